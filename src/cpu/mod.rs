//! The CPU compute primitives every hand-written kernel shares (those of [`crate::nn`] and the
//! optimizer loops of [`crate::ops`]): the element types (all computed in f32), vectorisable
//! reductions and exponential, run-time dispatch to the widest vector instructions, the rule
//! for how many threads a kernel may use (see the [`crate::nn`] module documentation), outputs
//! written once without a zero-fill, and the `gemm` crate's kernel with explicit strides. A leaf:
//! it imports nothing of the crate.

use candle_core::{bail, Layout, Result};

pub(crate) mod gemm;

/// The element types of the CPU kernels, all computed in f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `src` as f32: itself for f32, else converted into `buf` (of `src`'s length).
    fn load<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn load<'a>(src: &'a [f32], _buf: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            #[inline(always)]
            fn load<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(buf);
                buf
            }
        }
    };
}
half_elem!(half::bf16);
half_elem!(half::f16);

/// `Σ f(a_i)` with 16 independent accumulators, so that the compiler can vectorise the sum (one
/// accumulator fixes the order of the additions and keeps it scalar).
#[inline(always)]
pub(crate) fn sum16(a: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = a.chunks_exact(16);
    for c in &mut chunks {
        for k in 0..16 {
            acc[k] += f(c[k]);
        }
    }
    let rest: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f32>() + rest
}

/// `Σ a_i · b_i`, vectorised as [`sum16`].
#[inline(always)]
pub(crate) fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (mut ca, mut cb) = (a.chunks_exact(16), b.chunks_exact(16));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + rest
}

#[inline(always)]
pub(crate) fn max16(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = a.chunks_exact(16);
    for c in &mut chunks {
        for k in 0..16 {
            acc[k] = acc[k].max(c[k]);
        }
    }
    let rest = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    acc.iter().fold(rest, |m, &v| m.max(v))
}

/// The input slice of a contiguous layout.
pub(crate) fn contiguous<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("the {what} has to be contiguous"),
    }
}

// ---------------------------------------------------------------------------------------------
// Threads.

/// The number of threads a kernel may use: Candle's intra-op thread count
/// (`RAYON_NUM_THREADS`, else the machine's cores), the count its CPU matmul uses.
pub(crate) fn threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// `f(i)` for every `i` in `0..n`, collected in order: over rayon's pool when [`threads`] is
/// above 1 and there is more than one task, else on the calling thread, in order.
pub(crate) fn parallel_map<R: Send>(n: usize, f: impl Fn(usize) -> R + Send + Sync) -> Vec<R> {
    if n > 1 && threads() > 1 {
        use rayon::prelude::*;
        (0..n).into_par_iter().map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}

/// `f(chunk_index, chunk)` over `out` cut into chunks of `chunk` elements (the last one
/// shorter), in parallel under the rule of [`parallel_map`].
pub(crate) fn parallel_chunks<T: Send>(
    out: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Send + Sync,
) {
    let chunk = chunk.max(1);
    if out.len() > chunk && threads() > 1 {
        use rayon::prelude::*;
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        for (i, c) in out.chunks_mut(chunk).enumerate() {
            f(i, c)
        }
    }
}

/// [`parallel_chunks`] whose calls each return a value, collected in chunk order.
pub(crate) fn parallel_chunks_map<T: Send, R: Send>(
    out: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) -> R + Send + Sync,
) -> Vec<R> {
    let chunk = chunk.max(1);
    if out.len() > chunk && threads() > 1 {
        use rayon::prelude::*;
        out.par_chunks_mut(chunk)
            .enumerate()
            .map(|(i, c)| f(i, c))
            .collect()
    } else {
        out.chunks_mut(chunk)
            .enumerate()
            .map(|(i, c)| f(i, c))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Vector instructions.

/// Runs `f` compiled for the widest vector instructions this CPU has (AVX-512, else AVX2 with
/// FMA, else the build's baseline), chosen at run time as the `gemm` crate does: the release
/// build targets baseline x86-64 (SSE2), so without this the element-wise loops of the kernels
/// vectorise four lanes wide at most. `f` and what it calls must be `#[inline(always)]` so
/// that they are compiled inside the wider function: write the closure
/// `with_simd(#[inline(always)] || …)`. A closure without the attribute is a function of its
/// own, which LLVM declines to inline once its body is large, and then runs with the baseline's
/// 4-lane SSE (measured: the attention kernel's gathers, softmax and exponentials ran that way,
/// 7.7 → 4.9 ms forward and 15.8 → 11.3 ms backward on one thread with the attribute).
#[inline(always)]
pub(crate) fn with_simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma")]
        unsafe fn v4<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn v3<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match simd() {
            // SAFETY: `simd` answers `Avx512` only for a CPU with every feature `v4` is
            // compiled for, `Avx2` only for one with AVX2 and FMA.
            Simd::Avx512 => return unsafe { v4(f) },
            Simd::Avx2 => return unsafe { v3(f) },
            Simd::Baseline => {}
        }
    }
    f()
}

