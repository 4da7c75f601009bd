//! `pipeline parity`, `pipeline engine-check` and `pipeline attention-trial`: a device against
//! the CPU (the candle executor's kernels; the engine's backend), and one flash
//! implementation's trial (what `attention = "auto"` runs in a child process).

use crate::device::DeviceName;
use crate::train::attention_trial::{AttentionShape, TrialSettings};

/// `--device` as the user typed it: a device name, or the refusal printed (naming the flag,
/// not the config key `run.device` the same parser serves) and exit code 2 for a bad flag.
fn device_flag(device: &str) -> Result<DeviceName, i32> {
    crate::device::parse(device).map_err(|_| {
        err!("error: --device {device:?} is not a device: use \"cpu\" or \"cuda:N\"");
        2
    })
}

/// Compares `device` in `dtype` with the CPU in f64 and prints each comparison; exit 1 when
/// one is out of its bound.
pub fn parity(device: &str, dtype: &str, seed: u64, json: bool) -> i32 {
    if let Err(code) = device_flag(device) {
        return code;
    }
    let dtype = match dtype {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        other => {
            err!("error: --dtype {other:?}: use f32 or bf16");
            return 2;
        }
    };
    let result = crate::device::open_named(device).and_then(|d| crate::check::parity::run(&d, device, dtype, seed));
    match result {
        Ok(r) => {
            if json {
                out!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
            } else {
                out!("parity {} {} vs cpu f64: loss {:.6} vs {:.6}", r.device, r.dtype, r.loss.0, r.loss.1);
                for c in &r.compared {
                    let expected = c.expected.map(|x| format!(" (expected {x:.1e})")).unwrap_or_default();
                    let verdict = if c.ok() { "" } else { "  FAILED" };
                    out!("  {:<32} rel_err {:.3e}  bound {:.1e}{expected}{verdict}", c.name, c.rel_err, c.bound);
                }
                out!("bounds: {}", r.rule);
                let verdict = if r.ok { "ok, every error within its bound" } else { "FAILED" };
                out!("max rel_err {:.3e}, worst error / bound {:.2}: {verdict}", r.max_rel_err, r.worst_ratio);
            }
            if r.ok { 0 } else { 1 }
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

/// Checks the engine's backend on `device` against the CPU in f64 and times it
/// ([`crate::check::engine`]); prints the report (text or JSON) and writes its JSON to
/// `json_out` when given; exit 1 when an error is beyond its bound, 2 on a bad argument.
/// `--dtype` and `--activations` of `pipeline engine-check`, as given.
pub struct Precision<'a> {
    /// GEMM maths.
    pub dtype: Option<&'a str>,
    /// Storage of the activations.
    pub activations: Option<&'a str>,
    /// Attention of the timings and the graph check.
    pub attention: Option<&'a str>,
}

pub fn engine_check(
    device: &str,
    Precision { dtype, activations, attention }: Precision<'_>,
    timing: Option<&str>,
    rows: Option<usize>,
    seed: u64,
    json: bool,
    json_out: Option<&std::path::Path>,
) -> i32 {
    use crate::check::engine::{Options, TimingShape};
    let gpu = match device_flag(device) {
        Ok(d) => d != DeviceName::Cpu,
        Err(code) => return code,
    };
    let bf16 = match dtype.unwrap_or(if gpu { "bf16" } else { "f32" }) {
        "bf16" if gpu => true,
        "bf16" => {
            err!("error: --dtype bf16 is the GPU backend's GEMM maths; on the CPU the engine checks its f32 backend (--dtype f32)");
            return 2;
        }
        "f32" => false,
        other => {
            err!("error: --dtype {other:?}: use bf16 or f32");
            return 2;
        }
    };
    let bf16_activations = match activations.unwrap_or(if bf16 { "bf16" } else { "f32" }) {
        "f32" => false,
        "bf16" if bf16 => true,
        "bf16" => {
            err!("error: --activations bf16 is the GPU backend's with --dtype bf16");
            return 2;
        }
        other => {
            err!("error: --activations {other:?}: use f32 or bf16");
            return 2;
        }
    };
    let timing = match timing.unwrap_or(if gpu { "baseline" } else { "small" }) {
        "baseline" => TimingShape::Baseline,
        "record-0427" => TimingShape::Record0427,
        "small" => TimingShape::Small,
        "none" => TimingShape::None,
        other => {
            err!("error: --timing {other:?}: use baseline, record-0427, small or none");
            return 2;
        }
    };
    if rows == Some(0) {
        err!("error: --rows must be at least 1");
        return 2;
    }
    let cudnn = match attention.unwrap_or("flash_mma") {
        "flash_mma" => false,
        "cudnn" if gpu => true,
        "cudnn" => {
            err!("error: --attention cudnn is the GPU backend's; the CPU backend computes attention itself");
            return 2;
        }
        other => {
            err!("error: --attention {other:?}: use flash_mma or cudnn");
            return 2;
        }
    };
    let o = Options { device: device.to_string(), bf16, bf16_activations, cudnn, timing, rows, seed };
    match crate::check::engine::run(&o) {
        Ok(r) => {
            if let Some(path) = json_out {
                let written =
                    serde_json::to_vec_pretty(&r).map_err(anyhow::Error::from).and_then(|b| crate::runtime::rundir::write_atomic(path, &b));
                if let Err(e) = written {
                    err!("error: writing {}: {e:#}", path.display());
                    return 1;
                }
            }
            if json {
                let code = super::print_json(&r);
                if code != 0 {
                    return code;
                }
            } else {
                out_raw!("{}", crate::check::engine::text(&r));
            }
            if r.ok { 0 } else { 1 }
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

/// Runs one flash implementation's trial on `device` at `shape` and prints its outcome.
pub fn attention_trial(device: &str, kernels: &str, shape: AttentionShape, json: bool) -> i32 {
    if let Err(code) = device_flag(device) {
        return code;
    }
    use crate::model::flash_attn::FlashKernels;
    let Some(kernels) = FlashKernels::ALL.into_iter().find(|k| k.name() == kernels) else {
        err!("error: --kernels {kernels:?}: use flash or flash_mma");
        return 2;
    };
    if [shape.batch, shape.t, shape.heads, shape.kv_heads, shape.head_dim].contains(&0) || !shape.heads.is_multiple_of(shape.kv_heads) {
        err!("error: --batch, --seq-len, --heads, --kv-heads and --head-dim must be positive, --heads a multiple of --kv-heads");
        return 2;
    }
    let result = crate::device::open_named(device).and_then(|d| crate::train::attention_trial::check_flash(&d, kernels, shape));
    match result {
        Ok(o) => {
            if json {
                out!("{}", serde_json::to_string(&o).unwrap_or_default());
            } else {
                out!("{}", crate::train::attention_trial::summary(std::slice::from_ref(&o), shape, TrialSettings::flash()));
            }
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}
