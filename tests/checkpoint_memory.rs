//! Memory of checkpointing, measured with a counting global allocator: writing the full state
//! dict holds one unit at a time (not the model), and loading a full file or a sharded
//! checkpoint maps the files instead of reading them into memory.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_fsdp::checkpoint::{load_full, load_sharded, save_full, save_sharded, TrainState};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::optim::{Sgd, SgdConfig};
use candle_fsdp::{FsdpConfig, FsdpModel};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{Counting, LIVE, PEAK};

#[global_allocator]
static GLOBAL: Counting = Counting;

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
    let base = LIVE.load(Ordering::SeqCst);
    if pg.rank() == 0 {
        PEAK.store(base, Ordering::SeqCst);
    }
    pg.barrier_wait()?;
    Ok(base)
}

/// Waits until both ranks are done and quiet, then returns the peak above `base`.
fn peak_since(pg: &dyn ProcessGroup, base: isize) -> candle_fsdp::Result<isize> {
    pg.barrier_wait()?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    pg.barrier_wait()?;
    Ok(PEAK.load(Ordering::SeqCst) - base)
}

#[test]
fn checkpoint_io_holds_one_unit_not_the_model() {
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
