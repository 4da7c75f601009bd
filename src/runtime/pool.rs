//! A bounded pool of reusable buffers.
//!
//! [`Pool::take`] hands out a free buffer, blocking while all are in use: a pool is also a
//! bound on how many batches can be in flight. The handle, [`Pooled`], sends its buffer back
//! through the pool's return channel when dropped, i.e. when the last stage that held the batch
//! is done with it. Buffers are made once, when the pool is created, so a pipeline in steady
//! state allocates no batch buffers; [`Pool::made`] counts them to prove it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use flume::{Receiver, RecvTimeoutError, Sender};

use crate::runtime::control::POLL;
use crate::runtime::stage::{Ctx, Stopped};

/// A fixed set of reusable buffers.
pub struct Pool<T> {
    tx: Sender<T>,
    rx: Receiver<T>,
    made: Arc<AtomicUsize>,
    size: usize,
}

impl<T: Send + 'static> Pool<T> {
    /// Makes `size` buffers with `make`.
    pub fn new(size: usize, mut make: impl FnMut() -> T) -> Self {
        let (tx, rx) = flume::bounded(size.max(1));
        let made = Arc::new(AtomicUsize::new(0));
        for _ in 0..size.max(1) {
            made.fetch_add(1, Ordering::Relaxed);
            // Cannot fail: the channel holds exactly `size` and we own the receiver.
            let _ = tx.send(make());
        }
        Self { tx, rx, made, size: size.max(1) }
    }

    /// Number of buffers in the pool.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Buffers made since the pool was created (stays at [`Pool::size`]).
    pub fn made(&self) -> usize {
        self.made.load(Ordering::Relaxed)
    }

    /// Buffers free right now.
    #[cfg(feature = "tools")]
    pub fn free(&self) -> usize {
        self.rx.len()
    }

    /// Takes a free buffer, waiting for one to come back; fails with [`Stopped`] if the graph
    /// aborts meanwhile. `ctx` may be `None` outside a graph (tests, benches).
    pub fn take(&self, ctx: Option<&Ctx>) -> Result<Pooled<T>, Stopped> {
        if let Ok(item) = self.rx.try_recv() {
            return Ok(self.wrap(item));
        }
        loop {
            if ctx.is_some_and(Ctx::aborted) {
                return Err(Stopped);
            }
            match self.rx.recv_timeout(POLL) {
                Ok(item) => return Ok(self.wrap(item)),
                Err(RecvTimeoutError::Timeout) => continue,
                // Unreachable while `self` holds a sender; treat as a stop.
                Err(RecvTimeoutError::Disconnected) => return Err(Stopped),
            }
        }
    }

    fn wrap(&self, item: T) -> Pooled<T> {
        Pooled { item: Some(item), home: self.tx.clone() }
    }
}

/// A buffer on loan from a [`Pool`]; goes back when dropped.
pub struct Pooled<T> {
    item: Option<T>,
    home: Sender<T>,
}

impl<T> Deref for Pooled<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("present until drop")
    }
}

impl<T> DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item.as_mut().expect("present until drop")
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            // If the pool is gone the buffer is simply freed.
            let _ = self.home.try_send(item);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_none_are_made_later() {
        let pool = Pool::new(2, || vec![0u32; 16]);
        for round in 0..100u32 {
            let mut a = pool.take(None).unwrap();
            let b = pool.take(None).unwrap();
            a[0] = round;
            assert_eq!(pool.free(), 0);
            drop(a);
            drop(b);
            assert_eq!(pool.free(), 2);
        }
        assert_eq!(pool.made(), 2);
    }

    #[test]
    fn take_waits_for_a_buffer_returned_by_another_thread() {
        let pool = Pool::new(1, || 0u8);
        let held = pool.take(None).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            drop(held);
        });
        let again = pool.take(None).unwrap();
        assert_eq!(*again, 0);
        t.join().unwrap();
    }
}
