//! The CUDA kernels of `kernels/` and their CPU references. Placeholder, filled by the GPU-path
//! work.
