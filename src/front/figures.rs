//! The figures the front reports: [`Front::stats`] and [`Front::mem_get_info`], the pool's
//! figures with the blocks waiting in front caches counted as reusable.
//!
//! What the front caches change in them ([`Inner::cached`]) is summed when read, from the bins'
//! lengths and running counters each thread and each bin keeps for itself
//! ([`super::counters`]): they read without a side effect in O(live threads × bins), and are
//! exact whenever no call is in flight. The peak of allocated bytes counts cached blocks as
//! allocated while they are cached (the pool's peak); `reset_peak_stats` drains first, so the
//! peaks it sets are exact.

use super::counters::Delta;
use super::{Front, Inner};
use crate::error::Result;
use crate::pool::Stats;

impl Front {
    /// The figures of `device`, counting cached blocks as reusable (see the module's
    /// documentation for when they are exact).
    pub fn stats(&self, device: i32) -> Result<Stats> {
        let inner = &self.inner;
        let mut s = inner.pool.stats(device)?;
        let (d, largest) = inner.cached(device);
        s.allocated_bytes = s.allocated_bytes.wrapping_sub(d.cached_bytes as u64);
        s.live_blocks = s.live_blocks.wrapping_sub(d.cached_blocks as u64);
        s.requested_bytes = s.requested_bytes.wrapping_add(d.requested as u64);
        s.reserve_calls = s.reserve_calls.wrapping_add(d.hits as u64);
        s.cache_hits = s.cache_hits.wrapping_add(d.hits as u64);
        s.reusable_bytes = s.reserved_bytes.saturating_sub(s.allocated_bytes);
        s.largest_reusable_block = s.largest_reusable_block.max(largest);
        Ok(s)
    }

    /// `(free, total)` bytes of `device`, where free counts reusable memory, cached blocks
    /// included.
    pub fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        // One hold of the device's lock.
        let info = self.inner.pool.mem_get_info_capped(device)?;
        let (free, total) = (info.free, info.total);
        let cached = self.inner.sum(device).cached_bytes.max(0) as u64;
        let mut free = free.saturating_add(cached).min(total);
        if let Some((limit, allocated)) = info.cap {
            // The pool bounded free by what its limit leaves, counting cached blocks as
            // allocated; bound it by what the limit leaves to the user's blocks.
            free = free.min(limit.saturating_sub(allocated.saturating_sub(cached)));
        }
        Ok((free, total))
    }
}

impl Inner {
    /// What the front caches change in `device`'s figures, summed over every cache.
    pub(super) fn sum(&self, device: i32) -> Delta {
        self.cached(device).0
    }

    /// What the front caches change in `device`'s figures, summed over every cache (the
    /// shared counters, each live cache's own, and each of its bins on `device`; a retired
    /// cache holds none), and the largest block size a bin on `device` holds (remote lists not
    /// counted): one pass over the live caches' bins.
    fn cached(&self, device: i32) -> (Delta, u64) {
        let Some(shared) = usize::try_from(device)
            .ok()
            .and_then(|d| self.shared.get(d))
        else {
            return (Delta::default(), 0);
        };
        let (mut sum, mut largest) = (shared.read(), 0);
        for cache in self.threads.iter().filter(|cache| cache.is_alive()) {
            sum = sum.plus(cache.counters[device as usize].read());
            for bin in cache.bins.iter().filter(|bin| bin.on(device)) {
                sum = sum.plus(bin.figures());
                largest = largest.max(bin.holds());
            }
        }
        (sum, largest)
    }
}
