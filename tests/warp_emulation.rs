//! The register-fragment flash-attention kernels (`kernels/flash_mma.cu`) run on the CPU in the
//! warp emulator (`tests/warp_emu`, built here with the machine's g++) and are compared with
//! attention in double: forward output and log-sum-exp, and the three input gradients. The
//! emulator also fails a kernel that reads shared memory another warp may still be writing
//! (a missing barrier or copy wait); the last tests break the kernels on purpose to show that
//! both kinds of mistake are caught.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Builds the check against `kernels` (None: the project's own file) into the test's temp dir.
fn build(name: &str, kernels: Option<&Path>) -> PathBuf {
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let mut cmd = Command::new("g++");
    cmd.args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-o"]).arg(&exe);
    cmd.arg("-I").arg(root().join("tests/warp_emu/include"));
    if let Some(k) = kernels {
        cmd.arg(format!("-DFLASH_MMA_SOURCE=\"{}\"", k.display()));
    }
    cmd.arg(root().join("tests/warp_emu/flash_mma_check.cpp"));
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run g++ (the warp emulator needs a C++20 compiler): {e}"));
    assert!(out.status.success(), "g++ failed on the warp emulator:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

fn run(exe: &Path, shape: &[&str]) -> (Output, String) {
    let out = Command::new(exe).args(shape).output().expect("the emulated check runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out, text)
}

/// A copy of the kernels with `from` replaced by `to` (which must occur exactly once).
fn mutant(name: &str, from: &str, to: &str) -> PathBuf {
    let src = std::fs::read_to_string(root().join("kernels/flash_mma.cu")).expect("kernels/flash_mma.cu");
    assert_eq!(src.matches(from).count(), 1, "`{from}` should occur once in kernels/flash_mma.cu");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.cu"));
    std::fs::write(&path, src.replace(from, to)).expect("temp dir is writable");
    path
}

/// Several tiles each way, two query heads per KV head, two sequences; then a group of four
/// heads on one KV head.
#[test]
fn flash_mma_kernels_match_attention_in_double() {
    let exe = build("flash_mma_check", None);
    for shape in [["2", "192", "4", "2", "7"], ["1", "128", "4", "1", "11"]] {
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
    let k = mutant("flash_mma_mask", "!diagonal || key <= q0 + c ?", "!diagonal || key < q0 + c ?");
    let (out, text) = run(&build("flash_mma_mask", Some(&k)), &["1", "128", "4", "2", "5"]);
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
