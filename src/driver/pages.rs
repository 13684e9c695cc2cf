//! Page-granular reuse on a driver that maps physical memory only from an allocation's start.
//!
//! The pool lends cached pages to new ranges by mapping a handle's pages at offsets into it
//! (`cuMemMap` takes an offset). The CUDA driver's description of `cuMemMap` allows that, but its
//! note on the offset says "currently must be zero", and the CUDA 13.0 driver on an H200 refuses
//! any other offset (`scripts/gpu-check.sh`, 2026-12-04). [`PageHandles`] wraps such a driver so
//! that the pool can still lend: where the driver has the virtual-memory API but maps only from
//! an allocation's start, each handle the pool creates is made of *parts*, one driver handle each,
//! and mapping a run of the pool's handle maps each of its parts whole, from its start. A part
//! mapped in two places at once is one whole handle mapped twice, which the driver allows.
//!
//! A part is one page unless the wrapper is made with larger ones ([`PageHandles::with_part`],
//! `RESMEM_CONF=handle_part_mib:N`); the pool, told so ([`Driver::vmm_part`]), then lends a
//! handle's memory only in whole parts. One page a part lends every free page, as on a driver
//! that maps at offsets, at a `cuMemCreate` and a `cuMemRelease` per page; larger parts make
//! fewer calls and lend less (BENCHMARKS.md, "Handles of larger parts": 8 MiB parts made a
//! quarter of the calls and put 3 of 96 generated workloads over PyTorch's policy's peak,
//! against none). A handle no larger than a part is one driver handle. Unmapping and setting access take one call
//! for a run of mappings, as the driver allows; where it refuses a run, each mapping is asked
//! for alone. On a driver that maps at offsets, or has no virtual-memory API, every call passes
//! through.
//!
//! Each call the pool makes stays one call to it, all or nothing where the driver allows:
//! out of memory is answered before any part is made (from `cuMemGetInfo`); a creation or
//! mapping that fails part way undoes what it made; a release that fails part way keeps the
//! handle, whole (the parts it released made again, at once or where it is next mapped), as the
//! pool keeps a handle whose release failed. What an undo cannot undo (the driver refusing that
//! too) is made good before the next creation, release, mapping or address-range free, and when
//! the wrapper is dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::{
    DevicePtr, Driver, DriverError, DriverResult, EventHandle, PhysHandle, StreamHandle,
    CUDA_ERROR_OUT_OF_MEMORY,
};

/// What an undo left to make good later (see [`PageHandles::leftovers`]).
#[derive(Clone, Copy, Debug)]
enum Leftover {
    /// A part of a failed creation, on a device, of its size, to release.
    Part(i32, PhysHandle, u64),
    /// A part mapped by a failed mapping, on a device: its address and size, to unmap.
    Mapping(i32, DevicePtr, u64),
}

/// A handle made of parts.
#[derive(Debug)]
struct Composed {
    /// Its size.
    size: u64,
    /// The size of each part but the last.
    part: u64,
    /// Each part's driver handle, in order; `None` where a release that failed part way
    /// released it (made again when the handle is mapped there).
    parts: Box<[Option<PhysHandle>]>,
}

impl Composed {
    /// The size of part `i`.
    fn len(&self, i: usize) -> u64 {
        self.part.min(self.size - i as u64 * self.part)
    }
}

/// `CUDA_ERROR_INVALID_VALUE`: what the driver answers a range it will not take in one call.
const CUDA_ERROR_INVALID_VALUE: i32 = 1;

/// The top bit of the names of handles made of parts.
const COMPOSED: PhysHandle = 1 << 63;

