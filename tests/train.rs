//! `step_executor/candle` through the real binary: a tiny GPT trained on real English text (the
//! repository's README, docs/ and module docs, tokenized here with a small BPE sentencepiece model and
//! written as challenge-format shards). Checks that validation loss falls, that a seed repeats a
//! run bit for bit, the challenge's log line formats, the saved weights (PyTorch `state_dict`
//! names and shapes, and a save/load round trip through `train.init_weights`), the ways a run
//! stops (iterations, wall-clock cap, end of input, Ctrl-C), and one test per kind of bad input,
//! each of which must exit non-zero without a panic and name the key or file at fault; and
//! `pipeline artifact` (quantize, compress, round-trip score) on the trained weights.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Output};
use std::time::Duration;

use candle_core::{Device, Tensor};
use common::tiny::*;
use common::{assert_fails, bin, report, text, wait_or_kill};
use pipeline::data::shard::write_shard;
use serde_json::Value;

/// `validations` as (step, val_loss, val_bpb).
fn validations(t: &serde_json::Map<String, Value>) -> Vec<(u64, f64, f64)> {
    t["validations"]
        .as_array()
        .expect("train.validations")
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["val_loss"].as_f64().unwrap(), v["val_bpb"].as_f64().unwrap()))
        .collect()
}

fn train_log(out: &Path) -> String {
    std::fs::read_to_string(out.join("train.log")).unwrap_or_else(|e| panic!("{}/train.log: {e}", out.display()))
}

fn validate(config: &Path, sets: &[&str]) -> Output {
    let mut c = bin();
    c.arg("validate").arg(config);
    for s in sets {
        c.arg("--set").arg(s);
    }
    c.output().expect("the binary runs")
}

// ---- log line parsers (the challenge's regular expressions, by hand) ----

fn digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// `\d+\.\d{places}`.
fn fixed(s: &str, places: usize) -> bool {
    s.split_once('.').is_some_and(|(a, b)| digits(a) && b.len() == places && digits(b))
}

/// `step:\d+/\d+` → (step, total).
fn step_field(s: &str) -> Option<(u64, u64)> {
    let (n, m) = s.strip_prefix("step:")?.split_once('/')?;
    (digits(n) && digits(m)).then(|| (n.parse().unwrap(), m.parse().unwrap()))
}

/// `train_time:\d+ms step_avg:\d+\.\d{2}ms`.
fn time_fields(time: &str, avg: &str) -> bool {
    time.strip_prefix("train_time:").and_then(|t| t.strip_suffix("ms")).is_some_and(digits)
        && avg.strip_prefix("step_avg:").and_then(|t| t.strip_suffix("ms")).is_some_and(|t| fixed(t, 2))
}

/// `^step:\d+/\d+ train_loss:\d+\.\d{4} train_time:\d+ms step_avg:\d+\.\d{2}ms$` → (step, total, loss).
fn parse_train_line(l: &str) -> Option<(u64, u64, f64)> {
    let p: Vec<&str> = l.split(' ').collect();
    let [step, loss, time, avg] = p.as_slice() else { return None };
    let (n, m) = step_field(step)?;
    let loss = loss.strip_prefix("train_loss:").filter(|x| fixed(x, 4))?;
    time_fields(time, avg).then(|| (n, m, loss.parse().unwrap()))
}

/// `^step:\d+/\d+ val_loss:\d+\.\d{4} val_bpb:\d+\.\d{4} train_time:\d+ms step_avg:\d+\.\d{2}ms$`
/// → (step, total, val_loss, val_bpb).
fn parse_val_line(l: &str) -> Option<(u64, u64, f64, f64)> {
    let p: Vec<&str> = l.split(' ').collect();
    let [step, loss, bpb, time, avg] = p.as_slice() else { return None };
    let (n, m) = step_field(step)?;
    let loss = loss.strip_prefix("val_loss:").filter(|x| fixed(x, 4))?;
    let bpb = bpb.strip_prefix("val_bpb:").filter(|x| fixed(x, 4))?;
    time_fields(time, avg).then(|| (n, m, loss.parse().unwrap(), bpb.parse().unwrap()))
}

/// `timing step:N/M steps:K data_wait:Xms h2d:Xms forward:Xms backward:Xms optimizer:Xms val:Xms`
/// → the phase fields in ms.
fn parse_timing_line(l: &str) -> Option<HashMap<String, f64>> {
    let mut p = l.strip_prefix("timing ")?.split(' ');
    step_field(p.next()?)?;
    p.next()?.strip_prefix("steps:").filter(|k| digits(k))?;
    let mut fields = HashMap::new();
    for kv in p {
        let (k, v) = kv.split_once(':')?;
        let v = v.strip_suffix("ms").filter(|v| fixed(v, 2))?;
        fields.insert(k.to_string(), v.parse().unwrap());
    }
    ["data_wait", "h2d", "forward", "backward", "optimizer", "val"].iter().all(|k| fields.contains_key(*k)).then_some(fields)
}

// ---- tests ----

