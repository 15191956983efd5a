// Module `ops`: the element-wise kernels and reductions of src/ops.rs over flat f32 tensors
// (in-place scaling, the grad scaler's unscale with its inf/NaN check, gradient accumulation,
// the finiteness check, the sum of squares of gradient clipping). References: `kernels::
// scale_reference`, `scale_check_finite_reference`, `non_finite_reference`, `add_reference`,
// `sum_squares_reference` (src/kernels/mod.rs).
//
// Preceded by common.cuh (conversions, dtype codes, GRID_STRIDE, is_finite_f32, factor).

// Threads per block of the reductions below (the wrapper launches exactly this many).
#define REDUCE_THREADS 256

// x[i] = x[i] * s (IEEE product, as ops::scale_'s CPU loop).
// Launch: 1-D, any grid, any block size.
extern "C" __global__ void scale(float* x, u64 n, float s) {
    GRID_STRIDE(i, n) {
        x[i] = __fmul_rn(x[i], s);
    }
}

// The grad scaler's unscale with its inf/NaN check, on the device:
// x[i] = x[i] * f with f = *s_ptr when s_ptr is given, else s; when any product is infinite or
// NaN, *found_inf = 1.0f (never written otherwise: the flag accumulates over calls and is
// zeroed by its owner; PyTorch's _amp_foreach_non_finite_check_and_unscale_).
// Launch: 1-D, any grid, any block size (every thread of a block must reach __syncthreads_or).
extern "C" __global__ void scale_check_finite(float* x, u64 n, float s, const float* s_ptr,
                                              float* found_inf) {
    const float f = factor(s, s_ptr);
    int bad = 0;
    GRID_STRIDE(i, n) {
        const float v = __fmul_rn(x[i], f);
        x[i] = v;
        bad |= is_finite_f32(v) ? 0 : 1;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
        *found_inf = 1.0f;
    }
}

// The inf/NaN check alone: *found_inf = 1.0f when some x[i] is infinite or NaN (else not
// written). Launch: as scale_check_finite.
extern "C" __global__ void non_finite(const float* x, u64 n, float* found_inf) {
    int bad = 0;
    GRID_STRIDE(i, n) {
        bad |= is_finite_f32(x[i]) ? 0 : 1;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
        *found_inf = 1.0f;
    }
}

template <u32 SD>
__device__ __forceinline__ void add_impl(float* dst, const void* src, u64 n) {
    GRID_STRIDE(i, n) {
        dst[i] = __fadd_rn(dst[i], load_f32<SD>(src, i));
    }
}

// dst[i] = dst[i] + widen(src[i]), src of dtype code src_dtype (widening is exact).
// Launch: 1-D, any grid, any block size.
extern "C" __global__ void add(float* dst, const void* src, u32 src_dtype, u64 n) {
    switch (src_dtype) {
    case DT_BF16:
        add_impl<DT_BF16>(dst, src, n);
        break;
    case DT_F16:
        add_impl<DT_F16>(dst, src, n);
        break;
    default:
        add_impl<DT_F32>(dst, src, n);
        break;
    }
}

// Sum of a block's values, returned to thread 0 (warp shuffles, then one warp over the warps'
// sums): a fixed order for a fixed block size, so results are reproducible.
__device__ __forceinline__ double block_sum(double v) {
    __shared__ double warp_sums[REDUCE_THREADS / 32];
    for (int off = 16; off > 0; off >>= 1) {
        v = __dadd_rn(v, __shfl_down_sync(0xFFFFFFFFu, v, off));
    }
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    if (lane == 0u) {
        warp_sums[warp] = v;
    }
    __syncthreads();
    if (warp == 0u) {
        v = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) {
            v = __dadd_rn(v, __shfl_down_sync(0xFFFFFFFFu, v, off));
        }
    }
    return v;
}

// First pass of the sum of squares: partial[blockIdx.x] = sum over this block's grid-stride
// elements of (double)x[i] * (double)x[i] (each square exact in f64: 24 + 24 bits < 53).
// Launch: 1-D, block REDUCE_THREADS, grid = number of partials (<= 1024).
extern "C" __global__ void sum_squares_partial(const float* x, u64 n, double* partial) {
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        const double d = (double)x[i];
        acc = __dadd_rn(acc, __dmul_rn(d, d));
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = acc;
    }
}

// Second pass: out[0] = (accumulate ? out[0] : 0) + sum of partial[0..count), so sums of several
// tensors can accumulate on the device without a host read in between.
// Launch: one block of REDUCE_THREADS threads.
extern "C" __global__ void sum_squares_final(const double* partial, u32 count, double* out,
                                             u32 accumulate) {
    double acc = 0.0;
    for (u32 i = threadIdx.x; i < count; i += blockDim.x) {
        acc = __dadd_rn(acc, partial[i]);
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
        out[0] = accumulate != 0u ? __dadd_rn(out[0], acc) : acc;
    }
}
