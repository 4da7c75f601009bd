//! Sliding-window evaluation and legal score-first test-time training (TTT) of the validation
//! stream, as record `2026-04-09_SP8192_3LayerRecur_ParResid_QK525_LegalTTT` scores it (record
//! spec §2.5, §4.6, §4.7; legality conditions §6).
//!
//! **Targets.** `tokens` holds `N + 1` tokens and `N` targets; *target index* `i` (`0 ≤ i < N`)
//! is the token `tokens[i + 1]`, predicted from the input `tokens[i]` after the context
//! `tokens[.. i]`. Every [`Range`] of targets below is a range of target indices.
//!
//! **Sliding windows (§2.5, [`super::sliding`]: [`windows`], [`sliding_eval`]).** Windows of `seq_len = T` inputs
//! start every `stride` tokens; with `C = T − stride`, the first window scores all its targets and
//! every later one only its last `stride` targets, each of which therefore sees at least `C`
//! tokens of context. Every target is scored exactly once. Windows are run `batch_windows` at a
//! time as `(rows, T)` batches; a window shorter than `T` (at the end of the stream) is padded
//! with token 0 at the end, and padded positions are never scored. Padding cannot change a scored
//! position: every op of the model acts per position except attention, which is causal, so a
//! position only sees itself and earlier positions of its own row.
//!
//! **Score-first TTT (§4.7, [`score_first_ttt`]).** The targets are cut into chunks of
//! `chunk_tokens`; each window goes to the chunk of its first scored target. For each chunk in
//! order: (1) score all its windows with the current weights, without autograd, and add them to
//! the result — these scores are final; (2) unless it is the last chunk, train on the chunk just
//! scored: a few epochs of SGD with momentum on whole sequences of the chunk, at a learning rate
//! that decays over the chunks with a cosine. The weights that score chunk `c` have therefore
//! seen only targets of chunks `< c`, all already scored (§6: causality, score before update,
//! single pass). [`TttEvent`]s report each step in order, so that callers (and the tests) can
//! check the order of scoring and training.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dist::Collective;
use crate::dist::share::{all_go_on, share};
#[cfg(feature = "tools")]
use crate::dist::single::Single;
use crate::eval::bpb::{BpbAccumulator, ByteTables};
use crate::eval::executor::{EvalModel, SgdStep};

#[cfg(feature = "tools")]
pub use super::sliding::sliding_eval;
pub use super::sliding::{SlidingConfig, Window, sliding_eval_shared, windows};
use super::sliding::{check_tokens, score_windows};

/// Score-first TTT settings (spec §4.7). The defaults are the record's: `seq_len` 2048, `stride`
/// 64, `batch_windows` 32, `chunk_tokens` 32768 (`TTT_CHUNK_TOKENS`), `lr` 0.005 (`TTT_LR`),
/// `momentum` 0.9 (`TTT_MOMENTUM`), `epochs` 3 (`TTT_EPOCHS`), `batch_seqs` 32, `grad_clip` 1.0.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(default)]
pub struct TttConfig {
    /// Window geometry of the scoring (its keys flat beside these); `seq_len` is also the
    /// training sequence length.
    #[serde(flatten)]
    pub sliding: SlidingConfig,
    /// Tokens per TTT chunk (`TTT_CHUNK_TOKENS`, 32768 in the records), at least `seq_len`:
    /// scored, then trained on.
    pub chunk_tokens: usize,
    /// Peak SGD learning rate (of chunk 0, `TTT_LR`, 0.005), decayed over the chunks with a
    /// cosine to 0.
    pub lr: f64,
    /// SGD momentum (`TTT_MOMENTUM`, 0.9; no Nesterov, no dampening, no weight decay).
    pub momentum: f64,
    /// Passes over each chunk's sequences (`TTT_EPOCHS`, 3).
    pub epochs: usize,
    /// Sequences per SGD step, at most (32).
    pub batch_seqs: usize,
    /// Global gradient-norm clip per SGD step (`clip_grad_norm_`, 1.0); 0 turns clipping off.
    pub grad_clip: f64,
}

