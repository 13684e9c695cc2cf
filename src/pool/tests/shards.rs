//! Shards by stream (`shards.rs`): a stream whose shard is locked by another thread moves to a
//! shard of its own, and the device's figures, cap and memory stay one device's.

use std::sync::mpsc;
use std::time::Duration;

use super::*;

const S1: StreamHandle = 0x7f00_0000_1000;
const S2: StreamHandle = 0x7f00_0000_2000;

/// Reserve `size` bytes on `stream` of `device` from another thread while this one holds the
/// device's first shard, let go once the reserve waits for it. Returns the pointer.
fn reserve_against_held_shard(
    pool: &Pool,
    device: i32,
    size: u64,
    stream: StreamHandle,
) -> DevicePtr {
    let held = pool.lock(device).unwrap();
    std::thread::scope(|s| {
        let other = s.spawn(|| pool.reserve(device, size, stream));
        while pool.shards[device as usize * SHARDS]
            .waiting
            .load(Ordering::Relaxed)
            == 0
        {
            std::thread::yield_now();
        }
        drop(held);
        other.join().unwrap().unwrap()
    })
}

/// The same where the reserve must not wait for the held shard (it would never end).
fn reserve_beside_held_shard(pool: &Pool, size: u64, stream: StreamHandle) -> DevicePtr {
    let held = pool.lock(0).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| tx.send(pool.reserve(0, size, stream)).unwrap());
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a reserve on a stream of another shard waited for the held one");
        drop(held);
        got.unwrap()
    })
}

/// `stream`, owning nothing yet, moved to shard 1 by a reserve that met shard 0 held.
fn move_to_own_shard(pool: &Pool, stream: StreamHandle) -> DevicePtr {
    let p = reserve_against_held_shard(pool, 0, 2 * MIB, stream);
    assert_eq!(pool.bindings[0].shard(stream), 1);
    p
}

