//! A `pipeline run` process among several ranks: joining the job its launcher started (the
//! collective from [`crate::dist::start`], `[run]`'s rank, world size and device set from it),
//! and leaving it: cleanly after the last collective, or by ending every rank at once when this
//! one failed, so that no rank waits forever in a collective its peer will never enter.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::dist::Placement;
use crate::runtime::config::Loaded;
use crate::train::config::Config;

/// Set once every rank has passed the run's last collective (the report's merge).
static CLEAN: AtomicBool = AtomicBool::new(false);

/// Joins the job this process was started in (a world of one without a launcher) and writes
/// its place into `[run]`: `world_size`, `rank`, and on a GPU `device = "cuda:LOCAL_RANK"`.
/// Errors: a config whose `run.world_size` differs from the launcher's, a process started alone
/// for a config that asks for several ranks, a binary that cannot start the ranks' backend.
pub fn join(loaded: &mut Loaded<Config>) -> anyhow::Result<Placement> {
    let asked = loaded.config.run.world_size;
    let placement = crate::dist::start(&loaded.config.run.device)?;
    if placement.world == 1 {
        anyhow::ensure!(
            asked <= 1,
            "`run.world_size` = {asked} but this process was started alone: start the ranks with \
             `pipeline launch --nproc {asked} CONFIG`, or `mpirun -n {asked} pipeline run CONFIG` (see the README's \"Several ranks\")"
        );
        return Ok(placement);
    }
    anyhow::ensure!(
        asked <= 1 || asked == placement.world,
        "`run.world_size` = {asked}, but the launcher started {} ranks ({}): leave `run.world_size` out, or make them agree",
        placement.world,
        placement.source
    );
    let run = &mut loaded.config.run;
    run.world_size = placement.world;
    run.rank = placement.rank;
    if run.device.starts_with("cuda") {
        run.device = format!("cuda:{}", placement.local_rank);
    }
    Ok(placement)
}

/// Marks the job's last collective as passed: from here a rank may leave on its own.
pub fn mark_clean() {
    CLEAN.store(true, Ordering::SeqCst);
}

/// Leaves the job with exit code `code`: `MPI_Finalize` when every rank passed the last
/// collective, else every rank is ended now (this rank's error printed first, its rank named).
pub fn leave(code: i32) {
    let Some(c) = crate::dist::installed() else { return };
    if CLEAN.load(Ordering::SeqCst) {
        c.finish();
    } else {
        err!("pipeline: rank {} of {} stops with exit code {code} before the job's end: stopping every rank", c.rank(), c.world());
        c.abort(if code == 0 { 1 } else { code });
    }
}
