//! The identity of a frozen base: what an adapter-only checkpoint records instead of the base's
//! tensors (issue 33, decision 75). A leaf: files and checksums only.
//!
//! A LoRA run built from a Hugging Face directory
//! ([`crate::hf::decoder::build_from_hf_with`] with LoRA) knows its base
//! ([`crate::FsdpModel::base`]); its sharded checkpoints then store
//! only the units that train, and `meta.json`'s `train.base` names the directory and checksums
//! its `config.json` and weight files. Loading such a checkpoint needs a model built from the
//! same base: the identities are compared file by file, and the first file that differs (absent,
//! another size, another CRC-32C) is named.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One file of a base: its name in the directory, size in bytes, and CRC-32C (Castagnoli) of its
/// bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseFile {
    /// File name inside the base directory (`config.json`, `model.safetensors`, …).
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32C of the whole file.
    pub crc32c: u32,
}

/// A frozen base's identity: its directory (as given when the model was built) and, sorted by
/// name, its `config.json`, `model.safetensors.index.json` when present, and every
/// `*.safetensors` file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseIdentity {
    /// The directory the model was built from (canonical: absolute, links resolved).
    pub dir: PathBuf,
    /// Its files, sorted by name.
    pub files: Vec<BaseFile>,
}

/// Identities already computed in this process, by canonical directory and the files'
/// (name, size, modification time): ranks that are threads of one process, and repeated
/// saves, checksum a base once.
type Cache = HashMap<(PathBuf, Vec<(String, u64, Option<SystemTime>)>), Vec<BaseFile>>;

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Whether `name` is a file of a base's identity.
fn identifying(name: &str) -> bool {
    name == "config.json"
        || name == "model.safetensors.index.json"
        || name.ends_with(".safetensors")
}

impl BaseIdentity {
    /// The identity of the model directory `dir`: reads every identifying file once per process
    /// (CRC-32C at memory speed; the page cache is the ranks' common one).
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or file that could not be read; a directory without
    /// `config.json` ([`Error::Missing`] naming it).
    pub fn of(dir: &Path) -> Result<Self> {
        let canonical = fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
        let mut listing = Vec::new();
        for entry in fs::read_dir(&canonical).map_err(|e| Error::io(dir, e))? {
            let entry = entry.map_err(|e| Error::io(dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let meta = entry.metadata().map_err(|e| Error::io(entry.path(), e))?;
            if meta.is_file() && identifying(&name) {
                listing.push((name, meta.len(), meta.modified().ok()));
            }
        }
        listing.sort();
        if !listing.iter().any(|(n, ..)| n == "config.json") {
            return Err(Error::missing(
                format_args!("config.json in {}", dir.display()),
                "not a Hugging Face model directory",
            ));
        }
        let key = (canonical.clone(), listing.clone());
        if let Some(files) = cache().lock().expect("base cache").get(&key) {
            return Ok(Self {
                dir: canonical,
                files: files.clone(),
            });
        }
        let files = listing
            .iter()
            .map(|(name, bytes, _)| {
                let path = canonical.join(name);
                Ok(BaseFile {
                    name: name.clone(),
                    bytes: *bytes,
                    crc32c: file_crc32c(&path)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        cache()
            .lock()
            .expect("base cache")
            .insert(key, files.clone());
        Ok(Self {
            dir: canonical,
            files,
        })
    }

    /// Checks that `found` (the base a model was built from, or an export reads) is this
    /// recorded one.
    ///
    /// # Errors
    /// [`Error::Conflict`] naming the first file that differs: absent from either side,
    /// another size or another checksum, with both directories.
    pub fn check(&self, found: &BaseIdentity) -> Result<()> {
        let theirs: HashMap<&str, &BaseFile> =
            found.files.iter().map(|f| (f.name.as_str(), f)).collect();
        let differs = |what: String| {
            let now = if found.dir == self.dir {
                format!("{} as it is now", found.dir.display())
            } else {
                format!("the base given, {}", found.dir.display())
            };
            Err(Error::conflict(
                format_args!("the checkpoint's frozen base {}", self.dir.display()),
                now,
                format_args!(
                    "{what}{}: an adapter-only checkpoint holds no base tensor, it needs the \
                     base it was trained on",
                    if found.dir == self.dir {
                        ", so it has changed since"
                    } else {
                        ""
                    }
                ),
            ))
        };
        for f in &self.files {
            match theirs.get(f.name.as_str()) {
                None => return differs(format!("{} is missing", f.name)),
                Some(g) if g.bytes != f.bytes => {
                    return differs(format!(
                        "{} has {} bytes, the checkpoint recorded {}",
                        f.name, g.bytes, f.bytes
                    ))
                }
                Some(g) if g.crc32c != f.crc32c => {
                    return differs(format!(
                        "{} differs (CRC-32C {:#010x}, the checkpoint recorded {:#010x})",
                        f.name, g.crc32c, f.crc32c
                    ))
                }
                Some(_) => {}
            }
        }
        if let Some(extra) = found
            .files
            .iter()
            .find(|g| !self.files.iter().any(|f| f.name == g.name))
        {
            return differs(format!("{} was not part of it", extra.name));
        }
        Ok(())
    }

    /// The identity of `dir` when it is the recorded base `self` moved or copied there (or
    /// `self.dir` itself with `None`), checked against `self`.
    ///
    /// Errors: the directory cannot be read, naming it as the checkpoint's base (and how to
    /// give another); as [`BaseIdentity::check`].
    pub fn verify_at(&self, dir: Option<&Path>) -> Result<()> {
        let at = dir.unwrap_or(&self.dir);
        let found = Self::of(at).map_err(|e| {
            Error::InvalidArgument(format!(
                "the checkpoint's frozen base {} cannot be read ({e}){}",
                at.display(),
                if dir.is_none() {
                    "; if it moved, give its new directory (fsdp-ckpt export --base DIR)"
                } else {
                    ""
                }
            ))
        })?;
        self.check(&found)
    }
}

/// CRC-32C of a whole file, read in 4 MiB blocks.
fn file_crc32c(path: &Path) -> Result<u32> {
    let mut f = fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut buf = vec![0u8; 4 << 20];
    let mut crc = 0u32;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
    }
}