/// A driver whose handles are made of parts where it maps only from an allocation's start (see
/// the module's description).
pub struct PageHandles<D: Driver> {
    inner: D,
    /// The size asked for each part (0: a page); rounded up to the device's page.
    part: u64,
    /// Per device, the page size once the device was found to map only from an allocation's
    /// start (asked through [`Driver::vmm_granularity`], which the pool calls before it creates
    /// any physical memory).
    whole_only: Vec<OnceLock<u64>>,
    /// The pool's handles made of parts, by the handle the pool was given.
    handles: Mutex<HashMap<PhysHandle, Composed>>,
    /// Every mapping made on a device that maps only from an allocation's start, by device and
    /// address: its size (a part's, or a handle's of one part), for asking the driver mapping
    /// by mapping where it refuses a run.
    mapped: Mutex<BTreeMap<(i32, DevicePtr), u64>>,
    /// Cleared once the driver refused to unmap, or set access to, a run of several mappings in
    /// one call: each mapping is then asked for alone.
    runs: AtomicBool,
    /// What undoing a call that failed part way could not undo, made good before each later
    /// creation, release, mapping or address-range free: parts of a failed creation whose
    /// release failed too (the pool never knew them), and parts of a failed mapping whose unmap
    /// failed too (the pool takes the range for unmapped).
    leftovers: Mutex<Vec<Leftover>>,
    /// The next name for a handle made of parts (with [`COMPOSED`]).
    next: AtomicU64,
}

/// The driver's answer to a mapping or range it will not take.
fn invalid(call: &'static str, description: String) -> DriverError {
    DriverError {
        call,
        code: CUDA_ERROR_INVALID_VALUE,
        name: "CUDA_ERROR_INVALID_VALUE".to_string(),
        description,
    }
}

impl<D: Driver> PageHandles<D> {
    /// Wrap `inner`, handles made of one-page parts; nothing is asked of it until the pool asks.
    pub fn new(inner: D) -> PageHandles<D> {
        PageHandles::with_part(inner, 0)
    }

