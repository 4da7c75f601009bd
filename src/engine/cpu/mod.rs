//! The engine's CPU backends: [`CpuBackend<f64>`] for checks (every op in f64, the standard
//! library's `exp` and `tanh`), [`CpuBackend<f32>`] for speed (AVX2 + FMA kernels picked at
//! run time, fast `exp`/`tanh`, rayon across rows). One generic implementation serves both: the
//! element type is the only difference, so the f64 backend checks the very code the f32 one
//! runs.
//!
//! The maths of the model's ops lives once, in [`crate::model::ops`]: the row functions of
//! `rms_norm`, `resid_mix`, `scale_add`, `relu_sq` (both activations), `qk_norm_rope`,
//! `softcap_ce` and `attention` are those the candle model's CPU kernels run; those of
//! `skip_gate`, `xsa` and `embedding` are the row kernels beside the candle composites they are
//! tested against. All are called here on the arena's slices. What is left here is the
//! engine's own glue:
//!
//! - [`gemm`]: matrix products through the `gemm` crate (candle's own CPU GEMM: packed,
//!   register-tiled, AVX2/AVX-512 kernels, rayon), with `beta` and strided views;
//! - [`flat`]: the flat loops (fills, copies, reductions, the optimizers);
//! - the per-channel sums of [`crate::model::ops`] added into the engine's buffers
//!   (`add_into`), and its buffers read as [`Rows`].
//!
//! The arena is one `Vec<T>`; [`CpuBackend::io`] hands out the input and output slices of an
//! op after checking that no output overlaps another region of the call, which is what makes
//! the raw-pointer split sound.

mod flat;
mod gemm;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::backend::{AttnShape, Backend, Buf, check_regions};
use crate::engine::backend::BackendExt;
use crate::engine::op::{self, Kernels, Op};
use crate::model::host::rows::{Rows, add_into, dense_offsets};
use crate::model::host::simd::Real;
use crate::model::ops::qk_norm_rope::{self, RopeRows};
use crate::model::ops::{
    DocRule, DocumentMask, attn_gate, embedding, lanes, relu_sq, resid_mix, rms_norm, scale_add, skip_gate, smear_gate, softcap_ce, xsa,
};

/// The ids an embedding op reads of the micro-batch's `x`: `x` itself, or its BigramHash
/// buckets.
fn read_ids(x: &[u32], ids: op::Ids) -> std::borrow::Cow<'_, [u32]> {
    match ids {
        op::Ids::Tokens => std::borrow::Cow::Borrowed(x),
        op::Ids::Bigram { buckets, t } => std::borrow::Cow::Owned(embedding::bigram_ids(x, t, buckets)),
    }
}

/// The head geometry of the model's XSA row kernels.
fn heads(s: AttnShape) -> xsa::HeadsShape {
    xsa::HeadsShape { heads: s.heads, kv_heads: s.kv_heads, d: s.d }
}

/// A CPU backend over an arena of `T` (`f64`: the check backend; `f32`: the fast one).
pub(crate) struct CpuBackend<T> {
    arena: Vec<T>,
    /// The micro-batch's input ids.
    x: Vec<u32>,
    /// The micro-batch's targets.
    y: Vec<u32>,
    /// The document mask of these ids, made by the first attention call that asks for it
    /// (keyed by BOS id, rows and length) and dropped with the ids.
    docs: Option<((DocRule, usize, usize), Arc<DocumentMask>)>,
}

impl<T: Real> CpuBackend<T> {
    /// A backend with an arena of `len` elements, all zero.
    pub(crate) fn new(len: usize) -> Self {
        Self { arena: vec![T::from_f64(0.0); len], x: Vec::new(), y: Vec::new(), docs: None }
    }

    /// The whole arena (the cuBLASLt plan check of [`crate::engine::lt`] runs its GEMMs on it).
    #[cfg(test)]
    pub(crate) fn arena_mut(&mut self) -> &mut [T] {
        &mut self.arena
    }

