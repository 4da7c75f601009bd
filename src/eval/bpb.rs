//! The challenge's validation metric: bits per byte (`val_bpb`).
//!
//! The score is the model's cross-entropy on the validation tokens, but divided by the number of
//! UTF-8 bytes of text those tokens stand for, so that tokenizers of different vocabularies
//! compare fairly. The bytes are not measured on the text: they are counted from the tokens with
//! three look-up tables built from the sentencepiece model ([`ByteTables`]), exactly as the
//! challenge's scripts do (record spec, section 2):
//!
//! - **Tables (2.1).** Length `max(sentencepiece vocabulary, V)`. Defaults: `base_bytes = 0`,
//!   `leading_space = false`, `is_boundary = true`. Control, unknown and unused pieces (PAD, BOS,
//!   EOS, UNK, ...) keep the defaults. Every other piece has `is_boundary = false`; a byte-fallback
//!   piece (`<0xNN>`) has `base_bytes = 1`; a normal (or user-defined) piece that starts with
//!   U+2581 `▁` has `leading_space = true`, and `base_bytes` is the UTF-8 length of its text with
//!   that one leading `▁` stripped (a bare `▁` piece has base 0). Ids past the sentencepiece
//!   vocabulary keep the defaults.
//! - **Per target (2.2).** A target `y` predicted from input (previous token) `x` counts
//!   `base_bytes[y] + (leading_space[y] && !is_boundary[x] ? 1 : 0)` bytes: the space a `▁` stands
//!   for is counted unless the previous token is a boundary such as BOS. A BOS target counts its
//!   loss but zero bytes.
//! - **Loss and bpb (2.3).** Over all scored targets, in `f64`:
//!   `val_loss = Σ nll / N_tokens` (nats per token) and
//!   `val_bpb = (val_loss / ln 2) · N_tokens / N_bytes = Σ nll / (ln 2 · N_bytes)`.
//!
//! **CaseOps.** Validation data of a CaseOps tokenizer ([`crate::data::caseops`]) is
//! transformed text, which the tables would count (operators as three bytes each, capitals
//! as lowercase letters after them). Its val split carries a byte sidecar: the original text's
//! UTF-8 bytes of each position of the stream. Tables that hold it
//! ([`ByteTables::with_stream_bytes`]) charge target `i` of the stream (token `i + 1`) the
//! sidecar's entry `i + 1` instead of the rule above; everything else (loss, tokens, 2.3) is
//! the same. So the accumulator is told where in the stream the targets it adds start
//! (`first_target`); without a sidecar that position is not used and the sums are the tables'.
//!
//! [`validation_tokens`] applies the challenge's truncation of the validation stream to whole
//! sequences (spec 1.3), [`BpbAccumulator`] sums the loss and bytes of scored batches, and
//! [`unigram_bpb`] gives the score of a unigram model, the bar any trained model must beat.
//!
//! **Per-target record.** Tables made with [`ByteTables::recording`] make every accumulator
//! built from them also keep each target's loss, keyed by its target index, in the order it was
//! added ([`BpbAccumulator::recorded`]): what the legality audit ([`crate::eval::audit`]) reads
//! from the unchanged evaluations. Off (the default), an accumulator holds no record and
//! allocates nothing for it.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use sentencepiece_model::{SentencePieceModel, Type};

/// The sentencepiece word-boundary marker U+2581 (`▁`), which stands for a space.
pub const SPACE_MARKER: char = '\u{2581}';

/// Per-token byte look-up tables (spec 2.1), indexed by token id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ByteTables {
    /// UTF-8 bytes a token stands for, not counting the space of a leading `▁`.
    pub base_bytes: Vec<u16>,
    /// The piece starts with `▁`: it adds one byte (a space) unless the previous token is a boundary.
    pub leading_space: Vec<bool>,
    /// Control, unknown or unused piece, or an id outside the sentencepiece vocabulary.
    pub is_boundary: Vec<bool>,
    /// The model has a bare `▁` piece. Without it a lone space may be encoded as the three
    /// byte-fallback pieces of U+2581 and counted as three bytes instead of one (later challenge
    /// records assert it exists); recorded here, not enforced.
    pub has_space_piece: bool,
    /// CaseOps: the original UTF-8 bytes of each token of the validation stream (its byte
    /// sidecar), which replace the rule above when set ([`ByteTables::with_stream_bytes`]).
    pub stream_bytes: Option<StreamBytes>,
    /// Accumulators built from these tables keep each target's loss ([`ByteTables::recording`]);
    /// false (the default) for every evaluation that only needs the sums.
    pub record_targets: bool,
}

/// A validation stream's byte sidecar: entry `i` is the original bytes of token `i`.
#[derive(Clone, PartialEq, Eq)]
pub struct StreamBytes(pub Arc<[u16]>);

