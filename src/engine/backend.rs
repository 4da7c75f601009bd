//! The backend trait: every op the engine's schedule ([`super::schedule`]) and its optimizers
//! ([`super::optim`]) run, on regions of one arena addressed by static offsets ([`Buf`],
//! [`Mat`]). The schedule knows the model and the order; a backend knows how to compute an op
//! on its device and in its precision. Two CPU backends implement it
//! ([`super::cpu::CpuBackend`] in f64 for checks and f32 for speed); the GPU backend of the
//! next issue implements the same trait over device memory.
//!
//! Conventions: `rows x cols` matrices are row-major with a leading dimension (`ld`, elements
//! between rows), so a column block of a wider matrix (q inside the fused qkv product) is a
//! view, not a copy. An op writes its outputs and reads its inputs; an output never overlaps
//! an input unless the op says it works in place. "Accumulate" outputs (`+=`) are how gradients
//! are summed over the uses of a tensor and over micro-batches without a separate add.

use candle_core::{DType, Tensor};

use crate::engine::op::Op;
pub use crate::engine::op::{Activation, AdamStep, AttnShape, Buf, HeadShape, LaneBufs, Mat};

/// A micro-batch's token ids, inputs `x` and targets `y` (`rows * t` each), wherever they are.
#[derive(Clone, Copy, Debug)]
pub enum Tokens<'a> {
    /// On the host.
    Host {
        /// Inputs.
        x: &'a [u32],
        /// Targets.
        y: &'a [u32],
    },
    /// `u32` tensors on any device (the upload stage's): the GPU backend copies them device to
    /// device, with no host read; other backends read them.
    Tensors {
        /// Inputs.
        x: &'a Tensor,
        /// Targets.
        y: &'a Tensor,
    },
}

impl Tokens<'_> {
    /// The ids and targets on the host (a read for tensors on a GPU).
    pub fn to_host(&self) -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
        Ok(match *self {
            Tokens::Host { x, y } => (x.to_vec(), y.to_vec()),
            Tokens::Tensors { x, y } => (x.flatten_all()?.to_vec1()?, y.flatten_all()?.to_vec1()?),
        })
    }

    /// How many ids and targets.
    pub fn lens(&self) -> (usize, usize) {
        match *self {
            Tokens::Host { x, y } => (x.len(), y.len()),
            Tokens::Tensors { x, y } => (x.elem_count(), y.elem_count()),
        }
    }
}

/// How a backend that captures units of work ([`Backend::begin_unit`]) has run them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Units captured (once per key, again when its sequence changed).
    pub captured: u64,
    /// Units replayed from a capture (the first run of a capture included).
    pub replayed: u64,
    /// Units run op by op (graphs switched off, or a capture that failed).
    pub eager: u64,
}

/// Panics when a region of an op leaves an arena of `len` elements, or an output overlaps an
/// input or another output (the rule every backend enforces).
pub fn check_regions(len: usize, ins: &[Buf], outs: &[Buf]) {
    for b in ins.iter().chain(outs) {
        assert!(b.end() <= len, "region {b:?} outside the {len}-element arena");
    }
    for (i, o) in outs.iter().enumerate() {
        assert!(!ins.iter().any(|b| b.overlaps(*o)), "output {o:?} overlaps an input");
        assert!(!outs[i + 1..].iter().any(|b| b.overlaps(*o)), "outputs {o:?} overlap");
    }
}

/// The ops of the engine, on one arena. Every method panics on a region outside the arena or
/// an output overlapping an input (a schedule bug, never a data error).
pub trait Backend: Send {
    /// The arena's element type (`F64` for the check backend, `F32` for the fast one).
    fn dtype(&self) -> DType;

    /// Where the ops run, for logs and reports (`"cpu"`, `"cuda:0 (NVIDIA H100 …), bf16 GEMMs"`).
    fn device_name(&self) -> String;

    /// Elements in the arena.
    fn len(&self) -> usize;

    /// Whether the arena is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` (any float dtype, any device; `dst.len` elements) into `dst`.
    fn upload(&mut self, dst: Buf, src: &Tensor) -> anyhow::Result<()>;

    /// `src` as a CPU tensor of `shape` in the arena's dtype.
    fn download(&self, src: Buf, shape: &[usize]) -> anyhow::Result<Tensor>;

    /// `src` as a tensor of `shape` on `device`, in the arena's dtype. The default goes through
    /// the host; the GPU backend copies into a tensor on its own GPU device to device (ordered
    /// after its work with an event, no host wait).
    fn download_to(&self, src: Buf, shape: &[usize], device: &candle_core::Device) -> anyhow::Result<Tensor> {
        Ok(self.download(src, shape)?.to_device(device)?)
    }

    /// The token ids of the next micro-batch: inputs `x` and targets `y`, `rows * t` each.
    fn set_tokens(&mut self, x: &[u32], y: &[u32]);

    /// [`Backend::set_tokens`] from wherever the ids are. The default reads them to the host;
    /// the GPU backend copies tensors on its GPU device to device and builds what it derives
    /// from them (the ids' CSR) there, so a micro-batch costs the host no read.
    fn load_tokens(&mut self, tokens: Tokens<'_>) -> anyhow::Result<()> {
        let (x, y) = tokens.to_host()?;
        self.set_tokens(&x, &y);
        Ok(())
    }

    /// `sum(src)` in f64.
    fn sum(&self, src: Buf) -> f64;

    /// `sum(src^2)` in f64.
    fn sum_sq(&self, src: Buf) -> f64;

    /// Whether every element of `src` is finite.
    fn all_finite(&self, src: Buf) -> bool;

