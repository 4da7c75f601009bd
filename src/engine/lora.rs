//! Per-document LoRA adapters on the engine (phased TTT, spec 5.4): where they live in the
//! arena ([`LoraLayout`]) and the products the schedule adds at each site, forward and
//! backward. The adapters are the candle model's ([`crate::model::lora`]), stored alike so that
//! a set made there uploads as it is: per slot (position of the layer sequence) and site
//! (q, k, v, o, mlp) and for the head, `A^T` `[docs, in, r]` and `B^T` `[docs, r, out]`.
//!
//! ```text
//! forward, per batch row b (document b), rows b·T .. (b+1)·T of x and y:
//!   h_b = x_b A_b                      (T, r), kept
//!   y_b += s h_b B_b                   s = alpha / r (or 1)
//! backward from dy (the gradient of y), the base frozen:
//!   dB_b += s h_b^T dy_b
//!   dh_b  = s dy_b B_b^T
//!   dA_b += x_b^T dh_b
//!   dx_b += dh_b A_b^T                 (into the gradient of the site's input)
//! ```
//!
//! Each product is one strided-batched GEMM over the batch rows
//! ([`Backend::gemm_batched`]). Where each site reads and adds (the candle model's
//! attachment): q, k, v read the normed block input `n1` and add to their projections before
//! the q/k norm; o reads `n1` and adds to the attention's output projection; mlp reads the
//! MLP's normed input and adds to its output before `mlp_scale`; the head reads the
//! final-normed stream and adds to the logits before the soft-cap.
//!
//! The values sit at the end of the parameter region (so that a GPU backend's bf16 copy of
//! the weights holds them for its GEMMs), their gradients likewise in the gradient region,
//! AdamW's two moments in the optimizer region: one flat AdamW over the whole of it is one
//! AdamW per document, as the batched tensors are.

use super::backend::{Backend, Buf, Mat};
use super::layout::{ALIGN, LoraShape};
use super::schedule::Schedule;
use crate::model::ModelConfig;
use crate::model::lora::Site;

/// How the passes go through the adapters ([`Schedule::set_lora`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraOn {
    /// The output scale `s` (`alpha / r`, or 1).
    pub scale: f64,
    /// The document of the pass's first row: row `b` goes through document `first_doc + b`'s
    /// adapters (a pass over the documents that have a chunk, when they are the last ones).
    pub first_doc: usize,
}

/// One batched adapter's buffers (`docs` documents, `in -> out` at rank `r`).
#[derive(Clone, Copy, Debug)]
pub struct LoraBufs {
    /// Input width.
    pub inp: usize,
    /// Output width.
    pub out: usize,
    /// `A^T` `[docs, in, r]`.
    pub a: Buf,
    /// `B^T` `[docs, r, out]`.
    pub b: Buf,
    /// `A`'s gradient.
    pub da: Buf,
    /// `B`'s gradient.
    pub db: Buf,
    /// `h = x A` of the last forward pass `(N, r)`.
    pub h: Buf,
}

/// The adapters' buffers in the arena.
#[derive(Clone, Debug)]
pub struct LoraLayout {
    /// Documents and rank.
    pub shape: LoraShape,
    /// Every value (one region at the end of the parameters), in the candle adapters' order.
    pub values: Buf,
    /// Every gradient, laid out as `values`.
    pub grads: Buf,
    /// AdamW's first moments, laid out as `values`.
    pub m: Buf,
    /// AdamW's second moments.
    pub v: Buf,
    /// Per position of the longest layer sequence, the adapters in [`Site::ALL`] order.
    pub slots: Vec<[LoraBufs; 5]>,
    /// The head's adapter.
    pub head: LoraBufs,
    /// `dh` of the adapter being differentiated `(N, r)` (scratch).
    pub dh: Buf,
}

