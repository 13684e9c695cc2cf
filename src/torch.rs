//! PyTorch's pluggable-allocator entry points: functions with exactly the types
//! `torch.cuda.memory.CUDAPluggableAllocator` calls (`torch/csrc/cuda/CUDAPluggableAllocator.h`),
//! so that `libresmem.so` can be PyTorch's CUDA allocator with no glue library in between.
//!
//! | PyTorch calls                                   | with                                  |
//! | ----------------------------------------------- | ------------------------------------- |
//! | `alloc_fn(size, device, stream)`                | [`rm_torch_malloc`]                   |
//! | `free_fn(ptr, size, device, stream)`            | [`rm_torch_free`]                     |
//! | `init_fn(device_count)` (`set_init_fn`)         | [`rm_torch_init`]                     |
//! | `reset_fn()` (`set_reset_fn`, `empty_cache`)    | [`rm_torch_empty_cache`]              |
//! | `memory_fraction_fn(fraction, device)`          | [`rm_torch_set_memory_fraction`]      |
//! | `record_stream_fn(ptr, stream)`                 | [`rm_torch_record_stream`]            |
//!
//! The hooks return nothing (PyTorch's types), so a failure is left in `rm_last_error()`; the
//! allocation function returns NULL on failure. Each goes through the same panic boundary as the
//! rest of the C API and never unwinds into PyTorch.

use std::ffi::{c_double, c_int, c_void};

use crate::capi::{boundary, pool};
use crate::driver::DevicePtr;
use crate::error::Error;
use crate::record;

/// `ssize_t`, the size type of PyTorch's allocation functions (declared by `<sys/types.h>`).
#[allow(non_camel_case_types)]
pub type ssize_t = isize;

/// Allocate `size` bytes on `device` for use on `stream` (a `cudaStream_t`): PyTorch's
/// `alloc_fn`. Size 0 returns NULL, as PyTorch expects of an empty tensor. A negative size, or a
/// failure (out of memory, bad device, no driver), returns NULL with `rm_last_error()` saying why.
///
/// # Safety
/// None beyond passing values: `stream` is handed to the driver, never dereferenced here.
#[no_mangle]
pub unsafe extern "C" fn rm_torch_malloc(
    size: ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    if let Some(ptr) = u64::try_from(size).ok().and_then(|size| {
        crate::capi::reserve_hit::<{ crate::capi::site::TORCH }>(device, size, stream)
    }) {
        return ptr as *mut c_void;
    }
    malloc_call(size, device, stream)
}

/// [`rm_torch_malloc`] past its hit path: a key displaced from its home bin, then the full path.
#[cold]
#[inline(never)]
fn malloc_call(size: ssize_t, device: c_int, stream: *mut c_void) -> *mut c_void {
    if let Some(ptr) = u64::try_from(size)
        .ok()
        .and_then(|size| crate::capi::reserve_probed(device, size, stream))
    {
        return ptr as *mut c_void;
    }
    let mut ptr: DevicePtr = 0;
    boundary("rm_torch_malloc", || {
        let size = u64::try_from(size).map_err(|_| {
            Error::invalid_value(format!(
                "size {size} is negative; pass the number of bytes to allocate"
            ))
        })?;
        let stream = crate::capi::stream_key(stream);
        let outcome = crate::runtime::reserve(device, size, stream);
        record::reserved(device, size, stream, &outcome);
        ptr = outcome?;
        Ok(())
    });
    ptr as *mut c_void
}

/// Give back a block from [`rm_torch_malloc`]: PyTorch's `free_fn`. The pool knows the block's
/// size, device and stream, so those arguments are accepted for the signature's sake. NULL does
/// nothing; an unknown pointer leaves a message in `rm_last_error()` and changes nothing.
///
/// # Safety
/// None beyond passing values: the pointer is looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn rm_torch_free(
    ptr: *mut c_void,
    size: ssize_t,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = (size, device, stream);
    if !crate::capi::release_hit::<{ crate::capi::site::TORCH }>(ptr) {
        free_call(ptr);
    }
}

/// [`rm_torch_free`] past its hit path: a block the front knows, then the full path.
#[cold]
#[inline(never)]
fn free_call(ptr: *mut c_void) {
    if crate::capi::release_known("rm_torch_free", ptr).is_some() {
        return;
    }
    boundary("rm_torch_free", || {
        let pool = pool()?;
        record::release(ptr as DevicePtr, || pool.release(ptr as DevicePtr))
    });
}

/// PyTorch's `init_fn`, called with the number of devices: starts the pool (loads the driver)
/// so that a missing driver shows up in `rm_last_error()` before the first allocation.
///
/// # Safety
/// None: the argument is a value.
#[no_mangle]
pub unsafe extern "C" fn rm_torch_init(device_count: c_int) {
    let _ = device_count;
    boundary("rm_torch_init", || pool().map(drop));
}

/// PyTorch's `reset_fn`, which `torch.cuda.empty_cache()` calls: return every idle cached
/// segment on every device to the driver (`rm_free_reusable(-1, NULL)`).
///
/// # Safety
/// None: there are no arguments.
#[no_mangle]
pub unsafe extern "C" fn rm_torch_empty_cache() {
    boundary("rm_torch_empty_cache", || {
        pool()?.free_reusable(None)?;
        record::emptied(None);
        Ok(())
    });
}

/// PyTorch's `memory_fraction_fn`, which `torch.cuda.set_per_process_memory_fraction(fraction,
/// device)` calls: cap what the pool reserves on `device` at `fraction` of its total memory
/// (rounded down to a byte). Past the cap `rm_torch_malloc` fails with out-of-memory and a
/// message naming the cap. A fraction outside 0..=1 is refused and changes nothing.
///
/// # Safety
/// None: all arguments are values.
#[no_mangle]
pub unsafe extern "C" fn rm_torch_set_memory_fraction(fraction: c_double, device: c_int) {
    boundary("rm_torch_set_memory_fraction", || {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::invalid_value(format!(
                "fraction {fraction} is not between 0 and 1"
            )));
        }
        let pool = pool()?;
        let (_, total) = pool.mem_get_info(device)?;
        let limit = (fraction * total as f64) as u64;
        pool.set_memory_limit(Some(device), Some(limit)).map(drop)
    });
}

/// PyTorch's `record_stream_fn`, which `Tensor.record_stream(stream)` calls: the block at `ptr`
/// is also used on `stream`, so its reuse waits for that stream's work (`rm_record_stream`).
///
/// # Safety
/// None beyond passing values: the pointers are looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn rm_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    boundary("rm_torch_record_stream", || {
        if ptr.is_null() {
            return Err(Error::invalid_pointer(
                "ptr is NULL; pass a block returned by rm_torch_malloc",
            ));
        }
        let pool = pool()?;
        let stream = crate::capi::stream_key(stream);
        record::record_stream(ptr as DevicePtr, stream, || {
            pool.record_stream(ptr as DevicePtr, stream)
        })
    });
}
