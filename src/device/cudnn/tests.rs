//! The cache's call sequence against a recording stand-in of the library, the CPU interpreter
//! against a dense reference (itself checked by finite differences), and the loader's refusals.

use std::cell::RefCell;

use super::*;

/// What the stand-in was asked.
#[derive(Clone, Debug, PartialEq)]
enum Call {
    Build(SdpaDesc),
    Alloc(usize),
    Execute { graph: usize, ptrs: SdpaPtrs, workspace: u64 },
}

/// A library that records every call, builds graph `n` for the n-th build, needs
/// `need(desc)` bytes of workspace, and refuses descriptors with `d == 96`.
struct Recorder {
    calls: RefCell<Vec<Call>>,
    built: usize,
    need: fn(&SdpaDesc) -> usize,
}

impl SdpaLib for Recorder {
    type Graph = usize;
    fn build(&mut self, desc: &SdpaDesc) -> anyhow::Result<(usize, usize)> {
        self.calls.borrow_mut().push(Call::Build(*desc));
        anyhow::ensure!(desc.d != 96, "no engine supports this graph");
        self.built += 1;
        Ok((self.built - 1, (self.need)(desc)))
    }
    fn alloc_workspace(&mut self, bytes: usize) -> anyhow::Result<u64> {
        self.calls.borrow_mut().push(Call::Alloc(bytes));
        Ok(0x1000_0000 * self.calls.borrow().len() as u64)
    }
    fn execute(&self, graph: &usize, ptrs: &SdpaPtrs, workspace: u64) -> anyhow::Result<()> {
        self.calls.borrow_mut().push(Call::Execute { graph: *graph, ptrs: *ptrs, workspace });
        Ok(())
    }
}

/// A forward descriptor of `b` sequences of `s` tokens, `h` heads (`h_kv` shared) of `d`,
/// token-major rows of `ld` elements for q, k, v (o packed).
fn desc(b: usize, s: usize, h: usize, h_kv: usize, d: usize, ld: usize) -> SdpaDesc {
    SdpaDesc {
        backward: false,
        causal: true,
        ragged: false,
        deterministic: true,
        b,
        h,
        h_kv,
        s,
        d,
        max_total: 0,
        scale_bits: (1.0 / (d as f32).sqrt()).to_bits(),
        q: token_major(s, d, ld),
        k: token_major(s, d, ld),
        v: token_major(s, d, ld),
        o: token_major(s, d, h * d),
        dq: [0; 4],
        dk: [0; 4],
        dv: [0; 4],
        stats: stats_token_major(s, h),
    }
}

fn backward(mut d: SdpaDesc) -> SdpaDesc {
    d.backward = true;
    (d.dq, d.dk, d.dv) = (d.o, token_major(d.s, d.d, d.h_kv * d.d), token_major(d.s, d.d, d.h_kv * d.d));
    d
}

#[test]
fn a_graph_is_built_once_per_descriptor_and_the_workspace_grows_to_the_largest_need() {
    let mut c = SdpaCache::new(Recorder { calls: RefCell::default(), built: 0, need: |d| if d.backward { 3 << 20 } else { 1000 } });
    let (f, b) = (desc(2, 128, 4, 2, 64, 512), backward(desc(2, 128, 4, 2, 64, 512)));
    let p = SdpaPtrs { q: 1, k: 2, v: 3, o: 4, stats: 5, ..Default::default() };
    c.prepare(&f).unwrap();
    c.prepare(&f).unwrap();
    c.execute(&f, &p).unwrap();
    c.prepare(&b).unwrap();
    c.execute(&b, &p).unwrap();
    c.execute(&f, &p).unwrap();
    let calls = c.lib().calls.borrow().clone();
    // Forward: built once, 1000 bytes rounded to 1 MiB; backward: built once, the workspace
    // grown to 3 MiB, which every later execution gets (the forward's too).
    let (w1, w2) = (0x1000_0000 * 2, 0x1000_0000 * 5);
    assert_eq!(
        calls,
        vec![
            Call::Build(f),
            Call::Alloc(1 << 20),
            Call::Execute { graph: 0, ptrs: p, workspace: w1 },
            Call::Build(b),
            Call::Alloc(3 << 20),
            Call::Execute { graph: 1, ptrs: p, workspace: w2 },
            Call::Execute { graph: 0, ptrs: p, workspace: w2 },
        ]
    );
    assert_eq!((c.built(), c.workspace_bytes()), (2, 3 << 20));
}

