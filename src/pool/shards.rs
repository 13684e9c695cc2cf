//! A device's books in shards by stream, so that threads working on different streams do not
//! wait on one lock.
//!
//! Each device has [`SHARDS`] shards, each a whole [`DevicePool`] behind its own mutex: its own
//! segments, blocks, bins and physical handles. A stream is served by one shard, found through
//! the device's [`Binding`]: a stream's hash picks one of [`BUCKETS`] buckets, and the bucket
//! names its shard. Every bucket starts on shard 0, so a program whose calls never contend
//! (every single-threaded one, every replay) has one shard per device and exactly the policy of
//! one pool. A reserve that finds its shard's lock taken by another thread waits for it; then,
//! if its stream owns no segment in that shard (it leaves no memory behind), it moves the
//! stream's bucket, once, to a shard of its own: from then on the two streams' misses take
//! different locks and touch different memory. A stream that already owns memory stays where
//! its cache is. Two threads on one stream (or on streams sharing a bucket) keep sharing a
//! shard.
//!
//! A shard's memory serves only its own streams; across shards memory goes back through the
//! driver: a reserve that runs out of memory in its shard returns the other shards' idle cache
//! and tries once more (`Pool::reserve`), as PyTorch's policy returns every stream's cache
//! before it fails. A cap and a warm-up count the whole device: each shard publishes what it
//! reserves (and has claimed for memory being created) and what of that is reusable at the end
//! of every hold, and the others count that against the cap (one per device, kept with the
//! claim lock)
//! ([`Context::reserved_elsewhere`](super::Context::reserved_elsewhere)) or as reusable already
//! ([`Context::reusable_elsewhere`](super::Context::reusable_elsewhere)). Room for new memory is
//! claimed under the device's claim lock, and the claim published at once
//! ([`Context::publish_committed`](super::Context::publish_committed)): read as of the end of
//! the other's hold alone, two shards growing at once could both take the same room (one
//! making a segment under its lock while the other, not yet counting it, made its own).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

use super::device::DevicePool;
use crate::driver::StreamHandle;

/// Shards per device: streams whose misses may run at once without waiting on each other.
/// Sixteen, so that a host's worker threads, each on a stream of its own, each miss on a lock
/// of their own: with four, 8 threads on 8 streams of an H200 host took 4,902 ns a pair of
/// 128 MiB blocks against 190 with 4 threads, streams meeting on each lock (on a 2-CPU machine,
/// 4 threads' wall time a pair: a median of 422 ns with four, 218 with sixteen, the bound of two
/// CPUs taking turns; BENCHMARKS.md). A shard no stream moved to costs its empty books alone
/// (1,280 bytes), and streams move only where their calls meet.
pub const SHARDS: usize = 16;

/// Buckets per device that streams hash into; a bucket moves to another shard as a whole, so
/// two streams in one bucket always share a shard. 1,024, so that few do: 8 streams share a
/// bucket with a probability of 2.7% (37% among 64).
const BUCKETS: usize = 1024;

/// One shard: a device pool behind its own lock, on cache lines of its own (two shards' locks
/// on one line would make their threads wait on each other's writes).
#[repr(align(128))]
pub(crate) struct Shard {
    pub(crate) books: Mutex<DevicePool>,
    /// Threads blocked on `books` (see `Pool::let_waiters_in`).
    pub(crate) waiting: AtomicU32,
    /// What this shard reserves and has claimed for memory being created, as of the end of its
    /// last hold or, under a cap, its last claim.
    pub(crate) committed: AtomicU64,
    /// What it reserves and no live block holds, as of the end of its last hold.
    pub(crate) reusable: AtomicU64,
}

impl Shard {
    pub(crate) fn new(pool: DevicePool) -> Shard {
        Shard {
            books: Mutex::new(pool),
            waiting: AtomicU32::new(0),
            committed: AtomicU64::new(0),
            reusable: AtomicU64::new(0),
        }
    }
}

/// A shard's books while its lock is held; what they commit is published when it is let go.
pub(crate) struct Books<'a> {
    guard: MutexGuard<'a, DevicePool>,
    shard: &'a Shard,
}

impl<'a> Books<'a> {
    pub(crate) fn new(guard: MutexGuard<'a, DevicePool>, shard: &'a Shard) -> Books<'a> {
        Books { guard, shard }
    }
}

impl Deref for Books<'_> {
    type Target = DevicePool;
    fn deref(&self) -> &DevicePool {
        &self.guard
    }
}

impl DerefMut for Books<'_> {
    fn deref_mut(&mut self) -> &mut DevicePool {
        &mut self.guard
    }
}

impl Drop for Books<'_> {
    fn drop(&mut self) {
        // Read by the device's other shards, under their own locks: for a cap, and for a
        // warm-up (which counts the device's reusable memory).
        let (committed, reusable) = self.guard.published();
        if self.shard.committed.load(Ordering::Relaxed) != committed {
            self.shard.committed.store(committed, Ordering::Relaxed);
        }
        if self.shard.reusable.load(Ordering::Relaxed) != reusable {
            self.shard.reusable.store(reusable, Ordering::Relaxed);
        }
    }
}

