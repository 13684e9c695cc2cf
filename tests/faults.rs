//! Fault injection: a scripted workload over two simulated devices runs once for every driver
//! call the pool makes, at every position that call reaches, failing there once or from there
//! on, with out-of-memory or other `CUresult`s. Each time the failing operation returns the right
//! status (out-of-memory as `RM_ERROR_OUT_OF_MEMORY`, any other failure as `RM_ERROR_DRIVER`
//! naming the call and its code), the books stay exact, nothing leaks once the fault is cleared
//! and the cache returned, and the pool keeps working.
//!
//! A second sweep makes each failure's clean-up fail too: for every failure of the first sweep
//! (once), every call of each clean-up function (`cuMemUnmap`, `cuMemRelease`,
//! `cuMemAddressFree`, `cuMemFree_v2`, `cuEventDestroy_v2`) made while the failing operation
//! runs, and the next one, fails as well. The books and the driver must still agree after every
//! step: memory the pool could not give back stays counted as reserved, and is returned once the
//! driver allows, never forgotten.

use std::collections::BTreeMap;
use std::sync::Arc;

use cuda_sim::{codes, Call, Fault, Sim, VmmSetting};
use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Pool, PoolConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// One step of the workload. Blocks are named by the step that reserved them.
#[derive(Clone, Copy, Debug)]
enum Step {
    Reserve(&'static str, i32, u64, usize),
    Release(&'static str),
    RecordStream(&'static str, usize),
    Enqueue(i32, usize),
    Complete(i32, usize),
    Warmup(i32, u64),
    MemGetInfo(i32),
    FreeReusable(Option<i32>),
    SetLimit(Option<i32>, Option<u64>),
    /// The stream moves to a shard of its own, as when a reserve meets another thread.
    OwnShard(i32, usize),
}

use Step::*;

/// Every path that calls the driver: growth, reuse on the same stream, adoption of another
/// stream's idle segment (event record and wait), record_stream and pending blocks (event query
/// and synchronize), release before growing, the out-of-memory retry that waits for pending
/// blocks, warm-up, limits, returning cache, and a device's shards (a stream on a shard of its
/// own running out of memory while the first shard caches, and the other way round).
const WORKLOAD: &[Step] = &[
    Reserve("a", 0, 1000, 0),
    Reserve("b", 0, 3 * MIB, 1),
    Reserve("c", 1, 512 << 10, 0),
    RecordStream("b", 2),
    Enqueue(0, 2),
    Release("b"),
    Reserve("d", 0, 3 * MIB, 1),
    Complete(0, 2),
    Reserve("e", 0, MIB + 1, 1),
    Release("d"),
    Release("e"),
    Reserve("f", 0, 2 * MIB, 2),
    Release("a"),
    Warmup(1, GIB),
    MemGetInfo(0),
    MemGetInfo(1),
    Reserve("g", 1, 3 * GIB, 1),
    RecordStream("g", 2),
    Enqueue(1, 2),
    Release("g"),
    OwnShard(1, 2),
    Reserve("l", 1, 3 * GIB, 2),
    Release("l"),
    Reserve("h", 1, 3 * GIB + 512 * MIB, 0),
    SetLimit(Some(0), Some(64 * MIB)),
    Reserve("i", 0, 8 * MIB, 0),
    SetLimit(None, None),
    FreeReusable(Some(1)),
    Reserve("j", 1, 100, 2),
    Release("h"),
    FreeReusable(None),
    Reserve("k", 0, 700, 1),
];

struct Run {
    /// Segments are stitched from physical chunks (`vmm:true`).
    stitched: bool,
    /// Handles made of parts (`Mode::WholeHandles`, `Mode::Parts`).
    whole_only: bool,
    /// The driver the pool is given, for the pages it holds that the pool never knew.
    driver: Arc<PageHandles<SimDriver>>,
    pool: Pool,
    sim: &'static Sim,
    streams: Vec<Vec<u64>>,
    /// Live blocks by name: address, device, bytes requested.
    live: BTreeMap<&'static str, (u64, i32, u64)>,
}

/// How the pool's segments are backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `cuMemAlloc` (`vmm:false`).
    Classic,
    /// The virtual-memory API, mapping at offsets into handles (the default).
    Stitched,
    /// The default on a driver that maps only from an allocation's start, as the CUDA driver:
    /// handles of one page each (`PageHandles`).
    WholeHandles,
    /// The same with handles of 6 MiB parts (`PageHandles::with_part`), each lent only whole.
    Parts,
}

impl Mode {
    /// Whether the driver maps only from an allocation's start, handles made of parts.
    fn whole_only(self) -> bool {
        matches!(self, Mode::WholeHandles | Mode::Parts)
    }
}

impl Run {
    fn new(mode: Mode) -> Run {
        Run::with_mode(mode, &[4 * GIB, 4 * GIB])
    }

    fn with_devices(stitched: bool, capacities: &[u64]) -> Run {
        let mode = if stitched {
            Mode::Stitched
        } else {
            Mode::Classic
        };
        Run::with_mode(mode, capacities)
    }

    fn with_mode(mode: Mode, capacities: &[u64]) -> Run {
        let stitched = mode != Mode::Classic;
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(capacities)));
        if mode.whole_only() {
            sim.set_vmm(VmmSetting::StartOnly);
        }
        let part = if mode == Mode::Parts { 6 * MIB } else { 0 };
        let driver = Arc::new(PageHandles::with_part(SimDriver::new(sim).unwrap(), part));
        let streams = (0..capacities.len() as i32)
            .map(|d| {
                vec![
                    0,
                    sim.stream_create(d).unwrap(),
                    sim.stream_create(d).unwrap(),
                ]
            })
            .collect();
        let config = PoolConfig {
            vmm: stitched,
            ..PoolConfig::default()
        };
        Run {
            stitched,
            whole_only: mode.whole_only(),
            driver: driver.clone(),
            pool: Pool::new(driver, config),
            sim,
            streams,
            live: BTreeMap::new(),
        }
    }

