//! The per-item trace of a run (`[run] trace = true`): what each stage thread did with each of
//! its last items, written as `trace.json` in the Chrome trace event format, which Perfetto UI
//! (<https://ui.perfetto.dev>, "Open trace file") and `chrome://tracing` open.
//!
//! What it holds:
//! - one track (thread) per stage, with a slice per item (the stage's own work on it, the
//!   `item` slices), the time it waited for that item before (`wait for input`), and the time
//!   it was blocked handing its output on (`blocked sending`);
//! - nested slices a stage reports itself inside an item ([`crate::runtime::stage::Ctx::trace_phases`]:
//!   a step executor's forward, backward and optimizer);
//! - flow arrows along every channel: each item sent carries an id ([`item_id`]) from the
//!   slice that made it to the slice that took it, so a batch can be followed from the sampler
//!   to the executor and on to the stages after it;
//! - a counter per channel: its sampled length, where it changed.
//!
//! Bounded: each stage keeps a ring of its last `[run] trace_items` items (and four times as
//! many nested slices), each channel as many length changes, so a long run's trace has the
//! size of a short one's end. Recording costs a few stores per item into memory allocated
//! before the run; nothing is written until the run has ended.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use crate::runtime::clock::Clock;

/// The id an item carries along a channel: the producing stage's index (plus one, so no id is
/// zero) in the high bits, the producer's count of items sent in the low 40.
#[inline]
pub fn item_id(stage: usize, seq: u64) -> u64 {
    ((stage as u64 + 1) << 40) | (seq & ((1 << 40) - 1))
}

/// A fixed-capacity ring: pushing onto a full one overwrites the oldest entry.
#[derive(Clone, Debug)]
pub struct Ring<T> {
    buf: Vec<T>,
    next: usize,
    cap: usize,
    /// Entries ever pushed.
    pub total: u64,
}

impl<T: Clone> Ring<T> {
    /// An empty ring of `cap` entries (at least one), allocated now.
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        Self { buf: Vec::with_capacity(cap), next: 0, cap, total: 0 }
    }

    /// Adds `x`, dropping the oldest entry when full.
    #[inline]
    pub fn push(&mut self, x: T) {
        if self.buf.len() < self.cap {
            self.buf.push(x);
        } else {
            self.buf[self.next] = x;
        }
        self.next = (self.next + 1) % self.cap;
        self.total += 1;
    }

    /// The entries kept, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        let (a, b) =
            if self.buf.len() < self.cap { (&self.buf[..], &self.buf[..0]) } else { (&self.buf[self.next..], &self.buf[..self.next]) };
        a.iter().chain(b.iter())
    }
}

/// What a stage did with one item, in clock ticks.
#[derive(Clone, Copy, Debug, Default)]
pub struct ItemRecord {
    /// When it began waiting for the item (its previous item's end); equal to `start` when
    /// the item was already there.
    pub wait_from: u64,
    /// When its work on the item began (the item received; for a source, the call made).
    pub start: u64,
    /// When its work ended (sends blocked inside it are part of it).
    pub end: u64,
    /// When its last output had been handed on (`end` unless that send blocked).
    pub sent: u64,
    /// The id of the item taken in ([`item_id`]; 0 for a source's items).
    pub in_id: u64,
    /// The id of the first item it sent, and how many it sent (consecutive ids).
    pub out_first: u64,
    /// Items sent.
    pub out_n: u32,
}

/// A slice a stage reported inside its work ([`crate::runtime::stage::Ctx::trace_phases`]).
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// Its name.
    pub name: &'static str,
    /// Start and end, clock ticks.
    pub start: u64,
    /// End, clock ticks.
    pub end: u64,
}

/// One stage thread's recording.
#[derive(Clone, Debug)]
pub struct StageTrace {
    /// Its last items.
    pub items: Ring<ItemRecord>,
    /// Its last nested slices.
    pub spans: Ring<Span>,
    clock: Clock,
}

