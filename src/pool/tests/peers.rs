//! Devices given access to each other's mapped memory: each device that serves a request is a
//! peer of every other that does, from its first request on, its ranges mapped before given
//! access then.

use cuda_sim::Call;

use super::*;

const DEVICES: [u64; 3] = [GIB, GIB, GIB];

/// Every device's memory back with the driver, nothing mapped.
fn assert_all_returned(pool: &Pool, sim: &Sim) {
    pool.free_reusable(None).unwrap();
    for device in 0..3 {
        assert_eq!(sim.used_bytes(device), 0, "device {device}");
        assert_eq!(sim.physical_allocations(device), 0, "device {device}");
    }
    assert_eq!(sim.reserved_ranges(), 0);
}

#[test]
fn devices_that_serve_requests_use_each_others_ranges() {
    let (pool, sim) = pool_with(&DEVICES, vmm());
    let a = pool.reserve(0, 64 * MIB, 0).unwrap();
    assert_eq!(sim.accessible_from(a, 0), Some(true));
    assert_eq!(
        sim.accessible_from(a, 1),
        Some(false),
        "device 1 serves nothing yet"
    );
    assert_eq!(sim.call_count(Call::MemSetAccess), 1);
    let b = pool.reserve(1, 32 * MIB, 0).unwrap();
    for (ptr, from) in [(a, 1), (b, 0), (b, 1)] {
        assert_eq!(
            sim.accessible_from(ptr, from),
            Some(true),
            "{ptr:#x} from {from}"
        );
    }
    assert_eq!(
        sim.call_count(Call::MemSetAccess),
        4,
        "b's own mapping, then device 0's range given device 1 and b given device 0"
    );
    let c = pool.reserve(0, 100 * MIB, 0).unwrap();
    assert_eq!(
        sim.call_count(Call::MemSetAccess),
        5,
        "a range mapped after gives its device and the peer access in one call"
    );
    for ptr in [a, b, c, c + 100 * MIB - 1] {
        assert_eq!(sim.accessible_from(ptr, 0), Some(true));
        assert_eq!(sim.accessible_from(ptr, 1), Some(true));
        assert_eq!(
            sim.accessible_from(ptr, 2),
            Some(false),
            "device 2 serves nothing in this process"
        );
    }
    assert_books(&pool, sim);
    for ptr in [a, b, c] {
        pool.release(ptr).unwrap();
    }
    // A range made from cached pages later gives the peer access too.
    let d = pool.reserve(0, 150 * MIB, 0).unwrap();
    assert_eq!(sim.accessible_from(d + 150 * MIB - 1, 1), Some(true));
    pool.release(d).unwrap();
    assert_books(&pool, sim);
    assert_all_returned(&pool, sim);
}

#[test]
fn devices_the_driver_says_cannot_use_each_others_memory_are_not_peers() {
    let (pool, sim) = pool_with(&DEVICES, vmm());
    sim.set_peer_access(false);
    let a = pool.reserve(0, 64 * MIB, 0).unwrap();
    let b = pool.reserve(1, 64 * MIB, 0).unwrap();
    assert_eq!(sim.accessible_from(a, 1), Some(false));
    assert_eq!(sim.accessible_from(b, 0), Some(false));
    assert_eq!(
        sim.call_count(Call::MemSetAccess),
        2,
        "each range's own, nothing more"
    );
    assert_eq!(
        sim.call_count(Call::DeviceCanAccessPeer),
        2,
        "asked once each way"
    );
    // Asked once: a third reserve asks nothing more.
    let c = pool.reserve(1, 64 * MIB, 0).unwrap();
    assert_eq!(sim.call_count(Call::DeviceCanAccessPeer), 2);
    for ptr in [a, b, c] {
        pool.release(ptr).unwrap();
    }
    assert_books(&pool, sim);
    assert_all_returned(&pool, sim);
}

