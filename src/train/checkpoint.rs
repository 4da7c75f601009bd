//! Checkpoints: everything a killed or finished run needs to go on as if it had never stopped.
//!
//! A checkpoint holds the parameters after an optimizer step, the optimizer's state, the weight
//! averager's state, the sampler's position and the data-order fingerprint, so that
//! `pipeline run --resume RUN_DIR` continues the same run (same batches, same updates) from that
//! step, and says clearly why when it cannot.
//!
//! # On disk
//!
//! `RUN_DIR/checkpoints/step_{step:08}.safetensors` ([`DIR`], [`file_name`]): one plain
//! safetensors file, readable by any safetensors reader (`safetensors.safe_open(path, "pt")`).
//!
//! - Tensors, each in its own dtype, names prefixed by what they are: `model.` (parameters, the
//!   `state_dict` names), `optim.` (optimizer state), `avg.` (averaged weights).
//! - Header metadata (`__metadata__`, string to string):
//!   - `pipeline.checkpoint`: [`CheckpointMeta`] as JSON. Its `version` is [`VERSION`]; a file with
//!     a higher one is refused as written by a newer `pipeline`. `train_ms` and `train_loss` are
//!     JSON strings (`"3.2810974"`, `"NaN"`) so that they come back bit for bit, NaN included.
//!   - `pipeline.crc32`: 8 lower-case hex digits, the CRC-32 (IEEE, `crc32fast`) of the whole file
//!     as written with these 8 digits set to `00000000`. It covers the length prefix, the header
//!     (tensor table and metadata) and every tensor byte: a flipped bit anywhere is caught on load.
//!
//! Files are written atomically ([`crate::runtime::rundir::write_atomic`]: `.NAME.tmp-PID` in the same
//! folder, fsync, rename, fsync of the folder), so a checkpoint file is whole or absent; a full
//! disk leaves an error naming the file, the older checkpoints, and no temporary file. [`prune`]
//! keeps the newest few and removes temporary files that killed processes left behind.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::data::guarded_map::GuardedMap;

/// Subdirectory of a run directory holding checkpoints.
pub const DIR: &str = "checkpoints";
/// Format version written into every checkpoint.
pub const VERSION: u32 = 1;

/// Header metadata key of the [`CheckpointMeta`] JSON.
const META_KEY: &str = "pipeline.checkpoint";
/// Header metadata key of the CRC-32.
const CRC_KEY: &str = "pipeline.crc32";
/// What the CRC digits are while the CRC is computed.
const CRC_PLACEHOLDER: &[u8; 8] = b"00000000";
/// How the CRC entry appears in the (compact JSON) header, up to its digits.
const CRC_NEEDLE: &[u8] = b"\"pipeline.crc32\":\"";
/// The safetensors limit on the header size; a larger length prefix means "not safetensors".
const MAX_HEADER: u64 = 100_000_000;

/// What a checkpoint says besides its tensors (JSON in the safetensors header metadata under key
/// `"pipeline.checkpoint"`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckpointMeta {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// Optimizer steps taken.
    pub step: u64,
    /// Training time so far, ms (validation excluded).
    #[serde(with = "exact_f64")]
    pub train_ms: f64,
    /// Last step's train loss.
    #[serde(with = "exact_f64")]
    pub train_loss: f64,
    /// The sampler's state after the step's last micro-batch (None for runs whose input has no
    /// state).
    pub loader: Option<crate::data::batch::LoaderState>,
    /// Several ranks whose samplers' states differ (the shuffled sampler): every rank's, in
    /// rank order (`loader` is rank 0's); empty otherwise, and in checkpoints made before it
    /// was kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_loaders: Vec<crate::data::batch::LoaderState>,
    /// Rolling data-order fingerprint up to this step.
    pub rolling: u64,
    /// Fingerprint of the training data (hex string; computed by the caller, see
    /// [`data_fingerprint`]).
    pub data: String,
    /// The run's seed.
    pub seed: u64,
    /// The `[model]` table as JSON (for messages).
    pub model: serde_json::Value,
    /// Weight averager state: kind (`"ema"` | `"swa"`) and how many snapshots it holds; its
    /// tensors are under `"avg."`.
    pub averager: Option<AveragerMeta>,
    /// Anything else the trainer keeps (validation history...), opaque here.
    pub extra: serde_json::Value,
}

/// A weight averager's state besides its tensors.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AveragerMeta {
    /// `"ema"` or `"swa"`.
    pub kind: String,
    /// Snapshots folded in.
    pub count: u64,
}

