//! The challenge's significance rule: a record must beat the one before it by at least
//! [`MARGIN_NATS`] (0.005 nats of `val_loss`) and show it at `p <` [`P_LIMIT`] (0.01), usually
//! over three seeds (the challenge's README: "enough run logs to show at p < 0.01 that they
//! achieved the required 0.005-nat improvement").
//!
//! The test is one-sided and shifted by the margin. With the submission's per-seed losses
//! `s_1..s_n` (nats) against a baseline's `b_1..b_m`, `d = mean(s) - mean(b)` (negative is
//! better), and the null hypothesis "the improvement is at most the margin",
//! `mean(s) - mean(b) >= -margin`:
//!
//! - against runs (Welch): `se = sqrt(var(s)/n + var(b)/m)` with sample variances, the
//!   Welch-Satterthwaite `df = se^4 / ((var(s)/n)^2/(n-1) + (var(b)/m)^2/(m-1))`;
//! - against a fixed figure (the record's published mean): `se = sd(s)/sqrt(n)`, `df = n - 1`;
//! - `t = (d + margin) / se` and `p = F_df(t)`, Student's t distribution's lower tail: the
//!   chance of a difference this far below `-margin` if the improvement were exactly the margin.
//!
//! The rule is met when `d <= -margin` and `p < P_LIMIT`. A record given as bits per byte is
//! turned into nats per token with the submission's own bytes per token (`val_bytes /
//! val_tokens`), as the records' READMEs do (`delta_vs_leaderboard_nats`).

use serde::Serialize;
use statrs::distribution::{ContinuousCDF, StudentsT};

use crate::report::ablation::stats::{mean, std_dev, welch_se2_df};

/// The improvement a record must show, in nats of `val_loss`.
pub const MARGIN_NATS: f64 = 0.005;

/// The p-value it must be shown at (strictly below).
pub const P_LIMIT: f64 = 0.01;

/// What the submission is compared with.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Baseline {
    /// A published figure: the record's mean val_bpb, converted to nats with `nats_per_bpb`.
    Figure {
        /// The record's val_bpb.
        bpb: f64,
        /// `ln 2 * bytes / tokens` of the submission's validation: nats per token per bpb.
        nats_per_bpb: f64,
    },
    /// The per-seed val_loss (nats) of a baseline's runs.
    Runs(Vec<f64>),
}

/// The significance figures of a submission against a baseline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Significance {
    /// Seeds of the submission.
    pub n: usize,
    /// Their mean val_loss, nats.
    pub mean_nats: f64,
    /// Their sample standard deviation, nats (NaN below two seeds).
    pub std_nats: f64,
    /// The baseline's mean val_loss, nats.
    pub baseline_mean_nats: f64,
    /// The baseline's sample standard deviation (0 for a fixed figure).
    pub baseline_std_nats: f64,
    /// Baseline runs (0 for a fixed figure).
    pub baseline_n: usize,
    /// `mean - baseline_mean`, nats (negative: better).
    pub diff_nats: f64,
    /// `t = (diff + margin) / se`.
    pub t: f64,
    /// Degrees of freedom.
    pub df: f64,
    /// One-sided p that the improvement exceeds the margin (see the module's doc).
    pub p: f64,
    /// `diff <= -margin` and `p < P_LIMIT`.
    pub clears: bool,
    /// Why there is no test (fewer than two seeds), when so.
    pub untestable: Option<String>,
}

