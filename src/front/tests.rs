//! The front cache over simulated devices: hits, the refusals, releases from other threads, a
//! thread's exit, drains, and the figures after each.

use std::sync::Arc;

use cuda_sim::Sim;

use super::*;
use crate::driver::sim::SimDriver;
use crate::error::rm_status;
use crate::pool::PoolConfig;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn front_with(capacities: &[u64]) -> (Front, &'static Sim) {
    front_gated(capacities, Gate::new())
}

fn front_gated(capacities: &[u64], gate: Gate) -> (Front, &'static Sim) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(capacities)));
    let driver = SimDriver::new(sim).expect("sim initialises");
    let pool = Pool::new(Arc::new(driver), PoolConfig::default());
    (Front::with_gate(pool, gate), sim)
}

fn front() -> (Front, &'static Sim) {
    front_with(&[24 * GIB])
}

/// Classic segments, whose placement is PyTorch's: a 4 MiB block starts a 20 MiB segment.
fn classic() -> PoolConfig {
    PoolConfig {
        vmm: false,
        ..PoolConfig::default()
    }
}

/// A pool on a fresh simulated 24 GiB device.
fn pool_over(config: PoolConfig) -> (Pool, &'static Sim) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[24 * GIB])));
    (
        Pool::new(Arc::new(SimDriver::new(sim).unwrap()), config),
        sim,
    )
}

/// A front over [`pool_over`]'s pool.
fn front_over(config: PoolConfig) -> (Front, &'static Sim) {
    let (pool, sim) = pool_over(config);
    (Front::new(pool), sim)
}

/// The figures a quiescent front reports: allocated, requested, live blocks, reserve calls,
/// cache hits; and the rest consistent with the driver.
fn figures(front: &Front, sim: &Sim, device: i32) -> (u64, u64, u64, u64, u64) {
    front.check().unwrap();
    let s = front.stats(device).unwrap();
    assert_eq!(s.reserved_bytes, sim.used_bytes(device));
    assert_eq!(s.reusable_bytes, s.reserved_bytes - s.allocated_bytes);
    (
        s.allocated_bytes,
        s.requested_bytes,
        s.live_blocks,
        s.reserve_calls,
        s.cache_hits,
    )
}

#[test]
fn a_release_then_a_reserve_of_the_same_size_is_a_hit_with_exact_figures() {
    let (front, sim) = front();
    let a = front.reserve(0, 1000, 0).unwrap();
    assert_eq!(figures(&front, sim, 0), (1024, 1000, 1, 1, 0));
    front.release(a).unwrap();
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 1, 0));
    // The pool still holds the block live; the front counts it reusable.
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 1);
    let s = front.stats(0).unwrap();
    // Small requests come from small segments: 1 MiB at most.
    assert_eq!((s.reusable_bytes, s.largest_reusable_block), (2 * MIB, MIB));
    let b = front.reserve(0, 900, 0).unwrap();
    assert_eq!(b, a);
    assert_eq!(figures(&front, sim, 0), (1024, 900, 1, 2, 1));
    // Reading the figures changed nothing.
    assert_eq!(figures(&front, sim, 0), (1024, 900, 1, 2, 1));
    front.release(b).unwrap();
    assert_eq!(front.free_reusable(None).unwrap(), 2 * MIB);
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 2, 1));
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn double_interior_and_unknown_releases_are_refused_and_change_nothing() {
    let (front, sim) = front();
    let a = front.reserve(0, 4 * MIB, 0).unwrap();
    let b = front.reserve(0, 512, 0).unwrap();
    front.release(a).unwrap();
    let before = (figures(&front, sim, 0), front.stats(0).unwrap());
    for bad in [a, a + 512, b + 512, 0x10, a + 3] {
        let err = front.release(bad).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER, "{bad:#x}");
    }
    let err = front.release(a).unwrap_err();
    assert!(err.message.contains("already released"), "{}", err.message);
    let err = front.record_stream(a, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    assert_eq!((figures(&front, sim, 0), front.stats(0).unwrap()), before);
    // The cached block is still handed out once, and the live one released once.
    assert_eq!(front.reserve(0, 4 * MIB, 0).unwrap(), a);
    front.release(b).unwrap();
    front.release(a).unwrap();
    assert_eq!(
        front.release(b).unwrap_err().status,
        rm_status::RM_ERROR_INVALID_POINTER
    );
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 3, 1));
}

