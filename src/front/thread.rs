//! One thread's cache and the registry of them all.
//!
//! A thread cache has [`BINS`] bins, each a LIFO list of entries of one device, stream and
//! block size, and a *remote* list that other threads push the blocks they release to (the
//! owner sorts them into its bins when a bin runs dry). A bin's list is one word, its head and
//! its length, so that its bound costs no other write. Each keying of a bin gets a *tag*
//! naming the cache, the bin's slot and the keying; an entry notes the tag of the bin it was
//! last cached in, so that its next release by the same thread finds the bin from the tag
//! alone (no key compared) while the bin still holds that key. Only the owner pushes to and
//! pops from its bins, with plain loads and stores, inside the front's gate (`gate.rs`): a
//! drain takes a bin's list (an exchange of the word) only while the owner is outside. Other
//! threads push to the remote list with a compare-and-swap and the owner takes it whole with an
//! exchange.
//!
//! A cache outlives its thread: at exit its blocks go back to the pool and the record is marked
//! dead, to be adopted by a later thread; blocks released to it after that wait in its remote
//! list for the adopter or the next drain.

use std::sync::atomic::{
    AtomicBool, AtomicI64, AtomicU32, AtomicU64,
    Ordering::{Acquire, Relaxed, Release, SeqCst},
};
use std::sync::OnceLock;

use super::counters::{Counters, Delta};
use super::entries::{Entry, NIL};
use super::gate::{Gate, Owner};
use crate::driver::StreamHandle;
use crate::pool::size::SMALL_MAX;

/// Bins per thread cache: distinct (device, stream, size) keys it can hold at once.
pub const BINS: usize = 64;
/// Bins looked at for a key before giving up.
const PROBE: usize = 8;
/// The most bytes a bin holds (one block more where a block is larger); beyond it releases go
/// to the pool. A thread cache holds at most [`BINS`] times this, and gives it all back before
/// the pool would grow.
pub const MAX_BIN_BYTES: u64 = 256 << 20;
/// The most blocks a bin holds.
pub const MAX_BIN_BLOCKS: u32 = 1024;
/// Thread caches a front keeps; threads beyond them use the pool directly.
pub const MAX_THREADS: usize = 1024;
// A bin's tag holds its slot in 6 bits and its cache's index in 10 (see `ThreadCache::tagged`).
const _: () = assert!(BINS == 1 << 6 && MAX_THREADS <= 1 << 10);

/// One LIFO list of blocks of one key. A cache line each, so that no two threads' bins share
/// one. Laid out so that bytes 12 to 15 of the line hold nothing: see [`Busy`].
#[repr(C, align(64))]
pub struct Bin {
    /// Its device and block size, as [`key_of`] packs them; 0 (size 0): the bin has no key.
    key: AtomicU64,
    /// The most blocks it holds, from [`MAX_BIN_BLOCKS`] and [`MAX_BIN_BYTES`] (set with the key).
    cap: AtomicU32,
    stream: AtomicU64,
    /// This keying's tag (see [`ThreadCache::tagged`]); [`UNKEYED`] before the first.
    tag: AtomicU64,
    /// The list: its length in the high half, its first entry (or [`NIL`]) in the low half.
    list: AtomicU64,
    /// Reserves it served since keyed (owner only; folded into the cache's counters when
    /// re-keyed).
    hits: AtomicU64,
    /// What its pops and pushes since keyed change in the requested bytes (owner only; folded
    /// likewise): the callers' requests of the blocks it handed out less those it took back.
    requested: AtomicI64,
}

/// A cache's flag for the gate (`gate.rs`), which its owner sets and clears around every hit,
/// alone on its line at byte 12. A load waits behind an earlier store to the same offset
/// within a page (the CPU matches them by the low 12 bits of their addresses at first), so the
/// flag sits where the hit paths load nothing: bytes 12 to 15 of a bin are padding, and of a
/// block's record (`entries::Entry`) the thread cache's index, which they do not read.
#[repr(C, align(64))]
pub struct Busy {
    _before: [u8; 12],
    pub flag: AtomicBool,
}

