//! Segments: booking a new one, returning idle ones to the driver, forgetting one, and the idle
//! list.

use super::*;

impl DevicePool {
    /// Book a new segment at `ptr` of `segment` bytes (its memory already counted as reserved),
    /// mapped from `lead` bytes before `ptr` (see `Segment::lead`), as one free, idle block of
    /// `stream`; returns the block.
    pub(super) fn install_segment(
        &mut self,
        cx: &Context<'_>,
        (ptr, segment, lead): (DevicePtr, u64, u64),
        class: Class,
        stream: StreamHandle,
        runs: Vec<Run>,
    ) -> BlockId {
        let seg = match self.vacant_segments.pop() {
            Some(seg) => seg,
            None => {
                let seg = self.segments.push(Segment {
                    base: 0,
                    size: 0,
                    slot: SlotId::NIL,
                    class,
                    first: BlockId::NIL,
                    in_use: false,
                    idle_at: None,
                    runs: Vec::new(),
                    borrowers: IntSet::default(),
                    stitched: false,
                    released: 0,
                    lead: 0,
                    granted: 0,
                });
                // Room for every segment to be forgotten (see `Blocks::insert`).
                self.vacant_segments
                    .reserve(self.segments.capacity() - self.vacant_segments.len());
                seg
            }
        };
        let id = self.blocks.insert(Block {
            ptr,
            size: segment,
            requested: 0,
            segment: seg,
            prev: BlockId::NIL,
            next: BlockId::NIL,
            state: State::Free,
            shared: false,
        });
        let slot = self.join_slot(stream);
        let stitched = !runs.is_empty();
        for lender in runs.iter().filter_map(|r| r.lender.map(|(l, _)| l)) {
            self.add_borrower(lender, seg);
        }
        self.segments[seg] = Segment {
            base: ptr,
            size: segment,
            slot,
            class,
            first: id,
            in_use: true,
            idle_at: None,
            runs,
            borrowers: IntSet::default(),
            stitched,
            released: 0,
            lead,
            granted: 0,
        };
        self.bin_insert(slot, class, id);
        self.mark_idle(seg);
        cx.spans.add(ptr, segment, self.owner);
        self.stats.segments += 1;
        id
    }

    /// Return idle segments to the driver until at least `needed` bytes are back (`u64::MAX`:
    /// all of them): the smallest single segment that covers it, else the largest first.
    pub(super) fn release_idle(&mut self, cx: &Context<'_>, needed: u64) -> Result<u64> {
        if matches!(self.vmm, VmmMode::On(_)) {
            return self.release_idle_stitched(cx, needed);
        }
        let mut idle: Vec<(u64, SegId)> = self
            .idle
            .iter()
            .map(|&seg| (self.segments[seg].size, seg))
            .collect();
        if idle.is_empty() {
            return Ok(0);
        }
        idle.sort_unstable();
        let chosen: Vec<(u64, SegId)> = match idle.iter().find(|&&(size, _)| size >= needed) {
            Some(&one) if needed != u64::MAX => vec![one],
            _ => {
                let mut sum = 0u64;
                idle.iter()
                    .rev()
                    .take_while(|&&(size, _)| {
                        let more = sum < needed;
                        sum = sum.saturating_add(size);
                        more
                    })
                    .copied()
                    .collect()
            }
        };
        // Work queued before the blocks were released may still use them.
        self.settle(
            cx,
            chosen.iter().map(|&(_, seg)| seg),
            "waiting for the device before returning cached memory",
        )?;
        let mut released = 0;
        for (size, seg) in chosen {
            self.free_segment(cx, seg)?;
            released += size;
        }
        Ok(released)
    }

    /// Give an idle segment back to the driver and forget it.
    pub(super) fn free_segment(&mut self, cx: &Context<'_>, seg: SegId) -> Result<()> {
        let (base, size) = (self.segments[seg].base, self.segments[seg].size);
        if !self.segments[seg].stitched {
            // Out of the span map before the driver can hand the addresses to another device.
            cx.spans.remove(base, size, self.owner);
            if let Err(e) = cx.driver.mem_free(self.device, base) {
                cx.spans.add(base, size, self.owner);
                return Err(Error::driver(
                    &format!("returning segment {base:#x} to the driver"),
                    &e,
                ));
            }
            self.forget_segment(seg);
            self.remove_reserved(size, 1);
            return Ok(());
        }
        self.dismantle(cx, seg)
    }

    /// Drop a segment with no block in use from the books (not its memory, nor its entry in
    /// the span map, which the caller takes out before the driver frees the addresses). Its
    /// lists of runs and borrowers are emptied but keep their allocations, for the next segment
    /// in its place: a sweep returning thousands of segments under the device's lock then frees
    /// none of those small allocations. Freed, each would wait in glibc's fastbins until a later
    /// free or allocation merged them all at once (`malloc_consolidate`) inside one hold of the
    /// lock: up to 400 µs for the thousands a sweep of 100k segments gathered (BENCHMARKS.md).
    pub(super) fn forget_segment(&mut self, seg: SegId) {
        let (slot, class, mut id, idle_at) = {
            let s = &self.segments[seg];
            (s.slot, s.class, s.first, s.idle_at)
        };
        while id != BlockId::NIL {
            let next = self.blocks[id].next;
            debug_assert!(matches!(self.blocks[id].state, State::Free | State::Hole));
            if self.blocks[id].state == State::Free {
                self.bin_remove(slot, class, id);
            } else {
                self.holes.remove(&self.blocks[id].ptr);
            }
            self.blocks.remove(id);
            id = next;
        }
        if idle_at.is_some() {
            self.unmark_idle(seg);
        }
        self.leave_slot(slot);
        self.segments[seg].in_use = false;
        self.vacant_segments.push(seg);
        self.stats.segments -= 1;
        self.segments[seg].runs.clear();
        self.segments[seg].borrowers.clear();
    }

    pub(super) fn mark_idle(&mut self, seg: SegId) {
        debug_assert_eq!(self.segments[seg].idle_at, None);
        self.segments[seg].idle_at = Some(self.idle.push(seg));
    }

    pub(super) fn unmark_idle(&mut self, seg: SegId) {
        let at = self.segments[seg]
            .idle_at
            .take()
            .expect("an idle segment knows its place");
        self.idle.swap_remove(at);
        if let Some(&moved) = self.idle.get(at) {
            self.segments[moved].idle_at = Some(at);
        }
    }
}
