//! The models users fine-tune: the one decoder's families (Llama, Mistral, Qwen2, Qwen3, Phi-3,
//! Gemma 2, GPT-2) against transformers' numbers, Hugging Face model directories in (single
//! file, sharded index, errors, per-rank memory) and out (`fsdp-ckpt export --format hf`).
//!
//! The fixtures under `tests/models/fixtures/` are tiny random models with what transformers
//! computed: `llama-*` `LlamaForCausalLM`s written by `scripts/make-hf-fixture.py`, `family-*`
//! one per family by `scripts/make-hf-family-fixture.py`; the `resolve-*` ones, by
//! `scripts/make-hf-resolve-fixture.py`, with what transformers' `from_pretrained` decided;
//! `lora-llama` a PEFT adapter on `llama-gqa` with PEFT's numbers, by
//! `scripts/make-peft-fixture.py`.

#[path = "../common/mod.rs"]
mod common;

mod adapter_ckpt;
mod example;
mod families;
mod hf_export;
mod hf_load;
mod hf_resolve;
mod llama;
mod lora;
mod packed;
mod qlora;
mod sft;

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use candle_fsdp::checkpoint::ReadStats;
use candle_fsdp::hf::weights::HfWeights;

/// The fixture directory `name` (e.g. `llama-mha`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/models/fixtures")
        .join(name)
}

/// The inputs `(B, T)` and targets `(B, T)` u32 of a fixture's `expected.json`.
pub fn inputs(name: &str) -> (Tensor, Tensor) {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = |k: &str| -> Vec<Vec<u32>> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect()
    };
    let t = |r: Vec<Vec<u32>>| Tensor::new(r, &Device::Cpu).unwrap();
    (t(rows("inputs")), t(rows("targets")))
}

/// Tensor `name` of a fixture's `expected.safetensors`, as f32 values.
pub fn expected(fixture_name: &str, name: &str) -> Vec<f32> {
    let w = ExpectedFile::open(fixture_name);
    w.get(name)
}

/// A fixture's `expected.safetensors` (its bytes).
pub struct ExpectedFile(Vec<u8>);

impl ExpectedFile {
    pub fn open(fixture_name: &str) -> Self {
        Self(std::fs::read(fixture(fixture_name).join("expected.safetensors")).unwrap())
    }

    pub fn names(&self) -> Vec<String> {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        st.names().into_iter().map(String::from).collect()
    }

    pub fn get(&self, name: &str) -> Vec<f32> {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Every tensor of a Hugging Face directory's weights, as f32 (name, shape, values), sorted.
pub fn weights_of(dir: &std::path::Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let w = HfWeights::open(dir, &mut ReadStats::default()).unwrap();
    w.names()
        .map(|n| {
            let shape = w.shape(n).unwrap().to_vec();
            let numel = shape.iter().product();
            let mut v = vec![0.0; numel];
            w.read_f32(n, 0..numel, &mut v, &mut ReadStats::default())
                .unwrap();
            (n.to_string(), shape, v)
        })
        .collect()
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
