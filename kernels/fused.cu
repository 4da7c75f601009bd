// The GPU kernels of the model's fused ops (see src/model/cuda/fused.rs for the launches and
// src/model/ops/, one file per op, for the CPU references they are checked against). The device
// maths of the ops the explicit engine (kernels/engine.cu) has too lives in kernels/ops/, one
// header per op, shared by both; this file keeps the entry points, their launch geometry and
// the ops only the model has (causal softmax, the 16-byte-chunk norm_rope, the ballot search of
// the embedding's gradient, the casts). Every kernel gives one warp to one row: the rows here
// are short (a head's 64 values, a token's 512 channels, a query's 1024 keys), so a warp reads a
// row with coalesced loads, reduces it with shuffles and writes it once; blocks hold 8 rows.
//
// Arithmetic is in float32 whatever the storage type (float32 or bfloat16). Under mixed
// precision the residual stream is float32 and the products around it bfloat16: the RMS norm,
// scale and sum kernels then read one type and write the other (the `_f32_bf16` instantiations),
// so that no separate cast pass runs; their results equal a float32 kernel followed by a cast.
// The transcendental functions are the fast intrinsics (`ops::Fast`: rsqrtf, __expf).
#include <cuda_bf16.h>
#include <math_constants.h>

#include "ops/act.cuh"
#include "ops/colsum.cuh"
#include "ops/common.cuh"
#include "ops/qk_norm_rope.cuh"
#include "ops/reduce.cuh"
#include "ops/rms_norm.cuh"
#include "ops/scale.cuh"
#include "ops/softcap_ce.cuh"
#include "ops/vec.cuh"

