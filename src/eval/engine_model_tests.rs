//! One score, whichever executor: the evaluations after training on the engine
//! ([`super::engine_model::EngineModel`]) against the same evaluations on candle
//! ([`super::executor::CandleModel`]), target by target, on the baseline's, the 04-09 record's
//! (looped) and the 04-27 record's elements (documents, SmearGate's BOS fix): in f64 to 1e-9,
//! in f32 within 1e-3 bpb. The engine runs micro-batches of other rows than the evaluation's
//! batches, so that partial micro-batches (padded with ignored targets) are exercised.

use std::sync::Arc;

use candle_core::{DType, Device};

use super::bpb::{BpbAccumulator, ByteTables};
use super::engine_model::EngineModel;
use super::executor::{CandleModel, EvalExecutor, EvalModel};
use super::phased::{PhasedConfig, phased_ttt};
use super::ttt::{SlidingConfig, TttConfig, score_first_ttt, sliding_eval};
use crate::dist::single::Single;
use crate::engine::tests::{baseline_small, perturbed, record_0427_small, record_small};
use crate::model::{Gpt, ModelConfig};

const BOS: u32 = 1;

/// Byte tables for `vocab` ids (id 0 a boundary, the others 1 to 3 bytes), recording every
/// target's loss.
fn tables(vocab: usize) -> Arc<ByteTables> {
    Arc::new(
        ByteTables {
            base_bytes: (0..vocab).map(|i| if i == 0 { 0 } else { 1 + (i % 3) as u16 }).collect(),
            leading_space: (0..vocab).map(|i| i % 3 == 0 && i > 0).collect(),
            is_boundary: (0..vocab).map(|i| i == 0).collect(),
            has_space_piece: true,
            stream_bytes: None,
            record_targets: false,
        }
        .recording(),
    )
}

/// A stream of documents (a BOS every 9 to 40 tokens), ids below `vocab`.
fn stream(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
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
fn pair(cfg: &ModelConfig, dtype: DType) -> (Gpt, Gpt) {
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
fn configs() -> Vec<(&'static str, ModelConfig)> {
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

/// The weights of the candle model and the engine's (through its mirror) agree within `tol`
/// of each tensor's norm.
fn same_weights(what: &str, candle: &Gpt, engine: &mut EngineModel, tol: f64) {
    let e = engine.candle().unwrap();
    for ((name, a), (_, b)) in candle.state_dict().iter().zip(e.state_dict()) {
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
    let cfg = TttConfig {
        sliding: SlidingConfig { seq_len: 12, stride: 4, batch_windows: 3 },
        chunk_tokens: 36,
        lr: 0.05,
        momentum: 0.9,
        epochs: 2,
        batch_seqs: 2,
        grad_clip: 0.5,
    };
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

/// Phased TTT: the LoRA passes run on candle either way; the global SGD phases (attention masked
/// at each document) run on the engine, whose weights reach the later batches through the mirror.
#[test]
fn phased_ttt_with_the_global_sgd_on_the_engine_equals_candle_in_f64() {
    let pcfg = PhasedConfig {
        lora_rank: 2,
        lora_lr: 0.02,
        chunk: 8,
        context: 24,
        batch_docs: 2,
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
        let mut engine = EngineModel::new(e, pcfg.global_batch_seqs, pcfg.global_seq_len).unwrap();
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
    let cfg = TttConfig {
        sliding: SlidingConfig { seq_len: 12, stride: 4, batch_windows: 3 },
        chunk_tokens: 36,
        lr: 0.05,
        momentum: 0.9,
        epochs: 1,
        batch_seqs: 2,
        grad_clip: 1.0,
    };
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

/// GPTQ's Hessians from the engine's forward passes (the inputs it keeps for its backward pass,
/// and the MLP's activation recomputed) equal candle's observer's, weight by weight, for every
/// element: the looped blocks add each repeat, the gate's and XSA's outputs feed the
/// projection, the lanes' MLP reads lane 1. A pass of 3 rows on an engine of 2 pads one.
#[test]
fn hessians_from_the_engine_equal_candles() {
    use std::collections::HashSet;
    for (name, cfg) in configs() {
        let (c, e) = pair(&cfg, DType::F64);
        let wanted: HashSet<String> = c.state_dict().into_iter().filter(|(_, t)| t.rank() == 2).map(|(n, _)| n).collect();
        let batches: Vec<Vec<u32>> = (0..2).map(|b| stream(2 * 3 * 12, cfg.vocab_size, 10 + b)).collect();
        let run = |m: &mut dyn EvalModel| {
            let mut k = 0;
            crate::artifact::hessian::collect(
                m,
                (3, 12),
                2,
                3,
                wanted.clone(),
                |buf| {
                    buf.copy_from_slice(&batches[k]);
                    k += 1;
                    Ok(())
                },
                || true,
            )
            .unwrap()
            .unwrap()
        };
        let a = run(&mut CandleModel::new(&c));
        let b = run(&mut EngineModel::new(e, 2, 12).unwrap());
        assert_eq!(a.by_weight.len(), b.by_weight.len(), "{name}: weights with a Hessian");
        assert_eq!(a.distinct, b.distinct, "{name}: distinct inputs");
        for (w, h) in &a.by_weight {
            let g = b.by_weight.get(w).unwrap_or_else(|| panic!("{name}: the engine has no Hessian for {w}"));
            let (x, y): (Vec<f64>, Vec<f64>) = (h.iter().map(|&v| v as f64).collect(), g.iter().map(|&v| v as f64).collect());
            let err = crate::engine::tests::rel_err(&x, &y);
            assert!(err < 1e-6, "{name}: {w}'s Hessian differs by {err:e} of its norm");
        }
    }
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

/// On a GPU the engine's attention takes heads 64 wide: a model of narrower heads is refused
/// before the run, naming the reason and how to ask for candle; candle takes it.
#[test]
fn a_model_the_engine_cannot_run_is_refused_naming_candle() {
    let cfg = record_small();
    let e = EvalExecutor::Engine.check(&cfg, 64, true, "eval").unwrap_err().to_string();
    assert!(e.contains("heads 64 wide") && e.contains("stages.eval.executor = \"candle\""), "{e}");
    EvalExecutor::Candle.check(&cfg, 64, true, "eval").unwrap();
    EvalExecutor::Engine.check(&cfg, 12, false, "eval").unwrap();
}
