// Causal flash attention with grouped KV heads on register fragments: the design of
// kernels/flash_attn.cu (same layouts, grid, base-2 log-sum-exp, deterministic two-kernel
// backward pass) with raw mma.sync m16n8k16 instructions instead of WMMA. Scores stay in the
// accumulator registers, where each lane knows which rows and columns it holds, so the softmax
// runs in registers and the probabilities become the next product's A operand without a trip
// through shared memory; B operands come from shared memory by ldmatrix; key/value (or
// query/gradient) tiles are double-buffered with cp.async so the next tile loads while this one
// is multiplied. Launched from src/model/flash_attn/cuda.rs (`attention = "flash_mma"`); the backward
// pass takes delta from flash_attn.cu's flash_delta_bf16. Checked on the CPU by the warp
// emulator (tests/warp_emu, `cargo test --test warp_emulation`) and on a GPU by
// `pipeline parity`, both against float64 references.
//
// Every block has four warps; warp w owns 16 rows of the block's 64 (queries in the forward and
// dq kernels, keys in the dk/dv kernel). Lane l holds rows g = l / 4 and g + 8 of its warp's 16
// and, of every 8-column slice, columns 2t and 2t + 1 (t = l % 4): the mma accumulator layout
// (kernels/mma_sm80.cuh). Row statistics are reduced over the four lanes of a row by shuffles.
//
// Requirements (checked by the launcher): head dim 64, T a multiple of 64, 16-byte aligned rows.
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>
#include <mma_sm80.cuh>

typedef __nv_bfloat16 bf16;

namespace {

constexpr int D = 64;        // head dim
constexpr int TILE = 64;     // rows per block and columns per inner tile
constexpr int THREADS = 128; // four warps
constexpr int WR = 16;       // rows per warp
constexpr int NT = 8;        // 8-column slices of a 64-wide product (the mma's n)
constexpr int KC = 4;        // 16-wide steps over 64 (the mma's k)
constexpr int LDT = D + 8;   // padded shared row: ldmatrix's eight row addresses hit distinct banks
constexpr unsigned FULL = 0xffffffffu;

typedef uint32_t FragA[KC][4];  // a warp's 16 x 64 A operand
typedef float Acc[NT][4];       // a warp's 16 x 64 f32 product

// Starts copying the 64 x 64 tile at src (row stride ld) into dst [64][LDT]: 512 pieces of 16
// bytes, four per thread.
__device__ __forceinline__ void load_tile_async(bf16* dst, const bf16* src, long ld) {
    for (int i = threadIdx.x; i < TILE * D / 8; i += THREADS) {
        const int r = i >> 3, c = (i & 7) * 8;
        cp_async_16(dst + r * LDT + c, src + r * ld + c);
    }
}

// The warp's 16 x 64 rows (row stride ld) as A fragments, straight from global memory.
__device__ __forceinline__ void load_a(FragA& a, const bf16* rows, long ld, int g, int t) {
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        const bf16* r0 = rows + (long)g * ld + kc * 16 + 2 * t;
        const bf16* r8 = r0 + 8 * ld;
        a[kc][0] = *reinterpret_cast<const uint32_t*>(r0);
        a[kc][1] = *reinterpret_cast<const uint32_t*>(r8);
        a[kc][2] = *reinterpret_cast<const uint32_t*>(r0 + 8);
        a[kc][3] = *reinterpret_cast<const uint32_t*>(r8 + 8);
    }
}

__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// out = A (16 x 64) times the transpose of tile [64][LDT]: tile row j is column j of out.
__device__ __forceinline__ void mul_bt(Acc& out, const FragA& a, const bf16* tile, int lane) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        out[n][0] = out[n][1] = out[n][2] = out[n][3] = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // Matrices: columns 32 half + 0, 8, 16, 24 of rows 8n..8n+7 = (b0, b1) of steps 2 half, 2 half + 1.
            uint32_t b[4];
            ldsm_x4(b, tile + (n * 8 + (lane & 7)) * LDT + half * 32 + (lane >> 3) * 8);
            mma_bf16(out[n], a[2 * half], b[0], b[1]);
            mma_bf16(out[n], a[2 * half + 1], b[2], b[3]);
        }
    }
}

