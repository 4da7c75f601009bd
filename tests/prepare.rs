//! `pipeline data prepare` through the real binary, with a tiny BPE sentencepiece model built
//! here (specials, 256 byte pieces, a few merges). Checks what the shards hold against what the
//! manifest says and against the input text; then one test per kind of bad input, each of which
//! must exit non-zero without a panic and name the file or flag at fault.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{Dir, assert_fails, bin, scratch, text};
use pipeline::data::shard::{AccessMode, ShardFile};
use pipeline::data::tokenizer::Tokenizer;

const BOS: u16 = 1;
const EOS: u16 = 2;

/// Writes a tiny BPE sentencepiece model: `<pad> <s> </s> <unk>`, the byte pieces
/// `<0x00>..<0xFF>` (ids 4..259), then a few merges; identity normaliser, no dummy prefix.
fn write_model(path: &Path) {
    let normal = ["▁the", "▁th", "▁t", "th", "he", "▁", "e", "t", "h", "a", "o", "n", "s"];
    std::fs::write(path, pipeline::data::tokenizer::build_bpe_model(&normal, &[])).unwrap();
}

/// A scratch directory holding `tiny.model`; returns (directory, model path).
fn setup(name: &str) -> (Dir, PathBuf) {
    let dir = Dir(scratch(&format!("prepare-{name}")));
    let model = dir.join("tiny.model");
    write_model(&model);
    (dir, model)
}

/// Runs `pipeline data prepare --tokenizer MODEL --out OUT --input ...` plus `args`.
fn prepare(model: &Path, out: &Path, inputs: &[&Path], args: &[&str]) -> Output {
    let mut c = bin();
    c.args(["data", "prepare", "--tokenizer"]).arg(model).arg("--out").arg(out).arg("--input");
    c.args(inputs).args(args);
    c.output().expect("the binary runs")
}

fn assert_ok(o: &Output) {
    assert_eq!(o.status.code(), Some(0), "{}", text(o));
}

/// All tokens of one shard.
fn shard_tokens(path: &Path) -> Vec<u16> {
    let f = ShardFile::open(path, 0, AccessMode::Pread).unwrap_or_else(|e| panic!("{e}"));
    let mut out = vec![0u16; f.tokens as usize];
    f.read(0, &mut out).unwrap();
    out
}

fn manifest(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
}

/// The split's shard names as the manifest lists them, checked to exist in sorted order.
fn split_shards(out: &Path, split: &str) -> Vec<PathBuf> {
    let names: Vec<String> = manifest(out)[split]["shards"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    let mut on_disk: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("fineweb_{split}_")))
        .collect();
    on_disk.sort();
    assert_eq!(names, on_disk, "manifest's {split} shards vs the folder");
    names.iter().map(|n| out.join(n)).collect()
}

/// The split's tokens, shards concatenated in order.
fn split_tokens(out: &Path, split: &str) -> Vec<u16> {
    split_shards(out, split).iter().flat_map(|p| shard_tokens(p)).collect()
}

/// Cuts a token stream into documents at each BOS (the stream must start with one).
fn documents(tokens: &[u16]) -> Vec<&[u16]> {
    assert_eq!(tokens.first(), Some(&BOS), "the stream does not start with BOS");
    let starts: Vec<usize> = tokens.iter().enumerate().filter(|(_, t)| **t == BOS).map(|(i, _)| i).collect();
    starts.iter().enumerate().map(|(k, &s)| &tokens[s..starts.get(k + 1).copied().unwrap_or(tokens.len())]).collect()
}

/// Documents of the jsonl input, in order.
const JSONL_DOCS: [&str; 3] =
    ["the theater then", "Hello, world! Numbers 0123456789 and punctuation ;:?", "Line one\nline two with  two spaces"];

/// Documents of the txt input as the txt file is split (a single blank line stays inside).
const TXT_DOCS: [&str; 3] = ["First txt document.\n\nStill the first, after one blank line.", "Second txt document.", "Third: the end"];

