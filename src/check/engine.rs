//! `pipeline engine-check`: does the explicit engine's backend on a device compute what the
//! CPU computes in f64, and where does a micro-batch's time go? In order:
//!
//! 1. on a GPU, the engine's stream (its own, never the NULL stream graph capture refuses);
//! 2. every op case of [`crate::engine::cases`] (one line per op and variant: every kernel and
//!    GEMM layout the backend launches) against the f64 CPU backend, each within its bound;
//! 3. the whole engine (two small models, one with the 04-09 record's elements, one with the
//!    04-27 record's: [`cases::check_models`], [`cases::model_check`]): loss,
//!    every gradient and every weight after one Muon and Adam step, against the f64 CPU
//!    engine, with the GEMM maths asked for and, on a GPU, the other one too;
//! 4. on a GPU, graph replay against op-by-op launches (three steps whose learning rates
//!    change: bit-identical losses, norms and weights, every unit of the third step replayed),
//!    and the device-to-device paths (token ids from CUDA tensors, weights into them);
//! 5. per-op timings at the baseline's shapes, or the 04-27 record's ([`crate::engine::timed`]),
//!    on token ids drawn as text's are ([`timing_ids`]): device time per op
//!    (µs), its bandwidth or TFLOP/s, its share of a micro-batch; then a micro-batch and an
//!    optimizer step as the trainer runs them (graphs on) for comparison.
//!
//! `--device cpu` runs 2, 3 and 5 on the f32 CPU backend (what CI exercises). Exit 1 when any
//! error is beyond its bound.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device};
use serde::Serialize;

use crate::engine::Engine;
use crate::engine::backend::Backend;
use crate::engine::cases::{self, ModelBounds};
use crate::engine::cpu::CpuBackend;
use crate::engine::gpu::{Capacity, GpuPrecision, HalfRegions};
use crate::engine::layout::Layout;
use crate::engine::optim::MuonStep;
use crate::engine::step::{OptimizerStep, kernel_capacity};
use crate::engine::timed::{OpTime, Timed};
use crate::model::{Gpt, ModelConfig};

/// The shapes of the timings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TimingShape {
    /// The baseline (9 layers, width 512, 8 heads on 4, vocabulary 1024) on micro-batches of
    /// 64 x 1024 tokens (524,288 tokens a step in 8).
    Baseline,
    /// The 04-27 record's model ([`ModelConfig::record_0427`]: 11 blocks with 3..=5 looped
    /// into 17, vocabulary 8192, every 04-27 element) on micro-batches packed as its loader packs
    /// them (`window_sampler/packed_docs`): one row of 24 x 2048 tokens, documents cut every 2048
    /// (the record's 48 x 2048 halved, so that the check's arena fits one 80 GB GPU beside the
    /// rest; `--rows 48` for the record's own), timing the looped pass that most of its steps run.
    Record0427,
    /// A small model (2 layers, width 128, 2 heads of 64) on 2 x 128 tokens: a check of the
    /// plumbing, not a measurement (`SMOKE=1`, CI).
    Small,
    /// No timings.
    None,
}

/// What `pipeline engine-check` is asked.
#[derive(Clone, Debug)]
pub struct Options {
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// GEMMs on the bf16 tensor cores (the training default on a GPU) or in f32.
    pub bf16: bool,
    /// The timings with bf16 activations (`--activations bf16`; needs `bf16`).
    pub bf16_activations: bool,
    /// The timings and the graph check with attention on cuDNN (`--attention cudnn`; GPU).
    pub cudnn: bool,
    /// The timings' shapes.
    pub timing: TimingShape,
    /// Rows per micro-batch of the timings instead of the shape's.
    pub rows: Option<usize>,
    /// Seed of the arenas, weights and tokens.
    pub seed: u64,
}

/// One op case's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct OpLine {
    /// The case.
    pub name: &'static str,
    /// `|device − f64| / max(1, |f64|)`, the worst over the arena.
    pub err: f64,
    /// Its bound.
    pub bound: f64,
    /// Where the worst error is: the arena element, the device's value and the reference's.
    pub at: (usize, f64, f64),
    /// Within the bound.
    pub ok: bool,
}

