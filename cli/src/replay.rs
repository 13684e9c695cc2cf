//! A trace driven through an allocation policy on a fresh simulated device, and the figures
//! that compare policies: peaks, fragmentation, driver calls by kind and their estimated time,
//! out-of-memory events, and the smallest device the trace runs on. [`crate::report`] prints
//! them.

use std::collections::HashMap;
use std::sync::Arc;

use cuda_sim::{ledger, Call, CallTally, Sim};
use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::error::rm_status;
use resmem::pool::Layout;
use resmem::{Front, Pool, PoolConfig, Stats};

use crate::allocator::Allocator;
use crate::baseline::{TorchAllocator, TorchConfig};
use crate::trace::{Event, Trace};
use crate::units::gib_or_mib;

/// An allocation policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// resmem's pool with its default settings (`PoolConfig::default()`).
    Resmem,
    /// resmem's pool with classic segments (`vmm:false`).
    ResmemClassic,
    /// resmem's pool on the CUDA virtual-memory API (`vmm:true`).
    ResmemVmm,
    /// resmem's default pool behind the per-thread front caches ([`Front`]), as the C library
    /// and PyTorch programs use it: a released block waits in the caller's cache for the next
    /// request of its size and stream, unmerged, until a growth drains the caches (or, a block
    /// over 1 MiB, until a request over 1 MiB on its thread and stream misses the cache).
    ResmemFront,
    /// PyTorch's caching allocator.
    Torch,
}

impl Policy {
    /// The policy's name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Resmem => "resmem",
            Policy::ResmemClassic => "resmem-classic",
            Policy::ResmemVmm => "resmem-vmm",
            Policy::ResmemFront => "resmem-front",
            Policy::Torch => "torch",
        }
    }

    /// The pool settings of a resmem policy; `None` for PyTorch's.
    pub fn pool_config(self) -> Option<PoolConfig> {
        match self {
            Policy::Resmem | Policy::ResmemFront => Some(PoolConfig::default()),
            Policy::ResmemClassic => Some(PoolConfig {
                vmm: false,
                ..PoolConfig::default()
            }),
            Policy::ResmemVmm => Some(PoolConfig {
                vmm: true,
                ..PoolConfig::default()
            }),
            Policy::Torch => None,
        }
    }

    /// Whether this policy is resmem's default pool (a named policy may coincide with it); the
    /// default behind the front caches is told apart.
    pub fn is_default(self) -> bool {
        self != Policy::ResmemFront && self.pool_config() == Some(PoolConfig::default())
    }

    /// An allocator of this policy over `driver` (PyTorch's with its default settings).
    pub fn build(self, driver: Arc<dyn resmem::Driver>) -> Box<dyn Allocator> {
        self.build_logged(driver, false, TorchConfig::default())
            .expect("the default configuration is valid")
    }

    /// [`Policy::build`], a resmem pool logging its decisions to standard error if `logging`,
    /// PyTorch's with the settings `torch`; an error for settings PyTorch refuses.
    fn build_logged(
        self,
        driver: Arc<dyn resmem::Driver>,
        logging: bool,
        torch: TorchConfig,
    ) -> Result<Box<dyn Allocator>, String> {
        Ok(match self.pool_config() {
            Some(config) if self == Policy::ResmemFront => Box::new(Front::new(Pool::new(
                driver,
                PoolConfig { logging, ..config },
            ))),
            Some(config) => Box::new(Pool::new(driver, PoolConfig { logging, ..config })),
            None => Box::new(TorchAllocator::new(driver, torch).map_err(|e| e.message)?),
        })
    }
}

/// The driver functions a caching allocator calls, in table order, with the rows' labels;
/// event and stream-order calls are summed in one row.
pub const CALL_ROWS: &[(&str, &[Call])] = &[
    ("cuMemAlloc", &[Call::MemAlloc]),
    ("cuMemFree", &[Call::MemFree]),
    ("cuMemCreate", &[Call::MemCreate]),
    ("cuMemRelease", &[Call::MemRelease]),
    ("cuMemMap", &[Call::MemMap]),
    ("cuMemUnmap", &[Call::MemUnmap]),
    ("cuMemSetAccess", &[Call::MemSetAccess]),
    ("cuMemAddressReserve", &[Call::MemAddressReserve]),
    ("cuMemAddressFree", &[Call::MemAddressFree]),
    (
        "events",
        &[
            Call::EventCreate,
            Call::EventRecord,
            Call::EventQuery,
            Call::EventSynchronize,
            Call::EventDestroy,
            Call::StreamWaitEvent,
        ],
    ),
];

