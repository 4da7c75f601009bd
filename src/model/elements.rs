//! The table of model elements: every switch of `[model]` that the records turn on or change,
//! with the keys it reads and how to turn it on alone. It is where a new element plugs in:
//! add a row here, read its keys in the candle model (`model::{block, attention, mlp, gpt}`),
//! and implement it in the engine (or refuse it there, naming the key, in
//! `engine::support`). One test per executor pair walks the table: each element alone on the
//! baseline at a small width, engine against candle in f64, loss and every gradient
//! (`engine::tests::every_model_element_alone_matches_candle_in_f64`); another requires every
//! `[model]` key to be named by an element or by [`SHAPE_KEYS`], so a new key without a row
//! fails a test.

#[cfg(feature = "tools")]
use super::config::{Init, MlpActivation, ModelConfig};

/// One model element: a switch of `[model]` (or a value the records change).
#[derive(Clone, Copy, Debug)]
#[cfg(feature = "tools")]
pub struct Element {
    /// The element as the records and the docs name it.
    pub name: &'static str,
    /// The `[model]` keys it reads.
    pub keys: &'static [&'static str],
    /// The record that brought it (`"baseline"`: a value of the baseline's the records keep).
    pub since: &'static str,
    /// Whether the engine's forward pass runs it a step at a time from the looping switch
    /// (depth recurrence): the comparison then runs looped.
    pub looped: bool,
    /// Whether the explicit engine implements it (else its support check refuses it, naming
    /// one of `keys`; the element test checks either).
    pub engine: bool,
    /// Turns the element on in `cfg` (a small baseline), at the record's value where it fits a
    /// small model, leaving every other key alone.
    pub enable: fn(&mut ModelConfig),
}

/// The `[model]` keys that size the model rather than switch an element on.
#[cfg(feature = "tools")]
pub const SHAPE_KEYS: [&str; 5] = ["vocab_size", "num_layers", "model_dim", "num_heads", "mlp_mult"];

/// Every model element, in the order the record spec lists them.
#[cfg(feature = "tools")]
pub const ELEMENTS: &[Element] = &[
    Element {
        name: "grouped-query attention",
        keys: &["num_kv_heads"],
        since: "baseline",
        looped: false,
        engine: true,
        enable: |c| c.num_kv_heads = 1,
    },
    Element {
        name: "untied output head",
        keys: &["tie_embeddings"],
        since: "baseline",
        looped: false,
        engine: true,
        enable: |c| c.tie_embeddings = false,
    },
    Element {
        name: "logit soft-cap",
        keys: &["logit_softcap"],
        since: "baseline",
        looped: false,
        engine: true,
        enable: |c| c.logit_softcap = 15.0,
    },
    Element { name: "QK gain", keys: &["qk_gain_init"], since: "04-09", looped: false, engine: true, enable: |c| c.qk_gain_init = 5.25 },
    Element {
        name: "LeakyReLU²",
        keys: &["mlp_activation", "leaky_relu_slope"],
        since: "04-09",
        looped: false,
        engine: true,
        enable: |c| {
            c.mlp_activation = MlpActivation::LeakyRelu2;
            // Not the record's 0.5, which is the default: an engine that hard-coded it would pass.
            c.leaky_relu_slope = 0.3;
        },
    },
    Element { name: "LN scale", keys: &["ln_scale"], since: "04-09", looped: false, engine: true, enable: |c| c.ln_scale = true },
    Element {
        name: "parallel residuals",
        keys: &["parallel_residual_start"],
        since: "04-09",
        looped: false,
        engine: true,
        enable: |c| c.parallel_residual_start = Some(c.num_layers / 2),
    },
    Element { name: "skip gates", keys: &["skip_gates"], since: "04-09", looped: false, engine: true, enable: |c| c.skip_gates = true },
    Element {
        name: "partial RoPE",
        keys: &["rope_dims"],
        since: "04-09",
        looped: false,
        engine: true,
        enable: |c| c.rope_dims = Some((c.head_dim() / 4).max(2) / 2 * 2),
    },
    Element {
        name: "NTK RoPE rescale",
        keys: &["rope_train_seq_len", "rope_base"],
        since: "04-09",
        // Shorter than the comparison's sequences, so that the base is rescaled.
        looped: false,
        engine: true,
        enable: |c| {
            c.rope_train_seq_len = Some(4);
            c.rope_base = 20_000.0;
        },
    },
    Element {
        name: "XSA",
        keys: &["xsa_last_n"],
        since: "04-09",
        looped: false,
        engine: true,
        enable: |c| c.xsa_last_n = c.num_layers / 2,
    },
    Element {
        name: "depth recurrence",
        keys: &["loop_start", "loop_end", "num_loops", "enable_looping_at"],
        since: "04-09",
        looped: true,
        engine: true,
        enable: |c| {
            c.loop_start = 1;
            c.loop_end = c.num_layers.saturating_sub(2).max(1);
            c.num_loops = 2;
            c.enable_looping_at = 0.35;
        },
    },
    Element {
        name: "initialisation",
        // Candle makes the initial weights; the engine loads them, whatever made them.
        keys: &["init", "tied_embed_init_std"],
        since: "04-09",
        looped: false,
        engine: true,
        enable: |c| {
            c.init = Init::Orthogonal;
            c.tied_embed_init_std = 0.02;
        },
    },
    Element {
        name: "BigramHash",
        keys: &["bigram_vocab_size", "bigram_dim"],
        since: "03-20",
        looped: false,
        engine: true,
        enable: |c| {
            // Fewer buckets than ids, so that pairs collide; a table narrower than the model,
            // so that the projection runs.
            c.bigram_vocab_size = (c.vocab_size / 2).max(2);
            c.bigram_dim = (c.model_dim / 2).max(1);
        },
    },
    Element {
        name: "SmearGate",
        keys: &["smear_gate", "smear_gate_window"],
        since: "04-27",
        looped: false,
        engine: true,
        enable: |c| {
            c.smear_gate = true;
            c.smear_gate_window = (c.model_dim / 4).max(1);
        },
    },
    Element {
        name: "document-masked attention",
        keys: &["document_attention", "bos_id", "document_max_len"],
        since: "04-27",
        looped: false,
        engine: true,
        enable: |c| {
            c.document_attention = true;
            // A token the comparison's random batches hold, so that rows split.
            c.bos_id = 3;
            // Documents cut in pieces of 2, as the record's packed rows at TRAIN_SEQ_LEN (the
            // 04-27 elements' test runs them whole).
            c.document_max_len = 2;
        },
    },
    Element {
        name: "sparse attention gate",
        keys: &["attn_gate", "attn_gate_window", "attn_gate_init_std", "attn_gate_scale"],
        since: "04-27",
        looped: false,
        engine: true,
        enable: |c| {
            c.attn_gate = true;
            c.attn_gate_window = (c.model_dim / 4).max(1);
            // Drawn, so that the gates differ between heads (the record's zeros give 0.5 on all).
            c.attn_gate_init_std = 0.5;
            c.attn_gate_scale = 0.5;
        },
    },
    Element {
        name: "two-lane parallel decoder",
        keys: &["parallel_decoder_start", "parallel_final_lane"],
        since: "04-27",
        looped: false,
        engine: true,
        enable: |c| {
            // Two lane blocks or more, so that lane 1 reaches lane 0 (and the loss) through the
            // second block's MLP term.
            c.parallel_decoder_start = Some((c.num_layers / 2).max(1));
            c.parallel_final_lane = super::config::FinalLane::Attn;
        },
    },
];