// acc += P (16 x 64, the f32 product p rounded to bf16) times tile [64][LDT]. The accumulator
// layout of slices 2kc and 2kc + 1 is the A layout of step kc, so p is repacked in registers.
__device__ __forceinline__ void mul_add(Acc& acc, const Acc& p, const bf16* tile, int lane) {
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        const uint32_t a[4] = {pack_bf16(p[2 * kc][0], p[2 * kc][1]), pack_bf16(p[2 * kc][2], p[2 * kc][3]),
                               pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]), pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
        for (int nn = 0; nn < NT / 2; ++nn) {
            // Matrices (transposed): rows 16kc + 0 / 8 of columns 16nn + 0 / 8 = (b0, b1) of slices 2nn, 2nn + 1.
            uint32_t b[4];
            ldsm_x4_t(b, tile + (kc * 16 + (lane & 15)) * LDT + nn * 16 + (lane >> 4) * 8);
            mma_bf16(acc[2 * nn], a, b[0], b[1]);
            mma_bf16(acc[2 * nn + 1], a, b[2], b[3]);
        }
    }
}

// Writes acc times the rows' scales (row g: s0, row g + 8: s1) as bf16 into the warp's 16 rows
// of out (row stride ld).
__device__ __forceinline__ void store_rows(bf16* out, long ld, const Acc& acc, float s0, float s1, int g, int t) {
    bf16* r0 = out + (long)g * ld + 2 * t;
    bf16* r8 = r0 + 8 * ld;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        *reinterpret_cast<uint32_t*>(r0 + n * 8) = pack_bf16(acc[n][0] * s0, acc[n][1] * s0);
        *reinterpret_cast<uint32_t*>(r8 + n * 8) = pack_bf16(acc[n][2] * s1, acc[n][3] * s1);
    }
}

// The sum (or max) of a row's value over its four lanes.
__device__ __forceinline__ float row_sum(float x) {
    x += __shfl_xor_sync(FULL, x, 1);
    return x + __shfl_xor_sync(FULL, x, 2);
}
__device__ __forceinline__ float row_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL, x, 2));
}

// Where a block of the forward and dq kernels works: query tile qt (the longest rows first) of
// (batch b, head h) blockIdx.y, KV head kvh; warp w owns query rows row0..row0+15, its lane
// rows row0 + g and row0 + g + 8.
struct QueryTile {
    int qt, bh, b, h, kvh, lane, g, t, row0;
    long ldq, ldk, kv;  // row strides of q and k/v; offset of this (batch, KV head) in k and v
    __device__ QueryTile(int seq, int heads, int kv_heads)
        : qt(seq / TILE - 1 - blockIdx.x), bh(blockIdx.y), b(bh / heads), h(bh % heads), kvh(h / (heads / kv_heads)),
          lane(threadIdx.x & 31), g(lane >> 2), t(lane & 3), row0(qt * TILE + (threadIdx.x >> 5) * WR), ldq((long)heads * D),
          ldk((long)kv_heads * D), kv((long)b * seq * ldk + kvh * D) {}
    // Offset of this warp's first row of head h in q-shaped matrices.
    __device__ long q_rows(int seq) const { return ((long)b * seq + row0) * ldq + h * D; }
    // Whether key `key` is visible to the lane's row r (0: g, 1: g + 8).
    __device__ bool visible(int key, int r) const { return key <= row0 + g + 8 * r; }
    // Under a document mask (`starts` rising along a sequence): the lane rows' first visible
    // keys, and the first key tile any row of the block sees (its first row's start's).
    __device__ void documents(int seq, const unsigned* starts, int lo[2], int* kt0) const {
        const long base = (long)b * seq;
        lo[0] = (int)starts[base + row0 + g];
        lo[1] = (int)starts[base + row0 + g + 8];
        *kt0 = (int)starts[base + qt * TILE] / TILE;
    }
};

// Starts loading key/value tile kt of a (batch, KV head) into stage buffers.
__device__ __forceinline__ void load_kv(bf16* ks, bf16* vs, const bf16* kb, const bf16* vb, int kt, long ldk) {
    load_tile_async(ks, kb + (long)kt * TILE * ldk, ldk);
    load_tile_async(vs, vb + (long)kt * TILE * ldk, ldk);
    cp_async_commit();
}

