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
//! `{"messages": [{"role", "content"}, …]}` lines are rendered by the tokenizer's chat template
//! ([`ChatTemplate`], as transformers' `apply_chat_template` renders it): the prompt is every
//! message but the last (which must be the assistant's) with the generation prompt, the
//! completion the rest of the whole conversation's text.
//!
//! **Packing** ([`pack`]): instead of one padded example per sequence, several examples fill
//! one sequence of `seq_len` tokens, with position ids restarting at 0 at each (the decoder's
//! [`crate::models::decoder::FsdpDecoder::forward_at`] attends within each example and takes
//! its rotary angles at those ids), as TRL's `packing=True` with `padding_free` and
//! transformers' `DataCollatorWithFlattening` do. The loss and its gradients are those of the
//! same examples unpacked (a test checks it); only the padding's compute is gone.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};
pub use crate::nn::IGNORE_INDEX;

/// One tokenized example (or a packed sequence of several, [`pack`]): `inputs`, `targets` and
/// `positions`, each [`SftExample::len`] tokens, unpadded ([`batch`] pads a batch to its
/// longest sequence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    /// Input ids.
    pub inputs: Vec<u32>,
    /// Next-token targets; [`IGNORE_INDEX`] at prompt positions.
    pub targets: Vec<u32>,
    /// Position ids: `0..len` for one example; restarting at 0 at each example of a packed
    /// sequence ([`pack`]).
    pub positions: Vec<u32>,
    /// Whether prompt, completion and end of sequence did not fit `seq_len + 1` tokens and
    /// were cut ([`SftExample::new`]).
    pub truncated: bool,
}

impl SftExample {
    /// The example of `prompt` and `completion` ids (and `eos` after the completion), cut to
    /// `seq_len + 1` tokens (see the module docs): `min(tokens − 1, seq_len)` positions.
    pub fn new(prompt: &[u32], completion: &[u32], eos: Option<u32>, seq_len: usize) -> Self {
        let mut tokens: Vec<u32> = prompt.iter().chain(completion).copied().collect();
        tokens.extend(eos);
        let truncated = tokens.len() > seq_len.saturating_add(1);
        tokens.truncate(seq_len.saturating_add(1));
        let n = tokens.len().saturating_sub(1);
        let inputs = tokens[..n].to_vec();
        // Target i is token i + 1: a target when it is a completion (or eos) token.
        let targets: Vec<u32> = (0..n)
            .map(|i| {
                if i + 1 >= prompt.len() {
                    tokens[i + 1]
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        Self {
            inputs,
            targets,
            positions: (0..n as u32).collect(),
            truncated,
        }
    }

    /// Positions (tokens) of the example or packed sequence.
    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Whether it has no position.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Whether the example is one sequence at positions `0..len` (not packed): what [`batch`]
    /// leaves without position ids.
    pub fn is_plain(&self) -> bool {
        self.positions
            .iter()
            .enumerate()
            .all(|(i, &p)| p as usize == i)
    }

    /// The positions whose target counts.
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, … (what the template knows).
    pub role: String,
    /// The text.
    pub content: String,
}

/// A tokenizer's chat template (`tokenizer_config.json`'s `chat_template`), rendered as
/// transformers renders it: Jinja with `trim_blocks` and `lstrip_blocks`, `raise_exception`,
/// Python's string methods (minijinja's pycompat), and the special tokens (`bos_token`,
/// `eos_token`, …) as variables.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    special: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// The template `source` with the special tokens `special` (name → text, e.g.
    /// `bos_token` → `<s>`).
    ///
    /// Errors: a template that does not parse (the parser's message).
    pub fn new(source: &str, special: BTreeMap<String, String>) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::InvalidArgument(format!("chat template: {e}")))?;
        Ok(Self { env, special })
    }

