//! The legality conditions of phased TTT (record spec §5.6, §6) on a tiny model: every target
//! scored once, scored before any update uses it, a last chunk never trained on, the base trained
//! only on documents scored completely, and no score moved by a token that comes after it.

use std::collections::HashMap;

use super::config::PhasedConfig;
use super::docs::segment;
use super::run::{PhasedEvent, PhasedOutcome, phased_ttt};
use crate::eval::candle_model::CandleModel;
use crate::eval::lora::LoraModel;
// Score-first TTT's tiny float64 model (every parameter moved off its initial value) and its
// hand-made byte tables.
use crate::eval::ttt::tests::{VOCAB, model, tables};

const BOS: u32 = 1;

/// A stream of 14 documents of 5 to 90 tokens (some text before the first BOS too), each a
/// repeated motif with noise so that adaptation has something to learn.
fn stream(seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out: Vec<u32> = vec![7, 9, 11];
    for _ in 0..14 {
        let motif: Vec<u32> = (0..rng.usize(2..6)).map(|_| rng.u32(2..VOCAB as u32)).collect();
        let body: Vec<u32> =
            (0..rng.usize(5..90)).map(|i| if rng.f64() < 0.1 { rng.u32(2..VOCAB as u32) } else { motif[i % motif.len()] }).collect();
        out.push(BOS);
        out.extend(body);
    }
    out
}

fn cfg() -> PhasedConfig {
    PhasedConfig {
        lora_rank: 2,
        lora_lr: 0.02,
        chunk: 8,
        context: 24,
        batch_docs: 3,
        prefix_docs: 8,
        phases: 2,
        global_chunk_tokens: 48,
        global_seq_len: 16,
        global_batch_seqs: 2,
        global_lr: 0.01,
        ..PhasedConfig::default()
    }
}

/// Every event of a run, owned.
#[derive(Debug, Clone)]
enum Ev {
    Scored(usize, std::ops::Range<usize>),
    Adapted(usize, std::ops::Range<usize>),
    Phase(Vec<usize>),
    Global(usize, usize),
}

fn run(tokens: &[u32], cfg: &PhasedConfig) -> (PhasedOutcome, Vec<Ev>) {
    let mut events = Vec::new();
    let out = phased_ttt(
        &mut CandleModel::new(model()),
        tokens,
        tables(),
        (cfg, BOS, 5),
        &crate::dist::single::Single,
        |e| {
            events.push(match e {
                PhasedEvent::Scored { doc, targets } => Ev::Scored(*doc, targets.clone()),
                PhasedEvent::Adapted { doc, targets } => Ev::Adapted(*doc, targets.clone()),
                PhasedEvent::PhaseStart { docs, .. } => Ev::Phase(docs.to_vec()),
                PhasedEvent::GlobalChunk { chunk, of, .. } => Ev::Global(*chunk, *of),
                PhasedEvent::Batch { .. } => return,
            })
        },
        || true,
    )
    .unwrap()
    .unwrap();
    (out, events)
}

#[test]
fn every_target_once_scored_before_trained_on_and_no_last_chunk_trained() {
    let tokens = stream(1);
    let docs = segment(&tokens, BOS);
    let (out, events) = run(&tokens, &cfg());
    let n = tokens.len() - 1;
    assert_eq!((out.acc.tokens() as usize, out.nll.len()), (n, n));
    assert!(out.nll.iter().all(|x| x.is_finite()));
    assert_eq!((out.docs, out.batches), (docs.len(), docs.len().div_ceil(3)));
    assert_eq!(out.phases.len(), 2, "boundaries 4 and 8 of {} documents", docs.len());
    let mut scored = vec![0u8; n];
    let mut doc_left: HashMap<usize, usize> = docs.iter().enumerate().map(|(i, d)| (i, d.pred_len())).collect();
    let mut trained_chunks = 0;
    for e in &events {
        match e {
            Ev::Scored(d, t) => {
                for i in t.clone() {
                    scored[i] += 1;
                }
                *doc_left.get_mut(d).unwrap() -= t.len();
            }
            Ev::Adapted(d, t) => {
                assert!(t.clone().all(|i| scored[i] == 1), "document {d} trained on {t:?} before scoring it");
                assert!(t.end < docs[*d].targets().end, "document {d}'s last chunk {t:?} was trained on");
                trained_chunks += 1;
            }
            Ev::Phase(used) => {
                assert!(used.iter().all(|d| doc_left[d] == 0), "a phase trained on a document not scored completely");
            }
            Ev::Global(c, of) => assert!(c + 1 < *of, "global chunk {c} of {of}: the last is never trained on"),
        }
    }
    assert!(scored.iter().all(|&s| s == 1), "every target scored exactly once");
    assert!(trained_chunks > 0 && events.iter().any(|e| matches!(e, Ev::Global(..))), "adaptation and global SGD both ran");
    let first_phase = out.phases[0].stats;
    assert!(first_phase.trained_chunks + 1 == first_phase.chunks && first_phase.steps > 0, "{first_phase:?}");
}

