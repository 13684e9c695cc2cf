//! What recording (`RESMEM_CONF=record:PATH`) adds to a cache-hit `rm_reserve` + `rm_release`
//! pair through the C ABI, measured against the unrecorded pair in the same run.
//!
//! The recorded pair is the C ABI pair plus exactly the recorder calls its hooks make (the
//! `alloc` line after the reserve, the release run under the recorder's lock and its `free`
//! line), into a recorder writing to `/dev/null`, so that the batches' `write(2)` calls are
//! paid but the disk is not filled. Run: `cargo bench -p resmem-cli --bench record`.
//!
//! In a loop of nothing but pairs, the writer thread, which formats two lines per pair, sets
//! the pace as soon as it has no core of its own. The `bursts` figures time the calling thread
//! alone: bursts of pairs too short to fill a thread's ring, each followed by an untimed flush
//! (for both the plain and the recorded pair), which is what a program sees whose allocator
//! calls leave the writer time to catch up.

use std::ffi::c_void;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use resmem::capi::{rm_release, rm_reserve};
use resmem::error::rm_status;
use resmem::record::Recorder;

const SIZES: [(usize, &str); 2] = [(512, "512B"), (4 << 20, "4MiB")];

/// Pairs per burst: 800 recorded calls, fewer than the half ring (1024) that wakes the writer.
const BURST: u64 = 400;

fn capi_reserve(size: usize) -> u64 {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the call.
    let status = unsafe { rm_reserve(0, size, std::ptr::null_mut(), &mut p) };
    assert_eq!(status, rm_status::RM_SUCCESS);
    p as u64
}

fn capi_release(p: u64) {
    // SAFETY: `p` came from rm_reserve and is released once.
    let status = unsafe { rm_release(p as *mut c_void) };
    assert_eq!(status, rm_status::RM_SUCCESS);
}

/// `iters` runs of `pair`, timed in bursts of [`BURST`] with an untimed flush after each.
fn in_bursts(iters: u64, recorder: &Recorder, mut pair: impl FnMut()) -> Duration {
    let mut timed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BURST);
        let start = Instant::now();
        for _ in 0..n {
            pair();
        }
        timed += start.elapsed();
        recorder.flush();
        left -= n;
    }
    timed
}

fn recorded_pair(recorder: &Recorder, size: usize) {
    let p = capi_reserve(black_box(size));
    recorder.alloc(0, size as u64, 0, p);
    recorder
        .release(p, || {
            capi_release(p);
            Ok(())
        })
        .unwrap();
}

fn pairs(c: &mut Criterion) {
    // Before the first call, with no thread spawned yet: the pool reads these once.
    std::env::set_var("RESMEM_DRIVER", "sim");
    std::env::set_var("CUDA_SIM_DEVICES", "80GiB");
    std::env::remove_var("RESMEM_CONF");
    let recorder = Recorder::open("/dev/null", Some(80 << 30)).expect("open /dev/null");
    let mut group = c.benchmark_group("record");
    for (size, name) in SIZES {
        capi_release(capi_reserve(size)); // now cached
        group.bench_function(BenchmarkId::new("pair", name), |b| {
            b.iter(|| capi_release(capi_reserve(black_box(size))))
        });
        group.bench_function(BenchmarkId::new("pair-recorded", name), |b| {
            b.iter(|| recorded_pair(&recorder, size))
        });
        group.bench_function(BenchmarkId::new("pair-bursts", name), |b| {
            b.iter_custom(|iters| {
                in_bursts(iters, &recorder, || {
                    capi_release(capi_reserve(black_box(size)))
                })
            })
        });
        group.bench_function(BenchmarkId::new("pair-recorded-bursts", name), |b| {
            b.iter_custom(|iters| in_bursts(iters, &recorder, || recorded_pair(&recorder, size)))
        });
    }
    group.bench_function("recorder-alone", |b| {
        b.iter(|| {
            recorder.alloc(0, 512, 0, black_box(4096));
            recorder.release(4096, || Ok(())).unwrap();
        })
    });
    group.bench_function("recorder-alone-bursts", |b| {
        b.iter_custom(|iters| {
            in_bursts(iters, &recorder, || {
                recorder.alloc(0, 512, 0, black_box(4096));
                recorder.release(4096, || Ok(())).unwrap();
            })
        })
    });
    group.finish();
    assert!(recorder.is_recording(), "writing to /dev/null failed");
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_millis(2000))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = pairs
}
criterion_main!(benches);
