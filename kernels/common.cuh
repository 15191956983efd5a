// Shared by every module of kernels/: the loader (src/kernels/mod.rs, `SOURCES`) puts this text
// in front of each module's source before NVRTC compiles it, so no file #includes anything and
// NVRTC needs no include path.
//
// Element types: f32 is `float`; bf16 and f16 are handled as their 16-bit patterns
// (`unsigned short`) with the explicit conversions below, which are bit for bit those of the
// `half` crate (2.x, its portable fallbacks): round to nearest, ties to even; NaN stays NaN
// (quietened, payload kept); overflow goes to infinity; subnormals are kept, not flushed.
// Each has a CPU twin in src/kernels/mod.rs (`f32_to_bf16_bits` and so on).
//
// Floating-point arithmetic in the kernels is written with the IEEE round-to-nearest intrinsics
// (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn), which the compiler never contracts
// into a fused multiply-add; the loader compiles with --fmad=false --ftz=false --prec-div=true
// --prec-sqrt=true as a second guard. The CPU loops of src/ops.rs do the same operations in the
// same order, so the results agree bit for bit.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Element type codes shared with src/kernels/cuda.rs (`dtype_code`).
#define DT_F32 0u
#define DT_BF16 1u
#define DT_F16 2u

// Grid-stride loop over [0, n): every thread of the grid takes every (gridDim.x * blockDim.x)-th
// index, so any grid size covers any n.
#define GRID_STRIDE(i, n)                                                                  \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n);                 \
         i += (u64)blockDim.x * gridDim.x)

// ---- conversions (twins of half 2.x: bfloat/convert.rs, binary16/arch.rs fallbacks) --------

// bf16 -> f32: exact; a NaN gets its quiet bit set.
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    u32 x = (u32)h;
    if ((x & 0x7FFFu) > 0x7F80u) {
        x |= 0x0040u;
    }
    return __uint_as_float(x << 16);
}

// f32 -> bf16: round to nearest, ties to even; NaN keeps its top mantissa bits, quietened.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    const u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (u16)((x >> 16) + 1u);
    }
    return (u16)(x >> 16);
}

// f16 -> f32: exact (subnormals normalised); a NaN gets its quiet bit set.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    const u32 i = (u32)h;
    if ((i & 0x7FFFu) == 0u) {
        return __uint_as_float(i << 16);
    }
    const u32 half_sign = i & 0x8000u;
    const u32 half_exp = i & 0x7C00u;
    const u32 half_man = i & 0x03FFu;
    if (half_exp == 0x7C00u) {
        if (half_man == 0u) {
            return __uint_as_float((half_sign << 16) | 0x7F800000u);
        }
        return __uint_as_float((half_sign << 16) | 0x7FC00000u | (half_man << 13));
    }
    const u32 sign = half_sign << 16;
    const int unbiased_exp = ((int)half_exp >> 10) - 15;
    if (half_exp == 0u) {
        // leading zeros of the 16-bit mantissa field, minus the 6 bits above it
        const int e = (__clz((int)half_man) - 16) - 6;
        const u32 exp = ((u32)(127 - 15 - e)) << 23;
        const u32 man = (half_man << (14 + e)) & 0x7FFFFFu;
        return __uint_as_float(sign | exp | man);
    }
    const u32 exp = ((u32)(unbiased_exp + 127)) << 23;
    const u32 man = (half_man & 0x03FFu) << 13;
    return __uint_as_float(sign | exp | man);
}

// f32 -> f16: round to nearest, ties to even, including into and out of the subnormal range;
// overflow to infinity; NaN keeps its top mantissa bits, quietened.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    const u32 x = __float_as_uint(f);
    const u32 sign = x & 0x80000000u;
    const u32 exp = x & 0x7F800000u;
    const u32 man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        const u32 nan_bit = (man == 0u) ? 0u : 0x0200u;
        return (u16)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    const u32 half_sign = sign >> 16;
    const int unbiased_exp = (int)(exp >> 23) - 127;
    const int half_exp = unbiased_exp + 15;
    if (half_exp >= 0x1F) {
        return (u16)(half_sign | 0x7C00u);
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return (u16)half_sign;
        }
        const u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        const u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) {
            half_man += 1u;
        }
        return (u16)(half_sign | half_man);
    }
    const u32 he = ((u32)half_exp) << 10;
    const u32 half_man = man >> 13;
    const u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        return (u16)((half_sign | he | half_man) + 1u);
    }
    return (u16)(half_sign | he | half_man);
}

// ---- typed element access (DT is a compile-time dtype code) ----------------------------------

template <u32 DT>
__device__ __forceinline__ float load_f32(const void* p, u64 i) {
    if (DT == DT_BF16) {
        return bf16_to_f32(((const u16*)p)[i]);
    } else if (DT == DT_F16) {
        return f16_to_f32(((const u16*)p)[i]);
    } else {
        return ((const float*)p)[i];
    }
}

template <u32 DT>
__device__ __forceinline__ void store_f32(void* p, u64 i, float v) {
    if (DT == DT_BF16) {
        ((u16*)p)[i] = f32_to_bf16(v);
    } else if (DT == DT_F16) {
        ((u16*)p)[i] = f32_to_f16(v);
    } else {
        ((float*)p)[i] = v;
    }
}

// dst[j] = src[i] converted from dtype S to dtype D; a bit copy when S == D (NaN payloads
// untouched, as a plain copy).
template <u32 S, u32 D>
__device__ __forceinline__ void convert(const void* src, u64 i, void* dst, u64 j) {
    if (S == D) {
        if (S == DT_F32) {
            ((u32*)dst)[j] = ((const u32*)src)[i];
        } else {
            ((u16*)dst)[j] = ((const u16*)src)[i];
        }
    } else {
        store_f32<D>(dst, j, load_f32<S>(src, i));
    }
}

// Whether an f32 is finite (neither infinite nor NaN), from its bits.
__device__ __forceinline__ bool is_finite_f32(float v) {
    return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u;
}

// The unscale factor of the optimizer and scaler kernels: `*ptr` when a device pointer is given
// (a scale that lives on the GPU), else the value passed by the host.
__device__ __forceinline__ float factor(float value, const float* ptr) {
    return ptr != 0 ? *ptr : value;
}
