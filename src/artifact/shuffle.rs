//! The byte shuffle the records apply before Brotli (spec 4.5).
//!
//! Byte shuffle with stride `s`: the bytes at offsets `0, s, 2s, ...`, then those at `1, s + 1,
//! ...`, up to `s - 1`, prefixed with the tag [`SHUFFLE_TAG`] (`BSHF`) and one stride byte. With
//! stride 2 the low and the high bytes of every fp16 value end up in two separate runs, which the
//! compressor models better. [`unshuffle`] reverses it; a body without the tag is returned as it
//! is, so one reader takes both.

use anyhow::{Result, ensure};

/// The tag in front of a shuffled body (then one byte: the stride).
pub const SHUFFLE_TAG: [u8; 4] = *b"BSHF";

/// `data` byte-shuffled with `stride` (2..=255), tag and stride byte first.
pub fn shuffle(data: &[u8], stride: u8) -> Result<Vec<u8>> {
    ensure!(stride >= 2, "byte shuffle stride {stride} must be at least 2 (0 or 1: no shuffle)");
    let s = stride as usize;
    let mut out = Vec::with_capacity(data.len() + SHUFFLE_TAG.len() + 1);
    out.extend_from_slice(&SHUFFLE_TAG);
    out.push(stride);
    for lane in 0..s {
        out.extend(data.iter().skip(lane).step_by(s));
    }
    Ok(out)
}

/// Reverses [`shuffle`] when `data` starts with [`SHUFFLE_TAG`]; otherwise gives `data` back.
pub fn unshuffle(data: Vec<u8>) -> Result<Vec<u8>> {
    if !data.starts_with(&SHUFFLE_TAG) {
        return Ok(data);
    }
    let at = SHUFFLE_TAG.len();
    ensure!(data.len() > at, "a shuffled body ends after its `BSHF` tag, before the stride byte");
    let s = data[at] as usize;
    ensure!(s >= 2, "a shuffled body gives stride {s} (at byte {at}); strides start at 2");
    let body = &data[at + 1..];
    let n = body.len();
    let mut out = vec![0u8; n];
    let mut src = body.iter();
    for lane in 0..s {
        for o in out.iter_mut().skip(lane).step_by(s) {
            *o = *src.next().expect("the lanes hold n bytes in all");
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::codec::Codec;

    #[test]
    fn shuffle_groups_lanes_and_round_trips() {
        let data = [1u8, 2, 3, 4, 5, 6, 7];
        let s = shuffle(&data, 2).unwrap();
        assert_eq!(&s[..5], b"BSHF\x02");
        assert_eq!(&s[5..], [1, 3, 5, 7, 2, 4, 6]);
        assert_eq!(shuffle(&data, 3).unwrap()[5..], [1, 4, 7, 2, 5, 3, 6]);
        let mut rng = fastrand::Rng::with_seed(5);
        for n in [0usize, 1, 2, 3, 17, 1000, 4097] {
            let data: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
            for stride in [2u8, 3, 4, 7, 255] {
                assert_eq!(unshuffle(shuffle(&data, stride).unwrap()).unwrap(), data, "n {n} stride {stride}");
            }
        }
        // Without the tag, the body is left as it is.
        assert_eq!(unshuffle(vec![9, 8, 7]).unwrap(), [9, 8, 7]);
        assert!(shuffle(&data, 1).is_err() && shuffle(&data, 0).is_err());
        let err = unshuffle(b"BSHF".to_vec()).unwrap_err().to_string();
        assert!(err.contains("stride byte"), "{err}");
        let err = unshuffle(b"BSHF\x01abc".to_vec()).unwrap_err().to_string();
        assert!(err.contains("byte 4"), "{err}");
    }

    /// The shuffle helps the compressor on fp16 data, which it is there for.
    #[test]
    fn shuffle_helps_brotli_on_fp16() {
        let mut rng = fastrand::Rng::with_seed(9);
        let data: Vec<u8> = (0..20_000).flat_map(|_| half::f16::from_f32((rng.f32() - 0.5) * 0.05).to_le_bytes()).collect();
        let plain = Codec::Brotli.compress(&data, 9).unwrap().len();
        let shuffled = Codec::Brotli.compress(&shuffle(&data, 2).unwrap(), 9).unwrap().len();
        assert!(shuffled < plain, "shuffled {shuffled} >= plain {plain}");
    }
}
