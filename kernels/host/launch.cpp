// The kernels of kernels/ compiled for the host under emulation.h, with C entry points that run
// one emulated launch each (tests/kernels.rs loads this as a shared library). The kernel sources
// are included unchanged, after common.cuh, as the loader does for NVRTC.
#include "emulation.h"

#include "../common.cuh"

#include "../cast.cu"
#include "../copy.cu"
#include "../ops.cu"
#include "../optim.cu"

extern "C" {

unsigned emu_sizeof(unsigned which) {
    switch (which) {
    case 0:
        return sizeof(CopyInArgs);
    case 1:
        return sizeof(CopyOutArgs);
    case 2:
        return sizeof(AdamWArgs);
    default:
        return sizeof(SgdArgs);
    }
}

void emu_cast(const void* s, u32 sd, void* d, u32 dd, u64 n, unsigned gx, unsigned bx) {
    EMU_LAUNCH(gx, 1u, bx, cast(s, sd, d, dd, n));
}

void emu_copy_in(void* out, const CopyInArgs* a, unsigned gx, unsigned gy, unsigned bx) {
    EMU_LAUNCH(gx, gy, bx, copy_in(out, *a));
}

void emu_copy_out(const void* src, const CopyOutArgs* a, unsigned gx, unsigned gy, unsigned bx) {
    EMU_LAUNCH(gx, gy, bx, copy_out(src, *a));
}

void emu_scale(float* x, u64 n, float s, unsigned gx, unsigned bx) {
    EMU_LAUNCH(gx, 1u, bx, scale(x, n, s));
}

// One thread per block: __syncthreads_or is then exact.
void emu_scale_check_finite(float* x, u64 n, float s, const float* sp, float* f, unsigned gx) {
    EMU_LAUNCH(gx, 1u, 1u, scale_check_finite(x, n, s, sp, f));
}

void emu_non_finite(const float* x, u64 n, float* f, unsigned gx) {
    EMU_LAUNCH(gx, 1u, 1u, non_finite(x, n, f));
}

void emu_add(float* d, const void* s, u32 sd, u64 n, unsigned gx, unsigned bx) {
    EMU_LAUNCH(gx, 1u, bx, add(d, s, sd, n));
}

void emu_adamw(float* p, const float* g, float* m, float* v, u64 n, const AdamWArgs* h, float inv,
               const float* invp, const float* found, unsigned gx, unsigned bx) {
    EMU_LAUNCH(gx, 1u, bx, adamw(p, g, m, v, n, *h, inv, invp, found));
}

void emu_sgd(float* p, const float* g, float* b, u64 n, const SgdArgs* h, float inv,
             const float* invp, const float* found, unsigned gx, unsigned bx) {
    EMU_LAUNCH(gx, 1u, bx, sgd(p, g, b, n, *h, inv, invp, found));
}

void emu_update_scale(float* s, u32* t, const float* f, float* inv, float g, float b, u32 i) {
    EMU_LAUNCH(1u, 1u, 1u, update_scale(s, t, f, inv, g, b, i));
}
}
