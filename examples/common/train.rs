//! The training loop both examples run: `world_size` ranks, as threads of this process or one
//! per process under `mpirun` (the launcher `setup` chose), each training its FSDP shards on its
//! share of every epoch.
//!
//! One optimizer step of a rank, in order: for each of `--grad-accum` micro-batches, forward,
//! cross-entropy, backward of `loss / k` (scaled by the grad scaler under f16; under
//! `--accum-mode no-sync` only the last micro-batch reduce-scatters); then the example's learning
//! rate for this step, unscale (f16), clip (`--clip-grad-norm`), the optimizer step (skipped by
//! the scaler on inf/NaN), `zero_grad`. After each epoch: the mean train loss over every rank's
//! batches, the example's evaluation of the gathered full model on rank 0 while the others wait
//! at a barrier, one line on rank 0, a sharded checkpoint.
//!
//! Each call of the runtime's public API is made in one place below (`Rank`'s methods), so an
//! API change is one edit.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Tensor};
use candle_fsdp::checkpoint::{self, RngState, SamplerState, TrainState};
use candle_fsdp::clip::clip_grad_norm;
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::data::{Batch, BatchLoader, DistributedSampler};
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::timeline::render_timeline;
use candle_fsdp::trace::{
    chrome_trace_json, overlap_summary, peak_rss_bytes, OverlapSummary, Span, TraceSession, Tracer,
};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{
    BackwardPrefetch, Error, FsdpConfig, FsdpModel, FullModel, MemoryStats, MixedPrecision, Result,
    ShardedOptimizer,
};
use indicatif::{ProgressBar, ProgressStyle};

use super::args::{AccumMode, TrainArgs};

/// Steps of the first epoch trained before tracing starts (`--trace`).
const TRACE_WARMUP_STEPS: usize = 8;

/// A training split as [`BatchLoader`] takes it: flat f32 items, one u8 label each.
pub struct TrainData {
    /// `len × C × H × W` values, item-major.
    pub images: Arc<Vec<f32>>,
    /// One class label per item.
    pub labels: Arc<Vec<u8>>,
    /// `(C, H, W)` of one item.
    pub item_shape: (usize, usize, usize),
}

/// What an example brings to [`train()`]; everything else is the loop's.
pub struct Job<'a, O> {
    /// The training split.
    pub data: &'a TrainData,
    /// The model's units, built on every rank; the rank's process group is passed for units that
    /// communicate themselves (SyncBatchNorm).
    pub units: &'a (dyn Fn(Arc<dyn ProcessGroup>) -> Vec<UnitSpec> + Sync),
    /// The optimizer, built on every rank.
    pub optimizer: &'a (dyn Fn() -> O + Sync),
    /// Learning rate of optimizer step `step` (from 0) of `total` in the whole run, set before
    /// that step; `None` keeps the optimizer's own.
    pub learning_rate: Option<&'a (dyn Fn(u64, u64) -> f64 + Sync)>,
    /// Test accuracy in percent of the gathered model, on rank 0 after every epoch.
    pub evaluate: &'a (dyn Fn(&FullModel) -> Result<f64> + Sync),
}

/// What rank 0 saw.
pub struct Outcome {
    /// Test accuracy after the last epoch trained; NaN when no epoch was trained.
    pub accuracy: f64,
    /// Wall time of each epoch trained as its line prints it (training and evaluation), seconds.
    #[allow(dead_code)] // read by mnist_cnn's last line; the main job's prints accuracy only
    pub epoch_times: Vec<f64>,
}

