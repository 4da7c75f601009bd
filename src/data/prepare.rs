//! `pipeline data prepare`: text in, challenge-format shards out.
//!
//! Inputs:
//! - `.jsonl`: one JSON object per line with a string field `text` (blank lines are skipped);
//! - `.txt` (or any other file): documents are separated by **two or more consecutive blank
//!   lines**; a single blank line is a paragraph break inside a document, so a file without
//!   such a gap is one document.
//!
//! Documents keep their input order (files in the order given). The first documents form the
//! validation split (`--val-docs N`, or `--val-frac F` of them, at least one), the rest the
//! training split, as the challenge takes its first 50,000 documents for validation. Each
//! document is stored as `[BOS] + ids`, no EOS, documents back to back, cut into shards of
//! `--shard-tokens` tokens (a document may straddle two shards). `manifest.json` records the
//! counts, the inputs and the tokenizer's sha256.
//!
//! With `--caseops` each document is first rewritten by the CaseOps transform
//! ([`crate::data::caseops`]) and tokenized with a CaseOps model (one that reserves the
//! operators; another is refused), and the val split gets a byte sidecar: beside each
//! `fineweb_val_NNNNNN.bin` a `fineweb_val_bytes_NNNNNN.bin` in the same format holding, for
//! each token, the UTF-8 bytes of the original text it stands for (BOS and operators 0), which
//! bits per byte is charged with. The manifest records the transform and the sidecars.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rayon::prelude::*;
use serde::Serialize;

use crate::data::shard::write_shard;
use crate::data::tokenizer::Tokenizer;
use crate::runtime::files::sha256_file;

/// How the validation split is chosen.
#[derive(Clone, Copy, Debug)]
pub enum ValSplit {
    /// The first N documents.
    Docs(usize),
    /// The first fraction F of the documents (at least one).
    Frac(f64),
}

/// Options of `pipeline data prepare`.
pub struct PrepareOptions {
    /// The sentencepiece model.
    pub tokenizer: PathBuf,
    /// Input files.
    pub inputs: Vec<PathBuf>,
    /// Output folder.
    pub out: PathBuf,
    /// Validation split.
    pub val: ValSplit,
    /// Tokens per shard.
    pub shard_tokens: usize,
    /// Replace shards already in `out`.
    pub force: bool,
    /// Apply the CaseOps transform and write the val byte sidecar.
    pub caseops: bool,
}

/// One split's part of the manifest.
#[derive(Debug, Serialize)]
pub struct SplitSummary {
    /// Documents.
    pub docs: usize,
    /// Tokens, BOS included.
    pub tokens: u64,
    /// UTF-8 bytes of the documents' text.
    pub text_bytes: u64,
    /// Shard file names.
    pub shards: Vec<String>,
    /// CaseOps val split: the byte sidecar file names, one per shard.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub byte_sidecars: Vec<String>,
    /// CaseOps val split: the sidecar's total, the original text's UTF-8 bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sidecar_bytes: Option<u64>,
}

/// `manifest.json`.
#[derive(Debug, Serialize)]
pub struct Manifest {
    /// Format of the shards.
    pub format: &'static str,
    /// Tool that wrote them.
    pub created_by: String,
    /// The tokenizer.
    pub tokenizer: serde_json::Value,
    /// Inputs with their sha256 and document counts.
    pub inputs: Vec<serde_json::Value>,
    /// How documents were split into val and train.
    pub split_rule: String,
    /// Tokens per shard.
    pub shard_tokens: usize,
    /// The text transform applied before tokenizing (`lossless_caps_caseops_v1`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_transform: Option<&'static str>,
    /// Validation split.
    pub val: SplitSummary,
    /// Training split.
    pub train: SplitSummary,
}

/// Splits a `.txt` file's text into documents at runs of two or more blank lines.
pub fn split_txt(text: &str) -> Vec<String> {
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut docs = Vec::new();
    let mut cur: Vec<&str> = Vec::new();
    let mut blanks = 0;
    for line in text.split('\n') {
        if line.trim().is_empty() {
            blanks += 1;
            continue;
        }
        if blanks >= 2 && !cur.is_empty() {
            docs.push(cur.join("\n").trim().to_string());
            cur.clear();
        } else if blanks == 1 && !cur.is_empty() {
            cur.push("");
        }
        blanks = 0;
        cur.push(line);
    }
    if !cur.is_empty() {
        docs.push(cur.join("\n").trim().to_string());
    }
    docs.retain(|d| !d.is_empty());
    docs
}

/// Reads the documents of one input file.
pub fn read_documents(path: &Path) -> anyhow::Result<Vec<String>> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text (invalid byte at offset {})", path.display(), e.utf8_error().valid_up_to()))?;
    if path.extension().is_some_and(|e| e == "jsonl") {
        let mut docs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("{}:{}: not a JSON object", path.display(), i + 1))?;
            let t = v
                .get("text")
                .and_then(|t| t.as_str())
                .ok_or_else(|| anyhow::anyhow!("{}:{}: no string field `text`", path.display(), i + 1))?;
            if !t.trim().is_empty() {
                docs.push(t.to_string());
            }
        }
        Ok(docs)
    } else {
        Ok(split_txt(&text))
    }
}

