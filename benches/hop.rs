//! Per-hop cost of the pipeline runtime, next to bare flume channels.
//!
//! # What is measured
//!
//! 1,000,000 small items pass through a 4-stage chain, source -> transform -> transform -> sink,
//! i.e. 3 hops (channels). Each item is a [`pipeline::runtime::message::Blob`]: a sequence number and an
//! `Arc<[u8]>` clone of one shared 64-byte buffer, which is exactly what the runtime's
//! `synthetic/blob` source emits. Three variants run side by side, each at queue depth 2 and
//! 1024:
//!
//! - `raw_flume`: 4 plain `std::thread`s joined by 3 `flume::bounded(depth)` channels, blocking
//!   `send` / `recv`, the sink counting. The floor: what the channels alone cost.
//! - `runtime_uninstrumented`: the pipeline runtime with `[run] instrument = false`
//!   (`synthetic/blob count=1000000 size_bytes=64` -> `delay/sleep delay_us=0` ->
//!   `delay/sleep delay_us=0` -> `drain/count`, every `queue = depth`).
//! - `runtime_instrumented`: the same with `instrument = true` (the default), `warmup_items = 20`.
//! - `runtime_traced`: instrumented and `trace = true` (the last 10,000 items of each stage kept,
//!   `trace.json` written after the run, inside the timing).
//!
//! The runtime variants go through the library exactly as `pipeline run` does: the TOML is
//! written to a temporary directory, loaded with `pipeline::runtime::config::load_with_env(.., false)`
//! (environment ignored), and run with `pipeline::cli::run::run` into a fresh, empty `--out`
//! directory that is deleted after the run. A timed run covers the whole `run::run` call:
//! planning, making the run directory, writing `config.toml`, starting and joining the stage
//! threads, building and fsyncing `report.json`. The summary prints how much of that lies
//! outside the stage threads (run time minus the report's `wall_s`): a few milliseconds, i.e.
//! well under 1 ns per item-hop. The raw-flume timing likewise includes spawning and joining
//! its threads.
//!
//! "ns per item per hop" is the wall time of one whole run divided by 1,000,000 x 3. It is a
//! throughput figure for the whole chain (with 4 threads on few cores the stages share CPUs,
//! so hops are not fully overlapped), not a latency of one channel crossing. Criterion's
//! throughput counts one *element* per item per hop (3,000,000 per run), so its `elem/s` is
//! the inverse of that figure.
//!
//! # How to run
//!
//! ```text
//! cargo bench --bench hop                  # all eight, then the summary table
//! cargo bench --bench hop -- depth1024     # one depth only (the summary shows what ran)
//! ```
//!
//! `HOP_BENCH_ITEMS=100000 cargo bench --bench hop` runs fewer items per run, for a quick look
//! (per-hop figures stay comparable; only the run length changes).
//!
//! Every sample is whole runs of 1,000,000 items (`iter_custom`, flat sampling), 10 samples per
//! variant after one warm-up run. Expect about 9 minutes on a 2-core machine: at depth 2 every
//! hop blocks and wakes a thread, so a run takes ~15 s and the 3 x 11 depth-2 runs alone take
//! ~8 minutes (10 samples is criterion's minimum); depth 1024 takes about half a minute. After the criterion groups a plain summary table is printed
//! to stdout, computed from the bench's own timing of every one of those runs (median over all
//! runs of a variant, warm-up included): ns per item per hop for each variant and depth, and the
//! instrumentation overhead relative to the uninstrumented runtime and to raw flume's hop cost.
//!
//! On a small, shared machine (2 cores here) results are noisy: 4 busy threads plus the
//! runtime's sampling thread contend for the cores, so compare variants within one invocation
//! rather than across invocations.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use pipeline::runtime::config::Loaded;
use pipeline::runtime::control::Control;
use pipeline::runtime::message::Blob;
use pipeline::train::config::Config;

