//! Byte-level text corpora for language models: every byte is a token (vocabulary
//! [`VOCAB_SIZE`] = 256), the last part of the file is held out for validation, and each rank
//! samples its own deterministic random windows.
//!
//! ```no_run
//! use candle_core::Device;
//! use candle_fsdp::data::text::{Split, TextCorpus};
//!
//! // The last 5 % of the bytes are the validation split.
//! let corpus = TextCorpus::load("data/shakespeare/shakespeare.txt.gz")?;
//! // Rank 1's batch of optimizer step 7: 8 windows of 64 tokens, targets shifted by one.
//! let (x, y) = corpus.windows(Split::Train, 8, 64, 0, 1, 7, &Device::Cpu)?;
//! assert_eq!(x.dims(), &[8, 64]);
//! # Ok::<(), candle_fsdp::Error>(())
//! ```
//!
//! A window is `seq_len + 1` consecutive bytes starting anywhere in its split (uniformly, never
//! crossing into the other split): the inputs are its first `seq_len` bytes, the targets its
//! last `seq_len`. Which windows a batch holds depends only on `(seed, split, rank, step)`, so a
//! run resumed at step `s` sees the batches an uninterrupted run would have, and ranks draw
//! different windows (independent streams, not a partition: random windows of a long text
//! almost never coincide).
//!
//! Built with the cargo feature `gpt` (on by default), which brings flate2.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use super::gz::read_maybe_gz;
use crate::error::{Error, Result};

/// Number of distinct tokens of a byte-level corpus.
pub const VOCAB_SIZE: usize = 256;

/// Fraction of the bytes held out for validation by [`TextCorpus::load`] (the last 5 %).
pub const DEFAULT_VAL_FRACTION: f64 = 0.05;

/// Which part of the corpus to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The first `1 − val_fraction` of the bytes.
    Train,
    /// The last `val_fraction` of the bytes.
    Val,
}

impl Split {
    fn name(self) -> &'static str {
        match self {
            Split::Train => "training",
            Split::Val => "validation",
        }
    }
}

/// A text file as bytes, split into a training and a validation part.
#[derive(Debug, Clone)]
pub struct TextCorpus {
    path: PathBuf,
    bytes: Vec<u8>,
    /// First byte of the validation split.
    split_at: usize,
}

