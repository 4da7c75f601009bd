//! `pipeline artifact WEIGHTS --config C [--method gptq]`: quantize a weights file as the
//! config's `artifact` stage would (its keys, when the config has one; the baseline's otherwise;
//! `--bits`, `--codec`, `--level` and `--set stages.NAME.KEY=V` on top), write the artifact, read
//! it back and score the round trip.

use std::path::PathBuf;

use crate::artifact::quant::Codec;
use crate::artifact::roundtrip::{CodeBytes, build, default_path};
use crate::runtime::config::{self, Tables};
use crate::runtime::graph::RESERVED_KEYS;
use crate::stages::artifact::ArtifactParams;
use crate::train::config::Config;

/// The rounding `--method` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MethodArg {
    /// Round to nearest (the `quantize` implementation).
    Quantize,
    /// GPTQ with Hessians from training data (the `gptq` implementation).
    Gptq,
}

/// The command's options besides the weights and the config.
pub struct Options {
    /// `--set` overrides.
    pub sets: Vec<String>,
    /// `--method`; unset: the config's artifact stage's implementation, else `quantize`.
    pub method: Option<MethodArg>,
    /// `--bits`, `--codec`, `--level` overrides.
    pub bits: Option<u8>,
    /// See `bits`.
    pub codec: Option<Codec>,
    /// See `bits`.
    pub level: Option<i32>,
    /// `--out`.
    pub out: Option<PathBuf>,
    /// `--val-max-tokens`.
    pub val_max_tokens: usize,
}

/// Writes and scores the artifact of `weights` under the config at `path`.
pub fn command(weights: PathBuf, path: PathBuf, o: Options) -> i32 {
    let loaded = match config::load::<Config>(&path, &o.sets) {
        Ok(l) => l,
        Err(e) => {
            err!("error: {e}");
            return 2;
        }
    };
    let (params, stage_impl) = match stage_params(&loaded) {
        Ok(p) => p,
        Err(e) => {
            err!("error: {e:#}");
            return 2;
        }
    };
    let mut p = params;
    p.quant.bits = o.bits.unwrap_or(p.quant.bits);
    p.quant.codec = o.codec.unwrap_or(p.quant.codec);
    p.quant.level = o.level.or(p.quant.level);
    if let Err(e) = p.check() {
        err!("error: {e:#}");
        return 2;
    }
    let gptq = match o.method {
        Some(m) => m == MethodArg::Gptq,
        None => stage_impl.as_deref() == Some("gptq"),
    };
    let q = p.quant.clone();
    let out = o.out.unwrap_or_else(|| default_path(&weights, &q));
    let code = match p.code_bytes {
        Some(n) => CodeBytes::Given(n),
        // The source bundle beside the artifact.
        None => CodeBytes::measure(out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."))),
    };
    match build(&loaded.config, &weights, &q, &p.method(gptq), &out, o.val_max_tokens, code, |l| out!("{l}")) {
        Ok(_) => 0,
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

/// The parameters and implementation of the config's `artifact` stage (the defaults and no
/// implementation when it has none); errors name the bad key.
fn stage_params(loaded: &config::Loaded<Config>) -> anyhow::Result<(ArtifactParams, Option<String>)> {
    let Some((name, dict)) = loaded.config.stage_of_kind("artifact") else { return Ok((ArtifactParams::default(), None)) };
    let implementation = dict.get("impl").and_then(|v| v.as_str()).map(String::from);
    let mut params = dict.clone();
    for k in RESERVED_KEYS {
        params.remove(k);
    }
    #[allow(clippy::result_large_err)] // figment's errors, passed on into one message
    let p = figment::value::Value::serialize(&params)
        .and_then(|raw| crate::runtime::stage::unknown_keys::<ArtifactParams>(&raw))
        .and_then(|()| figment::Figment::from(figment::providers::Serialized::defaults(params)).extract::<ArtifactParams>())
        .map_err(|e| anyhow::anyhow!("`stages.{name}`: {e}"))?;
    Ok((p, implementation))
}
