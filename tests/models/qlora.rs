//! A packed frozen base (`FsdpConfig::frozen_storage`, `--base-dtype`): the int8 and NF4 bytes
//! against bitsandbytes' (`scripts/make-quant-fixture.py`), the LoRA-adapted `llama-gqa` on a
//! bf16 / int8 / NF4 base at world sizes 1, 2, 3 against the same model computed with the
//! dequantised weights in f32, a 20-step LoRA run on each base, and a checkpoint of a packed
//! run resumed bit-exact at another world size.

use candle_core::{DType, Device, Tensor};
use candle_fsdp::checkpoint::{load_sharded, save_sharded, TrainState};
use candle_fsdp::hf::decoder::{build_from_hf_with, HfOptions};
use candle_fsdp::hf::peft::load_peft_adapter;
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::lora::LoraConfig;
use candle_fsdp::models::decoder::lm_loss;
use candle_fsdp::quant::{pack, unpack, BaseDType, QUANT_BLOCK};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, ShardedOptimizer};

use super::common::{tmpdir, to_vec};
use super::{fixture, inputs, max_abs_diff, weights_of};

const ADAPTER: &str = "lora-llama";
const BASE: &str = "llama-gqa";

fn opts() -> HfOptions {
    HfOptions {
        activation_checkpointing: false,
        lora: Some(LoraConfig::new(
            4,
            8.0,
            ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"].map(String::from),
        )),
    }
}

fn config(storage: BaseDType) -> FsdpConfig {
    FsdpConfig {
        frozen_storage: storage,
        ..FsdpConfig::default()
    }
}

fn le_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn int8_and_nf4_bytes_equal_bitsandbytes() {
    let bytes = std::fs::read(fixture("quant").join("quant.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let raw = |n: &str| st.tensor(n).unwrap().data().to_vec();
    let x = le_f32(&raw("input"));
    assert_eq!(x.len() % QUANT_BLOCK, 0);
    for (format, name) in [(BaseDType::Int8, "int8"), (BaseDType::Nf4, "nf4")] {
        let mut ours = vec![0u8; format.packed_bytes(x.len())];
        pack(format, &x, &mut ours).unwrap();
        // Our layout is bitsandbytes' codes followed by its absmax, byte for byte.
        let mut theirs = raw(&format!("{name}.codes"));
        theirs.extend(raw(&format!("{name}.absmax")));
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        assert_eq!(first, None, "{name}: first differing byte");
        let mut values = vec![0f32; x.len()];
        unpack(format, &ours, &mut values).unwrap();
        let want = le_f32(&raw(&format!("{name}.dequant")));
        let same = values
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: dequantised values differ from bitsandbytes'");
        for (xb, vb) in x.chunks(QUANT_BLOCK).zip(values.chunks(QUANT_BLOCK)) {
            let absmax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = max_abs_diff(xb, vb);
            assert!(
                err <= format.error_bound(absmax),
                "{name}: error {err} over the bound {} (absmax {absmax})",
                format.error_bound(absmax)
            );
        }
    }
}

/// Every weight that is not an adapter, gathered (name, shape, values).
type Weights = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Builds the adapted `llama-gqa` at `ws` with the base stored in `storage`; returns rank 0's
/// logits, its gathered base weights and its sharded bytes.
fn adapted(ws: usize, storage: BaseDType, base: &std::path::Path) -> (Vec<f32>, Weights, usize) {
    let (ids, _) = inputs(BASE);
    let base = base.to_path_buf();
    let out = launch(&Launcher::threads(ws), move |pg| {
        let (decoder, mut model, _) = build_from_hf_with(pg, config(storage), &base, &opts())?;
        load_peft_adapter(&fixture(ADAPTER), &mut model)?;
        let logits = to_vec(&decoder.logits(&mut model, &ids, false)?);
        let bytes = model.memory_stats().sharded_bytes;
        let params = model.gather_full_params(false)?.expect("every rank");
        let weights = params
            .iter()
            .filter(|(n, _)| !n.contains(".lora_"))
            .map(|(n, t)| (n.clone(), t.dims().to_vec(), to_vec(t)))
            .collect::<Weights>();
        Ok((logits, weights, bytes))
    })
    .unwrap();
    let mut first = out.into_iter().next().unwrap();
    first.1.sort_by(|a, b| a.0.cmp(&b.0));
    first
}

/// A Hugging Face directory: `llama-gqa`'s config with `weights` in f32.
fn write_hf(dir: &std::path::Path, weights: &Weights) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture(BASE).join("config.json"), dir.join("config.json")).unwrap();
    let tensors: Vec<(String, Tensor)> = weights
        .iter()
        .map(|(n, s, v)| {
            (
                n.clone(),
                Tensor::from_vec(v.clone(), s.clone(), &Device::Cpu).unwrap(),
            )
        })
        .collect();
    candle_core::safetensors::save(
        &tensors
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
        dir.join("model.safetensors"),
    )
    .unwrap();
}