impl StageTrace {
    /// Room for `items` items (and four times as many nested slices), allocated now.
    pub fn new(items: usize, clock: Clock) -> Self {
        Self { items: Ring::new(items), spans: Ring::new(items.saturating_mul(4)), clock }
    }

    /// Records consecutive phases that have just ended, in order: the last ends now.
    pub fn phases_ending_now(&mut self, phases: &[(&'static str, Duration)]) {
        let now = self.clock.now();
        let ticks = |d: Duration| (d.as_nanos() as f64 / self.clock.ns_per_tick()) as u64;
        let mut start = now.saturating_sub(phases.iter().map(|(_, d)| ticks(*d)).sum());
        for &(name, d) in phases {
            let end = (start + ticks(d)).min(now);
            self.spans.push(Span { name, start, end });
            start = end;
        }
    }
}

/// A channel's length where it changed, as sampled.
#[derive(Clone, Debug)]
pub struct CounterTrace {
    /// `(clock tick, length)` per change.
    pub samples: Ring<(u64, u32)>,
    last: Option<u32>,
}

impl CounterTrace {
    /// Room for `cap` changes.
    pub fn new(cap: usize) -> Self {
        Self { samples: Ring::new(cap), last: None }
    }

    /// Adds a sample, kept only if the length changed.
    pub fn sample(&mut self, tick: u64, len: usize) {
        let len = len.min(u32::MAX as usize) as u32;
        if self.last != Some(len) {
            self.samples.push((tick, len));
            self.last = Some(len);
        }
    }
}

/// Everything a traced run recorded, for [`write`].
pub struct TraceData {
    /// Stage names, in plan order (thread ids are their positions).
    pub stages: Vec<String>,
    /// Per stage, its recording (`None` if its thread hung).
    pub traces: Vec<Option<StageTrace>>,
    /// Per channel: its name (`FROM->TO` for a channel with one producer, else `TO's input`)
    /// and its length changes.
    pub counters: Vec<(String, CounterTrace)>,
    /// The clock and its reading at the run's start (time zero of the trace).
    pub clock: Clock,
    /// Time zero.
    pub start: u64,
}

/// Writes `data` as a Chrome trace event file at `path` (atomically). Timestamps are
/// microseconds from the run's start.
pub fn write(data: &TraceData, path: &Path) -> anyhow::Result<()> {
    crate::runtime::rundir::write_atomic(path, render(data).as_bytes())
}

/// The trace as Chrome trace event JSON.
pub fn render(data: &TraceData) -> String {
    let us = |t: u64| data.clock.nanos(data.start, t) as f64 / 1e3;
    let mut o = String::with_capacity(1 << 20);
    o.push_str("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    let _ = write!(o, "{{\"ph\":\"M\",\"pid\":1,\"name\":\"process_name\",\"args\":{{\"name\":\"pipeline\"}}}}");
    for (tid, name) in data.stages.iter().enumerate() {
        let _ = write!(o, ",\n{{\"ph\":\"M\",\"pid\":1,\"tid\":{tid},\"name\":\"thread_name\",\"args\":{{\"name\":{}}}}}", json_str(name));
        let _ = write!(o, ",\n{{\"ph\":\"M\",\"pid\":1,\"tid\":{tid},\"name\":\"thread_sort_index\",\"args\":{{\"sort_index\":{tid}}}}}");
    }
    // When each sent id was taken in: a flow is drawn only when both ends are still kept.
    let taken: HashMap<u64, u64> =
        data.traces.iter().flatten().flat_map(|t| t.items.iter()).filter(|r| r.in_id != 0).map(|r| (r.in_id, r.start)).collect();
    let sent: HashSet<u64> =
        data.traces.iter().flatten().flat_map(|t| t.items.iter()).flat_map(|r| (0..r.out_n as u64).map(move |k| r.out_first + k)).collect();
    for (tid, (name, trace)) in data.stages.iter().zip(&data.traces).enumerate() {
        let Some(t) = trace else { continue };
        for r in t.items.iter() {
            if r.start > r.wait_from {
                slice(&mut o, tid, "wait for input", "wait", us(r.wait_from), us(r.start), "");
            }
            let args = format!("{{\"in\":{},\"out\":{}}}", r.in_id, r.out_n);
            slice(&mut o, tid, name, "item", us(r.start), us(r.end), &args);
            if r.sent > r.end {
                slice(&mut o, tid, "blocked sending", "send", us(r.end), us(r.sent), "");
            }
            // The arrow into this item starts where it was made and ends at this slice's start.
            if r.in_id != 0 && sent.contains(&r.in_id) {
                flow(&mut o, tid, "f", r.in_id, us(r.start));
            }
            // Arrows out start inside this slice, one per item sent: at its middle, or where the
            // consumer took the item if that came first (an item sent early in the slice, or a
            // thread descheduled between its send and the slice's end).
            let mid = (us(r.start) + us(r.end)) / 2.0;
            for k in 0..r.out_n as u64 {
                let id = r.out_first + k;
                if let Some(&took) = taken.get(&id) {
                    flow(&mut o, tid, "s", id, mid.min(us(took)));
                }
            }
        }
        for s in t.spans.iter() {
            slice(&mut o, tid, s.name, "phase", us(s.start), us(s.end), "");
        }
    }
    for (name, c) in &data.counters {
        for &(tick, len) in c.samples.iter() {
            let _ =
                write!(o, ",\n{{\"ph\":\"C\",\"pid\":1,\"name\":{},\"ts\":{:.3},\"args\":{{\"length\":{len}}}}}", json_str(name), us(tick));
        }
    }
    o.push_str("\n]}\n");
    o
}

fn slice(o: &mut String, tid: usize, name: &str, cat: &str, ts: f64, end: f64, args: &str) {
    let _ = write!(
        o,
        ",\n{{\"ph\":\"X\",\"pid\":1,\"tid\":{tid},\"name\":{},\"cat\":\"{cat}\",\"ts\":{ts:.3},\"dur\":{:.3}",
        json_str(name),
        (end - ts).max(0.0)
    );
    if !args.is_empty() {
        let _ = write!(o, ",\"args\":{args}");
    }
    o.push('}');
}

fn flow(o: &mut String, tid: usize, ph: &str, id: u64, ts: f64) {
    let bp = if ph == "f" { ",\"bp\":\"e\"" } else { "" };
    let _ = write!(o, ",\n{{\"ph\":\"{ph}\",\"pid\":1,\"tid\":{tid},\"name\":\"item\",\"cat\":\"flow\",\"id\":{id},\"ts\":{ts:.3}{bp}}}");
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"?\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_entries_in_order() {
        let mut r = Ring::new(3);
        assert_eq!(r.iter().count(), 0);
        for k in 0..2 {
            r.push(k);
        }
        assert_eq!(r.iter().copied().collect::<Vec<_>>(), [0, 1]);
        for k in 2..8 {
            r.push(k);
        }
        assert_eq!(r.iter().copied().collect::<Vec<_>>(), [5, 6, 7]);
        assert_eq!(r.total, 8);
    }

    #[test]
    fn counters_keep_changes_only() {
        let mut c = CounterTrace::new(10);
        for (t, len) in [(1, 0), (2, 0), (3, 2), (4, 2), (5, 1)] {
            c.sample(t, len);
        }
        assert_eq!(c.samples.iter().copied().collect::<Vec<_>>(), [(1, 0), (3, 2), (5, 1)]);
    }

    /// Two stages, one item passed between them: slices, a flow from the producer's slice to
    /// the consumer's, a nested phase, a counter; the whole is valid JSON.
    #[test]
    fn renders_slices_flows_and_counters() {
        let clock = Clock::new();
        let t0 = clock.now();
        let tick = |us: f64| t0 + (us * 1e3 / clock.ns_per_tick()) as u64;
        let mut a = StageTrace::new(4, clock.clone());
        let id = item_id(0, 0);
        a.items.push(ItemRecord {
            wait_from: tick(0.0),
            start: tick(0.0),
            end: tick(10.0),
            sent: tick(12.0),
            in_id: 0,
            out_first: id,
            out_n: 1,
        });
        let mut b = StageTrace::new(4, clock.clone());
        b.items.push(ItemRecord {
            wait_from: tick(5.0),
            start: tick(12.0),
            end: tick(20.0),
            sent: tick(20.0),
            in_id: id,
            out_first: 0,
            out_n: 0,
        });
        b.spans.push(Span { name: "forward", start: tick(13.0), end: tick(15.0) });
        let mut c = CounterTrace::new(4);
        c.sample(tick(11.0), 1);
        let data = TraceData {
            stages: vec!["src".into(), "sink".into()],
            traces: vec![Some(a), Some(b)],
            counters: vec![("src->sink".into(), c)],
            clock,
            start: t0,
        };
        let v: serde_json::Value = serde_json::from_str(&render(&data)).expect("valid JSON");
        let ev = v["traceEvents"].as_array().unwrap();
        let count = |ph: &str, name: &str| ev.iter().filter(|e| e["ph"] == ph && (name.is_empty() || e["name"] == name)).count();
        assert_eq!(count("X", "src"), 1);
        assert_eq!(count("X", "sink"), 1);
        assert_eq!(count("X", "blocked sending"), 1);
        assert_eq!(count("X", "wait for input"), 1);
        assert_eq!(count("X", "forward"), 1);
        assert_eq!(count("C", "src->sink"), 1);
        let s: Vec<_> = ev.iter().filter(|e| e["ph"] == "s").collect();
        let f: Vec<_> = ev.iter().filter(|e| e["ph"] == "f").collect();
        assert_eq!((s.len(), f.len()), (1, 1));
        assert_eq!(s[0]["id"], f[0]["id"]);
        assert_eq!((s[0]["tid"].as_u64(), f[0]["tid"].as_u64()), (Some(0), Some(1)));
        let wait = ev.iter().find(|e| e["name"] == "wait for input").unwrap();
        assert!((wait["ts"].as_f64().unwrap() - 5.0).abs() < 0.01 && (wait["dur"].as_f64().unwrap() - 7.0).abs() < 0.01, "{wait}");
    }

    /// An item taken before the middle of the slice that sent it (sent early in a long slice,
    /// or the producer descheduled between its send and its slice's end): the arrow starts no
    /// later than it ends, where the consumer took the item.
    #[test]
    fn an_arrow_never_starts_after_its_end() {
        let clock = Clock::new();
        let t0 = clock.now();
        let tick = |us: f64| t0 + (us * 1e3 / clock.ns_per_tick()) as u64;
        let id = item_id(0, 0);
        let rec = |start: f64, end: f64, in_id: u64, out_n: u32| ItemRecord {
            wait_from: tick(start),
            start: tick(start),
            end: tick(end),
            sent: tick(end),
            in_id,
            out_first: if out_n > 0 { id } else { 0 },
            out_n,
        };
        let mut a = StageTrace::new(4, clock.clone());
        a.items.push(rec(0.0, 100.0, 0, 1));
        let mut b = StageTrace::new(4, clock.clone());
        b.items.push(rec(20.0, 30.0, id, 0));
        let data =
            TraceData { stages: vec!["src".into(), "sink".into()], traces: vec![Some(a), Some(b)], counters: Vec::new(), clock, start: t0 };
        let v: serde_json::Value = serde_json::from_str(&render(&data)).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        let ts = |ph: &str| ev.iter().find(|e| e["ph"] == ph).unwrap()["ts"].as_f64().unwrap();
        assert!(ts("s") <= ts("f"), "the arrow starts at {} after it ends at {}", ts("s"), ts("f"));
        assert!((ts("s") - 20.0).abs() < 0.01, "{}", ts("s"));
    }
}
