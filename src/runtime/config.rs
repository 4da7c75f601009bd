//! The run's configuration: TOML file, then `PIPELINE_*` environment variables, then `--set`.
//!
//! Layering (later wins), all merged by figment:
//! 1. the TOML file given on the command line;
//! 2. environment variables `PIPELINE_<PATH>` with `__` between path parts, e.g.
//!    `PIPELINE_STAGES__SAMPLER__QUEUE=100` sets `stages.sampler.queue` (keys are lower-cased);
//! 3. `--set key.path=value` arguments; the value is read as TOML (`100`, `1.5`, `true`,
//!    `"text"`, `[1, 2]`), and as a plain string if it is not valid TOML.
//!
//! The runtime owns `[run]` ([`RunConfig`]) and the raw `[stages.NAME]` tables, checked by
//! [`crate::runtime::graph`] against the implementation each one names. An application adds its
//! own top-level tables in a type implementing [`Tables`] (the GPT's is `train::config::Config`:
//! `[data]`, `[model]`, `[train]`); [`load`] reads any such type, and [`Loaded`] says where each
//! value came from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::runtime::error::ConfigErrors;

/// `[run]`: how the run is executed and measured.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Name of the run; the run directory is `<out_dir>/<name>-<UTC time>`. Empty: the config
    /// file's stem.
    pub name: String,
    /// Seed of every random choice in the run (stages derive their own from it and their name).
    pub seed: u64,
    /// Folder under which run directories are made (unless `--out` names one).
    pub out_dir: PathBuf,
    /// Where the model runs: "cpu", or "cuda:N" in a binary built with the `cuda` feature.
    pub device: String,
    /// Items each stage handles before its histograms start: counted, but kept out of the
    /// steady-state summary.
    pub warmup_items: u64,
    /// Take timings (histograms, busy fractions); false keeps only item counts.
    pub instrument: bool,
    /// After Ctrl-C or a stop request, how long (ms) in-flight items may drain before every stage
    /// is stopped where it stands.
    pub drain_timeout_ms: u64,
    /// How often (µs) the length of every channel is sampled for its mean occupancy.
    pub sample_interval_us: u64,
    /// Write `trace.json` (Chrome trace events, for Perfetto UI or chrome://tracing): a slice
    /// per item on a track per stage, flow arrows along the channels, channel lengths as
    /// counters. Needs `instrument`.
    pub trace: bool,
    /// Items per stage the trace keeps: the last ones (a ring), so a long run's trace stays
    /// the size of a short one's.
    pub trace_items: usize,
    /// The stage whose input-bound fraction the verdict reports. Empty: the graph's sink.
    pub focus: String,
    /// Stop gracefully after this many seconds, as Ctrl-C would (0: no limit).
    pub max_seconds: f64,
    /// Number of ranks (processes, one per GPU) training together.
    pub world_size: usize,
    /// This process's rank, below `world_size`.
    pub rank: usize,
    /// Memory the run may use, GiB: the host's on "cpu", the GPU's on "cuda:N". A run whose
    /// estimate (printed by `validate` and `run`) is larger is refused before it allocates.
    /// 0: what the machine has (the host's available memory; a GPU's free memory).
    pub max_memory_gb: f64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            seed: 0,
            out_dir: PathBuf::from("runs"),
            device: "cpu".into(),
            warmup_items: 20,
            instrument: true,
            drain_timeout_ms: 10_000,
            sample_interval_us: 1_000,
            trace: false,
            trace_items: 10_000,
            focus: String::new(),
            max_seconds: 0.0,
            world_size: 1,
            rank: 0,
            max_memory_gb: 0.0,
        }
    }
}

/// What the runtime needs of an application's config: the `[run]` table and the raw
/// `[stages.NAME]` tables. The application's type (`train::config::Config`) adds its own
/// top-level tables beside them, each owned by the area it configures; the runtime never reads
/// them.
pub trait Tables: DeserializeOwned + Default {
    /// `[run]`.
    fn run(&self) -> &RunConfig;
    /// `[stages.NAME]`, raw until the planner resolves them.
    fn stages(&self) -> &BTreeMap<String, Dict>;

    /// The first stage (by name) of kind `kind`: its name and raw table.
    fn stage_of_kind(&self, kind: &str) -> Option<(&String, &Dict)> {
        self.stages().iter().find(|(_, d)| d.get("kind").and_then(|k| k.as_str()) == Some(kind))
    }
}

