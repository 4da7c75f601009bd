//! The rules over made-up run directories: each refusal with its figure, the significance
//! figures against a hand computation, and the folder.

use std::path::{Path, PathBuf};

use serde_json::json;

use super::figures::RunFigures;
use super::folder::{Entry, write};
use super::rules::Outcome;
use super::{Against, Submission};

/// A scratch folder removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("pipeline-submission-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A finished run's directory: `val_loss` nats on 65,536 targets of 158,340 bytes, a
/// 1,301,520-byte model and 609,873 bytes of code, 223.2 s of training and 2.4 s of GPTQ.
fn run_dir(root: &Path, seed: u64, val_loss: f64, edit: impl FnOnce(&mut serde_json::Value, &mut String)) -> PathBuf {
    let dir = root.join(format!("seed{seed}"));
    std::fs::create_dir_all(&dir).unwrap();
    let bpb = val_loss / (std::f64::consts::LN_2 * 158_340.0 / 65_536.0);
    let mut report = json!({
        "run": { "name": "record-mini", "status": "completed", "hardware": "1 x cpu (test)" },
        "train": { "steps": 300, "step_avg_ms": 743.9, "train_time_ms": 223_168.9, "val_bpb": bpb + 0.01, "val_bytes": 158_340 },
        "artifact": {
            "path": "final_model.int6.brotli.pgqz",
            "method": "gptq",
            "before": { "val_loss": val_loss - 0.02, "val_bpb": bpb - 0.008, "eval_ms": 2776.0 },
            "after": { "val_loss": val_loss + 0.02, "val_bpb": bpb + 0.008, "eval_ms": 2973.4 },
            "bytes": 1_301_520, "code_bytes": 609_873,
            "code": { "measured": {
                "file": "source.tar.xz", "files": 197, "raw_bytes": 2_287_348, "stripped_bytes": 979_208, "bytes": 609_873,
                "sha256": "aa11", "lock_sha256": "bb22",
                "build": { "version": "0.1.0", "features": ["cuda"], "profile": "release" }
            } },
            "quantized_values": 35_000_000, "lqer_bytes": 0, "bits": 6, "clip": "sd_clip", "clip_sigmas": 12.85,
            "reserve_ms": 2398.0, "compress_ms": 1145.7, "restore_ms": 12.2, "val_tokens": 65_536
        },
        "eval": {
            "weights": "quantized",
            "sliding": { "val_loss": val_loss + 0.004, "val_bpb": bpb + 0.002, "val_tokens": 65_536, "val_bytes": 158_340, "eval_ms": 10_339.3 },
            "ttt": { "val_loss": val_loss, "val_bpb": bpb, "val_tokens": 65_536, "val_bytes": 158_340, "eval_ms": 44_200.1 }
        }
    });
    let mut config =
        format!("[run]\nname = \"record-mini\"\nseed = {seed}\ndevice = \"cpu\"\n\n[model]\nnum_layers = 4\nmodel_dim = 128\n");
    edit(&mut report, &mut config);
    // The artifact the report names, of its size (sparse) and with its SHA-256 recorded.
    if let Some(bytes) = report["artifact"]["bytes"].as_u64() {
        let file = dir.join("final_model.int6.brotli.pgqz");
        std::fs::File::create(&file).unwrap().set_len(bytes).unwrap();
        if report["artifact"].get("sha256").is_none() {
            report["artifact"]["sha256"] = json!(crate::runtime::files::sha256_file(&file).unwrap());
        }
    }
    std::fs::write(dir.join("report.json"), serde_json::to_vec(&report).unwrap()).unwrap();
    std::fs::write(dir.join("config.toml"), config).unwrap();
    std::fs::write(dir.join("train.log"), format!("seed:{seed}\nquantized_ttt val_loss:{val_loss:.8}\n")).unwrap();
    std::fs::write(dir.join("report.html"), "<html></html>").unwrap();
    dir
}

fn load(dirs: &[PathBuf]) -> Vec<RunFigures> {
    dirs.iter().map(|d| RunFigures::load(d).unwrap()).collect()
}

