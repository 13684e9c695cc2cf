//! The front cache: per-thread caches of released blocks ahead of the [`Pool`], so that the
//! common reserve-release-reserve of one size on one stream touches no lock and no cache line
//! another thread writes.
//!
//! A block released by the caller stays *live* to the pool and waits in a front cache, keyed
//! by device, stream and block size; the next reserve of that key on the same thread takes it
//! back with plain loads and stores inside the front's gate (`gate.rs`). Only the same stream
//! gets it, so stream-ordered reuse holds as in the pool: a block released on one stream
//! reaches another only through the pool, after that stream's work. A block released on
//! another thread than the one that reserved it goes to the reserving thread's remote list (as
//! mimalloc does). Blocks up to [`MAX_BLOCK`] are cached, up to a bound of bytes and blocks per
//! bin (see `thread.rs`); others go straight to the pool; so do blocks beyond the
//! `entries::CAPACITY` the front can know at once.
//!
//! Blocks come back to the pool (*drains*, each list taken whole with an atomic exchange while
//! the lists' owners are out of the gate, no lock per thread) on `free_reusable`, `warmup`,
//! `set_memory_limit`, `reset_peak_stats` and `trim` (another process sharing the device asks),
//! before a reserve that the pool could serve only from the driver (so the pool grows only after
//! the caches gave back what they held, and another stream's need is met from it), after an
//! out-of-memory with blocks cached, when a thread exits (its cache is handed back), and when
//! the front is dropped. A thread also gives back its own large blocks on a device and stream
//! before a large reserve there that its cache cannot serve, so that the pool places it as it
//! would with no front (see `Inner::miss`).
//!
//! Pointer checks stay as strict as the pool's: every block the front knows is in an
//! `map::AddressMap` read without a lock; a release of a block waiting in a cache is refused
//! with `RM_ERROR_INVALID_POINTER` and changes nothing, and any pointer the front does not
//! hold (unknown, interior) goes to the pool, which refuses it the same way.
//!
//! # Locks
//!
//! A hit, and a release into a cache, take no lock: plain loads and stores on lines only the
//! calling thread writes, and for a release one compare-and-swap on the block's record (a second
//! release fails there); a release from another thread adds one compare-and-swap on the owner's
//! remote list. A drain waits for the owners inside the gate to leave it (a few instructions);
//! no owner ever waits for a drain. Everything else calls the [`Pool`], which takes its own
//! locks as it always does, and takes the arena's free-list mutex (`entries.rs`) for a block
//! newly known or forgotten; the two are never held together, so no lock order is added.
//!
//! # Figures
//!
//! [`Front::stats`] and [`Front::mem_get_info`] count cached blocks as reusable; how, and when
//! they are exact, is in `figures.rs`.

mod bindings;
mod counters;
mod entries;
mod figures;
mod gate;
mod giveback;
mod map;
mod seats;
mod thread;

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;

use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::{Error, Result};
use crate::pool::size::SMALL_MAX;
use crate::pool::{Pool, Waits};
use crate::tls;
pub(crate) use bindings::forget_key;
use bindings::{Binding, Bindings};
use counters::{Counters, Delta};
use entries::{Entries, Entry, CACHED, NIL, USER};
use gate::Gate;
use giveback::Was;
use map::AddressMap;
use seats::Seats;
use thread::{Bin, Registry, ThreadCache};

/// The largest block size the front caches.
pub const MAX_BLOCK: u64 = 64 << 20;

/// A pool with per-thread front caches; safe to share between threads.
pub struct Front {
    inner: Arc<Inner>,
}

struct Inner {
    id: u64,
    pool: Pool,
    devices: u32,
    entries: Entries,
    map: AddressMap,
    threads: Registry,
    /// The threads' caches by thread pointer, for the exports' hit path.
    seats: Seats,
    /// Between the caches' owners and the drains.
    gate: Gate,
    /// Figures changed outside a thread's own calls (drains, exits), per device.
    shared: Box<[Counters]>,
}

