//! The in-process simulated driver (`RESMEM_DRIVER=sim`): the devices of the `cuda-sim` crate,
//! called directly, with the same `CUresult` codes as the real driver.

use std::sync::Arc;

use cuda_sim::{CuError, Sim};

use super::{
    per_thread, DevicePtr, Driver, DriverError, DriverResult, EventHandle, PhysHandle, StreamHandle,
};
use crate::error::{rm_status, Error};

/// The simulated devices as a [`Driver`].
pub struct SimDriver {
    sim: Held,
}

/// The simulator a driver calls: one that lives as long as the process (the library's), or one
/// the driver shares with its caller and that goes with the last of them (a replay's).
enum Held {
    Static(&'static Sim),
    Shared(Arc<Sim>),
}

impl std::ops::Deref for Held {
    type Target = Sim;

    fn deref(&self) -> &Sim {
        match self {
            Held::Static(sim) => sim,
            Held::Shared(sim) => sim,
        }
    }
}

impl SimDriver {
    /// A driver over `sim`, initialised.
    pub fn new(sim: &'static Sim) -> Result<SimDriver, Error> {
        SimDriver::over(Held::Static(sim))
    }

    /// A driver over `sim`, initialised; the simulator goes when the caller's handle and the
    /// driver have both gone.
    pub fn shared(sim: Arc<Sim>) -> Result<SimDriver, Error> {
        SimDriver::over(Held::Shared(sim))
    }

    fn over(sim: Held) -> Result<SimDriver, Error> {
        sim.init().map_err(|e| {
            let detail = sim
                .config_error()
                .map(|m| format!(": {m}"))
                .unwrap_or_default();
            Error::new(
                rm_status::RM_ERROR_NO_DRIVER,
                format!(
                    "the simulated driver failed to initialise with {e}{detail}; \
                     set CUDA_SIM_DEVICES to capacities such as 24GiB or 80GiB,80GiB"
                ),
            )
        })?;
        Ok(SimDriver { sim })
    }

    /// The simulated devices underneath, for inspection.
    pub fn sim(&self) -> &Sim {
        &self.sim
    }

    /// The granularity where `device` has the virtual-memory API and maps at offsets into an
    /// allocation as `offsets` says.
    fn vmm_supported(&self, device: i32, offsets: bool) -> Option<u64> {
        let supported = self
            .sim
            .device_attribute(device, cuda_sim::ATTRIBUTE_VMM_SUPPORTED);
        if supported != Ok(1) || self.sim.maps_at_offsets() != offsets {
            return None;
        }
        self.sim.mem_granularity(device).ok()
    }
}

fn fail(call: &'static str) -> impl Fn(CuError) -> DriverError {
    move |e| DriverError {
        call,
        code: e.0,
        name: e.name().to_string(),
        description: e.description().to_string(),
    }
}

impl Driver for SimDriver {
    fn describe(&self) -> String {
        "the simulated driver (RESMEM_DRIVER=sim)".to_string()
    }

    fn device_count(&self) -> i32 {
        self.sim.device_count().unwrap_or(0)
    }

    fn mem_get_info(&self, device: i32) -> DriverResult<(u64, u64)> {
        self.sim
            .mem_get_info(device)
            .map_err(fail("cuMemGetInfo_v2"))
    }

    fn device_uuid(&self, device: i32) -> DriverResult<[u8; 16]> {
        self.sim
            .device_uuid(device)
            .map_err(fail("cuDeviceGetUuid"))
    }

    fn mem_alloc(&self, device: i32, bytes: u64) -> DriverResult<DevicePtr> {
        self.sim
            .mem_alloc(device, bytes)
            .map_err(fail("cuMemAlloc_v2"))
    }

    fn mem_free(&self, _device: i32, ptr: DevicePtr) -> DriverResult<()> {
        self.sim.mem_free(ptr).map_err(fail("cuMemFree_v2"))
    }

