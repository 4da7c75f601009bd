//! Build script.
//!
//! 0. Every build: the SHA-256 of each source file the crate can compile (`SOURCE_ROOTS`)
//!    into `$OUT_DIR/source_digests.txt` (`HEX  PATH` lines), which the binary embeds
//!    (src/artifact/bundle/sources.rs): a run packs the files its build compiled
//!    (cargo's dep-info) and refuses any whose bytes are not the ones compiled. And the build's
//!    features as `BUILT_FEATURES` (src/runtime/build_info.rs).
//!
//! The rest only for `--features cuda`:
//!
//! 1. Compiles `kernels/*.cu` (the fused ops' and the engine's GPU kernels; the device maths
//!    they share is in the headers of `kernels/ops/`) to PTX in `OUT_DIR` with nvcc
//!    (`$CUDA_ROOT/bin/nvcc`, else `nvcc` on the PATH) for `CUDA_COMPUTE_CAP` (default 90);
//!    the launchers embed it (src/model/cuda/fused.rs, src/model/flash_attn/cuda.rs,
//!    src/engine/gpu/cuda.rs) and the driver loads it at first use.
//! 2. candle's kernels ask the linker for the shared CUDA runtime (`-lcudart`); pointing that
//!    name at the static runtime of the CUDA tree (`CUDA_ROOT`, set by scripts/build-cuda.sh)
//!    keeps the GPU binary free of a libcudart dependency, so it starts on machines without
//!    CUDA and runs CPU configs there.
//! 3. Compiles `cpp/cudnn_sdpa.cpp` (cuDNN's fused attention through NVIDIA's header-only
//!    cudnn-frontend, behind the C ABI of `cpp/cudnn_sdpa.h`) as host C++17 with `$CXX` (default
//!    `c++`) into `$OUT_DIR/libcudnn_sdpa.a`, against the headers scripts/build-cuda.sh fetches
//!    (`CUDNN_FRONTEND_INCLUDE`, `CUDNN_INCLUDE`, `NVRTC_INCLUDE`, and `$CUDA_ROOT/include`), and
//!    links it with the shared libstdc++ (which candle's kernels need already). cuDNN itself is
//!    not linked: the frontend's dynamic loading resolves it through the handle of a
//!    libcudnn.so.9 that src/device/cudnn/ dlopens, so the binary still starts without cuDNN.

use std::path::PathBuf;
use std::process::Command;

/// What the crate's sources are: the files the source bundle may hold, digested at build time.
const SOURCE_ROOTS: [&str; 7] = ["Cargo.toml", "Cargo.lock", "build.rs", "src", "stages", "kernels", "cpp"];

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    digest_sources();
    // The features this build has, for the record a run keeps of its build
    // (src/runtime/build_info.rs), without a feature cfg outside the device areas.
    let features: Vec<&str> = ["tools", "candle", "mpi", "cuda"]
        .into_iter()
        .filter(|f| std::env::var_os(format!("CARGO_FEATURE_{}", f.to_uppercase())).is_some())
        .collect();
    println!("cargo:rustc-env=BUILT_FEATURES={}", features.join(","));
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // What nvcc and the C++ compiler read: in the dep-info (and so in the source bundle) only
    // where they are compiled.
    for dir in ["kernels", "cpp"] {
        for file in files_under(&PathBuf::from(dir)).into_iter().filter(|f| compiled(f)) {
            println!("cargo:rerun-if-changed={}", file.display());
        }
    }
    compile_kernels();
    compile_cudnn_shim();
    let Some(root) = std::env::var_os("CUDA_ROOT") else {
        println!("cargo:warning=CUDA_ROOT is not set: the binary will need libcudart.so at run time (use scripts/build-cuda.sh)");
        return;
    };
    let root = std::path::PathBuf::from(root);
    let lib = root.join("lib").join("libcudart_static.a");
    if !lib.is_file() {
        println!("cargo:warning={} is missing: the binary will need libcudart.so at run time", lib.display());
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("cudart_static");
    std::fs::create_dir_all(&out).expect("OUT_DIR is writable");
    // A linker script named like the shared library: `-lcudart` then links the static one.
    std::fs::write(out.join("libcudart.so"), format!("INPUT({})\n", lib.display())).expect("OUT_DIR is writable");
    println!("cargo:rustc-link-search=native={}", out.display());
}

/// `$OUT_DIR/source_digests.txt`: `HEX  PATH` for every file under [`SOURCE_ROOTS`], in path
/// order. Watching the roots reruns it whenever a source changes (the crate recompiles then
/// anyway).
fn digest_sources() {
    use sha2::Digest;
    let mut lines = String::new();
    for root in SOURCE_ROOTS {
        println!("cargo:rerun-if-changed={root}");
        for file in files_under(&PathBuf::from(root)) {
            let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            let hex: String = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            let path = file.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/");
            lines.push_str(&format!("{hex}  {path}\n"));
        }
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("source_digests.txt"), lines).expect("OUT_DIR is writable");
}

/// The regular files at `path` (a file, or a folder walked whole), sorted; none when it is
/// missing.
fn files_under(path: &std::path::Path) -> Vec<PathBuf> {
    let Ok(meta) = std::fs::metadata(path) else { return Vec::new() };
    if meta.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut out = Vec::new();
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", path.display()))
            .map(|e| e.expect("a readable folder").path())
            .collect();
        entries.sort();
        for e in entries {
            out.extend(files_under(&e));
        }
    }
    out
}

