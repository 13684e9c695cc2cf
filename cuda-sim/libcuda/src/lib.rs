//! `libcuda_sim.so`: the CUDA driver API over simulated devices.
//!
//! This library exports the CUDA driver API functions a device-memory pool
//! needs, under their real C names and signatures, over the process-wide
//! [`sim::Sim::global`] instance. A program can `dlopen("libcuda_sim.so")`
//! exactly as it would `libcuda.so.1` and resolve the same symbols.
//!
//! The devices come from the `CUDA_SIM_DEVICES` environment variable (for
//! example `"24GiB"` or `"80GiB,80GiB"`; one 24 GiB device when unset), read on
//! first use; a malformed value makes `cuInit` fail with
//! `CUDA_ERROR_INVALID_VALUE`.
//!
//! The driver's rules apply: every function except `cuDriverGetVersion`,
//! `cuGetErrorName` and `cuGetErrorString` returns
//! `CUDA_ERROR_NOT_INITIALIZED` before a successful `cuInit`; NULL
//! out-pointers give `CUDA_ERROR_INVALID_VALUE`; calls that act on the current
//! context use the calling thread's context stack and return
//! `CUDA_ERROR_INVALID_CONTEXT` when it is empty or its top context is a
//! primary context that is no longer retained. A NULL `CUstream` is the
//! default stream of the current context's device. No panic crosses the C
//! boundary: one is reported as `CUDA_ERROR_UNKNOWN`.
//!
//! The `cudasim_*` functions are test-only extras, not CUDA names.

#![warn(missing_docs)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

use sim::codes::*;
use sim::{Call, CuResult, Sim, VmmSetting};

/// `CUresult`: 0 for success, otherwise an error code.
pub type CUresult = c_int;
/// `CUdevice`: a device ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CUdeviceptr = u64;
/// `CUcontext`: an opaque context handle.
pub type CUcontext = *mut c_void;
/// `CUstream`: an opaque stream handle; NULL is the default stream.
pub type CUstream = *mut c_void;
/// `CUevent`: an opaque event handle.
pub type CUevent = *mut c_void;

