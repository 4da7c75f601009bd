// Runs kernels/fused.cu's mixed-precision kernels (`*_f32_bf16`: a float32 residual stream,
// bfloat16 products) in the warp emulator and checks the claim the model relies on: each gives
// bit for bit what its one-type float32 kernel gives followed by a cast (rms_norm_fwd,
// scale_cols: the output rounded to bf16; rms_norm_bwd, scale_add, column_dot: the bf16 input
// widened first). The float32 kernels themselves are compared with double references, and so
// is the soft-capped cross-entropy pair (f32 and bf16 logits).
// Prints one line per check and exits non-zero on any failure. Driven by tests/warp_emulation.rs.
//
// Usage: fused_check [rows len seed] (rows of `len` values; the launches are the ones of
// src/model/cuda/fused.rs: a warp per row and 8 rows per block, or a thread per channel and
// 64 rows per partial sum). Built with -DFUSED_SOURCE='"path"' it checks another copy of the
// kernels (the test's deliberately broken one, with its copy of the headers of kernels/ops/).
#include "warp_emu.h"
#ifdef FUSED_SOURCE
#include FUSED_SOURCE
#else
#include "../../kernels/fused.cu"
#endif

#include <algorithm>
#include <cmath>
#include <random>

typedef __nv_bfloat16 bf;

static void nothing() {}

// A warp per row, eight rows per block (model::cuda::fused::launch_rows).
template <class... P, class... A>
static void rows(void (*kernel)(P...), long n_rows, A... args) {
    emu::launch(kernel, dim3{static_cast<unsigned>((n_rows + 7) / 8), 1, 1}, 256, nothing, args...);
}

static std::vector<float> random_f32(size_t n, std::mt19937_64& rng, float sd) {
    std::normal_distribution<float> dist(0.f, sd);
    std::vector<float> out(n);
    for (float& x : out) x = dist(rng);
    return out;
}

static std::vector<bf> to_bf16(const std::vector<float>& x) {
    std::vector<bf> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = __float2bfloat16(x[i]);
    return out;
}

static std::vector<float> to_f32(const std::vector<bf>& x) {
    std::vector<float> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = __bfloat162float(x[i]);
    return out;
}

static bool failed = false;

static void same_bits(const char* what, const std::vector<bf>& got, const std::vector<bf>& want) {
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) bad += got[i].x != want[i].x;
    printf("%-40s %zu of %zu values differ %s\n", what, bad, want.size(), bad ? "FAILED" : "ok");
    failed |= bad != 0;
}

static void same_bits(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) bad += memcmp(&got[i], &want[i], 4) != 0;
    printf("%-40s %zu of %zu values differ %s\n", what, bad, want.size(), bad ? "FAILED" : "ok");
    failed |= bad != 0;
}

static void close_to(const char* what, const std::vector<float>& got, const std::vector<double>& want, double bound) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double e = std::fabs(got[i] - want[i]);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
        scale = std::max(scale, std::fabs(want[i]));
    }
    const double rel = err / std::max(scale, 1e-30);
    const bool ok = rel <= bound;
    printf("%-40s relative error %.3e (bound %.1e) %s\n", what, rel, bound, ok ? "ok" : "FAILED");
    failed |= !ok;
}

