//! `resmem demo`: the seed scenario ([`crate::seed`]) under each policy. Before each load the
//! loader asks the allocator for free memory, as accelerate does (keeping room for the largest
//! layer, it places parameters in order while they fit and leaves the rest on the CPU), then the
//! allocator gets exactly the calls PyTorch's allocator would get: the warm-up's `torch.empty`,
//! the parameters, `generate()`, the model's deletion. No policy gets `rm_warmup`.

use std::collections::HashMap;

use resmem::Stats;

use crate::allocator::Allocator;
use crate::model::Shape;
use crate::seed::{parameter_bytes, Calls};
use crate::trace::Event;
use crate::units::gib_or_mib;

/// One load's figures, after the model was deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// The free memory the allocator reported before the load (what the loader planned with).
    pub reported_free: u64,
    /// Reserved memory.
    pub reserved: u64,
    /// Allocated memory (what outlived `generate()`).
    pub allocated: u64,
    /// Bytes of parameters the loader left on the CPU.
    pub offloaded: u64,
}

/// A policy's run of the demo.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// Each load's figures.
    pub loads: Vec<Load>,
    /// `(allocated, reserved)` after every call.
    pub timeline: Vec<(u64, u64)>,
    /// The allocator's figures at the end.
    pub stats: Stats,
}

impl Run {
    /// The loads that left parameters on the CPU, numbered from 1.
    pub fn offloaded_loads(&self) -> Vec<usize> {
        (1..=self.loads.len())
            .filter(|&i| self.loads[i - 1].offloaded > 0)
            .collect()
    }
}

/// How many parameters (in order) the loader puts on the device when `free` bytes are
/// reported: accelerate keeps room for the largest layer on a device it may offload from, and
/// fills the rest in order.
pub fn plan(sizes: &[u64], free: u64) -> usize {
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let budget = free.saturating_sub(largest);
    let mut on_device = 0u64;
    sizes
        .iter()
        .take_while(|&&size| {
            on_device += size;
            on_device <= budget
        })
        .count()
}

/// `loads` loads of `shape`, each with `generate()` and the model deleted, through `alloc` on
/// device 0.
pub fn run(alloc: &dyn Allocator, shape: &Shape, loads: u32) -> Result<Run, String> {
    let fail =
        |what: &str, e: resmem::Error| format!("{} policy, {what}: {}", alloc.name(), e.message);
    let sizes = parameter_bytes(shape);
    let total: u64 = sizes.iter().sum();
    let mut calls = Calls::default();
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut run = Run {
        loads: Vec::new(),
        timeline: Vec::new(),
        stats: Stats::default(),
    };
    for load in 1..=loads {
        let (free, _) = alloc.mem_get_info(0).map_err(|e| fail("mem_get_info", e))?;
        let placed = plan(&sizes, free);
        let from = calls.events.len();
        calls.load(shape, load, placed);
        for event in &calls.events[from..] {
            match *event {
                Event::Alloc { id, size, .. } => {
                    let ptr = alloc.reserve(0, size, 0).map_err(|e| fail("reserve", e))?;
                    live.insert(id, ptr);
                }
                Event::Free { id } => {
                    let ptr = live.remove(&id).expect("the calls free only live blocks");
                    alloc.release(ptr).map_err(|e| fail("release", e))?;
                }
                _ => continue,
            }
            let s = alloc.stats(0).map_err(|e| fail("stats", e))?;
            run.timeline.push((s.allocated_bytes, s.reserved_bytes));
        }
        let s = alloc.stats(0).map_err(|e| fail("stats", e))?;
        run.loads.push(Load {
            reported_free: free,
            reserved: s.reserved_bytes,
            allocated: s.allocated_bytes,
            offloaded: total - sizes.iter().take(placed).sum::<u64>(),
        });
    }
    run.stats = alloc.stats(0).map_err(|e| fail("stats", e))?;
    Ok(run)
}

