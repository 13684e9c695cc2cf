//! Fault injection through the real loading path: the pool over `CudaDriver`, which opens
//! `libcuda_sim.so` with `dlopen` and runs every call between `cuCtxPushCurrent_v2` and
//! `cuCtxPopCurrent_v2`. Each driver function the workload reaches fails at each of its calls in
//! turn (once, and from there on), through the library's `cudasim_inject_faults`. Every failure
//! must come back as `RM_ERROR_DRIVER` naming the call (or `RM_ERROR_OUT_OF_MEMORY`), the books
//! must match what the driver holds, and once the fault is cleared nothing may leak. With
//! stitching, a failed segment build whose undoing fails too must leak nothing either.

mod common;

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::Arc;

use common::hooks::SimHooks;
use resmem::driver::cuda::CudaDriver;
use resmem::{rm_status, Pool, PoolConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

type Hook1 = unsafe extern "C" fn(*mut c_void) -> c_int;
type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;

/// The simulator's hooks in the loaded library, and two streams made there.
struct Hooks {
    sim: SimHooks,
    streams: [u64; 2],
}

impl std::ops::Deref for Hooks {
    type Target = SimHooks;
    fn deref(&self) -> &SimHooks {
        &self.sim
    }
}

fn library() -> String {
    common::artifacts()
        .lib_dir
        .join("libcuda_sim.so")
        .display()
        .to_string()
}

fn hooks(library: &str) -> Hooks {
    let name = CString::new(library).unwrap();
    // SAFETY: a NUL-terminated path; the library CudaDriver opened, so the same handle.
    let handle = unsafe { dlopen(name.as_ptr(), 2) };
    assert!(!handle.is_null());
    let sym = |s: &str| {
        let s = CString::new(s).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { dlsym(handle, s.as_ptr()) };
        assert!(!p.is_null(), "{s:?} missing");
        p
    };
    // SAFETY: each symbol is the function of that name with the declared signature.
    let streams = unsafe {
        let retain = std::mem::transmute::<*mut c_void, Retain>(sym("cuDevicePrimaryCtxRetain"));
        let push = std::mem::transmute::<*mut c_void, Hook1>(sym("cuCtxPushCurrent_v2"));
        let pop = std::mem::transmute::<*mut c_void, Hook1>(sym("cuCtxPopCurrent_v2"));
        let create = std::mem::transmute::<*mut c_void, StreamCreate>(sym("cuStreamCreate"));
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(push(ctx), 0);
        let mut streams = [0u64; 2];
        for s in &mut streams {
            let mut handle = std::ptr::null_mut();
            assert_eq!(create(&mut handle, 1), 0);
            *s = handle as u64;
        }
        assert_eq!(pop(std::ptr::null_mut()), 0);
        streams
    };
    let sim = SimHooks::find(library).expect("the simulator's hooks");
    Hooks { sim, streams }
}

/// One run of the workload on a fresh pool; the number of faults that fired, and of operations
/// that failed.
fn run(
    driver: &Arc<CudaDriver>,
    hooks: &Hooks,
    config: PoolConfig,
    fault: Option<&str>,
) -> (u64, u64) {
    let pool = Pool::new(driver.clone(), config);
    let [s1, s2] = hooks.streams;
    assert_eq!(
        hooks.used(),
        0,
        "{fault:?}: the previous run left memory behind"
    );
    let injected_before = hooks.injected();
    if let Some(spec) = fault {
        hooks.inject(spec);
    }
    let mut live: Vec<u64> = Vec::new();
    let mut failed = 0;
    let mut degraded = false;
    let check = |what: &str,
                 r: Result<(), resmem::Error>,
                 fired: bool,
                 failed: &mut u64,
                 degraded: &mut bool| {
        if let Err(e) = r {
            *failed += 1;
            if !fired {
                assert!(
                    *degraded && e.status == rm_status::RM_ERROR_OUT_OF_MEMORY,
                    "{fault:?}: {what} failed with no fault: {e}"
                );
                return;
            }
            *degraded = true;
            let call = fault.unwrap().split('@').next().unwrap();
            if fault.unwrap().ends_with("=2") {
                assert_eq!(
                    e.status,
                    rm_status::RM_ERROR_OUT_OF_MEMORY,
                    "{fault:?}: {what}: {e}"
                );
            } else {
                assert_eq!(
                    e.status,
                    rm_status::RM_ERROR_DRIVER,
                    "{fault:?}: {what}: {e}"
                );
                assert!(e.message.contains(call), "{fault:?}: {what}: {e}");
            }
        }
    };
    macro_rules! step {
        ($what:expr, $body:expr) => {{
            let before = hooks.injected();
            let r = $body;
            let fired = hooks.injected() > before;
            check($what, r, fired, &mut failed, &mut degraded);
        }};
    }
    let reserve = |pool: &Pool, size: u64, stream: u64, live: &mut Vec<u64>| {
        pool.reserve(0, size, stream).map(|p| live.push(p))
    };
    step!("reserve a", reserve(&pool, 1000, 0, &mut live));
    step!("reserve b", reserve(&pool, 3 * MIB, s1, &mut live));
    if let Some(&b) = live.last() {
        step!("record_stream", pool.record_stream(b, s2));
        hooks.enqueue(s2);
        step!(
            "release b",
            pool.release(b).map(|()| {
                live.pop();
            })
        );
    }
    step!("reserve c", reserve(&pool, 3 * MIB, s1, &mut live));
    hooks.complete(s2);
    step!("reserve d", reserve(&pool, MIB + 1, s1, &mut live));
    while live.len() > 1 {
        let p = live[1];
        step!(
            "release",
            pool.release(p).map(|()| {
                live.remove(1);
            })
        );
        if live.get(1) == Some(&p) {
            break;
        }
    }
    step!("reserve e", reserve(&pool, 2 * MIB, s2, &mut live));
    // A block pending on another stream's work when the cache is returned: waited for.
    if live.len() > 1 {
        let e = *live.last().unwrap();
        step!("record_stream e", pool.record_stream(e, s1));
        hooks.enqueue(s1);
        step!(
            "release e",
            pool.release(e).map(|()| {
                live.pop();
            })
        );
    }
    step!("warmup", pool.warmup(0, GIB).map(drop));
    step!("mem_get_info", pool.mem_get_info(0).map(drop));
    step!(
        "limit",
        pool.set_memory_limit(Some(0), Some(64 * MIB)).map(drop)
    );
    step!("unlimit", pool.set_memory_limit(Some(0), None).map(drop));
    step!("free_reusable", pool.free_reusable(None).map(drop));
    // Everything released and returned: the address space goes back too.
    let mut i = 0;
    while i < live.len() {
        let p = live[i];
        step!(
            "release at the end",
            pool.release(p).map(|()| {
                live.remove(i);
            })
        );
        if live.get(i) == Some(&p) {
            i += 1;
        }
    }
    step!(
        "free_reusable at the end",
        pool.free_reusable(None).map(drop)
    );
    let fired = hooks.injected() - injected_before;
    hooks.clear();
    // Nothing leaks: after returning the cache the driver holds what the pool reserves, and
    // nothing once the blocks are released.
    pool.free_reusable(None).unwrap();
    pool.check().unwrap();
    assert_eq!(
        pool.stats(0).unwrap().reserved_bytes,
        hooks.used(),
        "{fault:?}"
    );
    let p = pool.reserve(0, 5 * MIB, s1).unwrap();
    pool.release(p).unwrap();
    for p in live {
        pool.release(p).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_eq!(hooks.used(), 0, "{fault:?}: leaked");
    (fired, failed)
}

/// The calls both backings reach.
const COMMON: [&str; 9] = [
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemGetInfo_v2",
    "cuCtxSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
];

#[test]
fn every_call_through_the_loaded_driver_failing_at_every_position() {
    let library = library();
    std::env::set_var("CUDA_SIM_DEVICES", "4GiB");
    let driver = Arc::new(CudaDriver::load(&library).expect("load libcuda_sim.so"));
    let hooks = hooks(&library);
    let classic = PoolConfig {
        vmm: false,
        ..PoolConfig::default()
    };
    let mut calls: Vec<&str> = COMMON.to_vec();
    calls.extend(["cuMemAlloc_v2", "cuMemFree_v2"]);
    sweep(&driver, &hooks, classic, &calls, "classic segments");
    let mut calls: Vec<&str> = COMMON.to_vec();
    calls.extend([
        "cuMemCreate",
        "cuMemRelease",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
        "cuMemAddressReserve",
        "cuMemAddressFree",
    ]);
    sweep(
        &driver,
        &hooks,
        PoolConfig::default(),
        &calls,
        "the default",
    );
}

fn sweep(driver: &Arc<CudaDriver>, hooks: &Hooks, config: PoolConfig, calls: &[&str], what: &str) {
    assert_eq!(run(driver, hooks, config, None), (0, 0));
    let (mut runs, mut fired_total, mut failed_total) = (0, 0, 0);
    for &call in calls {
        let codes: &[i32] = if call == "cuMemAlloc_v2" || call == "cuMemCreate" {
            &[2, 719]
        } else {
            &[719]
        };
        for &code in codes {
            for plus in ["", "+"] {
                let mut nth = 1;
                loop {
                    let spec = format!("{call}@{nth}{plus}={code}");
                    let (fired, failed) = run(driver, hooks, config, Some(&spec));
                    runs += 1;
                    fired_total += fired;
                    failed_total += failed;
                    if fired == 0 {
                        break;
                    }
                    nth += 1;
                }
                assert!(nth > 1, "{what}: {call} was never reached");
            }
        }
    }
    eprintln!(
        "cuda faults, {what}: {runs} runs through libcuda_sim.so over {} driver functions; \
         {fired_total} failures injected, {failed_total} operations failed with the right status",
        calls.len()
    );
    // In the same test: the simulator in the loaded library is one per process.
    undoing_a_failed_segment_build_can_fail_too(driver, hooks);
}

/// With stitching, a segment build breaks and undoing it fails too (an unmap refused; an
/// address free is never part of the undoing: the range goes back to its chunk): the memory stays counted as reserved, the pool works on, and once the driver
/// allows, `free_reusable` returns everything. The first build maps twelve 128 MiB holes of a
/// 3 GiB warm-up into a 2 GiB segment (the 4 GiB device has 1 GiB free) and fails at its
/// second map; the others fail a fresh 64 MiB segment.
fn undoing_a_failed_segment_build_can_fail_too(driver: &Arc<CudaDriver>, hooks: &Hooks) {
    for (spec, holes) in [
        ("cuMemMap@2=999,cuMemUnmap@1=999", true),
        ("cuMemSetAccess@1=999,cuMemUnmap@1=999", false),
    ] {
        let config = PoolConfig {
            vmm: true,
            ..PoolConfig::default()
        };
        let pool = Pool::new(driver.clone(), config);
        assert_eq!(
            hooks.used(),
            0,
            "{spec}: the previous run left memory behind"
        );
        let mut kept = Vec::new();
        let size = if holes {
            pool.warmup(0, 3 * GIB).unwrap();
            for i in 0..24 {
                let p = pool.reserve(0, 128 * MIB, 0).unwrap();
                if i % 2 == 0 {
                    pool.release(p).unwrap();
                } else {
                    kept.push(p);
                }
            }
            2 * GIB
        } else {
            64 * MIB
        };
        let injected = hooks.injected();
        hooks.inject(spec);
        let e = pool.reserve(0, size, 0).unwrap_err();
        assert_eq!(e.status, rm_status::RM_ERROR_DRIVER, "{spec}: {e}");
        assert_eq!(hooks.injected() - injected, 2, "{spec}");
        hooks.clear();
        pool.check().unwrap();
        assert_eq!(
            pool.stats(0).unwrap().reserved_bytes,
            hooks.used(),
            "{spec}"
        );
        let p = pool.reserve(0, size, 0).unwrap();
        pool.release(p).unwrap();
        for p in kept {
            pool.release(p).unwrap();
        }
        pool.free_reusable(None).unwrap();
        assert_eq!(pool.stats(0).unwrap().reserved_bytes, 0, "{spec}");
        assert_eq!(hooks.used(), 0, "{spec}: leaked");
    }
}