/// 50 steps on real text: the step-0 validation scores the untrained model near ln(vocab), and
/// the step-50 validation is clearly lower.
#[test]
fn val_loss_falls_on_real_text() {
    let c = corpus("falls");
    let out = c.dir.join("run");
    let (t, o) = train_ok(&config(&c), &out, &[]);
    assert_eq!(u(&t, "steps"), 50, "{}", text(&o));
    assert_eq!(t["ended_by"], "iterations");
    let v = validations(&t);
    assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 25, 50], "{}", text(&o));
    let ln_v = (c.vocab as f64).ln();
    assert!((v[0].1 - ln_v).abs() < 0.1, "step-0 val_loss {} vs ln({}) = {ln_v}", v[0].1, c.vocab);
    assert!(v[2].1 < v[0].1 - 0.3, "val_loss did not fall: {v:?}");
    assert!(v[2].1 < v[1].1, "val_loss rose from step 25 to 50: {v:?}");
    assert_eq!(f(&t, "val_loss").to_bits(), v[2].1.to_bits(), "the report's val_loss is the last validation's");
    assert_eq!(f(&t, "val_bpb").to_bits(), v[2].2.to_bits());
    // bpb = loss / ln 2 * tokens / bytes for every validation.
    let ratio = u(&t, "val_tokens") as f64 / u(&t, "val_bytes") as f64;
    for (step, loss, bpb) in &v {
        let want = loss / std::f64::consts::LN_2 * ratio;
        assert!((bpb - want).abs() < 1e-6 * want, "step {step}: val_bpb {bpb}, expected {want}");
    }
    // The scored stream, its bytes and the unigram bar, recomputed from the shards.
    let val = shard_tokens(&c.dir.join("shards/fineweb_val_000000.bin"));
    let n = (val.len() - 1) / 32 * 32;
    assert_eq!(u(&t, "val_tokens"), n as u64);
    let bytes: u64 = (0..n).map(|i| target_bytes(val[i], val[i + 1])).sum();
    assert_eq!(u(&t, "val_bytes"), bytes);
    let mut counts = vec![0u64; c.vocab];
    for tok in shard_tokens(&c.dir.join("shards/fineweb_train_000000.bin")) {
        counts[tok as usize] += 1;
    }
    let total = (counts.iter().sum::<u64>() + c.vocab as u64) as f64;
    let bits: f64 = val[1..=n].iter().map(|&y| total.log2() - ((counts[y as usize] + 1) as f64).log2()).sum();
    let want = bits / bytes as f64;
    assert!((f(&t, "unigram_bpb") - want).abs() < 1e-9 * want, "unigram_bpb {} vs {want}", f(&t, "unigram_bpb"));
    // The unigram bar (~4.6 here) is beaten by ~0.7 bits per byte after 50 steps with any seed.
    let unigram = f(&t, "unigram_bpb");
    assert!(unigram > 0.0 && unigram < v[0].2, "unigram_bpb {unigram} should beat the untrained model's {}", v[0].2);
    assert!(v[2].2 < unigram, "final val_bpb {} is not below unigram_bpb {unigram}", v[2].2);
    let log = train_log(&out);
    assert!(log.lines().any(|l| l.starts_with(&format!("val_unigram_bpb:{unigram:.4} "))), "{log}");
    let loss = f(&t, "train_loss");
    assert!(loss.is_finite() && loss < ln_v, "train_loss {loss}");
}

/// The same seed repeats a run bit for bit (losses and weights); another seed does not.
#[test]
fn a_seed_repeats_a_run_bit_for_bit() {
    let c = corpus("determinism");
    let cfg = config(&c);
    let sets = ["train.iterations=6", "train.val_every=2"];
    let (a, _) = train_ok(&cfg, &c.dir.join("a"), &sets);
    // The number of threads copying rows into micro-batches must not matter either.
    let (b, _) = train_ok(&cfg, &c.dir.join("b"), &[sets[0], sets[1], "stages.sampler.workers=2"]);
    let (other, _) = train_ok(&cfg, &c.dir.join("other"), &[sets[0], sets[1], "run.seed=7"]);
    assert_eq!(f(&a, "train_loss").to_bits(), f(&b, "train_loss").to_bits());
    let (va, vb) = (validations(&a), validations(&b));
    assert_eq!(va.len(), 4);
    assert_eq!(va.len(), vb.len());
    for (x, y) in va.iter().zip(&vb) {
        assert_eq!((x.0, x.1.to_bits(), x.2.to_bits()), (y.0, y.1.to_bits(), y.2.to_bits()), "validation at step {}", x.0);
    }
    // Nor the upload implementation: `sync` onto `run.device` = "cpu" is the `cpu` upload.
    let (s, _) = train_ok(&cfg, &c.dir.join("sync"), &[sets[0], sets[1], "stages.upload.impl=\"sync\""]);
    assert_eq!(f(&a, "train_loss").to_bits(), f(&s, "train_loss").to_bits());
    let w = |d: &str| std::fs::read(c.dir.join(d).join("final_model.safetensors")).unwrap();
    assert!(w("a") == w("b"), "the weights differ between two runs with the same seed");
    assert!(w("a") == w("sync"), "the weights differ between the cpu and sync uploads");
    assert!(w("a") != w("other"), "another seed gave the same weights");
    assert_ne!(f(&a, "train_loss").to_bits(), f(&other, "train_loss").to_bits());
    assert_ne!(validations(&other)[0].1.to_bits(), va[0].1.to_bits(), "another seed, same initial val_loss");
}

