//! LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
//! arXiv:2106.09685) on the linear layers of FSDP units, as PEFT defines them.
//!
//! A targeted linear layer `y = x·Wᵀ + b` (`W` `(out, in)`) gains two trainable matrices, `A`
//! `(r, in)` and `B` `(out, r)`, and computes
//!
//! ```text
//! y = x·Wᵀ + b + s · (x·Aᵀ)·Bᵀ        s = alpha / r   (rsLoRA: alpha / √r)
//! ```
//!
//! `A` starts Kaiming-uniform as PEFT's (`kaiming_uniform_(a = √5)`: uniform in `±1/√in`),
//! `B` at zero, so the adapted model starts as the base. The parameters are named as PEFT names
//! them under the module: `<module>.lora_A.weight`, `<module>.lora_B.weight` (PEFT's files add a
//! `base_model.model.` prefix, [`peft_name`]). With [`crate::FsdpModelBuilder::train_only`]`(`
//! [`TRAINABLE`]`)` everything else is frozen: the base weights are gathered but never
//! reduce-scattered and hold no optimizer state; only the adapters are reduced and stepped.
//!
//! The targets are PEFT's `target_modules`: a module is adapted when its full name equals a
//! target or ends with `.target` (`"q_proj"` adapts every layer's `…self_attn.q_proj`), or, for
//! a target with a glob character (`*`, `?`, `[`), when the glob matches the full name
//! (`"*.mlp.*"`). The decoder ([`crate::models::decoder::FsdpDecoder::with_lora`]) adapts its
//! projections; a user's unit uses [`linear`] (or [`LoraAdapter`] beside its own layer).

use candle_core::{Module, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsdp::fused::mix64 as mix;

/// The key under which a LoRA run's checkpoints store its [`LoraConfig`] (JSON), for the
/// export of the adapter (`fsdp-ckpt export --format peft`).
pub const LORA_CONFIG_KEY: &str = "lora_config";

/// The patterns of the adapters' parameters, for [`crate::FsdpModelBuilder::train_only`].
pub const TRAINABLE: [&str; 2] = ["*.lora_A.weight", "*.lora_B.weight"];

/// What to adapt and how: PEFT's `LoraConfig` fields of the same names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` of the update (≥ 1).
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / √r` with `rslora`).
    pub alpha: f64,
    /// `target_modules`: module names (or name suffixes, or globs) to adapt.
    pub targets: Vec<String>,
    /// rsLoRA's scaling `alpha / √r` (Kalajdzievski 2023, arXiv:2312.03732; PEFT's
    /// `use_rslora`).
    #[serde(default)]
    pub rslora: bool,
    /// `lora_dropout`: the probability with which each element of an adapter's input is
    /// zeroed (the rest scaled by `1 / (1 − p)`) in a training call of the FSDP runtime (as
    /// PEFT's `nn.Dropout` before `lora_A`); evaluation and plain Candle run without it. In
    /// `[0, 1)`. The masks are a counter-based hash of the call's seed
    /// ([`crate::fsdp::fused::call_seed`]), the module's name and the element's index
    /// ([`dropout_keep`]), so a recomputation (activation checkpointing) and the fused and
    /// composed paths draw the same mask.
    #[serde(default)]
    pub dropout: f64,
}

impl LoraConfig {
    /// Rank `r`, `alpha`, the target modules; no rsLoRA, no dropout.
    pub fn new(r: usize, alpha: f64, targets: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            r,
            alpha,
            targets: targets
                .into_iter()
                .map(|t| t.into().trim().to_string())
                .collect(),
            rslora: false,
            dropout: 0.0,
        }
    }

    /// The update's scale `s`: `alpha / r`, or `alpha / √r` with `rslora`.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Checks the values.
    ///
    /// Errors, naming the field: `r` of 0, an `alpha` not finite and positive, no target, an
    /// invalid glob, a dropout outside `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, expected: String, found: String| {
            Err(Error::value(format!("LoRA: {what}"), expected, found))
        };
        if self.r == 0 {
            return bad("r (the rank)", "at least 1".into(), "0".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(
                "alpha",
                "finite and positive".into(),
                self.alpha.to_string(),
            );
        }
        if self.targets.is_empty() {
            return Err(Error::missing(
                "target module (e.g. q_proj, v_proj)",
                "LoRA adapts the modules its targets name",
            ));
        }
        for t in &self.targets {
            if t.is_empty() {
                return bad("a target module name", "non-empty".into(), "\"\"".into());
            }
            if is_glob(t) {
                if let Err(e) = glob::Pattern::new(t) {
                    return Err(Error::InvalidArgument(format!(
                        "LoRA: target {t:?} is not a valid glob: {e}"
                    )));
                }
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(
                "dropout",
                "in [0, 1) (the probability of zeroing an input element)".into(),
                self.dropout.to_string(),
            );
        }
        Ok(())
    }

    /// PEFT's `adapter_config.json` of this config (`peft_type` LORA, `task_type` CAUSAL_LM, `r`,
    /// `lora_alpha`, `lora_dropout`, `target_modules`, `use_rslora`, `bias` "none",
    /// `base_model_name_or_path`).
    ///
    /// `target_modules` is the list of targets; when a target is a glob (which PEFT does not
    /// know), the full names of the modules that were adapted, `adapted` (PEFT matches a full
    /// name exactly: a regular expression from the glob would also match modules that are not
    /// linear layers, such as `mlp.act_fn`, which PEFT refuses). `fan_in_fan_out` is true for
    /// `Conv1D` weights (GPT-2).
    pub fn peft_config(
        &self,
        base_model: Option<&str>,
        fan_in_fan_out: bool,
        adapted: &[String],
    ) -> serde_json::Value {
        let targets = if self.targets.iter().any(|t| is_glob(t)) {
            let mut names = adapted.to_vec();
            names.sort();
            names.dedup();
            serde_json::Value::from(names)
        } else {
            serde_json::Value::from(self.targets.clone())
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "use_rslora": self.rslora,
            "bias": "none",
            "fan_in_fan_out": fan_in_fan_out,
            "inference_mode": true,
            "base_model_name_or_path": base_model,
        })
    }

    /// Whether the module named `name` (its full name, e.g.
    /// `model.layers.0.self_attn.q_proj`) is a target.
    pub fn targets_module(&self, name: &str) -> bool {
        self.targets.iter().any(|t| {
            if is_glob(t) {
                glob::Pattern::new(t).is_ok_and(|p| p.matches(name))
            } else {
                name == t || name.ends_with(&format!(".{t}"))
            }
        })
    }
}

