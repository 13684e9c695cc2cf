//! Placement by PyTorch's policy: best fit, splitting, the small and large classes and their
//! segment sizes, parking small blocks, coalescing on release, and warm-up.

use super::*;

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

/// A 64 MiB warm segment holding 3 MiB and 20 MiB blocks at its end, with a free block of
/// 41 MiB before them, from the segment's start to the middle of a 2 MiB page; and where the
/// segment starts.
fn free_to_mid_page(config: PoolConfig) -> (Pool, &'static Sim, u64) {
    let (pool, sim) = pool_with(&[256 * MIB], config);
    pool.warmup(0, 64 * MIB).unwrap();
    let base = pool.reserve(0, 41 * MIB, 0).unwrap();
    assert_eq!(pool.reserve(0, 3 * MIB, 0).unwrap(), base + 41 * MIB);
    assert_eq!(pool.reserve(0, 20 * MIB, 0).unwrap(), base + 44 * MIB);
    pool.release(base).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 64 * MIB);
    (pool, sim, base)
}

#[test]
fn vmm_a_block_goes_to_the_back_of_a_free_block_where_that_leaves_more_whole_pages() {
    let (pool, sim, base) = free_to_mid_page(vmm());
    // At the front, 3 MiB would leave 18 whole free pages (4 to 40 MiB); packed against the
    // live block after it, 19 (0 to 38 MiB), which a later range can borrow.
    let back = pool.reserve(0, 3 * MIB, 0).unwrap();
    assert_eq!(back, base + 38 * MIB);
    // The rest, 0 to 38 MiB, ends on a page: 4 MiB leave 17 whole pages either way, and ties
    // go to the front, as PyTorch places blocks.
    let front = pool.reserve(0, 4 * MIB, 0).unwrap();
    assert_eq!(front, base);
    let s = pool.stats(0).unwrap();
    assert_eq!(s.largest_reusable_block, 34 * MIB);
    assert_eq!((s.driver_allocs, s.live_blocks), (1, 4));
    assert_books(&pool, sim);
    // Released, the block at the back merges with the free block before it and the live
    // block's neighbour after it.
    pool.release(back).unwrap();
    assert_eq!(pool.stats(0).unwrap().largest_reusable_block, 37 * MIB);
    pool.release(front).unwrap();
    assert_eq!(pool.stats(0).unwrap().largest_reusable_block, 41 * MIB);
    assert_books(&pool, sim);
}

#[test]
fn classic_segments_always_take_the_front_of_a_free_block() {
    // They lend no pages: PyTorch's placement.
    let (pool, sim, base) = free_to_mid_page(classic());
    assert_eq!(pool.reserve(0, 3 * MIB, 0).unwrap(), base);
    assert_books(&pool, sim);
}
