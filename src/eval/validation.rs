//! Validation as the challenge scores it (spec 1.3, 2.3, 2.4): the validation shards
//! concatenated, cut into consecutive non-overlapping sequences of `seq_len` targets, each
//! scored once; `val_loss` is the mean cross-entropy per token and `val_bpb` the bits per byte
//! with the sentencepiece byte rules of [`crate::eval::bpb`], or, for CaseOps data, with the
//! original bytes of the split's byte sidecar ([`crate::eval::sidecar`]).
//!
//! Also the bar to beat: the unigram bits per byte of the same scored targets, with token
//! frequencies counted on the training shards.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use anyhow::Context;
#[cfg(feature = "candle")]
use candle_core::{DType, Tensor};

use crate::data::shard::{AccessMode, ShardFile, glob_sorted};
use crate::eval::bpb::{BpbAccumulator, ByteTables, unigram_bpb, validation_tokens};
use crate::eval::sidecar::{ValFiles, read_stream_bytes, val_files};
#[cfg(feature = "candle")]
use crate::model::Gpt;

/// What the validation reads and how it cuts the stream: the application fills it from its
/// config (`[data] val`, `tokenizer`; `[train] seq_len`, `val_batch_tokens`, `val_max_tokens`;
/// `[model] vocab_size`). Errors name those keys. The ranks that share the split are not
/// settings: [`Validator::shared`] takes their collective.
#[derive(Clone, Debug, Default)]
pub struct ValSettings {
    /// Glob of the validation shards (`data.val`).
    pub val: Option<String>,
    /// The sentencepiece model the byte counts come from (`data.tokenizer`).
    pub tokenizer: Option<PathBuf>,
    /// Targets per sequence (`train.seq_len`).
    pub seq_len: usize,
    /// Tokens per validation batch over all ranks (`train.val_batch_tokens`).
    pub val_batch_tokens: usize,
    /// Score only the first this many targets; 0: all (`train.val_max_tokens`).
    pub val_max_tokens: usize,
    /// The model's vocabulary (`model.vocab_size`).
    pub vocab: usize,
    /// Each batch scored as one row of all its tokens (`train.val_packed`).
    pub packed: bool,
}

/// Training tokens read (at most) to count unigram frequencies.
const UNIGRAM_MAX_TOKENS: u64 = 64 << 20;

/// The validation stream of this rank, ready to score.
pub struct Validator {
    /// The split's scored tokens and byte tables, shared by every stage that validates.
    data: Arc<ValData>,
    seq_len: usize,
    /// Sequences per forward pass.
    batch_rows: usize,
    /// Each pass one row of its `batch_rows` sequences (`train.val_packed`).
    packed: bool,
    /// This rank's sequences, `[first, end)`.
    first: usize,
    end: usize,
    /// The glob the shards came from.
    pattern: String,
    /// The ranks sharing the split: their sums are added up after each pass.
    ranks: std::sync::Arc<dyn crate::dist::Collective>,
}

/// A validation pass's scoring: `(x, y, rows)` to the summed loss (nats) of the `rows`
/// sequences of targets `y` after inputs `x` ([`Validator::run_with`]).
pub type ScoreFn<'a> = dyn FnMut(&[u32], &[u32], usize) -> anyhow::Result<f64> + 'a;

/// What a validation load reads: the same for every stage of a run, so loaded once.
struct ValData {
    /// `usable + 1` tokens of the whole split (after the cap), as u32.
    tokens: Vec<u32>,
    tables: Arc<ByteTables>,
    /// Scorable targets of the whole split before `val_max_tokens`.
    split_targets: usize,
}

/// What makes two loads the same: the files (with their sizes and modification times), the
/// tokenizer and the settings that cut the stream.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ValKey {
    files: Vec<(PathBuf, u64, Option<SystemTime>)>,
    tokenizer: (PathBuf, u64, Option<SystemTime>),
    seq_len: usize,
    val_max_tokens: usize,
    vocab: usize,
}

/// Loads alive somewhere in the process: the executor, the artifact and the evaluation stages
/// of one run share one copy of the split (the challenge's is 62 M tokens) instead of reading
/// it three times; once every holder is gone the next load reads the files again.
static LOADED: Mutex<Vec<(ValKey, Weak<ValData>)>> = Mutex::new(Vec::new());