    fn event_create(&self, device: i32) -> DriverResult<EventHandle> {
        self.sim.event_create(device).map_err(fail("cuEventCreate"))
    }

    fn event_destroy(&self, _device: i32, event: EventHandle) -> DriverResult<()> {
        self.sim
            .event_destroy(event)
            .map_err(fail("cuEventDestroy_v2"))
    }

    fn event_record(
        &self,
        device: i32,
        event: EventHandle,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        let stream = per_thread::handle("cuEventRecord", stream)?;
        self.sim
            .event_record(device, event, stream)
            .map_err(fail("cuEventRecord"))
    }

    fn event_query(&self, _device: i32, event: EventHandle) -> DriverResult<bool> {
        self.sim.event_query(event).map_err(fail("cuEventQuery"))
    }

    fn event_synchronize(&self, _device: i32, event: EventHandle) -> DriverResult<()> {
        self.sim
            .event_synchronize(event)
            .map_err(fail("cuEventSynchronize"))
    }

    fn stream_wait_event(
        &self,
        device: i32,
        stream: StreamHandle,
        event: EventHandle,
    ) -> DriverResult<()> {
        let stream = per_thread::handle("cuStreamWaitEvent", stream)?;
        self.sim
            .stream_wait_event(device, stream, event)
            .map_err(fail("cuStreamWaitEvent"))
    }

    fn synchronize(&self, device: i32) -> DriverResult<()> {
        self.sim
            .synchronize(device)
            .map_err(fail("cuCtxSynchronize"))
    }

    fn vmm_granularity(&self, device: i32) -> Option<u64> {
        // A simulator made to refuse offsets into allocations (`CUDA_SIM_VMM=offset0`) says so
        // without the probe the CUDA driver needs (`cuda.rs`), which would add calls to every
        // replay.
        self.vmm_supported(device, true)
    }

    fn vmm_whole_granularity(&self, device: i32) -> Option<u64> {
        self.vmm_supported(device, false)
    }

    fn vmm_reserve(&self, _device: i32, size: u64) -> DriverResult<DevicePtr> {
        self.sim
            .mem_address_reserve(size, 0)
            .map_err(fail("cuMemAddressReserve"))
    }

    fn vmm_free(&self, _device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.sim
            .mem_address_free(ptr, size)
            .map_err(fail("cuMemAddressFree"))
    }

    fn vmm_create(&self, device: i32, size: u64) -> DriverResult<PhysHandle> {
        self.sim
            .mem_create(device, size)
            .map_err(fail("cuMemCreate"))
    }

    fn vmm_release(&self, _device: i32, handle: PhysHandle) -> DriverResult<()> {
        self.sim.mem_release(handle).map_err(fail("cuMemRelease"))
    }

    fn vmm_map(
        &self,
        _device: i32,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> DriverResult<()> {
        self.sim
            .mem_map(ptr, size, offset, handle)
            .map_err(fail("cuMemMap"))
    }

    fn vmm_unmap(&self, _device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.sim.mem_unmap(ptr, size).map_err(fail("cuMemUnmap"))
    }

    fn vmm_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        peers: &[i32],
    ) -> DriverResult<()> {
        let devices: Vec<i32> = std::iter::once(device)
            .chain(peers.iter().copied())
            .collect();
        self.sim
            .mem_set_access_for(ptr, size, &devices)
            .map_err(fail("cuMemSetAccess"))
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> DriverResult<bool> {
        self.sim
            .device_can_access_peer(device, peer)
            .map_err(fail("cuDeviceCanAccessPeer"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_simulator_goes_with_the_last_of_its_holders() {
        let sim = Arc::new(Sim::new(&[1 << 30]));
        let driver = SimDriver::shared(Arc::clone(&sim)).unwrap();
        assert_eq!(Arc::strong_count(&sim), 2);
        let ptr = driver.mem_alloc(0, 2 << 20).unwrap();
        driver.mem_free(0, ptr).unwrap();
        drop(driver);
        assert_eq!(Arc::strong_count(&sim), 1);
    }
}
