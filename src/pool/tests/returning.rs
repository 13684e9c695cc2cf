//! Returning memory to the driver: `free_reusable`, `trim`, and the sweep's bounded batches on
//! classic and stitched segments.

use super::*;

#[test]
fn free_reusable_returns_idle_segments_only() {
    let (pool, sim) = pool(24 * GIB);
    let keep = pool.reserve(0, 10 * MIB, 0).unwrap();
    let small = pool.reserve(0, 1000, 0).unwrap();
    let gone = pool.reserve(0, 20 * MIB, 0).unwrap();
    pool.release(gone).unwrap();
    let partly = pool.reserve(0, 1000, 0).unwrap();
    pool.release(small).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 20 * MIB);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.segments), (12 * MIB, 2));
    pool.release(keep).unwrap();
    pool.release(partly).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 12 * MIB);
    assert_eq!(sim.live_allocations(0), 0);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.driver_allocs, s.driver_frees, s.peak_reserved_bytes),
        (3, 3, 32 * MIB)
    );
    assert_books(&pool, sim);
}

#[test]
fn trim_returns_idle_segments_up_to_the_bytes_asked_and_never_a_live_block() {
    let (pool, sim) = pool(24 * GIB);
    let live = pool.reserve(0, 4 * GIB, 0).unwrap();
    let idle: Vec<u64> = [2 * GIB, 6 * GIB, 8 * GIB]
        .iter()
        .map(|&size| pool.reserve(0, size, 0).unwrap())
        .collect();
    for ptr in idle {
        pool.release(ptr).unwrap();
    }
    assert_eq!(pool.trim(0, 0).unwrap(), 0);
    // The smallest idle segment that covers the bytes asked.
    assert_eq!(pool.trim(0, 5 * GIB).unwrap(), 6 * GIB);
    assert_eq!(sim.used_bytes(0), 14 * GIB);
    // More than is idle: every idle segment, and the live block stays.
    assert_eq!(pool.trim(0, 20 * GIB).unwrap(), 10 * GIB);
    assert_eq!(pool.trim(0, GIB).unwrap(), 0);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.allocated_bytes), (4 * GIB, 4 * GIB));
    assert_books(&pool, sim);
    pool.release(live).unwrap();
    assert_eq!(pool.trim(0, GIB).unwrap(), 4 * GIB);
    assert_eq!(
        pool.trim(7, GIB).unwrap_err().status,
        rm_status::RM_ERROR_INVALID_DEVICE
    );
}

#[test]
fn free_reusable_returns_many_idle_segments_in_batches_with_exact_books() {
    let (pool, sim) = pool(24 * GIB);
    let pool = Arc::new(pool);
    let n = 3 * FREE_BATCH as u64 + 5;
    // One 20 MiB segment each (as PyTorch sizes them); the kept block gets one of its own.
    let blocks: Vec<u64> = (0..n)
        .map(|_| pool.reserve(0, 20 * MIB, 0).unwrap())
        .collect();
    let keep = pool.reserve(0, 4 * MIB, 0).unwrap();
    for p in blocks {
        pool.release(p).unwrap();
    }
    // Another thread takes the lock between batches meanwhile.
    let other = Arc::clone(&pool);
    let reader = std::thread::spawn(move || {
        for _ in 0..1000 {
            other.stats(0).unwrap();
        }
    });
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), n * 20 * MIB);
    reader.join().unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.segments, s.reserved_bytes, s.driver_frees),
        (1, 20 * MIB, n)
    );
    assert_eq!(sim.free_calls(), n);
    pool.release(keep).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn free_reusable_takes_stitched_segments_apart_in_batches_with_exact_books() {
    let (pool, sim) = pool_with(&[24 * GIB], PoolConfig::default());
    let n = 2 * FREE_BATCH as u64 + 3;
    // 8 MiB blocks: created 20 MiB at a time, as PyTorch sizes a segment for them, then with
    // the growth's headroom, so ranges hold two blocks or more.
    let blocks: Vec<u64> = (0..n)
        .map(|_| pool.reserve(0, 8 * MIB, 0).unwrap())
        .collect();
    for p in blocks {
        pool.release(p).unwrap();
    }
    // 536 MiB of blocks in 27 ranges, 540 MiB (PyTorch's policy: 34 segments, 680 MiB).
    let before = pool.stats(0).unwrap();
    let reserved = before.reserved_bytes;
    assert_eq!((before.segments, reserved), (27, 540 * MIB));
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), reserved);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.segments, s.reserved_bytes), (0, 0));
    assert_eq!((sim.used_bytes(0), sim.physical_allocations(0)), (0, 0));
    assert_eq!(sim.reserved_ranges(), 0);
    // Taken apart, the segments kept their lists of runs for the next ones in their places.
    assert_eq!(
        pool.lock(0).unwrap().0.vacant_with_runs_room() as u64,
        before.segments
    );
    assert_books(&pool, sim);
    // Which get lists of their own, with exact books: the pool grows again as it did the first
    // time (returning its memory ended the growth that sized the headroom).
    let again: Vec<u64> = (0..n)
        .map(|_| pool.reserve(0, 8 * MIB, 0).unwrap())
        .collect();
    assert_eq!(pool.stats(0).unwrap().segments, before.segments);
    for p in again {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}

