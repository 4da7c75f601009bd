//! A document mask for packed rows (what FlashAttention's `cu_seqlens` express): a row of `T`
//! positions holds several documents one after another, and attention must stay inside each.
//! With `start(i)` the first position of the segment holding position `i`:
//!
//! ```text
//! position i sees key j  <=>  start(i) <= j <= i
//! ```
//!
//! Segments start at the row's first position, at every position whose input token is the
//! BOS token (spec 5.5: `cu_seqlens` at BOS positions), and, with a cut length `L`
//! ([`DocRule::max_len`], `model.document_max_len`), every `L` positions from each document's
//! start: the 04-27 record's `_build_cu_seqlens(bos, n, max_doc_len = L)`, which packs a whole
//! micro-batch into one row and cuts its documents at `TRAIN_SEQ_LEN`. With `d(i)` the
//! document start of position `i` (the last BOS at or before it, else the row's first position):
//!
//! ```text
//! start(i) = d(i) + floor((i - d(i)) / L) * L        (L = 0: start(i) = d(i))
//! ```
//!
//! Every op of the model but attention acts per position, and RoPE makes a score depend only
//! on `i - j`, so a masked row computes what its segments would compute as separate rows (to
//! rounding).
//!
//! The fused CPU attention kernel reads [`DocumentMask::row`] and skips the hidden keys in its
//! softmax; every other device adds [`DocumentMask::additive`] to the materialised scores.

#[cfg(feature = "candle")]
use candle_core::Tensor;
#[cfg(feature = "candle")]
use candle_core::{DType, Device};
use candle_core::{Result, bail};

/// Where a row's attention segments start: at each `bos` and every `max_len` positions from a
/// document's start (0: documents are not cut).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DocRule {
    /// The token that starts a document.
    pub bos: u32,
    /// A document longer than this is attended in pieces of this length (0: whole).
    pub max_len: u32,
}

impl DocRule {
    /// Documents starting at `bos`, not cut.
    pub fn at(bos: u32) -> Self {
        Self { bos, max_len: 0 }
    }

    /// `start(i)` of position `i` of a document starting at `doc`.
    #[inline]
    pub fn start(self, doc: usize, i: usize) -> usize {
        match self.max_len as usize {
            0 => doc,
            l => doc + (i - doc) / l * l,
        }
    }
}

/// Per position of a batch of packed rows, the first key position it may see.
#[derive(Clone, Debug)]
pub struct DocumentMask {
    /// Positions per row.
    t: usize,
    /// `start(i)` of every position, row after row (`B * T` entries).
    starts: Vec<u32>,
    /// [`DocumentMask::additive`] as first made: every attention layer of a pass reads the same
    /// `(B, 1, T, T)` mask, so it is built and moved to the device once.
    #[cfg(feature = "candle")]
    additive: std::sync::OnceLock<Tensor>,
    /// [`DocumentMask::starts_on`] as first made.
    #[cfg(feature = "candle")]
    on_device: std::sync::OnceLock<Tensor>,
}

impl DocumentMask {
    /// The mask of input rows `x` (`rows * t` token ids, row-major) under `rule`: a segment
    /// starts at each row's first position, at every `rule.bos`, and every `rule.max_len`
    /// positions from a document's start.
    pub fn at_token(x: &[u32], t: usize, rule: DocRule) -> Result<Self> {
        if t == 0 || !x.len().is_multiple_of(t) || t > u32::MAX as usize {
            bail!("document mask: {} tokens do not form rows of {t}", x.len());
        }
        let mut starts = Vec::with_capacity(x.len());
        for row in x.chunks_exact(t) {
            let mut doc = 0;
            for (i, &tok) in row.iter().enumerate() {
                if tok == rule.bos {
                    doc = i;
                }
                starts.push(rule.start(doc, i) as u32);
            }
        }
        Ok(Self {
            t,
            starts,
            #[cfg(feature = "candle")]
            additive: std::sync::OnceLock::new(),
            #[cfg(feature = "candle")]
            on_device: std::sync::OnceLock::new(),
        })
    }

    /// Number of rows.
    #[cfg(feature = "candle")]
    pub fn rows(&self) -> usize {
        self.starts.len() / self.t
    }

    /// Positions per row.
    #[cfg(feature = "candle")]
    pub fn t(&self) -> usize {
        self.t
    }

    /// `start(i)` for the positions of row `b`.
    pub fn row(&self, b: usize) -> &[u32] {
        &self.starts[b * self.t..(b + 1) * self.t]
    }

    /// The segments of row `b` as `(start, len)` pairs, in order (FlashAttention's `cu_seqlens`
    /// of one row).
    #[cfg(feature = "candle")]
    pub fn segments(&self, b: usize) -> Vec<(usize, usize)> {
        let row = self.row(b);
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (i, &s) in row.iter().enumerate() {
            match out.last_mut() {
                Some((start, len)) if *start == s as usize => *len += 1,
                _ => out.push((i, 1)),
            }
        }
        out
    }

