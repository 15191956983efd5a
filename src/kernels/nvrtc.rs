//! Compiling and loading the kernels of [`super::SOURCES`] on a GPU (feature `cuda`).
//!
//! Each module is compiled to PTX with NVRTC once per process (cached), and loaded into a
//! device's context once (Candle's per-device module cache,
//! [`CudaDevice::get_or_load_custom_func`]) and handed out as a cudarc [`CudaFunction`]. NVRTC
//! options: `--gpu-architecture=compute_80`, `--fmad=false --ftz=false --prec-div=true
//! --prec-sqrt=true` (IEEE arithmetic without contraction, as the CPU loops of `crate::ops`).
//! The argument structs of [`super::plan`] are marked [`DeviceRepr`] here, so that a launch can
//! pass them by value.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::CudaDevice;
use cudarc::driver::{CudaFunction, DeviceRepr};

use super::plan::{AdamWArgs, CopyInArgs, CopyOutArgs, SgdArgs};
use crate::error::{Error, Result};

/// Virtual architecture the PTX targets; the driver JIT-compiles it for the GPU at load
/// (sm_80 and later: bf16 arithmetic, `__grid_constant__` parameters).
const ARCH: &str = "compute_80";

/// PTX per module, compiled once per process and kept for its lifetime (a few tens of KiB each),
/// so that a launch never copies it.
fn ptx_cache() -> &'static Mutex<HashMap<&'static str, &'static str>> {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, &'static str>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn ptx_static(module: &str) -> Result<&'static str> {
    let (name, src) = super::SOURCES
        .iter()
        .find(|(n, _)| *n == module)
        .ok_or_else(|| {
            Error::missing(
                format!("kernel module named {module:?}"),
                "the kernels are compiled from the crate's own modules",
            )
        })?;
    let mut cache = ptx_cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cache.get(name) {
        return Ok(p);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(ARCH),
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map_err(|e| Error::Cuda(format!("NVRTC compiling kernels/{name}.cu: {e}")))?
        .to_src();
    let ptx: &'static str = Box::leak(ptx.into_boxed_str());
    cache.insert(name, ptx);
    Ok(ptx)
}

/// The PTX of module `module` (compiled on first use).
///
/// Errors: no such module; NVRTC missing or the compile failing ([`Error::Cuda`] with NVRTC's
/// log).
pub fn ptx(module: &str) -> Result<String> {
    ptx_static(module).map(str::to_string)
}

/// Function `function` of module `module` on `device`, loaded into the device's context (once
/// per module). Launch it with `stream.launch_builder(&f)`: `device.cuda_stream()` is Candle's
/// compute stream.
///
/// Errors: see [`ptx`]; the driver refusing the PTX or not finding the function.
pub fn func(device: &CudaDevice, module: &str, function: &str) -> Result<CudaFunction> {
    let ptx = ptx_static(module)?;
    Ok(device
        .get_or_load_custom_func(function, module, ptx)
        .map_err(|e| Error::Cuda(format!("loading {module}::{function}: {e}")))?
        .into_cuda_function())
}

// SAFETY: plain `repr(C)` data of f32 fields, the layout of `struct AdamWArgs` in
// kernels/optim.cu (nine floats, 36 bytes, 4-byte aligned; sizes asserted in `plan`, and the
// PTX parameter list checked by tests/gpu/kernels.rs).
unsafe impl DeviceRepr for AdamWArgs {}

// SAFETY: plain `repr(C)` data, the layout of `struct SgdArgs` in kernels/optim.cu (four floats,
// two unsigned ints, 24 bytes).
unsafe impl DeviceRepr for SgdArgs {}

// SAFETY: plain `repr(C)` data (u64 and u32 fields, explicit padding), the layout of
// `struct CopyInArgs` in kernels/copy.cu: 2592 bytes, 8-byte aligned (asserted in `plan`; the
// PTX declares `.param .align 8 .b8 copy_in_param_1[2592]`).
unsafe impl DeviceRepr for CopyInArgs {}

// SAFETY: plain `repr(C)` data, the layout of `struct CopyOutArgs` in kernels/copy.cu: 1552
// bytes, 8-byte aligned.
unsafe impl DeviceRepr for CopyOutArgs {}
