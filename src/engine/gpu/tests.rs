//! The GPU backend ([`KernelBackend`] over the warp emulator: the kernels of
//! `kernels/engine.cu` and `kernels/flash_mma.cu` compiled for the CPU, launched exactly as the
//! CUDA device launches them) against the CPU: every op check of [`crate::engine::cases`] (the
//! table `pipeline engine-check` runs on a real GPU), a test that the table launches every
//! kernel the engine has, the ids' CSR, the whole engine, and graph replay.

use std::collections::BTreeSet;
use std::path::Path;

use super::emu::{self, EmuDevice};
use super::{COLSUM_GROUP, Capacity, KernelBackend};
use crate::engine::backend::Backend;
use crate::engine::backend::BackendExt;
use crate::engine::cases;
use crate::engine::op;

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

/// The kernels the engine declares (`kernels.rs`) are exactly the `extern "C"` entry points
/// of kernels/engine.cu (its families in kernels/engine/) and kernels/flash_mma.cu: a kernel
/// added on one side only is named.
#[test]
fn the_declared_kernels_are_the_sources_entry_points() {
    let mut defined = BTreeSet::new();
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files = vec![kernels.join("engine.cu"), kernels.join("flash_mma.cu")];
    files.extend(std::fs::read_dir(kernels.join("engine")).unwrap().map(|e| e.unwrap().path()));
    for file in files {
        let src = std::fs::read_to_string(file).unwrap();
        for entry in src.split("extern \"C\" __global__").skip(1) {
            // `void NAME(` or `void __launch_bounds__(N) NAME(`: the last word before the
            // first `(` that does not open the launch bounds.
            let head = entry.trim_start().trim_start_matches("void").trim_start();
            let head = head.strip_prefix("__launch_bounds__").map_or(head, |h| &h[h.find(')').unwrap() + 1..]);
            let head = head.trim_start().trim_start_matches("void").trim_start();
            defined.insert(head[..head.find('(').unwrap()].trim().to_string());
        }
    }
    let declared: BTreeSet<String> = super::kernels::ALL.iter().map(|k| k.to_string()).collect();
    assert_eq!(declared.len(), super::kernels::ALL.len(), "a kernel is declared twice");
    let only = |a: &BTreeSet<String>, b: &BTreeSet<String>| a.difference(b).cloned().collect::<Vec<_>>();
    assert!(
        declared == defined,
        "defined in the .cu but not declared in kernels.rs: {:?}; declared but not defined: {:?}",
        only(&defined, &declared),
        only(&declared, &defined)
    );
}

/// The fused residual sum and norm (`op::MixNormFwd`, `eng_mix_norm_fwd`) writes exactly what
/// the two ops write one after the other, bit for bit, with the activations in f32 and in bf16
/// (its norm reads the sum as stored), for the residual mix and the scaled add, on rows in
/// 16-byte chunks and on rows off them.
#[test]
fn the_fused_mix_norm_is_the_two_ops_bit_for_bit() {
    use crate::engine::backend::Buf;
    use crate::engine::gpu::HalfRegions;
    use candle_core::{Device, Tensor};
    let (rows, cols) = (37, 64);
    let n = rows * cols;
    // f32 regions first (the mix, the scale, the statistics), then the activations.
    let (mix, s, r1, r2) =
        (Buf { off: 0, len: 2 * cols }, Buf { off: 128, len: cols }, Buf { off: 192, len: rows }, Buf { off: 256, len: rows });
    let act = Buf { off: 320, len: 7 * n + 8 };
    for (exe, bf16) in [(emu::emulator(), false), (emu::emulator_bf16(), true)] {
        let half = bf16.then_some(HalfRegions { act, params: Buf { off: 0, len: 320 } });
        let dev = EmuDevice::new(exe, emu::temp_dir().join(format!("mix-norm-{bf16}.mem")));
        let mut be = KernelBackend::with_half(dev, act.end(), Capacity::minimal(n, 8), half).unwrap();
        let mut rng = fastrand::Rng::with_seed(9);
        let mut random = |be: &mut KernelBackend<EmuDevice>, b: Buf| {
            let v: Vec<f32> = (0..b.len).map(|_| rng.f32() * 2.0 - 1.0).collect();
            be.upload(b, &Tensor::from_vec(v, b.len, &Device::Cpu).unwrap()).unwrap();
        };
        random(&mut be, mix);
        random(&mut be, s);
        for skip in [0, 1] {
            let at = |k: usize| Buf { off: act.off + skip + k * n, len: n };
            let (h, x0, u1, o1, u2, o2) = (at(0), at(1), at(2), at(3), at(4), at(5));
            random(&mut be, h);
            random(&mut be, x0);
            for (kind, m) in [(op::MixKind::Resid, mix), (op::MixKind::Scale, s)] {
                be.op(op::MixNormFwd { h, x0, mix: m, kind, u: u1, out: o1, rstd: r1, scale: 0.7, eps: 1e-6 });
                match kind {
                    op::MixKind::Resid => be.op(op::ResidMixFwd { h, x0, mix: m, out: u2 }),
                    op::MixKind::Scale => be.op(op::ScaleAddFwd { base: h, x: x0, s: m, out: u2 }),
                }
                be.op(op::RmsNormFwd { x: u2, out: o2, rstd: r2, cols, scale: 0.7, eps: 1e-6 });
                let get = |be: &KernelBackend<EmuDevice>, b: Buf| be.download(b, &[b.len]).unwrap().to_vec1::<f32>().unwrap();
                for (what, a, b) in [("u", u1, u2), ("out", o1, o2), ("rstd", r1, r2)] {
                    let (x, y) = (get(&be, a), get(&be, b));
                    let same = x.iter().zip(&y).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{kind:?}, bf16 {bf16}, rows off 16 bytes {}: `{what}` differs from the two ops'", skip == 1);
                }
            }
        }
    }
}

