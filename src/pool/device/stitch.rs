//! Virtual-memory stitching (`RESMEM_CONF=vmm:true`): a segment is a reserved address range
//! backed by physical chunks mapped back to back, so a new segment can be built from chunks the
//! cache holds anywhere (idle segments taken apart, spare chunks) and only the shortfall is
//! created with the driver. A request larger than every cached block can then use cached
//! memory without returning it to the driver first: 748 MiB cached and 736 MiB free serve a
//! 784 MiB request by remapping the 748 MiB and creating 36 MiB.
//!
//! Chunks are multiples of the allocation granularity; new ones are sized to about a quarter of
//! what is needed (at least one granule, at most 512 MiB), which bounds both the number of
//! driver calls per segment and the unusable rest when chunks are picked for a later request.
//! Access is set once per segment. Reusable chunks come, in this order, from spare chunks, from
//! idle segments taken apart, and from free blocks inside segments that still hold live blocks:
//! a chunk lying wholly inside a free block is unmapped and the block becomes a *hole* (address
//! space without memory, never handed out), so fragmentation inside a segment does not strand
//! physical memory.
//!
//! The bound this keeps, checked after every operation of the property tests: after
//! `free_reusable`, the physical memory held is exactly the chunks that live blocks touch; in
//! between, new physical memory is created only for the part of a request that the spare chunks,
//! the idle segments and the chunks lying wholly inside free blocks could not cover. What is held
//! beyond live bytes is therefore the partly used chunks under live blocks, plus reusable chunks
//! not yet needed (all returned by `free_reusable`).
//!
//! Every step that unmaps memory records it as it goes (an unmapped chunk becomes a hole and goes
//! to the spare chunks), so a driver failure midway is reported with the books still exact; the
//! fault sweep in `tests/faults.rs` fails every driver call at every position to hold that.

use super::{Context, DevicePool, Grow, State, NIL};
use crate::driver::{DevicePtr, PhysHandle};
use crate::error::{Error, Result};
use crate::pool::size::{human, Class};

/// Physical memory from `cuMemCreate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Chunk {
    pub(super) handle: PhysHandle,
    pub(super) size: u64,
}

/// Whether a device pool stitches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VmmMode {
    /// Not asked yet (decided at the first growth, which has the driver at hand).
    Undecided,
    /// Classic segments from `cuMemAlloc`.
    Off,
    /// Stitched segments, with this allocation granularity.
    On(u64),
}

/// The largest chunk created at once.
const MAX_CHUNK: u64 = 512 << 20;

/// The sizes of the chunks to create for `need` bytes (a multiple of `granularity`).
pub(super) fn chunk_plan(need: u64, granularity: u64) -> Vec<u64> {
    if need == 0 {
        return Vec::new();
    }
    let quarter = (need / 4).max(granularity);
    let chunk = (1u64 << (63 - quarter.leading_zeros()))
        .clamp(granularity, MAX_CHUNK.max(granularity))
        / granularity
        * granularity;
    let mut plan = vec![chunk; (need / chunk) as usize];
    if need % chunk != 0 {
        plan.push(need % chunk);
    }
    plan
}

impl DevicePool {
    /// Whether this pool stitches; asks the driver once.
    pub(super) fn stitching(&mut self, cx: &Context<'_>) -> bool {
        if self.vmm == VmmMode::Undecided {
            self.vmm = match (self.config.vmm, cx.driver.vmm_granularity(self.device)) {
                (true, Some(granularity)) => VmmMode::On(granularity),
                (true, None) => {
                    self.log(format_args!(
                        "vmm:true, but the driver or device lacks the virtual-memory API: \
                         using classic segments"
                    ));
                    VmmMode::Off
                }
                (false, _) => VmmMode::Off,
            };
        }
        matches!(self.vmm, VmmMode::On(_))
    }

