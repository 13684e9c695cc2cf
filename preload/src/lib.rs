//! `libresmem_preload.so`: resmem for programs that cannot be changed.
//!
//! ```sh
//! LD_PRELOAD=/usr/local/lib/libresmem_preload.so program
//! RESMEM_CONF=preload_allocations:true LD_PRELOAD=/usr/local/lib/libresmem_preload.so program
//! ```
//!
//! Preloaded, it interposes the memory-information calls, so that they report the driver's free
//! memory plus the bytes resmem's pool holds but does not use (as `rm_mem_get_info` does):
//! `cudaMemGetInfo` (runtime API, through a dynamically linked `libcudart`), `cuMemGetInfo_v2`
//! and `cuMemGetInfo` (driver API). With `RESMEM_CONF=preload_allocations:true` it also routes
//! `cudaMalloc`/`cudaFree` and `cuMemAlloc_v2`/`cuMemFree_v2` through the pool, so that an
//! unmodified program gets the reserved-reuse policy; an allocation from a thread in CUDA's
//! relaxed stream-capture mode (how PyTorch's allocator allocates while a graph is captured)
//! goes through `rm_reserve_no_wait`, which makes no wait the driver refuses during a capture.
//! `cudaIpcGetMemHandle` and `cuIpcGetMemHandle` refuse memory of the pool (an IPC handle names
//! a whole allocation; the pool hands out pieces of its own) and pass any other through.
//! The pool comes with this object (its
//! `rm_*` functions are exported too, and being preloaded they are the ones a program calls).
//!
//! The real functions are reached through handles of their own libraries (`real.rs`), so a call
//! never comes back here. Nothing is opened until a hooked function is called: a program that
//! never touches CUDA runs as if this object were absent.
//!
//! This is a separate object from `libresmem.so` on purpose: a C++ engine that links
//! `-lresmem -lcuda` must not have its own driver calls redirected by link order.

mod real;

use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use resmem::error::rm_status;
use resmem::{record, runtime, Error};

const CUDA_SUCCESS: c_int = 0;
/// `cudaErrorInvalidValue` and `CUDA_ERROR_INVALID_VALUE`.
const INVALID_VALUE: c_int = 1;
/// `cudaErrorMemoryAllocation` and `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: c_int = 2;
/// `cudaErrorInitializationError` and `CUDA_ERROR_NOT_INITIALIZED`.
const NOT_INITIALIZED: c_int = 3;
/// `cudaErrorInvalidDevice` and `CUDA_ERROR_INVALID_DEVICE`.
const INVALID_DEVICE: c_int = 101;
/// `CUDA_ERROR_NOT_SUPPORTED` (`cudaErrorNotSupported`).
const NOT_SUPPORTED: c_int = 801;
/// `cudaErrorUnknown` and `CUDA_ERROR_UNKNOWN`.
const UNKNOWN: c_int = 999;

/// `cudaStreamCaptureModeRelaxed` / `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// Whether the calling thread is in CUDA's relaxed stream-capture mode, read by exchanging the
/// mode and putting it back: how an allocation made while a stream captures a graph is made
/// (PyTorch's allocator switches to it around its `cudaMalloc` during a capture, as the driver
/// creates memory then only in that mode). Such an allocation goes through
/// `rm_reserve_no_wait`, which makes none of the waits the driver refuses during a capture (a
/// thread relaxed for another reason only gets less reuse of cached memory). False where the
/// library lacks the function or refuses it.
fn relaxed_capture(exchange: Option<real::ExchangeCaptureMode>) -> bool {
    let Some(exchange) = exchange else {
        return false;
    };
    let mut mode = CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid int; the call writes the thread's old mode there.
    if unsafe { exchange(&mut mode) } != CUDA_SUCCESS {
        return false;
    }
    let mut back = mode;
    // SAFETY: as above; it puts the old mode back.
    unsafe { exchange(&mut back) };
    mode == CAPTURE_MODE_RELAXED
}

