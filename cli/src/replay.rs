//! A trace driven through an allocation policy on a fresh simulated device, and the figures
//! that compare policies: peaks, fragmentation, driver calls, out-of-memory events.

use std::collections::HashMap;
use std::sync::Arc;

use cuda_sim::Sim;
use resmem::baseline::{TorchAllocator, TorchConfig};
use resmem::driver::sim::SimDriver;
use resmem::error::rm_status;
use resmem::{Allocator, Pool, PoolConfig, Stats};

use crate::trace::{Event, Trace};
use crate::units::gib_or_mib;

/// An allocation policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// resmem's pool.
    Resmem,
    /// resmem's pool stitching segments with the virtual-memory API (`vmm:true`).
    ResmemVmm,
    /// PyTorch's caching allocator.
    Torch,
}

impl Policy {
    /// The policy's name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Resmem => "resmem",
            Policy::ResmemVmm => "resmem-vmm",
            Policy::Torch => "torch",
        }
    }

    /// An allocator of this policy over `driver`.
    pub fn build(self, driver: Arc<dyn resmem::Driver>) -> Box<dyn Allocator> {
        match self {
            Policy::Resmem => Box::new(Pool::new(driver, PoolConfig::default())),
            Policy::ResmemVmm => Box::new(Pool::new(
                driver,
                PoolConfig {
                    vmm: true,
                    ..PoolConfig::default()
                },
            )),
            Policy::Torch => Box::new(
                TorchAllocator::new(driver, TorchConfig::default())
                    .expect("the default configuration is valid"),
            ),
        }
    }
}

/// What a replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The policy.
    pub policy: Policy,
    /// The allocator's figures at the end.
    pub stats: Stats,
    /// Allocations that failed with out-of-memory (their frees are skipped).
    pub ooms: u64,
    /// `(allocated, reserved)` after every operation.
    pub timeline: Vec<(u64, u64)>,
    /// The first out-of-memory message, if any.
    pub first_oom: Option<String>,
}

impl Outcome {
    /// GMLake's fragmentation: `1 - peak allocated / peak reserved`.
    pub fn fragmentation(&self) -> f64 {
        if self.stats.peak_reserved_bytes == 0 {
            0.0
        } else {
            1.0 - self.stats.peak_allocated_bytes as f64 / self.stats.peak_reserved_bytes as f64
        }
    }
}

/// Replay `trace` under `policy` on a fresh simulated device of `device_memory` bytes.
/// `progress` is called with the number of operations done, every 4096 operations.
pub fn replay(
    trace: &Trace,
    policy: Policy,
    device_memory: u64,
    mut progress: impl FnMut(u64),
) -> Result<Outcome, String> {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[device_memory])));
    let driver = SimDriver::new(sim).map_err(|e| e.message)?;
    let alloc = policy.build(Arc::new(driver));
    let mut streams: HashMap<u64, u64> = HashMap::from([(0, 0)]);
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut outcome = Outcome {
        policy,
        stats: Stats::default(),
        ooms: 0,
        timeline: Vec::with_capacity(trace.events.len()),
        first_oom: None,
    };
    let (mut allocated, mut reserved) = (0, 0);
    for (n, event) in trace.events.iter().enumerate() {
        let fail = |e: resmem::Error| format!("operation {}: {}", n + 1, e.message);
        match event {
            Event::Alloc { id, size, stream } => {
                let handle = stream_handle(sim, &mut streams, *stream)?;
                match alloc.reserve(0, *size, handle) {
                    Ok(ptr) => {
                        live.insert(*id, ptr);
                    }
                    Err(e) if e.status == rm_status::RM_ERROR_OUT_OF_MEMORY => {
                        outcome.ooms += 1;
                        outcome.first_oom.get_or_insert(e.message);
                    }
                    Err(e) => return Err(fail(e)),
                }
            }
            Event::Free { id } => {
                if let Some(ptr) = live.remove(id) {
                    alloc.release(ptr).map_err(fail)?;
                }
            }
            Event::RecordStream { id, stream } => {
                if let Some(&ptr) = live.get(id) {
                    let handle = stream_handle(sim, &mut streams, *stream)?;
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
            (allocated, reserved) = (s.allocated_bytes, s.reserved_bytes);
        }
        outcome.timeline.push((allocated, reserved));
        if n % 4096 == 4095 {
            progress(n as u64 + 1);
        }
    }
    progress(trace.events.len() as u64);
    outcome.stats = alloc.stats(0).map_err(|e| e.message)?;
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

/// The side-by-side table of several outcomes.
pub fn table(trace: &Trace, outcomes: &[Outcome]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = vec![
        ("peak allocated".into(), vec![]),
        ("peak reserved".into(), vec![]),
        ("fragmentation".into(), vec![]),
        ("driver allocations".into(), vec![]),
        ("driver frees".into(), vec![]),
        ("out-of-memory events".into(), vec![]),
    ];
    for o in outcomes {
        let s = &o.stats;
        let cells = [
            gib_or_mib(s.peak_allocated_bytes),
            gib_or_mib(s.peak_reserved_bytes),
            format!("{:.2} %", 100.0 * o.fragmentation()),
            s.driver_allocs.to_string(),
            s.driver_frees.to_string(),
            o.ooms.to_string(),
        ];
        for (row, cell) in rows.iter_mut().zip(cells) {
            row.1.push(cell);
        }
    }
    let mut out = format!("{:<28}", "");
    for o in outcomes {
        out.push_str(&format!("{:>14}", o.policy.name()));
    }
    out.push('\n');
    for (label, cells) in rows {
        out.push_str(&format!("{label:<28}"));
        for c in cells {
            out.push_str(&format!("{c:>14}"));
        }
        out.push('\n');
    }
    if let Some(peak) = trace.torch_peak_reserved {
        out.push_str(&format!(
            "PyTorch itself recorded a peak reserved of {}",
            gib_or_mib(peak)
        ));
        if let Some(t) = outcomes.iter().find(|o| o.policy == Policy::Torch) {
            let ratio = t.stats.peak_reserved_bytes as f64 / peak.max(1) as f64;
            out.push_str(&format!(" (the torch policy replayed: {ratio:.4} x that)"));
        }
        out.push('\n');
        if trace.unmatched_frees > 0 {
            out.push_str(&format!(
                "{} frees of blocks allocated before recording began were skipped\n",
                trace.unmatched_frees
            ));
        }
    }
    out
}