/// The adapters' sizes, before their places are known ([`super::layout::Layout::sized`]).
pub(super) struct Plan {
    shape: LoraShape,
    /// `(in, out)` per adapter: the slots' in [`Site::ALL`] order, then the head's.
    dims: Vec<(usize, usize)>,
}

impl Plan {
    /// Adapters of `shape` for every position of `cfg`'s longest (looped) layer sequence.
    pub(super) fn new(cfg: &ModelConfig, shape: LoraShape) -> Self {
        let slots = cfg.layer_sequence(true).len().max(cfg.layer_sequence(false).len());
        let mut dims: Vec<(usize, usize)> = (0..slots).flat_map(|_| Site::ALL.map(|s| s.dims(cfg))).collect();
        dims.push((cfg.model_dim, cfg.vocab_size));
        Plan { shape, dims }
    }

    /// The rank.
    pub(super) fn rank(&self) -> usize {
        self.shape.rank
    }

    /// One entry per adapter.
    pub(super) fn adapters(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.dims.iter().copied()
    }

    /// Each adapter's A and B offsets within the values (each on [`ALIGN`]), and their length.
    fn offsets(&self) -> (Vec<(usize, usize)>, usize) {
        let (docs, r) = (self.shape.docs, self.shape.rank);
        let mut at = 0;
        let mut out = Vec::with_capacity(self.dims.len());
        for &(i, o) in &self.dims {
            let a = at;
            let b = (a + docs * i * r).next_multiple_of(ALIGN);
            at = (b + docs * r * o).next_multiple_of(ALIGN);
            out.push((a, b));
        }
        (out, at)
    }

    /// Elements of the values (and of the gradients, and of each moment).
    pub(super) fn len(&self) -> usize {
        self.offsets().1
    }

    /// The layout, from its regions: the values' and gradients', the two moments, each
    /// adapter's `h` and the `dh` scratch.
    pub(super) fn place(self, (values, grads): (Buf, Buf), (m, v): (Buf, Buf), h: Vec<Buf>, dh: Buf) -> LoraLayout {
        let (docs, r) = (self.shape.docs, self.shape.rank);
        let (offs, _) = self.offsets();
        let mut all: Vec<LoraBufs> = offs
            .iter()
            .zip(&self.dims)
            .zip(h)
            .map(|((&(a, b), &(inp, out)), h)| LoraBufs {
                inp,
                out,
                a: values.sub(a, docs * inp * r),
                b: values.sub(b, docs * r * out),
                da: grads.sub(a, docs * inp * r),
                db: grads.sub(b, docs * r * out),
                h,
            })
            .collect();
        let head = all.pop().expect("the head's adapter");
        let slots = all.chunks_exact(5).map(|c| [c[0], c[1], c[2], c[3], c[4]]).collect();
        LoraLayout { shape: self.shape, values, grads, m, v, slots, head, dh }
    }
}

impl LoraLayout {
    /// Every adapter with its name as the candle adapters call it (`lora.{slot}.{site}.a`,
    /// `lora.head.b`): `(name, buffer, [docs, rows, cols])`, for the first `slots` positions.
    pub fn named(&self, slots: usize) -> Vec<(String, Buf, [usize; 3])> {
        let (docs, r) = (self.shape.docs, self.shape.rank);
        let mut out = Vec::new();
        let mut push = |name: String, ad: &LoraBufs| {
            out.push((format!("{name}.a"), ad.a, [docs, ad.inp, r]));
            out.push((format!("{name}.b"), ad.b, [docs, r, ad.out]));
        };
        for (i, set) in self.slots.iter().take(slots).enumerate() {
            for (site, ad) in Site::ALL.iter().zip(set) {
                push(format!("lora.{i}.{}", site.name()), ad);
            }
        }
        push("lora.head".to_string(), &self.head);
        out
    }
}

impl Schedule {
    /// Position `pos`'s adapter at `site`, when the passes go through adapters.
    pub(super) fn adapter(&self, pos: usize, site: Site) -> Option<LoraBufs> {
        self.lora?;
        let l = self.layout.lora.as_ref()?;
        let i = Site::ALL.iter().position(|s| *s == site).expect("a site");
        Some(l.slots[pos][i])
    }

