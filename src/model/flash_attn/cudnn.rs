//! cuDNN's fused flash attention as a candle op (`attention = "cudnn"` on the candle path;
//! `cuda` builds): the graphs of [`crate::device::cudnn`] (one cache per GPU, on candle's
//! stream), token-major `(B*T, H*D)` bf16 operands as they are, each query's log-sum-exp kept
//! from the forward pass for the backward. Under a document mask the graphs are cuDNN's ragged
//! ones, packed as the engine packs them (`t` slots a row: its documents, then empty ones),
//! uploaded from the mask, which the host holds.
//!
//! [`apply`] answers `Ok(None)` where cuDNN cannot run (no libcudnn, or a shape it refuses):
//! the caller says so once and runs the flash_mma kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, bail};

use crate::device::cudnn::ffi::Cudnn;
use crate::device::cudnn::{SdpaCache, SdpaDesc, SdpaPtrs, causal_descs, packed_slots};
use crate::model::ops::DocumentMask;

/// The graph caches, one per GPU (by ordinal), or why cuDNN cannot run there.
type Caches = HashMap<usize, std::result::Result<SdpaCache<Cudnn>, String>>;

fn caches() -> &'static Mutex<Caches> {
    static CACHES: OnceLock<Mutex<Caches>> = OnceLock::new();
    CACHES.get_or_init(Default::default)
}

/// Runs `f` on the cache of `stream`'s GPU, made at the first call.
fn with_cache<R>(stream: &Arc<CudaStream>, f: impl FnOnce(&mut SdpaCache<Cudnn>) -> anyhow::Result<R>) -> anyhow::Result<R> {
    let mut all = caches().lock().unwrap_or_else(|e| e.into_inner());
    let ordinal = stream.context().ordinal();
    let entry = all.entry(ordinal).or_insert_with(|| Cudnn::new(stream.clone()).map(SdpaCache::new).map_err(|e| format!("{e:#}")));
    match entry {
        Ok(cache) => f(cache),
        Err(why) => anyhow::bail!("{why}"),
    }
}

/// The descriptors of `batch` rows of `t` (a slot per position with `docs`), every tensor
/// packed token-major.
fn descs(batch: usize, t: usize, heads: usize, kv_heads: usize, d: usize, docs: bool) -> (SdpaDesc, SdpaDesc) {
    causal_descs(batch, t, heads, kv_heads, d, docs, [heads * d, kv_heads * d, kv_heads * d])
}

/// See [`super::cudnn_unavailable`].
pub fn unavailable(
    device: &candle_core::Device,
    batch: usize,
    t: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    docs: bool,
) -> Option<String> {
    let candle_core::Device::Cuda(dev) = device else { return Some("cuDNN runs on CUDA devices only".into()) };
    let (fwd, bwd) = descs(batch, t, heads, kv_heads, d, docs);
    with_cache(&dev.cuda_stream(), |c| c.prepare(&fwd).and_then(|_| c.prepare(&bwd))).err().map(|e| format!("{e:#}"))
}

/// A document mask's ragged arrays on the device: each position's document length, and the
/// offsets for rows of q (and o), of k and v, and of the statistics (`i32`).
struct Ragged {
    lens: Tensor,
    off_q: Tensor,
    off_kv: Tensor,
    off_stats: Tensor,
}

impl Ragged {
    fn new(docs: &DocumentMask, heads: usize, kv_heads: usize, d: usize, device: &candle_core::Device) -> Result<Self> {
        let (rows, t) = (docs.rows(), docs.t());
        let n = rows * t;
        let segments: Vec<Vec<(usize, usize)>> = (0..rows).map(|b| docs.segments(b)).collect();
        let (lens, starts) = packed_slots(t, &segments);
        let offsets = |unit: usize| -> Result<Tensor> {
            if (n * unit) > i32::MAX as usize {
                bail!("cuDNN attention: ragged offsets of {n} positions of {unit} elements overflow int32");
            }
            Tensor::from_vec(starts.iter().map(|&p| p * unit as u32).collect::<Vec<_>>(), n + 1, device)
        };
        Ok(Ragged {
            lens: Tensor::from_vec(lens, n, device)?,
            off_q: offsets(heads * d)?,
            off_kv: offsets(kv_heads * d)?,
            off_stats: offsets(heads)?,
        })
    }
}

/// cuDNN attention of token-major `q` `(B*T, H*D)`, `k` and `v` `(B*T, K*D)` (bf16, on a GPU),
/// within `docs`' documents if given; `Ok(None)` (nothing run) where cuDNN cannot run here, with
/// the reason for the caller's one line.
pub fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    docs: Option<&DocumentMask>,
) -> Result<std::result::Result<Tensor, String>> {
    let (n, width) = q.dims2()?;
    let (t, d) = (n / batch, width / heads);
    let candle_core::Device::Cuda(dev) = q.device() else { bail!("cuDNN attention: q is not on a GPU") };
    let stream = dev.cuda_stream();
    let (fwd, bwd) = descs(batch, t, heads, kv_heads, d, docs.is_some());
    if let Err(e) = with_cache(&stream, |c| c.prepare(&fwd).and_then(|_| c.prepare(&bwd))) {
        return Ok(Err(format!("{e:#}")));
    }
    let ragged = docs.map(|m| Ragged::new(m, heads, kv_heads, d, q.device())).transpose()?;
    let op = CudnnAttention { fwd, bwd, ragged, stats: Mutex::new(None) };
    let c = |x: &Tensor| x.contiguous();
    Ok(Ok(c(q)?.apply_op3(&c(k)?, &c(v)?, op)?))
}

