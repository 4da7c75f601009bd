//! The training log: the challenge script's line formats (so its log parsers work), a copy in
//! `RUN_DIR/train.log`, a progress bar on a terminal (stdout as [`console`] allows), and the
//! per-phase time breakdown.
//!
//! Line formats (spec 3.9):
//! - `step:N/M train_loss:X train_time:Tms step_avg:Sms`
//! - `step:N/M val_loss:X val_bpb:Y train_time:Tms step_avg:Sms`
//! - `stopping_early: wallclock_cap train_time:Tms step:N/M`
//! - `timing step:N/M steps:K data_wait:..ms h2d:..ms forward:..ms backward:..ms optimizer:..ms
//!   val:..ms` (means per step over the last K steps; `val` is validation time spread over them).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::runtime::console;
use crate::train::config::TrainConfig;

/// Writes log lines to stdout (above the progress bar on a terminal; as the process's
/// [`console`] allows: rank 0's only among ranks unless every rank's is asked for, tagged then)
/// and to `train.log` (always).
pub struct TrainLog {
    file: Option<BufWriter<File>>,
    bar: Option<ProgressBar>,
    /// What stdout gets: `None` for nothing, else each line's prefix.
    stdout: Option<String>,
}

impl TrainLog {
    /// A log writing `RUN_DIR/train.log` when `run_dir` is given (appending to it when
    /// `append`, as a resumed run does); with a progress bar of `total_steps` when `progress`
    /// is true and the console has room for one (a terminal, one process speaking).
    pub fn new(run_dir: Option<&Path>, total_steps: u64, progress: bool, append: bool) -> anyhow::Result<Self> {
        let file = match run_dir {
            Some(d) => Some(BufWriter::new(open_log(&d.join("train.log"), append)?)),
            None => None,
        };
        let console = console::get();
        let stdout = console.line_prefix();
        let bar = (progress && console.bar()).then(|| {
            let b = ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stdout());
            b.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        });
        Ok(Self { file, bar, stdout })
    }

    /// Logs one line.
    pub fn line(&mut self, s: &str) {
        match (&self.bar, &self.stdout) {
            (Some(b), _) => b.println(s),
            // A closed terminal (SIGHUP) or pipe must not stop training: the file has the line.
            (None, Some(prefix)) => {
                let _ = writeln!(std::io::stdout().lock(), "{prefix}{s}");
            }
            (None, None) => {}
        }
        if let Some(f) = self.file.as_mut() {
            // A log that cannot be written must not stop training; stdout still has it.
            let _ = writeln!(f, "{s}").and_then(|_| f.flush());
        }
    }

    /// Moves the progress bar (no-op without one).
    pub fn progress(&self, step: u64, train_loss: f64, step_avg_ms: f64) {
        if let Some(b) = &self.bar {
            b.set_position(step);
            b.set_message(format!("train_loss {train_loss:.4}  {step_avg_ms:.0} ms/step"));
        }
    }

    /// Removes the progress bar.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if let Some(f) = self.file.as_mut() {
            let _ = f.flush();
        }
    }
}

/// Opens `path` for appending, emptied first unless `append`. Always in append mode: other
/// stages append lines to the same file ([`StageLog`]), and a writer with its own file position
/// would overwrite them.
fn open_log(path: &Path, append: bool) -> anyhow::Result<File> {
    if !append {
        File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    }
    std::fs::OpenOptions::new().append(true).create(true).open(path).with_context(|| format!("cannot open {}", path.display()))
}

/// Log lines of the stages after training (averaging, artifact, evaluation): stdout (as the
/// process's [`console`] allows, as for the training log) and the end of `RUN_DIR/train.log`,
/// which they open only when they have something to say (the executor writes the file first).
pub struct StageLog {
    path: Option<std::path::PathBuf>,
    /// What stdout gets: `None` for nothing, else each line's prefix.
    stdout: Option<String>,
}

impl StageLog {
    /// A log appending to `RUN_DIR/train.log` when `run_dir` is given.
    pub fn new(run_dir: Option<&Path>) -> Self {
        Self { path: run_dir.map(|d| d.join("train.log")), stdout: console::get().line_prefix() }
    }

    /// Logs one line.
    pub fn line(&self, s: &str) {
        if let Some(prefix) = &self.stdout {
            let _ = writeln!(std::io::stdout().lock(), "{prefix}{s}");
        }
        if let Some(p) = &self.path {
            // As for the training log: stdout still has the line if the file cannot take it.
            if let Ok(mut f) = open_log(p, true) {
                let _ = writeln!(f, "{s}");
            }
        }
    }
}

