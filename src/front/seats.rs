//! The calling thread's cache found from its thread pointer (`tls::thread_key`), for the
//! exports' hit path: a register read and two loads, where the thread-local's lookup is a call
//! to `__tls_get_addr`, around which the caller saves its arguments on the stack.
//!
//! A table of buckets of two *seats*, indexed by a hash of the key. A thread takes a seat when
//! it binds to the front, and gives it up when it hands its cache back at exit; a thread whose
//! bucket is full goes through the thread-local, as every thread did before. Only the thread
//! whose key a seat holds writes it (a free seat is claimed with a compare-and-swap to a
//! placeholder no thread pointer equals, then filled), so a thread that finds its own key in a
//! seat reads the cache it put there itself.
//!
//! A thread pointer names one live thread; an exited thread's may be a later thread's. An exit
//! clears the thread's seat before its cache is retired (and may be adopted by another thread),
//! so a seat never names a cache another thread may use. The one exception is a thread that
//! binds again so late in its exit that no destructor runs after: its cache is never retired
//! (as without seats), and a later thread with the same pointer finds the seat and uses that
//! cache, which no other thread uses; when that thread binds, it takes the seat over.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::Relaxed, Ordering::Release};

use super::thread::ThreadCache;

/// Buckets in a table (a power of two).
const BUCKETS: usize = 1 << 11;
/// Seats per bucket.
const WAYS: usize = 2;
/// A claimed seat being filled: thread pointers are aligned, so never 1.
const CLAIMED: usize = 1;

#[repr(C, align(16))]
struct Seat {
    /// The thread's key; 0: free.
    key: AtomicUsize,
    cache: AtomicPtr<ThreadCache>,
}

/// The seats of one front.
pub struct Seats {
    /// A fixed number, so that a masked bucket indexes them with no bounds check.
    seats: Box<[[Seat; WAYS]; BUCKETS]>,
}

impl Default for Seats {
    fn default() -> Self {
        // Every seat free: key 0, no cache.
        Seats {
            seats: super::map::zeroed(),
        }
    }
}

/// The bucket of `key`: its bits above the alignment, mixed by a multiplication (thread
/// pointers of one process differ mostly in their high bits).
#[inline(always)]
fn bucket(key: usize) -> usize {
    let h = ((key as u64) >> 6).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> (64 - BUCKETS.trailing_zeros())) as usize & (BUCKETS - 1)
}

impl Seats {
    /// The seat holding `key`, the calling thread's own (see the module's documentation).
    #[inline(always)]
    fn own(&self, key: usize) -> Option<&Seat> {
        let bucket = &self.seats[bucket(key)];
        if bucket[0].key.load(Relaxed) == key {
            Some(&bucket[0])
        } else if bucket[1].key.load(Relaxed) == key {
            Some(&bucket[1])
        } else {
            None
        }
    }

    /// The cache seated for the thread of `key`, the caller's own.
    #[inline(always)]
    pub fn get(&self, key: usize) -> Option<&ThreadCache> {
        let seat = self.own(key)?;
        // SAFETY: the caller's own seat, filled by the caller with a cache of this front (see
        // `take`), which lives as long as the front.
        Some(unsafe { &*seat.cache.load(Relaxed) })
    }

    /// Seat `cache` for the calling thread, whose key is `key` (a seat holding `key` already is
    /// this thread's, left as it is if it names `cache`, or an exited thread's: it is filled
    /// again); `false` where the bucket is full.
    pub fn take(&self, key: usize, cache: &ThreadCache) -> bool {
        debug_assert!(key > CLAIMED);
        let cache = cache as *const ThreadCache as *mut ThreadCache;
        if let Some(own) = self.own(key) {
            // Written only if it changes: other threads read the bucket's line on every hit.
            if own.cache.load(Relaxed) != cache {
                own.cache.store(cache, Relaxed);
            }
            return true;
        }
        for seat in &self.seats[bucket(key)] {
            if seat
                .key
                .compare_exchange(0, CLAIMED, Relaxed, Relaxed)
                .is_ok()
            {
                seat.cache.store(cache, Relaxed);
                // Filled before the key names it. Only this thread reads the seat as its own
                // (see `get`), so program order alone would do; the others see a taken seat
                // from the claim on.
                seat.key.store(key, Release);
                return true;
            }
        }
        false
    }

    /// Free the calling thread's seat (its key is `key`), if it has one.
    pub fn leave(&self, key: usize) {
        if let Some(own) = self.own(key) {
            own.key.store(0, Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::thread::Registry;
    use super::*;

    #[test]
    fn a_thread_finds_the_cache_it_seated_until_it_leaves() {
        let registry = Registry::new(1);
        let (a, b, c) = (
            registry.claim().unwrap(),
            registry.claim().unwrap(),
            registry.claim().unwrap(),
        );
        let seats = Seats::default();
        // Three keys of one bucket: two seats, the third thread goes without.
        let k1 = 0x7f00_0000_0040usize;
        let mut same = (1usize..)
            .map(|i| k1 + i * 64)
            .filter(|&k| bucket(k) == bucket(k1));
        let (k2, k3) = (same.next().unwrap(), same.next().unwrap());
        assert!(seats.get(k1).is_none());
        assert!(seats.take(k1, a) && seats.take(k2, b));
        assert!(!seats.take(k3, c));
        assert!(std::ptr::eq(seats.get(k1).unwrap(), a));
        assert!(std::ptr::eq(seats.get(k2).unwrap(), b));
        assert!(seats.get(k3).is_none());
        // The same key seated again (a later thread with the same pointer) takes its seat over.
        assert!(seats.take(k1, c));
        assert!(std::ptr::eq(seats.get(k1).unwrap(), c));
        // Leaving frees the seat for the third key.
        seats.leave(k1);
        assert!(seats.get(k1).is_none());
        assert!(seats.take(k3, c));
        assert!(std::ptr::eq(seats.get(k3).unwrap(), c));
        assert!(std::ptr::eq(seats.get(k2).unwrap(), b));
    }

    #[test]
    fn thread_pointers_spread_over_the_buckets() {
        // Threads' pointers sit near the top of their stacks, 8 MiB and a guard page apart.
        let mut used = std::collections::HashSet::new();
        for i in 0..256usize {
            used.insert(bucket(0x7f3a_1c00_0000 + i * ((8 << 20) + 4096) - 0x6c0));
        }
        assert!(used.len() >= 240, "{} buckets for 256 threads", used.len());
    }

    #[test]
    fn the_calling_threads_key_is_its_own() {
        let here = crate::tls::thread_key();
        let there = std::thread::spawn(crate::tls::thread_key).join().unwrap();
        assert_ne!(here, 0);
        assert_ne!(here, there);
        assert_eq!(here, crate::tls::thread_key());
    }
}