impl std::fmt::Debug for StreamBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamBytes({} tokens)", self.0.len())
    }
}

impl ByteTables {
    /// Reads a sentencepiece `.model` file and builds its tables for a model of `vocab_size`
    /// outputs (the tables hold `max(pieces, vocab_size)` entries).
    pub fn from_model_file(path: &Path, vocab_size: usize) -> anyhow::Result<Self> {
        let bytes = crate::runtime::files::read(path).with_context(|| format!("{}: cannot read the tokenizer", path.display()))?;
        let model =
            SentencePieceModel::from_slice(&bytes).map_err(|e| anyhow::anyhow!("{}: not a sentencepiece model ({e})", path.display()))?;
        anyhow::ensure!(!model.pieces().is_empty(), "{}: not a sentencepiece model (it has no pieces)", path.display());
        Ok(Self::from_model(&model, vocab_size))
    }

    /// Builds the tables of a parsed sentencepiece model for a model of `vocab_size` outputs
    /// (the tables hold `max(pieces, vocab_size)` entries), following spec 2.1.
    pub fn from_model(model: &SentencePieceModel, vocab_size: usize) -> Self {
        let pieces = model.pieces();
        let len = pieces.len().max(vocab_size);
        let mut t = Self {
            base_bytes: vec![0; len],
            leading_space: vec![false; len],
            is_boundary: vec![true; len],
            has_space_piece: false,
            stream_bytes: None,
            record_targets: false,
        };
        for (id, p) in pieces.iter().enumerate() {
            match p.r#type() {
                Type::Control | Type::Unknown | Type::Unused => continue,
                Type::Byte => {
                    t.is_boundary[id] = false;
                    t.base_bytes[id] = 1;
                }
                Type::Normal | Type::UserDefined => {
                    t.is_boundary[id] = false;
                    let text = p.piece();
                    if text == "▁" {
                        t.has_space_piece = true;
                    }
                    let rest = match text.strip_prefix(SPACE_MARKER) {
                        Some(rest) => {
                            t.leading_space[id] = true;
                            rest
                        }
                        None => text,
                    };
                    t.base_bytes[id] = u16::try_from(rest.len()).unwrap_or(u16::MAX);
                }
            }
        }
        t
    }

    /// Number of ids the tables cover.
    pub fn len(&self) -> usize {
        self.base_bytes.len()
    }

    /// The tables cover no id.
    pub fn is_empty(&self) -> bool {
        self.base_bytes.is_empty()
    }

    /// Bytes counted for `target` predicted after `prev` (spec 2.2):
    /// `base_bytes[target] + 1` if `target` has a leading `▁` and `prev` is not a boundary,
    /// else `base_bytes[target]`. Panics if either id is outside the tables.
    #[inline]
    pub fn target_bytes(&self, prev: u32, target: u32) -> u32 {
        let (p, t) = (prev as usize, target as usize);
        u32::from(self.base_bytes[t]) + u32::from(self.leading_space[t] && !self.is_boundary[p])
    }

    /// Sum of [`target_bytes`](Self::target_bytes) over pairs `(prev[i], targets[i])`: the
    /// tables' rule, whether or not a sidecar is held ([`bytes_at`](Self::bytes_at) uses it).
    /// Panics if the slices differ in length or hold an id outside the tables.
    pub fn count_bytes(&self, prev: &[u32], targets: &[u32]) -> u64 {
        assert_eq!(prev.len(), targets.len(), "count_bytes: {} inputs for {} targets", prev.len(), targets.len());
        prev.iter().zip(targets).map(|(&p, &t)| u64::from(self.target_bytes(p, t))).sum()
    }

    /// These tables charging the validation stream's byte sidecar `bytes` (one entry per
    /// token of the stream) instead of their rule (CaseOps data).
    pub fn with_stream_bytes(mut self, bytes: Vec<u16>) -> Self {
        self.stream_bytes = Some(StreamBytes(bytes.into()));
        self
    }

    /// These tables making every [`BpbAccumulator`] built from them keep each target's loss
    /// ([`BpbAccumulator::recorded`]): the legality audit's view of an unchanged evaluation.
    #[cfg(feature = "tools")]
    pub fn recording(mut self) -> Self {
        self.record_targets = true;
        self
    }

    /// Bytes of the targets `targets[k]` (after `prev[k]`) that are targets
    /// `first_target + k` of the validation stream: the sidecar's entries
    /// `first_target + 1 ..` when the tables hold one, else [`count_bytes`](Self::count_bytes).
    /// Panics if the slices differ in length, or the targets run past the sidecar (checked
    /// beforehand by [`check_stream`](Self::check_stream)) or an id past the tables.
    pub fn bytes_at(&self, first_target: usize, prev: &[u32], targets: &[u32]) -> u64 {
        assert_eq!(prev.len(), targets.len(), "bytes_at: {} inputs for {} targets", prev.len(), targets.len());
        match &self.stream_bytes {
            Some(StreamBytes(side)) => side[first_target + 1..first_target + 1 + targets.len()].iter().map(|&b| u64::from(b)).sum(),
            None => self.count_bytes(prev, targets),
        }
    }

    /// Checks that a held sidecar covers a validation stream of `tokens` tokens.
    pub fn check_stream(&self, tokens: usize) -> anyhow::Result<()> {
        if let Some(StreamBytes(side)) = &self.stream_bytes {
            anyhow::ensure!(side.len() >= tokens, "the byte sidecar covers {} tokens of a validation stream of {tokens}", side.len());
        }
        Ok(())
    }
}

