//! Supervised fine-tuning data: `{"prompt": …, "completion": …}` JSON lines, tokenized into
//! fixed-length examples whose loss counts only the completion's tokens, and the per-token
//! normalisation of a step's loss over every rank and micro-batch (issue 33, fourth part).
//!
//! One example is `tokens = prompt ⧺ completion (⧺ eos)`, cut to `seq_len + 1` tokens; inputs
//! `tokens[..T]`, targets `tokens[1..]` with every target that is a prompt token replaced by
//! [`IGNORE_INDEX`], padded to `seq_len` (inputs with `pad`, targets with [`IGNORE_INDEX`]). The
//! loss is [`crate::nn::lm_loss_sum`] times [`token_scale`]: the gradients then equal those of
//! one process averaging over all target tokens of the step's global batch (Megatron-LM's
//! per-token loss; transformers' `num_items_in_batch`), whatever the split over ranks and
//! micro-batches, including ranks with no target token at all.
//!
//! Not here yet: `{"messages": […]}` rendered by a chat template, and packing several examples
//! into one sequence (positions restarting at each, attention confined to it).

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};
pub use crate::nn::IGNORE_INDEX;

/// One tokenized example: `inputs` and `targets`, each `seq_len` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    /// Input ids, padded.
    pub inputs: Vec<u32>,
    /// Next-token targets; [`IGNORE_INDEX`] at prompt and padding positions.
    pub targets: Vec<u32>,
}

impl SftExample {
    /// The example of `prompt` and `completion` ids (and `eos` after the completion) in
    /// `seq_len` positions, padded with `pad` (see the module docs).
    pub fn new(
        prompt: &[u32],
        completion: &[u32],
        eos: Option<u32>,
        seq_len: usize,
        pad: u32,
    ) -> Self {
        let mut tokens: Vec<u32> = prompt.iter().chain(completion).copied().collect();
        tokens.extend(eos);
        tokens.truncate(seq_len + 1);
        let n = tokens.len().saturating_sub(1);
        let mut inputs = tokens[..n].to_vec();
        // Target i is token i + 1: a target when it is a completion (or eos) token.
        let mut targets: Vec<u32> = (0..n)
            .map(|i| {
                if i + 1 >= prompt.len() {
                    tokens[i + 1]
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        inputs.resize(seq_len, pad);
        targets.resize(seq_len, IGNORE_INDEX);
        Self { inputs, targets }
    }

    /// The positions whose target counts.
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// Reads `path`, one JSON object per non-empty line with string fields `prompt` and
/// `completion`, tokenized by `tokenize`, into examples of `seq_len` ([`SftExample::new`]).
///
/// Errors, naming the file and the line: an unreadable file; a line that is not a JSON object
/// with both string fields (a `messages` line is named as not supported yet); a tokenizer
/// error; an example whose prompt fills the whole sequence (no completion token left to
/// learn); a file without examples.
pub fn read_jsonl(
    path: &Path,
    tokenize: &dyn Fn(&str) -> Result<Vec<u32>>,
    eos: Option<u32>,
    seq_len: usize,
    pad: u32,
) -> Result<Vec<SftExample>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |m: String| Error::file(path, format!("line {}: {m}", i + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
        if v.get("messages").is_some() {
            return Err(at(
                "a \"messages\" record: chat templates are not supported yet; write \
                 {\"prompt\": …, \"completion\": …} lines"
                    .into(),
            ));
        }
        let field = |k: &str| {
            v.get(k).and_then(|x| x.as_str()).ok_or_else(|| {
                at(format!(
                    "expected an object with string fields \"prompt\" and \"completion\", \
                     \"{k}\" is missing or not a string"
                ))
            })
        };
        let (prompt, completion) = (field("prompt")?, field("completion")?);
        let p = tokenize(prompt).map_err(|e| at(format!("tokenizing the prompt: {e}")))?;
        let c = tokenize(completion).map_err(|e| at(format!("tokenizing the completion: {e}")))?;
        let ex = SftExample::new(&p, &c, eos, seq_len, pad);
        if ex.target_count() == 0 {
            return Err(at(format!(
                "the prompt's {} tokens fill --seq-len {seq_len}: no completion token to learn",
                p.len()
            )));
        }
        out.push(ex);
    }
    if out.is_empty() {
        return Err(Error::file(path, "no example (empty file)"));
    }
    Ok(out)
}

/// The `(inputs, targets)` tensors `(B, seq_len)` u32 of `examples` on `device`.
///
/// Errors: no example, or examples of different lengths; Candle's.
pub fn batch(examples: &[&SftExample], device: &Device) -> Result<(Tensor, Tensor)> {
    let t = examples
        .first()
        .map(|e| e.inputs.len())
        .ok_or_else(|| Error::InvalidArgument("an SFT batch needs at least one example".into()))?;
    if examples.iter().any(|e| e.inputs.len() != t) {
        return Err(Error::InvalidArgument(
            "an SFT batch's examples differ in length".into(),
        ));
    }
    let b = examples.len();
    let x: Vec<u32> = examples.iter().flat_map(|e| e.inputs.clone()).collect();
    let y: Vec<u32> = examples.iter().flat_map(|e| e.targets.clone()).collect();
    Ok((
        Tensor::from_vec(x, (b, t), device)?,
        Tensor::from_vec(y, (b, t), device)?,
    ))
}

/// The factor of each micro-batch's summed loss ([`crate::nn::lm_loss_sum`]) in a step whose
/// micro-batches on this rank hold `local` target tokens in all: `world_size / N`, `N` the
/// target tokens of every rank's micro-batches (one all-reduce: a collective, every rank calls
/// it once per step before its first backward). The runtime averages gradients over the ranks,
/// hence the `world_size`; the gradient is then `(1/N) Σ` over the step's `N` tokens.
///
/// Errors: no target token on any rank (naming the step's emptiness); the collective's.
pub fn token_scale(pg: &dyn ProcessGroup, local: usize) -> Result<f32> {
    let n = pg.all_reduce_u64s(vec![local as u64], ReduceOp::Sum)?[0];
    if n == 0 {
        return Err(Error::InvalidArgument(
            "no target token on any rank in this step: every example's completion is empty".into(),
        ));
    }
    Ok((pg.world_size() as f64 / n as f64) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_the_completion_and_eos_only() {
        let ex = SftExample::new(&[10, 11, 12], &[20, 21], Some(2), 8, 0);
        assert_eq!(ex.inputs, [10, 11, 12, 20, 21, 0, 0, 0]);
        let i = IGNORE_INDEX;
        assert_eq!(ex.targets, [i, i, 20, 21, 2, i, i, i]);
        assert_eq!(ex.target_count(), 3);
        // Cut to seq_len + 1 tokens: the last target is the first token that does not fit.
        let ex = SftExample::new(&[10, 11], &[20, 21, 22, 23], None, 3, 0);
        assert_eq!(ex.inputs, [10, 11, 20]);
        assert_eq!(ex.targets, [i, 20, 21]);
    }
}
