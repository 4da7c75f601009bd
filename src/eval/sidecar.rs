//! The validation split's files, with the byte sidecars of CaseOps data.
//!
//! A run's data is CaseOps when its tokenizer (`data.tokenizer`) reserves the CaseOps operators
//! ([`crate::data::tokenizer::is_caseops`]); no other key says so. Its validation shards then
//! need their byte sidecars ([`crate::data::caseops::sidecar_path`]: `fineweb_val_bytes_N.bin`
//! beside `fineweb_val_N.bin`, written by `pipeline data prepare --caseops`), because bits per
//! byte is charged with the original text's bytes they hold ([`crate::eval::bpb`]). A glob such
//! as `fineweb_val_*.bin` matches the sidecars too: they are set apart from the token shards.
//!
//! Refused, naming the files: a CaseOps shard without its sidecar, a sidecar whose length is not
//! its shard's, and sidecars among the shards of a tokenizer that is not CaseOps (they would be
//! read as tokens).

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::data::caseops::{is_sidecar_of_any, sidecar_path};
use crate::data::shard::{ShardFile, glob_sorted, read_header};

/// The files of a validation split.
#[derive(Clone, Debug)]
pub struct ValFiles {
    /// The token shards, in order.
    pub shards: Vec<PathBuf>,
    /// CaseOps data: each shard's byte sidecar, checked to exist and to match its length.
    pub sidecars: Option<Vec<PathBuf>>,
}

/// The validation files `data.val` = `pattern` matches, with their sidecars when `tokenizer` is
/// a CaseOps model; only the headers are read.
pub fn val_files(pattern: &str, tokenizer: Option<&Path>) -> anyhow::Result<ValFiles> {
    let paths = glob_sorted(pattern).context("`data.val`")?;
    anyhow::ensure!(!paths.is_empty(), "`data.val` = {pattern:?} matches no file");
    let caseops = match tokenizer {
        Some(t) => crate::data::tokenizer::is_caseops(t).with_context(|| format!("`data.tokenizer` = {}", t.display()))?,
        None => false,
    };
    let (shards, sidecars): (Vec<PathBuf>, Vec<PathBuf>) = paths.iter().cloned().partition(|p| !is_sidecar_of_any(p, &paths));
    if !caseops {
        if let Some(side) = sidecars.first() {
            let tok = tokenizer.map_or_else(|| "(none)".to_string(), |t| t.display().to_string());
            anyhow::bail!(
                "`data.val` = {pattern:?} matches {}, the byte sidecar of a CaseOps shard, but the tokenizer {tok} does not reserve the CaseOps operators: use the CaseOps tokenizer the shards were made with, or a glob of the token shards only",
                side.display()
            );
        }
        return Ok(ValFiles { shards, sidecars: None });
    }
    let tok = tokenizer.map(|t| t.display().to_string()).unwrap_or_default();
    let mut sides = Vec::with_capacity(shards.len());
    for shard in &shards {
        let side = sidecar_path(shard).with_context(|| {
            format!("the validation shard {} has no name a byte sidecar can be found by (NAME_NNNNNN.bin)", shard.display())
        })?;
        anyhow::ensure!(
            side.is_file(),
            "the validation shard {} is CaseOps data (the tokenizer {tok} reserves the CaseOps operators) but its byte sidecar {} is missing: make the split with `pipeline data prepare --caseops` (`data.val`)",
            shard.display(),
            side.display()
        );
        let tokens = read_header(shard)?.1;
        let values = read_header(&side)?.1;
        anyhow::ensure!(
            values == tokens,
            "the byte sidecar {} holds {values} values but its validation shard {} holds {tokens} tokens; they must match",
            side.display(),
            shard.display()
        );
        sides.push(side);
    }
    Ok(ValFiles { shards, sidecars: Some(sides) })
}