    /// Wrap `inner`, handles made of parts of `part` bytes, rounded up to the device's page (0:
    /// a page each).
    pub fn with_part(inner: D, part: u64) -> PageHandles<D> {
        let devices = usize::try_from(inner.device_count()).unwrap_or(0);
        PageHandles {
            inner,
            part,
            whole_only: (0..devices).map(|_| OnceLock::new()).collect(),
            handles: Mutex::new(HashMap::new()),
            mapped: Mutex::new(BTreeMap::new()),
            runs: AtomicBool::new(true),
            leftovers: Mutex::new(Vec::new()),
            next: AtomicU64::new(1),
        }
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The bytes on `device` held by parts of failed creations whose release the driver refused
    /// (released again before later calls): memory the pool does not count.
    pub fn orphaned_bytes(&self, device: i32) -> u64 {
        self.leftovers()
            .iter()
            .map(|l| match *l {
                Leftover::Part(d, _, size) if d == device => size,
                _ => 0,
            })
            .sum()
    }

    /// The page size where `device` maps only from an allocation's start and the pool's handles
    /// on it are made of parts.
    fn page(&self, device: i32) -> Option<u64> {
        let slot = self.whole_only.get(usize::try_from(device).ok()?)?;
        slot.get().copied()
    }

    /// The size of the parts on `device` where its handles are made of parts.
    fn part(&self, device: i32) -> Option<u64> {
        let page = self.page(device)?;
        Some(self.part.max(page).next_multiple_of(page))
    }

    fn leftovers(&self) -> MutexGuard<'_, Vec<Leftover>> {
        self.leftovers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn table(&self) -> MutexGuard<'_, HashMap<PhysHandle, Composed>> {
        // Each change to the table is whole (an entry inserted or removed, a part's slot set
        // once its part is made): a panic elsewhere cannot leave one half made.
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mapped(&self) -> MutexGuard<'_, BTreeMap<(i32, DevicePtr), u64>> {
        self.mapped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Make good what earlier undos left; what the driver still refuses stays for next time.
    fn settle(&self) {
        let mut leftovers = self.leftovers();
        if !leftovers.is_empty() {
            leftovers.retain(|&left| match left {
                Leftover::Part(device, part, _) => self.inner.vmm_release(device, part).is_err(),
                Leftover::Mapping(device, at, size) => {
                    let kept = self.inner.vmm_unmap(device, at, size).is_err();
                    if !kept {
                        self.mapped().remove(&(device, at));
                    }
                    kept
                }
            });
        }
    }

    /// Release `parts` (handle and size), which the pool never knew; those the driver will not
    /// take back now are released again later.
    fn release_or_orphan(&self, device: i32, parts: &[(PhysHandle, u64)]) {
        for &(part, size) in parts {
            if self.inner.vmm_release(device, part).is_err() {
                self.leftovers().push(Leftover::Part(device, part, size));
            }
        }
    }

    /// Map `size` bytes of the driver handle `part`, from its start, at `ptr`, and note the
    /// mapping.
    fn map_part(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        part: PhysHandle,
    ) -> DriverResult<()> {
        self.inner.vmm_map(device, ptr, size, part, 0)?;
        self.mapped().insert((device, ptr), size);
        Ok(())
    }

    /// The mappings made here in `[ptr, ptr + size)` on `device`, as (address, size).
    fn mappings_in(&self, device: i32, (ptr, size): (DevicePtr, u64)) -> Vec<(DevicePtr, u64)> {
        self.mapped()
            .range((device, ptr)..(device, ptr.saturating_add(size)))
            .map(|(&(_, at), &len)| (at, len))
            .collect()
    }

    /// Forget `mappings` on `device`, unmapped.
    fn forget(&self, device: i32, mappings: &[(DevicePtr, u64)]) {
        let mut mapped = self.mapped();
        for (at, _) in mappings {
            mapped.remove(&(device, *at));
        }
    }

    /// Unmap, or set access to, `range` on `device` with `call`: one call for the range while
    /// the driver takes runs, else (or once it refused a run of several mappings) a call per
    /// mapping in it; `unmap` forgets the mappings unmapped. The record of mappings is read only
    /// where a refusal or an unmap needs it.
    fn per_run_or_mapping(
        &self,
        device: i32,
        range: (DevicePtr, u64),
        unmap: bool,
        call: impl Fn(DevicePtr, u64) -> DriverResult<()>,
    ) -> DriverResult<()> {
        let forget = |mappings: &[(DevicePtr, u64)]| {
            if unmap {
                self.forget(device, mappings);
            }
        };
        if self.runs.load(Ordering::Relaxed) {
            match call(range.0, range.1) {
                Err(e)
                    if e.code == CUDA_ERROR_INVALID_VALUE
                        && self.mappings_in(device, range).len() > 1 =>
                {
                    self.runs.store(false, Ordering::Relaxed);
                }
                answer => {
                    if answer.is_ok() && unmap {
                        self.forget(device, &self.mappings_in(device, range));
                    }
                    return answer;
                }
            }
        }
        let inside = self.mappings_in(device, range);
        if inside.iter().map(|&(_, len)| len).sum::<u64>() != range.1 {
            // Not whole mappings made here: the driver's to judge.
            let answer = call(range.0, range.1);
            if answer.is_ok() {
                forget(&inside);
            }
            return answer;
        }
        for (i, &(at, len)) in inside.iter().enumerate() {
            if let Err(e) = call(at, len) {
                forget(&inside[..i]);
                return Err(e);
            }
        }
        forget(&inside);
        Ok(())
    }
}

impl<D: Driver> Drop for PageHandles<D> {
    fn drop(&mut self) {
        // Parts and mappings an undo left are made good before the wrapper goes (the driver
        // itself may stay loaded, and its memory with it).
        self.settle();
    }
}

impl<D: Driver> Driver for PageHandles<D> {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn device_count(&self) -> i32 {
        self.inner.device_count()
    }

    fn mem_get_info(&self, device: i32) -> DriverResult<(u64, u64)> {
        self.inner.mem_get_info(device)
    }

    fn device_uuid(&self, device: i32) -> DriverResult<[u8; 16]> {
        self.inner.device_uuid(device)
    }

    fn mem_alloc(&self, device: i32, bytes: u64) -> DriverResult<DevicePtr> {
        self.inner.mem_alloc(device, bytes)
    }

    fn mem_free(&self, device: i32, ptr: DevicePtr) -> DriverResult<()> {
        self.inner.mem_free(device, ptr)
    }

    fn event_create(&self, device: i32) -> DriverResult<EventHandle> {
        self.inner.event_create(device)
    }

