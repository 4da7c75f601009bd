//! Data parallelism's collectives: the operations ranks use to train one model together
//! (all-reduce, broadcast, all-gather, reduce-scatter, barrier), behind one trait,
//! [`Collective`], with an existing engine under each backend, never a home-made transport:
//!
//! - [`single`]: one rank, every operation the identity (what a run without a launcher gets);
//! - [`threads`]: ranks as threads of one process, every call recorded (the engine's tests);
//! - `mpi` (feature `mpi`): CPU ranks over the system's MPI (rsmpi), started by `mpirun`, Slurm
//!   or `pipeline launch`;
//! - `nccl` (feature `cuda`): GPU ranks over NCCL (cudarc's bindings), its unique id handed out by
//!   `pipeline launch` (or broadcast over MPI).
//!
//! Where a process stands (rank, world size, local rank) is read from the launcher's environment
//! ([`env`]). The process's collective is installed once, before any stage is built
//! ([`install`]), and read by whoever needs it ([`world`]); a process that installed none is a
//! world of one. [`bucket`] all-reduces a list of tensors (the gradients) as a few flat buffers.
//!
//! Every rank must call the same collectives in the same order. The installed collective is
//! used, one after another, by the step executor's thread (training, validation, the step's
//! agreement), then by the stages after training (`artifact`, `ttt_eval`: their passes split
//! by [`share`]), each once the final snapshot reaches it, which the executor sends after its
//! last collective; and by the main thread (the report's merge) once the graph has ended.

pub mod bucket;
pub mod env;
pub mod share;
pub mod single;
#[cfg(feature = "tools")]
pub mod threads;

#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::Tensor;

pub use env::Placement;

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over ranks.
    Sum,
    /// The sum divided by the world size.
    Mean,
    /// The largest value.
    Max,
}

/// The collective operations of one group of ranks. Tensors are contiguous, f32 or f64 (the
/// MPI backend also takes bf16 and f16, reduced in f32), on the backend's device; every rank
/// passes the same shape. Results are new tensors on the same device.
pub trait Collective: Send + Sync {
    /// This process's rank, below [`Collective::world`].
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// The backend's name (`single`, `mpi`, `nccl`), for logs and the report.
    fn backend(&self) -> &'static str;

    /// Whether every operation is the identity with nothing sent ([`single::Single`]): the
    /// code skips its collectives then (training, validation and the evaluations alike). A launcher's world of one (`pipeline launch
    /// --nproc 1`, as `torchrun --nproc 1`) is not: it runs them, through its transport.
    fn is_identity(&self) -> bool {
        false
    }

    /// Every rank's `t` combined by `op`, on every rank.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor>;

    /// Rank `root`'s `t` on every rank.
    fn broadcast(&self, t: &Tensor, root: usize) -> anyhow::Result<Tensor>;

    /// Every rank's `t` stacked along a new first dimension, in rank order: `(world, ...)`.
    fn all_gather(&self, t: &Tensor) -> anyhow::Result<Tensor>;

    /// `t` (first dimension `world · n`) combined by `op` across ranks; rank `r` keeps rows
    /// `[r·n, (r+1)·n)` of the result.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> anyhow::Result<()>;

    /// Every rank's host values combined by `op` (f64 sums, maxima: small agreements such as
    /// validation sums or the step's clock).
    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> anyhow::Result<Vec<f64>>;

    /// Every rank's bytes (of any length), in rank order.
    fn all_gather_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<Vec<u8>>>;

    /// Ends every rank of the job with `code` now (a rank failed; the others may be waiting in
    /// a collective that will never complete). Backends without a job to end return.
    fn abort(&self, code: i32);

    /// Leaves the group cleanly (MPI_Finalize): called once, at the end of a process that
    /// succeeded.
    fn finish(&self) {}
}

impl std::fmt::Debug for dyn Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} rank {} of {}", self.backend(), self.rank(), self.world())
    }
}

static WORLD: OnceLock<Arc<dyn Collective>> = OnceLock::new();

/// Serialises [`install`] (one install per process).
static INSTALLING: Mutex<()> = Mutex::new(());

/// Installs this process's collective; errors if one is installed already.
pub fn install(c: Arc<dyn Collective>) -> anyhow::Result<()> {
    let _guard = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    WORLD.set(c).map_err(|_| anyhow::anyhow!("a collective is installed already: one per process"))
}

/// This process's collective: the installed one, or a world of one.
pub fn world() -> Arc<dyn Collective> {
    match WORLD.get() {
        Some(c) => c.clone(),
        None => Arc::new(single::Single),
    }
}

/// The installed collective's rank and world size, `(0, 1)` when none is.
#[cfg(feature = "tools")]
pub fn rank_world() -> (usize, usize) {
    WORLD.get().map(|c| (c.rank(), c.world())).unwrap_or((0, 1))
}

/// The installed collective, for the end of the process: `finish` on success, `abort` on a
/// failure while other ranks may still be waiting.
pub fn installed() -> Option<Arc<dyn Collective>> {
    WORLD.get().cloned()
}

