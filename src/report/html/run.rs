//! A run's `report.html`: how the run went and the verdict in words at the top, then the stage
//! graph, the stage and channel tables, per stage its service-time percentile plot (with the
//! stage's own histograms), per channel its send-blocked, receive-blocked and residence
//! percentiles and its length over time, every channel's length against its capacity on one
//! chart, and for a training run its losses and step times ([`super::train`]).

use std::fmt::Write;

use super::plots::{self, Frame, Line, YAxis};
use super::{anchor, escape, figure, graph, shell, train};
use crate::report::document::Report;
use crate::report::tables::{ChannelReport, StageReport};

/// The whole page for `report`; `steps_tsv` is the run's `steps.tsv` where it wrote one.
pub fn page(report: &Report, steps_tsv: Option<&str>) -> String {
    let mut body = String::new();
    header(&mut body, report);
    let training = train::section(report, steps_tsv);
    let _ = writeln!(
        body,
        "<nav><a href=\"#graph\">stage graph</a><a href=\"#stages\">stages</a><a href=\"#channels\">channels</a>{}</nav>",
        if training.is_some() { "<a href=\"#training\">training</a>" } else { "" }
    );
    verdict(&mut body, report);
    let _ = writeln!(body, "<h2 id=\"graph\">Stage graph</h2>\n<div class=\"graph-box\">{}</div>", graph::svg(report));
    stages(&mut body, report);
    channels(&mut body, report);
    if let Some(t) = training {
        body.push_str(&t);
    }
    shell(&format!("pipeline report: {}", report.run.name), &body)
}

/// The run's name, status, times, files, error and notes.
fn header(o: &mut String, report: &Report) {
    let r = &report.run;
    let status = match &r.signal {
        Some(sig) => format!("{} by {sig}", r.status),
        None => r.status.clone(),
    };
    let _ = writeln!(
        o,
        "<h1>run <code>{}</code> <span class=\"status {}\">{}</span></h1>",
        escape(&r.name),
        escape(&r.status),
        escape(&status)
    );
    o.push_str("<dl class=\"facts\">\n");
    let mut fact = |k: &str, v: String| {
        let _ = writeln!(o, "<dt>{}</dt><dd>{v}</dd>", escape(k));
    };
    fact("wall time", format!("{:.2} s (exit code {})", r.wall_s, r.exit_code));
    fact("started", escape(&r.started));
    fact("config", format!("<code>{}</code>", escape(&r.config)));
    fact("run directory", format!("<code>{}</code>", escape(&r.run_dir)));
    fact("warm-up", format!("first {} items of each stage left out of the steady figures", r.warmup_items));
    if let Some(ms) = r.stop_ms {
        fact("stopping took", format!("{ms:.0} ms"));
    }
    o.push_str("</dl>\n");
    if let Some(e) = &r.error {
        let _ = writeln!(o, "<p class=\"error\">error: {}</p>", escape(e));
    }
    for n in &r.notes {
        let _ = writeln!(o, "<p class=\"none\">note: {}</p>", escape(n));
    }
}

/// The verdict: the input-bound class, the explanation, and the figures behind it.
fn verdict(o: &mut String, report: &Report) {
    let v = &report.verdict;
    let level = v.class.split(' ').next().unwrap_or("");
    let _ = writeln!(o, "<section class=\"verdict {}\">", escape(level));
    let bottleneck = match &v.bottleneck {
        Some(b) => format!("bottleneck <code>{}</code> (busy {:.1}%)", escape(b), v.bottleneck_busy_fraction * 100.0),
        None => "no bottleneck named".into(),
    };
    let _ = writeln!(
        o,
        "<p class=\"class\">Verdict: <code>{}</code> is {} ({:.1}% of its time waiting for input); {bottleneck}</p>",
        escape(&v.focus),
        escape(&v.class),
        v.input_bound_fraction * 100.0
    );
    let _ = writeln!(o, "<p>{}</p>", escape(&v.explanation));
    o.push_str("<dl class=\"facts\">\n");
    let _ = writeln!(o, "<dt>throughput</dt><dd>{:.2} items/s at <code>{}</code></dd>", v.throughput_per_s, escape(&v.focus));
    if let Some(n) = &v.next_bottleneck {
        let _ = writeln!(o, "<dt>next bottleneck</dt><dd><code>{}</code></dd>", escape(n));
    }
    if let Some(p) = v.predicted_throughput_per_s {
        let _ = writeln!(o, "<dt>with the bottleneck free</dt><dd>at most {p:.2} items/s</dd>");
    }
    if !v.demand_ms.is_empty() {
        let mut d: Vec<(&String, &f64)> = v.demand_ms.iter().collect();
        d.sort_by(|a, b| b.1.total_cmp(a.1));
        let list: Vec<String> = d.iter().map(|(k, ms)| format!("<code>{}</code> {:.3}", escape(k), ms)).collect();
        let _ = writeln!(o, "<dt>demand, ms per focus item</dt><dd>{}</dd>", list.join(", "));
    }
    o.push_str("</dl>\n</section>\n");
}

