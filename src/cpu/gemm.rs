//! f32 matrix products on AVX2 + FMA and on AVX-512: the crate's own kernel.
//!
//! `gemm`'s AVX2 kernel reached 50–70 % of an AVX2 CPU's f32 peak on the training step's shapes
//! where OpenBLAS and MKL reach 80–87 %, and its AVX-512 kernel 0.78–0.95× MKL's (issue 31,
//! BENCHMARKS.md). This is the layered design of Goto and van de Geijn ("Anatomy of
//! High-Performance Matrix Multiplication", ACM TOMS 34(3), 2008) as BLIS arranges it (Van Zee
//! and van de Geijn, ACM TOMS 41(3), 2015):
//!
//! - `B` is packed into column panels of `NR` (a `KC × NC` block, in the last-level cache; on
//!   one thread on AVX-512 `KC × NC_ALONE`, in L2), `A` into row panels of `MR` (an `MC × KC`
//!   block, in L2), zero-padded at the edges, with 8 × 8 in-register transposes where the
//!   packed layout crosses the stored one (the `B = Wᵀ` of `x·Wᵀ`, the row-major `A` of `x·Wᵀ`
//!   and `g·W`);
//! - the register tile ([`Isa`]) is 6 × 16 on AVX2 (twelve 8-lane accumulators, two loads of
//!   `B` and six broadcasts of `A` for twelve fused multiply-adds per `k`: 15 of the 16 `ymm`
//!   registers) and 14 × 32 on AVX-512 (28 of the 32 `zmm` registers accumulate);
//! - the threads split `m` or `n` (the one whose other operand is the cheaper to pack on every
//!   thread) at tile boundaries, each packing for itself: no barrier inside a product; a split
//!   product keeps each `B` panel in L1 while `A`'s panels stream past it; a product on one
//!   thread on AVX-512 keeps each `A` panel (the broadcast operand's, as BLIS's AVX-512
//!   kernels keep theirs) in L1 and streams `B`'s from a block of [`NC_ALONE`] columns.
//!
//! Every element of `C` sums its `k` products in the same order (blocks of `KC` in ascending
//! `k`, each block's sum added to `C`), whatever the thread count and edges: results are
//! bitwise independent of the split (not of the instruction set: the blocks differ).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

/// Below this many multiply-adds a product runs on one thread (a split costs a few µs).
const SPLIT_MIN: usize = 1 << 18;

/// Columns of a packed `B` block when the product runs on one thread (`KC × 1024` floats,
/// 1 MiB at `KC` = 256: L2), where the loop over `A`'s panels runs outside the loop over `B`'s.
/// On one thread that order and this block measured 2–6 % faster than the split order with
/// [`Isa::NC`] on AVX-512 (cold operands, the step's shapes; the GPT step at world size 2
/// 2.5–7 % faster), neutral on AVX2, which keeps the old order ([`Isa::A_RESIDENT_ALONE`]); on
/// two threads 1–3 % slower (BENCHMARKS.md §23). Neither changes an element's summation order.
const NC_ALONE: usize = 1024;

/// A register tile and the blocking around it, for one instruction set.
pub(crate) trait Isa {
    /// Rows of the register tile.
    const MR: usize;
    /// Columns of the register tile.
    const NR: usize;
    /// Depth of a packed block: an `A` and a `B` micro-panel (`KC × (MR + NR)` floats) fit L1.
    const KC: usize;
    /// Rows of a packed `A` block (`MC × KC` floats: L2).
    const MC: usize;
    /// Columns of a packed `B` block (`KC × NC` floats: the last-level cache).
    const NC: usize;
    /// Whether a product on one thread keeps the `A` panel in L1 (blocks of [`NC_ALONE`]
    /// columns) rather than the `B` panel: where the `B` panel would crowd L1.
    const A_RESIDENT_ALONE: bool;

    /// `C[rows × cols] (= or +=) Σ_p a_p ⊗ b_p` over `kc` packed steps (`a`: `kc·MR` floats,
    /// `b`: `kc·NR`, 64-byte aligned).
    ///
    /// # Safety
    ///
    /// The packed panels hold what they say; the tile's `rows × cols` lie in `C`; compiled
    /// inside a function with the instruction set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        overwrite: bool,
    );
}