/// The table launches every kernel the engine's backend can launch (the emulator's list of
/// kernels/engine.cu and flash_mma.cu), so `pipeline engine-check` checks each on a GPU.
#[test]
fn the_op_cases_launch_every_kernel() {
    let all: BTreeSet<String> = super::kernels::ALL.iter().map(|k| k.to_string()).collect();
    assert!(all.len() > 40 && all.contains("eng_csr_fill") && all.contains("flash_bwd_dkdv_mma_bf16"), "{all:?}");
    let mut be = case_backend(emu::emulator(), "coverage");
    for case in cases::cases() {
        cases::run(&case, &mut be, 2).unwrap();
    }
    let mut launched = be.device().launched();
    // The bf16-activation build's own kernels: the flat ops on activations and the weights'
    // copy, launched by a step of the 04-27 check model (its lanes copy and scale activations)
    // and by a sum over activations.
    {
        use crate::engine::Engine;
        use crate::engine::gpu::HalfRegions;
        use crate::engine::layout::Layout;
        use crate::engine::step::kernel_capacity;
        let [_, (_, cfg)] = cases::check_models();
        let (rows, t) = cases::CHECK_ROWS_T;
        let dev = EmuDevice::new(emu::emulator_bf16(), emu::temp_dir().join("coverage-bf16.mem"));
        let record = dev.launch_record();
        let layout = Layout::new(&cfg, rows, t);
        let be = KernelBackend::with_half(dev, layout.len(), kernel_capacity(&cfg, rows, t).unwrap(), Some(HalfRegions::of(&layout)));
        let mut e = Engine::with_backend(&cfg, rows, t, Box::new(be.unwrap()), false).unwrap();
        let x = crate::engine::tests::tokens(4, rows * t, cfg.vocab_size as u32);
        e.micro_step(&x, &x, false, 1.0);
        // The logits hold their gradient after the pass: a finite sum over bf16 activations.
        let sum = e.backend().sum(e.schedule().layout.logits);
        assert!(sum.is_finite(), "{sum}");
        launched.extend(record.lock().unwrap().iter().cloned());
    }
    let missing: Vec<&String> = all.iter().filter(|k| !launched.contains(*k)).collect();
    assert!(missing.is_empty(), "kernels no case launches: {missing:?}");
}

/// The device's document slots for cuDNN's ragged attention (`eng_doc_slots`: lengths, and the
/// offsets of a unit stride, `eng_ragged_offsets`) are the host's packing of the same documents
/// ([`crate::device::cudnn::packed_slots`], which the candle path uploads): rows with one
/// document, several, BOS twice in a row, at a row's last position, across 32-position chunks;
/// and with the documents cut every 20 positions (`model.document_max_len`).
#[test]
fn the_devices_document_slots_are_the_hosts_packing() {
    use crate::engine::backend::AttnShape;
    use crate::model::ops::DocRule;
    let mut be = case_backend(emu::emulator(), "doc-slots");
    // Two rows of 64 (the case backend's capacity): documents at 0, 31, 32, 33 and 63 in the
    // first, one document in the second.
    let (rows, t, bos) = (2, 64, 7u32);
    // The micro-batch holds `cases::N` ids; the rows are its first `rows x t`.
    let mut ids: Vec<u32> = (0..cases::N).map(|i| 8 + (i as u32 * 37) % 30).collect();
    for p in [0, 31, 32, 33, 63] {
        ids[p] = bos;
    }
    be.set_tokens(&ids, &ids);
    ids.truncate(rows * t);
    let slots = |be: &mut KernelBackend<EmuDevice>, rule: DocRule| {
        let s = AttnShape { batch: rows, t, heads: 2, kv_heads: 1, d: 64, docs: Some(rule) };
        let got = be.doc_slots_read(s, rule);
        let mask = crate::model::ops::DocumentMask::at_token(&ids, t, rule).unwrap();
        let segments: Vec<Vec<(usize, usize)>> = (0..rows).map(|r| mask.segments(r)).collect();
        let want = crate::device::cudnn::packed_slots(t, &segments);
        assert_eq!(got, want, "{rule:?}");
        want
    };
    let want = slots(&mut be, DocRule::at(bos));
    assert_eq!((&want.0[..6], &want.1[..6]), (&[31, 1, 1, 30, 1, 0][..], &[0, 31, 32, 33, 63, 64][..]));
    assert_eq!((want.0[t], want.0[t + 1], want.1[t], want.1[t + 1], want.1[2 * t]), (64, 0, 64, 128, 128));
    let cut = slots(&mut be, DocRule { bos, max_len: 20 });
    assert_eq!((&cut.0[..7], &cut.1[..7]), (&[20, 11, 1, 1, 20, 10, 1][..], &[0, 20, 31, 32, 33, 53, 63][..]));
    assert_eq!(&cut.0[t..t + 5], [20, 20, 20, 4, 0], "the second row's one document in pieces of 20");
}

