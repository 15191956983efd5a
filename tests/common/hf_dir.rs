//! Synthetic Hugging Face Llama directories for tests: `config.json` and one
//! `model.safetensors` of random values in the dtype asked for.

use std::path::Path;

use candle_core::Device;
use candle_fsdp::hf::llama::{config_to_json, CONFIG_FILE};
use candle_fsdp::models::llama::{FsdpLlama, LlamaConfig};
use safetensors::Dtype;

/// Writes `dir/config.json` and `dir/model.safetensors` for `cfg`, every tensor filled with
/// small pseudo-random values (a fixed xorshift stream) stored as `dtype` (F32 or BF16).
/// Returns the weights file's size in bytes.
pub fn write_hf_llama(dir: &Path, cfg: &LlamaConfig, dtype: Dtype) -> u64 {
    std::fs::create_dir_all(dir).unwrap();
    let name = if dtype == Dtype::BF16 {
        "bfloat16"
    } else {
        "float32"
    };
    std::fs::write(
        dir.join(CONFIG_FILE),
        serde_json::to_string_pretty(&config_to_json(cfg, name)).unwrap(),
    )
    .unwrap();
    let params = FsdpLlama::new(*cfg)
        .unwrap()
        .spec()
        .record(&Device::Cpu)
        .unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    };
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = params
        .iter()
        .map(|p| {
            let n = p.shape.elem_count();
            let bytes: Vec<u8> = if dtype == Dtype::BF16 {
                (0..n)
                    .flat_map(|_| half::bf16::from_f32(next()).to_le_bytes())
                    .collect()
            } else {
                (0..n).flat_map(|_| next().to_le_bytes()).collect()
            };
            (p.name.clone(), p.shape.dims().to_vec(), bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).unwrap();
    std::fs::metadata(&path).unwrap().len()
}
