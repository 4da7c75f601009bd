//! A tiny GPT training setup on real English text, shared by the training tests: the
//! repository's README, docs/ and module docs tokenized with a small BPE sentencepiece model and
//! written as challenge-format shards, a config of the demo graph with a tiny model, and
//! helpers to run the binary on it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use pipeline::data::shard::write_shard;
use pipeline::data::tokenizer::Tokenizer;
use serde_json::Value;

use super::{Dir, bin, report, scratch, text, wait_or_kill};

/// Pieces after the byte pieces, best merge first: common English pairs and words, each one
/// reachable by merging two earlier pieces, then single letters.
pub const PIECES: &[&str] = &[
    "▁t", "he", "▁the", "in", "er", "an", "on", "re", "▁a", "at", "en", "or", "es", "ed", "is", "it", "ar", "al", "st", "le", "ou", "▁s",
    "▁w", "▁o", "▁c", "▁f", "▁p", "▁b", "▁m", "▁i", "▁d", "ing", "▁of", "▁to", "▁an", "▁and", "▁in", "▁is", "ion", "ch", "th", "▁th", "▁",
    "e", "t", "a", "o", "i", "n", "s", "r", "h", "l", "d", "c", "u", "m", "f", "p", "g", "w", "y", "b", "v", "k",
];

/// Shards and tokenizer made from the repository's prose.
pub struct Corpus {
    pub dir: Dir,
    pub tokenizer: PathBuf,
    pub vocab: usize,
}

impl Corpus {
    pub fn train_glob(&self) -> String {
        self.dir.join("shards/fineweb_train_*.bin").display().to_string()
    }
    pub fn val_glob(&self) -> String {
        self.dir.join("shards/fineweb_val_*.bin").display().to_string()
    }
}

/// The documents: the paragraphs of README.md and of every `docs/*.md`, and the `//!` doc block
/// of every `.rs` file under `src/`.
pub fn documents() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    pages.insert(0, root.join("README.md"));
    let mut docs: Vec<String> = Vec::new();
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        docs.extend(text.split("\n\n").map(str::trim).filter(|p| p.len() > 40).map(String::from));
    }
    for f in super::rust_files(&root.join("src")) {
        let src = std::fs::read_to_string(&f).unwrap();
        let doc: Vec<&str> = src.lines().filter_map(|l| l.strip_prefix("//!")).map(str::trim).collect();
        let doc = doc.join("\n");
        if doc.len() > 40 {
            docs.push(doc);
        }
    }
    assert!(docs.len() >= 50, "only {} documents of prose", docs.len());
    docs
}

/// Builds the tokenizer and the shards in a fresh scratch directory: every tenth document goes
/// to the val shard, the rest to the train shard, each one starting with BOS.
pub fn corpus(name: &str) -> Corpus {
    corpus_with(name, 1)
}

/// As [`corpus`], with the val documents written `val_copies` times (a longer validation).
pub fn corpus_with(name: &str, val_copies: usize) -> Corpus {
    let dir = Dir(scratch(&format!("train-{name}")));
    let tokenizer = dir.join("tiny.model");
    std::fs::write(&tokenizer, pipeline::data::tokenizer::build_bpe_model(PIECES, &[])).unwrap();
    let tok = Tokenizer::load(&tokenizer).unwrap();
    assert_eq!(tok.bos, 1);
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, d) in documents().iter().enumerate() {
        let ids = tok.encode_document(d).unwrap();
        if i % 10 == 5 { val.extend(ids) } else { train.extend(ids) }
    }
    let merged = train.iter().filter(|&&t| t >= 260).count();
    assert!(merged * 5 > train.len(), "the merges are hardly used: {merged} of {} tokens", train.len());
    std::fs::create_dir_all(dir.join("shards")).unwrap();
    write_shard(&dir.join("shards/fineweb_train_000000.bin"), &train).unwrap();
    write_shard(&dir.join("shards/fineweb_val_000000.bin"), &val.repeat(val_copies)).unwrap();
    Corpus { vocab: tok.vocab_size, tokenizer, dir }
}