fn file_key(path: &Path) -> anyhow::Result<(PathBuf, u64, Option<SystemTime>)> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok((path.to_path_buf(), meta.len(), meta.modified().ok()))
}

impl Validator {
    /// Reads `[data] val` and `[data] tokenizer` and checks them against `[model]`; errors name
    /// the key or the file. Stages that load the same split share one copy of it. This process
    /// scores the whole split.
    pub fn load(settings: &ValSettings, micro_steps: usize) -> anyhow::Result<Self> {
        Self::shared(settings, micro_steps, std::sync::Arc::new(crate::dist::single::Single))
    }

    /// As [`Validator::load`], the split shared by the ranks of `ranks`: this rank scores its
    /// contiguous share of the sequences, in passes of `train.val_batch_tokens / (W · A)`
    /// tokens, and each pass ends with the sums of loss, targets and bytes added up over the
    /// ranks in f64, so that every rank gets the whole split's score.
    pub fn shared(settings: &ValSettings, micro_steps: usize, ranks: std::sync::Arc<dyn crate::dist::Collective>) -> anyhow::Result<Self> {
        let pattern = settings.val.clone().context("`data.val` is not set: the step executor validates on the validation shards")?;
        let tok_path =
            settings.tokenizer.as_deref().context("`data.tokenizer` is not set: val_bpb counts bytes with the sentencepiece model")?;
        let files = val_files(&pattern, Some(tok_path))?;
        let t = settings;
        let key = ValKey {
            files: files.shards.iter().chain(files.sidecars.iter().flatten()).map(|p| file_key(p)).collect::<anyhow::Result<_>>()?,
            tokenizer: file_key(tok_path).context("`data.tokenizer`")?,
            seq_len: t.seq_len,
            val_max_tokens: t.val_max_tokens,
            vocab: settings.vocab,
        };
        // Held while loading: a second stage asking for the same split waits and shares it.
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        loaded.retain(|(_, w)| w.strong_count() > 0);
        let data = match loaded.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
            Some(data) => data,
            None => {
                let data = Arc::new(ValData::read(settings, &pattern, tok_path, &files)?);
                loaded.push((key, Arc::downgrade(&data)));
                data
            }
        };
        drop(loaded);
        let seqs = (data.tokens.len() - 1) / t.seq_len;
        let batch_rows = tokens_per_pass(settings, ranks.world(), micro_steps) / t.seq_len;
        let mine = crate::dist::share::share(seqs, ranks.rank(), ranks.world());
        Ok(Self { data, seq_len: t.seq_len, batch_rows, packed: t.packed, first: mine.start, end: mine.end, pattern, ranks })
    }
}

/// What `pipeline validate` can tell of the validation split from its shards' headers alone:
/// that it holds at least one sequence of `train.seq_len` targets, which every validation
/// needs (the run would refuse it when loading the split). Nothing to check without `data.val`.
pub fn check_split(settings: &ValSettings) -> anyhow::Result<()> {
    let Some(tokens) = split_tokens(settings)? else { return Ok(()) };
    let pattern = settings.val.as_deref().unwrap_or_default();
    anyhow::ensure!(tokens > settings.seq_len as u64, "{}", too_short(pattern, tokens, settings.seq_len));
    Ok(())
}

/// Tokens in the validation shards `data.val` matches, from their headers; none without it.
/// CaseOps data's sidecars are checked here ([`val_files`]), so the config check refuses a
/// missing or mismatched one.
pub fn split_tokens(settings: &ValSettings) -> anyhow::Result<Option<u64>> {
    let Some(pattern) = &settings.val else { return Ok(None) };
    let files = val_files(pattern, settings.tokenizer.as_deref())?;
    let mut tokens = 0u64;
    for p in &files.shards {
        tokens += crate::data::shard::read_header(p)?.1;
    }
    Ok(Some(tokens))
}

