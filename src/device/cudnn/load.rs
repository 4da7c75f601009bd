//! Finding and opening cuDNN (`libcudnn.so.9`) at run time: the binary links no cuDNN, so that
//! it starts where there is none and says so in one line where attention would have used it.
//!
//! Where it looks, in order: the file `CUDNN_LIB` names, then `libcudnn.so.9` by the dynamic
//! loader's search (`LD_LIBRARY_PATH`; PyTorch's cu13 install carries it in
//! `site-packages/nvidia/cudnn/lib`, which `scripts/gpu-check.sh` and
//! `scripts/gpu-first-light.sh` put there). A library is taken only if it answers
//! `cudnnGetVersion` with a 9.x version.

use std::ffi::c_void;
use std::sync::OnceLock;

/// The variable naming a libcudnn to load.
pub const ENV: &str = "CUDNN_LIB";
/// The name the dynamic loader is asked for.
pub const SONAME: &str = "libcudnn.so.9";

/// An opened cuDNN, kept open for the life of the process.
#[derive(Debug)]
pub struct Opened {
    /// What was opened (the path or the name).
    pub path: String,
    /// `cudnnGetVersion()`, e.g. 92801 for 9.28.1.
    pub version: usize,
    /// The `dlopen` handle (the shim resolves cuDNN's entry points through it).
    pub handle: *mut c_void,
}

// SAFETY: a dlopen handle is a process-wide token; dlsym on it is thread-safe.
unsafe impl Send for Opened {}
// SAFETY: as above; the handle is never closed.
unsafe impl Sync for Opened {}

/// Where to look: `CUDNN_LIB` if set, then the soname.
pub fn candidates() -> Vec<String> {
    let mut out: Vec<String> = std::env::var(ENV).ok().filter(|s| !s.is_empty()).into_iter().collect();
    out.push(SONAME.to_string());
    out
}

/// Opens the first of `candidates` that is a cuDNN 9; an error naming each one tried and why.
pub fn open(candidates: &[String]) -> Result<Opened, String> {
    let mut tried = Vec::new();
    for c in candidates {
        match open_one(c) {
            Ok(o) => return Ok(o),
            Err(why) => tried.push(format!("{c} ({why})")),
        }
    }
    Err(format!(
        "cuDNN could not be loaded: tried {}; install it (pip install nvidia-cudnn-cu13, or PyTorch's cu13 wheels) and put its lib/ on LD_LIBRARY_PATH, or set {ENV} to the file",
        tried.join(", ")
    ))
}

fn open_one(name: &str) -> Result<Opened, String> {
    // SAFETY: loading a library runs its initialisers; libcudnn's are plain C++ statics.
    let lib = unsafe { libloading::os::unix::Library::open(Some(name), libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL) }
        .map_err(|e| e.to_string())?;
    // SAFETY: cudnnGetVersion is `size_t cudnnGetVersion(void)` in every cuDNN.
    let version = unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> usize>(b"cudnnGetVersion\0")
            .map_err(|_| "no cudnnGetVersion: not a cuDNN library".to_string())?;
        f()
    };
    if !(90_000..100_000).contains(&version) {
        return Err(format!("cuDNN version {version}, not 9.x"));
    }
    Ok(Opened { path: name.to_string(), version, handle: lib.into_raw() })
}

/// The process's cuDNN, opened at the first call from [`candidates`]; the same answer after.
pub fn library() -> Result<&'static Opened, String> {
    static LIB: OnceLock<Result<Opened, String>> = OnceLock::new();
    LIB.get_or_init(|| open(&candidates())).as_ref().map_err(Clone::clone)
}

/// `92801` as `9.28.1`.
#[cfg(feature = "tools")]
pub fn version_name(v: usize) -> String {
    format!("{}.{}.{}", v / 10_000, v / 100 % 100, v % 100)
}
