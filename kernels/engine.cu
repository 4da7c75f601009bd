// The GPU kernels of the training engine's backend (src/engine/gpu/: the launches, one per
// `Backend` op; src/engine/cpu/: the CPU reference each kernel is checked against, in the warp
// emulator by `cargo test --lib engine::gpu`). Compiled twice: with float32 activations
// (engine.ptx) and with bfloat16 ones (engine_bf16.ptx, `act` below); parameters, gradients and
// optimizer state are float32 in both. Every kernel reads and writes the arena by element offsets
// the schedule fixed once, so a step's launches are the same every step (what lets a CUDA graph
// replay them).
//
// Shapes of launch (the launcher in src/engine/gpu/ops.rs picks the grids):
// - flat kernels: a grid-stride loop over n elements, 256 threads per block;
// - row kernels: one warp per row (or per row and head), 8 rows per 256-thread block, lanes
//   strided over the row so that loads coalesce;
// - per-channel sums of a backward pass: deterministic, no atomics. `*_partial` kernels give
//   each block of PART rows one partial sum per channel (a thread per channel), and
//   `colsum_finish` adds the partials in block order into the destination (`+=`), so that a
//   gradient is the same bit for bit on every run and under graph replay;
// - reductions to a scalar (sum, sum of squares, non-finite count): per-block partials, then one
//   block adds them in order.
//
// Maths is float32 with float32 accumulation inside a row (the CPU reference accumulates in
// float64: the comparison's tolerance says so), with the correctly rounded transcendental
// functions (`ops::Precise`). The device maths of the ops the model's fused kernels
// (kernels/fused.cu) have too lives in kernels/ops/, one header per op, shared by both: RMS norm,
// the MLP's activation, the per-channel scales and their column sums, qk norm + RoPE, the
// soft-capped cross-entropy, and the warp and block reductions. This file keeps the entry
// points, their launch geometry and the ops only the engine has.
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