/// The whole engine with one GEMM maths.
#[derive(Clone, Debug, Serialize)]
pub struct ModelLine {
    /// Which check model ([`cases::check_models`]): `04-09 elements` or `04-27 elements`.
    pub model: String,
    /// `bf16 GEMMs`, `f32 GEMMs`, `bf16 activations` or `cpu f32`.
    pub maths: String,
    /// Its bounds.
    pub bounds: ModelBounds,
    /// Every quantity: the loss, each gradient, each weight after the optimizer step.
    pub compared: Vec<cases::Compared>,
    /// The largest `rel_err / bound`.
    pub worst_ratio: f64,
    /// Every quantity within its bound.
    pub ok: bool,
}

/// Graph replay against op-by-op launches.
#[derive(Clone, Debug, Serialize)]
pub struct GraphLine {
    /// Losses, gradient norms and weights identical bit for bit.
    pub identical: bool,
    /// Units captured, replayed and run op by op with graphs on.
    pub counts: (u64, u64, u64),
    /// Identical, and every unit of the last step replayed.
    pub ok: bool,
}

/// One check that passes or fails (stream, transfers).
#[derive(Clone, Debug, Serialize)]
pub struct Flag {
    /// What was checked.
    pub what: String,
    /// Whether it holds.
    pub ok: bool,
    /// What was seen.
    pub detail: String,
}

/// The timings of one op (name and shape) over a micro-batch or an optimizer step.
#[derive(Clone, Debug, Serialize)]
pub struct TimingLine {
    /// The op.
    pub op: &'static str,
    /// Its shape (calls of several shapes under one op are separate lines).
    pub shape: String,
    /// Calls.
    pub calls: usize,
    /// Device time in all, µs.
    pub us: f64,
    /// Bytes moved per second (a lower bound of its traffic), GB/s.
    pub gb_s: f64,
    /// Its products' TFLOP/s (GEMMs, attention).
    pub tflop_s: Option<f64>,
    /// Its share of the pass, percent.
    pub share_pct: f64,
}

/// The per-op timings.
#[derive(Clone, Debug, Serialize)]
pub struct Timings {
    /// The model and micro-batch timed.
    pub shape: String,
    /// What timed the ops: CUDA events (device time) or the host's clock.
    pub clock: String,
    /// One micro-batch (forward and backward), op by op, largest first.
    pub micro_batch: Vec<TimingLine>,
    /// The sum of the micro-batch's op times, ms.
    pub micro_batch_ops_ms: f64,
    /// A micro-batch as the trainer runs it (units of work, graphs on a GPU), ms (median of 5).
    pub micro_batch_ms: f64,
    /// One optimizer step (clipping, Muon, Adam), op by op.
    pub optimizer: Vec<TimingLine>,
    /// The sum of its op times, ms.
    pub optimizer_ops_ms: f64,
    /// An optimizer step as the trainer runs it, ms (median of 5).
    pub optimizer_ms: f64,
}

/// What `pipeline engine-check` found.
#[derive(Clone, Debug, Serialize)]
pub struct EngineCheck {
    /// The backend (device, GEMM maths).
    pub backend: String,
    /// The engine's stream (a GPU).
    pub stream: Option<Flag>,
    /// Every op case.
    pub ops: Vec<OpLine>,
    /// The whole engine, per GEMM maths.
    pub models: Vec<ModelLine>,
    /// Graph replay (a GPU).
    pub graphs: Option<GraphLine>,
    /// Device-to-device paths (a GPU).
    pub transfers: Vec<Flag>,
    /// Per-op timings.
    pub timings: Option<Timings>,
    /// Every check within its bound.
    pub ok: bool,
}

/// The engine's backend on `device` for `layout` (or an arena of `len` with no layout, f32
/// only): the f32 CPU backend, or the GPU's in the precision and with the graphs asked for.
fn backend(
    device: &Device,
    p: GpuPrecision,
    graphs: bool,
    len: usize,
    layout: Option<&Layout>,
    cap: Capacity,
) -> anyhow::Result<Box<dyn Backend>> {
    if device.is_cpu() {
        return Ok(Box::new(CpuBackend::<f32>::new(len)));
    }
    let half = match (p, layout) {
        (GpuPrecision::Bf16, Some(l)) => Some(HalfRegions::of(l)),
        (GpuPrecision::Bf16, None) => anyhow::bail!("bf16 activations need the engine's layout"),
        _ => None,
    };
    crate::engine::gpu::gpu_backend(device, p, graphs, len, cap, half)
}