/// Trains `job` as `args` say on the ranks of `launcher`, then writes the trace (with
/// `--trace`); returns rank 0's [`Outcome`] in the process that runs rank 0 (`None` in the
/// others, under `mpirun`). Prints on rank 0 one line per epoch and a memory summary at the end.
pub fn train<O: ShardedOptimizer + 'static>(
    args: &TrainArgs,
    launcher: &Launcher,
    job: &Job<'_, O>,
) -> anyhow::Result<Option<Outcome>> {
    let session = TraceSession::new();
    let finals = launch(launcher, |pg| Rank::new(args, job, pg, &session)?.run())?;
    let (mut outcomes, mut spans) = (Vec::new(), Vec::new());
    for (outcome, rank_spans) in finals {
        outcomes.push(outcome);
        spans.extend(rank_spans);
    }
    if let Some(path) = &args.trace {
        // One process per rank (mpirun): each writes its own rank's trace, `out.json` →
        // `out.rank<r>.json`; only rank 0 prints.
        let ranks = launcher.local_ranks();
        let path = if ranks.len() < launcher.world_size() {
            let stem = path.file_stem().unwrap_or_default().to_string_lossy();
            let ext = path
                .extension()
                .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
            path.with_file_name(format!("{stem}.rank{}{ext}", ranks.start))
        } else {
            path.clone()
        };
        write_trace(&path, spans, ranks.start == 0)?;
    }
    let has_rank0 = launcher.local_ranks().start == 0;
    Ok(has_rank0.then(|| outcomes.swap_remove(0)))
}

/// Prints the newest checkpoint under `--checkpoint-dir` and the `fsdp-ckpt export` command
/// that makes one model file of it (plain Candle and PyTorch load that file by name); nothing
/// when there is none.
pub fn print_checkpoint(args: &TrainArgs) -> anyhow::Result<()> {
    let root = &args.checkpoint_dir;
    let Some(latest) = checkpoint::list_complete(root)?.pop() else {
        return Ok(());
    };
    let name = root.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    println!("checkpoint: {}", latest.display());
    println!(
        "one model file from it: cargo run --release --bin fsdp-ckpt -- export {} --out \
         {name}.safetensors",
        latest.display()
    );
    Ok(())
}

/// One rank's training state.
struct Rank<'a, O> {
    args: &'a TrainArgs,
    job: &'a Job<'a, O>,
    pg: Arc<dyn ProcessGroup>,
    model: FsdpModel,
    optim: O,
    /// Dynamic loss scaling, under f16 only.
    scaler: Option<ShardedGradScaler>,
    tracer: Option<Arc<Tracer>>,
    /// Epoch whose steps are traced (the first one trained).
    traced_epoch: Option<u64>,
    sampler: DistributedSampler,
    /// Optimizer steps taken (restored on resume; names the checkpoints).
    step: u64,
    /// Optimizer steps of the whole run (the schedule's horizon).
    total_steps: u64,
    /// The run its checkpoints belong to: fresh, or the resumed checkpoint's.
    run_id: Option<String>,
}

/// What a rank returns: its outcome and its traced spans.
type RankOutput = (Outcome, Vec<Span>);

