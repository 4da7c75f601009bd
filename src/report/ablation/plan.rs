//! Which runs an ablation makes: the base config and its variants, from `--vary KEY=V1,V2`
//! arguments or the config's `[ablation]` table, one key changed at a time (or their cross
//! product with `grid`), each run `seeds` times.

use std::collections::BTreeMap;

/// The `[ablation]` table of a config: the same as `pipeline ablate`'s flags, so an ablation
/// can live in the file it varies.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AblationConfig {
    /// Config keys and the values to try for each (`"stages.sampler.queue" = [2, 100]`).
    pub vary: BTreeMap<String, Vec<toml::Value>>,
    /// Run the cross product of every key's values instead of one key at a time.
    pub grid: bool,
    /// Runs of every variant, the `k`-th with `run.seed` = the config's seed + `k` (1: once,
    /// with the config's seed).
    pub seeds: u32,
}

impl AblationConfig {
    /// Whether the table says nothing (left out of a run's resolved config).
    pub fn is_empty(&self) -> bool {
        self.vary.is_empty() && !self.grid && self.seeds <= 1
    }
}

/// One varied key: `key` and the values to try, each as TOML text (`2`, `"pinned"`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg(feature = "tools")]
pub struct Vary {
    /// The dotted config key.
    pub key: String,
    /// The values, as TOML text.
    pub values: Vec<String>,
}

#[cfg(feature = "tools")]
impl Vary {
    /// Parses `KEY=V1,V2,...`: the values are read as a TOML array when they form one (so
    /// `"a,b"` and `[1, 2]` stay whole), else split at commas, each a TOML value or a bare
    /// string (as `--set` reads it).
    #[cfg(feature = "tools")]
    pub fn parse(raw: &str) -> Result<Vary, String> {
        let (key, values) = raw.split_once('=').ok_or_else(|| format!("`--vary {raw}`: expected KEY=V1,V2,..."))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(str::is_empty) {
            return Err(format!("`--vary {raw}`: the key must be a dotted path such as stages.sampler.queue"));
        }
        let as_array = toml::from_str::<toml::Table>(&format!("v = [{values}]")).ok().and_then(|mut t| t.remove("v"));
        let values: Vec<String> = match as_array {
            Some(toml::Value::Array(items)) => items.iter().map(toml::Value::to_string).collect(),
            _ => values.split(',').map(|v| bare(v.trim())).collect(),
        };
        if values.is_empty() || values.iter().any(|v| v.is_empty() || v == "\"\"") {
            return Err(format!("`--vary {raw}`: give one or more values, separated by commas"));
        }
        Ok(Vary { key: key.to_string(), values })
    }

    /// The `[ablation.vary]` entry `key = [values]`.
    #[cfg(feature = "tools")]
    pub fn from_table(key: &str, values: &[toml::Value]) -> Vary {
        Vary { key: key.to_string(), values: values.iter().map(toml::Value::to_string).collect() }
    }
}

/// A value as `--set` reads it: TOML when it parses, else a string.
#[cfg(feature = "tools")]
fn bare(v: &str) -> String {
    match toml::from_str::<toml::Table>(&format!("v = {v}")).ok().and_then(|mut t| t.remove("v")) {
        Some(value) => value.to_string(),
        None => toml::Value::String(v.to_string()).to_string(),
    }
}

/// One run of an ablation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg(feature = "tools")]
pub struct Variant {
    /// The variant's name: `base`, or its settings (`stages.sampler.queue=100`).
    pub name: String,
    /// The `--set` arguments that make it (`KEY=TOML`), seed included.
    pub sets: Vec<String>,
    /// The seed offset `k` (0 for the config's own seed).
    pub seed: u32,
    /// Its run directory's name inside the ablation directory.
    pub dir: String,
}