impl TextCorpus {
    /// Reads `path` (plain text, or gzip: detected by its magic bytes, so `.txt` and `.txt.gz`
    /// both work) and holds out its last [`DEFAULT_VAL_FRACTION`] of bytes for validation.
    ///
    /// Errors (each naming the file): it cannot be read, its gzip stream is corrupt, it is too
    /// short to leave at least one byte to each split.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_with_val_fraction(path, DEFAULT_VAL_FRACTION)
    }

    /// As [`TextCorpus::load`], holding out the last `val_fraction` (in `(0, 1)`) of the bytes.
    ///
    /// Errors: as [`TextCorpus::load`]; a `val_fraction` outside `(0, 1)`.
    pub fn load_with_val_fraction(path: impl AsRef<Path>, val_fraction: f64) -> Result<Self> {
        let path = path.as_ref();
        let bytes = read_maybe_gz(path)?;
        Self::from_bytes(path, bytes, val_fraction)
    }

    /// A corpus from bytes already in memory; `path` only names it in errors.
    ///
    /// The validation split is the last `round(len · val_fraction)` bytes, at least one; the
    /// training split the rest, at least one. The split falls on a UTF-8 character boundary:
    /// when that point is inside a multi-byte character, the character goes to the validation
    /// split (the point moves back to its first byte, while the training split keeps a byte), so
    /// that each split of a UTF-8 file is UTF-8 and they join to the file.
    ///
    /// Errors: a `val_fraction` outside `(0, 1)`; fewer than 2 bytes.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>, val_fraction: f64) -> Result<Self> {
        let path = path.into();
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(Error::value(
                format_args!("{}: the validation fraction", path.display()),
                "in (0, 1)",
                val_fraction,
            ));
        }
        let len = bytes.len();
        if len < 2 {
            return Err(Error::file(
                &path,
                format!("a text corpus needs at least 2 bytes (one for each split), found {len}"),
            ));
        }
        let val_len = ((len as f64 * val_fraction).round() as usize).clamp(1, len - 1);
        Ok(Self {
            path,
            split_at: char_boundary_at_or_before(&bytes, len - val_len),
            bytes,
        })
    }

    /// The whole corpus as text (both splits, in order).
    ///
    /// Errors, naming the file: it is not UTF-8 (with the byte offset of the first invalid
    /// sequence).
    pub fn text(&self) -> Result<&str> {
        std::str::from_utf8(&self.bytes).map_err(|e| {
            Error::file(
                &self.path,
                format!(
                    "not UTF-8 text: an invalid byte sequence at byte {} (a tokenizer reads \
                     text; without --tokenizer the corpus is read as bytes)",
                    e.valid_up_to()
                ),
            )
        })
    }

    /// The file the corpus was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Total bytes (both splits).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Always false: a corpus holds at least 2 bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes of one split.
    pub fn split(&self, split: Split) -> &[u8] {
        match split {
            Split::Train => &self.bytes[..self.split_at],
            Split::Val => &self.bytes[self.split_at..],
        }
    }

    /// Checks that `split` holds at least one window of `seq_len` tokens (`seq_len + 1` bytes).
    ///
    /// Errors (naming the file, the split, its size and `seq_len`): it does not; `seq_len` 0.
    pub fn check_seq_len(&self, split: Split, seq_len: usize) -> Result<()> {
        let n = self.split(split).len();
        if seq_len == 0 {
            return Err(Error::value("seq_len", "at least 1", 0));
        }
        if n < seq_len.saturating_add(1) {
            return Err(Error::file(
                &self.path,
                format!(
                    "the {} split has {n} bytes, too few for one window of seq_len {seq_len} \
                     (seq_len + 1 = {} bytes)",
                    split.name(),
                    seq_len.saturating_add(1)
                ),
            ));
        }
        Ok(())
    }

    /// The first byte of each of the `batch` windows of `(seed, split, rank, step)`: uniform
    /// over the split's `len − seq_len` possible starts, offsets into the split.
    ///
    /// Errors: as [`TextCorpus::check_seq_len`].
    pub fn window_starts(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        step: u64,
    ) -> Result<Vec<usize>> {
        self.check_seq_len(split, seq_len)?;
        sample_window_starts(
            self.split(split).len(),
            split,
            batch,
            seq_len,
            seed,
            rank,
            step,
        )
    }

    /// One batch of `(inputs, targets)`, each a `(batch, seq_len)` u32 tensor on `device`
    /// holding byte values (`< 256`): the windows of [`TextCorpus::window_starts`], the targets
    /// being the inputs shifted left by one byte.
    ///
    /// Errors: as [`TextCorpus::check_seq_len`]; `batch` 0; the tensors cannot be made.
    #[allow(clippy::too_many_arguments)]
    pub fn windows(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        step: u64,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.check_seq_len(split, seq_len)?;
        windows_of(
            self.split(split),
            split,
            batch,
            seq_len,
            seed,
            rank,
            step,
            device,
        )
    }
}

/// The `(inputs, targets)` batch of [`sample_window_starts`] over the tokens `data` of `split`,
/// each `(batch, seq_len)` u32 on `device`, the targets the inputs shifted left by one: the
/// windows of both [`TextCorpus`] (bytes) and [`TokenCorpus`] (ids).
///
/// Errors: `batch` 0; as [`sample_window_starts`]; the tensors cannot be made.
#[allow(clippy::too_many_arguments)]
fn windows_of<T: Copy + Into<u32>>(
    data: &[T],
    split: Split,
    batch: usize,
    seq_len: usize,
    seed: u64,
    rank: usize,
    step: u64,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if batch == 0 {
        return Err(Error::value("batch", "at least 1", 0));
    }
    let starts = sample_window_starts(data.len(), split, batch, seq_len, seed, rank, step)?;
    let mut inputs = Vec::with_capacity(batch * seq_len);
    let mut targets = Vec::with_capacity(batch * seq_len);
    for s in starts {
        let w = &data[s..s + seq_len + 1];
        inputs.extend(w[..seq_len].iter().map(|&t| t.into()));
        targets.extend(w[1..].iter().map(|&t| t.into()));
    }
    Ok((
        Tensor::from_vec(inputs, (batch, seq_len), device)?,
        Tensor::from_vec(targets, (batch, seq_len), device)?,
    ))
}