fn three(root: &Path) -> Vec<PathBuf> {
    [(42, 2.30), (0, 2.31), (1234, 2.32)].iter().map(|&(s, l)| run_dir(root, s, l, |_, _| ())).collect()
}

fn check<'a>(s: &'a Submission, name: &str) -> &'a super::rules::Check {
    s.checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no check {name}: {:?}", s.checks))
}

#[test]
fn three_good_seeds_pass_and_read_their_figures() {
    let t = Scratch::new("good");
    let runs = load(&three(&t.0));
    let r = &runs[0];
    assert_eq!((r.seed, r.steps, r.total_bytes()), (42, 300, Some(1_911_393)));
    assert!((r.train_s() - 225.5669).abs() < 1e-3 && (r.eval_s() - (12.2 + 2973.4 + 10_339.3 + 44_200.1) / 1e3).abs() < 1e-9);
    assert_eq!(r.score.label, "quantized_ttt");
    let s = Submission::check(runs, 3, &Against::Bpb(1.5), vec![]);
    assert!(s.passed(), "{:#?}", s.failures());
    let c = check(&s, "size seed 42");
    assert!(
        c.figure.starts_with(
            "1,911,393 bytes = model 1,301,520 + code 609,873 (source.tar.xz of the pipeline 0.1.0, lean record build (cuda), release: 197 source files"
        ),
        "{c:?}"
    );
    let c = check(&s, "train time seed 0");
    assert!(
        c.figure.starts_with("225.6 s on 1 x cpu (test) (not the rules' hardware: the time does not carry over) = training loop"),
        "{c:?}"
    );
    assert_eq!(check(&s, "one code").figure, "every seed was trained by the same source.tar.xz (609,873 bytes, SHA-256 aa11)");
    assert_eq!(check(&s, "seeds").figure, "3 distinct seed(s): 0, 42, 1234");
}

