//! cuDNN's fused flash attention (SDPA, forward and backward) as this crate calls it: what a
//! graph computes ([`SdpaDesc`]), where its tensors are ([`SdpaPtrs`]), and the graph cache
//! and workspace ([`SdpaCache`]) over a library ([`SdpaLib`]):
//!
//! - `cuda` builds: cuDNN itself (`ffi.rs`), NVIDIA's cudnn-frontend graphs behind the C shim
//!   `cpp/cudnn_sdpa.{h,cpp}`, with libcudnn.so.9 opened at run time ([`load`]);
//! - tests: a recording stand-in, which checks the call sequence (what is built once per
//!   shape, how large the workspace grows, which pointers each execution gets) without a GPU;
//! - the warp emulator: [`interpret`], the same maths on the CPU from the same descriptor and
//!   addresses, so that the engine's use of it is checked against its CPU reference.
//!
//! The maths (cuDNN's SDPA with a causal mask, top-left aligned, scale `c = 1/sqrt(d)`), per
//! sequence, query head `h` and its key/value head `h / (H / H_kv)`:
//!
//! ```text
//! S_ij = c q_i . k_j  (j <= i)      stats_i = ln sum_j exp(S_ij)      P_ij = exp(S_ij - stats_i)
//! o_i = sum_j P_ij v_j
//! D_i = do_i . o_i    dS_ij = P_ij (do_i . v_j - D_i)
//! dq_i = c sum_j dS_ij k_j    dk_j = c sum_{h in group} sum_i dS_ij q_i    dv_j = sum_{h, i} P_ij do_i
//! ```
//!
//! With `ragged`, each of the `b` slots is a document: its own length (`seq_len`, 0 for an
//! unused slot) and first element of each tensor (the ragged offsets), causal within itself;
//! cuDNN's padded "THD" layout, which is how attention within documents runs packed batches.

pub mod interpret;
pub mod load;

#[cfg(feature = "cuda")]
pub mod ffi;

use std::collections::HashMap;

/// The most document slots a ragged graph is given (see [`SdpaDesc::unsupported`]).
pub const MAX_RAGGED_SLOTS: usize = 65_535;

/// Element strides of a tensor in the order (batch, head, sequence, dim).
pub type Strides = [i64; 4];

/// The strides of token-major rows `(B*T, heads*d)` with `ld` elements between two rows, the
/// engine's layout: `(T ld, d, ld, 1)`.
pub fn token_major(t: usize, d: usize, ld: usize) -> Strides {
    [(t * ld) as i64, d as i64, ld as i64, 1]
}

/// The statistics' strides, token-major `(B*T, heads)`: `(T heads, 1, heads, 1)` (the ragged
/// layout's, with offsets `token * heads`).
pub fn stats_token_major(t: usize, heads: usize) -> Strides {
    [(t * heads) as i64, 1, heads as i64, 1]
}

/// The statistics' strides packed `(B, heads, T)`: `(heads T, T, 1, 1)`, the only layout
/// cuDNN before 9.12 writes (and before 9.26 reads) for a non-ragged graph.
pub fn stats_packed(t: usize, heads: usize) -> Strides {
    [(t * heads) as i64, t as i64, 1, 1]
}

/// The forward and backward descriptors of causal attention over token-major rows, as both
/// executors call it: `batch` sequences of `t` tokens (or, with `docs`, cuDNN's ragged layout
/// with a slot per position), `heads` query heads over `kv_heads` of width `d`; q, k and v rows
/// `lds` elements apart; o, do, dq, dk and dv packed. The statistics are packed per sequence,
/// or token-major under `docs`. The backward is deterministic except under `docs`, where
/// cuDNN's deterministic backward would need a workspace of `slots x heads x t^2` elements.
pub fn causal_descs(batch: usize, t: usize, heads: usize, kv_heads: usize, d: usize, docs: bool, lds: [usize; 3]) -> (SdpaDesc, SdpaDesc) {
    let n = batch * t;
    let tm = |ld: usize| token_major(t, d, ld);
    let fwd = SdpaDesc {
        backward: false,
        causal: true,
        ragged: docs,
        deterministic: !docs,
        b: if docs { n } else { batch },
        h: heads,
        h_kv: kv_heads,
        s: t,
        d,
        max_total: if docs { n } else { 0 },
        scale_bits: ((1.0 / (d as f64).sqrt()) as f32).to_bits(),
        q: tm(lds[0]),
        k: tm(lds[1]),
        v: tm(lds[2]),
        o: tm(heads * d),
        dq: [0; 4],
        dk: [0; 4],
        dv: [0; 4],
        stats: if docs { stats_token_major(t, heads) } else { stats_packed(t, heads) },
    };
    let bwd = SdpaDesc { backward: true, dq: fwd.o, dk: tm(kv_heads * d), dv: tm(kv_heads * d), ..fwd };
    (fwd, bwd)
}

