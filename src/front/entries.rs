//! The records of the blocks the front cache knows, in an arena that never moves: an entry's
//! memory stays valid for the life of the front, so a thread holding a stale index reads an
//! old value, never freed memory. Indices are recycled through a free list (taken on misses
//! only). The arena is one mapping of zeroed memory for all [`CAPACITY`] entries, made with the
//! front: an entry is found from its index with one addition, and the system gives a page of
//! it memory only when an entry on it is first written.
//!
//! An entry's `word` is the block's address with its state in the low bits (addresses are
//! 512-byte aligned): [`USER`] while the caller holds the block, [`CACHED`] while it waits in a
//! front cache, `0` while the entry is unused. A compare-and-swap on the whole word both checks
//! the address and claims the block, so a release racing a recycling of the entry for another
//! address fails instead of claiming the wrong block.

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::driver::{DevicePtr, StreamHandle};

/// No entry: the end of a list.
pub const NIL: u32 = u32::MAX;
/// State bits of an entry's word: the caller holds the block.
pub const USER: u64 = 1;
/// State bits of an entry's word: the block waits in a front cache.
pub const CACHED: u64 = 2;

/// Entries an arena holds: blocks beyond them are not cached (they go to the pool). Fewer under
/// Miri, whose interpreter would take hours over the test that hands out every one.
pub const CAPACITY: usize = if cfg!(miri) { 1 << 12 } else { 1 << 20 };

/// One block the front cache knows, on a cache line of its own: entries of blocks that
/// different threads use never share one.
#[derive(Default)]
#[repr(C, align(64))]
pub struct Entry {
    /// The address and the state (see the module's documentation).
    pub word: AtomicU64,
    /// The next entry in the list this one is on.
    pub next: AtomicU32,
    /// The thread cache that reserved the block from the pool (its remote list takes releases
    /// made on other threads). At bytes 12 to 15, which the hit paths do not read: see
    /// `thread::Busy`.
    pub owner: AtomicU32,
    pub device: AtomicI32,
    /// Used on another stream too (`record_stream`): its release goes to the pool, which
    /// orders its reuse after that stream's work.
    pub shared: AtomicBool,
    pub stream: AtomicU64,
    /// Block size (a multiple of 512).
    pub size: AtomicU64,
    /// Bytes the pool counts as requested for the block (the request it was reserved for).
    pub pool_requested: AtomicU64,
    /// Bytes the caller asked for when it last reserved the block.
    pub requested: AtomicU64,
    /// The tag of the owner's bin it was last cached in (`thread::ThreadCache::tagged`);
    /// 0: none yet.
    pub bin: AtomicU64,
}

// One cache line each (the fields above fill it).
const _: () = assert!(std::mem::size_of::<Entry>() == 64);
const _: () = assert!(std::mem::offset_of!(Entry, owner) == 12);

impl Entry {
    /// The word for `ptr` in `state`.
    pub fn word_of(ptr: DevicePtr, state: u64) -> u64 {
        ptr | state
    }

    /// The block's address.
    pub fn ptr(&self) -> DevicePtr {
        self.word.load(Relaxed) & !(USER | CACHED)
    }

    /// Fill a fresh entry for a block just reserved from the pool (held by the caller); its
    /// word is set last, by the caller.
    pub fn fill(&self, owner: u32, device: i32, stream: StreamHandle, size: u64, requested: u64) {
        self.owner.store(owner, Relaxed);
        self.device.store(device, Relaxed);
        self.stream.store(stream, Relaxed);
        self.size.store(size, Relaxed);
        self.pool_requested.store(requested, Relaxed);
        self.requested.store(requested, Relaxed);
        self.shared.store(false, Relaxed);
        self.bin.store(0, Relaxed);
        self.next.store(NIL, Relaxed);
    }
}

/// The arena: [`CAPACITY`] entries, all zero bytes at first (unused entries: every field of an
/// entry is an atomic, for which zero is a valid value).
pub struct Entries {
    all: NonNull<[Entry; CAPACITY]>,
    /// Made with `mmap` (else with the allocator, which writes every page at once).
    mapped: bool,
    /// Indices handed out so far, and the ones given back.
    alloc: Mutex<(u32, Vec<u32>)>,
}

