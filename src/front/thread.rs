//! One thread's cache and the registry of them all.
//!
//! A thread cache has [`BINS`] bins, each a LIFO list of entries of one device, stream and
//! block size, and a *remote* list that other threads push the blocks they release to (the
//! owner sorts them into its bins when a bin runs dry). Only the owner pushes to its bins, so a
//! pop is one compare-and-swap that can fail only when a drain has just taken the list (an
//! exchange of the head): no ABA, no lock. Other threads push to the remote list with a
//! compare-and-swap and the owner takes it whole with an exchange.
//!
//! A cache outlives its thread: at exit its blocks go back to the pool and the record is marked
//! dead, to be adopted by a later thread; blocks released to it after that wait in its remote
//! list for the adopter or the next drain.

use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicU32, AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::OnceLock;

use super::counters::Counters;
use super::entries::{Entry, NIL};
use crate::driver::StreamHandle;

/// Bins per thread cache: distinct (device, stream, size) keys it can hold at once.
pub const BINS: usize = 64;
/// Bins looked at for a key before giving up.
const PROBE: usize = 8;
/// The most bytes a thread cache holds in its bins; beyond it releases go to the pool.
pub const MAX_HELD_BYTES: u64 = 256 << 20;
/// The most blocks a thread cache holds in its bins.
pub const MAX_HELD_BLOCKS: u64 = 4096;
/// Thread caches a front keeps; threads beyond them use the pool directly.
pub const MAX_THREADS: usize = 1024;

/// One LIFO list of blocks of one key. `size` 0: the bin has no key. A cache line each, so
/// that no two threads' bins share one.
#[derive(Default)]
#[repr(align(64))]
pub struct Bin {
    device: AtomicI32,
    stream: AtomicU64,
    size: AtomicU64,
    pub head: AtomicU32,
}

impl Bin {
    fn is(&self, device: i32, stream: StreamHandle, size: u64) -> bool {
        self.size.load(Relaxed) == size
            && self.stream.load(Relaxed) == stream
            && self.device.load(Relaxed) == device
    }

    /// Whether its key is on `device`.
    pub fn on(&self, device: i32) -> bool {
        self.device.load(Relaxed) == device
    }

    /// The block size of the blocks it holds now; 0 when it holds none.
    pub fn holds(&self) -> u64 {
        if self.head.load(Relaxed) == NIL {
            0
        } else {
            self.size.load(Relaxed)
        }
    }
}

/// One thread's cache (its own cache lines: see [`Bin`] and [`Counters`]).
#[repr(align(64))]
pub struct ThreadCache {
    pub index: u32,
    alive: AtomicBool,
    /// A fixed number, so that a bin's slot indexes them with no bounds check.
    pub bins: Box<[Bin; BINS]>,
    pub remote: AtomicU32,
    /// The figures this thread changed, per device.
    pub counters: Box<[Counters]>,
    /// Bytes and blocks the owner put in its bins, less what it took out (owner-written).
    held_bytes: AtomicU64,
    held_blocks: AtomicU64,
    /// Bytes and blocks drains took from its bins (written by drains).
    drained_bytes: AtomicU64,
    drained_blocks: AtomicU64,
}

fn slot_of(device: i32, stream: StreamHandle, size: u64) -> usize {
    let h = (stream ^ (size >> 9).rotate_left(29) ^ (device as u64).rotate_left(53))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 58) as usize
}

/// [`BINS`] bins with no key.
fn bins() -> Box<[Bin; BINS]> {
    let bins: Box<[Bin]> = (0..BINS)
        .map(|_| Bin {
            head: AtomicU32::new(NIL),
            ..Bin::default()
        })
        .collect();
    bins.try_into()
        .unwrap_or_else(|_| unreachable!("BINS bins"))
}

impl ThreadCache {
    fn new(index: u32, devices: usize) -> ThreadCache {
        ThreadCache {
            index,
            alive: AtomicBool::new(true),
            bins: bins(),
            remote: AtomicU32::new(NIL),
            counters: (0..devices).map(|_| Counters::default()).collect(),
            held_bytes: AtomicU64::new(0),
            held_blocks: AtomicU64::new(0),
            drained_bytes: AtomicU64::new(0),
            drained_blocks: AtomicU64::new(0),
        }
    }

    /// The bin holding `(device, stream, size)`, if any (owner only).
    #[inline(always)]
    pub fn find(&self, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        let start = slot_of(device, stream, size);
        // The key's own bin, where it almost always is, before the probe.
        let home = &self.bins[start];
        if home.is(device, stream, size) {
            return Some(home);
        }
        self.probe(start, device, stream, size)
    }

    /// The rest of [`ThreadCache::find`]: the bins after the key's own.
    #[inline(never)]
    fn probe(&self, start: usize, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        (1..PROBE)
            .map(|i| &self.bins[(start + i) % BINS])
            .find(|bin| bin.is(device, stream, size))
    }

    /// The bin for `(device, stream, size)`, keying an empty one if there is none yet (owner
    /// only); `None` when every bin it may use holds other keys' blocks.
    #[inline(always)]
    pub fn find_or_key(&self, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        if let Some(bin) = self.find(device, stream, size) {
            return Some(bin);
        }
        self.key(device, stream, size)
    }

