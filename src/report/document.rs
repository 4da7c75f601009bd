//! `RUN_DIR/report.json`: what every stage and channel did, and the verdict.
//!
//! Field meanings (durations in µs unless the name says otherwise; "steady" means after each
//! stage's first `[run] warmup_items` items):
//! - `stages.NAME.busy_fraction`: steady service time / time from that stage's warm-up end to
//!   the end of the run;
//! - `stages.NAME.service_us`: time per item inside the stage's own code (less time blocked on a
//!   full output channel);
//! - `channels."A->B".send_blocked_us`: per item, time A waited for room in B's channel;
//! - `channels."A->B".recv_blocked_us`: per item, time B waited for any input (shared by all of
//!   B's input edges);
//! - `channels."A->B".residence_us`: per item, from A's send to B's receive;
//! - `channels."A->B".mean_occupancy`: mean sampled length of B's channel, next to the value
//!   Little's law predicts from throughput and mean residence (`littles_law_occupancy`).
//!
//! The verdict (see [`crate::report::verdict`]) names the bottleneck and classes the focus stage's
//! input-bound fraction as the TensorFlow profiler does.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::report::tables::{ChannelReport, StageReport};
use crate::report::verdict::{self, Verdict};
use crate::runtime::build_info::BuildInfo;
use crate::runtime::control::{StopReason, StopSignal};
use crate::runtime::exec::{RunResult, StageState};
use crate::runtime::graph::Plan;
use crate::runtime::metrics::{Hist, Summary};

/// The whole report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// How the run went.
    pub run: RunInfo,
    /// Per stage.
    pub stages: BTreeMap<String, StageReport>,
    /// Per edge, keyed "FROM->TO".
    pub channels: BTreeMap<String, ChannelReport>,
    /// The bottleneck verdict.
    pub verdict: Verdict,
    /// Filled by the step executor.
    #[serde(default)]
    pub train: serde_json::Map<String, serde_json::Value>,
    /// Other sections published by stages.
    #[serde(flatten)]
    pub sections: BTreeMap<String, serde_json::Value>,
}

/// `run`: identity and outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunInfo {
    /// `[run] name`.
    pub name: String,
    /// The config file the run was started from.
    pub config: String,
    /// The run directory.
    pub run_dir: String,
    /// Start time, RFC 3339 UTC.
    pub started: String,
    /// The hardware it ran on, in words: ranks, then the GPU's name or the CPU's model and
    /// cores (what `pipeline submission` times the rules against).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hardware: String,
    /// The build of the binary that ran it (version, features, profile): the lean record build
    /// or the full one.
    #[serde(default)]
    pub build: BuildInfo,
    /// Wall time from starting the stage threads to the last one ending (s).
    pub wall_s: f64,
    /// "completed", "interrupted" or "failed".
    pub status: String,
    /// The process exit code that goes with the status.
    pub exit_code: i32,
    /// The first failure: which stage and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The signal that stopped an interrupted run: `SIGINT`, `SIGTERM` or `SIGHUP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// Time from the abort to the last stage ending (ms), when the run was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_ms: Option<f64>,
    /// `[run] warmup_items`.
    pub warmup_items: u64,
    /// `[run] instrument`.
    pub instrument: bool,
    /// Stage names in topological order (for display).
    pub stage_order: Vec<String>,
    /// Anything else worth knowing (drain timeout hit, stage hung, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// SHA-256 of the run directory's files that the checks judge besides the artifact and the
    /// source bundle ([`crate::runtime::files::RECORDED`]), as the run left them: `audit-eval`
    /// and `submission` compare the files of the folder they are given with them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
}

/// Inputs to [`build`] that do not come from the run itself.
pub struct ReportMeta<'a> {
    /// `[run] name` as resolved.
    pub name: &'a str,
    /// The config file.
    pub config_path: &'a Path,
    /// The run directory.
    pub run_dir: &'a Path,
    /// Start time, RFC 3339.
    pub started: String,
    /// `[run] warmup_items`.
    pub warmup_items: u64,
    /// `[run] instrument`.
    pub instrument: bool,
    /// The hardware the run ran on, in words (ranks, GPU or CPU model).
    pub hardware: String,
}

/// Exit code for each way a run can end: 0 completed, 1 failed, 128 + the signal's number when
/// a signal stopped it (SIGINT 130, SIGTERM 143, SIGHUP 129).
pub fn exit_code(reason: StopReason, signal: Option<StopSignal>) -> i32 {
    match reason {
        StopReason::Completed => 0,
        StopReason::Failed => 1,
        StopReason::Interrupted => signal.unwrap_or(StopSignal::Int).exit_code(),
    }
}

