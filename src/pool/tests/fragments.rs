//! Fragments (the virtual-memory API): a new range that starts in the free tail of a page whose
//! start a live block holds, so that the request needs a page less; the lender kept while its
//! borrower lives, and both returned.

use super::*;

const KIB: u64 = 1 << 10;

/// A 68 MiB warm-up segment holding a 2.5 MiB block at 0 and a 60 MiB block at 4 MiB: free are
/// the tail of the second page (1.5 MiB at 2.5 MiB) and the last 4 MiB. Returns the pool, the
/// device, and the two blocks.
fn a_tail_and_two_pages(capacity: u64) -> (Pool, &'static Sim, u64, u64) {
    let (pool, sim) = pool_with(&[capacity], vmm());
    pool.warmup(0, 68 * MIB).unwrap();
    let a = pool.reserve(0, 2 * MIB + 512 * KIB, 0).unwrap();
    let tail = pool.reserve(0, MIB + 512 * KIB, 0).unwrap();
    let b = pool.reserve(0, 60 * MIB, 0).unwrap();
    assert_eq!((tail - a, b - a), (2 * MIB + 512 * KIB, 4 * MIB));
    pool.release(tail).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes, 68 * MIB);
    (pool, sim, a, b)
}

#[test]
fn vmm_a_request_starts_in_the_free_tail_of_a_live_blocks_page() {
    let (pool, sim, a, b) = a_tail_and_two_pages(GIB);
    let allocs = pool.stats(0).unwrap().driver_allocs;
    // 5.5 MiB fits no free block. Its last page would hold 1.5 MiB: the tail holds that, the
    // two free pages the rest. Three pages mapped, nothing created.
    let p = pool.reserve(0, 5 * MIB + 512 * KIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.driver_allocs), (68 * MIB, allocs));
    assert_eq!(s.reusable_bytes, 0, "every cached byte in use");
    assert_eq!(
        p % (2 * MIB),
        512 * KIB,
        "the block starts where the tail does"
    );
    assert_eq!(sim.is_accessible(p), Some(true));
    assert_eq!(sim.is_accessible(p + 5 * MIB + 511 * KIB), Some(true));
    assert_eq!(
        sim.mappings(0).len(),
        3,
        "the warm-up, and the tail's page and the two pages mapped again"
    );
    assert_eq!(sim.used_bytes(0), 68 * MIB);
    assert_books(&pool, sim);
    // The lender goes only after its borrower: everything back, in the sweep's one pass.
    for ptr in [a, b, p] {
        pool.release(ptr).unwrap();
    }
    assert_books(&pool, sim);
    assert_eq!(pool.free_reusable(None).unwrap(), 68 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_without_a_tail_that_holds_its_last_page_a_request_takes_whole_pages() {
    let (pool, sim, a, b) = a_tail_and_two_pages(GIB);
    // 5.75 MiB: its last page would hold 1.75 MiB, more than the 1.5 MiB tail. The two free
    // pages and a 20 MiB handle (PyTorch's segment for the 1.75 MiB they lack) make its range,
    // which starts on a page of its own.
    let p = pool.reserve(0, 5 * MIB + 768 * KIB, 0).unwrap();
    assert_eq!(p % (2 * MIB), 0);
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.reusable_bytes),
        (88 * MIB, 19 * MIB + 768 * KIB)
    );
    for ptr in [a, b, p] {
        pool.release(ptr).unwrap();
    }
    assert_eq!(pool.free_reusable(None).unwrap(), 88 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_the_smallest_tail_that_holds_the_last_page_is_taken() {
    // Tails of 1.5 MiB at 2.5 MiB and 1.25 MiB at 8.75 MiB in a 78 MiB warm-up, and two free
    // ranges of 4 MiB (at 68 and 74 MiB); the rest live.
    let (pool, sim) = pool_with(&[GIB], vmm());
    pool.warmup(0, 78 * MIB).unwrap();
    let sizes = [
        2 * MIB + 512 * KIB,
        MIB + 512 * KIB,
        4 * MIB + 768 * KIB,
        MIB + 256 * KIB,
        58 * MIB,
        4 * MIB,
        2 * MIB,
    ];
    let ptrs: Vec<u64> = sizes
        .iter()
        .map(|&size| pool.reserve(0, size, 0).unwrap())
        .collect();
    assert_eq!(ptrs[4] - ptrs[0], 10 * MIB);
    for i in [1, 3, 5] {
        pool.release(ptrs[i]).unwrap();
    }
    // 5 MiB: its last page would hold 1 MiB. Both tails hold that; the smaller is taken.
    let p = pool.reserve(0, 5 * MIB, 0).unwrap();
    assert_eq!(p % (2 * MIB), 768 * KIB, "in the 1.25 MiB tail");
    // 5.5 MiB: its last page would hold 1.5 MiB; only the other tail does.
    let q = pool.reserve(0, 5 * MIB + 512 * KIB, 0).unwrap();
    assert_eq!(q % (2 * MIB), 512 * KIB, "in the 1.5 MiB tail");
    // Nothing created; a quarter MiB left, after the 5 MiB block.
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.reusable_bytes), (78 * MIB, 256 * KIB));
    assert_books(&pool, sim);
    for ptr in [ptrs[0], ptrs[2], ptrs[4], ptrs[6], p, q] {
        pool.release(ptr).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_an_idle_borrower_of_a_tail_gives_it_back_on_a_miss() {
    // A 72 MiB device: the 68 MiB warm-up and 4 MiB free on the driver.
    let (pool, sim, a, b) = a_tail_and_two_pages(72 * MIB);
    let p = pool.reserve(0, 5 * MIB + 512 * KIB, 0).unwrap();
    for ptr in [a, b, p] {
        pool.release(ptr).unwrap();
    }
    // 72 MiB: the idle borrower is taken apart first, its pages fill the lender's holes, and the
    // lender is one free 68 MiB block again; the rest is created.
    let all = pool.reserve(0, 72 * MIB, 0).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.reusable_bytes), (72 * MIB, 0));
    assert_eq!(sim.used_bytes(0), 72 * MIB);
    pool.release(all).unwrap();
    assert_eq!(pool.free_reusable(None).unwrap(), 72 * MIB);
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}