struct SplitWriter {
    dir: PathBuf,
    prefix: &'static str,
    shard_tokens: usize,
    buf: Vec<u16>,
    /// The byte sidecar, in step with `buf` (CaseOps val split only).
    side: Option<Vec<u16>>,
    summary: SplitSummary,
}

impl SplitWriter {
    fn new(dir: &Path, prefix: &'static str, shard_tokens: usize, sidecar: bool) -> Self {
        Self {
            dir: dir.to_path_buf(),
            prefix,
            shard_tokens,
            buf: Vec::new(),
            side: sidecar.then(Vec::new),
            summary: SplitSummary {
                docs: 0,
                tokens: 0,
                text_bytes: 0,
                shards: Vec::new(),
                byte_sidecars: Vec::new(),
                sidecar_bytes: sidecar.then_some(0),
            },
        }
    }

    /// Adds one document; `bytes` (the sidecar's counts, one per token) when the split has one.
    fn push(&mut self, doc: &[u16], text_bytes: usize, bytes: Option<&[u16]>) -> anyhow::Result<()> {
        self.summary.docs += 1;
        self.summary.tokens += doc.len() as u64;
        self.summary.text_bytes += text_bytes as u64;
        let mut rest = doc;
        let mut rest_bytes = bytes.unwrap_or_default();
        if let (Some(total), Some(b)) = (&mut self.summary.sidecar_bytes, bytes) {
            *total += b.iter().map(|&x| u64::from(x)).sum::<u64>();
        }
        while !rest.is_empty() {
            let room = self.shard_tokens - self.buf.len();
            let take = room.min(rest.len());
            self.buf.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if let Some(side) = &mut self.side {
                anyhow::ensure!(rest_bytes.len() >= take, "internal: a document's sidecar is shorter than its tokens");
                side.extend_from_slice(&rest_bytes[..take]);
                rest_bytes = &rest_bytes[take..];
            }
            if self.buf.len() == self.shard_tokens {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let name = format!("fineweb_{}_{:06}.bin", self.prefix, self.summary.shards.len());
        if let Some(side) = &mut self.side {
            // The sidecar first: a shard on disk without its sidecar would be refused.
            let side_path = crate::data::caseops::sidecar_path(&self.dir.join(&name)).expect("a shard name has a number");
            write_shard(&side_path, side)?;
            self.summary.byte_sidecars.push(side_path.file_name().expect("a file").to_string_lossy().into_owned());
            side.clear();
        }
        write_shard(&self.dir.join(&name), &self.buf)?;
        self.summary.shards.push(name);
        self.buf.clear();
        Ok(())
    }
}

/// Runs `data prepare`; returns the manifest it wrote.
pub fn prepare(opts: &PrepareOptions) -> anyhow::Result<Manifest> {
    anyhow::ensure!(!opts.inputs.is_empty(), "no --input files given");
    anyhow::ensure!(opts.shard_tokens >= 1 && opts.shard_tokens < (1 << 31), "--shard-tokens must be between 1 and 2^31 - 1");
    if let ValSplit::Frac(f) = opts.val {
        anyhow::ensure!((0.0..1.0).contains(&f), "--val-frac must be at least 0 and below 1; found {f}");
    }
    if let ValSplit::Docs(0) = opts.val {
        anyhow::bail!("--val-docs must be at least 1; found 0");
    }
    anyhow::ensure!(!opts.out.is_file(), "--out {} is a file, not a folder", opts.out.display());
    let tok = Tokenizer::load(&opts.tokenizer)?;
    anyhow::ensure!(
        !opts.caseops || tok.caseops,
        "--caseops: the tokenizer {} does not reserve the CaseOps operators U+E001..U+E004 as user-defined pieces (use a CaseOps model such as fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model)",
        opts.tokenizer.display()
    );
    anyhow::ensure!(
        opts.caseops || !tok.caseops,
        "the tokenizer {} reserves the CaseOps operators U+E001..U+E004: pass --caseops, so that the text is transformed and the val split gets its byte sidecar",
        opts.tokenizer.display()
    );

    // Read every input before touching the output folder, so a bad input leaves it as it was.
    let mut docs: Vec<String> = Vec::new();
    let mut inputs = Vec::new();
    for path in &opts.inputs {
        let d = read_documents(path)?;
        inputs.push(serde_json::json!({ "path": path.display().to_string(), "sha256": sha256_file(path)?, "docs": d.len() }));
        docs.extend(d);
    }
    let names = opts.inputs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    anyhow::ensure!(docs.len() >= 2, "{names} hold {} document(s); a val and a train split need at least 2", docs.len());
    let n_val = match opts.val {
        ValSplit::Docs(n) => {
            anyhow::ensure!(n < docs.len(), "--val-docs {n} takes all {} documents; at least one must be left for training", docs.len());
            n
        }
        ValSplit::Frac(f) => ((docs.len() as f64 * f).ceil() as usize).clamp(1, docs.len() - 1),
    };

    std::fs::create_dir_all(&opts.out).with_context(|| format!("cannot create {}", opts.out.display()))?;
    let existing: Vec<PathBuf> = std::fs::read_dir(&opts.out)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("fineweb_")))
        .collect();
    if !existing.is_empty() {
        anyhow::ensure!(opts.force, "{} already holds {} shards; pass --force to replace them", opts.out.display(), existing.len());
        for p in existing {
            std::fs::remove_file(&p).with_context(|| format!("cannot remove {}", p.display()))?;
        }
    }

