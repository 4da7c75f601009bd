//! `pipeline parity` through the binary: the CPU's f32 path agrees with f64 within tolerance
//! (exit 0, JSON report), and a CUDA device in a CPU-only build is a clear error, not a panic.

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