// Before working on tile i of n (stage i & 1): starts loading tile i + 1 into the other stage
// with `load`, waits for tile i's copies and for every thread's.
template <class Load>
__device__ __forceinline__ void next_stage(int i, int n, Load load) {
    if (i + 1 < n) {
        load(i + 1, (i + 1) & 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

}  // namespace

// The kernels' bodies take a document mask as a template switch: with DOCS, `starts[b t + i]` is
// the first key position query i of sequence b may see (src/model/ops/doc_mask.rs; rising
// along a sequence), so a key is visible when starts[i] <= key <= i; the forward and dq kernels
// skip the key tiles wholly before a query tile's first start, and the dk/dv kernel the query
// tiles whose segments all start after its key tile. Without it (`starts` unread) the kernels are plain
// causal attention. The extern "C" entry points below instantiate both.

// Forward: o and lse2 for query tile (T/64 - 1 - blockIdx.x) of (batch, head) blockIdx.y.
// scale_log2 = log2(e) / sqrt(64).
template <bool DOCS>
__device__ __forceinline__ void flash_fwd(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse2, int t, int heads, int kv_heads,
                                          float scale_log2, const unsigned* starts) {
    __shared__ __align__(16) bf16 ks[2][TILE * LDT];
    __shared__ __align__(16) bf16 vs[2][TILE * LDT];
    const QueryTile at(t, heads, kv_heads);
    const int lane = at.lane;
    int lo[2] = {0, 0}, kt0 = 0;
    if (DOCS) at.documents(t, starts, lo, &kt0);
    auto load = [&](int i, int st) { load_kv(ks[st], vs[st], k + at.kv, v + at.kv, kt0 + i, at.ldk); };
    load(0, 0);

    FragA qa;
    load_a(qa, q + at.q_rows(t), at.ldq, at.g, at.t);
    Acc acc, s;
    zero(acc);
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};  // l: this lane's part of the row sums
    const int tiles = at.qt + 1 - kt0;
    for (int i = 0; i < tiles; ++i) {
        const int st = i & 1, kt = kt0 + i;
        next_stage(i, tiles, load);
        mul_bt(s, qa, ks[st], lane);
        // Online softmax. Causal only: every row sees key kt*64 <= its own, so its max stays
        // finite, and only the diagonal tile has masked keys. Under a document mask a row may see
        // nothing of a tile before its document's: its max is then -inf, and 0 stands in for it
        // in the exponentials (which are all 0) until a visible key comes (its own at the latest).
        const bool diagonal = kt == at.qt;
        float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt * TILE + n * 8 + 2 * at.t + (e & 1);
                const bool seen = (!diagonal || at.visible(key, e >> 1)) && (!DOCS || key >= lo[e >> 1]);
                s[n][e] = seen ? s[n][e] * scale_log2 : -CUDART_INF_F;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
            }
        }
        float alpha[2], base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float mn = fmaxf(m[r], row_max(mx[r]));
            base[r] = DOCS && mn == -CUDART_INF_F ? 0.f : mn;
            alpha[r] = exp2f(m[r] - base[r]);
            m[r] = mn;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(s[n][e] - base[e >> 1]);
                l[e >> 1] += s[n][e];
                acc[n][e] *= alpha[e >> 1];
            }
        }
        mul_add(acc, s, vs[st], lane);
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    const float l0 = row_sum(l[0]), l1 = row_sum(l[1]);
    store_rows(o + at.q_rows(t), at.ldq, acc, 1.f / l0, 1.f / l1, at.g, at.t);
    if (at.t == 0) {
        float* row = lse2 + (long)at.bh * t + at.row0 + at.g;
        row[0] = m[0] + log2f(l0);
        row[8] = m[1] + log2f(l1);
    }
}