/// `RUN_DIR/steps.tsv`: one row per optimizer step (step, train loss, LR multiplier, training
/// time, rolling data fingerprint, then the step's forward, backward and optimizer time in ms:
/// device time on a GPU), for plotting, for finding the step that was slow and where, and for
/// checking that a resumed run saw the same data at every step. Losses are written with full
/// precision (they round-trip).
pub struct StepTable {
    file: Option<BufWriter<File>>,
}

/// The header of `steps.tsv`.
pub const STEP_TABLE_HEADER: &str = "step\ttrain_loss\tlr_mul\ttrain_time_ms\tdata_fingerprint\tforward_ms\tbackward_ms\toptimizer_ms";

impl StepTable {
    /// A table at `RUN_DIR/steps.tsv`; a resumed run (`resumed_at` = the checkpoint's step)
    /// keeps the rows up to that step and drops later ones (steps the interrupted process took
    /// after its last checkpoint, which the resumed run takes again).
    pub fn new(run_dir: Option<&Path>, resumed_at: Option<u64>) -> anyhow::Result<Self> {
        let Some(dir) = run_dir else { return Ok(Self { file: None }) };
        let path = dir.join("steps.tsv");
        let mut kept = String::from(STEP_TABLE_HEADER);
        kept.push('\n');
        if let Some(at) = resumed_at {
            let old = std::fs::read_to_string(&path).unwrap_or_default();
            for row in old.lines().skip(1) {
                if row.split('\t').next().and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s <= at) {
                    kept.push_str(row);
                    // A row of an older table (before the phase columns) gets them empty.
                    let missing = STEP_TABLE_HEADER.split('\t').count().saturating_sub(row.split('\t').count());
                    kept.push_str(&"\t".repeat(missing));
                    kept.push('\n');
                }
            }
        }
        crate::runtime::rundir::write_atomic(&path, kept.as_bytes())?;
        Ok(Self { file: Some(BufWriter::new(open_log(&path, true)?)) })
    }

    /// Appends the row of `step` (`phases`: its forward, backward and optimizer time).
    pub fn row(&mut self, step: u64, train_loss: f64, lr_mul: f64, train_ms: f64, fingerprint: u64, phases: [Duration; 3]) {
        if let Some(f) = self.file.as_mut() {
            let [fw, bw, opt] = phases.map(|d| d.as_secs_f64() * 1e3);
            let _ = writeln!(f, "{step}\t{train_loss}\t{lr_mul}\t{train_ms:.1}\t{fingerprint:016x}\t{fw:.2}\t{bw:.2}\t{opt:.2}")
                .and_then(|_| f.flush());
        }
    }
}

impl Drop for TrainLog {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Time spent per phase of training.
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    /// Waiting for the next micro-batch (the executor idle on its input).
    pub data_wait: Duration,
    /// Host-to-device copies (measured by the upload stage).
    pub h2d: Duration,
    /// Forward passes.
    pub forward: Duration,
    /// Backward passes and gradient accumulation.
    pub backward: Duration,
    /// Optimizer updates.
    pub optimizer: Duration,
    /// Validation passes.
    pub validation: Duration,
}

/// [`Phases`] in milliseconds, for the report.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PhasesMs {
    /// Waiting for input.
    pub data_wait: f64,
    /// Host-to-device copies.
    pub h2d: f64,
    /// Forward passes.
    pub forward: f64,
    /// Backward passes.
    pub backward: f64,
    /// Optimizer updates.
    pub optimizer: f64,
    /// Validation.
    pub validation: f64,
}

impl Phases {
    /// Adds `o` to these.
    pub fn add(&mut self, o: &Phases) {
        self.data_wait += o.data_wait;
        self.h2d += o.h2d;
        self.forward += o.forward;
        self.backward += o.backward;
        self.optimizer += o.optimizer;
        self.validation += o.validation;
    }

    /// Each phase divided by `n` (per step), in ms.
    pub fn per(&self, n: u64) -> PhasesMs {
        let f = |d: Duration| d.as_secs_f64() * 1e3 / n.max(1) as f64;
        PhasesMs {
            data_wait: f(self.data_wait),
            h2d: f(self.h2d),
            forward: f(self.forward),
            backward: f(self.backward),
            optimizer: f(self.optimizer),
            validation: f(self.validation),
        }
    }

    /// The timing line for steps ending at `step` of `total`, over `n` steps.
    pub fn line(&self, step: u64, total: u64, n: u64) -> String {
        let p = self.per(n);
        format!(
            "timing step:{step}/{total} steps:{n} data_wait:{:.2}ms h2d:{:.2}ms forward:{:.2}ms backward:{:.2}ms optimizer:{:.2}ms val:{:.2}ms",
            p.data_wait, p.h2d, p.forward, p.backward, p.optimizer, p.validation
        )
    }
}

