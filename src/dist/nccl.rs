//! GPU ranks over NCCL (feature `cuda`), through cudarc's bindings (libnccl loaded at run time).
//! One communicator per process on the model's device and compute stream, so a collective is
//! ordered with the kernels around it and no host synchronisation is added. The communicator's
//! unique id comes from rank 0: `pipeline launch` makes it and hands it to every rank in
//! `LAUNCH_NCCL_ID` (hex, [`super::NCCL_ID_VAR`]), or, in a binary with the `mpi` feature started by `mpirun`/`srun`,
//! rank 0 broadcasts it over MPI. No other transport carries it.
//!
//! Each operation is a candle custom op run without a gradient: it reads the input's device
//! slice and returns a new tensor on the same stream.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::{Collective, ReduceOp};

use super::NCCL_ID_VAR as ID_VAR;

/// Errors, naming the fix, when libnccl cannot be opened: cudarc loads `libnccl.so` at its
/// first call and panics where it finds none (PyTorch's wheels carry only `libnccl.so.2`).
pub fn ensure_lib() -> anyhow::Result<()> {
    // SAFETY: opening NCCL runs no initialiser with requirements of its own.
    match unsafe { libloading::Library::new("libnccl.so") } {
        Ok(_) => Ok(()),
        Err(e) => anyhow::bail!(
            "NCCL cannot be loaded ({e}): put libnccl.so on LD_LIBRARY_PATH (with only libnccl.so.2, as in PyTorch's nvidia/nccl/lib, add a link libnccl.so -> libnccl.so.2)"
        ),
    }
}

/// A new unique id as hex, for `pipeline launch` to hand to every rank.
pub fn new_id_hex() -> anyhow::Result<String> {
    ensure_lib()?;
    let id = Id::new().map_err(|e| anyhow::anyhow!("ncclGetUniqueId failed: {e:?} (is libnccl.so.2 on the library path?)"))?;
    Ok(id.internal().iter().map(|&c| format!("{:02x}", c as u8)).collect())
}

/// Reads an id written by [`new_id_hex`].
pub fn id_from_hex(hex: &str) -> anyhow::Result<Id> {
    anyhow::ensure!(hex.len() == 256, "{ID_VAR} must be 256 hex digits (NCCL's 128-byte unique id), found {} characters", hex.len());
    let mut internal = [0 as std::ffi::c_char; 128];
    for (i, c) in internal.iter_mut().enumerate() {
        let byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| anyhow::anyhow!("{ID_VAR} is not hex"))?;
        *c = byte as std::ffi::c_char;
    }
    Ok(Id::uninit(internal))
}

/// A communicator the custom ops share.
struct Shared(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap: it is only reached through a mutex.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// The NCCL communicator of this process.
pub struct Nccl {
    comm: Arc<Mutex<Shared>>,
    device: Device,
    rank: usize,
    world: usize,
}

impl Nccl {
    /// Joins the communicator `id` names as `rank` of `world`, on `device`'s compute stream
    /// (every rank must call it; it returns once all have).
    pub fn init(device: &Device, rank: usize, world: usize, id: Id) -> anyhow::Result<Self> {
        let Device::Cuda(d) = device else { anyhow::bail!("NCCL ranks need a CUDA device, not {device:?}") };
        ensure_lib()?;
        let comm = Comm::from_rank(d.cuda_stream(), rank, world, id)
            .map_err(|e| anyhow::anyhow!("ncclCommInitRank (rank {rank} of {world}) failed: {e:?}"))?;
        Ok(Self { comm: Arc::new(Mutex::new(Shared(comm))), device: device.clone(), rank, world })
    }

    fn run(&self, t: &Tensor, kind: Kind) -> anyhow::Result<Tensor> {
        let op = Op { comm: self.comm.clone(), kind, world: self.world };
        Ok(t.contiguous()?.apply_op1_no_bwd(&op)?)
    }
}

#[derive(Clone, Copy)]
enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
}

struct Op {
    comm: Arc<Mutex<Shared>>,
    kind: Kind,
    world: usize,
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Mean => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
    }
}