/// The packed ragged slots of `rows.len()` rows of `t` positions whose documents are
/// `rows[r]` (`(start, len)` pairs in order, covering the row): row r's documents in slots
/// `r t ..` in order, then its unused slots (length 0) starting at the row's end, so that each
/// slot starts where the one before ends. Returns each slot's length (`rows x t`) and first
/// position (`rows x t + 1`, the last the end): a tensor's ragged offsets are those times its
/// row stride. The engine's `eng_doc_slots` computes the same on the device.
#[cfg(feature = "tools")]
pub fn packed_slots(t: usize, rows: &[Vec<(usize, usize)>]) -> (Vec<u32>, Vec<u32>) {
    let n = rows.len() * t;
    let (mut lens, mut starts) = (vec![0u32; n], Vec::with_capacity(n + 1));
    for (r, docs) in rows.iter().enumerate() {
        for (j, &(start, len)) in docs.iter().enumerate() {
            lens[r * t + j] = len as u32;
            starts.push((r * t + start) as u32);
        }
        starts.resize(starts.len() + t - docs.len(), ((r + 1) * t) as u32);
    }
    starts.push(n as u32);
    (lens, starts)
}

/// What one cuDNN graph computes; equal descriptors share a built graph (the cache's key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SdpaDesc {
    /// The backward pass (dq, dk, dv) rather than the forward (o, stats).
    pub backward: bool,
    /// Causal within each sequence (top-left aligned).
    pub causal: bool,
    /// Documents: `b` slots of their own lengths and offsets (see the module doc).
    pub ragged: bool,
    /// A deterministic backward where cuDNN offers one.
    pub deterministic: bool,
    /// Sequences (or document slots).
    pub b: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads (dividing `h`).
    pub h_kv: usize,
    /// The longest sequence.
    pub s: usize,
    /// Head width.
    pub d: usize,
    /// With `ragged`: the most tokens the slots hold together.
    pub max_total: usize,
    /// The softmax scale's bits (`f32`, so that the descriptor hashes).
    pub scale_bits: u32,
    /// Strides of q, k, v, o (do has o's).
    pub q: Strides,
    /// See [`SdpaDesc::q`].
    pub k: Strides,
    /// See [`SdpaDesc::q`].
    pub v: Strides,
    /// See [`SdpaDesc::q`].
    pub o: Strides,
    /// Strides of the backward's outputs (zero in a forward descriptor).
    pub dq: Strides,
    /// See [`SdpaDesc::dq`].
    pub dk: Strides,
    /// See [`SdpaDesc::dq`].
    pub dv: Strides,
    /// Strides of the statistics (`f32`, one per query and head).
    pub stats: Strides,
}

impl SdpaDesc {
    /// The softmax scale.
    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }

    /// Why cuDNN's flash attention cannot take this descriptor, checked before asking it (the
    /// shapes its SDPA kernels support: bf16 heads of a multiple of 8 up to 128 wide, the last
    /// dimension contiguous, 16-byte aligned rows); `None` when it may.
    pub fn unsupported(&self) -> Option<String> {
        if self.b == 0 || self.h == 0 || self.h_kv == 0 || self.s == 0 {
            return Some(format!("an empty attention ({} x {} heads x {})", self.b, self.h, self.s));
        }
        if !self.h.is_multiple_of(self.h_kv) {
            return Some(format!("{} query heads do not share {} key/value heads evenly", self.h, self.h_kv));
        }
        if self.d == 0 || self.d > 128 || !self.d.is_multiple_of(8) {
            return Some(format!("head width {} (cuDNN's flash attention takes multiples of 8 up to 128)", self.d));
        }
        let mut tensors = vec![("q", self.q), ("k", self.k), ("v", self.v), ("o", self.o)];
        if self.backward {
            tensors.extend([("dq", self.dq), ("dk", self.dk), ("dv", self.dv)]);
        }
        for (name, st) in tensors {
            if st[3] != 1 || st[..3].iter().any(|&x| x <= 0 || x % 8 != 0) {
                return Some(format!("{name}'s strides {st:?} (the head's elements must be contiguous, rows 16-byte aligned)"));
            }
        }
        if self.ragged && (self.max_total == 0 || self.max_total > self.b * self.s) {
            return Some(format!("{} tokens in {} documents of at most {}", self.max_total, self.b, self.s));
        }
        // Not known to fit a launch's grid (y and z take at most 65,535): until measured on a
        // GPU, more document slots (one per position) are refused, not risked mid-run.
        if self.ragged && self.b > MAX_RAGGED_SLOTS {
            return Some(format!("{} document slots (a slot per position), more than {MAX_RAGGED_SLOTS}", self.b));
        }
        // Ragged offsets are int32 elements.
        if self.ragged {
            let rows = [self.q, self.k, self.v, self.o, self.dq, self.dk, self.dv].map(|st| st[2]).into_iter().max().unwrap_or(0);
            if (self.b as i64 + 1).saturating_mul(rows.max(self.h as i64)) > i32::MAX as i64 {
                return Some(format!("ragged offsets of {} slots of {rows} elements overflow cuDNN's int32", self.b));
            }
        }
        None
    }
}

