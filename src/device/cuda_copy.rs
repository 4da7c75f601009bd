//! Host-to-device copies for the `cuda` build: page-locked staging buffers and the copy of a
//! micro-batch from one onto the GPU, either on a dedicated copy stream (`upload/stream`) or on
//! the executor's stream itself (`upload/sync`). Neither ever waits on the host for the GPU.
//!
//! Every thread that uses a GPU enqueues onto one compute stream ([`crate::device::open`]), so
//! stream order alone orders the uploader's tensors, the executor's kernels and the snapshots
//! the stages after it read. The copy stream is the only other stream, and its buffers are
//! synchronised by hand (candle's per-tensor event tracking is off):
//!
//! - the copy lands in one of a small ring of device buffers owned by the copier ([`RING`]);
//! - the compute stream waits for the copy's event, copies the buffer into a fresh tensor
//!   allocated on the compute stream (so that its memory is freed in compute order when the
//!   executor drops it), and records the slot's `released` event;
//! - the next copy into that slot waits (on the copy stream, not the host) for `released`;
//! - the page-locked source buffer records its own `copied` event ([`PinnedBuffer`]), which the
//!   pin stage waits for before writing the next micro-batch into it.
//!
//! Copy times come from CUDA event pairs read once both have completed, without blocking:
//! [`Copier::finished`] returns the ones that have; [`Copier::drain`] waits for the rest.
//!
//! [`check_copies`] (a row of `pipeline parity` on a GPU) checks that synchronisation on the
//! device; `scripts/gpu-check.sh` runs it and its ablation compares the two uploaders.

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};

/// Device buffers a dedicated copy stream cycles through. Two let the copy of the next
/// micro-batch run while the compute stream has not yet reached the current one; more only let
/// copies run further ahead, which the compute stream cannot use.
pub const RING: usize = 4;

/// The candle CUDA device behind `device` (an error naming `run.device` otherwise).
pub fn cuda_device(device: &Device) -> anyhow::Result<CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d.clone()),
        _ => anyhow::bail!("page-locked buffers and copy streams need `run.device` = \"cuda:N\""),
    }
}

/// The CUDA context of `device`.
pub fn context(device: &Device) -> anyhow::Result<Arc<CudaContext>> {
    Ok(cuda_device(device)?.cuda_stream().context().clone())
}

/// A page-locked host buffer and the event of its last copy to the GPU.
///
/// cudarc's own pinned buffers record their copies' events only while its event tracking is
/// on, and it is off here (see [`crate::device::open`]): this type records the event itself
/// ([`Copier::copy`]), and waits for it before the host reads, writes or frees the memory.
pub struct PinnedBuffer {
    host: PinnedHostSlice<u32>,
    /// Recorded after each copy out of `host` (blocking sync: a host wait sleeps). Behind a
    /// lock: a batch may go to two uploaders (a stage's output is cloned to each consumer).
    copied: std::sync::Mutex<CudaEvent>,
}

impl PinnedBuffer {
    /// Capacity in u32.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The values, after the last copy out of the buffer completed.
    pub fn as_slice(&self) -> anyhow::Result<&[u32]> {
        self.wait_copies()?;
        Ok(self.host.as_slice()?)
    }

    /// The values to write, after the last copy out of the buffer completed.
    pub fn as_mut_slice(&mut self) -> anyhow::Result<&mut [u32]> {
        self.wait_copies()?;
        Ok(self.host.as_mut_slice()?)
    }

    fn event(&self) -> std::sync::MutexGuard<'_, CudaEvent> {
        // A poisoned lock still holds a valid event.
        self.copied.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits on the host until every copy out of the buffer queued so far has run.
    fn wait_copies(&self) -> anyhow::Result<()> {
        Ok(self.event().synchronize()?)
    }

    /// Marks a copy out of the buffer just queued on `stream`: the event then completes after it
    /// and after every earlier copy (`stream` first waits for the event's previous record, which
    /// may be another uploader's copy on another stream).
    fn copy_queued(&self, stream: &CudaStream) -> anyhow::Result<()> {
        let ev = self.event();
        stream.wait(&ev)?;
        ev.record(stream)?;
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // The memory is freed after this (field drop): not while a copy still reads it.
        let ev = self.event();
        ev.context().record_err(ev.synchronize());
    }
}

