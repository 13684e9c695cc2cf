//! Concurrency: 8 threads share one pool over two simulated devices with three streams each
//! (two on a device's first shard, one on a shard of its own), doing mixed operations and handing blocks to each other, so that most blocks are released by
//! another thread than the one that reserved them, with classic segments and with stitched ones
//! (`vmm:true`), and behind the per-thread front caches (the C API's path). Every block handed
//! out is checked against all other live blocks (no two overlap), and at the end the books are
//! exact and, once the cache is returned, the driver holds nothing: no allocation, no physical
//! memory, no address range. A watchdog fails the test
//! if the threads stop making progress (a deadlock) instead of hanging.
//!
//! Two more tests hold the invariant that every live block stays known to the pool while
//! another device returns memory: one thread per device cycling a 64 MiB block through
//! `record_stream`, release and `free_reusable`, and the same interleaving forced exactly (a
//! device grows inside the very driver call in which another frees its segment).
//!
//! And one holds a cap: threads on streams of four shards grow and return memory at once
//! under it, and the driver never holds more than the cap at any moment.
//!
//! `RESMEM_STRESS_OPS` sets the operations per thread (default 100000: 800000 in all; a quarter
//! of that with stitching, whose driver calls cost more).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use cuda_sim::{Sim, VmmSetting};
use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Front, Pool, PoolConfig};

mod common;
use common::spy::{Spy, Watch};
use common::under::Under;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const THREADS: usize = 8;
const DEVICES: i32 = 2;

/// A small xorshift generator: the test needs speed and reproducibility, not quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Every live block in the process, to catch two threads handed overlapping memory.
#[derive(Default)]
struct Ledger(Mutex<BTreeMap<u64, u64>>);

impl Ledger {
    fn add(&self, ptr: u64, size: u64) {
        let mut map = self.0.lock().unwrap();
        if let Some((&p, &s)) = map.range(..=ptr).next_back() {
            assert!(p + s <= ptr, "{ptr:#x}+{size} overlaps live {p:#x}+{s}");
        }
        if let Some((&n, _)) = map.range(ptr..).next() {
            assert!(ptr + size <= n, "{ptr:#x}+{size} overlaps live {n:#x}");
        }
        map.insert(ptr, size);
    }
    fn remove(&self, ptr: u64) {
        assert!(self.0.lock().unwrap().remove(&ptr).is_some());
    }
}

