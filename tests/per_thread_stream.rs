//! The special stream handles through the C API, on the process-wide simulated device:
//! `cudaStreamPerThread` (`0x2`) names a different stream in each thread, so a block one thread
//! released is handed to another only after the first thread's work on it; `cudaStreamLegacy`
//! (`0x1`) is the NULL stream.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::{mpsc, Mutex, MutexGuard};

use cuda_sim::{Sim, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
use resmem::capi::*;
use resmem::rm_status;

const MIB: usize = 1 << 20;

const PER_THREAD: *mut c_void = CU_STREAM_PER_THREAD as *mut c_void;

/// The process-wide pool on one simulated 4 GiB device; one test at a time.
fn setup() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("RESMEM_DRIVER", "sim");
    std::env::set_var("CUDA_SIM_DEVICES", "4GiB");
    std::env::remove_var("RESMEM_CONF");
    guard
}

fn reserve(size: usize, stream: *mut c_void) -> u64 {
    let mut p = null_mut();
    // SAFETY: &mut p is valid for writing a pointer.
    let status = unsafe { rm_reserve(0, size, stream, &mut p) };
    assert_eq!(status, rm_status::RM_SUCCESS);
    p as u64
}

fn release(p: u64) {
    // SAFETY: a block this test reserved.
    assert_eq!(
        unsafe { rm_release(p as *mut c_void) },
        rm_status::RM_SUCCESS
    );
}

fn free_reusable() {
    let mut released = 0usize;
    // SAFETY: &mut released is valid for writing a size_t.
    assert_eq!(
        unsafe { rm_free_reusable(0, &mut released) },
        rm_status::RM_SUCCESS
    );
}

#[test]
fn another_threads_block_on_the_per_thread_stream_waits_for_its_work() {
    let _one = setup();
    let sim = Sim::global();
    let (to_first, first_rx) = mpsc::channel::<()>();
    let (from_first, first) = mpsc::channel::<(u64, u64)>();
    let first_thread = std::thread::spawn(move || {
        // A kernel on this thread's own stream still uses the block when it is released; on
        // that stream it is reused at once, as stream order makes safe.
        let p = reserve(64 * MIB, PER_THREAD);
        sim.enqueue_work(0, CU_STREAM_PER_THREAD).unwrap();
        release(p);
        assert_eq!(reserve(64 * MIB, PER_THREAD), p, "its own stream: at once");
        release(p);
        from_first
            .send((p, sim.pending_work(0, CU_STREAM_PER_THREAD).unwrap()))
            .unwrap();
        // Asked again once the other thread has the block: is the kernel still running?
        first_rx.recv().unwrap();
        from_first
            .send((p, sim.pending_work(0, CU_STREAM_PER_THREAD).unwrap()))
            .unwrap();
    });
    let (p, pending) = first.recv().unwrap();
    assert_eq!(pending, 1, "the first thread's kernel runs on");
    // Another thread, passing the same handle, is on another stream: it gets the block only
    // ordered after the first thread's work (here: the device waited for, since no handle names
    // the first thread's stream from this one).
    let second = std::thread::spawn(move || {
        let q = reserve(64 * MIB, PER_THREAD);
        sim.enqueue_work(0, CU_STREAM_PER_THREAD).unwrap();
        sim.complete_work(0, CU_STREAM_PER_THREAD).unwrap();
        q
    })
    .join()
    .unwrap();
    to_first.send(()).unwrap();
    let (_, pending) = first.recv().unwrap();
    first_thread.join().unwrap();
    assert_eq!(
        second, p,
        "the idle block went to the other thread's stream"
    );
    assert_eq!(
        pending, 0,
        "the first thread's kernel finished before the second's work"
    );
    release(second);
    free_reusable();
    assert_eq!(sim.used_bytes(0), 0);
}

#[test]
fn the_legacy_handle_is_the_null_stream() {
    let _one = setup();
    let sim = Sim::global();
    let p = reserve(64 * MIB, CU_STREAM_LEGACY as *mut c_void);
    sim.enqueue_work(0, 0).unwrap();
    release(p);
    // The same stream by its other name: reused at once, with no wait for the kernel.
    assert_eq!(reserve(64 * MIB, null_mut()), p);
    assert_eq!(sim.pending_work(0, CU_STREAM_LEGACY).unwrap(), 1);
    sim.complete_work(0, 0).unwrap();
    release(p);
    free_reusable();
    assert_eq!(sim.used_bytes(0), 0);
}
