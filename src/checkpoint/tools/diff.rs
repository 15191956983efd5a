//! `fsdp-ckpt diff A B` on two checkpoints: every parameter, optimizer buffer and model buffer
//! compared by name, element by element (bit for bit), whatever the world sizes the two were
//! saved at; the first difference is named as the checkpoint's (step, unit, phase, rank): the
//! tensor, the first differing element, and each differing tensor's max abs / rel difference.
//! (Fingerprint files are compared by [`crate::fsdp::fingerprint::diff`].)

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::export::{open_shard_files, read_param_f32};
use super::{optim_list, resolve_checkpoint, SourceFile, CHUNK_ELEMS};
use crate::checkpoint::{read_meta, CheckpointMeta, ParamMeta};
use crate::error::{Error, Result};
use crate::fsdp::fingerprint::count as plural;

/// One tensor that differs between two checkpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDifference {
    /// The unit that holds it.
    pub unit: String,
    /// `param`, `buffer` or the optimizer buffer's name (`exp_avg`, …).
    pub phase: String,
    /// The tensor's name (the parameter's, for optimizer buffers too).
    pub tensor: String,
    /// The rank whose shard (in the first checkpoint) holds the first differing element (0 for
    /// buffers, which rank 0 stores).
    pub rank: usize,
    /// Row-major index of the first differing element, and that element in each checkpoint.
    pub first: Option<(Vec<usize>, f32, f32)>,
    /// Elements that differ (bits), of `numel`.
    pub differing: usize,
    /// Elements of the tensor.
    pub numel: usize,
    /// Largest `|a - b|` over the differing elements.
    pub max_abs: f64,
    /// Largest `|a - b| / max(|a|, |b|)` over them.
    pub max_rel: f64,
    /// Differing elements where one side (or both, with other bits) is NaN: not in
    /// `max_abs` / `max_rel`.
    pub nan: usize,
    /// Why there is no element comparison (a tensor one checkpoint lacks, shapes that differ).
    pub note: Option<String>,
}

impl fmt::Display for TensorDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}, unit {})", self.tensor, self.phase, self.unit)?;
        if let Some(note) = &self.note {
            return write!(f, ": {note}");
        }
        write!(
            f,
            ": {} of {} differ, max abs {:.3e}, max rel {:.3e}",
            self.differing,
            plural(self.numel, "element"),
            self.max_abs,
            self.max_rel
        )?;
        if self.nan > 0 {
            write!(f, " ({} against NaN)", plural(self.nan, "element"))?;
        }
        Ok(())
    }
}

/// What [`diff_checkpoints`] found.
#[derive(Debug, Clone)]
pub struct CheckpointDiff {
    /// The two checkpoint directories.
    pub dirs: [PathBuf; 2],
    /// Their training steps.
    pub steps: [u64; 2],
    /// Tensors compared (present in both, equal shapes) and their elements.
    pub tensors: usize,
    /// See `tensors`.
    pub elements: u64,
    /// Differences, in the first checkpoint's order (parameters, then optimizer buffers, then
    /// buffers; then tensors only the second one has), and of the metadata (steps, optimizer
    /// step counts) as notes.
    pub differences: Vec<TensorDifference>,
    /// Metadata that differs (training step, epoch, optimizer steps).
    pub meta_differences: Vec<String>,
}

impl CheckpointDiff {
    /// True when every tensor is bit-identical and the training metadata agrees.
    pub fn identical(&self) -> bool {
        self.differences.is_empty() && self.meta_differences.is_empty()
    }
}

