//! Mixed-precision policy: plain data, after PyTorch FSDP's `MixedPrecision` /
//! FSDP2's `MixedPrecisionPolicy`.
//!
//! What each dtype governs in a step (master shards, gradient shards and optimizer state are
//! f32 always):
//! - `param_dtype`: the local f32 shard is cast to it *before* the all-gather (so the wire and
//!   the gathered buffer carry 2 bytes an element for bf16/f16), and the unit computes in it.
//! - `reduce_dtype`: the flat gradient is cast to it before the reduce-scatter; the reduced shard
//!   is widened back and accumulated into the f32 gradient shard.
//! - `buffer_dtype`: dtype in which buffers (running statistics) are kept.
//! - `cast_forward_inputs`: floating-point unit inputs are cast to the unit's `param_dtype`.

use candle_core::DType;

use crate::error::{Error, Result};

/// A mixed-precision policy (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MixedPrecision {
    /// All-gather and compute dtype (F32, BF16 or F16).
    #[serde(with = "dtype_name")]
    pub param_dtype: DType,
    /// Gradient reduce-scatter dtype (F32, BF16 or F16).
    #[serde(with = "dtype_name")]
    pub reduce_dtype: DType,
    /// Buffer dtype (F32, BF16 or F16).
    #[serde(with = "dtype_name")]
    pub buffer_dtype: DType,
    /// Cast floating-point unit inputs to `param_dtype`.
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        Self::full_f32()
    }
}

impl MixedPrecision {
    /// Everything in f32 (the default).
    pub fn full_f32() -> Self {
        Self {
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
            buffer_dtype: DType::F32,
            cast_forward_inputs: true,
        }
    }

    /// bf16 all-gather, compute and reduce-scatter; f32 buffers.
    pub fn bf16() -> Self {
        Self {
            param_dtype: DType::BF16,
            reduce_dtype: DType::BF16,
            ..Self::full_f32()
        }
    }

    /// f16 all-gather, compute and reduce-scatter; f32 buffers. Use with
    /// [`crate::grad_scaler::ShardedGradScaler`].
    pub fn f16() -> Self {
        Self {
            param_dtype: DType::F16,
            reduce_dtype: DType::F16,
            ..Self::full_f32()
        }
    }

    /// bf16 all-gather and compute, f32 gradient reduce-scatter.
    pub fn bf16_compute_f32_reduce() -> Self {
        Self {
            param_dtype: DType::BF16,
            ..Self::full_f32()
        }
    }

    /// Parses a preset name: `f32`, `bf16`, `f16`, `bf16-f32-reduce`.
    pub fn from_name(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().replace('_', "-").as_str() {
            "f32" | "fp32" => Ok(Self::full_f32()),
            "bf16" => Ok(Self::bf16()),
            "f16" | "fp16" => Ok(Self::f16()),
            "bf16-f32-reduce" => Ok(Self::bf16_compute_f32_reduce()),
            other => Err(Error::value(
                "precision",
                "f32, bf16, f16 or bf16-f32-reduce",
                format!("{other:?}"),
            )),
        }
    }

    /// Checks that every dtype is F32, BF16 or F16.
    pub fn validate(&self) -> Result<()> {
        for (what, d) in [
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
            ("buffer_dtype", self.buffer_dtype),
        ] {
            if !matches!(d, DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::dtype(
                    format!("mixed precision {what}"),
                    "f32, bf16 or f16",
                    d,
                ));
            }
        }
        Ok(())
    }

    /// True when any dtype is f16 (a gradient scaler is then advisable).
    pub fn uses_f16(&self) -> bool {
        self.param_dtype == DType::F16 || self.reduce_dtype == DType::F16
    }
}

mod dtype_name {
    use candle_core::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = String::deserialize(d)?;
        name.parse::<DType>()
            .map_err(|_| serde::de::Error::custom(format!("unknown dtype {name}")))
    }
}