/// The primary context of device `d` has the handle `CTX_BASE + d`.
const CTX_BASE: usize = 0xC000_0001;
/// `CU_STREAM_NON_BLOCKING`, the only `cuStreamCreate` flag.
const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`, the accepted
/// `cuEventCreate` flags.
const EVENT_FLAGS: c_uint = 0x1 | 0x2;

type Status = Result<(), CUresult>;

/// How many contexts of a thread's stack live in storage with no destructor.
const FIXED: usize = 32;

thread_local! {
    /// The calling thread's context stack, as device ordinals: the bottom `FIXED` entries and
    /// the depth in plain `Copy` storage with no destructor, so that calls from a thread-exit
    /// destructor or an `atexit` handler work (a thread-local with a destructor is gone then,
    /// and one first touched then would never be freed).
    static BOTTOM: Cell<[CUdevice; FIXED]> = const { Cell::new([0; FIXED]) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// The entries above the first `FIXED`, touched only by stacks that deep.
    static SPILL: RefCell<Vec<CUdevice>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's current context's device, if any.
fn stack_top() -> Option<CUdevice> {
    match DEPTH.get() {
        0 => None,
        depth if depth <= FIXED => Some(BOTTOM.get()[depth - 1]),
        _ => SPILL
            .try_with(|s| s.borrow().last().copied())
            .ok()
            .flatten(),
    }
}

/// Push `dev` on the calling thread's context stack (`CUDA_ERROR_INVALID_VALUE` if a stack over
/// `FIXED` deep grows while the thread is being torn down).
fn stack_push(dev: CUdevice) -> Status {
    let depth = DEPTH.get();
    if depth < FIXED {
        let mut bottom = BOTTOM.get();
        bottom[depth] = dev;
        BOTTOM.set(bottom);
    } else {
        SPILL
            .try_with(|s| s.borrow_mut().push(dev))
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    }
    DEPTH.set(depth + 1);
    Ok(())
}

/// Pop the calling thread's current context; its device, if there was one.
fn stack_pop() -> Option<CUdevice> {
    let top = stack_top()?;
    let depth = DEPTH.get();
    if depth > FIXED {
        let _ = SPILL.try_with(|s| s.borrow_mut().pop());
    }
    DEPTH.set(depth - 1);
    Some(top)
}

/// Primary-context reference counts per device.
fn retained() -> &'static Mutex<HashMap<CUdevice, u32>> {
    static RETAINED: OnceLock<Mutex<HashMap<CUdevice, u32>>> = OnceLock::new();
    RETAINED.get_or_init(|| Mutex::new(HashMap::new()))
}

fn retain_count(dev: CUdevice) -> u32 {
    let map = retained().lock().unwrap_or_else(|e| e.into_inner());
    map.get(&dev).copied().unwrap_or(0)
}

fn sim() -> &'static Sim {
    Sim::global()
}

/// Converts a simulator result to a `CUresult` error.
fn cu<T>(r: CuResult<T>) -> Result<T, CUresult> {
    r.map_err(|e| e.0)
}

/// Runs a function body, turning its result and any panic into a `CUresult`.
fn guard(body: impl FnOnce() -> Status) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Fails with `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`; otherwise the
/// number of devices.
fn initialized() -> Result<c_int, CUresult> {
    cu(sim().initialized_device_count())
}

/// Counts a call of a function the simulator has no method for, failing it
/// when an injected fault says so.
fn fault_point(call: Call) -> Status {
    cu(sim().fault_point(call))
}

/// Fails with `CUDA_ERROR_INVALID_DEVICE` for an ordinal out of range.
fn check_device(dev: CUdevice) -> Status {
    let count = initialized()?;
    if (0..count).contains(&dev) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
}

fn ctx_handle(dev: CUdevice) -> CUcontext {
    (CTX_BASE + dev as usize) as CUcontext
}

/// The device of a context handle; `CUDA_ERROR_INVALID_CONTEXT` for NULL or
/// anything that is not a context handle.
fn ctx_device(ctx: CUcontext) -> Result<CUdevice, CUresult> {
    let count = initialized()?;
    (ctx as usize)
        .checked_sub(CTX_BASE)
        .and_then(|d| CUdevice::try_from(d).ok())
        .filter(|d| *d < count)
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// The device of the calling thread's current context.
fn current_device() -> Result<CUdevice, CUresult> {
    initialized()?;
    let top = stack_top();
    match top {
        Some(dev) if retain_count(dev) > 0 => Ok(dev),
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// Resolves a stream to `(device, handle)`: NULL is the current context's
/// default stream (handle 0), anything else must be a live stream.
fn resolve_stream(stream: CUstream) -> Result<(CUdevice, u64), CUresult> {
    initialized()?;
    let handle = stream as usize as u64;
    // The NULL stream, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` are the current context's.
    if matches!(
        handle,
        0 | sim::CU_STREAM_LEGACY | sim::CU_STREAM_PER_THREAD
    ) {
        return Ok((current_device()?, handle));
    }
    let dev = sim()
        .stream_device(handle)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    Ok((dev, handle))
}

fn event_handle(event: CUevent) -> Result<u64, CUresult> {
    if event.is_null() {
        Err(CUDA_ERROR_INVALID_HANDLE)
    } else {
        Ok(event as usize as u64)
    }
}

/// Fails with `CUDA_ERROR_INVALID_VALUE` for a NULL pointer.
fn non_null<T>(p: *mut T) -> Status {
    if p.is_null() {
        Err(CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(())
    }
}

/// Writes `value` through a caller's out-pointer.
///
/// # Safety
/// `p` must be NULL or valid for a write of `T`.
unsafe fn write_out<T>(p: *mut T, value: T) -> Status {
    non_null(p)?;
    // SAFETY: `p` is non-null, and the caller guarantees it is valid for writes.
    unsafe { p.write(value) };
    Ok(())
}

/// The `cuGetErrorName` / `cuGetErrorString` strings, NUL-terminated and
/// alive for the whole process.
fn error_strings() -> &'static HashMap<CUresult, (CString, CString)> {
    static STRINGS: OnceLock<HashMap<CUresult, (CString, CString)>> = OnceLock::new();
    STRINGS.get_or_init(|| {
        ALL.iter()
            .map(|&code| {
                let name = sim::codes::name(code).expect("known code");
                let text = sim::codes::description(code).expect("known code");
                (
                    code,
                    (
                        CString::new(name).expect("no NUL in names"),
                        CString::new(text).expect("no NUL in descriptions"),
                    ),
                )
            })
            .collect()
    })
}

