//! The backend's ops as values: each op is a struct of its named arguments (regions of the
//! arena, shapes, scalars), declared once in the list below with what it computes; [`Op`] is
//! any of them. The schedule runs an op with `be.op(op::RmsNormFwd { .. })`
//! ([`crate::engine::backend::BackendExt`]); a backend that computes implements [`Kernels`]
//! (a method per op, taking its struct) and applies each [`Op`] to itself; a wrapper of a
//! backend (the per-op timing, the cuBLASLt check) implements one [`Backend::run`] for every
//! op. Adding an op is an entry here and its [`Kernels`] method in each computing backend.
//!
//! The ops' arguments ([`Buf`], [`Mat`] and the shapes) are defined here too.
//!
//! [`Backend::run`]: crate::engine::backend::Backend::run

/// The ids an embedding op looks its table up at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ids {
    /// The micro-batch's input ids.
    #[default]
    Tokens,
    /// BigramHash's bucket of each position ([`crate::model::ops::embedding::bigram_bucket`]):
    /// of `buckets` rows, the micro-batch's ids in sequences of `t`.
    Bigram { buckets: usize, t: usize },
}

/// The residual sum a [`MixNormFwd`] norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixKind {
    /// [`ResidMixFwd`]'s: `u = h mix[0] + x0 mix[1]` (`mix` `(2, cols)`).
    Resid,
    /// [`ScaleAddFwd`]'s: `u = h + x0 mix` per channel (`mix` `(cols)`).
    Scale,
}

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
/// position, at every id equal to `docs.bos`, and every `docs.max_len` positions from a
/// document's start: [`crate::model::ops::DocumentMask::at_token`]).
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
    /// Attend within documents: where their segments start (`None`: plain causal attention).
    pub docs: Option<crate::model::ops::DocRule>,
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

/// The parameters of one block's two-lane mix ([`LanesFwd`]), or their gradients:
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

/// Declares the ops: for each `method => Name { field: Type, .. }`, the struct `Name` and its
/// variant of [`Op`], and the method of [`Kernels`] that computes it.
macro_rules! ops {
    ($($(#[$doc:meta])* $method:ident => $name:ident { $($field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Copy, Debug)]
            #[allow(missing_docs)]
            pub struct $name {
                $(pub $field: $ty),*
            }

            impl From<$name> for Op {
                fn from(o: $name) -> Op {
                    Op::$name(o)
                }
            }
        )*

        /// Any op of the backend, as a value.
        #[derive(Clone, Copy, Debug)]
        #[allow(missing_docs)]
        pub enum Op {
            $($name($name)),*
        }

        impl Op {
            /// The op's name (its [`Kernels`] method's).
            #[cfg(feature = "tools")]
            pub fn name(&self) -> &'static str {
                match self {
                    $(Op::$name(_) => stringify!($method)),*
                }
            }

            /// The arena regions of its arguments, in order (what a wrapper that counts an
            /// op's traffic reads when it has no model of the op's own).
            #[cfg(feature = "tools")]
            pub fn regions(&self) -> Vec<Buf> {
                let mut out = Vec::new();
                match self {
                    $(Op::$name(o) => { $(Regions::push(&o.$field, &mut out);)* })*
                }
                out
            }

            /// Computes the op on `k`.
            pub fn apply<K: Kernels + ?Sized>(self, k: &mut K) {
                match self {
                    $(Op::$name(o) => k.$method(o)),*
                }
            }
        }

        /// The ops a backend computes, one method per op taking the op's struct: what
        /// [`Op::apply`] calls.
        pub trait Kernels {
            $(
                #[doc = concat!("[`", stringify!($name), "`].")]
                fn $method(&mut self, o: $name);
            )*
        }
    };
}

