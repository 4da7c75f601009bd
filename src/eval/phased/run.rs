//! The phased TTT loop (record spec §5.4, §5.5), scoring every target of the validation stream
//! once:
//!
//! ```text
//! for batch in work_queue (longest first):
//!     fresh LoRA (A drawn, B = 0) and AdamW for its documents
//!     for c in 0 .. max chunks:
//!         forward the documents with a chunk c (window <= context, base frozen, their adapters)
//!         score chunk c of each                                   (final: never rescored)
//!         loss = sum over documents not at their last chunk of mean NLL over chunk c
//!         backward, one AdamW step on the adapters
//!     while a phase boundary b_k <= documents scored:
//!         global SGD of the base on the first b_k scored documents (global.rs)
//! ```
//!
//! The legality conditions (§5.6) hold by construction and are checked as the loop runs: a
//! chunk is scored before the update it takes part in, from a window of its own document's
//! earlier tokens; adapters live for one batch; a last chunk is never trained on; the base
//! changes only at pauses, from documents already scored completely; a target scored twice is
//! an error. [`PhasedEvent`]s report each step in order (the tests follow them).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::config::PhasedConfig;
use super::docs::{Chunk, Document, chunks, phase_boundaries, segment, work_queue};
use super::global::{GlobalStats, global_sgd};
use super::progress::Progress;
use crate::dist::{Collective, ReduceOp};
use crate::eval::bpb::{BpbAccumulator, ByteTables};
use crate::eval::executor::EvalModel;
use crate::eval::lora::LoraStep;

/// What happened, in order.
#[derive(Debug)]
pub enum PhasedEvent<'a> {
    /// Targets of a document were scored (stream target indices).
    Scored { doc: usize, targets: Range<usize> },
    /// A document's adapters took one step on these targets (already scored).
    Adapted { doc: usize, targets: Range<usize> },
    /// A global SGD phase starts on these documents, in stream order of its training stream.
    PhaseStart { phase: usize, docs: &'a [usize] },
    /// A global SGD chunk `chunk` of `of` was trained on: targets of the phase's stream.
    GlobalChunk { phase: usize, chunk: usize, of: usize, targets: Range<usize> },
    /// A batch of documents is done: its `ttp:` line.
    Batch { line: &'a str },
}

/// One global SGD phase, as it ran.
#[derive(Clone, Debug)]
pub struct PhaseReport {
    /// 1-based.
    pub phase: usize,
    /// Documents it trained on (`b_k`).
    pub docs: usize,
    /// Documents scored when it paused the queue.
    pub scored_at_pause: usize,
    /// Batches done when it paused the queue.
    pub after_batch: usize,
    /// When it paused, from the start of the evaluation.
    pub paused_at: Duration,
    /// What the global SGD did.
    pub stats: GlobalStats,
}

/// Where the evaluation's time went.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhasedTimes {
    /// Forward passes and the scores' sums (the same forward serves the update).
    pub score: Duration,
    /// Backward passes and AdamW steps of the adapters.
    pub adapt: Duration,
    /// Global SGD phases.
    pub global: Duration,
}

/// The result of [`phased_ttt`].
#[derive(Debug)]
pub struct PhasedOutcome {
    /// Every target's one score.
    pub acc: BpbAccumulator,
    /// Every stream target's NLL as scored, in stream order.
    pub nll: Vec<f32>,
    /// Documents.
    pub docs: usize,
    /// Batches of the work queue.
    pub batches: usize,
    /// The phases that ran (fewer than configured when the stream has fewer documents than a
    /// boundary).
    pub phases: Vec<PhaseReport>,
    /// The configured boundaries.
    pub boundaries: Vec<usize>,
    /// Time spent scoring, adapting, and in global SGD.
    pub times: PhasedTimes,
}