/// The stage table and a card per stage with its percentile plot.
fn stages(o: &mut String, report: &Report) {
    o.push_str("<h2 id=\"stages\">Stages</h2>\n<table>\n<tr><th class=\"l\">stage</th><th class=\"l\">kind/impl</th><th class=\"l\">role</th><th>items</th><th>busy</th><th>p50 µs</th><th>p90 µs</th><th>p99 µs</th><th>max µs</th><th>items/s</th><th class=\"l\">state</th></tr>\n");
    let named = || report.run.stage_order.iter().filter_map(|n| report.stages.get(n).map(|s| (n, s)));
    for (name, s) in named() {
        let u = &s.service_us;
        let _ = writeln!(
            o,
            "<tr><td class=\"l\"><a href=\"#{}\">{}</a></td><td class=\"l\">{}/{}</td><td class=\"l\">{}</td><td>{}</td><td style=\"background:{}\">{:.1}%</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td class=\"l\">{}</td></tr>",
            anchor("stage", name),
            escape(name),
            escape(&s.kind),
            escape(&s.imp),
            escape(&s.role),
            s.items,
            tint(s.busy_fraction),
            s.busy_fraction * 100.0,
            u.p50,
            u.p90,
            u.p99,
            u.max,
            s.throughput_per_s,
            escape(&s.state)
        );
    }
    o.push_str("</table>\n<div class=\"cards\">\n");
    for (name, s) in named() {
        stage_card(o, name, s);
    }
    o.push_str("</div>\n");
}

/// A light red behind a share (0: none), for table cells.
fn tint(share: f64) -> String {
    format!("rgba(214,39,40,{:.2})", share.clamp(0.0, 1.0) * 0.6)
}

fn stage_card(o: &mut String, name: &str, s: &StageReport) {
    let _ = writeln!(
        o,
        "<div class=\"card\" id=\"{}\"><h3>{} <small>{}/{}, {}</small></h3>",
        anchor("stage", name),
        escape(name),
        escape(&s.kind),
        escape(&s.imp),
        escape(&s.role)
    );
    let mut line = format!(
        "{} items ({} in, {} out), busy {:.1}%, {:.1} items/s over a steady {:.2} s",
        s.items,
        s.items_in,
        s.items_out,
        s.busy_fraction * 100.0,
        s.throughput_per_s,
        s.steady_s
    );
    if s.items_dropped > 0 {
        let _ = write!(line, "; {} dropped unprocessed", s.items_dropped);
    }
    let _ = writeln!(o, "<p>{}</p>", escape(&line));
    if let Some(e) = &s.error {
        let _ = writeln!(o, "<p class=\"error\">{}: {}</p>", escape(&s.state), escape(e));
    }
    let mut series = vec![("service".to_string(), &s.service_us)];
    series.extend(s.extra_us.iter().map(|(k, h)| (k.clone(), h)));
    let title =
        if s.extra_us.is_empty() { format!("{name}: service time per item") } else { format!("{name}: service time and own histograms") };
    let chart = plots::percentiles(&title, &series, plots::SIZE);
    o.push_str(&figure(chart, "no service times recorded (the stage handled no items after its warm-up)"));
    o.push_str("</div>\n");
}

/// The channels in the report's order (by consumer, in stage order).
fn ordered(report: &Report) -> Vec<(&String, &ChannelReport)> {
    report.run.stage_order.iter().flat_map(|to| report.channels.iter().filter(move |(_, c)| &c.to == to)).collect()
}