/// The id of the next front: never reused, so that a thread's last front (`tls::Thread`) cannot name a
/// dropped front's successor at the same address.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Front {
    /// A front over `pool`.
    pub fn new(pool: Pool) -> Front {
        Front::with_gate(pool, Gate::new())
    }

    /// A front over `pool` whose caches' owners and drains meet at `gate` (the tests choose
    /// its fences).
    fn with_gate(pool: Pool, gate: Gate) -> Front {
        let devices = pool.device_count().max(0) as u32;
        Front {
            inner: Arc::new(Inner {
                id: NEXT_ID.fetch_add(1, Relaxed),
                devices,
                entries: Entries::default(),
                map: AddressMap::default(),
                threads: Registry::new(devices as usize),
                seats: Seats::default(),
                gate,
                shared: (0..devices).map(|_| Counters::default()).collect(),
                pool,
            }),
        }
    }

    /// How a hit fences against the drains, in words (see `gate.rs`).
    pub fn gate_mode(&self) -> &'static str {
        self.inner.gate.describe()
    }

    /// The pool underneath (calls on it bypass the front caches).
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// A block of at least `size` bytes on `device` for use on `stream`; `0` for size 0.
    #[inline]
    pub fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        self.reserve_as(device, size, stream, Waits::Allowed)
    }

    /// [`Front::reserve`] for a stream capturing a CUDA graph: see [`Pool::reserve_no_wait`].
    pub fn reserve_no_wait(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        self.reserve_as(device, size, stream, Waits::Never)
    }

    #[inline]
    fn reserve_as(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
        waits: Waits,
    ) -> Result<DevicePtr> {
        let inner = &self.inner;
        if size == 0 || device as u32 >= inner.devices {
            return inner.pool.reserve_as(device, size, stream, waits);
        }
        if size > MAX_BLOCK {
            // Not cached, but it may need what the caches hold.
            return inner.miss(device, size, 0, stream, waits);
        }
        let block = block_of(size);
        let hit = tls::with(|t| {
            inner.with_cache(t, |cache| {
                let bin = inner.bin_with_blocks(cache, device, stream, block)?;
                inner.pop(cache, bin, size)
            })
        });
        match hit.flatten() {
            Some(ptr) => Ok(ptr),
            None => inner.miss(device, size, block, stream, waits),
        }
    }

    /// The hit path of [`Front::reserve`] for a thread already seated in this front (see
    /// `seats.rs`): a block from the calling thread's own bin of `(device, stream, size)` when
    /// that is the key's home bin; `None`, with nothing changed, where the bin is empty or
    /// elsewhere (see [`Front::reserve_probed`]), or the thread has no seat, or the size is not
    /// cached. It makes no call, so that the exports' hit paths have none to save registers
    /// around (see `capi::hit`).
    #[inline(always)]
    pub(crate) fn reserve_hit(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
    ) -> Option<DevicePtr> {
        let inner = &*self.inner;
        let cache = inner.seats.get(tls::thread_key())?;
        // No device check: only the pool's devices are keyed, so no bin has another.
        if size.wrapping_sub(1) >= MAX_BLOCK {
            return None;
        }
        let bin = cache.home(device, stream, block_of(size))?;
        inner.pop(cache, bin, size)
    }

    /// [`Front::reserve_hit`] of a key displaced from its home bin, or of a thread with no seat
    /// (the hit path's miss, out of line): the probe for its bin, the thread seated if it can be.
    #[cold]
    #[inline(never)]
    pub(crate) fn reserve_probed(
        &self,
        t: &tls::Thread,
        device: i32,
        size: u64,
        stream: StreamHandle,
    ) -> Option<DevicePtr> {
        let inner = &*self.inner;
        let cache = inner.bound(t)?;
        inner.seat(cache);
        if size.wrapping_sub(1) >= MAX_BLOCK {
            return None;
        }
        let bin = cache.find(device, stream, block_of(size))?;
        inner.pop(cache, bin, size)
    }

    /// Give a block back; `0` does nothing. Unknown, interior and repeated releases fail with
    /// `RM_ERROR_INVALID_POINTER` and change nothing.
    #[inline]
    pub fn release(&self, ptr: DevicePtr) -> Result<()> {
        if ptr == 0 || self.release_hit(ptr) {
            return Ok(());
        }
        match tls::with(|t| self.release_known(t, ptr)) {
            Some(outcome) => outcome.map_err(|e| *e),
            None => self.inner.pool.release(ptr),
        }
    }

    /// The hit path of [`Front::release`] for a thread seated in this front: the caller's own
    /// block, used on its stream only, going back to the bin it was last cached in (named by the
    /// tag in its entry), which has room for it. `true` once it is cached there; `false`, with
    /// nothing changed, for anything else ([`Front::release_known`] then finds what to do). It
    /// makes no call, so that the exports' hit paths have none to save registers around (see
    /// `capi::hit`).
    #[inline(always)]
    pub(crate) fn release_hit(&self, ptr: DevicePtr) -> bool {
        let inner = &*self.inner;
        let Some(index) = inner.map.get(ptr) else {
            return false;
        };
        let e = inner.entries.get(index);
        let Some(cache) = inner.seats.get(tls::thread_key()) else {
            return false;
        };
        let bin = cache.tagged(e.bin.load(Relaxed));
        let Some(bin) = bin.filter(|bin| !e.shared.load(Relaxed) && bin.has_room()) else {
            return false;
        };
        let Some(owner) = cache.enter(&inner.gate) else {
            return false;
        };
        // Read before the block is cached: from then on its entry may be reused.
        let requested = e.requested.load(Relaxed);
        if e.word
            .compare_exchange(
                Entry::word_of(ptr, USER),
                Entry::word_of(ptr, CACHED),
                Acquire,
                Relaxed,
            )
            .is_err()
        {
            // Released already, or given back to the pool meanwhile.
            return false;
        }
        // The bin had room, and only its owner (this thread) adds to it: a drain meanwhile
        // only empties it, so the push cannot find it full.
        bin.push_with_room(&owner, index, e);
        bin.count_release(requested);
        true
    }

    /// [`Front::release`] of a block the front knows, past [`Front::release_hit`]: cached (in
    /// the caller's cache if it reserved the block, else in the reserving thread's remote list)
    /// or given to the pool, and a second release refused. `None`, with nothing changed, for a
    /// pointer the front does not hold for a caller: the pool knows what it is. (The error is
    /// boxed, so that the outcome fits in registers.)
    #[cold]
    #[inline(never)]
    pub(crate) fn release_known(
        &self,
        t: &tls::Thread,
        ptr: DevicePtr,
    ) -> Option<std::result::Result<(), Box<Error>>> {
        let inner = &self.inner;
        let index = inner.map.get(ptr)?;
        let e = inner.entries.get(index);
        match e.word.compare_exchange(
            Entry::word_of(ptr, USER),
            Entry::word_of(ptr, CACHED),
            Acquire,
            Acquire,
        ) {
            Ok(_) => {}
            Err(w) if w == Entry::word_of(ptr, CACHED) => return Some(Err(already_released(ptr))),
            // The entry was given back meanwhile: the pool knows what the pointer is.
            Err(_) => return None,
        }
        if e.shared.load(Relaxed) {
            return Some(inner.release_shared(index, ptr).map_err(Box::new));
        }
        let cached = match inner.bound(t) {
            Some(cache) => {
                inner.seat(cache);
                inner.cache_released(cache, index, e)
            }
            None => inner.cache_released_unbound(t, index, e),
        };
        if !cached {
            inner.evict(index, ptr, Was::Held);
        }
        Some(Ok(()))
    }

    /// Note that the live block at `ptr` is also used on `stream`: its release then goes to the
    /// pool, which orders its reuse after that stream's work.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let inner = &self.inner;
        let known = inner.map.get(ptr).map(|i| inner.entries.get(i));
        if let Some(e) = known {
            if e.word.load(Acquire) == Entry::word_of(ptr, CACHED) {
                return Err(*already_released(ptr));
            }
        }
        inner.pool.record_stream(ptr, stream)?;
        if let Some(e) = known {
            if e.word.load(Acquire) == Entry::word_of(ptr, USER) && e.stream.load(Relaxed) != stream
            {
                e.shared.store(true, Relaxed);
            }
        }
        Ok(())
    }

    /// Return every cached block to the pool, then idle memory to the driver (one device or
    /// all). Returns the bytes returned to the driver.
    pub fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        self.inner.drain();
        self.inner.pool.free_reusable(device)
    }

    /// Return idle memory of `device` to the driver up to `bytes`, at another process's request
    /// (see [`Pool::trim`]), cached blocks given back to the pool first.
    pub fn trim(&self, device: i32, bytes: u64) -> Result<u64> {
        self.inner.drain();
        self.inner.pool.trim(device, bytes)
    }

    /// Ensure at least `bytes` are reusable on `device`, cached blocks given back to the pool
    /// first. Returns the bytes newly allocated.
    pub fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        self.inner.drain();
        self.inner.pool.warmup(device, bytes)
    }

    /// Cap what the pool reserves (see [`Pool::set_memory_limit`]), cached blocks given back
    /// to the pool first so that idle memory above the cap can be returned.
    pub fn set_memory_limit(&self, device: Option<i32>, limit: Option<u64>) -> Result<u64> {
        self.inner.drain();
        self.inner.pool.set_memory_limit(device, limit)
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        self.inner.pool.driver()
    }

    /// Number of devices.
    pub fn device_count(&self) -> i32 {
        self.inner.pool.device_count()
    }

    /// The cap on `device`, if any.
    pub fn memory_limit(&self, device: i32) -> Result<Option<u64>> {
        self.inner.pool.memory_limit(device)
    }

    /// Set the peaks of `device` to the current values (cached blocks given back first, so
    /// that the peaks are the exact current figures).
    pub fn reset_peak_stats(&self, device: i32) -> Result<()> {
        self.inner.drain();
        self.inner.pool.reset_peak_stats(device)
    }

    /// Give every block waiting in a front cache back to the pool.
    pub fn drain(&self) {
        self.inner.drain();
    }

    /// Check the pool's books; a description of the first broken invariant.
    pub fn check(&self) -> std::result::Result<(), String> {
        self.inner.pool.check()
    }
}

