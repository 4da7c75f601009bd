//! GPTQ for one weight matrix: the int6/int8 quantizer of the 2026-04-09 record
//! (`shared/research/record_spec.md`, section 4.5), with its SD-clip row scales, plain
//! round-to-nearest for comparison and the error measure GPTQ minimises.
//!
//! This file is the algorithm only, one matrix at a time: it does not collect Hessians and does
//! not write artifacts (the container and codecs are [`super::quant`]'s).
//!
//! # The problem
//!
//! A linear layer computes `y = x W^T` with `W` of shape `[rows, cols]` (`[out, in]`, PyTorch's
//! layout). Quantizing `W` to `q * s` (integers `q` in `[-Q, Q]`, one scale `s_r` per row,
//! `Q = 2^(bits-1) - 1`: 31 for int6, 127 for int8) changes the output on calibration inputs `X`
//! (`[n, cols]`) by `X D^T` with `D = W - q * s`. GPTQ picks `q` to keep
//!
//! ```text
//! || X D^T ||_F^2 = sum_r  d_r^T (X^T X) d_r = tr(D H D^T),     H = X^T X   ([cols, cols])
//! ```
//!
//! small, where plain rounding only keeps each `|d_rc|` small. Rows are independent (they share
//! `H`), so everything below is per row `w` (one row of `W`, length `cols`).
//!
//! # The algorithm (Optimal Brain Quantization, column by column)
//!
//! Quantize column `j`, then change the columns not yet quantized so that `tr(D H D^T)` grows
//! as little as possible. With the rounding error `delta_j = w_j - q_j s` fixed, the quadratic
//! form `d^T H d` is smallest when the not-yet-quantized weights move by
//!
//! ```text
//! w_{j+1..} -= (delta_j / [H_j^-1]_jj) * [H_j^-1]_{j, j+1..}
//! ```
//!
//! where `H_j^-1` is the inverse of `H` restricted to the not-yet-quantized columns `j..`. The
//! trick of GPTQ: the rows `[H_j^-1]_{j, j..} / sqrt([H_j^-1]_jj)` are the rows of the upper
//! Cholesky factor `U` of `H^-1` (`H^-1 = U^T U`), so one factorization gives every step:
//!
//! ```text
//! q_j   = clamp(round_half_even(w_j / s), -Q, Q)
//! e_j   = (w_j - q_j * s) / U_jj            (= delta_j / sqrt([H_j^-1]_jj))
//! w_k  -= e_j * U_jk                 for k >= j    (k = j too: harmless, w_j is done)
//! ```
//!
//! Blocking (the "lazy batch" update): the update of column `k` by column `j` only depends on
//! `e_j` and `U_jk`, so within a block of `B` columns (128) only the block's own columns are
//! updated as the columns are quantized, and after the block the errors `E` (`[rows, B]`) are
//! pushed onto all later columns at once, a GEMM:
//!
//! ```text
//! W[:, b1..] -= E · U[b0..b1, b1..]          (block = columns b0..b1)
//! ```
//!
//! The result is the same as the column-by-column update up to the order of the floating-point
//! sums.
//!
//! # Steps of [`quantize_matrix`] (spec 4.5, as the record's `gptq_quantize_weight`)
//!
//! 1. Dead columns (`H_jj == 0`, an input feature that was always 0): `H_jj = 1`, and that column
//!    of the working copy of `W` is set to 0 (its `q` comes out 0).
//! 2. Damping: `H_jj += damping * mean_j(H_jj)` (mean after step 1; `damping` = 0.01).
//! 3. Act-order (switchable): columns sorted by `H_jj` descending, most important first; `W`'s
//!    columns and `H`'s rows and columns permuted alike. The sort is stable (ties keep their
//!    column order); PyTorch's `argsort` is not stable, so on exact ties the order may differ
//!    from the record's, which changes nothing systematic.
//! 4. `H = L L^T` (Cholesky), `H^-1 = L^-T L^-1` ("cholesky_inverse"), then `U` = upper Cholesky
//!    factor of `H^-1`. A Cholesky that fails means `H` is not positive definite after damping
//!    (e.g. negative or inconsistent entries): an error, not a fallback.
//! 5. The blocked column loop above, with the caller's row scales as they are.
//! 6. `q` is put back in the original column order.
//!
//! # Numerics
//!
//! Everything internal is f64: `H`, its factors, the working copy of `W`, the errors, and the
//! rounding division `w / s`, done on the f64 working value with the f32 scale widened to f64.
//! The record does all of this in f32 on the CPU, so a value that lands within f32 rounding of a
//! half-integer can round the other way here; f64 makes the result depend much less on the order
//! of the sums (ours and faer's), which the tests rely on.
//!
//! `H` is read symmetrised, `(H_ij + H_ji) / 2`, which changes nothing for a symmetric `H` (the
//! f64 sum of two equal f32 values halves exactly).
//!
//! A row whose scale is 0 (an SD-clip scale of a (nearly) constant row rounds to fp16 zero, see
//! [`sd_clip_scales`]) gets `q = 0`: it dequantizes to 0 whatever `q` is; the record divides by
//! zero there (`±Q`, or NaN cast to int8).
//!
//! Dense linear algebra (Cholesky, triangular inverse, the after-block GEMM) is faer's, parallel
//! over rayon's global pool. The in-block column loop runs over tiles of rows in parallel (rows
//! are independent given the block's `U`); a tile's block columns are copied column-major, so
//! each update runs down a column of independent rows, with AVX2 where the CPU has it (chosen at
//! run time; no FMA, so the arithmetic is the same as the baseline build's).

