//! `pipeline validate CONFIG`: plan the graph, run every stage's own checks and the memory
//! estimate, print the estimate and the stages; run nothing.

use std::path::PathBuf;

use super::run::{self, RunError};
use crate::runtime::config;
use crate::runtime::graph;
use crate::stages::REGISTRY;
use crate::train::config::Config;

/// Checks the config at `path` with `sets`; exit 0 when valid, 2 otherwise.
pub fn command(path: PathBuf, sets: Vec<String>) -> i32 {
    let result = config::load::<Config>(&path, &sets).map_err(RunError::from).and_then(|loaded| {
        let plan = graph::plan(&loaded, &REGISTRY)?;
        run::check_run_table(&loaded)?;
        let ext = loaded.config.extensions();
        graph::check_resources(&plan, &loaded, &ext)?;
        let memory = graph::memory(&plan, &loaded, &ext, run::gpu_free(&loaded.config.run));
        out!("{}", memory.summary());
        graph::check_memory(&memory, &loaded)?;
        Ok(plan)
    });
    match result {
        Ok(plan) => {
            let names: Vec<String> =
                plan.stages.iter().map(|s| format!("{} ({}/{})", s.name, s.factory.kind(), s.factory.name())).collect();
            out!("{}: ok, {} stages: {}", path.display(), plan.stages.len(), names.join(" -> "));
            for note in plan.stages.iter().filter_map(|s| s.set_aside_note()) {
                out!("note: {note}");
            }
            0
        }
        Err(e) => {
            err!("error: {e}");
            2
        }
    }
}