/// An engine for `cfg` on `rows x t` tokens on `device`, attention on cuDNN if `cudnn`.
fn engine(
    device: &Device,
    cfg: &ModelConfig,
    (rows, t): (usize, usize),
    p: GpuPrecision,
    graphs: bool,
    cudnn: bool,
) -> anyhow::Result<Engine> {
    let cap = kernel_capacity(cfg, rows, t)?;
    let layout = Layout::new(cfg, rows, t);
    let be = backend(device, p, graphs, layout.len(), Some(&layout), cap)?;
    let mut e = Engine::with_backend(cfg, rows, t, be, false)?;
    e.set_cudnn(cudnn)?;
    Ok(e)
}

/// The GPU precision of `bf16` GEMMs with or without bf16 activations.
fn precision(bf16: bool, activations: bool) -> GpuPrecision {
    match (bf16, activations) {
        (_, true) => GpuPrecision::Bf16,
        (true, false) => GpuPrecision::Bf16Gemms,
        (false, false) => GpuPrecision::F32,
    }
}

/// Runs every check `o` asks for (see the module doc).
pub fn run(o: &Options) -> anyhow::Result<EngineCheck> {
    let device = crate::device::open_named(&o.device)?;
    let gpu = !device.is_cpu();
    anyhow::ensure!(gpu || !o.bf16, "--dtype bf16 is the GPU backend's GEMM maths; the CPU backend runs f32");
    anyhow::ensure!(!o.bf16_activations || (gpu && o.bf16), "--activations bf16 is the GPU backend's, with --dtype bf16");
    let chosen = precision(o.bf16, o.bf16_activations);
    let mut be = backend(&device, precision(o.bf16, false), true, cases::arena_len(), None, cases::capacity())?;
    let name = be.device_name();
    let stream = if gpu { Some(stream_flag(&device)?) } else { None };
    let mut ops = Vec::new();
    for case in cases::cases() {
        let r = cases::run(&case, be.as_mut(), o.seed)?;
        ops.push(OpLine { name: r.name, err: r.err, bound: r.bound, at: (r.at, r.got, r.want), ok: r.ok() });
    }
    drop(be);
    let mut models = Vec::new();
    // On a GPU every precision, the one asked for first.
    let maths: Vec<GpuPrecision> = if gpu {
        let mut all = vec![chosen];
        all.extend([GpuPrecision::Bf16Gemms, GpuPrecision::F32, GpuPrecision::Bf16].into_iter().filter(|&p| p != chosen));
        all
    } else {
        vec![GpuPrecision::F32]
    };
    // On a GPU, the bf16 activations once more with attention on cuDNN.
    let runs: Vec<(GpuPrecision, bool)> = maths.iter().map(|&p| (p, false)).chain(gpu.then_some((GpuPrecision::Bf16, true))).collect();
    for (model, cfg) in cases::check_models() {
        for &(p, cudnn) in &runs {
            let (label, bounds) = match (gpu, p) {
                (false, _) => ("cpu f32", ModelBounds::CPU_F32),
                (true, GpuPrecision::Bf16Gemms) => ("bf16 GEMMs", ModelBounds::GPU_BF16_GEMMS),
                (true, GpuPrecision::F32) => ("f32 GEMMs", ModelBounds::GPU_F32_GEMMS),
                (true, GpuPrecision::Bf16) => ("bf16 activations", ModelBounds::GPU_BF16_ACTIVATIONS),
            };
            let mut e = engine(&device, &cfg, cases::CHECK_ROWS_T, p, true, cudnn)?;
            let compared = cases::model_check(&mut e, &cfg, bounds, o.seed)?;
            let worst_ratio = compared.iter().map(|c| c.rel_err / c.bound).fold(0.0, f64::max);
            let ok = compared.iter().all(cases::Compared::ok);
            // The attention that ran: cuDNN, or flash_mma with cuDNN's refusal.
            let maths = if cudnn { format!("{label}, attention {}", e.attention_name()) } else { label.into() };
            models.push(ModelLine { model: model.into(), maths, bounds, compared, worst_ratio, ok });
        }
    }
    let graphs = if gpu { Some(graph_check(&device, chosen, o.cudnn, o.seed)?) } else { None };
    let transfers = if gpu { transfer_flags(&device)? } else { Vec::new() };
    let timings = match o.timing {
        TimingShape::None => None,
        shape => Some(timings(&device, chosen, o.cudnn, shape, o.rows, o.seed)?),
    };
    let ok = stream.as_ref().is_none_or(|s| s.ok)
        && ops.iter().all(|l| l.ok)
        && models.iter().all(|m| m.ok)
        && graphs.as_ref().is_none_or(|g| g.ok)
        && transfers.iter().all(|t| t.ok);
    Ok(EngineCheck { backend: name, stream, ops, models, graphs, transfers, timings, ok })
}

