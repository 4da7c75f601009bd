//! A record submission from finished runs, one per seed: the challenge's rules checked over
//! their reports ([`rules`]), the significance of the improvement ([`significance`]), and the
//! records folder the challenge's pull requests add ([`folder`]). The figures come from each
//! run's `report.json` and `config.toml` ([`figures`]); the checks that need the model or the
//! tokenizer (the legality audit, the byte table) are made by the caller and handed in.

pub mod figures;
pub mod folder;
pub mod rules;
pub mod significance;

use serde::Serialize;

use self::figures::RunFigures;
use self::rules::{Check, Outcome};
use self::significance::{Baseline, Significance};
use crate::report::ablation::stats::{mean, std_dev};

/// What a submission is checked against.
#[derive(Clone, Debug)]
pub enum Against {
    /// Nothing: the significance line is skipped.
    Nothing,
    /// The record's published val_bpb.
    Bpb(f64),
    /// A baseline's runs (one per seed).
    Runs(Vec<RunFigures>),
}

impl Against {
    /// How the line names it.
    pub fn describe(&self) -> String {
        match self {
            Against::Nothing => "nothing".into(),
            Against::Bpb(b) => format!("the record's {b} bpb"),
            Against::Runs(r) => format!("{} baseline run(s) of `{}`", r.len(), r.first().map_or("", |r| r.name.as_str())),
        }
    }
}

/// A set of runs checked as one submission.
#[derive(Clone, Debug, Serialize)]
pub struct Submission {
    /// The runs, in the order given.
    pub runs: Vec<RunFigures>,
    /// Every check, in order.
    pub checks: Vec<Check>,
    /// The significance test, when there was something to test against.
    pub significance: Option<Significance>,
    /// The record's bpb given, or the baseline runs' mean bpb.
    pub baseline_bpb: Option<f64>,
}

impl Submission {
    /// Checks `runs` (at least one) against the rules; `extra` are the caller's checks (the
    /// legality audit, the byte table), placed before the significance line.
    pub fn check(runs: Vec<RunFigures>, min_seeds: usize, against: &Against, extra: Vec<Check>) -> Self {
        let mut checks = rules::set_checks(&runs, min_seeds);
        for r in &runs {
            checks.extend(rules::run_checks(r));
        }
        checks.push(rules::val_check(&runs));
        checks.extend(extra);
        let losses: Vec<f64> = runs.iter().map(|r| r.score.val_loss).collect();
        // Nats per token per bpb of the submission's validation: a baseline's bpb becomes
        // nats on the submission's tokens, so that a baseline with another tokenizer is
        // compared on the text's bytes, as the records compare across tokenizers.
        let (tokens, bytes) = runs.iter().fold((0u64, 0u64), |(t, b), r| (t + r.score.val_tokens, b + r.score.val_bytes));
        let nats_per_bpb = std::f64::consts::LN_2 * bytes as f64 / tokens.max(1) as f64;
        let (significance, baseline_bpb) = match against {
            Against::Nothing => (None, None),
            Against::Bpb(b) => (Some(significance::test(&losses, &Baseline::Figure { bpb: *b, nats_per_bpb })), Some(*b)),
            Against::Runs(base) => {
                let bpb: Vec<f64> = base.iter().map(|r| r.score.val_bpb).collect();
                let theirs: Vec<f64> = bpb.iter().map(|b| b * nats_per_bpb).collect();
                (Some(significance::test(&losses, &Baseline::Runs(theirs))), Some(mean(&bpb)))
            }
        };
        checks.push(rules::significance_check(significance.as_ref(), &against.describe()));
        Self { runs, checks, significance, baseline_bpb }
    }

    /// No check failed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.outcome != Outcome::Fail)
    }

    /// Every rule of a valid submission holds: only the significance line (a record's rule,
    /// not the non-record track's) may have failed.
    pub fn valid(&self) -> bool {
        self.checks.iter().all(|c| c.outcome != Outcome::Fail || c.name == "significance")
    }

    /// The failed checks.
    pub fn failures(&self) -> Vec<&Check> {
        self.checks.iter().filter(|c| c.outcome == Outcome::Fail).collect()
    }

    /// Mean and sample standard deviation of the submitted scores: (bpb, bpb std, nats, nats
    /// std).
    pub fn score_stats(&self) -> (f64, f64, f64, f64) {
        let bpb: Vec<f64> = self.runs.iter().map(|r| r.score.val_bpb).collect();
        let nats: Vec<f64> = self.runs.iter().map(|r| r.score.val_loss).collect();
        (mean(&bpb), std_dev(&bpb), mean(&nats), std_dev(&nats))
    }
}

#[cfg(test)]
mod tests;
