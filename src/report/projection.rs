//! The step time on N ranks predicted from one rank's measurements: what `pipeline project`
//! prints (docs/ranks.md, "Projecting N GPUs"). A pure model, no I/O: the command gathers its
//! inputs from a run's `report.json` and resolved config.
//!
//! ```text
//! one rank, measured                  N ranks, predicted
//!   m1 x (forward + backward)           mN x (forward + backward), mN = m1 / N (global batch)
//!   optimizer: rest + Newton-Schulz       or m1 (per-rank batch)
//!   other (host, data wait)             optimizer: rest + Newton-Schulz x (slowest rank's share)
//!                                       + exposed gradient all-reduce + Muon's update exchange
//!                                       other: unchanged
//! ```
//!
//! The gradient buckets leave on one communication stream, in order, each not before its
//! ready time in the last micro-batch's backward pass (a fraction of that pass: every event
//! of the pass is assumed to take the same time); the part of the stream that runs past the
//! end of the pass is exposed. Muon's exchange of updates comes after the Newton-Schulz
//! iterations and is not overlapped. Collectives are rings: an all-reduce of `B` bytes takes
//! `2 (N-1)/N B / bw + 2 (N-1) latency`, an all-gather `(N-1)/N B / bw + (N-1) latency`, with
//! `bw` the bus bandwidth as nccl-tests reports it.

use serde::Serialize;

/// Default bus bandwidth of the link, GB/s: what NCCL's ring reaches on the NVLink 4 of an
/// H100 SXM node (450 GB/s a direction on the wire, about 370 GB/s after the protocol's
/// overhead; NCCL's maintainer in NVIDIA/nccl-tests#212). NVLink SHARP all-reduces reach about
/// 480 GB/s of bus bandwidth on 8 GPUs at large sizes (same source): `--link-gbs 480`.
pub const H100_SXM_LINK_GBS: f64 = 370.0;

/// Default latency per step of a ring collective, µs: a round figure for NVLink within a node
/// (a small all-reduce on 8 GPUs, 14 steps, then takes about 28 µs).
pub const H100_SXM_LATENCY_US: f64 = 2.0;

/// A record's own figures on 8xH100, shown beside a prediction.
#[derive(Clone, Debug, Serialize)]
pub struct RecordFigures {
    /// The record.
    pub name: &'static str,
    /// Mean step, ms.
    pub step_ms: f64,
    /// Steps trained in its wall-clock budget.
    pub steps: u64,
    /// The budget, s.
    pub budget_s: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

/// The records' figures (8xH100 SXM, 600 s).
pub const RECORDS: [RecordFigures; 2] = [
    RecordFigures {
        name: "04-09",
        step_ms: 129.2,
        steps: 4550,
        budget_s: 588.0,
        source: "record_spec.md: 588,047 ms / 4,550 steps (600 s less 12 s kept for GPTQ)",
    },
    RecordFigures { name: "04-27", step_ms: 121.7, steps: 4931, budget_s: 600.0, source: "record_0427.md: 4,931 steps at 121.7 ms" },
];

/// The interconnect: ring collectives over a link of this bus bandwidth and step latency.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Link {
    /// Bus bandwidth per rank, GB/s (10^9 bytes/s).
    pub gbs: f64,
    /// Latency of one step of a ring collective, µs.
    pub latency_us: f64,
}

impl Link {
    /// An all-reduce of `bytes` over `n` ranks, ms (0 on one rank).
    pub fn all_reduce_ms(&self, bytes: f64, n: usize) -> f64 {
        2.0 * self.ring(bytes, n)
    }

    /// An all-gather whose result is `bytes` over `n` ranks, ms (0 on one rank).
    pub fn all_gather_ms(&self, bytes: f64, n: usize) -> f64 {
        self.ring(bytes, n)
    }

    /// One pass around the ring: `(n-1)/n` of `bytes` through the link and `n-1` latencies.
    fn ring(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let k = (n - 1) as f64;
        k / n as f64 * bytes / (self.gbs * 1e9) * 1e3 + k * self.latency_us * 1e-3
    }
}