// dq for query tile (T/64 - 1 - blockIdx.x) of (batch, head) blockIdx.y. scale = 1/sqrt(64).
template <bool DOCS>
__device__ __forceinline__ void flash_bwd_dq(const bf16* q, const bf16* k, const bf16* v, const bf16* go, const float* lse2,
                                             const float* delta, bf16* dq, int t, int heads, int kv_heads, float scale_log2, float scale,
                                             const unsigned* starts) {
    __shared__ __align__(16) bf16 ks[2][TILE * LDT];
    __shared__ __align__(16) bf16 vs[2][TILE * LDT];
    const QueryTile at(t, heads, kv_heads);
    const int lane = at.lane;
    int lo[2] = {0, 0}, kt0 = 0;
    if (DOCS) at.documents(t, starts, lo, &kt0);
    auto load = [&](int i, int st) { load_kv(ks[st], vs[st], k + at.kv, v + at.kv, kt0 + i, at.ldk); };
    load(0, 0);

    FragA qa, ga;
    load_a(qa, q + at.q_rows(t), at.ldq, at.g, at.t);
    load_a(ga, go + at.q_rows(t), at.ldq, at.g, at.t);
    const long stat = (long)at.bh * t + at.row0 + at.g;
    const float li[2] = {lse2[stat], lse2[stat + 8]}, di[2] = {delta[stat], delta[stat + 8]};
    Acc acc, s, dp;
    zero(acc);
    const int tiles = at.qt + 1 - kt0;
    for (int i = 0; i < tiles; ++i) {
        const int st = i & 1, kt = kt0 + i;
        next_stage(i, tiles, load);
        mul_bt(s, qa, ks[st], lane);   // S = Q K^T
        mul_bt(dp, ga, vs[st], lane);  // dP = dO V^T
        const bool diagonal = kt == at.qt;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, key = kt * TILE + n * 8 + 2 * at.t + (e & 1);
                const bool seen = (!diagonal || at.visible(key, r)) && (!DOCS || key >= lo[r]);
                const float p = seen ? exp2f(s[n][e] * scale_log2 - li[r]) : 0.f;
                s[n][e] = p * (dp[n][e] - di[r]);  // dS
            }
        }
        mul_add(acc, s, ks[st], lane);  // dq += dS K (times scale below)
        __syncthreads();
    }
    store_rows(dq + at.q_rows(t), at.ldq, acc, scale, scale, at.g, at.t);
}

// dk and dv for key tile blockIdx.x of (batch, KV head) blockIdx.y, summed over the group's
// query heads in order (and over query tiles in order within a head).
template <bool DOCS>
__device__ __forceinline__ void flash_bwd_dkdv(const bf16* q, const bf16* k, const bf16* v, const bf16* go, const float* lse2,
                                               const float* delta, bf16* dk, bf16* dv, int t, int heads, int kv_heads, float scale_log2,
                                               float scale, const unsigned* starts) {
    __shared__ __align__(16) bf16 qs[2][TILE * LDT];
    __shared__ __align__(16) bf16 gs[2][TILE * LDT];
    __shared__ __align__(16) float ls[2][TILE];
    __shared__ __align__(16) float dl[2][TILE];
    __shared__ __align__(16) unsigned lo[2][TILE];  // the query tile's first visible keys (DOCS)
    const int nt = t / TILE, kt = blockIdx.x;  // the longest columns (kt = 0) first
    const int b = blockIdx.y / kv_heads, kvh = blockIdx.y % kv_heads, group = heads / kv_heads;
    const long ldq = (long)heads * D, ldk = (long)kv_heads * D;
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int row0 = kt * TILE + (threadIdx.x >> 5) * WR;  // the warp's first key
    // Work item i: query tile kt + i % nq of the group's head i / nq. Under a document mask the
    // query tiles stop at the first whose first row's segment starts past this key tile: starts
    // rise along a sequence, so none after it sees this tile either (the diagonal tile always
    // does).
    int nq = nt - kt;
    if (DOCS) {
        const int last_key = kt * TILE + TILE - 1;
        int seen = 1;
        while (seen < nq && (int)starts[(long)b * t + (kt + seen) * TILE] <= last_key) ++seen;
        nq = seen;
    }
    const int items = group * nq;
    auto load = [&](int i, int st) {
        const int h = kvh * group + i / nq, qt = kt + i % nq;
        const long rows = ((long)b * t + qt * TILE) * ldq + h * D, stat = ((long)b * heads + h) * t + qt * TILE;
        load_tile_async(qs[st], q + rows, ldq);
        load_tile_async(gs[st], go + rows, ldq);
        if (threadIdx.x < TILE / 4) {
            cp_async_16(ls[st] + 4 * threadIdx.x, lse2 + stat + 4 * threadIdx.x);
        } else if (threadIdx.x < TILE / 2) {
            cp_async_16(dl[st] + 4 * (threadIdx.x - TILE / 4), delta + stat + 4 * (threadIdx.x - TILE / 4));
        } else if (DOCS && threadIdx.x < 3 * TILE / 4) {
            const int c = 4 * (threadIdx.x - TILE / 2);
            cp_async_16(lo[st] + c, starts + (long)b * t + qt * TILE + c);
        }
        cp_async_commit();
    };
    load(0, 0);

    FragA ka, va;
    load_a(ka, k + ((long)b * t + row0) * ldk + kvh * D, ldk, g, tq);
    load_a(va, v + ((long)b * t + row0) * ldk + kvh * D, ldk, g, tq);
    Acc dka, dva, s, dp;
    zero(dka);
    zero(dva);
    for (int i = 0; i < items; ++i) {
        const int st = i & 1, q0 = (kt + i % nq) * TILE;
        const bool diagonal = i % nq == 0;
        next_stage(i, items, load);
        mul_bt(s, ka, qs[st], lane);  // S^T = K Q^T (keys x queries)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = n * 8 + 2 * tq + (e & 1), key = row0 + g + 8 * (e >> 1);
                const bool seen = (!diagonal || key <= q0 + c) && (!DOCS || key >= (int)lo[st][c]);
                s[n][e] = seen ? exp2f(s[n][e] * scale_log2 - ls[st][c]) : 0.f;  // P^T
            }
        }
        mul_add(dva, s, gs[st], lane);  // dv += P^T dO
        mul_bt(dp, va, gs[st], lane);   // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - dl[st][n * 8 + 2 * tq + (e & 1)]);  // dS^T
        }
        mul_add(dka, dp, qs[st], lane);  // dk += dS^T Q (times scale below)
        __syncthreads();
    }
    const long out = ((long)b * t + row0) * ldk + kvh * D;
    store_rows(dk + out, ldk, dka, scale, scale, g, tq);
    store_rows(dv + out, ldk, dva, 1.f, 1.f, g, tq);
}

