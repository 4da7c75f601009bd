//! Which build of the binary is running: its version, the cargo features it was compiled with
//! and its profile. Every run records it (`report.json`'s `run.build`), so that a submission
//! can say which build trained it and its rebuild uses the same features. Also what a run's
//! source bundle holds ([`SourceBundle`]: made by `artifact::bundle`, read by the submission's
//! checks).

use serde::{Deserialize, Serialize};

/// A build of the binary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    /// The crate's version.
    pub version: String,
    /// The cargo features it was compiled with (of `tools`, `candle`, `mpi`, `cuda`); without
    /// `tools` it is the lean record build.
    pub features: Vec<String>,
    /// `release`, or `debug` (debug assertions on).
    pub profile: String,
}

impl BuildInfo {
    /// This binary's build.
    pub fn this() -> Self {
        Self {
            version: env!("CARGO_PKG_VERSION").into(),
            // build.rs names them.
            features: env!("BUILT_FEATURES").split(',').filter(|f| !f.is_empty()).map(String::from).collect(),
            profile: if cfg!(debug_assertions) { "debug" } else { "release" }.into(),
        }
    }

    /// Whether it is the lean record build (no `tools`).
    pub fn lean(&self) -> bool {
        !self.features.iter().any(|f| f == "tools")
    }

    /// The features to ask for beside the build's kind (`--no-default-features` for the lean
    /// one): all but `tools` and, in a full build, what `tools` brings (`candle`).
    pub fn extra_features(&self) -> Vec<&str> {
        let implied: &[&str] = if self.lean() { &[] } else { &["candle"] };
        self.features.iter().map(String::as_str).filter(|f| *f != "tools" && !implied.contains(f)).collect()
    }

    /// The cargo flags that build it again: `--no-default-features` for the lean build, then
    /// `--features` with [`BuildInfo::extra_features`].
    #[cfg(feature = "tools")]
    pub fn cargo_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        if self.lean() {
            flags.push("--no-default-features".to_string());
        }
        let extra = self.extra_features();
        if !extra.is_empty() {
            flags.extend(["--features".to_string(), extra.join(",")]);
        }
        flags
    }

    /// In words: `pipeline 0.1.0, lean record build (cuda), release`.
    pub fn line(&self) -> String {
        let kind = if self.lean() { "lean record build" } else { "full build" };
        let extra = self.extra_features();
        let extra = if extra.is_empty() { String::new() } else { format!(" ({})", extra.join(", ")) };
        format!("pipeline {}, {kind}{extra}, {}", self.version, self.profile)
    }
}

/// A run's source bundle: the packed sources of the build that trained it, the code counted
/// against the cap.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceBundle {
    /// Its file name in a run directory or records folder: `source.tar.xz`, `source.tar.br` or `source.tar.lrz`.
    pub file: String,
    /// Source files packed.
    pub files: usize,
    /// Their bytes as they are in the tree.
    pub raw_bytes: u64,
    /// Their bytes stripped of comments, docs, tests and indentation.
    pub stripped_bytes: u64,
    /// The compressed file's bytes: the code counted against the cap.
    pub bytes: u64,
    /// The compressed file's SHA-256.
    pub sha256: String,
    /// `Cargo.lock`'s SHA-256 (beside the bundle, not counted).
    pub lock_sha256: String,
    /// The build whose sources these are.
    pub build: BuildInfo,
}

impl SourceBundle {
    /// The shell command that unpacks the bundle into the folder `code`, by its compressor:
    /// `tar` reads xz alone; Brotli and lrzip streams go through their own programs.
    #[cfg(feature = "tools")]
    pub fn unpack_command(&self) -> String {
        let f = &self.file;
        match f.rsplit('.').next() {
            Some("br") => format!("brotli -dc {f} | tar -xf - -C code"),
            Some("lrz") => format!("lrzcat -q {f} | tar -xf - -C code"),
            _ => format!("tar -xf {f} -C code"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_build_names_its_features() {
        let b = BuildInfo::this();
        assert_eq!(b.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(b.lean(), !cfg!(feature = "tools"));
        assert!(b.features.iter().all(|f| ["tools", "candle", "mpi", "cuda"].contains(&f.as_str())), "{b:?}");
        assert_eq!(b.features.iter().any(|f| f == "candle"), cfg!(feature = "candle"));
        let lean = BuildInfo { version: "1".into(), features: vec!["cuda".into()], profile: "release".into() };
        assert_eq!(lean.line(), "pipeline 1, lean record build (cuda), release");
        assert_eq!(lean.cargo_flags(), ["--no-default-features", "--features", "cuda"]);
        let full = BuildInfo { features: vec!["tools".into(), "candle".into(), "mpi".into()], ..lean.clone() };
        assert_eq!(
            (full.line().as_str(), full.cargo_flags()),
            ("pipeline 1, full build (mpi), release", vec!["--features".to_string(), "mpi".into()])
        );
        let lean_candle = BuildInfo { features: vec!["candle".into()], ..lean.clone() };
        assert_eq!(lean_candle.cargo_flags(), ["--no-default-features", "--features", "candle"]);
        let bundle = |file: &str| SourceBundle {
            file: file.into(),
            files: 1,
            raw_bytes: 1,
            stripped_bytes: 1,
            bytes: 1,
            sha256: String::new(),
            lock_sha256: String::new(),
            build: lean.clone(),
        };
        assert_eq!(bundle("source.tar.xz").unpack_command(), "tar -xf source.tar.xz -C code");
        assert_eq!(bundle("source.tar.br").unpack_command(), "brotli -dc source.tar.br | tar -xf - -C code");
        assert_eq!(bundle("source.tar.lrz").unpack_command(), "lrzcat -q source.tar.lrz | tar -xf - -C code");
    }
}
