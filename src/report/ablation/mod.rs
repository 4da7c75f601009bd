//! Ablations: several runs of one config that differ in one setting at a time (or in a grid of
//! settings), compared side by side. [`plan`] makes the list of runs, [`figures`] reads what a
//! finished run measured from its run directory, [`summary`] compares every run with the base
//! (ratios, differences, seeds' means and standard deviations, Welch's t-test against the
//! challenge's significance bar), [`stats`] holds the statistics. `pipeline ablate`
//! (`crate::cli::ablate`) runs them.

#[cfg(feature = "tools")]
pub mod figures;
pub mod plan;
#[cfg(feature = "tools")]
pub mod stats;
#[cfg(feature = "tools")]
pub mod summary;
