//! The CUDA kernels of `kernels/` (CUDA C, compiled at run time with NVRTC, so a build needs no
//! CUDA toolkit) and their CPU references.
//!
//! Every kernel has a CPU reference here, written as plain loops over host slices with the same
//! arithmetic in the same order; the GPU tests (`tests/gpu/kernels.rs`, run by
//! `scripts/gpu-check.sh`) compare each kernel against its reference, and the CPU tests
//! (`tests/optim/kernels.rs`) check that each reference equals the production CPU path it stands for
//! ([`crate::ops`]' loops, the copy-in of `fsdp::collectives`, the `half` crate's conversions,
//! the grad scaler's update) and run the kernel sources themselves on the CPU under a host
//! emulation of the CUDA built-ins (`kernels/host/`) with the launch plans of [`plan`]. The
//! sources are embedded in the binary ([`SOURCES`]), compiled once per process and loaded once
//! per device by module `nvrtc` (feature `cuda`). The launch wrappers over Candle tensors are
//! the GPU side of [`crate::ops`] (`ops::cuda`).
//!
//! **A leaf.** This module imports nothing of the crate but [`crate::error`]: it knows the
//! kernels, their argument structs and their plans, not the optimizers or the flat parameters
//! that use them (Candle's `candle-kernels`). The references take the kernels' own argument
//! structs ([`plan::AdamWArgs`], [`plan::SgdArgs`]) and layouts ([`plan::CopyLayout`]); the
//! conversions live with the types above (`ops`, `flat_param`).
//!
//! | module  | kernels | reference |
//! |---------|---------|-----------|
//! | `cast`  | `cast` (f32 ↔ bf16 ↔ f16) | [`cast_reference`] |
//! | `copy`  | `copy_in`, `copy_out` | [`copy_in_reference`], [`copy_out_reference`] |
//! | `ops`   | `scale`, `scale_check_finite`, `non_finite`, `add`, `sum_squares_partial`/`_final` | [`scale_reference`], [`scale_check_finite_reference`], [`non_finite_reference`], [`add_reference`], [`sum_squares_reference`] |
//! | `optim` | `adamw`, `sgd`, `update_scale` | [`adamw_reference`], [`sgd_reference`], [`update_scale_reference`] |
//!
//! **Exactness.** bf16 and f16 conversions are bit for bit those of the `half` crate (round to
//! nearest even, NaN quietened with its payload kept, subnormals kept). The element-wise kernels
//! use IEEE round-to-nearest operations without fused multiply-add (and are compiled with
//! `--fmad=false`), like the CPU loops of [`crate::ops`], so their results agree bit for bit;
//! only NaN payloads may differ (a GPU returns the canonical NaN of an operation on NaN). The
//! sum of squares is reduced in a fixed tree order, reproduced exactly by
//! [`sum_squares_reference`]; it differs from the CPU path's element-order sum by rounding only.

#[cfg(feature = "cuda")]
pub mod nvrtc;
#[doc(hidden)]
pub mod plan;

use candle_core::DType;
use half::{bf16, f16};

use plan::{AdamWArgs, CopyLayout, ParamSpan, SgdArgs};

/// The shared prelude of every module (conversions, dtype codes, grid-stride loop), put in
/// front of each module's source in [`SOURCES`].
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One entry of [`SOURCES`]: the module name and `kernels/common.cuh` followed by
/// `kernels/<name>.cu` (a `#line` directive in between, so NVRTC's messages name the module's
/// own lines).
macro_rules! module {
    ($name:literal) => {
        (
            $name,
            concat!(
                include_str!("../../kernels/common.cuh"),
                "\n#line 1 \"",
                $name,
                ".cu\"\n",
                include_str!(concat!("../../kernels/", $name, ".cu"))
            ),
        )
    };
}

/// The kernel sources, `(module name, CUDA C source)`: one module per `.cu` file of `kernels/`,
/// each preceded by [`COMMON`]. The sources include no header (NVRTC then needs no include
/// path): bf16 and f16 are handled as 16-bit patterns with explicit conversions.
pub const SOURCES: &[(&str, &str)] = &[
    module!("cast"),
    module!("comm"),
    module!("copy"),
    module!("ops"),
    module!("optim"),
];