/// `n` page-locked buffers of `len` u32 each, allocated once.
pub fn pinned_buffers(device: &Device, n: usize, len: usize) -> anyhow::Result<Vec<PinnedBuffer>> {
    let ctx = context(device)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        // SAFETY: the memory is uninitialised until the pin stage writes a micro-batch into it,
        // and nothing reads a buffer before that (its tokens come from the batch it holds).
        let host = unsafe { ctx.alloc_pinned::<u32>(len) }?;
        let copied = std::sync::Mutex::new(ctx.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))?);
        out.push(PinnedBuffer { host, copied });
    }
    Ok(out)
}

/// One device buffer of the copy stream's ring.
struct Slot {
    /// Where the copy stream writes a micro-batch (allocated on first use, for its size).
    buf: Option<CudaSlice<u32>>,
    /// Recorded on the compute stream after its copy out of `buf`: the next write waits for it.
    released: CudaEvent,
}

/// A copy's start and end events (timing enabled), read once both have completed.
struct Span {
    start: CudaEvent,
    end: CudaEvent,
}

/// Copies micro-batches from page-locked buffers to one GPU.
pub struct Copier {
    device: CudaDevice,
    /// The executor's stream, which every tensor lives on.
    compute: Arc<CudaStream>,
    /// The dedicated copy stream and its ring of buffers (`None`: copies run on `compute`).
    dedicated: Option<(Arc<CudaStream>, Vec<Slot>)>,
    /// The ring slot the next copy uses.
    next: usize,
    /// Copies whose time has not been read yet, oldest first.
    pending: VecDeque<Span>,
    /// Timing events to reuse.
    spare: Vec<Span>,
}

impl Copier {
    /// A copier with its own stream (`dedicated`) or on the executor's.
    pub fn new(device: &Device, dedicated: bool) -> anyhow::Result<Self> {
        let device = cuda_device(device)?;
        let compute = device.cuda_stream();
        let dedicated = if dedicated {
            let ctx = compute.context();
            let slots = (0..RING).map(|_| Ok(Slot { buf: None, released: ctx.new_event(None)? })).collect::<anyhow::Result<Vec<_>>>()?;
            Some((ctx.new_stream()?, slots))
        } else {
            None
        };
        Ok(Self { device, compute, dedicated, next: 0, pending: VecDeque::new(), spare: Vec::new() })
    }

    fn span(&mut self) -> anyhow::Result<Span> {
        if let Some(s) = self.spare.pop() {
            return Ok(s);
        }
        let ctx = self.compute.context();
        Ok(Span {
            start: ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            end: ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        })
    }

    /// Queues the copy of `src` (x then y, each `rows x seq_len` u32) to the GPU and returns `x`
    /// and `y`, tensors on the compute stream that no kernel queued after this call can read
    /// before the copy is done. Returns without waiting for the copy.
    pub fn copy(&mut self, src: &PinnedBuffer, rows: usize, seq_len: usize) -> anyhow::Result<(Tensor, Tensor)> {
        let n = 2 * rows * seq_len;
        anyhow::ensure!(src.len() == n, "staging buffer of {} tokens for a micro-batch of {n}", src.len());
        let span = self.span()?;
        // SAFETY: every element is written by the copy below before anything reads it.
        let mut dst = unsafe { self.compute.alloc::<u32>(n) }?;
        match &mut self.dedicated {
            None => {
                span.start.record(&self.compute)?;
                self.compute.memcpy_htod(&src.host, &mut dst)?;
                src.copy_queued(&self.compute)?;
                span.end.record(&self.compute)?;
            }
            Some((copy, slots)) => {
                let slot = &mut slots[self.next];
                self.next = (self.next + 1) % RING;
                // The compute stream's copy out of this slot's previous micro-batch must be done
                // before it is written again (a wait on the copy stream, never on the host).
                copy.wait(&slot.released)?;
                if slot.buf.as_ref().is_none_or(|b| b.len() != n) {
                    // The old buffer (if any) is freed on the copy stream, after the wait above.
                    // SAFETY: written by the copy below before the compute stream reads it.
                    slot.buf = Some(unsafe { copy.alloc::<u32>(n) }?);
                }
                let buf = slot.buf.as_mut().expect("allocated above");
                span.start.record(copy)?;
                copy.memcpy_htod(&src.host, buf)?;
                src.copy_queued(copy)?;
                span.end.record(copy)?;
                self.compute.wait(&span.end)?;
                self.compute.memcpy_dtod(buf, &mut dst)?;
                slot.released.record(&self.compute)?;
            }
        }
        self.pending.push_back(span);
        let storage = CudaStorage::wrap_cuda_slice(dst, self.device.clone());
        let both = Tensor::from_storage(Storage::Cuda(storage), (2, rows, seq_len), BackpropOp::none(), false);
        Ok((both.get(0)?, both.get(1)?))
    }

