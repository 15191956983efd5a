//! The gated MLP's middle of the block node (`super`): `m = act(g) ⊙ u` over the rows of the
//! `[g, u]` projection and, in the backward, `[dg, du]`, in one pass over the rank's threads
//! (SwiGLU with SiLU, GeGLU with the tanh GELU).

use crate::models::decoder::Activation;
use crate::nn::kernels::{gelu_tanh, gelu_tanh_grad, silu, silu_grad};

/// The gated MLP's middle, one pass over the rank's threads: `m = act(g) ⊙ u` from `gu` `(n,
/// 2I)`; with `dm` `(n, I)`, also `[dg, du] = [dm ⊙ u ⊙ act'(g), dm ⊙ act(g)]` `(n, 2I)`.
pub(super) fn gate(
    gu: &[f32],
    dm: Option<&[f32]>,
    i: usize,
    act: Activation,
) -> (Vec<f32>, Vec<f32>) {
    const ROWS: usize = 64;
    use std::mem::MaybeUninit;
    let n = gu.len() / (2 * i).max(1);
    let mut m: Vec<MaybeUninit<f32>> = Vec::with_capacity(n * i);
    let nd = if dm.is_some() { n * 2 * i } else { 0 };
    let mut dgu: Vec<MaybeUninit<f32>> = Vec::with_capacity(nd);
    // SAFETY: `MaybeUninit` needs no initialisation.
    unsafe {
        m.set_len(n * i);
        dgu.set_len(nd);
    }
    let run = |k: usize, m: &mut [MaybeUninit<f32>], d: Option<&mut [MaybeUninit<f32>]>| {
        let gu = &gu[k * ROWS * 2 * i..];
        let dm = dm.map(|dm| &dm[k * ROWS * i..]);
        crate::cpu::with_simd(
            #[inline(always)]
            || match act {
                Activation::Silu => gate_rows::<true>(gu, dm, m, d, i),
                Activation::GeluTanh => gate_rows::<false>(gu, dm, m, d, i),
            },
        )
    };
    if n > ROWS && crate::cpu::threads() > 1 {
        use rayon::prelude::*;
        if dm.is_some() {
            m.par_chunks_mut(ROWS * i)
                .zip(dgu.par_chunks_mut(ROWS * 2 * i))
                .enumerate()
                .for_each(|(k, (m, d))| run(k, m, Some(d)));
        } else {
            m.par_chunks_mut(ROWS * i)
                .enumerate()
                .for_each(|(k, m)| run(k, m, None));
        }
    } else if dm.is_some() {
        for (k, (m, d)) in m
            .chunks_mut(ROWS * i)
            .zip(dgu.chunks_mut(ROWS * 2 * i))
            .enumerate()
        {
            run(k, m, Some(d));
        }
    } else {
        for (k, m) in m.chunks_mut(ROWS * i).enumerate() {
            run(k, m, None);
        }
    }
    // SAFETY: `gate_rows` wrote every element of both (whole rows of every chunk).
    unsafe {
        (
            std::mem::transmute::<Vec<MaybeUninit<f32>>, Vec<f32>>(m),
            std::mem::transmute::<Vec<MaybeUninit<f32>>, Vec<f32>>(dgu),
        )
    }
}

/// [`gate`]'s rows: `m` (rows of `i`) from `gu` (rows of `2i`, from the same row), and with
/// `dm` and `d` the gradient rows; SiLU when `SILU`, else the tanh GELU.
#[inline(always)]
fn gate_rows<const SILU: bool>(
    gu: &[f32],
    dm: Option<&[f32]>,
    m: &mut [std::mem::MaybeUninit<f32>],
    d: Option<&mut [std::mem::MaybeUninit<f32>]>,
    i: usize,
) {
    #[inline(always)]
    fn f<const SILU: bool>(x: f32) -> f32 {
        if SILU {
            silu(x)
        } else {
            gelu_tanh(x)
        }
    }
    #[inline(always)]
    fn df<const SILU: bool>(x: f32) -> f32 {
        if SILU {
            silu_grad(x)
        } else {
            gelu_tanh_grad(x)
        }
    }
    for (r, mrow) in m.chunks_exact_mut(i).enumerate() {
        let (g, u) = gu[r * 2 * i..][..2 * i].split_at(i);
        for ((o, &g), &u) in mrow.iter_mut().zip(g).zip(u) {
            o.write(f::<SILU>(g) * u);
        }
    }
    if let (Some(d), Some(dm)) = (d, dm) {
        for (r, drow) in d.chunks_exact_mut(2 * i).enumerate() {
            let (g, u) = gu[r * 2 * i..][..2 * i].split_at(i);
            let dmr = &dm[r * i..][..i];
            let (dg, du) = drow.split_at_mut(i);
            for j in 0..i {
                dg[j].write(dmr[j] * u[j] * df::<SILU>(g[j]));
                du[j].write(dmr[j] * f::<SILU>(g[j]));
            }
        }
    }
}
