//! The PyTorch policy against simulated devices: each rule with exact figures.

use std::sync::Arc;

use cuda_sim::Sim;

use super::torch::*;
use crate::allocator::Allocator;
use resmem::driver::sim::SimDriver;
use resmem::error::rm_status;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn torch_with(capacity: u64, config: TorchConfig) -> (TorchAllocator, &'static Sim) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[capacity])));
    let driver = SimDriver::new(sim).expect("sim initialises");
    (TorchAllocator::new(Arc::new(driver), config).unwrap(), sim)
}

fn torch(capacity: u64) -> (TorchAllocator, &'static Sim) {
    torch_with(capacity, TorchConfig::default())
}

/// The books are consistent, and reserved equals what the driver holds.
fn assert_books(t: &TorchAllocator, sim: &Sim) {
    t.check().unwrap();
    assert_eq!(t.stats(0).unwrap().reserved_bytes, sim.used_bytes(0));
}

#[test]
fn requests_round_to_512_bytes() {
    assert_eq!(round_size(1), 512);
    assert_eq!(round_size(511), 512);
    assert_eq!(round_size(512), 512);
    assert_eq!(round_size(513), 1024);
    assert_eq!(round_size(MIB + 1), MIB + 512);
}

#[test]
fn roundup_power2_divisions_round_to_the_next_division_of_the_interval() {
    let mut config = TorchConfig::default();
    config.roundup_power2_divisions[0] = 4; // below 2 MiB
    config.roundup_power2_divisions[2] = 4; // 4 to 8 MiB
    config.roundup_power2_divisions[3] = 6; // 8 to 16 MiB: counted as 4
    config.roundup_power2_divisions[4] = 8; // 16 to 32 MiB
    config.roundup_power2_divisions[15] = 2; // 32 GiB and up
                                             // 600 bytes is no more than 4 divisions of 512 bytes: to 512 bytes only.
    assert_eq!(config.round_size(600), 1024);
    // 3,000 bytes: quarters of 2,048 to 4,096 bytes.
    assert_eq!(config.round_size(3000), 3072);
    assert_eq!(config.round_size(5 * MIB + 1), 6 * MIB);
    assert_eq!(config.round_size(6 * MIB), 6 * MIB);
    assert_eq!(config.round_size(8 * MIB), 8 * MIB);
    assert_eq!(config.round_size(9 * MIB), 10 * MIB);
    assert_eq!(config.round_size(17 * MIB + 1), 18 * MIB);
    assert_eq!(config.round_size(100 * GIB), 128 * GIB);
    // An interval without divisions: 512 bytes.
    assert_eq!(config.round_size(3 * MIB + 1), 3 * MIB + 512);
    // The policy rounds so: 5 MiB and a byte is a 6 MiB block of a 20 MiB segment.
    let (t, sim) = torch_with(GIB, config);
    let p = t.reserve(0, 5 * MIB + 1, 0).unwrap();
    let s = t.stats(0).unwrap();
    assert_eq!((s.allocated_bytes, s.reserved_bytes), (6 * MIB, 20 * MIB));
    t.release(p).unwrap();
    assert_books(&t, sim);
}

#[test]
fn segment_sizes_follow_the_pools() {
    assert_eq!(allocation_size(512), 2 * MIB);
    assert_eq!(allocation_size(MIB), 2 * MIB);
    assert_eq!(allocation_size(MIB + 512), 20 * MIB);
    assert_eq!(allocation_size(10 * MIB - 512), 20 * MIB);
    assert_eq!(allocation_size(10 * MIB), 10 * MIB);
    assert_eq!(allocation_size(10 * MIB + 512), 12 * MIB);
    assert_eq!(allocation_size(784 * MIB), 784 * MIB);
}