/// AVX2 + FMA: a 6 × 16 tile.
pub(crate) struct Avx2;
/// AVX-512 (F): a 14 × 32 tile.
pub(crate) struct Avx512;

/// Which of the crate's kernels this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Avx2,
    Avx512,
}

/// The widest of the crate's kernels this process runs ([`super::simd`]: the CPU's widest
/// unless `FSDP_SIMD` holds it lower), if any.
pub(crate) fn level() -> Option<Level> {
    match super::simd() {
        super::Simd::Avx512 => Some(Level::Avx512),
        super::Simd::Avx2 => Some(Level::Avx2),
        super::Simd::Baseline => None,
    }
}

/// One cache line of floats: the packing buffers' unit, so that every panel is 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

thread_local! {
    /// The thread's packing buffer of `A` blocks, kept between products.
    static PACK_A: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    /// The thread's packing buffer of `B` blocks, kept between products.
    static PACK_B: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// `f` with this thread's buffer `key`; with a fresh one if it is taken (a product does not
/// call back into rayon while it holds its buffers, so this is a safeguard).
fn with_buffer<R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<Line>>>,
    f: impl FnOnce(&mut Vec<Line>) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => f(&mut v),
        Err(_) => f(&mut Vec::new()),
    })
}

/// One `KC × NC` block of `B` (columns `jc..jc + nc`, depth `pc..pc + kc`) packed at `bp`,
/// and whether the products against it overwrite `C` (its first block without `accumulate`).
#[derive(Clone, Copy)]
struct BlockB {
    jc: usize,
    nc: usize,
    pc: usize,
    kc: usize,
    bp: *mut f32,
    overwrite: bool,
    /// The product runs on one thread: [`rows_against`] keeps each `A` panel in L1 and
    /// streams the block's `B` panels past it.
    alone: bool,
}

/// A pointer that may cross to the pool's threads: each thread writes a disjoint set of `C`'s
/// tiles.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the threads of one product write disjoint tiles of `C` and only read `A` and `B`.
unsafe impl Send for Shared {}

// SAFETY: as above.
unsafe impl Sync for Shared {}

/// The operands of one product, as raw pointers with element strides.
#[derive(Clone, Copy)]
pub(crate) struct Operands {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub rs_a: usize,
    pub cs_a: usize,
    pub b: *const f32,
    pub rs_b: usize,
    pub cs_b: usize,
}
// SAFETY: the operands are only read.
unsafe impl Send for Operands {}
// SAFETY: as above.
unsafe impl Sync for Operands {}

/// `C (m × n, row stride ldc, column stride 1) = [C +] A (m × k) · B (k × n)` with the tile of
/// `level`, on up to `threads` of rayon's pool. `C` may be uninitialised when `accumulate` is
/// false.
///
/// # Safety
///
/// The CPU runs `level` ([`level`] is it or wider); every element the strides reach lies in
/// its allocation; `C`'s rows do not overlap `A` or `B`; `C` is initialised when `accumulate`.
pub(crate) unsafe fn gemm(
    level: Level,
    o: Operands,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    threads: usize,
) {
    let (m, n, k) = (o.m, o.n, o.k);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row `i` of `C` has `n` elements (the caller's contract).
                unsafe { std::ptr::write_bytes(c.add(i * ldc), 0, n) };
            }
        }
        return;
    }
    let (mr, nr) = match level {
        Level::Avx2 => (Avx2::MR, Avx2::NR),
        Level::Avx512 => (Avx512::MR, Avx512::NR),
    };
    let c = Shared(c);
    let parts = if m * n * k < SPLIT_MIN {
        1
    } else {
        threads.max(1)
    };
    // Split the dimension whose other operand is the cheaper one to pack on every thread.
    let split_m = m >= n;
    let (tiles, tile, len) = if split_m {
        (m.div_ceil(mr), mr, m)
    } else {
        (n.div_ceil(nr), nr, n)
    };
    let parts = parts.min(tiles);
    let run = move |part: usize| {
        let lo = (tiles * part / parts) * tile;
        let hi = ((tiles * (part + 1) / parts) * tile).min(len);
        let (rows, cols) = if split_m {
            (lo..hi, 0..n)
        } else {
            (0..m, lo..hi)
        };
        // SAFETY: the caller's contract; parts write disjoint tiles.
        unsafe { blocked(level, o, rows, cols, c, ldc, accumulate, parts == 1) }
    };
    if parts == 1 {
        run(0);
    } else {
        use rayon::prelude::*;
        (0..parts).into_par_iter().for_each(run);
    }
}

