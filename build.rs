//! Build script: only for `--features cuda`. candle's kernels ask the linker for the shared
//! CUDA runtime (`-lcudart`); pointing that name at the static runtime of the CUDA tree
//! (`CUDA_ROOT`, set by scripts/build-cuda.sh) keeps the GPU binary free of a libcudart
//! dependency, so it starts on machines without CUDA and runs CPU configs there.

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
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
