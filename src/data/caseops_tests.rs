//! Tests of the CaseOps transform and its byte counts, on text made here.

use super::*;
use crate::data::tokenizer::{Tokenizer, build_bpe_model_reserving};

/// Real-looking documents: mixed case, ALL CAPS, mixed-case words, digits, punctuation,
/// accents, CJK, emoji, whitespace runs, operator characters already in the text, U+E000.
fn documents() -> Vec<String> {
    vec![
        String::new(),
        "The NASA Launch".into(),
        "I think iPhone and McDonald's are ABCdef; XyZ!".into(),
        "THE END. A B C. x Y z. 42 apples, 3.14 pies (and 1,000 TOTAL).".into(),
        "Café au lait à Paris — Ünïcödé ÉCOLE naïve résumé Straße".into(),
        "東京 is the Capital of 日本; 한국어 텍스트 and Ελληνικά ΚΕΦΑΛΑΙΑ.".into(),
        "Emoji 😀👍🏽 and a family 👨\u{200d}👩\u{200d}👧 HERE.".into(),
        "Private use already: \u{E001}Title\u{E002}\u{E003}\u{E004}x \u{E004}\u{E004} and the sentinel \u{E000}A".into(),
        "  Leading and trailing spaces, tabs\tHere\tand\r\nnew lines\n\n\nEnd  ".into(),
        "A".into(),
        "a".into(),
        "\u{E004}".into(),
        "HTTPServer URLs like https://Example.COM/Path?Q=1 and snake_Case_NAME".into(),
        "ﬁne ligatures ＦＵＬＬ-width Ｌｅｔｔｅｒｓ and ½ fractions".into(),
    ]
}

#[test]
fn encode_then_decode_is_the_identity() {
    for doc in documents() {
        let t = encode(&doc);
        assert_eq!(decode(&t).unwrap(), doc, "{doc:?} -> {t:?}");
        assert!(!t.bytes().any(|b| b.is_ascii_uppercase()), "{t:?} keeps an ASCII capital");
    }
}

#[test]
fn encode_follows_the_word_rules() {
    let (t, a, c, e) = (TITLE, ALLCAPS, CAPNEXT, ESC);
    assert_eq!(encode("The NASA Launch"), format!("{t}the {a}nasa {t}launch"));
    assert_eq!(encode("I iPhone McDonald ABCdef"), format!("{t}i i{c}phone {t}mc{c}donald {t}a{c}b{c}cdef"));
    assert_eq!(encode("x\u{E001}y\u{E004}"), format!("x{e}\u{E001}y{e}\u{E004}"));
    assert_eq!(encode("\u{E000}Élan ÉCOLE"), format!("\u{E000}Élan É{a}cole"));
    assert_eq!(encode(""), "");
}

#[test]
fn decode_refuses_what_encode_cannot_make() {
    let bad = [
        format!("{TITLE}"),
        format!("{TITLE} x"),
        format!("{ESC}"),
        format!("a{TITLE}b"),
        format!("{CAPNEXT}{CAPNEXT}a"),
        format!("{ALLCAPS}{TITLE}a"),
        format!("{TITLE}{ESC}\u{E001}"),
    ];
    for t in bad {
        let e = decode(&t).expect_err(&format!("{t:?} decoded"));
        assert!(e.to_string().contains("not CaseOps text"), "{e}");
    }
}

#[test]
fn char_weights_add_up_to_the_original_length() {
    for doc in documents() {
        let t = encode(&doc);
        let total: u64 = char_weights(&t).iter().map(|&(_, w)| u64::from(w)).sum();
        assert_eq!(total, doc.len() as u64, "{doc:?}");
    }
    let w: Vec<u32> = char_weights(&format!("{ESC}{ESC}{TITLE}a{ESC}{TITLE}")).iter().map(|&(_, w)| w).collect();
    assert_eq!(w, vec![0, 3, 0, 1, 0, 3]);
}

#[test]
fn sidecar_names_sit_beside_their_shards() {
    let p = Path::new("/d/fineweb_val_000003.bin");
    assert_eq!(sidecar_path(p).unwrap(), Path::new("/d/fineweb_val_bytes_000003.bin"));
    assert!(sidecar_path(Path::new("/d/noseparator.bin")).is_none());
    let all = vec![p.to_path_buf(), PathBuf::from("/d/fineweb_val_bytes_000003.bin")];
    assert!(is_sidecar_of_any(&all[1], &all));
    assert!(!is_sidecar_of_any(&all[0], &all));
}

/// A small CaseOps model: the operators reserved, a few merges, byte fallback for the rest; the
/// identity normaliser, so each piece's text is exactly the transformed text it covers.
fn caseops_model(tag: &str) -> (PathBuf, Tokenizer) {
    let ops: Vec<String> = OPERATORS.iter().map(|c| c.to_string()).collect();
    let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
    let normal = ["▁the", "▁th", "th", "he", "▁a", "an", "▁", "e", "t", "h", "a", "n", "s", "o", "i", "l", "c", "p", "é"];
    let path = std::env::temp_dir().join(format!("pipeline-caseops-{tag}-{}.model", std::process::id()));
    std::fs::write(&path, build_bpe_model_reserving(&ops, &normal, &[])).unwrap();
    let tok = Tokenizer::load(&path).unwrap();
    (path, tok)
}