    /// The chat template of a `tokenizer_config.json` (its `chat_template`: a string, or the
    /// entry named `default` of a list of `{name, template}`), with its special tokens
    /// (`bos_token`, `eos_token`, `unk_token`, `pad_token`: strings or `{"content": …}`);
    /// `None` when it has none.
    ///
    /// Errors, naming the file: unreadable, not JSON, a template that does not parse.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not JSON: {e}")))?;
        let source = match &v["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(list) => match list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
            {
                Some(s) => s.to_string(),
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        let special = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .iter()
            .filter_map(|k| {
                let t = &v[*k];
                t.as_str()
                    .or_else(|| t["content"].as_str())
                    .map(|s| (k.to_string(), s.to_string()))
            })
            .collect();
        Self::new(&source, special)
            .map(Some)
            .map_err(|e| Error::file(path, e.to_string()))
    }

    /// The text of `messages` (`add_generation_prompt`: followed by the assistant's turn
    /// opening, as for generation).
    ///
    /// Errors: the template's (`raise_exception`, an undefined operation), with its message.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self.env.get_template("chat").expect("added in new");
        let mut ctx: BTreeMap<String, minijinja::Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from(v.clone())))
            .collect();
        ctx.insert(
            "messages".into(),
            minijinja::Value::from_serialize(messages),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        t.render(ctx)
            .map_err(|e| Error::InvalidArgument(format!("chat template: {e}")))
    }

    /// A conversation as a supervised example's texts: the prompt (every message but the
    /// last, with the generation prompt) and the completion (the rest of the whole
    /// conversation's text).
    ///
    /// Errors: no message, a last message that is not the assistant's, a template whose prompt
    /// is not the start of the whole conversation's text; the template's.
    pub fn prompt_and_completion(&self, messages: &[Message]) -> Result<(String, String)> {
        let Some(last) = messages.last() else {
            return Err(Error::missing(
                "message in the conversation",
                "a supervised conversation ends with the assistant's message (its completion)",
            ));
        };
        if last.role != "assistant" {
            return Err(Error::InvalidArgument(format!(
                "the last message is the {}'s: a supervised conversation ends with the \
                 assistant's (its completion)",
                last.role
            )));
        }
        let prompt = self.render(&messages[..messages.len() - 1], true)?;
        let full = self.render(messages, false)?;
        match full.strip_prefix(&prompt) {
            Some(completion) => Ok((prompt, completion.to_string())),
            None => Err(Error::InvalidArgument(
                "the chat template's text of the conversation does not start with its prompt \
                 (all but the last message, with the generation prompt): the completion cannot \
                 be told apart"
                    .into(),
            )),
        }
    }
}

/// Reads `path` (a leading UTF-8 byte-order mark skipped), one JSON object per non-empty line,
/// tokenized by `tokenize`, into examples of at most `seq_len` ([`SftExample::new`]; longer
/// ones cut and marked [`SftExample::truncated`]): `{"prompt": …, "completion": …}` (the completion then
/// followed by `eos`), or `{"messages": [{"role", "content"}, …]}` rendered by `template`
/// ([`ChatTemplate::prompt_and_completion`]; the template writes its own end-of-turn marks).
///
/// Errors, naming the file and the line: an unreadable file; a line that is not a JSON object
/// with both string fields, or with `messages` that are not role/content objects; a
/// `messages` line without a template; the template's; a tokenizer error; a file without
/// examples, or whose every example's prompt fills the whole sequence. An example whose prompt
/// fills the whole sequence (no completion token to learn) is skipped, its line listed in
/// [`SftFile::skipped`] (TRL trains on such an example's zero completion tokens: nothing).
pub fn read_jsonl(
    path: &Path,
    tokenize: &dyn Fn(&str) -> Result<Vec<u32>>,
    template: Option<&ChatTemplate>,
    eos: Option<u32>,
    seq_len: usize,
) -> Result<SftFile> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    // A UTF-8 byte-order mark (some editors write one) is not part of the first line's JSON.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |m: String| Error::file(path, format!("line {}: {m}", i + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
        if let Some(m) = v.get("messages") {
            let messages: Vec<Message> = serde_json::from_value(m.clone()).map_err(|e| {
                at(format!(
                    "\"messages\" must be a list of {{\"role\", \"content\"}} strings: {e}"
                ))
            })?;
            let Some(t) = template else {
                return Err(at(
                    "a \"messages\" record needs the tokenizer's chat template \
                     (tokenizer_config.json with chat_template beside the model)"
                        .into(),
                ));
            };
            let (prompt, completion) = t
                .prompt_and_completion(&messages)
                .map_err(|e| at(e.to_string()))?;
            let p = tokenize(&prompt).map_err(|e| at(format!("tokenizing the prompt: {e}")))?;
            let c =
                tokenize(&completion).map_err(|e| at(format!("tokenizing the completion: {e}")))?;
            let ex = SftExample::new(&p, &c, None, seq_len);
            if ex.target_count() == 0 && p.len() < seq_len {
                return Err(at(
                    "the template's completion is empty: nothing to learn".into()
                ));
            }
            if ex.target_count() == 0 {
                skipped.push(i + 1);
            } else {
                out.push(ex);
            }
            continue;
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
        let ex = SftExample::new(&p, &c, eos, seq_len);
        if c.is_empty() && eos.is_none() {
            return Err(at(
                "the completion is empty (and no end-of-sequence token follows it): nothing \
                 to learn"
                    .into(),
            ));
        }
        if ex.target_count() == 0 {
            skipped.push(i + 1);
        } else {
            out.push(ex);
        }
    }
    if out.is_empty() && !skipped.is_empty() {
        return Err(Error::file(
            path,
            format!(
                "every example's prompt would fill --seq-len {seq_len} ({}): no completion token to \
                 learn",
                lines_list(&skipped)
            ),
        ));
    }
    if out.is_empty() {
        return Err(Error::file(path, "no example (empty file)"));
    }
    Ok(SftFile {
        examples: out,
        skipped,
    })
}