/// Every batch of a sweep of device 0, `count` segments at most each, as (bytes, more).
fn sweep_batches(pool: &Pool, count: usize, over: &dyn Fn() -> bool) -> Vec<(u64, bool)> {
    // As `Pool::free_reusable`: the device waited for first, without the lock.
    let mut sweep = Sweep::settled_at(pool.wait_unlocked(0).unwrap());
    let mut batches = Vec::new();
    loop {
        let (mut device, cx) = pool.lock(0).unwrap();
        let (bytes, more) = device
            .free_reusable_batch(&cx, &mut sweep, count, over)
            .unwrap();
        drop(device);
        // As `Pool::free_reusable`: the driver calls made without the lock, booked next.
        sweep.make_calls(&**pool.driver(), 0);
        batches.push((bytes, more));
        pool.check().unwrap();
        if !more {
            return batches;
        }
        assert!(batches.len() < 1000, "the sweep does not end");
    }
}

/// `n` idle 20 MiB blocks, a 2 MiB segment with 16 small blocks parked on another stream, and
/// a block used on that stream, pending on its work: returns the other stream, the number of
/// segments and the bytes reserved. Classic segments are one per large block (checked here);
/// stitched ones grow with headroom, so some hold more than one, and lend pages to others.
fn cache_to_sweep(pool: &Pool, sim: &Sim, n: usize, stitched: bool) -> (u64, usize, u64) {
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let large: Vec<u64> = (0..n)
        .map(|_| pool.reserve(0, 20 * MIB, s1).unwrap())
        .collect();
    let small: Vec<u64> = (0..16)
        .map(|_| pool.reserve(0, 4096, s2).unwrap())
        .collect();
    let p = pool.reserve(0, 4 * MIB, s1).unwrap();
    pool.record_stream(p, s2).unwrap();
    sim.enqueue_work(0, s2).unwrap();
    for ptr in large.into_iter().chain(small).chain([p]) {
        pool.release(ptr).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert!(s.reserved_bytes >= n as u64 * 20 * MIB + 2 * MIB);
    if !stitched {
        assert_eq!(
            (s.segments, s.reserved_bytes),
            (n as u64 + 2, (n as u64 + 1) * 20 * MIB + 2 * MIB)
        );
    }
    (s2, s.segments as usize, s.reserved_bytes)
}

#[test]
fn a_sweep_bounds_every_batch_on_both_policies_and_ends_with_exact_books() {
    for config in [classic(), vmm()] {
        let (pool, sim) = pool_with(&[24 * GIB], config);
        let n = 20;
        let (s2, segments, reserved) = cache_to_sweep(&pool, sim, n, config.vmm);
        // One segment a batch. The parked blocks (16: the most a stream keeps; the small
        // blocks merged with each other as they were released) are merged by the first batch
        // before it returns a segment, the pending block is waited for, and each segment goes
        // back in a batch of its own (a lender's pages with its last borrower). The driver's
        // calls follow each batch and the next books them: a classic segment taken out by one
        // batch is counted by the next (one batch more, which counts the last); a stitched
        // segment's range is unmapped after one batch, and its handle, mapped nowhere once
        // that is booked, released after the next (two more).
        let batches = sweep_batches(&pool, 1, &|| false);
        let extra = if config.vmm { 2 } else { 1 };
        assert_eq!(batches.len(), segments + extra, "{config:?}");
        assert_eq!(
            batches.iter().map(|&(bytes, _)| bytes).sum::<u64>(),
            reserved,
            "{config:?}"
        );
        assert!(
            batches[..extra].iter().all(|&(bytes, _)| bytes == 0),
            "the first batches' segments are counted by later ones"
        );
        if !config.vmm {
            let mut sizes: Vec<u64> = batches[1..].iter().map(|&(bytes, _)| bytes).collect();
            sizes.sort_unstable();
            let mut expected = vec![20 * MIB; n + 1];
            expected.insert(0, 2 * MIB);
            assert_eq!(sizes, expected);
        }
        assert!(batches[..segments + extra - 1]
            .iter()
            .all(|&(_, more)| more));
        assert_eq!(
            sim.pending_work(0, s2).unwrap(),
            0,
            "the host waited for s2"
        );
        let s = pool.stats(0).unwrap();
        assert_eq!((s.segments, s.reserved_bytes), (0, 0), "{config:?}");
        assert_nothing_held(sim);
        assert_books(&pool, sim);
    }
}

#[test]
fn a_batch_stops_after_one_segment_once_its_time_is_up() {
    for config in [classic(), vmm()] {
        let (pool, sim) = pool_with(&[24 * GIB], config);
        let n = 2 * FREE_BATCH;
        let (_, segments, reserved) = cache_to_sweep(&pool, sim, n, config.vmm);
        let handles = sim.physical_allocations(0);
        let batches = sweep_batches(&pool, FREE_BATCH, &|| true);
        // Parked blocks all merged and the pending block freed in the first, then one segment
        // a batch, counted by the next (classic: one batch more, which counts the last, freed
        // after the one before). Stitched: 65 segments over 64 handles, one taken apart and one
        // handle released a batch, a handle once the unmaps of all the ranges mapping it were
        // booked; where two handles come free in one batch, the second waits a batch more.
        let expected = if config.vmm {
            assert_eq!((segments, handles), (65, 64));
            70
        } else {
            segments + 1
        };
        assert_eq!(batches.len(), expected, "{config:?}");
        let total: u64 = batches.iter().map(|&(bytes, _)| bytes).sum();
        assert_eq!(total, reserved, "{config:?}");
        assert_nothing_held(sim);
        assert_books(&pool, sim);
    }
}

#[test]
fn a_batch_returns_handles_left_mapped_nowhere_a_few_at_a_time_once_its_time_is_up() {
    let (pool, sim) = pool_with(&[24 * GIB], vmm());
    let n = 8;
    let blocks: Vec<u64> = (0..n)
        .map(|_| pool.reserve(0, 20 * MIB, 0).unwrap())
        .collect();
    for p in blocks {
        pool.release(p).unwrap();
    }
    // Batches with time to spare: the first takes every segment apart, the second (once
    // their unmaps are booked) takes every handle out to release, and the third books the
    // releases, which all failed: all are held again, mapped nowhere, with exact books (and
    // their address chunk, unused, for the sweep that finishes).
    sim.inject_faults("cuMemRelease@1+=999").unwrap();
    {
        let mut sweep = Sweep::settled_at(pool.wait_unlocked(0).unwrap());
        let mut results = Vec::new();
        while results.len() < 3 {
            let (mut device, cx) = pool.lock(0).unwrap();
            results.push(device.free_reusable_batch(&cx, &mut sweep, FREE_BATCH, &|| false));
            drop(device);
            sweep.make_calls(&**pool.driver(), 0);
        }
        assert_eq!(results[0].as_ref().unwrap(), &(0, true));
        assert_eq!(results[1].as_ref().unwrap(), &(0, true));
        let e = results[2].as_ref().unwrap_err();
        assert!(e.message.contains("cuMemRelease"), "{e}");
    }
    sim.clear_faults();
    pool.check().unwrap();
    assert_eq!((sim.physical_allocations(0), sim.reserved_ranges()), (n, 1));
    // Once their time is up, batches take them out one at a time, each counted by the next:
    // one a batch, not all in the first.
    let batches = sweep_batches(&pool, FREE_BATCH, &|| true);
    let mut expected = vec![(0, true)];
    expected.extend(std::iter::repeat_n((20 * MIB, true), n - 1));
    expected.push((20 * MIB, false));
    assert_eq!(batches, expected);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn a_sweep_takes_apart_a_lender_before_its_borrower_with_exact_books() {
    // The free memory between live blocks is lent to a new segment: the first segment has
    // holes, the second runs lent by it. Swept one segment a batch, the lender goes first and
    // its pages lent on become the borrower's; the books stay exact after every batch
    // (`sweep_batches` checks them) and nothing is held afterwards.
    let (pool, sim, ptrs) = fragmented(vmm());
    let big = pool.reserve(0, 60 * MIB, 0).unwrap();
    for p in [ptrs[2], ptrs[3], ptrs[6], ptrs[7], big] {
        pool.release(p).unwrap();
    }
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 92 * MIB);
    let batches = sweep_batches(&pool, 1, &|| false);
    // Taken apart first (its range unmapped after the batch), the lender returns nothing: the
    // borrower still maps 48 MiB of its handle. Then the borrower goes (unmapped after the
    // second batch), and with it the last mappings of both handles, released one a batch, the
    // larger first, each counted by the batch after.
    assert_eq!(
        batches,
        vec![
            (0, true),
            (0, true),
            (0, true),
            (80 * MIB, true),
            (12 * MIB, false)
        ]
    );
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

/// The device's waits (`cuCtxSynchronize`) counted so far.
fn waits(sim: &Sim) -> u64 {
    sim.driver_calls()
        .iter()
        .find(|t| t.call == Some(cuda_sim::Call::CtxSynchronize))
        .map_or(0, |t| t.calls)
}

/// Memory goes back after a wait for the device's queued work only where a block was released
/// since the last wait began: a second return of memory released before that wait waits for
/// nothing, and one released after it waits again.
#[test]
fn returning_memory_waits_for_the_device_only_for_blocks_released_since_the_last_wait() {
    for config in [classic(), PoolConfig::default()] {
        waits_only_for_blocks_released_since_the_last_wait(config);
    }
}

fn waits_only_for_blocks_released_since_the_last_wait(config: PoolConfig) {
    let (pool, sim) = pool_with(&[24 * GIB], config);
    let blocks: Vec<u64> = (0..3)
        .map(|_| pool.reserve(0, 64 * MIB, 0).unwrap())
        .collect();
    for &p in &blocks[..2] {
        pool.release(p).unwrap();
    }
    let before = waits(sim);
    assert_eq!(pool.trim(0, 64 * MIB).unwrap(), 64 * MIB);
    assert_eq!(waits(sim), before + 1, "released since the last wait");
    assert_eq!(pool.trim(0, 64 * MIB).unwrap(), 64 * MIB);
    assert_eq!(waits(sim), before + 1, "released before the last wait");
    pool.release(blocks[2]).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 64 * MIB);
    assert_eq!(
        waits(sim),
        before + 2,
        "released since: one wait, before the lock"
    );
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 0);
    assert_eq!(waits(sim), before + 2, "nothing released since");
    assert_books(&pool, sim);
}