/// Starts this process's collective from its launcher's environment ([`env`]) for a run on
/// `device` ("cpu" or "cuda:N"): MPI for CPU ranks; NCCL for GPU ranks; nothing for a world of
/// one, unless `pipeline launch` started it ([`COLLECTIVE_VAR`]: `--nproc 1` runs every
/// collective through the transport, as `torchrun --nproc 1` does, which is how its cost is
/// measured). Returns where the process stands.
pub fn start(device: &str) -> anyhow::Result<Placement> {
    let placement = Placement::from_env()?;
    if placement.world == 1 && std::env::var_os(COLLECTIVE_VAR).is_none() {
        return Ok(placement);
    }
    let c: Arc<dyn Collective> = if device == "cpu" { start_cpu(&placement)? } else { start_gpu(device, &placement)? };
    anyhow::ensure!(
        (c.rank(), c.world()) == (placement.rank, placement.world),
        "the {} backend says rank {} of {}, the environment ({}) says rank {} of {}",
        c.backend(),
        c.rank(),
        c.world(),
        placement.source,
        placement.rank,
        placement.world
    );
    install(c)?;
    Ok(placement)
}

/// The advice for a binary that cannot start CPU ranks.
pub const NO_MPI: &str = "CPU ranks need a binary built with the `mpi` feature: install MPI and libclang \
     (Debian: apt-get install libopenmpi-dev openmpi-bin libclang-dev), then cargo build --release --features mpi";

#[cfg(feature = "mpi")]
fn start_cpu(_p: &Placement) -> anyhow::Result<Arc<dyn Collective>> {
    Ok(Arc::new(mpi::Mpi::init()?))
}

#[cfg(not(feature = "mpi"))]
fn start_cpu(p: &Placement) -> anyhow::Result<Arc<dyn Collective>> {
    anyhow::bail!("this process is rank {} of {} ({}), but {NO_MPI}", p.rank, p.world, p.source)
}

#[cfg(feature = "cuda")]
fn start_gpu(device: &str, p: &Placement) -> anyhow::Result<Arc<dyn Collective>> {
    let dev = crate::device::open_named(device)?;
    let id = match std::env::var(NCCL_ID_VAR) {
        Ok(hex) => nccl::id_from_hex(&hex)?,
        Err(_) => id_over_mpi(p)?,
    };
    Ok(Arc::new(nccl::Nccl::init(&dev, p.rank, p.world, id)?))
}

/// NCCL's id broadcast from rank 0 over MPI (a GPU job started by `mpirun` or `srun`).
#[cfg(all(feature = "cuda", feature = "mpi"))]
fn id_over_mpi(_p: &Placement) -> anyhow::Result<candle_core::cuda_backend::cudarc::nccl::safe::Id> {
    let m = mpi::Mpi::init()?;
    let hex = if m.rank() == 0 { nccl::new_id_hex()? } else { String::new() };
    let all = m.all_gather_bytes(hex.as_bytes())?;
    // MPI stays initialised (finalised at exit by the OS: no MPI call follows).
    let id = nccl::id_from_hex(std::str::from_utf8(&all[0])?)?;
    std::mem::forget(m);
    Ok(id)
}

#[cfg(all(feature = "cuda", not(feature = "mpi")))]
fn id_over_mpi(p: &Placement) -> anyhow::Result<candle_core::cuda_backend::cudarc::nccl::safe::Id> {
    anyhow::bail!(
        "rank {} of {} ({}) has no NCCL id: start GPU ranks with `pipeline launch --nproc {}` (which hands it out in {}), \
         or build with the `mpi` feature to start them with mpirun or srun",
        p.rank,
        p.world,
        p.source,
        p.world,
        NCCL_ID_VAR
    )
}

#[cfg(not(feature = "cuda"))]
fn start_gpu(device: &str, p: &Placement) -> anyhow::Result<Arc<dyn Collective>> {
    anyhow::bail!("rank {} of {} on device `{device}` needs the `cuda` build (NCCL)", p.rank, p.world)
}

/// The environment variable with which `pipeline launch` asks its ranks for the collective even
/// in a world of one (`--nproc 1`). Not `PIPELINE_…`: that prefix is the config's environment
/// layer.
pub const COLLECTIVE_VAR: &str = "LAUNCH_COLLECTIVE";

/// The environment variable that carries NCCL's unique id (256 hex digits) from `pipeline
/// launch` to its ranks. Not `PIPELINE_…`: that prefix is the config's environment layer.
pub const NCCL_ID_VAR: &str = "LAUNCH_NCCL_ID";

/// A new NCCL unique id as hex, for `pipeline launch` to hand to its GPU ranks in
/// [`NCCL_ID_VAR`]; an error naming the missing build without the `cuda` feature.
pub fn new_nccl_id(device: &str) -> anyhow::Result<String> {
    #[cfg(feature = "cuda")]
    {
        let _ = device;
        nccl::new_id_hex()
    }
    #[cfg(not(feature = "cuda"))]
    anyhow::bail!("device `{device}`: GPU ranks need the `cuda` build (NCCL); CPU ranks: `--set run.device=cpu` with the `mpi` build")
}
