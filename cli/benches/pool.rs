//! The pool's speed through the C ABI, against references measured in the same run:
//! - a cache-hit `rm_reserve` + `rm_release` pair by size class, with 0, 1k, 10k and 100k other
//!   blocks cached (the cost must not grow with the cache), next to glibc's `malloc` + `free`
//!   of the same size and the PyTorch-policy baseline's pair;
//! - the same pairs from 2 threads on 2 streams at once;
//! - `rm_mem_get_info` against the bare simulated driver call it adds to;
//! - stitching (`vmm:true`): a 1 GiB segment from twelve cached 64 MiB holes, against creating it
//!   afresh with classic segments (one `cuMemAlloc`), both on a simulated driver.
//!
//! Everything runs on simulated devices (`RESMEM_DRIVER=sim`, 80 GiB), set before the first
//! call. Run: `cargo bench -p resmem-cli --bench pool` (or `scripts/benchmarks.py` for BENCHMARKS.md).

use std::ffi::c_void;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cuda_sim::Sim;
use resmem::capi::{rm_mem_get_info, rm_release, rm_reserve};
use resmem::driver::sim::SimDriver;
use resmem::error::rm_status;
use resmem_cli::allocator::Allocator;
use resmem_cli::baseline::{TorchAllocator, TorchConfig};

const SIZES: [(usize, &str); 4] = [
    (512, "512B"),
    (64 << 10, "64KiB"),
    (4 << 20, "4MiB"),
    (64 << 20, "64MiB"),
];
const CACHED: [usize; 4] = [0, 1_000, 10_000, 100_000];

fn setup_env() {
    // Called at the start of main's benchmark functions, before any thread
    // is spawned and before the pool reads the environment on its first call.
    std::env::set_var("RESMEM_DRIVER", "sim");
    std::env::set_var("CUDA_SIM_DEVICES", "80GiB");
}

fn capi_reserve(size: usize, stream: u64) -> u64 {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the call.
    let status = unsafe { rm_reserve(0, size, stream as *mut c_void, &mut p) };
    assert_eq!(status, rm_status::RM_SUCCESS);
    p as u64
}

fn capi_release(p: u64) {
    // SAFETY: `p` came from rm_reserve and is released once.
    let status = unsafe { rm_release(p as *mut c_void) };
    assert_eq!(status, rm_status::RM_SUCCESS);
}

/// The size of the `i`-th other cached block: 90% small (up to 128 KiB), 10% large.
fn other_size(i: usize) -> usize {
    if i % 10 == 9 {
        (1 << 20) + 512 * (1 + i % 1024)
    } else {
        512 * (1 + i % 256)
    }
}

/// Add cached blocks `from..to`: reserve each with a live 512-byte fence after it (so that
/// released neighbours do not merge), then release them all.
fn add_cached(
    reserve: &mut dyn FnMut(usize) -> u64,
    release: &mut dyn FnMut(u64),
    from: usize,
    to: usize,
) {
    let mut others = Vec::with_capacity(to - from);
    for i in from..to {
        others.push(reserve(other_size(i)));
        let _fence = reserve(512);
    }
    for p in others {
        release(p);
    }
}

fn torch_baseline() -> &'static TorchAllocator {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[80 << 30])));
    let driver = SimDriver::new(sim).expect("the simulated device starts");
    Box::leak(Box::new(
        TorchAllocator::new(Arc::new(driver), TorchConfig::default()).expect("valid config"),
    ))
}

fn glibc_pair(size: usize) {
    // SAFETY: malloc of a non-zero size; the result is freed once (free(NULL) is allowed).
    unsafe {
        let p = libc::malloc(size);
        black_box(p);
        libc::free(p);
    }
}