/// All tokens of one shard.
pub fn shard_tokens(path: &Path) -> Vec<u16> {
    let f = pipeline::data::shard::ShardFile::open(path, 0, pipeline::data::shard::AccessMode::Pread).unwrap_or_else(|e| panic!("{e}"));
    let mut out = vec![0u16; f.tokens as usize];
    f.read(0, &mut out).unwrap();
    out
}

/// UTF-8 bytes that target `tok` stands for after `prev`, by the challenge's rules: control and
/// unknown pieces 0, byte pieces 1, normal pieces their text with `▁` as a space, except that a
/// leading `▁` after a control or unknown piece counts nothing.
pub fn target_bytes(prev: u16, tok: u16) -> u64 {
    match tok {
        0..=3 => 0,
        4..=259 => 1,
        _ => {
            let piece = PIECES[tok as usize - 260];
            match piece.strip_prefix('▁') {
                Some(rest) => rest.len() as u64 + u64::from(prev >= 4),
                None => piece.len() as u64,
            }
        }
    }
}

/// A TOML string literal.
pub fn lit(s: impl AsRef<str>) -> String {
    toml::Value::String(s.as_ref().to_string()).to_string()
}

/// Writes `NAME.toml`: the demo graph (pipelines/demo.toml) with a tiny model on `c`, 50 steps
/// with exact step counts (no wall-clock cap, no warm-down); `data_val` false leaves `data.val`
/// out.
pub fn config_with(c: &Corpus, name: &str, data_val: bool) -> PathBuf {
    let val = if data_val { format!("val = {}\n", lit(c.val_glob())) } else { String::new() };
    let toml = format!(
        r#"[run]
name = "train-test"
seed = 1337
warmup_items = 2

[data]
train = {train}
{val}tokenizer = {tok}

[model]
vocab_size = {vocab}
num_layers = 2
model_dim = 32
num_heads = 2
num_kv_heads = 1

[train]
seq_len = 32
batch_tokens = 256
grad_accum_steps = 1
iterations = 50
warmdown_iters = 0
max_wallclock_seconds = 0
val_every = 25
val_batch_tokens = 1024
log_every = 10
timing_every = 25

[stages.reader]
kind = "shard_reader"
impl = "mmap"
split = "train"

[stages.sampler]
kind = "window_sampler"
impl = "shuffled"
inputs = ["reader"]

[stages.pin]
kind = "pin"
impl = "pageable"
inputs = ["sampler"]

[stages.upload]
kind = "upload"
impl = "cpu"
inputs = ["pin"]

[stages.train]
kind = "step_executor"
impl = "candle"
inputs = ["upload"]
"#,
        train = lit(c.train_glob()),
        tok = lit(c.tokenizer.display().to_string()),
        vocab = c.vocab,
    );
    let path = c.dir.join(format!("{name}.toml"));
    std::fs::write(&path, toml).unwrap();
    path
}

pub fn config(c: &Corpus) -> PathBuf {
    config_with(c, "train", true)
}

/// Runs the binary with a generous limit (a hang fails the test instead of the whole suite).
pub fn run_limited(config: &Path, out: &Path, sets: &[&str]) -> Output {
    let mut c = bin();
    c.arg("run").arg(config).arg("--out").arg(out).arg("-q");
    for s in sets {
        c.arg("--set").arg(s);
    }
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("the binary runs");
    finish(child, config)
}

/// A run that must succeed; returns its `train` report section.
pub fn train_ok(config: &Path, out: &Path, sets: &[&str]) -> (serde_json::Map<String, Value>, Output) {
    let o = run_limited(config, out, sets);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(out);
    assert_eq!(r.run.status, "completed", "{}", text(&o));
    (r.train, o)
}

pub fn f(t: &serde_json::Map<String, Value>, key: &str) -> f64 {
    t[key].as_f64().unwrap_or_else(|| panic!("train.{key} is not a number: {:?}", t.get(key)))
}

pub fn u(t: &serde_json::Map<String, Value>, key: &str) -> u64 {
    t[key].as_u64().unwrap_or_else(|| panic!("train.{key} is not an integer: {:?}", t.get(key)))
}

