//! `[run] trace = true`: `trace.json` in the Chrome trace event format, bounded by
//! `trace_items`, with a track per stage, flow arrows that follow every item along the graph,
//! channel lengths as counters, and a step executor's phases nested in its steps.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use common::tiny::*;
use common::{assert_fails, run, scratch, synthetic_toml, text};
use serde_json::Value;

fn events(out: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(out.join("trace.json")).expect("trace.json written");
    let v: Value = serde_json::from_str(&text).expect("trace.json is JSON");
    v["traceEvents"].as_array().expect("traceEvents").clone()
}

/// Thread id of each stage's track, from the metadata events.
fn tracks(ev: &[Value]) -> BTreeMap<String, u64> {
    ev.iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| (e["args"]["name"].as_str().unwrap().to_string(), e["tid"].as_u64().unwrap()))
        .collect()
}

fn slices<'a>(ev: &'a [Value], tid: u64, cat: &str) -> Vec<&'a Value> {
    ev.iter().filter(|e| e["ph"] == "X" && e["tid"] == tid && e["cat"] == cat).collect()
}

/// A 4-stage chain, 300 items, each stage keeping its last 100: the tracks, the bound, a slice
/// per kept item, every flow arrow from a producer's slice to its consumer's, an item followed
/// from the source to the sink, and counters per channel.
#[test]
fn a_chain_is_traced_within_its_bound() {
    let out = scratch("trace-chain");
    let sets = [
        "run.trace=true",
        "run.trace_items=100",
        "run.sample_interval_us=100",
        "stages.source.count=300",
        "stages.source.delay_us=100",
        "stages.mid.delay_us=300",
        "stages.post.delay_us=100",
        "stages.sink.delay_us=100",
    ];
    let o = run(&synthetic_toml(), &out, &sets);
    assert!(o.status.success(), "{}", text(&o));
    let ev = events(&out);
    let t = tracks(&ev);
    assert_eq!(t.keys().cloned().collect::<Vec<_>>(), ["mid", "post", "sink", "source"]);
    for (name, &tid) in &t {
        let items = slices(&ev, tid, "item");
        assert_eq!(items.len(), 100, "`{name}` keeps its last 100 of 300 items");
        assert!(items.iter().all(|e| e["name"] == name.as_str() && e["dur"].as_f64().unwrap() >= 0.0));
    }
    // The slow middle stage holds the source back (blocked sends) and starves the stages after
    // it (waits for input).
    assert!(!slices(&ev, t["source"], "send").is_empty(), "the source is blocked by `mid`");
    assert!(!slices(&ev, t["post"], "wait").is_empty(), "`post` waits for `mid`");

    // Flow arrows: every end has its start, on the producing stage's track, no later.
    let starts: HashMap<u64, &Value> = ev.iter().filter(|e| e["ph"] == "s").map(|e| (e["id"].as_u64().unwrap(), e)).collect();
    let ends: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "f").collect();
    assert!(ends.len() >= 250, "{} arrows", ends.len());
    let upstream = |tid: u64| match t.iter().find(|&(_, &v)| v == tid).unwrap().0.as_str() {
        "mid" => t["source"],
        "post" => t["mid"],
        "sink" => t["post"],
        other => panic!("an arrow into `{other}`"),
    };
    for f in &ends {
        let s = starts[&f["id"].as_u64().unwrap()];
        assert_eq!(s["tid"].as_u64().unwrap(), upstream(f["tid"].as_u64().unwrap()), "{s} -> {f}");
        assert!(s["ts"].as_f64() <= f["ts"].as_f64(), "{s} -> {f}");
        assert_eq!(f["bp"], "e");
    }
    // Follow the last item the sink took back to the source: three hops.
    let sink_last =
        slices(&ev, t["sink"], "item").into_iter().max_by(|a, b| a["ts"].as_f64().partial_cmp(&b["ts"].as_f64()).unwrap()).unwrap();
    let mut id = sink_last["args"]["in"].as_u64().unwrap();
    let mut hops = 0;
    while let Some(s) = starts.get(&id) {
        hops += 1;
        let tid = s["tid"].as_u64().unwrap();
        let ts = s["ts"].as_f64().unwrap();
        // The slice the arrow leaves from, and the item that slice took in.
        let from = slices(&ev, tid, "item")
            .into_iter()
            .find(|e| e["ts"].as_f64().unwrap() <= ts && ts <= e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap())
            .unwrap_or_else(|| panic!("no slice around {s}"));
        id = from["args"]["in"].as_u64().unwrap();
        if id == 0 {
            assert_eq!(tid, t["source"], "only a source's items come from nowhere");
            break;
        }
    }
    assert_eq!(hops, 3, "source -> mid -> post -> sink");

    // A counter per channel, lengths within capacity.
    let counters: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "C").collect();
    for ch in ["source->mid", "mid->post", "post->sink"] {
        assert!(counters.iter().any(|e| e["name"] == ch), "no counter for {ch}");
    }
    assert!(counters.iter().all(|e| e["args"]["length"].as_u64().unwrap() <= 2));
    let _ = std::fs::remove_dir_all(&out);
}

/// Off by default: no trace.json. Tracing without instrumentation is a config error naming the
/// key, and nothing is created.
#[test]
fn off_by_default_and_needs_instrumentation() {
    let out = scratch("trace-off");
    let o = run(&synthetic_toml(), &out, &["stages.source.count=30"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!out.join("trace.json").exists());
    let _ = std::fs::remove_dir_all(&out);
    let o = run(&synthetic_toml(), &out, &["run.trace=true", "run.instrument=false"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["run.trace", "instrument"]);
    assert!(!out.exists(), "a refused config creates nothing");
}

/// A training run: the executor's track nests forward, backward and optimizer inside its
/// items, and a validation.
#[test]
fn a_step_executor_nests_its_phases() {
    let c = corpus("trace-train");
    let out = c.dir.join("run");
    let (_, o) = train_ok(&config(&c), &out, &["train.iterations=4", "train.val_every=2", "run.trace=true"]);
    let ev = events(&out);
    let t = tracks(&ev);
    let tid = t["train"];
    let items = slices(&ev, tid, "item");
    let phases = slices(&ev, tid, "phase");
    let count = |name: &str| phases.iter().filter(|e| e["name"] == name).count();
    assert_eq!((count("forward"), count("backward"), count("optimizer")), (4, 4, 4), "{}", text(&o));
    assert!(count("validation") >= 2, "validations at steps 2 and 4 (and the final one)");
    // Each forward lies inside an item slice of the executor (to rounding).
    for p in phases.iter().filter(|e| e["name"] == "forward") {
        let (ts, end) = (p["ts"].as_f64().unwrap(), p["ts"].as_f64().unwrap() + p["dur"].as_f64().unwrap());
        assert!(
            items.iter().any(|i| {
                let (a, b) = (i["ts"].as_f64().unwrap(), i["ts"].as_f64().unwrap() + i["dur"].as_f64().unwrap());
                a - 1.0 <= ts && end <= b + 1.0
            }),
            "forward {p} is in no step"
        );
    }
}
