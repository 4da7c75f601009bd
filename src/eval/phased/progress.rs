//! The `ttp:` progress line phased TTT logs after each batch of documents (record spec §5.4):
//!
//! ```text
//! ttp: b<batches done>/<queue length> bl:<batch loss> bb:<batch bpb> rl:<running loss> rb:<running bpb> dl:<shortest>-<longest doc tokens> gd:<0|1>
//! ```
//!
//! The batch figures are those of the targets scored since the previous line (loss in nats per
//! token; bpb = loss / ln 2 · tokens / bytes), the running ones of every target scored so far,
//! and `gd` says whether the global SGD phases are all done.

/// Running sums between `ttp:` lines.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    nll: f64,
    tokens: u64,
    bytes: u64,
    at_last_line: (f64, u64, u64),
    batches: usize,
}

impl Progress {
    /// Adds what a batch scored: summed NLL (nats), targets and their bytes.
    pub fn add(&mut self, nll: f64, tokens: u64, bytes: u64) {
        self.nll += nll;
        self.tokens += tokens;
        self.bytes += bytes;
    }

    /// Ends a batch of documents of `doc_lens` tokens: its line, and the batch figures restart.
    pub fn line(&mut self, queue_len: usize, doc_lens: &[usize], global_done: bool) -> String {
        self.batches += 1;
        let (n0, t0, b0) = self.at_last_line;
        let (dn, dt, db) = (self.nll - n0, self.tokens - t0, self.bytes - b0);
        let bpb =
            |nll: f64, t: u64, b: u64| if t > 0 && b > 0 { nll / t as f64 / std::f64::consts::LN_2 * (t as f64 / b as f64) } else { 0.0 };
        let loss = |nll: f64, t: u64| if t > 0 { nll / t as f64 } else { 0.0 };
        self.at_last_line = (self.nll, self.tokens, self.bytes);
        format!(
            "ttp: b{}/{queue_len} bl:{:.4} bb:{:.4} rl:{:.4} rb:{:.4} dl:{}-{} gd:{}",
            self.batches,
            loss(dn, dt),
            bpb(dn, dt, db),
            loss(self.nll, self.tokens),
            bpb(self.nll, self.tokens, self.bytes),
            doc_lens.iter().min().unwrap_or(&0),
            doc_lens.iter().max().unwrap_or(&0),
            u8::from(global_done)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_and_running_figures() {
        let mut p = Progress::default();
        // 100 targets, 200 nats, 400 bytes: loss 2, bpb 2 / ln 2 / 4.
        p.add(200.0, 100, 400);
        let l = p.line(782, &[10, 30, 20], false);
        let bpb = 2.0 / std::f64::consts::LN_2 * 0.25;
        assert_eq!(l, format!("ttp: b1/782 bl:2.0000 bb:{bpb:.4} rl:2.0000 rb:{bpb:.4} dl:10-30 gd:0"));
        // A second batch: 100 targets, 100 nats, 100 bytes.
        p.add(100.0, 100, 100);
        let l = p.line(782, &[40], true);
        let (b, r) = (1.0 / std::f64::consts::LN_2, 1.5 / std::f64::consts::LN_2 * 200.0 / 500.0);
        assert_eq!(l, format!("ttp: b2/782 bl:1.0000 bb:{b:.4} rl:1.5000 rb:{r:.4} dl:40-40 gd:1"));
    }
}