namespace eng {

// The storage type of the activations and their gradients (the arena's activation region, see
// src/engine/layout.rs): float32, or bfloat16 in the engine's bf16 build (`-DENGINE_ACT_BF16`,
// engine_bf16.ptx), where every kernel below still computes in float32 (ops::bf16s reads as a
// float and rounds what it is assigned). Parameters, their gradients, optimizer state and the
// per-row statistics stay float32 in both.
#ifdef ENGINE_ACT_BF16
using act = ops::bf16s;
#else
using act = float;
#endif

constexpr int PART = 64;  // rows per partial sum of a per-channel reduction

// 16-byte chunks of activations: AV of them (8 bf16 or 4 floats). The hottest row and flat
// kernels below move their activations in such chunks when every activation pointer they are
// given is 16-byte aligned and the row width a multiple of AV (`chunked`: the arena's buffers
// are, at the model's widths), and element by element otherwise, in the same kernel (a branch
// every thread takes alike). Per-channel parameters are read by element (small, cached).
constexpr int AV = 16 / (int)sizeof(act);

__device__ __forceinline__ void loadv(const float* p, float (&v)[4]) { ops::unpack(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void loadv(const ops::bf16s* p, float (&v)[8]) { ops::unpack(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void storev(float* p, const float (&v)[4]) { *reinterpret_cast<uint4*>(p) = ops::pack(v); }
__device__ __forceinline__ void storev(ops::bf16s* p, const float (&v)[8]) { *reinterpret_cast<uint4*>(p) = ops::pack(v); }

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<unsigned long long>(p) % 16 == 0; }

// Whether every pointer is 16-byte aligned and `cols` (a row's width, or n) a multiple of AV.
template <typename... P>
__device__ __forceinline__ bool chunked(long cols, const P*... ptrs) {
    return cols % AV == 0 && (aligned16(ptrs) && ...);
}

// Chunk-wise grid-stride loop: `i` the first element of each chunk of AV.
#define FOR_CHUNKS(i, n) for (long i = first_index() * AV; i < (n); i += grid_stride() * AV)

// Chunks per lane of the chunked RMS norm rows (a row held in registers): rows up to
// 32 AV RMS_CHUNKS wide (1024 bf16, 512 floats); wider rows take the element path.
constexpr int RMS_CHUNKS = 4;

using ops::block_sum;
using ops::Precise;
using ops::warp_max;
using ops::warp_row;
using ops::warp_sum;

__device__ __forceinline__ long first_index() { return (long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ long grid_stride() { return (long)gridDim.x * blockDim.x; }

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// For this lane's `id`: `below`, the lanes under it holding the same id, and `same`, all lanes
// holding it (itself included).
__device__ __forceinline__ void warp_match(unsigned id, int* below, int* same) {
    const int lane = threadIdx.x & 31;
    int b = 0, t = 1;
    for (int m = 1; m < 32; ++m) {
        const unsigned other = __shfl_xor_sync(0xffffffffu, id, m);
        if (other == id) {
            ++t;
            if ((lane ^ m) < lane) ++b;
        }
    }
    *below = b;
    *same = t;
}

}  // namespace eng

using namespace eng;

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

// ---- embedding ---------------------------------------------------------------------------

// out[i] = table[ids[i]] (rows of dim), thread per element. An id outside the vocabulary (the
// sampler's check switched off, or shards of another tokenizer) gives its row NaN rather than
// a read past the table: the loss turns NaN and the trainer stops before the update.
extern "C" __global__ void eng_embedding_fwd(const float* table, const unsigned* ids, act* out, long n, int dim, int vocab) {
    const long total = n * dim;
    for (long i = first_index(); i < total; i += grid_stride()) {
        const unsigned id = ids[i / dim];
        out[i] = id < (unsigned)vocab ? table[(long)id * dim + i % dim] : CUDART_NAN_F;
    }
}

// The embedding's gradient, dtable[v] += the sum of dout[i] over the tokens i with id v, from
// the ids' CSR (pos[off[v]..off[v + 1]]: row v's tokens, ascending; eng_csr_* below), in two
// levels so that a frequent id (4% of a micro-batch's tokens for English text) is not one
// block's serial tail: a row of more than `piece` tokens is cut into pieces of `piece` (poff[v]:
// the pieces of the rows below v, from eng_csr_scan), each summed by a block of its own into
// part (eng_embedding_pieces), and block v then adds its row's pieces in order; a shorter row
// block v sums directly. Fixed orders, no atomics: the same sums on every run.

// part[p] = the sum of dout over piece p's tokens in order (a thread per channel); blocks past
// the micro-batch's pieces (the grid is sized for the most a micro-batch can have) return.
extern "C" __global__ void eng_embedding_pieces(const act* dout, const unsigned* off, const unsigned* pos, const unsigned* poff,
                                                float* part, int dim, int vocab, int piece) {
    const unsigned p = blockIdx.x;
    if (p >= poff[vocab]) return;
    // The row v with poff[v] <= p < poff[v + 1] (rows of no pieces share their poff).
    int lo = 0, hi = vocab;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (poff[mid] <= p) lo = mid; else hi = mid;
    }
    const unsigned k0 = off[lo] + (p - poff[lo]) * (unsigned)piece, end = off[lo + 1];
    const unsigned k1 = k0 + piece < end ? k0 + piece : end;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float s = 0.f;
        for (unsigned k = k0; k < k1; ++k) s += dout[(long)pos[k] * dim + c];
        part[(long)p * dim + c] = s;
    }
}

// dtable[v] += its row's pieces in order, or its tokens in order when it has no pieces. Block
// per row, a thread per channel.
extern "C" __global__ void eng_embedding_bwd(const act* dout, const unsigned* off, const unsigned* pos, const unsigned* poff,
                                             const float* part, float* dtable, int dim) {
    const int v = blockIdx.x;
    const unsigned lo = off[v], hi = off[v + 1], p0 = poff[v], p1 = poff[v + 1];
    if (lo == hi) return;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float s = dtable[(long)v * dim + c];
        if (p1 > p0)
            for (unsigned p = p0; p < p1; ++p) s += part[(long)p * dim + c];
        else
            for (unsigned k = lo; k < hi; ++k) s += dout[(long)pos[k] * dim + c];
        dtable[(long)v * dim + c] = s;
    }
}

// ---- the ids' CSR (for the embedding's gradient), built on the device ---------------------
//
// off[v] is where vocabulary row v's tokens start in pos, and pos lists the positions of the
// micro-batch's ids row by row, each row's in ascending order: what a stable counting sort of
// the ids gives. Three launches, no atomics, so the CSR (and the gradient summed in its order)
// is the same on every run. The ids are cut into chunks of `chunk` positions, one warp each:
//   eng_csr_count  counts each chunk's ids per row into cnt (chunks x vocab);
//   eng_csr_scan   one block turns the counts into off and, in place, each chunk's first slot
//                  in each row (rows before it, then the same row's earlier chunks);
//   eng_csr_fill   each chunk's warp writes its positions in order from those slots.
// Within a chunk a warp takes 32 ids at a time; a lane learns how many lanes hold its id and
// how many of those are below it by 31 shuffles, and the lowest such lane adds them up.
// Ids outside [0, vocab) are skipped (the sampler has checked them against the tokenizer).

// cnt[c][v] = the ids equal to v among positions [c chunk, (c + 1) chunk). One warp per chunk.
extern "C" __global__ void eng_csr_count(const unsigned* ids, long n, int vocab, int chunk, unsigned* cnt) {
    const long c = blockIdx.x, start = c * chunk, end = start + chunk < n ? start + chunk : n;
    unsigned* row = cnt + c * (long)vocab;
    const int lane = threadIdx.x;
    for (int v = lane; v < vocab; v += 32) row[v] = 0;
    __syncwarp();
    for (long i0 = start; i0 < end; i0 += 32) {
        const long i = i0 + lane;
        const unsigned id = i < end && ids[i] < (unsigned)vocab ? ids[i] : 0xffffffffu;
        int below, same;
        eng::warp_match(id, &below, &same);
        if (id != 0xffffffffu && below == 0) row[id] += same;
        __syncwarp();
    }
}

// sums[k] becomes the sum of sums[j < k] (256 threads' values); returns the total to every thread.
__device__ unsigned block_exclusive_scan(unsigned* sums) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned run = 0;
        for (int k = 0; k < (int)blockDim.x; ++k) {
            const unsigned x = sums[k];
            sums[k] = run;
            run += x;
        }
        sums[blockDim.x] = run;
    }
    __syncthreads();
    return sums[blockDim.x];
}

