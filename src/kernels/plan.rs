//! The kernels' by-value argument structs (`repr(C)` mirrors of the C structs of `kernels/`)
//! and the launch plans of `copy_in` / `copy_out`: which descriptors go into which launch, with
//! which grid, over a layout given as [`ParamSpan`]s. Plain data and pure functions, compiled
//! without feature `cuda`, so that the plans the GPU wrappers (`crate::ops::cuda`, feature
//! `cuda`) launch can be checked on any machine. Not an API: public only for those checks.
//!
//! The conversions from the optimizers' hyper-parameters (`crate::ops::AdamWHyper` →
//! [`AdamWArgs`], `SgdHyper` → [`SgdArgs`]) and from a `crate::flat_param::FlatParamLayout` (→
//! [`CopyLayout`]) live with those types: this module knows nothing above it.

use super::COPY_MAX_PARAMS;

/// Where one parameter lies in a flat buffer: its first flat index and its element count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamSpan {
    /// First flat index (alignment gaps may lie between parameters).
    pub offset: usize,
    /// Elements.
    pub numel: usize,
}

/// The geometry of one unit's flat buffer, as the copy kernels see it: its parameters' spans (in
/// layout order, increasing offsets), and the shard of each of `world_size` ranks
/// (`shard_numel` elements; `world_size × shard_numel` flat elements in all, padding included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyLayout {
    /// The parameters, in layout order.
    pub spans: Vec<ParamSpan>,
    /// Elements per rank's shard.
    pub shard_numel: usize,
    /// Ranks.
    pub world_size: usize,
}

impl CopyLayout {
    /// Flat elements, padding included: `world_size × shard_numel`.
    pub fn padded_numel(&self) -> usize {
        self.world_size * self.shard_numel
    }
}

/// `AdamWArgs` of `kernels/optim.cu` (`crate::ops::AdamWHyper`, field for field).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWArgs {
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// 1 − β1.
    pub one_minus_beta1: f32,
    /// 1 − β2.
    pub one_minus_beta2: f32,
    /// 1 / (1 − β1ᵗ).
    pub bias_correction1: f32,
    /// 1 / (1 − β2ᵗ).
    pub bias_correction2: f32,
    /// 1 − lr·λ.
    pub decay: f32,
    /// Learning rate.
    pub lr: f32,
    /// ε.
    pub eps: f32,
}

/// `SgdArgs` of `kernels/optim.cu` (`crate::ops::SgdHyper`; the bools as 0/1).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdArgs {
    /// Learning rate.
    pub lr: f32,
    /// μ.
    pub momentum: f32,
    /// 1 − τ.
    pub one_minus_dampening: f32,
    /// λ.
    pub weight_decay: f32,
    /// Nesterov (0/1).
    pub nesterov: u32,
    /// First step (0/1).
    pub first_step: u32,
}

/// `CopyInParam` of `kernels/copy.cu`: one parameter's region of a copy-in.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyInParam {
    /// Device address of the gradient's first element; 0 when absent.
    pub src: u64,
    /// First flat index of the region (the parameter's offset; 0 for the first parameter).
    pub offset: u64,
    /// Gradient elements at the start of the region.
    pub numel: u64,
    /// End of the region: the next parameter's offset, or the end of the flat elements.
    pub end: u64,
    /// Dtype code of the gradient.
    pub dtype: u32,
    /// 1 when the gradient is present.
    pub present: u32,
}

/// `CopyInArgs` of `kernels/copy.cu`: one launch of a copy-in.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyInArgs {
    /// `shard_numel`.
    pub shard_numel: u64,
    /// `world_size`.
    pub world_size: u32,
    /// Flags per chunk (every parameter of the unit).
    pub num_params: u32,
    /// Index in the unit of `params[0]`.
    pub first_param: u32,
    /// Parameters of this launch.
    pub count: u32,
    /// Dtype code of the buffer.
    pub out_dtype: u32,
    /// Padding (0).
    pub pad: u32,
    /// Descriptors (`count` used).
    pub params: [CopyInParam; COPY_MAX_PARAMS],
}

/// `CopyOutParam` of `kernels/copy.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyOutParam {
    /// Device address of the output's first element.
    pub dst: u64,
    /// Flat offset of the parameter in the gathered buffer.
    pub offset: u64,
    /// Elements.
    pub numel: u64,
}

/// `CopyOutArgs` of `kernels/copy.cu`: one launch of a copy-out.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOutArgs {
    /// Dtype code of the gathered buffer.
    pub src_dtype: u32,
    /// Dtype code of the outputs.
    pub dst_dtype: u32,
    /// Parameters of this launch.
    pub count: u32,
    /// Padding (0).
    pub pad: u32,
    /// Descriptors (`count` used).
    pub params: [CopyOutParam; COPY_MAX_PARAMS],
}

