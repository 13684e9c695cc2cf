//! The C API: the exported `rm_*` functions of the core API (PyTorch's entry points are in
//! [`crate::torch`]), and nothing else exported. Each one checks its arguments, runs its body
//! behind `boundary` (a caught panic becomes `RM_ERROR_INTERNAL`), returns an [`rm_status`],
//! and leaves a message for `rm_last_error()` on failure. The logic lives in [`crate::front`] and
//! [`crate::pool`]; this file only translates, and tells [`crate::record`] what was done.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{self, AssertUnwindSafe};

use crate::driver::DevicePtr;
use crate::error::{last_error_ptr, rm_status, set_last_error, Error, Result};
use crate::front::Front;
use crate::pool::Stats;
use crate::{record, runtime, tls};

/// A device's figures, as `rm_get_stats` reports them. They are exact whenever no other call
/// is in flight (calls running meanwhile may or may not be counted yet).
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct rm_stats {
    /// Bytes in live blocks (block sizes: requests rounded up to 512 bytes).
    pub allocated_bytes: u64,
    /// Bytes in live blocks as requested.
    pub requested_bytes: u64,
    /// Bytes held from the driver.
    pub reserved_bytes: u64,
    /// `reserved_bytes - allocated_bytes`: held but unused, counted as free by `rm_mem_get_info`.
    pub reusable_bytes: u64,
    /// The largest single request servable without the driver (on the stream owning that block).
    pub largest_reusable_block: u64,
    /// Highest `allocated_bytes` since start or the last `rm_reset_peak_stats`. Where threads
    /// contended for the pool and their streams took separate shards of the device (README,
    /// "shards"), the sum of the shards' highs: at least the device's.
    pub peak_allocated_bytes: u64,
    /// Highest `reserved_bytes` since start or the last `rm_reset_peak_stats`: the device's own,
    /// whatever its shards.
    pub peak_reserved_bytes: u64,
    /// Blocks reserved and not yet released.
    pub live_blocks: u64,
    /// Segments (driver allocations) held.
    pub segments: u64,
    /// `rm_reserve` calls with a non-zero size.
    pub reserve_calls: u64,
    /// Of those, the ones served from a free block the pool held, with no new segment (a
    /// segment mapped from cached pages, which allocates no memory, is not counted).
    pub cache_hits: u64,
    /// Successful driver allocations.
    pub driver_allocs: u64,
    /// Successful driver frees.
    pub driver_frees: u64,
    /// Times a driver out-of-memory made the pool return all reusable memory and retry.
    pub oom_retries: u64,
    /// Requests that failed with `RM_ERROR_OUT_OF_MEMORY`.
    pub ooms: u64,
}

impl From<Stats> for rm_stats {
    fn from(s: Stats) -> rm_stats {
        rm_stats {
            allocated_bytes: s.allocated_bytes,
            requested_bytes: s.requested_bytes,
            reserved_bytes: s.reserved_bytes,
            reusable_bytes: s.reusable_bytes,
            largest_reusable_block: s.largest_reusable_block,
            peak_allocated_bytes: s.peak_allocated_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
            live_blocks: s.live_blocks,
            segments: s.segments,
            reserve_calls: s.reserve_calls,
            cache_hits: s.cache_hits,
            driver_allocs: s.driver_allocs,
            driver_frees: s.driver_frees,
            oom_retries: s.oom_retries,
            ooms: s.ooms,
        }
    }
}

/// Run an export's body: its error becomes a status and this thread's last-error message,
/// prefixed with the function's name; a panic becomes `RM_ERROR_INTERNAL`.
///
/// Nothing here may unwind into C, even when called from a thread-exit destructor or an
/// `atexit` handler, after the thread's locals are gone: the boundary flag (in [`tls`]) has no
/// destructor (always usable), and the last-error storage is reached with `try_with` (see
/// [`set_last_error`]), inside a catch of its own.
pub(crate) fn boundary(function: &str, body: impl FnOnce() -> Result<()>) -> rm_status {
    tls::install_quiet_panic_hook();
    let outcome = tls::with(|t| {
        let outer = t.in_boundary.replace(true);
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            test_panic(function);
            body()
        }));
        t.in_boundary.set(outer);
        outcome
    });
    let error = match outcome {
        Ok(Ok(())) => return rm_status::RM_SUCCESS,
        Ok(Err(error)) => error,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            Error::internal(format!(
                "internal error ({what}); the library stays usable, but please report this"
            ))
        }
    };
    fail(function, error)
}