impl<'a, O: ShardedOptimizer + 'static> Rank<'a, O> {
    /// Builds the model, optimizer, scaler, tracer and sampler of one rank.
    fn new(
        args: &'a TrainArgs,
        job: &'a Job<'a, O>,
        pg: Arc<dyn ProcessGroup>,
        session: &TraceSession,
    ) -> Result<Self> {
        let mixed_precision = MixedPrecision::from_name(&args.precision)?;
        // Dynamic loss scaling, under f16 only.
        let scaler = if mixed_precision.uses_f16() {
            Some(ShardedGradScaler::new(GradScalerConfig::default())?)
        } else {
            None
        };
        let config = FsdpConfig {
            sharding_strategy: args.strategy,
            seed: args.seed,
            forward_prefetch: !args.no_prefetch,
            backward_prefetch: if args.no_prefetch {
                BackwardPrefetch::None
            } else {
                BackwardPrefetch::BackwardPre
            },
            mixed_precision,
            ..Default::default()
        };
        let mut model = FsdpModel::builder(pg.clone(), config)
            .units((job.units)(pg.clone()))
            .build()?;
        // Off until the traced steps (see `train_epoch`).
        let tracer = args.trace.as_ref().map(|_| {
            let t = session.tracer(pg.rank());
            t.set_enabled(false);
            t
        });
        model.set_tracer(tracer.clone());
        let sampler = DistributedSampler::new(
            job.data.labels.len(),
            pg.world_size(),
            pg.rank(),
            true,
            args.seed,
            false,
        )?;
        let batches_per_epoch = sampler.num_samples().div_ceil(args.batch_size);
        let total_steps = (batches_per_epoch.div_ceil(args.grad_accum) as u64 * args.epochs).max(1);
        Ok(Self {
            args,
            job,
            pg,
            model,
            optim: (job.optimizer)(),
            scaler,
            tracer,
            traced_epoch: None,
            sampler,
            step: 0,
            total_steps,
            run_id: None,
        })
    }

    /// Resumes (with `--resume`), trains the remaining epochs, reports.
    fn run(mut self) -> Result<RankOutput> {
        let rank = self.pg.rank();
        let (start_epoch, mut resume_at) = self.resume()?;
        let mut accuracy = f64::NAN;
        let mut epoch_times = Vec::new();
        let mut train_mem = None;
        for epoch in start_epoch..self.args.epochs {
            let t0 = Instant::now();
            match resume_at.take() {
                Some(s) => s.apply(&mut self.sampler)?,
                None => self.sampler.set_epoch(epoch),
            }
            let (loss_sum, batches) = self.train_epoch(epoch)?;
            // Mean train loss over all ranks' batches, reduced to rank 0.
            let sums = self.sum_to_rank0(loss_sum as f32, batches as f32)?;
            let train_time = t0.elapsed().as_secs_f64();
            // Memory of training (the evaluation below gathers in f32 and would blur it).
            train_mem = Some(self.model.memory_stats());
            if let Some(acc) = self.evaluate()? {
                accuracy = acc;
            }
            let epoch_time = t0.elapsed().as_secs_f64();
            if rank == 0 {
                println!(
                    "epoch {:>2}  train loss {:.4}  test accuracy {:.2}%  epoch time {:.2}s (train {:.2}s)",
                    epoch + 1,
                    sums[0] / sums[1],
                    accuracy,
                    epoch_time,
                    train_time
                );
            }
            let next = SamplerState {
                epoch: epoch + 1,
                position: 0,
                world_size: self.pg.world_size(),
            };
            epoch_times.push(epoch_time);
            self.save(epoch + 1, next)?;
        }
        if rank == 0 {
            self.report(train_mem);
        }
        let spans = self.tracer.map(|t| t.spans()).unwrap_or_default();
        Ok((
            Outcome {
                accuracy,
                epoch_times,
            },
            spans,
        ))
    }

    /// Loads the newest checkpoint with `--resume`; returns the epoch to start in and, for a
    /// mid-epoch checkpoint, where the sampler stopped.
    fn resume(&mut self) -> Result<(u64, Option<SamplerState>)> {
        let loaded = match (&self.args.resume_from, self.args.resume) {
            (Some(dir), _) => Some(checkpoint::load_sharded(
                dir,
                &mut self.model,
                &mut self.optim,
            )?),
            (None, true) => checkpoint::load_latest(
                &self.args.checkpoint_dir,
                &mut self.model,
                &mut self.optim,
            )?,
            (None, false) => None,
        };
        let Some(loaded) = loaded else {
            self.run_id = Some(self.fresh_run_id()?);
            return Ok((0, None));
        };
        if self.pg.rank() == 0 {
            for s in &loaded.skipped {
                println!(
                    "skipped damaged checkpoint {} (left as {}): {}",
                    s.dir.display(),
                    s.renamed_to
                        .as_ref()
                        .map_or("it is".into(), |p| p.display().to_string()),
                    s.error
                );
            }
        }
        let train = loaded.meta.train;
        self.run_id = train.run_id.clone();
        if let Some(rng) = &train.rng {
            if rng.seed != self.args.seed {
                return Err(Error::InvalidArgument(format!(
                    "{} was trained with --seed {}; resuming with --seed {} would change the \
                     data order: pass --seed {}",
                    loaded.dir.display(),
                    rng.seed,
                    self.args.seed,
                    rng.seed
                )));
            }
        }
        self.step = train.step;
        let (mut start_epoch, mut resume_at) = (train.epoch, None);
        if let Some(s) = train.sampler {
            (start_epoch, resume_at) = (s.epoch, Some(s));
        }
        if let (Some(s), Some(v)) = (&mut self.scaler, train.grad_scaler) {
            s.load_state(
                serde_json::from_value(v)
                    .map_err(|e| Error::InvalidArgument(format!("grad scaler state: {e}")))?,
            );
        }
        if self.pg.rank() == 0 {
            println!(
                "resumed from {} (epoch {}, step {})",
                loaded.dir.display(),
                start_epoch + 1,
                self.step
            );
        }
        Ok((start_epoch, resume_at))
    }

    /// A new run id, drawn on rank 0 and broadcast (a collective), so every rank (thread or
    /// process) saves under the same one.
    fn fresh_run_id(&self) -> Result<String> {
        let id = checkpoint::new_run_id();
        let halves = [&id[..16], &id[16..]].map(|h| u64::from_str_radix(h, 16).unwrap_or(0));
        let v = self.pg.broadcast_u64s(halves.to_vec(), 0)?;
        Ok(format!("{:016x}{:016x}", v[0], v[1]))
    }

    /// One epoch over this rank's share (from where the sampler starts); returns the sum of the
    /// micro-batch losses and their number.
    fn train_epoch(&mut self, epoch: u64) -> Result<(f64, usize)> {
        let data = self.job.data;
        let loader = BatchLoader::new(
            data.images.clone(),
            data.labels.clone(),
            data.item_shape,
            self.sampler.indices(),
            self.args.batch_size,
            false,
        )?;
        let num_batches = loader.num_batches();
        let bar = (self.pg.rank() == 0).then(|| progress_bar(num_batches, epoch));
        let k = self.args.grad_accum;
        let (mut loss_sum, mut batches, mut consumed) = (0.0f64, 0usize, 0usize);
        for (i, batch) in loader.enumerate() {
            let batch = batch?;
            if let Some(t) = &self.tracer {
                let first = *self.traced_epoch.get_or_insert(epoch) == epoch;
                let traced = TRACE_WARMUP_STEPS..TRACE_WARMUP_STEPS + self.args.trace_steps;
                t.set_enabled(first && traced.contains(&i));
            }
            // The last micro-batch of each group of k (or of the epoch) steps the optimizer.
            let last_micro = (i + 1) % k == 0 || i + 1 == num_batches;
            let loss = self.forward_backward(&batch, last_micro)?;
            if last_micro {
                self.optimizer_step()?;
            }
            consumed += batch.len();
            // Mid-epoch checkpoint (the end of the epoch saves in `run`).
            let save_every = self.args.save_every;
            if last_micro
                && save_every > 0
                && self.step.is_multiple_of(save_every)
                && i + 1 < num_batches
            {
                self.save(epoch, SamplerState::new(&self.sampler, consumed))?;
            }
            loss_sum += loss.to_scalar::<f32>()? as f64;
            batches += 1;
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        Ok((loss_sum, batches))
    }

    /// Forward, cross-entropy and backward of one micro-batch; returns its (unscaled) loss.
    fn forward_backward(&mut self, batch: &Batch, last_micro: bool) -> Result<Tensor> {
        let sync = last_micro || self.args.accum_mode == AccumMode::ReduceScatter;
        self.model.set_requires_gradient_sync(sync);
        let logits = self.model.forward(&batch.images)?.to_dtype(DType::F32)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
        let micro_loss = (&loss / self.args.grad_accum as f64)?;
        match &self.scaler {
            Some(s) => self.model.backward(&s.scale_loss(&micro_loss)?)?,
            None => self.model.backward(&micro_loss)?,
        }
        Ok(loss)
    }

    /// Learning rate, unscale, clip, step, zero the gradients.
    fn optimizer_step(&mut self) -> Result<()> {
        if let Some(lr) = self.job.learning_rate {
            self.optim
                .set_learning_rate(lr(self.step, self.total_steps));
        }
        if let Some(s) = &mut self.scaler {
            s.unscale(&mut self.model)?;
        }
        if self.args.clip_grad_norm > 0.0 {
            clip_grad_norm(&mut self.model, self.args.clip_grad_norm)?;
        }
        match &mut self.scaler {
            // Skipped (and the scale lowered) when some rank found inf/NaN.
            Some(s) => {
                s.step(&mut self.model, &mut self.optim)?;
            }
            None => self.optim.step(&mut self.model)?,
        }
        self.model.zero_grad();
        self.step += 1;
        Ok(())
    }

    /// Sums two values over the ranks onto rank 0 (every rank gets a vector; only rank 0's is
    /// the sum).
    fn sum_to_rank0(&self, a: f32, b: f32) -> Result<Vec<f32>> {
        self.pg.reduce_f32s(vec![a, b], 0, ReduceOp::Sum)
    }

    /// The example's evaluation of the gathered full model on rank 0 (`Some` there, `None`
    /// elsewhere); the other ranks wait at a barrier.
    fn evaluate(&mut self) -> Result<Option<f64>> {
        let accuracy = match self.model.gather_full_model(true)? {
            Some(full) => Some((self.job.evaluate)(&full)?),
            None => None,
        };
        self.pg.barrier_wait()?;
        Ok(accuracy)
    }

    /// Saves a sharded checkpoint after `epochs_done` epochs with the sampler at `sampler`.
    fn save(&self, epochs_done: u64, sampler: SamplerState) -> Result<()> {
        let state = TrainState {
            step: self.step,
            epoch: epochs_done,
            sampler: Some(sampler),
            rng: Some(RngState {
                seed: self.args.seed,
            }),
            grad_scaler: self
                .scaler
                .as_ref()
                .and_then(|s| serde_json::to_value(s.state()).ok()),
            run_id: self.run_id.clone(),
            ..Default::default()
        };
        checkpoint::save_sharded(
            &self.args.checkpoint_dir,
            &self.model,
            &self.optim,
            &state,
            self.args.keep_last,
        )?;
        Ok(())
    }

    /// Rank 0's summary: training memory, peak RSS, the grad scaler.
    fn report(&self, train_mem: Option<MemoryStats>) {
        if let Some(m) = train_mem {
            let optimizer_bytes = self.optim.state_bytes();
            println!(
                "rank 0 training memory: sharded state {} B (+ optimizer {} B), peak unsharded \
                 parameters {} B, at most {} unit(s) unsharded at once",
                m.sharded_bytes, optimizer_bytes, m.peak_unsharded_bytes, m.peak_unsharded_units
            );
        }
        if let Some(rss) = peak_rss_bytes() {
            println!(
                "process peak RSS {:.1} MiB (the ranks of this process)",
                rss as f64 / (1 << 20) as f64
            );
        }
        if let Some(s) = &self.scaler {
            let st = s.state();
            println!(
                "grad scaler: scale {} after {} steps, {} skipped",
                st.scale, st.taken_steps, st.skipped_steps
            );
        }
    }
}

