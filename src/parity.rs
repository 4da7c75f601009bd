//! `pipeline parity`: does a device compute what the CPU computes? A small GPT (the baseline's
//! architecture at toy size, seeded, so its weights are the same on every device) takes one
//! batch on the device in the given precision and on the CPU in f64; the loss and every
//! parameter's gradient are compared as relative errors against the precision's tolerance.
//! This is part (a) of `scripts/gpu-check.sh`; on a CPU build it checks the f32 path (fused
//! CPU ops) against f64.

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::compare::{rel_err, worst};
use crate::model::flash_attn::FlashKernels;
use crate::model::{Gpt, ModelConfig};

/// One compared quantity.
#[derive(Clone, Debug, Serialize)]
pub struct Compared {
    /// `loss` or the parameter's name.
    pub name: String,
    /// `‖device − reference‖ / ‖reference‖`.
    pub rel_err: f64,
}

/// What `pipeline parity` found.
#[derive(Clone, Debug, Serialize)]
pub struct ParityReport {
    /// The device checked.
    pub device: String,
    /// Its parameter dtype.
    pub dtype: String,
    /// Loss on the device and on the CPU in f64.
    pub loss: (f64, f64),
    /// Every comparison, loss first.
    pub compared: Vec<Compared>,
    /// The largest relative error.
    pub max_rel_err: f64,
    /// The tolerance for `dtype`.
    pub tolerance: f64,
    /// Whether every error is within it.
    pub ok: bool,
}

/// Tolerance on relative errors: bf16 keeps 8 bits of mantissa (about 4e-3 per rounding). The
/// CPU's f32 gradients measure about 4e-4 from f64 on the toy model (the loss 4e-8), nearly all
/// of it from RMS norm's epsilon, which is the dtype's machine epsilon as in PyTorch
/// (`F.rms_norm(eps=None)`): 1.2e-7 in f32 against the embedding rows' mean square of about
/// 2e-4. f32 gets 2e-3.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 | DType::F16 => 5e-2,
        DType::F32 => 2e-3,
        _ => 1e-9,
    }
}

/// The toy model: vocabulary 256, 2 layers, width 64, 4 heads, 2 KV heads.
fn toy() -> ModelConfig {
    ModelConfig { vocab_size: 256, num_layers: 2, model_dim: 64, num_heads: 4, num_kv_heads: 2, ..ModelConfig::default() }
}

/// Named values as f64 host vectors.
type Named = Vec<(String, Vec<f64>)>;

/// Loss and named gradients of `model` on `x`, `y`.
fn loss_and_grads(model: &Gpt, x: &Tensor, y: &Tensor) -> anyhow::Result<(f64, Named)> {
    let loss = model.loss(x, y)?;
    let grads = loss.backward()?;
    let mut out = Vec::new();
    for (name, var, _) in model.params() {
        let g = grads.get(var.as_tensor()).ok_or_else(|| anyhow::anyhow!("no gradient for `{name}`"))?;
        out.push((name.clone(), g.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f64>()?));
    }
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, out))
}