/// A loaded checkpoint. Tensor names are prefixed: `"model."` (parameters), `"optim."`
/// (optimizer state), `"avg."` (averaged weights).
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The file it was loaded from.
    pub path: PathBuf,
    /// Everything but the tensors.
    pub meta: CheckpointMeta,
    /// Every tensor, on the CPU, in the dtype it was saved in, by full (prefixed) name.
    pub tensors: HashMap<String, Tensor>,
}

impl Checkpoint {
    /// Tensors under `prefix` (`"model."` etc.) with the prefix stripped.
    pub fn section(&self, prefix: &str) -> HashMap<String, Tensor> {
        self.tensors.iter().filter_map(|(n, t)| n.strip_prefix(prefix).map(|rest| (rest.to_string(), t.clone()))).collect()
    }
}

/// File name for a step: `step_{step:08}.safetensors`.
pub fn file_name(step: u64) -> String {
    format!("step_{step:08}.safetensors")
}

/// The step of a checkpoint file name (`step_<digits>.safetensors`), else None.
fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?.strip_suffix(".safetensors")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Serialises `meta` and `tensors` as a checkpoint file's bytes (see the module doc): safetensors
/// (which lays the data out sorted by dtype then name, whatever the order given) with the meta
/// JSON and a CRC-32 of the whole file in the header metadata. Tensors may be of any dtype but the
/// sub-byte ones (F32, BF16, F16, F64, F8E4M3, I64, I32, I16, U32, U8) and on any device (they
/// are copied to the CPU). `meta.version` must be [`VERSION`]; names must be unique.
pub fn encode(meta: &CheckpointMeta, tensors: &[(String, Tensor)]) -> anyhow::Result<Vec<u8>> {
    if meta.version != VERSION {
        bail!("cannot encode a checkpoint with format version {} (this build writes version {VERSION})", meta.version);
    }
    let mut seen = HashSet::with_capacity(tensors.len());
    let mut cpu = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            bail!("cannot encode a checkpoint: tensor `{name}` is given twice");
        }
        match t.dtype() {
            DType::F32
            | DType::BF16
            | DType::F16
            | DType::F64
            | DType::F8E4M3
            | DType::I64
            | DType::I32
            | DType::I16
            | DType::U32
            | DType::U8 => {}
            other => bail!("cannot encode a checkpoint: tensor `{name}` has dtype {other:?}, which checkpoints do not store"),
        }
        let t = t.to_device(&Device::Cpu).with_context(|| format!("cannot encode a checkpoint: cannot copy tensor `{name}` to the CPU"))?;
        cpu.push((name.as_str(), t));
    }
    let meta_json = serde_json::to_string(meta).context("cannot encode the checkpoint metadata as JSON")?;
    let placeholder = String::from_utf8_lossy(CRC_PLACEHOLDER).into_owned();
    let info = HashMap::from([(META_KEY.to_string(), meta_json), (CRC_KEY.to_string(), placeholder)]);
    let mut bytes = safetensors::serialize(cpu, Some(info)).context("cannot encode the checkpoint tensors as safetensors")?;
    let at = crc_digits_at(&bytes).context("cannot encode a checkpoint: the CRC entry is missing from the safetensors header")?;
    let crc = checksum(&bytes, at);
    bytes[at..at + CRC_PLACEHOLDER.len()].copy_from_slice(format!("{crc:08x}").as_bytes());
    Ok(bytes)
}

/// Where the 8 CRC digits start in a safetensors file's bytes (searched in the header only).
fn crc_digits_at(bytes: &[u8]) -> Option<usize> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    let i = header.windows(CRC_NEEDLE.len()).position(|w| w == CRC_NEEDLE)?;
    let at = 8 + i + CRC_NEEDLE.len();
    (bytes.get(at + CRC_PLACEHOLDER.len()) == Some(&b'"')).then_some(at)
}

/// CRC-32 of `bytes` with the 8 digits at `at` read as [`CRC_PLACEHOLDER`].
fn checksum(bytes: &[u8], at: usize) -> u32 {
    let end = (at + CRC_PLACEHOLDER.len()).min(bytes.len());
    let mut h = crc32fast::Hasher::new();
    h.update(&bytes[..at.min(end)]);
    h.update(CRC_PLACEHOLDER);
    h.update(&bytes[end..]);
    h.finalize()
}

/// Writes `bytes` atomically as `dir/file_name(step)` (creating `dir`), returns the path. Errors
/// name the path; a failed write (full disk, EFBIG, a folder in the way) leaves the older
/// checkpoints and no temporary file.
pub fn write(dir: &Path, step: u64, bytes: &[u8]) -> anyhow::Result<PathBuf> {
    let path = dir.join(file_name(step));
    fs::create_dir_all(dir)
        .with_context(|| format!("cannot write checkpoint {}: cannot create the folder {}", path.display(), dir.display()))?;
    // write_atomic's error names the path already.
    crate::runtime::rundir::write_atomic(&path, bytes)?;
    Ok(path)
}

