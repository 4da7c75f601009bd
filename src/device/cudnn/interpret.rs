//! cuDNN's SDPA on the CPU: what a graph of [`SdpaDesc`] computes (the maths in the parent
//! module's doc), read from and written to a byte memory at the addresses of [`SdpaPtrs`], as
//! the device would. The warp emulator runs the engine's cuDNN calls through it, so that the
//! descriptors, strides, ragged offsets and statistics the engine hands cuDNN are checked
//! against the engine's CPU reference; the arithmetic is f64, each output rounded once to its
//! type (`bf16` tensors, `f32` statistics), as a fused kernel stores them.

#[cfg(feature = "tools")]
use anyhow::Context;

#[cfg(feature = "tools")]
use super::{SdpaDesc, SdpaPtrs, Strides};

/// Element reads and writes at byte addresses of a memory.
#[cfg(feature = "tools")]
struct Mem<'a>(&'a mut [u8]);

#[cfg(feature = "tools")]
impl Mem<'_> {
    fn bytes<const N: usize>(&self, addr: u64) -> anyhow::Result<[u8; N]> {
        let at = addr as usize;
        let got =
            self.0.get(at..at + N).with_context(|| format!("reading {N} bytes at {addr:#x}, past the memory's {} bytes", self.0.len()))?;
        Ok(got.try_into().expect("N bytes"))
    }

    fn put<const N: usize>(&mut self, addr: u64, b: [u8; N]) -> anyhow::Result<()> {
        let len = self.0.len();
        let at = addr as usize;
        let dst = self.0.get_mut(at..at + N).with_context(|| format!("writing {N} bytes at {addr:#x}, past the memory's {len} bytes"))?;
        dst.copy_from_slice(&b);
        Ok(())
    }

    fn bf16(&self, addr: u64) -> anyhow::Result<f64> {
        Ok(half::bf16::from_bits(u16::from_ne_bytes(self.bytes(addr)?)).to_f64())
    }

    fn set_bf16(&mut self, addr: u64, v: f64) -> anyhow::Result<()> {
        self.put(addr, half::bf16::from_f64(v).to_bits().to_ne_bytes())
    }

    fn f32(&self, addr: u64) -> anyhow::Result<f64> {
        Ok(f32::from_ne_bytes(self.bytes(addr)?) as f64)
    }

    fn set_f32(&mut self, addr: u64, v: f64) -> anyhow::Result<()> {
        self.put(addr, (v as f32).to_ne_bytes())
    }

    fn i32(&self, addr: u64) -> anyhow::Result<i64> {
        Ok(i32::from_ne_bytes(self.bytes(addr)?) as i64)
    }
}

/// One tensor of a call: its address, strides and element size; `base` is the element offset
/// of the current sequence (its batch stride times its index, or its ragged offset).
#[derive(Clone, Copy)]
#[cfg(feature = "tools")]
struct View {
    ptr: u64,
    st: Strides,
    bytes: u64,
    base: i64,
}

#[cfg(feature = "tools")]
impl View {
    #[cfg(feature = "tools")]
    fn new(ptr: u64, st: Strides, bytes: u64) -> View {
        View { ptr, st, bytes, base: 0 }
    }

    /// The address of `(head, pos, dim)` of the current sequence.
    #[cfg(feature = "tools")]
    fn at(&self, head: usize, pos: usize, dim: usize) -> u64 {
        let e = self.base + head as i64 * self.st[1] + pos as i64 * self.st[2] + dim as i64 * self.st[3];
        self.ptr.wrapping_add((e as u64).wrapping_mul(self.bytes))
    }
}