#[test]
fn small_requests_share_a_2_mib_segment_split_down_to_512_bytes() {
    let (t, sim) = torch(GIB);
    let a = t.reserve(0, MIB, 0).unwrap();
    let b = t.reserve(0, MIB - 1024, 0).unwrap();
    let c = t.reserve(0, 1, 0).unwrap();
    let d = t.reserve(0, 300, 0).unwrap();
    assert_eq!((b, c, d), (a + MIB, a + 2 * MIB - 1024, a + 2 * MIB - 512));
    let s = t.stats(0).unwrap();
    assert_eq!(
        (s.segments, s.reserved_bytes, s.allocated_bytes),
        (1, 2 * MIB, 2 * MIB)
    );
    assert_eq!((s.reserve_calls, s.cache_hits, s.driver_allocs), (4, 3, 1));
    assert_eq!(s.requested_bytes, MIB + (MIB - 1024) + 1 + 300);
    // The next small request needs a second segment.
    t.reserve(0, 512, 0).unwrap();
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 4 * MIB);
    assert_books(&t, sim);
}

#[test]
fn large_requests_under_10_mib_share_20_mib_segments() {
    let (t, sim) = torch(GIB);
    let a = t.reserve(0, 8 * MIB, 0).unwrap();
    let b = t.reserve(0, 8 * MIB, 0).unwrap();
    assert_eq!(
        b,
        a + 8 * MIB,
        "the 12 MiB remainder was split off and reused"
    );
    // 4 MiB remain in the first segment: a third 8 MiB request needs a new one.
    let c = t.reserve(0, 8 * MIB, 0).unwrap();
    assert_ne!(c, b + 8 * MIB);
    let s = t.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.allocated_bytes), (40 * MIB, 24 * MIB));
    assert_eq!(s.largest_reusable_block, 12 * MIB);
    assert_books(&t, sim);
}

#[test]
fn large_remainders_of_at_most_1_mib_are_not_split() {
    let (t, sim) = torch(GIB);
    // 19.5 MiB is a segment of its own, rounded to 20 MiB: the 0.5 MiB stays in the block.
    let p = t.reserve(0, 19 * MIB + MIB / 2, 0).unwrap();
    let s = t.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.allocated_bytes), (20 * MIB, 20 * MIB));
    t.release(p).unwrap();
    // A remainder of exactly 1 MiB is not split either (the rule is "more than 1 MiB").
    let q = t.reserve(0, 19 * MIB, 0).unwrap();
    assert_eq!(q, p);
    assert_eq!(t.stats(0).unwrap().allocated_bytes, 20 * MIB);
    t.release(q).unwrap();
    // A remainder of 1 MiB + 512 is.
    t.reserve(0, 19 * MIB - 512, 0).unwrap();
    let s = t.stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes, s.largest_reusable_block),
        (19 * MIB - 512, MIB + 512)
    );
    assert_books(&t, sim);
}

#[test]
fn best_fit_takes_the_smallest_cached_block_that_fits() {
    let (t, sim) = torch(GIB);
    let ptrs: Vec<u64> = [12, 16, 14]
        .iter()
        .map(|&m| t.reserve(0, m * MIB, 0).unwrap())
        .collect();
    for &p in &ptrs {
        t.release(p).unwrap();
    }
    assert_eq!(
        t.reserve(0, 13 * MIB, 0).unwrap(),
        ptrs[2],
        "the 14 MiB block"
    );
    assert_eq!(
        t.reserve(0, 11 * MIB, 0).unwrap(),
        ptrs[0],
        "the 12 MiB block"
    );
    let s = t.stats(0).unwrap();
    assert_eq!((s.driver_allocs, s.allocated_bytes), (3, 26 * MIB));
    assert_books(&t, sim);
}

#[test]
fn cached_blocks_serve_only_their_own_stream() {
    let (t, sim) = torch(GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let p = t.reserve(0, 64 * MIB, s1).unwrap();
    t.release(p).unwrap();
    let q = t.reserve(0, 64 * MIB, s2).unwrap();
    assert_ne!(q, p);
    let s = t.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_allocs, s.cache_hits),
        (128 * MIB, 2, 0)
    );
    assert_eq!(t.reserve(0, 64 * MIB, s1).unwrap(), p);
    assert_books(&t, sim);
}

