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
//! - `spans`: the lock-free map from a 2 MiB span of addresses to the device whose segments
//!   touch it, which finds a pointer's device for `release` (kept with several devices only);
//! - `probe` (only with the cargo feature `hold-probe`, for `scripts/bench-pauses.sh`): the
//!   timing of each hold of a device's lock by [`Pool::free_reusable`];
//! - this module: the multi-device [`Pool`], one lock per device.
//!
//! # Locks
//!
//! Each device's books sit behind their own `Mutex`; nothing else is locked. So no cycle (and
//! no deadlock) is possible:
//!
//! 1. at most one device mutex at a time: [`Pool::free_reusable`] and
//!    [`Pool::set_memory_limit`] over every device take them one after the other, releasing each
//!    before the next (and `free_reusable` releases it between batches of its work too), and so
//!    does a release whose device the span map cannot tell;
//! 2. the span map is written with atomic operations while a device's mutex is held (a segment
//!    booked or forgotten) and read without a lock;
//! 3. the driver is called with the device mutex held, save by `free_reusable` and `trim`,
//!    which wait for the device's work before they take the mutex, by `free_reusable`'s
//!    calls that return memory, made after each batch has let go of it (`device/deferred.rs`),
//!    and by `reserve` and `warmup`, whose calls that create and map memory, and the waits for
//!    the device's work that cached memory needs, are made between passes under the mutex
//!    (`device/growing.rs`); the driver takes no lock of the pool and
//!    never calls back into it (the simulator's own mutex is a leaf).
//!
//! `release` and `record_stream` read the span map *before* taking a device mutex. A mutex
//! poisoned by a panic is taken over (see `Pool::lock`).

// Public: what the command and the PyTorch-policy baseline use (sizes and their printing, the
// integer map, the figures). The rest is the pool's own business.
pub(crate) mod bins;
pub(crate) mod blocks;
pub(crate) mod device;
pub(crate) mod hash;
pub(crate) mod ids;
pub mod layout;
#[cfg(feature = "hold-probe")]
mod probe;
pub(crate) mod size;
pub(crate) mod spans;
pub(crate) mod stats;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::{rm_status, Error, Result};
use device::{DevicePool, Pass, Sweep};
pub use layout::Layout;
use spans::{Owner, Spans};
pub use stats::Stats;

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
}