impl Op {
    fn out_shape(&self, shape: &Shape) -> candle_core::Result<Shape> {
        let dims = shape.dims();
        Ok(match self.kind {
            Kind::AllReduce(_) | Kind::Broadcast(_) => shape.clone(),
            Kind::AllGather => {
                let mut d = vec![self.world];
                d.extend_from_slice(dims);
                Shape::from(d)
            }
            Kind::ReduceScatter(_) => {
                let first = dims.first().copied().unwrap_or(0);
                if first == 0 || first % self.world != 0 {
                    candle_core::bail!("reduce-scatter of shape {dims:?}: the first dimension must split into {} ranks", self.world)
                }
                let mut d = dims.to_vec();
                d[0] = first / self.world;
                Shape::from(d)
            }
        })
    }

    fn go<T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits>(
        &self,
        s: &CudaStorage,
        l: &Layout,
        out: &Shape,
    ) -> candle_core::Result<CudaStorage> {
        let (start, end) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("NCCL: input not contiguous".into()))?;
        let src: CudaView<'_, T> = s.as_cuda_slice::<T>()?.slice(start..end);
        let dev = s.device().clone();
        let mut dst: CudaSlice<T> = dev.alloc_zeros::<T>(out.elem_count())?;
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let comm = &guard.0;
        let r = match self.kind {
            Kind::AllReduce(op) => comm.all_reduce(&src, &mut dst, &nccl_op(op)),
            Kind::Broadcast(root) => comm.broadcast(Some(&src), &mut dst, root as i32),
            Kind::AllGather => comm.all_gather(&src, &mut dst),
            Kind::ReduceScatter(op) => comm.reduce_scatter(&src, &mut dst, &nccl_op(op)),
        };
        r.map_err(|e| candle_core::Error::Msg(format!("NCCL collective failed: {e:?}")))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for Op {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives take CUDA tensors; CPU ranks use the `mpi` backend")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = self.out_shape(l.shape())?;
        let r = match s.dtype() {
            DType::F32 => self.go::<f32>(s, l, &out)?,
            DType::F64 => self.go::<f64>(s, l, &out)?,
            DType::BF16 => self.go::<half::bf16>(s, l, &out)?,
            DType::U8 => self.go::<u8>(s, l, &out)?,
            d => candle_core::bail!("NCCL collectives here take f32, f64, bf16 or u8, not {d:?}"),
        };
        Ok((r, out))
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        self.run(t, Kind::AllReduce(op))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> anyhow::Result<Tensor> {
        anyhow::ensure!(root < self.world, "broadcast from rank {root} in a world of {}", self.world);
        self.run(t, Kind::Broadcast(root))
    }

    fn all_gather(&self, t: &Tensor) -> anyhow::Result<Tensor> {
        self.run(t, Kind::AllGather)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        self.run(t, Kind::ReduceScatter(op))
    }

    fn barrier(&self) -> anyhow::Result<()> {
        // NCCL has no barrier: an all-reduce of one value, waited for.
        let one = Tensor::ones(1, DType::F32, &self.device)?;
        self.all_reduce(&one, ReduceOp::Sum)?.to_vec1::<f32>()?;
        Ok(())
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> anyhow::Result<Vec<f64>> {
        let t = Tensor::from_slice(values, values.len(), &self.device)?;
        Ok(self.all_reduce(&t, op)?.to_vec1::<f64>()?)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<Vec<u8>>> {
        let lens = self.all_reduce_host(&[bytes.len() as f64], ReduceOp::Max)?;
        let width = lens[0] as usize;
        let mut padded = Vec::with_capacity(width + 8);
        padded.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        padded.extend_from_slice(bytes);
        padded.resize(width + 8, 0);
        let t = Tensor::from_vec(padded, width + 8, &self.device)?;
        let all = self.all_gather(&t)?.to_vec2::<u8>()?;
        Ok(all
            .into_iter()
            .map(|row| {
                let n = u64::from_le_bytes(row[..8].try_into().expect("8 bytes")) as usize;
                row[8..8 + n].to_vec()
            })
            .collect())
    }

    fn abort(&self, _code: i32) {
        // Nothing to end from here: `pipeline launch` stops the other ranks when one exits with
        // an error, and the process exits right after this call.
    }
}