/// The channel table, a card per channel, and every channel's length against its capacity.
fn channels(o: &mut String, report: &Report) {
    let chans = ordered(report);
    if chans.is_empty() {
        return;
    }
    o.push_str("<h2 id=\"channels\">Channels</h2>\n<table>\n<tr><th class=\"l\">channel</th><th>capacity</th><th>mean length</th><th>Little's law</th><th>empty</th><th>full</th><th>send-blocked p99 µs</th><th>send-blocked share</th><th>recv-blocked p99 µs</th><th>recv-blocked share</th><th>residence p50 µs</th><th>residence p99 µs</th></tr>\n");
    for (name, c) in &chans {
        let _ = writeln!(
            o,
            "<tr><td class=\"l\"><a href=\"#{}\">{}</a></td><td>{}</td><td>{:.2}</td><td>{:.2}</td><td>{:.0}%</td><td>{:.0}%</td><td>{:.1}</td><td style=\"background:{}\">{:.1}%</td><td>{:.1}</td><td style=\"background:{}\">{:.1}%</td><td>{:.1}</td><td>{:.1}</td></tr>",
            anchor("channel", name),
            escape(name),
            c.capacity,
            c.mean_occupancy,
            c.littles_law_occupancy,
            c.empty_fraction * 100.0,
            c.full_fraction * 100.0,
            c.send_blocked_us.p99,
            tint(c.send_blocked_fraction),
            c.send_blocked_fraction * 100.0,
            c.recv_blocked_us.p99,
            tint(c.recv_blocked_fraction),
            c.recv_blocked_fraction * 100.0,
            c.residence_us.p50,
            c.residence_us.p99
        );
    }
    o.push_str("</table>\n<p class=\"none\">send-blocked: the producer waiting for room; recv-blocked: the consumer waiting for input (shared by all its inputs); residence: from send to receive. Shares are of the stage's steady time.</p>\n");
    o.push_str("<div class=\"cards\">\n");
    for (name, c) in &chans {
        channel_card(o, name, c);
    }
    o.push_str("</div>\n");
    let relative: Vec<Line> = chans
        .iter()
        .filter(|(_, c)| !c.occupancy_timeline.is_empty())
        .map(|(name, c)| {
            let cap = c.capacity.max(1) as f64;
            Line::solid(format!("{name} (cap {})", c.capacity), c.occupancy_timeline.iter().map(|p| (p[0], p[1] / cap)).collect())
        })
        .collect();
    if relative.len() > 1 {
        o.push_str("<h2 id=\"occupancy\">Channel occupancy</h2>\n");
        let frame = Frame { title: "every channel's length / its capacity", x: "seconds from the start", y: "share of capacity" };
        o.push_str(&figure(plots::lines(&frame, &relative, YAxis::FromZero, (1100, 340)), "no channel lengths were sampled"));
    }
}