impl Default for TttConfig {
    /// The record's values (spec §4.7).
    fn default() -> Self {
        Self {
            sliding: SlidingConfig::default(),
            chunk_tokens: 32_768,
            lr: 0.005,
            momentum: 0.9,
            epochs: 3,
            batch_seqs: 32,
            grad_clip: 1.0,
        }
    }
}

impl TttConfig {
    /// Checks the settings; errors name the keys (`seq_len`, `stride`, `batch_windows`,
    /// `chunk_tokens`, `lr`, `momentum`, `epochs`, `batch_seqs`, `grad_clip`).
    pub fn check(&self) -> anyhow::Result<()> {
        self.sliding.check()?;
        anyhow::ensure!(
            self.chunk_tokens >= self.sliding.seq_len,
            "`chunk_tokens` ({}) must be at least `seq_len` ({}): a chunk is trained on as whole sequences",
            self.chunk_tokens,
            self.sliding.seq_len
        );
        anyhow::ensure!(self.lr.is_finite() && self.lr >= 0.0, "`lr` must be a finite number >= 0, got {}", self.lr);
        anyhow::ensure!(
            self.momentum.is_finite() && (0.0..1.0).contains(&self.momentum),
            "`momentum` must be in [0, 1), got {}",
            self.momentum
        );
        anyhow::ensure!(self.epochs >= 1, "`epochs` must be at least 1");
        anyhow::ensure!(self.batch_seqs >= 1, "`batch_seqs` must be at least 1");
        anyhow::ensure!(
            self.grad_clip.is_finite() && self.grad_clip >= 0.0,
            "`grad_clip` must be a finite number >= 0 (0: no clipping), got {}",
            self.grad_clip
        );
        Ok(())
    }

    /// The learning rate of chunk `c` of `n_chunks`: `lr · ½ · (1 + cos(π · c / max(n_chunks − 1, 1)))`
    /// (from `lr` at chunk 0 to 0 at the last chunk, which is not trained on).
    pub fn chunk_lr(&self, c: usize, n_chunks: usize) -> f64 {
        chunk_cosine(self.lr, c, n_chunks)
    }

    /// The most sequences one rank of `world` trains on at once, and the key that bounds them:
    /// a step's rows are at most `batch_seqs` and at most a chunk's whole sequences
    /// (`chunk_tokens / seq_len`: the record's 32768-token chunks hold 16 of 2048, under its
    /// `batch_seqs` of 32), shared between the ranks as [`train_sequences`] shares them. What
    /// the memory estimate counts, and the key its refusal names.
    pub fn rows_per_rank(&self, world: usize) -> (usize, &'static str) {
        step_rows_per_rank((self.chunk_tokens, self.sliding.seq_len, self.batch_seqs), world, ["chunk_tokens", "batch_seqs"])
    }

    /// How a chunk is trained on: whole sequences of `seq_len`, plain causal rows.
    pub(crate) fn training(&self) -> SeqTraining {
        SeqTraining {
            seq_len: self.sliding.seq_len,
            epochs: self.epochs,
            batch_seqs: self.batch_seqs,
            grad_clip: self.grad_clip,
            doc_bos: None,
        }
    }
}

