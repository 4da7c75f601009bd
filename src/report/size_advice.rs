//! What a model over the size cap must lose, and the quantization settings closest to doing it,
//! for the run's size line and `pipeline submission`'s.
//!
//! The estimate is the entropy coder's: a quantized value costs about `log2(range / step)` bits
//! after compression, so widening every step by a factor `f` (SD-clip's `k` times `f`) frees
//! `log2(f)` bits a value, `n log2(f) / 8` bytes over `n` values; one bit fewer (`bits - 1`)
//! doubles the step, about `n / 8` bytes; LQER's corrections free what they take. Compressors
//! are not ideal entropy coders: the figures say where to start, and the next run's size line
//! says where it landed.

/// A model's size facts, from its `artifact` section.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SizeFacts {
    /// Bytes over the cap (model + code).
    pub over: u64,
    /// The compressed model's bytes.
    pub model_bytes: u64,
    /// Quantized values (one byte each in the payload).
    pub values: u64,
    /// Bits of the matrices.
    pub bits: u8,
    /// SD-clip's `k` of the matrices, when the clip is SD-clip.
    pub clip_sigmas: Option<f64>,
    /// LQER's corrections' bytes (0: none).
    pub lqer_bytes: u64,
}

/// One line: how many bytes to lose, then the settings, nearest first.
pub fn advice(f: &SizeFacts) -> String {
    let over = f.over as f64;
    let mut options: Vec<(f64, String)> = Vec::new();
    if let (Some(k), true) = (f.clip_sigmas, f.values > 0) {
        let factor = 2f64.powf(8.0 * over / f.values as f64);
        options.push((
            0.0,
            format!(
                "`clip_sigmas` {k} -> {:.2} (and the embedding's and the per-family `k`s times {factor:.3}: about {} bytes)",
                k * factor,
                f.over
            ),
        ));
    }
    if f.lqer_bytes > 0 {
        let enough = if f.lqer_bytes >= f.over { "enough" } else { "not enough alone" };
        options.push((1.0, format!("`lqer = false` (its corrections take {} bytes: {enough})", f.lqer_bytes)));
    }
    if f.bits > 2 && f.values > 0 {
        let frees = f.values / 8;
        let enough = if frees >= f.over { "enough" } else { "not enough alone" };
        options.push((2.0, format!("`bits` {} -> {} (about {frees} bytes: {enough})", f.bits, f.bits - 1)));
    }
    options.sort_by(|a, b| a.0.total_cmp(&b.0));
    let share = 100.0 * over / f.model_bytes.max(1) as f64;
    let mut line = format!("the model must lose {} bytes ({share:.2}% of its {})", f.over, f.model_bytes);
    if !options.is_empty() {
        line.push_str("; closest settings: ");
        line.push_str(&options.into_iter().map(|(_, o)| o).collect::<Vec<_>>().join("; or "));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advice_names_the_bytes_and_the_settings() {
        let f = SizeFacts {
            over: 506_649,
            model_bytes: 15_865_260,
            values: 35_000_000,
            bits: 6,
            clip_sigmas: Some(12.85),
            lqer_bytes: 120_000,
        };
        let a = advice(&f);
        assert!(a.starts_with("the model must lose 506649 bytes (3.19% of its 15865260)"), "{a}");
        // log2(f) = 8 * 506649 / 35e6 = 0.1158: f = 1.0836, k = 13.92.
        assert!(a.contains("`clip_sigmas` 12.85 -> 13.92"), "{a}");
        assert!(a.contains("`lqer = false` (its corrections take 120000 bytes: not enough alone)"), "{a}");
        assert!(a.contains("`bits` 6 -> 5 (about 4375000 bytes: enough)"), "{a}");
        assert!(a.find("clip_sigmas").unwrap() < a.find("lqer").unwrap());
        // A quantile clip and no LQER: bits only.
        let plain = advice(&SizeFacts { over: 10, model_bytes: 100, values: 800, bits: 8, clip_sigmas: None, lqer_bytes: 0 });
        assert_eq!(plain, "the model must lose 10 bytes (10.00% of its 100); closest settings: `bits` 8 -> 7 (about 100 bytes: enough)");
    }
}
