//! The pool's figures for one device, kept exact at every moment: byte counts and peaks are
//! updated with every change, event counters with every event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A device's figures; the Rust twin of `rm_stats`, field for field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes in live blocks: each request rounded up to a multiple of 512.
    pub allocated_bytes: u64,
    /// Bytes in live blocks as the callers asked for them.
    pub requested_bytes: u64,
    /// Bytes held from the driver (all segments).
    pub reserved_bytes: u64,
    /// `reserved_bytes - allocated_bytes`: memory the pool holds but nobody uses.
    pub reusable_bytes: u64,
    /// The largest single request the pool can serve without the driver.
    pub largest_reusable_block: u64,
    /// The most `allocated_bytes` has been since the last peak reset.
    pub peak_allocated_bytes: u64,
    /// The most `reserved_bytes` has been since the last peak reset.
    pub peak_reserved_bytes: u64,
    /// Blocks handed out and not yet released.
    pub live_blocks: u64,
    /// Segments held from the driver.
    pub segments: u64,
    /// Calls of `reserve` with a non-zero size.
    pub reserve_calls: u64,
    /// Those served from a free block the pool held, with no new segment (a segment mapped
    /// from cached pages, which allocates no memory, is not counted).
    pub cache_hits: u64,
    /// Successful driver allocations.
    pub driver_allocs: u64,
    /// Successful driver frees.
    pub driver_frees: u64,
    /// Times a driver out-of-memory made the pool return all reusable memory and retry.
    pub oom_retries: u64,
    /// Requests that failed with out-of-memory.
    pub ooms: u64,
}

impl Stats {
    /// Count a new live block.
    pub fn add_live(&mut self, size: u64, requested: u64) {
        self.allocated_bytes += size;
        self.requested_bytes += requested;
        self.live_blocks += 1;
        self.peak_allocated_bytes = self.peak_allocated_bytes.max(self.allocated_bytes);
    }

    /// Count a released block.
    pub fn remove_live(&mut self, size: u64, requested: u64) {
        self.allocated_bytes -= size;
        self.requested_bytes -= requested;
        self.live_blocks -= 1;
    }

    /// Count `bytes` newly held from the driver in `calls` allocations.
    pub fn add_reserved(&mut self, bytes: u64, calls: u64) {
        self.reserved_bytes += bytes;
        self.driver_allocs += calls;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
    }

    /// Count `bytes` given back to the driver in `calls` frees.
    pub fn remove_reserved(&mut self, bytes: u64, calls: u64) {
        self.reserved_bytes -= bytes;
        self.driver_frees += calls;
    }

    /// Bytes held but not in live blocks.
    pub fn reusable(&self) -> u64 {
        self.reserved_bytes - self.allocated_bytes
    }

    /// Add another shard's figures of the same device: every count summed, the largest
    /// reusable block the larger. A peak summed is at least the peak of the sum (the device's
    /// reserved peak is kept whole by `WholeDevice`).
    pub fn add(&mut self, other: &Stats) {
        self.allocated_bytes += other.allocated_bytes;
        self.requested_bytes += other.requested_bytes;
        self.reserved_bytes += other.reserved_bytes;
        self.reusable_bytes += other.reusable_bytes;
        self.largest_reusable_block = self
            .largest_reusable_block
            .max(other.largest_reusable_block);
        self.peak_allocated_bytes += other.peak_allocated_bytes;
        self.peak_reserved_bytes += other.peak_reserved_bytes;
        self.live_blocks += other.live_blocks;
        self.segments += other.segments;
        self.reserve_calls += other.reserve_calls;
        self.cache_hits += other.cache_hits;
        self.driver_allocs += other.driver_allocs;
        self.driver_frees += other.driver_frees;
        self.oom_retries += other.oom_retries;
        self.ooms += other.ooms;
    }

    /// Set the peaks to the current values.
    pub fn reset_peaks(&mut self) {
        self.peak_allocated_bytes = self.allocated_bytes;
        self.peak_reserved_bytes = self.reserved_bytes;
    }
}

/// What a device's shards share: what it reserves, all its shards together, and the most it has
/// reserved since the last peak reset; its cap; its claim lock. Each shard adds and subtracts its own changes where it books them (under its own
/// lock, at each driver allocation and free: never on a cache hit), so that the peak is the
/// device's, where the sum of the shards' peaks counts shards that peaked at different times
/// together (a stream's shard grown while another's had given its memory back).
///
/// It also holds the device's cap and its *claim lock*: a shard checks the cap and claims room
/// for new memory under the lock (`DevicePool::claim`), publishing what it then commits before
/// letting go, so that two shards never claim the same room; the cap is set under the same lock
/// ([`WholeDevice::set_limit`]), so that every claim after it counts against the new value
/// (a cap kept by each shard, set one shard at a time, let a shard not reached yet claim under
/// the old value after another had refused a request under the new one).
#[derive(Debug)]
#[repr(align(128))] // on lines of its own: its reserved figures are written at every growth
pub(crate) struct WholeDevice {
    now: AtomicU64,
    peak: AtomicU64,
    /// The cap in bytes; `NO_LIMIT` where there is none.
    limit: AtomicU64,
    claims: Mutex<()>,
    /// The other devices given access to the device's mapped memory, a bit each (device `d`:
    /// bit `d`; see `pool/peers.rs`).
    peers: AtomicU64,
}

