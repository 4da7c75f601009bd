//! cuDNN itself (`cuda` builds): the C shim of `cpp/cudnn_sdpa.h` (compiled and linked by
//! build.rs over NVIDIA's cudnn-frontend headers) as an [`SdpaLib`] on one CUDA stream, with
//! libcudnn opened at run time ([`super::load`]).

use std::ffi::{c_char, c_void};
use std::sync::{Arc, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::{SdpaDesc, SdpaLib, SdpaPtrs, load};

/// `pg_sdpa_desc` of cpp/cudnn_sdpa.h.
#[repr(C)]
struct Desc {
    backward: i32,
    causal: i32,
    ragged: i32,
    deterministic: i32,
    b: i64,
    h: i64,
    h_kv: i64,
    s: i64,
    d: i64,
    max_total: i64,
    scale: f32,
    q: [i64; 4],
    k: [i64; 4],
    v: [i64; 4],
    o: [i64; 4],
    dq: [i64; 4],
    dk: [i64; 4],
    dv: [i64; 4],
    stats: [i64; 4],
}

/// `pg_sdpa_ptrs` of cpp/cudnn_sdpa.h.
#[repr(C)]
struct Ptrs {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    stats: u64,
    seq_len_q: u64,
    seq_len_kv: u64,
    off_q: u64,
    off_k: u64,
    off_v: u64,
    off_o: u64,
    off_dq: u64,
    off_dk: u64,
    off_dv: u64,
    off_stats: u64,
}

unsafe extern "C" {
    fn pg_cudnn_init(dlhandle: *mut c_void, version: *mut i64, err: *mut c_char, err_len: usize) -> i32;
    fn pg_cudnn_handle_create(stream: *mut c_void, handle: *mut *mut c_void, err: *mut c_char, err_len: usize) -> i32;
    fn pg_cudnn_handle_destroy(handle: *mut c_void);
    fn pg_sdpa_build(
        handle: *mut c_void,
        desc: *const Desc,
        graph: *mut *mut c_void,
        workspace: *mut i64,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn pg_sdpa_execute(
        handle: *mut c_void,
        graph: *mut c_void,
        ptrs: *const Ptrs,
        workspace: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn pg_sdpa_destroy(graph: *mut c_void);
}

/// Calls a shim function with an error buffer; its message on failure.
fn call(what: &str, f: impl FnOnce(*mut c_char, usize) -> i32) -> anyhow::Result<()> {
    let mut err = vec![0u8; 2048];
    if f(err.as_mut_ptr() as *mut c_char, err.len()) == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    anyhow::bail!("{what}: {}", String::from_utf8_lossy(&err[..end]))
}

/// The process's cuDNN, bound to the shim once: its library (path and version).
pub fn cudnn() -> Result<&'static load::Opened, String> {
    static BOUND: OnceLock<Result<(), String>> = OnceLock::new();
    let lib = load::library()?;
    BOUND
        .get_or_init(|| {
            let mut version = 0i64;
            // SAFETY: the handle is a live dlopen handle of a cuDNN 9 (load.rs checked it).
            call("binding cuDNN", |e, n| unsafe { pg_cudnn_init(lib.handle, &mut version, e, n) }).map_err(|e| format!("{e:#}"))
        })
        .clone()?;
    Ok(lib)
}

/// A built graph, destroyed with its cache.
pub struct Graph(*mut c_void);

// SAFETY: a built graph is plain host data of the frontend's; it is used by one thread at a
// time (its cache's owner, behind `&mut` or a lock).
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: built by pg_sdpa_build, dropped once.
        unsafe { pg_sdpa_destroy(self.0) }
    }
}

/// cuDNN on one CUDA stream: its handle and the workspaces handed out (kept while it lives).
pub struct Cudnn {
    stream: Arc<CudaStream>,
    handle: *mut c_void,
    workspaces: Vec<CudaSlice<u8>>,
}

// SAFETY: the handle is used from one thread at a time (the owner's `&mut` / `&`); cuDNN
// handles may move between threads.
unsafe impl Send for Cudnn {}

impl Cudnn {
    /// A cuDNN handle queueing on `stream`; an error (one line) where cuDNN cannot be loaded.
    pub fn new(stream: Arc<CudaStream>) -> anyhow::Result<Self> {
        cudnn().map_err(|e| anyhow::anyhow!(e))?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the stream outlives the handle (kept in `self`).
        call("cudnnCreate", |e, n| unsafe { pg_cudnn_handle_create(stream.cu_stream() as *mut c_void, &mut handle, e, n) })?;
        Ok(Cudnn { stream, handle, workspaces: Vec::new() })
    }
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe { pg_cudnn_handle_destroy(self.handle) }
    }
}

impl SdpaLib for Cudnn {
    type Graph = Graph;

    fn build(&mut self, d: &SdpaDesc) -> anyhow::Result<(Graph, usize)> {
        let desc = Desc {
            backward: d.backward as i32,
            causal: d.causal as i32,
            ragged: d.ragged as i32,
            deterministic: d.deterministic as i32,
            b: d.b as i64,
            h: d.h as i64,
            h_kv: d.h_kv as i64,
            s: d.s as i64,
            d: d.d as i64,
            max_total: d.max_total as i64,
            scale: d.scale(),
            q: d.q,
            k: d.k,
            v: d.v,
            o: d.o,
            dq: d.dq,
            dk: d.dk,
            dv: d.dv,
            stats: d.stats,
        };
        let (mut graph, mut bytes) = (std::ptr::null_mut(), 0i64);
        // SAFETY: `desc` is a pg_sdpa_desc; the outputs are written on success.
        call("building the cuDNN graph", |e, n| unsafe { pg_sdpa_build(self.handle, &desc, &mut graph, &mut bytes, e, n) })?;
        Ok((Graph(graph), bytes.max(0) as usize))
    }

    fn alloc_workspace(&mut self, bytes: usize) -> anyhow::Result<u64> {
        // SAFETY: cuDNN writes the workspace before it reads it.
        let slice = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|e| anyhow::anyhow!("the cuDNN workspace ({bytes} bytes): {e:?}"))?;
        let addr = {
            let (addr, _sync) = slice.device_ptr(&self.stream);
            addr
        };
        self.workspaces.push(slice);
        Ok(addr)
    }

    fn execute(&self, graph: &Graph, p: &SdpaPtrs, workspace: u64) -> anyhow::Result<()> {
        let ptrs = Ptrs {
            q: p.q,
            k: p.k,
            v: p.v,
            o: p.o,
            dout: p.dout,
            dq: p.dq,
            dk: p.dk,
            dv: p.dv,
            stats: p.stats,
            seq_len_q: p.seq_len,
            seq_len_kv: p.seq_len,
            off_q: p.off_q,
            off_k: p.off_k,
            off_v: p.off_v,
            off_o: p.off_o,
            off_dq: p.off_dq,
            off_dk: p.off_dk,
            off_dv: p.off_dv,
            off_stats: p.off_stats,
        };
        // SAFETY: the addresses are live device buffers of the sizes the descriptor implies
        // (the callers' contract), the workspace at least the build's need.
        call("cuDNN attention", |e, n| unsafe { pg_sdpa_execute(self.handle, graph.0, &ptrs, workspace as *mut c_void, e, n) })
    }
}
