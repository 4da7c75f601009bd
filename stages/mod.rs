//! Stage implementations, one file per stage kind, each implementation a type beside its
//! siblings, all registered in [`REGISTRY`].
//!
//! This folder is compiled as the `stages` module of the `pipeline` crate (a `#[path]` module
//! declared in `src/lib.rs`), so stages use the runtime through `crate::`.
//!
//! Adding an implementation: write a type implementing `Source`, `Transform` or `Sink` (see
//! `crate::runtime::stage`) in its kind's file, then add one line below. The first implementation of a
//! kind is the kind's default when a config leaves out `impl`.

use crate::report::document::Report;
use crate::runtime::driver::{SinkImpl, SourceImpl, TransformImpl};
use crate::runtime::registry::Registry;
use crate::runtime::stage::BuildCtx;
use crate::train::checkpoint::Checkpoint;
use crate::train::config::Config;

pub mod artifact;
pub mod checkpoint;
pub mod delay;
pub mod drain;
pub mod ema_swa;
pub mod pin;
pub mod shard_reader;
pub mod step_executor;
pub mod synthetic;
pub mod ttt_eval;
pub mod upload;
pub mod window_sampler;

/// Every stage implementation, in the order `pipeline stages` lists them.
pub static REGISTRY: Registry = Registry::new(&[
    &SourceImpl::<synthetic::Blobs>::new(),
    &TransformImpl::<delay::Sleep>::new(),
    &TransformImpl::<delay::Spin>::new(),
    &SinkImpl::<drain::Count>::new(),
    &SinkImpl::<drain::Batches>::new(),
    &SourceImpl::<shard_reader::Mmap>::new(),
    &SourceImpl::<shard_reader::Pread>::new(),
    &TransformImpl::<window_sampler::Shuffled>::new(),
    &TransformImpl::<window_sampler::PackedDocs>::new(),
    &TransformImpl::<window_sampler::Sequential>::new(),
    &TransformImpl::<pin::Pageable>::new(),
    &TransformImpl::<pin::Pinned>::new(),
    &TransformImpl::<upload::Cpu>::new(),
    &TransformImpl::<upload::OnDevice>::new(),
    &TransformImpl::<upload::CopyStream>::new(),
    &TransformImpl::<step_executor::Candle>::new(),
    &TransformImpl::<step_executor::Engine>::new(),
    &TransformImpl::<ema_swa::Ema>::new(),
    &TransformImpl::<ema_swa::Swa>::new(),
    &TransformImpl::<ema_swa::Passthrough>::new(),
    &TransformImpl::<checkpoint::Atomic>::new(),
    &TransformImpl::<artifact::Quantize>::new(),
    &TransformImpl::<artifact::Gptq>::new(),
    &SinkImpl::<ttt_eval::ScoreFirst>::new(),
    &SinkImpl::<ttt_eval::Sliding>::new(),
    &SinkImpl::<ttt_eval::Phased>::new(),
]);

/// The GPT application's config (`[data]`, `[model]`, `[train]`, `[run]`), which every stage
/// here reads: a typed extension of the build context ([`Config::extensions`]).
fn config<'a>(ctx: &BuildCtx<'a>) -> anyhow::Result<&'a Config> {
    ctx.need::<Config>()
}

/// The checkpoint a resumed run continues from (`pipeline run --resume`): stages with state
/// (sampler, executor, averager, checkpointer) restore theirs from it.
fn resumed<'a>(ctx: &BuildCtx<'a>) -> Option<&'a Checkpoint> {
    ctx.ext::<Checkpoint>()
}

/// For `nothing_left` only: the report of the process a resumed run continues
/// (`RUN_DIR/report.json`), when `--resume` named that run directory and the run goes on in it
/// with the same stages.
fn previous<'a>(ctx: &BuildCtx<'a>) -> Option<&'a Report> {
    ctx.ext::<Report>()
}

#[cfg(test)]
mod tests {
    use crate::runtime::stage::Role;
    const REGISTRY: &[&dyn crate::runtime::driver::StageFactory] = super::REGISTRY.all();

    /// What the stages after training need of the step executor's snapshots, planned from the
    /// repository's configs: an EMA needs every step; checkpoints alone every `every`-th
    /// (joined over several consumers); the artifact and the evaluation only the last.
    #[test]
    fn the_step_executor_is_asked_only_for_the_snapshots_its_consumers_need() {
        use crate::runtime::stage::Demand;
        let demand = |sets: &[&str]| {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let loaded =
                crate::runtime::config::load::<crate::train::config::Config>(&root.join("pipelines/baseline.toml"), &sets).unwrap();
            let plan = crate::runtime::graph::plan(&loaded, &super::REGISTRY).unwrap();
            plan.stages[plan.index("train").unwrap()].demand
        };
        // The baseline: checkpoints every 1000 steps, then the artifact and the evaluation.
        assert_eq!(demand(&[]), Demand::every(1000));
        assert!(demand(&[]).wants(2000) && !demand(&[]).wants(1500));
        assert_eq!(demand(&["stages.ckpt.every=0"]), Demand::LAST);
        assert!(!Demand::LAST.wants(0));
        // An EMA in front of the checkpoints needs every step.
        let ema =
            ["stages.avg.kind=\"ema_swa\"", "stages.avg.impl=\"ema\"", "stages.avg.inputs=[\"train\"]", "stages.ckpt.inputs=[\"avg\"]"];
        assert_eq!(demand(&ema), Demand::ALL);
        // A pass-through averager asks nothing of its own; SWA every 50 joins with 1000 to 50.
        let none =
            ["stages.avg.kind=\"ema_swa\"", "stages.avg.impl=\"none\"", "stages.avg.inputs=[\"train\"]", "stages.ckpt.inputs=[\"avg\"]"];
        assert_eq!(demand(&none), Demand::every(1000));
        let swa =
            ["stages.avg.kind=\"ema_swa\"", "stages.avg.impl=\"swa\"", "stages.avg.inputs=[\"train\"]", "stages.ckpt.inputs=[\"avg\"]"];
        assert_eq!(demand(&swa), Demand::every(50));
    }