/// Tokens one validation forward pass takes on this rank: `train.val_batch_tokens` shared by
/// the ranks and micro-batches, in whole sequences, at least one.
pub fn tokens_per_pass(settings: &ValSettings, world_size: usize, micro_steps: usize) -> usize {
    let t = settings;
    (t.val_batch_tokens / (world_size * micro_steps).max(1) / t.seq_len).max(1) * t.seq_len
}

/// The refusal of a split of `tokens` tokens, shorter than one sequence.
fn too_short(pattern: &str, tokens: u64, seq_len: usize) -> String {
    format!(
        "the validation shards {pattern:?} hold {tokens} tokens, fewer than one sequence of `train.seq_len` = {seq_len} plus 1 (`data.val`)"
    )
}

impl ValData {
    fn read(settings: &ValSettings, pattern: &str, tok_path: &Path, files: &ValFiles) -> anyhow::Result<Self> {
        let mut tables = load_tables(tok_path, settings.vocab)?;
        let all = ShardFile::read_concatenated(&files.shards)?;
        let t = settings;
        let usable = validation_tokens(&all, t.seq_len);
        anyhow::ensure!(usable.len() > t.seq_len, "{}", too_short(pattern, all.len() as u64, t.seq_len));
        let split_targets = usable.len() - 1;
        let mut seqs = split_targets / t.seq_len;
        if t.val_max_tokens > 0 {
            seqs = seqs.min((t.val_max_tokens / t.seq_len).max(1));
        }
        let vocab = settings.vocab;
        let tokens: Vec<u32> = usable[..seqs * t.seq_len + 1].iter().map(|&x| u32::from(x)).collect();
        if let Some(pos) = tokens.iter().position(|&x| x as usize >= vocab) {
            anyhow::bail!(
                "validation token {} at position {pos} is not below `model.vocab_size` = {vocab} (shards {pattern:?} made with another tokenizer?)",
                tokens[pos]
            );
        }
        if let Some(mut bytes) = read_stream_bytes(files)? {
            anyhow::ensure!(
                bytes.len() == all.len(),
                "the byte sidecars of {pattern:?} hold {} values for {} tokens; they must match",
                bytes.len(),
                all.len()
            );
            bytes.truncate(tokens.len());
            tables = tables.with_stream_bytes(bytes);
        }
        Ok(Self { tokens, tables: Arc::new(tables), split_targets })
    }
}

impl Validator {
    /// The scored stream: `targets() + 1` tokens (inputs, then the last target).
    pub fn tokens(&self) -> &[u32] {
        &self.data.tokens
    }

    /// The `(rows, t)` of a scorer's passes: `rows x t` of the training rows' length, or
    /// packed one row of a whole batch's tokens.
    pub fn pass_shape(&self, rows: usize) -> (usize, usize) {
        if self.packed { (1, self.batch_rows * self.seq_len) } else { (rows, self.seq_len) }
    }

    /// Targets scored by a full pass over all ranks.
    pub fn targets(&self) -> usize {
        self.data.tokens.len() - 1
    }

    /// Targets of the whole split (before `train.val_max_tokens`).
    pub fn split_targets(&self) -> usize {
        self.data.split_targets
    }

    /// The shard glob.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The byte tables.
    pub fn tables(&self) -> &Arc<ByteTables> {
        &self.data.tables
    }

    /// Scores this rank's sequences with `model`; `keep_going` is asked between batches: false
    /// cuts the pass short and gives `None` (a partial score is no score). Several ranks agree
    /// before each batch whether to go on (one rank's false stops them all) and run as many
    /// rounds as the longest share takes. The candle model's forward pass (feature `candle`).
    #[cfg(feature = "candle")]
    pub fn run(&self, model: &Gpt, keep_going: impl Fn() -> bool) -> anyhow::Result<Option<BpbAccumulator>> {
        self.run_with(&mut |x, y, rows| nll_sum(model, x, y, rows), 1, keep_going)
    }