/// `error`'s status, its message (prefixed with `function`'s name) left in this thread's last
/// error.
fn fail(function: &str, error: Error) -> rm_status {
    let message = format!("{function}: {}", error.message);
    // A panic here could only lose the message, never the status.
    let _stored = panic::catch_unwind(|| set_last_error(&message));
    error.status
}

/// The hit path of an export: `f` on the started pool's front, inside a panic catch as
/// [`boundary`]'s, taken only while the pool is started and nothing is recorded (see
/// [`runtime::fast`]). `None`: `f` changed nothing, or panicked; the caller goes on past its
/// hit path.
///
/// The hit path stores as little as it can before it loads the bin's and the block's entry: a
/// load waits behind an earlier store at the same offset within a page (the CPU cannot tell
/// them apart at first), and the stack the calls write to may sit at any offset relative to
/// them. So `f` makes no call (around which the export would save registers on the stack), not
/// even the thread-local's lookup (a call to `__tls_get_addr` in a shared object): the calling
/// thread's cache is found from its thread pointer (`front/seats.rs`). For the same reason it
/// leaves the boundary flag alone (the quiet panic hook's, which [`boundary`] and [`past_hit`]
/// set): nothing in `f` can panic (no call; its indices are in bounds by construction, masked
/// or shifted; its arithmetic cannot overflow).
/// If a change ever made it panic, the panic would still be caught here, only reported by the
/// hook as any other.
#[inline(always)]
fn hit<R>(f: impl FnOnce(&'static Front) -> Option<R>) -> Option<R> {
    let front = runtime::fast()?;
    panic::catch_unwind(AssertUnwindSafe(|| f(front)))
        .ok()
        .flatten()
}

/// [`hit`] for what an export tries past its hit path and before its full path (out of line):
/// inside the boundary flag too, as [`boundary`].
#[inline(always)]
fn past_hit<R>(f: impl FnOnce(&'static Front, &tls::Thread) -> Option<R>) -> Option<R> {
    let front = runtime::fast()?;
    let t = tls::current();
    let outer = t.in_boundary.replace(true);
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| f(front, t)));
    t.in_boundary.set(outer);
    outcome.ok().flatten()
}

/// The pool's name for a stream a caller passed (`driver::per_thread`): `CU_STREAM_LEGACY` is
/// the NULL stream, `CU_STREAM_PER_THREAD` the calling thread's own default stream.
#[inline(always)]
pub(crate) fn stream_key(stream: *mut c_void) -> u64 {
    crate::driver::per_thread::key(stream as u64)
}

/// The callers of the hit paths, for their `SITE` parameter: each gets its own copy of the
/// panic catch's inner function, which the compiler inlines where it has one caller and calls
/// where two share it (a call, with the arguments passed through the stack).
pub(crate) mod site {
    pub const RM: u8 = 0;
    pub const TORCH: u8 = 1;
}

/// A block for `(device, size, stream)` from the calling thread's front cache, if its home bin
/// of that key holds one (nothing else is tried); for `rm_reserve` and `rm_torch_malloc` (`SITE`:
/// see [`site`]).
#[inline(always)]
pub(crate) fn reserve_hit<const SITE: u8>(
    device: c_int,
    size: u64,
    stream: *mut c_void,
) -> Option<DevicePtr> {
    hit(|front| front.reserve_hit(device, size, stream_key(stream)))
}

/// [`reserve_hit`] of a key its home bin does not hold (see [`Front::reserve_probed`]), where
/// the callers go on past their hit path.
#[cold]
#[inline(never)]
pub(crate) fn reserve_probed(device: c_int, size: u64, stream: *mut c_void) -> Option<DevicePtr> {
    past_hit(|front, t| front.reserve_probed(t, device, size, stream_key(stream)))
}

/// Whether `ptr` was released into the calling thread's front cache on the hit path (see
/// [`Front::release_hit`]); `false`, with nothing changed, otherwise. For `rm_release` and
/// `rm_torch_free` (`SITE`: see [`site`]).
#[inline(always)]
pub(crate) fn release_hit<const SITE: u8>(ptr: *mut c_void) -> bool {
    hit(|front| front.release_hit(ptr as DevicePtr).then_some(())).is_some()
}

