// Causal flash attention with grouped KV heads, bf16 in and out, float32 softmax and
// accumulation, on tensor cores (WMMA 16x16x16). Launched from src/model/flash_attn/cuda.rs; the CPU
// reference it is checked against is the token-major attention of src/model/ops/attention.rs.
//
// Layout: token-major matrices as the model keeps them. q and o are (B*T, H*64), k and v are
// (B*T, K*64); query head h reads KV head h / (H / K). Nothing of size (T, T) is stored: the
// forward pass keeps, per query row, the base-2 log-sum-exp of its scaled scores
// (lse2 = max + log2(sum), (B*H, T) float32), and the backward pass recomputes the
// probabilities from it.
//
// Every block has four warps; each warp owns 16 rows of the block's 64 (queries in the forward
// and dq kernels, keys in the dk/dv kernel) and walks the other side in tiles of 64 staged in
// shared memory. A lane handles half a row (32 columns) of its warp's 16 x 64 score tile for
// the softmax arithmetic. The backward pass is two kernels, dk/dv (block per key tile and KV
// head, summing over the group's query heads in order) and dq (block per query tile and head),
// so that no gradient is accumulated with atomics: results do not depend on scheduling.
//
// Requirements (checked by the launcher): head dim 64, T a multiple of 64, 16-byte aligned rows.
#include <cuda_bf16.h>
#include <math_constants.h>
#include <mma.h>

using namespace nvcuda;
typedef __nv_bfloat16 bf16;

namespace {

constexpr int D = 64;      // head dim
constexpr int TILE = 64;   // rows per block and columns per inner tile
constexpr int WARPS = 4;   // each owns 16 of the block's rows
constexpr int WR = 16;     // rows per warp
constexpr int KS = D / 16; // 16-wide steps over the head dim (and over a tile)
constexpr unsigned FULL = 0xffffffffu;
// Row strides in shared memory, padded so that the rows of a fragment fall on different banks:
// bf16 tiles and probability rows 72 (144 bytes), float score rows 68.
constexpr int LDT = D + 8;
constexpr int LDS = TILE + 4;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// Copies 64 rows of 64 values (row stride `ld` elements) into a [64][LDT] tile, 16 bytes per
// thread and step.
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, long ld) {
    for (int i = threadIdx.x; i < TILE * D / 8; i += blockDim.x) {
        int r = i / (D / 8), c = (i % (D / 8)) * 8;
        *reinterpret_cast<uint4*>(dst + r * LDT + c) = *reinterpret_cast<const uint4*>(src + r * ld + c);
    }
}

// The column of the lane's j-th value (j < 32) of its row: the two lanes of a row take the even
// and the odd columns, so that at every j the warp's 32 lanes touch at most two words per bank
// of the float scores (row stride LDS) and of the bf16 rows (stride LDT).
__device__ __forceinline__ int col(int j, int lane) {
    return (lane & 1) + 2 * j;
}

// out[16 x 64] (row stride LDS) = A[16 x 64] (fragments in registers) times the transpose of
// the tile [64][LDT]: row j of the tile is column j of the product.
__device__ __forceinline__ void mul_transposed(float* out, const FragA (&a)[KS], const bf16* tile) {
#pragma unroll
    for (int n = 0; n < TILE / 16; ++n) {
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            FragBt b;
            wmma::load_matrix_sync(b, tile + n * 16 * LDT + kk * 16, LDT);
            wmma::mma_sync(acc, a[kk], b, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, LDS, wmma::mem_row_major);
    }
}

// acc[16 x 64] += A[16 x 64] (bf16 in shared memory, row stride LDT) times the tile [64][LDT].
__device__ __forceinline__ void mul_add(FragC (&acc)[KS], const bf16* a, const bf16* tile) {
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) {
        FragA fa;
        wmma::load_matrix_sync(fa, a + kk * 16, LDT);
#pragma unroll
        for (int n = 0; n < KS; ++n) {
            FragB b;
            wmma::load_matrix_sync(b, tile + kk * 16 * LDT + n * 16, LDT);
            wmma::mma_sync(acc[n], fa, b, acc[n]);
        }
    }
}

