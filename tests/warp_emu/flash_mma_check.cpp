// Runs kernels/flash_mma.cu's three kernels in the warp emulator on random bf16 inputs and
// compares them with causal GQA attention computed in double (forward: o and the base-2
// log-sum-exp; backward: dq, dk, dv for a random output gradient). Prints one line per tensor
// and exits non-zero if any error exceeds its bound. Driven by tests/warp_emulation.rs.
//
// With `docs` = 1 it runs the document entry points (`*_docs_bf16`) on segments that start at
// positions 37, 64, 65 and 130 of row 0 and 100 of the others (keys before a query's segment
// start hidden in the reference too): at 192 tokens the last query tile skips the first key
// tile, its rows from 130 see nothing of the second, and dk/dv mask across query tiles.
//
// Usage: flash_mma_check [batch seq heads kv_heads seed docs]. Built with -DFLASH_MMA_SOURCE='"path"'
// it checks another copy of the kernels (the test's deliberately broken ones).
#include "warp_emu.h"
#ifdef FLASH_MMA_SOURCE
#include FLASH_MMA_SOURCE
#else
#include "../../kernels/flash_mma.cu"
#endif

#include <algorithm>
#include <cmath>
#include <random>

typedef __nv_bfloat16 bf;

static std::vector<bf> random_bf16(size_t n, std::mt19937_64& rng, float sd) {
    std::normal_distribution<float> dist(0.f, sd);
    std::vector<bf> out(n);
    for (bf& x : out) x = __float2bfloat16(dist(rng));
    return out;
}

static std::vector<double> widen(const std::vector<bf>& x) {
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = __bfloat162float(x[i]);
    return out;
}

// max |got - want| / max |want|, the tolerance's scale: bf16 keeps 8 bits of mantissa.
static bool report(const char* what, const std::vector<double>& got, const std::vector<double>& want, double bound) {
    double err = 0, scale = 0;
    size_t worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double e = std::fabs(got[i] - want[i]);
        if (!(e <= err)) {  // catches NaN too
            err = std::isnan(e) ? INFINITY : e;
            worst = i;
        }
        scale = std::max(scale, std::fabs(want[i]));
    }
    const double rel = err / std::max(scale, 1e-30);
    const bool ok = rel <= bound;
    printf("%-4s max error %.3e of max %.3e (relative %.3e, bound %.1e, worst at %zu: got %.6f want %.6f) %s\n", what, err, scale, rel,
           bound, worst, got[worst], want[worst], ok ? "ok" : "FAILED");
    return ok;
}

static void no_copies_left() {
    if (!emu::in_flight.empty() || !emu::open_group.empty()) {
        fprintf(stderr, "warp emulator: thread %u of block %u,%u ended with cp.async copies not waited for\n", threadIdx.x, blockIdx.x,
                blockIdx.y);
        abort();
    }
    emu::in_flight.clear();
}