/// Sums of a validation pass: negative log-likelihood (nats, `f64`), scored tokens and their
/// bytes (spec 2.3). Fill one per worker with [`add`](Self::add), combine with
/// [`merge`](Self::merge), read [`val_loss`](Self::val_loss) and [`val_bpb`](Self::val_bpb).
#[derive(Clone, Debug)]
pub struct BpbAccumulator {
    tables: Arc<ByteTables>,
    nll_sum: f64,
    tokens: u64,
    bytes: u64,
    /// Each target's loss, under [`ByteTables::recording`] only.
    record: Option<TargetRecord>,
}

/// What an accumulator of recording tables holds besides its sums: every added target's
/// `(target index, loss)` in the order added, or why no such list can be had.
#[derive(Clone, Debug)]
enum TargetRecord {
    /// Every target added so far, with its loss.
    Losses(Vec<(usize, f32)>),
    /// Some targets were added without their own losses (a device's sum, the ranks' sums).
    Unusable(String),
}

impl TargetRecord {
    /// An empty record when `tables` ask for one.
    fn for_tables(tables: &ByteTables) -> Option<Self> {
        tables.record_targets.then(|| Self::Losses(Vec::new()))
    }

    /// From here on the record cannot list every target: `why`. The first reason is kept.
    fn spoil(&mut self, why: impl FnOnce() -> String) {
        if let Self::Losses(_) = self {
            *self = Self::Unusable(why());
        }
    }
}

impl BpbAccumulator {
    /// The records' score line: `<label> val_loss:%.8f val_bpb:%.8f eval_time:%.0fms`.
    pub fn score_line(&self, label: &str, eval_ms: f64) -> String {
        format!("{label} val_loss:{:.8} val_bpb:{:.8} eval_time:{eval_ms:.0}ms", self.val_loss(), self.val_bpb())
    }

    /// An empty accumulator counting bytes with `tables`.
    pub fn new(tables: Arc<ByteTables>) -> Self {
        let record = TargetRecord::for_tables(&tables);
        Self { tables, nll_sum: 0.0, tokens: 0, bytes: 0, record }
    }

    /// An accumulator holding these sums (the ranks' sums added up). Under recording tables its
    /// record is unusable: sums do not say which target lost what.
    pub fn from_sums(tables: Arc<ByteTables>, nll_sum: f64, tokens: u64, bytes: u64) -> Self {
        let mut record = TargetRecord::for_tables(&tables);
        if let Some(r) = &mut record {
            r.spoil(|| format!("{tokens} targets came as sums (from_sums: the ranks' sums added up), not one loss each"));
        }
        Self { tables, nll_sum, tokens, bytes, record }
    }

    /// The sums of every rank of `ranks` added up in f64, on every rank (the score of a pass
    /// the ranks shared); unchanged for a world of one without a transport.
    pub fn all_reduced(self, ranks: &dyn crate::dist::Collective) -> anyhow::Result<Self> {
        if ranks.is_identity() {
            return Ok(self);
        }
        let sums = ranks.all_reduce_host(&[self.nll_sum, self.tokens as f64, self.bytes as f64], crate::dist::ReduceOp::Sum)?;
        Ok(Self::from_sums(self.tables, sums[0], sums[1] as u64, sums[2] as u64))
    }

    /// The tables it counts bytes with.
    #[cfg(feature = "tools")]
    pub fn tables(&self) -> &Arc<ByteTables> {
        &self.tables
    }

