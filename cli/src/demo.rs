//! The seed scenario: consecutive loads of a bf16 model by a loader that plans with the free
//! memory the allocator reports (offloading to the CPU what does not fit), warms the allocator
//! up like transformers' `caching_allocator_warmup`, reserves every parameter, and drops the
//! model before the next load.

use crate::allocator::Allocator;

use crate::model::Shape;
use crate::units::gib_or_mib;

/// One load's figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// The free memory the allocator reported before the load (what the loader planned with).
    pub reported_free: u64,
    /// Reserved memory with the model loaded.
    pub reserved: u64,
    /// Allocated memory with the model loaded.
    pub allocated: u64,
    /// Bytes of parameters the loader left on the CPU.
    pub offloaded: u64,
}

/// `loads` loads of `shape` through `alloc` on device 0.
pub fn run(alloc: &dyn Allocator, shape: &Shape, loads: u32) -> Result<Vec<Load>, String> {
    let sizes: Vec<u64> = shape.parameters().iter().map(|p| p * 2).collect();
    let fail =
        |what: &str, e: resmem::Error| format!("{} policy, {what}: {}", alloc.name(), e.message);
    let mut rows = Vec::new();
    for _ in 0..loads {
        let (free, _) = alloc.mem_get_info(0).map_err(|e| fail("mem_get_info", e))?;
        // The loader's plan: parameters in order while they fit in the reported free memory.
        let mut on_device = 0u64;
        let mut placed = Vec::new();
        for &size in &sizes {
            if on_device + size <= free {
                on_device += size;
                placed.push(size);
            }
        }
        let offloaded = sizes.iter().sum::<u64>() - on_device;
        alloc.warmup(0, on_device).map_err(|e| fail("warm-up", e))?;
        let mut ptrs = Vec::with_capacity(placed.len());
        for size in placed {
            ptrs.push(alloc.reserve(0, size, 0).map_err(|e| fail("reserve", e))?);
        }
        let s = alloc.stats(0).map_err(|e| fail("stats", e))?;
        rows.push(Load {
            reported_free: free,
            reserved: s.reserved_bytes,
            allocated: s.allocated_bytes,
            offloaded,
        });
        for ptr in ptrs {
            alloc.release(ptr).map_err(|e| fail("release", e))?;
        }
    }
    Ok(rows)
}

/// The table of one policy's loads.
pub fn table(rows: &[Load]) -> String {
    let mut out = format!(
        "{:<6}{:>16}{:>14}{:>14}{:>14}\n",
        "load", "reported free", "reserved", "allocated", "offloaded"
    );
    for (i, r) in rows.iter().enumerate() {
        let offloaded = if r.offloaded == 0 {
            "no".to_string()
        } else {
            gib_or_mib(r.offloaded)
        };
        out.push_str(&format!(
            "{:<6}{:>16}{:>14}{:>14}{:>14}\n",
            i + 1,
            gib_or_mib(r.reported_free),
            gib_or_mib(r.reserved),
            gib_or_mib(r.allocated),
            offloaded
        ));
    }
    out
}
