//! The block arena: every block of every segment of a device, with links to its address
//! neighbours (for splitting and coalescing).
//!
//! Blocks are addressed by [`BlockId`]; vacated slots are reused, so the arena never grows past
//! the largest number of blocks that existed at once.

use super::ids::{BlockId, Id, SegId};
use crate::driver::DevicePtr;

/// Where a block stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Cached and in its stream's bins, ready for reuse.
    Free,
    /// Handed out by `reserve`.
    Live,
    /// Released, but waiting for work on other streams (`record_stream`) before reuse.
    Pending,
    /// Released on its own stream next to no free or parked block: a free block kept in its
    /// stream's parking list instead of the bins; reusable memory.
    Parked,
    /// Pages of a stitched segment lent to another segment, which maps them too (they stay
    /// mapped here): never handed out until they come back.
    Hole,
    /// An unused arena slot.
    Vacant,
}

/// A contiguous piece of a segment.
#[derive(Clone, Debug)]
pub struct Block {
    /// Device address of the first byte.
    pub ptr: DevicePtr,
    /// Size in bytes, a multiple of 512.
    pub size: u64,
    /// For live blocks, the bytes the caller asked for.
    pub requested: u64,
    /// The segment that holds it (and whose stream's bins hold it while free).
    pub segment: SegId,
    /// Address neighbours in the same segment ([`BlockId::NIL`]: none).
    pub prev: BlockId,
    /// See `prev`.
    pub next: BlockId,
    /// Where it stands.
    pub state: State,
    /// Live and also used on streams other than its own (`record_stream`).
    pub shared: bool,
}

/// All blocks of one device.
#[derive(Default)]
pub struct Blocks {
    slots: Vec<Block>,
    vacant: Vec<BlockId>,
}

impl Blocks {
    /// Store a new block and return its id.
    pub fn insert(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.vacant.pop() {
            self.slots[id.index()] = block;
            id
        } else {
            let id = BlockId::at(self.slots.len());
            self.slots.push(block);
            // Room for every block to be dropped, reserved while blocks are made: dropping them
            // (returning memory, under the device's lock) then never copies the list.
            self.vacant
                .reserve(self.slots.capacity() - self.vacant.len());
            id
        }
    }

    /// Drop a block; its index may be reused.
    pub fn remove(&mut self, id: BlockId) {
        let block = &mut self.slots[id.index()];
        debug_assert_ne!(block.state, State::Vacant);
        block.state = State::Vacant;
        self.vacant.push(id);
    }

    /// Whether `id` names a block that exists (not vacant).
    pub fn is_held(&self, id: BlockId) -> bool {
        self.slots
            .get(id.index())
            .is_some_and(|b| b.state != State::Vacant)
    }

    /// Number of blocks that exist (not vacant).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }
}

impl std::ops::Index<BlockId> for Blocks {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        &self.slots[id.index()]
    }
}

impl std::ops::IndexMut<BlockId> for Blocks {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.slots[id.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(ptr: u64) -> Block {
        Block {
            ptr,
            size: 512,
            requested: 0,
            segment: SegId::at(0),
            prev: BlockId::NIL,
            next: BlockId::NIL,
            state: State::Free,
            shared: false,
        }
    }

    #[test]
    fn slots_are_reused() {
        let mut blocks = Blocks::default();
        let a = blocks.insert(block(0));
        let b = blocks.insert(block(512));
        assert_eq!((a, b, blocks.len()), (BlockId::at(0), BlockId::at(1), 2));
        blocks.remove(a);
        assert_eq!(blocks.len(), 1);
        let c = blocks.insert(block(1024));
        assert_eq!(c, a);
        assert_eq!(blocks[c].ptr, 1024);
        assert_eq!(blocks.len(), 2);
    }
}
