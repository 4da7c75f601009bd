//! The CUDA [`Device`] (`cuda` builds): the four memory spaces as four device allocations made
//! once (static addresses, what CUDA graph replay needs), launches of `kernels/engine.cu` and
//! `kernels/flash_mma.cu` (PTX compiled by build.rs) on one stream, and GEMM plans through
//! `cublasLtMatmul` with the descriptors and the heuristic's algorithm cached per plan shape.
//! A unit of work is captured from the stream into a CUDA graph (`cuStreamBeginCapture` in
//! thread-local mode, so the other stages' threads keep allocating) and replayed with
//! `cuGraphLaunch`; every address it holds is static, and the values that change between
//! replays live in device memory (see [`super`]).
//!
//! **Streams.** The engine runs on a stream of its own, made non-blocking in the context the
//! rest of the program shares (candle's, [`crate::device::open`]): not the legacy NULL stream,
//! on which `cuStreamBeginCapture` is refused (every capture would fail and every unit run op by
//! op), and not candle's stream, where the other stages' threads queue work that a capture
//! would swallow. What crosses between the two is ordered by CUDA events, never a host wait:
//! a micro-batch's token tensors are copied device to device after candle's stream has made
//! them, and candle's stream waits for that copy before it can free them
//! ([`Device::write_tensor`]); the weights go out device to device into fresh tensors on
//! candle's stream after the engine's step, and the engine's stream waits for that copy before
//! its next step overwrites them ([`Device::tensor`]).
//!
//! **Alignment.** Each plan's cache key and heuristic preferences carry the real alignment of
//! its A, B and C addresses (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`, [`LtPlan::alignments`]):
//! the arena's regions start on 256 bytes ([`crate::engine::layout::ALIGN`]), but a view such
//! as the key columns of the fused qkv product can start anywhere, and an algorithm chosen for
//! 256-byte alignment may load 16 bytes at a time from it.
//!
//! GEMM maths: on bf16 operands (bf16 activations, the weights' bf16 copy) `CUBLAS_COMPUTE_32F`,
//! bf16 products with f32 accumulation into a bf16 or f32 C. On f32 operands
//! [`GemmMath::Bf16`] (the default) multiplies on the bf16 tensor cores with f32 accumulation
//! (`CUBLAS_COMPUTE_32F_FAST_16BF`, cuBLAS rounds the inputs); `Tf32` and `F32` trade speed for
//! precision (parity checks). Weight gradients accumulate in f32 across micro-batches with
//! `beta = 1` in every case.
//!
//! **cuDNN** (`attention = "cudnn"`, [`super::SdpaCall`]): a handle on the engine's stream,
//! made at the first attention call that asks for it; each graph is built (and the workspace
//! grown) when the backend prepares a call, before it is queued, so nothing of the build runs
//! under a capture: a captured call is cuDNN's kernels on the engine's stream with static
//! addresses, as a launch is. Not yet run on a GPU: whether cuDNN's execute keeps to that (no
//! allocation, no synchronisation) under `cuStreamBeginCapture` is the first thing to check.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt_result, sys as lt_sys};
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg, result as cu_result, sys as cu_sys,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;

use super::{Arg, Device, Launch, SdpaCall, Sizes, Space, Work};
use crate::device::cudnn::ffi::Cudnn;
use crate::device::cudnn::{SdpaCache, SdpaDesc};
use crate::engine::lt::{LtLayout, LtOp, LtPlan};

/// The PTX of kernels/engine.cu.
const ENGINE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/engine.ptx"));
/// The PTX of kernels/engine.cu with bf16 activations (`-DENGINE_ACT_BF16`).
const ENGINE_BF16_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/engine_bf16.ptx"));
/// The PTX of kernels/flash_mma.cu.
const FLASH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_mma.ptx"));
/// cuBLASLt's workspace ([`super::LT_WORKSPACE`]).
const WORKSPACE: usize = super::LT_WORKSPACE;

