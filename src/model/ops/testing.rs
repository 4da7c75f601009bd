//! What the ops' tests share: random inputs, closeness checks, gradients of a weighted loss
//! compared with a reference's and with finite differences; and the ignored timing of the CPU
//! kernels against their references.

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::model::ops::{self, causal_attention, rms_norm, softcap_cross_entropy};

/// Uniform values in `[-scale, scale)` of `shape`, in `dtype`.
pub(crate) fn rand(rng: &mut fastrand::Rng, shape: &[usize], scale: f64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| (rng.f64() * 2.0 - 1.0) * scale).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// Values uniform in [-2, 2) of `shape` from `seed`, in f64.
pub(crate) fn seeded(shape: &[usize], seed: u64) -> Tensor {
    rand(&mut fastrand::Rng::with_seed(seed), shape, 2.0, DType::F64)
}

/// `n` random class indices below `v`, as a u32 tensor.
pub(crate) fn targets(rng: &mut fastrand::Rng, n: usize, v: usize) -> Tensor {
    Tensor::from_vec((0..n).map(|_| rng.u32(0..v as u32)).collect::<Vec<_>>(), n, &Device::Cpu).unwrap()
}

/// The elements of `t` as f64, in row-major order.
pub(crate) fn flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// Asserts `|got - want| <= tol * (1 + |want|)` elementwise (and equal shapes).
pub(crate) fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (g, w) = (flat(got), flat(want));
    let mut worst = (0.0f64, 0usize);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let e = (a - b).abs() / (1.0 + b.abs());
        assert!(e.is_finite(), "{what}[{i}]: {a} vs {b}");
        if e > worst.0 {
            worst = (e, i);
        }
    }
    assert!(worst.0 <= tol, "{what}[{}]: {} vs {} (error {:e} > {tol:e})", worst.1, g[worst.1], w[worst.1], worst.0);
}

/// The loss whose gradients are compared: a random weighting of every output element, or
/// a plain sum (whose gradient reaches the op as a stride-0 broadcast).
#[derive(Clone, Copy)]
pub(crate) enum Loss {
    Weighted,
    Sum,
}

/// The scalar loss of `out` (a seeded random weighting, or the sum).
pub(crate) fn loss_of(out: &Tensor, loss: Loss, seed: u64) -> Tensor {
    match loss {
        Loss::Weighted => {
            let w = rand(&mut fastrand::Rng::with_seed(seed), out.dims(), 1.0, out.dtype());
            (out * w).unwrap().sum_all().unwrap()
        }
        Loss::Sum => out.sum_all().unwrap(),
    }
}

/// Gradients of `loss(f(inputs))` with respect to each input.
pub(crate) fn grads(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], loss: Loss) -> Vec<Tensor> {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let g = loss_of(&f(&ts).unwrap(), loss, 99).backward().unwrap();
    vars.iter().map(|v| g.get(v.as_tensor()).expect("a gradient for every input").clone()).collect()
}

/// Asserts that `fused` and `reference` give the same gradients (to 1e-12) for both losses.
pub(crate) fn check_grads(
    fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    what: &str,
) {
    for loss in [Loss::Weighted, Loss::Sum] {
        let (a, b) = (grads(fused, inputs, loss), grads(reference, inputs, loss));
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_close(a, b, 1e-12, &format!("{what}: gradient of input {i}"));
        }
    }
}

/// Central finite differences of the weighted loss against the backward pass, for every
/// element of every (f64) input.
pub(crate) fn check_finite_differences(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], what: &str) {
    let analytic: Vec<Vec<f64>> = grads(f, inputs, Loss::Weighted).iter().map(flat).collect();
    let eval = |ins: &[Tensor]| loss_of(&f(ins).unwrap(), Loss::Weighted, 99).to_scalar::<f64>().unwrap();
    let eps = 1e-6;
    for (a, input) in inputs.iter().enumerate() {
        let base = flat(input);
        for idx in 0..base.len() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[idx] += delta;
                let mut ins = inputs.to_vec();
                ins[a] = Tensor::from_vec(v, input.dims(), &Device::Cpu).unwrap();
                eval(&ins)
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps);
            let g = analytic[a][idx];
            assert!(
                (fd - g).abs() <= 1e-7 + 1e-6 * fd.abs().max(g.abs()),
                "{what}: input {a}[{idx}]: finite difference {fd}, backward {g}"
            );
        }
    }
}

/// Asserts `|a - b| <= 1e-6 (1 + |b|)` elementwise: a kernel compiled for the baseline target
/// against its AVX2 build.
pub(crate) fn assert_near(a: &[f32], b: &[f32], what: &str) {
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{what}[{i}]: {a} vs {b}");
    }
}

/// Fused vs reference forward + backward on the CPU demo model's shapes (f32). Run with
/// `cargo test --release --lib model::ops::testing -- --ignored --nocapture`.
#[test]
#[ignore]
fn speed_against_the_reference() {
    fn time(f: &dyn Fn()) -> f64 {
        f();
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            f();
            best = best.min(start.elapsed().as_secs_f64());
        }
        best * 1e3
    }
    // Backward from the output itself (candle seeds it with ones), so that only the op is timed.
    fn fwd_bwd(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, vars: &[Tensor]) {
        f(vars).unwrap().backward().unwrap();
    }
    let report = |what: &str,
                  fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
                  reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
                  inputs: &[Tensor]| {
        let vars: Vec<Tensor> = inputs.iter().map(|t| Var::from_tensor(t).unwrap().as_tensor().clone()).collect();
        let (f, r) = (time(&|| fwd_bwd(fused, &vars)), time(&|| fwd_bwd(reference, &vars)));
        let (ff, rf) = (time(&|| drop(fused(inputs).unwrap())), time(&|| drop(reference(inputs).unwrap())));
        println!("{what}: fwd+bwd fused {f:.2} ms, reference {r:.2} ms ({:.1}x); fwd only {ff:.2} vs {rf:.2} ms ({:.1}x)", r / f, rf / ff);
    };
    let mut rng = fastrand::Rng::with_seed(0);
    let y = targets(&mut rng, 4096, 1024);
    let logits = rand(&mut rng, &[4096, 1024], 10.0, DType::F32);
    report(
        "softcap_cross_entropy (4096, 1024)",
        &|x| softcap_cross_entropy(&x[0], &y, 30.0),
        &|x| ops::cross_entropy_rows(&ops::softcap(&x[0], 30.0)?, &y),
        &[logits],
    );
    let x = rand(&mut rng, &[16, 256, 128], 1.0, DType::F32);
    report("rms_norm (16, 256, 128)", &|x| rms_norm(&x[0]), &|x| ops::rms_norm_reference(&x[0]), &[x]);
    for shape in [(16, 4, 2, 256, 32), (64, 4, 2, 64, 32)] {
        let (b, h, k, t, d) = shape;
        let inputs = [
            rand(&mut rng, &[b, h, t, d], 1.5, DType::F32),
            rand(&mut rng, &[b, k, t, d], 1.5, DType::F32),
            rand(&mut rng, &[b, k, t, d], 1.0, DType::F32),
        ];
        let f = |x: &[Tensor]| causal_attention(&x[0], &x[1], &x[2]);
        let r = |x: &[Tensor]| {
            ops::causal_attention_reference(&x[0], &x[1], &x[2], &ops::causal_mask(x[0].dim(2)?, x[0].dtype(), x[0].device())?)
        };
        report(&format!("causal_attention (B, H, K, T, D) = {shape:?}"), &f, &r, &inputs);
    }
}
