//! Every op of the GPU backend ([`KernelBackend`] over the warp emulator: the kernels of
//! `kernels/engine.cu` and `kernels/flash_mma.cu` compiled for the CPU, launched exactly as the
//! CUDA device launches them) against its CPU reference ([`CpuBackend<f64>`]), on one random
//! arena: the whole arena is compared after each op, so a write outside an op's outputs fails
//! too. Shapes cross the kernels' edges: rows not a multiple of a block (8) or of a partial sum
//! (64), rows wider than a warp and not a multiple of it, strided views.

use candle_core::{Device as CandleDevice, Tensor};

use std::path::Path;

use super::emu::{self, EmuDevice};
use super::{Capacity, KernelBackend};
use crate::engine::backend::{Activation, AdamStep, AttnShape, Backend, Buf, HeadShape, Mat};
use crate::engine::cpu::CpuBackend;
use crate::engine::layout::Bump;

/// Tokens (rows) of the row ops: more than one partial sum (64), not a multiple of 8.
const N: usize = 70;
/// Row width: wider than a warp, not a multiple of 32.
const W: usize = 48;
const VOCAB: usize = 40;

fn capacity(tokens: usize, heads: usize, d: usize, kv_heads: usize) -> Capacity {
    Capacity { tokens, vocab: VOCAB, width: 2 * W, attn_width: heads * d, kv_width: kv_heads * d, heads, attention_calls: 2 }
}

fn emulated(exe: &Path, len: usize, cap: Capacity, name: &str) -> KernelBackend<EmuDevice> {
    let file = emu::temp_dir().join(format!("{name}.mem"));
    KernelBackend::new(EmuDevice::new(exe, file), len, cap).expect("the emulated device allocates")
}

fn tokens(seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let x = (0..N).map(|_| rng.u32(0..VOCAB as u32 / 2) * 2).collect(); // some rows unused, some repeated
    let y = (0..N).map(|_| rng.u32(0..VOCAB as u32)).collect();
    (x, y)
}

/// Runs `op` on the emulated backend and on the f64 CPU backend from the same random arena of
/// `len` values in [-1, 1) and compares every element: `|gpu - cpu| <= tol max(1, |cpu|)`.
fn check(name: &str, len: usize, cap: Capacity, tol: f64, op: impl Fn(&mut dyn Backend)) {
    check_on(emu::emulator(), name, len, cap, tol, op)
}

/// [`check`] on the emulator `exe`.
fn check_on(exe: &Path, name: &str, len: usize, cap: Capacity, tol: f64, op: impl Fn(&mut dyn Backend)) {
    let mut rng = fastrand::Rng::with_seed(name.len() as u64 * 7919);
    let init: Vec<f32> = (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let init = Tensor::from_vec(init, len, &CandleDevice::Cpu).unwrap();
    let all = Buf { off: 0, len };
    let mut gpu = emulated(exe, len, cap, name);
    let mut cpu = CpuBackend::<f64>::new(len);
    gpu.upload(all, &init).unwrap();
    cpu.upload(all, &init).unwrap();
    op(&mut gpu);
    op(&mut cpu);
    let got: Vec<f32> = gpu.download(all, &[len]).unwrap().to_vec1().unwrap();
    let want: Vec<f64> = cpu.download(all, &[len]).unwrap().to_vec1().unwrap();
    let mut worst = (0.0f64, 0usize);
    for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let err = if g.is_nan() && w.is_nan() { 0.0 } else { (g as f64 - w).abs() / w.abs().max(1.0) };
        let err = if err.is_nan() { f64::INFINITY } else { err };
        if err > worst.0 {
            worst = (err, k);
        }
    }
    let k = worst.1;
    assert!(
        worst.0 <= tol,
        "{name}: element {k} is {} on the emulated GPU, {} on the CPU (error {:.2e} > {tol:.0e})",
        got[k],
        want[k],
        worst.0
    );
}

fn cap() -> Capacity {
    capacity(N, 3, 16, 1)
}

