//! The token-embedding lookup: for the table `W` `(V, C)` and ids `x` `(N,)`,
//!
//! ```text
//! y[n] = W[x[n]];   dW[v] = sum over n with x[n] = v of g[n]   (in token order)
//! ```
//!
//! The token-embedding lookup with its own backward pass for the GPU: candle's `index_select`
//! gradient (`index_add`) runs one thread per channel over every token in turn (9 ms per
//! 16,384 tokens on an H100, more than any other kernel of a step); the kernel here
//! (`kernels/fused.cu`) gives each vocabulary row a block that gathers its tokens' gradients in
//! token order, so the sum is deterministic. The CPU implementation ([`embedding_rows_bwd`], in
//! f64) is its reference and the engine's CPU backward pass; candle's CPU training keeps
//! `index_select`.
//!
//! BigramHash (`model.bigram_vocab_size`, the records of 2026-03-20) looks its table up with
//! the same ops at ids of its own, each position's bucket ([`bigram_bucket`]):
//!
//! ```text
//! b[0] = B - 1;   b[i] = (36313 x[i] XOR 27191 x[i-1]) mod (B - 1)   per sequence of T, B buckets
//! ```
//!
//! the records' int32 products, exact (no wrap) for ids below [`BIGRAM_MAX_VOCAB`]. The
//! engine's GPU kernels compute the same buckets (`bigram_bucket` in
//! `kernels/engine/embedding.cuh`).

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::model::host::simd::Real;

/// Rows `ids` of `weight` `(V, C)` for `ids` `(N,)` of u32: `(N, C)`, differentiable in `weight`.
#[cfg(feature = "candle")]
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    weight.dims2()?;
    if crate::model::gpu_path(weight) {
        ids.dims1()?;
        if ids.dtype() != DType::U32 {
            bail!("embedding: ids must be u32, got {:?}", ids.dtype());
        }
        return weight.contiguous()?.apply_op2(&ids.contiguous()?, Embedding);
    }
    weight.index_select(ids, 0)
}

/// The largest vocabulary whose ids BigramHash's hash multiplies without overflowing the
/// records' 32-bit signed products: `36313 (V - 1) < 2^31`.
pub const BIGRAM_MAX_VOCAB: usize = (i32::MAX as usize) / 36313 + 1;

/// The BigramHash bucket of position `i` of `ids`, sequences of `t` (see the module doc):
/// `buckets - 1` at a sequence's first position, else the hash of `ids[i - 1], ids[i]` mod
/// `buckets - 1`. `buckets` is at least 2.
pub fn bigram_bucket(ids: &[u32], i: usize, t: usize, buckets: usize) -> u32 {
    let m = (buckets - 1) as u32;
    if i.is_multiple_of(t) { m } else { (36313u32.wrapping_mul(ids[i]) ^ 27191u32.wrapping_mul(ids[i - 1])) % m }
}

/// Every position's BigramHash bucket ([`bigram_bucket`]).
pub fn bigram_ids(ids: &[u32], t: usize, buckets: usize) -> Vec<u32> {
    (0..ids.len()).map(|i| bigram_bucket(ids, i, t, buckets)).collect()
}

/// `out[n] = table[ids[n]]` for `dim`-wide rows (the engine's CPU lookup; candle's CPU training
/// runs `index_select`).
pub(crate) fn embedding_rows_fwd<T: Real>(table: &[T], ids: &[u32], out: &mut [T], dim: usize) {
    if dim == 0 {
        return;
    }
    out.par_chunks_mut(dim).zip(ids.par_iter()).for_each(|(o, &id)| {
        let id = id as usize;
        o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
    });
}

/// `dtable[v] += sum over n with ids[n] = v of dout[n]`, each row's sum in token order (the
/// maths of the module doc): the engine's CPU backward pass, and the backward op's CPU
/// implementation in f64 (the GPU kernel's reference). Every id must be below the table's rows.
pub(crate) fn embedding_rows_bwd<T: Real>(dout: &[T], ids: &[u32], dtable: &mut [T], dim: usize) {
    if dim == 0 {
        return;
    }
    // Rows of the table split among tasks, each scanning every id: no two tasks write a row,
    // and each row's sum runs in token order.
    let per = (dtable.len() / dim).div_ceil(rayon::current_num_threads().max(1)).max(1);
    dtable.par_chunks_mut(per * dim).enumerate().for_each(|(c, block)| {
        let lo = c * per;
        for (n, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= lo && id < lo + block.len() / dim {
                for (d, &g) in block[(id - lo) * dim..(id - lo + 1) * dim].iter_mut().zip(&dout[n * dim..(n + 1) * dim]) {
                    *d += g;
                }
            }
        }
    });
}

#[cfg(feature = "candle")]
struct Embedding;

/// `(ids, grad) -> (vocab, C)` gradient of the table.
#[cfg(feature = "candle")]
struct EmbeddingBwd {
    vocab: usize,
}

