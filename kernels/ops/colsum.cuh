// Per-channel sums over the rows of (rows x cols) tensors, the parameters' gradients of the
// per-channel ops (scale.cuh):
//   out[j] = sum over rows r of a[r][j]   or   of a[r][j] b[r][j],
// deterministic, without atomics, in two passes: partial sums over runs of rows (a thread per
// channel, so that loads coalesce across channels; float32 accumulation whatever the storage
// types), then the partials added in order. The same inputs give the same bits on every run
// and under CUDA graph replay.
#pragma once
#include "common.cuh"

namespace ops {

// sum over r in [r0, r1) of a[r][j].
template <typename T>
__device__ __forceinline__ float column_sum(const T* a, long r0, long r1, int cols, int j) {
    float s = 0.f;
    for (long r = r0; r < r1; ++r) s += load(a, r * cols + j);
    return s;
}

// sum over r in [r0, r1) of a[r][j] b[r][j].
template <typename T, typename TB>
__device__ __forceinline__ float column_dot(const T* a, const TB* b, long r0, long r1, int cols, int j) {
    float s = 0.f;
    for (long r = r0; r < r1; ++r) s += load(a, r * cols + j) * load(b, r * cols + j);
    return s;
}

// The second pass: sum over p = 0, 1, ... parts - 1 of part[p stride + j], in that order.
__device__ __forceinline__ float column_total(const float* part, int parts, long stride, long j) {
    float s = 0.f;
    for (int p = 0; p < parts; ++p) s += part[p * stride + j];
    return s;
}

}  // namespace ops