#[test]
fn a_block_cached_on_one_stream_reaches_another_only_through_the_pool() {
    let (front, sim) = front();
    let s1 = sim.stream_create(0).unwrap();
    let s2 = sim.stream_create(0).unwrap();
    let a = front.reserve(0, 64 * MIB, s1).unwrap();
    front.release(a).unwrap();
    let pool_calls = front.pool().stats(0).unwrap().reserve_calls;
    let b = front.reserve(0, 64 * MIB, s2).unwrap();
    // Not a front hit: the pool served it (adopting the idle segment after s1's work, once the
    // cache gave it back), and no second segment was made.
    assert_eq!(front.pool().stats(0).unwrap().reserve_calls, pool_calls + 1);
    assert_eq!(b, a);
    assert_eq!(sim.used_bytes(0), 64 * MIB);
    assert_eq!(figures(&front, sim, 0), (64 * MIB, 64 * MIB, 1, 2, 1));
    // On its own stream it is a front hit.
    front.release(b).unwrap();
    assert_eq!(front.reserve(0, 64 * MIB, s2).unwrap(), b);
    assert_eq!(front.pool().stats(0).unwrap().reserve_calls, pool_calls + 1);
    front.release(b).unwrap();
}

#[test]
fn a_large_miss_gives_back_the_threads_large_blocks_of_its_stream_first() {
    // The same calls to a pool alone, for where it places the request.
    let (alone, alone_sim) = pool_over(classic());
    let (front, sim) = front_over(classic());
    let s1 = sim.stream_create(0).unwrap();
    assert_eq!(alone_sim.stream_create(0).unwrap(), s1);
    let calls = [(4 * MIB, 0), (1000, 0), (4 * MIB, s1)];
    let cached = calls.map(|(size, stream)| front.reserve(0, size, stream).unwrap());
    let freed = calls.map(|(size, stream)| alone.reserve(0, size, stream).unwrap());
    assert_eq!(cached, freed);
    for (p, q) in cached.into_iter().zip(freed) {
        front.release(p).unwrap();
        alone.release(q).unwrap();
    }
    assert_eq!(front.inner.sum(0).cached_blocks, 3);
    // 6 MiB on stream 0 misses the front. The 4 MiB block waiting there goes back to the pool
    // first and merges with the free rest of its segment, so the pool places the request as it
    // would with no front: where it was (were the block still waiting, the request would go
    // beside it, in the segment's free rest).
    let b = front.reserve(0, 6 * MIB, 0).unwrap();
    assert_eq!(b, alone.reserve(0, 6 * MIB, 0).unwrap());
    assert_eq!(b, cached[0]);
    assert_eq!(sim.used_bytes(0), alone_sim.used_bytes(0));
    // The small block (the other class) and stream s1's block stay cached: the pool could not
    // have placed the request among them.
    assert_eq!(front.inner.sum(0).cached_blocks, 2);
    let hits = front.stats(0).unwrap().cache_hits;
    assert_eq!(front.reserve(0, 1000, 0).unwrap(), cached[1]);
    assert_eq!(front.reserve(0, 4 * MIB, s1).unwrap(), cached[2]);
    assert_eq!(front.stats(0).unwrap().cache_hits, hits + 2);
    for p in [b, cached[1], cached[2]] {
        front.release(p).unwrap();
    }
    // Three hits: the two above and the pool's for 6 MiB.
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 6, 3));
}

