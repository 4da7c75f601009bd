//! From `[stages.*]` tables to a checked plan: which implementation each stage runs, with
//! which parameters, fed by which stages, through a channel of which capacity.
//!
//! [`plan`] checks everything that needs no resources and reports every problem it finds:
//! unknown kind or implementation, bad or missing keys, parameter types, inputs naming no stage,
//! sources with inputs, consumers without, message types that disagree across an edge, cycles,
//! outputs nobody consumes, queue depths of 0. [`check_resources`] then runs each
//! implementation's own `check` (files exist, ...), as `pipeline validate` does.

use std::collections::BTreeMap;

use figment::value::{Dict, Value};
use serde::Deserialize;

use crate::runtime::config::{Loaded, RunConfig, Tables, push_figment_error};
use crate::runtime::driver::StageFactory;
use crate::runtime::error::ConfigErrors;
use crate::runtime::registry::Registry;
use crate::runtime::stage::{BuildCtx, Demand, Extensions, Role};

/// Keys every stage table may have besides its implementation's parameters.
pub const RESERVED_KEYS: [&str; 4] = ["kind", "impl", "inputs", "queue"];

/// Default capacity of the channel feeding a stage.
pub const DEFAULT_QUEUE: usize = 2;

/// One stage of a checked plan.
pub struct PlannedStage {
    /// Its `[stages.NAME]` key.
    pub name: String,
    /// The implementation it runs.
    pub factory: &'static dyn StageFactory,
    /// Its parameters with every default filled in.
    pub params: toml::Table,
    /// Indices (into [`Plan::stages`]) of the stages feeding it, in config order.
    pub inputs: Vec<usize>,
    /// Indices of the stages it feeds.
    pub consumers: Vec<usize>,
    /// Capacity of its input channel (0 for a source).
    pub queue: usize,
    /// Which of its output items its consumers need ([`Demand`]: each consumer's own need
    /// joined with what it passes on to its consumers).
    pub demand: Demand,
    /// Keys of its table that another implementation of its kind takes and this one does not:
    /// set aside rather than refused, so that `impl` alone switches implementations (in an
    /// ablation, or with `--set`). A key no implementation of the kind takes is an error.
    pub set_aside: Vec<String>,
}

impl PlannedStage {
    /// What its `check` and `memory` see: `[run]`, the application's extensions and its place
    /// in the graph, no run yet.
    pub fn check_ctx<'a>(&'a self, run: &'a RunConfig, ext: &'a Extensions) -> BuildCtx<'a> {
        BuildCtx { stage: &self.name, run, ext, run_dir: None, consumers: self.consumers.len(), queue: self.queue, demand: self.demand }
    }

    /// A note naming the keys set aside ([`PlannedStage::set_aside`]), if any.
    pub fn set_aside_note(&self) -> Option<String> {
        (!self.set_aside.is_empty()).then(|| {
            format!(
                "stages.{}: {} taken by other {} implementations, not by `{}`: set aside",
                self.name,
                self.set_aside.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "),
                self.factory.kind(),
                self.factory.name()
            )
        })
    }
}

/// A checked graph, stages in topological order (ties broken by name).
pub struct Plan {
    /// The stages, sources first.
    pub stages: Vec<PlannedStage>,
    /// Index of the stage whose input-bound fraction the verdict reports.
    pub focus: usize,
}

