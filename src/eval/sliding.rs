//! Sliding-window scoring of the validation stream (record spec §2.5): the windows, the
//! scoring of a rank's share of them, and the whole-stream score. Score-first TTT ([`super::ttt`])
//! scores its chunks with the same windows and the same scoring.
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
//! position: every op of the model acts per position except attention, which is causal, so a
//! position only sees itself and earlier positions of its own row. The passes run on either
//! executor ([`EvalModel`]: the engine, or candle).

use std::ops::Range;
use std::sync::Arc;

use crate::dist::Collective;
use crate::dist::share::{all_go_on, rounds, share};
#[cfg(feature = "tools")]
use crate::dist::single::Single;
use crate::eval::bpb::{BpbAccumulator, ByteTables};
use crate::eval::executor::EvalModel;

/// Sliding-window geometry (spec §2.5; the record: `seq_len` 2048, `stride` 64, 32 windows per
/// batch). The keys of the evaluation stages, flattened into their tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(default)]
pub struct SlidingConfig {
    /// Window length in tokens (`EVAL_SEQ_LEN`; the records use 2048). As a stage's key it
    /// defaults to 0: the run's `train.seq_len` ([`SlidingConfig::at`]).
    #[serde(default)]
    pub seq_len: usize,
    /// Tokens between window starts (`EVAL_STRIDE`, 64 in the records); every window but the
    /// first scores this many targets. In `1..=seq_len`; `stride == seq_len` is the
    /// non-overlapping evaluation.
    pub stride: usize,
    /// Windows per forward pass (32 in the records).
    pub batch_windows: usize,
}

impl Default for SlidingConfig {
    /// The record's values: `seq_len` 2048, `stride` 64, `batch_windows` 32.
    fn default() -> Self {
        Self { seq_len: 2048, stride: 64, batch_windows: 32 }
    }
}

impl SlidingConfig {
    /// This geometry with a `seq_len` of 0 read as `train_seq_len`.
    pub fn at(self, train_seq_len: usize) -> Self {
        Self { seq_len: if self.seq_len == 0 { train_seq_len } else { self.seq_len }, ..self }
    }

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
/// [`EvalModel::token_losses`] (forward passes only) added to a [`BpbAccumulator`] with `prev` = the input
/// token at each scored position. `keep_going` is asked before every batch: false gives
/// `Ok(None)` (a partial score is no score).
#[cfg(feature = "tools")]
pub fn sliding_eval(
    model: &mut dyn EvalModel,
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
    model: &mut dyn EvalModel,
    tokens: &[u32],
    tables: Arc<ByteTables>,
    cfg: &SlidingConfig,
    ranks: &dyn Collective,
    keep_going: impl Fn() -> bool,
) -> anyhow::Result<Option<BpbAccumulator>> {
    cfg.check()?;
    let n = check_tokens(model.config(), tokens, &tables)?;
    let mut acc = BpbAccumulator::new(tables);
    let done = score_windows(model, tokens, &windows(n, cfg), cfg, ranks, &keep_going, |first, prev, targets, nll| {
        acc.add(first, prev, targets, nll)
    })?;
    if !done {
        return Ok(None);
    }
    Ok(Some(acc.all_reduced(ranks)?))
}

/// Number of targets of `tokens`, after checking there is one and that every id fits the model
/// and the byte tables.
pub(super) fn check_tokens(model: &crate::model::ModelConfig, tokens: &[u32], tables: &ByteTables) -> anyhow::Result<usize> {
    anyhow::ensure!(tokens.len() >= 2, "{} validation tokens: at least 2 are needed to score one target", tokens.len());
    tables.check_stream(tokens.len())?;
    let limit = model.vocab_size.min(tables.len());
    if let Some(pos) = tokens.iter().position(|&t| t as usize >= limit) {
        anyhow::bail!(
            "token {} at position {pos} is not below the vocabulary ({} ids in the model, {} in the byte tables)",
            tokens[pos],
            model.vocab_size,
            tables.len()
        );
    }
    Ok(tokens.len() - 1)
}

/// Scores this rank's share of `wins` ([`crate::dist::share`]) in batches of
/// `cfg.batch_windows` padded `(rows, seq_len)` rows; for every window calls
/// `sink(first target index, prev, targets, nll)` with its scored positions. Before each
/// round of batches the ranks agree whether to go on (`keep_going` on any rank false:
/// `Ok(false)` on all); every rank runs as many rounds as the longest share takes.
#[allow(clippy::too_many_arguments)]
pub(super) fn score_windows(
    model: &mut dyn EvalModel,
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
        let nll = model.token_losses(&x, &y, t)?;
        for (r, w) in batch.iter().enumerate() {
            let pos = r * t + w.score_from..r * t + w.len;
            sink(w.start + w.score_from, &x[pos.clone()], &y[pos.clone()], &nll[pos]);
        }
    }
    Ok(true)
}