namespace {

using ops::Fast;
using ops::load;
using ops::store;
using ops::warp_max;
using ops::warp_row;
using ops::warp_sum;

// p[r, j] = exp(scale * s[r, j] - m) / z over the keys j <= i of row r's query position
// i = r % t (m the row's maximum, z its sum); 0 for the future keys j > i.
template <typename T>
__device__ void causal_softmax_fwd(const T* s, T* p, long rows, int t, float scale) {
    long r = warp_row(rows);
    if (r < 0) return;
    int lane = threadIdx.x & 31, i = (int)(r % t);
    const T* sr = s + r * t;
    T* pr = p + r * t;
    float m = -CUDART_INF_F;
    for (int j = lane; j <= i; j += 32) m = fmaxf(m, scale * load(sr, j));
    m = warp_max(m);
    float z = 0.f;
    for (int j = lane; j <= i; j += 32) z += __expf(scale * load(sr, j) - m);
    float inv = 1.f / warp_sum(z);
    for (int j = lane; j < t; j += 32) store(pr, j, j <= i ? __expf(scale * load(sr, j) - m) * inv : 0.f);
}

// ds[r, j] = scale * p[r, j] * (g[r, j] - sum_k p[r, k] g[r, k]): the gradient of the scores
// given the probabilities p and their gradient g (0 for the future keys, where p is 0).
template <typename T>
__device__ void causal_softmax_bwd(const T* p, const T* g, T* ds, long rows, int t, float scale) {
    long r = warp_row(rows);
    if (r < 0) return;
    int lane = threadIdx.x & 31, i = (int)(r % t);
    const T* pr = p + r * t;
    const T* gr = g + r * t;
    T* dr = ds + r * t;
    float dot = 0.f;
    for (int j = lane; j <= i; j += 32) dot += load(pr, j) * load(gr, j);
    dot = warp_sum(dot);
    for (int j = lane; j < t; j += 32) store(dr, j, j <= i ? scale * load(pr, j) * (load(gr, j) - dot) : 0.f);
}

// RMS norm (ops/rms_norm.cuh, scale 1) over rows of d: y = x / sqrt(mean(x^2) + eps), stored
// as TY; dx for a gradient g stored as TG, recomputing 1 / r.
template <typename T, typename TY = T>
__device__ void rms_norm_fwd(const T* x, TY* y, long rows, int d, float eps) {
    long r = warp_row(rows);
    if (r < 0) return;
    ops::rms_norm_row<Fast>(x + r * d, y + r * d, d, eps, 1.f);
}

template <typename T, typename TG = T>
__device__ void rms_norm_bwd(const T* x, const TG* g, T* dx, long rows, int d, float eps) {
    long r = warp_row(rows);
    if (r < 0) return;
    const T* xr = x + r * d;
    const TG* gr = g + r * d;
    float ss, xg;
    ops::row_sum_sq_dot(xr, gr, d, ss, xg);
    ops::rms_norm_bwd_row(xr, gr, dx + r * d, d, ops::rms_rstd<Fast>(ss, d, eps), xg, 1.f, false);
}

// relu(x)^2 and its gradient 2 relu(x) g (ops/act.cuh), elementwise (rows only for the launch
// geometry).
template <typename T>
__device__ void relu_sq_fwd(const T* x, T* y, long rows, int d, float) {
    long r = warp_row(rows);
    if (r < 0) return;
    for (int j = threadIdx.x & 31; j < d; j += 32) store(y, r * d + j, ops::act_sq(ops::relu(load(x, r * d + j))));
}

template <typename T>
__device__ void relu_sq_bwd(const T* x, const T* g, T* dx, long rows, int d, float) {
    long r = warp_row(rows);
    if (r < 0) return;
    for (int j = threadIdx.x & 31; j < d; j += 32)
        store(dx, r * d + j, ops::act_sq_grad(ops::relu(load(x, r * d + j)), 1.f, load(g, r * d + j)));
}

// Soft-capped cross-entropy per row of v logits (ops/softcap_ce.cuh), in float32 whatever the
// logits' storage (bf16 logits read as they are: the script's `logits.float()` without a pass of
// its own). A target outside 0..v gives a NaN loss (the CPU op reports it as an error; the GPU
// cannot stop the step).
template <typename T>
__device__ void softcap_ce_fwd(const T* x, const unsigned* targets, float* loss, long rows, int v, float cap) {
    long r = warp_row(rows);
    if (r < 0) return;
    int lane = threadIdx.x & 31;
    const T* xr = x + r * v;
    float inv = 1.f / cap, m = -CUDART_INF_F;
    for (int j = lane; j < v; j += 32) m = fmaxf(m, load(xr, j));
    // tanh is increasing: the largest logit gives the largest capped one.
    float zmax = cap * ops::softcap_tanh(warp_max(m), inv), s = 0.f;
    for (int j = lane; j < v; j += 32) s += Fast::exp(cap * ops::softcap_tanh(load(xr, j), inv) - zmax);
    s = warp_sum(s);
    unsigned y = targets[r];
    if (lane == 0) loss[r] = ops::softcap_ce_loss(s, zmax, cap, ops::target_tanh(xr, y, v, inv));
}

// Its gradient for per-row loss gradients g, the row's logsumexp recovered from its loss as
// loss + z[target]. `lg` is (2, rows): the losses, then their gradients.
template <typename T>
__device__ void softcap_ce_bwd(const T* x, const unsigned* targets, const float* lg, T* dx, long rows, int v, float cap) {
    long r = warp_row(rows);
    if (r < 0) return;
    int lane = threadIdx.x & 31;
    const T* xr = x + r * v;
    T* dr = dx + r * v;
    float inv = 1.f / cap, g = lg[rows + r];
    unsigned y = targets[r];
    float ty = ops::target_tanh(xr, y, v, inv);
    float lse = lg[r] + cap * ty;
    for (int j = lane; j < v; j += 32) {
        float t = ops::softcap_tanh(load(xr, j), inv);
        float d = Fast::exp(cap * t - lse) * ops::tanh_slope(t) * g;
        if (j == (int)y) d -= ops::tanh_slope(ty) * g;
        store(dr, j, d);
    }
}

// Per-head RMS norm then RoPE (ops/qk_norm_rope.cuh: every value rotated, no gain) on
// token-major rows: row r is head (r % heads) of token n = r / heads, at position p = n % seq;
// `table` is (seq, d) = [cos | sin] of (seq, d/2) each.
template <typename T>
__device__ void norm_rope_fwd(const T* x, const T* table, T* out, long rows, int d, float eps, int heads, int seq) {
    long r = warp_row(rows);
    if (r < 0) return;
    const int half = d / 2;
    const T* tr = table + (long)((r / heads) % seq) * d;
    ops::norm_rope_row<Fast, false>(x + r * d, out + r * d, tr, tr + half, d, half, eps, 1.f);
}

// Its gradient: one sweep for sum(x^2) and sum(x dy) (dy the rotated-back gradient), then the
// write.
template <typename T>
__device__ void norm_rope_bwd(const T* x, const T* g, const T* table, T* dx, long rows, int d, float eps, int heads,
                              int seq) {
    long r = warp_row(rows);
    if (r < 0) return;
    int lane = threadIdx.x & 31, half = d / 2;
    const T* xr = x + r * d;
    const T* gr = g + r * d;
    const T* tr = table + (long)((r / heads) % seq) * d;
    float ss = 0.f, xdy = 0.f;
    for (int i = lane; i < half; i += 32) {
        float x1 = load(xr, i), x2 = load(xr, i + half);
        float g1 = load(gr, i), g2 = load(gr, i + half);
        float c = load(tr, i), s = load(tr, half + i);
        ss += x1 * x1 + x2 * x2;
        xdy += x1 * ops::unrope_lo(g1, g2, c, s) + x2 * ops::unrope_hi(g1, g2, c, s);
    }
    ss = warp_sum(ss);
    xdy = warp_sum(xdy);
    float inv = ops::rms_rstd<Fast>(ss, d, eps);
    float k = xdy / d * inv * inv * inv;
    ops::norm_rope_bwd_row<false>(xr, gr, dx + r * d, tr, tr + half, d, half, inv, k, 1.f);
}

// The same two kernels on 16-byte chunks: a row of d values is L = d / E chunks of E = 16 /
// sizeof(T) values (4 floats, 8 bf16), one chunk per lane, so a warp holds 32 / L rows and each
// lane makes one 16-byte load per tensor instead of E / 2 narrow ones per half (the warp-per-row
// kernels above keep one 64-value bf16 head row of 128 bytes in flight per warp, a third of the
// memory bandwidth). The rotation partner of chunk c < L/2 is chunk c + L/2, lane ^ (L/2): its
// values come by shuffle. For d % (2E) == 0, L a power of two up to 32 and 16-byte aligned rows
// (the launch checks, and takes the kernels above otherwise). Lanes past the last row load
// zeros and store nothing, but take part in every shuffle.
using ops::pack;
using ops::shfl_xor;
using ops::unpack;
// The sum of v over the L lanes of this lane's row (an aligned group of L lanes).
using ops::group_sum;

// This lane's row and chunk, whether the row exists, and its chunks of x and of the row's cos
// and sin (zeros past the last row).
template <typename T>
struct RopeChunk {
    static constexpr int E = 16 / sizeof(T);
    int L, c;
    long r;
    bool live;
    uint4 xu;
    float x[E], cs[E], sn[E];