/// A block for an interposed allocation on `device`'s default stream: `rm_reserve`, or
/// `rm_reserve_no_wait` for a thread in the relaxed capture mode ([`relaxed_capture`]).
fn reserve_for(
    device: c_int,
    size: usize,
    exchange: Option<real::ExchangeCaptureMode>,
) -> Result<u64, Error> {
    let outcome = if relaxed_capture(exchange) {
        runtime::reserve_no_wait(device, size as u64, 0)
    } else {
        runtime::reserve(device, size as u64, 0)
    };
    record::reserved(device, size as u64, 0, &outcome);
    outcome
}

/// Run an interposer's body; a panic becomes `UNKNOWN` rather than unwinding into the program.
fn guard(body: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(UNKNOWN)
}

/// The CUDA code for a pool error (the same numbers in the runtime and the driver API).
fn cuda_code(error: &Error) -> c_int {
    match error.status {
        rm_status::RM_SUCCESS => CUDA_SUCCESS,
        rm_status::RM_ERROR_INVALID_VALUE | rm_status::RM_ERROR_INVALID_POINTER => INVALID_VALUE,
        rm_status::RM_ERROR_OUT_OF_MEMORY => OUT_OF_MEMORY,
        rm_status::RM_ERROR_INVALID_DEVICE => INVALID_DEVICE,
        rm_status::RM_ERROR_NO_DRIVER => NOT_INITIALIZED,
        rm_status::RM_ERROR_DRIVER | rm_status::RM_ERROR_INTERNAL => UNKNOWN,
    }
}

/// Whether `RESMEM_CONF` asks for allocations to go through the pool. A malformed
/// `RESMEM_CONF` is said once on standard error, and the hooks then pass every call through.
fn route_allocations() -> bool {
    match runtime::settings() {
        Ok(settings) => settings.preload_allocations,
        Err(error) => {
            static SAID: Once = Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "resmem preload: {}; cudaMalloc and cuMemAlloc are not routed through the pool",
                    error.message
                )
            });
            false
        }
    }
}

/// `free + reusable` on `device`, no more than `total`. Reusable memory exists only once the
/// pool has started; asking does not start it.
fn with_reusable(device: c_int, free: usize, total: usize) -> usize {
    let reusable = runtime::started()
        .and_then(|pool| pool.stats(device).ok())
        .map_or(0, |s| {
            usize::try_from(s.reusable_bytes).unwrap_or(usize::MAX)
        });
    free.saturating_add(reusable).min(total)
}

/// Finish a real `*MemGetInfo` call that returned `status`: where it succeeded and wrote both
/// figures, add resmem's reusable bytes on the current device (read with `device`; left as the
/// driver said where that fails) to `free`, at most `total`.
///
/// # Safety
/// Where `status` is success, `free` and `total` are null or valid for reading and writing a
/// `size_t` (the real call wrote them).
unsafe fn add_reusable(
    status: c_int,
    free: *mut usize,
    total: *mut usize,
    device: impl FnOnce(&mut c_int) -> c_int,
) -> c_int {
    if status != CUDA_SUCCESS || free.is_null() || total.is_null() {
        return status;
    }
    let mut current = 0;
    if device(&mut current) == CUDA_SUCCESS {
        // SAFETY: non-null, and written by the real call (this function's contract).
        unsafe { *free = with_reusable(current, *free, *total) };
    }
    CUDA_SUCCESS
}

/// `cudaMemGetInfo`: the current device's free memory, counting resmem's reusable bytes, and
/// its total memory.
///
/// # Safety
/// As `cudaMemGetInfo`: `free` and `total` are valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> c_int {
    guard(|| {
        let Some(rt) = real::runtime() else {
            return NOT_INITIALIZED;
        };
        // SAFETY: the real function, with the caller's arguments.
        let status = unsafe { (rt.mem_get_info)(free, total) };
        // SAFETY: the real function, with a valid int to write.
        let device = |d: &mut c_int| unsafe { (rt.get_device)(d) };
        // SAFETY: `free` and `total` as the real call left them.
        unsafe { add_reusable(status, free, total, device) }
    })
}