#[test]
fn flat_ops_and_reductions_match_the_cpu() {
    check("flat", 600, cap(), 1e-6, |be| {
        let mut r = Bump::default();
        let (a, b, c) = (r.take(100), r.take(100), r.take(100));
        be.fill(a, 0.25);
        be.scale(b, -3.0);
        be.copy(c, b);
        let (s, q) = (be.sum(b), be.sum_sq(c));
        // The reductions' values land in the arena, so the comparison covers them.
        be.fill(r.take(1), s / 10.0);
        be.fill(r.take(1), q / 100.0);
        assert!(be.all_finite(c));
        be.fill(c.sub(5, 1), f64::NAN);
        assert!(!be.all_finite(c));
        be.axpby(0.5, a, -2.0, r.take(100));
        be.ema(r.take(50), b.sub(0, 50), 0.9);
        // Device scalars: a sum added twice; clipping that scales and clipping that does not.
        let total = r.take(1);
        be.sum_into(b, total);
        be.sum_into(a, total);
        let (g, norm) = (r.take(100), r.take(2));
        be.copy(g, b);
        be.clip_norm(g, 0.5, norm.sub(0, 1));
        be.clip_norm(g, 1e3, norm.sub(1, 1));
    });
}

/// The optimizer ops inside a unit of work run three times with new learning rates and
/// momentum each time: on the emulated GPU the first run is op by op, the second captured, the
/// third replayed, and each must use its own values (read from the schedule scalars when
/// replayed), as the CPU does.
#[test]
fn a_replayed_unit_reads_each_steps_schedule_scalars() {
    check("unit", 2000, cap(), 2e-6, |be| {
        let mut r = Bump::default();
        let (p, g, m, v, buf, u) = (r.take(200), r.take(200), r.take(200), r.take(200), r.take(200), r.take(200));
        be.fill(v, 0.5);
        for k in 0..3 {
            let x = 1.0 + k as f64;
            be.begin_unit("optimizer");
            let s = AdamStep { lr: 0.01 * x, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.04, bias1: 0.1 * x, bias2_sqrt: 0.2 * x };
            be.adam(p, g, m, v, s);
            be.momentum(g, buf, u, 0.8 + 0.05 * x, true);
            be.axpby(-0.1 * x, u, 1.0 - 0.01 * x, p);
            be.sgd(p, g, buf, 0.1 * x, 0.9, false);
            be.end_unit();
        }
        if let Some(c) = be.graph_counts() {
            assert_eq!((c.eager, c.captured, c.replayed), (1, 1, 2), "{c:?}");
        }
    });
}

#[test]
fn optimizer_ops_match_the_cpu() {
    check("optim", 3000, cap(), 2e-6, |be| {
        let mut r = Bump::default();
        let (p, g, m, v) = (r.take(300), r.take(300), r.take(300), r.take(300));
        let sq: Vec<f32> = (0..300).map(|k| (k as f32 * 0.37).sin().powi(2)).collect();
        be.upload(v, &Tensor::from_vec(sq, 300, &CandleDevice::Cpu).unwrap()).unwrap();
        let s = AdamStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.04, bias1: 0.19, bias2_sqrt: 0.3 };
        be.adam(p, g, m, v, s);
        be.adam(p, g, m, v, AdamStep { weight_decay: 0.0, ..s });
        let (buf, u) = (r.take(300), r.take(300));
        be.momentum(g, buf, u, 0.95, true);
        be.momentum(g, buf, u, 0.85, false);
        be.sgd(p, g, buf, 0.1, 0.9, true);
        be.sgd(p, g, buf, 0.1, 0.9, false);
        be.sgd(p, g, buf, 0.1, 0.0, false);
        // Newton-Schulz helpers: 3 matrices of 7 x 11.
        let x = r.take(3 * 77);
        be.row_normalize(x, 11, 1e-7);
        be.normalize_each(x, 3, 1e-7);
        be.transpose_each(x, r.take(3 * 77), 3, 7, 11);
    });
}

#[test]
fn gemm_plans_match_the_cpu_for_every_layout() {
    check("gemm", 4000, cap(), 1e-5, |be| {
        let mut r = Bump::default();
        let (m, n, k) = (13, 9, 37);
        let wide = r.take(m * 50).mat(m, 50); // a is a column view of a wider matrix
        let a = wide.cols(3, k);
        let at = r.take(k * m).mat(k, m).t();
        let b = r.take(k * n).mat(k, n);
        let bt = r.take(n * k).mat(n, k).t();
        let c = r.take(m * n).mat(m, n);
        be.gemm(c, a, b, 1.0, 0.0);
        be.gemm(c, at, bt, 0.5, 1.0);
        be.gemm(c, a, bt, 1.0, 1.0);
        be.gemm(c, at, b, -1.0, 0.5);
    });
}

