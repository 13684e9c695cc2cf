//! The real CUDA driver, loaded at run time.
//!
//! The library (`libcuda.so.1`, or `RESMEM_CUDA_LIBRARY`) is opened with `dlopen` and every
//! function resmem uses is looked up on that handle up front, into a typed table: a missing
//! symbol is a load error naming it, never a crash later. Looking symbols up on the driver's own
//! handle (not `RTLD_NEXT` or `RTLD_DEFAULT`) keeps working when resmem itself is preloaded and
//! interposes some of them. Every call runs inside the device's primary context, pushed before
//! and popped after, so the caller's current context is left as it was.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use super::{
    per_thread, DevicePtr, Driver, DriverError, DriverResult, EventHandle, PhysHandle, StreamHandle,
};
use crate::error::{rm_status, Error};

type CUresult = c_int;
type CUdevice = c_int;
type CUcontext = *mut c_void;
type CUstream = *mut c_void;
type CUevent = *mut c_void;
type CUdeviceptr = u64;

const CUDA_SUCCESS: CUresult = 0;
const CUDA_ERROR_NOT_READY: CUresult = 600;
/// What a driver answers for an argument or a property it does not take.
const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;

/// Declares the function table and its resolver: field, exported symbol, parameter types.
macro_rules! driver_table {
    ($(#[$doc:meta])* $table:ident { $( $field:ident = $symbol:literal ( $($arg:ty),* ); )* }) => {
        $(#[$doc])*
        struct $table {
            $( $field: unsafe extern "C" fn($($arg),*) -> CUresult, )*
        }

        impl $table {
            /// The names of every symbol the table needs.
            const SYMBOLS: &'static [&'static str] = &[$($symbol),*];

            /// Look every function up on `handle`; the names of those missing on failure.
            ///
            /// # Safety
            /// `handle` is a live `dlopen` handle of a library whose symbols of these names have
            /// the CUDA driver API's signatures, as declared here.
            unsafe fn resolve(handle: *mut c_void) -> Result<$table, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    let name = concat!($symbol, "\0");
                    // SAFETY: `handle` is live (caller's contract) and `name` is NUL-terminated.
                    let $field = unsafe { libc::dlsym(handle, name.as_ptr().cast()) };
                    if $field.is_null() {
                        missing.push($symbol);
                    }
                )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok($table {
                    $(
                        // SAFETY: the symbol is non-null and, by the caller's contract, a function
                        // with exactly this C signature; fn pointers and data pointers have the
                        // same size on every platform CUDA supports.
                        $field: unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CUresult>($field)
                        },
                    )*
                })
            }
        }
    };
}

driver_table! {
    /// The driver functions resmem needs, resolved from the library handle.
    Table {
    init = "cuInit"(c_uint);
    driver_get_version = "cuDriverGetVersion"(*mut c_int);
    device_get_count = "cuDeviceGetCount"(*mut c_int);
    device_get = "cuDeviceGet"(*mut CUdevice, c_int);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain"(*mut CUcontext, CUdevice);
    primary_ctx_release = "cuDevicePrimaryCtxRelease_v2"(CUdevice);
    ctx_push = "cuCtxPushCurrent_v2"(CUcontext);
    ctx_pop = "cuCtxPopCurrent_v2"(*mut CUcontext);
    ctx_synchronize = "cuCtxSynchronize"();
    mem_get_info = "cuMemGetInfo_v2"(*mut usize, *mut usize);
    mem_alloc = "cuMemAlloc_v2"(*mut CUdeviceptr, usize);
    mem_free = "cuMemFree_v2"(CUdeviceptr);
    event_create = "cuEventCreate"(*mut CUevent, c_uint);
    event_destroy = "cuEventDestroy_v2"(CUevent);
    event_record = "cuEventRecord"(CUevent, CUstream);
    event_query = "cuEventQuery"(CUevent);
    event_synchronize = "cuEventSynchronize"(CUevent);
    stream_wait_event = "cuStreamWaitEvent"(CUstream, CUevent, c_uint);
    get_error_name = "cuGetErrorName"(CUresult, *mut *const c_char);
    get_error_string = "cuGetErrorString"(CUresult, *mut *const c_char);
    }
}