/// Phased TTT of `tokens` (`N + 1` tokens with documents starting at `bos`; ids checked by the
/// caller): returns every target's score. `model` is trained in place at the phases (after the
/// call it holds the adapted base) on its executor; the LoRA passes of the batches run on its
/// candle model ([`EvalModel::candle`]: on the engine, a mirror synced after each phase). `seed` draws the adapters (batch `i` from `seed + i`).
/// `keep_going` is asked before every forward pass or SGD step: false (on any rank) gives
/// `Ok(None)`.
///
/// Several ranks (`ranks`) share the work queue in rounds: in round `k` rank `r` takes queue
/// entry `k·W + r`; after each round the ranks add up what each scored (one small all-reduce,
/// which is also their agreement to go on) and pause together for a phase once the documents of
/// the rounds done reach its boundary, then train the base with every step's sequences split
/// among them ([`global_sgd`]). Every rank knows the queue, so each knows which documents the
/// others scored without sending them. (The record's ranks claim entries from a shared file
/// counter instead, as they finish: the same work, in an order that depends on timing; here
/// the order, and so the score, is the same in every run of a given world size.) With one rank
/// this is the loop above, batch by batch. The returned sums are every rank's; `nll` holds
/// this rank's targets only (NaN elsewhere).
pub fn phased_ttt(
    model: &mut dyn EvalModel,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    (cfg, bos, seed): (&PhasedConfig, u32, u64),
    ranks: &dyn Collective,
    mut on_event: impl FnMut(&PhasedEvent<'_>),
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<PhasedOutcome>> {
    cfg.check()?;
    anyhow::ensure!(tokens.len() >= 2, "{} validation tokens: at least 2 are needed to score one target", tokens.len());
    tables.check_stream(tokens.len())?;
    let t_start = Instant::now();
    let docs = segment(tokens, bos);
    let queue = work_queue(&docs, cfg.batch_docs);
    let boundaries = if cfg.phases > 0 { phase_boundaries(cfg.prefix_docs, cfg.phases) } else { Vec::new() };
    let (rank, world) = (ranks.rank(), ranks.world());
    let mut run = Run::new(tokens, cfg, tables.clone());
    let mut progress = Progress::default();
    // Documents completely scored (by any rank): (orig_batch_idx, position in batch, document).
    let mut done: Vec<(usize, usize, usize)> = Vec::with_capacity(docs.len());
    let mut phases = Vec::new();
    let mut mine_targets = 0;
    for round in 0..queue.len().div_ceil(world) {
        let entries = round * world..((round + 1) * world).min(queue.len());
        let before = (run.acc.nll_sum(), run.acc.tokens(), run.acc.bytes());
        let mut going = true;
        if let Some(batch) = queue.get(round * world + rank) {
            let batch_docs: Vec<Document> = batch.docs.iter().map(|&d| docs[d]).collect();
            mine_targets += batch_docs.iter().map(Document::pred_len).sum::<usize>();
            let lora_seed = seed.wrapping_add(batch.index as u64);
            going = run.batch(model, &batch.docs, &batch_docs, lora_seed, &mut on_event, &keep_going)?;
        }
        let scored = (run.acc.nll_sum() - before.0, run.acc.tokens() - before.1, run.acc.bytes() - before.2);
        // What each rank's entry of the round scored, and whether all go on.
        let Some(round_sums) = round_sums(ranks, going, scored)? else {
            return Ok(None);
        };
        for (q, sums) in entries.clone().zip(round_sums) {
            progress.add(sums.0, sums.1, sums.2);
            let batch = &queue[q];
            done.extend(batch.docs.iter().enumerate().map(|(pos, &d)| (batch.index, pos, d)));
        }
        while let Some(&boundary) = boundaries.get(phases.len())
            && done.len() >= boundary
        {
            let phase = phases.len() + 1;
            let paused_at = t_start.elapsed();
            let mut order = done.clone();
            order.sort_unstable();
            let used: Vec<usize> = order[..boundary].iter().map(|&(_, _, d)| d).collect();
            on_event(&PhasedEvent::PhaseStart { phase, docs: &used });
            let t0 = Instant::now();
            let spans: Vec<Document> = used.iter().map(|&d| docs[d]).collect();
            let Some(stats) = global_sgd(
                model,
                tokens,
                &spans,
                (cfg, bos),
                ranks,
                |c, n, targets| on_event(&PhasedEvent::GlobalChunk { phase, chunk: c, of: n, targets }),
                &keep_going,
            )?
            else {
                return Ok(None);
            };
            run.times.global += t0.elapsed();
            // The base changed: the warm start begins again from fresh adapters (as the record).
            model.lora_forget();
            phases.push(PhaseReport { phase, docs: boundary, scored_at_pause: done.len(), after_batch: entries.end, paused_at, stats });
        }
        for q in entries {
            let lens: Vec<usize> = queue[q].docs.iter().map(|&d| docs[d].len).collect();
            let line = progress.line(queue.len(), &lens, phases.len() == boundaries.len());
            on_event(&PhasedEvent::Batch { line: &line });
        }
    }
    let scored = run.scored.iter().filter(|&&s| s).count();
    anyhow::ensure!(scored == mine_targets, "internal: {scored} targets scored on rank {rank}, its documents have {mine_targets}");
    let acc = run.acc.all_reduced(ranks)?;
    anyhow::ensure!(
        acc.tokens() == run.scored.len() as u64,
        "internal: {} of {} targets were scored by the {world} rank(s)",
        acc.tokens(),
        run.scored.len()
    );
    Ok(Some(PhasedOutcome { acc, nll: run.nll, docs: docs.len(), batches: queue.len(), phases, boundaries, times: run.times }))
}

/// The sums `(nll, targets, bytes)` each rank scored in a round, in rank order, or `None` when
/// a rank was asked to stop. One all-reduce; a world of one without a transport asks nobody.
fn round_sums(ranks: &dyn Collective, going: bool, mine: (f64, u64, u64)) -> anyhow::Result<Option<Vec<(f64, u64, u64)>>> {
    let world = ranks.world();
    if ranks.is_identity() {
        return Ok(going.then(|| vec![mine]));
    }
    // [stop, then (nll, targets, bytes) per rank]: each rank fills its own place.
    let mut v = vec![0.0; 1 + 3 * world];
    v[0] = if going { 0.0 } else { 1.0 };
    let at = 1 + 3 * ranks.rank();
    v[at..at + 3].copy_from_slice(&[mine.0, mine.1 as f64, mine.2 as f64]);
    let all = ranks.all_reduce_host(&v, ReduceOp::Sum).context("phased TTT: the ranks' sums of a round")?;
    if all[0] > 0.0 {
        return Ok(None);
    }
    Ok(Some((0..world).map(|r| (all[1 + 3 * r], all[2 + 3 * r] as u64, all[3 + 3 * r] as u64)).collect()))
}

/// The state of one evaluation that the batches share.
pub(super) struct Run<'a> {
    tokens: &'a [u32],
    cfg: &'a PhasedConfig,
    acc: BpbAccumulator,
    nll: Vec<f32>,
    scored: Vec<bool>,
    times: PhasedTimes,
}

impl<'a> Run<'a> {
    /// A run over `tokens` (at least 2) that has scored nothing yet.
    pub(super) fn new(tokens: &'a [u32], cfg: &'a PhasedConfig, tables: Arc<ByteTables>) -> Self {
        Self {
            tokens,
            cfg,
            acc: BpbAccumulator::new(tables),
            nll: vec![f32::NAN; tokens.len() - 1],
            scored: vec![false; tokens.len() - 1],
            times: PhasedTimes::default(),
        }
    }

    /// The chunk loop over one batch of documents (`ids` into the stream's list, `docs` their
    /// spans) on `model`'s frozen weights with adapters ([`crate::eval::lora`]) drawn from
    /// `seed` (or, under the warm start of A, the last full batch's A). False when
    /// `keep_going` said stop.
    pub(super) fn batch(
        &mut self,
        model: &mut dyn EvalModel,
        ids: &[usize],
        docs: &[Document],
        seed: u64,
        on_event: &mut impl FnMut(&PhasedEvent<'_>),
        keep_going: &impl Fn() -> bool,
    ) -> anyhow::Result<bool> {
        let cfg = self.cfg;
        let plans: Vec<Vec<Chunk>> = docs.iter().map(|d| chunks(d.pred_len(), cfg.chunk, cfg.context)).collect();
        let rounds = plans.iter().map(Vec::len).max().unwrap_or(0);
        // A full batch starts from the last full batch's A under the warm start (B zeroed, a
        // fresh optimizer); any other batch draws fresh adapters (a short batch leaves the kept
        // ones for the next full one, as the record does).
        let warm = cfg.lora_warm_start_a && docs.len() == cfg.batch_docs;
        model.lora_begin(&cfg.lora_spec(), docs.len(), seed, warm)?;
        let rows = docs.len();
        for c in 0..rounds {
            if !keep_going() {
                model.lora_end(false)?;
                return Ok(false);
            }
            let t0 = Instant::now();
            // The documents with a chunk c, each in its own row.
            let active: Vec<bool> = plans.iter().map(|p| c < p.len()).collect();
            let width = (0..rows).filter(|&r| active[r]).map(|r| plans[r][c].window.len()).max().unwrap_or(0);
            let (mut x, mut y) = (vec![0u32; rows * width], vec![0u32; rows * width]);
            let mut scored = vec![0..0; rows];
            let mut train = vec![false; rows];
            for r in (0..rows).filter(|&r| active[r]) {
                let (d, ch) = (docs[r], &plans[r][c]);
                let w = &ch.window;
                x[r * width..][..w.len()].copy_from_slice(&self.tokens[d.start + w.start..d.start + w.end]);
                y[r * width..][..w.len()].copy_from_slice(&self.tokens[d.start + w.start + 1..d.start + w.end + 1]);
                scored[r] = ch.scored.start - w.start..ch.scored.end - w.start;
                train[r] = !ch.last;
            }
            let step = LoraStep { x: &x, y: &y, width, active: &active, scored: &scored, train: &train };
            let nll = model.lora_score(&step)?;
            // Score: each chunk's targets, final.
            let mut loss = 0.0;
            let mut trained = Vec::new();
            for r in (0..rows).filter(|&r| active[r]) {
                let (d, ch) = (docs[r], &plans[r][c]);
                let local = r * width + scored[r].start..r * width + scored[r].end;
                let targets = d.start + ch.scored.start..d.start + ch.scored.end;
                for t in targets.clone() {
                    anyhow::ensure!(!self.scored[t], "internal: target {t} scored twice");
                    self.scored[t] = true;
                }
                self.nll[targets.clone()].copy_from_slice(&nll[local.clone()]);
                self.acc.add(targets.start, &x[local.clone()], &y[local.clone()], &nll[local.clone()]);
                on_event(&PhasedEvent::Scored { doc: ids[r], targets: targets.clone() });
                if train[r] {
                    loss += nll[local.clone()].iter().map(|&v| v as f64).sum::<f64>() / local.len() as f64;
                    trained.push((ids[r], targets));
                }
            }
            self.times.score += t0.elapsed();
            if trained.is_empty() {
                continue;
            }
            // Update: Σ over the documents not at their last chunk of the chunk's mean NLL.
            let t0 = Instant::now();
            anyhow::ensure!(loss.is_finite(), "the LoRA TTT loss is {loss} at chunk {c} of the batch of documents from {}", ids[0]);
            model.lora_adapt()?;
            for (doc, targets) in trained {
                on_event(&PhasedEvent::Adapted { doc, targets });
            }
            self.times.adapt += t0.elapsed();
        }
        model.lora_end(warm)?;
        Ok(true)
    }
}
