//! The pool over the real loading path: `CudaDriver` opens a driver library with `dlopen`,
//! resolves its table, and runs every call in the device's primary context.
//!
//! By default the library is `libcuda_sim.so`, so this runs everywhere; with
//! `RESMEM_TEST_CUDA_LIBRARY=libcuda.so.1` it runs on a real GPU (`scripts/gpu-check.sh` does).
//! Checks that need simulated kernels (work that stays queued until the test completes it) run
//! only where the library exports the simulator's test hooks.

mod common;

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::Arc;
use std::time::Instant;

use common::hooks::SimHooks;
use resmem::driver::cuda::CudaDriver;
use resmem::driver::pages::PageHandles;
use resmem::driver::{per_thread, Driver};
use resmem::{Pool, PoolConfig};

const MIB: u64 = 1 << 20;
const CUDA_ERROR_NOT_READY: c_int = 600;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
const RTLD_NOW: c_int = 2;

type Fn1 = unsafe extern "C" fn(*mut c_void) -> c_int;
type Fn2 = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type RetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;

/// The handful of extra driver calls the test itself makes (streams, and the simulator's hooks).
struct Extra {
    stream_create: Fn2,
    stream_query: Fn1,
    stream_synchronize: Fn1,
    ctx_push: Fn1,
    ctx_pop: Fn1,
    primary_ctx_retain: RetainFn,
    /// The simulator's hooks, where the library is the simulator.
    sim: Option<SimHooks>,
}

/// The driver library loaded as resmem loads it: handles of one page each where the driver
/// maps only from an allocation's start.
fn loaded(library: &str) -> Arc<PageHandles<CudaDriver>> {
    Arc::new(PageHandles::new(
        CudaDriver::load(library).expect("load the driver library"),
    ))
}

fn library() -> String {
    std::env::var("RESMEM_TEST_CUDA_LIBRARY").unwrap_or_else(|_| {
        common::artifacts()
            .lib_dir
            .join("libcuda_sim.so")
            .display()
            .to_string()
    })
}

fn extra(library: &str) -> Extra {
    let name = CString::new(library).unwrap();
    // SAFETY: a NUL-terminated path; the same library CudaDriver opened, so the same handle.
    let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW) };
    assert!(!handle.is_null(), "dlopen {library}");
    let sym = |s: &str| {
        let s = CString::new(s).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        unsafe { dlsym(handle, s.as_ptr()) }
    };
    let required = |s: &str| {
        let p = sym(s);
        assert!(!p.is_null(), "{library} lacks {s}");
        p
    };
    // SAFETY: each symbol is non-null and is the driver function of that name, with the
    // declared signature.
    unsafe {
        Extra {
            stream_create: std::mem::transmute::<*mut c_void, Fn2>(required("cuStreamCreate")),
            stream_query: std::mem::transmute::<*mut c_void, Fn1>(required("cuStreamQuery")),
            stream_synchronize: std::mem::transmute::<*mut c_void, Fn1>(required(
                "cuStreamSynchronize",
            )),
            ctx_push: std::mem::transmute::<*mut c_void, Fn1>(required("cuCtxPushCurrent_v2")),
            ctx_pop: std::mem::transmute::<*mut c_void, Fn1>(required("cuCtxPopCurrent_v2")),
            primary_ctx_retain: std::mem::transmute::<*mut c_void, RetainFn>(required(
                "cuDevicePrimaryCtxRetain",
            )),
            sim: SimHooks::find(library),
        }
    }
}

impl Extra {
    /// `f` with the device's primary context current on the calling thread, as creating a
    /// stream and the driver's special stream handles need.
    fn in_context<T>(&self, f: impl FnOnce() -> T) -> T {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the context is pushed and popped around `f`.
        unsafe {
            assert_eq!((self.primary_ctx_retain)(&mut ctx, 0), 0);
            assert_eq!((self.ctx_push)(ctx), 0);
        }
        let done = f();
        let mut popped = std::ptr::null_mut();
        // SAFETY: as above.
        unsafe { assert_eq!((self.ctx_pop)((&mut popped as *mut *mut c_void).cast()), 0) };
        done
    }

