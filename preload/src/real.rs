//! The real CUDA functions behind the interposed names, reached through handles of their own
//! libraries (never `RTLD_NEXT`, never the global scope, so a call can never come back here):
//!
//! - the runtime (`libcudart.so.*`): the copy the program has already loaded, found among the
//!   loaded objects with `dl_iterate_phdr` and opened with `RTLD_NOLOAD` (nothing new is loaded);
//! - the driver: `RESMEM_CUDA_LIBRARY` (ignored in setuid and setgid programs), or
//!   `libcuda.so.1`, opened with `dlopen` (the program that calls a driver function has it loaded
//!   already, so this returns that copy).
//!
//! Both are looked up on the first call of a hooked function, never before, and kept once found.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

/// `cudaError_t` / `CUresult`.
pub type Status = c_int;

/// The runtime API functions the interposers need.
pub struct Runtime {
    /// `cudaMemGetInfo(size_t *free, size_t *total)`.
    pub mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> Status,
    /// `cudaGetDevice(int *device)`.
    pub get_device: unsafe extern "C" fn(*mut c_int) -> Status,
    /// `cudaMalloc(void **ptr, size_t size)`.
    pub malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Status,
    /// `cudaFree(void *ptr)`.
    pub free: unsafe extern "C" fn(*mut c_void) -> Status,
    /// `cudaDeviceSynchronize(void)`.
    pub device_synchronize: unsafe extern "C" fn() -> Status,
    /// `cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode *mode)`, where the runtime
    /// has it (CUDA 10.1 and later).
    pub exchange_capture_mode: Option<ExchangeCaptureMode>,
    /// `cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *ptr)`, where the runtime has it.
    pub ipc_get_mem_handle: Option<IpcGetMemHandle>,
}

/// `cudaIpcGetMemHandle` and `cuIpcGetMemHandle`: the 64-byte handle of the allocation holding
/// a device address.
pub type IpcGetMemHandle = unsafe extern "C" fn(*mut [u8; 64], u64) -> Status;

/// `cudaThreadExchangeStreamCaptureMode` and `cuThreadExchangeStreamCaptureMode`: the calling
/// thread's stream-capture mode set to `*mode`, the old one written there.
pub type ExchangeCaptureMode = unsafe extern "C" fn(*mut c_int) -> Status;

/// The driver API functions the interposers need.
pub struct Driver {
    /// `cuMemGetInfo_v2(size_t *free, size_t *total)`.
    pub mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> Status,
    /// `cuCtxGetDevice(CUdevice *device)`.
    pub ctx_get_device: unsafe extern "C" fn(*mut c_int) -> Status,
    /// `cuMemAlloc_v2(CUdeviceptr *ptr, size_t size)`.
    pub mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> Status,
    /// `cuMemFree_v2(CUdeviceptr ptr)`.
    pub mem_free: unsafe extern "C" fn(u64) -> Status,
    /// `cuCtxSynchronize(void)`.
    pub ctx_synchronize: unsafe extern "C" fn() -> Status,
    /// `cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)`, where the driver has it.
    pub exchange_capture_mode: Option<ExchangeCaptureMode>,
    /// `cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr ptr)`, where the driver has it.
    pub ipc_get_mem_handle: Option<IpcGetMemHandle>,
}

/// Resolve `name` on `handle` as a function pointer of type `F`.
///
/// # Safety
/// `handle` is a live `dlopen` handle, and the symbol `name`, if present, has type `F`.
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &CStr) -> Option<F> {
    // SAFETY: handle is live and name is NUL-terminated (caller's contract).
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        return None;
    }
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: F is a function pointer type of the symbol's signature (caller's contract), the
    // same size as the address.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

/// The path of the first loaded object whose file name starts with `libcudart.so`.
fn loaded_cudart() -> Option<CString> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info, and `data` is the Option below.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Option<CString>)) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a non-null dlpi_name is a NUL-terminated path.
        let path = unsafe { CStr::from_ptr(info.dlpi_name as *const c_char) };
        let file = path.to_bytes().rsplit(|&b| b == b'/').next().unwrap_or(b"");
        if file.starts_with(b"libcudart.so") {
            *found = Some(path.to_owned());
            return 1;
        }
        0
    }
    let mut found: Option<CString> = None;
    // SAFETY: the callback only reads what it is given and writes `found`, which outlives the
    // call.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut found as *mut _ as *mut c_void) };
    found
}

fn runtime_from_loaded() -> Option<Runtime> {
    let path = loaded_cudart()?;
    // SAFETY: path is NUL-terminated; RTLD_NOLOAD only returns an already loaded object.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: the handle is live (never closed) and each name has the type of its field.
    unsafe {
        Some(Runtime {
            mem_get_info: symbol(handle, c"cudaMemGetInfo")?,
            get_device: symbol(handle, c"cudaGetDevice")?,
            malloc: symbol(handle, c"cudaMalloc")?,
            free: symbol(handle, c"cudaFree")?,
            device_synchronize: symbol(handle, c"cudaDeviceSynchronize")?,
            exchange_capture_mode: symbol(handle, c"cudaThreadExchangeStreamCaptureMode"),
            ipc_get_mem_handle: symbol(handle, c"cudaIpcGetMemHandle"),
        })
    }
}

fn driver_from_library() -> Option<Driver> {
    // Through the guarded reader: ignored in a privileged (AT_SECURE) process.
    let library = resmem::runtime::var("RESMEM_CUDA_LIBRARY")
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| resmem::config::DEFAULT_CUDA_LIBRARY.to_string());
    let name = CString::new(library).ok()?;
    // SAFETY: name is NUL-terminated; the handle is kept for the life of the process.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: as above.
    unsafe {
        Some(Driver {
            mem_get_info: symbol(handle, c"cuMemGetInfo_v2")?,
            ctx_get_device: symbol(handle, c"cuCtxGetDevice")?,
            mem_alloc: symbol(handle, c"cuMemAlloc_v2")?,
            mem_free: symbol(handle, c"cuMemFree_v2")?,
            ctx_synchronize: symbol(handle, c"cuCtxSynchronize")?,
            exchange_capture_mode: symbol(handle, c"cuThreadExchangeStreamCaptureMode"),
            ipc_get_mem_handle: symbol(handle, c"cuIpcGetMemHandle"),
        })
    }
}

/// The program's CUDA runtime, once it has loaded one. Not finding it is not remembered: the
/// program may load the runtime later.
pub fn runtime() -> Option<&'static Runtime> {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    if let Some(runtime) = RUNTIME.get() {
        return Some(runtime);
    }
    let found = runtime_from_loaded()?;
    Some(RUNTIME.get_or_init(|| found))
}

/// The CUDA driver library, once it can be opened.
pub fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    if let Some(driver) = DRIVER.get() {
        return Some(driver);
    }
    let found = driver_from_library()?;
    Some(DRIVER.get_or_init(|| found))
}
