// Module `copy`: the copy-in of a unit's parameter gradients into its flat reduction buffer, and
// the copy-out of a gathered flat buffer into per-parameter tensors. References:
// `kernels::copy_in_reference`, `kernels::copy_out_reference` (src/kernels/mod.rs).
//
// Both take their per-parameter descriptors (device addresses, offsets, sizes) *by value*, as
// one fixed-size kernel parameter (`__grid_constant__`, read in place from the parameter
// bank, never copied per thread): a launch needs no host-to-device copy, so the step path has no
// host round trip. One launch handles up to COPY_MAX_PARAMS parameters; the wrapper
// (src/kernels/cuda.rs) launches once per batch.
//
// Preceded by common.cuh (conversions, dtype codes, GRID_STRIDE).

// Parameters per launch; the argument structs below stay under the 4 KiB kernel-parameter limit
// of every CUDA version (copy_in: 32 + 64 * 40 = 2592 bytes).
#define COPY_MAX_PARAMS 64

// One parameter of a copy-in (mirrored by `CopyInParam` in src/kernels/cuda.rs).
struct CopyInParam {
    u64 src;     // device address of the gradient's first element; 0 when absent
    u64 offset;  // flat offset of the parameter (FlatParamLayout)
    u64 numel;   // elements of the parameter
    u64 end;     // end of the parameter's region: the next parameter's offset, or the batch end
    u32 dtype;   // dtype code of the gradient (DT_F32, DT_BF16, DT_F16)
    u32 present; // 1: the gradient exists; 0: the parameter got none (zeros, flag 0)
};

// One launch of a copy-in (mirrored by `CopyInArgs` in src/kernels/cuda.rs).
struct CopyInArgs {
    u64 shard_numel; // S: elements of one chunk (FlatParamLayout::shard_numel)
    u32 world_size;  // W: chunks
    u32 num_params;  // F: presence flags after each chunk (every parameter of the unit)
    u32 first_param; // index in the unit of params[0]
    u32 count;       // parameters of this launch (<= COPY_MAX_PARAMS)
    u32 out_dtype;   // dtype code of the buffer (the reduce dtype)
    u32 pad;
    CopyInParam params[COPY_MAX_PARAMS];
};

// a / b, in 32 bits when both fit (the common case, and much cheaper than a 64-bit division).
__device__ __forceinline__ u64 div_u64(u64 a, u64 b) {
    if (((a | b) >> 32) == 0ull) {
        return (u64)((u32)a / (u32)b);
    }
    return a / b;
}

template <u32 SD, u32 OD>
__device__ __forceinline__ void copy_in_region(void* out, const CopyInArgs& a, const CopyInParam& p) {
    const u64 S = a.shard_numel;
    const u64 F = a.num_params;
    const u64 len = p.end - p.offset;
    const bool present = p.present != 0u && p.src != 0ull;
    GRID_STRIDE(k, len) {
        const u64 i = p.offset + k; // flat index
        float v = 0.0f;
        if (present && k < p.numel) {
            v = load_f32<SD>((const void*)p.src, k);
        }
        // chunk c = i / S holds flat [c*S, (c+1)*S) at [c*(S+F), c*(S+F)+S) of the buffer
        store_f32<OD>(out, i + div_u64(i, S) * F, v);
    }
}

template <u32 OD>
__device__ __forceinline__ void copy_in_from(void* out, const CopyInArgs& a, const CopyInParam& p) {
    switch (p.dtype) {
    case DT_BF16:
        copy_in_region<DT_BF16, OD>(out, a, p);
        break;
    case DT_F16:
        copy_in_region<DT_F16, OD>(out, a, p);
        break;
    default:
        copy_in_region<DT_F32, OD>(out, a, p);
        break;
    }
}