/// Items per run unless `HOP_BENCH_ITEMS` says otherwise.
const DEFAULT_ITEMS: u64 = 1_000_000;
/// Channels an item crosses: source -> mid -> post -> sink.
const HOPS: u64 = 3;
/// Payload size of every blob (one shared buffer).
const SIZE_BYTES: usize = 64;
/// Queue depths compared.
const DEPTHS: [usize; 2] = [2, 1024];

const RAW: &str = "raw_flume";
const UNINSTR: &str = "runtime_uninstrumented";
const INSTR: &str = "runtime_instrumented";
const TRACED: &str = "runtime_traced";
const VARIANTS: [&str; 4] = [RAW, UNINSTR, INSTR, TRACED];

/// One timed run: the whole-run wall time, and for runtime variants the report's own `wall_s`
/// (stage threads only).
#[derive(Clone, Copy)]
struct RunTiming {
    total: Duration,
    stage_wall: Option<Duration>,
}

/// Every timed run, by (depth, variant), in the order they ran (criterion's warm-up run first).
static RUNS: Mutex<BTreeMap<(usize, &'static str), Vec<RunTiming>>> = Mutex::new(BTreeMap::new());

/// Items per run: `HOP_BENCH_ITEMS` (for a quicker look), else 1,000,000.
fn items() -> u64 {
    static N: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *N.get_or_init(|| match std::env::var("HOP_BENCH_ITEMS") {
        Ok(v) => v
            .trim()
            .replace('_', "")
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| panic!("HOP_BENCH_ITEMS={v:?}: expected a positive integer")),
        Err(_) => DEFAULT_ITEMS,
    })
}

fn remember(depth: usize, variant: &'static str, t: RunTiming) {
    RUNS.lock().unwrap().entry((depth, variant)).or_default().push(t);
}

// ---------------------------------------------------------------------------------------------
// Variant (a): raw flume
// ---------------------------------------------------------------------------------------------

/// 4 threads, 3 bounded flume channels, [`items`] blobs; returns the wall time from before the
/// first spawn to after the last join.
fn raw_flume_run(depth: usize) -> Duration {
    let data: Arc<[u8]> = vec![0xA5u8; SIZE_BYTES].into();
    let count = items();
    let start = Instant::now();
    let (tx1, rx1) = flume::bounded::<Blob>(depth);
    let (tx2, rx2) = flume::bounded::<Blob>(depth);
    let (tx3, rx3) = flume::bounded::<Blob>(depth);
    let source = thread::spawn(move || {
        for seq in 0..count {
            if tx1.send(Blob { seq, data: data.clone() }).is_err() {
                break;
            }
        }
    });
    let mid = thread::spawn(move || {
        for item in rx1.iter() {
            if tx2.send(item).is_err() {
                break;
            }
        }
    });
    let post = thread::spawn(move || {
        for item in rx2.iter() {
            if tx3.send(item).is_err() {
                break;
            }
        }
    });
    let sink = thread::spawn(move || {
        let mut n = 0u64;
        for item in rx3.iter() {
            black_box(&item);
            n += 1;
        }
        n
    });
    source.join().unwrap();
    mid.join().unwrap();
    post.join().unwrap();
    let n = sink.join().unwrap();
    let elapsed = start.elapsed();
    assert_eq!(n, count, "raw flume sink counted {n} items");
    elapsed
}

// ---------------------------------------------------------------------------------------------
// Variants (b) and (c): the pipeline runtime
// ---------------------------------------------------------------------------------------------

/// The config of the runtime chain.
fn chain_toml(depth: usize, instrument: bool, trace: bool) -> String {
    let count = items();
    format!(
        r#"[run]
name = "hop"
seed = 0
warmup_items = 20
instrument = {instrument}
trace = {trace}

[stages.source]
kind = "synthetic"
impl = "blob"
count = {count}
size_bytes = {SIZE_BYTES}

[stages.mid]
kind = "delay"
impl = "sleep"
inputs = ["source"]
queue = {depth}
delay_us = 0

[stages.post]
kind = "delay"
impl = "sleep"
inputs = ["mid"]
queue = {depth}
delay_us = 0

[stages.sink]
kind = "drain"
impl = "count"
inputs = ["post"]
queue = {depth}
"#
    )
}

