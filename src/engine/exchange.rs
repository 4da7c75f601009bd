//! The engine's gradient exchange between ranks (data parallel): after a step's last
//! micro-batch every gradient is replaced by its mean over the ranks, as DDP's all-reduce does,
//! in buckets that leave as soon as the backward pass has finished their gradients, so that the
//! collectives run while the pass goes on.
//!
//! ```text
//! backward pass (compute thread)              exchange thread
//!   head          event 0  -> bucket 0 ready ---> all-reduce(bucket 0)      (the last blocks'
//!   position P-1  event 1                         ...                        gradients and the
//!   ...           event k  -> bucket 1 ready ---> all-reduce(bucket 1)       head leave first)
//!   embedding     event P+1 -> the rest     ---> all-reduce(...)
//! wait for every bucket; write the means back into the gradient region
//! ```
//!
//! Buckets follow DDP's policy: parameters in the order their gradients become final
//! ([`Schedule::grad_events`]), packed until a bucket holds `bucket_elems` (the first one only
//! `first_bucket_elems`, so that the exchange starts early); a bucket leaves at the event where
//! its last gradient is final. Every rank makes the same buckets and sends them in the same
//! order, from one thread, so the collectives match across ranks.
//!
//! Two ways a bucket travels, by backend:
//! - through the host (the CPU backends): [`Backend::download`], the collective on the
//!   exchange thread, [`Backend::upload`];
//! - on the device (the GPU backend, once [`Backend::set_comm`] started its communicator):
//!   [`Backend::comm_all_reduce`] queues the bucket's all-reduce inside the backward pass's
//!   unit of work, on the communication stream, forked where the bucket's last gradient is
//!   final; the unit's end joins the streams, so the whole pass, collectives included, is one
//!   CUDA graph (`src/engine/gpu/comm.rs`). The host waits for nothing: the collectives' time
//!   shows in the device's phase times (the backward pass ends when its last bucket is in).
//!
//! The caller must make no other collective call between the start of the pass and
//! [`Exchange::finish`]: the exchange thread's calls would interleave with them in a different
//! order on different ranks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::backend::{Backend, Buf};
use super::schedule::Schedule;
use crate::dist::{Collective, ReduceOp};

/// DDP's default bucket: 25 MiB of f32.
pub const DEFAULT_BUCKET_MIB: f64 = 25.0;

/// DDP's first bucket: 1 MiB of f32 (small, so that the exchange starts early in the pass).
pub const DEFAULT_FIRST_BUCKET_MIB: f64 = 1.0;

/// One bucket: gradients (regions of the arena) that travel together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// The slots (parameters) it carries, in the order they became final.
    pub slots: Vec<usize>,
    /// Their gradient regions.
    pub regions: Vec<Buf>,
    /// The event of the backward pass after which all of them are final.
    pub ready: usize,
    /// Elements.
    pub elems: usize,
}

/// The buckets of a layer sequence (looped or not), in the order they leave.
pub fn plan_buckets(schedule: &Schedule, looping: bool, first_bucket_elems: usize, bucket_elems: usize) -> Vec<Bucket> {
    let slots = &schedule.layout.slots;
    let events = schedule.grad_events(looping);
    // Final first leaves first; among equals, the later parameter first (DDP's reverse order).
    let mut order: Vec<usize> = (0..slots.len()).filter(|&i| slots[i].grad.len > 0).collect();
    order.sort_by_key(|&i| (events[i], std::cmp::Reverse(i)));
    let mut out: Vec<Bucket> = Vec::new();
    let mut cur = Bucket { slots: Vec::new(), regions: Vec::new(), ready: 0, elems: 0 };
    for i in order {
        cur.slots.push(i);
        cur.regions.push(slots[i].grad);
        cur.ready = cur.ready.max(events[i]);
        cur.elems += slots[i].grad.len;
        let cap = if out.is_empty() { first_bucket_elems.min(bucket_elems) } else { bucket_elems };
        if cur.elems >= cap.max(1) {
            out.push(std::mem::replace(&mut cur, Bucket { slots: Vec::new(), regions: Vec::new(), ready: 0, elems: 0 }));
        }
    }
    if !cur.slots.is_empty() {
        out.push(cur);
    }
    out
}

/// What one step's exchange did.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExchangeStats {
    /// Buckets sent.
    pub buckets: usize,
    /// Elements averaged.
    pub elems: usize,
    /// Wall time of the collectives on the exchange thread (packing included).
    pub comm: Duration,
    /// Time the compute thread waited for the exchange after the backward pass: the part of
    /// `comm` the step paid for (all of it without overlap).
    pub exposed: Duration,
}

/// What the exchange thread returns per bucket: the averaged values and the collective's time.
type Done = anyhow::Result<(Tensor, Duration)>;