/// One thread's share: rows `rows` × columns `cols` of `C`, blocked and packed.
///
/// # Safety
///
/// As [`gemm`].
#[allow(clippy::too_many_arguments)]
unsafe fn blocked(
    level: Level,
    o: Operands,
    rows: Range<usize>,
    cols: Range<usize>,
    c: Shared,
    ldc: usize,
    accumulate: bool,
    alone: bool,
) {
    with_buffer(&PACK_A, |pa| {
        with_buffer(&PACK_B, |pb| {
            let c = c.0;
            // SAFETY: the caller's contract; `level` runs on this CPU.
            unsafe {
                match level {
                    Level::Avx2 => kernel_avx2(o, rows, cols, c, ldc, accumulate, alone, pa, pb),
                    Level::Avx512 => {
                        kernel_avx512(o, rows, cols, c, ldc, accumulate, alone, pa, pb)
                    }
                }
            }
        })
    })
}

/// [`kernel`] with AVX2's tile, compiled for AVX2 and FMA.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(
    o: Operands,
    rows: Range<usize>,
    cols: Range<usize>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    alone: bool,
    pa: &mut Vec<Line>,
    pb: &mut Vec<Line>,
) {
    // SAFETY: the caller's contract.
    unsafe { kernel::<Avx2>(o, rows, cols, c, ldc, accumulate, alone, pa, pb) }
}

/// [`kernel`] with AVX-512's tile, compiled for AVX-512 F.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn kernel_avx512(
    o: Operands,
    rows: Range<usize>,
    cols: Range<usize>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    alone: bool,
    pa: &mut Vec<Line>,
    pb: &mut Vec<Line>,
) {
    // SAFETY: the caller's contract.
    unsafe { kernel::<Avx512>(o, rows, cols, c, ldc, accumulate, alone, pa, pb) }
}

/// `v` grown to at least `floats` floats; its start.
fn buffer(v: &mut Vec<Line>, floats: usize) -> *mut f32 {
    let lines = floats.div_ceil(16);
    if v.len() < lines {
        v.resize(lines, Line([0.0; 16]));
    }
    v.as_mut_ptr() as *mut f32
}

/// The five loops around `I`'s register tile over rows `rows` and columns `cols` of `C`.
///
/// # Safety
///
/// As [`gemm`]; compiled inside a function with `I`'s instructions.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn kernel<I: Isa>(
    o: Operands,
    rows: Range<usize>,
    cols: Range<usize>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    alone: bool,
    pa: &mut Vec<Line>,
    pb: &mut Vec<Line>,
) {
    let (nr, kc_max) = (I::NR, I::KC.min(o.k));
    let alone = alone && I::A_RESIDENT_ALONE;
    let nc_max = if alone { NC_ALONE.min(I::NC) } else { I::NC };
    let bp = buffer(pb, nc_max.min(cols.len()).div_ceil(nr) * nr * kc_max);
    let mut jc = cols.start;
    while jc < cols.end {
        let nc = nc_max.min(cols.end - jc);
        let mut pc = 0;
        while pc < o.k {
            let blk = BlockB {
                jc,
                nc,
                pc,
                kc: I::KC.min(o.k - pc),
                bp,
                overwrite: pc == 0 && !accumulate,
                alone,
            };
            // SAFETY: the caller's contract.
            unsafe {
                pack(
                    nr,
                    blk.kc,
                    nc,
                    o.b.add(pc * o.rs_b + jc * o.cs_b),
                    o.cs_b,
                    o.rs_b,
                    bp,
                );
                rows_against::<I>(&o, blk, rows.clone(), c, ldc, pa);
            }
            pc += I::KC;
        }
        jc += nc;
    }
}

