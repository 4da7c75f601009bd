//! Tests of [`super`]: every `ttt_eval` implementation has an audit, the three real ones pass it
//! on a tiny model with and without document attention, and two deliberately leaky
//! evaluations (TTT that trains on a chunk before scoring it; rows scored without the document
//! mask the model claims) are caught at the right position.

use super::*;
use crate::eval::audit::Leak;
use crate::eval::candle_model::CandleModel;
use crate::eval::executor::EvalModel;
use crate::eval::ttt::{TttConfig, train_sequences};
use crate::model::Gpt;

const BOS: u32 = 1;
const VOCAB: usize = crate::eval::ttt::tests::VOCAB;

/// A tiny model (vocabulary 32, BOS 1) with `train.seq_len` 16; `docs` sets
/// `document_attention`.
fn config(docs: bool) -> Config {
    let model = crate::eval::audit::tests::tiny_config(docs);
    let train = crate::train::config::TrainConfig { seq_len: 16, ..Default::default() };
    Config { model, train, ..Config::default() }
}

/// Weights of `config`'s model with every parameter moved off its initial value, so that
/// attention (and so the context) matters.
fn weights(c: &Config) -> Vec<(String, Tensor)> {
    let m = Gpt::new(&c.model, 3, DType::F32, &Device::Cpu).unwrap();
    let mut rng = fastrand::Rng::with_seed(17);
    m.state_dict()
        .into_iter()
        .map(|(n, t)| {
            let noise: Vec<f32> = (0..t.elem_count()).map(|_| rng.f32() * 0.6 - 0.3).collect();
            let noise = Tensor::from_vec(noise, t.dims(), &Device::Cpu).unwrap();
            (n, (t + noise).unwrap())
        })
        .collect()
}

/// Documents of 5 to 24 tokens (a BOS, then ids 2..32), `n + 1` tokens in all.
fn tokens(n: usize) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(5);
    let mut out = Vec::new();
    while out.len() <= n {
        out.push(BOS);
        out.extend((0..rng.usize(4..24)).map(|_| rng.u32(2..VOCAB as u32)));
    }
    out.truncate(n + 1);
    out
}

/// Runs `entry` on `config` with `params` over 240 targets.
fn audit(entry: &Audited, config: &Config, params: &toml::Table) -> AuditReport {
    let w = weights(config);
    let t = tokens(240);
    let setup = Setup {
        config,
        params,
        seed: 9,
        weights: &w,
        tables: Arc::new(crate::eval::ttt::tests::tables().as_ref().clone().recording()),
        tokens: &t,
        bos: BOS,
    };
    audit_stage(entry, "eval", &setup, "test weights").unwrap()
}

/// The settings the tests give each implementation: small windows, chunks and adapters.
fn params(name: &str) -> toml::Table {
    let text = match name {
        "sliding" => "stride = 8\nbatch_windows = 4",
        "score_first" => "stride = 8\nbatch_windows = 4\nepochs = 1\nbatch_seqs = 4\nlr = 0.05",
        "phased" => {
            "lora_rank = 2\nlora_lr = 0.01\nchunk = 4\ncontext = 16\nbatch_docs = 64\nprefix_docs = 2000\nphases = 2\nglobal_chunk_tokens = 32"
        }
        _ => "",
    };
    toml::from_str(text).unwrap()
}

#[test]
fn every_ttt_eval_implementation_has_an_audit() {
    let impls: Vec<&str> = crate::stages::REGISTRY.impls("ttt_eval").iter().map(|f| f.name()).collect();
    assert!(impls.len() >= 3, "{impls:?}");
    for name in &impls {
        assert!(AUDITED.iter().any(|a| a.name == *name), "ttt_eval/{name} has no entry in AUDITED: add its builder");
    }
    for a in AUDITED {
        assert!(impls.contains(&a.name), "AUDITED names `{}`, which is no ttt_eval implementation", a.name);
    }
}