// The pieces the embedding's gradient cuts a row of `len` tokens into (eng_embedding_pieces):
// none for a row it sums directly.
__device__ unsigned pieces_of(unsigned len, int piece) {
    return len > (unsigned)piece ? (len + piece - 1) / piece : 0;
}

// off[v] = the ids below row v in all; cnt[c][v] becomes off[v] + the ids of row v in chunks
// before c; off[vocab] = the ids in all; poff[v] = the embedding gradient's pieces of the rows
// below v (poff[vocab]: all of them). One block of 256 threads, thread t owning a run of rows.
extern "C" __global__ void eng_csr_scan(unsigned* cnt, int chunks, int vocab, unsigned* off, int piece, unsigned* poff) {
    __shared__ unsigned sums[257];
    const int t = threadIdx.x, per = (vocab + (int)blockDim.x - 1) / (int)blockDim.x;
    const int v0 = t * per < vocab ? t * per : vocab, v1 = v0 + per < vocab ? v0 + per : vocab;
    unsigned s = 0;
    for (int v = v0; v < v1; ++v)
        for (int c = 0; c < chunks; ++c) s += cnt[(long)c * vocab + v];
    sums[t] = s;
    const unsigned total = block_exclusive_scan(sums);
    if (t == 0) off[vocab] = total;
    unsigned run = sums[t];
    for (int v = v0; v < v1; ++v) {
        off[v] = run;
        for (int c = 0; c < chunks; ++c) {
            const long k = (long)c * vocab + v;
            const unsigned x = cnt[k];
            cnt[k] = run;
            run += x;
        }
    }
    // The embedding gradient's pieces, once every thread's rows of off are written.
    __syncthreads();
    unsigned p = 0;
    for (int v = v0; v < v1; ++v) p += pieces_of(off[v + 1] - off[v], piece);
    sums[t] = p;
    const unsigned pieces = block_exclusive_scan(sums);
    if (t == 0) poff[vocab] = pieces;
    unsigned q = sums[t];
    for (int v = v0; v < v1; ++v) {
        poff[v] = q;
        q += pieces_of(off[v + 1] - off[v], piece);
    }
}