int main(int argc, char** argv) {
    const long n = argc > 1 ? atol(argv[1]) : 37;
    const int d = argc > 2 ? atoi(argv[2]) : 70;
    std::mt19937_64 rng(argc > 3 ? strtoull(argv[3], nullptr, 10) : 1);
    const size_t len = static_cast<size_t>(n) * d;
    const float eps = 1.1920929e-07f;  // ops::rms_eps(F32)

    const std::vector<float> x = random_f32(len, rng, 1.5f), g = random_f32(len, rng, 0.5f);
    const std::vector<float> base = random_f32(len, rng, 1.f), s = random_f32(d, rng, 1.f);
    const std::vector<bf> g16 = to_bf16(g), x16 = to_bf16(random_f32(len, rng, 1.f));

    // The double references of the float32 kernels.
    std::vector<double> norm(len), norm_bwd(len), dot(d, 0.0);
    for (long r = 0; r < n; ++r) {
        const float* xr = &x[r * d];
        double ss = 0, xg = 0;
        for (int j = 0; j < d; ++j) ss += double(xr[j]) * xr[j], xg += double(xr[j]) * __bfloat162float(g16[r * d + j]);
        const double inv = 1.0 / std::sqrt(ss / d + eps);
        for (int j = 0; j < d; ++j) {
            norm[r * d + j] = xr[j] * inv;
            norm_bwd[r * d + j] = __bfloat162float(g16[r * d + j]) * inv - xr[j] * xg / d * inv * inv * inv;
            dot[j] += double(g[r * d + j]) * __bfloat162float(x16[r * d + j]);
        }
    }

    // rms_norm_fwd: f32 -> bf16 equals f32 -> f32 then a cast.
    std::vector<float> y32(len);
    std::vector<bf> y16(len);
    rows(rms_norm_fwd_f32, n, x.data(), y32.data(), n, d, eps);
    rows(rms_norm_fwd_f32_bf16, n, x.data(), y16.data(), n, d, eps);
    close_to("rms_norm_fwd_f32 vs double", y32, norm, 1e-6);
    same_bits("rms_norm_fwd_f32_bf16 = cast", y16, to_bf16(y32));

    // rms_norm_bwd: a bf16 gradient equals its widened copy.
    std::vector<float> dx32(len), dx16(len);
    const std::vector<float> g_wide = to_f32(g16);
    rows(rms_norm_bwd_f32, n, x.data(), g_wide.data(), dx32.data(), n, d, eps);
    rows(rms_norm_bwd_f32_bf16, n, x.data(), g16.data(), dx16.data(), n, d, eps);
    close_to("rms_norm_bwd_f32 vs double", dx32, norm_bwd, 1e-5);
    same_bits("rms_norm_bwd_f32_bf16 = widened", dx16, dx32);

    // scale_cols: f32 -> bf16 equals f32 then a cast.
    std::vector<float> sc32(len);
    std::vector<bf> sc16(len);
    rows(scale_cols_f32, n, g.data(), s.data(), sc32.data(), n, d, 0.f);
    rows(scale_cols_f32_bf16, n, g.data(), s.data(), sc16.data(), n, d, 0.f);
    same_bits("scale_cols_f32_bf16 = cast", sc16, to_bf16(sc32));

    // scale_add: a bf16 branch equals its widened copy.
    std::vector<float> sa32(len), sa16(len);
    const std::vector<float> x_wide = to_f32(x16);
    rows(scale_add_f32, n, base.data(), x_wide.data(), s.data(), sa32.data(), n, d, 0.f);
    rows(scale_add_f32_bf16, n, base.data(), x16.data(), s.data(), sa16.data(), n, d, 0.f);
    same_bits("scale_add_f32_bf16 = widened", sa16, sa32);

    // column_dot: partial sums of 64 rows (a thread per channel, 128 per block), then their sum.
    const int chunk = 64, chunks = static_cast<int>(std::max<long>(1, (n + chunk - 1) / chunk));
    const dim3 grid{static_cast<unsigned>((d + 127) / 128), static_cast<unsigned>(chunks), 1};
    std::vector<float> p32(static_cast<size_t>(chunks) * d), p16(p32.size()), c32(d), c16(d);
    emu::launch(column_dot_partial_f32, grid, 128, nothing, g.data(), x_wide.data(), p32.data(), n, d, chunk);
    emu::launch(column_dot_partial_f32_bf16, grid, 128, nothing, g.data(), x16.data(), p16.data(), n, d, chunk);
    const dim3 one{static_cast<unsigned>((d + 127) / 128), 1, 1};
    emu::launch(column_dot_sum_f32, one, 128, nothing, p32.data(), c32.data(), chunks, d);
    emu::launch(column_dot_sum_f32, one, 128, nothing, p16.data(), c16.data(), chunks, d);
    close_to("column_dot_f32 vs double", c32, dot, 1e-5);
    same_bits("column_dot_partial_f32_bf16 = widened", c16, c32);

    // softcap_ce: losses and logit gradients against double, for f32 and bf16 logits (rows of
    // `len` classes; the backward pass reads the forward's own losses, as the model does).
    const float cap = 30.f;
    std::vector<float> logits(len), lg(2 * n);
    std::vector<unsigned> targets(n);
    for (size_t i = 0; i < len; ++i) logits[i] = 20.f * x[i];
    for (long r = 0; r < n; ++r) targets[r] = static_cast<unsigned>((r * 7919) % d), lg[n + r] = g[r];
    const std::vector<bf> logits16 = to_bf16(logits);
    for (bool narrow : {false, true}) {
        const std::vector<float> in = narrow ? to_f32(logits16) : logits;
        std::vector<double> want_loss(n), want_grad(len);
        for (long r = 0; r < n; ++r) {
            double m = -INFINITY, s = 0;
            for (int j = 0; j < d; ++j) m = std::max(m, cap * std::tanh(double(in[r * d + j]) / cap));
            for (int j = 0; j < d; ++j) s += std::exp(cap * std::tanh(double(in[r * d + j]) / cap) - m);
            const double lse = std::log(s) + m;
            want_loss[r] = lse - cap * std::tanh(double(in[r * d + targets[r]]) / cap);
            for (int j = 0; j < d; ++j) {
                const double t = std::tanh(double(in[r * d + j]) / cap);
                want_grad[r * d + j] = (std::exp(cap * t - lse) - (j == int(targets[r]))) * (1 - t * t) * g[r];
            }
        }
        std::vector<float> loss(n), grad(len);
        if (narrow) {
            std::vector<bf> grad16(len);
            rows(softcap_ce_fwd_bf16, n, logits16.data(), targets.data(), loss.data(), n, d, cap);
            std::copy(loss.begin(), loss.end(), lg.begin());
            rows(softcap_ce_bwd_bf16, n, logits16.data(), targets.data(), lg.data(), grad16.data(), n, d, cap);
            grad = to_f32(grad16);
        } else {
            rows(softcap_ce_fwd_f32, n, logits.data(), targets.data(), loss.data(), n, d, cap);
            std::copy(loss.begin(), loss.end(), lg.begin());
            rows(softcap_ce_bwd_f32, n, logits.data(), targets.data(), lg.data(), grad.data(), n, d, cap);
        }
        close_to(narrow ? "softcap_ce_fwd_bf16 vs double" : "softcap_ce_fwd_f32 vs double", loss, want_loss, 1e-5);
        // bf16 gradients: one rounding to 8 bits of mantissa.
        close_to(narrow ? "softcap_ce_bwd_bf16 vs double" : "softcap_ce_bwd_f32 vs double", grad, want_grad, narrow ? 4e-3 : 1e-5);
    }

    // A target outside the classes: the row's loss is NaN (the trainer stops on it), the others
    // are untouched.
    {
        std::vector<unsigned> bad(targets.begin(), targets.end());
        bad[n - 1] = static_cast<unsigned>(d);
        std::vector<float> loss(n), want(n);
        rows(softcap_ce_fwd_f32, n, logits.data(), targets.data(), want.data(), n, d, cap);
        rows(softcap_ce_fwd_f32, n, logits.data(), bad.data(), loss.data(), n, d, cap);
        const bool ok = std::isnan(loss[n - 1]) && std::equal(loss.begin(), loss.end() - 1, want.begin());
        printf("%-40s %s\n", "softcap_ce_fwd target out of range", ok ? "NaN loss ok" : "FAILED");
        failed |= !ok;
    }

    // norm_rope: per-head RMS norm then RoPE, the warp-per-row kernels and the 16-byte-chunk
    // ones, forward and backward, against double; `n` tokens of 3 heads at positions n % 5,
    // head dims 16, 64 and 128 (chunks of 2 to 32 lanes per row). The epsilon is the one
    // src/model/ops/rms_norm.rs (rms_eps) gives the dtype (bf16's is 2^-7).
    for (int hd : {16, 64, 128}) {
        const int heads = 3, seq = 5, half = hd / 2;
        const long hr = n * heads;  // head rows
        const size_t hl = static_cast<size_t>(hr) * hd;
        const std::vector<float> hx = random_f32(hl, rng, 1.5f), hg = random_f32(hl, rng, 0.5f);
        std::vector<float> table(static_cast<size_t>(seq) * hd);
        for (int p = 0; p < seq; ++p)
            for (int i = 0; i < half; ++i) {
                const double a = p * std::pow(10000.0, -2.0 * i / hd);
                table[p * hd + i] = float(std::cos(a)), table[p * hd + half + i] = float(std::sin(a));
            }
        for (bool narrow : {false, true}) {
            // bf16 kernels read the bf16 copies; the references take the same values, widened.
            const std::vector<bf> hx16 = to_bf16(hx), hg16 = to_bf16(hg), t16 = to_bf16(table);
            const std::vector<float> xin = narrow ? to_f32(hx16) : hx, gin = narrow ? to_f32(hg16) : hg;
            const std::vector<float> tin = narrow ? to_f32(t16) : table;
            const float heps = narrow ? 7.8125e-3f : eps;
            std::vector<double> want_y(hl), want_dx(hl);
            for (long r = 0; r < hr; ++r) {
                const float* xr = &xin[r * hd];
                const float* gr = &gin[r * hd];
                const float* tr = &tin[((r / heads) % seq) * hd];
                double ss = 0, xdy = 0;
                std::vector<double> dy(hd);
                for (int i = 0; i < half; ++i) {
                    const double c = tr[i], s = tr[half + i];
                    dy[i] = gr[i] * c - gr[i + half] * s, dy[i + half] = gr[i] * s + gr[i + half] * c;
                }
                for (int j = 0; j < hd; ++j) ss += double(xr[j]) * xr[j], xdy += xr[j] * dy[j];
                const double inv = 1.0 / std::sqrt(ss / hd + heps), k = xdy / hd * inv * inv * inv;
                for (int i = 0; i < half; ++i) {
                    const double c = tr[i], s = tr[half + i], y1 = xr[i] * inv, y2 = xr[i + half] * inv;
                    want_y[r * hd + i] = y1 * c + y2 * s, want_y[r * hd + i + half] = y2 * c - y1 * s;
                }
                for (int j = 0; j < hd; ++j) want_dx[r * hd + j] = dy[j] * inv - xr[j] * k;
            }
            // 16-byte chunks: 256 threads per block, hd / E lanes per row.
            const int lanes = hd / (narrow ? 8 : 4);
            const dim3 vgrid{static_cast<unsigned>((hr * lanes + 255) / 256), 1, 1};
            char label[64];
            if (narrow) {
                std::vector<bf> y(hl), dx(hl), vy(hl), vdx(hl);
                rows(norm_rope_fwd_bf16, hr, hx16.data(), t16.data(), y.data(), hr, hd, heps, heads, seq);
                rows(norm_rope_bwd_bf16, hr, hx16.data(), hg16.data(), t16.data(), dx.data(), hr, hd, heps, heads, seq);
                emu::launch(norm_rope_vec_fwd_bf16, vgrid, 256, nothing, hx16.data(), t16.data(), vy.data(), hr, hd, heps, heads, seq);
                emu::launch(norm_rope_vec_bwd_bf16, vgrid, 256, nothing, hx16.data(), hg16.data(), t16.data(), vdx.data(), hr, hd, heps,
                            heads, seq);
                // bf16 outputs: one rounding to 8 bits of mantissa.
                snprintf(label, sizeof label, "norm_rope_fwd_bf16 d=%d vs double", hd);
                close_to(label, to_f32(y), want_y, 4e-3);
                snprintf(label, sizeof label, "norm_rope_vec_fwd_bf16 d=%d vs double", hd);
                close_to(label, to_f32(vy), want_y, 4e-3);
                snprintf(label, sizeof label, "norm_rope_bwd_bf16 d=%d vs double", hd);
                close_to(label, to_f32(dx), want_dx, 4e-3);
                snprintf(label, sizeof label, "norm_rope_vec_bwd_bf16 d=%d vs double", hd);
                close_to(label, to_f32(vdx), want_dx, 4e-3);
            } else {
                std::vector<float> y(hl), dx(hl), vy(hl), vdx(hl);
                rows(norm_rope_fwd_f32, hr, hx.data(), table.data(), y.data(), hr, hd, heps, heads, seq);
                rows(norm_rope_bwd_f32, hr, hx.data(), hg.data(), table.data(), dx.data(), hr, hd, heps, heads, seq);
                emu::launch(norm_rope_vec_fwd_f32, vgrid, 256, nothing, hx.data(), table.data(), vy.data(), hr, hd, heps, heads, seq);
                emu::launch(norm_rope_vec_bwd_f32, vgrid, 256, nothing, hx.data(), hg.data(), table.data(), vdx.data(), hr, hd, heps,
                            heads, seq);
                snprintf(label, sizeof label, "norm_rope_fwd_f32 d=%d vs double", hd);
                close_to(label, y, want_y, 1e-6);
                snprintf(label, sizeof label, "norm_rope_vec_fwd_f32 d=%d vs double", hd);
                close_to(label, vy, want_y, 1e-6);
                snprintf(label, sizeof label, "norm_rope_bwd_f32 d=%d vs double", hd);
                close_to(label, dx, want_dx, 1e-5);
                snprintf(label, sizeof label, "norm_rope_vec_bwd_f32 d=%d vs double", hd);
                close_to(label, vdx, want_dx, 1e-5);
            }
        }
    }

    return failed ? 1 : 0;
}