impl Default for Busy {
    fn default() -> Self {
        Busy {
            _before: [0; 12],
            flag: AtomicBool::new(false),
        }
    }
}

const _: () = assert!(std::mem::offset_of!(Busy, flag) == 12);
const _: () = assert!(std::mem::offset_of!(Bin, cap) + 4 == 12);
const _: () = assert!(std::mem::offset_of!(Bin, stream) == 16);
const _: () = assert!(std::mem::size_of::<Bin>() == 64);

/// A bin's device and block size (a multiple of 512, below 2 TiB) in one word, so that a key
/// is compared in two: the device in the high half, the size in 512-byte units in the low.
#[inline(always)]
fn key_of(device: i32, size: u64) -> u64 {
    debug_assert!(size % 512 == 0 && size >> 41 == 0);
    (device as u32 as u64) << 32 | size >> 9
}

/// The tag of a bin never keyed, which no entry holds.
const UNKEYED: u64 = u64::MAX;

/// The most blocks of `size` bytes a bin holds: as many as [`MAX_BIN_BYTES`] takes, at most
/// [`MAX_BIN_BLOCKS`], at least one.
fn cap_of(size: u64) -> u32 {
    (MAX_BIN_BYTES / size.max(1)).clamp(1, MAX_BIN_BLOCKS as u64) as u32
}

/// The word of an empty list.
const EMPTY: u64 = NIL as u64;

fn head(list: u64) -> u32 {
    list as u32
}

fn length(list: u64) -> u32 {
    (list >> 32) as u32
}

impl Default for Bin {
    fn default() -> Self {
        Bin {
            key: AtomicU64::new(0),
            stream: AtomicU64::new(0),
            cap: AtomicU32::new(0),
            tag: AtomicU64::new(UNKEYED),
            list: AtomicU64::new(EMPTY),
            hits: AtomicU64::new(0),
            requested: AtomicI64::new(0),
        }
    }
}

impl Bin {
    #[inline(always)]
    fn is(&self, device: i32, stream: StreamHandle, size: u64) -> bool {
        self.key.load(Relaxed) == key_of(device, size) && self.stream.load(Relaxed) == stream
    }

    /// Whether it holds blocks over [`SMALL_MAX`] for `stream` on `device`: blocks a large
    /// reserve on that stream may be placed among in the pool.
    pub fn holds_large_for(&self, device: i32, stream: StreamHandle) -> bool {
        self.holds() > SMALL_MAX && self.on(device) && self.stream.load(Relaxed) == stream
    }

    /// The device of its key.
    pub fn device(&self) -> i32 {
        (self.key.load(Relaxed) >> 32) as i32
    }

    /// The block size of its key.
    fn size(&self) -> u64 {
        (self.key.load(Relaxed) as u32 as u64) << 9
    }

    /// Whether its key is on `device`.
    pub fn on(&self, device: i32) -> bool {
        self.device() == device
    }

    /// The block size of the blocks it holds now; 0 when it holds none.
    pub fn holds(&self) -> u64 {
        if self.is_empty() {
            0
        } else {
            self.size()
        }
    }

    /// Count a reserve it served, of `requested` bytes (owner only: a plain load and store).
    #[inline(always)]
    pub fn count_hit(&self, requested: u64) {
        self.hits
            .store(self.hits.load(Relaxed).wrapping_add(1), Relaxed);
        self.count_requested(requested as i64);
    }

    /// Count a release into it of a block last reserved for `requested` bytes (owner only).
    #[inline(always)]
    pub fn count_release(&self, requested: u64) {
        self.count_requested((requested as i64).wrapping_neg());
    }

    #[inline(always)]
    fn count_requested(&self, change: i64) {
        let now = self.requested.load(Relaxed).wrapping_add(change);
        self.requested.store(now, Relaxed);
    }

