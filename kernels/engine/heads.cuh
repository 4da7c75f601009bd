// Per-head kernels: the q/k RMS norm with partial RoPE and gain, and XSA.
// Part of kernels/engine.cu (its prologue defines `act`, the chunk helpers and the
// ops headers this file uses); included there, once, inside no namespace.

#pragma once

// ---- per-head RMS norm + partial RoPE + gain ---------------------------------------------

// ops/qk_norm_rope.cuh: warp per (row, head): xn = x / r; y[i] = (a cos + b sin) gain,
// y[i + half] = (b cos - a sin) gain for the rotated pairs (a, b) = (xn[i], xn[i + half]),
// i < half = rot / 2; y = xn gain past rot. Row n is at position n % t; x has row stride ldx,
// out is contiguous; rstd keeps 1 / r for the backward pass.
extern "C" __global__ void eng_qk_norm_rope_fwd(const act* x, long ldx, act* out, float* rstd, const float* gain, int has_gain,
                                                const float* cos, const float* sin, long rows, int heads, int d, int rot, int t, float eps) {
    const long item = warp_row(rows * heads);
    if (item < 0) return;
    const int lane = threadIdx.x & 31, h = (int)(item % heads), half = rot / 2;
    const long n = item / heads;
    const act* xh = x + n * ldx + (long)h * d;
    act* yh = out + item * d;
    const float* cr = cos + (long)(n % t) * half;
    const float* sr = sin + (long)(n % t) * half;
    const float g = has_gain ? gain[h] : 1.f;
    const float inv = ops::norm_rope_row<Precise, true>(xh, yh, cr, sr, d, half, eps, g);
    if (lane == 0) rstd[item] = inv;
}

// Warp per (row, head): dxn = rope^T(dy gain); dx = (dxn - xn mean(dxn xn)) / r (written, row
// stride lddx); part[item] = sum(dy rope(xn)) (the gain's gradient before the sum over rows).
extern "C" __global__ void eng_qk_norm_rope_bwd(const act* x, long ldx, const float* rstd, const act* dy, act* dx, long lddx,
                                                const float* gain, int has_gain, const float* cos, const float* sin, long rows, int heads,
                                                int d, int rot, int t, float* part) {
    const long item = warp_row(rows * heads);
    if (item < 0) return;
    const int lane = threadIdx.x & 31, h = (int)(item % heads), half = rot / 2;
    const long n = item / heads;
    const act* xh = x + n * ldx + (long)h * d;
    const act* gy = dy + item * d;
    act* dh = dx + n * lddx + (long)h * d;
    const float* cr = cos + (long)(n % t) * half;
    const float* sr = sin + (long)(n % t) * half;
    const float inv = rstd[item], g = has_gain ? gain[h] : 1.f;
    float dg = 0.f, dot = 0.f;
    for (int i = lane; i < half; i += 32) {
        const float a = xh[i] * inv, b = xh[i + half] * inv, c = cr[i], s = sr[i];
        dg += gy[i] * ops::rope_lo(a, b, c, s) + gy[i + half] * ops::rope_hi(a, b, c, s);
        const float ga = gy[i] * g, gb = gy[i + half] * g;
        dot += ops::unrope_lo(ga, gb, c, s) * a + ops::unrope_hi(ga, gb, c, s) * b;
    }
    for (int i = 2 * half + lane; i < d; i += 32) {
        dg += gy[i] * xh[i] * inv;
        dot += gy[i] * g * xh[i] * inv;
    }
    dot = warp_sum(dot);
    dg = warp_sum(dg);
    // dx = dxn / r - x k with k = mean(dxn xn) / r^2.
    ops::norm_rope_bwd_row<true>(xh, gy, dh, cr, sr, d, half, inv, dot / d * inv * inv, g);
    if (lane == 0) part[item] = dg;
}

// The same two kernels for heads 64 wide (the GPU engine's only width) whose rotated half is
// a power-of-two multiple of AV (f32: rot 8, 16, 32, 64; bf16: 16, 32, 64), with every row
// 16-byte aligned (KernelBackend::qk_vector checks): QK_LANES lanes per (row, head), one 16-byte
// chunk of AV values each (16 lanes of 4 floats, 8 lanes of 8 bf16), so a warp moves two or
// four heads with 16-byte loads where the kernels above give a warp one head and leave lanes
// idle (measured at 0.9-1.4 TB/s on an H100 and an H200). A lane of the rotated part finds its
// pair's other half `half / AV` lanes away (a shuffle); the sums are over the head's lanes.
constexpr int QK_LANES = 64 / AV;

