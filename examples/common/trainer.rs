//! The pieces of a training loop every example shares, whatever its loop looks like (MNIST's
//! epochs in [`super::train`], the GPT's steps): one rank's [`Trainer`] (model, optimizer, grad
//! scaler, tracer, step counter, run id) with its resume, micro-batch, optimizer-step, save and
//! report methods, [`run_job`] (launch the ranks, then write the trace), and
//! [`print_checkpoint`].
//!
//! Each call of the runtime's public API that these pieces make is made in one place below, so
//! an API change is one edit.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use candle_core::Tensor;
use candle_fsdp::checkpoint::{self, RngState, TrainState};
use candle_fsdp::clip::clip_grad_norm;
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::fsdp::FsdpModelBuilder;
use candle_fsdp::grad_scaler::{GradScalerConfig, ShardedGradScaler};
use candle_fsdp::launch::{launch, Launcher};
use candle_fsdp::timeline::render_timeline;
use candle_fsdp::trace::{
    chrome_trace_json, overlap_summary, OverlapSummary, Span, TraceSession, Tracer,
};
use candle_fsdp::{
    BackwardPrefetch, Error, FsdpConfig, FsdpModel, MemoryStats, MixedPrecision, Result,
    ShardedOptimizer,
};

use super::args::{AccumMode, TrainArgs};

pub use super::trace_window::trace_window;

