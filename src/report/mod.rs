//! What a run reports: `RUN_DIR/report.json` ([`document`]), its text table, and the bottleneck
//! verdict ([`verdict`]) computed from the stage and channel tables ([`tables`]).

pub mod ablation;
pub mod advise;
pub mod document;
pub mod tables;
pub mod verdict;
