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

/// A region of the arena: `len` elements from `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Buf {
    /// First element.
    pub off: usize,
    /// Elements.
    pub len: usize,
}

impl Buf {
    /// `len` elements from `off` elements into this region.
    pub fn sub(self, off: usize, len: usize) -> Buf {
        assert!(off + len <= self.len, "sub-region {off}+{len} of a {}-element region", self.len);
        Buf { off: self.off + off, len }
    }

    /// The end (exclusive).
    pub fn end(self) -> usize {
        self.off + self.len
    }

    /// Whether the two regions share an element.
    pub fn overlaps(self, other: Buf) -> bool {
        self.len > 0 && other.len > 0 && self.off < other.end() && other.off < self.end()
    }

    /// The region as a `rows x cols` row-major matrix (`ld = cols`).
    pub fn mat(self, rows: usize, cols: usize) -> Mat {
        assert_eq!(rows * cols, self.len, "a {}-element region as a {rows}x{cols} matrix", self.len);
        Mat { off: self.off, rows, cols, ld: cols, t: false }
    }
}

/// A matrix in the arena: `rows x cols` stored row-major from `off` with `ld` elements between
/// rows; `t` reads it transposed (a `cols x rows` operand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mat {
    /// First element.
    pub off: usize,
    /// Stored rows.
    pub rows: usize,
    /// Stored columns.
    pub cols: usize,
    /// Elements between the starts of two rows.
    pub ld: usize,
    /// Read transposed.
    pub t: bool,
}

impl Mat {
    /// The transposed operand (no copy).
    pub fn t(self) -> Mat {
        Mat { t: !self.t, ..self }
    }

    /// Columns `c0..c0 + n` of the stored matrix (a view with the same `ld`).
    pub fn cols(self, c0: usize, n: usize) -> Mat {
        assert!(c0 + n <= self.cols && !self.t, "columns {c0}+{n} of a {}-column matrix", self.cols);
        Mat { off: self.off + c0, cols: n, ..self }
    }

    /// Rows `r0..r0 + n` of the stored matrix.
    pub fn rows(self, r0: usize, n: usize) -> Mat {
        assert!(r0 + n <= self.rows && !self.t, "rows {r0}+{n} of a {}-row matrix", self.rows);
        Mat { off: self.off + r0 * self.ld, rows: n, ..self }
    }

    /// The operand's shape as read: `(rows, cols)`, swapped when transposed.
    pub fn shape(self) -> (usize, usize) {
        if self.t { (self.cols, self.rows) } else { (self.rows, self.cols) }
    }

    /// The elements `count` such matrices `stride` apart span (a batched operand).
    pub fn batch_span(self, count: usize, stride: usize) -> Buf {
        let one = self.span();
        if count == 0 || one.len == 0 { Buf { off: self.off, len: 0 } } else { Buf { off: one.off, len: (count - 1) * stride + one.len } }
    }

    /// The elements it spans (from the first to one past the last).
    pub fn span(self) -> Buf {
        let len = if self.rows == 0 || self.cols == 0 { 0 } else { (self.rows - 1) * self.ld + self.cols };
        Buf { off: self.off, len }
    }
}

/// The MLP's activation and its slope for negative inputs (`relu²`: 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Activation {
    /// Slope of the leaky ReLU before the square (0: ReLU).
    pub slope: f64,
}

/// Shapes of one causal attention call on token-major matrices: `batch` sequences of `t`
/// tokens, `heads` query heads and `kv_heads` key/value heads of width `d`; with `docs`, the
/// document mask of the micro-batch's input ids (a segment starts at each sequence's first
/// position and at every id equal to `docs`: [`crate::model::ops::DocumentMask::at_token`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Head width.
    pub d: usize,
    /// Attend within documents: the BOS id that starts one (`None`: plain causal attention).
    pub docs: Option<u32>,
}

/// Shapes of the per-head RMS norm + RoPE op: rows of `heads` heads of width `d`, the first
/// `rot` dims of each rotated with the `(t, rot / 2)` tables, row `n` at position `n % t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    /// Rows (tokens).
    pub rows: usize,
    /// Heads per row.
    pub heads: usize,
    /// Head width.
    pub d: usize,
    /// Rotated dims per head (even, at most `d`).
    pub rot: usize,
    /// Sequence length (the position of row `n` is `n % t`).
    pub t: usize,
}