    /// What it changes in its device's figures now: its blocks, cached, and its counts.
    pub fn figures(&self) -> Delta {
        let blocks = length(self.list.load(Relaxed)) as i64;
        Delta {
            cached_bytes: blocks.wrapping_mul(self.size() as i64),
            cached_blocks: blocks,
            requested: self.requested.load(Relaxed),
            hits: self.hits.load(Relaxed) as i64,
        }
    }

    /// Its counts, leaving zeros (owner only).
    pub fn take_counts(&self) -> Delta {
        let d = Delta {
            requested: self.requested.load(Relaxed),
            hits: self.hits.load(Relaxed) as i64,
            ..Delta::default()
        };
        self.requested.store(0, Relaxed);
        self.hits.store(0, Relaxed);
        d
    }

    /// Whether it holds no block.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        head(self.list.load(Relaxed)) == NIL
    }

    /// Take its first entry (its owner only, inside the gate: see [`Owner`]), `entry` finding an
    /// entry by index; `None` when it is empty.
    #[inline(always)]
    pub fn pop<'e>(&self, _: &Owner, entry: impl FnOnce(u32) -> &'e Entry) -> Option<&'e Entry> {
        let list = self.list.load(Relaxed);
        let first = head(list);
        if first == NIL {
            return None;
        }
        let e = entry(first);
        // One block fewer (it holds `first`, so at least one), the next entry first.
        let rest = u64::from(length(list).wrapping_sub(1)) << 32 | u64::from(e.next.load(Relaxed));
        self.list.store(rest, Relaxed);
        Some(e)
    }

    /// Its tag: which keying of which bin it is (see [`ThreadCache::tagged`]).
    #[inline(always)]
    pub fn tag(&self) -> u64 {
        self.tag.load(Relaxed)
    }

    /// Put entry `e`, at `index`, of a block of the bin's size first (its owner only, inside the
    /// gate); `false`, with nothing changed, when the bin is full.
    #[inline(always)]
    pub fn push(&self, owner: &Owner, index: u32, e: &Entry) -> bool {
        if !self.has_room() {
            return false;
        }
        self.push_with_room(owner, index, e);
        true
    }

    /// Whether it has room for one more block.
    #[inline(always)]
    pub fn has_room(&self) -> bool {
        length(self.list.load(Relaxed)) < self.cap.load(Relaxed)
    }

    /// [`Bin::push`] where [`Bin::has_room`] said so since the owner last added to it (only
    /// the owner adds; a drain only empties it).
    #[inline(always)]
    pub fn push_with_room(&self, _: &Owner, index: u32, e: &Entry) {
        let list = self.list.load(Relaxed);
        e.next.store(head(list), Relaxed);
        self.list
            .store(((length(list) as u64 + 1) << 32) | index as u64, Relaxed);
    }

    /// Take the whole list (a drain with the owner out of the gate, or the owner): its first
    /// entry, or [`NIL`].
    pub fn take(&self) -> u32 {
        head(self.list.swap(EMPTY, Acquire))
    }
}

/// One thread's cache (its own cache lines: see [`Bin`] and [`Counters`]; the remote list,
/// which other threads write, on a line of its own).
#[repr(align(64))]
pub struct ThreadCache {
    pub index: u32,
    alive: AtomicBool,
    /// Its owner is inside the front's gate (see `gate.rs`).
    pub busy: Busy,
    /// Keyings of its bins so far (owner only), for their tags.
    keyings: AtomicU64,
    /// The bins keyed for blocks over [`SMALL_MAX`], a bit per slot (owner only): where a large
    /// miss looks for blocks to give back, so that a miss looks at no bin where there are none.
    large: AtomicU64,
    /// A fixed number, in the cache itself, so that a bin's slot indexes them with no bounds
    /// check and no load of where they are.
    pub bins: [Bin; BINS],
    pub remote: Line<AtomicU32>,
    /// The figures this thread changed that its bins do not hold, per device: the blocks it
    /// pushed onto remote lists (see [`super::counters`]) and the counts of re-keyed bins.
    pub counters: Box<[Counters]>,
}

