//! The stage contract: what a stage implementation writes, and how the runtime drives it.
//!
//! A stage implementation is one type implementing [`Source`], [`Transform`] or [`Sink`], plus
//! one line in `stages::REGISTRY` wrapping it in [`SourceImpl`], [`TransformImpl`] or
//! [`SinkImpl`]. The runtime owns the loop: it receives, times the call, sends, counts, and
//! handles stop and abort; the implementation only turns items into items.
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
use std::marker::PhantomData;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use crate::runtime::channel::Stopped;
use crate::runtime::channel::{EdgeOutStats, InPort, InStats, Meter, OutPort, TypedChannel};
use crate::runtime::clock::Clock;
use crate::runtime::config::RunConfig;
use crate::runtime::control::{Control, POLL, StopReason};
use crate::runtime::message::{Message, MsgType};
use crate::runtime::metrics::Hist;

/// Typed parameters of a stage implementation: the keys of its `[stages.NAME]` table besides
/// `kind`, `impl`, `inputs` and `queue`. Use `#[serde(deny_unknown_fields, default)]` and a doc
/// comment per field: `pipeline stages` prints them.
pub trait Params: Serialize + DeserializeOwned + JsonSchema + 'static {}
impl<T: Serialize + DeserializeOwned + JsonSchema + 'static> Params for T {}

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
}

