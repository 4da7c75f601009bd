//! The engine against candle's autograd (the model of [`crate::model`]): loss and every
//! gradient to 1e-9 in f64, for the baseline's elements and for every element of the record
//! (record-mini's switches at a small width), looped and not; the same with poison on (every
//! dead buffer NaN), which catches a read of a buffer the pass did not write; each model element
//! of [`crate::model::ELEMENTS`] alone; and when each gradient is final.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::Engine;
use crate::model::{FinalLane, ModelConfig};

/// The baseline's elements at a small size (tied head, relu², sequential blocks, U-Net skips).
pub(crate) fn baseline_small() -> ModelConfig {
    ModelConfig { vocab_size: 48, num_layers: 4, model_dim: 32, num_heads: 4, num_kv_heads: 2, mlp_mult: 2, ..ModelConfig::default() }
}

pub(crate) use super::cases::record_small;

pub(crate) use super::cases::perturbed;

/// `n` token ids below `vocab` from `seed`.
pub(crate) fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut r = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| r.u32(0..vocab)).collect()
}

/// The elements of `t` in f64.
pub(crate) fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// `|a - b| / |a|` in the L2 norm (`|a - b|` when `a` is zero).
pub(crate) fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    if den == 0.0 { num } else { num / den }
}

/// Candle's loss and gradients of `m` on one micro-batch, then the engine's (over
/// `micro` micro-batches of the same tokens, to check accumulation), compared.
fn compare(cfg: &ModelConfig, looping: bool, poison: bool, micro: usize, tol: f64) {
    let (rows, t) = (3, 6);
    let mut m = perturbed(cfg, 7);
    m.set_looping(looping);
    let mut x = tokens(1, rows * t, cfg.vocab_size as u32);
    if cfg.document_attention || cfg.smear_gate {
        // A document starts mid-row in every row (and a row with a BOS at its start), so that
        // the document mask and SmearGate's BOS fix bite.
        for r in 0..rows {
            x[r * t + t / 2] = cfg.bos_id;
        }
        x[0] = cfg.bos_id;
    }
    let y = tokens(2, rows * t, cfg.vocab_size as u32);
    let xt = Tensor::from_vec(x.clone(), (rows, t), &Device::Cpu).unwrap();
    let yt = Tensor::from_vec(y.clone(), (rows, t), &Device::Cpu).unwrap();
    let loss = m.loss(&xt, &yt).unwrap();
    let grads = loss.backward().unwrap();
    let want_loss = loss.to_scalar::<f64>().unwrap();

    let mut e = Engine::cpu(cfg, rows, t, DType::F64, poison).unwrap();
    e.load_params(&m.state_dict().into_iter().collect()).unwrap();
    e.zero_grads();
    let n = (rows * t) as f64;
    for _ in 0..micro {
        e.micro_step(&x, &y, looping, 1.0 / (n * micro as f64));
    }
    let got_loss = e.loss_sum().unwrap() / (n * micro as f64);
    let what = format!("looping {looping} poison {poison} micro {micro}");
    assert!((got_loss - want_loss).abs() <= tol * want_loss.abs(), "{what}: loss {got_loss} vs {want_loss}");
    let got: HashMap<String, Tensor> = e.grads().unwrap().into_iter().collect();
    if std::env::var("ENGINE_DEBUG").is_ok() {
        for (name, var, _) in m.params() {
            eprintln!("{name}: {:e}", rel_err(&flat(grads.get(var.as_tensor()).unwrap()), &flat(&got[name])));
        }
    }
    for (name, var, _) in m.params() {
        let want = flat(grads.get(var.as_tensor()).unwrap());
        let err = rel_err(&want, &flat(&got[name]));
        assert!(err <= tol, "{what}: gradient of {name}: relative error {err:e}");
        assert!(want.iter().any(|&g| g != 0.0) || name.starts_with("skip"), "{name}: the check needs a non-zero gradient");
    }
}

#[test]
fn baseline_loss_and_gradients_equal_candle_autograd_in_f64() {
    compare(&baseline_small(), false, false, 1, 1e-9);
    compare(&ModelConfig { tie_embeddings: false, ..baseline_small() }, false, false, 1, 1e-9);
}

#[test]
fn record_loss_and_gradients_equal_candle_autograd_in_f64() {
    for looping in [false, true] {
        compare(&record_small(), looping, false, 1, 1e-9);
    }
}

/// The 04-27 record's elements together on the record's small model (looped and not, poisoned,
/// over two micro-batches): SmearGate with the BOS fix, the sparse attention gate, attention
/// within documents, the two-lane decoder after the loop.
#[test]
fn the_04_27_elements_together_equal_candle_autograd_in_f64() {
    let cfg = record_0427_small();
    for looping in [false, true] {
        compare(&cfg, looping, false, 1, 1e-9);
    }
    compare(&cfg, true, true, 2, 1e-9);
}