// pos[slot] = position for every id, each chunk's warp in position order from the slots
// eng_csr_scan left in its row of cnt.
extern "C" __global__ void eng_csr_fill(const unsigned* ids, long n, int vocab, int chunk, unsigned* cnt, unsigned* pos) {
    const long c = blockIdx.x, start = c * chunk, end = start + chunk < n ? start + chunk : n;
    unsigned* next = cnt + c * (long)vocab;
    const int lane = threadIdx.x;
    for (long i0 = start; i0 < end; i0 += 32) {
        const long i = i0 + lane;
        const unsigned id = i < end && ids[i] < (unsigned)vocab ? ids[i] : 0xffffffffu;
        int below, same;
        eng::warp_match(id, &below, &same);
        if (id != 0xffffffffu) pos[next[id] + below] = (unsigned)i;
        __syncwarp();
        if (id != 0xffffffffu && below == 0) next[id] += same;
        __syncwarp();
    }
}

// ---- RMS norm ----------------------------------------------------------------------------

// ops/rms_norm.cuh with the scale folded in. Warp per row.

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
    const float inv = ops::rms_rstd<Precise>(warp_sum(ss), cols, eps);
    const float a = inv * scale;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < chunks) {
            for (int k = 0; k < AV; ++k) v[m][k] *= a;
            storev(out + r * cols + ch * AV, v[m]);
        }
    }
    if (lane == 0) rstd[r] = inv;
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
    const int lane = threadIdx.x & 31, chunks = cols / AV;
    float xv[RMS_CHUNKS][AV], gv[RMS_CHUNKS][AV];
    float xg = 0.f;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < chunks) {
            loadv(xr + ch * AV, xv[m]);
            loadv(gr + ch * AV, gv[m]);
            for (int k = 0; k < AV; ++k) xg += xv[m][k] * gv[m][k];
        }
    }
    xg = warp_sum(xg);
    const float inv = rstd[r], a = inv * scale, c = xg / cols * inv * inv * inv * scale;
    act* dr = dx + r * cols;
#pragma unroll
    for (int m = 0; m < RMS_CHUNKS; ++m) {
        const int ch = lane + 32 * m;
        if (ch < chunks) {
            float o[AV];
            if (acc) loadv(dr + ch * AV, o);
            for (int k = 0; k < AV; ++k) {
                const float v = gv[m][k] * a - xv[m][k] * c;
                o[k] = acc ? o[k] + v : v;
            }
            storev(dr + ch * AV, o);
        }
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
extern "C" __global__ void eng_skip_fwd(const act* h, const act* s, const float* w, const float* z, int gated, act* out, long n,
                                        int cols) {
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        const float k = s[i] * w[c];
        out[i] = gated ? k + (h[i] - k) * sigmoid(z[c]) : h[i] + k;
    }
}