#[test]
fn vmm_a_request_that_would_fail_takes_a_tail_with_the_drivers_last_page() {
    // 70 MiB: the driver has one page left beside the warm-up. 7.5 MiB fits no free block; its
    // last page would hold 1.5 MiB, which the tail holds. The two free pages and the driver's
    // page make the rest. Growth starts in the tail only where the cache covers the rest, so
    // the first try asks the driver for two pages and fails; the last try, with the tail, needs
    // the one page the driver has.
    let (pool, sim, a, b) = a_tail_and_two_pages(70 * MIB);
    let p = pool.reserve(0, 7 * MIB + 512 * KIB, 0).unwrap();
    assert_eq!(
        p % (2 * MIB),
        512 * KIB,
        "the block starts where the tail does"
    );
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.reusable_bytes, s.ooms),
        (70 * MIB, 0, 0)
    );
    assert_eq!(sim.used_bytes(0), 70 * MIB);
    assert_eq!(sim.is_accessible(p + 7 * MIB + 511 * KIB), Some(true));
    assert_books(&pool, sim);
    // A page more than the device has still fails, naming what it asked for.
    pool.release(p).unwrap();
    let err = pool.reserve(0, 9 * MIB + 512 * KIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(
        err.message.contains("requested 9.50 MiB"),
        "{}",
        err.message
    );
    // Why the 5.50 MiB reusable and the 2 MiB free did not serve 9.50 MiB.
    assert!(
        err.message.contains(
            "4.00 MiB (4194304 bytes) lies in whole free pages, which a new range maps but which \
             are too few with the driver's free memory, and 1.50 MiB (1572864 bytes) in the unused \
             parts of 2 MiB pages that live blocks also hold"
        ),
        "{}",
        err.message
    );
    for ptr in [a, b] {
        pool.release(ptr).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_nothing_held(sim);
    assert_books(&pool, sim);
}
