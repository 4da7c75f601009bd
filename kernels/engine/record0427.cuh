// The 04-27 record's elements: SmearGate, the sparse attention-output gate, the two-lane decoder, and the document starts.
// Part of kernels/engine.cu (its prologue defines `act`, the chunk helpers and the
// ops headers this file uses); included there, once, inside no namespace.

#pragma once

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

// Warp per row: out_r = e_r + g_r e_{r-1} (out_r = e_r at a sequence's first position); rows in
// 16-byte chunks a chunk per lane at a time, the same maths per element.
extern "C" __global__ void eng_smear_fwd(const act* e, const unsigned* ids, const float* w, const float* lambda, act* out, long rows,
                                         int cols, int win, int t, int bos) {
    const long r = warp_row(rows);
    if (r < 0) return;
    float s;
    const float g = smear_gate_of(e, ids, w, lambda[0], r, cols, win, t, bos, &s);
    const bool first = r % t == 0;
    const int lane = threadIdx.x & 31;
    if (chunked(cols, e, out)) {
        for (int c = lane * AV; c < cols; c += 32 * AV) {
            float x[AV];
            loadv(e + r * cols + c, x);
            if (!first) {
                float p[AV];
                loadv(e + (r - 1) * cols + c, p);
                for (int k = 0; k < AV; ++k) x[k] = x[k] + p[k] * g;
            }
            storev(out + r * cols + c, x);
        }
        return;
    }
    for (int c = lane; c < cols; c += 32) out[r * cols + c] = first ? e[r * cols + c] : e[r * cols + c] + e[(r - 1) * cols + c] * g;
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
    // Rows in 16-byte chunks: a chunk per lane at a time (the dot's terms summed in another
    // order than the element path's).
    const bool chunks = chunked(cols, dout, e, de);
    if (r % t != 0 && ids[r] != (unsigned)bos) {
        float dg = 0.f;
        if (chunks) {
            for (int c = lane * AV; c < cols; c += 32 * AV) {
                float a[AV], b[AV];
                loadv(dout + r * cols + c, a);
                loadv(e + (r - 1) * cols + c, b);
                for (int k = 0; k < AV; ++k) dg += a[k] * b[k];
            }
        } else {
            for (int c = lane; c < cols; c += 32) dg += dout[r * cols + c] * e[(r - 1) * cols + c];
        }
        dg = warp_sum(dg);
        dz = dg * l * s * (1.f - s);
        dl = dg * s;
    }
    if (chunks) {
        for (int c = lane * AV; c < cols; c += 32 * AV) {
            float d[AV];
            loadv(dout + r * cols + c, d);
            if (has_next) {
                float nx[AV];
                loadv(dout + (r + 1) * cols + c, nx);
                for (int k = 0; k < AV; ++k) d[k] += g_next * nx[k];
            }
            for (int k = 0; k < AV; ++k)
                if (c + k < win) d[k] += dz * w[c + k];
            storev(de + r * cols + c, d);
        }
    }
    for (int c = lane; c < cols && !chunks; c += 32) {
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
// Rows in 16-byte chunks take them a chunk at a time (the same maths per element).
extern "C" __global__ void eng_lanes_fwd(const act* l0, const act* l1, const act* ao, const act* mo, const float* sa,
                                         const float* sm, const float* r, const float* p, act* out0, act* out1, long n, int cols) {
    if (chunked(cols, l0, l1, ao, mo, out0, out1)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float x0[AV], x1[AV], av[AV], mv[AV];
            loadv(l0 + i, x0);
            loadv(l1 + i, x1);
            loadv(ao + i, av);
            loadv(mo + i, mv);
            for (int k = 0; k < AV; ++k) {
                const float a = sa[c + k] * av[k], m = sm[c + k] * mv[k];
                x0[k] = r[0] * x0[k] + p[0] * a + p[2] * m;
                x1[k] = r[1] * x1[k] + p[1] * a + p[3] * m;
            }
            storev(out0 + i, x0);
            storev(out1 + i, x1);
        }
        return;
    }
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
    if (chunked(cols, g0, g1, dl0, dl1, dao, dmo)) {
        FOR_CHUNKS(i, n) {
            const int c = (int)(i % cols);
            float x0[AV], x1[AV], a[AV], m[AV];
            loadv(g0 + i, x0);
            loadv(g1 + i, x1);
            for (int k = 0; k < AV; ++k) {
                a[k] = sa[c + k] * (p[0] * x0[k] + p[1] * x1[k]);
                m[k] = sm[c + k] * (p[2] * x0[k] + p[3] * x1[k]);
                x0[k] = r[0] * x0[k];
                x1[k] = r[1] * x1[k];
            }
            storev(dl0 + i, x0);
            storev(dl1 + i, x1);
            storev(dao + i, a);
            storev(dmo + i, m);
        }
        return;
    }
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

// starts[r t + p] = the first position of the attention segment holding position p of row r:
// with d the document start (the last position at or before p whose id is bos, else 0),
// d + floor((p - d) / max_len) max_len (max_len = 0: d), as DocRule::start. Warp per row, 32
// positions at a time: a ballot of the BOS positions, each lane taking the highest at or below
// it (or the carry): doc_start_at.
__device__ __forceinline__ unsigned segment_start(unsigned doc, int p, int max_len) {
    return max_len > 0 ? doc + ((unsigned)p - doc) / (unsigned)max_len * (unsigned)max_len : doc;
}

// The document start of position p0 + lane of row r (a warp on the 32 positions from p0): the
// last BOS at or before it in the chunk, else *carry (the last one before p0), which becomes
// the chunk's last BOS for the next.
__device__ __forceinline__ unsigned doc_start_at(const unsigned* ids, long r, int t, int bos, int p0, int lane, unsigned* carry) {
    const int p = p0 + lane;
    const unsigned mask = __ballot_sync(0xffffffffu, p < t && ids[r * t + p] == (unsigned)bos);
    const unsigned upto = mask & (0xffffffffu >> (31 - lane));
    const unsigned doc = upto ? (unsigned)(p0 + 31 - __clz(upto)) : *carry;
    if (mask) *carry = (unsigned)(p0 + 31 - __clz(mask));
    return doc;
}

extern "C" __global__ void eng_doc_starts(const unsigned* ids, unsigned* starts, long rows, int t, int bos, int max_len) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    unsigned carry = 0;
    for (int p0 = 0; p0 < t; p0 += 32) {
        const int p = p0 + lane;
        const unsigned doc = doc_start_at(ids, r, t, bos, p0, lane, &carry);
        if (p < t) starts[r * t + p] = segment_start(doc, p, max_len);
    }
}

// cuDNN's ragged attention over the segments of a micro-batch (src/engine/gpu/sdpa.rs), packed
// as cuDNN's THD layout reads it: row r's segments in order in slots r t, r t + 1, ..., then
// its unused slots (length 0). slot_len[s] is slot s's length and slot_start[s] its first
// position (r t + p; for an unused slot, the row's end (r + 1) t), so that each slot starts
// where the one before it ends and the offsets `start * stride` are cumulative. A segment
// starts where eng_doc_starts's start(p) = p (a row's first position, each id equal to bos,
// every max_len positions from a document's start) and runs to the next start or the row's
// end. pos_len (n entries) is scratch: first 1 at each start (0 elsewhere), then the length of
// the segment starting at each position. Warp per row, each lane on the same positions in
// every pass: 32 positions at a time from the front (the starts), from the end (each start's
// length: the lowest start above it, or the carry from the chunk after), then from the front
// (each start's slot: the starts below it in the chunk, plus the carry), then the unused slots.
extern "C" __global__ void eng_doc_slots(const unsigned* ids, unsigned* pos_len, int* slot_len, int* slot_start, long rows, int t, int bos,
                                         int max_len) {
    const long r = warp_row(rows);
    if (r < 0) return;
    const int lane = threadIdx.x & 31;
    unsigned carry = 0;
    for (int p0 = 0; p0 < t; p0 += 32) {
        const int p = p0 + lane;
        const unsigned doc = doc_start_at(ids, r, t, bos, p0, lane, &carry);
        if (p < t) pos_len[r * t + p] = segment_start(doc, p, max_len) == (unsigned)p ? 1u : 0u;
    }
    __syncwarp();
    int next = t;
    for (int p0 = (t - 1) / 32 * 32; p0 >= 0; p0 -= 32) {
        const int p = p0 + lane;
        const bool start = p < t && pos_len[r * t + p] != 0;
        const unsigned mask = __ballot_sync(0xffffffffu, start);
        const unsigned above = lane == 31 ? 0u : mask & (0xffffffffu << (lane + 1));
        if (p < t) pos_len[r * t + p] = start ? (above ? p0 + __ffs(above) - 1 : next) - p : 0;
        if (mask) next = p0 + __ffs(mask) - 1;
    }
    __syncwarp();
    int count = 0;
    for (int p0 = 0; p0 < t; p0 += 32) {
        const int p = p0 + lane;
        const bool start = p < t && pos_len[r * t + p] != 0;
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