// Writes the warp's 16 x 64 accumulator times `scale` as bf16 rows of `out` (row stride `ld`),
// through the warp's float scratch; lane handles half of row `r`.
__device__ __forceinline__ void write_rows(bf16* out, long ld, FragC (&acc)[KS], float* scratch, int r, int c0, float scale) {
    __syncwarp();
#pragma unroll
    for (int n = 0; n < KS; ++n) wmma::store_matrix_sync(scratch + n * 16, acc[n], LDS, wmma::mem_row_major);
    __syncwarp();
    bf16* row = out + r * ld + c0;
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
        *reinterpret_cast<__nv_bfloat162*>(row + j) =
            __floats2bfloat162_rn(scratch[r * LDS + c0 + j] * scale, scratch[r * LDS + c0 + j + 1] * scale);
    }
}

// Multiplies the warp's 16 x 64 accumulator's rows by the lanes' `alpha` (lane handles half of
// row `r`), through the scratch: fragment layouts are opaque. Skipped when no row changes.
__device__ __forceinline__ void scale_rows(FragC (&acc)[KS], float* scratch, int r, int lane, float alpha) {
    if (__all_sync(FULL, alpha == 1.f)) return;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < KS; ++n) wmma::store_matrix_sync(scratch + n * 16, acc[n], LDS, wmma::mem_row_major);
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 32; ++j) scratch[r * LDS + col(j, lane)] *= alpha;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < KS; ++n) wmma::load_matrix_sync(acc[n], scratch + n * 16, LDS, wmma::mem_row_major);
}

// Where a block of the forward and dq kernels works, and what its thread handles: query tile
// qt (the longest rows first) of (batch b, head h) blockIdx.y, KV head kvh; warp w owns rows
// row0.. row0+15 and its lane half of row r (query qi), columns from c0.
struct QueryTile {
    int qt, bh, b, h, kvh, w, lane, r, c0, row0, qi;
    long ldq, ldk, kv;  // row strides of q and k/v; offset of this (batch, KV head) in k and v
    __device__ QueryTile(int t, int heads, int kv_heads)
        : qt(t / TILE - 1 - blockIdx.x), bh(blockIdx.y), b(bh / heads), h(bh % heads), kvh(h / (heads / kv_heads)),
          w(threadIdx.x / 32), lane(threadIdx.x & 31), r(lane >> 1), c0((lane & 1) * 32), row0(qt * TILE + w * WR), qi(row0 + r),
          ldq((long)heads * D), ldk((long)kv_heads * D), kv((long)b * t * ldk + kvh * D) {}
    // Offset of this warp's first row of head h in q-shaped matrices.
    __device__ long q_rows(int t) const { return ((long)b * t + row0) * ldq + h * D; }
};

// Stages key/value tile kt of a (batch, KV head) into shared memory, after every warp is done
// with the previous one.
__device__ __forceinline__ void load_kv(bf16* ks, bf16* vs, const bf16* kb, const bf16* vb, int kt, long ldk) {
    __syncthreads();
    load_tile(ks, kb + (long)kt * TILE * ldk, ldk);
    load_tile(vs, vb + (long)kt * TILE * ldk, ldk);
    __syncthreads();
}

}  // namespace

// Forward: o and lse2 for query tile (T/64 - 1 - blockIdx.x) of (batch, head) blockIdx.y.
// scale_log2 = log2(e) / sqrt(64).
extern "C" __global__ void __launch_bounds__(128)
    flash_fwd_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse2, int t, int heads, int kv_heads, float scale_log2) {
    __shared__ __align__(32) bf16 ks[TILE * LDT];
    __shared__ __align__(32) bf16 vs[TILE * LDT];
    __shared__ __align__(32) bf16 ps[WARPS][WR * LDT];
    __shared__ __align__(32) float sc[WARPS][WR * LDS];
    const QueryTile at(t, heads, kv_heads);
    const int lane = at.lane, r = at.r, qi = at.qi;
    float* s = sc[at.w];
    bf16* p = ps[at.w];

    FragA qf[KS];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) wmma::load_matrix_sync(qf[kk], q + at.q_rows(t) + kk * 16, at.ldq);
    FragC of[KS];
