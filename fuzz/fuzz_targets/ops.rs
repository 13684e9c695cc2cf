//! Operation sequences from arbitrary bytes on two simulated devices with three streams each,
//! under the default policy (stitched segments) or classic segments, straight to the pool or
//! through the front caches the C library calls (`Front`), on a driver that maps at offsets
//! into an allocation or only from its start (the pool's handles then made of one-page
//! handles, as on the CUDA driver), as the first byte says: every byte
//! pair is one operation, among them arming a driver call to fail (once, with out-of-memory or
//! another `CUresult`) and reserving while a stream captures a graph (without waits; the capture
//! must end cleanly). After each, the books must be exact (`Pool::check`,
//! reserved equal to what the simulator holds, allocated + reusable = reserved, the live blocks
//! those handed out and not released), every block aligned and inside the driver's memory, and
//! a failure must have the right status: out-of-memory, or with a fault fired in the operation,
//! `RM_ERROR_DRIVER`. At the end, with the faults cleared, releasing everything and returning
//! the cache leaves the simulator empty.

#![no_main]

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cuda_sim::{codes, Call, Fault, Sim, VmmSetting};
use libfuzzer_sys::fuzz_target;
use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Front, Pool, PoolConfig, Result, Stats};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The driver calls a fault may be armed on: every one the pool makes on its paths.
const FAULTY: [Call; 16] = [
    Call::MemAlloc,
    Call::MemFree,
    Call::MemCreate,
    Call::MemRelease,
    Call::MemMap,
    Call::MemUnmap,
    Call::MemSetAccess,
    Call::MemAddressReserve,
    Call::MemAddressFree,
    Call::CtxSynchronize,
    Call::EventCreate,
    Call::EventRecord,
    Call::EventQuery,
    Call::EventSynchronize,
    Call::StreamWaitEvent,
    Call::MemGetInfo,
];

/// What the operations go to: the pool, or the front caches ahead of it.
enum Target {
    Pool(Pool),
    Front(Front),
}

/// `$body` with `$t` the pool or the front, whichever `$target` holds.
macro_rules! either {
    ($target:expr, $t:ident => $body:expr) => {
        match $target {
            Target::Pool($t) => $body,
            Target::Front($t) => $body,
        }
    };
}

impl Target {
    fn reserve(&self, device: i32, size: u64, stream: u64) -> Result<u64> {
        either!(self, t => t.reserve(device, size, stream))
    }
    fn reserve_no_wait(&self, device: i32, size: u64, stream: u64) -> Result<u64> {
        either!(self, t => t.reserve_no_wait(device, size, stream))
    }
    fn release(&self, ptr: u64) -> Result<()> {
        either!(self, t => t.release(ptr))
    }
    fn record_stream(&self, ptr: u64, stream: u64) -> Result<()> {
        either!(self, t => t.record_stream(ptr, stream))
    }
    fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        either!(self, t => t.free_reusable(device))
    }
    fn trim(&self, device: i32, bytes: u64) -> Result<u64> {
        either!(self, t => t.trim(device, bytes))
    }
    fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        either!(self, t => t.warmup(device, bytes))
    }
    fn own_shard(&self, device: i32, stream: u64) -> Result<bool> {
        match self {
            Target::Pool(p) => p.own_shard(device, stream),
            Target::Front(f) => f.pool().own_shard(device, stream),
        }
    }
    fn set_memory_limit(&self, device: Option<i32>, limit: Option<u64>) -> Result<u64> {
        either!(self, t => t.set_memory_limit(device, limit))
    }
    fn reset_peak_stats(&self, device: i32) -> Result<()> {
        either!(self, t => t.reset_peak_stats(device))
    }
    fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        either!(self, t => t.mem_get_info(device))
    }
    fn stats(&self, device: i32) -> Result<Stats> {
        either!(self, t => t.stats(device))
    }
    fn check(&self) -> std::result::Result<(), String> {
        either!(self, t => t.check())
    }
}

fn size(code: u8) -> u64 {
    // 1 byte to 3 GiB, on a roughly logarithmic scale with odd sizes in between.
    let shift = u64::from(code % 32);
    ((1u64 << shift) + u64::from(code / 32) * 511).min(3 * GIB)
}

