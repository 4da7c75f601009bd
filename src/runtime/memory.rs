//! The memory a run will need, estimated from its config before anything is allocated, against
//! what the machine has: a model too big for memory is refused with the estimate and the keys
//! that set it, instead of aborting in the allocator halfway through building it.
//!
//! Each stage implementation says what it will hold at its peak ([`crate::runtime::stage::Transform::memory`]
//! and its twins): a list of [`Need`]s, each on the host or on the run's device, with the config
//! keys that size it, held for the whole run or only while the stage works (activations, an
//! evaluation's model: [`Need::transient`]). A place's peak is everything held for the run plus
//! the largest stage's transient needs together, as stages work one after another (training,
//! then the artifact, then evaluation). [`crate::runtime::graph::memory`] collects them; [`Estimate::check`] compares each
//! place's total with its budget: `[run] max_memory_gb` when set, else on the host what the
//! kernel says is available (`MemAvailable`, and a cgroup's `memory.max` when lower, as in a
//! container), on a GPU its free memory as the driver reports it.

use std::fmt::Write as _;

/// Where a need lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Place {
    /// Host memory (RAM).
    Host,
    /// The run's device (`run.device`; the host itself on "cpu").
    Device,
}

/// One part of a stage's peak memory.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Need {
    /// The stage (filled in by [`crate::runtime::graph::memory`]).
    pub stage: String,
    /// What it is ("weights", "optimizer state", "activations of one micro-batch", ...).
    pub what: String,
    /// Bytes.
    pub bytes: u64,
    /// The config keys that size it, the most telling first.
    pub keys: Vec<String>,
    /// Where it lives.
    pub place: Place,
    /// Held only while its stage works (activations, a scoring model, a write buffer), not for
    /// the whole run.
    pub transient: bool,
}

impl Need {
    /// A need of `bytes` for `what`, sized by `keys`, on the run's device.
    pub fn device(what: impl Into<String>, bytes: u64, keys: &[&str]) -> Self {
        Self {
            stage: String::new(),
            what: what.into(),
            bytes,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            place: Place::Device,
            transient: false,
        }
    }

    /// The same, held only while its stage works.
    pub fn transient(self) -> Self {
        Self { transient: true, ..self }
    }

    /// The same on the host.
    pub fn host(what: impl Into<String>, bytes: u64, keys: &[&str]) -> Self {
        Self { place: Place::Host, ..Self::device(what, bytes, keys) }
    }
}

/// What one place may use, and who said so.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Budget {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure comes from (`run.max_memory_gb`, `MemAvailable`, a cgroup's limit).
    pub source: String,
}

/// Every stage's needs, and the budgets they are judged against.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Estimate {
    /// All needs, in plan order.
    pub needs: Vec<Need>,
    /// Whether the run's device is the host (`run.device = "cpu"`): then every need is the host's.
    pub device_is_host: bool,
    /// The host's budget, when known.
    pub host: Option<Budget>,
    /// The device's budget (a GPU run: `run.max_memory_gb`, else the GPU's free memory).
    pub device: Option<Budget>,
    /// Stages whose estimate failed, with why: the total leaves them out.
    pub unknown: Vec<String>,
}

/// Bytes in a GiB.
const GIB: f64 = (1u64 << 30) as f64;

/// Bytes in GiB, or TiB and PiB when that many.
fn gib(b: u64) -> String {
    let g = b as f64 / GIB;
    match g {
        g if g >= 1024.0 * 1024.0 => format!("{:.1} PiB", g / (1024.0 * 1024.0)),
        g if g >= 1024.0 => format!("{:.1} TiB", g / 1024.0),
        g => format!("{g:.2} GiB"),
    }
}

impl Estimate {
    /// Judges `needs` for a run on `device_is_host` (else on a GPU with `gpu_free` bytes free,
    /// when known) with `max_memory_gb` (0: what the machine has).
    pub fn new(needs: Vec<Need>, device_is_host: bool, max_memory_gb: f64, gpu_free: Option<u64>) -> Self {
        let set = (max_memory_gb > 0.0).then(|| Budget { bytes: (max_memory_gb * GIB) as u64, source: "run.max_memory_gb".into() });
        let (host, device) = if device_is_host {
            (set.or_else(host_available), None)
        } else {
            let free = gpu_free.map(|bytes| Budget { bytes, source: "the GPU's free memory".into() });
            (host_available(), set.or(free))
        };
        Self { needs, device_is_host, host, device, unknown: Vec::new() }
    }