// ---- entry points: causal, and causal within documents (`starts` as above) ---------------

extern "C" __global__ void __launch_bounds__(THREADS)
    flash_fwd_mma_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse2, int t, int heads, int kv_heads,
                       float scale_log2) {
    flash_fwd<false>(q, k, v, o, lse2, t, heads, kv_heads, scale_log2, nullptr);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    flash_fwd_mma_docs_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse2, int t, int heads, int kv_heads,
                            float scale_log2, const unsigned* starts) {
    flash_fwd<true>(q, k, v, o, lse2, t, heads, kv_heads, scale_log2, starts);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    flash_bwd_dq_mma_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* go, const float* lse2, const float* delta, bf16* dq,
                          int t, int heads, int kv_heads, float scale_log2, float scale) {
    flash_bwd_dq<false>(q, k, v, go, lse2, delta, dq, t, heads, kv_heads, scale_log2, scale, nullptr);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    flash_bwd_dq_mma_docs_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* go, const float* lse2, const float* delta,
                               bf16* dq, int t, int heads, int kv_heads, float scale_log2, float scale, const unsigned* starts) {
    flash_bwd_dq<true>(q, k, v, go, lse2, delta, dq, t, heads, kv_heads, scale_log2, scale, starts);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    flash_bwd_dkdv_mma_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* go, const float* lse2, const float* delta,
                            bf16* dk, bf16* dv, int t, int heads, int kv_heads, float scale_log2, float scale) {
    flash_bwd_dkdv<false>(q, k, v, go, lse2, delta, dk, dv, t, heads, kv_heads, scale_log2, scale, nullptr);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    flash_bwd_dkdv_mma_docs_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* go, const float* lse2, const float* delta,
                                 bf16* dk, bf16* dv, int t, int heads, int kv_heads, float scale_log2, float scale,
                                 const unsigned* starts) {
    flash_bwd_dkdv<true>(q, k, v, go, lse2, delta, dk, dv, t, heads, kv_heads, scale_log2, scale, starts);
}
