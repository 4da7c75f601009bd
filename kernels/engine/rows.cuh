// Row kernels: RMS norm, the residual mix, the scaled add and the skips.
// Part of kernels/engine.cu (its prologue defines `act`, the chunk helpers and the
// ops headers this file uses); included there, once, inside no namespace.

#pragma once

// ---- RMS norm ----------------------------------------------------------------------------

// ops/rms_norm.cuh with the scale folded in. Warp per row.

// The chunked RMS norm's second half, for a row whose lane chunks v hold and whose sum of
// squares this lane's part ss is: out = scale v / r, *rstd = 1 / r (lane 0).
__device__ __forceinline__ void norm_chunks_out(float (&v)[RMS_CHUNKS][AV], float ss, act* outr, float* rstd, int cols, float scale,
                                                float eps) {
    const int lane = threadIdx.x & 31, chunks = cols / AV;
    const float inv = ops::rms_rstd<Precise>(warp_sum(ss), cols, eps);
    const float a = inv * scale;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < chunks) {
            for (int k = 0; k < AV; ++k) v[m][k] *= a;
            storev(outr + ch * AV, v[m]);
        }
    }
    if (lane == 0) *rstd = inv;
}

// out = x scale / r, rstd = 1 / r with r = sqrt(mean(x^2) + eps).
// Chunked: the row in registers, one read and one write of it.
extern "C" __global__ void eng_rms_norm_fwd(const act* x, act* out, float* rstd, long rows, int cols, float scale, float eps) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    if (!chunked(cols, x, out) || cols > 32 * AV * RMS_CHUNKS) {
        const float inv = ops::rms_norm_row<Precise>(x + r * cols, out + r * cols, cols, eps, scale);
        if (lane == 0) rstd[r] = inv;
        return;
    }
    const int chunks = cols / AV;
    const act* xr = x + r * cols;
    float v[RMS_CHUNKS][AV];
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < chunks) {
            loadv(xr + ch * AV, v[m]);
            for (int k = 0; k < AV; ++k) ss += v[m][k] * v[m][k];
        }
    }
    norm_chunks_out(v, ss, out + r * cols, rstd + r, cols, scale, eps);
}

// A residual sum and its RMS norm in one pass (op::MixNormFwd): u = h mix[0] + x0 mix[cols + .]
// (resid, eng_resid_mix_fwd's) or u = h + x0 mix (eng_scale_add_fwd's) per channel, written to u,
// then out = scale u / r, rstd = 1 / r as eng_rms_norm_fwd. The norm reads u from registers as
// it was stored (packed to the activations' type and unpacked), so out and rstd are the two
// kernels' bit for bit, with one read of u and one launch fewer. Warp per row; rows that are
// not in 16-byte chunks (or too wide for the registers) write u, then norm it from memory.
extern "C" __global__ void eng_mix_norm_fwd(const act* h, const act* x0, const float* mix, int resid, act* u, act* out, float* rstd,
                                            long rows, int cols, float scale, float eps) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    const act* hr = h + r * cols;
    const act* xr = x0 + r * cols;
    act* ur = u + r * cols;
    const float* m1 = resid ? mix + cols : mix;
    if (!chunked(cols, h, x0, u, out) || cols > 32 * AV * RMS_CHUNKS) {
        for (int c = lane; c < cols; c += 32)
            ur[c] = resid ? ops::mixed(hr[c], xr[c], mix[c], m1[c]) : ops::add_scaled(hr[c], xr[c], m1[c]);
        __syncwarp();
        const float inv = ops::rms_norm_row<Precise>(ur, out + r * cols, cols, eps, scale);
        if (lane == 0) rstd[r] = inv;
        return;
    }
    const int chunks = cols / AV;
    float v[RMS_CHUNKS][AV];
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < chunks) {
            const int c = ch * AV;
            float xv[AV];
            loadv(hr + c, v[m]);
            loadv(xr + c, xv);
            for (int k = 0; k < AV; ++k)
                v[m][k] = resid ? ops::mixed(v[m][k], xv[k], mix[c + k], m1[c + k]) : ops::add_scaled(v[m][k], xv[k], m1[c + k]);
            const uint4 stored = ops::pack(v[m]);
            *reinterpret_cast<uint4*>(ur + c) = stored;
            ops::unpack(stored, v[m]);
            for (int k = 0; k < AV; ++k) ss += v[m][k] * v[m][k];
        }
    }
    norm_chunks_out(v, ss, out + r * cols, rstd + r, cols, scale, eps);
}