/// Release `ptr` if it is a block the front caches know and hold for a caller (see
/// [`Front::release_known`]); `None` where the pool must be asked. For `rm_release` and
/// `rm_torch_free` past [`release_hit`], whose `function` names an error.
#[inline(never)]
pub(crate) fn release_known(function: &str, ptr: *mut c_void) -> Option<rm_status> {
    let outcome = past_hit(|front, t| front.release_known(t, ptr as DevicePtr))?;
    Some(match outcome {
        Ok(()) => rm_status::RM_SUCCESS,
        Err(error) => fail_boxed(function, error),
    })
}

/// [`fail`] of a boxed error, out of the hit path (which passes the box on: moving the error
/// out there would give it a stack frame).
#[cold]
#[inline(never)]
#[allow(clippy::boxed_local)]
fn fail_boxed(function: &str, error: Box<Error>) -> rm_status {
    fail(function, *error)
}

/// In debug builds only: panic inside the export named by `RESMEM_TEST_PANIC`, so that tests
/// can check that a panic becomes `RM_ERROR_INTERNAL` and the library stays usable.
fn test_panic(function: &str) {
    #[cfg(debug_assertions)]
    if runtime::var_os("RESMEM_TEST_PANIC").is_some_and(|f| f == function) {
        panic!("RESMEM_TEST_PANIC={function}");
    }
    #[cfg(not(debug_assertions))]
    let _ = function;
}

fn null_argument(name: &str) -> Error {
    Error::invalid_value(format!(
        "{name} is NULL; pass a pointer to where the result goes"
    ))
}

/// Write `value` through `out` after a null check.
///
/// # Safety
/// `out` is null or valid for writing a `T`.
unsafe fn write_out<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-null, and valid for writes by the caller's contract.
        unsafe { out.write(value) };
    }
}

pub(crate) fn pool() -> Result<&'static Front> {
    runtime::pool()
}

fn size_arg(size: usize) -> u64 {
    size as u64
}

fn usize_out(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// Free and total memory of `device` in bytes, where *free* is what the driver reports free
/// plus this pool's reusable bytes on that device (memory it holds but nobody uses), and, with
/// `RESMEM_CONF=share:true,share_count:true`, the reusable bytes the other sharing processes on
/// the device would give up on request (never more than the total).
///
/// # Safety
/// `free_bytes` and `total_bytes` are NULL or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn rm_mem_get_info(
    device: c_int,
    free_bytes: *mut usize,
    total_bytes: *mut usize,
) -> rm_status {
    boundary("rm_mem_get_info", || {
        if free_bytes.is_null() {
            return Err(null_argument("free_bytes"));
        }
        if total_bytes.is_null() {
            return Err(null_argument("total_bytes"));
        }
        let (free, total) = runtime::mem_get_info(device)?;
        // SAFETY: both checked non-null; valid by the caller's contract.
        unsafe {
            write_out(free_bytes, usize_out(free));
            write_out(total_bytes, usize_out(total));
        }
        Ok(())
    })
}

