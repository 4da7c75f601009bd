//! A world of one rank: every collective is the identity (a gather adds the leading dimension
//! of one). What a process started without a launcher uses, so the training code calls the same
//! operations whatever the world size.

use candle_core::Tensor;

use super::{Collective, ReduceOp};

/// One rank, no transport.
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }

    fn world(&self) -> usize {
        1
    }

    fn backend(&self) -> &'static str {
        "single"
    }

    fn is_identity(&self) -> bool {
        true
    }

    fn all_reduce(&self, t: &Tensor, _op: ReduceOp) -> anyhow::Result<Tensor> {
        Ok(t.clone())
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> anyhow::Result<Tensor> {
        anyhow::ensure!(root == 0, "broadcast from rank {root} in a world of one");
        Ok(t.clone())
    }

    fn all_gather(&self, t: &Tensor) -> anyhow::Result<Tensor> {
        Ok(t.unsqueeze(0)?)
    }

    fn reduce_scatter(&self, t: &Tensor, _op: ReduceOp) -> anyhow::Result<Tensor> {
        Ok(t.clone())
    }

    fn barrier(&self) -> anyhow::Result<()> {
        Ok(())
    }

    fn all_reduce_host(&self, values: &[f64], _op: ReduceOp) -> anyhow::Result<Vec<f64>> {
        Ok(values.to_vec())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }

    fn abort(&self, _code: i32) {}
}