/// The block size the front caches a request of `size` bytes in (1 to [`MAX_BLOCK`]).
#[inline(always)]
fn block_of(size: u64) -> u64 {
    (size + 511) & !511
}

#[cold]
#[inline(never)]
fn already_released(ptr: DevicePtr) -> Box<Error> {
    Box::new(Error::invalid_pointer(format!(
        "{ptr:#x} was already released (double release); the pool is unchanged (pass each \
         pointer from rm_reserve to rm_release once)"
    )))
}

/// A front dropped (with the last [`Front`]; the threads' bindings do not keep it) gives the
/// blocks its caches hold back to the pool, whose own drop then returns its cache to the driver.
impl Drop for Inner {
    fn drop(&mut self) {
        self.drain();
    }
}

impl Inner {
    /// The calling thread's cache in this front if the thread's last call was into it (the
    /// common case); else `None`, and [`Inner::with_cache`] binds it.
    #[inline(always)]
    fn bound(&self, t: &tls::Thread) -> Option<&ThreadCache> {
        let (id, cache) = t.front.get();
        // SAFETY: ids are never reused, so an id equal to this front's names a cache of this
        // very front, which the caller keeps alive for this call, and the cache lives in the
        // front's registry as long as the front.
        (id == self.id).then(|| unsafe { &*cache.cast::<ThreadCache>() })
    }

