//! The statistics of a seeded ablation: mean and sample standard deviation per figure, and
//! Welch's t-test between two variants (unequal variances, the Welch-Satterthwaite degrees of
//! freedom, a two-sided p-value from Student's t distribution through `statrs`).

use statrs::distribution::{ContinuousCDF, StudentsT};

/// The mean of `xs` (NaN when empty).
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() { f64::NAN } else { xs.iter().sum::<f64>() / xs.len() as f64 }
}

/// The sample standard deviation of `xs` (`n - 1` in the denominator; NaN below two values).
pub fn std_dev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return f64::NAN;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// Welch's t-test of `a` against `b`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Welch {
    /// `(mean(a) - mean(b)) / sqrt(var(a) / n_a + var(b) / n_b)`.
    pub t: f64,
    /// Welch-Satterthwaite degrees of freedom.
    pub df: f64,
    /// Two-sided p-value: the chance of a `|t|` this large if the means were equal.
    pub p: f64,
}

/// The squared standard error of `mean(a) - mean(b)`, `var(a)/n_a + var(b)/n_b` (sample
/// variances), and the Welch-Satterthwaite degrees of freedom (NaN when neither side has any
/// spread). Both sides need two values or more.
pub fn welch_se2_df(a: &[f64], b: &[f64]) -> (f64, f64) {
    let (va, vb) = (std_dev(a).powi(2) / a.len() as f64, std_dev(b).powi(2) / b.len() as f64);
    let se2 = va + vb;
    (se2, se2 * se2 / (va * va / (a.len() - 1) as f64 + vb * vb / (b.len() - 1) as f64))
}

/// Welch's t-test of `a` against `b`, or `None` with fewer than two values on a side or no
/// variance at all (identical runs: nothing to test).
pub fn welch(a: &[f64], b: &[f64]) -> Option<Welch> {
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    let (se2, df) = welch_se2_df(a, b);
    if se2.is_nan() || se2 <= 0.0 {
        return None;
    }
    let t = (mean(a) - mean(b)) / se2.sqrt();
    let dist = StudentsT::new(0.0, 1.0, df).ok()?;
    let p = (2.0 * (1.0 - dist.cdf(t.abs()))).clamp(0.0, 1.0);
    Some(Welch { t, df, p })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_sample_standard_deviation() {
        assert_eq!(mean(&[1.0, 2.0, 3.0, 4.0]), 2.5);
        assert!((std_dev(&[1.0, 2.0, 3.0, 4.0]) - 1.2909944487358056).abs() < 1e-12);
        assert!(std_dev(&[1.0]).is_nan() && mean(&[]).is_nan());
    }

    /// With df = 2 Student's t has a closed form, two-sided `p = 1 - |t| / sqrt(2 + t^2)`:
    /// a = [0, 2], b = [2, 4] give equal variances (2), n = 2 each, so df = 2 and t = -sqrt(2),
    /// p = 1 - sqrt(2) / 2. And by hand for unequal sizes and variances.
    #[test]
    fn welch_matches_closed_forms() {
        let w = welch(&[0.0, 2.0], &[2.0, 4.0]).unwrap();
        assert!((w.t + 2f64.sqrt()).abs() < 1e-12 && (w.df - 2.0).abs() < 1e-12, "{w:?}");
        assert!((w.p - (1.0 - 2f64.sqrt() / 2.0)).abs() < 1e-9, "{w:?}");
        let (a, b) = ([1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0, 7.0]);
        let w = welch(&a, &b).unwrap();
        // var(a) = 5/3, var(b) = 5/2: se^2 = 5/12 + 1/2 = 11/12.
        let se2: f64 = 11.0 / 12.0;
        let df = se2 * se2 / ((5.0f64 / 12.0).powi(2) / 3.0 + 0.25 / 4.0);
        assert!((w.t - -2.5 / se2.sqrt()).abs() < 1e-12 && (w.df - df).abs() < 1e-9, "{w:?}");
        assert!(w.p > 0.02 && w.p < 0.05, "{w:?}");
        // Symmetric, and nothing to test without spread or with one value.
        assert!((welch(&b, &a).unwrap().p - w.p).abs() < 1e-12);
        assert!(welch(&[1.0, 1.0], &[1.0, 1.0]).is_none() && welch(&[1.0], &b).is_none());
    }
}