// Copy-in: writes the buffer elements of the parameters params[0..count) (launch y-index j is
// parameter j): its region [offset, end) of flat indices, which is the parameter's gradient
// converted to `out_dtype` (round to nearest even) followed by zeros up to `end` (alignment gap
// or final padding), or all zeros when the gradient is absent; and its presence flag (1 or 0)
// after each of the W chunks. Flat index i lands at i + (i / S) * F; the flag of unit parameter
// q after chunk c at c * (S + F) + S + q. The batches of one copy-in cover [0, W * S) and all F
// flags exactly once, so the buffer needs no zero-fill beforehand.
// Launch: grid (x, count), block 256; any x (grid-stride over the largest region).
extern "C" __global__ void copy_in(void* out, const __grid_constant__ CopyInArgs args) {
    const u32 j = blockIdx.y;
    if (j >= args.count) {
        return;
    }
    const CopyInParam& p = args.params[j];
    switch (args.out_dtype) {
    case DT_BF16:
        copy_in_from<DT_BF16>(out, args, p);
        break;
    case DT_F16:
        copy_in_from<DT_F16>(out, args, p);
        break;
    default:
        copy_in_from<DT_F32>(out, args, p);
        break;
    }
    const u64 S = args.shard_numel;
    const u64 F = args.num_params;
    const float flag = (p.present != 0u && p.src != 0ull) ? 1.0f : 0.0f;
    GRID_STRIDE(c, args.world_size) {
        const u64 at = c * (S + F) + S + args.first_param + j;
        switch (args.out_dtype) {
        case DT_BF16:
            store_f32<DT_BF16>(out, at, flag);
            break;
        case DT_F16:
            store_f32<DT_F16>(out, at, flag);
            break;
        default:
            store_f32<DT_F32>(out, at, flag);
            break;
        }
    }
}

// One parameter of a copy-out (mirrored by `CopyOutParam` in src/kernels/cuda.rs).
struct CopyOutParam {
    u64 dst;    // device address of the output tensor's first element
    u64 offset; // flat offset of the parameter in the gathered buffer
    u64 numel;  // elements
};

// One launch of a copy-out (mirrored by `CopyOutArgs` in src/kernels/cuda.rs).
struct CopyOutArgs {
    u32 src_dtype; // dtype code of the gathered buffer
    u32 dst_dtype; // dtype code of the outputs
    u32 count;     // parameters of this launch (<= COPY_MAX_PARAMS)
    u32 pad;
    CopyOutParam params[COPY_MAX_PARAMS];
};

template <u32 SD, u32 DD>
__device__ __forceinline__ void copy_out_param(const void* src, const CopyOutParam& p) {
    const char* base = (const char*)src + p.offset * (SD == DT_F32 ? 4ull : 2ull);
    GRID_STRIDE(k, p.numel) {
        convert<SD, DD>(base, k, (void*)p.dst, k);
    }
}

template <u32 SD>
__device__ __forceinline__ void copy_out_from(const void* src, u32 dst_dtype, const CopyOutParam& p) {
    switch (dst_dtype) {
    case DT_BF16:
        copy_out_param<SD, DT_BF16>(src, p);
        break;
    case DT_F16:
        copy_out_param<SD, DT_F16>(src, p);
        break;
    default:
        copy_out_param<SD, DT_F32>(src, p);
        break;
    }
}

// Copy-out: dst_j[k] = convert(src[offset_j + k]) for k < numel_j, j = blockIdx.y < count (a bit
// copy when the dtypes agree). Outputs are separate allocations that must not overlap `src`.
// Launch: grid (x, count), block 256; any x (grid-stride over the largest parameter).
extern "C" __global__ void copy_out(const void* src, const __grid_constant__ CopyOutArgs args) {
    const u32 j = blockIdx.y;
    if (j >= args.count) {
        return;
    }
    const CopyOutParam& p = args.params[j];
    switch (args.src_dtype) {
    case DT_BF16:
        copy_out_from<DT_BF16>(src, args.dst_dtype, p);
        break;
    case DT_F16:
        copy_out_from<DT_F16>(src, args.dst_dtype, p);
        break;
    default:
        copy_out_from<DT_F32>(src, args.dst_dtype, p);
        break;
    }
}
