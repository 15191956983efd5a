//! The CUDA kernels of `kernels/` (CUDA C, compiled at run time with NVRTC, so a build needs no
//! CUDA toolkit) and their CPU references.
//!
//! Every kernel has a CPU reference here, written as plain loops over host slices with the same
//! arithmetic in the same order; the GPU tests (`tests/gpu/`, run by `scripts/gpu-check.sh`)
//! compare each kernel against its reference. The sources are embedded in the binary
//! ([`SOURCES`]) and compiled once per process, loaded once per device ([`cuda`], feature
//! `cuda`).

#[cfg(feature = "cuda")]
pub mod cuda;

/// The kernel sources, `(module name, CUDA C source)`: one module per file of `kernels/`.
/// The sources include no header (NVRTC then needs no include path): bf16 and f16 are handled
/// as 16-bit patterns with explicit conversions.
pub const SOURCES: &[(&str, &str)] = &[];
