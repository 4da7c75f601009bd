// The GPU kernels of the training engine's backend (src/engine/gpu/: the launches, one per
// `Backend` op; src/engine/cpu/: the CPU reference each kernel is checked against, in the warp
// emulator by `cargo test --lib engine::gpu`). Compiled twice: with float32 activations
// (engine.ptx) and with bfloat16 ones (engine_bf16.ptx, `act` below); parameters, gradients and
// optimizer state are float32 in both. Every kernel reads and writes the arena by element offsets
// the schedule fixed once, so a step's launches are the same every step (what lets a CUDA graph
// replay them).
//
// Shapes of launch (the launcher in src/engine/gpu/ops.rs picks the grids):
// - flat kernels: a grid-stride loop over n elements, 256 threads per block;
// - row kernels: one warp per row (or per row and head), 8 rows per 256-thread block, lanes
//   strided over the row so that loads coalesce;
// - per-channel sums of a backward pass: deterministic, no atomics. `*_partial` kernels give
//   each block of PART rows one partial sum per channel (a thread per channel), and
//   `colsum_finish` adds the partials in block order into the destination (`+=`), so that a
//   gradient is the same bit for bit on every run and under graph replay;
// - reductions to a scalar (sum, sum of squares, non-finite count): per-block partials, then one
//   block adds them in order.
//
// Maths is float32 with float32 accumulation inside a row (the CPU reference accumulates in
// float64: the comparison's tolerance says so), with the correctly rounded transcendental
// functions (`ops::Precise`). The device maths of the ops the model's fused kernels
// (kernels/fused.cu) have too lives in kernels/ops/, one header per op, shared by both: RMS norm,
// the MLP's activation, the per-channel scales and their column sums, qk norm + RoPE, the
// soft-capped cross-entropy, and the warp and block reductions. This file keeps what every
// kernel shares (`act`, the 16-byte chunk helpers, the row and lane helpers); the entry points,
// their launch geometry and the ops only the engine has are in kernels/engine/, a file per op
// family, included at the end.
#include <cuda_bf16.h>
#include <math_constants.h>

#include "ops/act.cuh"
#include "ops/colsum.cuh"
#include "ops/common.cuh"
#include "ops/qk_norm_rope.cuh"
#include "ops/reduce.cuh"
#include "ops/rms_norm.cuh"
#include "ops/scale.cuh"
#include "ops/softcap_ce.cuh"
#include "ops/vec.cuh"

namespace eng {

// The storage type of the activations and their gradients (the arena's activation region, see
// src/engine/layout.rs): float32, or bfloat16 in the engine's bf16 build (`-DENGINE_ACT_BF16`,
// engine_bf16.ptx), where every kernel below still computes in float32 (ops::bf16s reads as a
// float and rounds what it is assigned). Parameters, their gradients, optimizer state and the
// per-row statistics stay float32 in both.
#ifdef ENGINE_ACT_BF16
using act = ops::bf16s;
#else
using act = float;
#endif

constexpr int PART = 64;  // rows per partial sum of a per-channel reduction

// 16-byte chunks of activations: AV of them (8 bf16 or 4 floats). The hottest row and flat
// kernels below move their activations in such chunks when every activation pointer they are
// given is 16-byte aligned and the row width a multiple of AV (`chunked`: the arena's buffers
// are, at the model's widths), and element by element otherwise, in the same kernel (a branch
// every thread takes alike). Per-channel parameters are read by element (small, cached).
constexpr int AV = 16 / (int)sizeof(act);

__device__ __forceinline__ void loadv(const float* p, float (&v)[4]) { ops::unpack(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void loadv(const ops::bf16s* p, float (&v)[8]) { ops::unpack(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void storev(float* p, const float (&v)[4]) { *reinterpret_cast<uint4*>(p) = ops::pack(v); }
__device__ __forceinline__ void storev(ops::bf16s* p, const float (&v)[8]) { *reinterpret_cast<uint4*>(p) = ops::pack(v); }

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<unsigned long long>(p) % 16 == 0; }

// Whether every pointer is 16-byte aligned and `cols` (a row's width, or n) a multiple of AV.
template <typename... P>
__device__ __forceinline__ bool chunked(long cols, const P*... ptrs) {
    return cols % AV == 0 && (aligned16(ptrs) && ...);
}

// Chunk-wise grid-stride loop: `i` the first element of each chunk of AV.
#define FOR_CHUNKS(i, n) for (long i = first_index() * AV; i < (n); i += grid_stride() * AV)

// Chunks per lane of the chunked RMS norm rows (a row held in registers): rows up to
// 32 AV RMS_CHUNKS wide (1024 bf16, 512 floats); wider rows take the element path.
constexpr int RMS_CHUNKS = 4;

using ops::block_sum;
using ops::Precise;
using ops::warp_max;
using ops::warp_row;
using ops::warp_sum;

__device__ __forceinline__ long first_index() { return (long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ long grid_stride() { return (long)gridDim.x * blockDim.x; }

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// For this lane's `id`: `below`, the lanes under it holding the same id, and `same`, all lanes
// holding it (itself included).
__device__ __forceinline__ void warp_match(unsigned id, int* below, int* same) {
    const int lane = threadIdx.x & 31;
    int b = 0, t = 1;
    for (int m = 1; m < 32; ++m) {
        const unsigned other = __shfl_xor_sync(0xffffffffu, id, m);
        if (other == id) {
            ++t;
            if ((lane ^ m) < lane) ++b;
        }
    }
    *below = b;
    *same = t;
}

}  // namespace eng

using namespace eng;

// The kernels by op family (kernels/engine/), each file under the size rule.
#include "engine/flat.cuh"
#include "engine/embedding.cuh"
#include "engine/rows.cuh"
#include "engine/heads.cuh"
#include "engine/record0427.cuh"
#include "engine/loss.cuh"
