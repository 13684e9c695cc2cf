//! Hostile input at the Rust level: every exported function through the rlib with NULL, garbage
//! and interior pointers, pointers and streams of another device, extreme sizes and device
//! ordinals; a driver that panics while the pool holds a device lock.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cuda_sim::Sim;
use resmem::capi::*;
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Pool, PoolConfig};

mod common;
use common::spy::{Spy, Watch};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn leaked_sim(capacities: &[u64]) -> &'static Sim {
    Box::leak(Box::new(Sim::new(capacities)))
}

/// The process-wide pool on two simulated 4 GiB devices (every test sets the same variables).
/// The guard keeps the tests that use the C API (and `RESMEM_TEST_PANIC`) one at a time.
fn setup() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("RESMEM_DRIVER", "sim");
    std::env::set_var("CUDA_SIM_DEVICES", "4GiB,4GiB");
    std::env::remove_var("RESMEM_CONF");
    guard
}

fn last_error() -> String {
    // SAFETY: rm_last_error returns a NUL-terminated string valid until the next failing call.
    unsafe { CStr::from_ptr(rm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn reserve(device: i32, size: usize) -> (rm_status, *mut c_void) {
    let mut p = 1 as *mut c_void;
    // SAFETY: &mut p is valid for writing a pointer.
    let status = unsafe { rm_reserve(device, size, null_mut(), &mut p) };
    (status, p)
}

fn stats(device: i32) -> rm_stats {
    let mut s = rm_stats::default();
    // SAFETY: &mut s is valid for writing an rm_stats.
    assert_eq!(
        unsafe { rm_get_stats(device, &mut s) },
        rm_status::RM_SUCCESS
    );
    s
}

#[test]
fn every_export_refuses_bad_pointers_sizes_and_devices() {
    let _one = setup();
    let (status, p) = reserve(0, 4096);
    assert_eq!(status, rm_status::RM_SUCCESS, "{}", last_error());
    let (status, q) = reserve(1, 3 * MIB as usize);
    assert_eq!(status, rm_status::RM_SUCCESS);
    let before = (stats(0), stats(1));
    let addr = p as usize;
    let garbage: Vec<usize> = vec![
        1,
        511,
        0x1000,
        0xdead_beef,
        usize::MAX,
        usize::MAX - 511,
        addr + 1,
        addr + 511,
        addr + 512,
        addr + 4095,
        addr + 4096,
        addr + 2 * MIB as usize - 1,
        q as usize + 512,
    ];
    for &g in &garbage {
        // SAFETY: the pointers are looked up, never dereferenced.
        unsafe {
            assert_eq!(
                rm_release(g as *mut c_void),
                rm_status::RM_ERROR_INVALID_POINTER,
                "{g:#x}"
            );
            assert!(last_error().starts_with("rm_release: "), "{}", last_error());
            assert_eq!(
                rm_record_stream(g as *mut c_void, null_mut()),
                rm_status::RM_ERROR_INVALID_POINTER,
                "{g:#x}"
            );
        }
    }
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            rm_record_stream(null_mut(), null_mut()),
            rm_status::RM_ERROR_INVALID_POINTER
        );
        assert_eq!(rm_release(null_mut()), rm_status::RM_SUCCESS);
    }
    for size in [usize::MAX, usize::MAX - 511, usize::MAX - (2 << 20) + 2] {
        let (status, out) = reserve(0, size);
        assert_eq!(
            status,
            rm_status::RM_ERROR_INVALID_VALUE,
            "{size}: {}",
            last_error()
        );
        assert!(out.is_null());
    }
    for size in [usize::MAX / 2, 5 * GIB as usize] {
        let (status, out) = reserve(0, size);
        assert_eq!(
            status,
            rm_status::RM_ERROR_OUT_OF_MEMORY,
            "{size}: {}",
            last_error()
        );
        assert!(out.is_null());
    }
    let (status, out) = reserve(0, 0);
    assert_eq!((status, out), (rm_status::RM_SUCCESS, null_mut()));
    for device in [-1, -2, 2, i32::MAX, i32::MIN] {
        let (mut f, mut t) = (0usize, 0usize);
        let mut s = rm_stats::default();
        // SAFETY: every out-pointer is valid.
        unsafe {
            assert_eq!(reserve(device, 512).0, rm_status::RM_ERROR_INVALID_DEVICE);
            assert!(last_error().contains(&format!("device {device} is out of range")));
            assert_eq!(
                rm_mem_get_info(device, &mut f, &mut t),
                rm_status::RM_ERROR_INVALID_DEVICE
            );
            assert_eq!(rm_warmup(device, 1), rm_status::RM_ERROR_INVALID_DEVICE);
            let mut p = 1 as *mut c_void;
            assert_eq!(
                rm_reserve_no_wait(device, 512, null_mut(), &mut p),
                rm_status::RM_ERROR_INVALID_DEVICE
            );
            assert!(p.is_null());
            assert_eq!(
                rm_get_stats(device, &mut s),
                rm_status::RM_ERROR_INVALID_DEVICE
            );
            assert_eq!(
                rm_reset_peak_stats(device),
                rm_status::RM_ERROR_INVALID_DEVICE
            );
            let want = if device == -1 {
                rm_status::RM_SUCCESS
            } else {
                rm_status::RM_ERROR_INVALID_DEVICE
            };
            assert_eq!(rm_free_reusable(device, null_mut()), want, "{device}");
        }
    }
    // SAFETY: NULL out-pointers are refused, not written.
    unsafe {
        let mut f = 0usize;
        assert_eq!(
            rm_mem_get_info(0, null_mut(), &mut f),
            rm_status::RM_ERROR_INVALID_VALUE
        );
        assert_eq!(
            rm_mem_get_info(0, &mut f, null_mut()),
            rm_status::RM_ERROR_INVALID_VALUE
        );
        assert_eq!(
            rm_reserve(0, 512, null_mut(), null_mut()),
            rm_status::RM_ERROR_INVALID_VALUE
        );
        assert_eq!(
            rm_reserve_no_wait(0, 512, null_mut(), null_mut()),
            rm_status::RM_ERROR_INVALID_VALUE
        );
        assert!(last_error().starts_with("rm_reserve_no_wait: "));
        let mut p = 1 as *mut c_void;
        assert_eq!(
            rm_reserve_no_wait(0, usize::MAX, null_mut(), &mut p),
            rm_status::RM_ERROR_INVALID_VALUE
        );
        assert!(p.is_null());
        assert_eq!(
            rm_get_stats(0, null_mut()),
            rm_status::RM_ERROR_INVALID_VALUE
        );
        assert_eq!(rm_warmup(0, usize::MAX), rm_status::RM_ERROR_INVALID_VALUE);
        assert_eq!(rm_warmup(0, 0), rm_status::RM_SUCCESS);
    }
    for raw in [i32::MIN, -1, 8, 1000, i32::MAX] {
        // SAFETY: a static NUL-terminated string.
        let text = unsafe { CStr::from_ptr(rm_status_string(raw)) };
        assert_eq!(text.to_str().unwrap(), "unknown rm_status value");
    }
    // Nothing changed, and the blocks are still good.
    let mut after = (stats(0), stats(1));
    after.0.ooms = before.0.ooms;
    after.0.reserve_calls = before.0.reserve_calls;
    assert_eq!(after.0.allocated_bytes, before.0.allocated_bytes);
    assert_eq!(after.1, before.1);
    // SAFETY: both were returned by rm_reserve.
    unsafe {
        assert_eq!(rm_release(p), rm_status::RM_SUCCESS);
        assert_eq!(rm_release(q), rm_status::RM_SUCCESS);
    }
}

/// Debug builds only: `RESMEM_TEST_PANIC` forces a panic in debug builds alone
/// (`capi::test_panic`), so a release build has none to catch.
#[cfg(debug_assertions)]
#[test]
fn a_forced_panic_is_internal_and_the_library_stays_usable() {
    let _one = setup();
    std::env::set_var("RESMEM_TEST_PANIC", "rm_warmup");
    // SAFETY: values only.
    let status = unsafe { rm_warmup(0, 1) };
    std::env::remove_var("RESMEM_TEST_PANIC");
    assert_eq!(status, rm_status::RM_ERROR_INTERNAL);
    assert!(
        last_error().starts_with("rm_warmup: internal error (RESMEM_TEST_PANIC=rm_warmup)"),
        "{}",
        last_error()
    );
    let (status, p) = reserve(0, 100);
    assert_eq!(status, rm_status::RM_SUCCESS);
    // SAFETY: returned by rm_reserve.
    assert_eq!(unsafe { rm_release(p) }, rm_status::RM_SUCCESS);
}

/// What panics in the simulated driver: `cuMemAlloc_v2` and `cuMemCreate` while `armed`,
/// `cuMemFree_v2` and `cuMemUnmap` while `frees_armed`, `cuMemGetInfo_v2` while `info_armed`,
/// `cuMemMap` while `map_armed`, `cuEventQuery` while `query_armed` (which a `cuMemAlloc_v2` that
/// succeeds arms while `arm_query` is set).
#[derive(Default)]
struct Explode {
    armed: AtomicBool,
    frees_armed: AtomicBool,
    info_armed: AtomicBool,
    map_armed: AtomicBool,
    query_armed: AtomicBool,
    arm_query: AtomicBool,
}

impl Watch for Explode {
    fn before(&self, call: &'static str, _device: i32) {
        let armed = match call {
            "cuMemAlloc_v2" | "cuMemCreate" => &self.armed,
            "cuMemFree_v2" | "cuMemUnmap" => &self.frees_armed,
            "cuMemGetInfo_v2" => &self.info_armed,
            "cuMemMap" => &self.map_armed,
            "cuEventQuery" => &self.query_armed,
            _ => return,
        };
        if armed.load(Ordering::SeqCst) {
            panic!("driver exploded");
        }
    }

    fn after(&self, call: &'static str, _device: i32) {
        if call == "cuMemAlloc_v2" && self.arm_query.load(Ordering::SeqCst) {
            self.query_armed.store(true, Ordering::SeqCst);
        }
    }
}

/// The simulated driver, panicking as [`Explode`] says.
type PanickingDriver = Spy<Explode>;

fn panicking_driver(sim: &'static Sim) -> PanickingDriver {
    Spy {
        sim: SimDriver::new(sim).unwrap(),
        watch: Explode::default(),
    }
}

/// A pool over a 4 GiB simulated device behind a [`PanickingDriver`], stitched (`vmm`) or not.
fn panicking_pool(vmm: bool) -> (&'static Sim, Arc<PanickingDriver>, Pool) {
    let sim = leaked_sim(&[4 * GIB]);
    let driver = Arc::new(panicking_driver(sim));
    let config = PoolConfig {
        vmm,
        ..PoolConfig::default()
    };
    let pool = Pool::new(driver.clone(), config);
    (sim, driver, pool)
}

/// A reserve of `size` bytes with `armed` set, so that the driver panics in it: its error, which
/// must be `RM_ERROR_DRIVER` saying the driver panicked (`what` names the case). `armed` is
/// cleared again.
fn reserve_while_armed(pool: &Pool, armed: &AtomicBool, size: u64, what: &str) -> resmem::Error {
    armed.store(true, Ordering::SeqCst);
    let e = pool.reserve(0, size, 0).unwrap_err();
    armed.store(false, Ordering::SeqCst);
    assert_eq!(e.status, rm_status::RM_ERROR_DRIVER, "{what}");
    assert!(e.message.contains("the driver panicked"), "{what}: {e}");
    e
}

/// `blocks` are released, everything goes back, the driver holds nothing, and the books check.
fn release_all(pool: &Pool, sim: &Sim, blocks: &[u64]) {
    for &p in blocks {
        pool.release(p).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
    pool.check().unwrap();
}

#[test]
fn a_lock_poisoned_by_a_panic_is_taken_over() {
    let sim = leaked_sim(&[4 * GIB]);
    let driver = Arc::new(panicking_driver(sim));
    let pool = Arc::new(Pool::new(driver.clone(), PoolConfig::default()));
    let a = pool.reserve(0, 4096, 0).unwrap();
    driver.watch.info_armed.store(true, Ordering::SeqCst);
    // Growth asks for the driver's free memory under the device's lock: the panic unwinds out
    // of it, poisoning it.
    let p = pool.clone();
    let outcome = std::thread::spawn(move || p.reserve(0, 64 * MIB, 0)).join();
    assert!(outcome.is_err(), "the driver panicked");
    driver.watch.info_armed.store(false, Ordering::SeqCst);
    pool.check().unwrap();
    let b = pool.reserve(0, 64 * MIB, 0).unwrap();
    release_all(&pool, sim, &[a, b]);
}

/// Growth creates memory without the device's lock (`cuMemAlloc`, `cuMemCreate`): a driver
/// that panics there fails the reserve with an error instead, nothing stays counted in flight
/// (a cap is not shrunk by it), the books are exact, and the next reserve grows.
#[test]
fn a_driver_panicking_while_it_creates_memory_fails_the_reserve() {
    for vmm in [false, true] {
        let (sim, driver, pool) = panicking_pool(vmm);
        pool.set_memory_limit(Some(0), Some(64 * MIB)).unwrap();
        reserve_while_armed(&pool, &driver.watch.armed, 64 * MIB, &format!("vmm {vmm}"));
        pool.check().unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!((s.reserved_bytes, s.driver_allocs), (0, 0), "vmm {vmm}");
        let p = pool.reserve(0, 64 * MIB, 0).expect("the whole cap is left");
        assert_eq!(sim.used_bytes(0), 64 * MIB, "vmm {vmm}");
        pool.release(p).unwrap();
        assert_eq!(pool.free_reusable(None).unwrap(), 64 * MIB, "vmm {vmm}");
        pool.check().unwrap();
    }
}

/// Memory a growth made without the lock is booked even when the pass that was to take it
/// unwinds: the driver panics in the second pass, under the lock, at the `cuEventQuery` asking
/// after a block pending on another stream's work (armed once `cuMemAlloc` returned). The lock is
/// taken over, the new segment is in the books (reserved = what the driver holds), and
/// everything goes back.
#[test]
fn memory_made_without_the_lock_is_booked_when_the_second_pass_panics() {
    let (sim, driver, pool) = panicking_pool(false);
    let pool = Arc::new(pool);
    let other = sim.stream_create(0).unwrap();
    let shared = pool.reserve(0, MIB, 0).unwrap();
    pool.record_stream(shared, other).unwrap();
    sim.enqueue_work(0, other).unwrap();
    pool.release(shared).unwrap();
    driver.watch.arm_query.store(true, Ordering::SeqCst);
    let p = pool.clone();
    let outcome = std::thread::spawn(move || p.reserve(0, 64 * MIB, 0)).join();
    assert!(outcome.is_err(), "the driver panicked in the second pass");
    driver.watch.arm_query.store(false, Ordering::SeqCst);
    driver.watch.query_armed.store(false, Ordering::SeqCst);
    pool.check().unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        s.reserved_bytes,
        sim.used_bytes(0),
        "the new segment is booked"
    );
    assert_eq!(s.reserved_bytes, 2 * MIB + 64 * MIB);
    sim.complete_work(0, other).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 66 * MIB);
    assert_eq!(sim.used_bytes(0), 0);
    pool.check().unwrap();
}

