//! What a run reports: `RUN_DIR/report.json` ([`document`]), its text table, the bottleneck
//! verdict ([`verdict`]) computed from the stage and channel tables ([`tables`]), and the same as
//! a self-contained page with plots, `report.html` ([`html`]), the ranks of a data-parallel
//! run side by side ([`ranks`]), and the step on N ranks predicted from one ([`projection`]).

pub mod ablation;
pub mod advise;
pub mod document;
pub mod html;
pub mod projection;
pub mod ranks;
pub mod steps;
pub mod submission;
pub mod tables;
pub mod verdict;
