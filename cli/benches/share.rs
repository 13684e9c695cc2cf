//! Time from request to memory received when processes share a device
//! (`RESMEM_CONF=share:true`), against a reference measured in the same run.
//!
//! Two processes on one simulated 24 GiB device whose capacity they share (`CUDA_SIM_SHARED`):
//! this one (B) and a holder (A, this same program started with `RESMEM_BENCH_SHARE_HOLDER=1`).
//! Each round, A caches 16 GiB idle; B then reserves 12 GiB through `rm_reserve`, which runs
//! out of memory, asks A, waits for A's helper thread to return its idle cache, and retries.
//! The time of that `rm_reserve` is the request-to-memory time. The reference is the same
//! `rm_reserve` when the memory is free (A caches nothing): a plain growth of the pool.
//!
//! Run: `cargo bench -p resmem-cli --bench share` (prints a Markdown section for BENCHMARKS.md).

use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use resmem::capi::{rm_free_reusable, rm_get_share_stats, rm_release, rm_reserve};
use resmem::error::rm_status;

const GIB: usize = 1 << 30;
const ROUNDS: usize = 200;

fn reserve(bytes: usize) -> *mut c_void {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer for the call.
    let status = unsafe { rm_reserve(0, bytes, std::ptr::null_mut(), &mut p) };
    assert_eq!(status, rm_status::RM_SUCCESS, "rm_reserve of {bytes} bytes");
    p
}

fn release_and_return(p: *mut c_void) {
    // SAFETY: `p` came from rm_reserve and is released once; the out-pointer may be NULL.
    unsafe {
        assert_eq!(rm_release(p), rm_status::RM_SUCCESS);
        assert_eq!(
            rm_free_reusable(0, std::ptr::null_mut()),
            rm_status::RM_SUCCESS
        );
    }
}

/// A: on every line `N`, cache N GiB idle (returning what it held first), then answer.
fn holder() {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let gib: usize = line.unwrap().trim().parse().unwrap();
        // SAFETY: the out-pointer may be NULL.
        unsafe { rm_free_reusable(0, std::ptr::null_mut()) };
        if gib > 0 {
            release_and_keep(reserve(gib * GIB));
        }
        writeln!(out, "ok").unwrap();
        out.flush().unwrap();
    }
}

fn release_and_keep(p: *mut c_void) {
    // SAFETY: `p` came from rm_reserve and is released once.
    assert_eq!(unsafe { rm_release(p) }, rm_status::RM_SUCCESS);
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    if std::env::var_os("RESMEM_BENCH_SHARE_HOLDER").is_some() {
        holder();
        return;
    }
    let dir = std::env::temp_dir().join(format!("resmem-bench-share-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (key, value) in [
        ("RESMEM_DRIVER", "sim".into()),
        ("CUDA_SIM_DEVICES", "24GiB".into()),
        ("CUDA_SIM_SHARED", dir.join("capacity").into_os_string()),
        ("RESMEM_SHARE_DIR", dir.clone().into_os_string()),
        ("RESMEM_CONF", "share:true".into()),
    ] {
        // Before any thread is spawned and before the pool reads the environment.
        std::env::set_var(key, value);
    }
    let mut a = Command::new(std::env::current_exe().unwrap())
        .env("RESMEM_BENCH_SHARE_HOLDER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_a = a.stdin.take().unwrap();
    let mut from_a = BufReader::new(a.stdout.take().unwrap());
    let mut cache_in_a = |gib: usize| {
        writeln!(to_a, "{gib}").unwrap();
        let mut line = String::new();
        from_a.read_line(&mut line).unwrap();
        assert_eq!(line, "ok\n");
    };
    let mut time = |a_caches: usize| -> Vec<f64> {
        let mut us = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            cache_in_a(a_caches);
            let start = Instant::now();
            let p = reserve(12 * GIB);
            us.push(start.elapsed().as_secs_f64() * 1e6);
            release_and_return(p);
        }
        us.sort_by(f64::total_cmp);
        us
    };
    // Warm both processes up (threads started, registry joined, code paged in).
    time(16);
    let shared = time(16);
    let plain = time(0);
    cache_in_a(0);
    // The end of A's input ends A.
    drop(to_a);
    let _ = a.wait();
    let (mut given, mut received) = (0u64, 0u64);
    // SAFETY: both are valid for writing a u64.
    assert_eq!(
        unsafe { rm_get_share_stats(0, &mut given, &mut received) },
        rm_status::RM_SUCCESS
    );
    assert_eq!(received, 2 * ROUNDS as u64 * 16 * GIB as u64);
    let _ = std::fs::remove_dir_all(&dir);

    println!("## Request to memory received, two processes sharing a device\n");
    println!(
        "`cargo bench -p resmem-cli --bench share`: {ROUNDS} rounds each. Process A caches 16 GiB idle on a \
         simulated 24 GiB device shared with process B (`CUDA_SIM_SHARED`); B's `rm_reserve` \
         of 12 GiB runs out of memory, asks A, waits for A's helper thread to return its idle \
         cache, and retries. The reference is the same `rm_reserve` with the memory free.\n"
    );
    println!("| `rm_reserve` of 12 GiB | median (us) | p90 (us) | max (us) | / reference |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let reference = percentile(&plain, 0.5);
    for (name, us) in [
        ("memory held idle by A: request, trim, retry", &shared),
        ("memory free (reference)", &plain),
    ] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |",
            percentile(us, 0.5),
            percentile(us, 0.9),
            us[us.len() - 1],
            percentile(us, 0.5) / reference
        );
    }
}
