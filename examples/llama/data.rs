//! Tokens of the llama example: a `tokenizer.json` through the `tokenizers` crate, or bytes;
//! a tokenized corpus with the byte corpus's splits and per-rank random windows.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::Device;
use candle_fsdp::data::text::{Split, TextCorpus, TokenCorpus, DEFAULT_VAL_FRACTION};
use candle_fsdp::Result;

use super::lm::{Codec, Corpus, LmBatch};

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

/// Reads and tokenizes `path` (plain or gzipped UTF-8 text): the whole file tokenized, then the
/// last [`DEFAULT_VAL_FRACTION`] of the tokens held out for validation ([`TokenCorpus`]).
///
/// Errors: unreadable file, not UTF-8; too few tokens for one window of `seq_len` in each split.
pub fn load_tokens(path: &Path, codec: &dyn Codec, seq_len: usize) -> anyhow::Result<TokenCorpus> {
    let corpus = TextCorpus::load(path).with_context(|| {
        format!(
            "loading the corpus {} (--data; a relative path is from the current directory)",
            path.display()
        )
    })?;
    let c = TokenCorpus::tokenize(&corpus, DEFAULT_VAL_FRACTION, |t| codec.encode(t))?;
    let (train, val) = (c.split(Split::Train).len(), c.split(Split::Val).len());
    anyhow::ensure!(
        train > seq_len && val > seq_len,
        "{}: {} tokens ({train} training, {val} validation), too few for a window of \
         --seq-len {seq_len} in each split",
        path.display(),
        c.tokens().len()
    );
    Ok(c)
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
    ) -> Result<LmBatch> {
        let (x, y) = TokenCorpus::windows(self, split, batch, seq_len, seed, rank, index, device)?;
        Ok((x, y, None))
    }
}
