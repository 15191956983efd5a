//! The wrappers of the element-wise kernels of modules `ops` (scale, finiteness checks, add,
//! sum of squares) and `optim` (AdamW, SGD, the grad scaler's update): in-place updates of
//! flat tensors on the device's compute stream, over the helpers of [`super`].

use candle_core::{DType, Tensor};
use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};

use super::{
    check_f32, check_one, check_scalar, config_1d, cuda_storage, device_of, f32_view, f32_view_mut,
    factor_parts, func, guard, guard_view, launch_err, push_opt, range, with_mut, with_mut2,
    AnyView,
};
use crate::error::{Error, Result};
use crate::kernels::plan::{AdamWArgs, SgdArgs};
use crate::kernels::{self, dtype_code, THREADS};
use crate::ops::{AdamWHyper, ScaleFactor, SgdHyper, Unscale};

// ---- module `ops` --------------------------------------------------------------------------

/// `t = t · s` in place (f32, contiguous, on a GPU, checked by [`crate::ops::scale_`]);
/// [`kernels::scale_reference`].
///
/// Errors: a failed launch.
pub(in crate::ops) fn scale_(t: &Tensor, s: f32) -> Result<()> {
    const OP: &str = "scale_";
    let n = t.elem_count();
    if n == 0 {
        return Ok(());
    }
    let dev = device_of(OP, "tensor", t)?;
    let f = func(&dev, "ops", "scale")?;
    let cs = dev.cuda_stream();
    with_mut(t, OP, |ts, tl| {
        let mut x = f32_view_mut(ts, tl, OP, "tensor")?;
        let n64 = n as u64;
        let mut b = cs.launch_builder(&f);
        b.arg(&mut x);
        b.arg(&n64);
        b.arg(&s);
        // SAFETY: `scale(float*, u64, float)`: matching argument list; the view holds n f32.
        unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("ops::scale", e))?;
        Ok(())
    })
}

/// The grad scaler's unscale with its inf/NaN check, on the device: `t = t · factor` in place
/// and, when some result is infinite or NaN, `found_inf = 1` (a one-element f32 tensor on the
/// same GPU, never read by the host here, left alone otherwise: zero it before the step's first
/// call); [`kernels::scale_check_finite_reference`], PyTorch's
/// `_amp_foreach_non_finite_check_and_unscale_`.
///
/// Arguments checked by [`crate::ops::unscale_check_finite_`].
///
/// Errors: a failed launch.
pub(in crate::ops) fn scale_check_finite_(
    t: &Tensor,
    factor: ScaleFactor<'_>,
    found_inf: &Tensor,
) -> Result<()> {
    const OP: &str = "scale_check_finite_";
    let n = t.elem_count();
    let dev = device_of(OP, "tensor", t)?;
    let (value, dev_factor) = factor_parts(&factor);
    if n == 0 {
        return Ok(());
    }
    let f = func(&dev, "ops", "scale_check_finite")?;
    let cs = dev.cuda_stream();
    let fg = guard(dev_factor);
    let fv = guard_view(&fg, OP, "inv_scale")?;
    let null = 0u64;
    with_mut(t, OP, |ts, tl| {
        let mut x = f32_view_mut(ts, tl, OP, "tensor")?;
        with_mut(found_inf, OP, |fs, fl| {
            let mut flag = f32_view_mut(fs, fl, OP, "found_inf")?;
            let n64 = n as u64;
            let mut b = cs.launch_builder(&f);
            b.arg(&mut x);
            b.arg(&n64);
            b.arg(&value);
            push_opt(&mut b, &fv, &null);
            b.arg(&mut flag);
            // SAFETY: `scale_check_finite(float*, u64, float, const float*, float*)`: matching
            // argument list; x holds n f32, the factor pointer (or null) and the flag one each;
            // distinct storages (checked).
            unsafe { b.launch(config_1d(n)) }
                .map_err(|e| launch_err("ops::scale_check_finite", e))?;
            Ok(())
        })
    })
}