    /// Run one step; `Err` with what the pool returned when it failed.
    fn step(&mut self, step: Step) -> Result<(), resmem::Error> {
        match step {
            Reserve(name, device, size, stream) => {
                let ptr = self
                    .pool
                    .reserve(device, size, self.streams[device as usize][stream])?;
                self.live.insert(name, (ptr, device, size));
            }
            Release(name) => {
                if let Some(&(ptr, _, _)) = self.live.get(name) {
                    self.pool.release(ptr)?;
                    self.live.remove(name);
                }
            }
            RecordStream(name, stream) => {
                if let Some(&(ptr, device, _)) = self.live.get(name) {
                    self.pool
                        .record_stream(ptr, self.streams[device as usize][stream])?;
                }
            }
            Enqueue(device, stream) => {
                self.sim
                    .enqueue_work(device, self.streams[device as usize][stream])
                    .unwrap();
            }
            Complete(device, stream) => {
                self.sim
                    .complete_work(device, self.streams[device as usize][stream])
                    .unwrap();
            }
            Warmup(device, bytes) => drop(self.pool.warmup(device, bytes)?),
            MemGetInfo(device) => drop(self.pool.mem_get_info(device)?),
            FreeReusable(device) => drop(self.pool.free_reusable(device)?),
            SetLimit(device, limit) => drop(self.pool.set_memory_limit(device, limit)?),
            OwnShard(device, stream) => {
                let stream = self.streams[device as usize][stream];
                self.pool.own_shard(device, stream)?;
            }
        }
        Ok(())
    }

    /// The books are exact, and the driver holds what the pool says it reserves.
    fn check_books(&self) {
        self.pool.check().unwrap();
        for d in 0..self.pool.device_count() {
            let s = self.pool.stats(d).unwrap();
            let orphaned = self.driver.orphaned_bytes(d);
            if self.whole_only && self.sim.injected_failures() > 0 {
                // A handle of pages whose release failed part way and could not be made whole
                // again is kept, whole in the books, while the driver holds only the pages not
                // yet released; the pages of a failed creation the driver would not take back
                // are the wrapper's, released again at its next creation or release.
                assert!(
                    s.reserved_bytes + orphaned >= self.sim.used_bytes(d),
                    "device {d}: reserved {} < used {}",
                    s.reserved_bytes,
                    self.sim.used_bytes(d)
                );
            } else {
                assert_eq!(s.reserved_bytes, self.sim.used_bytes(d), "device {d}");
            }
            if !self.stitched {
                assert_eq!(s.segments, self.sim.live_allocations(d) as u64);
            }
            assert_eq!(
                s.live_blocks,
                self.live.values().filter(|l| l.1 == d).count() as u64
            );
        }
    }

