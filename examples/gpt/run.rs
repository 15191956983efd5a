//! The GPT's step loop on every rank, over the shared pieces of `common::trainer`.
//!
//! One optimizer step of a rank: for each of `--grad-accum` micro-batches, this rank's windows of
//! `(seed, rank, step · k + micro)`, a training forward through the units, the mean next-token
//! cross-entropy, its backward; then the learning rate of the step, unscale / clip / AdamW step
//! (the trainer's). Every `--log-interval` steps the micro-batch losses since the last line are
//! summed over the ranks onto rank 0, which prints them with the step time and tokens/s; every
//! `--eval-interval` steps and at the end each rank evaluates its share of the validation
//! windows (inference forwards, collectives) and rank 0 prints the mean. Checkpoints every
//! `--save-every` steps and at the end; at the very end every rank generates the same sample
//! (the forwards are collectives; the sampling is seeded alike) and rank 0 returns it.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use candle_fsdp::checkpoint::TrainState;
use candle_fsdp::data::text::{Split, TextCorpus};
use candle_fsdp::launch::Launcher;
use candle_fsdp::lr_scheduler::LrSchedule;
use candle_fsdp::models::gpt::{lm_loss, FsdpGpt, GptConfig};
use candle_fsdp::trace::{Span, TraceSession};
use candle_fsdp::{AdamW, AdamWConfig, MemoryBudget, ParamGroup, Result};
use rand::{Rng, SeedableRng};

use super::common::trainer::{run_job, trace_window, Trainer};
use super::Args;

/// What rank 0 saw.
pub struct Outcome {
    /// Optimizer steps this run took (0: nothing left to train).
    pub steps_trained: u64,
    /// The generated text (prompt included), when `--sample-len` > 0.
    pub sample: Option<String>,
}

/// Trains the GPT `cfg` on `corpus` as `args` say, on the ranks of `launcher`; rank 0's
/// [`Outcome`] in the process that runs rank 0.
pub fn train(
    args: &Args,
    cfg: GptConfig,
    corpus: &TextCorpus,
    launcher: &Launcher,
    budget: Option<MemoryBudget>,
) -> anyhow::Result<Option<Outcome>> {
    run_job(&args.train, launcher, |pg, session| {
        LmRank::new(args, cfg, corpus, pg, session, budget)?.run()
    })
}

/// Activations one training step keeps per rank, measured on plain-Candle probes under the
/// counting allocator (`candle_fsdp::alloc`): a 1-layer and a 2-layer GPT of this shape run a
/// forward and the loss at the per-rank batch, in f32; the bytes still held by their graphs
/// give one block's activations (the difference) and the rest (embeddings, final norm, logits).
/// Estimate: `rest + n_layer · block` bytes; with checkpointed blocks, the smaller of that and
/// `rest + n_layer · input + block`, where a block's saved input is `batch · seq_len · d_model`
/// f32 values and one block's activations exist at a time (its recompute in the backward).
///
/// Errors: the counting allocator is not installed; Candle's.
pub fn measure_activation_bytes(
    cfg: &GptConfig,
    batch: usize,
    checkpointed: bool,
) -> anyhow::Result<usize> {
    use candle_fsdp::alloc;
    use candle_fsdp::models::gpt::Gpt;
    anyhow::ensure!(
        alloc::is_counting(),
        "the activation probe needs candle_fsdp::alloc::Counting as the global allocator"
    );
    let held = |layers: usize| -> anyhow::Result<usize> {
        let probe = GptConfig {
            n_layer: layers,
            ..*cfg
        };
        let varmap = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let gpt = Gpt::new(probe, vb)?;
        let ids = Tensor::zeros((batch, cfg.seq_len), DType::U32, &Device::Cpu)?;
        let before = alloc::live_bytes();
        let loss = lm_loss(&gpt.forward(&ids)?, &ids)?;
        let after = alloc::live_bytes();
        drop(loss);
        Ok(after.saturating_sub(before))
    };
    let (one, two) = (held(1)?, held(2)?);
    let block = two.saturating_sub(one);
    let rest = one.saturating_sub(block);
    let whole = rest + cfg.n_layer * block;
    Ok(if checkpointed {
        // Never more than without checkpointing (a block's input is among what it keeps).
        whole.min(rest + cfg.n_layer * batch * cfg.seq_len * cfg.d_model * 4 + block)
    } else {
        whole
    })
}