    /// The rest of [`ThreadCache::find_or_key`]: key an empty bin.
    #[cold]
    fn key(&self, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        let start = slot_of(device, stream, size);
        let bin = (0..PROBE)
            .map(|i| &self.bins[(start + i) % BINS])
            .find(|bin| bin.head.load(Acquire) == NIL)?;
        // Only the owner pushes, so an empty bin stays empty while it is re-keyed.
        bin.device.store(device, Relaxed);
        bin.stream.store(stream, Relaxed);
        bin.size.store(size, Relaxed);
        Some(bin)
    }

    /// Whether one more block of `size` bytes stays under the bounds (owner only).
    #[inline]
    pub fn has_room(&self, size: u64) -> bool {
        let bytes = self.held_bytes.load(Relaxed) - self.drained_bytes.load(Relaxed);
        let blocks = self.held_blocks.load(Relaxed) - self.drained_blocks.load(Relaxed);
        bytes + size <= MAX_HELD_BYTES && blocks < MAX_HELD_BLOCKS
    }

    /// Count a block into (`+1`) or out of (`-1`) the bins (owner only).
    #[inline]
    pub fn hold(&self, size: u64, sign: i64) {
        let (bytes, blocks) = if sign > 0 {
            (size, 1)
        } else {
            (size.wrapping_neg(), u64::MAX)
        };
        let b = self.held_bytes.load(Relaxed).wrapping_add(bytes);
        self.held_bytes.store(b, Relaxed);
        let n = self.held_blocks.load(Relaxed).wrapping_add(blocks);
        self.held_blocks.store(n, Relaxed);
    }

    /// Count blocks a drain took from the bins.
    pub fn drained(&self, bytes: u64, blocks: u64) {
        self.drained_bytes.fetch_add(bytes, Relaxed);
        self.drained_blocks.fetch_add(blocks, Relaxed);
    }

    /// Push entry `e`, at `index`, onto `list` (its `next` is written here), which others may
    /// exchange.
    #[inline]
    pub fn push(list: &AtomicU32, index: u32, e: &Entry) {
        let mut head = list.load(Relaxed);
        loop {
            e.next.store(head, Relaxed);
            match list.compare_exchange_weak(head, index, Release, Relaxed) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Mark the cache free for another thread (its owner has exited).
    pub fn retire(&self) {
        self.alive.store(false, Release);
    }
}

/// Every thread cache of one front.
pub struct Registry {
    caches: Box<[OnceLock<ThreadCache>]>,
    count: AtomicU32,
    devices: usize,
}

impl Registry {
    /// No caches yet; each will count figures for `devices` devices.
    pub fn new(devices: usize) -> Registry {
        Registry {
            caches: (0..MAX_THREADS).map(|_| OnceLock::new()).collect(),
            count: AtomicU32::new(0),
            devices,
        }
    }

    /// A cache for the calling thread: a retired one, else a new one; `None` when all
    /// [`MAX_THREADS`] are in use.
    pub fn claim(&self) -> Option<&ThreadCache> {
        if let Some(cache) = self.iter().find(|c| {
            c.alive
                .compare_exchange(false, true, Acquire, Relaxed)
                .is_ok()
        }) {
            return Some(cache);
        }
        let index = self.count.fetch_add(1, Relaxed);
        if index as usize >= MAX_THREADS {
            self.count.fetch_sub(1, Relaxed);
            return None;
        }
        Some(self.caches[index as usize].get_or_init(|| ThreadCache::new(index, self.devices)))
    }

    /// The cache at `index`.
    #[inline]
    pub fn get(&self, index: u32) -> Option<&ThreadCache> {
        self.caches.get(index as usize)?.get()
    }

    /// Every cache made so far, live or retired.
    pub fn iter(&self) -> impl Iterator<Item = &ThreadCache> {
        let n = (self.count.load(Acquire) as usize).min(MAX_THREADS);
        self.caches[..n].iter().filter_map(OnceLock::get)
    }
}

#[cfg(test)]
mod tests {
    use super::super::entries::Entries;
    use super::*;

    #[test]
    fn bins_are_keyed_and_bounded() {
        let cache = ThreadCache::new(0, 1);
        let entries = Entries::default();
        assert!(cache.find(0, 7, 512).is_none());
        let bin = cache.find_or_key(0, 7, 512).unwrap() as *const Bin;
        let i = entries.take().unwrap();
        ThreadCache::push(&cache.find(0, 7, 512).unwrap().head, i, entries.get(i));
        assert_eq!(cache.find(0, 7, 512).unwrap() as *const Bin, bin);
        assert_eq!(cache.find(0, 7, 512).unwrap().holds(), 512);
        assert!(cache.find(0, 8, 512).is_none());
        assert!(cache.find(1, 7, 512).is_none());
        // Room: bytes and blocks, less what drains took.
        assert!(cache.has_room(MAX_HELD_BYTES));
        cache.hold(MAX_HELD_BYTES, 1);
        assert!(!cache.has_room(512));
        cache.drained(512, 1);
        assert!(cache.has_room(512));
        assert!(!cache.has_room(1024));
        cache.hold(MAX_HELD_BYTES, -1);
    }

    #[test]
    fn retired_caches_are_adopted_before_new_ones() {
        let registry = Registry::new(1);
        let a = registry.claim().unwrap().index;
        let b = registry.claim().unwrap().index;
        assert_eq!((a, b), (0, 1));
        registry.get(a).unwrap().retire();
        assert_eq!(registry.claim().unwrap().index, a);
        assert_eq!(registry.claim().unwrap().index, 2);
        assert_eq!(registry.iter().count(), 3);
    }
}
