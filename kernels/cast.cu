// Module `cast`: element-type conversion between f32, bf16 and f16 (the mixed-precision cast of
// a shard before its all-gather, of a flat gradient before its reduce-scatter, of a reduced
// shard back to f32). Reference: `kernels::cast_reference` (src/kernels/mod.rs).
//
// Preceded by common.cuh (conversions, dtype codes, GRID_STRIDE).

template <u32 S, u32 D>
__device__ __forceinline__ void cast_impl(const void* src, void* dst, u64 n) {
    GRID_STRIDE(i, n) {
        convert<S, D>(src, i, dst, i);
    }
}

template <u32 S>
__device__ __forceinline__ void cast_from(const void* src, void* dst, u32 dst_dtype, u64 n) {
    switch (dst_dtype) {
    case DT_BF16:
        cast_impl<S, DT_BF16>(src, dst, n);
        break;
    case DT_F16:
        cast_impl<S, DT_F16>(src, dst, n);
        break;
    default:
        cast_impl<S, DT_F32>(src, dst, n);
        break;
    }
}

// dst[i] = convert(src[i]) for i < n: widening (bf16/f16 -> f32) is exact, narrowing rounds to
// nearest even; f16 <-> bf16 goes through f32 (exact, then one rounding). A same-dtype "cast"
// copies the bits. `src` and `dst` must not overlap.
// Launch: 1-D, any grid (grid-stride); the wrapper uses 256 threads and min(ceil(n/256), 2048)
// blocks.
extern "C" __global__ void cast(const void* src, u32 src_dtype, void* dst, u32 dst_dtype, u64 n) {
    switch (src_dtype) {
    case DT_BF16:
        cast_from<DT_BF16>(src, dst, dst_dtype, n);
        break;
    case DT_F16:
        cast_from<DT_F16>(src, dst, dst_dtype, n);
        break;
    default:
        cast_from<DT_F32>(src, dst, dst_dtype, n);
        break;
    }
}
