//! Placement: where a request lands in the cache, and how blocks split and merge. The best fit
//! by (size, address) among a stream's free and parked blocks of a class (step 1 of the policy,
//! and the last resort of a small request among the large ones), an idle segment of another
//! stream (step 2), a free block handed out with its rest kept free where PyTorch's split rule
//! keeps it, and a released block merged with its free neighbours.

use super::*;

/// Where a best fit lies: a free block in the bins, or the parked block at this index of its
/// slot's list.
#[derive(Clone, Copy)]
pub(super) enum Fit {
    Binned(BlockId),
    Parked(SlotId, usize),
}

impl DevicePool {
    /// The best fit, by (size, address), among `stream`'s free and parked blocks of `class`.
    pub(super) fn best_free(
        &self,
        stream: StreamHandle,
        class: Class,
        block_size: u64,
    ) -> Option<Fit> {
        let slot = *self.slot_of.get(&stream)?;
        let binned = self.slots[slot].bins[class as usize].find(block_size);
        let key = |id: BlockId| (self.blocks[id].size, self.blocks[id].ptr);
        match self.best_parked(slot, class, block_size) {
            Some(at) if binned.is_none_or(|b| key(self.parked_at(slot, at)) < key(b)) => {
                Some(Fit::Parked(slot, at))
            }
            _ => binned.map(Fit::Binned),
        }
    }

    /// Hand out `fit` for a request of `requested` bytes (`block_size` rounded).
    pub(super) fn take_fit(&mut self, fit: Fit, block_size: u64, requested: u64) -> DevicePtr {
        self.stats.cache_hits += 1;
        match fit {
            Fit::Parked(slot, at) => self.take_parked(slot, at, block_size, requested),
            Fit::Binned(id) => self.take(id, block_size, requested),
        }
    }

    /// Step 2: the smallest idle segment of `class` that holds `block_size` bytes, moved to
    /// `stream` if it belongs to another; returns its block.
    pub(super) fn adopt_idle_segment(
        &mut self,
        cx: &Context<'_>,
        class: Class,
        block_size: u64,
        stream: StreamHandle,
    ) -> Result<Option<BlockId>> {
        // Without waits, only a segment of the stream's own, or one whose work is done.
        let waits = self.may_wait();
        let best = self
            .idle
            .iter()
            .map(|&seg| (&self.segments[seg], seg))
            .filter(|(s, _)| s.class == class && s.size >= block_size)
            .filter(|(s, seg)| {
                waits || self.slots[s.slot].handle == stream || self.is_settled(*seg)
            })
            .min_by_key(|(s, seg)| (s.size, *seg))
            .map(|(_, seg)| seg);
        let Some(seg) = best else {
            return Ok(None);
        };
        let (old_slot, id) = (self.segments[seg].slot, self.segments[seg].first);
        let old = self.slots[old_slot].handle;
        if old != stream {
            if waits {
                self.order_after(cx, old, stream)?;
            }
            self.bin_remove(old_slot, class, id);
            self.leave_slot(old_slot);
            let slot = self.join_slot(stream);
            self.segments[seg].slot = slot;
            self.bin_insert(slot, class, id);
        }
        Ok(Some(id))
    }

