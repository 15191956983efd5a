//! Run fingerprints ([`crate::FsdpConfig::fingerprint`], the examples' `--fingerprint FILE`):
//! a CRC-32C of every value a step moves between ranks, written per step, unit, phase and rank,
//! so that two runs that should be equal (threads against shm, tcp or MPI; a refactor; a
//! resumed run against an uninterrupted one) can be compared record by record and the first
//! difference named ([`diff`], `fsdp-ckpt diff A B`).
//!
//! **What is recorded**, for each step ([`crate::FsdpModel::fingerprint_step`] closes one: the
//! crate's optimizers after their update, the grad scaler for a step it skips):
//! - `params`: the parameters of a unit's group as the unit computes with them, at their first
//!   forward use of the step (after the all-gather, unpacked and cast to `param_dtype`; the
//!   parameters in order, padding excluded, so the value does not depend on the world size);
//! - `reduce-in`: the unit's flat gradient as it enters the reduce-scatter (or all-reduce under
//!   NO_SHARD), in `reduce_dtype`, padding and presence flags included;
//! - `reduce-out`: the reduced chunk this rank receives (after the replicas' all-reduce under
//!   the hybrid strategies), in `reduce_dtype`;
//! - `shard`: the unit's f32 master shard at the step's end (trainable units only).
//!
//! A phase seen more than once in a step (gradient accumulation with a reduce-scatter per
//! micro-batch) is numbered: `reduce-in`, `reduce-in#1`, … Eval forwards record nothing, nor
//! does a group with no element on any rank. Steps are numbered from 0, or from the training
//! step of the checkpoint the model loaded ([`crate::FsdpModel::set_fingerprint_step`]).
//!
//! **Cost**: one CRC-32C pass over bytes the step has just touched (hardware CRC instructions,
//! about 10 GB/s a core: `cargo bench --bench fingerprint`), plus at each step's end two small
//! all-reduces of integers that bring every rank's records to rank 0, which appends them to
//! the file and flushes it. Tensors outside the host (a GPU's) are copied to the host to be
//! hashed: that costs a transfer per record.
//!
//! **The file** (text, tab-separated, one record a line; rank 0 writes it; a non-empty file
//! already at the path, say an elastic restart's earlier attempt, is kept as `FILE.1`, or the
//! first free `FILE.n`):
//!
//! ```text
//! # candle-fsdp fingerprint 1
//! # world_size 2
//! # step  unit  phase  rank  crc32c  bytes
//! 0       fc1   params 0     5f1c02ab  401920
//! 0       fc1   params 1     5f1c02ab  401920
//! ```
//!
//! Within a step the records are in the order rank 0 made them (forward, then backward), the
//! ranks of one event next to each other; so the first differing record of two files is the
//! first place the runs diverged. [`FingerprintReader`] checks a file as it reads it.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use crate::error::{Error, Result};

/// First line of a fingerprint file.
pub const FORMAT_LINE: &str = "# candle-fsdp fingerprint 1";

/// Where in a step a record was taken (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FingerprintPhase {
    /// A unit's parameters at their first forward use of the step.
    Params,
    /// A unit's flat gradient as it enters the reduce-scatter (all-reduce under NO_SHARD).
    ReduceIn,
    /// The reduced gradient chunk this rank receives.
    ReduceOut,
    /// The unit's f32 master shard after the optimizer step.
    Shard,
}

impl FingerprintPhase {
    const ALL: [FingerprintPhase; 4] = [
        FingerprintPhase::Params,
        FingerprintPhase::ReduceIn,
        FingerprintPhase::ReduceOut,
        FingerprintPhase::Shard,
    ];

    /// The name in the file: `params`, `reduce-in`, `reduce-out`, `shard`.
    pub fn name(self) -> &'static str {
        match self {
            FingerprintPhase::Params => "params",
            FingerprintPhase::ReduceIn => "reduce-in",
            FingerprintPhase::ReduceOut => "reduce-out",
            FingerprintPhase::Shard => "shard",
        }
    }

    fn code(self) -> u64 {
        self as u64
    }
}

