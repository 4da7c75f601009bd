//! The sentencepiece tokenizer, in pure Rust.
//!
//! The `.model` file is parsed with `sentencepiece-model` (vocabulary, piece types, BOS id) and
//! encoded with `kitoken`. kitoken emulates the `nmt_nfkc` normaliser with NFKC plus the NMT
//! rules rather than the model's own character map. Against python sentencepiece on the demo
//! corpus (`scripts/check_tokenizer_parity.py`) that changes 29 of 8,551,102 tokens with the demo
//! tokenizer, 31 of 8,850,111 with the challenge's 1024-piece model and 32 of 5,846,478 with its
//! 8192-piece model (99.9995% or better), all in four documents holding U+200D zero-width
//! joiners: sentencepiece keeps their bytes, kitoken treats them as whitespace. Tabs are turned
//! into spaces before encoding, as sentencepiece does.

use std::path::Path;
#[cfg(feature = "tools")]
use std::path::PathBuf;

use anyhow::Context;
#[cfg(feature = "tools")]
use sha2::Digest;

/// A loaded sentencepiece model.
#[cfg(feature = "tools")]
pub struct Tokenizer {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Number of pieces (token ids are below it).
    pub vocab_size: usize,
    /// The BOS id (1 in the challenge's models).
    pub bos: u32,
    /// sha256 of the model file, hex.
    pub sha256: String,
    /// The model reserves the CaseOps operators as user-defined pieces
    /// ([`crate::data::caseops`]): its shards are of transformed text.
    pub caseops: bool,
    encoder: kitoken::Kitoken,
    /// The text each id stands for in the encoder's normalised text: U+2581 as a space, a byte
    /// piece as its byte, nothing for control, unknown and unused pieces.
    piece_bytes: Vec<Vec<u8>>,
}

/// Whether a parsed model holds every CaseOps operator as a user-defined piece.
fn reserves_caseops(model: &sentencepiece_model::SentencePieceModel) -> bool {
    use sentencepiece_model::Type;
    crate::data::caseops::OPERATORS.iter().all(|op| {
        let op = op.to_string();
        model.pieces().iter().any(|p| p.r#type() == Type::UserDefined && p.piece() == op)
    })
}

/// Whether the sentencepiece model at `path` reserves the CaseOps operators (U+E001..U+E004)
/// as user-defined pieces, the mark of a CaseOps tokenizer.
pub fn is_caseops(path: &Path) -> anyhow::Result<bool> {
    Ok(reserves_caseops(&read_model(path)?.1))
}

#[cfg(feature = "tools")]
fn piece_bytes_of(model: &sentencepiece_model::SentencePieceModel) -> Vec<Vec<u8>> {
    use sentencepiece_model::Type;
    model
        .pieces()
        .iter()
        .map(|p| match p.r#type() {
            Type::Normal | Type::UserDefined => crate::data::caseops::piece_text(p.piece()).as_bytes().to_vec(),
            Type::Byte => {
                let hex = p.piece().strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
                hex.and_then(|h| u8::from_str_radix(h, 16).ok()).map(|b| vec![b]).unwrap_or_default()
            }
            _ => Vec::new(),
        })
        .collect()
}