#pragma unroll
    for (int n = 0; n < KS; ++n) wmma::fill_fragment(of[n], 0.f);
    float m = -CUDART_INF_F, l = 0.f;

    for (int kt = 0; kt <= at.qt; ++kt) {
        load_kv(ks, vs, k + at.kv, v + at.kv, kt, at.ldk);
        mul_transposed(s, qf, ks);
        __syncwarp();
        // Online softmax over this tile (every row has at least key kt*64 <= qi unmasked).
        float x[32], mx = -CUDART_INF_F;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int c = col(j, lane);
            x[j] = kt * TILE + c <= qi ? s[r * LDS + c] * scale_log2 : -CUDART_INF_F;
            mx = fmaxf(mx, x[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
        const float mn = fmaxf(m, mx), alpha = exp2f(m - mn);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const float pv = exp2f(x[j] - mn);
            sum += pv;
            p[r * LDT + col(j, lane)] = __float2bfloat16(pv);
        }
        sum += __shfl_xor_sync(FULL, sum, 1);
        l = l * alpha + sum;
        m = mn;
        scale_rows(of, s, r, lane, alpha);
        __syncwarp();
        mul_add(of, p, vs);
    }
    write_rows(o + at.q_rows(t), at.ldq, of, s, r, at.c0, 1.f / l);
    if ((lane & 1) == 0) lse2[(long)at.bh * t + qi] = m + log2f(l);
}

// delta[(b*H + h)*T + i] = sum_d o[i, h, d] * go[i, h, d], one warp per (token, head) row.
extern "C" __global__ void flash_delta_bf16(const bf16* o, const bf16* go, float* delta, long rows, int t, int heads) {
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const __nv_bfloat162 a = reinterpret_cast<const __nv_bfloat162*>(o + row * D)[lane];
    const __nv_bfloat162 g = reinterpret_cast<const __nv_bfloat162*>(go + row * D)[lane];
    float acc = __low2float(a) * __low2float(g) + __high2float(a) * __high2float(g);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(FULL, acc, off);
    if (lane == 0) {
        const long n = row / heads, h = row % heads, b = n / t, i = n % t;
        delta[(b * heads + h) * t + i] = acc;
    }
}

// dk and dv for key tile blockIdx.x of (batch, KV head) blockIdx.y, summed over the group's
// query heads in order. scale = 1/sqrt(64).
extern "C" __global__ void __launch_bounds__(128) flash_bwd_dkdv_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* go,
                                                                     const float* lse2, const float* delta, bf16* dk, bf16* dv,
                                                                     int t, int heads, int kv_heads, float scale_log2, float scale) {
    __shared__ __align__(32) bf16 qs[TILE * LDT];
    __shared__ __align__(32) bf16 gs[TILE * LDT];
    __shared__ __align__(32) bf16 bufs[WARPS][WR * LDT];
    __shared__ __align__(32) float sc[WARPS][WR * LDS];
    __shared__ float ls[TILE], dl[TILE];
    const int nt = t / TILE, kt = blockIdx.x;  // the longest columns (kt = 0) first
    const int b = blockIdx.y / kv_heads, kvh = blockIdx.y % kv_heads, group = heads / kv_heads;
    const long ldq = (long)heads * D, ldk = (long)kv_heads * D;
    const int w = threadIdx.x / 32, lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 32;
    const int row0 = kt * TILE + w * WR, kj = row0 + r;
    float* s = sc[w];
    bf16* buf = bufs[w];

    FragA kf[KS], vf[KS];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        wmma::load_matrix_sync(kf[kk], k + ((long)b * t + row0) * ldk + kvh * D + kk * 16, ldk);
        wmma::load_matrix_sync(vf[kk], v + ((long)b * t + row0) * ldk + kvh * D + kk * 16, ldk);
    }
    FragC dkf[KS], dvf[KS];
