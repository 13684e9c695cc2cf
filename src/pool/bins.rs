//! The free-block index of one stream and size class: best fit, as PyTorch's caching allocator
//! chooses, by (size, address) in an ordered set.
//!
//! The smallest free block that fits a request is taken, the lowest address among equals. An
//! earlier index (two-level segregated bins, TLSF) answered in O(1) with a *good* fit: the first
//! block of the lowest non-empty bin above the request's, which can be up to an eighth larger
//! than the best one and leaves the best one to be split by a later, larger request. Replayed on
//! real training snapshots, that placement held more memory than PyTorch's best fit; the ordered
//! set costs O(log n) per change, and the common reserve-release-reserve of one size never
//! reaches it (parked blocks, see `device.rs`).

use std::collections::BTreeSet;

use super::blocks::{Blocks, State};
use super::ids::{BlockId, Id};

/// The free blocks of one stream and one size class, by (size, address, block).
#[derive(Default)]
pub struct Bins {
    set: BTreeSet<(u64, u64, BlockId)>,
}

impl Bins {
    /// Add free block `id`.
    pub fn insert(&mut self, blocks: &Blocks, id: BlockId) {
        let block = &blocks[id];
        debug_assert_eq!(block.state, State::Free);
        let fresh = self.set.insert((block.size, block.ptr, id));
        debug_assert!(fresh, "block {id:?} was already binned");
    }

    /// Remove free block `id`, which these bins hold.
    pub fn remove(&mut self, blocks: &Blocks, id: BlockId) {
        let block = &blocks[id];
        let held = self.set.remove(&(block.size, block.ptr, id));
        debug_assert!(held, "block {id:?} was not binned");
    }

    /// Free block `id`, which these bins hold under `old_size` at `old_ptr`, changed size or
    /// address: file it under the new ones.
    pub fn resized(&mut self, blocks: &Blocks, id: BlockId, old_size: u64, old_ptr: u64) {
        let held = self.set.remove(&(old_size, old_ptr, id));
        debug_assert!(held, "block {id:?} was not binned");
        self.insert(blocks, id);
    }

    /// The smallest free block of at least `size` bytes, lowest address first; it stays in the
    /// bins.
    pub fn find(&self, size: u64) -> Option<BlockId> {
        self.set
            .range((size, 0, BlockId::at(0))..)
            .next()
            .map(|&(_, _, id)| id)
    }

    /// The free blocks of at least `size` bytes, smallest first (`.rev()`: largest first).
    pub fn from(&self, size: u64) -> impl DoubleEndedIterator<Item = BlockId> + '_ {
        self.set
            .range((size, 0, BlockId::at(0))..)
            .map(|&(_, _, id)| id)
    }

    /// The size of the largest free block held (0 if none).
    pub fn largest(&self) -> u64 {
        self.set.last().map_or(0, |&(size, _, _)| size)
    }

    /// Number of free blocks held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::blocks::Block;
    use super::super::ids::SegId;
    use super::*;
    use crate::pool::size::MIN_BLOCK;

    fn free_block(blocks: &mut Blocks, ptr: u64, size: u64) -> BlockId {
        blocks.insert(Block {
            ptr,
            size,
            requested: 0,
            segment: SegId::at(0),
            prev: BlockId::NIL,
            next: BlockId::NIL,
            state: State::Free,
            shared: false,
        })
    }

    #[test]
    fn finds_the_smallest_fitting_block_lowest_address_first() {
        let mut blocks = Blocks::default();
        let mut bins = Bins::default();
        let sizes = [512u64, 4096, 9 << 20, 17 * 512, 1 << 30, 4096];
        let ids: Vec<BlockId> = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| free_block(&mut blocks, (10 - i as u64) << 32, s))
            .collect();
        for &id in &ids {
            bins.insert(&blocks, id);
        }
        assert_eq!(bins.len(), 6);
        assert_eq!(bins.find(17 * 512), Some(ids[3]));
        assert_eq!(bins.find(512), Some(ids[0]));
        // Two blocks of 4096: the one at the lower address.
        assert_eq!(bins.find(1024), Some(ids[5]));
        assert_eq!(bins.find(4096), Some(ids[5]));
        assert_eq!(bins.find(4608), Some(ids[3]));
        // TLSF good fit took the 1 GiB block here when it shared a bin level with 9 MiB.
        assert_eq!(bins.find(2 << 20), Some(ids[2]));
        assert_eq!(bins.find((9 << 20) + 512), Some(ids[4]));
        assert_eq!(bins.find((1 << 30) + 512), None);
        assert_eq!(bins.largest(), 1 << 30);
        bins.remove(&blocks, ids[4]);
        assert_eq!(bins.largest(), 9 << 20);
        assert_eq!(bins.find((9 << 20) + 512), None);
        // A block that shrinks from the front (a split) is refiled.
        let (old_size, old_ptr) = (blocks[ids[2]].size, blocks[ids[2]].ptr);
        blocks[ids[2]].size = 1024;
        blocks[ids[2]].ptr += old_size - 1024;
        bins.resized(&blocks, ids[2], old_size, old_ptr);
        assert_eq!(bins.find(1024), Some(ids[2]));
        assert_eq!(bins.largest(), 17 * 512);
        for &id in &[ids[0], ids[1], ids[2], ids[3], ids[5]] {
            bins.remove(&blocks, id);
        }
        assert!(bins.is_empty());
        assert_eq!(bins.largest(), 0);
        assert_eq!(bins.find(512), None);
    }

    #[test]
    fn every_found_block_is_the_best_fit() {
        // A deterministic pseudo-random workload compared with a linear scan.
        let mut blocks = Blocks::default();
        let mut bins = Bins::default();
        let mut held: Vec<BlockId> = Vec::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000u64 {
            let r = next();
            if r % 3 != 0 || held.is_empty() {
                let size = (1 + r % (1 << (r % 24))) * MIN_BLOCK;
                let id = free_block(&mut blocks, step << 40, size);
                bins.insert(&blocks, id);
                held.push(id);
            } else {
                let id = held.swap_remove((r as usize / 3) % held.len());
                bins.remove(&blocks, id);
                blocks.remove(id);
            }
            let want = (1 + next() % (1 << 20)) * MIN_BLOCK;
            let best = held
                .iter()
                .filter(|&&id| blocks[id].size >= want)
                .min_by_key(|&&id| (blocks[id].size, blocks[id].ptr))
                .copied();
            assert_eq!(bins.find(want), best, "step {step}, {want} bytes");
        }
        assert_eq!(bins.len(), held.len());
    }
}
