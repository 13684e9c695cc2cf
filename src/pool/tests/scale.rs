//! Many blocks and many threads: a hundred thousand cached blocks, and threads sharing the pool.

use super::*;

#[test]
fn a_hundred_thousand_cached_blocks_keep_working() {
    let (pool, sim) = pool(24 * GIB);
    let ptrs: Vec<u64> = (0..100_000u64)
        .map(|i| pool.reserve(0, 512 * (1 + i % 7), 0).unwrap())
        .collect();
    // Release every other block: 50k cached fragments that cannot merge.
    for &p in ptrs.iter().step_by(2) {
        pool.release(p).unwrap();
    }
    pool.check().unwrap();
    for i in 0..1000u64 {
        let p = pool.reserve(0, 512 * (1 + i % 7), 0).unwrap();
        pool.release(p).unwrap();
    }
    for &p in ptrs.iter().skip(1).step_by(2) {
        pool.release(p).unwrap();
    }
    let s = pool.stats(0).unwrap();
    assert_eq!(s.allocated_bytes, 0);
    assert_eq!(s.largest_reusable_block, MIB);
    pool.free_reusable(Some(0)).unwrap();
    assert_eq!(sim.used_bytes(0), 0);
    assert_books(&pool, sim);
}

#[test]
fn threads_share_the_pool_and_release_each_others_blocks() {
    let (pool, sim) = pool_with(&[8 * GIB, 8 * GIB], classic());
    let pool = Arc::new(pool);
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (pool, tx, rx) = (pool.clone(), tx.clone(), rx.clone());
            std::thread::spawn(move || {
                for i in 0..5_000u64 {
                    let size = 512 + (i * 7919 + t * 31) % (3 * MIB);
                    let p = pool.reserve((i % 2) as i32, size, 0).unwrap();
                    tx.send(p).unwrap();
                    if let Ok(q) = rx.lock().unwrap().try_recv() {
                        pool.release(q).unwrap();
                    }
                }
            })
        })
        .collect();
    drop(tx);
    for h in handles {
        h.join().unwrap();
    }
    while let Ok(q) = rx.lock().unwrap().try_recv() {
        pool.release(q).unwrap();
    }
    for d in 0..2 {
        assert_eq!(pool.stats(d).unwrap().allocated_bytes, 0);
    }
    assert_books(&pool, sim);
    pool.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0) + sim.used_bytes(1), 0);
}