#[test]
fn row_ops_match_the_cpu() {
    check_rows(emu::emulator(), "rows");
}

/// An RMS norm backward that divides by one column too many fails the comparison: the harness
/// sees a wrong kernel.
#[test]
#[should_panic(expected = "on the emulated GPU")]
fn a_wrong_kernel_fails_the_comparison() {
    let from = "c = scale * warp_sum(s) * inv * inv * inv / cols;";
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/engine.cu")).unwrap();
    assert_eq!(src.matches(from).count(), 1, "the mutated line occurs once");
    let dir = emu::temp_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let mutant = dir.join("engine_mutant.cu");
    std::fs::write(&mutant, src.replace(from, "c = scale * warp_sum(s) * inv * inv * inv / (cols + 1);")).unwrap();
    check_rows(&emu::build(&dir, "engine_emu_mutant", Some(&mutant)), "rows_mutant");
}

fn check_rows(exe: &Path, name: &str) {
    let len = 40 * N * W;
    check_on(exe, name, len, cap(), 2e-5, |be| {
        let (x, y) = tokens(5);
        be.set_tokens(&x, &y);
        let mut r = Bump::default();
        let nw = N * W;
        let (h, x0, mix, out, rstd) = (r.take(nw), r.take(nw), r.take(2 * W), r.take(nw), r.take(N));
        be.rms_norm_fwd(h, out, rstd, W, 0.7, 1e-6);
        let (dy, dx) = (r.take(nw), r.take(nw));
        be.rms_norm_bwd(h, rstd, dy, dx, W, 0.7, false);
        be.rms_norm_bwd(h, rstd, dy, dx, W, 1.3, true);
        let u = r.take(nw);
        be.resid_mix_fwd(h, x0, mix, u);
        let (dh, dx0, dmix) = (r.take(nw), r.take(nw), r.take(2 * W));
        be.resid_mix_bwd(dy, h, x0, mix, dh, dx0, dmix);
        let s = r.take(W);
        be.scale_add_fwd(h, x0, s, r.take(nw));
        be.scale_add_fwd(u, x0, s, u);
        be.scale_add_bwd(dy, x0, s, r.take(nw), r.take(W));
        let (w, z) = (r.take(W), r.take(W));
        be.skip_fwd(h, x0, w, None, r.take(nw));
        be.skip_fwd(h, x0, w, Some(z), r.take(nw));
        be.skip_bwd(dy, h, x0, w, None, r.take(nw), r.take(nw), r.take(W));
        be.skip_bwd(dy, h, x0, w, Some((z, r.take(W))), r.take(nw), r.take(nw), r.take(W));
        let pre = r.take(nw);
        let act = Activation { slope: 0.5 };
        be.act_fwd(pre, r.take(nw), act);
        be.act_bwd(pre, dy, r.take(nw), act);
        be.act_fwd(pre, r.take(nw), Activation { slope: 0.0 });
        let table = r.take(VOCAB * W);
        be.embedding_fwd(table, r.take(nw), W);
        be.embedding_bwd(dy, r.take(VOCAB * W), W);
    });
}