// Row r's RMS norm gradient into gr, gr (+)= scale (dn / r - x sum(dn x) / (cols r^3)) with
// 1 / r = inv from the forward pass, added when acc, on 16-byte chunks (cols <= 32 AV
// RMS_CHUNKS): eng_rms_norm_bwd's chunked path and the fused passes'. o gets the lane's chunks
// of gr as stored (packed to the activations' type and unpacked): what a next op reads.
__device__ __forceinline__ void norm_grad_chunks(const act* xr, const act* nr, act* gr, float inv, int cols, float scale, bool acc,
                                                 float (&o)[RMS_CHUNKS][AV]) {
    const int lane = threadIdx.x & 31, n = cols / AV;
    float xv[RMS_CHUNKS][AV], gv[RMS_CHUNKS][AV];
    float xg = 0.f;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < n) {
            loadv(xr + ch * AV, xv[m]);
            loadv(nr + ch * AV, gv[m]);
            for (int k = 0; k < AV; ++k) xg += xv[m][k] * gv[m][k];
        }
    }
    xg = warp_sum(xg);
    const float a = inv * scale, c = xg / cols * inv * inv * inv * scale;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < n) {
            if (acc) loadv(gr + ch * AV, o[m]);
            for (int k = 0; k < AV; ++k) {
                const float v = gv[m][k] * a - xv[m][k] * c;
                o[m][k] = acc ? o[m][k] + v : v;
            }
            const uint4 stored = ops::pack(o[m]);
            *reinterpret_cast<uint4*>(gr + ch * AV) = stored;
            ops::unpack(stored, o[m]);
        }
    }
}

// dx (+)= scale (dy / r - x sum(dy x) / (cols r^3)), with 1 / r from the forward pass.
extern "C" __global__ void eng_rms_norm_bwd(const act* x, const float* rstd, const act* dy, act* dx, long rows, int cols, float scale,
                                            int acc) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const act* xr = x + r * cols;
    const act* gr = dy + r * cols;
    if (!chunked(cols, x, dy, dx) || cols > 32 * AV * RMS_CHUNKS) {
        ops::rms_norm_bwd_row(xr, gr, dx + r * cols, cols, rstd[r], ops::row_dot(xr, gr, cols), scale, acc != 0);
        return;
    }
    // Chunked: x and dy read once into registers, dx written (read too when accumulating).
    float o[RMS_CHUNKS][AV];
    norm_grad_chunks(xr, gr, dx + r * cols, rstd[r], cols, scale, acc != 0, o);
}

// The widest row eng_norm_scale_bwd takes (its per-warp channel sums live in shared memory),
// and eng_norm_mix_bwd (two sums a channel).
constexpr int NORM_SCALE_MAX = 1024;
constexpr int NORM_MIX_MAX = 512;

