//! What a training session needs, known before it starts: the checks of its config that
//! `pipeline validate` runs, and its memory estimate ([`crate::runtime::memory`]).

use anyhow::Context;

use crate::data::batch::BatchShape;

use crate::model::flash_attn::Attention;
use crate::runtime::memory::Need;
use crate::train::config::{Config, TrainConfig};
use crate::train::params::{Precision, SessionParams};

/// Checks `c` for a session with `p`: the model, the device and dtype, the batch geometry,
/// `[train]`, the validation split and tokenizer, the initial weights.
pub fn check(p: &SessionParams, c: &Config) -> anyhow::Result<()> {
    c.model.check()?;
    if matches!(crate::device::parse(&c.run.device)?, crate::device::DeviceName::Cpu) && p.dtype == Precision::Bf16 {
        anyhow::bail!("`dtype` = \"bf16\" is for GPUs: on `run.device` = \"cpu\" use \"f32\" (or \"f64\" for checks)");
    }
    c.batch_shape()?;
    check_train(&c.train)?;
    anyhow::ensure!(c.data.val.is_some(), "`data.val` is not set: the step executor validates on the validation shards");
    let tok = c.data.tokenizer.as_deref().context("`data.tokenizer` is not set: val_bpb counts bytes with the sentencepiece model")?;
    crate::eval::validation::load_tables(tok, c.model.vocab_size)?;
    if c.model.smear_gate || c.model.document_attention {
        // The BOS fix and the document mask must know where documents start in these shards.
        let bos = crate::data::tokenizer::bos_id(tok).with_context(|| format!("`data.tokenizer` = {}", tok.display()))?;
        anyhow::ensure!(
            bos == c.model.bos_id,
            "`model.bos_id` = {} but the tokenizer {} starts documents with {bos}: SmearGate's BOS fix and the document mask would miss them",
            c.model.bos_id,
            tok.display()
        );
    }
    crate::eval::validation::check_split(&c.validation())?;
    if let Some(w) = &c.train.init_weights {
        anyhow::ensure!(w.is_file(), "`train.init_weights` = {} is not a file", w.display());
    }
    Ok(())
}

/// What a session holds at its peak: weights, gradients, optimizer state, the activations of
/// one micro-batch or validation batch (whichever is larger), and the validation split.
pub fn memory(p: &SessionParams, c: &Config) -> anyhow::Result<Vec<Need>> {
    use crate::model::memory::{MODEL_KEYS, ParamCounts, training_bytes};
    c.model.check()?;
    let (shape, rows) = (c.train_shape()?, c.batch_shape()?);
    let m = &c.model;
    let counts = ParamCounts::of(m);
    let (param_bytes, act_bytes) = elem_bytes(p.dtype);
    let on_cpu = matches!(crate::device::parse(&c.run.device)?, crate::device::DeviceName::Cpu);
    let t = shape.seq_len;
    let train = training_bytes(m, shape.rows * t, t, stores_probs(p, on_cpu), act_bytes);
    let val = validation_pass_bytes(p, c, rows, on_cpu);
    let mut act_keys = vec!["train.batch_tokens", "train.grad_accum_steps", "train.seq_len"];
    act_keys.extend(MODEL_KEYS);
    let mut needs = vec![
        Need::device("weights", counts.total.saturating_mul(param_bytes), &MODEL_KEYS),
        Need::device("gradients", counts.total.saturating_mul(param_bytes), &MODEL_KEYS),
        Need::device("optimizer state", counts.optimizer().saturating_mul(param_bytes), &MODEL_KEYS),
    ];
    if train >= val {
        needs.push(Need::device("activations of one micro-batch", train, &act_keys).transient());
    } else {
        act_keys[0] = "train.val_batch_tokens";
        needs.push(Need::device("activations of one validation batch", val, &act_keys).transient());
    }
    needs.extend(validation_tokens(c)?);
    Ok(needs)
}

/// Bytes per parameter and per activation: f32 master weights and optimizer state in every mode
/// but f64; bf16 products between f32 norms and residuals average out at about 3 bytes an
/// activation.
fn elem_bytes(p: Precision) -> (u64, u64) {
    match p {
        Precision::F64 => (8, 8),
        Precision::F32 => (4, 4),
        Precision::Bf16 => (4, 3),
    }
}