/// Turns a run's measurements into a report.
pub fn build(plan: &Plan, result: &RunResult, meta: &ReportMeta) -> Report {
    let clock = &result.clock;
    let wall_s = clock.seconds(result.start, result.end);
    let mut stages = BTreeMap::new();
    let mut steady = vec![0.0f64; plan.stages.len()];
    // The stages the focus stage feeds (the graph is acyclic: the focus stage is not one).
    let mut after_focus = plan.reachable(plan.focus, false);
    after_focus[plan.focus] = false;
    // The steady phase ends when the focus stage (the executor, a loader's sink) ends: what
    // runs after it (an evaluation after training) is no part of the stages that fed it.
    let focus_end = result.stages.get(plan.focus).filter(|r| r.env.is_some()).map_or(result.end, |r| r.end.min(result.end));
    for (i, (s, r)) in plan.stages.iter().zip(&result.stages).enumerate() {
        let (items_in, items_out, items_dropped, service, busy, steady_s) = match &r.env {
            Some(env) => {
                // The window runs to the end of the steady phase, not of this stage: a stage
                // that finished early (a source whose items sit in a deep queue) was idle since.
                // Stages after the focus stage run to the end of the whole run.
                let end = if after_focus[i] { result.end.max(r.end) } else { focus_end };
                let steady_start = env.steady_start.unwrap_or(env.start);
                let steady_s = clock.seconds(steady_start, end);
                let busy = if steady_s > 0.0 { (env.service.sum_ns() * 1e-9 / steady_s).min(1.0) } else { 0.0 };
                (env.items_in, env.items_out, env.items_dropped, env.service.summary(), busy, steady_s)
            }
            None => (0, 0, 0, Summary::default(), 0.0, 0.0),
        };
        steady[i] = steady_s;
        let role = s.factory.role();
        let items = match role {
            crate::runtime::stage::Role::Source => items_out,
            crate::runtime::stage::Role::Sink => items_in,
            // A transform that produces after its input ends (a sampler) is judged by its output.
            crate::runtime::stage::Role::Transform => items_in.max(items_out),
        };
        let error = match &r.state {
            StageState::Failed(m) | StageState::Panicked(m) => Some(m.clone()),
            _ => None,
        };
        stages.insert(
            s.name.clone(),
            StageReport {
                kind: s.factory.kind().into(),
                imp: s.factory.name().into(),
                role: role.as_str().into(),
                inputs: s.inputs.iter().map(|&j| plan.stages[j].name.clone()).collect(),
                items,
                items_in,
                items_out,
                items_dropped,
                busy_fraction: busy,
                throughput_per_s: if steady_s > 0.0 { service.count as f64 / steady_s } else { 0.0 },
                service_us: service,
                steady_s,
                state: r.state.as_str().into(),
                error,
                extra_us: r.extra.iter().map(|(k, h)| (k.clone(), h.summary())).collect(),
            },
        );
    }

    let mut channels = BTreeMap::new();
    for (c, s) in plan.stages.iter().enumerate() {
        let cons_env = result.stages[c].env.as_ref();
        let occ = result.occupancy[c].clone().unwrap_or_default();
        let recv = cons_env.map(|e| e.input.recv_blocked.clone()).unwrap_or_default();
        let recv_total_s = (recv.sum_ns() + cons_env.map(|e| e.input.tail_wait as f64 * clock.ns_per_tick()).unwrap_or(0.0)) * 1e-9;
        for (edge, &p) in s.inputs.iter().enumerate() {
            let prod_env = result.stages[p].env.as_ref();
            let out_pos = plan.stages[p].consumers.iter().position(|&x| x == c).unwrap_or(0);
            let send = prod_env.and_then(|e| e.outputs.get(out_pos)).map(|o| o.send_blocked.clone()).unwrap_or_default();
            let items = cons_env.and_then(|e| e.input.items.get(edge).copied()).unwrap_or(0);
            let residence =
                cons_env.and_then(|e| e.input.residence.get(edge)).cloned().unwrap_or_else(|| Hist::in_units(clock.ns_per_tick()));
            let res = residence.summary();
            let edge_rate = if steady[c] > 0.0 { res.count as f64 / steady[c] } else { 0.0 };
            let frac = |total_s: f64, window: f64| if window > 0.0 { (total_s / window).min(1.0) } else { 0.0 };
            let samples = occ.samples.max(1) as f64;
            let name = format!("{}->{}", plan.stages[p].name, s.name);
            channels.insert(
                name,
                ChannelReport {
                    from: plan.stages[p].name.clone(),
                    to: s.name.clone(),
                    capacity: s.queue,
                    items,
                    send_blocked_fraction: frac(send.sum_ns() * 1e-9, steady[p]),
                    send_blocked_us: send.summary(),
                    recv_blocked_fraction: frac(recv_total_s, steady[c]),
                    recv_blocked_us: recv.summary(),
                    // Residence counts the producer's blocked send, during which the item is not
                    // in the queue: take it out before comparing with sampled occupancy.
                    littles_law_occupancy: edge_rate * (res.mean - send.summary().mean).max(0.0) * 1e-6,
                    residence_us: res,
                    mean_occupancy: occ.sum as f64 / samples,
                    empty_fraction: occ.empty as f64 / samples,
                    full_fraction: occ.full as f64 / samples,
                    occupancy_timeline: occ.timeline.points(),
                },
            );
        }
    }

    let status = match result.reason {
        StopReason::Completed => "completed",
        StopReason::Interrupted => "interrupted",
        StopReason::Failed => "failed",
    };
    let verdict = verdict::judge(plan, &stages, &channels);
    let mut sections = result.sections.clone();
    let train = match sections.remove("train") {
        Some(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    Report {
        run: RunInfo {
            name: meta.name.to_string(),
            config: meta.config_path.display().to_string(),
            run_dir: meta.run_dir.display().to_string(),
            started: meta.started.clone(),
            hardware: meta.hardware.clone(),
            build: BuildInfo::this(),
            wall_s,
            status: status.into(),
            exit_code: exit_code(result.reason, result.signal),
            // A run is interrupted exactly when a signal was recorded (`Control::reason`).
            signal: result.signal.filter(|_| result.reason == StopReason::Interrupted).map(|s| s.name().to_string()),
            error: result.failure.as_ref().map(|(s, m)| format!("stage `{s}` failed: {m}")),
            stop_ms: result.stop_ms,
            warmup_items: meta.warmup_items,
            instrument: meta.instrument,
            stage_order: plan.stages.iter().map(|s| s.name.clone()).collect(),
            notes: result.notes.clone(),
            files: crate::runtime::files::recorded(meta.run_dir),
        },
        stages,
        channels,
        verdict,
        train,
        sections,
    }
}

impl Report {
    /// Reads `RUN_DIR/report.json`.
    pub fn load(run_dir: &Path) -> anyhow::Result<Report> {
        use anyhow::Context;
        let path = run_dir.join("report.json");
        let bytes = crate::runtime::files::read(&path)?;
        serde_json::from_slice(&bytes).with_context(|| format!("{} is not a report written by this version of pipeline", path.display()))
    }

    /// The report as the text table `pipeline run` and `pipeline report` print.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let r = &self.run;
        let status = match &r.signal {
            Some(sig) => format!("{} by {sig}", r.status),
            None => r.status.clone(),
        };
        let _ = writeln!(o, "run `{}`: {status} after {:.2} s (exit {})  [{}]", r.name, r.wall_s, r.exit_code, r.run_dir);
        if let Some(e) = &r.error {
            let _ = writeln!(o, "error: {e}");
        }
        for n in &r.notes {
            let _ = writeln!(o, "note: {n}");
        }
        let _ = writeln!(o);
        let nw = r.stage_order.iter().map(|n| n.len()).max().unwrap_or(0).max(14);
        let kw = self.stages.values().map(|s| s.kind.len() + s.imp.len() + 1).max().unwrap_or(0).max(20);
        let _ = writeln!(
            o,
            "{:<nw$} {:<kw$} {:>9} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "stage", "kind/impl", "items", "busy", "p50 µs", "p90 µs", "p99 µs", "max µs", "items/s"
        );
        for name in &r.stage_order {
            let Some(s) = self.stages.get(name) else { continue };
            let state = if s.state == "finished" { String::new() } else { format!("  [{}]", s.state) };
            let _ = writeln!(
                o,
                "{:<nw$} {:<kw$} {:>9} {:>5.1}% {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}{}",
                name,
                format!("{}/{}", s.kind, s.imp),
                s.items,
                s.busy_fraction * 100.0,
                s.service_us.p50,
                s.service_us.p90,
                s.service_us.p99,
                s.service_us.max,
                s.throughput_per_s,
                state
            );
            for (k, h) in &s.extra_us {
                let _ = writeln!(
                    o,
                    "{:<14} {:<20} {:>9} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                    "",
                    format!("  {k}"),
                    h.count,
                    "",
                    h.p50,
                    h.p90,
                    h.p99,
                    h.max
                );
            }
        }
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "{:<26} {:>5} {:>6} {:>6} {:>6} {:>10} {:>8} {:>10} {:>8} {:>10} {:>10}",
            "channel", "cap", "occ", "empty", "full", "send-blk", "send %", "recv-blk", "recv %", "resid p50", "resid p99"
        );
        for name in r.stage_order.iter().flat_map(|to| self.channels.iter().filter(move |(_, c)| &c.to == to)).map(|(k, _)| k) {
            let c = &self.channels[name];
            let _ = writeln!(
                o,
                "{:<26} {:>5} {:>6.2} {:>5.0}% {:>5.0}% {:>10.1} {:>7.1}% {:>10.1} {:>7.1}% {:>10.1} {:>10.1}",
                name,
                c.capacity,
                c.mean_occupancy,
                c.empty_fraction * 100.0,
                c.full_fraction * 100.0,
                c.send_blocked_us.p99,
                c.send_blocked_fraction * 100.0,
                c.recv_blocked_us.p99,
                c.recv_blocked_fraction * 100.0,
                c.residence_us.p50,
                c.residence_us.p99
            );
        }
        let _ = writeln!(o, "(send-blk, recv-blk: p99 µs per item; send %, recv %: share of the stage's steady time)");
        let _ = writeln!(o);
        let v = &self.verdict;
        let _ = writeln!(
            o,
            "verdict: bottleneck `{}`; `{}` is {} ({:.1}% of its time waiting for input)",
            v.bottleneck.as_deref().unwrap_or("-"),
            v.focus,
            v.class,
            v.input_bound_fraction * 100.0
        );
        let _ = writeln!(o, "  {}", v.explanation);
        if let Some(d) = self.sections.get("data") {
            let _ = writeln!(
                o,
                "data: {} micro-batches ({} steps), {} tokens, {} tokens/s; rolling fingerprint {}",
                d["micro_batches"],
                d["steps"],
                d["tokens"],
                d["tokens_per_s"].as_f64().map(|t| format!("{:.0}", t)).unwrap_or_else(|| "-".into()),
                d["rolling_fingerprint"].as_str().unwrap_or("-")
            );
        }
        if !self.train.is_empty() {
            let _ = writeln!(o);
            write_train(&mut o, &self.train);
        }
        o
    }
}