/// A sweep frees classic segments without the device's lock and books the driver's answers
/// after: a segment the driver does not take back is booked again, idle, with exact books, the
/// failure told with the call named; the others go back; the next sweep returns it.
#[test]
fn a_classic_segment_the_driver_does_not_take_back_is_booked_again() {
    let (pool, sim) = pool(24 * GIB);
    let blocks: Vec<u64> = (0..3)
        .map(|_| pool.reserve(0, 64 * MIB, 0).unwrap())
        .collect();
    for p in blocks {
        pool.release(p).unwrap();
    }
    sim.inject_faults("cuMemFree_v2@2=999").unwrap();
    let e = pool.free_reusable(Some(0)).unwrap_err();
    assert_eq!(e.status, rm_status::RM_ERROR_DRIVER);
    assert!(e.message.contains("cuMemFree_v2"), "{e}");
    // The first went back; the second did not and is booked again; the third went back in the
    // same batch, or (a batch that ran out of time) stays for the next sweep.
    let s = pool.stats(0).unwrap();
    assert!(matches!(s.driver_frees, 1 | 2), "{s:?}");
    assert_eq!(
        (s.segments, s.reserved_bytes),
        (3 - s.driver_frees, (3 - s.driver_frees) * 64 * MIB)
    );
    assert_books(&pool, sim);
    let hits = s.cache_hits;
    let p = pool.reserve(0, 64 * MIB, 0).unwrap();
    pool.release(p).unwrap();
    assert_eq!(
        pool.stats(0).unwrap().cache_hits,
        hits + 1,
        "idle again, reused"
    );
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), s.reserved_bytes);
    assert_eq!(sim.live_allocations(0), 0);
    assert_books(&pool, sim);
}