use anyhow::{Result, anyhow, ensure};
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{self, LltError};
use faer::linalg::cholesky::llt::inverse;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

mod solver;

use solver::{Block, quantize_block_tile, quantize_value};

/// Rows per tile (one rayon task) of the in-block column loop. The tile's block columns are
/// copied column-major (`128 x 32` f64: 32 KiB, about L1), so every update is one loop of 32
/// independent rows over contiguous memory, which vectorises (4-wide with AVX2). Measured on
/// tok_emb's shape: 16 to 64 rows are within about 10% of each other; 8 and 128 are slower.
const ROW_TILE: usize = 32;

/// Settings of [`quantize_matrix`] (the `artifact/gptq` stage's keys of the same names).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(default)]
pub struct GptqConfig {
    /// Relative damping: `damping * mean(diag H)` is added to the diagonal of `H` (0.01 in the
    /// record). Finite and >= 0.
    pub damping: f64,
    /// Columns per block of the lazy-batch update (128 in the record). At least 1; the result
    /// does not depend on it beyond floating-point summation order.
    pub block_size: usize,
    /// Quantize columns in order of decreasing `H_jj` ("act-order", on in the record) instead of
    /// their natural order.
    pub act_order: bool,
}

impl GptqConfig {
    /// Checks every setting; errors name its key.
    pub fn check(&self) -> Result<()> {
        ensure!(
            self.damping.is_finite() && self.damping >= 0.0,
            "`damping` = {} must be a non-negative number (0.01 in the record)",
            self.damping
        );
        ensure!(self.block_size >= 1, "`block_size` must be at least 1 (128 in the record)");
        Ok(())
    }
}

impl Default for GptqConfig {
    /// The record's settings: damping 0.01, blocks of 128 columns, act-order on.
    fn default() -> Self {
        Self { damping: 0.01, block_size: 128, act_order: true }
    }
}

/// What [`quantize_matrix`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GptqOutput {
    /// The quantized values, row-major `[rows, cols]` in the original column order, each in
    /// `[-qmax, qmax]`. Dequantize as `q[r, c] * scales[r]`.
    pub q: Vec<i8>,
    /// How many columns had `H_jj == 0` (their `q` is 0).
    pub dead_columns: usize,
}