/// Threads per block of every 1-D launch.
pub const THREADS: u32 = 256;

/// Most blocks of an element-wise launch (grid-stride loops cover larger tensors): enough to
/// fill any current GPU several times over.
pub const MAX_BLOCKS: u32 = 2048;

/// Most blocks (partial sums) of the first pass of the sum of squares.
pub const MAX_REDUCE_BLOCKS: u32 = 1024;

/// Parameters per launch of `copy_in` / `copy_out` (their descriptors travel by value in the
/// kernel's parameter bank, which holds 4 KiB on every CUDA version).
pub const COPY_MAX_PARAMS: usize = 64;

/// Blocks of an element-wise launch over `n` elements: `ceil(n / THREADS)`, at least 1, at most
/// [`MAX_BLOCKS`].
pub fn elementwise_blocks(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS as usize) as u32
}

/// Blocks (= partial sums) of the sum of squares over `n` elements: `ceil(n / THREADS)`, at
/// least 1, at most [`MAX_REDUCE_BLOCKS`]. Fixes the reduction order ([`sum_squares_reference`]).
pub fn sum_squares_blocks(n: usize) -> u32 {
    n.div_ceil(THREADS as usize)
        .clamp(1, MAX_REDUCE_BLOCKS as usize) as u32
}

/// The kernels' code of an element dtype (`DT_F32` 0, `DT_BF16` 1, `DT_F16` 2 in
/// `kernels/common.cuh`); `None` for any other dtype.
pub fn dtype_code(dtype: DType) -> Option<u32> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

// ---- conversions: the twins of kernels/common.cuh (and of the half crate 2.x) --------------

/// bf16 (bits) → f32, exact; a NaN gets its quiet bit set. `bf16_to_f32` of
/// `kernels/common.cuh`; equals `half::bf16::to_f32` (half's `bfloat/convert.rs`).
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    let mut x = h as u32;
    if x & 0x7FFF > 0x7F80 {
        x |= 0x0040;
    }
    f32::from_bits(x << 16)
}

/// f32 → bf16 (bits), round to nearest, ties to even; a NaN keeps its top mantissa bits and is
/// quietened. `f32_to_bf16` of `kernels/common.cuh`; equals `half::bf16::from_f32`.
pub fn f32_to_bf16_bits(f: f32) -> u16 {
    let x = f.to_bits();
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    let round_bit = 0x0000_8000u32;
    if x & round_bit != 0 && x & (3 * round_bit - 1) != 0 {
        ((x >> 16) + 1) as u16
    } else {
        (x >> 16) as u16
    }
}

/// f16 (bits) → f32, exact (subnormals normalised); a NaN gets its quiet bit set.
/// `f16_to_f32` of `kernels/common.cuh`; equals `half::f16::to_f32` (half's
/// `f16_to_f32_fallback`, and the F16C instruction where half uses it).
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let i = h as u32;
    if i & 0x7FFF == 0 {
        return f32::from_bits(i << 16);
    }
    let half_sign = i & 0x8000;
    let half_exp = i & 0x7C00;
    let half_man = i & 0x03FF;
    if half_exp == 0x7C00 {
        if half_man == 0 {
            return f32::from_bits((half_sign << 16) | 0x7F80_0000);
        }
        return f32::from_bits((half_sign << 16) | 0x7FC0_0000 | (half_man << 13));
    }
    let sign = half_sign << 16;
    let unbiased_exp = ((half_exp as i32) >> 10) - 15;
    if half_exp == 0 {
        // leading zeros of the 16-bit mantissa field, minus the 6 bits above it
        let e = (half_man as u16).leading_zeros() as i32 - 6;
        let exp = ((127 - 15 - e) as u32) << 23;
        let man = (half_man << (14 + e)) & 0x7F_FFFF;
        return f32::from_bits(sign | exp | man);
    }
    let exp = ((unbiased_exp + 127) as u32) << 23;
    let man = (half_man & 0x03FF) << 13;
    f32::from_bits(sign | exp | man)
}

