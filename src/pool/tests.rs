//! The pool against simulated devices: each rule of the policy, the books after every step, and
//! the messages.

use std::sync::Arc;

use cuda_sim::Sim;

use super::*;
use crate::driver::sim::SimDriver;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

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

#[test]
fn small_requests_share_a_segment_and_are_aligned() {
    let (pool, sim) = pool(24 * GIB);
    let a = pool.reserve(0, 1, 0).unwrap();
    let b = pool.reserve(0, 700, 0).unwrap();
    let c = pool.reserve(0, MIB, 0).unwrap();
    assert_eq!(a % 512, 0);
    assert_eq!(b, a + 512);
    assert_eq!(c, b + 1024);
    let s = pool.stats(0).unwrap();
    assert_eq!(s.segments, 1);
    assert_eq!(s.reserved_bytes, 2 * MIB);
    assert_eq!(s.allocated_bytes, 512 + 1024 + MIB);
    assert_eq!(s.requested_bytes, 1 + 700 + MIB);
    assert_eq!(s.live_blocks, 3);
    assert_eq!((s.reserve_calls, s.cache_hits, s.driver_allocs), (3, 2, 1));
    assert_eq!(s.largest_reusable_block, 2 * MIB - (512 + 1024 + MIB));
    assert_books(&pool, sim);
}

#[test]
fn large_requests_share_20_mib_segments_under_10_mib_and_get_their_own_above() {
    let (pool, sim) = pool(24 * GIB);
    let p = pool.reserve(0, 3 * MIB + 1, 0).unwrap();
    assert_eq!(p % (2 * MIB), 0);
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, 20 * MIB);
    assert_eq!(s.allocated_bytes, 3 * MIB + 512);
    assert_eq!(s.largest_reusable_block, 17 * MIB - 512);
    // The next one shares the segment.
    let q = pool.reserve(0, 9 * MIB, 0).unwrap();
    assert_eq!(q, p + 3 * MIB + 512);
    // 10 MiB and more: a segment of its own, rounded to 2 MiB pages.
    let r = pool.reserve(0, 10 * MIB + 1, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.segments), (32 * MIB, 2));
    for ptr in [p, q, r] {
        pool.release(ptr).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert_eq!((s.allocated_bytes, s.reusable_bytes), (0, 32 * MIB));
    assert_eq!(s.largest_reusable_block, 20 * MIB);
    assert_books(&pool, sim);
}

#[test]
fn released_blocks_coalesce_and_are_reused_without_the_driver() {
    let (pool, sim) = pool(24 * GIB);
    pool.warmup(0, 64 * MIB).unwrap();
    let ptrs: Vec<u64> = (0..8)
        .map(|_| pool.reserve(0, 8 * MIB, 0).unwrap())
        .collect();
    for w in ptrs.windows(2) {
        assert_eq!(w[1], w[0] + 8 * MIB, "the warm segment is split in order");
    }
    for &p in ptrs.iter().rev().step_by(2) {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
    for &p in ptrs.iter().step_by(2) {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        s.largest_reusable_block,
        64 * MIB,
        "all eight merged back into one"
    );
    assert_eq!((s.driver_allocs, s.cache_hits, s.reserve_calls), (1, 8, 8));
    let again = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(again, ptrs[0]);
    assert_eq!(pool.stats(0).unwrap().driver_allocs, 1);
}

#[test]
fn exact_size_reuse_finds_the_same_block() {
    let (pool, _) = pool(24 * GIB);
    let keep = pool.reserve(0, 17 * 512, 0).unwrap();
    let p = pool.reserve(0, 17 * 512, 0).unwrap();
    let _fence = pool.reserve(0, 512, 0).unwrap();
    pool.release(p).unwrap();
    assert_eq!(pool.reserve(0, 17 * 512, 0).unwrap(), p);
    assert_ne!(keep, p);
}

#[test]
fn warmup_allocates_only_the_shortfall() {
    let (pool, sim) = pool(24 * GIB);
    assert_eq!(pool.warmup(0, 8 * GIB).unwrap(), 8 * GIB);
    assert_eq!(pool.warmup(0, 8 * GIB).unwrap(), 0, "already reusable");
    let p = pool.reserve(0, 6 * GIB, 0).unwrap();
    // 2 GiB reusable, 3 GiB wanted: 1 GiB more.
    assert_eq!(pool.warmup(0, 3 * GIB).unwrap(), GIB);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.segments, s.driver_allocs),
        (9 * GIB, 2, 2)
    );
    pool.release(p).unwrap();
    assert_eq!(pool.warmup(0, 9 * GIB).unwrap(), 0);
    assert_eq!(pool.warmup(0, 0).unwrap(), 0);
    assert_books(&pool, sim);
}

#[test]
fn mem_get_info_counts_reusable_memory_as_free() {
    let (pool, sim) = pool(24 * GIB);
    let p = pool.reserve(0, 5 * GIB, 0).unwrap();
    let (free, total) = pool.mem_get_info(0).unwrap();
    assert_eq!((free, total), (19 * GIB, 24 * GIB));
    pool.release(p).unwrap();
    assert_eq!(
        sim.mem_get_info(0).unwrap().0,
        19 * GIB,
        "the driver still sees it used"
    );
    assert_eq!(pool.mem_get_info(0).unwrap(), (24 * GIB, 24 * GIB));
}

#[test]
fn idle_segments_go_back_to_the_driver_before_growing() {
    // transformers #37436: 748 MiB cached, a 784 MiB request, 736 MiB free on the driver.
    let (pool, sim) = pool((748 + 736) * MIB);
    let cached = pool.reserve(0, 748 * MIB, 0).unwrap();
    pool.release(cached).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 736 * MIB);
    let p = pool.reserve(0, 784 * MIB, 0).unwrap();
    assert_ne!(p, 0);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_allocs, s.driver_frees),
        (784 * MIB, 2, 1)
    );
    assert_eq!(
        (s.oom_retries, s.ooms),
        (0, 0),
        "no failed driver call was needed"
    );
    assert_books(&pool, sim);
}

