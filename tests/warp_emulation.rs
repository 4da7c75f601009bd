//! Kernels run on the CPU in the warp emulator (`tests/warp_emu`, built here with the machine's
//! g++) and compared with references:
//!
//! - the register-fragment flash-attention kernels (`kernels/flash_mma.cu`) against attention in
//!   double: forward output and log-sum-exp, and the three input gradients. The emulator also
//!   fails a kernel that reads shared memory another warp may still be writing (a missing
//!   barrier or copy wait);
//! - the mixed-precision row kernels of `kernels/fused.cu` against their one-type kernels
//!   followed by a cast (bit for bit), and those against double. Their device maths is in
//!   `kernels/ops/`, shared with the engine's kernels (whose own check is
//!   `cargo test --lib engine::gpu`).
//!
//! Some tests break a kernel on purpose to show that each kind of mistake is caught.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Builds `tests/warp_emu/{check}.cpp` into the test's temp dir as `name`; with `kernels`, the
/// check includes that file (through the `define` macro) instead of the project's own.
fn build_check(check: &str, name: &str, kernels: Option<(&str, &Path)>) -> PathBuf {
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let mut cmd = Command::new("g++");
    cmd.args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-o"]).arg(&exe);
    // The emulator's stand-ins for CUDA's headers first; then kernels/, for the ops' shared
    // device maths (`#include "ops/..."`) of a kernel file copied outside it.
    cmd.arg("-I").arg(root().join("tests/warp_emu/include"));
    cmd.arg("-I").arg(root().join("kernels"));
    if let Some((define, k)) = kernels {
        cmd.arg(format!("-D{define}=\"{}\"", k.display()));
    }
    cmd.arg(root().join(format!("tests/warp_emu/{check}.cpp")));
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run g++ (the warp emulator needs a C++20 compiler): {e}"));
    assert!(out.status.success(), "g++ failed on the warp emulator:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// Builds the flash check against `kernels` (None: the project's own file).
fn build(name: &str, kernels: Option<&Path>) -> PathBuf {
    build_check("flash_mma_check", name, kernels.map(|k| ("FLASH_MMA_SOURCE", k)))
}

fn run(exe: &Path, shape: &[&str]) -> (Output, String) {
    let out = Command::new(exe).args(shape).output().expect("the emulated check runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out, text)
}

/// A copy of `kernels/{main}` and of the shared headers `kernels/ops/` in the test's temp dir
/// (`{name}-src/`), with `from` replaced by `to` in `kernels/{file}` (`main` or a header; `from`
/// must occur exactly once there). Returns the copy of `main`, whose `#include "ops/..."`
/// finds the copied headers next to it.
fn mutant_of(main: &str, file: &str, name: &str, from: &str, to: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-src"));
    std::fs::create_dir_all(dir.join("ops")).expect("temp dir is writable");
    let mut files = vec![PathBuf::from(main)];
    for e in std::fs::read_dir(root().join("kernels/ops")).expect("kernels/ops exists") {
        files.push(Path::new("ops").join(e.expect("kernels/ops is readable").file_name()));
    }
    assert!(files.iter().any(|f| f == Path::new(file)), "kernels/{file} is not {main} or a header of kernels/ops");
    for f in files {
        let mut src = std::fs::read_to_string(root().join("kernels").join(&f)).expect("the kernel file");
        if f == Path::new(file) {
            assert_eq!(src.matches(from).count(), 1, "`{from}` should occur once in kernels/{file}");
            src = src.replace(from, to);
        }
        std::fs::write(dir.join(&f), src).expect("temp dir is writable");
    }
    dir.join(main)
}

fn mutant(name: &str, from: &str, to: &str) -> PathBuf {
    mutant_of("flash_mma.cu", "flash_mma.cu", name, from, to)
}

/// Several tiles each way, two query heads per KV head, two sequences; then a group of four
/// heads on one KV head.
#[test]
fn flash_mma_kernels_match_attention_in_double() {
    let exe = build("flash_mma_check", None);
    // The last: the document entry points (segments skip a key tile, empty a row's tile, and
    // mask dk/dv across query tiles).
    for shape in [["2", "192", "4", "2", "7", "0"], ["1", "128", "4", "1", "11", "0"], ["2", "192", "4", "2", "13", "1"]] {
        let (out, text) = run(&exe, &shape);
        assert!(out.status.success(), "shape {shape:?}:\n{text}");
        for tensor in ["o ", "lse", "dq ", "dk ", "dv "] {
            assert!(text.lines().any(|l| l.starts_with(tensor) && l.ends_with(" ok")), "{tensor} not checked:\n{text}");
        }
    }
}

/// A causal mask off by one (the diagonal key hidden from dk/dv) is a numerical failure.
#[test]
fn a_wrong_mask_fails_the_comparison() {
    let k = mutant("flash_mma_mask", "(!diagonal || key <= q0 + c)", "(!diagonal || key < q0 + c)");
    let (out, text) = run(&build("flash_mma_mask", Some(&k)), &["1", "128", "4", "2", "5"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("dk ") && l.ends_with("FAILED")), "{text}");
}

/// Within documents, a row that sees nothing of a key tile must keep its exponentials at 0:
/// with the running max's -inf used as it is, they are NaN. And the dk/dv mask of earlier
/// segments matters: without it dk is wrong.
#[test]
fn document_masks_that_break_fail_the_comparison() {
    let k = mutant("flash_mma_empty", "base[r] = DOCS && mn == -CUDART_INF_F ? 0.f : mn;", "base[r] = mn;");
    let (out, text) = run(&build("flash_mma_empty", Some(&k)), &["2", "192", "4", "2", "13", "1"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("o ") && l.ends_with("FAILED")), "{text}");
    let k = mutant("flash_mma_dkdv_docs", "(!DOCS || key >= (int)lo[st][c])", "(!DOCS || key >= 0)");
    let (out, text) = run(&build("flash_mma_dkdv_docs", Some(&k)), &["2", "192", "4", "2", "13", "1"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("dk ") && l.ends_with("FAILED")), "{text}");
}

/// Without the barrier that ends a tile, a warp refills the stage another warp still reads (from
/// the third tile on, hence 192 tokens): a
/// race the emulator reports whatever the threads' timing.
#[test]
fn a_missing_barrier_is_reported_as_a_race() {
    let k = mutant("flash_mma_race", "__syncthreads();  // every warp", "// every warp");
    let (out, text) = run(&build("flash_mma_race", Some(&k)), &["1", "192", "2", "2", "5"]);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("shared-memory race"), "{text}");
}

/// The mixed-precision row kernels equal their one-type kernels and a cast, bit for bit, and
/// those match double: rows not a multiple of a block, lengths not a multiple of a warp, several
/// partial sums.
#[test]
fn mixed_precision_row_kernels_equal_a_cast_and_the_f32_kernel() {
    let exe = build_check("fused_check", "fused_check", None);
    for shape in [["37", "70", "3"], ["130", "512", "4"]] {
        let (out, text) = run(&exe, &shape);
        assert!(out.status.success(), "shape {shape:?}:\n{text}");
        assert_eq!(text.lines().filter(|l| l.ends_with(" ok")).count(), 13 + 24, "{text}");
    }
}

/// A warp reduction (kernels/ops/reduce.cuh) that skips its last step is caught by the
/// comparison with double.
#[test]
fn a_broken_row_reduction_fails_the_comparison() {
    let k = mutant_of(
        "fused.cu",
        "ops/reduce.cuh",
        "fused_sum",
        "v += __shfl_xor_sync(0xffffffffu, v, o);",
        "v += o > 1 ? __shfl_xor_sync(0xffffffffu, v, o) : 0.f;",
    );
    let (out, text) = run(&build_check("fused_check", "fused_sum", Some(("FUSED_SOURCE", &k))), &["37", "70", "3"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("rms_norm_fwd_f32 vs double") && l.ends_with("FAILED")), "{text}");
}

/// The 16-byte-chunk norm_rope kernels reduce each row over its group of lanes (`group_sum` of
/// kernels/ops/reduce.cuh): a reduction that stops one step short (each lane sums half its row)
/// is caught in every head size, forward and backward, while the warp-per-row kernels still
/// pass.
#[test]
fn a_short_group_reduction_fails_the_norm_rope_comparison() {
    let k =
        mutant_of("fused.cu", "ops/reduce.cuh", "rope_group", "for (int o = L / 2; o > 0; o >>= 1)", "for (int o = L / 4; o > 0; o >>= 1)");
    let (out, text) = run(&build_check("fused_check", "rope_group", Some(("FUSED_SOURCE", &k))), &["37", "70", "3"]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let failed = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix) && l.ends_with("FAILED")).count();
    assert_eq!(failed("norm_rope_vec_"), 12, "{text}");
    assert_eq!(failed("norm_rope_fwd_") + failed("norm_rope_bwd_"), 0, "{text}");
}
