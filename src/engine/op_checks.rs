//! Every backward op of the [`Backend`] against central finite differences of its forward op,
//! on the f64 CPU backend: for a fixed random `R` and `L = sum(out R)`, the backward op run
//! with `dy = R` must give `dL/dx` for every input `x` to a relative error (of the whole
//! gradient vector) below 1e-6, with `(L(x + h) - L(x - h)) / 2h`, `h = 1e-6`.
//!
//! Every region starts as random garbage (outputs and gradients too), so a gradient that is
//! said to be written but is added to, or said to accumulate but is overwritten, fails; the
//! backward op must also leave every element outside its gradients (the padding columns of a
//! strided view included) bit-for-bit unchanged. Shapes cross the CPU kernels' block of 64
//! rows, inputs are column views of wider matrices where the schedule passes views, and every
//! gradient must be non-zero. The checks against candle's autograd (whole model) are in
//! `tests.rs`; these pin each op down on its own.

use std::collections::HashSet;

use candle_core::{Device, Tensor};

use super::backend::{Activation, AttnShape, Backend, Buf, HeadShape, Mat};
use super::cpu::CpuBackend;
use crate::engine::backend::BackendExt;
use crate::engine::op;

type Be = CpuBackend<f64>;

/// The finite-difference step.
const H: f64 = 1e-6;
/// The largest relative error of a gradient vector.
const TOL: f64 = 1e-6;
/// The arena's elements (every test fits).
const ARENA: usize = 1 << 14;

/// The arena elements of a region, in row-major order.
trait Region {
    fn idx(&self) -> Vec<usize>;
}

impl Region for Buf {
    fn idx(&self) -> Vec<usize> {
        (self.off..self.end()).collect()
    }
}

impl Region for Mat {
    fn idx(&self) -> Vec<usize> {
        assert!(!self.t);
        let m = *self;
        (0..m.rows).flat_map(|r| (0..m.cols).map(move |c| m.off + r * m.ld + c)).collect()
    }
}

/// The f64 backend, a bump allocator over its arena and a seeded generator.
struct Lab {
    be: Be,
    next: usize,
    rng: fastrand::Rng,
}

impl Lab {
    fn new(seed: u64) -> Lab {
        Lab { be: CpuBackend::new(ARENA), next: 0, rng: fastrand::Rng::with_seed(seed) }
    }

    /// `n` random values of magnitude in `[0.2, 1]`, either sign (away from 0, where
    /// the activation has its kink).
    fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| (0.2 + 0.8 * self.rng.f64()) * if self.rng.bool() { 1.0 } else { -1.0 }).collect()
    }

    /// A fresh region of `n` elements holding [`Lab::values`].
    fn buf(&mut self, n: usize) -> Buf {
        let b = Buf { off: self.next, len: n };
        self.next += n;
        let v = self.values(n);
        self.set(b, &v);
        b
    }

    fn set(&mut self, b: Buf, v: &[f64]) {
        self.be.upload(b, &Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()).unwrap();
    }

    fn get(&self, b: Buf) -> Vec<f64> {
        self.be.download(b, &[b.len]).unwrap().to_vec1().unwrap()
    }

    fn arena(&self) -> Vec<f64> {
        self.get(Buf { off: 0, len: ARENA })
    }
}

/// One input of an op: its elements, its gradient's, and whether the backward op adds to the
/// gradient (`acc`) or writes it.
struct Wrt {
    name: String,
    x: Vec<usize>,
    dx: Vec<usize>,
    acc: bool,
}

fn wrt(name: impl Into<String>, x: impl Region, dx: impl Region, acc: bool) -> Wrt {
    Wrt { name: name.into(), x: x.idx(), dx: dx.idx(), acc }
}

