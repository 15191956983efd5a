//! Copy-in, all-gather, copy-out and reduce-scatter of one unit, as free functions over buffers
//! (FSDP2's `_fsdp_collectives.py`): they know layouts and dtypes, nothing of modules, autograd
//! schedules or training state. This is the only place that turns gathered buffers into
//! parameters and gradients into a reduce-scatter buffer.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::config::CommStreams;
use super::mesh::Mesh;
use super::storage;
use crate::comm::{CommStream, ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::flat_param::{FlatParamLayout, FlatParameter, ParamInfo};
use crate::quant::BaseDType;

/// The groups and comm streams FSDP runs its collectives on (FSDP2's comm context): the
/// runtime creates them from the world group when the model is built and decides which op runs
/// where.
pub(crate) struct CommContext {
    /// The shard group, the replica group (hybrid) and this rank's place in them.
    pub mesh: Mesh,
    /// Parameter all-gathers (unshard), in issue order, on the shard group.
    pub all_gather: CommStream,
    /// Gradient reductions (reduce-scatter; all-reduce under NO_SHARD) on the shard group: a
    /// stream of their own, so that they never queue behind an all-gather, or, with
    /// [`CommStreams::Shared`], the all-gathers' stream itself.
    pub reduce_scatter: CommStream,
    /// Hybrid only: the all-reduce of the reduced shards across replicas, on the replica group,
    /// so that it never queues behind the next reduce-scatter.
    pub all_reduce: Option<CommStream>,
    /// Partial reshard after forward only: the backward's all-gathers inside the secondary
    /// group.
    pub all_gather_secondary: Option<CommStream>,
}

impl CommContext {
    /// Creates the streams on `mesh`'s groups (a collective: every rank builds its models in
    /// the same order), the reductions' own unless `streams` shares the all-gathers'. `streams`
    /// is the build's resolved value ([`CommStreams::resolve`] over the world group, so that
    /// every rank's agreement compared it): `Auto` is not resolved again here.
    pub(crate) fn new(mesh: Mesh, streams: CommStreams) -> Result<Self> {
        debug_assert_ne!(streams, CommStreams::Auto, "resolved at build");
        let all_gather = mesh.shard.new_stream("all_gather")?;
        Ok(Self {
            reduce_scatter: match streams {
                CommStreams::Shared => all_gather.clone(),
                CommStreams::Separate | CommStreams::Auto => {
                    mesh.shard.new_stream("reduce_scatter")?
                }
            },
            all_gather,
            all_reduce: match &mesh.replica {
                Some(g) => Some(g.new_stream("all_reduce_replicas")?),
                None => None,
            },
            all_gather_secondary: match &mesh.secondary {
                Some(g) => Some(g.new_stream("all_gather_secondary")?),
                None => None,
            },
            mesh,
        })
    }

    /// The group parameters are sharded over.
    pub(crate) fn shard_pg(&self) -> &dyn ProcessGroup {
        self.mesh.shard.as_ref()
    }

    /// The secondary group of a partial reshard after forward and its stream.
    pub(crate) fn secondary(&self) -> Option<(&dyn ProcessGroup, &CommStream)> {
        self.mesh
            .secondary
            .as_deref()
            .zip(self.all_gather_secondary.as_ref())
    }
}

/// Issues the all-gather of `flat`'s shard in `dtype` on `stream` (copy-in: the f32 master
/// shard is cast to `dtype` on its device first, so the wire carries `dtype`; in f32 the shard
/// itself is the input, no copy). When `real` is false (world size 1 or an empty unit: see
/// `ParamGroup::gathers`) the cast shard *is* the unsharded buffer and no collective runs.
pub(crate) fn all_gather_shard(
    pg: &dyn ProcessGroup,
    stream: &CommStream,
    flat: &FlatParameter,
    dtype: DType,
    real: bool,
) -> Work<Tensor> {
    let input = match crate::alloc::in_shared(|| flat.shard().to_dtype(dtype)) {
        Ok(t) => t,
        Err(e) => return Work::ready(Err(e.into())),
    };
    if !real {
        return Work::ready(Ok(input));
    }
    // SAFETY: the all-gather writes every element of its output (world_size shards of
    // `shard_numel` each, checked by the backend) before `wait` hands it out; on error the
    // buffer is dropped unread. Skipping the zero-fill saves a pass over the unit per gather.
    match unsafe { Tensor::empty(flat.layout().padded_numel, dtype, flat.shard().device()) } {
        Ok(out) => pg.all_gather(stream, &input, out),
        Err(e) => Work::ready(Err(e.into())),
    }
}

/// Issues the all-gather of a packed shard's bytes (`u8`, [`crate::quant`]) on `stream`: the
/// wire carries the packed bytes; the output is every rank's packed shard in rank order,
/// dequantised by [`unpack_gathered`]. When `real` is false the shard's bytes are the output.
pub(crate) fn all_gather_packed(
    pg: &dyn ProcessGroup,
    stream: &CommStream,
    bytes: &Tensor,
    real: bool,
) -> Work<Tensor> {
    if !real {
        return Work::ready(Ok(bytes.clone()));
    }
    let n = bytes.elem_count() * pg.world_size();
    // SAFETY: as in `all_gather_shard`: the all-gather writes every byte before `wait`.
    match unsafe { Tensor::empty(n, DType::U8, bytes.device()) } {
        Ok(out) => pg.all_gather(stream, bytes, out),
        Err(e) => Work::ready(Err(e.into())),
    }
}

/// Dequantises gathered packed shards (`layout.world_size` segments of
/// `format.packed_bytes(shard_numel)` bytes, rank order, as [`all_gather_packed`] returns
/// them; one segment when the group does not gather) into the unsharded flat buffer: 1-D,
/// `padded_numel` elements of `dtype`, on the bytes' device (off the CPU through the host).
///
/// Errors: a byte count that is not a whole number of segments; a failed transfer.
pub(crate) fn unpack_gathered(
    format: BaseDType,
    gathered: &Tensor,
    layout: &FlatParamLayout,
    dtype: DType,
) -> Result<Tensor> {
    let shard = layout.shard_numel;
    let seg = format.packed_bytes(shard);
    // The bytes borrowed from the gathered buffer (a host copy only off the CPU).
    let out = crate::ops::with_host_u8(gathered, |bytes| -> Result<Vec<f32>> {
        let segments = bytes.len().checked_div(seg).unwrap_or(0);
        if seg * segments != bytes.len() || segments * shard > layout.padded_numel {
            return Err(Error::shape(
                "gathered packed shards",
                format!(
                    "whole {}-byte {} segments of {shard} elements",
                    seg,
                    format.name()
                ),
                format!("{} bytes", bytes.len()),
            ));
        }
        let mut out = vec![0f32; segments * shard];
        for (o, b) in out
            .chunks_exact_mut(shard.max(1))
            .zip(bytes.chunks_exact(seg.max(1)))
        {
            crate::quant::unpack(format, b, o)?;
        }
        Ok(out)
    })??;
    let n = out.len();
    let t = Tensor::from_vec(out, n, gathered.device())?;
    Ok(if dtype == DType::F32 {
        t
    } else {
        t.to_dtype(dtype)?
    })
}

/// `gather` (packed bytes, [`all_gather_packed`]) followed by [`unpack_gathered`] on a helper
/// thread as soon as the bytes arrive, so that the dequantisation overlaps the compute the way
/// an f32 gather's copy does on its comm thread: the returned work yields the unsharded flat
/// buffer. Off the CPU (where the bytes would cross to the host) `gather` is returned as is and
/// the wait dequantises. `rank` names the work in an error.
pub(crate) fn unpack_when_gathered(
    gather: Work<Tensor>,
    format: BaseDType,
    layout: FlatParamLayout,
    dtype: DType,
    rank: usize,
) -> Work<Tensor> {
    if gather.is_completed() {
        // Nothing to overlap with (no gather, world size 1): at the wait, on the compute thread.
        return gather;
    }
    let (work, done) = Work::pending("dequantise", rank, "unpack");
    std::thread::spawn(move || {
        let result = gather.wait().and_then(|g| {
            if g.device().is_cpu() {
                unpack_gathered(format, &g, &layout, dtype)
            } else {
                Ok(g)
            }
        });
        done.complete(result);
    });
    work
}

/// This rank's piece of a gathered flat buffer for a partial reshard after forward: the
/// `rank`-th of `pg`'s `world_size` equal chunks, copied (the gathered buffer is dropped).
pub(crate) fn secondary_piece(pg: &dyn ProcessGroup, flat: &Tensor) -> Result<Tensor> {
    let n = flat.elem_count() / pg.world_size();
    // `force_contiguous`: a buffer of the piece's size (`copy` would clone the whole gathered
    // storage behind the view and keep it alive).
    Ok(crate::alloc::in_shared(|| {
        flat.narrow(0, pg.rank() * n, n)?.force_contiguous()
    })?)
}

/// Issues the all-gather of [`secondary_piece`]s inside their group on `stream`: the full flat
/// buffer again, bit for bit the one they were cut from.
pub(crate) fn all_gather_secondary(
    pg: &dyn ProcessGroup,
    stream: &CommStream,
    piece: &Tensor,
) -> Work<Tensor> {
    let n = piece.elem_count() * pg.world_size();
    // SAFETY: as in `all_gather_shard`: the all-gather writes every element before `wait`.
    match unsafe { Tensor::empty(n, piece.dtype(), piece.device()) } {
        Ok(out) => pg.all_gather(stream, piece, out),
        Err(e) => Work::ready(Err(e.into())),
    }
}

/// Waits for a gather and returns the unsharded flat buffer (1-D, `padded_numel` elements).
pub(crate) fn wait_gathered(work: Work<Tensor>) -> Result<Tensor> {
    work.wait()
}

/// One parameter as a view (narrow + reshape, no copy) of the gathered flat buffer.
fn view(p: &ParamInfo, flat: &Tensor) -> Result<Tensor> {
    Ok(flat
        .narrow(0, p.offset, p.numel)?
        .reshape(p.shape.clone())?)
}

/// Copy-out without a copy: each parameter as a view of the gathered flat buffer, keyed by full
/// name. For forwards without autograd (eval, activation checkpointing).
pub(crate) fn param_views(
    layout: &FlatParamLayout,
    flat: &Tensor,
) -> Result<HashMap<String, Tensor>> {
    layout
        .params
        .iter()
        .map(|p| Ok((p.name.clone(), view(p, flat)?)))
        .collect()
}

/// Copy-out without a copy for a training step whose parameters are read only by fused nodes
/// ([`super::param_group::ParamGroup`]'s views binding): each parameter as a detached view of
/// `flat` (sharing its storage, no autograd edge), in layout order.
pub(crate) fn param_detached_views(layout: &FlatParamLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    layout
        .params
        .iter()
        .map(|p| Ok(view(p, flat)?.detach()))
        .collect()
}

/// Copy-out into fresh autograd variables, one per parameter (in layout order), each a contiguous
/// copy of its range of the gathered buffer. Per-parameter variables rather than views of one flat
/// variable: Candle's `narrow` backward would pad every parameter's gradient to the whole flat
/// size (design decision 2).
pub(crate) fn param_vars(layout: &FlatParamLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    // On a GPU: every parameter's copy in one launch (kernels/copy.cu), created as variables.
    #[cfg(feature = "cuda")]
    if crate::device::is_cuda(flat.device()) {
        return crate::ops::cuda::copy_out(layout, flat, flat.dtype(), true, None);
    }
    layout
        .params
        .iter()
        .map(|p| Ok(Var::from_tensor(&view(p, flat)?)?.into_inner()))
        .collect()
}

/// Copy-out into plain tensors without gradient (frozen parameters), one compact copy per
/// parameter (in layout order), whose storage can be freed and refilled like a variable's.
pub(crate) fn param_copies(layout: &FlatParamLayout, flat: &Tensor) -> Result<Vec<Tensor>> {
    #[cfg(feature = "cuda")]
    if crate::device::is_cuda(flat.device()) {
        return crate::ops::cuda::copy_out(layout, flat, flat.dtype(), false, None);
    }
    layout
        .params
        .iter()
        .map(|p| Ok(view(p, flat)?.force_contiguous()?))
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
/// layout order; parameters past the end of `params` have none) into one flat f32 reduction buffer on `flat`'s device, in one device
/// concatenation of each gradient widened to f32 and the zero gaps between them (zeros too
/// where a parameter got no gradient, and for the final padding), so each element is written
/// once. `None` for a unit without parameters.
///
/// The buffer carries the gradient *presence* with it: after each of the layout's
/// `world_size` chunks of `shard_numel` elements come `F` flags (F = number of parameters,
/// 1.0 where the parameter received a gradient, 0.0 where its zeros stand for "absent"), so
/// the buffer has `world_size × (shard_numel + F)` elements and the reduction that gives each
/// rank its chunk also gives it every parameter's flag summed (averaged) over the ranks: a
/// flag > 0 means some rank produced a gradient. No extra collective, no extra copy
/// ([`split_reduced`] takes them apart).
///
/// Also returns this rank's own flags on the host: where every one is set, every parameter has
/// a gradient whatever the other ranks had, so the reduced flags need not be read back (on a
/// GPU, a device-to-host read that would block the host; see [`split_reduced`]).
pub(crate) fn flatten_grads(
    flat: &FlatParameter,
    grads: Option<&GradStore>,
    params: &[Tensor],
) -> Result<Option<(Tensor, Vec<bool>)>> {
    let layout = flat.layout();
    if layout.padded_numel == 0 {
        return Ok(None);
    }
    let device = flat.shard().device();
    // On a GPU: the whole buffer, flags included, in one launch per 64 parameters
    // (kernels/copy.cu), the same layout and values; no host-to-device copy.
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        let gs: Vec<Option<Tensor>> = (0..layout.params.len())
            .map(|i| {
                grads
                    .zip(params.get(i))
                    .and_then(|(g, t)| g.get(t))
                    .map(Tensor::detach)
            })
            .collect();
        let local: Vec<bool> = gs.iter().map(Option::is_some).collect();
        let refs: Vec<Option<&Tensor>> = gs.iter().map(Option::as_ref).collect();
        return Ok(
            crate::ops::cuda::copy_in(layout, &refs, DType::F32, dev, None)?.map(|t| (t, local)),
        );
    }
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, device);
    let mut segments = Vec::with_capacity(2 * layout.params.len() + 1);
    let mut present = Vec::with_capacity(layout.params.len());
    let mut at = 0;
    for (i, p) in layout.params.iter().enumerate() {
        if p.offset > at {
            segments.push(zeros(p.offset - at)?);
        }
        let g = grads.zip(params.get(i)).and_then(|(g, t)| g.get(t));
        present.push(if g.is_some() { 1.0f32 } else { 0.0 });
        segments.push(match g {
            // Detached: a gradient that Candle's backward computed from tracked tensors keeps
            // their graph (the unit's activations and gathered parameters) alive through the
            // flat gradient otherwise; at world size 1, where the flat gradient is kept as the
            // gradient shard, that held every block's activations to the end of the step.
            Some(g) => g.detach().to_dtype(DType::F32)?.flatten_all()?,
            None => zeros(p.numel)?,
        });
        at = p.offset + p.numel;
    }
    if layout.padded_numel > at {
        segments.push(zeros(layout.padded_numel - at)?);
    }
    let local: Vec<bool> = present.iter().map(|&p| p > 0.0).collect();
    let flags = Tensor::from_vec(present, layout.params.len(), device)?;
    // Cut the segments at the chunk boundaries and put the flags after each chunk.
    let shard = layout.shard_numel;
    let mut pieces = Vec::with_capacity(segments.len() + 2 * layout.world_size);
    let (mut pos, mut boundary) = (0, shard);
    for seg in segments {
        let (mut from, len) = (0, seg.elem_count());
        while from < len {
            let take = (len - from).min(boundary - pos);
            pieces.push(if from == 0 && take == len {
                seg.clone()
            } else {
                seg.narrow(0, from, take)?
            });
            from += take;
            pos += take;
            if pos == boundary {
                pieces.push(flags.clone());
                boundary += shard;
            }
        }
    }
    // In the shared arena under shm: the reduce-scatter's peers read it in place.
    let flat = crate::alloc::in_shared(|| Tensor::cat(&pieces, 0))?;
    Ok(Some((flat, local)))
}

