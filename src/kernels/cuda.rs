//! Loading the kernels of [`super::SOURCES`] on a GPU: each module is compiled to PTX with NVRTC
//! once per process (cached), and loaded into a device's context once (Candle's per-device
//! module cache, [`CudaDevice::get_or_load_custom_func`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::CudaFunc;
use candle_core::CudaDevice;

use crate::error::{Error, Result};

/// Virtual architecture the PTX targets; the driver JIT-compiles it for the GPU at load
/// (sm_80 and later: bf16 arithmetic and the atomics the kernels use exist there).
const ARCH: &str = "compute_80";

fn ptx_cache() -> &'static Mutex<HashMap<&'static str, String>> {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, String>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The PTX of module `module` (compiled on first use).
///
/// Errors: no such module; NVRTC missing or the compile failing ([`Error::Cuda`] with NVRTC's
/// log).
pub fn ptx(module: &str) -> Result<String> {
    let (name, src) = super::SOURCES
        .iter()
        .find(|(n, _)| *n == module)
        .ok_or_else(|| Error::InvalidArgument(format!("no kernel module named {module:?}")))?;
    let mut cache = ptx_cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cache.get(name) {
        return Ok(p.clone());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(ARCH),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map_err(|e| Error::Cuda(format!("NVRTC compiling kernels/{name}.cu: {e}")))?
        .to_src();
    cache.insert(name, ptx.clone());
    Ok(ptx)
}

/// Function `function` of module `module` on `device` (launched on the device's compute
/// stream by [`CudaFunc::builder`]; use `stream.launch_builder(&func)` for another stream).
///
/// Errors: see [`ptx`]; the driver refusing the PTX or not finding the function.
pub fn func(device: &CudaDevice, module: &str, function: &str) -> Result<CudaFunc> {
    let ptx = ptx(module)?;
    device
        .get_or_load_custom_func(function, module, &ptx)
        .map_err(|e| Error::Cuda(format!("loading {module}::{function}: {e}")))
}