/// Scratch space of this bench process: configs and run directories.
fn scratch() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("pipeline-hop-bench-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("cannot create the bench's temp dir");
        d
    })
}

/// Writes and loads the config of one runtime variant (environment ignored).
fn load_chain(depth: usize, instrument: bool, trace: bool) -> Loaded<Config> {
    let path = scratch().join(format!("hop-depth{depth}-instrument-{instrument}-trace-{trace}.toml"));
    std::fs::write(&path, chain_toml(depth, instrument, trace)).expect("cannot write the bench config");
    match pipeline::runtime::config::load_with_env(&path, &[], false) {
        Ok(l) => l,
        Err(e) => panic!("bench config does not load:\n{e}"),
    }
}

/// One whole runtime run into a fresh `--out` directory, deleted afterwards (outside the timing).
fn runtime_run(loaded: &Loaded<Config>) -> RunTiming {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let out = scratch().join(format!("run-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
    let start = Instant::now();
    let outcome = pipeline::cli::run::run(loaded, Some(&out), None, Arc::new(Control::new()), |_, _| {});
    let total = start.elapsed();
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => panic!("runtime run failed: {e}"),
    };
    let report = &outcome.report;
    let sink = report.stages.get("sink").expect("report has no `sink` stage");
    assert_eq!(report.run.status, "completed", "run ended as {:?}: {:?}", report.run.status, report.run.error);
    assert_eq!(sink.items_in, items(), "runtime sink counted {} items", sink.items_in);
    let stage_wall = Some(Duration::from_secs_f64(report.run.wall_s));
    drop(outcome);
    std::fs::remove_dir_all(&out).expect("cannot delete the run directory");
    RunTiming { total, stage_wall }
}

// ---------------------------------------------------------------------------------------------
// Criterion
// ---------------------------------------------------------------------------------------------

fn bench_hops(c: &mut Criterion) {
    for depth in DEPTHS {
        let mut group = c.benchmark_group(format!("hop/depth{depth}"));
        // 10 samples, the fewest criterion accepts: each sample is whole 1M-item runs (~0.3 s at
        // depth 1024, ~15 s at depth 2 on this 2-core machine), so fewer runs is not an option.
        group.sample_size(10);
        // Flat sampling: every sample gets the same number of runs. The default (linear) would
        // ask for 1, 2, ..., 10 runs per sample, i.e. 55 runs per benchmark.
        group.sampling_mode(SamplingMode::Flat);
        // Warm-up stops after the first routine call that exceeds this, so a 1 ms target means
        // exactly one warm-up run (criterion also uses it to estimate the time per run).
        group.warm_up_time(Duration::from_millis(1));
        // Target for the 10 samples together. Flat sampling gives each sample
        // ceil(10 s / 10 / time of one run) runs, at least 1: at depth 1024 (~0.3 s a run here)
        // that is a few runs per sample, ~10 s per variant; at depth 2 (~15 s a run here) it is
        // exactly 1 run per sample, so those take 11 runs whatever the target, and criterion
        // warns "Unable to complete 10 samples in 10.0s" (expected; nothing shorter exists with
        // 10 samples of 1M items).
        group.measurement_time(Duration::from_secs(10));
        // One element = one item crossing one hop, so criterion's elem/s is the hop rate and its
        // inverse the ns per item per hop that the summary prints.
        group.throughput(Throughput::Elements(items() * HOPS));

        group.bench_function(RAW, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let d = raw_flume_run(depth);
                    remember(depth, RAW, RunTiming { total: d, stage_wall: None });
                    total += d;
                }
                total
            })
        });
        for (name, instrument, trace) in [(UNINSTR, false, false), (INSTR, true, false), (TRACED, true, true)] {
            let loaded = load_chain(depth, instrument, trace);
            group.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = runtime_run(&loaded);
                        remember(depth, name, t);
                        total += t.total;
                    }
                    total
                })
            });
        }
        group.finish();
    }
}