/// The tensor-core maths of the GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GemmMath {
    /// bf16 products, f32 accumulation (`CUBLAS_COMPUTE_32F_FAST_16BF`).
    #[default]
    Bf16,
    /// TF32 products (`CUBLAS_COMPUTE_32F_FAST_TF32`).
    Tf32,
    /// Full f32 (`CUBLAS_COMPUTE_32F`).
    F32,
}

/// A plan's shape: what its descriptors and algorithm depend on (not its addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ShapeKey {
    ops: (bool, bool),
    /// Whether A, B and C are bf16 (else f32).
    bf16: [bool; 3],
    layouts: [(u64, u64, i64); 3],
    batch: (u32, i64, i64, i64),
    reads_c: bool,
    /// The alignment in bytes of A, B and C that the algorithm was chosen for.
    align: [u32; 3],
}

impl ShapeKey {
    /// `p`'s key with A, B and C in spaces starting at the byte addresses `bases`.
    fn of(p: &LtPlan, spaces: [Space; 3], bases: [u64; 3]) -> Self {
        let l = |x: LtLayout| (x.rows, x.cols, x.ld);
        ShapeKey {
            ops: (p.trans_a == LtOp::T, p.trans_b == LtOp::T),
            bf16: spaces.map(Space::is_bf16),
            layouts: [l(p.a), l(p.b), l(p.c)],
            batch: (p.batch, p.stride_a, p.stride_b, p.stride_c),
            reads_c: p.beta != 0.0,
            align: p.alignments_in(bases, spaces.map(Space::elem_bytes)),
        }
    }
}

/// The cached descriptors of one plan shape.
struct Prepared {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host objects of cuBLASLt, used under the device's lock.
unsafe impl Send for Prepared {}

/// cuBLASLt's handle, workspace and plan cache.
struct Lt {
    handle: lt_sys::cublasLtHandle_t,
    /// Owns the memory `workspace_ptr` points into.
    _workspace: CudaSlice<u8>,
    /// The workspace's address, taken once (no stream bookkeeping while a graph is captured).
    workspace_ptr: u64,
    math: GemmMath,
    cache: HashMap<ShapeKey, Prepared>,
}

// SAFETY: the handle is used only under the device's lock, on its one stream.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        for p in self.cache.values() {
            // SAFETY: created by this cache and used by no pending call (the stream is synced
            // when the device drops its allocations).
            unsafe {
                let _ = lt_result::destroy_matmul_desc(p.desc);
                for l in p.layouts {
                    let _ = lt_result::destroy_matrix_layout(l);
                }
            }
        }
        // SAFETY: as above.
        unsafe {
            let _ = lt_result::destroy_handle(self.handle);
        }
    }
}

fn lt_err(e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow::anyhow!("cuBLASLt: {e:?}")
}

/// A captured unit of work.
struct Graph(CudaGraph);

// SAFETY: a graph is used only through the device that owns it (`&mut` to capture, one
// stream to launch), never from two threads at once.
unsafe impl Send for Graph {}

/// The engine's CUDA device: one GPU, one stream of its own.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    /// The engine's stream (non-blocking, never the NULL stream: see the module doc).
    stream: Arc<CudaStream>,
    /// Recorded on the engine's stream / on candle's, to order one after the other.
    ours: CudaEvent,
    theirs: CudaEvent,
    modules: [Arc<CudaModule>; 2],
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// The 4-byte spaces and the bf16 one, and every space's base address.
    words: Vec<(Space, CudaSlice<u32>)>,
    /// The 2-byte spaces.
    halves: Vec<(Space, CudaSlice<u16>)>,
    bases: HashMap<Space, u64>,
    lt: Mutex<Lt>,
    /// Captured units by slot.
    graphs: Vec<Option<Graph>>,
    /// Timing marks (events with timing) recorded and not released.
    marks: Mutex<super::Marks<CudaEvent>>,
    /// cuDNN's graphs and workspace on the engine's stream, made at the first attention call
    /// that asks for it (or why cuDNN cannot run here).
    sdpa: Option<Result<SdpaCache<Cudnn>, String>>,
    /// The collectives' communicator and stream (data parallel: [`Device::comm_init`]).
    comm: Option<super::nccl::DeviceComm>,
    /// candle's stream (the rest of the program's, where the world's collectives run).
    candle: Arc<CudaStream>,
}