/// train.log and stdout hold the challenge script's lines.
#[test]
fn logs_have_the_challenge_formats() {
    let c = corpus("log");
    let out = c.dir.join("run");
    let (t, o) = train_ok(&config(&c), &out, &["train.iterations=12", "train.val_every=6", "train.timing_every=6"]);
    let log = train_log(&out);
    let lines: Vec<&str> = log.lines().collect();
    let train: Vec<(u64, u64, f64)> = lines.iter().filter_map(|l| parse_train_line(l)).collect();
    let val: Vec<(u64, u64, f64, f64)> = lines.iter().filter_map(|l| parse_val_line(l)).collect();
    // Steps 1 to 10, then every log_every = 10, and the last.
    assert_eq!(train.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12], "{log}");
    assert!(train.iter().all(|x| x.1 == 12), "{log}");
    assert_eq!(val.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 6, 12], "{log}");
    let last = train.last().unwrap();
    assert!((last.2 - f(&t, "train_loss")).abs() <= 5e-5, "logged {} vs reported {}", last.2, f(&t, "train_loss"));
    for ((_, _, loss, bpb), (_, l, b)) in val.iter().zip(validations(&t)) {
        assert!((loss - l).abs() <= 5e-5 && (bpb - b).abs() <= 5e-5, "logged {loss} {bpb} vs reported {l} {b}");
    }
    // Lines that start like these must match them exactly.
    for l in &lines {
        if l.starts_with("step:") {
            assert!(parse_train_line(l).is_some() || parse_val_line(l).is_some(), "malformed step line: {l:?}");
        }
    }
    let params = u(&t, "model_params");
    assert!(lines.contains(&format!("model_params:{params}").as_str()), "{log}");
    assert!(lines.contains(&"world_size:1 grad_accum_steps:1"), "{log}");
    let timing: Vec<_> = lines.iter().filter(|l| l.starts_with("timing ")).collect();
    assert_eq!(timing.len(), 2, "{log}");
    for l in timing {
        let p = parse_timing_line(l).unwrap_or_else(|| panic!("malformed timing line: {l:?}"));
        assert!(p["forward"] > 0.0 && p["backward"] > 0.0 && p["optimizer"] > 0.0, "{l}");
    }
    // stdout (not a terminal) holds the same lines in the same order.
    let stdout = String::from_utf8_lossy(&o.stdout);
    let mut rest = stdout.lines();
    for l in &lines {
        assert!(rest.any(|s| s == *l), "train.log line {l:?} not on stdout (in order)\n{}", text(&o));
    }
    let per_step = t["timing_ms_per_step"].as_object().expect("train.timing_ms_per_step");
    for k in ["data_wait", "h2d", "forward", "backward", "optimizer", "validation"] {
        assert!(per_step[k].as_f64().is_some_and(|x| x >= 0.0), "timing_ms_per_step.{k}: {per_step:?}");
    }
    assert!(per_step["forward"].as_f64().unwrap() > 0.0, "{per_step:?}");
    // The attention implementation and auto's trials are a GPU run's; the keys are there, empty.
    assert!(t.contains_key("attention") && t["attention"].is_null() && t["attention_auto"].is_null(), "{t:?}");
    let grad2 = c.dir.join("accum");
    let (t2, _) = train_ok(&config(&c), &grad2, &["train.iterations=2", "train.grad_accum_steps=2"]);
    assert_eq!(u(&t2, "tokens"), 2 * 256, "two micro-batches of 4 rows per step");
    assert!(train_log(&grad2).lines().any(|l| l == "world_size:1 grad_accum_steps:2"), "{}", train_log(&grad2));
}

/// Expected `state_dict` names and shapes of the baseline for the test model.
fn expected_tensors(vocab: usize) -> Vec<(String, Vec<usize>)> {
    let (d, kv, hidden) = (32, 16, 64);
    let mut v = vec![("tok_emb.weight".to_string(), vec![vocab, d]), ("skip_weights".into(), vec![1, d])];
    for i in 0..2 {
        let p = |s: &str| format!("blocks.{i}.{s}");
        v.extend([
            (p("attn.c_q.weight"), vec![d, d]),
            (p("attn.c_k.weight"), vec![kv, d]),
            (p("attn.c_v.weight"), vec![kv, d]),
            (p("attn.proj.weight"), vec![d, d]),
            (p("attn.q_gain"), vec![2]),
            (p("mlp.fc.weight"), vec![hidden, d]),
            (p("mlp.proj.weight"), vec![d, hidden]),
            (p("attn_scale"), vec![d]),
            (p("mlp_scale"), vec![d]),
            (p("resid_mix"), vec![2, d]),
        ]);
    }
    v.sort();
    v
}

