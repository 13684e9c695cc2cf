//! Parking: small blocks, and large ones filling their segment, released on their own stream and
//! kept unmerged in a short per-stream list, so the common reserve-release-reserve of one size
//! is served without touching the bins.

use super::*;

impl DevicePool {
    /// Park released block `id` on its stream, unmerged; the oldest parked block is merged if
    /// the list is full.
    pub(super) fn park(&mut self, id: u32) {
        let slot = self.segments[self.blocks[id].segment as usize].slot as usize;
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

    /// The most recently parked block of exactly `block_size` bytes on `slot`, taken out.
    pub(super) fn unpark(&mut self, slot: u32, block_size: u64) -> Option<u32> {
        let parked = &mut self.slots[slot as usize].parked;
        let at = parked
            .iter()
            .rposition(|&id| self.blocks[id].size == block_size)?;
        self.parked -= 1;
        // Usually the last one: a pop, not a shift.
        Some(if at + 1 == parked.len() {
            parked.pop()?
        } else {
            parked.remove(at)
        })
    }

    /// Hand a parked block out again.
    pub(super) fn revive(&mut self, id: u32, requested: u64) -> DevicePtr {
        let block = &mut self.blocks[id];
        block.state = State::Live;
        block.requested = requested;
        let (ptr, size) = (block.ptr, block.size);
        self.stats.add_live(size, requested);
        ptr
    }

    /// Merge every parked block into the free blocks of its stream.
    pub(super) fn flush_parked(&mut self) {
        if self.parked == 0 {
            return;
        }
        for slot in 0..self.slots.len() {
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
        for slot in 0..self.slots.len() {
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