/// Runs `desc` on `p` in `memory` (addresses are byte offsets into it).
#[cfg(feature = "tools")]
pub fn run(desc: &SdpaDesc, p: &SdpaPtrs, memory: &mut [u8]) -> anyhow::Result<()> {
    anyhow::ensure!(desc.unsupported().is_none(), "cuDNN would refuse {}: {:?}", super::describe(desc), desc.unsupported());
    let mut m = Mem(memory);
    let views = |m: &Mem, slot: usize, v: &mut [(&mut View, u64)]| -> anyhow::Result<usize> {
        if !desc.ragged {
            for (view, _) in v.iter_mut() {
                view.base = slot as i64 * view.st[0];
            }
            return Ok(desc.s);
        }
        let len = m.i32(p.seq_len + 4 * slot as u64)?;
        anyhow::ensure!((0..=desc.s as i64).contains(&len), "slot {slot}'s length {len} is outside 0..={}", desc.s);
        for (k, (view, off)) in v.iter_mut().enumerate() {
            if *off == 0 {
                continue;
            }
            // Packed, as cuDNN's THD layout (and FlashAttention's cumulative lengths) read it:
            // b + 1 entries, each slot starting where the one before ends, the last the end.
            let (this, next) = (m.i32(*off + 4 * slot as u64)?, m.i32(*off + 4 * (slot as u64 + 1))?);
            anyhow::ensure!(
                this >= 0 && next - this == len * view.st[2],
                "ragged offsets of tensor {k}: slot {slot} starts at {this} with {len} rows of {}, the next at {next} (not packed)",
                view.st[2]
            );
            view.base = this;
        }
        Ok(len as usize)
    };
    let (mut q, mut k, mut v) = (View::new(p.q, desc.q, 2), View::new(p.k, desc.k, 2), View::new(p.v, desc.v, 2));
    let (mut o, mut stats) = (View::new(p.o, desc.o, 2), View::new(p.stats, desc.stats, 4));
    let mut dout = View::new(p.dout, desc.o, 2);
    let (mut dq, mut dk, mut dv) = (View::new(p.dq, desc.dq, 2), View::new(p.dk, desc.dk, 2), View::new(p.dv, desc.dv, 2));
    let group = desc.h / desc.h_kv;
    let scale = desc.scale() as f64;
    let d = desc.d;
    for slot in 0..desc.b {
        let len = views(
            &m,
            slot,
            &mut [
                (&mut q, p.off_q),
                (&mut k, p.off_k),
                (&mut v, p.off_v),
                (&mut o, p.off_o),
                (&mut stats, p.off_stats),
                // The backward's own tensors (a forward graph has none).
                (&mut dout, if desc.backward { p.off_o } else { 0 }),
                (&mut dq, if desc.backward { p.off_dq } else { 0 }),
                (&mut dk, if desc.backward { p.off_dk } else { 0 }),
                (&mut dv, if desc.backward { p.off_dv } else { 0 }),
            ],
        )?;
        for g in 0..desc.h_kv {
            let read = |m: &Mem, t: &View, head: usize| -> anyhow::Result<Vec<f64>> {
                let mut out = Vec::with_capacity(len * d);
                for pos in 0..len {
                    for e in 0..d {
                        out.push(m.bf16(t.at(head, pos, e))?);
                    }
                }
                Ok(out)
            };
            let (kk, vv) = (read(&m, &k, g)?, read(&m, &v, g)?);
            let (mut dk_acc, mut dv_acc) = (vec![0.0; len * d], vec![0.0; len * d]);
            for h in g * group..(g + 1) * group {
                let qq = read(&m, &q, h)?;
                let seen = |i: usize| if desc.causal { i + 1 } else { len };
                let score = |i: usize, j: usize| scale * (0..d).map(|e| qq[i * d + e] * kk[j * d + e]).sum::<f64>();
                if !desc.backward {
                    for i in 0..len {
                        let s: Vec<f64> = (0..seen(i)).map(|j| score(i, j)).collect();
                        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let lse = max + s.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                        for e in 0..d {
                            let y: f64 = s.iter().enumerate().map(|(j, x)| (x - lse).exp() * vv[j * d + e]).sum();
                            m.set_bf16(o.at(h, i, e), y)?;
                        }
                        m.set_f32(stats.at(h, i, 0), lse)?;
                    }
                    continue;
                }
                let (oo, gg) = (read(&m, &o, h)?, read(&m, &dout, h)?);
                for i in 0..len {
                    let lse = m.f32(stats.at(h, i, 0))?;
                    let delta: f64 = (0..d).map(|e| gg[i * d + e] * oo[i * d + e]).sum();
                    let mut dqi = vec![0.0; d];
                    for j in 0..seen(i) {
                        let pij = (score(i, j) - lse).exp();
                        let dp: f64 = (0..d).map(|e| gg[i * d + e] * vv[j * d + e]).sum();
                        let ds = pij * (dp - delta);
                        for e in 0..d {
                            dqi[e] += scale * ds * kk[j * d + e];
                            dk_acc[j * d + e] += scale * ds * qq[i * d + e];
                            dv_acc[j * d + e] += pij * gg[i * d + e];
                        }
                    }
                    for (e, x) in dqi.into_iter().enumerate() {
                        m.set_bf16(dq.at(h, i, e), x)?;
                    }
                }
            }
            if desc.backward {
                for j in 0..len {
                    for e in 0..d {
                        m.set_bf16(dk.at(g, j, e), dk_acc[j * d + e])?;
                        m.set_bf16(dv.at(g, j, e), dv_acc[j * d + e])?;
                    }
                }
            }
        }
    }
    Ok(())
}