/// GPTQ of one matrix.
///
/// `w` is the weight, row-major `[rows, cols]` (PyTorch's `[out, in]`); `hessian` is `H`, row-major
/// `[cols, cols]`, symmetric positive semi-definite (`sum X^T X` over the layer's inputs, any
/// positive factor); `scales` holds one scale per row, used as given (the record's are
/// [`sd_clip_scales`], rounded to fp16 and passed here as the f32 values of those fp16 numbers);
/// `qmax` is `Q` (31 for int6, 127 for int8). The steps and numerics are in the module
/// documentation.
///
/// Errors (the caller adds the tensor's name): wrong lengths, a non-finite value in `w` or
/// `hessian`, a negative or non-finite scale, `qmax < 1`, `block_size == 0`, a negative or
/// non-finite damping, and an `H` that is not positive definite after damping.
pub fn quantize_matrix(
    w: &[f32],
    rows: usize,
    cols: usize,
    hessian: &[f32],
    scales: &[f32],
    qmax: i8,
    cfg: &GptqConfig,
) -> Result<GptqOutput> {
    let n = cols;
    let numel = rows.checked_mul(cols).ok_or_else(|| anyhow!("GPTQ: shape {rows}x{cols} overflows"))?;
    ensure!(w.len() == numel, "GPTQ: the weight has {} values, expected {rows}x{cols} = {numel}", w.len());
    let h_numel = n.checked_mul(n).ok_or_else(|| anyhow!("GPTQ: Hessian shape {n}x{n} overflows"))?;
    ensure!(hessian.len() == h_numel, "GPTQ: the Hessian has {} values, expected {n}x{n} = {h_numel}", hessian.len());
    ensure!(scales.len() == rows, "GPTQ: {} row scales for {rows} rows", scales.len());
    ensure!(qmax >= 1, "GPTQ: qmax must be at least 1, got {qmax}");
    ensure!(cfg.block_size >= 1, "GPTQ: block_size must be at least 1");
    ensure!(cfg.damping.is_finite() && cfg.damping >= 0.0, "GPTQ: damping must be finite and >= 0, got {}", cfg.damping);
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(anyhow!("GPTQ: non-finite weight {} at row {}, column {}", w[i], i / n, i % n));
    }
    if let Some(i) = hessian.iter().position(|x| !x.is_finite()) {
        return Err(anyhow!("GPTQ: non-finite Hessian entry {} at ({}, {})", hessian[i], i / n, i % n));
    }
    if let Some(r) = scales.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
        return Err(anyhow!("GPTQ: row {r} has scale {}, expected a finite value >= 0", scales[r]));
    }

    // H in f64, symmetrised; only the diagonal is needed before the permutation.
    let h_at = |i: usize, j: usize| 0.5 * (f64::from(hessian[i * n + j]) + f64::from(hessian[j * n + i]));
    let mut diag: Vec<f64> = (0..n).map(|j| h_at(j, j)).collect();

    // 1. Dead columns: H_jj = 1, the column of W zeroed (below, when W is copied).
    let dead: Vec<bool> = diag.iter().map(|&d| d == 0.0).collect();
    let dead_columns = dead.iter().filter(|&&d| d).count();
    if rows == 0 || n == 0 {
        return Ok(GptqOutput { q: Vec::new(), dead_columns });
    }
    for (d, &is_dead) in diag.iter_mut().zip(&dead) {
        if is_dead {
            *d = 1.0;
        }
    }

    // 2. Damping, relative to the mean diagonal after step 1.
    let damp = cfg.damping * diag.iter().sum::<f64>() / n as f64;
    for d in &mut diag {
        *d += damp;
    }

    // 3. Column order: perm[k] = original column quantized k-th.
    let perm = column_order(&diag, cfg.act_order);

    // The permuted, damped H (faer, column-major; symmetric, so the layout does not matter).
    let hp = Mat::<f64>::from_fn(n, n, |i, j| if i == j { diag[perm[i]] } else { h_at(perm[i], perm[j]) });

    // 4. U, the upper Cholesky factor of H^-1, row-major.
    let par = Par::rayon(0);
    let u = upper_factor_of_inverse(hp, &perm, par)?;

    // The working copy of W, permuted, dead columns zeroed, f64.
    let mut wp = vec![0.0f64; numel];
    wp.par_chunks_mut(n).zip(w.par_chunks(n)).for_each(|(dst, src)| {
        for (d, &c) in dst.iter_mut().zip(&perm) {
            *d = if dead[c] { 0.0 } else { f64::from(src[c]) };
        }
    });

    // 5. Blocks of columns.
    let bs = cfg.block_size.min(n);
    let qmax = f64::from(qmax);
    let mut qp = vec![0i8; numel];
    let mut err = vec![0.0f64; rows * bs];
    let mut ublk = vec![0.0f64; bs * bs];
    for b0 in (0..n).step_by(bs) {
        let b1 = (b0 + bs).min(n);
        let nb = b1 - b0;
        // The block's diagonal part of U, contiguous: ublk[j * nb + k] = U[b0 + j, b0 + k].
        for j in 0..nb {
            ublk[j * nb..(j + 1) * nb].copy_from_slice(&u[(b0 + j) * n + b0..(b0 + j) * n + b1]);
        }
        let blk = Block { n, bs, b0, nb, ublk: &ublk[..nb * nb], qmax };
        wp.par_chunks(ROW_TILE * n)
            .zip(qp.par_chunks_mut(ROW_TILE * n))
            .zip(err.par_chunks_mut(ROW_TILE * bs))
            .zip(scales.par_chunks(ROW_TILE))
            .for_each(|(((w_rows, q_rows), e_rows), s_rows)| {
                quantize_block_tile(blk, w_rows, q_rows, e_rows, s_rows);
            });
        if b1 < n {
            // W[:, b1..] -= E · U[b0..b1, b1..]
            let rest = n - b1;
            let e = MatRef::from_row_major_slice_with_stride(&err, rows, nb, bs);
            let u_rest = MatRef::from_row_major_slice_with_stride(&u[b0 * n + b1..], nb, rest, n);
            let w_rest = row_major_mut(&mut wp[b1..], rows, rest, n);
            matmul(w_rest, Accum::Add, e, u_rest, -1.0, par);
        }
    }

    // 6. Back to the original column order.
    let mut q = vec![0i8; numel];
    q.par_chunks_mut(n).zip(qp.par_chunks(n)).for_each(|(dst, src)| {
        for (&v, &c) in src.iter().zip(&perm) {
            dst[c] = v;
        }
    });
    Ok(GptqOutput { q, dead_columns })
}

