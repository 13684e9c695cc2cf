//! Giving blocks back to the pool: one block ([`Inner::evict`]), a block also used on other
//! streams ([`Inner::release_shared`]), every cache or one (drains: each list taken whole with
//! an exchange), and a thread's exit ([`Inner::hand_back`]).

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;

use super::counters::Delta;
use super::entries::{Entry, NIL, USER};
use super::thread::ThreadCache;
use super::Inner;
use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Result;

/// Where a block given back to the pool was, for the figures: a bin's blocks are counted by
/// the bin's length (gone with the list taken), a remote list's by counters.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Was {
    /// Held by the user (just claimed from a release).
    Held,
    /// In a bin, whose list was taken whole.
    InBin,
    /// In a remote list.
    InRemote,
}

impl Inner {
    /// Forget entry `index` (its block at `ptr` is claimed by the caller, and was where `was`
    /// says) and give the block to the pool.
    pub(super) fn evict(&self, index: u32, ptr: DevicePtr, was: Was) {
        let e = self.entries.get(index);
        let device = e.device.load(Relaxed);
        let (size, pool_requested) = (e.size.load(Relaxed), e.pool_requested.load(Relaxed));
        let mut d = Delta {
            requested: pool_requested as i64,
            ..Delta::default()
        };
        match was {
            Was::Held => d.requested -= e.requested.load(Relaxed) as i64,
            Was::InBin => {}
            Was::InRemote => {
                d.cached_bytes = -(size as i64);
                d.cached_blocks = -1;
            }
        }
        self.forget(index, ptr);
        self.shared[device as usize].add_shared(d);
        // The pool holds the block live: its release cannot be refused.
        let _ = self.pool.release(ptr);
    }

    /// Drop entry `index` for the block at `ptr` from the map and the arena.
    pub(super) fn forget(&self, index: u32, ptr: DevicePtr) {
        self.map.clear(ptr);
        self.entries.get(index).word.store(0, Release);
        self.entries.put(index);
    }

    /// Release a block also used on other streams through the pool, which records their work.
    /// On failure the block stays held by the caller, as the pool leaves it.
    #[cold]
    pub(super) fn release_shared(self: &Arc<Self>, index: u32, ptr: DevicePtr) -> Result<()> {
        let e = self.entries.get(index);
        let fields = (
            e.owner.load(Relaxed),
            e.device.load(Relaxed),
            e.stream.load(Relaxed),
            e.size.load(Relaxed),
            e.pool_requested.load(Relaxed),
            e.requested.load(Relaxed),
        );
        let (owner, device, stream, size, pool_requested, requested) = fields;
        self.forget(index, ptr);
        match self.pool.release(ptr) {
            Ok(()) => {
                self.shared[device as usize].add_shared(Delta {
                    requested: pool_requested as i64 - requested as i64,
                    ..Delta::default()
                });
                Ok(())
            }
            Err(err) => {
                match self.entries.take() {
                    Some(index) => {
                        let e = self.entries.get(index);
                        e.fill(owner, device, stream, size, requested);
                        e.pool_requested.store(pool_requested, Relaxed);
                        e.shared.store(true, Relaxed);
                        e.word.store(Entry::word_of(ptr, USER), Release);
                        self.map.set(ptr, index);
                    }
                    None => self.shared[device as usize].add_shared(Delta {
                        requested: pool_requested as i64 - requested as i64,
                        ..Delta::default()
                    }),
                }
                Err(err)
            }
        }
    }

    /// Give the blocks of every cache, live threads' and exited ones', back to the pool: each
    /// list taken with one exchange, the bins' while their owners are out of the gate (see
    /// `gate.rs`), then given back with the owners free to go on.
    pub(super) fn drain(&self) {
        let mut lists = Vec::new();
        self.gate.exclusive(
            || self.threads.iter().map(|cache| &cache.busy.flag),
            |owners_out| {
                for cache in self.threads.iter() {
                    if owners_out {
                        lists.extend(cache.bins.iter().map(|bin| (bin.take(), Was::InBin)));
                    }
                    lists.push((cache.remote.swap(NIL, Acquire), Was::InRemote));
                }
            },
        );
        for (list, was) in lists {
            self.evict_list(list, was);
        }
    }

    /// Give back the large blocks `cache` (the caller's own) holds for `stream` on `device`:
    /// before a large reserve on that stream goes to the pool, so that the pool places it among
    /// the free blocks it would have with no front, merged with their neighbours (see
    /// `Inner::miss`). Owner only; no gate and no barrier: only the owner pushes to its bins,
    /// and a drain racing with it takes each list with an exchange as this does.
    pub(super) fn give_back_large(&self, cache: &ThreadCache, device: i32, stream: StreamHandle) {
        for bin in cache.large_bins() {
            if bin.holds_large_for(device, stream) {
                self.evict_list(bin.take(), Was::InBin);
            }
        }
    }

    /// Give the blocks of one cache back to the pool (its owner, or with its owner gone): each
    /// list taken with one exchange.
    pub(super) fn drain_cache(&self, cache: &ThreadCache) {
        for bin in cache.bins.iter() {
            self.evict_list(bin.take(), Was::InBin);
        }
        self.evict_list(cache.remote.swap(NIL, Acquire), Was::InRemote);
    }

    /// Give every block of a list taken whole (from where `was` says) back to the pool.
    pub(super) fn evict_list(&self, mut index: u32, was: Was) {
        while index != NIL {
            let e = self.entries.get(index);
            let next = e.next.load(Relaxed);
            self.evict(index, e.ptr(), was);
            index = next;
        }
    }

    /// The exit of the thread using cache `index`: its blocks go back to the pool, its figures
    /// (its counters and its bins' counts) to the shared set, and the cache to the next thread
    /// that needs one.
    pub(super) fn hand_back(&self, index: u32) {
        let Some(cache) = self.threads.get(index) else {
            return;
        };
        // Unseated before the cache can be retired and adopted by another thread, which may
        // have this thread's pointer (see `seats.rs`).
        self.seats.leave(crate::tls::thread_key());
        self.drain_cache(cache);
        for (own, shared) in cache.counters.iter().zip(self.shared.iter()) {
            shared.add_shared(own.take());
        }
        for bin in cache.bins.iter() {
            if let Some(shared) = usize::try_from(bin.device())
                .ok()
                .and_then(|d| self.shared.get(d))
            {
                shared.add_shared(bin.take_counts());
            }
        }
        cache.retire();
    }
}
