//! What a run reports: `RUN_DIR/report.json` ([`document`]), its text table, the bottleneck
//! verdict ([`verdict`]) computed from the stage and channel tables ([`tables`]), and the same as
//! a self-contained page with plots, `report.html` ([`html`]), the ranks of a data-parallel
//! run side by side ([`ranks`]), the step on N ranks predicted from one ([`projection`]), and
//! what a model over the size cap must lose ([`size_advice`]).

pub mod ablation;
#[cfg(feature = "tools")]
pub mod advise;
pub mod document;
#[cfg(feature = "tools")]
pub mod html;
#[cfg(feature = "tools")]
pub mod projection;
pub mod ranks;
pub mod size_advice;
#[cfg(feature = "tools")]
pub mod steps;
#[cfg(feature = "tools")]
pub mod submission;
pub mod tables;
pub mod verdict;