/// A mutable row-major view (`row_stride` between row starts) of `slice`.
///
/// Not `MatMut::from_row_major_slice_with_stride_mut`: in faer 0.24.4 that one checks the bounds
/// of a row-major layout but builds a column-major one (row stride 1, column stride
/// `row_stride`), so writes through it land in the wrong places, past the end of the slice too
/// (faer-rs pull request 267, not merged yet). The column-major view of the transpose is right.
fn row_major_mut(slice: &mut [f64], nrows: usize, ncols: usize, row_stride: usize) -> MatMut<'_, f64> {
    MatMut::from_column_major_slice_with_stride_mut(slice, ncols, nrows, row_stride).transpose_mut()
}

/// The order in which columns are quantized: `perm[k]` is the original index of the `k`-th
/// column. Act-order sorts by `diag` descending, stably (equal values keep their order).
fn column_order(diag: &[f64], act_order: bool) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..diag.len()).collect();
    if act_order {
        perm.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]));
    }
    perm
}

/// `U`, row-major `[n, n]` with zeros below the diagonal, from the permuted damped `H`:
/// `H = L L^T`, `H^-1 = L^-T L^-1`, `H^-1 = L2 L2^T`, `U = L2^T` (so `H^-1 = U^T U`).
/// `perm` only names the failing column in errors.
fn upper_factor_of_inverse(mut l: Mat<f64>, perm: &[usize], par: Par) -> Result<Vec<f64>> {
    let n = l.nrows();
    let scratch = factor::cholesky_in_place_scratch::<f64>(n, par, Default::default()).or(inverse::inverse_scratch::<f64>(n, par));
    let mut mem = MemBuffer::new(scratch);

    // H = L L^T (lower triangle of `l`; the upper one keeps H's values and is never read).
    factor::cholesky_in_place(l.as_mut(), Default::default(), par, MemStack::new(&mut mem), Default::default()).map_err(|e| match e {
        LltError::NonPositivePivot { index } => anyhow!(
            "GPTQ: the Hessian is not positive definite after damping (Cholesky pivot {index} of {n}, original column {}, is not positive)",
            perm[index]
        ),
    })?;

    // H^-1 (lower triangle written; the rest stays 0 and is not read).
    let mut hinv = Mat::<f64>::zeros(n, n);
    inverse::inverse(hinv.as_mut(), l.as_ref(), par, MemStack::new(&mut mem));
    drop(l);

    // H^-1 = L2 L2^T.
    factor::cholesky_in_place(hinv.as_mut(), Default::default(), par, MemStack::new(&mut mem), Default::default()).map_err(
        |e| match e {
            LltError::NonPositivePivot { index } => anyhow!(
                "GPTQ: the inverse Hessian is not positive definite numerically (Cholesky pivot {index} of {n}); \
             the Hessian is too ill-conditioned, raise the damping"
            ),
        },
    )?;

    // U = L2^T, row-major: row i of U is column i of L2 from the diagonal down.
    let mut u = vec![0.0f64; n * n];
    u.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        for (j, x) in row.iter_mut().enumerate().skip(i) {
            *x = hinv[(j, i)];
        }
    });
    ensure!(u.iter().all(|x| x.is_finite()), "GPTQ: the inverse Hessian's factor is not finite; the Hessian is too ill-conditioned");
    Ok(u)
}

