//! The training windows: micro-batches `x, y` of shape `(rows, seq_len)` cut out of the
//! shards in a deterministic, resumable order (the `window_sampler` stage drives them).
//!
//! - [`SequentialSampler`]: the challenge baseline's `TokenStream` + `DistributedTokenLoader`:
//!   one contiguous stream over all shards in sorted order, wrapping around; each micro-step
//!   takes `world_size * (local + 1)` tokens and rank `r` uses slice `r`; `x` is its first
//!   `local` tokens, `y` the same shifted by one. Same windows as the reference for the same
//!   shards.
//! - [`ShuffledSampler`]: the records' `ShuffledSequenceLoader`: this rank owns shards
//!   `index % world_size == rank`; each shard epoch has a random phase below `seq_len` and a
//!   random permutation of its sequence starts; each row picks a shard with probability
//!   proportional to the sequences it has left (one uniform draw against the cumulative
//!   counts); when all are used, every shard starts a new epoch. Seeded by `(run.seed, rank)`.
//!   The permutation is a keyed Feistel network over `0..m` (cycle-walking), so a shard's
//!   state is `(epoch, consumed)` and restoring is O(1) per shard. Rows are chosen serially and
//!   copied in parallel (`workers` rayon threads), so the order never depends on `workers`.
//! - [`crate::data::packed::PackedSampler`]: the 04-27 record's document-packing loader (its
//!   own file).

use std::sync::Arc;

use anyhow::Context;

use crate::data::batch::{BatchShape, FINGERPRINT_SEED, LoaderState, ShardCursor, mix, mix_window};
use crate::data::shard::{ShardError, ShardFile};

// ---------------------------------------------------------------------------------------------
// Shared
// ---------------------------------------------------------------------------------------------

/// One window of a micro-batch: tokens `[start, start + len)` of shard `shard` (position in the
/// sampler's shard list).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    shard: usize,
    start: u64,
    len: u64,
}

/// Widens `src` (u16) into `dst` (u32), checking ids against `vocab`; returns the offset of the
/// first bad id.
#[inline]
pub(crate) fn widen(src: &[u16], dst: &mut [u32], vocab: Option<usize>) -> Option<usize> {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s as u32;
    }
    let v = vocab?;
    if src.iter().fold(0u16, |m, &t| m.max(t)) as usize >= v { src.iter().position(|&t| t as usize >= v) } else { None }
}

pub(crate) fn bad_token(file: &ShardFile, start: u64, off: usize, src_id: u16, vocab: usize) -> anyhow::Error {
    ShardError::TokenOutOfRange { path: file.path.clone(), id: src_id, position: start + off as u64, vocab }.into()
}

/// A sampler's common interface (the stage and the tests drive both through it).
pub trait Sampler: Send {
    /// Fills `buf` (x then y) with the next micro-batch; returns its window fingerprint.
    fn fill(&mut self, buf: &mut [u32]) -> anyhow::Result<u64>;
    /// The state after the last micro-batch.
    fn state(&self) -> LoaderState;
    /// The micro-batch geometry.
    fn shape(&self) -> BatchShape;
}

// ---------------------------------------------------------------------------------------------
// Sequential
// ---------------------------------------------------------------------------------------------

/// The baseline's sequential stream.
pub struct SequentialSampler {
    shards: Vec<Arc<ShardFile>>,
    shape: BatchShape,
    vocab: Option<usize>,
    shard: usize,
    offset: u64,
    micro_batches: u64,
    rolling: u64,
    scratch: Vec<u16>,
    pieces: Vec<Piece>,
}

impl SequentialSampler {
    /// A stream over `shards` (sorted order), starting at the beginning or at `state`.
    pub fn new(shards: Vec<Arc<ShardFile>>, shape: BatchShape, vocab: Option<usize>, state: Option<&LoaderState>) -> anyhow::Result<Self> {
        anyhow::ensure!(!shards.is_empty(), "the sequential sampler got no shards");
        let mut s = Self {
            shards,
            shape,
            vocab,
            shard: 0,
            offset: 0,
            micro_batches: 0,
            rolling: FINGERPRINT_SEED,
            scratch: Vec::new(),
            pieces: Vec::new(),
        };
        match state {
            None => {}
            Some(LoaderState::Sequential { shard, offset, micro_batches, rolling }) => {
                anyhow::ensure!(
                    *shard < s.shards.len() && *offset < s.shards[*shard].tokens,
                    "loader state points past the shards (shard {shard}, offset {offset}); were the shards changed?"
                );
                (s.shard, s.offset, s.micro_batches, s.rolling) = (*shard, *offset, *micro_batches, *rolling);
            }
            Some(other) => anyhow::bail!("cannot resume the sequential sampler from a {} state", kind_of(other)),
        }
        Ok(s)
    }