// dh = dy gh, ds = dy gk w with the shares (gh, gk) = (g, 1 - g), or (1, 1) ungated.
extern "C" __global__ void eng_skip_bwd(const act* dy, const float* w, const float* z, int gated, act* dh, act* ds, long n, int cols) {
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

// ---- the 04-27 record's SmearGate (src/model/ops/smear_gate.rs) --------------------------

// The gate of row r of the `cols`-wide embedding rows e: lambda sigmoid(w . e_r[:win]), 0 at a
// sequence's first position and where the row's id is bos (the BOS fix); its sigmoid (0 there
// too) in *s. Every lane of the warp gets both.
__device__ __forceinline__ float smear_gate_of(const act* e, const unsigned* ids, const float* w, float lambda, long r, int cols,
                                               int win, int t, int bos, float* s) {
    if (r % t == 0 || ids[r] == (unsigned)bos) {
        *s = 0.f;
        return 0.f;
    }
    float z = 0.f;
    for (int c = threadIdx.x & 31; c < win; c += 32) z += w[c] * e[r * cols + c];
    *s = sigmoid(warp_sum(z));
    return lambda * *s;
}

// Warp per row: out_r = e_r + g_r e_{r-1} (out_r = e_r at a sequence's first position).
extern "C" __global__ void eng_smear_fwd(const act* e, const unsigned* ids, const float* w, const float* lambda, act* out, long rows,
                                         int cols, int win, int t, int bos) {
    const long r = warp_row(rows);
    if (r < 0) return;
    float s;
    const float g = smear_gate_of(e, ids, w, lambda[0], r, cols, win, t, bos, &s);
    const bool first = r % t == 0;
    for (int c = threadIdx.x & 31; c < cols; c += 32) out[r * cols + c] = first ? e[r * cols + c] : e[r * cols + c] + e[(r - 1) * cols + c] * g;
}

// Warp per row, with G = dout and dg_r = G_r . e_{r-1}: de_r = G_r + g_{r+1} G_{r+1} + [c < win]
// dz_r w with dz_r = dg_r lambda s_r (1 - s_r); (dz_r, dg_r s_r) into rowv[2r], rowv[2r + 1] for
// eng_smear_partial (both 0 where the gate is off).
extern "C" __global__ void eng_smear_bwd(const act* dout, const act* e, const unsigned* ids, const float* w, const float* lambda,
                                         act* de, float* rowv, long rows, int cols, int win, int t, int bos) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    const float l = lambda[0];
    float s, s_next;
    smear_gate_of(e, ids, w, l, r, cols, win, t, bos, &s);
    const bool has_next = r + 1 < rows && (r + 1) % t != 0;
    const float g_next = has_next ? smear_gate_of(e, ids, w, l, r + 1, cols, win, t, bos, &s_next) : 0.f;
    float dz = 0.f, dl = 0.f;
    if (r % t != 0 && ids[r] != (unsigned)bos) {
        float dg = 0.f;
        for (int c = lane; c < cols; c += 32) dg += dout[r * cols + c] * e[(r - 1) * cols + c];
        dg = warp_sum(dg);
        dz = dg * l * s * (1.f - s);
        dl = dg * s;
    }
    for (int c = lane; c < cols; c += 32) {
        float d = dout[r * cols + c];
        if (has_next) d += g_next * dout[(r + 1) * cols + c];
        if (c < win) d += dz * w[c];
        de[r * cols + c] = d;
    }
    if (lane == 0) {
        rowv[2 * r] = dz;
        rowv[2 * r + 1] = dl;
    }
}

// part[blk][c] = the block's sum of dz_r e_r[c] for c < win, and of dl_r at c = win (w's and
// lambda's gradients before colsum_finish adds the blocks).
extern "C" __global__ void eng_smear_partial(const act* e, const float* rowv, long rows, int cols, int win, float* part) {
    const long r0 = (long)blockIdx.y * PART, r1 = min(r0 + PART, rows);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c <= win; c += gridDim.x * blockDim.x) {
        float a = 0.f;
        for (long r = r0; r < r1; ++r) a += c < win ? rowv[2 * r] * e[r * cols + c] : rowv[2 * r + 1];
        part[(long)blockIdx.y * (win + 1) + c] = a;
    }
}

// ---- the 04-27 record's sparse attention-output gate (src/model/ops/attn_gate.rs) ---------

// g = sigmoid(scale w[h] . x[n, :win]) of row n (row stride ldx), head h; every lane gets it.
__device__ __forceinline__ float attn_gate_of(const act* x, long ldx, const float* w, long n, int h, int win, float scale) {
    float z = 0.f;
    for (int c = threadIdx.x & 31; c < win; c += 32) z += x[n * ldx + c] * w[h * win + c];
    return sigmoid(warp_sum(z) * scale);
}

// Warp per (row, head): out[n, h, :] = g y[n, h, :].
extern "C" __global__ void eng_attn_gate_fwd(const act* y, const act* x, long ldx, const float* w, act* out, long rows, int heads,
                                             int d, int win, float scale) {
    const long item = warp_row(rows * heads);
    if (item < 0) return;
    const long n = item / heads;
    const int h = (int)(item % heads);
    const float g = attn_gate_of(x, ldx, w, n, h, win, scale);
    for (int k = threadIdx.x & 31; k < d; k += 32) out[item * d + k] = g * y[item * d + k];
}