/// Splits a reduced chunk of a [`flatten_grads`] buffer (`shard_numel + F` elements) into the
/// gradient shard (`shard_numel` elements, a view) and each parameter's presence (its reduced
/// flag > 0). With `all_local` (this rank had every gradient) every flag is known to be set and
/// nothing is read back from the device.
pub(crate) fn split_reduced(
    layout: &FlatParamLayout,
    reduced: Tensor,
    all_local: bool,
) -> Result<(Tensor, Vec<bool>)> {
    let (n, f) = (layout.shard_numel, layout.params.len());
    if all_local {
        return Ok((reduced.narrow(0, 0, n)?, vec![true; f]));
    }
    let flags = crate::device::read_small::<f32>(&reduced.narrow(0, n, f)?.to_dtype(DType::F32)?)?;
    Ok((
        reduced.narrow(0, 0, n)?,
        flags.into_iter().map(|v| v > 0.0).collect(),
    ))
}

/// Issues the reduction of one unit's [`flatten_grads`] buffer on `stream`, in its dtype (the
/// caller has cast it to the unit's `reduce_dtype`: the wire carries that): reduce-scatter
/// (average) into this rank's chunk (shard and presence flags) when the unit is sharded,
/// all-reduce (average) under NO_SHARD, nothing at world size 1. With `to_replicas` (a hybrid
/// mesh) the reduced chunk is made in the shared arena: the replica all-reduce reads it
/// ([`crate::alloc::in_shared`]; elsewhere it is private, and kept out of the arena so that
/// its memory serves the next step's activations).
pub(crate) fn reduce_grads(
    pg: &dyn ProcessGroup,
    stream: &CommStream,
    layout: &FlatParamLayout,
    input: Tensor,
    to_replicas: bool,
) -> Work<Tensor> {
    if pg.world_size() == 1 {
        return Work::ready(Ok(input));
    }
    if layout.world_size == 1 {
        return pg.all_reduce(stream, input, ReduceOp::Avg);
    }
    // SAFETY: the reduce-scatter writes every element of its output before `wait` hands it
    // out; on error the buffer is dropped unread.
    let chunk = layout.shard_numel + layout.params.len();
    let empty = || unsafe { Tensor::empty(chunk, input.dtype(), input.device()) };
    let out = match to_replicas {
        true => crate::alloc::in_shared(empty),
        false => empty(),
    };
    match out {
        Ok(out) => pg.reduce_scatter(stream, &input, out, ReduceOp::Avg),
        Err(e) => Work::ready(Err(e.into())),
    }
}

/// Issues the all-reduce (average) of one reduced chunk (the output of [`reduce_grads`]: shard
/// and presence flags) across the replicas of a hybrid mesh on `stream`: every replica then holds
/// the gradient averaged over the whole world.
pub(crate) fn all_reduce_replicas(
    replicas: &dyn ProcessGroup,
    stream: &CommStream,
    reduced: Tensor,
) -> Work<Tensor> {
    replicas.all_reduce(stream, reduced, ReduceOp::Avg)
}

/// Waits for a gradient reduction and returns the reduced shard (1-D, in `reduce_dtype`).
pub(crate) fn wait_reduced(work: Work<Tensor>) -> Result<Tensor> {
    work.wait()
}
