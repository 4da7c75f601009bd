//! The stage tables of every rank merged into one report. Rank 0's tables stay the report's
//! own (its verdict, its histograms); the `ranks` section lays each stage's figures side by
//! side, one entry per rank, and names the slowest rank per stage: the one with the largest
//! mean service time, which every other rank waits for at the next collective. A note in the
//! text report names it where the ranks differ by more than 5%.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::report::document::Report;
use crate::report::tables::StageReport;

/// Adds the `ranks` section to `report` (rank 0's) from `tables`, every rank's stage tables in
/// rank order (rank 0's included), gathered over `backend`, and the notes naming slow ranks.
pub fn add_to(report: &mut Report, tables: &[BTreeMap<String, StageReport>], backend: &str) {
    let (section, notes) = merge(&report.run.stage_order, tables, backend);
    report.sections.insert("ranks".into(), section);
    report.run.notes.extend(notes);
}

/// The `ranks` section for stages `order` from every rank's `tables`, and the notes naming a
/// rank more than 5% slower than the fastest.
pub fn merge(order: &[String], tables: &[BTreeMap<String, StageReport>], backend: &str) -> (Value, Vec<String>) {
    let mut notes = Vec::new();
    let mut stages = serde_json::Map::new();
    for name in order {
        let per: Vec<Option<&StageReport>> = tables.iter().map(|t| t.get(name)).collect();
        let mean = |s: Option<&StageReport>| s.map_or(0.0, |s| s.service_us.mean);
        let Some((slowest, slow)) = per.iter().enumerate().max_by(|a, b| mean(*a.1).total_cmp(&mean(*b.1))) else { continue };
        let fastest = per.iter().map(|s| mean(*s)).fold(f64::INFINITY, f64::min);
        let mut extra = serde_json::Map::new();
        for s in per.iter().flatten() {
            for k in s.extra_us.keys() {
                let means: Vec<Value> =
                    per.iter().map(|s| s.and_then(|s| s.extra_us.get(k)).map_or(Value::Null, |h| json!(h.mean))).collect();
                extra.insert(k.clone(), Value::Array(means));
            }
        }
        stages.insert(
            name.clone(),
            json!({
                "slowest_rank": slowest,
                "mean_us": per.iter().map(|s| mean(*s)).collect::<Vec<_>>(),
                "p90_us": per.iter().map(|s| s.map_or(0.0, |s| s.service_us.p90)).collect::<Vec<_>>(),
                "busy_fraction": per.iter().map(|s| s.map_or(0.0, |s| s.busy_fraction)).collect::<Vec<_>>(),
                "items": per.iter().map(|s| s.map_or(0, |s| s.items)).collect::<Vec<_>>(),
                "extra_mean_us": extra,
            }),
        );
        let slow = mean(*slow);
        if tables.len() > 1 && fastest > 0.0 && slow > 1.05 * fastest {
            notes.push(format!(
                "stage `{name}`: rank {slowest} is the slowest of {} ranks ({slow:.0} µs per item, against {fastest:.0} µs on the fastest)",
                tables.len()
            ));
        }
    }
    (json!({ "world": tables.len(), "backend": backend, "stages": stages }), notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(mean: f64) -> StageReport {
        StageReport {
            kind: "k".into(),
            imp: "i".into(),
            role: "sink".into(),
            inputs: Vec::new(),
            items: 3,
            items_in: 3,
            items_out: 0,
            items_dropped: 0,
            busy_fraction: 0.5,
            service_us: crate::runtime::metrics::Summary { mean, ..Default::default() },
            throughput_per_s: 1.0,
            steady_s: 1.0,
            state: "finished".into(),
            error: None,
            extra_us: BTreeMap::new(),
        }
    }

    /// The slowest rank per stage is the one with the largest mean service time, and a note
    /// names it when it is more than 5% slower than the fastest.
    #[test]
    fn the_slowest_rank_is_named() {
        let t = |a: f64, b: f64| BTreeMap::from([("a".to_string(), stage(a)), ("b".to_string(), stage(b))]);
        let order = ["a".to_string(), "b".to_string()];
        let (ranks, notes) = merge(&order, &[t(100.0, 50.0), t(130.0, 51.0)], "mpi");
        assert_eq!(ranks["world"], 2);
        assert_eq!(ranks["stages"]["a"]["slowest_rank"], 1);
        assert_eq!(ranks["stages"]["a"]["mean_us"], json!([100.0, 130.0]));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("`a`: rank 1"), "{notes:?}");
    }
}
