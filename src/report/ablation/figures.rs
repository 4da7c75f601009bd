//! What one finished run measured, read back from its run directory (`report.json`, and
//! `steps.tsv` where a step executor wrote one): the figures an ablation compares.

use std::path::Path;

use serde_json::Value;

use crate::report::document::Report;
use crate::report::steps::Steps;

/// One run's figures (`None`: the run has no such thing, e.g. no training in a loader run).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Figures {
    /// "completed", "interrupted" or "failed".
    pub status: String,
    /// The run's exit code.
    pub exit_code: i32,
    /// Wall time of the run, seconds.
    pub wall_s: f64,
    /// Optimizer steps taken.
    pub steps: Option<u64>,
    /// Training tokens per second.
    pub tokens_per_s: Option<f64>,
    /// Items per second through the verdict's focus stage (the executor, or a loader's sink).
    pub items_per_s: f64,
    /// Median step time (ms), steps 2 on (the first holds start-up).
    pub step_ms_p50: Option<f64>,
    /// 99th percentile step time (ms), steps 2 on.
    pub step_ms_p99: Option<f64>,
    /// The focus stage's input wait: the verdict's input-bound fraction (its time blocked on
    /// receive over its loop time).
    pub input_wait: f64,
    /// Final validation loss of the trained weights (nats per token).
    pub val_loss: Option<f64>,
    /// Final validation bits per byte of the trained weights.
    pub val_bpb: Option<f64>,
    /// Bits per byte after test-time training (the `ttt_eval` stage), where run.
    pub ttt_bpb: Option<f64>,
    /// The run's final score in nats per token: after TTT where run, else the sliding
    /// evaluation's, else the final validation's (what the significance bar is judged on).
    pub score_loss: Option<f64>,
    /// The score's bits per byte, from the same evaluation as `score_loss`.
    pub score_bpb: Option<f64>,
    /// Bytes of the quantized artifact, where built.
    pub artifact_bytes: Option<u64>,
    /// The stage with the highest busy share.
    pub bottleneck: Option<String>,
    /// The data-order fingerprint after the last micro-batch (runs with the same one saw the
    /// same batches in the same order).
    pub fingerprint: Option<String>,
    /// Micro-batches (a loader's sink) or steps (a training run) the fingerprint covers.
    pub fingerprint_at: Option<u64>,
    /// The fingerprint after each step (`steps.tsv`), to compare runs of different lengths
    /// at the steps they share.
    #[serde(skip)]
    pub step_fingerprints: Vec<String>,
}

impl Figures {
    /// Whether this run and `other` saw the same data order over what both covered (`None`:
    /// nothing to compare, e.g. loader runs stopped after different numbers of batches).
    pub fn same_data(&self, other: &Figures) -> Option<bool> {
        let (a, b) = (&self.step_fingerprints, &other.step_fingerprints);
        if !a.is_empty() && !b.is_empty() {
            let n = a.len().min(b.len());
            return Some(a[n - 1] == b[n - 1]);
        }
        if self.fingerprint_at != other.fingerprint_at {
            return None;
        }
        Some(self.fingerprint.as_ref()? == other.fingerprint.as_ref()?)
    }

    /// Whether the run finished what it was asked to (exit code 0, not stopped).
    pub fn complete(&self) -> bool {
        self.exit_code == 0 && self.status == "completed"
    }

    /// The figures of the run in `run_dir`.
    pub fn read(run_dir: &Path) -> anyhow::Result<Figures> {
        let report = Report::load(run_dir)?;
        let steps = std::fs::read_to_string(run_dir.join("steps.tsv")).ok();
        Ok(Figures::of(&report, steps.as_deref()))
    }