/// Kernels only the candle executor launches (src/model/cuda/fused.rs,
/// src/model/flash_attn/cuda.rs): compiled, and so in the source bundle, with the feature
/// `candle` only. The engine's are `engine.cu` and `flash_mma.cu`.
const CANDLE_KERNELS: [&str; 2] = ["kernels/fused.cu", "kernels/flash_attn.cu"];

/// Whether this build compiles `file` (every kernel and header but [`CANDLE_KERNELS`] without
/// the feature `candle`).
fn compiled(file: &std::path::Path) -> bool {
    std::env::var_os("CARGO_FEATURE_CANDLE").is_some() || !CANDLE_KERNELS.iter().any(|k| file == std::path::Path::new(k))
}

/// `kernels/NAME.cu` -> `$OUT_DIR/NAME.ptx` for every kernel file this build compiles.
fn compile_kernels() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("CUDA_ROOT").map(|r| PathBuf::from(r).join("bin").join("nvcc")).filter(|p| p.is_file());
    let nvcc = nvcc.unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut files: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/ exists")
        .map(|e| e.expect("kernels/ is readable").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu") && compiled(p))
        .collect();
    files.sort();
    // The engine's kernels twice: float32 activations (engine.ptx) and bfloat16 ones
    // (engine_bf16.ptx, `-DENGINE_ACT_BF16`: kernels/engine.cu's `act`).
    let builds = files.into_iter().flat_map(|cu| {
        let stem = cu.file_stem().expect("a file name").to_string_lossy().into_owned();
        let bf16 = (stem == "engine").then(|| (cu.clone(), format!("{stem}_bf16.ptx"), Some("-DENGINE_ACT_BF16")));
        std::iter::once((cu, format!("{stem}.ptx"), None)).chain(bf16)
    });
    for (cu, name, define) in builds {
        let ptx = out.join(name);
        let status = Command::new(&nvcc)
            .args(define)
            // `-I kernels`: kernels include their shared headers with angle brackets (see
            // kernels/mma_sm80.cuh), so that the warp emulator's tests can swap them. The ops'
            // headers (`#include "ops/..."`) are found next to the including file.
            .args(["--ptx", "-O3", "-std=c++17", "-I", "kernels", &format!("-arch=compute_{cap}"), "-o"])
            .arg(&ptx)
            .arg(&cu)
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {} to compile {}: {e} (build with scripts/build-cuda.sh)", nvcc.display(), cu.display())
            });
        assert!(status.success(), "{} failed on {}", nvcc.display(), cu.display());
    }
}

/// `cpp/cudnn_sdpa.cpp` -> `$OUT_DIR/libcudnn_sdpa.a`, linked with the shared libstdc++.
fn compile_cudnn_shim() {
    for var in ["CUDNN_FRONTEND_INCLUDE", "CUDNN_INCLUDE", "NVRTC_INCLUDE", "CXX"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let required = |var: &str| {
        let dir = std::env::var_os(var).map(PathBuf::from).filter(|d| d.is_dir());
        dir.unwrap_or_else(|| panic!("{var} is not set to a directory: build with scripts/build-cuda.sh, which fetches cuDNN's headers"))
    };
    let mut includes = vec![required("CUDNN_FRONTEND_INCLUDE"), required("CUDNN_INCLUDE")];
    // The frontend includes nvrtc.h, which the pip CUDA tree lacks (build-cuda.sh fetches it
    // apart), and cuda.h / cuda_runtime_api.h from the CUDA tree.
    includes.extend(std::env::var_os("NVRTC_INCLUDE").map(PathBuf::from));
    includes.extend(std::env::var_os("CUDA_ROOT").map(|r| PathBuf::from(r).join("include")));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cxx = std::env::var_os("CXX").unwrap_or_else(|| "c++".into());
    let obj = out.join("cudnn_sdpa.o");
    let mut compile = Command::new(&cxx);
    // `-isystem`: the frontend's own warnings are not this crate's.
    for dir in &includes {
        compile.arg("-isystem").arg(dir);
    }
    compile
        .args(["-std=c++17", "-O2", "-fPIC", "-Wall", "-Wextra", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING", "-c", "-o"])
        .arg(&obj)
        .arg("cpp/cudnn_sdpa.cpp");
    let status = compile.status().unwrap_or_else(|e| panic!("cannot run {} to compile cpp/cudnn_sdpa.cpp: {e}", cxx.to_string_lossy()));
    assert!(status.success(), "{} failed on cpp/cudnn_sdpa.cpp", cxx.to_string_lossy());
    let lib = out.join("libcudnn_sdpa.a");
    // `ar r` would keep the members of an older archive.
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar").arg("rcs").arg(&lib).arg(&obj).status().expect("cannot run ar");
    assert!(status.success(), "ar failed on {}", obj.display());
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=cudnn_sdpa");
    // The shared libstdc++, as candle-kernels' own C++ already asks for: one C++ runtime in the
    // process (a static copy beside it would give two sets of its statics).
    println!("cargo:rustc-link-lib=dylib=stdc++");
    // dlopen / dlsym (in libc itself since glibc 2.34, in libdl before).
    println!("cargo:rustc-link-lib=dylib=dl");
}