impl Plan {
    /// Index of the stage called `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.stages.iter().position(|s| s.name == name)
    }

    /// Per stage, whether it is reached from stage `from` through a chain of channels: along
    /// them only (the stages `from` feeds), or with `both_ways` in either direction (the graph
    /// `from` is part of). `from` itself counts as reached.
    pub fn reachable(&self, from: usize, both_ways: bool) -> Vec<bool> {
        let mut seen = vec![false; self.stages.len()];
        let mut stack = vec![from];
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            let s = &self.stages[i];
            stack.extend(&s.consumers);
            if both_ways {
                stack.extend(&s.inputs);
            }
        }
        seen
    }

    /// The resolved `[stages]` tables, as written to `RUN_DIR/config.toml`.
    pub fn stage_tables(&self) -> toml::Table {
        let mut out = toml::Table::new();
        for s in &self.stages {
            let mut t = toml::Table::new();
            t.insert("kind".into(), s.factory.kind().into());
            t.insert("impl".into(), s.factory.name().into());
            if s.factory.role() != Role::Source {
                let inputs = s.inputs.iter().map(|&i| toml::Value::from(self.stages[i].name.clone())).collect::<Vec<_>>();
                t.insert("inputs".into(), toml::Value::Array(inputs));
                t.insert("queue".into(), toml::Value::Integer(s.queue as i64));
            }
            for (k, v) in &s.params {
                t.insert(k.clone(), v.clone());
            }
            out.insert(s.name.clone(), toml::Value::Table(t));
        }
        out
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Head {
    kind: String,
    #[serde(rename = "impl")]
    imp: Option<String>,
    #[serde(default)]
    inputs: Vec<String>,
    queue: Option<i64>,
}

struct Draft {
    name: String,
    factory: &'static dyn StageFactory,
    params: toml::Table,
    inputs: Vec<String>,
    queue: usize,
    set_aside: Vec<String>,
}

/// Checks the stage tables of `loaded` against the implementations of `registry` and orders
/// them into a [`Plan`].
pub fn plan<C: Tables>(loaded: &Loaded<C>, registry: &Registry) -> Result<Plan, ConfigErrors> {
    let mut errors = ConfigErrors::default();
    let tables = loaded.config.stages();
    let file = loaded.path.display().to_string();
    if tables.is_empty() {
        errors.push(file.clone(), Some("stages".into()), "no stages: add at least a source and a sink as [stages.NAME] tables");
        return Err(errors);
    }

    let mut drafts: Vec<Draft> = Vec::new();
    for (name, table) in tables {
        if let Some(d) = draft_stage(loaded, registry, name, table, &mut errors) {
            drafts.push(d);
        }
    }

    // Inputs and roles.
    let names: Vec<&str> = tables.keys().map(String::as_str).collect();
    for d in &drafts {
        let key = |k: &str| Some(format!("stages.{}.{k}", d.name));
        let role = d.factory.role();
        if role == Role::Source && !d.inputs.is_empty() {
            errors.push(
                loaded.origin_of(&format!("stages.{}.inputs", d.name)),
                key("inputs"),
                format!("stage `{}` is a source ({}/{}) and takes no inputs", d.name, d.factory.kind(), d.factory.name()),
            );
        }
        if role != Role::Source && d.inputs.is_empty() {
            errors.push(
                loaded.origin_of(&format!("stages.{}", d.name)),
                key("inputs"),
                format!(
                    "stage `{}` ({}/{}) needs `inputs = [\"...\"]` naming the stages that feed it",
                    d.name,
                    d.factory.kind(),
                    d.factory.name()
                ),
            );
        }
        for (i, inp) in d.inputs.iter().enumerate() {
            if d.inputs[..i].contains(inp) {
                errors.push(
                    loaded.origin_of(&format!("stages.{}.inputs", d.name)),
                    key("inputs"),
                    format!("input `{inp}` is listed twice"),
                );
            } else if inp == &d.name {
                errors.push(
                    loaded.origin_of(&format!("stages.{}.inputs", d.name)),
                    key("inputs"),
                    format!("stage `{}` cannot feed itself", d.name),
                );
            } else if !names.contains(&inp.as_str()) {
                errors.push(
                    loaded.origin_of(&format!("stages.{}.inputs", d.name)),
                    key("inputs"),
                    format!("input `{inp}` names no stage; stages are: {}", names.join(", ")),
                );
            }
        }
    }

    // Types across every edge whose both ends were understood.
    let by_name: BTreeMap<&str, &Draft> = drafts.iter().map(|d| (d.name.as_str(), d)).collect();
    for d in &drafts {
        let Some(want) = d.factory.input() else { continue };
        for inp in &d.inputs {
            let Some(up) = by_name.get(inp.as_str()) else { continue };
            match up.factory.output() {
                None => errors.push(
                    loaded.origin_of(&format!("stages.{}.inputs", d.name)),
                    Some(format!("stages.{}.inputs", d.name)),
                    format!("input `{inp}` is a sink ({}/{}) and produces nothing", up.factory.kind(), up.factory.name()),
                ),
                Some(got) if got != want => errors.push(
                    loaded.origin_of(&format!("stages.{}.inputs", d.name)),
                    Some(format!("stages.{}.inputs", d.name)),
                    format!(
                        "message types disagree: `{inp}` ({}/{}) produces {} but `{}` ({}/{}) takes {}",
                        up.factory.kind(),
                        up.factory.name(),
                        got.name,
                        d.name,
                        d.factory.kind(),
                        d.factory.name(),
                        want.name
                    ),
                ),
                Some(_) => {}
            }
        }
    }
    if !errors.is_empty() || drafts.len() != tables.len() {
        return Err(errors);
    }

    // Consumers, orphans, cycles.
    let idx: BTreeMap<String, usize> = drafts.iter().enumerate().map(|(i, d)| (d.name.clone(), i)).collect();
    let n = drafts.len();
    let mut consumers = vec![Vec::new(); n];
    for (i, d) in drafts.iter().enumerate() {
        for inp in &d.inputs {
            consumers[idx[inp]].push(i);
        }
    }
    for (i, d) in drafts.iter().enumerate() {
        if d.factory.role() != Role::Sink && !d.factory.output_optional() && consumers[i].is_empty() {
            errors.push(
                loaded.origin_of(&format!("stages.{}", d.name)),
                Some(format!("stages.{}", d.name)),
                format!("the output of `{}` ({}/{}) feeds no stage; list it in some stage's `inputs` (a `drain` stage consumes anything of type Blob)", d.name, d.factory.kind(), d.factory.name()),
            );
        }
    }
    let order = match topo_order(&drafts, &idx) {
        Ok(o) => o,
        Err(cycle) => {
            errors.push(file.clone(), Some("stages".into()), format!("the stages form a cycle: {}", cycle.join(" -> ")));
            return Err(errors);
        }
    };
    errors.clone().into_result()?;

    // Re-index in topological order.
    let mut new_index = vec![0; n];
    for (pos, &old) in order.iter().enumerate() {
        new_index[old] = pos;
    }
    let mut slots: Vec<Option<Draft>> = drafts.into_iter().map(Some).collect();
    let mut stages = Vec::with_capacity(n);
    for &old in &order {
        let d = slots[old].take().expect("each index appears once in a topological order");
        let inputs = d.inputs.iter().map(|s| new_index[idx[s]]).collect();
        let mut cons: Vec<usize> = consumers[old].iter().map(|&c| new_index[c]).collect();
        cons.sort_unstable();
        stages.push(PlannedStage {
            name: d.name,
            factory: d.factory,
            params: d.params,
            inputs,
            consumers: cons,
            queue: d.queue,
            demand: Demand::LAST,
            set_aside: d.set_aside,
        });
    }
    // What each stage's consumers need of its output, consumers first (reverse topological
    // order): a consumer's own need joined with what its own consumers need of it. A stage
    // whose parameters do not parse needs everything (its own error is reported elsewhere).
    for i in (0..stages.len()).rev() {
        let mut demand = Demand::LAST;
        for &c in &stages[i].consumers {
            let own = stages[c].factory.demand(&stages[c].params).unwrap_or(Demand::ALL);
            demand = demand.join(own).join(stages[c].demand);
        }
        stages[i].demand = demand;
    }
    let run = loaded.config.run();
    if run.trace && !run.instrument {
        let msg = "run.trace needs run.instrument = true: the trace is made of the instrumentation's timings";
        errors.push(loaded.origin_of("run.trace"), Some("run.trace".into()), msg);
        return Err(errors);
    }
    let mut plan = Plan { stages, focus: 0 };
    plan.focus = match choose_focus(&plan, &loaded.config.run().focus) {
        Ok(f) => f,
        Err(msg) => {
            errors.push(loaded.origin_of("run.focus"), Some("run.focus".into()), msg);
            return Err(errors);
        }
    };
    Ok(plan)
}

fn draft_stage<C>(loaded: &Loaded<C>, registry: &Registry, name: &str, table: &Dict, errors: &mut ConfigErrors) -> Option<Draft> {
    let base = format!("stages.{name}");
    let mut head_dict = Dict::new();
    let mut params = Dict::new();
    for (k, v) in table {
        if RESERVED_KEYS.contains(&k.as_str()) {
            head_dict.insert(k.clone(), v.clone());
        } else {
            params.insert(k.clone(), v.clone());
        }
    }
    let head: Head = match Value::from(head_dict).deserialize() {
        Ok(h) => h,
        Err(e) => {
            push_figment_error(errors, loaded, Some(&base), e);
            return None;
        }
    };
    let kinds = registry.kinds();
    let impls = registry.impls(&head.kind);
    if impls.is_empty() {
        errors.push(
            loaded.origin_of(&format!("{base}.kind")),
            Some(format!("{base}.kind")),
            format!("unknown stage kind `{}`; known kinds: {}", head.kind, kinds.join(", ")),
        );
        return None;
    }
    let factory = match &head.imp {
        None => impls[0],
        Some(i) => match registry.find(&head.kind, i) {
            Some(f) => f,
            None => {
                let names: Vec<&str> = impls.iter().map(|f| f.name()).collect();
                errors.push(
                    loaded.origin_of(&format!("{base}.impl")),
                    Some(format!("{base}.impl")),
                    format!("unknown implementation `{i}` of kind `{}`; available: {}", head.kind, names.join(", ")),
                );
                return None;
            }
        },
    };
    let queue = match head.queue {
        None => DEFAULT_QUEUE,
        Some(q) if factory.role() == Role::Source => {
            errors.push(
                loaded.origin_of(&format!("{base}.queue")),
                Some(format!("{base}.queue")),
                format!("stage `{name}` is a source and has no input channel; remove `queue` (it was {q})"),
            );
            return None;
        }
        Some(q) if q < 1 => {
            errors.push(
                loaded.origin_of(&format!("{base}.queue")),
                Some(format!("{base}.queue")),
                format!("queue must be at least 1 (it is the capacity of the channel feeding `{name}`); found {q}"),
            );
            return None;
        }
        Some(q) => q as usize,
    };
    let set_aside = set_aside_sibling_keys(factory, &impls, &mut params);
    let params = match factory.resolve(&Value::from(params)) {
        Ok(p) => p,
        Err(e) => {
            let before = errors.0.len();
            push_figment_error(errors, loaded, Some(&base), e);
            for issue in &mut errors.0[before..] {
                issue.message = format!("{} (stage `{name}`, {}/{})", issue.message, factory.kind(), factory.name());
            }
            return None;
        }
    };
    Some(Draft { name: name.to_string(), factory, params, inputs: head.inputs, queue, set_aside })
}

/// The parameter names an implementation takes (its schema's properties).
fn param_names(f: &dyn StageFactory) -> Vec<String> {
    crate::runtime::stage::schema_keys(&f.schema())
}

/// Removes from `params` (and returns, sorted) the keys `factory` does not take but a sibling
/// implementation of its kind does.
fn set_aside_sibling_keys(factory: &dyn StageFactory, siblings: &[&'static dyn StageFactory], params: &mut Dict) -> Vec<String> {
    let own = param_names(factory);
    let foreign: Vec<&String> = params.keys().filter(|k| !own.contains(k)).collect();
    if foreign.is_empty() {
        // The usual case: the siblings' schemas need not be made.
        return Vec::new();
    }
    let others: Vec<String> = siblings.iter().filter(|s| s.name() != factory.name()).flat_map(|s| param_names(*s)).collect();
    let aside: Vec<String> = foreign.into_iter().filter(|k| others.contains(k)).cloned().collect();
    for k in &aside {
        params.remove(k);
    }
    aside
}

/// Kahn's algorithm; on a cycle, returns the names along one cycle (first name repeated last).
fn topo_order(drafts: &[Draft], idx: &BTreeMap<String, usize>) -> Result<Vec<usize>, Vec<String>> {
    let n = drafts.len();
    let mut indeg: Vec<usize> = drafts.iter().map(|d| d.inputs.len()).collect();
    let mut outs = vec![Vec::new(); n];
    for (i, d) in drafts.iter().enumerate() {
        for inp in &d.inputs {
            outs[idx[inp]].push(i);
        }
    }
    let mut ready: std::collections::BTreeSet<(String, usize)> =
        (0..n).filter(|&i| indeg[i] == 0).map(|i| (drafts[i].name.clone(), i)).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(first) = ready.pop_first() {
        let i = first.1;
        order.push(i);
        for &c in &outs[i] {
            indeg[c] -= 1;
            if indeg[c] == 0 {
                ready.insert((drafts[c].name.clone(), c));
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Walk backwards along inputs among the stages left over until a stage repeats.
    let left: Vec<bool> = (0..n).map(|i| indeg[i] > 0).collect();
    let mut at = (0..n).find(|&i| left[i]).unwrap_or(0);
    let mut path = vec![at];
    loop {
        let next = drafts[at].inputs.iter().map(|s| idx[s]).find(|&j| left[j]).unwrap_or(at);
        if let Some(pos) = path.iter().position(|&p| p == next) {
            let mut cycle: Vec<String> = path[pos..].iter().rev().map(|&i| drafts[i].name.clone()).collect();
            cycle.push(cycle[0].clone());
            return Err(cycle);
        }
        path.push(next);
        at = next;
    }
}

fn choose_focus(plan: &Plan, wanted: &str) -> Result<usize, String> {
    if !wanted.is_empty() {
        return plan.index(wanted).ok_or_else(|| format!("`{wanted}` names no stage"));
    }
    // A training graph is about its step executor (the stages after it evaluate and save);
    // otherwise the sink with the longest path from a source, or the last stage if none.
    if let Some(i) = plan.stages.iter().position(|s| s.factory.kind() == "step_executor") {
        return Ok(i);
    }
    let mut depth = vec![0usize; plan.stages.len()];
    for (i, s) in plan.stages.iter().enumerate() {
        depth[i] = s.inputs.iter().map(|&j| depth[j] + 1).max().unwrap_or(0);
    }
    let sinks = (0..plan.stages.len()).filter(|&i| plan.stages[i].factory.role() == Role::Sink);
    Ok(sinks.max_by_key(|&i| (depth[i], std::cmp::Reverse(i))).unwrap_or(plan.stages.len() - 1))
}

/// Every stage's memory estimate ([`crate::runtime::memory`]), judged against `[run] max_memory_gb` or
/// what the machine has: the host's available memory on "cpu", else `gpu_free` (the free
/// memory of the GPU `run.device` names, which the caller measures; `None` when unknown). A
/// stage whose estimate fails (a config its check refuses, a shard that cannot be read) is
/// listed as not estimated.
pub fn memory<C: Tables>(plan: &Plan, loaded: &Loaded<C>, ext: &Extensions, gpu_free: Option<u64>) -> crate::runtime::memory::Estimate {
    let run = loaded.config.run();
    let (mut needs, mut unknown) = (Vec::new(), Vec::new());
    for s in &plan.stages {
        let ctx = s.check_ctx(run, ext);
        match s.factory.memory(&s.params, &ctx) {
            Ok(list) => needs.extend(list.into_iter().map(|n| crate::runtime::memory::Need { stage: s.name.clone(), ..n })),
            Err(e) => unknown.push(format!("{} ({e:#})", s.name)),
        }
    }
    // The estimate takes the GPU's free memory as the budget only off the host and without
    // `max_memory_gb`.
    let on_host = run.device == "cpu";
    crate::runtime::memory::Estimate { unknown, ..crate::runtime::memory::Estimate::new(needs, on_host, run.max_memory_gb, gpu_free) }
}

/// On `--resume RUN_DIR`: the first stage's message that the run it continues is complete
/// ([`crate::runtime::stage::Transform::nothing_left`]), if one says so. `ext` holds what the
/// stages compare: the resume state and the previous process's report.
pub fn nothing_left<C: Tables>(
    plan: &Plan,
    loaded: &Loaded<C>,
    ext: &Extensions,
    run_dir: Option<&std::path::Path>,
) -> anyhow::Result<Option<String>> {
    for s in &plan.stages {
        let ctx = BuildCtx { run_dir, ..s.check_ctx(loaded.config.run(), ext) };
        if let Some(message) = s.factory.nothing_left(&s.params, &ctx)? {
            return Ok(Some(message));
        }
    }
    Ok(None)
}

/// The memory estimate's refusals as config errors, each blamed on the origin of the key that
/// sizes the largest part (the `--set` that made the model too big, say).
pub fn check_memory<C>(estimate: &crate::runtime::memory::Estimate, loaded: &Loaded<C>) -> Result<(), ConfigErrors> {
    let mut errors = ConfigErrors::default();
    for (message, keys) in estimate.check() {
        // The key to blame: the first of the largest parts' keys that a `--set` or the
        // environment gave (what the user just changed), else the first of them.
        let key = keys.iter().find(|k| loaded.overridden(k)).or(keys.first()).cloned();
        let origin = key.as_deref().map(|k| loaded.origin_of(k)).unwrap_or_else(|| loaded.origin_of("run.max_memory_gb"));
        errors.push(origin, key, message);
    }
    errors.into_result()
}

/// Runs every implementation's `check` (what `pipeline validate` adds to [`plan`]).
pub fn check_resources<C: Tables>(plan: &Plan, loaded: &Loaded<C>, ext: &Extensions) -> Result<(), ConfigErrors> {
    let mut errors = ConfigErrors::default();
    for s in &plan.stages {
        let ctx = s.check_ctx(loaded.config.run(), ext);
        if let Err(e) = s.factory.check(&s.params, &ctx) {
            let (key, message) = (format!("stages.{}", s.name), format!("{e:#}"));
            errors.push(loaded.origin_in(&key, &message), Some(key), message);
        }
    }
    errors.into_result()
}