    /// [`Validator::run`] with the scoring given: `score(x, y, rows)` returns the summed loss
    /// (nats) of the `rows` sequences of targets `y` after inputs `x` (an executor that scores
    /// on its own device, [`crate::train::executor::Executor::score`]), in batches of a
    /// multiple of `rows_multiple` sequences (the scorer's own pass: `train.val_batch_tokens`
    /// rounded up to it, so that a scorer of fixed rows pads at most each rank's last batch).
    /// Packed (`train.val_packed`), each batch of `train.val_batch_tokens / (W · A)` tokens goes
    /// to `score` as one row (`rows` 1), a rank's last one shorter.
    pub fn run_with(
        &self,
        score: &mut ScoreFn<'_>,
        rows_multiple: usize,
        keep_going: impl Fn() -> bool,
    ) -> anyhow::Result<Option<BpbAccumulator>> {
        let batch_rows = if self.packed { self.batch_rows } else { self.batch_rows.next_multiple_of(rows_multiple.max(1)) };
        let mut acc = BpbAccumulator::new(self.data.tables.clone());
        let tokens = &self.data.tokens;
        let t = self.seq_len;
        let mut s = self.first;
        let seqs = (tokens.len() - 1) / t;
        for _ in 0..crate::dist::share::rounds(seqs, self.ranks.world(), batch_rows) {
            if !crate::dist::share::all_go_on(self.ranks.as_ref(), keep_going())? {
                return Ok(None);
            }
            if s == self.end {
                continue;
            }
            let rows = batch_rows.min(self.end - s);
            let x = &tokens[s * t..(s + rows) * t];
            let y = &tokens[s * t + 1..(s + rows) * t + 1];
            acc.add_sum(s * t, x, y, score(x, y, if self.packed { 1 } else { rows })?);
            s += rows;
        }
        Ok(Some(acc.all_reduced(self.ranks.as_ref())?))
    }

    /// Unigram bits per byte of the scored targets (all ranks' share), with add-one smoothed
    /// frequencies of the first (at most) 64 Mi tokens of the training shards `train_glob`.
    pub fn unigram_bpb(&self, train_glob: &str, vocab: usize) -> anyhow::Result<f64> {
        let counts = unigram_counts(train_glob, vocab)?;
        let tokens = &self.data.tokens;
        let n = tokens.len();
        Ok(unigram_bpb(&counts, &tokens[..n - 1], &tokens[1..], &self.data.tables))
    }
}

/// The summed loss (nats) of `model` on `rows` sequences of targets `y` after inputs `x`
/// (row-major ids): its per-token losses in f32, added up in f64 (the candle forward pass).
#[cfg(feature = "candle")]
pub fn nll_sum(model: &Gpt, x: &[u32], y: &[u32], rows: usize) -> anyhow::Result<f64> {
    let t = x.len() / rows.max(1);
    let xt = Tensor::from_slice(x, (rows, t), model.device())?;
    let yt = Tensor::from_slice(y, (rows, t), model.device())?;
    let nll = model.eval_token_losses(&xt, &yt)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(nll.iter().map(|&l| f64::from(l)).sum())
}