#[test]
fn freed_neighbours_merge_back_into_one_block() {
    let (t, sim) = torch(GIB);
    t.warmup(0, 64 * MIB).unwrap();
    let ptrs: Vec<u64> = (0..4).map(|_| t.reserve(0, 16 * MIB, 0).unwrap()).collect();
    assert_eq!(t.stats(0).unwrap().driver_allocs, 1);
    for &i in &[1, 3, 0, 2] {
        t.release(ptrs[i]).unwrap();
    }
    let s = t.stats(0).unwrap();
    assert_eq!(s.largest_reusable_block, 64 * MIB);
    assert_eq!(t.reserve(0, 64 * MIB, 0).unwrap(), ptrs[0]);
    assert_books(&t, sim);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole_and_for_large_requests() {
    let config = TorchConfig {
        max_split_size: Some(40 * MIB),
        ..TorchConfig::default()
    };
    let (t, sim) = torch_with(GIB, config);
    let big = t.reserve(0, 64 * MIB, 0).unwrap();
    t.release(big).unwrap();
    // Under max_split_size: never an oversize block.
    let small = t.reserve(0, 30 * MIB, 0).unwrap();
    assert_ne!(small, big);
    // At or above it: only if the block is less than 20 MiB larger (64 >= 40 + 20).
    let forty = t.reserve(0, 40 * MIB, 0).unwrap();
    assert_ne!(forty, big);
    // 64 < 50 + 20: taken whole, not split.
    assert_eq!(t.reserve(0, 50 * MIB, 0).unwrap(), big);
    let s = t.stats(0).unwrap();
    assert_eq!(s.allocated_bytes, (30 + 40 + 64) * MIB);
    assert_eq!(s.driver_allocs, 3);
    assert_books(&t, sim);
    // At least 20 MiB, as PyTorch requires (of the rounding too).
    let new = |config| {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[GIB])));
        TorchAllocator::new(Arc::new(SimDriver::new(sim).unwrap()), config)
    };
    let split = |mib| TorchConfig {
        max_split_size: Some(mib * MIB),
        ..TorchConfig::default()
    };
    let rounding = |mib| TorchConfig {
        max_non_split_rounding: Some(mib * MIB),
        ..TorchConfig::default()
    };
    for config in [split(19), rounding(19)] {
        let err = new(config).err().unwrap();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_VALUE);
    }
    assert_eq!(
        new(split(19)).err().unwrap().message,
        "max_split_size of 19.00 MiB (19922944 bytes) is too small: PyTorch requires at least \
         20 MiB"
    );
    assert!(new(split(20)).is_ok() && new(rounding(20)).is_ok());
}

#[test]
fn max_non_split_rounding_sets_how_much_larger_an_oversize_block_may_be() {
    let config = TorchConfig {
        max_split_size: Some(40 * MIB),
        max_non_split_rounding: Some(64 * MIB),
        ..TorchConfig::default()
    };
    let (t, sim) = torch_with(GIB, config);
    let big = t.reserve(0, 100 * MIB, 0).unwrap();
    t.release(big).unwrap();
    // 100 >= 40 + 60 under the default's 20 MiB; with 64 MiB, 100 < 40 + 64: taken whole.
    assert_eq!(t.reserve(0, 40 * MIB, 0).unwrap(), big);
    let s = t.stats(0).unwrap();
    assert_eq!((s.allocated_bytes, s.driver_allocs), (100 * MIB, 1));
    // A request under max_split_size still never takes one.
    t.release(big).unwrap();
    assert_ne!(t.reserve(0, 36 * MIB, 0).unwrap(), big);
    assert_eq!(t.stats(0).unwrap().driver_allocs, 2);
    assert_books(&t, sim);
}