    /// After returning the cache, the driver holds exactly the segments of live blocks, and
    /// with the virtual-memory API the handles mapped in the ranges that hold a live block.
    fn check_nothing_leaks(&self) {
        self.pool.free_reusable(None).unwrap();
        self.check_books();
        for d in 0..self.pool.device_count() {
            let touches = |base: u64, len: u64| {
                self.live.values().any(|&(p, dev, size)| {
                    dev == d && p < base + len && base < p + size.max(1).next_multiple_of(512)
                })
            };
            let mut needed: u64 = self
                .sim
                .allocations(d)
                .iter()
                .filter(|&&(base, len)| touches(base, len))
                .map(|&(_, len)| len)
                .sum();
            let mut handles: Vec<(u64, u64)> = self
                .sim
                .range_handles(d)
                .into_iter()
                .filter(|&((base, len), _)| touches(base, len))
                .flat_map(|(_, handles)| handles)
                .collect();
            handles.sort_unstable();
            handles.dedup();
            needed += handles.iter().map(|&(_, size)| size).sum::<u64>();
            if self.whole_only {
                // The driver's handles are pages of the pool's: the driver holds what the pool
                // reserves, a handle's pages in a range with a live block or not, and the pages
                // of failed creations not yet taken back. A release that failed part way, whose
                // pages the driver would not make again at once, leaves the pool counting more
                // than the driver holds until the handle is mapped or released: never less.
                let reserved = self.pool.stats(d).unwrap().reserved_bytes;
                let orphaned = self.driver.orphaned_bytes(d);
                assert!(
                    self.sim.used_bytes(d) <= reserved + orphaned,
                    "device {d} leaks"
                );
                assert!(needed <= reserved, "device {d}: {needed} > {reserved}");
            } else {
                assert_eq!(self.sim.used_bytes(d), needed, "device {d} leaks");
            }
        }
    }
}

impl Run {
    /// With no block live and the cache returned, the driver holds nothing: no memory, no
    /// allocation, no address range.
    fn check_all_returned(&self, what: &str) {
        for d in 0..self.pool.device_count() {
            assert_eq!(self.sim.used_bytes(d), 0, "{what}: device {d}");
            assert_eq!(self.sim.live_allocations(d), 0, "{what}: device {d}");
            assert_eq!(self.sim.physical_allocations(d), 0, "{what}: device {d}");
        }
        assert_eq!(self.sim.reserved_ranges(), 0, "{what}: address ranges left");
    }

    /// Run the workload, checking after every step that a failure has the right status and
    /// that the books match the driver. Returns the operations that failed.
    fn run_checked(&mut self, what: &str) -> u64 {
        let (mut failed, mut degraded) = (0, false);
        for &step in WORKLOAD {
            let fired = self.sim.injected_failures();
            let outcome = self.step(step);
            let fired = self.sim.injected_failures() - fired;
            if let Err(e) = outcome {
                if fired == 0 {
                    assert!(
                        degraded && e.status == rm_status::RM_ERROR_OUT_OF_MEMORY,
                        "{what}: {step:?} failed with no fault: {e}"
                    );
                } else {
                    failed += 1;
                    degraded = true;
                    assert!(
                        matches!(
                            e.status,
                            rm_status::RM_ERROR_DRIVER | rm_status::RM_ERROR_OUT_OF_MEMORY
                        ),
                        "{what}: {step:?}: {e}"
                    );
                    assert!(e.message.contains("failed with"), "{what}: {e}");
                }
            }
            self.check_books();
        }
        failed
    }

    /// Clear the faults, return the cache, check nothing leaked, release everything and check
    /// that the driver holds nothing.
    fn finish(mut self, what: &str) {
        self.sim.clear_faults();
        self.check_nothing_leaks();
        for (_, (ptr, _, _)) in std::mem::take(&mut self.live) {
            self.pool.release(ptr).unwrap();
        }
        self.pool.free_reusable(None).unwrap();
        self.check_books();
        self.check_all_returned(what);
    }
}

/// The functions that give memory or events back to the driver: what clean-up calls.
const CLEAN_UP: [Call; 5] = [
    Call::MemUnmap,
    Call::MemRelease,
    Call::MemAddressFree,
    Call::MemFree,
    Call::EventDestroy,
];