    fn stream(&self) -> u64 {
        let mut stream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer, with the context current.
        self.in_context(|| unsafe { assert_eq!((self.stream_create)(&mut stream, 1), 0) });
        stream as u64
    }
}

/// The tests share one driver (and its devices): they run one at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn the_pool_works_through_the_loaded_driver() {
    let _serial = one_at_a_time();
    let library = library();
    let driver = loaded(&library);
    println!(
        "{} with {} device(s)",
        driver.describe(),
        driver.device_count()
    );
    let pool = Pool::new(driver.clone(), PoolConfig::default());
    let x = extra(&library);
    let simulated = x.sim.is_some();

    // Reserve, release, and see the block counted as free.
    let (free0, total) = pool.mem_get_info(0).unwrap();
    let p = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(p % 512, 0);
    pool.release(p).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.reusable_bytes), (64 * MIB, 64 * MIB));
    let (driver_free, driver_total) = driver.mem_get_info(0).unwrap();
    assert_eq!(driver_total, total);
    let (free, _) = pool.mem_get_info(0).unwrap();
    if simulated {
        assert_eq!(free, driver_free + 64 * MIB);
        assert_eq!(free, free0);
    }
    assert_eq!(
        pool.reserve(0, 64 * MIB, 0).unwrap(),
        p,
        "served from cache"
    );
    pool.release(p).unwrap();

    // Another stream takes the idle segment, ordered after the first stream's work.
    let (s1, s2) = (x.stream(), x.stream());
    let a = pool.reserve(0, 8 * MIB, s1).unwrap();
    if let Some(sim) = &x.sim {
        assert_eq!(sim.enqueue(s1), 0);
    }
    pool.release(a).unwrap();
    let b = pool.reserve(0, 8 * MIB, s2).unwrap();
    assert_eq!(b, a, "the idle segment moved to the other stream");
    if let Some(sim) = &x.sim {
        // SAFETY: a stream of this driver.
        assert_eq!(
            unsafe { (x.stream_query)(s1 as *mut c_void) },
            CUDA_ERROR_NOT_READY
        );
        assert_eq!(sim.enqueue(s2), 0);
        assert_eq!(sim.complete(s2), 0);
        // SAFETY: as above.
        assert_eq!(
            unsafe { (x.stream_query)(s1 as *mut c_void) },
            0,
            "s2 waited for s1"
        );
    }
    pool.release(b).unwrap();

    // record_stream: the block waits for the other stream's work.
    let fence = pool.reserve(0, 512, s1).unwrap();
    let c = pool.reserve(0, 4096, s1).unwrap();
    pool.record_stream(c, s2).unwrap();
    if let Some(sim) = &x.sim {
        assert_eq!(sim.enqueue(s2), 0);
    }
    pool.release(c).unwrap();
    let held = simulated.then(|| {
        let d = pool.reserve(0, 4096, s1).unwrap();
        assert_ne!(d, c, "s2 may still use it");
        d
    });
    // SAFETY: a stream of this driver.
    assert_eq!(unsafe { (x.stream_synchronize)(s2 as *mut c_void) }, 0);
    let e = pool.reserve(0, 4096, s1).unwrap();
    assert_eq!(e, c, "reusable after s2's work");
    pool.release(e).unwrap();
    if let Some(d) = held {
        pool.release(d).unwrap();
    }
    pool.check().unwrap();

    // A cache-hit pair's cost on this machine (printed, not asserted).
    let n = 200_000;
    let start = Instant::now();
    for _ in 0..n {
        let p = pool.reserve(0, 4096, s1).unwrap();
        pool.release(p).unwrap();
    }
    println!(
        "cache-hit reserve+release pair: {:.1} ns",
        start.elapsed().as_nanos() as f64 / n as f64
    );

    // Everything idle goes back to the driver.
    pool.release(fence).unwrap();
    let returned = pool.free_reusable(None).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.allocated_bytes, s.segments), (0, 0, 0));
    // The 8 MiB blocks came from the idle 64 MiB segment; with the virtual-memory API the small
    // blocks' 2 MiB range was made from its free pages too, else it is a segment of its own.
    let small = if driver.vmm_granularity(0).is_some() {
        0
    } else {
        2 * MIB
    };
    assert_eq!(returned, 64 * MIB + small);
    if simulated {
        assert_eq!(pool.mem_get_info(0).unwrap(), (free0, total));
    }
}

