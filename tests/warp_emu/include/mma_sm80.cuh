// Warp emulator: kernels/mma_sm80.cuh's instructions, with the same names and fragment layouts
// (see that file), executed by the warp's 32 threads together (warp_emu.h).
//
// Checks the hardware would fault on: ldmatrix rows and cp.async addresses 16-byte aligned.
// cp.async copies are held back until the thread's cp_async_wait retires their group, and both
// their start and their landing go through the race check of warp_emu.h, as ldmatrix's reads do.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

namespace emu {

inline void require_aligned(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
        fprintf(stderr, "warp emulator: %s address %p is not 16-byte aligned (thread %u of block %u,%u)\n", what, p, threadIdx.x,
                blockIdx.x, blockIdx.y);
        abort();
    }
}

inline void ldmatrix(uint32_t (&r)[4], const __nv_bfloat16* row, bool trans) {
    require_aligned(row, "ldmatrix row");
    shared_read(row);
    Warp& w = *warp;
    w.ptr[lane] = row;
    w.bar.arrive_and_wait();
    const unsigned g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat16* const* rows = w.ptr + 8 * i;
        uint16_t lo, hi;
        if (trans) {
            lo = rows[2 * t][g].x;
            hi = rows[2 * t + 1][g].x;
        } else {
            lo = rows[g][2 * t].x;
            hi = rows[g][2 * t + 1].x;
        }
        r[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
    w.bar.arrive_and_wait();
}

inline float half_of(uint32_t reg, int hi) {
    return __bfloat162float({static_cast<uint16_t>(hi ? reg >> 16 : reg & 0xffffu)});
}

// d += a b for the warp: every lane posts its fragments, then computes its own four outputs
// from the gathered 16 x 16 and 16 x 8 operands.
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    Warp& w = *warp;
    for (int i = 0; i < 4; ++i) w.regs[lane][i] = a[i];
    w.regs[lane][4] = b0;
    w.regs[lane][5] = b1;
    w.bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, t = l % 4;
        for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = half_of(w.regs[l][0], e);
            A[g + 8][2 * t + e] = half_of(w.regs[l][1], e);
            A[g][2 * t + 8 + e] = half_of(w.regs[l][2], e);
            A[g + 8][2 * t + 8 + e] = half_of(w.regs[l][3], e);
            B[2 * t + e][g] = half_of(w.regs[l][4], e);
            B[2 * t + 8 + e][g] = half_of(w.regs[l][5], e);
        }
    }
    w.bar.arrive_and_wait();
    const unsigned g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const unsigned row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float acc = d[e];
        for (int kk = 0; kk < 16; ++kk) acc += A[row][kk] * B[kk][col];
        d[e] = acc;
    }
}

struct Copy {
    void* dst;
    const void* src;
};
inline thread_local std::vector<Copy> open_group;
inline thread_local std::vector<std::vector<Copy>> in_flight;

}  // namespace emu

inline void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
    emu::ldmatrix(r, row, false);
}
inline void ldsm_x4_t(uint32_t (&r)[4], const __nv_bfloat16* row) {
    emu::ldmatrix(r, row, true);
}
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu::mma(d, a, b0, b1);
}
inline uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return static_cast<uint32_t>(v.x.x) | static_cast<uint32_t>(v.y.x) << 16;
}
inline void cp_async_16(void* smem, const void* gmem) {
    emu::require_aligned(smem, "cp.async shared");
    emu::require_aligned(gmem, "cp.async global");
    emu::shared_write(smem, false);
    emu::open_group.push_back({smem, gmem});
}
inline void cp_async_commit() {
    emu::in_flight.push_back(std::move(emu::open_group));
    emu::open_group.clear();
}
template <int N>
inline void cp_async_wait() {
    while (emu::in_flight.size() > static_cast<size_t>(N)) {
        for (const emu::Copy& c : emu::in_flight.front()) {
            memcpy(c.dst, c.src, 16);
            emu::shared_write(c.dst, true);
        }
        emu::in_flight.erase(emu::in_flight.begin());
    }
}