#[test]
fn every_idle_classic_segment_goes_back_when_the_driver_is_short() {
    let (pool, sim) = pool(100 * MIB);
    let ptrs: Vec<u64> = [10, 30, 20, 40]
        .iter()
        .map(|&m| pool.reserve(0, m * MIB, 0).unwrap())
        .collect();
    for &p in &ptrs {
        pool.release(p).unwrap();
    }
    // 0 MiB free on the driver; a 45 MiB request (46 MiB page-rounded) fits no idle segment.
    // All four go back, as PyTorch returns every cached segment when the driver refuses, and
    // the peak stays at the device's 100 MiB.
    pool.reserve(0, 45 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_frees, s.driver_allocs),
        (46 * MIB, 4, 5)
    );
    // Now 54 MiB free: a 30 MiB request is allocated without returning anything.
    pool.reserve(0, 30 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.peak_reserved_bytes, s.driver_frees),
        (76 * MIB, 100 * MIB, 4)
    );
    assert_books(&pool, sim);
}

#[test]
fn driver_oom_returns_everything_and_retries_once() {
    let config = PoolConfig {
        release_before_grow: false,
        ..classic()
    };
    let (pool, sim) = pool_with(&[100 * MIB], config);
    let p = pool.reserve(0, 60 * MIB, 0).unwrap();
    pool.release(p).unwrap();
    let q = pool.reserve(0, 70 * MIB, 0).unwrap();
    assert_ne!(q, 0);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.oom_retries, s.ooms, s.driver_frees), (1, 0, 1));
    assert_books(&pool, sim);
}

#[test]
fn out_of_memory_names_every_figure_and_changes_nothing() {
    let (pool, sim) = pool(100 * MIB);
    let live = pool.reserve(0, 60 * MIB, 0).unwrap();
    let small = pool.reserve(0, 4096, 0).unwrap();
    pool.release(small).unwrap();
    let before = pool.stats(0).unwrap();
    let err = pool.reserve(0, 50 * MIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    let m = &err.message;
    assert!(m.contains("requested 50.00 MiB (52428800 bytes)"), "{m}");
    assert!(m.contains("reserves 60.00 MiB (62914560 bytes)"), "{m}");
    assert!(m.contains("0 B is reusable"), "{m}");
    assert!(
        m.contains("driver reports 40.00 MiB (41943040 bytes) free"),
        "{m}"
    );
    let after = pool.stats(0).unwrap();
    assert_eq!(after.ooms, 1);
    assert_eq!(after.oom_retries, 1);
    assert_eq!(
        after.reserved_bytes,
        before.reserved_bytes - 2 * MIB,
        "the idle small segment went back"
    );
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    pool.release(live).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn a_request_beyond_the_device_fails_without_flushing_the_cache() {
    let (pool, sim) = pool(24 * GIB);
    let p = pool.reserve(0, GIB, 0).unwrap();
    pool.release(p).unwrap();
    let err = pool.reserve(0, 25 * GIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(
        err.message.contains("more than the device's total memory"),
        "{}",
        err.message
    );
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, GIB);
    let err = pool.reserve(0, u64::MAX - 511, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_INVALID_VALUE);
    assert_books(&pool, sim);
}

#[test]
fn bad_pointers_are_refused_with_a_reason_and_nothing_changes() {
    let (pool, sim) = pool(24 * GIB);
    let a = pool.reserve(0, 4096, 0).unwrap();
    let b = pool.reserve(0, 4096, 0).unwrap();
    pool.release(a).unwrap();
    let before = pool.stats(0).unwrap();
    let cases = [
        (a, "already released"),
        (b + 512, "points 512 bytes into a live block"),
        (b + 8192, "inside cached free memory"),
        (0x1234_5000, "not returned by rm_reserve"),
    ];
    for (ptr, needle) in cases {
        let err = pool.release(ptr).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
        assert!(err.message.contains(needle), "{ptr:#x}: {}", err.message);
        let err = pool.record_stream(ptr, 0).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    }
    assert_eq!(pool.stats(0).unwrap(), before);
    pool.release(0).unwrap();
    pool.release(b).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn invalid_devices_are_refused() {
    let (pool, _) = pool_with(&[GIB, GIB], classic());
    for device in [-2, -1, 2, 10_000, i32::MAX] {
        let err = pool.reserve(device, 512, 0).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_DEVICE);
        assert!(
            err.message.contains("2 devices (ordinals 0 to 1)"),
            "{}",
            err.message
        );
        assert!(pool.stats(device).is_err());
        assert!(pool.mem_get_info(device).is_err());
        assert!(pool.warmup(device, 1).is_err());
    }
    assert!(pool.free_reusable(Some(-2)).is_err());
}

#[test]
fn release_finds_the_device_of_a_pointer() {
    let (pool, sim) = pool_with(&[GIB, GIB], classic());
    let on0 = pool.reserve(0, 3 * MIB, 0).unwrap();
    let on1 = pool.reserve(1, 3 * MIB, 0).unwrap();
    assert_eq!(sim.device_of(on1), Some(1));
    pool.release(on1).unwrap();
    assert_eq!(pool.stats(1).unwrap().allocated_bytes, 0);
    assert_eq!(pool.stats(0).unwrap().allocated_bytes, 3 * MIB);
    pool.release(on0).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 40 * MIB);
    assert_eq!((sim.used_bytes(0), sim.used_bytes(1)), (0, 0));
    assert_books(&pool, sim);
}

#[test]
fn bad_pointers_are_refused_on_several_devices_without_a_lock_and_nothing_changes() {
    for config in [classic(), vmm()] {
        let (pool, sim) = pool_with(&[GIB, GIB], config);
        let a = pool.reserve(1, 4096, 0).unwrap();
        let b = pool.reserve(1, 4096, 0).unwrap();
        let big = pool.reserve(0, 96 * MIB, 0).unwrap();
        pool.release(a).unwrap();
        let before = (pool.stats(0).unwrap(), pool.stats(1).unwrap());
        let cases = [
            (a, "already released"),
            (b + 512, "points 512 bytes into a live block"),
            (b + 8192, "inside cached free memory"),
            (big + 70 * MIB, "points 73400320 bytes into a live block"),
            (0x1234_5000, "in no memory the pool holds on any device"),
            (u64::MAX - 511, "in no memory the pool holds on any device"),
        ];
        for (ptr, needle) in cases {
            let err = pool.release(ptr).unwrap_err();
            assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
            assert!(err.message.contains(needle), "{ptr:#x}: {}", err.message);
            let err = pool.record_stream(ptr, 0).unwrap_err();
            assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
        }
        assert_eq!((pool.stats(0).unwrap(), pool.stats(1).unwrap()), before);
        pool.release(b).unwrap();
        pool.release(big).unwrap();
        assert_eq!(pool.stats(1).unwrap().allocated_bytes, 0);
        assert_books(&pool, sim);
    }
}

#[test]
fn a_span_the_map_cannot_tell_is_resolved_by_asking_each_device() {
    let (pool, sim) = pool_with(&[GIB, GIB], classic());
    let a = pool.reserve(0, 4096, 0).unwrap();
    let b = pool.reserve(0, 4096, 0).unwrap();
    let c = pool.reserve(1, 4096, 0).unwrap();
    // As if a segment of device 1 shared the 2 MiB span of device 0's segment.
    let span = a & !(2 * MIB - 1);
    pool.spans.add(span, 2 * MIB, 1);
    assert_eq!(pool.spans.owner(a), Owner::Unknown);
    assert!(pool.check().unwrap_err().contains("span map"));
    let err = pool.release(b + 512).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    assert!(
        err.message.contains("points 512 bytes into a live block"),
        "{}",
        err.message
    );
    pool.record_stream(a, 0).unwrap();
    pool.release(a).unwrap();
    let err = pool.release(a).unwrap_err();
    assert!(err.message.contains("already released"), "{}", err.message);
    let err = pool.release(span + 2 * MIB - 512).unwrap_err();
    assert!(
        err.message.contains("inside cached free memory"),
        "{}",
        err.message
    );
    assert_eq!(pool.stats(0).unwrap().allocated_bytes, 4096);
    pool.spans.remove(span, 2 * MIB);
    pool.release(b).unwrap();
    pool.release(c).unwrap();
    assert_books(&pool, sim);
}

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
fn peaks_track_and_reset() {
    let (pool, _) = pool(24 * GIB);
    let p = pool.reserve(0, 100 * MIB, 0).unwrap();
    pool.release(p).unwrap();
    pool.free_reusable(Some(0)).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.peak_allocated_bytes, s.peak_reserved_bytes),
        (100 * MIB, 100 * MIB)
    );
    pool.reset_peak_stats(0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.peak_allocated_bytes, s.peak_reserved_bytes), (0, 0));
}

