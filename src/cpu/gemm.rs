//! f32 matrix products on AVX2 + FMA and on AVX-512: the crate's own kernel.
//!
//! `gemm`'s AVX2 kernel reached 50–70 % of an AVX2 CPU's f32 peak on the training step's shapes
//! where OpenBLAS and MKL reach 80–87 %, and its AVX-512 kernel 0.78–0.95× MKL's (issue 31,
//! BENCHMARKS.md). This is the layered design of Goto and van de Geijn ("Anatomy of
//! High-Performance Matrix Multiplication", ACM TOMS 34(3), 2008) as BLIS arranges it (Van Zee
//! and van de Geijn, ACM TOMS 41(3), 2015):
//!
//! - `B` is packed into column panels of `NR` (a `KC × NC` block, in the last-level cache), `A`
//!   into row panels of `MR` (an `MC × KC` block, in L2), zero-padded at the edges, with 8 × 8
//!   in-register transposes for the transposed `B` of `x·Wᵀ`;
//! - the register tile ([`Isa`]) is 6 × 16 on AVX2 (twelve 8-lane accumulators, two loads of
//!   `B` and six broadcasts of `A` for twelve fused multiply-adds per `k`: 15 of the 16 `ymm`
//!   registers) and 14 × 32 on AVX-512 (28 of the 32 `zmm` registers accumulate);
//! - the threads split `m` or `n` (the one whose other operand is the cheaper to pack on every
//!   thread) at tile boundaries, each packing for itself: no barrier inside a product.
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

/// The widest of the crate's kernels this CPU runs (AVX-512 F, else AVX2 and FMA), if any.
pub(crate) fn level() -> Option<Level> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Level::Avx512);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Some(Level::Avx2);
        }
    }
    None
}

/// One cache line of floats: the packing buffers' unit, so that every panel is 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

