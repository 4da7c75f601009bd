//! What leaves a run: the quantized, compressed artifact and its codecs ([`quant`]), GPTQ for one
//! matrix with SD-clip scales ([`gptq`]), and the post-training round trip that writes it and
//! scores it ([`roundtrip`]). Plain weights files are the model's (`model::weights`).

pub mod gptq;
pub mod quant;
pub mod roundtrip;
