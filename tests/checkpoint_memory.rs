//! Memory of checkpointing, measured with a counting global allocator: writing the full state
//! dict holds one unit at a time (not the model), and loading a full file or a sharded
//! checkpoint maps the files instead of reading them into memory; building a Llama from a
//! Hugging Face directory holds each rank's shards, not the model.

use std::sync::Arc;

use candle_fsdp::checkpoint::{load_full, load_sharded, save_full, save_sharded, TrainState};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::optim::{Sgd, SgdConfig};
use candle_fsdp::{FsdpConfig, FsdpModel};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{live, peak, reset_peak};

#[global_allocator]
static GLOBAL: counting_alloc::Counting = counting_alloc::COUNTING;

/// The allocator counts the whole process: the tests of this file run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const UNITS: usize = 16;
const DIM: usize = 512;
const UNIT_BYTES: isize = ((DIM * DIM + DIM) * 4) as isize; // ≈ 1 MiB each
const MODEL_BYTES: isize = UNIT_BYTES * UNITS as isize; // ≈ 16 MiB

fn build(pg: Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    let mut b = FsdpModel::builder(pg, FsdpConfig::default());
    for i in 0..UNITS {
        b = b.unit(format!("l{i}"), |vb| candle_nn::linear(DIM, DIM, vb));
    }
    b.build()
}

/// Both ranks quiet (comm streams free their buffers just after a collective completes), then
/// rank 0 resets the peak to the live count.
fn start(pg: &dyn ProcessGroup) -> candle_fsdp::Result<isize> {
    pg.barrier_wait()?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    let base = live();
    if pg.rank() == 0 {
        reset_peak();
    }
    pg.barrier_wait()?;
    Ok(base)
}

/// Waits until both ranks are done and quiet, then returns the peak above `base`.
fn peak_since(pg: &dyn ProcessGroup, base: isize) -> candle_fsdp::Result<isize> {
    pg.barrier_wait()?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    pg.barrier_wait()?;
    Ok(peak() - base)
}

#[test]
fn checkpoint_io_holds_one_unit_not_the_model() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("candle-fsdp-ckpt-mem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let full = dir.join("model.safetensors");
    let peaks = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = build(pg.clone())?;
        let mut opt = Sgd::new(SgdConfig::default());
        // Full save: both ranks together hold about one gathered unit each plus a shard copy
        // and rank 0's write buffer; gathering the model would take MODEL_BYTES on rank 0
        // alone.
        let base = start(pg.as_ref())?;
        save_full(&full, &m)?;
        let save = peak_since(pg.as_ref(), base)?;
        // Full load: new shards replace old ones unit by unit; the file is mapped, not read.
        let base = start(pg.as_ref())?;
        load_full(&full, &mut m)?;
        let load = peak_since(pg.as_ref(), base)?;
        // Sharded save and load (SGD without momentum: no optimizer state).
        let base = start(pg.as_ref())?;
        let ckpt = save_sharded(&dir, &m, &opt, &TrainState::default(), 0)?;
        let save_sharded_peak = peak_since(pg.as_ref(), base)?;
        let base = start(pg.as_ref())?;
        load_sharded(&ckpt, &mut m, &mut opt)?;
        let load_sharded_peak = peak_since(pg.as_ref(), base)?;
        Ok([save, load, save_sharded_peak, load_sharded_peak])
    })
    .unwrap();
    let [save, load, ssave, sload] = peaks[0];
    println!(
        "model {MODEL_BYTES} B, unit {UNIT_BYTES} B; peak above baseline (both ranks): full save \
         {save} B, full load {load} B, sharded save {ssave} B, sharded load {sload} B"
    );
    for (what, p) in [
        ("full save", save),
        ("full load", load),
        ("sharded save", ssave),
        ("sharded load", sload),
    ] {
        assert!(
            p < 5 * UNIT_BYTES,
            "{what}: peak {p} B above baseline, more than 5 units ({} B); model {MODEL_BYTES} B",
            5 * UNIT_BYTES
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "llama")]
#[path = "common/hf_dir.rs"]
mod hf_dir;