thread_local! {
    /// The thread's packing buffers (`A` block, `B` block), kept between products.
    static PACKS: RefCell<(Vec<Line>, Vec<Line>)> = const { RefCell::new((Vec::new(), Vec::new())) };
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
        unsafe { blocked(level, o, rows, cols, c, ldc, accumulate) }
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
unsafe fn blocked(
    level: Level,
    o: Operands,
    rows: Range<usize>,
    cols: Range<usize>,
    c: Shared,
    ldc: usize,
    accumulate: bool,
) {
    PACKS.with(|packs| {
        // A product does not call back into rayon while it holds the buffers, so the borrow
        // is never taken twice on one thread; if it were, fresh buffers would do.
        let mut own = (Vec::new(), Vec::new());
        let mut held = packs.try_borrow_mut();
        let (pa, pb) = match held.as_deref_mut() {
            Ok((pa, pb)) => (pa, pb),
            Err(_) => (&mut own.0, &mut own.1),
        };
        let c = c.0;
        // SAFETY: the caller's contract; `level` runs on this CPU.
        unsafe {
            match level {
                Level::Avx2 => kernel_avx2(o, rows, cols, c, ldc, accumulate, pa, pb),
                Level::Avx512 => kernel_avx512(o, rows, cols, c, ldc, accumulate, pa, pb),
            }
        }
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
    pa: &mut Vec<Line>,
    pb: &mut Vec<Line>,
) {
    // SAFETY: the caller's contract.
    unsafe { kernel::<Avx2>(o, rows, cols, c, ldc, accumulate, pa, pb) }
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
    pa: &mut Vec<Line>,
    pb: &mut Vec<Line>,
) {
    // SAFETY: the caller's contract.
    unsafe { kernel::<Avx512>(o, rows, cols, c, ldc, accumulate, pa, pb) }
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
    pa: &mut Vec<Line>,
    pb: &mut Vec<Line>,
) {
    let (mr, nr, kc_max) = (I::MR, I::NR, I::KC.min(o.k));
    let ap = buffer(pa, I::MC.min(rows.len()).div_ceil(mr) * mr * kc_max);
    let bp = buffer(pb, I::NC.min(cols.len()).div_ceil(nr) * nr * kc_max);
    let mut jc = cols.start;
    while jc < cols.end {
        let nc = I::NC.min(cols.end - jc);
        let mut pc = 0;
        while pc < o.k {
            let kc = I::KC.min(o.k - pc);
            // SAFETY: the block lies in `B` (the caller's contract); `bp` holds it.
            unsafe {
                pack_b(
                    nr,
                    kc,
                    nc,
                    o.b.add(pc * o.rs_b + jc * o.cs_b),
                    o.rs_b,
                    o.cs_b,
                    bp,
                )
            };
            let overwrite = pc == 0 && !accumulate;
            let mut ic = rows.start;
            while ic < rows.end {
                let mc = I::MC.min(rows.end - ic);
                // SAFETY: as above, for `A`.
                unsafe {
                    pack_a(
                        mr,
                        mc,
                        kc,
                        o.a.add(ic * o.rs_a + pc * o.cs_a),
                        o.rs_a,
                        o.cs_a,
                        ap,
                    )
                };
                let mut jr = 0;
                while jr < nc {
                    let mut ir = 0;
                    while ir < mc {
                        // SAFETY: panels inside the packed blocks; the tile inside `C`.
                        unsafe {
                            I::tile(
                                kc,
                                ap.add(ir * kc),
                                bp.add(jr * kc),
                                c.add((ic + ir) * ldc + jc + jr),
                                ldc,
                                mr.min(mc - ir),
                                nr.min(nc - jr),
                                overwrite,
                            )
                        };
                        ir += mr;
                    }
                    jr += nr;
                }
                ic += mc;
            }
            pc += kc;
        }
        jc += nc;
    }
}

/// Packs `A`'s `mc × kc` block into row panels of `mr`: panel `q`, step `p`, row `i` at
/// `dst[q·kc·mr + p·mr + i]`, rows past `mc` zero.
#[inline(always)]
unsafe fn pack_a(
    mr: usize,
    mc: usize,
    kc: usize,
    a: *const f32,
    rs: usize,
    cs: usize,
    dst: *mut f32,
) {
    let mut d = dst;
    let mut ir = 0;
    while ir < mc {
        let rows = mr.min(mc - ir);
        // SAFETY: rows `ir..ir + rows` of the block lie in `A`; `d` has `kc·mr` floats.
        unsafe {
            let a = a.add(ir * rs);
            if rows == mr && rs == 1 {
                for p in 0..kc {
                    std::ptr::copy_nonoverlapping(a.add(p * cs), d.add(p * mr), mr);
                }
            } else if rows == mr && cs == 1 {
                for p in 0..kc {
                    for i in 0..mr {
                        *d.add(p * mr + i) = *a.add(i * rs + p);
                    }
                }
            } else {
                for p in 0..kc {
                    for i in 0..mr {
                        *d.add(p * mr + i) = if i < rows {
                            *a.add(i * rs + p * cs)
                        } else {
                            0.0
                        };
                    }
                }
            }
            d = d.add(kc * mr);
        }
        ir += mr;
    }
}

/// Packs `B`'s `kc × nc` block into column panels of `nr` (a multiple of 8): panel `q`, step
/// `p`, column `j` at `dst[q·kc·nr + p·nr + j]`, columns past `nc` zero.
#[inline(always)]
unsafe fn pack_b(
    nr: usize,
    kc: usize,
    nc: usize,
    b: *const f32,
    rs: usize,
    cs: usize,
    dst: *mut f32,
) {
    let mut d = dst;
    let mut jr = 0;
    while jr < nc {
        let cols = nr.min(nc - jr);
        // SAFETY: columns `jr..jr + cols` of the block lie in `B`; `d` has `kc·nr` floats.
        unsafe {
            let b = b.add(jr * cs);
            if cols == nr && cs == 1 {
                for p in 0..kc {
                    std::ptr::copy_nonoverlapping(b.add(p * rs), d.add(p * nr), nr);
                }
            } else if cols == nr && rs == 1 {
                // Columns contiguous along `k` (`B = Wᵀ`): 8 × 8 transposes.
                let mut p = 0;
                while p + 8 <= kc {
                    for j in (0..nr).step_by(8) {
                        transpose8_rows(b.add(p + j * cs), cs, 8, d.add(p * nr + j), nr);
                    }
                    p += 8;
                }
                for p in p..kc {
                    for j in 0..nr {
                        *d.add(p * nr + j) = *b.add(j * cs + p);
                    }
                }
            } else {
                for p in 0..kc {
                    for j in 0..nr {
                        *d.add(p * nr + j) = if j < cols {
                            *b.add(p * rs + j * cs)
                        } else {
                            0.0
                        };
                    }
                }
            }
            d = d.add(kc * nr);
        }
        jr += nr;
    }
}

/// `dst[q·ld_dst + r] = src[r·ld_src + q]` for `q < 8`, `r < 8`: eight rows of eight floats,
/// transposed in registers; rows from `rows` on are read as zeros (and not read).
#[inline(always)]
unsafe fn transpose8_rows(
    src: *const f32,
    ld_src: usize,
    rows: usize,
    dst: *mut f32,
    ld_dst: usize,
) {
    // SAFETY: `rows` rows of eight floats at `src`, eight rows of eight at `dst` (the caller's
    // contract); compiled inside a kernel with AVX.
    unsafe {
        let r = [0, 1, 2, 3, 4, 5, 6, 7].map(|i| {
            if i < rows {
                _mm256_loadu_ps(src.add(i * ld_src))
            } else {
                _mm256_setzero_ps()
            }
        });
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
    // Panels of 14 and 32 × 192 floats: 35 KiB of L1.
    const KC: usize = 256;
    const MC: usize = 126;
    const NC: usize = 3072;

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
mod tests {
    use super::*;

    /// The kernels this CPU runs (none: the test says so and checks nothing).
    fn levels() -> Vec<Level> {
        match level() {
            Some(Level::Avx512) => vec![Level::Avx2, Level::Avx512],
            Some(Level::Avx2) => vec![Level::Avx2],
            None => {
                eprintln!("skipped: this CPU lacks AVX2 and FMA");
                vec![]
            }
        }
    }

    /// A deterministic pseudo-random f32 in [-1, 1).
    fn value(i: usize, seed: usize) -> f32 {
        let x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (seed as u64) << 17;
        let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `[C +] A·B` in f64 over the same strided operands.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        (ars, acs): (usize, usize),
        b: &[f32],
        (brs, bcs): (usize, usize),
        c: &[f32],
        ldc: usize,
        accumulate: bool,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = if accumulate {
                    c[i * ldc + j] as f64
                } else {
                    0.0
                };
                for p in 0..k {
                    s += a[i * ars + p * acs] as f64 * b[p * brs + j * bcs] as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    /// Runs one product on `threads` threads; returns `C` (row stride `n + 3`: the columns past
    /// `n` must stay untouched).
    #[allow(clippy::too_many_arguments)]
    fn product(
        level: Level,
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        (rs_a, cs_a): (usize, usize),
        b: &[f32],
        (rs_b, cs_b): (usize, usize),
        c0: &[f32],
        accumulate: bool,
        threads: usize,
    ) -> Vec<f32> {
        let mut c = c0.to_vec();
        let o = Operands {
            m,
            n,
            k,
            a: a.as_ptr(),
            rs_a,
            cs_a,
            b: b.as_ptr(),
            rs_b,
            cs_b,
        };
        // SAFETY: `level` runs here (the callers' `levels()`); the strides stay inside.
        unsafe { gemm(level, o, c.as_mut_ptr(), n + 3, accumulate, threads) };
        c
    }

    /// Every orientation the step uses (and a general stride), every edge of the 6 × 16 tile
    /// and of the `KC` / `MC` blocks, accumulating or not, one and two threads: within f32
    /// rounding of an f64 reference, bitwise equal across thread counts, and the columns past
    /// `n` untouched.
    #[test]
    fn products_match_an_f64_reference() {
        for level in levels() {
            every_case(level);
        }
    }

    fn every_case(level: Level) {
        let dims = [
            (1, 1, 1),
            (6, 16, 8),
            (7, 17, 9),
            (14, 32, 200),
            (15, 33, 193),
            (5, 15, 300),
            (13, 40, 257),
            (121, 33, 64),
            (64, 700, 520),
            (300, 70, 33),
            (97, 250, 600),
        ];
        for (case, &(m, n, k)) in dims.iter().enumerate() {
            // (name, A's strides, B's strides, elements of A and B)
            let orientations = [
                ("a·b", (k, 1), (n, 1)),
                ("a·bᵀ", (k, 1), (1, k)),
                ("aᵀ·b", (1, m), (n, 1)),
                ("aᵀ·bᵀ", (1, m), (1, k)),
                ("strided", (2 * k + 1, 2), (1, 3 * k)),
            ];
            for (name, (ars, acs), (brs, bcs)) in orientations {
                let a: Vec<f32> = (0..(m - 1) * ars + (k - 1) * acs + 1)
                    .map(|i| value(i, case))
                    .collect();
                let b: Vec<f32> = (0..(k - 1) * brs + (n - 1) * bcs + 1)
                    .map(|i| value(i, case + 100))
                    .collect();
                let ldc = n + 3;
                let c0: Vec<f32> = (0..m * ldc).map(|i| value(i, case + 200)).collect();
                for accumulate in [false, true] {
                    let one = product(
                        level,
                        (m, n, k),
                        &a,
                        (ars, acs),
                        &b,
                        (brs, bcs),
                        &c0,
                        accumulate,
                        1,
                    );
                    let two = product(
                        level,
                        (m, n, k),
                        &a,
                        (ars, acs),
                        &b,
                        (brs, bcs),
                        &c0,
                        accumulate,
                        2,
                    );
                    let want = reference(
                        (m, n, k),
                        &a,
                        (ars, acs),
                        &b,
                        (brs, bcs),
                        &c0,
                        ldc,
                        accumulate,
                    );
                    let what =
                        format!("{level:?} {name} m {m} n {n} k {k} accumulate {accumulate}");
                    assert!(
                        one.iter()
                            .zip(&two)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{what}: one and two threads differ"
                    );
                    for i in 0..m {
                        for j in 0..ldc {
                            let got = one[i * ldc + j];
                            if j >= n {
                                assert_eq!(
                                    got.to_bits(),
                                    c0[i * ldc + j].to_bits(),
                                    "{what}: ({i}, {j}) past n written"
                                );
                                continue;
                            }
                            let w = want[i * n + j];
                            // f32 rounding of k products and sums of values below 1.
                            let tol = 1e-6 * (k as f64 + 2.0);
                            assert!(
                                (got as f64 - w).abs() <= tol,
                                "{what}: ({i}, {j}) {got} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `k = 0`: `C = 0` without accumulation (from uninitialised memory), untouched with it.
    #[test]
    fn an_empty_sum_writes_zeros_or_nothing() {
        for level in levels() {
            let c0 = vec![7f32; 4 * 5];
            let none = product(level, (4, 2, 0), &[], (0, 1), &[], (2, 1), &c0, false, 2);
            let kept = product(level, (4, 2, 0), &[], (0, 1), &[], (2, 1), &c0, true, 2);
            for i in 0..4 {
                assert_eq!(&none[i * 5..i * 5 + 2], &[0.0, 0.0]);
                assert_eq!(&none[i * 5 + 2..i * 5 + 5], &[7.0; 3]);
                assert_eq!(&kept[i * 5..i * 5 + 5], &[7.0; 5]);
            }
        }
    }
}
