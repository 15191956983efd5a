//! Storage formats of a frozen base: how a LoRA/QLoRA run keeps, and all-gathers, the
//! parameters it does not train ([`crate::FsdpConfig::frozen_storage`]).
//!
//! A frozen shard is packed once, when the model is built, and stays packed: the all-gather
//! moves the packed bytes and the unit dequantises them after the gather into its compute dtype
//! (design/fsdp.md, "Packed frozen bases"; decision 74). The formats:
//!
//! | format | bytes per element | layout of `n` values (`n` a multiple of [`BaseDType::block`]) |
//! |---|---|---|
//! | `f32`  | 4 | `n` little-endian f32 |
//! | `bf16` | 2 | `n` little-endian bf16, rounded to nearest even |
//! | `int8` | 1 + 4/64 | `n` i8 codes, then `n/64` f32 LE absmax, one per block of 64 |
//! | `nf4`  | 1/2 + 4/64 | `n/2` bytes (element `2i` in the high nibble, `2i+1` in the low), then `n/64` f32 LE absmax |
//!
//! **int8** is linear absmax quantisation over blocks of 64 consecutive elements of the flat
//! shard, with the arithmetic of bitsandbytes' `int8_vectorwise_quant` / `_dequant` (LLM.int8,
//! Dettmers et al. 2022) applied to each block as to a row: code = round-half-even(x · (127 /
//! absmax)), value = (code · absmax) · 7.874015718698502e-3 (1/127 in f32). The issue asked for
//! one scale per output row; a flat shard's boundaries cut rows, so each rank could not compute
//! a row's scale from its own bytes (decision 74). Blocks of 64 are never cut, because frozen
//! shards are padded to a multiple of the block ([`crate::flat_param::FlatParamLayout::with_shard_multiple`]).
//!
//! **nf4** is QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, "QLoRA", §3) with the codebook and
//! arithmetic of bitsandbytes' `quantize_4bit(blocksize=64, quant_type="nf4")`: scaled =
//! clamp(x · (1 / max(absmax, 1e-38)), −1, 1), code = the first codebook entry whose upper
//! midpoint is ≥ scaled (`torch.bucketize`: a value on a midpoint takes the lower entry), value
//! = codebook\[code\] · absmax. `scripts/make-quant-fixture.py` writes bitsandbytes' bytes for the
//! tests (`tests/quant.rs`), which equal ours exactly.

use crate::error::{Error, Result};

/// The storage (and all-gather) format of a frozen parameter shard. See the module docs for
/// each layout and its source.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum BaseDType {
    /// Unpacked f32: the shard is an ordinary f32 tensor (the default; nothing is packed).
    #[default]
    F32,
    /// bf16, 2 bytes per element (round to nearest even).
    Bf16,
    /// Blockwise (64) linear absmax int8: 1 byte per element + one f32 scale per 64.
    Int8,
    /// QLoRA's NF4, blockwise absmax (64): half a byte per element + one f32 scale per 64.
    Nf4,
}

/// The elements of one int8 / NF4 scale block.
pub const QUANT_BLOCK: usize = 64;

/// QLoRA's NormalFloat-4 codebook, as bitsandbytes' `get_4bit_type("nf4")` lists it (the f32
/// nearest each of its decimal literals), ascending.
pub const NF4_CODEBOOK: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// 1/127 in f32, the factor bitsandbytes' int8 dequantisation multiplies by (its literal
/// `7.874015718698502e-3` is this f32 printed in full).
const INV_127: f32 = 1.0 / 127.0;

/// Midpoints between adjacent NF4 entries, computed in f32 as bitsandbytes does.
fn nf4_midpoints() -> [f32; 15] {
    std::array::from_fn(|i| (NF4_CODEBOOK[i] + NF4_CODEBOOK[i + 1]) / 2.0)
}