// SAFETY: the arena is owned by `Entries` and only ever reached as shared `&Entry`s, and `Entry`
// (atomics only) is `Sync`.
unsafe impl Send for Entries {}
// SAFETY: as above.
unsafe impl Sync for Entries {}

impl Default for Entries {
    fn default() -> Self {
        let layout = Layout::new::<[Entry; CAPACITY]>();
        // SAFETY: a new private anonymous mapping, at no address of ours; it reads as zeros.
        let mapped = unsafe {
            libc::mmap(
                ptr::null_mut(),
                layout.size(),
                libc::PROT_READ | libc::PROT_WRITE,
                // No swap reserved for pages never touched; Miri runs only private anonymous
                // mappings, so its checks run without the flag.
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | if cfg!(miri) { 0 } else { libc::MAP_NORESERVE },
                -1,
                0,
            )
        };
        let (all, mapped) = if mapped == libc::MAP_FAILED {
            // SAFETY: the layout's size is not zero.
            (unsafe { alloc::alloc_zeroed(layout) }, false)
        } else {
            (mapped.cast::<u8>(), true)
        };
        // `mmap` aligns to pages, more than an entry's 64 bytes.
        let Some(all) = NonNull::new(all.cast::<[Entry; CAPACITY]>()) else {
            alloc::handle_alloc_error(layout)
        };
        Entries {
            all,
            mapped,
            alloc: Mutex::new((0, Vec::new())),
        }
    }
}

impl Drop for Entries {
    fn drop(&mut self) {
        let layout = Layout::new::<[Entry; CAPACITY]>();
        let all = self.all.as_ptr().cast::<u8>();
        if self.mapped {
            // SAFETY: the mapping made in `default`, of this size, no longer referenced (`&mut`).
            unsafe { libc::munmap(all.cast(), layout.size()) };
        } else {
            // SAFETY: allocated in `default` with this layout, no longer referenced.
            unsafe { alloc::dealloc(all, layout) };
        }
    }
}

impl Entries {
    /// The entry at `index`, which [`Entries::take`] has handed out at some time.
    #[inline(always)]
    pub fn get(&self, index: u32) -> &Entry {
        // SAFETY: `all` is valid, zeroed or written only through shared atomics, for as long as
        // `self` lives.
        let all = unsafe { self.all.as_ref() };
        // Indices handed out are below CAPACITY: the mask changes none of them.
        &all[index as usize % CAPACITY]
    }

    /// An unused entry's index; `None` once all are in use.
    pub fn take(&self) -> Option<u32> {
        let mut alloc = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(index) = alloc.1.pop() {
            return Some(index);
        }
        let index = alloc.0;
        if index as usize >= CAPACITY {
            return None;
        }
        alloc.0 += 1;
        Some(index)
    }

    /// Give an entry back for reuse; its word must already be `0`.
    pub fn put(&self, index: u32) {
        self.alloc
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .push(index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_recycled_and_entries_stay_put() {
        let entries = Entries::default();
        let (a, b) = (entries.take().unwrap(), entries.take().unwrap());
        assert_eq!((a, b), (0, 1));
        entries
            .get(a)
            .word
            .store(Entry::word_of(0x7000, USER), Relaxed);
        assert_eq!(entries.get(a).ptr(), 0x7000);
        entries.get(a).word.store(0, Relaxed);
        entries.put(a);
        assert_eq!(entries.take(), Some(0));
        assert_eq!(entries.take(), Some(2));
        // Every entry up to CAPACITY is handed out once, unused (all zero) and writable, then
        // none: the last one is at the end of the arena.
        for i in 3..CAPACITY as u32 {
            assert_eq!(entries.take(), Some(i));
        }
        assert_eq!(entries.take(), None);
        let last = entries.get(CAPACITY as u32 - 1);
        assert_eq!((last.word.load(Relaxed), last.bin.load(Relaxed)), (0, 0));
        last.word.store(Entry::word_of(0x7000, CACHED), Relaxed);
        assert_eq!(last.ptr(), 0x7000);
        entries.put(CAPACITY as u32 - 1);
        assert_eq!(entries.take(), Some(CAPACITY as u32 - 1));
    }
}
