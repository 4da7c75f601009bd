//! The `artifact` stage's keys ([`ArtifactParams`]): the quantization scheme ([`QuantConfig`]'s
//! keys) and GPTQ's settings ([`GptqConfig`]'s), flat so that a TOML table reads as the record's
//! environment variables, and the stage's own (calibration, code bytes, file name, scoring);
//! their defaults and checks.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::artifact::gptq::GptqConfig;
use crate::artifact::quant::QuantConfig;
use crate::artifact::roundtrip::Method;

/// Parameters of `artifact/quantize` and `artifact/gptq` (the same keys, so that switching
/// `impl` changes the rounding and nothing else): the library's configs, flat in the stage's
/// table, and the stage's own keys. Unknown keys are refused by the runtime against this
/// struct's schema ([`crate::runtime::stage::unknown_keys`]), since serde's own check does not
/// see through `flatten`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ArtifactParams {
    /// The quantization scheme ([`QuantConfig`]'s keys).
    #[serde(flatten)]
    pub quant: QuantConfig,
    /// `gptq` only: its settings ([`GptqConfig`]'s keys).
    #[serde(flatten)]
    pub gptq: GptqConfig,
    /// `gptq` only: calibration micro-batches of the training shape (64 in the record).
    pub calibration_batches: usize,
    /// Code bytes counted against the cap with the artifact, for experiments only (`pipeline
    /// submission` refuses a run whose code size was stated); unset: the source bundle this
    /// binary packs from its own sources (docs/submitting.md).
    pub code_bytes: Option<u64>,
    /// File name inside the run directory (default `final_model.int<bits>.<codec>.pgqz`).
    pub file: Option<String>,
    /// Score the weights before and after the round trip.
    pub eval: bool,
    /// What scores them: "engine" (the explicit engine on the training micro-batch's rows: f32
    /// on the CPU, bf16 activations on a GPU) or "candle" (the candle model, f32).
    pub executor: crate::eval::executor::EvalExecutor,
}

impl Default for ArtifactParams {
    fn default() -> Self {
        Self {
            quant: QuantConfig::default(),
            gptq: GptqConfig::default(),
            calibration_batches: 64,
            code_bytes: None,
            file: None,
            eval: true,
            executor: Default::default(),
        }
    }
}

impl ArtifactParams {
    /// The rounding of implementation `gptq` (true) or `quantize`.
    pub fn method(&self, gptq: bool) -> Method {
        if gptq { Method::Gptq { gptq: self.gptq, calibration_batches: self.calibration_batches } } else { Method::Nearest }
    }

    /// Checks every key; errors name it.
    pub fn check(&self) -> anyhow::Result<()> {
        self.quant.check()?;
        self.gptq.check()?;
        anyhow::ensure!(self.calibration_batches >= 1, "`calibration_batches` must be at least 1");
        if let Some(f) = &self.file {
            anyhow::ensure!(!f.is_empty() && !f.contains('/'), "`file` must be a plain file name inside the run directory; found {f:?}");
        }
        Ok(())
    }

    /// The artifact's file name.
    pub(super) fn file_name(&self) -> String {
        self.file.clone().unwrap_or_else(|| format!("final_model.int{}.{}.pgqz", self.quant.bits, self.quant.codec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::stage::{param_keys, parse_params, schema_keys};

    #[allow(clippy::result_large_err)] // figment's error, as the stage's parsing gets it
    fn parse(text: &str) -> Result<ArtifactParams, figment::Error> {
        parse_params(text)
    }

    /// The library's keys are the stage's, with the library's defaults, and a misspelt one is
    /// refused with the keys it could have been.
    #[test]
    fn the_librarys_keys_are_the_stages_and_a_typo_is_refused() {
        let p = parse("bits = 6\nclip_sigmas = 11.0\ndamping = 0.02\ncalibration_batches = 3\nfile = \"a.pgqz\"").unwrap();
        assert_eq!((p.quant.bits, p.quant.clip_sigmas, p.gptq.damping, p.calibration_batches), (6, 11.0, 0.02, 3));
        assert_eq!(p.quant, QuantConfig { bits: 6, clip_sigmas: 11.0, ..QuantConfig::default() });
        assert_eq!(p.gptq, GptqConfig { damping: 0.02, ..GptqConfig::default() });
        let e = parse("clip_sigma = 11.0").unwrap_err().to_string();
        assert!(e.contains("unknown field") && e.contains("clip_sigma") && e.contains("clip_sigmas"), "{e}");
        let keys = param_keys::<ArtifactParams>();
        let lib = |s: schemars::Schema| schema_keys(&s);
        for k in lib(schemars::schema_for!(QuantConfig)).iter().chain(&lib(schemars::schema_for!(GptqConfig))) {
            assert!(keys.contains(&k.as_str()), "`{k}` is not a key of the stage");
        }
        assert!(parse("damping = -1.0").unwrap().check().unwrap_err().to_string().contains("`damping`"));
    }
}
