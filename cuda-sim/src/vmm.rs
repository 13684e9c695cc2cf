//! The CUDA virtual-memory API, simulated with the driver's rules: address ranges reserved in
//! granularity multiples, physical allocations (`cuMemCreate`) that count against the device's
//! capacity when created, mappings only inside reserved ranges and only onto unmapped addresses,
//! access set on mapped ranges, unmapping before an address range is freed, and the release of a
//! still-mapped allocation deferred until its last mapping is gone.

use std::collections::{BTreeMap, HashMap};

use super::codes::*;
use super::{Call, CuError, CuResult, Sim, State, PAGE};

/// A reserved range as (base, size), with the (handle, size) of each allocation mapped in it.
pub type RangeHandles = ((u64, u64), Vec<(u64, u64)>);

/// The allocation granularity of every simulated device (minimum and recommended): one page.
pub const GRANULARITY: u64 = PAGE;

/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub const ATTRIBUTE_VMM_SUPPORTED: i32 = 102;

/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`: whether `cuMemCreate` takes
/// the GPUDirect RDMA flag.
pub const ATTRIBUTE_RDMA_WITH_VMM_SUPPORTED: i32 = 110;

/// `dev`'s bit in a mapping's access set (devices past the 64th are never given access).
fn device_bit(dev: i32) -> u64 {
    u32::try_from(dev)
        .ok()
        .and_then(|d| 1u64.checked_shl(d))
        .unwrap_or(0)
}

/// Reserved address ranges start here, away from `cuMemAlloc`'s device windows.
const VA_BASE: u64 = 0x5000_0000_0000;
/// The size of the reservable address space.
const VA_SIZE: u64 = 1 << 44;
/// Physical allocation handles start here, distinct from streams and events.
const FIRST_HANDLE: u64 = 0xA000_0001;

#[derive(Debug)]
struct Physical {
    device: i32,
    size: u64,
    mappings: u32,
    released: bool,
    /// Created with the GPUDirect RDMA flag (`allocFlags.gpuDirectRDMACapable`).
    rdma: bool,
}

#[derive(Debug)]
struct Mapping {
    size: u64,
    handle: u64,
    /// The devices given read-write access, a bit each (device `d`: bit `d`).
    access: u64,
}

#[derive(Debug)]
struct Range {
    size: u64,
    /// Mappings by address.
    maps: BTreeMap<u64, Mapping>,
}

/// The virtual-memory state of a [`Sim`].
#[derive(Debug)]
pub(crate) struct VmmState {
    pub(crate) supported: bool,
    /// Whether `cuMemMap` maps memory from an offset into an allocation; if not, only from its
    /// start (the driver API's note on the parameter: "currently must be zero").
    offsets: bool,
    /// Whether devices can use each other's memory (`cuDeviceCanAccessPeer`).
    peers: bool,
    /// Whether `cuMemCreate` takes the GPUDirect RDMA flag (else it refuses it, as the driver
    /// does on devices without it).
    rdma: bool,
    next_handle: u64,
    handles: HashMap<u64, Physical>,
    ranges: BTreeMap<u64, Range>,
    creates: u64,
    releases: u64,
}

impl VmmState {
    pub(crate) fn new() -> VmmState {
        VmmState {
            supported: true,
            offsets: true,
            peers: true,
            rdma: true,
            next_handle: FIRST_HANDLE,
            handles: HashMap::new(),
            ranges: BTreeMap::new(),
            creates: 0,
            releases: 0,
        }
    }

    /// The range containing `[ptr, ptr + size)`, by base.
    fn range_of(&self, ptr: u64, size: u64) -> CuResult<u64> {
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        let (&base, range) = self.ranges.range(..=ptr).next_back().ok_or(invalid)?;
        let end = ptr.checked_add(size).ok_or(invalid)?;
        if size == 0 || end > base + range.size {
            return Err(invalid);
        }
        Ok(base)
    }

    /// The addresses of the mappings that exactly tile `[ptr, ptr + size)`.
    fn whole_mappings(&self, ptr: u64, size: u64) -> CuResult<(u64, Vec<u64>)> {
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        let base = self.range_of(ptr, size)?;
        let range = &self.ranges[&base];
        let mut at = ptr;
        let mut found = Vec::new();
        for (&addr, map) in range.maps.range(ptr..ptr + size) {
            if addr != at {
                return Err(invalid);
            }
            found.push(addr);
            at = addr + map.size;
        }
        if at != ptr + size {
            return Err(invalid);
        }
        Ok((base, found))
    }

    /// The device of the memory mapped at `ptr`, and the devices given access to it (a bit
    /// each).
    pub(crate) fn mapping_at(&self, ptr: u64) -> Option<(i32, u64)> {
        let (_, range) = self.ranges.range(..=ptr).next_back()?;
        let (&addr, map) = range.maps.range(..=ptr).next_back()?;
        (ptr < addr + map.size).then(|| (self.handles[&map.handle].device, map.access))
    }
}

impl State {
    fn vmm_check(&mut self, dev: Option<i32>) -> CuResult<()> {
        self.check_init()?;
        if let Some(dev) = dev {
            self.device(dev)?;
        }
        if !self.vmm.supported {
            return Err(CuError(CUDA_ERROR_NOT_SUPPORTED));
        }
        Ok(())
    }

    /// Free the pages of a physical allocation that is released and unmapped.
    fn drop_physical(&mut self, handle: u64) {
        let physical = self.vmm.handles.remove(&handle).expect("known handle");
        self.give_pages(physical.device as usize, physical.size / PAGE);
    }
}

/// What `CUDA_SIM_VMM` asks of the simulated virtual-memory API.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VmmSetting {
    /// `1` or unset: the API in full.
    #[default]
    Full,
    /// `0`: no API (the attribute reads 0, every call fails with `CUDA_ERROR_NOT_SUPPORTED`).
    Absent,
    /// `offset0`: `cuMemMap` maps only from an allocation's start, refusing any other offset
    /// with `CUDA_ERROR_INVALID_VALUE`: a driver that holds to the API's note on the parameter
    /// ("currently must be zero"), which its description of the call contradicts.
    StartOnly,
}

impl VmmSetting {
    /// A value of `CUDA_SIM_VMM` (surrounding spaces ignored); an error names the three.
    pub fn parse(value: &str) -> Result<VmmSetting, String> {
        match value.trim() {
            "1" => Ok(VmmSetting::Full),
            "0" => Ok(VmmSetting::Absent),
            "offset0" => Ok(VmmSetting::StartOnly),
            other => Err(format!(
                "CUDA_SIM_VMM={other:?}: use 0 (no virtual-memory API), offset0 (cuMemMap only \
                 from an allocation's start) or 1 (the API in full, the default)"
            )),
        }
    }
}

impl Sim {
    /// Shape the virtual-memory API as `setting` says (see [`VmmSetting`]).
    pub fn set_vmm(&self, setting: VmmSetting) {
        let mut st = self.lock();
        st.vmm.supported = setting != VmmSetting::Absent;
        st.vmm.offsets = setting != VmmSetting::StartOnly;
    }

    /// `cuDeviceGetAttribute`: only `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`
    /// (102) is simulated; other attributes give `CUDA_ERROR_INVALID_VALUE`.
    pub fn device_attribute(&self, dev: i32, attribute: i32) -> CuResult<i32> {
        let st = self.call(Call::DeviceGetAttribute)?;
        st.device(dev)?;
        match attribute {
            ATTRIBUTE_VMM_SUPPORTED => Ok(i32::from(st.vmm.supported)),
            ATTRIBUTE_RDMA_WITH_VMM_SUPPORTED => Ok(i32::from(st.vmm.supported && st.vmm.rdma)),
            _ => Err(CuError(CUDA_ERROR_INVALID_VALUE)),
        }
    }

    /// Make the devices report no virtual-memory support (as older GPUs and drivers do): the
    /// attribute reads 0 and the virtual-memory calls fail with `CUDA_ERROR_NOT_SUPPORTED`.
    /// `CUDA_SIM_VMM=0` does this for [`Sim::from_env`].
    pub fn disable_vmm(&self) {
        self.set_vmm(VmmSetting::Absent);
    }

    /// Whether `cuMemMap` maps memory from an offset into an allocation (see
    /// [`VmmSetting::StartOnly`]).
    pub fn maps_at_offsets(&self) -> bool {
        self.lock().vmm.offsets
    }

    /// `cuMemGetAllocationGranularity` for a pinned device allocation on `dev`.
    pub fn mem_granularity(&self, dev: i32) -> CuResult<u64> {
        self.call(Call::MemGetAllocationGranularity)?
            .vmm_check(Some(dev))?;
        Ok(GRANULARITY)
    }

    /// `cuMemAddressReserve`: a range of `size` bytes (a multiple of the granularity) at the
    /// lowest free address aligned to `alignment` (0: the granularity).
    pub fn mem_address_reserve(&self, size: u64, alignment: u64) -> CuResult<u64> {
        let mut st = self.call(Call::MemAddressReserve)?;
        st.vmm_check(None)?;
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        if size == 0 || size % GRANULARITY != 0 || (alignment != 0 && !alignment.is_power_of_two())
        {
            return Err(invalid);
        }
        let align = alignment.max(GRANULARITY);
        let mut cursor = VA_BASE;
        for (&base, range) in &st.vmm.ranges {
            if base >= cursor && base - cursor >= size {
                break;
            }
            cursor = (base + range.size).next_multiple_of(align);
        }
        if cursor + size > VA_BASE + VA_SIZE {
            return Err(CuError(CUDA_ERROR_OUT_OF_MEMORY));
        }
        st.vmm.ranges.insert(
            cursor,
            Range {
                size,
                maps: BTreeMap::new(),
            },
        );
        Ok(cursor)
    }

    /// `cuMemAddressFree`: `ptr` and `size` must be exactly a reserved range with nothing
    /// mapped in it.
    pub fn mem_address_free(&self, ptr: u64, size: u64) -> CuResult<()> {
        let mut st = self.call(Call::MemAddressFree)?;
        st.vmm_check(None)?;
        match st.vmm.ranges.get(&ptr) {
            Some(range) if range.size == size && range.maps.is_empty() => {
                st.vmm.ranges.remove(&ptr);
                Ok(())
            }
            _ => Err(CuError(CUDA_ERROR_INVALID_VALUE)),
        }
    }

    /// `cuMemCreate`: `size` bytes (a multiple of the granularity) of physical memory on `dev`,
    /// counted against its capacity from now on.
    pub fn mem_create(&self, dev: i32, size: u64) -> CuResult<u64> {
        self.mem_create_with(dev, size, false)
    }

    /// `cuMemCreate`, with the GPUDirect RDMA flag where `rdma`: refused with
    /// `CUDA_ERROR_INVALID_DEVICE` where the devices do not take it
    /// ([`Sim::set_gpu_direct_rdma`]), as the driver refuses it on devices without it.
    pub fn mem_create_with(&self, dev: i32, size: u64, rdma: bool) -> CuResult<u64> {
        let mut st = self.call(Call::MemCreate)?;
        st.vmm_check(Some(dev))?;
        if size == 0 || size % GRANULARITY != 0 {
            return Err(CuError(CUDA_ERROR_INVALID_VALUE));
        }
        if rdma && !st.vmm.rdma {
            return Err(CuError(CUDA_ERROR_INVALID_DEVICE));
        }
        st.take_pages(dev, size / PAGE)?;
        let handle = st.vmm.next_handle;
        st.vmm.next_handle += 1;
        st.vmm.creates += 1;
        st.vmm.handles.insert(
            handle,
            Physical {
                device: dev,
                size,
                mappings: 0,
                released: false,
                rdma,
            },
        );
        Ok(handle)
    }

    /// Whether `cuMemCreate` takes the GPUDirect RDMA flag (and the attribute says so); it
    /// does unless this says not.
    pub fn set_gpu_direct_rdma(&self, on: bool) {
        self.lock().vmm.rdma = on;
    }

    /// Bytes of `dev`'s physical allocations created with the GPUDirect RDMA flag (for tests).
    pub fn rdma_capable_bytes(&self, dev: i32) -> u64 {
        let st = self.lock();
        st.vmm
            .handles
            .values()
            .filter(|p| p.device == dev && p.rdma)
            .map(|p| p.size)
            .sum()
    }

    /// `cuMemRelease`: the memory is freed now if unmapped, else when its last mapping goes.
    pub fn mem_release(&self, handle: u64) -> CuResult<()> {
        let mut st = self.call(Call::MemRelease)?;
        st.vmm_check(None)?;
        let physical = match st.vmm.handles.get_mut(&handle) {
            Some(p) if !p.released => p,
            _ => return Err(CuError(CUDA_ERROR_INVALID_VALUE)),
        };
        physical.released = true;
        st.vmm.releases += 1;
        let physical = st.vmm.handles.get_mut(&handle).expect("known");
        if physical.mappings == 0 {
            st.drop_physical(handle);
        }
        Ok(())
    }

    /// `cuMemMap`: `size` bytes of `handle` from `offset` on, at `ptr`, a granularity-aligned
    /// address inside a reserved range where nothing is mapped yet. Offset and size are
    /// granularity multiples inside the allocation (the offset 0 only, under
    /// [`VmmSetting::StartOnly`]); one allocation may be mapped in any number of places at
    /// once, each mapping counted until it is unmapped.
    pub fn mem_map(&self, ptr: u64, size: u64, offset: u64, handle: u64) -> CuResult<()> {
        let mut st = self.call(Call::MemMap)?;
        st.vmm_check(None)?;
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        match st.vmm.handles.get(&handle) {
            Some(p)
                if !p.released
                    && size > 0
                    && size % GRANULARITY == 0
                    && offset % GRANULARITY == 0
                    && (offset == 0 || st.vmm.offsets)
                    && offset.checked_add(size).is_some_and(|end| end <= p.size) => {}
            Some(_) => return Err(invalid),
            None => return Err(CuError(CUDA_ERROR_INVALID_HANDLE)),
        }
        if ptr % GRANULARITY != 0 {
            return Err(invalid);
        }
        let base = st.vmm.range_of(ptr, size)?;
        let range = st.vmm.ranges.get_mut(&base).expect("range found");
        if let Some((&addr, map)) = range.maps.range(..ptr + size).next_back() {
            if addr + map.size > ptr {
                return Err(invalid);
            }
        }
        range.maps.insert(
            ptr,
            Mapping {
                size,
                handle,
                access: 0,
            },
        );
        st.vmm.handles.get_mut(&handle).expect("known").mappings += 1;
        Ok(())
    }

    /// `cuMemUnmap`: `[ptr, ptr + size)` must be exactly a run of whole mappings.
    pub fn mem_unmap(&self, ptr: u64, size: u64) -> CuResult<()> {
        let mut st = self.call(Call::MemUnmap)?;
        st.vmm_check(None)?;
        let (base, addrs) = st.vmm.whole_mappings(ptr, size)?;
        for addr in addrs {
            let map = st
                .vmm
                .ranges
                .get_mut(&base)
                .expect("range found")
                .maps
                .remove(&addr)
                .expect("mapping found");
            let physical = st.vmm.handles.get_mut(&map.handle).expect("mapped handle");
            physical.mappings -= 1;
            if physical.released && physical.mappings == 0 {
                st.drop_physical(map.handle);
            }
        }
        Ok(())
    }

    /// `cuMemSetAccess` with one descriptor (read-write for `dev`, which may be another
    /// device than the memory's, as for a peer): `[ptr, ptr + size)` must be exactly a run of
    /// whole mappings.
    pub fn mem_set_access(&self, ptr: u64, size: u64, dev: i32) -> CuResult<()> {
        self.mem_set_access_for(ptr, size, &[dev])
    }

    /// `cuMemSetAccess` with a descriptor for each of `devs` (one call): every device named
    /// must exist, or none is given access.
    pub fn mem_set_access_for(&self, ptr: u64, size: u64, devs: &[i32]) -> CuResult<()> {
        let mut st = self.call(Call::MemSetAccess)?;
        st.vmm_check(None)?;
        if devs.is_empty() {
            return Err(CuError(CUDA_ERROR_INVALID_VALUE));
        }
        let mut access = 0;
        for &dev in devs {
            st.device(dev)?;
            access |= device_bit(dev);
        }
        let (base, addrs) = st.vmm.whole_mappings(ptr, size)?;
        let range = st.vmm.ranges.get_mut(&base).expect("range found");
        for addr in addrs {
            range.maps.get_mut(&addr).expect("mapping found").access |= access;
        }
        Ok(())
    }

    /// Whether `ptr` is mapped, and if so whether the device whose memory it is was given
    /// access to it (for tests).
    pub fn is_accessible(&self, ptr: u64) -> Option<bool> {
        self.lock()
            .vmm
            .mapping_at(ptr)
            .map(|(dev, access)| access & device_bit(dev) != 0)
    }

    /// Whether `ptr` is mapped, and if so whether `dev` (the memory's device or a peer) was
    /// given access to it (for tests).
    pub fn accessible_from(&self, ptr: u64, dev: i32) -> Option<bool> {
        self.lock()
            .vmm
            .mapping_at(ptr)
            .map(|(_, access)| access & device_bit(dev) != 0)
    }

    /// `cuDeviceCanAccessPeer`: whether `dev`'s kernels can use memory of `peer`, another
    /// device. Every pair of simulated devices can, unless [`Sim::set_peer_access`] said not.
    pub fn device_can_access_peer(&self, dev: i32, peer: i32) -> CuResult<bool> {
        let st = self.call(Call::DeviceCanAccessPeer)?;
        st.check_init()?;
        st.device(dev)?;
        st.device(peer)?;
        Ok(dev != peer && st.vmm.peers)
    }

    /// Whether the simulated devices can use each other's memory (`cuDeviceCanAccessPeer`);
    /// they can unless this says not.
    pub fn set_peer_access(&self, on: bool) {
        self.lock().vmm.peers = on;
    }

    /// The address ranges `dev`'s kernels could use now, in order, adjacent ones merged: its
    /// `cuMemAlloc` allocations and the mappings (of its physical memory, or a peer's) to which
    /// it was given access.
    pub fn accessible_ranges(&self, dev: i32) -> Vec<(u64, u64)> {
        let st = self.lock();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        if let Some(d) = usize::try_from(dev).ok().and_then(|d| st.devices.get(d)) {
            ranges.extend(d.allocations.iter().map(|(&b, &l)| (b, l)));
        }
        for range in st.vmm.ranges.values() {
            for (&addr, map) in &range.maps {
                if map.access & device_bit(dev) != 0 {
                    ranges.push((addr, map.size));
                }
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (base, len) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 + last.1 == base => last.1 += len,
                _ => merged.push((base, len)),
            }
        }
        merged
    }

    /// Every mapping of `dev`'s physical memory, as (address, size), in address order.
    pub fn mappings(&self, dev: i32) -> Vec<(u64, u64)> {
        let st = self.lock();
        let mut maps: Vec<(u64, u64)> = st
            .vmm
            .ranges
            .values()
            .flat_map(|range| range.maps.iter())
            .filter(|(_, map)| st.vmm.handles[&map.handle].device == dev)
            .map(|(&addr, map)| (addr, map.size))
            .collect();
        maps.sort_unstable();
        maps
    }

    /// Every reserved range holding a mapping of `dev`'s memory, as (base, size), with the
    /// handles mapped in it and their sizes, for tests.
    pub fn range_handles(&self, dev: i32) -> Vec<RangeHandles> {
        let st = self.lock();
        st.vmm
            .ranges
            .iter()
            .map(|(&base, range)| {
                let mut handles: Vec<(u64, u64)> = range
                    .maps
                    .values()
                    .filter(|map| st.vmm.handles[&map.handle].device == dev)
                    .map(|map| (map.handle, st.vmm.handles[&map.handle].size))
                    .collect();
                handles.sort_unstable();
                handles.dedup();
                ((base, range.size), handles)
            })
            .filter(|(_, handles)| !handles.is_empty())
            .collect()
    }

    /// Successful [`Sim::mem_create`] and [`Sim::mem_release`] calls, all devices.
    pub fn vmm_calls(&self) -> (u64, u64) {
        let st = self.lock();
        (st.vmm.creates, st.vmm.releases)
    }

    /// Physical allocations of `dev` that exist (not yet freed), for tests.
    pub fn physical_allocations(&self, dev: i32) -> usize {
        self.lock()
            .vmm
            .handles
            .values()
            .filter(|p| p.device == dev)
            .count()
    }

    /// Reserved address ranges, all devices, for tests.
    pub fn reserved_ranges(&self) -> usize {
        self.lock().vmm.ranges.len()
    }
}

/// The device of the physical memory mapped at `ptr`, if any.
pub(crate) fn device_of_mapping(st: &State, ptr: u64) -> Option<i32> {
    st.vmm.mapping_at(ptr).map(|(d, _)| d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn sim(capacity: u64) -> Sim {
        let sim = Sim::new(&[capacity]);
        sim.init().unwrap();
        sim
    }

    fn err(code: i32) -> CuError {
        CuError(code)
    }

    #[test]
    fn physical_memory_counts_at_create_and_frees_when_released_and_unmapped() {
        let sim = sim(64 * MIB);
        assert_eq!(sim.device_attribute(0, ATTRIBUTE_VMM_SUPPORTED), Ok(1));
        assert_eq!(sim.mem_granularity(0), Ok(2 * MIB));
        let h = sim.mem_create(0, 32 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 32 * MIB);
        assert_eq!(sim.mem_get_info(0).unwrap().0, 32 * MIB);
        assert_eq!(
            sim.mem_create(0, 34 * MIB),
            Err(err(CUDA_ERROR_OUT_OF_MEMORY))
        );
        let va = sim.mem_address_reserve(64 * MIB, 0).unwrap();
        assert_eq!(va % (2 * MIB), 0);
        sim.mem_map(va + 32 * MIB, 32 * MIB, 0, h).unwrap();
        assert_eq!(sim.is_accessible(va + 32 * MIB), Some(false));
        assert_eq!(sim.is_accessible(va), None);
        sim.mem_set_access(va + 32 * MIB, 32 * MIB, 0).unwrap();
        assert_eq!(sim.is_accessible(va + 63 * MIB), Some(true));
        assert_eq!(sim.device_of(va + 40 * MIB), Some(0));
        // Released while mapped: freed only when unmapped.
        sim.mem_release(h).unwrap();
        assert_eq!(sim.used_bytes(0), 32 * MIB);
        assert_eq!(sim.mem_release(h), Err(err(CUDA_ERROR_INVALID_VALUE)));
        assert_eq!(
            sim.mem_address_free(va, 64 * MIB),
            Err(err(CUDA_ERROR_INVALID_VALUE))
        );
        sim.mem_unmap(va + 32 * MIB, 32 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 0);
        assert_eq!(sim.physical_allocations(0), 0);
        sim.mem_address_free(va, 64 * MIB).unwrap();
        assert_eq!(sim.reserved_ranges(), 0);
    }

    #[test]
    fn mappings_follow_the_drivers_rules() {
        let sim = sim(64 * MIB);
        let (a, b) = (
            sim.mem_create(0, 4 * MIB).unwrap(),
            sim.mem_create(0, 2 * MIB).unwrap(),
        );
        let va = sim.mem_address_reserve(8 * MIB, 0).unwrap();
        let invalid = Err(err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(sim.mem_map(va + MIB, 4 * MIB, 0, a), invalid, "misaligned");
        assert_eq!(
            sim.mem_map(va + 6 * MIB, 4 * MIB, 0, a),
            invalid,
            "past the range"
        );
        assert_eq!(
            sim.mem_map(va, 2 * MIB, 3 * MIB, a),
            invalid,
            "past the allocation's end"
        );
        assert_eq!(
            sim.mem_map(va, 2 * MIB, MIB, a),
            invalid,
            "an offset off the granularity"
        );
        assert_eq!(sim.mem_map(va, 0, 0, a), invalid, "nothing");
        assert_eq!(
            sim.mem_map(va, 4 * MIB, 0, 12345),
            Err(err(CUDA_ERROR_INVALID_HANDLE))
        );
        assert_eq!(
            sim.mem_map(0x1000, 4 * MIB, 0, a),
            invalid,
            "outside any range"
        );
        sim.mem_map(va, 4 * MIB, 0, a).unwrap();
        assert_eq!(
            sim.mem_map(va + 2 * MIB, 2 * MIB, 0, b),
            invalid,
            "overlaps"
        );
        sim.mem_map(va + 4 * MIB, 2 * MIB, 0, b).unwrap();
        // Access and unmap take runs of whole mappings only.
        assert_eq!(
            sim.mem_set_access(va, 8 * MIB, 0),
            invalid,
            "a gap at the end"
        );
        assert_eq!(
            sim.mem_set_access(va, 2 * MIB, 0),
            invalid,
            "part of a mapping"
        );
        sim.mem_set_access(va, 6 * MIB, 0).unwrap();
        assert_eq!(sim.mem_unmap(va + 2 * MIB, 4 * MIB), invalid);
        sim.mem_unmap(va, 6 * MIB).unwrap();
        // The same physical memory maps again elsewhere.
        let other = sim.mem_address_reserve(4 * MIB, 0).unwrap();
        assert_ne!(other, va);
        sim.mem_map(other, 4 * MIB, 0, a).unwrap();
        assert_eq!(
            sim.is_accessible(other),
            Some(false),
            "access is per mapping"
        );
        sim.mem_unmap(other, 4 * MIB).unwrap();
        for h in [a, b] {
            sim.mem_release(h).unwrap();
        }
        assert_eq!(sim.used_bytes(0), 0);
        let invalid = err(CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sim.mem_create(0, 3 * MIB), Err(invalid));
        assert_eq!(sim.mem_address_reserve(3 * MIB, 0), Err(invalid));
        assert_eq!(sim.mem_address_reserve(2 * MIB, 3 * MIB), Err(invalid));
    }

    #[test]
    fn the_gpu_direct_rdma_flag_is_kept_and_refused_where_the_devices_do_not_take_it() {
        let sim = sim(64 * MIB);
        assert_eq!(
            sim.device_attribute(0, ATTRIBUTE_RDMA_WITH_VMM_SUPPORTED),
            Ok(1)
        );
        let a = sim.mem_create_with(0, 4 * MIB, true).unwrap();
        let b = sim.mem_create(0, 2 * MIB).unwrap();
        assert_eq!(sim.rdma_capable_bytes(0), 4 * MIB);
        sim.set_gpu_direct_rdma(false);
        assert_eq!(
            sim.device_attribute(0, ATTRIBUTE_RDMA_WITH_VMM_SUPPORTED),
            Ok(0)
        );
        assert_eq!(
            sim.mem_create_with(0, 2 * MIB, true),
            Err(err(CUDA_ERROR_INVALID_DEVICE))
        );
        assert_eq!(sim.used_bytes(0), 6 * MIB, "nothing taken for the refusal");
        for h in [a, b] {
            sim.mem_release(h).unwrap();
        }
        assert_eq!(sim.rdma_capable_bytes(0), 0);
    }

    #[test]
    fn access_is_given_to_each_device_named_and_peers_can_be_refused() {
        let sim = Sim::new(&[64 * MIB, 64 * MIB, 64 * MIB]);
        sim.init().unwrap();
        let h = sim.mem_create(1, 4 * MIB).unwrap();
        let va = sim.mem_address_reserve(4 * MIB, 0).unwrap();
        sim.mem_map(va, 4 * MIB, 0, h).unwrap();
        // Access for a peer is not access for the memory's own device.
        sim.mem_set_access(va, 4 * MIB, 0).unwrap();
        assert_eq!(sim.accessible_from(va, 0), Some(true));
        assert_eq!(sim.is_accessible(va), Some(false));
        assert_eq!(sim.accessible_ranges(1), vec![]);
        assert_eq!(sim.accessible_ranges(0), vec![(va, 4 * MIB)]);
        sim.mem_set_access(va, 4 * MIB, 1).unwrap();
        assert_eq!(sim.is_accessible(va + 4 * MIB - 1), Some(true));
        assert_eq!(sim.accessible_from(va, 2), Some(false));
        assert_eq!(sim.accessible_from(va + 4 * MIB, 0), None);
        assert_eq!(sim.device_can_access_peer(0, 2), Ok(true));
        assert_eq!(
            sim.device_can_access_peer(1, 1),
            Ok(false),
            "not its own peer"
        );
        assert_eq!(
            sim.device_can_access_peer(0, 3),
            Err(err(CUDA_ERROR_INVALID_DEVICE))
        );
        sim.set_peer_access(false);
        assert_eq!(sim.device_can_access_peer(0, 2), Ok(false));
        sim.mem_unmap(va, 4 * MIB).unwrap();
        sim.mem_release(h).unwrap();
    }

    #[test]
    fn one_allocation_maps_at_offsets_in_several_places_and_frees_after_its_last_mapping() {
        let sim = sim(64 * MIB);
        let h = sim.mem_create(0, 8 * MIB).unwrap();
        let (a, b) = (
            sim.mem_address_reserve(8 * MIB, 0).unwrap(),
            sim.mem_address_reserve(4 * MIB, 0).unwrap(),
        );
        // The whole allocation in one range, and its middle 4 MiB again in another.
        sim.mem_map(a, 8 * MIB, 0, h).unwrap();
        sim.mem_map(b, 2 * MIB, 4 * MIB, h).unwrap();
        sim.mem_map(b + 2 * MIB, 2 * MIB, 2 * MIB, h).unwrap();
        assert_eq!(
            sim.mappings(0),
            vec![(a, 8 * MIB), (b, 2 * MIB), (b + 2 * MIB, 2 * MIB)]
        );
        // Memory counts once, however often it is mapped.
        assert_eq!(sim.used_bytes(0), 8 * MIB);
        sim.mem_set_access(b, 4 * MIB, 0).unwrap();
        assert_eq!(sim.accessible_ranges(0), vec![(b, 4 * MIB)]);
        // Unmapping takes whole mappings: not a part of one, not a run with a gap.
        let invalid = Err(err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(sim.mem_unmap(a + 2 * MIB, 2 * MIB), invalid);
        assert_eq!(sim.mem_unmap(b, 2 * MIB + MIB), invalid);
        sim.mem_unmap(a, 8 * MIB).unwrap();
        sim.mem_release(h).unwrap();
        assert_eq!(sim.physical_allocations(0), 1, "still mapped in b");
        assert_eq!(sim.used_bytes(0), 8 * MIB);
        assert_eq!(sim.mem_map(a, 2 * MIB, 0, h), invalid, "released");
        sim.mem_unmap(b, 2 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 8 * MIB);
        sim.mem_unmap(b + 2 * MIB, 2 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 0);
        assert_eq!(sim.physical_allocations(0), 0);
        sim.mem_address_free(a, 8 * MIB).unwrap();
        sim.mem_address_free(b, 4 * MIB).unwrap();
    }

    #[test]
    fn address_ranges_are_reused_lowest_first() {
        let sim = sim(64 * MIB);
        let a = sim.mem_address_reserve(4 * MIB, 0).unwrap();
        let b = sim.mem_address_reserve(4 * MIB, 0).unwrap();
        assert_eq!(b, a + 4 * MIB);
        sim.mem_address_free(a, 4 * MIB).unwrap();
        assert_eq!(sim.mem_address_reserve(2 * MIB, 0).unwrap(), a);
        assert_eq!(sim.mem_address_reserve(4 * MIB, 0).unwrap(), b + 4 * MIB);
        let aligned = sim.mem_address_reserve(2 * MIB, 64 * MIB).unwrap();
        assert_eq!(aligned % (64 * MIB), 0);
    }

    #[test]
    fn refusing_offsets_maps_only_from_an_allocations_start() {
        let sim = sim(64 * MIB);
        assert!(sim.maps_at_offsets());
        sim.set_vmm(VmmSetting::StartOnly);
        assert!(!sim.maps_at_offsets());
        let handle = sim.mem_create(0, 4 * MIB).unwrap();
        let va = sim.mem_address_reserve(4 * MIB, 0).unwrap();
        let invalid = Err(err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(sim.mem_map(va, 2 * MIB, 2 * MIB, handle), invalid);
        // From the start, a part or the whole, in several places at once.
        sim.mem_map(va, 2 * MIB, 0, handle).unwrap();
        sim.mem_map(va + 2 * MIB, 2 * MIB, 0, handle).unwrap();
        sim.mem_unmap(va, 4 * MIB).unwrap();
        sim.mem_map(va, 4 * MIB, 0, handle).unwrap();
        sim.mem_unmap(va, 4 * MIB).unwrap();
        sim.set_vmm(VmmSetting::Full);
        sim.mem_map(va, 2 * MIB, 2 * MIB, handle).unwrap();
        sim.mem_unmap(va, 2 * MIB).unwrap();
        sim.mem_release(handle).unwrap();
        sim.mem_address_free(va, 4 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 0);
    }

    #[test]
    fn without_vmm_support_every_call_says_not_supported() {
        let sim = sim(64 * MIB);
        sim.disable_vmm();
        assert_eq!(sim.device_attribute(0, ATTRIBUTE_VMM_SUPPORTED), Ok(0));
        let unsupported = Err(err(CUDA_ERROR_NOT_SUPPORTED));
        assert_eq!(sim.mem_create(0, 2 * MIB), unsupported);
        assert_eq!(sim.mem_address_reserve(2 * MIB, 0), unsupported);
        assert_eq!(sim.mem_granularity(0), unsupported);
        assert_eq!(
            sim.device_attribute(0, 1),
            Err(err(CUDA_ERROR_INVALID_VALUE))
        );
    }
}
