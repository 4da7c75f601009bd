//! The stage contract: what a stage implementation writes, and how the runtime drives it.
//!
//! A stage implementation is one type implementing [`Source`], [`Transform`] or [`Sink`], plus
//! one line in a registry wrapping it in `SourceImpl`, `TransformImpl` or `SinkImpl`
//! ([`crate::runtime::driver`], which also holds the loops). The runtime owns the loop: it
//! receives, times the call, sends, counts, and handles stop and abort; the implementation only
//! turns items into items.
//!
//! Lifecycle of every stage, on its own thread:
//! 1. `build` (on the main thread, before any thread starts) from its typed `Params`;
//! 2. the loop: `next` / `process` / `consume`, once per item, until the input ends, the
//!    source is exhausted, the graph stops, or the call returns an error;
//! 3. `flush`, always, unless the stage itself failed (a checkpointer saves here; the reason is
//!    in [`Ctx::stop_reason`]).
//!
//! Returning an error (or panicking) from any call stops the whole graph; the error is reported
//! with the stage's name. [`Stopped`] returned by an emit is not an error: it means the graph is
//! aborting, and propagating it with `?` ends the stage quietly.

use std::any::Any;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use crate::runtime::channel::Stopped;
use crate::runtime::channel::{EdgeOutStats, Meter, OutPort};
use crate::runtime::config::RunConfig;
use crate::runtime::control::{Control, POLL, StopReason};
use crate::runtime::message::Message;
use crate::runtime::metrics::Hist;
use crate::runtime::trace::{ItemRecord, StageTrace};

/// Typed parameters of a stage implementation: the keys of its `[stages.NAME]` table besides
/// `kind`, `impl`, `inputs` and `queue`. Use `#[serde(default)]` and a doc comment per field:
/// `pipeline stages` prints them; unknown keys are refused against the schema ([`unknown_keys`]),
/// so a stage may `#[serde(flatten)]` its library's config.
pub trait Params: Serialize + DeserializeOwned + JsonSchema + 'static {}
impl<T: Serialize + DeserializeOwned + JsonSchema + 'static> Params for T {}

/// The keys a [`Params`] type takes: its schema's properties, in order, those of configs it
/// `#[serde(flatten)]`s included (the schema merges them). Computed once per type.
pub fn param_keys<P: Params>() -> &'static [&'static str] {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static KEYS: OnceLock<Mutex<HashMap<std::any::TypeId, &'static [&'static str]>>> = OnceLock::new();
    let mut known = KEYS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    known.entry(std::any::TypeId::of::<P>()).or_insert_with(|| {
        let names = schema_keys(&schemars::SchemaGenerator::default().into_root_schema_for::<P>());
        names.into_iter().map(|n| &*n.leak()).collect::<Vec<&'static str>>().leak()
    })
}

/// The property names of a parameters' schema, in order.
pub fn schema_keys(schema: &schemars::Schema) -> Vec<String> {
    schema.get("properties").and_then(|p| p.as_object()).map(|p| p.keys().cloned().collect()).unwrap_or_default()
}

/// Refuses a key of a stage's table `raw` that `P` does not take, as `#[serde(deny_unknown_fields)]`
/// would: serde cannot check a struct that flattens a library's config into the stage's keys,
/// so the runtime checks every stage's table against [`param_keys`].
#[allow(clippy::result_large_err)] // figment's error, as its own `extract` returns: the key and where it came from
pub fn unknown_keys<P: Params>(raw: &figment::value::Value) -> Result<(), figment::Error> {
    let Some(dict) = raw.as_dict() else { return Ok(()) };
    let keys = param_keys::<P>();
    match dict.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(figment::error::Kind::UnknownField(k.clone(), keys).into()),
        None => Ok(()),
    }
}

/// A stage's parameters from the TOML table `text`, as the driver reads them: unknown keys
/// refused ([`unknown_keys`]), then deserialized (the stages' tests).
#[cfg(test)]
#[allow(clippy::result_large_err)] // figment's error, as the driver gets it
pub fn parse_params<P: Params>(text: &str) -> Result<P, figment::Error> {
    let raw = figment::value::Value::serialize(toml::from_str::<toml::Table>(text).expect("a TOML table"))?;
    unknown_keys::<P>(&raw)?;
    raw.deserialize()
}

