//! The training trace (`[stages.train] step_trace = true`): what another trainer needs to take the
//! same steps from the same weights and to compare itself with this one step by step
//! (`scripts/compare-record.py` runs the record's own training code on it, docs/record.md).
//!
//! `RUN_DIR/step_trace/` holds:
//!
//! - `weights_0.safetensors`: the weights before the first step (the `state_dict` names), and
//!   `weights_N.safetensors` after each step `N` of `step_trace_weights_at` and after the last
//!   step of a run that ends at `train.iterations` or the wall-clock cap;
//! - `batches.u16`: every micro-batch's tokens in the order trained (those of a step dropped
//!   unfinished are not written), each as `rows x seq_len`
//!   inputs then `rows x seq_len` targets, little-endian u16 (the shards' own type), so that
//!   `numpy.fromfile(path, "<u2").reshape(steps, micro_steps, 2, rows, seq_len)` reads them;
//! - `steps.tsv`: one row per step: the mean training loss, the global gradient norm before
//!   clipping (`NaN` without clipping), the LR multiplier, the Muon momentum, the training
//!   fraction and whether the layer loop was on during the step (losses in full precision);
//! - `trace.json`: the geometry (`rows`, `seq_len`, `micro_steps`) and the files above.
//!
//! The trace starts at step 0: a resumed run is refused (its first steps are in another
//! process's trace).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::Tensor;

use crate::data::batch::BatchShape;
use crate::train::executor::StepOutcome;

/// The header of `step_trace/steps.tsv`.
pub const TRACE_STEPS_HEADER: &str = "step\ttrain_loss\tgrad_norm\tlr_mul\tmomentum\tfrac\tlooping";

/// An open trace under `RUN_DIR/step_trace/`.
pub struct Trace {
    dir: PathBuf,
    /// `batches.u16` and `steps.tsv`, each written a step at a time (so unbuffered).
    batches: File,
    /// The tokens of the step in progress, written with its row (a step dropped unfinished,
    /// after Ctrl-C or the input's end, leaves none behind).
    pending: Vec<u8>,
    steps: File,
    weights_at: Vec<u64>,
}