/// A record waiting for the end of its step.
#[derive(Debug, Clone, Copy)]
struct Pending {
    unit: usize,
    phase: FingerprintPhase,
    occurrence: u32,
    crc: u32,
    bytes: u64,
}

impl Pending {
    /// `[key, crc, bytes]`: what the all-reduce carries (every value below 2^63).
    fn encode(&self) -> [u64; 3] {
        let key = ((self.unit as u64) << 24) | (self.phase.code() << 20) | self.occurrence as u64;
        [key, u64::from(self.crc), self.bytes]
    }

    fn decode(v: &[u64]) -> Result<Self> {
        let phase = FingerprintPhase::ALL
            .get(((v[0] >> 20) & 0xf) as usize)
            .copied()
            .ok_or_else(|| Error::Internal(format!("fingerprint record key {:#x}", v[0])))?;
        Ok(Pending {
            unit: (v[0] >> 24) as usize,
            phase,
            occurrence: (v[0] & 0xf_ffff) as u32,
            crc: v[1] as u32,
            bytes: v[2],
        })
    }
}

/// One rank's fingerprint recorder, owned by the model: records are kept until the step ends,
/// then gathered to rank 0, which writes them.
pub(crate) struct Recorder {
    /// Rank 0's file.
    out: Option<(PathBuf, BufWriter<File>)>,
    pending: Vec<Pending>,
    /// Records this step per (unit, phase): the next one's `#n`; a unit's parameters are
    /// recorded once a step.
    occurrences: HashMap<(usize, FingerprintPhase), u32>,
    /// The number the next closed step gets.
    step: u64,
}

/// `path` with `.n` appended: the first such name that is free.
fn free_aside(path: &Path) -> PathBuf {
    (1..)
        .map(|n| {
            let mut name = path.as_os_str().to_owned();
            name.push(format!(".{n}"));
            PathBuf::from(name)
        })
        .find(|p| !p.exists())
        .expect("a free name")
}

