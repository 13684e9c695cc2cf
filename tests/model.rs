//! Model-based property tests: random sequences of every pool operation on several simulated
//! devices and streams, with sizes from 1 byte to GiBs, checked after every step against a
//! reference model of the live blocks and against the simulated driver's own books.
//!
//! `PROPTEST_CASES` sets the number of sequences (default 10000 per test, six tests, each
//! sequence up to 80 operations); a long run: `PROPTEST_CASES=200000 cargo test --release --test
//! model`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use cuda_sim::{Sim, VmmSetting};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Front, Pool, PoolConfig, Stats};

mod common;
use common::under::Under;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 2 * MIB;
/// Three devices: one roomy, one small enough that large requests run out of memory, and one
/// so small that large blocks fill it and small requests run out too (the last resort that
/// serves them from free large blocks).
const CAPACITIES: [u64; 3] = [8 * GIB, 2 * GIB, 48 * MIB];
/// Created streams per device, besides the default stream.
const STREAMS: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    Reserve {
        device: i32,
        size: u64,
        stream: usize,
    },
    /// A reserve while the stream (a created one) captures a graph: `reserve_no_wait`, the
    /// capture begun before and ended after it, which must end cleanly.
    ReserveCaptured {
        device: i32,
        size: u64,
        stream: usize,
    },
    Release(Index),
    ReleaseInterior(Index, u64),
    DoubleRelease,
    RecordStream(Index, usize),
    Enqueue {
        device: i32,
        stream: usize,
    },
    Complete {
        device: i32,
        stream: usize,
    },
    FreeReusable(Option<i32>),
    Warmup {
        device: i32,
        bytes: u64,
    },
    MemGetInfo(i32),
    ResetPeaks(i32),
    SetLimit(Option<i32>, Option<u64>),
    /// The stream moves to a shard of its own where it owns no memory in its shard, as when a
    /// reserve meets another thread there.
    OwnShard {
        device: i32,
        stream: usize,
    },
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=4096,
        4 => 4097u64..=MIB,
        3 => MIB + 1..=64 * MIB,
        1 => 64 * MIB..=6 * GIB,
    ]
}

fn device() -> impl Strategy<Value = i32> {
    0..CAPACITIES.len() as i32
}

fn op() -> impl Strategy<Value = Op> {
    let stream = 0..=STREAMS;
    prop_oneof![
        12 => (device(), size(), stream.clone())
            .prop_map(|(device, size, stream)| Op::Reserve { device, size, stream }),
        3 => (device(), size(), 1..=STREAMS)
            .prop_map(|(device, size, stream)| Op::ReserveCaptured { device, size, stream }),
        8 => any::<Index>().prop_map(Op::Release),
        1 => (any::<Index>(), 1u64..4096).prop_map(|(i, off)| Op::ReleaseInterior(i, off)),
        1 => Just(Op::DoubleRelease),
        3 => (any::<Index>(), stream.clone()).prop_map(|(i, s)| Op::RecordStream(i, s)),
        2 => (device(), stream.clone()).prop_map(|(device, stream)| Op::Enqueue { device, stream }),
        2 => (device(), stream.clone()).prop_map(|(device, stream)| Op::Complete { device, stream }),
        2 => (device(), stream).prop_map(|(device, stream)| Op::OwnShard { device, stream }),
        1 => prop::option::of(device()).prop_map(Op::FreeReusable),
        1 => (device(), 1u64..=3 * GIB).prop_map(|(device, bytes)| Op::Warmup { device, bytes }),
        1 => device().prop_map(Op::MemGetInfo),
        1 => device().prop_map(Op::ResetPeaks),
        1 => (prop::option::of(device()), prop::option::of(0u64..=4 * GIB))
            .prop_map(|(d, l)| Op::SetLimit(d, l)),
    ]
}

/// What the runs exercised, for the report: operations, successful reserves, out-of-memory
/// failures, blocks released while pending on other streams' work.
static OPS: AtomicU64 = AtomicU64::new(0);
static RESERVED: AtomicU64 = AtomicU64::new(0);
static OOMS: AtomicU64 = AtomicU64::new(0);
static SEQUENCES: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Copy, Debug)]
struct Block {
    device: i32,
    size: u64,
    requested: u64,
}

/// The reference model: what the caller knows.
struct Model {
    pool: Box<dyn Under>,
    sim: &'static Sim,
    /// Streams per device: the default stream (0) and the created ones.
    streams: Vec<Vec<u64>>,
    /// Live blocks by address.
    live: BTreeMap<u64, Block>,
    released: Vec<u64>,
    peaks: Vec<(u64, u64)>,
    limits: Vec<Option<u64>>,
    /// Segments are stitched from physical chunks (`vmm:true`), not `cuMemAlloc`ed.
    stitched: bool,
    /// The driver maps only from an allocation's start: each handle the pool creates or
    /// releases is a driver call per page.
    whole_only: bool,
}