/// The `train` section as a few lines: steps and speed, the final validation against the
/// unigram bar, the per-step time of each phase, the weights file.
fn write_train(o: &mut String, t: &serde_json::Map<String, serde_json::Value>) {
    use std::fmt::Write;
    let f = |k: &str| t.get(k).and_then(|v| v.as_f64());
    let num = |k: &str, digits: usize| f(k).map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into());
    let _ = writeln!(
        o,
        "train: {} steps (ended by {}) in {:.1} s of training, {} tokens/s, step_avg {} ms",
        t.get("steps").and_then(|v| v.as_u64()).unwrap_or(0),
        t.get("ended_by").and_then(|v| v.as_str()).unwrap_or("-").replace('_', " "),
        f("train_time_ms").unwrap_or(0.0) / 1e3,
        num("tokens_per_s", 0),
        num("step_avg_ms", 2),
    );
    if f("val_bpb").is_some() {
        let _ = writeln!(
            o,
            "  final val_loss {} val_bpb {} over {} tokens ({} bytes); unigram bpb {}",
            num("val_loss", 4),
            num("val_bpb", 4),
            t.get("val_tokens").and_then(|v| v.as_u64()).unwrap_or(0),
            t.get("val_bytes").and_then(|v| v.as_u64()).unwrap_or(0),
            num("unigram_bpb", 4),
        );
    }
    if let (Some(ms), Some(pct)) = (t.get("timing_ms_per_step"), t.get("timing_share_pct")) {
        let parts: Vec<String> = ["data_wait", "h2d", "forward", "backward", "optimizer"]
            .iter()
            .map(|k| match pct.get(k).and_then(|v| v.as_f64()) {
                Some(p) => format!("{k} {:.2} ms ({p:.0}%)", ms[k].as_f64().unwrap_or(0.0)),
                // H2D overlaps the executor (another thread): a time, not a share.
                None => format!("{k} {:.2} ms (overlapped)", ms[k].as_f64().unwrap_or(0.0)),
            })
            .collect();
        let _ = writeln!(o, "  per step: {}; validation {:.1} s in all", parts.join(", "), f("val_time_ms").unwrap_or(0.0) / 1e3);
    }
    if let Some(w) = t.get("weights").and_then(|v| v.as_str()) {
        let _ = writeln!(o, "  weights: {w}");
    }
}