/// Reserve a block of at least `size` bytes on `device`, 512-byte aligned, for use on `stream`
/// (a `CUstream`; NULL is the default stream, and so is `CU_STREAM_LEGACY`;
/// `CU_STREAM_PER_THREAD`, `cudaStreamPerThread`, is the calling thread's own default stream: a
/// block reserved and released on it is reused at once by the same thread, by another thread
/// only after the device's work). `size` 0 succeeds with `*out_ptr = NULL`.
///
/// Order of attempts: a cached block on this stream (best fit); an idle cached segment of
/// another stream, ordered after that stream's work; a new segment, returning idle cached
/// segments to the driver first if the driver's free memory is short; on a driver
/// out-of-memory, all reusable memory is returned and the allocation retried once (where
/// threads contending for the pool moved their streams to separate shards of the device, the
/// stream's shard first, then the other shards' idle cache and one more try); with
/// `RESMEM_CONF=share:true`, the other sharing processes on the device are asked for the
/// shortfall, and the allocation is retried once more if the driver's free memory rises within
/// `share_wait_ms`; then `RM_ERROR_OUT_OF_MEMORY`, with the requested, reserved, reusable and
/// driver-free bytes (and what sharing asked and received) in `rm_last_error()`. On failure
/// `*out_ptr` is NULL.
///
/// # Safety
/// `out_ptr` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn rm_reserve(
    device: c_int,
    size: usize,
    stream: *mut c_void,
    out_ptr: *mut *mut c_void,
) -> rm_status {
    if !out_ptr.is_null() {
        if let Some(ptr) = reserve_hit::<{ site::RM }>(device, size_arg(size), stream) {
            // SAFETY: checked non-null; valid for writes by the caller's contract.
            unsafe { out_ptr.write(ptr as *mut c_void) };
            return rm_status::RM_SUCCESS;
        }
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { reserve_call(device, size, stream, out_ptr) }
}

/// [`rm_reserve`] past its hit path, in a function of its own so that the hit path saves no
/// registers for it: a key displaced from its home bin, then the full path.
///
/// # Safety
/// As [`rm_reserve`].
#[cold]
#[inline(never)]
unsafe fn reserve_call(
    device: c_int,
    size: usize,
    stream: *mut c_void,
    out_ptr: *mut *mut c_void,
) -> rm_status {
    if !out_ptr.is_null() {
        if let Some(ptr) = reserve_probed(device, size_arg(size), stream) {
            // SAFETY: checked non-null; valid for writes by the caller's contract.
            unsafe { out_ptr.write(ptr as *mut c_void) };
            return rm_status::RM_SUCCESS;
        }
    }
    // SAFETY: the caller's contract, passed on.
    unsafe {
        reserve_full(
            "rm_reserve",
            runtime::reserve,
            device,
            size,
            stream,
            out_ptr,
        )
    }
}

/// The full path of `function` (`rm_reserve` or `rm_reserve_no_wait`): `*out_ptr` NULL first,
/// then the block `reserve` gives, recorded; a NULL `out_ptr` refused.
///
/// # Safety
/// `out_ptr` is NULL or valid for writing a pointer.
unsafe fn reserve_full(
    function: &str,
    reserve: fn(i32, u64, u64) -> Result<DevicePtr>,
    device: c_int,
    size: usize,
    stream: *mut c_void,
    out_ptr: *mut *mut c_void,
) -> rm_status {
    boundary(function, || {
        if out_ptr.is_null() {
            return Err(null_argument("out_ptr"));
        }
        // SAFETY: checked non-null; valid by the caller's contract.
        unsafe { write_out(out_ptr, std::ptr::null_mut()) };
        let stream = stream_key(stream);
        let outcome = reserve(device, size_arg(size), stream);
        record::reserved(device, size_arg(size), stream, &outcome);
        let ptr = outcome?;
        // SAFETY: as above.
        unsafe { write_out(out_ptr, ptr as *mut c_void) };
        Ok(())
    })
}

/// Reserve as [`rm_reserve`] for a stream that is capturing a CUDA graph, or while any stream
/// of the device captures one (`resmem.torch.install()` calls it for PyTorch's graph
/// captures): it never waits for the device's work (`cuCtxSynchronize`, `cuEventSynchronize`,
/// `cuEventQuery`, `cuMemFree`) nor orders `stream` after another stream's
/// (`cuStreamWaitEvent`), which the driver refuses during a capture, invalidating it. It takes
/// a cached block of `stream`, an idle cached segment whose work is known done (released before
/// the pool last waited for the device), or new memory; no cache goes back to the driver to
/// make room, so where memory is short it fails with `RM_ERROR_OUT_OF_MEMORY` where
/// `rm_reserve` might not. Use `rm_reserve` again once the capture has ended. During a capture,
/// the driver creates memory only for a thread in CUDA's relaxed capture mode
/// (`cuThreadExchangeStreamCaptureMode`), as PyTorch's allocator sets it around its own.
///
/// # Safety
/// `out_ptr` is NULL or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn rm_reserve_no_wait(
    device: c_int,
    size: usize,
    stream: *mut c_void,
    out_ptr: *mut *mut c_void,
) -> rm_status {
    let reserve = runtime::reserve_no_wait;
    // SAFETY: the caller's contract, passed on.
    unsafe { reserve_full("rm_reserve_no_wait", reserve, device, size, stream, out_ptr) }
}