impl Recorder {
    /// The recorder of rank `rank` of `world_size`; rank 0 creates
    /// `path` and writes the header. A non-empty file already at `path` (an earlier run, or the
    /// attempt before an elastic restart) is kept: renamed to `path.1` (or the first free
    /// `path.n`).
    ///
    /// Errors: `path` cannot be created, written or moved aside (naming it).
    pub(crate) fn new(path: &Path, rank: usize, world_size: usize) -> Result<Self> {
        let out = if rank == 0 {
            let io = |e: std::io::Error| Error::file(path, format!("fingerprint file: {e}"));
            if std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() > 0) {
                let aside = free_aside(path);
                std::fs::rename(path, &aside).map_err(|e| {
                    Error::file(
                        path,
                        format!(
                            "fingerprint file: cannot keep it as {}: {e}",
                            aside.display()
                        ),
                    )
                })?;
            }
            let mut w = BufWriter::new(File::create(path).map_err(io)?);
            writeln!(
                w,
                "{FORMAT_LINE}\n# world_size {world_size}\n# step\tunit\tphase\trank\tcrc32c\tbytes"
            )
            .and_then(|_| w.flush())
            .map_err(io)?;
            Some((path.to_path_buf(), w))
        } else {
            None
        };
        Ok(Recorder {
            out,
            pending: Vec::new(),
            occurrences: HashMap::new(),
            step: 0,
        })
    }

    /// The number the next closed step gets.
    pub(crate) fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Keeps a record (none of zero bytes: a group without parameter elements on any rank).
    fn push(&mut self, unit: usize, phase: FingerprintPhase, (crc, bytes): (u32, u64)) {
        if bytes == 0 {
            return;
        }
        let n = self.occurrences.entry((unit, phase)).or_insert(0);
        self.pending.push(Pending {
            unit,
            phase,
            occurrence: *n,
            crc,
            bytes,
        });
        *n += 1;
    }

    /// Records unit `unit`'s parameters `params` unless they were recorded this step (a unit
    /// without parameters records nothing).
    ///
    /// Errors: a failed host copy.
    pub(crate) fn params(&mut self, unit: usize, params: &[Tensor]) -> Result<()> {
        let seen = self
            .occurrences
            .contains_key(&(unit, FingerprintPhase::Params));
        if params.is_empty() || seen {
            return Ok(());
        }
        let mut acc = (0u32, 0u64);
        for p in params {
            let (crc, n) = crate::ops::crc32c_append(acc.0, p)?;
            acc = (crc, acc.1 + n);
        }
        self.push(unit, FingerprintPhase::Params, acc);
        Ok(())
    }

    /// Records `t` as unit `unit`'s `phase`.
    ///
    /// Errors: a failed host copy.
    pub(crate) fn tensor(
        &mut self,
        unit: usize,
        phase: FingerprintPhase,
        t: &Tensor,
    ) -> Result<()> {
        let v = crate::ops::crc32c_append(0, t)?;
        self.push(unit, phase, v);
        Ok(())
    }

    /// Ends the current step: gathers every rank's records to rank 0 (a collective on `pg`,
    /// the model's whole world: two all-reduces of integers), which appends them to the file
    /// with the unit names `names` and flushes it; starts the next step.
    ///
    /// Errors: the collectives'; rank 0's write (naming the file).
    pub(crate) fn finish_step(&mut self, pg: &dyn ProcessGroup, names: &[&str]) -> Result<()> {
        let step = self.step;
        self.step += 1;
        let mine = std::mem::take(&mut self.pending);
        self.occurrences.clear();
        let (rank, ws) = (pg.rank(), pg.world_size());
        let per_rank: Vec<Vec<Pending>> = if ws == 1 {
            vec![mine]
        } else {
            let mut counts = vec![0u64; ws];
            counts[rank] = mine.len() as u64;
            let counts = pg.all_reduce_u64s(counts, ReduceOp::Sum)?;
            let total: u64 = counts.iter().sum();
            let at: u64 = counts[..rank].iter().sum();
            let mut v = vec![0u64; 3 * total as usize];
            for (i, p) in mine.iter().enumerate() {
                let k = 3 * (at as usize + i);
                v[k..k + 3].copy_from_slice(&p.encode());
            }
            let v = pg.all_reduce_u64s(v, ReduceOp::Sum)?;
            let mut it = v.chunks_exact(3);
            counts
                .iter()
                .map(|&n| {
                    (0..n)
                        .map(|_| Pending::decode(it.next().unwrap_or(&[0; 3])))
                        .collect()
                })
                .collect::<Result<_>>()?
        };
        let Some((path, w)) = &mut self.out else {
            return Ok(());
        };
        // Record i of every rank, then record i + 1: one event's ranks side by side.
        let longest = per_rank.iter().map(Vec::len).max().unwrap_or(0);
        let mut text = String::new();
        for i in 0..longest {
            for (r, recs) in per_rank.iter().enumerate() {
                if let Some(p) = recs.get(i) {
                    let unit = names.get(p.unit).copied().unwrap_or("?");
                    let phase = match p.occurrence {
                        0 => p.phase.name().to_string(),
                        n => format!("{}#{n}", p.phase.name()),
                    };
                    text.push_str(&format!(
                        "{step}\t{unit}\t{phase}\t{r}\t{:08x}\t{}\n",
                        p.crc, p.bytes
                    ));
                }
            }
        }
        w.write_all(text.as_bytes())
            .and_then(|_| w.flush())
            .map_err(|e| Error::file(path.as_path(), format!("fingerprint file: {e}")))
    }
}

/// One line of a fingerprint file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintRecord {
    /// Step number (see [`crate::FsdpModel::fingerprint_step`]).
    pub step: u64,
    /// Unit name.
    pub unit: String,
    /// Phase name, with `#n` for its n-th repetition in the step ([`FingerprintPhase::name`]).
    pub phase: String,
    /// Rank in the job's world.
    pub rank: usize,
    /// CRC-32C of the bytes.
    pub crc32c: u32,
    /// Bytes hashed.
    pub bytes: u64,
}