/// Every registered implementation passes on its own settings; the short prefix makes
/// score-first's chunks and phased's batches and pause smaller, and the report says so.
#[test]
fn the_real_evaluations_pass_with_and_without_document_attention() {
    for docs in [false, true] {
        let c = config(docs);
        for entry in AUDITED {
            let r = audit(entry, &c, &params(entry.name));
            let text = r.lines().join("\n");
            assert!(r.passed(), "{} (document_attention {docs}):\n{text}", entry.name);
            assert!(r.causality.targets_compared > 0 && r.causality.own_change > 0.0, "{text}");
            assert_eq!(r.tokens, 240);
            assert!(text.ends_with("verdict: PASS"), "{text}");
            match (&r.documents, docs) {
                (DocumentsAudit::Checked(d), true) => assert!(d.passed && d.targets_compared >= 2, "{text}"),
                (DocumentsAudit::NotApplicable { reason }, false) => assert!(reason.contains("document_attention"), "{text}"),
                (d, _) => panic!("document_attention {docs}: {d:?}"),
            }
            let keys: Vec<&str> = r.adjusted.iter().map(|a| a.key.as_str()).collect();
            let want: &[&str] = match entry.name {
                "score_first" => &["chunk_tokens"],
                "phased" => &["batch_docs", "prefix_docs"],
                _ => &[],
            };
            assert_eq!(keys, want, "{text}");
            assert!(r.adjusted.iter().all(|a| text.contains(&format!("adjusted: {} {} -> {}", a.key, a.from, a.to))), "{text}");
        }
    }
}

/// The chunk length the leaky evaluation uses, and its settings.
const LEAKY_CHUNK: usize = 64;

fn leaky_cfg() -> TttConfig {
    let sliding = crate::eval::ttt::SlidingConfig { seq_len: 16, stride: 8, batch_windows: 4 };
    TttConfig { sliding, chunk_tokens: LEAKY_CHUNK, lr: 0.05, momentum: 0.9, epochs: 1, batch_seqs: 4, grad_clip: 1.0 }
}

/// Score-first TTT in the wrong order: each chunk is trained on, then scored (its targets read
/// from a recording sliding pass over the stream with the weights of that moment).
fn train_first<'a>(s: &Setup<'a>) -> anyhow::Result<Built<'a>> {
    let (config, weights, tables) = (s.config, s.weights, s.tables.clone());
    let scorer: Scorer<'a> = Box::new(move |tokens| {
        let cfg = leaky_cfg();
        let mut model = CandleModel::new(model_from(config, weights)?);
        model.reset_sgd(cfg.momentum)?;
        let n = tokens.len() - 1;
        let mut out = Vec::new();
        for start in (0..n).step_by(cfg.chunk_tokens) {
            let end = (start + cfg.chunk_tokens).min(n);
            let seqs = (end - start) / cfg.sliding.seq_len;
            train_sequences(&mut model, tokens, start, seqs, &cfg.training(), cfg.lr, &Single, &|| true)?;
            let acc = sliding_eval(&mut model, tokens, tables.clone(), &cfg.sliding, || true)?.context("stopped")?;
            out.extend(acc.recorded()?.iter().filter(|(j, _)| (start..end).contains(j)));
        }
        Ok(out)
    });
    let rules = PositionRules { bos: Some(s.bos), stream_chunk: Some(LEAKY_CHUNK), doc_chunk: None };
    Ok(Built { scorer, rows: masked_rows(s), row_len: 16, adjusted: Vec::new(), rules, order: Order::Stream })
}

