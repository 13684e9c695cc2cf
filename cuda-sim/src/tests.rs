//! Unit tests of the simulated driver rules.

use super::*;
use std::fmt;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn sim(caps: &[u64]) -> Sim {
    let s = Sim::new(caps);
    s.init().unwrap();
    s
}

fn err<T: fmt::Debug>(r: CuResult<T>) -> i32 {
    r.unwrap_err().0
}

#[test]
fn error_names_and_display() {
    let e = CuError(CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(e.name(), "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(e.description(), "out of memory");
    assert_eq!(e.to_string(), "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory");
    assert_eq!(codes::name(0), Some("CUDA_SUCCESS"));
    assert_eq!(codes::name(201), Some("CUDA_ERROR_INVALID_CONTEXT"));
    assert_eq!(codes::description(600), Some("device not ready"));
    assert_eq!(codes::name(12345), None);
    assert_eq!(codes::description(-1), None);
    for code in codes::ALL {
        assert!(codes::name(code).unwrap().starts_with("CUDA_"));
        assert!(codes::description(code).is_some());
    }
    assert_eq!(CuError(4242).name(), "CUDA_ERROR_UNRECOGNIZED");
    let boxed: Box<dyn std::error::Error> = Box::new(CuError(CUDA_ERROR_INVALID_VALUE));
    assert!(boxed.to_string().contains("invalid argument"));
}

#[test]
fn not_initialized_until_init() {
    let s = Sim::new(&[GIB]);
    let ni = CUDA_ERROR_NOT_INITIALIZED;
    assert_eq!(s.driver_version(), 12040);
    assert_eq!(err(s.device_count()), ni);
    assert_eq!(err(s.device_name(0)), ni);
    assert_eq!(err(s.total_mem(0)), ni);
    assert_eq!(err(s.mem_get_info(0)), ni);
    assert_eq!(err(s.mem_alloc(0, 1)), ni);
    assert_eq!(err(s.mem_free(WINDOW_BASE)), ni);
    assert_eq!(err(s.stream_create(0)), ni);
    assert_eq!(err(s.stream_destroy(FIRST_STREAM)), ni);
    assert_eq!(err(s.event_create(0)), ni);
    assert_eq!(err(s.event_destroy(FIRST_EVENT)), ni);
    assert_eq!(err(s.event_record(0, FIRST_EVENT, 0)), ni);
    assert_eq!(err(s.event_query(FIRST_EVENT)), ni);
    assert_eq!(err(s.event_synchronize(FIRST_EVENT)), ni);
    assert_eq!(err(s.stream_wait_event(0, 0, FIRST_EVENT)), ni);
    assert_eq!(err(s.stream_synchronize(0, 0)), ni);
    assert_eq!(err(s.stream_query(0, 0)), ni);
    assert_eq!(err(s.synchronize(0)), ni);
    assert_eq!(err(s.enqueue_work(0, 0)), ni);
    assert_eq!(err(s.complete_work(0, 0)), ni);
    assert_eq!(err(s.pending_work(0, 0)), ni);
    // Inspection needs no init.
    assert_eq!(s.capacity(0), GIB);
    assert_eq!(s.used_bytes(0), 0);
    assert_eq!(s.live_allocations(0), 0);
    assert_eq!(s.device_of(WINDOW_BASE), None);
    s.init().unwrap();
    s.init().unwrap();
    assert_eq!(s.device_count().unwrap(), 1);
}

#[test]
fn init_without_devices_fails() {
    let s = Sim::new(&[]);
    assert_eq!(err(s.init()), CUDA_ERROR_NO_DEVICE);
    assert_eq!(err(s.device_count()), CUDA_ERROR_NOT_INITIALIZED);
}

#[test]
fn device_queries() {
    let s = sim(&[24 * GIB, GIB + GIB / 2, 3 * MIB]);
    assert_eq!(s.device_count().unwrap(), 3);
    assert_eq!(s.device_name(0).unwrap(), "cuda-sim device 0 (24 GiB)");
    assert_eq!(s.device_name(1).unwrap(), "cuda-sim device 1 (1536 MiB)");
    // Capacity rounds down to whole pages.
    assert_eq!(s.total_mem(2).unwrap(), PAGE);
    assert_eq!(s.capacity(2), PAGE);
    assert_eq!(s.mem_get_info(0).unwrap(), (24 * GIB, 24 * GIB));
    for bad in [-1, 3, i32::MAX] {
        assert_eq!(err(s.device_name(bad)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.total_mem(bad)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.mem_get_info(bad)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.mem_alloc(bad, 1)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.stream_create(bad)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.event_create(bad)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.synchronize(bad)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(err(s.enqueue_work(bad, 0)), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(s.capacity(bad), 0);
        assert_eq!(s.used_bytes(bad), 0);
    }
}

#[test]
fn page_rounding() {
    let s = sim(&[GIB]);
    assert_eq!(err(s.mem_alloc(0, 0)), CUDA_ERROR_INVALID_VALUE);
    let a = s.mem_alloc(0, 1).unwrap();
    assert_eq!(s.used_bytes(0), PAGE);
    let b = s.mem_alloc(0, PAGE).unwrap();
    assert_eq!(s.used_bytes(0), 2 * PAGE);
    let c = s.mem_alloc(0, PAGE + 1).unwrap();
    assert_eq!(s.used_bytes(0), 4 * PAGE);
    assert_eq!(s.mem_get_info(0).unwrap(), (GIB - 4 * PAGE, GIB));
    for p in [a, b, c] {
        assert_ne!(p, 0);
        assert_eq!(p % PAGE, 0);
    }
    assert_eq!(b, a + PAGE);
    assert_eq!(c, b + PAGE);
    assert_eq!(s.live_allocations(0), 3);
    s.mem_free(c).unwrap();
    assert_eq!(s.used_bytes(0), 2 * PAGE);
    assert_eq!(s.alloc_calls(), 3);
    assert_eq!(s.free_calls(), 1);
}

#[test]
fn out_of_memory_exactly_at_capacity() {
    let s = sim(&[24 * GIB]);
    let ptrs: Vec<u64> = (0..12).map(|_| s.mem_alloc(0, 2 * GIB).unwrap()).collect();
    assert_eq!(s.used_bytes(0), 24 * GIB);
    assert_eq!(s.mem_get_info(0).unwrap(), (0, 24 * GIB));
    assert_eq!(err(s.mem_alloc(0, 2 * GIB)), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(err(s.mem_alloc(0, 1)), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(s.alloc_calls(), 12);
    s.mem_free(ptrs[5]).unwrap();
    assert_eq!(err(s.mem_alloc(0, 2 * GIB + 1)), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(s.mem_alloc(0, 2 * GIB).unwrap(), ptrs[5]);
    // Larger than the device at all.
    let t = sim(&[GIB]);
    assert_eq!(err(t.mem_alloc(0, GIB + 1)), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(err(t.mem_alloc(0, u64::MAX)), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(t.mem_alloc(0, GIB).unwrap() % PAGE, 0);
}

#[test]
fn bad_frees_are_invalid_value() {
    let s = sim(&[GIB, GIB]);
    let p = s.mem_alloc(0, 3 * PAGE).unwrap();
    let inv = CUDA_ERROR_INVALID_VALUE;
    assert_eq!(err(s.mem_free(0)), inv);
    assert_eq!(err(s.mem_free(12345)), inv);
    assert_eq!(err(s.mem_free(p + 1)), inv);
    assert_eq!(err(s.mem_free(p + PAGE)), inv);
    assert_eq!(err(s.mem_free(p + 3 * PAGE)), inv);
    assert_eq!(err(s.mem_free(u64::MAX)), inv);
    assert_eq!(err(s.mem_free(p + WINDOW_SIZE)), inv);
    assert_eq!(s.live_allocations(0), 1);
    s.mem_free(p).unwrap();
    assert_eq!(err(s.mem_free(p)), inv);
    assert_eq!(s.free_calls(), 1);
    assert_eq!(s.used_bytes(0), 0);
}

#[test]
fn address_windows_per_device() {
    let s = sim(&[GIB, GIB, GIB]);
    let p0 = s.mem_alloc(0, 1).unwrap();
    let p1 = s.mem_alloc(1, 1).unwrap();
    let p2 = s.mem_alloc(2, 5 * MIB).unwrap();
    for (dev, p) in [(0u64, p0), (1, p1), (2, p2)] {
        let lo = 0x7000_0000_0000 + dev * (1 << 40);
        assert!(p >= lo && p < lo + (1 << 40), "{p:#x} outside window {dev}");
        assert_eq!(s.device_of(p), Some(dev as i32));
        assert_eq!(s.device_of(p + PAGE - 1), Some(dev as i32));
    }
    assert_eq!(s.device_of(p2 + 3 * PAGE - 1), Some(2));
    assert_eq!(s.device_of(p2 + 3 * PAGE), None);
    assert_eq!(s.device_of(p0 + PAGE), None);
    assert_eq!(s.device_of(0), None);
    // Free works on any device's pointer without naming the device.
    s.mem_free(p1).unwrap();
    assert_eq!(s.device_of(p1), None);
    assert_eq!(s.used_bytes(1), 0);
    assert_eq!(s.used_bytes(2), 3 * PAGE);
    s.mem_free(p2).unwrap();
    s.mem_free(p0).unwrap();
    assert_eq!(s.free_calls(), 3);
}

#[test]
fn addresses_are_reused_lowest_gap_first() {
    let s = sim(&[GIB]);
    let a = s.mem_alloc(0, PAGE).unwrap();
    let b = s.mem_alloc(0, 2 * PAGE).unwrap();
    let c = s.mem_alloc(0, PAGE).unwrap();
    assert_eq!(a, WINDOW_BASE);
    s.mem_free(b).unwrap();
    // A 3-page block does not fit the 2-page gap; it goes after c.
    let d = s.mem_alloc(0, 3 * PAGE).unwrap();
    assert_eq!(d, c + PAGE);
    // A 1-page block takes the lowest gap.
    assert_eq!(s.mem_alloc(0, PAGE).unwrap(), b);
    assert_eq!(s.mem_alloc(0, PAGE).unwrap(), b + PAGE);
    s.mem_free(a).unwrap();
    assert_eq!(s.mem_alloc(0, 1).unwrap(), a);
    // Unique among live allocations.
    let mut bases: Vec<u64> = (0..20).map(|_| s.mem_alloc(0, 1).unwrap()).collect();
    bases.sort_unstable();
    bases.dedup();
    assert_eq!(bases.len(), 20);
}

#[test]
fn parse_sizes() {
    let cases: &[(&str, u64)] = &[
        ("24GiB", 24 * GIB),
        ("80 GiB", 80 * GIB),
        ("512MiB", 512 * MIB),
        ("1.5GiB", 3 * GIB / 2),
        ("24GB", 24_000_000_000),
        ("1048576", 1_048_576),
        ("2MB", 2_000_000),
        ("4KiB", 4096),
        ("4kib", 4096),
        ("4KB", 4000),
        ("1TiB", 1 << 40),
        ("2tb", 2_000_000_000_000),
        ("7B", 7),
        ("  3 gib ", 3 * GIB),
        ("0", 0),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("2.KiB", 2048),
        ("1.50GiB", 3 * GIB / 2),
    ];
    for &(s, v) in cases {
        assert_eq!(parse_size(s), Some(v), "{s}");
    }
    for bad in [
        "",
        " ",
        "GiB",
        "abc",
        "-1",
        "-1GiB",
        "1.2.3GiB",
        "1 2GiB",
        "1GiBs",
        "1 G",
        "1XB",
        "0.1B",
        "1.0000001KiB",
        "16EiB",
        "99999999999999999999",
        "20000000TiB",
        ".",
        "1,5GiB",
        "+1",
    ] {
        assert_eq!(parse_size(bad), None, "{bad:?}");
    }
}

#[test]
fn parse_device_lists() {
    assert_eq!(parse_devices("24GiB").unwrap(), vec![24 * GIB]);
    assert_eq!(parse_devices("80GiB,80GiB").unwrap(), vec![80 * GIB; 2]);
    assert_eq!(
        parse_devices(" 8GiB , 512MiB ").unwrap(),
        vec![8 * GIB, 512 * MIB]
    );
    assert!(parse_devices("").unwrap_err().contains("empty"));
    assert!(parse_devices("   ").is_err());
    let e = parse_devices("24GiB,lots").unwrap_err();
    assert!(e.contains("lots") && e.contains("device 1"), "{e}");
    let e = parse_devices("24GiB,").unwrap_err();
    assert!(e.contains("device 1"), "{e}");
    let e = parse_devices("0").unwrap_err();
    assert!(e.contains("device 0"), "{e}");
    assert!(parse_devices("1MiB").is_err());
    assert!(parse_devices("2MiB").is_ok());
}

#[test]
fn stream_and_event_handles() {
    let s = sim(&[GIB, GIB]);
    let s0 = s.stream_create(0).unwrap();
    let s1 = s.stream_create(1).unwrap();
    let e0 = s.event_create(0).unwrap();
    let e1 = s.event_create(1).unwrap();
    let all = [s0, s1, e0, e1];
    for (i, a) in all.iter().enumerate() {
        assert_ne!(*a, 0);
        for b in &all[i + 1..] {
            assert_ne!(a, b);
        }
    }
    assert_eq!(s.stream_device(s1), Some(1));
    assert_eq!(s.stream_device(0), None);
    assert_eq!(s.event_device(e0), Some(0));
    let h = CUDA_ERROR_INVALID_HANDLE;
    // Handles of another device, or of the other kind.
    assert_eq!(err(s.enqueue_work(0, s1)), h);
    assert_eq!(err(s.stream_synchronize(1, s0)), h);
    assert_eq!(err(s.event_record(0, e1, 0)), h);
    assert_eq!(err(s.event_record(0, e0, s1)), h);
    assert_eq!(err(s.event_record(1, e0, s1)), h);
    assert_eq!(err(s.event_record(0, s0, s0)), h);
    assert_eq!(err(s.event_query(s0)), h);
    assert_eq!(err(s.enqueue_work(0, e0)), h);
    assert_eq!(err(s.stream_destroy(0)), h);
    assert_eq!(err(s.stream_destroy(e0)), h);
    assert_eq!(err(s.event_destroy(s0)), h);
    s.event_record(0, e0, s0).unwrap();
    s.event_record(1, e1, 0).unwrap();
    // Destroy, then every use of the handle fails.
    s.stream_destroy(s0).unwrap();
    assert_eq!(err(s.stream_destroy(s0)), h);
    assert_eq!(err(s.enqueue_work(0, s0)), h);
    assert_eq!(err(s.stream_query(0, s0)), h);
    assert_eq!(err(s.event_record(0, e0, s0)), h);
    s.event_destroy(e0).unwrap();
    assert_eq!(err(s.event_destroy(e0)), h);
    assert_eq!(err(s.event_query(e0)), h);
    assert_eq!(err(s.event_synchronize(e0)), h);
    assert_eq!(err(s.stream_wait_event(0, 0, e0)), h);
    // New handles are never reused.
    assert!(s.stream_create(0).unwrap() > s1);
    assert!(s.event_create(0).unwrap() > e1);
}

#[test]
fn event_captures_stream_work() {
    let s = sim(&[GIB]);
    let s1 = s.stream_create(0).unwrap();
    let e = s.event_create(0).unwrap();
    assert!(s.event_query(e).unwrap(), "never recorded: complete");
    assert_eq!(s.enqueue_work(0, s1).unwrap(), 1);
    s.event_record(0, e, s1).unwrap();
    assert!(!s.event_query(e).unwrap());
    assert!(!s.stream_query(0, s1).unwrap());
    // Work after the record is not part of the capture.
    assert_eq!(s.enqueue_work(0, s1).unwrap(), 2);
    assert_eq!(s.pending_work(0, s1).unwrap(), 2);
    s.complete_work(0, s1).unwrap();
    assert!(s.event_query(e).unwrap());
    assert!(s.stream_query(0, s1).unwrap());
    assert_eq!(s.pending_work(0, s1).unwrap(), 0);
    // Recording again replaces the capture.
    s.enqueue_work(0, s1).unwrap();
    s.event_record(0, e, s1).unwrap();
    assert!(!s.event_query(e).unwrap());
    s.event_record(0, e, 0).unwrap();
    assert!(s.event_query(e).unwrap(), "idle default stream");
    // event_synchronize completes exactly the captured work.
    s.event_record(0, e, s1).unwrap();
    s.enqueue_work(0, s1).unwrap();
    s.event_synchronize(e).unwrap();
    assert!(s.event_query(e).unwrap());
    assert_eq!(s.pending_work(0, s1).unwrap(), 1);
    s.stream_synchronize(0, s1).unwrap();
    assert_eq!(s.pending_work(0, s1).unwrap(), 0);
}

#[test]
fn stream_wait_event_orders_work() {
    let s = sim(&[GIB]);
    let s1 = s.stream_create(0).unwrap();
    let s2 = s.stream_create(0).unwrap();
    let e = s.event_create(0).unwrap();
    s.enqueue_work(0, s1).unwrap();
    s.event_record(0, e, s1).unwrap();
    // Work on s2 before the wait does not depend on s1.
    s.enqueue_work(0, s2).unwrap();
    s.stream_wait_event(0, s2, e).unwrap();
    s.enqueue_work(0, s2).unwrap();
    s.enqueue_work(0, s1).unwrap(); // not captured by e
    s.complete_work(0, s2).unwrap();
    assert!(
        s.event_query(e).unwrap(),
        "s1's captured work completed first"
    );
    assert_eq!(s.pending_work(0, s1).unwrap(), 1);
    assert_eq!(s.pending_work(0, s2).unwrap(), 0);

    // Only items after the wait depend on the event.
    let f = s.event_create(0).unwrap();
    s.enqueue_work(0, s2).unwrap();
    s.event_record(0, f, s2).unwrap();
    s.enqueue_work(0, s1).unwrap();
    s.event_record(0, e, s1).unwrap();
    s.stream_wait_event(0, s2, e).unwrap();
    s.event_synchronize(f).unwrap();
    assert!(s.event_query(f).unwrap());
    assert!(
        !s.event_query(e).unwrap(),
        "s2's earlier work does not wait"
    );
    assert!(!s.stream_query(0, s2).unwrap(), "s2 still waits on e");
    s.stream_synchronize(0, s2).unwrap();
    assert!(s.event_query(e).unwrap());
    assert_eq!(s.pending_work(0, s1).unwrap(), 0);
}

#[test]
fn event_after_wait_includes_the_wait() {
    // An event recorded after a wait (with no work in between) completes only
    // after the waited-for work, as on the driver.
    let s = sim(&[GIB]);
    let s1 = s.stream_create(0).unwrap();
    let s2 = s.stream_create(0).unwrap();
    let (e1, e2) = (s.event_create(0).unwrap(), s.event_create(0).unwrap());
    s.enqueue_work(0, s1).unwrap();
    s.event_record(0, e1, s1).unwrap();
    s.stream_wait_event(0, s2, e1).unwrap();
    s.event_record(0, e2, s2).unwrap();
    assert!(!s.event_query(e2).unwrap());
    assert!(!s.stream_query(0, s2).unwrap());
    assert_eq!(s.pending_work(0, s2).unwrap(), 0);
    // Destroying e1 keeps the wait.
    s.event_destroy(e1).unwrap();
    assert!(!s.event_query(e2).unwrap());
    s.event_synchronize(e2).unwrap();
    assert_eq!(s.pending_work(0, s1).unwrap(), 0);
    assert!(s.stream_query(0, s2).unwrap());
}

#[test]
fn transitive_waits_across_devices() {
    let s = sim(&[GIB, GIB]);
    let a = s.stream_create(0).unwrap();
    let b = s.stream_create(1).unwrap();
    let ea = s.event_create(0).unwrap();
    let eb = s.event_create(1).unwrap();
    s.enqueue_work(0, a).unwrap();
    s.event_record(0, ea, a).unwrap();
    // Waiting on another device's event is allowed.
    s.stream_wait_event(1, b, ea).unwrap();
    s.enqueue_work(1, b).unwrap();
    s.event_record(1, eb, b).unwrap();
    s.stream_wait_event(0, 0, eb).unwrap();
    s.enqueue_work(0, 0).unwrap();
    assert!(!s.event_query(ea).unwrap());
    s.complete_work(0, 0).unwrap();
    assert!(s.event_query(ea).unwrap());
    assert!(s.event_query(eb).unwrap());
    assert!(s.stream_query(0, a).unwrap());
    assert!(s.stream_query(1, b).unwrap());
}

#[test]
fn synchronize_and_destroyed_streams() {
    let s = sim(&[GIB, GIB]);
    let a = s.stream_create(0).unwrap();
    let other = s.stream_create(1).unwrap();
    let e = s.event_create(0).unwrap();
    s.enqueue_work(0, a).unwrap();
    s.enqueue_work(0, 0).unwrap();
    s.enqueue_work(1, other).unwrap();
    s.event_record(0, e, a).unwrap();
    // Work of a destroyed stream still has to complete.
    s.stream_destroy(a).unwrap();
    assert!(!s.event_query(e).unwrap());
    s.synchronize(0).unwrap();
    assert!(s.event_query(e).unwrap());
    assert!(s.stream_query(0, 0).unwrap());
    assert_eq!(
        s.pending_work(1, other).unwrap(),
        1,
        "other device untouched"
    );
    // A destroyed stream's event can also be synchronized directly.
    let b = s.stream_create(1).unwrap();
    let f = s.event_create(1).unwrap();
    s.enqueue_work(1, b).unwrap();
    s.event_record(1, f, b).unwrap();
    s.stream_destroy(b).unwrap();
    s.event_synchronize(f).unwrap();
    assert!(s.event_query(f).unwrap());
}

#[test]
fn threads_share_one_sim() {
    let s = std::sync::Arc::new(sim(&[24 * GIB, 24 * GIB]));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                let dev = t % 2;
                let stream = s.stream_create(dev).unwrap();
                let event = s.event_create(dev).unwrap();
                for i in 0..200u64 {
                    let p = s.mem_alloc(dev, 1 + (i % 7) * PAGE).unwrap();
                    assert_eq!(s.device_of(p), Some(dev));
                    s.enqueue_work(dev, stream).unwrap();
                    s.event_record(dev, event, stream).unwrap();
                    if i % 3 == 0 {
                        s.event_synchronize(event).unwrap();
                        assert!(s.event_query(event).unwrap());
                    }
                    s.mem_free(p).unwrap();
                }
                s.stream_synchronize(dev, stream).unwrap();
                assert_eq!(s.pending_work(dev, stream).unwrap(), 0);
                s.stream_destroy(stream).unwrap();
                s.event_destroy(event).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(s.alloc_calls(), 800);
    assert_eq!(s.free_calls(), 800);
    assert_eq!(s.used_bytes(0) + s.used_bytes(1), 0);
    assert_eq!(s.live_allocations(0) + s.live_allocations(1), 0);
}

#[test]
fn global_instance_follows_the_environment() {
    // Only this test touches the global instance and the variable.
    let g = Sim::global();
    assert!(std::ptr::eq(g, Sim::global()));
    match std::env::var(ENV_VAR) {
        Err(_) => {
            g.init().unwrap();
            assert_eq!(g.config_error(), None);
            assert_eq!(g.total_mem(0).unwrap(), 24 * GIB);
        }
        Ok(v) => match parse_devices(&v) {
            Ok(_) => g.init().unwrap(),
            Err(_) => {
                assert_eq!(err(g.init()), CUDA_ERROR_INVALID_VALUE);
                assert!(g.config_error().is_some());
            }
        },
    }
}

#[test]
fn the_virtual_memory_variable_takes_three_values_and_refuses_others() {
    let with = |value: &'static str| {
        Sim::from_vars(&move |name| (name == "CUDA_SIM_VMM").then(|| value.into()))
            .inspect(|s| s.init().unwrap())
    };
    let full = with("1").unwrap();
    assert_eq!(full.device_attribute(0, ATTRIBUTE_VMM_SUPPORTED), Ok(1));
    assert!(full.maps_at_offsets());
    let none = with(" 0 ").unwrap();
    assert_eq!(none.device_attribute(0, ATTRIBUTE_VMM_SUPPORTED), Ok(0));
    let start_only = with("offset0").unwrap();
    assert_eq!(
        start_only.device_attribute(0, ATTRIBUTE_VMM_SUPPORTED),
        Ok(1)
    );
    assert!(!start_only.maps_at_offsets());
    assert_eq!(
        with("yes").err().unwrap(),
        "CUDA_SIM_VMM=\"yes\": use 0 (no virtual-memory API), offset0 (cuMemMap only from an \
         allocation's start) or 1 (the API in full, the default)"
    );
}

#[test]
fn malformed_configuration_fails_init() {
    let s = Sim {
        config_error: Some("bad".into()),
        ..Sim::new(&[])
    };
    assert_eq!(err(s.init()), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(s.config_error(), Some("bad"));
    assert_eq!(err(s.device_count()), CUDA_ERROR_NOT_INITIALIZED);
}

// ----- injected faults -----

#[test]
fn fault_syntax_parses_every_form_and_rejects_the_rest() {
    let faults = Fault::parse_list(
        " cuMemAlloc_v2@3=2, cuEventRecord@5+=CUDA_ERROR_LAUNCH_FAILED ,cuInit=999,",
    )
    .unwrap();
    assert_eq!(
        faults,
        vec![
            Fault::once(Call::MemAlloc, 3, CUDA_ERROR_OUT_OF_MEMORY),
            Fault::from_nth(Call::EventRecord, 5, CUDA_ERROR_LAUNCH_FAILED),
            Fault::from_nth(Call::Init, 1, CUDA_ERROR_UNKNOWN),
        ]
    );
    assert_eq!(faults[1].to_string(), "cuEventRecord@5+=719");
    for (bad, needle) in [
        ("cuMemAlloc_v2@3", "not NAME@N=CODE"),
        ("cuMalloc@1=2", "not a driver function"),
        ("cuMemAlloc_v2@0=2", "not a call number"),
        ("cuMemAlloc_v2@x=2", "not a call number"),
        ("cuMemAlloc_v2@1=CUDA_ERROR_NOPE", "not a CUresult"),
        ("cuMemAlloc_v2@1=0", "cannot return CUDA_SUCCESS"),
    ] {
        let err = Fault::parse_list(bad).unwrap_err();
        assert!(err.contains(needle), "{bad}: {err}");
    }
    for call in Call::ALL {
        assert_eq!(Call::from_name(call.name()), Some(*call));
    }
}

#[test]
fn a_fault_fails_exactly_the_nth_call_and_changes_nothing() {
    let sim = Sim::new(&[8 * PAGE]);
    sim.init().unwrap();
    let first = sim.mem_alloc(0, PAGE).unwrap();
    sim.inject_fault(Fault::once(Call::MemAlloc, 2, CUDA_ERROR_LAUNCH_FAILED));
    sim.mem_alloc(0, PAGE).unwrap();
    assert_eq!(
        sim.mem_alloc(0, PAGE).unwrap_err(),
        CuError(CUDA_ERROR_LAUNCH_FAILED)
    );
    assert_eq!(sim.used_bytes(0), 2 * PAGE);
    let third = sim.mem_alloc(0, PAGE).unwrap();
    assert_eq!(sim.allocations(0).len(), 3);
    assert_eq!(sim.allocations(0)[0], (first, PAGE));
    assert_eq!(sim.call_count(Call::MemAlloc), 4);
    assert_eq!(sim.injected_failures(), 1);
    sim.mem_free(third).unwrap();
}

#[test]
fn a_repeating_fault_fails_every_call_until_cleared() {
    let sim = Sim::new(&[8 * PAGE]);
    sim.init().unwrap();
    sim.inject_faults("cuEventRecord@2+=719,cuEventRecord@1=1")
        .unwrap();
    let event = sim.event_create(0).unwrap();
    // The first call trips the second fault; the later ones the first.
    assert_eq!(
        sim.event_record(0, event, 0).unwrap_err(),
        CuError(CUDA_ERROR_INVALID_VALUE)
    );
    for _ in 0..3 {
        assert_eq!(
            sim.event_record(0, event, 0).unwrap_err(),
            CuError(CUDA_ERROR_LAUNCH_FAILED)
        );
    }
    assert_eq!(sim.injected_failures(), 4);
    sim.clear_faults();
    sim.event_record(0, event, 0).unwrap();
    assert_eq!(sim.call_count(Call::EventRecord), 5);
    // A malformed list injects nothing.
    assert!(sim.inject_faults("cuEventRecord@1=1,bogus").is_err());
    sim.event_record(0, event, 0).unwrap();
}

#[test]
fn test_helpers_are_not_driver_calls() {
    let sim = Sim::new(&[8 * PAGE]);
    sim.init().unwrap();
    sim.inject_faults("cuStreamSynchronize=1,cuDeviceGetCount=1")
        .unwrap();
    sim.enqueue_work(0, 0).unwrap();
    sim.complete_work(0, 0).unwrap();
    assert_eq!(sim.initialized_device_count(), Ok(1));
    assert_eq!(sim.device_count(), Err(CuError(CUDA_ERROR_INVALID_VALUE)));
    assert_eq!(sim.call_count(Call::StreamSynchronize), 0);
}

#[test]
fn uuids_are_shared_by_name_and_unique_otherwise() {
    let dir = std::env::temp_dir().join(format!("cuda-sim-uuid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let name = dir.join("capacity").to_string_lossy().into_owned();
    let _ = std::fs::remove_file(&name);
    let sims: Vec<Sim> = (0..3).map(|_| Sim::new(&[4 * PAGE, 4 * PAGE])).collect();
    for sim in &sims {
        sim.init().unwrap();
    }
    let uuid = |sim: &Sim, dev| sim.device_uuid(dev).unwrap();
    // Unshared: every instance and device has its own.
    assert_ne!(uuid(&sims[0], 0), uuid(&sims[1], 0));
    assert_ne!(uuid(&sims[0], 0), uuid(&sims[0], 1));
    sims[0].share_capacity(&name).unwrap();
    sims[1].share_capacity(&name).unwrap();
    assert_eq!(uuid(&sims[0], 0), uuid(&sims[1], 0));
    assert_eq!(uuid(&sims[0], 1), uuid(&sims[1], 1));
    assert_ne!(uuid(&sims[0], 0), uuid(&sims[0], 1));
    assert_ne!(uuid(&sims[0], 0), uuid(&sims[2], 0));
    assert_eq!(
        sims[0].device_uuid(2).unwrap_err().0,
        codes::CUDA_ERROR_INVALID_DEVICE
    );
    // Shared capacity: what one uses, the other cannot.
    let p = sims[0].mem_alloc(0, 3 * PAGE).unwrap();
    assert_eq!(sims[1].mem_get_info(0).unwrap(), (PAGE, 4 * PAGE));
    assert_eq!(
        sims[1].mem_alloc(0, 2 * PAGE).unwrap_err().0,
        codes::CUDA_ERROR_OUT_OF_MEMORY
    );
    sims[0].mem_free(p).unwrap();
    let q = sims[1].mem_alloc(0, 4 * PAGE).unwrap();
    assert_eq!(sims[0].mem_get_info(0).unwrap(), (0, 4 * PAGE));
    // Virtual-memory physical allocations count too.
    assert_eq!(
        sims[0].mem_create(0, GRANULARITY).unwrap_err().0,
        codes::CUDA_ERROR_OUT_OF_MEMORY
    );
    sims[1].mem_free(q).unwrap();
    let h = sims[0].mem_create(0, GRANULARITY).unwrap();
    assert_eq!(sims[1].mem_get_info(0).unwrap().0, 4 * PAGE - GRANULARITY);
    sims[0].mem_release(h).unwrap();
    assert_eq!(sims[1].mem_get_info(0).unwrap().0, 4 * PAGE);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A delayed call takes its time outside the simulator's lock: another thread's calls go on
/// meanwhile, and the delayed one returns after its time.
#[test]
fn a_delayed_call_takes_its_time_without_holding_the_other_calls() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let sim = Arc::new(Sim::new(&[8 * PAGE]));
    sim.init().unwrap();
    sim.set_delays("cuCtxSynchronize=2000ms").unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let waiter = {
        let (sim, done) = (sim.clone(), done.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            sim.synchronize(0).unwrap();
            done.store(true, Ordering::SeqCst);
            start.elapsed()
        })
    };
    // Inside the delay (the thread had time to begin it), calls go on.
    std::thread::sleep(Duration::from_millis(200));
    let ptr = sim.mem_alloc(0, PAGE).unwrap();
    sim.mem_free(ptr).unwrap();
    assert!(
        !done.load(Ordering::SeqCst),
        "the allocation waited for the delayed call"
    );
    assert!(waiter.join().unwrap() >= Duration::from_millis(2000));
    sim.set_delay(Call::CtxSynchronize, Duration::ZERO);
    assert!(sim.set_delays("cuCtxSynchronize=soon").is_err());
}

#[test]
fn the_legacy_handle_is_the_default_stream_and_the_per_thread_handle_each_threads_own() {
    let s = sim(&[4 * PAGE]);
    s.init().unwrap();
    s.enqueue_work(0, CU_STREAM_LEGACY).unwrap();
    assert_eq!(s.pending_work(0, 0).unwrap(), 1, "one stream, two names");
    s.enqueue_work(0, CU_STREAM_PER_THREAD).unwrap();
    assert_eq!(s.pending_work(0, CU_STREAM_PER_THREAD).unwrap(), 1);
    assert_eq!(s.pending_work(0, 0).unwrap(), 1, "not the default stream");
    let e = s.event_create(0).unwrap();
    s.event_record(0, e, CU_STREAM_PER_THREAD).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // Another thread's per-thread stream: none of the first thread's work.
            assert_eq!(s.pending_work(0, CU_STREAM_PER_THREAD).unwrap(), 0);
            // Made to wait for the first thread's event, its work completes that work first.
            s.stream_wait_event(0, CU_STREAM_PER_THREAD, e).unwrap();
            s.enqueue_work(0, CU_STREAM_PER_THREAD).unwrap();
            s.complete_work(0, CU_STREAM_PER_THREAD).unwrap();
        });
    });
    assert_eq!(s.pending_work(0, CU_STREAM_PER_THREAD).unwrap(), 0);
    assert_eq!(
        s.pending_work(0, 0).unwrap(),
        1,
        "the default stream's work is its own"
    );
    assert_eq!(
        err(s.pending_work(1, CU_STREAM_PER_THREAD)),
        CUDA_ERROR_INVALID_DEVICE
    );
}