impl FingerprintRecord {
    /// The record's place within its step.
    fn place(&self) -> (&str, &str, usize) {
        (&self.unit, &self.phase, self.rank)
    }
}

impl fmt::Display for FingerprintRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {}, unit {}, phase {}, rank {}",
            self.step, self.unit, self.phase, self.rank
        )
    }
}

/// True for a phase name of the file: one of [`FingerprintPhase::name`], optionally `#n`
/// (n ≥ 1).
fn valid_phase(p: &str) -> bool {
    let (base, n) = match p.split_once('#') {
        Some((b, n)) => (b, Some(n)),
        None => (p, None),
    };
    FingerprintPhase::ALL.iter().any(|x| x.name() == base)
        && n.is_none_or(|n| n.parse::<u32>().is_ok_and(|n| n >= 1))
}

/// A fingerprint file read one step at a time (memory: one step's records), checked as it goes:
/// the header first (format line, then `# world_size N`), the steps in increasing order, each
/// step's records contiguous, no (unit, phase, rank) twice in a step, ranks below the world
/// size, known phase names.
pub struct FingerprintReader {
    path: PathBuf,
    lines: std::io::Lines<BufReader<File>>,
    line: usize,
    world_size: usize,
    /// The first record of the next step, read ahead.
    ahead: Option<FingerprintRecord>,
    last_step: Option<u64>,
}

impl FingerprintReader {
    /// Opens `path` and reads its header.
    ///
    /// Errors, naming the file and the line: missing or unreadable; not a fingerprint file
    /// (first line); no `# world_size` line before the records.
    pub fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
        let mut r = FingerprintReader {
            path: path.to_path_buf(),
            lines: BufReader::new(f).lines(),
            line: 0,
            world_size: 0,
            ahead: None,
            last_step: None,
        };
        match r.next_line()? {
            Some(l) if l == FORMAT_LINE => {}
            Some(l) => {
                return Err(r.bad(&format!(
                    "not a fingerprint file (expected first line {FORMAT_LINE:?}): {l:?}"
                )))
            }
            None => return Err(Error::file(path, "empty: not a fingerprint file")),
        }
        while let Some(l) = r.next_line()? {
            if let Some(ws) = l.strip_prefix("# world_size ") {
                r.world_size = ws
                    .trim()
                    .parse()
                    .ok()
                    .filter(|&w| w > 0)
                    .ok_or_else(|| r.bad(&format!("bad world size: {l:?}")))?;
            } else if l.starts_with('#') {
                continue;
            } else {
                if r.world_size == 0 {
                    return Err(r.bad("a record before the `# world_size` line"));
                }
                r.ahead = Some(r.parse(&l)?);
                break;
            }
        }
        if r.world_size == 0 {
            return Err(Error::file(
                path,
                "no `# world_size` line: not a complete header",
            ));
        }
        Ok(r)
    }

    /// World size of the run that wrote the file.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    fn next_line(&mut self) -> Result<Option<String>> {
        self.line += 1;
        self.lines
            .next()
            .transpose()
            .map_err(|e| Error::file(&self.path, format!("line {}: {e}", self.line)))
    }

    fn bad(&self, what: &str) -> Error {
        Error::file(&self.path, format!("line {}: {what}", self.line))
    }

    fn parse(&self, line: &str) -> Result<FingerprintRecord> {
        let bad = |what: &str| self.bad(&format!("{what}: {line:?}"));
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 6 {
            return Err(bad("expected 6 tab-separated fields"));
        }
        let r = FingerprintRecord {
            step: f[0].parse().map_err(|_| bad("bad step"))?,
            unit: f[1].to_string(),
            phase: f[2].to_string(),
            rank: f[3].parse().map_err(|_| bad("bad rank"))?,
            crc32c: u32::from_str_radix(f[4], 16).map_err(|_| bad("bad crc32c"))?,
            bytes: f[5].parse().map_err(|_| bad("bad byte count"))?,
        };
        if r.rank >= self.world_size {
            return Err(bad(&format!(
                "rank {} in a file of world size {}",
                r.rank, self.world_size
            )));
        }
        if !valid_phase(&r.phase) {
            return Err(bad(
                "unknown phase (expected params, reduce-in, reduce-out or shard, optionally #n)",
            ));
        }
        Ok(r)
    }

    /// The next step's number and records, in file order; `None` at the end of the file.
    ///
    /// Errors, naming the file and the line: a malformed record; a step lower than or equal to
    /// an earlier step (steps out of order, or two files concatenated); a (unit, phase, rank)
    /// twice in one step; a header line among the records.
    pub fn next_step(&mut self) -> Result<Option<(u64, Vec<FingerprintRecord>)>> {
        let Some(first) = self.ahead.take() else {
            return Ok(None);
        };
        let step = first.step;
        if self.last_step.is_some_and(|s| step <= s) {
            return Err(self.bad(&format!(
                "step {step} after step {}: steps out of order (two files concatenated?)",
                self.last_step.unwrap_or(0)
            )));
        }
        self.last_step = Some(step);
        let mut seen = std::collections::HashSet::new();
        let mut recs = Vec::new();
        let mut next = Some(first);
        while let Some(r) = next.take() {
            if r.step != step {
                self.ahead = Some(r);
                break;
            }
            if !seen.insert((r.unit.clone(), r.phase.clone(), r.rank)) {
                return Err(self.bad(&format!(
                    "{r} appears twice (two files concatenated, or two runs writing one file?)"
                )));
            }
            recs.push(r);
            if let Some(l) = self.next_line()? {
                if l.starts_with('#') {
                    return Err(self.bad(&format!(
                        "a header line among the records (two files concatenated?): {l:?}"
                    )));
                }
                next = Some(self.parse(&l)?);
            }
        }
        Ok(Some((step, recs)))
    }
}

