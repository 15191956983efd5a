//! The epoch loop both MNIST examples run: `world_size` ranks, as threads of this process or one
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
//! The pieces of the step, resume, saving and reporting are [`super::trainer`]'s, shared with
//! the GPT example's step loop.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_fsdp::checkpoint::TrainState;
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt};
use candle_fsdp::data::{Batch, BatchLoader, DistributedSampler, SamplerState};
use candle_fsdp::launch::Launcher;
use candle_fsdp::trace::{Span, TraceSession};
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FullModel, Result, ShardedOptimizer};
use indicatif::{ProgressBar, ProgressStyle};

use super::args::TrainArgs;
use super::trainer::{run_job, trace_window, Trainer};

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
    /// Epochs to train (in total, counting resumed ones).
    pub epochs: u64,
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
    run_job(args, launcher, |pg, session| {
        Rank::new(args, job, pg, session)?.run()
    })
}

/// One rank's epoch loop: the shared [`Trainer`] plus the sampler.
struct Rank<'a, O> {
    job: &'a Job<'a, O>,
    t: Trainer<'a, O>,
    /// Epoch whose steps are traced (the first one trained).
    traced_epoch: Option<u64>,
    sampler: DistributedSampler,
    /// Optimizer steps of the whole run (the schedule's horizon).
    total_steps: u64,
}

/// What a rank returns: its outcome and its traced spans.
type RankOutput = (Outcome, Vec<Span>);

