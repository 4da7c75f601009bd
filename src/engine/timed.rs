//! Per-op timing of a backend: [`Timed`] wraps any [`Backend`], runs each op on it at once
//! (units of work are not opened: every op is launched as it comes, so that it can be timed
//! alone) and records, per op call, its name, its shape, the bytes it moves at least (each
//! region it reads or writes once) and its FLOPs (GEMMs and attention), and its time: device
//! time between two CUDA events on a GPU ([`Backend::timing_mark`]), the host's clock on a
//! backend whose ops run as they come. `pipeline engine-check` runs a micro-batch and an
//! optimizer step through it at the baseline's shapes and prints the table.
//!
//! The times are resolved (which waits for the device) when the host next reads from the
//! backend ([`Backend::download`], a reduction), and at [`Timed::resolve`].

#[cfg(feature = "tools")]
use std::sync::{Arc, Mutex};
#[cfg(feature = "tools")]
use std::time::Instant;

#[cfg(feature = "tools")]
use candle_core::{DType, Tensor};

#[cfg(feature = "tools")]
use super::backend::{Activation, AdamStep, AttnShape, Backend, Buf, GraphCounts, HeadShape, LaneBufs, Mat, Tokens};

/// One op call's time.
#[derive(Clone, Debug, serde::Serialize)]
#[cfg(feature = "tools")]
pub struct OpTime {
    /// The [`Backend`] method.
    pub op: &'static str,
    /// Its shape (`rows x cols`, a GEMM's `m x n x k` and operand order).
    pub shape: String,
    /// Bytes of its regions (each read or written once; a lower bound of its traffic).
    pub bytes: f64,
    /// Floating-point operations of its products (GEMMs, attention; 0 for the rest).
    pub flops: f64,
    /// Milliseconds.
    pub ms: f64,
}

/// What an op's time is measured with.
#[cfg(feature = "tools")]
enum Start {
    /// A device timing mark.
    Mark(usize),
    /// The host's clock.
    Host(Instant),
}

/// An op whose time is not read yet.
#[cfg(feature = "tools")]
struct Pending {
    op: &'static str,
    shape: String,
    bytes: f64,
    flops: f64,
    start: Start,
    /// The mark after it (device clock), or its host time.
    end: Result<usize, f64>,
}

/// A backend whose every op is timed (see the module doc).
#[cfg(feature = "tools")]
pub struct Timed {
    inner: Box<dyn Backend>,
    pending: Mutex<Vec<Pending>>,
    log: Arc<Mutex<Vec<OpTime>>>,
}

#[cfg(feature = "tools")]
impl Timed {
    /// Bytes per element of `b`: 2 inside the backend's bf16 region, else the arena's.
    #[cfg(feature = "tools")]
    fn elem(&self, b: Buf) -> f64 {
        match self.inner.half_region() {
            Some(h) if b.off >= h.off && b.end() <= h.end() => 2.0,
            _ => self.inner.dtype().size_in_bytes().min(4) as f64,
        }
    }

    /// Bytes of `bufs`.
    #[cfg(feature = "tools")]
    fn bytes(&self, bufs: &[Buf]) -> f64 {
        bufs.iter().map(|&b| self.elem(b) * b.len as f64).sum::<f64>()
    }

    /// Bytes per element of a GEMM input: 2 with bf16 activations for the activations and for
    /// the weights (read from their bf16 copy, below the bf16 region); the arena's for the rest
    /// (Muon's f32 stacks, after it).
    #[cfg(feature = "tools")]
    fn gemm_elem(&self, m: Mat) -> f64 {
        match self.inner.half_region() {
            Some(h) if m.span().end() <= h.end() => 2.0,
            _ => self.elem(m.span()),
        }
    }

    /// Times the ops of `inner`; the returned log fills as the times are resolved.
    #[cfg(feature = "tools")]
    pub fn new(inner: Box<dyn Backend>) -> (Self, Arc<Mutex<Vec<OpTime>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        (Self { inner, pending: Mutex::new(Vec::new()), log: log.clone() }, log)
    }

