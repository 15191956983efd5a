//! The decoder block node against the composed layers, per family and with LoRA adapters.

use super::*;
use candle_core::{Module, Var};
use candle_nn::{VarBuilder, VarMap};

use crate::models::decoder::{family::config_from_json, DecoderConfig};

thread_local! {
    /// Set by a test: the block composes its layers even in an armed call (the reference
    /// for what depends on the call, as LoRA's dropout).
    pub(super) static COMPOSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn config(fixture: &str) -> DecoderConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/models/fixtures")
        .join(fixture)
        .join("config.json");
    config_from_json(&std::fs::read_to_string(&path).unwrap(), &path).unwrap()
}

/// A seeded value per element, uniform in ±1.7·std around `mean`.
fn values(n: usize, mean: f32, std: f32, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let z = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            mean + (u - 0.5) * 3.4 * std
        })
        .collect()
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

/// The block of `fixture`'s layer `layer` with seeded weights (norms around 1, biases and
/// weights ±0.3), and its parameters.
fn block_of(fixture: &str, layer: usize) -> (DecoderConfig, Block, Vec<Var>) {
    block_with(fixture, layer, None)
}

/// [`block_of`] with LoRA adapters (`A`, `B` random too, so the adapters matter).
fn block_with(
    fixture: &str,
    layer: usize,
    lora: Option<&crate::lora::LoraConfig>,
) -> (DecoderConfig, Block, Vec<Var>) {
    let cfg = config(fixture);
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let blk = Block::with_lora(&cfg, layer, lora, vb).unwrap();
    let mut vars: Vec<(String, Var)> = map.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (name, v)) in vars.iter().enumerate() {
        let n = v.elem_count();
        let norm = name.contains("norm") && !name.contains("bias");
        // Gemma's norms store the offset from 1.
        let mean = if norm && !cfg.table().norm_offset {
            1.0
        } else {
            0.0
        };
        let t = Tensor::from_vec(
            values(n, mean, 0.3, 100 + i as u64),
            v.shape(),
            &Device::Cpu,
        )
        .unwrap();
        v.set(&t).unwrap();
    }
    (cfg, blk, vars.into_iter().map(|(_, v)| v).collect())
}

/// The one node's output, its input's gradient and every parameter's gradient (sent to the
/// runtime's sink) equal the composed layers' (Candle's autograd), for each family the node
/// covers: grouped-query heads, biases everywhere (Llama's `attention_bias` and `mlp_bias`;
/// Qwen2's q/k/v only), Mistral's window, Phi-3's fused projections, Qwen3's q/k norms, GPT-2 (the GPT's node over `Conv1D` weights), Gemma 2's sandwich
/// norms with the `1 + w` offset, soft-capped scores, its scale and GELU gate.
#[test]
fn one_node_decoder_block_matches_the_composed_layers() {
    for (fixture, layer) in CASES {
        node_matches_composed(fixture, layer, None);
    }
}

/// The families of [`one_node_decoder_block_matches_the_composed_layers`].
const CASES: [(&str, usize); 9] = [
    ("llama-tied", 0),
    ("llama-gqa", 1),
    ("family-mistral", 0),
    ("family-qwen2", 1),
    ("family-phi3", 0),
    ("family-gemma2", 0),
    ("family-gemma2", 1),
    ("family-qwen3", 0),
    ("family-gpt2", 1),
];

/// Packed examples (position ids restarting at each: the rotary tables per token, the
/// attention within each example; two sequences of 13 tokens, examples of 5 + 8 and 3 + 6 + 4
/// tokens): the node equals the composed layers too, window (Mistral: 5 keys; Gemma 2) and
/// soft-cap included. GPT-2's node attends over whole sequences: packed, it composes.
#[test]
fn one_node_block_over_packed_examples_matches_the_composed_layers() {
    let ids: Vec<u32> = [5u32, 8, 3, 6, 4].iter().flat_map(|&n| 0..n).collect();
    let ids = Tensor::from_vec(ids, (2, 13), &Device::Cpu).unwrap();
    let pos = Positions::new(&ids).unwrap();
    assert_eq!(
        pos.starts.to_vec2::<u32>().unwrap()[1],
        [0, 0, 0, 3, 3, 3, 3, 3, 3, 9, 9, 9, 9]
    );
    for (fixture, layer) in CASES {
        node_matches_composed(fixture, layer, Some(&pos));
    }
}

