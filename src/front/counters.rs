//! Running counters of what the front caches change in the pool's figures, per device. The
//! common changes are kept by the bins themselves (`thread::Bin`): the blocks a bin holds are
//! its list's length, and it counts its own hits and requested bytes, so a hit or a release into
//! a bin writes nothing else. The rest is counted here: each thread cache keeps its own set,
//! written only by its thread (a load and a store, no atomic read-modify-write, no shared cache
//! line), for the blocks it pushed onto other threads' remote lists and the counts of its bins
//! when re-keyed; changes made outside a thread's own calls (drains, a thread's exit) go to one
//! shared set with atomic adds. A reader sums every set and every bin: the sum is exact whenever
//! no call is in flight, and within the changes of the calls in flight otherwise.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

/// A change, or a sum, of the figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Bytes in blocks held by front caches: live to the pool, reusable to the user.
    pub cached_bytes: i64,
    /// Blocks held by front caches.
    pub cached_blocks: i64,
    /// What to add to the pool's requested bytes: for each block the front knows, the bytes
    /// its caller asked for (0 while cached) less what the pool counts for it.
    pub requested: i64,
    /// Reserves served by a front cache (never seen by the pool): calls and cache hits.
    pub hits: i64,
}

impl Delta {
    /// `self` plus `other`.
    pub fn plus(self, other: Delta) -> Delta {
        Delta {
            cached_bytes: self.cached_bytes.wrapping_add(other.cached_bytes),
            cached_blocks: self.cached_blocks.wrapping_add(other.cached_blocks),
            requested: self.requested.wrapping_add(other.requested),
            hits: self.hits.wrapping_add(other.hits),
        }
    }
}

/// One set of counters, on a cache line of its own (another thread's set is written as often).
#[derive(Default)]
#[repr(align(64))]
pub struct Counters {
    cached_bytes: AtomicI64,
    cached_blocks: AtomicI64,
    requested: AtomicI64,
    hits: AtomicI64,
}

impl Counters {
    fn fields(&self) -> [&AtomicI64; 4] {
        [
            &self.cached_bytes,
            &self.cached_blocks,
            &self.requested,
            &self.hits,
        ]
    }

    /// Add `d` to a set only this thread writes: plain loads and stores.
    #[inline]
    pub fn add_owned(&self, d: Delta) {
        // Plain loads and stores, no branch: only the owner writes these.
        let add =
            |field: &AtomicI64, v: i64| field.store(field.load(Relaxed).wrapping_add(v), Relaxed);
        add(&self.cached_bytes, d.cached_bytes);
        add(&self.cached_blocks, d.cached_blocks);
        add(&self.requested, d.requested);
        add(&self.hits, d.hits);
    }

    pub fn add_shared(&self, d: Delta) {
        let values = [d.cached_bytes, d.cached_blocks, d.requested, d.hits];
        for (field, v) in self.fields().into_iter().zip(values) {
            if v != 0 {
                field.fetch_add(v, Relaxed);
            }
        }
    }

    /// The current values.
    pub fn read(&self) -> Delta {
        Delta {
            cached_bytes: self.cached_bytes.load(Relaxed),
            cached_blocks: self.cached_blocks.load(Relaxed),
            requested: self.requested.load(Relaxed),
            hits: self.hits.load(Relaxed),
        }
    }

    /// The current values, leaving zeros (for folding an exiting thread's set into the shared
    /// one; only the owner may call it).
    pub fn take(&self) -> Delta {
        let d = self.read();
        for field in self.fields() {
            field.store(0, Relaxed);
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_and_shared_adds_sum_exactly() {
        let (a, b) = (Counters::default(), Counters::default());
        let d = Delta {
            cached_bytes: 4096,
            cached_blocks: 2,
            requested: -100,
            hits: 1,
        };
        a.add_owned(d);
        a.add_owned(d);
        b.add_shared(Delta {
            cached_bytes: -4096,
            cached_blocks: -2,
            requested: 50,
            hits: 0,
        });
        let sum = a.read().plus(b.read());
        assert_eq!(
            sum,
            Delta {
                cached_bytes: 4096,
                cached_blocks: 2,
                requested: -150,
                hits: 2
            }
        );
        assert_eq!(a.take(), d.plus(d));
        assert_eq!(a.read(), Delta::default());
    }
}