#[test]
fn after_a_failed_allocation_oversize_blocks_go_back_first_largest_first() {
    let config = TorchConfig {
        max_split_size: Some(40 * MIB),
        ..TorchConfig::default()
    };
    let (t, sim) = torch_with(200 * MIB, config);
    let ptrs: Vec<u64> = [30, 60, 50]
        .iter()
        .map(|&m| t.reserve(0, m * MIB, 0).unwrap())
        .collect();
    for &p in &ptrs {
        t.release(p).unwrap();
    }
    // 60 MiB free on the driver; 100 MiB needed; no single oversize block covers it: 60 + 50
    // go back, the 30 MiB block (under max_split_size) stays cached.
    t.reserve(0, 100 * MIB, 0).unwrap();
    let s = t.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_frees, s.oom_retries),
        (130 * MIB, 2, 0)
    );
    assert_books(&t, sim);
}

#[test]
fn after_a_failed_allocation_every_whole_cached_segment_goes_back_and_it_retries() {
    // transformers #37436 with the cache in one whole segment: PyTorch frees it and retries.
    let (t, sim) = torch((748 + 736) * MIB);
    let cached = t.reserve(0, 748 * MIB, 0).unwrap();
    t.release(cached).unwrap();
    assert_eq!(t.mem_get_info(0).unwrap().0, 736 * MIB);
    t.reserve(0, 784 * MIB, 0).unwrap();
    let s = t.stats(0).unwrap();
    assert_eq!(
        (
            s.reserved_bytes,
            s.driver_allocs,
            s.driver_frees,
            s.oom_retries,
            s.ooms
        ),
        (784 * MIB, 2, 1, 1, 0)
    );
    assert_books(&t, sim);
}

#[test]
fn cache_in_split_segments_is_not_returned_and_the_request_fails() {
    // transformers #37436 as PyTorch reports it: 748 MiB reserved but unallocated, spread over
    // segments that each still hold a live block, 736 MiB free on the driver, 784 MiB asked.
    let (t, sim) = torch(1676 * MIB);
    let ptrs: Vec<u64> = (0..235)
        .map(|_| t.reserve(0, 4 * MIB, 0).unwrap())
        .collect();
    for (i, &p) in ptrs.iter().enumerate() {
        let (segment, slot) = (i / 5, i % 5);
        if slot != 0 && !(segment == 46 && slot == 1) {
            t.release(p).unwrap();
        }
    }
    let s = t.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.reusable_bytes), (940 * MIB, 748 * MIB));
    assert_eq!(t.mem_get_info(0).unwrap().0, 736 * MIB);
    let err = t.reserve(0, 784 * MIB, 0).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
    assert!(err.message.contains("748.00 MiB"), "{}", err.message);
    let s = t.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.driver_frees, s.oom_retries, s.ooms),
        (940 * MIB, 0, 1, 1)
    );
    assert_books(&t, sim);
}

#[test]
fn mem_get_info_is_the_drivers_view() {
    let (t, _) = torch(24 * GIB);
    let p = t.reserve(0, 100 * MIB, 0).unwrap();
    t.release(p).unwrap();
    assert_eq!(t.mem_get_info(0).unwrap(), (24 * GIB - 100 * MIB, 24 * GIB));
}

#[test]
fn warmup_allocates_the_whole_size_and_leaves_it_cached() {
    let (t, sim) = torch(24 * GIB);
    assert_eq!(t.warmup(0, GIB).unwrap(), GIB);
    let s = t.stats(0).unwrap();
    assert_eq!(
        (s.reserved_bytes, s.allocated_bytes, s.peak_allocated_bytes),
        (GIB, 0, GIB)
    );
    assert_eq!(t.warmup(0, GIB).unwrap(), 0, "served from the cache");
    // While that block is in use, a warm-up allocates a whole second one.
    let p = t.reserve(0, GIB, 0).unwrap();
    assert_eq!(t.warmup(0, GIB).unwrap(), GIB);
    t.release(p).unwrap();
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 2 * GIB);
    assert_books(&t, sim);
}