/// Give a block back to the pool (not to the driver). NULL is accepted and does nothing.
/// A pointer the pool did not hand out, an interior pointer, or a second release fails with
/// `RM_ERROR_INVALID_POINTER` and changes nothing. The block is reusable at once on the stream it
/// was reserved for; elsewhere only after the work queued on every stream that used it.
///
/// # Safety
/// None beyond passing a value: the pointer is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn rm_release(ptr: *mut c_void) -> rm_status {
    if release_hit::<{ site::RM }>(ptr) {
        return rm_status::RM_SUCCESS;
    }
    release_call(ptr)
}

/// [`rm_release`] past its hit path (see [`reserve_call`]): a block the front knows, then the
/// full path.
#[cold]
#[inline(never)]
fn release_call(ptr: *mut c_void) -> rm_status {
    if let Some(status) = release_known("rm_release", ptr) {
        return status;
    }
    boundary("rm_release", || {
        if ptr.is_null() {
            return Ok(());
        }
        let pool = pool()?;
        record::release(ptr as DevicePtr, || pool.release(ptr as DevicePtr))
    })
}

/// Note that the live block at `ptr` is also used on `stream` (PyTorch's `record_stream`): its
/// release then waits for the work queued on `stream` before the block is reused.
///
/// # Safety
/// None beyond passing values: the pointers are looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn rm_record_stream(ptr: *mut c_void, stream: *mut c_void) -> rm_status {
    boundary("rm_record_stream", || {
        if ptr.is_null() {
            return Err(Error::invalid_pointer(
                "ptr is NULL; pass a block returned by rm_reserve",
            ));
        }
        let pool = pool()?;
        let stream = stream_key(stream);
        record::record_stream(ptr as DevicePtr, stream, || {
            pool.record_stream(ptr as DevicePtr, stream)
        })
    })
}

/// Return every idle cached segment to the driver (what `torch.cuda.empty_cache()` does), after
/// waiting for the device's queued work, which may still use released blocks. `device` -1
/// means every device. The bytes returned are stored in `*released_bytes` unless it is NULL.
/// The wait is made before the device's lock is taken, and idle segments go back in batches,
/// so other threads' calls on the device wait for one batch at most, never for the device's
/// work; blocks they release meanwhile may stay cached.
///
/// # Safety
/// `released_bytes` is NULL or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn rm_free_reusable(device: c_int, released_bytes: *mut usize) -> rm_status {
    boundary("rm_free_reusable", || {
        // SAFETY: NULL or valid by the caller's contract.
        unsafe { write_out(released_bytes, 0) };
        let device = (device != -1).then_some(device);
        let released = pool()?.free_reusable(device)?;
        record::emptied(device);
        // SAFETY: as above.
        unsafe { write_out(released_bytes, usize_out(released)) };
        Ok(())
    })
}

/// Make sure at least `bytes` of reusable memory is reserved on `device`, counting what is
/// already reusable first: only the shortfall is allocated, as one segment. Loading a model of
/// the same size again therefore reserves nothing new. With `RESMEM_CONF=share:true`, a
/// shortfall the driver cannot meet is asked of the other sharing processes, as in `rm_reserve`.
///
/// # Safety
/// None: all arguments are values.
#[no_mangle]
pub unsafe extern "C" fn rm_warmup(device: c_int, bytes: usize) -> rm_status {
    boundary("rm_warmup", || {
        runtime::warmup(device, size_arg(bytes))?;
        record::warmed_up(device, size_arg(bytes));
        Ok(())
    })
}

/// Fill `*out` with `device`'s figures. Reading them changes nothing (no later placement);
/// they are exact whenever no other call is in flight. Blocks waiting in a thread's front
/// cache count as reusable, not allocated.
///
/// # Safety
/// `out` is NULL or valid for writing an `rm_stats`.
#[no_mangle]
pub unsafe extern "C" fn rm_get_stats(device: c_int, out: *mut rm_stats) -> rm_status {
    boundary("rm_get_stats", || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        let stats = rm_stats::from(pool()?.stats(device)?);
        // With sharing, the reusable bytes just read are published to the other processes.
        runtime::share_counts(device, stats.reusable_bytes);
        // SAFETY: checked non-null; valid by the caller's contract.
        unsafe { write_out(out, stats) };
        Ok(())
    })
}

