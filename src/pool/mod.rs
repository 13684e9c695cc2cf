//! The caching pool: pure logic over the [`Driver`] trait. It never calls CUDA directly and never
//! reads the environment; everything it needs comes in through [`Pool::new`].
//!
//! - `size`: rounding and the small/large classes;
//! - `blocks`: the block arena with address-neighbour links;
//! - `ids`: typed indexes of blocks, segments, stream slots and idle places, and the tables
//!   they index;
//! - `bins`: the best-fit free-block index, by (size, address);
//! - `device`: one device's books and the reserved-reuse policy (`device/stitch.rs`: the
//!   page-granular reuse of the virtual-memory mode; `device/unstitch.rs`: taking its segments
//!   apart; `device/phys.rs`: its physical handles);
//! - `stats`: the figures `rm_get_stats` reports;
//! - `spans`: the lock-free map from a 2 MiB span of addresses to the shard whose segments
//!   touch it, which finds a pointer's shard for `release`;
//! - `probe` (only with the cargo feature `hold-probe`, for `scripts/bench-pauses.sh`): the
//!   timing of each hold of a device's lock by [`Pool::free_reusable`];
//! - `shards`: a device's books in shards by stream, and which shard serves a stream;
//! - this module: the multi-device [`Pool`], one lock per shard.
//!
//! # Locks
//!
//! Each shard's books sit behind their own `Mutex`; the only other lock is each device's claim
//! lock (`stats.rs`), a leaf. So no cycle (and no deadlock) is possible:
//!
//! 1. at most one shard mutex at a time: calls over a device's shards ([`Pool::free_reusable`],
//!    [`Pool::set_memory_limit`], the figures, a reserve returning the other shards' cache) and
//!    over every device take them one after the other, releasing each before the next (and
//!    `free_reusable` releases it between batches of its work too), and so do a release whose
//!    shard the span map cannot tell and a device's first reserve, once it holds none, giving
//!    the other devices' ranges access to it (`peers.rs`);
//! 2. the span map and each shard's published commitment are written with atomic operations
//!    while its mutex is held and read without a lock; under a cap, a shard checks the cap and
//!    publishes its claim of room with its device's claim lock held too, taken under the shard
//!    mutex and let go before anything else is locked or called (no driver call under it);
//!    [`Pool::set_memory_limit`] takes it alone, to set the device's cap, before it goes over
//!    the shards;
//! 3. the driver is called with a shard's mutex held, save by `free_reusable` and `trim`,
//!    which wait for the device's work before they take the mutex, by `free_reusable`'s
//!    calls that return memory, made after each batch has let go of it (`device/deferred.rs`),
//!    and by `reserve` and `warmup`, whose calls that create and map memory, and the waits for
//!    the device's work that cached memory needs, are made between passes under the mutex
//!    (`device/growing.rs`); the driver takes no lock of the pool and
//!    never calls back into it (the simulator's own mutex is a leaf).
//!
//! `release` and `record_stream` read the span map *before* taking a shard mutex. A mutex
//! poisoned by a panic is taken over (see `Pool::lock_shard`).

// Public: what the command and the PyTorch-policy baseline use (sizes and their printing, the
// integer map, the figures). The rest is the pool's own business.
pub(crate) mod bins;
pub(crate) mod blocks;
pub(crate) mod device;
pub(crate) mod hash;
pub(crate) mod ids;
pub mod layout;
mod peers;
#[cfg(feature = "hold-probe")]
mod probe;
mod shards;
pub(crate) mod size;
pub(crate) mod spans;
pub(crate) mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::{rm_status, Error, Result};
pub(crate) use device::Waits;
use device::{DevicePool, Pass, Sweep};
pub use layout::Layout;
pub use shards::SHARDS;
use shards::{Binding, Books, Shard};
use spans::{Owner, Spans};
pub use stats::Stats;
use stats::WholeDevice;

/// The most idle segments (and handles) [`Pool::free_reusable`] takes out of the books per hold
/// of a device's lock, for the driver calls made after it.
pub const FREE_BATCH: usize = 32;