/// Checkpoint files (`step_<digits>.safetensors`, regular files) in `dir`, sorted by step
/// ascending; temporary files and other names are ignored. A missing `dir` has none.
pub fn list(dir: &Path) -> anyhow::Result<Vec<(u64, PathBuf)>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot list the checkpoints in {}", dir.display())),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list the checkpoints in {}", dir.display()))?;
        let Some(step) = entry.file_name().to_str().and_then(parse_step) else { continue };
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// True for `.step_<digits>.safetensors.tmp-<pid>` with a pid other than `me`.
fn is_stale_temp(name: &str, me: u32) -> bool {
    let Some((file, pid)) = name.strip_prefix('.').and_then(|n| n.rsplit_once(".tmp-")) else { return false };
    parse_step(file).is_some() && pid.parse::<u32>().is_ok_and(|pid| pid != me)
}

/// Removes all but the newest `keep` checkpoints in `dir` (`keep` 0 counts as 1: the newest is
/// never removed) and the temporary files (`.step_*.safetensors.tmp-PID`) that processes other
/// than this one left (killed mid-write); returns what it removed. Other files are left alone.
pub fn prune(dir: &Path, keep: usize) -> anyhow::Result<Vec<PathBuf>> {
    let files = list(dir)?;
    let doomed = files.len().saturating_sub(keep.max(1));
    let mut removed = Vec::new();
    let mut remove = |path: &Path| -> anyhow::Result<()> {
        match fs::remove_file(path) {
            Ok(()) => {
                removed.push(path.to_path_buf());
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("cannot remove old checkpoint file {}", path.display())),
        }
    };
    for (_, path) in &files[..doomed] {
        remove(path)?;
    }
    let me = std::process::id();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e).with_context(|| format!("cannot list the checkpoints in {}", dir.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list the checkpoints in {}", dir.display()))?;
        if entry.file_name().to_str().is_some_and(|n| is_stale_temp(n, me)) && entry.file_type().is_ok_and(|t| t.is_file()) {
            remove(&entry.path())?;
        }
    }
    Ok(removed)
}

/// A checkpoint file's bytes, mapped (a checkpoint can be gigabytes; files are only ever replaced
/// by rename, never rewritten in place).
/// Guarded: a file truncated while it is read reads zeros past its end, which [`load`] and
/// [`check`] refuse, instead of the process dying of SIGBUS.
fn map(path: &Path) -> anyhow::Result<GuardedMap> {
    crate::runtime::files::ensure_regular(path).context("not a checkpoint")?;
    let file = fs::File::open(path).with_context(|| format!("cannot read checkpoint {}", path.display()))?;
    let len = file.metadata().with_context(|| format!("cannot read checkpoint {}", path.display()))?.len();
    if len == 0 {
        bail!("checkpoint {} is empty (truncated: its write never finished?)", path.display());
    }
    GuardedMap::map(&file).with_context(|| format!("cannot read checkpoint {}", path.display()))
}

/// The error for a checkpoint that shrank while it was read, if it did.
fn whole(path: &Path, bytes: &GuardedMap) -> anyhow::Result<()> {
    if bytes.damaged() {
        bail!("checkpoint {} shrank while it was read (something truncated it): it cannot be loaded", path.display());
    }
    Ok(())
}