    /// Runs `f` on the inner backend as one timed op.
    #[cfg(feature = "tools")]
    fn time<R>(&mut self, op: &'static str, shape: String, bytes: f64, flops: f64, f: impl FnOnce(&mut dyn Backend) -> R) -> R {
        let start = match self.inner.timing_mark() {
            Some(m) => Start::Mark(m),
            None => Start::Host(Instant::now()),
        };
        let r = f(self.inner.as_mut());
        let end = match &start {
            Start::Mark(_) => self.inner.timing_mark().ok_or(f64::NAN),
            Start::Host(t0) => Err(t0.elapsed().as_secs_f64() * 1e3),
        };
        self.pending.lock().expect("the pending timings").push(Pending { op, shape, bytes, flops, start, end });
        r
    }

    /// Reads the times of every op not read yet into the log (waits for the device).
    #[cfg(feature = "tools")]
    pub fn resolve(&self) -> anyhow::Result<()> {
        let pending = std::mem::take(&mut *self.pending.lock().expect("the pending timings"));
        let mut log = self.log.lock().expect("the timing log");
        for p in pending {
            let ms = match (p.start, p.end) {
                (Start::Mark(a), Ok(b)) => self.inner.timing_ms(a, b)?,
                (_, Err(ms)) => ms,
                (Start::Host(_), Ok(_)) => f64::NAN,
            };
            log.push(OpTime { op: p.op, shape: p.shape, bytes: p.bytes, flops: p.flops, ms });
        }
        self.inner.timing_reset();
        Ok(())
    }
}

#[cfg(feature = "tools")]
fn rows_cols(b: Buf, cols: usize) -> String {
    format!("{}x{cols}", b.len / cols.max(1))
}

