//! File plumbing of checkpoints: atomic writes, a streaming safetensors writer and a
//! memory-mapped safetensors reader that copies element ranges.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::fault;
use super::ReadStats;
use crate::error::{Error, Result};

/// Elements converted per write of f32 data (64 KiB of bytes).
const CHUNK_ELEMS: usize = 16 * 1024;

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A file written under a temporary name in its final directory and renamed into place by
/// [`AtomicFile::commit`] after a flush and an fsync (then the directory is fsynced), so that
/// `path` holds either its previous content or the complete new one, never a torn write.
/// Dropping it uncommitted removes the temporary file.
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<BufWriter<File>>,
    written: u64,
}

impl std::fmt::Debug for AtomicFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtomicFile")
            .field("path", &self.path)
            .field("tmp", &self.tmp)
            .field("written", &self.written)
            .finish()
    }
}

impl AtomicFile {
    /// Creates the temporary file `.<name>.tmp-<pid>-<n>` next to `path`.
    ///
    /// Errors: the directory does not exist or is not writable (naming `path`).
    pub fn create(path: &Path) -> Result<Self> {
        let dir = parent_dir(path);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
        let tmp = dir.join(format!(
            ".{name}.tmp-{}-{}",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io(path, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            file: Some(BufWriter::with_capacity(256 << 10, file)),
            written: 0,
        })
    }

    /// The final path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written so far.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// Appends `bytes`.
    ///
    /// Errors: any I/O error (e.g. a full disk), naming the final path.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        let f = self.file.as_mut().expect("AtomicFile used after commit");
        let res = match fault::allow(bytes.len()) {
            Ok(()) => f.write_all(bytes),
            Err(fit) => f
                .write_all(&bytes[..fit])
                .and_then(|_| f.flush())
                .and_then(|_| {
                    Err(std::io::Error::other(
                        "injected write failure (checkpoint::fault)",
                    ))
                }),
        };
        res.map_err(|e| Error::io(&self.path, e))?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Appends `values` as little-endian f32, converting 64 KiB at a time.
    ///
    /// Errors: as [`AtomicFile::write_all`].
    pub fn write_f32s(&mut self, values: &[f32]) -> Result<()> {
        let mut buf = Vec::with_capacity(CHUNK_ELEMS.min(values.len()) * 4);
        for chunk in values.chunks(CHUNK_ELEMS) {
            buf.clear();
            for v in chunk {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            self.write_all(&buf)?;
        }
        Ok(())
    }

    /// Hands the buffered bytes to the operating system (its page cache), so that a later
    /// [`AtomicFile::commit`] (for instance on another thread) only fsyncs and renames.
    ///
    /// Errors: as [`AtomicFile::write_all`].
    pub fn flush(&mut self) -> Result<()> {
        let f = self.file.as_mut().expect("AtomicFile used after commit");
        f.flush().map_err(|e| Error::io(&self.path, e))
    }

    /// Flushes, fsyncs, renames the temporary file to the final path and fsyncs the directory.
    /// Returns the file's size in bytes.
    ///
    /// Errors: the flush, fsync or rename fails (naming the final path); the temporary file is
    /// removed and a previous file at the final path is left as it was.
    pub fn commit(mut self) -> Result<u64> {
        let writer = self.file.take().expect("AtomicFile committed twice");
        let res = (|| -> std::io::Result<()> {
            let file = writer.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            drop(file);
            fs::rename(&self.tmp, &self.path)?;
            sync_dir(parent_dir(&self.path));
            Ok(())
        })();
        match res {
            Ok(()) => Ok(self.written),
            Err(e) => {
                if !fault::crash_mode() {
                    let _ = fs::remove_file(&self.tmp);
                }
                Err(Error::io(&self.path, e))
            }
        }
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some(f) = self.file.take() {
            drop(f);
            if !fault::crash_mode() {
                let _ = fs::remove_file(&self.tmp);
            }
        }
    }
}

/// Writes `bytes` to `path` atomically (see [`AtomicFile`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit().map(|_| ())
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Fsyncs a directory so that renames and creations in it are durable (best effort: some file
/// systems cannot sync a directory).
pub(crate) fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// One tensor of a safetensors file being written.
#[derive(Debug, Clone)]
pub(crate) struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn f32(name: impl Into<String>, numel: usize) -> Self {
        Self {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![numel],
        }
    }

    fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes a safetensors file tensor by tensor: the header (all names, dtypes, shapes and
/// offsets) first, then each tensor's bytes in header order, so that only one tensor needs to
/// be in memory at a time. The result is an ordinary safetensors file (8-byte little-endian
/// header length, JSON header padded with spaces to 8 bytes, data).
pub(crate) struct SafetensorsWriter {
    file: AtomicFile,
    specs: Vec<TensorSpec>,
    next: usize,
    /// CRC-32C of each tensor written so far, in header order.
    crcs: Vec<u32>,
    /// Bytes still owed to the tensor started by [`SafetensorsWriter::begin_tensor`].
    pending: usize,
}

impl SafetensorsWriter {
    pub fn create(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: HashMap<String, String>,
    ) -> Result<Self> {
        // The header is built by hand with sorted keys (serde_json's default map), so that the
        // same tensors give byte-identical files; safetensors' own serialiser iterates a
        // HashMap for `__metadata__`.
        let mut header = serde_json::Map::new();
        let sorted: std::collections::BTreeMap<_, _> = metadata.into_iter().collect();
        header.insert("__metadata__".into(), serde_json::json!(sorted));
        let mut offset = 0usize;
        for s in &specs {
            let n = s.nbytes();
            let entry = serde_json::json!({
                "dtype": s.dtype,
                "shape": s.shape,
                "data_offsets": [offset, offset + n],
            });
            if header.insert(s.name.clone(), entry).is_some() || s.name == "__metadata__" {
                return Err(Error::file(
                    path,
                    format!("tensor name {} used twice", s.name),
                ));
            }
            offset += n;
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
            .map_err(|e| Error::file(path, format!("cannot serialise header: {e}")))?;
        // The safetensors reader's own checks (offsets contiguous, sizes matching dtype × shape).
        serde_json::from_slice::<Metadata>(&json)
            .map_err(|e| Error::file(path, format!("invalid safetensors header: {e}")))?;
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut file = AtomicFile::create(path)?;
        file.write_all(&(json.len() as u64).to_le_bytes())?;
        file.write_all(&json)?;
        Ok(Self {
            file,
            specs,
            next: 0,
            crcs: Vec::new(),
            pending: 0,
        })
    }

    /// Errors if the tensor started by [`SafetensorsWriter::begin_tensor`] is incomplete.
    fn check_complete(&self) -> Result<()> {
        if self.pending > 0 {
            let spec = &self.specs[self.next - 1];
            return Err(Error::file(
                self.file.path(),
                format!(
                    "tensor {} is incomplete: {} of its {} bytes missing",
                    spec.name,
                    self.pending,
                    spec.nbytes()
                ),
            ));
        }
        Ok(())
    }

    fn expect(&mut self, name: &str, dtype: Dtype, nbytes: usize) -> Result<()> {
        self.check_complete()?;
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::file(
                self.file.path(),
                format!("tensor {name} written after the last header entry"),
            )
        })?;
        if spec.name != name || spec.dtype != dtype || spec.nbytes() != nbytes {
            return Err(Error::file(
                self.file.path(),
                format!(
                    "tensor written out of header order: expected {} {:?} {:?} ({} bytes), \
                     found {name} {dtype:?} ({nbytes} bytes)",
                    spec.name,
                    spec.dtype,
                    spec.shape,
                    spec.nbytes()
                ),
            ));
        }
        self.next += 1;
        Ok(())
    }

    /// Writes the next tensor, `name`, from f32 values (little-endian, converted 64 KiB at a
    /// time), and records the CRC-32C of its bytes.
    pub fn write_f32(&mut self, name: &str, values: &[f32]) -> Result<()> {
        self.expect(name, Dtype::F32, values.len() * 4)?;
        let mut crc = 0u32;
        let mut buf = Vec::with_capacity(CHUNK_ELEMS.min(values.len()) * 4);
        for chunk in values.chunks(CHUNK_ELEMS) {
            buf.clear();
            for v in chunk {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            crc = crc32c::crc32c_append(crc, &buf);
            self.file.write_all(&buf)?;
        }
        self.crcs.push(crc);
        Ok(())
    }

    /// Writes the next tensor, `name`, from a candle tensor (its own dtype), and records the
    /// CRC-32C of its bytes.
    pub fn write_tensor(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let (dtype, bytes) = tensor_bytes(t)?;
        self.expect(name, dtype, bytes.len())?;
        self.crcs.push(crc32c::crc32c(&bytes));
        self.file.write_all(&bytes)
    }

    /// Starts the next tensor, `name`, of `nbytes` bytes in `dtype`, whose bytes then follow in
    /// parts ([`SafetensorsWriter::write_part`]), so that no tensor need be in memory whole.
    pub fn begin_tensor(&mut self, name: &str, dtype: Dtype, nbytes: usize) -> Result<()> {
        self.expect(name, dtype, nbytes)?;
        self.pending = nbytes;
        self.crcs.push(0);
        Ok(())
    }

    /// Appends the next `bytes` of the tensor started by [`SafetensorsWriter::begin_tensor`]
    /// (and folds them into its CRC-32C).
    ///
    /// Errors: more bytes than the tensor has left (naming it), or an I/O error.
    pub fn write_part(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() > self.pending {
            let name = self
                .specs
                .get(self.next.wrapping_sub(1))
                .map_or("?", |s| &s.name);
            return Err(Error::file(
                self.file.path(),
                format!(
                    "tensor {name}: {} bytes written where {} were left",
                    bytes.len(),
                    self.pending
                ),
            ));
        }
        self.pending -= bytes.len();
        if let Some(crc) = self.crcs.last_mut() {
            *crc = crc32c::crc32c_append(*crc, bytes);
        }
        self.file.write_all(bytes)
    }

    /// Checks that every tensor was written and commits the file; returns its size in bytes
    /// and the CRC-32C of each tensor's data, in header order.
    pub fn finish(self) -> Result<(u64, Vec<u32>)> {
        let (bytes, crcs, file) = self.finish_deferred()?;
        file.commit()?;
        Ok((bytes, crcs))
    }

    /// [`SafetensorsWriter::finish`] without the commit: every tensor checked written, the
    /// bytes flushed to the operating system; returns the size, the checksums and the file,
    /// whose [`AtomicFile::commit`] (fsync, rename) the caller runs, possibly on another thread
    /// (asynchronous checkpoint saves).
    pub fn finish_deferred(mut self) -> Result<(u64, Vec<u32>, AtomicFile)> {
        self.check_complete()?;
        if self.next != self.specs.len() {
            return Err(Error::file(
                self.file.path(),
                format!(
                    "only {} of {} tensors were written",
                    self.next,
                    self.specs.len()
                ),
            ));
        }
        self.file.flush()?;
        Ok((self.file.bytes_written(), self.crcs, self.file))
    }
}

/// The safetensors dtype of a candle dtype this module stores.
pub(crate) fn st_dtype(dtype: DType) -> Result<Dtype> {
    Ok(match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F64 => Dtype::F64,
        other => {
            return Err(Error::dtype(
                "a checkpoint tensor",
                "floating-point (F32, BF16, F16, F64)",
                other,
            ))
        }
    })
}

/// The candle dtype of a safetensors dtype this module reads (F32, BF16, F16, F64).
pub(crate) fn candle_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

/// A tensor's bytes (little-endian, row-major) in its own dtype.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<(Dtype, Vec<u8>)> {
    let dtype = st_dtype(t.dtype())?;
    let flat = t.flatten_all()?;
    let bytes = match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        _ => flat
            .to_vec1::<f64>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    };
    Ok((dtype, bytes))
}

/// A memory-mapped safetensors file whose header has been parsed and checked (offsets
/// contiguous, total size matching): tensor data is read range by range, touching only the
/// pages of those ranges.
pub(crate) struct MappedFile {
    pub path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    pub metadata: HashMap<String, String>,
}

impl MappedFile {
    /// Opens and maps `path` and parses its header. `expected_len`: the size recorded at save
    /// time, if any.
    ///
    /// Errors, naming the file: missing or unreadable; a size other than `expected_len`
    /// (truncated or modified); too short, or a header that does not parse or whose offsets
    /// do not match the file size (truncated or corrupt).
    pub fn open(path: &Path, expected_len: Option<u64>, stats: &mut ReadStats) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if let Some(exp) = expected_len {
            if exp != len {
                return Err(Error::file(
                    path,
                    format!(
                        "truncated or corrupt: expected {exp} bytes (as recorded in {}), found \
                         {len}",
                        super::META_FILE
                    ),
                ));
            }
        }
        if len < 8 {
            return Err(Error::file(
                path,
                format!(
                    "corrupt or truncated safetensors file: {len} bytes, less than the 8-byte \
                     header length"
                ),
            ));
        }
        // SAFETY: the map is read-only; as with every mmap (and candle's own
        // `MmapedSafetensors`), the file must not be truncated or rewritten in place while it is
        // mapped. Checkpoint files are only ever replaced by rename, which leaves this mapping
        // on the old inode.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (n, header) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| Error::file(path, explain_safetensors_error(&mmap, &e)))?;
        stats.files_opened += 1;
        stats.header_bytes += 8 + n as u64;
        let tensors = header
            .tensors()
            .into_iter()
            .map(|(k, v)| (k, v.clone()))
            .collect();
        let metadata = header.metadata().clone().unwrap_or_default();
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            data_start: 8 + n,
            tensors,
            metadata,
        })
    }

    /// Names of the tensors in the file (unordered).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The header entry of `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Where the bytes of tensor `name` lie in the file (absolute byte offsets), for readers
    /// that read the file instead of the map (the offline tools, whose memory must not grow
    /// with the pages they touched).
    pub fn byte_range(&self, name: &str) -> Option<Range<u64>> {
        self.tensors.get(name).map(|i| {
            (self.data_start + i.data_offsets.0) as u64..(self.data_start + i.data_offsets.1) as u64
        })
    }

    /// Checks that `name` exists with `dtype` and `shape`.
    ///
    /// Errors, naming file and tensor: missing; dtype or shape other than expected.
    pub fn check(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<()> {
        let info = self.tensors.get(name).ok_or_else(|| {
            Error::file(
                &self.path,
                format!("tensor {name} is missing (expected {dtype:?} of shape {shape:?})"),
            )
        })?;
        if info.dtype != dtype {
            return Err(Error::file(
                &self.path,
                format!(
                    "tensor {name}: expected dtype {dtype:?}, found {:?}",
                    info.dtype
                ),
            ));
        }
        if info.shape != shape {
            return Err(Error::file(
                &self.path,
                format!(
                    "tensor {name}: expected shape {shape:?}, found {:?}",
                    info.shape
                ),
            ));
        }
        Ok(())
    }

    /// CRC-32C of tensor `name`'s data bytes.
    ///
    /// Errors: missing tensor.
    pub fn crc32c(&self, name: &str) -> Result<u32> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::file(&self.path, format!("tensor {name} is missing")))?;
        let (a, b) = info.data_offsets;
        Ok(crc32c::crc32c(
            &self.mmap[self.data_start + a..self.data_start + b],
        ))
    }

    /// Copies elements `range` (row-major) of tensor `name` into `out`, converting F32, BF16,
    /// F16 or F64 to f32. Only the bytes of that range are touched.
    ///
    /// Errors: missing tensor, range outside it, a non-float dtype.
    pub fn read_f32(
        &self,
        name: &str,
        range: Range<usize>,
        out: &mut [f32],
        stats: &mut ReadStats,
    ) -> Result<()> {
        debug_assert_eq!(range.len(), out.len());
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::file(&self.path, format!("tensor {name} is missing")))?;
        let size = info.dtype.bitsize() / 8;
        let numel = (info.data_offsets.1 - info.data_offsets.0) / size.max(1);
        if range.end > numel {
            return Err(Error::file(
                &self.path,
                format!("tensor {name}: elements {range:?} requested, it has {numel} elements"),
            ));
        }
        let start = self.data_start + info.data_offsets.0 + range.start * size;
        let bytes = &self.mmap[start..start + range.len() * size];
        stats.data_bytes += bytes.len() as u64;
        match info.dtype {
            Dtype::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Dtype::BF16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Dtype::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Dtype::F64 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    *o = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32;
                }
            }
            other => {
                return Err(Error::file(
                    &self.path,
                    format!(
                    "tensor {name}: expected a float dtype (F32, BF16, F16, F64), found {other:?}"
                ),
                ))
            }
        }
        Ok(())
    }

    /// Reads the whole tensor `name` as a candle tensor of `dtype` (for small buffers).
    pub fn read_tensor(
        &self,
        name: &str,
        dtype: DType,
        device: &candle_core::Device,
        stats: &mut ReadStats,
    ) -> Result<Tensor> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::file(&self.path, format!("tensor {name} is missing")))?;
        let shape = info.shape.clone();
        let n: usize = shape.iter().product();
        let mut v = vec![0.0f32; n];
        self.read_f32(name, 0..n, &mut v, stats)?;
        Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
    }
}

/// Why `bytes` is not a readable safetensors file, in sizes: the header length against the
/// file's, or where the header says the tensor data ends against the bytes there are; else
/// the safetensors crate's error `e`.
fn explain_safetensors_error(bytes: &[u8], e: &safetensors::SafeTensorError) -> String {
    let len = bytes.len() as u64;
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes checked"));
    if 8 + n > len {
        return format!(
            "corrupt or truncated safetensors file: its header says {n} bytes of JSON follow \
             the 8-byte length, but the file has {len} bytes in all"
        );
    }
    let end = serde_json::from_slice::<serde_json::Value>(&bytes[8..(8 + n) as usize])
        .ok()
        .and_then(|v| {
            v.as_object()?
                .values()
                .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
                .max()
        });
    match end {
        Some(end) if 8 + n + end != len => format!(
            "corrupt or truncated safetensors file: its header places tensor data up to byte \
             {} (8 + {n} header bytes + {end}), but the file has {len} bytes",
            8 + n + end
        ),
        _ => format!("corrupt or truncated safetensors file: {e}"),
    }
}