/// Whether the attention probabilities are stored: on the CPU and by the materialised
/// attention (on a GPU, `model.document_attention` runs flash_mma's document kernels, which
/// store none).
fn stores_probs(p: &SessionParams, on_cpu: bool) -> bool {
    on_cpu || p.attention == Attention::Materialized
}

/// The activations of one validation pass of the candle model.
fn validation_pass_bytes(p: &SessionParams, c: &Config, shape: BatchShape, on_cpu: bool) -> u64 {
    let tokens = crate::eval::validation::tokens_per_pass(&c.validation(), shape.world_size, shape.micro_steps);
    // Packed (`train.val_packed`), a pass is one row of all its tokens.
    let t = if c.train.val_packed { tokens } else { shape.seq_len };
    crate::model::memory::forward_bytes(&c.model, tokens, t, stores_probs(p, on_cpu), elem_bytes(p.dtype).1)
}

/// The validation split, read whole (u16) and kept as u32 ids.
fn validation_tokens(c: &Config) -> anyhow::Result<Option<Need>> {
    let Some(tokens) = crate::eval::validation::split_tokens(&c.validation())? else { return Ok(None) };
    let kept = if c.train.val_max_tokens > 0 { tokens.min(c.train.val_max_tokens as u64 + 1) } else { tokens };
    Ok(Some(Need::host("validation tokens", tokens * 2 + kept * 4, &["data.val", "train.val_max_tokens"])))
}

/// What a session on the engine (`impl = "engine"`) holds at its peak: the engine's arena,
/// region by region, exactly as [`crate::engine::layout::Layout`] sizes it (in the arena's
/// dtype: f64 for f64 runs, else f32); on a GPU the kernel backend's other spaces and
/// cuBLASLt's workspace ([`crate::engine::gpu::Capacity::scratch_bytes`]); the candle
/// model that mirrors the weights (validation runs in the arena); the validation split.
/// With `bf16_activations` the activations and scratch count 2 bytes an element, and the
/// weights' bf16 copy is added.
pub fn engine_memory(p: &SessionParams, c: &Config, bf16_activations: bool) -> anyhow::Result<Vec<Need>> {
    use crate::model::memory::{MODEL_KEYS, ParamCounts};
    crate::engine::support::check(&c.model)?;
    let shape = c.train_shape()?;
    let m = &c.model;
    let t = shape.seq_len;
    // The arena and the mirror hold f32 (f64 in f64 runs), as the candle executor's weights.
    let elem = elem_bytes(p.dtype).0;
    let layout = crate::engine::layout::Layout::new(m, shape.rows, t);
    let act_keys =
        ["train.batch_tokens", "train.grad_accum_steps", "train.seq_len", "model.model_dim", "model.num_layers", "model.vocab_size"];
    let mut needs: Vec<Need> = layout
        .region_bytes(elem as usize, bf16_activations)
        .into_iter()
        .map(|(what, bytes)| {
            // The activations and scratch are freed with the executor when training ends (on an
            // H100 the record's 34 GB went to 2 GB before the artifact stage began): the
            // artifact's and the evaluation's models do not sit beside them.
            let working = matches!(what, "activations" | "scratch");
            let need = Need::device(format!("engine arena: {what}"), bytes as u64, if working { &act_keys } else { &MODEL_KEYS });
            if working { need.transient() } else { need }
        })
        .collect();
    let on_cpu = matches!(crate::device::parse(&c.run.device)?, crate::device::DeviceName::Cpu);
    if !on_cpu {
        // An error here is the backend check's to report (head width, sequence length).
        if let Ok(cap) = crate::engine::step::kernel_capacity(m, shape.rows, t) {
            needs.push(
                Need::device(
                    "engine kernel scratch (aux, bf16 attention operands, token CSR, cuBLASLt workspace)",
                    cap.scratch_bytes() as u64,
                    &act_keys,
                )
                .transient(),
            );
        }
    }
    // The mirror's weights (what snapshots and the saved weights read). Validation runs the
    // engine's own forward passes in the arena above (`Executor::score`): no activations of its own.
    let weights = ParamCounts::of(m).total.saturating_mul(elem);
    needs.push(Need::device("candle mirror of the weights", weights, &MODEL_KEYS));
    // A sync copies the arena's parameters out whole before the mirror takes them.
    needs.push(Need::device("the mirror's sync (a copy of the weights)", weights, &MODEL_KEYS).transient());
    needs.extend(validation_tokens(c)?);
    Ok(needs)
}