#[test]
fn a_block_is_reused_on_its_own_stream_at_once() {
    let (pool, sim) = pool(24 * GIB);
    let s1 = sim.stream_create(0).unwrap();
    let p = pool.reserve(0, 4096, s1).unwrap();
    sim.enqueue_work(0, s1).unwrap();
    pool.release(p).unwrap();
    assert_eq!(
        pool.reserve(0, 4096, s1).unwrap(),
        p,
        "stream order makes it safe"
    );
}

#[test]
fn another_stream_gets_an_idle_segment_ordered_after_the_old_streams_work() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let p = pool.reserve(0, 8 * MIB, s1).unwrap();
    sim.enqueue_work(0, s1).unwrap(); // a kernel still using p
    pool.release(p).unwrap();
    let q = pool.reserve(0, 8 * MIB, s2).unwrap();
    assert_eq!(q, p, "the idle segment moved to s2");
    assert_eq!(pool.stats(0).unwrap().driver_allocs, 1);
    // Work queued on s2 now cannot finish before s1's kernel.
    sim.enqueue_work(0, s2).unwrap();
    assert_eq!(sim.pending_work(0, s1).unwrap(), 1);
    sim.complete_work(0, s2).unwrap();
    assert_eq!(sim.pending_work(0, s1).unwrap(), 0, "s2 waited for s1");
    assert_books(&pool, sim);
}

#[test]
fn a_partly_used_segment_of_another_stream_is_not_shared() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let _held = pool.reserve(0, 4096, s1).unwrap();
    pool.reserve(0, 4096, s2).unwrap();
    assert_eq!(pool.stats(0).unwrap().segments, 2);
}

#[test]
fn record_stream_holds_a_block_until_that_streams_work_is_done() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let _fence = pool.reserve(0, 512, s1).unwrap();
    let p = pool.reserve(0, 4096, s1).unwrap();
    pool.record_stream(p, s2).unwrap();
    pool.record_stream(p, s1).unwrap(); // its own stream: nothing to wait for
    sim.enqueue_work(0, s2).unwrap();
    pool.release(p).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes, s.live_blocks),
        (512, 1),
        "released at once in the books"
    );
    let q = pool.reserve(0, 4096, s1).unwrap();
    assert_ne!(q, p, "s2 may still be using it");
    pool.check().unwrap();
    sim.complete_work(0, s2).unwrap();
    let r = pool.reserve(0, 4096, s1).unwrap();
    assert_eq!(r, p, "reusable once s2's work completed");
    assert_books(&pool, sim);
}

