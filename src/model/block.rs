//! One transformer block on the `(B*T, D)` residual stream `h`, with `x0` the normed embedding:
//!
//! ```text
//! u = h * resid_mix[0] + x0 * resid_mix[1]
//! u = u + attention(norm(u)) * attn_scale
//! y = u + mlp(norm(u)) * mlp_scale
//! ```
//!
//! Under mixed precision on the GPU path the attention and MLP outputs stay in the matmul dtype
//! and are added to the stream by `scale_add` as they are (no cast pass either way).

use candle_core::{Result, Tensor};

use super::Gpt;
use super::formulation::Formulation;
use super::ops::{resid_mix, scale_add};

impl Gpt {
    /// Block `i` on the stream `h` (`b` batch rows), with the pass's formulation `f` and RoPE
    /// tables `cos`, `sin`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block(&self, f: &Formulation, i: usize, h: &Tensor, x0: &Tensor, b: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let p = |s: &str| self.p(&format!("blocks.{i}.{s}"));
        let u = resid_mix(h, x0, &p("resid_mix"))?;
        let a = self.attention(f, i, &f.norm_in(&u)?, b, cos, sin)?;
        let u = scale_add(&u, &a, &p("attn_scale"))?;
        let m = self.mlp(f, i, &f.norm_in(&u)?)?;
        scale_add(&u, &m, &p("mlp_scale"))
    }
}
