//! One score, whichever executor: the evaluations after training on the engine
//! ([`super::engine_eval::EngineModel`]) against the same evaluations on candle
//! ([`crate::eval::candle_model::CandleModel`]), target by target, on the baseline's, the 04-09 record's
//! (looped) and the 04-27 record's elements (documents, SmearGate's BOS fix): in f64 to 1e-9,
//! in f32 within 1e-3 bpb. The engine runs micro-batches of other rows than the evaluation's
//! batches, so that partial micro-batches (padded with ignored targets) are exercised.

use std::sync::Arc;

use candle_core::{DType, Device};

use super::engine_eval::{EngineModel, check, phased_sizing};
use crate::dist::single::Single;
use crate::engine::tests::{baseline_small, perturbed, record_0427_small, record_small};
use crate::eval::bpb::{BpbAccumulator, ByteTables};
use crate::eval::candle_model::CandleModel;
use crate::eval::executor::{EvalExecutor, EvalModel};
use crate::eval::phased::{PhasedConfig, phased_ttt};
use crate::eval::ttt::{SlidingConfig, TttConfig, score_first_ttt, sliding_eval};
use crate::model::{Gpt, ModelConfig};

const BOS: u32 = 1;

/// Byte tables for `vocab` ids (id 0 a boundary, the others 1 to 3 bytes), recording every
/// target's loss.
fn tables(vocab: usize) -> Arc<ByteTables> {
    Arc::new(crate::eval::ttt::tests::tables_of(vocab).recording())
}

/// Score-first TTT on windows of 12 (stride 4, 3 a batch), chunks of 3 sequences trained in
/// steps of 2 and 1 (`batch_seqs` 2): the second step's micro-batch is padded.
fn ttt_cfg(epochs: usize, grad_clip: f64) -> TttConfig {
    TttConfig {
        sliding: SlidingConfig { seq_len: 12, stride: 4, batch_windows: 3 },
        chunk_tokens: 36,
        lr: 0.05,
        momentum: 0.9,
        epochs,
        batch_seqs: 2,
        grad_clip,
    }
}

/// A stream of documents (a BOS every 9 to 40 tokens), ids below `vocab`.
pub(crate) fn stream(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut next_bos = 3;
    (0..n)
        .map(|i| {
            if i == next_bos {
                next_bos += rng.usize(9..40);
                BOS
            } else {
                rng.u32(2..vocab as u32)
            }
        })
        .collect()
}

/// The same perturbed weights as a candle model and as the model an engine is built from,
/// both in `dtype`.
pub(crate) fn pair(cfg: &ModelConfig, dtype: DType) -> (Gpt, Gpt) {
    let one = || {
        let src = perturbed(cfg, 5);
        let mut m = Gpt::new(cfg, 5, dtype, &Device::Cpu).unwrap();
        m.load_state(&src.state_dict().into_iter().collect()).unwrap();
        m
    };
    (one(), one())
}

/// The configs compared: the baseline's elements, the 04-09 record's (looped), the 04-27
/// record's (documents, SmearGate, attention gate, two lanes).
pub(crate) fn configs() -> Vec<(&'static str, ModelConfig)> {
    vec![("baseline", baseline_small()), ("04-09", record_small()), ("04-27", record_0427_small())]
}

/// Every recorded target's loss of `a` and `b` agree within `tol`, and they scored the same
/// targets.
fn same_scores(what: &str, a: &BpbAccumulator, b: &BpbAccumulator, tol: f64) {
    let (ra, rb) = (a.recorded().unwrap(), b.recorded().unwrap());
    assert_eq!(ra.len(), rb.len(), "{what}: targets scored");
    assert_eq!(a.tokens(), b.tokens(), "{what}: tokens");
    for ((ja, la), (jb, lb)) in ra.iter().zip(rb) {
        assert_eq!(ja, jb, "{what}: target order");
        assert!((la - lb).abs() as f64 <= tol, "{what}: target {ja}: candle {la}, engine {lb}");
    }
    assert!((a.val_bpb() - b.val_bpb()).abs() <= tol, "{what}: bpb candle {} engine {}", a.val_bpb(), b.val_bpb());
}

/// The weights of the candle model and the engine's agree within `tol` of each tensor's norm.
fn same_weights(what: &str, candle: &Gpt, engine: &mut EngineModel, tol: f64) {
    for ((name, a), (_, b)) in candle.state_dict().iter().zip(engine.engine().params().unwrap()) {
        let err = crate::engine::tests::rel_err(&crate::engine::tests::flat(a), &crate::engine::tests::flat(&b));
        assert!(err <= tol, "{what}: weight {name} differs by {err:e} of its norm");
    }
}

