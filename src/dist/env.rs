//! Where this process stands among the ranks, read from its launcher's environment. Each
//! launcher names the variables differently; the first source whose rank and world size are
//! both set wins:
//!
//! | source | rank | world size | local rank |
//! |---|---|---|---|
//! | `pipeline launch`, torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` |
//! | Open MPI's `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | MPICH's `mpiexec` (Hydra), Intel MPI | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` |
//! | Slurm's `srun` | `SLURM_PROCID` | `SLURM_STEP_NUM_TASKS` | `SLURM_LOCALID` |
//!
//! Without any of them the process is rank 0 of 1. (Slurm's batch script itself sees
//! `SLURM_NTASKS` but not `SLURM_STEP_NUM_TASKS`: it is one process, not a rank.) The local rank picks the GPU on a
//! `cuda` device (`cuda:LOCAL_RANK`).

/// A rank's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// This process's rank, below `world`.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// The rank among the ranks of this machine (the GPU it drives).
    pub local_rank: usize,
    /// Where it was read: "pipeline launch / torchrun (RANK, WORLD_SIZE)", or "none".
    pub source: &'static str,
}

/// The sources in the order they are tried: (name, rank, world size, local rank).
pub const SOURCES: [(&str, &str, &str, &str); 4] = [
    ("pipeline launch / torchrun (RANK, WORLD_SIZE, LOCAL_RANK)", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI (OMPI_COMM_WORLD_*)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH / Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("Slurm srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
];

impl Placement {
    /// A process on its own.
    pub fn single() -> Self {
        Self { rank: 0, world: 1, local_rank: 0, source: "none" }
    }

    /// Reads the process's environment.
    pub fn from_env() -> anyhow::Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables `get` returns; errors name a variable that is not a number, or a rank
    /// not below the world size.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let num = |k: &str, v: String| -> anyhow::Result<usize> {
            v.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("environment variable {k}={v:?} is not a rank count or index"))
        };
        for (source, rank_k, world_k, local_k) in SOURCES {
            // Slurm: the step's task count, set by `srun` only (a batch script also sees
            // SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but is one process).
            let (Some(rank), Some(world)) = (get(rank_k), get(world_k)) else { continue };
            let (rank, world) = (num(rank_k, rank)?, num(world_k, world)?);
            anyhow::ensure!(world >= 1, "environment variable {world_k}=0: a job has at least one rank");
            anyhow::ensure!(rank < world, "environment variable {rank_k}={rank} is not below {world_k}={world}");
            let local_rank = match get(local_k) {
                Some(v) => num(local_k, v)?,
                None => rank,
            };
            return Ok(Self { rank, world, local_rank, source });
        }
        Ok(Self::single())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(vars: &[(&str, &str)]) -> anyhow::Result<Placement> {
        Placement::from_vars(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    /// Every source of the table is read, the first one set wins, and the local rank defaults
    /// to the rank.
    #[test]
    fn every_source_is_read() {
        assert_eq!(read(&[]).unwrap(), Placement::single());
        for (source, r, w, l) in SOURCES {
            let p = read(&[(r, "1"), (w, "4"), (l, "0")]).unwrap();
            assert_eq!((p.rank, p.world, p.local_rank, p.source), (1, 4, 0, source));
            assert_eq!(read(&[(r, "3"), (w, "4")]).unwrap().local_rank, 3);
        }
        let both = read(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap();
        assert_eq!(both.rank, 0, "the launcher's own variables come first");
    }

    /// A rank past the world size, or a word where a number belongs, is an error naming the
    /// variable.
    #[test]
    fn bad_values_name_the_variable() {
        let e = read(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("RANK=2") && e.contains("WORLD_SIZE=2"), "{e}");
        let e = read(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("PMI_RANK"), "{e}");
    }
}