impl CudaDevice {
    /// The engine's device on the GPU of `device` (a candle CUDA device, [`crate::device::open`]),
    /// its GEMMs in `math`: the same context, a stream of its own.
    /// With `act_bf16`, the kernels are the bf16-activation build of kernels/engine.cu.
    pub fn new(device: &candle_core::Device, math: GemmMath, act_bf16: bool) -> anyhow::Result<Self> {
        let candle_core::Device::Cuda(candle) = device else {
            anyhow::bail!("the engine's GPU backend runs on a CUDA device, not {:?}", device.location());
        };
        let ctx = candle.cuda_stream().context().clone();
        let ordinal = ctx.ordinal();
        // What `order` relies on: candle's tensors live on one real stream (every thread's:
        // `crate::device::open`), whose own events are off, so an event recorded on it orders
        // everything queued there.
        anyhow::ensure!(
            !is_legacy_stream(&candle.cuda_stream()) && !ctx.is_event_tracking(),
            "cuda:{ordinal}: the engine needs candle's device as `crate::device::open` makes it (one shared stream, event tracking off)"
        );
        let stream = ctx.new_stream().map_err(|e| anyhow::anyhow!("cuda:{ordinal}: a stream for the engine: {e:?}"))?;
        anyhow::ensure!(!is_legacy_stream(&stream), "cuda:{ordinal}: the engine's stream is the NULL stream, which cannot be captured");
        let event = || ctx.new_event(None).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: an event: {e:?}"));
        let (ours, theirs) = (event()?, event()?);
        let load = |src: &str| ctx.load_module(Ptx::from_src(src)).map_err(|e| anyhow::anyhow!("loading the engine's kernels: {e:?}"));
        let modules = [load(if act_bf16 { ENGINE_BF16_PTX } else { ENGINE_PTX })?, load(FLASH_PTX)?];
        let handle = lt_result::create_handle().map_err(lt_err)?;
        // SAFETY: cuBLASLt only needs the workspace's bytes, never their values.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE) }.map_err(|e| anyhow::anyhow!("cuBLASLt workspace: {e:?}"))?;
        let workspace_ptr = workspace.device_ptr(&stream).0;
        let lt = Lt { handle, _workspace: workspace, workspace_ptr, math, cache: HashMap::new() };
        Ok(Self {
            ctx,
            stream,
            ours,
            theirs,
            modules,
            functions: Mutex::new(HashMap::new()),
            words: Vec::new(),
            halves: Vec::new(),
            bases: HashMap::new(),
            lt: Mutex::new(lt),
            graphs: Vec::new(),
            marks: Mutex::new(super::Marks::default()),
            sdpa: None,
            comm: None,
            candle: candle.cuda_stream(),
        })
    }

    /// The stream every launch runs on (graph capture, events).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether the engine's stream is the legacy NULL stream or the per-thread default stream
    /// (never: [`CudaDevice::new`] refuses it; `pipeline engine-check` prints it).
    pub fn on_default_stream(&self) -> bool {
        is_legacy_stream(&self.stream)
    }

    /// Orders `later` after the work queued on `earlier` so far (an event, no host wait).
    fn order(&self, earlier: &CudaStream, later: &CudaStream) -> anyhow::Result<()> {
        let event = if std::ptr::eq(earlier, self.stream.as_ref()) { &self.ours } else { &self.theirs };
        event.record(earlier).map_err(|e| anyhow::anyhow!("recording an event: {e:?}"))?;
        later.wait(event).map_err(|e| anyhow::anyhow!("waiting for an event: {e:?}"))
    }

