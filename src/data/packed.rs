//! The 04-27 record's document-packing loader (`DocumentPackingLoader` of its train_gpt.py) as
//! a [`Sampler`]: each micro-batch is one flat row of `n = batch_tokens / (world_size *
//! grad_accum_steps)` tokens, read straight through the shards, whose documents the model's
//! attention keeps apart (`model.document_attention`, cut every `model.document_max_len`
//! positions from a document's start as the record's `_build_cu_seqlens` cuts at
//! TRAIN_SEQ_LEN: [`crate::model::ops::DocumentMask`]).
//!
//! The order, as the record's loader has it:
//!
//! ```text
//! shards: every one, in sorted order, again from the first after the last (no shuffling)
//! cursor: at a shard's first BOS when the loader comes to it
//! micro-batch: span = n + 1 tokens per rank, world * span in all;
//!     while cursor + world * span > the shard's tokens: next shard (its rest is skipped)
//!     rank r reads tokens [cursor + r span, cursor + (r + 1) span):
//!         x = the first n, y = the last n
//!     cursor += world * span
//! ```
//!
//! So the last token of each span is only a target, a row starts anywhere in a document (its
//! first segment starts at the row's start), and the seed plays no part. The state is the
//! shard and the cursor: restoring it is O(1) but for finding a shard's first BOS.

use std::sync::Arc;

use crate::data::batch::{BatchShape, FINGERPRINT_SEED, LoaderState, mix, mix_window};
use crate::data::sampler::{Sampler, bad_token, kind_of, widen};
use crate::data::shard::ShardFile;

/// Tokens read at a time while looking for a shard's first BOS.
const SCAN: usize = 1 << 16;

/// The record's document-packing loader.
pub struct PackedSampler {
    shards: Vec<Arc<ShardFile>>,
    shape: BatchShape,
    vocab: Option<usize>,
    bos: u32,
    /// Position in the sorted shard list.
    shard: usize,
    /// The next span's first token in that shard (the first rank's).
    cursor: u64,
    micro_batches: u64,
    rolling: u64,
    scratch: Vec<u16>,
}

impl PackedSampler {
    /// The loader over every shard of `shards` (sorted), one row of `shape.tokens()` tokens a
    /// micro-batch, documents starting at `bos`; from the first shard's first BOS, or at
    /// `state`.
    pub fn new(
        shards: Vec<Arc<ShardFile>>,
        shape: BatchShape,
        vocab: Option<usize>,
        bos: u32,
        state: Option<&LoaderState>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!shards.is_empty(), "the packed_docs sampler got no shards");
        anyhow::ensure!(shape.rows == 1, "the packed_docs sampler makes one row a micro-batch, not {}", shape.rows);
        let need = shape.world_size as u64 * (shape.tokens() as u64 + 1);
        anyhow::ensure!(
            shards.iter().any(|s| s.tokens >= need),
            "every shard is shorter than one micro-batch of all ranks, world_size x (tokens + 1) = {need} tokens: the record's loader would never find one"
        );
        let mut s = Self {
            shards,
            shape,
            vocab,
            bos,
            shard: 0,
            cursor: 0,
            micro_batches: 0,
            rolling: FINGERPRINT_SEED,
            scratch: vec![0; SCAN.max(shape.tokens() + 1)],
        };
        match state {
            None => s.cursor = s.first_bos(0)?,
            Some(LoaderState::Packed { shard, cursor, micro_batches, rolling }) => {
                anyhow::ensure!(
                    *shard < s.shards.len() && *cursor <= s.shards[*shard].tokens,
                    "loader state points past the shards (shard {shard}, cursor {cursor}); were the shards changed?"
                );
                (s.shard, s.cursor, s.micro_batches, s.rolling) = (*shard, *cursor, *micro_batches, *rolling);
            }
            Some(other) => anyhow::bail!("cannot resume the packed_docs sampler from a {} state", kind_of(other)),
        }
        Ok(s)
    }

    /// The first position of shard `i` whose token is BOS.
    fn first_bos(&mut self, i: usize) -> anyhow::Result<u64> {
        let file = &self.shards[i];
        let bos = self.bos;
        let mut at = 0u64;
        while at < file.tokens {
            let len = (file.tokens - at).min(SCAN as u64) as usize;
            let found = file.with_tokens(at, len, &mut self.scratch, |w| w.iter().position(|&t| u32::from(t) == bos))?;
            if let Some(p) = found {
                return Ok(at + p as u64);
            }
            at += len as u64;
        }
        anyhow::bail!(
            "{}: no BOS token ({bos}, `model.bos_id`) in the shard; the packed_docs sampler starts each shard at its first document",
            file.path.display()
        )
    }

    /// Moves to the next shard (the first after the last), at its first BOS.
    fn advance(&mut self) -> anyhow::Result<()> {
        self.shard = (self.shard + 1) % self.shards.len();
        self.cursor = self.first_bos(self.shard)?;
        Ok(())
    }
}