/// The time after which a batch of [`Pool::free_reusable`] stops early (checked after each
/// segment), so that no hold of the lock runs long however much bookkeeping a segment takes
/// (a lender's pages merging back, a pending block's events asked about): the calls that
/// return memory are made between batches.
const BATCH_TIME: Duration = Duration::from_micros(20);

/// The passes of a reserve or warm-up that may defer their driver calls until the device's lock
/// is let go (`device/growing.rs`): a wait for the device's work, the unmaps of the idle ranges
/// it made way for, then a growth; a later pass makes its calls under the lock.
const DEFERRING_PASSES: usize = 3;

/// The longest [`Pool::free_reusable`] waits, between batches, for blocked threads to take the
/// device's lock.
const WAITERS_GRACE: Duration = Duration::from_micros(200);

/// Settings of the pool (from `RESMEM_CONF`, parsed elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Return idle segments to the driver before growing when the driver's free memory is short
    /// of a new segment (step 3 of the policy). Default: on.
    pub release_before_grow: bool,
    /// Write a line to standard error on every segment the pool allocates or returns, and on
    /// out-of-memory. Default: off.
    pub logging: bool,
    /// Build segments from physical memory mapped with the CUDA virtual-memory API, so that a
    /// request can use cached pages wherever they lie (page-granular reuse, see
    /// `device/stitch.rs`). Devices or drivers without the API keep classic segments.
    /// Default: on.
    pub vmm: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            release_before_grow: true,
            logging: false,
            vmm: true,
        }
    }
}

/// What a device pool needs from outside while it works.
pub(crate) struct Context<'a> {
    driver: &'a dyn Driver,
    spans: &'a Spans,
    /// The shards of the pool's device, and which of them this is.
    shards: &'a [Shard],
    own: usize,
}

impl Context<'_> {
    /// What the device's other shards reserve and are creating, as of the end of their last
    /// holds: counted against a cap on the device.
    pub(crate) fn reserved_elsewhere(&self) -> u64 {
        self.elsewhere(|shard| &shard.committed)
    }

    /// What the device's other shards reserve and no live block holds, as of the end of their
    /// last holds: counted by a warm-up as reusable already.
    pub(crate) fn reusable_elsewhere(&self) -> u64 {
        self.elsewhere(|shard| &shard.reusable)
    }

    /// Publish what this shard now reserves and is creating (`DevicePool::committed`) at once,
    /// rather than when its lock is let go: a claim of room under a cap (`DevicePool::claim`).
    pub(crate) fn publish_committed(&self, committed: u64) {
        self.shards[self.own]
            .committed
            .store(committed, Ordering::Relaxed);
    }

    fn elsewhere(&self, figure: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .enumerate()
            .filter(|&(k, _)| k != self.own)
            .map(|(_, shard)| figure(shard).load(Ordering::Relaxed))
            .sum()
    }
}

/// The pool of every device, safe to share between threads.
pub struct Pool {
    driver: Arc<dyn Driver>,
    /// [`SHARDS`] per device, device by device (`shards.rs`).
    shards: Box<[Shard]>,
    /// Per device, which shard serves each stream.
    bindings: Box<[Binding]>,
    /// Per device, what its shards share: what they reserve together and the peak of that, the
    /// cap, the claim lock.
    reserved: Box<[Arc<WholeDevice>]>,
    spans: Spans,
}

/// A pool dropped (the library unloaded, a pool a Rust program or the command made) gives its
/// cache back to the driver as [`Pool::free_reusable`] does (after the devices' work), and its
/// events, so that loading and unloading the library in a loop leaves nothing behind. Blocks
/// still live stay the driver's, and so do the segments holding them: their users may still
/// use them. Failures are ignored: there is no caller left to tell.
impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.free_reusable(None);
        for index in 0..self.shards.len() {
            let (mut pool, cx) = self.lock_shard(index);
            pool.destroy_events(&cx);
        }
    }
}

/// What [`Pool::mem_get_info_capped`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// As [`Pool::mem_get_info`].
    pub free: u64,
    pub total: u64,
    /// Where the device has a cap: the cap and the bytes allocated.
    pub cap: Option<(u64, u64)>,
}