/// Rows `rows` of `C`'s columns `blk.jc..blk.jc + blk.nc` (=/+=) `A`'s rows times the packed
/// block: `A` packed `MC` rows at a time into `pa`, then the register tiles.
///
/// # Safety
///
/// As [`gemm`]; `blk` packed; compiled inside a function with `I`'s instructions.
#[inline(always)]
unsafe fn rows_against<I: Isa>(
    o: &Operands,
    blk: BlockB,
    rows: Range<usize>,
    c: *mut f32,
    ldc: usize,
    pa: &mut Vec<Line>,
) {
    let (mr, nr, kc) = (I::MR, I::NR, blk.kc);
    // `pack`'s transposes may spill up to 7 floats past the last panel.
    let ap = buffer(pa, I::MC.min(rows.len()).div_ceil(mr) * mr * kc + 8);
    let mut ic = rows.start;
    while ic < rows.end {
        let mc = I::MC.min(rows.end - ic);
        // SAFETY: the block lies in `A` (the caller's contract); `ap` holds it.
        unsafe {
            pack(
                mr,
                kc,
                mc,
                o.a.add(ic * o.rs_a + blk.pc * o.cs_a),
                o.rs_a,
                o.cs_a,
                ap,
            )
        };
        // A macro, not a closure: a closure would not inherit the caller's target features.
        macro_rules! tile {
            ($ir:expr, $jr:expr) => {{
                let (ir, jr) = ($ir, $jr);
                // SAFETY: panels inside the packed blocks; the tile inside `C`.
                unsafe {
                    I::tile(
                        kc,
                        ap.add(ir * kc),
                        blk.bp.add(jr * kc),
                        c.add((ic + ir) * ldc + blk.jc + jr),
                        ldc,
                        mr.min(mc - ir),
                        nr.min(blk.nc - jr),
                        blk.overwrite,
                    )
                }
            }};
        }
        if blk.alone {
            // One thread: the `A` panel stays in L1 while the block's `B` panels (`NC_ALONE`
            // columns: L2) stream past it.
            for ir in (0..mc).step_by(mr) {
                for jr in (0..blk.nc).step_by(nr) {
                    tile!(ir, jr);
                }
            }
        } else {
            // Split: the `B` panel stays in L1 while the `A` block's panels (L2) stream past.
            for jr in (0..blk.nc).step_by(nr) {
                for ir in (0..mc).step_by(mr) {
                    tile!(ir, jr);
                }
            }
        }
        ic += mc;
    }
}