#[test]
fn sliding_on_the_engine_equals_candle_in_f64() {
    let sc = SlidingConfig { seq_len: 12, stride: 4, batch_windows: 3 };
    for (name, cfg) in configs() {
        let tokens = stream(150, cfg.vocab_size, 1);
        let (c, e) = pair(&cfg, DType::F64);
        let a = sliding_eval(&mut CandleModel::new(&c), &tokens, tables(cfg.vocab_size), &sc, || true).unwrap().unwrap();
        // Micro-batches of 2 rows: each batch of 3 windows is one full and one padded.
        let mut engine = EngineModel::new(e, 2, sc.seq_len).unwrap();
        let b = sliding_eval(&mut engine, &tokens, tables(cfg.vocab_size), &sc, || true).unwrap().unwrap();
        same_scores(&format!("sliding, {name}"), &a, &b, 1e-9);
    }
}

/// Score-first TTT, steps of 2 and then 1 sequence (3 per chunk, `batch_seqs` 2) on an engine of
/// 2 rows: the last step of each chunk is a padded micro-batch, whose ignored rows must add
/// nothing to the mean or its gradient.
#[test]
fn score_first_ttt_on_the_engine_equals_candle_in_f64() {
    let cfg = ttt_cfg(2, 0.5);
    for (name, mcfg) in configs() {
        let tokens = stream(150, mcfg.vocab_size, 2);
        let (c, e) = pair(&mcfg, DType::F64);
        let a = score_first_ttt(&mut CandleModel::new(&c), &tokens, tables(mcfg.vocab_size), &cfg, |_| {}, || true).unwrap().unwrap();
        let mut engine = EngineModel::new(e, cfg.rows_per_rank(1).0, cfg.sliding.seq_len).unwrap();
        let b = score_first_ttt(&mut engine, &tokens, tables(mcfg.vocab_size), &cfg, |_| {}, || true).unwrap().unwrap();
        assert!(a.chunks >= 4, "{name}: the test needs several trained chunks, got {}", a.chunks);
        same_scores(&format!("score-first, {name}"), &a.acc, &b.acc, 1e-9);
        same_weights(&format!("score-first, {name}"), &c, &mut engine, 1e-9);
    }
}

/// Phased TTT on the engine: the LoRA passes (adapters in the arena, the record's alpha and
/// warm start of A, AdamW with weight decay, batches of 3 documents so that one is short) and
/// the global SGD phases (attention masked at each document) against candle's.
#[test]
fn phased_ttt_on_the_engine_equals_candle_in_f64() {
    let pcfg = PhasedConfig {
        lora_rank: 2,
        lora_lr: 0.02,
        lora_alpha: Some(6.0),
        lora_warm_start_a: true,
        chunk: 8,
        context: 24,
        batch_docs: 3,
        prefix_docs: 6,
        phases: 2,
        global_chunk_tokens: 36,
        global_seq_len: 12,
        global_batch_seqs: 2,
        global_lr: 0.05,
        ..PhasedConfig::default()
    };
    for (name, mcfg) in [("04-09", record_small()), ("04-27", record_0427_small())] {
        let tokens = stream(260, mcfg.vocab_size, 3);
        let (c, e) = pair(&mcfg, DType::F64);
        let run = |m: &mut dyn EvalModel| {
            phased_ttt(m, &tokens, tables(mcfg.vocab_size), (&pcfg, BOS, 9), &Single, |_| {}, || true).unwrap().unwrap()
        };
        let a = run(&mut CandleModel::new(&c));
        let sizing = phased_sizing((pcfg.global_batch_seqs, pcfg.global_seq_len), (pcfg.batch_docs, pcfg.context, pcfg.lora_rank), false);
        let mut engine = EngineModel::sized(e, sizing).unwrap();
        let b = run(&mut engine);
        assert_eq!(a.phases.len(), 2, "{name}: both phases ran");
        assert!(a.phases.iter().all(|p| p.stats.steps > 0), "{name}: every phase trained");
        same_scores(&format!("phased, {name}"), &a.acc, &b.acc, 1e-9);
        same_weights(&format!("phased, {name}"), &c, &mut engine, 1e-9);
    }
}

