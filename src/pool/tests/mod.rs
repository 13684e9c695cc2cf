//! The pool against simulated devices: each rule of the policy, the books after every step, and
//! the messages.
//!
//! Here are the helpers several files share; each file holds one topic:
//! - `placement`: PyTorch's policy (best fit, splitting, classes, parking, warm-up);
//! - `figures`: `mem_get_info`, peaks and the largest reusable block;
//! - `streams`: streams and events (`record_stream`, pending blocks, cross-stream reuse);
//! - `limits`: memory caps and out-of-memory;
//! - `pages`: page-granular reuse with the virtual-memory API (the `vmm_*` tests);
//! - `peers`: devices given access to each other's mapped memory;
//! - `fragments`: ranges that start in the free tail of a live block's page;
//! - `returning`: returning memory (`free_reusable`, `trim`, the sweep's batches);
//! - `pointers`: bad pointers and devices, and finding a pointer's device;
//! - `scale`: many blocks and many threads;
//! - `shards`: a device's shards by stream, which threads on different streams take apart.

use std::sync::Arc;

use cuda_sim::Sim;

use super::*;
use crate::driver::pages::PageHandles;
use crate::driver::sim::SimDriver;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

mod figures;
mod fragments;
mod limits;
mod pages;
mod peers;
mod placement;
mod pointers;
mod returning;
mod scale;
mod shards;
mod streams;

/// A pool over fresh simulated devices of these capacities, and the devices.
fn pool_with(capacities: &[u64], config: PoolConfig) -> (Pool, &'static Sim) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(capacities)));
    let driver = SimDriver::new(sim).expect("sim initialises");
    (Pool::new(Arc::new(driver), config), sim)
}

/// Classic segments (`cuMemAlloc`), as on devices without the virtual-memory API.
fn classic() -> PoolConfig {
    PoolConfig {
        vmm: false,
        ..PoolConfig::default()
    }
}

fn pool(capacity: u64) -> (Pool, &'static Sim) {
    pool_with(&[capacity], classic())
}

/// The books are consistent, and reserved equals what the driver holds for us.
fn assert_books(pool: &Pool, sim: &Sim) {
    pool.check().unwrap();
    for device in 0..pool.device_count() {
        let stats = pool.stats(device).unwrap();
        assert_eq!(
            stats.reserved_bytes,
            sim.used_bytes(device),
            "device {device}"
        );
        assert_eq!(
            stats.reusable_bytes,
            stats.reserved_bytes - stats.allocated_bytes
        );
    }
}

/// Device 0 holds no memory, no physical allocation and no address range.
fn assert_nothing_held(sim: &Sim) {
    assert_eq!(
        (
            sim.used_bytes(0),
            sim.physical_allocations(0),
            sim.reserved_ranges()
        ),
        (0, 0, 0)
    );
}

fn vmm() -> PoolConfig {
    PoolConfig {
        vmm: true,
        ..PoolConfig::default()
    }
}

/// Ten 8 MiB blocks from one 80 MiB segment, with every other pair released: 48 MiB free in
/// three 16 MiB holes between live blocks, and 20 MiB free on the driver.
fn fragmented(config: PoolConfig) -> (Pool, &'static Sim, Vec<u64>) {
    let (pool, sim) = pool_with(&[100 * MIB], config);
    pool.warmup(0, 80 * MIB).unwrap();
    let ptrs: Vec<u64> = (0..10)
        .map(|_| pool.reserve(0, 8 * MIB, 0).unwrap())
        .collect();
    for i in [0, 1, 4, 5, 8, 9] {
        pool.release(ptrs[i]).unwrap();
    }
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 80 * MIB);
    (pool, sim, ptrs)
}