/// The runtime's own config: `[run]` and the stage tables, nothing else (graphs of synthetic
/// stages, the runtime's tests).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[run]`.
    #[serde(default)]
    pub run: RunConfig,
    /// `[stages.NAME]`, raw until the graph builder resolves them.
    #[serde(default, skip_serializing)]
    pub stages: BTreeMap<String, Dict>,
}

impl Tables for Config {
    fn run(&self) -> &RunConfig {
        &self.run
    }
    fn stages(&self) -> &BTreeMap<String, Dict> {
        &self.stages
    }
}

/// A config loaded from its layers, with the figment kept to say where each value came from.
pub struct Loaded<C = Config> {
    /// The merged layers.
    pub figment: Figment,
    /// The typed top-level config.
    pub config: C,
    /// The TOML file it was loaded from.
    pub path: PathBuf,
}

impl<C> Loaded<C> {
    /// Names the file, environment variable or `--set` argument that supplied `key` (dotted
    /// path); the config file when nothing more precise is known.
    pub fn origin_of(&self, key: &str) -> String {
        let mut probe = key;
        loop {
            if let Ok(value) = self.figment.find_value(probe) {
                return match value {
                    // A table: blame the file unless every value in it came from one override.
                    Value::Dict(..) => self.table_origin(probe, &value),
                    _ => self.leaf_origin(probe),
                };
            }
            match probe.rfind('.') {
                Some(i) => probe = &probe[..i],
                None => return self.file_name(),
            }
        }
    }

    /// The origin of the value an error `message` about `key` (a table, e.g. `stages.train`)
    /// is about: the first key quoted in backticks in the message that the config holds, as a
    /// full path (`train.iterations`) or relative to `key` (`dtype`), so that a bad value set
    /// with `--set` or the environment is blamed on that, not on the file. Else `key`'s origin.
    pub fn origin_in(&self, key: &str, message: &str) -> String {
        let is_key = |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        for quoted in message.split('`').skip(1).step_by(2).filter(|t| is_key(t)) {
            for candidate in [quoted.to_string(), format!("{key}.{quoted}")] {
                if candidate.contains('.') && self.figment.find_value(&candidate).is_ok() {
                    return self.origin_of(&candidate);
                }
            }
        }
        self.origin_of(key)
    }

    /// Whether `key`'s value was given by a `--set` or an environment variable rather than a
    /// config file (or a default).
    pub fn overridden(&self, key: &str) -> bool {
        self.figment
            .find_metadata(key)
            .is_some_and(|md| matches!(md.source, Some(figment::Source::Custom(_))) || md.name.contains("environment"))
    }

    fn file_name(&self) -> String {
        relative(&self.path).display().to_string()
    }

    fn leaf_origin(&self, key: &str) -> String {
        match self.figment.find_metadata(key) {
            Some(md) => describe_origin(md, &key.split('.').collect::<Vec<_>>(), &self.path),
            None => self.file_name(),
        }
    }

    fn table_origin(&self, key: &str, value: &Value) -> String {
        let mut leaves = Vec::new();
        collect_leaves(key, value, &mut leaves);
        let origins: Vec<String> = leaves.iter().map(|k| self.leaf_origin(k)).collect();
        let file = self.file_name();
        if origins.is_empty() || origins.contains(&file) { file } else { origins[0].clone() }
    }
}