    /// Moves the cursor `n` tokens on, recording the pieces passed over when `keep`.
    fn walk(&mut self, mut n: u64, keep: bool) {
        while n > 0 {
            let here = self.shards[self.shard].tokens - self.offset;
            let take = here.min(n);
            if keep {
                self.pieces.push(Piece { shard: self.shard, start: self.offset, len: take });
            }
            self.offset += take;
            n -= take;
            if self.offset == self.shards[self.shard].tokens {
                self.shard = (self.shard + 1) % self.shards.len();
                self.offset = 0;
            }
        }
    }
}

impl Sampler for SequentialSampler {
    fn fill(&mut self, buf: &mut [u32]) -> anyhow::Result<u64> {
        let local = self.shape.tokens();
        let span = (local + 1) as u64;
        let (rank, world) = (self.shape.rank as u64, self.shape.world_size as u64);
        self.pieces.clear();
        self.walk(rank * span, false);
        self.walk(span, true);
        self.walk((world - rank - 1) * span, false);
        self.scratch.resize(span as usize, 0);
        let mut at = 0usize;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut pieces = std::mem::take(&mut self.pieces);
        let mut h = FINGERPRINT_SEED;
        for p in &pieces {
            let file = &self.shards[p.shard];
            file.read(p.start, &mut scratch[at..at + p.len as usize])?;
            if let Some(v) = self.vocab
                && let Some(off) = scratch[at..at + p.len as usize].iter().position(|&t| t as usize >= v)
            {
                return Err(bad_token(file, p.start, off, scratch[at + off], v));
            }
            h = mix_window(h, file.index, p.start, p.len);
            at += p.len as usize;
        }
        let (x, y) = buf[..2 * local].split_at_mut(local);
        widen(&scratch[..local], x, None);
        widen(&scratch[1..=local], y, None);
        self.scratch = scratch;
        pieces.clear();
        self.pieces = pieces;
        self.micro_batches += 1;
        self.rolling = mix(self.rolling, h);
        Ok(h)
    }

    fn state(&self) -> LoaderState {
        LoaderState::Sequential { shard: self.shard, offset: self.offset, micro_batches: self.micro_batches, rolling: self.rolling }
    }

    fn shape(&self) -> BatchShape {
        self.shape
    }
}

/// The sampler a state is of (`window_sampler`'s implementation name).
pub(crate) fn kind_of(s: &LoaderState) -> &'static str {
    match s {
        LoaderState::Sequential { .. } => "sequential",
        LoaderState::Shuffled { .. } => "shuffled",
        LoaderState::Packed { .. } => "packed_docs",
    }
}

// ---------------------------------------------------------------------------------------------
// Shuffled
// ---------------------------------------------------------------------------------------------

/// A keyed pseudo-random permutation of `0..n` (4-round Feistel network, cycle-walking).
#[derive(Clone, Copy, Debug)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    key: u64,
}

impl Permutation {
    /// The permutation of `0..n` chosen by `key`.
    pub fn new(n: u64, key: u64) -> Self {
        let bits = 64 - n.max(2).saturating_sub(1).leading_zeros();
        Self { n, half_bits: bits.div_ceil(2).max(1), key }
    }

    /// Where `i` goes (`i < n`).
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mask = (1u64 << self.half_bits) - 1;
        let mut x = i;
        loop {
            let (mut l, mut r) = (x >> self.half_bits, x & mask);
            for round in 0..4u64 {
                let f = mix(self.key ^ round, r) & mask;
                (l, r) = (r, l ^ f);
            }
            x = (l << self.half_bits) | r;
            if x < self.n {
                return x;
            }
        }
    }
}

struct ShardEpoch {
    file: Arc<ShardFile>,
    epoch: u32,
    consumed: u64,
    phase: u64,
    count: u64,
    perm: Permutation,
}

