//! The figures the pool reports: free memory as `mem_get_info` counts it, peaks and their reset,
//! and the largest reusable block.

use super::*;

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
fn the_layout_tells_free_bytes_beside_live_blocks_from_whole_free_pages() {
    let (pool, sim) = pool_with(&[GIB], PoolConfig::default());
    // A 20 MiB range (PyTorch's segment for requests under 10 MiB): a [0, 3), b [3, 8).
    let a = pool.reserve(0, 3 * MIB, 0).unwrap();
    let b = pool.reserve(0, 5 * MIB, 0).unwrap();
    assert_eq!(b, a + 3 * MIB);
    pool.release(a).unwrap();
    // Page 1 holds 1 MiB free beside b; pages 0 and 4 to 9 are free.
    let expected = Layout {
        requested: 5 * MIB,
        rounding: 0,
        beside_live: MIB,
        free_pages: 14 * MIB,
        idle: 0,
    };
    assert_eq!(pool.layout(0).unwrap(), expected);
    // 14 MiB from those pages: mapped again into a range of its own (lent, holes here).
    let c = pool.reserve(0, 14 * MIB, 0).unwrap();
    assert_eq!(sim.used_bytes(0), 20 * MIB);
    let l = pool.layout(0).unwrap();
    assert_eq!(
        l,
        Layout {
            requested: 19 * MIB,
            free_pages: 0,
            ..expected
        }
    );
    assert_eq!(l.total(), pool.stats(0).unwrap().reserved_bytes);
    // Everything released: the ranges are idle.
    pool.release(b).unwrap();
    pool.release(c).unwrap();
    let l = pool.layout(0).unwrap();
    assert_eq!((l.requested, l.beside_live, l.idle), (0, 0, 20 * MIB));
    assert_books(&pool, sim);
}