/// The vector instructions the crate's own kernels run ([`with_simd`], the matmul kernels of
/// `cpu/gemm.rs`), from the narrowest up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Simd {
    /// The build's baseline (SSE2 on x86-64; every non-x86 target).
    Baseline,
    /// AVX2 with FMA (x86-64-v3).
    Avx2,
    /// AVX-512 F, VL and DQ (with AVX2 and FMA; x86-64-v4).
    Avx512,
}

/// The widest vector instructions the crate's own kernels use, chosen once per process: the
/// CPU's widest, or at most AVX2 under `FSDP_SIMD=avx2`, which makes an AVX-512 CPU run what a
/// CPU without AVX-512 runs (issue 31's targets are stated for one): the element-wise kernels
/// compiled for AVX2 and the matmul default of such a CPU ([`matmul_kernel`]). The `gemm`
/// crate's kernels (Candle's own matmul, attention's tiles) follow it only in a build without
/// the `gemm-avx512` feature (`--no-default-features`). `FSDP_SIMD=avx512` (or unset) is the
/// CPU's widest (either in any case); another value is ignored with a warning.
pub(crate) fn simd() -> Simd {
    static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let value = std::env::var("FSDP_SIMD").unwrap_or_default();
        let value = value.trim();
        let (level, warning) = simd_from(cpu_simd(), &value.to_ascii_lowercase());
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        if level < Simd::Avx512 && cfg!(feature = "gemm-avx512") && cpu_simd() == Simd::Avx512 {
            eprintln!(
                "FSDP_SIMD={value}: the gemm crate's kernels (Candle's matmul, attention's tiles) \
                 still run AVX-512 in a build with the gemm-avx512 feature"
            );
        }
        level
    })
}

/// The widest of [`Simd`]'s levels this CPU runs.
fn cpu_simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            if has!("avx512f") && has!("avx512vl") && has!("avx512dq") {
                return Simd::Avx512;
            }
            return Simd::Avx2;
        }
    }
    Simd::Baseline
}

/// The level `FSDP_SIMD=value` gives on a CPU whose widest is `cpu` (`""` when unset), and the
/// warning to print when the value is not used as asked.
fn simd_from(cpu: Simd, value: &str) -> (Simd, Option<String>) {
    let asked = match value {
        "" => return (cpu, None),
        "avx512" => Simd::Avx512,
        "avx2" => Simd::Avx2,
        other => {
            return (
                cpu,
                Some(format!(
                    "FSDP_SIMD={other:?} is none of \"avx512\", \"avx2\"; using {cpu:?}"
                )),
            )
        }
    };
    if asked <= cpu {
        (asked, None)
    } else {
        (
            cpu,
            Some(format!(
                "FSDP_SIMD={value}: this CPU cannot run it; using {cpu:?}"
            )),
        )
    }
}

/// `eˣ` in f32 without a libm call, so that a loop over a slice vectorises: Cephes' `expf`
/// (S. L. Moshier, Cephes Math Library): `eˣ = 2ⁿ · eʳ` with `n = round(x / ln 2)`,
/// `r = x − n · ln 2` (ln 2 split in two for precision) and `eʳ` a degree-7 polynomial; relative
/// error below 2⁻²² (measured against `f32::exp` in the tests). Inputs are clamped to
/// `[−87.3, 88.3]` (so `eˣ` of a very negative number is about 1e−38, not 0, and of a large one
/// about 2e38, not ∞); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2²³: adding it rounds to an integer
    let xc = x.clamp(-87.3, 88.3);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * r)
        * r
        + r
        + 1.0;
    let bits = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32); // n as an integer
    let scale = f32::from_bits(((bits + 127) << 23) as u32);
    let y = p * scale;
    if x.is_nan() {
        x
    } else {
        y
    }
}

