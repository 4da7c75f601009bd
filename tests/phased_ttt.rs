//! Phased TTT on real text (record spec §5): the documents found in a challenge-format
//! validation shard are the documents that were written into it, and their targets are the
//! sliding evaluation's, each once.

mod common;

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
        assert_eq!(tok.decode(&span[1..span.len() - 1]).unwrap(), written[k], "document {k}");
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
