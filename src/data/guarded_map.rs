//! A read-only memory map of a file that survives the file shrinking under it.
//!
//! Reading a page of a map that lies past its file's end (the file was truncated after it was
//! mapped) raises SIGBUS, whose default action kills the process at once: no message, no
//! report, no checkpoint. Every [`GuardedMap`] registers its address range in a fixed table,
//! and one process-wide SIGBUS handler looks the faulting address up there:
//!
//! - inside a registered map: it maps a private page of zeros over the faulting page (so the
//!   read completes and reads zeros) and marks that map damaged. The owner checks
//!   [`GuardedMap::damaged`] after each read and turns it into an error naming the file, so the
//!   run stops as it does after a failed `pread` (exit 1, report and checkpoint written);
//! - anywhere else: the handler that was installed before runs (Rust's stack-overflow reporter,
//!   or the default action), so every other fault ends the process as it would have.
//!
//! The handler only reads atomics and calls `mmap(2)`; it allocates nothing and takes no lock.

use std::fs::File;
use std::io;
use std::ops::Deref;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// How many maps can be guarded at once (a shard set opens one per shard).
const SLOTS: usize = 4096;

struct Slot {
    claimed: AtomicBool,
    start: AtomicUsize,
    len: AtomicUsize,
    damaged: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot =
    Slot { claimed: AtomicBool::new(false), start: AtomicUsize::new(0), len: AtomicUsize::new(0), damaged: AtomicBool::new(false) };
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// The SIGBUS action that was installed before ours, written once before ours is installed.
struct Previous(std::cell::UnsafeCell<std::mem::MaybeUninit<libc::sigaction>>);
// SAFETY: written once inside `INSTALL` before the handler that reads it exists; read-only after.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(std::cell::UnsafeCell::new(std::mem::MaybeUninit::uninit()));
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(Ordering::Relaxed);
    for slot in &TABLE {
        let start = slot.start.load(Ordering::Acquire);
        if start == 0 || addr < start || addr - start >= slot.len.load(Ordering::Acquire) {
            continue;
        }
        // SAFETY: the page lies inside a live read-only map this module registered; replacing
        // it with zeros changes what its readers see, which `damaged` then reports.
        let zeros = unsafe {
            libc::mmap(
                (addr & !(page - 1)) as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if zeros != libc::MAP_FAILED {
            slot.damaged.store(true, Ordering::Release);
            return;
        }
    }
    // Not ours: what was there before decides.
    // SAFETY: written before this handler was installed (see `install`).
    let previous = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    let action = previous.sa_sigaction;
    if action == libc::SIG_DFL || action == libc::SIG_IGN {
        // Back to the default action; returning re-runs the access, which faults again and
        // ends the process as if this handler had never been there.
        // SAFETY: a zeroed sigaction with SIG_DFL is a valid argument.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
        }
    } else if previous.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: an SA_SIGINFO action is a three-argument handler.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = unsafe { std::mem::transmute(action) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a plain action is a one-argument handler.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(action) };
        f(sig);
    }
}

fn install() -> io::Result<()> {
    INSTALL.call_once(|| {
        // SAFETY: plain libc calls with valid arguments; PREVIOUS is written before the handler
        // that reads it is installed, and only here.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE);
            if page > 0 {
                PAGE.store(page as usize, Ordering::Relaxed);
            }
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_sigbus as *const () as usize;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            let previous = (*PREVIOUS.0.get()).as_mut_ptr();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), previous) == 0
                && libc::sigaction(libc::SIGBUS, &ours, std::ptr::null_mut()) == 0
            {
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
    if INSTALLED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(io::Error::other("cannot install the SIGBUS handler that guards memory maps"))
    }
}

/// A read-only map of a whole file, registered with the SIGBUS handler while it lives.
pub struct GuardedMap {
    map: memmap2::Mmap,
    slot: Option<usize>,
}

impl GuardedMap {
    /// Maps `file` read-only and registers the map. An empty file has no pages to fault.
    pub fn map(file: &File) -> io::Result<Self> {
        install()?;
        // SAFETY: read-only; a file shrinking under the map is met by the handler above (its
        // pages read as zeros and `damaged` turns true), not by undefined behaviour.
        let map = unsafe { memmap2::MmapOptions::new().map(file) }?;
        if map.is_empty() {
            return Ok(Self { map, slot: None });
        }
        let i = TABLE
            .iter()
            .position(|s| s.claimed.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok())
            .ok_or_else(|| io::Error::other(format!("more than {SLOTS} files are mapped at once (use positioned reads instead)")))?;
        let slot = &TABLE[i];
        slot.damaged.store(false, Ordering::Release);
        slot.len.store(map.len(), Ordering::Release);
        slot.start.store(map.as_ptr() as usize, Ordering::Release);
        Ok(Self { map, slot: Some(i) })
    }

    /// Whether a page of the map was read past the file's end since it was mapped: what was
    /// read from there is zeros, not the file.
    pub fn damaged(&self) -> bool {
        self.slot.is_some_and(|i| TABLE[i].damaged.load(Ordering::Acquire))
    }

    /// The underlying map (for `madvise`).
    pub fn inner(&self) -> &memmap2::Mmap {
        &self.map
    }
}

impl Deref for GuardedMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for GuardedMap {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let slot = &TABLE[i];
            slot.start.store(0, Ordering::Release);
            slot.len.store(0, Ordering::Release);
            slot.claimed.store(false, Ordering::Release);
        }
        // `map` is unmapped after this, zero pages included.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file truncated under its map: reading past the new end no longer kills the process;
    /// the pages read as zeros and the map says it is damaged. (Without the handler this test
    /// dies of SIGBUS.)
    #[test]
    fn a_file_shrinking_under_its_map_is_reported_not_fatal() {
        let dir = std::env::temp_dir().join(format!("guarded-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let page = PAGE.load(Ordering::Relaxed).max(4096);
        std::fs::File::create(&path).unwrap().write_all(&vec![7u8; 4 * page]).unwrap();
        let file = File::open(&path).unwrap();
        let map = GuardedMap::map(&file).unwrap();
        let other = GuardedMap::map(&file).unwrap();
        assert_eq!(map[3 * page], 7);
        assert!(!map.damaged());
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(page as u64).unwrap();
        assert_eq!(map[0], 7, "the page still in the file reads as before");
        let tail = std::hint::black_box(&map[2 * page..3 * page]).iter().map(|&b| b as u64).sum::<u64>();
        assert_eq!(tail, 0, "a page past the end reads as zeros");
        assert!(map.damaged());
        assert!(!other.damaged(), "only the map that faulted is damaged");
        drop(map);
        drop(other);
        // A fresh map of the shrunk file is whole.
        let again = GuardedMap::map(&file).unwrap();
        assert_eq!(again.len(), page);
        assert!(!again.damaged());
        std::fs::remove_dir_all(&dir).ok();
    }
}
