//! Per-head RMS norm followed by RoPE on token-major rows, as one op each way, for the query
//! and key projections on a GPU (the composite of [`super::ops`] is about a dozen passes forward
//! and twice that backward, plus two transposes). The CPU implementation is the reference the
//! GPU kernels (`kernels/fused.cu`) are checked against; CPU training uses
//! [`super::fused::qk_norm_rope`], which also folds in the gain.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};

use super::ops;

/// `rope(rms_norm(head))` for every head of `x` `(N, heads * D)`, whose row `n` is position
/// `n % T`; `table` is `(T, D)`: the `(T, D / 2)` cos table then the sin table of
/// [`ops::rope_tables`], side by side. `eps` is the norm's epsilon, by default the input dtype's
/// ([`ops::rms_eps`]). Returns `(N, heads * D)`. Differentiable in `x`.
pub fn norm_rope(x: &Tensor, table: &Tensor, heads: usize, eps: Option<f64>) -> Result<Tensor> {
    let (n, width) = x.dims2()?;
    let (t, d) = table.dims2()?;
    if heads == 0 || d % 2 != 0 || width != heads * d || t == 0 || n % t != 0 {
        bail!("norm_rope: x {:?} with {heads} heads does not fit the table {:?}", x.shape(), table.shape());
    }
    let table = table.to_dtype(x.dtype())?.contiguous()?;
    let eps = eps.unwrap_or(ops::rms_eps(x.dtype()));
    x.contiguous()?.apply_op2(&table, NormRope { heads, eps })
}

struct NormRope {
    heads: usize,
    /// The RMS norm's epsilon.
    eps: f64,
}

/// `(x, grad, table) -> dx` of [`NormRope`].
struct NormRopeBwd {
    heads: usize,
    eps: f64,
}

fn host(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    super::host::to_f64("norm_rope", s, l)
}

fn storage(v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
    super::host::from_f64("norm_rope", v, dtype)
}

/// Row geometry: `(d, seq)` from the table's layout, checked against `x`'s element count.
fn geometry(xl: &Layout, tl: &Layout) -> Result<(usize, usize)> {
    let (seq, d) = tl.shape().dims2()?;
    if d == 0 || !xl.shape().elem_count().is_multiple_of(d) {
        bail!("norm_rope: x {:?} does not split into rows of {d}", xl.shape());
    }
    Ok((d, seq))
}

/// The reference forward pass in f64.
fn fwd_rows(x: &[f64], table: &[f64], d: usize, heads: usize, seq: usize, eps: f64) -> Vec<f64> {
    let half = d / 2;
    let mut out = vec![0.0; x.len()];
    for (r, (xr, o)) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
        let tr = &table[((r / heads) % seq) * d..][..d];
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        for i in 0..half {
            let (y1, y2, c, s) = (xr[i] * inv, xr[i + half] * inv, tr[i], tr[half + i]);
            o[i] = y1 * c + y2 * s;
            o[i + half] = y2 * c - y1 * s;
        }
    }
    out
}

/// The reference backward pass in f64: rotate the gradient back, then RMS norm's backward.
fn bwd_rows(x: &[f64], g: &[f64], table: &[f64], d: usize, heads: usize, seq: usize, eps: f64) -> Vec<f64> {
    let half = d / 2;
    let mut out = vec![0.0; x.len()];
    for (r, ((xr, gr), o)) in x.chunks_exact(d).zip(g.chunks_exact(d)).zip(out.chunks_exact_mut(d)).enumerate() {
        let tr = &table[((r / heads) % seq) * d..][..d];
        let mut dy = vec![0.0; d];
        for i in 0..half {
            let (g1, g2, c, s) = (gr[i], gr[i + half], tr[i], tr[half + i]);
            dy[i] = g1 * c - g2 * s;
            dy[i + half] = g1 * s + g2 * c;
        }
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        let k = xr.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>() / d as f64 * inv * inv * inv;
        for ((o, dy), x) in o.iter_mut().zip(&dy).zip(xr) {
            *o = dy * inv - x * k;
        }
    }
    out
}