#pragma unroll
    for (int n = 0; n < KS; ++n) {
        wmma::fill_fragment(dkf[n], 0.f);
        wmma::fill_fragment(dvf[n], 0.f);
    }
    for (int g = 0; g < group; ++g) {
        const int h = kvh * group + g;
        const long bh = (long)b * heads + h;
        for (int qt = kt; qt < nt; ++qt) {
            __syncthreads();
            load_tile(qs, q + ((long)b * t + qt * TILE) * ldq + h * D, ldq);
            load_tile(gs, go + ((long)b * t + qt * TILE) * ldq + h * D, ldq);
            if (threadIdx.x < TILE) {
                ls[threadIdx.x] = lse2[bh * t + qt * TILE + threadIdx.x];
                dl[threadIdx.x] = delta[bh * t + qt * TILE + threadIdx.x];
            }
            __syncthreads();
            // P^T (16 keys x 64 queries) from the recomputed scores.
            mul_transposed(s, kf, qs);
            __syncwarp();
            float pr[32];
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int c = col(j, lane);
                pr[j] = kj <= qt * TILE + c ? exp2f(s[r * LDS + c] * scale_log2 - ls[c]) : 0.f;
                buf[r * LDT + c] = __float2bfloat16(pr[j]);
            }
            __syncwarp();
            mul_add(dvf, buf, gs);  // dv += P^T dO
            __syncwarp();
            mul_transposed(s, vf, gs);  // dP^T = V dO^T
            __syncwarp();
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int c = col(j, lane);
                buf[r * LDT + c] = __float2bfloat16(pr[j] * (s[r * LDS + c] - dl[c]));
            }
            __syncwarp();
            mul_add(dkf, buf, qs);  // dk += dS^T Q (times scale below)
        }
    }
    write_rows(dk + ((long)b * t + row0) * ldk + kvh * D, ldk, dkf, s, r, c0, scale);
    write_rows(dv + ((long)b * t + row0) * ldk + kvh * D, ldk, dvf, s, r, c0, 1.f);
}

// dq for query tile (T/64 - 1 - blockIdx.x) of (batch, head) blockIdx.y.
extern "C" __global__ void __launch_bounds__(128) flash_bwd_dq_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* go,
                                                                   const float* lse2, const float* delta, bf16* dq, int t, int heads,
                                                                   int kv_heads, float scale_log2, float scale) {
    __shared__ __align__(32) bf16 ks[TILE * LDT];
    __shared__ __align__(32) bf16 vs[TILE * LDT];
    __shared__ __align__(32) bf16 bufs[WARPS][WR * LDT];
    __shared__ __align__(32) float sc[WARPS][WR * LDS];
    const QueryTile at(t, heads, kv_heads);
    const int lane = at.lane, r = at.r, qi = at.qi;
    float* s = sc[at.w];
    bf16* buf = bufs[at.w];

    FragA qf[KS], gf[KS];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        wmma::load_matrix_sync(qf[kk], q + at.q_rows(t) + kk * 16, at.ldq);
        wmma::load_matrix_sync(gf[kk], go + at.q_rows(t) + kk * 16, at.ldq);
    }
    const float li = lse2[(long)at.bh * t + qi], di = delta[(long)at.bh * t + qi];
    FragC dqf[KS];
#pragma unroll
    for (int n = 0; n < KS; ++n) wmma::fill_fragment(dqf[n], 0.f);
    for (int kt = 0; kt <= at.qt; ++kt) {
        load_kv(ks, vs, k + at.kv, v + at.kv, kt, at.ldk);
        mul_transposed(s, qf, ks);  // S = Q K^T
        __syncwarp();
        float pr[32];
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int c = col(j, lane);
            pr[j] = kt * TILE + c <= qi ? exp2f(s[r * LDS + c] * scale_log2 - li) : 0.f;
        }
        __syncwarp();
        mul_transposed(s, gf, vs);  // dP = dO V^T
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int c = col(j, lane);
            buf[r * LDT + c] = __float2bfloat16(pr[j] * (s[r * LDS + c] - di));
        }
        __syncwarp();
        mul_add(dqf, buf, ks);  // dq += dS K (times scale below)
    }
    write_rows(dq + at.q_rows(t), at.ldq, dqf, s, r, at.c0, scale);
}
