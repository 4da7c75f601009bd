//! Instrumented ports on bounded flume channels.
//!
//! Every stage with inputs owns one bounded channel (capacity = its `queue`); each upstream
//! stage holds a sender to it (one *edge*). Items travel in an [`Envelope`] that carries the
//! producer's clock reading and the edge index, so the consumer can record per-edge residence
//! time.
//!
//! Hot-path budget: one clock read per item per stage. A send first tries `try_send`; only
//! when the channel is full does it read the clock, block (polling the abort flag every
//! [`POLL`]) and record the blocked time. Receives work the same way with `try_recv`. On the
//! fast path the receive time is taken to be the consumer's previous clock reading, so
//! residence shorter than one send (tens of ns) reads as zero.

use std::any::Any;

use flume::{Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};

use crate::runtime::clock::Clock;
use crate::runtime::control::{Control, POLL};
use crate::runtime::metrics::Hist;

/// What travels on a channel: the item, the producer's clock reading, the edge it came by, and
/// the item's id ([`crate::runtime::trace::item_id`]), which the trace's flow arrows follow.
pub(crate) struct Envelope<T> {
    item: T,
    sent: u64,
    edge: u32,
    id: u64,
}

/// Returned by a send or an emit when the graph is aborting or the consumer is gone; the
/// runtime treats it as a normal stop, not a stage failure. Stage code propagates it with `?`.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the graph is stopping; the item was not delivered")]
pub struct Stopped;

/// Per-thread timing state shared by a stage's input and output ports.
pub(crate) struct Meter {
    pub clock: Clock,
    /// Whether timings are taken at all (`[run] instrument`).
    pub instrument: bool,
    /// Whether histograms record yet (false during warm-up).
    pub recording: bool,
    /// The thread's most recent clock reading.
    pub last: u64,
    /// Ticks blocked in sends since the last reset (subtracted from service time).
    pub blocked: u64,
}

impl Meter {
    #[inline]
    pub fn now(&mut self) -> u64 {
        if self.instrument {
            self.last = self.clock.now();
        }
        self.last
    }
}

/// Producer-side statistics of one edge.
pub(crate) struct EdgeOutStats {
    pub items: u64,
    pub send_blocked: Hist,
}

impl EdgeOutStats {
    /// Stats for one edge, histogram in clock ticks.
    pub fn new(ns_per_tick: f64) -> Self {
        Self { items: 0, send_blocked: Hist::in_units(ns_per_tick) }
    }
}

/// Consumer-side statistics of a stage's input channel.
pub(crate) struct InStats {
    pub items: Vec<u64>,
    pub residence: Vec<Hist>,
    pub recv_blocked: Hist,
    /// Ticks spent waiting for the end of input after the last item (not an item's wait).
    pub tail_wait: u64,
    /// The id of the item received last.
    pub last_id: u64,
}

impl InStats {
    /// Stats for a channel fed by `edges` producers, histograms in clock ticks.
    pub fn new(edges: usize, ns_per_tick: f64) -> Self {
        Self {
            items: vec![0; edges],
            residence: (0..edges).map(|_| Hist::in_units(ns_per_tick)).collect(),
            recv_blocked: Hist::in_units(ns_per_tick),
            tail_wait: 0,
            last_id: 0,
        }
    }
}

/// The sending half of a stage: one sender per downstream edge (fan-out clones the item).
pub(crate) struct OutPort<T> {
    edges: Vec<(Sender<Envelope<T>>, u32)>,
    /// The producing stage's index, for item ids.
    origin: usize,
    /// Items sent so far (each fan-out counts once).
    seq: u64,
}

impl<T: Clone + Send + 'static> OutPort<T> {
    /// Takes the type-erased senders the graph builder made for stage `origin`; `None` if one
    /// is of another type.
    pub fn from_erased(erased: Vec<(Box<dyn Any + Send>, u32)>, origin: usize) -> Option<Self> {
        let mut edges = Vec::with_capacity(erased.len());
        for (tx, edge) in erased {
            edges.push((*tx.downcast::<Sender<Envelope<T>>>().ok()?, edge));
        }
        Some(Self { edges, origin, seq: 0 })
    }

    /// Items sent so far: the sequence number the next item's id gets.
    #[inline]
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The id the next item sent gets.
    #[inline]
    pub fn next_id(&self) -> u64 {
        crate::runtime::trace::item_id(self.origin, self.seq)
    }

    /// Sends `item` to every edge, stamped with a fresh clock reading.
    #[inline]
    pub fn send(&mut self, item: T, meter: &mut Meter, stats: &mut [EdgeOutStats], ctl: &Control) -> Result<(), Stopped> {
        let stamp = meter.now();
        self.send_stamped(item, stamp, meter, stats, ctl)
    }

    /// Sends `item` to every edge with a clock reading the caller already took.
    pub fn send_stamped(
        &mut self,
        item: T,
        stamp: u64,
        meter: &mut Meter,
        stats: &mut [EdgeOutStats],
        ctl: &Control,
    ) -> Result<(), Stopped> {
        let id = self.next_id();
        self.seq += 1;
        let Some(((last_tx, last_edge), rest)) = self.edges.split_last() else { return Ok(()) };
        let (last_stats, rest_stats) = stats.split_last_mut().ok_or(Stopped)?;
        for ((tx, edge), st) in rest.iter().zip(rest_stats.iter_mut()) {
            send_one(tx, Envelope { item: item.clone(), sent: stamp, edge: *edge, id }, meter, st, ctl)?;
        }
        send_one(last_tx, Envelope { item, sent: stamp, edge: *last_edge, id }, meter, last_stats, ctl)
    }
}