    __device__ RopeChunk(const T* xs, const T* table, long rows, int d, int heads, int seq) {
        L = d / E;
        c = (threadIdx.x & 31) % L;
        r = ((long)blockIdx.x * blockDim.x + threadIdx.x) / L;
        live = r < rows;
        xu = uint4{0u, 0u, 0u, 0u};
        uint4 cu = xu, su = xu;
        if (live) {
            const T* tr = table + (long)((r / heads) % seq) * d;
            const int tc = (c % (L / 2)) * E;  // the chunk's column in the cos half
            xu = *reinterpret_cast<const uint4*>(xs + r * d + c * E);
            cu = *reinterpret_cast<const uint4*>(tr + tc);
            su = *reinterpret_cast<const uint4*>(tr + d / 2 + tc);
        }
        unpack(xu, x);
        unpack(cu, cs);
        unpack(su, sn);
    }
};

template <typename T>
__device__ void norm_rope_vec_fwd(const T* x, const T* table, T* out, long rows, int d, float eps, int heads, int seq) {
    RopeChunk<T> k(x, table, rows, d, heads, seq);
    constexpr int E = RopeChunk<T>::E;
    float ss = 0.f;
    for (int e = 0; e < E; ++e) ss += k.x[e] * k.x[e];
    const float inv = ops::rms_rstd<Fast>(group_sum(ss, k.L), d, eps);
    float p[E], o[E];
    unpack(shfl_xor(k.xu, k.L / 2), p);
    // First half: y1 c + y2 s (this lane y1, the partner y2); second half: y2 c - y1 s.
    const bool first = k.c < k.L / 2;
    for (int e = 0; e < E; ++e) {
        const float y = k.x[e] * inv, q = p[e] * inv;
        o[e] = first ? ops::rope_lo(y, q, k.cs[e], k.sn[e]) : ops::rope_hi(q, y, k.cs[e], k.sn[e]);
    }
    if (k.live) *reinterpret_cast<uint4*>(out + k.r * d + k.c * E) = pack(o);
}

template <typename T>
__device__ void norm_rope_vec_bwd(const T* x, const T* g, const T* table, T* dx, long rows, int d, float eps, int heads,
                                  int seq) {
    RopeChunk<T> k(x, table, rows, d, heads, seq);
    constexpr int E = RopeChunk<T>::E;
    const uint4 gu = k.live ? *reinterpret_cast<const uint4*>(g + k.r * d + k.c * E) : uint4{0u, 0u, 0u, 0u};
    float gv[E], p[E], dy[E];
    unpack(gu, gv);
    unpack(shfl_xor(gu, k.L / 2), p);
    // First half: dy1 = g1 c - g2 s (this lane g1); second half: dy2 = g1 s + g2 c (this lane g2).
    const bool first = k.c < k.L / 2;
    float ss = 0.f, xdy = 0.f;
    for (int e = 0; e < E; ++e) {
        dy[e] = first ? ops::unrope_lo(gv[e], p[e], k.cs[e], k.sn[e]) : ops::unrope_hi(p[e], gv[e], k.cs[e], k.sn[e]);
        ss += k.x[e] * k.x[e];
        xdy += k.x[e] * dy[e];
    }
    ss = group_sum(ss, k.L);
    xdy = group_sum(xdy, k.L);
    const float inv = ops::rms_rstd<Fast>(ss, d, eps);
    const float kk = xdy / d * inv * inv * inv;
    float o[E];
    for (int e = 0; e < E; ++e) o[e] = dy[e] * inv - k.x[e] * kk;
    if (k.live) *reinterpret_cast<uint4*>(dx + k.r * d + k.c * E) = pack(o);
}

// Per-channel scales on rows of d channels (ops/scale.cuh; s, mix: the extra inputs, of d and
// 2 d values): x * s (stored as TO), base + x * s (x stored as TX), and the residual mix
// h * mix[0] + x0 * mix[1].
template <typename T, typename TO = T>
__device__ void scale_cols(const T* x, const T* sc, TO* y, long rows, int d, float) {
    long r = warp_row(rows);
    if (r < 0) return;
    for (int j = threadIdx.x & 31; j < d; j += 32) store(y, r * d + j, ops::scaled(load(x, r * d + j), load(sc, j)));
}

template <typename T, typename TX = T>
__device__ void scale_add(const T* base, const TX* x, const T* sc, T* y, long rows, int d, float) {
    long r = warp_row(rows);
    if (r < 0) return;
    for (int j = threadIdx.x & 31; j < d; j += 32)
        store(y, r * d + j, ops::add_scaled(load(base, r * d + j), load(x, r * d + j), load(sc, j)));
}

template <typename T>
__device__ void resid_mix(const T* h, const T* x0, const T* mix, T* y, long rows, int d, float) {
    long r = warp_row(rows);
    if (r < 0) return;
    for (int j = threadIdx.x & 31; j < d; j += 32)
        store(y, r * d + j, ops::mixed(load(h, r * d + j), load(x0, r * d + j), load(mix, j), load(mix, d + j)));
}

// The gradient of an embedding lookup: dw[v, j] = sum of g[i, j] over the tokens i with
// ids[i] == v, in token order (deterministic, no atomics). Block (v, y) owns vocabulary row v,
// channels y * blockDim.x + tid; each warp finds the matching tokens 32 at a time with a ballot.
template <typename T>
__device__ void embedding_bwd(const unsigned* ids, const T* g, T* dw, long n, int c) {
    unsigned v = blockIdx.x;
    int j = blockIdx.y * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    float acc = 0.f;
    for (long base = 0; base < n; base += 32) {
        long i = base + lane;
        unsigned id = i < n ? ids[i] : 0xffffffffu;
        unsigned mask = __ballot_sync(0xffffffffu, id == v);
        while (mask) {
            int b = __ffs(mask) - 1;
            mask &= mask - 1;
            if (j < c) acc += load(g, (base + b) * c + j);
        }
    }
    if (j < c) store(dw, (long)v * c + j, acc);
}

// Per-channel sums over rows of a * b (a, b: rows x c) in ops/colsum.cuh's two passes: partial
// sums of `chunk` rows per block row, then the partials added in chunk order.
template <typename T, typename TB = T>
__device__ void column_dot_partial(const T* a, const TB* b, float* partial, long rows, int c, int chunk) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    long r0 = (long)blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    partial[(long)blockIdx.y * c + j] = ops::column_dot(a, b, r0, r1, c, j);
}