fn ops_per_thread() -> u64 {
    std::env::var("RESMEM_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

#[test]
fn eight_threads_exchanging_blocks_keep_the_books_exact() {
    eight_threads(false);
}

#[test]
fn eight_threads_exchanging_blocks_keep_the_books_exact_with_stitching() {
    eight_threads(true);
}

fn eight_threads(stitched: bool) {
    eight_threads_over(stitched, None, Arc::new);
}

/// The default on a driver that maps only from an allocation's start (the CUDA driver's way),
/// the pool's handles made of 6 MiB parts (`PageHandles::with_part`): threads mapping and
/// unmapping parts at once.
#[test]
fn eight_threads_exchanging_blocks_keep_the_books_exact_with_handles_of_parts() {
    eight_threads_over(true, Some(6 << 20), Arc::new);
}

/// The same through the front caches (the C API's path): blocks released by another thread go
/// to the reserving thread's remote list, threads exit with full caches, and drains run while
/// other threads hit.
#[test]
fn eight_threads_exchanging_blocks_through_the_front_caches_keep_the_books_exact() {
    eight_threads_over(false, None, |pool| Arc::new(Front::new(pool)));
}

/// Eight threads on a pool (stitched or classic; `parts`: on a driver that maps only from an
/// allocation's start, handles made of parts of that size), wrapped by `wrap`.
fn eight_threads_over<P: Under + 'static>(
    stitched: bool,
    parts: Option<u64>,
    wrap: impl FnOnce(Pool) -> Arc<P>,
) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[16 * GIB, 16 * GIB])));
    if parts.is_some() {
        sim.set_vmm(VmmSetting::StartOnly);
    }
    let config = PoolConfig {
        vmm: stitched,
        ..PoolConfig::default()
    };
    let driver = PageHandles::with_part(SimDriver::new(sim).unwrap(), parts.unwrap_or(0));
    let pool = wrap(Pool::new(Arc::new(driver), config));
    let streams: Arc<Vec<Vec<u64>>> = Arc::new(
        (0..DEVICES)
            .map(|d| {
                vec![
                    0,
                    sim.stream_create(d).unwrap(),
                    sim.stream_create(d).unwrap(),
                ]
            })
            .collect(),
    );
    // Each device's third stream on a shard of its own (as contention moves a stream), the
    // other two sharing the first: releases cross shards, and figures sum them.
    for d in 0..DEVICES {
        assert!(pool.own_shard(d, streams[d as usize][2]).unwrap());
    }
    let ledger = Arc::new(Ledger::default());
    // Blocks in flight between threads: (ptr, device).
    let exchange: Arc<Mutex<Vec<(u64, i32)>>> = Arc::default();
    let done = Arc::new(AtomicU64::new(0));
    let foreign_releases = Arc::new(AtomicU64::new(0));
    let per_thread = ops_per_thread();

    let (finished_tx, finished_rx) = mpsc::channel();
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let (pool, streams, ledger, exchange, done, foreign, tx) = (
            pool.clone(),
            streams.clone(),
            ledger.clone(),
            exchange.clone(),
            done.clone(),
            foreign_releases.clone(),
            finished_tx.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) * 0x1234_5678_9ABC_DEF1));
            let mut mine: Vec<(u64, i32, u64)> = Vec::new();
            for _ in 0..per_thread {
                let device = rng.below(DEVICES as u64) as i32;
                let stream = streams[device as usize][rng.below(3) as usize];
                match rng.below(100) {
                    0..=44 => {
                        let size = match rng.below(10) {
                            0..=5 => 1 + rng.below(64 << 10),
                            6..=8 => 1 + rng.below(MIB),
                            _ => MIB + rng.below(64 * MIB),
                        };
                        match pool.reserve(device, size, stream) {
                            Ok(ptr) => {
                                assert_eq!(ptr % 512, 0);
                                ledger.add(ptr, size.div_ceil(512) * 512);
                                mine.push((ptr, device, size));
                            }
                            Err(e) => {
                                assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY, "{e}")
                            }
                        }
                    }
                    45..=64 => {
                        if let Some((ptr, _, _)) = pop_random(&mut mine, &mut rng) {
                            ledger.remove(ptr);
                            pool.release(ptr).unwrap();
                        }
                    }
                    65..=79 => {
                        // Hand a block to whichever thread comes next.
                        if let Some((ptr, device, _)) = pop_random(&mut mine, &mut rng) {
                            exchange.lock().unwrap().push((ptr, device));
                        }
                    }
                    80..=89 => {
                        let taken = exchange.lock().unwrap().pop();
                        if let Some((ptr, device)) = taken {
                            if rng.below(2) == 0 {
                                let other = streams[device as usize][rng.below(3) as usize];
                                pool.record_stream(ptr, other).unwrap();
                            }
                            ledger.remove(ptr);
                            pool.release(ptr).unwrap();
                            foreign.fetch_add(1, Relaxed);
                        }
                    }
                    90..=93 => {
                        if let Some(&(ptr, device, _)) = mine.last() {
                            let other = streams[device as usize][rng.below(3) as usize];
                            pool.record_stream(ptr, other).unwrap();
                        }
                    }
                    94..=96 => {
                        let (free, total) = pool.mem_get_info(device).unwrap();
                        assert!(free <= total);
                        let s = pool.stats(device).unwrap();
                        if pool.figures_exact_in_flight() {
                            assert!(s.allocated_bytes <= s.reserved_bytes);
                        }
                    }
                    97 => {
                        pool.free_reusable(Some(device)).unwrap();
                    }
                    98 => {
                        // Like a reserve, a warm-up's shortfall may find the device full (the
                        // threads' live blocks fill it in long runs): refused, never more.
                        if let Err(e) = pool.warmup(device, rng.below(256 * MIB) + 1) {
                            assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY, "{e}")
                        }
                    }
                    _ => {
                        let _ = sim.enqueue_work(device, stream);
                        if rng.below(2) == 0 {
                            let _ = sim.complete_work(device, stream);
                        }
                    }
                }
                done.fetch_add(1, Relaxed);
            }
            for (ptr, _, _) in mine {
                ledger.remove(ptr);
                pool.release(ptr).unwrap();
            }
            tx.send(()).unwrap();
        }));
    }
    drop(finished_tx);
    // Watchdog: every thread must finish, and progress must never stall for 60 s.
    let mut finished = 0;
    let mut last = 0;
    while finished < THREADS {
        match finished_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(()) => finished += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = done.load(Relaxed);
                assert!(
                    now > last,
                    "no progress in 60 s at {now} operations: deadlock"
                );
                last = now;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    // Blocks still in the exchange are released here, by yet another thread.
    for (ptr, _) in exchange.lock().unwrap().drain(..) {
        ledger.remove(ptr);
        pool.release(ptr).unwrap();
    }
    assert!(ledger.0.lock().unwrap().is_empty());
    pool.check().unwrap();
    let mut allocs = 0;
    for d in 0..DEVICES {
        let s = pool.stats(d).unwrap();
        assert_eq!(
            (s.allocated_bytes, s.requested_bytes, s.live_blocks),
            (0, 0, 0)
        );
        assert_eq!(s.reserved_bytes, sim.used_bytes(d));
        assert_eq!(s.reusable_bytes, s.reserved_bytes);
        allocs += s.driver_allocs;
    }
    if parts.is_none() {
        assert_driver_agrees(&*pool, sim);
    }
    pool.free_reusable(None).unwrap();
    assert_returned(&*pool, sim);
    eprintln!(
        "stress{}{}: {THREADS} threads, {} operations, {} blocks released by another thread, \
         {allocs} driver allocations",
        if stitched { " (stitched)" } else { "" },
        if parts.is_some() { " (parts)" } else { "" },
        done.load(Relaxed),
        foreign_releases.load(Relaxed)
    );
}

/// The driver's successful allocations and frees are the pool's (chunks with stitching).
fn assert_driver_agrees(pool: &dyn Under, sim: &Sim) {
    let (mut allocs, mut frees) = (0, 0);
    for d in 0..DEVICES {
        let s = pool.stats(d).unwrap();
        allocs += s.driver_allocs;
        frees += s.driver_frees;
    }
    // The default makes physical memory with cuMemCreate, classic segments with cuMemAlloc.
    let (creates, releases) = sim.vmm_calls();
    assert_eq!(
        (allocs, frees),
        (sim.alloc_calls() + creates, sim.free_calls() + releases)
    );
}