/// Packs `len` lines of `kc` steps into panels of `w` lines: panel `q`, step `p`, line `i` at
/// `dst[q·kc·w + p·w + i]`, lines past `len` zero. Line `i` at step `p` is `src[i·ls + p·ks]`:
/// `A`'s rows (`ls`, `ks` = its row and column strides) or `B`'s columns (its column and row
/// strides), so one routine packs both operands.
#[inline(always)]
unsafe fn pack(
    w: usize,
    kc: usize,
    len: usize,
    src: *const f32,
    ls: usize,
    ks: usize,
    dst: *mut f32,
) {
    if ls == 1 {
        // Lines contiguous (a row-major `B`, the `gᵀ` of a weight gradient): step `p`'s `len`
        // floats are one run, read once and in order into every panel (panel by panel, each
        // step's run was fetched again per panel, 4 KiB apart).
        let full = len / w;
        let rest = len - full * w;
        for p in 0..kc {
            // SAFETY: step `p` of the block lies in the operand; the panels in `dst`.
            unsafe {
                let run = src.add(p * ks);
                for q in 0..full {
                    std::ptr::copy_nonoverlapping(run.add(q * w), dst.add(q * kc * w + p * w), w);
                }
                if rest > 0 {
                    let d = dst.add(full * kc * w + p * w);
                    std::ptr::copy_nonoverlapping(run.add(full * w), d, rest);
                    std::ptr::write_bytes(d.add(rest), 0, w - rest);
                }
            }
        }
        return;
    }
    let mut d = dst;
    let mut i0 = 0;
    while i0 < len {
        let lines = w.min(len - i0);
        // SAFETY: lines `i0..i0 + lines` of the block lie in the operand; `d` has `kc·w` floats
        // (and the slack `rows_against` gives `A`'s buffer).
        unsafe {
            let src = src.add(i0 * ls);
            if lines == w && ks == 1 {
                // Lines contiguous along `k` (the row-major `A` of `x·Wᵀ`, the `Wᵀ` as `B`):
                // 8 × 8 transposes of eight lines at a time. A group that overhangs `w` (`A`'s
                // 6 or 14) reads line `w - 1` again for the missing lines and writes them into
                // the next step's first slots, which the groups below it (stored after it) or
                // the next steps overwrite; past the last panel they land in the buffer's slack.
                let mut p = 0;
                while p + 8 <= kc {
                    let mut g = (w - 1) / 8 * 8;
                    loop {
                        transpose8_rows(src.add(g * ls + p), ls, w - g, d.add(p * w + g), w);
                        if g == 0 {
                            break;
                        }
                        g -= 8;
                    }
                    p += 8;
                }
                for p in p..kc {
                    for i in 0..w {
                        *d.add(p * w + i) = *src.add(i * ls + p);
                    }
                }
            } else {
                for p in 0..kc {
                    for i in 0..w {
                        *d.add(p * w + i) = if i < lines {
                            *src.add(i * ls + p * ks)
                        } else {
                            0.0
                        };
                    }
                }
            }
            d = d.add(kc * w);
        }
        i0 += w;
    }
}

/// `dst[q·ld_dst + r] = src[min(r, rows - 1)·ld_src + q]` for `q < 8`, `r < 8`: eight rows
/// of eight floats transposed in registers, rows from `rows` on reading the last one again
/// (`rows ≥ 1`). Stores go in increasing `q`.
#[inline(always)]
unsafe fn transpose8_rows(
    src: *const f32,
    ld_src: usize,
    rows: usize,
    dst: *mut f32,
    ld_dst: usize,
) {
    // SAFETY: `rows` rows of eight floats at `src`, eight rows of eight at `dst` (the caller's
    // contract); compiled inside a kernel with AVX. The loads are written out: a closure
    // (`array::map`) is not compiled with the kernel's target features, so its intrinsics
    // became calls (3 % of the kernel's samples under `perf`).
    unsafe {
        let last = rows - 1;
        let r = [
            _mm256_loadu_ps(src),
            _mm256_loadu_ps(src.add(last.min(1) * ld_src)),
            _mm256_loadu_ps(src.add(last.min(2) * ld_src)),
            _mm256_loadu_ps(src.add(last.min(3) * ld_src)),
            _mm256_loadu_ps(src.add(last.min(4) * ld_src)),
            _mm256_loadu_ps(src.add(last.min(5) * ld_src)),
            _mm256_loadu_ps(src.add(last.min(6) * ld_src)),
            _mm256_loadu_ps(src.add(last.min(7) * ld_src)),
        ];
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let out = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (q, v) in out.into_iter().enumerate() {
            _mm256_storeu_ps(dst.add(q * ld_dst), v);
        }
    }
}

impl Isa for Avx2 {
    const MR: usize = 6;
    const NR: usize = 16;
    // Panels of 6 and 16 × 256 floats: 24 KiB of L1.
    const KC: usize = 256;
    const MC: usize = 120;
    const NC: usize = 3072;
    // The 16 KiB `B` panel leaves L1 room: the `A`-resident order measured neutral on one
    // thread (−2.5 to +3 %, BENCHMARKS.md §23).
    const A_RESIDENT_ALONE: bool = false;

