// Element access, work split and precision shared by the row kernels of kernels/fused.cu (the
// model's fused ops) and kernels/engine.cu (the explicit engine's), which both include the
// headers of this directory, one per op, for their device maths.
//
// Maths: none of its own. Arithmetic is in float32 whatever the storage type: `load` widens a
// float32 or bfloat16 element to float32, `store` rounds a float32 to the storage type
// (bfloat16: to nearest even). The two executors differ in one choice, passed to the ops'
// functions as a type: `Fast` takes the intrinsics (1 / sqrt(v) by rsqrtf, exp(v) by __expf,
// within a few ulps: fused.cu's), `Precise` the correctly rounded functions (1 / sqrtf, expf:
// engine.cu's, as its CPU reference computes them). The warp emulator (tests/warp_emu) makes
// both exact, so a check there covers the logic of either.
#pragma once
#include <cuda_bf16.h>

namespace ops {

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, long i, float v) { p[i] = __float2bfloat16(v); }

// A bfloat16 element that reads as a float and rounds a float it is assigned (to nearest even),
// with no arithmetic of its own: the engine's activations in its bf16 build (kernels/engine.cu,
// `act`), so that a kernel written for float storage computes in float32 on either. It has no
// constructor from float, so `cond ? element : float` is a float and `a * element` is float
// arithmetic.
struct bf16s {
    __nv_bfloat16 v;
    __device__ __forceinline__ operator float() const { return __bfloat162float(v); }
    __device__ __forceinline__ bf16s& operator=(float f) {
        v = __float2bfloat16(f);
        return *this;
    }
    __device__ __forceinline__ bf16s& operator+=(float f) { return *this = float(*this) + f; }
    __device__ __forceinline__ bf16s& operator*=(float f) { return *this = float(*this) * f; }
};
static_assert(sizeof(bf16s) == 2, "bf16s is a bfloat16");
__device__ __forceinline__ float load(const bf16s* p, long i) { return p[i]; }
__device__ __forceinline__ void store(bf16s* p, long i, float v) { p[i] = v; }

// This thread's lane in its warp.
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// The row (or work item) this warp owns, or -1 past the end: warp w of block b owns item
// b * (blockDim.x / 32) + w.
__device__ __forceinline__ long warp_row(long rows) {
    long r = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    return r < rows ? r : -1;
}

// The precision of the transcendental functions (see the head of the file).
struct Fast {
    static __device__ __forceinline__ float rsqrt(float v) { return rsqrtf(v); }
    static __device__ __forceinline__ float exp(float v) { return __expf(v); }
};
struct Precise {
    static __device__ __forceinline__ float rsqrt(float v) { return 1.f / sqrtf(v); }
    static __device__ __forceinline__ float exp(float v) { return expf(v); }
};

}  // namespace ops