    #[test]
    fn no_duplicate_kind_impl_pairs() {
        for (i, a) in REGISTRY.iter().enumerate() {
            for b in &REGISTRY[i + 1..] {
                assert!(!(a.kind() == b.kind() && a.name() == b.name()), "{}/{} registered twice", a.kind(), a.name());
            }
        }
    }

    #[test]
    fn names_are_snake_case_and_documented() {
        let ok = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        for f in REGISTRY {
            assert!(ok(f.kind()) && ok(f.name()), "{}/{}: names must be snake_case", f.kind(), f.name());
            assert!(!f.doc().is_empty(), "{}/{} has no doc line", f.kind(), f.name());
        }
    }

    #[test]
    fn one_role_per_kind_and_types_match_role() {
        for f in REGISTRY {
            for g in super::REGISTRY.impls(f.kind()) {
                assert_eq!(f.role(), g.role(), "kind `{}` mixes roles", f.kind());
            }
            assert_eq!(f.input().is_none(), f.role() == Role::Source, "{}/{}", f.kind(), f.name());
            assert_eq!(f.output().is_none(), f.role() == Role::Sink, "{}/{}", f.kind(), f.name());
        }
    }

    #[test]
    fn every_param_is_documented() {
        for f in REGISTRY {
            let schema = f.schema();
            let props = schema.get("properties").and_then(|p| p.as_object()).cloned().unwrap_or_default();
            for (name, prop) in props {
                assert!(prop.get("description").is_some(), "{}/{}: parameter `{name}` has no doc comment", f.kind(), f.name());
            }
        }
    }

    /// Every implementation refuses a key it does not take, naming it, and takes each key its
    /// schema lists (those of a flattened library config too): the runtime's check stands in
    /// for serde's `deny_unknown_fields`, which `flatten` turns off.
    #[test]
    fn every_implementation_refuses_an_unknown_key_and_takes_its_own() {
        use figment::value::{Dict, Value};
        for f in REGISTRY {
            let mut dict = Dict::new();
            dict.insert("no_such_key".into(), Value::from(1));
            let e = f.resolve(&Value::from(dict)).map(drop).expect_err(&format!("{}/{} took `no_such_key`", f.kind(), f.name()));
            assert!(matches!(&e.kind, figment::error::Kind::UnknownField(k, _) if k == "no_such_key"), "{}/{}: {e}", f.kind(), f.name());
            let required = f.schema().get("required").and_then(|r| r.as_array()).map_or(0, |r| r.len());
            if required == 0 {
                // The defaults, written out key by key, resolve to themselves.
                let defaults = f.resolve(&Value::from(Dict::new())).unwrap();
                let back = f.resolve(&Value::serialize(&defaults).unwrap()).unwrap();
                assert_eq!(back, defaults, "{}/{}", f.kind(), f.name());
            }
        }
    }

    /// `pipeline stages` starts every parameter's doc at one column within an implementation,
    /// however long its names (the flattened library keys are).
    #[test]
    fn the_catalogs_columns_line_up() {
        let text = crate::runtime::catalog::render(&super::REGISTRY);
        for block in text.split("  impl = ").skip(1) {
            let docs: Vec<usize> = block
                .lines()
                .skip(1)
                .take_while(|l| l.starts_with("      "))
                .map(|l| {
                    // The doc starts after the third gap of the padded columns.
                    let mut cols = 0;
                    let mut at = 6;
                    let b = l.as_bytes();
                    while cols < 3 {
                        while at < b.len() && b[at] != b' ' {
                            at += 1;
                        }
                        while at < b.len() && b[at] == b' ' {
                            at += 1;
                        }
                        cols += 1;
                    }
                    at
                })
                .collect();
            assert!(docs.windows(2).all(|w| w[0] == w[1]), "{block}");
        }
    }

    #[test]
    fn defaults_resolve_when_no_param_is_required() {
        for f in REGISTRY {
            let schema = f.schema();
            let required = schema.get("required").and_then(|r| r.as_array()).map(|r| r.len()).unwrap_or(0);
            if required == 0 {
                let empty = figment::value::Value::from(figment::value::Dict::new());
                f.resolve(&empty).unwrap_or_else(|e| panic!("{}/{}: {e}", f.kind(), f.name()));
            }
        }
    }
}