#[test]
fn a_large_miss_gives_back_every_large_bin_of_its_stream_and_a_small_one_nothing() {
    let (front, sim) = front_over(classic());
    // Two sizes cached, one of them hit meanwhile: both go back at the next large miss, merge
    // with the rest of their segment, and 8 MiB goes at its start.
    let x = front.reserve(0, 4 * MIB, 0).unwrap();
    let y = front.reserve(0, 6 * MIB, 0).unwrap();
    front.release(x).unwrap();
    assert_eq!(front.reserve(0, 4 * MIB, 0).unwrap(), x);
    front.release(x).unwrap();
    front.release(y).unwrap();
    assert_eq!(front.inner.sum(0).cached_blocks, 2);
    let z = front.reserve(0, 8 * MIB, 0).unwrap();
    assert_eq!(z, x);
    assert_eq!(front.inner.sum(0).cached_blocks, 0);
    // A small miss gives nothing back: small requests have segments of their own.
    let s = front.reserve(0, 1000, 0).unwrap();
    front.release(s).unwrap();
    let t = front.reserve(0, 2000, 0).unwrap();
    assert_eq!(front.inner.sum(0).cached_blocks, 1);
    for p in [z, t] {
        front.release(p).unwrap();
    }
    // Four hits: the front's of 4 MiB, and the pool's of 6 and 8 MiB (in the segment 4 MiB
    // made) and 2000 bytes.
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 6, 4));
}

#[test]
fn blocks_released_by_another_thread_go_back_to_the_reserving_thread() {
    let (front, sim) = front();
    let front = Arc::new(front);
    let sizes = [512, 64 << 10, 4 * MIB, 64 * MIB];
    let ptrs: Vec<u64> = sizes
        .iter()
        .flat_map(|&size| (0..3).map(move |_| size))
        .map(|size| front.reserve(0, size, 0).unwrap())
        .collect();
    let reserved = sim.used_bytes(0);
    let other = Arc::clone(&front);
    let released = ptrs.clone();
    let first = ptrs[0];
    std::thread::spawn(move || {
        for ptr in released {
            other.release(ptr).unwrap();
        }
        // A second release from this thread is refused too.
        let err = other.release(first).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    })
    .join()
    .unwrap();
    // The pool served the first round (with its own hits within shared segments).
    let pool_hits = front.pool().stats(0).unwrap().cache_hits;
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 12, pool_hits));
    // The reserving thread gets them back from its remote list, without the pool.
    let pool_calls = front.pool().stats(0).unwrap().reserve_calls;
    let mut again: Vec<u64> = sizes
        .iter()
        .flat_map(|&size| (0..3).map(move |_| size))
        .map(|size| front.reserve(0, size, 0).unwrap())
        .collect();
    assert_eq!(front.pool().stats(0).unwrap().reserve_calls, pool_calls);
    let mut expected = ptrs.clone();
    again.sort_unstable();
    expected.sort_unstable();
    assert_eq!(again, expected);
    assert_eq!(sim.used_bytes(0), reserved);
    let total: u64 = sizes.iter().map(|s| 3 * s).sum();
    assert_eq!(
        figures(&front, sim, 0),
        (total, total, 12, 24, pool_hits + 12)
    );
    for ptr in again {
        front.release(ptr).unwrap();
    }
    front.free_reusable(None).unwrap();
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 24, pool_hits + 12));
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn a_thread_exiting_with_a_full_cache_hands_it_back() {
    let (front, sim) = front();
    let front = Arc::new(front);
    let worker = Arc::clone(&front);
    let cached = std::thread::spawn(move || {
        let mut held = 0;
        let mut ptrs = Vec::new();
        // More than a bin holds: the rest goes straight to the pool.
        for _ in 0..5 {
            ptrs.push(worker.reserve(0, 64 * MIB, 0).unwrap());
        }
        for _ in 0..100 {
            ptrs.push(worker.reserve(0, 64 << 10, 0).unwrap());
        }
        for ptr in ptrs {
            worker.release(ptr).unwrap();
        }
        let s = worker.stats(0).unwrap();
        held += worker.pool().stats(0).unwrap().live_blocks;
        assert_eq!((s.allocated_bytes, s.live_blocks), (0, 0));
        held
    })
    .join()
    .unwrap();
    // A bin holds 256 MiB: four 64 MiB blocks (the fifth went to the pool), and every 64 KiB
    // block in a bin of their own.
    assert_eq!(cached, 104);
    // After the exit the pool holds nothing live: the cache was handed back.
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 0);
    let pool_hits = front.pool().stats(0).unwrap().cache_hits;
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 105, pool_hits));
    let s = front.stats(0).unwrap();
    assert_eq!(s.reusable_bytes, s.reserved_bytes);
    assert_eq!(s.largest_reusable_block, 64 * MIB);
    front.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
    // The next thread adopts the retired cache.
    let worker = Arc::clone(&front);
    std::thread::spawn(move || {
        let a = worker.reserve(0, 512, 0).unwrap();
        worker.release(a).unwrap();
        assert_eq!(worker.reserve(0, 512, 0).unwrap(), a);
        worker.release(a).unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(front.inner.threads.iter().count(), 1);
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 107, pool_hits + 1));
}