    /// Where `n` lives on this run.
    fn place_of(&self, n: &Need) -> Place {
        if self.device_is_host { Place::Host } else { n.place }
    }

    /// Peak bytes at `place`: every need held for the run, plus the largest stage's working
    /// set (its transient needs together: a stage may hold all of them at once, as the engine
    /// holds its arena's activations while validating through its mirror).
    pub fn total(&self, place: Place) -> u64 {
        let here = || self.needs.iter().filter(move |n| self.place_of(n) == place);
        // Saturating: an absurd config's estimate must stay absurd, not wrap to a small one.
        let held = here().filter(|n| !n.transient).fold(0u64, |a, n| a.saturating_add(n.bytes));
        let mut working: Vec<(&str, u64)> = Vec::new();
        for n in here().filter(|n| n.transient) {
            match working.iter_mut().find(|(stage, _)| *stage == n.stage) {
                Some((_, bytes)) => *bytes = bytes.saturating_add(n.bytes),
                None => working.push((&n.stage, n.bytes)),
            }
        }
        held.saturating_add(working.iter().map(|&(_, b)| b).max().unwrap_or(0))
    }

    /// One line per place: the total, the budget, the largest parts.
    pub fn summary(&self) -> String {
        let mut o = String::new();
        for (place, budget, name) in [(Place::Host, &self.host, "host"), (Place::Device, &self.device, "device")] {
            if place == Place::Device && self.device_is_host {
                continue;
            }
            let total = self.total(place);
            let of = budget.as_ref().map(|b| format!(" of {} ({})", gib(b.bytes), b.source)).unwrap_or_else(|| " (no limit known)".into());
            let _ = write!(
                o,
                "{}memory estimate ({name}): {}{of}; largest: {}",
                if o.is_empty() { "" } else { "\n" },
                gib(total),
                self.largest(place, 3)
            );
        }
        if !self.unknown.is_empty() {
            let _ = write!(o, "; not estimated: {}", self.unknown.join(", "));
        }
        o
    }

    /// The needs at `place`, largest first.
    fn parts(&self, place: Place) -> Vec<&Need> {
        let mut parts: Vec<&Need> = self.needs.iter().filter(|n| self.place_of(n) == place && n.bytes > 0).collect();
        parts.sort_by_key(|n| std::cmp::Reverse(n.bytes));
        parts
    }

    /// The `k` largest needs at `place`, as `stage what size, ...`.
    fn largest(&self, place: Place, k: usize) -> String {
        let shown: Vec<String> = self.parts(place).iter().take(k).map(|n| format!("{} {} {}", n.stage, n.what, gib(n.bytes))).collect();
        if shown.is_empty() { "nothing".into() } else { shown.join(", ") }
    }

    /// The places whose total passes their budget: (message, the keys that size the largest
    /// parts, the largest part's first).
    pub fn check(&self) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        for (place, budget, name) in [(Place::Host, &self.host, "host"), (Place::Device, &self.device, "device")] {
            let Some(b) = budget else { continue };
            let total = self.total(place);
            if total <= b.bytes {
                continue;
            }
            let mut keys: Vec<&str> = Vec::new();
            for k in self.parts(place).iter().take(4).flat_map(|n| n.keys.iter()) {
                if !keys.contains(&k.as_str()) {
                    keys.push(k);
                }
            }
            let keys_text: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
            out.push((
                format!(
                    "the run needs an estimated {} of {name} memory, more than the {} it may use ({}); largest: {}. Make it smaller with {}, or set `run.max_memory_gb` if the estimate is wrong for this machine",
                    gib(total),
                    gib(b.bytes),
                    b.source,
                    self.largest(place, 4),
                    keys_text.join(", ")
                ),
                keys.iter().map(|k| k.to_string()).collect(),
            ));
        }
        out
    }
}

