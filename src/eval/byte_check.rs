//! The validation's byte count checked against its text: the challenge's score divides by the
//! bytes of the validation text, which the rule of spec 2.2 counts from the tokenizer's pieces
//! ([`ByteTables`]) or a CaseOps byte sidecar. A tokenizer whose table is wrong scores a
//! better bpb than it earns (openai/parameter-golf#897: a model without the bare `▁` piece
//! under-counts). This check decodes each validation document with the tokenizer (and undoes
//! CaseOps where the model is a CaseOps one) and compares its UTF-8 bytes with what the rule
//! counted for its targets, document by document.
//!
//! A byte sidecar counts the original text, before the tokenizer's normaliser folded its
//! whitespace runs and NFKC forms, which decoding cannot restore: there the documents may differ
//! by what the normaliser removed, and the check asks the totals to agree within
//! [`SIDECAR_TOLERANCE`] (a sidecar that also charged the CaseOps operators, 3 bytes each,
//! would be several percent over). The first document that differs is still named.
//!
//! A document is what lies between two BOS tokens; its targets are its tokens after the BOS and
//! the next BOS (which the rule counts as 0 bytes). Its first space (the leading `▁` of the piece after a boundary) the rule does not count,
//! so neither does the decoded text. The last document, cut by `train.val_max_tokens`, is
//! compared as far as it goes (a CaseOps cut inside an escape is left out, and said).

use std::path::PathBuf;

use serde::Serialize;

use super::bpb::ByteTables;
use super::validation::{ValSettings, Validator};
use crate::data::tokenizer::Tokenizer;

/// The first document whose counts differ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// Document index in the scored stream (0: the first after a BOS).
    pub document: usize,
    /// The stream position of its BOS.
    pub bos_at: usize,
    /// Bytes the rule counted for its targets.
    pub counted: u64,
    /// Bytes of its decoded text.
    pub decoded: u64,
    /// The start of its text (for the message).
    pub text: String,
}

/// What the check found.
#[derive(Clone, Debug, Serialize)]
pub struct ByteCheck {
    /// The tokenizer.
    pub tokenizer: PathBuf,
    /// Where the rule's counts come from: "the tokenizer's pieces" or "the byte sidecar".
    pub source: String,
    /// The model holds the bare `▁` piece (later records assert it).
    pub space_piece: bool,
    /// Targets scored.
    pub targets: u64,
    /// Their bytes by the rule: the denominator of the score.
    pub counted_bytes: u64,
    /// Documents compared.
    pub documents: usize,
    /// Their bytes by the rule.
    pub compared_counted: u64,
    /// Their decoded text's bytes.
    pub compared_decoded: u64,
    /// Documents left out (text before the first BOS; a CaseOps cut that does not decode).
    pub skipped: usize,
    /// The first document that differs.
    pub first_mismatch: Option<Mismatch>,
}

impl ByteCheck {
    /// Every compared document agrees, at least one was compared, and a table without a
    /// sidecar has the `▁` piece.
    pub fn passed(&self) -> bool {
        let agree = if self.source == PIECES {
            self.first_mismatch.is_none()
        } else {
            (self.compared_counted as f64 - self.compared_decoded as f64).abs() <= SIDECAR_TOLERANCE * self.compared_decoded as f64
        };
        agree && self.documents > 0 && (self.space_piece || self.source != PIECES)
    }

    /// The figure of the check's line.
    pub fn figure(&self) -> String {
        let mut s = format!(
            "{} bytes over {} targets ({}), {}; {} documents decoded to {} bytes, counted {}",
            self.counted_bytes,
            self.targets,
            self.source,
            if self.space_piece { "the `▁` piece present" } else { "NO bare `▁` piece" },
            self.documents,
            self.compared_decoded,
            self.compared_counted
        );
        if self.skipped > 0 {
            s += &format!(" ({} left out)", self.skipped);
        }
        if self.source != PIECES {
            s += &format!(
                " ({:+.2}%: the sidecar counts the text before the normaliser, within {}% allowed)",
                (self.compared_counted as f64 / self.compared_decoded.max(1) as f64 - 1.0) * 100.0,
                SIDECAR_TOLERANCE * 100.0
            );
        }
        if let Some(m) = &self.first_mismatch {
            s += &format!(
                "; document {} (BOS at {}) decodes to {} bytes but counts {}: {:?}",
                m.document, m.bos_at, m.decoded, m.counted, m.text
            );
        }
        s
    }
}

const PIECES: &str = "the tokenizer's pieces";

/// How far a byte sidecar's total may lie from the decoded text's (a fraction of it): the
/// original text's whitespace and NFKC forms that the normaliser folded.
pub const SIDECAR_TOLERANCE: f64 = 0.01;