// ---------------------------------------------------------------------------------------------
// Outputs.

/// A vector of `n` elements not yet written, for tasks that each write a scattered part of it
/// (column blocks of rows, say) in parallel: [`Uninit::share`] hands out a [`Scattered`] view,
/// [`Uninit::assume_init`] takes the vector once every element is written. No zero-fill, as
/// [`filled`].
pub(crate) struct Uninit<T>(Vec<std::mem::MaybeUninit<T>>);

impl<T: Copy> Uninit<T> {
    /// `n` elements, none written.
    pub(crate) fn new(n: usize) -> Self {
        let mut v = Vec::with_capacity(n);
        // SAFETY: `MaybeUninit` needs no initialisation; the capacity is `n`.
        unsafe { v.set_len(n) };
        Self(v)
    }

    /// A view the tasks write through, for as long as it is borrowed.
    pub(crate) fn share(&mut self) -> Scattered<'_, T> {
        Scattered {
            ptr: self.0.as_mut_ptr(),
            len: self.0.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// The vector.
    ///
    /// # Safety
    ///
    /// Every element has been written.
    pub(crate) unsafe fn assume_init(self) -> Vec<T> {
        let mut v = std::mem::ManuallyDrop::new(self.0);
        // SAFETY: every element was written (the caller's contract), `MaybeUninit<T>` has `T`'s
        // layout, and the allocation is handed over whole (pointer, length, capacity).
        unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut T, v.len(), v.capacity()) }
    }
}

/// A shared view of an [`Uninit`] through which parallel tasks write disjoint runs.
#[derive(Clone, Copy)]
pub(crate) struct Scattered<'a, T> {
    ptr: *mut std::mem::MaybeUninit<T>,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the tasks write disjoint elements (the contract of `Scattered::run`); `T` is `Copy`
// data sent between threads as the elements of a `Vec<T: Send>` would be.
unsafe impl<T: Send> Send for Scattered<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Scattered<'_, T> {}

impl<'a, T> Scattered<'a, T> {
    /// Elements `start .. start + len`, to write.
    ///
    /// # Safety
    ///
    /// No other task touches these elements while the run is alive.
    ///
    /// # Panics
    ///
    /// When the run does not lie in the vector.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn run(
        &self,
        start: usize,
        len: usize,
    ) -> &'a mut [std::mem::MaybeUninit<T>] {
        assert!(
            start <= self.len && len <= self.len - start,
            "Scattered::run: {start} + {len} past {} elements",
            self.len
        );
        // SAFETY: inside the allocation (asserted); exclusive (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// A vector of `n` elements each written exactly once by `fill(chunk_index, chunk)` over chunks
/// of `chunk` elements (in parallel under the rule of [`parallel_map`]), without zero-filling
/// it first: the outputs of the kernels are written whole, and a zero-fill of a few MB is a
/// pass over memory (`memset` was 5 % of a GPT step's CPU samples).
///
/// # Safety
///
/// `fill` must write every element of the chunk it is given.
pub(crate) unsafe fn filled<T: Copy + Send>(
    n: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [std::mem::MaybeUninit<T>]) + Send + Sync,
) -> Vec<T> {
    let mut v: Vec<std::mem::MaybeUninit<T>> = Vec::with_capacity(n);
    // SAFETY: `MaybeUninit` needs no initialisation; the capacity is `n`.
    unsafe { v.set_len(n) };
    parallel_chunks(&mut v, chunk, fill);
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: every element was written (the caller's contract), `MaybeUninit<T>` has `T`'s
    // layout, and the allocation is handed over whole (pointer, length, capacity).
    unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut T, v.len(), v.capacity()) }
}

