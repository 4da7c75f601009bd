//! What leaves a run: the quantized, compressed artifact. [`quant`]: the quantization scheme
//! (round to nearest or GPTQ, per-row scales, fp16 passthrough); [`format`]: the artifact's
//! bytes (header, safetensors container, manifest) written and read back with every check;
//! [`gptq`]: the GPTQ algorithm for one matrix; [`hessian`]: the calibration pass that collects
//! each matrix's Hessian; [`codec`]: the compressors; [`shuffle`]: the byte shuffle; [`pergroup`]: the
//! per-group codec (the 04-27 record's), which runs [`lrzip`]; [`bundle`]: the
//! source bundle, the code bytes the challenge counts against its cap; [`roundtrip`]: the post-training round trip
//! that writes the artifact and scores it. Plain weights files are the model's
//! (`model::weights`).

pub mod bundle;
pub mod codec;
pub mod format;
pub mod gptq;
pub mod hessian;
pub mod lrzip;
pub mod pergroup;
pub mod quant;
pub mod roundtrip;
pub mod shuffle;
#[cfg(test)]
mod synthetic;
