//! Per-document LoRA adapters on the engine (phased TTT, spec 5.4): where they live in the
//! arena ([`LoraLayout`]) and the products the schedule adds at each site, forward and
//! backward. The adapters are the candle model's ([`crate::model::lora`]), stored alike so that
//! a set made there uploads as it is: per slot (position of the layer sequence) and site
//! (q, k, v, o, mlp) and for the head, `A^T` `[docs, in, r]` and `B^T` `[docs, r, out]`.
//!
//! ```text
//! forward, per batch row b (document first_doc + b), rows b·T .. (b+1)·T of x and y:
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
//! ([`crate::engine::op::GemmBatched`]; the schedule's side is `lora_ops.rs`). Where each site reads and adds (the candle model's
//! attachment): q, k, v read the normed block input `n1` and add to their projections before
//! the q/k norm; o reads `n1` and adds to the attention's output projection; mlp reads the
//! MLP's normed input and adds to its output before `mlp_scale`; the head reads the
//! final-normed stream and adds to the logits before the soft-cap.
//!
//! The values sit at the end of the parameter region (so that a GPU backend's bf16 copy of
//! the weights holds them for its GEMMs), their gradients likewise in the gradient region,
//! AdamW's two moments in the optimizer region: one flat AdamW over the whole of it is one
//! AdamW per document, as the batched tensors are.

use super::backend::Buf;
use crate::model::ModelConfig;
use crate::model::lora::Site;

/// Per-document LoRA adapters: one set per document (batch row) at rank `rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraShape {
    /// Documents (the most rows of a pass through them).
    pub docs: usize,
    /// The adapters' rank.
    pub rank: usize,
}

/// How the passes go through the adapters (the schedule's `set_lora`).
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

/// The adapters' sizes, before their places are known (the layout's `Layout::sized`).
pub(super) struct Plan {
    shape: LoraShape,
    /// Elements each A and B starts on a multiple of.
    align: usize,
    /// `(in, out)` per adapter: the slots' in [`Site::ALL`] order, then the head's.
    dims: Vec<(usize, usize)>,
}

impl Plan {
    /// Adapters of `shape` for every position of `cfg`'s longest (looped) layer sequence, each
    /// A and B starting on a multiple of `align` elements.
    pub(super) fn new(cfg: &ModelConfig, shape: LoraShape, align: usize) -> Self {
        let slots = cfg.layer_sequence(true).len().max(cfg.layer_sequence(false).len());
        let mut dims: Vec<(usize, usize)> = (0..slots).flat_map(|_| Site::ALL.map(|s| s.dims(cfg))).collect();
        dims.push((cfg.model_dim, cfg.vocab_size));
        Plan { shape, align, dims }
    }

    /// The rank.
    pub(super) fn rank(&self) -> usize {
        self.shape.rank
    }

    /// One entry per adapter.
    pub(super) fn adapters(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.dims.iter().copied()
    }

    /// Each adapter's A and B offsets within the values (each aligned), and their length.
    fn offsets(&self) -> (Vec<(usize, usize)>, usize) {
        let (docs, r) = (self.shape.docs, self.shape.rank);
        let mut at = 0;
        let mut out = Vec::with_capacity(self.dims.len());
        for &(i, o) in &self.dims {
            let a = at;
            let b = (a + docs * i * r).next_multiple_of(self.align);
            at = (b + docs * r * o).next_multiple_of(self.align);
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