    /// The input slices `ins` and the output slices `outs` of one op. Panics when an output
    /// overlaps an input or another output, or a region leaves the arena.
    fn io<const I: usize, const O: usize>(&mut self, ins: [Buf; I], outs: [Buf; O]) -> ([&[T]; I], [&mut [T]; O]) {
        check_regions(self.arena.len(), &ins, &outs);
        let base = self.arena.as_mut_ptr();
        // SAFETY: every region lies inside the arena (checked above); the outputs are disjoint
        // from each other and from the inputs, so no element is reachable through a `&mut` and
        // any other reference; the slices borrow `self` mutably, so the arena outlives them and
        // nothing else touches it meanwhile.
        unsafe {
            let ins = ins.map(|b| &*std::ptr::slice_from_raw_parts(base.add(b.off) as *const T, b.len));
            let outs = outs.map(|b| &mut *std::ptr::slice_from_raw_parts_mut(base.add(b.off), b.len));
            (ins, outs)
        }
    }

    /// The document mask of the micro-batch's ids under `s.docs` (`None` without), made once
    /// per micro-batch.
    fn document_mask(&mut self, s: AttnShape) -> Option<Arc<DocumentMask>> {
        let key = (s.docs?, s.batch, s.t);
        if let Some((k, m)) = &self.docs
            && *k == key
        {
            return Some(m.clone());
        }
        let n = s.batch * s.t;
        assert!(self.x.len() >= n, "a document mask over {} ids for {} x {} positions", self.x.len(), s.batch, s.t);
        let m = Arc::new(DocumentMask::at_token(&self.x[..n], s.t, key.0).expect("the ids form rows of t"));
        self.docs = Some((key, m.clone()));
        Some(m)
    }

    /// The elements of `b`.
    fn get(&self, b: Buf) -> &[T] {
        &self.arena[b.off..b.end()]
    }
}

impl<T: Real> Backend for CpuBackend<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }

    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn len(&self) -> usize {
        self.arena.len()
    }

    fn upload(&mut self, dst: Buf, src: &Tensor) -> anyhow::Result<()> {
        anyhow::ensure!(src.elem_count() == dst.len, "uploading {} elements into a {}-element region", src.elem_count(), dst.len);
        let v: Vec<T> = src.to_device(&Device::Cpu)?.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1()?;
        let ([], [out]) = self.io([], [dst]);
        out.copy_from_slice(&v);
        Ok(())
    }

    fn download(&self, src: Buf, shape: &[usize]) -> anyhow::Result<Tensor> {
        Ok(Tensor::from_slice(self.get(src), shape, &Device::Cpu)?)
    }

    fn set_tokens(&mut self, x: &[u32], y: &[u32]) {
        self.x.clear();
        self.x.extend_from_slice(x);
        self.y.clear();
        self.y.extend_from_slice(y);
        self.docs = None;
    }

    fn sum(&self, src: Buf) -> f64 {
        flat::sum(self.get(src))
    }

    fn sum_sq(&self, src: Buf) -> f64 {
        flat::sum_sq(self.get(src))
    }

    fn all_finite(&self, src: Buf) -> bool {
        self.get(src).iter().all(|x| x.to_f64().is_finite())
    }

    fn run(&mut self, op: Op) {
        op.apply(self)
    }
}

