//! The records of the blocks the front cache knows, in an arena that never moves: an entry's
//! memory stays valid for the life of the front, so a thread holding a stale index reads an
//! old value, never freed memory. Indices are recycled through a free list (taken on misses
//! only).
//!
//! An entry's `word` is the block's address with its state in the low bits (addresses are
//! 512-byte aligned): [`USER`] while the caller holds the block, [`CACHED`] while it waits in a
//! front cache, `0` while the entry is unused. A compare-and-swap on the whole word both checks
//! the address and claims the block, so a release racing a recycling of the entry for another
//! address fails instead of claiming the wrong block.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

use crate::driver::{DevicePtr, StreamHandle};

/// No entry: the end of a list.
pub const NIL: u32 = u32::MAX;
/// State bits of an entry's word: the caller holds the block.
pub const USER: u64 = 1;
/// State bits of an entry's word: the block waits in a front cache.
pub const CACHED: u64 = 2;

/// Entries an arena holds: blocks beyond them are not cached (they go to the pool).
pub const CAPACITY: usize = 1 << 20;
/// Entries made at once.
const CHUNK: usize = 1 << 12;
const CHUNKS: usize = CAPACITY / CHUNK;

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
    /// made on other threads).
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

/// The arena: up to [`CAPACITY`] entries in chunks of [`CHUNK`], each made when first needed.
pub struct Entries {
    /// Fixed sizes, so that [`Entries::get`] indexes them with no bounds check.
    chunks: Box<[OnceLock<Box<[Entry; CHUNK]>>; CHUNKS]>,
    /// Indices handed out so far, and the ones given back.
    alloc: Mutex<(u32, Vec<u32>)>,
}

impl Default for Entries {
    fn default() -> Self {
        let chunks: Box<[OnceLock<Box<[Entry; CHUNK]>>]> =
            (0..CHUNKS).map(|_| OnceLock::new()).collect();
        Entries {
            chunks: chunks
                .try_into()
                .unwrap_or_else(|_| unreachable!("CHUNKS chunks")),
            alloc: Mutex::new((0, Vec::new())),
        }
    }
}

impl Entries {
    /// The entry at `index`, which [`Entries::take`] has handed out at some time.
    #[inline]
    pub fn get(&self, index: u32) -> &Entry {
        // Indices handed out are below CAPACITY: the mask changes none of them.
        let chunk = self.chunks[index as usize / CHUNK % CHUNKS]
            .get()
            .expect("an index handed out by Entries::take");
        &chunk[index as usize % CHUNK]
    }

    /// An unused entry's index; `None` once all are in use.
    pub fn take(&self) -> Option<u32> {
        let mut alloc = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(index) = alloc.1.pop() {
            return Some(index);
        }
        let index = alloc.0;
        let chunk = self.chunks.get(index as usize / CHUNK)?;
        chunk.get_or_init(|| {
            let entries: Box<[Entry]> = (0..CHUNK).map(|_| Entry::default()).collect();
            entries
                .try_into()
                .unwrap_or_else(|_| unreachable!("CHUNK entries"))
        });
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
        // A second chunk starts where the first ends, its entries unused.
        for _ in 3..CHUNK as u32 + 1 {
            entries.take().unwrap();
        }
        assert_eq!(entries.take(), Some(CHUNK as u32 + 1));
        assert_eq!(entries.get(CHUNK as u32).word.load(Relaxed), 0);
    }
}