impl ShardEpoch {
    fn new(file: Arc<ShardFile>, epoch: u32, consumed: u64, seed: u64, seq_len: u64) -> Self {
        let mut e = Self { file, epoch, consumed, phase: 0, count: 0, perm: Permutation::new(1, 0) };
        e.start_epoch(epoch, seed, seq_len);
        e.consumed = consumed.min(e.count);
        e
    }

    /// Draws this epoch's phase and permutation from `(seed, shard, epoch)` alone.
    fn start_epoch(&mut self, epoch: u32, seed: u64, t: u64) {
        let n = self.file.tokens;
        let key = mix(mix(mix(seed, self.file.index as u64), epoch as u64), 0x5348_5546);
        let max_phase = (t - 1).min(n.saturating_sub(t + 1));
        self.phase = if max_phase > 0 { mix(key, 1) % (max_phase + 1) } else { 0 };
        self.count = n.saturating_sub(1 + self.phase) / t;
        self.perm = Permutation::new(self.count.max(1), mix(key, 2));
        self.epoch = epoch;
        self.consumed = 0;
    }

    fn remaining(&self) -> u64 {
        self.count - self.consumed
    }
}

/// The records' shuffled sequence sampler.
pub struct ShuffledSampler {
    shards: Vec<ShardEpoch>,
    shape: BatchShape,
    vocab: Option<usize>,
    seed: u64,
    rng: fastrand::Rng,
    micro_batches: u64,
    rolling: u64,
    pool: Option<rayon::ThreadPool>,
    rows: Vec<(usize, u64)>,
    scratch: Vec<u16>,
}

impl ShuffledSampler {
    /// A sampler over the shards this rank owns among `shards`, seeded by `(seed, rank)`,
    /// starting fresh or at `state`; `workers` > 1 copies rows on that many threads.
    pub fn new(
        shards: Vec<Arc<ShardFile>>,
        shape: BatchShape,
        vocab: Option<usize>,
        seed: u64,
        workers: usize,
        state: Option<&LoaderState>,
    ) -> anyhow::Result<Self> {
        let seed = mix(mix(seed, shape.rank as u64), 0x5355_4646);
        let t = shape.seq_len as u64;
        let owned: Vec<Arc<ShardFile>> = shards.into_iter().filter(|s| s.index % shape.world_size == shape.rank).collect();
        anyhow::ensure!(
            !owned.is_empty(),
            "rank {} of {} owns no shard (shards are dealt by index % world_size)",
            shape.rank,
            shape.world_size
        );
        let mut epochs: Vec<ShardEpoch> = owned.into_iter().map(|f| ShardEpoch::new(f, 0, 0, seed, t)).collect();
        anyhow::ensure!(epochs.iter().any(|e| e.count > 0), "every shard is shorter than one sequence of seq_len + 1 = {} tokens", t + 1);
        let mut rng = fastrand::Rng::with_seed(seed);
        let (mut micro_batches, mut rolling) = (0, FINGERPRINT_SEED);
        match state {
            None => {}
            Some(LoaderState::Shuffled { rng: r, shards, micro_batches: m, rolling: f }) => {
                anyhow::ensure!(
                    shards.len() == epochs.len(),
                    "loader state has {} shards but this rank owns {}; were the shards or world size changed?",
                    shards.len(),
                    epochs.len()
                );
                for (e, c) in epochs.iter_mut().zip(shards) {
                    anyhow::ensure!(
                        e.file.index == c.index,
                        "loader state names shard {} where this rank has shard {}; were the shards changed?",
                        c.index,
                        e.file.index
                    );
                    *e = ShardEpoch::new(e.file.clone(), c.epoch, c.consumed, seed, t);
                }
                rng = fastrand::Rng::with_seed(*r);
                (micro_batches, rolling) = (*m, *f);
            }
            Some(other) => anyhow::bail!("cannot resume the shuffled sampler from a {} state", kind_of(other)),
        }
        let pool = if workers > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(workers)
                    .thread_name(|i| format!("sampler-{i}"))
                    .build()
                    .context("cannot start the sampler's worker threads")?,
            )
        } else {
            None
        };
        let scratch = vec![0u16; shape.seq_len + 1];
        Ok(Self { shards: epochs, shape, vocab, seed, rng, micro_batches, rolling, pool, rows: Vec::with_capacity(shape.rows), scratch })
    }

    /// Picks the next row: a shard with probability proportional to what it has left, then the
    /// next start of that shard's permutation.
    fn next_row(&mut self) -> (usize, u64) {
        let t = self.shape.seq_len as u64;
        let mut total: u64 = self.shards.iter().map(ShardEpoch::remaining).sum();
        if total == 0 {
            for e in &mut self.shards {
                let next = e.epoch + 1;
                e.start_epoch(next, self.seed, t);
            }
            total = self.shards.iter().map(ShardEpoch::remaining).sum();
        }
        let mut u = self.rng.u64(0..total);
        let mut pick = 0;
        for (i, e) in self.shards.iter().enumerate() {
            let r = e.remaining();
            if u < r {
                pick = i;
                break;
            }
            u -= r;
        }
        let e = &mut self.shards[pick];
        let k = e.phase + e.perm.apply(e.consumed) * t;
        e.consumed += 1;
        (pick, k)
    }
}

