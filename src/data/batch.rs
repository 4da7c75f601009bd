//! Messages of the data path and what they carry: shapes, data-order fingerprints, loader
//! state.
//!
//! Shapes follow the challenge scripts: a step consumes `batch_tokens` tokens over all ranks,
//! split into `world_size` ranks x `grad_accum_steps` micro-steps; each micro-batch holds
//! `rows = batch_tokens / (world_size * grad_accum_steps) / seq_len` sequences of `seq_len`
//! tokens, as inputs `x` and next-token targets `y`.
//!
//! Fingerprints: every micro-batch hashes the windows it was cut from, `(shard index, first
//! token, length)` in order, with [`mix`]; the rolling fingerprint chains those hashes over the
//! whole run. Two runs that report the same rolling fingerprint at a step saw the same tokens
//! in the same order up to it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::data::shard::ShardFile;
use crate::runtime::message::Message;
use crate::runtime::pool::Pooled;

/// Starting value of every fingerprint.
pub const FINGERPRINT_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// Folds `x` into the hash `h` (splitmix64 finaliser over a rotated xor; stable across versions,
/// since fingerprints are compared between runs).
#[inline]
pub fn mix(h: u64, x: u64) -> u64 {
    let mut z = h.rotate_left(5) ^ x;
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of one window: folds its shard index, first token and length into `h`.
#[inline]
pub fn mix_window(h: u64, shard: usize, start: u64, len: u64) -> u64 {
    mix(mix(mix(h, shard as u64), start), len)
}

/// Micro-batch geometry for this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchShape {
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per micro-batch on this rank.
    pub rows: usize,
    /// Micro-batches per optimizer step on this rank.
    pub micro_steps: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// This rank.
    pub rank: usize,
}

impl BatchShape {
    /// The shape of `batch_tokens` per step over `world` ranks in `grad_accum_steps`
    /// micro-batches (0: 8 / world, as the challenge scripts do) of `seq_len`-token sequences,
    /// for `rank`. Errors name the config keys these come from (`train.*`, `run.*`) that do not
    /// divide.
    pub fn new(seq_len: usize, batch_tokens: usize, grad_accum_steps: usize, world: usize, rank: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(world >= 1, "`run.world_size` must be at least 1");
        anyhow::ensure!(rank < world, "`run.rank` ({rank}) must be below `run.world_size` ({world})");
        let micro = if grad_accum_steps == 0 {
            anyhow::ensure!(
                8 % world == 0,
                "`train.grad_accum_steps` = 0 means 8 / world_size, but `run.world_size` = {world} does not divide 8; set it explicitly"
            );
            8 / world
        } else {
            grad_accum_steps
        };
        anyhow::ensure!(seq_len >= 1, "`train.seq_len` must be at least 1");
        let per_micro = world.checked_mul(micro).filter(|&p| p.checked_mul(seq_len).is_some()).ok_or_else(|| {
            anyhow::anyhow!("`run.world_size` ({world}) x `train.grad_accum_steps` ({micro}) x `train.seq_len` ({}) is too large", seq_len)
        })?;
        anyhow::ensure!(
            batch_tokens.is_multiple_of(per_micro)
                && (batch_tokens / per_micro).is_multiple_of(seq_len)
                && batch_tokens >= per_micro * seq_len,
            "`train.batch_tokens` ({}) must split into world_size ({world}) x grad_accum_steps ({micro}) micro-batches of whole `train.seq_len` ({}) sequences",
            batch_tokens,
            seq_len
        );
        Ok(Self { seq_len, rows: batch_tokens / per_micro / seq_len, micro_steps: micro, world_size: world, rank })
    }

    /// The same micro-batches as one row of all their tokens (the `packed_docs` sampler's).
    pub fn packed(self) -> Self {
        Self { seq_len: self.tokens(), rows: 1, ..self }
    }

    /// Tokens in one micro-batch of this rank (`rows * seq_len`).
    pub fn tokens(&self) -> usize {
        self.rows * self.seq_len
    }
}

/// A checked shard, sent by the shard reader. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Shard(pub Arc<ShardFile>);

impl Message for Shard {
    const NAME: &'static str = "Shard";
}

/// Where a sampler stands, small and serialisable: restoring it continues the same order
/// without replaying batches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "sampler", rename_all = "lowercase")]
pub enum LoaderState {
    /// The sequential stream's cursor.
    Sequential {
        /// Position in the sorted shard list.
        shard: usize,
        /// Next token of that shard.
        offset: u64,
        /// Micro-batches produced so far.
        micro_batches: u64,
        /// Rolling fingerprint so far.
        rolling: u64,
    },
    /// The shuffled sampler's random state and per-shard cursors.
    Shuffled {
        /// State of the generator that picks shards.
        rng: u64,
        /// Per owned shard: its index, epoch and how many of its sequences were used.
        shards: Vec<ShardCursor>,
        /// Micro-batches produced so far.
        micro_batches: u64,
        /// Rolling fingerprint so far.
        rolling: u64,
    },
    /// The document-packing loader's place (`packed_docs`): every rank's is the same.
    #[serde(rename = "packed_docs")]
    Packed {
        /// Position in the sorted shard list.
        shard: usize,
        /// The next micro-batch's first token in that shard (the first rank's).
        cursor: u64,
        /// Micro-batches produced so far.
        micro_batches: u64,
        /// Rolling fingerprint so far.
        rolling: u64,
    },
}