    /// Adds scored targets: `nll[i]` is the loss (nats) of `targets[i]` predicted from input
    /// `prev[i]`, target `first_target + i` of the validation stream. Each target counts one
    /// token and its bytes ([`ByteTables::bytes_at`]: the tables' rule, or the sidecar's entry).
    /// Panics if the three slices differ in length or an id or position is outside the tables.
    pub fn add(&mut self, first_target: usize, prev: &[u32], targets: &[u32], nll: &[f32]) {
        assert_eq!(targets.len(), nll.len(), "BpbAccumulator::add: {} targets for {} losses", targets.len(), nll.len());
        self.bytes += self.tables.bytes_at(first_target, prev, targets);
        self.tokens += targets.len() as u64;
        self.nll_sum += nll.iter().map(|&x| f64::from(x)).sum::<f64>();
        if let Some(TargetRecord::Losses(pairs)) = &mut self.record {
            pairs.extend(nll.iter().enumerate().map(|(i, &l)| (first_target + i, l)));
        }
    }

    /// Adds scored targets whose losses are known only as their sum `nll_sum` (nats): an
    /// executor that adds them up on its device. Each target counts as in [`Self::add`].
    pub fn add_sum(&mut self, first_target: usize, prev: &[u32], targets: &[u32], nll_sum: f64) {
        assert_eq!(prev.len(), targets.len(), "BpbAccumulator::add_sum: {} inputs for {} targets", prev.len(), targets.len());
        self.bytes += self.tables.bytes_at(first_target, prev, targets);
        self.tokens += targets.len() as u64;
        self.nll_sum += nll_sum;
        if let Some(r) = &mut self.record {
            let n = targets.len();
            r.spoil(|| {
                format!(
                    "targets {first_target}..{} were added as one sum (add_sum: a device-summed score), not one loss each",
                    first_target + n
                )
            });
        }
    }

    /// Adds another accumulator's sums (another worker's share of the same split), and under
    /// recording tables its record after this one's.
    pub fn merge(&mut self, other: &BpbAccumulator) {
        self.nll_sum += other.nll_sum;
        self.tokens += other.tokens;
        self.bytes += other.bytes;
        match (&mut self.record, &other.record) {
            (Some(TargetRecord::Losses(mine)), Some(TargetRecord::Losses(theirs))) => mine.extend_from_slice(theirs),
            (Some(mine), Some(TargetRecord::Unusable(why))) => mine.spoil(|| why.clone()),
            (Some(mine), None) => mine
                .spoil(|| format!("merged {} targets of an accumulator that kept no record (its tables were not recording)", other.tokens)),
            (None, _) | (Some(TargetRecord::Unusable(_)), _) => {}
        }
    }

    /// Every target added so far as `(target index, loss)`, in the order added (a target added
    /// twice appears twice). Errors when the tables were not made with
    /// [`ByteTables::recording`], or when targets came without their own losses ([`Self::add_sum`],
    /// [`Self::from_sums`]): the error says which.
    #[cfg(feature = "tools")]
    pub fn recorded(&self) -> anyhow::Result<&[(usize, f32)]> {
        match &self.record {
            Some(TargetRecord::Losses(pairs)) => Ok(pairs),
            Some(TargetRecord::Unusable(why)) => anyhow::bail!("no per-target losses were recorded: {why}"),
            None => anyhow::bail!("no per-target losses were recorded: the byte tables were not made with `ByteTables::recording`"),
        }
    }

    /// Σ nll so far, in nats.
    pub fn nll_sum(&self) -> f64 {
        self.nll_sum
    }

    /// Scored tokens so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Bytes of the scored tokens so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Mean loss per token in nats, `Σ nll / N_tokens`; NaN before any token.
    pub fn val_loss(&self) -> f64 {
        if self.tokens == 0 { f64::NAN } else { self.nll_sum / self.tokens as f64 }
    }

    /// Bits per byte, `Σ nll / (ln 2 · N_bytes)`; NaN while no byte has been counted.
    pub fn val_bpb(&self) -> f64 {
        if self.bytes == 0 { f64::NAN } else { self.nll_sum / (std::f64::consts::LN_2 * self.bytes as f64) }
    }
}

/// Bits per byte of a unigram model on the validation targets: the bar a trained model must
/// beat (a model that learnt only token frequencies scores this).
///
/// The model predicts every token with the add-one smoothed training frequency
/// `p(t) = (train_counts[t] + 1) / (Σ train_counts + train_counts.len())`, whatever came before,
/// so the vocabulary is `train_counts.len()` ids (use the model's `V`). The score is
/// `Σ −log₂ p(target) / Σ bytes`, over every pair `(val_prev[i], val_targets[i])`, target `i`
/// of the validation stream, with the bytes of [`ByteTables::bytes_at`]; BOS targets count their loss and no bytes, as in the real
/// metric. NaN if the targets hold no byte. Panics if the slices differ in length, if
/// `train_counts` is empty or if a target is not below `train_counts.len()`.
pub fn unigram_bpb(train_counts: &[u64], val_prev: &[u32], val_targets: &[u32], tables: &ByteTables) -> f64 {
    assert!(!train_counts.is_empty(), "unigram_bpb: no vocabulary");
    let bytes = tables.bytes_at(0, val_prev, val_targets);
    if bytes == 0 {
        return f64::NAN;
    }
    let total = train_counts.iter().sum::<u64>() as f64 + train_counts.len() as f64;
    let log2_total = total.log2();
    let bits: f64 = val_targets
        .iter()
        .map(|&t| {
            let c = *train_counts
                .get(t as usize)
                .unwrap_or_else(|| panic!("unigram_bpb: target {t} outside the vocabulary of {}", train_counts.len()));
            log2_total - (c as f64 + 1.0).log2()
        })
        .sum();
    bits / bytes as f64
}