/// Training on the chunk that holds the changed token before scoring it moves that chunk's
/// scores: the first leaked target is the chunk's first, and the report names it.
#[test]
fn training_before_scoring_is_caught_at_the_first_target_of_the_changed_chunk() {
    let entry = Audited { name: "train_first", build: train_first };
    let r = audit(&entry, &config(false), &toml::Table::new());
    assert!(!r.passed());
    let p = r.causality.position;
    let first = (p - 1) / LEAKY_CHUNK * LEAKY_CHUNK;
    assert!(first > 0 && first < p - 1, "p {p}: the changed chunk is not the first, and p - 1 is inside it");
    let leak: &Leak = r.causality.leak.as_ref().unwrap();
    assert_eq!((leak.target, leak.token), (first, first + 1), "{:?}", r.causality);
    let text = r.lines().join("\n");
    assert!(text.contains(&format!("causality: FAIL: target {first} (scoring token {})", first + 1)), "{text}");
    assert!(text.ends_with("verdict: FAIL"), "{text}");
}

/// Rows scored by the same weights without the document mask, while `[model]` claims
/// `document_attention`: the second document's first target (the BOS's) moves.
fn unmasked<'a>(s: &Setup<'a>) -> anyhow::Result<Built<'a>> {
    let mut built = sliding(s)?;
    let mut plain = s.config.clone();
    plain.model.document_attention = false;
    let weights = s.weights;
    built.rows = Box::new(move |x, y| {
        let model = model_from(&plain, weights)?;
        let xt = Tensor::from_slice(x, (1, x.len()), &Device::Cpu)?;
        let yt = Tensor::from_slice(y, (1, y.len()), &Device::Cpu)?;
        Ok(model.eval_token_losses(&xt, &yt)?.to_dtype(DType::F32)?.to_vec1()?)
    });
    Ok(built)
}

#[test]
fn rows_that_ignore_the_claimed_document_mask_are_caught_at_the_bos() {
    let entry = Audited { name: "unmasked", build: unmasked };
    let r = audit(&entry, &config(true), &params("sliding"));
    assert!(r.causality.passed, "the scores themselves are causal: {:?}", r.causality);
    let DocumentsAudit::Checked(d) = &r.documents else { panic!("{:?}", r.documents) };
    let leak = d.leak.as_ref().unwrap();
    assert_eq!((leak.target, leak.token), (d.bos_position, d.bos_position + 1), "{d:?}");
    assert!(!r.passed());
    let text = r.lines().join("\n");
    assert!(text.contains(&format!("documents: FAIL: target {}", d.bos_position)), "{text}");
}

/// A device-summed score keeps no per-target losses: the audit errors, naming `add_sum`.
fn summed<'a>(s: &Setup<'a>) -> anyhow::Result<Built<'a>> {
    let mut built = sliding(s)?;
    let tables = s.tables.clone();
    built.scorer = Box::new(move |tokens| {
        let mut acc = crate::eval::bpb::BpbAccumulator::new(tables.clone());
        let n = tokens.len() - 1;
        acc.add_sum(0, &tokens[..n], &tokens[1..], 1.0);
        Ok(acc.recorded()?.to_vec())
    });
    Ok(built)
}

#[test]
fn an_evaluation_without_per_target_losses_fails_the_audit() {
    let c = config(false);
    let w = weights(&c);
    let t = tokens(240);
    let p = params("sliding");
    let tables = Arc::new(crate::eval::ttt::tests::tables().as_ref().clone().recording());
    let setup = Setup { config: &c, params: &p, seed: 9, weights: &w, tables, tokens: &t, bos: BOS };
    let e = format!("{:#}", audit_stage(&Audited { name: "summed", build: summed }, "eval", &setup, "w").unwrap_err());
    assert!(e.contains("stage `eval`") && e.contains("add_sum"), "{e}");
    // A prefix too short for three chunks of `seq_len` is refused, naming the key.
    let short = tokens(40);
    let setup = Setup { tokens: &short, ..setup };
    let entry = AUDITED.iter().find(|a| a.name == "score_first").unwrap();
    let e = format!("{:#}", audit_stage(entry, "eval", &Setup { params: &params("score_first"), ..setup }, "w").unwrap_err());
    assert!(e.contains("3 TTT chunks of at least `seq_len` (16)"), "{e}");
}
