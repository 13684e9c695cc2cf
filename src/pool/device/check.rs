//! The invariant check: every book of a device pool recomputed from the blocks, the books of
//! stitched segments (runs, holes, borrowers) with them.
//!
//! What holds: blocks tile their segment with exact links; free and parked neighbours are
//! merged; the bins hold exactly the free blocks, and the address map exactly the live and
//! parked blocks; runs tile each stitched segment (from its lead), each whole parts of its
//! handle, as spare pages are (`phys.rs`); each lent run is a hole in its lender, the holes
//! are exactly the lent bytes and exactly the indexed holes; no byte of a handle has two owners
//! (blocks that are not holes, through their runs, and spare pages); each segment's borrowers
//! are exactly the segments it lent runs to, and the devices each was given access to are peers
//! of the device; the address chunks hold exactly the segments'
//! ranges and their free ranges; owned plus spare bytes equal the handles' bytes; the unused
//! index holds exactly the handles with every page spare; and the figures equal what the
//! blocks say. Across shards, `Pool::check` adds that the span map counts exactly the
//! segments of every device and that each device's reserved figure is its shards' sum.

use super::*;
use crate::driver::PhysHandle;

impl DevicePool {
    /// Live blocks marked as used on other streams.
    pub(super) fn blocks_shared(&self) -> usize {
        self.by_ptr
            .values()
            .filter(|&&id| self.blocks[id].shared)
            .count()
    }