    /// Physical memory for a new segment of `size` bytes, mapped and accessible: reusable
    /// chunks first (unless `mode` keeps the cache as it is), then new ones for the shortfall.
    /// Returns the segment's address and its chunks, already counted as reserved.
    pub(super) fn stitch(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        class: Class,
        requested: u64,
        mode: Grow,
        driver_free: u64,
    ) -> Result<(DevicePtr, Vec<Chunk>)> {
        let VmmMode::On(granularity) = self.vmm else {
            return Err(Error::internal("stitching without the virtual-memory API"));
        };
        let size = size.next_multiple_of(granularity);
        let mut picked = Vec::new();
        if mode == Grow::MayRelease {
            if let Err(err) = self.gather(cx, &mut picked, size, class) {
                // What was picked stays held, as spare.
                self.spare.append(&mut picked);
                return Err(err);
            }
        }
        let have: u64 = picked.iter().map(|c| c.size).sum();
        let size = size.max(have);
        let created = match self.create_chunks(cx, size - have, requested, mode, driver_free) {
            Ok(created) => created,
            Err(err) => {
                self.spare.extend(picked);
                return Err(err);
            }
        };
        let reused = picked.len();
        picked.extend(created);
        match self.map_chunks(cx, size, &picked) {
            Ok(base) => {
                self.log(format_args!(
                    "stitched a {} segment from {reused} cached and {} new chunks",
                    human(size),
                    picked.len() - reused
                ));
                Ok((base, picked))
            }
            Err(err) => {
                self.spare.extend(picked);
                Err(err)
            }
        }
    }

    /// Pick reusable chunks for `size` bytes into `picked`: spare ones, then those of idle
    /// segments taken apart, then those under free blocks of segments in use.
    fn gather(
        &mut self,
        cx: &Context<'_>,
        picked: &mut Vec<Chunk>,
        size: u64,
        class: Class,
    ) -> Result<()> {
        self.pick_spare(picked, size, class);
        if picked.iter().map(|c| c.size).sum::<u64>() < size && !self.idle.is_empty() {
            self.take_apart_idle(cx, size, class)?;
            self.pick_spare(picked, size, class);
        }
        let have: u64 = picked.iter().map(|c| c.size).sum();
        if have < size {
            let harvested = self.harvest(cx, size - have)?;
            self.spare.extend(harvested);
            self.pick_spare(picked, size, class);
        }
        Ok(())
    }

    /// Move spare chunks into `picked`: largest first while each fits what is still needed,
    /// then, for a large request that is not covered, the smallest spare chunk that covers the
    /// rest (the segment grows by the excess, which stays reusable in it, rather than the
    /// driver being asked for more memory while unmapped memory sits idle).
    fn pick_spare(&mut self, picked: &mut Vec<Chunk>, size: u64, class: Class) {
        let mut need = size.saturating_sub(picked.iter().map(|c| c.size).sum::<u64>());
        self.spare
            .sort_unstable_by_key(|c| std::cmp::Reverse(c.size));
        let mut i = 0;
        while i < self.spare.len() && need > 0 {
            if self.spare[i].size <= need {
                let chunk = self.spare.remove(i);
                need -= chunk.size;
                picked.push(chunk);
            } else {
                i += 1;
            }
        }
        if need > 0 && class == Class::Large {
            // Sorted largest first: the last one that covers the rest is the smallest.
            if let Some(at) = self.spare.iter().rposition(|c| c.size >= need) {
                picked.push(self.spare.remove(at));
            }
        }
    }

    /// Take idle segments apart into spare chunks, largest first, until the spare chunks could
    /// cover `size` (small segments only for small requests' 2 MiB segments).
    fn take_apart_idle(&mut self, cx: &Context<'_>, size: u64, class: Class) -> Result<()> {
        let mut idle: Vec<(u64, u32)> = self
            .idle
            .iter()
            .map(|&seg| (self.segments[seg as usize].size, seg))
            .filter(|&(seg_size, _)| class == Class::Large || seg_size <= size)
            .collect();
        idle.sort_unstable_by_key(|&(seg_size, seg)| (std::cmp::Reverse(seg_size), seg));
        // Work queued before the blocks were released may still use the memory.
        if !idle.is_empty() {
            cx.driver.synchronize(self.device).map_err(|e| {
                Error::driver("waiting for the device before remapping cached memory", &e)
            })?;
        }
        let mut have: u64 = self.spare.iter().map(|c| c.size).sum();
        for (seg_size, seg) in idle {
            if have >= size {
                break;
            }
            let chunks = self.dismantle(cx, seg)?;
            self.spare.extend(chunks);
            have += seg_size;
        }
        Ok(())
    }

