//! The report's `train` section: what the session publishes at its end (and on the way, for
//! `pipeline report` of a run in progress): steps, losses, throughput, the phases' shares, the
//! ranks' communication, the engine's own fields.

use crate::runtime::stage::Ctx;
use crate::train::log::Phases;

use super::Session;

impl Session {
    /// Publishes the `train` section of the report.
    pub(super) fn publish(&mut self, ctx: &Ctx) {
        self.total.add(&self.window);
        self.window = Phases::default();
        let steps = self.trainer.step();
        let train_ms = self.train_ms();
        let tokens = steps * (self.shape.tokens() * self.shape.micro_steps * self.shape.world_size) as u64;
        let per_step = self.total.per(steps);
        // H2D is timed on the upload stage's thread and overlaps the executor's time: it is
        // reported, but not part of the executor's shares.
        let busy = per_step.data_wait + per_step.forward + per_step.backward + per_step.optimizer;
        let share = |x: f64| if busy > 0.0 { (1000.0 * x / busy).round() / 10.0 } else { 0.0 };
        let last = self.last_val.as_ref();
        let val_time_ms = self.total.validation.as_secs_f64() * 1e3;
        ctx.publish(
            "train",
            serde_json::json!({
                "steps": steps,
                "iterations": self.cfg.iterations,
                "ended_by": self.ending,
                "tokens": tokens,
                "tokens_per_s": if train_ms > 0.0 { tokens as f64 / (train_ms / 1e3) } else { 0.0 },
                "train_time_ms": train_ms,
                "step_avg_ms": if steps > 0 { train_ms / steps as f64 } else { 0.0 },
                "train_loss": self.last_loss,
                "val_loss": last.map(|a| a.val_loss()),
                "val_bpb": last.map(|a| a.val_bpb()),
                "val_tokens": last.map(|a| a.tokens()),
                "val_bytes": last.map(|a| a.bytes()),
                "val_split_tokens": self.validator.split_targets(),
                "unigram_bpb": self.unigram_bpb,
                "attention": self.attention,
                "attention_auto": self.auto_choice,
                "val_time_ms": val_time_ms,
                "validations": self.vals,
                "model_params": self.trainer.model().param_count(),
                "engine": self.trainer.report(),
                "timing_ms_per_step": per_step,
                "timing_share_pct": {
                    "data_wait": share(per_step.data_wait),
                    "forward": share(per_step.forward),
                    "backward": share(per_step.backward),
                    "optimizer": share(per_step.optimizer),
                },
                "dropped_micro_batches": self.dropped_micro,
                "world_size": self.ranks.world(),
                "comm_ms_per_step": if steps > 0 { self.comm_total.as_secs_f64() * 1e3 / steps as f64 } else { 0.0 },
                "comm_share_pct": if train_ms > 0.0 { 100.0 * self.comm_total.as_secs_f64() * 1e3 / train_ms } else { 0.0 },
                "comm_overlapped_ms_per_step": if steps > 0 { self.overlapped_total.as_secs_f64() * 1e3 / steps as f64 } else { 0.0 },
                "resumed_from_step": (self.resumed_from > 0).then_some(self.resumed_from),
                "weights": self.weights_path.as_ref().filter(|p| p.exists()).map(|p| p.display().to_string()),
            }),
        );
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), KiB.
pub(super) fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}
