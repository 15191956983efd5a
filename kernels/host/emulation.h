// Host emulation of the CUDA built-ins the kernels of kernels/ use, so that their sources can be
// compiled by a C++ compiler and run on the CPU (tests/kernels.rs,
// `kernel_sources_run_under_host_emulation`). Not used by NVRTC or on a GPU.
//
// Threads run one after another: a launch is a loop over blockIdx.y, blockIdx.x, threadIdx.x,
// each calling the kernel function to completion. This is exact for kernels whose threads do not
// communicate (every kernel here but the block reductions); __syncthreads_or is exact with one
// thread per block. The warp shuffles of the sum of squares are not emulated (its order is
// checked against `sum_squares_reference` on a GPU). The IEEE intrinsics map to plain
// operations: compile with -ffp-contract=off so that none is fused.
#include <cmath>
#include <cstdint>
#include <cstring>

struct emu_dim3 {
    unsigned x, y, z;
};
static thread_local emu_dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static

static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline int __syncthreads_or(int x) { return x; }
static inline void __syncthreads() {}
static inline double __shfl_down_sync(unsigned, double v, int) { return v; }

// One emulated launch of `call` over a (gx, gy) grid of bx-thread blocks.
#define EMU_LAUNCH(gx, gy, bx, call)                                                        \
    do {                                                                                    \
        gridDim = {(gx), (gy), 1};                                                          \
        blockDim = {(bx), 1, 1};                                                            \
        for (unsigned y_ = 0; y_ < (gy); y_++)                                              \
            for (unsigned b_ = 0; b_ < (gx); b_++)                                          \
                for (unsigned t_ = 0; t_ < (bx); t_++) {                                    \
                    blockIdx = {b_, y_, 0};                                                 \
                    threadIdx = {t_, 0, 0};                                                 \
                    call;                                                                   \
                }                                                                           \
    } while (0)
