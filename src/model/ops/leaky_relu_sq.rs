//! The 04-09 record's MLP activation, squared leaky ReLU with slope `a` in [0, 1], elementwise:
//!
//! ```text
//! l(x) = x            (x > 0)        y  = l(x)^2
//!        a x          (x <= 0)       dx = 2 l(x) l'(x) g,   l'(x) = 1 or a
//! ```
//!
//! For `a` in [0, 1], `l(x) = max(x, a x)`, which is how it runs on every device: candle's
//! `maximum` and `sqr`, whose backward passes give `dx` above. The engine's fused CPU form is
//! [`super::relu_sq`]'s kernel with the slope. The reference it is tested against is the
//! scalar formula.

#[cfg(feature = "candle")]
use candle_core::{Result, Tensor, bail};

/// `leaky_relu(x, slope)^2`, elementwise; `slope` in [0, 1].
#[cfg(feature = "candle")]
pub fn leaky_relu_sq(x: &Tensor, slope: f64) -> Result<Tensor> {
    if !(0.0..=1.0).contains(&slope) {
        bail!("leaky_relu_sq: slope {slope} is outside [0, 1]");
    }
    x.maximum(&x.affine(slope, 0.0)?)?.sqr()
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var};

    use super::*;
    use crate::model::ops::testing::{flat, seeded};

    /// The scalar formula and its derivative, in f64.
    fn reference(x: f64, a: f64) -> (f64, f64) {
        let (l, dl) = if x > 0.0 { (x, 1.0) } else { (a * x, a) };
        (l * l, 2.0 * l * dl)
    }

    #[test]
    fn matches_the_formula_and_its_derivative() {
        for slope in [0.0, 0.5, 1.0] {
            let x = Var::from_tensor(&seeded(&[7, 33], 3)).unwrap();
            let y = leaky_relu_sq(x.as_tensor(), slope).unwrap();
            let g = seeded(&[7, 33], 4);
            let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = flat(grads.get(x.as_tensor()).unwrap());
            for (i, ((&xi, &yi), &gi)) in flat(x.as_tensor()).iter().zip(&flat(&y)).zip(&flat(&g)).enumerate() {
                let (want, dwant) = reference(xi, slope);
                assert!((yi - want).abs() <= 1e-12 * (1.0 + want.abs()), "slope {slope} [{i}]: {yi} vs {want}");
                assert!((dx[i] - dwant * gi).abs() <= 1e-12 * (1.0 + dwant.abs()), "slope {slope} d[{i}]: {} vs {}", dx[i], dwant * gi);
            }
        }
    }

    #[test]
    fn slope_zero_is_relu_squared_and_bad_slopes_are_refused() {
        let x = seeded(&[5, 9], 8).to_dtype(DType::F32).unwrap();
        let a = flat(&leaky_relu_sq(&x, 0.0).unwrap());
        let b = flat(&crate::model::ops::relu_sq(&x).unwrap());
        assert_eq!(a, b);
        for bad in [-0.1, 1.5, f64::NAN] {
            assert!(leaky_relu_sq(&x, bad).unwrap_err().to_string().contains("slope"));
        }
    }
}