/// AdamW of the flags, with no weight decay on biases and LayerNorm weights.
fn optimizer(args: &Args) -> AdamW {
    let cfg = AdamWConfig {
        lr: args.train.lr,
        beta1: args.beta1,
        beta2: args.beta2,
        weight_decay: args.weight_decay,
        ..Default::default()
    };
    let no_decay = ParamGroup::new(
        "no_decay",
        ["*.bias", "*.ln1.weight", "*.ln2.weight", "lnf.weight"],
        AdamWConfig {
            weight_decay: 0.0,
            ..cfg
        },
    );
    AdamW::with_groups(cfg, vec![no_decay])
}

/// One rank's step loop.
struct LmRank<'a> {
    args: &'a Args,
    gpt: FsdpGpt,
    corpus: &'a TextCorpus,
    t: Trainer<'a, AdamW>,
    device: Device,
}

impl<'a> LmRank<'a> {
    fn new(
        args: &'a Args,
        cfg: GptConfig,
        corpus: &'a TextCorpus,
        pg: std::sync::Arc<dyn candle_fsdp::comm::ProcessGroup>,
        session: &TraceSession,
        budget: Option<MemoryBudget>,
    ) -> Result<Self> {
        let gpt = FsdpGpt::new(cfg)?.with_activation_checkpointing(args.activation_checkpointing);
        let device = pg.device().clone();
        let t = Trainer::new(
            &args.train,
            pg,
            session,
            |b| {
                let b = gpt.add_units(b);
                match budget {
                    Some(budget) => b.memory_budget(budget),
                    None => b,
                }
            },
            optimizer(args),
        )?;
        if t.pg.rank() == 0 {
            let activations = budget.map_or(0, |b| b.activation_bytes);
            println!(
                "memory plan: {}{}",
                t.model.memory_plan(8, activations),
                if budget.is_none() {
                    " (activations not measured: they are with --max-memory-per-rank)"
                } else {
                    ""
                }
            );
        }
        Ok(Self {
            args,
            gpt,
            corpus,
            t,
            device,
        })
    }

    /// Learning rate of optimizer step `step` (from 0): linear warm-up over `--warmup-steps`,
    /// then a cosine from `--lr` to `--min-lr-factor · lr` at `--max-steps`.
    fn learning_rate(&self, step: u64) -> f64 {
        let (warmup, total) = (self.args.warmup_steps, self.args.max_steps);
        let factor = if step < warmup {
            LrSchedule::linear_warmup(1.0 / warmup as f64, warmup).factor(step)
        } else {
            LrSchedule::Cosine {
                total_steps: total.saturating_sub(warmup).max(1),
                min_factor: self.args.min_lr_factor,
            }
            .factor(step - warmup)
        };
        self.args.train.lr * factor
    }

    /// Resumes (with `--resume`), trains to `--max-steps`, evaluates, saves, samples.
    fn run(mut self) -> Result<(Outcome, Vec<Span>)> {
        let rank = self.t.pg.rank();
        if let Some(r) = self.t.resume()? {
            if rank == 0 {
                println!("resumed from {} (step {})", r.dir.display(), self.t.step);
            }
        }
        let (start, max) = (self.t.step, self.args.max_steps);
        let (ws, b, t) = (
            self.t.pg.world_size(),
            self.args.train.batch_size,
            self.args.seq_len,
        );
        let k = self.args.train.grad_accum;
        let tokens_per_step = (ws * b * t * k) as f64;
        // Since the last loss line: summed micro-batch losses, their number, training time.
        let (mut loss_sum, mut micro, mut busy, mut steps) = (0.0f64, 0usize, 0.0f64, 0u64);
        let mut train_mem = None;
        for step in start..max {
            let t0 = Instant::now();
            let traced = trace_window((max - start) as usize, self.args.train.trace_steps);
            self.t
                .set_tracing(traced.contains(&((step - start) as usize)));
            for m in 0..k {
                let loss = self.micro_batch(step * k as u64 + m as u64, m + 1 == k)?;
                loss_sum += loss as f64;
                micro += 1;
            }
            let lr = self.learning_rate(step);
            self.t.optimizer_step(Some(lr))?;
            busy += t0.elapsed().as_secs_f64();
            steps += 1;
            let done = step + 1;
            if done % self.args.log_interval == 0 || done == max {
                let sums = self.t.sum_to_rank0(vec![loss_sum as f32, micro as f32])?;
                if rank == 0 {
                    println!(
                        "step {done:>6}/{max}  loss {:.4}  lr {lr:.2e}  {:.1} ms/step  {:.0} tok/s",
                        sums[0] / sums[1],
                        1e3 * busy / steps as f64,
                        tokens_per_step * steps as f64 / busy
                    );
                }
                (loss_sum, micro, busy, steps) = (0.0, 0, 0.0, 0);
            }
            if done == max {
                // Memory of training (evaluation and sampling gather again).
                train_mem = Some(self.t.model.memory_stats());
            }
            let interval = self.args.eval_interval;
            if (interval > 0 && done % interval == 0) || done == max {
                let val = self.evaluate()?;
                if rank == 0 {
                    println!("step {done:>6}/{max}  val loss {val:.4}");
                }
            }
            let save_every = self.args.train.save_every;
            if save_every > 0 && done % save_every == 0 && done < max {
                self.save()?;
            }
        }
        self.t.set_tracing(false);
        let steps_trained = max.saturating_sub(start);
        if steps_trained > 0 {
            self.save()?;
        }
        if rank == 0 && steps_trained > 0 {
            self.t.report(train_mem);
        }
        let sample = if self.args.sample_len > 0 {
            Some(self.generate()?)
        } else {
            None
        };
        Ok((
            Outcome {
                steps_trained,
                sample,
            },
            self.t.spans(),
        ))
    }