#[test]
fn free_reusable_waits_for_pending_blocks() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let p = pool.reserve(0, 4 * MIB, s1).unwrap();
    pool.record_stream(p, s2).unwrap();
    sim.enqueue_work(0, s2).unwrap();
    pool.release(p).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 20 * MIB);
    assert_eq!(
        sim.pending_work(0, s2).unwrap(),
        0,
        "the host waited for s2"
    );
    assert_books(&pool, sim);
}

#[test]
fn a_hundred_thousand_cached_blocks_keep_working() {
    let (pool, sim) = pool(24 * GIB);
    let ptrs: Vec<u64> = (0..100_000u64)
        .map(|i| pool.reserve(0, 512 * (1 + i % 7), 0).unwrap())
        .collect();
    // Release every other block: 50k cached fragments that cannot merge.
    for &p in ptrs.iter().step_by(2) {
        pool.release(p).unwrap();
    }
    pool.check().unwrap();
    for i in 0..1000u64 {
        let p = pool.reserve(0, 512 * (1 + i % 7), 0).unwrap();
        pool.release(p).unwrap();
    }
    for &p in ptrs.iter().skip(1).step_by(2) {
        pool.release(p).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert_eq!(s.allocated_bytes, 0);
    assert_eq!(s.largest_reusable_block, MIB);
    pool.free_reusable(Some(0)).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
    assert_books(&pool, sim);
}

#[test]
fn threads_share_the_pool_and_release_each_others_blocks() {
    let (pool, sim) = pool_with(&[8 * GIB, 8 * GIB], classic());
    let pool = Arc::new(pool);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (pool, tx, rx) = (pool.clone(), tx.clone(), rx.clone());
            std::thread::spawn(move || {
                for i in 0..5_000u64 {
                    let size = 512 + (i * 7919 + t * 31) % (3 * MIB);
                    let p = pool.reserve((i % 2) as i32, size, 0).unwrap();
                    tx.send(p).unwrap();
                    if let Ok(q) = rx.lock().unwrap().try_recv() {
                        pool.release(q).unwrap();
                    }
                }
            })
        })
        .collect();
    drop(tx);
    for h in handles {
        h.join().unwrap();
    }
    while let Ok(q) = rx.lock().unwrap().try_recv() {
        pool.release(q).unwrap();
    }
    for d in 0..2 {
        assert_eq!(pool.stats(d).unwrap().allocated_bytes, 0);
    }
    assert_books(&pool, sim);
    pool.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0) + sim.used_bytes(1), 0);
}

#[test]
fn a_memory_limit_caps_reserved_and_names_itself() {
    let (pool, sim) = pool(24 * GIB);
    let idle = pool.reserve(0, 6 * GIB, 0).unwrap();
    pool.release(idle).unwrap();
    // A new cap below what is reserved returns the idle cache at once.
    assert_eq!(pool.set_memory_limit(None, Some(4 * GIB)).unwrap(), 6 * GIB);
    assert_eq!(pool.memory_limit(0).unwrap(), Some(4 * GIB));
    let a = pool.reserve(0, 3 * GIB, 0).unwrap();
    assert_eq!(
        pool.mem_get_info(0).unwrap().0,
        GIB,
        "free is what the cap leaves"
    );
    let err = pool.reserve(0, 2 * GIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(
        err.message.contains("memory limit of 4.00 GiB"),
        "{}",
        err.message
    );
    assert!(
        err.message.contains("set_per_process_memory_fraction"),
        "{}",
        err.message
    );
    // Growing under the cap returns idle cache first.
    pool.release(a).unwrap();
    let b = pool.reserve(0, 4 * GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.ooms), (4 * GIB, 1));
    pool.release(b).unwrap();
    pool.set_memory_limit(Some(0), None).unwrap();
    assert_eq!(pool.memory_limit(0).unwrap(), None);
    pool.reserve(0, 10 * GIB, 0).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn a_growing_pools_headroom_stays_within_its_cap() {
    // 30 segments of 32 MiB: the pool grows by 960 MiB, so its next creation takes 30 MiB of
    // headroom (a thirty-second of what it reserves). Under a cap of 980 MiB it may take 20
    // MiB more: the headroom is dropped rather than make the pool return cache or fail for it.
    for (cap, reserved) in [(None, 990 * MIB), (Some(980 * MIB), 980 * MIB)] {
        let (pool, sim) = pool_with(&[24 * GIB], vmm());
        let blocks: Vec<u64> = (0..30)
            .map(|_| pool.reserve(0, 32 * MIB, 0).unwrap())
            .collect();
        assert_eq!(pool.stats(0).unwrap().reserved_bytes, 960 * MIB);
        pool.set_memory_limit(Some(0), cap).unwrap();
        pool.release(blocks[0]).unwrap();
        // 34 MiB: the idle 32 MiB segment's pages, and 2 MiB lacking, created as PyTorch's
        // 20 MiB segment for it or as the headroom, whichever is larger.
        let p = pool.reserve(0, 34 * MIB, 0).unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!(
            (s.reserved_bytes, s.ooms, s.driver_frees),
            (reserved, 0, 0),
            "cap {cap:?}"
        );
        pool.release(p).unwrap();
        assert_books(&pool, sim);
    }
}

#[test]
fn parked_blocks_are_free_blocks_to_best_fit_and_merge_with_a_released_neighbour() {
    let (pool, sim) = pool(24 * GIB);
    // a | b | c | d | the rest of a 2 MiB small segment.
    let a = pool.reserve(0, 4096, 0).unwrap();
    let b = pool.reserve(0, 8192, 0).unwrap();
    let c = pool.reserve(0, 4096, 0).unwrap();
    let d = pool.reserve(0, 4096, 0).unwrap();
    assert_eq!((b, c, d), (a + 4096, a + 12288, a + 16384));
    // Between live blocks, c and then a are parked (they merge with nothing).
    pool.release(c).unwrap();
    pool.release(a).unwrap();
    pool.check().unwrap();
    // Best fit by (size, address) over the bins and the parked blocks, as PyTorch's: the
    // lowest 4 KiB block, a, although c was parked before it.
    assert_eq!(pool.reserve(0, 4096, 0).unwrap(), a);
    // A 2 KiB request splits the parked c rather than the segment's tail.
    let e = pool.reserve(0, 2048, 0).unwrap();
    assert_eq!(e, c);
    pool.release(e).unwrap();
    // b released between a (live) and the parked c merges with c: 12 KiB free at b.
    pool.release(b).unwrap();
    pool.check().unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reusable_bytes, 2 * MIB - 8192);
    assert_eq!(
        pool.stats(0).unwrap(),
        s,
        "reading the figures changes nothing"
    );
    assert_eq!(pool.reserve(0, 12288, 0).unwrap(), b);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.allocated_bytes, s.driver_allocs), (12288 + 8192, 1));
    pool.release(d).unwrap();
    // A parked block counts as reusable and as released.
    assert_eq!(pool.stats(0).unwrap().reusable_bytes, 2 * MIB - 16384);
    let err = pool.release(d).unwrap_err();
    assert!(err.message.contains("already released"), "{}", err.message);
    assert!(pool.record_stream(d, 7).is_err());
    assert_books(&pool, sim);
}

