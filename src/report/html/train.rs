//! The training part of a run's `report.html`: the step executor's figures (`train` in
//! `report.json`), and against steps the train loss and step time (from `steps.tsv`) and the
//! validation loss and bits per byte (from `train.validations`). A run that trained nothing has
//! no such part.

use std::fmt::Write;

use serde_json::{Map, Value};

use super::plots::{self, Frame, Line, YAxis};
use super::{escape, figure};
use crate::report::document::Report;
use crate::report::steps::Steps;

/// `(step, value)` of each entry of `train.validations` that has `key`.
pub fn validations(train: &Map<String, Value>, key: &str) -> Vec<(f64, f64)> {
    let Some(Value::Array(vals)) = train.get("validations") else { return Vec::new() };
    vals.iter().filter_map(|v| Some((v.get("step")?.as_f64()?, v.get(key)?.as_f64()?))).collect()
}

/// The training part of the page, `None` for a run that trained nothing (no `train` section and
/// no `steps.tsv`).
pub fn section(report: &Report, steps_tsv: Option<&str>) -> Option<String> {
    let t = &report.train;
    let steps = steps_tsv.map(Steps::parse).unwrap_or_default();
    if t.is_empty() && steps.loss.is_empty() {
        return None;
    }
    let mut o = String::from("<h2 id=\"training\">Training</h2>\n");
    facts(&mut o, t);
    o.push_str("<div class=\"cards\">\n<div class=\"card\">\n");
    let mut loss = vec![Line::solid("train loss", steps.loss.clone())];
    let val = validations(t, "val_loss");
    if !val.is_empty() {
        loss.push(Line { marks: true, ..Line::solid("val loss", val) });
    }
    let frame = Frame { title: "loss against steps", x: "step", y: "nats per token" };
    o.push_str(&figure(plots::lines(&frame, &loss, YAxis::Span, plots::SIZE), "no losses recorded"));
    o.push_str("</div>\n<div class=\"card\">\n");
    let frame = Frame { title: "step time against steps (validation excluded)", x: "step", y: "ms" };
    o.push_str(&figure(
        plots::lines(&frame, &[Line::solid("step time", steps.step_ms.clone())], YAxis::FromZero, plots::SIZE),
        "no step times: steps.tsv has fewer than two steps",
    ));
    o.push_str("</div>\n");
    let bpb = validations(t, "val_bpb");
    if !bpb.is_empty() {
        o.push_str("<div class=\"card\">\n");
        let mut lines = vec![Line { marks: true, ..Line::solid("val bpb", bpb.clone()) }];
        if let Some(u) = t.get("unigram_bpb").and_then(Value::as_f64) {
            let (a, b) = (bpb.first().map_or(0.0, |p| p.0), bpb.last().map_or(1.0, |p| p.0));
            lines.push(Line { dashed: true, ..Line::solid(format!("unigram bpb {u:.3}"), vec![(a, u), (b, u)]) });
        }
        let frame = Frame { title: "validation bits per byte", x: "step", y: "bits per byte" };
        o.push_str(&figure(plots::lines(&frame, &lines, YAxis::Span, plots::SIZE), ""));
        o.push_str("</div>\n");
    }
    o.push_str("</div>\n");
    Some(o)
}

/// The executor's headline figures and its per-step time by phase.
fn facts(o: &mut String, t: &Map<String, Value>) {
    let f = |k: &str| t.get(k).and_then(Value::as_f64);
    let num = |k: &str, digits: usize| f(k).map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into());
    o.push_str("<dl class=\"facts\">\n");
    let ended = t.get("ended_by").and_then(Value::as_str).unwrap_or("-").replace('_', " ");
    let _ = writeln!(
        o,
        "<dt>steps</dt><dd>{} (ended by {}), {:.1} s of training, step_avg {} ms, {} tokens/s</dd>",
        t.get("steps").and_then(Value::as_u64).unwrap_or(0),
        escape(&ended),
        f("train_time_ms").unwrap_or(0.0) / 1e3,
        num("step_avg_ms", 2),
        num("tokens_per_s", 0)
    );
    if f("train_loss").is_some() {
        let _ = writeln!(o, "<dt>final train loss</dt><dd>{}</dd>", num("train_loss", 4));
    }
    if f("val_bpb").is_some() {
        let _ = writeln!(
            o,
            "<dt>final validation</dt><dd>val_loss {}, val_bpb {} (unigram bpb {}: the bar to beat)</dd>",
            num("val_loss", 4),
            num("val_bpb", 4),
            num("unigram_bpb", 4)
        );
    }
    if let (Some(ms), Some(pct)) = (t.get("timing_ms_per_step"), t.get("timing_share_pct")) {
        let parts: Vec<String> = ["data_wait", "h2d", "forward", "backward", "optimizer"]
            .iter()
            .filter_map(|k| {
                let v = ms.get(k)?.as_f64()?;
                Some(match pct.get(k).and_then(Value::as_f64) {
                    Some(p) => format!("{k} {v:.2} ms ({p:.0}%)"),
                    None => format!("{k} {v:.2} ms (overlapped)"),
                })
            })
            .collect();
        let _ = writeln!(o, "<dt>per step</dt><dd>{}</dd>", escape(&parts.join(", ")));
    }
    if let Some(w) = t.get("weights").and_then(Value::as_str) {
        let _ = writeln!(o, "<dt>weights</dt><dd><code>{}</code></dd>", escape(w));
    }
    o.push_str("</dl>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validations_are_read_by_key() {
        let t: Map<String, Value> =
            serde_json::from_str(r#"{"validations": [{"step": 0, "val_loss": 6.9, "val_bpb": 4.1}, {"step": 20, "val_loss": 5.0}]}"#)
                .unwrap();
        assert_eq!(validations(&t, "val_loss"), [(0.0, 6.9), (20.0, 5.0)]);
        assert_eq!(validations(&t, "val_bpb"), [(0.0, 4.1)]);
        assert!(validations(&Map::new(), "val_loss").is_empty());
    }
}
