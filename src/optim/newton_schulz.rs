//! Newton–Schulz orthogonalization (NS5), the heart of Muon: see the module doc of
//! [`crate::optim`] for the iteration and what five steps do to the singular values.

use candle_core::{Result, Tensor, bail};

/// The quintic Newton–Schulz coefficients `(a, b, c)` of the record (§3.6).
pub const NS5_COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// The epsilon added to the Frobenius norm before normalizing in [`newton_schulz5`].
pub const NS5_EPS: f64 = 1e-7;

/// Orthogonalizes a 2-D matrix with the record's quintic Newton–Schulz iteration (§3.6).
///
/// `X = G / (‖G‖_F + 1e-7)`; if `rows > cols` the iteration runs on `Xᵀ`; `steps` times
/// `A = X·Xᵀ, B = b·A + c·A·A, X = a·X + B·X` with [`NS5_COEFFS`]; the result is transposed
/// back, so it has the shape of `g`. The computation stays in `g`'s dtype (f32 on CPU; the record
/// casts to bf16 on the GPU first, which the caller can do by passing a bf16 tensor). The input is
/// detached: no gradient flows through the result.
///
/// # Errors
///
/// When `g` is not 2-D, or on a candle error.
pub fn newton_schulz5(g: &Tensor, steps: usize) -> Result<Tensor> {
    if g.rank() != 2 {
        bail!("newton_schulz5 expects a 2-D matrix, got shape {:?}", g.dims());
    }
    newton_schulz5_stack(&g.unsqueeze(0)?, steps)?.squeeze(0)
}

/// [`newton_schulz5`] of each matrix of a `(K, rows, cols)` stack at once: every candle op runs
/// on the whole stack (batched matrix products), so a group of same-shaped parameters costs the
/// op count of one.
pub(super) fn newton_schulz5_stack(g: &Tensor, steps: usize) -> Result<Tensor> {
    let (_, rows, cols) = g.dims3()?;
    let (a, b, c) = NS5_COEFFS;
    let g = g.detach();
    let norm = g.sqr()?.sum_keepdim((1, 2))?.sqrt()?.affine(1.0, NS5_EPS)?;
    let mut x = g.broadcast_div(&norm)?;
    let transposed = rows > cols;
    if transposed {
        x = x.transpose(1, 2)?.contiguous()?;
    }
    for _ in 0..steps {
        let gram = x.matmul(&x.transpose(1, 2)?)?;
        let poly = (gram.affine(b, 0.0)? + gram.matmul(&gram)?.affine(c, 0.0)?)?;
        x = (x.affine(a, 0.0)? + poly.matmul(&x)?)?;
    }
    if transposed {
        x = x.transpose(1, 2)?.contiguous()?;
    }
    Ok(x)
}