// Warp per (row, head): dy[n, h, :] = g G[n, h, :]; dz[n, h] = scale g (1 - g) (G . y)[n, h].
extern "C" __global__ void eng_attn_gate_bwd(const act* dout, const act* y, const act* x, long ldx, const float* w, act* dy,
                                             act* dz, long rows, int heads, int d, int win, float scale) {
    const long item = warp_row(rows * heads);
    if (item < 0) return;
    const long n = item / heads;
    const int h = (int)(item % heads);
    const float g = attn_gate_of(x, ldx, w, n, h, win, scale);
    float dg = 0.f;
    for (int k = threadIdx.x & 31; k < d; k += 32) {
        dg += dout[item * d + k] * y[item * d + k];
        dy[item * d + k] = g * dout[item * d + k];
    }
    dg = warp_sum(dg);
    if ((threadIdx.x & 31) == 0) dz[item] = scale * g * (1.f - g) * dg;
}

// ---- the 04-27 record's two-lane decoder (src/model/ops/lanes.rs) --------------------------

// A = sa ao, M = sm mo per channel; out_k = r[k] l_k + p[0, k] A + p[1, k] M (l0 may be l1).
extern "C" __global__ void eng_lanes_fwd(const act* l0, const act* l1, const act* ao, const act* mo, const float* sa,
                                         const float* sm, const float* r, const float* p, act* out0, act* out1, long n, int cols) {
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        const float a = sa[c] * ao[i], m = sm[c] * mo[i];
        out0[i] = r[0] * l0[i] + p[0] * a + p[2] * m;
        out1[i] = r[1] * l1[i] + p[1] * a + p[3] * m;
    }
}

// dl_k = r[k] G_k; dao = sa dA, dmo = sm dM with dA = p[0, 0] G_0 + p[0, 1] G_1, dM alike.
extern "C" __global__ void eng_lanes_bwd(const act* g0, const act* g1, const float* sa, const float* sm, const float* r,
                                         const float* p, act* dl0, act* dl1, act* dao, act* dmo, long n, int cols) {
    for (long i = first_index(); i < n; i += grid_stride()) {
        const int c = (int)(i % cols);
        dl0[i] = r[0] * g0[i];
        dl1[i] = r[1] * g1[i];
        dao[i] = sa[c] * (p[0] * g0[i] + p[1] * g1[i]);
        dmo[i] = sm[c] * (p[2] * g0[i] + p[3] * g1[i]);
    }
}

// Over the block's PART rows: part[blk] = two per-channel sums, `cols` each: dA ao and dM mo
// (the scales' gradients, for colsum_finish); sc[blk] = six sums over the rows and the block's
// channels, G_0 l_0, G_1 l_1, G_0 A, G_1 A, G_0 M, G_1 M (the lambdas' gradients, for
// eng_lanes_finish), blk = blockIdx.y gridDim.x + blockIdx.x for sc. Thread per channel.
extern "C" __global__ void eng_lanes_partial(const act* g0, const act* g1, const act* l0, const act* l1, const act* ao,
                                             const act* mo, const float* sa, const float* sm, const float* p, long rows, int cols,
                                             float* part, float* sc) {
    __shared__ float sh[8];
    const long r0 = (long)blockIdx.y * PART, r1 = min(r0 + PART, rows);
    float t[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float da = 0.f, dm = 0.f;
        for (long r = r0; r < r1; ++r) {
            const long i = r * cols + c;
            const float a = sa[c] * ao[i], m = sm[c] * mo[i];
            da += (p[0] * g0[i] + p[1] * g1[i]) * ao[i];
            dm += (p[2] * g0[i] + p[3] * g1[i]) * mo[i];
            t[0] += g0[i] * l0[i];
            t[1] += g1[i] * l1[i];
            t[2] += g0[i] * a;
            t[3] += g1[i] * a;
            t[4] += g0[i] * m;
            t[5] += g1[i] * m;
        }
        part[(long)blockIdx.y * 2 * cols + c] = da;
        part[(long)blockIdx.y * 2 * cols + cols + c] = dm;
    }
    for (int k = 0; k < 6; ++k) {
        const float total = ops::block_sum(t[k], sh);
        if (threadIdx.x == 0) sc[((long)blockIdx.y * gridDim.x + blockIdx.x) * 6 + k] = total;
    }
}