    /// Hand out free block `id` for a block of `block_size` bytes. When the rest is worth
    /// keeping free ([`size::splits`]), a new live block is cut from the front of `id` (from its
    /// back where that leaves more whole pages free, see [`DevicePool::takes_back`]) and `id`
    /// stays as the free rest, moving between bins only if its size crosses a bin boundary: the
    /// usual cache hit touches no bin list at all. Otherwise the whole block is handed out, the
    /// rest with it (see [`allocated`]).
    pub(super) fn take(&mut self, id: BlockId, block_size: u64, requested: u64) -> DevicePtr {
        let seg = self.blocks[id].segment;
        let (slot, class) = {
            let s = &self.segments[seg];
            (s.slot, s.class)
        };
        let (ptr, size, prev, next) = {
            let b = &self.blocks[id];
            (b.ptr, b.size, b.prev, b.next)
        };
        if prev == BlockId::NIL && next == BlockId::NIL {
            self.unmark_idle(seg);
        }
        // What the block takes: the request's bytes, or all of `id` if the rest is not kept.
        let taken = if size::splits(class, size - block_size) {
            block_size
        } else {
            size
        };
        let live_id = if size == taken {
            self.bin_remove(slot, class, id);
            id
        } else {
            let back = self.takes_back(class, ptr, size, taken);
            let live_id = self.blocks.insert(Block {
                ptr: if back { ptr + size - taken } else { ptr },
                size: taken,
                requested,
                segment: seg,
                prev: if back { id } else { prev },
                next: if back { next } else { id },
                state: State::Live,
                shared: false,
            });
            let (before, after) = if back { (id, next) } else { (prev, id) };
            if before != BlockId::NIL {
                self.blocks[before].next = live_id;
            } else {
                self.segments[seg].first = live_id;
            }
            if after != BlockId::NIL {
                self.blocks[after].prev = live_id;
            }
            let rest = &mut self.blocks[id];
            rest.size = size - taken;
            if !back {
                rest.ptr = ptr + taken;
            }
            self.bin_resized(slot, class, id, size, ptr);
            live_id
        };
        let block = &mut self.blocks[live_id];
        block.size = taken;
        block.requested = requested;
        block.state = State::Live;
        let ptr = block.ptr;
        self.by_ptr.insert(ptr, live_id);
        self.stats.add_live(block_size, requested);
        ptr
    }

    /// Whether a block of `taken` bytes cut from free block [`ptr`, `ptr + size`) of a segment
    /// of `class` goes at its back: in a stitched segment of large blocks, where that leaves
    /// more whole pages in the rest than the front would. A free block's whole pages are what
    /// a later range can borrow (`pieces.rs`); its bytes in pages it shares with a live block
    /// serve only requests that fit there. Cut from the front, a block that starts mid-page
    /// and ends mid-page may touch a page more than one packed against the block's end: on
    /// `traces/interleaved-lifetimes.jsonl`, the long-lived blocks' rounding and the free bytes
    /// beside them at the peak fell from 129 to 111 MiB. Ties go to the front, as PyTorch
    /// places blocks; classic segments lend no pages and always take the front.
    fn takes_back(&self, class: Class, ptr: u64, size: u64, taken: u64) -> bool {
        let VmmMode::On(page) = self.vmm else {
            return false;
        };
        if class != Class::Large {
            return false;
        }
        let whole = |from, to| whole_pages(from, to, page);
        whole(ptr, ptr + size - taken) > whole(ptr + taken, ptr + size)
    }

    /// Make block `id` free, merged with its free (and parked) neighbours. A free neighbour
    /// grows over it in place (changing bins only if its size crosses a bin boundary).
    pub(super) fn free_block(&mut self, id: BlockId) {
        let seg = self.blocks[id].segment;
        let (slot, class) = {
            let s = &self.segments[seg];
            (s.slot, s.class)
        };
        for n in [self.blocks[id].prev, self.blocks[id].next] {
            if n != BlockId::NIL && self.blocks[n].state == State::Parked {
                self.unpark_neighbour(n);
            }
        }
        let (ptr, size, prev, next) = {
            let b = &mut self.blocks[id];
            b.state = State::Free;
            b.requested = 0;
            (b.ptr, b.size, b.prev, b.next)
        };
        let prev_free = prev != BlockId::NIL && self.blocks[prev].state == State::Free;
        let next_free = next != BlockId::NIL && self.blocks[next].state == State::Free;
        let merged = match (prev_free, next_free) {
            (false, false) => {
                self.bin_insert(slot, class, id);
                id
            }
            (true, false) => {
                let (old, old_ptr) = (self.blocks[prev].size, self.blocks[prev].ptr);
                self.blocks[prev].size += size;
                self.unlink(id);
                self.bin_resized(slot, class, prev, old, old_ptr);
                prev
            }
            (false, true) => {
                let (old, old_ptr) = (self.blocks[next].size, self.blocks[next].ptr);
                let b = &mut self.blocks[next];
                b.ptr = ptr;
                b.size += size;
                self.unlink(id);
                self.bin_resized(slot, class, next, old, old_ptr);
                next
            }
            (true, true) => {
                self.bin_remove(slot, class, next);
                let (old, old_ptr) = (self.blocks[prev].size, self.blocks[prev].ptr);
                self.blocks[prev].size += size + self.blocks[next].size;
                self.unlink(id);
                self.unlink(next);
                self.bin_resized(slot, class, prev, old, old_ptr);
                prev
            }
        };
        let b = &self.blocks[merged];
        if b.prev == BlockId::NIL && b.next == BlockId::NIL {
            self.mark_idle(seg);
        }
    }