/// A fingerprint file read whole ([`FingerprintReader`] over every step).
#[derive(Debug, Clone)]
pub struct FingerprintFile {
    /// The file.
    pub path: PathBuf,
    /// World size of the run that wrote it.
    pub world_size: usize,
    /// Records in file order.
    pub records: Vec<FingerprintRecord>,
}

/// Reads a whole fingerprint file (memory: every record; [`diff`] streams instead).
///
/// Errors: [`FingerprintReader`]'s.
pub fn read(path: &Path) -> Result<FingerprintFile> {
    let mut r = FingerprintReader::open(path)?;
    let mut records = Vec::new();
    while let Some((_, recs)) = r.next_step()? {
        records.extend(recs);
    }
    Ok(FingerprintFile {
        path: path.to_path_buf(),
        world_size: r.world_size(),
        records,
    })
}

/// Differences [`diff`] keeps (the count goes on).
pub const MAX_LISTED: usize = 100;

/// What [`diff`] found.
#[derive(Debug, Clone, Default)]
pub struct FingerprintDiff {
    /// World sizes of the two runs.
    pub world_sizes: [usize; 2],
    /// Steps both files record (only these are compared).
    pub common_steps: BTreeSet<u64>,
    /// Steps only the first / only the second file records.
    pub only_a: BTreeSet<u64>,
    /// See `only_a`.
    pub only_b: BTreeSet<u64>,
    /// Records compared (of the common steps, in the first file or the second).
    pub compared: usize,
    /// Records that differ (a checksum or a size, or present in one file only).
    pub differing: usize,
    /// The first [`MAX_LISTED`] differences, in the order of events (within a step, the first
    /// file's order, then the second's records the first lacks): `(a, b)`, `None` where a file
    /// lacks the record.
    pub differences: Vec<(Option<FingerprintRecord>, Option<FingerprintRecord>)>,
}

impl FingerprintDiff {
    /// True when both runs had one world size and the common steps hold the same records with
    /// the same checksums.
    pub fn identical(&self) -> bool {
        self.differing == 0 && self.world_sizes[0] == self.world_sizes[1]
    }