impl BaseDType {
    /// Parses `f32`, `bf16`, `int8` or `nf4` (the `--base-dtype` flag).
    ///
    /// # Errors
    /// [`Error::Value`] naming the value and the accepted ones.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "f32" => Self::F32,
            "bf16" => Self::Bf16,
            "int8" => Self::Int8,
            "nf4" => Self::Nf4,
            _ => {
                return Err(Error::value(
                    "base dtype",
                    "one of f32, bf16, int8, nf4",
                    format!("{name:?}"),
                ))
            }
        })
    }

    /// The flag spelling (`"f32"`, `"bf16"`, `"int8"`, `"nf4"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Nf4 => "nf4",
        }
    }

    /// The element count a packed run must be a multiple of: 1 for f32/bf16,
    /// [`QUANT_BLOCK`] for int8/NF4.
    pub fn block(self) -> usize {
        match self {
            Self::F32 | Self::Bf16 => 1,
            Self::Int8 | Self::Nf4 => QUANT_BLOCK,
        }
    }

    /// Bytes that `numel` elements take in this format (`numel` a multiple of
    /// [`BaseDType::block`]): 4n, 2n, n + n/16, n/2 + n/16.
    pub fn packed_bytes(self, numel: usize) -> usize {
        match self {
            Self::F32 => 4 * numel,
            Self::Bf16 => 2 * numel,
            Self::Int8 => numel + 4 * (numel / QUANT_BLOCK),
            Self::Nf4 => numel / 2 + 4 * (numel / QUANT_BLOCK),
        }
    }

    /// The largest |x − unpack(pack(x))| for an element x whose block has absolute maximum
    /// `absmax` (for f32/bf16, whose error is relative, `absmax` is |x| itself):
    /// - f32: 0;
    /// - bf16: |x| · 2⁻⁸ (half a unit in the last place of an 8-bit significand);
    /// - int8: absmax / 254 (half a step of 127 per side) plus 2⁻²⁰ · absmax for the f32
    ///   products of the two formulas;
    /// - nf4: absmax · (1 − 0.6961928) / 2, half the widest gap of the codebook (between its two
    ///   smallest entries, −1 and −0.6961928), plus 2⁻²⁰ · absmax.
    pub fn error_bound(self, absmax: f32) -> f32 {
        let slack = absmax * (1.0 / (1u32 << 20) as f32);
        match self {
            Self::F32 => 0.0,
            Self::Bf16 => absmax / 256.0,
            Self::Int8 => absmax / 254.0 + slack,
            Self::Nf4 => absmax * (NF4_CODEBOOK[1] - NF4_CODEBOOK[0]) / 2.0 + slack,
        }
    }

    /// The code bytes of `numel` elements (the packed bytes without the scales).
    fn code_bytes(self, numel: usize) -> usize {
        match self {
            Self::F32 => 4 * numel,
            Self::Bf16 => 2 * numel,
            Self::Int8 => numel,
            Self::Nf4 => numel / 2,
        }
    }

    fn check(self, numel: usize, bytes: usize, what: &str) -> Result<()> {
        if !numel.is_multiple_of(self.block()) {
            return Err(Error::shape(
                format!("{what} {numel} values as {}: the count", self.name()),
                format!("a multiple of the block, {}", self.block()),
                numel,
            ));
        }
        if bytes != self.packed_bytes(numel) {
            return Err(Error::shape(
                format!("{what} {numel} values as {}", self.name()),
                format!("{} packed bytes", self.packed_bytes(numel)),
                bytes,
            ));
        }
        Ok(())
    }
}

