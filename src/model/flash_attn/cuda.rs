//! Flash attention's op and kernel launches (`kernels/flash_attn.cu`, `kernels/flash_mma.cu`):
//! one kernel computes the output and each query row's log-sum-exp, the backward pass
//! recomputes the probabilities tile by tile (dk/dv and dq in two deterministic kernels). When
//! it runs is decided in the parent module, [`super`].

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, bail};

use super::{FlashKernels, HEAD_DIM, TILE};

/// The PTX of kernels/flash_attn.cu (the WMMA kernels and delta).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn.ptx"));
/// The name the module is cached under in candle's device.
const MODULE: &str = "pipeline-flash-attn";
/// The PTX of kernels/flash_mma.cu (the register-fragment kernels).
const PTX_MMA: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_mma.ptx"));
const MODULE_MMA: &str = "pipeline-flash-mma";
/// Threads per block of the tile kernels (four warps of 16 rows).
const THREADS: u32 = 128;

/// Where an implementation's forward, dk/dv and dq kernels are, and their names; both take
/// the same arguments on the same grids.
struct Kernels {
    module: &'static str,
    ptx: &'static str,
    fwd: &'static str,
    dkdv: &'static str,
    dq: &'static str,
}

/// The kernels of `k`, or with `docs` flash_mma's document entry points (the same arguments and
/// grids, then the segment starts).
fn kernels(k: FlashKernels, docs: bool) -> Kernels {
    if docs {
        return Kernels {
            module: MODULE_MMA,
            ptx: PTX_MMA,
            fwd: "flash_fwd_mma_docs_bf16",
            dkdv: "flash_bwd_dkdv_mma_docs_bf16",
            dq: "flash_bwd_dq_mma_docs_bf16",
        };
    }
    match k {
        FlashKernels::Wmma => {
            Kernels { module: MODULE, ptx: PTX, fwd: "flash_fwd_bf16", dkdv: "flash_bwd_dkdv_bf16", dq: "flash_bwd_dq_bf16" }
        }
        // cuDNN's fallback (`apply` runs cuDNN itself where it can).
        FlashKernels::Mma | FlashKernels::Cudnn => Kernels {
            module: MODULE_MMA,
            ptx: PTX_MMA,
            fwd: "flash_fwd_mma_bf16",
            dkdv: "flash_bwd_dkdv_mma_bf16",
            dq: "flash_bwd_dq_mma_bf16",
        },
    }
}

/// Flash attention of token-major `q`, `k`, `v` (see [`crate::model::flash_attn::flash_attention`]).
/// With `starts` (each position's segment start, `u32` on the device) the kernels are
/// flash_mma's document entry points.
#[allow(clippy::too_many_arguments)]
pub fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    kernels: FlashKernels,
    starts: Option<Tensor>,
) -> Result<Tensor> {
    if starts.is_some() && kernels == FlashKernels::Wmma {
        bail!("flash attention: only the flash_mma kernels take document segments");
    }
    let op = FlashAttention { batch, heads, kv_heads, kernels, starts, lse: Mutex::new(None) };
    aligned(q)?.apply_op3(&aligned(k)?, &aligned(v)?, op)
}

/// `x` contiguous from a 16-element boundary (the kernels load 32-byte fragments).
fn aligned(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    if x.layout().start_offset() % 16 == 0 { Ok(x) } else { x.copy() }
}

struct FlashAttention {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    kernels: FlashKernels,
    /// Each position's segment start (`u32`, `(B*T,)` on the device): the document kernels.
    starts: Option<Tensor>,
    /// The forward pass's base-2 log-sum-exp per query row, `(B*H, T)` f32, for the
    /// backward pass.
    lse: Mutex<Option<Tensor>>,
}

impl FlashAttention {
    fn t(&self, n: usize) -> usize {
        n / self.batch
    }
}

/// Scores are scaled by 1/sqrt(64); the kernels work in base 2.
fn scales() -> (f32, f32) {
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    (scale * std::f32::consts::LOG2_E, scale)
}

