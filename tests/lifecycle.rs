//! Lifecycle: a failing or panicking stage stops the graph within 1 s with a clear error and a
//! report; Ctrl-C at random moments never hangs and always leaves a readable report; stop
//! requests, time limits and drain timeouts end runs as documented.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{bin, report, run, scratch, synthetic_toml, text, wait_or_kill};

fn failing(stage: &str, mode: &str) {
    let out = scratch(&format!("fail-{stage}-{mode}"));
    let sets = [
        "stages.source.count=0".to_string(), // endless: only the failure can end the run
        "stages.source.delay_us=100".into(),
        format!("stages.{stage}.fail_at=40"),
        format!("stages.{stage}.fail_mode=\"{mode}\""),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let mut c = bin();
    c.arg("run").arg(synthetic_toml()).arg("--out").arg(&out).arg("-q");
    for s in &sets {
        c.arg("--set").arg(s);
    }
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    wait_or_kill(&mut child, Duration::from_secs(30), "failing run");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains(&format!("stage `{stage}` failed")), "{}", text(&o));
    let cause = if mode == "panic" { "injected panic at item 40" } else { "injected failure at item 40" };
    assert!(stderr.contains(cause), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.run.status, "failed");
    assert_eq!(r.run.exit_code, 1);
    let want_state = if mode == "panic" { "panicked" } else { "failed" };
    assert_eq!(r.stages[stage].state, want_state);
    for (name, s) in &r.stages {
        assert_ne!(s.state, "hung", "stage {name} hung");
    }
    let stop_ms = r.run.stop_ms.expect("an aborted run reports its stop time");
    assert!(stop_ms < 1000.0, "graph took {stop_ms} ms to stop after the failure");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn failing_source_stops_the_graph() {
    failing("source", "error");
}

#[test]
fn failing_middle_stage_stops_the_graph() {
    failing("mid", "error");
}

#[test]
fn failing_sink_stops_the_graph() {
    failing("sink", "error");
}

#[test]
fn panicking_source_stops_the_graph() {
    failing("source", "panic");
}

#[test]
fn panicking_middle_stage_stops_the_graph() {
    failing("mid", "panic");
}

#[test]
fn panicking_sink_stops_the_graph() {
    failing("sink", "panic");
}

/// Starts an endless run, waits until it has made its run directory, and returns the child.
fn start_endless(out: &std::path::Path, extra: &[&str]) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut c = bin();
    c.arg("run").arg(synthetic_toml()).arg("--out").arg(out).args(["--set", "stages.source.count=0"]);
    for s in extra {
        c.arg("--set").arg(s);
    }
    let mut child = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let t = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) if l.contains("run directory") => break,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                panic!("the run never announced its run directory");
            }
        }
        assert!(t.elapsed() < Duration::from_secs(30));
    }
    (child, rx)
}

fn sigint(child: &Child) {
    let ok = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
}

