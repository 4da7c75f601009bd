//! The CUDA device's collectives (`cuda` builds): an NCCL communicator of its own, made by
//! cudarc's binding of libnccl (loaded at run time), on a communication stream of its own in
//! the engine's context. Its unique id is rank 0's, handed to every rank by the world's
//! collective ([`crate::dist`]: NCCL's or MPI's), so no other transport is involved.
//!
//! A [`CommCall`] forks from the engine's compute stream (an event recorded there, waited for
//! on the communication stream), runs its pieces in one NCCL group (one launch), and a
//! [`CommCall::Join`] makes the compute stream wait for the communication stream (another
//! event). Events are the only ordering: no host wait. Under `cuStreamBeginCapture` the fork
//! pulls the communication stream into the capture and the join (every unit of work with
//! collectives ends with one) brings it back, so the NCCL kernels are nodes of the unit's graph,
//! which NCCL supports since 2.9 (graph-captured and eager calls may mix on one communicator,
//! `NCCL_GRAPH_MIXING_SUPPORT`, on by default).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};

use super::{CommCall, Space};
use crate::dist::{Collective, ReduceOp};

/// The communicator and its stream.
pub(super) struct DeviceComm {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    /// Recorded on the compute stream before each collective.
    fork: CudaEvent,
    /// Recorded on the communication stream at a join.
    done: CudaEvent,
    rank: usize,
}

// SAFETY: the communicator is used by the device that owns it, whose calls come from one
// thread at a time (the engine's), never concurrently.
unsafe impl Send for DeviceComm {}
unsafe impl Sync for DeviceComm {}

fn nccl_err(what: &str) -> impl Fn(result::NcclError) -> anyhow::Error + '_ {
    // The result code (`NcclError`'s own Debug prints only its name).
    move |e| anyhow::anyhow!("{what}: {:?}", e.0)
}

impl DeviceComm {
    /// Joins a new communicator among `ranks` (every rank calls it; it returns once all have).
    pub(super) fn new(ctx: &Arc<CudaContext>, ranks: &dyn Collective) -> anyhow::Result<Self> {
        let (rank, world) = (ranks.rank(), ranks.world());
        // Rank 0's id reaches every rank, or its absence does: a rank 0 that cannot make one
        // still takes part in the gather, so that no rank waits for it.
        let made = if rank == 0 { crate::dist::nccl::new_id_hex() } else { Ok(String::new()) };
        let hex = made.as_ref().map(|h| h.clone()).unwrap_or_default();
        let all = ranks.all_gather_bytes(hex.as_bytes()).map_err(|e| e.context("handing out the engine's NCCL id"))?;
        made?;
        anyhow::ensure!(!all[0].is_empty(), "rank 0 could not make the engine's NCCL id (its error says why)");
        crate::dist::nccl::ensure_lib()?;
        let id = crate::dist::nccl::id_from_hex(std::str::from_utf8(&all[0])?)?;
        let unique = sys::ncclUniqueId { internal: *id.internal() };
        let stream = ctx.new_stream().map_err(|e| anyhow::anyhow!("a communication stream for the engine: {e:?}"))?;
        let event = || ctx.new_event(None).map_err(|e| anyhow::anyhow!("an event for the engine's collectives: {e:?}"));
        let (fork, done) = (event()?, event()?);
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before it is read; every rank passes the same id.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), world as i32, unique, rank as i32)
                .map_err(nccl_err(&format!("ncclCommInitRank for the engine (rank {rank} of {world})")))?;
            comm.assume_init()
        };
        Ok(Self { comm, stream, fork, done, rank })
    }

    /// Runs `c`, ordered after the work queued on `compute` (`address` resolves a space's
    /// element to its device address).
    pub(super) fn run(&self, compute: &CudaStream, address: &dyn Fn(Space, usize) -> u64, c: &CommCall) -> anyhow::Result<()> {
        let cu = |e| anyhow::anyhow!("ordering the engine's collectives: {e:?}");
        if let CommCall::Join = c {
            self.done.record(&self.stream).map_err(cu)?;
            return compute.wait(&self.done).map_err(cu);
        }
        self.fork.record(compute).map_err(cu)?;
        self.stream.wait(&self.fork).map_err(cu)?;
        let s = self.stream.cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let mut r = Ok(());
        match c {
            CommCall::AllReduce { pieces, op } => {
                for &(space, off, len) in pieces {
                    let p = address(space, off) as *mut std::ffi::c_void;
                    // SAFETY: the piece lies inside the space's allocation (the backend's regions).
                    r = r.and(unsafe { result::all_reduce(p, p, len, dtype(space), red(*op), self.comm, s) }.map(|_| ()));
                }
            }
            CommCall::Broadcast { pieces } => {
                for &(space, off, len, root) in pieces {
                    let p = address(space, off) as *mut std::ffi::c_void;
                    // SAFETY: as above.
                    r = r.and(unsafe { result::broadcast(p, p, len, dtype(space), root as i32, self.comm, s) }.map(|_| ()));
                }
            }
            &CommCall::AllReduceInto { src, dst, len, op } => {
                let (from, to) = (address(src.0, src.1) as *const std::ffi::c_void, address(dst.0, dst.1) as *mut std::ffi::c_void);
                // SAFETY: both lie inside their spaces' allocations and do not overlap.
                r = unsafe { result::all_reduce(from, to, len, dtype(src.0), red(op), self.comm, s) }.map(|_| ());
            }
            CommCall::Join => unreachable!("handled above"),
        }
        let end = result::group_end().map(|_| ());
        r.and(end).map_err(nccl_err(&format!("the engine's collective on rank {} ({c:?})", self.rank)))
    }
}

fn dtype(space: Space) -> sys::ncclDataType_t {
    if space.is_bf16() { sys::ncclDataType_t::ncclBfloat16 } else { sys::ncclDataType_t::ncclFloat32 }
}

fn red(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl Drop for DeviceComm {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: nothing is queued on the communicator any more.
        unsafe {
            let _ = result::comm_destroy(self.comm);
        }
    }
}