/// In f32 (the CPU's fast backend against candle's f32 model) the scores agree within 1e-3 bpb:
/// the bound for record-mini; here far inside it.
#[test]
fn the_engine_in_f32_scores_within_1e_3_bpb_of_candle() {
    let cfg = ttt_cfg(1, 1.0);
    let mcfg = record_0427_small();
    let tokens = stream(150, mcfg.vocab_size, 4);
    let (c, e) = pair(&mcfg, DType::F32);
    let a = score_first_ttt(&mut CandleModel::new(&c), &tokens, tables(mcfg.vocab_size), &cfg, |_| {}, || true).unwrap().unwrap();
    let mut engine = EngineModel::new(e, 2, cfg.sliding.seq_len).unwrap();
    assert!(engine.describe().starts_with("engine (cpu"), "{}", engine.describe());
    let b = score_first_ttt(&mut engine, &tokens, tables(mcfg.vocab_size), &cfg, |_| {}, || true).unwrap().unwrap();
    let gap = (a.acc.val_bpb() - b.acc.val_bpb()).abs();
    assert!(gap < 1e-3, "f32: candle {} engine {} bpb", a.acc.val_bpb(), b.acc.val_bpb());
}

/// A batch of rows that is not the engine's: more rows than a micro-batch, fewer, and none
/// left over; every position's loss equals the candle model's.
#[test]
fn token_losses_of_any_rows_equal_candle() {
    let cfg = record_small();
    let (c, e) = pair(&cfg, DType::F64);
    let mut engine = EngineModel::new(e, 3, 6).unwrap();
    let mut candle = CandleModel::new(&c);
    for rows in [1, 2, 3, 4, 7] {
        let x = crate::engine::tests::tokens(rows as u64, rows * 6, cfg.vocab_size as u32);
        let y = crate::engine::tests::tokens(rows as u64 + 50, rows * 6, cfg.vocab_size as u32);
        let (a, b) = (candle.token_losses(&x, &y, 6).unwrap(), engine.token_losses(&x, &y, 6).unwrap());
        assert_eq!(a.len(), b.len());
        for (k, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!((p - q).abs() < 1e-6, "{rows} rows, position {k}: candle {p}, engine {q}");
        }
    }
}

/// Packed validation's rows (`train.val_packed`): an engine of one row of 24 scores rows of 24
/// and a last, shorter one of 12 in the same arena (then 24 again), documents cut every 4 as
/// the model says; every position's loss equals the candle model's.
#[test]
fn shorter_rows_than_the_engines_are_scored_in_its_arena() {
    let cfg =
        crate::model::ModelConfig { document_attention: true, document_max_len: 4, bos_id: 3, ..crate::engine::tests::record_0427_small() };
    let (c, e) = pair(&cfg, DType::F64);
    let mut engine = EngineModel::new(e, 1, 24).unwrap();
    let mut candle = CandleModel::new(&c);
    for (seed, t) in [(1, 24), (2, 12), (3, 24)] {
        let x = crate::engine::tests::tokens(seed, t, cfg.vocab_size as u32);
        let y = crate::engine::tests::tokens(seed + 50, t, cfg.vocab_size as u32);
        let (a, b) = (candle.token_losses(&x, &y, t).unwrap(), engine.token_losses(&x, &y, t).unwrap());
        assert_eq!(a.len(), b.len());
        for (k, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!((p - q).abs() < 1e-6, "a row of {t}, position {k}: candle {p}, engine {q}");
        }
    }
}

/// On a GPU the engine's attention takes heads 64 wide: a model of narrower heads is refused
/// before the run, naming the reason and how to ask for candle; candle takes it.
#[test]
fn a_model_the_engine_cannot_run_is_refused_naming_candle() {
    let cfg = record_small();
    let e = check(EvalExecutor::Engine, &cfg, 64, true, "eval").unwrap_err().to_string();
    assert!(e.contains("heads 64 wide") && e.contains("stages.eval.executor = \"candle\""), "{e}");
    check(EvalExecutor::Candle, &cfg, 64, true, "eval").unwrap();
    check(EvalExecutor::Engine, &cfg, 12, false, "eval").unwrap();
}

/// Byte tables for `vocab` ids of 1 to 3 bytes, no boundaries, recording nothing (the emulated-GPU
/// comparisons read the outcomes' own per-target losses).
fn plain_tables(vocab: usize) -> Arc<crate::eval::bpb::ByteTables> {
    Arc::new(crate::eval::bpb::ByteTables {
        base_bytes: (0..vocab).map(|i| 1 + (i % 3) as u16).collect(),
        leading_space: vec![false; vocab],
        is_boundary: vec![false; vocab],
        has_space_piece: true,
        stream_bytes: None,
        record_targets: false,
    })
}