    #[inline(always)]
    unsafe fn tile(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        overwrite: bool,
    ) {
        const MR: usize = 6;
        const NR: usize = 16;
        // SAFETY: the trait's contract; AVX2 and FMA are on.
        unsafe {
            if !overwrite {
                // The tile's rows of `C`, read after the loop: fetched while it runs.
                for i in 0..rows {
                    _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + NR - 1) as *const i8);
                }
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            let (mut a, mut b) = (a, b);
            for _ in 0..kc {
                let b0 = _mm256_load_ps(b);
                let b1 = _mm256_load_ps(b.add(8));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*a.add(i));
                    acc[0] = _mm256_fmadd_ps(ai, b0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(ai, b1, acc[1]);
                }
                a = a.add(MR);
                b = b.add(NR);
            }
            if rows == MR && cols == NR {
                for (i, acc) in acc.iter().enumerate() {
                    let ci = c.add(i * ldc);
                    let (x0, x1) = if overwrite {
                        (acc[0], acc[1])
                    } else {
                        (
                            _mm256_add_ps(_mm256_loadu_ps(ci), acc[0]),
                            _mm256_add_ps(_mm256_loadu_ps(ci.add(8)), acc[1]),
                        )
                    };
                    _mm256_storeu_ps(ci, x0);
                    _mm256_storeu_ps(ci.add(8), x1);
                }
            } else {
                let mut t = [0f32; MR * NR];
                for (i, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(t.as_mut_ptr().add(i * NR), acc[0]);
                    _mm256_storeu_ps(t.as_mut_ptr().add(i * NR + 8), acc[1]);
                }
                store_edge(&t, NR, c, ldc, rows, cols, overwrite);
            }
        }
    }
}

impl Isa for Avx512 {
    const MR: usize = 14;
    const NR: usize = 32;
    // Panels of 14 and 32 × 256 floats: 46 KiB of L1.
    const KC: usize = 256;
    const MC: usize = 126;
    const NC: usize = 3072;
    // The 32 KiB `B` panel crowds a 48 KiB L1.
    const A_RESIDENT_ALONE: bool = true;

    #[inline(always)]
    unsafe fn tile(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        overwrite: bool,
    ) {
        const MR: usize = 14;
        const NR: usize = 32;
        // SAFETY: the trait's contract; AVX-512 F is on.
        unsafe {
            if !overwrite {
                // The tile's rows of `C`, read after the loop: fetched while it runs.
                for i in 0..rows {
                    _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + 16) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + NR - 1) as *const i8);
                }
            }
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            let (mut a, mut b) = (a, b);
            for _ in 0..kc {
                let b0 = _mm512_load_ps(b);
                let b1 = _mm512_load_ps(b.add(16));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*a.add(i));
                    acc[0] = _mm512_fmadd_ps(ai, b0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(ai, b1, acc[1]);
                }
                a = a.add(MR);
                b = b.add(NR);
            }
            if rows == MR && cols == NR {
                for (i, acc) in acc.iter().enumerate() {
                    let ci = c.add(i * ldc);
                    let (x0, x1) = if overwrite {
                        (acc[0], acc[1])
                    } else {
                        (
                            _mm512_add_ps(_mm512_loadu_ps(ci), acc[0]),
                            _mm512_add_ps(_mm512_loadu_ps(ci.add(16)), acc[1]),
                        )
                    };
                    _mm512_storeu_ps(ci, x0);
                    _mm512_storeu_ps(ci.add(16), x1);
                }
            } else {
                let mut t = [0f32; MR * NR];
                for (i, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(t.as_mut_ptr().add(i * NR), acc[0]);
                    _mm512_storeu_ps(t.as_mut_ptr().add(i * NR + 16), acc[1]);
                }
                store_edge(&t, NR, c, ldc, rows, cols, overwrite);
            }
        }
    }
}

/// An edge tile's `rows × cols` of `t` (row stride `nr`) written or added into `C`.
#[inline(always)]
unsafe fn store_edge(
    t: &[f32],
    nr: usize,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    overwrite: bool,
) {
    for i in 0..rows {
        for j in 0..cols {
            // SAFETY: the tile's `rows × cols` lie in `C` (the caller's contract).
            unsafe {
                let d = c.add(i * ldc + j);
                *d = if overwrite {
                    t[i * nr + j]
                } else {
                    *d + t[i * nr + j]
                };
            }
        }
    }
}

#[cfg(test)]
mod tests;