/// The inf/NaN check alone, on the device: `found_inf = 1` when some element of `t` is
/// infinite or NaN (left alone otherwise); [`kernels::non_finite_reference`]. `t` is read only.
///
/// Arguments checked by [`crate::ops::check_finite_`].
///
/// Errors: a failed launch.
pub(in crate::ops) fn check_finite_(t: &Tensor, found_inf: &Tensor) -> Result<()> {
    const OP: &str = "check_finite_";
    let n = t.elem_count();
    let dev = device_of(OP, "tensor", t)?;
    if n == 0 {
        return Ok(());
    }
    let f = func(&dev, "ops", "non_finite")?;
    let cs = dev.cuda_stream();
    let (ts, tl) = t.storage_and_layout();
    let x = f32_view(cuda_storage(&ts, OP, "tensor")?, tl, OP, "tensor")?;
    with_mut(found_inf, OP, |fs, fl| {
        let mut flag = f32_view_mut(fs, fl, OP, "found_inf")?;
        let n64 = n as u64;
        let mut b = cs.launch_builder(&f);
        b.arg(&x);
        b.arg(&n64);
        b.arg(&mut flag);
        // SAFETY: `non_finite(const float*, u64, float*)`: matching argument list; x holds n
        // f32, the flag one; distinct storages (checked).
        unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("ops::non_finite", e))?;
        Ok(())
    })
}

/// `dst += src` in place: `dst` f32, `src` f32/bf16/f16 (widened exactly), same element count,
/// contiguous, distinct storages, one GPU; [`kernels::add_reference`].
///
/// Arguments checked by [`crate::ops::add_`].
///
/// Errors: a failed launch.
pub(in crate::ops) fn add_(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "add_";
    let n = dst.elem_count();
    let dev = device_of(OP, "dst", dst)?;
    if n == 0 {
        return Ok(());
    }
    let f = func(&dev, "ops", "add")?;
    let cs = dev.cuda_stream();
    let code = dtype_code(src.dtype()).expect("checked");
    with_mut2(dst, src, OP, |ds, dl, ss, sl| {
        let mut d = f32_view_mut(ds, dl, OP, "dst")?;
        let s = AnyView::new(ss, sl, OP, "src")?;
        let n64 = n as u64;
        let mut b = cs.launch_builder(&f);
        b.arg(&mut d);
        s.push(&mut b);
        b.arg(&code);
        b.arg(&n64);
        // SAFETY: `add(float*, const void*, u32, u64)`: matching argument list; both
        // views hold n elements (src of the dtype whose code is passed); distinct
        // storages (checked).
        unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("ops::add", e))?;
        Ok(())
    })?;
    Ok(())
}

/// The sum of squares of `t` (f32, contiguous) in f64, on the device, into `out` (a one-element
/// f64 tensor on the same GPU): `out = sum` or, with `accumulate`, `out += sum` (sums of several
/// tensors without a host read in between). Two launches: [`kernels::sum_squares_blocks`]`(n)`
/// partial sums, then one block; the order is fixed ([`kernels::sum_squares_reference`]).
///
/// Errors: `t` not a contiguous f32 tensor on a GPU; `out` not a one-element f64 tensor on the
/// same GPU, or sharing `t`'s storage; a failed launch.
pub fn sum_squares_into(t: &Tensor, out: &Tensor, accumulate: bool) -> Result<()> {
    const OP: &str = "sum_squares_into";
    let n = check_f32(OP, &[("tensor", t)])?;
    let dev = device_of(OP, "tensor", t)?;
    check_one(OP, "out", out, &dev, &[DType::F64])?;
    if out.elem_count() != 1 {
        return Err(crate::ops::bad(
            OP,
            "out",
            format!("must hold one element, found shape {:?}", out.dims()),
        ));
    }
    crate::ops::check_distinct(OP, &[("tensor", t), ("out", out)])?;
    let blocks = kernels::sum_squares_blocks(n);
    let stream = dev.cuda_stream();
    // SAFETY: the first launch writes every one of the `blocks` partials before the second
    // (same stream) reads them.
    let mut partial = unsafe { stream.alloc::<f64>(blocks as usize) }
        .map_err(|e| Error::Cuda(format!("{OP}: allocating partial sums: {e:?}")))?;
    let first = func(&dev, "ops", "sum_squares_partial")?;
    let second = func(&dev, "ops", "sum_squares_final")?;
    {
        let (ts, tl) = t.storage_and_layout();
        let x = f32_view(cuda_storage(&ts, OP, "tensor")?, tl, OP, "tensor")?;
        let n64 = n as u64;
        let mut b = stream.launch_builder(&first);
        b.arg(&x);
        b.arg(&n64);
        b.arg(&mut partial);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `sum_squares_partial(const float*, u64, double*)`: matching argument list;
        // x holds n f32 (n == 0 reads nothing), `partial` one f64 per block; block size
        // THREADS = REDUCE_THREADS of kernels/ops.cu.
        unsafe { b.launch(cfg) }.map_err(|e| launch_err("ops::sum_squares_partial", e))?;
    }
    let acc = u32::from(accumulate);
    with_mut(out, OP, |os, ol| {
        let (start, end) = range(ol, OP, "out")?;
        let mut o = os.as_cuda_slice_mut::<f64>()?.slice_mut(start..end);
        let mut b = stream.launch_builder(&second);
        b.arg(&partial);
        b.arg(&blocks);
        b.arg(&mut o);
        b.arg(&acc);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `sum_squares_final(const double*, u32, double*, u32)`: matching argument
        // list; `partial` holds `blocks` f64, `o` one; one block of REDUCE_THREADS threads.
        unsafe { b.launch(cfg) }.map_err(|e| launch_err("ops::sum_squares_final", e))?;
        Ok(())
    })
}

