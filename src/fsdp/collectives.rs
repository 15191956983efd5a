//! Copy-in, all-gather, copy-out and reduce-scatter of one unit, as free functions over buffers
//! (FSDP2's `_fsdp_collectives.py`): they know layouts and dtypes, nothing of modules, autograd
//! schedules or training state. This is the only place that turns gathered buffers into
//! parameters and gradients into a reduce-scatter buffer.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::storage;
use crate::comm::{CommBuffer, ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, FlatParameter};
use crate::ops::with_host_f32;

/// Issues the all-gather of `flat`'s shard in `dtype` (copy-in: the f32 master shard is cast to
/// `dtype` first, so the wire carries `dtype`). When `real` is false (world size 1 or an empty
/// unit: see `FsdpUnit::gathers`) the cast shard *is* the unsharded buffer and no collective runs.
pub(crate) fn all_gather_shard(
    pg: &dyn ProcessGroup,
    flat: &FlatParameter,
    dtype: DType,
    real: bool,
) -> Work<CommBuffer> {
    let input = match with_host_f32(flat.shard(), |s| CommBuffer::from_f32(s, dtype)) {
        Ok(Ok(b)) => b,
        Ok(Err(e)) | Err(e) => return Work::ready(Err(e)),
    };
    if !real {
        return Work::ready(Ok(input));
    }
    match CommBuffer::zeros(dtype, flat.layout().padded_numel) {
        Ok(out) => pg.all_gather(input, out),
        Err(e) => Work::ready(Err(e)),
    }
}

/// Waits for a gather and returns the unsharded flat buffer as one 1-D tensor of
/// `padded_numel` elements on `device` (the buffer moves into the tensor: no copy on CPU).
pub(crate) fn wait_gathered(work: Work<CommBuffer>, device: &Device) -> Result<Tensor> {
    let full = work.wait()?;
    let n = full.len();
    Ok(match full {
        CommBuffer::F32(v) => Tensor::from_vec(v, n, device)?,
        CommBuffer::BF16(v) => Tensor::from_vec(v, n, device)?,
        CommBuffer::F16(v) => Tensor::from_vec(v, n, device)?,
    })
}

/// Copy-out without a copy: each parameter as a view (narrow + reshape) of the gathered flat
/// buffer, keyed by full name. For forwards without autograd (eval, activation checkpointing).
pub(crate) fn param_views(
    layout: &FlatParamLayout,
    flat: &Tensor,
) -> Result<HashMap<String, Tensor>> {
    layout
        .params
        .iter()
        .map(|p| {
            let view = flat
                .narrow(0, p.offset, p.numel)?
                .reshape(p.shape.clone())?;
            Ok((p.name.clone(), view))
        })
        .collect()
}

/// Copy-out into fresh autograd variables, one per parameter (in layout order), each a contiguous
/// copy of its range of the gathered buffer. Per-parameter variables rather than views of one flat
/// variable: Candle's `narrow` backward would pad every parameter's gradient to the whole flat
/// size (design decision 2).
pub(crate) fn param_vars(layout: &FlatParamLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    layout
        .params
        .iter()
        .map(|p| {
            let view = flat
                .narrow(0, p.offset, p.numel)?
                .reshape(p.shape.clone())?;
            Ok(Var::from_tensor(&view)?.into_inner())
        })
        .collect()
}

/// Refills the freed storage of `params` (variables from [`param_vars`], in layout order) from
/// the gathered buffer, in place: the autograd graph that references them sees the values again.
pub(crate) fn refill_params(
    layout: &FlatParamLayout,
    flat: &Tensor,
    params: &[Tensor],
) -> Result<()> {
    for (p, t) in layout.params.iter().zip(params) {
        storage::refill(t, &flat.narrow(0, p.offset, p.numel)?)?;
    }
    Ok(())
}

/// Frees the storage of `params` in place (reshard under a live graph).
pub(crate) fn free_params(params: &[Tensor]) -> Result<()> {
    params.iter().try_for_each(storage::free)
}

/// Copy-in: the parameter gradients of one unit (from `grads`, for the variables `params` in
/// layout order) into one padded flat f32 buffer of `padded_numel` elements; zeros where a
/// parameter got no gradient and in gaps and padding. `None` for a unit without parameters.
pub(crate) fn flatten_grads(
    layout: &FlatParamLayout,
    grads: Option<&GradStore>,
    params: &[Tensor],
) -> Result<Option<Vec<f32>>> {
    if layout.padded_numel == 0 {
        return Ok(None);
    }
    let mut flat = vec![0.0f32; layout.padded_numel];
    if let Some(grads) = grads {
        for (p, t) in layout.params.iter().zip(params) {
            if let Some(g) = grads.get(t) {
                copy_into(g, &mut flat[p.offset..p.offset + p.numel])?;
            }
        }
    }
    Ok(Some(flat))
}

/// Issues the reduction of one unit's flat gradient in `dtype` (cast first: the wire carries
/// `reduce_dtype`): reduce-scatter (average) into this rank's shard when the unit is sharded,
/// all-reduce (average) under NO_SHARD, nothing at world size 1.
pub(crate) fn reduce_grads(
    pg: &dyn ProcessGroup,
    layout: &FlatParamLayout,
    flat_grad: Vec<f32>,
    dtype: DType,
) -> Work<CommBuffer> {
    let input = if dtype == DType::F32 {
        CommBuffer::F32(flat_grad)
    } else {
        match CommBuffer::from_f32(&flat_grad, dtype) {
            Ok(b) => b,
            Err(e) => return Work::ready(Err(e)),
        }
    };
    if pg.world_size() == 1 {
        return Work::ready(Ok(input));
    }
    if layout.world_size == 1 {
        return pg.all_reduce(input, ReduceOp::Avg);
    }
    match CommBuffer::zeros(dtype, layout.shard_numel) {
        Ok(out) => pg.reduce_scatter(input, out, ReduceOp::Avg),
        Err(e) => Work::ready(Err(e)),
    }
}

/// Waits for a gradient reduction and returns the reduced shard (in `reduce_dtype`) as a 1-D
/// tensor on `device`.
pub(crate) fn wait_reduced(work: Work<CommBuffer>, device: &Device) -> Result<Tensor> {
    let reduced = work.wait()?;
    let n = reduced.len();
    Ok(match reduced {
        CommBuffer::F32(v) => Tensor::from_vec(v, n, device)?,
        CommBuffer::BF16(v) => Tensor::from_vec(v, n, device)?,
        CommBuffer::F16(v) => Tensor::from_vec(v, n, device)?,
    })
}

/// Copies a tensor's values (as f32, row-major) into `out`, whose length must be its element
/// count.
pub(crate) fn copy_into(t: &Tensor, out: &mut [f32]) -> Result<()> {
    if t.elem_count() != out.len() {
        return Err(Error::InvalidArgument(format!(
            "gradient has {} elements, its parameter {}",
            t.elem_count(),
            out.len()
        )));
    }
    let t = if t.dtype() == DType::F32 {
        t.clone()
    } else {
        t.to_dtype(DType::F32)?
    };
    let t = if t.is_contiguous() {
        t
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => {
            let s = cpu.as_slice::<f32>()?;
            let start = layout.start_offset();
            out.copy_from_slice(&s[start..start + out.len()]);
            Ok(())
        }
        _ => {
            drop(storage);
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            out.copy_from_slice(&v);
            Ok(())
        }
    }
}