/// The CUDA device takes a stream of its own (`new_stream`: non-blocking), never a default
/// one: on cudarc's `default_stream()` (the legacy NULL stream) `cuStreamBeginCapture` is
/// refused and every unit would run op by op; on the per-thread stream the capture would take
/// in other stages' work. The source is read (no GPU here; on a GPU `CudaDevice::new` also
/// refuses a default stream, and `pipeline engine-check` prints the handle it got).
#[test]
fn the_cuda_device_launches_on_a_stream_of_its_own() {
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine/gpu/cuda.rs")).unwrap();
    let code: String = src.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    assert!(code.contains("ctx.new_stream()"), "the engine's stream is not made with new_stream()");
    for default in ["default_stream()", "per_thread_stream()"] {
        assert!(!code.contains(default), "src/engine/gpu/cuda.rs takes {default}");
    }
    assert!(code.contains("is_legacy_stream(&stream)"), "CudaDevice::new no longer refuses a default stream");
}

/// Token ids outside the vocabulary (the sampler's check switched off) give NaN rather than
/// reads past the table: the embedding's rows of a bad id, and the loss of a bad target, so the
/// step's loss is NaN and the trainer stops before its update.
#[test]
fn ids_outside_the_vocabulary_give_nan_not_stray_reads() {
    use crate::engine::backend::Buf;
    let mut be = case_backend(emu::emulator(), "bad-ids");
    let (n, w, vocab) = (cases::N, 8, cases::capacity().vocab);
    let mut x = vec![1u32; n];
    let mut y = vec![2u32; n];
    (x[3], y[5]) = (vocab as u32 + 7, vocab as u32);
    be.set_tokens(&x, &y);
    let (table, out) = (Buf { off: 0, len: vocab * w }, Buf { off: vocab * w, len: n * w });
    be.op(op::Fill { dst: table, value: 0.5 });
    be.op(op::EmbeddingFwd { table, out, dim: w, ids: op::Ids::Tokens });
    let rows: Vec<f32> = be.download(out, &[n * w]).unwrap().to_vec1().unwrap();
    assert!(rows[3 * w..4 * w].iter().all(|v| v.is_nan()) && rows.iter().filter(|v| v.is_nan()).count() == w, "{rows:?}");
    let (logits, losses) = (Buf { off: 0, len: n * vocab }, Buf { off: n * vocab, len: n });
    be.op(op::Fill { dst: logits, value: 0.1 });
    be.op(op::SoftcapCe { logits, losses, vocab, cap: 30.0, grad_scale: 1.0 });
    let l: Vec<f32> = be.download(losses, &[n]).unwrap().to_vec1().unwrap();
    assert!(l[5].is_nan() && l.iter().enumerate().all(|(k, v)| k == 5 || v.is_finite()), "{l:?}");
}

/// Runs the case `case` on an emulator built from the kernels with `from` replaced by `to` in
/// `file` (of kernels/): the mutant tests below expect its panic.
fn check_mutant(name: &str, file: &str, from: &str, to: &str, case: &str) {
    let dir = emu::temp_dir();
    let mutant = emu::mutant(&dir, &format!("engine_{name}_mutant"), file, from, to);
    let mut be = case_backend(&emu::build(&dir, &format!("engine_emu_{name}_mutant"), Some(&mutant), false), &format!("{name}-mutant"));
    check_case(&mut be, case);
}

/// An RMS norm backward that divides by one column too many (in the device maths engine.cu
/// shares with the model's kernels, kernels/ops/rms_norm.cuh) fails its case: the harness sees
/// a wrong kernel.
#[test]
#[should_panic(expected = "on the emulated GPU")]
fn a_wrong_kernel_fails_the_comparison() {
    let (from, to) = ("c = xg / d * inv * inv * inv * s;", "c = xg / (d + 1) * inv * inv * inv * s;");
    check_mutant("rms", "ops/rms_norm.cuh", from, to, "rms_norm_bwd (write, then accumulate)");
}