/// Packs `values` into `out` in `format` (layouts in the module docs).
///
/// # Errors
/// [`Error::Shape`] when `values.len()` is not a multiple of [`BaseDType::block`] or
/// `out.len()` is not [`BaseDType::packed_bytes`] of it.
pub fn pack(format: BaseDType, values: &[f32], out: &mut [u8]) -> Result<()> {
    let n = values.len();
    format.check(n, out.len(), "pack")?;
    match format {
        BaseDType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(values) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        BaseDType::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        BaseDType::Int8 => {
            let (codes, scales) = out.split_at_mut(n);
            for ((block, codes), scale) in values
                .chunks_exact(QUANT_BLOCK)
                .zip(codes.chunks_exact_mut(QUANT_BLOCK))
                .zip(scales.chunks_exact_mut(4))
            {
                let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                scale.copy_from_slice(&absmax.to_le_bytes());
                // A block of zeros keeps codes 0 (bitsandbytes would divide by zero).
                let mul = if absmax > 0.0 { 127.0 / absmax } else { 0.0 };
                for (c, v) in codes.iter_mut().zip(block) {
                    *c = ((v * mul).round_ties_even() as i8) as u8;
                }
            }
        }
        BaseDType::Nf4 => {
            let mids = nf4_midpoints();
            let (codes, scales) = out.split_at_mut(n / 2);
            for ((block, codes), scale) in values
                .chunks_exact(QUANT_BLOCK)
                .zip(codes.chunks_exact_mut(QUANT_BLOCK / 2))
                .zip(scales.chunks_exact_mut(4))
            {
                let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                scale.copy_from_slice(&absmax.to_le_bytes());
                let inv = 1.0 / absmax.max(1e-38);
                // torch.bucketize(right=False): the count of midpoints strictly below x.
                let code = |v: f32| {
                    let x = (v * inv).clamp(-1.0, 1.0);
                    mids.iter().filter(|&&m| m < x).count() as u8
                };
                for (c, pair) in codes.iter_mut().zip(block.chunks_exact(2)) {
                    *c = (code(pair[0]) << 4) | code(pair[1]);
                }
            }
        }
    }
    Ok(())
}

/// Unpacks `packed` (in `format`) into `out`, whose length is the element count. Runs of more
/// than 64 Ki elements are split over rayon's pool (the one Candle's matmul uses), in whole
/// blocks.
///
/// # Errors
/// [`Error::Shape`] when `out.len()` is not a multiple of [`BaseDType::block`] or
/// `packed.len()` is not [`BaseDType::packed_bytes`] of it.
pub fn unpack(format: BaseDType, packed: &[u8], out: &mut [f32]) -> Result<()> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let n = out.len();
    format.check(n, packed.len(), "unpack")?;
    let (codes, scales) = packed.split_at(format.code_bytes(n));
    let scale_bytes = |k: usize| {
        if format.block() == 1 {
            0
        } else {
            4 * (k / QUANT_BLOCK)
        }
    };
    if n <= CHUNK {
        unpack_run(format, codes, scales, out);
        return Ok(());
    }
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, o)| {
        let (a, b) = (i * CHUNK, i * CHUNK + o.len());
        let c = &codes[format.code_bytes(a)..format.code_bytes(b)];
        unpack_run(format, c, &scales[scale_bytes(a)..scale_bytes(b)], o);
    });
    Ok(())
}