template <typename T>
__device__ void column_dot_sum(const float* partial, T* out, int chunks, int c) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    store(out, j, ops::column_total(partial, chunks, c, j));
}

}  // namespace

#define FOR_TYPES(X) X(f32, float) X(bf16, __nv_bfloat16)

// Forward and backward kernels of the row ops that share one signature: OP_fwd(x, y, rows, len,
// param) and OP_bwd(x, g, dx, rows, len, param), for each storage type.
#define ROW_PAIR(op, name, T)                                                                               \
    extern "C" __global__ void op##_fwd_##name(const T* x, T* y, long rows, int len, float p) {            \
        op##_fwd<T>(x, y, rows, len, p);                                                                   \
    }                                                                                                      \
    extern "C" __global__ void op##_bwd_##name(const T* x, const T* g, T* dx, long rows, int len, float p) { \
        op##_bwd<T>(x, g, dx, rows, len, p);                                                               \
    }
#define SOFTMAX(name, T) ROW_PAIR(causal_softmax, name, T)
#define RMS(name, T) ROW_PAIR(rms_norm, name, T)
#define RELU(name, T) ROW_PAIR(relu_sq, name, T)
FOR_TYPES(SOFTMAX)
FOR_TYPES(RMS)
FOR_TYPES(RELU)