#[test]
fn a_refusal_is_asked_once_and_named_and_unsupported_shapes_never_reach_the_library() {
    let mut c = SdpaCache::new(Recorder { calls: RefCell::default(), built: 0, need: |_| 0 });
    let refused = desc(1, 64, 2, 2, 96, 192);
    for _ in 0..2 {
        let e = c.prepare(&refused).unwrap_err().to_string();
        assert!(e.contains("forward 1 x 2 heads (2 kv) x 64 x 96") && e.contains("no engine supports"), "{e}");
    }
    assert!(c.execute(&refused, &SdpaPtrs::default()).unwrap_err().to_string().contains("no engine supports"));
    // Head width 200, an odd row stride, heads that do not share evenly: refused before cuDNN.
    for bad in [desc(1, 64, 2, 2, 200, 400), desc(1, 64, 2, 2, 64, 130), desc(1, 64, 3, 2, 64, 192)] {
        assert!(bad.unsupported().is_some(), "{bad:?}");
        assert!(c.prepare(&bad).is_err());
    }
    let e = c.execute(&desc(1, 64, 2, 2, 64, 128), &SdpaPtrs::default()).unwrap_err().to_string();
    assert!(e.contains("before it was prepared"), "{e}");
    // The library saw the one refused build, nothing else; no workspace was needed.
    assert_eq!(c.lib().calls.borrow().clone(), vec![Call::Build(refused)]);
}

/// Element `e` of head `h`, position `i` of sequence `b` in a dense `(B, T, H, D)` array.
fn at(t: usize, h: usize, d: usize, b: usize, i: usize, hh: usize, e: usize) -> usize {
    ((b * t + i) * h + hh) * d + e
}

/// Dense causal attention of `(B, T, H, D)` arrays in f64: `(o, stats)`, and with `dout` the
/// gradients `(dq, dk, dv)` by the matrix formulas.
#[allow(clippy::type_complexity)]
fn dense(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    (bn, t, h, hk, d): (usize, usize, usize, usize, usize),
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = 1.0 / (d as f64).sqrt();
    let (mut o, mut lse) = (vec![0.0; bn * t * h * d], vec![0.0; bn * t * h]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for b in 0..bn {
        for hh in 0..h {
            let g = hh / (h / hk);
            // P (T x T), masked above the diagonal.
            let mut p = vec![0.0; t * t];
            for i in 0..t {
                let s: Vec<f64> =
                    (0..=i).map(|j| c * (0..d).map(|e| q[at(t, h, d, b, i, hh, e)] * k[at(t, hk, d, b, j, g, e)]).sum::<f64>()).collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                lse[(b * t + i) * h + hh] = m + z.ln();
                for j in 0..=i {
                    p[i * t + j] = (s[j] - m).exp() / z;
                }
            }
            for i in 0..t {
                for e in 0..d {
                    o[at(t, h, d, b, i, hh, e)] = (0..t).map(|j| p[i * t + j] * v[at(t, hk, d, b, j, g, e)]).sum();
                }
            }
            for i in 0..t {
                let delta: f64 = (0..d).map(|e| dout[at(t, h, d, b, i, hh, e)] * o[at(t, h, d, b, i, hh, e)]).sum();
                for j in 0..t {
                    let dp: f64 = (0..d).map(|e| dout[at(t, h, d, b, i, hh, e)] * v[at(t, hk, d, b, j, g, e)]).sum();
                    let ds = p[i * t + j] * (dp - delta);
                    for e in 0..d {
                        dq[at(t, h, d, b, i, hh, e)] += c * ds * k[at(t, hk, d, b, j, g, e)];
                        dk[at(t, hk, d, b, j, g, e)] += c * ds * q[at(t, h, d, b, i, hh, e)];
                        dv[at(t, hk, d, b, j, g, e)] += p[i * t + j] * dout[at(t, h, d, b, i, hh, e)];
                    }
                }
            }
        }
    }
    (o, lse, dq, dk, dv)
}

fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut r = fastrand::Rng::with_seed(seed);
    // bf16-exact values, so that the interpreter reads what the reference reads.
    (0..n).map(|_| half::bf16::from_f64(r.f64() * 2.0 - 1.0).to_f64()).collect()
}

#[test]
fn the_dense_reference_gradients_match_finite_differences() {
    let dims = (1, 5, 2, 1, 4);
    let (q, k, v, g) = (values(40, 1), values(20, 2), values(20, 3), values(40, 4));
    let (_, _, dq, dk, dv) = dense(&q, &k, &v, &g, dims);
    let loss = |q: &[f64], k: &[f64], v: &[f64]| dense(q, k, v, &g, dims).0.iter().zip(&g).map(|(a, b)| a * b).sum::<f64>();
    let h = 1e-6;
    for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
        for i in 0..grad.len() {
            let (mut a, mut b, mut c) = (q.clone(), k.clone(), v.clone());
            let (mut a2, mut b2, mut c2) = (q.clone(), k.clone(), v.clone());
            let (x, y) = match which {
                0 => (&mut a[i], &mut a2[i]),
                1 => (&mut b[i], &mut b2[i]),
                _ => (&mut c[i], &mut c2[i]),
            };
            *x += h;
            *y -= h;
            let fd = (loss(&a, &b, &c) - loss(&a2, &b2, &c2)) / (2.0 * h);
            assert!((fd - grad[i]).abs() < 1e-6, "tensor {which} element {i}: {fd} vs {}", grad[i]);
        }
    }
}