/// The kernels read every input as dense rows.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    if !l.is_contiguous() {
        bail!("flash attention: input is not contiguous, layout {l:?}");
    }
    crate::model::cuda::fused::view(s, l)
}

fn cuda(t: &Tensor) -> Result<(candle_core::StorageRef<'_>, &Layout)> {
    let (s, l) = t.storage_and_layout();
    if !matches!(&*s, Storage::Cuda(_)) {
        bail!("flash attention: a tensor is not on the GPU");
    }
    Ok((s, l))
}

fn storage<'a>(s: &'a candle_core::StorageRef<'_>) -> &'a CudaStorage {
    match &**s {
        Storage::Cuda(c) => c,
        _ => unreachable!("checked by `cuda`"),
    }
}

fn dims(what: &str, n: usize, t: usize, heads: usize) -> Result<(i32, i32, u32, u32)> {
    let int = |x: usize| i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("flash attention: {what} {x} too large")));
    let b = n / t;
    let grid_y = u32::try_from(b * heads).ok().filter(|&y| y <= 65_535);
    let Some(grid_y) = grid_y else { bail!("flash attention: {b} rows x {heads} heads exceed the grid") };
    Ok((int(t)?, int(heads)?, (t / TILE) as u32, grid_y))
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("flash attention runs on CUDA only; on the CPU the model uses the fused attention")
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
        if qs.dtype() != DType::BF16 {
            bail!("flash attention runs in bf16, got {:?}", qs.dtype());
        }
        let (n, width) = ql.shape().dims2()?;
        let t = self.t(n);
        let (t_arg, heads_arg, grid_x, grid_y) = dims("sequence", n, t, self.heads)?;
        let kv_arg = self.kv_heads as i32;
        let dev = qs.device().clone();
        let (q, k, v) = (view::<half::bf16>(qs, ql)?, view::<half::bf16>(ks, kl)?, view::<half::bf16>(vs, vl)?);
        // SAFETY: the kernel writes every element of o (each warp its 16 rows of 64) and lse.
        let o = unsafe { dev.alloc::<half::bf16>(n * width)? };
        let lse = unsafe { dev.alloc::<f32>(n * self.heads)? };
        let ks = kernels(self.kernels, self.starts.is_some());
        let func = dev.get_or_load_custom_func(ks.fwd, ks.module, ks.ptx)?;
        let cfg = LaunchConfig { grid_dim: (grid_x, grid_y, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let (scale_log2, _) = scales();
        let starts = self.starts.as_ref().map(cuda).transpose()?;
        let sv = match &starts {
            Some((s, l)) => Some(view::<u32>(storage(s), l)?),
            None => None,
        };
        let mut b = func.builder();
        b.arg(&q).arg(&k).arg(&v).arg(&o).arg(&lse).arg(&t_arg).arg(&heads_arg).arg(&kv_arg).arg(&scale_log2);
        if let Some(sv) = &sv {
            b.arg(sv);
        }
        // SAFETY: the signature is (const bf16* q, k, v, bf16* o, float* lse, int t, int heads,
        // int kv_heads, float scale_log2[, const unsigned* starts]); shapes were checked by
        // `flash_attention` (and the starts, one per position, by `flash_attention_docs`).
        unsafe { b.launch(cfg) }.w()?;
        let lse = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone())),
            (self.batch * self.heads, t),
            BackpropOp::none(),
            false,
        );
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((CudaStorage::wrap_cuda_slice(o, dev), ql.shape().clone()))
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(lse) = lse else { bail!("flash attention: backward pass before the forward pass") };
        let go = aligned(&go.to_dtype(DType::BF16)?)?;
        let (dq, dk, dv) = backward(self, q, k, v, o, &go, &lse)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

