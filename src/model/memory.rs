//! What the GPT of a `[model]` takes in memory, from its shapes alone: parameters, optimizer
//! state, and the activations a forward (and backward) pass keeps. The stages that hold a model
//! or its copies build their [`crate::runtime::memory::Need`]s from these figures.
//!
//! Activations, per token of a batch, in elements (`d` = model_dim, `kv` = kv_dim, `h` = the
//! MLP's hidden width, `H` heads, `T` tokens per sequence, `V` the vocabulary, `L` blocks):
//!
//! ```text
//! per block:  12·d + 3·kv + 2·h      residual mix, norms, q/k/v and their normed, rotated
//!                                      copies, attention output, projections, scaled adds, the
//!                                      MLP's pre- and post-activation
//!           + H·T                     attention probabilities, where they are stored (not
//!                                      with flash attention)
//! once:       4·d + 3·V               embedding, final norm, logits, soft-capped logits, and
//!                                      the loss's gradient of them
//! ```
//!
//! Training keeps all of it until the backward pass has used it; the backward pass frees it as
//! it makes gradients, so the peak is about the forward total. Measured on the CPU (demo model,
//! 4 x 128, T 256, peak RSS at 4,096 / 16,384 / 65,536 tokens per step: 361 / 1,170 / 3,758 MiB),
//! a token costs 55 KB; this count gives 66 KB, a fifth over. A forward pass alone
//! (validation) keeps about one block's worth plus the logits.

use crate::model::ModelConfig;
use crate::model::ParamGroup;

/// Element counts of a model's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every parameter.
    pub total: u64,
    /// Those Muon updates (the block matrices): one momentum buffer each.
    pub muon: u64,
    /// Those Adam updates: two moments each.
    pub adam: u64,
    /// The largest tensor.
    pub largest: u64,
}

impl ParamCounts {
    /// The counts of `m`'s parameters ([`ModelConfig::param_shapes`]).
    pub fn of(m: &ModelConfig) -> Self {
        let mut c = ParamCounts { total: 0, muon: 0, adam: 0, largest: 0 };
        for (name, shape) in m.param_shapes() {
            // Saturating: an absurd config must give an absurd estimate, not a wrapped small one.
            let n: u64 = shape.iter().fold(1u64, |a, &x| a.saturating_mul(x as u64));
            c.total = c.total.saturating_add(n);
            c.largest = c.largest.max(n);
            match crate::model::gpt_group_of(&name, shape.len()) {
                ParamGroup::Matrix => c.muon = c.muon.saturating_add(n),
                _ => c.adam = c.adam.saturating_add(n),
            }
        }
        c
    }

    /// Elements of optimizer state: Muon's momentum, Adam's two moments.
    pub fn optimizer(&self) -> u64 {
        self.muon.saturating_add(self.adam.saturating_mul(2))
    }
}

/// Activation elements per token of a batch of sequences of `seq_len` (module docs); `probs`:
/// the attention probabilities are stored. In f64: an absurd config gives a huge count, never
/// a wrapped one (the casts to u64 saturate).
pub fn activations_per_token(m: &ModelConfig, seq_len: usize, probs: bool) -> f64 {
    let (d, kv, h) = (m.model_dim as f64, m.kv_dim() as f64, m.mlp_mult as f64 * m.model_dim as f64);
    let per_block = 12.0 * d + 3.0 * kv + 2.0 * h + if probs { m.num_heads as f64 * seq_len as f64 } else { 0.0 };
    // Every block the pass runs keeps its own activations: the looped sequence under depth
    // recurrence (the record's 17 for 11 blocks).
    m.layer_sequence(true).len() as f64 * per_block + 4.0 * d + 3.0 * m.vocab_size as f64
}

/// Bytes of activations a training pass over `tokens` tokens keeps at its peak (elements of
/// `elem` bytes).
pub fn training_bytes(m: &ModelConfig, tokens: usize, seq_len: usize, probs: bool, elem: u64) -> u64 {
    (tokens as f64 * activations_per_token(m, seq_len, probs) * elem as f64) as u64
}

