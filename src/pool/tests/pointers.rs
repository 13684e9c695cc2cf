//! Hostile input: bad pointers and devices are refused with a reason and change nothing, and a
//! pointer's device is found across several devices.

use super::*;

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
    assert_refused(&pool, &cases);
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
        assert_refused(&pool, &cases);
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
    let device_1 = super::SHARDS as i32; // device 1's first shard
    pool.spans.add(span, 2 * MIB, device_1);
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
    pool.spans.remove(span, 2 * MIB, device_1);
    pool.release(b).unwrap();
    pool.release(c).unwrap();
    assert_books(&pool, sim);
}

/// Each pointer refused by `release` and `record_stream` with `RM_ERROR_INVALID_POINTER`, the
/// release's message naming what it is.
fn assert_refused(pool: &Pool, cases: &[(u64, &str)]) {
    for &(ptr, needle) in cases {
        let err = pool.release(ptr).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
        assert!(err.message.contains(needle), "{ptr:#x}: {}", err.message);
        let err = pool.record_stream(ptr, 0).unwrap_err();
        assert_eq!(err.status, rm_status::RM_ERROR_INVALID_POINTER);
    }
}
