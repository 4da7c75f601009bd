//! Slowdown and fault injection, for testing that the report names the right stage and that
//! the runtime survives a failing stage. Any stage implementation can embed these.

use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::runtime::stage::Ctx;

/// How an injected fault shows itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FailMode {
    /// The stage returns an error.
    #[default]
    Error,
    /// The stage panics.
    Panic,
}

/// Fails a stage at a chosen item.
pub struct Fault {
    at: u64,
    mode: FailMode,
    seen: u64,
}

impl Fault {
    /// Fails at item `at` (1-based); `at = 0` never fails.
    pub fn new(at: u64, mode: FailMode) -> Self {
        Self { at, mode, seen: 0 }
    }

    /// Counts one item; errors (or panics) if it is the chosen one.
    pub fn tick(&mut self) -> anyhow::Result<()> {
        self.seen += 1;
        if self.at > 0 && self.seen == self.at {
            match self.mode {
                FailMode::Error => anyhow::bail!("injected failure at item {} (fail_at = {})", self.seen, self.at),
                FailMode::Panic => panic!("injected panic at item {} (fail_at = {})", self.seen, self.at),
            }
        }
        Ok(())
    }
}

/// Adds a service time per item: `delay_us`, plus a uniform jitter of up to `jitter_us` either
/// way, by sleeping (off-CPU, like waiting for I/O) or spinning (on-CPU, like real work).
pub struct Pace {
    base_ns: f64,
    jitter_ns: f64,
    spin: bool,
    rng: fastrand::Rng,
}

impl Pace {
    /// Checks the two durations (finite, not negative).
    pub fn check(delay_us: f64, jitter_us: f64) -> anyhow::Result<()> {
        for (name, v) in [("delay_us", delay_us), ("jitter_us", jitter_us)] {
            if !v.is_finite() || !(0.0..=1e12).contains(&v) {
                anyhow::bail!("`{name}` must be a number of microseconds from 0 to 1e12 (about 11 days); found {v}");
            }
        }
        Ok(())
    }

    /// A pacer; `seed` makes the jitter repeatable.
    pub fn new(delay_us: f64, jitter_us: f64, spin: bool, seed: u64) -> anyhow::Result<Self> {
        Self::check(delay_us, jitter_us)?;
        Ok(Self { base_ns: delay_us * 1e3, jitter_ns: jitter_us * 1e3, spin, rng: fastrand::Rng::with_seed(seed) })
    }

    /// The next duration to wait.
    pub fn draw(&mut self) -> Duration {
        let j = if self.jitter_ns > 0.0 { (self.rng.f64() * 2.0 - 1.0) * self.jitter_ns } else { 0.0 };
        Duration::from_nanos((self.base_ns + j).max(0.0) as u64)
    }

    /// Waits one drawn duration; false if the graph aborted meanwhile.
    pub fn wait(&mut self, ctx: &Ctx) -> bool {
        self.wait_inner(ctx, false)
    }

    /// As [`Pace::wait`], but also ends early on a graceful stop (for sources).
    pub fn wait_unless_stopping(&mut self, ctx: &Ctx) -> bool {
        self.wait_inner(ctx, true)
    }

    fn wait_inner(&mut self, ctx: &Ctx, source: bool) -> bool {
        let d = self.draw();
        if d.is_zero() {
            return true;
        }
        if !self.spin {
            return if source { ctx.sleep_unless_stopping(d) } else { ctx.sleep(d) };
        }
        let deadline = Instant::now() + d;
        let mut spins = 0u32;
        while Instant::now() < deadline {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && ctx.aborted() {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_in_range_and_repeats() {
        let mut a = Pace::new(100.0, 50.0, false, 7).unwrap();
        let mut b = Pace::new(100.0, 50.0, false, 7).unwrap();
        for _ in 0..1000 {
            let d = a.draw();
            assert!(d >= Duration::from_micros(50) && d <= Duration::from_micros(150), "{d:?}");
            assert_eq!(d, b.draw());
        }
    }

    #[test]
    fn rejects_negative_and_nan() {
        assert!(Pace::new(-1.0, 0.0, false, 0).is_err());
        assert!(Pace::new(1.0, f64::NAN, false, 0).is_err());
    }

    #[test]
    fn fault_fires_once_at_its_item() {
        let mut f = Fault::new(3, FailMode::Error);
        assert!(f.tick().is_ok());
        assert!(f.tick().is_ok());
        let e = f.tick().unwrap_err().to_string();
        assert!(e.contains("item 3"), "{e}");
        let mut never = Fault::new(0, FailMode::Panic);
        for _ in 0..10 {
            assert!(never.tick().is_ok());
        }
    }
}