    fn event_destroy(&self, device: i32, event: EventHandle) -> DriverResult<()> {
        self.inner.event_destroy(device, event)
    }

    fn event_record(
        &self,
        device: i32,
        event: EventHandle,
        stream: StreamHandle,
    ) -> DriverResult<()> {
        self.inner.event_record(device, event, stream)
    }

    fn event_query(&self, device: i32, event: EventHandle) -> DriverResult<bool> {
        self.inner.event_query(device, event)
    }

    fn event_synchronize(&self, device: i32, event: EventHandle) -> DriverResult<()> {
        self.inner.event_synchronize(device, event)
    }

    fn stream_wait_event(
        &self,
        device: i32,
        stream: StreamHandle,
        event: EventHandle,
    ) -> DriverResult<()> {
        self.inner.stream_wait_event(device, stream, event)
    }

    fn synchronize(&self, device: i32) -> DriverResult<()> {
        self.inner.synchronize(device)
    }

    fn vmm_granularity(&self, device: i32) -> Option<u64> {
        if let Some(page) = self.page(device) {
            return Some(page);
        }
        self.inner.vmm_granularity(device).or_else(|| {
            let page = self.inner.vmm_whole_granularity(device)?;
            let slot = self.whole_only.get(usize::try_from(device).ok()?)?;
            Some(*slot.get_or_init(|| page))
        })
    }

    fn vmm_whole_granularity(&self, _device: i32) -> Option<u64> {
        // Whole-only devices are made to look like devices that map at offsets, in parts.
        None
    }

    fn vmm_part(&self, device: i32) -> Option<u64> {
        self.part(device)
    }

    fn vmm_reserve(&self, device: i32, size: u64) -> DriverResult<DevicePtr> {
        self.inner.vmm_reserve(device, size)
    }

    fn vmm_free(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.settle();
        self.inner.vmm_free(device, ptr, size)
    }

    fn vmm_create(&self, device: i32, size: u64) -> DriverResult<PhysHandle> {
        let Some(part) = self.part(device) else {
            return self.inner.vmm_create(device, size);
        };
        if size <= part {
            return self.inner.vmm_create(device, size);
        }
        self.settle();
        // Out of memory is answered before any part is made, as one cuMemCreate answers it: a
        // creation that failed part way would otherwise make and release parts for nothing,
        // and leave them with the driver where it also refuses their release.
        let (free, _) = self.inner.mem_get_info(device)?;
        if size > free {
            return Err(DriverError {
                call: "cuMemCreate",
                code: CUDA_ERROR_OUT_OF_MEMORY,
                name: "CUDA_ERROR_OUT_OF_MEMORY".to_string(),
                description: format!(
                    "{size} bytes asked for in parts of {part}, {free} free on the device"
                ),
            });
        }
        let mut made = Vec::with_capacity(usize::try_from(size.div_ceil(part)).unwrap_or(0));
        let mut at = 0;
        while at < size {
            let len = part.min(size - at);
            match self.inner.vmm_create(device, len) {
                Ok(handle) => made.push((handle, len)),
                Err(e) => {
                    // The parts made so far go back; the failure (out of memory, say) is the
                    // pool's to handle as from one call. Those the driver will not take back
                    // now are released again later.
                    self.release_or_orphan(device, &made);
                    return Err(e);
                }
            }
            at += len;
        }
        // A name of its own, that no driver handle takes (a driver's handles are addresses or
        // small counts): a part's handle could be the driver's again for another allocation
        // once released, while the whole is still retried.
        let id = COMPOSED | self.next.fetch_add(1, Ordering::Relaxed);
        let parts = made.into_iter().map(|(handle, _)| Some(handle)).collect();
        self.table().insert(id, Composed { size, part, parts });
        Ok(id)
    }