// ---- module `optim` ------------------------------------------------------------------------

/// One fused AdamW update in place over flat f32 tensors on a GPU ([`kernels::adamw_reference`];
/// [`crate::ops::adamw_step`]'s arithmetic, bit for bit): `param`, `exp_avg`, `exp_avg_sq`
/// written, `grad` read and multiplied by `u.inv_scale` in registers (not written back). When
/// `u.found_inf` is given and holds a non-zero value on the device, the kernel returns without
/// writing: the step is skipped without the host reading the flag.
///
/// Arguments checked by [`crate::ops::adamw_step_fused`] (f32, contiguous, one element count, one
/// GPU, distinct storages, scaler tensors one f32 element on that GPU).
///
/// Errors: a failed launch.
pub(in crate::ops) fn adamw_(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: &AdamWHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    const OP: &str = "adamw_";
    let n = param.elem_count();
    let dev = device_of(OP, "param", param)?;
    if n == 0 {
        return Ok(());
    }
    let f = func(&dev, "optim", "adamw")?;
    let cs = dev.cuda_stream();
    let args = AdamWArgs::from(h);
    let (value, dev_factor) = factor_parts(&u.inv_scale);
    let (gs, gl) = grad.storage_and_layout();
    let g = f32_view(cuda_storage(&gs, OP, "grad")?, gl, OP, "grad")?;
    let sg = guard(dev_factor);
    let sv = guard_view(&sg, OP, "inv_scale")?;
    let fg = guard(u.found_inf);
    let fv = guard_view(&fg, OP, "found_inf")?;
    let null = 0u64;
    with_mut(param, OP, |ps, pl| {
        let mut p = f32_view_mut(ps, pl, OP, "param")?;
        with_mut(exp_avg, OP, |ms, ml| {
            let mut m = f32_view_mut(ms, ml, OP, "exp_avg")?;
            with_mut(exp_avg_sq, OP, |vs, vl| {
                let mut v = f32_view_mut(vs, vl, OP, "exp_avg_sq")?;
                let n64 = n as u64;
                let mut b = cs.launch_builder(&f);
                b.arg(&mut p);
                b.arg(&g);
                b.arg(&mut m);
                b.arg(&mut v);
                b.arg(&n64);
                b.arg(&args);
                b.arg(&value);
                push_opt(&mut b, &sv, &null);
                push_opt(&mut b, &fv, &null);
                // SAFETY: `adamw(float*, const float*, float*, float*, u64, AdamWArgs, float,
                // const float*, const float*)`: matching argument list (AdamWArgs mirrors the C
                // struct); the four views hold n f32, the optional pointers one f32 or null;
                // distinct storages (checked).
                unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("optim::adamw", e))?;
                Ok(())
            })
        })
    })
}

/// One fused SGD update in place over flat f32 tensors on a GPU ([`kernels::sgd_reference`];
/// [`crate::ops::sgd_step`]'s arithmetic, bit for bit): `param` and, when `h.momentum != 0`,
/// `buf` (present exactly then) written; `grad` read and multiplied by `u.inv_scale`;
/// skipped on the device when `u.found_inf` holds a non-zero value. Arguments checked by
/// [`crate::ops::sgd_step_fused`].
///
/// Errors: a failed launch.
pub(in crate::ops) fn sgd_(
    param: &Tensor,
    grad: &Tensor,
    buf: Option<&Tensor>,
    h: &SgdHyper,
    u: &Unscale<'_>,
) -> Result<()> {
    const OP: &str = "sgd_";
    let n = param.elem_count();
    let dev = device_of(OP, "param", param)?;
    if n == 0 {
        return Ok(());
    }
    let f = func(&dev, "optim", "sgd")?;
    let cs = dev.cuda_stream();
    let args = SgdArgs::from(h);
    let (value, dev_factor) = factor_parts(&u.inv_scale);
    let (gs, gl) = grad.storage_and_layout();
    let g = f32_view(cuda_storage(&gs, OP, "grad")?, gl, OP, "grad")?;
    let sg = guard(dev_factor);
    let sv = guard_view(&sg, OP, "inv_scale")?;
    let fg = guard(u.found_inf);
    let fv = guard_view(&fg, OP, "found_inf")?;
    let null = 0u64;
    let n64 = n as u64;
    let launch = |p: &mut CudaViewMut<'_, f32>, bv: Option<&mut CudaViewMut<'_, f32>>| {
        let mut b = cs.launch_builder(&f);
        b.arg(p);
        b.arg(&g);
        match bv {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&n64);
        b.arg(&args);
        b.arg(&value);
        push_opt(&mut b, &sv, &null);
        push_opt(&mut b, &fv, &null);
        // SAFETY: `sgd(float*, const float*, float*, u64, SgdArgs, float, const float*,
        // const float*)`: matching argument list (SgdArgs mirrors the C struct); the views
        // hold n f32 (the buffer null exactly when momentum is 0), the optional pointers one
        // f32 or null; distinct storages (checked).
        unsafe { b.launch(config_1d(n)) }.map_err(|e| launch_err("optim::sgd", e))?;
        Ok(())
    };
    with_mut(param, OP, |ps, pl| {
        let mut p = f32_view_mut(ps, pl, OP, "param")?;
        match buf {
            None => launch(&mut p, None),
            Some(bt) => with_mut(bt, OP, |bs, bl| {
                let mut bv = f32_view_mut(bs, bl, OP, "momentum_buffer")?;
                launch(&mut p, Some(&mut bv))
            }),
        }
    })
}

