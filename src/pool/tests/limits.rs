//! Memory caps and out-of-memory: idle cache returned before growing, the retry after the
//! driver refuses, the error's figures, and what headroom may not do: pass a memory limit, or
//! add to a warm-up.

use super::*;

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
fn out_of_memory_says_why_the_reusable_memory_did_not_serve() {
    // Classic segments: 30 MiB free beside a live 20 MiB block, 50 MiB free on the driver;
    // 60 MiB fits neither, and the message says the largest reusable block.
    let (pool, sim) = pool(100 * MIB);
    let p = pool.reserve(0, 50 * MIB, 0).unwrap();
    pool.release(p).unwrap();
    let live = pool.reserve(0, 20 * MIB, 0).unwrap();
    let err = pool.reserve(0, 60 * MIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    let m = &err.message;
    assert!(
        m.contains("of which 30.00 MiB (31457280 bytes) is reusable"),
        "{m}"
    );
    assert!(
        m.contains(
            "The largest reusable block here is 30.00 MiB (31457280 bytes): without the \
             driver's virtual-memory API free blocks cannot be joined"
        ),
        "{m}"
    );
    pool.release(live).unwrap();
    assert_books(&pool, sim);
}

#[test]
fn vmm_out_of_memory_says_where_the_reusable_memory_lies() {
    // Stitched: a 20 MiB range fills the device. Its 4 MiB block and a 15.5 MiB one, which
    // takes the 16 MiB left with it (a rest of 0.5 MiB, as PyTorch's split rule hands out):
    // the 0.5 MiB reusable can serve nothing.
    let (pool, sim) = pool_with(&[20 * MIB], vmm());
    let a = pool.reserve(0, 4 * MIB, 0).unwrap();
    let b = pool.reserve(0, 15 * MIB + MIB / 2, 0).unwrap();
    let err = pool.reserve(0, 2 * MIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    let m = &err.message;
    assert!(
        m.contains("of which 512.00 KiB (524288 bytes) is reusable"),
        "{m}"
    );
    assert!(
        m.contains(
            "Of the reusable memory here, 0 B lies in whole free pages, which a new range maps \
             but which are too few with the driver's free memory, and 0 B in the unused parts \
             of 2 MiB pages that live blocks also hold, which only requests that fit beside \
             those blocks can use; 512.00 KiB (524288 bytes) are rests of at most 1 MiB handed \
             out with large blocks"
        ),
        "{m}"
    );
    for p in [a, b] {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}

#[test]
fn a_small_request_with_no_room_for_a_small_segment_takes_a_free_large_block() {
    // A 5 MiB and a 13.5 MiB block share a 20 MiB segment that fills the device, 1.5 MiB free
    // at its end, part of a page the second block holds too: no 2 MiB small segment can be had
    // (not even from the cache's whole pages, where the driver maps memory at an offset), and
    // PyTorch's policy fails a small request. The pool serves it from that free block, and the
    // block merges back when released.
    for config in [classic(), vmm()] {
        let (pool, sim) = pool_with(&[20 * MIB], config);
        let a = pool.reserve(0, 5 * MIB, 0).unwrap();
        let b = pool.reserve(0, 13 * MIB + MIB / 2, 0).unwrap();
        assert_eq!(b, a + 5 * MIB);
        let small = pool.reserve(0, 4096, 0).unwrap();
        assert_eq!(
            small,
            a + 18 * MIB + MIB / 2,
            "the free block after the second"
        );
        let s = pool.stats(0).unwrap();
        assert_eq!(
            (s.reserved_bytes, s.allocated_bytes, s.ooms),
            (20 * MIB, 18 * MIB + MIB / 2 + 4096, 0)
        );
        assert_books(&pool, sim);
        pool.release(small).unwrap();
        // Merged back: a 1.5 MiB large request fits in place.
        let c = pool.reserve(0, MIB + MIB / 2, 0).unwrap();
        assert_eq!(c, small);
        // With nothing free at all, the small request fails as before.
        let err = pool.reserve(0, 4096, 0).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
        assert_eq!(pool.stats(0).unwrap().ooms, 1);
        for p in [a, b, c] {
            pool.release(p).unwrap();
        }
        assert_books(&pool, sim);
    }
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
fn a_warm_up_after_growth_allocates_exactly_its_shortfall() {
    // 30 segments of 32 MiB: a creation now would take 30 MiB of headroom, but a warm-up asks
    // for exactly what it lacks.
    let (pool, sim) = pool_with(&[24 * GIB], vmm());
    let blocks: Vec<u64> = (0..30)
        .map(|_| pool.reserve(0, 32 * MIB, 0).unwrap())
        .collect();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 960 * MIB);
    assert_eq!(pool.warmup(0, 4 * MIB).unwrap(), 4 * MIB);
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 964 * MIB);
    for p in blocks {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}