/// Compares `device` in `dtype` against the CPU in f64 on one batch of 4 x 64 tokens.
pub fn run(device: &Device, device_name: &str, dtype: DType, seed: u64) -> anyhow::Result<ParityReport> {
    let cfg = toy();
    let (rows, t) = (4usize, 64usize);
    let mut rng = fastrand::Rng::with_seed(seed);
    let toks: Vec<u32> = (0..rows * (t + 1)).map(|_| rng.u32(0..cfg.vocab_size as u32)).collect();
    let x: Vec<u32> = (0..rows).flat_map(|r| toks[r * (t + 1)..r * (t + 1) + t].to_vec()).collect();
    let y: Vec<u32> = (0..rows).flat_map(|r| toks[r * (t + 1) + 1..(r + 1) * (t + 1)].to_vec()).collect();
    let batch = |d: &Device| -> anyhow::Result<(Tensor, Tensor)> {
        Ok((Tensor::from_slice(&x, (rows, t), d)?, Tensor::from_slice(&y, (rows, t), d)?))
    };
    let reference = Gpt::new(&cfg, seed, DType::F64, &Device::Cpu)?;
    // The zero-initialised output projections would make most gradients zero: perturb every
    // parameter the same way on both sides (host-side values, so both get the same numbers).
    let mut prng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let mut state = std::collections::HashMap::new();
    for (name, var, _) in reference.params() {
        let base = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
        let v: Vec<f64> = base.iter().map(|b| b + 0.02 * (prng.f64() * 2.0 - 1.0)).collect();
        state.insert(name.clone(), Tensor::from_vec(v, var.dims(), &Device::Cpu)?);
    }
    let mut reference = reference;
    reference.load_state(&state)?;
    // bf16 is the executor's mixed precision: f32 weights, bf16 matmuls.
    let (param_dtype, matmul_dtype) = if dtype == DType::BF16 { (DType::F32, DType::BF16) } else { (dtype, dtype) };
    let mut model = Gpt::new(&cfg, seed, param_dtype, device)?.with_matmul_dtype(matmul_dtype);
    model.load_state(&state)?;
    let (rx, ry) = batch(&Device::Cpu)?;
    let (ref_loss, ref_grads) = loss_and_grads(&reference, &rx, &ry)?;
    let (dx, dy) = batch(device)?;
    let (dev_loss, dev_grads) = loss_and_grads(&model, &dx, &dy)?;
    let mut compared = vec![Compared { name: "loss".into(), rel_err: ((dev_loss - ref_loss) / ref_loss).abs() }];
    for ((name, g), (_, r)) in dev_grads.iter().zip(&ref_grads) {
        compared.push(Compared { name: name.clone(), rel_err: rel_err(g, r) });
    }
    if !device.is_cpu() {
        compared.extend(kernel_checks(device, dtype, seed)?);
        #[cfg(feature = "cuda")]
        for (name, dedicated) in [("upload stream", true), ("upload sync", false)] {
            // 3 x the copy stream's ring: every slot is reused twice.
            // The count itself is the error: one differing token is over every tolerance.
            let (differing, of) = crate::cuda_copy::check_copies(device, dedicated, 3 * crate::cuda_copy::RING)?;
            compared.push(Compared { name: format!("{name}: tokens differing of {of}"), rel_err: differing as f64 });
        }
    }
    let max_rel_err = worst(compared.iter().map(|c| c.rel_err));
    let tol = tolerance(dtype);
    Ok(ParityReport {
        device: device_name.into(),
        dtype: if dtype == DType::BF16 { "bf16 matmuls, f32 weights".into() } else { format!("{dtype:?}").to_lowercase() },
        loss: (dev_loss, ref_loss),
        ok: max_rel_err.is_finite() && max_rel_err <= tol,
        compared,
        max_rel_err,
        tolerance: tol,
    })
}

/// [`crate::model::norm_rope::norm_rope`] of `x` `(N, heads * D)` with RoPE tables for
/// sequences of `t`.
fn norm_rope_case(x: &Tensor, t: usize, heads: usize) -> candle_core::Result<Tensor> {
    let d = x.dim(1)? / heads;
    let (cos, sin) = crate::model::ops::rope_tables(t, d, 10_000.0, x.dtype(), x.device())?;
    crate::model::norm_rope::norm_rope(x, &Tensor::cat(&[&cos, &sin], 1)?, heads)
}

/// Attention of `b` sequences with `heads` query heads over `kv` KV heads of 64 channels, q, k
/// and v the column blocks of `x` `(b*t, (heads + 2 kv) * 64)`: the flash `kernels` where they
/// run (CUDA, bf16), the fused attention elsewhere (its CPU implementation is the reference).
fn attention_case(x: &Tensor, b: usize, heads: usize, kv: usize, kernels: FlashKernels) -> candle_core::Result<Tensor> {
    use crate::model::flash_attn;
    let d = flash_attn::HEAD_DIM;
    let (q, k, v) = (x.narrow(1, 0, heads * d)?, x.narrow(1, heads * d, kv * d)?, x.narrow(1, (heads + kv) * d, kv * d)?);
    if flash_attn::unsupported(q.device(), q.dtype(), x.dim(0)? / b, d).is_none() {
        flash_attn::flash_attention(&q, &k, &v, b, heads, kv, kernels)
    } else {
        crate::model::fused::causal_attention_tokens(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, b, heads, kv)
    }
}