    /// The first differing record's place (step, unit, phase, rank).
    pub fn first(&self) -> Option<&FingerprintRecord> {
        self.differences
            .first()
            .and_then(|(a, b)| a.as_ref().or(b.as_ref()))
    }

    fn push(&mut self, a: Option<&FingerprintRecord>, b: Option<&FingerprintRecord>) {
        self.differing += 1;
        if self.differences.len() < MAX_LISTED {
            self.differences.push((a.cloned(), b.cloned()));
        }
    }

    /// Compares one step both files hold.
    fn step(&mut self, a: &[FingerprintRecord], b: &[FingerprintRecord]) {
        let aligned = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.place() == y.place());
        if aligned {
            for (x, y) in a.iter().zip(b) {
                self.compared += 1;
                if (x.crc32c, x.bytes) != (y.crc32c, y.bytes) {
                    self.push(Some(x), Some(y));
                }
            }
            return;
        }
        let by_place: HashMap<_, _> = b.iter().map(|r| (r.place(), r)).collect();
        for x in a {
            self.compared += 1;
            match by_place.get(&x.place()) {
                Some(y) if (x.crc32c, x.bytes) == (y.crc32c, y.bytes) => {}
                Some(y) => self.push(Some(x), Some(y)),
                None => self.push(Some(x), None),
            }
        }
        let in_a: std::collections::HashSet<_> = a.iter().map(FingerprintRecord::place).collect();
        for y in b.iter().filter(|y| !in_a.contains(&y.place())) {
            self.compared += 1;
            self.push(None, Some(y));
        }
    }
}

fn steps_text(s: &BTreeSet<u64>) -> String {
    match (s.first(), s.last()) {
        (Some(a), Some(b)) if a == b => format!("step {a}"),
        (Some(a), Some(b)) if (b - a + 1) as usize == s.len() => format!("steps {a}..={b}"),
        (Some(_), Some(_)) if s.len() <= 20 => format!(
            "steps {}",
            s.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        ),
        (Some(a), Some(b)) => format!("{} steps between {a} and {b}", s.len()),
        _ => "no step".into(),
    }
}

/// `n` and `word`, plural when `n` ≠ 1 (also the checkpoint diff's).
pub(crate) fn count(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

impl fmt::Display for FingerprintDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [wa, wb] = self.world_sizes;
        if self.common_steps.is_empty() {
            writeln!(f, "no step in common: nothing compared")?;
        } else if self.identical() {
            writeln!(
                f,
                "fingerprints identical: {}, {}",
                count(self.compared, "record"),
                steps_text(&self.common_steps)
            )?;
        } else if let Some(first) = self.first() {
            writeln!(f, "first difference: {first}")?;
            for (a, b) in self.differences.iter().take(8) {
                let side = |r: &Option<FingerprintRecord>| match r {
                    Some(r) => format!("crc32c {:08x} ({} bytes)", r.crc32c, r.bytes),
                    None => "absent".to_string(),
                };
                let at = a.as_ref().or(b.as_ref()).expect("one side");
                writeln!(f, "  {at}: {} vs {}", side(a), side(b))?;
            }
            if self.differing > 8 {
                writeln!(f, "  … {} more", self.differing - 8)?;
            }
            writeln!(
                f,
                "{} of {} differ in {}",
                self.differing,
                count(self.compared, "record"),
                steps_text(&self.common_steps)
            )?;
        }
        if wa != wb {
            writeln!(f, "the runs had different world sizes: {wa} vs {wb}")?;
        }
        if !self.only_a.is_empty() {
            writeln!(f, "only the first file has {}", steps_text(&self.only_a))?;
        }
        if !self.only_b.is_empty() {
            writeln!(f, "only the second file has {}", steps_text(&self.only_b))?;
        }
        Ok(())
    }
}