/// SD-clip row scales: `s_r = k * std(W_r) / Q_max`, std of the row unbiased (n-1), accumulated in
/// f64, clamped >= 1e-10, rounded to fp16.
///
/// `w` is row-major `[rows, cols]` (the original weight, before any GPTQ), `qmax` is `Q_max` and
/// `clip_sigmas` is `k` (12.85 for the record's int6 matrices, 20 for its int8 embedding).
///
/// As the record on the CPU (`(k * W.std(dim=1) / Q).clamp_min(1e-10).to(float16)`): the
/// variance is summed in f64 (two passes: mean, then squared deviations), the square root is
/// taken in f64 and rounded to f32 (PyTorch's f32 result), then `* k`, `/ Q` and the clamp in
/// f32, then the rounding to fp16. The clamp does not survive that last rounding: 1e-10 is far
/// below fp16's smallest subnormal (6e-8), so a constant row (std 0) gets scale 0, as in the
/// record ([`quantize_matrix`] gives such a row `q = 0`). With `cols < 2` the unbiased std is
/// undefined: NaN, as in PyTorch ([`quantize_matrix`] rejects it).
///
/// # Panics
/// If `w.len() != rows * cols` (a programming error, not data).
pub fn sd_clip_scales(w: &[f32], rows: usize, cols: usize, qmax: i8, clip_sigmas: f64) -> Vec<f16> {
    assert_eq!(Some(w.len()), rows.checked_mul(cols), "sd_clip_scales: {} values for {rows}x{cols}", w.len());
    if cols < 2 {
        return vec![f16::NAN; rows];
    }
    let k = clip_sigmas as f32;
    let q = f32::from(qmax);
    w.par_chunks(cols)
        .map(|row| {
            let n = row.len() as f64;
            let mean = row.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
            let ss: f64 = row.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum();
            let std = (ss / (n - 1.0)).sqrt() as f32;
            f16::from_f32((k * std / q).max(1e-10))
        })
        .collect()
}

