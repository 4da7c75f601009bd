//! Depth advice from a finished run: the chain of stages that feeds the verdict's focus stage
//! (the executor, or a loader's sink) replayed as a tandem queue, each stage one server whose
//! service times are drawn from its own recorded distribution ([`Summary::quantiles`]) and each
//! channel a bounded buffer (a stage holds a finished item until the next channel has room, as
//! a blocked `send` does). For each channel on the chain and each depth in 1, 2, 4, ... 128 (the
//! other channels as recorded), and for every channel at once, it predicts the focus stage's
//! input-wait share and throughput, and names the smallest depth within 1% of the best.
//!
//! The recursion, for item `n` and stage `j` (service `s`, depth `b` of the channel into `j+1`):
//! start `S_j(n) = max(D_{j-1}(n), D_j(n-1))`, finish `F_j(n) = S_j(n) + s_j(n)`, departure
//! `D_j(n) = max(F_j(n), S_{j+1}(n - b))`: the item leaves when the channel has room, i.e.
//! when item `n - b` has been taken in. The focus stage's wait for item `n` is
//! `max(0, D_{last-1}(n) - D_last(n-1))`.
//!
//! Approximations, stated in the output: stages are single servers (a stage's workers show up
//! in its service times); a stage that makes fewer items than the focus stage (a shard reader)
//! has its service scaled by its items per focus item, and its channel's depth counted in focus
//! items; what the focus stage sends on (snapshots to the EMA) is not modelled.

use crate::report::document::Report;
use crate::runtime::metrics::Summary;

/// Depths tried for each channel.
pub const DEPTHS: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
/// Items simulated per prediction, and the first ones left out as warm-up.
const ITEMS: usize = 20_000;
const WARMUP: usize = 500;

/// One stage of the chain, as the simulation sees it.
#[derive(Clone, Debug)]
pub struct Server {
    /// The stage's name.
    pub name: String,
    /// Service time per focus item at each quantile (µs): the recorded quantiles times the
    /// stage's items per focus item.
    quantiles: Vec<f64>,
}

/// The chain: servers from the source to the focus stage, and the recorded depth of the
/// channel into each server after the first (in focus items).
#[derive(Clone, Debug)]
pub struct Chain {
    /// Source first, the focus stage last.
    pub servers: Vec<Server>,
    /// `depths[j]`: the channel into `servers[j + 1]`, as recorded.
    pub depths: Vec<usize>,
    /// Channel names (`FROM->TO`), as `depths`.
    pub channels: Vec<String>,
}

/// A predicted steady state.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// The focus stage's time waiting for input over its wall time.
    pub input_wait: f64,
    /// Focus items per second.
    pub throughput_per_s: f64,
}

impl Chain {
    /// The chain feeding `report`'s focus stage. Errors name a stage without recorded service
    /// times or a focus stage with no input.
    pub fn of(report: &Report) -> anyhow::Result<Chain> {
        let focus = report.verdict.focus.clone();
        let mut names = vec![focus.clone()];
        loop {
            let stage = report
                .stages
                .get(names.last().expect("non-empty"))
                .ok_or_else(|| anyhow::anyhow!("no stage `{}` in the report", names[0]))?;
            match stage.inputs.first() {
                Some(input) if !names.contains(input) => names.push(input.clone()),
                _ => break,
            }
        }
        anyhow::ensure!(names.len() >= 2, "the focus stage `{focus}` has no input: nothing to advise");
        names.reverse();
        let focus_items = report.stages[&focus].items.max(1) as f64;
        let mut servers = Vec::new();
        for name in &names {
            let st = &report.stages[name];
            let q = quantiles(&st.service_us).ok_or_else(|| {
                anyhow::anyhow!(
                    "stage `{name}` recorded no service-time distribution (a run with `run.instrument = true`, by this version)"
                )
            })?;
            let per_focus = st.items as f64 / focus_items;
            servers.push(Server { name: name.clone(), quantiles: q.iter().map(|x| x * per_focus).collect() });
        }
        let mut depths = Vec::new();
        let mut channels = Vec::new();
        for w in names.windows(2) {
            let key = format!("{}->{}", w[0], w[1]);
            let ch = report.channels.get(&key).ok_or_else(|| anyhow::anyhow!("no channel {key} in the report"))?;
            let per_focus = (report.stages[&w[0]].items as f64 / focus_items).max(1e-9);
            depths.push(((ch.capacity as f64 / per_focus).round() as usize).max(1));
            channels.push(key);
        }
        Ok(Chain { servers, depths, channels })
    }

