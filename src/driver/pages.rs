//! Page-granular reuse on a driver that maps physical memory only from an allocation's start.
//!
//! The pool lends cached pages to new ranges by mapping a handle's pages at offsets into it
//! (`cuMemMap` takes an offset). The CUDA driver's description of `cuMemMap` allows that, but its
//! note on the offset says "currently must be zero", and the CUDA 13.0 driver on an H200 refuses
//! any other offset (`scripts/gpu-check.sh`, 2026-12-04). [`PageHandles`] wraps such a driver so
//! that the pool works unchanged: where the driver has the virtual-memory API but maps only from
//! an allocation's start, each handle the pool creates is made of one driver handle per page, and
//! mapping a run of the pool's handle at an offset maps each of those pages whole, from its start.
//! A page mapped in two places at once is one whole handle mapped twice, which the driver allows.
//!
//! The price is driver calls: one `cuMemCreate` and one `cuMemRelease` per page instead of per
//! handle, and one `cuMemMap` per page mapped. Unmapping and setting access take one call for a
//! run of mappings, as the driver allows; where it refuses a run, each page is asked for alone.
//! On a driver that maps at offsets, or has no virtual-memory API, every call passes through.
//!
//! Each call the pool makes stays one call to it, all or nothing where the driver allows:
//! out of memory is answered before any page is made (from `cuMemGetInfo`); a creation or
//! mapping that fails part way undoes what it made; a release that fails part way keeps the
//! handle, whole (the pages it released made again, at once or where it is next mapped), as the
//! pool keeps a handle whose release failed. What an undo cannot undo (the driver refusing that
//! too) is made good before the next creation, release, mapping or address-range free, and when
//! the wrapper is dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::{
    DevicePtr, Driver, DriverError, DriverResult, EventHandle, PhysHandle, StreamHandle,
    CUDA_ERROR_OUT_OF_MEMORY,
};

/// What an undo left to make good later (see [`PageHandles::leftovers`]).
#[derive(Clone, Copy, Debug)]
enum Leftover {
    /// A page of a failed creation, on a device, to release.
    Page(i32, PhysHandle),
    /// A page mapped by a failed mapping, on a device: its address and size, to unmap.
    Mapping(i32, DevicePtr, u64),
}

/// A handle made of pages: each page's driver handle, `None` where it was released.
type Pages = Box<[Option<PhysHandle>]>;

/// `CUDA_ERROR_INVALID_VALUE`: what the driver answers a range it will not take in one call.
const CUDA_ERROR_INVALID_VALUE: i32 = 1;

/// The top bit of the names of handles made of pages.
const COMPOSED: PhysHandle = 1 << 63;

/// A driver whose handles are made of one-page handles where it maps only from an allocation's
/// start (see the module's description).
pub struct PageHandles<D: Driver> {
    inner: D,
    /// Per device, the page size once the device was found to map only from an allocation's
    /// start (asked through [`Driver::vmm_granularity`], which the pool calls before it creates
    /// any physical memory).
    whole_only: Vec<OnceLock<u64>>,
    /// The pool's handles made of pages, by the handle the pool was given: the device's driver
    /// handles, one per page, in order (`None`: a page released by a release that failed part
    /// way, made again when the handle is mapped there).
    handles: Mutex<HashMap<PhysHandle, Pages>>,
    /// Cleared once the driver refused to unmap, or set access to, a run of several mappings in
    /// one call: each page is then asked for alone.
    runs: AtomicBool,
    /// What undoing a call that failed part way could not undo, made good before each later
    /// creation, release, mapping or address-range free: pages of a failed creation whose
    /// release failed too (the pool never knew them), and pages of a failed mapping whose unmap
    /// failed too (the pool takes the range for unmapped).
    leftovers: Mutex<Vec<Leftover>>,
    /// The next name for a handle made of pages (with [`COMPOSED`]).
    next: AtomicU64,
}