#[test]
fn a_full_parking_list_files_its_oldest_block_in_the_bins() {
    let (pool, sim) = pool(24 * GIB);
    let ptrs: Vec<u64> = (0..40).map(|_| pool.reserve(0, 4096, 0).unwrap()).collect();
    // Every other block released, each between live ones: the last 16 stay parked, the first
    // four go to the bins.
    for &p in ptrs.iter().step_by(2) {
        pool.release(p).unwrap();
        pool.check().unwrap();
    }
    // Best fit sees both: the lowest address of the size first, wherever it waits.
    assert_eq!(pool.reserve(0, 4096, 0).unwrap(), ptrs[0]);
    assert_eq!(pool.reserve(0, 4096, 0).unwrap(), ptrs[2]);
    // Released between two parked blocks, a block merges with both: 12 KiB at ptrs[18].
    pool.release(ptrs[19]).unwrap();
    pool.check().unwrap();
    assert_eq!(pool.reserve(0, 12288, 0).unwrap(), ptrs[18]);
    assert_books(&pool, sim);
}

#[test]
fn a_large_block_takes_a_remainder_of_at_most_1_mib_with_it() {
    let (pool, sim) = pool(24 * GIB);
    // A 20 MiB segment: 9 MiB and 10.5 MiB out of it leave 0.5 MiB, which no large request
    // could use: it goes out with the second block, as PyTorch hands it out.
    let a = pool.reserve(0, 9 * MIB, 0).unwrap();
    let b = pool.reserve(0, 10 * MIB + 512 * 1024, 0).unwrap();
    assert_eq!(b, a + 9 * MIB);
    pool.check().unwrap();
    // The rest counts as reusable, as it would as a free block, but is in no free block.
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (
            s.allocated_bytes,
            s.reusable_bytes,
            s.largest_reusable_block,
            s.driver_allocs
        ),
        (19 * MIB + 512 * 1024, 512 * 1024, 0, 1)
    );
    pool.release(b).unwrap();
    // Released, it is 11 MiB again: a remainder over 1 MiB stays free.
    let c = pool.reserve(0, 9 * MIB, 0).unwrap();
    assert_eq!(c, b);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (
            s.allocated_bytes,
            s.reusable_bytes,
            s.largest_reusable_block
        ),
        (18 * MIB, 2 * MIB, 2 * MIB)
    );
    pool.release(a).unwrap();
    pool.release(c).unwrap();
    assert_books(&pool, sim);
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

