//! What `pipeline audit-eval` found ([`super::audit`]): the report, its verdict and its lines.

use serde::Serialize;

use crate::eval::audit::{Causality, Documents, Leak};

/// A setting of the stage changed so that the audit's short prefix exercises it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Adjustment {
    /// The stage's key.
    pub key: String,
    /// Its value in the run.
    pub from: usize,
    /// The value audited.
    pub to: usize,
    /// Why.
    pub why: String,
}

impl Adjustment {
    /// `key` changed from `from` to `to` because `why`.
    pub fn new(key: &str, from: usize, to: usize, why: String) -> Self {
        Self { key: key.to_string(), from, to, why }
    }
}

/// The documents audit, or why it does not apply.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum DocumentsAudit {
    /// The model claims document masking: checked.
    Checked(Documents),
    /// The model does not claim it.
    NotApplicable {
        /// Why it does not apply.
        reason: String,
    },
}

/// The audit of one run's evaluation.
#[derive(Clone, Debug, Serialize)]
pub struct AuditReport {
    /// The `ttt_eval` stage's name (`[stages.NAME]`).
    pub stage: String,
    /// Its implementation (`sliding`, `score_first`, `phased`).
    pub implementation: String,
    /// Where the weights came from.
    pub weights: String,
    /// Targets of the validation prefix scored.
    pub tokens: usize,
    /// Settings changed to fit the prefix.
    pub adjusted: Vec<Adjustment>,
    /// The causality audit.
    pub causality: Causality,
    /// The documents (BOS) audit.
    pub documents: DocumentsAudit,
}

fn verdict(passed: bool) -> &'static str {
    if passed { "PASS" } else { "FAIL" }
}

fn leak_line(what: &str, l: &Leak, of: usize) -> String {
    format!(
        "{what}: FAIL: target {} (scoring token {}) moved by {:.3e} ({} -> {}); {} of {of} compared targets moved",
        l.target, l.token, l.change, l.before, l.after, l.moved
    )
}

impl AuditReport {
    /// Both audits passed (the documents audit where it applies).
    pub fn passed(&self) -> bool {
        self.causality.passed
            && match &self.documents {
                DocumentsAudit::Checked(d) => d.passed,
                DocumentsAudit::NotApplicable { .. } => true,
            }
    }

    /// The report as text, one finding a line, the verdict last.
    pub fn lines(&self) -> Vec<String> {
        let c = &self.causality;
        let mut out = vec![format!(
            "audit-eval: stage `{}` (ttt_eval/{}) on the first {} validation targets; weights: {}",
            self.stage, self.implementation, self.tokens, self.weights
        )];
        for a in &self.adjusted {
            out.push(format!("adjusted: {} {} -> {}: {}", a.key, a.from, a.to, a.why));
        }
        out.push(format!(
            "changed: token {} ({} -> {}); targets taken {}; target {} scores it",
            c.position,
            c.from,
            c.to,
            c.order,
            c.position - 1
        ));
        match &c.leak {
            Some(l) => out.push(leak_line("causality", l, c.targets_compared)),
            None if c.problems.is_empty() => out.push(format!(
                "causality: PASS: every target scored once in both runs; the {} targets taken before target {} unchanged bit for bit; target {} moved by {:.3e}",
                c.targets_compared,
                c.position - 1,
                c.position - 1,
                c.own_change
            )),
            None => {}
        }
        out.extend(c.problems.iter().map(|p| format!("causality: FAIL: {p}")));
        match &self.documents {
            DocumentsAudit::NotApplicable { reason } => out.push(format!("documents: not applicable: {reason}")),
            DocumentsAudit::Checked(d) => {
                let head = format!(
                    "BOS at {} in the row of inputs {}..{}, {} tokens of the document before it changed",
                    d.bos_position, d.row.start, d.row.end, d.changed_tokens
                );
                match &d.leak {
                    Some(l) => out.push(format!("{} ({head})", leak_line("documents", l, d.targets_compared))),
                    None if d.problems.is_empty() => out.push(format!(
                        "documents: PASS: {head}; the {} targets after it unchanged bit for bit, alone within {:.1e} (largest {:.3e}, target {})",
                        d.targets_compared,
                        crate::eval::audit::ALONE_TOLERANCE,
                        d.alone_max_diff,
                        d.alone_worst_target
                    )),
                    None => {}
                }
                out.extend(d.problems.iter().map(|p| format!("documents: FAIL: {p}")));
            }
        }
        out.push(format!("verdict: {}", verdict(self.passed())));
        out
    }
}
