//! The whole GPT written from its formulas with plain candle ops in f64 (tests only): what every
//! model element ([`ModelConfig`]'s switches) is checked against. Heads are reshaped to
//! `(B, H, T, D)` here, as the record's script does, where the model keeps token-major matrices
//! and fused ops; the reference ops are [`ops::rms_norm_reference`], [`ops::rope`] and
//! [`ops::causal_attention_reference`].

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};

use super::ops;
use super::{MlpActivation, ModelConfig};

/// Soft-capped logits `(B*T, V)` of the model `cfg` with parameters `p` (by `state_dict` name,
/// f64) for input ids `x` `(B, T)`.
pub(crate) fn logits(cfg: &ModelConfig, p: &HashMap<String, Tensor>, x: &Tensor) -> Result<Tensor> {
    let (b, t) = x.dims2()?;
    let emb = &p["tok_emb.weight"];
    let mut h = ops::rms_norm_reference(&emb.index_select(&x.flatten_all()?, 0)?)?;
    let x0 = h.clone();
    let (cos, sin) = ops::rope_tables(t, cfg.head_dim(), cfg.rope_base, DType::F64, &Device::Cpu)?;
    let mask = ops::causal_mask(t, DType::F64, &Device::Cpu)?;
    let block = |i: usize, h: &Tensor| block(cfg, p, i, h, &x0, (b, t), (&cos, &sin, &mask));
    let enc = cfg.encoder_layers();
    let mut skips = Vec::new();
    for i in 0..enc {
        h = block(i, &h)?;
        skips.push(h.clone());
    }
    for j in 0..cfg.num_layers - enc {
        if let Some(s) = skips.pop() {
            // skip = w_j * s; gated: h = g h + (1 - g) skip with g = sigmoid(z_j); else h + skip.
            let skip = s.broadcast_mul(&p["skip_weights"].get(j)?)?;
            h = if cfg.skip_gates {
                let z = p["skip_gates"].get(j)?.to_vec1::<f64>()?;
                let g = Tensor::from_vec(z.iter().map(|z| 1.0 / (1.0 + (-z).exp())).collect::<Vec<_>>(), z.len(), &Device::Cpu)?;
                (h.broadcast_mul(&g)? + skip.broadcast_mul(&(1.0 - &g)?)?)?
            } else {
                (h + skip)?
            };
        }
        h = block(enc + j, &h)?;
    }
    let head = if cfg.tie_embeddings { emb } else { &p["lm_head.weight"] };
    ops::softcap(&ops::rms_norm_reference(&h)?.matmul(&head.t()?)?, cfg.logit_softcap)
}

/// Block `i`: `u = mix0 h + mix1 x0`, then attention and MLP of `rms_norm(u) * s` added to `u`
/// in turn (sequential) or both from the same `u` (parallel), `s = 1/sqrt(i + 1)` under
/// `ln_scale`.
fn block(
    cfg: &ModelConfig,
    p: &HashMap<String, Tensor>,
    i: usize,
    h: &Tensor,
    x0: &Tensor,
    (b, t): (usize, usize),
    (cos, sin, mask): (&Tensor, &Tensor, &Tensor),
) -> Result<Tensor> {
    let w = |s: &str| &p[&format!("blocks.{i}.{s}")];
    let mix = w("resid_mix");
    let u = (h.broadcast_mul(&mix.get(0)?)? + x0.broadcast_mul(&mix.get(1)?)?)?;
    let s = if cfg.ln_scale { 1.0 / ((i + 1) as f64).sqrt() } else { 1.0 };
    let normed = |u: &Tensor| -> Result<Tensor> { ops::rms_norm_reference(u)? * s };
    let attn = |x: &Tensor| attention(cfg, p, i, x, (b, t), (cos, sin, mask));
    let mlp = |x: &Tensor| mlp(cfg, p, i, x);
    let parallel = cfg.parallel_residual_start.is_some_and(|start| i >= start);
    if parallel {
        let n = normed(&u)?;
        let a = attn(&n)?.broadcast_mul(w("attn_scale"))?;
        let m = mlp(&n)?.broadcast_mul(w("mlp_scale"))?;
        return (u + a)? + m;
    }
    let u = (&u + attn(&normed(&u)?)?.broadcast_mul(w("attn_scale"))?)?;
    &u + mlp(&normed(&u)?)?.broadcast_mul(w("mlp_scale"))?
}