impl Trace {
    /// Creates `run_dir/step_trace/` (refusing one that has files: a trace is one run's, whole) and
    /// writes `trace.json` for batches of `shape`; the weights after each step of `weights_at`
    /// will be saved.
    pub fn create(run_dir: &Path, shape: BatchShape, weights_at: &[u64]) -> anyhow::Result<Self> {
        let dir = run_dir.join("step_trace");
        if dir.is_dir() && std::fs::read_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))?.next().is_some() {
            anyhow::bail!("key `step_trace`: {} already holds a trace (a trace starts at step 0 and is one run's)", dir.display());
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("key `step_trace`: cannot create {}", dir.display()))?;
        let meta = serde_json::json!({
            "rows": shape.rows,
            "seq_len": shape.seq_len,
            "micro_steps": shape.micro_steps,
            "batches": "batches.u16",
            "batches_layout": "[steps, micro_steps, 2 (inputs, targets), rows, seq_len] little-endian u16",
            "steps": "steps.tsv",
            "weights": "weights_N.safetensors: before step 1 (N = 0) and after step N",
            "weights_at": weights_at,
        });
        crate::runtime::rundir::write_atomic(&dir.join("trace.json"), serde_json::to_string_pretty(&meta)?.as_bytes())?;
        let open = |name: &str, head: &str| -> anyhow::Result<File> {
            let path = dir.join(name);
            let mut f = File::create(&path).with_context(|| format!("key `step_trace`: cannot create {}", path.display()))?;
            f.write_all(head.as_bytes()).with_context(|| format!("key `step_trace`: cannot write {}", path.display()))?;
            Ok(f)
        };
        let batches = open("batches.u16", "")?;
        let steps = open("steps.tsv", &format!("{TRACE_STEPS_HEADER}\n"))?;
        Ok(Self { dir, batches, pending: Vec::new(), steps, weights_at: weights_at.to_vec() })
    }

    /// Takes one micro-batch's inputs and targets (`rows x seq_len` u32 tensors, on any
    /// device) for the step in progress; they reach `batches.u16` with the step's row. A token
    /// above u16 is an error (the shards hold u16).
    pub fn batch(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<()> {
        for t in [x, y] {
            for tok in t.flatten_all()?.to_vec1::<u32>()? {
                let tok = u16::try_from(tok).with_context(|| format!("trace: token {tok} does not fit the shards' u16"))?;
                self.pending.extend_from_slice(&tok.to_le_bytes());
            }
        }
        Ok(())
    }

    /// Appends step `step`'s row (`looping`: whether the loop was on during it).
    pub fn step(&mut self, step: u64, out: &StepOutcome, looping: bool) -> anyhow::Result<()> {
        let batches = self.dir.join("batches.u16");
        self.batches.write_all(&self.pending).with_context(|| format!("cannot write {}", batches.display()))?;
        self.pending.clear();
        let row = format!(
            "{step}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            out.train_loss,
            out.grad_norm.unwrap_or(f64::NAN),
            out.lr_mul,
            out.momentum,
            out.frac,
            u8::from(looping)
        );
        let path = self.dir.join("steps.tsv");
        self.steps.write_all(row.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Whether the weights after `step` belong in the trace (`last`: the run's last step).
    pub fn wants_weights(&self, step: u64, last: bool) -> bool {
        step == 0 || last || self.weights_at.contains(&step)
    }

    /// Saves the weights after `step` as `weights_{step}.safetensors`.
    pub fn weights(&self, step: u64, state: &[(String, Tensor)]) -> anyhow::Result<()> {
        crate::model::weights::save(&self.dir.join(format!("weights_{step}.safetensors")), state)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn outcome(loss: f64) -> StepOutcome {
        StepOutcome {
            train_loss: loss,
            lr_mul: 0.5,
            frac: 0.25,
            momentum: 0.93,
            grad_norm: None,
            phases: Default::default(),
            comm: Default::default(),
            overlapped: Default::default(),
        }
    }

    /// The tokens come back in the documented layout once their step's row is written (an
    /// unfinished step's never do), the rows in full precision, a token beyond u16 is an error,
    /// and a second trace in the same folder is refused.
    #[test]
    fn a_trace_reads_back_as_documented() {
        let run = std::env::temp_dir().join(format!("trace-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&run);
        let shape = BatchShape { rows: 2, seq_len: 3, micro_steps: 1, world_size: 1, rank: 0 };
        let mut t = Trace::create(&run, shape, &[5]).unwrap();
        let x = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu).unwrap();
        let y = Tensor::new(&[[2u32, 3, 4], [5, 6, 65535]], &Device::Cpu).unwrap();
        t.batch(&x, &y).unwrap();
        assert_eq!(std::fs::metadata(run.join("step_trace/batches.u16")).unwrap().len(), 0, "a step's tokens wait for its row");
        t.step(1, &outcome(1.0 / 3.0), true).unwrap();
        // A step that never ends (Ctrl-C inside it) leaves no tokens behind.
        t.batch(&x, &y).unwrap();
        drop(t);
        let bytes = std::fs::read(run.join("step_trace/batches.u16")).unwrap();
        let tokens: Vec<u16> = bytes.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        assert_eq!(tokens, [1, 2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 65535]);
        let rows = std::fs::read_to_string(run.join("step_trace/steps.tsv")).unwrap();
        let row: Vec<&str> = rows.lines().nth(1).unwrap().split('\t').collect();
        assert_eq!(row[1].parse::<f64>().unwrap(), 1.0 / 3.0);
        assert_eq!((row[2], row[6]), ("NaN", "1"));
        let mut t = Trace::create(&run.join("again"), shape, &[5]).unwrap();
        assert!(t.wants_weights(0, false) && t.wants_weights(5, false) && t.wants_weights(7, true) && !t.wants_weights(6, false));
        let big = Tensor::new(&[[65536u32]], &Device::Cpu).unwrap();
        assert!(t.batch(&big, &big).is_err());
        let again = Trace::create(&run.join("again"), shape, &[]).err().unwrap();
        assert!(format!("{again:#}").contains("already holds a trace"), "{again:#}");
        let _ = std::fs::remove_dir_all(&run);
    }
}