#[test]
fn each_broken_rule_is_refused_with_its_figure() {
    let t = Scratch::new("broken");
    let root = &t.0;
    let mut dirs = three(root);
    // Over the cap by one byte.
    dirs[1] = run_dir(&root.join("cap"), 0, 2.31, |r, _| r["artifact"]["bytes"] = json!(16_000_000 - 609_873 + 1));
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "size seed 0");
    assert!(c.outcome == Outcome::Fail && c.figure.contains("16,000,001 bytes") && c.figure.contains("1 over"), "{c:?}");
    assert_eq!(s.failures().len(), 1, "{:?}", s.failures());
    // Over the training time once GPTQ is counted, and over the evaluation time.
    dirs[1] = run_dir(&root.join("time"), 0, 2.31, |r, _| {
        r["train"]["train_time_ms"] = json!(599_000.0);
        r["eval"]["ttt"]["eval_ms"] = json!(590_000.0);
    });
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "train time seed 0");
    assert!(
        c.outcome == Outcome::Fail && c.figure.starts_with("601.4 s") && c.figure.contains("gptq calibration + quantization 2.4 s"),
        "{c:?}"
    );
    let c = check(&s, "eval time seed 0");
    assert!(c.outcome == Outcome::Fail && c.figure.starts_with("603.3 s"), "{c:?}");
    // Attention trials before the timer count.
    dirs[1] =
        run_dir(&root.join("trials"), 0, 2.31, |r, _| r["train"]["attention_auto"] = json!({ "kernels": "flash", "wall_ms": 375_000.0 }));
    let c = check(&Submission::check(load(&dirs), 3, &Against::Nothing, vec![]), "train time seed 0").clone();
    assert!(
        c.outcome == Outcome::Fail && c.figure.starts_with("600.6 s") && c.figure.contains("attention trials before the timer 375.0 s"),
        "{c:?}"
    );
    // A missing seed, and a seed given twice.
    let s = Submission::check(load(&dirs[..2]), 3, &Against::Nothing, vec![]);
    assert!(check(&s, "seeds").outcome == Outcome::Fail && check(&s, "seeds").figure.ends_with("1 missing"), "{:?}", check(&s, "seeds"));
    let twice = vec![dirs[0].clone(), dirs[0].clone(), dirs[2].clone()];
    let s = Submission::check(load(&twice), 3, &Against::Nothing, vec![]);
    assert!(check(&s, "seeds").figure.starts_with("seed(s) 42 given twice"), "{:?}", check(&s, "seeds"));
    // Mixed configs name the key and both values; names and output folders may differ.
    dirs[1] =
        run_dir(&root.join("mixed"), 0, 2.31, |_, c| *c = c.replace("num_layers = 4", "num_layers = 5").replace("record-mini", "other"));
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "one config");
    assert!(c.outcome == Outcome::Fail && c.figure.starts_with("`model.num_layers` is 4 in") && c.figure.contains("but 5 in"), "{c:?}");
    assert_eq!(s.failures().len(), 1, "only the model differs: {:?}", s.failures());
    // Seeds trained by different code.
    dirs[1] = run_dir(&root.join("code"), 0, 2.31, |r, _| r["artifact"]["code"]["measured"]["sha256"] = json!("cc33"));
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "one code");
    assert!(
        c.outcome == Outcome::Fail && c.figure == "seed 0 was trained by the source bundle cc33 but seed 42 by aa11: different code",
        "{c:?}"
    );
    // A code size stated by the config, or not measured: refused, saying why.
    dirs[1] = run_dir(&root.join("given"), 0, 2.31, |r, _| r["artifact"]["code"] = json!({ "given": 1000 }));
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "size seed 0");
    assert!(
        c.outcome == Outcome::Fail && c.figure.starts_with("code size not measured: stated by the config (`code_bytes` = 1000)"),
        "{c:?}"
    );
    dirs[1] = run_dir(&root.join("unmeasured"), 0, 2.31, |r, _| r["artifact"]["code"] = json!({ "unmeasured": "no dep-info" }));
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    assert!(
        check(&s, "size seed 0").figure.starts_with("code size not measured: not measured (no dep-info)"),
        "{:?}",
        check(&s, "size seed 0")
    );
    // Over the cap: the bytes to lose and the closest settings.
    dirs[1] = run_dir(&root.join("over"), 0, 2.31, |r, _| r["artifact"]["bytes"] = json!(15_865_260));
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "size seed 0");
    assert!(
        c.outcome == Outcome::Fail
            && c.figure.contains("475,133 over: the model must lose 475133 bytes")
            && c.figure.contains("`clip_sigmas` 12.85 -> "),
        "{c:?}"
    );
    // An interrupted run, and one scored on other validation targets.
    dirs[1] = run_dir(&root.join("stopped"), 0, 2.31, |r, _| {
        r["run"]["status"] = json!("interrupted");
        r["eval"]["ttt"]["val_tokens"] = json!(65_535);
    });
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    assert!(check(&s, "runs finished").figure.contains("(interrupted)"), "{:?}", check(&s, "runs finished"));
    assert!(check(&s, "val split").outcome == Outcome::Fail && check(&s, "val split").figure.contains("scored 65,535 targets"));
    // A diverged TTT is an error naming its key, not a quiet fall back to the sliding score;
    // an artifact without its calibration time likewise.
    let bad = run_dir(&root.join("diverged"), 7, 2.31, |r, _| r["eval"]["ttt"]["val_loss"] = json!(null));
    let err = format!("{:#}", RunFigures::load(&bad).unwrap_err());
    assert!(err.contains("no number at `eval.ttt.val_loss`"), "{err}");
    let bad =
        run_dir(&root.join("noreserve"), 7, 2.31, |r, _| r["artifact"].as_object_mut().unwrap().remove("reserve_ms").map(drop).unwrap());
    assert!(format!("{:#}", RunFigures::load(&bad).unwrap_err()).contains("`artifact.reserve_ms`"));
    // A run directory without a report is an error naming it.
    let err = RunFigures::load(&root.join("nowhere")).unwrap_err();
    assert!(format!("{err:#}").contains("not a finished run directory"), "{err:#}");
}