struct CudnnAttention {
    fwd: SdpaDesc,
    bwd: SdpaDesc,
    ragged: Option<Ragged>,
    /// The forward's statistics `(B*T, H)` f32, for the backward pass.
    stats: Mutex<Option<Tensor>>,
}

/// The device address of a contiguous tensor's first element.
fn address(t: &Tensor, stream: &Arc<CudaStream>) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(c) = &*s else { bail!("cuDNN attention: a tensor is not on the GPU") };
    storage_address(c, l, stream)
}

fn storage_address(c: &CudaStorage, l: &Layout, stream: &Arc<CudaStream>) -> Result<u64> {
    if !l.is_contiguous() {
        bail!("cuDNN attention: an operand is not contiguous ({l:?})");
    }
    let bytes = c.dtype().size_in_bytes() as u64;
    let base = match c.dtype() {
        DType::BF16 => c.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0,
        DType::F32 => c.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        DType::U32 => c.as_cuda_slice::<u32>()?.device_ptr(stream).0,
        other => bail!("cuDNN attention: an operand of {other:?}"),
    };
    Ok(base + l.start_offset() as u64 * bytes)
}

impl CudnnAttention {
    /// The ragged arrays' addresses into `p`.
    fn ragged_ptrs(&self, p: &mut SdpaPtrs, stream: &Arc<CudaStream>) -> Result<()> {
        if let Some(r) = &self.ragged {
            p.seq_len = address(&r.lens, stream)?;
            (p.off_q, p.off_o, p.off_dq) = (address(&r.off_q, stream)?, address(&r.off_q, stream)?, address(&r.off_q, stream)?);
            let kv = address(&r.off_kv, stream)?;
            (p.off_k, p.off_v, p.off_dk, p.off_dv) = (kv, kv, kv, kv);
            p.off_stats = address(&r.off_stats, stream)?;
        }
        Ok(())
    }
}

impl CustomOp3 for CudnnAttention {
    fn name(&self) -> &'static str {
        "cudnn-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("cuDNN attention runs on CUDA only; on the CPU the model uses the fused attention")
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
        vs: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if qs.dtype() != DType::BF16 || ks.dtype() != DType::BF16 || vs.dtype() != DType::BF16 {
            bail!("cuDNN attention runs in bf16, got {:?}", qs.dtype());
        }
        let dev = qs.device().clone();
        let stream = dev.cuda_stream();
        let (n, width) = ql.shape().dims2()?;
        // SAFETY: cuDNN writes every element of o and of the statistics (every query of every head).
        let o = unsafe { dev.alloc::<half::bf16>(n * width)? };
        let stats = unsafe { dev.alloc::<f32>(n * self.fwd.h)? };
        let mut p = SdpaPtrs {
            q: storage_address(qs, ql, &stream)?,
            k: storage_address(ks, kl, &stream)?,
            v: storage_address(vs, vl, &stream)?,
            o: o.device_ptr(&stream).0,
            stats: stats.device_ptr(&stream).0,
            ..Default::default()
        };
        self.ragged_ptrs(&mut p, &stream)?;
        with_cache(&stream, |c| c.execute(&self.fwd, &p)).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        let stats = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(stats, dev.clone())),
            (n, self.fwd.h),
            BackpropOp::none(),
            false,
        );
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(stats);
        Ok((CudaStorage::wrap_cuda_slice(o, dev), ql.shape().clone()))
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(stats) = stats else { bail!("cuDNN attention: backward pass before the forward pass") };
        let go = go.to_dtype(DType::BF16)?.contiguous()?;
        let candle_core::Device::Cuda(dev) = q.device() else { bail!("cuDNN attention: q is not on a GPU") };
        let stream = dev.cuda_stream();
        let (dq, dk, dv) = (q.zeros_like()?, k.zeros_like()?, v.zeros_like()?);
        let mut p = SdpaPtrs {
            q: address(q, &stream)?,
            k: address(k, &stream)?,
            v: address(v, &stream)?,
            o: address(o, &stream)?,
            dout: address(&go, &stream)?,
            dq: address(&dq, &stream)?,
            dk: address(&dk, &stream)?,
            dv: address(&dv, &stream)?,
            stats: address(&stats, &stream)?,
            ..Default::default()
        };
        self.ragged_ptrs(&mut p, &stream)?;
        with_cache(&stream, |c| c.execute(&self.bwd, &p)).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