#[test]
fn a_reserve_that_would_grow_takes_cached_memory_back_first() {
    let (front, sim) = front_with(&[200 * MIB]);
    let a = front.reserve(0, 64 * MIB, 0).unwrap();
    let b = front.reserve(0, 64 * MIB, 0).unwrap();
    let c = front.reserve(0, 64 * MIB, 0).unwrap();
    for p in [a, b, c] {
        front.release(p).unwrap();
    }
    assert_eq!(front.mem_get_info(0).unwrap(), (200 * MIB, 200 * MIB));
    // 150 MiB fits only once the cached blocks go back to the pool, which maps their pages
    // into one range (page-granular reuse): nothing new from the driver.
    let big = front.reserve(0, 150 * MIB, 0).unwrap();
    assert_eq!(sim.used_bytes(0), 192 * MIB);
    assert_eq!(figures(&front, sim, 0), (150 * MIB, 150 * MIB, 1, 4, 0));
    front.release(big).unwrap();
    // A cap drains too: nothing stays above it.
    front.set_memory_limit(Some(0), Some(64 * MIB)).unwrap();
    assert_eq!(sim.used_bytes(0), 64 * MIB);
    // A block waiting in the cache goes back too under a lower cap.
    let d = front.reserve(0, 64 * MIB, 0).unwrap();
    front.release(d).unwrap();
    assert_eq!(figures(&front, sim, 0).0, 0);
    front.set_memory_limit(Some(0), Some(32 * MIB)).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
    assert_eq!(front.memory_limit(0).unwrap(), Some(32 * MIB));
}

#[test]
fn a_block_used_on_another_stream_is_released_through_the_pool() {
    let (front, sim) = front();
    let s1 = sim.stream_create(0).unwrap();
    let s2 = sim.stream_create(0).unwrap();
    let a = front.reserve(0, 512, s1).unwrap();
    front.record_stream(a, s2).unwrap();
    sim.enqueue_work(0, s2).unwrap();
    front.release(a).unwrap();
    // The pool holds it pending s2's work, not the front.
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 0);
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 1, 0));
    assert_eq!(
        front.release(a).unwrap_err().status,
        rm_status::RM_ERROR_INVALID_POINTER
    );
    // Recorded on its own stream, it stays a front block.
    let b = front.reserve(0, 512, s1).unwrap();
    front.record_stream(b, s1).unwrap();
    front.release(b).unwrap();
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 1);
    sim.complete_work(0, s2).unwrap();
    front.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn many_threads_reserving_and_releasing_each_others_blocks_keep_exact_books() {
    many_threads_with_drains(Gate::new());
}

#[test]
fn many_threads_keep_exact_books_with_a_fenced_gate() {
    many_threads_with_drains(Gate::with_fences(true));
}

