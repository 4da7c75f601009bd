//! Tests of [`super`]: hand-made scorers that are causal, look ahead, score twice or see
//! nothing, and a tiny model's rows with and without its document mask.

use candle_core::Device;

use super::*;
use crate::model::ModelConfig;

const BOS: u32 = 1;

/// A loss that is a function of every token in `t` (FNV-1a folded to a float).
fn digest(t: &[u32]) -> f32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in t {
        h = (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3);
    }
    (h % 10_000) as f32 / 1000.0
}

/// A stream of documents of 9 tokens (a BOS, then 8) with ids 2..20.
fn stream(n: usize) -> Vec<u32> {
    (0..n).map(|i| if i % 9 == 0 { BOS } else { 2 + (i as u32 * 7) % 18 }).collect()
}

/// Target `j` from the strict prefix and its own token: causal.
fn causal(t: &[u32]) -> anyhow::Result<Records> {
    Ok((0..t.len() - 1).map(|j| (j, digest(&t[..j + 2]))).collect())
}

#[test]
fn a_causal_scorer_passes_and_compares_every_earlier_target() {
    let t = stream(64);
    let p = choose_position(&t, &PositionRules { bos: Some(BOS), ..Default::default() }).unwrap();
    assert!(t[p - 1..=p + 1].iter().all(|&x| x != BOS));
    let c = causality(&causal, &t, p, replacement(t[p], 20, Some(BOS)), &Order::Stream).unwrap();
    assert!(c.passed, "{c:?}");
    assert_eq!(c.targets_compared, p - 1);
    assert!(c.own_change > 0.0);
}

/// A scorer that peeks at the token after its target: target `p − 2` (scoring token `p − 1`)
/// sees the changed token `p` and is named.
#[test]
fn a_look_ahead_is_caught_at_the_first_target_that_sees_the_change() {
    let t = stream(64);
    let peek = |t: &[u32]| -> anyhow::Result<Records> { Ok((0..t.len() - 1).map(|j| (j, digest(&t[..(j + 3).min(t.len())]))).collect()) };
    let p = 30;
    let c = causality(&peek, &t, p, replacement(t[p], 20, Some(BOS)), &Order::Stream).unwrap();
    assert!(!c.passed);
    let leak = c.leak.unwrap();
    assert_eq!((leak.target, leak.token, leak.moved), (p - 2, p - 1, 1));
    assert_eq!(leak.change, (leak.after - leak.before).abs());
}

#[test]
fn double_missing_and_blind_scorers_fail_with_the_reason() {
    let t = stream(40);
    let twice = |t: &[u32]| -> anyhow::Result<Records> {
        let mut r = causal(t)?;
        r.push((3, 0.5));
        Ok(r)
    };
    let c = causality(&twice, &t, 20, 9, &Order::Stream).unwrap();
    assert!(!c.passed && c.problems[0].contains("target 3 was scored twice"), "{:?}", c.problems);
    let short = |t: &[u32]| -> anyhow::Result<Records> { Ok(causal(t)?.into_iter().filter(|&(j, _)| j != 7 && j != 9).collect()) };
    let c = causality(&short, &t, 20, 9, &Order::Stream).unwrap();
    assert!(c.problems[0].contains("2 of 39 targets were never scored, the first 7"), "{:?}", c.problems);
    // Target j from its inputs only: the changed token's own score does not move.
    let blind = |t: &[u32]| -> anyhow::Result<Records> { Ok((0..t.len() - 1).map(|j| (j, digest(&t[..=j]))).collect()) };
    let c = causality(&blind, &t, 20, 9, &Order::Stream).unwrap();
    assert!(!c.passed && c.leak.is_none() && c.problems[0].contains("saw nothing"), "{:?}", c.problems);
    // A scorer's error is the audit's.
    let broken = |_: &[u32]| -> anyhow::Result<Records> { anyhow::bail!("no per-target losses were recorded") };
    let e = format!("{:#}", causality(&broken, &t, 20, 9, &Order::Stream).unwrap_err());
    assert!(e.contains("no per-target losses"), "{e}");
}

