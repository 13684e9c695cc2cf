//! A driver over the simulator that lets a test watch chosen calls: [`Watch::before`] runs as a
//! call begins, [`Watch::after`] once it succeeded, each with the driver function's name (as
//! `cuda.h` spells it) and the device. A hook may panic, block, or call the pool from another
//! thread; the call itself goes to the simulator unchanged.

use resmem::driver::sim::SimDriver;
use resmem::driver::{DevicePtr, Driver, DriverResult, EventHandle, PhysHandle, StreamHandle};

/// What a test does around the calls of a [`Spy`]; both do nothing unless given.
pub trait Watch: Send + Sync {
    fn before(&self, _call: &'static str, _device: i32) {}
    fn after(&self, _call: &'static str, _device: i32) {}
}

/// The simulated driver, watched by `watch`.
pub struct Spy<W> {
    pub sim: SimDriver,
    pub watch: W,
}

impl<W: Watch> Spy<W> {
    /// `f`, the call `call` on `device`, between the watch's hooks.
    fn watched<T>(
        &self,
        call: &'static str,
        device: i32,
        f: impl FnOnce(&SimDriver) -> DriverResult<T>,
    ) -> DriverResult<T> {
        self.watch.before(call, device);
        let result = f(&self.sim);
        if result.is_ok() {
            self.watch.after(call, device);
        }
        result
    }
}

impl<W: Watch> Driver for Spy<W> {
    fn describe(&self) -> String {
        self.sim.describe()
    }
    fn device_count(&self) -> i32 {
        self.sim.device_count()
    }
    fn mem_get_info(&self, d: i32) -> DriverResult<(u64, u64)> {
        self.watched("cuMemGetInfo_v2", d, |s| s.mem_get_info(d))
    }
    fn device_uuid(&self, d: i32) -> DriverResult<[u8; 16]> {
        self.watched("cuDeviceGetUuid", d, |s| s.device_uuid(d))
    }
    fn mem_alloc(&self, d: i32, bytes: u64) -> DriverResult<DevicePtr> {
        self.watched("cuMemAlloc_v2", d, |s| s.mem_alloc(d, bytes))
    }
    fn mem_free(&self, d: i32, p: DevicePtr) -> DriverResult<()> {
        self.watched("cuMemFree_v2", d, |s| s.mem_free(d, p))
    }
    fn event_create(&self, d: i32) -> DriverResult<EventHandle> {
        self.watched("cuEventCreate", d, |s| s.event_create(d))
    }
    fn event_destroy(&self, d: i32, e: EventHandle) -> DriverResult<()> {
        self.watched("cuEventDestroy_v2", d, |s| s.event_destroy(d, e))
    }
    fn event_record(&self, d: i32, e: EventHandle, st: StreamHandle) -> DriverResult<()> {
        self.watched("cuEventRecord", d, |s| s.event_record(d, e, st))
    }
    fn event_query(&self, d: i32, e: EventHandle) -> DriverResult<bool> {
        self.watched("cuEventQuery", d, |s| s.event_query(d, e))
    }
    fn event_synchronize(&self, d: i32, e: EventHandle) -> DriverResult<()> {
        self.watched("cuEventSynchronize", d, |s| s.event_synchronize(d, e))
    }
    fn stream_wait_event(&self, d: i32, st: StreamHandle, e: EventHandle) -> DriverResult<()> {
        self.watched("cuStreamWaitEvent", d, |s| s.stream_wait_event(d, st, e))
    }
    fn synchronize(&self, d: i32) -> DriverResult<()> {
        self.watched("cuCtxSynchronize", d, |s| s.synchronize(d))
    }
    fn vmm_granularity(&self, d: i32) -> Option<u64> {
        self.sim.vmm_granularity(d)
    }
    fn vmm_reserve(&self, d: i32, size: u64) -> DriverResult<DevicePtr> {
        self.watched("cuMemAddressReserve", d, |s| s.vmm_reserve(d, size))
    }
    fn vmm_free(&self, d: i32, p: DevicePtr, size: u64) -> DriverResult<()> {
        self.watched("cuMemAddressFree", d, |s| s.vmm_free(d, p, size))
    }
    fn vmm_create(&self, d: i32, size: u64) -> DriverResult<PhysHandle> {
        self.watched("cuMemCreate", d, |s| s.vmm_create(d, size))
    }
    fn vmm_release(&self, d: i32, h: PhysHandle) -> DriverResult<()> {
        self.watched("cuMemRelease", d, |s| s.vmm_release(d, h))
    }
    fn vmm_map(
        &self,
        d: i32,
        p: DevicePtr,
        size: u64,
        h: PhysHandle,
        offset: u64,
    ) -> DriverResult<()> {
        self.watched("cuMemMap", d, |s| s.vmm_map(d, p, size, h, offset))
    }
    fn vmm_unmap(&self, d: i32, p: DevicePtr, size: u64) -> DriverResult<()> {
        self.watched("cuMemUnmap", d, |s| s.vmm_unmap(d, p, size))
    }
    fn vmm_set_access(&self, d: i32, p: DevicePtr, size: u64, peers: &[i32]) -> DriverResult<()> {
        self.watched("cuMemSetAccess", d, |s| s.vmm_set_access(d, p, size, peers))
    }
    fn can_access_peer(&self, d: i32, peer: i32) -> DriverResult<bool> {
        self.watched("cuDeviceCanAccessPeer", d, |s| s.can_access_peer(d, peer))
    }
}
