//! What recording (`RESMEM_CONF=record:PATH`) adds to a cache-hit `rm_reserve` + `rm_release`
//! pair through the C ABI, measured against the unrecorded pair in the same run.
//!
//! The recorded pair is the C ABI pair plus exactly the recorder calls its hooks make (the
//! `alloc` entry after the reserve, the `free` entry numbered before the release), into a
//! recorder writing to `/dev/null`, so that the writer's `write(2)` calls are paid but the disk
//! is not filled. Run: `cargo bench -p resmem-cli --bench record`.
//!
//! Three views of the same loop of pairs:
//! - `wall`: elapsed time per pair. In a loop of nothing but pairs the writer thread, which
//!   formats two lines per pair, sets the pace as soon as it has no core of its own.
//! - `caller-cpu`: the CPU time of the calling thread per pair (`CLOCK_THREAD_CPUTIME_ID`):
//!   what recording costs the program's own thread, waits for the writer excluded.
//! - `writer-cpu`: the writer thread's CPU time per recorded pair: the work moved off the
//!   program's threads, paid wherever a core is free.
//!
//! And `bursts`: 512 B pairs timed in bursts too short to fill a thread's ring, each followed by
//! an untimed flush, so that no writer runs beside the timed calls; `wall/2-threads`: two
//! threads making pairs at once, elapsed time per pair.

use std::ffi::c_void;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use resmem::capi::{rm_release, rm_reserve};
use resmem::error::rm_status;
use resmem::record::Recorder;

const SIZES: [(usize, &str); 2] = [(512, "512B"), (4 << 20, "4MiB")];

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

/// The CPU time so far of the thread whose clock is `clock`.
fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid out-pointer; a clock of a thread of this process.
    let rc = unsafe { libc::clock_gettime(clock, &mut t) };
    assert_eq!(rc, 0, "clock_gettime({clock})");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The CPU-time clock of the recorder's writer thread (named `resmem-record`): the kernel's
/// per-thread clock id for its thread id, `(~tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED`.
/// The thread names itself once it runs: looked for for up to a second.
fn writer_clock() -> libc::clockid_t {
    for _ in 0..1000 {
        for task in std::fs::read_dir("/proc/self/task").expect("read /proc/self/task") {
            let task = task.expect("a task entry").path();
            let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
            if comm.trim() == "resmem-record" {
                let tid: libc::pid_t = task.file_name().unwrap().to_str().unwrap().parse().unwrap();
                return (!tid << 3) | 6;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("no resmem-record thread");
}

/// `iters` runs of `pair`, timed by `clock`'s CPU time; `recorder` flushed inside the window.
fn cpu_of(
    clock: libc::clockid_t,
    iters: u64,
    recorder: &Recorder,
    mut pair: impl FnMut(),
) -> Duration {
    let start = cpu_time(clock);
    for _ in 0..iters {
        pair();
    }
    recorder.flush();
    cpu_time(clock) - start
}

/// Pairs per burst: 800 recorded calls, fewer than the half ring (1024) that wakes the writer.
const BURST: u64 = 400;

/// Elapsed time of `iters` runs of `pair`, timed in bursts of [`BURST`] with an untimed flush
/// after each: the calling thread's cost with no writer running beside it.
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

/// Elapsed time for `iters` runs of `pair`, half in each of two threads at once.
fn two_threads(iters: u64, pair: impl Fn() + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..iters / 2 {
                    pair();
                }
            });
        }
    });
    start.elapsed()
}

fn pairs(c: &mut Criterion) {
    // Before the first call, with no thread spawned yet: the pool reads these once.
    std::env::set_var("RESMEM_DRIVER", "sim");
    std::env::set_var("CUDA_SIM_DEVICES", "80GiB");
    std::env::remove_var("RESMEM_CONF");
    let recorder = Recorder::open("/dev/null", Some(80 << 30)).expect("open /dev/null");
    let caller = libc::CLOCK_THREAD_CPUTIME_ID;
    let writer = writer_clock();
    let mut group = c.benchmark_group("record");
    for (size, name) in SIZES {
        capi_release(capi_reserve(size)); // now cached
        group.bench_function(BenchmarkId::new("wall/pair", name), |b| {
            b.iter(|| capi_release(capi_reserve(black_box(size))))
        });
        group.bench_function(BenchmarkId::new("wall/pair-recorded", name), |b| {
            b.iter(|| recorded_pair(&recorder, size))
        });
        group.bench_function(BenchmarkId::new("caller-cpu/pair", name), |b| {
            b.iter_custom(|iters| {
                cpu_of(caller, iters, &recorder, || {
                    capi_release(capi_reserve(black_box(size)))
                })
            })
        });
        group.bench_function(BenchmarkId::new("caller-cpu/pair-recorded", name), |b| {
            b.iter_custom(|iters| {
                cpu_of(caller, iters, &recorder, || recorded_pair(&recorder, size))
            })
        });
        group.bench_function(BenchmarkId::new("writer-cpu/pair-recorded", name), |b| {
            b.iter_custom(|iters| {
                cpu_of(writer, iters, &recorder, || recorded_pair(&recorder, size))
            })
        });
    }
    group.bench_function("bursts/pair", |b| {
        b.iter_custom(|iters| {
            in_bursts(iters, &recorder, || {
                capi_release(capi_reserve(black_box(512)))
            })
        })
    });
    group.bench_function("bursts/pair-recorded", |b| {
        b.iter_custom(|iters| in_bursts(iters, &recorder, || recorded_pair(&recorder, 512)))
    });
    group.bench_function("bursts/recorder-alone", |b| {
        b.iter_custom(|iters| {
            in_bursts(iters, &recorder, || {
                recorder.alloc(0, 512, 0, black_box(4096));
                recorder.release(4096, || Ok(())).unwrap();
            })
        })
    });
    // Two threads at once: the plain pairs share the pool's lock; recorded, they also share the
    // recorder (its order counter).
    group.bench_function("wall/2-threads/pair", |b| {
        b.iter_custom(|iters| two_threads(iters, || capi_release(capi_reserve(black_box(512)))))
    });
    group.bench_function("wall/2-threads/pair-recorded", |b| {
        b.iter_custom(|iters| two_threads(iters, || recorded_pair(&recorder, 512)))
    });
    group.bench_function("wall/recorder-alone", |b| {
        b.iter(|| {
            recorder.alloc(0, 512, 0, black_box(4096));
            recorder.release(4096, || Ok(())).unwrap();
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