    /// Seat the calling thread, whose cache is `cache`, if it has no seat yet and its bucket has
    /// room (see `seats.rs`).
    fn seat(&self, cache: &ThreadCache) {
        self.seats.take(tls::thread_key(), cache);
    }

    /// Run `f` with the calling thread's cache in this front; `None` where it has none and can
    /// get none (every cache taken, or the thread is exiting).
    #[inline]
    fn with_cache<R>(
        self: &Arc<Self>,
        t: &tls::Thread,
        f: impl FnOnce(&ThreadCache) -> R,
    ) -> Option<R> {
        if let Some(cache) = self.bound(t) {
            return Some(f(cache));
        }
        bindings::with_bindings(|bindings| self.bind(t, bindings))
            .flatten()
            .map(f)
    }

    /// The calling thread's cache in this front, claimed on first use, noted in `t`.
    #[cold]
    fn bind<'a>(
        self: &'a Arc<Self>,
        t: &tls::Thread,
        bindings: &Bindings,
    ) -> Option<&'a ThreadCache> {
        let mut list = bindings.list.borrow_mut();
        // Fronts dropped since are forgotten here.
        list.retain(|b| b.front.strong_count() > 0);
        let found = list.iter().find(|b| b.id == self.id).map(|b| b.cache);
        let cache = match found {
            Some(index) => self.threads.get(index)?,
            None => {
                let cache = self.threads.claim()?;
                list.push(Binding {
                    front: Arc::downgrade(self),
                    id: self.id,
                    cache: cache.index,
                });
                cache
            }
        };
        t.front
            .set((self.id, (cache as *const ThreadCache).cast::<()>()));
        self.seat(cache);
        Some(cache)
    }

    /// The caller's bin of `(device, stream, block)` with blocks in it, after sorting in the
    /// blocks other threads released to it if the bin is empty.
    #[inline]
    fn bin_with_blocks<'a>(
        &self,
        cache: &'a ThreadCache,
        device: i32,
        stream: StreamHandle,
        block: u64,
    ) -> Option<&'a Bin> {
        let bin = cache.find(device, stream, block);
        if bin.is_some_and(|bin| !bin.is_empty()) || cache.remote.load(Relaxed) == NIL {
            return bin;
        }
        self.collect_remote(cache);
        cache.find(device, stream, block)
    }

    /// A block from `bin`, one of the bins of `cache`, the caller's, for a request of `size`
    /// bytes; `None` where it is empty or a drain is in flight.
    #[inline(always)]
    fn pop(&self, cache: &ThreadCache, bin: &Bin, size: u64) -> Option<DevicePtr> {
        let owner = cache.enter(&self.gate)?;
        let e = bin.pop(&owner, |first| self.entries.get(first))?;
        let ptr = e.ptr();
        e.requested.store(size, Relaxed);
        e.word.store(Entry::word_of(ptr, USER), Release);
        bin.count_hit(size);
        Some(ptr)
    }

    /// Put entry `e` (at `index`) first in `bin`, one of the bins of `cache`, the caller's;
    /// `false`, with nothing changed, where the bin is full or a drain is in flight.
    #[inline(always)]
    fn push(&self, cache: &ThreadCache, bin: &Bin, index: u32, e: &Entry) -> bool {
        cache
            .enter(&self.gate)
            .is_some_and(|owner| bin.push(&owner, index, e))
    }

    /// Put the block of entry `e` (at `index`), just claimed from its caller, in a cache: the
    /// caller's own if it reserved the block, else the reserving thread's remote list. `false`
    /// where it does not fit (the caller then gives it to the pool).
    ///
    /// The common case, the caller's own block going back to the bin it was last cached in,
    /// finds that bin from the tag noted in the entry; anything else is [`Inner::rebin`]'s.
    #[inline(always)]
    fn cache_released(&self, cache: &ThreadCache, index: u32, e: &Entry) -> bool {
        let requested = e.requested.load(Relaxed);
        let Some(bin) = cache.tagged(e.bin.load(Relaxed)) else {
            return self.rebin(cache, index, e, requested);
        };
        if !self.push(cache, bin, index, e) {
            return false;
        }
        bin.count_release(requested);
        true
    }

    /// [`Inner::cache_released`] of a block whose bin is not the one its entry names: the
    /// caller's bin of its key (keyed now if needed, its tag noted in the entry) if the caller
    /// reserved it, else the reserving thread's remote list.
    #[inline(never)]
    fn rebin(&self, cache: &ThreadCache, index: u32, e: &Entry, requested: u64) -> bool {
        let (owner, device, stream, size) = (
            e.owner.load(Relaxed),
            e.device.load(Relaxed),
            e.stream.load(Relaxed),
            e.size.load(Relaxed),
        );
        if owner != cache.index {
            let Some(owner) = self.threads.get(owner) else {
                return false;
            };
            ThreadCache::push_remote(&owner.remote, index, e);
            // Counted here while it waits in the remote list (the owner may take it at once:
            // only values read above count).
            cache.counters[device as usize].add_owned(Delta {
                cached_bytes: size as i64,
                cached_blocks: 1,
                requested: -(requested as i64),
                hits: 0,
            });
            return true;
        }
        let Some(bin) = cache
            .find_or_key(device, stream, size)
            .or_else(|| self.make_room(cache, device, stream, size))
        else {
            return false;
        };
        e.bin.store(bin.tag(), Relaxed);
        if !self.push(cache, bin, index, e) {
            return false;
        }
        bin.count_release(requested);
        true
    }

    /// [`Inner::cache_released`] by a thread whose last call was not into this front: its
    /// cache bound first.
    #[cold]
    #[inline(never)]
    fn cache_released_unbound(self: &Arc<Self>, t: &tls::Thread, index: u32, e: &Entry) -> bool {
        self.with_cache(t, |cache| self.cache_released(cache, index, e)) == Some(true)
    }

    /// A bin for a key none of `cache`'s bins holds when every bin it may use holds blocks of
    /// other keys: the emptiest of them gives its blocks back to the pool and takes the new key,
    /// so that a thread cycling through more keys than it has bins keeps its newest cached.
    #[cold]
    fn make_room<'a>(
        &self,
        cache: &'a ThreadCache,
        device: i32,
        stream: StreamHandle,
        size: u64,
    ) -> Option<&'a Bin> {
        self.evict_list(cache.emptiest(device, stream, size).take(), Was::InBin);
        cache.find_or_key(device, stream, size)
    }

    /// Sort the blocks other threads released to `cache` into its bins.
    fn collect_remote(&self, cache: &ThreadCache) {
        let mut index = cache.remote.swap(NIL, Acquire);
        while index != NIL {
            let e = self.entries.get(index);
            let next = e.next.load(Relaxed);
            let size = e.size.load(Relaxed);
            let (device, stream) = (e.device.load(Relaxed), e.stream.load(Relaxed));
            let bin = cache
                .find_or_key(device, stream, size)
                .or_else(|| self.make_room(cache, device, stream, size));
            if let Some(bin) = bin {
                e.bin.store(bin.tag(), Relaxed);
            }
            if bin.is_some_and(|bin| self.push(cache, bin, index, e)) {
                // Counted by its bin from now on, no longer as waiting in a remote list.
                cache.counters[device as usize].add_owned(Delta {
                    cached_bytes: -(size as i64),
                    cached_blocks: -1,
                    ..Delta::default()
                });
            } else {
                self.evict(index, e.ptr(), Was::InRemote);
            }
            index = next;
        }
    }

    /// A reserve no front cache could serve: from the pool's memory (for a large request, after
    /// the calling thread gave back its large blocks on the device and stream); else, after
    /// every cache gave back what it holds, from the driver. The block is noted for caching
    /// unless `block` is 0.
    ///
    /// The first give-back keeps the front from costing memory. A block waiting in a bin is
    /// live to the pool: the pool's best fit cannot choose it, nor merge it with its free
    /// neighbours, so a request of another size splits a larger block instead, and the cache
    /// fragments. On generated workloads the front then needed more memory than PyTorch's
    /// policy about twice as often as the pool alone; with the give-back, about as often
    /// (BENCHMARKS.md, "Generated workloads"). Only blocks the request could be placed among
    /// go back: the same stream's (another stream's wait for the next growth, which drains
    /// every cache), and large ones. Small requests have segments of their own, 2 MiB each, so
    /// small blocks waiting cost little memory; they miss often (a decoding step's sizes vary),
    /// and giving back at each of their misses emptied the bins the next requests would hit:
    /// 17,575 of a decoding workload's 25,000 reserves missed, against 202 now.
    fn miss(
        self: &Arc<Self>,
        device: i32,
        size: u64,
        block: u64,
        stream: StreamHandle,
        waits: Waits,
    ) -> Result<DevicePtr> {
        // A large request (its block over SMALL_MAX: the bound is a multiple of the block
        // rounding, so the size's side is the block's).
        if size > SMALL_MAX {
            tls::with(|t| self.with_cache(t, |cache| self.give_back_large(cache, device, stream)));
        }
        let ptr = match self.pool.reserve_cached(device, size, stream, waits)? {
            Some(ptr) => ptr,
            None => {
                if self.sum(device).cached_blocks != 0 {
                    self.drain();
                }
                match self.pool.reserve_as(device, size, stream, waits) {
                    // Blocks cached by other threads meanwhile may be what is missing.
                    Err(e) if e.is_out_of_memory() && self.sum(device).cached_blocks != 0 => {
                        self.drain();
                        self.pool.reserve_as(device, size, stream, waits)?
                    }
                    result => result?,
                }
            }
        };
        if block != 0 {
            self.register(ptr, device, stream, block, size);
        }
        Ok(ptr)
    }

    /// Note a block just reserved from the pool, held by the caller, so that its release can
    /// be cached. A block that cannot be noted is simply released to the pool later.
    fn register(
        self: &Arc<Self>,
        ptr: DevicePtr,
        device: i32,
        stream: StreamHandle,
        block: u64,
        size: u64,
    ) {
        if ptr >= map::LIMIT {
            return;
        }
        let Some(owner) = tls::with(|t| self.with_cache(t, |cache| cache.index)) else {
            return;
        };
        let Some(index) = self.entries.take() else {
            return;
        };
        let e = self.entries.get(index);
        e.fill(owner, device, stream, block, size);
        e.word.store(Entry::word_of(ptr, USER), Release);
        self.map.set(ptr, index);
    }
}

#[cfg(test)]
mod tests;