#[cfg(feature = "candle")]
impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, w: &CpuStorage, wl: &Layout, ids: &CpuStorage, il: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c) = (il.shape().elem_count(), wl.shape().dims2()?.1);
        Ok((w.index_select(ids, wl, il, 0)?, Shape::from((n, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        ids: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c) = (il.shape().elem_count(), wl.shape().dims2()?.1);
        Ok((w.index_select(ids, wl, il, 0)?, Shape::from((n, c))))
    }

    fn bwd(&self, w: &Tensor, ids: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dw = ids.apply_op2_no_bwd(&grad.contiguous()?, &EmbeddingBwd { vocab: w.dim(0)? })?;
        Ok((Some(dw), None))
    }
}

#[cfg(feature = "candle")]
impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "embedding-bwd"
    }

    fn cpu_fwd(&self, ids: &CpuStorage, il: &Layout, g: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c) = gl.shape().dims2()?;
        let Some((i0, i1)) = il.contiguous_offsets() else { bail!("embedding backward: ids {il:?} must be contiguous") };
        let CpuStorage::U32(ids) = ids else { bail!("embedding backward: ids must be u32, got {:?}", ids.dtype()) };
        let ids = &ids[i0..i1];
        if ids.len() != n {
            bail!("embedding backward: {} ids for a gradient of {n} rows", ids.len());
        }
        let g_values = crate::model::host::convert::to_f64("embedding backward", g, gl)?;
        if let Some(&v) = ids.iter().find(|&&v| v as usize >= self.vocab) {
            bail!("embedding backward: token id {v} is outside the vocabulary of {}", self.vocab);
        }
        let mut dw = vec![0.0f64; self.vocab * c];
        embedding_rows_bwd(&g_values, ids, &mut dw, c);
        let out = crate::model::host::convert::from_f64("embedding backward", dw, g.dtype())?;
        Ok((out, Shape::from((self.vocab, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        il: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = gl.shape().dims2()?.1;
        Ok((crate::model::cuda::fused::embedding_bwd((ids, il), (g, gl), self.vocab)?, Shape::from((self.vocab, c))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The buckets are the records' (values from their `bigram_hash` in PyTorch: int32
    /// products, XOR, `%` by 10,239), a sequence's first position in the last bucket.
    #[test]
    fn bigram_buckets_are_the_records() {
        // torch: t = [[1, 2, 8191], [5, 0, 5]]; out[..., 1:] = (36313 t[1:] ^ 27191 t[:-1]) % 10239.
        let ids = [1u32, 2, 8191, 5, 0, 5];
        let want = |a: u32, b: u32| ((36313 * a as i64) ^ (27191 * b as i64)).rem_euclid(10239) as u32;
        assert_eq!(bigram_ids(&ids, 3, 10240), [10239, want(2, 1), want(8191, 2), 10239, want(0, 5), want(5, 0)]);
        assert_eq!(bigram_ids(&[7, 7], 2, 2), [1, 0], "one bucket besides the first position's");
        assert_eq!(36313 * (BIGRAM_MAX_VOCAB as i64 - 1), 2_147_478_194, "below 2^31 - 1");
        assert!(36313 * BIGRAM_MAX_VOCAB as i64 > i32::MAX as i64);
    }

    /// The backward op gives `index_select`'s gradient (repeated ids add up), and an id outside
    /// the table is an error, not a wild write.
    #[test]
    fn backward_op_matches_index_select_gradients() {
        let mut rng = fastrand::Rng::with_seed(4);
        let w =
            Var::from_tensor(&Tensor::from_vec((0..7 * 5).map(|_| rng.f64()).collect::<Vec<_>>(), (7, 5), &Device::Cpu).unwrap()).unwrap();
        let ids = Tensor::new(&[3u32, 0, 3, 6, 3, 1], &Device::Cpu).unwrap();
        let g = Tensor::from_vec((0..6 * 5).map(|_| rng.f64() - 0.5).collect::<Vec<_>>(), (6, 5), &Device::Cpu).unwrap();
        let rows = embedding(w.as_tensor(), &ids).unwrap();
        assert_eq!(rows.to_vec2::<f64>().unwrap(), w.as_tensor().index_select(&ids, 0).unwrap().to_vec2::<f64>().unwrap());
        let want = (rows * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let got = ids.apply_op2_no_bwd(&g, &EmbeddingBwd { vocab: 7 }).unwrap();
        let (a, b) = (got.to_vec2::<f64>().unwrap(), want.get(w.as_tensor()).unwrap().to_vec2::<f64>().unwrap());
        for (ra, rb) in a.iter().zip(&b) {
            for (x, y) in ra.iter().zip(rb) {
                assert!((x - y).abs() < 1e-12, "{a:?} vs {b:?}");
            }
        }
        assert!(a[2].iter().all(|&x| x == 0.0), "row 2 is never looked up");
        let err = Tensor::new(&[9u32], &Device::Cpu)
            .unwrap()
            .apply_op2_no_bwd(&g.narrow(0, 0, 1).unwrap(), &EmbeddingBwd { vocab: 7 })
            .unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    }
}