// Mixed precision: a float32 residual stream, bfloat16 products (see the file's head).
typedef __nv_bfloat16 bf16_t;
extern "C" __global__ void rms_norm_fwd_f32_bf16(const float* x, bf16_t* y, long rows, int len, float eps) {
    rms_norm_fwd<float, bf16_t>(x, y, rows, len, eps);
}
extern "C" __global__ void rms_norm_bwd_f32_bf16(const float* x, const bf16_t* g, float* dx, long rows, int len,
                                                 float eps) {
    rms_norm_bwd<float, bf16_t>(x, g, dx, rows, len, eps);
}
extern "C" __global__ void scale_cols_f32_bf16(const float* x, const float* s, bf16_t* y, long rows, int d, float p) {
    scale_cols<float, bf16_t>(x, s, y, rows, d, p);
}
extern "C" __global__ void scale_add_f32_bf16(const float* b, const bf16_t* x, const float* s, float* y, long rows,
                                              int d, float p) {
    scale_add<float, bf16_t>(b, x, s, y, rows, d, p);
}
extern "C" __global__ void column_dot_partial_f32_bf16(const float* a, const bf16_t* b, float* partial, long rows, int c,
                                                       int chunk) {
    column_dot_partial<float, bf16_t>(a, b, partial, rows, c, chunk);
}

#define NORM_ROPE(name, T)                                                                                 \
    extern "C" __global__ void norm_rope_fwd_##name(const T* x, const T* table, T* out, long rows, int d, \
                                                    float eps, int heads, int seq) {                       \
        norm_rope_fwd<T>(x, table, out, rows, d, eps, heads, seq);                                         \
    }                                                                                                      \
    extern "C" __global__ void norm_rope_bwd_##name(const T* x, const T* g, const T* table, T* dx,         \
                                                    long rows, int d, float eps, int heads, int seq) {     \
        norm_rope_bwd<T>(x, g, table, dx, rows, d, eps, heads, seq);                                       \
    }
FOR_TYPES(NORM_ROPE)

#define NORM_ROPE_VEC(name, T)                                                                             \
    extern "C" __global__ void norm_rope_vec_fwd_##name(const T* x, const T* table, T* out, long rows,     \
                                                        int d, float eps, int heads, int seq) {            \
        norm_rope_vec_fwd<T>(x, table, out, rows, d, eps, heads, seq);                                     \
    }                                                                                                      \
    extern "C" __global__ void norm_rope_vec_bwd_##name(const T* x, const T* g, const T* table, T* dx,     \
                                                        long rows, int d, float eps, int heads, int seq) { \
        norm_rope_vec_bwd<T>(x, g, table, dx, rows, d, eps, heads, seq);                                   \
    }