fn collect_leaves(prefix: &str, value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Dict(_, d) => {
            for (k, v) in d {
                collect_leaves(&format!("{prefix}.{k}"), v, out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

fn describe_origin(md: &Metadata, path: &[&str], file: &Path) -> String {
    match &md.source {
        Some(figment::Source::File(p)) => relative(p).display().to_string(),
        Some(figment::Source::Custom(s)) => s.clone(),
        _ if md.name.contains("environment") => {
            let var: Vec<String> = path.iter().map(|p| p.to_uppercase()).collect();
            format!("environment variable PIPELINE_{}", var.join("__"))
        }
        _ => file.display().to_string(),
    }
}

/// Shortens an absolute path to one relative to the working directory when possible.
fn relative(p: &Path) -> PathBuf {
    std::env::current_dir().ok().and_then(|cwd| p.strip_prefix(&cwd).ok().map(Path::to_path_buf)).unwrap_or_else(|| p.to_path_buf())
}

/// A `--set key.path=value` argument as a figment provider.
struct SetArg {
    raw: String,
    key: String,
    value: Value,
}

impl SetArg {
    fn parse(raw: &str) -> Result<Self, String> {
        let (key, value) = raw.split_once('=').ok_or_else(|| format!("`--set {raw}`: expected key.path=value"))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(str::is_empty) {
            return Err(format!("`--set {raw}`: the key must be a dotted path such as stages.sampler.queue"));
        }
        let value = value.trim();
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_string()));
        let value = Value::serialize(parsed).map_err(|e| format!("`--set {raw}`: {e}"))?;
        Ok(Self { raw: raw.to_string(), key: key.to_string(), value })
    }
}

impl Provider for SetArg {
    fn metadata(&self) -> Metadata {
        Metadata::named("--set argument").source(figment::Source::Custom(format!("--set {}", self.raw)))
    }
    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let nested = figment::util::nest(&self.key, self.value.clone());
        let dict = nested.into_dict().ok_or_else(|| figment::Error::from("--set produced no table".to_string()))?;
        Ok(Profile::Default.collect(dict))
    }
}

/// Prefix of the environment variables that override config values.
pub const ENV_PREFIX: &str = "PIPELINE_";

/// Why environment variable `var` cannot name a config key, if it is one of ours
/// (`PIPELINE_...`) and cannot: an empty path part, from `___` or a `__` at either end
/// (`PIPELINE_STAGES____QUEUE`, `PIPELINE_STAGES__MID__`), which figment would silently drop.
fn env_key_problem(var: &str) -> Option<String> {
    // figment matches the prefix in any case (`pipeline_...` sets keys too).
    let rest = var.get(ENV_PREFIX.len()..).filter(|_| var.get(..ENV_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX)))?;
    let parts: Vec<&str> = rest.split("__").collect();
    if rest.is_empty() || parts.iter().any(|p| p.is_empty()) {
        Some(format!(
            "`{var}` has an empty key part (parts are separated by exactly two underscores, e.g. PIPELINE_STAGES__MID__QUEUE=4 sets stages.mid.queue); it would be ignored"
        ))
    } else {
        None
    }
}

/// Loads `path`, then the environment, then `sets`, into a [`Loaded`] config.
pub fn load<C: Tables>(path: &Path, sets: &[String]) -> Result<Loaded<C>, ConfigErrors> {
    load_with_env(path, sets, true)
}

/// As [`load`], optionally ignoring the environment (tests, benches).
pub fn load_with_env<C: Tables>(path: &Path, sets: &[String], use_env: bool) -> Result<Loaded<C>, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    let shown = path.display().to_string();
    // A FIFO would block this read forever: only a regular file is read.
    let text = match crate::runtime::files::read(path).map(String::from_utf8) {
        Ok(Ok(t)) => t,
        Ok(Err(_)) => {
            errors.push(shown, None, "cannot read the config file: it is not UTF-8 text");
            return Err(errors);
        }
        Err(e) => {
            let why = match e.downcast_ref::<crate::runtime::files::NotRegular>() {
                Some(n) => format!("the config must be a regular file; this is {}", n.what),
                None => format!("cannot read the config file: {}", e.root_cause()),
            };
            errors.push(shown, None, why);
            return Err(errors);
        }
    };
    if let Err(e) = toml::from_str::<toml::Table>(&text) {
        errors.push(shown, None, format!("not valid TOML: {}", e.to_string().trim_end()));
        return Err(errors);
    }
    let mut figment = Figment::from(Toml::file_exact(path));
    if use_env {
        for (var, _) in std::env::vars_os() {
            if let Some(msg) = var.to_str().and_then(env_key_problem) {
                errors.push(format!("environment variable {}", var.to_string_lossy()), None, msg);
            }
        }
        figment = figment.merge(Env::prefixed(ENV_PREFIX).split("__"));
    }
    for raw in sets {
        match SetArg::parse(raw) {
            Ok(set) => figment = figment.merge(set),
            Err(msg) => errors.push("command line", None, msg),
        }
    }
    errors.clone().into_result()?;
    let config: C = match figment.extract() {
        Ok(c) => c,
        Err(e) => {
            let loaded = Loaded { figment, config: C::default(), path: path.to_path_buf() };
            push_figment_error(&mut errors, &loaded, None, e);
            return Err(errors);
        }
    };
    Ok(Loaded { figment, config, path: path.to_path_buf() })
}

