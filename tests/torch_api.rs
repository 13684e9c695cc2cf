//! The PyTorch entry points (`rm_torch_*`) and the memory cap (`rm_set_memory_limit`), called
//! as PyTorch calls them, against the process-wide pool on simulated devices. Each test uses its
//! own device, so that the tests can run in parallel on the shared pool.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::Once;

use resmem::capi::{rm_get_memory_limit, rm_get_stats, rm_set_memory_limit, rm_stats};
use resmem::error::rm_status::{self, *};
use resmem::torch::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Four simulated 24 GiB devices in process, set before the pool's first use.
/// Set the environment once; the returned guard runs the tests one at a time, since they share
/// the process-wide pool (one test's empty_cache would otherwise change another's figures).
fn setup() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("RESMEM_DRIVER", "sim");
        std::env::set_var("CUDA_SIM_DEVICES", "24GiB,24GiB,24GiB,24GiB");
        std::env::remove_var("RESMEM_CONF");
    });
    guard
}

fn last_error() -> String {
    // SAFETY: rm_last_error returns a NUL-terminated string valid until the next failure here.
    unsafe { CStr::from_ptr(resmem::capi::rm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn stats(device: i32) -> rm_stats {
    let mut s = rm_stats::default();
    // SAFETY: `s` is a valid rm_stats.
    assert_eq!(unsafe { rm_get_stats(device, &mut s) }, RM_SUCCESS);
    s
}

fn limit(device: i32) -> u64 {
    let mut bytes = usize::MAX;
    // SAFETY: `bytes` is a valid size_t.
    assert_eq!(
        unsafe { rm_get_memory_limit(device, &mut bytes) },
        RM_SUCCESS
    );
    bytes as u64
}

#[test]
fn malloc_and_free_as_pytorch_calls_them() {
    let _serial = setup();
    // SAFETY (all calls below): arguments are values; pointers come from rm_torch_malloc.
    unsafe {
        rm_torch_init(4);
        assert!(
            rm_torch_malloc(0, 0, null_mut()).is_null(),
            "size 0 is NULL"
        );
        let p = rm_torch_malloc(1000, 0, null_mut());
        assert!(!p.is_null(), "{}", last_error());
        assert_eq!(p as usize % 512, 0);
        let s = stats(0);
        assert_eq!((s.allocated_bytes, s.requested_bytes), (1024, 1000));
        assert_eq!(s.reserved_bytes, 2 * MIB);
        rm_torch_free(p, 1000, 0, null_mut());
        let s = stats(0);
        assert_eq!((s.allocated_bytes, s.reserved_bytes), (0, 2 * MIB));
        rm_torch_free(null_mut(), 0, 0, null_mut());

        assert!(rm_torch_malloc(-1, 0, null_mut()).is_null());
        let e = last_error();
        assert!(e.starts_with("rm_torch_malloc: size -1 is negative"), "{e}");
        assert!(rm_torch_malloc(512, 9, null_mut()).is_null());
        let e = last_error();
        assert!(
            e.starts_with("rm_torch_malloc: device 9 is out of range"),
            "{e}"
        );
        rm_torch_free(0x1234 as *mut c_void, 1, 0, null_mut());
        assert!(
            last_error().starts_with("rm_torch_free: "),
            "{}",
            last_error()
        );
        assert_eq!(
            stats(0).reserved_bytes,
            2 * MIB,
            "a bad free changes nothing"
        );
    }
}

#[test]
fn empty_cache_returns_idle_memory_to_the_driver() {
    let _serial = setup();
    // SAFETY: as above.
    unsafe {
        let p = rm_torch_malloc((64 * MIB) as isize, 1, null_mut());
        assert!(!p.is_null(), "{}", last_error());
        rm_torch_free(p, (64 * MIB) as isize, 1, null_mut());
        assert_eq!(stats(1).reserved_bytes, 64 * MIB);
        rm_torch_empty_cache();
        let s = stats(1);
        assert_eq!((s.reserved_bytes, s.driver_frees), (0, 1));
    }
}

#[test]
fn memory_fraction_caps_the_pool() {
    let _serial = setup();
    // SAFETY: as above.
    unsafe {
        rm_torch_set_memory_fraction(0.5, 2);
        assert_eq!(limit(2), 12 * GIB);
        let p = rm_torch_malloc((13 * GIB) as isize, 2, null_mut());
        assert!(p.is_null());
        let e = last_error();
        assert!(e.starts_with("rm_torch_malloc: "), "{e}");
        assert!(e.contains("memory limit of 12.00 GiB"), "{e}");
        assert!(e.contains("set_per_process_memory_fraction"), "{e}");
        assert_eq!(stats(2).ooms, 1);

        rm_torch_set_memory_fraction(1.5, 2);
        assert!(last_error().contains("fraction 1.5 is not between 0 and 1"));
        assert_eq!(limit(2), 12 * GIB, "a refused fraction changes nothing");

        assert_eq!(rm_set_memory_limit(2, 0), RM_SUCCESS);
        assert_eq!(limit(2), 0);
        let p = rm_torch_malloc((13 * GIB) as isize, 2, null_mut());
        assert!(!p.is_null(), "{}", last_error());
        rm_torch_free(p, 0, 2, null_mut());
    }
}

#[test]
fn memory_limit_c_api() {
    let _serial = setup();
    // SAFETY: as above.
    unsafe {
        let p = rm_torch_malloc((100 * MIB) as isize, 3, null_mut());
        rm_torch_free(p, 0, 3, null_mut());
        assert_eq!(stats(3).reserved_bytes, 100 * MIB);
        // A cap below what is reserved returns the idle cache at once.
        assert_eq!(rm_set_memory_limit(3, (64 * MIB) as usize), RM_SUCCESS);
        assert_eq!(stats(3).reserved_bytes, 0);
        assert_eq!(limit(3), 64 * MIB);
        let mut out = 0usize;
        assert_eq!(rm_get_memory_limit(7, &mut out), RM_ERROR_INVALID_DEVICE);
        assert_eq!(rm_get_memory_limit(3, null_mut()), RM_ERROR_INVALID_VALUE);
        assert_eq!(
            rm_set_memory_limit(7, 1),
            rm_status::RM_ERROR_INVALID_DEVICE
        );
        assert_eq!(rm_set_memory_limit(3, 0), RM_SUCCESS);
    }
}

#[test]
fn record_stream_reaches_the_pool() {
    let _serial = setup();
    // SAFETY: as above.
    unsafe {
        rm_torch_record_stream(null_mut(), null_mut());
        assert!(
            last_error().starts_with("rm_torch_record_stream: ptr is NULL"),
            "{}",
            last_error()
        );
        rm_torch_record_stream(0x40 as *mut c_void, null_mut());
        assert!(last_error().starts_with("rm_torch_record_stream: "));
    }
}