/// `d sum(out r) / dx` by central differences at each element of `x`, `fwd` rerun each time.
fn numeric(lab: &mut Lab, fwd: &dyn Fn(&mut Be), out: Buf, r: &[f64], x: &[usize]) -> Vec<f64> {
    let loss = |lab: &mut Lab| {
        fwd(&mut lab.be);
        lab.get(out).iter().zip(r).map(|(o, r)| o * r).sum::<f64>()
    };
    x.iter()
        .map(|&i| {
            let at = Buf { off: i, len: 1 };
            let x0 = lab.get(at)[0];
            lab.be.op(op::Fill { dst: at, value: x0 + H });
            let plus = loss(lab);
            lab.be.op(op::Fill { dst: at, value: x0 - H });
            let minus = loss(lab);
            lab.be.op(op::Fill { dst: at, value: x0 });
            (plus - minus) / (2.0 * H)
        })
        .collect()
}

/// Asserts `|analytic - numeric| <= TOL |numeric|` (L2 norms) and a non-zero gradient.
fn assert_close(name: &str, analytic: &[f64], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len(), "{name}: lengths");
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let scale = norm(&mut numeric.iter().copied());
    let diff = norm(&mut analytic.iter().zip(numeric).map(|(a, n)| a - n));
    assert!(scale > 1e-3, "{name}: gradient {scale:e} is (nearly) zero");
    let (i, worst) =
        analytic.iter().zip(numeric).map(|(a, n)| (a - n).abs()).enumerate().fold((0, 0.0), |b, c| if c.1 > b.1 { c } else { b });
    assert!(
        diff <= TOL * scale,
        "{name}: relative error {:e} (worst element {i}: analytic {}, numeric {}, |diff| {worst:e})",
        diff / scale,
        analytic[i],
        numeric[i]
    );
}

/// Runs `fwd`, sets `dy` (the gradient of `out`) to a random `R`, runs `bwd` and checks every
/// gradient of `wrts` (less what it held before, when it accumulates) against [`numeric`] of
/// `L = sum(out R)`, and that `bwd` wrote nothing else.
fn check(lab: &mut Lab, fwd: impl Fn(&mut Be), bwd: impl FnOnce(&mut Be), out: Buf, dy: Buf, wrts: &[Wrt]) {
    fwd(&mut lab.be);
    let r = lab.values(out.len);
    lab.set(dy, &r);
    let before = lab.arena();
    bwd(&mut lab.be);
    let after = lab.arena();
    let written: HashSet<usize> = wrts.iter().flat_map(|w| w.dx.iter().copied()).collect();
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(written.contains(&i) || b.to_bits() == a.to_bits(), "the backward op wrote element {i}, outside its gradients");
    }
    for w in wrts {
        let analytic: Vec<f64> = w.dx.iter().map(|&i| after[i] - if w.acc { before[i] } else { 0.0 }).collect();
        let numeric = numeric(lab, &fwd, out, &r, &w.x);
        assert_close(&w.name, &analytic, &numeric);
    }
}

/// `rms_norm_bwd` (scale 0.7, 70 rows: two row blocks), written and with `accumulate`.
#[test]
fn rms_norm() {
    let (rows, cols, scale, eps) = (70, 5, 0.7, 1e-5);
    for acc in [false, true] {
        let mut lab = Lab::new(1);
        let (x, out, rstd, dy, dx) =
            (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(rows), lab.buf(rows * cols), lab.buf(rows * cols));
        let fwd = |be: &mut Be| be.op(op::RmsNormFwd { x, out, rstd, cols, scale, eps });
        let bwd = |be: &mut Be| be.op(op::RmsNormBwd { x, rstd, dy, dx, cols, scale, accumulate: acc });
        check(&mut lab, fwd, bwd, out, dy, &[wrt(format!("dx (accumulate {acc})"), x, dx, acc)]);
    }
}

/// `resid_mix_bwd`: `dh` written, `dx0` and `dmix` (both rows) accumulated.
#[test]
fn resid_mix() {
    let (rows, cols) = (70, 3);
    let mut lab = Lab::new(2);
    let (h, x0, mix, out) = (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(2 * cols), lab.buf(rows * cols));
    let (dy, dh, dx0, dmix) = (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(2 * cols));
    let fwd = |be: &mut Be| be.op(op::ResidMixFwd { h, x0, mix, out });
    let bwd = |be: &mut Be| be.op(op::ResidMixBwd { du: dy, h, x0, mix, dh, dx0, dmix });
    check(&mut lab, fwd, bwd, out, dy, &[wrt("dh", h, dh, false), wrt("dx0", x0, dx0, true), wrt("dmix", mix, dmix, true)]);
}