#[test]
fn a_failing_clean_up_after_every_failure_loses_nothing() {
    second_failure_sweep(Mode::Classic);
}

#[test]
fn a_failing_clean_up_after_every_failure_loses_nothing_with_stitching() {
    second_failure_sweep(Mode::Stitched);
}

#[test]
fn a_failing_clean_up_after_every_failure_loses_nothing_with_handles_of_one_page() {
    second_failure_sweep(Mode::WholeHandles);
}

#[test]
fn a_failing_clean_up_after_every_failure_loses_nothing_with_handles_of_larger_parts() {
    second_failure_sweep(Mode::Parts);
}

/// Every failure of the first sweep (once), with each clean-up call made during the failing
/// operation, and the next one, failing too.
fn second_failure_sweep(mode: Mode) {
    let code = codes::CUDA_ERROR_LAUNCH_FAILED;
    let (mut runs, mut injected, mut failed_ops) = (0u64, 0u64, 0u64);
    for (call, n) in clean_counts(mode) {
        for nth in positions(mode, n, 8) {
            let first = Fault::once(call, nth, code);
            // Where the first failure fires: the clean-up calls made before that step and
            // by its end.
            let mut probe = Run::new(mode);
            probe.sim.inject_fault(first);
            let mut window: Vec<(Call, u64, u64)> = Vec::new();
            for &step in WORKLOAD {
                let before: Vec<u64> = CLEAN_UP.iter().map(|&c| probe.sim.call_count(c)).collect();
                let fired = probe.sim.injected_failures();
                let _ = probe.step(step);
                if probe.sim.injected_failures() > fired {
                    window = CLEAN_UP
                        .iter()
                        .zip(before)
                        .map(|(&c, b)| (c, b, probe.sim.call_count(c)))
                        .collect();
                    break;
                }
            }
            for (cleanup, before, after) in window {
                for nth2 in positions(mode, after + 1 - before, 4)
                    .into_iter()
                    .map(|k| before + k)
                {
                    let second = Fault::once(cleanup, nth2, code);
                    let what = format!("{first} then {second}");
                    let mut run = Run::new(mode);
                    run.sim.inject_fault(first);
                    run.sim.inject_fault(second);
                    failed_ops += run.run_checked(&what);
                    injected += run.sim.injected_failures();
                    runs += 1;
                    run.finish(&what);
                }
            }
        }
    }
    eprintln!(
        "second faults ({mode:?}): {runs} runs, {injected} failures injected, {failed_ops} \
         operations failed with the right status",
    );
    assert!(runs > 0 && injected > runs, "second failures were injected");
}

/// The scenarios of a segment build that breaks (a failed map, or a failed access) and whose
/// undoing fails too (an unmap), on a 2 GiB device. The first
/// builds a 1 GiB segment from twelve 64 MiB holes of a 1.5 GiB warm-up (twelve maps and one
/// new handle) and fails at its second map; the others fail a fresh 64 MiB segment. What the
/// pool could not take back stays counted as reserved until `free_reusable` returns it; the
/// driver ends holding nothing.
#[test]
fn a_failed_unmap_while_undoing_a_segment_build_leaks_nothing() {
    for (spec, holes) in [
        ("cuMemMap@2=999,cuMemUnmap@1=999", true),
        ("cuMemSetAccess@1=999,cuMemUnmap@1=999", false),
    ] {
        let mut run = Run::with_devices(true, &[2 * GIB]);
        let stream = run.streams[0][0];
        let mut kept = Vec::new();
        let size = if holes {
            run.pool.warmup(0, 1536 * MIB).unwrap();
            for i in 0..24 {
                let p = run.pool.reserve(0, 64 * MIB, stream).unwrap();
                if i % 2 == 0 {
                    run.pool.release(p).unwrap();
                } else {
                    let name: &'static str = Box::leak(format!("kept {i}").into_boxed_str());
                    run.live.insert(name, (p, 0, 64 * MIB));
                    kept.push(name);
                }
            }
            GIB
        } else {
            64 * MIB
        };
        run.sim.inject_faults(spec).unwrap();
        let e = run.pool.reserve(0, size, stream).unwrap_err();
        assert_eq!(e.status, rm_status::RM_ERROR_DRIVER, "{spec}: {e}");
        run.check_books();
        assert_eq!(run.sim.injected_failures(), 2, "{spec}");
        run.sim.clear_faults();
        // The pool works on while the driver holds the memory it could not take back.
        let p = run.pool.reserve(0, size, stream).unwrap();
        run.pool.release(p).unwrap();
        for name in kept {
            let (p, _, _) = run.live.remove(name).unwrap();
            run.pool.release(p).unwrap();
        }
        run.pool.free_reusable(None).unwrap();
        run.check_books();
        run.check_all_returned(spec);
    }
}

