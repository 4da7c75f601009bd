// The flat kernels (grid-stride over the elements) and the per-channel sums.
// Part of kernels/engine.cu (its prologue defines `act`, the chunk helpers and the
// ops headers this file uses); included there, once, inside no namespace.

#pragma once

// ---- flat kernels ------------------------------------------------------------------------

// Each of these five has a float32 entry point and an `_act` one on the activations' storage
// (the same kernel in the float32 build): the launcher picks by where the buffer lies.

// d[i] = v.
template <typename T>
__device__ void fill_t(T* d, long n, float v) {
    for (long i = first_index(); i < n; i += grid_stride()) d[i] = v;
}
extern "C" __global__ void eng_fill(float* d, long n, float v) { fill_t(d, n, v); }
extern "C" __global__ void eng_fill_act(act* d, long n, float v) { fill_t(d, n, v); }

// d[i] *= a.
template <typename T>
__device__ void scale_t(T* d, long n, float a) {
    for (long i = first_index(); i < n; i += grid_stride()) d[i] = d[i] * a;
}
extern "C" __global__ void eng_scale(float* d, long n, float a) { scale_t(d, n, a); }
extern "C" __global__ void eng_scale_act(act* d, long n, float a) { scale_t(d, n, a); }

// d[i] = s[i].
template <typename T>
__device__ void copy_t(T* d, const T* s, long n) {
    for (long i = first_index(); i < n; i += grid_stride()) d[i] = s[i];
}
extern "C" __global__ void eng_copy(float* d, const float* s, long n) { copy_t(d, s, n); }
extern "C" __global__ void eng_copy_act(act* d, const act* s, long n) { copy_t(d, s, n); }

// y = a x + b y with (a, b) = ab[0..2] (the EMA: a = 1 - decay, b = decay). The scalars are
// read from device memory: they change between replays of a captured step (Muon's learning rate).
template <typename T>
__device__ void axpby_t(const float* ab, const T* x, T* y, long n) {
    const float a = ab[0], b = ab[1];
    // The chunk is of T's own width (4 floats, 8 bf16), whichever storage the build's `act` is.
    constexpr int V = 16 / (int)sizeof(T);
    if (n % V == 0 && aligned16(x) && aligned16(y)) {
        for (long i = first_index() * V; i < n; i += grid_stride() * V) {
            float xv[V], yv[V];
            loadv(x + i, xv);
            loadv(y + i, yv);
            for (int k = 0; k < V; ++k) yv[k] = a * xv[k] + b * yv[k];
            storev(y + i, yv);
        }
        return;
    }
    for (long i = first_index(); i < n; i += grid_stride()) y[i] = a * x[i] + b * y[i];
}
extern "C" __global__ void eng_axpby(const float* ab, const float* x, float* y, long n) { axpby_t(ab, x, y, n); }
extern "C" __global__ void eng_axpby_act(const float* ab, const act* x, act* y, long n) { axpby_t(ab, x, y, n); }