/// Writes `docs.jsonl` and `docs.txt` holding [`JSONL_DOCS`] and [`TXT_DOCS`].
fn write_inputs(dir: &Path) -> (PathBuf, PathBuf) {
    let jsonl = dir.join("docs.jsonl");
    let lines: Vec<String> = JSONL_DOCS.iter().map(|d| serde_json::json!({ "id": 7, "text": d }).to_string()).collect();
    std::fs::write(&jsonl, lines.join("\n\n") + "\n").unwrap();
    let txt = dir.join("docs.txt");
    std::fs::write(&txt, format!("\n{}\n\n\n{}\n\n\n\n{}\n", TXT_DOCS[0], TXT_DOCS[1], TXT_DOCS[2])).unwrap();
    (jsonl, txt)
}

/// A `.txt` input with `n` documents of ~60 tokens each.
fn write_many_docs(dir: &Path, n: usize) -> PathBuf {
    let p = dir.join("many.txt");
    let docs: Vec<String> = (0..n).map(|i| format!("Document number {i}: the other thing, then another one.")).collect();
    std::fs::write(&p, docs.join("\n\n\n")).unwrap();
    p
}

#[test]
fn tiny_model_loads_and_round_trips() {
    let (_dir, model) = setup("model");
    let tok = Tokenizer::load(&model).unwrap();
    assert_eq!((tok.vocab_size, tok.bos), (273, 1));
    let ids = tok.encode("the then").unwrap();
    assert!(ids.contains(&260), "`▁the`/`the` merges unused: {ids:?}");
    assert!(ids.iter().all(|&i| i >= 3 && (i as usize) < tok.vocab_size), "{ids:?}");
    assert_eq!(tok.decode(&ids).unwrap(), "the then");
    let doc = tok.encode_document("é\n").unwrap();
    assert_eq!(doc[0], BOS);
    assert_eq!(tok.decode(&doc[1..].iter().map(|&t| t as u32).collect::<Vec<_>>()).unwrap(), "é\n");
}

#[test]
fn jsonl_and_txt_become_shards_matching_the_manifest() {
    let (dir, model) = setup("basic");
    let (jsonl, txt) = write_inputs(&dir);
    let out = dir.join("out");
    assert_ok(&prepare(&model, &out, &[&jsonl, &txt], &[]));

    let (val, train) = (split_tokens(&out, "val"), split_tokens(&out, "train"));
    let m = manifest(&out);
    let tok = Tokenizer::load(&model).unwrap();
    assert_eq!(m["tokenizer"]["sha256"], tok.sha256.as_str());
    assert_eq!(m["tokenizer"]["vocab_size"], tok.vocab_size);
    // 6 documents, default --val-frac 0.05: ceil(0.3) = 1 in val.
    let (val_docs, train_docs) = (documents(&val), documents(&train));
    assert_eq!((val_docs.len(), train_docs.len()), (1, 5));
    assert_eq!(m["val"]["docs"], 1);
    assert_eq!(m["train"]["docs"], 5);
    assert_eq!(m["val"]["tokens"], val.len());
    assert_eq!(m["train"]["tokens"], train.len());
    assert_eq!(m["inputs"][0]["docs"], 3);
    assert_eq!(m["inputs"][1]["docs"], 3);

    assert!(!val.contains(&EOS) && !train.contains(&EOS), "EOS in the shards");
    assert!(val.iter().chain(&train).all(|&t| (t as usize) < tok.vocab_size));
    let want: Vec<&str> = JSONL_DOCS.iter().chain(&TXT_DOCS).copied().collect();
    for (i, (doc, want)) in val_docs.iter().chain(&train_docs).zip(&want).enumerate() {
        let ids: Vec<u32> = doc[1..].iter().map(|&t| t as u32).collect();
        assert_eq!(tok.decode(&ids).unwrap(), *want, "document {i}");
    }
}