/// `scale_add_bwd`: `dx` written, `ds` accumulated (the base's gradient is `dy` itself).
#[test]
fn scale_add() {
    let (rows, cols) = (70, 3);
    let mut lab = Lab::new(3);
    let (base, x, s, out) = (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(cols), lab.buf(rows * cols));
    let (dy, dx, ds) = (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(cols));
    let fwd = |be: &mut Be| be.op(op::ScaleAddFwd { base, x, s, out });
    let bwd = |be: &mut Be| be.op(op::ScaleAddBwd { dy, x, s, dx, ds });
    check(&mut lab, fwd, bwd, out, dy, &[wrt("dx", x, dx, false), wrt("ds", s, ds, true)]);
}

/// `skip_bwd` without and with the gate `z`: `dh`, `ds` written, `dw`, `dz` accumulated.
#[test]
fn skip() {
    let (rows, cols) = (70, 3);
    for gated in [false, true] {
        let mut lab = Lab::new(4);
        let (h, s, w, z, out) = (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(cols), lab.buf(cols), lab.buf(rows * cols));
        let (dy, dh, ds, dw, dz) = (lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(rows * cols), lab.buf(cols), lab.buf(cols));
        let fwd = |be: &mut Be| be.op(op::SkipFwd { h, s, w, z: gated.then_some(z), out });
        let bwd = |be: &mut Be| be.op(op::SkipBwd { dy, h, s, w, z: gated.then_some((z, dz)), dh, ds, dw });
        let mut wrts = vec![wrt(format!("dh (gated {gated})"), h, dh, false), wrt("ds", s, ds, false), wrt("dw", w, dw, true)];
        if gated {
            wrts.push(wrt("dz", z, dz, true));
        }
        check(&mut lab, fwd, bwd, out, dy, &wrts);
    }
}

/// `qk_norm_rope_bwd` with partial RoPE (4 of 6 dims), 66 rows at positions `n % 3` (tables
/// differing per position), `x` and `dx` column views of 15-wide matrices; with a gain
/// (`dgain` accumulated) and without.
#[test]
fn qk_norm_rope() {
    let s = HeadShape { rows: 66, heads: 2, d: 6, rot: 4, t: 3 };
    let (w, ld, half) = (s.heads * s.d, 15, s.rot / 2);
    for gained in [true, false] {
        let mut lab = Lab::new(5);
        let x = lab.buf(s.rows * ld).mat(s.rows, ld).cols(2, w);
        let (out, rstd, gain, cos, sin) =
            (lab.buf(s.rows * w), lab.buf(s.rows * s.heads), lab.buf(s.heads), lab.buf(s.t * half), lab.buf(s.t * half));
        let angles: Vec<f64> = (0..s.t * half).map(|i| 0.3 + 0.7 * i as f64).collect();
        lab.set(cos, &angles.iter().map(|a| a.cos()).collect::<Vec<_>>());
        lab.set(sin, &angles.iter().map(|a| a.sin()).collect::<Vec<_>>());
        let (dy, dgain) = (lab.buf(s.rows * w), lab.buf(s.heads));
        let dx = lab.buf(s.rows * ld).mat(s.rows, ld).cols(1, w);
        let fwd = |be: &mut Be| be.op(op::QkNormRopeFwd { x, out, rstd, gain: gained.then_some(gain), cos, sin, s, eps: 1e-5 });
        let bwd = |be: &mut Be| be.op(op::QkNormRopeBwd { x, rstd, dy, dx, gain: gained.then_some((gain, dgain)), cos, sin, s });
        let mut wrts = vec![wrt(format!("dx (gain {gained})"), x, dx, false)];
        if gained {
            wrts.push(wrt("dgain", gain, dgain, true));
        }
        check(&mut lab, fwd, bwd, out, dy, &wrts);
    }
}