/// Shared body of `cuGetErrorName` and `cuGetErrorString`.
///
/// # Safety
/// `out` must be NULL or valid for a write of a pointer.
unsafe fn error_string(error: CUresult, out: *mut *const c_char, name: bool) -> Status {
    non_null(out)?;
    let found = error_strings()
        .get(&error)
        .map(|(n, d)| if name { n.as_ptr() } else { d.as_ptr() });
    // SAFETY: `out` is non-null and the caller guarantees it is writable.
    unsafe { write_out(out, found.unwrap_or(std::ptr::null())) }?;
    found.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuInit`: initializes the driver. `flags` must be 0.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        cu(sim().init())
    })
}

/// `cuDriverGetVersion`: writes 12040 (CUDA 12.4); needs no `cuInit`.
///
/// # Safety
/// `driver_version` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(driver_version: *mut c_int) -> CUresult {
    guard(|| {
        fault_point(Call::DriverGetVersion)?;
        // SAFETY: the caller's contract on `driver_version`.
        unsafe { write_out(driver_version, sim().driver_version()) }
    })
}

/// `cuDeviceGetCount`: writes the number of devices.
///
/// # Safety
/// `count` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard(|| {
        let n = cu(sim().device_count())?;
        // SAFETY: the caller's contract on `count`.
        unsafe { write_out(count, n) }
    })
}

/// `cuDeviceGet`: writes the device handle for `ordinal`.
///
/// # Safety
/// `device` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard(|| {
        fault_point(Call::DeviceGet)?;
        initialized()?;
        non_null(device)?;
        check_device(ordinal)?;
        // SAFETY: the caller's contract on `device`.
        unsafe { write_out(device, ordinal) }
    })
}

/// `cuDeviceGetName`: writes the device's name, NUL-terminated and truncated
/// to `len` bytes.
///
/// # Safety
/// `name` must be NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(name)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let text = cu(sim().device_name(dev))?;
        let n = text.len().min(len - 1);
        // SAFETY: `name` is non-null and valid for `len` bytes (caller's
        // contract); `n + 1 <= len` bytes are written, and the source string
        // cannot overlap a caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// `cuDeviceTotalMem_v2`: writes the device's capacity in bytes.
///
/// # Safety
/// `bytes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(bytes)?;
        let total = cu(sim().total_mem(dev))?;
        // SAFETY: the caller's contract on `bytes`.
        unsafe { write_out(bytes, total as usize) }
    })
}

/// `cuDeviceGetUuid`: writes the device's 16-byte UUID (a `CUuuid`), the same in every process
/// that shares capacity under one `CUDA_SIM_SHARED` name.
///
/// # Safety
/// `uuid` must be NULL or valid for a write of 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(uuid)?;
        let bytes = cu(sim().device_uuid(dev))?;
        // SAFETY: the caller's contract on `uuid`.
        unsafe { write_out(uuid, bytes) }
    })
}

/// `cuDeviceGetUuid_v2`: as [`cuDeviceGetUuid`] (the simulator has no MIG instances).
///
/// # Safety
/// As [`cuDeviceGetUuid`].
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: the same contract.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

/// `cuDevicePrimaryCtxRetain`: retains the device's primary context and
/// writes its handle (the same handle every time for a device).
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    guard(|| {
        fault_point(Call::DevicePrimaryCtxRetain)?;
        initialized()?;
        non_null(pctx)?;
        check_device(dev)?;
        *retained()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(dev)
            .or_insert(0) += 1;
        // SAFETY: the caller's contract on `pctx`.
        unsafe { write_out(pctx, ctx_handle(dev)) }
    })
}

/// `cuDevicePrimaryCtxRelease_v2`: releases one reference to the device's
/// primary context; `CUDA_ERROR_INVALID_CONTEXT` if it is not retained. Once
/// no reference is left, calls made with it current fail with
/// `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    guard(|| {
        fault_point(Call::DevicePrimaryCtxRelease)?;
        check_device(dev)?;
        let mut map = retained().lock().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(&dev) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    })
}

