//! What the language-model examples (`gpt`, `llama`) share: their flags beyond the model's
//! shape ([`LmArgs`]) and the step loop on every rank ([`LmRank`]), over the shared pieces of
//! `common::trainer`. Each example gives its model ([`LanguageModel`]), its corpus
//! ([`Corpus`]), its tokens ([`Codec`]) and how the model is built. Included by each with
//! `#[path = "../common/lm.rs"] mod lm;` (the MNIST examples do not compile it).
//!
//! One optimizer step of a rank: for each of `--grad-accum` micro-batches, this rank's windows of
//! `(seed, rank, step · k + micro)`, a training forward through the units, the mean next-token
//! cross-entropy, its backward; then the learning rate of the step, unscale / clip / AdamW step
//! (the trainer's). Every `--log-interval` steps the micro-batch losses since the last line are
//! summed over the ranks onto rank 0, which prints them with the step time and tokens/s; every
//! `--eval-interval` steps and at the end each rank evaluates its share of the validation
//! windows (inference forwards, collectives) and rank 0 prints the mean. With `--eval-file`,
//! the file's loss ([`LmRank::eval_file`]) after training (only it with `--max-steps 0`).
//! Checkpoints every `--save-every` steps and at the end; at the very end every rank generates
//! the same sample (the forwards are collectives; the sampling is seeded alike) and rank 0
//! returns it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use candle_fsdp::checkpoint::TrainState;
use candle_fsdp::data::text::{Split, TextCorpus};
use candle_fsdp::lr_scheduler::LrSchedule;
use candle_fsdp::trace::{Span, TraceSession};
use candle_fsdp::{AdamW, AdamWConfig, FsdpConfig, FsdpModel, ParamGroup, Result};
use rand::{Rng, SeedableRng};

use super::common::trainer::{trace_window, Trainer};
use super::common::TrainArgs;

/// The language-model flags beyond the model's shape and `--seq-len`, flattened into each
/// example's `Args`.
#[derive(Debug, Clone, clap::Args)]
pub struct LmArgs {
    /// Optimizer steps to train (in total, counting resumed ones; 0 with --eval-file: only
    /// evaluate).
    #[arg(long, default_value_t = 300)]
    pub max_steps: u64,
    /// Linear warm-up steps of the learning rate (then a cosine decay to --max-steps).
    #[arg(long, default_value_t = 30)]
    pub warmup_steps: u64,
    /// Learning rate at --max-steps, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_factor: f64,
    /// AdamW weight decay of the weight matrices and embeddings (biases and norms get none).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// AdamW moments' dtype: f32, or bf16 (half the optimizer state; the update computed in
    /// f32, the moments rounded stochastically). CPU only.
    #[arg(long, default_value = "f32", value_name = "DTYPE")]
    pub optim_state_dtype: String,
    /// AdamW beta1.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    /// AdamW beta2.
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f64,
    /// Steps between loss lines.
    #[arg(long, default_value_t = 10)]
    pub log_interval: u64,
    /// Steps between validation losses (0: only at the end).
    #[arg(long, default_value_t = 100)]
    pub eval_interval: u64,
    /// Validation batches per rank (the same windows at every evaluation).
    #[arg(long, default_value_t = 8)]
    pub eval_batches: u64,
    /// A text file to evaluate after training (only it with --max-steps 0): rank 0 prints
    /// `eval loss X`, the mean next-token cross-entropy over its tokens cut into consecutive
    /// windows of --seq-len inputs plus one target (a last partial window dropped), the
    /// windows shared among the ranks.
    #[arg(long, value_name = "FILE")]
    pub eval_file: Option<PathBuf>,
    /// Tokens to generate at the end (0: no sample).
    #[arg(long, default_value_t = 300)]
    pub sample_len: usize,
    /// Sampling temperature of the generated sample.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Text the sample continues.
    #[arg(long, default_value = "ROMEO:")]
    pub prompt: String,
    /// The corpus: a text file, plain or gzipped (the last 5 % is the validation split); or,
    /// for the llama example, supervised examples: a .jsonl file of {"prompt", "completion"}
    /// or {"messages"} lines (the loss on the completions only).
    #[arg(long, default_value = "data/shakespeare/shakespeare.txt.gz")]
    pub data: PathBuf,
    /// Activation checkpointing of the blocks: each block keeps only its input and recomputes
    /// its forward in the backward (about a third more compute, far fewer activations).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub activation_checkpointing: bool,
    /// Memory budget of one rank in bytes: the runtime checks its plan (sharded state, units in
    /// flight, and the activations measured on a small probe before training) against it and
    /// fails at once, with the numbers, when the configuration cannot fit.
    #[arg(long, value_name = "BYTES")]
    pub max_memory_per_rank: Option<u64>,
}