    /// Take block `id` out of its segment's chain and the arena (its neighbours now cover it).
    pub(super) fn unlink(&mut self, id: BlockId) {
        let (seg, prev, next) = {
            let b = &self.blocks[id];
            (b.segment, b.prev, b.next)
        };
        if prev != BlockId::NIL {
            self.blocks[prev].next = next;
        } else {
            self.segments[seg].first = next;
        }
        if next != BlockId::NIL {
            self.blocks[next].prev = prev;
        }
        self.blocks.remove(id);
    }

    /// Free block `id`, held in the bins under `old_size` at `old_ptr`, changed: refile it.
    pub(super) fn bin_resized(
        &mut self,
        slot: SlotId,
        class: Class,
        id: BlockId,
        old_size: u64,
        old_ptr: u64,
    ) {
        self.slots[slot].bins[class as usize].resized(&self.blocks, id, old_size, old_ptr);
    }

    pub(super) fn bin_insert(&mut self, slot: SlotId, class: Class, id: BlockId) {
        self.slots[slot].bins[class as usize].insert(&self.blocks, id);
    }

    pub(super) fn bin_remove(&mut self, slot: SlotId, class: Class, id: BlockId) {
        self.slots[slot].bins[class as usize].remove(&self.blocks, id);
    }
}

/// The whole pages of `page` bytes in [`from`, `to`): by shifts where the page is a power of
/// two, as the driver's granularity is (this runs on every split of a free block of a stitched
/// segment, under the shard's lock).
fn whole_pages(from: u64, to: u64, page: u64) -> u64 {
    if page.is_power_of_two() {
        let shift = page.trailing_zeros();
        let first = (from >> shift) + u64::from(from & (page - 1) != 0);
        (to >> shift).saturating_sub(first)
    } else {
        (to / page).saturating_sub(from.div_ceil(page))
    }
}

#[cfg(test)]
mod tests {
    use super::whole_pages;

    const MIB: u64 = 1 << 20;

    #[test]
    fn whole_pages_by_shifts_and_by_division_agree() {
        // [3, 41) MiB in 2 MiB pages: 4 to 40, 18 pages; [0, 38): 19; inside one page: none.
        assert_eq!(whole_pages(3 * MIB, 41 * MIB, 2 * MIB), 18);
        assert_eq!(whole_pages(0, 38 * MIB, 2 * MIB), 19);
        assert_eq!(whole_pages(MIB, MIB + 512, 2 * MIB), 0);
        assert_eq!(whole_pages(2 * MIB, 4 * MIB, 2 * MIB), 1);
        // A granularity that is not a power of two (3 MiB): 3 to 39, 12 pages.
        assert_eq!(whole_pages(MIB, 41 * MIB, 3 * MIB), 12);
        for page in [2 * MIB, 3 * MIB, 512] {
            for (from, to) in [(0, 0), (1, 7 * MIB + 1), (5 * MIB, 5 * MIB), (513, 1 << 40)] {
                let by_division = (to / page).saturating_sub(from.div_ceil(page));
                assert_eq!(
                    whole_pages(from, to, page),
                    by_division,
                    "{page} {from} {to}"
                );
            }
        }
    }
}