impl fmt::Display for CheckpointDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "comparing {} with {}",
            self.dirs[0].display(),
            self.dirs[1].display()
        )?;
        if self.identical() {
            return writeln!(
                f,
                "checkpoints identical: {}, {} elements, bit for bit",
                plural(self.tensors, "tensor"),
                self.elements
            );
        }
        let step = match self.steps {
            [a, b] if a == b => format!("step {a}"),
            [a, b] => format!("steps {a} vs {b}"),
        };
        if let Some(d) = self.differences.first() {
            write!(
                f,
                "first difference: {step}, unit {}, phase {}, rank {}: tensor {}",
                d.unit, d.phase, d.rank, d.tensor
            )?;
            match (&d.first, &d.note) {
                (Some((idx, a, b)), _) => writeln!(f, ", element {idx:?}: {a:e} vs {b:e}")?,
                (None, Some(note)) => writeln!(f, ": {note}")?,
                (None, None) => writeln!(f)?,
            }
            for d in &self.differences {
                writeln!(f, "  {d}")?;
            }
        }
        for m in &self.meta_differences {
            writeln!(f, "  {m}")?;
        }
        writeln!(
            f,
            "checkpoints differ: {} ({} compared element by element){}",
            plural(self.differences.len(), "tensor"),
            self.tensors,
            if self.meta_differences.is_empty() {
                String::new()
            } else {
                format!(
                    ", {}",
                    plural(self.meta_differences.len(), "metadata difference")
                )
            }
        )
    }
}

/// One side of a comparison: a checkpoint's metadata and shard files.
struct Side {
    meta: CheckpointMeta,
    files: Vec<SourceFile>,
    /// Parameter name → (unit index, index in the unit's params).
    params: HashMap<String, (usize, usize)>,
}

impl Side {
    fn open(dir: &Path) -> Result<Self> {
        let meta = read_meta(dir)?;
        super::check_checksums(dir, &meta)?;
        let files = open_shard_files(dir, &meta)?;
        let params = meta
            .units
            .iter()
            .enumerate()
            .flat_map(|(k, u)| {
                u.params
                    .iter()
                    .enumerate()
                    .map(move |(i, p)| (p.name.clone(), (k, i)))
            })
            .collect();
        Ok(Side {
            meta,
            files,
            params,
        })
    }

    /// `(unit index, param)` of parameter `name`.
    fn param(&self, name: &str) -> Option<(usize, &ParamMeta)> {
        let &(k, i) = self.params.get(name)?;
        Some((k, &self.meta.units[k].params[i]))
    }

    /// Streams elements `range` of parameter `p` of unit `k` from tensor `prefix.<k>` as f32.
    fn read(
        &self,
        prefix: &str,
        k: usize,
        p: &ParamMeta,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let piece = ParamMeta {
            name: p.name.clone(),
            shape: vec![range.len()],
            offset: p.offset + range.start,
            numel: range.len(),
        };
        read_param_f32(
            &self.files,
            &format!("{prefix}.{k}"),
            self.meta.units[k].shard_numel,
            &piece,
        )
    }
}

/// Running comparison of one tensor.
struct Compare {
    d: TensorDifference,
    shape: Vec<usize>,
}

impl Compare {
    fn new(unit: &str, phase: &str, tensor: &str, shape: &[usize]) -> Self {
        Compare {
            d: TensorDifference {
                unit: unit.to_string(),
                phase: phase.to_string(),
                tensor: tensor.to_string(),
                rank: 0,
                first: None,
                differing: 0,
                numel: shape.iter().product(),
                max_abs: 0.0,
                max_rel: 0.0,
                nan: 0,
                note: None,
            },
            shape: shape.to_vec(),
        }
    }

    /// Compares elements starting at `at`; returns the first differing element's index.
    fn chunk(&mut self, at: usize, a: &[f32], b: &[f32]) -> Option<usize> {
        let mut first = None;
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            if x.to_bits() == y.to_bits() {
                continue;
            }
            self.d.differing += 1;
            if x.is_nan() || y.is_nan() {
                self.d.nan += 1;
            } else {
                // An infinity against a finite value: infinitely different; -0 against +0
                // (bits differ, values equal): no difference in value.
                let abs = (f64::from(x) - f64::from(y)).abs();
                let scale = f64::from(x.abs().max(y.abs()));
                let rel = match abs / scale {
                    _ if abs == 0.0 => 0.0,
                    r if r.is_nan() => f64::INFINITY,
                    r => r,
                };
                self.d.max_abs = self
                    .d
                    .max_abs
                    .max(if abs.is_nan() { f64::INFINITY } else { abs });
                self.d.max_rel = self.d.max_rel.max(rel);
            }
            if self.d.first.is_none() {
                self.d.first = Some((unravel(at + i, &self.shape), x, y));
                first = Some(at + i);
            }
        }
        first
    }

    fn finish(self) -> Option<TensorDifference> {
        (self.d.differing > 0).then_some(self.d)
    }
}

