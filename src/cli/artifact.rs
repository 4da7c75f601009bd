//! `pipeline artifact WEIGHTS`: quantize a weights file, write the artifact, read it back and
//! score the round trip.

use std::path::PathBuf;

use crate::runtime::config;
use crate::train::config::Config;

/// Writes and scores the artifact of `weights` under the config at `path`.
pub fn command(
    weights: PathBuf,
    path: PathBuf,
    sets: Vec<String>,
    q: crate::artifact::quant::QuantConfig,
    out: Option<PathBuf>,
    val_max_tokens: usize,
) -> i32 {
    let loaded = match config::load::<Config>(&path, &sets) {
        Ok(l) => l,
        Err(e) => {
            err!("error: {e}");
            return 2;
        }
    };
    let out = out.unwrap_or_else(|| crate::artifact::roundtrip::default_path(&weights, &q));
    match crate::artifact::roundtrip::build(&loaded.config, &weights, &q, &out, val_max_tokens, |l| out!("{l}")) {
        Ok(_) => 0,
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}
