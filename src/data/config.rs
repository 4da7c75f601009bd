//! `[data]`: where the token shards and the tokenizer are.

use std::path::PathBuf;

use anyhow::Context;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `[data]`: the token shards and tokenizer the data stages read.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Glob of the training shards, e.g. "data/golf_en_sp1024/fineweb_train_*.bin".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train: Option<String>,
    /// Glob of the validation shards.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val: Option<String>,
    /// Path of the sentencepiece model the shards were made with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
}

impl DataConfig {
    /// The vocabulary size of `tokenizer`, if one is configured.
    pub fn tokenizer_vocab(&self) -> anyhow::Result<Option<usize>> {
        self.tokenizer.as_deref().map(super::tokenizer::vocab_size).transpose().context("`data.tokenizer`")
    }
}