/// The home slot of a key: the top bits of its words mixed by a multiplication.
#[inline(always)]
pub(super) fn slot_of(device: i32, stream: StreamHandle, size: u64) -> usize {
    let h = (key_of(device, size) ^ stream).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 58) as usize
}

/// A value on a cache line of its own.
#[repr(align(64))]
pub struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl ThreadCache {
    fn new(index: u32, devices: usize) -> ThreadCache {
        ThreadCache {
            index,
            alive: AtomicBool::new(true),
            busy: Busy::default(),
            keyings: AtomicU64::new(0),
            large: AtomicU64::new(0),
            bins: std::array::from_fn(|_| Bin::default()),
            remote: Line(AtomicU32::new(NIL)),
            counters: (0..devices).map(|_| Counters::default()).collect(),
        }
    }

    /// Enter `gate` as this cache's owner (see `gate.rs`); `None` while a drain is in flight.
    #[inline(always)]
    pub fn enter(&self, gate: &Gate) -> Option<Owner<'_>> {
        gate.enter(&self.busy.flag)
    }

    /// The bin holding `(device, stream, size)`, if any (owner only).
    #[inline(always)]
    pub fn find(&self, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        // The key's own bin, where it almost always is, before the probe.
        self.home(device, stream, size)
            .or_else(|| self.probe(slot_of(device, stream, size), device, stream, size))
    }

    /// The bin holding `(device, stream, size)` if it is the key's home bin, the first that
    /// [`ThreadCache::find`] looks at (owner only).
    #[inline(always)]
    pub fn home(&self, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        let home = &self.bins[slot_of(device, stream, size)];
        home.is(device, stream, size).then_some(home)
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

    /// The rest of [`ThreadCache::find_or_key`]: key an empty bin, with a new tag.
    #[cold]
    fn key(&self, device: i32, stream: StreamHandle, size: u64) -> Option<&Bin> {
        let start = slot_of(device, stream, size);
        let slot = (0..PROBE)
            .map(|i| (start + i) % BINS)
            .find(|&slot| self.bins[slot].is_empty())?;
        let bin = &self.bins[slot];
        // Only the owner pushes, so an empty bin stays empty while it is re-keyed. Its counts
        // were of its old key's device: they go to the cache's counters of that device.
        if bin.tag() != UNKEYED {
            let old = bin.device() as usize;
            self.counters[old].add_owned(bin.take_counts());
        }
        bin.key.store(key_of(device, size), Relaxed);
        bin.stream.store(stream, Relaxed);
        bin.cap.store(cap_of(size), Relaxed);
        let keyings = self.keyings.load(Relaxed) + 1;
        self.keyings.store(keyings, Relaxed);
        let large = self.large.load(Relaxed) & !(1 << slot);
        self.large
            .store(large | u64::from(size > SMALL_MAX) << slot, Relaxed);
        bin.tag.store(
            keyings << 16 | (self.index as u64) << 6 | slot as u64,
            Relaxed,
        );
        Some(bin)
    }

    /// The bins keyed for blocks over [`SMALL_MAX`] (owner only).
    pub fn large_bins(&self) -> impl Iterator<Item = &Bin> {
        let mut bits = self.large.load(Relaxed);
        std::iter::from_fn(move || {
            let slot = bits.trailing_zeros() as usize;
            bits &= bits.wrapping_sub(1);
            self.bins.get(slot)
        })
    }

    /// The bin whose tag is `tag`, if it still is (owner only). A tag is the bin's keying
    /// (counted from 1 in its cache) over the cache's index (10 bits, [`MAX_THREADS`]) over
    /// its slot (6 bits, [`BINS`]): unique to one key of one bin of one cache for the life of
    /// the front, so a bin re-keyed since, or a bin of another cache, does not match; and
    /// never 0, the tag of no bin.
    #[inline(always)]
    pub fn tagged(&self, tag: u64) -> Option<&Bin> {
        let bin = &self.bins[(tag % BINS as u64) as usize];
        (bin.tag() == tag).then_some(bin)
    }

    /// The bin with the fewest blocks among those `(device, stream, size)` may use (owner
    /// only): the one to empty when none is free for a new key.
    pub fn emptiest(&self, device: i32, stream: StreamHandle, size: u64) -> &Bin {
        let start = slot_of(device, stream, size);
        (0..PROBE)
            .map(|i| &self.bins[(start + i) % BINS])
            .min_by_key(|bin| length(bin.list.load(Relaxed)))
            .unwrap_or(&self.bins[start])
    }

    /// Push entry `e`, at `index`, onto the remote list `list` (its `next` is written here),
    /// which others push to and the owner exchanges.
    #[inline]
    pub fn push_remote(list: &AtomicU32, index: u32, e: &Entry) {
        let mut head = list.load(Relaxed);
        loop {
            e.next.store(head, Relaxed);
            match list.compare_exchange_weak(head, index, Release, Relaxed) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Mark the cache free for another thread (its owner has exited, having given back its
    /// blocks and folded its figures into the shared set: a retired cache changes no figure).
    pub fn retire(&self) {
        self.alive.store(false, Release);
    }

    /// Whether a thread uses it (else it is retired, and changes no figure).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Acquire)
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
        // SeqCst: a drain that reads the count after its barrier and misses this cache has its
        // own count seen by this cache's owner (see `gate.rs`).
        let index = self.count.fetch_add(1, SeqCst);
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
        let gate = Gate::with_fences(true);
        let o = cache.enter(&gate).unwrap();
        assert!(cache.find(0, 7, 512).is_none());
        let bin = cache.find_or_key(0, 7, 512).unwrap() as *const Bin;
        let i = entries.take().unwrap();
        assert!(cache.find(0, 7, 512).unwrap().push(&o, i, entries.get(i)));
        assert_eq!(cache.find(0, 7, 512).unwrap() as *const Bin, bin);
        assert_eq!(cache.find(0, 7, 512).unwrap().holds(), 512);
        assert!(cache.find(0, 8, 512).is_none());
        assert!(cache.find(1, 7, 512).is_none());
        // An empty bin keeps its key until re-keyed; another key takes another bin.
        let bin = cache.find(0, 7, 512).unwrap();
        let popped = bin.pop(&o, |i| entries.get(i)).unwrap();
        assert!(std::ptr::eq(popped, entries.get(i)));
        assert!(bin.pop(&o, |_| unreachable!()).is_none());
        assert_eq!(bin.holds(), 0);
        assert!(!cache.find_or_key(0, 7, 1024).unwrap().is(0, 7, 512));
    }

    #[test]
    fn the_bins_keyed_for_large_blocks_are_known_without_a_look_at_the_others() {
        let cache = ThreadCache::new(0, 1);
        assert_eq!(cache.large_bins().count(), 0);
        let small = cache.find_or_key(0, 7, SMALL_MAX).unwrap() as *const Bin;
        let large = cache.find_or_key(0, 7, SMALL_MAX + 512).unwrap() as *const Bin;
        let larger = cache.find_or_key(0, 8, 64 << 20).unwrap() as *const Bin;
        let mut keyed: Vec<*const Bin> = cache.large_bins().map(|b| b as *const Bin).collect();
        let mut expected = vec![large, larger];
        keyed.sort();
        expected.sort();
        assert_eq!(keyed, expected);
        assert!(!keyed.contains(&small));
        // Empty, the large bins are keyed again for small blocks when their keys' homes need
        // them, and then are no longer among the large ones.
        for size in (1..=SMALL_MAX / 512).map(|k| k * 512) {
            for stream in 0..4 {
                let _ = cache.find_or_key(0, stream, size);
            }
        }
        let left: Vec<*const Bin> = cache.large_bins().map(|b| b as *const Bin).collect();
        for bin in cache.large_bins() {
            assert!(bin.size() > SMALL_MAX);
        }
        assert!(left.len() <= 2);
        assert_eq!(
            cache.bins.iter().filter(|b| b.size() > SMALL_MAX).count(),
            left.len()
        );
    }

    #[test]
    fn a_bin_is_bounded_in_blocks_and_bytes_and_a_drain_takes_it_whole() {
        let cache = ThreadCache::new(0, 1);
        let entries = Entries::default();
        let gate = Gate::with_fences(true);
        let o = cache.enter(&gate).unwrap();
        let bin = cache.find_or_key(0, 7, 512).unwrap();
        let mut pushed = Vec::new();
        loop {
            let i = entries.take().unwrap();
            if !bin.push(&o, i, entries.get(i)) {
                break;
            }
            pushed.push(i);
        }
        assert_eq!(pushed.len(), MAX_BIN_BLOCKS as usize);
        // LIFO, the list taken whole, then empty.
        let mut taken = Vec::new();
        let mut at = bin.take();
        while at != NIL {
            taken.push(at);
            at = entries.get(at).next.load(Relaxed);
        }
        pushed.reverse();
        assert_eq!(taken, pushed);
        assert!(bin.is_empty());
        // Bytes: one block over the bound always fits; a second only within it.
        let big = cache.find_or_key(0, 7, MAX_BIN_BYTES * 2).unwrap();
        let (a, b) = (entries.take().unwrap(), entries.take().unwrap());
        assert!(big.push(&o, a, entries.get(a)));
        assert!(!big.push(&o, b, entries.get(b)));
        let half = cache.find_or_key(0, 7, MAX_BIN_BYTES / 2).unwrap();
        assert!(half.push(&o, b, entries.get(b)));
        let c = entries.take().unwrap();
        assert!(half.push(&o, c, entries.get(c)));
        let d = entries.take().unwrap();
        assert!(!half.push(&o, d, entries.get(d)));
    }

    #[test]
    fn a_tag_names_one_keying_of_one_bin_of_one_cache() {
        let (a, b) = (ThreadCache::new(0, 1), ThreadCache::new(1, 1));
        let entries = Entries::default();
        let gate = Gate::with_fences(true);
        let o = a.enter(&gate).unwrap();
        let first = a.find_or_key(0, 7, 512).unwrap();
        let tag = first.tag();
        assert!(std::ptr::eq(a.tagged(tag).unwrap(), first));
        // No entry's "none", and not the same bin of another cache.
        assert!(a.tagged(0).is_none());
        let other = b.find_or_key(0, 7, 512).unwrap();
        assert_ne!(other.tag(), tag);
        assert!(b.tagged(tag).is_none());
        // Counted in the bin: its blocks and hits and requested bytes.
        let i = entries.take().unwrap();
        assert!(first.push(&o, i, entries.get(i)));
        first.count_release(300);
        let d = first.figures();
        assert_eq!(
            (d.cached_bytes, d.cached_blocks, d.requested, d.hits),
            (512, 1, -300, 0)
        );
        assert!(first.pop(&o, |i| entries.get(i)).is_some());
        first.count_hit(200);
        let d = first.figures();
        assert_eq!(
            (d.cached_bytes, d.cached_blocks, d.requested, d.hits),
            (0, 0, -100, 1)
        );
        // Re-keyed (empty) for another key sharing its home slot: a new tag, the old one
        // names nothing, and the counts went to the cache's counters of the old device.
        let home = slot_of(0, 7, 512);
        let stream = (8..).find(|&s| slot_of(0, s, 512) == home).unwrap();
        let second = a.find_or_key(0, stream, 512).unwrap();
        assert!(std::ptr::eq(second, first));
        assert_ne!(second.tag(), tag);
        assert!(a.tagged(tag).is_none());
        assert!(std::ptr::eq(a.tagged(second.tag()).unwrap(), second));
        assert_eq!(second.figures(), Delta::default());
        let folded = a.counters[0].read();
        assert_eq!((folded.requested, folded.hits), (-100, 1));
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
