//! An ablation's `report.html` (beside `ablation.json`): the comparison table, a link to every
//! run's own page, and every run's plots overlaid, one line per run: the focus stage's service
//! time percentiles, step time and train loss against steps (training runs), then every stage's
//! service time, every channel's residence and every channel's length over time (those with
//! nothing to draw left out: each run's own page says why).

use std::fmt::Write;

use super::plots::{self, Frame, Line, YAxis};
use super::train;
use super::{FILE, escape, figure, href, shell};
use crate::report::ablation::figures::Figures;
use crate::report::ablation::plan::Variant;
use crate::report::ablation::summary::{self, Line as Comparison};
use crate::report::document::Report;
use crate::report::steps::Steps;
use crate::runtime::metrics::Summary;

/// One planned run of the ablation and what its directory holds.
pub struct Run {
    /// Its settings and directory name.
    pub variant: Variant,
    /// Its figures, where it has run.
    pub figures: Option<Figures>,
    /// Its `report.json`, where it wrote one.
    pub report: Option<Report>,
    /// Its `steps.tsv`, where it wrote one.
    pub steps: Option<String>,
}

impl Run {
    /// The run's name on the plots: the variant's, with its seed when there are several.
    fn label(&self, seeded: bool) -> String {
        if seeded { format!("{} (seed +{})", self.variant.name, self.variant.seed) } else { self.variant.name.clone() }
    }
}

/// The page for the ablation of `config`: `runs` in plan order and their comparison `lines`.
pub fn page(config: &str, runs: &[Run], lines: &[Comparison]) -> String {
    let seeded = runs.iter().any(|r| r.variant.seed > 0);
    let done = runs.iter().filter(|r| r.figures.is_some()).count();
    let mut o = String::new();
    let _ = writeln!(o, "<h1>ablation of <code>{}</code></h1>", escape(config));
    let _ = writeln!(o, "<p>{done} of {} runs have a report. Ratios (x) and differences (+/-) are against the base.</p>", runs.len());
    comparison(&mut o, lines);
    run_list(&mut o, runs);
    let with_report: Vec<(String, &Report, &Run)> =
        runs.iter().filter_map(|r| r.report.as_ref().map(|rep| (r.label(seeded), rep, r))).collect();
    if with_report.is_empty() {
        o.push_str("<p class=\"none\">No run has written a report yet: nothing to plot.</p>\n");
        return shell(&format!("pipeline ablation: {config}"), &o);
    }
    o.push_str("<h2>Overlaid</h2>\n<div class=\"cards\">\n");
    let focus = with_report[0].1.verdict.focus.clone();
    overlay_service(&mut o, &with_report, &focus, true);
    overlay_steps(&mut o, &with_report);
    o.push_str("</div>\n<h2>Every stage and channel, overlaid</h2>\n<div class=\"cards\">\n");
    // Stages in the runs' order, and channels by their consumer in that order.
    let mut stages: Vec<&String> = Vec::new();
    for (_, r, _) in &with_report {
        for s in &r.run.stage_order {
            if !stages.contains(&s) {
                stages.push(s);
            }
        }
    }
    for s in stages.iter().filter(|s| ***s != focus) {
        overlay_service(&mut o, &with_report, s, false);
    }
    let mut channels: Vec<&String> = Vec::new();
    for to in &stages {
        for (_, r, _) in &with_report {
            for (name, c) in &r.channels {
                if &c.to == *to && !channels.contains(&name) {
                    channels.push(name);
                }
            }
        }
    }
    for c in channels {
        let series: Vec<(String, &Summary)> =
            with_report.iter().filter_map(|(l, r, _)| r.channels.get(c).map(|ch| (l.clone(), &ch.residence_us))).collect();
        let residence = plots::percentiles(&format!("{c}: residence per item"), &series, plots::SIZE);
        let lines: Vec<Line> = with_report
            .iter()
            .filter_map(|(l, r, _)| {
                let ch = r.channels.get(c)?;
                Some(Line::solid(format!("{l} (cap {})", ch.capacity), ch.occupancy_timeline.iter().map(|p| (p[0], p[1])).collect()))
            })
            .collect();
        let frame = Frame { title: &format!("{c}: length over time"), x: "seconds from the start", y: "items" };
        let length = plots::lines(&frame, &lines, YAxis::FromZero, plots::SIZE);
        if matches!((&residence, &length), (Ok(None), Ok(None))) {
            continue;
        }
        o.push_str("<div class=\"card\">\n");
        o.push_str(&figure(residence, &format!("{c}: no residence times")));
        o.push_str(&figure(length, "its length was not sampled over time"));
        o.push_str("</div>\n");
    }
    o.push_str("</div>\n");
    shell(&format!("pipeline ablation: {config}"), &o)
}