/// What [`read_jsonl`] read from a file.
#[derive(Debug, Clone)]
pub struct SftFile {
    /// The examples, in the file's order.
    pub examples: Vec<SftExample>,
    /// Lines (from 1) of the examples skipped because their prompt fills the whole sequence.
    pub skipped: Vec<usize>,
}

/// `line 3`, `lines 3, 9, 27` or, past eight, `lines 3, 9, … (12 lines)`: the lines of
/// `lines` for a message (`no line` for none).
pub fn lines_list(lines: &[usize]) -> String {
    let shown: Vec<String> = lines.iter().take(8).map(|l| l.to_string()).collect();
    match lines.len() {
        0 => "no line".to_string(),
        1 => format!("line {}", shown[0]),
        n if n <= 8 => format!("lines {}", shown.join(", ")),
        n => format!("lines {}, … ({n} lines)", shown.join(", ")),
    }
}

/// Packs `examples` (each at most `seq_len` tokens) into sequences of at most `seq_len`
/// tokens, several examples each, by best-fit decreasing (the longest example first, each into
/// the fullest sequence it fits; TRL's `bfd` packing): each example keeps its inputs and
/// targets, its positions restart at 0. Every target token is kept once, so the per-token loss
/// over the sequences is the loss over the examples. Deterministic: examples of equal length
/// keep their order.
///
/// Errors: an example longer than `seq_len` (read with a larger `seq_len`), naming it.
pub fn pack(examples: &[SftExample], seq_len: usize) -> Result<Vec<SftExample>> {
    if let Some((i, e)) = examples.iter().enumerate().find(|(_, e)| e.len() > seq_len) {
        return Err(Error::shape(
            format_args!("example {i}"),
            format_args!("at most {seq_len} tokens (the length of a packed sequence)"),
            format_args!("{} tokens", e.len()),
        ));
    }
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(examples[i].len()));
    // Free space → the sequences with that much left, in creation order.
    let mut free: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut rows: Vec<Vec<usize>> = Vec::new();
    for i in order {
        let n = examples[i].len();
        let fit = free.range(n..).next().map(|(&f, _)| f);
        let (row, left) = match fit {
            Some(f) => {
                let list = free.get_mut(&f).expect("a key just found");
                let r = list.remove(0);
                if list.is_empty() {
                    free.remove(&f);
                }
                (r, f - n)
            }
            None => {
                rows.push(Vec::new());
                (rows.len() - 1, seq_len - n)
            }
        };
        rows[row].push(i);
        free.entry(left).or_default().push(row);
    }
    Ok(rows
        .into_iter()
        .map(|members| {
            let mut row = SftExample {
                inputs: Vec::new(),
                targets: Vec::new(),
                positions: Vec::new(),
                truncated: false,
            };
            for &i in &members {
                let e = &examples[i];
                row.inputs.extend_from_slice(&e.inputs);
                row.targets.extend_from_slice(&e.targets);
                row.positions.extend(0..e.len() as u32);
                row.truncated |= e.truncated;
            }
            row
        })
        .collect())
}

