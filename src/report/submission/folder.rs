//! The records folder of a submission, as the challenge's pull requests lay it out
//! (`records/track_10min_16mb/<date>_<name>/`): `README.md` with the per-seed results table,
//! `submission.json` with the records' keys, each seed's `train_seed<S>.log`, and, in place of
//! the records' `train_gpt.py`, the source bundle that trained the runs (`source.tar.xz`,
//! `.br` or `.lrz`, the counted code) with `Cargo.lock` beside it, each seed's resolved
//! `config_seed<S>.toml` and report pages (`report_seed<S>.html`, `report_seed<S>.json`).
//!
//! The folder is made under a temporary name beside `--out` and renamed when complete, so a
//! failure leaves no half-written folder.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::json;

use super::Submission;
use super::rules::grouped;
use super::significance::{MARGIN_NATS, P_LIMIT};

/// What the folder says about its author and entry.
#[derive(Clone, Debug, Default)]
pub struct Entry {
    /// The entry's name (the records' `name`).
    pub name: String,
    /// Author's name.
    pub author: String,
    /// GitHub id.
    pub github_id: String,
    /// One paragraph on what it does.
    pub blurb: String,
    /// `YYYY-MM-DD`.
    pub date: String,
    /// `10min_16mb`.
    pub track: String,
    /// The software that trained it (version, commit).
    pub software: String,
}