    fn vmm_release(&self, device: i32, handle: PhysHandle) -> DriverResult<()> {
        self.settle();
        let Some(mut composed) = self.table().remove(&handle) else {
            return self.inner.vmm_release(device, handle);
        };
        // As one call: where the driver refuses a part, the handle stays for the pool to use or
        // release again (the pool keeps a handle whose release failed), whole: the parts
        // released before the refusal are made again (memory given up, whose contents nobody
        // needs), now or, where the driver will not make them now, where the handle is mapped.
        // Until then the driver holds less than the pool counts, never more.
        for i in 0..composed.parts.len() {
            let Some(part) = composed.parts[i] else {
                continue;
            };
            if let Err(e) = self.inner.vmm_release(device, part) {
                for j in 0..i {
                    match self.inner.vmm_create(device, composed.len(j)) {
                        Ok(made) => composed.parts[j] = Some(made),
                        Err(_) => break,
                    }
                }
                self.table().insert(handle, composed);
                return Err(e);
            }
            composed.parts[i] = None;
        }
        Ok(())
    }

    fn vmm_map(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> DriverResult<()> {
        if self.page(device).is_none() {
            return self.inner.vmm_map(device, ptr, size, handle, offset);
        }
        self.settle();
        let run = {
            let mut table = self.table();
            let Some(composed) = table.get_mut(&handle) else {
                drop(table);
                if offset != 0 {
                    return self.inner.vmm_map(device, ptr, size, handle, offset);
                }
                return self.map_part(device, ptr, size, handle);
            };
            let (part, whole) = (composed.part, composed.size);
            let end = offset.checked_add(size).filter(|&end| end <= whole);
            let first = usize::try_from(offset / part).unwrap_or(usize::MAX);
            let fits = end.is_some_and(|end| {
                size > 0 && offset % part == 0 && (end % part == 0 || end == whole)
            });
            if !fits {
                // What the driver answers a run past a handle's end, or not of whole parts.
                return Err(invalid(
                    "cuMemMap",
                    format!(
                        "{size} bytes from offset {offset} are not whole parts of {part} bytes \
                         of a handle of {whole} bytes"
                    ),
                ));
            }
            let count = usize::try_from(size.div_ceil(part)).unwrap_or(usize::MAX);
            // Parts a failed release gave back are made again (rarely: under the table's lock).
            for i in first..first + count {
                if composed.parts[i].is_none() {
                    composed.parts[i] = Some(self.inner.vmm_create(device, composed.len(i))?);
                }
            }
            (first..first + count)
                .map(|i| (composed.parts[i].expect("made above"), composed.len(i)))
                .collect::<Vec<_>>()
        };
        let mut at = ptr;
        for (i, &(part, len)) in run.iter().enumerate() {
            if let Err(e) = self.map_part(device, at, len, part) {
                // Undo what was mapped, part by part (each its own mapping); the range is left
                // as it was found, or as it will be once the parts the driver will not unmap
                // now are unmapped before the next mapping or address-range free.
                let mut back = ptr;
                for &(_, len) in &run[..i] {
                    if self.inner.vmm_unmap(device, back, len).is_ok() {
                        self.mapped().remove(&(device, back));
                    } else {
                        self.leftovers().push(Leftover::Mapping(device, back, len));
                    }
                    back += len;
                }
                return Err(e);
            }
            at += len;
        }
        Ok(())
    }

    fn vmm_unmap(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        if self.page(device).is_none() {
            return self.inner.vmm_unmap(device, ptr, size);
        }
        self.per_run_or_mapping(device, (ptr, size), true, |p, s| {
            self.inner.vmm_unmap(device, p, s)
        })
    }

    fn vmm_set_access(
        &self,
        device: i32,
        ptr: DevicePtr,
        size: u64,
        peers: &[i32],
    ) -> DriverResult<()> {
        if self.page(device).is_none() {
            return self.inner.vmm_set_access(device, ptr, size, peers);
        }
        self.per_run_or_mapping(device, (ptr, size), false, |p, s| {
            self.inner.vmm_set_access(device, p, s, peers)
        })
    }

    fn can_access_peer(&self, device: i32, peer: i32) -> DriverResult<bool> {
        self.inner.can_access_peer(device, peer)
    }
}

#[cfg(test)]
mod tests {
    use cuda_sim::{Call, Sim, VmmSetting};