// The pair partner's AV values, `o` lanes away (every lane shuffles).
__device__ __forceinline__ void partner(const float (&v)[AV], int o, float (&p)[AV]) {
    for (int k = 0; k < AV; ++k) p[k] = __shfl_xor_sync(0xffffffffu, v[k], o);
}

extern "C" __global__ void eng_qk_norm_rope_fwd4(const act* x, long ldx, act* out, float* rstd, const float* gain, int has_gain,
                                                 const float* cos, const float* sin, long rows, int heads, int d, int rot, int t, float eps) {
    const long items = rows * heads, raw = ((long)blockIdx.x * blockDim.x + threadIdx.x) / QK_LANES;
    const bool live = raw < items;
    const long item = live ? raw : 0;  // spare lanes compute on item 0 and store nothing: every lane shuffles
    const int j = AV * (threadIdx.x % QK_LANES), half = rot / 2, h = (int)(item % heads);
    const long n = item / heads;
    float xv[AV], pv[AV];
    loadv(x + n * ldx + (long)h * d + j, xv);
    partner(xv, half / AV, pv);  // the pair's other half (lanes of the rotated part)
    float ss = 0.f;
    for (int k = 0; k < AV; ++k) ss += xv[k] * xv[k];
    const float inv = ops::rms_rstd<Precise>(ops::group_sum(ss, QK_LANES), d, eps);
    const float g = has_gain ? gain[h] : 1.f;
    float y[AV];
    const bool lo = j < half;
    const long c0 = (long)(n % t) * half + (lo ? j : j - half);
    for (int k = 0; k < AV; ++k) {
        const float xs = xv[k] * inv, ps = pv[k] * inv;
        if (j >= 2 * half) y[k] = xs * g;
        else y[k] = (lo ? ops::rope_lo(xs, ps, cos[c0 + k], sin[c0 + k]) : ops::rope_hi(ps, xs, cos[c0 + k], sin[c0 + k])) * g;
    }
    if (!live) return;
    storev(out + item * d + j, y);
    if (j == 0) rstd[item] = inv;
}

extern "C" __global__ void eng_qk_norm_rope_bwd4(const act* x, long ldx, const float* rstd, const act* dy, act* dx, long lddx,
                                                 const float* gain, int has_gain, const float* cos, const float* sin, long rows, int heads,
                                                 int d, int rot, int t, float* part) {
    const long items = rows * heads, raw = ((long)blockIdx.x * blockDim.x + threadIdx.x) / QK_LANES;
    const bool live = raw < items;
    const long item = live ? raw : 0;
    const int j = AV * (threadIdx.x % QK_LANES), half = rot / 2, h = (int)(item % heads);
    const long n = item / heads;
    float xv[AV], gv[AV], xp[AV], gp[AV];
    loadv(x + n * ldx + (long)h * d + j, xv);
    loadv(dy + item * d + j, gv);
    partner(xv, half / AV, xp);
    partner(gv, half / AV, gp);
    const float inv = rstd[item], g = has_gain ? gain[h] : 1.f;
    // Per value: the gain's gradient term, the norm's dot term, and dxn (the gradient before the norm).
    float dg = 0.f, dot = 0.f, dxn[AV];
    const bool rotated = j < 2 * half, lo = j < half;
    const long c0 = (long)(n % t) * half + (lo ? j : j - half);
    for (int k = 0; k < AV; ++k) {
        const float xs = xv[k] * inv, gs = gv[k];
        if (rotated) {
            const float c = cos[c0 + k], s = sin[c0 + k], ps = xp[k] * inv, gq = gp[k];
            const float a = lo ? xs : ps, b = lo ? ps : xs, ga = (lo ? gs : gq) * g, gb = (lo ? gq : gs) * g;
            dg += gs * (lo ? ops::rope_lo(a, b, c, s) : ops::rope_hi(a, b, c, s));
            dxn[k] = lo ? ops::unrope_lo(ga, gb, c, s) : ops::unrope_hi(ga, gb, c, s);
        } else {
            dg += gs * xs;
            dxn[k] = gs * g;
        }
        dot += dxn[k] * xs;
    }
    dot = ops::group_sum(dot, QK_LANES);
    dg = ops::group_sum(dg, QK_LANES);
    // dx = dxn / r - x k with k = mean(dxn xn) / r^2.
    const float kk = dot / d * inv * inv;
    if (!live) return;
    float o[AV];
    for (int k = 0; k < AV; ++k) o[k] = dxn[k] * inv - xv[k] * kk;
    storev(dx + n * lddx + (long)h * d + j, o);
    if (j == 0) part[item] = dg;
}