/// Writes the folder at `out` (absent, or an empty folder) with `code` (the source bundle and
/// `Cargo.lock`: names and bytes, checked by the caller); returns the files written.
pub fn write(sub: &Submission, entry: &Entry, code: &[(String, Vec<u8>)], out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if out.exists() {
        let empty = std::fs::read_dir(out).with_context(|| format!("cannot read {}", out.display()))?.next().is_none();
        anyhow::ensure!(empty, "{} already exists and is not empty; choose another --out", out.display());
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let leaf = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "submission".into());
    let tmp = parent.join(format!(".{leaf}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = fill(sub, entry, code, &tmp).and_then(|files| {
        if out.exists() {
            std::fs::remove_dir(out).with_context(|| format!("cannot replace the empty folder {}", out.display()))?;
        }
        std::fs::rename(&tmp, out).with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
        Ok(files.into_iter().map(|f| out.join(f)).collect())
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Writes every file into `dir`; returns their names.
fn fill(sub: &Submission, entry: &Entry, code: &[(String, Vec<u8>)], dir: &Path) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut files = Vec::new();
    let mut put = |name: String, bytes: Vec<u8>| -> anyhow::Result<()> {
        std::fs::write(dir.join(&name), bytes).with_context(|| format!("cannot write {}", dir.join(&name).display()))?;
        files.push(name);
        Ok(())
    };
    put("README.md".into(), readme(sub, entry).into_bytes())?;
    put("submission.json".into(), serde_json::to_vec_pretty(&submission_json(sub, entry))?)?;
    for (name, bytes) in code {
        put(name.clone(), bytes.clone())?;
    }
    for r in &sub.runs {
        for (from, to) in [
            ("train.log", format!("train_seed{}.log", r.seed)),
            ("config.toml", format!("config_seed{}.toml", r.seed)),
            ("report.json", format!("report_seed{}.json", r.seed)),
            ("report.html", format!("report_seed{}.html", r.seed)),
        ] {
            let src = r.dir.join(from);
            // The lean record build writes no page: it is made here from the report.
            if from == "report.html" && !src.exists() {
                let report = crate::report::document::Report::load(&r.dir)?;
                let steps = std::fs::read_to_string(r.dir.join("steps.tsv")).ok();
                put(to, crate::report::html::run::page(&report, steps.as_deref()).into_bytes())?;
                continue;
            }
            let bytes = std::fs::read(&src).with_context(|| format!("{}: cannot read (seed {})", src.display(), r.seed))?;
            put(to, bytes)?;
        }
    }
    Ok(files)
}

fn f4(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.5}"))
}

/// The README: headline, results table, the improvement, the checks, how to reproduce.
fn readme(sub: &Submission, e: &Entry) -> String {
    let (bpb, bpb_sd, nats, nats_sd) = sub.score_stats();
    let n = sub.runs.len();
    let hardware = sub.runs.first().map_or(String::new(), |r| r.hardware.clone());
    let mut s = String::new();
    let _ = writeln!(s, "# {}\n", e.name);
    let _ = writeln!(
        s,
        "**val_bpb: {bpb:.5}** ({n}-seed mean, std {bpb_sd:.5}) | **{}** bytes at most | {hardware} | scored by `{}`\n",
        grouped(sub.runs.iter().filter_map(|r| r.total_bytes()).max().unwrap_or(0)),
        sub.runs.first().map_or("", |r| r.score.label.as_str())
    );
    if !e.blurb.is_empty() {
        let _ = writeln!(s, "{}\n", e.blurb);
    }
    if let (Some(sig), Some(base)) = (&sub.significance, sub.baseline_bpb) {
        let _ = writeln!(
            s,
            "**Against {base:.5} bpb:** {:+.5} bpb / {:+.5} nats (one-sided p = {:.2e} that it beats it by more than {MARGIN_NATS} nats; the rule: p < {P_LIMIT}).\n",
            bpb - base,
            sig.diff_nats,
            sig.p
        );
    }
    if let Some(sig) = sub.significance.as_ref().filter(|s| !s.clears) {
        let _ = writeln!(
            s,
            "**Not a record:** it is not shown to beat its baseline by {MARGIN_NATS} nats at p < {P_LIMIT} ({:+.5} nats, p = {:.2e}); track `{}`.\n",
            sig.diff_nats, sig.p, e.track
        );
    }
    let _ = writeln!(s, "## Results\n");
    let _ =
        writeln!(s, "| Seed | Steps | ms/step | Pre-quant val_bpb | Post-quant val_bpb | **Post-TTT val_bpb** | Artifact + code bytes |");
    let _ =
        writeln!(s, "|------|-------|---------|-------------------|--------------------|----------------------|-----------------------|");
    for r in &sub.runs {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {} | {} | **{}** | {} |",
            r.seed,
            grouped(r.steps),
            r.step_avg_ms,
            f4(r.pre_quant_bpb),
            f4(r.post_quant_bpb),
            f4(r.post_ttt_bpb),
            r.total_bytes().map_or("-".into(), grouped)
        );
    }
    let mean_of = |f: &dyn Fn(&super::figures::RunFigures) -> f64| sub.runs.iter().map(f).sum::<f64>() / n.max(1) as f64;
    let _ = writeln!(
        s,
        "| **Mean** | {:.0} | {:.1} | | | **{}** | {} |\n",
        mean_of(&|r| r.steps as f64),
        mean_of(&|r| r.step_avg_ms),
        if sub.runs.iter().all(|r| r.post_ttt_bpb.is_some()) {
            format!("{:.5}", mean_of(&|r| r.post_ttt_bpb.unwrap_or(f64::NAN)))
        } else {
            "-".into()
        },
        grouped(mean_of(&|r| r.total_bytes().unwrap_or(0) as f64).round() as u64)
    );
    let _ = writeln!(s, "{n}-seed std: {bpb_sd:.5} bpb / {nats_sd:.5} nats (mean val_loss {nats:.5} nats).\n");
    let _ = writeln!(s, "## Checks\n");
    let _ = writeln!(s, "Made by `pipeline submission` from the runs' reports:\n");
    for c in &sub.checks {
        let _ = writeln!(s, "- {}", c.line());
    }
    let _ = writeln!(
        s,
        "\nNot checked by the tool: that the hardware is the rules' (the times above are the ones measured on the hardware named), and the rules' spirit.\n"
    );
    let _ = writeln!(s, "## Reproducing\n");
    let _ = writeln!(s, "Trained and scored by {}.", e.software);
    if let Some(b) = sub.runs.first().and_then(|r| r.bundle.as_ref()) {
        let flags = b.build.cargo_flags().join(" ");
        let _ = writeln!(
            s,
            "The code is `{}` ({} bytes, counted): the {} source files of the {}, comments, docs and tests stripped. Rebuild and rerun it:\n\n```sh\nmkdir code && {} && cp Cargo.lock code/\ncargo build --release {flags} --manifest-path code/Cargo.toml\n```\n\nor check it at once with `pipeline submission --verify .` (it builds the bundle in an empty directory and reruns the config at a tiny size against the full build, bit for bit). Each seed:\n",
            b.file,
            grouped(b.bytes),
            b.files,
            b.build.line(),
            b.unpack_command()
        );
    }
    let _ = writeln!(s, "```sh");
    for r in &sub.runs {
        let _ = writeln!(s, "pipeline run config_seed{}.toml", r.seed);
    }
    let _ = writeln!(s, "```\n");
    let _ = writeln!(
        s,
        "## Files\n\n- `submission.json`: the results in the records' keys;\n- `source.tar.xz` (or `.br`, `.lrz`): the code, counted; `Cargo.lock`: its dependencies' versions, not counted;\n- `train_seed<S>.log`: each seed's log;\n- `config_seed<S>.toml`: each seed's resolved config (the records' command-line settings);\n- `report_seed<S>.html`, `report_seed<S>.json`: each run's report (where every millisecond and byte went)."
    );
    s
}