    use super::*;
    use crate::driver::sim::SimDriver;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn driver(capacity: u64, setting: VmmSetting) -> (PageHandles<SimDriver>, &'static Sim) {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[capacity])));
        sim.set_vmm(setting);
        (PageHandles::new(SimDriver::new(sim).unwrap()), sim)
    }

    fn calls(sim: &Sim) -> [u64; 5] {
        [
            Call::MemCreate,
            Call::MemRelease,
            Call::MemMap,
            Call::MemUnmap,
            Call::MemSetAccess,
        ]
        .map(|call| sim.call_count(call))
    }

    #[test]
    fn a_driver_that_maps_at_offsets_is_passed_through() {
        let (driver, sim) = driver(GIB, VmmSetting::Full);
        assert_eq!(driver.vmm_granularity(0), Some(2 * MIB));
        let handle = driver.vmm_create(0, 8 * MIB).unwrap();
        let va = driver.vmm_reserve(0, 4 * MIB).unwrap();
        driver.vmm_map(0, va, 4 * MIB, handle, 2 * MIB).unwrap();
        driver.vmm_set_access(0, va, 4 * MIB, &[]).unwrap();
        driver.vmm_unmap(0, va, 4 * MIB).unwrap();
        driver.vmm_release(0, handle).unwrap();
        driver.vmm_free(0, va, 4 * MIB).unwrap();
        assert_eq!(calls(sim), [1, 1, 1, 1, 1]);
        assert_eq!(sim.used_bytes(0), 0);
    }

    #[test]
    fn a_handle_is_made_of_pages_where_the_driver_maps_only_from_the_start() {
        let (driver, sim) = driver(GIB, VmmSetting::StartOnly);
        assert_eq!(driver.inner().vmm_granularity(0), None);
        assert_eq!(driver.inner().vmm_whole_granularity(0), Some(2 * MIB));
        assert_eq!(driver.vmm_granularity(0), Some(2 * MIB));
        assert_eq!(driver.vmm_whole_granularity(0), None);
        let handle = driver.vmm_create(0, 8 * MIB).unwrap();
        assert_eq!(sim.physical_allocations(0), 4);
        assert_eq!(sim.used_bytes(0), 8 * MIB);
        // Its middle two pages in one range, its first two in another: each page mapped whole.
        let (a, b) = (
            driver.vmm_reserve(0, 4 * MIB).unwrap(),
            driver.vmm_reserve(0, 4 * MIB).unwrap(),
        );
        driver.vmm_map(0, a, 4 * MIB, handle, 2 * MIB).unwrap();
        driver.vmm_map(0, b, 4 * MIB, handle, 0).unwrap();
        driver.vmm_set_access(0, a, 4 * MIB, &[]).unwrap();
        assert_eq!(sim.is_accessible(a + 3 * MIB), Some(true));
        assert_eq!(sim.is_accessible(b), Some(false));
        assert_eq!(sim.mappings(0).len(), 4);
        // Released while mapped: the driver keeps the pages until their last mapping goes.
        driver.vmm_release(0, handle).unwrap();
        assert_eq!(
            sim.used_bytes(0),
            6 * MIB,
            "the unmapped last page is freed"
        );
        driver.vmm_unmap(0, a, 4 * MIB).unwrap();
        driver.vmm_unmap(0, b, 4 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 0);
        // Create and release per page, map per page, unmap and access per run.
        assert_eq!(calls(sim), [4, 4, 4, 2, 1]);
        // A run past the handle's end is the driver's to refuse.
        let handle = driver.vmm_create(0, 4 * MIB).unwrap();
        let e = driver.vmm_map(0, a, 4 * MIB, handle, 2 * MIB).unwrap_err();
        assert_eq!((e.call, e.code), ("cuMemMap", CUDA_ERROR_INVALID_VALUE));
        driver.vmm_release(0, handle).unwrap();
        driver.vmm_free(0, a, 4 * MIB).unwrap();
        driver.vmm_free(0, b, 4 * MIB).unwrap();
        assert_eq!(sim.physical_allocations(0), 0);
    }