/// Parses and checks a checkpoint file's bytes: safetensors structure, metadata present, version
/// known, CRC. Errors are whole sentences naming `path`.
fn verify<'a>(path: &Path, bytes: &'a [u8]) -> anyhow::Result<(CheckpointMeta, safetensors::SafeTensors<'a>)> {
    let p = path.display();
    let st = match safetensors::SafeTensors::deserialize(bytes) {
        Ok(st) => st,
        Err(e) => bail!("checkpoint {p} {}", diagnose(bytes, &e)),
    };
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).with_context(|| format!("checkpoint {p} has a corrupt header"))?;
    let info = header.metadata().as_ref();
    let Some(meta_json) = info.and_then(|m| m.get(META_KEY)) else {
        bail!(
            "{p} is not a pipeline checkpoint: it is a safetensors file without the `{META_KEY}` metadata (weights alone, e.g. a run's final \
             weights, cannot be resumed from)"
        );
    };
    let raw: serde_json::Value =
        serde_json::from_str(meta_json).with_context(|| format!("checkpoint {p} is corrupt: its `{META_KEY}` metadata is not JSON"))?;
    match raw.get("version").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(VERSION) => {}
        Some(v) if v > u64::from(VERSION) => bail!(
            "checkpoint {p} was written by a newer pipeline (checkpoint format version {v}; this build reads version {VERSION}): \
             resume it with that version"
        ),
        Some(v) => bail!("checkpoint {p} has an unknown format version {v} (this build reads version {VERSION})"),
        None => bail!("checkpoint {p} is corrupt: its `{META_KEY}` metadata has no format version"),
    }
    let Some(stored) = info.and_then(|m| m.get(CRC_KEY)) else {
        bail!("checkpoint {p} is corrupt: it has no `{CRC_KEY}` entry to check its data against");
    };
    let stored = (stored.len() == 8).then(|| u32::from_str_radix(stored, 16).ok()).flatten();
    let at = crc_digits_at(bytes);
    let (Some(stored), Some(at)) = (stored, at) else {
        bail!("checkpoint {p} is corrupt: its `{CRC_KEY}` entry is malformed");
    };
    let actual = checksum(bytes, at);
    if actual != stored {
        bail!(
            "checkpoint {p} is corrupt: crc mismatch (the file says {stored:08x}, its bytes give {actual:08x}); it was damaged after it \
             was written"
        );
    }
    let meta: CheckpointMeta =
        serde_json::from_value(raw).with_context(|| format!("checkpoint {p} has metadata this build cannot read (`{META_KEY}`)"))?;
    Ok((meta, st))
}

/// Why `bytes` are not a well-formed safetensors file, in words (after "checkpoint PATH ").
fn diagnose(bytes: &[u8], error: &safetensors::SafeTensorError) -> String {
    let len = bytes.len() as u64;
    let Some(prefix) = bytes.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()) else {
        return format!("is truncated: it has {len} bytes, fewer than the 8 of a safetensors length prefix");
    };
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER {
        return format!("is not a safetensors file (its first 8 bytes give a header length of {n})");
    }
    if 8 + n > len {
        return format!("is truncated: its header needs {} bytes, the file has {len}", 8 + n);
    }
    // The header is there: compare the data it describes with what the file holds.
    let header = &bytes[8..(8 + n) as usize];
    let Ok(serde_json::Value::Object(entries)) = serde_json::from_slice::<serde_json::Value>(header) else {
        return format!("is not a safetensors file, or its header is corrupt ({error})");
    };
    let data_end = entries
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let expected = 8 + n + data_end;
    if expected > len {
        format!("is truncated: its header describes {expected} bytes, the file has {len}")
    } else if expected < len {
        format!("is corrupt: {} bytes follow the tensor data its header describes", len - expected)
    } else {
        format!("is corrupt: its safetensors header is invalid ({error})")
    }
}

/// Loads and verifies one checkpoint file: safetensors structure, metadata present, version
/// known, CRC matches; tensors come back on the CPU in their saved dtype. Errors name the file
/// and say what is wrong (truncated, corrupt (crc mismatch), not a checkpoint, newer version).
pub fn load(path: &Path) -> anyhow::Result<Checkpoint> {
    let bytes = map(path)?;
    let verified = verify(path, &bytes);
    whole(path, &bytes)?;
    let (meta, st) = verified?;
    let mut tensors = HashMap::with_capacity(st.len());
    for (name, view) in st.iter() {
        let dtype = DType::try_from(view.dtype()).map_err(|_| {
            anyhow::anyhow!("checkpoint {} holds tensor `{name}` of dtype {:?}, which pipeline cannot load", path.display(), view.dtype())
        })?;
        let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)
            .with_context(|| format!("checkpoint {}: cannot load tensor `{name}`", path.display()))?;
        tensors.insert(name.to_string(), t);
    }
    whole(path, &bytes)?;
    Ok(Checkpoint { path: path.to_path_buf(), meta, tensors })
}

/// Checks a checkpoint file as [`load`] does, without building its tensors.
fn check(path: &Path) -> anyhow::Result<CheckpointMeta> {
    let bytes = map(path)?;
    let meta = verify(path, &bytes).map(|(meta, _)| meta);
    whole(path, &bytes)?;
    meta
}