    /// Every position's `start(i)`, row after row, as a `u32` tensor `(B * T,)` on `device` (the
    /// GPU flash kernels' document argument). Made once and kept for the first device asked for
    /// (every attention layer of a pass asks for the same).
    #[cfg(feature = "candle")]
    pub fn starts_on(&self, device: &Device) -> Result<Tensor> {
        if let Some(t) = self.on_device.get()
            && t.device().same_device(device)
        {
            return Ok(t.clone());
        }
        let t = Tensor::from_slice(&self.starts, self.starts.len(), device)?;
        let _ = self.on_device.set(t.clone());
        Ok(t)
    }

    /// Whether every row is one segment (the mask is plain causal attention).
    #[cfg(feature = "candle")]
    pub fn is_causal(&self) -> bool {
        self.starts.iter().all(|&s| s == 0)
    }

    /// The additive mask `(B, 1, T, T)`: 0 where position `i` sees key `j`, -inf elsewhere (the
    /// future and earlier documents), for scores `(B, H, T, T)`. Made once and kept for the
    /// first `dtype` and device asked for (a pass asks for one).
    #[cfg(feature = "candle")]
    pub fn additive(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some(m) = self.additive.get()
            && m.dtype() == dtype
            && m.device().same_device(device)
        {
            return Ok(m.clone());
        }
        let m = self.make_additive(dtype, device)?;
        // Only the first is kept; another dtype or device is made again each time.
        let _ = self.additive.set(m.clone());
        Ok(m)
    }

    #[cfg(feature = "candle")]
    fn make_additive(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let t = self.t;
        let mut v = vec![f32::NEG_INFINITY; self.rows() * t * t];
        for (b, block) in v.chunks_exact_mut(t * t).enumerate() {
            for (i, (row, &s)) in block.chunks_exact_mut(t).zip(self.row(b)).enumerate() {
                row[s as usize..=i].fill(0.0);
            }
        }
        Tensor::from_vec(v, (self.rows(), 1, t, t), device)?.to_dtype(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_start_at_every_bos_and_at_each_row() {
        let x = [5, 1, 7, 8, 1, 1, 9, 3, 2, 1, 4, 4];
        let m = DocumentMask::at_token(&x, 6, DocRule::at(1)).unwrap();
        assert_eq!(m.rows(), 2);
        assert_eq!(m.row(0), [0, 1, 1, 1, 4, 5]);
        assert_eq!(m.row(1), [0, 0, 0, 3, 3, 3]);
        assert_eq!(m.segments(0), [(0, 1), (1, 3), (4, 1), (5, 1)]);
        assert_eq!(m.segments(1), [(0, 3), (3, 3)]);
        assert!(!m.is_causal());
        assert!(DocumentMask::at_token(&[2, 3, 4], 3, DocRule::at(1)).unwrap().is_causal());
        assert!(DocumentMask::at_token(&x, 5, DocRule::at(1)).is_err(), "12 tokens are not rows of 5");
    }

    /// The 04-27 record's cuts (`_build_cu_seqlens(bos_pos, n, device, max_doc_len = 3)`): a
    /// document longer than 3 goes in pieces of 3 from its own start, the row's first (partial)
    /// document too, and a BOS restarts the count.
    #[test]
    fn documents_are_cut_every_max_len_from_their_start() {
        let x = [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 1, 2, 1, 3, 4, 5, 6, 7, 8];
        let m = DocumentMask::at_token(&x, x.len(), DocRule { bos: 1, max_len: 3 }).unwrap();
        // The record's boundaries: [0, 3, 5, 8, 10, 12, 15, 18, 19].
        assert_eq!(m.segments(0), [(0, 3), (3, 2), (5, 3), (8, 2), (10, 2), (12, 3), (15, 3), (18, 1)]);
        assert_eq!(m.row(0)[..6], [0, 0, 0, 3, 3, 5]);
        let whole = DocumentMask::at_token(&x, x.len(), DocRule::at(1)).unwrap();
        assert_eq!(whole.segments(0), [(0, 5), (5, 5), (10, 2), (12, 7)]);
        let longer = DocumentMask::at_token(&x, x.len(), DocRule { bos: 1, max_len: 7 }).unwrap();
        assert_eq!(longer.row(0), whole.row(0), "no document is longer than 7");
    }

    #[test]
    fn the_additive_mask_hides_the_future_and_earlier_documents() {
        let m = DocumentMask::at_token(&[1, 7, 1, 8], 4, DocRule::at(1)).unwrap();
        let a = m.additive(DType::F32, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let seen: Vec<Vec<bool>> = a.chunks(4).map(|r| r.iter().map(|x| *x == 0.0).collect()).collect();
        let want = [[true, false, false, false], [true, true, false, false], [false, false, true, false], [false, false, true, true]];
        assert_eq!(seen, want.map(|r| r.to_vec()).to_vec());
        let again = m.additive(DType::F32, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(again, a, "the kept mask");
        let wide = m.additive(DType::F64, &Device::Cpu).unwrap();
        assert_eq!(wide.dtype(), DType::F64, "another dtype is made, not the kept one returned");
    }
}