/// The node of `fixture`'s block `layer` against its composed layers on `(2, 13, d)` inputs at
/// `pos`: output, input gradient, every parameter's gradient.
fn node_matches_composed(fixture: &str, layer: usize, pos: Option<&Positions>) {
    {
        let (cfg, blk, vars) = block_of(fixture, layer);
        let (b, t, d) = (2, 13, cfg.hidden_size);
        let x = Var::from_vec(values(b * t * d, 0.0, 1.0, 7), (b, t, d), &Device::Cpu).unwrap();
        let r = Tensor::from_vec(values(b * t * d, 0.0, 1.0, 8), (b, t, d), &Device::Cpu).unwrap();
        assert!(
            block(&blk, x.as_tensor(), pos).unwrap().is_none(),
            "{fixture}: not armed"
        );
        let want = blk.forward_at(x.as_tensor(), pos).unwrap();
        let want_grads = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();

        let armed = fused::arm();
        let node = block(&blk, x.as_tensor(), pos).unwrap();
        if pos.is_some() && blk.attn.rope.is_none() {
            assert!(node.is_none(), "{fixture}: GPT-2 packed composes");
            return;
        }
        let got = node.unwrap_or_else(|| panic!("{fixture}: armed, one node"));
        assert!(
            vars.iter().all(|v| fused::promised(v.as_tensor())),
            "{fixture}"
        );
        drop(armed);
        let e = max_rel(&got, &want);
        assert!(e < 2e-5, "{fixture} layer {layer}: output {e}");
        let sink = fused::collect();
        let grads = (&got * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let sent = sink.finish();
        let dx = grads.get(x.as_tensor()).unwrap();
        let e = max_rel(dx, want_grads.get(x.as_tensor()).unwrap());
        assert!(e < 2e-5, "{fixture} layer {layer}: dx {e}");
        assert_eq!(
            sent.len(),
            vars.len(),
            "{fixture}: one gradient per parameter"
        );
        for v in &vars {
            let (_, g) = sent
                .iter()
                .find(|(p, _)| p.id() == v.as_tensor().id())
                .unwrap_or_else(|| panic!("{fixture}: a parameter's gradient not sent"));
            assert!(grads.get(v.as_tensor()).is_none(), "past Candle's graph");
            let e = max_rel(g, want_grads.get(v.as_tensor()).unwrap());
            assert!(
                e < 5e-5,
                "{fixture} layer {layer}: parameter {:?}: {e}",
                v.shape()
            );
        }
    }
}

/// With LoRA adapters and the base frozen (as `train_only` binds it), the node's output
/// and the input's and the adapters' gradients equal the composed layers', and it sends no
/// gradient for a frozen parameter: attention and MLP targets, separate and fused (Phi-3)
/// projections, rsLoRA's scale.
#[test]
fn one_node_block_with_lora_adapters_and_a_frozen_base() {
    use crate::lora::LoraConfig;
    let mut rs = LoraConfig::new(3, 6.0, ["qkv_proj", "o_proj", "down_proj"]);
    rs.rslora = true;
    let cases = [
        (
            "llama-tied",
            LoraConfig::new(
                2,
                4.0,
                ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
            ),
        ),
        (
            "family-qwen2",
            LoraConfig::new(4, 8.0, ["*.self_attn.*", "gate_proj"]),
        ),
        ("family-phi3", rs),
    ];
    for (fixture, lora) in cases {
        let (cfg, blk, vars) = block_with(fixture, 0, Some(&lora));
        let is_adapter = |v: &Var| {
            vars.iter()
                .position(|w| w.as_tensor().id() == v.as_tensor().id())
                .is_some_and(|_| v.rank() == 2)
        };
        let (b, t, d) = (2, 9, cfg.hidden_size);
        let x = Var::from_vec(values(b * t * d, 0.0, 1.0, 17), (b, t, d), &Device::Cpu).unwrap();
        let r = Tensor::from_vec(values(b * t * d, 0.0, 1.0, 18), (b, t, d), &Device::Cpu).unwrap();
        let want = blk.forward(x.as_tensor()).unwrap();
        let want_grads = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();
        // The adapters: the parameters named lora_A / lora_B, recognised by shape (rank r).
        let adapters: Vec<&Var> = vars
            .iter()
            .filter(|v| {
                is_adapter(v) && (v.dim(0).unwrap() == lora.r || v.dim(1).unwrap() == lora.r)
            })
            .collect();
        assert!(!adapters.is_empty(), "{fixture}");
        let frozen: Vec<Tensor> = vars
            .iter()
            .filter(|v| {
                !adapters
                    .iter()
                    .any(|a| a.as_tensor().id() == v.as_tensor().id())
            })
            .map(|v| v.as_tensor().clone())
            .collect();
        let armed = fused::arm_with_frozen(&frozen, 0);
        let got = block(&blk, x.as_tensor(), None)
            .unwrap()
            .expect("one node with adapters");
        drop(armed);
        let e = max_rel(&got, &want);
        assert!(e < 2e-5, "{fixture}: output {e}");
        let sink = fused::collect();
        let grads = (&got * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let sent = sink.finish();
        let e = max_rel(
            grads.get(x.as_tensor()).unwrap(),
            want_grads.get(x.as_tensor()).unwrap(),
        );
        assert!(e < 2e-5, "{fixture}: dx {e}");
        assert_eq!(
            sent.len(),
            adapters.len(),
            "{fixture}: gradients of the adapters only"
        );
        for a in &adapters {
            let (_, g) = sent
                .iter()
                .find(|(p, _)| p.id() == a.as_tensor().id())
                .unwrap();
            let e = max_rel(g, want_grads.get(a.as_tensor()).unwrap());
            assert!(e < 5e-5, "{fixture}: adapter {:?}: {e}", a.shape());
        }
    }
}

/// LoRA's dropout draws the same masks in the node and in the composed layers of the same armed
/// call (the node regenerates them in its backward): equal outputs and gradients; the masks
/// matter (another seed, or no dropout, gives another output); outside a training call there
/// is no dropout.
#[test]
fn lora_dropout_masks_are_the_calls_in_the_node_and_the_composed_layers() {
    use crate::lora::LoraConfig;
    let targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"];
    let mut lora = LoraConfig::new(3, 6.0, targets);
    lora.dropout = 0.3;
    let (cfg, blk, vars) = block_with("llama-gqa", 0, Some(&lora));
    let (_, plain, _) = block_with("llama-gqa", 0, Some(&LoraConfig::new(3, 6.0, targets)));
    let (b, t, d) = (2, 7, cfg.hidden_size);
    let x = Var::from_vec(values(b * t * d, 0.0, 1.0, 27), (b, t, d), &Device::Cpu).unwrap();
    let r = Tensor::from_vec(values(b * t * d, 0.0, 1.0, 28), (b, t, d), &Device::Cpu).unwrap();
    let composed = |seed: u64| {
        let armed = fused::arm_with_frozen(std::iter::empty(), seed);
        COMPOSE.with(|c| c.set(true));
        let y = blk.forward(x.as_tensor()).unwrap();
        COMPOSE.with(|c| c.set(false));
        drop(armed);
        y
    };
    let want = composed(11);
    let want_grads = (&want * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let armed = fused::arm_with_frozen(std::iter::empty(), 11);
    let got = block(&blk, x.as_tensor(), None).unwrap().expect("one node");
    drop(armed);
    let e = max_rel(&got, &want);
    assert!(e < 2e-5, "output {e}");
    let sink = fused::collect();
    let grads = (&got * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let sent = sink.finish();
    let e = max_rel(
        grads.get(x.as_tensor()).unwrap(),
        want_grads.get(x.as_tensor()).unwrap(),
    );
    assert!(e < 2e-5, "dx {e}");
    assert_eq!(sent.len(), vars.len());
    for v in &vars {
        let (_, g) = sent
            .iter()
            .find(|(p, _)| p.id() == v.as_tensor().id())
            .expect("sent");
        let e = max_rel(g, want_grads.get(v.as_tensor()).unwrap());
        assert!(e < 5e-5, "parameter {:?}: {e}", v.shape());
    }
    // The masks matter, and are the seed's.
    assert!(
        max_rel(&composed(12), &want) > 1e-3,
        "another seed, the same output"
    );
    let eval = blk.forward(x.as_tensor()).unwrap();
    assert!(max_rel(&eval, &want) > 1e-3, "dropout changed nothing");
    // Outside a training call: no dropout (the same block without it).
    let e = max_rel(&eval, &plain.forward(x.as_tensor()).unwrap());
    assert_eq!(e, 0.0, "evaluation applied dropout");
}

/// The mask keeps a fraction `1 − p` of the elements, scaled by `1 / (1 − p)`.
#[test]
fn lora_dropout_keeps_one_minus_p_of_the_elements() {
    let n = 200_000;
    for p in [0.05f32, 0.1, 0.5] {
        let mut v = vec![1f32; n];
        crate::lora::dropout_in_place(&mut v, p, 42);
        let kept = v.iter().filter(|&&x| x != 0.0).count() as f32 / n as f32;
        assert!((kept - (1.0 - p)).abs() < 0.005, "p {p}: kept {kept}");
        assert!(v.iter().all(|&x| x == 0.0 || x == 1.0 / (1.0 - p)));
    }
}