/// Four threads on two devices reserving, releasing their own blocks and each other's, one of
/// them draining every cache now and then while the others hit theirs.
fn many_threads_with_drains(gate: Gate) {
    let (front, sim) = front_gated(&[24 * GIB, 24 * GIB], gate);
    let front = Arc::new(front);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let front = Arc::clone(&front);
            let tx = tx.clone();
            let rx = Arc::clone(&rx);
            std::thread::spawn(move || {
                let stream = sim.stream_create((t % 2) as i32).unwrap();
                for i in 0..2000u64 {
                    let size = [512, 64 << 10, 4 * MIB][(i % 3) as usize] + t;
                    let p = front.reserve((t % 2) as i32, size, stream).unwrap();
                    if i % 2 == 0 {
                        tx.send(p).unwrap();
                    } else {
                        front.release(p).unwrap();
                    }
                    if let Ok(p) = rx.lock().unwrap().try_recv() {
                        front.release(p).unwrap();
                    }
                    if i % 500 == 0 {
                        front.stats(0).unwrap();
                    }
                    if t == 0 && i % 100 == 50 {
                        front.drain();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(tx);
    for p in rx.lock().unwrap().try_iter() {
        front.release(p).unwrap();
    }
    for device in 0..2 {
        let (allocated, requested, live, calls, _) = figures(&front, sim, device);
        assert_eq!((allocated, requested, live, calls), (0, 0, 0, 4000));
    }
    front.free_reusable(None).unwrap();
    assert_eq!((sim.used_bytes(0), sim.used_bytes(1)), (0, 0));
}

#[test]
fn a_dropped_front_gives_every_cached_block_back_to_the_driver() {
    let (front, sim) = front();
    let a = front.reserve(0, 512, 0).unwrap();
    let b = front.reserve(0, 64 * MIB, 0).unwrap();
    front.release(a).unwrap();
    front.release(b).unwrap();
    let kept = front.reserve(0, 1000, 0).unwrap();
    assert_eq!(front.inner.sum(0).cached_blocks, 2);
    assert!(sim.used_bytes(0) > 64 * MIB);
    drop(front);
    // One block stayed live (its small segment stays); all else went back.
    assert_eq!(sim.used_bytes(0), 2 * MIB);
    let _ = kept;
}

#[test]
fn a_dropped_front_leaves_the_threads_that_used_it_working() {
    let (first, _) = front();
    let a = first.reserve(0, 512, 0).unwrap();
    first.release(a).unwrap();
    drop(first);
    // This thread's binding to the dropped front is skipped, and a new front binds afresh.
    let (second, sim) = front();
    let b = second.reserve(0, 512, 0).unwrap();
    second.release(b).unwrap();
    assert_eq!(second.reserve(0, 512, 0).unwrap(), b);
    second.release(b).unwrap();
    assert_eq!(figures(&second, sim, 0), (0, 0, 0, 2, 1));
    // A thread whose front is gone by the time it exits.
    let (third, _) = front();
    let third = Arc::new(third);
    let user = Arc::clone(&third);
    let (tx, rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let p = user.reserve(0, 512, 0).unwrap();
        user.release(p).unwrap();
        drop(user);
        tx.send(()).unwrap();
        go_rx.recv().unwrap();
    });
    rx.recv().unwrap();
    drop(third);
    go_tx.send(()).unwrap();
    t.join().unwrap();
}

#[test]
fn a_thread_using_more_sizes_than_it_has_bins_keeps_the_newest_cached() {
    let (front, sim) = front();
    // 200 sizes, more than the bins, each released after reserving: every size ends cached
    // while it is among the newest, the oldest bins emptied into the pool to make room.
    let sizes: Vec<u64> = (1..=200).map(|k| k * 512).collect();
    for &size in &sizes {
        let p = front.reserve(0, size, 0).unwrap();
        front.release(p).unwrap();
    }
    let calls = front.pool().stats(0).unwrap().reserve_calls;
    let pool_hits = front.pool().stats(0).unwrap().cache_hits;
    // The newest size is a hit, served without the pool.
    let last = *sizes.last().unwrap();
    let p = front.reserve(0, last, 0).unwrap();
    assert_eq!(front.pool().stats(0).unwrap().reserve_calls, calls);
    front.release(p).unwrap();
    // Every block not in a bin went back to the pool: at most one block a bin is cached.
    let cached = front.pool().stats(0).unwrap().live_blocks;
    assert!((1..=thread::BINS as u64).contains(&cached), "{cached}");
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 201, pool_hits + 1));
    front.free_reusable(None).unwrap();
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 0);
    assert_eq!(sim.used_bytes(0), 0);
}