impl Pool {
    /// A pool over every device `driver` sees.
    pub fn new(driver: Arc<dyn Driver>, config: PoolConfig) -> Pool {
        let devices = driver.device_count().max(0);
        let reserved: Box<[Arc<WholeDevice>]> = (0..devices).map(|_| Arc::default()).collect();
        let shards: Box<[Shard]> = (0..devices)
            .flat_map(|device| (0..SHARDS).map(move |k| (device, k)))
            .map(|(device, k)| {
                let owner = device * SHARDS as i32 + k as i32;
                let reserved = Arc::clone(&reserved[device as usize]);
                Shard::new(DevicePool::new(device, owner, config, reserved))
            })
            .collect();
        Pool {
            driver,
            shards,
            reserved,
            bindings: (0..devices).map(|_| Binding::default()).collect(),
            // With one device, pointers in no recorded segment are shard 0's: its segments
            // (all a pool whose calls never contended has) cost no entries.
            spans: if devices > 1 {
                Spans::default()
            } else {
                Spans::except(0)
            },
        }
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// Number of devices.
    pub fn device_count(&self) -> i32 {
        self.bindings.len() as i32
    }

    /// The index of `device` among the devices, or the error naming the ordinals there are.
    #[inline]
    fn device_index(&self, device: i32) -> Result<usize> {
        // A negative ordinal is a large unsigned one.
        match device as u32 as usize {
            d if d < self.bindings.len() => Ok(d),
            _ => Err(self.invalid_device(device)),
        }
    }

    /// The indexes of `device` (checked), or (`None`) of every device.
    fn devices(&self, device: Option<i32>) -> Result<std::ops::Range<usize>> {
        match device {
            Some(d) => self.device_index(d).map(|d| d..d + 1),
            None => Ok(0..self.bindings.len()),
        }
    }

    /// The indexes of `device`'s shards that may hold memory.
    fn opened_shards(&self, d: usize) -> std::ops::Range<usize> {
        d * SHARDS..d * SHARDS + self.bindings[d].opened()
    }

    /// Shard `index`'s books, locked. A lock poisoned by a panic is taken over: every book is
    /// updated only after the driver call it depends on succeeded.
    fn lock_shard(&self, index: usize) -> (Books<'_>, Context<'_>) {
        let shard = &self.shards[index];
        (Books::new(self.take(shard), shard), self.context(index))
    }

    /// `shard`'s lock, taken at once where it is free.
    #[inline]
    fn take<'a>(&self, shard: &'a Shard) -> MutexGuard<'a, DevicePool> {
        match shard.books.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => self.wait_for(shard),
        }
    }

    /// Run `f` on shard `index`'s books under its lock (all of it inlined where the calls that
    /// hit the pool come: nothing returned through memory).
    #[inline]
    fn with_shard<T>(&self, index: usize, f: impl FnOnce(&mut DevicePool, &Context<'_>) -> T) -> T {
        let shard = &self.shards[index];
        let mut books = Books::new(self.take(shard), shard);
        f(&mut books, &self.context(index))
    }

    /// `shard`'s lock, waiting for it (counted among its waiters meanwhile).
    #[cold]
    fn wait_for<'a>(&self, shard: &'a Shard) -> MutexGuard<'a, DevicePool> {
        shard.waiting.fetch_add(1, Ordering::Relaxed);
        let guard = shard.books.lock().unwrap_or_else(|e| e.into_inner());
        shard.waiting.fetch_sub(1, Ordering::Relaxed);
        guard
    }

    #[inline]
    fn context(&self, index: usize) -> Context<'_> {
        let first = index - index % SHARDS;
        Context {
            driver: &*self.driver,
            spans: &self.spans,
            shards: &self.shards[first..first + SHARDS],
            own: index % SHARDS,
        }
    }

    /// `device`'s first shard, locked: the one a pool whose calls never contended uses alone.
    fn lock(&self, device: i32) -> Result<(Books<'_>, Context<'_>)> {
        let d = self.device_index(device)?;
        Ok(self.lock_shard(d * SHARDS))
    }

    /// The shard serving `stream` on `device`, locked, and its index. Where another thread
    /// holds its lock, the stream moves to a shard of its own if it may (`shards.rs`).
    #[inline]
    fn lock_stream(
        &self,
        device: i32,
        stream: StreamHandle,
    ) -> Result<(usize, MutexGuard<'_, DevicePool>)> {
        let d = self.device_index(device)?;
        let binding = &self.bindings[d];
        let k = binding.shard(stream);
        let index = d * SHARDS + k;
        Ok(match self.shards[index].books.try_lock() {
            Ok(guard) => (index, guard),
            Err(TryLockError::Poisoned(e)) => (index, e.into_inner()),
            Err(TryLockError::WouldBlock) => self.contended(d, k, stream),
        })
    }

    /// `stream`'s shard `k` of device `d` is locked by another thread: its shard now, locked.
    /// Once the lock is its, a stream that owns no segment there (nothing it would leave behind)
    /// moves to a shard of its own if it may (`shards.rs`).
    #[cold]
    fn contended(
        &self,
        d: usize,
        k: usize,
        stream: StreamHandle,
    ) -> (usize, MutexGuard<'_, DevicePool>) {
        let index = d * SHARDS + k;
        let guard = self.wait_for(&self.shards[index]);
        match self.leave(d, k, stream, &guard) {
            None => (index, guard),
            Some(to) => {
                drop(guard);
                let index = d * SHARDS + to;
                (index, self.take(&self.shards[index]))
            }
        }
    }

    /// `stream`, served by shard `k` of device `d` whose books `pool` are (locked), moves to
    /// a shard of its own where it may and owns no segment in `k`: its new shard.
    fn leave(&self, d: usize, k: usize, stream: StreamHandle, pool: &DevicePool) -> Option<usize> {
        if k != 0 || pool.holds_stream(stream) {
            return None;
        }
        self.bindings[d].move_contended(stream, k)
    }

    /// Move `stream` on `device` to a shard of its own, as a reserve that finds another thread
    /// in its shard does (where it owns no memory there): for tests that exercise a device's
    /// shards without racing threads. Whether it moved.
    #[doc(hidden)]
    pub fn own_shard(&self, device: i32, stream: StreamHandle) -> Result<bool> {
        let d = self.device_index(device)?;
        let k = self.bindings[d].shard(stream);
        let (pool, _) = self.lock_shard(d * SHARDS + k);
        Ok(self.leave(d, k, stream, &pool).is_some())
    }

    #[cold]
    fn invalid_device(&self, device: i32) -> Error {
        let seen = match self.bindings.len() {
            0 => "no devices".to_string(),
            1 => "1 device (ordinal 0)".to_string(),
            n => format!("{n} devices (ordinals 0 to {})", n - 1),
        };
        Error::new(
            rm_status::RM_ERROR_INVALID_DEVICE,
            format!(
                "device {device} is out of range: this process sees {seen} through {}",
                self.driver.describe()
            ),
        )
    }

    /// A block of at least `size` bytes on `device` for use on `stream`; `0` for size 0.
    /// Where the stream's shard runs out of memory while the device's other shards hold idle
    /// cache, that cache goes back to the driver and the request runs once more, as PyTorch's
    /// policy returns every stream's cache before it fails.
    pub fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        self.reserve_as(device, size, stream, Waits::Allowed)
    }

    /// [`Pool::reserve`] for a stream that is capturing a CUDA graph (or while any stream of the
    /// device captures): it never waits for the device's work (`cuCtxSynchronize`,
    /// `cuEventSynchronize`, `cuEventQuery`, `cuMemFree`) nor orders `stream` after another
    /// stream's (`cuStreamWaitEvent`), which the driver refuses during a capture, invalidating
    /// it. So it takes only what needs neither: the stream's own cached blocks, idle segments
    /// whose work is known done (released before the last wait for the device), and new memory
    /// (as PyTorch's allocator serves a capture: from the graph's pool or `cudaMalloc`). No
    /// cache goes back to the driver to make room: past the driver's memory or the cap it fails
    /// with an out-of-memory error.
    pub fn reserve_no_wait(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        self.reserve_as(device, size, stream, Waits::Never)
    }

    /// [`Pool::reserve`] or [`Pool::reserve_no_wait`], as `waits` says.
    pub(crate) fn reserve_as(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
        waits: Waits,
    ) -> Result<DevicePtr> {
        if size == 0 {
            return self.device_index(device).map(|_| 0);
        }
        let f = |pool: &mut DevicePool, cx: &Context<'_>| pool.reserve_as(cx, size, stream, waits);
        let (index, guard) = self.lock_stream(device, stream)?;
        let books = Books::new(guard, &self.shards[index]);
        let err = match self.unlocked_growth(index, books, self.context(index), f) {
            Err(err) if err.is_out_of_memory() && waits == Waits::Allowed => err,
            done => return self.introduced(index / SHARDS, done),
        };
        if self.free_other_shards(index)? == 0 {
            return Err(err);
        }
        // Tried again, the request counts as failed only if the second try fails.
        let (mut books, cx) = self.lock_shard(index);
        books.forgive_oom();
        let done = self.unlocked_growth(index, books, cx, f);
        self.introduced(index / SHARDS, done)
    }

    /// Return the idle cache of the shards of shard `index`'s device other than it; the bytes
    /// returned.
    fn free_other_shards(&self, index: usize) -> Result<u64> {
        let d = index / SHARDS;
        let mut total = 0;
        for other in self.opened_shards(d).filter(|&i| i != index) {
            total += self.free_shard(other)?;
        }
        Ok(total)
    }

    /// Run `f` on shard `index`'s pool, locked in `books`, making the driver calls a growth
    /// needs without the lock: a pass defers them, they are made once the lock is let go, and
    /// the next pass takes what they made (`device/growing.rs`).
    fn unlocked_growth<T>(
        &self,
        index: usize,
        mut books: Books<'_>,
        cx: Context<'_>,
        f: impl Fn(&mut DevicePool, &Context<'_>) -> Result<T>,
    ) -> Result<T> {
        let mut plan = match books.deferring(&cx, |pool| f(pool, &cx)) {
            Pass::Done(done) => return done,
            Pass::Grow(plan) => plan,
        };
        drop(books);
        // A pass may defer again what the last one's calls made way for (a growth once a wait
        // for the device is done); the last pass makes its calls under the lock.
        for pass in 2.. {
            let made = plan.make(&*self.driver);
            let (mut books, cx) = self.lock_shard(index);
            let defer = pass <= DEFERRING_PASSES;
            plan = match books.prepared(&cx, plan, made, defer, |pool| f(pool, &cx)) {
                Pass::Done(done) => return done,
                Pass::Grow(plan) => plan,
            };
        }
        unreachable!("the last pass defers nothing")
    }

    /// Like [`Pool::reserve`] (or [`Pool::reserve_no_wait`], as `waits` says), but only from
    /// memory the pool already holds: `None` (and nothing counted) where the request would need
    /// the driver. Size 0 is `Some(0)`.
    pub(crate) fn reserve_cached(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
        waits: Waits,
    ) -> Result<Option<DevicePtr>> {
        if size == 0 {
            return self.device_index(device).map(|_| Some(0));
        }
        let (index, guard) = self.lock_stream(device, stream)?;
        let mut books = Books::new(guard, &self.shards[index]);
        let done = books.reserve_cached(&self.context(index), size, stream, waits);
        drop(books);
        self.introduced(index / SHARDS, done)
    }

    /// Give a block back to the pool. `0` is accepted and does nothing.
    pub fn release(&self, ptr: DevicePtr) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.on_shard_of(ptr, |pool, cx| pool.release(cx, ptr))
    }

    /// Whether `ptr` lies in memory the pool holds (a block's, live or cached), on any device.
    pub fn holds(&self, ptr: DevicePtr) -> bool {
        ptr != 0 && self.on_shard_of(ptr, |pool, _| Ok(pool.holds(ptr))) == Ok(true)
    }

    /// Note that the live block at `ptr` is also used on `stream`.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.on_shard_of(ptr, |pool, _| pool.record_stream(ptr, stream))
    }

    /// Run `f` on the pool of the shard whose segment holds `ptr`, found without a lock in the
    /// span map (without a look while a pool of one device uses one shard). Where the map
    /// cannot tell (segments of several shards share the span, or an address beyond it), or
    /// the shard it names has no block at `ptr` (a segment the map does not record shares the
    /// span), each shard is asked in turn: the one that handed out a block at `ptr`, else the
    /// one holding memory there (whose `f` says what is wrong with the pointer).
    #[inline]
    fn on_shard_of<T>(
        &self,
        ptr: DevicePtr,
        f: impl Fn(&mut DevicePool, &Context<'_>) -> Result<T>,
    ) -> Result<T> {
        let one = self.bindings.len() == 1;
        let owner = if one && self.bindings[0].opened() == 1 {
            Owner::Shard(0)
        } else {
            match self.spans.owner(ptr) {
                Owner::Nobody if one => Owner::Shard(0),
                owner => owner,
            }
        };
        let index = match owner {
            Owner::Shard(index) => Some(index as usize),
            Owner::Nobody => None,
            Owner::Unknown => self.ask_each_shard(ptr),
        };
        let Some(index) = index else {
            return Err(Error::invalid_pointer(format!(
                "{ptr:#x} was not returned by rm_reserve: it lies in no memory the pool holds on \
                 any device (pass only pointers from rm_reserve, each once)"
            )));
        };
        let done = self.with_shard(index, &f);
        if done
            .as_ref()
            .is_err_and(|e| e.status == rm_status::RM_ERROR_INVALID_POINTER)
            && self.shards.len() > 1
        {
            if let Some(other) = self.ask_each_shard(ptr).filter(|&i| i != index) {
                return self.with_shard(other, f);
            }
        }
        done
    }

    /// The shard that handed out a block at `ptr`, else one whose memory holds it, asking each
    /// under its lock.
    fn ask_each_shard(&self, ptr: DevicePtr) -> Option<usize> {
        let mut holder = None;
        for d in 0..self.bindings.len() {
            for index in self.opened_shards(d) {
                let (pool, _) = self.lock_shard(index);
                if pool.has_block_at(ptr) {
                    return Some(index);
                }
                if holder.is_none() && pool.holds(ptr) {
                    holder = Some(index);
                }
            }
        }
        holder
    }

    /// `(free, total)` bytes of `device`, where free counts this pool's reusable memory.
    pub fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        self.mem_get_info_capped(device)
            .map(|info| (info.free, info.total))
    }

    /// [`Pool::mem_get_info`] with the cap on `device` (the driver asked under the lock of the
    /// device's first shard, the figures of its other shards read under theirs).
    pub fn mem_get_info_capped(&self, device: i32) -> Result<MemInfo> {
        let d = self.device_index(device)?;
        let (mut reusable, mut allocated) = (0u64, 0u64);
        let mut add = |pool: &DevicePool| {
            reusable += pool.reusable_bytes();
            allocated += pool.allocated_bytes();
        };
        for index in self.opened_shards(d).skip(1) {
            add(&self.lock_shard(index).0);
        }
        let (pool, cx) = self.lock_shard(d * SHARDS);
        let (free, total) = pool.driver_info(&cx)?;
        add(&pool);
        let mut free = free.saturating_add(reusable).min(total);
        let cap = pool.limit().map(|limit| (limit, allocated));
        if let Some((limit, allocated)) = cap {
            free = free.min(limit.saturating_sub(allocated));
        }
        Ok(MemInfo { free, total, cap })
    }

    /// Return idle cached memory to the driver, on one device or (`None`) all. Returns bytes.
    /// The device's queued work is waited for first, without the device's locks; then the work
    /// goes in batches of bounded size (at most [`FREE_BATCH`] segments, fewer once a batch has
    /// run for `BATCH_TIME`), shard by shard, the shard's lock released between them (and the
    /// driver calls that return memory made while it is released), so that reserves and
    /// releases on the device wait for one batch's bookkeeping at most. Blocks released
    /// meanwhile may stay cached.
    pub fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        let mut total = 0;
        for d in self.devices(device)? {
            for index in self.opened_shards(d) {
                total += self.free_shard(index)?;
            }
        }
        Ok(total)
    }

    /// [`Pool::free_reusable`] on shard `index`.
    fn free_shard(&self, index: usize) -> Result<u64> {
        let device = (index / SHARDS) as i32;
        let mut total = 0;
        #[cfg(feature = "hold-probe")]
        let mut holds = probe::Holds::default();
        let mut sweep = Sweep::settled_at(self.wait_unlocked(index)?);
        loop {
            let (mut pool, cx) = self.lock_shard(index);
            #[cfg(feature = "hold-probe")]
            let timing = probe::Holds::start(sweep.step_name());
            let start = Instant::now();
            let over = || start.elapsed() >= BATCH_TIME;
            let batch = pool.free_reusable_batch(&cx, &mut sweep, FREE_BATCH, &over);
            #[cfg(feature = "hold-probe")]
            holds.end(timing);
            drop(pool);
            // The driver calls that return what the batch took out of the books, made without
            // the lock (the next batch books the answers).
            sweep.make_calls(&*self.driver, device);
            let (bytes, more) = match batch {
                Ok(batch) => batch,
                Err(e) => {
                    // What was returned is booked all the same; the first failure is told.
                    let (mut pool, cx) = self.lock_shard(index);
                    let _ = pool.book_sweep_calls(&cx, &mut sweep);
                    return Err(e);
                }
            };
            total += bytes;
            if !more {
                break;
            }
            self.let_waiters_in(index);
        }
        #[cfg(feature = "hold-probe")]
        holds.print();
        Ok(total)
    }

    /// Before memory of shard `index` goes back to the driver: the device's queued work, which
    /// may still use blocks released before, waited for without the shard's lock (where a block
    /// was released since the last wait and cached memory is left), so that no reserve or
    /// release waits behind that work. Returns the count of the shard's releases the wait
    /// settled (0: no wait was needed).
    fn wait_unlocked(&self, index: usize) -> Result<u64> {
        let (releases, needs_wait) = {
            let (pool, _) = self.lock_shard(index);
            (pool.releases(), pool.needs_wait())
        };
        if !needs_wait {
            return Ok(0);
        }
        self.driver
            .synchronize((index / SHARDS) as i32)
            .map_err(|e| {
                Error::driver("waiting for the device before returning cached memory", &e)
            })?;
        Ok(releases)
    }

    /// Between two batches of a long operation on shard `index`: give the threads blocked on
    /// its lock the time to take it (a mutex lets the thread that just released it take it
    /// again before a woken waiter runs), up to [`WAITERS_GRACE`].
    fn let_waiters_in(&self, index: usize) {
        let waiting = &self.shards[index].waiting;
        let start = Instant::now();
        while waiting.load(Ordering::Relaxed) > 0 && start.elapsed() < WAITERS_GRACE {
            std::thread::yield_now();
        }
    }

    /// Return idle cached memory of `device` to the driver, up to `bytes` of it (whole idle
    /// segments, so possibly a little more), never a block in use: what another process asks
    /// for when it runs short. Returns the bytes returned. The device's queued work is waited
    /// for first, without the shards' locks; the driver calls are made under them (one hold
    /// per shard, bounded by the bytes asked).
    pub fn trim(&self, device: i32, bytes: u64) -> Result<u64> {
        let d = self.device_index(device)?;
        let mut total = 0;
        for index in self.opened_shards(d) {
            if total >= bytes {
                break;
            }
            let settled = self.wait_unlocked(index)?;
            let (mut pool, cx) = self.lock_shard(index);
            pool.settled_at(settled);
            total += pool.trim(&cx, bytes - total)?;
        }
        Ok(total)
    }

    /// Ensure at least `bytes` are reusable on `device`, counting what every shard holds: the
    /// shortfall is allocated in the default stream's shard (a load's blocks come from it; the
    /// other shards' idle cache goes back to the driver when a reserve runs short). Returns the
    /// bytes newly allocated.
    pub fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        let d = self.device_index(device)?;
        let index = d * SHARDS + self.bindings[d].shard(0);
        // No cache goes back for a warm-up, the other shards' neither.
        let (books, cx) = self.lock_shard(index);
        self.unlocked_growth(index, books, cx, |pool, cx| pool.warmup(cx, bytes))
    }

    /// The figures of `device`, read without changing anything: the sums of its shards'
    /// (`largest_reusable_block` their largest). The reserved peak is the device's own, kept
    /// across its shards as they book their driver calls; the allocated peak is the sum of the
    /// shards' peaks: the device's own where one shard did all the work since the last reset
    /// (always, unless threads contended for the pool), else at least it (a device-wide figure
    /// for it would be a write to memory every thread shares at every reserve and release).
    pub fn stats(&self, device: i32) -> Result<Stats> {
        let mut sum = Stats::default();
        self.each_opened_shard(device, |pool| sum.add(&pool.stats()))?;
        sum.peak_reserved_bytes = self.reserved[self.device_index(device)?].peak();
        Ok(sum)
    }

    /// Where `device`'s reserved memory lies, by page: what live blocks hold, and what the
    /// cache holds by how it can be used again (see [`Layout`]). A walk of every block, under
    /// the shards' locks in turn: for a replay or a diagnosis, not for a hot path.
    pub fn layout(&self, device: i32) -> Result<Layout> {
        let mut sum = Layout::default();
        self.each_opened_shard(device, |pool| sum.add(&pool.layout()))?;
        Ok(sum)
    }

    /// Run `f` on each of `device`'s shards that may hold memory, under its lock, one after
    /// the other.
    fn each_opened_shard(&self, device: i32, mut f: impl FnMut(&mut DevicePool)) -> Result<()> {
        let d = self.device_index(device)?;
        for index in self.opened_shards(d) {
            f(&mut self.lock_shard(index).0);
        }
        Ok(())
    }

    /// Whether `device`'s cache is reused page by page (segments stitched with the
    /// virtual-memory API) rather than as classic segments: decided once per device, at its
    /// first growth, or now if none came yet (the CUDA driver then tries a mapping to answer).
    pub fn reuses_pages(&self, device: i32) -> Result<bool> {
        let (mut pool, cx) = self.lock(device)?;
        Ok(pool.reuses_pages(&cx))
    }

    /// Set the peaks of `device` to the current values.
    pub fn reset_peak_stats(&self, device: i32) -> Result<()> {
        self.each_opened_shard(device, |pool| pool.reset_peak_stats())?;
        self.reserved[self.device_index(device)?].reset_peak();
        Ok(())
    }

    /// Cap what the pool reserves on `device` (`None`: every device) at `limit` bytes (`None`:
    /// no cap), all its shards together. Idle cache above the cap goes back to the driver now;
    /// a reserve that would grow past it returns idle cache first, then fails with
    /// out-of-memory naming the cap. Returns the bytes returned to the driver.
    pub fn set_memory_limit(&self, device: Option<i32>, limit: Option<u64>) -> Result<u64> {
        let mut total = 0;
        for d in self.devices(device)? {
            // One cap for all the device's shards, set before any returns its cache: from here
            // on every claim counts against it.
            self.reserved[d].set_limit(limit);
            for index in self.opened_shards(d) {
                let (mut pool, cx) = self.lock_shard(index);
                total += pool.return_above_cap(&cx)?;
            }
        }
        Ok(total)
    }

    /// The cap on `device`, if any.
    pub fn memory_limit(&self, device: i32) -> Result<Option<u64>> {
        Ok(self.reserved[self.device_index(device)?].limit())
    }

    /// Check the books of every shard and the span map; a description of the first broken
    /// invariant. Exact only while no other thread calls the pool.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut segments = Vec::new();
        let mut reserved = vec![0u64; self.reserved.len()];
        for index in 0..self.shards.len() {
            let (pool, _) = self.lock_shard(index);
            let (device, k) = (index / SHARDS, index % SHARDS);
            reserved[device] += pool.stats().reserved_bytes;
            if k >= self.bindings[device].opened() && pool.stats().segments > 0 {
                return Err(format!(
                    "device {device}: shard {k} holds segments but was never opened"
                ));
            }
            pool.check()
                .map_err(|e| format!("device {device} (shard {k}): {e}"))?;
            segments.extend(
                pool.segment_ranges()
                    .map(|(base, size)| (base, size, index as i32)),
            );
        }
        for (device, (&sum, figure)) in reserved.iter().zip(self.reserved.iter()).enumerate() {
            if figure.now() != sum || figure.peak() < sum {
                return Err(format!(
                    "device {device}: the device-wide reserved figure is {} (peak {}) where its \
                     shards reserve {sum}",
                    figure.now(),
                    figure.peak()
                ));
            }
        }
        self.spans.check(&segments)
    }
}

#[cfg(test)]
mod tests;