/// The calls that create device memory.
pub const CREATING: &[Call] = &[Call::MemAlloc, Call::MemCreate];

/// What a replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The policy.
    pub policy: Policy,
    /// The allocator's figures at the end.
    pub stats: Stats,
    /// The most bytes live blocks were asked for at once (the trace's sizes, not rounded).
    pub peak_requested: u64,
    /// Allocations that failed with out-of-memory (their frees are skipped).
    pub ooms: u64,
    /// `(allocated, reserved)` after every operation.
    pub timeline: Vec<(u64, u64)>,
    /// The first out-of-memory message, if any.
    pub first_oom: Option<String>,
    /// The policy's driver calls by kind (those of creating the simulated device left out).
    pub calls: Vec<CallTally>,
    /// Where the reserved memory lay after the operation that left the most reserved (the
    /// first such): what fragmentation is made of.
    pub peak_layout: Layout,
}

impl Outcome {
    /// Fragmentation, one definition for every policy: the share of the reserved peak that the
    /// requested bytes never used, `1 - peak requested / peak reserved`.
    pub fn fragmentation(&self) -> f64 {
        if self.stats.peak_reserved_bytes == 0 {
            0.0
        } else {
            1.0 - self.peak_requested as f64 / self.stats.peak_reserved_bytes as f64
        }
    }

    /// Calls of the functions in `calls`.
    pub fn count(&self, calls: &[Call]) -> u64 {
        self.calls
            .iter()
            .filter(|t| t.call.is_some_and(|c| calls.contains(&c)))
            .map(|t| t.calls)
            .sum()
    }

    /// Driver calls that create device memory (`cuMemAlloc`, `cuMemCreate`).
    pub fn creating_calls(&self) -> u64 {
        self.count(CREATING)
    }

    /// The driver time the calls would take, by the simulator's cost model, in microseconds.
    pub fn driver_time_us(&self) -> f64 {
        self.calls.iter().map(ledger::estimate_us).sum()
    }
}

/// Replay `trace` under `policy` on a fresh simulated device of `device_memory` bytes (PyTorch's
/// policy with the allocator settings the trace recorded, if any).
/// `progress` is called with the number of operations done, every 4096 operations.
pub fn replay(
    trace: &Trace,
    policy: Policy,
    device_memory: u64,
    progress: impl FnMut(u64),
) -> Result<Outcome, String> {
    replay_logged(trace, policy, device_memory, How::default(), progress)
}

/// How [`replay_logged`] replays.
#[derive(Clone, Copy, Debug, Default)]
pub struct How {
    /// Every operation after which the policy reserves a different amount (memory created or
    /// returned) is written to standard error, after what a resmem pool logged of its
    /// decisions while serving it.
    pub log: bool,
    /// `Some`: the simulated driver maps only from an allocation's start, as the CUDA driver
    /// does, and resmem's handles are made of parts of this many bytes (`PageHandles`; 0: a
    /// page each), as on a GPU. `None`: it maps at offsets into an allocation.
    pub handle_part: Option<u64>,
}