/// Causal GQA attention of the `(B*T, D)` input: per-head RMS norm and RoPE of q and k, the
/// query gain per head, softmax attention, the output projection.
fn attention(
    cfg: &ModelConfig,
    p: &HashMap<String, Tensor>,
    i: usize,
    x: &Tensor,
    (b, t): (usize, usize),
    (cos, sin, mask): (&Tensor, &Tensor, &Tensor),
) -> Result<Tensor> {
    let w = |s: &str| &p[&format!("blocks.{i}.attn.{s}")];
    let (hd, heads, kv) = (cfg.head_dim(), cfg.num_heads, cfg.num_kv_heads);
    // (B*T, n*hd) -> (B, n, T, hd).
    let split = |y: Tensor, n: usize| y.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
    let q = ops::rope(&ops::rms_norm_reference(&split(x.matmul(&w("c_q.weight").t()?)?, heads)?)?, cos, sin)?;
    let q = q.broadcast_mul(&w("q_gain").reshape((1, heads, 1, 1))?)?;
    let k = ops::rope(&ops::rms_norm_reference(&split(x.matmul(&w("c_k.weight").t()?)?, kv)?)?, cos, sin)?;
    let v = split(x.matmul(&w("c_v.weight").t()?)?, kv)?;
    let y = ops::causal_attention_reference(&q, &k, &v, mask)?;
    let y = y.transpose(1, 2)?.contiguous()?.reshape((b * t, heads * hd))?;
    y.matmul(&w("proj.weight").t()?)
}

/// `act(x Wfc^T) Wproj^T`, `act` relu² or leaky-relu² (scalar formula).
fn mlp(cfg: &ModelConfig, p: &HashMap<String, Tensor>, i: usize, x: &Tensor) -> Result<Tensor> {
    let w = |s: &str| &p[&format!("blocks.{i}.mlp.{s}")];
    let pre = x.matmul(&w("fc.weight").t()?)?;
    let slope = match cfg.mlp_activation {
        MlpActivation::Relu2 => 0.0,
        MlpActivation::LeakyRelu2 => cfg.leaky_relu_slope,
    };
    let v: Vec<f64> = pre.flatten_all()?.to_vec1::<f64>()?.iter().map(|&u| if u > 0.0 { u * u } else { (slope * u).powi(2) }).collect();
    let act = Tensor::from_vec(v, pre.dims(), &Device::Cpu)?;
    act.matmul(&w("proj.weight").t()?)
}