/// An embedding gradient whose pieces (the first level, for rows of many tokens) lose their
/// last token fails its case: the case's ids repeat enough to be cut into pieces.
#[test]
#[should_panic(expected = "on the emulated GPU")]
fn embedding_pieces_that_drop_a_token_fail_the_comparison() {
    let (from, to) =
        ("const unsigned k1 = k0 + piece < end ? k0 + piece : end;", "const unsigned k1 = (k0 + piece < end ? k0 + piece : end) - 1;");
    check_mutant("pieces", "engine/embedding.cuh", from, to, "embedding_bwd (the ids' CSR)");
}

/// A vectorized q/k norm + RoPE whose lanes take their own values for their pair's other half
/// (a shuffle by 0 instead of `half / 4` lanes) fails its 64-wide case.
#[test]
#[should_panic(expected = "on the emulated GPU")]
fn a_rope_pair_from_the_wrong_lane_fails_the_comparison() {
    let (from, to) = ("partner(xv, half / AV, pv);", "partner(xv, 0, pv);");
    check_mutant("rope", "engine/heads.cuh", from, to, "qk_norm_rope_fwd (64 wide, 16 rotated, gain)");
}

/// The chunked path of the RMS norm's gradient (16-byte rows, the row in registers) whose dot
/// product leaves out the gradient fails its aligned case: that case runs the chunked path.
#[test]
#[should_panic(expected = "on the emulated GPU")]
fn a_chunked_rms_norm_gradient_without_its_dot_fails_the_comparison() {
    let (from, to) = ("xg += xv[m][k] * gv[m][k];", "xg += xv[m][k];");
    check_mutant("rms-chunks", "engine/rows.cuh", from, to, "rms_norm_bwd (16-byte rows: the chunked path)");
}

/// The ids' CSR built on the device (`eng_csr_count`, `_scan`, `_fill`) is the stable counting
/// sort the embedding's gradient reads: for chunks of 64 positions over 150 ids (three chunks,
/// the last partial and not a multiple of a warp), repeated ids within a warp and across
/// chunks, unused rows, and an id outside the vocabulary (skipped), the offsets and positions
/// equal the host's, and building it twice gives the same; so do the embedding gradient's
/// pieces per row (of 4 tokens here: rows of more than 4 ids cut into pieces, shorter ones none).
#[test]
fn the_device_builds_the_ids_csr_in_token_order() {
    use super::{Device, Space};
    let (n, vocab, piece) = (150, 40, 4);
    let cap = Capacity {
        tokens: n,
        vocab,
        width: 8,
        attn_width: 8,
        kv_width: 8,
        heads: 1,
        attention_calls: 1,
        colsum_group: COLSUM_GROUP,
        embed_piece: piece,
    };
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("csr.mem"));
    let mut be = KernelBackend::with_csr_chunk(dev, 16, cap, 64, None).unwrap();
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
        let poff = be.device().read(Space::Tokens, t.pieces(), vocab + 1).unwrap();
        let mut want_poff = vec![0u32; vocab + 1];
        for v in 0..vocab {
            let len = want_off[v + 1] - want_off[v];
            want_poff[v + 1] = want_poff[v] + if len > piece as u32 { len.div_ceil(piece as u32) } else { 0 };
        }
        assert_eq!(poff, want_poff, "round {round}: the embedding gradient's pieces");
        assert!(want_poff[vocab] > 8 && (want_poff[vocab] as usize) <= t.max_pieces(), "{} pieces", want_poff[vocab]);
    }
}

/// The engine with `bounds` on `be` against the f64 CPU engine ([`cases::model_check`]):
/// every quantity within its bound, and at most 0.6 of it (room for the real GPU's rounding, a
/// fresh draw of the same errors: `pipeline parity` measured fresh draws at up to 1.4 times
/// the RMS of others); prints the worst of each kind.
fn check_model_on(cfg: &crate::model::ModelConfig, be: Box<dyn Backend>, bounds: cases::ModelBounds, what: &str) -> crate::engine::Engine {
    use crate::engine::Engine;
    let (rows, t) = cases::CHECK_ROWS_T;
    let mut e = Engine::with_backend(cfg, rows, t, be, true).unwrap();
    let compared = cases::model_check(&mut e, cfg, bounds, 3).unwrap();
    let worst = |prefix: &str| {
        compared
            .iter()
            .filter(|c| c.name.starts_with(prefix))
            .map(|c| (c.rel_err, c.rel_err / c.bound, c.name.clone()))
            .fold((0.0, 0.0, String::new()), |a, b| if b.1 > a.1 { b } else { a })
    };
    for prefix in ["loss", "grad", "weight"] {
        let (err, ratio, name) = worst(prefix);
        println!("{what}: worst {prefix}: {name} rel_err {err:.2e}, {ratio:.2} of its bound");
    }
    for c in &compared {
        assert!(c.ok() && c.rel_err <= 0.6 * c.bound, "{what}: {} rel_err {:.2e}, bound {:.2e}", c.name, c.rel_err, c.bound);
    }
    e
}