    /// Forward and backward of this rank's micro-batch `index`; returns its loss.
    fn micro_batch(&mut self, index: u64, last_micro: bool) -> Result<f32> {
        let (x, y) = self.corpus.windows(
            Split::Train,
            self.args.train.batch_size,
            self.args.seq_len,
            self.args.train.seed,
            self.t.pg.rank(),
            index,
            &self.device,
        )?;
        let gpt = &self.gpt;
        let loss = self.t.forward_backward(last_micro, |model| {
            let logits = gpt.logits(model, &x, true)?;
            lm_loss(&logits, &y)
        })?;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Mean validation loss over every rank's `--eval-batches` windows (the same at every
    /// evaluation); rank 0's value is the mean over all ranks (the others get their own part).
    fn evaluate(&mut self) -> Result<f32> {
        let mut sum = 0.0f32;
        for i in 0..self.args.eval_batches {
            let (x, y) = self.corpus.windows(
                Split::Val,
                self.args.train.batch_size,
                self.args.seq_len,
                self.args.train.seed,
                self.t.pg.rank(),
                i,
                &self.device,
            )?;
            let logits = self.gpt.logits(&mut self.t.model, &x, false)?;
            sum += lm_loss(&logits, &y)?.to_scalar::<f32>()?;
        }
        let sums = self
            .t
            .sum_to_rank0(vec![sum, self.args.eval_batches as f32])?;
        Ok(sums[0] / sums[1])
    }

    /// Continues `--prompt` by `--sample-len` bytes, each drawn from the softmax of the last
    /// position's logits at `--temperature` (the context is the last `--seq-len` bytes). Every
    /// rank draws the same bytes (same seed): the forwards are collectives.
    fn generate(&mut self) -> Result<String> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.args.train.seed ^ 0x5341_4d50_4c45);
        let mut tokens: Vec<u32> = self.args.prompt.bytes().map(u32::from).collect();
        let t_max = self.args.seq_len;
        for _ in 0..self.args.sample_len {
            let ctx = &tokens[tokens.len().saturating_sub(t_max)..];
            let ids = Tensor::new(ctx, &self.device)?.unsqueeze(0)?;
            let logits = self.gpt.logits(&mut self.t.model, &ids, false)?;
            let last = logits.get(0)?.get(ctx.len() - 1)?.to_dtype(DType::F32)?;
            let probs = candle_nn::ops::softmax(&(last / self.args.temperature)?, D::Minus1)?
                .to_vec1::<f32>()?;
            tokens.push(sample(&probs, rng.random::<f32>()));
        }
        let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Saves a sharded checkpoint at the current step (the data order needs no sampler state:
    /// the batches of a step depend on the step).
    fn save(&self) -> Result<()> {
        self.t.save(TrainState::default())
    }
}

/// The index where the cumulative sum of `probs` passes `u` (in `[0, 1)`); the last index
/// when rounding leaves the sum below `u`.
fn sample(probs: &[f32], u: f32) -> u32 {
    let mut acc = 0.0f32;
    for (i, &p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return i as u32;
        }
    }
    probs.len().saturating_sub(1) as u32
}
