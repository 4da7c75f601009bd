//! Continuing a training session: what a checkpoint holds of it besides the tensors
//! ([`History`]), restoring a trainer from it, the one rule for where training ends, and
//! whether the process a resumed run continues had already completed it.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::data::batch::{BatchShape, LoaderState};
use crate::model::ModelConfig;
use crate::report::document::Report;
use crate::train::checkpoint::Checkpoint;
use crate::train::config::{Config, TrainConfig};
use crate::train::executor::Executor;
use crate::train::snapshot::Ending;

/// One validation's result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ValPoint {
    pub step: u64,
    pub val_loss: f64,
    pub val_bpb: f64,
    pub train_time_ms: f64,
}

/// What the executor keeps in a checkpoint besides the tensors.
#[derive(Serialize, Deserialize)]
pub(crate) struct History {
    /// The batch geometry the loader state belongs to.
    pub shape: BatchShape,
    /// Validations so far.
    pub validations: Vec<ValPoint>,
    /// On a GPU, the attention trained with (`flash`, `flash_mma`, `materialized`): a resumed
    /// `attention = "auto"` keeps it. None on the CPU, and in checkpoints made before it was kept.
    #[serde(default)]
    pub attention: Option<String>,
    /// The last step's LR multiplier (none in checkpoints made before it was kept).
    #[serde(default)]
    pub lr_mul: Option<f64>,
    /// The run's `train.iterations` when the checkpoint was made (none in checkpoints made
    /// before it was kept): a resume that changes it is said in the log.
    #[serde(default)]
    pub iterations: Option<u64>,
    /// Whether depth recurrence was on after the last step (`model.enable_looping_at` had
    /// passed): the resumed run goes on in the same layout. Absent in checkpoints made before
    /// recurrence existed, whose models had none.
    #[serde(default)]
    pub looping: bool,
}

/// The attention the run that wrote `ck` trained with, where its state says (see
/// [`History::attention`]); a checkpoint without step-executor state is refused later, by
/// [`resume`].
pub(crate) fn trained_attention(ck: &Checkpoint) -> Option<String> {
    serde_json::from_value::<History>(ck.meta.extra.clone()).ok().and_then(|h| h.attention)
}

/// An error naming the first `[model]` key whose value differs between the checkpoint's
/// `saved` table and `now` (keys the checkpoint's version did not know take their defaults, the
/// baseline's, which is what it trained): weights of one architecture must not continue in
/// another, even where the shapes agree (`ln_scale`, `xsa_last_n`, a loop range...).
pub(crate) fn same_architecture(saved: &serde_json::Value, now: &ModelConfig) -> anyhow::Result<()> {
    let then: ModelConfig = serde_json::from_value(saved.clone()).context("its `[model]` table is not one this version reads")?;
    if let Some((key, x, y)) = then.differences(now).into_iter().next() {
        anyhow::bail!("it was trained with `model.{key}` = {x}, the config now gives {y}: the architecture must not change on resume");
    }
    Ok(())
}

/// Whether a resume from `ck` can go on under `c`, judged before anything else is (a run that
/// would be found complete included): the same `[model]`, and a checkpoint not past
/// `train.iterations` (from there no step would be trained, and the log would read
/// `step 7/5`). Errors name the checkpoint and the key.
pub fn fits(ck: &Checkpoint, c: &Config) -> anyhow::Result<()> {
    let what = || format!("cannot resume from {}", ck.path.display());
    same_architecture(&ck.meta.model, &c.model).with_context(what)?;
    if ck.meta.step > c.train.iterations {
        anyhow::bail!(
            "{}: it is at step {}, past `train.iterations` = {}: no step could be trained; give `train.iterations` of at least {} (the run's \
             own count, or more to train further), or resume from an earlier checkpoint",
            what(),
            ck.meta.step,
            c.train.iterations,
            ck.meta.step
        );
    }
    Ok(())
}