/// Two streams of device 0 whose keys for 512 bytes have the same home bin.
fn streams_sharing_a_home_bin(sim: &Sim) -> (StreamHandle, StreamHandle) {
    let s1 = sim.stream_create(0).unwrap();
    let home = thread::slot_of(0, s1, 512);
    let s2 = (0..10_000)
        .map(|_| sim.stream_create(0).unwrap())
        .find(|&s| thread::slot_of(0, s, 512) == home)
        .expect("one stream in 64 shares a home bin");
    (s1, s2)
}

#[test]
fn a_block_whose_bin_was_rekeyed_while_it_was_held_goes_back_to_a_bin_of_its_own_key() {
    let (front, sim) = front();
    let (s1, s2) = streams_sharing_a_home_bin(sim);
    let a = front.reserve(0, 512, s1).unwrap();
    front.release(a).unwrap();
    // A hit: the home bin is empty again, still keyed for s1, and a's entry names it.
    assert_eq!(front.reserve(0, 500, s1).unwrap(), a);
    // b's release re-keys the empty home bin for s2; a's entry names a bin no longer of its
    // key, so a goes to a new bin of s1's.
    let b = front.reserve(0, 512, s2).unwrap();
    assert_ne!(b, a);
    front.release(b).unwrap();
    front.release(a).unwrap();
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 3, 1));
    assert_eq!(
        front.release(a).unwrap_err().status,
        rm_status::RM_ERROR_INVALID_POINTER
    );
    // Each is a hit on its own stream only.
    let pool_calls = front.pool().stats(0).unwrap().reserve_calls;
    assert_eq!(front.reserve(0, 512, s2).unwrap(), b);
    assert_eq!(front.reserve(0, 512, s1).unwrap(), a);
    assert_eq!(front.pool().stats(0).unwrap().reserve_calls, pool_calls);
    assert_eq!(figures(&front, sim, 0), (1024, 1024, 2, 5, 3));
    // Back in the bins their entries now name, and the books exact once drained.
    front.release(a).unwrap();
    front.release(b).unwrap();
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 5, 3));
    front.free_reusable(None).unwrap();
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 5, 3));
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 0);
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn the_hit_paths_take_only_their_common_case_and_change_nothing_otherwise() {
    let (front, sim) = front();
    let (s1, s2) = streams_sharing_a_home_bin(sim);
    let hit = |size, stream| front.reserve_hit(0, size, stream);
    let released = |ptr| front.release_hit(ptr);
    // A thread not bound to the front yet (so with no seat), an unknown pointer: nothing.
    assert_eq!(hit(512, s1), None);
    assert!(!released(0x7000_0000_0000));
    let b = front.reserve(0, 512, s2).unwrap();
    let a = front.reserve(0, 512, s1).unwrap();
    // A block's first release keys a bin past the hit path (its entry names none yet); from
    // then on both hit paths take it.
    assert!(!released(a));
    front.release(a).unwrap();
    assert_eq!(figures(&front, sim, 0), (512, 512, 1, 2, 0));
    assert_eq!(hit(500, s1), Some(a));
    assert_eq!(figures(&front, sim, 0), (1024, 1012, 2, 3, 1));
    assert!(released(a));
    assert_eq!(figures(&front, sim, 0), (512, 512, 1, 3, 1));
    // A second release is not the hit path's: refused past it, nothing changed.
    assert!(!released(a));
    let err = tls::with(|t| front.release_known(t, a))
        .unwrap()
        .unwrap_err();
    assert!(err.message.contains("already released"), "{}", err.message);
    assert_eq!(figures(&front, sim, 0), (512, 512, 1, 3, 1));
    // s2's key, its home bin holding s1's block, takes another bin: found by the probe only.
    front.release(b).unwrap();
    assert_eq!(hit(512, s2), None);
    assert_eq!(tls::with(|t| front.reserve_probed(t, 0, 512, s2)), Some(b));
    assert_eq!(figures(&front, sim, 0), (512, 512, 1, 4, 2));
    assert!(released(b));
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 4, 2));
    // A full bin (four 64 MiB blocks: MAX_BIN_BYTES) takes no fifth on the hit path, even of
    // a block whose entry names it; past the hit path that one goes to the pool.
    let big: Vec<_> = (0..5)
        .map(|_| front.reserve(0, MAX_BLOCK, s1).unwrap())
        .collect();
    front.release(big[0]).unwrap();
    assert_eq!(hit(MAX_BLOCK, s1), Some(big[0]));
    for &p in &big[1..] {
        front.release(p).unwrap();
    }
    let live = front.pool().stats(0).unwrap().live_blocks;
    assert!(!released(big[0]));
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, live);
    assert!(tls::with(|t| front.release_known(t, big[0]))
        .unwrap()
        .is_ok());
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, live - 1);
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 10, 3));
    front.free_reusable(None).unwrap();
    assert_eq!(front.pool().stats(0).unwrap().live_blocks, 0);
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn a_thread_after_an_exited_one_finds_no_seat_until_it_binds() {
    let (front, sim) = front();
    let front = Arc::new(front);
    let stream = sim.stream_create(0).unwrap();
    let run = |front: Arc<Front>| {
        std::thread::spawn(move || {
            // Before binding, whatever the thread pointer (glibc reuses an exited thread's
            // stack, and with it the pointer): no seat, no hit.
            assert_eq!(front.reserve_hit(0, 512, stream), None);
            let p = front.reserve(0, 512, stream).unwrap();
            front.release(p).unwrap();
            assert_eq!(front.reserve_hit(0, 512, stream), Some(p));
            assert!(front.release_hit(p));
        })
        .join()
        .unwrap()
    };
    run(Arc::clone(&front));
    run(Arc::clone(&front));
    // Both exited: their blocks went back to the pool with their caches. Four reserves, three
    // hits: each thread's second, and the second thread's first, from the pool's cache.
    assert_eq!(figures(&front, sim, 0), (0, 0, 0, 4, 3));
    front.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn two_threads_releasing_one_block_at_once_release_it_once() {
    // The owner's release takes the hit path (its bin pushed with plain stores), the other
    // thread's goes past it: exactly one claims the block, the other is refused, every time.
    let (front, sim) = front();
    let front = Arc::new(front);
    let stream = sim.stream_create(0).unwrap();
    let (to_other, from_owner) = std::sync::mpsc::channel::<u64>();
    let (to_owner, from_other) = std::sync::mpsc::channel::<bool>();
    let start = Arc::new(std::sync::Barrier::new(2));
    let rounds = 2000;
    let other = {
        let (front, start) = (Arc::clone(&front), Arc::clone(&start));
        std::thread::spawn(move || {
            for p in from_owner {
                start.wait();
                to_owner.send(front.release(p).is_ok()).unwrap();
            }
        })
    };
    for _ in 0..rounds {
        // A hit from the second round on: the block is the owner's, cached in its bin.
        let p = front.reserve(0, 4096, stream).unwrap();
        to_other.send(p).unwrap();
        start.wait();
        let mine = front.release(p);
        let theirs = from_other.recv().unwrap();
        assert!(mine.is_ok() != theirs, "released twice or not at all");
        if let Err(e) = mine {
            assert_eq!(e.status, rm_status::RM_ERROR_INVALID_POINTER);
        }
    }
    drop(to_other);
    other.join().unwrap();
    // Each round's block went back once, to the owner's bin or the pool; nothing held.
    front.free_reusable(None).unwrap();
    assert_eq!(figures(&front, sim, 0).0, 0);
    assert_eq!(sim.used_bytes(0), 0);
}