/// Which collective gives every rank the sharded Muon's updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MuonExchange {
    /// One all-reduce (sum) of every update, zeros where another rank owns it.
    AllReduce,
    /// An all-gather of the owned updates: the engine's (each update broadcast from its owner,
    /// one group) and the records' (`all_gather_into_tensor`, in bf16).
    AllGather,
}

/// Which batch the N ranks keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Keep {
    /// The global batch, as the records: each rank takes `1/N` of the one-rank run's
    /// micro-batches (at least one).
    Global,
    /// Each rank the one-rank run's micro-batches (weak scaling): N times the global batch.
    PerRank,
}

/// One gradient bucket as the projection sees it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct BucketIn {
    /// Bytes exchanged.
    pub bytes: f64,
    /// When its gradients are final, as a fraction of the backward pass (0 to 1).
    pub ready: f64,
}

/// What one rank's run measured and what its step exchanges.
#[derive(Clone, Debug, Serialize)]
pub struct Inputs {
    /// Forward pass per micro-batch, ms.
    pub forward_ms: f64,
    /// Backward pass per micro-batch, ms.
    pub backward_ms: f64,
    /// Optimizer per step, ms.
    pub optimizer_ms: f64,
    /// The share of `optimizer_ms` that is Muon's Newton-Schulz (sharded over the ranks).
    pub ns_share: f64,
    /// The rest of the measured step, ms (host work, waits for data): carried over unchanged.
    pub other_ms: f64,
    /// The measured step, ms.
    pub step_ms: f64,
    /// Micro-batches per step of the measured run.
    pub micro_steps: usize,
    /// Newton-Schulz FLOPs of each Muon matrix, in the order that deals them to the ranks
    /// (matrix `i` to rank `i mod N`).
    pub ns_flops: Vec<f64>,
    /// The gradient buckets, in the order they leave.
    pub buckets: Vec<BucketIn>,
    /// Bytes of Muon's updates (every matrix).
    pub muon_bytes: f64,
    /// How they are exchanged.
    pub muon_exchange: MuonExchange,
    /// Collectives that exchange issues, each paying a ring's latency (the engine: one
    /// broadcast per matrix, grouped; one all-reduce or all-gather: 1).
    pub muon_collectives: usize,
}

/// The prediction for N ranks.
#[derive(Clone, Debug, Serialize)]
pub struct Projection {
    /// Ranks.
    pub nproc: usize,
    /// Micro-batches per step on each rank.
    pub micro_steps: usize,
    /// The one-rank run's micro-batches do not divide among the ranks (rounded up).
    pub uneven: bool,
    /// Compute per rank, ms: passes, optimizer (the slowest rank's Newton-Schulz share), other.
    pub compute_ms: f64,
    /// The slowest rank's share of the Newton-Schulz FLOPs.
    pub ns_rank_share: f64,
    /// Every collective's time, ms (buckets and Muon's exchange).
    pub comm_ms: f64,
    /// The gradient all-reduce's time, ms.
    pub grad_comm_ms: f64,
    /// Of it, what runs past the end of the backward pass, ms.
    pub grad_exposed_ms: f64,
    /// Muon's exchange of updates, ms (all exposed).
    pub muon_comm_ms: f64,
    /// Communication the step waits for, ms.
    pub exposed_ms: f64,
    /// The predicted step, ms.
    pub step_ms: f64,
    /// Steps in the budget.
    pub steps_in_budget: u64,
    /// The budget, s.
    pub budget_s: f64,
}

/// The slowest rank's share of `flops` when matrix `i` goes to rank `i mod n` (1 on one rank
/// or without matrices).
pub fn slowest_share(flops: &[f64], n: usize) -> f64 {
    let total: f64 = flops.iter().sum();
    if n <= 1 || total <= 0.0 {
        return 1.0;
    }
    let mut per = vec![0.0; n];
    for (i, f) in flops.iter().enumerate() {
        per[i % n] += f;
    }
    per.iter().cloned().fold(0.0, f64::max) / total
}