/// The sidecars' values, concatenated in shard order (one per token of the split); `None` for
/// data that is not CaseOps.
pub fn read_stream_bytes(files: &ValFiles) -> anyhow::Result<Option<Vec<u16>>> {
    let Some(sides) = &files.sidecars else { return Ok(None) };
    Ok(Some(ShardFile::read_concatenated(sides)?))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use crate::data::caseops::OPERATORS;
    use crate::data::prepare::{PrepareOptions, ValSplit, prepare};
    use crate::eval::validation::{ValSettings, Validator, check_split};

    /// Documents with capitals, ALL CAPS, accents, CJK, emoji and an operator character.
    const DOCS: [&str; 4] = [
        "The NASA Launch went WELL, said Dr. McDonald.",
        "Café au lait à Paris: ÉCOLE 東京 😀 and iPhone\u{E001}x.",
        "plain lower text, no capitals at all",
        "Training Text That Is Not In The Val Split.",
    ];

    /// A CaseOps model (operators reserved) or a plain one, and `DOCS` prepared with it into a
    /// fresh folder (the first three are val). Returns (folder, model, val settings).
    fn setup(name: &str, caseops: bool) -> (PathBuf, PathBuf, ValSettings) {
        let dir = std::env::temp_dir().join(format!("pipeline-sidecar-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ops: Vec<String> = OPERATORS.iter().map(|c| c.to_string()).collect();
        let ops: Vec<&str> = if caseops { ops.iter().map(String::as_str).collect() } else { Vec::new() };
        let normal = ["▁the", "th", "he", "▁a", "an", "▁", "e", "t", "h", "a", "n", "s", "o", "i", "l", "c"];
        let model = dir.join("tok.model");
        std::fs::write(&model, crate::data::tokenizer::build_bpe_model_reserving(&ops, &normal, &[])).unwrap();
        let input = dir.join("docs.jsonl");
        let lines: Vec<String> = DOCS.iter().map(|d| serde_json::json!({ "text": d }).to_string()).collect();
        std::fs::write(&input, lines.join("\n")).unwrap();
        let opts = PrepareOptions {
            tokenizer: model.clone(),
            inputs: vec![input],
            out: dir.join("shards"),
            val: ValSplit::Docs(3),
            shard_tokens: 40,
            force: false,
            caseops,
        };
        prepare(&opts).unwrap();
        let vocab = crate::data::tokenizer::vocab_size(&model).unwrap();
        let settings = ValSettings {
            val: Some(dir.join("shards/fineweb_val_*.bin").display().to_string()),
            tokenizer: Some(model.clone()),
            seq_len: 1,
            val_batch_tokens: 64,
            val_max_tokens: 0,
            vocab,
            packed: false,
        };
        (dir, model, settings)
    }

    fn val_bytes(dir: &Path) -> Vec<u16> {
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir.join("shards"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("fineweb_val_bytes_"))
            .collect();
        names.sort();
        let files = super::ValFiles { shards: Vec::new(), sidecars: Some(names) };
        super::read_stream_bytes(&files).unwrap().unwrap()
    }

    /// The sidecar adds up to the original documents' UTF-8 bytes, and bpb through it (every
    /// scoring path's accumulator) is Σ nll / (ln 2 · original bytes) for fixed per-token losses;
    /// the tables would have counted the transformed text.
    #[test]
    fn bpb_is_charged_on_the_original_bytes() {
        let (dir, _, settings) = setup("bpb", true);
        let original: u64 = DOCS[..3].iter().map(|d| d.len() as u64).sum();
        let side = val_bytes(&dir);
        assert_eq!(side.iter().map(|&b| u64::from(b)).sum::<u64>(), original);
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("shards/manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["val"]["sidecar_bytes"], original);
        assert_eq!(manifest["text_transform"], crate::data::caseops::NAME);
        assert!(manifest["val"]["byte_sidecars"].as_array().unwrap().len() >= 2, "a shard of 40 tokens cuts the split");

        let v = Validator::load(&settings, 1).unwrap();
        assert_eq!(v.tokens().len(), side.len(), "the sidecars are not read as token shards");
        let loss = |y: &[u32]| y.iter().map(|&t| 0.25 + f64::from(t % 7) / 10.0).sum::<f64>();
        let acc = v.run_with(&mut |_, y, _| Ok(loss(y)), 1, || true).unwrap().unwrap();
        let nll = loss(&v.tokens()[1..]);
        assert_eq!(acc.bytes(), original);
        let by_hand = nll / (std::f64::consts::LN_2 * original as f64);
        assert!((acc.val_bpb() - by_hand).abs() < 1e-12, "{} vs {by_hand}", acc.val_bpb());
        let tables_bytes = v.tables().count_bytes(&v.tokens()[..v.targets()], &v.tokens()[1..]);
        assert_ne!(tables_bytes, original, "the tables count the transformed text");
        // Sequences of 4, two a batch, the stream cut by `val_max_tokens`: each batch's targets
        // are charged their own stream positions, the cut stream's prefix of the sidecar.
        let cut = ValSettings { seq_len: 4, val_batch_tokens: 8, val_max_tokens: 30, ..settings.clone() };
        let v = Validator::load(&cut, 1).unwrap();
        let n = v.targets();
        assert!(n >= 16 && n < side.len() - 1 && n.is_multiple_of(4), "{n} targets of {}", side.len() - 1);
        let acc = v.run_with(&mut |_, y, _| Ok(loss(y)), 1, || true).unwrap().unwrap();
        assert_eq!(acc.bytes(), side[1..=n].iter().map(|&b| u64::from(b)).sum::<u64>());
        assert_eq!(acc.tokens(), n as u64);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A CaseOps split without a sidecar, or with one of the wrong length, is refused at config
    /// check time naming the shard and the sidecar; sidecars read by a plain tokenizer too.
    #[test]
    fn a_missing_or_mismatched_sidecar_is_refused() {
        let (dir, _, settings) = setup("refuse", true);
        check_split(&settings).unwrap();
        let shard = dir.join("shards/fineweb_val_000000.bin");
        let side = dir.join("shards/fineweb_val_bytes_000000.bin");
        let kept = std::fs::read(&side).unwrap();
        crate::data::shard::write_shard(&side, &[1, 2, 3]).unwrap();
        let e = format!("{:#}", check_split(&settings).unwrap_err());
        assert!(e.contains(&*shard.to_string_lossy()) && e.contains(&*side.to_string_lossy()) && e.contains("3 values"), "{e}");
        std::fs::remove_file(&side).unwrap();
        let e = format!("{:#}", check_split(&settings).unwrap_err());
        assert!(e.contains(&*shard.to_string_lossy()) && e.contains(&*side.to_string_lossy()) && e.contains("missing"), "{e}");
        assert!(Validator::load(&settings, 1).is_err());
        std::fs::write(&side, kept).unwrap();
        let (plain_dir, plain, _) = setup("refuse-plain", false);
        let e = format!("{:#}", check_split(&ValSettings { tokenizer: Some(plain), ..settings.clone() }).unwrap_err());
        assert!(e.contains("fineweb_val_bytes_") && e.contains("does not reserve"), "{e}");
        let _ = (std::fs::remove_dir_all(dir), std::fs::remove_dir_all(plain_dir));
    }

    /// `--caseops` with a model that does not reserve the operators is refused naming it, and a
    /// CaseOps model without `--caseops` too.
    #[test]
    fn prepare_refuses_a_tokenizer_of_the_wrong_kind() {
        let (dir, caseops_model, _) = setup("kinds", true);
        let (plain_dir, plain_model, _) = setup("kinds-plain", false);
        let opts = |model: &Path, caseops| PrepareOptions {
            tokenizer: model.to_path_buf(),
            inputs: vec![dir.join("docs.jsonl")],
            out: dir.join("again"),
            val: ValSplit::Docs(1),
            shard_tokens: 1000,
            force: true,
            caseops,
        };
        let e = format!("{:#}", prepare(&opts(&plain_model, true)).unwrap_err());
        assert!(e.contains(&*plain_model.to_string_lossy()) && e.contains("does not reserve"), "{e}");
        let e = format!("{:#}", prepare(&opts(&caseops_model, false)).unwrap_err());
        assert!(e.contains(&*caseops_model.to_string_lossy()) && e.contains("--caseops"), "{e}");
        let _ = (std::fs::remove_dir_all(dir), std::fs::remove_dir_all(plain_dir));
    }
}