/// A byte memory with bf16 / f32 / i32 arrays placed at increasing addresses.
#[derive(Default)]
struct Memory(Vec<u8>);

impl Memory {
    fn bf16(&mut self, x: &[f64]) -> u64 {
        let at = self.0.len() as u64;
        self.0.extend(x.iter().flat_map(|&v| half::bf16::from_f64(v).to_bits().to_ne_bytes()));
        self.0.resize(self.0.len().div_ceil(16) * 16, 0);
        at
    }
    fn words(&mut self, x: &[u32]) -> u64 {
        let at = self.0.len() as u64;
        self.0.extend(x.iter().flat_map(|v| v.to_ne_bytes()));
        self.0.resize(self.0.len().div_ceil(16) * 16, 0);
        at
    }
    fn read_bf16(&self, at: u64, n: usize) -> Vec<f64> {
        (0..n).map(|i| half::bf16::from_bits(u16::from_ne_bytes(self.0[at as usize + 2 * i..][..2].try_into().unwrap())).to_f64()).collect()
    }
    fn read_f32(&self, at: u64, n: usize) -> Vec<f64> {
        (0..n).map(|i| f32::from_ne_bytes(self.0[at as usize + 4 * i..][..4].try_into().unwrap()) as f64).collect()
    }
}

/// Worst `|a - b| / (1 + |b|)`.
fn worst(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0.0, f64::max)
}

#[test]
fn the_interpreter_reads_strided_gqa_operands_in_place_and_matches_the_dense_reference() {
    // Two sequences of 16, 4 query heads on 2 KV heads of 8: q, k, v are column slices of one
    // fused row (q | k | v, ld = 64), as the engine's qkv projection leaves them.
    let (bn, t, h, hk, d) = (2, 16, 4, 2, 8);
    let ld = h * d + 2 * hk * d;
    let (q, k, v, g) = (values(bn * t * h * d, 5), values(bn * t * hk * d, 6), values(bn * t * hk * d, 7), values(bn * t * h * d, 8));
    let mut fused = vec![0.0; bn * t * ld];
    for r in 0..bn * t {
        fused[r * ld..r * ld + h * d].copy_from_slice(&q[r * h * d..(r + 1) * h * d]);
        fused[r * ld + h * d..r * ld + (h + hk) * d].copy_from_slice(&k[r * hk * d..(r + 1) * hk * d]);
        fused[r * ld + (h + hk) * d..(r + 1) * ld].copy_from_slice(&v[r * hk * d..(r + 1) * hk * d]);
    }
    let mut m = Memory::default();
    let base = m.bf16(&fused);
    let (o, dout) = (m.bf16(&vec![0.0; q.len()]), m.bf16(&g));
    let stats = m.words(&vec![0; bn * t * h]);
    let (dq, dk, dv) = (m.bf16(&vec![0.0; q.len()]), m.bf16(&vec![0.0; k.len()]), m.bf16(&vec![0.0; v.len()]));
    let p = SdpaPtrs {
        q: base,
        k: base + 2 * (h * d) as u64,
        v: base + 2 * ((h + hk) * d) as u64,
        o,
        dout,
        dq,
        dk,
        dv,
        stats,
        ..Default::default()
    };
    let f = desc(bn, t, h, hk, d, ld);
    interpret::run(&f, &p, &mut m.0).unwrap();
    interpret::run(&backward(f), &p, &mut m.0).unwrap();
    // The reference reads o as stored (bf16), as the backward pass does.
    let (ro, rl, _, _, _) = dense(&q, &k, &v, &g, (bn, t, h, hk, d));
    let got_o = m.read_bf16(o, q.len());
    assert!(worst(&got_o, &ro) < 8e-3, "o: {}", worst(&got_o, &ro));
    assert!(worst(&m.read_f32(stats, rl.len()), &rl) < 1e-6);
    let (_, _, rdq, rdk, rdv) = dense(&q, &k, &v, &g, (bn, t, h, hk, d));
    for (name, at, r) in [("dq", dq, &rdq), ("dk", dk, &rdk), ("dv", dv, &rdv)] {
        let e = worst(&m.read_bf16(at, r.len()), r);
        assert!(e < 2e-2, "{name}: {e}");
    }
}

