// Per-channel scales on rows of d channels (c = j mod d the channel of element j; s and mix
// are parameters of d and 2 d values):
//   scale_cols:  y = x s[c]                      (also the backward pass of the two below: dx = dy s)
//   scale_add:   y = base + x s[c]               gradients: dbase = dy, dx = dy s, ds = sum_rows dy x
//   resid_mix:   y = h mix[c] + x0 mix[d + c]    gradients: dh = du mix[c], dx0 = du mix[d + c],
//                                                dmix = (sum_rows du h, sum_rows du x0)
// The per-channel sums over rows are colsum.cuh's. The model's kernels (kernels/fused.cu) give a
// warp to a row, the engine's (kernels/engine.cu) stride a grid over the elements.
#pragma once

namespace ops {

__device__ __forceinline__ float scaled(float x, float s) { return x * s; }
__device__ __forceinline__ float add_scaled(float base, float x, float s) { return base + x * s; }
__device__ __forceinline__ float mixed(float h, float x0, float m0, float m1) { return h * m0 + x0 * m1; }

}  // namespace ops