#[test]
fn head_ops_match_the_cpu() {
    // 3 query heads of 16 on 1 KV head, q inside a fused qkv row (a strided view), 6 of 16
    // dims rotated, positions modulo t = 10.
    let (heads, d, kvh) = (3, 16, 1);
    let qkv_w = heads * d + 2 * kvh * d;
    let len = 12 * N * qkv_w;
    check("heads", len, cap(), 2e-5, |be| {
        let mut r = Bump::default();
        let qkv = r.take(N * qkv_w).mat(N, qkv_w);
        let q = qkv.cols(0, heads * d);
        let v = qkv.cols(heads * d + kvh * d, kvh * d);
        let s = HeadShape { rows: N, heads, d, rot: 6, t: 10 };
        let (cos, sin, gain) = (r.take(10 * 3), r.take(10 * 3), r.take(heads));
        let (out, rstd) = (r.take(N * heads * d), r.take(N * heads));
        be.qk_norm_rope_fwd(q, out, rstd, Some(gain), cos, sin, s, 1e-6);
        be.qk_norm_rope_fwd(q, r.take(N * heads * d), r.take(N * heads), None, cos, sin, s, 1e-6);
        let dy = r.take(N * heads * d);
        let dqkv = r.take(N * qkv_w).mat(N, qkv_w);
        be.qk_norm_rope_bwd(q, rstd, dy, dqkv.cols(0, heads * d), Some((gain, r.take(heads))), cos, sin, s);
        be.qk_norm_rope_bwd(q, rstd, dy, dqkv.cols(0, heads * d), None, cos, sin, s);
        let a = AttnShape { batch: 7, t: 10, heads, kv_heads: kvh, d };
        let y = r.take(N * heads * d);
        be.xsa_fwd(y, v, r.take(N * heads * d), a);
        be.xsa_bwd(dy, y, v, r.take(N * heads * d), dqkv.cols(heads * d + kvh * d, kvh * d), a);
    });
}

/// The ids' CSR built on the device (`eng_csr_count`, `_scan`, `_fill`) is the stable counting
/// sort the embedding's gradient reads: for chunks of 64 positions over 150 ids (three chunks,
/// the last partial and not a multiple of a warp), repeated ids within a warp and across
/// chunks, unused rows, and an id outside the vocabulary (skipped), the offsets and positions
/// equal the host's, and building it twice gives the same.
#[test]
fn the_device_builds_the_ids_csr_in_token_order() {
    use super::{Device, Space};
    let (n, vocab) = (150, 40);
    let cap = Capacity { tokens: n, vocab, width: 8, attn_width: 8, kv_width: 8, heads: 1, attention_calls: 1 };
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("csr.mem"));
    let mut be = KernelBackend::with_csr_chunk(dev, 16, cap, 64).unwrap();
    let mut rng = fastrand::Rng::with_seed(3);
    // Ids from few rows (many repeats in a warp), every other row unused; one out of range.
    let mut x: Vec<u32> = (0..n).map(|_| rng.u32(0..8) * 4).collect();
    x[77] = vocab as u32 + 3;
    let y = vec![0; n];
    let t = be.tokens;
    for round in 0..2 {
        be.set_tokens(&x, &y);
        let off = be.device().read(Space::Tokens, t.csr_off(), vocab + 1).unwrap();
        let pos = be.device().read(Space::Tokens, t.csr_pos(), n).unwrap();
        let mut want_off = vec![0u32; vocab + 1];
        for &id in x.iter().filter(|&&id| (id as usize) < vocab) {
            want_off[id as usize + 1] += 1;
        }
        for v in 0..vocab {
            want_off[v + 1] += want_off[v];
        }
        assert_eq!(off, want_off, "round {round}: offsets");
        let valid = want_off[vocab] as usize;
        let mut want_pos: Vec<u32> = (0..n as u32).filter(|&i| (x[i as usize] as usize) < vocab).collect();
        want_pos.sort_by_key(|&i| x[i as usize]); // stable: positions ascending within a row
        assert_eq!(&pos[..valid], &want_pos[..], "round {round}: positions");
    }
}

#[test]
fn softcap_cross_entropy_matches_the_cpu() {
    check("loss", 3 * N * VOCAB, cap(), 2e-5, |be| {
        let (x, y) = tokens(9);
        be.set_tokens(&x, &y);
        let mut r = Bump::default();
        let logits = r.take(N * VOCAB);
        be.scale(logits, 20.0);
        be.softcap_ce(logits, r.take(N), VOCAB, 15.0, 1.0 / N as f64);
    });
}