/// The `(inputs, targets, positions)` tensors `(B, T)` u32 of `examples` on `device`, `T` the
/// longest of them (as transformers' collators pad to the longest in the batch): shorter ones
/// padded with `pad` (targets [`IGNORE_INDEX`], positions continuing their last example's, so
/// padding attends only behind the real tokens, which never see it). `positions` only when an
/// example is packed (then the decoder's
/// [`crate::models::decoder::FsdpDecoder::logits_at`] takes them).
///
/// Errors: no example, or only empty ones; Candle's.
pub fn batch(
    examples: &[&SftExample],
    pad: u32,
    device: &Device,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let t = examples.iter().map(|e| e.len()).max().unwrap_or(0);
    if t == 0 {
        return Err(Error::missing(
            "non-empty example in the SFT batch",
            "a batch needs at least one",
        ));
    }
    let b = examples.len();
    let (mut x, mut y, mut p) = (
        Vec::with_capacity(b * t),
        Vec::with_capacity(b * t),
        Vec::with_capacity(b * t),
    );
    for e in examples {
        let n = e.len();
        x.extend_from_slice(&e.inputs);
        x.resize(x.len() + t - n, pad);
        y.extend_from_slice(&e.targets);
        y.resize(y.len() + t - n, IGNORE_INDEX);
        p.extend_from_slice(&e.positions);
        let next = e.positions.last().map_or(0, |&l| l + 1);
        p.extend(next..next + (t - n) as u32);
    }
    let positions = if examples.iter().all(|e| e.is_plain()) {
        None
    } else {
        Some(Tensor::from_vec(p, (b, t), device)?)
    };
    Ok((
        Tensor::from_vec(x, (b, t), device)?,
        Tensor::from_vec(y, (b, t), device)?,
        positions,
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
        return Err(Error::missing(
            "target token on any rank in this step",
            "every example's completion is empty",
        ));
    }
    Ok((pg.world_size() as f64 / n as f64) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_the_completion_and_eos_only() {
        let ex = SftExample::new(&[10, 11, 12], &[20, 21], Some(2), 8);
        assert_eq!(ex.inputs, [10, 11, 12, 20, 21]);
        let i = IGNORE_INDEX;
        assert_eq!(ex.targets, [i, i, 20, 21, 2]);
        assert!(!ex.truncated);
        assert_eq!(ex.target_count(), 3);
        // Cut to seq_len + 1 tokens: the last target is the first token that does not fit.
        let ex = SftExample::new(&[10, 11], &[20, 21, 22, 23], None, 3);
        assert_eq!(ex.inputs, [10, 11, 20]);
        assert_eq!(ex.targets, [i, 20, 21]);
        assert!(ex.truncated);
    }

    #[test]
    fn packing_keeps_every_target_once_with_restarting_positions() {
        let i = IGNORE_INDEX;
        // Lengths 5, 2, 3, 4 (seq_len 8): best fit decreasing puts 5 + 3 and 4 + 2.
        let ex = [
            SftExample::new(&[1, 2], &[3, 4, 5], Some(9), 8),
            SftExample::new(&[10], &[11], Some(9), 8),
            SftExample::new(&[20, 21], &[22], Some(9), 8),
            SftExample::new(&[30], &[31, 32, 33], Some(9), 8),
        ];
        assert_eq!(ex.iter().map(|e| e.len()).collect::<Vec<_>>(), [5, 2, 3, 4]);
        let rows = pack(&ex, 8).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].inputs, [1, 2, 3, 4, 5, 20, 21, 22]);
        assert_eq!(rows[0].targets, [i, 3, 4, 5, 9, i, 22, 9]);
        assert_eq!(rows[0].positions, [0, 1, 2, 3, 4, 0, 1, 2]);
        assert_eq!(rows[1].inputs, [30, 31, 32, 33, 10, 11]);
        assert_eq!(rows[1].targets, [31, 32, 33, 9, 11, 9]);
        assert_eq!(rows[1].positions, [0, 1, 2, 3, 0, 1]);
        let count = |v: &[SftExample]| v.iter().map(SftExample::target_count).sum::<usize>();
        assert_eq!(count(&rows), count(&ex));
        assert!(ex.iter().all(SftExample::is_plain) && !rows[0].is_plain());
        let err = pack(&ex, 4).unwrap_err().to_string();
        assert!(
            err.contains("example 0: expected at most 4 tokens (the length of a packed sequence), found 5 tokens"),
            "{err}"
        );
        // A batch pads to its longest: the second row with pad 0, IGNORE targets, positions
        // continuing its last example's.
        let (x, y, p) = batch(&[&rows[0], &rows[1]], 0, &Device::Cpu).unwrap();
        assert_eq!(x.dims(), [2, 8]);
        assert_eq!(
            x.to_vec2::<u32>().unwrap()[1],
            [30, 31, 32, 33, 10, 11, 0, 0]
        );
        assert_eq!(y.to_vec2::<u32>().unwrap()[1], [31, 32, 33, 9, 11, 9, i, i]);
        assert_eq!(
            p.unwrap().to_vec2::<u32>().unwrap()[1],
            [0, 1, 2, 3, 0, 1, 2, 3]
        );
        // Plain examples: padded to the longest (5), no positions.
        let (x, _, p) = batch(&[&ex[1], &ex[0]], 7, &Device::Cpu).unwrap();
        assert_eq!(x.to_vec2::<u32>().unwrap()[0], [10, 11, 7, 7, 7]);
        assert!(p.is_none());
    }
}