/// The log line of a resume whose `train.iterations` differs from the one the checkpoint's run
/// had: the LR schedule's warm-down follows the new count from the checkpoint's step on.
pub(crate) fn iterations_changed(ck: &Checkpoint, now: u64) -> Option<String> {
    let then = serde_json::from_value::<History>(ck.meta.extra.clone()).ok()?.iterations?;
    (then != now).then(|| {
        format!(
            "resume: train.iterations is {now}, the run had {then}: from step {} on the schedule (warm-down, looping, momentum) follows {now}, so the run is not the uninterrupted run of either count bit for bit",
            ck.meta.step
        )
    })
}

/// Restores `trainer` from `ck`, after checking that the run continues with the same batch
/// geometry and training data; returns the validation history.
pub(crate) fn resume(trainer: &mut dyn Executor, ck: &Checkpoint, shape: BatchShape, data: &str) -> anyhow::Result<History> {
    let what = || format!("cannot resume from {}", ck.path.display());
    let history: History = serde_json::from_value(ck.meta.extra.clone())
        .with_context(|| format!("{}: it holds no step-executor state (made by another version?)", what()))?;
    let (a, b) = (history.shape, shape);
    // The same rows of the same length per micro-batch, and the same micro-batches per step
    // over all ranks (`W · A`): the same global batch.
    anyhow::ensure!(
        (a.seq_len, a.rows, a.micro_steps * a.world_size) == (b.seq_len, b.rows, b.micro_steps * b.world_size),
        "{}: it was made with seq_len {}, {} rows x {} micro-batches on {} rank(s); `[train]`/`[run]` now give seq_len {}, {} rows x {} micro-batches on {} rank(s) (`train.seq_len`, `train.batch_tokens` and the micro-batches of a step over all ranks, `run.world_size` x `train.grad_accum_steps`, must not change)",
        what(),
        a.seq_len,
        a.rows,
        a.micro_steps,
        a.world_size,
        b.seq_len,
        b.rows,
        b.micro_steps,
        b.world_size
    );
    let shuffled = matches!(ck.meta.loader, Some(LoaderState::Shuffled { .. }));
    // Another world size takes the same data only where the data order does not depend on it:
    // the sequential stream (rank r of W takes the r-th slice of each chunk of W · A slices).
    // The shuffled sampler deals shards by rank and seeds each rank's generator with it.
    anyhow::ensure!(
        a.world_size == b.world_size || !shuffled,
        "{}: it was made on {} rank(s) with the shuffled sampler, whose order depends on the ranks (each owns the shards \
         `index % W == rank` and its own generator); it continues on {} rank(s) only with `run.world_size` = {} \
         (the sequential sampler's order does not depend on the world size)",
        what(),
        a.world_size,
        b.world_size,
        a.world_size
    );
    anyhow::ensure!(
        b.world_size == 1 || !shuffled || ck.meta.rank_loaders.len() == b.world_size,
        "{}: it was made on {} ranks with the shuffled sampler, whose state differs per rank, and it holds {} rank state(s) \
         (made by a version that kept rank 0's only?), so it cannot continue on several ranks",
        what(),
        a.world_size,
        ck.meta.rank_loaders.len()
    );
    anyhow::ensure!(
        ck.meta.data == data,
        "{}: the training shards (`data.train`) differ from those it was trained on (data fingerprint {} now, {} then)",
        what(),
        data,
        ck.meta.data
    );
    same_architecture(&ck.meta.model, trainer.model().config()).with_context(what)?;
    trainer.load_weights(&ck.section("model.")).with_context(|| format!("{}: the weights do not fit `[model]`", what()))?;
    trainer.set_looping(history.looping);
    trainer.restore(ck.meta.step, &ck.section("optim.")).with_context(|| format!("{}: the optimizer state does not fit", what()))?;
    Ok(history)
}

