//! The gradient all-reduce: a list of tensors reduced as a few flat buffers ("buckets") rather
//! than one call per tensor. Each bucket concatenates whole tensors (flattened, in list order)
//! until it holds at least `bucket_elems` elements, as DDP's 25 MB buckets do; a tensor larger
//! than a bucket travels alone. Fewer, larger calls amortise the transport's per-call latency;
//! keeping buckets bounded keeps the staging copy small.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};

use super::{Collective, ReduceOp};

/// DDP's default bucket: 25 MiB of f32.
pub const DEFAULT_BUCKET_ELEMS: usize = 25 * (1 << 20) / 4;

/// What one bucketed all-reduce did.
#[derive(Clone, Copy, Debug, Default)]
pub struct BucketStats {
    /// Buckets sent.
    pub buckets: usize,
    /// Elements reduced.
    pub elements: usize,
    /// Wall time of the collectives themselves (packing and unpacking excluded).
    pub comm: Duration,
}

/// Every rank's `tensors` combined by `op`, each returned in its own shape, dtype kept. All
/// tensors of one bucket share a dtype: a change of dtype starts a new bucket.
pub fn all_reduce_tensors(
    c: &dyn Collective,
    tensors: &[Tensor],
    op: ReduceOp,
    bucket_elems: usize,
) -> anyhow::Result<(Vec<Tensor>, BucketStats)> {
    let mut stats = BucketStats::default();
    if c.is_identity() {
        return Ok((tensors.to_vec(), stats));
    }
    let mut out = Vec::with_capacity(tensors.len());
    let mut start = 0;
    while start < tensors.len() {
        let dtype: DType = tensors[start].dtype();
        let mut end = start;
        let mut elems = 0;
        while end < tensors.len() && tensors[end].dtype() == dtype && (elems == 0 || elems < bucket_elems.max(1)) {
            elems += tensors[end].elem_count();
            end += 1;
        }
        let flats: Vec<Tensor> = tensors[start..end].iter().map(|t| t.flatten_all()).collect::<candle_core::Result<_>>()?;
        let flat = if flats.len() == 1 { flats[0].clone() } else { Tensor::cat(&flats, 0)? };
        let t0 = Instant::now();
        let reduced = c.all_reduce(&flat, op)?;
        stats.comm += t0.elapsed();
        stats.buckets += 1;
        stats.elements += elems;
        let mut offset = 0;
        for t in &tensors[start..end] {
            let n = t.elem_count();
            out.push(reduced.narrow(0, offset, n)?.reshape(t.dims())?);
            offset += n;
        }
        start = end;
    }
    Ok((out, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::single::Single;

    /// A world of one returns the tensors themselves and sends nothing.
    #[test]
    fn one_rank_is_the_identity() {
        let a = Tensor::arange(0f32, 6.0, &candle_core::Device::Cpu).unwrap().reshape((2, 3)).unwrap();
        let (out, stats) = all_reduce_tensors(&Single, std::slice::from_ref(&a), ReduceOp::Mean, 4).unwrap();
        assert_eq!(out[0].to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
        assert_eq!(stats.buckets, 0);
    }
}