const _: () = {
    assert!(std::mem::size_of::<AdamWArgs>() == 36);
    assert!(std::mem::size_of::<SgdArgs>() == 24);
    assert!(std::mem::size_of::<CopyInParam>() == 40);
    assert!(std::mem::size_of::<CopyInArgs>() == 32 + 40 * COPY_MAX_PARAMS);
    assert!(std::mem::align_of::<CopyInArgs>() == 8);
    assert!(std::mem::size_of::<CopyOutArgs>() == 16 + 24 * COPY_MAX_PARAMS);
    // The kernel-parameter bank holds 4 KiB on every CUDA version; the buffer pointer is the
    // other 8 bytes.
    assert!(std::mem::size_of::<CopyInArgs>() + 8 <= 4096);
};

/// A 2-D launch grid `(x, y, 1)` (blocks of [`super::THREADS`] threads).
pub type Grid = (u32, u32, u32);

/// The launches of one copy-in: for gradient sources `srcs[q] = (address, dtype code)` of every
/// parameter of `layout` (address 0: absent) into a buffer of dtype code `out_dtype`, one
/// [`CopyInArgs`] per [`COPY_MAX_PARAMS`] parameters with its grid (`y`: the batch's parameters,
/// `x`: blocks over its longest region or the world size). Parameter `q`'s region runs from its
/// offset (0 for the first) to the next parameter's offset (the last: `padded_numel`), so the
/// launches write every flat element and every flag exactly once.
///
/// Panics when `srcs` is not one entry per parameter.
pub fn copy_in_plan(
    layout: &CopyLayout,
    srcs: &[(u64, u32)],
    out_dtype: u32,
) -> Vec<(CopyInArgs, Grid)> {
    let f = layout.spans.len();
    assert_eq!(srcs.len(), f, "one source per parameter");
    let mut plan = Vec::with_capacity(f.div_ceil(COPY_MAX_PARAMS));
    let mut first = 0;
    while first < f {
        let count = (f - first).min(COPY_MAX_PARAMS);
        let mut args = CopyInArgs {
            shard_numel: layout.shard_numel as u64,
            world_size: layout.world_size as u32,
            num_params: f as u32,
            first_param: first as u32,
            count: count as u32,
            out_dtype,
            pad: 0,
            params: [CopyInParam::default(); COPY_MAX_PARAMS],
        };
        let mut longest = layout.world_size;
        for j in 0..count {
            let q = first + j;
            let p = &layout.spans[q];
            let start = if q == 0 { 0 } else { p.offset };
            let end = layout
                .spans
                .get(q + 1)
                .map_or(layout.padded_numel(), |n| n.offset);
            let (src, dtype) = srcs[q];
            args.params[j] = CopyInParam {
                src,
                offset: start as u64,
                numel: (p.offset + p.numel - start) as u64,
                end: end as u64,
                dtype,
                present: u32::from(src != 0),
            };
            longest = longest.max(end - start);
        }
        plan.push((args, (super::elementwise_blocks(longest), count as u32, 1)));
        first += count;
    }
    plan
}

/// The launches of one copy-out: parameter `q` of `spans` into the output at address
/// `dsts[q]`, from a gathered buffer of dtype code `src_dtype` into outputs of `dst_dtype`; one
/// [`CopyOutArgs`] per [`COPY_MAX_PARAMS`] parameters with its grid (`y`: the batch's
/// parameters, `x`: blocks over its largest).
///
/// Panics when `dsts` is not one entry per parameter.
pub fn copy_out_plan(
    spans: &[ParamSpan],
    dsts: &[u64],
    src_dtype: u32,
    dst_dtype: u32,
) -> Vec<(CopyOutArgs, Grid)> {
    let f = spans.len();
    assert_eq!(dsts.len(), f, "one destination per parameter");
    let mut plan = Vec::with_capacity(f.div_ceil(COPY_MAX_PARAMS));
    let mut first = 0;
    while first < f {
        let count = (f - first).min(COPY_MAX_PARAMS);
        let mut args = CopyOutArgs {
            src_dtype,
            dst_dtype,
            count: count as u32,
            pad: 0,
            params: [CopyOutParam::default(); COPY_MAX_PARAMS],
        };
        let mut longest = 1;
        for j in 0..count {
            let p = &spans[first + j];
            args.params[j] = CopyOutParam {
                dst: dsts[first + j],
                offset: p.offset as u64,
                numel: p.numel as u64,
            };
            longest = longest.max(p.numel);
        }
        plan.push((args, (super::elementwise_blocks(longest), count as u32, 1)));
        first += count;
    }
    plan
}