/// Below this many multiply-adds (`m · n · k`) a product runs on the calling thread even when
/// asked to split: waking the pool costs more than the second thread saves.
const SERIAL_GEMM_MACS: usize = 1 << 22;

/// `dst (m × n) = [dst +] lhs (m × k) · rhs (k × n)` in f32 with explicit strides (`(slice,
/// row stride, column stride)` for each operand; `dst` row-major with row stride `dst_rs`), on
/// rayon's pool under the rule of [`parallel_map`] when `par`, else on the calling thread.
/// `dst` may be uninitialised when `accumulate` is false: it is then only written.
///
/// The kernel is [`matmul_kernel`]'s: the crate's own AVX2 kernel ([`gemm`]) on CPUs without
/// AVX-512, the `gemm` crate's AVX-512 kernel on those with it.
///
/// # Safety
///
/// Every element the strides reach must lie inside its slice: `lhs.0.len() > (m−1)·rs +
/// (k−1)·cs` and likewise for `rhs` (`k × n`) and `dst` (`m × n`); `dst` must be initialised
/// when `accumulate`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
    par: bool,
) {
    let threads = if par && m * n * k >= SERIAL_GEMM_MACS {
        threads()
    } else {
        1
    };
    let level = match matmul_kernel() {
        MatmulKernel::Avx2 => Some(gemm::Level::Avx2),
        MatmulKernel::Avx512 => Some(gemm::Level::Avx512),
        MatmulKernel::GemmCrate => None,
    };
    if let Some(level) = level {
        let o = gemm::Operands {
            m,
            n,
            k,
            a: lhs.0.as_ptr(),
            rs_a: lhs.1,
            cs_a: lhs.2,
            b: rhs.0.as_ptr(),
            rs_b: rhs.1,
            cs_b: rhs.2,
        };
        // SAFETY: the caller's contract; `matmul_kernel` chose a level this CPU runs.
        return unsafe { gemm::gemm(level, o, dst, dst_rs, accumulate, threads) };
    }
    let parallelism = if threads > 1 {
        ::gemm::Parallelism::Rayon(threads)
    } else {
        ::gemm::Parallelism::None
    };
    // SAFETY: the caller's contract.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.0.as_ptr(),
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0.as_ptr(),
            rhs.2 as isize,
            rhs.1 as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Which kernel the crate's f32 matrix products run on the CPU ([`matmul_kernel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulKernel {
    /// The crate's AVX2 + FMA kernel (6 × 16 register tile, packed panels; `cpu/gemm.rs`).
    Avx2,
    /// The crate's AVX-512 kernel (14 × 32 register tile, packed panels; `cpu/gemm.rs`).
    Avx512,
    /// The `gemm` crate's kernel for the widest instructions the CPU has (AVX-512 with its
    /// `x86-v4` feature, which this crate's default feature `gemm-avx512` turns on): Candle's
    /// own matmul.
    GemmCrate,
}

