//! Deterministic parameter initialisation from candle-nn's [`Init`] hints.
//!
//! Candle's CPU random generator cannot be seeded, so a Candle program that wants reproducible
//! weights needs its own source. Here every parameter is drawn from its own stream,
//! `StdRng::seed_from_u64(seed ^ fnv1a64(name))`, so its values depend only on `(seed, name,
//! shape, hint)`: not on which process, rank or unit creates it, nor on creation order. The FSDP
//! runtime uses it to fill one unit at a time, and [`seeded_var_builder`] gives a plain,
//! single-process Candle program the very same weights (the reference for parity tests).
//!
//! The formulas are candle-nn's `Init::var` (`candle-nn/src/init.rs`), after PyTorch's
//! `torch.nn.init`: Kaiming std = gain / sqrt(fan), uniform bound = sqrt(3) * std.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// FNV-1a 64-bit hash of `s` (Fowler–Noll–Vo, public domain), used to derive per-name seeds.
pub fn fnv1a64(s: &str) -> u64 {
    fnv1a64_update(FNV1A64_OFFSET, s.as_bytes())
}

/// The FNV-1a 64-bit offset basis: the hash of no bytes.
pub(crate) const FNV1A64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Continues the FNV-1a 64-bit hash `h` over `bytes`.
pub(crate) fn fnv1a64_update(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The initial values (f32, row-major, `shape.elem_count()` of them) of parameter `name`.
pub fn init_values(name: &str, shape: &Shape, hint: Init, seed: u64) -> Vec<f32> {
    let n = shape.elem_count();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ fnv1a64(name));
    let uniform = |rng: &mut rand::rngs::StdRng, lo: f64, up: f64| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..up) as f32).collect()
    };
    let normal = |rng: &mut rand::rngs::StdRng, mean: f64, std: f64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let z: f64 = StandardNormal.sample(rng);
                (mean + std * z) as f32
            })
            .collect()
    };
    match hint {
        Init::Const(c) => vec![c as f32; n],
        Init::Uniform { lo, up } if lo < up => uniform(&mut rng, lo, up),
        Init::Uniform { lo, .. } => vec![lo as f32; n],
        Init::Randn { mean, stdev } => normal(&mut rng, mean, stdev),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let fan = fan.for_shape(shape).max(1);
            let std = non_linearity.gain() / (fan as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(&mut rng, -bound, bound)
                }
                NormalOrUniform::Normal => normal(&mut rng, 0.0, std),
            }
        }
    }
}

/// A [`SimpleBackend`] that creates each requested variable with [`init_values`] and keeps it in
/// a [`VarMap`] (so the usual `varmap.all_vars()` + candle-nn optimizer loop works).
struct SeededBackend {
    varmap: VarMap,
    seed: u64,
    // Serialises creation so that two threads asking for the same name get the same Var.
    lock: Arc<Mutex<()>>,
}

impl SimpleBackend for SeededBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let _g = self.lock.lock();
        let mut data = self.varmap.data().lock().unwrap();
        if let Some(v) = data.get(name) {
            if v.shape() != &s {
                candle_core::bail!(
                    "parameter {name}: requested shape {s:?} but it exists with shape {:?}",
                    v.shape()
                );
            }
            return Ok(v.as_tensor().clone());
        }
        let values = init_values(name, &s, h, self.seed);
        let var = Var::from_tensor(&Tensor::from_vec(values, s, dev)?.to_dtype(dtype)?)?;
        data.insert(name.to_string(), var.clone());
        Ok(var.into_inner())
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        let data = self.varmap.data().lock().unwrap();
        match data.get(name) {
            Some(v) => Ok(v.as_tensor().clone()),
            None => {
                candle_core::bail!("parameter {name} does not exist and has no shape to create it")
            }
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.data().lock().unwrap().contains_key(name)
    }
}

/// A `VarBuilder` for plain single-process Candle code whose variables are initialised exactly
/// as the FSDP runtime initialises them for the same `seed` (see the module docs), and stored in
/// `varmap`.
pub fn seeded_var_builder(
    varmap: &VarMap,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> VarBuilder<'static> {
    let backend = SeededBackend {
        varmap: varmap.clone(),
        seed,
        lock: Arc::new(Mutex::new(())),
    };
    VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
}

/// Reads every variable of `varmap` as f32 values, keyed by name (for comparisons in tests).
pub fn varmap_values(varmap: &VarMap) -> candle_core::Result<HashMap<String, Vec<f32>>> {
    let data = varmap.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| {
            Ok((
                k.clone(),
                v.as_tensor()
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            ))
        })
        .collect()
}