/// Unpacks whole blocks: `out.len()` elements from their code bytes and (int8 / NF4) their
/// blocks' absmax bytes.
fn unpack_run(format: BaseDType, codes: &[u8], scales: &[u8], out: &mut [f32]) {
    match format {
        BaseDType::F32 => {
            for (o, b) in out.iter_mut().zip(codes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        BaseDType::Bf16 => {
            for (o, b) in out.iter_mut().zip(codes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        BaseDType::Int8 => {
            for ((block, codes), scale) in out
                .chunks_exact_mut(QUANT_BLOCK)
                .zip(codes.chunks_exact(QUANT_BLOCK))
                .zip(scales.chunks_exact(4))
            {
                let absmax = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
                for (o, &c) in block.iter_mut().zip(codes) {
                    *o = (f32::from(c as i8) * absmax) * INV_127;
                }
            }
        }
        BaseDType::Nf4 => {
            // One table lookup per byte yields both of its elements.
            let pairs: [[f32; 2]; 256] =
                std::array::from_fn(|b| [NF4_CODEBOOK[b >> 4], NF4_CODEBOOK[b & 15]]);
            for ((block, codes), scale) in out
                .chunks_exact_mut(QUANT_BLOCK)
                .zip(codes.chunks_exact(QUANT_BLOCK / 2))
                .zip(scales.chunks_exact(4))
            {
                let absmax = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
                for (o, &c) in block.chunks_exact_mut(2).zip(codes) {
                    let [hi, lo] = pairs[usize::from(c)];
                    o[0] = hi * absmax;
                    o[1] = lo * absmax;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn round_trips_are_within_the_bound_and_stable_when_repacked() {
        let mut x = values(4096 * QUANT_BLOCK, 7);
        for (i, v) in x.iter_mut().enumerate() {
            *v *= [1e-3f32, 0.37, 1.0, 17.0, 3e4][(i / QUANT_BLOCK) % 5];
        }
        for f in [
            BaseDType::F32,
            BaseDType::Bf16,
            BaseDType::Int8,
            BaseDType::Nf4,
        ] {
            let mut bytes = vec![0u8; f.packed_bytes(x.len())];
            pack(f, &x, &mut bytes).unwrap();
            let mut y = vec![0f32; x.len()];
            unpack(f, &bytes, &mut y).unwrap();
            for (bx, by) in x.chunks(QUANT_BLOCK).zip(y.chunks(QUANT_BLOCK)) {
                let absmax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in bx.iter().zip(by) {
                    let scale = if f.block() == 1 { a.abs() } else { absmax };
                    assert!((a - b).abs() <= f.error_bound(scale), "{f:?}: {a} -> {b}");
                }
            }
            // Packing the dequantised values again gives the same bytes, except that an int8
            // scale may move by one ulp ((127 · absmax) · (1/127) need not round to absmax).
            let mut again = vec![0u8; bytes.len()];
            pack(f, &y, &mut again).unwrap();
            if f == BaseDType::Int8 {
                let (codes, scales) = bytes.split_at(x.len());
                assert_eq!(codes, &again[..x.len()]);
                for (a, b) in scales.chunks(4).zip(again[x.len()..].chunks(4)) {
                    let (a, b) = (
                        u32::from_le_bytes(a.try_into().unwrap()),
                        u32::from_le_bytes(b.try_into().unwrap()),
                    );
                    assert!(a.abs_diff(b) <= 1, "int8 scale {a:#x} -> {b:#x}");
                }
            } else {
                assert_eq!(bytes, again, "{f:?}");
            }
        }
    }

    #[test]
    fn the_int8_factor_is_bitsandbytes_literal() {
        assert_eq!(
            INV_127.to_bits(),
            (7.874015718698502e-3f64 as f32).to_bits()
        );
    }

    #[test]
    fn a_zero_block_packs_to_zeros() {
        let x = vec![0f32; QUANT_BLOCK];
        for f in [BaseDType::Int8, BaseDType::Nf4] {
            let mut bytes = vec![0xAAu8; f.packed_bytes(x.len())];
            pack(f, &x, &mut bytes).unwrap();
            let mut y = vec![1f32; x.len()];
            unpack(f, &bytes, &mut y).unwrap();
            assert!(y.iter().all(|v| *v == 0.0), "{f:?}");
        }
    }

    #[test]
    fn wrong_lengths_name_the_counts() {
        let e = pack(BaseDType::Nf4, &[0.0; 10], &mut [0u8; 5])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("10 values as nf4") && e.contains("multiple of the block, 64"),
            "{e}"
        );
        let e = unpack(BaseDType::Int8, &[0u8; 10], &mut [0.0; 64])
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected 68 packed bytes, found 10"), "{e}");
        let e = BaseDType::from_name("fp4").unwrap_err().to_string();
        assert!(e.contains("\"fp4\"") && e.contains("nf4"), "{e}");
    }
}