/// What `--resume ARG` names: a checkpoint file, or a run directory (the newest file of its
/// `checkpoints/`; a `checkpoints/` folder itself is accepted too). When that newest file does not
/// load, the error names it and why, and offers the newest earlier file that does ("the previous
/// good checkpoint is PATH (step N): resume from it with `--resume PATH`"), or says there is none.
pub fn resolve(arg: &Path) -> anyhow::Result<Checkpoint> {
    let a = arg.display();
    let info = fs::metadata(arg).with_context(|| format!("cannot resume from {a}: no such checkpoint file or run directory"))?;
    if !info.is_dir() {
        return load(arg);
    }
    let dir = if arg.join(DIR).is_dir() { arg.join(DIR) } else { arg.to_path_buf() };
    let files = list(&dir)?;
    let Some((_, newest)) = files.last() else {
        bail!("cannot resume from {a}: the run directory has no checkpoints (no {a}/{DIR}/step_*.safetensors)");
    };
    let e = match load(newest) {
        Ok(c) => return Ok(c),
        // Not a bad file but a failing system (permissions, the disk): say so, keeping the
        // system's error for the exit code.
        Err(e) if crate::runtime::files::is_system_error(&e) => {
            return Err(e.context(format!("cannot resume from {a}: its newest checkpoint {} cannot be read", newest.display())));
        }
        Err(e) => e,
    };
    let earlier = &files[..files.len() - 1];
    if let Some((step, good)) = earlier.iter().rev().find(|(_, p)| check(p).is_ok()) {
        bail!(
            "cannot resume from {a}: its newest checkpoint does not load: {e:#}. The previous good checkpoint is {} (step {step}): \
             resume from it with `--resume {}`",
            good.display(),
            good.display()
        );
    }
    if earlier.is_empty() {
        bail!("cannot resume from {a}: its only checkpoint does not load: {e:#}. There is no good checkpoint to resume from");
    }
    let d = dir.display();
    let others = match earlier.len() {
        1 => format!("The earlier checkpoint in {d} does not load either"),
        n => format!("None of the {n} earlier checkpoints in {d} loads either"),
    };
    bail!("cannot resume from {a}: its newest checkpoint does not load: {e:#}. {others}: there is no good checkpoint to resume from")
}

