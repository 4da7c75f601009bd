//! `pipeline submission --verify FOLDER`: a records folder rebuilt and rerun, as a reviewer
//! would. The folder's source bundle and `Cargo.lock` are checked against the digests its
//! `submission.json` recorded, unpacked into an empty directory and built there with cargo
//! (the build the runs recorded: its features and profile); then the folder's config runs at a
//! tiny size on the CPU twice, with the rebuilt binary and with this one, and every weights file
//! the two runs wrote must hold the same weights bit for bit (`*.safetensors` tensor by tensor,
//! their metadata holding wall times aside; the artifact byte for byte).
//!
//! The build reuses this binary's compiled dependencies: its target folder's `deps`, `build`
//! and `.fingerprint` entries are hard-linked into the new target folder (copied across file
//! systems), leaving out this crate's own, so that only the bundle's crate compiles.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::artifact::bundle;
use crate::runtime::build_info::SourceBundle;

/// What `--verify` takes.
#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    /// Where to unpack, build and rerun (default: a fresh folder under the system's temp).
    pub work: Option<PathBuf>,
    /// Extra `--set`s for both reruns (after the tiny size's).
    pub sets: Vec<String>,
}

/// The settings that make a rerun tiny: a few steps, no validation pass, no time cap.
pub const TINY: [&str; 3] = ["train.iterations=4", "train.val_every=0", "train.max_wallclock_seconds=0"];

/// Runs the check; 0 when the rebuilt binary reproduces this one's weights, 1 when it does not
/// (or does not build), 2 on a folder that cannot be read.
pub fn command(folder: &Path, o: VerifyOptions) -> i32 {
    let (code, config) = match read_folder(folder) {
        Ok(x) => x,
        Err(e) => {
            err!("error: {e:#}");
            return 2;
        }
    };
    match verify(folder, &code, &config, &o) {
        Ok(lines) => {
            for l in lines {
                out!("{l}");
            }
            0
        }
        Err(e) => {
            err!("verify FAILED: {e:#}");
            1
        }
    }
}

/// The folder's source bundle (from `submission.json`'s `code`) and its first seed's config.
fn read_folder(folder: &Path) -> Result<(SourceBundle, PathBuf)> {
    let path = folder.join("submission.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    let code = json
        .get("code")
        .filter(|c| !c.is_null())
        .with_context(|| format!("{}: no `code` (a folder without a source bundle)", path.display()))?;
    let code: SourceBundle =
        serde_json::from_value(code.clone()).with_context(|| format!("{}: `code` is not a source bundle's description", path.display()))?;
    let seed = json
        .get("seeds")
        .and_then(|s| s.get(0))
        .and_then(serde_json::Value::as_u64)
        .with_context(|| format!("{}: no `seeds`", path.display()))?;
    let config = folder.join(format!("config_seed{seed}.toml"));
    anyhow::ensure!(config.is_file(), "{} is missing", config.display());
    Ok((code, config))
}

fn verify(folder: &Path, code: &SourceBundle, config: &Path, o: &VerifyOptions) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let (packed, lock) = bundle::read(folder, code)?;
    let codec = bundle::Codec::of_file(&code.file).with_context(|| format!("`{}`: not a bundle's file name", code.file))?;
    let work = match &o.work {
        Some(w) => w.clone(),
        None => std::env::temp_dir().join(format!("pipeline-verify-{}", std::process::id())),
    };
    let src = work.join("src");
    let n = bundle::pack::unpack(&bundle::pack::decompress(codec, &packed)?, &src)?;
    std::fs::write(src.join(bundle::sources::LOCK), &lock).with_context(|| format!("cannot write {}", src.join("Cargo.lock").display()))?;
    lines.push(format!("unpacked {} ({} files, {} bytes, SHA-256 as recorded) into {}", code.file, n, code.bytes, src.display()));

    let target = work.join("target");
    let exe = std::env::current_exe().context("cannot find this binary's path")?;
    let release = code.build.profile == "release";
    let profile_dir = if release { "release" } else { "debug" };
    if let Some(seeded) = seed_target(&exe, &target.join(profile_dir))? {
        lines.push(format!("reused {seeded} compiled dependencies of {}", exe.parent().map_or(String::new(), |p| p.display().to_string())));
    }
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo.arg("build").arg("--offline").arg("--manifest-path").arg(src.join("Cargo.toml")).arg("--target-dir").arg(&target);
    cargo.env_remove("CARGO_TARGET_DIR").env_remove("CARGO_BUILD_TARGET_DIR");
    if release {
        cargo.arg("--release");
    }
    cargo.args(code.build.cargo_flags());
    let started = std::time::Instant::now();
    let built = cargo.output().context("cannot run cargo (is it on the PATH?)")?;
    anyhow::ensure!(
        built.status.success(),
        "the bundle does not build ({}):\n{}",
        code.build.line(),
        tail(&String::from_utf8_lossy(&built.stderr), 30)
    );
    let rebuilt = target.join(profile_dir).join("pipeline");
    lines.push(format!(
        "built the {} from the bundle in {:.0} s: {}",
        code.build.line(),
        started.elapsed().as_secs_f64(),
        rebuilt.display()
    ));

    let runs = [("rebuilt", rebuilt.as_path()), ("this binary", exe.as_path())];
    let mut weights = Vec::new();
    for (i, (what, bin)) in runs.iter().enumerate() {
        let out = work.join(format!("run-{i}"));
        let mut c = Command::new(bin);
        c.arg("run").arg(config).arg("--out").arg(&out).arg("-q");
        for s in TINY.iter().map(|s| s.to_string()).chain(o.sets.iter().cloned()) {
            c.arg("--set").arg(s);
        }
        let r = c.output().with_context(|| format!("cannot start {}", bin.display()))?;
        anyhow::ensure!(
            r.status.success(),
            "the rerun with {what} ({}) failed ({}):\n{}",
            bin.display(),
            r.status,
            tail(&String::from_utf8_lossy(&r.stderr), 30)
        );
        weights.push(weight_files(&out)?);
    }
    let (a, b) = (&weights[0], &weights[1]);
    let names = |w: &[(String, Vec<u8>)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    anyhow::ensure!(!a.is_empty(), "the rerun wrote no weights file (*.safetensors, *.pgqz)");
    anyhow::ensure!(names(a) == names(b), "the reruns wrote different weights files: {:?} against {:?}", names(a), names(b));
    for ((name, x), (_, y)) in a.iter().zip(b) {
        anyhow::ensure!(
            same_weights(name, x, y)?,
            "{name} differs between the rebuilt binary's rerun and this binary's: the bundle does not reproduce the run"
        );
    }
    lines.push(format!(
        "reran {} at a tiny size ({}) with both: {} weights files hold the same weights bit for bit ({})",
        config.display(),
        TINY.join(" "),
        a.len(),
        names(a).join(", ")
    ));
    if o.work.is_none() {
        let _ = std::fs::remove_dir_all(&work);
    }
    lines.push("verified: the folder's code builds and reproduces the run".into());
    Ok(lines)
}

/// Hard-links (or copies) the compiled dependencies of the target folder of `exe`
/// (`TARGET/PROFILE/pipeline`) into `to`, leaving out this crate's own units; how many
/// entries, or `None` when `exe` is not in a cargo target folder.
fn seed_target(exe: &Path, to: &Path) -> Result<Option<usize>> {
    let Some(from) = exe.parent() else { return Ok(None) };
    if !from.join("deps").is_dir() || !from.join(".fingerprint").is_dir() {
        return Ok(None);
    }
    let mut n = 0;
    for sub in ["deps", "build", ".fingerprint"] {
        let (src, dst) = (from.join(sub), to.join(sub));
        std::fs::create_dir_all(&dst).with_context(|| format!("cannot create {}", dst.display()))?;
        let Ok(entries) = std::fs::read_dir(&src) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = ["pipeline-", "libpipeline-", "pipeline.", "libpipeline."].iter().any(|p| name.starts_with(p));
            if !ours {
                n += link_tree(&e.path(), &dst.join(&name))?;
            }
        }
    }
    Ok(Some(n))
}