    /// The figures of `report` and the run's `steps.tsv` text.
    pub fn of(report: &Report, steps_tsv: Option<&str>) -> Figures {
        let t = &report.train;
        let num = |v: Option<&Value>| v.and_then(Value::as_f64).filter(|x| x.is_finite());
        let section = |name: &str| report.sections.get(name).filter(|v| !v.is_null());
        let eval = section("eval");
        let ttt = eval.and_then(|e| e.get("ttt")).filter(|v| !v.is_null());
        let sliding = eval.and_then(|e| e.get("sliding")).filter(|v| !v.is_null());
        let (score_loss, score_bpb) = [ttt, sliding]
            .into_iter()
            .flatten()
            .map(|e| (num(e.get("val_loss")), num(e.get("val_bpb"))))
            .find(|(l, _)| l.is_some())
            .unwrap_or((num(t.get("val_loss")), num(t.get("val_bpb"))));
        let steps = steps_tsv.map(Steps::parse).unwrap_or_default();
        let durations: Vec<f64> = steps.step_ms.iter().map(|&(_, ms)| ms).collect();
        let step_fingerprints = steps.fingerprints;
        let data = section("data");
        let (fingerprint, fingerprint_at) = match step_fingerprints.last() {
            Some(f) => (Some(f.clone()), Some(step_fingerprints.len() as u64)),
            None => (
                data.and_then(|d| d.get("rolling_fingerprint")).and_then(Value::as_str).map(str::to_string),
                data.and_then(|d| d.get("micro_batches")).and_then(Value::as_u64),
            ),
        };
        Figures {
            status: report.run.status.clone(),
            exit_code: report.run.exit_code,
            wall_s: report.run.wall_s,
            steps: t.get("steps").and_then(Value::as_u64),
            tokens_per_s: num(t.get("tokens_per_s")),
            items_per_s: report.verdict.throughput_per_s,
            step_ms_p50: percentile(&durations, 0.50),
            step_ms_p99: percentile(&durations, 0.99),
            input_wait: report.verdict.input_bound_fraction,
            val_loss: num(t.get("val_loss")),
            val_bpb: num(t.get("val_bpb")),
            ttt_bpb: ttt.and_then(|e| num(e.get("val_bpb"))),
            score_loss,
            score_bpb,
            artifact_bytes: section("artifact").and_then(|a| a.get("bytes")).and_then(Value::as_u64),
            bottleneck: report.verdict.bottleneck.clone(),
            fingerprint,
            fingerprint_at,
            step_fingerprints,
        }
    }
}

/// The `q` quantile of `xs` (nearest rank), `None` when empty.
fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_times_and_percentiles() {
        let tsv = "step\ttrain_loss\tlr_mul\ttrain_time_ms\tdata_fingerprint\n1\t7\t1\t700.0\taa\n2\t6\t1\t800.0\tbb\n3\t5\t1\t910.0\tcc\n4\t5\t1\t1010.0\tdd\n";
        let steps = Steps::parse(tsv);
        assert_eq!(steps.fingerprints, ["aa", "bb", "cc", "dd"]);
        let d: Vec<f64> = steps.step_ms.iter().map(|&(_, ms)| ms).collect();
        assert_eq!(d.len(), 3);
        assert!((d[1] - 110.0).abs() < 1e-9);
        assert_eq!(percentile(&d, 0.5), Some(100.0));
        assert_eq!(percentile(&d, 0.99).map(|x| x.round()), Some(110.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    /// Runs of different lengths compare at the steps they share; loader runs only at the same
    /// count of micro-batches.
    #[test]
    fn same_data_compares_what_both_runs_covered() {
        let steps = |fs: &[&str]| Figures { step_fingerprints: fs.iter().map(|s| s.to_string()).collect(), ..Figures::default() };
        assert_eq!(steps(&["a", "b", "c"]).same_data(&steps(&["a", "b"])), Some(true));
        assert_eq!(steps(&["a", "x", "c"]).same_data(&steps(&["a", "b"])), Some(false));
        let loader = |fp: &str, n| Figures { fingerprint: Some(fp.into()), fingerprint_at: Some(n), ..Figures::default() };
        assert_eq!(loader("a", 10).same_data(&loader("a", 10)), Some(true));
        assert_eq!(loader("a", 10).same_data(&loader("b", 10)), Some(false));
        assert_eq!(loader("a", 10).same_data(&loader("b", 12)), None);
    }
}