/// `cuCtxPushCurrent_v2`: pushes a context onto the calling thread's stack.
///
/// # Safety
/// Always safe to call; `ctx` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    guard(|| {
        fault_point(Call::CtxPushCurrent)?;
        let dev = ctx_device(ctx)?;
        stack_push(dev)
    })
}

/// `cuCtxPopCurrent_v2`: pops the calling thread's current context and writes
/// it to `pctx` unless that is NULL; `CUDA_ERROR_INVALID_CONTEXT` if the
/// stack is empty.
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    guard(|| {
        fault_point(Call::CtxPopCurrent)?;
        initialized()?;
        let dev = stack_pop().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: the caller's contract on `pctx`.
            unsafe { write_out(pctx, ctx_handle(dev)) }?;
        }
        Ok(())
    })
}

/// `cuCtxGetCurrent`: writes the calling thread's current context, or NULL
/// when there is none.
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    guard(|| {
        fault_point(Call::CtxGetCurrent)?;
        initialized()?;
        let top = stack_top();
        let ctx = top.map_or(std::ptr::null_mut(), ctx_handle);
        // SAFETY: the caller's contract on `pctx`.
        unsafe { write_out(pctx, ctx) }
    })
}

/// `cuCtxSetCurrent`: replaces the top of the calling thread's stack with
/// `ctx` (pushes it on an empty stack); NULL pops the top, if any.
///
/// # Safety
/// Always safe to call; `ctx` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    guard(|| {
        fault_point(Call::CtxSetCurrent)?;
        initialized()?;
        if ctx.is_null() {
            stack_pop();
            return Ok(());
        }
        let dev = ctx_device(ctx)?;
        stack_pop();
        stack_push(dev)
    })
}

/// `cuCtxGetDevice`: writes the current context's device.
///
/// # Safety
/// `device` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    guard(|| {
        fault_point(Call::CtxGetDevice)?;
        initialized()?;
        non_null(device)?;
        let dev = current_device()?;
        // SAFETY: the caller's contract on `device`.
        unsafe { write_out(device, dev) }
    })
}

/// `cuCtxSynchronize`: completes all work on the current device's streams.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    guard(|| cu(sim().synchronize(current_device()?)))
}

/// `cuMemGetInfo_v2`: writes the current device's free and total bytes.
///
/// # Safety
/// `free` and `total` must be NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(free)?;
        non_null(total)?;
        let (f, t) = cu(sim().mem_get_info(current_device()?))?;
        // SAFETY: the caller's contract on `free` and `total`.
        unsafe {
            write_out(free, f as usize)?;
            write_out(total, t as usize)
        }
    })
}

/// `cuMemAlloc_v2`: allocates `bytesize` bytes on the current device and
/// writes the address.
///
/// # Safety
/// `dptr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(dptr)?;
        let dev = current_device()?;
        let ptr = cu(sim().mem_alloc(dev, bytesize as u64))?;
        // SAFETY: the caller's contract on `dptr`.
        unsafe { write_out(dptr, ptr) }
    })
}

/// `cuMemFree_v2`: frees an allocation of any device; needs a current
/// context, as the driver does.
///
/// # Safety
/// Always safe to call; `dptr` is a device address, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    guard(|| {
        current_device()?;
        cu(sim().mem_free(dptr))
    })
}

/// `cuStreamCreate`: creates a stream on the current device. `flags` may be
/// `CU_STREAM_DEFAULT` (0) or `CU_STREAM_NON_BLOCKING` (1); both behave as
/// non-blocking streams.
///
/// # Safety
/// `ph_stream` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ph_stream: *mut CUstream, flags: c_uint) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(ph_stream)?;
        if flags & !CU_STREAM_NON_BLOCKING != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = cu(sim().stream_create(current_device()?))?;
        // SAFETY: the caller's contract on `ph_stream`.
        unsafe { write_out(ph_stream, handle as usize as CUstream) }
    })
}

/// `cuStreamDestroy_v2`: destroys a stream; its enqueued work still completes.
///
/// # Safety
/// Always safe to call; `stream` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    guard(|| {
        initialized()?;
        if stream.is_null() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        cu(sim().stream_destroy(stream as usize as u64))
    })
}

