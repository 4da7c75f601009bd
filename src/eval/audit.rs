//! The legality audit of an evaluation (record spec §6), made empirically: the score of a
//! position may depend only on the artifact and the tokens before it; every target is scored
//! exactly once; test-time training learns only from targets already scored.
//!
//! An evaluation is seen as a *scorer*: the prefix of the validation stream (`N + 1` tokens,
//! `N` targets; target `j` is the token `j + 1` predicted from the input token `j`) to every
//! target's loss, as [`Records`] in the order the evaluation took them. The real evaluations
//! give them through a recording [`crate::eval::bpb::BpbAccumulator`], unchanged.
//!
//! - **Causality** ([`causality`]): the scorer runs on the tokens and on a copy with the token at
//!   one position `p` ([`choose_position`]: inside a document and, where the evaluation has
//!   them, inside a chunk) changed. Both runs must score every target of `0..N` exactly once;
//!   every target the evaluation takes before target `p − 1` ([`Order`]: left to right, or by
//!   documents in the order of a work queue) must keep its loss bit for bit; and target `p − 1`,
//!   which scores token `p` itself, must change, else the audit saw nothing.
//! - **Documents** ([`bos_audit`]), for a model that claims document masking: in one packed row
//!   holding the end of a document and the start of the next (after a BOS), changing the tokens
//!   of the first must leave every loss of the second bit for bit, and the second scored alone in
//!   a row of its own must match within [`ALONE_TOLERANCE`] (the shapes differ, so the bits may).
//!
//! What it cannot see: whether the scores are a normalised distribution, and anything read
//! from outside the prefix (other data, files): only a change to the prefix is tried.

use std::ops::Range;

use anyhow::Context;
use candle_core::{DType, Tensor};
use serde::Serialize;

use crate::model::ops::{DocRule, DocumentMask};
use crate::model::{Gpt, PassExtras};

/// Each scored target's loss, `(target index, loss)`, in the order the evaluation took them.
pub type Records = Vec<(usize, f32)>;

/// One row's inputs and targets to their losses: the model's scoring pass of a packed row.
pub type RowFn<'a> = dyn Fn(&[u32], &[u32]) -> anyhow::Result<Vec<f32>> + 'a;

/// Largest difference (nats, absolute, per target) allowed between a document scored after
/// another in one row and scored alone: the two passes have different shapes.
pub const ALONE_TOLERANCE: f32 = 1e-4;

/// Where a changed position must sit to say something: what the evaluation's geometry makes
/// knowable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PositionRules {
    /// The token that starts a document: the changed token, and its neighbours, are none.
    pub bos: Option<u32>,
    /// Chunks of this many targets from target 0 (score-first TTT): target `p − 1` sits inside
    /// one, off its first target and its last two.
    pub stream_chunk: Option<usize>,
    /// Chunks of this many targets from each document's first target (phased TTT), likewise.
    pub doc_chunk: Option<usize>,
}

/// The order in which an evaluation takes its targets, which decides which targets a change at
/// position `p` must not move: those taken before target `p − 1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Order {
    /// Left to right over the stream: targets `j` with `j + 1 < p` (sliding windows,
    /// score-first TTT).
    Stream,
    /// Groups of documents (their target ranges), groups in the order taken, the documents of a
    /// group scored side by side and each left to right (phased TTT's work queue): every target
    /// of an earlier group, of another document of the same group, and of the same document
    /// before target `p − 1`. Later groups may learn from the changed document.
    Groups(Vec<Vec<Range<usize>>>),
}

impl Order {
    /// Per target of `0..n`: taken before target `p − 1`, so a change at `p` must not move it.
    pub fn before(&self, n: usize, p: usize) -> Vec<bool> {
        let own = p - 1;
        match self {
            Order::Stream => (0..n).map(|j| j < own).collect(),
            Order::Groups(groups) => {
                let mut out = vec![false; n];
                let Some(g) = groups.iter().position(|docs| docs.iter().any(|d| d.contains(&own))) else {
                    return (0..n).map(|j| j < own).collect();
                };
                for (k, docs) in groups.iter().enumerate().take(g + 1) {
                    for d in docs {
                        for j in d.clone().filter(|&j| j < n) {
                            out[j] = k < g || !d.contains(&own) || j < own;
                        }
                    }
                }
                out
            }
        }
    }