/// The whole engine on the emulated GPU (GEMMs in f32, attention in bf16) against the f64 CPU
/// engine, within 0.6 of [`cases::ModelBounds::GPU_F32_GEMMS`] (a wrong offset or kernel
/// gives errors of order 1).
#[test]
fn the_engine_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    let (rows, t) = cases::CHECK_ROWS_T;
    for (name, cfg) in cases::check_models() {
        let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(format!("engine-{}.mem", &name[..5])));
        let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t).unwrap()).unwrap();
        check_model_on(&cfg, Box::new(be), cases::ModelBounds::GPU_F32_GEMMS, &format!("emulated GPU, f32 GEMMs, {name}"));
    }
}

/// BigramHash on the emulated GPU against the f64 CPU engine, as
/// [`the_engine_on_the_emulated_gpu_matches_the_cpu_engine`]: more buckets than the
/// vocabulary's rows (the ids' CSR sized for the larger table), a projection, and the buckets'
/// CSR built for the table's gradient in place of the tokens' (their hash in the kernels).
#[test]
fn bigram_hash_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    let (rows, t) = cases::CHECK_ROWS_T;
    let cfg = crate::model::ModelConfig { bigram_vocab_size: 200, bigram_dim: 64, ..cases::check_model() };
    let cap = kernel_capacity(&cfg, rows, t).unwrap();
    assert_eq!(cap.vocab, 200, "the CSR's rows: the larger table's");
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("engine-bigram.mem"));
    let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), cap).unwrap();
    check_model_on(&cfg, Box::new(be), cases::ModelBounds::GPU_F32_GEMMS, "emulated GPU, f32 GEMMs, BigramHash");
}

/// [`the_engine_on_the_emulated_gpu_matches_the_cpu_engine`] with the GEMMs' inputs rounded to
/// bf16 as the GPU's default maths does: calibrates [`cases::ModelBounds::GPU_BF16_GEMMS`]
/// (ignored: minutes in the emulator; `cargo test --lib model_bounds -- --ignored --nocapture`).
#[test]
#[ignore]
fn model_bounds_of_bf16_gemms() {
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    let (rows, t) = cases::CHECK_ROWS_T;
    for (name, cfg) in cases::check_models() {
        let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(format!("engine-bf16-{}.mem", &name[..5]))).with_bf16_gemms();
        let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t).unwrap()).unwrap();
        check_model_on(&cfg, Box::new(be), cases::ModelBounds::GPU_BF16_GEMMS, &format!("emulated GPU, bf16 GEMMs, {name}"));
    }
}

/// The whole engine with bf16 activations (the bf16 build of the kernels, native bf16 GEMMs on
/// the weights' bf16 copy, f32 master weights and optimizer) on the emulated GPU against the
/// f64 CPU engine, within 0.6 of [`cases::ModelBounds::GPU_BF16_ACTIVATIONS`], on both check
/// models (the 04-27 one: SmearGate, the gate, XSA, the lanes, document-masked attention), with
/// poison on: a buffer read before this pass wrote it is NaN in either storage.
#[test]
fn the_engine_with_bf16_activations_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::gpu::HalfRegions;
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    let (rows, t) = cases::CHECK_ROWS_T;
    for (name, cfg) in cases::check_models() {
        let dev = EmuDevice::new(emu::emulator_bf16(), emu::temp_dir().join(format!("engine-act-{}.mem", &name[..5]))).with_bf16_gemms();
        let layout = Layout::new(&cfg, rows, t);
        let half = Some(HalfRegions::of(&layout));
        let be = KernelBackend::with_half(dev, layout.len(), kernel_capacity(&cfg, rows, t).unwrap(), half).unwrap();
        check_model_on(&cfg, Box::new(be), cases::ModelBounds::GPU_BF16_ACTIVATIONS, &format!("emulated GPU, bf16 activations, {name}"));
    }
}