/// Checks the byte count of the validation `settings` score (the run's `[data]` and
/// `train.val_max_tokens`).
pub fn check(settings: &ValSettings) -> anyhow::Result<ByteCheck> {
    let path = settings.tokenizer.clone().ok_or_else(|| anyhow::anyhow!("`data.tokenizer` is not set: bytes cannot be counted"))?;
    let tokenizer = Tokenizer::load(&path)?;
    let validator = Validator::load(settings, 1)?;
    check_stream(&tokenizer, validator.tokens(), validator.tables())
}

/// [`check`] on a stream of `N + 1` tokens and its tables.
pub fn check_stream(tokenizer: &Tokenizer, tokens: &[u32], tables: &ByteTables) -> anyhow::Result<ByteCheck> {
    anyhow::ensure!(tokens.len() >= 2, "the validation stream has {} tokens: nothing is scored", tokens.len());
    let n = tokens.len() - 1;
    let counted_bytes = tables.bytes_at(0, &tokens[..n], &tokens[1..]);
    let mut out = ByteCheck {
        tokenizer: tokenizer.path.clone(),
        source: if tables.stream_bytes.is_some() { "the byte sidecar".into() } else { PIECES.into() },
        space_piece: tables.has_space_piece,
        targets: n as u64,
        counted_bytes,
        documents: 0,
        compared_counted: 0,
        compared_decoded: 0,
        skipped: 0,
        first_mismatch: None,
    };
    let bos: Vec<usize> = tokens.iter().enumerate().filter(|(_, t)| **t == tokenizer.bos).map(|(i, _)| i).collect();
    if bos.first() != Some(&0) {
        out.skipped += 1;
    }
    for (d, &b) in bos.iter().enumerate() {
        let end = bos.get(d + 1).copied().unwrap_or(tokens.len());
        let (first, last) = (b + 1, end);
        if first >= last {
            continue;
        }
        // Targets `b ..= end - 1` predict tokens `b + 1 ..= end`: the document's tokens, then the
        // next BOS (0 bytes by the rule: a table that charges it differs from the text).
        let targets_end = (end + 1).min(tokens.len());
        let counted = tables.bytes_at(b, &tokens[b..targets_end - 1], &tokens[first..targets_end]);
        let mut text = tokenizer.decode_bytes(&tokens[first..last])?;
        if text.first() == Some(&b' ') && tables.leading_space.get(tokens[first] as usize).copied().unwrap_or(false) {
            text.remove(0);
        }
        if tokenizer.caseops {
            match crate::data::caseops::decode(&String::from_utf8_lossy(&text)) {
                Ok(original) => text = original.into_bytes(),
                Err(_) if end == tokens.len() => {
                    out.skipped += 1;
                    continue;
                }
                Err(e) => anyhow::bail!("validation document {d} (BOS at {b}) is not CaseOps text: {e}"),
            }
        }
        out.documents += 1;
        out.compared_counted += counted;
        out.compared_decoded += text.len() as u64;
        if counted != text.len() as u64 && out.first_mismatch.is_none() {
            out.first_mismatch = Some(Mismatch {
                document: d,
                bos_at: b,
                counted,
                decoded: text.len() as u64,
                text: String::from_utf8_lossy(&text[..text.len().min(60)]).into_owned(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NORMAL: [&str; 12] = ["▁the", "▁th", "▁t", "th", "he", "▁a", "an", "▁", "é", "e", "t", "a"];

    /// A tiny byte-fallback model (ids: 0-3 specials, BOS 1, 4-259 bytes, then [`NORMAL`]);
    /// without `with_space` the bare `▁` piece is a placeholder.
    struct Model {
        path: PathBuf,
        tok: Tokenizer,
    }

    impl Model {
        fn new(tag: &str, with_space: bool) -> Self {
            let normal: Vec<&str> = NORMAL.iter().map(|p| if *p == "▁" && !with_space { "zz" } else { p }).collect();
            let path = std::env::temp_dir().join(format!("pipeline-byte-check-{tag}-{}.model", std::process::id()));
            std::fs::write(&path, crate::data::tokenizer::build_bpe_model(&normal, &[])).unwrap();
            let tok = Tokenizer::load(&path).unwrap();
            Self { path, tok }
        }

        /// BOS + each text's ids, and the texts' bytes.
        fn stream(&self, texts: &[&str]) -> (Vec<u32>, u64) {
            let mut s = Vec::new();
            for t in texts {
                s.push(self.tok.bos);
                s.extend(self.tok.encode(t).unwrap());
            }
            (s, texts.iter().map(|t| t.len() as u64).sum())
        }
    }

    impl Drop for Model {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    const TEXTS: [&str; 3] = ["the hat at the tent", "an é at a  thé", "eta the"];

    #[test]
    fn a_sound_table_counts_the_decoded_bytes() {
        let m = Model::new("sound", true);
        let (tokens, bytes) = m.stream(&TEXTS);
        let tables = ByteTables::from_model_file(&m.path, 0).unwrap();
        let c = check_stream(&m.tok, &tokens, &tables).unwrap();
        assert!(c.passed(), "{}", c.figure());
        assert_eq!((c.documents, c.skipped, c.counted_bytes, c.compared_decoded), (3, 0, bytes, bytes), "{c:?}");
        // A stream cut in the middle of a document compares what is there; text before the
        // first BOS is left out.
        let c = check_stream(&m.tok, &tokens[3..tokens.len() - 2], &tables).unwrap();
        assert!(c.passed() && c.documents == 2 && c.skipped == 1, "{c:?}");
    }

    /// A table one byte short on `▁the` is caught at the first document holding it, with
    /// both counts; a model without the bare `▁` piece fails whatever its counts.
    #[test]
    fn a_wrong_table_and_a_missing_space_piece_are_caught() {
        let m = Model::new("wrong", true);
        let (tokens, _) = m.stream(&["at a tent", "a the hat", "eta"]);
        let mut tables = ByteTables::from_model_file(&m.path, 0).unwrap();
        let the = 260 + NORMAL.iter().position(|p| *p == "▁the").unwrap();
        assert!(tokens.contains(&(the as u32)), "{tokens:?}");
        tables.base_bytes[the] -= 1;
        let c = check_stream(&m.tok, &tokens, &tables).unwrap();
        let bad = c.first_mismatch.clone().expect("caught");
        let second_bos = tokens.iter().enumerate().filter(|(_, t)| **t == m.tok.bos).nth(1).unwrap().0;
        assert_eq!((bad.document, bad.bos_at, bad.counted + 1, bad.decoded), (1, second_bos, 9, 9), "{c:?}");
        let want = format!("document 1 (BOS at {second_bos}) decodes to 9 bytes but counts 8: \"a the hat\"");
        assert!(!c.passed() && c.figure().contains(&want), "{}", c.figure());
        // A table that charges the BOS a byte is caught at the first document before a BOS.
        let mut tables = ByteTables::from_model_file(&m.path, 0).unwrap();
        tables.base_bytes[m.tok.bos as usize] = 1;
        let c = check_stream(&m.tok, &tokens, &tables).unwrap();
        assert!(!c.passed() && c.first_mismatch.as_ref().is_some_and(|x| x.document == 0 && x.counted == x.decoded + 1), "{}", c.figure());
        let m = Model::new("nospace", false);
        let (tokens, _) = m.stream(&TEXTS);
        let c = check_stream(&m.tok, &tokens, &ByteTables::from_model_file(&m.path, 0).unwrap()).unwrap();
        assert!(!c.space_piece && !c.passed() && c.figure().contains("NO bare `▁` piece"), "{}", c.figure());
    }

    /// A sidecar (per-token bytes of the original text) is held to its total: one within 1%
    /// of the decoded text passes, naming the document that differs; one charging 3 more bytes
    /// on every tenth token (CaseOps operators counted) fails.
    #[test]
    fn a_sidecar_is_held_to_its_total() {
        let m = Model::new("sidecar", true);
        let texts: Vec<&str> = TEXTS.iter().cycle().take(12).copied().collect();
        let (tokens, _) = m.stream(&texts);
        let tables = ByteTables::from_model_file(&m.path, 0).unwrap();
        let mut side: Vec<u16> =
            std::iter::once(0).chain((1..tokens.len()).map(|i| tables.bytes_at(i - 1, &tokens[i - 1..i], &tokens[i..=i]) as u16)).collect();
        let c = check_stream(&m.tok, &tokens, &tables.clone().with_stream_bytes(side.clone())).unwrap();
        assert!(c.passed() && c.source == "the byte sidecar" && c.first_mismatch.is_none(), "{}", c.figure());
        // The original had one more space than the normaliser kept: named, within 1%.
        let last = side.len() - 1;
        side[last] += 1;
        let c = check_stream(&m.tok, &tokens, &tables.clone().with_stream_bytes(side.clone())).unwrap();
        assert!(c.passed() && c.first_mismatch.as_ref().is_some_and(|x| x.document == 11), "{}", c.figure());
        for b in side.iter_mut().step_by(10) {
            *b += 3;
        }
        let c = check_stream(&m.tok, &tokens, &tables.with_stream_bytes(side)).unwrap();
        assert!(!c.passed() && c.figure().contains("within 1% allowed"), "{}", c.figure());
    }
}