impl Sampler for PackedSampler {
    fn fill(&mut self, buf: &mut [u32]) -> anyhow::Result<u64> {
        let n = self.shape.tokens();
        let span = n as u64 + 1;
        let global = self.shape.world_size as u64 * span;
        // A shard too short for a whole micro-batch after its first BOS is passed over; once
        // around every shard without one is an error, not a loop.
        let mut passed = 0;
        while self.cursor + global > self.shards[self.shard].tokens {
            anyhow::ensure!(
                passed < self.shards.len(),
                "no training shard holds a micro-batch of all ranks, world_size x (tokens + 1) = {global} tokens, after its first BOS: the packed_docs sampler cannot go on"
            );
            self.advance()?;
            passed += 1;
        }
        let start = self.cursor + self.shape.rank as u64 * span;
        let file = self.shards[self.shard].clone();
        let vocab = self.vocab;
        let (x, y) = buf[..2 * n].split_at_mut(n);
        file.with_tokens(start, n + 1, &mut self.scratch, |w| {
            if let Some(off) = widen(&w[..n], x, vocab) {
                return Err(bad_token(&file, start, off, w[off], vocab.unwrap_or(0)));
            }
            if let Some(off) = widen(&w[1..], y, vocab) {
                return Err(bad_token(&file, start, off + 1, w[off + 1], vocab.unwrap_or(0)));
            }
            Ok(())
        })??;
        self.cursor += global;
        let h = mix_window(FINGERPRINT_SEED, file.index, start, span);
        self.micro_batches += 1;
        self.rolling = mix(self.rolling, h);
        Ok(h)
    }

    fn state(&self) -> LoaderState {
        LoaderState::Packed { shard: self.shard, cursor: self.cursor, micro_batches: self.micro_batches, rolling: self.rolling }
    }

