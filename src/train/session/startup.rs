//! The session's opening log lines, in the challenge script's formats (and the record's where
//! it adds elements), and the lines it logs when depth recurrence switches on.

use crate::data::batch::BatchShape;
use crate::eval::validation::Validator;
use crate::train::config::Config;
use crate::train::executor::Executor;
use crate::train::log::{TrainLog, training_elements_line};

/// The record's model elements that are on (`model_elements: ...`), or none for the baseline's
/// model (whose log stays the challenge script's).
fn model_elements_line(m: &crate::model::ModelConfig) -> Option<String> {
    let mut on = Vec::new();
    if m.mlp_activation == crate::model::MlpActivation::LeakyRelu2 {
        on.push(format!("mlp:leaky_relu2({})", m.leaky_relu_slope));
    }
    if let Some(r) = m.rope_dims {
        on.push(format!("rope_dims:{r}/{}", m.head_dim()));
    }
    if let Some(l) = m.rope_train_seq_len {
        on.push(format!("rope_train_seq_len:{l}"));
    }
    if m.ln_scale {
        on.push("ln_scale".into());
    }
    if m.xsa_last_n > 0 {
        on.push(format!("xsa_last_n:{}", m.xsa_last_n));
    }
    if m.skip_gates {
        on.push("skip_gates".into());
    }
    if let Some(p) = m.parallel_residual_start {
        on.push(format!("parallel_residual_start:{p}"));
    }
    if m.init == crate::model::Init::Orthogonal {
        on.push("init:orthogonal".into());
    }
    if m.smear_gate {
        // The BOS fix is part of the element: the log says which token it masks.
        on.push(format!("smear_gate:window{} bos_masked:{}", m.smear_gate_window, m.bos_id));
    }
    if m.document_attention {
        on.push(format!("document_attention:bos{}", m.bos_id));
    }
    if m.attn_gate {
        on.push(format!("attn_gate:window{} scale:{} init_std:{}", m.attn_gate_window, m.attn_gate_scale, m.attn_gate_init_std));
    }
    if let Some(p) = m.lanes_from() {
        on.push(format!(
            "parallel_decoder_start:{p} final_lane:{}",
            serde_json::to_value(m.parallel_final_lane).unwrap_or_default().as_str().unwrap_or("?")
        ));
    }
    (!on.is_empty()).then(|| format!("model_elements: {}", on.join(" ")))
}

/// `layer_loop:enabled step:<s> frac:<f> encoder:[...] decoder:[...]`, as the record logs it.
pub(super) fn looping_line(cfg: &crate::model::ModelConfig, step: u64, frac: f64) -> String {
    let (enc, dec) = cfg.encoder_decoder(true);
    format!("layer_loop:enabled step:{step} frac:{frac:.3} encoder:{enc:?} decoder:{dec:?}")
}

pub(super) fn startup_lines(
    log: &mut TrainLog,
    c: &Config,
    trainer: &dyn Executor,
    v: &Validator,
    shape: BatchShape,
    unigram: Option<f64>,
) {
    let t = &c.train;
    let m = &c.model;
    let tok = c.data.tokenizer.as_deref().map(|p| p.display().to_string()).unwrap_or_default();
    log.line(&format!("val_bpb:enabled tokenizer_kind=sentencepiece tokenizer_path={tok}"));
    if let Some(g) = &c.data.train {
        let n = crate::data::shard::glob_sorted(g).map(|v| v.len()).unwrap_or(0);
        let dir =
            std::path::Path::new(g).parent().and_then(|p| p.file_name()).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        log.line(&format!("train_loader:dataset:{dir} train_shards:{n}"));
    }
    let cap = if v.targets() < v.split_targets() {
        format!(" scored:{} (train.val_max_tokens = {})", v.targets(), t.val_max_tokens)
    } else {
        String::new()
    };
    log.line(&format!("val_loader:shards pattern={} tokens:{}{cap}", v.pattern(), v.split_targets()));
    log.line(&format!("model_params:{}", trainer.model().param_count()));
    for line in trainer.startup_lines() {
        log.line(&line);
    }
    log.line(&format!("world_size:{} grad_accum_steps:{}", shape.world_size, shape.micro_steps));
    log.line(&format!("attention_mode:gqa num_heads:{} num_kv_heads:{}", m.num_heads, m.num_kv_heads));
    if let Some(line) = model_elements_line(m) {
        log.line(&line);
    }
    if m.recurrent() {
        let (enc, dec) = m.encoder_decoder(false);
        log.line(&format!(
            "layer_loop:blocks {}..={} x{} from training fraction {} unlooped encoder:{enc:?} decoder:{dec:?}",
            m.loop_start,
            m.loop_end,
            m.num_loops + 1,
            m.enable_looping_at
        ));
        if trainer.model().looping() && trainer.step() == 0 {
            log.line(&looping_line(m, 0, 0.0));
        } else if trainer.model().looping() {
            let (enc, dec) = m.encoder_decoder(true);
            log.line(&format!("layer_loop:enabled (the checkpoint's layout) encoder:{enc:?} decoder:{dec:?}"));
        }
    }
    let (embed_lr, head_lr) = if m.tie_embeddings { (t.tied_embed_lr, 0.0) } else { (t.embed_lr, t.head_lr) };
    log.line(&format!(
        "tie_embeddings:{} embed_lr:{embed_lr} head_lr:{head_lr} matrix_lr:{} scalar_lr:{}",
        if m.tie_embeddings { "True" } else { "False" },
        t.matrix_lr,
        t.scalar_lr
    ));
    // The record's keys only when set, so that the baseline's lines stay the script's.
    let reserve =
        if t.gptq_reserve_seconds != 0.0 { format!(" gptq_reserve_seconds:{:.3}", t.gptq_reserve_seconds) } else { String::new() };
    log.line(&format!(
        "train_batch_tokens:{} train_seq_len:{} iterations:{} warmup_steps:0 max_wallclock_seconds:{:.3}{reserve}",
        t.batch_tokens, t.seq_len, t.iterations, t.max_wallclock_seconds
    ));
    if let Some(line) = training_elements_line(t) {
        log.line(&line);
    }
    log.line(&format!("seed:{}", c.run.seed));
    if let Some(u) = unigram {
        log.line(&format!("val_unigram_bpb:{u:.4} (token frequencies of the training shards: the bar to beat)"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 04-27 elements are logged, the smear with the token its BOS fix masks; the baseline
    /// logs none.
    #[test]
    fn the_04_27_elements_are_logged() {
        assert_eq!(model_elements_line(&crate::model::ModelConfig::default()), None);
        let m = crate::model::ModelConfig {
            smear_gate: true,
            document_attention: true,
            attn_gate: true,
            attn_gate_scale: 0.5,
            parallel_decoder_start: Some(8),
            ..crate::model::ModelConfig::default()
        };
        let line = model_elements_line(&m).unwrap();
        assert!(line.contains("smear_gate:window12 bos_masked:1"), "{line}");
        assert!(line.contains("document_attention:bos1"), "{line}");
        assert!(line.contains("attn_gate:window12 scale:0.5 init_std:0"), "{line}");
        assert!(line.contains("parallel_decoder_start:8 final_lane:mean"), "{line}");
        let off = crate::model::ModelConfig { parallel_decoder_start: Some(0), ..crate::model::ModelConfig::default() };
        assert_eq!(model_elements_line(&off), None, "0: one stream");
    }
}
