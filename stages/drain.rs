//! Kind `drain`: sinks that consume items.
//!
//! - `count`: counts items, optionally taking a service time per item (to play a slow
//!   consumer) and optionally asking the graph to stop after N items (as a step executor does
//!   at its last step).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::runtime::inject::{FailMode, Fault, Pace};
use crate::runtime::message::Blob;
use crate::runtime::stage::{BuildCtx, Ctx, Sink};

/// Parameters of `drain/count`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CountParams {
    /// Service time per item in µs (sleeping), to play a slow consumer.
    pub delay_us: f64,
    /// Uniform jitter in µs either side of `delay_us`.
    pub jitter_us: f64,
    /// Ask the whole graph to stop after this many items; 0 never asks.
    pub stop_after: u64,
    /// Fail when consuming this item (1-based); 0 never fails.
    pub fail_at: u64,
    /// How the injected failure shows: "error" or "panic".
    pub fail_mode: FailMode,
}

/// `drain/count`.
pub struct Count {
    items: u64,
    stop_after: u64,
    pace: Pace,
    fault: Fault,
}

impl Sink for Count {
    const KIND: &'static str = "drain";
    const IMPL: &'static str = "count";
    const DOC: &'static str = "Consumes and counts items; can play a slow consumer or stop the graph after N items.";
    type Params = CountParams;
    type In = Blob;

    fn check(p: &CountParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
        Pace::check(p.delay_us, p.jitter_us)
    }
    fn build(p: CountParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Ok(Self {
            items: 0,
            stop_after: p.stop_after,
            pace: Pace::new(p.delay_us, p.jitter_us, false, ctx.seed())?,
            fault: Fault::new(p.fail_at, p.fail_mode),
        })
    }
    fn consume(&mut self, _item: Blob, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.fault.tick()?;
        self.pace.wait(ctx);
        self.items += 1;
        if self.stop_after > 0 && self.items == self.stop_after {
            ctx.request_stop();
        }
        Ok(())
    }
}

/// Parameters of `drain/batches`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct BatchesParams {
    /// Ask the whole graph to stop after this many optimizer steps; 0 never asks.
    pub stop_after_steps: u64,
    /// Write every micro-batch's fingerprints to `RUN_DIR/data_order.tsv`.
    pub write_order: bool,
}

/// `drain/batches`: consumes device micro-batches, checks their shape, counts tokens and
/// records the data-order fingerprints (report section `data`, and `data_order.tsv`).
pub struct Batches {
    stop_after_steps: u64,
    order: Option<std::io::BufWriter<std::fs::File>>,
    order_path: Option<std::path::PathBuf>,
    batches: u64,
    tokens: u64,
    steps: u64,
    last: Option<crate::data::batch::BatchMeta>,
    first_at: Option<std::time::Instant>,
    last_at: Option<std::time::Instant>,
}

impl Sink for Batches {
    const KIND: &'static str = "drain";
    const IMPL: &'static str = "batches";
    const DOC: &'static str = "Consumes device micro-batches: checks shapes, counts tokens, records data-order fingerprints.";
    type Params = BatchesParams;
    type In = crate::data::batch::DeviceBatch;

    fn build(p: BatchesParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        use anyhow::Context;
        let (order, order_path) = match (p.write_order, ctx.run_dir) {
            (true, Some(dir)) => {
                let path = dir.join("data_order.tsv");
                let mut f =
                    std::io::BufWriter::new(std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?);
                std::io::Write::write_all(&mut f, b"step\tmicro\tfingerprint\trolling\n")?;
                (Some(f), Some(path))
            }
            _ => (None, None),
        };
        Ok(Self {
            stop_after_steps: p.stop_after_steps,
            order,
            order_path,
            batches: 0,
            tokens: 0,
            steps: 0,
            last: None,
            first_at: None,
            last_at: None,
        })
    }

    fn consume(&mut self, b: crate::data::batch::DeviceBatch, ctx: &mut Ctx) -> anyhow::Result<()> {
        if self.stop_after_steps > 0 && self.steps >= self.stop_after_steps {
            return Ok(()); // batches still in flight after the stop request are not part of the run
        }
        let s = b.meta.shape;
        anyhow::ensure!(
            b.x.dims() == [s.rows, s.seq_len] && b.y.dims() == [s.rows, s.seq_len],
            "batch shapes {:?} / {:?} do not match ({}, {})",
            b.x.dims(),
            b.y.dims(),
            s.rows,
            s.seq_len
        );
        let now = std::time::Instant::now();
        self.first_at.get_or_insert(now);
        self.last_at = Some(now);
        self.batches += 1;
        self.tokens += s.tokens() as u64;
        if let Some(f) = self.order.as_mut() {
            std::io::Write::write_fmt(
                f,
                format_args!("{}\t{}\t{:016x}\t{:016x}\n", b.meta.step, b.meta.micro, b.meta.fingerprint, b.meta.rolling),
            )?;
        }
        if b.meta.micro as usize + 1 == s.micro_steps {
            self.steps += 1;
            if self.stop_after_steps > 0 && self.steps == self.stop_after_steps {
                ctx.request_stop();
            }
        }
        self.last = Some(b.meta);
        Ok(())
    }

    fn flush(&mut self, ctx: &mut Ctx) -> anyhow::Result<()> {
        if let Some(mut f) = self.order.take() {
            std::io::Write::flush(&mut f)?;
        }
        let last = self.last.as_ref();
        // Rate between the first and the last batch: (n - 1) batches' worth of tokens per span.
        let per_s = match (self.first_at, self.last_at, self.last.as_ref()) {
            (Some(a), Some(b), Some(m)) if self.batches > 1 && b > a => {
                Some((self.batches - 1) as f64 * m.shape.tokens() as f64 / (b - a).as_secs_f64())
            }
            _ => None,
        };
        ctx.publish(
            "data",
            serde_json::json!({
                "micro_batches": self.batches,
                "steps": self.steps,
                "tokens": self.tokens,
                "tokens_per_s": per_s,
                "last_step": last.map(|m| m.step),
                "rolling_fingerprint": last.map(|m| format!("{:016x}", m.rolling)),
                "loader_state": last.map(|m| serde_json::to_value(&*m.state).unwrap_or_default()),
                "order_file": self.order_path.as_ref().map(|p| p.display().to_string()),
            }),
        );
        Ok(())
    }
}