/// The engine with bf16 activations and attention on cuDNN (the emulator runs each cuDNN call
/// through the CPU interpreter of its maths, on the descriptors, strides, statistics and ragged
/// offsets the backend hands it) against the f64 CPU engine, within the same bounds, on both
/// check models (the 04-27 one attends within documents: cuDNN's ragged layout); then the
/// same on a device without cuDNN, which falls back to flash_mma and says why.
#[test]
fn the_engine_with_cudnn_attention_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::gpu::HalfRegions;
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    let (rows, t) = cases::CHECK_ROWS_T;
    for (name, cfg) in cases::check_models() {
        // The fallback on the baseline's check model only (the same flash_mma path as the test above).
        let fallback = name == cases::check_models()[0].0;
        for cudnn in [true, false].into_iter().filter(|&c| c || fallback) {
            let file = emu::temp_dir().join(format!("engine-cudnn-{}-{cudnn}.mem", &name[..5]));
            let mut dev = EmuDevice::new(emu::emulator_bf16(), file).with_bf16_gemms();
            if !cudnn {
                dev = dev.without_cudnn("libcudnn.so.9: cannot open shared object file");
            }
            let record = dev.launch_record();
            let layout = Layout::new(&cfg, rows, t);
            let half = Some(HalfRegions::of(&layout));
            let mut be = KernelBackend::with_half(dev, layout.len(), kernel_capacity(&cfg, rows, t).unwrap(), half).unwrap();
            be.set_cudnn(true).unwrap();
            let what = format!("emulated GPU, bf16 activations, cuDNN {}, {name}", if cudnn { "attention" } else { "missing" });
            let e = check_model_on(&cfg, Box::new(be), cases::ModelBounds::GPU_BF16_ACTIVATIONS, &what);
            let (launched, attention) = (record.lock().unwrap().clone(), e.backend().attention_name());
            if cudnn {
                assert_eq!(attention, "cudnn", "{what}");
                assert!(launched.contains("cudnn sdpa forward") && launched.contains("cudnn sdpa backward"), "{what}: {launched:?}");
                assert!(!launched.iter().any(|k| k.starts_with("flash_")), "{what}: flash kernels ran beside cuDNN: {launched:?}");
            } else {
                assert!(attention.starts_with("flash_mma (cuDNN refused: libcudnn.so.9: cannot open"), "{what}: {attention}");
                assert!(launched.contains("flash_fwd_mma_bf16") || launched.contains("flash_fwd_mma_docs_bf16"), "{what}: {launched:?}");
            }
        }
    }
}

/// The f32 CPU backend's engine against the f64 one, within [`cases::ModelBounds::CPU_F32`]
/// (what `pipeline engine-check --device cpu` checks).
#[test]
fn the_f32_cpu_engine_matches_the_f64_one() {
    use crate::engine::cpu::CpuBackend;
    use crate::engine::layout::Layout;
    let (rows, t) = cases::CHECK_ROWS_T;
    for (name, cfg) in cases::check_models() {
        let be = Box::new(CpuBackend::<f32>::new(Layout::new(&cfg, rows, t).len()));
        check_model_on(&cfg, be, cases::ModelBounds::CPU_F32, &format!("cpu f32, {name}"));
    }
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
/// same engine launching op by op ([`cases::graph_check`], what `pipeline engine-check` runs on a
/// GPU): three steps with a learning rate, a momentum and a clip that change every step give
/// bit-identical losses, gradient norms and weights, and after the first sighting (op by op)
/// and the capture, every unit is a replay.
#[test]
fn graph_replay_is_bit_identical_to_eager_and_every_step_replays() {
    use crate::engine::Engine;
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    use crate::engine::tests::baseline_small;
    use crate::model::ModelConfig;
    let cfg = ModelConfig { model_dim: 64, num_heads: 1, num_kv_heads: 1, num_layers: 2, ..baseline_small() };
    let (rows, t) = (1, 64);
    let mut make = |graphs: bool| {
        let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(format!("graphs-{graphs}.mem")));
        let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t)?)?;
        Engine::with_backend(&cfg, rows, t, Box::new(be.with_graphs(graphs)), true)
    };
    let g = cases::graph_check(&cfg, (rows, t), 5, &mut make).unwrap();
    assert!(g.identical, "the weights after graph replay differ from op-by-op launches");
    assert!(g.ok(), "{g:?}");
}

/// The engine's phase times on a device with a clock come from its timing marks: each phase of
/// two micro-batches and an optimizer step is a positive span, together no longer than the
/// host's wall time around them; they are read once, and a step given up halfway leaves none.
/// The CPU backends have no device clock (their phases are the host's).
#[test]
fn the_engines_phase_times_come_from_the_device_clock() {
    use crate::engine::Engine;
    use crate::engine::layout::Layout;
    use crate::engine::step::{OptimizerStep, kernel_capacity};
    use crate::engine::tests::baseline_small;
    use crate::model::ModelConfig;
    use std::time::{Duration, Instant};
    let cfg = ModelConfig { model_dim: 64, num_heads: 1, num_kv_heads: 1, num_layers: 2, ..baseline_small() };
    let (rows, t) = (1, 64);
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("phases.mem"));
    let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t).unwrap()).unwrap();
    let mut e = Engine::with_backend(&cfg, rows, t, Box::new(be), false).unwrap();
    let params: std::collections::HashMap<_, _> = crate::engine::tests::perturbed(&cfg, 3).state_dict().into_iter().collect();
    e.load_params(&params).unwrap();
    e.zero_grads();
    let x: Vec<u32> = (0..rows * t).map(|k| (k * 7 % cfg.vocab_size) as u32).collect();
    let step = OptimizerStep { clip: 1.0, muon: cases::check_muon(), adam: [(0.01, 0.0); 3], betas: (0.9, 0.95), eps: 1e-8 };
    let t0 = Instant::now();
    for _ in 0..2 {
        e.micro_step(&x, &x, false, 0.5 / (rows * t) as f64);
    }
    e.optimizer_step(&step).unwrap();
    let wall = t0.elapsed();
    let p = e.device_phase_times().unwrap().expect("the emulated device has a clock");
    assert!(p.forward > Duration::ZERO && p.backward > Duration::ZERO && p.optimizer > Duration::ZERO, "{p:?}");
    assert!(p.forward + p.backward + p.optimizer <= wall, "{p:?} over {wall:?}");
    assert!(e.device_phase_times().unwrap().is_none(), "the spans are read once");
    e.micro_step(&x, &x, false, 1.0 / (rows * t) as f64);
    e.forget_phase_times();
    assert!(e.device_phase_times().unwrap().is_none(), "a step given up keeps no spans");
    let mut cpu = Engine::cpu(&cfg, rows, t, candle_core::DType::F32, false).unwrap();
    cpu.micro_step(&x, &x, false, 1.0 / (rows * t) as f64);
    assert!(cpu.device_phase_times().unwrap().is_none(), "the CPU backends have no device clock");
}