/// [`record_small`] with the 04-27 elements (the two-lane decoder in place of parallel
/// residuals, from the block after the loop).
pub(crate) fn record_0427_small() -> ModelConfig {
    ModelConfig {
        parallel_residual_start: None,
        parallel_decoder_start: Some(3),
        smear_gate: true,
        smear_gate_window: 8,
        attn_gate: true,
        attn_gate_window: 6,
        attn_gate_init_std: 0.5,
        attn_gate_scale: 0.5,
        document_attention: true,
        bos_id: 1,
        ..record_small()
    }
}

/// BigramHash with the 04-27 elements (SmearGate reads the rows it added to), with a projection
/// and without one (a table as wide as the model), looped, over two micro-batches, poisoned:
/// the engine equals candle's autograd in f64, with fewer buckets than the vocabulary's rows
/// and with more.
#[test]
fn bigram_hash_with_and_without_projection_equals_candle() {
    let base = record_0427_small();
    for (buckets, dim) in [(19, 8), (19, base.model_dim), (3 * base.vocab_size, 8)] {
        let cfg = ModelConfig { bigram_vocab_size: buckets, bigram_dim: dim, ..base.clone() };
        compare(&cfg, true, true, 2, 1e-9);
    }
}

/// The masks bite in the comparison: with a BOS mid-row, the loss under the document mask (and
/// under SmearGate's BOS fix) differs from the loss without it, on the engine as on candle.
#[test]
fn the_document_mask_and_the_bos_fix_change_the_loss() {
    let (rows, t) = (3, 6);
    let loss = |cfg: &ModelConfig| {
        let m = perturbed(cfg, 7);
        let mut x = tokens(1, rows * t, cfg.vocab_size as u32);
        for r in 0..rows {
            x[r * t + t / 2] = 1;
        }
        let y = tokens(2, rows * t, cfg.vocab_size as u32);
        let mut e = Engine::cpu(cfg, rows, t, DType::F64, false).unwrap();
        e.load_params(&m.state_dict().into_iter().collect()).unwrap();
        e.zero_grads();
        e.micro_step(&x, &y, false, 1.0);
        e.loss_sum().unwrap()
    };
    let with = loss(&record_0427_small());
    let without_docs = loss(&ModelConfig { document_attention: false, ..record_0427_small() });
    // The BOS fix off: a BOS id no token holds.
    let without_fix = loss(&ModelConfig { document_attention: false, bos_id: 47, ..record_0427_small() });
    assert!((with - without_docs).abs() > 1e-6 * with.abs(), "{with} vs {without_docs}");
    assert!((without_docs - without_fix).abs() > 1e-9 * with.abs(), "{without_docs} vs {without_fix}");
}

/// The element table's test: each model element ([`crate::model::ELEMENTS`]) alone on the
/// small baseline, engine against candle's autograd in f64, loss and every gradient to 1e-9
/// (looped for depth recurrence). An element in the table that the engine ignores or gets wrong
/// fails here, naming it.
#[test]
fn every_model_element_alone_matches_candle_in_f64() {
    for e in crate::model::ELEMENTS {
        let mut cfg = baseline_small();
        (e.enable)(&mut cfg);
        if !e.engine {
            // Not in the engine yet: refused before anything is built, naming one of its keys.
            let why = crate::engine::support::check(&cfg).expect_err(e.name).to_string();
            assert!(e.keys.iter().any(|k| why.contains(&format!("`model.{k}`"))), "{}: {why}", e.name);
            continue;
        }
        let run = std::panic::catch_unwind(|| compare(&cfg, e.looped, false, 1, 1e-9));
        if let Err(p) = run {
            let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            panic!("model element `{}` (keys {:?}): the engine differs from candle: {why}", e.name, e.keys);
        }
    }
}

/// The two-lane decoder with each final-lane rule, over two lane blocks (so that lane 1 reaches
/// lane 0 through the second block's mix), one of them popping a skip.
#[test]
fn the_two_lane_decoder_equals_candle_with_each_final_lane() {
    for lane in [FinalLane::Mean, FinalLane::Attn, FinalLane::Mlp] {
        let cfg = ModelConfig { parallel_decoder_start: Some(2), parallel_final_lane: lane, skip_gates: true, ..baseline_small() };
        compare(&cfg, false, false, 1, 1e-9);
    }
}

/// Two micro-batches of the same tokens at half the scale give one micro-batch's gradients:
/// accumulation in place is exact to rounding.
#[test]
fn gradients_accumulate_over_micro_batches() {
    compare(&record_small(), true, false, 2, 1e-9);
}

/// Poison: every activation and scratch buffer NaN before the forward pass, the scratch NaN
/// again between the passes, and the results still match (no op reads what its pass did not
/// write).
#[test]
fn poisoned_dead_buffers_change_nothing() {
    compare(&record_small(), true, true, 2, 1e-9);
    compare(&baseline_small(), false, true, 1, 1e-9);
}

