// The tensor-core and asynchronous-copy instructions of the register-fragment flash kernels
// (kernels/flash_mma.cu), as PTX wrappers (sm_80 and later).
//
// Kernels include this header with angle brackets (`#include <mma_sm80.cuh>`, build.rs passes
// `-I kernels`) so that the warp emulator of tests/warp_emu can put its own version of these
// functions in place and run the kernels' source on the CPU.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane l has g = l / 4 and
// t = l % 4. A (16 x 16, row-major) is four registers of two bf16 each: rows g, g + 8, g, g + 8
// at columns 2t, 2t + 1 (registers 0, 1) and 2t + 8, 2t + 9 (registers 2, 3). B (16 x 8) is two
// registers: rows (k) 2t, 2t + 1 and 2t + 8, 2t + 9 of column (n) g. The f32 accumulator
// (16 x 8) is four floats: row g, columns 2t, 2t + 1, then row g + 8, same columns. The lower
// column or row of a pair sits in the low half of its register.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the addresses of matrix i's
// rows (16 bytes each, 16-byte aligned); register i receives lane l's part of matrix i:
// row l / 4, columns 2(l % 4) and 2(l % 4) + 1.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// As ldsm_x4, each matrix transposed: register i receives rows 2(l % 4) and 2(l % 4) + 1 of
// column l / 4 of matrix i.
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const __nv_bfloat16* row) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// d (16 x 8, f32) += a (16 x 16, bf16) times b (16 x 8, bf16).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to bf16 in one register, `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Starts copying 16 bytes from global to shared memory (both 16-byte aligned), bypassing L1.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem) : "memory");
}

// Closes the group of copies this thread started since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