// ---- XSA: the output minus its projection on the unit value vector of its KV head --------

constexpr int XSA_MAX = 4;  // values per lane: head width up to 128

// Lane's share of the unit value of KV head `kv` of row n, and the norm before the floor.
__device__ __forceinline__ float unit_value(const act* v, long ldv, long n, int kv, int d, float (&u)[XSA_MAX]) {
    const int lane = threadIdx.x & 31;
    const act* vr = v + n * ldv + (long)kv * d;
    float s = 0.f;
    for (int k = 0; k < XSA_MAX; ++k) {
        const int j = lane + 32 * k;
        u[k] = j < d ? vr[j] : 0.f;
        s += u[k] * u[k];
    }
    const float norm = sqrtf(warp_sum(s));
    const float inv = 1.f / fmaxf(norm, 1e-12f);
    for (int k = 0; k < XSA_MAX; ++k) u[k] *= inv;
    return norm;
}

// Warp per (row, KV head): out = y - (y . u) u for each query head of the group.
extern "C" __global__ void eng_xsa_fwd(const act* y, const act* v, long ldv, act* out, long rows, int heads, int kv_heads, int d) {
    const long item = warp_row(rows * kv_heads);
    if (item < 0) return;
    const int lane = threadIdx.x & 31, kv = (int)(item % kv_heads), group = heads / kv_heads;
    const long n = item / kv_heads;
    float u[XSA_MAX];
    unit_value(v, ldv, n, kv, d, u);
    for (int h = kv * group; h < (kv + 1) * group; ++h) {
        const act* yr = y + (n * heads + h) * d;
        float a = 0.f;
        for (int k = 0; k < XSA_MAX; ++k) a += lane + 32 * k < d ? yr[lane + 32 * k] * u[k] : 0.f;
        a = warp_sum(a);
        for (int k = 0; k < XSA_MAX; ++k) {
            const int j = lane + 32 * k;
            if (j < d) out[(n * heads + h) * d + j] = yr[j] - a * u[k];
        }
    }
}

// Warp per (row, KV head): dy = g - (g . u) u per head; du = -sum over the group's heads of
// ((y . u) g + (g . u) y); dv = (du - u (du . u)) / |v| (du / 1e-12 below the floor), written.
extern "C" __global__ void eng_xsa_bwd(const act* dout, const act* y, const act* v, long ldv, act* dy, act* dv, long lddv, long rows,
                                       int heads, int kv_heads, int d) {
    const long item = warp_row(rows * kv_heads);
    if (item < 0) return;
    const int lane = threadIdx.x & 31, kv = (int)(item % kv_heads), group = heads / kv_heads;
    const long n = item / kv_heads;
    float u[XSA_MAX], du[XSA_MAX] = {0.f, 0.f, 0.f, 0.f};
    const float norm = unit_value(v, ldv, n, kv, d, u);
    for (int h = kv * group; h < (kv + 1) * group; ++h) {
        const act* gr = dout + (n * heads + h) * d;
        const act* yr = y + (n * heads + h) * d;
        float a = 0.f, b = 0.f;
        for (int k = 0; k < XSA_MAX; ++k) {
            const int j = lane + 32 * k;
            a += j < d ? yr[j] * u[k] : 0.f;
            b += j < d ? gr[j] * u[k] : 0.f;
        }
        a = warp_sum(a);
        b = warp_sum(b);
        for (int k = 0; k < XSA_MAX; ++k) {
            const int j = lane + 32 * k;
            if (j < d) {
                dy[(n * heads + h) * d + j] = gr[j] - b * u[k];
                du[k] -= a * gr[j] + b * yr[j];
            }
        }
    }
    float along = 0.f;
    for (int k = 0; k < XSA_MAX; ++k) along += du[k] * u[k];
    along = warp_sum(along);
    act* out = dv + n * lddv + (long)kv * d;
    for (int k = 0; k < XSA_MAX; ++k) {
        const int j = lane + 32 * k;
        if (j < d) out[j] = norm > 1e-12f ? (du[k] - u[k] * along) / norm : du[k] / 1e-12f;
    }
}
