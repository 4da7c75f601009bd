//! `pipeline project RUN_DIR --nproc N`: the step time on N ranks predicted from a one-rank
//! run ([`crate::report::projection`]): the run's phase times from its `report.json`, its
//! gradient buckets and Muon matrices rebuilt from its resolved `config.toml` (the engine's
//! [`plan_buckets`] on the model's [`Schedule`]), and an interconnect model; printed beside
//! the records' own figures, as a prediction (docs/ranks.md, "Projecting N GPUs").

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::engine::exchange::{DEFAULT_BUCKET_MIB, DEFAULT_FIRST_BUCKET_MIB, plan_buckets};
use crate::engine::schedule::Schedule;
use crate::model::ParamGroup;
use crate::report::document::Report;
use crate::report::projection::{self, BucketIn, Inputs, Keep, Link, MuonExchange, Projection, RECORDS, RecordFigures};
use crate::runtime::config::{self, Tables};
use crate::train::config::Config;

/// Machine balance (FLOPs per byte of memory traffic) that weighs the optimizer's elementwise
/// work against Newton-Schulz's GEMMs on a GPU: an H100 SXM's 989 dense bf16 TFLOP/s over its
/// 3.35 TB/s.
const GPU_FLOPS_PER_BYTE: f64 = 295.0;

/// The same on the CPU: one core's f32 FMA rate over its share of memory bandwidth, a round
/// figure.
const CPU_FLOPS_PER_BYTE: f64 = 10.0;

/// Bytes the optimizer moves per element besides Newton-Schulz: Muon's momentum, norms,
/// transposes and update (about ten f32 reads and writes), Adam's (seven), clipping's norm and
/// the gradient's zeroing (two).
const MUON_BYTES_PER_ELEM: f64 = 48.0;
const ADAM_BYTES_PER_ELEM: f64 = 36.0;

/// What `pipeline project` takes beside the run directory.
#[derive(Clone, Debug)]
pub struct Options {
    /// Ranks to predict.
    pub nproc: usize,
    /// The link's bus bandwidth, GB/s.
    pub link_gbs: f64,
    /// The link's latency per ring step, µs.
    pub link_latency_us: f64,
    /// The wall-clock budget, s.
    pub budget_s: f64,
    /// Which batch the ranks keep.
    pub keep: Keep,
    /// The Newton-Schulz share of the optimizer's time, instead of the estimate.
    pub ns_share: Option<f64>,
    /// Print JSON.
    pub json: bool,
}

/// What the command prints (`--json`: as it is).
#[derive(Debug, Serialize)]
pub struct ProjectionReport {
    /// The run directory read.
    pub run_dir: String,
    /// The one-rank run's figures and what the model derived from its config.
    pub measured: Inputs,
    /// Where `measured.ns_share` came from: "estimate (FLOPs)" or "--ns-share".
    pub ns_share_from: String,
    /// Micro-batch rows and tokens per row of the run.
    pub rows: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// The layer sequence the buckets were planned on was the looped one.
    pub looping: bool,
    /// The executor: "engine" (buckets sent during the pass) or "candle" (after it).
    pub executor: String,
    /// The interconnect model.
    pub link: Link,
    /// Which batch the ranks keep.
    pub keep: Keep,
    /// The prediction.
    pub projection: Projection,
    /// The records' own figures (8xH100 SXM), for comparison.
    pub records: Vec<RecordFigures>,
    /// What the model assumes.
    pub assumptions: Vec<String>,
}

/// Prints the projection (or its JSON); 0, or 1 when the run cannot be read or projected.
pub fn command(run_dir: PathBuf, o: Options) -> i32 {
    match build(&run_dir, &o) {
        Ok(r) if o.json => super::print_json(&r),
        Ok(r) => {
            out_raw!("{}", render(&r));
            0
        }
        Err(e) => {
            err!("error: {}: {e:#}", run_dir.display());
            1
        }
    }
}