int main(int argc, char** argv) {
    const int batch = argc > 1 ? atoi(argv[1]) : 2, t = argc > 2 ? atoi(argv[2]) : 192;
    const int heads = argc > 3 ? atoi(argv[3]) : 4, kvh = argc > 4 ? atoi(argv[4]) : 2;
    const uint64_t seed = argc > 5 ? strtoull(argv[5], nullptr, 10) : 7;
    const bool docs = argc > 6 && atoi(argv[6]) != 0;
    if (batch <= 0 || t <= 0 || t % 64 != 0 || heads <= 0 || kvh <= 0 || heads % kvh != 0) {
        fprintf(stderr, "usage: flash_mma_check [batch seq(multiple of 64) heads kv_heads(dividing heads) seed]\n");
        return 2;
    }
    const int d = 64, group = heads / kvh;
    const long n = (long)batch * t, wq = (long)heads * d, wk = (long)kvh * d;
    std::mt19937_64 rng(seed);
    // Scores of spread ~2.5 (softmax neither flat nor one-hot); unit output gradients.
    const std::vector<bf> q = random_bf16(n * wq, rng, 1.6f), k = random_bf16(n * wk, rng, 1.6f);
    const std::vector<bf> v = random_bf16(n * wk, rng, 1.f), go = random_bf16(n * wq, rng, 1.f);
    const std::vector<double> qd = widen(q), kd = widen(k), vd = widen(v), gd = widen(go);
    const double scale = 1.0 / std::sqrt((double)d);
    // Each position's segment start (0 everywhere without `docs`).
    std::vector<unsigned> starts(n, 0);
    for (int b = 0; b < batch && docs; ++b) {
        unsigned lo = 0;
        for (int i = 0; i < t; ++i) {
            const bool bos = b == 0 ? (i == 37 || i == 64 || i == 65 || i == 130) : i == 100;
            if (bos) lo = (unsigned)i;
            starts[(long)b * t + i] = lo;
        }
    }

    // Reference, double.
    std::vector<double> o_ref(n * wq, 0), lse_ref((long)batch * heads * t), dq_ref(n * wq, 0), dk_ref(n * wk, 0), dv_ref(n * wk, 0);
    std::vector<double> p(t), dp(t);
    for (int b = 0; b < batch; ++b) {
        for (int h = 0; h < heads; ++h) {
            const int kh = h / group;
            for (int i = 0; i < t; ++i) {
                const double* qi = &qd[(b * (long)t + i) * wq + h * d];
                const int j0 = (int)starts[(long)b * t + i];
                double mx = -INFINITY;
                for (int j = j0; j <= i; ++j) {
                    const double* kj = &kd[(b * (long)t + j) * wk + kh * d];
                    double s = 0;
                    for (int c = 0; c < d; ++c) s += qi[c] * kj[c];
                    p[j] = s * scale;
                    mx = std::max(mx, p[j]);
                }
                double sum = 0;
                for (int j = j0; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
                lse_ref[((long)b * heads + h) * t + i] = (mx + std::log(sum)) / std::log(2.0);
                double* oi = &o_ref[(b * (long)t + i) * wq + h * d];
                const double* gi = &gd[(b * (long)t + i) * wq + h * d];
                for (int j = j0; j <= i; ++j) {
                    p[j] /= sum;
                    const double* vj = &vd[(b * (long)t + j) * wk + kh * d];
                    for (int c = 0; c < d; ++c) oi[c] += p[j] * vj[c];
                }
                double delta = 0;
                for (int c = 0; c < d; ++c) delta += oi[c] * gi[c];
                for (int j = j0; j <= i; ++j) {
                    const double* vj = &vd[(b * (long)t + j) * wk + kh * d];
                    double s = 0;
                    for (int c = 0; c < d; ++c) s += gi[c] * vj[c];
                    const double ds = p[j] * (s - delta) * scale;
                    const double* kj = &kd[(b * (long)t + j) * wk + kh * d];
                    double* dqi = &dq_ref[(b * (long)t + i) * wq + h * d];
                    double* dkj = &dk_ref[(b * (long)t + j) * wk + kh * d];
                    double* dvj = &dv_ref[(b * (long)t + j) * wk + kh * d];
                    for (int c = 0; c < d; ++c) {
                        dqi[c] += ds * kj[c];
                        dkj[c] += ds * qi[c];
                        dvj[c] += p[j] * gi[c];
                    }
                }
            }
        }
    }

    // Kernels, emulated. Buffers over-aligned as the device allocator's are.
    const float scale_log2 = (float)(scale * M_LOG2E);
    std::vector<bf> o(n * wq), dq(n * wq), dk(n * wk), dv(n * wk);
    std::vector<float> lse((long)batch * heads * t, NAN), delta((long)batch * heads * t);
    const dim3 query_grid{(unsigned)(t / 64), (unsigned)(batch * heads), 1};
    if (docs) {
        emu::launch(flash_fwd_mma_docs_bf16, query_grid, 128, no_copies_left, q.data(), k.data(), v.data(), o.data(), lse.data(), t, heads,
                    kvh, scale_log2, (const unsigned*)starts.data());
    } else {
        emu::launch(flash_fwd_mma_bf16, query_grid, 128, no_copies_left, q.data(), k.data(), v.data(), o.data(), lse.data(), t, heads, kvh,
                    scale_log2);
    }
    // delta = rowsum(o * go) of the kernel's bf16 output (flash_attn.cu's flash_delta_bf16).
    for (long r = 0; r < n * heads; ++r) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += (double)__bfloat162float(o[r * d + c]) * __bfloat162float(go[r * d + c]);
        const long tok = r / heads, h = r % heads, b = tok / t, i = tok % t;
        delta[(b * heads + h) * t + i] = (float)acc;
    }
    const dim3 key_grid{(unsigned)(t / 64), (unsigned)(batch * kvh), 1};
    if (docs) {
        const unsigned* st = starts.data();
        emu::launch(flash_bwd_dkdv_mma_docs_bf16, key_grid, 128, no_copies_left, q.data(), k.data(), v.data(), go.data(), lse.data(),
                    delta.data(), dk.data(), dv.data(), t, heads, kvh, scale_log2, (float)scale, st);
        emu::launch(flash_bwd_dq_mma_docs_bf16, query_grid, 128, no_copies_left, q.data(), k.data(), v.data(), go.data(), lse.data(),
                    delta.data(), dq.data(), t, heads, kvh, scale_log2, (float)scale, st);
    } else {
        emu::launch(flash_bwd_dkdv_mma_bf16, key_grid, 128, no_copies_left, q.data(), k.data(), v.data(), go.data(), lse.data(),
                    delta.data(), dk.data(), dv.data(), t, heads, kvh, scale_log2, (float)scale);
        emu::launch(flash_bwd_dq_mma_bf16, query_grid, 128, no_copies_left, q.data(), k.data(), v.data(), go.data(), lse.data(),
                    delta.data(), dq.data(), t, heads, kvh, scale_log2, (float)scale);
    }

    printf("flash_mma emulated: batch %d, seq %d, heads %d, kv heads %d, seed %llu%s\n", batch, t, heads, kvh, (unsigned long long)seed,
           docs ? ", within documents" : "");
    bool ok = report("o", widen(o), o_ref, 1e-2);
    ok &= report("lse", std::vector<double>(lse.begin(), lse.end()), lse_ref, 1e-4);
    ok &= report("dq", widen(dq), dq_ref, 2e-2);
    ok &= report("dk", widen(dk), dk_ref, 2e-2);
    ok &= report("dv", widen(dv), dv_ref, 2e-2);
    return ok ? 0 : 1;
}