    fn function(&self, name: &'static str) -> CudaFunction {
        let mut cache = self.functions.lock().expect("the function cache");
        if let Some(f) = cache.get(name) {
            return f.clone();
        }
        let module = if name.starts_with("flash_") { &self.modules[1] } else { &self.modules[0] };
        let f = module.load_function(name).unwrap_or_else(|e| panic!("kernel `{name}` is not in the engine's PTX: {e:?}"));
        cache.insert(name, f.clone());
        f
    }

    fn address(&self, space: Space, off: usize) -> u64 {
        self.bases[&space] + (off * space.elem_bytes()) as u64
    }

    /// Runs a collective on the communication stream, ordered by events against this one.
    fn try_comm(&self, c: &super::CommCall) -> anyhow::Result<()> {
        let comm = self.comm.as_ref().ok_or_else(|| anyhow::anyhow!("{c:?} queued before the engine's communicator started"))?;
        comm.run(&self.stream, &|space, off| self.address(space, off), c)
    }

    /// Runs a cuDNN call whose graph was prepared.
    fn try_sdpa(&self, call: &SdpaCall) -> anyhow::Result<()> {
        let Some(Ok(cache)) = &self.sdpa else { anyhow::bail!("cuDNN attention was queued without cuDNN: {:?}", call.desc) };
        cache.execute(&call.desc, &call.ptrs(|space, off| self.address(space, off)))
    }

    fn slice(&self, space: Space) -> anyhow::Result<&CudaSlice<u32>> {
        self.words.iter().find(|w| w.0 == space).map(|w| &w.1).ok_or_else(|| anyhow::anyhow!("the {space:?} space is not a 4-byte space"))
    }

