//! How the runtime drives a stage: the type-erased registry entries made from a [`Source`],
//! [`Transform`] or [`Sink`] ([`SourceImpl`], [`TransformImpl`], [`SinkImpl`], all
//! [`StageFactory`]), and the loop each stage thread runs around the implementation's calls:
//! receive, time the call, send, count, warm-up, stop and abort, flush.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::runtime::channel::{EdgeOutStats, InPort, InStats, Meter, OutPort, TypedChannel};
use crate::runtime::clock::Clock;
use crate::runtime::control::Control;
use crate::runtime::message::{Message, MsgType};
use crate::runtime::metrics::Hist;
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Emitter, Params, Role, Sink, Source, Stopped, Transform};
use crate::runtime::trace::ItemRecord;

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
    /// Which of its producer's items it needs, from resolved parameters (a source: none).
    fn demand(&self, _params: &toml::Table) -> anyhow::Result<Demand> {
        Ok(Demand::LAST)
    }
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
    crate::runtime::stage::unknown_keys::<P>(raw)?;
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
    fn demand(&self, params: &toml::Table) -> anyhow::Result<Demand> {
        Ok(T::demand(&typed_params::<T::Params>(params)?))
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
    fn demand(&self, params: &toml::Table) -> anyhow::Result<Demand> {
        Ok(K::demand(&typed_params::<K::Params>(params)?))
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
    /// The stage's position in the plan (the origin of the ids its items carry).
    pub(crate) index: usize,
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
    pub(crate) items_dropped: u64,
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
            items_dropped: 0,
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

    /// Records an item's service time, unless the stage discarded the item ([`Ctx::discard`]).
    #[inline]
    fn record_item(&mut self, start: u64, end: u64, ctx: &mut Ctx) {
        if ctx.take_discarded() {
            self.items_dropped += 1;
        } else {
            self.record_service(start, end);
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
        let mut out = OutPort::<S::Out>::from_erased(wiring.outputs, wiring.index).ok_or_else(|| wiring_error(ctx.name()))?;
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
        let id = out.next_id();
        let sent = out.send_stamped(item, end, &mut env.meter, &mut env.outputs, &control);
        ctx.trace_item(ItemRecord {
            wait_from: start,
            start,
            end,
            sent: env.meter.last,
            in_id: 0,
            out_first: id,
            out_n: sent.is_ok() as u32,
        });
        if sent.is_err() {
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
        let mut out = OutPort::<T::Out>::from_erased(wiring.outputs, wiring.index).ok_or_else(|| wiring_error(&name))?;
        let control = env.control.clone();
        let mut wait_from = env.meter.last;
        while let Some(item) = inp.recv(&mut env.meter, &mut env.input, &control) {
            env.items_in += 1;
            let start = env.meter.last;
            env.meter.blocked = 0;
            let (first_id, seq0) = (out.next_id(), out.seq());
            let mut em =
                Emitter { port: &mut out, meter: &mut env.meter, stats: &mut env.outputs, control: &control, pending: None, emitted: 0 };
            let r = self.0.process(item, &mut em, ctx);
            let end = em.meter.now();
            // Time blocked during the call is subtracted; the final send happens after `end`.
            let blocked_in_call = em.meter.blocked;
            let sent = r.is_ok() && em.finish(end).is_ok();
            env.items_out += em.emitted;
            env.meter.blocked = blocked_in_call;
            env.record_item(start, end, ctx);
            let (in_id, out_n) = (env.input.last_id, (out.seq() - seq0) as u32);
            ctx.trace_item(ItemRecord { wait_from, start, end, sent: env.meter.last, in_id, out_first: first_id, out_n });
            wait_from = env.meter.last;
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
        let mut wait_from = env.meter.last;
        while let Some(item) = inp.recv(&mut env.meter, &mut env.input, &control) {
            env.items_in += 1;
            let start = env.meter.last;
            env.meter.blocked = 0;
            let r = self.0.consume(item, ctx);
            let end = env.meter.now();
            env.record_item(start, end, ctx);
            ctx.trace_item(ItemRecord { wait_from, start, end, sent: end, in_id: env.input.last_id, out_first: 0, out_n: 0 });
            wait_from = end;
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