#[inline]
fn send_one<T>(tx: &Sender<Envelope<T>>, env: Envelope<T>, meter: &mut Meter, st: &mut EdgeOutStats, ctl: &Control) -> Result<(), Stopped> {
    match tx.try_send(env) {
        Ok(()) => {
            if meter.recording {
                st.send_blocked.record_zero();
            }
        }
        Err(TrySendError::Full(mut env)) => {
            let t0 = meter.last;
            loop {
                if ctl.aborting() {
                    return Err(Stopped);
                }
                match tx.send_timeout(env, POLL) {
                    Ok(()) => break,
                    Err(flume::SendTimeoutError::Timeout(e)) => env = e,
                    Err(flume::SendTimeoutError::Disconnected(_)) => return Err(Stopped),
                }
            }
            let t1 = meter.now();
            let ticks = t1.saturating_sub(t0);
            meter.blocked += ticks;
            if meter.recording {
                st.send_blocked.record(ticks);
            }
        }
        Err(TrySendError::Disconnected(_)) => return Err(Stopped),
    }
    st.items += 1;
    Ok(())
}

/// The receiving half of a stage: its one input channel, fed by all its upstream edges.
pub(crate) struct InPort<T> {
    rx: Receiver<Envelope<T>>,
}

impl<T: Send + 'static> InPort<T> {
    /// Takes the type-erased receiver the graph builder made; `None` if it is of another type.
    pub fn from_erased(rx: Box<dyn Any + Send>) -> Option<Self> {
        Some(Self { rx: *rx.downcast::<Receiver<Envelope<T>>>().ok()? })
    }

    /// The next item; `None` when every producer has finished or the graph is aborting.
    #[inline]
    pub fn recv(&mut self, meter: &mut Meter, stats: &mut InStats, ctl: &Control) -> Option<T> {
        match self.rx.try_recv() {
            Ok(env) => {
                let edge = env.edge as usize;
                stats.items[edge] += 1;
                stats.last_id = env.id;
                if meter.recording {
                    stats.recv_blocked.record_zero();
                    stats.residence[edge].record(meter.last.saturating_sub(env.sent));
                }
                Some(env.item)
            }
            Err(TryRecvError::Empty) => self.recv_blocking(meter, stats, ctl),
            Err(TryRecvError::Disconnected) => None,
        }
    }

    #[cold]
    fn recv_blocking(&mut self, meter: &mut Meter, stats: &mut InStats, ctl: &Control) -> Option<T> {
        let t0 = meter.last;
        loop {
            if ctl.aborting() {
                return None;
            }
            match self.rx.recv_timeout(POLL) {
                Ok(env) => {
                    let t1 = meter.now();
                    let edge = env.edge as usize;
                    stats.items[edge] += 1;
                    stats.last_id = env.id;
                    if meter.recording {
                        stats.recv_blocked.record(t1.saturating_sub(t0));
                        stats.residence[edge].record(t1.saturating_sub(env.sent));
                    }
                    return Some(env.item);
                }
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    let t1 = meter.now();
                    stats.tail_wait += t1.saturating_sub(t0);
                    return None;
                }
            }
        }
    }
}

/// Reports a channel's length without keeping it open (`None` once every sender is gone).
pub(crate) type Probe = Box<dyn Fn() -> Option<usize> + Send>;

/// A freshly made channel before wiring: the builder hands out senders and the receiver as
/// `Box<dyn Any>`, and keeps a weak probe for occupancy sampling.
pub(crate) struct TypedChannel<T> {
    tx: Sender<Envelope<T>>,
    rx: Option<Receiver<Envelope<T>>>,
}

impl<T: Send + 'static> TypedChannel<T> {
    pub fn bounded(capacity: usize) -> Self {
        let (tx, rx) = flume::bounded(capacity);
        Self { tx, rx: Some(rx) }
    }
}

impl<T: Send + 'static> TypedChannel<T> {
    /// A new sender for one upstream edge.
    pub fn sender(&self) -> Box<dyn Any + Send> {
        Box::new(self.tx.clone())
    }
    /// The receiver (once).
    pub fn take_receiver(&mut self) -> Option<Box<dyn Any + Send>> {
        self.rx.take().map(|rx| Box::new(rx) as Box<dyn Any + Send>)
    }
    /// Reports the queue length without keeping the channel open.
    pub fn probe(&self) -> Probe {
        let weak = self.tx.downgrade();
        Box::new(move || weak.upgrade().map(|tx| tx.len()))
    }
}