#[test]
fn vmm_serves_the_37436_request_by_remapping_the_cache() {
    // 748 MiB cached, 784 MiB wanted, 736 MiB free on the driver.
    let (pool, sim) = pool_with(&[(748 + 736) * MIB], vmm());
    let cached = pool.reserve(0, 748 * MIB, 0).unwrap();
    pool.release(cached).unwrap();
    assert_eq!(sim.mem_get_info(0).unwrap().0, 736 * MIB);
    let before = pool.stats(0).unwrap();
    let p = pool.reserve(0, 784 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        s.reserved_bytes,
        796 * MIB,
        "the 748 MiB were remapped, 48 MiB created: the 36 MiB lacking and headroom (the cache \
         taken, at most a sixteenth of the 748 MiB reserved, in 2 MiB pages)"
    );
    assert_eq!(s.driver_frees, 0, "nothing went back to the driver");
    assert_eq!(
        s.driver_allocs - before.driver_allocs,
        1,
        "48 MiB as one handle"
    );
    assert_eq!(
        sim.mappings(0).len(),
        3,
        "748 MiB mapped twice, 48 MiB once"
    );
    assert_eq!(sim.used_bytes(0), 796 * MIB);
    assert_eq!(sim.is_accessible(p), Some(true));
    assert_eq!(sim.is_accessible(p + 784 * MIB - 1), Some(true));
    pool.release(p).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 796 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
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

#[test]
fn classic_segments_cannot_use_free_memory_between_live_blocks() {
    let (pool, sim, _) = fragmented(classic());
    let err = pool.reserve(0, 60 * MIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(
        err.message.contains("of which 48.00 MiB"),
        "{}",
        err.message
    );
    assert_books(&pool, sim);
}

#[test]
fn vmm_an_idle_borrower_gives_its_pages_back_on_a_miss_and_the_lender_merges() {
    let (pool, sim, ptrs) = fragmented(vmm());
    let allocs = pool.stats(0).unwrap().driver_allocs;
    // 32 MiB from two of the three free 16 MiB ranges, lent as holes; nothing created.
    let borrower = pool.reserve(0, 32 * MIB, 0).unwrap();
    assert_eq!(sim.mappings(0).len(), 3);
    pool.release(borrower).unwrap();
    // The live blocks at 16 MiB go: they merge with the free range at 32 MiB only, since the
    // range at 0 is a hole.
    pool.release(ptrs[2]).unwrap();
    pool.release(ptrs[3]).unwrap();
    pool.check().unwrap();
    // 48 MiB fits no free block: the idle borrower is taken apart first, its pages fill the
    // holes, and the lender's first 48 MiB are one free block that serves the request in place.
    let p = pool.reserve(0, 48 * MIB, 0).unwrap();
    assert_eq!(p, ptrs[0]);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_allocs, s.segments),
        (80 * MIB, allocs, 1)
    );
    assert_eq!(
        sim.mappings(0).len(),
        1,
        "only the warm-up's mapping is left"
    );
    pool.release(p).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn vmm_stitches_free_memory_between_live_blocks_into_a_new_segment() {
    let (pool, sim, ptrs) = fragmented(vmm());
    let big = pool.reserve(0, 60 * MIB, 0).unwrap();
    pool.check().unwrap();
    let s = pool.stats(0).unwrap();
    // The three free 16 MiB ranges were mapped again, lent as holes; 12 MiB was created.
    assert_eq!(s.reserved_bytes, 92 * MIB);
    assert_eq!(s.allocated_bytes, 32 * MIB + 60 * MIB);
    assert_eq!(sim.used_bytes(0), 92 * MIB);
    assert_eq!(sim.is_accessible(big + 59 * MIB), Some(true));
    assert_eq!(
        sim.mappings(0).len(),
        5,
        "the warm-up's handle, its 3 pieces, the new one"
    );
    assert_eq!(
        sim.is_accessible(ptrs[2]),
        Some(true),
        "live blocks keep their memory"
    );
    assert_eq!(sim.is_accessible(ptrs[7]), Some(true));
    // The holes are never handed out, and releasing around them works.
    let err = pool.release(ptrs[0]).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    for i in [2, 3, 6, 7] {
        pool.release(ptrs[i]).unwrap();
        pool.check().unwrap();
    }
    pool.release(big).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 92 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_free_reusable_keeps_the_handles_of_segments_with_live_blocks() {
    let (pool, sim, ptrs) = fragmented(vmm());
    // The warm-up's one handle is mapped in a segment with live blocks: it stays, whole.
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 0);
    assert_eq!(sim.used_bytes(0), 80 * MIB);
    assert_eq!(pool.mem_get_info(0).unwrap().0, 68 * MIB);
    for i in [2, 3, 6, 7] {
        pool.release(ptrs[i]).unwrap();
    }
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 80 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_falls_back_to_classic_segments_without_the_api() {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[GIB])));
    sim.disable_vmm();
    let pool = Pool::new(Arc::new(SimDriver::new(sim).unwrap()), vmm());
    let p = pool.reserve(0, 8 * MIB, 0).unwrap();
    let q = pool.reserve(0, 4096, 0).unwrap();
    assert_eq!(sim.physical_allocations(0), 0);
    assert_eq!(sim.live_allocations(0), 2);
    pool.release(p).unwrap();
    pool.release(q).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn vmm_small_requests_share_stitched_segments() {
    let (pool, sim) = pool_with(&[GIB], vmm());
    let a = pool.reserve(0, 512, 0).unwrap();
    let b = pool.reserve(0, 4096, 0).unwrap();
    assert_eq!(b, a + 512);
    assert_eq!(sim.physical_allocations(0), 1);
    assert_eq!(sim.is_accessible(a), Some(true));
    pool.release(a).unwrap();
    pool.release(b).unwrap();
    // A large request does not take the idle small segment's pages: they stay for small
    // requests, as PyTorch keeps its small pool. It gets a 20 MiB handle of its own.
    let c = pool.reserve(0, 2 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.driver_allocs), (22 * MIB, 2));
    assert_eq!(
        pool.reserve(0, 4096, 0).unwrap(),
        a,
        "the small segment serves again"
    );
    assert_eq!(pool.stats(0).unwrap().driver_allocs, 2);
    pool.release(c).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn vmm_covers_a_request_from_free_ranges_without_creating_memory() {
    let (pool, sim) = pool_with(&[GIB], vmm());
    // A 512 MiB warm-up (one handle) split into x, y and z.
    pool.warmup(0, 512 * MIB).unwrap();
    let x = pool.reserve(0, 128 * MIB, 0).unwrap();
    let y = pool.reserve(0, 256 * MIB, 0).unwrap();
    let z = pool.reserve(0, 128 * MIB, 0).unwrap();
    pool.release(x).unwrap();
    pool.release(z).unwrap();
    let allocs = pool.stats(0).unwrap().driver_allocs;
    // 150 MiB: z's 128 MiB and 22 MiB of x's, both mapped again; nothing created.
    let big = pool.reserve(0, 150 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.driver_allocs, allocs);
    assert_eq!(s.reserved_bytes, 512 * MIB);
    assert_eq!(sim.used_bytes(0), 512 * MIB);
    assert_eq!(sim.mappings(0).len(), 3);
    // The rest of x still serves in place.
    assert_eq!(s.largest_reusable_block, 106 * MIB);
    assert_eq!(pool.reserve(0, 106 * MIB, 0).unwrap(), x + 22 * MIB);
    for p in [big, y] {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}

#[test]
fn vmm_covers_a_large_request_from_two_idle_segments() {
    let (pool, sim) = pool_with(&[GIB], vmm());
    // Two idle segments: 512 MiB and 256 MiB.
    let a = pool.reserve(0, 512 * MIB, 0).unwrap();
    let b = pool.reserve(0, 256 * MIB, 0).unwrap();
    pool.release(a).unwrap();
    pool.release(b).unwrap();
    let allocs = pool.stats(0).unwrap().driver_allocs;
    // 600 MiB: all of the first and 88 MiB of the second, mapped again; nothing created.
    let c = pool.reserve(0, 600 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.driver_allocs, allocs, "nothing created");
    assert_eq!((s.reserved_bytes, s.segments), (768 * MIB, 3));
    assert_eq!(
        s.largest_reusable_block,
        168 * MIB,
        "the rest of b, in place"
    );
    assert_eq!(s.reusable_bytes, 168 * MIB);
    assert_eq!(pool.mem_get_info(0).unwrap().0, GIB - 600 * MIB);
    pool.release(c).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 768 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_a_small_request_can_take_a_chunk_from_an_idle_large_segment() {
    let (pool, sim) = pool_with(&[GIB], vmm());
    // An idle 20 MiB segment.
    let a = pool.reserve(0, 8 * MIB, 0).unwrap();
    pool.release(a).unwrap();
    let allocs = pool.stats(0).unwrap().driver_allocs;
    // A small request needs a 2 MiB small segment: 2 MiB of the idle segment are mapped again
    // (their place becomes a hole, and the segment is no longer idle).
    let small = pool.reserve(0, 4096, 0).unwrap();
    pool.check().unwrap();
    assert_eq!(
        pool.stats(0).unwrap().driver_allocs,
        allocs,
        "nothing created"
    );
    assert_eq!(sim.mappings(0).len(), 2, "its first 2 MiB are mapped twice");
    // The other 18 MiB still serve a large request in place.
    let b = pool.reserve(0, 18 * MIB, 0).unwrap();
    assert_eq!(b, a + 2 * MIB);
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.driver_allocs), (20 * MIB, allocs));
    pool.release(b).unwrap();
    pool.release(small).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 20 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn the_default_serves_1_gib_from_768_mib_of_holes_and_512_mib_free_on_a_2_gib_device() {
    let (pool, sim) = pool_with(&[2 * GIB], PoolConfig::default());
    // A 1.5 GiB warm-up split into 24 blocks of 64 MiB, every other one released.
    assert_eq!(pool.warmup(0, 1536 * MIB).unwrap(), 1536 * MIB);
    let blocks: Vec<u64> = (0..24)
        .map(|_| pool.reserve(0, 64 * MIB, 0).unwrap())
        .collect();
    for &p in blocks.iter().step_by(2) {
        pool.release(p).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reusable_bytes, s.largest_reusable_block),
        (768 * MIB, 64 * MIB)
    );
    assert_eq!(sim.mem_get_info(0).unwrap().0, 512 * MIB);
    // 1 GiB: the twelve 64 MiB ranges mapped again (no memory created for them) and 256 MiB new.
    let big = pool.reserve(0, GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes, 1792 * MIB);
    assert_eq!((s.driver_allocs, s.driver_frees, s.ooms), (2, 0, 0));
    assert_eq!(sim.used_bytes(0), 1792 * MIB);
    assert_eq!(sim.vmm_calls(), (2, 0), "two cuMemCreate in all");
    assert_eq!(sim.mappings(0).len(), 1 + 12 + 1);
    assert_eq!(sim.is_accessible(big + GIB - 1), Some(true));
    assert_books(&pool, sim);
    // Taken apart, the new range's pieces become free again where they came from.
    pool.release(big).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 256 * MIB);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.largest_reusable_block),
        (1536 * MIB, 64 * MIB)
    );
    assert_eq!(sim.mappings(0).len(), 1);
    assert_books(&pool, sim);
    for &p in blocks.iter().skip(1).step_by(2) {
        pool.release(p).unwrap();
    }
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 1536 * MIB);
    assert_nothing_held(sim);
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
fn the_largest_reusable_block_counts_parked_blocks_as_the_free_blocks_they_are() {
    let (pool, sim) = pool(24 * GIB);
    // Eight 128 KiB blocks fill one 1 MiB stretch of a 2 MiB small segment; a ninth keeps the
    // rest apart.
    let blocks: Vec<u64> = (0..8)
        .map(|_| pool.reserve(0, 128 << 10, 0).unwrap())
        .collect();
    let rest = pool.reserve(0, MIB, 0).unwrap();
    assert_eq!(pool.stats(0).unwrap().largest_reusable_block, 0);
    // 6 is parked; 2 is parked, and 3 beside it merges with it.
    for i in [2, 3, 6] {
        pool.release(blocks[i]).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.largest_reusable_block, s.reusable_bytes),
        (256 << 10, 384 << 10)
    );
    assert_eq!(pool.stats(0).unwrap(), s);
    pool.release(rest).unwrap();
    for i in [0, 1, 4, 5, 7] {
        pool.release(blocks[i]).unwrap();
    }
    assert_books(&pool, sim);
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
    let blocks: Vec<u64> = (0..n)
        .map(|_| pool.reserve(0, 20 * MIB, 0).unwrap())
        .collect();
    for p in blocks {
        pool.release(p).unwrap();
    }
    // The pool grew with headroom (at most a thirty-second of what it reserved) beyond the
    // blocks' own bytes, and returns all of it.
    let before = pool.stats(0).unwrap();
    let reserved = before.reserved_bytes;
    assert!(reserved >= n * 20 * MIB && reserved <= n * 20 * MIB + n * 20 * MIB / 32 + 2 * MIB);
    assert!(
        before.segments < n,
        "some segments hold more than one block"
    );
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
        .map(|_| pool.reserve(0, 20 * MIB, 0).unwrap())
        .collect();
    assert_eq!(pool.stats(0).unwrap().segments, before.segments);
    for p in again {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}

