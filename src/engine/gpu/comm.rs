//! The GPU backend's collectives (data parallel): regions of the arena resolved to device
//! spaces and queued as [`CommCall`]s with the rest of the work, so that the gradient
//! exchange and sharded Muon's exchange of updates run on the device's communication stream
//! inside the units of work (and their CUDA graphs) instead of through the host.
//!
//! ```text
//! compute stream:  ... grads of bucket 0 final ─┬─ more backward ... ─┬─ (join) optimizer
//!                                               │ fork                │
//! comm stream:                                  └─ all-reduce(bucket 0) ... all-reduce(k) ─┘
//! ```
//!
//! Every collective forks from the compute stream where it is queued; a join (explicit, or
//! the one every unit of work that queued collectives ends with, so that a captured graph's
//! streams meet again) makes the compute stream wait for all of them.

use super::{CommCall, Device, KernelBackend, Space, Work};
use crate::dist::{Collective, ReduceOp};
use crate::engine::backend::Buf;

impl<D: Device> KernelBackend<D> {
    /// `regions` as device pieces `(space, offset, elements)`: each cut at the edges of the
    /// bf16 activations, then resolved to its space; neighbours in one space merged.
    fn comm_pieces(&self, regions: &[Buf]) -> Vec<(Space, usize, usize)> {
        let mut out: Vec<(Space, usize, usize)> = Vec::new();
        for r in regions.iter().filter(|r| r.len > 0) {
            for p in self.pieces(*r) {
                let (space, off) = self.at(p.off);
                match out.last_mut() {
                    Some(last) if last.0 == space && last.1 + last.2 == off => last.2 += p.len,
                    _ => out.push((space, off, p.len)),
                }
            }
        }
        out
    }

    /// Starts the device's communicator among `ranks`.
    pub(super) fn start_comm(&mut self, ranks: std::sync::Arc<dyn Collective>) -> anyhow::Result<bool> {
        self.dev.comm_init(ranks)?;
        self.comm = true;
        Ok(true)
    }

    fn ensure_comm(&self) {
        assert!(self.comm, "a collective queued on {} before set_comm", self.dev.name());
    }

    /// Queues an all-reduce of `regions`.
    pub(super) fn queue_all_reduce(&mut self, regions: &[Buf], op: ReduceOp) {
        self.ensure_comm();
        let pieces = self.comm_pieces(regions);
        if pieces.is_empty() {
            return;
        }
        self.comm_open = true;
        self.submit(Work::Comm(CommCall::AllReduce { pieces, op }));
    }

    /// Queues broadcasts of `(region, root)`.
    pub(super) fn queue_broadcast(&mut self, pieces: &[(Buf, usize)]) {
        self.ensure_comm();
        let pieces: Vec<(Space, usize, usize, usize)> =
            pieces.iter().flat_map(|&(b, root)| self.comm_pieces(&[b]).into_iter().map(move |(s, o, n)| (s, o, n, root))).collect();
        if pieces.is_empty() {
            return;
        }
        self.comm_open = true;
        self.submit(Work::Comm(CommCall::Broadcast { pieces }));
    }

    /// Queues a join when collectives are open.
    pub(super) fn queue_join(&mut self) {
        if std::mem::take(&mut self.comm_open) {
            self.submit(Work::Comm(CommCall::Join));
        }
    }
}