/// Which shard of a device serves each stream, and whether the device was introduced to its
/// peers (`pool/peers.rs`): what every reserve on the device reads, on lines of its own.
#[repr(align(128))]
pub(crate) struct Binding {
    buckets: [AtomicU8; BUCKETS],
    /// Shards in use: shard 0, and those streams moved to (at most [`SHARDS`]).
    opened: AtomicU8,
    /// Set as the device's introduction begins: what another device's introduction reads.
    pub(crate) introducing: AtomicBool,
    /// Completed once the device's introduction is over: a reserve returns no block before.
    pub(crate) introduced: Once,
}

impl Default for Binding {
    fn default() -> Self {
        Binding {
            buckets: std::array::from_fn(|_| AtomicU8::new(0)),
            opened: AtomicU8::new(1),
            introducing: AtomicBool::new(false),
            introduced: Once::new(),
        }
    }
}

/// The bucket of `stream`: the top bits of a multiplicative hash (stream handles are pointers,
/// whose low bits say little).
fn bucket(stream: StreamHandle) -> usize {
    (stream.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - BUCKETS.trailing_zeros())) as usize
}

impl Binding {
    /// The shard (of the device's [`SHARDS`]) that serves `stream` now.
    #[inline]
    pub(crate) fn shard(&self, stream: StreamHandle) -> usize {
        self.buckets[bucket(stream)].load(Ordering::Acquire) as usize
    }

    /// How many of the device's shards may hold memory: those below this count.
    #[inline]
    pub(crate) fn opened(&self) -> usize {
        self.opened.load(Ordering::Acquire) as usize
    }

    /// `stream`, served by shard `from`, found that shard's lock taken: the shard it moves to,
    /// or `None` where it stays. A stream moves once, off shard 0, to the next shard not yet
    /// opened (once all are, to one picked by its bucket). Where another thread moved the
    /// stream's bucket meanwhile, the shard it moved it to.
    pub(crate) fn move_contended(&self, stream: StreamHandle, from: usize) -> Option<usize> {
        if from != 0 {
            return None;
        }
        let b = bucket(stream);
        // Moved by another thread meanwhile (which held the shard's lock before this one): no
        // shard is opened for nothing.
        let now = self.buckets[b].load(Ordering::Acquire);
        if now != 0 {
            return Some(usize::from(now));
        }
        let next = self
            .opened
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (usize::from(n) < SHARDS).then_some(n + 1)
            });
        let to = match next {
            Ok(n) => n,
            Err(_) => (1 + b % (SHARDS - 1)) as u8,
        };
        match self.buckets[b].compare_exchange(0, to, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Some(usize::from(to)),
            Err(now) => Some(usize::from(now)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_start_on_shard_zero_and_move_once() {
        let b = Binding::default();
        let (s1, s2) = (0x7f00_0000_1000u64, 0x7f00_0000_2000u64);
        assert_ne!(bucket(s1), bucket(s2), "the test needs two buckets");
        assert_eq!((b.shard(s1), b.shard(s2), b.opened()), (0, 0, 1));
        assert_eq!(b.move_contended(s1, 0), Some(1));
        assert_eq!((b.shard(s1), b.shard(s2), b.opened()), (1, 0, 2));
        // Off shard 0, it stays; asked again from shard 0 (a thread that waited there while
        // another moved it), it finds where it went, and opens no shard.
        assert_eq!(b.move_contended(s1, 1), None);
        assert_eq!(b.move_contended(s1, 0), Some(1));
        assert_eq!(b.opened(), 2);
        assert_eq!(b.move_contended(s2, 0), Some(2));
        assert_eq!((b.shard(s1), b.shard(s2), b.opened()), (1, 2, 3));
    }

    #[test]
    fn once_every_shard_is_open_streams_spread_over_them() {
        let b = Binding::default();
        let mut seen = [0usize; SHARDS];
        for i in 0..200u64 {
            let stream = 0x5000 + i * 0x40;
            if b.shard(stream) == 0 {
                if let Some(to) = b.move_contended(stream, 0) {
                    assert!((1..SHARDS).contains(&to));
                    seen[to] += 1;
                }
            }
        }
        assert_eq!(b.opened(), SHARDS);
        assert!(seen[1..].iter().all(|&n| n > 0), "{seen:?}");
    }

    #[test]
    fn fifteen_streams_made_one_after_another_each_take_a_shard_of_their_own() {
        // Stream handles are the driver's heap pointers, a fixed stride apart when made one
        // after another: each stride tried puts fifteen streams in fifteen buckets, so that
        // each moves to a shard no other stream of the device uses.
        for stride in [0x10, 0x40, 0x60, 0x100, 0x1000, 0x10000] {
            let b = Binding::default();
            for i in 0..SHARDS as u64 - 1 {
                let stream = 0x5600_1234_5000 + i * stride;
                assert_eq!(
                    b.move_contended(stream, 0),
                    Some(i as usize + 1),
                    "{stride:#x}"
                );
            }
            assert_eq!(b.opened(), SHARDS);
        }
    }

    #[test]
    fn a_shard_is_on_lines_of_its_own() {
        assert_eq!(std::mem::align_of::<Shard>(), 128);
        assert_eq!(std::mem::size_of::<Shard>() % 128, 0);
    }
}