/// A segment build whose access fails is undone without freeing address space (its range goes
/// back to its chunk); the chunk's own free, in `free_reusable`, failing keeps the chunk, and
/// the next `free_reusable` frees it.
#[test]
fn a_failed_address_free_keeps_the_chunk_for_the_next_sweep() {
    let run = Run::with_devices(true, &[2 * GIB]);
    let stream = run.streams[0][0];
    run.sim.inject_faults("cuMemSetAccess@1=999").unwrap();
    let e = run.pool.reserve(0, 64 * MIB, stream).unwrap_err();
    assert_eq!(e.status, rm_status::RM_ERROR_DRIVER, "{e}");
    assert_eq!(run.sim.call_count(Call::MemAddressFree), 0);
    run.check_books();
    run.sim.clear_faults();
    let p = run.pool.reserve(0, 64 * MIB, stream).unwrap();
    run.pool.release(p).unwrap();
    assert_eq!(run.sim.reserved_ranges(), 1, "one chunk for both builds");
    run.sim.inject_faults("cuMemAddressFree@1=999").unwrap();
    let e = run.pool.free_reusable(None).unwrap_err();
    assert_eq!(e.status, rm_status::RM_ERROR_DRIVER, "{e}");
    assert!(e.message.contains("unused address space"), "{}", e.message);
    run.check_books();
    assert_eq!(
        (
            run.pool.stats(0).unwrap().reserved_bytes,
            run.sim.used_bytes(0)
        ),
        (0, 0),
        "the memory went back; only the address space is kept"
    );
    assert_eq!(run.sim.reserved_ranges(), 1);
    run.sim.clear_faults();
    run.pool.free_reusable(None).unwrap();
    run.check_books();
    run.check_all_returned("cuMemAddressFree@1=999");
}

/// The workload without faults: every step succeeds. Returns the calls made per driver call.
fn clean_counts(mode: Mode) -> Vec<(Call, u64)> {
    let mut run = Run::new(mode);
    let before: Vec<u64> = Call::ALL.iter().map(|&c| run.sim.call_count(c)).collect();
    for &step in WORKLOAD {
        run.step(step).unwrap_or_else(|e| panic!("{step:?}: {e}"));
        run.check_books();
    }
    // The retries of `l`, on its own shard while the first caches `g`, and of `h`, on the first
    // while `l`'s shard caches it (stitched: in the pass that waits for `g`'s stream, and in the
    // next), each served once the other shard's cache went back.
    let s1 = run.pool.stats(1).unwrap();
    assert_eq!(
        (s1.oom_retries, s1.ooms),
        (if mode == Mode::Classic { 2 } else { 3 }, 0),
        "the workload reaches the out-of-memory retry in both shards"
    );
    run.check_nothing_leaks();
    Call::ALL
        .iter()
        .zip(before)
        .map(|(&c, b)| (c, run.sim.call_count(c) - b))
        .filter(|&(_, n)| n > 0)
        .collect()
}

#[test]
fn every_driver_call_failing_at_every_position() {
    sweep(Mode::Classic);
}

#[test]
fn every_driver_call_failing_at_every_position_with_stitching() {
    sweep(Mode::Stitched);
}

#[test]
fn every_driver_call_failing_at_every_position_with_handles_of_one_page() {
    sweep(Mode::WholeHandles);
}

#[test]
fn every_driver_call_failing_at_every_position_with_handles_of_larger_parts() {
    sweep(Mode::Parts);
}

/// The positions at which a call made `n` times is failed: every one, but with handles of one
/// page each (a call per 2 MiB page, thousands in this workload) the first and last eight and
/// about `spread` between them, so that the sweep runs in about the time of the others.
fn positions(mode: Mode, n: u64, spread: u64) -> Vec<u64> {
    if !mode.whole_only() || n <= 16 + spread {
        return (1..=n).collect();
    }
    let step = (n - 16).div_ceil(spread);
    (1..=8)
        .chain((9..=n - 8).step_by(step as usize))
        .chain(n - 7..=n)
        .collect()
}