    /// Unmap a stitched segment with no block in use and free its address range; its chunks
    /// stay held and are returned. Chunk by chunk, each unmapped one becoming a hole, so that a
    /// driver failure midway leaves exact books: the chunks unmapped so far go to the spare
    /// chunks, and the rest stay mapped in the segment.
    pub(super) fn dismantle(&mut self, cx: &Context<'_>, seg: u32) -> Result<Vec<Chunk>> {
        let chunks = self.segments[seg as usize].chunks.clone();
        let mut taken = Vec::new();
        for (offset, chunk) in chunks {
            if let Err(err) = self.carve_hole(cx, seg, offset, chunk) {
                self.spare.append(&mut taken);
                return Err(err);
            }
            taken.push(chunk);
        }
        let (base, size) = (
            self.segments[seg as usize].base,
            self.segments[seg as usize].size,
        );
        if let Err(e) = cx.driver.vmm_free(self.device, base, size) {
            // The segment stays, all holes, until a later attempt frees its range.
            self.spare.append(&mut taken);
            return Err(Error::driver(
                &format!("freeing the address range of segment {base:#x}"),
                &e,
            ));
        }
        let left = self.forget_segment(cx, seg);
        debug_assert!(left.is_empty());
        Ok(taken)
    }

    /// Unmap chunks that lie wholly inside free blocks of stitched segments, turning their
    /// address space into holes, until at least `need` bytes are collected (`u64::MAX`: all),
    /// taking only chunks of at most `need` bytes. Segments left with no memory are freed.
    pub(super) fn harvest(&mut self, cx: &Context<'_>, need: u64) -> Result<Vec<Chunk>> {
        let mut found: Vec<(u32, u64, Chunk)> = Vec::new();
        for (seg, s) in self.segments.iter().enumerate() {
            if !s.in_use || !s.stitched {
                continue;
            }
            // Walk blocks and chunks together, both in address order.
            let mut id = s.first;
            for &(offset, chunk) in &s.chunks {
                let (start, end) = (s.base + offset, s.base + offset + chunk.size);
                while id != NIL && self.blocks[id].ptr + self.blocks[id].size <= start {
                    id = self.blocks[id].next;
                }
                if id == NIL {
                    break;
                }
                let b = &self.blocks[id];
                if b.state == State::Free && b.ptr <= start && end <= b.ptr + b.size {
                    found.push((seg as u32, offset, chunk));
                }
            }
        }
        if found.is_empty() {
            return Ok(Vec::new());
        }
        // Largest chunks first: fewer unmaps for the same memory.
        found.sort_unstable_by_key(|&(seg, offset, chunk)| {
            (std::cmp::Reverse(chunk.size), seg, offset)
        });
        // Only chunks that fit are taken: a larger one would carve free space out of a segment
        // that is likely still filling (a warm-up range being split into parameters).
        let mut chosen = Vec::new();
        let mut have = 0u64;
        for entry in found {
            if have < need && entry.2.size <= need - have {
                have += entry.2.size;
                chosen.push(entry);
            }
        }
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        cx.driver.synchronize(self.device).map_err(|e| {
            Error::driver("waiting for the device before remapping cached memory", &e)
        })?;
        let mut taken = Vec::new();
        for (seg, offset, chunk) in chosen {
            if let Err(err) = self.carve_hole(cx, seg, offset, chunk) {
                // The chunks already unmapped stay held, as spare.
                self.spare.append(&mut taken);
                return Err(err);
            }
            taken.push(chunk);
        }
        if let Err(err) = self.free_hollow_segments(cx) {
            self.spare.append(&mut taken);
            return Err(err);
        }
        Ok(taken)
    }