driver_table! {
    /// The virtual-memory API (CUDA 10.2 and later), used when present.
    VmmTable {
    device_get_attribute = "cuDeviceGetAttribute"(*mut c_int, c_int, CUdevice);
    granularity = "cuMemGetAllocationGranularity"(*mut usize, *const MemAllocationProp, c_int);
    address_reserve = "cuMemAddressReserve"(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    address_free = "cuMemAddressFree"(CUdeviceptr, usize);
    create = "cuMemCreate"(*mut u64, usize, *const MemAllocationProp, u64);
    release = "cuMemRelease"(u64);
    map = "cuMemMap"(CUdeviceptr, usize, usize, u64, u64);
    unmap = "cuMemUnmap"(CUdeviceptr, usize);
    set_access = "cuMemSetAccess"(CUdeviceptr, usize, *const MemAccessDesc, usize);
    }
}

driver_table! {
    /// The device's UUID (CUDA 9.2 and later), used when processes share idle cache.
    UuidTable {
    device_get_uuid = "cuDeviceGetUuid"(*mut [u8; 16], CUdevice);
    }
}

driver_table! {
    /// Whether one device can use another's memory, asked before giving peers access to it.
    PeerTable {
    can_access_peer = "cuDeviceCanAccessPeer"(*mut c_int, CUdevice, CUdevice);
    }
}

/// `CUmemLocation`.
#[repr(C)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemAllocationProp`.
#[repr(C)]
struct MemAllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location: MemLocation,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
struct MemAccessDesc {
    location: MemLocation,
    flags: c_int,
}

const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 110;
/// The byte of `CUmemAllocationProp::allocFlags` that is `gpuDirectRDMACapable`.
const ALLOC_FLAG_GPU_DIRECT_RDMA: usize = 1;

/// A pinned allocation on `device`.
fn device_prop(device: i32) -> MemAllocationProp {
    MemAllocationProp {
        kind: CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: 0,
        location: MemLocation {
            kind: CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

/// The names of the driver functions resmem loads (for documentation and tests).
pub fn required_symbols() -> &'static [&'static str] {
    Table::SYMBOLS
}

/// The names of the virtual-memory functions resmem uses when the library has them.
pub fn optional_symbols() -> &'static [&'static str] {
    VmmTable::SYMBOLS
}

/// The name of the function that identifies a device, needed only to share idle cache with
/// other processes.
pub fn uuid_symbols() -> &'static [&'static str] {
    UuidTable::SYMBOLS
}

/// The name of the function that says whether one device can use another's memory, needed
/// only to give peers access to the pool's mapped memory.
pub fn peer_symbols() -> &'static [&'static str] {
    PeerTable::SYMBOLS
}

/// The CUDA driver, loaded from a shared library.
pub struct CudaDriver {
    library: String,
    table: Table,
    /// The virtual-memory API, if the library exports it.
    vmm: Option<VmmTable>,
    /// `cuDeviceGetUuid`, if the library exports it.
    uuid: Option<UuidTable>,
    /// `cuDeviceCanAccessPeer`, if the library exports it.
    peer: Option<PeerTable>,
    version: c_int,
    devices: Vec<CUdevice>,
    /// Each device's primary context, retained on first use.
    contexts: Vec<OnceLock<usize>>,
    /// Per device, whether `cuMemMap` maps memory at an offset into an allocation and one
    /// allocation in two places at once, once a probe could tell (`maps_at_offsets`).
    offsets: Vec<OnceLock<bool>>,
    /// Per device, whether `cuMemCreate` takes the GPUDirect RDMA flag, asked at the first
    /// creation (`rdma_capable`).
    rdma: Vec<OnceLock<bool>>,
    /// Per device, whether a creation with the flag failed where one without it succeeded: the
    /// flag is not asked for again.
    rdma_refused: Vec<AtomicBool>,
}

