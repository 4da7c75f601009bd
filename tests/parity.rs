//! `pipeline parity` through the binary: the CPU's f32 path agrees with f64 within tolerance
//! (exit 0, JSON report), and a CUDA device in a CPU-only build is a clear error, not a panic.
//! Also `pipeline attention-trial`, the child process of `attention = "auto"`.

mod common;

use common::{assert_fails, bin, text};

#[test]
fn cpu_parity_passes_and_reports_every_parameter() {
    let o = bin().args(["parity", "--json"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["ok"], true);
    assert_eq!(r["dtype"], "f32");
    let names: Vec<&str> = r["compared"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names[0], "loss");
    assert!(names.contains(&"tok_emb.weight") && names.contains(&"blocks.1.mlp.proj.weight"), "{names:?}");
    assert!(r["max_rel_err"].as_f64().unwrap() <= r["tolerance"].as_f64().unwrap());

    // bf16: each quantity carries the error bf16 rounding alone gives it, and its bound.
    let o = bin().args(["parity", "--dtype", "bf16", "--json"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for c in r["compared"].as_array().unwrap() {
        let (e, x, b) = (c["rel_err"].as_f64().unwrap(), c["expected"].as_f64().unwrap(), c["bound"].as_f64().unwrap());
        // (serde_json parses floats to within an ulp)
        // The toy model's query gains have one value per head (4); every other gradient many.
        let name = c["name"].as_str().unwrap();
        let want = pipeline::check::parity::bf16_bound(name, if name.ends_with("q_gain") { 4 } else { 1 << 20 }, x);
        assert!(e <= b && x > 0.0 && (b - want).abs() <= 1e-12 * b, "{c}");
    }
    assert!(r["rule"].as_str().unwrap().contains("expected"), "{r}");
    assert!(r["worst_ratio"].as_f64().is_some_and(|w| w > 0.0 && w <= 1.0), "{r}");
}

#[test]
fn bad_device_and_dtype_are_clear_errors() {
    if pipeline::device::CUDA_BUILD {
        return; // a cuda build may well open the device
    }
    let o = bin().args(["parity", "--device", "cuda:0"]).output().unwrap();
    assert_fails(&o, &["`run.device`", "build-cuda.sh"]);
    let o = bin().args(["parity", "--dtype", "f8"]).output().unwrap();
    assert_fails(&o, &["--dtype"]);
    let o = bin().args(["parity", "--device", "tpu"]).output().unwrap();
    assert_fails(&o, &["not a device"]);
}

/// `attention-trial` on the CPU: the flash kernels cannot run there, so the outcome (exit 0,
/// JSON) leaves the implementation out with the reason; `attention = "auto"`'s choice, which
/// runs one such process per implementation, then refuses with both reasons and the way out.
#[test]
fn attention_trial_processes_report_why_flash_cannot_run() {
    let args = ["attention-trial", "--device", "cpu", "--batch", "2", "--seq-len", "128", "--heads", "2", "--kv-heads", "1", "--json"];
    let o = bin().args(args).args(["--kernels", "flash_mma"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["name"], "flash_mma");
    assert!(r["rejected"].as_str().is_some_and(|w| w.starts_with("failed: flash attention cannot run here")), "{r}");

    let shape = pipeline::train::attention_trial::AttentionShape { batch: 2, t: 128, heads: 2, kv_heads: 1, head_dim: 64 };
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_pipeline"));
    let all = pipeline::model::flash_attn::FlashKernels::ALL;
    let err = pipeline::train::attention_choice::choose_flash(exe, "cpu", shape, pipeline::train::attention_choice::TIMEOUT, &all)
        .unwrap_err()
        .to_string();
    assert!(err.contains("flash left out (failed: flash attention cannot run here"), "{err}");
    assert!(err.contains("flash_mma left out (failed: flash attention cannot run here"), "{err}");
    // cuDNN's trial says why it cannot run before timing anything (no fallback timed as cudnn).
    // (a `cuda` build says it runs on CUDA devices only; this one, that it has no `cuda`).
    assert!(
        err.contains("cudnn left out (this binary was built without the `cuda` feature)")
            || err.contains("cudnn left out (cuDNN runs on CUDA devices only)"),
        "{err}"
    );
    assert!(err.contains("set attention = \"materialized\""), "{err}");

    let o = bin().args(args).args(["--kernels", "flash3"]).output().unwrap();
    assert_fails(&o, &["--kernels", "flash_mma"]);
    let o = bin().args(["attention-trial", "--kernels", "flash", "--heads", "3", "--kv-heads", "2"]).output().unwrap();
    assert_fails(&o, &["--heads a multiple of --kv-heads"]);
}