impl<D: Driver> PageHandles<D> {
    /// Wrap `inner`; nothing is asked of it until the pool asks.
    pub fn new(inner: D) -> PageHandles<D> {
        let devices = usize::try_from(inner.device_count()).unwrap_or(0);
        PageHandles {
            inner,
            whole_only: (0..devices).map(|_| OnceLock::new()).collect(),
            handles: Mutex::new(HashMap::new()),
            runs: AtomicBool::new(true),
            leftovers: Mutex::new(Vec::new()),
            next: AtomicU64::new(1),
        }
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The bytes on `device` held by pages of failed creations whose release the driver refused
    /// (released again before later calls): memory the pool does not count.
    pub fn orphaned_bytes(&self, device: i32) -> u64 {
        let pages = self
            .leftovers()
            .iter()
            .filter(|l| matches!(l, Leftover::Page(d, _) if *d == device))
            .count() as u64;
        pages * self.page(device).unwrap_or(0)
    }

    /// The page size where `device` maps only from an allocation's start and the pool's handles
    /// on it are made of pages.
    fn page(&self, device: i32) -> Option<u64> {
        let slot = self.whole_only.get(usize::try_from(device).ok()?)?;
        slot.get().copied()
    }

    fn leftovers(&self) -> MutexGuard<'_, Vec<Leftover>> {
        self.leftovers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Make good what earlier undos left; what the driver still refuses stays for next time.
    fn settle(&self) {
        let mut leftovers = self.leftovers();
        if !leftovers.is_empty() {
            leftovers.retain(|&left| match left {
                Leftover::Page(device, page) => self.inner.vmm_release(device, page).is_err(),
                Leftover::Mapping(device, at, size) => {
                    self.inner.vmm_unmap(device, at, size).is_err()
                }
            });
        }
    }

    /// Release `pages`, which the pool never knew; those the driver will not take back now are
    /// released again later.
    fn release_or_orphan(&self, device: i32, pages: &[PhysHandle]) {
        for &page in pages {
            if self.inner.vmm_release(device, page).is_err() {
                self.leftovers().push(Leftover::Page(device, page));
            }
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<PhysHandle, Pages>> {
        // Each change to the table is whole (an entry inserted or removed, a page's slot set
        // once its page is made): a panic elsewhere cannot leave one half made.
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unmap, or set access to, `[ptr, ptr + size)` with `call`: one call for the run while the
    /// driver takes runs, else (or once it refused one) a call per page.
    fn per_run_or_page(
        &self,
        page: u64,
        ptr: DevicePtr,
        size: u64,
        call: impl Fn(DevicePtr, u64) -> DriverResult<()>,
    ) -> DriverResult<()> {
        if size > page && self.runs.load(Ordering::Relaxed) {
            match call(ptr, size) {
                Err(e) if e.code == CUDA_ERROR_INVALID_VALUE => {
                    self.runs.store(false, Ordering::Relaxed);
                }
                answer => return answer,
            }
        }
        (0..size / page).try_for_each(|i| call(ptr + i * page, page))
    }
}

impl<D: Driver> Drop for PageHandles<D> {
    fn drop(&mut self) {
        // Pages and mappings an undo left are made good before the wrapper goes (the driver
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
        // Whole-only devices are made to look like devices that map at offsets.
        None
    }

    fn vmm_reserve(&self, device: i32, size: u64) -> DriverResult<DevicePtr> {
        self.inner.vmm_reserve(device, size)
    }

    fn vmm_free(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.settle();
        self.inner.vmm_free(device, ptr, size)
    }

    fn vmm_create(&self, device: i32, size: u64) -> DriverResult<PhysHandle> {
        let Some(page) = self.page(device).filter(|&page| size > page) else {
            return self.inner.vmm_create(device, size);
        };
        self.settle();
        // Out of memory is answered before any page is made, as one cuMemCreate answers it: a
        // creation that failed part way would otherwise make and release pages for nothing,
        // and leave them with the driver where it also refuses their release.
        let (free, _) = self.inner.mem_get_info(device)?;
        if size > free {
            return Err(DriverError {
                call: "cuMemCreate",
                code: CUDA_ERROR_OUT_OF_MEMORY,
                name: "CUDA_ERROR_OUT_OF_MEMORY".to_string(),
                description: format!(
                    "{size} bytes asked for in pages of {page}, {free} free on the device"
                ),
            });
        }
        let count = size.div_ceil(page);
        let mut pages = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        for _ in 0..count {
            match self.inner.vmm_create(device, page) {
                Ok(handle) => pages.push(handle),
                Err(e) => {
                    // The pages made so far go back; the failure (out of memory, say) is the
                    // pool's to handle as from one call. Those the driver will not take back
                    // now are released again later.
                    self.release_or_orphan(device, &pages);
                    return Err(e);
                }
            }
        }
        // A name of its own, that no driver handle takes (a driver's handles are addresses or
        // small counts): a page's handle could be the driver's again for another allocation
        // once released, while the whole is still retried.
        let id = COMPOSED | self.next.fetch_add(1, Ordering::Relaxed);
        self.table()
            .insert(id, pages.into_iter().map(Some).collect());
        Ok(id)
    }

    fn vmm_release(&self, device: i32, handle: PhysHandle) -> DriverResult<()> {
        self.settle();
        let Some(mut pages) = self.table().remove(&handle) else {
            return self.inner.vmm_release(device, handle);
        };
        // As one call: where the driver refuses a page, the handle stays for the pool to use or
        // release again (the pool keeps a handle whose release failed), whole: the pages
        // released before the refusal are made again (memory given up, whose contents nobody
        // needs), now or, where the driver will not make them now, where the handle is mapped.
        // Until then the driver holds less than the pool counts, never more.
        for i in 0..pages.len() {
            let Some(page) = pages[i] else { continue };
            if let Err(e) = self.inner.vmm_release(device, page) {
                if let Some(size) = self.page(device) {
                    for slot in pages[..i].iter_mut() {
                        match self.inner.vmm_create(device, size) {
                            Ok(made) => *slot = Some(made),
                            Err(_) => break,
                        }
                    }
                }
                self.table().insert(handle, pages);
                return Err(e);
            }
            pages[i] = None;
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
        let Some(page) = self.page(device) else {
            return self.inner.vmm_map(device, ptr, size, handle, offset);
        };
        self.settle();
        let run = {
            let mut table = self.table();
            let Some(pages) = table.get_mut(&handle) else {
                drop(table);
                return self.inner.vmm_map(device, ptr, size, handle, offset);
            };
            let first = usize::try_from(offset / page).unwrap_or(usize::MAX);
            let count = usize::try_from(size / page).unwrap_or(usize::MAX);
            let len = pages.len() as u64 * page;
            let run = (size > 0 && offset % page == 0 && size % page == 0)
                .then(|| pages.get_mut(first..first.checked_add(count)?))
                .flatten();
            let Some(run) = run else {
                // What the driver answers a run past a handle's end, or not of whole pages.
                return Err(DriverError {
                    call: "cuMemMap",
                    code: CUDA_ERROR_INVALID_VALUE,
                    name: "CUDA_ERROR_INVALID_VALUE".to_string(),
                    description: format!(
                        "{size} bytes from offset {offset} are not whole pages of a handle of \
                         {len} bytes"
                    ),
                });
            };
            // Pages a failed release gave back are made again (rarely: under the table's lock).
            for slot in run.iter_mut().filter(|slot| slot.is_none()) {
                *slot = Some(self.inner.vmm_create(device, page)?);
            }
            run.iter().flatten().copied().collect::<Vec<_>>()
        };
        for (i, &part) in (0u64..).zip(&run) {
            if let Err(e) = self.inner.vmm_map(device, ptr + i * page, page, part, 0) {
                // Undo what was mapped, page by page (each its own mapping); the range is left
                // as it was found, or as it will be once the pages the driver will not unmap now
                // are unmapped before the next mapping or address-range free.
                for j in 0..i {
                    let at = ptr + j * page;
                    if self.inner.vmm_unmap(device, at, page).is_err() {
                        self.leftovers().push(Leftover::Mapping(device, at, page));
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn vmm_unmap(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        match self.page(device) {
            Some(page) if size % page == 0 => {
                self.per_run_or_page(page, ptr, size, |p, s| self.inner.vmm_unmap(device, p, s))
            }
            _ => self.inner.vmm_unmap(device, ptr, size),
        }
    }

    fn vmm_set_access(&self, device: i32, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        match self.page(device) {
            Some(page) if size % page == 0 => self.per_run_or_page(page, ptr, size, |p, s| {
                self.inner.vmm_set_access(device, p, s)
            }),
            _ => self.inner.vmm_set_access(device, ptr, size),
        }
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
        driver.vmm_set_access(0, va, 4 * MIB).unwrap();
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
        driver.vmm_set_access(0, a, 4 * MIB).unwrap();
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
    fn a_driver_that_refuses_a_run_is_asked_page_by_page_from_then_on() {
        let (driver, sim) = driver(GIB, VmmSetting::StartOnly);
        assert!(driver.vmm_granularity(0).is_some());
        let handle = driver.vmm_create(0, 6 * MIB).unwrap();
        let va = driver.vmm_reserve(0, 6 * MIB).unwrap();
        driver.vmm_map(0, va, 6 * MIB, handle, 0).unwrap();
        let before = calls(sim);
        sim.inject_faults("cuMemSetAccess@1=1").unwrap();
        driver.vmm_set_access(0, va, 6 * MIB).unwrap();
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