/// Where a stage sits in the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// No input; produces items.
    Source,
    /// One input channel (fed by one or more stages); produces items.
    Transform,
    /// One input channel; produces nothing.
    Sink,
}

impl Role {
    /// Lower-case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Source => "source",
            Role::Transform => "transform",
            Role::Sink => "sink",
        }
    }
}

/// Typed values the application hands every stage's `check`, `memory`, `nothing_left` and
/// `build`, one per type: its config tables, the state a resumed run continues from, the report
/// of the process it continues. The runtime carries them without knowing what they are; each
/// type is owned by the area that defines it, and a stage asks for the ones it reads
/// ([`BuildCtx::ext`]).
#[derive(Default)]
pub struct Extensions(std::collections::HashMap<std::any::TypeId, Box<dyn Any + Send + Sync>>);

impl Extensions {
    /// Adds `value`, replacing any value of the same type.
    pub fn insert<T: Any + Send + Sync>(&mut self, value: T) {
        self.0.insert(std::any::TypeId::of::<T>(), Box::new(value));
    }

    /// The value of type `T`, if one was added.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.get(&std::any::TypeId::of::<T>()).and_then(|b| b.downcast_ref())
    }

    /// Removes and returns the value of type `T`.
    pub fn remove<T: Any>(&mut self) -> Option<T> {
        self.0.remove(&std::any::TypeId::of::<T>()).and_then(|b| b.downcast().ok()).map(|b| *b)
    }
}

/// What `build` and `check` may look at.
pub struct BuildCtx<'a> {
    /// The stage's name (its `[stages.NAME]` key).
    pub stage: &'a str,
    /// `[run]`.
    pub run: &'a RunConfig,
    /// What the application adds (its config tables, resume state): see [`Extensions`].
    pub ext: &'a Extensions,
    /// The run directory, when building for a run (absent under `pipeline validate`).
    pub run_dir: Option<&'a Path>,
    /// How many stages read this stage's output (0 for a sink, or a transform whose output is
    /// optional and unused: it may skip making it).
    pub consumers: usize,
    /// The capacity of this stage's input channel (`queue`; 0 for a source): items that may
    /// wait for it, which its memory estimate counts.
    pub queue: usize,
    /// Which of this stage's output items its consumers need ([`Demand`]): a producer whose
    /// items are costly may skip the others (the last item always goes).
    pub demand: Demand,
}

/// Which items of a producer a stage needs, by the producer's own count (its
/// [`Transform::demand`] and [`Sink::demand`]): every `n`-th, or only the last. The planner
/// joins what the consumers of a stage need, each with what its own consumers need (a stage
/// that is not given an item cannot pass it on), into [`BuildCtx::demand`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// `Some(n)`: items whose count is a multiple of `n`; `None`: the last only.
    every: Option<u64>,
}

impl Demand {
    /// Every item.
    pub const ALL: Demand = Demand { every: Some(1) };
    /// The last item only.
    pub const LAST: Demand = Demand { every: None };

    /// Every `n`-th item and the last (`n` = 0: the last only).
    pub fn every(n: u64) -> Demand {
        Demand { every: (n > 0).then_some(n) }
    }

    /// What either needs: every item a multiple of `gcd(n, m)` (at least the items of both).
    pub fn join(self, other: Demand) -> Demand {
        fn gcd(a: u64, b: u64) -> u64 {
            if b == 0 { a } else { gcd(b, a % b) }
        }
        match (self.every, other.every) {
            (Some(a), Some(b)) => Demand { every: Some(gcd(a, b)) },
            (a, b) => Demand { every: a.or(b) },
        }
    }

    /// Whether item `count` (the producer's count, not the last) is needed.
    pub fn wants(self, count: u64) -> bool {
        self.every.is_some_and(|n| count.is_multiple_of(n))
    }
}

impl<'a> BuildCtx<'a> {
    /// The extension of type `T`, if the application added one (the resume state of a run
    /// that was not resumed is absent, say).
    pub fn ext<T: Any>(&self) -> Option<&'a T> {
        self.ext.get::<T>()
    }

    /// The extension of type `T`, or an error naming the stage and the type: for what a stage
    /// cannot build without (its application's config).
    pub fn need<T: Any>(&self) -> anyhow::Result<&'a T> {
        self.ext().ok_or_else(|| {
            anyhow::anyhow!("stage `{}` needs a {} that this program does not provide", self.stage, std::any::type_name::<T>())
        })
    }

    /// A seed for this stage: the run's seed mixed with the stage name, so two stages of the same
    /// implementation draw different numbers while runs with the same seed repeat exactly.
    pub fn seed(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ self.run.seed;
        for b in self.stage.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
}