/// The parameters of one block's two-lane mix ([`Backend::lanes_fwd`]), or their gradients:
/// `attn_scale` and `mlp_scale` `(C,)`, the block's `parallel_resid_lambdas` row `(2,)` and its
/// `parallel_post_lambdas` `(2, 2)`, all in device memory.
#[derive(Clone, Copy, Debug)]
pub struct LaneBufs {
    /// `attn_scale`.
    pub sa: Buf,
    /// `mlp_scale`.
    pub sm: Buf,
    /// `r`: `parallel_resid_lambdas[i]`.
    pub r: Buf,
    /// `p`: `parallel_post_lambdas[i]`, row-major (`p[0, k]` attention into lane `k`).
    pub p: Buf,
}

/// One Adam step's scalars (see [`crate::optim::Adam::step`] for the update).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// Learning rate (schedule applied).
    pub lr: f64,
    /// `β1`.
    pub beta1: f64,
    /// `β2`.
    pub beta2: f64,
    /// `ε`.
    pub eps: f64,
    /// Decoupled weight decay (0: none).
    pub weight_decay: f64,
    /// `1 − β1^t`.
    pub bias1: f64,
    /// `sqrt(1 − β2^t)`.
    pub bias2_sqrt: f64,
}

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

    /// `dst = value`.
    fn fill(&mut self, dst: Buf, value: f64);

    /// `dst = src`.
    fn copy(&mut self, dst: Buf, src: Buf);

    /// `dst *= a`.
    fn scale(&mut self, dst: Buf, a: f64);

    /// `sum(src)` in f64.
    fn sum(&self, src: Buf) -> f64;

    /// `sum(src^2)` in f64.
    fn sum_sq(&self, src: Buf) -> f64;

    /// Whether every element of `src` is finite.
    fn all_finite(&self, src: Buf) -> bool;

    /// `dst[0] += sum(src)` on the device (the micro-batches' losses summed with no host read;
    /// the step reads the total once).
    fn sum_into(&mut self, src: Buf, dst: Buf);

    /// `clip_grad_norm_` on the device: `norm[0] = sqrt(sum(g^2))`, then `g *= max / (norm +
    /// 1e-6)` when that factor is below 1.
    fn clip_norm(&mut self, g: Buf, max: f64, norm: Buf);

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

    /// `C = alpha op(A) op(B) + beta C` (`beta = 0`: `C` is not read).
    fn gemm(&mut self, c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64);

    /// `count` independent products `C_i = alpha op(A_i) op(B_i) + beta C_i`, operand `i`
    /// starting `i * stride` elements after the view given (`strides = [c, a, b]`): the
    /// per-document LoRA adapters' products, one per batch row. The default runs them one by
    /// one; the GPU backend runs one strided-batched cuBLASLt call.
    #[allow(clippy::too_many_arguments)]
    fn gemm_batched(&mut self, c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64, count: usize, strides: [usize; 3]) {
        for i in 0..count {
            let at = |m: Mat, k: usize| Mat { off: m.off + i * strides[k], ..m };
            self.gemm(at(c, 0), at(a, 1), at(b, 2), alpha, beta);
        }
    }

    /// `out[n] = table[x[n]]` (`dim`-wide rows) for the micro-batch's inputs.
    fn embedding_fwd(&mut self, table: Buf, out: Buf, dim: usize);

    /// `dtable[x[n]] += dout[n]`.
    fn embedding_bwd(&mut self, dout: Buf, dtable: Buf, dim: usize);

    /// Row RMS norm: `r = sqrt(mean(x^2) + eps)`, `out = scale x / r`, `rstd = 1 / r` per row.
    fn rms_norm_fwd(&mut self, x: Buf, out: Buf, rstd: Buf, cols: usize, scale: f64, eps: f64);

    /// Backward of [`Backend::rms_norm_fwd`]: `dx (+)= scale (dy / r - x sum(dy x) / (cols r^3))`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_bwd(&mut self, x: Buf, rstd: Buf, dy: Buf, dx: Buf, cols: usize, scale: f64, accumulate: bool);

    /// `out = h mix[0] + x0 mix[1]` (`mix`: `(2, cols)`).
    fn resid_mix_fwd(&mut self, h: Buf, x0: Buf, mix: Buf, out: Buf);

    /// Backward of [`Backend::resid_mix_fwd`]: `dh = du mix[0]`, `dx0 += du mix[1]`,
    /// `dmix[0] += colsum(du h)`, `dmix[1] += colsum(du x0)`.
    #[allow(clippy::too_many_arguments)]
    fn resid_mix_bwd(&mut self, du: Buf, h: Buf, x0: Buf, mix: Buf, dh: Buf, dx0: Buf, dmix: Buf);

    /// `out = base + x s` per channel (`out` may be `base`: in place).
    fn scale_add_fwd(&mut self, base: Buf, x: Buf, s: Buf, out: Buf);

    /// Backward of the `x s` term: `dx = dy s`, `ds += colsum(dy x)` (the base's gradient is
    /// `dy` itself, which the schedule keeps).
    fn scale_add_bwd(&mut self, dy: Buf, x: Buf, s: Buf, dx: Buf, ds: Buf);

    /// The U-Net skip into decoder position `j`: `out = h + w s`, or with a gate row `z`,
    /// `out = k + sigmoid(z) (h - k)` with `k = w s`.
    fn skip_fwd(&mut self, h: Buf, s: Buf, w: Buf, z: Option<Buf>, out: Buf);

    /// Backward of [`Backend::skip_fwd`]: `dh = dy` (or `g dy`), `ds = w dk` (`dk = dy` or
    /// `(1 - g) dy`), both written; `dw += colsum(dk s)`, `dz += colsum(dy (h - k)) g (1 - g)`.
    #[allow(clippy::too_many_arguments)]
    fn skip_bwd(&mut self, dy: Buf, h: Buf, s: Buf, w: Buf, z: Option<(Buf, Buf)>, dh: Buf, ds: Buf, dw: Buf);

    /// Per-head RMS norm, RoPE of the first `rot` dims and an optional per-head gain, of the
    /// `(rows, heads d)` view `x` into contiguous `out`; `rstd` gets `1 / r` per (row, head).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_fwd(&mut self, x: Mat, out: Buf, rstd: Buf, gain: Option<Buf>, cos: Buf, sin: Buf, s: HeadShape, eps: f64);

    /// Backward of [`Backend::qk_norm_rope_fwd`] into the view `dx` (written), `dgain +=`.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_bwd(&mut self, x: Mat, rstd: Buf, dy: Buf, dx: Mat, gain: Option<(Buf, Buf)>, cos: Buf, sin: Buf, s: HeadShape);

    /// Causal GQA attention of token-major `q` `(N, H d)`, `k`, `v` `(N, K d)` views into `out`
    /// `(N, H d)`, scale `1/sqrt(d)`; under `s.docs` each position sees only the keys of its own
    /// document (from the micro-batch's ids).
    fn attention_fwd(&mut self, q: Mat, k: Mat, v: Mat, out: Buf, s: AttnShape);

    /// Backward of [`Backend::attention_fwd`] (probabilities recomputed): `dq`, `dk` written,
    /// `dv` (a view of the fused qkv gradient) written or, with `dv_acc`, added to (exclusive
    /// self-attention wrote its part first).
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(&mut self, q: Mat, k: Mat, v: Mat, out: Buf, dout: Buf, dq: Mat, dk: Mat, dv: Mat, dv_acc: bool, s: AttnShape);

    /// Exclusive self-attention: `out = y - (y . v^) v^` per query head, `v^` the unit value
    /// vector of the token's KV head.
    fn xsa_fwd(&mut self, y: Buf, v: Mat, out: Buf, s: AttnShape);

    /// Backward of [`Backend::xsa_fwd`]: `dy` and `dv` (a view of the qkv gradient) written.
    fn xsa_bwd(&mut self, dout: Buf, y: Buf, v: Mat, dy: Buf, dv: Mat, s: AttnShape);

    /// SmearGate (the 04-27 record; [`crate::model::ops::smear_gate`]) on the `cols`-wide
    /// embedding rows `e` of the micro-batch, sequences of `t`: `out_r = e_r + g_r e_{r-1}` with
    /// `g_r = lambda sigmoid(w . e_r[:W])` (`W = w.len`), `g_r = 0` at a sequence's first position
    /// and where the input id is `bos` (the BOS fix).
    #[allow(clippy::too_many_arguments)]
    fn smear_fwd(&mut self, e: Buf, w: Buf, lambda: Buf, out: Buf, cols: usize, t: usize, bos: u32);

    /// Backward of [`Backend::smear_fwd`]: `de_r = dout_r + g_{r+1} dout_{r+1} + [c < W] dz_r w`
    /// (written), `dw += sum_r dz_r e_r[:W]`, `dlambda += sum_r (dout_r . e_{r-1}) sigmoid_r`,
    /// with `dz_r = (dout_r . e_{r-1}) lambda s_r (1 - s_r)` where `g_r` is not forced to 0.
    #[allow(clippy::too_many_arguments)]
    fn smear_bwd(&mut self, dout: Buf, e: Buf, w: Buf, lambda: Buf, de: Buf, dw: Buf, dlambda: Buf, cols: usize, t: usize, bos: u32);

    /// The sparse attention-output gate (the 04-27 record; [`crate::model::ops::attn_gate`]):
    /// `out[n, h] = sigmoid(scale w[h] . x[n]) y[n, h]` for the `heads` heads of the `(N, H d)`
    /// rows `y`, `x` the `(N, W)` view of the gate's input, `w` `(H, W)`.
    fn attn_gate_fwd(&mut self, y: Buf, x: Mat, w: Buf, out: Buf, heads: usize, scale: f64);

    /// Backward of [`Backend::attn_gate_fwd`]: `dy = g dout` and `dz[n, h] = scale g (1 - g)
    /// (dout[n, h] . y[n, h])`, both written (the schedule turns `dz` into the gradients of `w`
    /// and `x` with two GEMMs).
    #[allow(clippy::too_many_arguments)]
    fn attn_gate_bwd(&mut self, dout: Buf, y: Buf, x: Mat, w: Buf, dy: Buf, dz: Buf, heads: usize, scale: f64);

    /// The two-lane decoder's mix (the 04-27 record; [`crate::model::ops::lanes`]): for `k` in
    /// 0, 1, `out[k] = r[k] l[k] + p[0, k] sa ao + p[1, k] sm mo`. `l[0]` and `l[1]` may be one
    /// buffer (the lanes' first block).
    fn lanes_fwd(&mut self, l: [Buf; 2], ao: Buf, mo: Buf, w: LaneBufs, out: [Buf; 2]);

    /// Backward of [`Backend::lanes_fwd`] from the lanes' gradients `g`: `dl[k] = r[k] g[k]`,
    /// `dao = sa dA`, `dmo = sm dM` written (`dA = p[0, 0] g[0] + p[0, 1] g[1]`, `dM` alike);
    /// the parameters' gradients `dw` added to.
    #[allow(clippy::too_many_arguments)]
    fn lanes_bwd(&mut self, g: [Buf; 2], l: [Buf; 2], ao: Buf, mo: Buf, w: LaneBufs, dl: [Buf; 2], dao: Buf, dmo: Buf, dw: LaneBufs);

    /// `out = leaky_relu(pre, slope)^2`.
    fn act_fwd(&mut self, pre: Buf, out: Buf, a: Activation);

    /// `dpre = dout 2 l(pre) l'(pre)` with `l(x) = max(x, slope x)`.
    fn act_bwd(&mut self, pre: Buf, dout: Buf, dpre: Buf, a: Activation);

    /// The soft-capped cross-entropy of `(rows, vocab)` logits against the micro-batch's
    /// targets, fused with its gradient: `losses[n]` gets row `n`'s loss and the logits are
    /// overwritten by `grad_scale d loss[n] / d logits[n]`.
    fn softcap_ce(&mut self, logits: Buf, losses: Buf, vocab: usize, cap: f64, grad_scale: f64);

    /// `p = p (1 - lr wd)` then the Adam update with moments `m`, `v` (see [`AdamStep`]).
    fn adam(&mut self, p: Buf, g: Buf, m: Buf, v: Buf, s: AdamStep);

    /// Muon's momentum: `buf = mu buf + g`; `u = g + mu buf` (Nesterov) or `buf`.
    fn momentum(&mut self, g: Buf, buf: Buf, u: Buf, mu: f64, nesterov: bool);

    /// `y = a x + b y`.
    fn axpby(&mut self, a: f64, x: Buf, b: f64, y: Buf);

    /// Each `cols`-wide row of `x` scaled to unit L2 norm (floored at `eps`), in place.
    fn row_normalize(&mut self, x: Buf, cols: usize, eps: f64);

    /// The Frobenius norm of each of `count` consecutive matrices of `len` elements of `x`,
    /// plus `eps`, then each divided by it, in place.
    fn normalize_each(&mut self, x: Buf, count: usize, eps: f64);

    /// Each of `count` stored `(rows, cols)` matrices of `src` transposed into `dst`.
    fn transpose_each(&mut self, src: Buf, dst: Buf, count: usize, rows: usize, cols: usize);
}
