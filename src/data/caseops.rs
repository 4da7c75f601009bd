//! CaseOps (`lossless_caps_caseops_v1`), the 04-27 record's reversible case transform, and the
//! per-token original byte counts (the validation "byte sidecar") that keep bits per byte
//! charged on the text as it was before the transform.
//!
//! **The transform.** Four private-use characters are case operators: TITLE U+E001, ALLCAPS
//! U+E002, CAPNEXT U+E003 and ESC U+E004 (a CaseOps sentencepiece model reserves them as
//! user-defined pieces). [`encode`] looks at maximal runs of ASCII letters `[A-Za-z]+` (a
//! "word"; anything else, non-ASCII letters included, ends a word and is copied unchanged):
//! - an all-lowercase word is copied;
//! - an all-uppercase word of two or more letters becomes `ALLCAPS` + the word in lowercase;
//! - an uppercase letter followed only by lowercase letters (or alone) becomes `TITLE` + the
//!   word in lowercase;
//! - any other word is written in lowercase, preceded by `TITLE` if its first letter is
//!   uppercase, with `CAPNEXT` before every later letter that is uppercase;
//! - an operator character already in the text is escaped as `ESC` + the character.
//!
//! [`decode`] inverts it exactly, `decode(encode(x)) == x` for every string, and refuses a
//! string `encode` cannot produce (an operator not followed by a letter, a dangling `ESC`, ...)
//! with what is wrong. U+E000, the sentinel of the older `lossless_caps_v1`, is not an operator
//! here: it is copied like any other character.
//!
//! **Original bytes.** Every character of the transformed text stands for a number of bytes of
//! the original UTF-8 text ([`char_weights`]): an operator or `ESC` stands for none, the
//! character an `ESC` escapes for its own UTF-8 length, every other character for its UTF-8
//! length (a letter lowered by the transform is still one byte). The weights of a transformed
//! document add up to the original document's UTF-8 length.
//!
//! **Per-piece counts.** [`piece_byte_counts`] gives each sentencepiece piece of a transformed
//! document the weights of the characters it covers. The pieces' text (U+2581 read as a space,
//! byte pieces as their byte) is the *normalised* transformed text, so it is aligned with the
//! transformed text character by character: equal characters (any whitespace matching a
//! space) go to the piece holding them; a run of up to four characters whose normalisation (the
//! tokenizer's) equals the next piece text goes to the piece that completes it; a character the
//! normaliser drops (extra whitespace, zero-width characters) goes to the piece of the match
//! before it, as sentencepiece's surfaces do; a character split into byte pieces goes to its
//! last byte piece; characters before the first match go to the first piece of text matched
//! (never to an operator). Every character's weight lands on exactly one piece, so the counts of a
//! document always add up to its original UTF-8 length, operator pieces count 0, and the
//! document's BOS (not a piece) counts 0. This matches the record's
//! `surface_piece_original_byte_counts` on sentencepiece's surfaces, except that sentencepiece
//! charges nobody for whitespace it strips at a document's start and end; here it is charged to
//! the first and last piece, so that the sidecar's total is the original text's length.

#[cfg(feature = "tools")]
use std::borrow::Cow;
use std::path::{Path, PathBuf};

/// Capitalise the first letter of the word that follows.
pub const TITLE: char = '\u{E001}';
/// Capitalise every letter of the word that follows.
pub const ALLCAPS: char = '\u{E002}';
/// Capitalise the next letter (inside a word).
pub const CAPNEXT: char = '\u{E003}';
/// The next character is literal text.
pub const ESC: char = '\u{E004}';
/// The operators, which a CaseOps tokenizer reserves as user-defined pieces.
pub const OPERATORS: [char; 4] = [TITLE, ALLCAPS, CAPNEXT, ESC];
/// The transform's name in the record's code and in our manifests.
#[cfg(feature = "tools")]
pub const NAME: &str = "lossless_caps_caseops_v1";

#[cfg(feature = "tools")]
fn is_operator(c: char) -> bool {
    OPERATORS.contains(&c)
}

/// The transformed text of `text` (see the module doc).
#[cfg(feature = "tools")]
pub fn encode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + text.len() / 16 + 4);
    let mut i = 0;
    while i < bytes.len() {
        if !bytes[i].is_ascii_alphabetic() {
            let c = text[i..].chars().next().unwrap_or_default();
            if is_operator(c) {
                out.push(ESC);
            }
            out.push(c);
            i += c.len_utf8();
            continue;
        }
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        push_word(&mut out, &text[start..i]);
    }
    out
}