#[test]
fn a_large_request_lacking_under_1_mib_creates_a_large_segment_for_the_next() {
    // A 20 MiB segment with an 8 MiB hole between two 6 MiB blocks. A 9 MiB request maps the
    // hole's pages and lacks 1 MiB: created as a large request's segment (20 MiB, as PyTorch
    // gives a 9 MiB request), not the small class's 2 MiB, so the next 9 MiB request fits in
    // the new range with no driver call.
    let (pool, sim) = pool_with(&[GIB], vmm());
    let x = pool.reserve(0, 20 * MIB, 0).unwrap();
    pool.release(x).unwrap();
    let a1 = pool.reserve(0, 6 * MIB, 0).unwrap();
    let a2 = pool.reserve(0, 8 * MIB, 0).unwrap();
    let a3 = pool.reserve(0, 6 * MIB, 0).unwrap();
    assert_eq!((a2, a3), (a1 + 6 * MIB, a1 + 14 * MIB));
    pool.release(a2).unwrap();
    let before = pool.stats(0).unwrap();
    let b = pool.reserve(0, 9 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.driver_allocs - before.driver_allocs, s.reserved_bytes),
        (1, 40 * MIB)
    );
    let c = pool.reserve(0, 9 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.driver_allocs - before.driver_allocs, s.reserved_bytes),
        (1, 40 * MIB)
    );
    for p in [a1, a3, b, c] {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}