/// The exchange of one engine: its buckets per layer sequence and its thread.
pub struct Exchange {
    ranks: Arc<dyn Collective>,
    /// The backend queues the collectives on its device (no exchange thread).
    device: bool,
    /// Buckets of the unlooped and the looped layer sequence.
    plans: [Vec<Bucket>; 2],
    /// Send buckets as they become ready (false: all after the pass, for comparison).
    overlap: bool,
    jobs: Option<flume::Sender<Tensor>>,
    done: flume::Receiver<Done>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exchange {
    /// The exchange of `schedule`'s gradients among `ranks` in buckets of `bucket_elems` (the
    /// first `first_bucket_elems`), sent while the backward pass runs when `overlap`; `device`:
    /// the backend queues the collectives itself ([`Backend::set_comm`] said so), else they go
    /// through the host on a thread of the exchange's. Errors when the thread cannot start.
    pub fn new(
        schedule: &Schedule,
        ranks: Arc<dyn Collective>,
        (first_bucket_elems, bucket_elems): (usize, usize),
        overlap: bool,
        device: bool,
    ) -> anyhow::Result<Exchange> {
        let plans = [false, true].map(|looping| plan_buckets(schedule, looping, first_bucket_elems, bucket_elems));
        let (jobs, rx) = flume::unbounded::<Tensor>();
        let (tx, done) = flume::unbounded::<Done>();
        if device {
            return Ok(Exchange { ranks, device, plans, overlap, jobs: None, done, thread: None });
        }
        let c = ranks.clone();
        let thread = std::thread::Builder::new().name("grad-exchange".into()).spawn(move || {
            for t in rx.iter() {
                let t0 = Instant::now();
                let r = c.all_reduce(&t, ReduceOp::Mean).map(|m| (m, t0.elapsed()));
                if tx.send(r).is_err() {
                    break;
                }
            }
        })?;
        Ok(Exchange { ranks, device, plans, overlap, jobs: Some(jobs), done, thread: Some(thread) })
    }

    /// Whether the backend's device runs the collectives (no host copies, no thread).
    pub fn on_device(&self) -> bool {
        self.device
    }

    /// The buckets of a layer sequence, in the order they leave.
    #[cfg(feature = "tools")]
    pub fn buckets(&self, looping: bool) -> &[Bucket] {
        &self.plans[looping as usize]
    }

    /// The ranks.
    pub fn ranks(&self) -> &Arc<dyn Collective> {
        &self.ranks
    }

    /// One pass's exchange: call [`Pass::at`] at every event of the backward pass, then
    /// [`Exchange::finish`].
    pub fn pass(&self, looping: bool) -> Pass {
        Pass { looping, overlap: self.overlap, sent: 0, error: None }
    }

    /// Sends the bucket `i` of the layer sequence: queued on the device, or its gradients packed
    /// into one tensor for the exchange thread.
    fn send(&self, be: &mut dyn Backend, looping: bool, i: usize) -> anyhow::Result<()> {
        let regions = &self.plans[looping as usize][i].regions;
        if self.device {
            be.comm_all_reduce(regions, ReduceOp::Mean);
            return Ok(());
        }
        let flat = pack(be, regions)?;
        let jobs = self.jobs.as_ref().ok_or_else(|| anyhow::anyhow!("the gradient exchange is closed"))?;
        jobs.send(flat).map_err(|_| anyhow::anyhow!("the gradient exchange thread has ended"))
    }

    /// Ends a pass: sends what is left, waits for every bucket and writes the ranks' means into
    /// the gradient region. Errors when a bucket could not be read or reduced.
    pub fn finish(&self, be: &mut dyn Backend, mut pass: Pass) -> anyhow::Result<ExchangeStats> {
        let looping = pass.looping;
        let plan = &self.plans[looping as usize];
        let t0 = Instant::now();
        if pass.error.is_none() {
            pass.overlap = true;
            pass.at(self, be, usize::MAX);
        }
        let mut stats = ExchangeStats::default();
        if self.device {
            // The backward unit joined its collectives; any sent after it join here.
            be.comm_join();
            if let Some(e) = pass.error.take() {
                return Err(e);
            }
            anyhow::ensure!(pass.sent == plan.len(), "internal: {} of {} gradient buckets were sent", pass.sent, plan.len());
            stats.buckets = plan.len();
            stats.elems = plan.iter().map(|b| b.elems).sum();
            return Ok(stats);
        }
        // Every sent bucket is received, even after an error, so that none is left behind for
        // the next pass.
        let mut error = pass.error.take();
        for b in &plan[..pass.sent] {
            let r = self.done.recv().map_err(|_| anyhow::anyhow!("the gradient exchange thread has ended")).and_then(|r| r);
            match r {
                Ok((mean, took)) if error.is_none() => {
                    stats.comm += took;
                    stats.buckets += 1;
                    stats.elems += b.elems;
                    unpack(be, &b.regions, &mean)?;
                }
                Ok(_) => {}
                Err(e) => error = error.or(Some(e.context("the gradient all-reduce"))),
            }
        }
        if let Some(e) = error {
            return Err(e);
        }
        anyhow::ensure!(pass.sent == plan.len(), "internal: {} of {} gradient buckets were sent", pass.sent, plan.len());
        stats.exposed = t0.elapsed();
        Ok(stats)
    }
}

/// `regions` of the arena, one after another, as one flat host tensor.
fn pack(be: &dyn Backend, regions: &[Buf]) -> anyhow::Result<Tensor> {
    let mut parts: Vec<Tensor> = regions.iter().map(|r| be.download(*r, &[r.len])).collect::<anyhow::Result<_>>()?;
    Ok(if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? })
}