#[test]
fn classic_segments_need_no_access_given() {
    let (pool, sim) = pool_with(&DEVICES, classic());
    let a = pool.reserve(0, 64 * MIB, 0).unwrap();
    let b = pool.reserve(1, 64 * MIB, 0).unwrap();
    assert_eq!(sim.call_count(Call::MemSetAccess), 0);
    for ptr in [a, b] {
        pool.release(ptr).unwrap();
    }
    assert_books(&pool, sim);
    assert_all_returned(&pool, sim);
}

#[test]
fn peers_reach_ranges_made_of_one_page_handles() {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&DEVICES)));
    sim.set_vmm(cuda_sim::VmmSetting::StartOnly);
    let driver = PageHandles::with_part(SimDriver::new(sim).unwrap(), 0);
    let pool = Pool::new(Arc::new(driver), vmm());
    let a = pool.reserve(0, 9 * MIB, 0).unwrap();
    let b = pool.reserve(2, 9 * MIB, 0).unwrap();
    for ptr in [a, a + 9 * MIB - 1, b, b + 9 * MIB - 1] {
        for from in [0, 2] {
            assert_eq!(
                sim.accessible_from(ptr, from),
                Some(true),
                "{ptr:#x} from {from}"
            );
        }
        assert_eq!(sim.accessible_from(ptr, 1), Some(false));
    }
    for ptr in [a, b] {
        pool.release(ptr).unwrap();
    }
    pool.check().unwrap();
    assert_all_returned(&pool, sim);
}

#[test]
fn a_range_the_driver_will_not_map_for_a_peer_is_still_served() {
    let (pool, sim) = pool_with(&DEVICES, vmm());
    let a = pool.reserve(0, 64 * MIB, 0).unwrap();
    let b = pool.reserve(1, 64 * MIB, 0).unwrap();
    let calls = sim.call_count(Call::MemSetAccess);
    // The next access call (device 0 and its peer) fails; device 0 alone is asked, and the
    // peer once more as the range is booked.
    sim.inject_faults("cuMemSetAccess@1=999").unwrap();
    let c = pool.reserve(0, 256 * MIB, 0).unwrap();
    assert_eq!(sim.call_count(Call::MemSetAccess) - calls, 3);
    assert_eq!(sim.accessible_from(c, 0), Some(true));
    assert_eq!(sim.accessible_from(c, 1), Some(true));
    // Refused for the peer both times, the peer goes without; the range is still served.
    sim.inject_faults("cuMemSetAccess@1=999,cuMemSetAccess@3=999")
        .unwrap();
    let d = pool.reserve(0, 512 * MIB, 0).unwrap();
    sim.clear_faults();
    assert_eq!(sim.accessible_from(d, 0), Some(true));
    assert_eq!(sim.accessible_from(d, 1), Some(false));
    pool.check().unwrap();
    for ptr in [a, b, c, d] {
        pool.release(ptr).unwrap();
    }
    assert_all_returned(&pool, sim);
}

/// Every call that gives access, and every question whether a device can be a peer, failing in
/// turn: each request is served or fails with the driver's error (a range's own access refused,
/// as at the first, second and sixth `cuMemSetAccess`), the books stay exact, and everything
/// goes back.
#[test]
fn a_failure_at_each_access_call_or_peer_question_loses_nothing() {
    for call in ["cuMemSetAccess", "cuDeviceCanAccessPeer"] {
        for nth in 1..=8 {
            let (pool, sim) = pool_with(&DEVICES, vmm());
            sim.inject_faults(&format!("{call}@{nth}=999")).unwrap();
            let mut live = Vec::new();
            for (device, size) in [(0, 64 * MIB), (1, 32 * MIB), (0, 100 * MIB), (2, 9 * MIB)] {
                match pool.reserve(device, size, 0) {
                    Ok(ptr) => live.push(ptr),
                    Err(e) => assert!(
                        e.message.contains("CUDA_ERROR_UNKNOWN"),
                        "{call}@{nth}: {}",
                        e.message
                    ),
                }
                pool.check().unwrap_or_else(|e| panic!("{call}@{nth}: {e}"));
            }
            for ptr in live {
                pool.release(ptr).unwrap();
            }
            sim.clear_faults();
            assert_books(&pool, sim);
            assert_all_returned(&pool, sim);
        }
    }
}
