//! The engine's GPU backend, written once over a [`Device`]: [`KernelBackend`] turns every
//! [`Backend`](super::backend::Backend) op into launches of the kernels of `kernels/engine.cu`
//! (and `kernels/flash_mma.cu` for attention) described as data ([`Launch`]: kernel name, grid,
//! arguments as offsets into the device's memory spaces), and every GEMM into a cuBLASLt plan
//! ([`super::lt::LtPlan`]). A device only runs what it is given:
//!
//! - the CUDA device (`cuda` builds, [`cuda`]) launches the PTX through cudarc and the plans
//!   through `cublasLtMatmul`;
//! - the warp emulator's device (tests, `emu.rs`) runs the same kernel source compiled for the
//!   CPU (`tests/warp_emu`) on the same launches, and the plans through the CPU interpreter of
//!   cuBLASLt ([`super::lt::interpret`]), so that the launches, the argument packing, the grids
//!   and the kernels are checked against the CPU backend ([`super::cpu`]) without a GPU.
//!
//! Memory is four spaces, each allocated once with static addresses: the `f32` arena (the
//! engine's layout), `aux` (`f32`: reduction partials, per-channel partial sums, attention's
//! log-sum-exp per layer and its delta), `half` (`bf16`: attention's operands) and `tokens`
//! (`u32`: the micro-batch's ids and targets, and the ids' CSR that makes the embedding's
//! gradient deterministic).

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(test)]
mod emu;
mod ops;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use super::lt::LtPlan;

/// A memory space of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// The engine's arena (`f32`).
    Arena,
    /// Scratch and per-layer statistics (`f32`).
    Aux,
    /// Attention's `bf16` operands.
    Half,
    /// Token ids, targets and the ids' CSR (`u32`).
    Tokens,
}

impl Space {
    /// Every space, in allocation order.
    pub const ALL: [Space; 4] = [Space::Arena, Space::Aux, Space::Half, Space::Tokens];

    /// Bytes per element.
    pub fn elem_bytes(self) -> usize {
        if self == Space::Half { 2 } else { 4 }
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A pointer to element `off` of a space.
    Ptr(Space, usize),
    /// A 32-bit integer.
    I32(i32),
    /// A 64-bit integer (sizes).
    I64(i64),
    /// A float.
    F32(f32),
}

/// One kernel launch: `kernel<<<grid, block>>>(args...)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The kernel's name in the PTX (`extern "C"`).
    pub kernel: &'static str,
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: u32,
    /// The arguments, in the kernel's order.
    pub args: Vec<Arg>,
}

/// Elements of each space a backend needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// The arena.
    pub arena: usize,
    /// `aux`.
    pub aux: usize,
    /// `half`.
    pub half: usize,
    /// `tokens`.
    pub tokens: usize,
}

/// What runs launches and GEMM plans on memory it owns.
pub trait Device: Send {
    /// A short name for reports (`"cuda:0 (NVIDIA H100 80GB HBM3)"`, `"warp emulator"`).
    fn name(&self) -> String;
    /// Allocates every space once (zeroed).
    fn alloc(&mut self, sizes: Sizes) -> anyhow::Result<()>;
    /// Runs a launch (asynchronously on a device: in order with every other call).
    fn launch(&self, l: &Launch);
    /// Runs `D = alpha op(A) op(B) + beta C` on the arena.
    fn gemm(&self, p: &LtPlan);
    /// Writes 32-bit words at element `off` of a 4-byte space.
    fn write(&mut self, space: Space, off: usize, words: &[u32]) -> anyhow::Result<()>;
    /// Reads `len` 32-bit words from element `off` of a 4-byte space (waits for the work before).
    fn read(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u32>>;
}

/// The GPU backend on GPU `ordinal` with an arena of `len` elements (GEMMs in bf16 or f32).
#[cfg(feature = "cuda")]
pub fn gpu_backend(ordinal: usize, bf16: bool, len: usize, cap: Capacity) -> anyhow::Result<Box<dyn super::backend::Backend>> {
    let math = if bf16 { cuda::GemmMath::Bf16 } else { cuda::GemmMath::F32 };
    Ok(Box::new(KernelBackend::new(cuda::CudaDevice::new(ordinal, math)?, len, cap)?))
}

/// Without the `cuda` feature: the reason there is no GPU backend.
#[cfg(not(feature = "cuda"))]
pub fn gpu_backend(ordinal: usize, _bf16: bool, _len: usize, _cap: Capacity) -> anyhow::Result<Box<dyn super::backend::Backend>> {
    anyhow::bail!("the engine's GPU backend (cuda:{ordinal}) needs a `cuda` build (scripts/build-cuda.sh)")
}

/// How much scratch a model's backend needs (from the engine's schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Tokens per micro-batch.
    pub tokens: usize,
    /// Vocabulary size (the embedding's rows).
    pub vocab: usize,
    /// The widest row of a per-channel sum (`2 x model_dim` for the residual mix).
    pub width: usize,
    /// Query heads x head width (attention's row).
    pub attn_width: usize,
    /// Key/value heads x head width.
    pub kv_width: usize,
    /// Query heads.
    pub heads: usize,
    /// Attention calls in the longest layer sequence (one log-sum-exp buffer each).
    pub attention_calls: usize,
}