/// The grad scaler's update on the device ([`kernels::update_scale_reference`],
/// `ShardedGradScaler`'s update, PyTorch's `_amp_update_scale_`): reads `found_inf`, updates
/// `scale` (one f32) and `growth_tracker` (one u32) in place and, when given, writes
/// `inv_scale = 1 / scale` (one f32) for the next unscale. No host read.
///
/// Errors: the tensors not one-element (f32; u32 for the tracker) on one GPU with distinct
/// storages; a failed launch.
pub fn update_scale_(
    scale: &Tensor,
    growth_tracker: &Tensor,
    found_inf: &Tensor,
    inv_scale: Option<&Tensor>,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
) -> Result<()> {
    const OP: &str = "update_scale_";
    let dev = device_of(OP, "scale", scale)?;
    check_scalar(OP, "scale", scale, &dev)?;
    check_scalar(OP, "found_inf", found_inf, &dev)?;
    check_one(OP, "growth_tracker", growth_tracker, &dev, &[DType::U32])?;
    if growth_tracker.elem_count() != 1 {
        return Err(crate::ops::bad(
            OP,
            "growth_tracker",
            format!(
                "must hold one element, found shape {:?}",
                growth_tracker.dims()
            ),
        ));
    }
    let mut all = vec![
        ("scale", scale),
        ("growth_tracker", growth_tracker),
        ("found_inf", found_inf),
    ];
    if let Some(t) = inv_scale {
        check_scalar(OP, "inv_scale", t, &dev)?;
        all.push(("inv_scale", t));
    }
    crate::ops::check_distinct(OP, &all)?;
    let f = func(&dev, "optim", "update_scale")?;
    let cs = dev.cuda_stream();
    let (fs, fl) = found_inf.storage_and_layout();
    let flag = f32_view(cuda_storage(&fs, OP, "found_inf")?, fl, OP, "found_inf")?;
    let null = 0u64;
    let launch = |s: &mut CudaViewMut<'_, f32>,
                  t: &mut CudaViewMut<'_, u32>,
                  inv: Option<&mut CudaViewMut<'_, f32>>| {
        let mut b = cs.launch_builder(&f);
        b.arg(s);
        b.arg(t);
        b.arg(&flag);
        match inv {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&growth_factor);
        b.arg(&backoff_factor);
        b.arg(&growth_interval);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `update_scale(float*, u32*, const float*, float*, float, float, u32)`:
        // matching argument list; every pointer one element (inv_scale possibly null); distinct
        // storages (checked).
        unsafe { b.launch(cfg) }.map_err(|e| launch_err("optim::update_scale", e))?;
        Ok(())
    };
    with_mut(scale, OP, |ss, sl| {
        let mut s = f32_view_mut(ss, sl, OP, "scale")?;
        with_mut(growth_tracker, OP, |ts, tl| {
            let (start, end) = range(tl, OP, "growth_tracker")?;
            let mut t = ts.as_cuda_slice_mut::<u32>()?.slice_mut(start..end);
            match inv_scale {
                None => launch(&mut s, &mut t, None),
                Some(it) => with_mut(it, OP, |is, il| {
                    let mut iv = f32_view_mut(is, il, OP, "inv_scale")?;
                    launch(&mut s, &mut t, Some(&mut iv))
                }),
            }
        })
    })
}