/// Scoring on the emulated GPU ([`crate::engine::Engine::score`]): 3 sequences on an engine of
/// 2 rows (the second micro-batch padded), twice, equal the f64 CPU engine's sum within the
/// f32-GEMM loss bound, and the second time the scoring pass is a replayed graph.
#[test]
fn scoring_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::Engine;
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity;
    use crate::engine::tests::tokens;
    let [_, (_, cfg)] = cases::check_models();
    let (rows, t, seqs) = (2, 64, 3);
    let params: std::collections::HashMap<_, _> = crate::engine::tests::perturbed(&cfg, 5).state_dict().into_iter().collect();
    let mut x = tokens(8, seqs * t, cfg.vocab_size as u32);
    x[70] = cfg.bos_id;
    let y = tokens(9, seqs * t, cfg.vocab_size as u32);
    let mut cpu = Engine::cpu(&cfg, rows, t, candle_core::DType::F64, false).unwrap();
    cpu.load_params(&params).unwrap();
    let want = cpu.score(&x, &y, false).unwrap();
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("score.mem"));
    let be = KernelBackend::new(dev, Layout::new(&cfg, rows, t).len(), kernel_capacity(&cfg, rows, t).unwrap()).unwrap();
    let mut e = Engine::with_backend(&cfg, rows, t, Box::new(be), false).unwrap();
    e.load_params(&params).unwrap();
    for round in 0..2 {
        let got = e.score(&x, &y, false).unwrap();
        let bound = cases::ModelBounds::GPU_F32_GEMMS.loss * want.abs();
        assert!((got - want).abs() <= bound, "round {round}: {got} vs {want}");
    }
    let c = e.graph_counts().unwrap();
    assert!(c.captured >= 1 && c.replayed >= 1, "{c:?}");
}

/// An engine of `cfg` on `rows x t` micro-batches over the warp emulator (its memory file
/// `file` in the emulator's folder), in f32 with f32 GEMMs: for the tests of what runs on the
/// engine above this module (the evaluations, `crate::train::engine_eval`).
pub(crate) fn emulated_engine(cfg: &crate::model::ModelConfig, rows: usize, t: usize, file: &str) -> crate::engine::Engine {
    emulated_engine_sized(cfg, crate::engine::layout::Sizing::fixed(rows, t), file)
}

/// [`emulated_engine`] on an arena sized by `sizing` (phased TTT's: passes of other shapes,
/// LoRA adapters).
pub(crate) fn emulated_engine_sized(
    cfg: &crate::model::ModelConfig,
    sizing: crate::engine::layout::Sizing,
    file: &str,
) -> crate::engine::Engine {
    use crate::engine::layout::Layout;
    use crate::engine::step::kernel_capacity_sized;
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(file));
    let be = KernelBackend::new(dev, Layout::sized(cfg, sizing).len(), kernel_capacity_sized(cfg, sizing).unwrap()).unwrap();
    crate::engine::Engine::with_backend_sized(cfg, sizing, Box::new(be), false).unwrap()
}

/// Timing marks keep their numbers when others are released; released marks at the front are
/// dropped (a reader keeping one span pending across steps holds only that span's marks), and
/// numbers are never reused after a reset.
#[test]
fn timing_marks_keep_their_numbers_and_drop_what_is_released() {
    let mut m = super::Marks::default();
    let ids: Vec<usize> = (0..5).map(|k| m.push(k * 10)).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4]);
    m.release(1);
    assert_eq!((m.get(0), m.get(1), m.get(2)), (Some(&0), None, Some(&20)));
    m.release(0);
    assert_eq!(m.held.len(), 3, "the released front is dropped");
    for k in [2, 3] {
        m.release(k);
    }
    assert_eq!((m.len(), m.get(4)), (1, Some(&40)));
    assert_eq!(m.push(50), 5);
    m.clear();
    assert!(m.is_empty() && m.get(4).is_none());
    assert_eq!(m.push(60), 6, "numbers are not reused");
}