/// With stitching, a range of new memory alone is mapped without the device's lock too: a
/// driver that panics in that `cuMemMap` fails the reserve with an error naming the mapping; the
/// handle just created stays as reusable cache with exact books, and serves the next reserve.
#[test]
fn a_driver_panicking_while_it_maps_a_new_range_fails_the_reserve() {
    let (sim, driver, pool) = panicking_pool(true);
    let e = reserve_while_armed(&pool, &driver.watch.map_armed, 64 * MIB, "a new range");
    assert!(e.message.contains("mapping new memory"), "{e}");
    pool.check().unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.allocated_bytes, s.driver_allocs), (0, 1));
    assert_eq!(s.reusable_bytes, s.reserved_bytes);
    assert_eq!(sim.used_bytes(0), s.reserved_bytes);
    let p = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(
        pool.stats(0).unwrap().driver_allocs,
        1,
        "made from the handle kept"
    );
    release_all(&pool, sim, &[p]);
}

/// The same for a range made of cached pages alone (two idle 32 MiB ranges for a 64 MiB
/// request), mapped without the lock: the reserve fails, the pages stay cached where they were
/// (no page left mapped in the range not made), and the next reserve makes the range from them,
/// creating nothing.
#[test]
fn a_driver_panicking_while_it_maps_cached_pages_fails_the_reserve() {
    let (sim, driver, pool) = panicking_pool(true);
    let blocks: Vec<u64> = (0..3)
        .map(|_| pool.reserve(0, 32 * MIB, 0).unwrap())
        .collect();
    pool.release(blocks[0]).unwrap();
    pool.release(blocks[2]).unwrap();
    let mapped = sim.mappings(0).len();
    let e = reserve_while_armed(&pool, &driver.watch.map_armed, 64 * MIB, "cached pages");
    assert!(e.message.contains("mapping cached memory"), "{e}");
    assert_eq!(sim.mappings(0).len(), mapped, "nothing left mapped");
    pool.check().unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (
            s.allocated_bytes,
            s.reusable_bytes,
            s.reserved_bytes,
            s.driver_allocs
        ),
        (32 * MIB, 64 * MIB, 96 * MIB, 3)
    );
    let p = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(
        pool.stats(0).unwrap().driver_allocs,
        3,
        "made from the cache"
    );
    assert_eq!(sim.is_accessible(p + 64 * MIB - 1), Some(true));
    release_all(&pool, sim, &[p, blocks[1]]);
}