/// The row-major multi-index of flat index `i` in `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[d] = i % n;
            i /= n;
        }
    }
    idx
}

fn absent(unit: &str, phase: &str, tensor: &str, which: &str) -> TensorDifference {
    let mut c = Compare::new(unit, phase, tensor, &[]);
    c.d.note = Some(format!("only in the {which} checkpoint"));
    c.d
}

/// Compares the checkpoints `a` and `b` (each a checkpoint directory or a root whose newest
/// complete checkpoint is taken) tensor by tensor: parameters, optimizer buffers (as f32,
/// whatever dtype they were stored in) and buffers, matched by name, bit for bit, in chunks of
/// [`CHUNK_ELEMS`] elements (memory: a few MiB, whatever the model's size); and their training
/// step, epoch and optimizer step counts.
///
/// Errors, naming the file: either checkpoint missing or damaged (its checksums are checked
/// first: a corrupt file is reported as such, not as a difference).
pub fn diff_checkpoints(a: &Path, b: &Path) -> Result<CheckpointDiff> {
    let dirs = [resolve_checkpoint(a)?, resolve_checkpoint(b)?];
    let sides = [Side::open(&dirs[0])?, Side::open(&dirs[1])?];
    let (ma, mb) = (&sides[0].meta, &sides[1].meta);
    let mut out = CheckpointDiff {
        steps: [ma.train.step, mb.train.step],
        dirs: dirs.clone(),
        tensors: 0,
        elements: 0,
        differences: Vec::new(),
        meta_differences: Vec::new(),
    };
    for (what, x, y) in [
        ("training step", ma.train.step, mb.train.step),
        ("epoch", ma.train.epoch, mb.train.epoch),
    ] {
        if x != y {
            out.meta_differences.push(format!("{what}: {x} vs {y}"));
        }
    }
    let optims = [
        optim_list(ma, Some(&sides[0].files[0].header)),
        optim_list(mb, Some(&sides[1].files[0].header)),
    ];
    let kinds: Vec<_> = match (&optims[0], &optims[1]) {
        (Some(x), Some(y)) => {
            if x.step != y.step {
                out.meta_differences
                    .push(format!("optimizer steps: {} vs {}", x.step, y.step));
            }
            if let (Some(p), Some(q)) = (&ma.optimizer, &mb.optimizer) {
                if p.param_steps != q.param_steps {
                    out.meta_differences
                        .push("per-parameter optimizer step counts differ".into());
                }
                if p.state_dtype != q.state_dtype {
                    out.meta_differences.push(format!(
                        "optimizer state stored as {:?} vs {:?} (the values are compared as f32)",
                        p.state_dtype, q.state_dtype
                    ));
                }
            }
            x.kinds
                .iter()
                .filter(|k| y.kinds.contains(k))
                .copied()
                .collect()
        }
        (None, Some(_)) | (Some(_), None) => {
            out.meta_differences
                .push("only one checkpoint holds optimizer state".into());
            Vec::new()
        }
        (None, None) => Vec::new(),
    };
    // Parameters, then each optimizer buffer kind of every parameter.
    let phases: Vec<(String, String)> = std::iter::once(("param".to_string(), "param".to_string()))
        .chain(
            kinds
                .iter()
                .map(|k| (k.name().to_string(), format!("optim.{}", k.name()))),
        )
        .collect();
    for (phase, prefix) in &phases {
        for (ka, ua) in ma.units.iter().enumerate().filter(|(_, u)| !u.in_base) {
            let stored = phase == "param" || !ua.no_optim_state;
            for pa in ua.params.iter().filter(|_| stored) {
                let Some((kb, pb)) = sides[1].param(&pa.name) else {
                    if phase == "param" {
                        out.differences
                            .push(absent(&ua.name, phase, &pa.name, "first"));
                    }
                    continue;
                };
                let ub = &mb.units[kb];
                if ub.in_base || (phase != "param" && ub.no_optim_state) {
                    continue;
                }
                if pa.shape != pb.shape {
                    let mut c = Compare::new(&ua.name, phase, &pa.name, &pa.shape);
                    c.d.note = Some(format!("shape {:?} vs {:?}", pa.shape, pb.shape));
                    out.differences.push(c.d);
                    continue;
                }
                let mut c = Compare::new(&ua.name, phase, &pa.name, &pa.shape);
                let mut at = 0;
                while at < pa.numel {
                    let r = at..(at + CHUNK_ELEMS).min(pa.numel);
                    let x = sides[0].read(prefix, ka, pa, r.clone())?;
                    let y = sides[1].read(prefix, kb, pb, r.clone())?;
                    if let Some(i) = c.chunk(at, &x, &y) {
                        c.d.rank = (pa.offset + i) / ua.shard_numel.max(1);
                    }
                    at = r.end;
                }
                out.tensors += 1;
                out.elements += pa.numel as u64;
                out.differences.extend(c.finish());
            }
        }
    }
    // Buffers (rank 0's file).
    for ua in &ma.units {
        for ba in &ua.buffers {
            let found = mb
                .units
                .iter()
                .find_map(|u| u.buffers.iter().find(|b| b.name == ba.name).map(|b| (u, b)));
            let Some((_, bb)) = found else {
                out.differences
                    .push(absent(&ua.name, "buffer", &ba.name, "first"));
                continue;
            };
            let mut c = Compare::new(&ua.name, "buffer", &ba.name, &ba.shape);
            if ba.dtype != bb.dtype {
                out.meta_differences.push(format!(
                    "buffer {} stored as {} vs {} (the values are compared as f32)",
                    ba.name, ba.dtype, bb.dtype
                ));
            }
            if ba.shape != bb.shape {
                c.d.note = Some(format!("shape {:?} vs {:?}", ba.shape, bb.shape));
                out.differences.push(c.d);
                continue;
            }
            let numel: usize = ba.shape.iter().product();
            let read = |s: &Side| -> Result<Vec<f32>> {
                let mut v = Vec::with_capacity(numel);
                s.files[0].stream(
                    &format!("buffer.{}", ba.name),
                    0..numel,
                    Dtype::F32,
                    &mut |b| {
                        v.extend(super::f32s_le(b));
                        Ok(())
                    },
                )?;
                Ok(v)
            };
            let (x, y) = (read(&sides[0])?, read(&sides[1])?);
            c.chunk(0, &x, &y);
            out.tensors += 1;
            out.elements += numel as u64;
            out.differences.extend(c.finish());
        }
    }
    // What only the second checkpoint has.
    for ub in mb.units.iter().filter(|u| !u.in_base) {
        for pb in &ub.params {
            if sides[0].param(&pb.name).is_none() {
                out.differences
                    .push(absent(&ub.name, "param", &pb.name, "second"));
            }
        }
        for bb in &ub.buffers {
            if !ma
                .units
                .iter()
                .any(|u| u.buffers.iter().any(|b| b.name == bb.name))
            {
                out.differences
                    .push(absent(&ub.name, "buffer", &bb.name, "second"));
            }
        }
    }
    if out.tensors == 0 && out.differences.is_empty() {
        return Err(Error::file(
            &dirs[0],
            "nothing to compare: the checkpoint holds no parameter or buffer",
        ));
    }
    Ok(out)
}