fn read_model(path: &Path) -> anyhow::Result<(Vec<u8>, sentencepiece_model::SentencePieceModel)> {
    let bytes = crate::runtime::files::read(path).with_context(|| format!("{}: cannot read the tokenizer", path.display()))?;
    let model = sentencepiece_model::SentencePieceModel::from_slice(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a sentencepiece model ({e})", path.display()))?;
    anyhow::ensure!(!model.pieces().is_empty(), "{}: not a sentencepiece model (it has no pieces)", path.display());
    anyhow::ensure!(
        model.pieces().len() <= 65_536,
        "{}: {} pieces do not fit uint16 shard tokens (at most 65,536)",
        path.display(),
        model.pieces().len()
    );
    Ok((bytes, model))
}

/// The vocabulary size of a sentencepiece model file.
pub fn vocab_size(path: &Path) -> anyhow::Result<usize> {
    Ok(read_model(path)?.1.pieces().len())
}

/// The BOS id of a sentencepiece model (1 unless its trainer spec says otherwise), checked to
/// be one of its pieces.
fn bos_of(path: &Path, model: &sentencepiece_model::SentencePieceModel) -> anyhow::Result<u32> {
    let bos = model.trainer().and_then(|t| t.bos_id).unwrap_or(1);
    anyhow::ensure!(bos >= 0 && (bos as usize) < model.pieces().len(), "{}: the model has no BOS piece (bos_id {bos})", path.display());
    Ok(bos as u32)
}

/// The BOS id of a sentencepiece model file, without building its encoder.
pub fn bos_id(path: &Path) -> anyhow::Result<u32> {
    bos_of(path, &read_model(path)?.1)
}

#[cfg(feature = "tools")]
impl Tokenizer {
    /// Loads a `.model` file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let (bytes, model) = read_model(path)?;
        let bos = bos_of(path, &model)?;
        let encoder = kitoken::Kitoken::from_sentencepiece_slice(&bytes)
            .map_err(|e| anyhow::anyhow!("{}: cannot build an encoder from this model: {e}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            vocab_size: model.pieces().len(),
            bos,
            sha256: crate::runtime::files::hex(&sha2::Sha256::digest(&bytes)),
            caseops: reserves_caseops(&model),
            encoder,
            piece_bytes: piece_bytes_of(&model),
        })
    }

    /// The text id `id` stands for in the encoder's normalised text (empty for an id outside
    /// the vocabulary).
    pub fn piece_bytes(&self, id: u32) -> &[u8] {
        self.piece_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// The encoder's normalisation of `fragment` as if it stood in the middle of a text (tabs
    /// as spaces, spaces as spaces rather than U+2581).
    pub fn normalize_fragment(&self, fragment: &str) -> String {
        let mut text = std::borrow::Cow::Owned(fragment.replace('\t', " "));
        self.encoder.config().normalize(&mut text, 1..2);
        text.replace('\u{2581}', " ")
    }

    /// Token ids of `text` (no BOS, no EOS).
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let text = if text.contains('\t') { std::borrow::Cow::Owned(text.replace('\t', " ")) } else { std::borrow::Cow::Borrowed(text) };
        self.encoder.encode(text.as_ref(), false).map_err(|e| anyhow::anyhow!("cannot encode: {e}"))
    }

    /// A document as the challenge stores it: BOS, then the text's ids, no EOS.
    pub fn encode_document(&self, text: &str) -> anyhow::Result<Vec<u16>> {
        let ids = self.encode(text)?;
        let mut out = Vec::with_capacity(ids.len() + 1);
        out.push(self.bos as u16);
        for id in ids {
            anyhow::ensure!((id as usize) < self.vocab_size, "the encoder produced id {id}, outside the vocabulary of {}", self.vocab_size);
            out.push(id as u16);
        }
        Ok(out)
    }

    /// Decodes ids back to the bytes of their text (a byte piece as its byte, so a cut in the
    /// middle of a character keeps its bytes).
    pub fn decode_bytes(&self, ids: &[u32]) -> anyhow::Result<Vec<u8>> {
        self.encoder.decode(ids, false).map_err(|e| anyhow::anyhow!("cannot decode: {e}"))
    }

    /// Decodes ids back to text (lossy UTF-8).
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        let bytes = self.encoder.decode(ids, false).map_err(|e| anyhow::anyhow!("cannot decode: {e}"))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Builds a small sentencepiece BPE model (the `.model` protobuf): `<pad> <s> </s>` (control,
/// ids 0-2), `<unk>` (3), the 256 byte-fallback pieces `<0x00>..<0xFF>` (4-259), then `normal`
/// pieces in merge order (best first), then `unused` pieces; identity normaliser, no dummy
/// prefix, whitespace escaped to U+2581. For tests and examples that need a real model without
/// training one.
#[cfg(feature = "tools")]
pub fn build_bpe_model(normal: &[&str], unused: &[&str]) -> Vec<u8> {
    build_bpe_model_reserving(&[], normal, unused)
}

/// [`build_bpe_model`] with `user_defined` pieces (ids 4 on, before the byte pieces, as
/// sentencepiece places them), e.g. the CaseOps operators.
#[cfg(feature = "tools")]
pub fn build_bpe_model_reserving(user_defined: &[&str], normal: &[&str], unused: &[&str]) -> Vec<u8> {
    use prost::Message;
    use sentencepiece_model::{ModelProto, ModelType, NormalizerSpec, SentencePiece, TrainerSpec, Type};
    let piece =
        |text: &str, kind: Type, score: f32| SentencePiece { piece: Some(text.into()), score: Some(score), r#type: Some(kind as i32) };
    let mut pieces = vec![
        piece("<pad>", Type::Control, 0.0),
        piece("<s>", Type::Control, 0.0),
        piece("</s>", Type::Control, 0.0),
        piece("<unk>", Type::Unknown, 0.0),
    ];
    pieces.extend(user_defined.iter().map(|p| piece(p, Type::UserDefined, 0.0)));
    pieces.extend((0..=255u8).map(|b| piece(&format!("<0x{b:02X}>"), Type::Byte, 0.0)));
    pieces.extend(normal.iter().enumerate().map(|(i, p)| piece(p, Type::Normal, -(i as f32))));
    pieces.extend(unused.iter().map(|p| piece(p, Type::Unused, 0.0)));
    ModelProto {
        pieces,
        trainer_spec: Some(TrainerSpec {
            model_type: Some(ModelType::Bpe as i32),
            byte_fallback: Some(true),
            unk_id: Some(3),
            bos_id: Some(1),
            eos_id: Some(2),
            pad_id: Some(0),
            ..Default::default()
        }),
        normalizer_spec: Some(NormalizerSpec {
            name: Some("identity".into()),
            add_dummy_prefix: Some(false),
            remove_extra_whitespaces: Some(false),
            escape_whitespaces: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}