/// Device addresses of one execution (0 where unused); ragged offsets are in elements of the
/// tensor they index, `b + 1` entries (`i32`) each, lengths `b` entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SdpaPtrs {
    /// `bf16` tensors.
    pub q: u64,
    /// See [`SdpaPtrs::q`].
    pub k: u64,
    /// See [`SdpaPtrs::q`].
    pub v: u64,
    /// See [`SdpaPtrs::q`].
    pub o: u64,
    /// The output's gradient (backward).
    pub dout: u64,
    /// Gradients written by the backward pass.
    pub dq: u64,
    /// See [`SdpaPtrs::dq`].
    pub dk: u64,
    /// See [`SdpaPtrs::dq`].
    pub dv: u64,
    /// `f32` statistics: written by the forward pass, read by the backward.
    pub stats: u64,
    /// Ragged: each slot's length (`i32`; queries and keys alike in self-attention).
    pub seq_len: u64,
    /// Ragged offsets of q, k, v, o (and do), dq, dk, dv and the statistics.
    pub off_q: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_k: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_v: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_o: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_dq: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_dk: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_dv: u64,
    /// See [`SdpaPtrs::off_q`].
    pub off_stats: u64,
}

/// A library that builds and runs SDPA graphs: cuDNN, or a stand-in.
pub trait SdpaLib {
    /// A built graph.
    type Graph;
    /// Builds the graph of `desc`; its workspace need in bytes. An error says why the library
    /// refused it.
    fn build(&mut self, desc: &SdpaDesc) -> anyhow::Result<(Self::Graph, usize)>;
    /// Device memory of `bytes` for workspaces, kept as long as the library is: its address.
    fn alloc_workspace(&mut self, bytes: usize) -> anyhow::Result<u64>;
    /// Queues `graph` on the library's stream with these tensors and workspace (no host wait,
    /// no allocation: it may be captured into a CUDA graph).
    fn execute(&self, graph: &Self::Graph, ptrs: &SdpaPtrs, workspace: u64) -> anyhow::Result<()>;
}

/// Built graphs by descriptor, and one workspace as large as the largest need.
///
/// A graph is built once per descriptor, before it first runs (outside any CUDA-graph
/// capture: [`SdpaCache::prepare`]); a refusal is kept too, so that it is asked once. The
/// workspace grows to the largest need seen; a grown one replaces the old for later
/// executions, and the old is kept (a captured graph may still point at it).
pub struct SdpaCache<L: SdpaLib> {
    /// Dropped before the library (a graph's plans before the handle they were built on).
    graphs: HashMap<SdpaDesc, Result<(L::Graph, usize), String>>,
    lib: L,
    /// `(address, bytes)` of the current workspace.
    workspace: (u64, usize),
}

impl<L: SdpaLib> SdpaCache<L> {
    /// A cache over `lib`, nothing built.
    pub fn new(lib: L) -> Self {
        SdpaCache { lib, graphs: HashMap::new(), workspace: (0, 0) }
    }

    /// The library (for the recording stand-in's tests).
    pub fn lib(&self) -> &L {
        &self.lib
    }

    /// Builds `desc`'s graph unless built (or refused) before, and grows the workspace to its
    /// need; an error (the same for every later call) where the descriptor or the library
    /// refuses it.
    pub fn prepare(&mut self, desc: &SdpaDesc) -> anyhow::Result<()> {
        if !self.graphs.contains_key(desc) {
            let built = match desc.unsupported() {
                Some(why) => Err(why),
                None => self.lib.build(desc).map_err(|e| format!("{e:#}")),
            };
            self.graphs.insert(*desc, built);
        }
        let need = match &self.graphs[desc] {
            Ok((_, bytes)) => *bytes,
            Err(why) => anyhow::bail!("cuDNN attention refused {}: {why}", describe(desc)),
        };
        if need > self.workspace.1 {
            // Rounded up to 1 MiB, so that needs growing by a few bytes do not each allocate.
            let bytes = need.div_ceil(1 << 20) << 20;
            self.workspace = (self.lib.alloc_workspace(bytes)?, bytes);
        }
        Ok(())
    }

    /// Runs `desc`'s graph (built by [`SdpaCache::prepare`]) on `ptrs`.
    pub fn execute(&self, desc: &SdpaDesc, ptrs: &SdpaPtrs) -> anyhow::Result<()> {
        match self.graphs.get(desc) {
            Some(Ok((graph, _))) => self.lib.execute(graph, ptrs, self.workspace.0),
            Some(Err(why)) => anyhow::bail!("cuDNN attention refused {}: {why}", describe(desc)),
            None => anyhow::bail!("cuDNN attention: {} runs before it was prepared", describe(desc)),
        }
    }

    /// Graphs built (refusals aside).
    pub fn built(&self) -> usize {
        self.graphs.values().filter(|g| g.is_ok()).count()
    }

    /// The workspace's bytes.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.1
    }
}

/// A descriptor in a few words, for errors and logs.
pub fn describe(d: &SdpaDesc) -> String {
    format!(
        "{} {} x {} heads ({} kv) x {} x {}{}",
        if d.backward { "backward" } else { "forward" },
        d.b,
        d.h,
        d.h_kv,
        d.s,
        d.d,
        if d.ragged { format!(", {} tokens in documents", d.max_total) } else { String::new() }
    )
}

#[cfg(test)]
mod tests;
