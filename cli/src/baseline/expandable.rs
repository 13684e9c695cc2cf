//! PyTorch's expandable segments (`expandable_segments:True`) in the baseline, as
//! `CUDACachingAllocator.cpp`'s `ExpandableSegment`, `find_expandable_block`, `map_block` and
//! `unmap_block` have them.
//!
//! A stream's memory of each pool lies in one range of address space as large as the device and
//! an eighth more (another range where that one has no room). It is made of handles of 2 MiB
//! (small pool) or 20 MiB (large pool), a `cuMemCreate` each, mapped where a free block of the
//! range must grow to hold a request: the lowest-addressed run of free and unmapped blocks that
//! covers it. Its blocks split whenever 512 bytes or more remain, and merge as any. When
//! PyTorch returns cache (out of memory, `empty_cache`), each cached block's whole handles go
//! back to the driver, and a range left with nothing mapped is freed.

use resmem::driver::{DevicePtr, PhysHandle, StreamHandle};
use resmem::error::{Error, Result};

use super::torch::{Block, Device, TorchAllocator, LARGE_BUFFER, SMALL_BUFFER};

/// One expandable segment: its address range and the handle mapped at each of its places.
pub(super) struct Expandable {
    base: DevicePtr,
    size: u64,
    /// The size of each handle: 2 MiB (small pool) or 20 MiB (large).
    handle_size: u64,
    handles: Vec<Option<PhysHandle>>,
}

impl TorchAllocator {
    /// A block of at least `rounded` bytes from this stream's expandable segments of the pool,
    /// taken out of the free set, mapping what it lacks; `None` where the driver is out of
    /// memory.
    pub(super) fn alloc_expandable(
        &self,
        device: i32,
        dev: &mut Device,
        rounded: u64,
        small: bool,
        stream: StreamHandle,
    ) -> Result<Option<DevicePtr>> {
        let mut at = self.find_expandable_block(device, dev, rounded, small, stream)?;
        if !dev.blocks[&at].mapped {
            let size = dev.blocks[&at].size.min(rounded);
            match self.map_block(device, dev, at, size)? {
                Some(merged) => at = merged,
                None => return Ok(None),
            }
        }
        // A free block followed by unmapped space: map what it still lacks after it.
        while dev.blocks[&at].size < rounded {
            let lacking = rounded - dev.blocks[&at].size;
            let next = dev.blocks[&at].next.expect("found with room enough");
            let size = dev.blocks[&next].size.min(lacking);
            match self.map_block(device, dev, next, size)? {
                Some(merged) => at = merged,
                None => return Ok(None),
            }
        }
        let b = &dev.blocks[&at];
        let key = (b.stream, b.size, at);
        dev.free[usize::from(!small)].remove(&key);
        Ok(Some(at))
    }

    /// The lowest-addressed place in this stream's segments of the pool where free and unmapped
    /// blocks together hold `size` bytes (a free block just before an unmapped one counts), or a
    /// new segment's unmapped block.
    fn find_expandable_block(
        &self,
        device: i32,
        dev: &mut Device,
        size: u64,
        small: bool,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        let usable = |dev: &Device, p: Option<DevicePtr>| {
            p.filter(|p| {
                let b = &dev.blocks[p];
                !b.allocated && !b.pending
            })
        };
        let room = |dev: &Device, mut p: Option<DevicePtr>| {
            let mut bytes = 0;
            while bytes < size {
                let Some(q) = usable(dev, p) else { break };
                bytes += dev.blocks[&q].size;
                p = dev.blocks[&q].next;
            }
            bytes >= size
        };
        let unmapped = &dev.unmapped[usize::from(!small)];
        for &(_, ptr) in unmapped.range((stream, 0)..(stream, DevicePtr::MAX)) {
            let start = usable(dev, dev.blocks[&ptr].prev).unwrap_or(ptr);
            if room(dev, Some(start)) {
                return Ok(start);
            }
        }
        // A new segment: address space for the device's memory and an eighth more.
        let handle_size = if small { SMALL_BUFFER } else { LARGE_BUFFER };
        let (_, total) = self
            .driver
            .mem_get_info(device)
            .map_err(|e| Error::driver("asking the device's memory", &e))?;
        let count = (total + total / 8)
            .div_ceil(handle_size)
            .max(size.div_ceil(handle_size));
        let bytes = count * handle_size;
        let base = self
            .driver
            .vmm_reserve(device, bytes)
            .map_err(|e| Error::driver("reserving an expandable segment's addresses", &e))?;
        let index = dev.expandable.len();
        dev.expandable.push(Some(Expandable {
            base,
            size: bytes,
            handle_size,
            handles: Vec::new(),
        }));
        dev.blocks.insert(
            base,
            Block::unused(bytes, (stream, small), (None, None), (false, Some(index))),
        );
        dev.unmapped[usize::from(!small)].insert((stream, base));
        dev.stats.segments += 1;
        Ok(base)
    }