/// The backward pass's events ([`crate::engine::schedule::Schedule::grad_events`]) are honest: what
/// a gradient holds at the event that names it final is what it holds at the end of the pass,
/// bit for bit, for every parameter (the exchange between ranks sends it then), looped and
/// not, tied head and untied, with gradients already accumulated from an earlier micro-batch.
/// And they are early enough to be worth it: the head's (untied) at 0, every block's before the
/// end.
#[test]
fn gradients_are_final_at_their_events() {
    let untied = ModelConfig { tie_embeddings: false, ..record_small() };
    let cases = [(baseline_small(), false), (record_small(), false), (record_small(), true), (untied, true), (record_0427_small(), true)];
    for (cfg, looping) in cases {
        let (rows, t) = (2, 6);
        let m = perturbed(&cfg, 3);
        let mut e = Engine::cpu(&cfg, rows, t, DType::F64, false).unwrap();
        e.load_params(&m.state_dict().into_iter().collect()).unwrap();
        e.zero_grads();
        let (x, y) = (tokens(5, rows * t, cfg.vocab_size as u32), tokens(6, rows * t, cfg.vocab_size as u32));
        e.micro_step(&x, &y, looping, 0.5);
        let slots = e.schedule().layout.slots.clone();
        let events = e.schedule().grad_events(looping);
        let p = e.schedule().positions(looping);
        let mut seen = Vec::new();
        let mut at_event: Vec<Option<Vec<f64>>> = vec![None; slots.len()];
        e.micro_step_with(crate::engine::backend::Tokens::Host { x: &x, y: &y }, looping, 0.5, &mut |be, event| {
            seen.push(event);
            for (i, s) in slots.iter().enumerate().filter(|(i, _)| events[*i] == event) {
                at_event[i] = Some(flat(&be.download(s.grad, &[s.grad.len]).unwrap()));
            }
        })
        .unwrap();
        assert_eq!(seen, (0..=p + 1).collect::<Vec<_>>(), "events in order, each once");
        let end: HashMap<String, Tensor> = e.grads().unwrap().into_iter().collect();
        for (i, s) in slots.iter().enumerate() {
            let then = at_event[i].as_ref().unwrap();
            assert!(then == &flat(&end[&s.name]), "{} (looping {looping}): changed after its event {}", s.name, events[i]);
            if s.name.starts_with("blocks.") {
                assert!(events[i] <= p, "{}: final only at the end", s.name);
            }
            if s.name == "lm_head.weight" {
                assert_eq!(events[i], 0);
            }
        }
    }
}

/// Scoring by forward passes alone ([`Engine::score`]) gives candle's summed token losses in
/// f64, for the 04-09 and 04-27 elements, looped and not, over 5 sequences on an engine of 2
/// rows (the last micro-batch padded); it leaves the step's loss sum at zero and no trace in
/// training: a step after scoring equals the step without it, weight for weight; sequences
/// that are not whole are refused.
#[test]
fn scoring_by_forward_passes_equals_candle_and_leaves_training_alone() {
    let (rows, t, seqs) = (2, 6, 5);
    for (name, cfg) in [("04-09", record_small()), ("04-27", record_0427_small())] {
        for looping in [false, true] {
            let mut m = perturbed(&cfg, 11);
            m.set_looping(looping);
            let mut x = tokens(3, seqs * t, cfg.vocab_size as u32);
            x[t + 2] = cfg.bos_id;
            let y = tokens(4, seqs * t, cfg.vocab_size as u32);
            let xt = Tensor::from_vec(x.clone(), (seqs, t), &Device::Cpu).unwrap();
            let yt = Tensor::from_vec(y.clone(), (seqs, t), &Device::Cpu).unwrap();
            let want: f64 = flat(&m.eval_token_losses(&xt, &yt).unwrap()).iter().sum();
            let params: HashMap<String, Tensor> = m.state_dict().into_iter().collect();
            let step = |score: bool| {
                let mut e = Engine::cpu(&cfg, rows, t, DType::F64, true).unwrap();
                e.load_params(&params).unwrap();
                e.zero_grads();
                let got = if score { Some(e.score(&x, &y, looping).unwrap()) } else { None };
                assert_eq!(e.loss_sum().unwrap(), 0.0, "{name}: the loss sum after scoring");
                e.micro_step(&x[..rows * t], &y[..rows * t], looping, 1.0 / (rows * t) as f64);
                e.muon(crate::engine::cases::check_muon()).unwrap();
                let w: Vec<Vec<f64>> = e.params().unwrap().iter().map(|(_, p)| flat(p)).collect();
                (got, w)
            };
            let (got, scored) = step(true);
            let got = got.unwrap();
            assert!((got - want).abs() <= 1e-9 * want.abs(), "{name} looping {looping}: scored {got} vs candle {want}");
            assert_eq!(scored, step(false).1, "{name} looping {looping}: scoring changed the training step");
        }
    }
    let mut e = Engine::cpu(&baseline_small(), rows, t, DType::F64, false).unwrap();
    let err = e.score(&[1; 7], &[1; 7], false).unwrap_err().to_string();
    assert!(err.contains("sequences of 6 tokens"), "{err}");
}
