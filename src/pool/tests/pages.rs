//! Page-granular reuse (the virtual-memory API): remapping cached pages, stitching free ranges
//! between live blocks, borrowers and lenders, covers from free ranges, headroom, the fallback to
//! classic segments, and a driver that maps only from an allocation's start (handles of one-page
//! parts, or larger ones).

use super::*;

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
        842 * MIB,
        "the 748 MiB were remapped, 94 MiB created: the 36 MiB lacking and headroom (the cache \
         taken, at most an eighth of the 748 MiB reserved, in 2 MiB pages)"
    );
    assert_eq!(s.driver_frees, 0, "nothing went back to the driver");
    assert_eq!(
        s.driver_allocs - before.driver_allocs,
        1,
        "94 MiB as one handle"
    );
    assert_eq!(
        sim.mappings(0).len(),
        3,
        "748 MiB mapped twice, 94 MiB once"
    );
    assert_eq!(sim.used_bytes(0), 842 * MIB);
    assert_eq!(sim.is_accessible(p), Some(true));
    assert_eq!(sim.is_accessible(p + 784 * MIB - 1), Some(true));
    pool.release(p).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 842 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
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
    // Without the API, and with a driver that maps nothing at an offset into an allocation
    // (page-granular reuse maps a cached page while the rest of its handle stays where it is).
    for refuse_offsets in [false, true] {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[GIB])));
        if refuse_offsets {
            sim.set_vmm(cuda_sim::VmmSetting::StartOnly);
        } else {
            sim.disable_vmm();
        }
        let pool = Pool::new(Arc::new(SimDriver::new(sim).unwrap()), vmm());
        assert!(!pool.reuses_pages(0).unwrap());
        let p = pool.reserve(0, 8 * MIB, 0).unwrap();
        let q = pool.reserve(0, 4096, 0).unwrap();
        assert_eq!(sim.physical_allocations(0), 0);
        assert_eq!(sim.live_allocations(0), 2);
        pool.release(p).unwrap();
        pool.release(q).unwrap();
        assert_books(&pool, sim);
    }
}