    /// Map handles over the unmapped block at `ptr`, from its start, to hold at least `size`
    /// bytes; the rest stays unmapped. The mapped block merges with free neighbours and joins
    /// the free set: its address, or `None` (nothing created) where the driver is out of memory.
    fn map_block(
        &self,
        device: i32,
        dev: &mut Device,
        ptr: DevicePtr,
        size: u64,
    ) -> Result<Option<DevicePtr>> {
        let (stream, small, whole, index) = {
            let b = &dev.blocks[&ptr];
            (
                b.stream,
                b.small,
                b.size,
                b.expandable.expect("in a segment"),
            )
        };
        let seg = dev.expandable[index].as_mut().expect("a live segment");
        let hs = seg.handle_size;
        let (first, end) = ((ptr - seg.base) / hs, (ptr - seg.base + size).div_ceil(hs));
        let mut created = Vec::new();
        for _ in first..end {
            match self.driver.vmm_create(device, hs) {
                Ok(h) => created.push(h),
                Err(e) => {
                    for h in created {
                        let _ = self.driver.vmm_release(device, h);
                    }
                    if e.is_out_of_memory() {
                        return Ok(None);
                    }
                    return Err(Error::driver("creating an expandable segment's handle", &e));
                }
            }
        }
        let end_usize = usize::try_from(end).expect("handles fit the address space");
        if seg.handles.len() < end_usize {
            seg.handles.resize(end_usize, None);
        }
        for (i, &h) in (first..end).zip(&created) {
            self.driver
                .vmm_map(device, seg.base + i * hs, hs, h, 0)
                .map_err(|e| Error::driver("mapping an expandable segment's handle", &e))?;
            seg.handles[i as usize] = Some(h);
        }
        let mapped = (end - first) * hs;
        self.driver
            .vmm_set_access(device, ptr, mapped, &[])
            .map_err(|e| Error::driver("giving access to an expandable segment", &e))?;
        dev.unmapped[usize::from(!small)].remove(&(stream, ptr));
        if mapped < whole {
            // The rest stays unmapped, after it.
            let rest = ptr + mapped;
            let next = dev.blocks[&ptr].next;
            dev.blocks.insert(
                rest,
                Block::unused(
                    whole - mapped,
                    (stream, small),
                    (Some(ptr), next),
                    (false, Some(index)),
                ),
            );
            if let Some(n) = next {
                dev.blocks.get_mut(&n).expect("linked").prev = Some(rest);
            }
            let b = dev.blocks.get_mut(&ptr).expect("known");
            b.next = Some(rest);
            b.size = mapped;
            dev.unmapped[usize::from(!small)].insert((stream, rest));
        }
        dev.blocks.get_mut(&ptr).expect("known").mapped = true;
        dev.stats.add_reserved(mapped, end - first);
        dev.driver_bytes += mapped;
        // Free, merged with free neighbours as a released block is: a free block before it
        // takes it in.
        let before = dev.blocks[&ptr].prev.filter(|p| {
            let b = &dev.blocks[p];
            !b.allocated && !b.pending && b.mapped
        });
        Self::free_block(dev, ptr);
        Ok(Some(before.unwrap_or(ptr)))
    }