// One block of six warps: warp q adds the `count` block sums q of eng_lanes_partial (in block
// order) into dr[0], dr[1], dp[0], dp[1], dp[2], dp[3].
extern "C" __global__ void eng_lanes_finish(const float* sc, int count, float* dr, float* dp) {
    const int q = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (q >= 6) return;
    float s = 0.f;
    for (int b = lane; b < count; b += 32) s += sc[(long)b * 6 + q];
    s = warp_sum(s);
    if (lane == 0) {
        if (q < 2) dr[q] += s;
        else dp[q - 2] += s;
    }
}

// ---- document starts (src/model/ops/doc_mask.rs) ------------------------------------------

// starts[r t + p] = the first position of the document holding position p of row r: the last
// position at or before p whose id is bos, else 0. Warp per row, 32 positions at a time: a
// ballot of the BOS positions, each lane taking the highest at or below it (or the carry).
extern "C" __global__ void eng_doc_starts(const unsigned* ids, unsigned* starts, long rows, int t, int bos) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    unsigned carry = 0;
    for (int p0 = 0; p0 < t; p0 += 32) {
        const int p = p0 + lane;
        const unsigned mask = __ballot_sync(0xffffffffu, p < t && ids[r * t + p] == (unsigned)bos);
        const unsigned upto = mask & (0xffffffffu >> (31 - lane));
        if (p < t) starts[r * t + p] = upto ? (unsigned)(p0 + 31 - __clz(upto)) : carry;
        if (mask) carry = (unsigned)(p0 + 31 - __clz(mask));
    }
}

// cuDNN's ragged attention over the documents of a micro-batch (src/engine/gpu/sdpa.rs), packed
// as cuDNN's THD layout reads it: row r's documents in order in slots r t, r t + 1, ..., then
// its unused slots (length 0). slot_len[s] is slot s's length and slot_start[s] its first
// position (r t + p; for an unused slot, the row's end (r + 1) t), so that each slot starts
// where the one before it ends and the offsets `start * stride` are cumulative. A document
// starts at a row's first position and at each id equal to bos, and runs to the next start or
// the row's end. pos_len (n entries) is scratch: the length of the document starting at each
// position. Warp per row: 32 positions at a time from the end (each start's length: the
// lowest start above it, or the carry from the chunk after), then from the front (each start's
// slot: the starts below it in the chunk, plus the carry), then the unused slots.
extern "C" __global__ void eng_doc_slots(const unsigned* ids, unsigned* pos_len, int* slot_len, int* slot_start, long rows, int t, int bos) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    int next = t;
    for (int p0 = (t - 1) / 32 * 32; p0 >= 0; p0 -= 32) {
        const int p = p0 + lane;
        const bool start = p < t && (p == 0 || ids[r * t + p] == (unsigned)bos);
        const unsigned mask = __ballot_sync(0xffffffffu, start);
        const unsigned above = lane == 31 ? 0u : mask & (0xffffffffu << (lane + 1));
        if (p < t) pos_len[r * t + p] = start ? (above ? p0 + __ffs(above) - 1 : next) - p : 0;
        if (mask) next = p0 + __ffs(mask) - 1;
    }
    __syncwarp();
    int count = 0;
    for (int p0 = 0; p0 < t; p0 += 32) {
        const int p = p0 + lane;
        const bool start = p < t && (p == 0 || ids[r * t + p] == (unsigned)bos);
        const unsigned mask = __ballot_sync(0xffffffffu, start);
        if (start) {
            const long slot = r * t + count + __popc(mask & ((1u << lane) - 1u));
            slot_len[slot] = (int)pos_len[r * t + p];
            slot_start[slot] = (int)(r * t + p);
        }
        count += __popc(mask);
    }
    for (int j = count + lane; j < t; j += 32) {
        slot_len[r * t + j] = 0;
        slot_start[r * t + j] = (int)((r + 1) * t);
    }
}

// out[i] = start[i] unit for the n slots, out[n] = n unit (the end): cuDNN's ragged offsets (in
// elements) of a tensor whose rows are unit elements apart.
extern "C" __global__ void eng_ragged_offsets(const int* start, int* out, long n, long unit) {
    for (long i = first_index(); i <= n; i += grid_stride()) out[i] = (int)((i < n ? (long)start[i] : n) * unit);
}

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
