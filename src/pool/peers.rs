//! Which devices are peers of which: each device that serves requests gives access to its
//! mapped memory to every other such device that can use it (`cuDeviceCanAccessPeer`).
//!
//! A program that uses two devices of one process (a model split across them, activations
//! copied between them) reads one device's memory from the other: a kernel on one device, or a
//! copy engine, uses the other's memory directly once peer access is on. `cuMemAlloc` memory
//! allows that once the program enables peer access; memory mapped with the virtual-memory API
//! only for the devices its mapping names (`device/peers.rs`). PyTorch's allocator gives its
//! expandable segments to a peer when PyTorch enables peer access, but a pluggable allocator is
//! never told, and a C program need not say. So resmem gives access to every device that serves
//! requests in the process, as soon as it does (its first reserve), and only to those: in a
//! process per device (the usual multi-GPU training or serving), the other devices never serve
//! a request of this process and no mapping names them. The first reserve on a device
//! introduces it: it becomes a peer of each device that already served one (those ranges,
//! mapped before, are given access under their shards' locks), and they of it. Devices past the
//! 64th are never peers.

use std::sync::atomic::Ordering;

use super::Pool;
use crate::error::Result;

impl Pool {
    /// `done`, once device `d` is introduced to its peers (where it succeeded: the first
    /// request the device serves; a request on the device meanwhile waits for it to end). A
    /// flag read for the requests after it.
    #[inline]
    pub(super) fn introduced<T>(&self, d: usize, done: Result<T>) -> Result<T> {
        let binding = &self.bindings[d];
        if done.is_ok() && !binding.introduced.is_completed() {
            // Forced: an introduction that panicked (a driver that did) is made again.
            binding.introduced.call_once_force(|_| self.introduce(d));
        }
        done
    }

    /// Make device `d` and every device whose introduction began peers of each other, where
    /// the driver says they can be, and give the ranges mapped so far their new peers. Two
    /// devices introduced at once by two threads each see the other (the flags are
    /// sequentially consistent), so that each pair is met at least once; meeting it twice
    /// changes nothing.
    #[cold]
    fn introduce(&self, d: usize) {
        self.bindings[d].introducing.store(true, Ordering::SeqCst);
        let e = d as i32;
        let can = |from: i32, to: i32| self.driver.can_access_peer(from, to).unwrap_or(false);
        let mut mine = 0u64;
        for other in (0..self.bindings.len()).filter(|&o| o != d && o < 64) {
            if !self.bindings[other].introducing.load(Ordering::SeqCst) {
                continue;
            }
            let o = other as i32;
            if d < 64 && can(e, o) && self.reserved[other].add_peers(1 << d) {
                self.grant_peers(other);
            }
            if can(o, e) {
                mine |= 1 << other;
            }
        }
        if mine != 0 && self.reserved[d].add_peers(mine) {
            self.grant_peers(d);
        }
    }

    /// Give every range of device `d` mapped so far the device's peers, shard by shard, each
    /// under its lock (one at a time).
    fn grant_peers(&self, d: usize) {
        for index in self.opened_shards(d) {
            let (mut pool, cx) = self.lock_shard(index);
            pool.grant_peers(&cx);
        }
    }
}
