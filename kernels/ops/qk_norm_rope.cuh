// Per-head RMS norm then rotary position embedding (RoPE) of a head of d values, for queries
// and keys (a warp per row and head). With y = x / r the RMS-normed head (rms_norm.cuh), the
// first `rot` values form the pairs (a, b) = (y[i], y[i + half]), half = rot / 2, rotated by the
// angle of the token's position for frequency i, c = cos, s = sin:
//   out[i] = (a c + b s) gain,  out[i + half] = (b c - a s) gain,  out[i] = y[i] gain past rot;
// gain is a per-head scale (1 without one). The gradient first rotates the output's gradient g
// back (the transposed rotation) into dy:
//   dy[i] = ga c - gb s,  dy[i + half] = ga s + gb c   for (ga, gb) = (g[i], g[i + half]) gain,
// then takes the RMS norm's backward pass: dx = dy / r - x sum(x dy) / (d r^3).
// cos and sin are read through pointers to the position's row (of `half` values each): the
// model's op keeps them as one table [cos | sin], the engine as two.
#pragma once
#include "common.cuh"
#include "rms_norm.cuh"

namespace ops {

// The rotation of a pair (a, b): the first and the second value.
__device__ __forceinline__ float rope_lo(float a, float b, float c, float s) { return a * c + b * s; }
__device__ __forceinline__ float rope_hi(float a, float b, float c, float s) { return b * c - a * s; }
// The transposed rotation of a pair of gradients (ga, gb).
__device__ __forceinline__ float unrope_lo(float ga, float gb, float c, float s) { return ga * c - gb * s; }
__device__ __forceinline__ float unrope_hi(float ga, float gb, float c, float s) { return ga * s + gb * c; }

// The forward pass of one head x into y (stored as T), cos and sin rows cr, sr; returns 1 / r.
// `Partial`: whether values past the rotated pairs (2 half < d) may exist.
template <class M, bool Partial, typename T, typename TC>
__device__ __forceinline__ float norm_rope_row(const T* xh, T* yh, const TC* cr, const TC* sr, int d, int half,
                                               float eps, float gain) {
    const int lane = lane_id();
    const float inv = rms_rstd<M>(row_sum_sq(xh, d), d, eps);
    for (int i = lane; i < half; i += 32) {
        const float a = load(xh, i) * inv, b = load(xh, i + half) * inv;
        const float c = load(cr, i), s = load(sr, i);
        store(yh, i, rope_lo(a, b, c, s) * gain);
        store(yh, i + half, rope_hi(a, b, c, s) * gain);
    }
    if (Partial)
        for (int i = 2 * half + lane; i < d; i += 32) store(yh, i, load(xh, i) * inv * gain);
    return inv;
}

// The backward pass's write: dx = dy / r - x k over the head, k = sum(x dy) / (d r^3) (the
// caller's sweep of the head gave it).
template <bool Partial, typename T, typename TD, typename TC>
__device__ __forceinline__ void norm_rope_bwd_row(const T* xh, const T* gh, TD* dh, const TC* cr, const TC* sr, int d,
                                                  int half, float inv, float k, float gain) {
    const int lane = lane_id();
    for (int i = lane; i < half; i += 32) {
        const float ga = load(gh, i) * gain, gb = load(gh, i + half) * gain;
        const float c = load(cr, i), s = load(sr, i);
        store(dh, i, unrope_lo(ga, gb, c, s) * inv - load(xh, i) * k);
        store(dh, i + half, unrope_hi(ga, gb, c, s) * inv - load(xh, i + half) * k);
    }
    if (Partial)
        for (int i = 2 * half + lane; i < d; i += 32) store(dh, i, load(gh, i) * gain * inv - load(xh, i) * k);
}

}  // namespace ops
