//! Saving a sharded checkpoint: each rank's file, the checksums, the metadata.

#[allow(unused_imports)]
use super::*;

/// One tensor of a rank's file, as [`write_rank_file`] takes it.
enum Piece<'a> {
    /// f32 values written as F32, or (`bf16`) as BF16 (bf16 optimizer state: exact).
    Values { values: &'a [f32], bf16: bool },
    /// A buffer, in its own dtype.
    Tensor(&'a Tensor),
}

/// Writes `piece` as the next tensor `name` of `w`.
fn write_piece(w: &mut SafetensorsWriter, name: &str, piece: Piece<'_>) -> Result<()> {
    match piece {
        Piece::Values { values, bf16: true } => {
            let bytes: Vec<u8> = values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect();
            w.begin_tensor(name, Dtype::BF16, bytes.len())?;
            w.write_part(&bytes)
        }
        Piece::Values {
            values,
            bf16: false,
        } => w.write_f32(name, values),
        Piece::Tensor(t) => w.write_tensor(name, t),
    }
}

/// Calls `f(name, piece)` for every tensor of this rank's file, in file order (see
/// [`rank_file_specs`]): its parameter shards (a packed frozen shard dequantised, as every
/// `param.k`), its optimizer buffers (streamed one at a time: no second copy of the optimizer
/// state), and on rank 0 the buffers.
fn for_each_piece(
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    kinds: &[BufferKind],
    rank: usize,
    kept: &Kept,
    f: &mut dyn FnMut(&str, Piece<'_>) -> Result<()>,
) -> Result<()> {
    let in_base = &kept.in_base;
    let holds = |k: usize, u: &ShardView| u.layout.world_size > rank && !in_base[k];
    for (k, u) in model.shards().enumerate() {
        if holds(k, &u) {
            with_host_f32(&u.param_f32()?, |s| {
                f(
                    &param_tensor(k),
                    Piece::Values {
                        values: s,
                        bf16: false,
                    },
                )
            })??;
        }
    }
    let bf16 = kept.optim_dtype == Dtype::BF16;
    for kind in kinds {
        for (k, u) in model.shards().enumerate() {
            if holds(k, &u) && !kept.stateless[k] {
                optim
                    .with_buffer(k, *kind, &mut |b| {
                        f(&optim_tensor(*kind, k), Piece::Values { values: b, bf16 })
                    })
                    .map_err(|e| {
                        e.prefixed(&format!("optimizer state of unit {} ({kind})", u.unit_name))
                    })?;
            }
        }
    }
    if rank == 0 {
        for (k, u) in model.shards().enumerate() {
            if in_base[k] {
                continue;
            }
            for (name, var) in u.buffers {
                f(&buffer_tensor(name), Piece::Tensor(var.as_tensor()))?;
            }
        }
    }
    Ok(())
}

/// The safetensors header metadata of rank `rank`'s file of `ws`.
fn file_header(rank: usize, ws: usize) -> HashMap<String, String> {
    HashMap::from([
        ("format".to_string(), SHARDED_FORMAT.to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        ("rank".to_string(), rank.to_string()),
        ("world_size".to_string(), ws.to_string()),
    ])
}

/// Writes this rank's file (see [`rank_file_specs`]) straight from the model and the
/// optimizer, and commits it; returns its size and the CRC-32C of each tensor, in file order.
pub(super) fn write_rank_file(
    path: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    kinds: &[BufferKind],
    (rank, ws): (usize, usize),
    kept: &Kept,
) -> Result<(u64, Vec<u32>)> {
    let specs = rank_file_specs(model, kinds, rank, kept)?;
    let mut w = SafetensorsWriter::create(path, specs, file_header(rank, ws))?;
    for_each_piece(model, optim, kinds, rank, kept, &mut |name, piece| {
        write_piece(&mut w, name, piece)
    })?;
    w.finish()
}

/// This rank's file copied to host memory at the step boundary (an asynchronous save's
/// staging): what [`write_staged`] writes later, the same bytes as [`write_rank_file`].
pub(super) struct Staged {
    specs: Vec<TensorSpec>,
    header: HashMap<String, String>,
    /// `(name, values, bf16)` or `(name, buffer copy)`, in file order.
    pieces: Vec<(String, StagedPiece)>,
}

enum StagedPiece {
    Values(Vec<f32>, bool),
    Tensor(Tensor),
}

impl Staged {
    /// Host bytes held.
    fn bytes(&self) -> usize {
        self.pieces
            .iter()
            .map(|(_, p)| match p {
                StagedPiece::Values(v, _) => 4 * v.len(),
                StagedPiece::Tensor(t) => t.elem_count() * t.dtype().size_in_bytes(),
            })
            .sum()
    }
}

/// Copies this rank's file contents (parameters, optimizer state, rank 0's buffers).
pub(super) fn stage_rank_file(
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    kinds: &[BufferKind],
    (rank, ws): (usize, usize),
    kept: &Kept,
) -> Result<Staged> {
    let specs = rank_file_specs(model, kinds, rank, kept)?;
    let mut pieces = Vec::with_capacity(specs.len());
    for_each_piece(model, optim, kinds, rank, kept, &mut |name, piece| {
        let p = match piece {
            Piece::Values { values, bf16 } => StagedPiece::Values(values.to_vec(), bf16),
            Piece::Tensor(t) => StagedPiece::Tensor(t.copy()?),
        };
        pieces.push((name.to_string(), p));
        Ok(())
    })?;
    Ok(Staged {
        specs,
        header: file_header(rank, ws),
        pieces,
    })
}

/// Writes and commits a staged file; returns its size and checksums as [`write_rank_file`].
fn write_staged(path: &Path, staged: Staged) -> Result<(u64, Vec<u32>)> {
    let mut w = SafetensorsWriter::create(path, staged.specs, staged.header)?;
    for (name, p) in &staged.pieces {
        let piece = match p {
            StagedPiece::Values(v, bf16) => Piece::Values {
                values: v,
                bf16: *bf16,
            },
            StagedPiece::Tensor(t) => Piece::Tensor(t),
        };
        write_piece(&mut w, name, piece)?;
    }
    w.finish()
}

/// The optimizer part of the metadata: kind, groups, buffer kinds, per-parameter steps.
pub(super) fn optimizer_meta(
    model: &FsdpModel,
    state: &OptimizerState,
    kinds: &[BufferKind],
    kept: &Kept,
) -> OptimizerMeta {
    let param_steps = model
        .shards()
        .zip(&state.units)
        .flat_map(|(v, u)| {
            v.layout
                .params
                .iter()
                .zip(&u.steps)
                .map(|(p, s)| (p.name.clone(), *s))
        })
        .collect();
    OptimizerMeta {
        step: state.step,
        hyper: Some(state.hyper.clone()),
        buffer_kinds: kinds.to_vec(),
        param_steps,
        buffers: Vec::new(),
        state_dtype: kept.optim_dtype,
    }
}

/// Every file's tensor checksums and size, known to rank 0 (a collective over the world: one
/// sum all-reduce of one integer per tensor of every file and one per file; each writing rank
/// fills its own file's slots, the ranks of other replicas (hybrid) none). `names`: every
/// file's tensor names ([`rank_file_specs`]).
fn gather_checksums(
    pg: &dyn crate::comm::ProcessGroup,
    names: Vec<Vec<String>>,
    (rank, writes): (usize, bool),
    mine: &[u32],
    my_bytes: u64,
) -> Result<(FileChecksums, Vec<u64>)> {
    let ws = names.len();
    if writes && names[rank].len() != mine.len() {
        return Err(Error::shape(
            format!("checkpoint checksums: tensors rank {rank} wrote"),
            names[rank].len(),
            mine.len(),
        ));
    }
    // The checksums of every file's tensors, then each file's size.
    let total: usize = names.iter().map(Vec::len).sum();
    let at: usize = names[..rank].iter().map(Vec::len).sum();
    let mut v = vec![0u64; total + ws];
    if writes {
        for (slot, c) in v[at..].iter_mut().zip(mine) {
            *slot = u64::from(*c);
        }
        v[total + rank] = my_bytes;
    }
    let v = if pg.world_size() == 1 {
        v
    } else {
        pg.all_reduce_u64s(v, ReduceOp::Sum)?
    };
    let sizes = v[total..].to_vec();
    let mut it = v.into_iter();
    let sums = names
        .into_iter()
        .map(|ns| {
            ns.into_iter()
                .map(|n| (n, it.next().unwrap_or(0) as u32))
                .collect()
        })
        .collect();
    Ok((sums, sizes))
}

/// This rank's file and the number of files: its rank in the shard group and the group's size
/// (the world's unless hybrid: a hybrid checkpoint is the sharded checkpoint of one shard group,
/// written by replica 0).
pub(super) fn writer_place(model: &FsdpModel) -> (usize, usize) {
    let g = model.shard_group();
    (g.rank(), g.world_size())
}

/// Every file's tensor checksums by name, in rank order.
type FileChecksums = Vec<BTreeMap<String, u32>>;

/// The optimizer's buffer kinds and what a save keeps ([`begin_save`]).
type Found = (Vec<BufferKind>, Kept);

/// What the end of a save needs once this rank's file is written: the place, every file's
/// tensor names, rank 0's metadata without its file list.
struct SaveCtx {
    pg: std::sync::Arc<dyn crate::comm::ProcessGroup>,
    root: PathBuf,
    staging: PathBuf,
    final_dir: PathBuf,
    file: PathBuf,
    rank: usize,
    writes: bool,
    names: Vec<Vec<String>>,
    meta: Option<CheckpointMeta>,
    keep_last: usize,
}

/// The first, collective part of a save: the staging directory (rank 0 prepares it, all
/// agree), the optimizer's header and what is kept, every file's tensor names, rank 0's
/// metadata.
fn begin_save(
    root: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    state: &TrainState,
    keep_last: usize,
) -> Result<(SaveCtx, Result<Found>)> {
    let pg = model.process_group().clone();
    let (rank, ws) = writer_place(model);
    let name = step_dir_name(state.step);
    let final_dir = root.join(&name);
    let staging = root.join(format!(".{name}.partial"));
    let prep = if pg.rank() == 0 {
        prepare_staging(root, &staging)
    } else {
        Ok(())
    };
    agree(
        pg.as_ref(),
        "preparing the checkpoint directory",
        &staging,
        prep,
    )?;
    let local = (|| -> Result<_> {
        let (ostate, kinds) = optim.state_header()?;
        let kept = Kept::of(model, &ostate, optim.state_dtype())?;
        let names = (0..ws)
            .map(|r| {
                Ok(rank_file_specs(model, &kinds, r, &kept)?
                    .into_iter()
                    .map(|s| s.name)
                    .collect())
            })
            .collect::<Result<Vec<Vec<String>>>>()?;
        let meta = if pg.rank() == 0 {
            let mut train = state.clone();
            if train.mixed_precision.is_none() {
                train.mixed_precision = serde_json::to_value(model.config().mixed_precision).ok();
            }
            // Adapter-only: the units left to the base are re-read from it on load.
            if kept.in_base.iter().any(|&b| b) {
                train.base = model.base().cloned();
            }
            Some(CheckpointMeta {
                format_version: FORMAT_VERSION,
                world_size: ws,
                strategy: Some(
                    super::super::strategy_name(model.config().sharding_strategy).to_string(),
                ),
                train,
                dtype: "F32".into(),
                units: unit_metas(model, &kept)?,
                optimizer: Some(optimizer_meta(model, &ostate, &kinds, &kept)),
                files: Vec::new(),
                saved_at_unix_ms: Some(now_unix_ms()),
            })
        } else {
            None
        };
        Ok((kinds, kept, names, meta))
    })();
    // A local failure is carried to the agreement on the written files (`finish_save`), which
    // every rank reaches at the same point (for an asynchronous save: at `wait`).
    let (found, names, meta) = match local {
        Ok((kinds, kept, names, meta)) => (Ok((kinds, kept)), names, meta),
        Err(e) => (Err(e), Vec::new(), None),
    };
    let ctx = SaveCtx {
        file: staging.join(shard_file_name(rank, ws)),
        pg,
        root: root.to_path_buf(),
        staging,
        final_dir,
        rank,
        writes: model.replica_index() == 0,
        names,
        meta,
        keep_last,
    };
    Ok((ctx, found))
}

/// The last, collective part of a save, once this rank's file is `written` (size and
/// checksums): every rank agrees it succeeded, the checksums and sizes are gathered, rank 0
/// writes `meta.json` and publishes, all agree.
fn finish_save(ctx: SaveCtx, written: Result<(u64, Vec<u32>)>) -> Result<PathBuf> {
    let pg = ctx.pg.clone();
    let cleanup = |staging: &Path| {
        if pg.rank() == 0 && !fault::crash_mode() {
            let _ = fs::remove_dir_all(staging);
        }
    };
    let (written, (bytes, crcs)) = match written {
        Ok(v) => (Ok(()), v),
        Err(e) => (Err(e), (0, Vec::new())),
    };
    if let Err(e) = agree(
        pg.as_ref(),
        "writing the checkpoint shards",
        &ctx.staging,
        written,
    ) {
        cleanup(&ctx.staging);
        return Err(e);
    }
    let (checksums, sizes) =
        match gather_checksums(pg.as_ref(), ctx.names, (ctx.rank, ctx.writes), &crcs, bytes) {
            Ok(c) => c,
            Err(e) => {
                cleanup(&ctx.staging);
                return Err(e);
            }
        };
    let finished = match ctx.meta {
        Some(mut meta) => {
            let ws = sizes.len();
            meta.files = (0..ws)
                .map(|r| FileMeta {
                    rank: r,
                    name: shard_file_name(r, ws),
                    bytes: sizes[r],
                    crc32c: checksums[r].clone(),
                })
                .collect();
            publish(
                &ctx.root,
                &ctx.staging,
                &ctx.final_dir,
                &meta,
                ctx.keep_last,
            )
        }
        None => Ok(()),
    };
    if finished.is_err() {
        cleanup(&ctx.staging);
    }
    agree(
        pg.as_ref(),
        "completing the checkpoint",
        &ctx.final_dir,
        finished,
    )?;
    Ok(ctx.final_dir)
}

/// Saves a sharded checkpoint of `model` and `optim` as `<root>/step-<state.step>/` (a
/// collective) and returns that directory.
///
/// Each rank writes its file (its shards of the parameters and of the optimizer state; rank 0
/// also the buffers) into a hidden staging directory; when every rank succeeded, rank 0 writes
/// `meta.json` (layouts, optimizer buffers, file sizes and `state`; the model's mixed-precision
/// policy when `state.mixed_precision` is `None`) and renames the staging directory into place,
/// replacing a checkpoint of the same step. `keep_last`: complete checkpoints kept under `root`
/// (older ones, by step, are deleted after the new one is complete; the new one is never
/// deleted); 0 keeps all. Under the hybrid strategies the checkpoint is the shard group's
/// (`world_size` = shard size), written once, by the ranks of replica 0; the other replicas take
/// part in the agreements only. Memory: one copy of this rank's optimizer state
/// ([`ShardedOptimizer::state`]) plus 64 KiB of conversion buffer.
///
/// Errors (on every rank; previous checkpoints untouched, the staging directory removed): any
/// rank failing to write (naming its file), or a collective failure.
pub fn save_sharded(
    root: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    state: &TrainState,
    keep_last: usize,
) -> Result<PathBuf> {
    let step = model.step();
    (|| -> Result<PathBuf> {
        let (ctx, found) = begin_save(root, model, optim, state, keep_last)?;
        let written = match found {
            Ok((kinds, kept)) if ctx.writes => {
                let place = writer_place(model);
                write_rank_file(&ctx.file, model, optim, &kinds, place, &kept)
            }
            Ok(_) => Ok((0, Vec::new())),
            Err(e) => Err(e),
        };
        finish_save(ctx, written)
    })()
    .map_err(|e| e.in_checkpoint(step))
}

/// [`save_sharded`] that does not hold up training while the files are written: this call
/// (collective) prepares the staging directory, copies this rank's shards, optimizer state and
/// (rank 0) buffers to host memory — the staged copy, so training may change the model and
/// optimizer as soon as it returns — and starts a thread that writes and fsyncs the file.
/// [`PendingSave::wait`] (collective, at a step boundary: before the next save, or at the end)
/// joins it, agrees that every rank's write succeeded, gathers the checksums and publishes
/// the checkpoint exactly as [`save_sharded`] does: the same files, byte for byte. A process
/// killed before `wait` leaves only the hidden staging directory: the previous checkpoints
/// stay complete and loadable. Staging memory: one copy of this rank's file contents
/// ([`PendingSave::staged_bytes`]) until the thread has written it.
///
/// At most one save should be in flight: wait for the last one before the next.
///
/// Errors: as [`save_sharded`] for the preparation; the background write's (naming the file)
/// come from [`PendingSave::wait`].
pub fn save_sharded_async(
    root: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    state: &TrainState,
    keep_last: usize,
) -> Result<PendingSave> {
    let step = model.step();
    (|| -> Result<PendingSave> {
        let (ctx, found) = begin_save(root, model, optim, state, keep_last)?;
        let (writer, staged_bytes) = match found {
            Err(e) => (Writer::Failed(e), 0),
            Ok(_) if !ctx.writes => (Writer::Nothing, 0),
            Ok((kinds, kept)) => {
                match stage_rank_file(model, optim, &kinds, writer_place(model), &kept) {
                    Ok(staged) => {
                        let n = staged.bytes();
                        let path = ctx.file.clone();
                        match std::thread::Builder::new()
                            .name("fsdp-ckpt-write".into())
                            .spawn({
                                // Fault injection (tests) follows the write to its thread.
                                let armed = fault::carried();
                                move || {
                                    fault::carry(armed);
                                    write_staged(&path, staged)
                                }
                            }) {
                            Ok(h) => (Writer::Thread(h), n),
                            Err(e) => (Writer::Failed(Error::io(&ctx.file, e)), 0),
                        }
                    }
                    Err(e) => (Writer::Failed(e), 0),
                }
            }
        };
        Ok(PendingSave {
            ctx,
            writer,
            staged_bytes,
            step,
        })
    })()
    .map_err(|e| e.in_checkpoint(step))
}

/// The background part of a [`PendingSave`].
enum Writer {
    Thread(std::thread::JoinHandle<Result<(u64, Vec<u32>)>>),
    /// Staging failed: reported at `wait`, where every rank agrees.
    Failed(Error),
    /// A rank of another replica (hybrid): it writes nothing.
    Nothing,
}

/// A checkpoint save in flight ([`save_sharded_async`]): staged, its file being written in the
/// background. [`PendingSave::wait`] publishes it; dropped without `wait`, the checkpoint is
/// never published (its hidden staging directory is replaced by the next save of that step).
#[must_use = "a pending save is published only by wait()"]
pub struct PendingSave {
    ctx: SaveCtx,
    writer: Writer,
    staged_bytes: usize,
    step: u64,
}

impl std::fmt::Debug for PendingSave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSave")
            .field("dir", &self.ctx.final_dir)
            .field("staged_bytes", &self.staged_bytes)
            .finish()
    }
}

impl PendingSave {
    /// Where the checkpoint is published.
    pub fn dir(&self) -> &Path {
        &self.ctx.final_dir
    }

    /// Host bytes of this rank's staged copy.
    pub fn staged_bytes(&self) -> usize {
        self.staged_bytes
    }

    /// Waits for this rank's file, then finishes the save as [`save_sharded`] does: agreement,
    /// checksums, `meta.json`, publish, rotation. A collective: every rank calls it at the same
    /// point of the run.
    ///
    /// Errors (on every rank; previous checkpoints untouched, the staging directory removed):
    /// a rank's background write failing (naming its file), the publish failing, a collective
    /// failure.
    pub fn wait(self) -> Result<PathBuf> {
        let step = self.step;
        let written = match self.writer {
            Writer::Thread(h) => h.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument(
                    "the checkpoint writer thread panicked".into(),
                ))
            }),
            Writer::Failed(e) => Err(e),
            Writer::Nothing => Ok((0, Vec::new())),
        };
        finish_save(self.ctx, written).map_err(|e| e.in_checkpoint(step))
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