pub(crate) fn check_train(t: &TrainConfig) -> anyhow::Result<()> {
    anyhow::ensure!(t.iterations >= 1, "`train.iterations` must be at least 1");
    anyhow::ensure!(t.max_wallclock_seconds >= 0.0, "`train.max_wallclock_seconds` must not be negative");
    anyhow::ensure!(t.grad_clip_norm >= 0.0, "`train.grad_clip_norm` must not be negative");
    t.muon_ns.check(t.muon_backend_steps, "train.muon_backend_steps")?;
    anyhow::ensure!((0.0..1.0).contains(&t.beta1) && (0.0..1.0).contains(&t.beta2), "`train.beta1` and `train.beta2` must be in [0, 1)");
    for (k, v) in [
        ("matrix_lr", t.matrix_lr),
        ("scalar_lr", t.scalar_lr),
        ("tied_embed_lr", t.tied_embed_lr),
        ("embed_lr", t.embed_lr),
        ("head_lr", t.head_lr),
    ] {
        anyhow::ensure!(v >= 0.0 && v.is_finite(), "`train.{k}` must be a non-negative number");
    }
    for (k, v) in [
        ("muon_weight_decay", t.muon_weight_decay),
        ("embed_weight_decay", t.embed_weight_decay),
        ("scalar_weight_decay", t.scalar_weight_decay),
        ("head_weight_decay", t.head_weight_decay),
    ] {
        anyhow::ensure!(v >= 0.0 && v.is_finite(), "`train.{k}` = {v} must be a non-negative number (0: no weight decay)");
    }
    for (k, v) in [("warmdown_frac", t.warmdown_frac), ("min_lr", t.min_lr)] {
        anyhow::ensure!((0.0..=1.0).contains(&v), "`train.{k}` = {v} must be in [0, 1]");
    }
    let reserve = t.gptq_reserve_seconds;
    anyhow::ensure!(reserve >= 0.0 && reserve.is_finite(), "`train.gptq_reserve_seconds` = {reserve} must be a non-negative number");
    anyhow::ensure!(
        t.max_wallclock_seconds <= 0.0 || reserve < t.max_wallclock_seconds,
        "`train.gptq_reserve_seconds` = {reserve} must be below `train.max_wallclock_seconds` = {}: it is taken off the cap",
        t.max_wallclock_seconds
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's memory check is its arena, region by region, to the byte: the sum of the
    /// `engine arena` needs is what an engine of that config allocates; the candle formula's
    /// activations do not appear.
    #[test]
    fn the_engine_memory_check_is_its_arena() {
        let model =
            crate::model::ModelConfig { vocab_size: 64, num_layers: 3, model_dim: 32, num_heads: 4, num_kv_heads: 2, ..Default::default() };
        let mut c = Config { model, ..Config::default() };
        (c.train.seq_len, c.train.batch_tokens, c.train.grad_accum_steps) = (16, 64, 2);
        for (precision, dtype) in [(Precision::F32, candle_core::DType::F32), (Precision::F64, candle_core::DType::F64)] {
            let p = SessionParams { dtype: precision, ..SessionParams::default() };
            let needs = engine_memory(&p, &c, false).unwrap();
            let arena: u64 = needs.iter().filter(|n| n.what.starts_with("engine arena")).map(|n| n.bytes).sum();
            let shape = c.batch_shape().unwrap();
            let e = crate::engine::Engine::cpu(&c.model, shape.rows, shape.seq_len, dtype, false).unwrap();
            assert_eq!(arena, e.arena_bytes().0 as u64, "{precision:?}");
            assert_eq!(needs.iter().filter(|n| n.what.starts_with("engine arena")).count(), 5);
            // Freed when training ends: the later stages' models do not sit beside them.
            for n in needs.iter().filter(|n| n.what.starts_with("engine arena")) {
                assert_eq!(n.transient, n.what.ends_with("activations") || n.what.ends_with("scratch"), "{}", n.what);
            }
            assert!(!needs.iter().any(|n| n.what == "activations of one micro-batch"), "the candle formula is not the engine's");
        }
        // With bf16 activations: the layout's bytes with the bf16 region at 2 bytes, and the
        // weights' bf16 copy beside the parameters (what the GPU backend allocates).
        let p = SessionParams { dtype: Precision::Bf16, ..SessionParams::default() };
        let needs = engine_memory(&p, &c, true).unwrap();
        let arena: u64 = needs.iter().filter(|n| n.what.starts_with("engine arena")).map(|n| n.bytes).sum();
        let shape = c.batch_shape().unwrap();
        let l = crate::engine::layout::Layout::new(&c.model, shape.rows, shape.seq_len);
        assert_eq!(arena, (4 * l.len() - 2 * l.half.len + 2 * l.params.len) as u64);
        assert!(needs.iter().any(|n| n.what == "engine arena: weights' bf16 copy" && !n.transient));
        // A model the engine's check refuses (here the model's own check, which it runs first)
        // is refused, naming the key.
        c.model.num_kv_heads = 3;
        let e = engine_memory(&SessionParams::default(), &c, false).unwrap_err().to_string();
        assert!(e.contains("`model.num_kv_heads`"), "{e}");
    }

    /// On a GPU, document attention runs on flash kernels (flash_mma's document entry points):
    /// it stores no scores, unlike the materialised attention, whose scores count.
    #[test]
    fn document_attention_on_a_gpu_stores_no_attention_scores() {
        let mut c = Config::default();
        c.run.device = "cuda:0".into();
        let p = SessionParams { dtype: Precision::Bf16, ..SessionParams::default() };
        let acts = |p: &SessionParams, c: &Config| {
            memory(p, c).unwrap().into_iter().find(|n| n.what == "activations of one micro-batch").unwrap().bytes
        };
        let flash = acts(&p, &c);
        c.model.document_attention = true;
        assert_eq!(acts(&p, &c), flash);
        let p_mat = SessionParams { attention: Attention::Materialized, ..p.clone() };
        assert!(acts(&p_mat, &c) > flash, "the materialised attention's scores count");
    }

    /// Every new `[train]` key out of range is refused with an error naming it; the defaults
    /// and the record's values pass.
    #[test]
    fn bad_training_element_keys_are_named() {
        check_train(&TrainConfig::default()).unwrap();
        let record = crate::train::config::record_train();
        check_train(&record).unwrap();
        // Without a cap the reserve takes nothing off, and is not refused.
        check_train(&TrainConfig { max_wallclock_seconds: 0.0, gptq_reserve_seconds: 12.0, ..TrainConfig::default() }).unwrap();
        let polar = TrainConfig { muon_ns: crate::optim::NewtonSchulz::PolarExpress, ..record.clone() };
        check_train(&polar).unwrap();
        let bad: [(&str, TrainConfig); 12] = [
            ("train.muon_backend_steps", TrainConfig { muon_backend_steps: 6, ..polar.clone() }),
            ("train.warmdown_frac", TrainConfig { warmdown_frac: 1.5, ..record.clone() }),
            ("train.warmdown_frac", TrainConfig { warmdown_frac: -0.1, ..record.clone() }),
            ("train.warmdown_frac", TrainConfig { warmdown_frac: f64::NAN, ..record.clone() }),
            ("train.min_lr", TrainConfig { min_lr: 2.0, ..record.clone() }),
            ("train.muon_weight_decay", TrainConfig { muon_weight_decay: -0.01, ..record.clone() }),
            ("train.embed_weight_decay", TrainConfig { embed_weight_decay: f64::INFINITY, ..record.clone() }),
            ("train.scalar_weight_decay", TrainConfig { scalar_weight_decay: -1.0, ..record.clone() }),
            ("train.head_weight_decay", TrainConfig { head_weight_decay: f64::NAN, ..record.clone() }),
            ("train.gptq_reserve_seconds", TrainConfig { gptq_reserve_seconds: -1.0, ..record.clone() }),
            ("train.gptq_reserve_seconds", TrainConfig { gptq_reserve_seconds: 600.0, ..record.clone() }),
            ("train.gptq_reserve_seconds", TrainConfig { gptq_reserve_seconds: 700.0, ..record.clone() }),
        ];
        for (key, t) in bad {
            let e = check_train(&t).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{key}: {e}");
        }
    }
}