/// `free_reusable` makes the calls that return memory without the device's lock, after the
/// memory left the books: a driver that panics in one of them fails the call with an error, and
/// the books take the memory back (the rest of the batch's calls unmade), exact; the next
/// `free_reusable` returns it.
#[test]
fn a_driver_panicking_while_memory_goes_back_leaves_exact_books() {
    for vmm in [false, true] {
        let (sim, driver, pool) = panicking_pool(vmm);
        let blocks: Vec<u64> = (0..3)
            .map(|_| pool.reserve(0, 64 * MIB, 0).unwrap())
            .collect();
        for p in blocks {
            pool.release(p).unwrap();
        }
        let reserved = pool.stats(0).unwrap().reserved_bytes;
        driver.watch.frees_armed.store(true, Ordering::SeqCst);
        let e = pool.free_reusable(None).unwrap_err();
        driver.watch.frees_armed.store(false, Ordering::SeqCst);
        assert_eq!(e.status, rm_status::RM_ERROR_DRIVER, "vmm {vmm}");
        assert!(e.message.contains("the driver panicked"), "vmm {vmm}: {e}");
        pool.check().unwrap();
        assert_eq!(pool.stats(0).unwrap().reserved_bytes, reserved, "vmm {vmm}");
        assert_eq!(sim.used_bytes(0), reserved, "vmm {vmm}");
        assert_eq!(pool.free_reusable(None).unwrap(), reserved, "vmm {vmm}");
        assert_eq!(sim.used_bytes(0), 0, "vmm {vmm}");
        pool.check().unwrap();
    }
}

#[test]
fn a_block_recorded_on_another_devices_stream_can_still_be_released() {
    let sim = leaked_sim(&[4 * GIB, 4 * GIB]);
    let pool = Pool::new(
        Arc::new(SimDriver::new(sim).unwrap()),
        PoolConfig::default(),
    );
    let other_device_stream = sim.stream_create(0).unwrap();
    let p = pool.reserve(1, 4096, 0).unwrap();
    pool.record_stream(p, other_device_stream).unwrap();
    pool.release(p).expect("release of a live block");
    pool.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(1), 0);
}

#[test]
fn the_memory_limit_message_reads_as_one_sentence() {
    let sim = leaked_sim(&[4 * GIB]);
    let pool = Pool::new(
        Arc::new(SimDriver::new(sim).unwrap()),
        PoolConfig::default(),
    );
    pool.set_memory_limit(Some(0), Some(64 * MIB)).unwrap();
    let e = pool.reserve(0, 128 * MIB, 0).unwrap_err();
    assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(!e.message.contains("  "), "{}", e.message);
}
