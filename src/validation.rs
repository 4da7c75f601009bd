//! Validation as the challenge scores it (spec 1.3, 2.3, 2.4): the validation shards
//! concatenated, cut into consecutive non-overlapping sequences of `seq_len` targets, each
//! scored once; `val_loss` is the mean cross-entropy per token and `val_bpb` the bits per byte
//! with the sentencepiece byte rules of [`crate::bpb`].
//!
//! Also the bar to beat: the unigram bits per byte of the same scored targets, with token
//! frequencies counted on the training shards.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use candle_core::{DType, Tensor};

use crate::bpb::{BpbAccumulator, ByteTables, unigram_bpb, validation_tokens};
use crate::config::Config;
use crate::model::Gpt;
use crate::shard::{AccessMode, ShardFile, glob_sorted};

/// Training tokens read (at most) to count unigram frequencies.
const UNIGRAM_MAX_TOKENS: u64 = 64 << 20;

/// The validation stream of this rank, ready to score.
pub struct Validator {
    /// `usable + 1` tokens of the whole split (after the cap), as u32.
    tokens: Vec<u32>,
    seq_len: usize,
    /// Sequences per forward pass.
    batch_rows: usize,
    /// This rank's sequences, `[first, end)`.
    first: usize,
    end: usize,
    tables: Arc<ByteTables>,
    /// Scorable targets of the whole split before `val_max_tokens`.
    split_targets: usize,
    /// The glob the shards came from.
    pattern: String,
}

impl Validator {
    /// Reads `[data] val` and `[data] tokenizer` and checks them against `[model]`; errors name
    /// the key or the file.
    pub fn load(config: &Config, micro_steps: usize) -> anyhow::Result<Self> {
        let pattern = config.data.val.clone().context("`data.val` is not set: the step executor validates on the validation shards")?;
        let tok_path =
            config.data.tokenizer.as_deref().context("`data.tokenizer` is not set: val_bpb counts bytes with the sentencepiece model")?;
        let tables = Arc::new(load_tables(tok_path, config.model.vocab_size)?);
        let paths = glob_sorted(&pattern).context("`data.val`")?;
        anyhow::ensure!(!paths.is_empty(), "`data.val` = {pattern:?} matches no file");
        let shards = ShardFile::open_all(&paths, AccessMode::Pread)?;
        let mut all: Vec<u16> = Vec::with_capacity(shards.iter().map(|s| s.tokens as usize).sum());
        for s in &shards {
            let start = all.len();
            all.resize(start + s.tokens as usize, 0);
            s.read(0, &mut all[start..])?;
        }
        let t = &config.train;
        let usable = validation_tokens(&all, t.seq_len);
        anyhow::ensure!(
            usable.len() > t.seq_len,
            "the validation shards {pattern:?} hold {} tokens, fewer than one sequence of `train.seq_len` = {} plus 1",
            all.len(),
            t.seq_len
        );
        let split_targets = usable.len() - 1;
        let mut seqs = split_targets / t.seq_len;
        if t.val_max_tokens > 0 {
            seqs = seqs.min((t.val_max_tokens / t.seq_len).max(1));
        }
        let vocab = config.model.vocab_size;
        let tokens: Vec<u32> = usable[..seqs * t.seq_len + 1].iter().map(|&x| u32::from(x)).collect();
        if let Some(pos) = tokens.iter().position(|&x| x as usize >= vocab) {
            anyhow::bail!(
                "validation token {} at position {pos} is not below `model.vocab_size` = {vocab} (shards {pattern:?} made with another tokenizer?)",
                tokens[pos]
            );
        }
        let (world, rank) = (config.run.world_size, config.run.rank);
        let batch_rows = (t.val_batch_tokens / (world * micro_steps).max(1) / t.seq_len).max(1);
        Ok(Self {
            tokens,
            seq_len: t.seq_len,
            batch_rows,
            first: seqs * rank / world,
            end: seqs * (rank + 1) / world,
            tables,
            split_targets,
            pattern,
        })
    }

    /// The scored stream: `targets() + 1` tokens (inputs, then the last target).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Targets scored by a full pass over all ranks.
    pub fn targets(&self) -> usize {
        self.tokens.len() - 1
    }

    /// Targets of the whole split (before `train.val_max_tokens`).
    pub fn split_targets(&self) -> usize {
        self.split_targets
    }

    /// The shard glob.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The byte tables.
    pub fn tables(&self) -> &Arc<ByteTables> {
        &self.tables
    }

    /// Scores this rank's sequences with `model`; `keep_going` is asked between batches: false
    /// cuts the pass short and gives `None` (a partial score is no score).
    pub fn run(&self, model: &Gpt, keep_going: impl Fn() -> bool) -> anyhow::Result<Option<BpbAccumulator>> {
        let mut acc = BpbAccumulator::new(self.tables.clone());
        let t = self.seq_len;
        let mut s = self.first;
        while s < self.end {
            if !keep_going() {
                return Ok(None);
            }
            let rows = self.batch_rows.min(self.end - s);
            let x = &self.tokens[s * t..(s + rows) * t];
            let y = &self.tokens[s * t + 1..(s + rows) * t + 1];
            let xt = Tensor::from_slice(x, (rows, t), model.device())?;
            let yt = Tensor::from_slice(y, (rows, t), model.device())?;
            let nll = model.eval_token_losses(&xt, &yt)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            acc.add(x, y, &nll);
            s += rows;
        }
        Ok(Some(acc))
    }

    /// Unigram bits per byte of the scored targets (all ranks' share), with add-one smoothed
    /// frequencies of the first (at most) 64 Mi tokens of the training shards `train_glob`.
    pub fn unigram_bpb(&self, train_glob: &str, vocab: usize) -> anyhow::Result<f64> {
        let counts = unigram_counts(train_glob, vocab)?;
        let n = self.tokens.len();
        Ok(unigram_bpb(&counts, &self.tokens[..n - 1], &self.tokens[1..], &self.tables))
    }
}

/// Byte tables of the tokenizer at `path`, checked against `model.vocab_size`.
pub fn load_tables(path: &Path, vocab: usize) -> anyhow::Result<ByteTables> {
    let pieces = crate::tokenizer::vocab_size(path).with_context(|| format!("`data.tokenizer` = {}", path.display()))?;
    anyhow::ensure!(
        pieces == vocab,
        "the tokenizer {} has {pieces} pieces but `model.vocab_size` is {vocab}; they must match",
        path.display()
    );
    ByteTables::from_model_file(path, vocab).with_context(|| format!("`data.tokenizer` = {}", path.display()))
}

/// Token counts over the first (at most) 64 Mi tokens of the shards matching `glob`.
fn unigram_counts(glob: &str, vocab: usize) -> anyhow::Result<Vec<u64>> {
    let paths = glob_sorted(glob).context("`data.train`")?;
    anyhow::ensure!(!paths.is_empty(), "`data.train` = {glob:?} matches no file");
    let mut counts = vec![0u64; vocab];
    let mut left = UNIGRAM_MAX_TOKENS;
    let mut buf = vec![0u16; 1 << 20];
    for p in paths {
        if left == 0 {
            break;
        }
        let shard = ShardFile::open(&p, 0, AccessMode::Pread)?;
        let mut pos = 0u64;
        while pos < shard.tokens && left > 0 {
            let n = (shard.tokens - pos).min(buf.len() as u64).min(left) as usize;
            shard.read(pos, &mut buf[..n])?;
            for &t in &buf[..n] {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c += 1;
                }
            }
            pos += n as u64;
            left -= n as u64;
        }
    }
    Ok(counts)
}
