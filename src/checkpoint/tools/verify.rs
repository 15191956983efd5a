//! `fsdp-ckpt verify`: read a whole sharded checkpoint and report every problem found.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::{file_entry, optim_list, parse_dtype, resolve_checkpoint, SourceFile};
use crate::checkpoint::{read_meta, CheckpointMeta, META_FILE, SHARDED_FORMAT};
use crate::error::{Error, Result};

/// One problem found by [`verify()`]: the file and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file (or directory) concerned.
    pub path: PathBuf,
    /// What is wrong, naming the tensor and expected vs found.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.message)
    }
}

impl Problem {
    /// The problem an error describes (its file and message when it names one).
    fn from_error(e: Error, fallback: &Path) -> Self {
        match e {
            Error::File { path, message } => Self { path, message },
            Error::Io { path, error } => Self {
                path,
                message: error.to_string(),
            },
            other => Self {
                path: fallback.to_path_buf(),
                message: other.to_string(),
            },
        }
    }
}

/// What [`verify()`] read and found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// The checkpoint directory (the newest one when a root was given).
    pub dir: PathBuf,
    /// Shard files opened.
    pub files: usize,
    /// Tensors whose data was read whole.
    pub tensors: usize,
    /// Bytes of tensor data read.
    pub data_bytes: u64,
    /// Every problem found, in file order; empty when the checkpoint is sound.
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    /// No problem was found.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "checkpoint {}: {} shard files, {} tensors, {} bytes of tensor data read",
            self.dir.display(),
            self.files,
            self.tensors,
            self.data_bytes
        )?;
        for p in &self.problems {
            writeln!(f, "problem: {p}")?;
        }
        match self.problems.len() {
            0 => write!(f, "no problem found"),
            1 => write!(f, "1 problem found"),
            n => write!(f, "{n} problems found"),
        }
    }
}

/// A check of one tensor's data, fed its bytes in order (whole elements), then asked for its
/// verdict.
trait DataCheck {
    fn update(&mut self, bytes: &[u8]);
    /// `None` when the data passed; else what is wrong.
    fn finish(&self) -> Option<String>;
}

/// The checks of the data of `tensor` (of `dtype`) in rank `rank`'s file: no value is NaN or
/// infinite, and the bytes have the CRC-32C the metadata records (format 3; older checkpoints
/// record none).
fn data_checks(
    meta: &CheckpointMeta,
    rank: usize,
    tensor: &str,
    dtype: Dtype,
) -> Vec<Box<dyn DataCheck>> {
    let mut checks: Vec<Box<dyn DataCheck>> = vec![Box::new(NonFinite {
        dtype,
        seen: 0,
        count: 0,
        first: None,
    })];
    let recorded = meta
        .files
        .iter()
        .find(|f| f.rank == rank)
        .and_then(|f| f.crc32c.get(tensor));
    if let Some(&expected) = recorded {
        checks.push(Box::new(Checksum { expected, crc: 0 }));
    }
    // Adam's second moment is a running mean of squares.
    if tensor.starts_with("optim.exp_avg_sq.") && matches!(dtype, Dtype::F32 | Dtype::BF16) {
        checks.push(Box::new(Negative {
            count: 0,
            first: None,
            seen: 0,
            bf16: dtype == Dtype::BF16,
        }));
    }
    checks
}

/// Counts negative values (where only non-negative ones are possible: Adam's `exp_avg_sq`).
struct Negative {
    count: usize,
    first: Option<(usize, f32)>,
    seen: usize,
    /// Elements are bf16 (bf16 optimizer state), else f32.
    bf16: bool,
}

impl DataCheck for Negative {
    fn update(&mut self, bytes: &[u8]) {
        let size = if self.bf16 { 2 } else { 4 };
        for c in bytes.chunks_exact(size) {
            let v = if self.bf16 {
                half::bf16::from_le_bytes([c[0], c[1]]).to_f32()
            } else {
                f32::from_le_bytes([c[0], c[1], c[2], c[3]])
            };
            if v < 0.0 {
                self.count += 1;
                self.first.get_or_insert((self.seen, v));
            }
            self.seen += 1;
        }
    }

    fn finish(&self) -> Option<String> {
        let (at, v) = self.first?;
        Some(format!(
            "{} negative value(s) of {} in a second moment, which cannot be negative (the \
             first, {v}, at element {at})",
            self.count, self.seen
        ))
    }
}

/// Compares the CRC-32C of the bytes with the one recorded at save time (catches flipped bits).
struct Checksum {
    expected: u32,
    crc: u32,
}

impl DataCheck for Checksum {
    fn update(&mut self, bytes: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
    }

    fn finish(&self) -> Option<String> {
        (self.crc != self.expected).then(|| {
            format!(
                "CRC-32C {:08x} of its data differs from the {:08x} recorded in meta.json (the \
                 data changed after the save)",
                self.crc, self.expected
            )
        })
    }
}

/// Counts NaN and infinite values (a diverged or corrupt state).
struct NonFinite {
    dtype: Dtype,
    seen: usize,
    count: usize,
    first: Option<(usize, f64)>,
}

impl DataCheck for NonFinite {
    fn update(&mut self, bytes: &[u8]) {
        let size = self.dtype.bitsize() / 8;
        for c in bytes.chunks_exact(size) {
            let v = match self.dtype {
                Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                Dtype::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
                Dtype::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
                _ => f64::from_le_bytes(c.try_into().expect("8 bytes")),
            };
            if !v.is_finite() {
                self.count += 1;
                self.first.get_or_insert((self.seen, v));
            }
            self.seen += 1;
        }
    }

    fn finish(&self) -> Option<String> {
        let (at, v) = self.first?;
        Some(format!(
            "{} non-finite value(s) of {} (the first, {v}, at element {at})",
            self.count, self.seen
        ))
    }
}

