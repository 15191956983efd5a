//! The GPT's part of the language-model loop (`common/lm.rs`): how its model is built, its
//! activation probe, the parameters without weight decay.

use candle_core::{DType, Device, Tensor};
use candle_fsdp::data::text::TextCorpus;
use candle_fsdp::hf::HF_CONFIG_KEY;
use candle_fsdp::launch::Launcher;
use candle_fsdp::models::gpt::{lm_loss, FsdpGpt, GptConfig};
use candle_fsdp::{FsdpModel, MemoryBudget};

use super::common::trainer::run_job;
use super::lm::{activation_estimate, Bytes, LmParts, LmRank, Outcome};
use super::Args;

/// Biases and LayerNorm weights (GPT-2's names): no weight decay.
const NO_DECAY: [&str; 4] = ["*.bias", "*.ln_1.weight", "*.ln_2.weight", "*.ln_f.weight"];

/// Trains the GPT `cfg` on `corpus` as `args` say, on the ranks of `launcher`; rank 0's
/// [`Outcome`] in the process that runs rank 0.
pub fn train(
    args: &Args,
    cfg: GptConfig,
    corpus: &TextCorpus,
    eval_tokens: Option<&[u32]>,
    launcher: &Launcher,
    budget: Option<MemoryBudget>,
) -> anyhow::Result<Option<Outcome>> {
    run_job(&args.train, launcher, |pg, session| {
        let gpt =
            FsdpGpt::new(cfg)?.with_activation_checkpointing(args.lm.activation_checkpointing);
        let parts = LmParts {
            model: gpt.clone(),
            seq_len: cfg.seq_len,
            corpus,
            codec: &Bytes,
            eval_tokens,
            no_decay: &NO_DECAY,
            // GPT-2's config.json, so that `fsdp-ckpt export --format hf` publishes a
            // checkpoint of this run for transformers.
            extra: [(
                HF_CONFIG_KEY.to_string(),
                cfg.hf_config("float32").to_string(),
            )]
            .into(),
        };
        let builder_pg = pg.clone();
        let activations = budget.map(|b| b.activation_bytes);
        LmRank::new(
            &args.lm,
            &args.train,
            parts,
            pg,
            session,
            activations,
            |mut config| {
                config.memory_budget = budget;
                gpt.add_units(FsdpModel::builder(builder_pg, config))
                    .build()
            },
        )?
        .run()
    })
}

/// Activations one training step keeps per rank ([`activation_estimate`]), measured on
/// plain-Candle probes ([`candle_fsdp::models::gpt::Gpt`]) of 1 and 2 layers of this shape
/// running a forward and the loss at the per-rank batch, in f32.
///
/// Errors: the counting allocator is not installed; Candle's.
pub fn measure_activation_bytes(
    cfg: &GptConfig,
    batch: usize,
    checkpointed: bool,
) -> anyhow::Result<usize> {
    use candle_fsdp::alloc;
    use candle_fsdp::models::gpt::Gpt;
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
    let input = batch * cfg.seq_len * cfg.d_model * 4;
    activation_estimate(cfg.n_layer, input, checkpointed, held)
}