#[test]
fn each_threads_per_thread_stream_is_a_stream_of_its_own_through_the_loaded_driver() {
    let _serial = one_at_a_time();
    let library = library();
    let pool = Pool::new(loaded(&library), PoolConfig::default());
    let x = extra(&library);
    let (to_first, first_rx) = std::sync::mpsc::channel::<()>();
    let (from_first, first) = std::sync::mpsc::channel::<c_int>();
    let (pool, x) = (&pool, &x);
    std::thread::scope(|scope| {
        let first_thread = scope.spawn(move || {
            // This thread's per-thread stream, by its key: its block comes back at once.
            let mine = per_thread::key(per_thread::CU_STREAM_PER_THREAD);
            let a = pool.reserve(0, 8 * MIB, mine).unwrap();
            if let Some(sim) = &x.sim {
                let queued = x.in_context(|| sim.enqueue(per_thread::CU_STREAM_PER_THREAD));
                assert_eq!(queued, 0);
            }
            pool.release(a).unwrap();
            assert_eq!(pool.reserve(0, 8 * MIB, mine).unwrap(), a);
            pool.release(a).unwrap();
            from_first.send(0).unwrap();
            first_rx.recv().unwrap();
            // SAFETY: the per-thread stream's handle, with a context current.
            let query = x.sim.as_ref().map_or(0, |_| {
                x.in_context(|| unsafe { (x.stream_query)(2 as *mut c_void) })
            });
            from_first.send(query).unwrap();
            a
        });
        first.recv().unwrap();
        // Another thread's: the idle segment moves to it only after the device's work (no
        // handle names the first thread's stream here, so the pool waits for the device).
        let b = scope
            .spawn(move || {
                pool.reserve(
                    0,
                    8 * MIB,
                    per_thread::key(per_thread::CU_STREAM_PER_THREAD),
                )
                .unwrap()
            })
            .join()
            .unwrap();
        to_first.send(()).unwrap();
        assert_eq!(first.recv().unwrap(), 0, "the first thread's work is done");
        assert_eq!(first_thread.join().unwrap(), b, "the idle segment moved");
        // A block used on a third thread's per-thread stream (record_stream) is released with
        // an event recorded there.
        scope.spawn(move || {
            let c = pool.reserve(0, 4096, 0).unwrap();
            pool.record_stream(c, per_thread::key(per_thread::CU_STREAM_PER_THREAD))
                .unwrap();
            pool.release(c).unwrap();
            pool.release(b).unwrap();
        });
    });
    pool.check().unwrap();
    pool.free_reusable(None).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0);
}

#[test]
fn stitching_through_the_loaded_driver() {
    let _serial = one_at_a_time();
    let library = library();
    let driver = loaded(&library);
    if driver.vmm_granularity(0).is_none() {
        println!(
            "{}: no virtual-memory API on device 0; stitching not exercised",
            driver.describe()
        );
        return;
    }
    let pool = Pool::new(driver.clone(), PoolConfig::default());
    // 32 cached 32 MiB segments, each its own handle.
    let ptrs: Vec<u64> = (0..32)
        .map(|_| pool.reserve(0, 32 * MIB, 0).unwrap())
        .collect();
    for &p in &ptrs {
        pool.release(p).unwrap();
    }
    let before = pool.stats(0).unwrap();
    assert_eq!((before.reserved_bytes, before.segments), (1024 * MIB, 32));
    let start = Instant::now();
    let big = pool.reserve(0, 1024 * MIB, 0).unwrap();
    let elapsed = start.elapsed();
    let after = pool.stats(0).unwrap();
    assert_eq!(
        after.reserved_bytes,
        1024 * MIB,
        "made from the cache, nothing created"
    );
    assert_eq!(after.driver_allocs, before.driver_allocs);
    // The 32 lenders stay, all holes, and the new range.
    assert_eq!(after.segments, 33);
    // One reserve, 32 maps (the same pages mapped a second time; 512 where the driver maps only
    // from an allocation's start, a page at a time) and one access call; nothing is unmapped.
    let offsets = driver.inner().vmm_granularity(0).is_some();
    let calls = 1 + if offsets { 32 } else { 512 } + 1;
    println!(
        "made a 1 GiB range from 32 cached 32 MiB segments in {:.2} ms ({:.1} us per driver call, {calls} calls{})",
        elapsed.as_secs_f64() * 1e3,
        elapsed.as_secs_f64() * 1e6 / calls as f64,
        if offsets {
            ""
        } else {
            "; handles of one page each: the driver maps only from an allocation's start"
        }
    );
    pool.release(big).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 1024 * MIB);
    pool.check().unwrap();
}

