//! Streams and events: reuse on a block's own stream, reuse across streams ordered after the old
//! stream's work, `record_stream`, and blocks pending on other streams' work.

use super::*;

#[test]
fn a_block_is_reused_on_its_own_stream_at_once() {
    let (pool, sim) = pool(24 * GIB);
    let s1 = sim.stream_create(0).unwrap();
    let p = pool.reserve(0, 4096, s1).unwrap();
    sim.enqueue_work(0, s1).unwrap();
    pool.release(p).unwrap();
    assert_eq!(
        pool.reserve(0, 4096, s1).unwrap(),
        p,
        "stream order makes it safe"
    );
}

#[test]
fn another_stream_gets_an_idle_segment_ordered_after_the_old_streams_work() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let p = pool.reserve(0, 8 * MIB, s1).unwrap();
    sim.enqueue_work(0, s1).unwrap(); // a kernel still using p
    pool.release(p).unwrap();
    let q = pool.reserve(0, 8 * MIB, s2).unwrap();
    assert_eq!(q, p, "the idle segment moved to s2");
    assert_eq!(pool.stats(0).unwrap().driver_allocs, 1);
    // Work queued on s2 now cannot finish before s1's kernel.
    sim.enqueue_work(0, s2).unwrap();
    assert_eq!(sim.pending_work(0, s1).unwrap(), 1);
    sim.complete_work(0, s2).unwrap();
    assert_eq!(sim.pending_work(0, s1).unwrap(), 0, "s2 waited for s1");
    assert_books(&pool, sim);
}

#[test]
fn a_partly_used_segment_of_another_stream_is_not_shared() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let _held = pool.reserve(0, 4096, s1).unwrap();
    pool.reserve(0, 4096, s2).unwrap();
    assert_eq!(pool.stats(0).unwrap().segments, 2);
}

#[test]
fn record_stream_holds_a_block_until_that_streams_work_is_done() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let _fence = pool.reserve(0, 512, s1).unwrap();
    let p = pool.reserve(0, 4096, s1).unwrap();
    pool.record_stream(p, s2).unwrap();
    pool.record_stream(p, s1).unwrap(); // its own stream: nothing to wait for
    sim.enqueue_work(0, s2).unwrap();
    pool.release(p).unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes, s.live_blocks),
        (512, 1),
        "released at once in the books"
    );
    let q = pool.reserve(0, 4096, s1).unwrap();
    assert_ne!(q, p, "s2 may still be using it");
    pool.check().unwrap();
    sim.complete_work(0, s2).unwrap();
    let r = pool.reserve(0, 4096, s1).unwrap();
    assert_eq!(r, p, "reusable once s2's work completed");
    assert_books(&pool, sim);
}

#[test]
fn free_reusable_waits_for_pending_blocks() {
    let (pool, sim) = pool(24 * GIB);
    let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
    let p = pool.reserve(0, 4 * MIB, s1).unwrap();
    pool.record_stream(p, s2).unwrap();
    sim.enqueue_work(0, s2).unwrap();
    pool.release(p).unwrap();
    assert_eq!(pool.free_reusable(Some(0)).unwrap(), 20 * MIB);
    assert_eq!(
        sim.pending_work(0, s2).unwrap(),
        0,
        "the host waited for s2"
    );
    assert_books(&pool, sim);
}

#[test]
fn a_dropped_pool_gives_its_events_back() {
    use cuda_sim::Call;
    for (config, pending) in [
        (classic(), false),
        (classic(), true),
        (PoolConfig::default(), false),
        (PoolConfig::default(), true),
    ] {
        let (pool, sim) = pool_with(&[24 * GIB], config);
        let (s1, s2) = (sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap());
        // An idle segment moving to another stream: one event, spare afterwards.
        let p = pool.reserve(0, 8 * MIB, s1).unwrap();
        sim.enqueue_work(0, s1).unwrap();
        pool.release(p).unwrap();
        let q = pool.reserve(0, 8 * MIB, s2).unwrap();
        if pending {
            // A block pending on another stream's work takes the spare event.
            pool.record_stream(q, s1).unwrap();
            pool.release(q).unwrap();
        }
        assert_eq!(sim.call_count(Call::EventCreate), 1);
        assert_eq!(sim.call_count(Call::EventDestroy), 0);
        drop(pool);
        assert_eq!(sim.call_count(Call::EventDestroy), 1);
        if pending {
            // Nothing was live: all its memory went back too.
            assert_eq!(sim.used_bytes(0), 0);
        }
    }
}

#[test]
fn a_dropped_pool_gives_its_cache_back_and_keeps_what_is_live() {
    for config in [classic(), PoolConfig::default()] {
        let (pool, sim) = pool_with(&[24 * GIB], config);
        let live = pool.reserve(0, 8 * MIB, 0).unwrap();
        let holding = sim.used_bytes(0);
        let cached = pool.reserve(0, 256 * MIB, 0).unwrap();
        pool.release(cached).unwrap();
        assert!(sim.used_bytes(0) >= holding + 256 * MIB);
        drop(pool);
        // The live block's segment stays: its user may still use it.
        assert_eq!(sim.used_bytes(0), holding, "{config:?}");
        let _ = live;
    }
}