// part[block] = the block's sum of x (mode 0), of x^2 (mode 1), or its count of non-finite
// values (mode 2), over its grid-stride share.
template <typename T>
__device__ void reduce_partial_t(const T* x, long n, int mode, float* part) {
    __shared__ float sh[8];
    float s = 0.f;
    for (long i = first_index(); i < n; i += grid_stride()) {
        const float v = x[i];
        s += mode == 0 ? v : mode == 1 ? v * v : (isfinite(v) ? 0.f : 1.f);
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
extern "C" __global__ void eng_reduce_partial(const float* x, long n, int mode, float* part) { reduce_partial_t(x, n, mode, part); }
extern "C" __global__ void eng_reduce_partial_act(const act* x, long n, int mode, float* part) { reduce_partial_t(x, n, mode, part); }

// out[0] = the sum of part[0..count] (added to out[0] when `acc`), in order by one thread
// (deterministic).
extern "C" __global__ void eng_reduce_finish(const float* part, int count, float* out, int acc) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float s = 0.f;
    for (int i = 0; i < count; ++i) s += part[i];
    out[0] = acc ? out[0] + s : s;
}

// clip_grad_norm_ without a host read: norm = sqrt(sum_sq[0]) (eng_reduce_* mode 1 wrote it),
// g *= max / (norm + 1e-6) when that is below 1, max = max_p[0]; norm_out[0] = norm (read once
// per step).
extern "C" __global__ void eng_clip(float* g, long n, const float* sum_sq, const float* max_p, float* norm_out) {
    const float norm = sqrtf(sum_sq[0]);
    const float coef = max_p[0] / (norm + 1e-6f);
    if (blockIdx.x == 0 && threadIdx.x == 0) norm_out[0] = norm;
    if (coef >= 1.f) return;
    for (long i = first_index(); i < n; i += grid_stride()) g[i] *= coef;
}

// torch.optim.Adam(W): p *= decay; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= step m / (sqrt(v) inv_b2 + eps), with step = lr / bias1, inv_b2 = 1 / sqrt(bias2);
// (step, inv_b2, decay) = s[0..3] in device memory (they change every step).
extern "C" __global__ void eng_adam(float* p, const float* g, float* m, float* v, long n, float b1, float b2, const float* s,
                                    float eps, int decays) {
    const float step = s[0], inv_b2 = s[1], decay = s[2];
    const float c1 = 1.f - b1, c2 = 1.f - b2;
    for (long i = first_index(); i < n; i += grid_stride()) {
        const float gi = g[i];
        const float mi = b1 * m[i] + c1 * gi;
        const float vi = b2 * v[i] + c2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        const float q = decays ? p[i] * decay : p[i];
        p[i] = q - mi / (sqrtf(vi) * inv_b2 + eps) * step;
    }
}

// Muon's momentum: buf = mu buf + g; u = g + mu buf (Nesterov) or buf; mu = mu_p[0] (device
// memory: the momentum warm-up changes it between steps).
extern "C" __global__ void eng_momentum(const float* g, float* buf, float* u, long n, const float* mu_p, int nesterov) {
    const float mu = mu_p[0];
    for (long i = first_index(); i < n; i += grid_stride()) {
        const float b = buf[i] * mu + g[i];
        buf[i] = b;
        u[i] = nesterov ? g[i] + b * mu : b;
    }
}

// Each row of `cols` divided by max(its norm, eps) (MuonEq-R's row equalisation). Warp per row.
extern "C" __global__ void eng_row_normalize(float* x, long rows, int cols, float eps) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    float* xr = x + r * cols;
    float s = 0.f;
    for (int j = lane; j < cols; j += 32) s += xr[j] * xr[j];
    const float inv = 1.f / fmaxf(sqrtf(warp_sum(s)), eps);
    for (int j = lane; j < cols; j += 32) xr[j] *= inv;
}

// Each of the `count` matrices of `len` elements divided by (its Frobenius norm + eps) (the
// start of Newton-Schulz). Block per matrix.
extern "C" __global__ void eng_normalize_each(float* x, long len, float eps) {
    __shared__ float sh[8];
    float* m = x + (long)blockIdx.x * len;
    float s = 0.f;
    for (long i = threadIdx.x; i < len; i += blockDim.x) s += m[i] * m[i];
    const float inv = 1.f / (sqrtf(block_sum(s, sh)) + eps);
    for (long i = threadIdx.x; i < len; i += blockDim.x) m[i] *= inv;
}

// dst[k][c][r] = src[k][r][c] for `count` matrices of rows x cols (count = gridDim.y).
extern "C" __global__ void eng_transpose_each(const float* src, float* dst, int rows, int cols) {
    const long len = (long)rows * cols, base = (long)blockIdx.y * len;
    for (long i = first_index(); i < len; i += grid_stride()) {
        const long r = i / cols, c = i % cols;
        dst[base + c * rows + r] = src[base + i];
    }
}

// ---- per-channel sums --------------------------------------------------------------------

// The two passes of ops/colsum.cuh.

// The first level of a long sum (src/engine/gpu/ops.rs `colsum`): group g = blockIdx.y adds the
// partials [g per, (g + 1) per) in order, mid[g][c] = sum of part[p * stride + c], so that
// `groups x width / 256` blocks share the reading; eng_colsum_finish then adds the groups.
extern "C" __global__ void eng_colsum_groups(const float* part, int parts, int stride, int width, int per, float* mid) {
    const int p0 = blockIdx.y * per, p1 = min(p0 + per, parts);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x)
        mid[(long)blockIdx.y * width + c] = ops::column_total(part + (long)p0 * stride, p1 - p0, stride, c);
}

// dst[c] += the sum over p of part[p * stride + c] for c < width, p in order.
extern "C" __global__ void eng_colsum_finish(const float* part, int parts, int stride, int width, float* dst) {
    for (long c = first_index(); c < width; c += grid_stride()) dst[c] += ops::column_total(part, parts, stride, c);
}

// part[blk][c] = the sum of a[r][c] over the block's PART rows (blockIdx.y).
extern "C" __global__ void eng_colsum_partial(const float* a, long rows, int cols, float* part) {
    const long r0 = (long)blockIdx.y * PART, r1 = min(r0 + PART, rows);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
        part[(long)blockIdx.y * cols + c] = ops::column_sum(a, r0, r1, cols, c);
}
