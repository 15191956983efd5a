//! MNIST in the IDX format (<http://yann.lecun.com/exdb/mnist/>).
//!
//! An IDX file is a big-endian header followed by raw bytes:
//!
//! | file   | magic  | header                                   | payload                  |
//! |--------|--------|------------------------------------------|--------------------------|
//! | images | `2051` | magic, count, rows, cols (4 × `u32` BE)  | `count × rows × cols` u8 |
//! | labels | `2049` | magic, count (2 × `u32` BE)              | `count` u8               |
//!
//! Files may be gzip-compressed (detected by the gzip magic bytes `1f 8b`, not by the name).
//! Every error names the file and, where it applies, the expected and the found value.
//!
//! Built with the cargo feature `mnist` (on by default), which brings flate2.

use std::path::{Path, PathBuf};

use super::gz::read_maybe_gz;
use crate::error::{Error, Result};

/// Magic number of an IDX file of unsigned bytes with 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 2051;
/// Magic number of an IDX file of unsigned bytes with 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 2049;
/// Number of MNIST classes; every label must be below this.
pub const NUM_CLASSES: usize = 10;

const IMAGES_HEADER: usize = 16;
const LABELS_HEADER: usize = 8;

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Checks the header length and magic number; returns nothing on success.
fn check_header(path: &Path, bytes: &[u8], header: usize, magic: u32, kind: &str) -> Result<()> {
    if bytes.len() < header {
        return Err(Error::file(
            path,
            format!(
                "IDX {kind} file too short for its header: expected at least {header} bytes, \
                 found {}",
                bytes.len()
            ),
        ));
    }
    let found = be_u32(bytes, 0);
    if found != magic {
        return Err(Error::file(
            path,
            format!("bad IDX {kind} magic number: expected {magic}, found {found}"),
        ));
    }
    Ok(())
}

/// Checks that the payload after the header has exactly `payload` bytes.
fn check_payload(
    path: &Path,
    bytes: &[u8],
    header: usize,
    payload: usize,
    what: &str,
) -> Result<()> {
    let expected = header.checked_add(payload).ok_or_else(|| {
        Error::file(
            path,
            format!("IDX header claims an impossible size ({what})"),
        )
    })?;
    if bytes.len() < expected {
        return Err(Error::file(
            path,
            format!(
                "file shorter than its header says ({what}): expected {expected} bytes, \
                 found {} (truncated?)",
                bytes.len()
            ),
        ));
    }
    if bytes.len() > expected {
        return Err(Error::file(
            path,
            format!(
                "file longer than its header says ({what}): expected {expected} bytes, \
                 found {} ({} trailing bytes)",
                bytes.len(),
                bytes.len() - expected
            ),
        ));
    }
    Ok(())
}

/// Reads an IDX image file (magic `2051`), gzip-compressed or not.
///
/// Returns `(pixels, count, rows, cols)`: `pixels` holds `count × rows × cols` raw `u8` values,
/// image-major then row-major (image `i`, row `y`, column `x` is at `(i·rows + y)·cols + x`).
///
/// # Errors
/// [`Error::Io`] if the file cannot be read; [`Error::File`] naming the file if gzip
/// decompression fails, the magic number is not 2051 (expected vs found), or the file is shorter
/// or longer than `16 + count × rows × cols` bytes (expected vs found byte counts).
pub fn read_idx_images(path: impl AsRef<Path>) -> Result<(Vec<u8>, usize, usize, usize)> {
    let path = path.as_ref();
    let bytes = read_maybe_gz(path)?;
    check_header(path, &bytes, IMAGES_HEADER, IMAGES_MAGIC, "images")?;
    let count = be_u32(&bytes, 4) as usize;
    let rows = be_u32(&bytes, 8) as usize;
    let cols = be_u32(&bytes, 12) as usize;
    let payload = count
        .checked_mul(rows)
        .and_then(|n| n.checked_mul(cols))
        .ok_or_else(|| {
            Error::file(
                path,
                format!("IDX header claims an impossible size: {count} × {rows} × {cols}"),
            )
        })?;
    check_payload(
        path,
        &bytes,
        IMAGES_HEADER,
        payload,
        &format!("16-byte header + {count} images of {rows}×{cols}"),
    )?;
    let pixels = bytes[IMAGES_HEADER..].to_vec();
    Ok((pixels, count, rows, cols))
}

/// Reads an IDX label file (magic `2049`), gzip-compressed or not.
///
/// Returns one raw `u8` label per item. The values are not range-checked here (IDX label files
/// are generic); [`Mnist::load`] checks that every label is below [`NUM_CLASSES`].
///
/// # Errors
/// [`Error::Io`] if the file cannot be read; [`Error::File`] naming the file if gzip
/// decompression fails, the magic number is not 2049 (expected vs found), or the file is shorter
/// or longer than `8 + count` bytes (expected vs found byte counts).
pub fn read_idx_labels(path: impl AsRef<Path>) -> Result<Vec<u8>> {
    let path = path.as_ref();
    let bytes = read_maybe_gz(path)?;
    check_header(path, &bytes, LABELS_HEADER, LABELS_MAGIC, "labels")?;
    let count = be_u32(&bytes, 4) as usize;
    check_payload(
        path,
        &bytes,
        LABELS_HEADER,
        count,
        &format!("8-byte header + {count} labels"),
    )?;
    Ok(bytes[LABELS_HEADER..].to_vec())
}

