//! The geometry of phased TTT (record spec §5.2, §5.3, §5.4's chunk loop, §5.5's boundaries):
//! which documents the validation stream holds, in which batches and order they are taken,
//! which targets each chunk of a document scores with which context, and where the phases
//! pause. Pure functions of the token stream and the settings, so the legality conditions that
//! rest on them (every target scored exactly once; a chunk's context only its own document's
//! earlier tokens) are tested here without a model.
//!
//! **Targets** are numbered as in [`crate::eval::ttt`]: with `N + 1` tokens, target `i` is
//! `tokens[i + 1]`. A document's local target `j` is the stream's target `start + j`.

use std::ops::Range;

/// One document of the validation stream: its span runs from its BOS through the next
/// document's BOS inclusive (the last: to the end of the stream), so its last target is the next
/// document's BOS and the documents' targets tile the stream's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Document {
    /// Position of its first token (its BOS; 0 for text before the stream's first BOS).
    pub start: usize,
    /// Tokens in its span, the next BOS included (`pred_len + 1`).
    pub len: usize,
}

impl Document {
    /// Targets it scores: `len − 1`.
    pub fn pred_len(&self) -> usize {
        self.len - 1
    }

    /// Its targets as stream target indices.
    #[cfg(feature = "tools")]
    pub fn targets(&self) -> Range<usize> {
        self.start..self.start + self.pred_len()
    }
}

/// The documents of `tokens`, in stream order (spec §5.2): one starting at every `bos`, and one
/// at position 0 if the stream does not begin with BOS (so that no target goes unscored). A
/// trailing BOS with nothing after it makes no document. The documents' targets are exactly the
/// stream's `0 .. tokens.len() − 1`, each once.
pub fn segment(tokens: &[u32], bos: u32) -> Vec<Document> {
    if tokens.len() < 2 {
        return Vec::new();
    }
    let mut starts: Vec<usize> = tokens.iter().enumerate().filter(|&(_, &t)| t == bos).map(|(i, _)| i).collect();
    if starts.first() != Some(&0) {
        starts.insert(0, 0);
    }
    let last = tokens.len() - 1;
    starts
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            let end = starts.get(k + 1).map_or(last, |&next| next);
            Document { start: s, len: end - s + 1 }
        })
        .filter(|d| d.pred_len() > 0)
        .collect()
}

/// A batch of documents as the work queue holds it (spec §5.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Its index among the batches cut from the documents sorted by length (`orig_batch_idx`).
    pub index: usize,
    /// Its documents, indices into [`segment`]'s list, shortest first.
    pub docs: Vec<usize>,
    /// Tokens of its longest document.
    pub longest: usize,
}

/// The work queue (spec §5.3): documents sorted by length ascending (ties in stream order), cut
/// into batches of `batch_docs` consecutive documents, the batches taken longest document first
/// (ties by batch index). Panics if `batch_docs` is 0.
pub fn work_queue(docs: &[Document], batch_docs: usize) -> Vec<Batch> {
    assert!(batch_docs > 0, "work_queue: batch_docs must be positive");
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.sort_by_key(|&i| (docs[i].len, i));
    let mut batches: Vec<Batch> = order
        .chunks(batch_docs)
        .enumerate()
        .map(|(index, c)| Batch { index, docs: c.to_vec(), longest: c.iter().map(|&i| docs[i].len).max().unwrap_or(0) })
        .collect();
    batches.sort_by(|a, b| b.longest.cmp(&a.longest).then(a.index.cmp(&b.index)));
    batches
}

/// One chunk of a document's targets and the window that scores it (spec §5.4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Its index in the document.
    pub index: usize,
    /// The document's targets it scores (local: `0 .. pred_len`).
    pub scored: Range<usize>,
    /// The inputs the window feeds, local token positions `[ctx_start, scored.end)`: at most
    /// `context` tokens, all of this document, the last ones predicting the chunk's targets.
    pub window: Range<usize>,
    /// Whether it is the document's last chunk (scored, never trained on).
    pub last: bool,
}

/// The chunks of a document with `pred_len` targets (spec §5.4): chunk `c` scores local targets
/// `[chunk·c, min(chunk·(c+1), pred_len))` from a window of inputs ending at the chunk's end and
/// starting `context` tokens before it, or at the document's start. Panics if `chunk` or
/// `context` is 0, or `context < chunk` (a window must hold its chunk).
pub fn chunks(pred_len: usize, chunk: usize, context: usize) -> Vec<Chunk> {
    assert!(chunk > 0 && context >= chunk, "chunks: chunk {chunk} must be positive and at most the context {context}");
    let n = pred_len.div_ceil(chunk);
    (0..n)
        .map(|c| {
            let end = (chunk * (c + 1)).min(pred_len);
            Chunk { index: c, scored: chunk * c..end, window: end.saturating_sub(context)..end, last: c + 1 == n }
        })
        .collect()
}

