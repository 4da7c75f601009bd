//! Synthetic GPTQ inputs shared by the tests of [`super::gptq`] and `benches/gptq.rs` (which
//! includes this file by path): normal samples and a Hessian with correlated columns of unequal
//! size. Test and bench code only; not part of the library's API.

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par};

/// A standard normal sample (Box-Muller; `1 - u` keeps the logarithm finite).
pub fn normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64();
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `H = X^T X / n` (f32, row-major) for `X` of `n` rows with correlated columns of unequal size:
/// each row is its own noise plus 4 shared factors with random loadings, and column `c` is
/// scaled by `exp(u_c)`, `u_c` uniform in [-1, 1] (so act-order has something to sort). The
/// product is faer's (only GPTQ's reference has to be faer-free; `H` is input).
pub fn correlated_hessian(cols: usize, n: usize, seed: u64) -> Vec<f32> {
    const FACTORS: usize = 4;
    let mut rng = fastrand::Rng::with_seed(seed);
    let loadings: Vec<f64> = (0..FACTORS * cols).map(|_| normal(&mut rng)).collect();
    let col_scale: Vec<f64> = (0..cols).map(|_| (2.0 * rng.f64() - 1.0).exp()).collect();
    let mut x = Mat::<f64>::zeros(n, cols);
    for i in 0..n {
        let f: Vec<f64> = (0..FACTORS).map(|_| normal(&mut rng)).collect();
        for c in 0..cols {
            let shared: f64 = (0..FACTORS).map(|k| f[k] * loadings[k * cols + c]).sum();
            x[(i, c)] = (normal(&mut rng) + shared) * col_scale[c];
        }
    }
    let mut h = Mat::<f64>::zeros(cols, cols);
    matmul(h.as_mut(), Accum::Replace, x.transpose(), x.as_ref(), 1.0 / n as f64, Par::rayon(0));
    (0..cols * cols).map(|k| h[(k / cols, k % cols)] as f32).collect()
}