/// Takes the GPUDirect RDMA flag again when the test ends, however it ends.
struct RdmaBack<'a>(&'a SimHooks);

impl Drop for RdmaBack<'_> {
    fn drop(&mut self) {
        self.0.set_gpu_direct_rdma(true);
    }
}

#[test]
fn created_memory_is_gpu_direct_rdma_capable_where_the_device_allows_it() {
    let _serial = one_at_a_time();
    let library = library();
    let driver = loaded(&library);
    if driver.vmm_granularity(0).is_none() && driver.vmm_whole_granularity(0).is_none() {
        println!("{}: no virtual-memory API on device 0", driver.describe());
        return;
    }
    let capable = driver.inner().rdma_capable(0);
    println!(
        "{}: GPUDirect RDMA with cuMemCreate on device 0: {capable}",
        driver.describe()
    );
    let pool = Pool::new(driver.clone(), PoolConfig::default());
    let p = pool.reserve(0, 64 * MIB, 0).unwrap();
    let Some(hooks) = SimHooks::find(&library) else {
        pool.release(p).unwrap();
        return;
    };
    assert!(capable, "the simulated devices take the flag by default");
    assert_eq!(
        hooks.rdma_capable(),
        hooks.used(),
        "every handle made with the flag"
    );
    pool.release(p).unwrap();
    pool.free_reusable(None).unwrap();
    // A device that does not take the flag (an integrated GPU): asked, it says no, and memory
    // is created without the flag rather than refused.
    {
        let _back = RdmaBack(&hooks);
        hooks.set_gpu_direct_rdma(false);
        let driver = loaded(&library);
        assert!(!driver.inner().rdma_capable(0));
        let pool = Pool::new(driver, PoolConfig::default());
        let p = pool.reserve(0, 64 * MIB, 0).unwrap();
        assert_eq!(hooks.rdma_capable(), 0);
        assert!(hooks.used() >= 64 * MIB);
        pool.release(p).unwrap();
        pool.free_reusable(None).unwrap();
        pool.check().unwrap();
    }
    // A fresh driver and pool, and a fault on the pool's first creation (the driver's probe of
    // offset mappings creates memory too: made first, so that the fault falls on the pool's).
    let faulted = |fault: &str| {
        let driver = loaded(&library);
        driver.vmm_granularity(0);
        let pool = Pool::new(driver.clone(), PoolConfig::default());
        let failed = hooks.injected();
        hooks.inject(fault);
        (driver, pool, failed)
    };
    // A creation that fails for another reason (a device in an error state): its error goes
    // back as it is, with no second creation, and the flag is kept.
    let (driver, pool, failed) = faulted("cuMemCreate@1=719");
    let err = pool.reserve(0, 64 * MIB, 0).unwrap_err();
    hooks.clear();
    assert!(err.to_string().contains("(719)"), "{err}");
    assert_eq!(hooks.injected() - failed, 1);
    assert!(driver.inner().rdma_capable(0));
    assert_eq!(hooks.used(), 0);
    // A driver that says the device takes the flag and refuses a creation with it all the
    // same: the creation is made again without it, and the flag never asked for again.
    let (driver, pool, failed) = faulted("cuMemCreate@1=1");
    let p = pool.reserve(0, 64 * MIB, 0).unwrap();
    hooks.clear();
    assert_eq!(hooks.injected() - failed, 1);
    assert!(!driver.inner().rdma_capable(0));
    assert_eq!(hooks.rdma_capable(), 0);
    pool.release(p).unwrap();
    pool.free_reusable(None).unwrap();
    pool.check().unwrap();
}

/// Maps at offsets again when the test ends, however it ends.
struct OffsetsBack<'a>(&'a SimHooks);