/// Starts `pipeline run` on `c`'s config with `sets`, output discarded.
pub fn spawn_run(c: &Corpus, out: &Path, sets: &[&str]) -> Child {
    let mut cmd = bin();
    cmd.arg("run").arg(config(c)).arg("--out").arg(out).arg("-q");
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

/// Waits until train.log has a line for which `pred` holds (failing if the child ends first, or
/// after 240 s: a hang detector, generous because CI's 2 cores run two tests at once).
pub fn wait_for_line(child: &mut Child, out: &Path, pred: impl Fn(&str) -> bool) {
    wait_for_line_every(child, out, Duration::from_millis(10), pred)
}

/// As [`wait_for_line`], polling every `every`.
pub fn wait_for_line_every(child: &mut Child, out: &Path, every: Duration, pred: impl Fn(&str) -> bool) {
    let t0 = Instant::now();
    while !std::fs::read_to_string(out.join("train.log")).is_ok_and(|l| l.lines().any(&pred)) {
        if t0.elapsed() > Duration::from_secs(240) || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the awaited line never came: {:?}", std::fs::read_to_string(out.join("train.log")));
        }
        std::thread::sleep(every);
    }
}

pub fn sigint(child: &Child) {
    let ok = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
}

/// As [`config_with`] (with `data.val`), followed by `extra` (more stage tables).
pub fn config_plus(c: &Corpus, name: &str, extra: &str) -> PathBuf {
    let path = config_with(c, name, true);
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push('\n');
    text.push_str(extra);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `pipeline run CONFIG ARGS... -q` (no `--out` added) with a time limit.
pub fn run_args(config: &Path, args: &[&str]) -> Output {
    let mut c = bin();
    c.arg("run").arg(config).arg("-q").args(args);
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("the binary runs");
    finish(child, config)
}

/// Collects a child's output (draining the pipes on threads, so a chatty child never blocks
/// on a full pipe), killing it after 420 s: a hang fails the test instead of the whole suite.
/// (A hang detector, not a timing: generous, because CI's 2 cores run two tests at once and a
/// run with its stages after training took minutes there before the dev profile was optimised.)
pub fn finish(mut child: Child, config: &Path) -> Output {
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let ho = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut so, &mut v).unwrap();
        v
    });
    let he = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut se, &mut v).unwrap();
        v
    });
    let status = wait_or_kill(&mut child, Duration::from_secs(420), &format!("pipeline run {}", config.display()));
    Output { status, stdout: ho.join().unwrap(), stderr: he.join().unwrap() }
}

/// EMA after the executor (decay 0.9) and checkpoints of it every `every` steps, the newest
/// `keep` kept.
pub fn ema_and_checkpoints(every: u64, keep: usize) -> String {
    format!(
        r#"
[stages.ema]
kind = "ema_swa"
impl = "ema"
inputs = ["train"]
decay = 0.9

[stages.ckpt]
kind = "checkpoint"
impl = "atomic"
inputs = ["ema"]
every = {every}
keep = {keep}
"#
    )
}

/// [`ema_and_checkpoints`] every 5 steps (2 kept), then the artifact (scored) and score-first TTT.
pub fn after_training() -> String {
    ema_and_checkpoints(5, 2)
        + r#"
[stages.artifact]
kind = "artifact"
impl = "quantize"
inputs = ["ckpt"]

[stages.eval]
kind = "ttt_eval"
impl = "score_first"
inputs = ["artifact"]
stride = 16
batch_windows = 8
chunk_tokens = 512
epochs = 2
batch_seqs = 8
"#
}

/// [`after_training`] with phased TTT (small chunks, batches of 3 documents, 2 phases over the
/// first 4) and the sliding score first; score-first's own keys stay in the table, set aside.
pub fn after_training_phased() -> String {
    after_training().replace("impl = \"score_first\"", "impl = \"phased\"")
        + r#"lora_rank = 4
lora_lr = 0.003
chunk = 16
context = 64
batch_docs = 3
prefix_docs = 4
phases = 2
global_chunk_tokens = 128
global_seq_len = 32
global_batch_seqs = 4
sliding_first = true
"#
}

/// [`after_training`] with the sliding-window evaluation only (its keys a subset of
/// score-first's), for tests that need the stages but not TTT's time.
pub fn after_training_sliding() -> String {
    after_training().replace("impl = \"score_first\"", "impl = \"sliding\"").replace("chunk_tokens = 512\nepochs = 2\nbatch_seqs = 8\n", "")
}