/// `submission.json` in the records' keys, and the checks.
fn submission_json(sub: &Submission, e: &Entry) -> serde_json::Value {
    let (bpb, bpb_sd, nats, nats_sd) = sub.score_stats();
    let n = sub.runs.len().max(1) as f64;
    let mut seed_results = serde_json::Map::new();
    for r in &sub.runs {
        seed_results.insert(
            r.seed.to_string(),
            json!({
                "val_loss": r.score.val_loss,
                "val_bpb": r.score.val_bpb,
                "pre_quant_val_bpb": r.pre_quant_bpb,
                "post_quant_val_bpb": r.post_quant_bpb,
                "artifact_bytes": r.total_bytes(),
                "model_bytes": r.artifact_bytes,
                "code_bytes": r.code_bytes,
                "steps": r.steps,
                "step_avg_ms": r.step_avg_ms,
                "train_time_s": r.train_s(),
                "eval_time_s": r.eval_s(),
            }),
        );
    }
    let bytes: Vec<u64> = sub.runs.iter().filter_map(|r| r.total_bytes()).collect();
    json!({
        "author": e.author,
        "github_id": e.github_id,
        "name": e.name,
        "blurb": e.blurb,
        "date": e.date,
        "track": e.track,
        "val_loss": nats,
        "val_bpb": bpb,
        "val_loss_std": nats_sd,
        "val_bpb_std": bpb_sd,
        "seeds": sub.runs.iter().map(|r| r.seed).collect::<Vec<_>>(),
        "seed_results": seed_results,
        "comparison_baseline_bpb": sub.baseline_bpb,
        "delta_vs_leaderboard_bpb": sub.baseline_bpb.map(|b| bpb - b),
        "delta_vs_leaderboard_nats": sub.significance.as_ref().map(|s| s.diff_nats),
        "p_value": sub.significance.as_ref().map(|s| s.p),
        "artifact_bytes_mean": bytes.iter().sum::<u64>() as f64 / bytes.len().max(1) as f64,
        "artifact_bytes_max": bytes.iter().max(),
        "bytes_total": bytes.iter().max(),
        "train_steps_mean": sub.runs.iter().map(|r| r.steps as f64).sum::<f64>() / n,
        "step_avg_ms_mean": sub.runs.iter().map(|r| r.step_avg_ms).sum::<f64>() / n,
        "hardware": sub.runs.first().map(|r| r.hardware.clone()),
        "software": e.software,
        "code": sub.runs.first().and_then(|r| r.bundle.clone()),
        "checks": sub.checks.iter().map(|c| json!({
            "name": c.name,
            "outcome": c.outcome,
            "figure": c.figure,
            "rule": c.rule,
        })).collect::<Vec<_>>(),
        "passed": sub.passed(),
        "record": sub.passed() && sub.significance.is_some(),
    })
}
