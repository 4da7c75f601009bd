//! The MLP sublayer of block `i` on the normed stream `x` `(B*T, D)`:
//!
//! ```text
//! y = act(x Wfc^T) Wproj^T          (hidden width mlp_mult * D)
//! act(u) = relu(u)^2                (model.mlp_activation = "relu2", the baseline)
//!        = leaky_relu(u, a)^2       ("leaky_relu2", a = model.leaky_relu_slope; the record)
//! ```
//!
//! Under mixed precision on the GPU path the `(B*T, hidden)` activations (relu² included) and
//! the output stay in the matmul dtype (see [`Formulation`]).

use candle_core::{Result, Tensor};

use super::Gpt;
use super::MlpActivation;
use super::formulation::Formulation;
use super::lora::Site;
use super::ops::{leaky_relu_sq, relu_sq};

impl Gpt {
    /// The MLP of block `i` at layer-sequence position `slot` on `x` (plus the pass's LoRA
    /// adapter on `x`, if any).
    pub(super) fn mlp(&self, f: &Formulation, (i, slot): (usize, usize), x: &Tensor) -> Result<Tensor> {
        let (fc, proj) = (self.p(&format!("blocks.{i}.mlp.fc.weight")), self.p(&format!("blocks.{i}.mlp.proj.weight")));
        let xin = x;
        let x = f.cast_to_activations(x)?;
        f.observe(&x, || vec![format!("blocks.{i}.mlp.fc.weight")])?;
        let pre = f.linear(&x, &fc)?;
        let up = match self.config().mlp_activation {
            MlpActivation::Relu2 => relu_sq(&pre)?,
            MlpActivation::LeakyRelu2 => leaky_relu_sq(&pre, self.config().leaky_relu_slope)?,
        };
        f.observe(&up, || vec![format!("blocks.{i}.mlp.proj.weight")])?;
        f.adapt(slot, Site::Mlp, xin, f.linear(&up, &proj)?)
    }
}
