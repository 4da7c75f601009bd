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
//! Memory is six spaces, each allocated once with static addresses: the `f32` arena (the
//! engine's layout), `aux` (`f32`: reduction partials, the schedule's scalars, per-channel
//! partial sums, attention's log-sum-exp per layer and its delta), `half` (`bf16`: attention's
//! staged operands), `tokens` (`u32`: the micro-batch's ids and targets, and the ids' CSR that
//! makes the embedding's gradient deterministic), and with bf16 activations ([`GpuPrecision`])
//! `act` (the layout's `half` region in `bf16`, taken out of the arena) and `mirror` (the
//! weights' `bf16` copy the GEMMs read); `place.rs` resolves an arena offset to its space.
//!
//! Units of work ([`Backend::begin_unit`](super::backend::Backend::begin_unit)): inside one,
//! the backend collects the ops' [`Work`] instead of running it, and the values that change from
//! step to step (learning rates, momentum, bias corrections) go to a table of schedule scalars
//! in `aux` that the kernels read through a pointer. At the unit's end the table is written
//! (one small copy) and the work runs: the first time a unit's key is seen op by op, the second
//! time, if its work is the same launch for launch (same kernels, grids, pointers and constant
//! arguments), captured as a graph ([`Device::capture`]: a CUDA graph on the GPU) and from then
//! on replayed ([`Device::replay`]) as long as it stays the same; work that changed runs op by
//! op and is captured again when it repeats. A unit never reads the device from the host, so a
//! training step has one host read, at its end.
//!
//! Collectives (data parallel, `comm.rs`): once [`Device::comm_init`] has started a
//! communicator (NCCL on the CUDA device, `nccl.rs`), the gradient buckets' all-reduces and
//! sharded Muon's broadcasts are [`CommCall`]s queued with the rest of a unit's work, on a
//! communication stream forked from the compute stream by an event and joined by another before
//! the unit ends, so a unit with collectives is still one graph.

mod backend;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(test)]
mod emu;
#[cfg(test)]
mod emu_comm;
pub mod kernels;
#[cfg(feature = "cuda")]
mod nccl;
mod ops;
mod place;
#[cfg(test)]
mod ranks_tests;
mod sdpa;
#[cfg(test)]
pub(crate) mod tests;

pub use sdpa::{Loc, SdpaAt, SdpaCall};

use std::collections::HashMap;

use super::backend::{Backend, GraphCounts};
use super::lt::LtPlan;
#[cfg(feature = "cuda")]
use crate::engine::backend::BackendExt;
#[cfg(feature = "cuda")]
use crate::engine::op;

/// A memory space of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// The engine's arena (`f32`); with bf16 activations, the arena less its `half` region.
    Arena,
    /// Scratch and per-layer statistics (`f32`).
    Aux,
    /// Attention's `bf16` operands.
    Half,
    /// Token ids, targets and the ids' CSR (`u32`).
    Tokens,
    /// With bf16 activations: the layout's `half` region (`bf16`; empty otherwise).
    Act,
    /// With bf16 activations: the weights' per-pass `bf16` copy that the GEMMs read (the
    /// parameter region's layout; empty otherwise).
    Mirror,
}

impl Space {
    /// Every space, in allocation order.
    #[cfg(feature = "tools")]
    pub const ALL: [Space; 6] = [Space::Arena, Space::Aux, Space::Half, Space::Tokens, Space::Act, Space::Mirror];

    /// Bytes per element.
    pub fn elem_bytes(self) -> usize {
        match self {
            Space::Half | Space::Act | Space::Mirror => 2,
            Space::Arena | Space::Aux | Space::Tokens => 4,
        }
    }

    /// Whether its elements are `bf16`.
    pub fn is_bf16(self) -> bool {
        self.elem_bytes() == 2
    }
}

/// The GPU backend's arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPrecision {
    /// An f32 arena, full f32 GEMMs (parity checks).
    F32,
    /// An f32 arena, GEMMs on the bf16 tensor cores with f32 accumulation (cuBLAS rounds the
    /// f32 operands as it reads them).
    Bf16Gemms,
    /// Activations and their gradients stored in bf16 ([`HalfRegions`]), GEMMs reading bf16
    /// operands natively (the weights' bf16 copy), f32 master weights, gradients and optimizer
    /// state: PyTorch's autocast.
    Bf16,
}

impl GpuPrecision {
    /// A short name for logs and reports.
    #[cfg(feature = "tools")]
    pub fn label(self) -> &'static str {
        match self {
            GpuPrecision::F32 => "f32",
            GpuPrecision::Bf16Gemms => "bf16 GEMMs",
            GpuPrecision::Bf16 => "bf16 activations",
        }
    }
}

