//! `pipeline validate` through the real binary: one broken config per test, each a valid
//! four-stage chain with exactly one thing changed. Every rejection must exit 2 without a
//! panic and name where the bad value came from, the key path and what is wrong.

use std::path::PathBuf;
use std::process::Command;

/// A valid chain: source (synthetic/blob) -> mid (delay/sleep) -> post (delay/sleep) -> sink
/// (drain/count).
const BASE: &str = r#"[run]
name = "validate-test"
seed = 0

[stages.source]
kind = "synthetic"
impl = "blob"
count = 10
delay_us = 0

[stages.mid]
kind = "delay"
impl = "sleep"
inputs = ["source"]
queue = 2
delay_us = 0

[stages.post]
kind = "delay"
impl = "sleep"
inputs = ["mid"]
queue = 2
delay_us = 0

[stages.sink]
kind = "drain"
impl = "count"
inputs = ["post"]
queue = 2
"#;

/// BASE with the first line equal to `old` inside table `[table]` replaced by `new` (which may
/// hold several lines, or none to delete it).
fn edit(table: &str, old: &str, new: &str) -> String {
    let header = format!("[{table}]");
    let lines: Vec<&str> = BASE.lines().collect();
    let start = lines.iter().position(|l| *l == header).unwrap_or_else(|| panic!("no {header} in BASE"));
    let at = lines[start + 1..]
        .iter()
        .take_while(|l| !l.starts_with('['))
        .position(|l| *l == old)
        .map(|i| start + 1 + i)
        .unwrap_or_else(|| panic!("no line `{old}` in {header}"));
    let mut out: Vec<&str> = lines[..at].to_vec();
    if !new.is_empty() {
        out.extend(new.lines());
    }
    out.extend(&lines[at + 1..]);
    out.join("\n") + "\n"
}

