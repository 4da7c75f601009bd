//! CPU ranks over MPI (feature `mpi`): rsmpi over the system's Open MPI or MPICH. The process is
//! started by `mpirun`, `srun` or `pipeline launch` (which runs `mpirun`); MPI itself finds the
//! other ranks. Tensors are copied to host vectors and reduced by MPI's own operations; bf16 and
//! f16 are reduced in f32.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` wanted and at least `MPI_THREAD_SERIALIZED`
//! required: stages run on their own threads, and a mutex keeps two calls from overlapping.

use std::sync::Mutex;

use candle_core::{DType, Tensor};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::{Collective, ReduceOp};

/// The MPI world of this process.
pub struct Mpi {
    /// Dropping the universe finalises MPI ([`Collective::finish`]).
    universe: Mutex<Option<Universe>>,
    comm: SimpleCommunicator,
    /// Held across every call: MPI calls never overlap.
    lock: Mutex<()>,
    rank: usize,
    world: usize,
}

// SAFETY: the communicator is a handle MPI allows any thread to use once initialised with at
// least MPI_THREAD_SERIALIZED (checked in `init`); `lock` serialises every call.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Initialises MPI; errors when it cannot be, or gives too little thread support.
    pub fn init() -> anyhow::Result<Self> {
        use mpi::Threading;
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| anyhow::anyhow!("MPI is initialised already in this process"))?;
        anyhow::ensure!(
            threading >= Threading::Serialized,
            "this MPI gives thread support {threading:?}; the pipeline's stages need at least MPI_THREAD_SERIALIZED"
        );
        let comm = universe.world();
        let (rank, world) = (comm.rank() as usize, comm.size() as usize);
        Ok(Self { universe: Mutex::new(Some(universe)), comm, lock: Mutex::new(()), rank, world })
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn op_of(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
    }
}

/// A tensor's values as f32 or f64 host vectors, and back.
enum Host {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

fn to_host(t: &Tensor) -> anyhow::Result<(Host, DType)> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F64 => (Host::F64(flat.to_vec1()?), DType::F64),
        DType::F32 => (Host::F32(flat.to_vec1()?), DType::F32),
        d @ (DType::BF16 | DType::F16) => (Host::F32(flat.to_dtype(DType::F32)?.to_vec1()?), d),
        d => anyhow::bail!("MPI collectives take f32, f64, bf16 or f16 tensors, not {d:?}"),
    })
}

fn from_host(h: Host, dims: &[usize], dtype: DType, like: &Tensor) -> anyhow::Result<Tensor> {
    let t = match h {
        Host::F32(v) => Tensor::from_vec(v, dims, like.device())?,
        Host::F64(v) => Tensor::from_vec(v, dims, like.device())?,
    };
    Ok(if t.dtype() == dtype { t } else { t.to_dtype(dtype)? })
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        let (h, dtype) = to_host(t)?;
        let _g = self.guard();
        let out = match h {
            Host::F32(v) => {
                let mut r = vec![0f32; v.len()];
                self.comm.all_reduce_into(&v[..], &mut r[..], op_of(op));
                Host::F32(r)
            }
            Host::F64(v) => {
                let mut r = vec![0f64; v.len()];
                self.comm.all_reduce_into(&v[..], &mut r[..], op_of(op));
                Host::F64(r)
            }
        };
        drop(_g);
        finish_mean(from_host(out, t.dims(), dtype, t)?, op, self.world)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> anyhow::Result<Tensor> {
        anyhow::ensure!(root < self.world, "broadcast from rank {root} in a world of {}", self.world);
        let (h, dtype) = to_host(t)?;
        let _g = self.guard();
        let root = self.comm.process_at_rank(root as i32);
        let out = match h {
            Host::F32(mut v) => {
                root.broadcast_into(&mut v[..]);
                Host::F32(v)
            }
            Host::F64(mut v) => {
                root.broadcast_into(&mut v[..]);
                Host::F64(v)
            }
        };
        drop(_g);
        from_host(out, t.dims(), dtype, t)
    }

    fn all_gather(&self, t: &Tensor) -> anyhow::Result<Tensor> {
        let (h, dtype) = to_host(t)?;
        let mut dims = vec![self.world];
        dims.extend_from_slice(t.dims());
        let _g = self.guard();
        let out = match h {
            Host::F32(v) => {
                let mut r = vec![0f32; v.len() * self.world];
                self.comm.all_gather_into(&v[..], &mut r[..]);
                Host::F32(r)
            }
            Host::F64(v) => {
                let mut r = vec![0f64; v.len() * self.world];
                self.comm.all_gather_into(&v[..], &mut r[..]);
                Host::F64(r)
            }
        };
        drop(_g);
        from_host(out, &dims, dtype, t)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        let first = t.dims().first().copied().unwrap_or(0);
        anyhow::ensure!(
            first > 0 && first % self.world == 0,
            "reduce-scatter of a tensor of shape {:?}: its first dimension must split into {} ranks",
            t.dims(),
            self.world
        );
        let mut dims = t.dims().to_vec();
        dims[0] = first / self.world;
        let (h, dtype) = to_host(t)?;
        let _g = self.guard();
        let out = match h {
            Host::F32(v) => {
                let mut r = vec![0f32; v.len() / self.world];
                self.comm.reduce_scatter_block_into(&v[..], &mut r[..], op_of(op));
                Host::F32(r)
            }
            Host::F64(v) => {
                let mut r = vec![0f64; v.len() / self.world];
                self.comm.reduce_scatter_block_into(&v[..], &mut r[..], op_of(op));
                Host::F64(r)
            }
        };
        drop(_g);
        finish_mean(from_host(out, &dims, dtype, t)?, op, self.world)
    }

    fn barrier(&self) -> anyhow::Result<()> {
        let _g = self.guard();
        self.comm.barrier();
        Ok(())
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> anyhow::Result<Vec<f64>> {
        let mut r = vec![0f64; values.len()];
        {
            let _g = self.guard();
            self.comm.all_reduce_into(values, &mut r[..], op_of(op));
        }
        if op == ReduceOp::Mean {
            r.iter_mut().for_each(|x| *x /= self.world as f64);
        }
        Ok(r)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<Vec<u8>>> {
        let _g = self.guard();
        let mut lens = vec![0u64; self.world];
        self.comm.all_gather_into(&(bytes.len() as u64), &mut lens[..]);
        let width = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = bytes.to_vec();
        padded.resize(width, 0);
        let mut all = vec![0u8; width * self.world];
        self.comm.all_gather_into(&padded[..], &mut all[..]);
        Ok(lens.iter().enumerate().map(|(r, &n)| all[r * width..r * width + n as usize].to_vec()).collect())
    }

    fn abort(&self, code: i32) {
        // No lock: a thread may be stuck inside a collective holding it.
        self.comm.abort(code)
    }

    fn finish(&self) {
        let _g = self.guard();
        drop(self.universe.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

/// Divides `t` by the world size for [`ReduceOp::Mean`] (after a sum).
fn finish_mean(t: Tensor, op: ReduceOp, world: usize) -> anyhow::Result<Tensor> {
    Ok(if op == ReduceOp::Mean && world > 1 { t.affine(1.0 / world as f64, 0.0)? } else { t })
}