/// f32 → f16 (bits), round to nearest, ties to even, into and out of the subnormal range;
/// overflow to infinity; a NaN keeps its top mantissa bits and is quietened. `f32_to_f16` of
/// `kernels/common.cuh`; equals `half::f16::from_f32` (half's `f32_to_f16_fallback`, and the
/// F16C instruction where half uses it).
pub fn f32_to_f16_bits(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = x & 0x8000_0000;
    let exp = x & 0x7F80_0000;
    let man = x & 0x007F_FFFF;
    if exp == 0x7F80_0000 {
        let nan_bit = if man == 0 { 0 } else { 0x0200 };
        return ((sign >> 16) | 0x7C00 | nan_bit | (man >> 13)) as u16;
    }
    let half_sign = sign >> 16;
    let unbiased_exp = ((exp >> 23) as i32) - 127;
    let half_exp = unbiased_exp + 15;
    if half_exp >= 0x1F {
        return (half_sign | 0x7C00) as u16;
    }
    if half_exp <= 0 {
        if 14 - half_exp > 24 {
            return half_sign as u16;
        }
        let m = man | 0x0080_0000;
        let mut half_man = m >> (14 - half_exp);
        let round_bit = 1u32 << (13 - half_exp);
        if m & round_bit != 0 && m & (3 * round_bit - 1) != 0 {
            half_man += 1;
        }
        return (half_sign | half_man) as u16;
    }
    let he = (half_exp as u32) << 10;
    let half_man = man >> 13;
    let round_bit = 0x0000_1000u32;
    if man & round_bit != 0 && man & (3 * round_bit - 1) != 0 {
        ((half_sign | he | half_man) + 1) as u16
    } else {
        (half_sign | he | half_man) as u16
    }
}

/// An element type of the kernels (f32, bf16, f16) with the kernels' conversions to and from
/// f32 (the functions above).
pub trait KernelFloat: candle_core::WithDType {
    /// Exact widening to f32 (NaN quietened).
    fn widen(self) -> f32;
    /// Narrowing from f32, round to nearest even (identity for f32).
    fn narrow(v: f32) -> Self;
    /// The stored bits (f32: 32, bf16/f16: 16 in the low half).
    fn to_raw(self) -> u32;
    /// The element of stored bits `b` (for bf16/f16 the low 16 bits).
    fn from_raw(b: u32) -> Self;
}

/// `S → D` as the kernels' `convert`: a bit copy when the dtypes agree, else exact widening then
/// one rounding.
fn convert<S: KernelFloat, D: KernelFloat>(x: S) -> D {
    if S::DTYPE == D::DTYPE {
        D::from_raw(x.to_raw())
    } else {
        D::narrow(x.widen())
    }
}

impl KernelFloat for f32 {
    fn widen(self) -> f32 {
        self
    }
    fn narrow(v: f32) -> Self {
        v
    }
    fn to_raw(self) -> u32 {
        self.to_bits()
    }
    fn from_raw(b: u32) -> Self {
        f32::from_bits(b)
    }
}

impl KernelFloat for bf16 {
    fn widen(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    fn narrow(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
    fn to_raw(self) -> u32 {
        self.to_bits() as u32
    }
    fn from_raw(b: u32) -> Self {
        bf16::from_bits(b as u16)
    }
}

impl KernelFloat for f16 {
    fn widen(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    fn narrow(v: f32) -> Self {
        f16::from_bits(f32_to_f16_bits(v))
    }
    fn to_raw(self) -> u32 {
        self.to_bits() as u32
    }
    fn from_raw(b: u32) -> Self {
        f16::from_bits(b as u16)
    }
}

/// A host slice of one of the kernels' element types, for the references whose inputs may be of
/// any of them (a gradient, an accumulated shard).
#[derive(Debug, Clone, Copy)]
pub enum Floats<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 values.
    BF16(&'a [bf16]),
    /// f16 values.
    F16(&'a [f16]),
}

impl Floats<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Floats::F32(s) => s.len(),
            Floats::BF16(s) => s.len(),
            Floats::F16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Floats::F32(_) => DType::F32,
            Floats::BF16(_) => DType::BF16,
            Floats::F16(_) => DType::F16,
        }
    }

    /// Element `i` widened to f32 (exactly, [`KernelFloat::widen`]). Panics out of bounds.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Floats::F32(s) => s[i],
            Floats::BF16(s) => s[i].widen(),
            Floats::F16(s) => s[i].widen(),
        }
    }
}