/// Appends one ASCII word in its transformed form.
#[cfg(feature = "tools")]
fn push_word(out: &mut String, word: &str) {
    let b = word.as_bytes();
    let (first, rest) = (b[0], &b[1..]);
    if b.iter().all(u8::is_ascii_lowercase) {
        out.push_str(word);
    } else if b.len() >= 2 && b.iter().all(u8::is_ascii_uppercase) {
        out.push(ALLCAPS);
        out.push_str(&word.to_ascii_lowercase());
    } else if first.is_ascii_uppercase() && rest.iter().all(u8::is_ascii_lowercase) {
        out.push(TITLE);
        out.push_str(&word.to_ascii_lowercase());
    } else {
        if first.is_ascii_uppercase() {
            out.push(TITLE);
        }
        out.push(char::from(first.to_ascii_lowercase()));
        for &c in rest {
            if c.is_ascii_uppercase() {
                out.push(CAPNEXT);
            }
            out.push(char::from(c.to_ascii_lowercase()));
        }
    }
}

/// The original text of a transformed `text`; an error says what is malformed and where
/// (character index) if `text` is not something [`encode`] produces.
#[cfg(feature = "tools")]
pub fn decode(text: &str) -> anyhow::Result<String> {
    #[derive(PartialEq)]
    enum Word {
        Title,
        AllCaps,
    }
    let mut out = String::with_capacity(text.len());
    let (mut escape, mut capnext, mut in_word, mut allcaps) = (false, false, false, false);
    let mut pending: Option<Word> = None;
    for (at, c) in text.chars().enumerate() {
        let bad = |what: &str| anyhow::anyhow!("not CaseOps text: {what} at character {at}");
        if escape {
            if pending.is_some() && !c.is_ascii_alphabetic() {
                return Err(bad("an escaped character where a TITLE or ALLCAPS word should start"));
            }
            out.push(c);
            escape = false;
            in_word = c.is_ascii_alphabetic();
            allcaps &= in_word;
            continue;
        }
        match c {
            ESC => escape = true,
            TITLE | ALLCAPS => {
                if pending.is_some() || in_word || capnext {
                    return Err(bad("a TITLE or ALLCAPS operator inside a word or after another operator"));
                }
                pending = Some(if c == TITLE { Word::Title } else { Word::AllCaps });
            }
            CAPNEXT => {
                if capnext {
                    return Err(bad("two CAPNEXT operators in a row"));
                }
                capnext = true;
            }
            c if c.is_ascii_alphabetic() => {
                let upper = if in_word {
                    if pending.is_some() {
                        return Err(bad("a TITLE or ALLCAPS operator inside a word"));
                    }
                    allcaps || capnext
                } else {
                    allcaps = pending == Some(Word::AllCaps);
                    in_word = true;
                    pending.take().is_some() || capnext
                };
                capnext = false;
                out.push(if upper { c.to_ascii_uppercase() } else { c });
            }
            c => {
                if pending.is_some() || capnext {
                    return Err(bad("a case operator not followed by an ASCII letter"));
                }
                out.push(c);
                in_word = false;
                allcaps = false;
            }
        }
    }
    let end = text.chars().count();
    anyhow::ensure!(!escape, "not CaseOps text: a dangling ESC at the end (character {end})");
    anyhow::ensure!(pending.is_none() && !capnext, "not CaseOps text: a dangling case operator at the end (character {end})");
    Ok(out)
}

/// Each character of a transformed `text` with the original UTF-8 bytes it stands for (module
/// doc): 0 for an operator or `ESC`, the character's UTF-8 length otherwise (an escaped
/// operator included). Their sum is the original text's UTF-8 length.
#[cfg(feature = "tools")]
pub fn char_weights(text: &str) -> Vec<(char, u32)> {
    let mut escape = false;
    text.chars()
        .map(|c| {
            let w = if escape || !is_operator(c) { c.len_utf8() as u32 } else { 0 };
            escape = !escape && c == ESC;
            (c, w)
        })
        .collect()
}

/// Per-piece original byte counts of one transformed document (module doc): `pieces[k]` is the
/// text of the document's k-th piece as the tokenizer emitted it (U+2581 as a space, a byte
/// piece as its byte), `normalize` the tokenizer's normalisation of a fragment in the middle of
/// a text. Returns one count per piece, adding up to the original UTF-8 length (the sum of
/// [`char_weights`]); an empty document has no pieces and no counts. The alignment never fails:
/// where it cannot match it moves on, keeping every character's weight on some piece.
#[cfg(feature = "tools")]
pub fn piece_byte_counts(transformed: &str, pieces: &[&[u8]], normalize: impl Fn(&str) -> String) -> Vec<u64> {
    let text = char_weights(transformed);
    let mut counts = vec![0u64; pieces.len()];
    if pieces.is_empty() {
        return counts;
    }
    let norm = piece_chars(pieces);
    let (mut i, mut j) = (0, 0);
    // The piece of the last match, and the weight seen before any match.
    let (mut last, mut pending) = (None::<usize>, 0u64);
    while i < text.len() && j < norm.len() {
        let (tc, tw) = text[i];
        let (pc, owner) = norm[j];
        if tc == pc || (pc == ' ' && tc.is_whitespace()) {
            charge(&mut counts, &mut pending, &mut last, owner, u64::from(tw));
            (i, j) = (i + 1, j + 1);
        } else if tc.is_whitespace() || normalize(&tc.to_string()).is_empty() {
            // Dropped by the normaliser: part of the span of the piece before.
            match last {
                Some(o) => counts[o] += u64::from(tw),
                None => pending += u64::from(tw),
            }
            i += 1;
        } else if let Some((k, len)) = normalized_match(&text[i..], &norm[j..], &normalize) {
            let w = text[i..i + k].iter().map(|&(_, w)| u64::from(w)).sum::<u64>();
            charge(&mut counts, &mut pending, &mut last, norm[j + len - 1].1, w);
            (i, j) = (i + k, j + len);
        } else if pc == ' ' {
            // A space the normaliser made with no counterpart here.
            j += 1;
        } else {
            // No match at all: charged to the piece at hand, and both move on.
            charge(&mut counts, &mut pending, &mut last, owner, u64::from(tw));
            (i, j) = (i + 1, j + 1);
        }
    }
    // After the last match: whitespace the normaliser stripped at the end (or everything, if
    // nothing matched).
    let rest = pending + text[i..].iter().map(|&(_, w)| u64::from(w)).sum::<u64>();
    counts[last.unwrap_or(0)] += rest;
    counts
}