/// Asserts that the gradient of `m`'s loss on `x`, `y` (an f64 model) matches central finite
/// differences at three coordinates of every parameter (the first, middle and last).
pub(crate) fn assert_gradients_match_finite_differences(m: &super::Gpt, x: &Tensor, y: &Tensor) {
    let grads = m.loss(x, y).unwrap().backward().unwrap();
    let eps = 1e-6;
    for (name, var, _) in m.params() {
        let g =
            grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}")).flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let base: Vec<f64> = var.flatten_all().unwrap().to_vec1().unwrap();
        for idx in [0, base.len() / 2, base.len() - 1] {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[idx] += delta;
                var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap()).unwrap();
                m.loss(x, y).unwrap().to_scalar::<f64>().unwrap()
            };
            let fd = (eval(eps) - eval(-eps)) / (2.0 * eps);
            var.set(&Tensor::from_vec(base.clone(), var.dims(), &Device::Cpu).unwrap()).unwrap();
            let tol = 1e-6 + 1e-4 * fd.abs().max(g[idx].abs());
            assert!((fd - g[idx]).abs() < tol, "{name}[{idx}]: finite difference {fd}, backward {}", g[idx]);
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::model::Gpt;

    fn tiny() -> ModelConfig {
        ModelConfig { vocab_size: 16, num_layers: 4, model_dim: 16, num_heads: 4, num_kv_heads: 2, mlp_mult: 2, ..ModelConfig::default() }
    }

    /// Every element on: the record's switches at a tiny size.
    fn all_on() -> ModelConfig {
        ModelConfig {
            mlp_activation: MlpActivation::LeakyRelu2,
            ln_scale: true,
            parallel_residual_start: Some(2),
            skip_gates: true,
            tie_embeddings: false,
            ..tiny()
        }
    }

    /// A tiny f64 model of `cfg` with every parameter drawn non-trivially (the zero-initialised
    /// projections would hide most of the graph).
    fn model(cfg: &ModelConfig, seed: u64) -> Gpt {
        let m = Gpt::new(cfg, seed, DType::F64, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
        for (_, v, _) in m.params() {
            let vals: Vec<f64> = (0..v.elem_count()).map(|_| rng.f64() * 1.2 - 0.6).collect();
            v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        m
    }

    fn ids(b: usize, t: usize, v: u32, seed: u32) -> Tensor {
        Tensor::from_vec((0..(b * t) as u32).map(|i| (i * 7 + seed) % v).collect::<Vec<_>>(), (b, t), &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.flatten_all().unwrap().to_vec1::<f64>().unwrap(), b.flatten_all().unwrap().to_vec1::<f64>().unwrap());
        a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    /// Each element alone, and all together, give the logits of the formulas, on the CPU's
    /// fused ops and in the GPU formulation.
    #[test]
    fn every_element_matches_the_formulas() {
        let cases: Vec<(&str, ModelConfig)> = vec![
            ("baseline", tiny()),
            ("leaky_relu2", ModelConfig { mlp_activation: MlpActivation::LeakyRelu2, leaky_relu_slope: 0.3, ..tiny() }),
            ("ln_scale", ModelConfig { ln_scale: true, ..tiny() }),
            ("parallel_residual_start", ModelConfig { parallel_residual_start: Some(1), ..tiny() }),
            ("skip_gates", ModelConfig { skip_gates: true, ..tiny() }),
            ("all", all_on()),
        ];
        let x = ids(2, 6, 16, 3);
        for (name, cfg) in cases {
            let m = model(&cfg, 7);
            let params: HashMap<String, Tensor> = m.state_dict().into_iter().collect();
            let want = logits(&cfg, &params, &x).unwrap();
            let got = m.logits(&x).unwrap();
            let d = max_diff(&got, &want);
            assert!(d < 1e-9, "{name}: logits differ from the formulas by {d:.3e}");
            // The GPU's graph (its kernels' CPU references, in f64) computes the same.
            let gpu = crate::model::with_gpu_formulation(|| m.logits(&x)).unwrap();
            let d = max_diff(&gpu, &want);
            assert!(d < 1e-9, "{name}: the GPU formulation differs from the formulas by {d:.3e}");
        }
    }

    /// The reference is not vacuous: each switch changes the logits of the same weights.
    #[test]
    fn each_switch_changes_the_model() {
        let x = ids(2, 6, 16, 5);
        let base = tiny();
        let m = model(&base, 9);
        let params: HashMap<String, Tensor> = m.state_dict().into_iter().collect();
        let plain = logits(&base, &params, &x).unwrap();
        for (name, cfg) in [
            ("leaky_relu2", ModelConfig { mlp_activation: MlpActivation::LeakyRelu2, ..base.clone() }),
            ("ln_scale", ModelConfig { ln_scale: true, ..base.clone() }),
            ("parallel_residual_start", ModelConfig { parallel_residual_start: Some(0), ..base.clone() }),
        ] {
            let mut other = Gpt::new(&cfg, 0, DType::F64, &Device::Cpu).unwrap();
            other.load_state(&params).unwrap();
            let d = max_diff(&other.logits(&x).unwrap(), &plain);
            assert!(d > 1e-6, "{name} changed nothing ({d:.1e})");
        }
    }

    /// Gradients with every element on, against central finite differences.
    #[test]
    fn gradients_with_every_element_match_finite_differences() {
        let cfg = all_on();
        let m = model(&cfg, 11);
        let (x, y) = (ids(2, 5, 16, 1), ids(2, 5, 16, 4));
        assert_gradients_match_finite_differences(&m, &x, &y);
    }

    /// The skip gates are parameters of their own, zero at init (the gate 0.5), in the scalar
    /// group; bad switches are refused with the key named.
    #[test]
    fn skip_gates_are_parameters_and_bad_keys_are_named() {
        let cfg = ModelConfig { skip_gates: true, ..tiny() };
        let m = Gpt::new(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let gates = m.param("skip_gates").unwrap();
        assert_eq!(gates.dims(), [cfg.skip_count(), 16]);
        assert!(gates.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&z| z == 0.0));
        assert_eq!(crate::model::gpt_group_of("skip_gates", 2), crate::model::ParamGroup::Scalar);
        assert_eq!(m.param_count(), Gpt::new(&tiny(), 1, DType::F32, &Device::Cpu).unwrap().param_count() + cfg.skip_count() * 16);
        for (bad, key) in [
            (ModelConfig { parallel_residual_start: Some(4), ..tiny() }, "model.parallel_residual_start"),
            (ModelConfig { leaky_relu_slope: 1.5, ..tiny() }, "model.leaky_relu_slope"),
            (ModelConfig { leaky_relu_slope: -0.5, ..tiny() }, "model.leaky_relu_slope"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }
}
