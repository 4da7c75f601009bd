//! `RUN_DIR/steps.tsv` read back (written by the step executor, `crate::train::log`): per step
//! its train loss, its own time and the data-order fingerprint after it. What the HTML report
//! plots and an ablation compares.

/// `steps.tsv` as columns, found by the header's names (`step`, `train_loss`, `train_time_ms`,
/// `data_fingerprint`); rows that do not parse leave out what they lack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Steps {
    /// `(step, train_loss)`.
    pub loss: Vec<(f64, f64)>,
    /// `(step, ms)`: the step's own time, the difference of consecutive `train_time_ms` (so the
    /// first row, which holds start-up, has none).
    pub step_ms: Vec<(f64, f64)>,
    /// The data-order fingerprint after each row that has one.
    pub fingerprints: Vec<String>,
}

impl Steps {
    /// Reads `steps.tsv` text; no header with `step`, `train_loss` and `train_time_ms`: empty.
    pub fn parse(text: &str) -> Steps {
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap_or("").split('\t').map(str::trim).collect();
        let col = |name: &str| header.iter().position(|h| *h == name);
        let (Some(step), Some(loss), Some(time)) = (col("step"), col("train_loss"), col("train_time_ms")) else {
            return Steps::default();
        };
        let fingerprint = col("data_fingerprint");
        let mut out = Steps::default();
        let mut previous: Option<f64> = None;
        for row in lines.filter(|l| !l.trim().is_empty()) {
            let cells: Vec<&str> = row.split('\t').collect();
            if let Some(f) = fingerprint.and_then(|i| cells.get(i)) {
                out.fingerprints.push(f.trim().to_string());
            }
            let num = |i: usize| cells.get(i).and_then(|c| c.trim().parse::<f64>().ok()).filter(|x| x.is_finite());
            let Some(s) = num(step) else { continue };
            if let Some(l) = num(loss) {
                out.loss.push((s, l));
            }
            let t = num(time);
            if let (Some(t), Some(p)) = (t, previous)
                && t >= p
            {
                out.step_ms.push((s, t - p));
            }
            previous = t.or(previous);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_step_times_and_fingerprints() {
        let tsv = "step\ttrain_loss\tlr_mul\ttrain_time_ms\tdata_fingerprint\n1\t7\t1\t700.0\taa\n2\t6\t1\t800.0\tbb\nbad row\n3\t5\t1\t910.0\tcc\n";
        let s = Steps::parse(tsv);
        assert_eq!(s.loss, [(1.0, 7.0), (2.0, 6.0), (3.0, 5.0)]);
        assert_eq!(s.step_ms.len(), 2);
        assert!((s.step_ms[1].1 - 110.0).abs() < 1e-9 && s.step_ms[1].0 == 3.0);
        assert_eq!(s.fingerprints, ["aa", "bb", "cc"]);
        assert_eq!(Steps::parse("no header"), Steps::default());
    }
}