/// [`pack`]'s inverse: `flat` written back into `regions`.
fn unpack(be: &mut dyn Backend, regions: &[Buf], flat: &Tensor) -> anyhow::Result<()> {
    let mut at = 0;
    for r in regions {
        be.upload(*r, &flat.narrow(0, at, r.len)?)?;
        at += r.len;
    }
    Ok(())
}

/// Each `(region, root)` of the arena broadcast from rank `root`, in place (sharded Muon's
/// exchange of updates: every matrix's from the rank that orthogonalised it). Queued on the
/// device and joined when the backend runs collectives ([`Backend::set_comm`]); otherwise now,
/// through the host, one broadcast per root (its regions packed). Returns the host
/// collectives' wall time (zero on the device: its time is the optimizer phase's).
pub fn broadcast_regions(be: &mut dyn Backend, pieces: &[(Buf, usize)], ranks: &dyn Collective) -> anyhow::Result<Duration> {
    if be.queues_collectives() {
        be.comm_broadcast(pieces);
        be.comm_join();
        return Ok(Duration::ZERO);
    }
    let mut took = Duration::ZERO;
    for root in 0..ranks.world() {
        let regions: Vec<Buf> = pieces.iter().filter(|p| p.1 == root).map(|p| p.0).collect();
        if regions.is_empty() {
            continue;
        }
        let flat = pack(be, &regions)?;
        let t0 = Instant::now();
        let out = ranks.broadcast(&flat, root)?;
        took += t0.elapsed();
        unpack(be, &regions, &out)?;
    }
    Ok(took)
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One backward pass's progress through the buckets.
pub struct Pass {
    looping: bool,
    overlap: bool,
    /// Buckets sent so far.
    sent: usize,
    /// The first error (later buckets are not sent).
    error: Option<anyhow::Error>,
}

impl Pass {
    /// The backward pass reached `event`: sends every bucket whose gradients are now final
    /// (only at the end without overlap).
    pub fn at(&mut self, x: &Exchange, be: &mut dyn Backend, event: usize) {
        let plan = &x.plans[self.looping as usize];
        if !self.overlap || self.error.is_some() {
            return;
        }
        while self.sent < plan.len() && plan[self.sent].ready <= event {
            if let Err(e) = x.send(be, self.looping, self.sent) {
                self.error = Some(e);
                return;
            }
            self.sent += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tests::record_small;

    /// Every parameter travels in exactly one bucket, buckets leave in event order, and only
    /// the last bucket may be smaller than its cap.
    #[test]
    fn buckets_cover_every_gradient_once_in_event_order() {
        let s = Schedule::new(&record_small(), 2, 6, 1e-6);
        for looping in [false, true] {
            for (first, cap) in [(1, 1), (300, 1000), (1 << 20, 1 << 20)] {
                let plan = plan_buckets(&s, looping, first, cap);
                let mut seen: Vec<usize> = plan.iter().flat_map(|b| b.slots.clone()).collect();
                seen.sort_unstable();
                let want: Vec<usize> = (0..s.layout.slots.len()).filter(|&i| s.layout.slots[i].grad.len > 0).collect();
                assert_eq!(seen, want, "looping {looping} first {first} cap {cap}");
                assert!(plan.windows(2).all(|w| w[0].ready <= w[1].ready));
                let events = s.grad_events(looping);
                for b in &plan {
                    assert_eq!(b.ready, b.slots.iter().map(|&i| events[i]).max().unwrap());
                    assert_eq!(b.elems, b.regions.iter().map(|r| r.len).sum::<usize>());
                }
                for (k, b) in plan.iter().enumerate().take(plan.len().saturating_sub(1)) {
                    assert!(b.elems >= if k == 0 { first.min(cap) } else { cap });
                }
            }
            // One bucket per parameter with a cap of 1; one bucket in all with a huge cap.
            assert_eq!(plan_buckets(&s, looping, 1, 1).len(), s.layout.slots.iter().filter(|x| x.grad.len > 0).count());
            assert_eq!(plan_buckets(&s, looping, usize::MAX, usize::MAX).len(), 1);
        }
    }
}