#[test]
fn empty_cache_returns_only_whole_segments() {
    let (t, sim) = torch(GIB);
    let a = t.reserve(0, 8 * MIB, 0).unwrap();
    let b = t.reserve(0, 8 * MIB, 0).unwrap();
    t.release(a).unwrap();
    assert_eq!(t.free_reusable(None).unwrap(), 0);
    t.release(b).unwrap();
    assert_eq!(t.free_reusable(Some(0)).unwrap(), 20 * MIB);
    let s = t.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.driver_frees), (0, 1));
    assert_books(&t, sim);
}

#[test]
fn record_stream_holds_a_block_until_that_streams_work_is_done() {
    let (t, sim) = torch(GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let p = t.reserve(0, 4096, s1).unwrap();
    t.record_stream(p, s2).unwrap();
    sim.enqueue_work(0, s2).unwrap();
    t.release(p).unwrap();
    assert_eq!(t.stats(0).unwrap().allocated_bytes, 0);
    let q = t.reserve(0, 4096, s1).unwrap();
    assert_ne!(q, p, "s2 may still be using it");
    sim.complete_work(0, s2).unwrap();
    assert_eq!(t.reserve(0, 4096, s1).unwrap(), p);
    assert_books(&t, sim);
}

#[test]
fn bad_pointers_are_refused_and_change_nothing() {
    let (t, sim) = torch(GIB);
    let p = t.reserve(0, 4096, 0).unwrap();
    t.release(p).unwrap();
    let err = t.release(p).unwrap_err();
    assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    assert_eq!(
        t.release(p + 512).unwrap_err().status,
        rm_status::RM_ERROR_INVALID_POINTER
    );
    assert_eq!(t.reserve(0, 0, 0).unwrap(), 0);
    assert_eq!(
        t.reserve(3, 512, 0).unwrap_err().status,
        rm_status::RM_ERROR_INVALID_DEVICE
    );
    assert_books(&t, sim);
}

fn expandable(capacity: u64) -> (TorchAllocator, &'static Sim) {
    torch_with(
        capacity,
        TorchConfig {
            expandable_segments: true,
            ..TorchConfig::default()
        },
    )
}

#[test]
fn expandable_segments_grow_by_20_mib_handles_at_a_free_blocks_end() {
    use cuda_sim::Call;
    let (t, sim) = expandable(GIB);
    // 64 MiB: a range for the stream's large pool (1 GiB and an eighth), four 20 MiB handles
    // mapped; the 16 MiB beyond the block stays free in the range.
    let a = t.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(sim.call_count(Call::MemAddressReserve), 1);
    assert_eq!(sim.call_count(Call::MemCreate), 4);
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 80 * MIB);
    assert_books(&t, sim);
    // Another 64 MiB: the free 16 MiB and three more handles after it, one block.
    let b = t.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(b, a + 64 * MIB);
    assert_eq!(sim.call_count(Call::MemCreate), 7);
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 140 * MIB);
    assert_books(&t, sim);
    // Freed, the first block serves a 40 MiB request in place (split at 512 bytes and more).
    t.release(a).unwrap();
    let c = t.reserve(0, 40 * MIB, 0).unwrap();
    assert_eq!(c, a);
    assert_eq!(sim.call_count(Call::MemCreate), 7);
    // A request larger than any free block and the unmapped space after the last: the 12 MiB
    // at the range's end and handles after it, not a new segment.
    let d = t.reserve(0, 100 * MIB, 0).unwrap();
    assert_eq!(d, a + 128 * MIB);
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 240 * MIB);
    assert_books(&t, sim);
    for p in [b, c, d] {
        t.release(p).unwrap();
    }
    // empty_cache returns every handle and the range.
    assert_eq!(t.free_reusable(Some(0)).unwrap(), 240 * MIB);
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 0);
    assert_eq!(sim.call_count(Call::MemRelease), 12);
    assert_eq!(sim.call_count(Call::MemAddressFree), 1);
    assert_books(&t, sim);
}