/// Where this rank's sampler continues from `ck` on `shape` (checked by [`resume`]): its own
/// state where the checkpoint holds every rank's (the shuffled sampler on several ranks), else
/// the checkpoint's (the sequential stream's and the document packing's position is every
/// rank's), its count of
/// micro-batches recounted in this run's micro-batches per step when the world size changed
/// (`steps · A`).
pub fn loader_for(ck: &Checkpoint, shape: &BatchShape) -> Option<LoaderState> {
    let mut state = match ck.meta.rank_loaders.get(shape.rank) {
        Some(mine) if ck.meta.rank_loaders.len() == shape.world_size => mine.clone(),
        _ => ck.meta.loader.clone()?,
    };
    let then = serde_json::from_value::<History>(ck.meta.extra.clone()).ok().map(|h| h.shape);
    if let (Some(then), LoaderState::Sequential { micro_batches, .. } | LoaderState::Packed { micro_batches, .. }) = (then, &mut state)
        && then.micro_steps != shape.micro_steps
    {
        *micro_batches = *micro_batches / then.micro_steps.max(1) as u64 * shape.micro_steps as u64;
    }
    Some(state)
}

/// Whether training that has taken `step` steps in `train_ms` of training time is over as `t`
/// sets it, and why: `train.iterations` reached, else the wall-clock cap crossed (the cap less
/// `train.gptq_reserve_seconds`: [`TrainConfig::cap_ms`]). The one rule for the end of a step,
/// for a checkpoint (its step and the training time at its end) and for a previous run's report.
pub fn training_end(step: u64, train_ms: f64, t: &TrainConfig) -> Option<Ending> {
    let cap_ms = t.cap_ms();
    if step >= t.iterations {
        Some(Ending::Iterations)
    } else if cap_ms > 0.0 && train_ms >= cap_ms {
        Some(Ending::WallclockCap)
    } else {
        None
    }
}

/// Whether the previous process's report says it completed (exit 0) a run whose training ended
/// (by iterations or the cap) and is over as `t` still has it end ([`training_end`]): then
/// every stage after training had done its work too. Its steps and ending. A larger
/// `train.iterations` or cap than the run had is more training, not a complete run.
fn completed(prev: &Report, t: &TrainConfig) -> Option<(u64, Ending)> {
    let get = |k: &str| prev.train.get(k);
    let ended = matches!(get("ended_by")?.as_str()?, "iterations" | "wallclock_cap");
    if prev.run.exit_code != 0 || prev.run.status != "completed" || !ended {
        return None;
    }
    let steps = get("steps")?.as_u64()?;
    Some((steps, training_end(steps, get("train_time_ms")?.as_f64()?, t)?))
}

/// How an ending reads in logs: the key that ended training (under `t`, which names the GPTQ
/// reserve when it shortened the cap).
pub fn ending_name(e: Ending, t: &TrainConfig) -> &'static str {
    match e {
        Ending::Iterations => "train.iterations",
        Ending::WallclockCap if t.gptq_reserve_seconds > 0.0 => "train.max_wallclock_seconds less train.gptq_reserve_seconds",
        Ending::WallclockCap => "train.max_wallclock_seconds",
        Ending::InputEnded => "the input ended",
        Ending::Interrupted => "interrupted",
        Ending::Failed => "failed",
    }
}

/// Fingerprint of the `data.train` files (names and sizes).
pub fn data_fingerprint(c: &Config) -> anyhow::Result<String> {
    match &c.data.train {
        Some(glob) => crate::train::checkpoint::data_fingerprint(&crate::data::shard::glob_sorted(glob).context("`data.train`")?),
        None => Ok(String::new()),
    }
}