#[test]
fn ctrl_c_at_random_moments_never_hangs_and_always_reports() {
    let seed = std::env::var("CTRLC_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_u64);
    let mut rng = fastrand::Rng::with_seed(seed);
    for rep in 0..20 {
        let out = scratch(&format!("ctrlc-{rep}"));
        // Vary where the time goes, so the signal lands in different stages' calls.
        let slow = ["source", "mid", "post", "sink"][rng.usize(0..4)];
        let delay = format!("stages.{slow}.delay_us={}", rng.u32(0..3000));
        let (mut child, _lines) = start_endless(&out, &[&delay]);
        let wait_ms = rng.u64(0..400);
        std::thread::sleep(Duration::from_millis(wait_ms));
        sigint(&child);
        let status = wait_or_kill(&mut child, Duration::from_secs(30), &format!("rep {rep} (seed {seed}, {delay}, {wait_ms} ms)"));
        assert_eq!(status.code(), Some(130), "rep {rep} (seed {seed}): exit status {status:?}");
        let r = report(&out);
        assert_eq!(r.run.status, "interrupted", "rep {rep}");
        assert!(r.stages.values().all(|s| s.state == "finished"), "rep {rep}: {}", r.render());
        // Graceful drain: everything the source produced reached the sink.
        assert_eq!(r.stages["source"].items, r.stages["sink"].items, "rep {rep}: items lost in the drain\n{}", r.render());
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn drain_timeout_turns_a_stuck_drain_into_an_abort() {
    let out = scratch("drain-timeout");
    // The sink takes 5 s per item: the drain cannot finish within 300 ms.
    let (mut child, _lines) =
        start_endless(&out, &["stages.sink.delay_us=5000000", "run.drain_timeout_ms=300", "stages.source.delay_us=0"]);
    // Long enough for the source's first items to be in flight on a loaded machine: with
    // nothing produced yet the drain has nothing to do and finishes in time (a 200 ms wait
    // failed so under a parallel build).
    std::thread::sleep(Duration::from_millis(1000));
    sigint(&child);
    let status = wait_or_kill(&mut child, Duration::from_secs(20), "stuck drain");
    assert_eq!(status.code(), Some(130));
    let r = report(&out);
    assert_eq!(r.run.status, "interrupted");
    assert!(r.run.notes.iter().any(|n| n.contains("drain_timeout_ms")), "{:?}", r.run.notes);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn second_ctrl_c_aborts_at_once() {
    let out = scratch("ctrlc-twice");
    let (mut child, _lines) =
        start_endless(&out, &["stages.sink.delay_us=5000000", "run.drain_timeout_ms=60000", "stages.source.delay_us=0"]);
    std::thread::sleep(Duration::from_millis(200));
    sigint(&child);
    std::thread::sleep(Duration::from_millis(200));
    sigint(&child);
    let status = wait_or_kill(&mut child, Duration::from_secs(20), "second Ctrl-C");
    assert_eq!(status.code(), Some(130));
    assert_eq!(report(&out).run.status, "interrupted");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_stage_can_stop_the_graph() {
    let out = scratch("stop-after");
    let o = run(&synthetic_toml(), &out, &["stages.source.count=0", "stages.sink.stop_after=50", "stages.source.delay_us=0"]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.run.status, "completed");
    assert!(r.stages["sink"].items >= 50);
    assert_eq!(r.stages["source"].items, r.stages["sink"].items, "the drain delivers what was produced");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn max_seconds_ends_an_endless_run() {
    let out = scratch("max-seconds");
    let o = run(&synthetic_toml(), &out, &["stages.source.count=0", "run.max_seconds=0.3"]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.run.status, "completed");
    assert!(r.run.notes.iter().any(|n| n.contains("max_seconds")));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_rate_limited_source_stops_at_once_on_a_graceful_stop() {
    let out = scratch("slow-rate");
    // One item every 10 s: the source must not finish its sleep after max_seconds stops the run.
    let t = Instant::now();
    let o = run(
        &synthetic_toml(),
        &out,
        &["stages.source.count=0", "stages.source.rate_per_s=0.1", "run.max_seconds=0.5", "run.drain_timeout_ms=5000"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&out);
    assert!(r.run.notes.iter().all(|n| !n.contains("did not drain")), "{:?}", r.run.notes);
    assert!(t.elapsed() < Duration::from_secs(4), "took {:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn resolved_config_repeats_the_run() {
    let out = scratch("resolved");
    let o = run(&synthetic_toml(), &out, &["stages.source.count=30", "stages.mid.queue=7"]);
    assert!(o.status.success(), "{}", text(&o));
    let cfg = std::fs::read_to_string(out.join("config.toml")).unwrap();
    let t: toml::Table = toml::from_str(&cfg).unwrap();
    assert_eq!(t["stages"]["mid"]["queue"].as_integer(), Some(7));
    assert_eq!(t["stages"]["source"]["count"].as_integer(), Some(30));
    // Defaults are written out too.
    assert_eq!(t["stages"]["sink"]["stop_after"].as_integer(), Some(0));
    assert_eq!(t["run"]["warmup_items"].as_integer(), Some(20));
    let again = out.join("again");
    let o2 = run(&out.join("config.toml"), &again, &[]);
    assert!(o2.status.success(), "{}", text(&o2));
    let r2 = report(&again);
    assert_eq!(r2.stages["sink"].items, 30);
    assert_eq!(r2.channels["source->mid"].capacity, 7);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn environment_overrides_file_and_set_overrides_environment() {
    let out = scratch("env-layer");
    let o = bin()
        .args(["run", "-q", "--out"])
        .arg(&out)
        .arg(synthetic_toml())
        .env("PIPELINE_STAGES__SOURCE__COUNT", "11")
        .env("PIPELINE_STAGES__MID__QUEUE", "3")
        .args(["--set", "stages.mid.queue=5"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.stages["sink"].items, 11);
    assert_eq!(r.channels["source->mid"].capacity, 5);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn fan_out_and_fan_in_deliver_every_item_to_every_consumer() {
    let dir = scratch("fan");
    let cfg = dir.join("fan.toml");
    std::fs::write(
        &cfg,
        r#"
[stages.src]
kind = "synthetic"
count = 200
[stages.a]
kind = "delay"
inputs = ["src"]
delay_us = 0
[stages.b]
kind = "delay"
impl = "spin"
inputs = ["src"]
delay_us = 10
[stages.sink]
kind = "drain"
inputs = ["a", "b"]
queue = 4
"#,
    )
    .unwrap();
    let out = dir.join("run");
    let o = run(&cfg, &out, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.stages["sink"].items, 400);
    assert_eq!(r.channels["a->sink"].items, 200);
    assert_eq!(r.channels["b->sink"].items, 200);
    assert_eq!(r.channels["src->a"].items, 200);
    assert_eq!(r.channels["src->b"].items, 200);
    let _ = std::fs::remove_dir_all(&dir);
}