/// The element named `name` (tests and the docs' table).
#[cfg(feature = "tools")]
pub fn element(name: &str) -> Option<&'static Element> {
    ELEMENTS.iter().find(|e| e.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[model]` keys: those of the record's config, whose optional keys are all set.
    fn model_keys() -> Vec<String> {
        // Every optional key set (the two forms of parallel blocks are never set together in a
        // run; only the names matter here).
        let r = ModelConfig { parallel_decoder_start: Some(8), ..ModelConfig::record() };
        assert!(r.parallel_residual_start.is_some() && r.rope_dims.is_some() && r.rope_train_seq_len.is_some());
        match serde_json::to_value(&r).unwrap() {
            serde_json::Value::Object(m) => m.keys().cloned().collect(),
            v => panic!("ModelConfig serialises to {v}"),
        }
    }

    /// Every `[model]` key is a shape key or an element's, exactly once; every element's keys
    /// exist.
    #[test]
    fn every_model_key_belongs_to_one_element_or_the_shape() {
        let keys = model_keys();
        for k in &keys {
            let owners: Vec<&str> = ELEMENTS.iter().filter(|e| e.keys.contains(&k.as_str())).map(|e| e.name).collect();
            let shape = SHAPE_KEYS.contains(&k.as_str());
            assert!(
                owners.len() + shape as usize == 1,
                "`model.{k}`: named by {owners:?}{}; add it to model::ELEMENTS (or SHAPE_KEYS) exactly once",
                if shape { " and SHAPE_KEYS" } else { "" }
            );
        }
        for e in ELEMENTS {
            for k in e.keys {
                assert!(keys.iter().any(|m| m == k), "{}: `model.{k}` is not a [model] key", e.name);
            }
        }
    }

    /// Each element's switch gives a valid config that differs from the baseline in every one of
    /// its keys and nowhere else.
    #[test]
    fn each_element_changes_its_keys_and_only_them() {
        let base = ModelConfig { vocab_size: 48, num_layers: 4, model_dim: 32, num_heads: 4, num_kv_heads: 2, ..ModelConfig::default() };
        for e in ELEMENTS {
            let mut c = base.clone();
            (e.enable)(&mut c);
            c.check().unwrap_or_else(|err| panic!("{}: {err:#}", e.name));
            let changed: Vec<String> = base.differences(&c).into_iter().map(|(k, _, _)| k).collect();
            for k in &changed {
                assert!(e.keys.iter().any(|ek| k.trim_start_matches("model.") == *ek), "{}: changes `{k}`, not one of its keys", e.name);
            }
            // Every key moves off its default, so that an executor ignoring one shows.
            for k in e.keys {
                assert!(changed.iter().any(|c| c.trim_start_matches("model.") == *k), "{}: leaves `model.{k}` at its default", e.name);
            }
            assert!(element(e.name).is_some());
        }
    }
}