impl LmArgs {
    /// The checks of these flags.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.log_interval >= 1, "--log-interval must be at least 1");
        self.state_dtype()?;
        anyhow::ensure!(self.eval_batches >= 1, "--eval-batches must be at least 1");
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.min_lr_factor),
            "--min-lr-factor must be in [0, 1], found {}",
            self.min_lr_factor
        );
        anyhow::ensure!(
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            "--weight-decay must be a finite number >= 0, found {}",
            self.weight_decay
        );
        for (flag, b) in [("--beta1", self.beta1), ("--beta2", self.beta2)] {
            anyhow::ensure!(
                (0.0..1.0).contains(&b),
                "{flag} must be in [0, 1), found {b}"
            );
        }
        anyhow::ensure!(
            self.temperature.is_finite() && self.temperature > 0.0,
            "--temperature must be a positive finite number, found {}",
            self.temperature
        );
        anyhow::ensure!(
            !self.prompt.is_empty() || self.sample_len == 0,
            "--prompt must not be empty (the sample continues it)"
        );
        Ok(())
    }

    /// `--optim-state-dtype` as a dtype (checked).
    pub fn state_dtype(&self) -> anyhow::Result<DType> {
        match self.optim_state_dtype.as_str() {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            other => anyhow::bail!("--optim-state-dtype must be f32 or bf16, found {other:?}"),
        }
    }

    /// AdamW's state bytes per trainable element under `--optim-state-dtype` (8 or 4), for the
    /// memory budget and plan.
    pub fn state_bytes_per_element(&self) -> usize {
        match self.state_dtype() {
            Ok(DType::BF16) => 4,
            _ => 8,
        }
    }

    /// AdamW of the flags (`lr`: `--lr`), with no weight decay on the parameters matching
    /// `no_decay` (biases and norm weights).
    pub fn optimizer(&self, lr: f64, no_decay: &[&str]) -> Result<AdamW> {
        let cfg = AdamWConfig {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            ..Default::default()
        };
        let group = ParamGroup::new(
            "no_decay",
            no_decay.iter().copied(),
            AdamWConfig {
                weight_decay: 0.0,
                ..cfg
            },
        );
        let dtype = self
            .state_dtype()
            .map_err(|e| candle_fsdp::Error::InvalidArgument(e.to_string()))?;
        AdamW::with_groups(cfg, vec![group]).with_state_dtype(dtype)
    }
}