/// Run the workload with each driver call it makes failing at each position in turn.
fn sweep(mode: Mode) {
    let stitched = mode != Mode::Classic;
    let counts = clean_counts(mode);
    let called: Vec<&str> = counts.iter().map(|(c, _)| c.name()).collect();
    let needed: &[&str] = if stitched {
        &[
            "cuMemCreate",
            "cuMemMap",
            "cuMemUnmap",
            "cuMemRelease",
            "cuEventRecord",
        ]
    } else {
        &[
            "cuMemAlloc_v2",
            "cuMemFree_v2",
            "cuMemGetInfo_v2",
            "cuEventRecord",
        ]
    };
    for &needed in needed {
        assert!(called.contains(&needed), "{needed} not reached: {called:?}");
    }
    let (mut runs, mut injected, mut failed_ops) = (0u64, 0u64, 0u64);
    for &(call, n) in &counts {
        let codes: &[i32] = if call == Call::MemAlloc || call == Call::MemCreate {
            &[
                codes::CUDA_ERROR_OUT_OF_MEMORY,
                codes::CUDA_ERROR_LAUNCH_FAILED,
            ]
        } else {
            &[codes::CUDA_ERROR_LAUNCH_FAILED, codes::CUDA_ERROR_UNKNOWN]
        };
        for nth in positions(mode, n, 32) {
            for &code in codes {
                for fault in [
                    Fault::once(call, nth, code),
                    Fault::from_nth(call, nth, code),
                ] {
                    runs += 1;
                    let mut run = Run::new(mode);
                    run.sim.inject_fault(fault);
                    let mut degraded = false;
                    for &step in WORKLOAD {
                        let fired = run.sim.injected_failures();
                        let outcome = run.step(step);
                        let fired = run.sim.injected_failures() - fired;
                        match outcome {
                            Ok(()) => {}
                            Err(e) if fired == 0 => {
                                // A block an earlier failure left live can crowd out a later
                                // request: only out-of-memory, and only after a failure.
                                assert!(
                                    degraded && e.status == rm_status::RM_ERROR_OUT_OF_MEMORY,
                                    "{fault}: {step:?} failed with no fault: {e}"
                                );
                            }
                            Err(e) => {
                                failed_ops += 1;
                                degraded = true;
                                if code == codes::CUDA_ERROR_OUT_OF_MEMORY {
                                    assert_eq!(
                                        e.status,
                                        rm_status::RM_ERROR_OUT_OF_MEMORY,
                                        "{fault}: {step:?}: {e}"
                                    );
                                } else {
                                    assert_eq!(
                                        e.status,
                                        rm_status::RM_ERROR_DRIVER,
                                        "{fault}: {step:?}: {e}"
                                    );
                                    let named = format!(
                                        "{} failed with {} ({code})",
                                        call.name(),
                                        codes::name(code).unwrap()
                                    );
                                    assert!(e.message.contains(&named), "{fault}: {e}");
                                }
                            }
                        }
                        run.check_books();
                    }
                    injected += run.sim.injected_failures();
                    run.sim.clear_faults();
                    run.check_nothing_leaks();
                    // The pool keeps working: every device and stream serves and takes back.
                    for d in 0..2 {
                        for s in 0..3 {
                            let stream = run.streams[d as usize][s];
                            let p = run.pool.reserve(d, 5 * MIB, stream).unwrap();
                            let q = run.pool.reserve(d, 4096, stream).unwrap();
                            run.pool.release(p).unwrap();
                            run.pool.release(q).unwrap();
                        }
                    }
                    for (_, (ptr, _, _)) in std::mem::take(&mut run.live) {
                        run.pool.release(ptr).unwrap();
                    }
                    run.check_nothing_leaks();
                    run.check_all_returned(&fault.to_string());
                }
            }
        }
    }
    eprintln!(
        "faults ({mode:?}): {runs} runs of {} steps over {} driver calls; {injected} failures \
         injected, {failed_ops} operations failed with the right status",
        WORKLOAD.len(),
        counts.len()
    );
    assert!(injected >= runs, "every run injected at least one failure");
}
