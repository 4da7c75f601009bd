//! `pipeline ablate` through the binary, on the tiny training setup: the base and its variants
//! run with the same data order and are compared; a rerun keeps completed runs and redoes the
//! rest; a bad key fails before anything runs; seeds give means and Welch's test; Ctrl-C lets
//! the current run finish and starts no other. Each run and the ablation write their
//! report.html.

mod common;

use std::path::Path;
use std::process::{Output, Stdio};

use common::tiny::{self, Corpus};
use common::{Dir, bin, scratch, text};
use serde_json::Value;

/// Runs `pipeline ablate CONFIG ARGS... --out OUT -q` with a time limit.
fn ablate(config: &Path, out: &Path, args: &[&str]) -> Output {
    let mut c = bin();
    c.arg("ablate").arg(config).arg("--out").arg(out).arg("-q").args(args);
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("the binary runs");
    tiny::finish(child, config)
}

fn summary(out: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out.join("ablation.json")).unwrap()).unwrap()
}

fn corpus(name: &str) -> Corpus {
    tiny::corpus(&format!("ablate-{name}"))
}

/// Base + two queue depths: three completed runs, the variants on the base's data order, the
/// table printed; a rerun keeps all three; a run whose report is gone is run again, alone.
#[test]
fn variants_run_compare_and_a_rerun_keeps_what_completed() {
    let c = corpus("queue");
    let config = tiny::config(&c);
    let out = Dir(scratch("ablate-queue"));
    let args = ["--vary", "stages.pin.queue=1,4", "--set", "train.iterations=6", "--set", "train.val_every=0"];
    let o = ablate(&config, &out, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let s = summary(&out);
    let lines = s["comparison"].as_array().unwrap();
    let names: Vec<&str> = lines.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["base", "stages.pin.queue=1", "stages.pin.queue=4"]);
    for l in lines {
        assert_eq!((l["runs"].as_u64(), l["complete"].as_u64()), (Some(1), Some(1)), "{l}");
        assert!(l["figures"]["tokens_per_s"]["mean"].as_f64().unwrap() > 0.0, "{l}");
    }
    for l in &lines[1..] {
        assert_eq!(l["same_data_as_base"], Value::Bool(true), "{l}");
        assert!(l["figures"]["wall_s"]["ratio"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["figures"]["val_bpb"]["diff"].is_number(), "{l}");
    }
    let table = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(table.contains("stages.pin.queue=4") && table.contains("same") && table.contains("x)"), "{table}");
    assert_eq!(std::fs::read_to_string(out.join("ablation.txt")).unwrap().lines().count(), 4);
    // The ablation's page: the table, a link to each run's own page, the runs overlaid.
    let page = common::html_page(&out.join("report.html"));
    for dir in ["base", "stages.pin.queue=1", "stages.pin.queue=4"] {
        assert!(page.contains(&format!("href=\"{dir}/report.html\"")), "no link to {dir}'s page");
        common::html_page(&out.join(dir).join("report.html"));
    }
    for part in ["Comparison", "train: service time per item", "step time against steps", "train loss against steps"] {
        assert!(page.contains(part), "`{part}` not on the ablation's page");
    }

    let report = out.join("stages.pin.queue=1/report.json");
    let before = std::fs::metadata(&report).unwrap().modified().unwrap();
    let o = ablate(&config, &out, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).matches("complete already, kept").count(), 3, "{}", text(&o));
    assert_eq!(std::fs::metadata(&report).unwrap().modified().unwrap(), before);

    std::fs::remove_file(out.join("stages.pin.queue=4/report.json")).unwrap();
    let o = ablate(&config, &out, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(stdout.matches("complete already, kept").count(), 2, "{stdout}");
    assert!(stdout.contains("[3/3] stages.pin.queue=4: completed"), "{stdout}");
    assert_eq!(summary(&out)["comparison"][2]["complete"].as_u64(), Some(1));
}

/// A key no stage has fails before anything runs, naming the variant and the key; a
/// non-ablation directory is not written into; nothing to vary is an error.
#[test]
fn bad_keys_and_directories_fail_before_anything_runs() {
    let c = corpus("bad");
    let config = tiny::config(&c);
    let out = Dir(scratch("ablate-bad"));
    let o = ablate(&config, &out.join("a"), &["--vary", "stages.pin.queu=1,4"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("stages.pin.queu=1") && text(&o).contains("queu"), "{}", text(&o));
    assert!(!out.join("a").exists(), "nothing is created for a bad plan");
    std::fs::write(out.join("note.txt"), "mine").unwrap();
    let o = ablate(&config, &out, &["--vary", "stages.pin.queue=1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not an ablation directory"), "{}", text(&o));
    let o = ablate(&config, &out.join("b"), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("nothing to vary"), "{}", text(&o));
}

/// Two seeds per variant from the config's `[ablation]` table: four runs, means and standard
/// deviations, and the score's Welch test against the base with the bar's verdict.
#[test]
fn seeds_from_the_ablation_table_give_means_and_a_welch_test() {
    let c = corpus("seeds");
    let config = tiny::config_plus(&c, "seeded", "[ablation]\nseeds = 2\n[ablation.vary]\n\"train.matrix_lr\" = [0.1]\n");
    let out = Dir(scratch("ablate-seeds"));
    let o = ablate(&config, &out, &["--set", "train.iterations=4", "--set", "train.val_every=0"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let s = summary(&out);
    assert_eq!(s["runs"].as_array().unwrap().len(), 4);
    let seeds: Vec<String> = s["runs"].as_array().unwrap().iter().map(|r| r["variant"]["sets"].to_string()).collect();
    // Seed by seed: base and the variant with the first seed, then both with the next.
    assert!(seeds[0].contains("run.seed=1337") && seeds[1].contains("run.seed=1337"), "{seeds:?}");
    assert!(seeds[2].contains("run.seed=1338") && !seeds[2].contains("matrix_lr"), "{seeds:?}");
    let v = &s["comparison"][1];
    assert_eq!(v["name"], "train.matrix_lr=0.1");
    assert!(v["figures"]["score_loss"]["std"].is_number(), "{v}");
    let sig = &v["significance"];
    assert!(sig["welch"]["p"].as_f64().is_some_and(|p| (0.0..=1.0).contains(&p)), "{v}");
    assert!(sig["clears_bar"].is_boolean(), "{v}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("the bar (0.005 nats at p <= 0.01)"), "{}", text(&o));
}

/// Ctrl-C during the first run: it finishes, no other starts, the exit code is SIGINT's; the
/// rerun goes on with the rest.
#[test]
fn ctrl_c_finishes_the_current_run_and_starts_no_other() {
    let c = corpus("sigint");
    let config = tiny::config(&c);
    let out = Dir(scratch("ablate-sigint"));
    let args = ["--vary", "stages.pin.queue=1", "--set", "train.iterations=120", "--set", "train.val_every=0"];
    let mut cmd = bin();
    cmd.arg("ablate").arg(&config).arg("--out").arg(&*out).args(args);
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    tiny::wait_for_line(&mut child, &out.join("base"), |l| l.starts_with("step:"));
    tiny::sigint(&child);
    let o = tiny::finish(child, &config);
    assert_eq!(o.status.code(), Some(130), "{}", text(&o));
    let s = summary(&out);
    assert_eq!(s["runs"][0]["figures"]["status"], "completed", "the current run finishes: {}", text(&o));
    assert!(s["runs"][1]["figures"].is_null(), "no other run starts");
    let o = ablate(&config, &out, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(stdout.contains("[1/2] base: complete already, kept") && stdout.contains("[2/2] stages.pin.queue=1: completed"), "{stdout}");
}