/// An owned host vector of one of the kernels' element types (the values of a tensor, for the
/// references).
#[derive(Debug, Clone, PartialEq)]
pub enum FloatVec {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
}

impl FloatVec {
    /// The elements of `t` (any shape, row-major) copied to the host in its own dtype.
    ///
    /// Errors: `t` not f32, bf16 or f16; a failed copy.
    pub fn from_tensor(t: &candle_core::Tensor) -> crate::error::Result<Self> {
        let flat = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::F32 => FloatVec::F32(flat.to_vec1()?),
            DType::BF16 => FloatVec::BF16(flat.to_vec1()?),
            DType::F16 => FloatVec::F16(flat.to_vec1()?),
            other => {
                return Err(crate::error::Error::dtype(
                    "a tensor read as floats",
                    "f32, bf16 or f16",
                    other,
                ))
            }
        })
    }

    /// A borrowed view.
    pub fn as_floats(&self) -> Floats<'_> {
        match self {
            FloatVec::F32(v) => Floats::F32(v),
            FloatVec::BF16(v) => Floats::BF16(v),
            FloatVec::F16(v) => Floats::F16(v),
        }
    }
}

// ---- module `cast` -------------------------------------------------------------------------

/// Reference of `cast` (module `cast`): `dst[i] = D::narrow(src[i].widen())`, exact widening
/// then one rounding to nearest even; a bit copy when `S == D`. Equals Candle's
/// `Tensor::to_dtype` on the CPU (which converts with `half`), bit for bit, NaN payloads
/// included.
pub fn cast_reference<S: KernelFloat, D: KernelFloat>(src: &[S]) -> Vec<D> {
    src.iter().map(|&x| convert::<S, D>(x)).collect()
}

// ---- module `copy` -------------------------------------------------------------------------

