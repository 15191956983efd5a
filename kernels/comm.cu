// Reductions of the thread backend on CUDA tensors (src/comm/threads/cuda.rs): one launch
// reduces the ranks' chunks into one destination, in rank order, with the CPU backend's
// arithmetic (src/comm/reduce.rs), so that the results are bitwise the CPU thread backend's.
//
// comm_reduce_<dtype>(srcs, nsrc, dst, n, op, use_scale, scale_f, scale_d):
//   dst[i] = op over j = 0, 1, ..., nsrc-1 (in order) of srcs.p[j][i], for i < n;
//   op 0: sum (and Avg: the sum times the scale when use_scale), 1: max, 2: min;
//   f32, bf16 and f16 accumulate in f32 and round once (bf16/f16: round to nearest even, NaN
//   quieted, as the `half` crate converts), f64 in f64, integers exactly (sums wrap);
//   max and min propagate NaN as `a.is_nan() || a >= b ? a : b`.
// dst may equal one of the sources (in place): each element is read from every source before
// it is written. The loader puts kernels/common.cuh in front of this file: its bf16/f16
// conversions (twins of the `half` crate) and integer typedefs are used here. Additions and
// products use the IEEE round-to-nearest intrinsics, never contracted into a fused multiply-add.

#define COMM_MAX_RANKS 64

// The sources' device addresses, passed by value (512 bytes of kernel parameters).
struct CommSrcs {
    unsigned long long p[COMM_MAX_RANKS];
};

__device__ __forceinline__ float comm_id_f32(float x) { return x; }
__device__ __forceinline__ double comm_id_f64(double x) { return x; }
__device__ __forceinline__ float comm_add_f32(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float comm_mul_f32(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double comm_add_f64(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double comm_mul_f64(double a, double b) { return __dmul_rn(a, b); }

// Floating-point reduction: T in memory, A the accumulator, WIDEN/NARROW the conversions,
// ADD/MUL the accumulator's arithmetic, SCALE the Avg factor in A.
#define COMM_REDUCE_FLOAT(NAME, T, A, WIDEN, NARROW, ADD, MUL, SCALE)                     \
    extern "C" __global__ void NAME(const CommSrcs srcs, unsigned int nsrc, T *dst,           \
                                    unsigned long long n, int op, int use_scale,              \
                                    float scale_f, double scale_d) {                          \
        unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;               \
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
             i < n; i += stride) {                                                            \
            A acc = WIDEN(((const T *)srcs.p[0])[i]);                                         \
            for (unsigned int j = 1; j < nsrc; ++j) {                                         \
                A x = WIDEN(((const T *)srcs.p[j])[i]);                                       \
                if (op == 0) {                                                                \
                    acc = ADD(acc, x);                                                        \
                } else if (op == 1) {                                                         \
                    acc = (acc != acc || acc >= x) ? acc : x;                                 \
                } else {                                                                      \
                    acc = (acc != acc || acc <= x) ? acc : x;                                 \
                }                                                                             \
            }                                                                                 \
            if (use_scale) {                                                                  \
                acc = MUL(acc, (SCALE));                                                      \
            }                                                                                 \
            dst[i] = NARROW(acc);                                                             \
        }                                                                                     \
    }

// Integer reduction: T in memory and accumulator, U its unsigned twin (sums wrap).
#define COMM_REDUCE_INT(NAME, T, U)                                                           \
    extern "C" __global__ void NAME(const CommSrcs srcs, unsigned int nsrc, T *dst,           \
                                    unsigned long long n, int op, int use_scale,              \
                                    float scale_f, double scale_d) {                          \
        unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;               \
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
             i < n; i += stride) {                                                            \
            T acc = ((const T *)srcs.p[0])[i];                                                \
            for (unsigned int j = 1; j < nsrc; ++j) {                                         \
                T x = ((const T *)srcs.p[j])[i];                                              \
                if (op == 0) {                                                                \
                    acc = (T)(U)((U)acc + (U)x);                                              \
                } else if (op == 1) {                                                         \
                    acc = acc >= x ? acc : x;                                                 \
                } else {                                                                      \
                    acc = acc <= x ? acc : x;                                                 \
                }                                                                             \
            }                                                                                 \
            dst[i] = acc;                                                                     \
        }                                                                                     \
    }

COMM_REDUCE_FLOAT(comm_reduce_f32, float, float, comm_id_f32, comm_id_f32, comm_add_f32,
                  comm_mul_f32, scale_f)
COMM_REDUCE_FLOAT(comm_reduce_f64, double, double, comm_id_f64, comm_id_f64, comm_add_f64,
                  comm_mul_f64, scale_d)
COMM_REDUCE_FLOAT(comm_reduce_bf16, u16, float, bf16_to_f32, f32_to_bf16, comm_add_f32,
                  comm_mul_f32, scale_f)
COMM_REDUCE_FLOAT(comm_reduce_f16, u16, float, f16_to_f32, f32_to_f16, comm_add_f32,
                  comm_mul_f32, scale_f)
COMM_REDUCE_INT(comm_reduce_u8, unsigned char, unsigned char)
COMM_REDUCE_INT(comm_reduce_u32, unsigned int, unsigned int)
COMM_REDUCE_INT(comm_reduce_i16, short, unsigned short)
COMM_REDUCE_INT(comm_reduce_i32, int, unsigned int)
COMM_REDUCE_INT(comm_reduce_i64, long long, unsigned long long)