    /// Which order, in words (for the report).
    pub fn describe(&self) -> String {
        match self {
            Order::Stream => "left to right over the stream".into(),
            Order::Groups(g) => format!("by documents, {} batches in the work queue's order", g.len()),
        }
    }
}

/// A target whose loss moved when it must not have.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Leak {
    /// Its target index (it scores token `target + 1`).
    pub target: usize,
    /// The position of the token it scores, `target + 1`.
    pub token: usize,
    /// Its loss in the first run (nats).
    pub before: f32,
    /// Its loss after the change (nats).
    pub after: f32,
    /// `|after − before|`.
    pub change: f32,
    /// How many of the compared targets moved.
    pub moved: usize,
}

/// The outcome of [`causality`].
#[derive(Clone, Debug, Serialize)]
pub struct Causality {
    /// The changed token's position `p`.
    pub position: usize,
    /// Its id in the stream.
    pub from: u32,
    /// The id it was changed to.
    pub to: u32,
    /// The order the targets are taken in ([`Order::describe`]).
    pub order: String,
    /// Targets taken before target `p − 1`, compared bit for bit.
    pub targets_compared: usize,
    /// The first of them (lowest target index) that moved, if any.
    pub leak: Option<Leak>,
    /// How much target `p − 1` (scoring token `p` itself) moved.
    pub own_change: f32,
    /// What else failed: a target scored twice or never, nothing seen.
    pub problems: Vec<String>,
    /// Nothing failed.
    pub passed: bool,
}

/// The first position to change near the middle of `tokens` (`N + 1`) that `rules` allow:
/// `2 ≤ p < N`, not a BOS nor next to one, target `p − 1` inside its chunk. Errors when no
/// position of the prefix qualifies.
pub fn choose_position(tokens: &[u32], rules: &PositionRules) -> anyhow::Result<usize> {
    anyhow::ensure!(tokens.len() >= 4, "a prefix of {} tokens is too short to change one inside it", tokens.len());
    let n = tokens.len() - 1;
    let inside = |local: usize, c: usize| c < 4 || (local % c >= 1 && local % c + 2 < c);
    let ok = |p: usize| {
        if let Some(bos) = rules.bos
            && tokens[p - 1..=p + 1].contains(&bos)
        {
            return false;
        }
        if let Some(c) = rules.stream_chunk
            && !inside(p - 1, c)
        {
            return false;
        }
        if let Some(c) = rules.doc_chunk {
            let start = rules.bos.and_then(|b| tokens[..p].iter().rposition(|&t| t == b)).unwrap_or(0);
            if !inside(p - 1 - start, c) {
                return false;
            }
        }
        true
    };
    let mid = n / 2;
    (0..n).flat_map(|d| [mid + d, mid.wrapping_sub(d)]).find(|&p| (2..n).contains(&p) && ok(p)).ok_or_else(|| {
        anyhow::anyhow!("no position of the {}-token prefix is inside a document and a chunk ({rules:?}): lengthen it", n + 1)
    })
}

/// Another id than `tok` below `vocab`, not `bos`: the next one up, wrapping.
pub fn replacement(tok: u32, vocab: usize, bos: Option<u32>) -> u32 {
    let vocab = vocab.max(3) as u32;
    let mut to = (tok + 1) % vocab;
    if Some(to) == bos {
        to = (to + 1) % vocab;
    }
    to
}

/// Each target's loss from `records`, which must score every target of `0..n` exactly once;
/// else the first problem, in words (`run` names the run).
fn single_pass(records: &[(usize, f32)], n: usize, run: &str) -> Result<Vec<f32>, String> {
    let mut out: Vec<Option<f32>> = vec![None; n];
    for &(j, l) in records {
        let slot = out.get_mut(j).ok_or_else(|| format!("{run}: target {j} is outside the prefix's targets 0..{n}"))?;
        if slot.replace(l).is_some() {
            return Err(format!("{run}: target {j} was scored twice"));
        }
    }
    let missing: Vec<usize> = (0..n).filter(|&j| out[j].is_none()).collect();
    if let Some(&first) = missing.first() {
        return Err(format!("{run}: {} of {n} targets were never scored, the first {first}", missing.len()));
    }
    Ok(out.into_iter().map(|l| l.unwrap_or(f32::NAN)).collect())
}

