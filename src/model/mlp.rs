//! The MLP sublayer of block `i` on the normed stream `x` `(B*T, D)`:
//!
//! ```text
//! y = relu(x Wfc^T)^2 Wproj^T          (hidden width mlp_mult * D)
//! ```
//!
//! Under mixed precision on the GPU path the `(B*T, hidden)` activations (relu² included) and
//! the output stay in the matmul dtype (see [`Formulation`]).

use candle_core::{Result, Tensor};

use super::Gpt;
use super::formulation::Formulation;
use super::ops::relu_sq;

impl Gpt {
    /// The MLP of block `i` on `x`.
    pub(super) fn mlp(&self, f: &Formulation, i: usize, x: &Tensor) -> Result<Tensor> {
        let (fc, proj) = (self.p(&format!("blocks.{i}.mlp.fc.weight")), self.p(&format!("blocks.{i}.mlp.proj.weight")));
        let x = f.cast_to_activations(x)?;
        let up = relu_sq(&f.linear(&x, &fc)?)?;
        f.linear(&up, &proj)
    }
}
