//! The NCCL process group (feature `nccl`). Placeholder, filled by the GPU-path work.