/// `cuStreamSynchronize`: completes all work enqueued on the stream so far.
///
/// # Safety
/// Always safe to call; `stream` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    guard(|| {
        let (dev, handle) = resolve_stream(stream)?;
        cu(sim().stream_synchronize(dev, handle))
    })
}

/// `cuStreamQuery`: `CUDA_SUCCESS` when all work enqueued on the stream has
/// completed, `CUDA_ERROR_NOT_READY` otherwise.
///
/// # Safety
/// Always safe to call; `stream` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(stream: CUstream) -> CUresult {
    guard(|| {
        let (dev, handle) = resolve_stream(stream)?;
        match cu(sim().stream_query(dev, handle))? {
            true => Ok(()),
            false => Err(CUDA_ERROR_NOT_READY),
        }
    })
}

/// `cuStreamWaitEvent`: work enqueued on the stream afterwards waits for the
/// work the event captured. `flags` must be 0.
///
/// # Safety
/// Always safe to call; the handles are only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: CUstream,
    event: CUevent,
    flags: c_uint,
) -> CUresult {
    guard(|| {
        initialized()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dev, handle) = resolve_stream(stream)?;
        cu(sim().stream_wait_event(dev, handle, event_handle(event)?))
    })
}

/// `cuStreamBeginCapture_v2`: the stream begins capturing a graph (any capture mode; the
/// simulator refuses waits during a capture as the default, global mode does, see
/// `cuda_sim`'s capture module). The default stream cannot capture.
///
/// # Safety
/// Always safe to call; `stream` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: CUstream, mode: c_uint) -> CUresult {
    guard(|| {
        initialized()?;
        if mode > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dev, handle) = resolve_stream(stream)?;
        cu(sim().stream_begin_capture(dev, handle))
    })
}

/// `cuStreamEndCapture`: the capture on the stream ends; `*ph_graph` gets a non-NULL handle
/// standing for the graph (the simulator keeps no graph), NULL where the capture was
/// invalidated (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
///
/// # Safety
/// `ph_graph` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: CUstream,
    ph_graph: *mut *mut c_void,
) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(ph_graph)?;
        let (dev, handle) = resolve_stream(stream)?;
        let ended = cu(sim().stream_end_capture(dev, handle));
        let graph = if ended.is_ok() {
            stream.cast::<c_void>()
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: the caller's contract on `ph_graph`.
        unsafe { write_out(ph_graph, graph) }?;
        ended
    })
}

/// `cuStreamIsCapturing`: the stream's `CUstreamCaptureStatus` (0 none, 1 active,
/// 2 invalidated).
///
/// # Safety
/// `status` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: CUstream, status: *mut c_uint) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(status)?;
        let (dev, handle) = resolve_stream(stream)?;
        let got = cu(sim().stream_is_capturing(dev, handle))?;
        // SAFETY: the caller's contract on `status`.
        unsafe { write_out(status, got) }
    })
}

/// `cuThreadExchangeStreamCaptureMode`: the calling thread's capture mode becomes `*mode`,
/// whose old value is written there.
///
/// # Safety
/// `mode` must be NULL or valid for a read and a write.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CUresult {
    guard(|| {
        non_null(mode)?;
        // SAFETY: non-null, and valid for reads by the caller's contract.
        let new = unsafe { mode.read() };
        let old = cu(sim().thread_exchange_capture_mode(new))?;
        // SAFETY: the caller's contract on `mode`.
        unsafe { write_out(mode, old) }
    })
}

/// `cuEventCreate`: creates an event on the current device. `flags` may
/// combine `CU_EVENT_BLOCKING_SYNC` (1) and `CU_EVENT_DISABLE_TIMING` (2).
///
/// # Safety
/// `ph_event` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ph_event: *mut CUevent, flags: c_uint) -> CUresult {
    guard(|| {
        initialized()?;
        non_null(ph_event)?;
        if flags & !EVENT_FLAGS != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = cu(sim().event_create(current_device()?))?;
        // SAFETY: the caller's contract on `ph_event`.
        unsafe { write_out(ph_event, handle as usize as CUevent) }
    })
}