/// The comparison table and the significance sentences.
fn comparison(o: &mut String, lines: &[Comparison]) {
    let (header, rows) = summary::table(lines);
    o.push_str("<h2>Comparison</h2>\n<table>\n<tr>");
    for (i, h) in header.iter().enumerate() {
        let _ = write!(o, "<th{}>{}</th>", if i == 0 { " class=\"l\"" } else { "" }, escape(h));
    }
    o.push_str("</tr>\n");
    for r in &rows {
        o.push_str("<tr>");
        for (i, c) in r.iter().enumerate() {
            let _ = write!(o, "<td{}>{}</td>", if i == 0 { " class=\"l\"" } else { "" }, escape(c));
        }
        o.push_str("</tr>\n");
    }
    o.push_str("</table>\n");
    for s in summary::significance(lines) {
        let _ = writeln!(o, "<p>{}</p>", escape(&s));
    }
}

/// Every planned run: its status and a link to its own page.
fn run_list(o: &mut String, runs: &[Run]) {
    o.push_str("<h2>Runs</h2>\n<table>\n<tr><th class=\"l\">run</th><th class=\"l\">settings</th><th class=\"l\">status</th><th>wall s</th><th class=\"l\">bottleneck</th><th class=\"l\">page</th></tr>\n");
    for r in runs {
        let (status, wall, bottleneck) = match &r.figures {
            Some(f) => (f.status.clone(), format!("{:.1}", f.wall_s), f.bottleneck.clone().unwrap_or_else(|| "-".into())),
            None => ("not run".into(), "-".into(), "-".into()),
        };
        let link = if r.report.is_some() {
            format!("<a href=\"{}\">{}/{FILE}</a>", escape(&href(&format!("{}/{FILE}", r.variant.dir))), escape(&r.variant.dir))
        } else {
            "-".into()
        };
        let _ = writeln!(
            o,
            "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{wall}</td><td class=\"l\">{}</td><td class=\"l\">{link}</td></tr>",
            escape(&r.variant.name),
            if r.variant.sets.is_empty() { "-".to_string() } else { format!("<code>{}</code>", escape(&r.variant.sets.join(" "))) },
            escape(&status),
            escape(&bottleneck)
        );
    }
    o.push_str("</table>\n");
}

/// A card with `stage`'s service time percentiles of every run that has it; with `always`, a
/// card that says so when no run recorded any (else none).
fn overlay_service(o: &mut String, runs: &[(String, &Report, &Run)], stage: &str, always: bool) {
    let series: Vec<(String, &Summary)> =
        runs.iter().filter_map(|(l, r, _)| r.stages.get(stage).map(|s| (l.clone(), &s.service_us))).collect();
    let chart = plots::percentiles(&format!("{stage}: service time per item"), &series, plots::SIZE);
    if series.is_empty() || (!always && matches!(chart, Ok(None))) {
        return;
    }
    o.push_str("<div class=\"card\">\n");
    o.push_str(&figure(chart, &format!("{stage}: no service times recorded")));
    let busy: Vec<String> =
        runs.iter().filter_map(|(l, r, _)| r.stages.get(stage).map(|s| format!("{} {:.1}%", escape(l), s.busy_fraction * 100.0))).collect();
    let _ = writeln!(o, "<p>busy: {}</p>\n</div>", busy.join(", "));
}

/// Cards with every training run's step time and losses against steps (none for loader runs).
fn overlay_steps(o: &mut String, runs: &[(String, &Report, &Run)]) {
    let parsed: Vec<(&String, &Report, Steps)> =
        runs.iter().map(|(l, r, run)| (l, *r, run.steps.as_deref().map(Steps::parse).unwrap_or_default())).collect();
    if parsed.iter().all(|(_, _, s)| s.loss.is_empty()) {
        return;
    }
    let step_ms: Vec<Line> = parsed.iter().map(|(l, _, s)| Line::solid((*l).clone(), s.step_ms.clone())).collect();
    let frame = Frame { title: "step time against steps (validation excluded)", x: "step", y: "ms" };
    o.push_str("<div class=\"card\">\n");
    o.push_str(&figure(plots::lines(&frame, &step_ms, YAxis::FromZero, plots::SIZE), "no step times"));
    o.push_str("</div>\n<div class=\"card\">\n");
    let loss: Vec<Line> = parsed.iter().map(|(l, _, s)| Line::solid((*l).clone(), s.loss.clone())).collect();
    let frame = Frame { title: "train loss against steps", x: "step", y: "nats per token" };
    o.push_str(&figure(plots::lines(&frame, &loss, YAxis::Span, plots::SIZE), "no losses"));
    o.push_str("</div>\n");
    let val: Vec<Line> = parsed
        .iter()
        .map(|(l, r, _)| Line { marks: true, ..Line::solid((*l).clone(), train::validations(&r.train, "val_loss")) })
        .collect();
    if val.iter().any(|l| !l.points.is_empty()) {
        let frame = Frame { title: "validation loss against steps", x: "step", y: "nats per token" };
        o.push_str("<div class=\"card\">\n");
        o.push_str(&figure(plots::lines(&frame, &val, YAxis::Span, plots::SIZE), ""));
        o.push_str("</div>\n");
    }
}