/// `cuMemGetInfo_v2`: the current context's device's free memory, counting resmem's reusable
/// bytes, and its total memory.
///
/// # Safety
/// As `cuMemGetInfo_v2`: `free` and `total` are valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> c_int {
    guard(|| {
        let Some(driver) = real::driver() else {
            return NOT_INITIALIZED;
        };
        // SAFETY: the real function, with the caller's arguments.
        let status = unsafe { (driver.mem_get_info)(free, total) };
        // SAFETY: the real function, with a valid int to write.
        let device = |d: &mut c_int| unsafe { (driver.ctx_get_device)(d) };
        // SAFETY: `free` and `total` as the real call left them.
        unsafe { add_reusable(status, free, total, device) }
    })
}

/// `cuMemGetInfo`, the driver API's original 32-bit form: as [`cuMemGetInfo_v2`], each figure
/// capped at `UINT_MAX`.
///
/// # Safety
/// `free` and `total` are valid for writing an `unsigned int`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> c_int {
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: both are valid size_t locals.
    let status = unsafe { cuMemGetInfo_v2(&mut f, &mut t) };
    if status == CUDA_SUCCESS {
        let cap = |v: usize| c_uint::try_from(v).unwrap_or(c_uint::MAX);
        // SAFETY: checked non-null; valid by the caller's contract.
        unsafe {
            *free = cap(f);
            *total = cap(t);
        }
    }
    status
}

/// `cudaMalloc`: through the pool on the current device when `preload_allocations` is on,
/// otherwise the runtime's own.
///
/// # Safety
/// As `cudaMalloc`: `ptr` is valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    guard(|| {
        let Some(rt) = real::runtime() else {
            return NOT_INITIALIZED;
        };
        if !route_allocations() {
            // SAFETY: the real function, with the caller's arguments.
            return unsafe { (rt.malloc)(ptr, size) };
        }
        if ptr.is_null() {
            return INVALID_VALUE;
        }
        let mut device = 0;
        // SAFETY: device is a valid int.
        let status = unsafe { (rt.get_device)(&mut device) };
        if status != CUDA_SUCCESS {
            return status;
        }
        match reserve_for(device, size, rt.exchange_capture_mode) {
            Ok(block) => {
                // SAFETY: checked non-null; valid by the caller's contract.
                unsafe { *ptr = block as *mut c_void };
                CUDA_SUCCESS
            }
            Err(error) => cuda_code(&error),
        }
    })
}

/// `cudaFree`: like the runtime's, it first waits for the device's work (so the block is idle
/// before anyone else can get it), then gives a pool block back to the pool. Any other pointer,
/// and NULL, goes to the runtime's own `cudaFree`.
///
/// # Safety
/// As `cudaFree`.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    guard(|| {
        let Some(rt) = real::runtime() else {
            return NOT_INITIALIZED;
        };
        let pool = match runtime::started() {
            Some(pool) if !ptr.is_null() && route_allocations() => pool,
            // SAFETY: the real function, with the caller's argument.
            _ => return unsafe { (rt.free)(ptr) },
        };
        // SAFETY: no arguments.
        let status = unsafe { (rt.device_synchronize)() };
        if status != CUDA_SUCCESS {
            return status;
        }
        match record::release(ptr as u64, || pool.release(ptr as u64)) {
            Ok(()) => CUDA_SUCCESS,
            // SAFETY: the real function, with the caller's argument.
            Err(e) if e.status == rm_status::RM_ERROR_INVALID_POINTER => unsafe { (rt.free)(ptr) },
            Err(e) => cuda_code(&e),
        }
    })
}

/// `cuMemAlloc_v2`: through the pool on the current context's device when
/// `preload_allocations` is on, otherwise the driver's own. Size 0 is `CUDA_ERROR_INVALID_VALUE`,
/// as in the driver.
///
/// # Safety
/// As `cuMemAlloc_v2`: `ptr` is valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, size: usize) -> c_int {
    guard(|| {
        let Some(driver) = real::driver() else {
            return NOT_INITIALIZED;
        };
        if !route_allocations() {
            // SAFETY: the real function, with the caller's arguments.
            return unsafe { (driver.mem_alloc)(ptr, size) };
        }
        if ptr.is_null() || size == 0 {
            return INVALID_VALUE;
        }
        let mut device = 0;
        // SAFETY: device is a valid int.
        let status = unsafe { (driver.ctx_get_device)(&mut device) };
        if status != CUDA_SUCCESS {
            return status;
        }
        match reserve_for(device, size, driver.exchange_capture_mode) {
            Ok(block) => {
                // SAFETY: checked non-null; valid by the caller's contract.
                unsafe { *ptr = block };
                CUDA_SUCCESS
            }
            Err(error) => cuda_code(&error),
        }
    })
}