/// Round to nearest with given scales: `clamp(round_half_even(w / s_r), -Q, Q)`, the baseline
/// GPTQ improves on.
///
/// `w` is row-major with `cols` columns and `scales.len()` rows. The division is done in f64 (the
/// f32 values widened), as in [`quantize_matrix`], so with `H` a multiple of the identity the two
/// agree exactly; a zero scale gives `q = 0`, as there.
///
/// # Panics
/// If `w.len() != scales.len() * cols` (a programming error, not data).
pub fn round_to_nearest(w: &[f32], cols: usize, scales: &[f32], qmax: i8) -> Vec<i8> {
    assert_eq!(Some(w.len()), scales.len().checked_mul(cols), "round_to_nearest: {} values for {} rows of {cols}", w.len(), scales.len());
    let qmax = f64::from(qmax);
    let mut q = vec![0i8; w.len()];
    if cols == 0 {
        return q;
    }
    q.par_chunks_mut(cols).zip(w.par_chunks(cols)).zip(scales.par_iter()).for_each(|((q_row, w_row), &s)| {
        for (o, &x) in q_row.iter_mut().zip(w_row) {
            *o = quantize_value(f64::from(x), f64::from(s), qmax) as i8;
        }
    });
    q
}

/// The Hessian-weighted relative error `tr(D H D^T) / tr(W H W^T)`, `D = W - q*s` (what GPTQ
/// minimises), f64.
///
/// `w` and `q` are row-major `[rows, cols]`, `hessian` `[cols, cols]`, `scales` one per row; the
/// dequantized value is `q * s` in f64. With `H = X^T X` this is `||X D^T||^2 / ||X W^T||^2`, the
/// relative squared error of the layer's output on the calibration inputs. `0/0` (a zero `W`
/// quantized exactly) is NaN, as the f64 division gives.
///
/// # Panics
/// If a length does not match the shape (a programming error, not data).
#[cfg(feature = "tools")]
pub fn weighted_error(w: &[f32], rows: usize, cols: usize, hessian: &[f32], q: &[i8], scales: &[f32]) -> f64 {
    let numel = rows.checked_mul(cols);
    assert_eq!(Some(w.len()), numel, "weighted_error: {} weights for {rows}x{cols}", w.len());
    assert_eq!(Some(q.len()), numel, "weighted_error: {} quantized values for {rows}x{cols}", q.len());
    assert_eq!(Some(hessian.len()), cols.checked_mul(cols), "weighted_error: {} Hessian values for {cols}x{cols}", hessian.len());
    assert_eq!(scales.len(), rows, "weighted_error: {} scales for {rows} rows", scales.len());
    let h = Mat::<f64>::from_fn(cols, cols, |i, j| f64::from(hessian[i * cols + j]));
    let wm = Mat::<f64>::from_fn(rows, cols, |r, c| f64::from(w[r * cols + c]));
    let dm = Mat::<f64>::from_fn(rows, cols, |r, c| wm[(r, c)] - f64::from(q[r * cols + c]) * f64::from(scales[r]));
    let quad = |m: &Mat<f64>| -> f64 {
        // tr(M H M^T) = sum over entries of (M H) ∘ M.
        let mut mh = Mat::<f64>::zeros(rows, cols);
        matmul(mh.as_mut(), Accum::Replace, m.as_ref(), h.as_ref(), 1.0, Par::rayon(0));
        (0..cols).map(|c| (0..rows).map(|r| mh[(r, c)] * m[(r, c)]).sum::<f64>()).sum()
    };
    quad(&dm) / quad(&wm)
}

#[cfg(test)]
mod tests;