/// `cuEventRecord`: the event captures the work enqueued on the stream so
/// far. Event and stream must belong to the same device.
///
/// # Safety
/// Always safe to call; the handles are only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult {
    guard(|| {
        initialized()?;
        let event = event_handle(event)?;
        let (dev, handle) = resolve_stream(stream)?;
        cu(sim().event_record(dev, event, handle))
    })
}

/// `cuEventQuery`: `CUDA_SUCCESS` when the captured work has completed,
/// `CUDA_ERROR_NOT_READY` otherwise.
///
/// # Safety
/// Always safe to call; `event` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(event: CUevent) -> CUresult {
    guard(|| {
        initialized()?;
        match cu(sim().event_query(event_handle(event)?))? {
            true => Ok(()),
            false => Err(CUDA_ERROR_NOT_READY),
        }
    })
}

/// `cuEventSynchronize`: waits for (completes) the captured work.
///
/// # Safety
/// Always safe to call; `event` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(event: CUevent) -> CUresult {
    guard(|| {
        initialized()?;
        cu(sim().event_synchronize(event_handle(event)?))
    })
}

/// `cuEventDestroy_v2`: destroys an event.
///
/// # Safety
/// Always safe to call; `event` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: CUevent) -> CUresult {
    guard(|| {
        initialized()?;
        cu(sim().event_destroy(event_handle(event)?))
    })
}

/// `cuGetErrorName`: writes a static NUL-terminated name such as
/// `"CUDA_ERROR_OUT_OF_MEMORY"`; for an unknown code writes NULL and returns
/// `CUDA_ERROR_INVALID_VALUE`. Needs no `cuInit`.
///
/// # Safety
/// `p_str` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    guard(|| {
        fault_point(Call::GetErrorName)?;
        // SAFETY: the caller's contract on `p_str`.
        unsafe { error_string(error, p_str, true) }
    })
}

/// `cuGetErrorString`: writes a static NUL-terminated description such as
/// `"out of memory"`; for an unknown code writes NULL and returns
/// `CUDA_ERROR_INVALID_VALUE`. Needs no `cuInit`.
///
/// # Safety
/// `p_str` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    guard(|| {
        fault_point(Call::GetErrorString)?;
        // SAFETY: the caller's contract on `p_str`.
        unsafe { error_string(error, p_str, false) }
    })
}

/// `CUmemLocation`: where memory lives (type 1: a device, with its ordinal).
#[repr(C)]
pub struct CUmemLocation {
    /// `CU_MEM_LOCATION_TYPE_DEVICE` (1) is the only type simulated.
    pub kind: c_int,
    /// The device ordinal.
    pub id: c_int,
}

/// `CUmemAllocationProp`, as `cuda.h` lays it out.
#[repr(C)]
pub struct CUmemAllocationProp {
    /// `CU_MEM_ALLOCATION_TYPE_PINNED` (1) is the only type simulated.
    pub kind: c_int,
    /// Shareable handle types requested (ignored).
    pub requested_handle_types: c_int,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// Windows-only metadata (ignored).
    pub win32_handle_meta_data: *mut c_void,
    /// Compression, RDMA and usage flags: the second byte, `gpuDirectRDMACapable`, is kept
    /// (and refused where the devices do not take it); the others are ignored.
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`: access for one location.
#[repr(C)]
pub struct CUmemAccessDesc {
    /// The device given access.
    pub location: CUmemLocation,
    /// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` (3) is the only access simulated.
    pub flags: c_int,
}

const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;

/// The device a `CUmemAllocationProp` names, after checking what is simulated.
///
/// # Safety
/// `prop` is NULL or points to a valid `CUmemAllocationProp`.
unsafe fn prop_device(prop: *const CUmemAllocationProp) -> Result<CUdevice, CUresult> {
    if prop.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and valid by the caller's contract.
    let prop = unsafe { &*prop };
    if prop.kind != CU_MEM_ALLOCATION_TYPE_PINNED
        || prop.location.kind != CU_MEM_LOCATION_TYPE_DEVICE
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(prop.location.id)
}

/// `cuDeviceGetAttribute`: only `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
///
/// # Safety
/// `pi` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_int,
    dev: CUdevice,
) -> CUresult {
    guard(|| {
        non_null(pi)?;
        let value = cu(sim().device_attribute(dev, attrib))?;
        // SAFETY: the caller's contract on `pi`.
        unsafe { write_out(pi, value) }
    })
}