/// The significance line equals the hand computation of `significance`'s own test on these
/// numbers: the seeds' val_loss against the baseline runs' (Welch, df 4, t -5.5114).
#[test]
fn significance_uses_the_seeds_losses() {
    let t = Scratch::new("sig");
    let ours = load(&three(&t.0.join("ours")));
    let base: Vec<PathBuf> =
        [(42, 2.35), (0, 2.36), (1234, 2.37)].iter().map(|&(s, l)| run_dir(&t.0.join("base"), s, l, |_, _| ())).collect();
    let s = Submission::check(ours.clone(), 3, &Against::Runs(load(&base)), vec![]);
    let sig = s.significance.as_ref().unwrap();
    assert!((sig.t + 5.511351921).abs() < 1e-6 && (sig.df - 4.0).abs() < 1e-9 && sig.clears, "{sig:?}");
    assert!(check(&s, "significance").outcome == Outcome::Pass);
    // A baseline with another tokenizer (twice the tokens for the same bytes: half the nats a
    // token) is compared on its bpb, turned into nats on our tokens: the same verdict.
    let other: Vec<PathBuf> = [(42, 2.35), (0, 2.36), (1234, 2.37)]
        .iter()
        .map(|&(s, l)| {
            run_dir(&t.0.join("other"), s, l / 2.0, |r, _| {
                r["eval"]["ttt"]["val_tokens"] = json!(131_072);
                r["eval"]["ttt"]["val_bpb"] = json!(l / (std::f64::consts::LN_2 * 158_340.0 / 65_536.0));
            })
        })
        .collect();
    let s2 = Submission::check(ours.clone(), 3, &Against::Runs(load(&other)), vec![]);
    let sig2 = s2.significance.as_ref().unwrap();
    assert!((sig2.t - sig.t).abs() < 1e-6 && (sig2.diff_nats - sig.diff_nats).abs() < 1e-9, "{sig2:?} vs {sig:?}");
    // Against a figure: nats per bpb from the seeds' own bytes per token.
    let k = std::f64::consts::LN_2 * 158_340.0 / 65_536.0;
    let s = Submission::check(ours, 3, &Against::Bpb(2.36 / k), vec![]);
    let sig = s.significance.as_ref().unwrap();
    assert!((sig.baseline_mean_nats - 2.36).abs() < 1e-9 && (sig.diff_nats + 0.05).abs() < 1e-9 && (sig.df - 2.0).abs() < 1e-12, "{sig:?}");
}

#[test]
fn the_rules_hardware_is_eight_sxm_h100s() {
    use super::rules::rules_hardware;
    assert!(rules_hardware("8 x NVIDIA H100 80GB HBM3"));
    for h in ["1 x NVIDIA H100 80GB HBM3", "8 x NVIDIA H100 PCIe", "8 x NVIDIA H100 NVL", "8 x NVIDIA H200", "1 x CPU (x, 2 cores)"] {
        assert!(!rules_hardware(h), "{h}");
    }
}