/// Attention in bf16 (flash_mma's kernels) against the CPU's f64: two sequences of 64 tokens,
/// two query heads of 64 on one KV head, q, k, v inside a fused qkv matrix.
#[test]
fn attention_matches_the_cpu_to_bf16_precision() {
    let (batch, t, heads, kvh, d) = (2, 64, 2, 1, 64);
    let n = batch * t;
    let w = (heads + 2 * kvh) * d;
    let cap = capacity(n, heads, d, kvh);
    check("attention", 6 * n * w, cap, 3e-2, |be| {
        // As the schedule calls it: q and k their own buffers (after the norm and RoPE), v a
        // view of the fused qkv product; dq, dk their own, dv a view of dqkv (added to, XSA).
        let mut r = Bump::default();
        let (q, k) = (r.take(n * heads * d).mat(n, heads * d), r.take(n * kvh * d).mat(n, kvh * d));
        let v = r.take(n * w).mat(n, w).cols((heads + kvh) * d, kvh * d);
        let s = AttnShape { batch, t, heads, kv_heads: kvh, d };
        let out = r.take(n * heads * d);
        be.attention_fwd(q, k, v, out, s);
        let dout = r.take(n * heads * d);
        let (dq, dk) = (r.take(n * heads * d).mat(n, heads * d), r.take(n * kvh * d).mat(n, kvh * d));
        let dv: Mat = r.take(n * w).mat(n, w).cols((heads + kvh) * d, kvh * d);
        be.attention_bwd(q, k, v, out, dout, dq, dk, dv, true, s);
    });
}

/// The whole engine on the emulated GPU against the f64 CPU engine: record-mini's switches
/// (XSA, gated skips, partial RoPE, QK gain, LeakyReLU², parallel residuals, looping) at heads
/// 64 wide (the GPU attention's), one micro-batch of one 64-token sequence, then Muon and Adam.
/// Attention runs in bf16 and the GEMMs in the interpreter's f32, so the loss agrees to 1e-3
/// and the gradients and weights to 3e-2 of their norm (1-2% measured: bf16 through six
/// virtual layers; a wrong offset or kernel gives O(1)).
#[test]
fn the_engine_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::Engine;
    use crate::engine::layout::Layout;
    use crate::engine::optim::MuonStep;
    use crate::engine::step::{ADAM_GROUPS, kernel_capacity};
    use crate::engine::tests::{flat, perturbed, record_small, tokens};
    use crate::model::ModelConfig;
    let cfg =
        ModelConfig { model_dim: 128, num_heads: 2, num_kv_heads: 1, rope_dims: Some(16), rope_train_seq_len: Some(64), ..record_small() };
    let (rows, t) = (1, 64);
    let params = perturbed(&cfg, 3).state_dict().into_iter().collect();
    let mut cpu = Engine::cpu(&cfg, rows, t, candle_core::DType::F64, false).unwrap();
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("engine.mem"));
    let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t).unwrap()).unwrap();
    let mut gpu = Engine::with_backend(&cfg, rows, t, Box::new(be), true).unwrap();
    let (x, y) = (tokens(1, rows * t, cfg.vocab_size as u32), tokens(2, rows * t, cfg.vocab_size as u32));
    let compare = |what: &str, a: Vec<(String, Tensor)>, b: Vec<(String, Tensor)>| {
        for ((name, a), (_, b)) in a.iter().zip(&b) {
            // Relative to the tensor, with a floor for the small sums of many terms (the q
            // gains' gradients, 2e-3 in norm) that bf16 rounding moves more than its share.
            let (a, b) = (flat(a), flat(b));
            let diff = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
            let norm = a.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!(diff <= 3e-2 * norm + 2e-4, "{what} {name}: difference {diff:.2e}, norm {norm:.2e}");
        }
    };
    let mut losses = Vec::new();
    for e in [&mut cpu, &mut gpu] {
        e.load_params(&params).unwrap();
        e.zero_grads();
        e.micro_step(&x, &y, true, 1.0 / (rows * t) as f64);
        losses.push(e.loss_sum().unwrap() / (rows * t) as f64);
    }
    assert!((losses[0] - losses[1]).abs() <= 1e-3 * losses[0], "mean losses {losses:?}");
    compare("gradient", cpu.grads().unwrap(), gpu.grads().unwrap());
    for e in [&mut cpu, &mut gpu] {
        e.muon(MuonStep { lr: 0.05, momentum: 0.95, nesterov: true, backend_steps: 5, row_norm: true, weight_decay: 0.01 }).unwrap();
        for (group, _) in ADAM_GROUPS {
            e.adam(group, 0.01, (0.9, 0.95), 1e-8, 0.0);
        }
    }
    compare("weight", cpu.params().unwrap(), gpu.params().unwrap());
    assert!(gpu.grads_finite() && gpu.params_finite());
}