/// Bytes a forward pass alone over `tokens` tokens keeps at its peak: a block's activations and
/// the logits.
pub fn forward_bytes(m: &ModelConfig, tokens: usize, seq_len: usize, probs: bool, elem: u64) -> u64 {
    let one_block = ModelConfig { num_layers: 1, num_loops: 0, ..m.clone() };
    (tokens as f64 * activations_per_token(&one_block, seq_len, probs) * elem as f64) as u64
}

/// The keys that size a model's parameters.
pub const MODEL_KEYS: [&str; 4] = ["model.model_dim", "model.num_layers", "model.vocab_size", "model.mlp_mult"];

/// Bytes of one training snapshot: a copy of the weights, the optimizer state of its step
/// (replaced, never mutated, by each step, so a snapshot in flight holds its own) and the
/// average an averager attached (f32 each).
pub fn snapshot_bytes(m: &ModelConfig) -> u64 {
    let c = ParamCounts::of(m);
    c.total.saturating_mul(2).saturating_add(c.optimizer()).saturating_mul(4)
}

/// What a stage after training holds in snapshots: its input queue full, and the one it works
/// on (`stage` names its `queue` key).
pub fn snapshots_need(m: &ModelConfig, stage: &str, queue: usize) -> crate::runtime::memory::Need {
    let queue_key = format!("stages.{stage}.queue");
    let mut keys: Vec<&str> = MODEL_KEYS.to_vec();
    keys.push(&queue_key);
    crate::runtime::memory::Need::device(
        format!("{} training snapshots (queued or in hand)", queue + 1),
        (queue as u64 + 1).saturating_mul(snapshot_bytes(m)),
        &keys,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The counts come from the same shapes the model is made of: checked against real models
    /// of several shapes (tied and untied, grouped heads).
    #[test]
    fn param_counts_match_the_model() {
        for (layers, dim, heads, kv, tie) in [(2, 32, 4, 2, true), (3, 48, 6, 3, false), (9, 64, 8, 4, true)] {
            let m = ModelConfig {
                vocab_size: 96,
                num_layers: layers,
                model_dim: dim,
                num_heads: heads,
                num_kv_heads: kv,
                tie_embeddings: tie,
                ..ModelConfig::default()
            };
            let gpt = crate::model::Gpt::new(&m, 1, DType::F32, &Device::Cpu).unwrap();
            let c = ParamCounts::of(&m);
            let real: u64 = gpt.params().iter().map(|(_, v, _)| v.as_tensor().elem_count() as u64).sum();
            let muon: u64 =
                gpt.params().iter().filter(|(_, _, g)| *g == ParamGroup::Matrix).map(|(_, v, _)| v.as_tensor().elem_count() as u64).sum();
            assert_eq!((c.total, c.muon), (real, muon), "{m:?}");
            assert_eq!(c.adam, real - muon);
        }
        // The baseline: 17,059,912 parameters (docs/training.md).
        assert_eq!(ParamCounts::of(&ModelConfig::default()).total, 17_059_912);
        // Absurd widths saturate instead of wrapping to a small count.
        let huge = ModelConfig { model_dim: 1 << 62, num_heads: 8, num_kv_heads: 4, ..ModelConfig::default() };
        assert_eq!(ParamCounts::of(&huge).total, u64::MAX);
        assert_eq!(snapshot_bytes(&huge), u64::MAX);
        assert_eq!(training_bytes(&huge, 1024, 1024, true, 4), u64::MAX);
    }

    #[test]
    fn activations_grow_with_the_shapes_that_size_them() {
        let m = ModelConfig::default();
        let base = training_bytes(&m, 1024, 1024, false, 4);
        assert!(training_bytes(&m, 2048, 1024, false, 4) == 2 * base);
        assert!(training_bytes(&m, 1024, 1024, true, 4) > base);
        let wide = ModelConfig { model_dim: 1024, ..m.clone() };
        assert!(training_bytes(&wide, 1024, 1024, false, 4) > base);
        assert!(forward_bytes(&m, 1024, 1024, false, 4) < base);
    }
}