#[test]
fn expandable_segments_return_only_whole_handles_of_cached_blocks() {
    let (t, sim) = expandable(GIB);
    // Two 10 MiB blocks in one 20 MiB handle, and a 30 MiB block over the next two handles.
    let a = t.reserve(0, 10 * MIB, 0).unwrap();
    let b = t.reserve(0, 10 * MIB, 0).unwrap();
    let c = t.reserve(0, 30 * MIB, 0).unwrap();
    assert_eq!((b, c), (a + 10 * MIB, a + 20 * MIB));
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 60 * MIB);
    // a's handle also holds b: nothing of it goes back; c's 30 MiB spans its first handle
    // whole and half of the next, which also holds the free 10 MiB after c.
    t.release(a).unwrap();
    t.release(c).unwrap();
    assert_eq!(t.free_reusable(Some(0)).unwrap(), 40 * MIB);
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 20 * MIB);
    assert_books(&t, sim);
    // The small pool: 2 MiB handles in a range of its own.
    let s = t.reserve(0, 1000, 0).unwrap();
    assert_eq!(t.stats(0).unwrap().reserved_bytes, 22 * MIB);
    t.release(s).unwrap();
    t.release(b).unwrap();
    assert_eq!(t.free_reusable(Some(0)).unwrap(), 22 * MIB);
    assert_eq!(t.stats(0).unwrap().segments, 0);
    assert_books(&t, sim);
}

#[test]
fn expandable_segments_give_cache_back_and_retry_at_capacity() {
    // A 200 MiB device: 100 MiB live, 80 MiB cached in another stream's range. A 90 MiB
    // request on stream 0 lacks room until the other range's handles go back.
    let (t, sim) = expandable(200 * MIB);
    let live = t.reserve(0, 100 * MIB, 0).unwrap();
    let other = t.reserve(0, 80 * MIB, 7).unwrap();
    t.release(other).unwrap();
    let p = t.reserve(0, 90 * MIB, 0).unwrap();
    let s = t.stats(0).unwrap();
    assert_eq!((s.reserved_bytes, s.oom_retries), (200 * MIB, 1));
    assert_books(&t, sim);
    t.release(p).unwrap();
    t.release(live).unwrap();
    t.free_reusable(None).unwrap();
    assert_books(&t, sim);
}

#[test]
fn random_sequences_keep_expandable_books_exact() {
    // A fixed linear congruential sequence: sizes from 512 bytes to 64 MiB on three streams
    // of a 512 MiB device, frees, uses on other streams, empty_cache; the books checked after
    // every operation, everything back at the end.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |bound: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % bound
    };
    let mut retries = 0;
    for round in 0..4 {
        let (t, sim) = expandable(512 * MIB);
        let streams = [
            0,
            sim.stream_create(0).unwrap(),
            sim.stream_create(0).unwrap(),
        ];
        let mut live: Vec<u64> = Vec::new();
        for _ in 0..1500 {
            match next(10) {
                0..=4 => {
                    let size = (512u64 << next(18)) + next(4096);
                    if let Ok(p) = t.reserve(0, size, streams[next(3) as usize]) {
                        live.push(p);
                    }
                }
                5..=7 if !live.is_empty() => {
                    let p = live.swap_remove(next(live.len() as u64) as usize);
                    t.release(p).unwrap();
                }
                8 if !live.is_empty() => {
                    let p = live[next(live.len() as u64) as usize];
                    t.record_stream(p, streams[next(3) as usize]).unwrap();
                }
                9 if round % 2 == 0 => {
                    t.free_reusable(Some(0)).unwrap();
                }
                _ => {}
            }
            t.check().unwrap();
        }
        retries += t.stats(0).unwrap().oom_retries;
        for p in live {
            t.release(p).unwrap();
        }
        t.free_reusable(Some(0)).unwrap();
        assert_eq!(t.stats(0).unwrap().reserved_bytes, 0);
        assert_eq!(t.stats(0).unwrap().segments, 0);
        assert_books(&t, sim);
    }
    // The sequences reach the device's capacity: cache went back and requests were retried.
    assert!(retries > 100, "{retries} retries");
}