/// What one `pipeline validate` run printed.
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Writes `config` (none: no file at all) as `<name>.toml` in a fresh temp directory and runs
/// `pipeline validate` on it with `args` after the path, no `PIPELINE_*` variables but `env`.
fn validate(name: &str, config: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Outcome {
    let dir: PathBuf = std::env::temp_dir().join(format!("validate-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.toml"));
    if let Some(text) = config {
        std::fs::write(&path, text).unwrap();
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pipeline"));
    cmd.arg("validate").arg(&path).args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(|k| k.starts_with("PIPELINE_")) {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run pipeline validate");
    let _ = std::fs::remove_dir_all(&dir);
    Outcome {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

/// Exit 2, no panic, and stderr holds `origin`, the key path in backticks (if any) and
/// `fragment`.
fn assert_rejected(out: &Outcome, origin: &str, key: Option<&str>, fragment: &str) {
    let err = &out.stderr;
    assert_eq!(out.code, Some(2), "exit code; stderr:\n{err}");
    assert!(!err.contains("panicked"), "panic:\n{err}");
    assert!(err.contains(origin), "origin `{origin}` not named:\n{err}");
    if let Some(key) = key {
        assert!(err.contains(&format!("`{key}`")), "key path `{key}` not named:\n{err}");
    }
    assert!(err.contains(fragment), "`{fragment}` not in:\n{err}");
}

/// Runs `config` as `<name>.toml` and checks it is rejected naming that file.
fn rejects(name: &str, config: &str, key: Option<&str>, fragment: &str) {
    let out = validate(name, Some(config), &[], &[]);
    assert_rejected(&out, &format!("{name}.toml"), key, fragment);
}

#[test]
fn valid_base_config_is_ok() {
    let out = validate("ok", Some(BASE), &[], &[]);
    assert_eq!(out.code, Some(0), "stderr:\n{}", out.stderr);
    assert!(out.stdout.contains("ok, 4 stages"), "stdout:\n{}", out.stdout);
}

#[test]
fn unknown_kind_lists_known_kinds() {
    let cfg = edit("stages.mid", r#"kind = "delay""#, r#"kind = "delai""#);
    rejects("unknown-kind", &cfg, Some("stages.mid.kind"), "unknown stage kind `delai`; known kinds: synthetic, delay, drain");
}

#[test]
fn unknown_impl_lists_available_impls() {
    let cfg = edit("stages.mid", r#"impl = "sleep""#, r#"impl = "slep""#);
    rejects("unknown-impl", &cfg, Some("stages.mid.impl"), "unknown implementation `slep` of kind `delay`; available: sleep, spin");
}

#[test]
fn unknown_stage_param_is_named_with_its_stage() {
    let cfg = edit("stages.mid", "delay_us = 0", "delay_uss = 5");
    rejects("unknown-param", &cfg, Some("stages.mid.delay_uss"), "unknown key `delay_uss`; expected one of: delay_us");
}

/// A key of another implementation of the stage's kind is set aside with a note, not refused:
/// `impl` alone switches implementations (an ablation's `--vary stages.X.impl=...`).
#[test]
fn a_sibling_implementations_key_is_set_aside() {
    let cfg = BASE.replace(
        "impl = \"count\"\ninputs = [\"post\"]\nqueue = 2\n",
        "impl = \"count\"\ninputs = [\"post\"]\nqueue = 2\nwrite_order = true\n",
    );
    assert_ne!(cfg, BASE);
    let out = validate("set-aside", Some(&cfg), &[], &[]);
    assert_eq!(out.code, Some(0), "stderr:\n{}", out.stderr);
    assert!(
        out.stdout.contains("note: stages.sink: `write_order` taken by other drain implementations, not by `count`: set aside"),
        "stdout:\n{}",
        out.stdout
    );
}

#[test]
fn unknown_run_key() {
    let cfg = edit("run", "seed = 0", "seedd = 1");
    rejects("unknown-run-key", &cfg, Some("run.seedd"), "unknown key `seedd`; expected one of: name, seed");
}

#[test]
fn unknown_top_level_table() {
    let cfg = format!("{BASE}\n[bogus]\nx = 1\n");
    rejects(
        "unknown-table",
        &cfg,
        Some("bogus"),
        "unknown top-level table or key `bogus`; expected one of: run, data, model, train, stages",
    );
}

#[test]
fn stage_without_kind() {
    let cfg = edit("stages.mid", r#"kind = "delay""#, "");
    rejects("missing-kind", &cfg, Some("stages.mid.kind"), "missing required key `kind`");
}

#[test]
fn delay_us_of_wrong_type() {
    let cfg = edit("stages.mid", "delay_us = 0", r#"delay_us = "fast""#);
    rejects("delay-type", &cfg, Some("stages.mid.delay_us"), r#"wrong type: found string "fast""#);
}

#[test]
fn queue_of_wrong_type() {
    let cfg = edit("stages.mid", "queue = 2", r#"queue = "two""#);
    rejects("queue-type", &cfg, Some("stages.mid.queue"), r#"wrong type: found string "two""#);
}

#[test]
fn input_is_a_sink() {
    let cfg = edit("stages.post", r#"inputs = ["mid"]"#, r#"inputs = ["sink"]"#);
    rejects("input-sink", &cfg, Some("stages.post.inputs"), "input `sink` is a sink (drain/count) and produces nothing");
}

#[test]
fn cycle_between_mid_and_post() {
    // mid takes both source and post, post takes mid: every output is consumed, but
    // mid -> post -> mid is a cycle.
    let cfg = edit("stages.mid", r#"inputs = ["source"]"#, r#"inputs = ["source", "post"]"#);
    rejects("cycle", &cfg, Some("stages"), "the stages form a cycle: post -> mid -> post");
}

#[test]
fn input_naming_no_stage() {
    let cfg = edit("stages.mid", r#"inputs = ["source"]"#, r#"inputs = ["nope"]"#);
    rejects("input-nope", &cfg, Some("stages.mid.inputs"), "input `nope` names no stage; stages are: mid, post, sink, source");
}

#[test]
fn queue_of_zero() {
    let cfg = edit("stages.mid", "queue = 2", "queue = 0");
    rejects("queue-zero", &cfg, Some("stages.mid.queue"), "queue must be at least 1");
}

#[test]
fn source_with_inputs() {
    let cfg = edit("stages.source", r#"impl = "blob""#, "impl = \"blob\"\ninputs = [\"sink\"]");
    rejects("source-inputs", &cfg, Some("stages.source.inputs"), "stage `source` is a source (synthetic/blob) and takes no inputs");
}

#[test]
fn transform_without_inputs() {
    let cfg = edit("stages.mid", r#"inputs = ["source"]"#, "");
    rejects("transform-no-inputs", &cfg, Some("stages.mid.inputs"), "stage `mid` (delay/sleep) needs `inputs = [");
}

#[test]
fn output_feeding_no_stage() {
    // sink reads mid, so nothing reads post.
    let cfg = edit("stages.sink", r#"inputs = ["post"]"#, r#"inputs = ["mid"]"#);
    rejects("orphan-output", &cfg, Some("stages.post"), "the output of `post` (delay/sleep) feeds no stage");
}

#[test]
fn missing_config_file() {
    let out = validate("missing-file", None, &[], &[]);
    assert_rejected(&out, "missing-file.toml", None, "cannot read the config file");
}

#[test]
fn invalid_toml_syntax() {
    let cfg = edit("stages.mid", "queue = 2", "queue = = 2");
    rejects("bad-syntax", &cfg, None, "not valid TOML");
}

#[test]
fn set_with_wrong_type_names_the_set_argument() {
    let out = validate("set-type", Some(BASE), &["--set", "stages.mid.delay_us=fast"], &[]);
    assert_rejected(&out, "--set stages.mid.delay_us=fast", Some("stages.mid.delay_us"), r#"wrong type: found string "fast""#);
}

#[test]
fn set_queue_zero_names_the_set_argument() {
    let out = validate("set-queue", Some(BASE), &["--set", "stages.mid.queue=0"], &[]);
    assert_rejected(&out, "--set stages.mid.queue=0", Some("stages.mid.queue"), "queue must be at least 1");
}

#[test]
fn env_var_queue_zero_names_the_environment() {
    let out = validate("env-queue", Some(BASE), &[], &[("PIPELINE_STAGES__MID__QUEUE", "0")]);
    // The variable itself is shown as `STAGES.MID.QUEUE` (figment's rendering), not as
    // `PIPELINE_STAGES__MID__QUEUE`, so only the kind of origin is checked here.
    assert_rejected(&out, "environment variable PIPELINE_STAGES__MID__QUEUE", Some("stages.mid.queue"), "queue must be at least 1");
}

#[test]
fn cuda_device_on_cpu_build() {
    let cfg = edit("run", "seed = 0", "seed = 0\ndevice = \"cuda:0\"");
    rejects("cuda-device", &cfg, Some("run.device"), "needs a binary built with the `cuda` feature");
    // ... and says how to run the config on the CPU instead.
    rejects("cuda-device", &cfg, Some("run.device"), "add `--set run.device=cpu`");
    rejects("cuda-device", &cfg, Some("run.device"), "pipelines/record-mini.toml for the record recipe");
}

#[test]
fn negative_delay_caught_by_stage_check() {
    let cfg = edit("stages.mid", "delay_us = 0", "delay_us = -5");
    rejects(
        "negative-delay",
        &cfg,
        Some("stages.mid"),
        "`delay_us` must be a number of microseconds from 0 to 1e12 (about 11 days); found -5",
    );
}

#[test]
fn stage_level_error_names_the_file_not_an_unrelated_override() {
    let cfg = edit("stages.mid", "delay_us = 0", "delay_us = -5");
    let out = validate("blame", Some(&cfg), &["--set", "stages.mid.queue=3"], &[("PIPELINE_STAGES__MID__JITTER_US", "1")]);
    assert_rejected(&out, "blame.toml", Some("stages.mid"), "`delay_us` must be a number of microseconds");
    assert!(!out.stderr.contains("--set"), "blamed the --set argument:\n{}", out.stderr);
    assert!(!out.stderr.contains("environment"), "blamed the environment:\n{}", out.stderr);
}

#[test]
fn out_of_range_numbers_are_config_errors_not_panics() {
    for (name, set, key) in [
        ("inf-seconds", "run.max_seconds=inf", "run.max_seconds"),
        ("huge-seconds", "run.max_seconds=1e20", "run.max_seconds"),
        ("tiny-rate", "stages.source.rate_per_s=1e-30", "stages.source"),
        ("huge-delay", "stages.mid.delay_us=1e300", "stages.mid"),
    ] {
        let out = validate(name, Some(BASE), &["--set", set], &[]);
        assert_eq!(out.code, Some(2), "{set}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked") && out.stderr.contains(key), "{set}: {}", out.stderr);
    }
}

#[test]
fn type_errors_use_plain_words() {
    let cfg = edit("stages.mid", "queue = 2", r#"queue = "two""#);
    let out = validate("plain-types", Some(&cfg), &[], &[]);
    assert_rejected(&out, "plain-types.toml", Some("stages.mid.queue"), "expected an integer");
    assert!(!out.stderr.contains("i64"), "{}", out.stderr);
}