/// The MNIST dataset held in memory.
///
/// Images are stored flat, `len × rows × cols` `f32` values, image-major then row-major, each
/// pixel being the raw byte divided by 255 so that it lies in `[0, 1]`. **No other
/// normalisation** is applied (no mean/std standardisation such as PyTorch examples'
/// `Normalize((0.1307,), (0.3081,))`); do it in the model if wanted.
/// For MNIST `rows = cols = 28`, the training split has 60 000 items and the test split 10 000.
#[derive(Debug, Clone)]
pub struct Mnist {
    /// Training images: `train_len() × rows × cols` values in `[0, 1]` (pixel / 255).
    pub train_images: Vec<f32>,
    /// Training labels, one per training image, each in `0..10`.
    pub train_labels: Vec<u8>,
    /// Test images: `test_len() × rows × cols` values in `[0, 1]` (pixel / 255).
    pub test_images: Vec<f32>,
    /// Test labels, one per test image, each in `0..10`.
    pub test_labels: Vec<u8>,
    /// Image height in pixels (28 for MNIST).
    pub rows: usize,
    /// Image width in pixels (28 for MNIST).
    pub cols: usize,
}

/// Resolves `dir/name.gz`, falling back to the uncompressed `dir/name`.
fn resolve(dir: &Path, name: &str) -> Result<PathBuf> {
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(plain);
    }
    Err(Error::file(
        gz,
        format!(
            "MNIST file not found (nor its uncompressed form {})",
            plain.display()
        ),
    ))
}

/// Reads one split (images + labels) and cross-checks it.
fn load_split(dir: &Path, images: &str, labels: &str) -> Result<(Vec<f32>, Vec<u8>, usize, usize)> {
    let ipath = resolve(dir, images)?;
    let lpath = resolve(dir, labels)?;
    let (pixels, count, rows, cols) = read_idx_images(&ipath)?;
    if count == 0 {
        // An empty split would train on nothing and report a NaN loss and 0 % accuracy.
        return Err(Error::file(
            &ipath,
            "holds no images: expected at least one (an empty split has no loss or accuracy)",
        ));
    }
    let labels = read_idx_labels(&lpath)?;
    if labels.len() != count {
        return Err(Error::file(
            &lpath,
            format!(
                "label count does not match image file {}: expected {count} labels, found {}",
                ipath.display(),
                labels.len()
            ),
        ));
    }
    if let Some((i, &l)) = labels
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize >= NUM_CLASSES)
    {
        return Err(Error::file(
            &lpath,
            format!("label {i} is {l}: expected a class in 0..{NUM_CLASSES}"),
        ));
    }
    let images = pixels.iter().map(|&p| f32::from(p) / 255.0).collect();
    Ok((images, labels, rows, cols))
}

impl Mnist {
    /// Loads the four MNIST files from `dir`.
    ///
    /// Reads `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and
    /// `t10k-labels-idx1-ubyte`, each preferably with a `.gz` suffix; if the `.gz` file is
    /// absent the uncompressed name is used. Pixels are converted to `f32` as `byte / 255`.
    ///
    /// # Errors
    /// Everything [`read_idx_images`] and [`read_idx_labels`] report, plus [`Error::File`] naming
    /// the file when a file is missing, when an image file holds no images, when a label file's
    /// count differs from its image file's
    /// (expected vs found), when a label is not in `0..10`, or when the test images' size differs
    /// from the training images' (expected vs found `rows×cols`).
    pub fn load(dir: impl AsRef<Path>) -> Result<Mnist> {
        let dir = dir.as_ref();
        let (train_images, train_labels, rows, cols) =
            load_split(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte")?;
        let (test_images, test_labels, trows, tcols) =
            load_split(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?;
        if (trows, tcols) != (rows, cols) {
            return Err(Error::file(
                resolve(dir, "t10k-images-idx3-ubyte")?,
                format!(
                    "test image size differs from the training images': expected {rows}×{cols}, \
                     found {trows}×{tcols}"
                ),
            ));
        }
        Ok(Mnist {
            train_images,
            train_labels,
            test_images,
            test_labels,
            rows,
            cols,
        })
    }

    /// Number of training items (60 000 for MNIST).
    pub fn train_len(&self) -> usize {
        self.train_labels.len()
    }

    /// Number of test items (10 000 for MNIST).
    pub fn test_len(&self) -> usize {
        self.test_labels.len()
    }

    /// Number of `f32` values per image, `rows × cols` (784 for MNIST).
    pub fn image_len(&self) -> usize {
        self.rows * self.cols
    }
}