/// On `--resume RUN_DIR` (in `run_dir`, from `resume`): the message saying the run is
/// complete, when the process it continues (its report, `previous`) completed it: training
/// ended as `c` now says, and every stage after it finished. Then there is nothing to do at
/// all, whichever checkpoint is newest (one at the last step may not exist: `at_end = false`,
/// a failed write under `on_error`).
pub fn complete(c: &Config, resume: Option<&Checkpoint>, previous: Option<&Report>, run_dir: Option<&Path>) -> Option<String> {
    let (_, prev) = resume.zip(previous)?;
    let (steps, ending) = completed(prev, &c.train)?;
    let dir = run_dir.map(|d| d.display().to_string()).unwrap_or_default();
    Some(format!(
        "run {dir} is complete: training ended at step {steps}/{} ({}) and every stage after it finished (its report.json: completed, exit 0). Nothing left to do; no file was changed. (To train again from one of its checkpoints, name the file: --resume {dir}/checkpoints/step_N.safetensors.)",
        c.train.iterations,
        ending_name(ending, &c.train),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `train.gptq_reserve_seconds` shortens the cap training stops at, and the ending names it.
    #[test]
    fn the_gptq_reserve_shortens_the_cap() {
        let base = TrainConfig::default();
        let record = TrainConfig { gptq_reserve_seconds: 12.0, ..TrainConfig::default() };
        assert_eq!(training_end(4000, 587_999.0, &record), None);
        assert_eq!(training_end(4000, 588_000.0, &record), Some(Ending::WallclockCap));
        assert_eq!(training_end(4000, 590_000.0, &base), None);
        assert_eq!(training_end(4000, 600_000.0, &base), Some(Ending::WallclockCap));
        assert_eq!(training_end(20_000, 0.0, &record), Some(Ending::Iterations));
        // Without a cap the reserve takes nothing.
        let uncapped = TrainConfig { max_wallclock_seconds: 0.0, ..record.clone() };
        assert_eq!(training_end(4000, 1e9, &uncapped), None);
        assert_eq!(ending_name(Ending::WallclockCap, &base), "train.max_wallclock_seconds");
        assert_eq!(ending_name(Ending::WallclockCap, &record), "train.max_wallclock_seconds less train.gptq_reserve_seconds");
    }

    /// A checkpoint's `[model]` must be this config's, key by key; keys it predates read as
    /// their defaults.
    #[test]
    fn another_architecture_is_refused_naming_the_key() {
        let now = ModelConfig { xsa_last_n: 2, ..ModelConfig::default() };
        let saved = serde_json::to_value(&now).unwrap();
        same_architecture(&saved, &now).unwrap();
        let e = same_architecture(&saved, &ModelConfig { xsa_last_n: 1, ..now.clone() }).unwrap_err().to_string();
        assert!(e.contains("`model.xsa_last_n` = 2") && e.contains("gives 1"), "{e}");
        let e = same_architecture(&saved, &ModelConfig { rope_dims: Some(16), ..now.clone() }).unwrap_err().to_string();
        assert!(e.contains("`model.rope_dims` = null") && e.contains("gives 16"), "{e}");
        // A checkpoint from before the record's keys: the baseline's model.
        let old = serde_json::json!({ "vocab_size": 1024, "num_layers": 9, "model_dim": 512, "num_heads": 8, "num_kv_heads": 4, "mlp_mult": 2,
            "tie_embeddings": true, "rope_base": 10000.0, "logit_softcap": 30.0, "qk_gain_init": 1.5, "tied_embed_init_std": 0.005 });
        same_architecture(&old, &ModelConfig::default()).unwrap();
        assert!(same_architecture(&old, &now).is_err());
    }

    /// The executor's checkpoint state keeps the attention trained with, and a checkpoint
    /// written before it did still resumes (its attention unknown, so "auto" runs its trials).
    #[test]
    fn checkpoint_state_keeps_the_attention_and_reads_older_state() {
        let shape = BatchShape { seq_len: 64, rows: 2, micro_steps: 1, world_size: 1, rank: 0 };
        let h = History {
            shape,
            validations: Vec::new(),
            attention: Some("flash_mma".into()),
            lr_mul: Some(0.25),
            iterations: Some(10),
            looping: true,
        };
        let back: History = serde_json::from_value(serde_json::to_value(&h).unwrap()).unwrap();
        assert_eq!((back.attention.as_deref(), back.lr_mul, back.looping), (Some("flash_mma"), Some(0.25), true));
        let mut older = serde_json::to_value(&h).unwrap();
        for key in ["attention", "lr_mul", "looping"] {
            older.as_object_mut().unwrap().remove(key);
        }
        let back: History = serde_json::from_value(older).unwrap();
        assert_eq!((back.attention, back.shape, back.lr_mul, back.looping), (None, shape, None, false));
    }
}
