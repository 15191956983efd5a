//! The kernel against an f64 reference, every orientation, edge and split.

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

/// One product: `A` (`m × k`) and `B` (`k × n`) with their (row, column) strides, and `C`'s
/// starting values (row stride `n + 3`: the columns past `n` must stay untouched).
struct Case {
    dims: (usize, usize, usize),
    a: Vec<f32>,
    a_strides: (usize, usize),
    b: Vec<f32>,
    b_strides: (usize, usize),
    c0: Vec<f32>,
}

impl Case {
    fn ldc(&self) -> usize {
        self.dims.1 + 3
    }

    /// `C` after the kernel of `level` on `threads` threads.
    fn run(&self, level: Level, accumulate: bool, threads: usize) -> Vec<f32> {
        let (m, n, k) = self.dims;
        let mut c = self.c0.clone();
        let o = Operands {
            m,
            n,
            k,
            a: self.a.as_ptr(),
            rs_a: self.a_strides.0,
            cs_a: self.a_strides.1,
            b: self.b.as_ptr(),
            rs_b: self.b_strides.0,
            cs_b: self.b_strides.1,
        };
        // SAFETY: `level` runs here (the callers' `levels()`); the strides stay inside.
        unsafe { gemm(level, o, c.as_mut_ptr(), self.ldc(), accumulate, threads) };
        c
    }

    /// `[C +] A·B` in f64 over the same strided operands (`m × n`, row stride `n`).
    fn reference(&self, accumulate: bool) -> Vec<f64> {
        let ((m, n, k), (ars, acs), (brs, bcs)) = (self.dims, self.a_strides, self.b_strides);
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = if accumulate {
                    self.c0[i * self.ldc() + j] as f64
                } else {
                    0.0
                };
                for p in 0..k {
                    s += self.a[i * ars + p * acs] as f64 * self.b[p * brs + j * bcs] as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }
}

/// Every orientation the step uses (and a general stride), every edge of the tiles and of
/// the `KC` / `MC` / `NC` blocks, accumulating or not, one and two threads: within f32
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
        // Split over `m` on two threads: several `KC` blocks, then two `NC` blocks.
        (400, 90, 600),
        (3100, 3080, 2),
        // On one thread (the `A`-panel-resident order): three `NC_ALONE` blocks with two `KC`
        // blocks each and a short last one, against the split order on two threads.
        (20, 2100, 300),
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
            let ldc = n + 3;
            let c = Case {
                dims: (m, n, k),
                a: (0..(m - 1) * ars + (k - 1) * acs + 1)
                    .map(|i| value(i, case))
                    .collect(),
                a_strides: (ars, acs),
                b: (0..(k - 1) * brs + (n - 1) * bcs + 1)
                    .map(|i| value(i, case + 100))
                    .collect(),
                b_strides: (brs, bcs),
                c0: (0..m * ldc).map(|i| value(i, case + 200)).collect(),
            };
            let c0 = &c.c0;
            for accumulate in [false, true] {
                let one = c.run(level, accumulate, 1);
                let two = c.run(level, accumulate, 2);
                let want = c.reference(accumulate);
                let what = format!("{level:?} {name} m {m} n {n} k {k} accumulate {accumulate}");
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
        let c = Case {
            dims: (4, 2, 0),
            a: vec![],
            a_strides: (0, 1),
            b: vec![],
            b_strides: (2, 1),
            c0: vec![7f32; 4 * 5],
        };
        let none = c.run(level, false, 2);
        let kept = c.run(level, true, 2);
        for i in 0..4 {
            assert_eq!(&none[i * 5..i * 5 + 2], &[0.0, 0.0]);
            assert_eq!(&none[i * 5 + 2..i * 5 + 5], &[7.0; 3]);
            assert_eq!(&kept[i * 5..i * 5 + 5], &[7.0; 5]);
        }
    }
}
