//! The invariant check: every book of a device pool, recomputed from the blocks.

use super::*;

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
        for (seg_id, seg) in self.segments.enumerate() {
            if !seg.in_use {
                continue;
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
}