/// Compares two fingerprint files over the steps both record (a resumed run against an
/// uninterrupted one compares the steps after the resume), streaming both a step at a time
/// (memory: two steps' records and the first [`MAX_LISTED`] differences).
///
/// Errors: either file's ([`FingerprintReader`]).
pub fn diff(a: &Path, b: &Path) -> Result<FingerprintDiff> {
    let (mut ra, mut rb) = (FingerprintReader::open(a)?, FingerprintReader::open(b)?);
    let mut d = FingerprintDiff {
        world_sizes: [ra.world_size(), rb.world_size()],
        ..Default::default()
    };
    let (mut ga, mut gb) = (ra.next_step()?, rb.next_step()?);
    loop {
        match (&ga, &gb) {
            (None, None) => break,
            (Some((sa, _)), Some((sb, _))) if sa < sb => {
                d.only_a.insert(*sa);
                ga = ra.next_step()?;
            }
            (Some((sa, _)), Some((sb, _))) if sb < sa => {
                d.only_b.insert(*sb);
                gb = rb.next_step()?;
            }
            (Some((s, x)), Some((_, y))) => {
                d.common_steps.insert(*s);
                d.step(x, y);
                ga = ra.next_step()?;
                gb = rb.next_step()?;
            }
            (Some((sa, _)), None) => {
                d.only_a.insert(*sa);
                ga = ra.next_step()?;
            }
            (None, Some((sb, _))) => {
                d.only_b.insert(*sb);
                gb = rb.next_step()?;
            }
        }
    }
    Ok(d)
}

/// Test-only fault injection (cargo feature `fault-injection`): a one-bit change in a rank's
/// gradient, to show that a fingerprint diff names where it happened.
#[cfg(feature = "fault-injection")]
pub mod fault {
    use std::cell::RefCell;

    #[derive(Debug, Clone)]
    struct Flip {
        step: u64,
        unit: String,
        element: usize,
        bit: u32,
    }

    thread_local! {
        static FLIP: RefCell<Option<Flip>> = const { RefCell::new(None) };
    }

    /// On the calling thread (a rank of the thread backend), flips bit `bit` of element
    /// `element` of unit `unit`'s flat gradient as it enters the reduction of model step `step`
    /// ([`crate::FsdpModel::step`]), once.
    pub fn flip_gradient_bit(step: u64, unit: &str, element: usize, bit: u32) {
        FLIP.with(|f| {
            *f.borrow_mut() = Some(Flip {
                step,
                unit: unit.to_string(),
                element,
                bit,
            })
        });
    }

    /// The armed flip for (`step`, `unit`), disarmed: (element, bit).
    pub(crate) fn take(step: u64, unit: &str) -> Option<(usize, u32)> {
        FLIP.with(|f| {
            let mut f = f.borrow_mut();
            match &*f {
                Some(x) if x.step == step && x.unit == unit => {
                    let x = f.take().expect("armed");
                    Some((x.element, x.bit))
                }
                _ => None,
            }
        })
    }
}

/// Without the `fault-injection` feature nothing is ever armed.
#[cfg(not(feature = "fault-injection"))]
pub(crate) mod fault {
    pub(crate) fn take(_step: u64, _unit: &str) -> Option<(usize, u32)> {
        None
    }
}

/// `t` (1-D) with bit `bit` of element `element` flipped (fault injection).
pub(crate) fn flip_bit(t: &Tensor, element: usize, bit: u32) -> Result<Tensor> {
    if t.dtype() != candle_core::DType::F32 {
        return Err(Error::dtype(
            "fault injection: the gradient",
            "F32 (it flips bits of f32 gradients)",
            t.dtype(),
        ));
    }
    let mut v = t.to_vec1::<f32>()?;
    let x = v.get_mut(element).ok_or_else(|| {
        Error::out_of_range(
            "fault injection: element",
            element,
            "the gradient's element count",
            t.elem_count(),
        )
    })?;
    *x = f32::from_bits(x.to_bits() ^ (1 << bit));
    Ok(Tensor::from_vec(v, t.elem_count(), t.device())?)
}