/// The saved weights carry the PyTorch names and shapes, and loading them back scores the
/// validation split exactly as the run that saved them did.
#[test]
fn weights_have_the_state_dict_names_and_load_back() {
    let c = corpus("weights");
    let cfg = config(&c);
    let first = c.dir.join("first");
    let (t, o) = train_ok(&cfg, &first, &["train.iterations=4", "train.val_every=2"]);
    let path = first.join("final_model.safetensors");
    assert_eq!(t["weights"].as_str(), Some(path.display().to_string().as_str()), "{}", text(&o));
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let mut got: Vec<(String, Vec<usize>)> = tensors.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
    got.sort();
    assert_eq!(got, expected_tensors(c.vocab));
    let count: usize = tensors.values().map(Tensor::elem_count).sum();
    assert_eq!(count as u64, u(&t, "model_params"));
    for (n, t) in &tensors {
        assert_eq!(t.dtype(), candle_core::DType::F32, "{n}");
    }
    // The zero-initialised projections have trained.
    let proj: Vec<f32> = tensors["blocks.0.attn.proj.weight"].flatten_all().unwrap().to_vec1().unwrap();
    assert!(proj.iter().any(|&x| x != 0.0), "attn.proj never moved from its zero init");

    let second = c.dir.join("second");
    let init = format!("train.init_weights={}", lit(path.display().to_string()));
    let (t2, o2) = train_ok(&cfg, &second, &[&init, "train.iterations=1", "train.val_every=1", "run.seed=99"]);
    let v2 = validations(&t2);
    assert_eq!(v2[0].0, 0, "{}", text(&o2));
    assert_eq!(
        v2[0].1.to_bits(),
        f(&t, "val_loss").to_bits(),
        "step-0 val_loss from the loaded weights {} vs the saving run's final {}",
        v2[0].1,
        f(&t, "val_loss")
    );
    assert_eq!(v2[0].2.to_bits(), f(&t, "val_bpb").to_bits());
}

/// `train.iterations` ends a run after exactly that many steps.
#[test]
fn iterations_end_the_run() {
    let c = corpus("iterations");
    let out = c.dir.join("run");
    let (t, o) = train_ok(&config(&c), &out, &["train.iterations=3", "train.val_every=0", "run.warmup_items=0"]);
    assert_eq!(u(&t, "steps"), 3, "{}", text(&o));
    // The batches still in flight after the last step are dropped, and not timed as steps:
    // the executor's service times (what `pipeline advise` simulates) are the 3 steps alone.
    let r = report(&out);
    let ex = &r.stages["train"];
    assert_eq!(ex.service_us.count, 3, "{ex:?}");
    assert_eq!(ex.items_dropped, ex.items_in - 3, "{ex:?}");
    assert_eq!(t["ended_by"], "iterations");
    assert_eq!(u(&t, "tokens"), 3 * 256);
    assert_eq!(validations(&t).iter().map(|v| v.0).collect::<Vec<_>>(), [3], "val_every = 0: only the final validation");
    assert!(!train_log(&out).contains("stopping_early"));
    assert!(out.join("final_model.safetensors").exists());
}

/// A tiny wall-clock cap ends a long run early, with a final validation at the last step.
#[test]
fn wallclock_cap_ends_the_run() {
    let c = corpus("wallclock");
    let out = c.dir.join("run");
    let (t, o) = train_ok(&config(&c), &out, &["train.iterations=100000", "train.max_wallclock_seconds=0.5", "train.val_every=0"]);
    assert_eq!(t["ended_by"], "wallclock_cap", "{}", text(&o));
    let steps = u(&t, "steps");
    assert!((1..100000).contains(&steps), "steps {steps}");
    assert!(f(&t, "train_time_ms") >= 500.0, "stopped before the cap: {} ms", f(&t, "train_time_ms"));
    let log = train_log(&out);
    assert!(log.lines().any(|l| l.starts_with("stopping_early: wallclock_cap ")), "{log}");
    let v = validations(&t);
    assert_eq!(v.last().map(|v| v.0), Some(steps), "final validation at the last step: {v:?}");
    assert!(log.lines().filter_map(parse_val_line).any(|x| x.0 == steps), "{log}");
}

/// After Ctrl-C: exit 130, status and `ended_by` "interrupted", a `stopping_early: interrupted`
/// line, and saved weights that load and match the steps taken; returns the steps.
fn assert_interrupted(child: &mut Child, c: &Corpus, out: &Path) -> u64 {
    let status = wait_or_kill(child, Duration::from_secs(60), "interrupted training");
    let log = std::fs::read_to_string(out.join("train.log")).unwrap_or_default();
    assert_eq!(status.code(), Some(130), "{log}");
    let r = report(out);
    assert_eq!(r.run.status, "interrupted", "{:?}", r.run.error);
    assert_eq!(r.train.get("ended_by"), Some(&Value::from("interrupted")), "{log}");
    let steps = u(&r.train, "steps");
    assert!(log.lines().any(|l| l.starts_with("stopping_early: interrupted")), "{log}");
    let path = out.join("final_model.safetensors");
    let w = pipeline::model::weights::load(&path, None).unwrap();
    assert_eq!(w.len(), expected_tensors(c.vocab).len());
    let saved = format!("saved weights: {} (step {steps})", path.display());
    assert!(log.lines().any(|l| l == saved), "no `{saved}` line\n{log}");
    steps
}

/// Ctrl-C during training: exit 130, a report saying so, and weights that load.
#[test]
fn ctrl_c_saves_the_weights_and_reports_interrupted() {
    let c = corpus("ctrlc");
    let out = c.dir.join("run");
    let mut child = spawn_run(&c, &out, &["train.iterations=100000", "train.val_every=0"]);
    wait_for_line(&mut child, &out, |l| parse_train_line(l).is_some());
    std::thread::sleep(Duration::from_millis(200));
    sigint(&child);
    let steps = assert_interrupted(&mut child, &c, &out);
    assert!((1..100000).contains(&steps), "steps {steps}");
}

