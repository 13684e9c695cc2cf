//! Reserves while a stream captures a CUDA graph (`Pool::reserve_no_wait`, `rm_reserve_no_wait`):
//! the driver refuses a wait for the device's work or for an event recorded outside the capture
//! (the simulator as the driver does, `cuda-sim`'s capture module), and the refusal invalidates
//! the capture. `reserve` makes such waits where another stream's cache is reused; a no-wait
//! reserve never does, with classic segments and stitched ones alike, and the books stay exact.

use std::sync::Arc;

use cuda_sim::codes::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
use cuda_sim::{Call, Sim};
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Pool, PoolConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn pool(vmm: bool) -> (&'static Sim, Pool) {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[4 * GIB])));
    let config = PoolConfig {
        vmm,
        ..PoolConfig::default()
    };
    let pool = Pool::new(Arc::new(SimDriver::new(sim).unwrap()), config);
    (sim, pool)
}

/// A 64 MiB block reserved and released on stream `a` while work queued on `a` may still use
/// it: an idle segment of `a`, not settled.
fn idle_on(sim: &Sim, pool: &Pool, a: u64) {
    let p = pool.reserve(0, 64 * MIB, a).unwrap();
    sim.enqueue_work(0, a).unwrap();
    pool.release(p).unwrap();
}

/// `pool.reserve(0, size, c)` while `c` captures: it fails with the driver's refusal (its
/// message naming `code`), and the capture is invalidated with it.
fn refused_during_capture(sim: &Sim, pool: &Pool, c: u64, size: u64, code: &str) {
    sim.stream_begin_capture(0, c).unwrap();
    let e = pool.reserve(0, size, c).unwrap_err();
    assert!(e.message.contains(code), "{}", e.message);
    assert_eq!(
        sim.stream_end_capture(0, c).unwrap_err().0,
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    );
}

/// `pool.reserve_no_wait(0, size, c)` while `c` captures; the capture ends cleanly.
fn no_wait_during_capture(sim: &Sim, pool: &Pool, c: u64, size: u64) -> resmem::Result<u64> {
    sim.stream_begin_capture(0, c).unwrap();
    let reserved = pool.reserve_no_wait(0, size, c);
    sim.stream_end_capture(0, c).unwrap();
    reserved
}

#[test]
fn a_reserve_during_a_capture_takes_no_cache_that_needs_a_wait() {
    for vmm in [false, true] {
        let (sim, pool) = pool(vmm);
        let (a, c) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
        idle_on(sim, &pool, a);
        assert_eq!(sim.used_bytes(0), 64 * MIB);

        // The usual reserve orders the capturing stream after `a`'s work: refused, and the
        // capture with it.
        refused_during_capture(sim, &pool, c, 64 * MIB, "CUDA_ERROR_STREAM_CAPTURE");
        pool.check().unwrap();

        // Without waits: new memory, the capture intact.
        let p = no_wait_during_capture(sim, &pool, c, 64 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 128 * MIB, "vmm {vmm}");
        let s = pool.stats(0).unwrap();
        assert_eq!((s.allocated_bytes, s.reserved_bytes), (64 * MIB, 128 * MIB));
        // Its own stream's cache is taken as usual.
        pool.release(p).unwrap();
        let q = no_wait_during_capture(sim, &pool, c, 64 * MIB).unwrap();
        assert_eq!(q, p, "vmm {vmm}");
        assert_eq!(sim.used_bytes(0), 128 * MIB, "vmm {vmm}");
        pool.release(q).unwrap();
        pool.check().unwrap();
        assert_eq!(pool.free_reusable(None).unwrap(), 128 * MIB);
        assert_eq!(sim.used_bytes(0), 0);
    }
}

#[test]
fn a_reserve_during_a_capture_leaves_blocks_pending_on_other_streams_alone() {
    for vmm in [false, true] {
        let (sim, pool) = pool(vmm);
        let (b, c) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
        // A block of the capturing stream's, used on `b` too: pending on `b`'s work once
        // released, which the usual reserve asks after (`cuEventQuery`).
        let shared = pool.reserve(0, MIB, c).unwrap();
        pool.record_stream(shared, b).unwrap();
        sim.enqueue_work(0, b).unwrap();
        pool.release(shared).unwrap();
        refused_during_capture(sim, &pool, c, MIB, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED");
        let p = no_wait_during_capture(sim, &pool, c, MIB).unwrap();
        assert_ne!(p, shared, "vmm {vmm}: the pending block is not ready");
        pool.release(p).unwrap();
        sim.complete_work(0, b).unwrap();
        pool.check().unwrap();
        assert_eq!(pool.stats(0).unwrap().allocated_bytes, 0);
    }
}

#[test]
fn without_waits_the_cache_is_not_returned_to_make_room() {
    for vmm in [false, true] {
        let (sim, pool) = pool(vmm);
        let (a, c) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
        idle_on(sim, &pool, a);
        pool.set_memory_limit(Some(0), Some(96 * MIB)).unwrap();
        let e = no_wait_during_capture(sim, &pool, c, 64 * MIB).unwrap_err();
        assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY, "{}", e.message);
        assert!(
            e.message.contains("memory limit of 96.00 MiB"),
            "{}",
            e.message
        );
        assert_eq!(
            sim.used_bytes(0),
            64 * MIB,
            "vmm {vmm}: the idle segment stays"
        );
        // After the capture, the usual reserve returns it and grows.
        pool.reserve(0, 64 * MIB, c).unwrap();
        assert_eq!(sim.used_bytes(0), 64 * MIB, "vmm {vmm}");
        pool.check().unwrap();
    }
}

#[test]
fn a_settled_idle_segment_of_another_stream_is_taken_without_a_wait() {
    let (sim, pool) = pool(false);
    let (a, c) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    // Two idle segments of `a`, their work queued.
    let (p, q) = (
        pool.reserve(0, 64 * MIB, a).unwrap(),
        pool.reserve(0, 64 * MIB, a).unwrap(),
    );
    sim.enqueue_work(0, a).unwrap();
    pool.release(p).unwrap();
    pool.release(q).unwrap();
    // Under a cap, a 96 MiB request returns one of them, waiting for the device first: the
    // other is settled then.
    pool.set_memory_limit(Some(0), Some(160 * MIB)).unwrap();
    let big = pool.reserve(0, 96 * MIB, a).unwrap();
    assert_eq!(sim.used_bytes(0), 160 * MIB);
    pool.set_memory_limit(Some(0), None).unwrap();
    let waits = sim.call_count(Call::StreamWaitEvent) + sim.call_count(Call::EventRecord);
    let r = no_wait_during_capture(sim, &pool, c, 64 * MIB).unwrap();
    assert!(r == p || r == q);
    assert_eq!(sim.used_bytes(0), 160 * MIB, "no new memory");
    assert_eq!(
        sim.call_count(Call::StreamWaitEvent) + sim.call_count(Call::EventRecord),
        waits,
        "no event ordered the capturing stream"
    );
    pool.release(r).unwrap();
    pool.release(big).unwrap();
    pool.check().unwrap();
}