/// The pool of every device, safe to share between threads.
pub struct Pool {
    driver: Arc<dyn Driver>,
    devices: Box<[Mutex<DevicePool>]>,
    /// Per device, the threads blocked on its lock (see [`Pool::let_waiters_in`]).
    waiting: Box<[AtomicU32]>,
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
        for device in 0..self.device_count() {
            if let Ok((mut pool, cx)) = self.lock(device) {
                pool.destroy_events(&cx);
            }
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
        let devices: Box<[Mutex<DevicePool>]> = (0..driver.device_count().max(0))
            .map(|device| Mutex::new(DevicePool::new(device, config)))
            .collect();
        Pool {
            driver,
            waiting: devices.iter().map(|_| AtomicU32::new(0)).collect(),
            // One device is every pointer's device: the map would never be read.
            spans: if devices.len() > 1 {
                Spans::default()
            } else {
                Spans::unused()
            },
            devices,
        }
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// Number of devices.
    pub fn device_count(&self) -> i32 {
        self.devices.len() as i32
    }

    /// `device`'s pool, locked. A lock poisoned by a panic is taken over: every book is updated
    /// only after the driver call it depends on succeeded.
    fn lock(&self, device: i32) -> Result<(MutexGuard<'_, DevicePool>, Context<'_>)> {
        let slot = usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| self.invalid_device(device))?;
        let guard = match slot.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let waiting = &self.waiting[device as usize];
                waiting.fetch_add(1, Ordering::Relaxed);
                let guard = slot.lock().unwrap_or_else(|e| e.into_inner());
                waiting.fetch_sub(1, Ordering::Relaxed);
                guard
            }
        };
        let cx = Context {
            driver: &*self.driver,
            spans: &self.spans,
        };
        Ok((guard, cx))
    }

    fn invalid_device(&self, device: i32) -> Error {
        let seen = match self.devices.len() {
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
    pub fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        if size == 0 {
            return self.lock(device).map(|_| 0);
        }
        self.unlocked_growth(device, |pool, cx| pool.reserve(cx, size, stream))
    }

    /// Run `f` on `device`'s pool, making the driver calls a growth needs without the device's
    /// lock: a pass defers them, they are made once the lock is let go, and the next pass takes
    /// what they made (`device/growing.rs`).
    fn unlocked_growth<T>(
        &self,
        device: i32,
        f: impl Fn(&mut DevicePool, &Context<'_>) -> Result<T>,
    ) -> Result<T> {
        let (mut pool, cx) = self.lock(device)?;
        let mut plan = match pool.deferring(&cx, |pool| f(pool, &cx)) {
            Pass::Done(done) => return done,
            Pass::Grow(plan) => plan,
        };
        drop(pool);
        // A pass may defer again what the last one's calls made way for (a growth once a wait
        // for the device is done); the last pass makes its calls under the lock.
        for pass in 2.. {
            let made = plan.make(&*self.driver);
            let (mut pool, cx) = self.lock(device)?;
            let defer = pass <= DEFERRING_PASSES;
            plan = match pool.prepared(&cx, plan, made, defer, |pool| f(pool, &cx)) {
                Pass::Done(done) => return done,
                Pass::Grow(plan) => plan,
            };
        }
        unreachable!("the last pass defers nothing")
    }

    /// Like [`Pool::reserve`], but only from memory the pool already holds: `None` (and nothing
    /// counted) where the request would need the driver. Size 0 is `Some(0)`.
    pub fn reserve_cached(
        &self,
        device: i32,
        size: u64,
        stream: StreamHandle,
    ) -> Result<Option<DevicePtr>> {
        let (mut pool, cx) = self.lock(device)?;
        if size == 0 {
            return Ok(Some(0));
        }
        pool.reserve_cached(&cx, size, stream)
    }

    /// Give a block back to the pool. `0` is accepted and does nothing.
    pub fn release(&self, ptr: DevicePtr) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.on_device_of(ptr, |pool, cx| pool.release(cx, ptr))
    }

    /// Note that the live block at `ptr` is also used on `stream`.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.on_device_of(ptr, |pool, _| pool.record_stream(ptr, stream))
    }

    /// Run `f` on the pool of the device whose segment holds `ptr`, found without a lock in the
    /// span map (without a look when there is one device). Where the map cannot tell (segments
    /// of several devices share the span, or an address beyond it), each device is asked in
    /// turn: the one that handed out a block at `ptr`, else the one holding memory there (whose
    /// `f` says what is wrong with the pointer).
    fn on_device_of<T>(
        &self,
        ptr: DevicePtr,
        f: impl FnOnce(&mut DevicePool, &Context<'_>) -> Result<T>,
    ) -> Result<T> {
        let owner = match self.devices.len() {
            1 => Owner::Device(0),
            _ => self.spans.owner(ptr),
        };
        let device = match owner {
            Owner::Device(device) => Some(device),
            Owner::Nobody => None,
            Owner::Unknown => self.ask_each_device(ptr)?,
        };
        let Some(device) = device else {
            return Err(Error::invalid_pointer(format!(
                "{ptr:#x} was not returned by rm_reserve: it lies in no memory the pool holds on \
                 any device (pass only pointers from rm_reserve, each once)"
            )));
        };
        let (mut pool, cx) = self.lock(device)?;
        f(&mut pool, &cx)
    }

    /// The device that handed out a block at `ptr`, else one whose memory holds it, asking each
    /// under its lock.
    fn ask_each_device(&self, ptr: DevicePtr) -> Result<Option<i32>> {
        let mut holder = None;
        for device in 0..self.device_count() {
            let (pool, _) = self.lock(device)?;
            if pool.has_block_at(ptr) {
                return Ok(Some(device));
            }
            if holder.is_none() && pool.holds(ptr) {
                holder = Some(device);
            }
        }
        Ok(holder)
    }

    /// `(free, total)` bytes of `device`, where free counts this pool's reusable memory.
    pub fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        let (pool, cx) = self.lock(device)?;
        pool.mem_get_info(&cx)
    }

    /// [`Pool::mem_get_info`] with the cap on `device`, read under one hold of the device's
    /// lock.
    pub fn mem_get_info_capped(&self, device: i32) -> Result<MemInfo> {
        let (pool, cx) = self.lock(device)?;
        let (free, total) = pool.mem_get_info(&cx)?;
        let cap = pool
            .memory_limit()
            .map(|limit| (limit, pool.stats().allocated_bytes));
        Ok(MemInfo { free, total, cap })
    }

    /// Return idle cached memory to the driver, on one device or (`None`) all. Returns bytes.
    /// The device's queued work is waited for first, without the device's lock; then the work
    /// goes in batches of bounded size (at most [`FREE_BATCH`] segments, fewer once a batch has
    /// run for `BATCH_TIME`), the device's lock released between them (and the driver calls
    /// that return memory made while it is released), so that reserves and releases on the
    /// device wait for one batch's bookkeeping at most. Blocks released meanwhile may stay
    /// cached.
    pub fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        // One ordinal is checked by `lock`, INT_MAX included.
        let devices = match device {
            Some(d) => vec![d],
            None => (0..self.device_count()).collect(),
        };
        let mut total = 0;
        #[cfg(feature = "hold-probe")]
        let mut holds = probe::Holds::default();
        for device in devices {
            let mut sweep = Sweep::settled_at(self.wait_unlocked(device)?);
            loop {
                let (mut pool, cx) = self.lock(device)?;
                #[cfg(feature = "hold-probe")]
                let timing = probe::Holds::start(sweep.step_name());
                let start = Instant::now();
                let over = || start.elapsed() >= BATCH_TIME;
                let batch = pool.free_reusable_batch(&cx, &mut sweep, FREE_BATCH, &over);
                #[cfg(feature = "hold-probe")]
                holds.end(timing);
                drop(pool);
                // The driver calls that return what the batch took out of the books, made
                // without the lock (the next batch books the answers).
                sweep.make_calls(&*self.driver, device);
                let (bytes, more) = match batch {
                    Ok(batch) => batch,
                    Err(e) => {
                        // What was returned is booked all the same; the first failure is told.
                        let (mut pool, cx) = self.lock(device)?;
                        let _ = pool.book_sweep_calls(&cx, &mut sweep);
                        return Err(e);
                    }
                };
                total += bytes;
                if !more {
                    break;
                }
                self.let_waiters_in(device);
            }
        }
        #[cfg(feature = "hold-probe")]
        holds.print();
        Ok(total)
    }

    /// Before memory of `device` goes back to the driver: the device's queued work, which may
    /// still use blocks released before, waited for without the device's lock (where a block was
    /// released since the last wait and cached memory is left), so that no reserve or release
    /// on the device waits behind that work. Returns the count of releases the wait settled (0:
    /// no wait was needed).
    fn wait_unlocked(&self, device: i32) -> Result<u64> {
        let (releases, needs_wait) = {
            let (pool, _) = self.lock(device)?;
            (pool.releases(), pool.needs_wait())
        };
        if !needs_wait {
            return Ok(0);
        }
        self.driver.synchronize(device).map_err(|e| {
            Error::driver("waiting for the device before returning cached memory", &e)
        })?;
        Ok(releases)
    }

    /// Between two batches of a long operation on `device`: give the threads blocked on its
    /// lock the time to take it (a mutex lets the thread that just released it take it again
    /// before a woken waiter runs), up to [`WAITERS_GRACE`].
    fn let_waiters_in(&self, device: i32) {
        let Some(waiting) = usize::try_from(device)
            .ok()
            .and_then(|d| self.waiting.get(d))
        else {
            return;
        };
        let start = Instant::now();
        while waiting.load(Ordering::Relaxed) > 0 && start.elapsed() < WAITERS_GRACE {
            std::thread::yield_now();
        }
    }

    /// Return idle cached memory of `device` to the driver, up to `bytes` of it (whole idle
    /// segments, so possibly a little more), never a block in use: what another process asks
    /// for when it runs short. Returns the bytes returned. The device's queued work is waited
    /// for first, without the device's lock; the driver calls are made under it (one hold,
    /// bounded by the bytes asked).
    pub fn trim(&self, device: i32, bytes: u64) -> Result<u64> {
        if bytes == 0 {
            // The ordinal is checked all the same.
            return self.lock(device).map(|_| 0);
        }
        let settled = self.wait_unlocked(device)?;
        let (mut pool, cx) = self.lock(device)?;
        pool.settled_at(settled);
        pool.trim(&cx, bytes)
    }

    /// Ensure at least `bytes` are reusable on `device`. Returns the bytes newly allocated.
    pub fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        self.unlocked_growth(device, |pool, cx| pool.warmup(cx, bytes))
    }

    /// The figures of `device`, read without changing anything.
    pub fn stats(&self, device: i32) -> Result<Stats> {
        let (pool, _) = self.lock(device)?;
        Ok(pool.stats())
    }

    /// Where `device`'s reserved memory lies, by page: what live blocks hold, and what the
    /// cache holds by how it can be used again (see [`Layout`]). A walk of every block, under
    /// the device's lock: for a replay or a diagnosis, not for a hot path.
    pub fn layout(&self, device: i32) -> Result<Layout> {
        let (pool, _) = self.lock(device)?;
        Ok(pool.layout())
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
        let (mut pool, _) = self.lock(device)?;
        pool.reset_peak_stats();
        Ok(())
    }

    /// Cap what the pool reserves on `device` (`None`: every device) at `limit` bytes (`None`:
    /// no cap). Idle cache above the cap goes back to the driver now; a reserve that would grow
    /// past it returns idle cache first, then fails with out-of-memory naming the cap. Returns
    /// the bytes returned to the driver.
    pub fn set_memory_limit(&self, device: Option<i32>, limit: Option<u64>) -> Result<u64> {
        self.each_device(device, |pool, cx| pool.set_memory_limit(cx, limit))
    }

    /// Run `f` on one device's pool or (`None`) on each in turn, summing what it returns.
    fn each_device(
        &self,
        device: Option<i32>,
        mut f: impl FnMut(&mut DevicePool, &Context<'_>) -> Result<u64>,
    ) -> Result<u64> {
        // One ordinal is checked by `lock`, INT_MAX included (`d..d + 1` would overflow).
        let devices = match device {
            Some(d) => vec![d],
            None => (0..self.device_count()).collect(),
        };
        let mut total = 0;
        for device in devices {
            let (mut pool, cx) = self.lock(device)?;
            total += f(&mut pool, &cx)?;
        }
        Ok(total)
    }

    /// The cap on `device`, if any.
    pub fn memory_limit(&self, device: i32) -> Result<Option<u64>> {
        let (pool, _) = self.lock(device)?;
        Ok(pool.memory_limit())
    }

    /// Check the books of every device and the span map; a description of the first broken
    /// invariant. Exact only while no other thread calls the pool.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut segments = Vec::new();
        for device in 0..self.device_count() {
            let (pool, _) = self.lock(device).map_err(|e| e.message)?;
            pool.check().map_err(|e| format!("device {device}: {e}"))?;
            segments.extend(
                pool.segment_ranges()
                    .map(|(base, size)| (base, size, device)),
            );
        }
        self.spans.check(&segments)
    }
}

#[cfg(test)]
mod tests;