    let mut val = SplitWriter::new(&opts.out, "val", opts.shard_tokens, opts.caseops);
    let mut train = SplitWriter::new(&opts.out, "train", opts.shard_tokens, false);
    // Tokenise in parallel in chunks, write in order.
    for (c, chunk) in docs.chunks(4096).enumerate() {
        let encoded: Vec<anyhow::Result<Encoded>> =
            chunk.par_iter().enumerate().map(|(i, d)| encode(&tok, d, opts.caseops && c * 4096 + i < n_val)).collect();
        for (i, (doc, text)) in encoded.into_iter().zip(chunk).enumerate() {
            let (ids, bytes) = doc.with_context(|| format!("document {}", c * 4096 + i))?;
            let w = if c * 4096 + i < n_val { &mut val } else { &mut train };
            w.push(&ids, text.len(), bytes.as_deref())?;
        }
    }
    val.flush()?;
    train.flush()?;
    let manifest = Manifest {
        format: "challenge shards: 256 x int32 header [20240520, 1, n], then n x uint16 tokens; documents are [BOS] + ids, no EOS",
        created_by: format!("pipeline {} data prepare", env!("CARGO_PKG_VERSION")),
        tokenizer: serde_json::json!({ "path": tok.path.display().to_string(), "sha256": tok.sha256, "vocab_size": tok.vocab_size, "bos_id": tok.bos }),
        inputs,
        split_rule: format!("first {n_val} documents are val, the rest train; .txt documents are separated by two or more blank lines"),
        shard_tokens: opts.shard_tokens,
        text_transform: opts.caseops.then_some(crate::data::caseops::NAME),
        val: val.summary,
        train: train.summary,
    };
    crate::runtime::rundir::write_atomic(&opts.out.join("manifest.json"), serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    Ok(manifest)
}

/// A document's tokens and, for a CaseOps val document, its byte sidecar.
pub type Encoded = (Vec<u16>, Option<Vec<u16>>);

/// One document as stored: `[BOS] + ids`, of the CaseOps-transformed text when the tokenizer
/// is a CaseOps one, and with `sidecar` its byte counts (BOS 0), which add up to the text's
/// UTF-8 length.
pub fn encode(tok: &Tokenizer, text: &str, sidecar: bool) -> anyhow::Result<Encoded> {
    if !tok.caseops {
        return Ok((tok.encode_document(text)?, None));
    }
    let transformed = crate::data::caseops::encode(text);
    let ids = tok.encode_document(&transformed)?;
    if !sidecar {
        return Ok((ids, None));
    }
    let pieces: Vec<&[u8]> = ids[1..].iter().map(|&id| tok.piece_bytes(u32::from(id))).collect();
    let counts = crate::data::caseops::piece_byte_counts(&transformed, &pieces, |f| tok.normalize_fragment(f));
    let mut bytes = Vec::with_capacity(ids.len());
    bytes.push(0);
    for (k, n) in counts.into_iter().enumerate() {
        let n = u16::try_from(n).map_err(|_| anyhow::anyhow!("token {} stands for {n} bytes, more than a uint16 sidecar holds", k + 1))?;
        bytes.push(n);
    }
    let total: u64 = bytes.iter().map(|&b| u64::from(b)).sum();
    anyhow::ensure!(total == text.len() as u64, "internal: the byte sidecar counts {total} bytes of a {}-byte document", text.len());
    Ok((ids, Some(bytes)))
}

#[cfg(test)]
mod tests {
    use super::split_txt;

    #[test]
    fn two_blank_lines_separate_documents() {
        let docs = split_txt("Para one.\n\nPara two.\n\n\nSecond doc.\r\n\r\n\r\n\r\nThird.\n");
        assert_eq!(docs, vec!["Para one.\n\nPara two.", "Second doc.", "Third."]);
        assert_eq!(split_txt("\n\n\n"), Vec::<String>::new());
        assert_eq!(split_txt("one line"), vec!["one line"]);
    }
}
