//! How device memory is obtained: the small [`Driver`] trait the pool is written against, and its
//! two implementations.
//!
//! - [`cuda::CudaDriver`] loads the CUDA driver library at run time (`dlopen`, never `-lcuda`),
//!   resolves a typed table of the functions it uses up front, and runs every call inside the
//!   device's primary context, leaving the caller's current context as it was.
//! - [`sim::SimDriver`] calls the simulated devices of the `cuda-sim` crate in process.
//!
//! [`pages::PageHandles`] wraps either where the driver maps physical memory only from an
//! allocation's start, as the CUDA driver does, so that the pool can still map cached pages
//! into new ranges.
//!
//! Handles cross the trait as plain integers: a stream or event is the driver's opaque handle
//! (`CUstream`, `CUevent`) as a `u64`, with `0` meaning the default stream, or, for a thread's
//! per-thread default stream, the pool's key for it, which each implementation turns into the
//! handle the driver takes ([`per_thread`]).

pub mod cuda;
pub mod pages;
pub mod per_thread;
pub mod sim;

use std::fmt;

/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;
/// A stream handle (`CUstream`); `0` is the default stream.
pub type StreamHandle = u64;
/// An event handle (`CUevent`).
pub type EventHandle = u64;
/// A physical allocation of the virtual-memory API (`CUmemGenericAllocationHandle`).
pub type PhysHandle = u64;

/// `CUDA_ERROR_OUT_OF_MEMORY`, the one driver result the pool reacts to by itself.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// A failed driver call: which call, its `CUresult`, and the driver's own words for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverError {
    /// The driver function that failed, e.g. `cuMemAlloc_v2`.
    pub call: &'static str,
    /// The `CUresult` it returned.
    pub code: i32,
    /// The result's name, e.g. `CUDA_ERROR_OUT_OF_MEMORY` (from `cuGetErrorName`).
    pub name: String,
    /// The result's description, e.g. `out of memory` (from `cuGetErrorString`).
    pub description: String,
}

impl DriverError {
    /// Whether the driver ran out of device memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == CUDA_ERROR_OUT_OF_MEMORY
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed with {} ({}): {}",
            self.call, self.name, self.code, self.description
        )
    }
}

impl std::error::Error for DriverError {}

/// A driver result.
pub type DriverResult<T> = Result<T, DriverError>;

/// What the pool needs from a driver, per device ordinal.
///
/// Implementations are thread-safe; the pool calls them while holding the lock of the device
/// concerned. One exception reaches other devices under that lock: when the driver rejects a
/// stream that a released block was also used on (`record_stream` may name any device's stream),
/// the pool calls `synchronize` on every device while holding the releasing device's lock.
pub trait Driver: Send + Sync {
    /// A short description for messages and logs, e.g. `CUDA driver 12.4 (libcuda.so.1)`.
    fn describe(&self) -> String;
    /// Number of devices visible to this process.
    fn device_count(&self) -> i32;
    /// `(free, total)` bytes of device memory, as the driver reports them.
    fn mem_get_info(&self, device: i32) -> DriverResult<(u64, u64)>;
    /// The device's 16-byte UUID (`cuDeviceGetUuid`): the same in every process that sees the
    /// device.
    fn device_uuid(&self, device: i32) -> DriverResult<[u8; 16]>;
    /// Allocate `bytes` of device memory.
    fn mem_alloc(&self, device: i32, bytes: u64) -> DriverResult<DevicePtr>;
    /// Free memory returned by [`Driver::mem_alloc`].
    fn mem_free(&self, device: i32, ptr: DevicePtr) -> DriverResult<()>;
    /// Create an event without timing.
    fn event_create(&self, device: i32) -> DriverResult<EventHandle>;
    /// Destroy an event.
    fn event_destroy(&self, device: i32, event: EventHandle) -> DriverResult<()>;
    /// Capture the work queued so far on `stream` in `event`.
    fn event_record(
        &self,
        device: i32,
        event: EventHandle,
        stream: StreamHandle,
    ) -> DriverResult<()>;
    /// Whether the work captured by `event` has completed.
    fn event_query(&self, device: i32, event: EventHandle) -> DriverResult<bool>;
    /// Block the host until the work captured by `event` has completed.
    fn event_synchronize(&self, device: i32, event: EventHandle) -> DriverResult<()>;
    /// Make work queued on `stream` from now on wait for the work captured by `event`.
    fn stream_wait_event(
        &self,
        device: i32,
        stream: StreamHandle,
        event: EventHandle,
    ) -> DriverResult<()>;
    /// Block the host until all work on the device has completed.
    fn synchronize(&self, device: i32) -> DriverResult<()>;

    // The virtual-memory API (`cuMemCreate`, `cuMemMap`, ...), where driver and device have it.

    /// The allocation granularity of the virtual-memory API on `device`, or `None` where the
    /// driver lacks the API, the device does not support it, or the driver maps no memory at
    /// an offset into an allocation (or not one allocation in two places at once), which the
    /// pool's page-granular reuse needs.
    fn vmm_granularity(&self, device: i32) -> Option<u64>;
    /// The allocation granularity where `device` has the virtual-memory API but the driver maps
    /// memory only from an allocation's start (so [`Driver::vmm_granularity`] says `None`):
    /// [`pages::PageHandles`] then makes the pool's handles of parts, one driver handle each
    /// (a page each by default). `None` elsewhere, and by default.
    fn vmm_whole_granularity(&self, device: i32) -> Option<u64> {
        let _ = device;
        None
    }
    /// Where `device` maps physical memory only from an allocation's start and the pool's
    /// handles are made of *parts* (see [`pages::PageHandles`]): the size of each part but a
    /// handle's last (the rest, no larger), a granularity multiple; any mapping of such a handle
    /// covers whole parts. `None` (the default) where any granularity multiple of a handle maps
    /// at any granularity offset into it.
    fn vmm_part(&self, device: i32) -> Option<u64> {
        let _ = device;
        None
    }
    /// Reserve `size` bytes of address space (`cuMemAddressReserve`).
    fn vmm_reserve(&self, device: i32, size: u64) -> DriverResult<DevicePtr>;
    /// Free a reserved address range with nothing mapped in it (`cuMemAddressFree`).
    fn vmm_free(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()>;
    /// Create `size` bytes of physical memory on `device` (`cuMemCreate`).
    fn vmm_create(&self, device: i32, size: u64) -> DriverResult<PhysHandle>;
    /// Release physical memory; the driver frees it once unmapped (`cuMemRelease`).
    fn vmm_release(&self, device: i32, handle: PhysHandle) -> DriverResult<()>;
    /// Map `size` bytes of `handle`, from `offset` on, at `ptr` (`cuMemMap`). Offset and size
    /// are granularity multiples; one handle may be mapped in several places at once.
    fn vmm_map(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> DriverResult<()>;
    /// Unmap `[ptr, ptr + size)` (`cuMemUnmap`).
    fn vmm_unmap(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()>;
    /// Give `device`, and each of `peers` (other devices), read-write access to `[ptr, ptr +
    /// size)`, a run of whole mappings of `device`'s memory (`cuMemSetAccess`, one descriptor
    /// each).
    fn vmm_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        peers: &[i32],
    ) -> DriverResult<()>;
    /// Whether `device`'s kernels can use memory of `peer`, another device
    /// (`cuDeviceCanAccessPeer`). A driver that cannot tell says no (the default).
    fn can_access_peer(&self, device: i32, peer: i32) -> DriverResult<bool> {
        let _ = (device, peer);
        Ok(false)
    }
}
