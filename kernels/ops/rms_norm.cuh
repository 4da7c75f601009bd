// RMS norm of a row of d values x (a warp per row, lanes strided over it so that loads
// coalesce):
//   r = sqrt(mean(x^2) + eps),  y = x s / r;
// and its gradient for the output's gradient g:
//   dx = s (g / r - x sum(g x) / (d r^3)).
// s is a constant scale: 1 in the model's op (kernels/fused.cu), the engine's folded factor in
// kernels/engine.cu. 1 / r is `M::rsqrt` of common.cuh (Fast or Precise).
#pragma once
#include "common.cuh"
#include "reduce.cuh"

namespace ops {

// sum(x^2) over the row, in every lane.
template <typename T>
__device__ __forceinline__ float row_sum_sq(const T* xr, int d) {
    float ss = 0.f;
    for (int j = lane_id(); j < d; j += 32) {
        float v = load(xr, j);
        ss += v * v;
    }
    return warp_sum(ss);
}

// sum(x g) over the row, in every lane.
template <typename T, typename TG>
__device__ __forceinline__ float row_dot(const T* xr, const TG* gr, int d) {
    float xg = 0.f;
    for (int j = lane_id(); j < d; j += 32) xg += load(xr, j) * load(gr, j);
    return warp_sum(xg);
}

// Both sums of the backward pass in one sweep of the row: ss = sum(x^2), xg = sum(x g).
template <typename T, typename TG>
__device__ __forceinline__ void row_sum_sq_dot(const T* xr, const TG* gr, int d, float& ss, float& xg) {
    ss = 0.f;
    xg = 0.f;
    for (int j = lane_id(); j < d; j += 32) {
        float v = load(xr, j);
        ss += v * v;
        xg += v * load(gr, j);
    }
    ss = warp_sum(ss);
    xg = warp_sum(xg);
}

// 1 / r from sum(x^2).
template <class M>
__device__ __forceinline__ float rms_rstd(float ss, int d, float eps) {
    return M::rsqrt(ss / d + eps);
}

// y = x s / r over the row (stored as TY); returns 1 / r.
template <class M, typename T, typename TY>
__device__ __forceinline__ float rms_norm_row(const T* xr, TY* yr, int d, float eps, float s) {
    const float inv = rms_rstd<M>(row_sum_sq(xr, d), d, eps);
    const float a = inv * s;
    for (int j = lane_id(); j < d; j += 32) store(yr, j, load(xr, j) * a);
    return inv;
}

// dx = s (g / r - x sum(g x) / (d r^3)) over the row, given 1 / r and xg = sum(g x); written,
// or added to dx when `acc`.
template <typename T, typename TG>
__device__ __forceinline__ void rms_norm_bwd_row(const T* xr, const TG* gr, T* dr, int d, float inv, float xg, float s,
                                                 bool acc) {
    const float a = inv * s, c = xg / d * inv * inv * inv * s;
    for (int j = lane_id(); j < d; j += 32) {
        const float v = load(gr, j) * a - load(xr, j) * c;
        store(dr, j, acc ? load(dr, j) + v : v);
    }
}

}  // namespace ops
