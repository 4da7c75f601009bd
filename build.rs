//! Build script: only for `--features cuda`.
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

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    compile_kernels();
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

/// `kernels/NAME.cu` -> `$OUT_DIR/NAME.ptx` for every kernel file.
fn compile_kernels() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("CUDA_ROOT").map(|r| PathBuf::from(r).join("bin").join("nvcc")).filter(|p| p.is_file());
    let nvcc = nvcc.unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut files: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/ exists")
        .map(|e| e.expect("kernels/ is readable").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
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
        println!("cargo:rerun-if-changed={}", cu.display());
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
