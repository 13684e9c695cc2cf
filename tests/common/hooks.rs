//! The simulator's test-only exports in a loaded `libcuda_sim.so` (`cudasim_*`, see
//! `cuda-sim/README.md`): scripted faults, queued work, the device's use, and a driver that maps
//! only from an allocation's start. Resolved on the same handle the driver under test opened.

use std::ffi::{c_char, c_int, c_void, CString};

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

const RTLD_NOW: c_int = 2;

type OnStream = unsafe extern "C" fn(*mut c_void) -> c_int;
type OnDevice = unsafe extern "C" fn(c_int) -> u64;

/// The hooks, as plain functions of the library.
pub struct SimHooks {
    inject: unsafe extern "C" fn(*const c_char) -> c_int,
    clear: unsafe extern "C" fn() -> c_int,
    injected: unsafe extern "C" fn() -> u64,
    used: OnDevice,
    live: OnDevice,
    enqueue: OnStream,
    complete: OnStream,
    refuse_offsets: unsafe extern "C" fn(c_int) -> c_int,
    rdma_bytes: OnDevice,
    set_rdma: unsafe extern "C" fn(c_int) -> c_int,
}

impl SimHooks {
    /// The hooks of `library`, or `None` where it lacks them (a real driver).
    pub fn find(library: &str) -> Option<SimHooks> {
        let name = CString::new(library).unwrap();
        // SAFETY: a NUL-terminated path; the library the driver under test opened, so the same
        // handle.
        let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW) };
        if handle.is_null() {
            return None;
        }
        let sym = |s: &str| {
            let s = CString::new(s).unwrap();
            // SAFETY: a live handle and a NUL-terminated name.
            Some(unsafe { dlsym(handle, s.as_ptr()) }).filter(|p| !p.is_null())
        };
        // SAFETY: each symbol is non-null and the simulator's function of that name, with the
        // declared signature.
        unsafe {
            Some(SimHooks {
                inject: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*const c_char) -> c_int,
                >(sym("cudasim_inject_faults")?),
                clear: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(sym(
                    "cudasim_clear_faults",
                )?),
                injected: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> u64>(sym(
                    "cudasim_injected_failures",
                )?),
                used: std::mem::transmute::<*mut c_void, OnDevice>(sym("cudasim_used_bytes")?),
                live: std::mem::transmute::<*mut c_void, OnDevice>(sym(
                    "cudasim_live_allocations",
                )?),
                enqueue: std::mem::transmute::<*mut c_void, OnStream>(sym("cudasim_enqueue_work")?),
                complete: std::mem::transmute::<*mut c_void, OnStream>(sym(
                    "cudasim_complete_work",
                )?),
                refuse_offsets: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(c_int) -> c_int,
                >(sym("cudasim_refuse_map_offsets")?),
                rdma_bytes: std::mem::transmute::<*mut c_void, OnDevice>(sym(
                    "cudasim_rdma_capable_bytes",
                )?),
                set_rdma: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int) -> c_int>(
                    sym("cudasim_set_gpu_direct_rdma")?,
                ),
            })
        }
    }

    /// Arm faults in the `CUDA_SIM_FAULTS` syntax, counted from now.
    pub fn inject(&self, spec: &str) {
        let spec = CString::new(spec).unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { (self.inject)(spec.as_ptr()) }, 0);
    }

    /// Disarm every fault.
    pub fn clear(&self) {
        // SAFETY: no arguments.
        assert_eq!(unsafe { (self.clear)() }, 0);
    }

    /// Calls failed by a fault so far.
    pub fn injected(&self) -> u64 {
        // SAFETY: no arguments.
        unsafe { (self.injected)() }
    }

    /// Bytes in use on device 0 (whole pages).
    pub fn used(&self) -> u64 {
        // SAFETY: a value argument.
        unsafe { (self.used)(0) }
    }

    /// Live `cuMemAlloc` allocations on device 0.
    pub fn live(&self) -> u64 {
        // SAFETY: a value argument.
        unsafe { (self.live)(0) }
    }

    /// Queue one simulated kernel on `stream`, incomplete until [`SimHooks::complete`]; the
    /// library's `CUresult`.
    pub fn enqueue(&self, stream: u64) -> c_int {
        // SAFETY: a stream of the library, passed back as the handle it is.
        unsafe { (self.enqueue)(stream as *mut c_void) }
    }

    /// Complete the work queued on `stream` so far; the library's `CUresult`.
    pub fn complete(&self, stream: u64) -> c_int {
        // SAFETY: as for `enqueue`.
        unsafe { (self.complete)(stream as *mut c_void) }
    }

    /// With `refuse`, `cuMemMap` maps only from an allocation's start.
    pub fn refuse_map_offsets(&self, refuse: bool) {
        // SAFETY: a value argument.
        assert_eq!(unsafe { (self.refuse_offsets)(c_int::from(refuse)) }, 0);
    }

    /// Bytes of device 0's physical allocations created with the GPUDirect RDMA flag.
    pub fn rdma_capable(&self) -> u64 {
        // SAFETY: a value argument.
        unsafe { (self.rdma_bytes)(0) }
    }

    /// Whether `cuMemCreate` takes the GPUDirect RDMA flag (the default), else refuses it.
    pub fn set_gpu_direct_rdma(&self, on: bool) {
        // SAFETY: a value argument.
        assert_eq!(unsafe { (self.set_rdma)(c_int::from(on)) }, 0);
    }
}
