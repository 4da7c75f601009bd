//! One transformer block on the `(B*T, D)` residual stream `h`, with `x0` the normed embedding
//! and `s` = `1/sqrt(i + 1)` for physical block `i` under `model.ln_scale` (else 1):
//!
//! ```text
//! u = h * resid_mix[0] + x0 * resid_mix[1]
//! sequential (the baseline):                  parallel (model.parallel_residual_start <= i):
//!   u = u + attention(norm(u) s) * attn_scale   n = norm(u) s
//!   y = u + mlp(norm(u) s) * mlp_scale          y = u + attention(n) * attn_scale + mlp(n) * mlp_scale
//! ```
//!
//! From `model.parallel_decoder_start` on, a block runs on the two-lane decoder's lanes
//! `(l0, l1)` instead ([`Gpt::lane_block`]):
//!
//! ```text
//! a = attention(norm(l0 * resid_mix[0] + x0 * resid_mix[1]) s) * attn_scale
//! m = mlp(norm(l1) s) * mlp_scale
//! l0' = resid[i, 0] l0 + post[i, 0, 0] a + post[i, 1, 0] m
//! l1' = resid[i, 1] l1 + post[i, 0, 1] a + post[i, 1, 1] m
//! ```
//!
//! (`resid` = `parallel_resid_lambdas`, `post` = `parallel_post_lambdas`).
//!
//! Under mixed precision on the GPU path the attention and MLP outputs stay in the matmul dtype
//! and are added to the stream by `scale_add` as they are (no cast pass either way).

use candle_core::{Result, Tensor};

use super::Gpt;
use super::formulation::Formulation;
use super::ops::{cast, resid_mix, scale_add};

impl Gpt {
    /// Block `i`'s norm of its input `u`: `norm(u)`, times `1/sqrt(i + 1)` under `ln_scale`.
    fn block_norm(&self, f: &Formulation, i: usize, u: &Tensor) -> Result<Tensor> {
        let n = f.norm_in(u)?;
        match self.config().ln_scale_of(i) {
            Some(s) => n.affine(s, 0.0),
            None => Ok(n),
        }
    }

    /// Block `i`, at position `slot` of the layer sequence, on the stream `h` (`b` batch rows),
    /// with the pass's formulation `f` and RoPE tables `cos`, `sin`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block(
        &self,
        f: &Formulation,
        (i, slot): (usize, usize),
        h: &Tensor,
        x0: &Tensor,
        b: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let p = |s: &str| self.p(&format!("blocks.{i}.{s}"));
        let norm = |u: &Tensor| self.block_norm(f, i, u);
        let u = resid_mix(h, x0, &p("resid_mix"))?;
        if self.config().parallel(i) {
            let n = norm(&u)?;
            let a = self.attention(f, (i, slot), &n, b, cos, sin)?;
            let m = self.mlp(f, (i, slot), &n)?;
            return scale_add(&scale_add(&u, &a, &p("attn_scale"))?, &m, &p("mlp_scale"));
        }
        let a = self.attention(f, (i, slot), &norm(&u)?, b, cos, sin)?;
        let u = scale_add(&u, &a, &p("attn_scale"))?;
        let m = self.mlp(f, (i, slot), &norm(&u)?)?;
        scale_add(&u, &m, &p("mlp_scale"))
    }

    /// Block `i` on the two-lane decoder's lanes `(l0, l1)`: the lanes it hands on.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lane_block(
        &self,
        f: &Formulation,
        (i, slot): (usize, usize),
        (l0, l1): (&Tensor, &Tensor),
        x0: &Tensor,
        b: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let p = |s: &str| self.p(&format!("blocks.{i}.{s}"));
        let norm = |u: &Tensor| self.block_norm(f, i, u);
        let dtype = l0.dtype();
        let u = resid_mix(l0, x0, &p("resid_mix"))?;
        let a = cast(&self.attention(f, (i, slot), &norm(&u)?, b, cos, sin)?, dtype)?.broadcast_mul(&p("attn_scale"))?;
        let m = cast(&self.mlp(f, (i, slot), &norm(l1)?)?, dtype)?.broadcast_mul(&p("mlp_scale"))?;
        let (resid, post) = (self.p("parallel_resid_lambdas").get(i)?, self.p("parallel_post_lambdas").get(i)?);
        let lane = |l: &Tensor, k: usize| -> Result<Tensor> {
            let mix = |t: &Tensor, w: Tensor| t.broadcast_mul(&w);
            mix(l, resid.get(k)?)? + mix(&a, post.get(0)?.get(k)?)? + mix(&m, post.get(1)?.get(k)?)?
        };
        Ok((lane(l0, 0)?, lane(l1, 1)?))
    }
}