fn pairs(c: &mut Criterion) {
    setup_env();
    let torch = torch_baseline();
    let mut have = 0;
    for cached in CACHED {
        add_cached(&mut |s| capi_reserve(s, 0), &mut capi_release, have, cached);
        add_cached(
            &mut |s| torch.reserve(0, s as u64, 0).unwrap(),
            &mut |p| torch.release(p).unwrap(),
            have,
            cached,
        );
        have = cached;
        let mut group = c.benchmark_group(format!("pair/{cached}-cached"));
        for (size, name) in SIZES {
            capi_release(capi_reserve(size, 0)); // now cached
            torch
                .release(torch.reserve(0, size as u64, 0).unwrap())
                .unwrap();
            group.bench_function(BenchmarkId::new("resmem", name), |b| {
                b.iter(|| capi_release(capi_reserve(black_box(size), 0)))
            });
            group.bench_function(BenchmarkId::new("torch", name), |b| {
                b.iter(|| {
                    torch
                        .release(torch.reserve(0, black_box(size) as u64, 0).unwrap())
                        .unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("glibc", name), |b| {
                b.iter(|| glibc_pair(black_box(size)))
            });
        }
        group.finish();
    }
}

/// `iters` pairs on each of 2 threads at once; the wall time per pair.
fn two_threads(iters: u64, pair: Arc<dyn Fn(usize) + Send + Sync>) -> Duration {
    let barrier = Arc::new(Barrier::new(3));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let (barrier, pair) = (barrier.clone(), pair.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..iters {
                    pair(t);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for t in threads {
        t.join().expect("bench thread");
    }
    start.elapsed()
}

fn pairs_two_threads(c: &mut Criterion) {
    setup_env();
    let sim = Sim::global();
    let streams = [sim.stream_create(0).unwrap(), sim.stream_create(0).unwrap()];
    let torch = torch_baseline();
    let mut group = c.benchmark_group("pair-2-threads");
    for (size, name) in SIZES {
        for &s in &streams {
            capi_release(capi_reserve(size, s));
            torch
                .release(torch.reserve(0, size as u64, s).unwrap())
                .unwrap();
        }
        group.bench_function(BenchmarkId::new("resmem", name), |b| {
            b.iter_custom(|iters| {
                two_threads(
                    iters,
                    Arc::new(move |t| capi_release(capi_reserve(black_box(size), streams[t]))),
                )
            })
        });
        group.bench_function(BenchmarkId::new("torch", name), |b| {
            b.iter_custom(|iters| {
                two_threads(
                    iters,
                    Arc::new(move |t| {
                        torch
                            .release(
                                torch
                                    .reserve(0, black_box(size) as u64, streams[t])
                                    .unwrap(),
                            )
                            .unwrap()
                    }),
                )
            })
        });
        group.bench_function(BenchmarkId::new("glibc", name), |b| {
            b.iter_custom(|iters| {
                two_threads(iters, Arc::new(move |_| glibc_pair(black_box(size))))
            })
        });
    }
    group.finish();
}

fn mem_get_info(c: &mut Criterion) {
    setup_env();
    let torch = torch_baseline();
    let (mut free, mut total) = (0usize, 0usize);
    let mut group = c.benchmark_group("mem_get_info");
    group.bench_function("resmem", |b| {
        b.iter(|| {
            // SAFETY: both out-pointers are valid.
            let status = unsafe { rm_mem_get_info(black_box(0), &mut free, &mut total) };
            assert_eq!(status, rm_status::RM_SUCCESS);
        })
    });
    group.bench_function("sim-driver", |b| {
        b.iter(|| Sim::global().mem_get_info(black_box(0)).unwrap())
    });
    group.bench_function("torch", |b| {
        b.iter(|| torch.mem_get_info(black_box(0)).unwrap())
    });
    group.finish();
}

/// A pool over a fresh 2 GiB simulated device. With `holes`, a 1.5 GiB warm-up split into 24
/// blocks of 64 MiB, every other one released: 768 MiB of free memory in twelve pieces, and
/// 512 MiB left on the driver, so a 1 GiB request must be built from the holes.
fn two_gib_device(vmm: bool, holes: bool) -> resmem::Pool {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[2 << 30])));
    let driver = Arc::new(SimDriver::new(sim).expect("the simulator starts"));
    let config = resmem::PoolConfig {
        vmm,
        ..resmem::PoolConfig::default()
    };
    let pool = resmem::Pool::new(driver, config);
    if holes {
        pool.warmup(0, 1536 << 20).unwrap();
        for i in 0..24 {
            let p = pool.reserve(0, 64 << 20, 0).unwrap();
            if i % 2 == 0 {
                pool.release(p).unwrap();
            }
        }
    }
    pool
}

/// A 1 GiB segment: mapped from twelve 64 MiB holes plus one new 256 MiB handle (the default),
/// against a fresh 1 GiB segment on an empty device, with the virtual-memory API and with
/// `cuMemAlloc`. (Classic segments cannot serve the request from the holes at all.)
fn stitch(c: &mut Criterion) {
    let mut group = c.benchmark_group("stitch-1GiB");
    group.sample_size(10);
    for (name, vmm, holes) in [
        ("resmem-vmm-from-holes", true, true),
        ("resmem-vmm-fresh", true, false),
        ("resmem-classic-fresh", false, false),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || two_gib_device(vmm, holes),
                |pool| {
                    let p = pool.reserve(0, 1 << 30, 0).unwrap();
                    black_box(p);
                    pool
                },
                criterion::BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// A pool over a fresh simulated device holding `n` free 4 MiB blocks, each between two live
/// ones (so none merges), and no larger free block: what a long run leaves cached.
fn free_blocks_device(n: usize) -> resmem::Pool {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[4 << 40])));
    let driver = Arc::new(SimDriver::new(sim).expect("the simulator starts"));
    let pool = resmem::Pool::new(driver, resmem::PoolConfig::default());
    let blocks: Vec<u64> = (0..2 * n + 1)
        .map(|_| pool.reserve(0, 4 << 20, 0).unwrap())
        .collect();
    for p in blocks.iter().skip(1).step_by(2) {
        pool.release(*p).unwrap();
    }
    // The growth headroom's free tails, taken, so that only the 4 MiB blocks are left.
    loop {
        let largest = pool.stats(0).unwrap().largest_reusable_block;
        if largest <= 4 << 20 {
            break;
        }
        pool.reserve(0, largest, 0).unwrap();
    }
    // A cap 4 GiB above what it reserves: the next growth's headroom (which grows with what the
    // pool reserves) is then alike for every `n`, and so is the work of booking its range.
    let reserved = pool.stats(0).unwrap().reserved_bytes;
    pool.set_memory_limit(Some(0), Some(reserved + (4 << 30)))
        .unwrap();
    pool
}

/// A 1 GiB request the cache cannot cover (the default creates it), with 1,000 and 100,000
/// free 4 MiB blocks cached: the search for pieces to map again looks at a bounded number of
/// them, so the growth should cost the same with both.
fn growth_among_free_blocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("growth-among-free-blocks");
    group.sample_size(10);
    for n in [1_000, 100_000] {
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_batched(
                || free_blocks_device(n),
                |pool| {
                    black_box(pool.reserve(0, 1 << 30, 0).unwrap());
                    pool
                },
                criterion::BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_millis(1500))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = pairs, pairs_two_threads, mem_get_info, stitch, growth_among_free_blocks
}
criterion_main!(benches);