/// Ctrl-C while a periodic validation runs (longer than `run.drain_timeout_ms`): the run must
/// still end as interrupted with its trained weights saved, as after Ctrl-C during a step.
#[test]
fn ctrl_c_during_validation_still_saves_the_weights() {
    // 8 copies of the val documents (177,664 tokens): a validation takes about 2 s in the test
    // build (measured on 2 cores), four times the drain timeout; the step-0 one comes before
    // the awaited line.
    let c = corpus_with("ctrlc-val", 8);
    let out = c.dir.join("run");
    let mut child = spawn_run(&c, &out, &["train.iterations=100000", "train.val_every=2", "run.drain_timeout_ms=500"]);
    // The step-2 train line is logged just before the step-2 validation starts.
    wait_for_line(&mut child, &out, |l| parse_train_line(l).is_some_and(|x| x.0 == 2));
    sigint(&child);
    let steps = assert_interrupted(&mut child, &c, &out);
    assert!(steps >= 2, "steps {steps}");
}

/// When the input ends first (the sampler's `max_steps`), the run ends there, validated and saved.
#[test]
fn input_end_ends_the_run() {
    let c = corpus("input-end");
    let out = c.dir.join("run");
    let (t, o) = train_ok(&config(&c), &out, &["stages.sampler.max_steps=3", "train.val_every=0"]);
    assert_eq!(u(&t, "steps"), 3, "{}", text(&o));
    assert_eq!(t["ended_by"], "input_ended");
    assert_eq!(u(&t, "dropped_micro_batches"), 0);
    assert_eq!(validations(&t).iter().map(|v| v.0).collect::<Vec<_>>(), [3], "final validation");
    assert!(out.join("final_model.safetensors").exists());
}

// ---- bad input ----

#[test]
fn tokenizer_vocab_differs_from_model_vocab_size() {
    let c = corpus("bad-vocab");
    let vocab = format!("model.vocab_size={}", c.vocab + 8);
    let o = run_limited(&config(&c), &c.dir.join("run"), &[&vocab]);
    assert_fails(&o, &["`model.vocab_size`", &c.tokenizer.display().to_string()]);
}

/// `pipeline validate` ("lists every problem") should reject what `run` rejects as a config
/// error (exit 2) before training: here a tokenizer whose size differs from `model.vocab_size`.
#[test]
fn validate_rejects_a_vocab_mismatch() {
    let c = corpus("validate-vocab");
    let vocab = format!("model.vocab_size={}", c.vocab + 8);
    let o = validate(&config(&c), &[&vocab]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["`model.vocab_size`", &c.tokenizer.display().to_string()]);
}

/// As above, for `train.init_weights` naming a file that does not exist.
#[test]
fn validate_rejects_missing_init_weights() {
    let c = corpus("validate-init");
    let missing = c.dir.join("absent.safetensors");
    let init = format!("train.init_weights={}", lit(missing.display().to_string()));
    let o = validate(&config(&c), &[&init]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["absent.safetensors"]);
}

#[test]
fn data_val_unset() {
    let c = corpus("no-val");
    let cfg = config_with(&c, "noval", false);
    let o = validate(&cfg, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["`data.val`"]);
    let o = run_limited(&cfg, &c.dir.join("run"), &[]);
    assert_fails(&o, &["`data.val`"]);
}

#[test]
fn cuda_device_in_a_cpu_build() {
    let c = corpus("cuda");
    let o = run_limited(&config(&c), &c.dir.join("run"), &["run.device=\"cuda:0\""]);
    assert_fails(&o, &["`run.device`"]);
}

/// The GPU's page-locked buffers and copy stream are refused with a clear message in a CPU
/// build (and on a CPU device in a cuda build).
#[test]
fn pinned_and_stream_uploads_need_a_gpu() {
    let c = corpus("pinned");
    let o = run_limited(&config(&c), &c.dir.join("pinned"), &["stages.pin.impl=\"pinned\""]);
    assert_fails(&o, &["pin/pinned", "pageable"]);
    let o = run_limited(&config(&c), &c.dir.join("stream"), &["stages.upload.impl=\"stream\""]);
    assert_fails(&o, &["upload/stream"]);
}

#[test]
fn bf16_on_the_cpu_is_refused() {
    let c = corpus("bf16");
    let o = run_limited(&config(&c), &c.dir.join("run"), &["stages.train.dtype=\"bf16\""]);
    assert_fails(&o, &["`dtype`", "bf16"]);
}

/// Flash attention is a CUDA kernel: asking for it (either implementation) on the CPU is refused
/// before training, naming the key, the value and the reason; "materialized" and the default
/// "auto" train.
#[test]
fn flash_attention_on_the_cpu_is_refused() {
    let c = corpus("flash");
    let o = run_limited(&config(&c), &c.dir.join("run"), &["stages.train.attention=\"flash\""]);
    assert_fails(&o, &["`attention`", "flash", "cuda"]);
    let o = run_limited(&config(&c), &c.dir.join("mma"), &["stages.train.attention=\"flash_mma\""]);
    assert_fails(&o, &["`attention`", "\"flash_mma\" cannot run", "cuda"]);
    let o = run_limited(&config(&c), &c.dir.join("typo"), &["stages.train.attention=\"flsh\""]);
    assert_fails(&o, &["`stages.train.attention`", "flsh", "materialized"]);
    train_ok(&config(&c), &c.dir.join("ok"), &["train.iterations=1", "train.val_every=0", "stages.train.attention=\"materialized\""]);
}