/// The causality audit of `score` on `tokens` (`N + 1` tokens), changing the token at
/// `position` to `to` (see the module doc). A scorer's error is returned as it is.
pub fn causality(
    score: &dyn Fn(&[u32]) -> anyhow::Result<Records>,
    tokens: &[u32],
    position: usize,
    to: u32,
    order: &Order,
) -> anyhow::Result<Causality> {
    let n = tokens.len().saturating_sub(1);
    anyhow::ensure!((1..=n).contains(&position), "position {position} is not a scored token of a {}-token prefix", tokens.len());
    anyhow::ensure!(tokens[position] != to, "the changed token must differ: position {position} already holds {to}");
    let first = score(tokens).context("the evaluation on the prefix")?;
    let mut changed = tokens.to_vec();
    changed[position] = to;
    let second = score(&changed).with_context(|| format!("the evaluation on the prefix with token {position} changed"))?;
    let mut out = Causality {
        position,
        from: tokens[position],
        to,
        order: order.describe(),
        targets_compared: 0,
        leak: None,
        own_change: 0.0,
        problems: Vec::new(),
        passed: false,
    };
    let (a, b) = match (single_pass(&first, n, "first run"), single_pass(&second, n, "changed run")) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => {
            out.problems.extend([a.err(), b.err()].into_iter().flatten());
            return Ok(out);
        }
    };
    let before = order.before(n, position);
    out.targets_compared = before.iter().filter(|&&x| x).count();
    let moved: Vec<usize> = (0..n).filter(|&j| before[j] && a[j].to_bits() != b[j].to_bits()).collect();
    if let Some(&j) = moved.first() {
        out.leak = Some(Leak { target: j, token: j + 1, before: a[j], after: b[j], change: (b[j] - a[j]).abs(), moved: moved.len() });
    }
    let own = position - 1;
    out.own_change = (b[own] - a[own]).abs();
    if a[own].to_bits() == b[own].to_bits() {
        out.problems.push(format!(
            "target {own}, which scores the changed token {position} itself, did not change: the audit saw nothing, so it proves nothing"
        ));
    }
    out.passed = out.leak.is_none() && out.problems.is_empty();
    Ok(out)
}

/// The outcome of [`bos_audit`].
#[derive(Clone, Debug, Serialize)]
pub struct Documents {
    /// The BOS that starts the second document.
    pub bos_position: usize,
    /// The row's input positions (the end of the first document, the second).
    pub row: Range<usize>,
    /// Tokens of the first document changed.
    pub changed_tokens: usize,
    /// Targets of the second document in the row, compared bit for bit.
    pub targets_compared: usize,
    /// The first of them that moved, if any.
    pub leak: Option<Leak>,
    /// The largest difference between the second document's losses in the row and alone.
    pub alone_max_diff: f32,
    /// The target where it was.
    pub alone_worst_target: usize,
    /// What else failed.
    pub problems: Vec<String>,
    /// Nothing failed.
    pub passed: bool,
}