    /// The descriptors and algorithm of `p`'s shape, storage types and alignment (A, B and C
    /// in `spaces`, starting at the byte addresses `bases`), made once and cached. bf16 A and B
    /// multiply natively (`CUBLAS_COMPUTE_32F`: bf16 products, f32 accumulation) into an f32 or
    /// bf16 C; f32 ones in the device's [`GemmMath`].
    fn prepare(lt: &mut Lt, p: &LtPlan, spaces: [Space; 3], bases: [u64; 3]) -> anyhow::Result<ShapeKey> {
        let key = ShapeKey::of(p, spaces, bases);
        if lt.cache.contains_key(&key) {
            return Ok(key);
        }
        let compute = match lt.math {
            _ if key.bf16[0] => lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            GemmMath::Bf16 => lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
            GemmMath::Tf32 => lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            GemmMath::F32 => lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let f32_type = lt_sys::cudaDataType_t::CUDA_R_32F;
        let type_of = |bf16: bool| if bf16 { lt_sys::cudaDataType_t::CUDA_R_16BF } else { f32_type };
        let desc = lt_result::create_matmul_desc(compute, f32_type).map_err(lt_err)?;
        // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (LtOp's values), an i32.
        let op = |o: LtOp| o as i32;
        let mut layouts = [std::ptr::null_mut(); 3];
        // SAFETY: attributes of the kinds and sizes cuBLASLt documents, on live descriptors.
        unsafe {
            use lt_sys::cublasLtMatmulDescAttributes_t as A;
            for (attr, o) in [(A::CUBLASLT_MATMUL_DESC_TRANSA, op(p.trans_a)), (A::CUBLASLT_MATMUL_DESC_TRANSB, op(p.trans_b))] {
                lt_result::set_matmul_desc_attribute(desc, attr, &o as *const _ as *const c_void, std::mem::size_of_val(&o))
                    .map_err(lt_err)?;
            }
            for (k, (l, stride)) in [(p.a, p.stride_a), (p.b, p.stride_b), (p.c, p.stride_c)].into_iter().enumerate() {
                let layout = lt_result::create_matrix_layout(type_of(key.bf16[k]), l.rows, l.cols, l.ld).map_err(lt_err)?;
                if p.batch > 1 {
                    use lt_sys::cublasLtMatrixLayoutAttribute_t as L;
                    let count = p.batch as i32;
                    let set = |attr, ptr: *const c_void, size| lt_result::set_matrix_layout_attribute(layout, attr, ptr, size);
                    set(L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const _ as *const c_void, 4).map_err(lt_err)?;
                    set(L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const _ as *const c_void, 8).map_err(lt_err)?;
                }
                layouts[k] = layout;
            }
            let pref = lt_result::create_matmul_pref().map_err(lt_err)?;
            let ws = WORKSPACE as u64;
            use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
            lt_result::set_matmul_pref_attribute(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const _ as *const c_void, 8)
                .map_err(lt_err)?;
            // The operands' real alignment (D is C): the default promises 256 bytes.
            let [al_a, al_b, al_c] = key.align;
            for (attr, bytes) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c),
            ] {
                lt_result::set_matmul_pref_attribute(pref, attr, &bytes as *const u32 as *const c_void, 4).map_err(lt_err)?;
            }
            let heuristic = lt_result::get_matmul_algo_heuristic(lt.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref);
            let _ = lt_result::destroy_matmul_pref(pref);
            let heuristic = heuristic.map_err(|e| anyhow::anyhow!("cuBLASLt has no algorithm for {p:?}: {e:?}"))?;
            lt.cache.insert(key, Prepared { desc, layouts, algo: heuristic.algo });
        }
        Ok(key)
    }

    /// Launches `l` on the stream.
    fn try_launch(&self, l: &Launch) -> anyhow::Result<()> {
        let f = self.function(l.kernel);
        let ptrs: Vec<u64> = l.args.iter().map(|a| if let Arg::Ptr(s, off) = *a { self.address(s, off) } else { 0 }).collect();
        let mut b = self.stream.launch_builder(&f);
        for (a, p) in l.args.iter().zip(&ptrs) {
            match a {
                Arg::Ptr(..) => b.arg(p),
                Arg::I32(x) => b.arg(x),
                Arg::I64(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig { grid_dim: (l.grid[0], l.grid[1], l.grid[2]), block_dim: (l.block, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments are the kernel's, in its order and types (the launcher in
        // ops.rs mirrors each signature of kernels/engine.cu and flash_mma.cu, and the warp
        // emulator's tests check that mirror); every pointer lies in a live allocation of this
        // device (offsets checked against the arena by the backend).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| anyhow::anyhow!("launching {}: {e:?}", l.kernel))
    }

    /// `cublasLtMatmul` of plan `p` on the stream.
    fn try_gemm(&self, p: &LtPlan, spaces: [Space; 3]) -> anyhow::Result<()> {
        let mut lt = self.lt.lock().expect("the cuBLASLt lock");
        let key = Self::prepare(&mut lt, p, spaces, spaces.map(|s| self.bases[&s]))?;
        let prepared = &lt.cache[&key];
        let (a, b, c) = (self.address(spaces[0], p.a_off), self.address(spaces[1], p.b_off), self.address(spaces[2], p.c_off));
        let ws = lt.workspace_ptr;
        // SAFETY: the plan's layouts lie inside the arena (checked by the backend before
        // planning), the descriptors and algorithm were made for this shape, the scalars are
        // host f32 (the default pointer mode), and the call is ordered on the device's stream.
        unsafe {
            lt_result::matmul(
                lt.handle,
                prepared.desc,
                &p.alpha as *const f32 as *const c_void,
                &p.beta as *const f32 as *const c_void,
                a as *const c_void,
                prepared.layouts[0],
                b as *const c_void,
                prepared.layouts[1],
                c as *const c_void,
                prepared.layouts[2],
                c as *mut c_void,
                prepared.layouts[2],
                &prepared.algo,
                ws as *mut c_void,
                WORKSPACE,
                self.stream.cu_stream() as lt_sys::cudaStream_t,
            )
        }
        .map_err(|e| anyhow::anyhow!("cublasLtMatmul {p:?}: {e:?}"))
    }
}

/// Whether `stream` is a default stream: the NULL stream, `CU_STREAM_LEGACY` (0x1) or
/// `CU_STREAM_PER_THREAD` (0x2).
fn is_legacy_stream(stream: &CudaStream) -> bool {
    let s = stream.cu_stream();
    s.is_null() || s as usize == 0x1 || s as usize == 0x2
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // The graphs first: NCCL's destroy waits until no graph holds its captured collectives;
        // then the communicator, before the memory its calls name.
        self.graphs.clear();
        self.comm = None;
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let math = match self.lt.lock().expect("the cuBLASLt lock").math {
            GemmMath::Bf16 => "bf16",
            GemmMath::Tf32 => "tf32",
            GemmMath::F32 => "f32",
        };
        format!("cuda:{} ({name}), {math} GEMMs", self.ctx.ordinal())
    }

    fn alloc(&mut self, sizes: Sizes) -> anyhow::Result<()> {
        let err = |s: Space| move |e| anyhow::anyhow!("allocating the engine's {s:?} space on the GPU: {e:?}");
        for (space, len) in [(Space::Arena, sizes.arena), (Space::Aux, sizes.aux), (Space::Tokens, sizes.tokens)] {
            let slice = self.stream.alloc_zeros::<u32>(len.max(1)).map_err(err(space))?;
            let ptr = slice.device_ptr(&self.stream).0;
            self.bases.insert(space, ptr);
            self.words.push((space, slice));
        }
        for (space, len) in [(Space::Half, sizes.half), (Space::Act, sizes.act), (Space::Mirror, sizes.mirror)] {
            let slice = self.stream.alloc_zeros::<u16>(len.max(8)).map_err(err(space))?;
            let ptr = slice.device_ptr(&self.stream).0;
            self.bases.insert(space, ptr);
            self.halves.push((space, slice));
        }
        Ok(())
    }

    fn launch(&self, l: &Launch) {
        self.try_launch(l).unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn gemm(&self, p: &LtPlan, spaces: [Space; 3]) {
        self.try_gemm(p, spaces).unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn sdpa_prepare(&mut self, desc: &SdpaDesc) -> anyhow::Result<()> {
        let stream = self.stream.clone();
        let cache = self.sdpa.get_or_insert_with(|| Cudnn::new(stream).map(SdpaCache::new).map_err(|e| format!("{e:#}")));
        cache.as_mut().map_err(|why| anyhow::anyhow!("{why}"))?.prepare(desc)
    }

    fn sdpa(&self, call: &SdpaCall) {
        self.try_sdpa(call).unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn comm_init(&mut self, ranks: Arc<dyn crate::dist::Collective>) -> anyhow::Result<()> {
        if self.comm.is_none() {
            self.comm = Some(super::nccl::DeviceComm::new(&self.ctx, ranks.as_ref())?);
        }
        Ok(())
    }

    fn fence(&self) -> anyhow::Result<()> {
        self.order(&self.stream, &self.candle)
    }

    fn comm(&self, c: &super::CommCall) {
        self.try_comm(c).unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn write_half(&mut self, space: Space, off: usize, bits: &[u16]) -> anyhow::Result<()> {
        let slice = self.halves.iter_mut().find(|w| w.0 == space).map(|w| &mut w.1);
        let slice = slice.ok_or_else(|| anyhow::anyhow!("the {space:?} space is not a 2-byte space"))?;
        anyhow::ensure!(off + bits.len() <= slice.len(), "writing {} elements at {off} of the {space:?} space", bits.len());
        let mut dst = slice.slice_mut(off..off + bits.len());
        self.stream.memcpy_htod(bits, &mut dst).map_err(|e| anyhow::anyhow!("copy to the GPU: {e:?}"))
    }

    fn read_half(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u16>> {
        let slice = self.halves.iter().find(|w| w.0 == space).map(|w| &w.1);
        let slice = slice.ok_or_else(|| anyhow::anyhow!("the {space:?} space is not a 2-byte space"))?;
        anyhow::ensure!(off + len <= slice.len(), "reading {len} elements at {off} of the {space:?} space");
        self.stream.clone_dtoh(&slice.slice(off..off + len)).map_err(|e| anyhow::anyhow!("copy from the GPU: {e:?}"))
    }

    fn capture(&mut self, slot: usize, work: &[Work]) -> anyhow::Result<()> {
        use cu_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream.begin_capture(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow::anyhow!("cuStreamBeginCapture: {e:?}"))?;
        let recorded = work.iter().try_for_each(|w| match w {
            Work::Launch(l) => self.try_launch(l),
            Work::Gemm(p, spaces) => self.try_gemm(p, *spaces),
            Work::Sdpa(call) => self.try_sdpa(call),
            Work::Comm(c) => self.try_comm(c),
        });
        if recorded.is_err() && work.iter().any(|w| matches!(w, Work::Comm(_))) {
            // A failure after a fork leaves the communication stream in the capture: join it so
            // that the capture can end and both streams leave capture mode.
            let _ = self.try_comm(&super::CommCall::Join);
        }
        // End the capture whatever happened, so the stream leaves capture mode.
        let graph = self.stream.end_capture(cu_sys::CUgraphInstantiate_flags(0));
        recorded?;
        let graph = graph.map_err(|e| anyhow::anyhow!("cuStreamEndCapture / cuGraphInstantiate: {e:?}"))?;
        let graph = graph.ok_or_else(|| anyhow::anyhow!("the captured graph is empty"))?;
        graph.upload().map_err(|e| anyhow::anyhow!("cuGraphUpload: {e:?}"))?;
        if self.graphs.len() <= slot {
            self.graphs.resize_with(slot + 1, || None);
        }
        self.graphs[slot] = Some(Graph(graph));
        Ok(())
    }

    fn replay(&self, slot: usize) -> anyhow::Result<()> {
        let graph = self.graphs.get(slot).and_then(Option::as_ref).ok_or_else(|| anyhow::anyhow!("no graph captured in slot {slot}"))?;
        graph.0.launch().map_err(|e| anyhow::anyhow!("cuGraphLaunch: {e:?}"))
    }
    fn write(&mut self, space: Space, off: usize, words: &[u32]) -> anyhow::Result<()> {
        let slice = self.words.iter_mut().find(|w| w.0 == space).map(|w| &mut w.1);
        let slice = slice.ok_or_else(|| anyhow::anyhow!("the {space:?} space is not a 4-byte space"))?;
        anyhow::ensure!(off + words.len() <= slice.len(), "writing {} words at {off} of the {space:?} space", words.len());
        let mut dst = slice.slice_mut(off..off + words.len());
        self.stream.memcpy_htod(words, &mut dst).map_err(|e| anyhow::anyhow!("copy to the GPU: {e:?}"))
    }

    fn synchronize(&self) -> anyhow::Result<()> {
        self.stream.synchronize().map_err(|e| anyhow::anyhow!("waiting for the engine's stream: {e:?}"))
    }

    fn timing_mark(&self) -> Option<usize> {
        let event = self.ctx.new_event(Some(cu_sys::CUevent_flags::CU_EVENT_DEFAULT)).ok()?;
        event.record(&self.stream).ok()?;
        Some(self.marks.lock().expect("the timing marks").push(event))
    }

    fn timing_ms(&self, from: usize, to: usize) -> anyhow::Result<f64> {
        let marks = self.marks.lock().expect("the timing marks");
        let (a, b) = (marks.get(from), marks.get(to));
        let (Some(a), Some(b)) = (a, b) else { anyhow::bail!("no timing marks {from} and {to}") };
        b.synchronize().map_err(|e| anyhow::anyhow!("waiting for a timing mark: {e:?}"))?;
        Ok(a.elapsed_ms(b).map_err(|e| anyhow::anyhow!("reading a timing mark: {e:?}"))? as f64)
    }

    fn timing_reset(&self) {
        self.marks.lock().expect("the timing marks").clear();
    }

    fn timing_done(&self, mark: usize) -> bool {
        self.marks.lock().expect("the timing marks").get(mark).is_none_or(|e| e.is_complete())
    }

    fn timing_release(&self, mark: usize) {
        self.marks.lock().expect("the timing marks").release(mark);
    }

    fn write_tensor(&mut self, space: Space, off: usize, t: &candle_core::Tensor) -> anyhow::Result<()> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*storage else {
            drop(storage);
            let words: Vec<u32> = t.flatten_all()?.to_vec1()?;
            return self.write(space, off, &words);
        };
        anyhow::ensure!(t.dtype() == candle_core::DType::U32, "token ids must be u32, not {:?}", t.dtype());
        anyhow::ensure!(layout.is_contiguous(), "token ids must be a contiguous tensor");
        anyhow::ensure!(cs.device.cuda_stream().context() == &self.ctx, "the token ids are on another GPU");
        let n = t.elem_count();
        anyhow::ensure!(off + n <= self.slice(space)?.len(), "writing {n} words at {off} of the {space:?} space");
        let theirs = cs.device.cuda_stream();
        let src = cs.as_cuda_slice::<u32>()?.device_ptr(&theirs).0 + 4 * layout.start_offset() as u64;
        let dst = self.address(space, off);
        // After candle's stream made the tensor; candle's stream (which frees it) after the copy.
        self.order(&theirs, &self.stream)?;
        // SAFETY: `n` u32 from `src` lie in the tensor's contiguous storage (checked above), and
        // `n` words from `dst` in this device's space; both streams are ordered around the copy.
        unsafe { cu_result::memcpy_dtod_async(dst, src, 4 * n, self.stream.cu_stream()) }
            .map_err(|e| anyhow::anyhow!("copying the token ids on the GPU: {e:?}"))?;
        self.order(&self.stream, &theirs)
    }

    fn tensor(&self, off: usize, len: usize, shape: &[usize], device: &candle_core::Device) -> anyhow::Result<candle_core::Tensor> {
        let candle_core::Device::Cuda(target) = device else {
            let v: Vec<f32> = self.read(Space::Arena, off, len)?.into_iter().map(f32::from_bits).collect();
            return Ok(candle_core::Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?.to_device(device)?);
        };
        anyhow::ensure!(target.cuda_stream().context() == &self.ctx, "copying the engine's weights to another GPU");
        anyhow::ensure!(off + len <= self.slice(Space::Arena)?.len(), "reading {len} elements at {off} of the arena");
        let theirs = target.cuda_stream();
        // SAFETY: every element is written by the copy below before anything on `theirs` reads it.
        let mut dst =
            unsafe { theirs.alloc::<f32>(len.max(1)) }.map_err(|e| anyhow::anyhow!("a tensor for the engine's weights: {e:?}"))?;
        // After the engine's work so far; the engine's next writes after the copy.
        self.order(&self.stream, &theirs)?;
        {
            let (ptr, _record) = dst.device_ptr_mut(&theirs);
            // SAFETY: `len` f32 in the fresh allocation and in the arena from `off` (checked).
            unsafe { cu_result::memcpy_dtod_async(ptr, self.address(Space::Arena, off), 4 * len, theirs.cu_stream()) }
                .map_err(|e| anyhow::anyhow!("copying the engine's weights on the GPU: {e:?}"))?;
        }
        self.order(&theirs, &self.stream)?;
        let storage = candle_core::CudaStorage::wrap_cuda_slice(dst, target.clone());
        let t = candle_core::Tensor::from_storage(candle_core::Storage::Cuda(storage), len, candle_core::op::BackpropOp::none(), false);
        Ok(t.reshape(shape)?)
    }

    fn read(&self, space: Space, off: usize, len: usize) -> anyhow::Result<Vec<u32>> {
        let slice = self.slice(space)?;
        anyhow::ensure!(off + len <= slice.len(), "reading {len} words at {off} of the {space:?} space");
        self.stream.clone_dtoh(&slice.slice(off..off + len)).map_err(|e| anyhow::anyhow!("copy from the GPU: {e:?}"))
    }
}