impl Sampler for ShuffledSampler {
    fn fill(&mut self, buf: &mut [u32]) -> anyhow::Result<u64> {
        let (rows, t) = (self.shape.rows, self.shape.seq_len);
        let local = rows * t;
        let mut plan = std::mem::take(&mut self.rows);
        plan.clear();
        for _ in 0..rows {
            let row = self.next_row();
            plan.push(row);
        }
        let mut h = FINGERPRINT_SEED;
        for &(s, k) in &plan {
            h = mix_window(h, self.shards[s].file.index, k, t as u64 + 1);
        }
        let (x, y) = buf[..2 * local].split_at_mut(local);
        let shards = &self.shards;
        let vocab = self.vocab;
        let copy_row = |scratch: &mut Vec<u16>, (s, k): (usize, u64), xr: &mut [u32], yr: &mut [u32]| -> anyhow::Result<()> {
            let file = &shards[s].file;
            file.with_tokens(k, t + 1, scratch, |w| {
                if let Some(off) = widen(&w[..t], xr, vocab) {
                    return Err(bad_token(file, k, off, w[off], vocab.unwrap_or(0)));
                }
                if let Some(off) = widen(&w[1..], yr, vocab) {
                    return Err(bad_token(file, k, off + 1, w[off + 1], vocab.unwrap_or(0)));
                }
                Ok(())
            })?
        };
        let result = match &self.pool {
            None => {
                let scratch = &mut self.scratch;
                x.chunks_mut(t).zip(y.chunks_mut(t)).zip(plan.iter()).try_for_each(|((xr, yr), &row)| copy_row(scratch, row, xr, yr))
            }
            Some(pool) => {
                use rayon::prelude::*;
                pool.install(|| {
                    x.par_chunks_mut(t)
                        .zip(y.par_chunks_mut(t))
                        .zip(plan.par_iter())
                        .try_for_each_init(|| vec![0u16; t + 1], |scratch, ((xr, yr), &row)| copy_row(scratch, row, xr, yr))
                })
            }
        };
        self.rows = plan;
        result?;
        self.micro_batches += 1;
        self.rolling = mix(self.rolling, h);
        Ok(h)
    }

    fn state(&self) -> LoaderState {
        LoaderState::Shuffled {
            rng: self.rng.get_seed(),
            shards: self.shards.iter().map(|e| ShardCursor { index: e.file.index, epoch: e.epoch, consumed: e.consumed }).collect(),
            micro_batches: self.micro_batches,
            rolling: self.rolling,
        }
    }

    fn shape(&self) -> BatchShape {
        self.shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let p = Permutation::new(n, 0xfeed ^ n);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i) as usize;
                assert!(!seen[j], "n={n}: {j} hit twice");
                seen[j] = true;
            }
        }
    }

    #[test]
    fn permutation_depends_on_key() {
        let a: Vec<u64> = (0..100).map(|i| Permutation::new(100, 1).apply(i)).collect();
        let b: Vec<u64> = (0..100).map(|i| Permutation::new(100, 2).apply(i)).collect();
        assert_ne!(a, b);
        assert_ne!(a, (0..100).collect::<Vec<_>>(), "identity is not a shuffle");
    }
}
