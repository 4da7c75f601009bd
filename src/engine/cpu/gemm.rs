//! `C = alpha op(A) op(B) + beta C` on arena views, through the `gemm` crate: the CPU GEMM
//! candle itself uses (packed panels, register-tiled AVX2 / AVX-512 / NEON micro-kernels
//! chosen at run time, rayon across tiles), so the engine's products are as fast as candle's
//! and the difference it makes is everything around them. Strides express the transposes and
//! the column views (q, k, v inside the fused qkv product): no operand is ever copied.
//!
//! The crate computes `dst = alpha dst + beta lhs rhs` (its names): our `beta` is its `alpha`
//! and our `alpha` its `beta`; with `beta = 0` the destination is not read, so a poisoned
//! (NaN-filled) output region is simply overwritten.

use crate::engine::backend::Mat;
use crate::model::host::simd::Real;

/// Row and column strides of an operand as read (transposed or not).
fn strides(m: Mat) -> (isize, isize) {
    if m.t { (1, m.ld as isize) } else { (m.ld as isize, 1) }
}

/// `c = alpha op(a) op(b) + beta c`, each operand given by its view and the slice its view spans
/// (starting at the view's first element).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm<T: Real>(c: Mat, cs: &mut [T], a: Mat, as_: &[T], b: Mat, bs: &[T], alpha: f64, beta: f64) {
    let ((m, k), (k2, n)) = (a.shape(), b.shape());
    assert!(k == k2 && c.shape() == (m, n) && !c.t, "gemm: {:?} x {:?} into {:?}", a.shape(), b.shape(), c.shape());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for r in 0..m {
            for x in &mut cs[r * c.ld..r * c.ld + n] {
                *x = if beta == 0.0 { T::from_f64(0.0) } else { *x * T::from_f64(beta) };
            }
        }
        return;
    }
    let ((ars, acs), (brs, bcs)) = (strides(a), strides(b));
    let threads = rayon::current_num_threads();
    let par = if threads > 1 && m * n * k >= 64 * 64 * 64 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the three views lie in their slices (each slice is its view's span, checked
    // against the arena by the caller), the destination slice is exclusively borrowed and
    // disjoint from the operands, and `T` is f32 or f64, which the crate supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            cs.as_mut_ptr(),
            1,
            c.ld as isize,
            beta != 0.0,
            as_.as_ptr(),
            acs,
            ars,
            bs.as_ptr(),
            bcs,
            brs,
            T::from_f64(beta),
            T::from_f64(alpha),
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::backend::Buf;

    /// Every transpose combination, a column view, and beta = 0 over NaN against the naive sum.
    #[test]
    fn gemm_matches_the_naive_product_for_every_layout() {
        let mut rng = fastrand::Rng::with_seed(3);
        let (m, n, k) = (5, 7, 3);
        for (ta, tb, beta) in [(false, false, 0.0), (true, false, 1.0), (false, true, 0.5), (true, true, 0.0)] {
            // A stored (m, k) or (k, m) inside a wider matrix (ld 9, from column 2).
            let (ar, ac) = if ta { (k, m) } else { (m, k) };
            let (br, bc) = if tb { (n, k) } else { (k, n) };
            let a_all: Vec<f64> = (0..ar * 9).map(|_| rng.f64() - 0.5).collect();
            let b_all: Vec<f64> = (0..br * bc).map(|_| rng.f64() - 0.5).collect();
            let a = Mat { off: 2, rows: ar, cols: ac, ld: 9, t: ta };
            let b = Buf { off: 0, len: br * bc }.mat(br, bc);
            let b = if tb { b.t() } else { b };
            let c0: Vec<f64> = (0..m * n).map(|_| if beta == 0.0 { f64::NAN } else { rng.f64() }).collect();
            let mut c = c0.clone();
            gemm(Buf { off: 0, len: m * n }.mat(m, n), &mut c, a, &a_all[2..], b, &b_all, 2.0, beta);
            let at = |i: usize, p: usize| if ta { a_all[2 + p * 9 + i] } else { a_all[2 + i * 9 + p] };
            let bt = |p: usize, j: usize| if tb { b_all[j * k + p] } else { b_all[p * n + j] };
            for i in 0..m {
                for j in 0..n {
                    let s: f64 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                    let want = 2.0 * s + if beta == 0.0 { 0.0 } else { beta * c0[i * n + j] };
                    assert!((c[i * n + j] - want).abs() < 1e-12, "ta {ta} tb {tb}: {} vs {want}", c[i * n + j]);
                }
            }
        }
    }
}