/// [`replay`], as `how` says.
pub fn replay_logged(
    trace: &Trace,
    policy: Policy,
    device_memory: u64,
    how: How,
    mut progress: impl FnMut(u64),
) -> Result<Outcome, String> {
    let log = how.log;
    let sim = Arc::new(Sim::new(&[device_memory]));
    if how.handle_part.is_some() {
        sim.set_vmm(cuda_sim::VmmSetting::StartOnly);
    }
    // As resmem loads a driver (`runtime::build`).
    let driver = PageHandles::with_part(
        SimDriver::shared(Arc::clone(&sim)).map_err(|e| e.message)?,
        how.handle_part.unwrap_or(0),
    );
    let before = sim.driver_calls();
    // PyTorch's policy with the settings it ran with, where the snapshot recorded them.
    let torch = trace
        .torch_settings
        .as_ref()
        .map(|s| s.config)
        .unwrap_or_default();
    let alloc = policy.build_logged(Arc::new(driver), log, torch)?;
    let mut streams: HashMap<u64, u64> = HashMap::from([(0, 0)]);
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut outcome = Outcome {
        policy,
        stats: Stats::default(),
        peak_requested: 0,
        ooms: 0,
        timeline: Vec::with_capacity(trace.events.len()),
        first_oom: None,
        calls: Vec::new(),
        peak_layout: Layout::default(),
    };
    let (mut allocated, mut reserved, mut requested) = (0, 0, 0u64);
    for (n, event) in trace.events.iter().enumerate() {
        let fail = |e: resmem::Error| format!("operation {}: {}", n + 1, e.message);
        match event {
            Event::Alloc { id, size, stream } => {
                let handle = stream_handle(&sim, &mut streams, *stream)?;
                match alloc.reserve(0, *size, handle) {
                    Ok(ptr) => {
                        live.insert(*id, (ptr, *size));
                        requested += size;
                        outcome.peak_requested = outcome.peak_requested.max(requested);
                    }
                    Err(e) if e.status == rm_status::RM_ERROR_OUT_OF_MEMORY => {
                        outcome.ooms += 1;
                        outcome.first_oom.get_or_insert(e.message);
                    }
                    Err(e) => return Err(fail(e)),
                }
            }
            Event::Free { id } => {
                if let Some((ptr, size)) = live.remove(id) {
                    alloc.release(ptr).map_err(fail)?;
                    requested -= size;
                }
            }
            Event::RecordStream { id, stream } => {
                if let Some(&(ptr, _)) = live.get(id) {
                    let handle = stream_handle(&sim, &mut streams, *stream)?;
                    alloc.record_stream(ptr, handle).map_err(fail)?;
                }
            }
            Event::Warmup { bytes } => match alloc.warmup(0, *bytes) {
                Ok(_) => {}
                Err(e) if e.status == rm_status::RM_ERROR_OUT_OF_MEMORY => {
                    outcome.ooms += 1;
                    outcome.first_oom.get_or_insert(e.message);
                }
                Err(e) => return Err(fail(e)),
            },
            Event::EmptyCache => {
                alloc.free_reusable(Some(0)).map_err(fail)?;
            }
            Event::Mark { .. } | Event::Meta { .. } => {}
        }
        // Figures only change on allocator calls; a full stats read is cheap enough.
        if !matches!(event, Event::Mark { .. }) {
            let s = alloc.stats(0).map_err(fail)?;
            if log && s.reserved_bytes != reserved {
                eprintln!(
                    "{}: operation {}: {}: reserved {} -> {}",
                    policy.name(),
                    n + 1,
                    describe(event),
                    gib_or_mib(reserved),
                    gib_or_mib(s.reserved_bytes)
                );
            }
            if s.reserved_bytes > outcome.peak_layout.total() {
                outcome.peak_layout = alloc.layout(0).map_err(fail)?;
            }
            (allocated, reserved) = (s.allocated_bytes, s.reserved_bytes);
        }
        outcome.timeline.push((allocated, reserved));
        if n % 4096 == 4095 {
            progress(n as u64 + 1);
        }
    }
    progress(trace.events.len() as u64);
    outcome.stats = alloc.stats(0).map_err(|e| e.message)?;
    outcome.calls = sim
        .driver_calls()
        .into_iter()
        .zip(before)
        .map(|(after, before)| CallTally {
            calls: after.calls - before.calls,
            bytes_created: after.bytes_created - before.bytes_created,
            bytes_freed: after.bytes_freed - before.bytes_freed,
            ..after
        })
        .collect();
    Ok(outcome)
}

/// The simulator's stream for a trace's stream number, created on first use (0: the default).
fn stream_handle(sim: &Sim, streams: &mut HashMap<u64, u64>, stream: u64) -> Result<u64, String> {
    if let Some(&h) = streams.get(&stream) {
        return Ok(h);
    }
    let h = sim
        .stream_create(0)
        .map_err(|e| format!("creating stream {stream}: {}", e.name()))?;
    streams.insert(stream, h);
    Ok(h)
}