#[test]
fn a_packed_base_computes_with_its_dequantised_weights_at_world_sizes_1_2_3() {
    let root = tmpdir("qlora-parity");
    let f32_base = weights_of(&fixture(BASE));
    let absmax = f32_base
        .iter()
        .flat_map(|(_, _, v)| v.iter())
        .fold(0f32, |m, v| m.max(v.abs()));
    let (_, _, f32_bytes) = adapted(2, BaseDType::F32, &fixture(BASE));
    for storage in [BaseDType::Bf16, BaseDType::Int8, BaseDType::Nf4] {
        let (logits1, weights1, _) = adapted(1, storage, &fixture(BASE));
        // The dequantised base is within the format's bound of the f32 one (a block may span
        // two tensors, so the bound uses the largest weight of the model); the fixture's weights
        // are bf16 in the file, so a bf16 base is the file's exactly.
        let mut moved = 0;
        for ((n, _, got), (m, _, want)) in weights1.iter().zip(&f32_base) {
            assert_eq!(n, m);
            for (g, w) in got.iter().zip(want) {
                let bound = if storage == BaseDType::Bf16 {
                    w.abs()
                } else {
                    absmax
                };
                assert!(
                    (g - w).abs() <= storage.error_bound(bound),
                    "{storage:?} {n}: {w} -> {g}"
                );
            }
            moved += usize::from(max_abs_diff(got, want) > 0.0);
        }
        let exact = storage == BaseDType::Bf16;
        assert_eq!(moved == 0, exact, "{storage:?}: {moved} tensors moved");
        // The same model in f32 from the dequantised weights: what the packed run must compute.
        let dir = root.join(storage.name());
        write_hf(&dir, &weights1);
        let (reference, _, _) = adapted(1, BaseDType::F32, &dir);
        for ws in [1, 2, 3] {
            let (logits, weights, bytes) = adapted(ws, storage, &fixture(BASE));
            // Blocks sit at the same flat offsets whatever the world size: the same base.
            assert!(
                weights == weights1,
                "{storage:?} ws {ws}: another dequantised base"
            );
            let d = max_abs_diff(&logits, &reference);
            assert!(
                d < 2e-5,
                "{storage:?} ws {ws}: logits {d} from the dequantised f32 model"
            );
            let d = max_abs_diff(&logits, &logits1);
            assert!(d < 2e-5, "{storage:?} ws {ws}: logits {d} from ws 1's");
            if ws == 2 {
                assert!(
                    bytes < f32_bytes,
                    "{storage:?}: {bytes} sharded bytes, f32 {f32_bytes}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Losses of 20 AdamW steps of the adapters on the fixture's batch at world size 2.
fn twenty_steps(storage: BaseDType) -> Vec<f32> {
    let (ids, targets) = inputs(BASE);
    let out = launch(&Launcher::threads(2), move |pg| {
        let (decoder, mut model, _) =
            build_from_hf_with(pg, config(storage), &fixture(BASE), &opts())?;
        let mut opt = AdamW::new(AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        });
        let mut losses = vec![];
        for _ in 0..20 {
            let logits = decoder.logits(&mut model, &ids, true)?;
            let loss = lm_loss(&logits, &targets)?;
            losses.push(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            model.backward(&loss)?;
            opt.step(&mut model)?;
        }
        Ok(losses)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn twenty_lora_steps_on_int8_and_nf4_bases_end_near_the_bf16_base_run() {
    let bf16 = twenty_steps(BaseDType::Bf16);
    let int8 = twenty_steps(BaseDType::Int8);
    let nf4 = twenty_steps(BaseDType::Nf4);
    // Measured (hidden 32, so quantisation noise is large): the runs fall from 4.85 / 4.85 /
    // 4.80 to 2.09 / 2.15 / 2.15; the stated distance at step 20 is 0.1 for int8 and 0.15 for
    // NF4 (a broken dequantisation lands nowhere near: the base would be another model).
    for (name, run, tol) in [
        ("bf16", &bf16, 0.0),
        ("int8", &int8, 0.1),
        ("nf4", &nf4, 0.15),
    ] {
        assert!(
            run[19] < run[0] - 2.0,
            "{name}: the adapters did not learn ({} -> {})",
            run[0],
            run[19]
        );
        let d = (run[19] - bf16[19]).abs();
        assert!(
            d <= tol,
            "{name}: final loss {} vs bf16's {}: {d} > {tol}",
            run[19],
            bf16[19]
        );
    }
}

#[test]
fn a_packed_base_checkpoint_resumes_bit_exact_at_another_world_size() {
    let root = tmpdir("qlora-ckpt");
    let (ids, targets) = inputs(BASE);
    for storage in [BaseDType::Int8, BaseDType::Nf4] {
        let ckpt_root = root.join(storage.name());
        // One step at world size 2, saved; then the next step's forward. A resume at world
        // size 3 must hold the same parameters (adapters and packed base) and compute the same
        // loss, bit for bit.
        let saved = launch(&Launcher::threads(2), |pg| {
            let (decoder, mut model, _) =
                build_from_hf_with(pg, config(storage), &fixture(BASE), &opts())?;
            let mut opt = AdamW::new(AdamWConfig::default());
            let logits = decoder.logits(&mut model, &ids, true)?;
            model.backward(&lm_loss(&logits, &targets)?)?;
            opt.step(&mut model)?;
            let state = TrainState {
                step: 1,
                ..Default::default()
            };
            let dir = save_sharded(&ckpt_root, &model, &opt, &state, 0)?;
            let loss = lm_loss(&decoder.logits(&mut model, &ids, false)?, &targets)?;
            let params = model.gather_full_params(false)?.expect("every rank");
            Ok((dir, loss.to_scalar::<f32>()?, params))
        })
        .unwrap()
        .swap_remove(0);
        let resumed = launch(&Launcher::threads(3), |pg| {
            let (decoder, mut model, _) =
                build_from_hf_with(pg, config(storage), &fixture(BASE), &opts())?;
            let mut opt = AdamW::new(AdamWConfig::default());
            load_sharded(&saved.0, &mut model, &mut opt)?;
            let loss = lm_loss(&decoder.logits(&mut model, &ids, false)?, &targets)?;
            let params = model.gather_full_params(false)?.expect("every rank");
            Ok((loss.to_scalar::<f32>()?, params))
        })
        .unwrap()
        .swap_remove(0);
        assert_eq!(
            resumed.0.to_bits(),
            saved.1.to_bits(),
            "{storage:?}: loss after resume"
        );
        assert_eq!(saved.2.len(), resumed.1.len());
        for ((n, a), (m, b)) in saved.2.iter().zip(&resumed.1) {
            assert_eq!(n, m);
            let same = to_vec(a)
                .iter()
                .zip(to_vec(b))
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{storage:?}: {n} differs after resume at world size 3"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