/// The runtime's face towards a running stage.
pub struct Ctx {
    name: String,
    control: Arc<Control>,
    extra: BTreeMap<String, Hist>,
    sections: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
    discarded: bool,
    trace: Option<StageTrace>,
}

impl Ctx {
    pub(crate) fn new(name: &str, control: Arc<Control>, sections: Arc<Mutex<BTreeMap<String, serde_json::Value>>>) -> Self {
        Self { name: name.to_string(), control, extra: BTreeMap::new(), sections, discarded: false, trace: None }
    }

    /// The stage's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True once the graph is stopping (gracefully or not). Sources check it for you between
    /// items; long calls may check it themselves.
    pub fn stopping(&self) -> bool {
        self.control.stopping()
    }

    /// True once the graph is aborting: finish the current item quickly.
    pub fn aborted(&self) -> bool {
        self.control.aborting()
    }

    /// Asks the whole graph to finish: sources stop, items in flight drain, stages flush.
    /// What a step executor calls when it reaches its last step.
    pub fn request_stop(&self) {
        self.control.request_stop();
    }

    /// Runs `f`, the stage's closing work (a final validation, saving weights), with the drain
    /// timeout held off: `[run] drain_timeout_ms` bounds how long in-flight items may take to
    /// drain, not how long a final evaluation may take. An abort still applies: `f` should check
    /// [`Ctx::aborted`] in its loops.
    pub fn finishing<R>(&mut self, f: impl FnOnce(&mut Ctx) -> R) -> R {
        struct Guard(Arc<Control>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.end_finishing();
            }
        }
        self.control.begin_finishing();
        let _guard = Guard(self.control.clone());
        f(self)
    }

    /// Why the graph is ending; meaningful in `flush`.
    pub fn stop_reason(&self) -> StopReason {
        self.control.reason()
    }

    /// Sleeps for `d`, waking early if the graph aborts; returns false if it did.
    pub fn sleep(&self, d: Duration) -> bool {
        self.sleep_while(d, || self.control.aborting())
    }

    /// Sleeps for `d`, waking early if the graph stops or aborts; returns false if it did. What a
    /// source pacing itself uses, so that a graceful stop ends it at once.
    pub fn sleep_unless_stopping(&self, d: Duration) -> bool {
        self.sleep_while(d, || self.control.stopping())
    }

    fn sleep_while(&self, d: Duration, wake: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + d;
        loop {
            if wake() {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            std::thread::sleep((deadline - now).min(POLL));
        }
    }

    /// Records a duration into a stage-specific histogram (reported under the stage's
    /// `extra_us.NAME`), e.g. a checkpoint's write time.
    pub fn record(&mut self, metric: &str, ns: u64) {
        match self.extra.get_mut(metric) {
            Some(h) => h.record(ns),
            None => {
                let mut h = Hist::new();
                h.record(ns);
                self.extra.insert(metric.to_string(), h);
            }
        }
    }

    /// Marks the item being processed as dropped unprocessed (a batch still in flight after a
    /// step executor's last step): its time is not recorded as service, so the service-time
    /// distribution (what `pipeline advise` simulates from) holds only real work, and it is
    /// counted in the report's `items_dropped`.
    pub fn discard(&mut self) {
        self.discarded = true;
    }

    /// Records, for the run's trace (`[run] trace = true`), consecutive phases of the current
    /// item's work that have just ended, in order (the last ends now): they show as slices
    /// nested in the item's. A step executor's forward, backward and optimizer. Costs nothing
    /// when the run is not traced.
    pub fn trace_phases(&mut self, phases: &[(&'static str, Duration)]) {
        if let Some(t) = self.trace.as_mut() {
            t.phases_ending_now(phases);
        }
    }

    /// Starts recording this stage's trace.
    pub(crate) fn set_trace(&mut self, t: StageTrace) {
        self.trace = Some(t);
    }

    /// Records an item for the trace; nothing when the run is not traced.
    #[inline]
    pub(crate) fn trace_item(&mut self, r: ItemRecord) {
        if let Some(t) = self.trace.as_mut() {
            t.items.push(r);
        }
    }

    /// The trace recorded, taken at the thread's end.
    pub(crate) fn take_trace(&mut self) -> Option<StageTrace> {
        self.trace.take()
    }

    /// Whether the item just processed was discarded; resets the mark.
    pub(crate) fn take_discarded(&mut self) -> bool {
        std::mem::take(&mut self.discarded)
    }

    /// Publishes a top-level report section (e.g. `train`); a later call replaces it.
    pub fn publish(&self, section: &str, value: serde_json::Value) {
        if let Ok(mut s) = self.sections.lock() {
            s.insert(section.to_string(), value);
        }
    }

    pub(crate) fn take_extra(&mut self) -> BTreeMap<String, Hist> {
        std::mem::take(&mut self.extra)
    }
}

/// A source: produces items until it returns `None` or the graph stops.
pub trait Source: Sized + Send + 'static {
    /// Stage kind (`kind = "..."`).
    const KIND: &'static str;
    /// Implementation name (`impl = "..."`).
    const IMPL: &'static str;
    /// One line for `pipeline stages`.
    const DOC: &'static str;
    /// Its parameters.
    type Params: Params;
    /// What it produces.
    type Out: Message;
    /// Builds the stage. Runs on the main thread before the graph starts.
    fn build(params: Self::Params, ctx: &BuildCtx) -> anyhow::Result<Self>;
    /// Checks what `pipeline validate` can check without building (files exist, ...).
    fn check(_params: &Self::Params, _ctx: &BuildCtx) -> anyhow::Result<()> {
        Ok(())
    }
    /// What it will hold at its peak, estimated from the config alone (nothing allocated):
    /// see [`crate::runtime::memory`]. Called after `check` passed. Default: nothing worth counting.
    fn memory(_params: &Self::Params, _ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        Ok(Vec::new())
    }
    /// On `--resume RUN_DIR` (with [`BuildCtx::resume`] and [`BuildCtx::previous`]): a
    /// message saying the run is complete, when the process it continues finished everything
    /// this stage would do. Asked before anything is allocated or written; when any stage says
    /// so, the run starts nothing, changes no file, prints the message and exits 0. Default: no.
    fn nothing_left(_params: &Self::Params, _ctx: &BuildCtx) -> Option<String> {
        None
    }
    /// The next item; `None` when exhausted. Its duration is the stage's service time.
    fn next(&mut self, ctx: &mut Ctx) -> anyhow::Result<Option<Self::Out>>;
    /// Called once after the loop (see the module docs).
    fn flush(&mut self, _ctx: &mut Ctx) -> anyhow::Result<()> {
        Ok(())
    }
}

/// A transform: turns each input item into zero or more output items.
pub trait Transform: Sized + Send + 'static {
    /// Stage kind.
    const KIND: &'static str;
    /// Implementation name.
    const IMPL: &'static str;
    /// One line for `pipeline stages`.
    const DOC: &'static str;
    /// Its parameters.
    type Params: Params;
    /// What it takes.
    type In: Message;
    /// What it produces.
    type Out: Message;
    /// True when nothing has to read the output (a step executor's snapshots serve optional
    /// stages after training): the graph then accepts the stage without consumers.
    const OUTPUT_OPTIONAL: bool = false;
    /// Which of its producer's items it needs for its own work ([`Demand`]; what it passes on
    /// to its consumers is added by the planner). Default: every item.
    fn demand(_params: &Self::Params) -> Demand {
        Demand::ALL
    }
    /// Builds the stage.
    fn build(params: Self::Params, ctx: &BuildCtx) -> anyhow::Result<Self>;
    /// See [`Source::check`].
    fn check(_params: &Self::Params, _ctx: &BuildCtx) -> anyhow::Result<()> {
        Ok(())
    }
    /// See [`Source::memory`].
    fn memory(_params: &Self::Params, _ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        Ok(Vec::new())
    }
    /// See [`Source::nothing_left`].
    fn nothing_left(_params: &Self::Params, _ctx: &BuildCtx) -> Option<String> {
        None
    }
    /// Handles one item, emitting any number of outputs. Its duration, less time blocked on a
    /// full output channel, is the stage's service time.
    fn process(&mut self, item: Self::In, out: &mut Emitter<'_, Self::Out>, ctx: &mut Ctx) -> anyhow::Result<()>;
    /// Called repeatedly after the input has ended, like a source's `next`, until it returns
    /// `None` or the graph stops: for stages that take their setup from upstream (a sampler
    /// receives shards, then produces batches). Each call is timed as one item. Default: none.
    fn produce(&mut self, _ctx: &mut Ctx) -> anyhow::Result<Option<Self::Out>> {
        Ok(None)
    }
    /// Called once after the loop (and `produce`); may emit final items.
    fn flush(&mut self, _out: &mut Emitter<'_, Self::Out>, _ctx: &mut Ctx) -> anyhow::Result<()> {
        Ok(())
    }
}

/// A sink: consumes items.
pub trait Sink: Sized + Send + 'static {
    /// Stage kind.
    const KIND: &'static str;
    /// Implementation name.
    const IMPL: &'static str;
    /// One line for `pipeline stages`.
    const DOC: &'static str;
    /// Its parameters.
    type Params: Params;
    /// What it takes.
    type In: Message;
    /// Which of its producer's items it needs ([`Demand`]). Default: every item.
    fn demand(_params: &Self::Params) -> Demand {
        Demand::ALL
    }
    /// Builds the stage.
    fn build(params: Self::Params, ctx: &BuildCtx) -> anyhow::Result<Self>;
    /// See [`Source::check`].
    fn check(_params: &Self::Params, _ctx: &BuildCtx) -> anyhow::Result<()> {
        Ok(())
    }
    /// See [`Source::memory`].
    fn memory(_params: &Self::Params, _ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        Ok(Vec::new())
    }
    /// See [`Source::nothing_left`].
    fn nothing_left(_params: &Self::Params, _ctx: &BuildCtx) -> Option<String> {
        None
    }
    /// Handles one item; its duration is the stage's service time.
    fn consume(&mut self, item: Self::In, ctx: &mut Ctx) -> anyhow::Result<()>;
    /// Called once after the loop.
    fn flush(&mut self, _ctx: &mut Ctx) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Hands a transform's outputs to the runtime.
///
/// An emitted item is sent when the stage emits its next item or its call returns, so that one
/// clock reading serves as both the end of the work and the item's send time.
pub struct Emitter<'a, T: Message> {
    pub(super) port: &'a mut OutPort<T>,
    pub(super) meter: &'a mut Meter,
    pub(super) stats: &'a mut [EdgeOutStats],
    pub(super) control: &'a Control,
    pub(super) pending: Option<T>,
    pub(super) emitted: u64,
}