/// Runs `rank` on every rank of `launcher` (each gets its process group and the trace session,
/// and returns its value and its traced spans), then writes the trace (with `--trace`); returns
/// rank 0's value in the process that runs rank 0 (`None` in the others, under `mpirun`).
pub fn run_job<R: Send>(
    args: &TrainArgs,
    launcher: &Launcher,
    rank: impl Fn(Arc<dyn ProcessGroup>, &TraceSession) -> Result<(R, Vec<Span>)> + Sync,
) -> anyhow::Result<Option<R>> {
    let session = TraceSession::new();
    let finals = launch(launcher, |pg| rank(pg, &session))?;
    let (mut values, mut spans) = (Vec::new(), Vec::new());
    for (value, rank_spans) in finals {
        values.push(value);
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
    Ok(has_rank0.then(|| values.swap_remove(0)))
}

/// Prints this process's peak resident set size (`VmHWM`, Linux), with the ranks it ran: under
/// `mpirun` every process prints its own line, `rank r (this process): peak RSS N B (M MiB)`
/// (`ranks a..b of this process: …` for several), which `benches/scaling.sh` reads. Nothing
/// where the kernel does not say.
pub fn print_peak_rss(launcher: &Launcher) {
    if let Some(rss) = candle_fsdp::alloc::peak_rss_bytes() {
        let ranks = launcher.local_ranks();
        let heap = if candle_fsdp::alloc::is_counting() {
            let h = candle_fsdp::alloc::peak_bytes();
            format!(", peak heap {h} B ({:.1} MiB)", h as f64 / (1 << 20) as f64)
        } else {
            String::new()
        };
        let who = if ranks.len() == 1 {
            format!("rank {} (this process)", ranks.start)
        } else {
            format!("ranks {}..{} of this process", ranks.start, ranks.end)
        };
        println!(
            "{who}: peak RSS {} B ({:.1} MiB){heap}",
            rss,
            rss as f64 / (1 << 20) as f64
        );
    }
}

/// Prints the newest checkpoint under `--checkpoint-dir` and the `fsdp-ckpt export` commands
/// for it: one model file (plain Candle and PyTorch load that file by name), and, when the run
/// stored a Hugging Face config, the directory in that layout (a LoRA run: its PEFT adapters
/// and the merged model); nothing when there is none.
pub fn print_checkpoint(args: &TrainArgs) -> anyhow::Result<()> {
    let root = &args.checkpoint_dir;
    let Some(latest) = checkpoint::list_complete(root)?.pop() else {
        return Ok(());
    };
    let name = root.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    println!("checkpoint: {}", latest.display());
    let meta = checkpoint::read_meta(&latest).ok();
    let extra = |key: &str| {
        meta.as_ref()
            .is_some_and(|m| m.train.extra.contains_key(key))
    };
    // An adapter-only checkpoint (its frozen base left in the base's files) has no single
    // model file: its exports are the adapters and the merged model.
    let adapter_only = meta
        .as_ref()
        .is_some_and(|m| m.units.iter().any(|u| u.in_base));
    if !adapter_only {
        println!(
            "one model file from it: cargo run --release --bin fsdp-ckpt -- export {} --out \
             {name}.safetensors",
            latest.display()
        );
    }
    if extra(candle_fsdp::lora::LORA_CONFIG_KEY) {
        println!(
            "its adapters for PEFT: cargo run --release --bin fsdp-ckpt -- export {} --format \
             peft --out DIR [--base-model BASE]; the merged model: … --format hf --merge --out \
             DIR [--dtype bf16]",
            latest.display()
        );
    } else if extra(candle_fsdp::hf::HF_CONFIG_KEY) {
        // A run that stored its Hugging Face config (llama, gpt) publishes in that layout.
        println!(
            "a Hugging Face directory from it: cargo run --release --bin fsdp-ckpt -- export {} \
             --format hf --out DIR [--dtype bf16]",
            latest.display()
        );
    }
    Ok(())
}

/// Which restart of the job this process is (`TORCHELASTIC_RESTART_COUNT`, set by
/// `fsdp-run --max-restarts` and torchrun): 0 on a first start. A restarted process resumes
/// from the newest complete checkpoint as with `--resume`.
pub fn restart_count() -> u64 {
    std::env::var("TORCHELASTIC_RESTART_COUNT")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A checkpoint [`Trainer::resume`] loaded.
pub struct Resumed {
    /// Its directory.
    pub dir: PathBuf,
    /// Its training state (the step is already the trainer's).
    pub train: TrainState,
}

/// One rank's training state, shared by every example's loop.
pub struct Trainer<'a, O> {
    /// The flags.
    pub args: &'a TrainArgs,
    /// This rank's process group.
    pub pg: Arc<dyn ProcessGroup>,
    /// The model.
    pub model: FsdpModel,
    /// The optimizer.
    pub optim: O,
    /// Dynamic loss scaling, under f16 only.
    scaler: Option<ShardedGradScaler>,
    tracer: Option<Arc<Tracer>>,
    /// Optimizer steps taken (restored on resume; names the checkpoints).
    pub step: u64,
    /// The run its checkpoints belong to: fresh, or the resumed checkpoint's.
    run_id: Option<String>,
    /// An asynchronous save not yet published (`--async-save`).
    pending: std::cell::RefCell<Option<checkpoint::PendingSave>>,
}

impl<'a, O: ShardedOptimizer + 'static> Trainer<'a, O> {
    /// Builds the model (the units `units` adds to the builder, with the FSDP configuration of
    /// the flags: strategy, seed, prefetch, precision), the grad scaler (f16) and the tracer
    /// (`--trace`, off until [`Trainer::set_tracing`]) of one rank.
    pub fn new(
        args: &'a TrainArgs,
        pg: Arc<dyn ProcessGroup>,
        session: &TraceSession,
        units: impl FnOnce(FsdpModelBuilder) -> FsdpModelBuilder,
        optim: O,
    ) -> Result<Self> {
        let builder_pg = pg.clone();
        Self::with_build(
            args,
            pg,
            session,
            |config| units(FsdpModel::builder(builder_pg, config)).build(),
            optim,
        )
    }

    /// As [`Trainer::new`], the model made by `build` from the FSDP configuration of the flags
    /// (e.g. read from a Hugging Face directory instead of initialised).
    pub fn with_build(
        args: &'a TrainArgs,
        pg: Arc<dyn ProcessGroup>,
        session: &TraceSession,
        build: impl FnOnce(FsdpConfig) -> Result<FsdpModel>,
        optim: O,
    ) -> Result<Self> {
        let mixed_precision = MixedPrecision::from_name(&args.precision)?;
        let scaler = if mixed_precision.uses_f16() {
            Some(ShardedGradScaler::new(GradScalerConfig::default())?)
        } else {
            None
        };
        let config = FsdpConfig {
            sharding_strategy: args.sharding_strategy(),
            reshard_after_forward_ranks: args.reshard_after_forward,
            seed: args.seed,
            forward_prefetch: !args.no_prefetch,
            backward_prefetch: if args.no_prefetch {
                BackwardPrefetch::None
            } else {
                BackwardPrefetch::BackwardPre
            },
            mixed_precision,
            device: pg.device().clone(),
            fingerprint: args.fingerprint.clone(),
            ..Default::default()
        };
        let mut model = build(config)?;
        let tracer = args.trace.as_ref().map(|_| {
            let t = session.tracer(pg.rank());
            t.set_enabled(false);
            t
        });
        model.set_tracer(tracer.clone());
        Ok(Self {
            args,
            pg,
            model,
            optim,
            scaler,
            tracer,
            step: 0,
            run_id: None,
            pending: Default::default(),
        })
    }

    /// Whether `--trace` asked for a trace.
    pub fn tracing_requested(&self) -> bool {
        self.tracer.is_some()
    }

    /// Turns the tracer (`--trace`) on or off; nothing without one.
    pub fn set_tracing(&self, on: bool) {
        if let Some(t) = &self.tracer {
            t.set_enabled(on);
        }
    }

    /// The spans this rank traced (empty without `--trace`).
    pub fn spans(&self) -> Vec<Span> {
        self.tracer.as_ref().map(|t| t.spans()).unwrap_or_default()
    }

    /// Loads `--resume-from`, or the newest checkpoint with `--resume` or in a restarted job
    /// ([`restart_count`] > 0; none yet: a fresh start) (reporting the damaged ones it passed
    /// over), and restores the step, the run id and the grad scaler; `None` (a fresh run, with
    /// a fresh run id) otherwise. A checkpoint trained with another `--seed` is
    /// an error (the data order would change).
    pub fn resume(&mut self) -> Result<Option<Resumed>> {
        let loaded = match (&self.args.resume_from, self.args.resume) {
            (Some(dir), _) => Some(checkpoint::load_sharded(
                dir,
                &mut self.model,
                &mut self.optim,
            )?),
            (None, resume) if resume || restart_count() > 0 => checkpoint::load_latest(
                &self.args.checkpoint_dir,
                &mut self.model,
                &mut self.optim,
            )?,
            (None, _) => None,
        };
        let Some(loaded) = loaded else {
            self.run_id = Some(self.fresh_run_id()?);
            return Ok(None);
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
        if let (Some(s), Some(v)) = (&mut self.scaler, &train.grad_scaler) {
            s.load_state(
                serde_json::from_value(v.clone())
                    .map_err(|e| Error::InvalidArgument(format!("grad scaler state: {e}")))?,
            );
        }
        Ok(Some(Resumed {
            dir: loaded.dir,
            train,
        }))
    }

    /// A new run id, drawn on rank 0 and broadcast (a collective), so every rank (thread or
    /// process) saves under the same one.
    fn fresh_run_id(&self) -> Result<String> {
        let id = checkpoint::new_run_id();
        let halves = [&id[..16], &id[16..]].map(|h| u64::from_str_radix(h, 16).unwrap_or(0));
        let v = self.pg.broadcast_u64s(halves.to_vec(), 0)?;
        Ok(format!("{:016x}{:016x}", v[0], v[1]))
    }

    /// One micro-batch: `forward` computes its loss (a scalar, from a training forward of the
    /// model), then the backward of `loss / --grad-accum` (scaled by the grad scaler under
    /// f16; under `--accum-mode no-sync` only the last micro-batch of a step reduce-scatters).
    /// Returns the unscaled loss.
    pub fn forward_backward(
        &mut self,
        last_micro: bool,
        forward: impl FnOnce(&mut FsdpModel) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let sync = last_micro || self.args.accum_mode == AccumMode::ReduceScatter;
        self.model.set_requires_gradient_sync(sync);
        let loss = forward(&mut self.model)?;
        let micro_loss = (&loss / self.args.grad_accum as f64)?;
        match &self.scaler {
            Some(s) => self.model.backward(&s.scale_loss(&micro_loss)?)?,
            None => self.model.backward(&micro_loss)?,
        }
        Ok(loss)
    }

    /// The learning rate `lr` (if any), unscale (f16), clip (`--clip-grad-norm`), the
    /// optimizer step (skipped by the scaler on inf/NaN), zero the gradients, count the step.
    pub fn optimizer_step(&mut self, lr: Option<f64>) -> Result<()> {
        if let Some(lr) = lr {
            self.optim.set_learning_rate(lr);
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

    /// Sums `values` over the ranks onto rank 0 (every rank gets a vector; only rank 0's is the
    /// sum). A collective.
    pub fn sum_to_rank0(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        self.pg.reduce_f32s(values, 0, ReduceOp::Sum)
    }

    /// Saves a sharded checkpoint of `state` (its step, seed, grad scaler and run id are the
    /// trainer's), rotating to `--keep-last`, after publishing a pending asynchronous one. A
    /// collective.
    pub fn save(&self, state: TrainState) -> Result<()> {
        self.save_with(state, false)
    }

    /// A periodic (`--save-every`) save: asynchronous under `--async-save` (published at the
    /// next save), else [`Trainer::save`]. A collective.
    pub fn save_periodic(&self, state: TrainState) -> Result<()> {
        self.save_with(state, self.args.async_save)
    }

    fn save_with(&self, state: TrainState, background: bool) -> Result<()> {
        // At most one save in flight: the last one is published first.
        if let Some(p) = self.pending.borrow_mut().take() {
            p.wait()?;
        }
        let state = TrainState {
            step: self.step,
            rng: Some(RngState {
                seed: self.args.seed,
            }),
            grad_scaler: self
                .scaler
                .as_ref()
                .and_then(|s| serde_json::to_value(s.state()).ok()),
            run_id: self.run_id.clone(),
            ..state
        };
        let pending = checkpoint::save_sharded_async(
            &self.args.checkpoint_dir,
            &self.model,
            &self.optim,
            &state,
            self.args.keep_last,
        )?;
        if background {
            *self.pending.borrow_mut() = Some(pending);
        } else {
            pending.wait()?;
        }
        Ok(())
    }

    /// Rank 0's summary: training memory, the grad scaler (every process prints its peak RSS
    /// after the job, [`print_peak_rss`]).
    pub fn report(&self, train_mem: Option<MemoryStats>) {
        if let Some(m) = train_mem {
            let optimizer_bytes = self.optim.state_bytes();
            println!(
                "rank 0 training memory: sharded state {} B (+ optimizer {} B), peak unsharded \
                 parameters {} B, at most {} unit(s) unsharded at once",
                m.sharded_bytes, optimizer_bytes, m.peak_unsharded_bytes, m.peak_unsharded_units
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

/// Writes the trace JSON and the timeline pictures, and prints the overlap summary.
fn write_trace(path: &Path, spans: Vec<Span>, print: bool) -> anyhow::Result<()> {
    if spans.is_empty() {
        // The run trained no step (resumed at its end): nothing to write, and the work is done.
        if print {
            println!(
                "trace: no step was trained, so nothing was traced ({} not written)",
                path.display()
            );
        }
        return Ok(());
    }
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
