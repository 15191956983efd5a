//! Whole-file reads that gunzip a gzip file (detected by its magic bytes `1f 8b`, not by its
//! name); shared by the MNIST and text readers.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// Reads a whole file, gunzipping it when it starts with the gzip magic bytes.
pub(crate) fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    if raw.len() >= 2 && raw[0] == 0x1f && raw[1] == 0x8b {
        let mut out = Vec::with_capacity(raw.len() * 4);
        let mut dec = flate2::read::GzDecoder::new(raw.as_slice());
        if let Err(e) = dec.read_to_end(&mut out) {
            return Err(Error::file(
                path,
                format!(
                    "gzip decompression failed after {} decompressed bytes \
                     ({} compressed bytes in file): {e}",
                    out.len(),
                    raw.len()
                ),
            ));
        }
        Ok(out)
    } else {
        Ok(raw)
    }
}