/// Tests the submission's per-seed `losses` (nats) against `baseline`.
pub fn test(losses: &[f64], baseline: &Baseline) -> Significance {
    let (n, m) = (
        losses.len(),
        match baseline {
            Baseline::Runs(b) => b.len(),
            Baseline::Figure { .. } => 0,
        },
    );
    let (mean_s, sd_s) = (mean(losses), std_dev(losses));
    let (mean_b, sd_b) = match baseline {
        Baseline::Figure { bpb, nats_per_bpb } => (bpb * nats_per_bpb, 0.0),
        Baseline::Runs(b) => (mean(b), std_dev(b)),
    };
    let diff = mean_s - mean_b;
    let mut out = Significance {
        n,
        mean_nats: mean_s,
        std_nats: sd_s,
        baseline_mean_nats: mean_b,
        baseline_std_nats: sd_b,
        baseline_n: m,
        diff_nats: diff,
        t: f64::NAN,
        df: f64::NAN,
        p: f64::NAN,
        clears: false,
        untestable: None,
    };
    let (se2, df) = match baseline {
        _ if n < 2 => {
            out.untestable = Some(format!("{n} seed(s): a p-value needs at least two (the challenge expects three)"));
            return out;
        }
        Baseline::Runs(b) if b.len() < 2 => {
            out.untestable = Some(format!("{} baseline run(s): Welch's test needs at least two", b.len()));
            return out;
        }
        Baseline::Figure { .. } => (sd_s * sd_s / n as f64, (n - 1) as f64),
        Baseline::Runs(b) => {
            let (se2, df) = welch_se2_df(losses, b);
            (se2, if se2 > 0.0 { df } else { (n + m - 2) as f64 })
        }
    };
    let shifted = diff + MARGIN_NATS;
    out.df = df;
    if se2 <= 0.0 {
        // No spread at all: the difference is exact.
        out.t = if shifted < 0.0 { f64::NEG_INFINITY } else { f64::INFINITY };
        out.p = if shifted < 0.0 { 0.0 } else { 1.0 };
    } else {
        out.t = shifted / se2.sqrt();
        out.p = StudentsT::new(0.0, 1.0, df).map(|d| d.cdf(out.t)).unwrap_or(f64::NAN);
    }
    out.clears = diff <= -MARGIN_NATS && out.p < P_LIMIT;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Student's t with 4 degrees of freedom in closed form: with `x = t^2 / (4 + t^2)`,
    /// `F(t) = 1/2 + sign(t) * (3/4) * sqrt(x) * (1 - x/3)`.
    fn cdf4(t: f64) -> f64 {
        let x = t * t / (4.0 + t * t);
        0.5 + t.signum() * 0.75 * x.sqrt() * (1.0 - x / 3.0)
    }

    /// Three seeds against three baseline runs, by hand: both spreads are 0.01 (variance
    /// 1e-4), so `se = sqrt(2e-4 / 3)`, `df = 4`, `d = -0.05`, `t = -0.045 / se = -5.5114`.
    #[test]
    fn welch_against_runs_matches_a_hand_computation() {
        let s = test(&[2.30, 2.31, 2.32], &Baseline::Runs(vec![2.35, 2.36, 2.37]));
        let se = (2e-4f64 / 3.0).sqrt();
        assert!((s.diff_nats + 0.05).abs() < 1e-12 && (s.std_nats - 0.01).abs() < 1e-12, "{s:?}");
        assert!((s.df - 4.0).abs() < 1e-9 && (s.t - (-0.045 / se)).abs() < 1e-9, "{s:?}");
        assert!((s.t + 5.511351921).abs() < 1e-6, "{s:?}");
        assert!((s.p - cdf4(s.t)).abs() < 1e-9 && s.p < 0.003 && s.clears, "{s:?}");
        // 0.004 nats better is not enough however sure, and a noisy 0.006 is not sure enough.
        let s = test(&[2.346, 2.346, 2.346], &Baseline::Runs(vec![2.35, 2.35, 2.35]));
        assert!(!s.clears && s.p == 1.0, "{s:?}");
        let s = test(&[2.334, 2.344, 2.354], &Baseline::Runs(vec![2.340, 2.350, 2.360]));
        assert!((s.diff_nats + 0.006).abs() < 1e-12 && s.p > 0.01 && !s.clears, "{s:?}");
    }

    /// Against a published figure: one-sample test, `df = n - 1`. Seeds 1.060, 1.061, 1.062
    /// bpb at 2.188 nats per bpb against the record's 1.0810 bpb (the 04-27 record's own
    /// figures, roughly): d = (1.061 - 1.081) * 2.188 = -0.04376 nats; sd = 0.001 * 2.188; with
    /// df = 2, `F(t) = 1/2 + t / (2 sqrt(2 + t^2))`.
    #[test]
    fn one_sample_against_a_figure_matches_a_hand_computation() {
        let k = 2.188;
        let losses: Vec<f64> = [1.060, 1.061, 1.062].iter().map(|b| b * k).collect();
        let s = test(&losses, &Baseline::Figure { bpb: 1.081, nats_per_bpb: k });
        let t = (-0.020 * k + 0.005) / (0.001 * k / 3f64.sqrt());
        assert!((s.diff_nats + 0.020 * k).abs() < 1e-9 && (s.df - 2.0).abs() < 1e-12 && (s.t - t).abs() < 1e-6, "{s:?}");
        assert!((s.p - (0.5 + t / (2.0 * (2.0 + t * t).sqrt()))).abs() < 1e-9 && s.clears, "{s:?}");
        assert_eq!(s.baseline_n, 0);
    }

    #[test]
    fn one_seed_cannot_be_tested() {
        let s = test(&[2.3], &Baseline::Figure { bpb: 1.081, nats_per_bpb: 2.188 });
        assert!(!s.clears && s.untestable.as_deref().is_some_and(|w| w.contains("1 seed")), "{s:?}");
        let s = test(&[2.3, 2.31], &Baseline::Runs(vec![2.4]));
        assert!(!s.clears && s.untestable.as_deref().is_some_and(|w| w.contains("1 baseline run")), "{s:?}");
    }
}