#[test]
fn a_model_reserving_the_operators_is_caseops() {
    let (path, tok) = caseops_model("detect");
    assert!(tok.caseops);
    assert!(crate::data::tokenizer::is_caseops(&path).unwrap());
    let plain = path.with_extension("plain.model");
    std::fs::write(&plain, crate::data::tokenizer::build_bpe_model(&["▁the", "e"], &[])).unwrap();
    assert!(!crate::data::tokenizer::is_caseops(&plain).unwrap());
    let _ = (std::fs::remove_file(path), std::fs::remove_file(plain));
}

/// Every document's pieces (encoded by the real tokenizer) get counts that add up to its
/// original UTF-8 length; operator pieces count 0; with the identity normaliser each piece
/// counts exactly the original bytes of the transformed text it holds.
#[test]
fn piece_counts_add_up_to_the_original_bytes() {
    let (path, tok) = caseops_model("counts");
    for doc in documents() {
        let t = encode(&doc);
        let ids = tok.encode(&t).unwrap();
        let pieces: Vec<&[u8]> = ids.iter().map(|&id| tok.piece_bytes(id)).collect();
        let counts = piece_byte_counts(&t, &pieces, |f| tok.normalize_fragment(f));
        assert_eq!(counts.len(), ids.len());
        assert_eq!(counts.iter().sum::<u64>(), doc.len() as u64, "{doc:?}");
        // Operator pieces count 0, but an operator escaped by the ESC piece before it is text.
        let mut escaped = false;
        for (k, &id) in ids.iter().enumerate() {
            let text = String::from_utf8_lossy(pieces[k]);
            match OPERATORS.iter().find(|op| text == op.to_string()) {
                Some(_) if escaped => (assert_eq!(counts[k], 3, "escaped operator piece {id} of {doc:?}"), escaped = false).1,
                Some(&op) => (assert_eq!(counts[k], 0, "operator piece {id} of {doc:?}"), escaped = op == ESC).1,
                None => escaped = false,
            }
        }
    }
    // By hand: "The café" -> TITLE "the café": pieces TITLE, "the", "▁c", "a", "f", "é".
    let t = encode("The café");
    let ids = tok.encode(&t).unwrap();
    let pieces: Vec<&[u8]> = ids.iter().map(|&id| tok.piece_bytes(id)).collect();
    let texts: Vec<String> = pieces.iter().map(|p| String::from_utf8_lossy(p).into_owned()).collect();
    let counts = piece_byte_counts(&t, &pieces, |f| tok.normalize_fragment(f));
    let want: Vec<u64> = texts.iter().map(|p| if p == &TITLE.to_string() { 0 } else { p.len() as u64 }).collect();
    assert_eq!(counts, want, "{texts:?}");
    assert_eq!(counts.iter().sum::<u64>(), "The café".len() as u64);
    let _ = std::fs::remove_file(path);
}

/// A normaliser that changes the text (as nmt_nfkc does): whitespace runs collapsed and the
/// ends stripped, a ligature expanded; the counts still add up and land where the text is.
#[test]
fn piece_counts_follow_a_normalised_text() {
    let normalize = |f: &str| f.replace('ﬁ', "fi").split_whitespace().collect::<Vec<_>>().join(" ");
    // Transformed "  ﬁne   \u{E001}day \n" as sentencepiece would cut its normalised "ﬁne ▁day".
    let t = format!("  ﬁne   {TITLE}day \n");
    let pieces: [&[u8]; 5] = [b"f", b"ine", b" ", "\u{E001}".as_bytes(), b"day"];
    let counts = piece_byte_counts(&t, &pieces, normalize);
    // The leading "  " (2) goes to the first match, "ﬁ" (3) to "ine", which completes its "fi";
    // the collapsed spaces to the space piece before them; the trailing " \n" to "day".
    assert_eq!(counts.iter().sum::<u64>(), decode(&t).unwrap().len() as u64);
    assert_eq!(counts, vec![0, 2 + 3 + 1 + 1, 3, 0, 3 + 2]);
    // Whitespace stripped before a leading operator goes to the text after it.
    let t = format!(" \n{TITLE}day");
    let counts = piece_byte_counts(&t, &["\u{E001}".as_bytes(), b"day"], normalize);
    assert_eq!(counts, vec![0, 2 + 3]);
}

/// Random strings over letters of both cases, operators, U+E000, spaces, digits, accents and
/// emoji: the round trip is exact and the weights add up, whatever the mix.
#[test]
fn random_strings_round_trip() {
    let alphabet: Vec<char> = "aBcDxyzXYZ \n1.,'é東😀\u{E000}\u{E001}\u{E002}\u{E003}\u{E004}".chars().collect();
    let mut rng = fastrand::Rng::with_seed(45);
    for _ in 0..3000 {
        let s: String = (0..rng.usize(0..24)).map(|_| alphabet[rng.usize(0..alphabet.len())]).collect();
        let t = encode(&s);
        assert_eq!(decode(&t).unwrap(), s, "{s:?} -> {t:?}");
        assert_eq!(char_weights(&t).iter().map(|&(_, w)| w as usize).sum::<usize>(), s.len(), "{s:?}");
    }
}
