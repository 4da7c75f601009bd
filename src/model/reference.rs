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
/// f64) for input ids `x` `(B, T)`, with depth recurrence on when `looped`.
pub(crate) fn logits(cfg: &ModelConfig, p: &HashMap<String, Tensor>, x: &Tensor, looped: bool) -> Result<Tensor> {
    let (b, t) = x.dims2()?;
    let emb = &p["tok_emb.weight"];
    let mut e = emb.index_select(&x.flatten_all()?, 0)?;
    if cfg.bigram_vocab_size > 0 {
        // BigramHash: row (36313 x_i XOR 27191 x_{i-1}) mod (B - 1) of the table, the last row
        // at a row's first position, projected (when narrower) and scaled.
        let m = cfg.bigram_vocab_size as i64 - 1;
        let rows: Vec<Vec<u32>> = x.to_vec2()?;
        let bucket = |r: &[u32], i: usize| if i == 0 { m } else { ((36313 * r[i] as i64) ^ (27191 * r[i - 1] as i64)) % m };
        let buckets: Vec<u32> = rows.iter().flat_map(|r| (0..t).map(move |i| bucket(r, i) as u32)).collect();
        let mut g = p["bigram.embed.weight"].index_select(&Tensor::new(buckets, &Device::Cpu)?, 0)?;
        if let Some(w) = p.get("bigram.proj.weight") {
            g = g.matmul(&w.t()?)?;
        }
        e = (e + g.broadcast_mul(&p["bigram.scale"])?)?;
    }
    let mut h = ops::rms_norm_reference(&e)?;
    let x0 = h.clone();
    // Partial RoPE: tables for the first r dims, base NTK-rescaled past the training length.
    let r = cfg.rope_dims.unwrap_or(cfg.head_dim());
    let base = match cfg.rope_train_seq_len {
        Some(l) if t > l => cfg.rope_base * (t as f64 / l as f64).powf(r as f64 / (r as f64 - 2.0)),
        _ => cfg.rope_base,
    };
    let (cos, sin) = ops::rope_tables(t, r, base, DType::F64, &Device::Cpu)?;
    let mask = ops::causal_mask(t, DType::F64, &Device::Cpu)?;
    let block = |i: usize, h: &Tensor| block(cfg, p, i, h, &x0, (b, t), (&cos, &sin, &mask));
    // The layer sequence: [0, s) + [s..=e] * (loops + 1) + (e, L) when looped, else 0..L;
    // its first half encodes (pushing skips), the rest decodes.
    let mut order: Vec<usize> = (0..cfg.num_layers).collect();
    if looped && cfg.num_loops > 0 {
        order = (0..cfg.loop_start).collect();
        for _ in 0..=cfg.num_loops {
            order.extend(cfg.loop_start..=cfg.loop_end);
        }
        order.extend(cfg.loop_end + 1..cfg.num_layers);
    }
    let (enc, dec) = order.split_at(order.len() / 2);
    let mut skips = Vec::new();
    for &i in enc {
        h = block(i, &h)?;
        skips.push(h.clone());
    }
    for (j, &i) in dec.iter().enumerate() {
        if j < p["skip_weights"].dim(0)?
            && let Some(s) = skips.pop()
        {
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
        h = block(i, &h)?;
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
    // RoPE on the first r dims only (r = 2 * the tables' width); the rest pass through.
    let r = 2 * cos.dim(1)?;
    let rope = |y: Tensor| -> Result<Tensor> {
        let rotated = ops::rope(&y.narrow(3, 0, r)?, cos, sin)?;
        if r == hd { Ok(rotated) } else { Tensor::cat(&[&rotated, &y.narrow(3, r, hd - r)?], 3) }
    };
    let q = rope(ops::rms_norm_reference(&split(x.matmul(&w("c_q.weight").t()?)?, heads)?)?)?;
    let q = q.broadcast_mul(&w("q_gain").reshape((1, heads, 1, 1))?)?;
    let k = rope(ops::rms_norm_reference(&split(x.matmul(&w("c_k.weight").t()?)?, kv)?)?)?;
    let v = split(x.matmul(&w("c_v.weight").t()?)?, kv)?;
    let mut y = ops::causal_attention_reference(&q, &k, &v, mask)?;
    if i + cfg.xsa_last_n >= cfg.num_layers {
        // XSA: y_h -= (y_h . v^) v^ with v^ the unit value of the head's KV group, same token.
        let vhat = v.broadcast_div(&v.sqr()?.sum_keepdim(3)?.sqrt()?)?;
        let vhat = ops::repeat_kv(&vhat, heads)?;
        y = (&y - y.mul(&vhat)?.sum_keepdim(3)?.broadcast_mul(&vhat)?)?;
    }
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

    /// Head dim 8 (room for partial RoPE), 2 query heads per KV head, 5 blocks (an odd count,
    /// so the U-Net halves differ).
    fn tiny() -> ModelConfig {
        ModelConfig { vocab_size: 16, num_layers: 5, model_dim: 32, num_heads: 4, num_kv_heads: 2, mlp_mult: 2, ..ModelConfig::default() }
    }

    /// Blocks 1..=2 run twice once looped: [0, 1, 2, 1, 2, 3, 4].
    fn looped() -> ModelConfig {
        ModelConfig { loop_start: 1, loop_end: 2, num_loops: 1, enable_looping_at: 0.5, ..tiny() }
    }

    /// Every element on: the record's switches at a tiny size.
    fn all_on() -> ModelConfig {
        ModelConfig {
            mlp_activation: MlpActivation::LeakyRelu2,
            ln_scale: true,
            parallel_residual_start: Some(3),
            skip_gates: true,
            rope_dims: Some(4),
            rope_train_seq_len: Some(4),
            xsa_last_n: 5,
            tie_embeddings: false,
            bigram_vocab_size: 11,
            bigram_dim: 8,
            ..looped()
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
    /// fused ops and in the GPU formulation; a recurrent model in both layouts.
    #[test]
    fn every_element_matches_the_formulas() {
        let cases: Vec<(&str, ModelConfig)> = vec![
            ("baseline", tiny()),
            ("leaky_relu2", ModelConfig { mlp_activation: MlpActivation::LeakyRelu2, leaky_relu_slope: 0.3, ..tiny() }),
            ("ln_scale", ModelConfig { ln_scale: true, ..tiny() }),
            ("parallel_residual_start", ModelConfig { parallel_residual_start: Some(1), ..tiny() }),
            ("skip_gates", ModelConfig { skip_gates: true, ..tiny() }),
            ("rope_dims", ModelConfig { rope_dims: Some(4), ..tiny() }),
            ("rope_train_seq_len", ModelConfig { rope_dims: Some(6), rope_train_seq_len: Some(4), ..tiny() }),
            ("xsa_last_n", ModelConfig { xsa_last_n: 2, ..tiny() }),
            ("num_loops", looped()),
            ("num_loops, gated", ModelConfig { skip_gates: true, num_loops: 2, ..looped() }),
            ("bigram", ModelConfig { bigram_vocab_size: 11, bigram_dim: 8, ..tiny() }),
            ("bigram, no projection", ModelConfig { bigram_vocab_size: 11, bigram_dim: 32, ..tiny() }),
            ("all", all_on()),
        ];
        let x = ids(2, 6, 16, 3);
        for (name, cfg) in cases {
            let mut m = model(&cfg, 7);
            let params: HashMap<String, Tensor> = m.state_dict().into_iter().collect();
            for looping in [false, true] {
                m.set_looping(looping);
                let want = logits(&cfg, &params, &x, looping).unwrap();
                let got = m.logits(&x).unwrap();
                let d = max_diff(&got, &want);
                assert!(d < 1e-9, "{name} (looping {looping}): logits differ from the formulas by {d:.3e}");
                // The GPU's graph (its kernels' CPU references, in f64) computes the same.
                let gpu = crate::model::with_gpu_formulation(|| m.logits(&x)).unwrap();
                let d = max_diff(&gpu, &want);
                assert!(d < 1e-9, "{name} (looping {looping}): the GPU formulation differs from the formulas by {d:.3e}");
            }
        }
    }

    /// The reference is not vacuous: each switch changes the logits of the same weights.
    #[test]
    fn each_switch_changes_the_model() {
        let x = ids(2, 6, 16, 5);
        let base = tiny();
        let m = model(&base, 9);
        let params: HashMap<String, Tensor> = m.state_dict().into_iter().collect();
        let plain = logits(&base, &params, &x, false).unwrap();
        for (name, cfg) in [
            ("leaky_relu2", ModelConfig { mlp_activation: MlpActivation::LeakyRelu2, ..base.clone() }),
            ("ln_scale", ModelConfig { ln_scale: true, ..base.clone() }),
            ("parallel_residual_start", ModelConfig { parallel_residual_start: Some(0), ..base.clone() }),
            ("rope_dims", ModelConfig { rope_dims: Some(4), ..base.clone() }),
            ("xsa_last_n", ModelConfig { xsa_last_n: 1, ..base.clone() }),
        ] {
            let mut other = Gpt::new(&cfg, 0, DType::F64, &Device::Cpu).unwrap();
            other.load_state(&params).unwrap();
            let d = max_diff(&other.logits(&x).unwrap(), &plain);
            assert!(d > 1e-6, "{name} changed nothing ({d:.1e})");
        }
        // NTK rescaling only past the training length.
        let partial = ModelConfig { rope_dims: Some(4), ..base.clone() };
        let ntk = |l: usize| {
            let mut m = Gpt::new(&ModelConfig { rope_train_seq_len: Some(l), ..partial.clone() }, 0, DType::F64, &Device::Cpu).unwrap();
            m.load_state(&params).unwrap();
            m.logits(&x).unwrap()
        };
        assert_eq!(max_diff(&ntk(6), &ntk(600)), 0.0, "T = 6 is within both lengths");
        assert!(max_diff(&ntk(3), &ntk(6)) > 1e-6, "T = 6 past 3 rescales the base");
        // Looping changes a recurrent model's output; its skip rows past the unlooped U-Net's
        // are read only when looped.
        let mut m = model(&looped(), 9);
        let unlooped = {
            m.set_looping(false);
            m.logits(&x).unwrap()
        };
        m.set_looping(true);
        assert!(max_diff(&m.logits(&x).unwrap(), &unlooped) > 1e-6);
    }

    /// Gradients with every element on, looped and not, against central finite differences.
    #[test]
    fn gradients_with_every_element_match_finite_differences() {
        let cfg = all_on();
        let mut m = model(&cfg, 11);
        let (x, y) = (ids(2, 5, 16, 1), ids(2, 5, 16, 4));
        assert_gradients_match_finite_differences(&m, &x, &y);
        m.set_looping(false);
        let grads = m.loss(&x, &y).unwrap().backward().unwrap();
        // Unlooped, the U-Net has 2 skips: rows 2.. of skip_weights get no gradient.
        let g = grads.get(m.param("skip_weights").unwrap().as_tensor()).unwrap().to_vec2::<f64>().unwrap();
        assert!(g[..2].iter().all(|r| r.iter().any(|v| *v != 0.0)) && g[2..].iter().all(|r| r.iter().all(|v| *v == 0.0)), "{g:?}");
    }

    /// The skip gates are parameters of their own, zero at init (the gate 0.5), in the scalar
    /// group, sized for the looped layout; bad switches are refused with the key named.
    #[test]
    fn skip_gates_are_parameters_and_bad_keys_are_named() {
        let cfg = ModelConfig { skip_gates: true, ..tiny() };
        let m = Gpt::new(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let gates = m.param("skip_gates").unwrap();
        assert_eq!(gates.dims(), [cfg.skip_count(), 32]);
        assert!(gates.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&z| z == 0.0));
        assert_eq!(crate::model::gpt_group_of("skip_gates", 2), crate::model::ParamGroup::Scalar);
        assert_eq!(m.param_count(), Gpt::new(&tiny(), 1, DType::F32, &Device::Cpu).unwrap().param_count() + cfg.skip_count() * 32);
        let m = Gpt::new(&ModelConfig { skip_gates: true, ..looped() }, 1, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(m.param("skip_gates").unwrap().dims(), [3, 32], "[0,1,2 | 1,2,3,4]: 3 skips");
        assert_eq!(m.param("skip_weights").unwrap().dims(), [3, 32]);
        for (bad, key) in [
            (ModelConfig { parallel_residual_start: Some(5), ..tiny() }, "model.parallel_residual_start"),
            (ModelConfig { leaky_relu_slope: 1.5, ..tiny() }, "model.leaky_relu_slope"),
            (ModelConfig { leaky_relu_slope: -0.5, ..tiny() }, "model.leaky_relu_slope"),
            (ModelConfig { rope_dims: Some(3), ..tiny() }, "model.rope_dims"),
            (ModelConfig { rope_dims: Some(10), ..tiny() }, "model.rope_dims"),
            (ModelConfig { rope_dims: Some(0), ..tiny() }, "model.rope_dims"),
            (ModelConfig { rope_dims: Some(2), rope_train_seq_len: Some(8), ..tiny() }, "model.rope_train_seq_len"),
            (ModelConfig { xsa_last_n: 6, ..tiny() }, "model.xsa_last_n"),
            (ModelConfig { loop_end: 5, ..looped() }, "model.loop_end"),
            (ModelConfig { loop_start: 3, loop_end: 2, ..looped() }, "model.loop_start"),
            (ModelConfig { enable_looping_at: 1.5, ..looped() }, "model.enable_looping_at"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
            assert!(Gpt::new(&bad, 0, DType::F32, &Device::Cpu).is_err());
        }
    }
}