/// Score-first TTT on the emulated GPU (the evaluation engine: forward passes read back, SGD
/// with momentum and clipping as launches outside the units, a padded last micro-batch whose
/// targets are ignored) scores and trains as the f64 CPU engine does, within the f32-GEMM bounds.
#[test]
fn score_first_ttt_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::cases;
    let [_, (_, cfg)] = cases::check_models();
    let (rows, t) = (2, 64);
    let model = || crate::engine::tests::perturbed(&cfg, 5);
    let params: std::collections::HashMap<_, _> = model().state_dict().into_iter().collect();
    let mut tokens = crate::engine::tests::tokens(11, 3 * 96 + 1, cfg.vocab_size as u32);
    tokens[100] = cfg.bos_id;
    // Chunks of 3 sequences, steps of 2 then 1: the second is a padded micro-batch.
    let ttt = TttConfig {
        sliding: SlidingConfig { seq_len: t, stride: 32, batch_windows: 3 },
        chunk_tokens: 3 * t,
        lr: 0.05,
        momentum: 0.9,
        epochs: 1,
        batch_seqs: 2,
        grad_clip: 0.5,
    };
    let tables = || plain_tables(cfg.vocab_size);
    let mut cpu = EngineModel::new(model(), rows, t).unwrap();
    let want = score_first_ttt(&mut cpu, &tokens, tables(), &ttt, |_| {}, || true).unwrap().unwrap();
    let mut e = crate::engine::gpu::tests::emulated_engine(&cfg, rows, t, "ttt.mem");
    e.load_params(&params).unwrap();
    let mut gpu = EngineModel::with_engine(e, &model());
    let got = score_first_ttt(&mut gpu, &tokens, tables(), &ttt, |_| {}, || true).unwrap().unwrap();
    assert_eq!(got.chunks, 2);
    let bounds = cases::ModelBounds::GPU_F32_GEMMS;
    for (c, ((a, n), (b, _))) in want.per_chunk.iter().zip(&got.per_chunk).enumerate() {
        assert!((a - b).abs() <= bounds.loss * a.abs(), "chunk {c} ({n} targets): cpu {a} vs emulated gpu {b}");
    }
    let (pc, pg) = (cpu.engine().params().unwrap(), gpu.engine().params().unwrap());
    for ((name, a), (_, b)) in pc.iter().zip(&pg) {
        let err = crate::engine::tests::rel_err(&crate::engine::tests::flat(a), &crate::engine::tests::flat(b));
        assert!(err <= bounds.tensor, "weight {name} after TTT: {err:e} of its norm");
    }
}