/// The GPU engine refuses, with the reason, the shapes its attention cannot take.
#[test]
fn the_gpu_engine_refuses_shapes_its_attention_cannot_take() {
    use crate::engine::step::kernel_capacity;
    use crate::engine::tests::record_small;
    use crate::model::ModelConfig;
    let e = kernel_capacity(&record_small(), 1, 64).unwrap_err().to_string();
    assert!(e.contains("64 wide") && e.contains("are 8"), "{e}");
    let cfg = ModelConfig { model_dim: 128, num_heads: 2, num_kv_heads: 1, ..record_small() };
    let e = kernel_capacity(&cfg, 1, 100).unwrap_err().to_string();
    assert!(e.contains("multiple of 64") && e.contains("100"), "{e}");
    assert!(kernel_capacity(&cfg, 2, 128).is_ok());
}

/// The engine on the emulated GPU with its units captured and replayed as graphs, against the
/// same engine launching op by op: three steps with a learning rate, a momentum and a clip
/// that change every step give bit-identical losses, gradient norms and weights, and after the
/// first sighting (op by op) and the capture, every unit is a replay (the step's launches do
/// not change from step to step: its varying values are read from device memory).
#[test]
fn graph_replay_is_bit_identical_to_eager_and_every_step_replays() {
    use crate::engine::Engine;
    use crate::engine::layout::Layout;
    use crate::engine::optim::MuonStep;
    use crate::engine::step::{OptimizerStep, kernel_capacity};
    use crate::engine::tests::{baseline_small, perturbed, tokens};
    use crate::model::ModelConfig;
    let cfg = ModelConfig { model_dim: 64, num_heads: 1, num_kv_heads: 1, num_layers: 2, ..baseline_small() };
    let (rows, t) = (1, 64);
    let params = perturbed(&cfg, 5).state_dict().into_iter().collect();
    let mut runs = Vec::new();
    for graphs in [false, true] {
        let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(format!("graphs-{graphs}.mem")));
        let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t).unwrap()).unwrap();
        let mut e = Engine::with_backend(&cfg, rows, t, Box::new(be.with_graphs(graphs)), true).unwrap();
        e.load_params(&params).unwrap();
        e.zero_grads();
        let mut stats = Vec::new();
        for step in 0..3u64 {
            let (x, y) = (tokens(10 * step, rows * t, 48), tokens(10 * step + 5, rows * t, 48));
            e.micro_step(&x, &y, false, 1.0 / (rows * t) as f64);
            let k = step as f64;
            let muon = MuonStep {
                lr: 0.02 + 0.01 * k,
                momentum: 0.85 + 0.05 * k,
                nesterov: true,
                backend_steps: 5,
                row_norm: true,
                weight_decay: 0.01,
            };
            let s = OptimizerStep {
                clip: 0.3 + k,
                muon,
                adam: [(0.01 + 0.01 * k, 0.0), (0.02 - 0.005 * k, 0.01), (0.03, 0.0)],
                betas: (0.9, 0.95),
                eps: 1e-8,
            };
            stats.push(e.optimizer_step(&s).unwrap());
        }
        let weights: Vec<Vec<u32>> = e
            .params()
            .unwrap()
            .iter()
            .map(|(_, w)| w.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect())
            .collect();
        runs.push((stats, weights, e.graph_counts().unwrap()));
    }
    let ((eager_stats, eager_w, eager_c), (graph_stats, graph_w, graph_c)) = (&runs[0], &runs[1]);
    assert_eq!(eager_stats, graph_stats);
    assert!(eager_stats.iter().all(|s| s.loss_sum.is_finite() && s.grad_norm.is_some_and(f64::is_finite)), "{eager_stats:?}");
    assert!(eager_w == graph_w, "the weights after graph replay differ from op-by-op launches");
    assert_eq!((eager_c.captured, eager_c.replayed, eager_c.eager), (0, 0, 9));
    // Forward, backward and optimizer: op by op in step 1, captured (and run) in step 2,
    // replayed in step 3.
    assert_eq!((graph_c.captured, graph_c.replayed, graph_c.eager), (3, 6, 3), "{graph_c:?}");
}