fn channel_card(o: &mut String, name: &str, c: &ChannelReport) {
    let _ = writeln!(
        o,
        "<div class=\"card\" id=\"{}\"><h3>{} <small>capacity {}, {} items</small></h3>",
        anchor("channel", name),
        escape(name),
        c.capacity,
        c.items
    );
    let _ = writeln!(
        o,
        "<p>producer blocked sending {:.1}% of its time, consumer waiting for input {:.1}%; the channel was empty {:.0}% and full {:.0}% of the time, {:.2} items long on average</p>",
        c.send_blocked_fraction * 100.0,
        c.recv_blocked_fraction * 100.0,
        c.empty_fraction * 100.0,
        c.full_fraction * 100.0,
        c.mean_occupancy
    );
    let series = [
        ("send-blocked".to_string(), &c.send_blocked_us),
        ("recv-blocked".to_string(), &c.recv_blocked_us),
        ("residence".to_string(), &c.residence_us),
    ];
    let chart = plots::percentiles(&format!("{name}: waits and residence per item"), &series, plots::SIZE);
    o.push_str(&figure(chart, "no waits or residence times above zero were recorded"));
    if let (Some(first), Some(last)) = (c.occupancy_timeline.first(), c.occupancy_timeline.last()) {
        let length = Line::solid("length", c.occupancy_timeline.iter().map(|p| (p[0], p[1])).collect());
        let cap = c.capacity as f64;
        let capacity = Line { dashed: true, ..Line::solid(format!("capacity {}", c.capacity), vec![(first[0], cap), (last[0], cap)]) };
        let frame = Frame { title: &format!("{name}: length over time"), x: "seconds from the start", y: "items" };
        o.push_str(&figure(plots::lines(&frame, &[length, capacity], YAxis::FromZero, plots::SIZE), ""));
    } else {
        o.push_str("<p class=\"none\">its length was not sampled over time</p>\n");
    }
    o.push_str("</div>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report as a failed two-stage training run writes it (histograms, a timeline, a
    /// failure whose message holds markup, validations).
    fn report() -> Report {
        let hist = |scale: f64| {
            let q: Vec<f64> = (0..100).map(|k| scale * (1.0 + k as f64 / 10.0)).collect();
            serde_json::json!({"count": 500, "mean": scale * 5.0, "p50": q[50], "p90": q[90], "p99": q[99], "max": scale * 20.0, "total_ms": 1.0, "quantiles": q})
        };
        let stage = |inputs: &[&str], role: &str, busy: f64| {
            serde_json::json!({"kind": "delay", "impl": "sleep", "role": role, "inputs": inputs, "items": 500, "items_in": 500, "items_out": 500,
                "busy_fraction": busy, "service_us": hist(100.0), "throughput_per_s": 900.0, "steady_s": 0.5, "state": "finished"})
        };
        let mut train = stage(&["feed"], "sink", 0.9);
        train["state"] = "failed".into();
        train["error"] = "bad <script>alert(1)</script> & more".into();
        train["extra_us"] = serde_json::json!({"write_us": hist(3.0), "idle_us": {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "total_ms": 0.0}});
        let zero = serde_json::json!({"count": 500, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "total_ms": 0.0, "quantiles": vec![0.0; 100]});
        serde_json::from_value(serde_json::json!({
            "run": {"name": "r", "config": "c.toml", "run_dir": "/tmp/r", "started": "2026-01-01T00:00:00Z", "wall_s": 1.5, "status": "failed",
                "exit_code": 1, "error": "stage `train` failed: bad <script>", "warmup_items": 4, "instrument": true, "stage_order": ["feed", "train"]},
            "stages": {"feed": stage(&[], "source", 0.1), "train": train},
            "channels": {"feed->train": {"from": "feed", "to": "train", "capacity": 4, "items": 500, "send_blocked_us": zero,
                "send_blocked_fraction": 0.0, "recv_blocked_us": hist(10.0), "recv_blocked_fraction": 0.02, "residence_us": hist(20.0),
                "mean_occupancy": 3.1, "empty_fraction": 0.01, "full_fraction": 0.7, "littles_law_occupancy": 3.0,
                "occupancy_timeline": [[0.0, 0.0], [0.5, 3.0], [1.0, 4.0]]}},
            "verdict": {"bottleneck": "train", "bottleneck_busy_fraction": 0.9, "focus": "train", "input_bound_fraction": 0.02,
                "class": "not input-bound", "explanation": "`train` is itself the bottleneck", "throughput_per_s": 900.0, "demand_ms": {"train": 1.1}},
            "train": {"steps": 3, "ended_by": "iterations", "val_bpb": 3.0, "unigram_bpb": 3.5,
                "validations": [{"step": 0, "val_loss": 7.0, "val_bpb": 4.0}, {"step": 3, "val_loss": 6.0, "val_bpb": 3.0}]}
        }))
        .unwrap()
    }

    #[test]
    fn page_of_a_failed_training_run() {
        let tsv = "step\ttrain_loss\tlr_mul\ttrain_time_ms\tdata_fingerprint\n1\t7.5\t1\t100\ta\n2\t7.0\t1\t190\tb\n3\t6.5\t1\t300\tc\n";
        let page = page(&report(), Some(tsv));
        assert_eq!(page.matches("<svg").count(), page.matches("</svg>").count());
        assert!(!page.contains("<script"), "markup from the run left raw");
        assert!(page.contains("bad &lt;script&gt;alert(1)&lt;/script&gt; &amp; more"));
        for part in [
            "id=\"stage-feed\"",
            "id=\"stage-train\"",
            "id=\"channel-feed--train\"",
            "train: service time and own histograms",
            "idle_us: no events",
            "send-blocked: 0 throughout",
            "feed-&gt;train: length over time",
            "capacity 4",
            "loss against steps",
            "step time against steps",
            "validation bits per byte",
            "class=\"verdict not\"",
        ] {
            assert!(page.contains(part), "`{part}` not on the page");
        }
        // One channel: no chart of every channel against its capacity.
        assert!(!page.contains("Channel occupancy"));
        let loader = Report { train: Default::default(), ..report() };
        assert!(!super::page(&loader, None).contains("id=\"training\""));
    }
}