    /// Return the whole handles inside the cached block at `ptr` (the device's work done); the
    /// bytes returned. What is left mapped at either end stays a free block; the unmapped part
    /// merges with unmapped neighbours, and a segment with nothing mapped is freed.
    pub(super) fn unmap_block(&self, device: i32, dev: &mut Device, ptr: DevicePtr) -> Result<u64> {
        let (stream, small, size, prev, next, index) = {
            let b = &dev.blocks[&ptr];
            (
                b.stream,
                b.small,
                b.size,
                b.prev,
                b.next,
                b.expandable.expect("in a segment"),
            )
        };
        let seg = dev.expandable[index].as_mut().expect("a live segment");
        let hs = seg.handle_size;
        let (first, end) = ((ptr - seg.base).div_ceil(hs), (ptr - seg.base + size) / hs);
        if first >= end {
            return Ok(0);
        }
        for i in first..end {
            let at = seg.base + i * hs;
            let handle = seg.handles[i as usize].take().expect("mapped");
            self.driver
                .vmm_unmap(device, at, hs)
                .and_then(|()| self.driver.vmm_release(device, handle))
                .map_err(|e| Error::driver("returning an expandable segment's handle", &e))?;
        }
        let (start, bytes) = (seg.base + first * hs, (end - first) * hs);
        let pool = usize::from(!small);
        dev.free[pool].remove(&(stream, size, ptr));
        dev.blocks.remove(&ptr);
        // In its place: mapped bytes before the handles returned (free), the unmapped handles,
        // mapped bytes after them (free).
        let mut pieces = Vec::with_capacity(3);
        if start > ptr {
            pieces.push((ptr, start - ptr, true));
        }
        pieces.push((start, bytes, false));
        if start + bytes < ptr + size {
            pieces.push((start + bytes, ptr + size - start - bytes, true));
        }
        for (i, &(at, len, mapped)) in pieces.iter().enumerate() {
            let before = if i == 0 { prev } else { Some(pieces[i - 1].0) };
            let after = pieces.get(i + 1).map(|p| p.0).or(next);
            dev.blocks.insert(
                at,
                Block::unused(len, (stream, small), (before, after), (mapped, Some(index))),
            );
            if mapped {
                dev.free[pool].insert((stream, len, at));
            }
        }
        if let Some(p) = prev {
            dev.blocks.get_mut(&p).expect("linked").next = Some(pieces[0].0);
        }
        if let Some(n) = next {
            dev.blocks.get_mut(&n).expect("linked").prev = Some(pieces[pieces.len() - 1].0);
        }
        dev.stats.remove_reserved(bytes, end - first);
        let start = Self::merge_unmapped(dev, start);
        let b = &dev.blocks[&start];
        if b.prev.is_none() && b.next.is_none() {
            self.release_segment(device, dev, start)?;
        } else {
            dev.unmapped[pool].insert((stream, start));
        }
        Ok(bytes)
    }

    /// Merge the unmapped block at `ptr` with unmapped neighbours (taken out of the unmapped
    /// set); the merged block's address, not in the set.
    fn merge_unmapped(dev: &mut Device, mut ptr: DevicePtr) -> DevicePtr {
        let small = dev.blocks[&ptr].small;
        let unmapped = |dev: &Device, p: Option<DevicePtr>| p.filter(|p| !dev.blocks[p].mapped);
        if let Some(prev) = unmapped(dev, dev.blocks[&ptr].prev) {
            dev.unmapped[usize::from(!small)].remove(&(dev.blocks[&prev].stream, prev));
            dev.merge(prev, ptr);
            ptr = prev;
        }
        if let Some(next) = unmapped(dev, dev.blocks[&ptr].next) {
            dev.unmapped[usize::from(!small)].remove(&(dev.blocks[&next].stream, next));
            dev.merge(ptr, next);
        }
        ptr
    }

    /// Free the address range of a segment with nothing mapped: its one block at `ptr`.
    fn release_segment(&self, device: i32, dev: &mut Device, ptr: DevicePtr) -> Result<()> {
        let block = dev.blocks.remove(&ptr).expect("known");
        let index = block.expandable.expect("in a segment");
        let seg = dev.expandable[index].take().expect("a live segment");
        self.driver
            .vmm_free(device, seg.base, seg.size)
            .map_err(|e| Error::driver("freeing an expandable segment's addresses", &e))?;
        dev.stats.segments -= 1;
        Ok(())
    }
}