    /// Check every invariant of the books; a description of the first broken one.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut reserved = 0;
        let mut allocated = 0;
        let mut requested = 0;
        let mut live = 0;
        let mut parked = 0usize;
        let mut free_blocks = 0usize;
        let mut segments = 0;
        let mut slot_segments: IntMap<SlotId, u32> = IntMap::default();
        // Stamps of releases (`streams.rs`): none ahead of the count, nor the wait.
        if self.settled > self.releases {
            return Err(format!(
                "settled up to release {} of {}",
                self.settled, self.releases
            ));
        }
        if let Some(p) = self.pending.iter().find(|p| p.released > self.releases) {
            return Err(format!(
                "a pending block stamped with release {} of {}",
                p.released, self.releases
            ));
        }
        for (seg_id, seg) in self.segments.enumerate() {
            if !seg.in_use {
                continue;
            }
            if seg.released > self.releases {
                return Err(format!(
                    "segment {:#x} stamped with release {} of {}",
                    seg.base, seg.released, self.releases
                ));
            }
            segments += 1;
            reserved += seg.size;
            let mut id = seg.first;
            let mut expect = seg.base;
            let mut prev = BlockId::NIL;
            // Free or parked: two such neighbours should have been merged.
            let mut prev_unused = false;
            let mut holes = 0;
            while id != BlockId::NIL {
                let b = &self.blocks[id];
                let here = format!("block {:#x} of segment {:#x}", b.ptr, seg.base);
                if b.ptr != expect || b.prev != prev || b.segment != seg_id {
                    return Err(format!("{here}: broken neighbour links"));
                }
                if b.size == 0 || b.size % MIN_BLOCK != 0 || b.ptr % MIN_BLOCK != 0 {
                    return Err(format!("{here}: misaligned ({} bytes)", b.size));
                }
                match b.state {
                    State::Live => {
                        allocated += super::allocated(b.requested);
                        requested += b.requested;
                        live += 1;
                        if self.by_ptr.get(&b.ptr) != Some(&id) {
                            return Err(format!("{here}: live but not in the address map"));
                        }
                        prev_unused = false;
                    }
                    State::Parked => {
                        parked += 1;
                        if self.by_ptr.get(&b.ptr) != Some(&id)
                            || !self.slots[seg.slot].parked.contains(&id)
                        {
                            return Err(format!("{here}: parked but not listed"));
                        }
                        if prev_unused {
                            return Err(format!("{here}: parked next to a free or parked block"));
                        }
                        prev_unused = true;
                    }
                    State::Free => {
                        if prev_unused {
                            return Err(format!(
                                "{here}: two free or parked neighbours were not merged"
                            ));
                        }
                        free_blocks += 1;
                        prev_unused = true;
                    }
                    State::Pending => prev_unused = false,
                    State::Hole => {
                        holes += b.size;
                        if !seg.stitched {
                            return Err(format!("{here}: a hole in a classic segment"));
                        }
                        prev_unused = false;
                    }
                    State::Vacant => return Err(format!("{here}: vacant slot linked")),
                }
                expect = b.ptr + b.size;
                prev = id;
                id = b.next;
            }
            if expect != seg.base + seg.size {
                return Err(format!("segment {:#x}: blocks do not cover it", seg.base));
            }
            reserved -= holes;
            let first = &self.blocks[seg.first];
            let is_idle = first.next == BlockId::NIL && first.state == State::Free;
            let listed = seg
                .idle_at
                .is_some_and(|at| self.idle.get(at) == Some(&seg_id));
            if is_idle != listed {
                return Err(format!("segment {:#x}: idle list is wrong", seg.base));
            }
            *slot_segments.entry(seg.slot).or_insert(0u32) += 1;
        }
        if self.idle.iter().any(|&seg| !self.segments[seg].in_use) {
            return Err("a vacant segment is listed as idle".to_string());
        }
        for (&handle, &slot) in &self.slot_of {
            let s = &self.slots[slot];
            if s.handle != handle
                || slot_segments.get(&slot).copied().unwrap_or(0) != s.segments
                || s.segments == 0
            {
                return Err(format!("stream {handle:#x}: slot {slot:?} has wrong books"));
            }
        }
        if slot_segments.len() != self.slot_of.len() {
            return Err("a segment belongs to an unmapped stream slot".to_string());
        }
        let binned: usize = self
            .slot_of
            .values()
            .flat_map(|&slot| self.slots[slot].bins.iter())
            .map(Bins::len)
            .sum();
        if binned != free_blocks {
            return Err(format!("{free_blocks} free blocks but {binned} in bins"));
        }
        let shared = self.blocks_shared();
        if shared != self.shared.len() {
            return Err(format!(
                "{shared} blocks marked shared, {} in the map",
                self.shared.len()
            ));
        }
        if self.by_ptr.len() != live as usize + parked {
            return Err(format!(
                "{live} live and {parked} parked blocks but {} in the map",
                self.by_ptr.len()
            ));
        }
        let listed: usize = self.slots.iter().map(|s| s.parked.len()).sum();
        if listed != parked || self.parked != parked {
            return Err(format!(
                "{parked} parked blocks, {listed} listed, {} counted",
                self.parked
            ));
        }
        reserved += self.phys.spare_bytes();
        if matches!(self.vmm, VmmMode::On(_)) {
            self.check_stitched()?;
            if reserved != self.phys.held_bytes() {
                return Err(format!(
                    "{reserved} bytes owned or spare, {} in handles",
                    self.phys.held_bytes()
                ));
            }
        }
        // Classic segments being freed and handles being released without the lock: reserved
        // until the driver answers (`deferred.rs`).
        if !self.returning.is_empty() && matches!(self.vmm, VmmMode::On(_)) {
            return Err("a stitched pool is freeing classic segments".to_string());
        }
        if let Some(&(handle, _)) = self.releasing.iter().find(|&&(h, _)| self.phys.holds(h)) {
            return Err(format!("handle {handle:#x} is held and being released"));
        }
        reserved += self.returning.iter().map(|r| r.size).sum::<u64>();
        reserved += self.releasing.iter().map(|&(_, size)| size).sum::<u64>();
        let s = &self.stats;
        let books = (
            s.reserved_bytes,
            s.allocated_bytes,
            s.requested_bytes,
            s.live_blocks,
            s.segments,
        );
        if books != (reserved, allocated, requested, live, segments) {
            return Err(format!(
                "stats (reserved, allocated, requested, live, segments) = {books:?}, blocks say {:?}",
                (reserved, allocated, requested, live, segments)
            ));
        }
        if s.peak_allocated_bytes < s.allocated_bytes || s.peak_reserved_bytes < s.reserved_bytes {
            return Err("a peak is below its current value".to_string());
        }
        Ok(())
    }

    /// Check that no byte of physical memory has two owners: the bytes of every block that is
    /// not a hole, through its segment's runs, and the spare pages, lie apart in their handles
    /// (a fragment's page is two segments', each owning its part).
    fn check_physical(&self) -> std::result::Result<(), String> {
        let mut owned: Vec<(PhysHandle, u64, u64)> = self
            .phys
            .spare_pieces()
            .into_iter()
            .map(|p| (p.handle, p.offset, p.offset + p.size))
            .collect();
        for s in self.segments.iter().filter(|s| s.in_use && s.stitched) {
            let mut id = s.first;
            while id != BlockId::NIL {
                let b = &self.blocks[id];
                id = b.next;
                if b.state != State::Hole {
                    let pages = s.pages(b.ptr, b.ptr + b.size);
                    owned.extend(pages.map(|(_, p)| (p.handle, p.offset, p.offset + p.size)));
                }
            }
        }
        owned.sort_unstable();
        for w in owned.windows(2) {
            if w[0].0 == w[1].0 && w[0].2 > w[1].1 {
                return Err(format!(
                    "handle {:#x}: bytes {:#x}..{:#x} have two owners",
                    w[0].0, w[1].1, w[0].2
                ));
            }
        }
        Ok(())
    }

    /// Check that each segment lists as borrowers exactly the segments with a run it lent,
    /// each once.
    fn check_borrowers(&self) -> std::result::Result<(), String> {
        use std::collections::{BTreeMap, BTreeSet};
        let mut expected: BTreeMap<SegId, BTreeSet<SegId>> = BTreeMap::new();
        for (seg_id, s) in self.segments.enumerate().filter(|(_, s)| s.in_use) {
            for (l, _) in s.runs.iter().filter_map(|r| r.lender) {
                expected.entry(l).or_default().insert(seg_id);
            }
        }
        for (seg_id, s) in self.segments.enumerate() {
            let listed: BTreeSet<SegId> = s.borrowers.iter().copied().collect();
            let lent = expected.remove(&seg_id).unwrap_or_default();
            if listed.len() != s.borrowers.len()
                || listed != lent
                || (!s.in_use && !lent.is_empty())
            {
                return Err(format!(
                    "segment {:#x} lists borrowers {:?} but lent runs to {:?}",
                    s.base, s.borrowers, lent
                ));
            }
        }
        Ok(())
    }

    /// Check the address chunks: every stitched segment and every kept range lies in one, and
    /// the chunks' bytes are exactly theirs, the free ranges' and those of ranges being mapped
    /// without the lock.
    fn check_addresses(&self) -> std::result::Result<(), String> {
        self.addresses.check()?;
        let mut used = self.carved;
        let ranges = self.segments.iter().filter(|s| s.in_use && s.stitched);
        for (base, size) in ranges
            .map(|s| s.mapped())
            .chain(self.stuck.iter().map(|k| k.range()))
        {
            if !self.addresses.within_chunk(base, size) {
                return Err(format!(
                    "range {base:#x}+{size:#x} lies in no address chunk"
                ));
            }
            used += size;
        }
        let (reserved, free) = (self.addresses.reserved(), self.addresses.free_bytes());
        if used + free != reserved {
            return Err(format!(
                "address chunks of {reserved} bytes hold {used} bytes of ranges and {free} free"
            ));
        }
        Ok(())
    }

    /// Check the books of stitched segments: runs tile each segment, each whole parts of its
    /// handle; every lent run's pages are a hole in its lender; holes are exactly the lent
    /// pages; memory held equals the handles.
    fn check_stitched(&self) -> std::result::Result<(), String> {
        self.phys.check()?;
        let (mut lent, mut holes, mut owned, mut hole_blocks) = (0u64, 0u64, 0u64, 0usize);
        for s in self.segments.iter().filter(|s| s.in_use && s.stitched) {
            let mut at = 0;
            for r in &s.runs {
                if r.offset != at || !self.phys.holds(r.pages.handle) {
                    return Err(format!(
                        "segment {:#x}: runs do not tile it with held handles",
                        s.base
                    ));
                }
                if self.phys.whole_parts(r.pages) != Some(r.pages) {
                    return Err(format!(
                        "segment {:#x}: a run of {:?} is not whole parts of its handle",
                        s.base, r.pages
                    ));
                }
                // A fragment's first bytes are its lender's, outside this segment's blocks.
                let skip = if at == 0 { s.lead } else { 0 };
                at += r.pages.size;
                if skip > 0 && (r.lender.is_none() || skip >= r.pages.size) {
                    return Err(format!(
                        "segment {:#x}: a lead of {skip} bytes in no lent page",
                        s.base
                    ));
                }
                if let Some((l, ptr)) = r.lender {
                    let (ptr, size) = (ptr + skip, r.pages.size - skip);
                    lent += size;
                    let lender = self.segments.get(l).filter(|x| x.in_use);
                    let inside = lender.is_some_and(|x| {
                        let b = &self.blocks[self.block_at(l, ptr)];
                        x.base <= ptr && b.state == State::Hole && ptr + size <= b.ptr + b.size
                    });
                    if !inside {
                        return Err(format!(
                            "segment {:#x}: a run lent by {ptr:#x} is not a hole there",
                            s.base
                        ));
                    }
                }
            }
            if at != s.lead + s.size {
                return Err(format!("segment {:#x}: runs do not cover it", s.base));
            }
            if s.granted & !self.whole_device.peers() != 0 {
                return Err(format!(
                    "segment {:#x}: access given to devices {:#x}, not all peers",
                    s.base, s.granted
                ));
            }
            let mut id = s.first;
            while id != BlockId::NIL {
                let b = &self.blocks[id];
                if b.state == State::Hole {
                    holes += b.size;
                    hole_blocks += 1;
                    if self.holes.get(&b.ptr) != Some(&id) {
                        return Err(format!("hole {id:?} at {:#x} is not indexed", b.ptr));
                    }
                } else {
                    owned += b.size;
                }
                id = b.next;
            }
        }
        if lent != holes {
            return Err(format!("{lent} bytes lent but {holes} bytes of holes"));
        }
        if hole_blocks != self.holes.len() {
            return Err(format!(
                "{hole_blocks} holes, but the index of holes holds {}",
                self.holes.len()
            ));
        }
        self.check_borrowers()?;
        self.check_addresses()?;
        self.check_physical()?;
        if owned + self.phys.spare_bytes() != self.phys.held_bytes() {
            return Err(format!(
                "segments own {owned} bytes and {} are spare, but handles hold {}",
                self.phys.spare_bytes(),
                self.phys.held_bytes()
            ));
        }
        Ok(())
    }
}