#[test]
fn a_request_just_under_10_mib_gets_a_shared_20_mib_segment_when_stitching_too() {
    // 9 MiB is 10 MiB of 2 MiB pages, but PyTorch sizes its segment by the request: 20 MiB,
    // which the next 9 MiB request shares. Stitching creates the same handle.
    for config in [classic(), PoolConfig::default()] {
        let (pool, sim) = pool_with(&[GIB], config);
        let a = pool.reserve(0, 9 * MIB, 0).unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!((s.reserved_bytes, s.driver_allocs), (20 * MIB, 1));
        let b = pool.reserve(0, 9 * MIB, 0).unwrap();
        let s = pool.stats(0).unwrap();
        assert_eq!((s.reserved_bytes, s.driver_allocs), (20 * MIB, 1));
        assert_eq!(b, a + 9 * MIB, "the second lies right after the first");
        assert_books(&pool, sim);
    }
}

/// Every batch of a sweep of device 0, `count` segments at most each, as (bytes, more).
fn sweep_batches(pool: &Pool, count: usize, over: &dyn Fn() -> bool) -> Vec<(u64, bool)> {
    let mut sweep = Sweep::default();
    let mut batches = Vec::new();
    loop {
        let (mut device, cx) = pool.lock(0).unwrap();
        let (bytes, more) = device
            .free_reusable_batch(&cx, &mut sweep, count, over)
            .unwrap();
        drop(device);
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
        // back in a batch of its own (a lender's pages with its last borrower).
        let batches = sweep_batches(&pool, 1, &|| false);
        assert_eq!(batches.len(), segments, "{config:?}");
        assert_eq!(
            batches.iter().map(|&(bytes, _)| bytes).sum::<u64>(),
            reserved,
            "{config:?}"
        );
        if !config.vmm {
            let mut sizes: Vec<u64> = batches.iter().map(|&(bytes, _)| bytes).collect();
            sizes.sort_unstable();
            let mut expected = vec![20 * MIB; n + 1];
            expected.insert(0, 2 * MIB);
            assert_eq!(sizes, expected);
        }
        assert!(batches[..segments - 1].iter().all(|&(_, more)| more));
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
        let batches = sweep_batches(&pool, FREE_BATCH, &|| true);
        // Parked blocks all merged and the pending block freed in the first, then one segment
        // a batch.
        assert_eq!(batches.len(), segments, "{config:?}");
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
    // A batch with time to spare takes every segment apart, then fails to return the first
    // handle: all are left mapped nowhere, with exact books.
    sim.inject_faults("cuMemRelease@1=999").unwrap();
    {
        let (mut device, cx) = pool.lock(0).unwrap();
        let mut sweep = Sweep::default();
        let failed = device.free_reusable_batch(&cx, &mut sweep, FREE_BATCH, &|| false);
        assert!(failed.is_err());
    }
    pool.check().unwrap();
    assert_eq!((sim.physical_allocations(0), sim.reserved_ranges()), (n, 0));
    // Once their time is up, batches return them one before the segments are looked at and
    // one after: two a batch, not all in the first.
    let batches = sweep_batches(&pool, FREE_BATCH, &|| true);
    assert_eq!(
        batches,
        vec![
            (40 * MIB, true),
            (40 * MIB, true),
            (40 * MIB, true),
            (40 * MIB, false)
        ]
    );
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
    // Taken apart first, the lender returns nothing: the borrower still maps 48 MiB of its
    // handle. Then the borrower goes, and with it the last mappings of both handles, returned
    // one a batch, the larger first.
    assert_eq!(
        batches,
        vec![(0, true), (80 * MIB, true), (12 * MIB, false)]
    );
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}
