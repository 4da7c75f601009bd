//! Acceptance: a 2 ms stage among 0.2 ms stages is named the bottleneck, and the sink's
//! input-bound class follows, at queue depths 1, 2 and 100.

mod common;

use common::{report, run, scratch, synthetic_toml, text};

fn check(depth: usize, slow: &str) {
    let out = scratch(&format!("verdict-{slow}-{depth}"));
    let q = |s: &str| format!("stages.{s}.queue={depth}");
    let sets = [
        "stages.source.count=260".to_string(),
        "stages.source.delay_us=200".into(),
        "stages.mid.delay_us=200".into(),
        "stages.post.delay_us=200".into(),
        "stages.sink.delay_us=200".into(),
        format!("stages.{slow}.delay_us=2000"),
        q("mid"),
        q("post"),
        q("sink"),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let o = run(&synthetic_toml(), &out, &sets);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&out);
    let v = &r.verdict;
    assert_eq!(v.bottleneck.as_deref(), Some(slow), "depth {depth}: {}\n{}", v.explanation, r.render());
    assert_eq!(v.focus, "sink");
    let want = if slow == "sink" { "not input-bound" } else { "highly input-bound" };
    assert_eq!(v.class, want, "depth {depth}, slow {slow}: input-bound {:.3}\n{}", v.input_bound_fraction, r.render());
    assert!(r.stages[slow].busy_fraction > 0.8, "{}", r.render());
    // Every other stage sleeps ~0.2 ms per item: its service time must show that, even when a
    // slow consumer keeps it blocked on its output (blocked time is not service time).
    for other in ["source", "mid", "post", "sink"].into_iter().filter(|s| *s != slow) {
        let s = &r.stages[other];
        assert!(
            s.service_us.p50 > 150.0 && s.busy_fraction > 0.03,
            "depth {depth}: `{other}` service p50 {} µs, busy {}\n{}",
            s.service_us.p50,
            s.busy_fraction,
            r.render()
        );
    }
    // Every channel reports the configured capacity, and every item arrived.
    for c in r.channels.values() {
        assert_eq!(c.capacity, depth);
        assert_eq!(c.items, 260);
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn slow_middle_stage_depth_1() {
    check(1, "mid");
}

#[test]
fn slow_middle_stage_depth_2() {
    check(2, "mid");
}

#[test]
fn slow_middle_stage_depth_100() {
    check(100, "mid");
}

#[test]
fn slow_sink_depth_1() {
    check(1, "sink");
}

#[test]
fn slow_sink_depth_2() {
    check(2, "sink");
}

#[test]
fn slow_sink_depth_100() {
    check(100, "sink");
}

#[test]
fn report_command_prints_the_same_verdict() {
    let out = scratch("verdict-report-cmd");
    let o = run(&synthetic_toml(), &out, &["stages.source.count=60", "stages.post.delay_us=2000", "run.warmup_items=5"]);
    assert!(o.status.success(), "{}", text(&o));
    let printed = common::bin().arg("report").arg(&out).output().unwrap();
    assert!(printed.status.success());
    let s = String::from_utf8_lossy(&printed.stdout);
    assert!(s.contains("verdict: bottleneck `post`"), "{s}");
    let missing = common::bin().arg("report").arg(out.join("nope")).output().unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("report.json"));
    let _ = std::fs::remove_dir_all(&out);
}