/// The kernel of the crate's f32 matrix products (those of [`crate::nn`]'s fused nodes and of
/// the decoder's block), chosen once per process: on a CPU with AVX2 and FMA but without
/// AVX-512 (or one held to AVX2 by `FSDP_SIMD=avx2`: [`simd`]), the crate's AVX2 kernel (0.95–1.05× MKL's AVX2 rate where `gemm`'s reached
/// 0.78–0.97× of it: BENCHMARKS.md §15, issue 31); elsewhere the `gemm` crate's (its AVX-512
/// kernel; the crate's own is faster alone but was 1–2 % slower inside the Llama step, so the
/// default stays). `FSDP_MATMUL=avx2`, `avx512` or `gemm` forces one (one the CPU, or
/// `FSDP_SIMD`, does not allow falls back to the default with a warning). Candle's own `matmul` (the composed ops) always
/// runs the `gemm` crate.
pub fn matmul_kernel() -> MatmulKernel {
    static CHOICE: std::sync::OnceLock<MatmulKernel> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let level = gemm::level();
        let best = match level {
            Some(gemm::Level::Avx2) => MatmulKernel::Avx2,
            _ => MatmulKernel::GemmCrate,
        };
        let forced = std::env::var("FSDP_MATMUL").unwrap_or_default();
        let want = match forced.trim() {
            "" => return best,
            "gemm" => MatmulKernel::GemmCrate,
            "avx2" => MatmulKernel::Avx2,
            "avx512" => MatmulKernel::Avx512,
            other => {
                eprintln!(
                    "FSDP_MATMUL={other:?} is none of \"avx512\", \"avx2\", \"gemm\"; using {best:?}"
                );
                return best;
            }
        };
        let runs = match want {
            MatmulKernel::Avx512 => level == Some(gemm::Level::Avx512),
            MatmulKernel::Avx2 => level.is_some(),
            MatmulKernel::GemmCrate => true,
        };
        if runs {
            want
        } else {
            eprintln!(
                "FSDP_MATMUL={forced}: this CPU (or FSDP_SIMD) cannot run it; using {best:?}"
            );
            best
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FSDP_SIMD` lowers the CPU's level, never raises it, and says so when it cannot be
    /// followed.
    #[test]
    fn simd_knob_holds_the_level_down_only() {
        assert_eq!(simd_from(Simd::Avx512, ""), (Simd::Avx512, None));
        assert_eq!(simd_from(Simd::Avx512, "avx2"), (Simd::Avx2, None));
        assert_eq!(simd_from(Simd::Avx512, "avx512"), (Simd::Avx512, None));
        assert_eq!(simd_from(Simd::Avx2, "avx2"), (Simd::Avx2, None));
        assert_eq!(
            simd_from(Simd::Avx2, "avx512"),
            (
                Simd::Avx2,
                Some("FSDP_SIMD=avx512: this CPU cannot run it; using Avx2".into())
            )
        );
        assert_eq!(
            simd_from(Simd::Avx512, "sse"),
            (
                Simd::Avx512,
                Some("FSDP_SIMD=\"sse\" is none of \"avx512\", \"avx2\"; using Avx512".into())
            )
        );
        assert_eq!(simd_from(Simd::Baseline, "avx2").0, Simd::Baseline);
    }

    /// Tasks writing disjoint runs of an `Uninit` on the pool give the vector they wrote; a run
    /// past the end is refused.
    #[test]
    fn scattered_runs_fill_the_vector() {
        let (rows, width) = (37, 10);
        let mut v = Uninit::<u32>::new(rows * width);
        let out = v.share();
        // Task `c` writes column block `c` (two columns) of every row.
        parallel_map(width / 2, |c| {
            for r in 0..rows {
                // SAFETY: column block `c` is this task's alone.
                let run = unsafe { out.run(r * width + 2 * c, 2) };
                run[0].write((r * width + 2 * c) as u32);
                run[1].write((r * width + 2 * c + 1) as u32);
            }
        });
        // SAFETY: the blocks cover every element.
        let v = unsafe { v.assume_init() };
        assert_eq!(v, (0..(rows * width) as u32).collect::<Vec<_>>());
        let mut w = Uninit::<u32>::new(4);
        let out = w.share();
        // SAFETY: nothing else writes `w`.
        let past = std::panic::catch_unwind(|| unsafe { out.run(3, 2).len() });
        assert!(past.is_err(), "a run past the end was handed out");
    }

    /// `exp_fast` against libm's `exp` over the whole clamped range, and at the edges.
    #[test]
    fn exp_fast_relative_error() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp_fast(x) as f64, (x as f64).exp());
            worst = worst.max((a - b).abs() / b);
            x += 0.001_3;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp_fast(0.0), 1.0);
        assert!(exp_fast(f32::NAN).is_nan());
        assert!(exp_fast(-1e9) < 2e-38 && exp_fast(-1e9) >= 0.0);
        assert!(exp_fast(1e9).is_finite() && exp_fast(1e9) > 1e38);
        // Vectorised through `with_simd`, the same values.
        let xs: Vec<f32> = (0..1000).map(|i| i as f32 * 0.17 - 80.0).collect();
        let ys: Vec<f32> = with_simd(
            #[inline(always)]
            || xs.iter().map(|&x| exp_fast(x)).collect(),
        );
        for (x, y) in xs.iter().zip(&ys) {
            assert_eq!(*y, exp_fast(*x));
        }
    }
}