/// Reads the whole sharded checkpoint `dir` (a checkpoint directory, or a root whose newest
/// complete checkpoint is used) and checks everything it can, reporting every problem rather
/// than stopping at the first: `meta.json` parses and is consistent; every rank's file exists,
/// has the size recorded, a valid header and the rank and world size in its metadata; it holds
/// exactly the tensors the metadata implies (parameter shards, optimizer state, buffers on rank
/// 0) with their dtypes and shapes; every byte of their data reads back, and no value is NaN or
/// infinite, and (format 3) each tensor's CRC-32C equals the recorded one, so a flipped bit is
/// found. Memory: a constant (data is streamed, see [`super`]).
///
/// Errors (rather than a report): `dir` missing or not a checkpoint directory. A damaged
/// `meta.json` is a reported problem (and ends the check: nothing else can be checked without
/// it).
pub fn verify(dir: &Path) -> Result<VerifyReport> {
    let dir = resolve_checkpoint(dir)?;
    let mut report = VerifyReport {
        dir: dir.clone(),
        files: 0,
        tensors: 0,
        data_bytes: 0,
        problems: Vec::new(),
    };
    let meta_path = dir.join(META_FILE);
    let meta = match read_meta(&dir) {
        Ok(m) => m,
        Err(e) => {
            report.problems.push(Problem::from_error(e, &meta_path));
            return Ok(report);
        }
    };
    let mut problems = Vec::new();
    // An adapter-only checkpoint is usable only with its frozen base: checked too.
    if let Some(base) = meta.adapter_base() {
        if let Err(e) = base.verify_at(None) {
            problems.push(Problem {
                path: meta_path.clone(),
                message: crate::checkpoint::root_message(e),
            });
        }
    }
    let mut opened: Vec<Option<SourceFile>> = (0..meta.world_size)
        .map(|r| match SourceFile::open_shard(&dir, &meta, r) {
            Ok(f) => Some(f),
            Err(e) => {
                let (name, _) = file_entry(&meta, r);
                problems.push(Problem::from_error(e, &dir.join(name)));
                None
            }
        })
        .collect();
    let optimizer = optim_list(&meta, opened[0].as_ref().map(|f| &f.header));
    for (rank, file) in opened.iter_mut().enumerate() {
        let Some(f) = file.as_ref() else { continue };
        report.files += 1;
        let mut bad = |message: String| {
            problems.push(Problem {
                path: f.path().to_path_buf(),
                message,
            })
        };
        if let Some(fmt) = f.metadata().get("format") {
            if fmt != SHARDED_FORMAT {
                bad(format!(
                    "safetensors metadata format: expected {SHARDED_FORMAT}, found {fmt}"
                ));
            }
        }
        // The tensors this rank's file must hold: (name, dtype, shape; None = any shape).
        let mut expected: Vec<(String, Dtype, Option<Vec<usize>>)> = Vec::new();
        for (k, u) in meta.units.iter().enumerate() {
            if u.world_size > rank && !u.in_base {
                expected.push((format!("param.{k}"), Dtype::F32, Some(vec![u.shard_numel])));
            }
        }
        let state_dtype = meta
            .optimizer
            .as_ref()
            .map_or(Dtype::F32, |o| o.state_dtype);
        for b in optimizer.iter().flat_map(|o| &o.buffers) {
            match b.unit {
                Some(k) if meta.units[k].world_size > rank => expected.push((
                    format!("optim.{}", b.name),
                    state_dtype,
                    Some(vec![meta.units[k].shard_numel]),
                )),
                Some(_) => {}
                None => expected.push((format!("optim.{}", b.name), Dtype::F32, None)),
            }
        }
        if rank == 0 {
            for b in meta
                .units
                .iter()
                .filter(|u| !u.in_base)
                .flat_map(|u| &u.buffers)
            {
                match parse_dtype(&b.dtype, &meta_path, &format!("buffer {}", b.name)) {
                    Ok(d) => {
                        expected.push((format!("buffer.{}", b.name), d, Some(b.shape.clone())))
                    }
                    Err(e) => problems.push(Problem::from_error(e, &meta_path)),
                }
            }
        }
        let mut bad = |message: String| {
            problems.push(Problem {
                path: f.path().to_path_buf(),
                message,
            })
        };
        let listed: BTreeSet<&str> = expected.iter().map(|(n, ..)| n.as_str()).collect();
        for name in f.names_in_file_order() {
            if !listed.contains(name.as_str()) {
                bad(format!(
                    "tensor {name} is not one the metadata lists for rank {rank}'s file"
                ));
            }
        }
        for (name, dtype, shape) in &expected {
            let checked = match shape {
                Some(s) => f.check(name, *dtype, s),
                None => f.info(name).and_then(|i| {
                    let s = i.shape.clone();
                    f.check(name, *dtype, &s)
                }),
            };
            if let Err(e) = checked {
                bad(Problem::from_error(e, f.path()).message);
                continue;
            }
            let info = f.info(name).expect("checked");
            let numel: usize = info.shape.iter().product();
            let mut checks = data_checks(&meta, rank, name, *dtype);
            let mut bytes = 0u64;
            let read = f.stream(name, 0..numel, *dtype, &mut |b| {
                bytes += b.len() as u64;
                for c in checks.iter_mut() {
                    c.update(b);
                }
                Ok(())
            });
            report.tensors += 1;
            report.data_bytes += bytes;
            match read {
                Err(e) => bad(Problem::from_error(e, f.path()).message),
                Ok(()) => {
                    for c in &checks {
                        if let Some(msg) = c.finish() {
                            bad(format!("tensor {name}: {msg}"));
                        }
                    }
                }
            }
        }
    }
    report.problems = problems;
    Ok(report)
}