#[test]
fn init_weights_not_safetensors() {
    let c = corpus("bad-weights");
    let cfg = config(&c);
    let first = c.dir.join("first");
    train_ok(&cfg, &first, &["train.iterations=1", "train.val_every=0"]);
    let bytes = std::fs::read(first.join("final_model.safetensors")).unwrap();
    let cut = c.dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let junk = c.dir.join("junk.safetensors");
    std::fs::write(&junk, "these are not weights\n").unwrap();
    for p in [&cut, &junk] {
        let init = format!("train.init_weights={}", lit(p.display().to_string()));
        let o = run_limited(&cfg, &c.dir.join("run"), &[&init]);
        assert_fails(&o, &[&p.display().to_string()]);
    }
}

#[test]
fn init_weights_of_another_shape() {
    let c = corpus("shape");
    let cfg = config(&c);
    let first = c.dir.join("first");
    train_ok(&cfg, &first, &["train.iterations=1", "train.val_every=0", "model.model_dim=16"]);
    let init = format!("train.init_weights={}", lit(first.join("final_model.safetensors").display().to_string()));
    let o = run_limited(&cfg, &c.dir.join("run"), &[&init]);
    assert_fails(&o, &["final_model.safetensors", "tensor `"]);
}

#[test]
fn train_token_beyond_the_vocabulary() {
    let c = corpus("bad-token");
    // Every 7th training token is out of range, so the first micro-batch holds one.
    let train = c.dir.join("shards/fineweb_train_000000.bin");
    let mut tokens = shard_tokens(&train);
    for t in tokens.iter_mut().step_by(7) {
        *t = c.vocab as u16 + 3;
    }
    write_shard(&train, &tokens).unwrap();
    let o = run_limited(&config(&c), &c.dir.join("run"), &["stages.sampler.check_tokens=false"]);
    assert_fails(&o, &["`model.vocab_size`", &format!("token id {}", c.vocab + 3)]);
}

/// A failure after some steps keeps what training made: the weights of the last finished
/// step are saved and the report's `train` section says how far it got.
#[test]
fn a_failure_mid_run_keeps_the_weights_and_the_train_report() {
    let c = corpus("late-failure");
    // The sequential stream reads the train shard in order: the first 3 steps (8 rows x 32
    // tokens, plus one) are clean, then every 7th token is out of range.
    let train = c.dir.join("shards/fineweb_train_000000.bin");
    let mut tokens = shard_tokens(&train);
    for t in tokens.iter_mut().skip(3 * 257 + 5).step_by(7) {
        *t = c.vocab as u16 + 3;
    }
    write_shard(&train, &tokens).unwrap();
    let out = c.dir.join("run");
    let o =
        run_limited(&config(&c), &out, &["stages.sampler.impl=\"sequential\"", "stages.sampler.check_tokens=false", "train.val_every=0"]);
    assert_fails(&o, &["`model.vocab_size`"]);
    assert_eq!(o.status.code(), Some(1));
    let t = report(&out).train;
    assert_eq!(t["ended_by"], "failed", "{t:?}");
    let steps = u(&t, "steps");
    assert!((1..=3).contains(&steps), "failed after {steps} steps");
    let w = pipeline::model::weights::load(&out.join("final_model.safetensors"), None).expect("the weights were saved");
    assert!(w.contains_key("tok_emb.weight"));
    assert!(train_log(&out).contains(&format!("saved weights: {}", out.join("final_model.safetensors").display())));
}

#[test]
fn typo_in_train_table() {
    let c = corpus("typo");
    let cfg = config_with(&c, "typo", true);
    let fixed = std::fs::read_to_string(&cfg).unwrap().replace("iterations = 50", "iteratons = 50");
    std::fs::write(&cfg, fixed).unwrap();
    let o = validate(&cfg, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["iteratons"]);
}

/// Runs `pipeline artifact WEIGHTS --config CONFIG` plus `args`.
fn artifact(weights: &Path, config: &Path, args: &[&str]) -> Output {
    bin().arg("artifact").arg(weights).arg("--config").arg(config).args(args).output().expect("the binary runs")
}

#[test]
fn artifact_round_trip_scores_the_dequantized_weights() {
    let c = corpus("artifact");
    let cfg = config(&c);
    let out = c.dir.join("run");
    let (t, _) = train_ok(&cfg, &out, &["train.iterations=20", "train.val_every=0"]);
    let weights = out.join("final_model.safetensors");
    for (bits, codec) in [("8", "zlib"), ("6", "zstd"), ("8", "brotli")] {
        let o = artifact(&weights, &out.join("config.toml"), &["--bits", bits, "--codec", codec]);
        let s = text(&o);
        assert!(o.status.success(), "{s}");
        let file = out.join(format!("final_model.int{bits}.{codec}.pgqz"));
        let size = std::fs::metadata(&file).unwrap().len();
        assert!(s.contains(&format!("Serialized model int{bits}+{codec}: {size} bytes")), "{s}");
        // The pre-quantization score is the run's own final validation (the records' format).
        let pre = s.lines().find(|l| l.starts_with("pre-quantization val_loss:")).expect("pre-quantization line");
        let pre_bpb: f64 = pre.split("val_bpb:").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!((pre_bpb - f(&t, "val_bpb")).abs() < 1e-4 && pre.contains(" eval_time:"), "{pre} vs {}", f(&t, "val_bpb"));
        assert!(s.lines().any(|l| l.starts_with("quantized val_loss:")), "{s}");
        let exact = s.lines().find(|l| l.starts_with(&format!("final_int{bits}_{codec}_roundtrip_exact "))).expect("exact line");
        let bpb: f64 = exact.split("val_bpb:").nth(1).unwrap().trim().parse().unwrap();
        assert!((bpb - f(&t, "val_bpb")).abs() < 0.1, "round trip {bpb} vs {}", f(&t, "val_bpb"));
        assert!(bpb != f(&t, "val_bpb"), "quantization changed nothing: the round trip did not use the artifact?");
    }
}