/// `attention_bwd` with GQA (4 query heads on 2 KV heads, d = 4, 2 sequences of 5 tokens),
/// q, k, v column views of one fused `(10, 32)` matrix, `dv` a view of a fused gradient
/// (`dq`, `dk` contiguous, as the schedule passes them); `dv` written and accumulated.
#[test]
fn attention() {
    let s = AttnShape { batch: 2, t: 5, heads: 4, kv_heads: 2, d: 4, docs: None };
    let (n, hd, kvd) = (s.batch * s.t, s.heads * s.d, s.kv_heads * s.d);
    let wide = hd + 2 * kvd;
    for dv_acc in [false, true] {
        let mut lab = Lab::new(6);
        let qkv = lab.buf(n * wide).mat(n, wide);
        let (q, k, v) = (qkv.cols(0, hd), qkv.cols(hd, kvd), qkv.cols(hd + kvd, kvd));
        let (out, dy) = (lab.buf(n * hd), lab.buf(n * hd));
        let (dq, dk) = (lab.buf(n * hd).mat(n, hd), lab.buf(n * kvd).mat(n, kvd));
        let dv = lab.buf(n * wide).mat(n, wide).cols(hd + kvd, kvd);
        let fwd = |be: &mut Be| be.op(op::AttentionFwd { q, k, v, out, s });
        let bwd = |be: &mut Be| be.op(op::AttentionBwd { q, k, v, out, dout: dy, dq, dk, dv, dv_acc, s });
        let wrts = [wrt(format!("dq (dv_acc {dv_acc})"), q, dq, false), wrt("dk", k, dk, false), wrt("dv", v, dv, dv_acc)];
        check(&mut lab, fwd, bwd, out, dy, &wrts);
    }
}

/// `xsa_bwd` (4 query heads on 2 KV heads, 66 rows): `dy` and `dv` written, `v` and `dv`
/// column views of 10-wide matrices.
#[test]
fn xsa() {
    let s = AttnShape { batch: 2, t: 33, heads: 4, kv_heads: 2, d: 4, docs: None };
    let (n, hd, kvd, ld) = (s.batch * s.t, s.heads * s.d, s.kv_heads * s.d, 10);
    let mut lab = Lab::new(7);
    let (y, v) = (lab.buf(n * hd), lab.buf(n * ld).mat(n, ld).cols(1, kvd));
    let (out, dout, dy) = (lab.buf(n * hd), lab.buf(n * hd), lab.buf(n * hd));
    let dv = lab.buf(n * ld).mat(n, ld).cols(2, kvd);
    let fwd = |be: &mut Be| be.op(op::XsaFwd { y, v, out, s });
    let bwd = |be: &mut Be| be.op(op::XsaBwd { dout, y, v, dy, dv, s });
    check(&mut lab, fwd, bwd, out, dout, &[wrt("dy", y, dy, false), wrt("dv", v, dv, false)]);
}

/// `act_bwd` of `relu²` (slope 0) and `leaky_relu(0.5)²`, inputs of both signs away from 0.
#[test]
fn act() {
    for slope in [0.0, 0.5] {
        let mut lab = Lab::new(8);
        let a = Activation { slope };
        let (pre, out, dy, dpre) = (lab.buf(50), lab.buf(50), lab.buf(50), lab.buf(50));
        let fwd = |be: &mut Be| be.op(op::ActFwd { pre, out, a });
        let bwd = |be: &mut Be| be.op(op::ActBwd { pre, dout: dy, dpre, a });
        check(&mut lab, fwd, bwd, out, dy, &[wrt(format!("dpre (slope {slope})"), pre, dpre, false)]);
    }
}

/// The harness can fail: `act_bwd` at slope 0.5 checked against `act_fwd` at slope 0.45.
#[test]
#[should_panic(expected = "relative error")]
fn harness_catches_a_wrong_gradient() {
    let mut lab = Lab::new(8);
    let (pre, out, dy, dpre) = (lab.buf(50), lab.buf(50), lab.buf(50), lab.buf(50));
    let fwd = |be: &mut Be| be.op(op::ActFwd { pre, out, a: Activation { slope: 0.45 } });
    let bwd = |be: &mut Be| be.op(op::ActBwd { pre, dout: dy, dpre, a: Activation { slope: 0.5 } });
    check(&mut lab, fwd, bwd, out, dy, &[wrt("dpre", pre, dpre, false)]);
}