/// The documents audit (see the module doc) of `score_row` (one row's inputs and targets to
/// their losses) on `tokens`, documents starting at `bos`, in rows of at most `row_len` inputs.
/// Tokens are changed to [`replacement`]s below `vocab`. Errors when the prefix holds no two
/// documents to put in one row.
pub fn bos_audit(score_row: &RowFn<'_>, tokens: &[u32], bos: u32, row_len: usize, vocab: usize) -> anyhow::Result<Documents> {
    anyhow::ensure!(row_len >= 4, "rows of {row_len} tokens are too short to hold two documents");
    let n = tokens.len().saturating_sub(1);
    let mid = n / 2;
    // A BOS with a document before it (a token besides its BOS) and two targets after it.
    let b = (0..n)
        .filter(|&b| tokens[b] == bos && b >= 2 && tokens[b - 1] != bos && b + 2 <= n && tokens[b + 1] != bos)
        .min_by_key(|&b| b.abs_diff(mid))
        .ok_or_else(|| anyhow::anyhow!("the {}-token prefix holds no BOS ({bos}) between two documents: lengthen it", tokens.len()))?;
    let prev_start = tokens[..b].iter().rposition(|&t| t == bos).unwrap_or(0);
    let r0 = prev_start.max(b.saturating_sub(row_len / 2));
    let end = (r0 + row_len).min(n);
    let next = tokens[b + 1..].iter().position(|&t| t == bos).map_or(n + 1, |k| b + 1 + k);
    let e2 = next.min(end);
    let mut changed = tokens.to_vec();
    let mut changed_tokens = 0;
    for t in &mut changed[r0..b] {
        if *t != bos {
            *t = replacement(*t, vocab, Some(bos));
            changed_tokens += 1;
        }
    }
    let row = |t: &[u32], r: Range<usize>| -> anyhow::Result<Vec<f32>> {
        let nll = score_row(&t[r.clone()], &t[r.start + 1..r.end + 1])?;
        anyhow::ensure!(nll.len() == r.len(), "a row of {} inputs was scored with {} losses", r.len(), nll.len());
        Ok(nll)
    };
    let a = row(tokens, r0..end).context("the row of two documents")?;
    let c = row(&changed, r0..end).context("the row with the first document changed")?;
    let alone = row(tokens, b..e2).context("the second document alone")?;
    let second = b - r0..e2 - r0;
    let moved: Vec<usize> = second.clone().filter(|&k| a[k].to_bits() != c[k].to_bits()).collect();
    let leak = moved.first().map(|&k| Leak {
        target: r0 + k,
        token: r0 + k + 1,
        before: a[k],
        after: c[k],
        change: (c[k] - a[k]).abs(),
        moved: moved.len(),
    });
    let mut problems = Vec::new();
    if (0..b - r0).all(|k| a[k].to_bits() == c[k].to_bits()) {
        problems.push(format!("no loss of the first document (targets {r0}..{b}) changed with its tokens: the audit saw nothing"));
    }
    let (worst, diff) = second.clone().map(|k| (k, (alone[k - second.start] - a[k]).abs())).fold((second.start, 0f32), |m, x| {
        if m.1.is_nan() {
            m
        } else if x.1.is_nan() || x.1 > m.1 {
            x
        } else {
            m
        }
    });
    if diff > ALONE_TOLERANCE || diff.is_nan() {
        problems.push(format!(
            "target {} scores {} after the document before it and {} alone: {diff:.3e} apart, over the tolerance {ALONE_TOLERANCE:e}",
            r0 + worst,
            a[worst],
            alone[worst - second.start]
        ));
    }
    let passed = leak.is_none() && problems.is_empty();
    Ok(Documents {
        bos_position: b,
        row: r0..end,
        changed_tokens,
        targets_compared: second.len(),
        leak,
        alone_max_diff: diff,
        alone_worst_target: r0 + worst,
        problems,
        passed,
    })
}

/// The losses of one row (inputs `x`, targets `y`) under `model`, attention kept inside the
/// documents that start at `bos` (cut as the model's `document_max_len` says:
/// [`DocumentMask::at_token`]), base frozen: the scoring pass
/// the evaluations take under `model.document_attention`.
pub fn masked_row_losses(model: &Gpt, bos: u32, x: &[u32], y: &[u32]) -> anyhow::Result<Vec<f32>> {
    let t = x.len();
    let mask = DocumentMask::at_token(x, t, DocRule { bos, ..model.config().doc_rule() })?;
    let xt = Tensor::from_slice(x, (1, t), model.device())?;
    let yt = Tensor::from_slice(y, (1, t), model.device())?;
    let nll = model.frozen_token_losses(&xt, &yt, PassExtras { lora: None, docs: Some(&mask) })?;
    Ok(nll.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

#[cfg(test)]
pub(crate) mod tests;