    /// Opens a unit of work named `key`: the ops until [`Backend::end_unit`] are one sequence
    /// that the backend may defer and replay as a whole (the GPU backend captures it once as a
    /// CUDA graph and replays it while the sequence stays the same). Inside a unit no op reads
    /// the device from the host ([`Backend::sum`], [`Backend::download`]...); values that change
    /// between replays (learning rates, momentum, bias corrections) are passed as op arguments
    /// and the backend keeps them in device memory. The CPU backends run ops as they come.
    fn begin_unit(&mut self, _key: &str) {}

    /// Closes the unit [`Backend::begin_unit`] opened and runs (or replays) it.
    fn end_unit(&mut self) {}

    /// Gives the backend the ranks' communicator (data parallel), for collectives it queues
    /// with its own work ([`Backend::comm_all_reduce`], [`Backend::comm_broadcast`]): true
    /// when it does (the GPU backend: NCCL on a stream of its own). False for a backend whose
    /// exchange goes through the host between ops (the CPU backends: [`super::exchange`] reads
    /// and writes their arena); an error when the communicator cannot start.
    fn set_comm(&mut self, _ranks: std::sync::Arc<dyn crate::dist::Collective>) -> anyhow::Result<bool> {
        Ok(false)
    }

    /// Queues, after the work queued so far, every region of `regions` combined over the ranks
    /// by `op`, in place, on the backend's communication stream: the work queued after it runs
    /// beside it and does not wait for it until [`Backend::comm_join`] (or the end of the unit
    /// of work, which joins). Until then no work may read or write the regions. Only on a
    /// backend whose [`Backend::set_comm`] returned true.
    fn comm_all_reduce(&mut self, _regions: &[Buf], _op: crate::dist::ReduceOp) {
        panic!("the engine's {} backend queues no collectives (set_comm)", self.device_name())
    }

    /// As [`Backend::comm_all_reduce`]: each `(region, root)` broadcast from rank `root` in
    /// place, all of them in one group (an all-gather whose pieces are any regions: sharded
    /// Muon's updates, each from the rank that computed it).
    fn comm_broadcast(&mut self, _pieces: &[(Buf, usize)]) {
        panic!("the engine's {} backend queues no collectives (set_comm)", self.device_name())
    }

    /// The work queued from now on waits for every collective queued so far.
    fn comm_join(&mut self) {}

    /// Whether [`Backend::set_comm`] started a communicator here (collectives are queued with
    /// the work, not run through the host).
    fn queues_collectives(&self) -> bool {
        false
    }

    /// Work queued from now on on the rest of the program's stream (candle's, where the world's
    /// collectives run) waits for the work queued so far here (an event, no host wait): so that
    /// the world's NCCL calls never run beside the backend's own (two communicators whose
    /// kernels run at once on a GPU may deadlock). Nothing to do on the CPU backends.
    fn fence(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Units captured and replayed so far, for the log and the report (`None`: the backend runs
    /// every op as it comes).
    fn graph_counts(&self) -> Option<GraphCounts> {
        None
    }

    /// Runs attention on cuDNN's fused flash attention (`on`; the GPU backend: where cuDNN
    /// refuses, it says so once and runs its own kernels) or on the backend's own; turning it
    /// on is an error on a backend without it.
    fn set_cudnn(&mut self, on: bool) -> anyhow::Result<()> {
        anyhow::ensure!(!on, "the engine's {} backend computes attention itself: cuDNN is the GPU backend's", self.device_name());
        Ok(())
    }

    /// The attention implementation the ops run, for logs and reports (`"reference"` on the CPU;
    /// `"cudnn"` or `"flash_mma"`, with cuDNN's refusal where it refused, on the GPU).
    fn attention_name(&self) -> String {
        "reference".into()
    }

    /// Waits until the device has done the work queued so far (the CPU backends run every op
    /// as it comes: nothing to wait for).
    fn synchronize(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Records a timing mark after the work queued so far (a CUDA event on a GPU) and returns
    /// its number; `None` when the backend has no device clock (its ops run as they come and
    /// the host's clock times them). For per-op timings ([`super::timed::Timed`]).
    fn timing_mark(&mut self) -> Option<usize> {
        None
    }

    /// Milliseconds of device time from mark `from` to mark `to` (waits for `to`).
    fn timing_ms(&self, _from: usize, _to: usize) -> anyhow::Result<f64> {
        anyhow::bail!("this backend has no device clock")
    }

    /// Whether the device has passed mark `mark` (without waiting; true without a clock).
    fn timing_done(&self, _mark: usize) -> bool {
        true
    }

    /// Forgets one timing mark (the others keep their numbers).
    fn timing_release(&self, _mark: usize) {}

    /// Forgets every timing mark.
    fn timing_reset(&self) {}

    /// The arena region this backend stores in bf16 (the layout's `half` region with bf16
    /// activations; none by default).
    fn half_region(&self) -> Option<Buf> {
        None
    }

    /// The weights in `params` may have changed since the last forward pass (called at the
    /// start of each one): a backend that keeps a lower-precision copy of them for its GEMMs
    /// (the GPU's with bf16 activations) refreshes it. Nothing to do for the others.
    fn refresh_weights(&mut self, _params: Buf) {}

    /// Runs one op ([`crate::engine::op`]): a backend that computes applies it
    /// (`op.apply(self)`, with [`crate::engine::op::Kernels`]); a wrapper (timing, a check)
    /// works around the inner backend's `run`, once for every op.
    fn run(&mut self, op: Op);
}

/// `be.op(op::Gemm { .. })`: an op's arguments, named, run on any backend.
pub trait BackendExt: Backend {
    /// Runs `op` ([`Backend::run`]).
    fn op(&mut self, op: impl Into<Op>) {
        self.run(op.into())
    }
}

impl<B: Backend + ?Sized> BackendExt for B {}