/// The adapters' life on the engine step by step against candle's, in f64: a full batch under
/// the warm start (kept), a short batch of fresh adapters in between (the kept set set aside
/// in the engine), then a full batch from the kept A with B zeroed; every pass's losses (rows
/// without a chunk, rows that score without training, a window shorter than the longest) and
/// the kept A agree.
#[test]
fn the_adapters_life_on_the_engine_equals_candle_in_f64() {
    use crate::eval::lora::{LoraModel, LoraSpec, LoraStep};
    let mcfg = record_0427_small();
    let (c, e) = pair(&mcfg, DType::F64);
    let spec = LoraSpec { rank: 3, alpha: Some(9.0), lr: 0.03, betas: (0.0, 0.99), eps: 1e-10, weight_decay: 0.5 };
    let sizing = phased_sizing((2, 12), (3, 16, spec.rank), false);
    let mut engine = EngineModel::sized(e, sizing).unwrap();
    let mut candle = CandleModel::new(&c);
    let tokens = stream(400, mcfg.vocab_size, 11);
    // One pass of `docs` rows of `width`: row 1 without a chunk in pass 1 (a row of ignored
    // targets on the engine), row 0 in pass 2 (a pass of the last rows alone); row 0 scores only.
    let pass = |m: &mut dyn EvalModel, docs: usize, width: usize, k: usize| -> Vec<f32> {
        let at = 7 * k;
        let x: Vec<u32> = tokens[at..at + docs * width].to_vec();
        let y: Vec<u32> = tokens[at + 1..at + 1 + docs * width].to_vec();
        let active: Vec<bool> = (0..docs).map(|r| !(r == 1 && k == 1 || r == 0 && k == 2)).collect();
        let scored: Vec<_> = (0..docs).map(|_| width - 4..width).collect();
        let train: Vec<bool> = (0..docs).map(|r| r != 0).collect();
        let step = LoraStep { x: &x, y: &y, width, active: &active, scored: &scored, train: &train };
        let nll = m.lora_score(&step).unwrap();
        if (0..docs).any(|r| active[r] && train[r]) {
            m.lora_adapt().unwrap();
        }
        // What a pass promises: the scored positions' losses (the others are no one's).
        (0..docs).filter(|&r| active[r]).flat_map(|r| nll[r * width + width - 4..(r + 1) * width].to_vec()).collect::<Vec<f32>>()
    };
    let script: [(usize, u64, bool, &[usize]); 3] = [(3, 5, true, &[8, 16, 12]), (2, 6, false, &[16, 9, 11]), (3, 7, true, &[10, 16, 7])];
    for (b, &(docs, seed, warm, widths)) in script.iter().enumerate() {
        for m in [&mut candle as &mut dyn EvalModel, &mut engine] {
            m.lora_begin(&spec, docs, seed, warm).unwrap();
        }
        for (k, &w) in widths.iter().enumerate() {
            let (a, bb) = (pass(&mut candle, docs, w, k), pass(&mut engine, docs, w, k));
            let worst = a.iter().zip(&bb).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-9, "batch {b}, pass {k}: losses differ by {worst:e}");
            assert!(a.iter().any(|&v| v > 0.0));
        }
        for m in [&mut candle as &mut dyn EvalModel, &mut engine] {
            m.lora_end(warm).unwrap();
        }
        let (ka, kb) = (candle.lora_kept_a().unwrap(), engine.lora_kept_a().unwrap());
        assert_eq!(ka.is_some(), kb.is_some(), "batch {b}: a kept set on one executor only");
        if let (Some(ka), Some(kb)) = (ka, kb) {
            let worst = ka.iter().zip(&kb).map(|(p, q)| (p - q).abs()).fold(0f64, f64::max);
            assert!(worst <= 1e-9, "batch {b}: the kept A differs by {worst:e}");
        }
    }
}

/// Phased TTT on the emulated GPU (the LoRA passes' strided-batched GEMMs, a window padded to
/// 128 tokens with the RoPE base of its own 69, a phase of global SGD in an arena sized for the
/// longest LoRA pass, whose embedding gradient reads only the micro-batch's rows) scores and
/// trains as the f64 CPU engine does, within the f32-GEMM bounds.
#[test]
fn phased_ttt_on_the_emulated_gpu_matches_the_cpu_engine() {
    use crate::engine::cases;
    let [_, (_, cfg)] = cases::check_models();
    let model = || crate::engine::tests::perturbed(&cfg, 5);
    let params: std::collections::HashMap<_, _> = model().state_dict().into_iter().collect();
    // Documents of 30 and 70 tokens: one batch (the first scored in one chunk; the second's
    // later windows passes of its row alone, the last of 69 positions padded to 128), then a
    // phase of global SGD on both.
    let mut tokens = crate::engine::tests::tokens(13, 100, cfg.vocab_size as u32);
    for at in [0, 30] {
        tokens[at] = cfg.bos_id;
    }
    let pcfg = PhasedConfig {
        lora_rank: 4,
        lora_lr: 1e-3,
        lora_alpha: Some(8.0),
        lora_warm_start_a: true,
        chunk: 32,
        context: 96,
        batch_docs: 2,
        prefix_docs: 2,
        phases: 1,
        global_chunk_tokens: 64,
        global_seq_len: 64,
        global_batch_seqs: 1,
        global_lr: 0.02,
        ..PhasedConfig::default()
    };
    let tables = || plain_tables(cfg.vocab_size);
    let run = |m: &mut dyn EvalModel| phased_ttt(m, &tokens, tables(), (&pcfg, cfg.bos_id, 9), &Single, |_| {}, || true).unwrap().unwrap();
    let global = (pcfg.global_batch_seqs, pcfg.global_seq_len);
    let mut cpu = EngineModel::sized(model(), phased_sizing(global, (pcfg.batch_docs, pcfg.context, pcfg.lora_rank), false)).unwrap();
    let want = run(&mut cpu);
    let sizing = phased_sizing(global, (pcfg.batch_docs, pcfg.context, pcfg.lora_rank), true);
    assert_eq!(sizing.max_t, 128, "the windows rounded up to 64 tokens");
    let mut e = crate::engine::gpu::tests::emulated_engine_sized(&cfg, sizing, "phased.mem");
    e.load_params(&params).unwrap();
    let mut gpu = EngineModel::with_engine(e, &model());
    let got = run(&mut gpu);
    assert_eq!((got.phases.len(), want.phases.len()), (1, 1), "the phase ran");
    assert!(want.phases[0].stats.steps > 0, "the phase trained");
    // Attention rounds q, k, v and the probabilities to bf16 in the emulator: a target's loss
    // within 1e-2 (5.6e-3 measured), the score within the f32-GEMM model bound.
    let bounds = cases::ModelBounds::GPU_F32_GEMMS;
    let (mut compared, mut worst) = (0, 0f32);
    for (a, b) in want.nll.iter().zip(&got.nll).filter(|(a, _)| !a.is_nan()) {
        worst = worst.max((a - b).abs());
        compared += 1;
    }
    eprintln!("worst target {worst:e}, bpb {} vs {}", want.acc.val_bpb(), got.acc.val_bpb());
    assert_eq!(compared, tokens.len() - 1, "every target scored once");
    assert!(worst <= 1e-2, "a target's loss: cpu and emulated gpu differ by {worst:e}");
    assert!((want.acc.val_bpb() - got.acc.val_bpb()).abs() <= bounds.loss * want.acc.val_bpb());
    // The phase trained the base in the arena sized for the LoRA passes.
    let (pc, pg) = (cpu.engine().params().unwrap(), gpu.engine().params().unwrap());
    for ((name, a), (_, b)) in pc.iter().zip(&pg) {
        let err = crate::engine::tests::rel_err(&crate::engine::tests::flat(a), &crate::engine::tests::flat(b));
        assert!(err <= bounds.tensor, "weight {name} after the phase: {err:e} of its norm");
    }
    let moved = pc
        .iter()
        .zip(params_sorted(&params))
        .any(|((_, a), b)| crate::engine::tests::rel_err(&crate::engine::tests::flat(a), &crate::engine::tests::flat(&b)) > 1e-6);
    assert!(moved, "the phase changed the weights");
}