/// When the last bucket's all-reduce ends, ms after the start of a backward pass of
/// `backward_ms`: buckets go one after another, each not before its ready time.
pub fn stream_end_ms(buckets: &[BucketIn], backward_ms: f64, link: &Link, n: usize) -> f64 {
    buckets.iter().fold(0.0, |end, b| end.max(b.ready.clamp(0.0, 1.0) * backward_ms) + link.all_reduce_ms(b.bytes, n))
}

/// The step on `n` ranks over `link`, keeping `keep`'s batch, and the steps in `budget_s`.
pub fn project(i: &Inputs, n: usize, link: &Link, keep: Keep, budget_s: f64) -> Projection {
    let n = n.max(1);
    let m1 = i.micro_steps.max(1);
    let (micro_steps, uneven) = match keep {
        Keep::Global => (m1.div_ceil(n).max(1), !m1.is_multiple_of(n)),
        Keep::PerRank => (m1, false),
    };
    let ns_rank_share = slowest_share(&i.ns_flops, n);
    let ns = i.ns_share.clamp(0.0, 1.0);
    let optimizer = i.optimizer_ms * ((1.0 - ns) + ns * ns_rank_share);
    let compute_ms = micro_steps as f64 * (i.forward_ms + i.backward_ms) + optimizer + i.other_ms.max(0.0);
    let grad_comm_ms: f64 = i.buckets.iter().map(|b| link.all_reduce_ms(b.bytes, n)).sum();
    let grad_exposed_ms = (stream_end_ms(&i.buckets, i.backward_ms, link, n) - i.backward_ms).max(0.0);
    let muon_comm_ms = match i.muon_exchange {
        MuonExchange::AllReduce => link.all_reduce_ms(i.muon_bytes, n),
        MuonExchange::AllGather => link.all_gather_ms(i.muon_bytes, n),
    } + link.all_gather_ms(0.0, n) * i.muon_collectives.saturating_sub(1) as f64;
    let exposed_ms = grad_exposed_ms + muon_comm_ms;
    let step_ms = compute_ms + exposed_ms;
    let steps_in_budget = if step_ms > 0.0 { (budget_s * 1e3 / step_ms).floor() as u64 } else { 0 };
    Projection {
        nproc: n,
        micro_steps,
        uneven,
        compute_ms,
        ns_rank_share,
        comm_ms: grad_comm_ms + muon_comm_ms,
        grad_comm_ms,
        grad_exposed_ms,
        muon_comm_ms,
        exposed_ms,
        step_ms,
        steps_in_budget,
        budget_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    /// 1 GB/s and 10 µs a step: 4 ranks all-reduce 1 MB in 2 x 3/4 x 1 ms + 6 x 10 µs = 1.56 ms
    /// and all-gather it in 0.75 + 0.03 = 0.78 ms; one rank exchanges nothing.
    #[test]
    fn ring_collectives_by_hand() {
        let link = Link { gbs: 1.0, latency_us: 10.0 };
        assert!(close(link.all_reduce_ms(1e6, 4), 1.56));
        assert!(close(link.all_gather_ms(1e6, 4), 0.78));
        assert_eq!(link.all_reduce_ms(1e6, 1), 0.0);
    }

    fn inputs(buckets: Vec<BucketIn>) -> Inputs {
        Inputs {
            forward_ms: 10.0,
            backward_ms: 20.0,
            optimizer_ms: 8.0,
            ns_share: 0.5,
            other_ms: 2.0,
            step_ms: 8.0 * 30.0 + 8.0 + 2.0,
            micro_steps: 8,
            ns_flops: vec![1.0, 1.0, 1.0, 1.0],
            buckets,
            muon_bytes: 1e6,
            muon_exchange: MuonExchange::AllReduce,
            muon_collectives: 1,
        }
    }

    /// A case by hand: 2 ranks at 1 GB/s, no latency, the global batch of 8 micro-batches.
    /// Each rank: 4 x (10 + 20) = 120 ms of passes, optimizer 4 + 4 x 1/2 = 6 ms, other 2 ms:
    /// 128 ms. Buckets of 5 MB (5 ms each) ready at 50% and 100% of a 20 ms pass: the first
    /// runs 10-15 ms, the second 20-25 ms, 5 ms past the pass. Muon: 1 MB all-reduced, 1 ms.
    /// Step 128 + 5 + 1 = 134 ms; 600 s hold 4,477 of them.
    #[test]
    fn a_step_by_hand() {
        let i = inputs(vec![BucketIn { bytes: 5e6, ready: 0.5 }, BucketIn { bytes: 5e6, ready: 1.0 }]);
        let link = Link { gbs: 1.0, latency_us: 0.0 };
        let p = project(&i, 2, &link, Keep::Global, 600.0);
        assert_eq!((p.micro_steps, p.uneven), (4, false));
        assert!(close(p.ns_rank_share, 0.5));
        assert!(close(p.compute_ms, 128.0), "{p:?}");
        assert!(close(p.grad_comm_ms, 10.0));
        assert!(close(p.grad_exposed_ms, 5.0));
        assert!(close(p.muon_comm_ms, 1.0));
        assert!(close(p.exposed_ms, 6.0));
        assert!(close(p.comm_ms, 11.0));
        assert!(close(p.step_ms, 134.0));
        assert_eq!(p.steps_in_budget, 4477);
        // Per-rank batches: every rank keeps 8 micro-batches.
        let w = project(&i, 2, &link, Keep::PerRank, 600.0);
        assert_eq!(w.micro_steps, 8);
        assert!(close(w.compute_ms, 248.0));
        // One rank: the measured step again, no communication.
        let one = project(&i, 1, &link, Keep::Global, 600.0);
        assert!(close(one.step_ms, i.step_ms) && one.comm_ms == 0.0, "{one:?}");
    }

    /// Buckets ready early hide their all-reduce under the rest of the pass; the same buckets
    /// all ready at the end expose all of it.
    #[test]
    fn early_buckets_hide_their_communication() {
        let link = Link { gbs: 1.0, latency_us: 0.0 };
        let early = inputs(vec![BucketIn { bytes: 4e6, ready: 0.1 }, BucketIn { bytes: 4e6, ready: 0.3 }]);
        let p = project(&early, 2, &link, Keep::Global, 600.0);
        assert_eq!(p.grad_exposed_ms, 0.0, "{p:?}");
        assert!(close(p.grad_comm_ms, 8.0));
        let late = inputs(vec![BucketIn { bytes: 4e6, ready: 1.0 }, BucketIn { bytes: 4e6, ready: 1.0 }]);
        let q = project(&late, 2, &link, Keep::Global, 600.0);
        assert!(close(q.grad_exposed_ms, 8.0), "{q:?}");
        assert!(q.step_ms > p.step_ms);
    }

    /// Micro-batches that do not divide among the ranks are rounded up, and said to be; the
    /// Newton-Schulz share of the slowest rank follows `i mod N` (3 matrices on 2 ranks: 2/3).
    #[test]
    fn uneven_deals() {
        let mut i = inputs(Vec::new());
        i.micro_steps = 3;
        i.ns_flops = vec![1.0, 1.0, 1.0];
        let p = project(&i, 2, &Link { gbs: 1.0, latency_us: 0.0 }, Keep::Global, 600.0);
        assert_eq!((p.micro_steps, p.uneven), (2, true));
        assert!(close(p.ns_rank_share, 2.0 / 3.0));
        assert_eq!(slowest_share(&[], 8), 1.0);
        // More ranks than micro-batches: one each.
        assert_eq!(project(&i, 8, &Link { gbs: 1.0, latency_us: 0.0 }, Keep::Global, 600.0).micro_steps, 1);
    }
}