/// Blocks of a reduction to a scalar (partials in `aux[0..REDUCE_BLOCKS]`, result after them).
pub(super) const REDUCE_BLOCKS: usize = 256;

/// The `aux` space's regions.
#[derive(Clone, Copy, Debug)]
struct AuxLayout {
    /// Reduction partials, then the scalar result.
    reduce: usize,
    /// Per-op scratch (partial sums, attention's delta), reused by every op.
    scratch: usize,
    scratch_len: usize,
    /// Log-sum-exp buffers, `lse_len` elements each.
    lse: usize,
    lse_len: usize,
    lse_count: usize,
}

/// The `tokens` space: x, y, then the ids' CSR (offsets per vocabulary row, then positions).
#[derive(Clone, Copy, Debug)]
struct TokenLayout {
    n: usize,
    vocab: usize,
}

impl TokenLayout {
    fn x(&self) -> usize {
        0
    }
    fn y(&self) -> usize {
        self.n
    }
    fn csr_off(&self) -> usize {
        2 * self.n
    }
    fn csr_pos(&self) -> usize {
        2 * self.n + self.vocab + 1
    }
    fn len(&self) -> usize {
        3 * self.n + self.vocab + 1
    }
}

/// The engine's backend over a [`Device`] (see the module doc).
pub struct KernelBackend<D: Device> {
    dev: D,
    len: usize,
    aux: AuxLayout,
    half_len: usize,
    tokens: TokenLayout,
    /// Log-sum-exp buffer index of each attention output (keyed by its arena offset).
    lse: HashMap<usize, usize>,
}

impl<D: Device> KernelBackend<D> {
    /// A backend with an arena of `len` elements on `dev`, scratch sized by `cap`.
    pub fn new(mut dev: D, len: usize, cap: Capacity) -> anyhow::Result<Self> {
        let parts = cap.tokens.div_ceil(ops::PART);
        // Partial sums (2 x width per block of rows), the q/k gain's per-(row, head) values and
        // their partials, attention's delta: the largest of them.
        let scratch_len = (2 * parts * cap.width).max(cap.tokens * cap.heads + parts * cap.heads).max(cap.tokens * cap.heads);
        // Every region starts 16-byte aligned (flash attention copies its statistics with
        // 16-byte cp.async).
        let align = |x: usize| x.div_ceil(4) * 4;
        let (scratch_len, lse_len) = (align(scratch_len), align(cap.tokens * cap.heads));
        let reduce = 0;
        let scratch = align(REDUCE_BLOCKS + 1);
        let lse = scratch + scratch_len;
        let aux = AuxLayout { reduce, scratch, scratch_len, lse, lse_len, lse_count: cap.attention_calls };
        // q, k, v, o (or dout), dq, dk, dv: each rounded up to 16 bytes.
        let round = |x: usize| x.div_ceil(8) * 8;
        let (q, kv) = (round(cap.tokens * cap.attn_width), round(cap.tokens * cap.kv_width));
        let half_len = 4 * q + 4 * kv;
        let tokens = TokenLayout { n: cap.tokens, vocab: cap.vocab };
        dev.alloc(Sizes { arena: len, aux: lse + lse_len * cap.attention_calls, half: half_len, tokens: tokens.len() })?;
        Ok(Self { dev, len, aux, half_len, tokens, lse: HashMap::new() })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The device, mutably (graph capture).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }
}