fn is_glob(t: &str) -> bool {
    t.contains(['*', '?', '['])
}

/// The name PEFT's `adapter_model.safetensors` gives parameter `name` (`base_model.model.` +
/// the name): `model.layers.0.self_attn.q_proj.lora_A.weight` →
/// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
pub fn peft_name(name: &str) -> String {
    format!("base_model.model.{name}")
}

/// The low-rank update of one linear layer: `A` `(r, in)`, `B` `(out, r)`, the scale, and the
/// dropout on its input.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f32,
    /// A hash of the module's name: its masks differ from other modules' in the same call.
    key: u64,
}

impl LoraAdapter {
    /// The adapter of a linear layer `in_dim → out_dim` under the layer's `vb` (parameters
    /// `lora_A.weight` `(r, in_dim)`, Kaiming-uniform `±1/√in_dim`, and `lora_B.weight` `(out_dim,
    /// r)`, zero).
    ///
    /// Errors: Candle's (a shape that differs from one already recorded under the name).
    pub fn new(
        in_dim: usize,
        out_dim: usize,
        cfg: &LoraConfig,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let bound = 1.0 / (in_dim.max(1) as f64).sqrt();
        let a = vb.pp("lora_A").get_with_hints(
            (cfg.r, in_dim),
            "weight",
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?;
        let b = vb
            .pp("lora_B")
            .get_with_hints((out_dim, cfg.r), "weight", Init::Const(0.0))?;
        // FNV-1a of the module's name.
        let key = vb.prefix().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, c| {
            (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3)
        });
        Ok(Self {
            a,
            b,
            scale: cfg.scale(),
            dropout: cfg.dropout as f32,
            key,
        })
    }