/// [`WholeDevice`]'s `limit` where no cap is set.
const NO_LIMIT: u64 = u64::MAX;

impl Default for WholeDevice {
    fn default() -> WholeDevice {
        WholeDevice {
            now: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            limit: AtomicU64::new(NO_LIMIT),
            claims: Mutex::new(()),
            peers: AtomicU64::new(0),
        }
    }
}

impl WholeDevice {
    /// A shard now reserves `bytes` more.
    pub(crate) fn add(&self, bytes: u64) {
        let now = self.now.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
    }

    /// A shard now reserves `bytes` less.
    pub(crate) fn remove(&self, bytes: u64) {
        self.now.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// What the device reserves now.
    pub(crate) fn now(&self) -> u64 {
        self.now.load(Ordering::Acquire)
    }

    /// The most the device has reserved since the last reset.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// The claim lock, held while a shard checks the cap and claims room (see the type).
    pub(crate) fn claiming(&self) -> MutexGuard<'_, ()> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device's cap, if any.
    pub(crate) fn limit(&self) -> Option<u64> {
        let limit = self.limit.load(Ordering::Acquire);
        (limit != NO_LIMIT).then_some(limit)
    }

    /// Set the device's cap (`None`: no cap), under the claim lock: a claim made after this
    /// returns counts against the new value. A cap of `u64::MAX` bytes is no cap.
    pub(crate) fn set_limit(&self, limit: Option<u64>) {
        let _claiming = self.claiming();
        self.limit
            .store(limit.unwrap_or(NO_LIMIT), Ordering::Release);
    }

    /// The devices given access to the device's mapped memory, a bit each.
    pub(crate) fn peers(&self) -> u64 {
        self.peers.load(Ordering::SeqCst)
    }

    /// Give `peers` (bits) access to the device's mapped memory from now on: whether any was
    /// new. Ranges mapped before need access set too (`Pool::introduce`).
    pub(crate) fn add_peers(&self, peers: u64) -> bool {
        self.peers.fetch_or(peers, Ordering::SeqCst) & peers != peers
    }

    /// Set the peak to what the device reserves now (and never below it: a shard that grew
    /// meanwhile is counted).
    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.now(), Ordering::Release);
        self.peak.fetch_max(self.now(), Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_follow_and_reset() {
        let mut s = Stats::default();
        s.add_reserved(4 << 20, 1);
        s.add_live(3 << 20, 3_000_000);
        s.remove_live(3 << 20, 3_000_000);
        assert_eq!(
            (s.allocated_bytes, s.requested_bytes, s.live_blocks),
            (0, 0, 0)
        );
        assert_eq!(s.peak_allocated_bytes, 3 << 20);
        assert_eq!(s.reusable(), 4 << 20);
        s.remove_reserved(4 << 20, 1);
        assert_eq!(s.peak_reserved_bytes, 4 << 20);
        assert_eq!((s.driver_allocs, s.driver_frees), (1, 1));
        s.reset_peaks();
        assert_eq!((s.peak_allocated_bytes, s.peak_reserved_bytes), (0, 0));
    }

    #[test]
    fn shards_add_up() {
        let mut a = Stats::default();
        a.add_reserved(20 << 20, 1);
        a.add_live(4 << 20, 4_000_000);
        a.largest_reusable_block = 16 << 20;
        let mut b = Stats::default();
        b.add_reserved(2 << 20, 1);
        b.add_live(512, 100);
        b.largest_reusable_block = 2 << 20;
        b.ooms = 1;
        let mut sum = a;
        sum.add(&b);
        assert_eq!(sum.allocated_bytes, (4 << 20) + 512);
        assert_eq!(sum.requested_bytes, 4_000_100);
        assert_eq!(sum.reserved_bytes, 22 << 20);
        assert_eq!(
            (sum.peak_allocated_bytes, sum.peak_reserved_bytes),
            ((4 << 20) + 512, 22 << 20)
        );
        assert_eq!((sum.live_blocks, sum.driver_allocs, sum.ooms), (2, 2, 1));
        assert_eq!(sum.largest_reusable_block, 16 << 20);
    }
}
