// 16-byte chunks of a row for the vectorized row kernels of kernels/fused.cu (the model's
// q/k norm + RoPE on f32 and bf16) and kernels/engine.cu (the engine's chunked paths, on f32 or
// bf16 activations): a uint4 holds
// 4 floats or 8 bf16; `unpack` widens it to floats, `pack` rounds floats back (bf16: to nearest
// even), and `shfl_xor` fetches another lane's chunk (a rotation pair's other half).
#pragma once
#include <cuda_bf16.h>

namespace ops {

__device__ __forceinline__ void unpack(const uint4& u, float (&v)[4]) {
    v[0] = __uint_as_float(u.x), v[1] = __uint_as_float(u.y), v[2] = __uint_as_float(u.z), v[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const uint4& u, float (&v)[8]) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
    for (int k = 0; k < 4; ++k) {
        // bf16 is the high half of a float: element 2k is the word's low 16 bits (little endian).
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}
__device__ __forceinline__ uint4 pack(const float (&v)[4]) {
    return uint4{__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])};
}
__device__ __forceinline__ uint4 pack(const float (&v)[8]) {
    unsigned w[4];
    for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        memcpy(&w[k], &h, 4);
    }
    return uint4{w[0], w[1], w[2], w[3]};
}
__device__ __forceinline__ uint4 shfl_xor(const uint4& u, int o) {
    return uint4{__shfl_xor_sync(0xffffffffu, u.x, o), __shfl_xor_sync(0xffffffffu, u.y, o),
                 __shfl_xor_sync(0xffffffffu, u.z, o), __shfl_xor_sync(0xffffffffu, u.w, o)};
}

}  // namespace ops