/// The policies' loads side by side: `(title, run)` each.
pub fn table(runs: &[(&str, &Run)]) -> String {
    const CELL: usize = 38;
    let mut out = format!("{:<6}", "");
    for (title, _) in runs {
        out.push_str(&format!("| {title:<w$}", w = CELL - 2));
    }
    out.push('\n');
    out.push_str(&format!("{:<6}", "load"));
    for _ in runs {
        out.push_str(&format!(
            "| {:>10} {:>10} {:>13} ",
            "free seen", "reserved", "offloaded"
        ));
    }
    out.push('\n');
    let loads = runs.iter().map(|(_, r)| r.loads.len()).max().unwrap_or(0);
    for i in 0..loads {
        out.push_str(&format!("{:<6}", i + 1));
        for (_, run) in runs {
            let cells = match run.loads.get(i) {
                Some(l) => (
                    short(l.reported_free),
                    short(l.reserved),
                    if l.offloaded == 0 {
                        "no".to_string()
                    } else {
                        format!("{} CPU", short(l.offloaded))
                    },
                ),
                None => Default::default(),
            };
            out.push_str(&format!(
                "| {:>10} {:>10} {:>13} ",
                cells.0, cells.1, cells.2
            ));
        }
        out.push('\n');
    }
    out
}

/// What the demo does, for its first lines.
pub fn intro(shape: &Shape, loads: u32, place: &str) -> String {
    let sizes = parameter_bytes(shape);
    let model: u64 = sizes.iter().sum();
    let warmup = crate::seed::warmup_bytes(shape, sizes.len());
    let mut out = format!(
        "{loads} loads of {} ({} in bf16, {} tensors) on {place}, as transformers before PR \
         #37920 makes them:\n",
        shape.name,
        gib_or_mib(model),
        sizes.len()
    );
    let survivor = crate::seed::SURVIVOR as f64 / f64::from(1u32 << 20);
    out.push_str(&format!(
        "  warm-up: one torch.empty of {}{}, freed at once; the parameters; generate(), after \
         which one {survivor} MiB block stays live; del model.\n",
        gib_or_mib(warmup),
        if warmup > model {
            " (the tied lm_head counted twice)"
        } else {
            ""
        },
    ));
    out.push_str(
        "  Before each load the loader asks for free memory and offloads what does not fit \
         (keeping room for the largest layer).\n",
    );
    out
}

/// A run as a replay's outcome, for the plot.
pub fn outcome(policy: crate::replay::Policy, run: &Run) -> crate::replay::Outcome {
    crate::replay::Outcome {
        policy,
        stats: run.stats,
        peak_requested: 0,
        ooms: 0,
        timeline: run.timeline.clone(),
        first_oom: None,
        calls: Vec::new(),
        peak_layout: Default::default(),
    }
}

/// One run's closing line: its peak against one warm-up, and its offloads.
pub fn summary(title: &str, run: &Run, one_warmup: u64) -> String {
    let peak = run.stats.peak_reserved_bytes;
    let offloads = run.offloaded_loads();
    let offload = if offloads.is_empty() {
        "nothing offloaded".to_string()
    } else {
        let list: Vec<String> = offloads.iter().map(|i| i.to_string()).collect();
        format!(
            "parameters offloaded to the CPU at load {}",
            list.join(", ")
        )
    };
    format!(
        "{title}: peak reserved {} ({:.3} x one warm-up), {} driver allocations, {offload}",
        gib_or_mib(peak),
        peak as f64 / one_warmup.max(1) as f64,
        run.stats.driver_allocs
    )
}

/// GiB with two decimals, as the seed prints them.
fn short(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loader_keeps_room_for_the_largest_layer() {
        let sizes = [40, 10, 30, 20];
        assert_eq!(plan(&sizes, 140), 4);
        assert_eq!(plan(&sizes, 139), 3);
        assert_eq!(plan(&sizes, 80), 1);
        assert_eq!(plan(&sizes, 79), 0);
        assert_eq!(plan(&[], 79), 0);
    }
}
