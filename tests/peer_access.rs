//! Devices of one process given access to each other's mapped memory, through the real loading
//! path (`CudaDriver` over a driver library: `cuDeviceCanAccessPeer`, and `cuMemSetAccess` with
//! a descriptor per device). By default the library is `libcuda_sim.so` with two simulated
//! devices; with `RESMEM_TEST_CUDA_LIBRARY=libcuda.so.1` on a machine of two GPUs or more it runs
//! there, checking what the driver can say (the simulator's access hook is absent there).

mod common;

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Arc;

use resmem::driver::cuda::CudaDriver;
use resmem::driver::pages::PageHandles;
use resmem::driver::Driver;
use resmem::{Pool, PoolConfig};

const MIB: u64 = 1 << 20;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
const RTLD_NOW: c_int = 2;

type AccessibleFrom = unsafe extern "C" fn(u64, c_int) -> c_int;

/// The simulator's `cudasim_accessible_from`, where the library is the simulator.
fn access_hook(library: &str) -> Option<AccessibleFrom> {
    let name = CString::new(library).unwrap();
    // SAFETY: a NUL-terminated path; the library the driver under test opened, so the same
    // handle.
    let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW) };
    assert!(!handle.is_null(), "dlopen {library}");
    // SAFETY: a live handle and a NUL-terminated name.
    let hook = unsafe { dlsym(handle, c"cudasim_accessible_from".as_ptr()) };
    // SAFETY: non-null, the simulator's function of that name, with this signature.
    (!hook.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, AccessibleFrom>(hook) })
}

/// The only test of this binary: it sets the simulated devices before the library is loaded.
#[test]
fn two_devices_serving_requests_use_each_others_ranges_through_the_loaded_driver() {
    std::env::set_var("CUDA_SIM_DEVICES", "2GiB,2GiB");
    let library = std::env::var("RESMEM_TEST_CUDA_LIBRARY").unwrap_or_else(|_| {
        common::artifacts()
            .lib_dir
            .join("libcuda_sim.so")
            .display()
            .to_string()
    });
    let driver = Arc::new(PageHandles::new(
        CudaDriver::load(&library).expect("load the driver library"),
    ));
    if driver.device_count() < 2 || driver.vmm_granularity(0).is_none() {
        println!(
            "{}: fewer than two devices, or no virtual-memory API; peers not exercised",
            driver.describe()
        );
        return;
    }
    let can = driver.can_access_peer(0, 1).unwrap();
    let back = driver.can_access_peer(1, 0).unwrap();
    assert!(!driver.can_access_peer(0, 0).unwrap(), "not its own peer");
    println!(
        "{}: device 0 can use device 1's memory: {can}; 1 of 0's: {back}",
        driver.describe()
    );
    let pool = Pool::new(driver.clone(), PoolConfig::default());
    // Device 0's first range is mapped before device 1 serves anything.
    let a = pool.reserve(0, 64 * MIB, 0).unwrap();
    let b = pool.reserve(1, 64 * MIB, 0).unwrap();
    let c = pool.reserve(0, 9 * MIB, 0).unwrap();
    pool.check().unwrap();
    let hook = access_hook(&library);
    assert!(
        hook.is_some() || std::env::var_os("RESMEM_TEST_CUDA_LIBRARY").is_some(),
        "the simulator exports its access hook"
    );
    if let Some(accessible) = hook {
        // SAFETY: the simulator's hook only looks the address up.
        let from = |ptr: u64, dev: c_int| unsafe { accessible(ptr, dev) };
        for ptr in [a, a + 64 * MIB - 1, c, c + 9 * MIB - 1] {
            assert_eq!(
                (from(ptr, 0), from(ptr, 1)),
                (1, c_int::from(back)),
                "{ptr:#x}"
            );
        }
        for ptr in [b, b + 64 * MIB - 1] {
            assert_eq!(
                (from(ptr, 1), from(ptr, 0)),
                (1, c_int::from(can)),
                "{ptr:#x}"
            );
        }
    }
    for ptr in [a, b, c] {
        pool.release(ptr).unwrap();
    }
    pool.free_reusable(None).unwrap();
    pool.check().unwrap();
    for device in 0..2 {
        assert_eq!(pool.stats(device).unwrap().reserved_bytes, 0);
    }
}
