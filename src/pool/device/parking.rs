//! Parking: a released block that would merge with nothing (no free or parked neighbour) is kept
//! in a short per-stream list instead of the bins, so that the common reserve-release-reserve of
//! one size is served without touching them. A parked block is the very free block PyTorch's
//! policy would have: best fit looks at the parked blocks beside the bins, and a block released
//! or freed next to a parked one takes it out of the list and merges with it.

use super::*;

impl DevicePool {
    /// Park released block `id` on its stream; it has no free or parked neighbour. The oldest
    /// parked block goes to the bins if the list is full.
    pub(super) fn park(&mut self, id: BlockId) {
        let slot = self.segments[self.blocks[id].segment].slot;
        self.blocks[id].state = State::Parked;
        self.blocks[id].requested = 0;
        if self.slots[slot].parked.len() == PARKED_MAX {
            let oldest = self.slots[slot].parked.remove(0);
            self.parked -= 1;
            self.by_ptr.remove(&self.blocks[oldest].ptr);
            self.free_block(oldest);
        }
        self.slots[slot].parked.push(id);
        self.parked += 1;
    }

    /// Where in `slot`'s list the best fit for `block_size` bytes of `class` is among the parked
    /// blocks: the smallest that holds it, the lowest address among equals.
    pub(super) fn best_parked(&self, slot: SlotId, class: Class, block_size: u64) -> Option<usize> {
        let parked = &self.slots[slot].parked;
        parked
            .iter()
            .enumerate()
            .filter(|&(_, &id)| {
                let b = &self.blocks[id];
                b.size >= block_size && self.segments[b.segment].class == class
            })
            .min_by_key(|&(_, &id)| (self.blocks[id].size, self.blocks[id].ptr))
            .map(|(at, _)| at)
    }

    /// The parked block at `at` in `slot`'s list.
    pub(super) fn parked_at(&self, slot: SlotId, at: usize) -> BlockId {
        self.slots[slot].parked[at]
    }

    /// Take the parked block at `at` out of `slot`'s list (still parked, in the address map).
    fn unpark_at(&mut self, slot: SlotId, at: usize) -> BlockId {
        self.parked -= 1;
        let parked = &mut self.slots[slot].parked;
        // Usually the last one: a pop, not a shift.
        if at + 1 == parked.len() {
            parked.pop().expect("a parked block")
        } else {
            parked.remove(at)
        }
    }

    /// Parked block `id`, next to a block about to be freed, becomes a free block in the bins,
    /// to be merged with it.
    pub(super) fn unpark_neighbour(&mut self, id: BlockId) {
        let (slot, class) = {
            let s = &self.segments[self.blocks[id].segment];
            (s.slot, s.class)
        };
        let at = self.slots[slot]
            .parked
            .iter()
            .position(|&p| p == id)
            .expect("a parked block is listed");
        self.unpark_at(slot, at);
        self.by_ptr.remove(&self.blocks[id].ptr);
        self.blocks[id].state = State::Free;
        self.bin_insert(slot, class, id);
    }

    /// Hand out the parked block at `at` in `slot`'s list for a block of `block_size` bytes
    /// (`requested` asked): whole if the rest is not worth keeping (usually the same size
    /// again, touching no bin), else split as any free block.
    pub(super) fn take_parked(
        &mut self,
        slot: SlotId,
        at: usize,
        block_size: u64,
        requested: u64,
    ) -> DevicePtr {
        let id = self.unpark_at(slot, at);
        let class = self.segments[self.blocks[id].segment].class;
        if !size::splits(class, self.blocks[id].size - block_size) {
            return self.revive(id, requested);
        }
        self.by_ptr.remove(&self.blocks[id].ptr);
        self.free_block(id);
        self.take(id, block_size, requested)
    }

    /// Hand a parked block out again, whole.
    fn revive(&mut self, id: BlockId, requested: u64) -> DevicePtr {
        let block = &mut self.blocks[id];
        block.state = State::Live;
        block.requested = requested;
        let ptr = block.ptr;
        self.stats.add_live(super::allocated(requested), requested);
        ptr
    }

    /// File every parked block in the bins of its stream (merging nothing: none has a free or
    /// parked neighbour), making segments it fills idle.
    pub(super) fn flush_parked(&mut self) {
        if self.parked == 0 {
            return;
        }
        for slot in self.slots.ids() {
            for id in std::mem::take(&mut self.slots[slot].parked) {
                self.by_ptr.remove(&self.blocks[id].ptr);
                self.free_block(id);
            }
        }
        self.parked = 0;
    }

    /// Merge up to `count` parked blocks into the free blocks of their streams; whether none
    /// is left parked.
    pub(super) fn flush_parked_upto(&mut self, count: usize) -> bool {
        let mut left = count;
        for slot in self.slots.ids() {
            while left > 0 {
                let Some(id) = self.slots[slot].parked.pop() else {
                    break;
                };
                self.parked -= 1;
                self.by_ptr.remove(&self.blocks[id].ptr);
                self.free_block(id);
                left -= 1;
            }
        }
        self.parked == 0
    }
}
