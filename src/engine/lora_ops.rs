//! The schedule's side of the per-document LoRA adapters ([`super::lora`]): which adapter a
//! site of a position goes through, and its products forward and backward, each one
//! strided-batched GEMM over the pass's rows (the maths is in [`super::lora`]'s module doc).

use super::backend::{Backend, Buf, Mat};
use super::lora::{LoraBufs, LoraOn};
use super::schedule::Schedule;
use crate::engine::backend::BackendExt;
use crate::engine::op;
use crate::model::lora::Site;

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
        be.op(op::GemmBatched { c: hr, a: xr, b: ar, alpha: 1.0, beta: 0.0, count: rows, strides: [sh, sx, ad.inp * r] });
        be.op(op::GemmBatched { c: yr, a: hr, b: br, alpha: s, beta: 1.0, count: rows, strides: [sy, sh, r * ad.out] });
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
        be.op(op::GemmBatched { c: dbr, a: hr.t(), b: dyr, alpha: s, beta: 1.0, count: rows, strides: [sb, sh, sy] });
        be.op(op::GemmBatched { c: dhr, a: dyr, b: br.t(), alpha: s, beta: 0.0, count: rows, strides: [sh, sy, sb] });
        be.op(op::GemmBatched { c: dar, a: xr.t(), b: dhr, alpha: 1.0, beta: 1.0, count: rows, strides: [sa, sx, sh] });
        be.op(op::GemmBatched { c: dxr, a: dhr, b: ar.t(), alpha: 1.0, beta: 1.0, count: rows, strides: [sx, sh, sa] });
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