fn stream_flag(device: &Device) -> anyhow::Result<Flag> {
    let (handle, default) = crate::engine::gpu::stream_check(device)?;
    let detail = if default { format!("{handle}: a default stream") } else { format!("{handle}: its own, non-blocking") };
    Ok(Flag { what: "the engine's stream is not the NULL stream".into(), ok: !default, detail })
}

/// The device-to-device paths, and the engine's collectives (NCCL at a world of one).
fn transfer_flags(device: &Device) -> anyhow::Result<Vec<Flag>> {
    let flags = crate::engine::gpu::transfer_check(device)?.into_iter().chain(crate::engine::gpu::comm_check(device)?);
    Ok(flags.map(|(what, ok, detail)| Flag { what, ok, detail }).collect())
}

/// Graph replay against op-by-op launches on the check model ([`cases::graph_check`]).
fn graph_check(device: &Device, p: GpuPrecision, cudnn: bool, seed: u64) -> anyhow::Result<GraphLine> {
    let cfg = cases::check_model();
    let shape = cases::CHECK_ROWS_T;
    let g = cases::graph_check(&cfg, shape, seed, &mut |graphs| engine(device, &cfg, shape, p, graphs, cudnn))?;
    Ok(GraphLine { identical: g.identical, counts: g.counts, ok: g.ok() })
}

/// The timings' model, micro-batch (`rows x t`) and whether the pass is the looped one.
fn timing_model(shape: TimingShape, rows: Option<usize>) -> (ModelConfig, usize, usize, bool) {
    match shape {
        TimingShape::Small => {
            let cfg = ModelConfig { num_layers: 2, model_dim: 128, num_heads: 2, num_kv_heads: 1, ..ModelConfig::default() };
            (cfg, rows.unwrap_or(2), 128, false)
        }
        TimingShape::Record0427 => {
            let cfg = ModelConfig::record_0427();
            let (looped, t) = (cfg.recurrent(), rows.unwrap_or(24) * cfg.document_max_len);
            (cfg, 1, t, looped)
        }
        _ => (ModelConfig::default(), rows.unwrap_or(64), 1024, false),
    }
}

/// `n` token ids with the skew and the documents of English text, so that the ops whose cost
/// follows the ids (the embedding's gradient sums each vocabulary row's tokens; document-masked
/// attention skips what lies before a document's start) are timed as training runs them: ids
/// by a Zipf law over a shuffled vocabulary (the `r`-th most frequent with weight
/// `1 / (r + 3)`: the most frequent about 4% of the tokens at a vocabulary of 8192, 6% at 1024;
/// the project's SP8192 shards have 4.2%, SP1024's 2.8%), and `bos` opening documents of 100
/// to 1,100 tokens (the SP8192 shards average 623).
pub(crate) fn timing_ids(n: usize, vocab: usize, bos: u32, seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut ids: Vec<u32> = (0..vocab as u32).filter(|&v| v != bos).collect();
    rng.shuffle(&mut ids);
    let mut cdf = Vec::with_capacity(ids.len());
    let mut total = 0.0;
    for r in 0..ids.len() {
        total += 1.0 / (r as f64 + 3.0);
        cdf.push(total);
    }
    let mut next_doc = 0;
    (0..n)
        .map(|k| {
            if k == next_doc && bos < vocab as u32 {
                next_doc += rng.usize(100..1100);
                return bos;
            }
            let u = rng.f64() * total;
            ids[cdf.partition_point(|&c| c < u).min(ids.len() - 1)]
        })
        .collect()
}