/// Perturbing a token of a document moves no score taken before it: not the document's earlier
/// targets, and nothing scored before the perturbed document could influence it (its batch's
/// other documents, earlier batches, and everything before a phase that trains on it).
#[test]
fn a_perturbed_token_moves_no_earlier_score() {
    no_earlier_score_moves(&cfg());
}

/// The same with the 04-27 record's adapters (PR #1767): outputs scaled by `alpha / rank` and
/// the warm start of A, which carries what a batch learned into the next full batch (trained
/// on chunks already scored, so still legal).
#[test]
fn a_perturbed_token_moves_no_earlier_score_under_the_warm_start_of_a() {
    no_earlier_score_moves(&PhasedConfig { lora_alpha: Some(4.0), lora_warm_start_a: true, ..cfg() });
}

fn no_earlier_score_moves(cfg: &PhasedConfig) {
    let tokens = stream(2);
    let docs = segment(&tokens, BOS);
    let (base, events) = run(&tokens, cfg);
    // The longest document is in the first batch, so later documents come after it; take a
    // document in the middle of the queue instead, and a token in the middle of it.
    let order: Vec<usize> = events.iter().filter_map(|e| if let Ev::Scored(d, _) = e { Some(*d) } else { None }).collect();
    let mut first_seen = Vec::new();
    for d in order {
        if !first_seen.contains(&d) {
            first_seen.push(d);
        }
    }
    let victim = *first_seen[first_seen.len() / 2..].iter().find(|&&v| docs[v].len > 10).unwrap();
    let d = docs[victim];
    let p = d.start + d.len / 2;
    assert_ne!(tokens[p], BOS);
    let mut changed = tokens.clone();
    changed[p] = if tokens[p] == 5 { 6 } else { 5 };
    let (after, _) = run(&changed, cfg);
    // Targets that could not depend on token p: the victim's targets before p - 1, and every
    // target scored before the victim's first score, unless a phase trained on the victim.
    let victim_in_phase = events.iter().any(|e| matches!(e, Ev::Phase(u) if u.contains(&victim)));
    let mut fixed: Vec<usize> = (d.start..p - 1).collect();
    for e in &events {
        match e {
            Ev::Scored(doc, _) if *doc == victim => break,
            Ev::Scored(_, t) => fixed.extend(t.clone()),
            _ => {}
        }
    }
    assert!(fixed.len() > 10, "the test needs earlier scores to watch ({})", fixed.len());
    for &i in &fixed {
        assert_eq!(base.nll[i].to_bits(), after.nll[i].to_bits(), "target {i} moved when token {p} changed");
    }
    assert_ne!(base.nll[p - 1], after.nll[p - 1], "the changed target's own score moves");
    if !victim_in_phase && !cfg.lora_warm_start_a {
        // Nothing else moves either: documents are independent, except through the phases
        // (and, under the warm start, through the next full batches' A).
        let moved = (0..tokens.len() - 1).filter(|&i| base.nll[i].to_bits() != after.nll[i].to_bits());
        assert!(moved.clone().all(|i| d.targets().contains(&i)), "{:?}", moved.collect::<Vec<_>>());
    }
}