/// The validation stream truncated to whole sequences of `seq_len` targets (spec 1.3): with
/// `N = tokens.len()`, keeps `[0, ⌊(N − 1) / seq_len⌋ · seq_len + 1)`, so every kept token but
/// the first is scored once as a target. Empty for an empty stream; a single token (no target)
/// when the stream is shorter than `seq_len + 1`. Panics if `seq_len` is 0.
pub fn validation_tokens(tokens: &[u16], seq_len: usize) -> &[u16] {
    assert!(seq_len > 0, "validation_tokens: seq_len must be positive");
    if tokens.is_empty() {
        return tokens;
    }
    let usable = (tokens.len() - 1) / seq_len * seq_len;
    &tokens[..usable + 1]
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use sentencepiece_model::SentencePieceModel;

    use super::*;
    use crate::data::tokenizer::Tokenizer;

    const BOS: u32 = 1;
    /// First normal piece: `<pad> <s> </s> <unk>`, then 256 byte pieces at 4..=259.
    const FIRST_NORMAL: u32 = 260;
    /// Normal pieces of the tiny model, ids from [`FIRST_NORMAL`], best merges first.
    const NORMAL: [&str; 17] = ["▁the", "▁th", "▁t", "th", "he", "▁a", "an", "▁", "é", "▁é", "e", "t", "h", "a", "o", "n", "s"];

    fn id_of(piece: &str) -> u32 {
        FIRST_NORMAL + NORMAL.iter().position(|p| *p == piece).unwrap() as u32
    }

    fn byte_id(b: u8) -> u32 {
        4 + u32::from(b)
    }

    /// The tiny model: [`NORMAL`] after the specials and byte pieces, then one unused piece
    /// (`<unused>`, last id). `with_space` keeps the bare `▁` piece; without it a placeholder
    /// keeps the other ids where they are.
    fn model_bytes(with_space: bool) -> Vec<u8> {
        let normal: Vec<&str> = NORMAL.iter().map(|p| if *p == "▁" && !with_space { "zz" } else { p }).collect();
        crate::data::tokenizer::build_bpe_model(&normal, &["<unused>"])
    }

    fn parsed(with_space: bool) -> SentencePieceModel {
        SentencePieceModel::from_slice(model_bytes(with_space)).unwrap()
    }

    /// Writes the tiny model to a temp file (removed on drop) and loads the tokenizer.
    struct TinyModel {
        path: PathBuf,
        tok: Tokenizer,
    }

    impl TinyModel {
        fn new(tag: &str, with_space: bool) -> Self {
            let path = std::env::temp_dir().join(format!("pipeline-bpb-{tag}-{}.model", std::process::id()));
            std::fs::write(&path, model_bytes(with_space)).unwrap();
            let tok = Tokenizer::load(&path).unwrap();
            Self { path, tok }
        }
    }

    impl Drop for TinyModel {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// `[BOS] + ids(text)` as (prev, target) pairs, checking that the ids decode to `text`.
    fn pairs(tok: &Tokenizer, text: &str) -> (Vec<u32>, Vec<u32>) {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "{text:?} does not round-trip: {ids:?}");
        let mut stream = vec![BOS];
        stream.extend(&ids);
        (stream[..stream.len() - 1].to_vec(), stream[1..].to_vec())
    }

    #[test]
    fn tables_follow_the_piece_kinds() {
        let t = ByteTables::from_model(&parsed(true), 0);
        let n = 4 + 256 + NORMAL.len() + 1;
        assert_eq!(t.len(), n);
        assert!(t.has_space_piece);
        // Control, unknown, unused: defaults.
        for id in [0, 1, 2, 3, n - 1] {
            assert_eq!((t.base_bytes[id], t.leading_space[id], t.is_boundary[id]), (0, false, true), "id {id}");
        }
        // Byte pieces: one byte, no space, not a boundary.
        for b in [0u8, 0x20, 0xC3, 0xFF] {
            let id = byte_id(b) as usize;
            assert_eq!((t.base_bytes[id], t.leading_space[id], t.is_boundary[id]), (1, false, false), "<0x{b:02X}>");
        }
        // Normal pieces: a leading `▁` becomes the flag, the rest counts its UTF-8 bytes.
        let want = [("▁the", 3, true), ("th", 2, false), ("▁", 0, true), ("é", 2, false), ("▁é", 2, true), ("e", 1, false)];
        for (p, base, space) in want {
            let id = id_of(p) as usize;
            assert_eq!((t.base_bytes[id], t.leading_space[id], t.is_boundary[id]), (base, space, false), "{p}");
        }
    }

    #[test]
    fn tables_grow_to_the_model_vocab_and_note_a_missing_space_piece() {
        let n = 4 + 256 + NORMAL.len() + 1;
        let t = ByteTables::from_model(&parsed(true), n + 10);
        assert_eq!(t.len(), n + 10);
        for id in n..n + 10 {
            assert_eq!((t.base_bytes[id], t.leading_space[id], t.is_boundary[id]), (0, false, true));
        }
        // A smaller model vocabulary never shrinks the tables.
        assert_eq!(ByteTables::from_model(&parsed(true), 8).len(), n);
        let without = ByteTables::from_model(&parsed(false), 0);
        assert!(!without.has_space_piece);
        // `▁the` still has its flag; `zz` in place of `▁` is plain.
        assert!(without.leading_space[id_of("▁the") as usize]);
        assert_eq!((without.base_bytes[id_of("▁") as usize], without.leading_space[id_of("▁") as usize]), (2, false));
    }

    #[test]
    fn from_model_file_reads_and_reports_errors() {
        let m = TinyModel::new("file", true);
        assert_eq!(ByteTables::from_model_file(&m.path, 0).unwrap(), ByteTables::from_model(&parsed(true), 0));
        let missing = m.path.with_extension("absent");
        let e = format!("{:#}", ByteTables::from_model_file(&missing, 0).unwrap_err());
        assert!(e.contains("cannot read the tokenizer"), "{e}");
        let junk = m.path.with_extension("junk");
        std::fs::write(&junk, b"\xff\xff\xff not a model").unwrap();
        let e = format!("{:#}", ByteTables::from_model_file(&junk, 0).unwrap_err());
        let _ = std::fs::remove_file(&junk);
        assert!(e.contains("not a sentencepiece model"), "{e}");
    }

    #[test]
    fn target_bytes_counts_the_space_only_after_a_non_boundary() {
        let t = ByteTables::from_model(&parsed(true), 0);
        let (the, sp, e) = (id_of("▁the"), id_of("▁"), id_of("e"));
        assert_eq!(t.target_bytes(BOS, the), 3, "after BOS the space is not counted");
        assert_eq!(t.target_bytes(e, the), 4, "after a normal piece it is");
        assert_eq!(t.target_bytes(byte_id(b'x'), the), 4, "after a byte piece too");
        assert_eq!(t.target_bytes(0, sp), 0);
        assert_eq!(t.target_bytes(e, sp), 1);
        assert_eq!(t.target_bytes(e, e), 1);
        assert_eq!(t.target_bytes(BOS, e), 1);
        assert_eq!(t.target_bytes(e, BOS), 0, "a BOS target has no bytes");
        assert_eq!(t.target_bytes(e, byte_id(0xC3)), 1);
        assert_eq!(t.count_bytes(&[BOS, the, e], &[the, e, sp]), 3 + 1 + 1);
    }

    /// THE key property: for text free of the model's normalisations, the bytes counted from
    /// the tokens equal the text's UTF-8 length, byte-fallback pieces included.
    #[test]
    fn counted_bytes_equal_the_text_length() {
        let m = TinyModel::new("key", true);
        let t = ByteTables::from_model_file(&m.path, m.tok.vocab_size).unwrap();
        let docs = [
            "the",
            "the theater then",
            "a cat sat on the mat",
            "than an ant hath seen the sea",
            // `é` is a piece; `ï`, `ü`, `ß`, `ñ` and the other letters fall back to bytes.
            "naïve café über straße",
            "é éé ñ the é",
            "Hello world, 42 is the answer!",
            "x",
            "日本語 the 🙂 end",
            // The tiny model's normaliser is the identity, so newlines (byte pieces) and runs of
            // spaces (one bare `▁` each) survive too; the challenge's nmt_nfkc model would change
            // them. Tabs are left out: `Tokenizer::encode` turns them into spaces, so such a
            // document decodes to a different text (one byte each either way, but not the input).
            "x\ny  z",
        ];
        let mut stream = Vec::new();
        for doc in docs {
            let (prev, targets) = pairs(&m.tok, doc);
            assert_eq!(t.count_bytes(&prev, &targets), doc.len() as u64, "{doc:?}: {targets:?}");
            stream.push(BOS);
            stream.extend(&targets);
        }
        // The documents back to back as a shard holds them: every BOS but the first is a target
        // with no bytes, and the space rule restarts after it.
        let total: usize = docs.iter().map(|d| d.len()).sum();
        assert_eq!(t.count_bytes(&stream[..stream.len() - 1], &stream[1..]), total as u64);
        // The byte fallback and the `▁é` piece were exercised.
        let ids = m.tok.encode("naïve é").unwrap();
        assert!(ids.contains(&byte_id(0xC3)) && ids.contains(&byte_id(0xAF)), "{ids:?}");
        assert!(ids.contains(&id_of("▁é")), "{ids:?}");
        assert!(m.tok.encode("a b").unwrap().contains(&id_of("▁")), "a lone space is the bare `▁` piece");
    }

    /// Where the count and the text differ, by the challenge's rules: a space right after BOS
    /// (the document starts with one) is not counted.
    #[test]
    fn a_leading_space_after_bos_is_not_counted() {
        let m = TinyModel::new("leading", true);
        let t = ByteTables::from_model_file(&m.path, m.tok.vocab_size).unwrap();
        for doc in [" the end", " x"] {
            let (prev, targets) = pairs(&m.tok, doc);
            assert_eq!(t.count_bytes(&prev, &targets), doc.len() as u64 - 1, "{doc:?}: {targets:?}");
        }
    }

    /// Why the bare `▁` piece matters: without it the space before a word with no `▁word`
    /// piece is encoded as the three byte pieces of U+2581 and counted as three bytes.
    #[test]
    fn without_a_space_piece_spaces_are_overcounted() {
        let m = TinyModel::new("nospace", false);
        let t = ByteTables::from_model_file(&m.path, m.tok.vocab_size).unwrap();
        assert!(!t.has_space_piece);
        let doc = "the x";
        let (prev, targets) = pairs(&m.tok, doc);
        assert!(targets.windows(3).any(|w| w == [byte_id(0xE2), byte_id(0x96), byte_id(0x81)]), "{targets:?}");
        assert_eq!(t.count_bytes(&prev, &targets), doc.len() as u64 + 2);
    }

    #[test]
    fn accumulator_math() {
        let t = Arc::new(ByteTables::from_model(&parsed(true), 0));
        let e = id_of("e");
        let ln2 = std::f32::consts::LN_2;
        // One byte per token, ln 2 nats each: one bit per byte.
        let mut a = BpbAccumulator::new(t.clone());
        assert!(a.val_loss().is_nan() && a.val_bpb().is_nan());
        a.add(0, &[e, e, e, e], &[e, e, e, e], &[ln2; 4]);
        assert_eq!((a.tokens(), a.bytes()), (4, 4));
        assert!((a.val_bpb() - 1.0).abs() < 1e-7, "{}", a.val_bpb());
        assert!((a.val_loss() - std::f64::consts::LN_2).abs() < 1e-7);
        // Another worker: `▁the` after `e` (4 bytes) with 2 nats, BOS target (0 bytes) with 1 nat.
        let mut b = BpbAccumulator::new(t.clone());
        b.add(0, &[e, id_of("▁the")], &[id_of("▁the"), BOS], &[2.0, 1.0]);
        assert_eq!((b.tokens(), b.bytes()), (2, 4));
        a.merge(&b);
        let nll = 4.0 * f64::from(ln2) + 3.0;
        assert_eq!((a.tokens(), a.bytes()), (6, 8));
        assert!((a.nll_sum() - nll).abs() < 1e-6);
        assert!((a.val_loss() - nll / 6.0).abs() < 1e-7);
        assert!((a.val_bpb() - nll / (std::f64::consts::LN_2 * 8.0)).abs() < 1e-7);
        // bpb = (loss / ln 2) · tokens / bytes.
        assert!((a.val_bpb() - a.val_loss() / std::f64::consts::LN_2 * 6.0 / 8.0).abs() < 1e-12);
    }

    /// Recording tables: every target's loss through `add`, `merge` and an identity
    /// `all_reduced`, in the order added; a device sum or the ranks' sums spoil the record with
    /// the reason; tables that do not record keep nothing.
    #[test]
    fn recording_tables_keep_each_targets_loss_and_sums_spoil_it() {
        let plain = Arc::new(ByteTables::from_model(&parsed(true), 0));
        let rec = Arc::new(ByteTables::from_model(&parsed(true), 0).recording());
        let e = id_of("e");
        let mut off = BpbAccumulator::new(plain.clone());
        off.add(0, &[e, e], &[e, e], &[1.0, 2.0]);
        assert!(format!("{:#}", off.recorded().unwrap_err()).contains("ByteTables::recording"));
        let mut a = BpbAccumulator::new(rec.clone());
        a.add(5, &[e, e], &[e, e], &[1.0, 2.0]);
        let mut b = BpbAccumulator::new(rec.clone());
        b.add(0, &[e], &[e], &[0.5]);
        a.merge(&b);
        let a = a.all_reduced(&crate::dist::single::Single).unwrap();
        assert_eq!(a.recorded().unwrap(), &[(5, 1.0), (6, 2.0), (0, 0.5)]);
        // The sums are those of the record.
        assert_eq!((a.tokens(), a.nll_sum()), (3, 3.5));
        let mut c = a.clone();
        c.add_sum(7, &[e, e], &[e, e], 1.0);
        c.add(9, &[e], &[e], &[1.0]);
        let why = format!("{:#}", c.recorded().unwrap_err());
        assert!(why.contains("targets 7..9") && why.contains("add_sum"), "{why}");
        let mut d = BpbAccumulator::new(rec.clone());
        d.merge(&c);
        assert!(format!("{:#}", d.recorded().unwrap_err()).contains("add_sum"), "a spoilt record spoils what it is merged into");
        let mut f = BpbAccumulator::new(rec.clone());
        f.merge(&off);
        assert!(format!("{:#}", f.recorded().unwrap_err()).contains("kept no record"));
        let s = BpbAccumulator::from_sums(rec, 1.0, 2, 2);
        assert!(format!("{:#}", s.recorded().unwrap_err()).contains("from_sums"));
    }

    #[test]
    #[should_panic(expected = "targets for")]
    fn accumulator_rejects_mismatched_lengths() {
        let mut a = BpbAccumulator::new(Arc::new(ByteTables::from_model(&parsed(true), 0)));
        a.add(0, &[1, 1], &[1, 1], &[0.5]);
    }

    #[test]
    fn unigram_bpb_by_hand() {
        // Vocabulary of 4 ids with hand-set tables: 0 boundary; 1 one byte; 2 two bytes;
        // 3 a bare leading-space piece (0 + 1 byte after a non-boundary).
        let t = ByteTables {
            base_bytes: vec![0, 1, 2, 0],
            leading_space: vec![false, false, false, true],
            is_boundary: vec![true, false, false, false],
            has_space_piece: true,
            stream_bytes: None,
            record_targets: false,
        };
        // Counts 3, 1, 0, 2: total 6 + 4 = 10; p = 0.4, 0.2, 0.1, 0.3.
        let counts = [3u64, 1, 0, 2];
        // Targets 1 (after 0: 1 byte), 2 (2 bytes), 3 (after 2: 1 byte), 0 (0 bytes).
        let (prev, targets) = ([0u32, 1, 2, 3], [1u32, 2, 3, 0]);
        let bits = -(0.2f64.log2() + 0.1f64.log2() + 0.3f64.log2() + 0.4f64.log2());
        let got = unigram_bpb(&counts, &prev, &targets, &t);
        assert!((got - bits / 4.0).abs() < 1e-12, "{got} vs {}", bits / 4.0);
        // Uniform counts over 4 ids: 2 bits per token; 1 byte per token gives 2 bits per byte.
        let got = unigram_bpb(&[5, 5, 5, 5], &[1, 1], &[1, 1], &t);
        assert!((got - 2.0).abs() < 1e-12, "{got}");
        // No bytes: NaN.
        assert!(unigram_bpb(&counts, &[1], &[0], &t).is_nan());
    }

    #[test]
    fn validation_tokens_keeps_whole_sequences_plus_one() {
        let tokens: Vec<u16> = (0..100).collect();
        let len = |n: usize, seq: usize| validation_tokens(&tokens[..n], seq).len();
        assert_eq!(len(0, 4), 0);
        assert_eq!(len(1, 4), 1);
        assert_eq!(len(4, 4), 1);
        assert_eq!(len(5, 4), 5);
        assert_eq!(len(8, 4), 5);
        assert_eq!(len(9, 4), 9);
        assert_eq!(len(100, 4), 97);
        assert_eq!(len(100, 33), 100);
        assert_eq!(len(100, 1), 100);
        assert_eq!(len(100, 1000), 1);
        // A prefix of the input.
        assert_eq!(validation_tokens(&tokens, 10), &tokens[..91]);
        // Every sequence is full: (kept − 1) is a multiple of T.
        for n in 1..100 {
            for seq in 1..20 {
                let k = len(n, seq);
                assert_eq!((k - 1) % seq, 0);
                assert!(n - k < seq, "n {n} seq {seq} kept {k}");
            }
        }
    }
}
