// Warp emulator: the bf16 type and conversions the kernels use, on the host (round to nearest
// even, as the device's __float2bfloat16 and __floats2bfloat162_rn).
#pragma once
#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    uint16_t x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {static_cast<uint16_t>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
    const uint32_t u = static_cast<uint32_t>(b.x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return {__float2bfloat16(lo), __float2bfloat16(hi)};
}
inline float __low2float(__nv_bfloat162 v) {
    return __bfloat162float(v.x);
}
inline float __high2float(__nv_bfloat162 v) {
    return __bfloat162float(v.y);
}
// float2 comes from warp_emu.h, included before any kernel.
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    return {__bfloat162float(v.x), __bfloat162float(v.y)};
}