/// `cuIpcGetMemHandle`: a 64-byte handle naming the `cuMemAlloc` allocation that holds `dptr`
/// (its base in the first 8 bytes, the rest zero); `CUDA_ERROR_INVALID_VALUE` for mapped memory.
///
/// # Safety
/// `handle` is NULL or valid for writing 64 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut [u8; 64], dptr: CUdeviceptr) -> CUresult {
    guard(|| {
        non_null(handle)?;
        let base = cu(sim().ipc_mem_handle(dptr))?;
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(&base.to_le_bytes());
        // SAFETY: the caller's contract on `handle`.
        unsafe { write_out(handle, bytes) }
    })
}

/// `cuDeviceCanAccessPeer`: 1 where `dev`'s kernels can use memory of `peer` (every pair of
/// distinct simulated devices), else 0.
///
/// # Safety
/// `can_access` is NULL or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can_access: *mut c_int,
    dev: CUdevice,
    peer: CUdevice,
) -> CUresult {
    guard(|| {
        non_null(can_access)?;
        let can = cu(sim().device_can_access_peer(dev, peer))?;
        // SAFETY: the caller's contract on `can_access`.
        unsafe { write_out(can_access, c_int::from(can)) }
    })
}

/// `cuMemGetAllocationGranularity`: 2 MiB, minimum and recommended.
///
/// # Safety
/// `granularity` is NULL or valid for writing a `size_t`; `prop` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_int,
) -> CUresult {
    guard(|| {
        non_null(granularity)?;
        // SAFETY: the caller's contract on `prop`.
        let dev = unsafe { prop_device(prop) }?;
        if !(0..=1).contains(&option) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = cu(sim().mem_granularity(dev))?;
        // SAFETY: the caller's contract on `granularity`.
        unsafe { write_out(granularity, g as usize) }
    })
}

/// `cuMemAddressReserve` (no fixed address, flags 0).
///
/// # Safety
/// `ptr` is NULL or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    guard(|| {
        non_null(ptr)?;
        if addr != 0 || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let base = cu(sim().mem_address_reserve(size as u64, alignment as u64))?;
        // SAFETY: the caller's contract on `ptr`.
        unsafe { write_out(ptr, base) }
    })
}

/// `cuMemAddressFree`.
///
/// # Safety
/// Always safe to call: the address is only looked up.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| cu(sim().mem_address_free(ptr, size as u64)))
}

/// `cuMemCreate` (flags 0).
///
/// # Safety
/// `handle` is NULL or valid for writing a handle; `prop` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    guard(|| {
        non_null(handle)?;
        // SAFETY: the caller's contract on `prop`.
        let dev = unsafe { prop_device(prop) }?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: as above; `prop_device` checked it non-null.
        let rdma = unsafe { (*prop).alloc_flags[1] } != 0;
        let h = cu(sim().mem_create_with(dev, size as u64, rdma))?;
        // SAFETY: the caller's contract on `handle`.
        unsafe { write_out(handle, h) }
    })
}

/// `cuMemRelease`.
///
/// # Safety
/// Always safe to call: the handle is only looked up.
#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    guard(|| cu(sim().mem_release(handle)))
}

/// `cuMemMap` (flags 0): `size` bytes of `handle` from `offset` on.
///
/// # Safety
/// Always safe to call: the arguments are only looked up.
#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CUresult {
    guard(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        cu(sim().mem_map(ptr, size as u64, offset as u64, handle))
    })
}

/// `cuMemUnmap`.
///
/// # Safety
/// Always safe to call: the range is only looked up.
#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| cu(sim().mem_unmap(ptr, size as u64)))
}

/// `cuMemSetAccess`: read-write access for the devices the descriptors name.
///
/// # Safety
/// `desc` is NULL or points to `count` valid descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    guard(|| {
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null with `count` elements by the caller's contract.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let mut devs = Vec::with_capacity(count);
        for d in descs {
            if d.location.kind != CU_MEM_LOCATION_TYPE_DEVICE
                || d.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            devs.push(d.location.id);
        }
        cu(sim().mem_set_access_for(ptr, size as u64, &devs))
    })
}