    /// The steady state with channel depths `depths` (as [`Chain::depths`]), drawn with `seed`.
    pub fn predict(&self, depths: &[usize], seed: u64) -> Prediction {
        let m = self.servers.len();
        let mut rng = fastrand::Rng::with_seed(seed);
        // Rows of start and departure times per stage, for every item so far.
        let mut start = vec![vec![0.0f64; ITEMS]; m];
        let mut depart = vec![vec![0.0f64; ITEMS]; m];
        let mut wait = 0.0;
        for n in 0..ITEMS {
            for j in 0..m {
                let arrive = if j == 0 { 0.0 } else { depart[j - 1][n] };
                let free = if n == 0 { 0.0 } else { depart[j][n - 1] };
                let s = arrive.max(free);
                let q = &self.servers[j].quantiles;
                let finish = s + q[rng.usize(0..q.len())];
                // It leaves when the channel on has room: item n - b has been taken in there.
                let room = match depths.get(j) {
                    Some(&b) if j + 1 < m && n >= b.max(1) => start[j + 1][n - b.max(1)],
                    _ => 0.0,
                };
                start[j][n] = s;
                depart[j][n] = finish.max(room);
                if j == m - 1 && n > WARMUP {
                    wait += (arrive - free).max(0.0);
                }
            }
        }
        let span = depart[m - 1][ITEMS - 1] - depart[m - 1][WARMUP];
        Prediction { input_wait: if span > 0.0 { wait / span } else { 0.0 }, throughput_per_s: (ITEMS - 1 - WARMUP) as f64 / span * 1e6 }
    }
}

/// What the run measured of `focus` over the time it spent in its loop (serving, waiting for
/// input, blocked sending), not its whole steady window: a step executor's window runs on to
/// the end of the run, through the evaluation after training, when it no longer takes items.
fn measured(report: &Report, focus: &str) -> Prediction {
    let t = crate::report::verdict::loop_time(focus, &report.stages[focus], &report.channels);
    Prediction { input_wait: t.wait_fraction(), throughput_per_s: t.items_per_s() }
}

fn quantiles(s: &Summary) -> Option<&[f64]> {
    (s.count > 0 && !s.quantiles.is_empty()).then_some(s.quantiles.as_slice())
}

/// What the simulation says of one channel (or of every channel at once).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChannelAdvice {
    /// `FROM->TO`, or `all channels`.
    pub channel: String,
    /// The depth the run had (in focus items; `None` for all channels).
    pub recorded_depth: Option<usize>,
    /// Each depth of [`DEPTHS`] and its prediction, the other channels as recorded.
    pub predictions: Vec<(usize, Prediction)>,
    /// The smallest depth whose throughput is within 1% of the best.
    pub advised_depth: usize,
}

/// Depth advice for a run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Advice {
    /// The stage whose input wait is predicted.
    pub focus: String,
    /// The chain, source first.
    pub chain: Vec<String>,
    /// What the run measured: the focus stage's input wait and throughput.
    pub measured: Prediction,
    /// The simulation at the recorded depths (how well it reproduces the run).
    pub recorded: Prediction,
    /// Per channel, then every channel at once.
    pub channels: Vec<ChannelAdvice>,
    /// Said first when the run did not complete: its status and why, and that its service
    /// times cover only what ran (a failing or stopped stage's are not its steady state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caveat: Option<String>,
}

/// What advice on `report`'s run must say first when the run did not complete: its status,
/// exit code and why, and that its service times cover only the part that ran.
pub fn caveat(report: &Report) -> Option<String> {
    let run = &report.run;
    (run.status != "completed" || run.exit_code != 0).then(|| {
        let why = run.error.as_deref().or(run.signal.as_deref()).map(|w| format!(": {w}")).unwrap_or_default();
        format!(
            "the run did not complete (status {}, exit code {}{why}): this advice reads the service times of the part that ran, which may not be the stages' steady state",
            run.status, run.exit_code
        )
    })
}