ops! {
    /// `dst = value`.
    fill => Fill { dst: Buf, value: f64 }
    /// `dst = src`.
    copy => CopyBuf { dst: Buf, src: Buf }
    /// `dst *= a`.
    scale => Scale { dst: Buf, a: f64 }
    /// `dst[0] += sum(src)` on the device (the micro-batches' losses summed with no host read;
    /// the step reads the total once).
    sum_into => SumInto { src: Buf, dst: Buf }
    /// `clip_grad_norm_` on the device: `norm[0] = sqrt(sum(g^2))`, then `g *= max / (norm +
    /// 1e-6)` when that factor is below 1.
    clip_norm => ClipNorm { g: Buf, max: f64, norm: Buf }
    /// `C = alpha op(A) op(B) + beta C` (`beta = 0`: `C` is not read).
    gemm => Gemm { c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64 }
    /// `count` independent products `C_i = alpha op(A_i) op(B_i) + beta C_i`, operand `i`
    /// starting `i * stride` elements after the view given (`strides = [c, a, b]`): the
    /// per-document LoRA adapters' products, one per batch row. The CPU backend runs them one
    /// by one ([`GemmBatched::each`]); the GPU backend runs one strided-batched cuBLASLt call.
    gemm_batched => GemmBatched { c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64, count: usize, strides: [usize; 3] }
    /// `out[n] = table[i[n]]` (`dim`-wide rows), `i` the micro-batch's inputs or their
    /// BigramHash buckets.
    embedding_fwd => EmbeddingFwd { table: Buf, out: Buf, dim: usize, ids: Ids }
    /// `dtable[i[n]] += dout[n]`, each row's sum in token order.
    embedding_bwd => EmbeddingBwd { dout: Buf, dtable: Buf, dim: usize, ids: Ids }
    /// Row RMS norm: `r = sqrt(mean(x^2) + eps)`, `out = scale x / r`, `rstd = 1 / r` per row.
    rms_norm_fwd => RmsNormFwd { x: Buf, out: Buf, rstd: Buf, cols: usize, scale: f64, eps: f64 }
    /// A residual sum and the RMS norm of it in one pass: `u` as [`ResidMixFwd`] or
    /// [`ScaleAddFwd`] writes it (`kind`; `x0` the mix's or the scaled add's second input),
    /// then [`RmsNormFwd`] of `u` into `out` and `rstd`, bit for bit the two ops' results (the
    /// norm reads `u` as stored), with one read of `u` and one launch fewer.
    mix_norm_fwd => MixNormFwd { h: Buf, x0: Buf, mix: Buf, kind: MixKind, u: Buf, out: Buf, rstd: Buf, scale: f64, eps: f64 }
    /// Backward of [`RmsNormFwd`]: `dx (+)= scale (dy / r - x sum(dy x) / (cols r^3))`.
    rms_norm_bwd => RmsNormBwd { x: Buf, rstd: Buf, dy: Buf, dx: Buf, cols: usize, scale: f64, accumulate: bool }
    /// `out = h mix[0] + x0 mix[1]` (`mix`: `(2, cols)`).
    resid_mix_fwd => ResidMixFwd { h: Buf, x0: Buf, mix: Buf, out: Buf }
    /// Backward of [`ResidMixFwd`]: `dh = du mix[0]`, `dx0 += du mix[1]`,
    /// `dmix[0] += colsum(du h)`, `dmix[1] += colsum(du x0)`.
    resid_mix_bwd => ResidMixBwd { du: Buf, h: Buf, x0: Buf, mix: Buf, dh: Buf, dx0: Buf, dmix: Buf }
    /// `out = base + x s` per channel (`out` may be `base`: in place).
    scale_add_fwd => ScaleAddFwd { base: Buf, x: Buf, s: Buf, out: Buf }
    /// [`RmsNormBwd`] accumulating into the stream's gradient `g`, then [`ScaleAddBwd`] of the
    /// updated `g`, in one pass: `g += scale (dn / r - x sum(dn x) / (cols r^3))`, `dx = g s`,
    /// `ds += colsum(g a)` (`a` the scaled add's `x`; `cols = s.len`).
    norm_scale_bwd => NormScaleBwd { x: Buf, rstd: Buf, dn: Buf, g: Buf, scale: f64, a: Buf, s: Buf, dx: Buf, ds: Buf }
    /// [`RmsNormBwd`] into `du` (written, or added to with `accumulate`), then [`ResidMixBwd`]
    /// of `du`, in one pass: `dh = du mix[0]`, `dx0 += du mix[1]`, `dmix[0] += colsum(du h)`,
    /// `dmix[1] += colsum(du x0)` (`cols = mix.len / 2`).
    norm_mix_bwd => NormMixBwd { x: Buf, rstd: Buf, dn: Buf, du: Buf, scale: f64, accumulate: bool, h: Buf, x0: Buf, mix: Buf, dh: Buf, dx0: Buf, dmix: Buf }
    /// Backward of the `x s` term: `dx = dy s`, `ds += colsum(dy x)` (the base's gradient is
    /// `dy` itself, which the schedule keeps).
    scale_add_bwd => ScaleAddBwd { dy: Buf, x: Buf, s: Buf, dx: Buf, ds: Buf }
    /// The U-Net skip into decoder position `j`: `out = h + w s`, or with a gate row `z`,
    /// `out = k + sigmoid(z) (h - k)` with `k = w s`.
    skip_fwd => SkipFwd { h: Buf, s: Buf, w: Buf, z: Option<Buf>, out: Buf }
    /// Backward of [`SkipFwd`]: `dh = dy` (or `g dy`), `ds = w dk` (`dk = dy` or
    /// `(1 - g) dy`), both written; `dw += colsum(dk s)`, `dz += colsum(dy (h - k)) g (1 - g)`.
    skip_bwd => SkipBwd { dy: Buf, h: Buf, s: Buf, w: Buf, z: Option<(Buf, Buf)>, dh: Buf, ds: Buf, dw: Buf }
    /// Per-head RMS norm, RoPE of the first `rot` dims and an optional per-head gain, of the
    /// `(rows, heads d)` view `x` into contiguous `out`; `rstd` gets `1 / r` per (row, head).
    qk_norm_rope_fwd => QkNormRopeFwd { x: Mat, out: Buf, rstd: Buf, gain: Option<Buf>, cos: Buf, sin: Buf, s: HeadShape, eps: f64 }
    /// Backward of [`QkNormRopeFwd`] into the view `dx` (written), `dgain +=`.
    qk_norm_rope_bwd => QkNormRopeBwd { x: Mat, rstd: Buf, dy: Buf, dx: Mat, gain: Option<(Buf, Buf)>, cos: Buf, sin: Buf, s: HeadShape }
    /// Causal GQA attention of token-major `q` `(N, H d)`, `k`, `v` `(N, K d)` views into `out`
    /// `(N, H d)`, scale `1/sqrt(d)`; under `s.docs` each position sees only the keys of its own
    /// document (from the micro-batch's ids).
    attention_fwd => AttentionFwd { q: Mat, k: Mat, v: Mat, out: Buf, s: AttnShape }
    /// Backward of [`AttentionFwd`] (probabilities recomputed): `dq`, `dk` written,
    /// `dv` (a view of the fused qkv gradient) written or, with `dv_acc`, added to (exclusive
    /// self-attention wrote its part first).
    attention_bwd => AttentionBwd { q: Mat, k: Mat, v: Mat, out: Buf, dout: Buf, dq: Mat, dk: Mat, dv: Mat, dv_acc: bool, s: AttnShape }
    /// Exclusive self-attention: `out = y - (y . v^) v^` per query head, `v^` the unit value
    /// vector of the token's KV head.
    xsa_fwd => XsaFwd { y: Buf, v: Mat, out: Buf, s: AttnShape }
    /// Backward of [`XsaFwd`]: `dy` and `dv` (a view of the qkv gradient) written.
    xsa_bwd => XsaBwd { dout: Buf, y: Buf, v: Mat, dy: Buf, dv: Mat, s: AttnShape }
    /// SmearGate (the 04-27 record; [`crate::model::ops::smear_gate`]) on the `cols`-wide
    /// embedding rows `e` of the micro-batch, sequences of `t`: `out_r = e_r + g_r e_{r-1}` with
    /// `g_r = lambda sigmoid(w . e_r[:W])` (`W = w.len`), `g_r = 0` at a sequence's first position
    /// and where the input id is `bos` (the BOS fix).
    smear_fwd => SmearFwd { e: Buf, w: Buf, lambda: Buf, out: Buf, cols: usize, t: usize, bos: u32 }
    /// Backward of [`SmearFwd`]: `de_r = dout_r + g_{r+1} dout_{r+1} + [c < W] dz_r w`
    /// (written), `dw += sum_r dz_r e_r[:W]`, `dlambda += sum_r (dout_r . e_{r-1}) sigmoid_r`,
    /// with `dz_r = (dout_r . e_{r-1}) lambda s_r (1 - s_r)` where `g_r` is not forced to 0.
    smear_bwd => SmearBwd { dout: Buf, e: Buf, w: Buf, lambda: Buf, de: Buf, dw: Buf, dlambda: Buf, cols: usize, t: usize, bos: u32 }
    /// The sparse attention-output gate (the 04-27 record; [`crate::model::ops::attn_gate`]):
    /// `out[n, h] = sigmoid(scale w[h] . x[n]) y[n, h]` for the `heads` heads of the `(N, H d)`
    /// rows `y`, `x` the `(N, W)` view of the gate's input, `w` `(H, W)`.
    attn_gate_fwd => AttnGateFwd { y: Buf, x: Mat, w: Buf, out: Buf, heads: usize, scale: f64 }
    /// Backward of [`AttnGateFwd`]: `dy = g dout` and `dz[n, h] = scale g (1 - g)
    /// (dout[n, h] . y[n, h])`, both written (the schedule turns `dz` into the gradients of `w`
    /// and `x` with two GEMMs).
    attn_gate_bwd => AttnGateBwd { dout: Buf, y: Buf, x: Mat, w: Buf, dy: Buf, dz: Buf, heads: usize, scale: f64 }
    /// The two-lane decoder's mix (the 04-27 record; [`crate::model::ops::lanes`]): for `k` in
    /// 0, 1, `out[k] = r[k] l[k] + p[0, k] sa ao + p[1, k] sm mo`. `l[0]` and `l[1]` may be one
    /// buffer (the lanes' first block).
    lanes_fwd => LanesFwd { l: [Buf; 2], ao: Buf, mo: Buf, w: LaneBufs, out: [Buf; 2] }
    /// Backward of [`LanesFwd`] from the lanes' gradients `g`: `dl[k] = r[k] g[k]`,
    /// `dao = sa dA`, `dmo = sm dM` written (`dA = p[0, 0] g[0] + p[0, 1] g[1]`, `dM` alike);
    /// the parameters' gradients `dw` added to.
    lanes_bwd => LanesBwd { g: [Buf; 2], l: [Buf; 2], ao: Buf, mo: Buf, w: LaneBufs, dl: [Buf; 2], dao: Buf, dmo: Buf, dw: LaneBufs }
    /// `out = leaky_relu(pre, slope)^2`.
    act_fwd => ActFwd { pre: Buf, out: Buf, a: Activation }
    /// `dpre = dout 2 l(pre) l'(pre)` with `l(x) = max(x, slope x)`.
    act_bwd => ActBwd { pre: Buf, dout: Buf, dpre: Buf, a: Activation }
    /// The soft-capped cross-entropy of `(rows, vocab)` logits against the micro-batch's
    /// targets, fused with its gradient: `losses[n]` gets row `n`'s loss and the logits are
    /// overwritten by `grad_scale d loss[n] / d logits[n]`.
    softcap_ce => SoftcapCe { logits: Buf, losses: Buf, vocab: usize, cap: f64, grad_scale: f64 }
    /// `p = p (1 - lr wd)` then the Adam update with moments `m`, `v` (see [`AdamStep`]).
    adam => Adam { p: Buf, g: Buf, m: Buf, v: Buf, s: AdamStep }
    /// Muon's momentum: `buf = mu buf + g`; `u = g + mu buf` (Nesterov) or `buf`.
    momentum => Momentum { g: Buf, buf: Buf, u: Buf, mu: f64, nesterov: bool }
    /// `y = a x + b y`.
    axpby => Axpby { a: f64, x: Buf, b: f64, y: Buf }
    /// Each `cols`-wide row of `x` scaled to unit L2 norm (floored at `eps`), in place.
    row_normalize => RowNormalize { x: Buf, cols: usize, eps: f64 }
    /// The Frobenius norm of each of `count` consecutive matrices of `len` elements of `x`,
    /// plus `eps`, then each divided by it, in place.
    normalize_each => NormalizeEach { x: Buf, count: usize, eps: f64 }
    /// Each of `count` stored `(rows, cols)` matrices of `src` transposed into `dst`.
    transpose_each => TransposeEach { src: Buf, dst: Buf, count: usize, rows: usize, cols: usize }
}

