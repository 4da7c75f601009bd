//! Device time of a training step's phases without a synchronisation per phase: on a CUDA
//! device, events recorded on the compute stream at every phase boundary, read once when the
//! step ends (where the loss read waits for the device anyway). Elsewhere (the CPU, or with
//! `sync_phases` on) there is nothing to record and the host's clock is the device's.

use std::time::Duration;

#[cfg(feature = "candle")]
use candle_core::Device;

/// A phase of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A micro-batch's forward pass.
    Forward,
    /// A micro-batch's backward pass (gradients kept).
    Backward,
    /// Clipping and the optimizers' update.
    Optimizer,
}

/// Device time per phase, summed over a step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// All the step's forward passes.
    pub forward: Duration,
    /// All the step's backward passes.
    pub backward: Duration,
    /// The optimizer update.
    pub optimizer: Duration,
}

/// A point on the device's timeline (an event recorded on the compute stream).
#[cfg(feature = "candle")]
pub struct Mark(#[cfg(feature = "cuda")] candle_core::cuda_backend::cudarc::driver::CudaEvent);

/// Records phase spans on one device's compute stream.
#[cfg(feature = "candle")]
pub struct PhaseClock {
    #[cfg(feature = "cuda")]
    stream: Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>>,
    spans: Vec<(Phase, Mark, Mark)>,
}

#[cfg(feature = "candle")]
impl PhaseClock {
    /// A clock on `device`'s compute stream; inert unless `device` is a CUDA device.
    pub fn new(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        let stream = match device {
            Device::Cuda(d) => Some(d.cuda_stream()),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Self {
            #[cfg(feature = "cuda")]
            stream,
            spans: Vec::new(),
        }
    }

    /// Whether marks are recorded (a CUDA device).
    pub fn active(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.stream.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// The device's current point (after everything queued so far); `None` when inert.
    pub fn mark(&self) -> anyhow::Result<Option<Mark>> {
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.stream {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            return Ok(Some(Mark(s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)));
        }
        Ok(None)
    }

    /// Adds the span between two marks to `phase`.
    pub fn span(&mut self, phase: Phase, start: Option<Mark>, end: Option<Mark>) {
        if let (Some(a), Some(b)) = (start, end) {
            self.spans.push((phase, a, b));
        }
    }

    /// The device time per phase of the spans that have ended since the last call (spans end
    /// in order on one stream); never waits. `None` when none has.
    pub fn take_ended(&mut self) -> anyhow::Result<Option<PhaseTimes>> {
        self.take(false)
    }

    /// [`PhaseClock::take_ended`] after waiting for every recorded span to end.
    pub fn take_all(&mut self) -> anyhow::Result<Option<PhaseTimes>> {
        self.take(true)
    }

    fn take(&mut self, wait: bool) -> anyhow::Result<Option<PhaseTimes>> {
        #[cfg(feature = "cuda")]
        {
            let n = if wait { self.spans.len() } else { self.spans.iter().take_while(|(_, _, b)| b.0.is_complete()).count() };
            if n == 0 {
                return Ok(None);
            }
            let mut t = PhaseTimes::default();
            for (phase, a, b) in self.spans.drain(..n) {
                // `elapsed_ms` waits for both events (they have ended unless `wait`).
                let d = Duration::from_secs_f64(f64::from(a.0.elapsed_ms(&b.0)?.max(0.0)) / 1e3);
                match phase {
                    Phase::Forward => t.forward += d,
                    Phase::Backward => t.backward += d,
                    Phase::Optimizer => t.optimizer += d,
                }
            }
            Ok(Some(t))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = wait;
            debug_assert!(self.spans.is_empty(), "marks are only made on CUDA devices");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the clock is inert: no marks, no spans, nothing to report, so the trainer
    /// keeps the host's times (which are the device's there).
    #[test]
    fn inert_off_cuda() {
        let mut c = PhaseClock::new(&Device::Cpu);
        assert!(!c.active());
        let (a, b) = (c.mark().unwrap(), c.mark().unwrap());
        assert!(a.is_none() && b.is_none());
        c.span(Phase::Forward, a, b);
        assert_eq!(c.take_ended().unwrap(), None);
        assert_eq!(c.take_all().unwrap(), None);
    }
}