/// The granularity of [`min_device`]'s search.
pub const MIN_DEVICE_STEP: u64 = 32 << 20;

/// How far above the given device memory [`min_device`] looks for one that runs the trace.
pub const MIN_DEVICE_REACH: u64 = 16;

/// An operation as `--log` names it.
fn describe(event: &Event) -> String {
    match event {
        Event::Alloc { id, size, stream } => {
            format!("alloc {id} of {} on stream {stream}", gib_or_mib(*size))
        }
        Event::Free { id } => format!("free {id}"),
        Event::RecordStream { id, stream } => format!("record_stream {id} on stream {stream}"),
        Event::Warmup { bytes } => format!("warm-up for {}", gib_or_mib(*bytes)),
        Event::EmptyCache => "empty_cache".into(),
        Event::Mark { label } => format!("mark {label}"),
        Event::Meta { name, .. } => format!("meta {name}"),
    }
}

/// The smallest device, to [`MIN_DEVICE_STEP`], on which `trace` runs under `policy` with no
/// out-of-memory: by bisection below `memory` if it runs there, else below the first doubling
/// of `memory` that runs it; `None` if none up to [`MIN_DEVICE_REACH`] times `memory` does.
pub fn min_device(trace: &Trace, policy: Policy, memory: u64) -> Result<Option<u64>, String> {
    let runs = |steps: u64| -> Result<bool, String> {
        Ok(replay(trace, policy, steps * MIN_DEVICE_STEP, |_| {})?.ooms == 0)
    };
    // In steps of MIN_DEVICE_STEP: a device of `lo` steps fails (0 steps always does), one of
    // `hi` runs.
    let (mut lo, mut hi) = (0u64, memory.div_ceil(MIN_DEVICE_STEP).max(1));
    while !runs(hi)? {
        lo = hi;
        hi *= 2;
        if hi * MIN_DEVICE_STEP > memory.saturating_mul(MIN_DEVICE_REACH) {
            return Ok(None);
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if runs(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi * MIN_DEVICE_STEP))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn trace(events: Vec<Event>) -> Trace {
        Trace {
            events,
            ..Trace::default()
        }
    }

    #[test]
    fn figures_count_requested_bytes_and_driver_calls() {
        // 1000 bytes: PyTorch's policy takes a 2 MiB small-pool segment for them.
        let t = trace(vec![
            Event::Alloc {
                id: 1,
                size: 1000,
                stream: 0,
            },
            Event::Free { id: 1 },
            Event::EmptyCache,
        ]);
        let o = replay(&t, Policy::Torch, 64 * MIB, |_| {}).unwrap();
        assert_eq!(o.peak_requested, 1000);
        assert_eq!(o.stats.peak_reserved_bytes, 2 * MIB);
        assert_eq!(o.fragmentation(), 1.0 - 1000.0 / (2 * MIB) as f64);
        assert_eq!(
            (o.count(&[Call::MemAlloc]), o.count(&[Call::MemFree])),
            (1, 1)
        );
        assert_eq!(o.creating_calls(), 1);
        // One cuMemAlloc of 2 MiB (46 us and 149 us per GiB) and one cuMemFree (37 us and 580
        // us per GiB), and the device synchronisation of empty_cache (5 us).
        let expected = 46.0 + 149.0 * 2.0 / 1024.0 + 37.0 + 580.0 * 2.0 / 1024.0 + 5.0;
        assert!((o.driver_time_us() - expected).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn the_smallest_device_is_found_to_32_mib_above_and_below() {
        // 100 MiB in one block: PyTorch's policy needs a 100 MiB segment, so 128 MiB.
        let t = trace(vec![Event::Alloc {
            id: 1,
            size: 100 * MIB,
            stream: 0,
        }]);
        assert_eq!(
            min_device(&t, Policy::Torch, 1024 * MIB).unwrap(),
            Some(128 * MIB)
        );
        assert_eq!(
            min_device(&t, Policy::Torch, 40 * MIB).unwrap(),
            Some(128 * MIB)
        );
        assert_eq!(min_device(&t, Policy::Torch, 4 * MIB).unwrap(), None);
    }
}