/// A model the loop runs: logits `(B, T, V)` of ids `(B, T)`.
pub trait LanguageModel {
    /// A training (`train`) or inference forward of `model`, the tokens at `positions` `(B, T)`
    /// (packed examples) or `0..T`: a collective.
    fn logits(
        &self,
        model: &mut FsdpModel,
        ids: &Tensor,
        positions: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor>;
}

#[cfg(feature = "llama")]
impl LanguageModel for candle_fsdp::models::decoder::FsdpDecoder {
    fn logits(
        &self,
        model: &mut FsdpModel,
        ids: &Tensor,
        positions: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        candle_fsdp::models::decoder::FsdpDecoder::logits_at(self, model, ids, positions, train)
    }
}

/// A micro-batch: inputs and targets `(B, T)` u32, and the position ids `(B, T)` u32 of packed
/// examples (`None`: `0..T` in every row).
pub type LmBatch = (Tensor, Tensor, Option<Tensor>);

/// Training and validation windows of token ids.
pub trait Corpus: Sync {
    /// This rank's batch `index` of `split`: `(inputs, targets, positions)`, each `(batch,
    /// seq_len)` u32, the targets shifted by one token (as [`TextCorpus::windows`]); positions
    /// only for packed examples.
    #[allow(clippy::too_many_arguments)]
    fn windows(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        index: u64,
        device: &Device,
    ) -> Result<LmBatch>;

    /// Whether the targets hold [`candle_fsdp::nn::IGNORE_INDEX`] positions (supervised
    /// examples): the loss is then the per-token one, normalised over the step's target tokens
    /// on every rank ([`candle_fsdp::data::sft::token_scale`]).
    fn per_token(&self) -> bool {
        false
    }
}

/// Supervised examples (`--data FILE.jsonl`, [`candle_fsdp::data::sft`]): the last 5 % (at
/// least one) held out for validation; each batch draws its examples with replacement, seeded
/// by the seed, the split, the rank and the batch index (as the text windows draw starts).
/// The llama example's (the GPT example trains on text only).
#[allow(dead_code)]
pub struct SftCorpus {
    /// Training examples.
    pub train: Vec<candle_fsdp::data::sft::SftExample>,
    /// Validation examples.
    pub val: Vec<candle_fsdp::data::sft::SftExample>,
    /// The token a batch is padded with (to its longest example).
    pub pad: u32,
}

#[allow(dead_code)]
impl SftCorpus {
    /// Splits `examples` (at least two) into training and validation; batches padded with
    /// `pad`.
    pub fn new(
        mut examples: Vec<candle_fsdp::data::sft::SftExample>,
        pad: u32,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            examples.len() >= 2,
            "--data: {} example(s); at least 2 (one is held out for validation)",
            examples.len()
        );
        let n_val = (examples.len() / 20).max(1);
        let val = examples.split_off(examples.len() - n_val);
        Ok(Self {
            train: examples,
            val,
            pad,
        })
    }

    /// The training examples' tokens (no padding).
    pub fn tokens(&self) -> usize {
        self.train.iter().map(|e| e.len()).sum()
    }
}

impl Corpus for SftCorpus {
    fn windows(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        index: u64,
        device: &Device,
    ) -> Result<LmBatch> {
        let pool = match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        };
        if let Some(e) = pool.iter().find(|e| e.len() > seq_len) {
            return Err(candle_fsdp::Error::InvalidArgument(format!(
                "a supervised example of {} tokens, longer than --seq-len {seq_len}",
                e.len()
            )));
        }
        let split_id = u64::from(matches!(split, Split::Val));
        let mut rng = rand::rngs::StdRng::seed_from_u64(
            seed ^ (split_id << 62) ^ ((rank as u64) << 40) ^ index.wrapping_mul(0x9E37_79B9),
        );
        let picked: Vec<&candle_fsdp::data::sft::SftExample> = (0..batch)
            .map(|_| &pool[rng.random_range(0..pool.len())])
            .collect();
        candle_fsdp::data::sft::batch(&picked, self.pad, device)
    }

    fn per_token(&self) -> bool {
        true
    }
}

impl Corpus for TextCorpus {
    fn windows(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        index: u64,
        device: &Device,
    ) -> Result<LmBatch> {
        let (x, y) = TextCorpus::windows(self, split, batch, seq_len, seed, rank, index, device)?;
        Ok((x, y, None))
    }
}

