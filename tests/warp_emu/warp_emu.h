// Warp emulator: runs CUDA kernels' source on the CPU, one OS thread per CUDA thread, one block
// at a time, so that tests can check a kernel's indexing, fragment layouts, synchronisation and
// masking against a reference without a GPU. It checks the logic, not the hardware: timing,
// bank conflicts and the hardware's rounding inside mma are not modelled (products of bf16
// values are exact in f32; accumulation order differs).
//
// Include this first, then the kernel file; compile with `-I tests/warp_emu/include` so that the
// kernel's <cuda_bf16.h>, <math_constants.h> and <mma_sm80.cuh> are the emulator's. Warp-wide
// operations (shuffles, ldmatrix, mma) meet at a 32-thread barrier, __syncthreads at the block's.
//
// Shared-memory races: the block's barriers count epochs, and every 16-byte chunk that ldmatrix
// reads or cp.async writes keeps who last touched it in which epoch. A chunk read by one warp and
// written by another in the same epoch (either order), or read while a copy into it is still in
// flight, aborts the run naming the kernel's block and thread: a missing __syncthreads or
// cp_async_wait fails deterministically, whatever the OS scheduling. Plain loads and stores of
// shared memory are not tracked.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <barrier>
#include <mutex>
#include <unordered_map>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct __nv_bfloat16;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {

// What a warp's lanes exchange at a warp-wide operation.
struct Warp {
    std::barrier<> bar{32};
    uint32_t word[32];
    uint32_t regs[32][6];
    const __nv_bfloat16* ptr[32];
};

// Counts the block's barrier phases.
struct Epoch {
    std::atomic<unsigned>* n;
    void operator()() noexcept { n->fetch_add(1); }
};

struct Block {
    std::atomic<unsigned> epoch{0};
    std::barrier<Epoch> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    explicit Block(unsigned threads) : bar(threads, Epoch{&epoch}) {
        for (unsigned w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
    }
};

inline thread_local Block* block;
inline thread_local Warp* warp;
inline thread_local unsigned lane;

// Who last touched a 16-byte chunk of shared memory, and in which epoch.
struct Chunk {
    unsigned write_epoch = ~0u, write_warp = 0, read_epoch = ~0u;
    uint64_t read_warps = 0;  // warps that read it in read_epoch
    bool in_flight = false;   // a cp.async into it has not been waited for
};
inline std::mutex shadow_lock;
inline std::unordered_map<uintptr_t, Chunk> shadow;

[[noreturn]] inline void race(const char* what, const void* p) {
    fprintf(stderr, "warp emulator: shared-memory race: %s at %p (block %u,%u, thread %u, epoch %u)\n", what, p, blockIdx.x, blockIdx.y,
            threadIdx.x, block->epoch.load());
    abort();
}

// The warp reads the 16 bytes at p (ldmatrix).
inline void shared_read(const void* p) {
    const unsigned e = block->epoch.load(), w = threadIdx.x / 32;
    std::lock_guard<std::mutex> g(shadow_lock);
    Chunk& c = shadow[reinterpret_cast<uintptr_t>(p) & ~uintptr_t{15}];
    if (c.in_flight) race("read of a chunk whose cp.async was not waited for", p);
    if (c.write_epoch == e && c.write_warp != w) race("read of a chunk another warp wrote since the last __syncthreads", p);
    if (c.read_epoch != e) {
        c.read_epoch = e;
        c.read_warps = 0;
    }
    c.read_warps |= uint64_t{1} << w;
}

// This thread starts (landed = false) or completes (landed = true) a copy into the 16 bytes at p.
inline void shared_write(const void* p, bool landed) {
    const unsigned e = block->epoch.load(), w = threadIdx.x / 32;
    std::lock_guard<std::mutex> g(shadow_lock);
    Chunk& c = shadow[reinterpret_cast<uintptr_t>(p) & ~uintptr_t{15}];
    if (c.read_epoch == e && (c.read_warps & ~(uint64_t{1} << w)))
        race("copy into a chunk another warp read since the last __syncthreads", p);
    c.in_flight = !landed;
    c.write_warp = w;
    if (landed) c.write_epoch = e;
}

// Clears the shared-memory shadow between two blocks (the completion step of the barrier that
// separates them).
struct NextBlock {
    void operator()() noexcept { shadow.clear(); }
};

// Runs kernel<<<grid, threads>>>(args...) block after block; `threads` a multiple of 32. The
// `threads` OS threads are made once per launch and run every block in turn, meeting at a
// barrier between blocks. `after_thread` is called at the end of each thread's block (checks
// of the emulated instructions).
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, unsigned threads, void (*after_thread)(), A... args) {
    if (threads % 32 != 0) {
        fprintf(stderr, "warp emulator: %u threads per block is not whole warps\n", threads);
        abort();
    }
    gridDim = grid;
    blockDim = {threads, 1, 1};
    const unsigned blocks = grid.x * grid.y;
    shadow.clear();
    std::vector<std::unique_ptr<Block>> per_block;
    for (unsigned b = 0; b < blocks; ++b) per_block.push_back(std::make_unique<Block>(threads));
    std::barrier<NextBlock> between(threads, NextBlock{});
    std::vector<std::thread> pool;
    for (unsigned tid = 0; tid < threads; ++tid) {
        pool.emplace_back([&, tid] {
            for (unsigned b = 0; b < blocks; ++b) {
                threadIdx = {tid, 0, 0};
                blockIdx = {b % grid.x, b / grid.x, 0};
                block = per_block[b].get();
                warp = block->warps[tid / 32].get();
                lane = tid % 32;
                kernel(args...);
                after_thread();
                between.arrive_and_wait();
            }
        });
    }
    for (std::thread& t : pool) t.join();
}

}  // namespace emu