// The RMS norm's backward pass into the stream's gradient and the scaled add's backward pass
// of that gradient, in one pass (op::NormScaleBwd): per row, g += scale (dn / r - x sum(dn x) /
// (cols r^3)) as eng_rms_norm_bwd accumulating, then dx = g s (eng_scale_cols) from g as
// stored, and the per-channel sums of g a for s's gradient (eng_dot_partial's part rows, each
// warp's rows summed in shared memory, then the block's warps in order). A block of 8 warps
// per PART rows, each warp a row at a time; cols <= NORM_SCALE_MAX.
extern "C" __global__ void eng_norm_scale_bwd(const act* x, const float* rstd, const act* dn, act* g, const act* a, const float* s,
                                              act* dx, long rows, int cols, float scale, float* part) {
    __shared__ float sums[8][NORM_SCALE_MAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    const long r0 = (long)blockIdx.x * PART, r1 = min(r0 + PART, rows);
    for (int c = lane; c < cols; c += 32) sums[warp][c] = 0.f;
    __syncwarp();
    const bool chunks = chunked(cols, x, dn, g, a, dx) && cols <= 32 * AV * RMS_CHUNKS;
    for (long r = r0 + warp; r < r1; r += warps) {
        const act* xr = x + r * cols;
        const act* nr = dn + r * cols;
        act* gr = g + r * cols;
        if (!chunks) {
            ops::rms_norm_bwd_row(xr, nr, gr, cols, rstd[r], ops::row_dot(xr, nr, cols), scale, true);
            __syncwarp();
            for (int c = lane; c < cols; c += 32) {
                const float o = gr[c];
                dx[r * cols + c] = ops::scaled(gr[c], s[c]);
                sums[warp][c] += o * a[r * cols + c];
            }
            __syncwarp();
            continue;
        }
        float o[RMS_CHUNKS][AV];
        norm_grad_chunks(xr, nr, gr, rstd[r], cols, scale, true, o);
#pragma unroll
        for (int m = 0; m < RMS_CHUNKS; ++m) {
            const int c0 = (lane + 32 * m) * AV;
            if (c0 < cols) {
                float av[AV], d[AV];
                loadv(a + r * cols + c0, av);
                for (int k = 0; k < AV; ++k) {
                    d[k] = ops::scaled(o[m][k], s[c0 + k]);
                    sums[warp][c0 + k] += o[m][k] * av[k];
                }
                storev(dx + r * cols + c0, d);
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float t = 0.f;
        for (int w = 0; w < warps; ++w) t += sums[w][c];
        part[(long)blockIdx.x * cols + c] = t;
    }
}

// The RMS norm's backward pass into u's gradient du (written, or added to with acc) and the
// residual mix's backward pass of du, in one pass (op::NormMixBwd): per row du as
// eng_rms_norm_bwd, then dh = du mix[0] and dx0 += du mix[1] (eng_resid_mix_bwd) from du as
// stored, and the per-channel sums of du h and du x0 for mix's gradient
// (eng_resid_mix_partial's part rows, 2 cols a block). Blocks as eng_norm_scale_bwd;
// cols <= NORM_MIX_MAX.
extern "C" __global__ void eng_norm_mix_bwd(const act* x, const float* rstd, const act* dn, act* du, int acc, const act* h,
                                            const act* x0, const float* mix, act* dh, act* dx0, long rows, int cols, float scale,
                                            float* part) {
    __shared__ float sums[8][2 * NORM_MIX_MAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    const long r0 = (long)blockIdx.x * PART, r1 = min(r0 + PART, rows);
    for (int c = lane; c < 2 * cols; c += 32) sums[warp][c] = 0.f;
    __syncwarp();
    const bool chunks = chunked(cols, x, dn, du, h, x0, dh, dx0) && cols <= 32 * AV * RMS_CHUNKS;
    for (long r = r0 + warp; r < r1; r += warps) {
        const act* xr = x + r * cols;
        const act* nr = dn + r * cols;
        act* gr = du + r * cols;
        const long i0 = r * cols;
        if (!chunks) {
            ops::rms_norm_bwd_row(xr, nr, gr, cols, rstd[r], ops::row_dot(xr, nr, cols), scale, acc != 0);
            __syncwarp();
            for (int c = lane; c < cols; c += 32) {
                const float g = gr[c];
                dh[i0 + c] = ops::scaled(gr[c], mix[c]);
                dx0[i0 + c] = ops::add_scaled(dx0[i0 + c], gr[c], mix[cols + c]);
                sums[warp][c] += g * h[i0 + c];
                sums[warp][cols + c] += g * x0[i0 + c];
            }
            __syncwarp();
            continue;
        }
        float o[RMS_CHUNKS][AV];
        norm_grad_chunks(xr, nr, gr, rstd[r], cols, scale, acc != 0, o);
#pragma unroll
        for (int m = 0; m < RMS_CHUNKS; ++m) {
            const int c0 = (lane + 32 * m) * AV;
            if (c0 < cols) {
                float hv[AV], xv[AV], d0[AV], dd[AV];
                loadv(h + i0 + c0, hv);
                loadv(x0 + i0 + c0, xv);
                loadv(dx0 + i0 + c0, d0);
                for (int k = 0; k < AV; ++k) {
                    dd[k] = ops::scaled(o[m][k], mix[c0 + k]);
                    d0[k] = ops::add_scaled(d0[k], o[m][k], mix[cols + c0 + k]);
                    sums[warp][c0 + k] += o[m][k] * hv[k];
                    sums[warp][cols + c0 + k] += o[m][k] * xv[k];
                }
                storev(dh + i0 + c0, dd);
                storev(dx0 + i0 + c0, d0);
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * cols; c += blockDim.x) {
        float t = 0.f;
        for (int w = 0; w < warps; ++w) t += sums[w][c];
        part[(long)blockIdx.x * 2 * cols + c] = t;
    }
}

// ---- residual mix, scaled add, skips -----------------------------------------------------
// (ops/scale.cuh; the per-channel sums of ops/colsum.cuh)

// out = h mix[0] + x0 mix[1] per channel (mix: 2 x cols).
extern "C" __global__ void eng_resid_mix_fwd(const act* h, const act* x0, const float* mix, act* out, long n, int cols) {
    if (chunked(cols, h, x0, out)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float hv[AV], xv[AV];
            loadv(h + i, hv);
            loadv(x0 + i, xv);
            for (int k = 0; k < AV; ++k) hv[k] = ops::mixed(hv[k], xv[k], mix[c + k], mix[cols + c + k]);
            storev(out + i, hv);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        out[i] = ops::mixed(h[i], x0[i], mix[c], mix[cols + c]);
    }
}

// dh = du mix[0]; dx0 += du mix[1].
extern "C" __global__ void eng_resid_mix_bwd(const act* du, const float* mix, act* dh, act* dx0, long n, int cols) {
    if (chunked(cols, du, dh, dx0)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float g[AV], d0[AV], o[AV];
            loadv(du + i, g);
            loadv(dx0 + i, d0);
            for (int k = 0; k < AV; ++k) {
                o[k] = ops::scaled(g[k], mix[c + k]);
                d0[k] = ops::add_scaled(d0[k], g[k], mix[cols + c + k]);
            }
            storev(dh + i, o);
            storev(dx0 + i, d0);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        dh[i] = ops::scaled(du[i], mix[c]);
        dx0[i] = ops::add_scaled(dx0[i], du[i], mix[cols + c]);
    }
}

// part[blk] = (sum du h, sum du x0) per channel over the block's PART rows: the mix's gradient.
extern "C" __global__ void eng_resid_mix_partial(const act* du, const act* h, const act* x0, long rows, int cols, float* part) {
    const long r0 = (long)blockIdx.y * PART, r1 = min(r0 + PART, rows);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float a = 0.f, b = 0.f;
        for (long r = r0; r < r1; ++r) {
            const float g = du[r * cols + c];
            a += g * h[r * cols + c];
            b += g * x0[r * cols + c];
        }
        part[(long)blockIdx.y * 2 * cols + c] = a;
        part[(long)blockIdx.y * 2 * cols + cols + c] = b;
    }
}

// out = base + x s per channel (base may be out: in place).
extern "C" __global__ void eng_scale_add_fwd(const act* base, const act* x, const float* s, act* out, long n, int cols) {
    if (chunked(cols, base, x, out)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float b[AV], v[AV];
            loadv(base + i, b);
            loadv(x + i, v);
            for (int k = 0; k < AV; ++k) b[k] = ops::add_scaled(b[k], v[k], s[c + k]);
            storev(out + i, b);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) out[i] = ops::add_scaled(base[i], x[i], s[i % cols]);
}

// dx = dy s per channel.
extern "C" __global__ void eng_scale_cols(const act* dy, const float* s, act* dx, long n, int cols) {
    if (chunked(cols, dy, dx)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float g[AV];
            loadv(dy + i, g);
            for (int k = 0; k < AV; ++k) g[k] = ops::scaled(g[k], s[c + k]);
            storev(dx + i, g);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) dx[i] = ops::scaled(dy[i], s[i % cols]);
}

// part[blk][c] = sum over the block's rows of a[r][c] b[r][c].
extern "C" __global__ void eng_dot_partial(const act* a, const act* b, long rows, int cols, float* part) {
    const long r0 = (long)blockIdx.y * PART, r1 = min(r0 + PART, rows);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
        part[(long)blockIdx.y * cols + c] = ops::column_dot(a, b, r0, r1, cols, c);
}

// U-Net skip: k = s w; out = h + k, or with a gate g = sigmoid(z): out = k + (h - k) g.
__device__ __forceinline__ float skip_value(float h, float s, float w, const float* z, int c, int gated) {
    const float k = s * w;
    return gated ? k + (h - k) * sigmoid(z[c]) : h + k;
}

extern "C" __global__ void eng_skip_fwd(const act* h, const act* s, const float* w, const float* z, int gated, act* out, long n,
                                        int cols) {
    if (chunked(cols, h, s, out)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float hv[AV], sv[AV];
            loadv(h + i, hv);
            loadv(s + i, sv);
            for (int k = 0; k < AV; ++k) hv[k] = skip_value(hv[k], sv[k], w[c + k], z, c + k, gated);
            storev(out + i, hv);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        out[i] = skip_value(h[i], s[i], w[c], z, c, gated);
    }
}

// dh = dy gh, ds = dy gk w with the shares (gh, gk) = (g, 1 - g), or (1, 1) ungated.
extern "C" __global__ void eng_skip_bwd(const act* dy, const float* w, const float* z, int gated, act* dh, act* ds, long n, int cols) {
    if (chunked(cols, dy, dh, ds)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float g[AV], a[AV], b[AV];
            loadv(dy + i, g);
            for (int k = 0; k < AV; ++k) {
                const float gh = gated ? sigmoid(z[c + k]) : 1.f, gk = gated ? 1.f - gh : 1.f;
                a[k] = g[k] * gh;
                b[k] = g[k] * gk * w[c + k];
            }
            storev(dh + i, a);
            storev(ds + i, b);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        const float g = gated ? sigmoid(z[c]) : 1.f, gk = gated ? 1.f - g : 1.f;
        dh[i] = dy[i] * g;
        ds[i] = dy[i] * gk * w[c];
    }
}

// part[blk] = (sum dy gk s, sum dy (h - s w)) per channel: w's gradient and the gate's before
// its sigmoid's slope (the second half only when gated).
extern "C" __global__ void eng_skip_partial(const act* dy, const act* h, const act* s, const float* w, const float* z, int gated,
                                            long rows, int cols, float* part) {
    const long r0 = (long)blockIdx.y * PART, r1 = min(r0 + PART, rows);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        const float gk = gated ? 1.f - sigmoid(z[c]) : 1.f;
        float a = 0.f, b = 0.f;
        for (long r = r0; r < r1; ++r) {
            const long i = r * cols + c;
            a += dy[i] * gk * s[i];
            if (gated) b += dy[i] * (h[i] - s[i] * w[c]);
        }
        part[(long)blockIdx.y * 2 * cols + c] = a;
        part[(long)blockIdx.y * 2 * cols + cols + c] = b;
    }
}

// dz[c] += (sum of the raw partials) g (1 - g), g = sigmoid(z[c]): the partials' second half.
extern "C" __global__ void eng_skip_gate_finish(const float* part, int parts, int cols, const float* z, float* dz) {
    for (long c = first_index(); c < cols; c += grid_stride()) {
        const float s = ops::column_total(part + cols, parts, 2L * cols, c);
        const float g = sigmoid(z[c]);
        dz[c] += s * g * (1.f - g);
    }
}