/// The projection of `run_dir`'s run on `o.nproc` ranks. Errors: no readable report, a report
/// without training or from several ranks, a config that cannot be read back.
pub fn build(run_dir: &Path, o: &Options) -> anyhow::Result<ProjectionReport> {
    anyhow::ensure!((1..=65_536).contains(&o.nproc), "--nproc must be between 1 and 65,536, not {}", o.nproc);
    anyhow::ensure!(o.link_gbs > 0.0 && o.link_gbs.is_finite(), "--link-gbs must be a positive number of GB/s");
    anyhow::ensure!(o.link_latency_us >= 0.0 && o.link_latency_us.is_finite(), "--link-latency-us must be 0 or more");
    anyhow::ensure!(o.budget_s > 0.0 && o.budget_s.is_finite(), "--budget-s must be a positive number of seconds");
    if let Some(s) = o.ns_share {
        anyhow::ensure!((0.0..=1.0).contains(&s), "--ns-share must lie in 0..=1");
    }
    let report = Report::load(run_dir)?;
    let path = run_dir.join("report.json");
    let t = &report.train;
    anyhow::ensure!(!t.is_empty(), "{} has no `train` section: not a training run", path.display());
    let num = |k: &str| t.get(k).and_then(|v| v.as_f64()).with_context(|| format!("{}: `train.{k}` is missing", path.display()));
    let world = num("world_size")? as usize;
    anyhow::ensure!(
        world <= 1,
        "{}: a run on {world} ranks; project from a one-rank run (`pipeline run`, or `pipeline launch --nproc 1`)",
        path.display()
    );
    let steps = num("steps")?;
    anyhow::ensure!(steps >= 1.0, "{}: the run trained no step", path.display());
    let phase = |k: &str| {
        t.get("timing_ms_per_step")
            .and_then(|p| p.get(k))
            .and_then(|v| v.as_f64())
            .with_context(|| format!("{}: `train.timing_ms_per_step.{k}` is missing", path.display()))
    };
    let (forward, backward, optimizer) = (phase("forward")?, phase("backward")?, phase("optimizer")?);
    let step_ms = num("step_avg_ms")?;

    let cfg_path = run_dir.join("config.toml");
    let loaded = config::load_with_env::<Config>(&cfg_path, &[], false)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("the run's resolved config {}", cfg_path.display()))?;
    let c = &loaded.config;
    let shape = c.batch_shape().with_context(|| cfg_path.display().to_string())?;
    let stage = c
        .stage_of_kind("step_executor")
        .map(|(_, d)| d.clone())
        .with_context(|| format!("{} has no `step_executor` stage", cfg_path.display()))?;
    let executor = stage.get("impl").and_then(|v| v.as_str()).unwrap_or("candle").to_string();
    let key = |k: &str, default: f64| stage.get(k).and_then(|v| v.to_num()).and_then(|n| n.to_f64()).unwrap_or(default);
    let elem_bytes = if stage.get("dtype").and_then(|v| v.as_str()) == Some("f64") { 8usize } else { 4 };
    let elems = |mib: f64| ((mib * (1 << 20) as f64) / elem_bytes as f64).max(1.0) as usize;
    let (first, cap) = (elems(key("first_bucket_mib", DEFAULT_FIRST_BUCKET_MIB)), elems(key("bucket_mib", DEFAULT_BUCKET_MIB)));

    let m = &c.model;
    let looping = m.num_loops > 0 && m.enable_looping_at < 1.0;
    let schedule = Schedule::new(m, shape.rows, shape.seq_len, 1e-6);
    let events = (schedule.positions(looping) + 2) as f64;
    // The engine sends a bucket when the pass reaches its event; the candle executor
    // all-reduces after the whole pass.
    let during = executor == "engine" && key_bool(&stage, "overlap_allreduce", true);
    let buckets: Vec<BucketIn> = plan_buckets(&schedule, looping, first, cap)
        .iter()
        .map(|b| BucketIn { bytes: (b.elems * elem_bytes) as f64, ready: if during { (b.ready + 1) as f64 / events } else { 1.0 } })
        .collect();
    let slots = &schedule.layout.slots;
    let steps_ns = c.train.muon_backend_steps as f64;
    let ns_flops: Vec<f64> = slots
        .iter()
        .filter(|s| s.group == ParamGroup::Matrix)
        .map(|s| {
            let (a, b) = (s.shape[0] as f64, s.shape.get(1).copied().unwrap_or(1) as f64);
            let (m, n) = (a.min(b), a.max(b));
            // Per iteration: A = X X^T (2 m m n), B = A A (2 m^3), X' = B X (2 m m n).
            steps_ns * (4.0 * m * m * n + 2.0 * m * m * m)
        })
        .collect();
    let muon_elems: usize = slots.iter().filter(|s| s.group == ParamGroup::Matrix).map(|s| s.grad.len).sum();
    let adam_elems: usize = slots.iter().filter(|s| s.group != ParamGroup::Matrix).map(|s| s.grad.len).sum();
    let (ns_share, ns_share_from) = match o.ns_share {
        Some(s) => (s, "--ns-share".to_string()),
        None => {
            let balance = if c.run.device.starts_with("cuda") { GPU_FLOPS_PER_BYTE } else { CPU_FLOPS_PER_BYTE };
            let ns: f64 = ns_flops.iter().sum();
            let elementwise = balance * (muon_elems as f64 * MUON_BYTES_PER_ELEM + adam_elems as f64 * ADAM_BYTES_PER_ELEM);
            let share = if ns + elementwise > 0.0 { ns / (ns + elementwise) } else { 0.0 };
            (share, format!("estimate (Newton-Schulz FLOPs against elementwise bytes at {balance} FLOPs/byte)"))
        }
    };
    let micro = shape.micro_steps.max(1) as f64;
    let matrices = ns_flops.len();
    let measured = Inputs {
        forward_ms: forward / micro,
        backward_ms: backward / micro,
        optimizer_ms: optimizer,
        ns_share,
        other_ms: (step_ms - forward - backward - optimizer).max(0.0),
        step_ms,
        micro_steps: shape.micro_steps,
        ns_flops,
        buckets,
        muon_bytes: (muon_elems * elem_bytes) as f64,
        // The engine broadcasts each update from its owner (an all-gather's bytes); the candle
        // executor all-reduces the updates, zeros where another rank owns them.
        muon_exchange: if executor == "engine" { MuonExchange::AllGather } else { MuonExchange::AllReduce },
        // Grouped, but each broadcast still makes its own way around the ring: a latency each.
        muon_collectives: if executor == "engine" { matrices } else { 1 },
    };
    let link = Link { gbs: o.link_gbs, latency_us: o.link_latency_us };
    let p = projection::project(&measured, o.nproc, &link, o.keep, o.budget_s);
    let mut assumptions = vec![
        "every event of the backward pass (the head, each layer position, the embedding) takes the same time".to_string(),
        "communication does not slow compute (no contention for SMs, cores or memory bandwidth)".to_string(),
        format!(
            "Muon's exchange of updates ({}) is not overlapped",
            if executor == "engine" {
                "an all-gather of the f32 updates: the engine broadcasts each from its owner"
            } else {
                "an all-reduce of every update, as the candle executor does"
            }
        ),
        "every rank is as fast as the measured one: no straggler, no jitter".to_string(),
        "the rest of the measured step (host work, data wait) is the same on every rank".to_string(),
        format!("the Newton-Schulz share of the optimizer's time: {:.1}%, {ns_share_from}", ns_share * 100.0),
    ];
    if !during {
        assumptions.push(format!("the `{executor}` executor all-reduces after the backward pass: no overlap"));
    }
    if p.uneven {
        assumptions.push(format!(
            "{} micro-batches do not divide among {} ranks: {} each (more than the global batch)",
            shape.micro_steps, o.nproc, p.micro_steps
        ));
    }
    Ok(ProjectionReport {
        run_dir: run_dir.display().to_string(),
        measured,
        ns_share_from,
        rows: shape.rows,
        seq_len: shape.seq_len,
        looping,
        executor,
        link,
        keep: o.keep,
        projection: p,
        records: RECORDS.to_vec(),
        assumptions,
    })
}