/// The advice for `report`'s run (see the module doc).
pub fn advise(report: &Report) -> anyhow::Result<Advice> {
    let chain = Chain::of(report)?;
    let seed = 0x5eed;
    let focus = report.verdict.focus.clone();
    let measured = measured(report, &focus);
    let recorded = chain.predict(&chain.depths, seed);
    let sweep = |channel: String, recorded_depth: Option<usize>, set: &dyn Fn(usize) -> Vec<usize>| {
        let predictions: Vec<(usize, Prediction)> = DEPTHS.iter().map(|&d| (d, chain.predict(&set(d), seed))).collect();
        let best = predictions.iter().map(|(_, p)| p.throughput_per_s).fold(0.0, f64::max);
        let advised_depth = predictions.iter().find(|(_, p)| p.throughput_per_s >= 0.99 * best).map_or(1, |(d, _)| *d);
        ChannelAdvice { channel, recorded_depth, predictions, advised_depth }
    };
    let mut channels = Vec::new();
    for (j, name) in chain.channels.iter().enumerate() {
        let set = |d: usize| {
            let mut v = chain.depths.clone();
            v[j] = d;
            v
        };
        channels.push(sweep(name.clone(), Some(chain.depths[j]), &set));
    }
    let n = chain.depths.len();
    channels.push(sweep("all channels".into(), None, &|d| vec![d; n]));
    let caveat = caveat(report);
    Ok(Advice { focus, chain: chain.servers.iter().map(|s| s.name.clone()).collect(), measured, recorded, channels, caveat })
}

/// The advice as text: the chain, measured against simulated at the recorded depths, then a
/// line per channel with the predicted input wait and throughput at each depth.
pub fn render(a: &Advice) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    if let Some(c) = &a.caveat {
        let _ = writeln!(o, "warning: {c}\n");
    }
    let _ = writeln!(o, "chain: {} (input wait of `{}`)", a.chain.join(" -> "), a.focus);
    let _ = writeln!(
        o,
        "measured: input wait {:.1}%, {} items/s; simulated at the recorded depths: {:.1}%, {} items/s",
        a.measured.input_wait * 100.0,
        rate(a.measured.throughput_per_s),
        a.recorded.input_wait * 100.0,
        rate(a.recorded.throughput_per_s)
    );
    let depths: Vec<String> = DEPTHS.iter().map(|d| format!("{d:>13}")).collect();
    let _ = writeln!(o, "\n{:<28} {:>6}  {}  advice", "channel (wait %, items/s)", "now", depths.join(""));
    for c in &a.channels {
        let cells: Vec<String> = c
            .predictions
            .iter()
            .map(|(_, p)| format!("{:>13}", format!("{:.1}% {}", p.input_wait * 100.0, rate(p.throughput_per_s))))
            .collect();
        let now = c.recorded_depth.map_or("-".to_string(), |d| d.to_string());
        let _ = writeln!(o, "{:<28} {:>6}  {}  depth {}", c.channel, now, cells.join(""), c.advised_depth);
    }
    let _ = writeln!(
        o,
        "\n(the smallest depth within 1% of the best throughput; stages as single servers drawing their recorded service times)"
    );
    o
}

/// A rate with three significant digits below 100 (a training step is a few items a second).
fn rate(x: f64) -> String {
    match x {
        x if x < 10.0 => format!("{x:.2}"),
        x if x < 100.0 => format!("{x:.1}"),
        x => format!("{x:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(services: &[f64], jitter: f64) -> Chain {
        let servers = services
            .iter()
            .enumerate()
            .map(|(k, &s)| Server {
                name: format!("s{k}"),
                quantiles: (0..100).map(|q| s + jitter * ((q as f64 + 0.5) / 50.0 - 1.0)).collect(),
            })
            .collect();
        let n = services.len() - 1;
        Chain { servers, depths: vec![1; n], channels: (0..n).map(|k| format!("s{k}->s{}", k + 1)).collect() }
    }

    /// Known cases: constant services never wait at any depth beyond the slowest stage's rate;
    /// a slow source makes the sink wait its difference; jitter costs throughput at depth 1
    /// and deeper channels win it back towards the slowest stage's rate.
    #[test]
    fn tandem_queue_known_cases() {
        let p = chain(&[100.0, 100.0, 100.0], 0.0).predict(&[1, 1], 1);
        assert!(p.input_wait < 1e-9 && (p.throughput_per_s - 1e4).abs() < 1.0, "{p:?}");
        let p = chain(&[200.0, 100.0], 0.0).predict(&[4], 1);
        assert!((p.input_wait - 0.5).abs() < 1e-3 && (p.throughput_per_s - 5e3).abs() < 1.0, "{p:?}");
        let c = chain(&[100.0, 100.0, 100.0], 90.0);
        let (shallow, deep) = (c.predict(&[1, 1], 1), c.predict(&[64, 64], 1));
        assert!(shallow.throughput_per_s < 0.9e4 && deep.throughput_per_s > 0.95e4, "{shallow:?} {deep:?}");
        assert!(shallow.input_wait > deep.input_wait + 0.05, "{shallow:?} {deep:?}");
    }
}