/// Per-op times of one micro-batch and one optimizer step (a warm-up pass first), then both as
/// the trainer runs them (median of five after two).
fn timings(device: &Device, p: GpuPrecision, cudnn: bool, shape: TimingShape, rows: Option<usize>, seed: u64) -> anyhow::Result<Timings> {
    let (cfg, rows, t, looped) = timing_model(shape, rows);
    let n = rows * t;
    let params: std::collections::HashMap<_, _> = Gpt::new(&cfg, seed, DType::F32, &Device::Cpu)?.state_dict().into_iter().collect();
    let ids = timing_ids(n + 1, cfg.vocab_size, cfg.bos_id, seed);
    let (x, y) = (ids[..n].to_vec(), ids[1..].to_vec());
    let record = shape == TimingShape::Record0427;
    let step = OptimizerStep {
        clip: 1.0,
        muon: MuonStep {
            lr: 0.02,
            momentum: 0.95,
            nesterov: true,
            backend_steps: 5,
            // The record's Polar-Express Muon with row normalisation (MuonEq-R) and decay.
            ns: if record { crate::optim::NewtonSchulz::PolarExpress } else { crate::optim::NewtonSchulz::Quintic },
            row_norm: record,
            weight_decay: if record { 0.095 } else { 0.0 },
        },
        adam: [(0.05, 0.0), (0.04, 0.0), (0.008, 0.0)],
        betas: (0.9, 0.95),
        eps: 1e-8,
    };
    let (micro, opt) = {
        let cap = kernel_capacity(&cfg, rows, t)?;
        let layout = Layout::new(&cfg, rows, t);
        let inner = backend(device, p, false, layout.len(), Some(&layout), cap)?;
        let (timed, log) = Timed::new(inner);
        let mut e = Engine::with_backend(&cfg, rows, t, Box::new(timed), false)?;
        e.set_cudnn(cudnn)?;
        e.load_params(&params)?;
        e.zero_grads();
        let take = |log: &std::sync::Mutex<Vec<OpTime>>| std::mem::take(&mut *log.lock().expect("the timing log"));
        e.micro_step(&x, &y, looped, 1.0 / n as f64);
        e.loss_sum()?; // resolves the times
        take(&log);
        e.micro_step(&x, &y, looped, 1.0 / n as f64);
        e.loss_sum()?;
        let micro = take(&log);
        e.optimizer_step(&step)?; // warm-up
        take(&log);
        e.micro_step(&x, &y, looped, 1.0 / n as f64);
        e.loss_sum()?;
        take(&log);
        e.optimizer_step(&step)?;
        (micro, take(&log))
    };
    // As the trainer runs them: units of work, captured and replayed on a GPU.
    let mut e = engine(device, &cfg, (rows, t), p, true, cudnn)?;
    e.load_params(&params)?;
    e.zero_grads();
    let (mut micro_ms, mut opt_ms) = (Vec::new(), Vec::new());
    for k in 0..7 {
        let t0 = Instant::now();
        e.micro_step(&x, &y, looped, 1.0 / n as f64);
        e.loss_sum()?;
        let t1 = Instant::now();
        e.optimizer_step(&step)?;
        if k >= 2 {
            micro_ms.push((t1 - t0).as_secs_f64() * 1e3);
            opt_ms.push(t1.elapsed().as_secs_f64() * 1e3);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (micro_batch, micro_batch_ops_ms) = table(&micro);
    let (optimizer, optimizer_ops_ms) = table(&opt);
    let label = format!(
        "{} layers{}, width {}, {} heads on {}, vocabulary {}{}; micro-batch {rows} x {t} tokens",
        cfg.num_layers,
        if looped { format!(" looped into {}", cfg.layer_sequence(true).len()) } else { String::new() },
        cfg.model_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
        if record { ", the 04-27 record's elements" } else { "" }
    );
    // The attention the timed engine ran (cuDNN, or flash_mma with cuDNN's refusal).
    let label = if device.is_cpu() { label } else { format!("{label}; attention {}", e.attention_name()) };
    let clock = if device.is_cpu() { "host clock per op" } else { "device time per op (CUDA events, no sync between ops)" };
    Ok(Timings {
        shape: label,
        clock: clock.into(),
        micro_batch,
        micro_batch_ops_ms,
        micro_batch_ms: median(micro_ms),
        optimizer,
        optimizer_ops_ms,
        optimizer_ms: median(opt_ms),
    })
}

/// The op times grouped by op and shape, largest first, and their sum in ms.
fn table(times: &[OpTime]) -> (Vec<TimingLine>, f64) {
    let total_ms: f64 = times.iter().map(|t| t.ms).sum();
    let mut groups: BTreeMap<(&'static str, String), (usize, f64, f64, f64)> = BTreeMap::new();
    for t in times {
        let g = groups.entry((t.op, t.shape.clone())).or_default();
        *g = (g.0 + 1, g.1 + t.ms, g.2 + t.bytes, g.3 + t.flops);
    }
    let mut lines: Vec<TimingLine> = groups
        .into_iter()
        .map(|((op, shape), (calls, ms, bytes, flops))| {
            let s = (ms / 1e3).max(1e-12);
            TimingLine {
                op,
                shape,
                calls,
                us: ms * 1e3,
                gb_s: bytes / s / 1e9,
                tflop_s: (flops > 0.0).then(|| flops / s / 1e12),
                share_pct: if total_ms > 0.0 { 100.0 * ms / total_ms } else { 0.0 },
            }
        })
        .collect();
    lines.sort_by(|a, b| b.us.total_cmp(&a.us));
    (lines, total_ms)
}

/// The report as text, one line per op case and per timed op.
pub fn text(r: &EngineCheck) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let verdict = |ok: bool| if ok { "ok" } else { "FAILED" };
    let _ = writeln!(s, "engine-check {}", r.backend);
    if let Some(f) = &r.stream {
        let _ = writeln!(s, "stream: {} ({}): {}", f.what, f.detail, verdict(f.ok));
    }
    let _ = writeln!(s, "ops against the CPU in f64 (worst |device - f64| / max(1, |f64|) over the arena):");
    for l in &r.ops {
        let _ = writeln!(s, "  {:<40} err {:.3e}  bound {:.0e}  {}", l.name, l.err, l.bound, verdict(l.ok));
        if !l.ok {
            let _ = writeln!(s, "    element {}: {} on the device, {} in f64", l.at.0, l.at.1, l.at.2);
        }
    }
    for m in &r.models {
        let _ = writeln!(
            s,
            "engine against the CPU engine in f64, {}, {}: loss, {} gradients and weights after Muon + Adam (bounds: loss {:.0e}, tensors {:.0e} of their norm + {:.0e}):",
            m.model,
            m.maths,
            (m.compared.len() - 1) / 2,
            m.bounds.loss,
            m.bounds.tensor,
            m.bounds.floor
        );
        let mut worst: Vec<&cases::Compared> = m.compared.iter().collect();
        worst.sort_by(|a, b| (b.rel_err / b.bound).total_cmp(&(a.rel_err / a.bound)));
        let loss = &m.compared[0];
        let _ = writeln!(s, "  {:<40} rel_err {:.3e}  bound {:.1e}  {}", loss.name, loss.rel_err, loss.bound, verdict(loss.ok()));
        for c in worst.iter().filter(|c| c.name != "loss").take(5) {
            let _ = writeln!(s, "  {:<40} rel_err {:.3e}  bound {:.1e}  {}", c.name, c.rel_err, c.bound, verdict(c.ok()));
        }
        let failed = m.compared.iter().filter(|c| !c.ok()).count();
        let _ = writeln!(
            s,
            "  ({} more within their bounds; worst error / bound {:.2}, {failed} out of bound): {}",
            m.compared.len().saturating_sub(6),
            m.worst_ratio,
            verdict(m.ok)
        );
    }
    match &r.graphs {
        Some(g) => {
            let (c, rp, e) = g.counts;
            let same = if g.identical { "bit-identical" } else { "DIFFERENT" };
            let _ =
                writeln!(s, "graphs: 3 steps replayed vs op by op: {same}; captured {c}, replayed {rp}, op by op {e}: {}", verdict(g.ok));
        }
        None => {
            let _ = writeln!(s, "graphs: n/a (the CPU backend runs every op as it comes)");
        }
    }
    for f in &r.transfers {
        let _ = writeln!(s, "transfer: {} ({}): {}", f.what, f.detail, verdict(f.ok));
    }
    if let Some(t) = &r.timings {
        let _ = writeln!(s, "timings: {}; {}", t.shape, t.clock);
        for (title, lines, ops_ms, ms) in [
            ("micro-batch", &t.micro_batch, t.micro_batch_ops_ms, t.micro_batch_ms),
            ("optimizer step", &t.optimizer, t.optimizer_ops_ms, t.optimizer_ms),
        ] {
            let _ = writeln!(s, "  {title}, op by op:");
            let _ =
                writeln!(s, "    {:<18} {:>24} {:>6} {:>11} {:>7} {:>8} {:>8}", "op", "shape", "calls", "µs", "share", "GB/s", "TFLOP/s");
            for l in lines.iter() {
                let tf = l.tflop_s.map(|x| format!("{x:.1}")).unwrap_or_default();
                let _ = writeln!(
                    s,
                    "    {:<18} {:>24} {:>6} {:>11.1} {:>6.1}% {:>8.1} {:>8}",
                    l.op, l.shape, l.calls, l.us, l.share_pct, l.gb_s, tf
                );
            }
            let _ = writeln!(s, "  {title}: the ops one by one {ops_ms:.2} ms; as the trainer runs it {ms:.2} ms");
        }
    }
    let _ = writeln!(s, "engine-check: {}", if r.ok { "ok, every error within its bound" } else { "FAILED" });
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The timings' ids have text's skew and documents: the most frequent id near 4% at a
    /// vocabulary of 8192, a document start every 100 to 1,100 tokens, every id in the
    /// vocabulary, and the same ids from the same seed.
    #[test]
    fn timing_ids_are_skewed_as_text_and_cut_into_documents() {
        let (n, vocab, bos) = (200_000, 8192, 1);
        let ids = timing_ids(n, vocab, bos, 7);
        assert_eq!(ids, timing_ids(n, vocab, bos, 7));
        assert!(ids.iter().all(|&v| (v as usize) < vocab));
        let mut counts = vec![0usize; vocab];
        ids.iter().for_each(|&v| counts[v as usize] += 1);
        let top = counts.iter().enumerate().filter(|&(v, _)| v != bos as usize).map(|(_, &c)| c).max().unwrap();
        let share = top as f64 / n as f64;
        assert!((0.03..0.06).contains(&share), "the most frequent id is {share} of the tokens");
        let starts: Vec<usize> = (0..n).filter(|&k| ids[k] == bos).collect();
        assert_eq!(starts[0], 0);
        assert!(starts.windows(2).all(|w| (100..1100).contains(&(w[1] - w[0]))), "document lengths");
        let mean = n as f64 / starts.len() as f64;
        assert!((450.0..750.0).contains(&mean), "documents of {mean} tokens on average");
    }

    /// `--timing record-0427` times the record's own model, looped, on one packed row of
    /// 24 x 2048 tokens (its documents cut every 2048) unless asked for other rows.
    #[test]
    fn the_record_timing_shape_is_the_records_looped_model() {
        let (cfg, rows, t, looped) = timing_model(TimingShape::Record0427, None);
        assert_eq!((cfg.vocab_size, cfg.num_layers, rows, t, cfg.document_max_len), (8192, 11, 1, 24 * 2048, 2048));
        assert!(looped && cfg.layer_sequence(true).len() == 17 && cfg.smear_gate && cfg.document_attention && cfg.attn_gate);
        assert_eq!(timing_model(TimingShape::Record0427, Some(48)).2, 48 * 2048);
        let (base, rows, t, looped) = timing_model(TimingShape::Baseline, None);
        assert_eq!((base.num_layers, rows, t, looped), (9, 64, 1024, false));
    }
}