#[cfg(feature = "tools")]
impl Backend for Timed {
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn upload(&mut self, dst: Buf, src: &Tensor) -> anyhow::Result<()> {
        self.inner.upload(dst, src)
    }
    fn download(&self, src: Buf, shape: &[usize]) -> anyhow::Result<Tensor> {
        let t = self.inner.download(src, shape)?;
        self.resolve()?;
        Ok(t)
    }
    fn download_to(&self, src: Buf, shape: &[usize], device: &candle_core::Device) -> anyhow::Result<Tensor> {
        let t = self.inner.download_to(src, shape, device)?;
        self.resolve()?;
        Ok(t)
    }
    fn set_tokens(&mut self, x: &[u32], y: &[u32]) {
        let n = x.len();
        self.time("set_tokens", format!("{n} ids"), 8.0 * n as f64, 0.0, |b| b.set_tokens(x, y))
    }
    fn load_tokens(&mut self, tokens: Tokens<'_>) -> anyhow::Result<()> {
        let n = tokens.lens().0;
        self.time("set_tokens", format!("{n} ids"), 8.0 * n as f64, 0.0, |b| b.load_tokens(tokens))
    }
    fn fill(&mut self, dst: Buf, value: f64) {
        self.time("fill", dst.len.to_string(), self.bytes(&[dst]), 0.0, |b| b.fill(dst, value))
    }
    fn copy(&mut self, dst: Buf, src: Buf) {
        self.time("copy", dst.len.to_string(), self.bytes(&[dst, src]), 0.0, |b| b.copy(dst, src))
    }
    fn scale(&mut self, dst: Buf, a: f64) {
        self.time("scale", dst.len.to_string(), 2.0 * self.bytes(&[dst]), 0.0, |b| b.scale(dst, a))
    }
    fn sum(&self, src: Buf) -> f64 {
        let v = self.inner.sum(src);
        let _ = self.resolve();
        v
    }
    fn sum_sq(&self, src: Buf) -> f64 {
        let v = self.inner.sum_sq(src);
        let _ = self.resolve();
        v
    }
    fn all_finite(&self, src: Buf) -> bool {
        let v = self.inner.all_finite(src);
        let _ = self.resolve();
        v
    }
    fn sum_into(&mut self, src: Buf, dst: Buf) {
        self.time("sum_into", src.len.to_string(), self.bytes(&[src]), 0.0, |b| b.sum_into(src, dst))
    }
    fn clip_norm(&mut self, g: Buf, max: f64, norm: Buf) {
        // Reads g twice (the norm, then the scaling) and writes it.
        self.time("clip_norm", g.len.to_string(), 3.0 * self.bytes(&[g]), 0.0, |b| b.clip_norm(g, max, norm))
    }
    fn graph_counts(&self) -> Option<GraphCounts> {
        self.inner.graph_counts()
    }
    fn set_cudnn(&mut self, on: bool) -> anyhow::Result<()> {
        self.inner.set_cudnn(on)
    }
    fn attention_name(&self) -> String {
        self.inner.attention_name()
    }
    fn half_region(&self) -> Option<Buf> {
        self.inner.half_region()
    }
    fn refresh_weights(&mut self, params: Buf) {
        // Reads the f32 weights, writes their bf16 copy (nothing without bf16 activations).
        if self.inner.half_region().is_some() {
            let by = 6.0 * params.len as f64;
            self.time("refresh_weights", params.len.to_string(), by, 0.0, |b| b.refresh_weights(params));
        }
    }
    fn synchronize(&self) -> anyhow::Result<()> {
        self.inner.synchronize()?;
        self.resolve()
    }
    fn gemm(&mut self, c: Mat, a: Mat, b_: Mat, alpha: f64, beta: f64) {
        let ((m, k), (_, n)) = (a.shape(), b_.shape());
        let tr = |x: Mat| if x.t { "T" } else { "N" };
        let shape = format!("{m}x{n}x{k} {}{}{}", tr(a), tr(b_), if beta != 0.0 { " +=" } else { "" });
        let c_bytes = if beta != 0.0 { 2.0 } else { 1.0 } * (m * n) as f64 * self.elem(c.span());
        let by = self.gemm_elem(a) * (m * k) as f64 + self.gemm_elem(b_) * (k * n) as f64 + c_bytes;
        self.time("gemm", shape, by, 2.0 * (m * n * k) as f64, |b| b.gemm(c, a, b_, alpha, beta))
    }
    fn embedding_fwd(&mut self, table: Buf, out: Buf, dim: usize) {
        self.time("embedding_fwd", rows_cols(out, dim), 2.0 * self.bytes(&[out]), 0.0, |b| b.embedding_fwd(table, out, dim))
    }
    fn embedding_bwd(&mut self, dout: Buf, dtable: Buf, dim: usize) {
        self.time("embedding_bwd", rows_cols(dout, dim), self.bytes(&[dout, dtable, dtable]), 0.0, |b| b.embedding_bwd(dout, dtable, dim))
    }
    fn rms_norm_fwd(&mut self, x: Buf, out: Buf, rstd: Buf, cols: usize, scale: f64, eps: f64) {
        self.time("rms_norm_fwd", rows_cols(x, cols), self.bytes(&[x, out, rstd]), 0.0, |b| b.rms_norm_fwd(x, out, rstd, cols, scale, eps))
    }
    fn rms_norm_bwd(&mut self, x: Buf, rstd: Buf, dy: Buf, dx: Buf, cols: usize, scale: f64, accumulate: bool) {
        let by = self.bytes(&[x, rstd, dy, dx]) + if accumulate { self.bytes(&[dx]) } else { 0.0 };
        self.time("rms_norm_bwd", rows_cols(x, cols), by, 0.0, |b| b.rms_norm_bwd(x, rstd, dy, dx, cols, scale, accumulate))
    }
    fn resid_mix_fwd(&mut self, h: Buf, x0: Buf, mix: Buf, out: Buf) {
        self.time("resid_mix_fwd", rows_cols(h, mix.len / 2), self.bytes(&[h, x0, out]), 0.0, |b| b.resid_mix_fwd(h, x0, mix, out))
    }
    fn resid_mix_bwd(&mut self, du: Buf, h: Buf, x0: Buf, mix: Buf, dh: Buf, dx0: Buf, dmix: Buf) {
        let by = self.bytes(&[du, h, x0, dh, dx0, dx0]);
        self.time("resid_mix_bwd", rows_cols(du, mix.len / 2), by, 0.0, |b| b.resid_mix_bwd(du, h, x0, mix, dh, dx0, dmix))
    }
    fn scale_add_fwd(&mut self, base: Buf, x: Buf, s: Buf, out: Buf) {
        self.time("scale_add_fwd", rows_cols(x, s.len), self.bytes(&[base, x, out]), 0.0, |b| b.scale_add_fwd(base, x, s, out))
    }
    fn scale_add_bwd(&mut self, dy: Buf, x: Buf, s: Buf, dx: Buf, ds: Buf) {
        self.time("scale_add_bwd", rows_cols(dy, s.len), self.bytes(&[dy, x, dx, dy]), 0.0, |b| b.scale_add_bwd(dy, x, s, dx, ds))
    }
    fn skip_fwd(&mut self, h: Buf, s: Buf, w: Buf, z: Option<Buf>, out: Buf) {
        self.time("skip_fwd", rows_cols(h, w.len), self.bytes(&[h, s, out]), 0.0, |b| b.skip_fwd(h, s, w, z, out))
    }
    fn skip_bwd(&mut self, dy: Buf, h: Buf, s: Buf, w: Buf, z: Option<(Buf, Buf)>, dh: Buf, ds: Buf, dw: Buf) {
        let by = self.bytes(&[dy, h, s, dh, ds, dy]);
        self.time("skip_bwd", rows_cols(dy, w.len), by, 0.0, |b| b.skip_bwd(dy, h, s, w, z, dh, ds, dw))
    }
    fn qk_norm_rope_fwd(&mut self, x: Mat, out: Buf, rstd: Buf, gain: Option<Buf>, cos: Buf, sin: Buf, s: HeadShape, eps: f64) {
        let shape = format!("{}x{}x{}", s.rows, s.heads, s.d);
        self.time("qk_norm_rope_fwd", shape, 2.0 * self.bytes(&[out]), 0.0, |b| b.qk_norm_rope_fwd(x, out, rstd, gain, cos, sin, s, eps))
    }
    fn qk_norm_rope_bwd(&mut self, x: Mat, rstd: Buf, dy: Buf, dx: Mat, gain: Option<(Buf, Buf)>, cos: Buf, sin: Buf, s: HeadShape) {
        let shape = format!("{}x{}x{}", s.rows, s.heads, s.d);
        self.time("qk_norm_rope_bwd", shape, 3.0 * self.bytes(&[dy]), 0.0, |b| b.qk_norm_rope_bwd(x, rstd, dy, dx, gain, cos, sin, s))
    }
    fn attention_fwd(&mut self, q: Mat, k: Mat, v: Mat, out: Buf, s: AttnShape) {
        // Causal: half of QK^T and PV, 2 t^2 d each per head.
        let flops = 2.0 * (s.batch * s.heads) as f64 * (s.t * s.t * s.d) as f64;
        let by = self.bytes(&[q.span(), k.span(), v.span()]) + self.bytes(&[out]);
        let shape = format!("{}x{}x{}h{}kv", s.batch, s.t, s.heads, s.kv_heads);
        self.time("attention_fwd", shape, by, flops, |b| b.attention_fwd(q, k, v, out, s))
    }
    fn attention_bwd(&mut self, q: Mat, k: Mat, v: Mat, out: Buf, dout: Buf, dq: Mat, dk: Mat, dv: Mat, dv_acc: bool, s: AttnShape) {
        // 2.5 times the forward's products (S and dP recomputed, dV, dQ, dK).
        let flops = 5.0 * (s.batch * s.heads) as f64 * (s.t * s.t * s.d) as f64;
        let qkv = self.bytes(&[q.span(), k.span(), v.span()]);
        let by = 2.0 * qkv + self.bytes(&[out, dout]);
        let shape = format!("{}x{}x{}h{}kv", s.batch, s.t, s.heads, s.kv_heads);
        self.time("attention_bwd", shape, by, flops, |b| b.attention_bwd(q, k, v, out, dout, dq, dk, dv, dv_acc, s))
    }
    fn xsa_fwd(&mut self, y: Buf, v: Mat, out: Buf, s: AttnShape) {
        self.time("xsa_fwd", rows_cols(y, s.heads * s.d), self.bytes(&[y, out]), 0.0, |b| b.xsa_fwd(y, v, out, s))
    }
    fn xsa_bwd(&mut self, dout: Buf, y: Buf, v: Mat, dy: Buf, dv: Mat, s: AttnShape) {
        self.time("xsa_bwd", rows_cols(y, s.heads * s.d), self.bytes(&[dout, y, dy]), 0.0, |b| b.xsa_bwd(dout, y, v, dy, dv, s))
    }
    fn smear_fwd(&mut self, e: Buf, w: Buf, lambda: Buf, out: Buf, cols: usize, t: usize, bos: u32) {
        self.time("smear_fwd", rows_cols(e, cols), self.bytes(&[e, e, out]), 0.0, |b| b.smear_fwd(e, w, lambda, out, cols, t, bos))
    }
    fn smear_bwd(&mut self, dout: Buf, e: Buf, w: Buf, lambda: Buf, de: Buf, dw: Buf, dlambda: Buf, cols: usize, t: usize, bos: u32) {
        let by = self.bytes(&[dout, dout, e, e, de]);
        self.time("smear_bwd", rows_cols(e, cols), by, 0.0, |b| b.smear_bwd(dout, e, w, lambda, de, dw, dlambda, cols, t, bos))
    }
    fn lanes_fwd(&mut self, l: [Buf; 2], ao: Buf, mo: Buf, w: LaneBufs, out: [Buf; 2]) {
        let by = self.bytes(&[l[0], l[1], ao, mo, out[0], out[1]]);
        self.time("lanes_fwd", rows_cols(ao, w.sa.len), by, 0.0, |b| b.lanes_fwd(l, ao, mo, w, out))
    }
    fn lanes_bwd(&mut self, g: [Buf; 2], l: [Buf; 2], ao: Buf, mo: Buf, w: LaneBufs, dl: [Buf; 2], dao: Buf, dmo: Buf, dw: LaneBufs) {
        // The mix's pass and the partial sums' pass, each reading the lanes and the outputs.
        let by = 2.0 * self.bytes(&[g[0], g[1], l[0], l[1], ao, mo]) + self.bytes(&[dl[0], dl[1], dao, dmo]);
        self.time("lanes_bwd", rows_cols(ao, w.sa.len), by, 0.0, |b| b.lanes_bwd(g, l, ao, mo, w, dl, dao, dmo, dw))
    }
    fn attn_gate_fwd(&mut self, y: Buf, x: Mat, w: Buf, out: Buf, heads: usize, scale: f64) {
        self.time("attn_gate_fwd", rows_cols(y, y.len / x.rows.max(1)), self.bytes(&[y, out]), 0.0, |b| {
            b.attn_gate_fwd(y, x, w, out, heads, scale)
        })
    }
    fn attn_gate_bwd(&mut self, dout: Buf, y: Buf, x: Mat, w: Buf, dy: Buf, dz: Buf, heads: usize, scale: f64) {
        let shape = rows_cols(y, y.len / x.rows.max(1));
        self.time("attn_gate_bwd", shape, self.bytes(&[dout, y, dy, dz]), 0.0, |b| b.attn_gate_bwd(dout, y, x, w, dy, dz, heads, scale))
    }
    fn act_fwd(&mut self, pre: Buf, out: Buf, a: Activation) {
        self.time("act_fwd", pre.len.to_string(), self.bytes(&[pre, out]), 0.0, |b| b.act_fwd(pre, out, a))
    }
    fn act_bwd(&mut self, pre: Buf, dout: Buf, dpre: Buf, a: Activation) {
        self.time("act_bwd", pre.len.to_string(), self.bytes(&[pre, dout, dpre]), 0.0, |b| b.act_bwd(pre, dout, dpre, a))
    }
    fn softcap_ce(&mut self, logits: Buf, losses: Buf, vocab: usize, cap: f64, grad_scale: f64) {
        self.time("softcap_ce", rows_cols(logits, vocab), 2.0 * self.bytes(&[logits]), 0.0, |b| {
            b.softcap_ce(logits, losses, vocab, cap, grad_scale)
        })
    }
    fn adam(&mut self, p: Buf, g: Buf, m: Buf, v: Buf, s: AdamStep) {
        self.time("adam", p.len.to_string(), self.bytes(&[p, g, m, v, p, m, v]), 0.0, |b| b.adam(p, g, m, v, s))
    }
    fn momentum(&mut self, g: Buf, buf: Buf, u: Buf, mu: f64, nesterov: bool) {
        self.time("momentum", g.len.to_string(), self.bytes(&[g, buf, buf, u]), 0.0, |b| b.momentum(g, buf, u, mu, nesterov))
    }
    fn axpby(&mut self, a: f64, x: Buf, b_: f64, y: Buf) {
        self.time("axpby", x.len.to_string(), self.bytes(&[x, y, y]), 0.0, |b| b.axpby(a, x, b_, y))
    }
    fn row_normalize(&mut self, x: Buf, cols: usize, eps: f64) {
        self.time("row_normalize", rows_cols(x, cols), 2.0 * self.bytes(&[x]), 0.0, |b| b.row_normalize(x, cols, eps))
    }
    fn normalize_each(&mut self, x: Buf, count: usize, eps: f64) {
        self.time("normalize_each", format!("{count}x{}", x.len / count.max(1)), 3.0 * self.bytes(&[x]), 0.0, |b| {
            b.normalize_each(x, count, eps)
        })
    }
    fn transpose_each(&mut self, src: Buf, dst: Buf, count: usize, rows: usize, cols: usize) {
        let shape = format!("{count}x{rows}x{cols}");
        self.time("transpose_each", shape, self.bytes(&[src, dst]), 0.0, |b| b.transpose_each(src, dst, count, rows, cols))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::CpuBackend;

    /// Every op through the wrapper is the inner backend's op (same arena afterwards) and has
    /// one timing with its bytes; a GEMM's FLOPs are `2 m n k`; units of work are not opened.
    #[test]
    fn timed_ops_are_the_inner_ops_with_a_time_each() {
        let mk = || Box::new(CpuBackend::<f64>::new(400)) as Box<dyn Backend>;
        let (mut timed, log) = Timed::new(mk());
        let mut plain = mk();
        let init = Tensor::from_vec((0..400).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>(), 400, &candle_core::Device::Cpu).unwrap();
        let all = Buf { off: 0, len: 400 };
        for be in [&mut timed as &mut dyn Backend, plain.as_mut()] {
            be.upload(all, &init).unwrap();
            be.begin_unit("u");
            be.gemm(Buf { off: 300, len: 12 }.mat(3, 4), Buf { off: 0, len: 15 }.mat(3, 5), Buf { off: 100, len: 20 }.mat(5, 4), 1.0, 0.0);
            be.scale(Buf { off: 200, len: 50 }, 2.0);
            be.end_unit();
        }
        let (a, b) = (timed.download(all, &[400]).unwrap(), plain.download(all, &[400]).unwrap());
        assert_eq!(a.to_vec1::<f64>().unwrap(), b.to_vec1::<f64>().unwrap());
        let log = log.lock().unwrap();
        assert_eq!(log.iter().map(|t| t.op).collect::<Vec<_>>(), ["gemm", "scale"]);
        assert_eq!(log[0].flops, 2.0 * 3.0 * 4.0 * 5.0);
        assert_eq!(log[0].shape, "3x4x5 NN");
        assert_eq!(log[1].bytes, 2.0 * 4.0 * 50.0);
        assert!(log.iter().all(|t| t.ms.is_finite() && t.ms >= 0.0));
    }
}