impl<T: Real> Kernels for CpuBackend<T> {
    fn fill(&mut self, op::Fill { dst, value }: op::Fill) {
        let ([], [d]) = self.io([], [dst]);
        flat::fill(d, T::from_f64(value));
    }
    fn copy(&mut self, op::CopyBuf { dst, src }: op::CopyBuf) {
        let ([s], [d]) = self.io([src], [dst]);
        d.copy_from_slice(s);
    }
    fn scale(&mut self, op::Scale { dst, a }: op::Scale) {
        let ([], [d]) = self.io([], [dst]);
        flat::scale(d, T::from_f64(a));
    }
    fn sum_into(&mut self, op::SumInto { src, dst }: op::SumInto) {
        let total = flat::sum(self.get(src));
        let (_, [d]) = self.io([src], [dst.sub(0, 1)]);
        d[0] = T::from_f64(d[0].to_f64() + total);
    }
    fn clip_norm(&mut self, op::ClipNorm { g, max, norm }: op::ClipNorm) {
        let n = flat::sum_sq(self.get(g)).sqrt();
        let (_, [d]) = self.io([g], [norm.sub(0, 1)]);
        d[0] = T::from_f64(n);
        let coef = max / (n + 1e-6);
        if coef < 1.0 {
            self.op(op::Scale { dst: g, a: coef });
        }
    }
    fn gemm(&mut self, op::Gemm { c, a, b, alpha, beta }: op::Gemm) {
        let ([a_s, b_s], [c_s]) = self.io([a.span(), b.span()], [c.span()]);
        gemm::gemm(c, c_s, a, a_s, b, b_s, alpha, beta);
    }
    fn embedding_fwd(&mut self, op::EmbeddingFwd { table, out, dim, ids }: op::EmbeddingFwd) {
        let x = std::mem::take(&mut self.x);
        let ([t], [o]) = self.io([table], [out]);
        embedding::embedding_rows_fwd(t, &read_ids(&x, ids), o, dim);
        self.x = x;
    }
    fn embedding_bwd(&mut self, op::EmbeddingBwd { dout, dtable, dim, ids }: op::EmbeddingBwd) {
        let x = std::mem::take(&mut self.x);
        let ([g], [d]) = self.io([dout], [dtable]);
        let read = read_ids(&x, ids);
        // The micro-batch's first rows (the ids may hold a larger arena's capacity).
        let n = (g.len() / dim.max(1)).min(read.len());
        embedding::embedding_rows_bwd(g, &read[..n], d, dim);
        self.x = x;
    }
    fn rms_norm_fwd(&mut self, op::RmsNormFwd { x, out, rstd, cols, scale, eps }: op::RmsNormFwd) {
        let ([x], [o, r]) = self.io([x], [out, rstd]);
        let offsets = dense_offsets(x.len() / cols, cols);
        rms_norm::forward_rows(Rows { data: x, offsets: &offsets, len: cols }, o, Some(r), scale, eps);
    }
    fn rms_norm_bwd(&mut self, op::RmsNormBwd { x, rstd, dy, dx, cols, scale, accumulate }: op::RmsNormBwd) {
        let ([x, r, g], [d]) = self.io([x, rstd, dy], [dx]);
        let offsets = dense_offsets(x.len() / cols, cols);
        let (x, g) = (Rows { data: x, offsets: &offsets, len: cols }, Rows { data: g, offsets: &offsets, len: cols });
        // `eps` is unused: `r` comes from the saved `rstd`.
        rms_norm::backward_rows(x, g, Some(r), d, scale, 0.0, accumulate);
    }
    fn mix_norm_fwd(&mut self, o: op::MixNormFwd) {
        let (cols, op::MixNormFwd { h, x0, mix, kind, u, out, rstd, scale, eps }) = (o.cols(), o);
        // The two ops' maths, one after the other (on the CPU a fused pass saves nothing).
        match kind {
            op::MixKind::Resid => self.op(op::ResidMixFwd { h, x0, mix, out: u }),
            op::MixKind::Scale => self.op(op::ScaleAddFwd { base: h, x: x0, s: mix, out: u }),
        }
        self.op(op::RmsNormFwd { x: u, out, rstd, cols, scale, eps });
    }
    fn norm_scale_bwd(&mut self, op::NormScaleBwd { x, rstd, dn, g, scale, a, s, dx, ds }: op::NormScaleBwd) {
        self.op(op::RmsNormBwd { x, rstd, dy: dn, dx: g, cols: s.len, scale, accumulate: true });
        self.op(op::ScaleAddBwd { dy: g, x: a, s, dx, ds });
    }
    fn norm_mix_bwd(&mut self, op::NormMixBwd { x, rstd, dn, du, scale, accumulate, h, x0, mix, dh, dx0, dmix }: op::NormMixBwd) {
        self.op(op::RmsNormBwd { x, rstd, dy: dn, dx: du, cols: mix.len / 2, scale, accumulate });
        self.op(op::ResidMixBwd { du, h, x0, mix, dh, dx0, dmix });
    }
    fn resid_mix_fwd(&mut self, op::ResidMixFwd { h, x0, mix, out }: op::ResidMixFwd) {
        let ([h, x0, m], [o]) = self.io([h, x0, mix], [out]);
        resid_mix::forward_rows(h, x0, m, o);
    }
    fn resid_mix_bwd(&mut self, op::ResidMixBwd { du, h, x0, mix, dh, dx0, dmix }: op::ResidMixBwd) {
        let ([g, h, x0, m], [dh, dx0, dm]) = self.io([du, h, x0, mix], [dh, dx0, dmix]);
        // dx0 is added to: the first block's x0 is the embedding's stream too.
        add_into(dm, &resid_mix::backward_rows(g, h, x0, m, dh, dx0, true));
    }
    fn scale_add_fwd(&mut self, op::ScaleAddFwd { base, x, s, out }: op::ScaleAddFwd) {
        if base == out {
            let ([x, s], [o]) = self.io([x, s], [out]);
            scale_add::forward_rows(x, s, o);
        } else {
            let ([b, x, s], [o]) = self.io([base, x, s], [out]);
            o.copy_from_slice(b);
            scale_add::forward_rows(x, s, o);
        }
    }
    fn scale_add_bwd(&mut self, op::ScaleAddBwd { dy, x, s, dx, ds }: op::ScaleAddBwd) {
        let ([g, x, s], [dx, ds]) = self.io([dy, x, s], [dx, ds]);
        add_into(ds, &scale_add::backward_rows(g, x, s, dx));
    }
    fn skip_fwd(&mut self, op::SkipFwd { h, s, w, z, out }: op::SkipFwd) {
        let z = z.unwrap_or_default();
        let ([h, s, w, z], [o]) = self.io([h, s, w, z], [out]);
        skip_gate::skip_rows_fwd(h, s, w, (!z.is_empty()).then_some(z), o);
    }
    fn skip_bwd(&mut self, op::SkipBwd { dy, h, s, w, z, dh, ds, dw }: op::SkipBwd) {
        let (z, dz) = z.unwrap_or_default();
        let ([g, h, s, w, z], [dh, ds, dw, dz]) = self.io([dy, h, s, w, z], [dh, ds, dw, dz]);
        let gate = (!z.is_empty()).then_some((z, dz));
        skip_gate::skip_rows_bwd(g, h, s, w, gate, dh, ds, dw);
    }
    fn qk_norm_rope_fwd(&mut self, op::QkNormRopeFwd { x, out, rstd, gain, cos, sin, s, eps }: op::QkNormRopeFwd) {
        let gain = gain.unwrap_or_default();
        let ([xs, g, c, sn], [o, r]) = self.io([x.span(), gain, cos, sin], [out, rstd]);
        let geo = RopeRows { heads: s.heads, d: s.d, half: s.rot / 2, seq: s.t, eps, cos: c, sin: sn };
        qk_norm_rope::forward_rows(&geo, (xs, x.ld), (!g.is_empty()).then_some(g), o, Some(r));
    }
    fn qk_norm_rope_bwd(&mut self, op::QkNormRopeBwd { x, rstd, dy, dx, gain, cos, sin, s }: op::QkNormRopeBwd) {
        let (g, dg) = gain.unwrap_or_default();
        let ([xs, r, gy, g, c, sn], [dxs, dg]) = self.io([x.span(), rstd, dy, g, cos, sin], [dx.span(), dg]);
        // `eps` is unused: each head's `r` comes from the saved `rstd`.
        let geo = RopeRows { heads: s.heads, d: s.d, half: s.rot / 2, seq: s.t, eps: 0.0, cos: c, sin: sn };
        let gain = (!g.is_empty()).then_some(g);
        let dgain = qk_norm_rope::backward_rows(&geo, s.rows, (xs, x.ld), gy, gain, Some(r), (dxs, dx.ld));
        add_into(dg, &dgain);
    }
    fn attention_fwd(&mut self, op::AttentionFwd { q, k, v, out, s }: op::AttentionFwd) {
        let mask = self.document_mask(s);
        let ([qs, ks, vs], [o]) = self.io([q.span(), k.span(), v.span()], [out]);
        let dims = (s.batch, s.t, s.heads, s.kv_heads, s.d);
        crate::model::ops::attention_token_major_fwd((qs, q.ld), (ks, k.ld), (vs, v.ld), o, dims, mask.as_deref());
    }
    fn attention_bwd(&mut self, op::AttentionBwd { q, k, v, out, dout, dq, dk, dv, dv_acc, s }: op::AttentionBwd) {
        let mask = self.document_mask(s);
        let ([qs, ks, vs, o, g], [dqs, dks, dvs]) = self.io([q.span(), k.span(), v.span(), out, dout], [dq.span(), dk.span(), dv.span()]);
        let dims = (s.batch, s.t, s.heads, s.kv_heads, s.d);
        let grads = crate::model::ops::AttentionGrads { dq: (dqs, dq.ld), dk: (dks, dk.ld), dv: (dvs, dv.ld), dv_acc };
        crate::model::ops::attention_token_major_bwd((qs, q.ld), (ks, k.ld), (vs, v.ld), (o, g), grads, dims, mask.as_deref());
    }
    fn smear_fwd(&mut self, op::SmearFwd { e, w, lambda, out, cols, t, bos }: op::SmearFwd) {
        let ids = std::mem::take(&mut self.x);
        let ([e, w, l], [o]) = self.io([e, w, lambda], [out]);
        // The micro-batch's first rows (the ids may hold a larger arena's capacity).
        let n = e.len() / cols.max(1);
        assert!(n * cols == e.len() && ids.len() >= n, "SmearGate over {n} rows with {} ids", ids.len());
        smear_gate::smear_rows_fwd(e, &ids[..n], w, l[0], o, smear_gate::SmearRows { cols, t, bos });
        self.x = ids;
    }
    fn smear_bwd(&mut self, op::SmearBwd { dout, e, w, lambda, de, dw, dlambda, cols, t, bos }: op::SmearBwd) {
        let ids = std::mem::take(&mut self.x);
        let ([g, e, w, l], [de, dw, dl]) = self.io([dout, e, w, lambda], [de, dw, dlambda]);
        let n = e.len() / cols.max(1);
        assert!(n * cols == e.len() && ids.len() >= n, "SmearGate over {n} rows with {} ids", ids.len());
        smear_gate::smear_rows_bwd(g, e, &ids[..n], w, l[0], de, dw, dl, smear_gate::SmearRows { cols, t, bos });
        self.x = ids;
    }
    fn lanes_fwd(&mut self, op::LanesFwd { l, ao, mo, w, out }: op::LanesFwd) {
        let ([l0, l1, ao, mo, sa, sm, r, p], [o0, o1]) = self.io([l[0], l[1], ao, mo, w.sa, w.sm, w.r, w.p], out);
        lanes::lanes_rows_fwd([l0, l1], ao, mo, lanes::LaneParams { sa, sm, r, p }, [o0, o1]);
    }
    fn lanes_bwd(&mut self, op::LanesBwd { g, l, ao, mo, w, dl, dao, dmo, dw }: op::LanesBwd) {
        let ins = [g[0], g[1], l[0], l[1], ao, mo, w.sa, w.sm, w.r, w.p];
        let ([g0, g1, l0, l1, ao, mo, sa, sm, r, p], [dl0, dl1, dao, dmo, dsa, dsm, dr, dp]) =
            self.io(ins, [dl[0], dl[1], dao, dmo, dw.sa, dw.sm, dw.r, dw.p]);
        let out = lanes::LaneGrads { dl: [dl0, dl1], dao, dmo, dsa, dsm, dr, dp };
        lanes::lanes_rows_bwd([g0, g1], [l0, l1], ao, mo, lanes::LaneParams { sa, sm, r, p }, out);
    }
    fn attn_gate_fwd(&mut self, op::AttnGateFwd { y, x, w, out, heads, scale }: op::AttnGateFwd) {
        let ([ys, xs, ws], [o]) = self.io([y, x.span(), w], [out]);
        let hd = y.len / x.rows / heads;
        attn_gate::attn_gate_rows_fwd(ys, (xs, x.ld), ws, o, (heads, hd), scale);
    }
    fn attn_gate_bwd(&mut self, op::AttnGateBwd { dout, y, x, w, dy, dz, heads, scale }: op::AttnGateBwd) {
        let ([g, ys, xs, ws], [d, z]) = self.io([dout, y, x.span(), w], [dy, dz]);
        let hd = y.len / x.rows / heads;
        attn_gate::attn_gate_rows_bwd(g, ys, (xs, x.ld), ws, d, z, (heads, hd), scale);
    }
    fn xsa_fwd(&mut self, op::XsaFwd { y, v, out, s }: op::XsaFwd) {
        let ([y, vs], [o]) = self.io([y, v.span()], [out]);
        xsa::xsa_rows_fwd(y, (vs, v.ld), o, heads(s));
    }
    fn xsa_bwd(&mut self, op::XsaBwd { dout, y, v, dy, dv, s }: op::XsaBwd) {
        let ([g, y, vs], [dy, dvs]) = self.io([dout, y, v.span()], [dy, dv.span()]);
        xsa::xsa_rows_bwd(g, y, (vs, v.ld), dy, (dvs, dv.ld), heads(s));
    }
    fn act_fwd(&mut self, op::ActFwd { pre, out, a }: op::ActFwd) {
        let ([p], [o]) = self.io([pre], [out]);
        relu_sq::forward_elems(p, o, Some(T::from_f64(a.slope)));
    }
    fn act_bwd(&mut self, op::ActBwd { pre, dout, dpre, a }: op::ActBwd) {
        let ([p, g], [d]) = self.io([pre, dout], [dpre]);
        relu_sq::backward_elems(p, g, d, Some(T::from_f64(a.slope)));
    }
    fn softcap_ce(&mut self, op::SoftcapCe { logits, losses, vocab, cap, grad_scale }: op::SoftcapCe) {
        let y = std::mem::take(&mut self.y);
        let ([], [l, out]) = self.io([], [logits, losses]);
        softcap_ce::fused_rows(l, &y, out, vocab, cap, grad_scale);
        self.y = y;
    }
    fn adam(&mut self, op::Adam { p, g, m, v, s }: op::Adam) {
        let ([g], [p, m, v]) = self.io([g], [p, m, v]);
        flat::adam(p, g, m, v, s);
    }
    fn momentum(&mut self, op::Momentum { g, buf, u, mu, nesterov }: op::Momentum) {
        let ([g], [b, u]) = self.io([g], [buf, u]);
        flat::momentum(g, b, u, T::from_f64(mu), nesterov);
    }
    fn axpby(&mut self, op::Axpby { a, x, b, y }: op::Axpby) {
        let ([x], [y]) = self.io([x], [y]);
        flat::axpby(T::from_f64(a), x, T::from_f64(b), y);
    }
    fn row_normalize(&mut self, op::RowNormalize { x, cols, eps }: op::RowNormalize) {
        let ([], [x]) = self.io([], [x]);
        flat::row_normalize(x, cols, eps);
    }
    fn normalize_each(&mut self, op::NormalizeEach { x, count, eps }: op::NormalizeEach) {
        let ([], [x]) = self.io([], [x]);
        flat::normalize_each(x, count, eps);
    }
    fn transpose_each(&mut self, op::TransposeEach { src, dst, count, rows, cols }: op::TransposeEach) {
        let ([s], [d]) = self.io([src], [dst]);
        flat::transpose_each(s, d, count, rows, cols);
    }

    fn gemm_batched(&mut self, o: op::GemmBatched) {
        for g in o.each() {
            self.gemm(g);
        }
    }
}
