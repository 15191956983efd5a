//! The LoRA adapters' products inside the decoder block node ([`super`]): each adapted
//! projection adds `s·(drop(a)·Aᵀ)·Bᵀ` into its columns; the backward computes `A`'s and `B`'s
//! gradients (those that train) and the input's share, with the dropout mask regenerated from
//! the call's seed ([`crate::lora::dropout_in_place`]), never stored.

use super::Piece;
use crate::nn::kernels::{add_assign, matmul, matmul_new, Mat};

/// `a` with the adapter's dropout mask applied ([`crate::lora::dropout_in_place`]), or `a`
/// itself without dropout.
pub(super) fn dropped(a: &[f32], drop: Option<(f32, u64)>) -> std::borrow::Cow<'_, [f32]> {
    match drop {
        Some((p, seed)) => {
            let mut v = a.to_vec();
            crate::lora::dropout_in_place(&mut v, p, seed);
            std::borrow::Cow::Owned(v)
        }
        None => std::borrow::Cow::Borrowed(a),
    }
}

/// `da += t ⊙ mask` (`t` the gradient of the adapter's dropped input), or `da += t`.
pub(super) fn add_dropped_grad(da: &mut [f32], mut t: Vec<f32>, drop: Option<(f32, u64)>) {
    if let Some((p, seed)) = drop {
        crate::lora::dropout_in_place(&mut t, p, seed);
    }
    add_assign(da, &t);
}

/// `out` `(n, pc.rows)` `+= s · (drop(a)·Aᵀ)·Bᵀ` for the piece's LoRA adapter, if it has one.
pub(super) fn lora_into(
    out: &mut [f32],
    a: &[f32],
    n: usize,
    inp: usize,
    pc: &Piece,
    p: &[&[f32]],
) {
    if let Some((ai, bi, r, scale)) = pc.lora {
        let xa = lora_down(&dropped(a, pc.drop), n, inp, p[ai], r, scale);
        let bt = Mat::new(p[bi], pc.rows, r).t();
        matmul(out, pc.rows, true, Mat::new(&xa, n, r), bt);
    }
}

/// The backward of [`lora_into`] for the output gradient `g` `(n, pc.rows)`: `A`'s and `B`'s
/// gradients (those that train) into `grads`, and `da += s·g·B·A`.
#[allow(clippy::too_many_arguments)]
pub(super) fn lora_bwd(
    g: &[f32],
    a: &[f32],
    n: usize,
    inp: usize,
    pc: &Piece,
    p: &[&[f32]],
    trains: &[bool],
    grads: &mut [Option<Vec<f32>>],
    da: &mut [f32],
) {
    lora_bwd_cols(Mat::new(g, n, pc.rows), a, n, inp, pc, p, trains, grads, da);
}

/// [`lora_bwd`] for the gradient given as a view (a piece's columns of a wider gradient):
/// `y += s·(a·Aᵀ)·Bᵀ` gives `dB = gᵀ·(s·a·Aᵀ)`, `d(xa) = s·g·B`, `dA = d(xa)ᵀ·a`, `da +=
/// d(xa)·A`.
#[allow(clippy::too_many_arguments)]
pub(super) fn lora_bwd_cols(
    gp: Mat<'_>,
    a: &[f32],
    n: usize,
    inp: usize,
    pc: &Piece,
    p: &[&[f32]],
    trains: &[bool],
    grads: &mut [Option<Vec<f32>>],
    da: &mut [f32],
) {
    let Some((ai, bi, r, scale)) = pc.lora else {
        return;
    };
    let ad = dropped(a, pc.drop);
    if trains[bi] {
        let xa = lora_down(&ad, n, inp, p[ai], r, scale);
        grads[bi] = Some(matmul_new(gp.t(), Mat::new(&xa, n, r)));
    }
    let mut dxa = matmul_new(gp, Mat::new(p[bi], pc.rows, r));
    for v in &mut dxa {
        *v *= scale;
    }
    if trains[ai] {
        grads[ai] = Some(matmul_new(Mat::new(&dxa, n, r).t(), Mat::new(&ad, n, inp)));
    }
    if pc.drop.is_some() {
        let t = matmul_new(Mat::new(&dxa, n, r), Mat::new(p[ai], r, inp));
        add_dropped_grad(da, t, pc.drop);
    } else {
        matmul(da, inp, true, Mat::new(&dxa, n, r), Mat::new(p[ai], r, inp));
    }
}

/// `s · a·Aᵀ` `(n, r)` for `a` `(n, inp)` and a LoRA `A` `(r, inp)`.
pub(super) fn lora_down(
    a: &[f32],
    n: usize,
    inp: usize,
    la: &[f32],
    r: usize,
    scale: f32,
) -> Vec<f32> {
    let mut xa = matmul_new(Mat::new(a, n, inp), Mat::new(la, r, inp).t());
    for v in &mut xa {
        *v *= scale;
    }
    xa
}