/// Runs `kernel` (`norm_rope_fwd` or `_bwd`) over the head rows of `inputs` (x first, then the
/// gradient) with the table `(ts, tl)`; the output has x's shape. Head rows that split into
/// 16-byte chunks (64 values in bf16 or f32, as the baseline's) take the chunked kernels
/// (`norm_rope_vec_*`: several rows per warp, one 16-byte load per lane and tensor).
#[cfg(feature = "cuda")]
fn launch(
    kernel: &str,
    (heads, eps): (usize, f64),
    inputs: &[(&candle_core::CudaStorage, &Layout)],
    (ts, tl): (&candle_core::CudaStorage, &Layout),
) -> Result<(candle_core::CudaStorage, Shape)> {
    let xl = inputs[0].1;
    let (d, seq) = geometry(xl, tl)?;
    let eps = eps as f32;
    let chunked = kernel.replacen("norm_rope_", "norm_rope_vec_", 1);
    let out = super::gpu_kernels::rows_op_chunked(kernel, &chunked, inputs, &[(ts, tl)], d, eps, &[heads as i32, seq as i32])?;
    Ok((out, xl.shape().clone()))
}

impl CustomOp2 for NormRope {
    fn name(&self) -> &'static str {
        "norm-rope"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ts: &CpuStorage, tl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (d, seq) = geometry(xl, tl)?;
        let out = fwd_rows(&host(xs, xl)?, &host(ts, tl)?, d, self.heads, seq, self.eps);
        Ok((storage(out, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        launch("norm_rope_fwd", (self.heads, self.eps), &[(xs, xl)], (ts, tl))
    }

    fn bwd(&self, x: &Tensor, table: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = x.apply_op3_no_bwd(&grad.contiguous()?, table, &NormRopeBwd { heads: self.heads, eps: self.eps })?;
        Ok((Some(dx), None))
    }
}

impl CustomOp3 for NormRopeBwd {
    fn name(&self) -> &'static str {
        "norm-rope-bwd"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if xl.dims() != gl.dims() {
            bail!("norm_rope backward: gradient {:?} for x {:?}", gl.shape(), xl.shape());
        }
        let (d, seq) = geometry(xl, tl)?;
        let out = bwd_rows(&host(xs, xl)?, &host(gs, gl)?, &host(ts, tl)?, d, self.heads, seq, self.eps);
        Ok((storage(out, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        launch("norm_rope_bwd", (self.heads, self.eps), &[(xs, xl), (gs, gl)], (ts, tl))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::tests::{flat, seeded as rand};
    use candle_core::{Device, Var};

    /// The composite it replaces: heads `(B, H, T, D)`, `ops::rope(ops::rms_norm(..))`, back to
    /// token-major rows.
    fn composite(x: &Tensor, cos: &Tensor, sin: &Tensor, b: usize, t: usize, h: usize, d: usize) -> Tensor {
        let xh = x.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
        ops::rope(&ops::rms_norm(&xh).unwrap(), cos, sin).unwrap().transpose(1, 2).unwrap().reshape((b * t, h * d)).unwrap()
    }

    #[test]
    fn matches_the_composite_forward_and_backward() {
        for (b, t, h, d) in [(2usize, 5usize, 3usize, 4usize), (1, 7, 1, 8), (3, 2, 2, 2)] {
            let (cos, sin) = ops::rope_tables(t, d, 10_000.0, DType::F64, &Device::Cpu).unwrap();
            let table = Tensor::cat(&[&cos, &sin], 1).unwrap();
            let x = Var::from_tensor(&rand(&[b * t, h * d], 3)).unwrap();
            let g = rand(&[b * t, h * d], 4);
            let ours = norm_rope(x.as_tensor(), &table, h, None).unwrap();
            let want = composite(x.as_tensor(), &cos, &sin, b, t, h, d);
            for (a, w) in flat(&ours).iter().zip(flat(&want)) {
                assert!((a - w).abs() < 1e-12, "{:?}: {a} vs {w}", (b, t, h, d));
            }
            let d_ours = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().clone();
            let d_want = (want * &g).unwrap().sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().clone();
            for (a, w) in flat(&d_ours).iter().zip(flat(&d_want)) {
                assert!((a - w).abs() < 1e-12, "{:?} gradient: {a} vs {w}", (b, t, h, d));
            }
        }
    }

    #[test]
    fn rejects_shapes_that_do_not_fit() {
        let table = Tensor::zeros((4, 8), DType::F64, &Device::Cpu).unwrap();
        assert!(norm_rope(&Tensor::zeros((8, 12), DType::F64, &Device::Cpu).unwrap(), &table, 2, None).is_err(), "12 != 2 * 8");
        assert!(
            norm_rope(&Tensor::zeros((6, 16), DType::F64, &Device::Cpu).unwrap(), &table, 2, None).is_err(),
            "6 rows are not whole sequences of 4"
        );
    }
}