/// The adapters learn: on documents that repeat a motif, phased TTT scores better than the
/// same chunked scoring with no adaptation (learning rates 0, no phases).
#[test]
fn adaptation_lowers_the_loss_on_repetitive_documents() {
    let tokens = stream(3);
    let (adapted, _) = run(&tokens, &PhasedConfig { phases: 0, lora_lr: 0.05, ..cfg() });
    let (bare, _) = run(&tokens, &PhasedConfig { phases: 0, lora_lr: 0.0, lora_weight_decay: 0.0, ..cfg() });
    assert!(adapted.acc.val_loss() < bare.acc.val_loss() - 0.01, "adapted {} vs bare {}", adapted.acc.val_loss(), bare.acc.val_loss());
    // The first chunk of every document is scored by the bare base model (B = 0): equal.
    let docs = segment(&tokens, BOS);
    for d in &docs {
        let first = d.start..d.start + d.pred_len().min(8);
        for i in first {
            assert_eq!(adapted.nll[i].to_bits(), bare.nll[i].to_bits(), "target {i} of a first chunk");
        }
    }
    let stopped =
        phased_ttt(&mut CandleModel::new(model()), &tokens, tables(), (&cfg(), BOS, 5), &crate::dist::single::Single, |_| {}, || false)
            .unwrap();
    assert!(stopped.is_none(), "a stop request gives no score");
}

/// The warm start of A: the first full batch draws its adapters as without it (same scores),
/// later full batches start from what earlier ones learned (different scores), and every first
/// chunk is still scored by the bare base (B = 0 whatever A is).
#[test]
fn the_warm_start_of_a_carries_a_into_the_next_full_batch() {
    let tokens = stream(3);
    let fresh = PhasedConfig { phases: 0, lora_lr: 0.05, lora_alpha: Some(4.0), ..cfg() };
    let warm = PhasedConfig { lora_warm_start_a: true, ..fresh.clone() };
    let (f, events) = run(&tokens, &fresh);
    let (w, _) = run(&tokens, &warm);
    let (bare, _) = run(&tokens, &PhasedConfig { lora_lr: 0.0, lora_weight_decay: 0.0, ..fresh.clone() });
    let docs = segment(&tokens, BOS);
    // Documents in queue order, batch by batch (3 a batch).
    let mut order: Vec<usize> = Vec::new();
    for e in &events {
        if let Ev::Scored(d, _) = e
            && !order.contains(d)
        {
            order.push(*d);
        }
    }
    for &d in &order[..3] {
        for i in docs[d].targets() {
            assert_eq!(f.nll[i].to_bits(), w.nll[i].to_bits(), "first batch, target {i}");
        }
    }
    let later: Vec<usize> = order[3..docs.len() / 3 * 3].iter().flat_map(|&d| docs[d].targets()).collect();
    assert!(later.iter().any(|&i| f.nll[i] != w.nll[i]), "a later full batch starts from the warm A");
    for d in &docs {
        for i in d.start..d.start + d.pred_len().min(8) {
            assert_eq!(w.nll[i].to_bits(), bare.nll[i].to_bits(), "target {i} of a first chunk");
        }
    }
}

/// A batch of fewer documents between two full ones leaves the kept A alone: the third batch
/// starts from the first one's A (and trains it further), as the record's reused adapters do.
#[test]
fn a_short_batch_between_full_ones_leaves_the_warm_a_alone() {
    let tokens = stream(3);
    let docs = segment(&tokens, BOS);
    let cfg = PhasedConfig { phases: 0, lora_lr: 0.05, lora_alpha: Some(4.0), lora_warm_start_a: true, ..cfg() };
    let m = model();
    let mut model = crate::eval::candle_model::CandleModel::new(&m);
    let mut run = super::run::Run::new(&tokens, &cfg, tables());
    let (mut ev, go) = (|_: &PhasedEvent<'_>| {}, || true);
    assert!(run.batch(&mut model, &[0, 1, 2], &docs[0..3], 5, &mut ev, &go).unwrap());
    let first = model.lora_kept_a().unwrap().expect("a full batch keeps its adapters");
    assert!(run.batch(&mut model, &[3, 4], &docs[3..5], 6, &mut ev, &go).unwrap());
    assert_eq!(model.lora_kept_a().unwrap().as_ref(), Some(&first), "the short batch drew its own and left the kept ones");
    assert!(run.batch(&mut model, &[5, 6, 7], &docs[5..8], 7, &mut ev, &go).unwrap());
    let third = model.lora_kept_a().unwrap().unwrap();
    let fresh = crate::model::lora::Lora::new(m.config(), m.looping(), (3, cfg.lora_rank), 7, m.dtype(), m.device()).unwrap();
    let fresh: Vec<f64> = fresh.vars()[0].1.flatten_all().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_vec1().unwrap();
    let dist = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>();
    assert!(dist(&third, &first) < dist(&third, &fresh), "the third batch trained on from the first's A, not a fresh draw");
    assert_ne!(third, first, "and trained it");
}