/// Test-only (not CUDA): enqueues one incomplete simulated work item on the
/// stream (NULL: the current context's default stream).
///
/// # Safety
/// Always safe to call; `stream` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cudasim_enqueue_work(stream: CUstream) -> CUresult {
    guard(|| {
        let (dev, handle) = resolve_stream(stream)?;
        cu(sim().enqueue_work(dev, handle)).map(drop)
    })
}

/// Test-only (not CUDA): completes all work enqueued on the stream so far,
/// first completing whatever it waits on.
///
/// # Safety
/// Always safe to call; `stream` is only compared, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cudasim_complete_work(stream: CUstream) -> CUresult {
    guard(|| {
        let (dev, handle) = resolve_stream(stream)?;
        cu(sim().complete_work(dev, handle))
    })
}

/// Test-only (not CUDA): bytes in use on `dev` (whole pages); 0 for an
/// unknown device. Needs no `cuInit`.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_used_bytes(dev: c_int) -> u64 {
    catch_unwind(|| sim().used_bytes(dev)).unwrap_or(0)
}

/// Test-only (not CUDA): 1 where `ptr` is mapped with access given to `dev` (the memory's
/// own device or a peer), 0 where it is mapped without, -1 where nothing is mapped there.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_accessible_from(ptr: CUdeviceptr, dev: c_int) -> c_int {
    catch_unwind(|| sim().accessible_from(ptr, dev).map_or(-1, c_int::from)).unwrap_or(-1)
}

/// Test-only (not CUDA): bytes of `dev`'s physical allocations created with the GPUDirect RDMA
/// flag; 0 for an unknown device.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_rdma_capable_bytes(dev: c_int) -> u64 {
    catch_unwind(|| sim().rdma_capable_bytes(dev)).unwrap_or(0)
}

/// Test-only (not CUDA): non-zero: `cuMemCreate` takes the GPUDirect RDMA flag and the device
/// attribute says so (the default); 0: the attribute reads 0 and the flag is refused.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_set_gpu_direct_rdma(on: c_int) -> CUresult {
    guard(|| {
        sim().set_gpu_direct_rdma(on != 0);
        Ok(())
    })
}

/// Test-only (not CUDA): the number of live allocations on `dev`; 0 for an
/// unknown device. Needs no `cuInit`.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_live_allocations(dev: c_int) -> u64 {
    catch_unwind(|| sim().live_allocations(dev) as u64).unwrap_or(0)
}

/// Test-only (not CUDA): injects the faults of a list in the
/// `CUDA_SIM_FAULTS` syntax (e.g. `"cuMemAlloc_v2@3=2"`), counting calls from
/// now on. `CUDA_ERROR_INVALID_VALUE` for NULL, non-UTF-8 or a malformed list
/// (then none is injected).
///
/// # Safety
/// `spec` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cudasim_inject_faults(spec: *const c_char) -> CUresult {
    guard(|| {
        if spec.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null and NUL-terminated by the caller's contract.
        let text = unsafe { std::ffi::CStr::from_ptr(spec) };
        let text = text.to_str().map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        sim()
            .inject_faults(text)
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)
    })
}

/// Test-only (not CUDA): with `refuse` non-zero, `cuMemMap` refuses an offset other than 0
/// into an allocation with `CUDA_ERROR_INVALID_VALUE` (as `CUDA_SIM_VMM=offset0`); with 0, the
/// virtual-memory API in full again (as `CUDA_SIM_VMM=1`).
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_refuse_map_offsets(refuse: c_int) -> CUresult {
    guard(|| {
        sim().set_vmm(if refuse != 0 {
            VmmSetting::StartOnly
        } else {
            VmmSetting::Full
        });
        Ok(())
    })
}

/// Test-only (not CUDA): disarms every injected fault.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_clear_faults() -> CUresult {
    guard(|| {
        sim().clear_faults();
        Ok(())
    })
}

/// Test-only (not CUDA): how many calls failed because of an injected fault.
///
/// # Safety
/// Always safe to call; `unsafe` only to match the other exports.
#[no_mangle]
pub unsafe extern "C" fn cudasim_injected_failures() -> u64 {
    catch_unwind(|| sim().injected_failures()).unwrap_or(0)
}
