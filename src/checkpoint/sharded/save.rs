//! Saving a sharded checkpoint: each rank's file, the checksums, the metadata.

#[allow(unused_imports)]
use super::*;

/// Writes this rank's file (see [`rank_file_specs`]); returns the CRC-32C of each tensor, in
/// file order.
///
/// The optimizer's buffers are streamed one at a time ([`ShardedOptimizer::with_buffer`]), so
/// that saving holds no second copy of the optimizer state.
pub(super) fn write_rank_file(
    path: &Path,
    model: &FsdpModel,
    optim: &dyn ShardedOptimizer,
    kinds: &[BufferKind],
    place: (usize, usize),
    kept: &Kept,
) -> Result<Vec<u32>> {
    let (rank, ws) = place;
    let in_base = &kept.in_base;
    let specs = rank_file_specs(model, kinds, rank, kept)?;
    let meta = HashMap::from([
        ("format".to_string(), SHARDED_FORMAT.to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        ("rank".to_string(), rank.to_string()),
        ("world_size".to_string(), ws.to_string()),
    ]);
    let mut w = SafetensorsWriter::create(path, specs, meta)?;
    let holds = |k: usize, u: &ShardView| u.layout.world_size > rank && !in_base[k];
    for (k, u) in model.shards().enumerate() {
        if holds(k, &u) {
            // A packed frozen shard is written dequantised (f32, as every `param.k`).
            with_host_f32(&u.param_f32()?, |s| w.write_f32(&param_tensor(k), s))??;
        }
    }
    for kind in kinds {
        for (k, u) in model.shards().enumerate() {
            if holds(k, &u) && !kept.stateless[k] {
                optim
                    .with_buffer(k, *kind, &mut |b| {
                        let name = optim_tensor(*kind, k);
                        if kept.optim_dtype == Dtype::BF16 {
                            // bf16 state's values: exact in bf16.
                            let bytes: Vec<u8> = b
                                .iter()
                                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                                .collect();
                            w.begin_tensor(&name, Dtype::BF16, bytes.len())?;
                            w.write_part(&bytes)?;
                        } else {
                            w.write_f32(&name, b)?;
                        }
                        Ok(())
                    })
                    .map_err(|e| {
                        Error::InvalidArgument(format!(
                            "optimizer state of unit {} ({kind}): {e}",
                            u.unit_name
                        ))
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
                w.write_tensor(&buffer_tensor(name), var.as_tensor())?;
            }
        }
    }
    Ok(w.finish()?.1)
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

/// Every file's tensor checksums, known to rank 0 (a collective over the world: one sum
/// all-reduce of one integer per tensor of every file; each writing rank fills its own file's
/// slots, the ranks of other replicas (hybrid) none).
pub(super) fn gather_checksums(
    model: &FsdpModel,
    kinds: &[BufferKind],
    kept: &Kept,
    mine: &[u32],
) -> Result<Vec<BTreeMap<String, u32>>> {
    let pg = model.process_group();
    let (rank, ws) = writer_place(model);
    let names: Vec<Vec<String>> = (0..ws)
        .map(|r| {
            Ok(rank_file_specs(model, kinds, r, kept)?
                .into_iter()
                .map(|s| s.name)
                .collect())
        })
        .collect::<Result<_>>()?;
    if model.replica_index() == 0 && names[rank].len() != mine.len() {
        return Err(Error::InvalidArgument(format!(
            "checkpoint checksums: rank {rank} wrote {} tensors, expected {}",
            mine.len(),
            names[rank].len()
        )));
    }
    let total: usize = names.iter().map(Vec::len).sum();
    let at: usize = names[..rank].iter().map(Vec::len).sum();
    let mut v = vec![0u64; total];
    if model.replica_index() == 0 {
        for (slot, c) in v[at..].iter_mut().zip(mine) {
            *slot = u64::from(*c);
        }
    }
    let v = if pg.world_size() == 1 {
        v
    } else {
        pg.all_reduce_u64s(v, ReduceOp::Sum)?
    };
    let mut it = v.into_iter();
    Ok(names
        .into_iter()
        .map(|ns| {
            ns.into_iter()
                .map(|n| (n, it.next().unwrap_or(0) as u32))
                .collect()
        })
        .collect())
}

/// This rank's file and the number of files: its rank in the shard group and the group's size
/// (the world's unless hybrid: a hybrid checkpoint is the sharded checkpoint of one shard group,
/// written by replica 0).
pub(super) fn writer_place(model: &FsdpModel) -> (usize, usize) {
    let g = model.shard_group();
    (g.rank(), g.world_size())
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
    let result = (|| -> Result<PathBuf> {
        let pg = model.process_group().clone();
        let (rank, ws) = writer_place(model);
        let writes = model.replica_index() == 0;
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
        let file = staging.join(shard_file_name(rank, ws));
        let (written, ostate) = match optim.state_header() {
            Ok((ostate, kinds)) => {
                let kept = Kept::of(model, &ostate, optim.state_dtype())?;
                let crcs = if writes {
                    write_rank_file(&file, model, optim, &kinds, (rank, ws), &kept)
                } else {
                    Ok(Vec::new())
                };
                match crcs {
                    Ok(crcs) => (Ok(crcs), Some((ostate, kinds, kept))),
                    Err(e) => (Err(e), None),
                }
            }
            Err(e) => (Err(e), None),
        };
        let (written, crcs) = match written {
            Ok(c) => (Ok(()), c),
            Err(e) => (Err(e), Vec::new()),
        };
        let cleanup = |staging: &Path| {
            if pg.rank() == 0 && !fault::crash_mode() {
                let _ = fs::remove_dir_all(staging);
            }
        };
        if let Err(e) = agree(
            pg.as_ref(),
            "writing the checkpoint shards",
            &staging,
            written,
        ) {
            cleanup(&staging);
            return Err(e);
        }
        let (ostate, kinds, kept) = ostate.expect("written on every rank");
        let checksums = match gather_checksums(model, &kinds, &kept, &crcs) {
            Ok(c) => c,
            Err(e) => {
                cleanup(&staging);
                return Err(e);
            }
        };
        let finished = if pg.rank() == 0 {
            (|| -> Result<()> {
                let files = (0..ws)
                    .map(|r| {
                        let name = shard_file_name(r, ws);
                        let p = staging.join(&name);
                        let bytes = fs::metadata(&p).map_err(|e| Error::io(&p, e))?.len();
                        Ok(FileMeta {
                            rank: r,
                            name,
                            bytes,
                            crc32c: checksums[r].clone(),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut train = state.clone();
                if train.mixed_precision.is_none() {
                    train.mixed_precision =
                        serde_json::to_value(model.config().mixed_precision).ok();
                }
                // Adapter-only: the units left to the base are re-read from it on load.
                if kept.in_base.iter().any(|&b| b) {
                    train.base = model.base().cloned();
                }
                let meta = CheckpointMeta {
                    format_version: FORMAT_VERSION,
                    world_size: ws,
                    strategy: Some(
                        super::super::strategy_name(model.config().sharding_strategy).to_string(),
                    ),
                    train,
                    dtype: "F32".into(),
                    units: unit_metas(model, &kept)?,
                    optimizer: Some(optimizer_meta(model, &ostate, &kinds, &kept)),
                    files,
                    saved_at_unix_ms: Some(now_unix_ms()),
                };
                publish(root, &staging, &final_dir, &meta, keep_last)
            })()
        } else {
            Ok(())
        };
        if finished.is_err() {
            cleanup(&staging);
        }
        agree(
            pg.as_ref(),
            "completing the checkpoint",
            &final_dir,
            finished,
        )?;
        Ok(final_dir)
    })();
    result.map_err(|e| e.in_checkpoint(step))
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
