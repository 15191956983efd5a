//! Tokens of the llama example: a `tokenizer.json` through the `tokenizers` crate, or bytes;
//! a tokenized corpus with the byte corpus's splits and per-rank random windows.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::{Device, Tensor};
use candle_fsdp::data::text::{sample_window_starts, Split, DEFAULT_VAL_FRACTION};
use candle_fsdp::Result;

use super::lm::{Codec, Corpus};

/// A Hugging Face tokenizer (`tokenizer.json`), special tokens neither added nor shown.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl HfTokenizer {
    /// Reads `path`.
    ///
    /// Errors: the file missing or not a tokenizer (naming it).
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("{}: not a tokenizer.json: {e}", path.display()))?;
        Ok(Self {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Its vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

impl Codec for HfTokenizer {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.path.display()))?;
        Ok(enc.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }
}

/// A text as token ids: the last [`DEFAULT_VAL_FRACTION`] of the tokens is the validation split;
/// windows as the byte corpus's (`seq_len + 1` consecutive tokens anywhere in the split, drawn
/// from `(seed, split, rank, index)`).
pub struct TokenCorpus {
    tokens: Vec<u32>,
    split_at: usize,
}

impl TokenCorpus {
    /// Reads and tokenizes `path` (plain or gzipped text).
    ///
    /// Errors: unreadable file; too few tokens for one window of `seq_len` in each split.
    pub fn load(path: &Path, codec: &dyn Codec, seq_len: usize) -> anyhow::Result<Self> {
        let corpus = candle_fsdp::data::text::TextCorpus::load(path)
            .with_context(|| format!("loading the corpus {}", path.display()))?;
        let mut text = String::from_utf8_lossy(corpus.split(Split::Train)).into_owned();
        text.push_str(&String::from_utf8_lossy(corpus.split(Split::Val)));
        let tokens = codec.encode(&text)?;
        let val = ((tokens.len() as f64 * DEFAULT_VAL_FRACTION).round() as usize).max(1);
        let split_at = tokens.len().saturating_sub(val);
        anyhow::ensure!(
            split_at > seq_len && tokens.len() - split_at > seq_len,
            "{}: {} tokens, too few for a window of --seq-len {seq_len} in each split",
            path.display(),
            tokens.len()
        );
        Ok(Self { tokens, split_at })
    }

    fn split(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.tokens[..self.split_at],
            Split::Val => &self.tokens[self.split_at..],
        }
    }
}

impl Corpus for TokenCorpus {
    fn windows(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        index: u64,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let data = self.split(split);
        // The byte corpus's sampler (same windows for the same seed, split, rank and step).
        let starts = sample_window_starts(data.len(), split, batch, seq_len, seed, rank, index)?;
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for s in starts {
            x.extend_from_slice(&data[s..s + seq_len]);
            y.extend_from_slice(&data[s + 1..s + seq_len + 1]);
        }
        Ok((
            Tensor::from_vec(x, (batch, seq_len), device)?,
            Tensor::from_vec(y, (batch, seq_len), device)?,
        ))
    }
}