impl MixNormFwd {
    /// The rows' width: the mix's or the scale's channels.
    pub fn cols(&self) -> usize {
        match self.kind {
            MixKind::Resid => self.mix.len / 2,
            MixKind::Scale => self.mix.len,
        }
    }
}

impl GemmBatched {
    /// The batch's products one by one.
    pub fn each(self) -> impl Iterator<Item = Gemm> {
        let GemmBatched { c, a, b, alpha, beta, count, strides } = self;
        (0..count).map(move |i| {
            let at = |m: Mat, k: usize| Mat { off: m.off + i * strides[k], ..m };
            Gemm { c: at(c, 0), a: at(a, 1), b: at(b, 2), alpha, beta }
        })
    }
}

/// The arena regions an op's argument names (none for a scalar or a shape).
#[cfg(feature = "tools")]
trait Regions {
    /// Appends them to `out`.
    fn push(&self, _out: &mut Vec<Buf>) {}
}

#[cfg(feature = "tools")]
impl Regions for Buf {
    fn push(&self, out: &mut Vec<Buf>) {
        out.push(*self);
    }
}

#[cfg(feature = "tools")]
impl Regions for Mat {
    fn push(&self, out: &mut Vec<Buf>) {
        out.push(self.span());
    }
}

#[cfg(feature = "tools")]
impl<R: Regions> Regions for Option<R> {
    fn push(&self, out: &mut Vec<Buf>) {
        if let Some(r) = self {
            r.push(out);
        }
    }
}

