//! Phased TTT on real text (record spec §5): the documents found in a challenge-format
//! validation shard are the documents that were written into it, and their targets are the
//! sliding evaluation's, each once; `ttt_eval/phased` through the binary logs and reports as
//! the records do.

mod common;

use common::report;
use common::tiny::*;
use pipeline::data::tokenizer::Tokenizer;
use pipeline::eval::bpb::validation_tokens;
use pipeline::eval::phased::docs::{chunks, segment, work_queue};

/// The tiny corpus's val shard (every tenth paragraph of the repository's prose, each written as
/// BOS + its ids), loaded as the evaluation loads it: each document found decodes to the
/// paragraph written there, in order, and the documents' targets are the stream's, each once.
#[test]
fn documents_of_a_real_shard_are_the_written_ones_and_tile_the_targets() {
    let c = corpus("phased-docs");
    let tok = Tokenizer::load(&c.tokenizer).unwrap();
    let written: Vec<String> = documents().into_iter().enumerate().filter(|(i, _)| i % 10 == 5).map(|(_, d)| d).collect();
    let shard = shard_tokens(&c.dir.join("shards/fineweb_val_000000.bin"));
    // As the evaluation loads it: whole sequences of 64 targets.
    let tokens: Vec<u32> = validation_tokens(&shard, 64).iter().map(|&t| t as u32).collect();
    let n_targets = tokens.len() - 1;
    let docs = segment(&tokens, tok.bos);
    assert_eq!(docs.iter().map(|d| d.pred_len()).sum::<usize>(), n_targets, "every target once");
    let mut next = 0;
    for d in &docs {
        assert_eq!(d.start, next, "documents in stream order, back to back");
        next = d.start + d.pred_len();
    }
    // Every document but the last (cut by the truncation) is a written paragraph, whole, its
    // span ending on the next BOS.
    assert!(docs.len() >= 5, "{} documents", docs.len());
    for (k, d) in docs[..docs.len() - 1].iter().enumerate() {
        let span = &tokens[d.start..d.start + d.len];
        assert_eq!((span[0], span[span.len() - 1]), (tok.bos, tok.bos));
        // As the tokenizer gives the text back (its NFKC normalisation turns `ᵀ` into `T`, ...).
        let want = tok.decode(&tok.encode(&written[k]).unwrap()).unwrap();
        assert_eq!(tok.decode(&span[1..span.len() - 1]).unwrap(), want, "document {k}");
    }
    // Every document's chunks score its targets once, from windows inside the document.
    for d in &docs {
        let cs = chunks(d.pred_len(), 48, 2048);
        assert_eq!(cs.iter().map(|c| c.scored.len()).sum::<usize>(), d.pred_len());
        assert!(cs.iter().all(|c| c.window.end <= d.pred_len()));
    }
    // The queue holds every document once, longest batch first.
    let q = work_queue(&docs, 4);
    let mut all: Vec<usize> = q.iter().flat_map(|b| b.docs.clone()).collect();
    all.sort_unstable();
    assert_eq!(all, (0..docs.len()).collect::<Vec<_>>());
    assert!(q.windows(2).all(|w| w[0].longest >= w[1].longest));
}

/// `ttt_eval/phased` after a short training run: the records' lines in train.log (`ttp:` per
/// batch, `ttpp:` per phase, `quantized_ttt_phased val_loss:… val_bpb:… eval_time:…ms`), and
/// in the report the score over the sliding pass's targets, the time split and both phases.
#[test]
fn phased_stage_logs_and_reports_like_the_records() {
    let c = corpus("phased-stage");
    let cfg = config_plus(&c, "phased", &after_training_phased());
    let out = c.dir.join("out");
    train_ok(&cfg, &out, &["train.iterations=12"]);
    let r = report(&out);
    let ev = &r.sections["eval"];
    let (sl, tt) = (&ev["sliding"], &ev["ttt"]);
    assert_eq!(tt["kind"], "phased");
    let aside = "stages.eval: `batch_seqs`, `chunk_tokens`, `epochs` taken by other ttt_eval implementations, not by `phased`: set aside";
    assert!(r.run.notes.iter().any(|n| n == aside), "{:?}", r.run.notes);
    assert_eq!(sl["val_tokens"], tt["val_tokens"], "phased TTT scores every target the sliding pass scores, once");
    assert_ne!(sl["val_bpb"], tt["val_bpb"]);
    let phases = tt["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2, "{tt}");
    assert_eq!((phases[0]["documents"].as_u64(), phases[1]["documents"].as_u64()), (Some(2), Some(4)));
    assert!(phases.iter().all(|p| p["steps"].as_u64().unwrap() > 0), "{tt}");
    for k in ["score_ms", "adapt_ms", "global_ms"] {
        assert!(tt[k].as_f64().unwrap() > 0.0, "{k}: {tt}");
    }
    for h in ["doc_batch", "global_sgd", "sliding"] {
        assert!(r.stages["eval"].extra_us.get(h).is_some_and(|x| x.count > 0), "no `{h}` histogram");
    }
    let log = std::fs::read_to_string(out.join("train.log")).unwrap();
    let batches = tt["batches"].as_u64().unwrap();
    assert_eq!(log.lines().filter(|l| l.starts_with("ttp: b")).count() as u64, batches, "{log}");
    assert!(log.contains(&format!("ttp: b{batches}/{batches} ")) && log.contains(" gd:1"), "{log}");
    assert!(log.lines().any(|l| l.starts_with("ttpp: phase 2/2 done: 4 documents")), "{log}");
    let line = log.lines().find(|l| l.starts_with("quantized_ttt_phased val_loss:")).unwrap_or_else(|| panic!("{log}"));
    let bpb: f64 = line.split(' ').nth(2).unwrap().strip_prefix("val_bpb:").unwrap().parse().unwrap();
    assert!((bpb - tt["val_bpb"].as_f64().unwrap()).abs() < 1e-7, "{line}");
}