fn backward(
    op: &FlashAttention,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    go: &Tensor,
    lse: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, width) = q.dims2()?;
    let kv_width = k.dims2()?.1;
    let t = op.t(n);
    let (t_arg, heads_arg, grid_x, grid_y) = dims("sequence", n, t, op.heads)?;
    let kv_arg = op.kv_heads as i32;
    let (scale_log2, scale) = scales();
    let (qs, ql) = cuda(q)?;
    let (ks, kl) = cuda(k)?;
    let (vs, vl) = cuda(v)?;
    let (os, ol) = cuda(o)?;
    let (gs, gl) = cuda(go)?;
    let (ls, ll) = cuda(lse)?;
    let dev = storage(&qs).device().clone();
    let bf16 = |s, l| view::<half::bf16>(storage(s), l);
    let (qv, kv, vv, ov, gv) = (bf16(&qs, ql)?, bf16(&ks, kl)?, bf16(&vs, vl)?, bf16(&os, ol)?, bf16(&gs, gl)?);
    let lv = view::<f32>(storage(&ls), ll)?;
    let starts = op.starts.as_ref().map(cuda).transpose()?;
    let sv = match &starts {
        Some((s, l)) => Some(view::<u32>(storage(s), l)?),
        None => None,
    };

    // delta = rowsum(o * go) per (token, head): one warp per row, eight per block.
    let rows = n * op.heads;
    // SAFETY: every element is written (one warp per row).
    let delta = unsafe { dev.alloc::<f32>(rows)? };
    let func = dev.get_or_load_custom_func("flash_delta_bf16", MODULE, PTX)?;
    let cfg = LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let rows_arg = rows as i64;
    let mut b = func.builder();
    b.arg(&ov).arg(&gv).arg(&delta).arg(&rows_arg).arg(&t_arg).arg(&heads_arg);
    // SAFETY: (const bf16* o, const bf16* go, float* delta, long rows, int t, int heads).
    unsafe { b.launch(cfg) }.w()?;

    // SAFETY: each kernel writes every element of its outputs (every row of every head).
    let dk = unsafe { dev.alloc::<half::bf16>(n * kv_width)? };
    let dv = unsafe { dev.alloc::<half::bf16>(n * kv_width)? };
    let dq = unsafe { dev.alloc::<half::bf16>(n * width)? };
    let kv_grid = u32::try_from((n / t) * op.kv_heads).map_err(|_| candle_core::Error::Msg("flash attention: grid".into()))?;
    let ks = kernels(op.kernels, sv.is_some());
    let func = dev.get_or_load_custom_func(ks.dkdv, ks.module, ks.ptx)?;
    let cfg = LaunchConfig { grid_dim: (grid_x, kv_grid, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&delta).arg(&dk).arg(&dv);
    b.arg(&t_arg).arg(&heads_arg).arg(&kv_arg).arg(&scale_log2).arg(&scale);
    if let Some(sv) = &sv {
        b.arg(sv);
    }
    // SAFETY: (q, k, v, go, lse2, delta, dk, dv, int t, int heads, int kv_heads, float, float
    // [, const unsigned* starts]).
    unsafe { b.launch(cfg) }.w()?;
    let func = dev.get_or_load_custom_func(ks.dq, ks.module, ks.ptx)?;
    let cfg = LaunchConfig { grid_dim: (grid_x, grid_y, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    b.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&delta).arg(&dq);
    b.arg(&t_arg).arg(&heads_arg).arg(&kv_arg).arg(&scale_log2).arg(&scale);
    if let Some(sv) = &sv {
        b.arg(sv);
    }
    // SAFETY: (q, k, v, go, lse2, delta, dq, int t, int heads, int kv_heads, float, float
    // [, const unsigned* starts]).
    unsafe { b.launch(cfg) }.w()?;

    let wrap = |s, shape: (usize, usize)| {
        Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())), shape, BackpropOp::none(), false)
    };
    Ok((wrap(dq, (n, width)), wrap(dk, (n, kv_width)), wrap(dv, (n, kv_width))))
}