    /// The head's adapter, when the passes go through adapters.
    pub(super) fn head_adapter(&self) -> Option<LoraBufs> {
        self.lora?;
        self.layout.lora.as_ref().map(|l| l.head)
    }

    /// `y += s (x A) B` per batch row, keeping `h = x A`: `x` the adapter's `(N, in)` input,
    /// `y` its `(N, out)` output (a view: the query columns of the fused product).
    pub(super) fn lora_fwd(&self, be: &mut dyn Backend, ad: LoraBufs, x: Buf, y: Mat) {
        let (rows, t, r) = (self.layout.rows, self.layout.t, self.rank());
        let LoraOn { scale: s, first_doc: d0 } = self.lora.expect("a LoRA pass");
        let (xr, hr, yr) = (x.mat(rows * t, ad.inp).rows(0, t), ad.h.mat(rows * t, r).rows(0, t), y.rows(0, t));
        let (ar, br) = (self.lora_a(ad).rows(d0 * ad.inp, ad.inp), self.lora_b(ad).rows(d0 * r, r));
        let (sx, sh, sy) = (t * ad.inp, t * r, t * y.ld);
        be.gemm_batched(hr, xr, ar, 1.0, 0.0, rows, [sh, sx, ad.inp * r]);
        be.gemm_batched(yr, hr, br, s, 1.0, rows, [sy, sh, r * ad.out]);
    }

    /// The backward pass of [`Schedule::lora_fwd`] from `dy`: the adapter's gradients
    /// (accumulated), and `dx += dh A^T` into the gradient of its input.
    pub(super) fn lora_bwd(&self, be: &mut dyn Backend, ad: LoraBufs, x: Buf, dy: Mat, dx: Buf) {
        let l = self.layout.lora.as_ref().expect("adapters in the arena");
        let (rows, t, r) = (self.layout.rows, self.layout.t, self.rank());
        let LoraOn { scale: s, first_doc: d0 } = self.lora.expect("a LoRA pass");
        let n = rows * t;
        let (xr, hr, dyr) = (x.mat(n, ad.inp).rows(0, t), ad.h.mat(n, r).rows(0, t), dy.rows(0, t));
        let (dhr, dxr) = (l.dh.mat(n, r).rows(0, t), dx.mat(n, ad.inp).rows(0, t));
        let (ar, br) = (self.lora_a(ad).rows(d0 * ad.inp, ad.inp), self.lora_b(ad).rows(d0 * r, r));
        let docs = l.shape.docs;
        let (dar, dbr) = (ad.da.mat(docs * ad.inp, r).rows(d0 * ad.inp, ad.inp), ad.db.mat(docs * r, ad.out).rows(d0 * r, r));
        let (sx, sh, sy, sa, sb) = (t * ad.inp, t * r, t * dy.ld, ad.inp * r, r * ad.out);
        be.gemm_batched(dbr, hr.t(), dyr, s, 1.0, rows, [sb, sh, sy]);
        be.gemm_batched(dhr, dyr, br.t(), s, 0.0, rows, [sh, sy, sb]);
        be.gemm_batched(dar, xr.t(), dhr, 1.0, 1.0, rows, [sa, sx, sh]);
        be.gemm_batched(dxr, dhr, ar.t(), 1.0, 1.0, rows, [sx, sh, sa]);
    }

    fn rank(&self) -> usize {
        self.layout.lora.as_ref().map_or(0, |l| l.shape.rank)
    }

    fn lora_a(&self, ad: LoraBufs) -> Mat {
        ad.a.mat(ad.a.len / self.rank(), self.rank())
    }

    fn lora_b(&self, ad: LoraBufs) -> Mat {
        ad.b.mat(ad.b.len / ad.out, ad.out)
    }
}