/// The first token of each of the `batch` windows of `seq_len + 1` tokens drawn for `(seed,
/// split, rank, step)` from a split of `len` tokens: uniform over its `len − seq_len` possible
/// starts, one random stream per `(seed, split, rank, step)`. The sampler of
/// [`TextCorpus::window_starts`], for corpora of other tokens (a tokenizer's ids).
///
/// Errors: `seq_len` 0, or `len < seq_len + 1` (no window fits).
pub fn sample_window_starts(
    len: usize,
    split: Split,
    batch: usize,
    seq_len: usize,
    seed: u64,
    rank: usize,
    step: u64,
) -> Result<Vec<usize>> {
    if seq_len == 0 {
        return Err(Error::value("seq_len", "at least 1", 0));
    }
    if len < seq_len.saturating_add(1) {
        return Err(Error::shape(
            format_args!(
                "the {} split, for one window of seq_len {seq_len}",
                split.name()
            ),
            format_args!(
                "at least {} tokens (seq_len + 1)",
                seq_len.saturating_add(1)
            ),
            format_args!("{len} tokens, too few"),
        ));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(stream_seed(seed, split, rank, step));
    Ok((0..batch)
        .map(|_| rng.random_range(0..len - seq_len))
        .collect())
}

/// One random stream per `(seed, split, rank, step)`: SplitMix64 finalisers chained over the
/// four values (distinct inputs give unrelated seeds).
fn stream_seed(seed: u64, split: Split, rank: usize, step: u64) -> u64 {
    fn mix(h: u64, v: u64) -> u64 {
        let mut z = (h ^ v).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let split = match split {
        Split::Train => 1,
        Split::Val => 2,
    };
    [split, rank as u64, step]
        .into_iter()
        .fold(mix(0, seed), mix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(len: usize) -> TextCorpus {
        let bytes = (0..len).map(|i| (i % 251) as u8).collect();
        TextCorpus::from_bytes("mem.txt", bytes, 0.05).unwrap()
    }

    #[test]
    fn split_is_the_last_five_percent() {
        let c = corpus(1000);
        assert_eq!(c.split(Split::Train).len(), 950);
        assert_eq!(c.split(Split::Val).len(), 50);
        assert_eq!(c.split(Split::Val)[0], (950 % 251) as u8);
        // Tiny corpora keep a byte in each split.
        let c = corpus(2);
        assert_eq!(
            (c.split(Split::Train).len(), c.split(Split::Val).len()),
            (1, 1)
        );
    }

    #[test]
    fn windows_are_shifted_and_inside_their_split() {
        let c = corpus(1000);
        let (x, y) = c.windows(Split::Val, 4, 8, 3, 0, 0, &Device::Cpu).unwrap();
        assert_eq!(x.dims(), &[4, 8]);
        assert_eq!(x.dtype(), candle_core::DType::U32);
        let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
        let val = c.split(Split::Val);
        for (xr, yr) in x.iter().zip(&y) {
            assert_eq!(&xr[1..], &yr[..7]);
            let start = val.iter().position(|&b| b as u32 == xr[0]).unwrap();
            assert!(start + 9 <= val.len());
            let w: Vec<u32> = val[start..start + 9].iter().map(|&b| b as u32).collect();
            assert_eq!(&w[..8], xr.as_slice());
            assert_eq!(&w[1..], yr.as_slice());
        }
    }

    #[test]
    fn windows_depend_on_seed_rank_step_split_only() {
        let c = corpus(100_000);
        let s = |seed, split, rank, step| c.window_starts(split, 16, 32, seed, rank, step).unwrap();
        assert_eq!(s(0, Split::Train, 0, 5), s(0, Split::Train, 0, 5));
        assert_ne!(s(0, Split::Train, 0, 5), s(0, Split::Train, 1, 5));
        assert_ne!(s(0, Split::Train, 0, 5), s(0, Split::Train, 0, 6));
        assert_ne!(s(0, Split::Train, 0, 5), s(1, Split::Train, 0, 5));
        assert_ne!(s(0, Split::Train, 0, 5), s(0, Split::Val, 0, 5));
    }

    #[test]
    fn every_start_is_reachable() {
        // seq_len = len − 1: exactly one window; len − 3: three starts, all drawn.
        let c = TextCorpus::from_bytes("m", vec![7; 200], 0.5).unwrap();
        assert!(c
            .window_starts(Split::Train, 8, 99, 0, 0, 0)
            .unwrap()
            .iter()
            .all(|&s| s == 0));
        let mut seen = c.window_starts(Split::Train, 64, 97, 0, 0, 0).unwrap();
        seen.sort();
        seen.dedup();
        assert_eq!(seen, vec![0, 1, 2]);
    }

    #[test]
    fn errors_name_the_file_and_the_sizes() {
        let c = corpus(100);
        let e = c
            .windows(Split::Val, 1, 5, 0, 0, 0, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mem.txt") && e.contains("validation split has 5 bytes"),
            "{e}"
        );
        let e = TextCorpus::from_bytes("one.txt", vec![1], 0.05)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one.txt") && e.contains("found 1"), "{e}");
        let e = TextCorpus::from_bytes("f.txt", vec![1; 10], 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("f.txt") && e.contains("(0, 1)"), "{e}");
    }
}

/// `at` moved back to the first byte of the UTF-8 character it falls inside: over at most three
/// continuation bytes (`0b10xx_xxxx`) to a lead byte whose sequence length reaches past `at`,
/// never below 1. `at` itself when it is on a boundary or the bytes there are not UTF-8.
fn char_boundary_at_or_before(bytes: &[u8], at: usize) -> usize {
    let continuation = |b: u8| b & 0xC0 == 0x80;
    if at >= bytes.len() || !continuation(bytes[at]) {
        return at;
    }
    for b in (at.saturating_sub(3).max(1)..at).rev() {
        if !continuation(bytes[b]) {
            // A lead byte of `n` bytes (`n` leading ones, 2 to 4) covers bytes `b..b + n`.
            let n = bytes[b].leading_ones() as usize;
            return if (2..=4).contains(&n) && b + n > at {
                b
            } else {
                at
            };
        }
    }
    at
}

/// A text corpus as a tokenizer's ids: the whole file tokenized at once, then the last
/// `val_fraction` of the **tokens** held out for validation. (Splitting the text first and
/// tokenizing each part would cut a word's tokens, and a cut inside a multi-byte character
/// would decode as U+FFFD at both ends.) Windows are drawn as [`TextCorpus::windows`] draws
/// them ([`sample_window_starts`]).
#[derive(Debug, Clone)]
pub struct TokenCorpus {
    path: PathBuf,
    tokens: Vec<u32>,
    /// First token of the validation split.
    split_at: usize,
}

impl TokenCorpus {
    /// Tokenizes the whole of `corpus` ([`TextCorpus::text`]) with `encode` and holds out the
    /// last `round(n · val_fraction)` of its `n` tokens (at least one) for validation.
    ///
    /// Errors, naming the file: the corpus is not UTF-8; `encode`'s error; fewer than 2 tokens;
    /// a `val_fraction` outside `(0, 1)`.
    pub fn tokenize<E: std::fmt::Display>(
        corpus: &TextCorpus,
        val_fraction: f64,
        encode: impl FnOnce(&str) -> std::result::Result<Vec<u32>, E>,
    ) -> Result<Self> {
        let path = corpus.path().to_path_buf();
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(Error::value(
                format_args!("{}: the validation fraction", path.display()),
                "in (0, 1)",
                val_fraction,
            ));
        }
        let tokens = encode(corpus.text()?)
            .map_err(|e| Error::file(&path, format!("tokenizing it: {e}")))?;
        let n = tokens.len();
        if n < 2 {
            return Err(Error::file(
                &path,
                format!("a corpus needs at least 2 tokens (one for each split), found {n}"),
            ));
        }
        let val = ((n as f64 * val_fraction).round() as usize).clamp(1, n - 1);
        Ok(Self {
            path,
            tokens,
            split_at: n - val,
        })
    }

    /// The file the corpus was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every token, both splits in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The tokens of one split.
    pub fn split(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.tokens[..self.split_at],
            Split::Val => &self.tokens[self.split_at..],
        }
    }

    /// One batch of `(inputs, targets)`, each `(batch, seq_len)` u32 on `device`: the windows
    /// of [`sample_window_starts`] over the split's tokens, the targets shifted left by one.
    ///
    /// Errors: `batch` 0; as [`sample_window_starts`]; the tensors cannot be made.
    #[allow(clippy::too_many_arguments)]
    pub fn windows(
        &self,
        split: Split,
        batch: usize,
        seq_len: usize,
        seed: u64,
        rank: usize,
        step: u64,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        windows_of(
            self.split(split),
            split,
            batch,
            seq_len,
            seed,
            rank,
            step,
            device,
        )
    }
}