/// The tensors of `params` in state-dict order (the engine's).
fn params_sorted(params: &std::collections::HashMap<String, candle_core::Tensor>) -> Vec<candle_core::Tensor> {
    let cfg = crate::engine::cases::check_models()[1].1.clone();
    cfg.param_shapes().into_iter().map(|(name, _)| params[&name].clone()).collect()
}

/// The 04-27 record's phased TTT on one GPU (one rank: all of `global_batch_seqs`, 64 documents
/// of up to 2048 tokens through rank-80 adapters): the evaluation engine's arena, adapters,
/// AdamW's moments, bf16 activations and kernel spaces included, fits an 80 GB H100; so does the
/// 04-09 record's score-first TTT at its own settings.
#[test]
fn the_records_evaluations_fit_one_h100() {
    let cfg = ModelConfig::record_0427();
    let p = PhasedConfig { lora_rank: 80, context: 2048, batch_docs: 64, global_seq_len: 2048, ..PhasedConfig::default() };
    let sizing = phased_sizing((p.global_rows_per_rank(1).0, p.global_seq_len), (p.batch_docs, p.context, p.lora_rank), true);
    let bytes = EngineModel::arena_bytes_sized(&cfg, sizing, "cuda:0");
    let adapters = crate::model::lora::Lora::count(&cfg, true, (64, 80)) as u64 * 16;
    eprintln!(
        "record-0427 phased TTT on one GPU: arena {:.1} GiB, of which adapters, gradients and moments {:.1} GiB",
        bytes as f64 / (1u64 << 30) as f64,
        adapters as f64 / (1u64 << 30) as f64
    );
    assert!(bytes > adapters, "the arena holds the adapters");
    assert!(bytes < 75 * (1u64 << 30), "{bytes} bytes: more than an H100 holds beside the CUDA context");
    // The 04-09 record's score-first TTT at its own `batch_seqs` (32 sequences of 2048 a step on
    // one rank), which ran out of memory on an H100 on candle.
    let ttt = TttConfig::default();
    let bytes = EngineModel::arena_bytes(&ModelConfig::record(), ttt.rows_per_rank(1).0, ttt.sliding.seq_len, "cuda:0");
    eprintln!("record-04-09 score-first TTT on one GPU: arena {:.1} GiB", bytes as f64 / (1u64 << 30) as f64);
    assert!(bytes < 75 * (1u64 << 30), "{bytes} bytes: more than an H100 holds");
}
