//! `run.device`: what it may name and how a stage opens it.

#[cfg(feature = "cuda")]
pub mod cuda_copy;
#[cfg(not(feature = "cuda"))]
#[path = "no_cuda_copy.rs"]
pub mod cuda_copy;
pub mod cudnn;
pub mod phase_clock;

use candle_core::Device;

use crate::runtime::config::RunConfig;

/// What `run.device` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceName {
    /// The host.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

/// Parses `run.device` ("cpu", "cuda", "cuda:N") without opening anything.
pub fn parse(d: &str) -> anyhow::Result<DeviceName> {
    match d {
        "cpu" => Ok(DeviceName::Cpu),
        "cuda" => Ok(DeviceName::Cuda(0)),
        _ => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(DeviceName::Cuda(n)),
            _ => anyhow::bail!("`run.device` = {d:?} is not a device: use \"cpu\" or \"cuda:N\""),
        },
    }
}

/// True when this binary was built with the `cuda` feature.
pub const CUDA_BUILD: bool = cfg!(feature = "cuda");

/// Whether `run.device` names a GPU that this build can run on (a `cuda` build and a
/// `cuda[:N]` device): what a stage checks the GPU backend's limits against. A GPU device in a
/// build without CUDA is another check's refusal.
pub fn runs_on_gpu(device: &str) -> bool {
    CUDA_BUILD && matches!(parse(device), Ok(DeviceName::Cuda(_)))
}

/// Checks that a GPU-only stage implementation (`what`, e.g. "`pin/pinned`") can run: a `cuda`
/// build and a CUDA `run.device`; the errors name `instead`, the implementation to use.
pub fn require_gpu(run: &RunConfig, what: &str, instead: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        CUDA_BUILD,
        "{what} needs CUDA: this binary was built without the `cuda` feature (scripts/build-cuda.sh); use {instead}"
    );
    anyhow::ensure!(
        matches!(parse(&run.device)?, DeviceName::Cuda(_)),
        "{what} is for GPU runs: `run.device` = {:?}; use {instead} on the CPU",
        run.device
    );
    Ok(())
}

/// Opens the device `run.device` names. A CUDA device in a CPU-only build, or on a machine
/// without a driver or the CUDA libraries, is an error naming the key and what is missing.
pub fn open(run: &RunConfig) -> anyhow::Result<Device> {
    open_named(&run.device)
}

/// Opens the device a `run.device` value names (for commands that take it as a flag); errors
/// as [`open`]'s.
pub fn open_named(device: &str) -> anyhow::Result<Device> {
    match parse(device)? {
        DeviceName::Cpu => Ok(Device::Cpu),
        DeviceName::Cuda(n) => open_cuda(n),
    }
}

/// The hardware `run` ran on, in words: `8 x NVIDIA H100 80GB HBM3` (the device's name as the
/// driver gives it; ranks take one GPU each), or `1 x CPU (AMD EPYC 7B13, 2 cores)`.
pub fn describe(run: &RunConfig) -> String {
    let what = match parse(&run.device) {
        Ok(DeviceName::Cuda(n)) => cuda_name(n).unwrap_or_else(|| format!("GPU cuda:{n}")),
        _ => {
            let model = std::fs::read_to_string("/proc/cpuinfo")
                .ok()
                .and_then(|t| {
                    t.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string())
                })
                .unwrap_or_else(|| std::env::consts::ARCH.to_string());
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            format!("CPU ({model}, {cores} cores)")
        }
    };
    format!("{} x {what}", run.world_size.max(1))
}

/// GPU `n`'s name: none in a CPU-only build.
#[cfg(not(feature = "cuda"))]
fn cuda_name(_n: usize) -> Option<String> {
    None
}

/// GPU `n`'s name as the driver gives it.
#[cfg(feature = "cuda")]
fn cuda_name(n: usize) -> Option<String> {
    let d = open_cuda(n).ok()?;
    d.as_cuda_device().ok()?.cuda_stream().context().name().ok()
}