    /// Unmap the chunk at `offset` of `seg`, which lies inside a free block, and make its
    /// address range a hole.
    fn carve_hole(&mut self, cx: &Context<'_>, seg: u32, offset: u64, chunk: Chunk) -> Result<()> {
        let (base, slot, class) = {
            let s = &self.segments[seg as usize];
            (s.base, s.slot, s.class)
        };
        let (start, end) = (base + offset, base + offset + chunk.size);
        let mut id = self.segments[seg as usize].first;
        while self.blocks[id].ptr + self.blocks[id].size <= start {
            id = self.blocks[id].next;
        }
        cx.driver
            .vmm_unmap(self.device, start, chunk.size)
            .map_err(|e| {
                Error::driver(
                    &format!("unmapping a cached chunk of segment {base:#x}"),
                    &e,
                )
            })?;
        if self.segments[seg as usize].idle_at != NIL {
            // With a hole it is no longer one free block: not idle any more.
            self.unmark_idle(seg);
        }
        let at = self.segments[seg as usize]
            .chunks
            .iter()
            .position(|&(o, _)| o == offset)
            .expect("the chunk is listed");
        self.segments[seg as usize].chunks.remove(at);
        // Split the free block into [left free][hole][right free].
        self.bin_remove(slot, class, id);
        let (ptr, size, next) = (
            self.blocks[id].ptr,
            self.blocks[id].size,
            self.blocks[id].next,
        );
        let mut hole = id;
        if ptr < start {
            self.blocks[id].size = start - ptr;
            self.bin_insert(slot, class, id);
            hole = self.new_block_after(id, start, chunk.size, State::Hole);
        } else {
            self.blocks[id].state = State::Hole;
            self.blocks[id].size = chunk.size;
        }
        if end < ptr + size {
            let right = self.new_block_after(hole, end, ptr + size - end, State::Free);
            debug_assert_eq!(self.blocks[right].next, next);
            self.bin_insert(slot, class, right);
        }
        Ok(())
    }

    /// Insert a block of `size` bytes at `ptr` right after block `after`; returns it.
    fn new_block_after(&mut self, after: u32, ptr: DevicePtr, size: u64, state: State) -> u32 {
        let (segment, next) = (self.blocks[after].segment, self.blocks[after].next);
        let id = self.blocks.insert(crate::pool::blocks::Block {
            ptr,
            size,
            requested: 0,
            segment,
            prev: after,
            next,
            state,
            shared: false,
        });
        self.blocks[after].next = id;
        if next != NIL {
            self.blocks[next].prev = id;
        }
        id
    }