/// Rank 0's progress bar of one epoch.
fn progress_bar(batches: usize, epoch: u64) -> ProgressBar {
    let b = ProgressBar::new(batches as u64);
    b.set_style(
        ProgressStyle::with_template(
            "epoch {msg} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    b.set_message(format!("{}", epoch + 1));
    b
}

/// Writes the trace JSON and the timeline pictures, and prints the overlap summary.
fn write_trace(path: &Path, spans: Vec<Span>, print: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        !spans.is_empty(),
        "no span was traced (was the epoch shorter than {TRACE_WARMUP_STEPS} steps?)"
    );
    std::fs::write(path, chrome_trace_json(&spans))
        .with_context(|| format!("writing {}", path.display()))?;
    for ext in ["png", "svg"] {
        render_timeline(&spans, &path.with_extension(ext))?;
    }
    if !print {
        return Ok(());
    }
    let summary = overlap_summary(&spans);
    let n = summary.len() as f64;
    let mean = |f: fn(&OverlapSummary) -> f64| summary.iter().map(f).sum::<f64>() / n;
    println!(
        "trace: {} spans of {} rank-steps written to {} (+ .png, .svg); per step: {:.2} ms, \
         compute {:.2} ms, communication {:.2} ms, exposed {:.2} ms ({:.1}% of the step), \
         overlap {:.1}%",
        spans.len(),
        summary.len(),
        path.display(),
        mean(|s| s.step_s) * 1e3,
        mean(|s| s.compute_s) * 1e3,
        mean(|s| s.comm_s) * 1e3,
        mean(|s| s.exposed_s) * 1e3,
        100.0 * mean(|s| s.exposed_s / s.step_s),
        100.0 * mean(|s| s.overlap_fraction)
    );
    Ok(())
}