    #[test]
    fn a_failure_part_way_gives_back_what_was_made() {
        let (driver, sim) = driver(GIB, VmmSetting::StartOnly);
        assert!(driver.vmm_granularity(0).is_some());
        // The third page's cuMemCreate runs out of memory: the two before are released.
        sim.inject_faults("cuMemCreate@3=2").unwrap();
        let e = driver.vmm_create(0, 8 * MIB).unwrap_err();
        sim.clear_faults();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!((sim.physical_allocations(0), sim.used_bytes(0)), (0, 0));
        // The second page's cuMemMap fails: the first is unmapped, the range as it was.
        let handle = driver.vmm_create(0, 8 * MIB).unwrap();
        let va = driver.vmm_reserve(0, 8 * MIB).unwrap();
        sim.inject_faults("cuMemMap@2=719").unwrap();
        let e = driver.vmm_map(0, va, 8 * MIB, handle, 0).unwrap_err();
        sim.clear_faults();
        assert_eq!((e.call, e.code), ("cuMemMap", 719));
        assert!(sim.mappings(0).is_empty());
        // The same with the undo's unmap failing too: the stray page is unmapped before the
        // next mapping.
        sim.inject_faults("cuMemMap@2=719,cuMemUnmap@1=719")
            .unwrap();
        assert!(driver.vmm_map(0, va, 8 * MIB, handle, 0).is_err());
        sim.clear_faults();
        assert_eq!(sim.mappings(0).len(), 1);
        driver.vmm_map(0, va, 8 * MIB, handle, 0).unwrap();
        assert_eq!(sim.mappings(0).len(), 4);
        driver.vmm_unmap(0, va, 8 * MIB).unwrap();
        driver.vmm_free(0, va, 8 * MIB).unwrap();
        // The third page's release fails: the handle stays, whole again (its first two pages
        // made again), to be mapped or released the next time.
        sim.inject_faults("cuMemRelease@3=719").unwrap();
        let e = driver.vmm_release(0, handle).unwrap_err();
        sim.clear_faults();
        assert_eq!((e.call, e.code), ("cuMemRelease", 719));
        assert_eq!(sim.used_bytes(0), 8 * MIB);
        // The same with the pages not made again at once: they are made where it is mapped.
        sim.inject_faults("cuMemRelease@3=719,cuMemCreate@1=2")
            .unwrap();
        assert!(driver.vmm_release(0, handle).is_err());
        sim.clear_faults();
        assert_eq!(sim.used_bytes(0), 4 * MIB);
        let va = driver.vmm_reserve(0, 8 * MIB).unwrap();
        driver.vmm_map(0, va, 8 * MIB, handle, 0).unwrap();
        assert_eq!(sim.used_bytes(0), 8 * MIB);
        driver.vmm_unmap(0, va, 8 * MIB).unwrap();
        driver.vmm_free(0, va, 8 * MIB).unwrap();
        driver.vmm_release(0, handle).unwrap();
        assert_eq!(sim.used_bytes(0), 0);
        // A creation failing part way whose clean-up fails too: the page the driver would not
        // take back is released before the next creation.
        sim.inject_faults("cuMemCreate@3=2,cuMemRelease@2=719")
            .unwrap();
        assert!(driver.vmm_create(0, 8 * MIB).is_err());
        sim.clear_faults();
        assert_eq!(sim.used_bytes(0), 2 * MIB);
        let handle = driver.vmm_create(0, 4 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 4 * MIB);
        driver.vmm_release(0, handle).unwrap();
        assert_eq!((sim.used_bytes(0), sim.physical_allocations(0)), (0, 0));
    }