/// Phase boundaries (spec §5.5): `⌊prefix_docs · k / phases⌋` for `k = 1 ..= phases`, in
/// documents scored; empty without phases.
pub fn phase_boundaries(prefix_docs: usize, phases: usize) -> Vec<usize> {
    (1..=phases).map(|k| prefix_docs * k / phases).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOS: u32 = 1;

    fn targets_once(tokens: &[u32], docs: &[Document]) {
        let mut seen = vec![0u8; tokens.len() - 1];
        for d in docs {
            for t in d.targets() {
                seen[t] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "{docs:?}: {seen:?}");
    }

    #[test]
    fn documents_tile_the_targets() {
        // BOS a b BOS c BOS d e f
        let tokens = [1, 5, 6, 1, 7, 1, 8, 9, 10];
        let docs = segment(&tokens, BOS);
        assert_eq!(docs, [Document { start: 0, len: 4 }, Document { start: 3, len: 3 }, Document { start: 5, len: 4 }]);
        // The first document's last target is the next BOS.
        assert_eq!(tokens[docs[0].targets().end], BOS);
        targets_once(&tokens, &docs);
        // Text before the first BOS is a document; a trailing BOS alone makes none.
        let tokens = [5, 6, 1, 7, 8, 1];
        let docs = segment(&tokens, BOS);
        assert_eq!(docs, [Document { start: 0, len: 3 }, Document { start: 2, len: 4 }]);
        targets_once(&tokens, &docs);
        assert!(segment(&[1], BOS).is_empty());
        assert_eq!(segment(&[1, 1, 1], BOS).iter().map(|d| d.pred_len()).collect::<Vec<_>>(), [1, 1]);
        // Random streams: the tiling holds.
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..200 {
            let n = rng.usize(2..300);
            let tokens: Vec<u32> = (0..n).map(|_| if rng.u8(..) < 20 { BOS } else { rng.u32(2..50) }).collect();
            targets_once(&tokens, &segment(&tokens, BOS));
        }
    }

    #[test]
    fn queue_sorts_batches_by_their_longest_document() {
        let lens = [5, 2, 9, 3, 3, 8, 2];
        let mut start = 0;
        let docs: Vec<Document> = lens
            .iter()
            .map(|&len| {
                let d = Document { start, len };
                start += len - 1;
                d
            })
            .collect();
        let q = work_queue(&docs, 3);
        // Ascending by length (ties in stream order): 1(2) 6(2) 3(3) | 4(3) 0(5) 5(8) | 2(9).
        assert_eq!(
            q.iter().map(|b| (b.index, b.docs.clone(), b.longest)).collect::<Vec<_>>(),
            [(2, vec![2], 9), (1, vec![4, 0, 5], 8), (0, vec![1, 6, 3], 3),]
        );
        let all: std::collections::BTreeSet<usize> = q.iter().flat_map(|b| b.docs.iter().copied()).collect();
        assert_eq!(all.len(), docs.len());
    }

    #[test]
    fn chunks_cover_a_document_once_with_bounded_context() {
        for pred_len in [1, 47, 48, 49, 96, 1000, 5000] {
            let cs = chunks(pred_len, 48, 2048);
            assert_eq!(cs.len(), pred_len.div_ceil(48));
            let mut next = 0;
            for c in &cs {
                assert_eq!(c.scored.start, next);
                next = c.scored.end;
                assert!(c.window.end == c.scored.end && c.window.len() <= 2048 && c.window.start <= c.scored.start);
                assert_eq!(c.last, c.index + 1 == cs.len());
            }
            assert_eq!(next, pred_len);
        }
        let cs = chunks(5000, 48, 2048);
        assert_eq!(cs[50].window, 400..2448);
        assert_eq!(cs[0].window, 0..48);
    }

    #[test]
    fn phase_boundaries_of_the_record() {
        assert_eq!(phase_boundaries(2000, 3), [666, 1333, 2000]);
        assert_eq!(phase_boundaries(2000, 1), [2000]);
        assert!(phase_boundaries(2000, 0).is_empty());
    }
}
