// Warp and block reductions of the row kernels (kernels/fused.cu, kernels/engine.cu).
//
// warp_sum(v) = v_0 + ... + v_31 and warp_max(v) = max(v_0, ..., v_31) over the lanes of a
// warp, by a butterfly of shuffles (offsets 16, 8, 4, 2, 1): every lane ends with the result,
// added in the same order in every lane, so every lane holds the same bits.
// group_sum(v, L): the same sum over each aligned group of L lanes (L a power of two up to 32).
// block_sum(v, sh) / block_max(v, sh): over the whole block (blockDim.x a multiple of 32, at
// most 256 threads: `sh` holds 8 floats of shared memory), the warps' results added (or
// maxed) in warp order; valid in every thread. Every thread of the block must call them.
#pragma once
#include <math_constants.h>

namespace ops {

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float group_sum(float s, int L) {
    for (int o = L / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < (int)blockDim.x / 32; ++i) s += sh[i];
    return s;
}

__device__ __forceinline__ float block_max(float v, float* sh) {
    v = warp_max(v);
    const int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float m = -CUDART_INF_F;
    for (int i = 0; i < (int)blockDim.x / 32; ++i) m = fmaxf(m, sh[i]);
    return m;
}

}  // namespace ops