// SAFETY: the table holds plain function pointers into the driver, which is thread-safe; the
// contexts are stored as addresses and only ever passed back to the driver.
unsafe impl Send for CudaDriver {}
// SAFETY: as above; all mutation goes through `OnceLock`.
unsafe impl Sync for CudaDriver {}

fn no_driver(message: String) -> Error {
    Error::new(rm_status::RM_ERROR_NO_DRIVER, message)
}

impl CudaDriver {
    /// Load `library` (a path or a name the dynamic loader searches for), resolve the table,
    /// initialise the driver and enumerate the devices.
    pub fn load(library: &str) -> Result<CudaDriver, Error> {
        let advice = "install the NVIDIA driver, set RESMEM_CUDA_LIBRARY to the driver library's \
                      path, or set RESMEM_DRIVER=sim to use simulated devices";
        let name = CString::new(library)
            .map_err(|_| no_driver(format!("RESMEM_CUDA_LIBRARY contains a NUL byte; {advice}")))?;
        // SAFETY: `name` is NUL-terminated; dlopen has no other preconditions. The handle is
        // never closed: the driver stays loaded for the life of the process, as it must while
        // device memory it handed out is in use.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(no_driver(format!(
                "could not load the CUDA driver library {library:?}: {}; {advice}",
                dlerror_text()
            )));
        }
        // SAFETY: `handle` was just opened and is never closed; the library is a CUDA driver
        // (or a stand-in exporting the same API), whose symbols have the declared signatures.
        let table = unsafe { Table::resolve(handle) }.map_err(|missing| {
            no_driver(format!(
                "{library:?} is not a usable CUDA driver: it lacks {}; {advice}",
                missing.join(", ")
            ))
        })?;
        // SAFETY: as for the table above.
        let vmm = unsafe { VmmTable::resolve(handle) }.ok();
        // SAFETY: as for the table above.
        let uuid = unsafe { UuidTable::resolve(handle) }.ok();
        // SAFETY: as for the table above.
        let peer = unsafe { PeerTable::resolve(handle) }.ok();
        let mut driver = CudaDriver {
            library: library.to_string(),
            table,
            vmm,
            uuid,
            peer,
            version: 0,
            devices: Vec::new(),
            contexts: Vec::new(),
            offsets: Vec::new(),
            rdma: Vec::new(),
            rdma_refused: Vec::new(),
        };
        let init_failed = |e: DriverError| no_driver(format!("{e}; {advice}"));
        // SAFETY: cuInit takes flags 0; the table entries have the declared signatures.
        driver
            .check("cuInit", unsafe { (driver.table.init)(0) })
            .map_err(init_failed)?;
        let mut version = 0;
        // SAFETY: the out-pointer is valid for the call.
        driver
            .check("cuDriverGetVersion", unsafe {
                (driver.table.driver_get_version)(&mut version)
            })
            .map_err(init_failed)?;
        let mut count = 0;
        // SAFETY: the out-pointer is valid for the call.
        driver
            .check("cuDeviceGetCount", unsafe {
                (driver.table.device_get_count)(&mut count)
            })
            .map_err(init_failed)?;
        let mut devices = Vec::new();
        for ordinal in 0..count {
            let mut device = 0;
            // SAFETY: the out-pointer is valid and the ordinal is below the device count.
            driver
                .check("cuDeviceGet", unsafe {
                    (driver.table.device_get)(&mut device, ordinal)
                })
                .map_err(init_failed)?;
            devices.push(device);
        }
        driver.version = version;
        driver.contexts = devices.iter().map(|_| OnceLock::new()).collect();
        driver.offsets = devices.iter().map(|_| OnceLock::new()).collect();
        driver.rdma = devices.iter().map(|_| OnceLock::new()).collect();
        driver.rdma_refused = devices.iter().map(|_| AtomicBool::new(false)).collect();
        driver.devices = devices;
        Ok(driver)
    }

    /// The driver's version, e.g. 12040 for CUDA 12.4.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Whether `device`'s `cuMemCreate` takes the GPUDirect RDMA flag
    /// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`), asked once; no where the
    /// driver cannot say.
    pub fn rdma_capable(&self, device: i32) -> bool {
        let Some(d) = usize::try_from(device)
            .ok()
            .filter(|&d| d < self.rdma.len())
        else {
            return false;
        };
        if self.rdma_refused[d].load(Ordering::Relaxed) {
            return false;
        }
        let once = &self.rdma[d];
        *once.get_or_init(|| {
            let (Some(vmm), Some(&dev)) = (&self.vmm, self.devices.get(device as usize)) else {
                return false;
            };
            let mut value: c_int = 0;
            // SAFETY: the out-pointer is valid; the device came from cuDeviceGet; the call
            // needs no current context.
            let status = unsafe {
                (vmm.device_get_attribute)(
                    &mut value,
                    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                    dev,
                )
            };
            status == CUDA_SUCCESS && value == 1
        })
    }

    /// `Ok` for `CUDA_SUCCESS`, else an error naming `call` and the result.
    fn check(&self, call: &'static str, result: CUresult) -> DriverResult<()> {
        if result == CUDA_SUCCESS {
            return Ok(());
        }
        Err(DriverError {
            call,
            code: result,
            name: self
                .error_text(self.table.get_error_name, result)
                .unwrap_or_else(|| format!("CUresult {result}")),
            description: self
                .error_text(self.table.get_error_string, result)
                .unwrap_or_else(|| "unknown error".to_string()),
        })
    }

    fn error_text(
        &self,
        getter: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
        result: CUresult,
    ) -> Option<String> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: the out-pointer is valid; the driver stores a static string or leaves NULL.
        let status = unsafe { getter(result, &mut text) };
        if status != CUDA_SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: on success the driver points `text` at a static NUL-terminated string.
        Some(
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// The primary context of `device`, retained on first use.
    fn context(&self, device: i32) -> DriverResult<CUcontext> {
        let ordinal = usize::try_from(device)
            .ok()
            .filter(|&d| d < self.devices.len());
        let Some(ordinal) = ordinal else {
            return Err(DriverError {
                call: "cuDevicePrimaryCtxRetain",
                code: 101,
                name: "CUDA_ERROR_INVALID_DEVICE".to_string(),
                description: "invalid device ordinal".to_string(),
            });
        };
        if let Some(&ctx) = self.contexts[ordinal].get() {
            return Ok(ctx as CUcontext);
        }
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid and the device handle came from cuDeviceGet.
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.table.primary_ctx_retain)(&mut ctx, self.devices[ordinal])
        })?;
        if self.contexts[ordinal].set(ctx as usize).is_err() {
            // Another thread retained it first: keep one reference only.
            // SAFETY: this thread's retain above succeeded, so there is a reference to drop.
            unsafe { (self.table.primary_ctx_release)(self.devices[ordinal]) };
        }
        Ok(ctx)
    }

    /// Run `call` with `device`'s primary context current, then restore the caller's.
    ///
    /// The result is the call's: a call that took effect (memory allocated or freed) is reported
    /// as done even if popping the context afterwards fails, since the pool's books must follow
    /// what the driver did. Reporting such an allocation as failed would leak it; reporting such
    /// a free as failed would keep freed memory in the cache and hand it out again.
    fn in_context(
        &self,
        device: i32,
        name: &'static str,
        call: impl FnOnce(&Table) -> CUresult,
    ) -> DriverResult<()> {
        self.in_context_with(device, name, || call(&self.table))
    }

    /// Run a virtual-memory call in `device`'s primary context; the API must be present.
    fn vmm_call(
        &self,
        device: i32,
        name: &'static str,
        call: impl FnOnce(&VmmTable) -> CUresult,
    ) -> DriverResult<()> {
        let Some(vmm) = &self.vmm else {
            return Err(DriverError {
                call: name,
                code: CUDA_ERROR_NOT_SUPPORTED,
                name: "CUDA_ERROR_NOT_SUPPORTED".to_string(),
                description: "the driver library lacks the virtual-memory API".to_string(),
            });
        };
        self.in_context_with(device, name, || call(vmm))
    }

    fn in_context_with(
        &self,
        device: i32,
        name: &'static str,
        call: impl FnOnce() -> CUresult,
    ) -> DriverResult<()> {
        let ctx = self.context(device)?;
        // SAFETY: `ctx` is a retained primary context of this driver.
        self.check("cuCtxPushCurrent_v2", unsafe { (self.table.ctx_push)(ctx) })?;
        let result = call();
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: the push above succeeded, so there is a context to pop; the out-pointer is valid.
        // A failed pop leaves this device's context current on the thread, which every later call
        // pushes again anyway; there is nothing better to do with it.
        let _ = unsafe { (self.table.ctx_pop)(&mut popped) };
        self.check(name, result)
    }

    /// The virtual-memory API's granularity on `device` and whether its `cuMemMap` maps at
    /// offsets into an allocation (probed once, `maps_at_offsets`); `None` without the API.
    fn vmm_support(&self, device: i32) -> Option<(u64, bool)> {
        let mut supported: c_int = 0;
        // SAFETY: the out-pointer is valid; the device handle came from cuDeviceGet.
        let dev = *self.devices.get(usize::try_from(device).ok()?)?;
        self.vmm_call(device, "cuDeviceGetAttribute", |v| unsafe {
            (v.device_get_attribute)(
                &mut supported,
                CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                dev,
            )
        })
        .ok()?;
        if supported == 0 {
            return None;
        }
        let mut granularity = 0usize;
        let prop = device_prop(dev);
        // SAFETY: the out-pointer and the property are valid for the call.
        self.vmm_call(device, "cuMemGetAllocationGranularity", |v| unsafe {
            (v.granularity)(&mut granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })
        .ok()?;
        let granularity = u64::try_from(granularity).ok().filter(|&g| g > 0)?;
        // Asked once per device; where the probe cannot tell, the call's description holds.
        let known = &self.offsets[usize::try_from(device).ok()?];
        let offsets = match known.get() {
            Some(&offsets) => offsets,
            None => match self.maps_at_offsets(device, granularity) {
                Some(offsets) => *known.get_or_init(|| offsets),
                None => true,
            },
        };
        Some((granularity, offsets))
    }

    /// Whether the driver maps memory at an offset into a physical allocation, and one
    /// allocation in two places at once, as page-granular reuse needs (a cached page is mapped
    /// into a new range while the rest of its allocation stays where it is). The API's
    /// description of `cuMemMap` allows any granularity-aligned offset, but its note on the
    /// parameter still says "currently must be zero"; so it is tried once per device, on two
    /// pages of `granularity` bytes: the allocation's second page mapped first, then its first
    /// page after it, both unmapped and everything given back. `Some(false)` where the driver
    /// refuses either mapping as invalid or unsupported; `None` where the probe could not run
    /// (no memory for its two pages, say) or failed otherwise.
    fn maps_at_offsets(&self, device: i32, granularity: u64) -> Option<bool> {
        let handle = self.vmm_create(device, 2 * granularity).ok()?;
        let answer = self
            .vmm_reserve(device, 2 * granularity)
            .ok()
            .and_then(|va| {
                // The second page first (an offset), then the first after it (a second mapping).
                let mut mapped = Vec::new();
                let mut refused = None;
                for (at, offset) in [(va, granularity), (va + granularity, 0)] {
                    match self.vmm_map(device, at, granularity, handle, offset) {
                        Ok(()) => mapped.push(at),
                        Err(e) => {
                            refused = Some(e);
                            break;
                        }
                    }
                }
                // A failure to undo cannot be mended here and has no caller to tell: at worst the
                // probe's two pages stay with the driver.
                for at in mapped {
                    let _ = self.vmm_unmap(device, at, granularity);
                }
                let _ = self.vmm_free(device, va, 2 * granularity);
                match refused {
                    None => Some(true),
                    Some(e) => [CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED]
                        .contains(&e.code)
                        .then_some(false),
                }
            });
        let _ = self.vmm_release(device, handle);
        answer
    }
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread, which we copy at once.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown dlopen error".to_string()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Driver for CudaDriver {
    fn describe(&self) -> String {
        format!(
            "the CUDA driver {}.{} ({})",
            self.version / 1000,
            self.version % 1000 / 10,
            self.library
        )
    }

    fn device_count(&self) -> i32 {
        self.devices.len() as i32
    }

    fn mem_get_info(&self, device: i32) -> DriverResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are valid for the call.
        self.in_context(device, "cuMemGetInfo_v2", |t| unsafe {
            (t.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    fn device_uuid(&self, device: i32) -> DriverResult<[u8; 16]> {
        let call = "cuDeviceGetUuid";
        let Some(table) = &self.uuid else {
            return Err(DriverError {
                call,
                code: CUDA_ERROR_NOT_SUPPORTED,
                name: "CUDA_ERROR_NOT_SUPPORTED".to_string(),
                description: "the driver library lacks cuDeviceGetUuid".to_string(),
            });
        };
        let handle = usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| DriverError {
                call,
                code: 101,
                name: "CUDA_ERROR_INVALID_DEVICE".to_string(),
                description: "invalid device ordinal".to_string(),
            })?;
        let mut uuid = [0u8; 16];
        // SAFETY: the out-pointer is valid for 16 bytes (a CUuuid); the device came from
        // cuDeviceGet; the call needs no current context.
        self.check(call, unsafe { (table.device_get_uuid)(&mut uuid, *handle) })?;
        Ok(uuid)
    }

    fn mem_alloc(&self, device: i32, bytes: u64) -> DriverResult<DevicePtr> {
        let mut ptr: CUdeviceptr = 0;
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        // SAFETY: the out-pointer is valid for the call.
        self.in_context(device, "cuMemAlloc_v2", |t| unsafe {
            (t.mem_alloc)(&mut ptr, bytes)
        })?;
        Ok(ptr)
    }

    fn mem_free(&self, device: i32, ptr: DevicePtr) -> DriverResult<()> {
        // SAFETY: `ptr` came from cuMemAlloc_v2 on this device and is freed once.
        self.in_context(device, "cuMemFree_v2", |t| unsafe { (t.mem_free)(ptr) })
    }

    fn event_create(&self, device: i32) -> DriverResult<EventHandle> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for the call.
        self.in_context(device, "cuEventCreate", |t| unsafe {
            (t.event_create)(&mut event, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(event as EventHandle)
    }

    fn event_destroy(&self, device: i32, event: EventHandle) -> DriverResult<()> {
        // SAFETY: `event` came from cuEventCreate and is destroyed once.
        self.in_context(device, "cuEventDestroy_v2", |t| unsafe {
            (t.event_destroy)(event as CUevent)
        })
    }

    fn event_record(
        &self,
        device: i32,
        event: EventHandle,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        let stream = per_thread::handle("cuEventRecord", stream)?;
        // SAFETY: handles are the driver's own, passed back unchanged.
        self.in_context(device, "cuEventRecord", |t| unsafe {
            (t.event_record)(event as CUevent, stream as CUstream)
        })
    }

    fn event_query(&self, device: i32, event: EventHandle) -> DriverResult<bool> {
        let mut not_ready = false;
        // SAFETY: `event` is the driver's own handle.
        self.in_context(device, "cuEventQuery", |t| {
            match unsafe { (t.event_query)(event as CUevent) } {
                CUDA_ERROR_NOT_READY => {
                    not_ready = true;
                    CUDA_SUCCESS
                }
                other => other,
            }
        })?;
        Ok(!not_ready)
    }

    fn event_synchronize(&self, device: i32, event: EventHandle) -> DriverResult<()> {
        // SAFETY: `event` is the driver's own handle.
        self.in_context(device, "cuEventSynchronize", |t| unsafe {
            (t.event_synchronize)(event as CUevent)
        })
    }

    fn stream_wait_event(
        &self,
        device: i32,
        stream: StreamHandle,
        event: EventHandle,
    ) -> DriverResult<()> {
        let stream = per_thread::handle("cuStreamWaitEvent", stream)?;
        // SAFETY: handles are the driver's own; flags must be 0.
        self.in_context(device, "cuStreamWaitEvent", |t| unsafe {
            (t.stream_wait_event)(stream as CUstream, event as CUevent, 0)
        })
    }

    fn synchronize(&self, device: i32) -> DriverResult<()> {
        // SAFETY: no arguments; acts on the pushed primary context.
        self.in_context(device, "cuCtxSynchronize", |t| unsafe {
            (t.ctx_synchronize)()
        })
    }

    fn vmm_granularity(&self, device: i32) -> Option<u64> {
        let (granularity, offsets) = self.vmm_support(device)?;
        offsets.then_some(granularity)
    }

    fn vmm_whole_granularity(&self, device: i32) -> Option<u64> {
        let (granularity, offsets) = self.vmm_support(device)?;
        (!offsets).then_some(granularity)
    }

    fn vmm_reserve(&self, device: i32, size: u64) -> DriverResult<DevicePtr> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the out-pointer is valid; no fixed address, default alignment, flags 0.
        self.vmm_call(device, "cuMemAddressReserve", |v| unsafe {
            (v.address_reserve)(&mut ptr, size as usize, 0, 0, 0)
        })?;
        Ok(ptr)
    }

    fn vmm_free(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        // SAFETY: a range this driver reserved, with nothing mapped in it.
        self.vmm_call(device, "cuMemAddressFree", |v| unsafe {
            (v.address_free)(ptr, size as usize)
        })
    }

    fn vmm_create(&self, device: i32, size: u64) -> DriverResult<PhysHandle> {
        let mut handle = 0u64;
        let dev = self.devices.get(device as usize).copied().unwrap_or(device);
        let mut prop = device_prop(dev);
        // As cudaMalloc memory is, where the device allows it: a network card may then read
        // and write the memory directly (GPUDirect RDMA: a KV cache sent between machines,
        // NCCL's registered buffers). Refused where the device does not allow it.
        let rdma = self.rdma_capable(device);
        if rdma {
            prop.alloc_flags[ALLOC_FLAG_GPU_DIRECT_RDMA] = 1;
        }
        // SAFETY: the out-pointer and the property are valid for the call; flags 0.
        let create = |prop: &MemAllocationProp, handle: &mut u64| {
            self.vmm_call(device, "cuMemCreate", |v| unsafe {
                (v.create)(handle, size as usize, prop, 0)
            })
        };
        match create(&prop, &mut handle) {
            // A driver that says the device takes the flag and refuses it all the same (an
            // invalid or unsupported property): asked once more without it, and never again
            // where that succeeds. Any other error (out of memory, a device in an error state)
            // is the creation's answer, flag or not, and goes back as it is.
            Err(e)
                if rdma
                    && (e.code == CUDA_ERROR_INVALID_VALUE
                        || e.code == CUDA_ERROR_NOT_SUPPORTED) =>
            {
                prop.alloc_flags[ALLOC_FLAG_GPU_DIRECT_RDMA] = 0;
                create(&prop, &mut handle).map_err(|_| e)?;
                self.rdma_refused[device as usize].store(true, Ordering::Relaxed);
            }
            done => done?,
        }
        Ok(handle)
    }

    fn vmm_release(&self, device: i32, handle: PhysHandle) -> DriverResult<()> {
        // SAFETY: a handle from cuMemCreate, released once.
        self.vmm_call(device, "cuMemRelease", |v| unsafe { (v.release)(handle) })
    }

    fn vmm_map(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> DriverResult<()> {
        // SAFETY: plain integers by value: a reserved, unmapped, granularity-aligned range, a
        // live handle, an aligned offset inside it; flags 0 as the API requires. A bad argument
        // is the driver's error, not undefined behaviour.
        self.vmm_call(device, "cuMemMap", |v| unsafe {
            (v.map)(ptr, size as usize, offset as usize, handle, 0)
        })
    }

    fn vmm_unmap(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        // SAFETY: a run of whole mappings this driver made.
        self.vmm_call(device, "cuMemUnmap", |v| unsafe {
            (v.unmap)(ptr, size as usize)
        })
    }

    fn vmm_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        peers: &[i32],
    ) -> DriverResult<()> {
        let desc = |device: i32| MemAccessDesc {
            location: MemLocation {
                kind: CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.devices.get(device as usize).copied().unwrap_or(device),
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let descs: Vec<MemAccessDesc> = std::iter::once(device)
            .chain(peers.iter().copied())
            .map(desc)
            .collect();
        // SAFETY: `descs.len()` valid descriptors for a run of whole mappings.
        self.vmm_call(device, "cuMemSetAccess", |v| unsafe {
            (v.set_access)(ptr, size as usize, descs.as_ptr(), descs.len())
        })
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> DriverResult<bool> {
        let call = "cuDeviceCanAccessPeer";
        let Some(table) = &self.peer else {
            return Ok(false);
        };
        let ordinal = |d: i32| {
            usize::try_from(d)
                .ok()
                .and_then(|d| self.devices.get(d).copied())
                .ok_or_else(|| DriverError {
                    call,
                    code: 101,
                    name: "CUDA_ERROR_INVALID_DEVICE".to_string(),
                    description: "invalid device ordinal".to_string(),
                })
        };
        let (dev, peer) = (ordinal(device)?, ordinal(peer)?);
        let mut can: c_int = 0;
        // SAFETY: the out-pointer is valid for an int; both devices came from cuDeviceGet; the
        // call needs no current context.
        self.check(call, unsafe {
            (table.can_access_peer)(&mut can, dev, peer)
        })?;
        Ok(can != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_no_driver_with_advice() {
        let err = CudaDriver::load("/nonexistent/libcuda.so.1").err().unwrap();
        assert_eq!(err.status, rm_status::RM_ERROR_NO_DRIVER);
        assert!(
            err.message.contains("/nonexistent/libcuda.so.1"),
            "{}",
            err.message
        );
        assert!(err.message.contains("RESMEM_DRIVER=sim"), "{}", err.message);
    }

    #[test]
    fn a_library_without_the_driver_api_names_the_missing_symbols() {
        let err = CudaDriver::load("libc.so.6").err().unwrap();
        assert_eq!(err.status, rm_status::RM_ERROR_NO_DRIVER);
        assert!(err.message.contains("lacks cuInit"), "{}", err.message);
    }

    #[test]
    fn the_table_lists_every_function() {
        assert_eq!(required_symbols().len(), 20);
        assert!(required_symbols().contains(&"cuMemAlloc_v2"));
        assert_eq!(optional_symbols().len(), 9);
        assert!(optional_symbols().contains(&"cuMemMap"));
        assert_eq!(uuid_symbols(), ["cuDeviceGetUuid"]);
        assert_eq!(peer_symbols(), ["cuDeviceCanAccessPeer"]);
    }
}
