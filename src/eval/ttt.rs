//! Sliding-window evaluation and legal score-first test-time training (TTT) of the validation
//! stream, as record `2026-04-09_SP8192_3LayerRecur_ParResid_QK525_LegalTTT` scores it (record
//! spec §2.5, §4.6, §4.7; legality conditions §6).
//!
//! **Targets.** `tokens` holds `N + 1` tokens and `N` targets; *target index* `i` (`0 ≤ i < N`)
//! is the token `tokens[i + 1]`, predicted from the input `tokens[i]` after the context
//! `tokens[.. i]`. Every [`Range`] of targets below is a range of target indices.
//!
//! **Sliding windows (§2.5, [`windows`], [`sliding_eval`]).** Windows of `seq_len = T` inputs
//! start every `stride` tokens; with `C = T − stride`, the first window scores all its targets and
//! every later one only its last `stride` targets, each of which therefore sees at least `C`
//! tokens of context. Every target is scored exactly once. Windows are run `batch_windows` at a
//! time as `(rows, T)` batches; a window shorter than `T` (at the end of the stream) is padded
//! with token 0 at the end, and padded positions are never scored. Padding cannot change a scored
//! position: every op of [`Gpt`] acts per position except attention, which is causal, so a
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

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::dist::share::{all_go_on, rounds, share};
use crate::dist::single::Single;
use crate::dist::{Collective, ReduceOp};
use crate::eval::bpb::{BpbAccumulator, ByteTables};
use crate::model::ops::DocumentMask;
use crate::model::{Gpt, PassExtras};
use crate::optim::Sgd;

/// Sliding-window geometry (spec §2.5; the record: `seq_len` 2048, `stride` 64, 32 windows per
/// batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingConfig {
    /// Inputs per window `T` (`EVAL_SEQ_LEN`).
    pub seq_len: usize,
    /// Tokens between window starts (`EVAL_STRIDE`); every window but the first scores this many
    /// targets. In `1..=seq_len`; `stride == seq_len` is the non-overlapping evaluation.
    pub stride: usize,
    /// Windows per forward pass.
    pub batch_windows: usize,
}

impl Default for SlidingConfig {
    /// The record's values: `seq_len` 2048, `stride` 64, `batch_windows` 32.
    fn default() -> Self {
        Self { seq_len: 2048, stride: 64, batch_windows: 32 }
    }
}

impl SlidingConfig {
    /// Checks the geometry; errors name the keys `seq_len`, `stride`, `batch_windows`.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.seq_len >= 1, "`seq_len` must be at least 1");
        anyhow::ensure!(
            (1..=self.seq_len).contains(&self.stride),
            "`stride` ({}) must be in 1..=`seq_len` ({})",
            self.stride,
            self.seq_len
        );
        anyhow::ensure!(self.batch_windows >= 1, "`batch_windows` must be at least 1");
        Ok(())
    }

    /// The unscored context `C = seq_len − stride` of every window but the first.
    pub fn context(&self) -> usize {
        self.seq_len.saturating_sub(self.stride)
    }
}

/// One window: inputs `tokens[start .. start + len)`, targets `tokens[start + 1 ..= start + len]`;
/// its positions `[score_from, len)` are scored, that is the targets [`Window::scored`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// First input token (and first target index) of the window.
    pub start: usize,
    /// Inputs (and targets) in the window, `1 ..= seq_len`.
    pub len: usize,
    /// First scored position: 0 for the first window, `C = seq_len − stride` for the others.
    pub score_from: usize,
}

impl Window {
    /// The target indices this window scores: `start + score_from .. start + len`.
    pub fn scored(&self) -> Range<usize> {
        self.start + self.score_from..self.start + self.len
    }
}

/// All windows over `n_targets` targets (`tokens.len() − 1`), as spec §2.5: starts
/// `ws = 0, stride, 2·stride, …` kept while `ws + C < n_targets` (`C = seq_len − stride`), length
/// `min(ws + seq_len, n_targets) − ws`; the first window scores all its positions, the others only
/// `[C, len)`. Every target is scored by exactly one window, every one but those of the first
/// window with at least `C` tokens of context.
///
/// The first window is kept even when `n_targets ≤ C` (the spec's rule would then keep no window
/// and score nothing; the record's stream is far longer, where the two agree). Empty for
/// `n_targets == 0`. Panics unless `1 ≤ stride ≤ seq_len` (see [`SlidingConfig::check`]).
pub fn windows(n_targets: usize, cfg: &SlidingConfig) -> Vec<Window> {
    assert!((1..=cfg.seq_len).contains(&cfg.stride), "windows: stride {} must be in 1..=seq_len ({})", cfg.stride, cfg.seq_len);
    let c = cfg.context();
    let mut out = Vec::new();
    if n_targets == 0 {
        return out;
    }
    let mut ws = 0;
    while ws == 0 || ws + c < n_targets {
        let len = (ws + cfg.seq_len).min(n_targets) - ws;
        out.push(Window { start: ws, len, score_from: if ws == 0 { 0 } else { c } });
        ws += cfg.stride;
    }
    out
}