/// Where a bf16-activation backend keeps what (arena offsets of the layout): the `half` region
/// lives in [`Space::Act`], the rest of the arena in [`Space::Arena`] (closed up), and GEMM
/// operands inside `params` are read from [`Space::Mirror`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfRegions {
    /// The layout's `half` region ([`crate::engine::layout::Layout::half`]).
    pub act: super::backend::Buf,
    /// The parameter region ([`crate::engine::layout::Layout::params`]).
    pub params: super::backend::Buf,
}

impl HalfRegions {
    /// The regions of `layout`.
    pub fn of(layout: &super::layout::Layout) -> Self {
        HalfRegions { act: layout.half, params: layout.params }
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
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

impl PartialEq for Arg {
    /// Bitwise: a NaN argument (the poison fill's) equals itself, so work that fills with NaN
    /// is still the same work from one step to the next.
    fn eq(&self, other: &Arg) -> bool {
        match (*self, *other) {
            (Arg::Ptr(s, a), Arg::Ptr(t, b)) => s == t && a == b,
            (Arg::I32(a), Arg::I32(b)) => a == b,
            (Arg::I64(a), Arg::I64(b)) => a == b,
            (Arg::F32(a), Arg::F32(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
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

/// One piece of work for a device: a kernel launch or a GEMM.
#[derive(Clone, Debug, PartialEq)]
pub enum Work {
    /// A kernel launch.
    Launch(Launch),
    /// A cuBLASLt GEMM, its A, B and C offsets in these spaces (`f32` or `bf16` by space).
    Gemm(LtPlan, [Space; 3]),
    /// A cuDNN attention call (its graph built by [`Device::sdpa_prepare`]).
    Sdpa(Box<SdpaCall>),
    /// A collective on the communication stream ([`Device::comm_init`]).
    Comm(CommCall),
}

/// A collective on the device's communication stream (data parallel): it starts after the
/// work queued before it and runs beside the work after it, which waits for it only at a
/// [`CommCall::Join`]. On the GPU: NCCL on a stream of its own, forked from the compute stream
/// by an event and joined by another, so a unit of work with collectives is still one CUDA
/// graph (NCCL's calls are captured with it).
#[derive(Clone, Debug, PartialEq)]
pub enum CommCall {
    /// Each piece `(space, offset, elements)` combined over the ranks by `op`, in place (one
    /// group: one launch).
    AllReduce {
        /// The pieces.
        pieces: Vec<(Space, usize, usize)>,
        /// How values combine.
        op: crate::dist::ReduceOp,
    },
    /// Each piece `(space, offset, elements, root)` broadcast from rank `root`, in place (one
    /// group).
    Broadcast {
        /// The pieces.
        pieces: Vec<(Space, usize, usize, usize)>,
    },
    /// `len` elements from `src` combined over the ranks by `op` into `dst` (out of place: at a
    /// world of one a copy, which engine-check's collectives check times against compute).
    AllReduceInto {
        /// The source `(space, offset)`.
        src: (Space, usize),
        /// The destination `(space, offset)`, not overlapping the source.
        dst: (Space, usize),
        /// Elements.
        len: usize,
        /// How values combine.
        op: crate::dist::ReduceOp,
    },
    /// The compute stream waits for every collective queued so far.
    Join,
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
    /// `act` (bf16 activations; 0 otherwise).
    pub act: usize,
    /// `mirror` (bf16 activations; 0 otherwise).
    pub mirror: usize,
}

/// What runs launches and GEMM plans on memory it owns.
pub trait Device: Send {
    /// A short name for reports (`"cuda:0 (NVIDIA H100 80GB HBM3)"`, `"warp emulator"`).
    fn name(&self) -> String;
    /// Allocates every space once (zeroed).
    fn alloc(&mut self, sizes: Sizes) -> anyhow::Result<()>;
    /// Runs a launch (asynchronously on a device: in order with every other call).
    fn launch(&self, l: &Launch);
    /// Runs `D = alpha op(A) op(B) + beta C` with A, B and C in `spaces`.
    fn gemm(&self, p: &LtPlan, spaces: [Space; 3]);
    /// Writes 32-bit words at element `off` of a 4-byte space.
    fn write(&mut self, space: Space, off: usize, words: &[u32]) -> anyhow::Result<()>;
    /// Reads `len` 32-bit words from element `off` of a 4-byte space (waits for the work before).
    fn read(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u32>>;
    /// Writes bf16 elements (their bits) at element `off` of a 2-byte space.
    fn write_half(&mut self, space: Space, off: usize, bits: &[u16]) -> anyhow::Result<()>;
    /// Reads `len` bf16 elements (their bits) from element `off` of a 2-byte space.
    fn read_half(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u16>>;
    /// Writes the elements of the 32-bit tensor `t` (`u32` ids) at element `off` of a 4-byte
    /// space, in order with the device's work. The default reads `t` to the host; the CUDA
    /// device copies a tensor on its GPU device to device, after the work queued on the
    /// tensor's stream and before anything later queued there (CUDA events, no host wait).
    fn write_tensor(&mut self, space: Space, off: usize, t: &candle_core::Tensor) -> anyhow::Result<()> {
        let words: Vec<u32> = t.flatten_all()?.to_vec1()?;
        self.write(space, off, &words)
    }
    /// `len` `f32` elements of the arena from `off` as a tensor of `shape` on `device`. The
    /// default reads them to the host; the CUDA device copies into a new tensor on its GPU
    /// device to device, on that device's stream after the work queued so far on its own.
    fn tensor(&self, off: usize, len: usize, shape: &[usize], device: &candle_core::Device) -> anyhow::Result<candle_core::Tensor> {
        let v: Vec<f32> = self.read(Space::Arena, off, len)?.into_iter().map(f32::from_bits).collect();
        Ok(candle_core::Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?.to_device(device)?)
    }
    /// Records `work` as graph `slot` without running it (replacing a graph there): its
    /// pointers and constants are fixed, what it reads from memory is read when replayed.
    fn capture(&mut self, slot: usize, work: &[Work]) -> anyhow::Result<()>;
    /// Runs graph `slot` (in order with every other call).
    fn replay(&self, slot: usize) -> anyhow::Result<()>;

    /// Waits until the device has done the work queued so far.
    fn synchronize(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Records a timing mark after the work queued so far (a CUDA event); `None` without a
    /// device clock (the emulator: its launches run as they come).
    fn timing_mark(&self) -> Option<usize> {
        None
    }

    /// Milliseconds between two marks (waits for the later one).
    fn timing_ms(&self, _from: usize, _to: usize) -> anyhow::Result<f64> {
        anyhow::bail!("this device has no clock")
    }

    /// Whether the device has passed mark `mark` (true without a device clock).
    fn timing_done(&self, _mark: usize) -> bool {
        true
    }

    /// Forgets one mark (the others keep their numbers).
    fn timing_release(&self, _mark: usize) {}

    /// Forgets every timing mark.
    fn timing_reset(&self) {}

    /// Builds (once) the cuDNN graph of `desc` and sizes its workspace, before a call of it is
    /// queued; an error says why it cannot run here (no cuDNN, or a shape it refuses).
    fn sdpa_prepare(&mut self, desc: &crate::device::cudnn::SdpaDesc) -> anyhow::Result<()> {
        anyhow::bail!("{} has no cuDNN ({})", self.name(), crate::device::cudnn::describe(desc))
    }

    /// Runs a cuDNN attention call whose graph was prepared.
    fn sdpa(&self, call: &SdpaCall) {
        panic!("{} has no cuDNN: {:?} was queued without being prepared", self.name(), call.desc)
    }

    /// Starts the device's communicator among `ranks` (every rank calls it, in the same
    /// order with its other collectives): from then on it runs [`CommCall`]s.
    fn comm_init(&mut self, _ranks: std::sync::Arc<dyn crate::dist::Collective>) -> anyhow::Result<()> {
        anyhow::bail!("{} runs no collectives", self.name())
    }

    /// Work queued later on the rest of the program's stream waits for the work queued so far
    /// here ([`Backend::fence`](super::backend::Backend::fence)); nothing on a device whose work
    /// is done when queued (the emulator).
    fn fence(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Runs a collective (after [`Device::comm_init`]).
    fn comm(&self, c: &CommCall) {
        panic!("{} runs no collectives: {c:?} was queued without a communicator", self.name())
    }

    /// Runs one piece of work.
    fn run(&self, w: &Work) {
        match w {
            Work::Launch(l) => self.launch(l),
            Work::Gemm(p, spaces) => self.gemm(p, *spaces),
            Work::Sdpa(c) => self.sdpa(c),
            Work::Comm(c) => self.comm(c),
        }
    }
}

/// The GPU backend on `device` (a candle CUDA device: the engine shares its context, on a
/// stream of its own) with an arena of `len` elements (GEMMs in bf16 or f32; units of work
/// replayed as CUDA graphs when `graphs`).
#[cfg(feature = "cuda")]
pub fn gpu_backend(
    device: &candle_core::Device,
    precision: GpuPrecision,
    graphs: bool,
    len: usize,
    cap: Capacity,
    half: Option<HalfRegions>,
) -> anyhow::Result<Box<dyn Backend>> {
    anyhow::ensure!(
        half.is_some() == (precision == GpuPrecision::Bf16),
        "the GPU backend's bf16 activations need their regions ({precision:?}, {half:?})"
    );
    let math = if precision == GpuPrecision::F32 { cuda::GemmMath::F32 } else { cuda::GemmMath::Bf16 };
    let dev = cuda::CudaDevice::new(device, math, half.is_some())?;
    Ok(Box::new(KernelBackend::with_half(dev, len, cap, half)?.with_graphs(graphs)))
}

/// Without the `cuda` feature: the reason there is no GPU backend.
#[cfg(not(feature = "cuda"))]
pub fn gpu_backend(
    device: &candle_core::Device,
    _precision: GpuPrecision,
    _graphs: bool,
    _len: usize,
    _cap: Capacity,
    _half: Option<HalfRegions>,
) -> anyhow::Result<Box<dyn Backend>> {
    anyhow::bail!("the engine's GPU backend ({:?}) needs a `cuda` build (scripts/build-cuda.sh)", device.location())
}

/// A device's timing marks, numbered in the order they were recorded: a mark is forgotten on
/// its own ([`Marks::release`]) without renumbering the others, and the released ones at the
/// front are dropped, so that a reader that keeps a few marks pending across steps (the
/// engine's phase spans) holds only those.
#[derive(Debug)]
pub struct Marks<E> {
    /// The number of `held[0]`.
    base: usize,
    held: std::collections::VecDeque<Option<E>>,
}

impl<E> Default for Marks<E> {
    fn default() -> Self {
        Self { base: 0, held: Default::default() }
    }
}

impl<E> Marks<E> {
    /// Keeps `e` as the next mark; its number.
    pub fn push(&mut self, e: E) -> usize {
        self.held.push_back(Some(e));
        self.base + self.held.len() - 1
    }

    /// Mark `i`, unless released.
    pub fn get(&self, i: usize) -> Option<&E> {
        i.checked_sub(self.base).and_then(|k| self.held.get(k)).and_then(Option::as_ref)
    }

    /// Forgets mark `i`.
    pub fn release(&mut self, i: usize) {
        if let Some(slot) = i.checked_sub(self.base).and_then(|k| self.held.get_mut(k)) {
            *slot = None;
        }
        while matches!(self.held.front(), Some(None)) {
            self.held.pop_front();
            self.base += 1;
        }
    }

    /// Forgets every mark (numbers are not reused).
    pub fn clear(&mut self) {
        self.base += self.held.len();
        self.held.clear();
    }

    /// Marks held (not released).
    pub fn len(&self) -> usize {
        self.held.iter().filter(|e| e.is_some()).count()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How much scratch a model's backend needs (from the engine's schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Tokens per micro-batch.
    pub tokens: usize,
    /// The rows of the largest table an embedding op looks up (the vocabulary's, or
    /// BigramHash's buckets when more): the rows of the ids' CSR.
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
    /// Row-block partials per group of a two-level per-channel sum ([`COLSUM_GROUP`]; the op
    /// checks take fewer, so that their short sums take the two-level path too).
    pub colsum_group: usize,
    /// Tokens per piece of the embedding's two-level gradient ([`EMBED_PIECE`]; the op checks
    /// take fewer, so that their few tokens per id are cut into pieces too).
    pub embed_piece: usize,
}

/// Tokens per piece of the embedding's gradient (`eng_embedding_pieces`): a vocabulary row with
/// more tokens in a micro-batch is summed by several blocks, then added up in order.
pub const EMBED_PIECE: usize = 64;

/// Row-block partials each block of the first level of a per-channel sum adds
/// (`eng_colsum_groups`): sums of more than two groups' worth take two levels.
pub const COLSUM_GROUP: usize = 32;

impl Capacity {
    /// The smallest capacity for `tokens` ids of a `vocab`-word vocabulary (one attention call
    /// of one 64-wide head): what the device checks that use no model need.
    pub fn minimal(tokens: usize, vocab: usize) -> Self {
        Capacity {
            tokens,
            vocab,
            width: 64,
            attn_width: 64,
            kv_width: 64,
            heads: 1,
            attention_calls: 1,
            colsum_group: COLSUM_GROUP,
            embed_piece: EMBED_PIECE,
        }
    }

    /// The four spaces' sizes for an arena of `len` elements, the aux space's layout, the half
    /// space's length and the tokens' layout (ids' CSR in chunks of `chunk` positions).
    fn spaces(&self, len: usize, chunk: usize) -> (Sizes, AuxLayout, usize, TokenLayout) {
        let parts = self.tokens.div_ceil(ops::PART);
        let tokens = TokenLayout { n: self.tokens, vocab: self.vocab, chunk, piece: self.embed_piece.max(1) };
        // Partial sums (2 x width per block of rows), the q/k gain's per-(row, head) values and
        // their partials, attention's delta, SmearGate's partials (up to `width + 1` values per
        // block) and per-row values (two per row), the two-lane mix's partials (two sums of
        // `width / 2` channels, then six per block of 256 channels, per block of rows): the
        // largest of them.
        let scratch_len = (2 * parts * self.width)
            .max(self.tokens * self.heads + parts * self.heads)
            .max(self.tokens * self.heads)
            .max(parts * (self.width + 1) + 2 * self.tokens)
            .max(parts * self.width + 6 * parts * self.width.div_ceil(2 * ops::BLOCK_THREADS))
            // The embedding gradient's pieces, a row of the model's width each (`width` is twice it).
            .max(tokens.max_pieces() * self.width / 2);
        // Every region starts 16-byte aligned (flash attention copies its statistics with
        // 16-byte cp.async).
        let align = |x: usize| x.div_ceil(4) * 4;
        let (scratch_len, lse_len) = (align(scratch_len), align(self.tokens * self.heads));
        let reduce = 0;
        let sched = align(REDUCE_BLOCKS + 1);
        let scratch = sched + SCHED_CAP;
        // The groups of a two-level per-channel sum, `width` each.
        let mid_len = align(parts.div_ceil(self.colsum_group.max(1)) * self.width);
        let mid = scratch + scratch_len;
        let lse = mid + mid_len;
        let aux = AuxLayout { reduce, sched, scratch, scratch_len, mid, mid_len, lse, lse_len, lse_count: self.attention_calls };
        // q, k, v, o (or dout), dq, dk, dv: each rounded up to 16 bytes.
        let round = |x: usize| x.div_ceil(8) * 8;
        let (q, kv) = (round(self.tokens * self.attn_width), round(self.tokens * self.kv_width));
        let half_len = 4 * q + 4 * kv;
        let sizes =
            Sizes { arena: len, aux: lse + lse_len * self.attention_calls, half: half_len, tokens: tokens.len(), act: 0, mirror: 0 };
        (sizes, aux, half_len, tokens)
    }

    /// Bytes the GPU backend allocates besides its arena (`aux`, `half`, `tokens` and
    /// cuBLASLt's workspace): what the memory check adds to the engine's arena on a GPU.
    pub fn scratch_bytes(&self) -> usize {
        let (s, ..) = self.spaces(0, CSR_CHUNK);
        s.aux * Space::Aux.elem_bytes() + s.half * Space::Half.elem_bytes() + s.tokens * Space::Tokens.elem_bytes() + LT_WORKSPACE
    }
}

/// cuBLASLt's workspace on a GPU, in bytes (NVIDIA's recommendation for Hopper).
pub const LT_WORKSPACE: usize = 32 << 20;

/// Blocks of a reduction to a scalar (partials in `aux[0..REDUCE_BLOCKS]`, result after them).
pub(super) const REDUCE_BLOCKS: usize = 256;

/// Schedule scalars one unit of work may hold (Muon takes 3 per matrix, Adam 3 per tensor).
const SCHED_CAP: usize = 16384;

/// The `aux` space's regions.
#[derive(Clone, Copy, Debug)]
struct AuxLayout {
    /// Reduction partials, then the scalar result.
    reduce: usize,
    /// The schedule scalars of the unit of work running ([`SCHED_CAP`] elements).
    sched: usize,
    /// Per-op scratch (partial sums, attention's delta), reused by every op.
    scratch: usize,
    scratch_len: usize,
    /// The first level's sums of a two-level per-channel sum.
    mid: usize,
    mid_len: usize,
    /// Log-sum-exp buffers, `lse_len` elements each.
    lse: usize,
    lse_len: usize,
    lse_count: usize,
}

/// Positions per chunk of the ids' CSR build (`eng_csr_*` in kernels/engine.cu: one warp per
/// chunk, and a `chunks x vocab` table of counts).
pub(super) const CSR_CHUNK: usize = 2048;

/// The `tokens` space: x, y, then the ids' CSR (offsets per vocabulary row, then positions),
/// then the CSR build's counts (`chunks x vocab`), then each position's document start, then the
/// embedding gradient's pieces per row (offsets, `vocab + 1`).
#[derive(Clone, Copy, Debug)]
struct TokenLayout {
    n: usize,
    vocab: usize,
    /// Positions per chunk of the CSR build.
    chunk: usize,
    /// Tokens per piece of the embedding's gradient.
    piece: usize,
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
    fn chunks(&self) -> usize {
        self.n.div_ceil(self.chunk).max(1)
    }
    fn counts(&self) -> usize {
        3 * self.n + self.vocab + 1
    }
    /// Each position's document start (`eng_doc_starts`, for attention within documents),
    /// 16-byte aligned for flash attention's copies.
    fn starts(&self) -> usize {
        (self.counts() + self.chunks() * self.vocab).div_ceil(4) * 4
    }
    fn pieces(&self) -> usize {
        self.starts() + self.n
    }
    /// The most pieces the embedding's gradient can cut a micro-batch's rows into: a row of
    /// `len > piece` tokens gives `ceil(len / piece) < 2 len / piece` of them.
    fn max_pieces(&self) -> usize {
        (2 * self.n).div_ceil(self.piece).max(1)
    }
    /// cuDNN's ragged attention (`sdpa.rs`, `eng_doc_slots`): each position's document length
    /// (scratch), each slot's length, each slot's first position (`n` entries each), then
    /// [`RAGGED_UNITS`] arrays of ragged offsets (`n + 1` entries each), all 16-byte aligned.
    fn ragged(&self) -> usize {
        (self.pieces() + self.vocab + 1).div_ceil(4) * 4
    }
    /// `eng_doc_slots`' slot lengths.
    fn slot_len(&self) -> usize {
        self.ragged() + self.n.div_ceil(4) * 4
    }
    /// `eng_doc_slots`' slot starts.
    fn slot_start(&self) -> usize {
        self.ragged() + 2 * self.n.div_ceil(4) * 4
    }
    /// The `k`-th array of ragged offsets.
    fn ragged_offsets(&self, k: usize) -> usize {
        self.ragged() + 3 * self.n.div_ceil(4) * 4 + k * (self.n + 1).div_ceil(4) * 4
    }
    fn len(&self) -> usize {
        self.ragged_offsets(RAGGED_UNITS)
    }
}

/// Arrays of ragged offsets the tokens' space holds: one per distinct row stride a cuDNN
/// attention call over documents reads (q, k, v, o, dq, dk, dv and the statistics at most).
const RAGGED_UNITS: usize = 8;

/// The unit of work being collected.
struct Unit {
    key: String,
    work: Vec<Work>,
    /// The schedule scalars' bits, from `aux.sched`.
    scalars: Vec<u32>,
}

/// What the backend remembers of a unit's key: its last work and whether that is captured.
struct Seen {
    /// The graph slot of this key.
    slot: usize,
    work: Vec<Work>,
    captured: bool,
}

/// The engine's backend over a [`Device`] (see the module doc).
pub struct KernelBackend<D: Device> {
    dev: D,
    len: usize,
    /// With bf16 activations: where they and the weights' bf16 copy are.
    half: Option<HalfRegions>,
    aux: AuxLayout,
    half_len: usize,
    tokens: TokenLayout,
    /// Log-sum-exp buffer index of each attention output (keyed by its arena offset).
    lse: HashMap<usize, usize>,
    /// Partials per group of a two-level per-channel sum ([`Capacity::colsum_group`]).
    colsum_group: usize,
    /// For which `(BOS id, rows, length)` the document starts of the micro-batch's ids are on the
    /// device (`eng_doc_starts`, launched by the first attention call that needs them).
    starts_for: Option<(crate::model::ops::DocRule, usize, usize)>,
    /// Attention on cuDNN (`sdpa.rs`).
    cudnn: sdpa::CudnnState,
    /// Capture repeated units as graphs.
    graphs: bool,
    /// The device runs collectives ([`Backend::set_comm`](super::backend::Backend::set_comm)).
    comm: bool,
    /// Collectives queued since the last join.
    comm_open: bool,
    unit: Option<Unit>,
    seen: HashMap<String, Seen>,
    counts: GraphCounts,
}

impl<D: Device> KernelBackend<D> {
    /// A backend with an arena of `len` elements on `dev`, scratch sized by `cap`.
    pub fn new(dev: D, len: usize, cap: Capacity) -> anyhow::Result<Self> {
        Self::with_csr_chunk(dev, len, cap, CSR_CHUNK, None)
    }

    /// [`KernelBackend::new`], with the activations in bf16 when `half` says where (`dev` must
    /// run the bf16 build of the kernels).
    pub fn with_half(dev: D, len: usize, cap: Capacity, half: Option<HalfRegions>) -> anyhow::Result<Self> {
        Self::with_csr_chunk(dev, len, cap, CSR_CHUNK, half)
    }

    /// [`KernelBackend::new`] building the ids' CSR in chunks of `chunk` positions (tests use
    /// small ones to cross chunk edges on small micro-batches).
    pub(super) fn with_csr_chunk(mut dev: D, len: usize, cap: Capacity, chunk: usize, half: Option<HalfRegions>) -> anyhow::Result<Self> {
        anyhow::ensure!(chunk >= 1, "a CSR chunk of {chunk} positions");
        let (mut sizes, aux, half_len, tokens) = cap.spaces(len, chunk);
        if let Some(h) = half {
            anyhow::ensure!(
                h.act.end() <= len && h.params.end() <= h.act.off && h.act.off.is_multiple_of(crate::engine::layout::ALIGN),
                "bf16 regions {h:?} outside an arena of {len} elements, the parameters after the activations, or the activations off 256 bytes"
            );
            (sizes.arena, sizes.act, sizes.mirror) = (len - h.act.len, h.act.len, h.params.len);
        }
        dev.alloc(sizes)?;
        Ok(Self {
            dev,
            len,
            half,
            aux,
            half_len,
            tokens,
            lse: HashMap::new(),
            colsum_group: cap.colsum_group.max(1),
            starts_for: None,
            cudnn: sdpa::CudnnState::default(),
            graphs: true,
            comm: false,
            comm_open: false,
            unit: None,
            seen: HashMap::new(),
            counts: GraphCounts::default(),
        })
    }

    /// Captures repeated units of work as graphs (the default) or runs them op by op.
    pub fn with_graphs(mut self, on: bool) -> Self {
        self.graphs = on;
        self
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Runs `w` now, or adds it to the open unit.
    fn submit(&mut self, w: Work) {
        match &mut self.unit {
            Some(u) => u.work.push(w),
            None => self.dev.run(&w),
        }
    }

    /// Schedule scalars (values that change between replays of a unit): a pointer to them in
    /// `aux`, where the open unit's table will hold them, or where they are written now.
    fn sched(&mut self, values: &[f64]) -> Arg {
        let words: Vec<u32> = values.iter().map(|&v| (v as f32).to_bits()).collect();
        match &mut self.unit {
            Some(u) => {
                let at = u.scalars.len();
                assert!(at + words.len() <= SCHED_CAP, "a unit of work holds at most {SCHED_CAP} schedule scalars");
                u.scalars.extend(words);
                Arg::Ptr(Space::Aux, self.aux.sched + at)
            }
            None => {
                // In order on the device: the launch before has read the previous values.
                self.dev.write(Space::Aux, self.aux.sched, &words).expect("writing schedule scalars to the device");
                Arg::Ptr(Space::Aux, self.aux.sched)
            }
        }
    }

    /// Panics inside a unit of work: `what` would need the unit's work done (a host read) or
    /// would reorder a host write before it.
    fn outside_unit(&self, what: &str) {
        if let Some(u) = &self.unit {
            panic!("{what} inside the unit of work `{}` (a schedule bug: units never touch the device from the host)", u.key);
        }
    }

    /// Runs the closed unit `u`: op by op the first time its key is seen or when its work
    /// changed, captured on its second identical run, replayed after.
    fn run_unit(&mut self, u: Unit) {
        if !u.scalars.is_empty() {
            self.dev.write(Space::Aux, self.aux.sched, &u.scalars).expect("writing schedule scalars to the device");
        }
        if self.graphs {
            if !self.seen.contains_key(&u.key) {
                let slot = self.seen.len();
                self.seen.insert(u.key.clone(), Seen { slot, work: Vec::new(), captured: false });
            }
            let seen = self.seen.get_mut(&u.key).expect("inserted above");
            if seen.work != u.work {
                // New or changed work: op by op now, captured when it repeats.
                for w in &u.work {
                    self.dev.run(w);
                }
                self.counts.eager += 1;
                seen.work = u.work;
                seen.captured = false;
                return;
            }
            if !seen.captured {
                match self.dev.capture(seen.slot, &u.work) {
                    Ok(()) => {
                        seen.captured = true;
                        self.counts.captured += 1;
                    }
                    Err(e) => {
                        eprintln!("warning: capturing the unit `{}` as a graph failed ({e:#}); running every unit op by op", u.key);
                        self.graphs = false;
                    }
                }
            }
            if seen.captured {
                match self.dev.replay(seen.slot) {
                    Ok(()) => {
                        self.counts.replayed += 1;
                        return;
                    }
                    Err(e) => panic!("replaying the unit `{}`: {e:#}", u.key),
                }
            }
        }
        // Graphs off (or the capture above failed): op by op, no record of the work kept.
        for w in &u.work {
            self.dev.run(w);
        }
        self.counts.eager += 1;
    }
}

/// The engine's stream on the GPU of `device`: `(its handle, whether it is a default stream)`
/// (`pipeline engine-check` prints it; a default stream cannot be captured into graphs).
#[cfg(feature = "cuda")]
pub fn stream_check(device: &candle_core::Device) -> anyhow::Result<(String, bool)> {
    let dev = cuda::CudaDevice::new(device, cuda::GemmMath::F32, false)?;
    Ok((format!("{:p}", dev.stream().cu_stream()), dev.on_default_stream()))
}

/// What crosses between the engine and candle's tensors on the GPU of `device`, device to
/// device, each while the stream it must wait for is still busy (a missing event then shows as
/// stale values): `(what, ok, detail)` for token ids from CUDA tensors (a view at an offset,
/// as the uploader makes them, written by candle's stream behind queued products) against the
/// same ids from the host, with the CSR built from each; and the arena copied into a CUDA
/// tensor after engine work still queued (products, then a scaling the copy must see) and
/// before a fill the copy must not see, against the host's expectation, bit for bit.
#[cfg(feature = "cuda")]
pub fn transfer_check(device: &candle_core::Device) -> anyhow::Result<Vec<(String, bool, String)>> {
    use candle_core::{Device as CandleDevice, Tensor};

    use super::backend::{Backend, Buf, Tokens};
    // A few milliseconds of products on candle's stream.
    let busy_candle = || -> anyhow::Result<()> {
        let a = (Tensor::ones((2048, 2048), candle_core::DType::F32, device)? * 1e-3)?;
        let mut b = a.clone();
        for _ in 0..16 {
            b = b.matmul(&a)?;
        }
        drop(b);
        Ok(())
    };
    // Token ids across a CSR chunk's edge; the other spaces as small as they go.
    let cap = Capacity::minimal(CSR_CHUNK + CSR_CHUNK / 2, 1001);
    let (small, side) = (4096, 1024);
    let len = small + 3 * side * side;
    let mut be = KernelBackend::new(cuda::CudaDevice::new(device, cuda::GemmMath::F32, false)?, len, cap)?;
    // A few milliseconds of products on the engine's stream (outside the checked region).
    let m = |k: usize| Buf { off: small + k * side * side, len: side * side }.mat(side, side);
    let busy_engine = |be: &mut KernelBackend<cuda::CudaDevice>| {
        for _ in 0..200 {
            be.op(op::Gemm { c: m(2), a: m(0), b: m(1), alpha: 1.0, beta: 0.0 });
        }
    };
    let t = be.tokens;
    let mut rng = fastrand::Rng::with_seed(11);
    let x: Vec<u32> = (0..t.n).map(|_| rng.u32(0..t.vocab as u32 / 3) * 3).collect();
    let y: Vec<u32> = (0..t.n).map(|_| rng.u32(0..t.vocab as u32)).collect();
    let read_all = |be: &KernelBackend<cuda::CudaDevice>| be.dev.read(Space::Tokens, 0, t.counts());
    be.set_tokens(&x, &y);
    let host = read_all(&be)?;
    // Zero the space between, so that a copy that does not happen shows.
    be.dev.write(Space::Tokens, 0, &vec![0; t.counts()])?;
    busy_candle()?;
    let both = Tensor::from_vec([x.clone(), y.clone()].concat(), (2, t.n), &CandleDevice::Cpu)?.to_device(device)?;
    let (tx, ty) = (both.get(0)?, both.get(1)?);
    be.load_tokens(Tokens::Tensors { x: &tx, y: &ty })?;
    let dev = read_all(&be)?;
    let differ = host.iter().zip(&dev).filter(|(a, b)| a != b).count();
    let mut out = vec![(
        "token ids and their CSR from CUDA tensors".to_string(),
        differ == 0,
        format!("{differ} of {} words differ from the host's", host.len()),
    )];
    let values: Vec<f32> = (0..small).map(|i| (i as f32 * 0.731).sin()).collect();
    let region = Buf { off: 64, len: small - 64 };
    be.upload(Buf { off: 0, len: small }, &Tensor::from_vec(values.clone(), small, &CandleDevice::Cpu)?)?;
    busy_candle()?;
    busy_engine(&mut be);
    be.op(op::Scale { dst: region, a: -2.0 });
    let on_device = be.download_to(region, &[region.len], device)?;
    be.op(op::Fill { dst: region, value: 7.0 });
    let copied: Vec<u32> = on_device.to_device(&CandleDevice::Cpu)?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect();
    let want: Vec<u32> = values[64..].iter().map(|v| (v * -2.0).to_bits()).collect();
    let differ = want.iter().zip(&copied).filter(|(a, b)| a != b).count();
    out.push((
        "arena into a CUDA tensor".to_string(),
        differ == 0,
        format!("{differ} of {} values differ from the arena between the engine's work before and after the copy", region.len),
    ));
    Ok(out)
}

/// Without the `cuda` feature: the reason there is no GPU stream.
#[cfg(not(feature = "cuda"))]
pub fn stream_check(device: &candle_core::Device) -> anyhow::Result<(String, bool)> {
    anyhow::bail!("the engine's GPU backend ({:?}) needs a `cuda` build (scripts/build-cuda.sh)", device.location())
}

/// Without the `cuda` feature: nothing crosses to a GPU.
#[cfg(not(feature = "cuda"))]
pub fn transfer_check(device: &candle_core::Device) -> anyhow::Result<Vec<(String, bool, String)>> {
    anyhow::bail!("the engine's GPU backend ({:?}) needs a `cuda` build (scripts/build-cuda.sh)", device.location())
}

/// The engine's collectives on the GPU of `device` ([`comm::comm_check`]) at a world of one:
/// NCCL on the engine's communication stream, beside its compute stream and inside a captured
/// graph (`pipeline engine-check` prints it). NCCL that cannot be loaded is a failed check
/// naming the library.
#[cfg(feature = "cuda")]
pub fn comm_check(device: &candle_core::Device) -> anyhow::Result<Vec<(String, bool, String)>> {
    let cap = Capacity::minimal(64, 64);
    let mut be = KernelBackend::new(cuda::CudaDevice::new(device, cuda::GemmMath::F32, false)?, comm::CHECK_ARENA, cap)?;
    // Enough GEMMs before the source's last write that a collective not ordered after it
    // (a missing fork) reads the old values.
    match comm::comm_check(&mut be, std::sync::Arc::new(crate::dist::single::Single), 400) {
        Ok(flags) => Ok(flags),
        Err(e) => Ok(vec![("collectives on the engine's communication stream (NCCL)".into(), false, format!("{e:#}"))]),
    }
}

/// Without the `cuda` feature there is no GPU backend to check.
#[cfg(not(feature = "cuda"))]
pub fn comm_check(device: &candle_core::Device) -> anyhow::Result<Vec<(String, bool, String)>> {
    anyhow::bail!("the engine's GPU backend ({:?}) needs a `cuda` build (scripts/build-cuda.sh)", device.location())
}
