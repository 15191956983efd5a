// Module `optim`: fused optimizer updates over a flat f32 shard, with the grad scaler's unscale
// and its device-side skip, and the scaler's own update on the device. References:
// `kernels::adamw_reference`, `sgd_reference`, `update_scale_reference` (src/kernels/mod.rs);
// the arithmetic is that of src/ops.rs's CPU loops, operation by operation.
//
// Skipping: when `found_inf` is given and *found_inf != 0 (some rank found an inf/NaN gradient,
// see ops.cu's scale_check_finite and its all-reduce max), the update kernels return at once and
// write nothing: the step is skipped without the host reading the flag (PyTorch's fused Adam
// with found_inf).
//
// Preceded by common.cuh (dtype codes, GRID_STRIDE, factor).

// x, or +0 when |x| is below f32's smallest normal number (FLT_MIN, 2^-126): how the optimizers
// store their moments and momentum buffers (a moment whose gradient became zero decays into the
// subnormal range, where a CPU takes ~100 cycles an operation; the CPU loops flush the same way,
// so the results stay bit-identical across devices).
__device__ __forceinline__ float flush_subnormal(float x) {
    return fabsf(x) < __uint_as_float(0x00800000u) ? 0.0f : x;
}

// Per-step constants of one AdamW update (mirrors ops::AdamWHyper, field for field).
struct AdamWArgs {
    float beta1;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float bias_correction1; // 1 / (1 - beta1^t)
    float bias_correction2; // 1 / (1 - beta2^t)
    float decay;            // 1 - lr * weight_decay
    float lr;
    float eps;
};

// One AdamW update (ops::adamw_step's CPU loop), element-wise, with g = grad * f
// (f = *inv_scale_ptr when given, else inv_scale; 1 for an unscaled gradient):
//   m = flush(m*beta1 + g*(1-beta1));  v = v*beta2 + (g*g)*(1-beta2), flushed once m == 0;
//   p = p*decay;  p = p - (m*c1 / (sqrt(v*c2) + eps)) * lr.
// The gradient is read only. Launch: 1-D, any grid, any block size.
extern "C" __global__ void adamw(float* param, const float* grad, float* exp_avg,
                                 float* exp_avg_sq, u64 n, AdamWArgs h, float inv_scale,
                                 const float* inv_scale_ptr, const float* found_inf) {
    if (found_inf != 0 && *found_inf != 0.0f) {
        return;
    }
    const float f = factor(inv_scale, inv_scale_ptr);
    GRID_STRIDE(i, n) {
        const float g = __fmul_rn(grad[i], f);
        const float m = flush_subnormal(
            __fadd_rn(__fmul_rn(exp_avg[i], h.beta1), __fmul_rn(g, h.one_minus_beta1)));
        const float v_new = __fadd_rn(__fmul_rn(exp_avg_sq[i], h.beta2),
                                      __fmul_rn(__fmul_rn(g, g), h.one_minus_beta2));
        // v is flushed only once m is 0 (kernels::flush_second_moment): a flushed v beside a
        // normal m would divide m by eps alone.
        const float v = m == 0.0f ? flush_subnormal(v_new) : v_new;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        const float m_hat = __fmul_rn(m, h.bias_correction1);
        const float v_hat = __fmul_rn(v, h.bias_correction2);
        float p = __fmul_rn(param[i], h.decay);
        p = __fsub_rn(p, __fmul_rn(__fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), h.eps)), h.lr));
        param[i] = p;
    }
}

// Per-step constants of one SGD update (mirrors ops::SgdHyper; the bools as 0/1).
struct SgdArgs {
    float lr;
    float momentum;            // mu
    float one_minus_dampening; // 1 - tau
    float weight_decay;        // lambda
    u32 nesterov;
    u32 first_step;
};

// One SGD update (ops::sgd_step's CPU loops), element-wise, with g = grad * f as in adamw:
//   d = g (+ lambda*p when lambda != 0);
//   with a momentum buffer b (momentum != 0): b = flush(first_step ? d : mu*b + (1-tau)*d);
//     d = nesterov ? d + mu*b : b;
//   p = p - lr*d.
// `momentum_buffer` is null when momentum is 0 (it is then neither read nor written).
// Launch: 1-D, any grid, any block size.
extern "C" __global__ void sgd(float* param, const float* grad, float* momentum_buffer, u64 n,
                               SgdArgs h, float inv_scale, const float* inv_scale_ptr,
                               const float* found_inf) {
    if (found_inf != 0 && *found_inf != 0.0f) {
        return;
    }
    const float f = factor(inv_scale, inv_scale_ptr);
    const bool wd = h.weight_decay != 0.0f;
    if (momentum_buffer == 0) {
        GRID_STRIDE(i, n) {
            float d = __fmul_rn(grad[i], f);
            const float p = param[i];
            if (wd) {
                d = __fadd_rn(d, __fmul_rn(h.weight_decay, p));
            }
            param[i] = __fsub_rn(p, __fmul_rn(h.lr, d));
        }
        return;
    }
    GRID_STRIDE(i, n) {
        float d = __fmul_rn(grad[i], f);
        const float p = param[i];
        if (wd) {
            d = __fadd_rn(d, __fmul_rn(h.weight_decay, p));
        }
        const float b = flush_subnormal(h.first_step != 0u
                                            ? d
                                            : __fadd_rn(__fmul_rn(h.momentum, momentum_buffer[i]),
                                                        __fmul_rn(h.one_minus_dampening, d)));
        momentum_buffer[i] = b;
        d = h.nesterov != 0u ? __fadd_rn(d, __fmul_rn(h.momentum, b)) : b;
        param[i] = __fsub_rn(p, __fmul_rn(h.lr, d));
    }
}

// The grad scaler's scale update on the device (ShardedGradScaler::update; PyTorch's
// _amp_update_scale_): after a step with *found_inf != 0, scale = scale * backoff_factor and the
// tracker restarts at 0; otherwise the tracker counts the clean step and, on reaching
// growth_interval, scale = scale * growth_factor and the tracker restarts. Then, when inv_scale
// is given, *inv_scale = 1 / scale (what the next unscale multiplies by). found_inf is read only:
// its owner zeroes it for the next step.
// Launch: one thread.
extern "C" __global__ void update_scale(float* scale, u32* growth_tracker, const float* found_inf,
                                        float* inv_scale, float growth_factor,
                                        float backoff_factor, u32 growth_interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    float s = *scale;
    if (*found_inf != 0.0f) {
        s = __fmul_rn(s, backoff_factor);
        *growth_tracker = 0u;
    } else {
        u32 t = *growth_tracker + 1u;
        if (t >= growth_interval) {
            s = __fmul_rn(s, growth_factor);
            t = 0u;
        }
        *growth_tracker = t;
    }
    *scale = s;
    if (inv_scale != 0) {
        *inv_scale = __fdiv_rn(1.0f, s);
    }
}