FOR_TYPES(NORM_ROPE_VEC)

#define SCALES(name, T)                                                                                    \
    extern "C" __global__ void scale_cols_##name(const T* x, const T* s, T* y, long rows, int d, float p) { \
        scale_cols<T>(x, s, y, rows, d, p);                                                                \
    }                                                                                                      \
    extern "C" __global__ void scale_add_##name(const T* b, const T* x, const T* s, T* y, long rows, int d, \
                                                float p) {                                                 \
        scale_add<T>(b, x, s, y, rows, d, p);                                                              \
    }                                                                                                      \
    extern "C" __global__ void resid_mix_##name(const T* h, const T* x0, const T* m, T* y, long rows, int d, \
                                                float p) {                                                 \
        resid_mix<T>(h, x0, m, y, rows, d, p);                                                             \
    }
FOR_TYPES(SCALES)

#define SOFTCAP_CE(name, T)                                                                                \
    extern "C" __global__ void softcap_ce_fwd_##name(const T* x, const unsigned* targets, float* loss, long rows, \
                                                     int v, float cap) {                                   \
        softcap_ce_fwd<T>(x, targets, loss, rows, v, cap);                                                 \
    }                                                                                                      \
    extern "C" __global__ void softcap_ce_bwd_##name(const T* x, const unsigned* targets, const float* lg,  \
                                                     T* dx, long rows, int v, float cap) {                 \
        softcap_ce_bwd<T>(x, targets, lg, dx, rows, v, cap);                                               \
    }
FOR_TYPES(SOFTCAP_CE)

#define EMBEDDING(name, T)                                                                                 \
    extern "C" __global__ void embedding_bwd_##name(const unsigned* ids, const T* g, T* dw, long n, int c) { \
        embedding_bwd<T>(ids, g, dw, n, c);                                                                \
    }
FOR_TYPES(EMBEDDING)

#define COLUMN_DOT(name, T)                                                                                \
    extern "C" __global__ void column_dot_partial_##name(const T* a, const T* b, float* partial, long rows,  \
                                                         int c, int chunk) {                               \
        column_dot_partial<T>(a, b, partial, rows, c, chunk);                                              \
    }                                                                                                      \
    extern "C" __global__ void column_dot_sum_##name(const float* partial, T* out, int chunks, int c) {    \
        column_dot_sum<T>(partial, out, chunks, c);                                                        \
    }
FOR_TYPES(COLUMN_DOT)

// Casts between float32 and bfloat16 (round to nearest even), 8 values per thread and step
// with 16-byte bf16 accesses; n8 = n / 8 full groups, the tail by the first threads.
extern "C" __global__ void cast_f32_to_bf16(const float* x, __nv_bfloat16* y, long n) {
    long n8 = n / 8, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
        float4 a = reinterpret_cast<const float4*>(x)[2 * i], b = reinterpret_cast<const float4*>(x)[2 * i + 1];
        __nv_bfloat162 o[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w), __floats2bfloat162_rn(b.x, b.y),
                               __floats2bfloat162_rn(b.z, b.w)};
        reinterpret_cast<uint4*>(y)[i] = *reinterpret_cast<uint4*>(o);
    }
    long i = n8 * 8 + (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}

extern "C" __global__ void cast_bf16_to_f32(const __nv_bfloat16* x, float* y, long n) {
    long n8 = n / 8, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
        uint4 v = reinterpret_cast<const uint4*>(x)[i];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
        float2 p0 = __bfloat1622float2(h[0]), p1 = __bfloat1622float2(h[1]), p2 = __bfloat1622float2(h[2]), p3 = __bfloat1622float2(h[3]);
        reinterpret_cast<float4*>(y)[2 * i] = make_float4(p0.x, p0.y, p1.x, p1.y);
        reinterpret_cast<float4*>(y)[2 * i + 1] = make_float4(p2.x, p2.y, p3.x, p3.y);
    }
    long i = n8 * 8 + (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __bfloat162float(x[i]);
}
