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

use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Tensor};

use super::backend::{AttnShape, Backend, Buf, GraphCounts, HeadShape, Mat, Tokens};
use super::op::Op;

/// One op call's time.
#[derive(Clone, Debug, serde::Serialize)]
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
enum Start {
    /// A device timing mark.
    Mark(usize),
    /// The host's clock.
    Host(Instant),
}

/// An op whose time is not read yet.
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
pub struct Timed {
    inner: Box<dyn Backend>,
    pending: Mutex<Vec<Pending>>,
    log: Arc<Mutex<Vec<OpTime>>>,
}

impl Timed {
    /// Bytes per element of `b`: 2 inside the backend's bf16 region, else the arena's.
    fn elem(&self, b: Buf) -> f64 {
        match self.inner.half_region() {
            Some(h) if b.off >= h.off && b.end() <= h.end() => 2.0,
            _ => self.inner.dtype().size_in_bytes().min(4) as f64,
        }
    }

    /// Bytes of `bufs`.
    fn bytes(&self, bufs: &[Buf]) -> f64 {
        bufs.iter().map(|&b| self.elem(b) * b.len as f64).sum::<f64>()
    }

    /// Bytes per element of a GEMM input: 2 with bf16 activations for the activations and for
    /// the weights (read from their bf16 copy, below the bf16 region); the arena's for the rest
    /// (Muon's f32 stacks, after it).
    fn gemm_elem(&self, m: Mat) -> f64 {
        match self.inner.half_region() {
            Some(h) if m.span().end() <= h.end() => 2.0,
            _ => self.elem(m.span()),
        }
    }

    /// Times the ops of `inner`; the returned log fills as the times are resolved.
    pub fn new(inner: Box<dyn Backend>) -> (Self, Arc<Mutex<Vec<OpTime>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        (Self { inner, pending: Mutex::new(Vec::new()), log: log.clone() }, log)
    }

    /// Runs `f` on the inner backend as one timed op.
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

fn rows_cols(b: Buf, cols: usize) -> String {
    format!("{}x{cols}", b.len / cols.max(1))
}

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
    fn run(&mut self, op: Op) {
        let (shape, bytes, flops) = self.traffic(&op);
        self.time(op.name(), shape, bytes, flops, |b| b.run(op))
    }
}