#[test]
fn ragged_slots_attend_within_their_documents_and_a_wrong_length_is_refused() {
    // One row of 16 tokens holding documents of 5, 8 and 3 tokens, in slots 0, 1 and 2 of 16,
    // packed (each slot starting where the one before ends: the engine's layout); the other
    // slots are empty, at the row's end.
    let (t, h, hk, d) = (16, 2, 1, 8);
    let docs = [(0usize, 5usize), (5, 8), (13, 3)];
    let (q, k, v, g) = (values(t * h * d, 9), values(t * hk * d, 10), values(t * hk * d, 11), values(t * h * d, 12));
    let mut m = Memory::default();
    let (qa, ka, va) = (m.bf16(&q), m.bf16(&k), m.bf16(&v));
    let o = m.bf16(&vec![7.0; q.len()]);
    let dout = m.bf16(&g);
    let stats = m.words(&vec![0; t * h]);
    let (dq, dk, dv) = (m.bf16(&vec![0.0; q.len()]), m.bf16(&vec![0.0; k.len()]), m.bf16(&vec![0.0; v.len()]));
    let mut lens = vec![0u32; t];
    let mut starts = vec![t; t + 1];
    for (slot, &(s, n)) in docs.iter().enumerate() {
        (lens[slot], starts[slot]) = (n as u32, s);
    }
    let seq_len = m.words(&lens);
    let offs = |unit: usize| starts.iter().map(|p| (p * unit) as u32).collect::<Vec<_>>();
    let (oq, okv, ost) = (m.words(&offs(h * d)), m.words(&offs(hk * d)), m.words(&offs(h)));
    let mut f = desc(t, t, h, hk, d, h * d);
    (f.k, f.v, f.ragged, f.max_total) = (token_major(t, d, hk * d), token_major(t, d, hk * d), true, t);
    let p = SdpaPtrs {
        q: qa,
        k: ka,
        v: va,
        o,
        dout,
        dq,
        dk,
        dv,
        stats,
        seq_len,
        off_q: oq,
        off_k: okv,
        off_v: okv,
        off_o: oq,
        off_dq: oq,
        off_dk: okv,
        off_dv: okv,
        off_stats: ost,
    };
    interpret::run(&f, &p, &mut m.0).unwrap();
    interpret::run(&backward(f), &p, &mut m.0).unwrap();
    // Each document alone, as one sequence of the dense reference.
    let (got_o, got_dq, got_dk) = (m.read_bf16(o, q.len()), m.read_bf16(dq, q.len()), m.read_bf16(dk, k.len()));
    for &(s, n) in &docs {
        let part = |x: &[f64], w: usize| x[s * w..(s + n) * w].to_vec();
        let (ro, _, rdq, rdk, _) = dense(&part(&q, h * d), &part(&k, hk * d), &part(&v, hk * d), &part(&g, h * d), (1, n, h, hk, d));
        assert!(worst(&part(&got_o, h * d), &ro) < 8e-3, "document at {s}");
        assert!(worst(&part(&got_dq, h * d), &rdq) < 2e-2, "document at {s}");
        assert!(worst(&part(&got_dk, hk * d), &rdk) < 2e-2, "document at {s}");
    }
    // A length past the sequence is refused, naming the slot; so are offsets that are not
    // packed (a slot per position, each document's slot at its start).
    let mut bad = lens.clone();
    bad[1] = 17;
    let seq_bad = m.words(&bad);
    let e = interpret::run(&f, &SdpaPtrs { seq_len: seq_bad, ..p }, &mut m.0).unwrap_err().to_string();
    assert!(e.contains("slot 1's length 17"), "{e}");
    let mut at_start = vec![0u32; t];
    for &(s, n) in &docs {
        at_start[s] = n as u32;
    }
    let (seq_sparse, every) = (m.words(&at_start), m.words(&(0..=t).map(|p| (p * h * d) as u32).collect::<Vec<_>>()));
    let e = interpret::run(&f, &SdpaPtrs { seq_len: seq_sparse, off_q: every, ..p }, &mut m.0).unwrap_err().to_string();
    assert!(e.contains("slot 0 starts at 0 with 5 rows of 16, the next at 16 (not packed)"), "{e}");
}

#[test]
fn a_missing_or_foreign_library_is_refused_naming_what_was_tried() {
    let e = load::open(&["/nonexistent/libcudnn.so.9".into()]).unwrap_err();
    assert!(e.contains("/nonexistent/libcudnn.so.9") && e.contains(load::ENV) && e.contains("LD_LIBRARY_PATH"), "{e}");
    // A real library that is not cuDNN.
    let e = load::open(&["libc.so.6".into(), "/nonexistent/x.so".into()]).unwrap_err();
    assert!(e.contains("libc.so.6 (no cudnnGetVersion: not a cuDNN library)"), "{e}");
    assert_eq!(load::version_name(92801), "9.28.1");
}
