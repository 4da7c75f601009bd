//! What leaves a run: weights files ([`weights`]), the quantized, compressed artifact and its
//! codecs ([`quant`]), and the post-training round trip that writes it and scores it
//! ([`roundtrip`]).

pub mod quant;
pub mod roundtrip;
pub mod weights;