/// Reference of `copy_in` (module `copy`): the flat reduction buffer of one unit in dtype `O`
/// (the reduce dtype), `None` when the layout has no element (`padded_numel == 0`).
///
/// `grads[q]` is parameter `q`'s gradient (layout order; `numel` elements, row-major, any of the
/// three dtypes), `None` or missing (past the end of `grads`) when it got none. With
/// `S = shard_numel`, `F = params.len()`, `W = world_size`, the buffer has `W × (S + F)`
/// elements: flat element `i < W·S` (the gradient of the parameter covering `i`, widened to f32
/// and converted to `O` by [`KernelFloat::narrow`] — as flatten_grads' widening and the cast
/// after it, so a signalling NaN is quietened even when the dtypes agree — or 0 in alignment
/// gaps, the final padding and absent gradients) lands at `i + ⌊i / S⌋·F`, and after chunk `c` come the `F` presence flags
/// (1 or 0) at `c·(S + F) + S + q`. This is `fsdp::collectives::flatten_grads`'s layout followed
/// by the cast to `reduce_dtype` that precedes the reduce-scatter (`issue_reduction`).
///
/// Panics when a gradient's length differs from its parameter's `numel` (a test tool; the
/// kernel's wrapper returns an error).
pub fn copy_in_reference<O: KernelFloat>(
    layout: &CopyLayout,
    grads: &[Option<Floats<'_>>],
) -> Option<Vec<O>> {
    if layout.padded_numel() == 0 {
        return None;
    }
    let (s, f, w) = (layout.shard_numel, layout.spans.len(), layout.world_size);
    let zero = O::narrow(0.0);
    let mut out = vec![zero; w * (s + f)];
    let grad = |q: usize| grads.get(q).copied().flatten();
    for (q, p) in layout.spans.iter().enumerate() {
        if let Some(g) = grad(q) {
            assert_eq!(
                g.len(),
                p.numel,
                "gradient of parameter {q} has {} elements, the parameter {}",
                g.len(),
                p.numel
            );
        }
    }
    // Gradient values (gaps, padding and absent gradients stay zero).
    for (q, p) in layout.spans.iter().enumerate() {
        let Some(g) = grad(q) else { continue };
        for k in 0..p.numel {
            let i = p.offset + k;
            out[i + (i / s) * f] = O::narrow(g.get(k));
        }
    }
    // Presence flags after each chunk.
    for c in 0..w {
        for q in 0..f {
            let flag = if grad(q).is_some() { 1.0 } else { 0.0 };
            out[c * (s + f) + s + q] = O::narrow(flag);
        }
    }
    Some(out)
}

/// Reference of `copy_out` (module `copy`): each parameter of `layout` (in layout order) as its
/// own vector, `dst_q[k] = D::narrow(flat[offset_q + k].widen())` for `k < numel_q` (a bit
/// copy when `S == D`). What `fsdp::collectives::param_copies` / `param_vars` make of a gathered
/// buffer (`flat.narrow(0, offset, numel).reshape(shape)`, made contiguous). A forward without
/// autograd needs no copy at all (`param_views`: views of the buffer).
///
/// Panics when `flat` is shorter than a parameter's end.
pub fn copy_out_reference<S: KernelFloat, D: KernelFloat>(
    spans: &[ParamSpan],
    flat: &[S],
) -> Vec<Vec<D>> {
    spans
        .iter()
        .map(|p| {
            flat[p.offset..p.offset + p.numel]
                .iter()
                .map(|&x| convert::<S, D>(x))
                .collect()
        })
        .collect()
}

// ---- module `ops` --------------------------------------------------------------------------

/// Reference of `scale` (module `ops`): `x[i] = x[i] · s`. Equals [`crate::ops::scale_`] on the
/// CPU.
pub fn scale_reference(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// Reference of `scale_check_finite` (module `ops`): `x[i] = x[i] · s`, and `*found_inf = 1`
/// when some product is infinite or NaN (left alone otherwise: the flag accumulates). The
/// scaling and the returned finiteness equal [`crate::ops::scale_and_check_finite_`] on the CPU;
/// the flag is PyTorch's `_amp_foreach_non_finite_check_and_unscale_`'s `found_inf`.
pub fn scale_check_finite_reference(x: &mut [f32], s: f32, found_inf: &mut f32) {
    let mut bad = false;
    for v in x.iter_mut() {
        *v *= s;
        bad |= !v.is_finite();
    }
    if bad {
        *found_inf = 1.0;
    }
}

/// Reference of `non_finite` (module `ops`): `*found_inf = 1` when some `x[i]` is infinite or
/// NaN (left alone otherwise). `*found_inf == 0` afterwards (from 0) exactly when
/// [`crate::ops::all_finite`] is true.
pub fn non_finite_reference(x: &[f32], found_inf: &mut f32) {
    if x.iter().any(|v| !v.is_finite()) {
        *found_inf = 1.0;
    }
}

/// Reference of `add` (module `ops`): `dst[i] = dst[i] + src[i]`, `src` widened exactly to f32.
/// Equals [`crate::ops::add_`] on the CPU. Panics when the lengths differ.
pub fn add_reference(dst: &mut [f32], src: Floats<'_>) {
    assert_eq!(dst.len(), src.len(), "add_reference: lengths differ");
    for (i, d) in dst.iter_mut().enumerate() {
        *d += src.get(i);
    }
}

/// Reference of `sum_squares_partial` + `sum_squares_final` (module `ops`), in the kernels'
/// exact order: `B = sum_squares_blocks(n)` blocks of [`THREADS`] threads; thread `t` of block
/// `b` sums `x[i]²` (in f64, each square exact) over `i = b·THREADS + t + k·B·THREADS` in order;
/// each block sums its threads by warp shuffles (pairs at distance 16, 8, 4, 2, 1 within each
/// warp of 32) and then its warps' sums the same way; the final pass sums the `B` partials with
/// one block likewise. Agrees with [`crate::ops::sum_squares`]'s CPU path (f64, element order)
/// up to rounding, exactly when every partial sum is exact (e.g. small integers).
pub fn sum_squares_reference(x: &[f32]) -> f64 {
    let threads = THREADS as usize;
    let blocks = sum_squares_blocks(x.len()) as usize;
    let stride = blocks * threads;
    let partials: Vec<f64> = (0..blocks)
        .map(|b| {
            let per_thread: Vec<f64> = (0..threads)
                .map(|t| {
                    let mut acc = 0.0f64;
                    let mut i = b * threads + t;
                    while i < x.len() {
                        let d = x[i] as f64;
                        acc += d * d;
                        i += stride;
                    }
                    acc
                })
                .collect();
            block_sum_reference(&per_thread)
        })
        .collect();
    let per_thread: Vec<f64> = (0..threads)
        .map(|t| {
            let mut acc = 0.0f64;
            let mut i = t;
            while i < partials.len() {
                acc += partials[i];
                i += threads;
            }
            acc
        })
        .collect();
    block_sum_reference(&per_thread)
}

/// `block_sum` of `kernels/ops.cu` for one block (`v.len()` threads, a multiple of 32): the
/// value thread 0 ends with.
fn block_sum_reference(v: &[f64]) -> f64 {
    // One warp's shuffle-down tree: lane l adds lane l + off (a lane past the warp adds its own
    // value, as __shfl_down_sync returns the caller's value then; lane 0 never reads those).
    fn warp(mut lanes: [f64; 32]) -> f64 {
        let mut off = 16;
        while off > 0 {
            let prev = lanes;
            for (l, v) in lanes.iter_mut().enumerate() {
                let other = if l + off < 32 { prev[l + off] } else { prev[l] };
                *v = prev[l] + other;
            }
            off >>= 1;
        }
        lanes[0]
    }
    let warps: Vec<f64> = v
        .chunks(32)
        .map(|w| warp(std::array::from_fn(|l| w[l])))
        .collect();
    warp(std::array::from_fn(|l| {
        if l < warps.len() {
            warps[l]
        } else {
            0.0
        }
    }))
}

// ---- module `optim` ------------------------------------------------------------------------

/// `x`, or `+0.0` when `|x|` is below f32's smallest normal number (`f32::MIN_POSITIVE`,
/// about 1.18e-38): how the optimizers store their moments and momentum buffers, on the CPU
/// (`ops`), on the GPU (`kernels/optim.cu`'s `flush_subnormal`) and in these references.
/// A moment whose gradient has become zero shrinks by β every step (β1 = 0.9: from 1e-5 into
/// the subnormal range in about 700 steps, where it stays about 150 more); every operation on
/// a subnormal takes the CPU a micro-code assist of about a hundred cycles, so a model with
/// many such moments ran its optimizer up to 17× slower (AdamW over 109 k subnormal moments:
/// 962 µs a step against 55 µs; the MNIST example at world size 1, epoch 1: 1.64 → 1.18 s).
/// What changes is only values below 1.2e-38, which the update `m̂ / (√v̂ + ε)` (ε ≥ 1e-8 in
/// practice) cannot tell from zero (with ε = 0 a flushed `v` beside a normal `m` divides by
/// zero). Written as a comparison, not the CPU's flush-to-zero mode, so that every device and
/// the references agree bit for bit (decision 87). PyTorch keeps subnormals unless
/// `torch.set_flush_denormal(True)`.
#[inline(always)]
pub fn flush_subnormal(x: f32) -> f32 {
    if x.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        x
    }
}

/// AdamW's second moment `v` as stored beside the (already flushed) first moment `m`:
/// [`flush_subnormal`]`(v)` once `m` is 0, else `v` as it is. A flushed `v` beside a normal `m`
/// (a gradient of about 1e-19 or less, whose square is subnormal) would make the update
/// `m̂ / (0 + ε)`: infinite with ε = 0, where PyTorch's stays finite; a moment whose gradient
/// stopped reaches `m = 0` long before `v` is subnormal (β1 = 0.9 against β2 = 0.999).
#[inline(always)]
pub fn flush_second_moment(v: f32, m: f32) -> f32 {
    if m == 0.0 {
        flush_subnormal(v)
    } else {
        v
    }
}

/// Reference of `adamw` (module `optim`): unless `found_inf != 0` (then nothing changes), per
/// element with `g = grad · inv_scale`:
/// `m = m·β1 + g·(1−β1)`, `v = v·β2 + (g·g)·(1−β2)`, `p = p·decay`,
/// `p = p − (m·c1 / (sqrt(v·c2) + ε))·lr` (Loshchilov & Hutter, ICLR 2019, as PyTorch's
/// `torch.optim.AdamW`), except that an `m` below f32's smallest normal number is stored (and
/// used) as `+0`, and so is such a `v` once `m` is 0 ([`flush_subnormal`],
/// [`flush_second_moment`], decision 87); `h` the kernel's [`AdamWArgs`], made from a
/// `crate::ops::AdamWHyper`. With `inv_scale == 1` this is
/// [`crate::ops::adamw_step`]'s CPU loop; with another `inv_scale` it equals
/// [`crate::ops::scale_and_check_finite_`]`(grad, inv_scale)` followed by that loop.
///
/// Panics when the lengths differ.
pub fn adamw_reference(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    h: &AdamWArgs,
    inv_scale: f32,
    found_inf: f32,
) {
    let n = param.len();
    assert!(grad.len() == n && exp_avg.len() == n && exp_avg_sq.len() == n);
    if found_inf != 0.0 {
        return;
    }
    for i in 0..n {
        let g = grad[i] * inv_scale;
        let m = flush_subnormal(exp_avg[i] * h.beta1 + g * h.one_minus_beta1);
        let v = flush_second_moment(exp_avg_sq[i] * h.beta2 + (g * g) * h.one_minus_beta2, m);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        let m_hat = m * h.bias_correction1;
        let v_hat = v * h.bias_correction2;
        let mut p = param[i] * h.decay;
        p -= (m_hat / (v_hat.sqrt() + h.eps)) * h.lr;
        param[i] = p;
    }
}

/// Reference of `sgd` (module `optim`): unless `found_inf != 0` (then nothing changes), per
/// element with `d = grad · inv_scale`: `d = d + λ·p` when λ ≠ 0; with a momentum buffer `b`
/// (required when `h.momentum ≠ 0`, ignored otherwise): `b = d` at the first step, else
/// `b = μ·b + (1−τ)·d` (a `b` below f32's smallest normal number stored and used as `+0`, the
/// optimizers' subnormal flush), then `d = d + μ·b` (Nesterov) or `d = b`; finally
/// `p = p − lr·d` (PyTorch's `torch.optim.SGD` algorithm). With `inv_scale == 1` this is
/// [`crate::ops::sgd_step`]'s CPU loops.
///
/// Panics when the lengths differ or the buffer is missing with momentum.
pub fn sgd_reference(
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: Option<&mut [f32]>,
    h: &SgdArgs,
    inv_scale: f32,
    found_inf: f32,
) {
    let n = param.len();
    assert_eq!(grad.len(), n);
    if found_inf != 0.0 {
        return;
    }
    let wd = h.weight_decay != 0.0;
    let (nesterov, first_step) = (h.nesterov != 0, h.first_step != 0);
    match (h.momentum != 0.0, momentum_buffer) {
        (false, _) => {
            for i in 0..n {
                let mut d = grad[i] * inv_scale;
                let p = param[i];
                if wd {
                    d += h.weight_decay * p;
                }
                param[i] = p - h.lr * d;
            }
        }
        (true, Some(b)) => {
            assert_eq!(b.len(), n);
            for i in 0..n {
                let mut d = grad[i] * inv_scale;
                let p = param[i];
                if wd {
                    d += h.weight_decay * p;
                }
                b[i] = flush_subnormal(if first_step {
                    d
                } else {
                    h.momentum * b[i] + h.one_minus_dampening * d
                });
                d = if nesterov {
                    d + h.momentum * b[i]
                } else {
                    b[i]
                };
                param[i] = p - h.lr * d;
            }
        }
        (true, None) => panic!("sgd_reference: momentum {} needs a buffer", h.momentum),
    }
}

/// Reference of `update_scale` (module `optim`), the grad scaler's update after a step
/// ([`crate::grad_scaler::ShardedGradScaler`]'s, PyTorch's `_amp_update_scale_`): after a step
/// with `found_inf != 0`, `scale = scale · backoff_factor` and `growth_tracker = 0`; otherwise
/// `growth_tracker += 1` and, when it reaches `growth_interval`, `scale = scale · growth_factor`
/// and `growth_tracker = 0`. Returns `1 / scale` (the next unscale's factor).
pub fn update_scale_reference(
    scale: &mut f32,
    growth_tracker: &mut u32,
    found_inf: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
) -> f32 {
    if found_inf != 0.0 {
        *scale *= backoff_factor;
        *growth_tracker = 0;
    } else {
        let mut t = *growth_tracker + 1;
        if t >= growth_interval {
            *scale *= growth_factor;
            t = 0;
        }
        *growth_tracker = t;
    }
    1.0 / *scale
}
