//! Bad input to the data path through the real binary: each test makes its own small shards in a
//! fresh directory, writes a loader config (shard_reader -> window_sampler/shuffled -> pin ->
//! upload/cpu -> drain/batches, 2 steps of 2 micro-batches of 4 x 16 tokens) with exactly one
//! thing wrong, and runs `pipeline run` (or `validate`) on it. Every rejection must exit non-zero
//! without a panic and name the offending file and the problem; a data error found while running
//! (exit 1) must also leave a report.json with status "failed" naming the failing stage. One
//! positive test pins down what a healthy run reports and that its order is reproducible.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{bin, scratch, text};
use pipeline::data::shard::{MAGIC, VERSION, write_raw, write_shard};

/// Tokens per healthy shard.
const SHARD_TOKENS: usize = 3000;
/// Pieces in the tiny tokenizer of [`write_model`].
const VOCAB: usize = 260;

/// One test's directory: `data/` holds the shards, `loader.toml` the config, `run/` the run.
/// Removed when the test passes, kept for a look when it fails.
struct Case {
    root: PathBuf,
}

impl Drop for Case {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

impl Case {
    fn new(name: &str) -> Self {
        let root = scratch(&format!("data-errors-{name}"));
        std::fs::create_dir_all(root.join("data")).unwrap();
        Self { root }
    }

    /// `data/<name>`.
    fn data(&self, name: &str) -> PathBuf {
        self.root.join("data").join(name)
    }

    /// `data/fineweb_train_00000<i>.bin`.
    fn shard(&self, i: usize) -> PathBuf {
        self.data(&format!("fineweb_train_{i:06}.bin"))
    }

    /// The glob of the training shards.
    fn glob(&self) -> String {
        self.data("fineweb_train_*.bin").display().to_string()
    }

    /// A healthy shard at index `i`, ids below [`VOCAB`].
    fn healthy(&self, i: usize) -> PathBuf {
        let p = self.shard(i);
        let tokens: Vec<u16> = (0..SHARD_TOKENS).map(|k| ((k * 7 + i * 13) % VOCAB) as u16).collect();
        write_shard(&p, &tokens).unwrap();
        p
    }

    /// `data/tiny.model`, a real sentencepiece model of [`VOCAB`] pieces.
    fn model(&self) -> PathBuf {
        let p = self.data("tiny.model");
        write_model(&p);
        p
    }

    /// Writes `loader.toml` with `[data]` lines `data` and the reader's `impl`; returns its path.
    fn config(&self, data: &str, reader: &str) -> PathBuf {
        let p = self.root.join("loader.toml");
        std::fs::write(&p, loader_toml(data, reader)).unwrap();
        p
    }

    /// The default config: the train glob, no tokenizer, mmap.
    fn default_config(&self) -> PathBuf {
        self.config(&format!("train = '{}'", self.glob()), "mmap")
    }