fn fail(message: String) -> TestCaseError {
    TestCaseError::fail(message)
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(fail(format!($($fmt)*)));
        }
    };
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// The segment a block needs when nothing cached fits: PyTorch's sizes.
fn segment_for(block: u64) -> u64 {
    if block <= MIB {
        PAGE
    } else if block < 10 * MIB {
        20 * MIB
    } else {
        round_up(block, PAGE)
    }
}

impl Model {
    fn new(config: PoolConfig, front: bool, parts: Option<u64>) -> Model {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&CAPACITIES)));
        let whole_only = parts.is_some();
        if whole_only {
            sim.set_vmm(VmmSetting::StartOnly);
        }
        // As resmem loads a driver: handles of parts (one page each by default) where it maps
        // only from an allocation's start.
        let driver = PageHandles::with_part(
            SimDriver::new(sim).expect("the simulator initialises"),
            parts.unwrap_or(0),
        );
        let streams = (0..CAPACITIES.len() as i32)
            .map(|d| {
                let mut s = vec![0];
                s.extend((0..STREAMS).map(|_| sim.stream_create(d).unwrap()));
                s
            })
            .collect();
        Model {
            stitched: config.vmm,
            whole_only,
            pool: {
                let pool = Pool::new(Arc::new(driver), config);
                if front {
                    Box::new(Front::new(pool))
                } else {
                    Box::new(pool)
                }
            },
            sim,
            streams,
            live: BTreeMap::new(),
            released: Vec::new(),
            peaks: vec![(0, 0); CAPACITIES.len()],
            limits: vec![None; CAPACITIES.len()],
        }
    }

    fn pick(&self, index: &Index) -> Option<(u64, Block)> {
        if self.live.is_empty() {
            return None;
        }
        let i = index.index(self.live.len());
        self.live.iter().nth(i).map(|(&p, &b)| (p, b))
    }

    fn stats(&self, device: i32) -> Stats {
        self.pool.stats(device).unwrap()
    }

    /// An out-of-memory is justified when the segment cannot fit even now that the pool has
    /// returned what it could: in the driver's free memory or under the limit.
    fn oom_is_justified(&self, device: i32, segment: u64) -> Result<(), TestCaseError> {
        let (free, total) = self.sim.mem_get_info(device).unwrap();
        let reserved = self.stats(device).reserved_bytes;
        let under_limit = self.limits[device as usize].map(|l| l.saturating_sub(reserved));
        ensure!(
            segment > free || segment > total || under_limit.is_some_and(|room| segment > room),
            "out of memory for a {segment}-byte segment on device {device} with {free} bytes free \
             on the driver and room {under_limit:?} under the limit"
        );
        Ok(())
    }

    /// A reserve on `stream` of `device`: `captured`, by `reserve_no_wait` while the stream
    /// captures a graph, whose capture must end cleanly (no wait the driver refuses was made).
    fn reserve(
        &mut self,
        device: i32,
        size: u64,
        stream: usize,
        captured: bool,
    ) -> Result<(), TestCaseError> {
        let handle = self.streams[device as usize][stream];
        let block = round_up(size, 512);
        let reserved = if captured {
            self.sim.stream_begin_capture(device, handle).unwrap();
            let reserved = self.pool.reserve_no_wait(device, size, handle);
            let ended = self.sim.stream_end_capture(device, handle);
            ensure!(
                ended.is_ok(),
                "a reserve of {size} during a capture made a wait the driver refused: {ended:?}"
            );
            reserved
        } else {
            self.pool.reserve(device, size, handle)
        };
        match reserved {
            Ok(ptr) => {
                ensure!(
                    ptr != 0 && ptr % 512 == 0,
                    "pointer {ptr:#x} is not aligned"
                );
                let b = Block {
                    device,
                    size: block,
                    requested: size,
                };
                self.check_placement(ptr, b)?;
                self.live.insert(ptr, b);
                RESERVED.fetch_add(1, Relaxed);
            }
            Err(e) => {
                ensure!(
                    e.status == rm_status::RM_ERROR_OUT_OF_MEMORY,
                    "reserve of {size} failed with {e}"
                );
                OOMS.fetch_add(1, Relaxed);
                self.oom_is_justified(device, segment_for(block))?;
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        OPS.fetch_add(1, Relaxed);
        match *op {
            Op::Reserve {
                device,
                size,
                stream,
            } => self.reserve(device, size, stream, false)?,
            Op::ReserveCaptured {
                device,
                size,
                stream,
            } => self.reserve(device, size, stream, true)?,
            Op::Release(ref index) => {
                if let Some((ptr, _)) = self.pick(index) {
                    self.pool.release(ptr).map_err(|e| fail(e.to_string()))?;
                    self.live.remove(&ptr);
                    self.released.push(ptr);
                }
            }
            Op::ReleaseInterior(ref index, offset) => {
                if let Some((ptr, b)) = self.pick(index) {
                    let inner = ptr + offset.min(b.size - 1).max(1);
                    let e = self.pool.release(inner).unwrap_err();
                    ensure!(
                        e.status == rm_status::RM_ERROR_INVALID_POINTER,
                        "interior release: {e}"
                    );
                }
            }
            Op::DoubleRelease => {
                if let Some(&ptr) = self.released.last() {
                    // The address may have been handed out again since.
                    if !self.live.contains_key(&ptr) {
                        let e = self.pool.release(ptr).unwrap_err();
                        ensure!(
                            e.status == rm_status::RM_ERROR_INVALID_POINTER,
                            "double release: {e}"
                        );
                    }
                }
            }
            Op::RecordStream(ref index, stream) => {
                if let Some((ptr, b)) = self.pick(index) {
                    let handle = self.streams[b.device as usize][stream];
                    self.pool
                        .record_stream(ptr, handle)
                        .map_err(|e| fail(e.to_string()))?;
                }
            }
            Op::Enqueue { device, stream } => {
                let handle = self.streams[device as usize][stream];
                self.sim.enqueue_work(device, handle).unwrap();
            }
            Op::Complete { device, stream } => {
                let handle = self.streams[device as usize][stream];
                self.sim.complete_work(device, handle).unwrap();
            }
            Op::FreeReusable(device) => {
                let devices = match device {
                    Some(d) => vec![d],
                    None => (0..CAPACITIES.len() as i32).collect(),
                };
                let before: u64 = devices.iter().map(|&d| self.stats(d).reserved_bytes).sum();
                let returned = self
                    .pool
                    .free_reusable(device)
                    .map_err(|e| fail(e.to_string()))?;
                let after: u64 = devices.iter().map(|&d| self.stats(d).reserved_bytes).sum();
                ensure!(
                    returned == before - after,
                    "returned {returned}, reserved {before} -> {after}"
                );
                // With the virtual-memory API, the bound: the driver holds exactly the handles
                // mapped in the address ranges that hold a live block. (Counted in the pool's
                // handles, which the driver sees only where they are its own: with handles of
                // one page each, the same decisions keep whole pool handles.)
                for d in devices
                    .iter()
                    .copied()
                    .filter(|_| self.stitched && !self.whole_only)
                {
                    let mut handles: Vec<(u64, u64)> = self
                        .sim
                        .range_handles(d)
                        .into_iter()
                        .filter(|&((addr, len), _)| {
                            self.live
                                .range(..addr + len)
                                .next_back()
                                .is_some_and(|(&p, b)| p + b.size > addr)
                        })
                        .flat_map(|(_, handles)| handles)
                        .collect();
                    handles.sort_unstable();
                    handles.dedup();
                    let kept: u64 = handles.iter().map(|&(_, size)| size).sum();
                    ensure!(
                        self.sim.used_bytes(d) == kept,
                        "device {d}: {} bytes held after free_reusable, the handles mapped in \
                         ranges with live blocks hold {kept}",
                        self.sim.used_bytes(d)
                    );
                }
                // Only segments holding a live block remain.
                for d in devices.iter().copied().filter(|_| !self.stitched) {
                    let kept: u64 = self
                        .sim
                        .allocations(d)
                        .iter()
                        .filter(|&&(base, len)| self.live.range(base..base + len).next().is_some())
                        .map(|&(_, len)| len)
                        .sum();
                    ensure!(
                        self.sim.used_bytes(d) == kept,
                        "device {d}: {} bytes held after free_reusable, live blocks need {kept}",
                        self.sim.used_bytes(d)
                    );
                }
            }
            Op::Warmup { device, bytes } => {
                let before = self.stats(device);
                match self.pool.warmup(device, bytes) {
                    Ok(allocated) => {
                        let expected = if bytes <= before.reusable_bytes {
                            0
                        } else {
                            round_up(bytes - before.reusable_bytes, PAGE)
                        };
                        ensure!(
                            allocated == expected,
                            "warm-up of {bytes} allocated {allocated}, expected {expected}"
                        );
                        ensure!(
                            self.stats(device).reusable_bytes >= bytes,
                            "warm-up left too little reusable"
                        );
                    }
                    Err(e) => {
                        ensure!(
                            e.status == rm_status::RM_ERROR_OUT_OF_MEMORY,
                            "warm-up failed with {e}"
                        );
                        self.oom_is_justified(
                            device,
                            round_up(bytes - before.reusable_bytes, PAGE),
                        )?;
                    }
                }
            }
            Op::MemGetInfo(device) => {
                let (free, total) = self.pool.mem_get_info(device).unwrap();
                let (driver_free, driver_total) = self.sim.mem_get_info(device).unwrap();
                let s = self.stats(device);
                let mut expected = (driver_free + s.reusable_bytes).min(driver_total);
                if let Some(limit) = self.limits[device as usize] {
                    expected = expected.min(limit.saturating_sub(s.allocated_bytes));
                }
                ensure!(
                    (free, total) == (expected, driver_total),
                    "mem_get_info {:?}, expected {:?}",
                    (free, total),
                    (expected, driver_total)
                );
            }
            Op::OwnShard { device, stream } => {
                let handle = self.streams[device as usize][stream];
                self.pool
                    .own_shard(device, handle)
                    .map_err(|e| fail(e.to_string()))?;
            }
            Op::ResetPeaks(device) => {
                self.pool.reset_peak_stats(device).unwrap();
                let s = self.stats(device);
                ensure!(
                    (s.peak_allocated_bytes, s.peak_reserved_bytes)
                        == (s.allocated_bytes, s.reserved_bytes),
                    "peaks after reset: {s:?}"
                );
                self.peaks[device as usize] = (s.allocated_bytes, s.reserved_bytes);
            }
            Op::SetLimit(device, limit) => {
                let devices = match device {
                    Some(d) => vec![d],
                    None => (0..CAPACITIES.len() as i32).collect(),
                };
                let before: u64 = devices.iter().map(|&d| self.stats(d).reserved_bytes).sum();
                let returned = self
                    .pool
                    .set_memory_limit(device, limit)
                    .map_err(|e| fail(e.to_string()))?;
                let after: u64 = devices.iter().map(|&d| self.stats(d).reserved_bytes).sum();
                ensure!(
                    returned == before - after,
                    "limit returned {returned}, reserved {before} -> {after}"
                );
                for d in devices {
                    self.limits[d as usize] = limit;
                    ensure!(
                        self.pool.memory_limit(d).unwrap() == limit,
                        "limit not kept"
                    );
                }
            }
        }
        self.check_books()
    }

    /// A new block lies inside one segment of its device and overlaps no other live block.
    fn check_placement(&self, ptr: u64, b: Block) -> Result<(), TestCaseError> {
        let inside = self
            .sim
            .accessible_ranges(b.device)
            .iter()
            .any(|&(base, len)| base <= ptr && ptr + b.size <= base + len);
        ensure!(
            inside,
            "block {ptr:#x}+{} lies in no segment of device {}",
            b.size,
            b.device
        );
        if let Some((&prev, pb)) = self.live.range(..=ptr).next_back() {
            ensure!(
                prev + pb.size <= ptr,
                "block {ptr:#x} overlaps {prev:#x}+{}",
                pb.size
            );
        }
        if let Some((&next, _)) = self.live.range(ptr..).next() {
            ensure!(
                ptr + b.size <= next,
                "block {ptr:#x}+{} overlaps {next:#x}",
                b.size
            );
        }
        Ok(())
    }

    fn check_books(&mut self) -> Result<(), TestCaseError> {
        self.pool.check().map_err(fail)?;
        let (mut allocs, mut frees) = (0, 0);
        for device in 0..CAPACITIES.len() as i32 {
            let s = self.stats(device);
            let blocks = self.live.values().filter(|b| b.device == device);
            let (mut allocated, mut requested, mut count) = (0, 0, 0);
            for b in blocks {
                allocated += b.size;
                requested += b.requested;
                count += 1;
            }
            let segments = self.sim.allocations(device);
            ensure!(
                (s.allocated_bytes, s.requested_bytes, s.live_blocks)
                    == (allocated, requested, count),
                "device {device}: stats {s:?}, model ({allocated}, {requested}, {count})"
            );
            let segment_count = if self.stitched {
                s.segments
            } else {
                segments.len() as u64
            };
            ensure!(
                s.reserved_bytes == self.sim.used_bytes(device) && s.segments == segment_count,
                "device {device}: reserved {} in {} segments, the driver holds {} in {}",
                s.reserved_bytes,
                s.segments,
                self.sim.used_bytes(device),
                segments.len()
            );
            ensure!(
                s.allocated_bytes + s.reusable_bytes == s.reserved_bytes,
                "device {device}: allocated + reusable != reserved: {s:?}"
            );
            let (peak_a, peak_r) = self.peaks[device as usize];
            ensure!(
                s.peak_allocated_bytes >= peak_a.max(s.allocated_bytes)
                    && s.peak_reserved_bytes >= peak_r.max(s.reserved_bytes),
                "device {device}: a peak went down: {s:?}, was ({peak_a}, {peak_r})"
            );
            self.peaks[device as usize] = (s.peak_allocated_bytes, s.peak_reserved_bytes);
            allocs += s.driver_allocs;
            frees += s.driver_frees;
        }
        // Stitched segments are made of cuMemCreate'd chunks: count those calls instead.
        let made = if self.stitched {
            self.sim.vmm_calls()
        } else {
            (self.sim.alloc_calls(), self.sim.free_calls())
        };
        // Where the driver maps only from an allocation's start, each handle the pool counts is a
        // call per page.
        let per_page = self.whole_only && made.0 >= allocs && made.1 >= frees;
        ensure!(
            made == (allocs, frees) || per_page,
            "driver calls counted ({allocs}, {frees}), made {made:?}"
        );
        Ok(())
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// Run `cases()` random sequences against a pool with `config`, behind the front caches if
/// `front`, on devices whose `cuMemMap` maps only from an allocation's start if `parts` (the
/// size of the parts handles are made of, 0 for a page).
fn run_sequences(config: PoolConfig, front: bool, parts: Option<u64>) {
    let runner_config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(runner_config);
    let result = runner.run(&prop::collection::vec(op(), 1..80), |ops| {
        SEQUENCES.fetch_add(1, Relaxed);
        let mut model = Model::new(config, front, parts);
        for op in &ops {
            model.apply(op)?;
        }
        // Everything released and returned, the driver holds nothing.
        let ptrs: Vec<u64> = model.live.keys().copied().collect();
        for ptr in ptrs {
            model.pool.release(ptr).map_err(|e| fail(e.to_string()))?;
            model.live.remove(&ptr);
        }
        model
            .pool
            .free_reusable(None)
            .map_err(|e| fail(e.to_string()))?;
        model.check_books()?;
        for d in 0..CAPACITIES.len() as i32 {
            ensure!(
                model.sim.used_bytes(d) == 0
                    && model.sim.live_allocations(d) == 0
                    && model.sim.physical_allocations(d) == 0,
                "device {d} still holds memory"
            );
        }
        ensure!(
            model.sim.reserved_ranges() == 0,
            "{} address ranges are still reserved",
            model.sim.reserved_ranges()
        );
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!(
        "model: {} sequences so far, {} operations, {} blocks reserved, {} out-of-memory failures",
        SEQUENCES.load(Relaxed),
        OPS.load(Relaxed),
        RESERVED.load(Relaxed),
        OOMS.load(Relaxed)
    );
}

/// The default: page-granular reuse with the virtual-memory API.
#[test]
fn random_sequences_keep_the_books_exact() {
    run_sequences(PoolConfig::default(), false, None);
}

/// The default on a driver that maps only from an allocation's start, as the CUDA driver: the
/// pool's handles made of one-page handles (`PageHandles`).
#[test]
fn random_sequences_keep_the_books_exact_with_handles_of_one_page() {
    run_sequences(PoolConfig::default(), false, Some(0));
}

/// The same with handles of 6 MiB parts, each lent only whole (`PageHandles::with_part`).
#[test]
fn random_sequences_keep_the_books_exact_with_handles_of_larger_parts() {
    run_sequences(PoolConfig::default(), false, Some(6 * MIB));
}

/// The same through the front caches: released blocks wait in this thread's cache, counted as
/// reusable, and go back to the pool before it would grow.
#[test]
fn random_sequences_through_the_front_caches_keep_the_books_exact() {
    run_sequences(PoolConfig::default(), true, None);
}

#[test]
fn random_sequences_keep_the_books_exact_with_classic_segments() {
    run_sequences(
        PoolConfig {
            vmm: false,
            ..PoolConfig::default()
        },
        false,
        None,
    );
}

#[test]
fn random_sequences_keep_the_books_exact_without_release_before_grow() {
    run_sequences(
        PoolConfig {
            release_before_grow: false,
            vmm: false,
            ..PoolConfig::default()
        },
        false,
        None,
    );
}
