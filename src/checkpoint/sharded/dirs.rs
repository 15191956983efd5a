//! Step directories of a sharded checkpoint: staging, publishing, rotation, runs.

#[allow(unused_imports)]
use super::*;

/// Rank 0: removes a stale staging directory of the same step and creates a fresh one.
pub(crate) fn prepare_staging(root: &Path, staging: &Path) -> Result<()> {
    fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
    if staging.exists() {
        fs::remove_dir_all(staging).map_err(|e| Error::io(staging, e))?;
    }
    fs::create_dir(staging).map_err(|e| Error::io(staging, e))?;
    sync_dir(root);
    Ok(())
}

/// Rank 0: writes `meta.json` into the staging directory, renames it to its final name
/// (replacing a checkpoint of the same step) and rotates.
pub(crate) fn publish(
    root: &Path,
    staging: &Path,
    final_dir: &Path,
    meta: &CheckpointMeta,
    keep_last: usize,
) -> Result<()> {
    let json = serde_json::to_vec_pretty(meta).expect("metadata serialises");
    write_atomic(&staging.join(META_FILE), &json)?;
    sync_dir(staging);
    let name = final_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("step");
    let had_old = final_dir.exists();
    // The same step of another run is kept, renamed `step-<n>.run-<its run id>` (not a step
    // directory any more: never loaded or rotated), rather than deleted: a run started from
    // scratch in a directory that holds another run's checkpoints loses none of them.
    let other_run = had_old && run_of(final_dir) != meta.train.run_id;
    let replaced = if other_run {
        let id: String = run_of(final_dir)
            .unwrap_or_else(|| "unknown".into())
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let mut k = 0;
        loop {
            let suffix = if k == 0 {
                String::new()
            } else {
                format!(".{k}")
            };
            let p = root.join(format!("{name}.run-{id}{suffix}"));
            if !p.exists() {
                break p;
            }
            k += 1;
        }
    } else {
        root.join(format!(".{name}.replaced"))
    };
    if had_old {
        if replaced.exists() {
            fs::remove_dir_all(&replaced).map_err(|e| Error::io(&replaced, e))?;
        }
        fs::rename(final_dir, &replaced).map_err(|e| Error::io(final_dir, e))?;
    }
    if other_run {
        tracing::warn!(
            "checkpoint {} of another run is kept as {}",
            final_dir.display(),
            replaced.display()
        );
    }
    if let Err(e) = fs::rename(staging, final_dir) {
        if had_old {
            let _ = fs::rename(&replaced, final_dir);
        }
        return Err(Error::io(final_dir, e));
    }
    sync_dir(root);
    if had_old && !other_run {
        let _ = fs::remove_dir_all(&replaced);
    }
    if keep_last > 0 {
        if let Err(e) = rotate(root, final_dir, keep_last, meta.train.run_id.as_deref()) {
            tracing::warn!("checkpoint rotation under {}: {e}", root.display());
        }
    }
    Ok(())
}

/// Deletes the oldest complete checkpoints of run `run_id` other than `keep` until
/// `keep_last` remain (`keep` counting as one); other runs' checkpoints are never touched.
/// Each is renamed to a hidden name first, so a crash during the deletion never leaves a
/// partly deleted directory that looks complete.
pub(super) fn rotate(
    root: &Path,
    keep: &Path,
    keep_last: usize,
    run_id: Option<&str>,
) -> Result<()> {
    let mut all = list_run(root, run_id)?;
    all.retain(|p| p != keep);
    while all.len() + 1 > keep_last {
        let old = all.remove(0);
        let name = old.file_name().and_then(|n| n.to_str()).unwrap_or("step");
        let trash = root.join(format!(".{name}.deleting"));
        fs::rename(&old, &trash).map_err(|e| Error::io(&old, e))?;
        fs::remove_dir_all(&trash).map_err(|e| Error::io(&trash, e))?;
    }
    sync_dir(root);
    Ok(())
}

/// The run id recorded in a complete checkpoint's `meta.json`: `Some(None)` for an anonymous
/// run, `None` when the metadata cannot be read (damaged: reported when it is loaded).
pub(super) fn read_run(dir: &Path) -> Option<Option<String>> {
    let bytes = fs::read(dir.join(META_FILE)).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    Some(v.get("run_id").and_then(|r| r.as_str()).map(str::to_string))
}

/// The run id of a checkpoint (`None`: anonymous or unreadable).
pub(super) fn run_of(dir: &Path) -> Option<String> {
    read_run(dir).flatten()
}

/// Complete checkpoints under `root` of run `run_id`, oldest first (one whose metadata cannot
/// be read belongs to no run: never rotated away, never loaded as this run's).
pub(super) fn list_run(root: &Path, run_id: Option<&str>) -> Result<Vec<PathBuf>> {
    Ok(list_complete(root)?
        .into_iter()
        .filter(|d| read_run(d).is_some_and(|r| r.as_deref() == run_id))
        .collect())
}