    #[test]
    fn handles_of_larger_parts_map_only_whole_parts() {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[GIB])));
        sim.set_vmm(VmmSetting::StartOnly);
        // 5 MiB parts are 6 MiB ones, a page being 2 MiB.
        let driver = PageHandles::with_part(SimDriver::new(sim).unwrap(), 5 * MIB);
        assert_eq!(
            driver.vmm_part(0),
            None,
            "not known before the granularity is asked"
        );
        assert_eq!(driver.vmm_granularity(0), Some(2 * MIB));
        assert_eq!(driver.vmm_part(0), Some(6 * MIB));
        // 16 MiB: parts of 6, 6 and 4 MiB; 6 MiB or less: one driver handle.
        let handle = driver.vmm_create(0, 16 * MIB).unwrap();
        let small = driver.vmm_create(0, 6 * MIB).unwrap();
        assert_eq!(sim.physical_allocations(0), 4);
        let va = driver.vmm_reserve(0, 32 * MIB).unwrap();
        // The last two parts, then the first: whole parts map, each part its own mapping.
        driver.vmm_map(0, va, 10 * MIB, handle, 6 * MIB).unwrap();
        driver
            .vmm_map(0, va + 10 * MIB, 6 * MIB, handle, 0)
            .unwrap();
        driver.vmm_map(0, va + 16 * MIB, 6 * MIB, small, 0).unwrap();
        assert_eq!(sim.mappings(0).len(), 4);
        // Part of a part, or from inside one, is refused, and nothing is mapped.
        let b = driver.vmm_reserve(0, 8 * MIB).unwrap();
        for (size, offset) in [(8 * MIB, 0), (4 * MIB, 2 * MIB), (2 * MIB, 14 * MIB)] {
            let e = driver.vmm_map(0, b, size, handle, offset).unwrap_err();
            assert_eq!(
                (e.call, e.code),
                ("cuMemMap", CUDA_ERROR_INVALID_VALUE),
                "{e}"
            );
        }
        assert_eq!(sim.mappings(0).len(), 4);
        // Access refused for the run: the driver is asked mapping by mapping, each whole.
        sim.inject_faults("cuMemSetAccess@1=1").unwrap();
        driver.vmm_set_access(0, va, 22 * MIB, &[]).unwrap();
        sim.clear_faults();
        assert_eq!(sim.call_count(Call::MemSetAccess), 1 + 4);
        assert_eq!(sim.is_accessible(va + 22 * MIB - 1), Some(true));
        // A release refused at the last part: the first two are made again, 6 MiB each.
        sim.inject_faults("cuMemRelease@3=719").unwrap();
        assert!(driver.vmm_release(0, handle).is_err());
        sim.clear_faults();
        assert_eq!(sim.used_bytes(0), 22 * MIB + 12 * MIB);
        driver.vmm_unmap(0, va, 22 * MIB).unwrap();
        assert_eq!(
            sim.call_count(Call::MemUnmap),
            4,
            "mapping by mapping from then on"
        );
        driver.vmm_release(0, handle).unwrap();
        driver.vmm_release(0, small).unwrap();
        driver.vmm_free(0, va, 32 * MIB).unwrap();
        driver.vmm_free(0, b, 8 * MIB).unwrap();
        assert_eq!((sim.used_bytes(0), sim.physical_allocations(0)), (0, 0));
    }

    #[test]
    fn a_driver_that_refuses_a_run_is_asked_mapping_by_mapping_from_then_on() {
        let (driver, sim) = driver(GIB, VmmSetting::StartOnly);
        assert!(driver.vmm_granularity(0).is_some());
        let handle = driver.vmm_create(0, 6 * MIB).unwrap();
        let va = driver.vmm_reserve(0, 6 * MIB).unwrap();
        driver.vmm_map(0, va, 6 * MIB, handle, 0).unwrap();
        let before = calls(sim);
        sim.inject_faults("cuMemSetAccess@1=1").unwrap();
        driver.vmm_set_access(0, va, 6 * MIB, &[]).unwrap();
        sim.clear_faults();
        assert_eq!(sim.is_accessible(va + 5 * MIB), Some(true));
        driver.vmm_unmap(0, va, 6 * MIB).unwrap();
        let after = calls(sim);
        // The refused run, then three pages; the unmap goes page by page at once.
        assert_eq!((after[4] - before[4], after[3] - before[3]), (4, 3));
        driver.vmm_release(0, handle).unwrap();
        driver.vmm_free(0, va, 6 * MIB).unwrap();
        assert_eq!(sim.used_bytes(0), 0);
    }
}
