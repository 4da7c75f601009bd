//! What `[run] trace = true` costs: the loader pipeline (`pipelines/loader.toml`: shard reader
//! -> shuffled sampler -> pin -> upload -> sink, the record's micro-batch of 48 x 2048 tokens)
//! with every queue 1024 deep, traced and not, side by side.
//!
//! # What is measured
//!
//! Runs alternate in ABBA order (off, on, on, off, ...) so that a warming page cache or a
//! neighbour's load falls on both variants alike. Each run moves `TRACE_BENCH_STEPS` steps (8
//! micro-batches each; default 1,000) through the graph, exactly as `pipeline run` does
//! (`pipeline::cli::run::run`, into a fresh `--out`, deleted afterwards), with the trace
//! keeping the last 10,000 items per stage (the default `trace_items`), so the traced runs
//! also pay for writing `trace.json`. The figure is micro-batches through the sink per second
//! of the run's wall time (`report.json`'s `wall_s`, stage threads only) and, beside it, of the
//! whole call (planning, report and trace writing included). The summary prints the median of
//! each variant and the traced/untraced ratio; the target is a cost under 2%.
//!
//! # How to run
//!
//! ```text
//! scripts/fetch-demo-data.sh      # once: the demo shards the loader config reads
//! cargo bench --bench trace       # 8 pairs of runs, about a minute on 2 cores
//! TRACE_BENCH_PAIRS=20 TRACE_BENCH_STEPS=2000 cargo bench --bench trace
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use pipeline::runtime::config::Loaded;
use pipeline::runtime::control::Control;
use pipeline::train::config::Config;

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One measured run.
struct Timing {
    /// Micro-batches per second of the stage threads' wall time.
    stage_rate: f64,
    /// Micro-batches per second of the whole `run` call.
    call_rate: f64,
    /// Bytes of `trace.json` (0 when not traced).
    trace_bytes: u64,
}

fn load(trace: bool, steps: u64) -> Loaded<Config> {
    let sets: Vec<String> = [
        format!("stages.sink.stop_after_steps={steps}"),
        "run.max_seconds=0".into(),
        "stages.sampler.queue=1024".into(),
        "stages.pin.queue=1024".into(),
        "stages.upload.queue=1024".into(),
        "stages.sink.queue=1024".into(),
        format!("run.trace={trace}"),
    ]
    .into();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/loader.toml");
    match pipeline::runtime::config::load_with_env(&path, &sets, false) {
        Ok(l) => l,
        Err(e) => panic!("pipelines/loader.toml does not load:\n{e}"),
    }
}

fn run_once(loaded: &Loaded<Config>, out: &Path) -> Timing {
    let start = Instant::now();
    let outcome = pipeline::cli::run::run(loaded, Some(out), None, Arc::new(Control::new()), |_, _| {});
    let call = start.elapsed().as_secs_f64();
    let outcome = outcome.unwrap_or_else(|e| panic!("loader run failed: {e}"));
    let r = &outcome.report;
    assert_eq!(r.run.status, "completed", "{:?}", r.run.error);
    let items = r.stages["sink"].items_in as f64;
    let trace_bytes = std::fs::metadata(out.join("trace.json")).map(|m| m.len()).unwrap_or(0);
    let t = Timing { stage_rate: items / r.run.wall_s, call_rate: items / call, trace_bytes };
    std::fs::remove_dir_all(out).expect("cannot delete the run directory");
    t
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument that is not this bench's name skips it.
    if std::env::args().skip(1).any(|a| !a.starts_with('-') && !"trace".contains(a.as_str())) {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !root.join("data/demo/shards").is_dir() {
        eprintln!("trace bench: data/demo/shards is missing: run scripts/fetch-demo-data.sh first");
        std::process::exit(1);
    }
    let (pairs, steps) = (env_or("TRACE_BENCH_PAIRS", 8), env_or("TRACE_BENCH_STEPS", 1000));
    let scratch: PathBuf = std::env::temp_dir().join(format!("pipeline-trace-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("cannot create the bench's temp dir");
    let configs = [load(false, steps), load(true, steps)];
    // One untimed run of each first: page cache and allocator warm.
    for (k, c) in configs.iter().enumerate() {
        run_once(c, &scratch.join(format!("warm-{k}")));
    }
    let mut runs: [Vec<Timing>; 2] = [Vec::new(), Vec::new()];
    let mut n = 0;
    for p in 0..pairs {
        let order = if p % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            n += 1;
            runs[k].push(run_once(&configs[k], &scratch.join(format!("run-{n}"))));
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let stage = |k: usize| median(runs[k].iter().map(|t| t.stage_rate).collect());
    let call = |k: usize| median(runs[k].iter().map(|t| t.call_rate).collect());
    println!("\ntrace bench: loader pipeline, queues 1024, {steps} steps ({} micro-batches) per run, {pairs} pairs (ABBA)", steps * 8);
    println!("{:<22} {:>26} {:>26}", "", "micro-batches/s (stages)", "micro-batches/s (call)");
    let spread = |k: usize| {
        let v: Vec<f64> = runs[k].iter().map(|t| t.stage_rate).collect();
        format!("{:.0}..{:.0}", v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(0.0, f64::max))
    };
    println!("{:<22} {:>26.0} {:>26.0}   stages: {}", "trace = false", stage(0), call(0), spread(0));
    println!("{:<22} {:>26.0} {:>26.0}   stages: {}", "trace = true", stage(1), call(1), spread(1));
    println!("{:<22} {:>25.2}% {:>25.2}%", "cost of tracing", (1.0 - stage(1) / stage(0)) * 100.0, (1.0 - call(1) / call(0)) * 100.0);
    println!("trace.json: {} bytes (median)", median(runs[1].iter().map(|t| t.trace_bytes as f64).collect()) as u64);
}