/// `cuMemFree_v2`: waits for the current context's work, then gives a pool block back to the
/// pool; any other pointer goes to the driver's own `cuMemFree_v2`.
///
/// # Safety
/// As `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: u64) -> c_int {
    guard(|| {
        let Some(driver) = real::driver() else {
            return NOT_INITIALIZED;
        };
        let pool = match runtime::started() {
            Some(pool) if ptr != 0 && route_allocations() => pool,
            // SAFETY: the real function, with the caller's argument.
            _ => return unsafe { (driver.mem_free)(ptr) },
        };
        // SAFETY: no arguments.
        let status = unsafe { (driver.ctx_synchronize)() };
        if status != CUDA_SUCCESS {
            return status;
        }
        match record::release(ptr, || pool.release(ptr)) {
            Ok(()) => CUDA_SUCCESS,
            // SAFETY: the real function, with the caller's argument.
            Err(e) if e.status == rm_status::RM_ERROR_INVALID_POINTER => unsafe {
                (driver.mem_free)(ptr)
            },
            Err(e) => cuda_code(&e),
        }
    })
}

/// Whether `ptr` lies in memory of resmem's pool (a routed `cudaMalloc` or `cuMemAlloc_v2`, or
/// an `rm_reserve`): such memory is refused to CUDA IPC, with a line on standard error the first
/// time. The pool hands out pieces of its segments, and a handle names a whole allocation: the
/// process that opened it would get the segment's start rather than the block (and mapped
/// memory, the default, is no allocation legacy IPC exports at all).
fn refused_to_ipc(ptr: u64, call: &str) -> bool {
    if !runtime::started().is_some_and(|front| front.pool().holds(ptr)) {
        return false;
    }
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        eprintln!(
            "resmem preload: {call} refused for {ptr:#x}, memory of resmem's pool: an IPC \
             handle names a whole allocation, and the pool hands out pieces of its own; to \
             share device memory between processes, leave preload_allocations off for those \
             allocations"
        )
    });
    true
}

/// `cudaIpcGetMemHandle`: refused (`cudaErrorInvalidValue`) for memory of resmem's pool (see
/// `refused_to_ipc`), the runtime's own for any other.
///
/// # Safety
/// As `cudaIpcGetMemHandle`: `handle` is valid for writing a `cudaIpcMemHandle_t`.
#[no_mangle]
pub unsafe extern "C" fn cudaIpcGetMemHandle(handle: *mut [u8; 64], ptr: *mut c_void) -> c_int {
    guard(|| {
        let Some(rt) = real::runtime() else {
            return NOT_INITIALIZED;
        };
        if refused_to_ipc(ptr as u64, "cudaIpcGetMemHandle") {
            return INVALID_VALUE;
        }
        match rt.ipc_get_mem_handle {
            // SAFETY: the real function, with the caller's arguments.
            Some(real) => unsafe { real(handle, ptr as u64) },
            None => NOT_SUPPORTED,
        }
    })
}

/// `cuIpcGetMemHandle`: refused (`CUDA_ERROR_INVALID_VALUE`) for memory of resmem's pool (see
/// `refused_to_ipc`), the driver's own for any other.
///
/// # Safety
/// As `cuIpcGetMemHandle`: `handle` is valid for writing a `CUipcMemHandle`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut [u8; 64], ptr: u64) -> c_int {
    guard(|| {
        let Some(driver) = real::driver() else {
            return NOT_INITIALIZED;
        };
        if refused_to_ipc(ptr, "cuIpcGetMemHandle") {
            return INVALID_VALUE;
        }
        match driver.ipc_get_mem_handle {
            // SAFETY: the real function, with the caller's arguments.
            Some(real) => unsafe { real(handle, ptr) },
            None => NOT_SUPPORTED,
        }
    })
}