#[test]
fn artifact_bad_inputs_are_named() {
    let c = corpus("artifact-bad");
    let cfg = config(&c);
    let out = c.dir.join("run");
    train_ok(&cfg, &out, &["train.iterations=1", "train.val_every=0"]);
    let weights = out.join("final_model.safetensors");
    let o = artifact(&weights, &out.join("config.toml"), &["--set", "model.num_layers=3"]);
    assert_fails(&o, &["blocks.2"]);
    let cut = c.dir.join("cut.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 3]).unwrap();
    assert_fails(&artifact(&cut, &out.join("config.toml"), &[]), &["cut.safetensors"]);
    let o = artifact(&weights, &out.join("config.toml"), &["--bits", "9"]);
    assert!(!o.status.success() && !text(&o).contains("panicked"), "{}", text(&o));
    // A bad value in the config's artifact stage is named with the stage.
    let with_stage = c.dir.join("with-artifact.toml");
    let text_of = std::fs::read_to_string(out.join("config.toml")).unwrap();
    std::fs::write(&with_stage, text_of + "\n[stages.pack]\nkind = \"artifact\"\nimpl = \"gptq\"\ninputs = [\"train\"]\nclip = \"sd\"\n")
        .unwrap();
    assert_fails(&artifact(&weights, &with_stage, &[]), &["stages.pack", "sd"]);
}

/// `--method gptq` calibrates on the config's training data and writes an artifact the
/// round trip scores; the config's artifact stage supplies the scheme.
#[test]
fn artifact_gptq_on_saved_weights() {
    let c = corpus("artifact-gptq");
    let cfg = config(&c);
    let out = c.dir.join("run");
    train_ok(&cfg, &out, &["train.iterations=10", "train.val_every=0"]);
    let weights = out.join("final_model.safetensors");
    // The config's own artifact stage gives the implementation and the settings; --set and
    // the flags go on top.
    let with_stage = c.dir.join("with-artifact.toml");
    let text_of = std::fs::read_to_string(out.join("config.toml")).unwrap();
    let stage = "\n[stages.pack]\nkind = \"artifact\"\nimpl = \"gptq\"\ninputs = [\"train\"]\ncalibration_batches = 3\n";
    std::fs::write(&with_stage, text_of + stage).unwrap();
    let o = artifact(&weights, &with_stage, &["--bits", "6", "--codec", "brotli", "--set", "stages.pack.calibration_batches=2"]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    assert!(s.contains("gptq:collected ") && s.contains(" from 2 calibration batches"), "{s}");
    assert!(s.contains("Code size: ") && s.contains("Total submission size int6+brotli: "), "{s}");
    assert!(s.lines().any(|l| l.starts_with("quantized val_loss:")), "{s}");
    assert!(out.join("final_model.int6.brotli.pgqz").is_file());
}

/// Trains `cfg` with `sets` on `executor`, traced: its output, the trace's directory, its
/// trace.json and the tokens of its batches.
fn traced(cfg: &Path, out: &Path, sets: &[&str], executor: &str) -> (Output, std::path::PathBuf, Value, Vec<u16>) {
    let impl_set = format!("stages.train.impl={executor}");
    let mut all: Vec<&str> = sets.to_vec();
    all.push(&impl_set);
    let (_, o) = train_ok(cfg, out, &all);
    let trace = out.join("step_trace");
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(trace.join("trace.json")).unwrap()).unwrap();
    let bytes = std::fs::read(trace.join("batches.u16")).unwrap();
    let tokens = bytes.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    (o, trace, meta, tokens)
}

/// `step_trace = true` writes what another trainer needs to take the same steps and compare
/// (scripts/compare-record.py): the initial weights, every micro-batch as trained (targets the
/// inputs shifted by one, windows of the training shards), a row per step whose losses are the
/// run's own, and weights after the listed and the last steps equal to the run's; on both
/// executors. (A resumed run is refused a trace: tests/checkpoint_faults.rs.)
#[test]
fn the_trace_holds_the_initial_weights_every_batch_and_every_step() {
    let c = corpus("trace");
    let cfg = config(&c);
    let shard: Vec<u16> = shard_tokens(&c.dir.join("shards/fineweb_train_000000.bin"));
    for executor in ["candle", "engine"] {
        let out = c.dir.join(executor);
        let sets = [
            "train.iterations=3",
            "train.val_every=0",
            "train.grad_accum_steps=2",
            "train.grad_clip_norm=1.0",
            "stages.train.step_trace=true",
            "stages.train.step_trace_weights_at=[2]",
            "train.save_weights=true",
        ];
        let (o, trace, meta, tokens) = traced(&cfg, &out, &sets, executor);
        let (rows, seq, micro) = (meta["rows"].as_u64().unwrap() as usize, meta["seq_len"].as_u64().unwrap() as usize, 2usize);
        assert_eq!((rows * seq * micro, meta["micro_steps"].as_u64()), (256, Some(2)), "{meta}");
        assert_eq!(tokens.len(), 3 * micro * 2 * rows * seq, "{executor}");
        for mb in tokens.chunks(2 * rows * seq) {
            let (x, y) = mb.split_at(rows * seq);
            for r in 0..rows {
                let (xr, yr) = (&x[r * seq..(r + 1) * seq], &y[r * seq..(r + 1) * seq]);
                assert_eq!(&xr[1..], &yr[..seq - 1], "{executor}: targets are the inputs shifted by one");
                let mut window = xr.to_vec();
                window.push(yr[seq - 1]);
                assert!(shard.windows(seq + 1).any(|w| w == window.as_slice()), "{executor}: a traced row is not a window of the shard");
            }
        }
        let ours: Vec<String> = std::fs::read_to_string(out.join("steps.tsv")).unwrap().lines().skip(1).map(String::from).collect();
        let traced: Vec<String> = std::fs::read_to_string(trace.join("steps.tsv")).unwrap().lines().skip(1).map(String::from).collect();
        assert_eq!(traced.len(), 3, "{executor}: {traced:?}");
        for (a, b) in ours.iter().zip(&traced) {
            let (a, b): (Vec<&str>, Vec<&str>) = (a.split('\t').collect(), b.split('\t').collect());
            assert_eq!((a[0], a[1]), (b[0], b[1]), "{executor}: the trace's step and loss are the run's");
            assert!(b[2].parse::<f64>().unwrap() > 0.0, "{executor}: clipping on, so a gradient norm: {b:?}");
        }
        let load = |p: &Path| candle_core::safetensors::load(p, &Device::Cpu).unwrap();
        let last = load(&trace.join("weights_3.safetensors"));
        let saved = load(&out.join("final_model.safetensors"));
        let init = load(&trace.join("weights_0.safetensors"));
        assert!(trace.join("weights_2.safetensors").is_file() && !trace.join("weights_1.safetensors").exists(), "{}", text(&o));
        for (name, t) in &saved {
            let a: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = last[name].flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(a, b, "{executor}: {name} after the last step");
        }
        let proj: Vec<f32> = init["blocks.0.attn.proj.weight"].flatten_all().unwrap().to_vec1().unwrap();
        assert!(proj.iter().all(|&v| v == 0.0), "{executor}: weights_0 is the zero-initialised projection before any step");
    }
}

/// `window_sampler/packed_docs` through the binary, on both executors: each micro-batch is one
/// row of all its tokens (the trace's rows 1 x 128), read straight through the shard from its
/// first BOS, one token (a target only) between micro-batches, as the 04-27 record's loader
/// reads; both executors take the same steps on them (documents cut every 32) and validate
/// alike in packed batches (`train.val_packed`); and with
/// `model.document_max_len = 0` the sampler refuses to start, naming the key.
#[test]
fn packed_docs_trains_one_row_a_micro_batch_on_both_executors() {
    let c = corpus("packed");
    let cfg = config(&c);
    let shard: Vec<u16> = shard_tokens(&c.dir.join("shards/fineweb_train_000000.bin"));
    let first = shard.iter().position(|&t| t == 1).expect("the corpus's documents start with BOS");
    let sets = [
        "train.iterations=3",
        "train.val_every=0",
        "train.grad_accum_steps=2",
        "stages.sampler.impl=packed_docs",
        "model.document_attention=true",
        "model.document_max_len=32",
        "train.val_packed=true",
        "stages.train.step_trace=true",
    ];
    let (mut losses, mut vals): (Vec<Vec<f64>>, Vec<f64>) = (Vec::new(), Vec::new());
    for executor in ["candle", "engine"] {
        let out = c.dir.join(executor);
        let (o, trace, meta, tokens) = traced(&cfg, &out, &sets, executor);
        assert_eq!((meta["rows"].as_u64(), meta["seq_len"].as_u64()), (Some(1), Some(128)), "{executor}: {meta}\n{}", text(&o));
        vals.push(report(&out).train["val_loss"].as_f64().unwrap());
        assert_eq!(tokens.len(), 6 * 2 * 128, "{executor}");
        for (k, mb) in tokens.chunks(2 * 128).enumerate() {
            let at = first + k * 129;
            assert_eq!(&mb[..128], &shard[at..at + 128], "{executor}: micro-batch {k}'s inputs");
            assert_eq!(&mb[128..], &shard[at + 1..at + 129], "{executor}: micro-batch {k}'s targets");
        }
        let steps = std::fs::read_to_string(trace.join("steps.tsv")).unwrap();
        losses.push(steps.lines().skip(1).map(|l| l.split('\t').nth(1).unwrap().parse().unwrap()).collect());
    }
    for (a, b) in losses[0].iter().zip(&losses[1]) {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "candle {:?} vs engine {:?}", losses[0], losses[1]);
    }
    assert!((vals[0] - vals[1]).abs() <= 1e-4 * vals[0], "packed validation: candle {} vs engine {}", vals[0], vals[1]);
    let o = run_limited(
        &cfg,
        &c.dir.join("uncut"),
        &["train.iterations=1", "stages.sampler.impl=packed_docs", "model.document_attention=true"],
    );
    assert_fails(&o, &["model.document_max_len", "packed_docs"]);
}