/// `x` in f32 when it is bf16 (the residual stream's dtype under mixed precision), else itself.
fn widened(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.dtype() == DType::BF16 { crate::model::cast::cast(x, DType::F32) } else { Ok(x.clone()) }
}

/// A device op and the shape of the random input it is checked on.
type KernelCase = (&'static str, Vec<usize>, fn(&Tensor) -> candle_core::Result<Tensor>);

/// The device's own kernels against their CPU references in f64, on random inputs of awkward
/// sizes (rows not a multiple of a block, lengths not a multiple of a warp): each op's output
/// and the gradient of its input under a random output gradient, as `kernel <op> <shape>
/// out|grad`.
pub fn kernel_checks(device: &Device, dtype: DType, seed: u64) -> anyhow::Result<Vec<Compared>> {
    use crate::model::{causal_softmax::causal_softmax, fused};
    let cases: Vec<KernelCase> = vec![
        ("causal_softmax", vec![2, 3, 128, 128], |x| causal_softmax(x, 0.125)),
        ("causal_softmax", vec![1, 2, 1000, 1000], |x| causal_softmax(x, 0.3)),
        ("rms_norm", vec![1000, 512], fused::rms_norm),
        ("rms_norm", vec![37, 3, 70], fused::rms_norm),
        ("relu_sq", vec![333, 1024], fused::relu_sq),
        ("norm_rope", vec![3 * 100, 4 * 64], |x| norm_rope_case(x, 100, 4)),
        ("norm_rope", vec![2 * 9, 3 * 6], |x| norm_rope_case(x, 9, 3)),
        // The per-channel parameters are rows of x itself, so that their gradients are checked too.
        ("scale_add", vec![257, 96], |x| fused::scale_add(&(x * 0.5)?, x, &x.get(0)?)),
        ("scale_cols", vec![100, 64], |x| fused::scale_cols(x, &x.get(3)?)),
        ("embedding", vec![50, 512], |w| {
            crate::model::embedding::embedding(
                w,
                &Tensor::from_vec((0..3000u32).map(|i| (i * 7919) % 49).collect::<Vec<u32>>(), 3000, w.device())?,
            )
        }),
        ("resid_mix", vec![130, 512], |x| fused::resid_mix(x, &((x * 0.3)? + 0.1)?, &x.narrow(0, 0, 2)?)),
        // Mixed precision where the kernels run bf16: the f32 stream's inputs are x widened (the
        // `_f32_bf16` kernels); in the f64 reference everything stays f64.
        ("rms_norm_to", vec![1000, 512], |x| fused::rms_norm_to(&widened(x)?, x.dtype())),
        ("rms_norm_to", vec![37, 70], |x| fused::rms_norm_to(&widened(x)?, x.dtype())),
        ("scale_add_mixed", vec![257, 96], |x| fused::scale_add(&widened(&(x * 0.5)?)?, x, &widened(&x.get(0)?)?)),
        // Logits scaled so that the soft-cap (30) bends them; targets spread over the classes.
        ("softcap_ce", vec![300, 1024], |x| {
            let targets = Tensor::from_vec((0..300u32).map(|i| (i * 7919) % 1024).collect::<Vec<u32>>(), 300, x.device())?;
            fused::softcap_cross_entropy(&(x * 20.0)?, &targets, 30.0)
        }),
        ("softcap_ce", vec![7, 50], |x| {
            let targets = Tensor::from_vec(vec![0u32, 49, 3, 17, 25, 49, 1], 7, x.device())?;
            fused::softcap_cross_entropy(&(x * 20.0)?, &targets, 30.0)
        }),
        // Several tiles each way, grouped heads (and, with one KV head, a group of four); both
        // implementations of the flash kernels.
        ("attention", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_case(x, 2, 4, 2, FlashKernels::Wmma)),
        ("attention", vec![3 * 64, (4 + 2) * 64], |x| attention_case(x, 3, 4, 1, FlashKernels::Wmma)),
        ("attention_mma", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_case(x, 2, 4, 2, FlashKernels::Mma)),
        ("attention_mma", vec![3 * 64, (4 + 2) * 64], |x| attention_case(x, 3, 4, 1, FlashKernels::Mma)),
    ];
    let kernel_dtype = if dtype == DType::F64 { DType::F32 } else { dtype };
    let mut rng = fastrand::Rng::with_seed(seed ^ 0xcafe);
    let mut out = Vec::new();
    for (name, shape, op) in cases {
        let n: usize = shape.iter().product();
        let x = Tensor::from_vec((0..n).map(|_| rng.f64() * 4.0 - 2.0).collect::<Vec<f64>>(), shape.as_slice(), &Device::Cpu)?;
        let g_seed = rng.u64(..);
        let run = |d: &Device, dt: DType| -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
            let x = candle_core::Var::from_tensor(&x.to_dtype(dt)?.to_device(d)?)?;
            let y = op(x.as_tensor())?;
            // The same output gradient on both sides, of the output's shape.
            let mut grng = fastrand::Rng::with_seed(g_seed);
            let g = Tensor::from_vec((0..y.elem_count()).map(|_| grng.f64() * 2.0 - 1.0).collect::<Vec<f64>>(), y.shape(), &Device::Cpu)?;
            let grads = (&y * g.to_dtype(dt)?.to_device(d)?)?.sum_all()?.backward()?;
            let dx = grads.get(x.as_tensor()).ok_or_else(|| anyhow::anyhow!("{name}: no gradient"))?;
            let host =
                |t: &Tensor| -> anyhow::Result<Vec<f64>> { Ok(t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?) };
            Ok((host(&y)?, host(dx)?))
        };
        let (want_y, want_dx) = run(&Device::Cpu, DType::F64)?;
        let (got_y, got_dx) = run(device, kernel_dtype)?;
        out.push(Compared { name: format!("kernel {name} {shape:?} out"), rel_err: rel_err(&got_y, &want_y) });
        out.push(Compared { name: format!("kernel {name} {shape:?} grad"), rel_err: rel_err(&got_dx, &want_dx) });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU's f32 path (fused ops) agrees with f64; and the check can fail: an f32 model
    /// judged against the f64 tolerance does not pass.
    #[test]
    fn cpu_f32_matches_f64_and_the_check_can_fail() {
        let r = run(&Device::Cpu, "cpu", DType::F32, 3).unwrap();
        assert!(r.ok, "{r:?}");
        assert_eq!(r.compared.len(), 1 + Gpt::new(&toy(), 3, DType::F32, &Device::Cpu).unwrap().params().len());
        assert!(r.compared.iter().all(|c| c.rel_err > 0.0), "f32 cannot equal f64 exactly: {r:?}");
        assert!(r.max_rel_err > tolerance(DType::F64), "{}", r.max_rel_err);
    }

    /// The kernel checks' plumbing on the CPU (the ops' CPU implementations in f32 against
    /// f64): close but not exact, for every case.
    #[test]
    fn kernel_checks_compare_outputs_and_gradients() {
        let r = kernel_checks(&Device::Cpu, DType::F32, 1).unwrap();
        assert_eq!(r.len(), 40);
        assert!(r.iter().all(|c| c.rel_err > 0.0 && c.rel_err < 1e-5), "{r:?}");
    }

    /// The mixed precision (bf16 matmuls over f32 weights) runs on the CPU too: within the bf16
    /// tolerance, and clearly less exact than f32 (the matmuls really are bf16).
    #[test]
    fn cpu_mixed_bf16_is_within_tolerance() {
        let r = run(&Device::Cpu, "cpu", DType::BF16, 3).unwrap();
        assert!(r.ok, "{r:?}");
        let f32 = run(&Device::Cpu, "cpu", DType::F32, 3).unwrap();
        assert!(r.max_rel_err > 2.0 * f32.max_rel_err, "bf16 {} vs f32 {}", r.max_rel_err, f32.max_rel_err);
    }
}