impl LoaderState {
    /// Micro-batches produced before this state.
    pub fn micro_batches(&self) -> u64 {
        match self {
            LoaderState::Sequential { micro_batches, .. }
            | LoaderState::Shuffled { micro_batches, .. }
            | LoaderState::Packed { micro_batches, .. } => *micro_batches,
        }
    }
}

/// One shard's place in the shuffled order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardCursor {
    /// Shard index in the sorted glob.
    pub index: usize,
    /// How many times the shard was reset (each epoch has its own phase and permutation).
    pub epoch: u32,
    /// Sequences of this epoch already used.
    pub consumed: u64,
}

/// Step, micro-step and provenance of a micro-batch.
#[derive(Clone, Debug)]
pub struct BatchMeta {
    /// Optimizer step (0-based, counted from the start of the order).
    pub step: u64,
    /// Micro-step within the step.
    pub micro: u32,
    /// The micro-batch geometry.
    pub shape: BatchShape,
    /// Hash of this micro-batch's windows.
    pub fingerprint: u64,
    /// Rolling fingerprint up to and including this micro-batch.
    pub rolling: u64,
    /// The sampler's state after this micro-batch (resume from here to get the next one).
    pub state: Arc<LoaderState>,
}

/// Host token buffer: `x` then `y`, each `rows x seq_len`, row-major.
pub type TokenBuf = Vec<u32>;

/// A micro-batch as the sampler built it (in the sampler's buffer pool).
#[derive(Clone)]
pub struct TokenBatch {
    /// Provenance.
    pub meta: BatchMeta,
    /// The tokens; the buffer returns to the sampler's pool when the last holder drops it.
    pub buf: Arc<Pooled<TokenBuf>>,
}

impl TokenBatch {
    /// Inputs, `rows x seq_len`.
    #[cfg(feature = "tools")]
    pub fn x(&self) -> &[u32] {
        &self.buf[..self.meta.shape.tokens()]
    }
    /// Targets, `rows x seq_len`.
    #[cfg(feature = "tools")]
    pub fn y(&self) -> &[u32] {
        &self.buf[self.meta.shape.tokens()..2 * self.meta.shape.tokens()]
    }
}

impl Message for TokenBatch {
    const NAME: &'static str = "TokenBatch";
}

/// A micro-batch copied into a staging buffer (page-locked with `pin/pinned`), ready to upload.
#[derive(Clone)]
pub struct PinnedBatch {
    /// Provenance.
    pub meta: BatchMeta,
    /// The staging buffer (x then y); returns to the pin stage's pool when dropped.
    pub buf: Arc<Pooled<crate::data::staging::Staging>>,
}

impl Message for PinnedBatch {
    const NAME: &'static str = "PinnedBatch";
}

/// A micro-batch as tensors on the executor's device.
#[derive(Clone)]
pub struct DeviceBatch {
    /// Provenance.
    pub meta: BatchMeta,
    /// Inputs, `(rows, seq_len)`, u32.
    pub x: candle_core::Tensor,
    /// Targets, `(rows, seq_len)`, u32.
    pub y: candle_core::Tensor,
    /// Host-to-device copy time (ns), for the executor's time breakdown: on the CPU this batch's
    /// copy; on a GPU the device time of the copies that completed since the uploader emitted
    /// the previous batch (a copy's time is known only once it has run; summed over a run the
    /// figures are the same).
    pub upload_ns: u64,
}

impl Message for DeviceBatch {
    const NAME: &'static str = "DeviceBatch";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_order_sensitive_and_stable() {
        let a = mix_window(mix_window(FINGERPRINT_SEED, 0, 10, 5), 1, 20, 5);
        let b = mix_window(mix_window(FINGERPRINT_SEED, 1, 20, 5), 0, 10, 5);
        assert_ne!(a, b);
        // Pinned values: fingerprints are compared across runs and versions, so the function
        // must never change.
        assert_eq!(mix(FINGERPRINT_SEED, 42), 0xa82b_ce54_5058_927f);
        assert_eq!(mix_window(FINGERPRINT_SEED, 3, 1000, 2049), 0x095e_0caf_44c9_8966);
    }

    #[test]
    fn shapes_follow_the_challenge() {
        let s = BatchShape::new(2048, 786_432, 0, 1, 0).unwrap();
        assert_eq!((s.rows, s.micro_steps), (48, 8));
        let s = BatchShape::new(2048, 786_432, 0, 8, 3).unwrap();
        assert_eq!((s.rows, s.micro_steps, s.rank), (48, 1, 3));
        let e = BatchShape::new(2048, 1000, 0, 8, 3).unwrap_err().to_string();
        assert!(e.contains("train.batch_tokens"), "{e}");
        let e = BatchShape::new(2048, 0, 1 << 62, 4, 0).unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
    }
}
