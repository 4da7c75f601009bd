//! The global SGD of a phase (record spec §5.5 step 3): the base model itself trained on the
//! documents scored so far.
//!
//! ```text
//! stream = concat(span of each document)            (each span ends on the next BOS)
//! n      = ceil((len(stream) - 1) / chunk_tokens)
//! for c in 0 .. n - 1:                              (the last chunk is never trained on)
//!     lr_c = lr * 0.5 * (1 + cos(pi * c / max(n - 1, 1)))
//!     floor(chunk_len / seq_len) sequences of chunk c, in batches of <= batch_seqs:
//!         mean CE with attention kept inside documents (mask at BOS), backward,
//!         clip the global norm, SGD with momentum (fresh for the phase, no weight decay)
//! ```
//!
//! Every parameter trains (the dequantized base, as the record does). Several ranks split each
//! step's sequences and sum their gradients ([`train_sequences`]), so every rank takes the step
//! one rank would take.

use super::config::PhasedConfig;
use super::docs::Document;
use crate::eval::executor::EvalModel;
use crate::eval::ttt::{SeqTraining, train_sequences};

/// What one phase's global SGD did.
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalStats {
    /// Tokens of its training stream.
    pub tokens: usize,
    /// Chunks of the stream (`n`).
    pub chunks: usize,
    /// Chunks trained on (`n − 1`, or 0 for a one-chunk stream).
    pub trained_chunks: usize,
    /// SGD steps taken.
    pub steps: usize,
    /// Seconds it took.
    pub seconds: f64,
}

/// Trains `model` in place on the spans of `docs` of `tokens`, concatenated in the order given.
/// `on_chunk(c, n, targets)` is called after each trained chunk with its targets in the phase's
/// stream. `None` when `keep_going` said stop.
pub fn global_sgd(
    model: &mut dyn EvalModel,
    tokens: &[u32],
    docs: &[Document],
    (cfg, bos): (&PhasedConfig, u32),
    ranks: &dyn crate::dist::Collective,
    mut on_chunk: impl FnMut(usize, usize, std::ops::Range<usize>),
    keep_going: &impl Fn() -> bool,
) -> anyhow::Result<Option<GlobalStats>> {
    let t0 = std::time::Instant::now();
    let stream: Vec<u32> = docs.iter().flat_map(|d| tokens[d.start..d.start + d.len].iter().copied()).collect();
    let n = cfg.global_chunks(stream.len());
    model.reset_sgd(cfg.global_momentum)?;
    let how = SeqTraining {
        seq_len: cfg.global_seq_len,
        epochs: cfg.global_epochs,
        batch_seqs: cfg.global_batch_seqs,
        grad_clip: cfg.global_grad_clip,
        doc_bos: Some(bos),
    };
    let targets = stream.len().saturating_sub(1);
    let mut stats = GlobalStats { tokens: stream.len(), chunks: n, ..GlobalStats::default() };
    for c in 0..n.saturating_sub(1) {
        let start = c * cfg.global_chunk_tokens;
        let chunk_len = ((c + 1) * cfg.global_chunk_tokens).min(targets) - start;
        let seqs = chunk_len / cfg.global_seq_len;
        let lr = cfg.global_chunk_lr(c, n);
        let Some(steps) = train_sequences(model, &stream, start, seqs, &how, lr, ranks, keep_going)? else {
            return Ok(None);
        };
        stats.steps += steps;
        stats.trained_chunks += 1;
        on_chunk(c, n, start..start + seqs * cfg.global_seq_len);
    }
    stats.seconds = t0.elapsed().as_secs_f64();
    Ok(Some(stats))
}
