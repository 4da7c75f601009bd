// The MLP's activation, the soft-capped cross-entropy, attention's casts and delta, the weights' bf16 copy.
// Part of kernels/engine.cu (its prologue defines `act`, the chunk helpers and the
// ops headers this file uses); included there, once, inside no namespace.

#pragma once

// ---- the MLP's activation (ops/act.cuh) -------------------------------------------------

// out = leaky_relu(x)^2 (slope 0: relu^2).
extern "C" __global__ void eng_act_fwd(const act* pre, act* out, long n, float slope) {
    if (chunked(n, pre, out)) {
        FOR_CHUNKS(i, n) {
            float v[AV];
            loadv(pre + i, v);
            for (int k = 0; k < AV; ++k) v[k] = ops::act_sq(ops::leaky_relu(v[k], slope));
            storev(out + i, v);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) out[i] = ops::act_sq(ops::leaky_relu(pre[i], slope));
}

// dpre = 2 l l' dout with l = leaky_relu(x), l' = 1 or slope.
extern "C" __global__ void eng_act_bwd(const act* pre, const act* dout, act* dpre, long n, float slope) {
    if (chunked(n, pre, dout, dpre)) {
        FOR_CHUNKS(i, n) {
            float x[AV], g[AV];
            loadv(pre + i, x);
            loadv(dout + i, g);
            for (int k = 0; k < AV; ++k) g[k] = ops::act_sq_grad(ops::leaky_relu(x[k], slope), ops::leaky_relu_slope(x[k], slope), g[k]);
            storev(dpre + i, g);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) {
        const float x = pre[i];
        dpre[i] = ops::act_sq_grad(ops::leaky_relu(x, slope), ops::leaky_relu_slope(x, slope), dout[i]);
    }
}

// ---- soft-capped cross-entropy fused with its gradient (ops/softcap_ce.cuh) --------------

// Block (256 threads) per row: t = tanh(x / cap), z = cap t; loss = logsumexp(z) - z[y]; the
// logits are overwritten by scale (softmax(z) - [j == y]) (1 - t^2).
extern "C" __global__ void eng_softcap_ce(act* logits, const unsigned* targets, float* losses, int vocab, float cap, float scale) {
    __shared__ float sh[8];
    const long r = blockIdx.x;
    act* xr = logits + r * vocab;
    const unsigned y = targets[r];
    if (y == ops::IGNORED_TARGET) {  // the whole block takes this branch: no barrier is split
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) xr[j] = 0.f;
        if (threadIdx.x == 0) losses[r] = 0.f;
        return;
    }
    const float inv_c = 1.f / cap;
    float m = -CUDART_INF_F;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, cap * ops::softcap_tanh(xr[j], inv_c));
    const float mx = ops::block_max(m, sh);
    float s = 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += Precise::exp(cap * ops::softcap_tanh(xr[j], inv_c) - mx);
    const float sum = block_sum(s, sh);
    // A target outside the vocabulary gives the row a NaN loss (not a read past the row).
    const float ty = ops::target_tanh(xr, y, vocab, inv_c);
    __syncthreads();  // every thread has read xr[y] before it is overwritten
    if (threadIdx.x == 0) losses[r] = ops::softcap_ce_loss(sum, mx, cap, ty);
    const float a = scale / sum;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float t = ops::softcap_tanh(xr[j], inv_c);
        const float p = Precise::exp(cap * t - mx) * a;
        xr[j] = ((unsigned)j == y ? p - scale : p) * ops::tanh_slope(t);
    }
}

// ---- attention's casts and delta; the weights' bf16 copy -------------------------------

// dst[i] = bf16(src[i]): the weights' copy that the GEMMs read with bf16 activations, made at
// the start of every forward pass from the f32 master weights.
extern "C" __global__ void eng_cast_bf16(const float* src, __nv_bfloat16* dst, long n) {
    for (long i = first_index(); i < n; i += grid_stride()) dst[i] = __float2bfloat16(src[i]);
}

// dst (rows x cols, contiguous bf16) = src (rows x cols, row stride lds, f32).
extern "C" __global__ void eng_to_bf16(const act* src, long lds, __nv_bfloat16* dst, long rows, int cols) {
    const long total = rows * cols;
    for (long i = first_index(); i < total; i += grid_stride()) dst[i] = __float2bfloat16(src[(i / cols) * lds + i % cols]);
}

// dst (row stride ldd, f32) (+)= src (rows x cols, contiguous bf16).
extern "C" __global__ void eng_from_bf16(const __nv_bfloat16* src, act* dst, long ldd, long rows, int cols, int acc) {
    const long total = rows * cols;
    for (long i = first_index(); i < total; i += grid_stride()) {
        const long j = (i / cols) * ldd + i % cols;
        const float v = __bfloat162float(src[i]);
        dst[j] = acc ? dst[j] + v : v;
    }
}

// delta = sum over a head's d values of o * dout (f32, contiguous rows of heads x d), stored
// as flash attention's backward kernels read it: delta[(b heads + h) t + i] for token n = b t + i.
// Warp per (token, head).
extern "C" __global__ void eng_attn_delta(const act* o, const act* dout, float* delta, long rows, int t, int heads, int d) {
    const long item = warp_row(rows * heads);
    if (item < 0) return;
    const int lane = threadIdx.x & 31;
    float s = 0.f;
    for (int j = lane; j < d; j += 32) s += o[item * d + j] * dout[item * d + j];
    s = warp_sum(s);
    const long n = item / heads, h = item % heads, b = n / t, i = n % t;
    if (lane == 0) delta[(b * heads + h) * t + i] = s;
}