impl<T: Message> Emitter<'_, T> {
    /// Emits one item. Fails with [`Stopped`] when the graph is aborting.
    pub fn emit(&mut self, item: T) -> Result<(), Stopped> {
        self.emitted += 1;
        if let Some(prev) = self.pending.replace(item) {
            self.port.send(prev, self.meter, self.stats, self.control)?;
        }
        Ok(())
    }

    /// Sends the item held back, stamped with the call's end.
    pub(super) fn finish(&mut self, stamp: u64) -> Result<(), Stopped> {
        match self.pending.take() {
            Some(item) => self.port.send_stamped(item, stamp, self.meter, self.stats, self.control),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Demand;

    /// Joining demands keeps every item either needs; the last alone needs nothing else.
    #[test]
    fn demands_join_to_what_either_needs() {
        assert_eq!(Demand::every(6).join(Demand::every(4)), Demand::every(2));
        assert_eq!(Demand::every(6).join(Demand::LAST), Demand::every(6));
        assert_eq!(Demand::LAST.join(Demand::LAST), Demand::LAST);
        assert_eq!(Demand::ALL.join(Demand::every(1000)), Demand::ALL);
        assert_eq!(Demand::every(0), Demand::LAST);
        assert!(Demand::every(3).wants(0) && Demand::every(3).wants(9) && !Demand::every(3).wants(4));
        assert!((0..5).all(|k| Demand::ALL.wants(k)) && (0..5).all(|k| !Demand::LAST.wants(k)));
    }
}