    /// The adapter for the module under `vb` when `cfg` targets it (its full name is
    /// `vb.prefix()`), else `None`.
    pub fn for_module(
        in_dim: usize,
        out_dim: usize,
        cfg: Option<&LoraConfig>,
        vb: &VarBuilder,
    ) -> candle_core::Result<Option<Self>> {
        match cfg {
            Some(c) if c.targets_module(&vb.prefix()) => {
                Self::new(in_dim, out_dim, c, vb.clone()).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The update `s · (drop(x)·Aᵀ)·Bᵀ` for `x` `(…, in)`: `(…, out)`; `drop` is the identity
    /// outside a training call ([`LoraAdapter::dropout_now`]).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = match self.dropout_now() {
            Some((p, seed)) => {
                let n = x.elem_count();
                let mask: Vec<f32> = (0..n).map(|i| dropout_factor(seed, i, p)).collect();
                let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
                x.mul(&mask)?
            }
            None => x.clone(),
        };
        let xa = crate::nn::linear_forward(&x, &self.a, None)?;
        crate::nn::linear_forward(&xa, &self.b, None)?.affine(self.scale, 0.0)
    }

    /// In a training call of the FSDP runtime with a dropout `p > 0`: `p` and this module's
    /// mask seed for the call (the call's seed mixed with the module's name); else `None`.
    pub fn dropout_now(&self) -> Option<(f32, u64)> {
        if self.dropout <= 0.0 {
            return None;
        }
        crate::fsdp::fused::call_seed().map(|s| (self.dropout, mix(s ^ self.key)))
    }

    /// `A` `(r, in)`.
    pub fn a(&self) -> &Tensor {
        &self.a
    }

    /// `B` `(out, r)`.
    pub fn b(&self) -> &Tensor {
        &self.b
    }

    /// The scale `s`.
    pub fn scale(&self) -> f64 {
        self.scale
    }
}

/// Whether element `i` of an adapter input survives dropout `p` under mask seed `seed`: the
/// top 24 bits of a hash of `(seed, i)` as a uniform number in `[0, 1)`, kept when `≥ p`.
pub fn dropout_keep(seed: u64, i: usize, p: f32) -> bool {
    let u = (mix(seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)) >> 40) as f32
        / (1u64 << 24) as f32;
    u >= p
}

/// The factor of element `i`: `1 / (1 − p)` when kept ([`dropout_keep`]), else 0.
pub fn dropout_factor(seed: u64, i: usize, p: f32) -> f32 {
    if dropout_keep(seed, i, p) {
        1.0 / (1.0 - p)
    } else {
        0.0
    }
}

/// `x ⊙ mask` for the mask of `(p, seed)` over `x`'s elements in order (the forward, and the
/// backward of the input's gradient), split over rayon's pool for large inputs.
pub fn dropout_in_place(x: &mut [f32], p: f32, seed: u64) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 14;
    x.par_chunks_mut(CHUNK).enumerate().for_each(|(c, xs)| {
        for (j, v) in xs.iter_mut().enumerate() {
            *v *= dropout_factor(seed, c * CHUNK + j, p);
        }
    });
}

/// A linear layer with an optional LoRA adapter: [`linear`].
#[derive(Debug, Clone)]
pub struct LoraLinear {
    base: crate::nn::Linear,
    adapter: Option<LoraAdapter>,
}

impl LoraLinear {
    /// The adapter, when the layer is a target.
    pub fn adapter(&self) -> Option<&LoraAdapter> {
        self.adapter.as_ref()
    }
}

impl Module for LoraLinear {
    /// `x·Wᵀ (+ b)`, plus the adapter's update when there is one; `x` `(…, in)`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.base.forward(x)?;
        match &self.adapter {
            Some(a) => y + a.forward(x)?,
            None => Ok(y),
        }
    }
}

/// A candle-nn style linear layer `in_dim → out_dim` (`weight` `(out, in)` initialised as
/// `candle_nn::linear`, `bias` when asked) under `vb`, adapted when `cfg` targets the module
/// (its full name `vb.prefix()`): the drop-in for `candle_nn::linear` in a user's unit.
///
/// Errors: Candle's.
pub fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    cfg: Option<&LoraConfig>,
    vb: VarBuilder,
) -> candle_core::Result<LoraLinear> {
    let base = if bias {
        crate::nn::linear(in_dim, out_dim, vb.clone())?
    } else {
        let init = candle_nn::init::DEFAULT_KAIMING_NORMAL;
        let w = vb.get_with_hints((out_dim, in_dim), "weight", init)?;
        crate::nn::Linear::new(w, None)
    };
    Ok(LoraLinear {
        adapter: LoraAdapter::for_module(in_dim, out_dim, cfg, &vb)?,
        base,
    })
}