inline void __syncthreads() {
    emu::block->bar.arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
    emu::warp->bar.arrive_and_wait();
}

// The value `x` of lane (this lane ^ mask); 32-bit types.
template <class T>
T __shfl_xor_sync(unsigned, T x, int mask) {
    static_assert(sizeof(T) == 4, "the emulator shuffles 32-bit values");
    emu::Warp& w = *emu::warp;
    memcpy(&w.word[emu::lane], &x, 4);
    w.bar.arrive_and_wait();
    T r;
    memcpy(&r, &w.word[emu::lane ^ static_cast<unsigned>(mask)], 4);
    w.bar.arrive_and_wait();
    return r;
}

// The lanes whose `pred` is true, as a bit mask.
inline unsigned __ballot_sync(unsigned, bool pred) {
    emu::Warp& w = *emu::warp;
    w.word[emu::lane] = pred;
    w.bar.arrive_and_wait();
    unsigned mask = 0;
    for (unsigned l = 0; l < 32; ++l) mask |= (w.word[l] ? 1u : 0u) << l;
    w.bar.arrive_and_wait();
    return mask;
}

inline bool __all_sync(unsigned mask, bool pred) {
    return __ballot_sync(mask, pred) == 0xffffffffu;
}

// Device maths and vector types of the row kernels (kernels/ops/, kernels/fused.cu). The fast-maths
// intrinsics are the exact functions here: the emulator checks logic, not the device's ulps.
inline float rsqrtf(float x) {
    return 1.0f / sqrtf(x);
}
inline float __expf(float x) {
    return expf(x);
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline int __popc(unsigned x) {
    return __builtin_popcount(x);
}
inline int __ffs(unsigned x) {
    return __builtin_ffs(static_cast<int>(x));
}
inline int __clz(unsigned x) {
    return x ? __builtin_clz(x) : 32;
}
template <class T>
T min(T a, T b) {
    return b < a ? b : a;
}
struct float2 {
    float x, y;
};
struct __align__(16) float4 {
    float x, y, z, w;
};
struct __align__(8) uint2 {
    unsigned x, y;
};
struct __align__(16) uint4 {
    unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) {
    return {x, y, z, w};
}