/// The sequences one rank of `world` trains on in a step of SGD over chunks of `chunk_tokens`
/// cut into sequences of `seq_len`, `batch_seqs` a step at most: the smaller of `batch_seqs`
/// and a chunk's whole sequences, shared between the ranks; with the key of `keys` (the
/// chunk's, the batch's) that bounds it.
pub(crate) fn step_rows_per_rank(
    (chunk_tokens, seq_len, batch_seqs): (usize, usize, usize),
    world: usize,
    keys: [&'static str; 2],
) -> (usize, &'static str) {
    let chunk = (chunk_tokens / seq_len.max(1)).max(1);
    let (rows, key) = if chunk < batch_seqs { (chunk, keys[0]) } else { (batch_seqs, keys[1]) };
    (rows.div_ceil(world.max(1)), key)
}

/// `peak · ½ · (1 + cos(π · c / max(n_chunks − 1, 1)))`: a learning rate from `peak` at chunk 0
/// to 0 at the last chunk, the decay of every TTT that trains chunk by chunk.
pub fn chunk_cosine(peak: f64, c: usize, n_chunks: usize) -> f64 {
    let last = n_chunks.saturating_sub(1).max(1) as f64;
    peak * 0.5 * (1.0 + (std::f64::consts::PI * c as f64 / last).cos())
}

/// What happened to one chunk, in order: `Scored`, then (except for the last chunk) `Trained`.
#[derive(Clone, Debug, PartialEq)]
pub enum TttEvent {
    /// The chunk's windows were scored with the current weights; the scores are final.
    Scored {
        /// Chunk index.
        chunk: usize,
        /// Target indices scored (contiguous; the chunks' ranges tile `0..N` in order).
        targets: Range<usize>,
        /// Σ nll of those targets (nats).
        nll_sum: f64,
        /// Targets scored.
        tokens: u64,
        /// Their bytes (spec §2.2).
        bytes: u64,
        /// Time spent scoring.
        elapsed: Duration,
    },
    /// The model was trained on the chunk just scored.
    Trained {
        /// Chunk index.
        chunk: usize,
        /// Target indices trained on (all already scored).
        targets: Range<usize>,
        /// Learning rate used ([`TttConfig::chunk_lr`]).
        lr: f64,
        /// SGD steps taken.
        steps: usize,
        /// Time spent training.
        elapsed: Duration,
    },
}

/// The result of [`score_first_ttt`].
#[derive(Clone, Debug)]
pub struct TttOutcome {
    /// Every target's score, as it was when its chunk was scored: the reported `val_loss` and
    /// `val_bpb` (the per-chunk sums merged in chunk order).
    pub acc: BpbAccumulator,
    /// Number of chunks.
    pub chunks: usize,
    /// Per chunk: (Σ nll, targets scored).
    pub per_chunk: Vec<(f64, u64)>,
}

/// Legal score-first TTT (spec §4.7) of `tokens` (`N + 1` tokens, `N ≥ 1`): returns the score of
/// every target, each taken once, before the weights are trained on it.
///
/// Windows are those of [`windows`]; `n_chunks = ⌈N / chunk_tokens⌉`; a window belongs to chunk
/// `min(⌊(start + score_from) / chunk_tokens⌋, n_chunks − 1)` (the position of its first scored
/// target's input). For each chunk `c` in order:
///
/// 1. score its windows with the current weights (no autograd), in batches of `batch_windows`,
///    and add them to the result, never to be revisited ([`TttEvent::Scored`]);
/// 2. unless `c` is the last chunk, train on it ([`TttEvent::Trained`]): at
///    `lr_c =` [`TttConfig::chunk_lr`]`(c, n_chunks)`, the chunk's targets
///    `[c·chunk_tokens, min((c+1)·chunk_tokens, N))` are cut into `⌊chunk_len / seq_len⌋`
///    sequences (inputs `tokens[c·chunk_tokens + i·seq_len ..][.. seq_len]`, targets shifted by
///    one, all already scored); `epochs` passes over them in batches of up to `batch_seqs`
///    sequences, each: mean cross-entropy, backward, global gradient norm clipped to
///    `grad_clip` (torch's `clip_grad_norm_`: gradients scaled by `grad_clip / (norm + 1e-6)`
///    when that is below 1), one SGD step ([`EvalModel::sgd_step`]).
///
/// One SGD optimizer (momentum, no Nesterov, no weight decay) over all of the model's
/// parameters is created at the start ([`EvalModel::reset_sgd`]), so its momentum carries
/// across chunks. The weights are updated in place: after the call `model` holds the adapted
/// weights. `on_event` gets every
/// [`TttEvent`] as it happens; `keep_going` is asked before every scoring or training batch:
/// false gives `Ok(None)` (the weights may then be partly trained).
#[cfg(feature = "tools")]
pub fn score_first_ttt(
    model: &mut dyn EvalModel,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    cfg: &TttConfig,
    on_event: impl FnMut(&TttEvent),
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<TttOutcome>> {
    score_first_ttt_shared(model, tokens, tables, cfg, &Single, on_event, keep_going)
}

/// [`score_first_ttt`] shared by the ranks of `ranks` (record spec §4.7), every rank starting
/// from the same weights: each chunk's windows are split among the ranks as
/// [`sliding_eval_shared`] splits them and its sums added up over the ranks before the chunk
/// is trained on (the events carry the whole chunk's sums); each SGD step's sequences are split
/// among the ranks ([`train_sequences`]), and its gradient summed over them, so that every rank
/// takes the same step and the weights stay the same on every rank. The result does not
/// depend on the number of ranks, up to the order of floating-point sums.
#[allow(clippy::too_many_arguments)]
pub fn score_first_ttt_shared(
    model: &mut dyn EvalModel,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    cfg: &TttConfig,
    ranks: &dyn Collective,
    mut on_event: impl FnMut(&TttEvent),
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<TttOutcome>> {
    cfg.check()?;
    let n = check_tokens(model.config(), tokens, &tables)?;
    let (wins, chunk_windows) = chunk_plan(n, cfg);
    let n_chunks = chunk_windows.len();
    model.reset_sgd(cfg.momentum)?;
    let mut acc = BpbAccumulator::new(tables.clone());
    let mut per_chunk = Vec::with_capacity(n_chunks);
    // Targets `[0, scored_end)` have been scored.
    let mut scored_end = 0;
    for (c, window_range) in chunk_windows.into_iter().enumerate() {
        let t0 = Instant::now();
        let chunk_wins = &wins[window_range];
        let targets = match (chunk_wins.first(), chunk_wins.last()) {
            (Some(first), Some(last)) => first.scored().start..last.scored().end,
            _ => scored_end..scored_end,
        };
        anyhow::ensure!(targets.start == scored_end, "internal: chunk {c} scores from target {} after {scored_end}", targets.start);
        let mut chunk_acc = BpbAccumulator::new(tables.clone());
        let done = score_windows(model, tokens, chunk_wins, &cfg.sliding, ranks, &keep_going, |first, prev, tgt, nll| {
            chunk_acc.add(first, prev, tgt, nll)
        })?;
        if !done {
            return Ok(None);
        }
        let chunk_acc = chunk_acc.all_reduced(ranks)?;
        scored_end = targets.end;
        on_event(&TttEvent::Scored {
            chunk: c,
            targets,
            nll_sum: chunk_acc.nll_sum(),
            tokens: chunk_acc.tokens(),
            bytes: chunk_acc.bytes(),
            elapsed: t0.elapsed(),
        });
        acc.merge(&chunk_acc);
        per_chunk.push((chunk_acc.nll_sum(), chunk_acc.tokens()));
        if c + 1 == n_chunks {
            break;
        }
        let t0 = Instant::now();
        let lr = cfg.chunk_lr(c, n_chunks);
        let start = c * cfg.chunk_tokens;
        let chunk_len = ((c + 1) * cfg.chunk_tokens).min(n) - start;
        let seqs = chunk_len / cfg.sliding.seq_len;
        let trained = start..start + seqs * cfg.sliding.seq_len;
        // The legality guard: never train on a target that has not been scored.
        anyhow::ensure!(
            trained.end <= scored_end,
            "internal: chunk {c} would train on targets {trained:?}, scored only up to {scored_end}"
        );
        let Some(steps) = train_sequences(model, tokens, start, seqs, &cfg.training(), lr, ranks, &keep_going)? else {
            return Ok(None);
        };
        on_event(&TttEvent::Trained { chunk: c, targets: trained, lr, steps, elapsed: t0.elapsed() });
    }
    anyhow::ensure!(scored_end == n, "internal: scored {scored_end} of {n} targets");
    Ok(Some(TttOutcome { acc, chunks: n_chunks, per_chunk }))
}

/// The windows over `n` targets and, per chunk, the range of window indices it scores (chunks
/// in order; a window goes to `min(⌊first scored target / chunk_tokens⌋, n_chunks − 1)`; since
/// windows are in order of their first scored target, each chunk's windows are contiguous).
fn chunk_plan(n: usize, cfg: &TttConfig) -> (Vec<Window>, Vec<Range<usize>>) {
    let wins = windows(n, &cfg.sliding);
    let n_chunks = n.div_ceil(cfg.chunk_tokens);
    let mut ranges = Vec::with_capacity(n_chunks);
    let mut w = 0;
    for c in 0..n_chunks {
        let first = w;
        while w < wins.len() && (wins[w].scored().start / cfg.chunk_tokens).min(n_chunks - 1) == c {
            w += 1;
        }
        ranges.push(first..w);
    }
    debug_assert_eq!(w, wins.len());
    (wins, ranges)
}

/// How SGD trains on whole sequences of a token stream: score-first TTT's chunks, phased TTT's
/// global SGD.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqTraining {
    /// Inputs per sequence.
    pub seq_len: usize,
    /// Passes over the sequences.
    pub epochs: usize,
    /// Sequences per SGD step (at most).
    pub batch_seqs: usize,
    /// Maximum global gradient norm; 0: no clipping.
    pub grad_clip: f64,
    /// With `Some(bos)`, attention stays inside documents: each row is masked at its BOS tokens
    /// ([`crate::model::ops::DocumentMask`]); `None`: plain causal rows.
    pub doc_bos: Option<u32>,
}

/// Trains on `seqs` consecutive sequences of `seq_len` inputs from `tokens[start ..]` (targets
/// shifted by one): `epochs` passes, batches of up to `batch_seqs` sequences, one
/// [`EvalModel::sgd_step`] each (mean cross-entropy, backward, gradient norm clipped to
/// `grad_clip` as torch's `clip_grad_norm_`, SGD with the momentum of the optimizer the caller
/// made). Returns the steps taken, or `None` when `keep_going` said stop (on any rank: the ranks
/// agree before each step).
///
/// Several ranks share each batch: rank `r` takes the contiguous share
/// [`crate::dist::share`]`(rows, r, W)` of its rows, and its mean loss weighted by
/// `rows_r / rows`; the gradients are summed over the ranks (a rank without rows adds zeros),
/// which gives every rank the gradient of the whole batch's mean loss: the same step as one
/// rank, up to the order of the sums. (The record's ranks each average their own rows, then
/// the ranks' means; the two agree when the rows divide evenly, as the record's 16 per chunk
/// on 8 GPUs do.)
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_sequences(
    model: &mut dyn EvalModel,
    tokens: &[u32],
    start: usize,
    seqs: usize,
    cfg: &SeqTraining,
    lr: f64,
    ranks: &dyn Collective,
    keep_going: &impl Fn() -> bool,
) -> anyhow::Result<Option<usize>> {
    let t = cfg.seq_len;
    let mut steps = 0;
    for _ in 0..cfg.epochs {
        for first in (0..seqs).step_by(cfg.batch_seqs) {
            if !all_go_on(ranks, keep_going())? {
                return Ok(None);
            }
            let rows = cfg.batch_seqs.min(seqs - first);
            let mine = share(rows, ranks.rank(), ranks.world());
            let base = start + (first + mine.start) * t;
            let local = mine.len() * t;
            let step = SgdStep {
                x: &tokens[base..base + local],
                y: &tokens[base + 1..base + local + 1],
                t,
                rows,
                doc_bos: cfg.doc_bos,
                lr,
                grad_clip: cfg.grad_clip,
                from: base,
            };
            model.sgd_step(&step, ranks)?;
            steps += 1;
        }
    }
    Ok(Some(steps))
}

#[cfg(test)]
pub(crate) mod tests;