/// Text to token ids and back.
pub trait Codec: Sync {
    /// The ids of `text`.
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>>;
    /// The text of `ids` (lossy).
    fn decode(&self, ids: &[u32]) -> String;
    /// The ids of a file's bytes: [`Codec::encode`] of them as UTF-8 (an error naming the
    /// first byte that is not); byte codecs take any bytes.
    fn encode_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<u32>> {
        let text = std::str::from_utf8(bytes).map_err(|e| {
            anyhow::anyhow!(
                "not UTF-8 text (byte {} is not part of a UTF-8 character), which a tokenizer \
                 needs",
                e.valid_up_to()
            )
        })?;
        self.encode(text)
    }
}

/// Bytes are tokens (vocabulary 256).
pub struct Bytes;

impl Codec for Bytes {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every byte is a token, UTF-8 or not (as the byte corpus of `--data` trains on).
    fn encode_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<u32>> {
        Ok(bytes.iter().map(|&b| u32::from(b)).collect())
    }
}

/// The tokens of `--eval-file` `path`, checked before any model is built or step trained: at
/// least one window of `seq_len` inputs plus one target.
///
/// Errors, naming the flag and the file: unreadable or not UTF-8; fewer than `seq_len + 1`
/// tokens (an empty file included); the codec's.
pub fn read_eval_file(
    path: &std::path::Path,
    codec: &dyn Codec,
    seq_len: usize,
) -> anyhow::Result<Vec<u32>> {
    let bytes = std::fs::read(path)
        .map_err(|e| anyhow::anyhow!("--eval-file {}: cannot read it: {e}", path.display()))?;
    let tokens = codec
        .encode_bytes(&bytes)
        .map_err(|e| anyhow::anyhow!("--eval-file {}: {e}", path.display()))?;
    anyhow::ensure!(
        tokens.len() > seq_len,
        "--eval-file {}: {} tokens, too few for one window of --seq-len {seq_len} ({} tokens: \
         the inputs and one target)",
        path.display(),
        tokens.len(),
        seq_len + 1
    );
    Ok(tokens)
}

/// Mean next-token cross-entropy of `logits` `(B, T, V)` against `targets` `(B, T)`, f32.
fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.flatten_to(1)?.to_dtype(DType::F32)?;
    Ok(candle_fsdp::nn::cross_entropy(
        &logits,
        &targets.flatten_all()?,
    )?)
}

/// What rank 0 saw.
pub struct Outcome {
    /// Optimizer steps this run took (0: nothing left to train).
    pub steps_trained: u64,
    /// The generated text (prompt included), when `--sample-len` > 0.
    pub sample: Option<String>,
    /// The `--eval-file` loss, when asked for.
    pub eval_loss: Option<f32>,
}

/// What an example gives the loop besides the flags.
pub struct LmParts<'a, M> {
    /// The model's units.
    pub model: M,
    /// Context length.
    pub seq_len: usize,
    /// The corpus.
    pub corpus: &'a dyn Corpus,
    /// Its tokens.
    pub codec: &'a dyn Codec,
    /// The tokens of `--eval-file`, when given.
    pub eval_tokens: Option<&'a [u32]>,
    /// Patterns of the parameters without weight decay.
    pub no_decay: &'a [&'a str],
    /// Stored in every checkpoint's `TrainState::extra` (e.g. the Hugging Face config).
    pub extra: BTreeMap<String, String>,
}

/// One rank's step loop.
pub struct LmRank<'a, M> {
    args: &'a LmArgs,
    train: &'a TrainArgs,
    parts: LmParts<'a, M>,
    t: Trainer<'a, AdamW>,
    device: Device,
}