/// The full names of the adapted modules among parameter names (`….lora_A.weight` → `…`).
pub fn adapted_modules<'a>(params: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut v: Vec<String> = params
        .into_iter()
        .filter_map(|n| n.strip_suffix(".lora_A.weight").map(String::from))
        .collect();
    v.sort();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_as_peft_names_suffixes_and_globs() {
        let c = LoraConfig::new(4, 8.0, ["q_proj", "*.mlp.*"]);
        assert!(c.targets_module("model.layers.0.self_attn.q_proj"));
        assert!(c.targets_module("q_proj"));
        assert!(!c.targets_module("model.layers.0.self_attn.xq_proj"));
        assert!(!c.targets_module("model.layers.0.self_attn.k_proj"));
        assert!(c.targets_module("model.layers.1.mlp.down_proj"));
        assert_eq!(c.scale(), 2.0);
        let mut rs = c.clone();
        rs.rslora = true;
        assert_eq!(rs.scale(), 4.0);
        let e = LoraConfig::new(4, 8.0, ["[q"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a valid glob"), "{e}");
        let e = LoraConfig::new(4, f64::NAN, ["q"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("alpha must be finite and positive"), "{e}");
        let e = LoraConfig::new(4, 8.0, Vec::<String>::new())
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("no target module"), "{e}");
        // Targets are trimmed (a list written with spaces after its commas).
        assert_eq!(LoraConfig::new(4, 8.0, [" v_proj "]).targets, ["v_proj"]);
    }

    /// PEFT knows no globs: with a glob among the targets the config written for PEFT lists
    /// the adapted modules' full names (a regular expression from the glob would also match
    /// `mlp.act_fn`, which PEFT refuses to adapt); a plain list of names otherwise.
    #[test]
    fn peft_config_lists_the_adapted_modules_for_globs() {
        let c = LoraConfig::new(4, 8.0, ["q_proj", "*.mlp.*", "layers.[01].o_proj"]);
        let adapted = vec!["model.layers.0.mlp.up_proj".to_string()];
        assert_eq!(
            c.peft_config(None, false, &adapted)["target_modules"],
            serde_json::json!(adapted)
        );
        let plain = LoraConfig::new(4, 8.0, ["q_proj", "v_proj"]);
        let v = plain.peft_config(Some("base"), true, &[]);
        assert_eq!(v["target_modules"], serde_json::json!(["q_proj", "v_proj"]));
        assert_eq!(v["fan_in_fan_out"], true);
        assert_eq!(v["base_model_name_or_path"], "base");
    }

    /// A user's unit of [`linear`] layers under `train_only(TRAINABLE)`: the adapted layer
    /// starts as its base (B = 0), only the adapters get gradients and change, the base's
    /// values stay bit for bit, at world size 2.
    #[test]
    fn a_users_unit_trains_only_its_adapters() {
        use crate::launch::{launch, Launcher};
        use crate::{FsdpConfig, FsdpModel, Sgd, SgdConfig, ShardedOptimizer};
        let cfg = LoraConfig::new(2, 4.0, ["fc1"]);
        let out = launch(&Launcher::threads(2), |pg| {
            let c = cfg.clone();
            let mut model = FsdpModel::builder(pg, FsdpConfig::default())
                .unit("mlp", move |vb| {
                    let fc1 = linear(6, 8, true, Some(&c), vb.pp("fc1"))?;
                    let fc2 = linear(8, 3, false, Some(&c), vb.pp("fc2"))?;
                    assert!(fc1.adapter().is_some() && fc2.adapter().is_none());
                    Ok(candle_nn::seq().add(fc1).add(fc2))
                })
                .train_only(TRAINABLE)
                .build()?;
            let x = Tensor::ones((5, 6), candle_core::DType::F32, &candle_core::Device::Cpu)?;
            let before = model.gather_full_params(false)?.expect("every rank");
            let y0 = model.forward(&x)?;
            model.backward(&y0.sqr()?.sum_all()?)?;
            let mut opt = Sgd::new(SgdConfig {
                lr: 0.1,
                ..Default::default()
            });
            opt.step(&mut model)?;
            let after = model.gather_full_params(false)?.expect("every rank");
            Ok((before, after))
        })
        .unwrap();
        let (before, after) = &out[0];
        let get = |v: &[(String, Tensor)], n: &str| -> Vec<f32> {
            let t = &v.iter().find(|(m, _)| m == n).unwrap().1;
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        for n in ["mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight"] {
            assert_eq!(get(before, n), get(after, n), "frozen {n} changed");
        }
        assert!(get(before, "mlp.fc1.lora_B.weight")
            .iter()
            .all(|&v| v == 0.0));
        assert!(
            get(after, "mlp.fc1.lora_B.weight")
                .iter()
                .any(|&v| v != 0.0),
            "B got a gradient and moved"
        );
        let a = get(before, "mlp.fc1.lora_A.weight");
        let bound = 1.0 / 6f32.sqrt();
        assert!(a.iter().all(|v| v.abs() <= bound) && a.iter().any(|&v| v != 0.0));
    }
}