/// After `free_reusable(-1)` with no block live, the books are exact and the driver holds
/// nothing on any device: no allocation, no physical memory, no address range.
fn assert_returned(pool: &dyn Under, sim: &Sim) {
    pool.check().unwrap();
    for d in 0..DEVICES {
        let s = pool.stats(d).unwrap();
        assert_eq!((s.reserved_bytes, s.live_blocks, s.segments), (0, 0, 0));
        assert_eq!(sim.used_bytes(d), 0, "device {d}");
        assert_eq!(sim.live_allocations(d), 0, "device {d}");
        assert_eq!(sim.physical_allocations(d), 0, "device {d}");
    }
    assert_eq!(sim.reserved_ranges(), 0);
}

/// The scenario of a live block becoming unknown: one thread per device, each cycling a 64 MiB
/// block through `record_stream`, release and `free_reusable` on its own device, so that one
/// device returns a segment while the other grows. Every call must succeed.
#[test]
fn one_thread_per_device_returning_memory_keeps_every_block_known() {
    for stitched in [false, true] {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[2 * GIB, 2 * GIB])));
        let config = PoolConfig {
            vmm: stitched,
            ..PoolConfig::default()
        };
        let pool = Arc::new(Pool::new(Arc::new(SimDriver::new(sim).unwrap()), config));
        let rounds = (ops_per_thread() / 20).max(100);
        let threads: Vec<_> = (0..DEVICES)
            .map(|d| {
                let pool = pool.clone();
                let other = sim.stream_create(d).unwrap();
                std::thread::spawn(move || {
                    for round in 0..rounds {
                        let ptr = pool.reserve(d, 64 * MIB, 0).unwrap();
                        let known = pool
                            .record_stream(ptr, other)
                            .and_then(|()| pool.release(ptr));
                        if let Err(e) = known {
                            panic!("device {d}, round {round}: {ptr:#x}: {e}");
                        }
                        pool.free_reusable(Some(d)).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_driver_agrees(&*pool, sim);
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// A hook a [`Hooked`] driver runs once, inside a driver call.
type Hook = Mutex<Option<Box<dyn FnOnce() + Send>>>;

/// Hooks that, once armed, run right after device 0 frees memory (`cuMemFree` or
/// `cuMemAddressFree`), inside that call (`on_free`); right after it unmaps a range
/// (`cuMemUnmap`, `on_unmap`); or inside a wait for device 0's work (`cuCtxSynchronize`,
/// `on_sync`).
#[derive(Default)]
struct Hooks {
    on_create: Hook,
    on_access: Hook,
    on_free: Hook,
    on_unmap: Hook,
    on_sync: Hook,
}

impl Hooks {
    fn run(hook: &Hook, device: i32) {
        if device == 0 {
            let hook = hook.lock().unwrap().take();
            if let Some(hook) = hook {
                hook();
            }
        }
    }
}

impl Watch for Hooks {
    fn before(&self, call: &'static str, device: i32) {
        if call == "cuCtxSynchronize" {
            Hooks::run(&self.on_sync, device);
        }
    }

    fn after(&self, call: &'static str, device: i32) {
        match call {
            "cuMemAlloc_v2" | "cuMemCreate" => Hooks::run(&self.on_create, device),
            "cuMemSetAccess" => Hooks::run(&self.on_access, device),
            "cuMemFree_v2" | "cuMemAddressFree" => Hooks::run(&self.on_free, device),
            "cuMemUnmap" => Hooks::run(&self.on_unmap, device),
            _ => {}
        }
    }
}

/// The simulated driver with [`Hooks`].
type Hooked = Spy<Hooks>;

/// Two simulated 2 GiB devices behind a [`Hooked`] driver, and a pool over them, stitched or
/// with classic segments.
fn hooked_pool(stitched: bool) -> (&'static Sim, Arc<Hooked>, Arc<Pool>) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[2 * GIB, 2 * GIB])));
    let driver = Arc::new(Spy {
        sim: SimDriver::new(sim).unwrap(),
        watch: Hooks::default(),
    });
    let config = PoolConfig {
        vmm: stitched,
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(driver.clone(), config));
    (sim, driver, pool)
}

/// The interleaving behind the lost block, forced: device 1 grows inside the driver call in
/// which device 0 frees its segment, so (with stitching, whose address ranges all devices
/// share) device 1's new segment gets the very base device 0 just freed. Device 1's block must
/// stay known, and both devices must return everything afterwards.
#[test]
fn a_device_growing_while_another_frees_keeps_its_block_known() {
    for stitched in [false, true] {
        let (sim, driver, pool) = hooked_pool(stitched);
        // Device 1 served a request before (and holds nothing now): the reserve inside device
        // 0's free below is not its first, which would give device 0's ranges access to it
        // (`pool/peers.rs`) under device 0's lock, held by this thread during the free.
        let first = pool.reserve(1, 64 * MIB, 0).unwrap();
        pool.release(first).unwrap();
        pool.free_reusable(Some(1)).unwrap();
        let freed = pool.reserve(0, 64 * MIB, 0).unwrap();
        pool.release(freed).unwrap();
        let grown: Arc<Mutex<Option<u64>>> = Arc::default();
        {
            let (pool, grown) = (Arc::downgrade(&pool), grown.clone());
            *driver.watch.on_free.lock().unwrap() = Some(Box::new(move || {
                let pool = pool.upgrade().unwrap();
                *grown.lock().unwrap() = Some(pool.reserve(1, 64 * MIB, 0).unwrap());
            }));
        }
        assert_eq!(pool.free_reusable(Some(0)).unwrap(), 64 * MIB);
        let grown = grown
            .lock()
            .unwrap()
            .expect("device 1 grew inside the free");
        if stitched {
            assert_eq!(grown, freed, "the sim reuses the freed range at once");
        }
        let other = sim.stream_create(1).unwrap();
        pool.record_stream(grown, other)
            .unwrap_or_else(|e| panic!("stitched {stitched}: {e}"));
        pool.release(grown).unwrap();
        pool.check().unwrap();
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// A device becomes a peer of another while that one maps a range without its lock: device 1
/// serves its first request inside device 0's `cuMemCreate` for a new range, after device 0's
/// ranges were walked for the new peer and before the new range is booked. The range is mapped
/// with the peers the pass saw (none), and given device 1 as it is booked.
#[test]
fn a_range_mapped_while_a_peer_joins_gives_it_access_once_booked() {
    let (sim, driver, pool) = hooked_pool(true);
    let first = pool.reserve(0, 64 * MIB, 0).unwrap();
    let joined: Arc<Mutex<Option<u64>>> = Arc::default();
    {
        let (pool, joined) = (Arc::downgrade(&pool), joined.clone());
        *driver.watch.on_create.lock().unwrap() = Some(Box::new(move || {
            let pool = pool.upgrade().unwrap();
            *joined.lock().unwrap() = Some(pool.reserve(1, 64 * MIB, 0).unwrap());
        }));
    }
    let grown = pool.reserve(0, 512 * MIB, 0).unwrap();
    let joined = joined
        .lock()
        .unwrap()
        .expect("device 1 served a request inside device 0's creation");
    for (ptr, size) in [(first, 64 * MIB), (grown, 512 * MIB), (joined, 64 * MIB)] {
        for from in [0, 1] {
            assert_eq!(
                sim.accessible_from(ptr + size - 1, from),
                Some(true),
                "{ptr:#x} from device {from}"
            );
        }
    }
    pool.check().unwrap();
    for ptr in [first, grown, joined] {
        pool.release(ptr).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_returned(&*pool, sim);
}

/// Another thread reserves and releases on device 0 (under the device's lock, as every miss)
/// inside a call of `driver`'s hook `hook`, and has done so within 20 s (else it was blocked
/// behind the lock): the bytes the pool reserved then, or what went wrong.
fn meanwhile(
    pool: &Arc<Pool>,
    driver: &Hooked,
    hook: fn(&Hooks) -> &Hook,
) -> Arc<Mutex<Option<Result<u64, String>>>> {
    let seen: Arc<Mutex<Option<Result<u64, String>>>> = Arc::default();
    let (pool, out) = (Arc::downgrade(pool), seen.clone());
    *hook(&driver.watch).lock().unwrap() = Some(Box::new(move || {
        let pool = pool.upgrade().unwrap();
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            let p = pool.reserve(0, MIB, 0).unwrap();
            pool.release(p).unwrap();
            done.send(pool.stats(0).unwrap().reserved_bytes).unwrap();
        });
        *out.lock().unwrap() = Some(
            finished
                .recv_timeout(Duration::from_secs(20))
                .map_err(|_| "blocked behind the device's lock".to_string()),
        );
    }));
    seen
}

/// What `f` returns, run on another thread within 20 s (else it was blocked behind the device's
/// lock, and this panics).
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || done.send(f()).unwrap());
    finished
        .recv_timeout(Duration::from_secs(20))
        .expect("blocked behind the device's lock")
}

/// Set `hook` to run `f` with the pool (held weakly until then), once.
fn on_hook(pool: &Arc<Pool>, hook: &Hook, f: impl FnOnce(Arc<Pool>) + Send + 'static) {
    let pool = Arc::downgrade(pool);
    *hook.lock().unwrap() = Some(Box::new(move || f(pool.upgrade().unwrap())));
}

/// The bytes reserved while a hook of [`meanwhile`] ran, which must have run.
fn seen(meanwhile: &Mutex<Option<Result<u64, String>>>, what: &str) -> u64 {
    meanwhile
        .lock()
        .unwrap()
        .take()
        .unwrap_or_else(|| panic!("{what}: the hook did not run"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// `free_reusable` waits for the device's queued work before it takes the device's lock: while
/// it waits, another thread reserves and releases on the same device (under the lock, as every
/// miss), which would block behind a wait made with the lock held. What that thread released
/// after the wait began stays cached (its work may still be queued), and goes with the next
/// `free_reusable`. Classic segments are freed (`cuMemFree`, which on a GPU may wait for the
/// device's work too) without the lock as well, and `trim` waits for the device without it.
#[test]
fn free_reusable_waits_for_the_device_without_the_lock() {
    for stitched in [false, true] {
        let (sim, driver, pool) = hooked_pool(stitched);
        let cached = pool.reserve(0, 64 * MIB, 0).unwrap();
        pool.release(cached).unwrap();
        let in_wait = meanwhile(&pool, &driver, |d| &d.on_sync);
        let returned = pool.free_reusable(Some(0)).unwrap();
        let reserved = seen(&in_wait, &format!("stitched {stitched}, in the wait"));
        let left = pool.stats(0).unwrap().reserved_bytes;
        if stitched {
            // The 1 MiB block's range borrowed a page of the cached segment's handle: the
            // segment was taken apart, but the handle stays mapped in that range, released
            // after the wait began and so kept.
            assert_eq!((returned, reserved, left), (0, 64 * MIB, 64 * MIB));
            // The next sweep takes that range apart and unmaps it without the lock: inside the
            // unmap, another thread reserves and releases (its range may map pages of the
            // handle still mapped in the range being unmapped).
            let in_unmap = meanwhile(&pool, &driver, |d| &d.on_unmap);
            let returned = pool.free_reusable(Some(0)).unwrap();
            let reserved = seen(&in_unmap, "in the unmap");
            let left = pool.stats(0).unwrap().reserved_bytes;
            // Its new range took a page of the same handle (spare in the books since the range
            // being unmapped was taken apart): the handle stays, mapped there.
            assert_eq!((returned, reserved, left), (0, 64 * MIB, 64 * MIB));
        } else {
            // The 1 MiB block got a 2 MiB segment of its own, kept.
            assert_eq!((returned, reserved, left), (64 * MIB, 66 * MIB, 2 * MIB));
            // The 2 MiB segment left goes back in the next sweep, and another thread reserves
            // and releases inside its cuMemFree: a new 2 MiB segment, kept.
            let in_free = meanwhile(&pool, &driver, |d| &d.on_free);
            assert_eq!(pool.free_reusable(Some(0)).unwrap(), 2 * MIB);
            assert_eq!(seen(&in_free, "in the free"), 4 * MIB);
            assert_eq!(pool.stats(0).unwrap().reserved_bytes, 2 * MIB);
            // `trim` (another process asks) waits for the device without the lock too: the
            // other thread's 1 MiB block reuses the idle 2 MiB segment meanwhile, and the 64 MiB
            // segment released before the wait goes back.
            let p = pool.reserve(0, 64 * MIB, 0).unwrap();
            pool.release(p).unwrap();
            let in_trim = meanwhile(&pool, &driver, |d| &d.on_sync);
            assert_eq!(pool.trim(0, 64 * MIB).unwrap(), 64 * MIB);
            assert_eq!(seen(&in_trim, "in trim's wait"), 66 * MIB);
            assert_eq!(pool.stats(0).unwrap().reserved_bytes, 2 * MIB);
        }
        pool.check().unwrap();
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// A reserve that needs new memory makes the driver call that creates it (`cuMemAlloc`,
/// `cuMemCreate`) without the device's lock: inside it, another thread reserves and releases a
/// block the cache holds. The new memory is booked after the call, and the books are exact.
#[test]
fn growth_creates_memory_without_the_lock() {
    for stitched in [false, true] {
        let (sim, driver, pool) = hooked_pool(stitched);
        let small = pool.reserve(0, MIB, 0).unwrap();
        pool.release(small).unwrap();
        let cached = pool.stats(0).unwrap().reserved_bytes;
        let in_create = meanwhile(&pool, &driver, |d| &d.on_create);
        let big = pool.reserve(0, 64 * MIB, 0).unwrap();
        // The other thread saw only the cache: the new memory was not booked yet.
        assert_eq!(seen(&in_create, &format!("stitched {stitched}")), cached);
        let s = pool.stats(0).unwrap();
        assert_eq!(
            (
                s.reserved_bytes,
                s.allocated_bytes,
                s.driver_allocs,
                s.reserve_calls
            ),
            (cached + 64 * MIB, 64 * MIB, 2, 3),
            "stitched {stitched}: one creation each, and three reserves counted once each"
        );
        assert_eq!(sim.used_bytes(0), s.reserved_bytes);
        pool.check().unwrap();
        pool.release(big).unwrap();
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// With stitching, a range made of new memory alone is also mapped without the device's lock:
/// inside its `cuMemSetAccess` (after its `cuMemMap`), another thread reserves and releases a
/// cached block and finishes.
#[test]
fn a_range_of_new_memory_is_mapped_without_the_lock() {
    let (sim, driver, pool) = hooked_pool(true);
    let small = pool.reserve(0, MIB, 0).unwrap();
    pool.release(small).unwrap();
    let cached = pool.stats(0).unwrap().reserved_bytes;
    let in_access = meanwhile(&pool, &driver, |d| &d.on_access);
    let big = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(
        seen(&in_access, "in the new range's cuMemSetAccess"),
        cached
    );
    assert_eq!(sim.is_accessible(big + 64 * MIB - 1), Some(true));
    pool.check().unwrap();
    // The books hold while a range is being mapped: its addresses are counted as taken.
    let checked: Arc<Mutex<Option<Result<(), String>>>> = Arc::default();
    let into = checked.clone();
    on_hook(&pool, &driver.watch.on_access, move |pool| {
        *into.lock().unwrap() = Some(within(move || pool.check()));
    });
    let other = pool.reserve(0, 1024 * MIB, 0).unwrap();
    let checked = checked.lock().unwrap().take().expect("the hook ran");
    assert_eq!(checked, Ok(()));
    pool.release(other).unwrap();
    pool.release(big).unwrap();
    pool.free_reusable(None).unwrap();
    assert_returned(&*pool, sim);
}

/// While a thread creates memory without the lock, the books move on: another thread releases
/// a block that serves the request. The second pass takes the cached block, and the memory just
/// created is kept as cache (an idle segment, or spare pages), reusable and returned as any.
#[test]
fn memory_created_meanwhile_but_not_needed_stays_as_cache() {
    for stitched in [false, true] {
        let (sim, driver, pool) = hooked_pool(stitched);
        let held = pool.reserve(0, 64 * MIB, 0).unwrap();
        let cached = pool.stats(0).unwrap().reserved_bytes;
        on_hook(&pool, &driver.watch.on_create, move |pool| {
            within(move || pool.release(held).unwrap());
        });
        let p = pool.reserve(0, 64 * MIB, 0).unwrap();
        assert_eq!(p, held, "stitched {stitched}: the block released meanwhile");
        let s = pool.stats(0).unwrap();
        assert_eq!(
            (s.reserved_bytes, s.allocated_bytes, s.driver_allocs),
            (2 * cached, 64 * MIB, 2),
            "stitched {stitched}: the memory made meanwhile is cached"
        );
        assert_eq!(s.reusable_bytes, cached);
        assert_eq!(sim.used_bytes(0), s.reserved_bytes);
        pool.check().unwrap();
        // Reusable: the next request of its size takes it, creating nothing.
        let q = pool.reserve(0, 64 * MIB, 0).unwrap();
        assert_eq!(
            pool.stats(0).unwrap().driver_allocs,
            2,
            "stitched {stitched}"
        );
        pool.release(p).unwrap();
        pool.release(q).unwrap();
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// Memory being created without the lock counts against the cap: a second thread growing
/// meanwhile is refused, naming the cap, and the pool never reserves past it.
#[test]
fn growth_in_flight_counts_against_the_cap() {
    for stitched in [false, true] {
        let (sim, driver, pool) = hooked_pool(stitched);
        pool.set_memory_limit(Some(0), Some(100 * MIB)).unwrap();
        let refused: Arc<Mutex<Option<String>>> = Arc::default();
        let into = refused.clone();
        on_hook(&pool, &driver.watch.on_create, move |pool| {
            let e = within(move || pool.reserve(0, 64 * MIB, 0).unwrap_err());
            assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
            *into.lock().unwrap() = Some(e.message);
        });
        let p = pool.reserve(0, 64 * MIB, 0).unwrap();
        let message = refused.lock().unwrap().take().expect("the hook ran");
        assert!(
            message.contains("memory limit"),
            "stitched {stitched}: {message}"
        );
        let s = pool.stats(0).unwrap();
        assert_eq!((s.reserved_bytes, s.driver_allocs), (64 * MIB, 1));
        pool.check().unwrap();
        pool.release(p).unwrap();
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// A cap lowered while memory is being created without the lock: the memory, not needed any
/// more (the cache serves the request), goes back to the driver instead of past the cap.
#[test]
fn memory_created_meanwhile_goes_back_under_a_cap_lowered_meanwhile() {
    for stitched in [false, true] {
        let (sim, driver, pool) = hooked_pool(stitched);
        let held = pool.reserve(0, 64 * MIB, 0).unwrap();
        let cached = pool.stats(0).unwrap().reserved_bytes;
        on_hook(&pool, &driver.watch.on_create, move |pool| {
            within(move || {
                pool.release(held).unwrap();
                pool.set_memory_limit(Some(0), Some(cached)).unwrap();
            });
        });
        let p = pool.reserve(0, 64 * MIB, 0).unwrap();
        assert_eq!(p, held, "stitched {stitched}");
        let s = pool.stats(0).unwrap();
        assert_eq!(
            (s.reserved_bytes, s.driver_allocs, s.driver_frees),
            (cached, 2, 1),
            "stitched {stitched}: made, then returned"
        );
        assert_eq!(sim.used_bytes(0), cached);
        pool.check().unwrap();
        pool.release(p).unwrap();
        pool.free_reusable(None).unwrap();
        assert_returned(&*pool, sim);
    }
}

/// Threads on streams of four shards grow and return memory at once under a cap: the driver
/// never holds more than the cap at any moment, as each growth claims its room under the
/// device's claim lock (`DevicePool::claim`) before it makes memory. Read as of the end of each
/// other's last hold, two shards could take the same room (a shard making a segment under its
/// lock, after returning idle cache to fit, while another grew beside it).
#[test]
fn threads_growing_on_several_shards_never_pass_the_cap() {
    const CAP: u64 = 256 * MIB;
    for stitched in [false, true] {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[4 * GIB, 4 * GIB])));
        let config = PoolConfig {
            vmm: stitched,
            ..PoolConfig::default()
        };
        let pool = Pool::new(Arc::new(SimDriver::new(sim).unwrap()), config);
        pool.set_memory_limit(Some(0), Some(CAP)).unwrap();
        let streams: Vec<u64> = (0..4).map(|_| sim.stream_create(0).unwrap()).collect();
        for &stream in &streams[1..] {
            assert!(pool.own_shard(0, stream).unwrap());
        }
        let per_thread = ops_per_thread() / 4;
        let refused = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (pool, refused, stream) = (&pool, &refused, streams[t % streams.len()]);
                scope.spawn(move || {
                    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (t as u64 + 1));
                    let mut mine = Vec::new();
                    for _ in 0..per_thread {
                        if mine.len() < 3 && rng.below(3) != 0 {
                            match pool.reserve(0, 1 + rng.below(48 * MIB), stream) {
                                Ok(ptr) => mine.push(ptr),
                                Err(e) => {
                                    assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY, "{e}");
                                    refused.fetch_add(1, Relaxed);
                                }
                            }
                        } else if let Some(ptr) = pop_random(&mut mine, &mut rng) {
                            pool.release(ptr).unwrap();
                        }
                        let used = sim.used_bytes(0);
                        assert!(
                            used <= CAP,
                            "stitched {stitched}: the driver holds {} MiB under a {} MiB cap",
                            used / MIB,
                            CAP / MIB
                        );
                    }
                    for ptr in mine {
                        pool.release(ptr).unwrap();
                    }
                });
            }
        });
        // The cap was met: requests were refused along the way.
        assert!(refused.load(Relaxed) > 0, "stitched {stitched}");
        assert!(pool.stats(0).unwrap().reserved_bytes <= CAP);
        pool.free_reusable(None).unwrap();
        assert_returned(&pool, sim);
    }
}

fn pop_random<T>(v: &mut Vec<T>, rng: &mut Rng) -> Option<T> {
    if v.is_empty() {
        None
    } else {
        let i = rng.below(v.len() as u64) as usize;
        Some(v.swap_remove(i))
    }
}

/// With stitching, a pool whose cache holds a 1 MiB block and two idle 32 MiB ranges, made on
/// either side of a live one: a 64 MiB request no free block fits is then made of the two
/// idle ranges' pages alone, creating nothing. Returns the live block.
fn two_idle_ranges() -> (&'static Sim, Arc<Hooked>, Arc<Pool>, u64) {
    let (sim, driver, pool) = hooked_pool(true);
    let small = pool.reserve(0, MIB, 0).unwrap();
    pool.release(small).unwrap();
    let a = pool.reserve(0, 32 * MIB, 0).unwrap();
    let b = pool.reserve(0, 32 * MIB, 0).unwrap();
    let c = pool.reserve(0, 32 * MIB, 0).unwrap();
    pool.release(a).unwrap();
    pool.release(c).unwrap();
    (sim, driver, pool, b)
}

/// How many calls of each of `calls` the driver has made since their counts were `before`.
fn made_since<const N: usize>(sim: &Sim, calls: [cuda_sim::Call; N], before: [u64; N]) -> [u64; N] {
    let mut made = calls.map(|c| sim.call_count(c));
    for (n, then) in made.iter_mut().zip(before) {
        *n -= then;
    }
    made
}

/// The books check, `blocks` are released, everything goes back, and the driver holds nothing.
fn release_all(pool: &Arc<Pool>, sim: &Sim, blocks: &[u64]) {
    pool.check().unwrap();
    for &p in blocks {
        pool.release(p).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_returned(&**pool, sim);
}

/// What `f` returned on another thread inside `hook` (which must have run), within 20 s.
fn inside<T: Send + 'static>(
    pool: &Arc<Pool>,
    hook: &Hook,
    f: impl FnOnce(Arc<Pool>) -> T + Send + 'static,
) -> Arc<Mutex<Option<T>>> {
    let out: Arc<Mutex<Option<T>>> = Arc::default();
    let into = out.clone();
    on_hook(pool, hook, move |pool| {
        *into.lock().unwrap() = Some(within(move || f(pool)));
    });
    out
}

/// A range made of cached pages alone is mapped without the device's lock too: inside its
/// `cuMemSetAccess` (after its two `cuMemMap`), another thread reserves and releases a cached
/// block, and the books check; the range then takes those pages, with no memory created.
#[test]
fn a_range_of_cached_pages_is_mapped_without_the_lock() {
    use cuda_sim::Call::MemMap;
    let (sim, driver, pool, b) = two_idle_ranges();
    let before = pool.stats(0).unwrap();
    let maps = [MemMap].map(|c| sim.call_count(c));
    let seen = inside(&pool, &driver.watch.on_access, |pool| {
        let p = pool.reserve(0, MIB, 0).unwrap();
        pool.release(p).unwrap();
        pool.check().map(|()| pool.stats(0).unwrap().reserved_bytes)
    });
    let big = pool.reserve(0, 64 * MIB, 0).unwrap();
    let seen = seen.lock().unwrap().take().expect("the hook ran");
    assert_eq!(
        seen,
        Ok(before.reserved_bytes),
        "the cache alone, books exact"
    );
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_allocs, s.allocated_bytes),
        (before.reserved_bytes, before.driver_allocs, 96 * MIB),
        "nothing created"
    );
    assert_eq!(made_since(sim, [MemMap], maps), [2]);
    assert_eq!(sim.is_accessible(big), Some(true));
    assert_eq!(sim.is_accessible(big + 64 * MIB - 1), Some(true));
    release_all(&pool, sim, &[big, b]);
}

/// The wait for the device's work that a range of cached pages needs first (their blocks were
/// released since the last wait: work queued before may still use them) is made without the
/// device's lock too, after the range's maps: inside it, another thread reserves and releases
/// a cached block and finishes. The second pass finds the pages settled and waits no more.
#[test]
fn the_wait_before_remapping_cached_pages_is_made_without_the_lock() {
    use cuda_sim::Call::{CtxSynchronize, MemMap};
    let (sim, driver, pool, b) = two_idle_ranges();
    let before = pool.stats(0).unwrap();
    let calls = [CtxSynchronize, MemMap].map(|c| sim.call_count(c));
    let in_wait = meanwhile(&pool, &driver, |d| &d.on_sync);
    let big = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(seen(&in_wait, "in the wait"), before.reserved_bytes);
    assert_eq!(
        made_since(sim, [CtxSynchronize, MemMap], calls),
        [1, 2],
        "one wait, two maps: none made again under the lock"
    );
    assert_eq!(pool.stats(0).unwrap().driver_allocs, before.driver_allocs);
    release_all(&pool, sim, &[big, b]);
}

/// Before a growth, idle ranges of lent pages are taken apart (their pages back in their
/// lenders); one released since the last wait for the device's work needs that wait first. It
/// is made without the device's lock: inside it another thread reserves and releases a cached
/// block and finishes. The next pass takes the range apart and defers the growth in turn (a
/// range of the cached pages and new memory, made without the lock too), and a last one takes
/// it: one wait in all, one creation.
#[test]
fn the_wait_before_ranges_of_lent_pages_go_back_is_made_without_the_lock() {
    use cuda_sim::Call::{CtxSynchronize, MemUnmap};
    let (sim, driver, pool, b) = two_idle_ranges();
    // A range of the two idle ranges' pages, released: idle, made of lent pages, not settled.
    let lent = pool.reserve(0, 64 * MIB, 0).unwrap();
    pool.release(lent).unwrap();
    let before = pool.stats(0).unwrap();
    let calls = [CtxSynchronize, MemUnmap].map(|c| sim.call_count(c));
    let in_wait = meanwhile(&pool, &driver, |d| &d.on_sync);
    let big = pool.reserve(0, 128 * MIB, 0).unwrap();
    assert_eq!(seen(&in_wait, "in the wait"), before.reserved_bytes);
    assert_eq!(
        made_since(sim, [CtxSynchronize, MemUnmap], calls),
        [1, 1],
        "one wait, and the idle range unmapped"
    );
    let s = pool.stats(0).unwrap();
    assert_eq!(s.driver_allocs, before.driver_allocs + 1);
    assert_eq!(s.allocated_bytes, 160 * MIB);
    assert_eq!(sim.is_accessible(big + 128 * MIB - 1), Some(true));
    release_all(&pool, sim, &[big, b]);
}

/// The unmap of an idle range of lent pages that a growth takes apart is made without the
/// device's lock too (after the wait it needs): inside that `cuMemUnmap`, another thread
/// reserves and releases a cached block and finishes. The growth's pass after it finds the
/// range's addresses back, as a single pass would.
#[test]
fn the_unmap_of_a_range_of_lent_pages_taken_apart_is_made_without_the_lock() {
    use cuda_sim::Call::MemUnmap;
    let (sim, driver, pool, b) = two_idle_ranges();
    let lent = pool.reserve(0, 64 * MIB, 0).unwrap();
    pool.release(lent).unwrap();
    let before = pool.stats(0).unwrap();
    let unmaps = [MemUnmap].map(|c| sim.call_count(c));
    let in_unmap = meanwhile(&pool, &driver, |d| &d.on_unmap);
    let big = pool.reserve(0, 128 * MIB, 0).unwrap();
    assert_eq!(seen(&in_unmap, "in the unmap"), before.reserved_bytes);
    assert_eq!(made_since(sim, [MemUnmap], unmaps), [1]);
    assert_eq!(
        pool.stats(0).unwrap().driver_allocs,
        before.driver_allocs + 1
    );
    release_all(&pool, sim, &[big, b]);
}

/// While a range of cached pages is mapped without the lock, another thread takes one of its
/// pieces (a block it reserves and keeps). The second pass chooses again: the range made
/// meanwhile is unmapped and the request made from what is left and new memory, under the
/// lock (the books then check: no page is owned twice).
#[test]
fn cached_pages_taken_meanwhile_are_not_mapped_twice() {
    use cuda_sim::Call::MemUnmap;
    let (sim, driver, pool, b) = two_idle_ranges();
    let before = pool.stats(0).unwrap();
    let unmaps = [MemUnmap].map(|c| sim.call_count(c));
    let taken = inside(&pool, &driver.watch.on_access, |pool| {
        pool.reserve(0, 32 * MIB, 0).unwrap()
    });
    let big = pool.reserve(0, 64 * MIB, 0).unwrap();
    let taken = taken.lock().unwrap().take().expect("the hook ran");
    assert_eq!(made_since(sim, [MemUnmap], unmaps), [1]);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        s.driver_allocs,
        before.driver_allocs + 1,
        "the rest created"
    );
    assert_eq!(s.allocated_bytes, 128 * MIB);
    assert_eq!(sim.is_accessible(big + 64 * MIB - 1), Some(true));
    assert_eq!(sim.used_bytes(0), s.reserved_bytes);
    release_all(&pool, sim, &[big, b, taken]);
}

/// While a range of cached pages is mapped without the lock, another thread returns the cache
/// (`free_reusable`): the two idle ranges are taken apart, their pages spare, but the handles
/// the range maps are pinned: that sweep releases only the 1 MiB block's. The second pass finds
/// the same pages, spare now, and takes the range made meanwhile (mapped in its own order), no
/// page mapped twice and nothing created.
#[test]
fn a_sweep_meanwhile_releases_no_handle_a_range_in_flight_maps() {
    use cuda_sim::Call::{MemMap, MemRelease, MemUnmap};
    let (sim, driver, pool, b) = two_idle_ranges();
    let before = pool.stats(0).unwrap();
    let calls = [MemMap, MemUnmap, MemRelease].map(|c| sim.call_count(c));
    let returned = inside(&pool, &driver.watch.on_access, |pool| {
        pool.free_reusable(Some(0)).unwrap()
    });
    let big = pool.reserve(0, 64 * MIB, 0).unwrap();
    let returned = returned.lock().unwrap().take().expect("the hook ran");
    assert_eq!(returned, 2 * MIB, "the 1 MiB block's handle alone");
    // Two maps (the range, without the lock); three unmaps (the two idle ranges and the
    // 1 MiB block's, by the sweep); one release (that block's handle).
    assert_eq!(
        made_since(sim, [MemMap, MemUnmap, MemRelease], calls),
        [2, 3, 1]
    );
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_allocs, s.allocated_bytes),
        (96 * MIB, before.driver_allocs, 96 * MIB)
    );
    assert_eq!(sim.is_accessible(big + 64 * MIB - 1), Some(true));
    assert_eq!(sim.used_bytes(0), s.reserved_bytes);
    release_all(&pool, sim, &[big, b]);
}