#[test]
fn the_folder_holds_the_table_the_json_and_the_logs() {
    let t = Scratch::new("folder");
    let s = Submission::check(load(&three(&t.0)), 3, &Against::Bpb(1.5), vec![]);
    let entry = Entry {
        name: "Test entry".into(),
        date: "2026-11-27".into(),
        track: "10min_16mb".into(),
        software: "pipeline 0.1.0".into(),
        ..Entry::default()
    };
    let out = t.0.join("records/2026-11-27_Test");
    let code = vec![("source.tar.xz".to_string(), b"packed".to_vec()), ("Cargo.lock".to_string(), b"lock".to_vec())];
    let files = write(&s, &entry, &code, &out).unwrap();
    assert_eq!(files.len(), 2 + 2 + 3 * 4);
    assert_eq!(std::fs::read(out.join("source.tar.xz")).unwrap(), b"packed");
    let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
    let r0 = &s.runs[0];
    let row = format!(
        "| 42 | 300 | 743.9 | {:.5} | {:.5} | **{:.5}** | 1,911,393 |",
        r0.pre_quant_bpb.unwrap(),
        r0.post_quant_bpb.unwrap(),
        r0.score.val_bpb
    );
    assert!(readme.contains(&row), "{row}\n{readme}");
    assert!(readme.contains("PASS size seed 1234") && readme.contains("pipeline run config_seed0.toml"), "{readme}");
    assert!(
        readme.contains("The code is `source.tar.xz` (609,873 bytes, counted)") && readme.contains("--no-default-features --features cuda"),
        "{readme}"
    );
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("submission.json")).unwrap()).unwrap();
    assert_eq!(j["seeds"], json!([42, 0, 1234]));
    assert_eq!(j["seed_results"]["0"]["artifact_bytes"], json!(1_911_393));
    assert!((j["val_loss"].as_f64().unwrap() - 2.31).abs() < 1e-12 && j["passed"] == json!(true));
    assert_eq!(
        std::fs::read_to_string(out.join("train_seed1234.log")).unwrap(),
        std::fs::read_to_string(t.0.join("seed1234/train.log")).unwrap()
    );
    // A second write refuses the folder now there, and a failed write leaves nothing behind.
    assert!(format!("{:#}", write(&s, &entry, &code, &out).unwrap_err()).contains("not empty"));
    std::fs::remove_file(s.runs[2].dir.join("train.log")).unwrap();
    let other = t.0.join("records/other");
    let err = write(&s, &entry, &code, &other).unwrap_err();
    assert!(format!("{err:#}").contains("train.log") && !other.exists(), "{err:#}");
    assert_eq!(std::fs::read_dir(t.0.join("records")).unwrap().count(), 1, "no temporary folder left");
}

/// A submission is judged on the files of the directories it is given: a copy whose artifact
/// was cut short, or has bytes flipped, fails `files` naming the file; a report naming
/// a path outside its directory is refused; an older report's absolute path is read as the
/// file of that name in the directory given, never at the path itself.
#[test]
fn the_artifact_is_judged_in_the_folder_given() {
    let t = Scratch::new("files");
    let dirs = three(&t.0);
    let artifact = dirs[0].join("final_model.int6.brotli.pgqz");
    let problem = |d: &PathBuf| RunFigures::load(d).unwrap().files_problem;
    assert_eq!(problem(&dirs[0]), None);
    std::fs::OpenOptions::new().write(true).open(&artifact).unwrap().set_len(5_000).unwrap();
    let p = problem(&dirs[0]).unwrap();
    assert!(p.contains("5000 bytes, the run recorded 1301520") && p.contains("final_model.int6.brotli.pgqz"), "{p}");
    std::fs::File::create(&artifact).unwrap().set_len(1_301_520).unwrap();
    let mut f = std::fs::OpenOptions::new().write(true).open(&artifact).unwrap();
    std::io::Write::write_all(&mut f, &[0xff; 64]).unwrap();
    let p = problem(&dirs[0]).unwrap();
    assert!(p.contains("its SHA-256 is") && p.contains("not the file the run wrote"), "{p}");
    let s = Submission::check(load(&dirs), 3, &Against::Nothing, vec![]);
    let c = check(&s, "files seed 42");
    assert_eq!(c.outcome, Outcome::Fail, "{c:?}");

    let out = run_dir(&t.0.join("outside"), 7, 2.3, |r, _| r["artifact"]["path"] = json!("../elsewhere.pgqz"));
    assert!(problem(&out).unwrap().contains("outside the run directory"), "{:?}", problem(&out));
    let old = run_dir(&t.0.join("old"), 8, 2.3, |r, _| r["artifact"]["path"] = json!("/nonexistent/final_model.int6.brotli.pgqz"));
    assert_eq!(problem(&old), None, "the file of that name in the directory given");
    // config.toml (what `one config` reads) against the SHA-256 the run recorded of it.
    let cfg = run_dir(&t.0.join("cfg"), 9, 2.3, |r, _| r["run"]["files"] = json!({"config.toml": "0".repeat(64)}));
    assert!(problem(&cfg).is_some_and(|p| p.contains("config.toml") && p.contains("not the file the run wrote")), "{:?}", problem(&cfg));
}