    /// The device times (ns) of the copies that have completed since the last call, oldest
    /// first; never waits. On the executor's stream (`upload/sync`) a kernel the executor
    /// queued between a copy's two events counts in its time; on a copy stream only copies do.
    pub fn finished(&mut self) -> anyhow::Result<Vec<u64>> {
        let mut out = Vec::new();
        while let Some(s) = self.pending.front() {
            if !s.end.try_is_complete()? {
                break;
            }
            let s = self.pending.pop_front().expect("checked above");
            // Both events have completed: this reads their times without waiting.
            out.push((s.start.elapsed_ms(&s.end)? as f64 * 1e6) as u64);
            self.spare.push(s);
        }
        Ok(out)
    }

    /// The device times (ns) of every copy not yet returned, waiting for them to complete.
    pub fn drain(&mut self) -> anyhow::Result<Vec<u64>> {
        if let Some(s) = self.pending.back() {
            s.end.synchronize()?;
        }
        self.finished()
    }
}

/// Copies `batches` micro-batches of distinct token patterns through a copier (its own stream
/// when `dedicated`) while the compute stream is kept busy with products queued before each
/// copy, then reads every `x` and `y` back: how many tokens differ from what was written, of
/// how many. Zero when the copies, the ring's reuse and the pinned buffers' reuse are all
/// ordered; a slot overwritten before the compute stream copied out of it, or a tensor read
/// before its copy, shows as differing tokens.
pub fn check_copies(device: &Device, dedicated: bool, batches: usize) -> anyhow::Result<(usize, usize)> {
    let (rows, seq_len) = (16, 1024);
    let n = 2 * rows * seq_len;
    let pattern = |batch: usize, j: usize| (batch as u32).wrapping_mul(2_654_435_761) ^ (j as u32).wrapping_mul(40_503);
    let mut pinned = pinned_buffers(device, 2, n)?;
    let mut copier = Copier::new(device, dedicated)?;
    // ~3 ms of f32 products on an H100 before each copy: the compute stream stays behind the
    // copies, which is when a missing wait would show.
    let busy = Tensor::ones((4096, 4096), candle_core::DType::F32, device)?;
    let mut got = Vec::with_capacity(batches);
    for i in 0..batches {
        drop(busy.matmul(&busy)?);
        let buf = &mut pinned[i % 2];
        for (j, v) in buf.as_mut_slice()?.iter_mut().enumerate() {
            *v = pattern(i, j);
        }
        got.push(copier.copy(buf, rows, seq_len)?);
    }
    let mut wrong = 0usize;
    for (i, (x, y)) in got.iter().enumerate() {
        let both = [x.flatten_all()?.to_vec1::<u32>()?, y.flatten_all()?.to_vec1::<u32>()?].concat();
        wrong += both.iter().enumerate().filter(|&(j, &v)| v != pattern(i, j)).count();
    }
    let times = copier.drain()?;
    anyhow::ensure!(times.len() == batches, "{} copy times for {batches} copies", times.len());
    Ok((wrong, batches * n))
}

impl Drop for Copier {
    fn drop(&mut self) {
        if let Some((copy, slots)) = &self.dedicated {
            for slot in slots {
                // Each buffer is freed on the copy stream: after the compute stream's last read
                // of it. An error here is kept by the context (nothing to return it to).
                copy.context().record_err(copy.wait(&slot.released));
            }
        }
    }
}