/// Fingerprint of training data files: 16 hex digits of a sha256 over the (file name, byte size)
/// pairs of `paths`, sorted, so that it is stable across runs and data folders but changes when a
/// shard is added, removed, renamed or resized. Errors name the file that cannot be read.
pub fn data_fingerprint(paths: &[PathBuf]) -> anyhow::Result<String> {
    let mut items = paths
        .iter()
        .map(|p| {
            let size = fs::metadata(p).with_context(|| format!("cannot read training data file {}", p.display()))?.len();
            let name = p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
            Ok((name, size))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    items.sort();
    let mut h = sha2::Sha256::new();
    for (name, size) in &items {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(size.to_le_bytes());
    }
    Ok(crate::runtime::files::hex(&h.finalize()[..8]))
}

/// f64 fields as JSON strings of Rust's shortest round-trip form (`"0.1"`, `"NaN"`, `"inf"`):
/// JSON has no NaN (serde_json writes `null`) and serde_json's default number parser may be one
/// ulp off. Reads strings, numbers and `null` (NaN).
mod exact_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{x:?}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Number(f64),
            Text(String),
        }
        match Option::<Repr>::deserialize(d)? {
            None => Ok(f64::NAN),
            Some(Repr::Number(x)) => Ok(x),
            Some(Repr::Text(s)) => s.parse().map_err(|_| serde::de::Error::custom(format!("`{s}` is not a number"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::batch::{LoaderState, ShardCursor};

    /// A fresh folder for one test, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let d = std::env::temp_dir().join(format!("pipeline-checkpoint-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            TempDir(d)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn meta(step: u64) -> CheckpointMeta {
        CheckpointMeta {
            version: VERSION,
            step,
            train_ms: 12345.678901234567,
            train_loss: 7.6126008513204315, // serde_json's own parser reads this one ulp off
            loader: Some(LoaderState::Shuffled {
                rng: u64::MAX - 3,
                shards: vec![ShardCursor { index: 2, epoch: 1, consumed: 17 }, ShardCursor { index: 0, epoch: 0, consumed: 0 }],
                micro_batches: 40,
                rolling: 0xdead_beef_cafe_f00d,
            }),
            rank_loaders: Vec::new(),
            rolling: 0x0123_4567_89ab_cdef,
            data: "00112233aabbccdd".into(),
            seed: 1337,
            model: serde_json::json!({ "num_layers": 2, "model_dim": 16 }),
            averager: Some(AveragerMeta { kind: "ema".into(), count: 5 }),
            extra: serde_json::json!({ "val": [[10, 3.5]], "note": "\"quoted\" pipeline.crc32" }),
        }
    }

    fn tensors() -> Vec<(String, Tensor)> {
        let dev = Device::Cpu;
        let w = Tensor::new(&[[1.5f32, -0.0, f32::NAN], [f32::INFINITY, 1e-40, -7.25]], &dev).unwrap();
        vec![
            ("model.w".into(), w.clone()),
            ("model.wt".into(), w.t().unwrap()), // not contiguous
            ("optim.adam.m".into(), Tensor::new(&[0.1f32, 0.2, 0.3], &dev).unwrap().to_dtype(DType::BF16).unwrap()),
            ("optim.adam.step".into(), Tensor::new(&[i64::MIN, -1, 0, i64::MAX], &dev).unwrap()),
            ("avg.w".into(), w.to_dtype(DType::F64).unwrap()),
            ("model.ids".into(), Tensor::new(&[3u32, 4], &dev).unwrap()),
        ]
    }

    /// The bytes of a tensor, row-major, little-endian.
    fn raw(t: &Tensor) -> Vec<u8> {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            DType::F32 => t.to_vec1::<f32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::F64 => t.to_vec1::<f64>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::BF16 => t.to_vec1::<half::bf16>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::I64 => t.to_vec1::<i64>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::U32 => t.to_vec1::<u32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
            other => panic!("{other:?}"),
        }
    }

    fn err<T>(r: anyhow::Result<T>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => format!("{e:#}"),
        }
    }

    /// Writes a valid checkpoint for `step` into `dir`.
    fn save(dir: &Path, step: u64) -> PathBuf {
        write(dir, step, &encode(&meta(step), &tensors()).unwrap()).unwrap()
    }

    /// Flips one bit of the last byte (tensor data) of a file.
    fn flip_last(path: &Path) {
        let mut b = fs::read(path).unwrap();
        *b.last_mut().unwrap() ^= 0x01;
        fs::write(path, b).unwrap();
    }

    #[test]
    fn round_trip_is_exact() {
        let d = TempDir::new("roundtrip");
        let path = save(&d.0, 42);
        assert_eq!(path, d.0.join("step_00000042.safetensors"));
        let c = load(&path).unwrap();
        assert_eq!(c.path, path);
        assert_eq!(c.meta, meta(42));
        assert_eq!(c.meta.train_loss.to_bits(), meta(42).train_loss.to_bits());
        let given = tensors();
        assert_eq!(c.tensors.len(), given.len());
        for (name, t) in &given {
            let back = &c.tensors[name];
            assert_eq!(back.dtype(), t.dtype(), "{name}");
            assert_eq!(back.dims(), t.dims(), "{name}");
            assert_eq!(raw(back), raw(t), "{name} differs after the round trip");
        }
        let model = c.section("model.");
        let mut names: Vec<_> = model.keys().cloned().collect();
        names.sort();
        assert_eq!(names, ["ids", "w", "wt"]);
        assert_eq!(raw(&c.section("optim.")["adam.step"]), raw(&given[3].1));
        assert!(c.section("nothing.").is_empty());
        // A plain safetensors reader sees the tensors too.
        let bytes = fs::read(&path).unwrap();
        assert_eq!(safetensors::SafeTensors::deserialize(&bytes).unwrap().len(), given.len());
        // (Not byte-deterministic: safetensors writes the metadata map in hash order.)
    }

    #[test]
    fn non_finite_floats_and_no_loader_round_trip() {
        let d = TempDir::new("nan");
        let mut m = meta(0);
        m.train_loss = f64::NAN;
        m.train_ms = f64::INFINITY;
        m.loader = None;
        m.averager = None;
        let path = write(&d.0, 0, &encode(&m, &[]).unwrap()).unwrap();
        let c = load(&path).unwrap();
        assert!(c.meta.train_loss.is_nan() && c.meta.train_ms == f64::INFINITY);
        assert_eq!((c.meta.loader, c.meta.averager, c.tensors.len()), (None, None, 0));
    }

    #[test]
    fn encode_refuses_bad_input() {
        let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let twice = vec![("a".to_string(), t.clone()), ("a".to_string(), t)];
        assert!(err(encode(&meta(1), &twice)).contains("`a` is given twice"));
        let mut m = meta(1);
        m.version = VERSION + 1;
        assert!(err(encode(&m, &[])).contains("format version"));
    }

    #[test]
    fn truncated_files_say_so() {
        let d = TempDir::new("truncated");
        let path = save(&d.0, 7);
        let bytes = fs::read(&path).unwrap();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for cut in [bytes.len() - 1, header_end + 3, header_end - 10, 5, 0] {
            fs::write(&path, &bytes[..cut]).unwrap();
            let e = err(load(&path));
            assert!(e.contains("step_00000007.safetensors") && (e.contains("truncated") || e.contains("empty")), "cut at {cut}: {e}");
        }
        fs::write(&path, [&bytes[..], b"junk"].concat()).unwrap();
        let e = err(load(&path));
        assert!(e.contains("step_00000007.safetensors") && e.contains("corrupt"), "{e}");
    }

    #[test]
    fn flipped_bytes_fail_the_crc() {
        let d = TempDir::new("flip");
        let path = save(&d.0, 7);
        let good = fs::read(&path).unwrap();
        flip_last(&path);
        let e = err(load(&path));
        assert!(e.contains("step_00000007.safetensors") && e.contains("corrupt") && e.contains("crc mismatch"), "{e}");
        // The metadata is covered too: step 7 -> 6 (one bit) in the JSON.
        let at = good.windows(9).position(|w| w == b"\"step\\\":7").unwrap() + 8;
        let mut b = good.clone();
        b[at] ^= 0x01;
        fs::write(&path, &b).unwrap();
        assert!(err(load(&path)).contains("crc mismatch"));
        // Every single byte of the data section, flipped, is caught.
        let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        for i in (header_end..good.len()).step_by(7) {
            let mut b = good.clone();
            b[i] ^= 0x80;
            assert!(verify(&path, &b).is_err(), "flip at {i} not caught");
        }
    }

    #[test]
    fn foreign_files_are_not_checkpoints() {
        let d = TempDir::new("foreign");
        let plain = d.0.join("weights.safetensors");
        let t = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        crate::model::weights::save(&plain, &[("w".to_string(), t)]).unwrap();
        let e = err(load(&plain));
        assert!(e.contains("weights.safetensors") && e.contains("not a pipeline checkpoint"), "{e}");
        let text = d.0.join("notes.txt");
        fs::write(&text, "these are not the tensors you are looking for").unwrap();
        let e = err(load(&text));
        assert!(e.contains("notes.txt") && e.contains("not a safetensors file"), "{e}");
        let e = err(load(&d.0.join("missing.safetensors")));
        assert!(e.contains("missing.safetensors"), "{e}");
    }

    #[test]
    fn newer_versions_are_refused() {
        let d = TempDir::new("newer");
        let mut b = encode(&meta(3), &[]).unwrap();
        let at = b.windows(12).position(|w| w == b"\"version\\\":1").unwrap() + 11;
        b[at] = b'2';
        let crc_at = crc_digits_at(&b).unwrap();
        let crc = checksum(&b, crc_at);
        b[crc_at..crc_at + 8].copy_from_slice(format!("{crc:08x}").as_bytes());
        let path = write(&d.0, 3, &b).unwrap();
        let e = err(load(&path));
        assert!(e.contains("step_00000003.safetensors") && e.contains("newer") && e.contains("version 2"), "{e}");
    }

    #[test]
    fn list_and_prune_keep_the_newest() {
        let d = TempDir::new("prune");
        for step in [3, 1, 5, 2, 4, 10] {
            write(&d.0, step, b"x").unwrap();
        }
        let me = std::process::id();
        let stale = d.0.join(".step_00000011.safetensors.tmp-4000000000");
        let ours = d.0.join(format!(".step_00000012.safetensors.tmp-{me}"));
        let unrelated = ["notes.txt", "step_abc.safetensors", "step_00000002.safetensors.bak", ".other.tmp-5", ".step_x.safetensors.tmp-5"];
        for f in [&stale, &ours] {
            fs::write(f, b"half").unwrap();
        }
        for f in unrelated {
            fs::write(d.0.join(f), b"keep").unwrap();
        }
        fs::create_dir_all(d.0.join("step_00000099.safetensors")).unwrap(); // a folder, not a checkpoint
        let steps = |dir: &Path| list(dir).unwrap().into_iter().map(|(s, _)| s).collect::<Vec<_>>();
        assert_eq!(steps(&d.0), [1, 2, 3, 4, 5, 10]);
        assert_eq!(list(&d.0).unwrap()[5].1, d.0.join("step_00000010.safetensors"));

        let mut removed = prune(&d.0, 2).unwrap();
        removed.sort();
        let mut expected = vec![stale.clone()];
        expected.extend([1, 2, 3, 4].map(|s| d.0.join(file_name(s))));
        expected.sort();
        assert_eq!(removed, expected);
        assert_eq!(steps(&d.0), [5, 10]);
        assert!(ours.exists(), "this process's own temporary file stays");
        for f in unrelated {
            assert!(d.0.join(f).exists(), "{f} removed");
        }
        assert!(prune(&d.0, 2).unwrap().is_empty());
        assert_eq!(prune(&d.0, 0).unwrap(), [d.0.join(file_name(5))]);
        assert_eq!(steps(&d.0), [10], "keep 0 still keeps the newest");
        assert!(list(&d.0.join("absent")).unwrap().is_empty());
        assert!(prune(&d.0.join("absent"), 1).unwrap().is_empty());
    }

    #[test]
    fn resolve_picks_the_newest_or_offers_the_previous_good_one() {
        let d = TempDir::new("resolve");
        let ckpts = d.0.join(DIR);
        let paths: Vec<_> = [10, 20, 30].map(|s| save(&ckpts, s)).into();
        assert_eq!(resolve(&d.0).unwrap().meta.step, 30);
        assert_eq!(resolve(&ckpts).unwrap().meta.step, 30, "the checkpoints folder itself");
        assert_eq!(resolve(&paths[0]).unwrap().meta.step, 10, "a file");

        flip_last(&paths[2]);
        let e = err(resolve(&d.0));
        let good = paths[1].display().to_string();
        assert!(e.contains(&paths[2].display().to_string()) && e.contains("crc mismatch"), "{e}");
        assert!(e.contains(&format!("previous good checkpoint is {good} (step 20)")) && e.contains(&format!("`--resume {good}`")), "{e}");

        fs::write(&paths[1], b"garbage").unwrap();
        let e = err(resolve(&d.0));
        assert!(e.contains(&format!("`--resume {}`", paths[0].display())), "skips the broken step 20: {e}");

        flip_last(&paths[0]);
        let e = err(resolve(&d.0));
        assert!(e.contains("no good checkpoint") && !e.contains("--resume"), "{e}");

        let e = err(resolve(&paths[2]));
        assert!(e.contains(&paths[2].display().to_string()) && e.contains("crc mismatch"), "{e}");
    }

    #[test]
    fn resolve_without_checkpoints_names_the_directory() {
        let d = TempDir::new("empty");
        let e = err(resolve(&d.0));
        assert!(e.contains(&d.0.display().to_string()) && e.contains("no checkpoints"), "{e}");
        fs::create_dir_all(d.0.join(DIR)).unwrap();
        assert!(err(resolve(&d.0)).contains("no checkpoints"));
        let e = err(resolve(&d.0.join("nope")));
        assert!(e.contains("nope") && e.contains("no such"), "{e}");
    }

    #[test]
    fn failed_writes_error_and_keep_older_checkpoints() {
        let d = TempDir::new("failwrite");
        let file = d.0.join("plain-file");
        fs::write(&file, b"").unwrap();
        let e = err(write(&file.join(DIR), 1, b"bytes"));
        assert!(e.contains("plain-file") && e.contains("step_00000001.safetensors"), "{e}");

        let ckpts = d.0.join(DIR);
        let older = save(&ckpts, 10);
        let before = fs::read(&older).unwrap();
        // A folder in the way of the rename: the write fails after the temporary file is made.
        fs::create_dir_all(ckpts.join(file_name(20)).join("x")).unwrap();
        let e = err(write(&ckpts, 20, &encode(&meta(20), &tensors()).unwrap()));
        assert!(e.contains("step_00000020.safetensors"), "{e}");
        assert_eq!(fs::read(&older).unwrap(), before);
        let names: Vec<_> = fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.contains(".tmp-")), "temporary file left: {names:?}");
        assert_eq!(resolve(&d.0).unwrap().meta.step, 10);
    }

    #[test]
    fn data_fingerprint_is_stable_and_sensitive() {
        let d = TempDir::new("fingerprint");
        let (a, b) = (d.0.join("train_000.bin"), d.0.join("train_001.bin"));
        fs::write(&a, [0u8; 100]).unwrap();
        fs::write(&b, [0u8; 200]).unwrap();
        let f = data_fingerprint(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(f.len(), 16);
        assert_eq!(f, data_fingerprint(&[b.clone(), a.clone()]).unwrap(), "order does not matter");
        // Same names and sizes elsewhere: same fingerprint.
        let other = d.0.join("copy");
        fs::create_dir_all(&other).unwrap();
        for p in [&a, &b] {
            fs::copy(p, other.join(p.file_name().unwrap())).unwrap();
        }
        assert_eq!(f, data_fingerprint(&[other.join("train_000.bin"), other.join("train_001.bin")]).unwrap());
        assert_ne!(f, data_fingerprint(std::slice::from_ref(&a)).unwrap());
        fs::write(&b, [0u8; 201]).unwrap();
        assert_ne!(f, data_fingerprint(&[a.clone(), b.clone()]).unwrap());
        assert!(err(data_fingerprint(&[d.0.join("gone.bin")])).contains("gone.bin"));
    }
}