/// Charges `w` to piece `owner`, now the last match, and with the first text (`w > 0`, not an
/// operator) what was pending before it.
#[cfg(feature = "tools")]
fn charge(counts: &mut [u64], pending: &mut u64, last: &mut Option<usize>, owner: usize, w: u64) {
    counts[owner] += w;
    if w > 0 {
        counts[owner] += std::mem::take(pending);
    }
    *last = Some(owner);
}

/// `Some((k, len))` when the normalisation of the first `k` (1 to 4) characters of `text` is
/// the first `len ≥ 1` characters of `norm`.
#[cfg(feature = "tools")]
fn normalized_match(text: &[(char, u32)], norm: &[(char, usize)], normalize: &impl Fn(&str) -> String) -> Option<(usize, usize)> {
    let mut frag = String::new();
    for k in 1..=text.len().min(4) {
        frag.push(if text[k - 1].0 == '\t' { ' ' } else { text[k - 1].0 });
        let n: Vec<char> = normalize(&frag).chars().map(|c| if c == '\u{2581}' { ' ' } else { c }).collect();
        if !n.is_empty() && n.len() <= norm.len() && n.iter().zip(norm).all(|(a, (b, _))| a == b) {
            return Some((k, n.len()));
        }
    }
    None
}

/// The characters of the pieces' concatenated text, each with the index of the piece that
/// completes it (a character split into byte pieces belongs to its last byte); bytes that are
/// not valid UTF-8 become U+FFFD.
#[cfg(feature = "tools")]
fn piece_chars(pieces: &[&[u8]]) -> Vec<(char, usize)> {
    let mut out = Vec::new();
    let mut buf: Vec<u8> = Vec::with_capacity(4);
    for (k, p) in pieces.iter().enumerate() {
        for &b in p.iter() {
            if !buf.is_empty() && (b & 0xC0) != 0x80 {
                // A new sequence starts before the last one was complete.
                out.push(('\u{FFFD}', k));
                buf.clear();
            }
            buf.push(b);
            let need = match buf[0] {
                0x00..=0x7F => 1,
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            if buf.len() == need {
                let c = std::str::from_utf8(&buf).ok().and_then(|s| s.chars().next()).unwrap_or('\u{FFFD}');
                out.push((c, k));
                buf.clear();
            }
        }
    }
    if !buf.is_empty() {
        out.push(('\u{FFFD}', pieces.len() - 1));
    }
    out
}

/// The text a sentencepiece piece stands for in a transformed document: U+2581 as a space.
#[cfg(feature = "tools")]
pub fn piece_text(piece: &str) -> Cow<'_, str> {
    if piece.contains('\u{2581}') { Cow::Owned(piece.replace('\u{2581}', " ")) } else { Cow::Borrowed(piece) }
}

/// The byte sidecar of the token shard `shard`: `NAME_bytes_NNNNNN.bin` beside
/// `NAME_NNNNNN.bin` (the record's `fineweb_val_bytes_000000.bin` beside
/// `fineweb_val_000000.bin`); `None` for a file name without a `_` before its number.
pub fn sidecar_path(shard: &Path) -> Option<PathBuf> {
    let name = shard.file_name()?.to_str()?;
    let (stem, number) = name.rsplit_once('_')?;
    Some(shard.with_file_name(format!("{stem}_bytes_{number}")))
}

/// Whether `path` is named as the sidecar of another of `paths` (a glob such as
/// `fineweb_val_*.bin` matches the sidecars too; they are not token shards).
pub fn is_sidecar_of_any(path: &Path, paths: &[PathBuf]) -> bool {
    paths.iter().any(|p| p != path && sidecar_path(p).as_deref() == Some(path))
}

#[cfg(test)]
#[path = "caseops_tests.rs"]
mod tests;