/// A boolean key of a stage table, `default` when absent.
fn key_bool(stage: &figment::value::Dict, k: &str, default: bool) -> bool {
    stage.get(k).and_then(|v| v.to_bool()).unwrap_or(default)
}

/// The projection as text: the measured run, the prediction, the records.
pub fn render(r: &ProjectionReport) -> String {
    use std::fmt::Write;
    let (i, p) = (&r.measured, &r.projection);
    let mut o = String::new();
    let _ = writeln!(o, "PREDICTION (a model, not a measurement) of {} ranks from the one-rank run {}", p.nproc, r.run_dir);
    let _ = writeln!(o);
    let _ = writeln!(o, "measured on one rank ({} executor, {} rows x {} tokens per micro-batch):", r.executor, r.rows, r.seq_len);
    let _ = writeln!(
        o,
        "  step {:.2} ms = {} micro-batches x (forward {:.2} + backward {:.2} ms)",
        i.step_ms, i.micro_steps, i.forward_ms, i.backward_ms
    );
    let _ = writeln!(
        o,
        "                 + optimizer {:.2} ms ({:.0}% Newton-Schulz) + other {:.2} ms",
        i.optimizer_ms,
        i.ns_share * 100.0,
        i.other_ms
    );
    let mib = |b: f64| b / (1 << 20) as f64;
    let grad: f64 = i.buckets.iter().map(|b| b.bytes).sum();
    let readies: Vec<String> = i.buckets.iter().map(|b| format!("{:.1} MiB @{:.0}%", mib(b.bytes), b.ready * 100.0)).collect();
    let _ = writeln!(
        o,
        "  gradients {:.2} MiB in {} buckets ({}), Muon updates {:.2} MiB",
        mib(grad),
        i.buckets.len(),
        readies.join(", "),
        mib(i.muon_bytes)
    );
    let _ = writeln!(o);
    let keep = match r.keep {
        Keep::Global => "the global batch",
        Keep::PerRank => "each rank the one-rank batch",
    };
    let _ = writeln!(o, "interconnect: ring collectives, {} GB/s bus bandwidth, {} µs per step; {keep}", r.link.gbs, r.link.latency_us);
    let _ = writeln!(o, "predicted on {} ranks ({} micro-batches each):", p.nproc, p.micro_steps);
    let _ = writeln!(
        o,
        "  compute per rank      {:>9.2} ms (Newton-Schulz share of the slowest rank {:.0}%)",
        p.compute_ms,
        p.ns_rank_share * 100.0
    );
    let _ = writeln!(o, "  gradient all-reduce   {:>9.2} ms, exposed {:.2} ms", p.grad_comm_ms, p.grad_exposed_ms);
    let _ = writeln!(o, "  Muon update exchange  {:>9.2} ms, exposed", p.muon_comm_ms);
    let _ = writeln!(o, "  communication         {:>9.2} ms, exposed {:.2} ms", p.comm_ms, p.exposed_ms);
    let _ = writeln!(o, "  step                  {:>9.2} ms", p.step_ms);
    let _ = writeln!(o, "  steps in {:.0} s        {:>9}", p.budget_s, p.steps_in_budget);
    let _ = writeln!(o);
    let _ = writeln!(o, "the records on 8xH100 SXM (measured, for comparison):");
    for rec in &r.records {
        let _ =
            writeln!(o, "  {}: {:.1} ms per step, {} steps in {:.0} s ({})", rec.name, rec.step_ms, rec.steps, rec.budget_s, rec.source);
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "assumptions:");
    for a in &r.assumptions {
        let _ = writeln!(o, "  - {a}");
    }
    o
}