#[test]
fn groups_protect_earlier_batches_and_the_batch_neighbours() {
    // Documents [0,4) [4,8) [8,12); batches: {[8,12)} first, then {[0,4), [4,8)}.
    let order = Order::Groups(vec![vec![8..12], vec![0..4, 4..8]]);
    // p = 6: target 5 of document [4,8).
    let before = order.before(12, 6);
    let want: Vec<bool> = (0..12).map(|j| j <= 4 || j >= 8).collect();
    assert_eq!(before, want);
    // p = 10: target 9 of the first batch: only its own earlier target 8.
    assert_eq!(order.before(12, 10), (0..12).map(|j| j == 8).collect::<Vec<_>>());
    assert_eq!(Order::Stream.before(5, 3), [true, true, false, false, false]);
}

#[test]
fn positions_avoid_documents_and_chunk_edges() {
    let t = stream(100);
    for c in [4usize, 5, 8, 16] {
        let rules = PositionRules { bos: Some(BOS), stream_chunk: Some(c), doc_chunk: None };
        let p = choose_position(&t, &rules).unwrap();
        let r = (p - 1) % c;
        assert!(r >= 1 && r + 2 < c && ![t[p - 1], t[p], t[p + 1]].contains(&BOS), "c {c} p {p}");
        let rules = PositionRules { bos: Some(BOS), stream_chunk: None, doc_chunk: Some(c) };
        let p = choose_position(&t, &rules).unwrap();
        let start = t[..p].iter().rposition(|&x| x == BOS).unwrap();
        let r = (p - 1 - start) % c;
        assert!(r >= 1 && r + 2 < c, "c {c} p {p} doc at {start}");
    }
    let all_bos = vec![BOS; 20];
    let e = choose_position(&all_bos, &PositionRules { bos: Some(BOS), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("no position of the 20-token prefix"), "{e}");
    assert_ne!(replacement(0, 3, Some(1)), 1);
    assert_eq!(replacement(19, 20, Some(BOS)), 0);
}

/// A tiny f64 model (vocabulary 32, BOS 1) with every parameter moved off its initial value,
/// so that attention matters; `docs` sets `document_attention`.
fn tiny(docs: bool) -> Gpt {
    crate::eval::ttt::tests::model_with(&tiny_config(docs))
}

/// The tiny model's config (vocabulary 32, BOS 1); `docs` sets `document_attention`.
pub(crate) fn tiny_config(docs: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 32,
        num_layers: 2,
        model_dim: 16,
        num_heads: 2,
        num_kv_heads: 1,
        bos_id: BOS,
        document_attention: docs,
        ..ModelConfig::default()
    }
}

/// The document mask keeps the second document's losses bit for bit and as alone; the same
/// weights scored without a mask leak, first at the BOS's own target.
#[test]
fn the_document_mask_passes_and_an_unmasked_row_leaks_at_the_bos() {
    let t = stream(60);
    let masked = tiny(true);
    let d = bos_audit(&|x, y| masked_row_losses(&masked, BOS, x, y), &t, BOS, 24, 32).unwrap();
    assert!(d.passed, "{d:?}");
    assert_eq!(t[d.bos_position], BOS);
    assert!(d.changed_tokens >= 2 && d.targets_compared >= 2, "{d:?}");
    assert!(d.row.start < d.bos_position && d.row.end > d.bos_position + 2 && d.row.len() <= 24, "{d:?}");
    let plain = tiny(false);
    let unmasked = |x: &[u32], y: &[u32]| -> anyhow::Result<Vec<f32>> {
        let xt = Tensor::from_slice(x, (1, x.len()), &Device::Cpu)?;
        let yt = Tensor::from_slice(y, (1, y.len()), &Device::Cpu)?;
        Ok(plain.eval_token_losses(&xt, &yt)?.to_dtype(DType::F32)?.to_vec1()?)
    };
    let d = bos_audit(&unmasked, &t, BOS, 24, 32).unwrap();
    assert!(!d.passed);
    let leak = d.leak.clone().unwrap();
    assert_eq!((leak.target, leak.token), (d.bos_position, d.bos_position + 1), "{d:?}");
    assert!(d.problems.iter().any(|p| p.contains("alone")), "{:?}", d.problems);
    let e = bos_audit(&unmasked, &[5, 6, 7, 8, 9], BOS, 24, 32).unwrap_err().to_string();
    assert!(e.contains("no BOS"), "{e}");
}