/// What the host can give a new process: `MemAvailable` from `/proc/meminfo`, or the room left
/// under this process's cgroup limit when that is smaller. `None` where neither can be read.
pub fn host_available() -> Option<Budget> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let avail = meminfo.as_deref().and_then(|m| {
        m.lines().find_map(|l| l.strip_prefix("MemAvailable:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    let mut best = avail.map(|kb| Budget { bytes: kb * 1024, source: "MemAvailable".into() });
    if let Some(room) = cgroup_room()
        && best.as_ref().is_none_or(|b| room < b.bytes)
    {
        best = Some(Budget { bytes: room, source: "the cgroup's memory.max".into() });
    }
    best
}

/// Room under the cgroup v2 limit of this process, if it has one.
fn cgroup_room() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cg.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let dir = std::path::Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let max = std::fs::read_to_string(dir.join("memory.max")).ok()?.trim().parse::<u64>().ok()?;
    let current = std::fs::read_to_string(dir.join("memory.current")).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0);
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs() -> Vec<Need> {
        vec![
            Need { stage: "train".into(), ..Need::device("weights", 3 << 30, &["model.model_dim", "model.num_layers"]) },
            Need { stage: "train".into(), ..Need::device("activations", 5 << 30, &["train.batch_tokens", "model.model_dim"]).transient() },
            Need { stage: "eval".into(), ..Need::device("scoring", 4 << 30, &["model.model_dim"]).transient() },
            Need { stage: "ema".into(), ..Need::host("average", 1 << 30, &["model.model_dim"]) },
        ]
    }

    #[test]
    fn over_budget_names_the_parts_and_keys() {
        let e = Estimate::new(needs(), true, 4.0, None);
        assert_eq!(e.total(Place::Host), 9 << 30);
        let problems = e.check();
        assert_eq!(problems.len(), 1);
        let (msg, key) = &problems[0];
        assert!(msg.contains("9.00 GiB of host memory, more than the 4.00 GiB it may use (run.max_memory_gb)"), "{msg}");
        // The working sets do not add up (one stage works at a time): 3 + 1 + the larger of 5 and 4.
        assert!(msg.contains("train activations 5.00 GiB, eval scoring 4.00 GiB, train weights 3.00 GiB"), "{msg}");
        assert!(msg.contains("`train.batch_tokens`, `model.model_dim`, `model.num_layers`"), "{msg}");
        assert_eq!(key.first().map(String::as_str), Some("train.batch_tokens"));
        assert!(Estimate::new(needs(), true, 9.5, None).check().is_empty());
    }

    /// A stage's transient needs add up (it may hold them at once); different stages' do not.
    #[test]
    fn a_stages_working_set_is_its_transient_needs_together() {
        let mut n = needs();
        n.push(Need { stage: "eval".into(), ..Need::device("adapters", 2 << 30, &["model.model_dim"]).transient() });
        // 3 + 1 held, then eval's 4 + 2 over train's 5.
        assert_eq!(Estimate::new(n.clone(), true, 0.0, None).total(Place::Host), 10 << 30);
        n.push(Need { stage: "train".into(), ..Need::device("validation", 2 << 30, &["model.model_dim"]).transient() });
        assert_eq!(Estimate::new(n, true, 0.0, None).total(Place::Host), 11 << 30);
    }

    #[test]
    fn a_gpu_run_splits_host_and_device() {
        let e = Estimate::new(needs(), false, 6.0, Some(100 << 30));
        assert_eq!((e.total(Place::Device), e.total(Place::Host)), (8 << 30, 1 << 30));
        let problems = e.check();
        assert!(problems.iter().any(|(m, _)| m.contains("of device memory")), "{problems:?}");
        assert!(e.summary().contains("memory estimate (device): 8.00 GiB of 6.00 GiB (run.max_memory_gb)"), "{}", e.summary());
        // Without a limit set, the GPU's free memory is the budget.
        let e = Estimate::new(needs(), false, 0.0, Some(7 << 30));
        assert!(e.check().iter().any(|(m, _)| m.contains("more than the 7.00 GiB it may use (the GPU's free memory)")), "{:?}", e.check());
        assert!(Estimate::new(needs(), false, 0.0, Some(9 << 30)).check().iter().all(|(m, _)| !m.contains("device")));
    }

    #[test]
    fn sizes_read_in_the_unit_that_fits() {
        assert_eq!(gib(3 << 29), "1.50 GiB");
        assert_eq!(gib(5 << 40), "5.0 TiB");
        assert_eq!(gib(6 << 50), "6.0 PiB");
    }

    #[test]
    fn the_host_reports_some_memory() {
        let b = host_available().expect("Linux has /proc/meminfo");
        assert!(b.bytes > 1 << 20, "{b:?}");
    }
}