#[test]
fn val_docs_puts_exactly_n_documents_in_val() {
    let (dir, model) = setup("val-docs");
    let input = write_many_docs(&dir, 10);
    let out = dir.join("out");
    assert_ok(&prepare(&model, &out, &[&input], &["--val-docs", "3"]));
    let count_bos = |split| split_tokens(&out, split).iter().filter(|&&t| t == BOS).count();
    assert_eq!(count_bos("val"), 3);
    assert_eq!(count_bos("train"), 7);
    assert_eq!(manifest(&out)["val"]["docs"], 3);
}

#[test]
fn small_shard_tokens_split_the_same_stream() {
    let (dir, model) = setup("shard-tokens");
    let input = write_many_docs(&dir, 12);
    let (one, many) = (dir.join("one"), dir.join("many"));
    assert_ok(&prepare(&model, &one, &[&input], &["--val-docs", "4"]));
    assert_ok(&prepare(&model, &many, &[&input], &["--val-docs", "4", "--shard-tokens", "50"]));
    for split in ["val", "train"] {
        assert_eq!(split_shards(&one, split).len(), 1, "{split}");
        let shards = split_shards(&many, split);
        assert!(shards.len() >= 3, "{split}: {} shards", shards.len());
        for s in &shards[..shards.len() - 1] {
            assert_eq!(shard_tokens(s).len(), 50, "{}", s.display());
        }
        assert_eq!(split_tokens(&many, split), split_tokens(&one, split), "{split}");
    }
}

#[test]
fn missing_tokenizer_file() {
    let (dir, _) = setup("no-model");
    let input = write_many_docs(&dir, 3);
    let o = prepare(&dir.join("absent.model"), &dir.join("out"), &[&input], &[]);
    assert_fails(&o, &["absent.model", "cannot read the tokenizer"]);
}

#[test]
fn tokenizer_that_is_not_a_model() {
    let (dir, _) = setup("not-model");
    let input = write_many_docs(&dir, 3);
    let fake = dir.join("fake.model");
    std::fs::write(&fake, "this is a text file, not a sentencepiece model\n").unwrap();
    let o = prepare(&fake, &dir.join("out"), &[&input], &[]);
    assert_fails(&o, &["fake.model", "not a sentencepiece model"]);
}

#[test]
fn jsonl_line_that_is_not_json() {
    let (dir, model) = setup("bad-json");
    let input = dir.join("broken.jsonl");
    std::fs::write(&input, "{\"text\": \"fine\"}\n{\"text\": \"cut off\n{\"text\": \"also fine\"}\n").unwrap();
    let o = prepare(&model, &dir.join("out"), &[&input], &[]);
    assert_fails(&o, &["broken.jsonl:2", "not a JSON object"]);
}

#[test]
fn jsonl_object_without_text() {
    let (dir, model) = setup("no-text");
    let input = dir.join("notext.jsonl");
    std::fs::write(&input, "{\"text\": \"fine\"}\n{\"body\": \"no text here\"}\n").unwrap();
    let o = prepare(&model, &dir.join("out"), &[&input], &[]);
    assert_fails(&o, &["notext.jsonl:2", "`text`"]);
}

#[test]
fn val_frac_above_one() {
    let (dir, model) = setup("val-frac");
    let input = write_many_docs(&dir, 3);
    let o = prepare(&model, &dir.join("out"), &[&input], &["--val-frac", "1.5"]);
    assert_fails(&o, &["--val-frac", "1.5"]);
}

#[test]
fn fewer_than_two_documents() {
    let (dir, model) = setup("one-doc");
    let input = write_many_docs(&dir, 1);
    let o = prepare(&model, &dir.join("out"), &[&input], &[]);
    assert_fails(&o, &["1 document", "at least 2"]);
}

#[test]
fn existing_shards_need_force() {
    let (dir, model) = setup("force");
    let input = write_many_docs(&dir, 4);
    let out = dir.join("out");
    assert_ok(&prepare(&model, &out, &[&input], &[]));
    let o = prepare(&model, &out, &[&input], &[]);
    assert_fails(&o, &[&out.display().to_string(), "already holds", "--force"]);
    let before = split_tokens(&out, "train");
    assert_ok(&prepare(&model, &out, &[&input], &["--force"]));
    assert_eq!(split_tokens(&out, "train"), before);
}