impl Drop for OffsetsBack<'_> {
    fn drop(&mut self) {
        self.0.refuse_map_offsets(false);
    }
}

#[test]
fn a_driver_that_maps_only_from_an_allocations_start_gets_handles_of_pages_or_parts() {
    let _serial = one_at_a_time();
    let library = library();
    let Some(hooks) = SimHooks::find(&library) else {
        println!("{library} is not the simulator: its mappings are what they are");
        return;
    };
    let used = hooks.used();
    hooks.refuse_map_offsets(true);
    let _back = OffsetsBack(&hooks);
    // The probe finds out, and gives back all it took.
    let raw = CudaDriver::load(&library).expect("load the driver library");
    assert_eq!(raw.vmm_granularity(0), None);
    assert_eq!(raw.vmm_whole_granularity(0), Some(2 * MIB));
    assert_eq!(hooks.used(), used);
    // The bare driver gives the pool classic segments: one of PyTorch's size, from cuMemAlloc.
    let pool = Pool::new(Arc::new(raw), PoolConfig::default());
    let live = hooks.live();
    let p = pool.reserve(0, 3 * MIB, 0).unwrap();
    assert_eq!(hooks.live(), live + 1);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.segments), (20 * MIB, 1));
    pool.release(p).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 20 * MIB);
    assert_eq!((hooks.live(), hooks.used()), (live, used));
    // As resmem loads it, the pool reuses pages, its handles made of pages.
    let driver = loaded(&library);
    assert_eq!(driver.vmm_granularity(0), Some(2 * MIB));
    let pool = Pool::new(driver, PoolConfig::default());
    assert!(pool.reuses_pages(0).unwrap());
    let p = pool.reserve(0, 3 * MIB, 0).unwrap();
    assert_eq!(hooks.live(), live, "handles, not a cuMemAlloc allocation");
    let reserved = pool.stats(0).unwrap().reserved_bytes;
    assert_eq!(hooks.used(), used + reserved);
    pool.release(p).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), reserved);
    assert_eq!(hooks.used(), used);
    // Every other 4 MiB block of a 64 MiB warm-up released: with handles of pages a 32 MiB
    // request maps the eight holes again, creating nothing; with 8 MiB parts
    // (`handle_part_mib:8`) each hole is half a part, which is not lent: it creates.
    for (part, reserved, allocs) in [(0, 64 * MIB, 1), (8 * MIB, 96 * MIB, 2)] {
        let driver = Arc::new(PageHandles::with_part(
            CudaDriver::load(&library).expect("load the driver library"),
            part,
        ));
        let pool = Pool::new(driver.clone(), PoolConfig::default());
        assert_eq!(pool.warmup(0, 64 * MIB).unwrap(), 64 * MIB);
        assert_eq!(driver.vmm_part(0), Some(part.max(2 * MIB)));
        let blocks: Vec<u64> = (0..16)
            .map(|_| pool.reserve(0, 4 * MIB, 0).unwrap())
            .collect();
        for &b in blocks.iter().step_by(2) {
            pool.release(b).unwrap();
        }
        let big = pool.reserve(0, 32 * MIB, 0).unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!(
            (s.reserved_bytes, s.driver_allocs),
            (reserved, allocs),
            "{part}"
        );
        assert_eq!(hooks.used(), used + reserved);
        pool.check().unwrap();
        pool.release(big).unwrap();
        for &b in blocks.iter().skip(1).step_by(2) {
            pool.release(b).unwrap();
        }
        assert_eq!(pool.free_reusable(None).unwrap(), reserved);
        assert_eq!(hooks.used(), used);
    }
    // A driver that maps at offsets is found to: its handles are the pool's.
    hooks.refuse_map_offsets(false);
    let driver = loaded(&library);
    assert_eq!(driver.inner().vmm_granularity(0), Some(2 * MIB));
    assert_eq!(driver.vmm_granularity(0), Some(2 * MIB));
    assert_eq!(hooks.used(), used);
}

