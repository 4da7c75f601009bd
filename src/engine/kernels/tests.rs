//! The GPU backend ([`KernelBackend`] over the warp emulator: the kernels of
//! `kernels/engine.cu` and `kernels/flash_mma.cu` compiled for the CPU, launched exactly as the
//! CUDA device launches them) against the CPU: every op check of [`crate::engine::cases`] (the
//! table `pipeline engine-check` runs on a real GPU), a test that the table launches every
//! kernel the engine has, the ids' CSR, the whole engine, and graph replay.

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::Tensor;

use super::emu::{self, EmuDevice};
use super::{Capacity, KernelBackend};
use crate::engine::backend::Backend;
use crate::engine::cases;

/// The emulated backend sized for every case, on the emulator `exe`.
fn case_backend(exe: &Path, name: &str) -> KernelBackend<EmuDevice> {
    let file = emu::temp_dir().join(format!("{name}.mem"));
    KernelBackend::new(EmuDevice::new(exe, file), cases::arena_len(), cases::capacity()).expect("the emulated device allocates")
}

/// Runs the case called `name` on `be`; panics naming the element when it is out of bound.
fn check_case(be: &mut KernelBackend<EmuDevice>, name: &str) {
    let case = cases::cases().into_iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no case `{name}`"));
    let r = cases::run(&case, be, 1).unwrap();
    assert!(
        r.ok(),
        "{}: element {} is {} on the emulated GPU, {} on the CPU (error {:.2e} > {:.0e})",
        r.name,
        r.at,
        r.got,
        r.want,
        r.err,
        r.bound
    );
}

/// Every op check of the table on one emulated backend, each within its bound; the unit case
/// ran op by op, was captured, then replayed.
#[test]
fn every_op_case_matches_the_cpu_on_the_emulated_gpu() {
    let mut be = case_backend(emu::emulator(), "cases");
    let mut failed = Vec::new();
    for case in cases::cases() {
        let r = cases::run(&case, &mut be, 1).unwrap();
        if !r.ok() {
            failed.push(format!("{}: error {:.2e} > {:.0e} at element {} ({} vs {})", r.name, r.err, r.bound, r.at, r.got, r.want));
        }
    }
    assert!(failed.is_empty(), "cases out of bound:\n{}", failed.join("\n"));
    let c = be.graph_counts().unwrap();
    assert_eq!((c.eager, c.captured, c.replayed), (1, 1, 2), "{c:?}");
}

/// The table launches every kernel the engine's backend can launch (the emulator's list of
/// kernels/engine.cu and flash_mma.cu), so `pipeline engine-check` checks each on a GPU.
#[test]
fn the_op_cases_launch_every_kernel() {
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/warp_emu/engine_emu.cpp")).unwrap();
    let all: BTreeSet<String> = src
        .split("K(")
        .skip(1)
        .filter_map(|t| t.split(')').next())
        .filter(|k| k.starts_with("eng_") || k.starts_with("flash_"))
        .map(str::to_string)
        .collect();
    assert!(all.len() > 40 && all.contains("eng_csr_fill") && all.contains("flash_bwd_dkdv_mma_bf16"), "{all:?}");
    let mut be = case_backend(emu::emulator(), "coverage");
    for case in cases::cases() {
        cases::run(&case, &mut be, 2).unwrap();
    }
    let launched = be.device().launched();
    let missing: Vec<&String> = all.iter().filter(|k| !launched.contains(*k)).collect();
    assert!(missing.is_empty(), "kernels no case launches: {missing:?}");
}

/// An RMS norm backward that divides by one column too many fails its case: the harness sees
/// a wrong kernel.
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
    let mut be = case_backend(&emu::build(&dir, "engine_emu_mutant", Some(&mutant)), "mutant");
    check_case(&mut be, "rms_norm_bwd (write, then accumulate)");
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