/// Byte tables of the tokenizer at `path`, checked against `model.vocab_size`.
pub fn load_tables(path: &Path, vocab: usize) -> anyhow::Result<ByteTables> {
    let pieces = crate::data::tokenizer::vocab_size(path).with_context(|| format!("`data.tokenizer` = {}", path.display()))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A config reading `n` validation tokens (ids below 40) from a fresh directory.
    fn setup(name: &str, n: usize) -> (ValSettings, PathBuf) {
        let dir = std::env::temp_dir().join(format!("pipeline-validation-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let pieces: Vec<String> = (0..40).map(|i| format!("p{i}")).collect();
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let tok = dir.join("tok.model");
        std::fs::write(&tok, crate::data::tokenizer::build_bpe_model(&pieces, &[])).unwrap();
        let vocab = crate::data::tokenizer::vocab_size(&tok).unwrap();
        let tokens: Vec<u16> = (0..n).map(|i| (i * 7 % vocab) as u16).collect();
        crate::data::shard::write_shard(&dir.join("fineweb_val_000000.bin"), &tokens).unwrap();
        let c = ValSettings {
            val: Some(dir.join("fineweb_val_*.bin").display().to_string()),
            tokenizer: Some(tok),
            seq_len: 16,
            val_batch_tokens: 524_288,
            val_max_tokens: 0,
            vocab,
            packed: false,
        };
        (c, dir)
    }

    /// A scorer of fixed rows gets batches of a multiple of them: 10 sequences in batches of 3
    /// (val_batch_tokens 48, 16 tokens a sequence) with a multiple of 4 come as 4, 4, 2, every
    /// target once, and the sums are the plain pass's.
    #[test]
    fn batches_are_a_multiple_of_the_scorers_rows() {
        let (mut c, dir) = setup("multiple", 16 * 10 + 1);
        c.val_batch_tokens = 48;
        let v = Validator::load(&c, 1).unwrap();
        let (mut calls, mut seen) = (Vec::new(), 0);
        let loss = |x: &[u32], y: &[u32]| x.iter().zip(y).map(|(&a, &b)| f64::from(a * 3 + b) / 100.0).sum::<f64>();
        let acc = v
            .run_with(
                &mut |x, y, rows| {
                    calls.push(rows);
                    seen += y.len();
                    Ok(loss(x, y))
                },
                4,
                || true,
            )
            .unwrap()
            .unwrap();
        assert_eq!((calls, seen), (vec![4, 4, 2], 160));
        let plain = v.run_with(&mut |x, y, _| Ok(loss(x, y)), 1, || true).unwrap().unwrap();
        assert_eq!((acc.nll_sum(), acc.tokens(), acc.bytes()), (plain.nll_sum(), plain.tokens(), plain.bytes()));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Packed (`train.val_packed`): each batch of 3 sequences comes as one row of their 48
    /// tokens, the last one of the 1 left, whatever the scorer's rows; the sums are the rows'.
    #[test]
    fn packed_batches_are_one_row_each() {
        let (mut c, dir) = setup("packed", 16 * 10 + 1);
        c.val_batch_tokens = 48;
        let rows = Validator::load(&c, 1).unwrap();
        c.packed = true;
        let v = Validator::load(&c, 1).unwrap();
        assert_eq!((v.pass_shape(4), rows.pass_shape(4)), ((1, 48), (4, 16)));
        let loss = |x: &[u32], y: &[u32]| x.iter().zip(y).map(|(&a, &b)| f64::from(a * 3 + b) / 100.0).sum::<f64>();
        let mut calls = Vec::new();
        let acc = v
            .run_with(
                &mut |x, y, r| {
                    calls.push((r, x.len(), y.len()));
                    Ok(loss(x, y))
                },
                4,
                || true,
            )
            .unwrap()
            .unwrap();
        assert_eq!(calls, [(1, 48, 48), (1, 48, 48), (1, 48, 48), (1, 16, 16)]);
        let plain = rows.run_with(&mut |x, y, _| Ok(loss(x, y)), 1, || true).unwrap().unwrap();
        assert_eq!((acc.nll_sum(), acc.tokens(), acc.bytes()), (plain.nll_sum(), plain.tokens(), plain.bytes()));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Stages of one run share one copy of the split; a changed file or setting is read anew,
    /// and once every holder is gone the memory goes with them.
    #[test]
    fn loads_of_the_same_split_share_one_copy() {
        let (mut c, dir) = setup("share", 16 * 10 + 1);
        let a = Validator::load(&c, 1).unwrap();
        let b = Validator::load(&c, 1).unwrap();
        assert!(Arc::ptr_eq(&a.data, &b.data), "the second stage reads the split again");
        assert_eq!(a.targets(), 160);
        c.val_max_tokens = 32;
        let capped = Validator::load(&c, 1).unwrap();
        assert!(!Arc::ptr_eq(&a.data, &capped.data));
        assert_eq!(capped.targets(), 32);
        c.val_max_tokens = 0;
        // Rewritten with another length: a new load sees the new file.
        crate::data::shard::write_shard(&dir.join("fineweb_val_000000.bin"), &[1u16; 16 * 4 + 1]).unwrap();
        let fresh = Validator::load(&c, 1).unwrap();
        assert_eq!(fresh.targets(), 64);
        assert!(fresh.tokens().iter().all(|&t| t == 1));
        let weak = Arc::downgrade(&a.data);
        drop((a, b));
        assert!(weak.upgrade().is_none(), "nothing else keeps the split alive");
        let _ = std::fs::remove_dir_all(dir);
    }
}