/// The free memory of the GPU a `run.device` value names, in bytes: the budget of the memory
/// estimate when `run.max_memory_gb` is not set. `None` on the CPU, in a CPU-only build, or
/// when the GPU cannot be opened (the run will say why when it opens it).
pub fn gpu_free_memory(device: &str) -> Option<u64> {
    match parse(device).ok()? {
        DeviceName::Cpu => None,
        DeviceName::Cuda(n) => cuda_free_memory(n),
    }
}

/// GPU `n`'s free memory: none in a CPU-only build.
#[cfg(not(feature = "cuda"))]
fn cuda_free_memory(_n: usize) -> Option<u64> {
    None
}

/// GPU `n`'s free memory as the driver reports it (opening the device, as the run will).
#[cfg(feature = "cuda")]
fn cuda_free_memory(n: usize) -> Option<u64> {
    let d = open_cuda(n).ok()?;
    let (free, _total) = d.as_cuda_device().ok()?.cuda_stream().context().mem_get_info().ok()?;
    Some(free as u64)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(n: usize) -> anyhow::Result<Device> {
    anyhow::bail!("`run.device` = \"cuda:{n}\": this binary was built without CUDA support (build it with scripts/build-cuda.sh)")
}

#[cfg(feature = "cuda")]
fn open_cuda(n: usize) -> anyhow::Result<Device> {
    use candle_core::cuda_backend::cudarc;
    // cudarc loads each library with dlopen on first use and panics if it is missing: look
    // for every library candle's CUDA backend opens before touching any of them.
    // SAFETY: these only try to dlopen the library (and close it again); no CUDA call is made.
    let libs = [
        ("libcuda.so.1 (the NVIDIA driver)", unsafe { cudarc::driver::sys::is_culib_present() }),
        ("libcublas.so.13", unsafe { cudarc::cublas::sys::is_culib_present() }),
        ("libcublasLt.so.13", unsafe { cudarc::cublaslt::sys::is_culib_present() }),
        ("libcurand.so.10", unsafe { cudarc::curand::sys::is_culib_present() }),
        ("libnvrtc.so.13", unsafe { cudarc::nvrtc::sys::is_culib_present() }),
    ];
    let missing: Vec<&str> = libs.iter().filter(|(_, present)| !present).map(|(name, _)| *name).collect();
    anyhow::ensure!(
        missing.is_empty(),
        "`run.device` = \"cuda:{n}\": cannot load {} on this machine; install the driver / a CUDA 13 runtime (PyTorch cu13 ships the libraries: add its nvidia/cu13/lib to LD_LIBRARY_PATH), or use \"cpu\"",
        missing.join(", ")
    );
    // One candle device per GPU for the whole process: tensors made by the uploader and the
    // executor must share it (candle refuses to mix two devices opened on the same GPU).
    static OPEN: std::sync::Mutex<Vec<(usize, Device)>> = std::sync::Mutex::new(Vec::new());
    let mut open = OPEN.lock().map_err(|_| anyhow::anyhow!("the device table is poisoned"))?;
    if let Some((_, d)) = open.iter().find(|(i, _)| *i == n) {
        return Ok(d.clone());
    }
    // One stream for every thread (`new_cuda` would give each thread its own per-thread default
    // stream, and nothing would order the executor's kernels before the uploader's tensors are
    // read, or the snapshots' copies before the averaging and checkpoint stages read them).
    let d = Device::new_cuda_with_stream(n).map_err(|e| anyhow::anyhow!("`run.device` = \"cuda:{n}\": cannot open the GPU: {e}"))?;
    // SAFETY: no tensor exists on this device yet. Every tensor lives on the one compute stream,
    // where stream order synchronises all uses; the only other stream, the uploader's copy
    // stream, synchronises its own buffers with events (`cuda_copy`). Event tracking would
    // instead record events around every kernel launch, and make the copy stream wait for the
    // compute stream whenever a batch is freed.
    unsafe { d.as_cuda_device()?.disable_event_tracking() };
    open.push((n, d.clone()));
    Ok(d)
}