/// Hard-links a file, or a folder's files, from `src` to `dst` (a copy where links fail).
fn link_tree(src: &Path, dst: &Path) -> Result<usize> {
    if src.is_dir() {
        std::fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
        let mut n = 0;
        for e in std::fs::read_dir(src).with_context(|| format!("cannot list {}", src.display()))?.flatten() {
            n += link_tree(&e.path(), &dst.join(e.file_name()))?;
        }
        return Ok(n);
    }
    if std::fs::hard_link(src, dst).is_err() {
        std::fs::copy(src, dst).with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
        // A copy must keep the time cargo's freshness check compares.
        if let Ok(t) = std::fs::metadata(src).and_then(|m| m.modified()) {
            let _ = std::fs::File::options().write(true).open(dst).and_then(|f| f.set_modified(t));
        }
    }
    Ok(1)
}

/// Every weights file under a run directory (`*.safetensors`, `*.pgqz`), by relative path.
fn weight_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out)?;
            } else if p.extension().is_some_and(|x| x == "safetensors" || x == "pgqz") {
                let rel = p.strip_prefix(root).expect("under the root").to_string_lossy().into_owned();
                out.push((rel, std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Whether two weights files hold the same weights: a `.safetensors` file tensor by tensor
/// (names, dtypes, shapes and bytes; its metadata holds wall times, which differ run to run),
/// anything else byte for byte.
fn same_weights(name: &str, x: &[u8], y: &[u8]) -> Result<bool> {
    if !name.ends_with(".safetensors") {
        return Ok(x == y);
    }
    let read = |bytes| safetensors::SafeTensors::deserialize(bytes).with_context(|| format!("{name}: not a safetensors file"));
    let (x, y) = (read(x)?, read(y)?);
    let mut names = x.names();
    names.sort();
    let mut other = y.names();
    other.sort();
    if names != other {
        return Ok(false);
    }
    for n in names {
        let (a, b) = (x.tensor(n)?, y.tensor(n)?);
        if a.dtype() != b.dtype() || a.shape() != b.shape() || a.data() != b.data() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two checkpoints of the same weights whose metadata differ (a wall time) hold the same
    /// weights; one changed value does not; other files compare byte for byte.
    #[test]
    fn weights_compare_tensor_by_tensor() {
        let file = |v: f32, ms: &str| {
            let values: Vec<u8> = [1.0f32, v].iter().flat_map(|x| x.to_le_bytes()).collect();
            let dir = std::env::temp_dir().join(format!("pipeline-verify-w-{}-{v}-{ms}", std::process::id()));
            let path = dir.with_extension("safetensors");
            let meta = std::collections::HashMap::from([("train_ms".to_string(), ms.to_string())]);
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &values).unwrap();
            safetensors::serialize_to_file([("w".to_string(), view)], Some(meta), &path).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            bytes
        };
        let (a, b, c) = (file(2.0, "1.5"), file(2.0, "17.25"), file(3.0, "1.5"));
        assert_ne!(a, b);
        assert!(same_weights("ck.safetensors", &a, &b).unwrap());
        assert!(!same_weights("ck.safetensors", &a, &c).unwrap());
        assert!(!same_weights("model.pgqz", &a, &b).unwrap());
        assert!(same_weights("ck.safetensors", &a, b"junk").is_err());
    }
}
