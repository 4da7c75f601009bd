//! Host-side initial values of the parameters, drawn from one seeded generator so that a seed
//! gives the same weights on every device: uniform and normal draws, and random orthogonal
//! matrices (`model.init = "orthogonal"`, the 04-09 record's, as `torch.nn.init.orthogonal_`):
//!
//! ```text
//! A ~ N(0, 1)^(m x n), transposed first when m < n so that it is tall
//! A = Q R  with diag(R) > 0          (the QR whose R has a positive diagonal is unique)
//! W = Q    (transposed back)         (gain 1: rows or columns orthonormal)
//! ```
//!
//! `Q` comes from CholeskyQR2: `R1 = chol(A^T A)`, `Q1 = A R1^-1`, then the same on `Q1`, which
//! restores orthogonality to rounding for the well-conditioned Gaussian matrices drawn here. Both
//! Cholesky factors have positive diagonals, so `Q` is the sign-fixed QR factor torch returns
//! (for other draws: torch's generator is not ours).

use candle_core::{Device, Tensor};

/// A seeded generator of initial values (f64, on the host).
pub(super) struct Init(pub(super) fastrand::Rng);

impl Init {
    /// `n` values uniform in `[-bound, bound)`.
    pub(super) fn uniform(&mut self, n: usize, bound: f64) -> Vec<f64> {
        (0..n).map(|_| (self.0.f64() * 2.0 - 1.0) * bound).collect()
    }

    /// `n` values from N(0, std^2).
    pub(super) fn normal(&mut self, n: usize, std: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                // Box-Muller; 1 - u keeps the logarithm finite.
                let (u, v) = (1.0 - self.0.f64(), self.0.f64());
                std * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
            })
            .collect()
    }

    /// A random `rows x cols` matrix (row-major) with orthonormal rows (`rows <= cols`) or
    /// columns (`rows >= cols`), gain 1.
    pub(super) fn orthogonal(&mut self, rows: usize, cols: usize) -> anyhow::Result<Vec<f64>> {
        let a = self.normal(rows * cols, 1.0);
        let a = Tensor::from_vec(a, (rows, cols), &Device::Cpu)?;
        let tall = if rows < cols { a.t()?.contiguous()? } else { a };
        let q = cholesky_qr(&cholesky_qr(&tall)?)?;
        let q = if rows < cols { q.t()?.contiguous()? } else { q };
        Ok(q.flatten_all()?.to_vec1::<f64>()?)
    }
}

/// `A R^-1` for the Cholesky factor `R` of `A^T A` (`A` tall, f64): one CholeskyQR pass.
fn cholesky_qr(a: &Tensor) -> anyhow::Result<Tensor> {
    let n = a.dim(1)?;
    let gram = a.t()?.matmul(a)?.flatten_all()?.to_vec1::<f64>()?;
    let r = cholesky_upper(&gram, n)?;
    let r_inv = Tensor::from_vec(upper_inverse(&r, n), (n, n), &Device::Cpu)?;
    Ok(a.matmul(&r_inv)?)
}

/// The upper triangular `R` with `R^T R = g` (`g` symmetric positive definite, `n x n`
/// row-major).
fn cholesky_upper(g: &[f64], n: usize) -> anyhow::Result<Vec<f64>> {
    let mut r = vec![0.0; n * n];
    for j in 0..n {
        let s: f64 = (0..j).map(|k| r[k * n + j] * r[k * n + j]).sum();
        let d = g[j * n + j] - s;
        anyhow::ensure!(d > 0.0, "orthogonal init: the Gram matrix is singular at column {j}");
        let rjj = d.sqrt();
        r[j * n + j] = rjj;
        for i in j + 1..n {
            let s: f64 = (0..j).map(|k| r[k * n + j] * r[k * n + i]).sum();
            r[j * n + i] = (g[j * n + i] - s) / rjj;
        }
    }
    Ok(r)
}

/// The inverse of the upper triangular `r` (`n x n` row-major, non-zero diagonal).
fn upper_inverse(r: &[f64], n: usize) -> Vec<f64> {
    let mut inv = vec![0.0; n * n];
    for j in 0..n {
        inv[j * n + j] = 1.0 / r[j * n + j];
        for i in (0..j).rev() {
            let s: f64 = (i + 1..=j).map(|k| r[i * n + k] * inv[k * n + j]).sum();
            inv[i * n + j] = -s / r[i * n + i];
        }
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `W W^T` (wide) or `W^T W` (tall) is the identity, and the seed repeats the draw.
    #[test]
    fn orthogonal_matrices_are_orthonormal_and_seeded() {
        for (rows, cols) in [(96usize, 64usize), (64, 96), (80, 80), (3, 7)] {
            let w = Init(fastrand::Rng::with_seed(4)).orthogonal(rows, cols).unwrap();
            assert_eq!(w, Init(fastrand::Rng::with_seed(4)).orthogonal(rows, cols).unwrap());
            let k = rows.min(cols);
            let at = |i: usize, j: usize| w[i * cols + j];
            for p in 0..k {
                for q in 0..k {
                    let dot: f64 = if rows <= cols {
                        (0..cols).map(|c| at(p, c) * at(q, c)).sum()
                    } else {
                        (0..rows).map(|r| at(r, p) * at(r, q)).sum()
                    };
                    let want = if p == q { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-12, "{rows}x{cols}: <{p}, {q}> = {dot}");
                }
            }
        }
    }

    /// The factor is torch's sign convention: `Q^T A` (= R) has a positive diagonal.
    #[test]
    fn the_r_factor_has_a_positive_diagonal() {
        let (m, n) = (40, 12);
        let mut init = Init(fastrand::Rng::with_seed(9));
        let q = init.orthogonal(m, n).unwrap();
        let a = Init(fastrand::Rng::with_seed(9)).normal(m * n, 1.0);
        for j in 0..n {
            let rjj: f64 = (0..m).map(|i| q[i * n + j] * a[i * n + j]).sum();
            assert!(rjj > 0.0, "R[{j},{j}] = {rjj}");
        }
    }
}