// ---------------------------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------------------------

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn ns_per_item_hop(d: Duration) -> f64 {
    d.as_nanos() as f64 / (items() * HOPS) as f64
}

fn print_summary() {
    let runs = RUNS.lock().unwrap();
    if runs.is_empty() {
        return;
    }
    println!();
    let n = items();
    println!(
        "hop summary: {n} items x {HOPS} hops per run, {SIZE_BYTES}-byte shared blobs; ns per item per hop = run wall time / {}",
        n * HOPS
    );
    println!("(median and min over every run of a variant, criterion's warm-up run included)");
    println!();
    println!("{:<6} {:<24} {:>5} {:>12} {:>12} {:>14}", "depth", "variant", "runs", "median ns", "min ns", "outside stages");
    let mut med: BTreeMap<(usize, &str), f64> = BTreeMap::new();
    for depth in DEPTHS {
        for variant in VARIANTS {
            let Some(ts) = runs.get(&(depth, variant)) else { continue };
            let per: Vec<f64> = ts.iter().map(|t| ns_per_item_hop(t.total)).collect();
            let m = median(per.clone());
            let min = per.iter().copied().fold(f64::INFINITY, f64::min);
            med.insert((depth, variant), m);
            let outside: Vec<f64> = ts.iter().filter_map(|t| t.stage_wall.map(|w| t.total.as_secs_f64() - w.as_secs_f64())).collect();
            let outside = if outside.is_empty() { "-".to_string() } else { format!("{:.1} ms", median(outside) * 1e3) };
            println!("{:<6} {:<24} {:>5} {:>12.1} {:>12.1} {:>14}", depth, variant, ts.len(), m, min, outside);
        }
    }
    println!();
    println!("instrumentation overhead = median(instrumented) - median(uninstrumented), per item per hop:");
    for depth in DEPTHS {
        let (Some(&a), Some(&b), Some(&c)) = (med.get(&(depth, RAW)), med.get(&(depth, UNINSTR)), med.get(&(depth, INSTR))) else {
            continue;
        };
        let over = c - b;
        println!(
            "  depth {depth:<5} {over:+8.1} ns  = {:+6.1}% vs runtime without instrumentation, {:+6.1}% vs raw flume hop ({a:.1} ns)",
            100.0 * over / b,
            100.0 * over / a
        );
        println!(
            "  {:<11} (runtime without instrumentation vs raw flume: {:+.1} ns, {:+.1}%; instrumented vs raw flume: {:+.1}%)",
            "",
            b - a,
            100.0 * (b - a) / a,
            100.0 * (c - a) / a
        );
    }
    println!();
    println!("tracing overhead = median(traced) - median(instrumented), per item per hop (the traced runs also write trace.json):");
    for depth in DEPTHS {
        let (Some(ti), Some(tt)) = (runs.get(&(depth, INSTR)), runs.get(&(depth, TRACED))) else { continue };
        let (c, d) = (med[&(depth, INSTR)], med[&(depth, TRACED)]);
        let stage = |ts: &Vec<RunTiming>| median(ts.iter().filter_map(|t| t.stage_wall).map(ns_per_item_hop).collect());
        let (ci, ct) = (stage(ti), stage(tt));
        println!(
            "  depth {depth:<5} {:+8.1} ns = {:+6.1}% of the instrumented hop; stage threads alone: {:+.1} ns = {:+.1}%",
            d - c,
            100.0 * (d - c) / c,
            ct - ci,
            100.0 * (ct - ci) / ci
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench_hops(&mut c);
    c.final_summary();
    print_summary();
    let _ = std::fs::remove_dir_all(scratch());
}
