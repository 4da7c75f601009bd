// The embedding and its gradient through the ids' CSR, built on the device.
// Part of kernels/engine.cu (its prologue defines `act`, the chunk helpers and the
// ops headers this file uses); included there, once, inside no namespace.

#pragma once

// ---- embedding ---------------------------------------------------------------------------

// The id an embedding kernel reads at position i: the token itself (buckets = 0), or
// BigramHash's bucket of the pair ending there (src/model/ops/embedding.rs, bigram_bucket):
// buckets - 1 at a sequence's first position (sequences of t), else
// (36313 x[i] XOR 27191 x[i-1]) mod (buckets - 1), the records' int32 products (the config
// keeps the ids small enough that they do not wrap).
__device__ __forceinline__ unsigned id_at(const unsigned* ids, long i, int t, int buckets) {
    if (buckets == 0) return ids[i];
    const unsigned m = (unsigned)buckets - 1u;
    if (i % t == 0) return m;
    return ((36313u * ids[i]) ^ (27191u * ids[i - 1])) % m;
}

// out[i] = table[ids[i]] (rows of dim), thread per element. An id outside the vocabulary (the
// sampler's check switched off, or shards of another tokenizer) gives its row NaN rather than
// a read past the table: the loss turns NaN and the trainer stops before the update.
extern "C" __global__ void eng_embedding_fwd(const float* table, const unsigned* ids, act* out, long n, int dim, int vocab, int t,
                                             int buckets) {
    const long total = n * dim;
    for (long i = first_index(); i < total; i += grid_stride()) {
        const unsigned id = id_at(ids, i / dim, t, buckets);
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
// The ids are those id_at reads: the tokens, or (buckets > 0) their BigramHash buckets, whose
// CSR the backward pass builds into the same space when BigramHash's gradient needs it.

// cnt[c][v] = the ids equal to v among positions [c chunk, (c + 1) chunk). One warp per chunk.
extern "C" __global__ void eng_csr_count(const unsigned* ids, long n, int vocab, int chunk, unsigned* cnt, int t, int buckets) {
    const long c = blockIdx.x, start = c * chunk, end = start + chunk < n ? start + chunk : n;
    unsigned* row = cnt + c * (long)vocab;
    const int lane = threadIdx.x;
    for (int v = lane; v < vocab; v += 32) row[v] = 0;
    __syncwarp();
    for (long i0 = start; i0 < end; i0 += 32) {
        const long i = i0 + lane;
        const unsigned x = i < end ? id_at(ids, i, t, buckets) : 0xffffffffu;
        const unsigned id = x < (unsigned)vocab ? x : 0xffffffffu;
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
extern "C" __global__ void eng_csr_fill(const unsigned* ids, long n, int vocab, int chunk, unsigned* cnt, unsigned* pos, int t,
                                         int buckets) {
    const long c = blockIdx.x, start = c * chunk, end = start + chunk < n ? start + chunk : n;
    unsigned* next = cnt + c * (long)vocab;
    const int lane = threadIdx.x;
    for (long i0 = start; i0 < end; i0 += 32) {
        const long i = i0 + lane;
        const unsigned x = i < end ? id_at(ids, i, t, buckets) : 0xffffffffu;
        const unsigned id = x < (unsigned)vocab ? x : 0xffffffffu;
        int below, same;
        eng::warp_match(id, &below, &same);
        if (id != 0xffffffffu) pos[next[id] + below] = (unsigned)i;
        __syncwarp();
        if (id != 0xffffffffu && below == 0) next[id] += same;
        __syncwarp();
    }
}
