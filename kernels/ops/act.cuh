// The MLP's activation, elementwise: y = l^2 with l = leaky_relu(x) = x for x > 0, else
// slope x (slope 0: relu^2); its gradient for the output's gradient g: dx = 2 l l' g, with
// l' = 1 for x > 0, else the slope.
// Two forms of l: `relu` (fmaxf: a NaN input gives 0; the model's relu_sq in kernels/fused.cu)
// and `leaky_relu` (a NaN propagates; the engine's, kernels/engine.cu).
#pragma once

namespace ops {

__device__ __forceinline__ float relu(float x) { return fmaxf(x, 0.f); }
__device__ __forceinline__ float leaky_relu(float x, float slope) { return x > 0.f ? x : x * slope; }
// l' of leaky_relu.
__device__ __forceinline__ float leaky_relu_slope(float x, float slope) { return x > 0.f ? 1.f : slope; }

// y = l^2 and dx = 2 l l' g.
__device__ __forceinline__ float act_sq(float l) { return l * l; }
__device__ __forceinline__ float act_sq_grad(float l, float dl, float g) { return 2.f * l * dl * g; }

}  // namespace ops