/// Builds the Llama of `dir` at world size `ws` (thread ranks) and returns, per rank, the peak
/// bytes its thread held while building (counting allocator, per thread) and its shards' bytes.
#[cfg(feature = "llama")]
fn hf_load_peaks(dir: &std::path::Path, ws: usize) -> Vec<(isize, usize)> {
    use candle_fsdp::hf::llama::build_from_hf;
    let _serial = serial();
    run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
        pg.barrier_wait()?;
        let base = counting_alloc::thread_reset_peak();
        let (_, model, _) = build_from_hf(pg.clone(), FsdpConfig::default(), dir, false)?;
        let peak = counting_alloc::thread_peak() - base;
        let shards: usize = model.shards().map(|u| u.param.elem_count() * 4).sum();
        pg.barrier_wait()?;
        Ok((peak, shards))
    })
    .unwrap()
}

/// A Llama of `layers` blocks, width 256, vocabulary 4096 (8.4 M parameters with 8 layers).
#[cfg(feature = "llama")]
fn mem_config(
    layers: usize,
    width: usize,
    vocab: usize,
) -> candle_fsdp::models::llama::LlamaConfig {
    candle_fsdp::models::llama::LlamaConfig {
        vocab_size: vocab,
        hidden_size: width,
        intermediate_size: width * 8 / 3,
        num_hidden_layers: layers,
        num_attention_heads: width / 64,
        num_key_value_heads: width / 64,
        head_dim: 64,
        ..Default::default()
    }
}

#[cfg(feature = "llama")]
#[test]
fn hf_load_holds_a_ranks_shards_not_the_model() {
    let dir = std::env::temp_dir().join(format!("candle-fsdp-hf-mem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = mem_config(8, 256, 4096);
    hf_dir::write_hf_llama(&dir, &cfg, safetensors::Dtype::BF16);
    let full_f32 = (cfg.num_params() * 4) as isize;
    for ws in [2, 4] {
        for (rank, (peak, shards)) in hf_load_peaks(&dir, ws).into_iter().enumerate() {
            println!(
                "ws {ws} rank {rank}: peak {peak} B while loading, shards {shards} B, full f32 \
                 model {full_f32} B"
            );
            // Its shards (1/ws of the model, plus padding) and a little bookkeeping: never the
            // model, nor one whole unit beyond its shard.
            assert!(
                peak < shards as isize + 512 * 1024,
                "ws {ws} rank {rank}: peak {peak} B, shards {shards} B"
            );
            assert!(
                peak < full_f32 / ws as isize + 512 * 1024,
                "ws {ws} rank {rank}: {peak} B"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The table of the issue: a 152 M-parameter Llama (bf16 on disk, f32 masters), per-rank peak
/// while loading at world sizes 1, 2 and 4. About 20 s and 0.6 GB of disk: run by hand,
/// `cargo test --release --test checkpoint_memory -- --ignored --nocapture`.
#[cfg(feature = "llama")]
#[test]
#[ignore]
fn hf_load_memory_table_152m() {
    let dir = std::env::temp_dir().join(format!("candle-fsdp-hf-mem152-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = mem_config(14, 768, 32000);
    let file = hf_dir::write_hf_llama(&dir, &cfg, safetensors::Dtype::BF16);
    let full_f32 = cfg.num_params() * 4;
    println!(
        "{} parameters; model.safetensors (bf16) {file} B; full f32 model {full_f32} B",
        cfg.num_params()
    );
    println!("| world size | rank | peak while loading (B) | its shards (B) | peak / full f32 |");
    for ws in [1, 2, 4] {
        for (rank, (peak, shards)) in hf_load_peaks(&dir, ws).into_iter().enumerate() {
            println!(
                "| {ws} | {rank} | {peak} | {shards} | {:.3} |",
                peak as f64 / full_f32 as f64
            );
            assert!(peak < shards as isize + 1024 * 1024);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