impl<'a, O: ShardedOptimizer + 'static> Rank<'a, O> {
    /// Builds the trainer (model, optimizer, scaler, tracer) and the sampler of one rank.
    fn new(
        args: &'a TrainArgs,
        job: &'a Job<'a, O>,
        pg: Arc<dyn ProcessGroup>,
        session: &TraceSession,
    ) -> Result<Self> {
        let units = (job.units)(pg.clone());
        let t = Trainer::new(
            args,
            pg.clone(),
            session,
            |b| b.units(units),
            (job.optimizer)(),
        )?;
        let sampler = DistributedSampler::new(
            job.data.labels.len(),
            pg.world_size(),
            pg.rank(),
            true,
            args.seed,
            false,
        )?;
        let batches_per_epoch = sampler.num_samples().div_ceil(args.batch_size);
        let total_steps = (batches_per_epoch.div_ceil(args.grad_accum) as u64 * job.epochs).max(1);
        Ok(Self {
            job,
            t,
            traced_epoch: None,
            sampler,
            total_steps,
        })
    }

    /// Resumes (with `--resume`), trains the remaining epochs, reports.
    fn run(mut self) -> Result<RankOutput> {
        let rank = self.t.pg.rank();
        let (start_epoch, mut resume_at) = self.resume()?;
        let mut accuracy = f64::NAN;
        let mut epoch_times = Vec::new();
        let mut train_mem = None;
        let mut train_comm = None;
        for epoch in start_epoch..self.job.epochs {
            let t0 = Instant::now();
            match resume_at.take() {
                Some(s) => self.sampler.restore(&s)?,
                None => self.sampler.set_epoch(epoch),
            }
            let comm0 = self.t.model.comm_stats();
            let (loss_sum, batches) = self.train_epoch(epoch)?;
            let comm = self.t.model.comm_stats().zip_with(comm0, u64::wrapping_sub);
            let steps = batches.div_ceil(self.t.args.grad_accum).max(1) as u64;
            train_comm = Some(comm.zip_with(comm, |v, _| v / steps));
            // Mean train loss over all ranks' batches, reduced to rank 0.
            let sums = self.t.sum_to_rank0(vec![loss_sum as f32, batches as f32])?;
            let train_time = t0.elapsed().as_secs_f64();
            // Memory of training (the evaluation below gathers in f32 and would blur it).
            train_mem = Some(self.t.model.memory_stats());
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
                world_size: self.t.pg.world_size(),
            };
            epoch_times.push(epoch_time);
            self.save(epoch + 1, next)?;
        }
        if rank == 0 {
            self.t.report(train_mem);
            if let Some(c) = train_comm {
                println!(
                    "rank 0 sent per optimizer step (last epoch, every group of the model): \
                     all-gather {} B, reduce-scatter {} B, all-reduce and others {} B",
                    c.all_gather_bytes, c.reduce_scatter_bytes, c.other_bytes
                );
            }
        }
        let spans = self.t.spans();
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
        let Some(resumed) = self.t.resume()? else {
            return Ok((0, None));
        };
        let train = resumed.train;
        let (mut start_epoch, mut resume_at) = (train.epoch, None);
        if let Some(s) = train.sampler {
            (start_epoch, resume_at) = (s.epoch, Some(s));
        }
        if self.t.pg.rank() == 0 {
            println!(
                "resumed from {} (epoch {}, step {})",
                resumed.dir.display(),
                start_epoch + 1,
                self.t.step
            );
        }
        Ok((start_epoch, resume_at))
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
            self.t.args.batch_size,
            false,
        )?;
        let num_batches = loader.num_batches();
        let bar = (self.t.pg.rank() == 0).then(|| progress_bar(num_batches, epoch));
        let k = self.t.args.grad_accum;
        let (mut loss_total, mut batches, mut consumed) = (None::<Tensor>, 0usize, 0usize);
        for (i, batch) in loader.enumerate() {
            let batch = batch?;
            if self.t.tracing_requested() {
                let first = *self.traced_epoch.get_or_insert(epoch) == epoch;
                let traced = trace_window(num_batches, self.t.args.trace_steps);
                self.t.set_tracing(first && traced.contains(&i));
            }
            // The last micro-batch of each group of k (or of the epoch) steps the optimizer.
            let last_micro = (i + 1) % k == 0 || i + 1 == num_batches;
            let loss = self.forward_backward(&batch, last_micro)?;
            if last_micro {
                let lr = self
                    .job
                    .learning_rate
                    .map(|lr| lr(self.t.step, self.total_steps));
                self.t.optimizer_step(lr)?;
            }
            consumed += batch.len();
            // Mid-epoch checkpoint (the end of the epoch saves in `run`).
            let save_every = self.t.args.save_every;
            if last_micro
                && save_every > 0
                && self.t.step.is_multiple_of(save_every)
                && i + 1 < num_batches
            {
                self.t.save_periodic(TrainState {
                    epoch,
                    sampler: Some(self.sampler.state(consumed)),
                    ..Default::default()
                })?;
            }
            // Summed on the device and read once per epoch: a read per step would make the
            // host wait for every step's GPU work.
            loss_total = Some(match loss_total {
                None => loss.detach().to_dtype(DType::F64)?,
                Some(t) => (t + loss.detach().to_dtype(DType::F64)?)?,
            });
            batches += 1;
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let loss_sum = match loss_total {
            Some(t) => t.to_scalar::<f64>()?,
            None => 0.0,
        };
        Ok((loss_sum, batches))
    }

    /// Forward, cross-entropy and backward of one micro-batch; returns its (unscaled) loss.
    fn forward_backward(&mut self, batch: &Batch, last_micro: bool) -> Result<Tensor> {
        self.t.forward_backward(last_micro, |model| {
            // The loader builds batches on the host; one copy to the model's device (a no-op on
            // the CPU).
            let images = batch.images.to_device(model.device())?;
            let labels = batch.labels.to_device(model.device())?;
            let logits = model.forward(&images)?.to_dtype(DType::F32)?;
            Ok(candle_fsdp::nn::cross_entropy(&logits, &labels)?)
        })
    }

    /// The example's evaluation of the gathered full model on rank 0 (`Some` there, `None`
    /// elsewhere); the other ranks wait at a barrier.
    fn evaluate(&mut self) -> Result<Option<f64>> {
        let accuracy = match self.t.model.gather_full_model(true)? {
            Some(full) => Some((self.job.evaluate)(&full)?),
            None => None,
        };
        self.t.pg.barrier_wait()?;
        Ok(accuracy)
    }

    /// Saves a sharded checkpoint after `epochs_done` epochs with the sampler at `sampler`.
    fn save(&self, epochs_done: u64, sampler: SamplerState) -> Result<()> {
        self.t.save(TrainState {
            epoch: epochs_done,
            sampler: Some(sampler),
            ..Default::default()
        })
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