#[test]
fn whole_handles_map_twice_and_runs_take_one_call() {
    // What handles of one page need of a driver that maps only from an allocation's start: one
    // handle mapped in two places at once, and a run of mappings of several handles unmapped,
    // and given access, in one call each (else PageHandles asks page by page). Printed on a
    // GPU; the simulator allows all of it.
    let _serial = one_at_a_time();
    let library = library();
    let driver = CudaDriver::load(&library).expect("load the driver library");
    let Some(page) = driver
        .vmm_granularity(0)
        .or_else(|| driver.vmm_whole_granularity(0))
    else {
        println!("{}: no virtual-memory API on device 0", driver.describe());
        return;
    };
    let handles = [
        driver.vmm_create(0, page).unwrap(),
        driver.vmm_create(0, page).unwrap(),
    ];
    let (run, twice) = (
        driver.vmm_reserve(0, 2 * page).unwrap(),
        driver.vmm_reserve(0, page).unwrap(),
    );
    driver.vmm_map(0, run, page, handles[0], 0).unwrap();
    driver.vmm_map(0, run + page, page, handles[1], 0).unwrap();
    let mapped_twice = driver.vmm_map(0, twice, page, handles[0], 0);
    let access = driver.vmm_set_access(0, run, 2 * page, &[]);
    let unmap = driver.vmm_unmap(0, run, 2 * page);
    if unmap.is_err() {
        driver.vmm_unmap(0, run, page).unwrap();
        driver.vmm_unmap(0, run + page, page).unwrap();
    }
    if mapped_twice.is_ok() {
        driver.vmm_unmap(0, twice, page).unwrap();
    }
    for handle in handles {
        driver.vmm_release(0, handle).unwrap();
    }
    driver.vmm_free(0, run, 2 * page).unwrap();
    driver.vmm_free(0, twice, page).unwrap();
    let said = |r: &Result<(), resmem::driver::DriverError>| match r {
        Ok(()) => "yes".to_string(),
        Err(e) => format!("no ({e})"),
    };
    println!(
        "{}: one handle mapped twice: {}; access to a run of two handles in one call: {}; the run \
         unmapped in one call: {}",
        driver.describe(),
        said(&mapped_twice),
        said(&access),
        said(&unmap)
    );
    if SimHooks::find(&library).is_some() {
        assert!(mapped_twice.is_ok() && access.is_ok() && unmap.is_ok());
    }
}

#[test]
fn the_drivers_offset_check_says_no_only_when_a_mapping_is_refused() {
    let _serial = one_at_a_time();
    let library = library();
    let Some(hooks) = SimHooks::find(&library) else {
        println!("{library} is not the simulator: its answers cannot be scripted");
        return;
    };
    let used = hooks.used();
    let granularity = Some(2 * MIB);
    // Each case on a freshly loaded driver (nothing known yet): what its first answer is, and
    // whether the check is made again at the next question (an answer it could not reach is
    // not kept).
    let cases = [
        // No memory for the check's two pages: it cannot tell, and the API's description holds.
        ("cuMemCreate@1=2", granularity, true),
        // Its address range refused: the same.
        ("cuMemAddressReserve@1=2", granularity, true),
        // A mapping refused as invalid or unsupported: no stitching, kept.
        ("cuMemMap@1=1", None, false),
        ("cuMemMap@2=1", None, false),
        ("cuMemMap@1=801", None, false),
        // A mapping failing otherwise (a launch failure): it cannot tell.
        ("cuMemMap@2=719", granularity, true),
        // Undoing it failing: the mappings were made, so yes, kept.
        ("cuMemUnmap@1=719", granularity, false),
        ("cuMemRelease@1=719", granularity, false),
    ];
    for (fault, first, asked_again) in cases {
        let driver = CudaDriver::load(&library).expect("load the driver library");
        hooks.inject(fault);
        let answer = driver.vmm_granularity(0);
        hooks.clear();
        assert_eq!(answer, first, "{fault}");
        // The next question: asked again (and answered yes now), or the kept answer.
        let again = if asked_again { granularity } else { first };
        assert_eq!(driver.vmm_granularity(0), again, "{fault}: asked again");
    }
    // A failed undo leaves the check's two pages with the driver (a mapping left, or the handle
    // unreleased), once per device and only where the driver fails a call it accepted a moment
    // before: the unmap and the release cases here, 4 MiB each. Every other case gave all back.
    assert_eq!(hooks.used(), used + 2 * 4 * MIB);
}