/// Whether an operation's failure is one it may have: with a fault fired during it, the
/// driver's failure (`RM_ERROR_DRIVER`) or out-of-memory; without, out-of-memory only, and only
/// where the operation may run out of memory (`may_run_out`) or an earlier fault left memory
/// the pool could not give back yet (`degraded`).
fn judge(result: Result<()>, fired: u64, may_run_out: bool, degraded: bool) {
    let Err(e) = result else {
        return;
    };
    if fired > 0 {
        assert!(
            matches!(
                e.status,
                rm_status::RM_ERROR_DRIVER | rm_status::RM_ERROR_OUT_OF_MEMORY
            ),
            "{e}"
        );
    } else {
        assert!(
            (may_run_out || degraded) && e.status == rm_status::RM_ERROR_OUT_OF_MEMORY,
            "failed with no fault fired: {e}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    // One simulator for the whole run (each input leaves it empty), so memory stays flat.
    static SIM: OnceLock<(&'static Sim, Vec<Vec<u64>>)> = OnceLock::new();
    let (sim, streams) = SIM.get_or_init(|| {
        // Each input's pool and front make and free allocations of a few hundred KiB. After the
        // first such free, glibc serves that size from the heap instead of `mmap`, and the
        // fuzzer's own long-lived allocations (the corpus) land in the holes they leave, so the
        // heap grew by about that much per input (to 800 MB in 20 minutes, where a plain
        // process replaying the whole corpus peaks at 17 MiB). A fixed threshold keeps them
        // mapped.
        // SAFETY: mallopt only sets a parameter of glibc's allocator, under its own lock.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 10) };
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[4 * GIB, GIB])));
        sim.init().unwrap();
        let streams = (0..2)
            .map(|d| {
                vec![
                    0,
                    sim.stream_create(d).unwrap(),
                    sim.stream_create(d).unwrap(),
                ]
            })
            .collect();
        (sim, streams)
    });
    let sim: &'static Sim = sim;
    // A fault an earlier input armed and never fired.
    sim.clear_faults();
    let first = data.first().copied().unwrap_or(0);
    // One input in two on a driver that maps only from an allocation's start, as the CUDA
    // driver: the pool's handles made of one-page handles, or (half of those) of 6 MiB parts.
    let whole = first & 16 != 0;
    sim.set_vmm(if whole {
        VmmSetting::StartOnly
    } else {
        VmmSetting::Full
    });
    let part = if first & 32 != 0 { 6 << 20 } else { 0 };
    let driver = Arc::new(PageHandles::with_part(SimDriver::new(sim).unwrap(), part));
    let pool = Pool::new(
        driver.clone(),
        PoolConfig {
            release_before_grow: first & 1 == 0,
            logging: false,
            // The default (stitched segments) three times in four, classic segments otherwise.
            vmm: first & 6 != 6,
        },
    );
    let pool = if first & 8 == 0 {
        Target::Front(Front::new(pool))
    } else {
        Target::Pool(pool)
    };
    let mut live: BTreeMap<u64, (i32, u64)> = BTreeMap::new();
    // Whether a fault fired in this input: memory the pool could not give back may make a later
    // operation run out of memory.
    let mut degraded = false;
    for pair in data.chunks_exact(2) {
        let (op, arg) = (pair[0], pair[1]);
        let device = i32::from(op & 1);
        let stream = streams[device as usize][usize::from((op >> 1) % 3)];
        let pick = |live: &BTreeMap<u64, (i32, u64)>| {
            (!live.is_empty()).then(|| *live.iter().nth(usize::from(arg) % live.len()).unwrap().0)
        };
        let before = sim.injected_failures();
        let fired = || sim.injected_failures() - before;
        match op >> 3 {
            0..=11 => {
                // A quarter of them while the stream, a created one, captures a graph: without
                // waits, and the capture must end cleanly.
                let result = if op >> 3 >= 9 && stream != 0 {
                    sim.stream_begin_capture(device, stream).unwrap();
                    let result = pool.reserve_no_wait(device, size(arg), stream);
                    let ended = sim.stream_end_capture(device, stream);
                    assert!(
                        ended.is_ok(),
                        "a reserve during a capture waited: {ended:?}"
                    );
                    result
                } else {
                    pool.reserve(device, size(arg), stream)
                };
                let result = result.map(|ptr| {
                    assert_eq!(ptr % 512, 0);
                    assert_eq!(sim.device_of(ptr), Some(device));
                    assert_eq!(sim.device_of(ptr + size(arg) - 1), Some(device));
                    assert!(live.insert(ptr, (device, size(arg))).is_none());
                });
                judge(result, fired(), true, degraded);
            }
            12..=19 => {
                if let Some(ptr) = pick(&live) {
                    let result = pool.release(ptr);
                    if result.is_ok() {
                        live.remove(&ptr);
                    }
                    judge(result, fired(), false, degraded);
                }
            }
            20..=22 => {
                if let Some(ptr) = pick(&live) {
                    let (d, _) = live[&ptr];
                    let result = pool.record_stream(ptr, streams[d as usize][usize::from(arg % 3)]);
                    judge(result, fired(), false, degraded);
                }
            }
            23 => {
                // An address past a block's start that no other live block starts at.
                if let Some(ptr) = pick(&live) {
                    let inner = ptr + 512 * u64::from(arg % 4 + 1);
                    if !live.contains_key(&inner) {
                        let e = pool.release(inner).unwrap_err();
                        assert_eq!(e.status, rm_status::RM_ERROR_INVALID_POINTER);
                    }
                }
            }
            24 | 25 => drop(sim.enqueue_work(device, stream)),
            26 | 27 => drop(sim.complete_work(device, stream)),
            28 => {
                let result = pool.free_reusable((arg & 1 == 0).then_some(device));
                judge(result.map(drop), fired(), false, degraded);
            }
            29 => {
                let result = pool.warmup(device, size(arg));
                judge(result.map(drop), fired(), true, degraded);
            }
            30 if arg & 0x80 != 0 => {
                let result = if arg & 0x40 != 0 {
                    pool.reset_peak_stats(device)
                } else if arg & 0x20 != 0 {
                    // The stream on a shard of its own, as contention moves it.
                    pool.own_shard(device, stream).map(drop)
                } else {
                    // What another process sharing the device asks back.
                    pool.trim(device, size(arg & 31)).map(drop)
                };
                judge(result, fired(), false, degraded);
            }
            30 => {
                let limit = (arg & 1 == 0).then_some(u64::from(arg) * 16 * MIB);
                let result = pool.set_memory_limit(Some(device), limit);
                judge(result.map(drop), fired(), false, degraded);
            }
            _ if arg & 0x80 != 0 => {
                // The `nth` next call of one function fails, once.
                let call = FAULTY[usize::from(arg & 15)];
                let nth = 1 + u64::from((arg >> 4) & 3);
                let code = if arg & 0x40 != 0 {
                    codes::CUDA_ERROR_OUT_OF_MEMORY
                } else {
                    codes::CUDA_ERROR_UNKNOWN
                };
                sim.inject_fault(Fault::once(call, nth, code));
            }
            _ => {
                let result = pool.mem_get_info(device).map(|(free, total)| {
                    assert!(free <= total);
                });
                judge(result, fired(), false, degraded);
            }
        }
        degraded |= fired() > 0;
        pool.check().unwrap();
        for d in 0..2 {
            let s = pool.stats(d).unwrap();
            if whole && degraded {
                // After a failure: a handle of pages whose release was refused part way stays
                // whole in the books while the driver holds less; pages an undo could not give
                // back are the wrapper's until its next call.
                assert!(sim.used_bytes(d) <= s.reserved_bytes + driver.orphaned_bytes(d));
            } else {
                assert_eq!(s.reserved_bytes, sim.used_bytes(d));
            }
            assert_eq!(s.allocated_bytes + s.reusable_bytes, s.reserved_bytes);
            let blocks = live.values().filter(|&&(dev, _)| dev == d).count();
            assert_eq!(s.live_blocks, blocks as u64);
        }
    }
    sim.clear_faults();
    for (ptr, _) in std::mem::take(&mut live) {
        pool.release(ptr).unwrap();
    }
    pool.free_reusable(None).unwrap();
    drop(pool);
    drop(driver);
    assert_eq!(sim.used_bytes(0) + sim.used_bytes(1), 0);
    for d in 0..2 {
        sim.synchronize(d).unwrap();
    }
});