impl Timed {
    /// An op's shape, the bytes it moves at least (each region it reads or writes, once per
    /// pass of its kernel over it) and its FLOPs (GEMMs and attention). An op without its own
    /// line here counts each of its regions once, shaped by its first.
    fn traffic(&self, op: &Op) -> (String, f64, f64) {
        let by = |bufs: &[Buf]| self.bytes(bufs);
        let attn = |s: AttnShape| format!("{}x{}x{}h{}kv", s.batch, s.t, s.heads, s.kv_heads);
        let heads = |s: HeadShape| format!("{}x{}x{}", s.rows, s.heads, s.d);
        let gemm = |c: Mat, a: Mat, b: Mat, beta: f64| {
            let ((m, k), (_, n)) = (a.shape(), b.shape());
            let tr = |x: Mat| if x.t { "T" } else { "N" };
            let shape = format!("{m}x{n}x{k} {}{}{}", tr(a), tr(b), if beta != 0.0 { " +=" } else { "" });
            let c_bytes = if beta != 0.0 { 2.0 } else { 1.0 } * (m * n) as f64 * self.elem(c.span());
            let bytes = self.gemm_elem(a) * (m * k) as f64 + self.gemm_elem(b) * (k * n) as f64 + c_bytes;
            (shape, bytes, 2.0 * (m * n * k) as f64)
        };
        match *op {
            Op::Fill(o) => (o.dst.len.to_string(), by(&[o.dst]), 0.0),
            Op::CopyBuf(o) => (o.dst.len.to_string(), by(&[o.dst, o.src]), 0.0),
            Op::Scale(o) => (o.dst.len.to_string(), 2.0 * by(&[o.dst]), 0.0),
            Op::SumInto(o) => (o.src.len.to_string(), by(&[o.src]), 0.0),
            // Reads g twice (the norm, then the scaling) and writes it.
            Op::ClipNorm(o) => (o.g.len.to_string(), 3.0 * by(&[o.g]), 0.0),
            Op::Gemm(o) => gemm(o.c, o.a, o.b, o.beta),
            Op::GemmBatched(o) => {
                let (shape, bytes, flops) = gemm(o.c, o.a, o.b, o.beta);
                let n = o.count as f64;
                (format!("{}x {shape}", o.count), n * bytes, n * flops)
            }
            Op::EmbeddingFwd(o) => (rows_cols(o.out, o.dim), 2.0 * by(&[o.out]), 0.0),
            Op::EmbeddingBwd(o) => (rows_cols(o.dout, o.dim), by(&[o.dout, o.dtable, o.dtable]), 0.0),
            Op::RmsNormFwd(o) => (rows_cols(o.x, o.cols), by(&[o.x, o.out, o.rstd]), 0.0),
            Op::RmsNormBwd(o) => {
                let acc = if o.accumulate { by(&[o.dx]) } else { 0.0 };
                (rows_cols(o.x, o.cols), by(&[o.x, o.rstd, o.dy, o.dx]) + acc, 0.0)
            }
            Op::ResidMixFwd(o) => (rows_cols(o.h, o.mix.len / 2), by(&[o.h, o.x0, o.out]), 0.0),
            Op::ResidMixBwd(o) => (rows_cols(o.du, o.mix.len / 2), by(&[o.du, o.h, o.x0, o.dh, o.dx0, o.dx0]), 0.0),
            Op::ScaleAddFwd(o) => (rows_cols(o.x, o.s.len), by(&[o.base, o.x, o.out]), 0.0),
            Op::ScaleAddBwd(o) => (rows_cols(o.dy, o.s.len), by(&[o.dy, o.x, o.dx, o.dy]), 0.0),
            Op::SkipFwd(o) => (rows_cols(o.h, o.w.len), by(&[o.h, o.s, o.out]), 0.0),
            Op::SkipBwd(o) => (rows_cols(o.dy, o.w.len), by(&[o.dy, o.h, o.s, o.dh, o.ds, o.dy]), 0.0),
            Op::QkNormRopeFwd(o) => (heads(o.s), 2.0 * by(&[o.out]), 0.0),
            Op::QkNormRopeBwd(o) => (heads(o.s), 3.0 * by(&[o.dy]), 0.0),
            Op::AttentionFwd(o) => {
                // Causal: half of QK^T and PV, 2 t^2 d each per head.
                let s = o.s;
                let flops = 2.0 * (s.batch * s.heads) as f64 * (s.t * s.t * s.d) as f64;
                (attn(s), by(&[o.q.span(), o.k.span(), o.v.span()]) + by(&[o.out]), flops)
            }
            Op::AttentionBwd(o) => {
                // 2.5 times the forward's products (S and dP recomputed, dV, dQ, dK).
                let s = o.s;
                let flops = 5.0 * (s.batch * s.heads) as f64 * (s.t * s.t * s.d) as f64;
                (attn(s), 2.0 * by(&[o.q.span(), o.k.span(), o.v.span()]) + by(&[o.out, o.dout]), flops)
            }
            Op::XsaFwd(o) => (rows_cols(o.y, o.s.heads * o.s.d), by(&[o.y, o.out]), 0.0),
            Op::XsaBwd(o) => (rows_cols(o.y, o.s.heads * o.s.d), by(&[o.dout, o.y, o.dy]), 0.0),
            Op::SmearFwd(o) => (rows_cols(o.e, o.cols), by(&[o.e, o.e, o.out]), 0.0),
            Op::SmearBwd(o) => (rows_cols(o.e, o.cols), by(&[o.dout, o.dout, o.e, o.e, o.de]), 0.0),
            Op::LanesFwd(o) => (rows_cols(o.ao, o.w.sa.len), by(&[o.l[0], o.l[1], o.ao, o.mo, o.out[0], o.out[1]]), 0.0),
            Op::LanesBwd(o) => {
                // The mix's pass and the partial sums' pass, each reading the lanes and the outputs.
                let reads = by(&[o.g[0], o.g[1], o.l[0], o.l[1], o.ao, o.mo]);
                (rows_cols(o.ao, o.w.sa.len), 2.0 * reads + by(&[o.dl[0], o.dl[1], o.dao, o.dmo]), 0.0)
            }
            Op::AttnGateFwd(o) => (rows_cols(o.y, o.y.len / o.x.rows.max(1)), by(&[o.y, o.out]), 0.0),
            Op::AttnGateBwd(o) => (rows_cols(o.y, o.y.len / o.x.rows.max(1)), by(&[o.dout, o.y, o.dy, o.dz]), 0.0),
            Op::ActFwd(o) => (o.pre.len.to_string(), by(&[o.pre, o.out]), 0.0),
            Op::ActBwd(o) => (o.pre.len.to_string(), by(&[o.pre, o.dout, o.dpre]), 0.0),
            Op::SoftcapCe(o) => (rows_cols(o.logits, o.vocab), 2.0 * by(&[o.logits]), 0.0),
            Op::Adam(o) => (o.p.len.to_string(), by(&[o.p, o.g, o.m, o.v, o.p, o.m, o.v]), 0.0),
            Op::Momentum(o) => (o.g.len.to_string(), by(&[o.g, o.buf, o.buf, o.u]), 0.0),
            Op::Axpby(o) => (o.x.len.to_string(), by(&[o.x, o.y, o.y]), 0.0),
            Op::RowNormalize(o) => (rows_cols(o.x, o.cols), 2.0 * by(&[o.x]), 0.0),
            Op::NormalizeEach(o) => (format!("{}x{}", o.count, o.x.len / o.count.max(1)), 3.0 * by(&[o.x]), 0.0),
            Op::TransposeEach(o) => (format!("{}x{}x{}", o.count, o.rows, o.cols), by(&[o.src, o.dst]), 0.0),
            #[allow(unreachable_patterns)]
            _ => {
                let regions = op.regions();
                (regions.first().map_or(String::new(), |b| b.len.to_string()), by(&regions), 0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::BackendExt;
    use crate::engine::cpu::CpuBackend;
    use crate::engine::op;

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
            be.op(op::Gemm {
                c: Buf { off: 300, len: 12 }.mat(3, 4),
                a: Buf { off: 0, len: 15 }.mat(3, 5),
                b: Buf { off: 100, len: 20 }.mat(5, 4),
                alpha: 1.0,
                beta: 0.0,
            });
            be.op(op::Scale { dst: Buf { off: 200, len: 50 }, a: 2.0 });
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