impl Ctx {
    pub(crate) fn new(name: &str, control: Arc<Control>, sections: Arc<Mutex<BTreeMap<String, serde_json::Value>>>) -> Self {
        Self { name: name.to_string(), control, extra: BTreeMap::new(), sections }
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
    port: &'a mut OutPort<T>,
    meter: &'a mut Meter,
    stats: &'a mut [EdgeOutStats],
    control: &'a Control,
    pending: Option<T>,
    emitted: u64,
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

    fn finish(&mut self, stamp: u64) -> Result<(), Stopped> {
        match self.pending.take() {
            Some(item) => self.port.send_stamped(item, stamp, self.meter, self.stats, self.control),
            None => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Registry entries
// ---------------------------------------------------------------------------------------------

/// One registered stage implementation, type-erased. Made by [`SourceImpl`], [`TransformImpl`]
/// or [`SinkImpl`]; never implemented by hand.
pub trait StageFactory: Sync {
    /// Stage kind.
    fn kind(&self) -> &'static str;
    /// Implementation name.
    fn name(&self) -> &'static str;
    /// One-line description.
    fn doc(&self) -> &'static str;
    /// Source, transform or sink.
    fn role(&self) -> Role;
    /// The message type it takes (none for a source).
    fn input(&self) -> Option<MsgType>;
    /// The message type it produces (none for a sink).
    fn output(&self) -> Option<MsgType>;
    /// True when the graph may leave its output unread ([`Transform::OUTPUT_OPTIONAL`]).
    fn output_optional(&self) -> bool {
        false
    }
    /// JSON schema of its parameters (doc comments, types, defaults).
    fn schema(&self) -> schemars::Schema;
    /// Parses raw parameters and returns them with every default filled in.
    #[allow(clippy::result_large_err)] // figment's error carries the key path and source we report
    fn resolve(&self, raw: &figment::value::Value) -> Result<toml::Table, figment::Error>;
    /// Runs the implementation's `check` on resolved parameters.
    fn check(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<()>;
    /// Runs the implementation's `memory` estimate on resolved parameters.
    fn memory(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>>;
    /// Runs the implementation's `nothing_left` on resolved parameters.
    fn nothing_left(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Option<String>>;
    /// Builds a runnable stage from resolved parameters.
    fn instantiate(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Box<dyn Runnable>>;
    /// Makes the bounded input channel of this stage (none for a source).
    #[doc(hidden)]
    fn input_channel(&self, capacity: usize) -> Option<Box<dyn ErasedChannelHandle>>;
}

/// Type-erased channel handle made by [`StageFactory::input_channel`] (runtime use only).
#[doc(hidden)]
pub trait ErasedChannelHandle {
    #[doc(hidden)]
    fn sender(&self) -> Box<dyn Any + Send>;
    #[doc(hidden)]
    fn take_receiver(&mut self) -> Option<Box<dyn Any + Send>>;
    #[doc(hidden)]
    fn probe(&self) -> Box<dyn Fn() -> Option<usize> + Send>;
}

impl<T: Send + 'static> ErasedChannelHandle for TypedChannel<T> {
    fn sender(&self) -> Box<dyn Any + Send> {
        TypedChannel::sender(self)
    }
    fn take_receiver(&mut self) -> Option<Box<dyn Any + Send>> {
        TypedChannel::take_receiver(self)
    }
    fn probe(&self) -> Box<dyn Fn() -> Option<usize> + Send> {
        TypedChannel::probe(self)
    }
}

#[allow(clippy::result_large_err)]
fn resolve_params<P: Params>(raw: &figment::value::Value) -> Result<toml::Table, figment::Error> {
    let typed: P = raw.deserialize()?;
    let value = toml::Value::try_from(&typed).map_err(|e| figment::Error::from(format!("cannot re-serialise parameters: {e}")))?;
    match value {
        toml::Value::Table(t) => Ok(t),
        other => Err(figment::Error::from(format!("parameters must be a table, found {}", other.type_str()))),
    }
}

fn typed_params<P: Params>(params: &toml::Table) -> anyhow::Result<P> {
    Ok(toml::Value::Table(params.clone()).try_into()?)
}

fn schema_of<P: Params>() -> schemars::Schema {
    schemars::SchemaGenerator::default().into_root_schema_for::<P>()
}

macro_rules! factory_common {
    ($t:ident) => {
        fn kind(&self) -> &'static str {
            $t::KIND
        }
        fn name(&self) -> &'static str {
            $t::IMPL
        }
        fn doc(&self) -> &'static str {
            $t::DOC
        }
        fn schema(&self) -> schemars::Schema {
            schema_of::<$t::Params>()
        }
        fn resolve(&self, raw: &figment::value::Value) -> Result<toml::Table, figment::Error> {
            resolve_params::<$t::Params>(raw)
        }
        fn check(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<()> {
            $t::check(&typed_params::<$t::Params>(params)?, ctx)
        }
        fn memory(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
            $t::memory(&typed_params::<$t::Params>(params)?, ctx)
        }
        fn nothing_left(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Option<String>> {
            Ok($t::nothing_left(&typed_params::<$t::Params>(params)?, ctx))
        }
    };
}

/// Registry entry for a [`Source`].
pub struct SourceImpl<S>(PhantomData<fn() -> S>);
impl<S> Default for SourceImpl<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> SourceImpl<S> {
    /// The entry (usable in a `static`).
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<S: Source> StageFactory for SourceImpl<S> {
    factory_common!(S);
    fn role(&self) -> Role {
        Role::Source
    }
    fn input(&self) -> Option<MsgType> {
        None
    }
    fn output(&self) -> Option<MsgType> {
        Some(MsgType::of::<S::Out>())
    }
    fn instantiate(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Box<dyn Runnable>> {
        Ok(Box::new(SourceRun(S::build(typed_params(params)?, ctx)?)))
    }
    fn input_channel(&self, _capacity: usize) -> Option<Box<dyn ErasedChannelHandle>> {
        None
    }
}

/// Registry entry for a [`Transform`].
pub struct TransformImpl<T>(PhantomData<fn() -> T>);
impl<T> Default for TransformImpl<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> TransformImpl<T> {
    /// The entry (usable in a `static`).
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T: Transform> StageFactory for TransformImpl<T> {
    factory_common!(T);
    fn role(&self) -> Role {
        Role::Transform
    }
    fn input(&self) -> Option<MsgType> {
        Some(MsgType::of::<T::In>())
    }
    fn output(&self) -> Option<MsgType> {
        Some(MsgType::of::<T::Out>())
    }
    fn output_optional(&self) -> bool {
        T::OUTPUT_OPTIONAL
    }
    fn instantiate(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Box<dyn Runnable>> {
        Ok(Box::new(TransformRun(T::build(typed_params(params)?, ctx)?)))
    }
    fn input_channel(&self, capacity: usize) -> Option<Box<dyn ErasedChannelHandle>> {
        Some(Box::new(TypedChannel::<T::In>::bounded(capacity)))
    }
}

/// Registry entry for a [`Sink`].
pub struct SinkImpl<K>(PhantomData<fn() -> K>);
impl<K> Default for SinkImpl<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> SinkImpl<K> {
    /// The entry (usable in a `static`).
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<K: Sink> StageFactory for SinkImpl<K> {
    factory_common!(K);
    fn role(&self) -> Role {
        Role::Sink
    }
    fn input(&self) -> Option<MsgType> {
        Some(MsgType::of::<K::In>())
    }
    fn output(&self) -> Option<MsgType> {
        None
    }
    fn instantiate(&self, params: &toml::Table, ctx: &BuildCtx) -> anyhow::Result<Box<dyn Runnable>> {
        Ok(Box::new(SinkRun(K::build(typed_params(params)?, ctx)?)))
    }
    fn input_channel(&self, capacity: usize) -> Option<Box<dyn ErasedChannelHandle>> {
        Some(Box::new(TypedChannel::<K::In>::bounded(capacity)))
    }
}

// ---------------------------------------------------------------------------------------------
// The loops
// ---------------------------------------------------------------------------------------------

/// Channels handed to a stage thread, type-erased until the stage's typed loop claims them.
#[doc(hidden)]
pub struct Wiring {
    pub(crate) input: Option<Box<dyn Any + Send>>,
    pub(crate) outputs: Vec<(Box<dyn Any + Send>, u32)>,
}

/// Everything the runtime measures about one stage thread. Lives outside the stage so that it
/// survives a panic.
#[doc(hidden)]
pub struct StageEnv {
    pub(crate) meter: Meter,
    pub(crate) control: Arc<Control>,
    pub(crate) warmup: u64,
    pub(crate) items_in: u64,
    pub(crate) items_out: u64,
    pub(crate) service: Hist,
    pub(crate) start: u64,
    pub(crate) steady_start: Option<u64>,
    pub(crate) input: InStats,
    pub(crate) outputs: Vec<EdgeOutStats>,
}

impl StageEnv {
    pub(crate) fn new(clock: Clock, control: Arc<Control>, instrument: bool, warmup: u64, in_edges: usize, out_edges: usize) -> Self {
        let start = clock.now();
        let tick = clock.ns_per_tick();
        let mut env = Self {
            meter: Meter { clock, instrument, recording: false, last: start, blocked: 0 },
            control,
            warmup,
            items_in: 0,
            items_out: 0,
            service: Hist::in_units(tick),
            start,
            steady_start: None,
            input: InStats::new(in_edges, tick),
            outputs: (0..out_edges).map(|_| EdgeOutStats::new(tick)).collect(),
        };
        env.check_warmup(0);
        env
    }

    /// Starts recording once `done` items (in for consumers, out for sources) have passed.
    #[inline]
    fn check_warmup(&mut self, done: u64) {
        if !self.meter.recording && done >= self.warmup && self.meter.instrument {
            self.meter.recording = true;
            self.steady_start = Some(self.meter.last);
        }
    }

    #[inline]
    fn record_service(&mut self, start: u64, end: u64) {
        if self.meter.recording {
            self.service.record(end.saturating_sub(start).saturating_sub(self.meter.blocked));
        }
    }
}

/// A built stage, ready to run on its thread.
#[doc(hidden)]
pub trait Runnable: Send {
    /// Runs the stage's loop and flush.
    fn run(self: Box<Self>, wiring: Wiring, env: &mut StageEnv, ctx: &mut Ctx) -> anyhow::Result<()>;
}

fn wiring_error(stage: &str) -> anyhow::Error {
    anyhow::anyhow!("internal error: stage `{stage}` was wired to a channel of the wrong message type")
}

/// Maps an error to `Ok` if it only says the graph is stopping.
fn quiet_stop(r: anyhow::Result<()>) -> anyhow::Result<()> {
    match r {
        Err(e) if e.is::<Stopped>() => Ok(()),
        other => other,
    }
}

struct SourceRun<S>(S);

impl<S: Source> Runnable for SourceRun<S> {
    fn run(mut self: Box<Self>, wiring: Wiring, env: &mut StageEnv, ctx: &mut Ctx) -> anyhow::Result<()> {
        let mut out = OutPort::<S::Out>::from_erased(wiring.outputs).ok_or_else(|| wiring_error(ctx.name()))?;
        produce_items(env, &mut out, ctx, |ctx| self.0.next(ctx))?;
        quiet_stop(self.0.flush(ctx))
    }
}

/// The producing loop of a source, and of a transform once its input has ended: call `next`,
/// time it as one item, send what it returns, until it returns `None`, the graph stops, or the
/// consumers are gone. [`Stopped`] from `next` ends the loop quietly.
fn produce_items<T: Message>(
    env: &mut StageEnv,
    out: &mut OutPort<T>,
    ctx: &mut Ctx,
    mut next: impl FnMut(&mut Ctx) -> anyhow::Result<Option<T>>,
) -> anyhow::Result<()> {
    let control = env.control.clone();
    let mut produced = 0u64;
    while !control.stopping() {
        let start = env.meter.last;
        env.meter.blocked = 0;
        let Some(item) = next(ctx).or_else(|e| if e.is::<Stopped>() { Ok(None) } else { Err(e) })? else { break };
        let end = env.meter.now();
        env.record_service(start, end);
        if out.send_stamped(item, end, &mut env.meter, &mut env.outputs, &control).is_err() {
            break;
        }
        env.items_out += 1;
        produced += 1;
        env.check_warmup(produced);
    }
    Ok(())
}

struct TransformRun<T>(T);

impl<T: Transform> Runnable for TransformRun<T> {
    fn run(mut self: Box<Self>, wiring: Wiring, env: &mut StageEnv, ctx: &mut Ctx) -> anyhow::Result<()> {
        let name = ctx.name().to_string();
        let mut inp = InPort::<T::In>::from_erased(wiring.input.ok_or_else(|| wiring_error(&name))?).ok_or_else(|| wiring_error(&name))?;
        let mut out = OutPort::<T::Out>::from_erased(wiring.outputs).ok_or_else(|| wiring_error(&name))?;
        let control = env.control.clone();
        while let Some(item) = inp.recv(&mut env.meter, &mut env.input, &control) {
            env.items_in += 1;
            let start = env.meter.last;
            env.meter.blocked = 0;
            let mut em =
                Emitter { port: &mut out, meter: &mut env.meter, stats: &mut env.outputs, control: &control, pending: None, emitted: 0 };
            let r = self.0.process(item, &mut em, ctx);
            let end = em.meter.now();
            // Time blocked during the call is subtracted; the final send happens after `end`.
            let blocked_in_call = em.meter.blocked;
            let sent = r.is_ok() && em.finish(end).is_ok();
            env.items_out += em.emitted;
            env.meter.blocked = blocked_in_call;
            env.record_service(start, end);
            if let Err(e) = r {
                if e.is::<Stopped>() {
                    break;
                }
                return Err(e);
            }
            if !sent || control.aborting() {
                break;
            }
            env.check_warmup(env.items_in);
        }
        // Input ended: keep producing, as a source would, while the graph runs.
        produce_items(env, &mut out, ctx, |ctx| self.0.produce(ctx))?;
        let mut em =
            Emitter { port: &mut out, meter: &mut env.meter, stats: &mut env.outputs, control: &control, pending: None, emitted: 0 };
        let r = self.0.flush(&mut em, ctx);
        let end = em.meter.now();
        let _ = em.finish(end);
        env.items_out += em.emitted;
        quiet_stop(r)
    }
}

struct SinkRun<K>(K);

impl<K: Sink> Runnable for SinkRun<K> {
    fn run(mut self: Box<Self>, wiring: Wiring, env: &mut StageEnv, ctx: &mut Ctx) -> anyhow::Result<()> {
        let name = ctx.name().to_string();
        let mut inp = InPort::<K::In>::from_erased(wiring.input.ok_or_else(|| wiring_error(&name))?).ok_or_else(|| wiring_error(&name))?;
        let control = env.control.clone();
        while let Some(item) = inp.recv(&mut env.meter, &mut env.input, &control) {
            env.items_in += 1;
            let start = env.meter.last;
            env.meter.blocked = 0;
            let r = self.0.consume(item, ctx);
            let end = env.meter.now();
            env.record_service(start, end);
            if let Err(e) = r {
                if e.is::<Stopped>() {
                    break;
                }
                return Err(e);
            }
            if control.aborting() {
                break;
            }
            env.check_warmup(env.items_in);
        }
        quiet_stop(self.0.flush(ctx))
    }
}