/// Turns a figment error (possibly several) into issues; `prefix` is prepended to each key path
/// (used for stage parameters, which are deserialised from a sub-table).
pub fn push_figment_error<C>(errors: &mut ConfigErrors, loaded: &Loaded<C>, prefix: Option<&str>, err: figment::Error) {
    for e in err {
        let mut parts: Vec<String> = prefix.map(|p| p.split('.').map(String::from).collect()).unwrap_or_default();
        parts.extend(e.path.iter().cloned());
        // Unknown fields are reported at the parent path by serde; name the field itself.
        match &e.kind {
            figment::error::Kind::UnknownField(field, _) if parts.last() != Some(field) => parts.push(field.clone()),
            figment::error::Kind::MissingField(field) if parts.last().map(String::as_str) != Some(field.as_ref()) => {
                parts.push(field.to_string())
            }
            _ => {}
        }
        let top_level = parts.len() == 1;
        let key = parts.join(".");
        let origin = loaded.origin_of(&key);
        let mut message = describe_kind(&e.kind);
        if top_level {
            message = message.replacen("unknown key", "unknown top-level table or key", 1);
        }
        errors.push(origin, if key.is_empty() { None } else { Some(key) }, message);
    }
}

fn describe_kind(kind: &figment::error::Kind) -> String {
    use figment::error::Kind;
    match kind {
        Kind::UnknownField(f, expected) => {
            if expected.is_empty() {
                format!("unknown key `{f}`; this table takes no keys")
            } else {
                format!("unknown key `{f}`; expected one of: {}", expected.join(", "))
            }
        }
        Kind::MissingField(f) => format!("missing required key `{f}`"),
        Kind::InvalidType(actual, expected) => format!("wrong type: found {actual}, expected {}", plain_type(expected)),
        Kind::InvalidValue(actual, expected) => format!("invalid value: found {actual}, expected {}", plain_type(expected)),
        Kind::UnknownVariant(v, expected) => format!("unknown value `{v}`; expected one of: {}", expected.join(", ")),
        other => other.to_string(),
    }
}

/// Serde's Rust type names in words a config author reads.
fn plain_type(expected: &str) -> String {
    match expected {
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer".into(),
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a non-negative integer".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" | "bool" => "true or false".into(),
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("c.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    /// A fresh folder under the system's temp dir, removed when dropped.
    struct TmpDir(PathBuf);

    impl std::ops::Deref for TmpDir {
        type Target = PathBuf;
        fn deref(&self) -> &PathBuf {
            &self.0
        }
    }

    impl Drop for TmpDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tmpdir(tag: &str) -> TmpDir {
        let d = std::env::temp_dir().join(format!("pipeline-config-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TmpDir(d)
    }

    #[test]
    fn set_overrides_file_and_parses_toml_values() {
        let d = tmpdir("set");
        let p = write(&d, "[run]\nseed = 1\n[stages.a]\nkind = \"drain\"\n");
        let l: Loaded = load_with_env(&p, &["run.seed=7".into(), "run.name=abc".into(), "stages.a.queue=5".into()], false).unwrap();
        assert_eq!(l.config.run.seed, 7);
        assert_eq!(l.config.run.name, "abc");
        assert_eq!(l.config.stages["a"]["queue"].to_i128(), Some(5));
        assert_eq!(l.origin_of("run.seed"), "--set run.seed=7");
    }

    #[test]
    fn unknown_run_key_names_file_and_key() {
        let d = tmpdir("unknown");
        let p = write(&d, "[run]\nseedd = 1\n");
        let e = load_with_env::<Config>(&p, &[], false).err().unwrap();
        assert_eq!(e.0.len(), 1);
        assert_eq!(e.0[0].key.as_deref(), Some("run.seedd"));
        assert!(e.0[0].message.contains("unknown key `seedd`"), "{}", e);
        assert!(e.0[0].origin.ends_with("c.toml"), "{}", e);
    }

    #[test]
    fn env_variables_with_an_empty_key_part_are_named() {
        for bad in ["PIPELINE_STAGES____QUEUE", "PIPELINE_STAGES__MID__", "PIPELINE___RUN__SEED", "PIPELINE_", "pipeline_stages____queue"] {
            let msg = env_key_problem(bad).unwrap_or_else(|| panic!("{bad} passed"));
            assert!(msg.contains(bad) && msg.contains("empty key part"), "{msg}");
        }
        for good in ["PIPELINE_STAGES__MID__QUEUE", "PIPELINE_RUN__SEED", "PIPELINE_TRAIN__VAL_MAX_TOKENS", "OTHER___X", "PATH"] {
            assert_eq!(env_key_problem(good), None, "{good}");
        }
    }

    #[test]
    fn bad_set_argument_is_an_error() {
        let d = tmpdir("badset");
        let p = write(&d, "");
        assert!(load_with_env::<Config>(&p, &["noequals".into()], false).is_err());
        assert!(load_with_env::<Config>(&p, &["a..b=1".into()], false).is_err());
    }
}