    fn shape(&self) -> BatchShape {
        self.shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::{AccessMode, write_shard};

    /// An empty directory of this test's own.
    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("pipeline-packed-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The record's loader written out as its Python reads (tests only): the micro-batches of
    /// `world` ranks, `n` tokens each, `count` times, over `shards`.
    fn record_loader(shards: &[Vec<u16>], n: usize, world: usize, rank: usize, count: usize) -> Vec<(Vec<u16>, Vec<u16>)> {
        let first_bos = |s: &Vec<u16>| s.iter().position(|&t| t == 1).unwrap();
        let (mut file, mut cursor) = (0, first_bos(&shards[0]));
        let span = n + 1;
        let mut out = Vec::new();
        for _ in 0..count {
            while cursor + span * world > shards[file].len() {
                file = (file + 1) % shards.len();
                cursor = first_bos(&shards[file]);
            }
            let buf = &shards[file][cursor + rank * span..cursor + (rank + 1) * span];
            out.push((buf[..n].to_vec(), buf[1..].to_vec()));
            cursor += span * world;
        }
        out
    }

    /// Shards of documents of varied lengths (BOS = 1 first), the first starting mid-document,
    /// one too short for a micro-batch.
    fn shards(dir: &std::path::Path) -> (Vec<Vec<u16>>, Vec<Arc<ShardFile>>) {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut made = Vec::new();
        for (i, len) in [700usize, 90, 520, 400].into_iter().enumerate() {
            let mut toks: Vec<u16> = (0..len).map(|_| rng.u16(2..50)).collect();
            let mut p = if i == 0 { 13 } else { 0 };
            while p < len {
                toks[p] = 1;
                p += rng.usize(5..60);
            }
            made.push(toks);
        }
        let paths: Vec<std::path::PathBuf> = (0..made.len()).map(|i| dir.join(format!("train_{i:06}.bin"))).collect();
        for (p, t) in paths.iter().zip(&made) {
            write_shard(p, t).unwrap();
        }
        (made, ShardFile::open_all(&paths, AccessMode::Mmap).unwrap())
    }

    fn take(s: &mut PackedSampler, count: usize) -> Vec<(Vec<u16>, Vec<u16>)> {
        let n = s.shape().tokens();
        let mut buf = vec![0u32; 2 * n];
        (0..count)
            .map(|_| {
                s.fill(&mut buf).unwrap();
                let narrow = |v: &[u32]| v.iter().map(|&t| t as u16).collect::<Vec<u16>>();
                (narrow(&buf[..n]), narrow(&buf[n..]))
            })
            .collect()
    }

    /// Token for token the record's loader: a start at the first BOS, shards passed over when
    /// the micro-batch does not fit (the short one always), around again after the last, for
    /// one rank and for each of three.
    #[test]
    fn batches_are_the_record_loaders() {
        let (tokens, files) = shards(&dir("record"));
        for (world, n) in [(1, 64), (3, 40)] {
            for rank in 0..world {
                let shape = BatchShape { seq_len: n, rows: 1, micro_steps: 1, world_size: world, rank };
                let mut s = PackedSampler::new(files.clone(), shape, Some(50), 1, None).unwrap();
                let want = record_loader(&tokens, n, world, rank, 40);
                assert_eq!(take(&mut s, 40), want, "world {world} rank {rank}");
            }
        }
    }

    /// A loader made from the state after k micro-batches goes on as the one that made them;
    /// the fingerprint chain too.
    #[test]
    fn resumes_where_it_stood() {
        let (_, files) = shards(&dir("resume"));
        let shape = BatchShape { seq_len: 64, rows: 1, micro_steps: 1, world_size: 1, rank: 0 };
        let mut a = PackedSampler::new(files.clone(), shape, None, 1, None).unwrap();
        take(&mut a, 9);
        let state = a.state();
        let mut b = PackedSampler::new(files.clone(), shape, None, 1, Some(&state)).unwrap();
        assert_eq!(take(&mut a, 20), take(&mut b, 20));
        assert_eq!(a.state(), b.state());
        let other = LoaderState::Sequential { shard: 0, offset: 0, micro_batches: 0, rolling: 0 };
        let e = PackedSampler::new(files, shape, None, 1, Some(&other)).err().unwrap().to_string();
        assert!(e.contains("packed_docs") && e.contains("sequential"), "{e}");
    }

    /// Bad input names what is wrong: a shard with no BOS, shards all shorter than a
    /// micro-batch, an id past the vocabulary (with the shard and position).
    #[test]
    fn bad_shards_are_named() {
        let path = dir("bad").join("train_000000.bin");
        write_shard(&path, &[5u16; 300]).unwrap();
        let files = ShardFile::open_all(std::slice::from_ref(&path), AccessMode::Mmap).unwrap();
        let shape = BatchShape { seq_len: 64, rows: 1, micro_steps: 1, world_size: 1, rank: 0 };
        let e = PackedSampler::new(files.clone(), shape, None, 1, None).err().unwrap().to_string();
        assert!(e.contains("no BOS") && e.contains("train_000000.bin"), "{e}");
        let wide = BatchShape { seq_len: 300, ..shape };
        let e = PackedSampler::new(files, wide, None, 1, None).err().unwrap().to_string();
        assert!(e.contains("shorter than one micro-batch"), "{e}");
        let mut toks = vec![1u16; 300];
        toks[70] = 999;
        write_shard(&path, &toks).unwrap();
        let files = ShardFile::open_all(std::slice::from_ref(&path), AccessMode::Mmap).unwrap();
        let mut s = PackedSampler::new(files, BatchShape { seq_len: 100, ..shape }, Some(50), 1, None).unwrap();
        let e = s.fill(&mut vec![0; 200]).unwrap_err().to_string();
        assert!(e.contains("999") && e.contains("train_000000.bin"), "{e}");
        // Long enough, but not after its first BOS: an error, not a loop.
        let mut late = vec![5u16; 300];
        late[250] = 1;
        write_shard(&path, &late).unwrap();
        let files = ShardFile::open_all(&[path], AccessMode::Mmap).unwrap();
        let mut s = PackedSampler::new(files, BatchShape { seq_len: 100, ..shape }, None, 1, None).unwrap();
        let e = s.fill(&mut vec![0; 200]).unwrap_err().to_string();
        assert!(e.contains("no training shard holds a micro-batch"), "{e}");
    }
}
