// Soft-capped cross-entropy of a row of v logits x with target y (in float32 whatever the
// logits' storage):
//   t = tanh(x / cap),  z = cap t,  loss = logsumexp(z) - z[y] = log(sum_j exp(z_j - m)) + m - z[y]
// with m = max_j z_j (tanh increases: the largest logit gives it); its gradient for the loss's
// gradient g:
//   dx_j = (softmax(z)_j - [j == y]) (1 - t_j^2) g.
// A target outside 0..v gives a NaN loss (and gradient), not a read past the row.
// The model's kernels (kernels/fused.cu) run the loss and its gradient as two kernels, a warp
// per row, the gradient recovering logsumexp(z) from the loss; the engine (kernels/engine.cu)
// runs both in one, a block per row. exp is `M::exp` of common.cuh.
#pragma once
#include <math_constants.h>
#include "common.cuh"

namespace ops {

// The target of a position that neither counts in the loss nor sends a gradient (the engine's
// fused loss: the padding of a partial batch; src/model/ops/softcap_ce.rs's IGNORED_TARGET).
constexpr unsigned IGNORED_TARGET = 0xFFFFFFFFu;

// t = tanh(x / cap), given 1 / cap.
__device__ __forceinline__ float softcap_tanh(float x, float inv_cap) { return tanhf(x * inv_cap); }

// t of the target's logit in row xr of v logits, NaN for a target outside the row.
template <typename T>
__device__ __forceinline__ float target_tanh(const T* xr, unsigned y, int v, float inv_cap) {
    return y < (unsigned)v ? softcap_tanh(load(xr, y), inv_cap) : CUDART_NAN_F;
}

// The loss from sum = sum_j exp(z_j - m), m and t of the target.
__device__ __forceinline__ float softcap_ce_loss(float sum, float m, float cap, float ty) {
    return logf(sum) + m - cap * ty;
}

// d tanh(x / cap) / d(x / cap) = 1 - t^2.
__device__ __forceinline__ float tanh_slope(float t) { return 1.f - t * t; }

}  // namespace ops