/// A LoRA pass (forward through the adapters, the backward pass into them with the base frozen,
/// one AdamW step) with bf16 activations: the adapters' values among the weights' bf16 copy,
/// `h` and `dh` among the bf16 activations, the gradients in f32; its losses and the adapters
/// after the step match the f64 CPU engine's within the bf16-activation bounds.
#[test]
fn a_lora_pass_with_bf16_activations_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::evaluate::{LoraAdam, LoraPass};
    use crate::engine::gpu::HalfRegions;
    use crate::engine::layout::{Layout, LoraShape, Sizing};
    use crate::engine::step::kernel_capacity_sized;
    let [_, (_, cfg)] = cases::check_models();
    let sizing = Sizing { rows: 2, t: 64, tokens: 128, max_t: 64, lora: Some(LoraShape { docs: 2, rank: 4 }) };
    let params: std::collections::HashMap<_, _> = crate::engine::tests::perturbed(&cfg, 5).state_dict().into_iter().collect();
    let lora = crate::model::lora::Lora::new(&cfg, false, (2, 4), 3, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let mut rng = fastrand::Rng::with_seed(3);
    let adapters: Vec<(String, candle_core::Tensor)> = lora
        .vars()
        .into_iter()
        .map(|(n, v)| {
            let vals: Vec<f32> = (0..v.elem_count()).map(|_| (rng.f32() - 0.5) * 0.2).collect();
            (n, candle_core::Tensor::from_vec(vals, v.dims(), &candle_core::Device::Cpu).unwrap())
        })
        .collect();
    let tokens = crate::engine::tests::tokens(13, 129, cfg.vocab_size as u32);
    let mut y = tokens[1..].to_vec();
    // Row 0 scores its last 16 positions only, row 1 trains on its last 16.
    for (i, t) in y.iter_mut().enumerate() {
        if i % 64 < 48 {
            *t = crate::model::ops::softcap_ce::IGNORED_TARGET;
        }
    }
    let train = [false, true];
    let pass = LoraPass { x: &tokens[..128], y: &y, looping: false, scale: 2.0, first_doc: 0, train: &train, grad_scale: 1.0 / 16.0 };
    let adam = LoraAdam { lr: 0.01, betas: (0.0, 0.99), eps: 1e-10, weight_decay: 0.5 };
    let run = |e: &mut crate::engine::Engine| {
        e.load_params(&params).unwrap();
        e.lora_load(&adapters).unwrap();
        let losses = e.lora_forward(&pass).unwrap();
        e.lora_backward(&pass, adam).unwrap();
        (losses, e.lora_tensors(cfg.layer_sequence(false).len()).unwrap())
    };
    let (want, want_ad) = run(&mut crate::engine::Engine::cpu_sized(&cfg, sizing, candle_core::DType::F64, false).unwrap());
    let dev = EmuDevice::new(emu::emulator_bf16(), emu::temp_dir().join("lora-bf16.mem")).with_bf16_gemms();
    let layout = Layout::sized(&cfg, sizing);
    let be =
        KernelBackend::with_half(dev, layout.len(), kernel_capacity_sized(&cfg, sizing).unwrap(), Some(HalfRegions::of(&layout))).unwrap();
    let mut gpu = crate::engine::Engine::with_backend_sized(&cfg, sizing, Box::new(be), false).unwrap();
    let (got, got_ad) = run(&mut gpu);
    let bounds = cases::ModelBounds::GPU_BF16_ACTIVATIONS;
    let (sw, sg) = (want.iter().map(|&v| v as f64).sum::<f64>(), got.iter().map(|&v| v as f64).sum::<f64>());
    assert!(sw > 0.0 && (sw - sg).abs() <= bounds.loss * sw, "the scored losses: cpu {sw}, emulated gpu {sg}");
    for ((name, a), (_, b)) in want_ad.iter().zip(&got_ad) {
        let err = crate::engine::tests::rel_err(&crate::engine::tests::flat(a), &crate::engine::tests::flat(b));
        assert!(err <= bounds.tensor, "adapter {name} after the step: {err:e} of its norm");
    }
}

/// A device too small for the engine: building the backend fails with the space and "out of
/// memory" named (what the stage reports, exit 1, before a step), not a panic or an abort.
#[test]
fn a_device_out_of_memory_is_an_error_naming_the_space() {
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("oom.mem")).with_capacity(64 << 10);
    let e = KernelBackend::new(dev, cases::arena_len(), cases::capacity()).err().expect("a 64 KiB device cannot hold the engine");
    let m = format!("{e:#}");
    assert!(m.contains("allocating the engine's Arena space on the GPU: out of memory"), "{m}");
    // A device that holds it allocates.
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("oom-fits.mem")).with_capacity(1 << 30);
    assert!(KernelBackend::new(dev, cases::arena_len(), cases::capacity()).is_ok());
}