#[test]
fn vmm_small_requests_share_stitched_segments() {
    let (pool, sim) = pool_with(&[GIB], vmm());
    assert!(pool.reuses_pages(0).unwrap());
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
fn vmm_a_request_larger_than_the_pool_takes_its_idle_ranges_though_they_cover_a_third() {
    // A model load freed, then a larger model's warm-up: the idle range covers a third of it.
    let (pool, sim) = pool_with(&[8 * GIB], vmm());
    let load = pool.reserve(0, GIB, 0).unwrap();
    pool.release(load).unwrap();
    let warmup = pool.reserve(0, 3 * GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    // The cached 1 GiB and 2 GiB created: not 3 GiB created beside 1 GiB left idle.
    assert_eq!(
        (s.reserved_bytes, s.reusable_bytes, s.driver_allocs),
        (3 * GIB, 0, 2)
    );
    assert_eq!(sim.used_bytes(0), 3 * GIB);
    pool.release(warmup).unwrap();
    // A request no larger than the pool still needs half of itself cached: with 2.5 GiB of the
    // 3 GiB live, a 2 GiB request is created whole beside the 0.5 GiB cached.
    let live = pool.reserve(0, 5 * GIB / 2, 0).unwrap();
    let whole = pool.reserve(0, 2 * GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.reusable_bytes), (5 * GIB, GIB / 2));
    for p in [whole, live] {
        pool.release(p).unwrap();
    }
    assert_eq!(pool.free_reusable(None).unwrap(), 5 * GIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_a_request_larger_than_a_pool_that_stopped_growing_takes_its_cache_beside_live_blocks() {
    // A load in one 1 GiB handle: two tensors freed, two small blocks outlive it.
    let (pool, sim) = pool_with(&[8 * GIB], vmm());
    pool.warmup(0, GIB).unwrap();
    let x = pool.reserve(0, 504 * MIB, 0).unwrap();
    let s1 = pool.reserve(0, 8 * MIB, 0).unwrap();
    let y = pool.reserve(0, 504 * MIB, 0).unwrap();
    let s2 = pool.reserve(0, 8 * MIB, 0).unwrap();
    pool.release(x).unwrap();
    pool.release(y).unwrap();
    // A request no free block holds, made wholly from the cache: the pool has stopped growing.
    let z = pool.reserve(0, 1000 * MIB, 0).unwrap();
    assert_eq!(
        pool.stats(0).unwrap().reserved_bytes,
        GIB,
        "made from the cache"
    );
    pool.release(z).unwrap();
    // A larger model's warm-up: the 1,008 MiB beside the live blocks cover a third of it, and
    // are half the pool. Taken, with the rest created: not 3 GiB beside 1,008 MiB left idle.
    let warmup = pool.reserve(0, 3 * GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.reusable_bytes, s.driver_allocs),
        (3 * GIB + 16 * MIB, 0, 2)
    );
    for p in [warmup, s1, s2] {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}

#[test]
fn vmm_a_growing_pool_keeps_its_cache_for_the_requests_after_a_larger_one() {
    // The first 8 MiB block's 20 MiB segment, then a 256 MiB request: the 12 MiB beside the
    // block stays for the small requests after it, and the request is created whole.
    let (pool, sim) = pool_with(&[8 * GIB], vmm());
    let first = pool.reserve(0, 8 * MIB, 0).unwrap();
    let large = pool.reserve(0, 256 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.reusable_bytes), (276 * MIB, 12 * MIB));
    let small = pool.reserve(0, 3 * MIB, 0).unwrap();
    assert_eq!(small, first + 8 * MIB, "beside the first block");
    assert_eq!(pool.stats(0).unwrap().driver_allocs, 2);
    for p in [first, large, small] {
        pool.release(p).unwrap();
    }
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

/// A 1.5 GiB warm-up split into 24 blocks of 64 MiB, every other one released (768 MiB of holes
/// between live blocks): the blocks, the released ones first in each pair.
fn holes_of_a_warmup(pool: &Pool) -> Vec<u64> {
    assert_eq!(pool.warmup(0, 1536 * MIB).unwrap(), 1536 * MIB);
    let blocks: Vec<u64> = (0..24)
        .map(|_| pool.reserve(0, 64 * MIB, 0).unwrap())
        .collect();
    for &p in blocks.iter().step_by(2) {
        pool.release(p).unwrap();
    }
    blocks
}

#[test]
fn the_default_serves_1_gib_from_768_mib_of_holes_and_512_mib_free_on_a_2_gib_device() {
    let (pool, sim) = pool_with(&[2 * GIB], PoolConfig::default());
    let blocks = holes_of_a_warmup(&pool);
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

/// The default pool on a 2 GiB device whose driver maps only from an allocation's start (the
/// CUDA driver's way), its handles made of parts of `part` bytes (`PageHandles`; 0: a page).
fn whole_only_pool(part: u64) -> (Pool, &'static Sim) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[2 * GIB])));
    sim.set_vmm(cuda_sim::VmmSetting::StartOnly);
    let driver = PageHandles::with_part(SimDriver::new(sim).unwrap(), part);
    (Pool::new(Arc::new(driver), PoolConfig::default()), sim)
}

/// Release the 1 GiB range `big` and the warm-up's other blocks: all `reserved` bytes go back,
/// and no mapping stays.
fn return_all(pool: &Pool, sim: &Sim, big: u64, blocks: &[u64], reserved: u64) {
    pool.release(big).unwrap();
    for &p in blocks.iter().skip(1).step_by(2) {
        pool.release(p).unwrap();
    }
    assert_books(pool, sim);
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), reserved);
    assert_nothing_held(sim);
    assert!(sim.mappings(0).is_empty());
}

#[test]
fn the_same_on_a_driver_that_maps_only_from_an_allocations_start() {
    // The pool's handles made of one-page handles: the same memory, more calls.
    let (pool, sim) = whole_only_pool(0);
    assert!(pool.reuses_pages(0).unwrap());
    let blocks = holes_of_a_warmup(&pool);
    let big = pool.reserve(0, GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.driver_allocs), (1792 * MIB, 2));
    assert_eq!(sim.used_bytes(0), 1792 * MIB);
    // 1,792 MiB in 896 pages, each created once; the new range maps 512 of them.
    assert_eq!(sim.call_count(cuda_sim::Call::MemCreate), 896);
    assert_eq!(sim.mappings(0).len(), 768 + 512);
    assert_eq!(sim.is_accessible(big + GIB - 1), Some(true));
    assert_books(&pool, sim);
    return_all(&pool, sim, big, &blocks, 1792 * MIB);
}

#[test]
fn with_handles_of_larger_parts_only_whole_parts_are_lent() {
    // The same driver, the pool's handles made of 24 MiB parts (`with_part`): the warm-up's
    // 1,536 MiB is 64 parts, and each 64 MiB hole holds two whole parts (48 MiB; a hole starts
    // 0, 8 or 16 MiB before a part's start). So the 1 GiB takes 576 MiB of the cache and
    // creates the 448 MiB it lacks (19 parts, the last 16 MiB), within the device.
    let (pool, sim) = whole_only_pool(24 * MIB);
    let blocks = holes_of_a_warmup(&pool);
    assert_eq!(sim.call_count(cuda_sim::Call::MemCreate), 64);
    let big = pool.reserve(0, GIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.driver_allocs), (1984 * MIB, 2));
    assert_eq!(sim.used_bytes(0), 1984 * MIB);
    assert_eq!(sim.call_count(cuda_sim::Call::MemCreate), 64 + 19);
    // The warm-up's 64 parts where they were, 24 of them again in the new range, and 19 new.
    assert_eq!(sim.mappings(0).len(), 64 + 24 + 19);
    assert_eq!(sim.is_accessible(big + GIB - 1), Some(true));
    assert_books(&pool, sim);
    // Taken apart, the lent parts fill their holes again; all of it goes back.
    return_all(&pool, sim, big, &blocks, 1984 * MIB);
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

/// Among many free blocks, a new range still finds its pieces: the largest first, then the
/// smallest that covers what is left, found through the bins without a look at every free block
/// (ties of size broken by the bins' order). 500 free 4 MiB blocks between live ones, and one
/// free 12 MiB block.
#[test]
fn vmm_pieces_are_found_among_many_free_blocks() {
    let (pool, sim) = pool_with(&[64 * GIB], vmm());
    // One handle for them all, so that no block straddles two.
    pool.warmup(0, 1002 * 4 * MIB + 12 * MIB).unwrap();
    let mut released = Vec::new();
    let mut kept = Vec::new();
    for i in 0..1000 {
        let p = pool.reserve(0, 4 * MIB, 0).unwrap();
        if i % 2 == 1 {
            released.push(p);
        } else {
            kept.push(p);
        }
    }
    kept.push(pool.reserve(0, 4 * MIB, 0).unwrap());
    let twelve = pool.reserve(0, 12 * MIB, 0).unwrap();
    kept.push(pool.reserve(0, 4 * MIB, 0).unwrap());
    for p in released {
        pool.release(p).unwrap();
    }
    pool.release(twelve).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reusable_bytes, 500 * 4 * MIB + 12 * MIB);
    let (maps, allocs) = (sim.mappings(0).len(), s.driver_allocs);
    // 14 MiB, which no free block holds: the 12 MiB block, then 2 MiB of a 4 MiB one; nothing
    // created.
    let p = pool.reserve(0, 14 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (sim.mappings(0).len() - maps, s.driver_allocs - allocs),
        (2, 0)
    );
    assert_eq!(s.reusable_bytes, 500 * 4 * MIB + 12 * MIB - 14 * MIB);
    pool.check().unwrap();
    // Released, the 14 MiB range gives its two lent pieces back first (unmapped: two mappings
    // fewer). Then 400 MiB: the 12 MiB block and 63 of the 4 MiB ones, the largest first and
    // 64 pieces at most (264 MiB, over half of it), and the 136 MiB lacking created as one
    // handle (with headroom).
    pool.release(p).unwrap();
    let (maps, allocs) = (sim.mappings(0).len(), pool.stats(0).unwrap().driver_allocs);
    let q = pool.reserve(0, 400 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        s.driver_allocs - allocs,
        1,
        "one handle for what the cache lacks"
    );
    assert_eq!(
        sim.mappings(0).len() + 2 - maps,
        65,
        "64 cached pieces and the new handle, less the two unmapped"
    );

    assert_eq!(sim.is_accessible(q + 400 * MIB - 1), Some(true));
    pool.release(q).unwrap();
    for p in kept {
        pool.release(p).unwrap();
    }
    pool.free_reusable(Some(0)).unwrap();
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

/// Where the cache is in more pieces than a range takes at once, a request that needs them all
/// is made from up to `LAST_RESORT_PIECES` once the driver refused it: not an out-of-memory.
/// A 1 GiB device: an 800 MiB warm-up in 200 blocks of 4 MiB, every other one released (400 MiB
/// cached in 100 pieces, each between two live blocks), 224 MiB free on the driver. 600 MiB:
/// 64 pieces (256 MiB) and the driver's 224 MiB fall short, all 100 and 200 MiB new do not.
#[test]
fn vmm_a_request_the_cache_covers_only_in_over_64_pieces_is_served() {
    let (pool, sim) = pool_with(&[GIB], vmm());
    assert_eq!(pool.warmup(0, 800 * MIB).unwrap(), 800 * MIB);
    let blocks: Vec<u64> = (0..200)
        .map(|_| pool.reserve(0, 4 * MIB, 0).unwrap())
        .collect();
    for &p in blocks.iter().step_by(2) {
        pool.release(p).unwrap();
    }
    assert_eq!(sim.mem_get_info(0).unwrap().0, 224 * MIB);
    let maps = sim.mappings(0).len();
    let big = pool.reserve(0, 600 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_allocs, s.ooms),
        (1000 * MIB, 2, 0),
        "the 400 MiB cached mapped again, 200 MiB created; no out-of-memory counted"
    );
    assert_eq!(
        sim.mappings(0).len() - maps,
        101,
        "100 pieces, one new handle"
    );
    assert_eq!(sim.is_accessible(big + 600 * MIB - 1), Some(true));
    assert_books(&pool, sim);
    pool.release(big).unwrap();
    for &p in blocks.iter().skip(1).step_by(2) {
        pool.release(p).unwrap();
    }
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 1000 * MIB);
    assert_nothing_held(sim);
}

/// A small request's range is a small segment: no headroom, however much the pool grew before
/// (headroom there would serve small requests only).
#[test]
fn vmm_a_small_request_after_large_growth_creates_no_headroom() {
    let (pool, sim) = pool_with(&[64 * GIB], vmm());
    let large: Vec<u64> = (0..10)
        .map(|_| pool.reserve(0, 100 * MIB, 0).unwrap())
        .collect();
    while pool.stats(0).unwrap().reusable_bytes > 0 {
        let tail = pool.stats(0).unwrap().largest_reusable_block;
        pool.reserve(0, tail, 0).unwrap();
    }
    let before = pool.stats(0).unwrap();
    let small = pool.reserve(0, 512 * 1024, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (
            s.reserved_bytes - before.reserved_bytes,
            s.driver_allocs - before.driver_allocs
        ),
        (2 * MIB, 1),
        "PyTorch's small segment, 2 MiB"
    );
    pool.release(small).unwrap();
    for p in large {
        pool.release(p).unwrap();
    }
    assert_books(&pool, sim);
}