    /// Free the address range of stitched segments left with no memory mapped in them.
    fn free_hollow_segments(&mut self, cx: &Context<'_>) -> Result<()> {
        let hollow: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&seg| {
                let s = &self.segments[seg as usize];
                s.in_use && s.stitched && s.chunks.is_empty() && self.is_hollow(seg)
            })
            .collect();
        for seg in hollow {
            let chunks = self.dismantle(cx, seg)?;
            debug_assert!(chunks.is_empty());
        }
        Ok(())
    }

    /// Whether every block of `seg` is a hole (then nothing is mapped in it).
    fn is_hollow(&self, seg: u32) -> bool {
        let mut id = self.segments[seg as usize].first;
        while id != NIL {
            if self.blocks[id].state != State::Hole {
                return false;
            }
            id = self.blocks[id].next;
        }
        true
    }

    /// Create chunks for `need` bytes. When the driver is short, spare chunks and idle segments
    /// go back first (if `mode` allows); after an out-of-memory, everything reusable goes back
    /// and the chunk is tried once more. On failure the chunks created so far are released.
    fn create_chunks(
        &mut self,
        cx: &Context<'_>,
        need: u64,
        requested: u64,
        mode: Grow,
        driver_free: u64,
    ) -> Result<Vec<Chunk>> {
        let VmmMode::On(granularity) = self.vmm else {
            return Ok(Vec::new());
        };
        if need == 0 {
            return Ok(Vec::new());
        }
        self.make_room_under_limit(cx, need, requested, mode)?;
        if mode == Grow::MayRelease && driver_free < need && self.config.release_before_grow {
            self.release_idle(cx, need - driver_free)?;
        }
        let mut created = Vec::new();
        let mut retried = false;
        let plan = chunk_plan(need, granularity);
        let mut i = 0;
        while i < plan.len() {
            match cx.driver.vmm_create(self.device, plan[i]) {
                Ok(handle) => {
                    self.stats.add_reserved(plan[i], 1);
                    created.push(Chunk {
                        handle,
                        size: plan[i],
                    });
                    i += 1;
                }
                Err(err) if err.is_out_of_memory() && mode == Grow::MayRelease && !retried => {
                    retried = true;
                    self.stats.oom_retries += 1;
                    let returned = self
                        .collect_pending(cx, true)
                        .and_then(|()| self.release_idle(cx, u64::MAX));
                    if let Err(err) = returned {
                        // The chunks created so far stay held, as spare.
                        self.spare.append(&mut created);
                        return Err(err);
                    }
                }
                Err(err) => {
                    self.release_chunks(cx, created)?;
                    return Err(self.alloc_failure(cx, err, requested, need));
                }
            }
        }
        Ok(created)
    }

    /// Reserve an address range of `size` bytes and map `chunks` back to back into it, with
    /// read-write access. On failure everything done here is undone.
    fn map_chunks(&mut self, cx: &Context<'_>, size: u64, chunks: &[Chunk]) -> Result<DevicePtr> {
        let device = self.device;
        let base = cx.driver.vmm_reserve(device, size).map_err(|e| {
            Error::driver(&format!("reserving {} of address space", human(size)), &e)
        })?;
        let mut mapped = 0;
        let mut result = Ok(());
        for chunk in chunks {
            if let Err(e) = cx
                .driver
                .vmm_map(device, base + mapped, chunk.size, chunk.handle, 0)
            {
                result = Err(Error::driver("mapping a chunk into a new segment", &e));
                break;
            }
            mapped += chunk.size;
        }
        if result.is_ok() {
            result = cx
                .driver
                .vmm_set_access(device, base, size)
                .map_err(|e| Error::driver("setting access to a new segment", &e));
        }
        if let Err(err) = result {
            if mapped > 0 {
                let _ = cx.driver.vmm_unmap(device, base, mapped);
            }
            let _ = cx.driver.vmm_free(device, base, size);
            return Err(err);
        }
        Ok(base)
    }

    /// Release spare chunks to the driver, largest first, until at least `needed` bytes went
    /// back (`u64::MAX`: all). Returns the bytes released.
    pub(super) fn release_spare(&mut self, cx: &Context<'_>, needed: u64) -> Result<u64> {
        self.spare.sort_unstable_by_key(|c| c.size);
        let mut released = 0;
        while released < needed {
            let Some(chunk) = self.spare.pop() else {
                break;
            };
            if let Err(e) = cx.driver.vmm_release(self.device, chunk.handle) {
                self.spare.push(chunk);
                return Err(Error::driver("returning a cached chunk to the driver", &e));
            }
            self.stats.remove_reserved(chunk.size, 1);
            released += chunk.size;
        }
        Ok(released)
    }

    /// Release these chunks to the driver; any that fail stay spare.
    pub(super) fn release_chunks(&mut self, cx: &Context<'_>, chunks: Vec<Chunk>) -> Result<()> {
        let mut result = Ok(());
        for chunk in chunks {
            if result.is_err() {
                self.spare.push(chunk);
                continue;
            }
            match cx.driver.vmm_release(self.device, chunk.handle) {
                Ok(()) => self.stats.remove_reserved(chunk.size, 1),
                Err(e) => {
                    self.spare.push(chunk);
                    result = Err(Error::driver("returning a chunk to the driver", &e));
                }
            }
        }
        result
    }

    /// Bytes held in spare chunks.
    pub(super) fn spare_bytes(&self) -> u64 {
        self.spare.iter().map(|c| c.size).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn chunk_plans_cover_the_need_in_few_granule_multiples() {
        let g = 2 * MIB;
        assert_eq!(chunk_plan(0, g), Vec::<u64>::new());
        assert_eq!(chunk_plan(2 * MIB, g), vec![2 * MIB]);
        assert_eq!(chunk_plan(6 * MIB, g), vec![2 * MIB; 3]);
        assert_eq!(
            chunk_plan(36 * MIB, g),
            vec![8 * MIB, 8 * MIB, 8 * MIB, 8 * MIB, 4 * MIB]
        );
        let plan = chunk_plan(784 * MIB, g);
        assert_eq!(
            plan,
            vec![
                128 * MIB,
                128 * MIB,
                128 * MIB,
                128 * MIB,
                128 * MIB,
                128 * MIB,
                16 * MIB
            ]
        );
        let plan = chunk_plan(8 << 30, g);
        assert_eq!(plan, vec![512 * MIB; 16]);
        for need in (1..2000).map(|n| n * 2 * MIB) {
            let plan = chunk_plan(need, g);
            assert_eq!(plan.iter().sum::<u64>(), need);
            assert!(plan.iter().all(|&c| c % g == 0 && c > 0 && c <= MAX_CHUNK));
            assert!(plan.len() <= 9, "{need}: {} chunks", plan.len());
        }
    }
}
