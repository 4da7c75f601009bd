//! The data path's library: the challenge's shard format ([`shard`]), the sentencepiece
//! tokenizer ([`tokenizer`]), the CaseOps case transform and its byte counts ([`caseops`]),
//! shards from text ([`prepare`]), the messages between data stages
//! with the loader's resumable state ([`batch`]), the training windows' order
//! ([`sampler`], the record's document packing: [`packed`]), memory maps that survive their file shrinking ([`guarded_map`]), and the host buffers a micro-batch is staged
//! in before its upload ([`staging`]).

pub mod batch;
pub mod caseops;
pub mod config;
pub mod guarded_map;
pub mod packed;
#[cfg(feature = "tools")]
pub mod prepare;
pub mod sampler;
pub mod shard;
pub mod staging;
pub mod tokenizer;