/// With `RESMEM_CONF=share:true`: `*given` is the bytes of idle cache this process returned
/// to the driver on `device` because other processes sharing the device asked, `*received`
/// the bytes they returned because this process asked. Zeros without sharing. (Separate from
/// `rm_stats`, whose layout the ABI promise keeps.)
///
/// # Safety
/// `given` and `received` are NULL or valid for writing a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn rm_get_share_stats(
    device: c_int,
    given: *mut u64,
    received: *mut u64,
) -> rm_status {
    boundary("rm_get_share_stats", || {
        if given.is_null() {
            return Err(null_argument("given"));
        }
        if received.is_null() {
            return Err(null_argument("received"));
        }
        let reusable = pool()?.stats(device)?.reusable_bytes;
        let (g, r) = runtime::share_counts(device, reusable);
        // SAFETY: checked non-null; valid by the caller's contract.
        unsafe {
            write_out(given, g);
            write_out(received, r);
        }
        Ok(())
    })
}

/// Set `device`'s peak figures to the current ones.
///
/// # Safety
/// None: the argument is a value.
#[no_mangle]
pub unsafe extern "C" fn rm_reset_peak_stats(device: c_int) -> rm_status {
    boundary("rm_reset_peak_stats", || pool()?.reset_peak_stats(device))
}

/// Cap what the pool may reserve on `device` at `bytes` (0: no cap; `device` -1: every device).
/// Idle cached memory above the cap goes back to the driver at once; a later `rm_reserve` that
/// would grow past the cap first returns idle cache, then fails with `RM_ERROR_OUT_OF_MEMORY`
/// naming the cap. This is what `torch.cuda.set_per_process_memory_fraction` sets.
///
/// # Safety
/// None: all arguments are values.
#[no_mangle]
pub unsafe extern "C" fn rm_set_memory_limit(device: c_int, bytes: usize) -> rm_status {
    boundary("rm_set_memory_limit", || {
        let limit = (bytes != 0).then_some(size_arg(bytes));
        pool()?
            .set_memory_limit((device != -1).then_some(device), limit)
            .map(drop)
    })
}

/// Store `device`'s cap in `*bytes`: 0 when there is none.
///
/// # Safety
/// `bytes` is NULL or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn rm_get_memory_limit(device: c_int, bytes: *mut usize) -> rm_status {
    boundary("rm_get_memory_limit", || {
        if bytes.is_null() {
            return Err(null_argument("bytes"));
        }
        let limit = pool()?.memory_limit(device)?.unwrap_or(0);
        // SAFETY: checked non-null; valid by the caller's contract.
        unsafe { write_out(bytes, usize_out(limit)) };
        Ok(())
    })
}

/// A static description of a status code, never NULL (an unknown value is described as such).
#[no_mangle]
pub extern "C" fn rm_status_string(status: c_int) -> *const c_char {
    match rm_status::from_raw(i64::from(status)) {
        Some(status) => status.describe_cstr().as_ptr(),
        None => c"unknown rm_status value".as_ptr(),
    }
}

/// This thread's last failure in words, prefixed with the function that failed; `""` if none.
/// The string stays valid until the next failing resmem call on this thread.
#[no_mangle]
pub extern "C" fn rm_last_error() -> *const c_char {
    last_error_ptr()
}

/// The library's version, e.g. `"0.1.0"`; a static string.
#[no_mangle]
pub extern "C" fn rm_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => panic!("version has a NUL"),
        };
    VERSION.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_internal_and_the_next_call_works() {
        let status = boundary("rm_test", || panic!("boom"));
        assert_eq!(status, rm_status::RM_ERROR_INTERNAL);
        let message = crate::error::last_error();
        assert!(
            message.starts_with("rm_test: internal error (boom)"),
            "{message}"
        );
        assert_eq!(boundary("rm_test", || Ok(())), rm_status::RM_SUCCESS);
        // A success leaves the last failure in place, like errno.
        assert!(crate::error::last_error().contains("boom"));
    }

    #[test]
    fn status_strings_are_never_null() {
        for raw in [-1, 0, 3, 7, 8, i32::MAX] {
            // SAFETY: rm_status_string returns a static NUL-terminated string.
            let text = unsafe { CStr::from_ptr(rm_status_string(raw)) };
            assert!(!text.to_bytes().is_empty());
        }
        // SAFETY: as above.
        let oom = unsafe { CStr::from_ptr(rm_status_string(3)) };
        assert!(oom.to_str().unwrap().starts_with("RM_ERROR_OUT_OF_MEMORY"));
    }

    #[test]
    fn version_is_the_package_version() {
        // SAFETY: rm_version returns a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(rm_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