/// Scores `tokens` (`N + 1` tokens, `N ≥ 1` targets, all ids below the model's vocabulary and
/// the tables' length) with sliding windows (spec §2.5): batches of `batch_windows` windows,
/// rows shorter than `seq_len` padded at the end (never scored), per-position losses from
/// [`Gpt::eval_token_losses`] (no autograd) added to a [`BpbAccumulator`] with `prev` = the input
/// token at each scored position. `keep_going` is asked before every batch: false gives
/// `Ok(None)` (a partial score is no score).
pub fn sliding_eval(
    model: &Gpt,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    cfg: &SlidingConfig,
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<BpbAccumulator>> {
    sliding_eval_shared(model, tokens, tables, cfg, &Single, keep_going)
}

/// [`sliding_eval`] shared by the ranks of `ranks` (record spec §2.5): each scores a contiguous
/// share of the windows ([`crate::dist::share`]), and the sums are added up over the ranks in
/// f64, so that every rank returns the whole score. Every rank holds the same weights and
/// tokens. The ranks agree before each batch whether to go on: one rank's stop stops all.
pub fn sliding_eval_shared(
    model: &Gpt,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    cfg: &SlidingConfig,
    ranks: &dyn Collective,
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<BpbAccumulator>> {
    cfg.check()?;
    let n = check_tokens(model, tokens, &tables)?;
    let mut acc = BpbAccumulator::new(tables);
    let done =
        score_windows(model, tokens, &windows(n, cfg), cfg, ranks, &keep_going, |_, prev, targets, nll| acc.add(prev, targets, nll))?;
    if !done {
        return Ok(None);
    }
    Ok(Some(acc.all_reduced(ranks)?))
}

/// Score-first TTT settings (spec §4.7). The defaults are the record's: `seq_len` 2048, `stride`
/// 64, `batch_windows` 32, `chunk_tokens` 32768 (`TTT_CHUNK_TOKENS`), `lr` 0.005 (`TTT_LR`),
/// `momentum` 0.9 (`TTT_MOMENTUM`), `epochs` 3 (`TTT_EPOCHS`), `batch_seqs` 32, `grad_clip` 1.0.
#[derive(Clone, Debug, PartialEq)]
pub struct TttConfig {
    /// Window geometry of the scoring; `sliding.seq_len` is also the training sequence length.
    pub sliding: SlidingConfig,
    /// Targets per chunk, at least `seq_len`.
    pub chunk_tokens: usize,
    /// Peak learning rate (of chunk 0), decayed over the chunks with a cosine to 0.
    pub lr: f64,
    /// SGD momentum (no Nesterov, no dampening, no weight decay).
    pub momentum: f64,
    /// Passes over each chunk's sequences.
    pub epochs: usize,
    /// Sequences per SGD step (at most).
    pub batch_seqs: usize,
    /// Maximum global gradient norm (`clip_grad_norm_`); 0 turns clipping off.
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
///    sequences, each: mean cross-entropy ([`Gpt::loss`]), backward, global gradient norm clipped
///    to `grad_clip` (torch's `clip_grad_norm_`: gradients scaled by `grad_clip / (norm + 1e-6)`
///    when that is below 1), one [`Sgd`] step.
///
/// One [`Sgd`] (momentum, no Nesterov, no weight decay) over all of the model's parameters is
/// created at the start, so its momentum carries across chunks. The parameters (candle `Var`s)
/// are updated in place: after the call `model` holds the adapted weights. `on_event` gets every
/// [`TttEvent`] as it happens; `keep_going` is asked before every scoring or training batch:
/// false gives `Ok(None)` (the weights may then be partly trained).
pub fn score_first_ttt(
    model: &Gpt,
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
    model: &Gpt,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    cfg: &TttConfig,
    ranks: &dyn Collective,
    mut on_event: impl FnMut(&TttEvent),
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<TttOutcome>> {
    cfg.check()?;
    let n = check_tokens(model, tokens, &tables)?;
    let (wins, chunk_windows) = chunk_plan(n, cfg);
    let n_chunks = chunk_windows.len();
    let params: Vec<(String, Var)> = model.params().iter().map(|(name, var, _)| (name.clone(), var.clone())).collect();
    let mut sgd = Sgd::new(params, cfg.momentum)?;
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
        let done =
            score_windows(model, tokens, chunk_wins, &cfg.sliding, ranks, &keep_going, |_, prev, tgt, nll| chunk_acc.add(prev, tgt, nll))?;
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
        let Some(steps) = train_sequences(model, tokens, start, seqs, &cfg.training(), &mut sgd, lr, ranks, &keep_going)? else {
            return Ok(None);
        };
        on_event(&TttEvent::Trained { chunk: c, targets: trained, lr, steps, elapsed: t0.elapsed() });
    }
    anyhow::ensure!(scored_end == n, "internal: scored {scored_end} of {n} targets");
    Ok(Some(TttOutcome { acc, chunks: n_chunks, per_chunk }))
}

/// Number of targets of `tokens`, after checking there is one and that every id fits the model
/// and the byte tables.
fn check_tokens(model: &Gpt, tokens: &[u32], tables: &ByteTables) -> anyhow::Result<usize> {
    anyhow::ensure!(tokens.len() >= 2, "{} validation tokens: at least 2 are needed to score one target", tokens.len());
    let limit = model.config().vocab_size.min(tables.len());
    if let Some(pos) = tokens.iter().position(|&t| t as usize >= limit) {
        anyhow::bail!(
            "token {} at position {pos} is not below the vocabulary ({} ids in the model, {} in the byte tables)",
            tokens[pos],
            model.config().vocab_size,
            tables.len()
        );
    }
    Ok(tokens.len() - 1)
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

/// Scores this rank's share of `wins` ([`crate::dist::share`]) in batches of
/// `cfg.batch_windows` padded `(rows, seq_len)` rows; for every window calls
/// `sink(first target index, prev, targets, nll)` with its scored positions. Before each
/// round of batches the ranks agree whether to go on (`keep_going` on any rank false:
/// `Ok(false)` on all); every rank runs as many rounds as the longest share takes.
#[allow(clippy::too_many_arguments)]
fn score_windows(
    model: &Gpt,
    tokens: &[u32],
    wins: &[Window],
    cfg: &SlidingConfig,
    ranks: &dyn Collective,
    keep_going: &impl Fn() -> bool,
    mut sink: impl FnMut(usize, &[u32], &[u32], &[f32]),
) -> anyhow::Result<bool> {
    let t = cfg.seq_len;
    let mine = &wins[share(wins.len(), ranks.rank(), ranks.world())];
    let mut batches = mine.chunks(cfg.batch_windows);
    for _ in 0..rounds(wins.len(), ranks.world(), cfg.batch_windows) {
        if !all_go_on(ranks, keep_going())? {
            return Ok(false);
        }
        let Some(batch) = batches.next() else { continue };
        let rows = batch.len();
        let (mut x, mut y) = (vec![0u32; rows * t], vec![0u32; rows * t]);
        for (r, w) in batch.iter().enumerate() {
            x[r * t..r * t + w.len].copy_from_slice(&tokens[w.start..w.start + w.len]);
            y[r * t..r * t + w.len].copy_from_slice(&tokens[w.start + 1..w.start + w.len + 1]);
        }
        let xt = Tensor::from_slice(&x, (rows, t), model.device())?;
        let yt = Tensor::from_slice(&y, (rows, t), model.device())?;
        let nll = model.eval_token_losses(&xt, &yt)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (r, w) in batch.iter().enumerate() {
            let pos = r * t + w.score_from..r * t + w.len;
            sink(w.start + w.score_from, &x[pos.clone()], &y[pos.clone()], &nll[pos]);
        }
    }
    Ok(true)
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
/// shifted by one): `epochs` passes, batches of up to `batch_seqs` sequences, one step each of
/// mean cross-entropy, backward, gradient norm clipped to `grad_clip` (torch's
/// `clip_grad_norm_`), [`Sgd`]. Returns the steps taken, or `None` when `keep_going` said stop
/// (on any rank: the ranks agree before each step).
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
    model: &Gpt,
    tokens: &[u32],
    start: usize,
    seqs: usize,
    cfg: &SeqTraining,
    sgd: &mut Sgd,
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
            let mut grads = GradStore::default();
            if !mine.is_empty() {
                let base = start + (first + mine.start) * t;
                let local = mine.len();
                let inputs = &tokens[base..base + local * t];
                let x = Tensor::from_slice(inputs, (local, t), model.device())?;
                let y = Tensor::from_slice(&tokens[base + 1..base + local * t + 1], (local, t), model.device())?;
                let mask = cfg.doc_bos.map(|bos| DocumentMask::at_token(inputs, t, bos)).transpose()?;
                let mut loss = model.token_losses_with(&x, &y, PassExtras { lora: None, docs: mask.as_ref() })?.mean_all()?;
                let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                anyhow::ensure!(value.is_finite(), "the TTT training loss is {value} on the sequences from target {base}");
                if local != rows {
                    loss = (loss * (local as f64 / rows as f64))?;
                }
                let mut store = loss.backward()?;
                // Only the parameters' gradients are kept; the activations' go with `store`.
                for (_, var, _) in model.params() {
                    if let Some(g) = store.remove(var.as_tensor()) {
                        grads.insert(var.as_tensor(), g);
                    }
                }
            }
            if !ranks.is_identity() {
                grads = sum_over_ranks(model, grads, ranks)?;
            }
            if cfg.grad_clip > 0.0 {
                clip_grad_norm(model, &mut grads, cfg.grad_clip)?;
            }
            sgd.step(&grads, lr)?;
            steps += 1;
        }
    }
    Ok(Some(steps))
}

/// Every parameter's gradient summed over the ranks (a parameter without one here counts as
/// zeros), in buckets ([`crate::dist::bucket`]).
fn sum_over_ranks(model: &Gpt, mut grads: GradStore, ranks: &dyn Collective) -> anyhow::Result<GradStore> {
    let vars: Vec<Var> = model.params().iter().map(|(_, v, _)| v.clone()).collect();
    let mine: Vec<Tensor> = vars
        .iter()
        .map(|v| match grads.remove(v.as_tensor()) {
            Some(g) => Ok(g),
            None => v.as_tensor().zeros_like(),
        })
        .collect::<candle_core::Result<_>>()?;
    let (summed, _) = crate::dist::bucket::all_reduce_tensors(ranks, &mine, ReduceOp::Sum, crate::dist::bucket::DEFAULT_BUCKET_ELEMS)?;
    let mut out = GradStore::default();
    for (v, g) in vars.iter().zip(summed) {
        out.insert(v.as_tensor(), g);
    }
    Ok(out)
}

/// `torch.nn.utils.clip_grad_norm_`: the global L2 norm of all gradients (summed in `f64`);
/// every gradient is scaled by `max / (norm + 1e-6)` when that is below 1. Returns the norm
/// before clipping.
fn clip_grad_norm(model: &Gpt, grads: &mut GradStore, max: f64) -> anyhow::Result<f64> {
    let mut sq = 0.0f64;
    for (_, var, _) in model.params() {
        if let Some(g) = grads.get(var.as_tensor()) {
            sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
    }
    let norm = sq.sqrt();
    let coef = max / (norm + 1e-6);
    if coef < 1.0 {
        for (_, var, _) in model.params() {
            if let Some(g) = grads.remove(var.as_tensor()) {
                grads.insert(var.as_tensor(), (g * coef)?);
            }
        }
    }
    Ok(norm)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::Cell;
    use std::collections::HashMap;

    use candle_core::Device;

    use super::*;
    use crate::model::ModelConfig;

    pub(crate) const VOCAB: usize = 32;

    /// A tiny float64 model whose parameters are all moved off their initial values (the zero
    /// output projections would otherwise make attention, and so the context, irrelevant).
    pub(crate) fn model() -> Gpt {
        let cfg = ModelConfig { vocab_size: VOCAB, num_layers: 2, model_dim: 16, num_heads: 2, num_kv_heads: 1, ..ModelConfig::default() };
        let m = Gpt::new(&cfg, 3, DType::F64, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(17);
        for (_, v, _) in m.params() {
            let old: Vec<f64> = v.flatten_all().unwrap().to_vec1().unwrap();
            let new: Vec<f64> = old.iter().map(|x| x + rng.f64() * 0.6 - 0.3).collect();
            v.set(&Tensor::from_vec(new, v.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        m
    }

    /// Hand-made byte tables: id 0 is a boundary (0 bytes), the others 1 to 3 bytes, every third
    /// one with a leading space.
    pub(crate) fn tables() -> Arc<ByteTables> {
        Arc::new(ByteTables {
            base_bytes: (0..VOCAB).map(|i| if i == 0 { 0 } else { 1 + (i % 3) as u16 }).collect(),
            leading_space: (0..VOCAB).map(|i| i % 3 == 0 && i > 0).collect(),
            is_boundary: (0..VOCAB).map(|i| i == 0).collect(),
            has_space_piece: true,
        })
    }

    fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..n).map(|_| rng.u32(0..VOCAB as u32)).collect()
    }

    fn params(m: &Gpt) -> Vec<Vec<f64>> {
        m.params().iter().map(|(_, v, _)| v.flatten_all().unwrap().to_vec1::<f64>().unwrap()).collect()
    }

    /// The loss of target `j` computed on its own: the window the spec's geometry gives it
    /// (`ws = 0` for `j < T`, else the largest multiple of `stride` with `ws + C ≤ j`), run alone
    /// and unpadded. Also returns that window's start.
    fn direct_nll(m: &Gpt, tokens: &[u32], j: usize, sc: &SlidingConfig) -> (f64, usize) {
        let (t, c, n) = (sc.seq_len, sc.context(), tokens.len() - 1);
        let ws = if j < t { 0 } else { (j - c) / sc.stride * sc.stride };
        let len = (ws + t).min(n) - ws;
        let x = Tensor::from_slice(&tokens[ws..ws + len], (1, len), &Device::Cpu).unwrap();
        let y = Tensor::from_slice(&tokens[ws + 1..ws + len + 1], (1, len), &Device::Cpu).unwrap();
        let nll: Vec<f64> = m.eval_token_losses(&x, &y).unwrap().to_vec1().unwrap();
        (nll[j - ws], ws)
    }

    /// Per-target losses from the sliding scorer (each target must be scored exactly once).
    fn sliding_losses(m: &Gpt, tokens: &[u32], sc: &SlidingConfig) -> Vec<f32> {
        let n = tokens.len() - 1;
        let mut out = vec![None; n];
        let done = score_windows(m, tokens, &windows(n, sc), sc, &Single, &|| true, |first, prev, tgt, nll| {
            for (k, &l) in nll.iter().enumerate() {
                assert_eq!((prev[k], tgt[k]), (tokens[first + k], tokens[first + k + 1]));
                assert!(out[first + k].replace(l).is_none(), "target {} scored twice", first + k);
            }
        })
        .unwrap();
        assert!(done);
        out.into_iter().enumerate().map(|(j, l)| l.unwrap_or_else(|| panic!("target {j} not scored"))).collect()
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * a.abs().max(b.abs()).max(1.0)
    }

    // ---------- geometry ----------

    /// Every target scored exactly once, each with at least `C` tokens of context outside the
    /// first window, and (when `N > C`) exactly the spec's window list
    /// `[ws for ws in range(0, N, stride) if ws + C < N]`.
    #[test]
    fn windows_score_every_target_exactly_once() {
        for t in [1usize, 2, 3, 5, 8, 16] {
            for stride in 1..=t {
                let sc = SlidingConfig { seq_len: t, stride, batch_windows: 1 };
                let c = t - stride;
                for n in (0..=3 * t + 5).chain([100, 257]) {
                    let wins = windows(n, &sc);
                    let mut count = vec![0u32; n];
                    for (i, w) in wins.iter().enumerate() {
                        assert_eq!(w.start, i * stride, "T {t} stride {stride} N {n}");
                        assert!(w.len >= 1 && w.len <= t && w.start + w.len <= n && w.score_from < w.len, "{w:?} T {t} N {n}");
                        assert_eq!(w.len, (w.start + t).min(n) - w.start);
                        if i == 0 {
                            assert_eq!(w.score_from, 0);
                        } else {
                            assert_eq!(w.score_from, c, "every later window scores [C, L)");
                        }
                        for j in w.scored() {
                            count[j] += 1;
                            if i > 0 {
                                assert!(j - w.start >= c, "target {j} has {} < C = {c} tokens of context", j - w.start);
                            }
                        }
                    }
                    assert!(count.iter().all(|&k| k == 1), "T {t} stride {stride} N {n}: counts {count:?}");
                    if n > c {
                        let spec: Vec<usize> = (0..n).step_by(stride).filter(|ws| ws + c < n).collect();
                        assert_eq!(wins.iter().map(|w| w.start).collect::<Vec<_>>(), spec, "T {t} stride {stride} N {n}");
                    } else if n > 0 {
                        assert_eq!(wins, [Window { start: 0, len: n, score_from: 0 }], "a short stream is one window");
                    }
                }
            }
        }
        // The record's numbers (spec §2.5): 633,409 windows for N = 40,540,160, T = 2048, stride 64.
        assert_eq!(windows(40_540_160, &SlidingConfig::default()).len(), 633_409);
    }

    /// With chunk and stride dividing each other as in the record, chunk `c` scores exactly the
    /// targets `[c·chunk, (c+1)·chunk)` (spec §4.7); the last chunk the rest.
    #[test]
    fn chunks_score_their_own_targets() {
        let cfg = TttConfig { sliding: SlidingConfig { seq_len: 2048, stride: 64, batch_windows: 32 }, ..TttConfig::default() };
        let n = 40_540_160;
        let (wins, ranges) = chunk_plan(n, &cfg);
        assert_eq!(ranges.len(), 1238);
        for (c, r) in ranges.iter().enumerate() {
            let scored = wins[r.start].scored().start..wins[r.end - 1].scored().end;
            assert_eq!(scored, 32_768 * c..(32_768 * (c + 1)).min(n), "chunk {c}");
        }
        assert_eq!(n - 32_768 * 1237, 6_144);
        // A geometry where stride does not divide the chunk: still a contiguous tiling, every
        // window in the chunk of its first scored target.
        let cfg =
            TttConfig { sliding: SlidingConfig { seq_len: 8, stride: 3, batch_windows: 2 }, chunk_tokens: 10, ..TttConfig::default() };
        let (wins, ranges) = chunk_plan(53, &cfg);
        assert_eq!(ranges.len(), 6);
        assert_eq!(ranges.last().unwrap().end, wins.len());
        for (c, r) in ranges.iter().enumerate() {
            for w in &wins[r.clone()] {
                assert_eq!((w.scored().start / 10).min(5), c);
            }
        }
    }

    #[test]
    fn config_check_names_the_keys() {
        TttConfig::default().check().unwrap();
        let base =
            TttConfig { sliding: SlidingConfig { seq_len: 8, stride: 4, batch_windows: 2 }, chunk_tokens: 16, ..TttConfig::default() };
        base.check().unwrap();
        let err = |f: &dyn Fn(&mut TttConfig)| {
            let mut c = base.clone();
            f(&mut c);
            c.check().unwrap_err().to_string()
        };
        type Case<'a> = (&'a dyn Fn(&mut TttConfig), &'a str);
        let cases: [Case; 11] = [
            (&|c| c.sliding.seq_len = 0, "`seq_len`"),
            (&|c| c.sliding.stride = 0, "`stride`"),
            (&|c| c.sliding.stride = 9, "`stride`"),
            (&|c| c.sliding.batch_windows = 0, "`batch_windows`"),
            (&|c| c.chunk_tokens = 7, "`chunk_tokens`"),
            (&|c| c.lr = -1.0, "`lr`"),
            (&|c| c.lr = f64::NAN, "`lr`"),
            (&|c| c.momentum = 1.0, "`momentum`"),
            (&|c| c.epochs = 0, "`epochs`"),
            (&|c| c.batch_seqs = 0, "`batch_seqs`"),
            (&|c| c.grad_clip = -0.5, "`grad_clip`"),
        ];
        for (f, key) in cases {
            let e = err(f);
            assert!(e.contains(key), "{e:?} should name {key}");
        }
        // The cosine schedule: lr at chunk 0, half way in the middle, 0 at the last chunk.
        assert_eq!(base.chunk_lr(0, 5), base.lr);
        assert!((base.chunk_lr(2, 5) - base.lr / 2.0).abs() < 1e-15);
        assert!(base.chunk_lr(4, 5).abs() < 1e-15);
        assert_eq!(base.chunk_lr(0, 1), base.lr);
    }

    // ---------- sliding evaluation ----------

    /// `stride == seq_len` is the non-overlapping evaluation: the loop of
    /// `Validator::run` (consecutive sequences, other batch sizes) gives the same sums.
    #[test]
    fn sliding_with_full_stride_is_the_non_overlapping_eval() {
        let m = model();
        let t = 8;
        let tokens = random_tokens(7 * t + 1, 1);
        let tables = tables();
        let mut want = BpbAccumulator::new(tables.clone());
        for s in (0..7).step_by(2) {
            let rows = 2.min(7 - s);
            let (x, y) = (&tokens[s * t..(s + rows) * t], &tokens[s * t + 1..(s + rows) * t + 1]);
            let xt = Tensor::from_slice(x, (rows, t), &Device::Cpu).unwrap();
            let yt = Tensor::from_slice(y, (rows, t), &Device::Cpu).unwrap();
            let nll = m.eval_token_losses(&xt, &yt).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
            want.add(x, y, &nll);
        }
        let sc = SlidingConfig { seq_len: t, stride: t, batch_windows: 3 };
        let got = sliding_eval(&m, &tokens, tables, &sc, || true).unwrap().unwrap();
        assert_eq!((got.tokens(), got.bytes()), (want.tokens(), want.bytes()));
        assert!((got.nll_sum() - want.nll_sum()).abs() < 1e-9, "{} vs {}", got.nll_sum(), want.nll_sum());
        assert!(want.tokens() == 56 && want.bytes() > 0);
    }

    /// With a small stride every target's loss is the one of its own window run alone and
    /// unpadded (so the padding of the short last windows cannot reach a scored position), and
    /// the accumulator holds exactly these losses and the bytes of every (input, target) pair.
    #[test]
    fn sliding_losses_match_each_targets_own_window() {
        let m = model();
        let sc = SlidingConfig { seq_len: 16, stride: 4, batch_windows: 5 };
        // N = 83: the last windows are shorter than T and padded.
        let tokens = random_tokens(84, 2);
        let n = tokens.len() - 1;
        let losses = sliding_losses(&m, &tokens, &sc);
        let mut sum = 0.0;
        for (j, &l) in losses.iter().enumerate() {
            let (want, ws) = direct_nll(&m, &tokens, j, &sc);
            assert!(close(f64::from(l), want, 1e-6), "target {j}: sliding {l}, direct {want}");
            assert!(j < sc.seq_len || j - ws >= sc.context(), "target {j} scored with {} of context", j - ws);
            sum += f64::from(l);
        }
        let acc = sliding_eval(&m, &tokens, tables(), &sc, || true).unwrap().unwrap();
        assert_eq!(acc.tokens(), n as u64);
        assert_eq!(acc.bytes(), tables().count_bytes(&tokens[..n], &tokens[1..]));
        assert!(close(acc.nll_sum(), sum, 1e-12));
        // The context matters: a full-stride evaluation (context reset every T) scores differently.
        let full = sliding_eval(&m, &tokens, tables(), &SlidingConfig { stride: 16, ..sc }, || true).unwrap().unwrap();
        assert!((full.nll_sum() - acc.nll_sum()).abs() > 1e-3);
    }

    #[test]
    fn sliding_eval_stops_and_rejects_bad_tokens() {
        let m = model();
        let sc = SlidingConfig { seq_len: 8, stride: 2, batch_windows: 2 };
        let tokens = random_tokens(40, 3);
        let calls = Cell::new(0);
        let stop_after_two = || {
            calls.set(calls.get() + 1);
            calls.get() <= 2
        };
        assert!(sliding_eval(&m, &tokens, tables(), &sc, stop_after_two).unwrap().is_none());
        assert_eq!(calls.get(), 3);
        let mut bad = tokens.clone();
        bad[7] = VOCAB as u32;
        let e = sliding_eval(&m, &bad, tables(), &sc, || true).unwrap_err().to_string();
        assert!(e.contains("position 7"), "{e}");
        assert!(sliding_eval(&m, &tokens[..1], tables(), &sc, || true).is_err());
        let e = sliding_eval(&m, &tokens, tables(), &SlidingConfig { stride: 9, ..sc }, || true).unwrap_err().to_string();
        assert!(e.contains("`stride`"), "{e}");
    }

    // ---------- score-first TTT ----------

    /// Chunk, stride and sequence length aligned as in the record: 6 chunks of 16 targets (the
    /// last one 6), 2 training sequences per chunk, batches of 1 sequence so momentum carries
    /// over several steps per chunk; the gradients are clipped.
    fn aligned() -> TttConfig {
        TttConfig {
            sliding: SlidingConfig { seq_len: 8, stride: 4, batch_windows: 3 },
            chunk_tokens: 16,
            lr: 0.05,
            momentum: 0.9,
            epochs: 2,
            batch_seqs: 1,
            grad_clip: 1.0,
        }
    }

    /// Stride dividing neither the chunk nor the sequence length, a chunk that is not a whole
    /// number of sequences: windows straddle chunk borders.
    fn misaligned() -> TttConfig {
        TttConfig {
            sliding: SlidingConfig { seq_len: 6, stride: 4, batch_windows: 2 },
            chunk_tokens: 14,
            lr: 0.05,
            momentum: 0.9,
            epochs: 2,
            batch_seqs: 2,
            grad_clip: 1.0,
        }
    }

    fn run(tokens: &[u32], cfg: &TttConfig) -> (TttOutcome, Vec<TttEvent>, Gpt) {
        let (out, events, _, m) = run_with_snapshots(tokens, cfg);
        (out, events, m)
    }

    /// Weights of every parameter, in `params` order.
    type Snapshot = Vec<Vec<f64>>;

    /// [`run`] that also copies the model's weights at every event, as they are when it is
    /// reported.
    fn run_with_snapshots(tokens: &[u32], cfg: &TttConfig) -> (TttOutcome, Vec<TttEvent>, Vec<Snapshot>, Gpt) {
        let m = model();
        let (mut events, mut snaps) = (Vec::new(), Vec::new());
        let on_event = |e: &TttEvent| {
            events.push(e.clone());
            snaps.push(params(&m));
        };
        let out = score_first_ttt(&m, tokens, tables(), cfg, on_event, || true).unwrap().unwrap();
        (out, events, snaps, m)
    }

    /// A fresh model holding the weights `snap`.
    fn model_from(snap: &[Vec<f64>]) -> Gpt {
        let m = model();
        for ((_, v, _), w) in m.params().iter().zip(snap) {
            v.set(&Tensor::from_slice(w, v.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        m
    }

    fn scored_ranges(events: &[TttEvent]) -> Vec<Range<usize>> {
        events.iter().filter_map(|e| if let TttEvent::Scored { targets, .. } = e { Some(targets.clone()) } else { None }).collect()
    }

    /// (c), (d), (f): the trace is S0 T0 S1 T1 … S(n−1); scored ranges tile `0..N` left to right
    /// (each target once); every trained range is non-empty and inside the targets already
    /// scored; no scored range meets an earlier trained range; the last chunk is never trained
    /// on; the result is the sum of the scores as they were emitted (no rescoring).
    #[test]
    fn ttt_trace_is_score_first_single_pass() {
        for (cfg, n) in [(aligned(), 86usize), (misaligned(), 61)] {
            let tokens = random_tokens(n + 1, 4);
            let (out, events, _) = run(&tokens, &cfg);
            let n_chunks = n.div_ceil(cfg.chunk_tokens);
            assert_eq!(out.chunks, n_chunks);
            assert_eq!(events.len(), 2 * n_chunks - 1);
            let (mut scored_end, mut trained): (usize, Vec<Range<usize>>) = (0, Vec::new());
            let (mut nll, mut toks, mut bytes) = (0.0f64, 0u64, 0u64);
            let mut emitted = Vec::new();
            for (i, e) in events.iter().enumerate() {
                match e {
                    TttEvent::Scored { chunk, targets, nll_sum, tokens: k, bytes: b, .. } => {
                        assert_eq!((i % 2, *chunk), (0, i / 2), "scoring of chunk {chunk} out of order");
                        assert_eq!(targets.start, scored_end, "chunk {chunk}: targets scored twice or skipped");
                        assert_eq!(*k as usize, targets.len());
                        for r in &trained {
                            assert!(
                                r.end <= targets.start || r.start >= targets.end,
                                "chunk {chunk} scores {targets:?}, trained on {r:?} before"
                            );
                        }
                        scored_end = targets.end;
                        nll += nll_sum;
                        toks += k;
                        bytes += b;
                        emitted.push((*nll_sum, *k));
                    }
                    TttEvent::Trained { chunk, targets, lr, steps, .. } => {
                        assert_eq!((i % 2, *chunk), (1, i / 2), "training of chunk {chunk} not right after its scoring");
                        assert!(*chunk < n_chunks - 1, "the last chunk is never trained on");
                        assert!(
                            !targets.is_empty() && targets.end <= scored_end,
                            "chunk {chunk} trains on {targets:?}, scored only < {scored_end}"
                        );
                        assert_eq!(targets.start, chunk * cfg.chunk_tokens);
                        assert_eq!(targets.len(), cfg.chunk_tokens / cfg.sliding.seq_len * cfg.sliding.seq_len);
                        assert_eq!(*lr, cfg.chunk_lr(*chunk, n_chunks));
                        let seqs = targets.len() / cfg.sliding.seq_len;
                        assert_eq!(*steps, cfg.epochs * seqs.div_ceil(cfg.batch_seqs));
                        trained.push(targets.clone());
                    }
                }
            }
            assert_eq!(scored_end, n, "every target scored");
            assert_eq!(out.per_chunk, emitted);
            assert_eq!(out.acc.nll_sum().to_bits(), nll.to_bits(), "the result is the emitted scores, bit for bit");
            assert_eq!((out.acc.tokens(), out.acc.bytes()), (toks, bytes));
            assert_eq!((toks, bytes), (n as u64, tables().count_bytes(&tokens[..n], &tokens[1..])));
            if cfg == aligned() {
                let want: Vec<Range<usize>> = (0..n_chunks).map(|c| 16 * c..(16 * (c + 1)).min(n)).collect();
                assert_eq!(scored_ranges(&events), want);
            }
        }
    }

    /// (a), (e): chunk 0 is scored with the untouched weights — bit for bit the score of a run
    /// that never trains (lr 0) and equal to the sliding evaluation of its targets — while every
    /// later chunk's score, and the weights, differ (the adaptation is real, so the other tests
    /// cannot pass vacuously). With lr 0 the whole run is the sliding evaluation.
    #[test]
    fn ttt_first_chunk_is_the_untrained_score_and_later_ones_adapt() {
        let cfg = aligned();
        let n = 86;
        let tokens = random_tokens(n + 1, 5);
        let (out, _, trained_model) = run(&tokens, &cfg);
        let (frozen, _, frozen_model) = run(&tokens, &TttConfig { lr: 0.0, ..cfg.clone() });
        assert_eq!(out.per_chunk[0].0.to_bits(), frozen.per_chunk[0].0.to_bits());
        assert_eq!(out.per_chunk[0].1, frozen.per_chunk[0].1);
        for c in 1..out.chunks {
            let (a, b) = (out.per_chunk[c].0, frozen.per_chunk[c].0);
            assert!((a - b).abs() > 1e-4, "chunk {c}: TTT {a} vs no TTT {b}: training changed nothing");
        }
        let fresh = params(&model());
        assert_eq!(params(&frozen_model), fresh, "lr 0 leaves the weights alone");
        assert_ne!(params(&trained_model), fresh);

        let sc = cfg.sliding;
        let losses = sliding_losses(&frozen_model, &tokens, &sc);
        let chunk0: f64 = losses[..16].iter().map(|&l| f64::from(l)).sum();
        assert!(close(out.per_chunk[0].0, chunk0, 1e-12), "{} vs {chunk0}", out.per_chunk[0].0);
        let sliding = sliding_eval(&frozen_model, &tokens, tables(), &sc, || true).unwrap().unwrap();
        assert!(close(frozen.acc.nll_sum(), sliding.nll_sum(), 1e-12));
        assert_eq!((frozen.acc.tokens(), frozen.acc.bytes()), (sliding.tokens(), sliding.bytes()));
    }

    /// (b): changing the tokens after the last target chunk `c` scores leaves the scores of
    /// chunks `0..=c` bit for bit unchanged (no chunk's score depends on later tokens), and the
    /// weights after training on chunk `c` too (so the weights that score chunk `c + 1` were
    /// trained on nothing past chunk `c`), while the later chunks' scores do change.
    #[test]
    fn ttt_scores_do_not_depend_on_later_tokens() {
        for (cfg, n) in [(aligned(), 86usize), (misaligned(), 61)] {
            let tokens = random_tokens(n + 1, 6);
            let (base, events, snaps, _) = run_with_snapshots(&tokens, &cfg);
            let ranges = scored_ranges(&events);
            for c in [0, 1, base.chunks - 2] {
                // Target index `end − 1` is token `end`: change every token after it.
                let end = ranges[c].end;
                let mut changed = tokens.clone();
                let mut rng = fastrand::Rng::with_seed(c as u64);
                for t in &mut changed[end + 1..] {
                    *t = (*t + rng.u32(1..VOCAB as u32)) % VOCAB as u32;
                }
                let (other, other_events, other_snaps, _) = run_with_snapshots(&changed, &cfg);
                assert_eq!(scored_ranges(&other_events), ranges);
                for k in 0..=c {
                    assert_eq!(
                        base.per_chunk[k].0.to_bits(),
                        other.per_chunk[k].0.to_bits(),
                        "chunk {k} moved when tokens after chunk {c} changed"
                    );
                }
                for k in c + 1..base.chunks {
                    assert_ne!(base.per_chunk[k].0, other.per_chunk[k].0, "chunk {k} should see the change");
                }
                // The weights after training on chunk `c` (events S0 T0 … Sc Tc), which score
                // chunk `c + 1`, do not depend on the later tokens either.
                assert!(snaps[..=2 * c + 1] == other_snaps[..=2 * c + 1], "weights up to the training of chunk {c} saw later tokens");
                if c + 2 < base.chunks {
                    assert!(snaps.last() != other_snaps.last(), "training on the changed chunk {} moves the weights", c + 1);
                }
            }
        }
    }

    /// Each chunk is scored with exactly the weights left by the training of the previous chunk
    /// (the initial weights for chunk 0): the weights do not move between `Trained { c − 1 }`
    /// and `Scored { c }`, and the reported score is the one those weights give (recomputed
    /// target by target on a copy), not the one of the weights after training on the chunk
    /// itself. With (b) this is score-before-update without trusting the trace's order.
    #[test]
    fn ttt_scores_each_chunk_with_the_weights_before_its_training() {
        for (cfg, n) in [(aligned(), 86usize), (misaligned(), 61)] {
            let tokens = random_tokens(n + 1, 10);
            let (out, events, snaps, _) = run_with_snapshots(&tokens, &cfg);
            let score = |snap: &[Vec<f64>], targets: &Range<usize>| -> f64 {
                let m = model_from(snap);
                targets.clone().map(|j| direct_nll(&m, &tokens, j, &cfg.sliding).0).sum()
            };
            for (i, e) in events.iter().enumerate() {
                let TttEvent::Scored { chunk, targets, nll_sum, .. } = e else {
                    continue;
                };
                let before = if i == 0 { params(&model()) } else { snaps[i - 1].clone() };
                assert!(snaps[i] == before, "chunk {chunk}: the weights moved between the previous training and the scoring");
                let want = score(&before, targets);
                assert!(close(*nll_sum, want, 1e-6), "chunk {chunk}: reported {nll_sum}, its weights give {want}");
                assert_eq!(out.per_chunk[*chunk].0, *nll_sum);
                if let Some(after) = snaps.get(i + 1) {
                    let adapted = score(after, targets);
                    assert!((adapted - want).abs() > 1e-3, "chunk {chunk}: training on it must change its score ({adapted} vs {want})");
                }
            }
        }
    }

    /// An independent replay of §4.7 written with plain loops: score chunk `c` target by target
    /// (each in its own window, unpadded) with weights trained only on chunks `< c`, then train
    /// on chunk `c` (mean CE, backward, clip, SGD). Every chunk's TTT score matches the replay,
    /// and not the illegal order (train on the chunk, then score it), which differs by far more
    /// than the tolerance; the final weights match (the last chunk is never trained on).
    #[test]
    fn ttt_matches_an_independent_score_then_train_replay() {
        let cfg = aligned();
        let (n, chunk, t) = (86usize, cfg.chunk_tokens, cfg.sliding.seq_len);
        let tokens = random_tokens(n + 1, 7);
        let (out, _, ttt_model) = run(&tokens, &cfg);
        let n_chunks = out.chunks;

        let m = model();
        let all: Vec<(String, Var)> = m.params().iter().map(|(name, v, _)| (name.clone(), v.clone())).collect();
        let mut sgd = Sgd::new(all, cfg.momentum).unwrap();
        let chunk_score =
            |m: &Gpt, c: usize| -> f64 { (c * chunk..((c + 1) * chunk).min(n)).map(|j| direct_nll(m, &tokens, j, &cfg.sliding).0).sum() };
        for c in 0..n_chunks {
            let legal = chunk_score(&m, c);
            let got = out.per_chunk[c].0;
            assert!(close(got, legal, 1e-6), "chunk {c}: TTT {got}, score-first replay {legal}");
            if c + 1 == n_chunks {
                break;
            }
            let lr = cfg.lr * 0.5 * (1.0 + (std::f64::consts::PI * c as f64 / (n_chunks - 1) as f64).cos());
            for _ in 0..cfg.epochs {
                for s in 0..chunk / t {
                    let base = c * chunk + s * t;
                    let x = Tensor::from_slice(&tokens[base..base + t], (1, t), &Device::Cpu).unwrap();
                    let y = Tensor::from_slice(&tokens[base + 1..base + t + 1], (1, t), &Device::Cpu).unwrap();
                    let mut store = m.loss(&x, &y).unwrap().backward().unwrap();
                    let mut grads = GradStore::default();
                    let mut sq = 0.0;
                    for (_, v, _) in m.params() {
                        let g = store.remove(v.as_tensor()).unwrap();
                        sq += g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
                        grads.insert(v.as_tensor(), g);
                    }
                    let coef = (cfg.grad_clip / (sq.sqrt() + 1e-6)).min(1.0);
                    let scaled: HashMap<String, Tensor> =
                        m.params().iter().map(|(name, v, _)| (name.clone(), (grads.get(v.as_tensor()).unwrap() * coef).unwrap())).collect();
                    for (name, v, _) in m.params() {
                        grads.insert(v.as_tensor(), scaled[name].clone());
                    }
                    sgd.step(&grads, lr).unwrap();
                }
            }
            let illegal = chunk_score(&m, c);
            assert!((illegal - legal).abs() > 1e-3, "chunk {c}: scoring after training ({illegal}) must be distinguishable from {legal}");
            assert!(!close(got, illegal, 1e-6));
        }
        for ((name, _, _), (a, b)) in m.params().iter().zip(params(&m).iter().zip(params(&ttt_model).iter())) {
            let err = crate::model::compare::worst(a.iter().zip(b).map(|(x, y)| (x - y).abs()));
            assert!(err < 1e-9, "{name}: replay and TTT weights differ by {err}");
        }
    }

    /// On a stream that repeats a short phrase, test-time training lowers the loss of later
    /// chunks (the update goes downhill), and the chunk-0 score is unaffected.
    #[test]
    fn ttt_learns_a_repeated_phrase() {
        let phrase = random_tokens(5, 8);
        let tokens: Vec<u32> = (0..161).map(|i| phrase[i % 5]).collect();
        let cfg = TttConfig { lr: 0.5, epochs: 3, batch_seqs: 2, ..aligned() };
        let (out, _, _) = run(&tokens, &cfg);
        let (frozen, _, _) = run(&tokens, &TttConfig { lr: 0.0, ..cfg.clone() });
        assert_eq!(out.per_chunk[0].0.to_bits(), frozen.per_chunk[0].0.to_bits());
        let later = |o: &TttOutcome| o.per_chunk[1..].iter().map(|p| p.0).sum::<f64>();
        assert!(later(&out) < 0.5 * later(&frozen), "TTT {} vs frozen {}", later(&out), later(&frozen));
        assert!(out.acc.val_bpb() < frozen.acc.val_bpb());
    }

    #[test]
    fn ttt_stops_when_asked_and_checks_its_config() {
        let tokens = random_tokens(87, 9);
        // Scoring batches and training batches both ask: stop at every possible point.
        for stop_at in [1, 2, 3, 4, 8, 12] {
            let calls = Cell::new(0);
            let keep_going = || {
                calls.set(calls.get() + 1);
                calls.get() < stop_at
            };
            let r = score_first_ttt(&model(), &tokens, tables(), &aligned(), |_| {}, keep_going).unwrap();
            assert!(r.is_none(), "stop at call {stop_at}");
            assert_eq!(calls.get(), stop_at);
        }
        let e = score_first_ttt(&model(), &tokens, tables(), &TttConfig { chunk_tokens: 4, ..aligned() }, |_| {}, || true).unwrap_err();
        assert!(e.to_string().contains("`chunk_tokens`"), "{e}");
        // A stream shorter than one chunk: one chunk, scored, never trained on.
        let mut events = Vec::new();
        let out = score_first_ttt(&model(), &tokens[..11], tables(), &aligned(), |e| events.push(e.clone()), || true).unwrap().unwrap();
        assert_eq!((out.chunks, out.acc.tokens(), events.len()), (1, 10, 1));
    }
}