    /// `pipeline run CONFIG --out <root>/<out> -q`.
    fn run(&self, config: &Path, out: &str) -> (Output, PathBuf) {
        let dir = self.root.join(out);
        let o = bin().arg("run").arg(config).arg("--out").arg(&dir).arg("-q").output().expect("the binary runs");
        (o, dir)
    }
}

fn loader_toml(data: &str, reader: &str) -> String {
    format!(
        r#"[run]
name = "data-errors"
seed = 0
warmup_items = 1
max_seconds = 60

[data]
{data}

[train]
seq_len = 16
batch_tokens = 128
grad_accum_steps = 2

[stages.reader]
kind = "shard_reader"
impl = "{reader}"
split = "train"

[stages.sampler]
kind = "window_sampler"
impl = "shuffled"
inputs = ["reader"]
queue = 4
workers = 2
buffers = 4

[stages.pin]
kind = "pin"
impl = "pageable"
inputs = ["sampler"]
queue = 2
buffers = 4

[stages.upload]
kind = "upload"
impl = "cpu"
inputs = ["pin"]
queue = 2

[stages.sink]
kind = "drain"
impl = "batches"
inputs = ["upload"]
queue = 2
stop_after_steps = 2
write_order = true
"#
    )
}

/// A BPE model of [`VOCAB`] pieces: `<pad> <s> </s> <unk>` and the 256 byte pieces.
fn write_model(path: &Path) {
    std::fs::write(path, pipeline::data::tokenizer::build_bpe_model(&[], &[])).unwrap();
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit `code`, no panic, and stderr names `file` and holds every fragment.
fn assert_rejected(o: &Output, code: i32, file: &str, fragments: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "exit code\n{}", text(o));
    assert!(!err.contains("panicked"), "panic\n{}", text(o));
    assert!(err.contains(file), "file `{file}` not named\n{}", text(o));
    for f in fragments {
        assert!(err.contains(f), "`{f}` not in stderr\n{}", text(o));
    }
}

/// RUN_DIR/report.json as JSON.
fn report_json(run_dir: &Path) -> serde_json::Value {
    let path = run_dir.join("report.json");
    let raw = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A data error found while running: exit 1, stderr names `file` and the problem, and the report
/// says the run failed in `stage` for that reason.
fn assert_run_failed(o: &Output, run_dir: &Path, stage: &str, file: &str, fragments: &[&str]) {
    assert_rejected(o, 1, file, fragments);
    let r = report_json(run_dir);
    assert_eq!(r["run"]["status"], "failed", "{r:#}");
    assert_eq!(r["run"]["exit_code"], 1, "{r:#}");
    assert_eq!(r["stages"][stage]["state"], "failed", "{r:#}");
    let error = r["stages"][stage]["error"].as_str().unwrap_or_default();
    assert!(error.contains(file), "stage error does not name {file}: {error}");
    let run_error = r["run"]["error"].as_str().unwrap_or_default();
    assert!(run_error.contains(stage) && run_error.contains(file), "run.error: {run_error}");
}

/// A healthy shard 0 next to a damaged shard 1 made by `damage`: the reader stops the run.
fn damaged_shard_fails_run(name: &str, damage: impl FnOnce(&Path), fragments: &[&str]) {
    let case = Case::new(name);
    case.healthy(0);
    damage(&case.shard(1));
    let (o, dir) = case.run(&case.default_config(), "run");
    assert_run_failed(&o, &dir, "reader", "fineweb_train_000001.bin", fragments);
}

// ---------------------------------------------------------------------------------------------
// Damaged shard files: found by the reader while running (exit 1).
// ---------------------------------------------------------------------------------------------

#[test]
fn truncated_shard() {
    let damage = |p: &Path| {
        write_shard(p, &vec![5u16; SHARD_TOKENS]).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.set_len(1024 + 2 * SHARD_TOKENS as u64 - 100).unwrap();
    };
    damaged_shard_fails_run("truncated", damage, &["header says 3000 tokens", "truncated"]);
}

#[test]
fn wrong_magic() {
    let damage = |p: &Path| write_raw(p, &[20240521, VERSION, 100], &[5; 100]).unwrap();
    damaged_shard_fails_run("magic", damage, &["magic number 20240521", "expected 20240520"]);
}

#[test]
fn version_2() {
    let damage = |p: &Path| write_raw(p, &[MAGIC, 2, 100], &[5; 100]).unwrap();
    damaged_shard_fails_run("version", damage, &["unsupported shard version 2"]);
}

#[test]
fn token_count_larger_than_the_file() {
    let damage = |p: &Path| write_raw(p, &[MAGIC, VERSION, 1_000_000], &[5; 100]).unwrap();
    damaged_shard_fails_run("count", damage, &["header says 1000000 tokens", "truncated"]);
}

#[test]
fn zero_token_shard() {
    let damage = |p: &Path| write_raw(p, &[MAGIC, VERSION, 0], &[]).unwrap();
    damaged_shard_fails_run("empty", damage, &["holds 0 tokens"]);
}

#[test]
fn file_shorter_than_the_header() {
    let damage = |p: &Path| std::fs::write(p, [0u8; 100]).unwrap();
    damaged_shard_fails_run("short", damage, &["100 bytes", "shorter than the 1024-byte shard header"]);
}

#[test]
fn directory_where_a_shard_is_expected() {
    let damage = |p: &Path| std::fs::create_dir(p).unwrap();
    damaged_shard_fails_run("dir", damage, &["is a directory"]);
}

#[test]
fn dangling_symlink_matched_by_the_glob() {
    // Tests run as root, so an unreadable file cannot be made with chmod; a link to nothing
    // cannot be opened either.
    let damage = |p: &Path| std::os::unix::fs::symlink(p.with_file_name("gone.bin"), p).unwrap();
    damaged_shard_fails_run("symlink", damage, &["cannot read"]);
}

#[test]
fn token_ids_at_the_vocab_size() {
    let case = Case::new("vocab");
    case.healthy(0);
    write_shard(&case.shard(1), &vec![VOCAB as u16; SHARD_TOKENS]).unwrap();
    let model = case.model();
    let config = case.config(&format!("train = '{}'\ntokenizer = '{}'", case.glob(), model.display()), "mmap");
    let (o, dir) = case.run(&config, "run");
    let vocab = format!("token id {VOCAB}");
    let limit = format!("not below the tokenizer's vocabulary size {VOCAB}");
    assert_run_failed(&o, &dir, "sampler", "fineweb_train_000001.bin", &[&vocab, &limit]);
}

// ---------------------------------------------------------------------------------------------
// Config errors: found before the run starts (exit 2).
// ---------------------------------------------------------------------------------------------

#[test]
fn glob_matching_nothing() {
    let case = Case::new("empty-glob");
    case.healthy(0);
    let glob = case.data("fineweb_trian_*.bin").display().to_string();
    let (o, _) = case.run(&case.config(&format!("train = '{glob}'"), "mmap"), "run");
    assert_rejected(&o, 2, "fineweb_trian_*.bin", &["no shard matches"]);
}

#[test]
fn train_glob_not_set() {
    let case = Case::new("no-train");
    case.healthy(0);
    let (o, _) = case.run(&case.config("", "mmap"), "run");
    assert_rejected(&o, 2, "loader.toml", &["`data.train` is not set"]);
}

#[test]
fn tokenizer_that_is_not_a_model() {
    let case = Case::new("bad-tokenizer");
    case.healthy(0);
    let fake = case.data("tokenizer.model");
    std::fs::write(&fake, "this is a text file, not a sentencepiece model\n").unwrap();
    let config = case.config(&format!("train = '{}'\ntokenizer = '{}'", case.glob(), fake.display()), "mmap");
    let (o, _) = case.run(&config, "run");
    assert_rejected(&o, 2, "tokenizer.model", &["not a sentencepiece model", "data.tokenizer"]);
}

#[test]
fn validate_reads_every_header() {
    let case = Case::new("validate");
    case.healthy(0);
    write_raw(&case.shard(1), &[MAGIC, VERSION, 500], &[5; 100]).unwrap();
    let o = bin().arg("validate").arg(case.default_config()).output().expect("the binary runs");
    assert_rejected(&o, 2, "fineweb_train_000001.bin", &["header says 500 tokens", "truncated", "stages.reader"]);
}

// ---------------------------------------------------------------------------------------------
// A healthy run.
// ---------------------------------------------------------------------------------------------

/// Runs `config` into `<root>/<out>`, checks the `data` section and `data_order.tsv`, and
/// returns the rolling fingerprint.
fn healthy_run(case: &Case, config: &Path, out: &str) -> String {
    let (o, dir) = case.run(config, out);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report_json(&dir);
    assert_eq!(r["run"]["status"], "completed", "{r:#}");
    let data = &r["data"];
    assert_eq!(data["micro_batches"], 4, "{data:#}");
    assert_eq!(data["steps"], 2, "{data:#}");
    assert_eq!(data["tokens"], 4 * 4 * 16, "{data:#}");
    let rolling = data["rolling_fingerprint"].as_str().unwrap_or_else(|| panic!("no fingerprint: {data:#}")).to_string();
    assert!(rolling.len() == 16 && rolling.chars().all(|c| c.is_ascii_hexdigit()), "{rolling}");
    let order = std::fs::read_to_string(dir.join("data_order.tsv")).unwrap();
    let lines: Vec<&str> = order.lines().collect();
    assert_eq!(lines.len(), 5, "{order}");
    assert_eq!(lines[0], "step\tmicro\tfingerprint\trolling");
    assert!(lines[4].ends_with(&rolling), "last line {} vs {rolling}", lines[4]);
    rolling
}

#[test]
fn healthy_run_is_reproducible_across_runs_and_readers() {
    let case = Case::new("healthy");
    case.healthy(0);
    case.healthy(1);
    let model = case.model();
    let data = format!("train = '{}'\ntokenizer = '{}'", case.glob(), model.display());
    let mmap = case.config(&data, "mmap");
    let first = healthy_run(&case, &mmap, "run-1");
    assert_eq!(healthy_run(&case, &mmap, "run-2"), first, "same config, different order");
    let pread = case.config(&data, "pread");
    assert_eq!(healthy_run(&case, &pread, "run-pread"), first, "pread and mmap disagree");
}