impl<'a, M: LanguageModel> LmRank<'a, M> {
    /// The rank's trainer, its model made by `build` from the flags' FSDP configuration; rank
    /// 0 prints the memory plan (`activation_bytes`: the measured estimate, if any).
    pub fn new(
        args: &'a LmArgs,
        train: &'a TrainArgs,
        parts: LmParts<'a, M>,
        pg: std::sync::Arc<dyn candle_fsdp::comm::ProcessGroup>,
        session: &TraceSession,
        activation_bytes: Option<usize>,
        build: impl FnOnce(FsdpConfig) -> Result<FsdpModel>,
    ) -> Result<Self> {
        let device = pg.device().clone();
        let optim = args.optimizer(train.lr, parts.no_decay)?;
        let t = Trainer::with_build(train, pg, session, build, optim)?;
        if t.pg.rank() == 0 {
            println!(
                "memory plan: {}{}",
                t.model.memory_plan(
                    args.state_bytes_per_element(),
                    activation_bytes.unwrap_or(0)
                ),
                if activation_bytes.is_none() {
                    " (activations not measured: they are with --max-memory-per-rank)"
                } else {
                    ""
                }
            );
        }
        Ok(Self {
            args,
            train,
            parts,
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
        self.train.lr * factor
    }

    /// Resumes (with `--resume`), trains to `--max-steps`, evaluates, saves, samples.
    pub fn run(mut self) -> Result<(Outcome, Vec<Span>)> {
        let rank = self.t.pg.rank();
        if let Some(r) = self.t.resume()? {
            if rank == 0 {
                println!("resumed from {} (step {})", r.dir.display(), self.t.step);
            }
        }
        if self.args.max_steps == 0 && self.parts.eval_tokens.is_some() {
            let eval_loss = Some(self.eval_file()?);
            let outcome = Outcome {
                steps_trained: 0,
                sample: None,
                eval_loss,
            };
            return Ok((outcome, self.t.spans()));
        }
        let (start, max) = (self.t.step, self.args.max_steps);
        let (ws, b, t) = (
            self.t.pg.world_size(),
            self.train.batch_size,
            self.parts.seq_len,
        );
        let k = self.train.grad_accum;
        let tokens_per_step = (ws * b * t * k) as f64;
        let per_token = self.parts.corpus.per_token();
        // Since the last loss line: summed micro-batch losses, their number, training time;
        // supervised batches: this rank's tokens (padded to each batch's longest) and targets.
        let (mut loss_sum, mut micro, mut busy, mut steps) = (0.0f64, 0usize, 0.0f64, 0u64);
        let (mut tokens, mut targets) = (0usize, 0usize);
        let (mut train_mem, mut train_comm) = (None, None);
        for step in start..max {
            let t0 = Instant::now();
            let comm0 = self.t.model.comm_stats();
            let traced = trace_window((max - start) as usize, self.train.trace_steps);
            self.t
                .set_tracing(traced.contains(&((step - start) as usize)));
            // The step's micro-batches, made once (a per-token loss counts their targets first).
            let batches = (0..k)
                .map(|m| self.train_batch(step * k as u64 + m as u64))
                .collect::<Result<Vec<_>>>()?;
            let factor = self.token_factor(&batches)?;
            if let Some((_, local)) = factor {
                tokens += batches
                    .iter()
                    .map(|(x, _, _)| x.elem_count())
                    .sum::<usize>();
                targets += local;
            }
            let factor = factor.map(|(f, _)| f);
            for (m, batch) in batches.into_iter().enumerate() {
                let loss = self.micro_batch(batch, m + 1 == k, factor)?;
                loss_sum += loss as f64;
                micro += 1;
            }
            let lr = self.learning_rate(step);
            self.t.optimizer_step(Some(lr))?;
            busy += t0.elapsed().as_secs_f64();
            steps += 1;
            let done = step + 1;
            if done % self.args.log_interval == 0 || done == max {
                let sums = self.t.sum_to_rank0(vec![
                    loss_sum as f32,
                    micro as f32,
                    tokens as f32,
                    targets as f32,
                ])?;
                if rank == 0 {
                    // Supervised batches are padded to their longest example, not --seq-len:
                    // their own tokens count, and the targets (what packing does not change).
                    let (tok, extra) = if per_token {
                        (
                            sums[2] as f64 / busy,
                            format!("  {:.0} target tok/s", sums[3] as f64 / busy),
                        )
                    } else {
                        (tokens_per_step * steps as f64 / busy, String::new())
                    };
                    println!(
                        "step {done:>6}/{max}  loss {:.4}  lr {lr:.2e}  {:.1} ms/step  {tok:.0} \
                         tok/s{extra}",
                        sums[0] / sums[1],
                        1e3 * busy / steps as f64,
                    );
                }
                (loss_sum, micro, busy, steps) = (0.0, 0, 0.0, 0);
                (tokens, targets) = (0, 0);
            }
            if done == max {
                // Memory of training (evaluation and sampling gather again), and the last
                // step's traffic.
                train_mem = Some(self.t.model.memory_stats());
                let comm = self.t.model.comm_stats();
                train_comm = Some(comm.zip_with(comm0, u64::wrapping_sub));
            }
            let interval = self.args.eval_interval;
            if (interval > 0 && done % interval == 0) || done == max {
                let val = self.evaluate()?;
                if rank == 0 {
                    println!("step {done:>6}/{max}  val loss {val:.4}");
                }
            }
            let save_every = self.train.save_every;
            if save_every > 0 && done % save_every == 0 && done < max {
                self.t.save_periodic(TrainState {
                    extra: self.parts.extra.clone(),
                    ..TrainState::default()
                })?;
            }
        }
        self.t.set_tracing(false);
        let steps_trained = max.saturating_sub(start);
        if steps_trained > 0 {
            self.save()?;
        }
        if rank == 0 && steps_trained > 0 {
            self.t.report(train_mem);
            if let Some(c) = train_comm {
                println!(
                    "rank 0 last step's traffic: all-gather {} B in {} calls, reduce-scatter {} B \
                     in {} calls",
                    c.all_gather_bytes,
                    c.all_gather_calls,
                    c.reduce_scatter_bytes,
                    c.reduce_scatter_calls
                );
            }
        }
        let eval_loss = match self.parts.eval_tokens {
            Some(_) => Some(self.eval_file()?),
            None => None,
        };
        let sample = if self.args.sample_len > 0 {
            Some(self.generate()?)
        } else {
            None
        };
        Ok((
            Outcome {
                steps_trained,
                sample,
                eval_loss,
            },
            self.t.spans(),
        ))
    }

    /// This rank's training micro-batch `index`.
    fn train_batch(&self, index: u64) -> Result<LmBatch> {
        self.parts.corpus.windows(
            Split::Train,
            self.train.batch_size,
            self.parts.seq_len,
            self.train.seed,
            self.t.pg.rank(),
            index,
            &self.device,
        )
    }

    /// The factor of each micro-batch's summed loss in a step of a per-token corpus
    /// ([`Corpus::per_token`]) whose micro-batches are `batches`: `token_scale` of their target
    /// tokens on this rank times their number `k` (the trainer divides each micro-batch's loss
    /// by `k`), so that the backward sees `sum · world / N` and the logged value averages to the
    /// step's per-token loss. `None` for a plain corpus. A collective when per-token.
    /// Also returns this rank's target tokens (the log's target tok/s).
    fn token_factor(&self, batches: &[LmBatch]) -> Result<Option<(f32, usize)>> {
        if !self.parts.corpus.per_token() {
            return Ok(None);
        }
        let k = batches.len();
        let mut local = 0usize;
        for (_, y, _) in batches {
            let y = y.flatten_all()?.to_vec1::<u32>()?;
            local += y
                .iter()
                .filter(|&&t| t != candle_fsdp::nn::IGNORE_INDEX)
                .count();
        }
        let scale = candle_fsdp::data::sft::token_scale(self.t.pg.as_ref(), local)?;
        Ok(Some((scale * k as f32, local)))
    }

    /// Forward and backward of one micro-batch `(inputs, targets, positions)`; returns its loss (with a
    /// per-token `factor`, the summed loss times it: see [`LmRank::token_factor`]).
    fn micro_batch(
        &mut self,
        (x, y, pos): LmBatch,
        last_micro: bool,
        factor: Option<f32>,
    ) -> Result<f32> {
        let lm = &self.parts.model;
        let loss = self.t.forward_backward(last_micro, |model| {
            let logits = lm.logits(model, &x, pos.as_ref(), true)?;
            match factor {
                None => lm_loss(&logits, &y),
                Some(f) => {
                    let (sum, _) = candle_fsdp::nn::lm_loss_sum(&logits, &y)?;
                    Ok(sum.affine(f as f64, 0.0)?)
                }
            }
        })?;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Mean validation loss over every rank's `--eval-batches` windows (the same at every
    /// evaluation); rank 0's value is the mean over all ranks (the others get their own part).
    fn evaluate(&mut self) -> Result<f32> {
        let (mut sum, mut count) = (0.0f32, 0.0f32);
        for i in 0..self.args.eval_batches {
            let (x, y, pos) = self.parts.corpus.windows(
                Split::Val,
                self.train.batch_size,
                self.parts.seq_len,
                self.train.seed,
                self.t.pg.rank(),
                i,
                &self.device,
            )?;
            let logits = self
                .parts
                .model
                .logits(&mut self.t.model, &x, pos.as_ref(), false)?;
            if self.parts.corpus.per_token() {
                // Summed over the target tokens; divided by their number over all ranks below.
                let (s, k) = candle_fsdp::nn::lm_loss_sum(&logits, &y)?;
                sum += s.to_scalar::<f32>()?;
                count += k as f32;
            } else {
                sum += lm_loss(&logits, &y)?.to_scalar::<f32>()?;
                count += 1.0;
            }
        }
        let sums = self.t.sum_to_rank0(vec![sum, count])?;
        Ok(sums[0] / sums[1])
    }

    /// The `--eval-file` loss: its tokens cut into `n = (len − 1) / seq_len` consecutive
    /// windows, window `w` the inputs `tokens[w·T .. (w+1)·T]` and the targets one further
    /// (a last partial window dropped); window `w` is rank `w mod world`'s, evaluated
    /// `--batch-size` at a time; the per-token losses are summed over the ranks. Every rank runs
    /// the same number of forwards (they are collectives): a rank out of windows runs window 0
    /// again and counts nothing. Rank 0 prints and returns `eval loss X`, the mean over all
    /// `n · T` targets.
    ///
    /// Errors: fewer than `seq_len + 1` tokens (which [`read_eval_file`] refuses earlier); the
    /// forwards'.
    pub fn eval_file(&mut self) -> Result<f32> {
        let tokens = self.parts.eval_tokens.expect("--eval-file given");
        let t = self.parts.seq_len;
        let n = tokens.len().saturating_sub(1) / t;
        if n == 0 {
            return Err(candle_fsdp::Error::InvalidArgument(format!(
                "--eval-file has {} tokens, too few for one window of --seq-len {t} (+1)",
                tokens.len()
            )));
        }
        let (rank, ws) = (self.t.pg.rank(), self.t.pg.world_size());
        let b = self.train.batch_size;
        let mine: Vec<usize> = (rank..n).step_by(ws).collect();
        let rounds = n.div_ceil(ws).div_ceil(b);
        let (mut sum, mut count) = (0.0f64, 0usize);
        for r in 0..rounds {
            let batch: Vec<usize> = mine.iter().skip(r * b).take(b).copied().collect();
            let real = batch.len();
            let windows = if real == 0 { vec![0] } else { batch };
            let mut x = Vec::with_capacity(windows.len() * t);
            let mut y = Vec::with_capacity(windows.len() * t);
            for &w in &windows {
                x.extend_from_slice(&tokens[w * t..(w + 1) * t]);
                y.extend_from_slice(&tokens[w * t + 1..(w + 1) * t + 1]);
            }
            let rows = windows.len();
            let x = Tensor::from_vec(x, (rows, t), &self.device)?;
            let y = Tensor::from_vec(y, (rows, t), &self.device)?;
            let logits = self
                .parts
                .model
                .logits(&mut self.t.model, &x, None, false)?;
            if real > 0 {
                let loss = lm_loss(&logits, &y)?.to_scalar::<f32>()? as f64;
                sum += loss * (rows * t) as f64;
                count += rows * t;
            }
        }
        let sums = self.t.sum_to_rank0(vec![sum as f32, count as f32])?;
        let loss = sums[0] / sums[1];
        if rank == 0 {
            println!("eval loss {loss:.6}");
        }
        Ok(loss)
    }

    /// Continues `--prompt` by `--sample-len` tokens, each drawn from the softmax of the last
    /// position's logits at `--temperature` (the context is the last `--seq-len` tokens). Every
    /// rank draws the same tokens (same seed): the forwards are collectives.
    fn generate(&mut self) -> Result<String> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.train.seed ^ 0x5341_4d50_4c45);
        let mut tokens = self
            .parts
            .codec
            .encode(&self.args.prompt)
            .map_err(|e| candle_fsdp::Error::InvalidArgument(format!("--prompt: {e}")))?;
        let t_max = self.parts.seq_len;
        for _ in 0..self.args.sample_len {
            let ctx = &tokens[tokens.len().saturating_sub(t_max)..];
            let ids = Tensor::new(ctx, &self.device)?.unsqueeze(0)?;
            let logits = self
                .parts
                .model
                .logits(&mut self.t.model, &ids, None, false)?;
            let last = logits.get(0)?.get(ctx.len() - 1)?.to_dtype(DType::F32)?;
            let probs = candle_nn::ops::softmax(&(last / self.args.temperature)?, D::Minus1)?
                .to_vec1::<f32>()?;
            tokens.push(sample(&probs, rng.random::<f32>()));
        }
        Ok(self.parts.codec.decode(&tokens))
    }

    /// Saves a sharded checkpoint at the current step (the data order needs no sampler state:
    /// the batches of a step depend on the step), with the example's extra values.
    fn save(&self) -> Result<()> {
        self.t.save(TrainState {
            extra: self.parts.extra.clone(),
            ..TrainState::default()
        })
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

/// Activations one training step keeps per rank, from `held(layers)`: the bytes a plain-Candle
/// probe of `layers` blocks of this shape still holds after its forward and loss at the
/// per-rank batch (counting allocator, `candle_fsdp::alloc`). With one and two layers, the
/// difference is one block's activations and the rest the embeddings, final norm and logits.
/// Estimate: `rest + n_layer · block` bytes; with checkpointed blocks, the smaller of that and
/// `rest + n_layer · input + block`, where a block's saved input is `input_bytes`
/// (`batch · seq_len · d_model` f32 values) and one block's activations exist at a time (its
/// recompute in the backward).
///
/// Errors: the counting allocator is not installed; the probe's.
pub fn activation_estimate(
    n_layer: usize,
    input_bytes: usize,
    checkpointed: bool,
    held: impl Fn(usize) -> anyhow::Result<usize>,
) -> anyhow::Result<usize> {
    anyhow::ensure!(
        candle_fsdp::alloc::is_counting(),
        "the activation probe needs candle_fsdp::alloc::Counting as the global allocator"
    );
    let (one, two) = (held(1)?, held(2)?);
    let block = two.saturating_sub(one);
    let rest = one.saturating_sub(block);
    let whole = rest + n_layer * block;
    Ok(if checkpointed {
        // Never more than without checkpointing (a block's input is among what it keeps).
        whole.min(rest + n_layer * input_bytes + block)
    } else {
        whole
    })
}