#[cfg(feature = "tools")]
impl<A: Regions, B: Regions> Regions for (A, B) {
    fn push(&self, out: &mut Vec<Buf>) {
        self.0.push(out);
        self.1.push(out);
    }
}

#[cfg(feature = "tools")]
impl<R: Regions, const N: usize> Regions for [R; N] {
    fn push(&self, out: &mut Vec<Buf>) {
        self.iter().for_each(|r| r.push(out));
    }
}

#[cfg(feature = "tools")]
impl Regions for LaneBufs {
    fn push(&self, out: &mut Vec<Buf>) {
        out.extend([self.sa, self.sm, self.r, self.p]);
    }
}

#[cfg(feature = "tools")]
impl Regions for Ids {}
#[cfg(feature = "tools")]
impl Regions for MixKind {}
#[cfg(feature = "tools")]
impl Regions for f64 {}
#[cfg(feature = "tools")]
impl Regions for usize {}
#[cfg(feature = "tools")]
impl Regions for u32 {}
#[cfg(feature = "tools")]
impl Regions for bool {}
#[cfg(feature = "tools")]
impl Regions for HeadShape {}
#[cfg(feature = "tools")]
impl Regions for AttnShape {}
#[cfg(feature = "tools")]
impl Regions for Activation {}
#[cfg(feature = "tools")]
impl Regions for AdamStep {}
