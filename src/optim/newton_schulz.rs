//! Newton–Schulz orthogonalization (NS5), the heart of Muon: see the module doc of
//! [`crate::optim`] for the iteration and what five steps do to the singular values.

#[cfg(feature = "tools")]
use candle_core::bail;
#[cfg(feature = "candle")]
use candle_core::{Result, Tensor};

/// The quintic Newton–Schulz coefficients `(a, b, c)` of the record (§3.6).
pub const NS5_COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// The epsilon added to the Frobenius norm before normalizing in [`newton_schulz5`].
pub const NS5_EPS: f64 = 1e-7;

/// Polar Express's per-iteration coefficients `(a, b, c)` for five steps (Amsel et al. 2025, as
/// the 04-27 record runs them): each iteration's quintic is the minimax-optimal one for the
/// singular-value interval the previous ones left, so five steps end closer to 1 than five of
/// the fixed quintic.
pub const POLAR_EXPRESS_COEFFS: [(f64, f64, f64); 5] = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
];

/// Which coefficients each Newton-Schulz iteration uses (`train.muon_ns`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NewtonSchulz {
    /// The same quintic [`NS5_COEFFS`] every iteration (the baseline and the 04-09 record).
    #[default]
    Quintic,
    /// Iteration `i` uses [`POLAR_EXPRESS_COEFFS`]`[i]` (the 04-27 record); at most 5 steps.
    PolarExpress,
}

impl NewtonSchulz {
    /// The coefficients of iteration `i` (from 0). Polar Express has none past its fifth:
    /// [`NewtonSchulz::check`] refuses such a step count before a run starts.
    pub fn at(self, i: usize) -> (f64, f64, f64) {
        match self {
            Self::Quintic => NS5_COEFFS,
            Self::PolarExpress => POLAR_EXPRESS_COEFFS[i.min(POLAR_EXPRESS_COEFFS.len() - 1)],
        }
    }

    /// Refuses `steps` iterations these coefficients do not cover, naming `key` (the step count's).
    pub fn check(self, steps: usize, key: &str) -> anyhow::Result<()> {
        anyhow::ensure!(steps >= 1, "`{key}` must be at least 1");
        if self == Self::PolarExpress {
            anyhow::ensure!(
                steps <= POLAR_EXPRESS_COEFFS.len(),
                "`{key}` = {steps}: Polar Express (`train.muon_ns = \"polar_express\"`) has coefficients for at most {} steps",
                POLAR_EXPRESS_COEFFS.len()
            );
        }
        Ok(())
    }
}

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
#[cfg(feature = "tools")]
pub fn newton_schulz5(g: &Tensor, steps: usize) -> Result<Tensor> {
    newton_schulz(g, steps, NewtonSchulz::Quintic)
}

/// [`newton_schulz5`] with iteration `i` using `coeffs.at(i)`.
#[cfg(feature = "tools")]
pub fn newton_schulz(g: &Tensor, steps: usize, coeffs: NewtonSchulz) -> Result<Tensor> {
    if g.rank() != 2 {
        bail!("newton_schulz5 expects a 2-D matrix, got shape {:?}", g.dims());
    }
    newton_schulz5_stack(&g.unsqueeze(0)?, steps, coeffs)?.squeeze(0)
}

/// [`newton_schulz5`] of each matrix of a `(K, rows, cols)` stack at once: every candle op runs
/// on the whole stack (batched matrix products), so a group of same-shaped parameters costs the
/// op count of one.
#[cfg(feature = "candle")]
pub(super) fn newton_schulz5_stack(g: &Tensor, steps: usize, coeffs: NewtonSchulz) -> Result<Tensor> {
    let (_, rows, cols) = g.dims3()?;
    let g = g.detach();
    let norm = g.sqr()?.sum_keepdim((1, 2))?.sqrt()?.affine(1.0, NS5_EPS)?;
    let mut x = g.broadcast_div(&norm)?;
    let transposed = rows > cols;
    if transposed {
        x = x.transpose(1, 2)?.contiguous()?;
    }
    for i in 0..steps {
        let (a, b, c) = coeffs.at(i);
        let gram = x.matmul(&x.transpose(1, 2)?)?;
        let poly = (gram.affine(b, 0.0)? + gram.matmul(&gram)?.affine(c, 0.0)?)?;
        x = (x.affine(a, 0.0)? + poly.matmul(&x)?)?;
    }
    if transposed {
        x = x.transpose(1, 2)?.contiguous()?;
    }
    Ok(x)
}