/// Every run of the ablation, base first: one key changed at a time (each value of each key),
/// or with `grid` every combination; each `seeds` times (`run.seed = base_seed + k`). Values
/// are applied as given, so a value equal to the base's is a run of its own (a repeat).
#[cfg(feature = "tools")]
pub fn plan(varies: &[Vary], grid: bool, seeds: u32, base_seed: u64) -> Result<Vec<Variant>, String> {
    let mut seen = std::collections::HashSet::new();
    if let Some(v) = varies.iter().find(|v| !seen.insert(v.key.as_str())) {
        return Err(format!("`{}` is varied twice: give all its values in one --vary", v.key));
    }
    let mut settings: Vec<Vec<(String, String)>> = vec![Vec::new()];
    if grid {
        for v in varies {
            settings = settings
                .iter()
                .flat_map(|prefix| v.values.iter().map(move |x| [prefix.clone(), vec![(v.key.clone(), x.clone())]].concat()))
                .collect();
        }
        // The grid's first cell is a variant too; the base (no change) stays first.
        settings.insert(0, Vec::new());
    } else {
        for v in varies {
            settings.extend(v.values.iter().map(|x| vec![(v.key.clone(), x.clone())]));
        }
    }
    let seeds = seeds.max(1);
    let mut out = Vec::new();
    // Seed by seed, every variant in turn: what drifts over the ablation (a page cache
    // warming, a neighbour's load) falls on every variant alike instead of on the first.
    for k in 0..seeds {
        for s in &settings {
            let name =
                if s.is_empty() { "base".to_string() } else { s.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",") };
            let mut sets: Vec<String> = s.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let mut dir = dir_name(&name);
            if seeds > 1 {
                sets.push(format!("run.seed={}", base_seed + k as u64));
                dir = format!("{dir}-seed{}", base_seed + k as u64);
            }
            out.push(Variant { name: name.clone(), sets, seed: k, dir });
        }
    }
    Ok(out)
}

/// A directory name for a variant: its name with every character outside `[A-Za-z0-9._=,-]`
/// replaced by `_`, cut to 120 bytes.
#[cfg(feature = "tools")]
fn dir_name(name: &str) -> String {
    let mut d: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || "._=,-".contains(c) { c } else { '_' }).collect();
    d.truncate(120);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vary_reads_lists_strings_and_arrays() {
        let v = Vary::parse("stages.sampler.queue=2,100").unwrap();
        assert_eq!((v.key.as_str(), v.values.clone()), ("stages.sampler.queue", vec!["2".to_string(), "100".into()]));
        assert_eq!(Vary::parse("stages.pin.impl=pinned,pageable").unwrap().values, vec!["\"pinned\"", "\"pageable\""]);
        assert_eq!(Vary::parse(r#"data.train="a,b","c""#).unwrap().values, vec![r#""a,b""#, r#""c""#]);
        assert_eq!(Vary::parse("x.y=[1, 2],[3]").unwrap().values, vec!["[1, 2]", "[3]"]);
        for bad in ["noequals", "=1,2", "a..b=1", "a.b=", "a.b=1,,2"] {
            assert!(Vary::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_key_at_a_time_grid_and_seeds() {
        let q = Vary::parse("stages.sampler.queue=2,100").unwrap();
        let p = Vary::parse("stages.pin.impl=pinned,pageable").unwrap();
        let names = |v: &[Variant]| v.iter().map(|x| x.name.clone()).collect::<Vec<_>>();
        let one = plan(&[q.clone(), p.clone()], false, 1, 0).unwrap();
        assert_eq!(
            names(&one),
            ["base", "stages.sampler.queue=2", "stages.sampler.queue=100", "stages.pin.impl=\"pinned\"", "stages.pin.impl=\"pageable\""]
        );
        assert!(one[0].sets.is_empty());
        assert_eq!(one[4].sets, ["stages.pin.impl=\"pageable\""]);
        assert_eq!(one[4].dir, "stages.pin.impl=_pageable_");
        let grid = plan(&[q.clone(), p.clone()], true, 1, 0).unwrap();
        assert_eq!(grid.len(), 5);
        assert_eq!(grid[4].sets, ["stages.sampler.queue=100", "stages.pin.impl=\"pageable\""]);
        let seeded = plan(std::slice::from_ref(&q), false, 3, 42).unwrap();
        assert_eq!(seeded.len(), 9);
        assert_eq!(seeded[8].sets, ["stages.sampler.queue=100", "run.seed=44"]);
        assert_eq!((seeded[8].dir.as_str(), seeded[8].seed), ("stages.sampler.queue=100-seed44", 2));
        // Seed by seed, the variants in turn.
        let order: Vec<(&str, u32)> = seeded.iter().map(|v| (v.name.as_str(), v.seed)).collect();
        assert_eq!(&order[..4], [("base", 0), ("stages.sampler.queue=2", 0), ("stages.sampler.queue=100", 0), ("base", 1)]);
        assert!(plan(&[q.clone(), q], false, 1, 0).unwrap_err().contains("varied twice"));
    }
}