/// `softcap_ce` (cap 3 on logits up to 4: the cap bites; 20 rows: two blocks of 16): each row's
/// loss against `logsumexp(z) - z[y]`, and the logits it leaves (`grad_scale` 1) against
/// central differences of the sum of the losses; `grad_scale` 0.25 scales them.
#[test]
fn softcap_ce() {
    let (rows, vocab, cap) = (20, 7, 3.0);
    let mut lab = Lab::new(9);
    let src = lab.buf(rows * vocab);
    let scaled: Vec<f64> = lab.get(src).iter().map(|x| 4.0 * x).collect();
    lab.set(src, &scaled);
    let (logits, losses) = (lab.buf(rows * vocab), lab.buf(rows));
    let targets: Vec<u32> = (0..rows).map(|_| lab.rng.u32(0..vocab as u32)).collect();
    lab.be.set_tokens(&vec![0; rows], &targets);
    let run = |be: &mut Be, grad_scale: f64| {
        be.op(op::CopyBuf { dst: logits, src });
        be.op(op::SoftcapCe { logits, losses, vocab, cap, grad_scale });
    };
    run(&mut lab.be, 1.0);
    let (grad, got) = (lab.get(logits), lab.get(losses));
    for (n, (row, &y)) in scaled.chunks(vocab).zip(&targets).enumerate() {
        let z: Vec<f64> = row.iter().map(|x| cap * (x / cap).tanh()).collect();
        let want = z.iter().map(|z| z.exp()).sum::<f64>().ln() - z[y as usize];
        assert!((got[n] - want).abs() < 1e-12, "row {n}: loss {} against {want}", got[n]);
    }
    let numeric = numeric(&mut lab, &|be: &mut Be| run(be, 1.0), losses, &vec![1.0; rows], &src.idx());
    assert_close("dlogits", &grad, &numeric);
    run(&mut lab.be, 0.25);
    let quarter: Vec<f64> = grad.iter().map(|g| 0.25 * g).collect();
    assert_close("dlogits (grad_scale 0.25)", &lab.get(logits), &quarter);
}

/// `embedding_bwd` with repeated ids (and two ids unused): `dtable` accumulated.
#[test]
fn embedding() {
    let (vocab, dim) = (6, 3);
    let ids = [2, 0, 2, 5, 2, 0, 3, 5];
    let mut lab = Lab::new(10);
    lab.be.set_tokens(&ids, &ids);
    let (table, out, dy, dtable) = (lab.buf(vocab * dim), lab.buf(ids.len() * dim), lab.buf(ids.len() * dim), lab.buf(vocab * dim));
    let fwd = |be: &mut Be| be.op(op::EmbeddingFwd { table, out, dim, ids: op::Ids::Tokens });
    let bwd = |be: &mut Be| be.op(op::EmbeddingBwd { dout: dy, dtable, dim, ids: op::Ids::Tokens });
    check(&mut lab, fwd, bwd, out, dy, &[wrt("dtable", table, dtable, true)]);
}

/// The same ops at BigramHash's buckets (5 of them, sequences of 3: buckets repeat, and the
/// sequences' first positions share the last one).
#[test]
fn embedding_at_bigram_buckets() {
    let (buckets, dim) = (5, 3);
    let ids = op::Ids::Bigram { buckets, t: 3 };
    let x = [2, 0, 2, 5, 2, 0, 3, 5, 5];
    let mut lab = Lab::new(10);
    lab.be.set_tokens(&x, &x);
    let (table, out, dy, dtable) = (lab.buf(buckets * dim), lab.buf(x.len() * dim), lab.buf(x.len() * dim), lab.buf(buckets * dim));
    let fwd = |be: &mut Be| be.op(op::EmbeddingFwd { table, out, dim, ids });
    let bwd = |be: &mut Be| be.op(op::EmbeddingBwd { dout: dy, dtable, dim, ids });
    check(&mut lab, fwd, bwd, out, dy, &[wrt("dtable", table, dtable, true)]);
}