/// `step:N/M train_loss:X train_time:Tms step_avg:Sms`.
pub fn train_line(step: u64, total: u64, loss: f64, train_ms: f64) -> String {
    format!("step:{step}/{total} train_loss:{loss:.4} train_time:{train_ms:.0}ms step_avg:{:.2}ms", train_ms / step.max(1) as f64)
}

/// `step:N/M val_loss:X val_bpb:Y train_time:Tms step_avg:Sms`.
pub fn val_line(step: u64, total: u64, val_loss: f64, val_bpb: f64, train_ms: f64) -> String {
    format!(
        "step:{step}/{total} val_loss:{val_loss:.4} val_bpb:{val_bpb:.4} train_time:{train_ms:.0}ms step_avg:{:.2}ms",
        train_ms / step.max(1) as f64
    )
}

/// The 04-09 record's training elements as one log line, when any is on (none: the baseline,
/// whose log stays the script's): after the hyper-parameter lines at the start.
pub fn training_elements_line(t: &TrainConfig) -> Option<String> {
    let wd = [t.muon_weight_decay, t.embed_weight_decay, t.scalar_weight_decay, t.head_weight_decay];
    let pe = t.muon_ns == crate::optim::NewtonSchulz::PolarExpress;
    let on = t.muon_row_norm || wd.iter().any(|&w| w != 0.0) || t.warmdown_frac != 0.0 || t.min_lr != 0.0 || pe;
    on.then(|| {
        format!(
            "muon_row_norm:{} muon_wd:{} embed_wd:{} scalar_wd:{} head_wd:{} warmdown_frac:{} min_lr:{}{}",
            t.muon_row_norm,
            wd[0],
            wd[1],
            wd[2],
            wd[3],
            t.warmdown_frac,
            t.min_lr,
            if pe { " muon_ns:polar_express" } else { "" }
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed run keeps the rows up to its checkpoint, an older table's rows padded to the
    /// header's columns, and appends its own with the phase times.
    #[test]
    fn a_resumed_table_keeps_its_rows_under_the_current_header() {
        let dir = std::env::temp_dir().join(format!("pipeline-steps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let old = "step\ttrain_loss\tlr_mul\ttrain_time_ms\tdata_fingerprint\n1\t7\t1\t10.0\taa\n2\t6\t1\t20.0\tbb\n3\t5\t1\t30.0\tcc\n";
        std::fs::write(dir.join("steps.tsv"), old).unwrap();
        let mut t = StepTable::new(Some(&dir), Some(2)).unwrap();
        let ms = Duration::from_millis;
        t.row(3, 5.5, 1.0, 31.0, 0xdd, [ms(4), ms(5), ms(1)]);
        drop(t);
        let text = std::fs::read_to_string(dir.join("steps.tsv")).unwrap();
        let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split('\t').collect()).collect();
        assert_eq!(rows[0].join("\t"), STEP_TABLE_HEADER);
        assert!(rows.iter().all(|r| r.len() == 8), "{text}");
        assert_eq!((rows.len(), rows[2][4], rows[2][5], rows[3][5]), (4, "bb", "", "4.00"), "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The lines parse with the patterns the challenge's log readers use.
    #[test]
    fn lines_have_the_challenge_format() {
        assert_eq!(train_line(10, 20000, 2.71234, 435.4), "step:10/20000 train_loss:2.7123 train_time:435ms step_avg:43.54ms");
        assert_eq!(val_line(0, 20000, 6.93571, 4.10661, 0.0), "step:0/20000 val_loss:6.9357 val_bpb:4.1066 train_time:0ms step_avg:0.00ms");
        let p = Phases { forward: Duration::from_millis(30), backward: Duration::from_millis(60), ..Phases::default() };
        let l = p.line(200, 1000, 3);
        assert!(l.starts_with("timing step:200/1000 steps:3 data_wait:0.00ms h2d:0.00ms forward:10.00ms backward:20.00ms"), "{l}");
    }

    /// The record's training elements get a line only when one is on: the baseline's log is
    /// the script's.
    #[test]
    fn training_elements_line_only_when_on() {
        assert_eq!(training_elements_line(&TrainConfig::default()), None);
        let record = crate::train::config::record_train();
        assert_eq!(
            training_elements_line(&record).as_deref(),
            Some("muon_row_norm:true muon_wd:0.095 embed_wd:0.085 scalar_wd:0.02 head_wd:0 warmdown_frac:0.72 min_lr:0")
        );
        assert!(training_elements_line(&TrainConfig { min_lr: 0.1, ..TrainConfig::default() }).is_some());
    }
}