#[test]
fn a_stream_that_owns_memory_stays_with_it() {
    let (pool, sim) = pool(GIB);
    let a = pool.reserve(0, 100 * MIB, S1).unwrap();
    let b = reserve_against_held_shard(&pool, 0, 100 * MIB, S1);
    assert_eq!(
        (pool.bindings[0].shard(S1), pool.bindings[0].opened()),
        (0, 1)
    );
    pool.release(a).unwrap();
    pool.release(b).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn a_stream_whose_shard_is_held_moves_to_its_own_and_the_books_stay_one_devices() {
    for config in [classic(), PoolConfig::default()] {
        let (pool, sim) = pool_with(&[4 * GIB], config);
        let a = pool.reserve(0, 100 * MIB, S1).unwrap();
        assert_eq!(pool.bindings[0].opened(), 1, "no contention, one shard");
        let b = reserve_against_held_shard(&pool, 0, 30 * MIB, S2);
        assert_eq!(pool.bindings[0].opened(), 2);
        assert_eq!(pool.bindings[0].shard(S2), 1);
        assert_eq!(pool.bindings[0].shard(S1), 0, "the other stream stays");
        // Each shard holds its own stream's block; the device's figures are their sums.
        let s = pool.stats(0).unwrap();
        assert_eq!(s.allocated_bytes, 130 * MIB);
        assert_eq!(s.live_blocks, 2);
        assert_eq!(s.segments, 2);
        assert_eq!(s.reserved_bytes, sim.used_bytes(0));
        assert_books(&pool, sim);
        // S2's next request is served by its shard from its cache, with shard 0 held.
        pool.release(b).unwrap();
        let b2 = reserve_beside_held_shard(&pool, 30 * MIB, S2);
        assert_eq!(b2, b);
        assert_eq!(pool.stats(0).unwrap().cache_hits, 1);
        // Released from this thread, each block finds its shard.
        pool.release(a).unwrap();
        pool.release(b2).unwrap();
        let err = pool.release(b2).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
        assert!(err.message.contains("already released"), "{}", err.message);
        let err = pool.release(a + 512).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
        assert_books(&pool, sim);
        let (free, total) = pool.mem_get_info(0).unwrap();
        assert_eq!(
            (free, total),
            (4 * GIB, 4 * GIB),
            "both shards' cache is free"
        );
        assert_eq!(pool.layout(0).unwrap().cached(), sim.used_bytes(0));
        // Everything goes back, from both shards.
        assert_eq!(pool.free_reusable(Some(0)).unwrap(), s.reserved_bytes);
        assert_nothing_held(sim);
        assert_books(&pool, sim);
    }
}

#[test]
fn once_every_shard_is_open_a_moving_stream_shares_one_and_each_stream_keeps_its_cache() {
    for config in [classic(), PoolConfig::default()] {
        let (pool, sim) = pool_with(&[4 * GIB], config);
        let stream = |i: u64| 0x7f00_0001_0000 + i * 0x1000;
        // Stream 0 stays on shard 0 with memory of its own; fifteen more, contending, open the
        // other fifteen shards, one each.
        let mut live = vec![pool.reserve(0, 30 * MIB, stream(0)).unwrap()];
        for i in 1..SHARDS as u64 {
            live.push(reserve_against_held_shard(&pool, 0, 30 * MIB, stream(i)));
            assert_eq!(pool.bindings[0].shard(stream(i)), i as usize);
        }
        assert_eq!(pool.bindings[0].opened(), SHARDS);
        // One more moves to a shard picked by its bucket, which another stream already uses.
        let late = stream(SHARDS as u64);
        live.push(reserve_against_held_shard(&pool, 0, 30 * MIB, late));
        let shard = pool.bindings[0].shard(late);
        assert!((1..SHARDS).contains(&shard), "{shard}");
        assert_eq!(pool.bindings[0].opened(), SHARDS);
        let s = pool.stats(0).unwrap();
        assert_eq!(s.allocated_bytes, (SHARDS as u64 + 1) * 30 * MIB);
        assert_eq!(s.segments, SHARDS as u64 + 1);
        assert_books(&pool, sim);
        // In the shared shard each stream's cache serves it alone: released, the late stream's
        // block comes back to it, and the other stream's request is served beside it.
        let mine = live.pop().unwrap();
        pool.release(mine).unwrap();
        assert_eq!(pool.reserve(0, 30 * MIB, late).unwrap(), mine);
        let other = pool.reserve(0, 30 * MIB, stream(shard as u64)).unwrap();
        assert_ne!(other, mine);
        live.extend([mine, other]);
        assert_books(&pool, sim);
        for p in live {
            pool.release(p).unwrap();
        }
        let (free, total) = pool.mem_get_info(0).unwrap();
        assert_eq!(free, total, "every shard's cache is free");
        pool.free_reusable(Some(0)).unwrap();
        assert_nothing_held(sim);
        assert_books(&pool, sim);
    }
}

#[test]
fn out_of_memory_in_a_shard_takes_the_other_shards_idle_cache() {
    for config in [classic(), PoolConfig::default()] {
        let (pool, sim) = pool_with(&[GIB], config);
        // Shard 0 caches 700 MiB of S1's.
        let a = pool.reserve(0, 700 * MIB, S1).unwrap();
        pool.release(a).unwrap();
        // S2 moves to shard 1, which has no cache; 700 MiB more do not fit beside shard 0's.
        let b = move_to_own_shard(&pool, S2);
        let c = pool.reserve(0, 700 * MIB, S2).unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!(s.ooms, 0, "the request did not fail");
        assert!(s.oom_retries >= 1);
        assert_eq!(s.allocated_bytes, 702 * MIB);
        assert!(s.reserved_bytes <= GIB);
        assert_books(&pool, sim);
        // Where no shard has idle cache left, it fails, counted once.
        let err = pool.reserve(0, 700 * MIB, S1).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
        assert_eq!(pool.stats(0).unwrap().ooms, 1);
        pool.release(b).unwrap();
        pool.release(c).unwrap();
        pool.free_reusable(None).unwrap();
        assert_nothing_held(sim);
        assert_books(&pool, sim);
    }
}

#[test]
fn a_cap_counts_every_shard_of_the_device() {
    let (pool, sim) = pool_with(&[4 * GIB], classic());
    let a = pool.reserve(0, 600 * MIB, S1).unwrap();
    let b = move_to_own_shard(&pool, S2);
    assert_eq!(pool.set_memory_limit(Some(0), Some(GIB)).unwrap(), 0);
    // Shard 1 may grow by what shard 0 leaves under the cap, no more.
    let err = pool.reserve(0, 500 * MIB, S2).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    // The message gives the device's figures, both shards' (`b`'s 20 MiB segment holds 2).
    assert!(
        err.message.contains("memory limit of 1.00 GiB")
            && err.message.contains("it reserves 620.00 MiB")
            && err.message.contains("of which 18.00 MiB"),
        "{}",
        err.message
    );
    let c = pool.reserve(0, 300 * MIB, S2).unwrap();
    // Shard 0's block cached, it goes back for shard 1's next request.
    pool.release(a).unwrap();
    let d = pool.reserve(0, 500 * MIB, S2).unwrap();
    // Shard 1: `b`'s 20 MiB segment, `c`'s and `d`'s; shard 0's went back.
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.allocated_bytes),
        (820 * MIB, 802 * MIB)
    );
    assert_eq!(s.ooms, 1, "only the first refusal");
    // Free is what the cap leaves to new blocks.
    assert_eq!(pool.mem_get_info(0).unwrap().0, GIB - 802 * MIB);
    // A lower cap returns idle cache: `d`'s segment.
    pool.release(d).unwrap();
    assert_eq!(
        pool.set_memory_limit(None, Some(400 * MIB)).unwrap(),
        500 * MIB
    );
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 320 * MIB);
    for p in [b, c] {
        pool.release(p).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn a_pool_of_several_devices_finds_each_shards_blocks() {
    let (pool, sim) = pool_with(&[GIB, GIB], PoolConfig::default());
    let a = pool.reserve(1, 8 * MIB, S1).unwrap();
    // Device 0's first request introduces it to device 1 (`pool/peers.rs`), under device 1's
    // locks: it comes before the hold below.
    let first = pool.reserve(0, 8 * MIB, S1).unwrap();
    pool.release(first).unwrap();
    // Device 1's first shard held: device 0 is not waited for, device 1's S2 moves.
    let held = pool.lock(1).unwrap();
    let x = pool.reserve(0, 8 * MIB, S2).unwrap();
    drop(held);
    assert_eq!(pool.bindings[0].opened(), 1);
    let b = reserve_against_held_shard(&pool, 1, 8 * MIB, S2);
    assert_eq!(pool.bindings[1].opened(), 2);
    assert_books(&pool, sim);
    for p in [a, b, x] {
        pool.record_stream(p, S1).unwrap();
        pool.release(p).unwrap();
    }
    assert_eq!(pool.stats(1).unwrap().allocated_bytes, 0);
    pool.free_reusable(None).unwrap();
    assert_books(&pool, sim);
    assert_eq!(sim.used_bytes(1), 0);
}

#[test]
fn the_reserved_peak_is_the_devices_not_the_sum_of_its_shards_peaks() {
    for config in [classic(), PoolConfig::default()] {
        let (pool, sim) = pool_with(&[4 * GIB], config);
        // Shard 0 reserves 100 MiB and gives it back to the driver...
        let a = pool.reserve(0, 100 * MIB, S1).unwrap();
        pool.release(a).unwrap();
        pool.free_reusable(Some(0)).unwrap();
        // ... before another stream, on a shard of its own, reserves 60 MiB.
        let b = reserve_against_held_shard(&pool, 0, 60 * MIB, S2);
        assert_eq!(pool.bindings[0].shard(S2), 1);
        let s = pool.stats(0).unwrap();
        // The shards peaked at 100 and 60 MiB, never together: the device at 100.
        assert_eq!(
            (
                s.reserved_bytes,
                s.peak_reserved_bytes,
                s.peak_allocated_bytes
            ),
            (60 * MIB, 100 * MIB, 160 * MIB)
        );
        // Both at once: 160 MiB.
        let a = pool.reserve(0, 100 * MIB, S1).unwrap();
        assert_eq!(pool.stats(0).unwrap().peak_reserved_bytes, 160 * MIB);
        assert_books(&pool, sim);
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        pool.free_reusable(Some(0)).unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!((s.reserved_bytes, s.peak_reserved_bytes), (0, 160 * MIB));
        pool.reset_peak_stats(0).unwrap();
        assert_eq!(pool.stats(0).unwrap().peak_reserved_bytes, 0);
        assert_books(&pool, sim);
    }
}

#[test]
fn a_shard_growing_under_its_lock_counts_against_the_cap_at_once() {
    let (pool, sim) = pool_with(&[4 * GIB], classic());
    // Shard 0: 40 MiB idle. Shard 1: stream 2's 20 MiB segment in use, and 20 MiB idle.
    let b = move_to_own_shard(&pool, S2);
    let idle = pool.reserve(0, 40 * MIB, S1).unwrap();
    pool.release(idle).unwrap();
    let idle = pool.reserve(0, 20 * MIB, S2).unwrap();
    pool.release(idle).unwrap();
    pool.set_memory_limit(Some(0), Some(100 * MIB)).unwrap();
    // 50 MiB on stream 1 needs its shard's idle 40 MiB back first, so its segment is made
    // under the shard's lock (slowly). Meanwhile stream 2 asks for 35 MiB: with its own idle
    // 20 MiB back, that fits beside the 40 MiB shard 0 held, not beside the 50 it is making.
    sim.set_delay(cuda_sim::Call::MemAlloc, Duration::from_millis(500));
    let frees = sim.call_count(cuda_sim::Call::MemFree);
    let (a, c) = std::thread::scope(|s| {
        let a = s.spawn(|| pool.reserve(0, 50 * MIB, S1));
        while sim.call_count(cuda_sim::Call::MemFree) == frees {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(100));
        let c = pool.reserve(0, 35 * MIB, S2);
        (a.join().unwrap(), c)
    });
    sim.set_delay(cuda_sim::Call::MemAlloc, Duration::ZERO);
    let s = pool.stats(0).unwrap();
    assert!(
        s.reserved_bytes <= 100 * MIB,
        "{} MiB reserved under a 100 MiB cap",
        s.reserved_bytes / MIB
    );
    // One of them fails, naming the cap: stream 2's, as the threads were timed (stream 1's,
    // should stream 2 have claimed its room first, shard 0's idle 40 MiB then back too).
    assert!(a.is_ok() != c.is_ok(), "{a:?} {c:?}");
    let (won, err) = match (a, c) {
        (Ok(p), Err(e)) => {
            assert_eq!(s.reserved_bytes, 70 * MIB);
            (p, e)
        }
        (Err(e), Ok(p)) => {
            assert_eq!(s.reserved_bytes, 56 * MIB);
            (p, e)
        }
        _ => unreachable!(),
    };
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(
        err.message.contains("memory limit of 100.00 MiB"),
        "{}",
        err.message
    );
    for p in [won, b] {
        pool.release(p).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn once_a_lowered_cap_is_read_no_shard_grows_past_it() {
    const S3: StreamHandle = 0x7f00_0000_3000;
    let (pool, sim) = pool_with(&[4 * GIB], classic());
    // Streams 2 and 3 on shards of their own, each holding a small block (a 2 MiB segment).
    let b2 = reserve_against_held_shard(&pool, 0, MIB / 2, S2);
    let b3 = reserve_against_held_shard(&pool, 0, MIB / 2, S3);
    assert_eq!(
        (pool.bindings[0].shard(S2), pool.bindings[0].shard(S3)),
        (1, 2)
    );
    let idle = pool.reserve(0, 40 * MIB, S2).unwrap();
    pool.release(idle).unwrap();
    pool.set_memory_limit(Some(0), Some(200 * MIB)).unwrap();
    // Stream 2's 160 MiB needs its idle 40 MiB back first, so its segment is made under shard
    // 1's lock (slowly), claimed under the 200 MiB cap: 164 MiB committed. Meanwhile the cap is
    // lowered to 170 MiB by a thread that must wait for shard 1 to return its cache.
    sim.set_delay(cuda_sim::Call::MemAlloc, Duration::from_millis(500));
    let frees = sim.call_count(cuda_sim::Call::MemFree);
    let (a, lowered, c) = std::thread::scope(|s| {
        let a = s.spawn(|| pool.reserve(0, 160 * MIB, S2));
        while sim.call_count(cuda_sim::Call::MemFree) == frees {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(50));
        let lowered = s.spawn(|| pool.set_memory_limit(Some(0), Some(170 * MIB)));
        while pool.memory_limit(0).unwrap() != Some(170 * MIB) {
            std::thread::yield_now();
        }
        // The cap reads 170 MiB: 20 MiB more on stream 3 would take the device to 184 MiB.
        // (Set shard by shard, shard 2 still held 200 MiB while the setter waited for shard 1.)
        // Stream 2's allocation is under way; stream 3's is made at once.
        sim.set_delay(cuda_sim::Call::MemAlloc, Duration::ZERO);
        let c = pool.reserve(0, 20 * MIB, S3);
        (a.join().unwrap(), lowered.join().unwrap(), c)
    });
    assert_eq!(lowered.unwrap(), 0, "no idle cache was left to return");
    let a = a.expect("claimed under the cap it was asked under");
    let err = c.expect_err("20 MiB past a cap the caller had read");
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(
        err.message.contains("memory limit of 170.00 MiB"),
        "{}",
        err.message
    );
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 164 * MIB);
    for p in [a, b2, b3] {
        pool.release(p).unwrap();
    }
    pool.set_memory_limit(Some(0), None).unwrap();
    pool.free_reusable(None).unwrap();
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}
