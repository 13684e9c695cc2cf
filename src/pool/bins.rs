//! The free-block index: two-level segregated bins with bitmasks (TLSF, as in offset-allocator),
//! so finding a fitting block costs a few bit operations and a scan of at most
//! [`OWN_BIN_SCAN`] blocks, whatever the number of cached blocks.
//!
//! Sizes are counted in 512-byte units. A size maps to a bin by its binary exponent (first
//! level) and the next three bits below its leading one (second level): eight bins per power of
//! two, each spanning at most 1/8 of its lower bound. Bins below 16 units are exact.
//!
//! Search first looks, boundedly, for the smallest fitting block in the request's own bin (so an
//! exact-size block released a moment ago is found again), then takes the first block of the
//! lowest non-empty higher bin, where every block fits: a good fit in bounded time (the scan of
//! the own bin stops after [`OWN_BIN_SCAN`] blocks; the higher bins cost O(1)).

use super::blocks::{Blocks, State, NIL};
use super::size::MIN_BLOCK;

const SUB_BITS: u32 = 3;
const SUBS: usize = 1 << SUB_BITS;
const GROUPS: usize = 64;
const BINS: usize = GROUPS * SUBS;
/// How many blocks of the request's own bin are looked at before moving up a bin.
const OWN_BIN_SCAN: usize = 16;

/// The bin that holds blocks of `units` 512-byte units (`units >= 1`).
fn bin_floor(units: u64) -> usize {
    if units < (2 * SUBS) as u64 {
        return units as usize;
    }
    let exp = 63 - units.leading_zeros();
    let mantissa = (units >> (exp - SUB_BITS)) as usize & (SUBS - 1);
    (exp as usize - SUB_BITS as usize + 1) * SUBS + mantissa
}

/// The smallest size, in units, of blocks in `bin`.
fn bin_lower_bound(bin: usize) -> u64 {
    if bin < 2 * SUBS {
        return bin as u64;
    }
    let exp = (bin / SUBS) as u32 + SUB_BITS - 1;
    ((SUBS + bin % SUBS) as u64) << (exp - SUB_BITS)
}

/// One set of bins: the free blocks of one stream and one size class.
pub struct Bins {
    heads: Box<[u32; BINS]>,
    groups: u64,
    subs: [u8; GROUPS],
    /// Free blocks held.
    count: usize,
}

impl Default for Bins {
    fn default() -> Self {
        Bins {
            heads: Box::new([NIL; BINS]),
            groups: 0,
            subs: [0; GROUPS],
            count: 0,
        }
    }
}

impl Bins {
    /// Add free block `id`.
    pub fn insert(&mut self, blocks: &mut Blocks, id: u32) {
        let bin = bin_floor(blocks[id].size / MIN_BLOCK);
        let head = self.heads[bin];
        {
            let block = &mut blocks[id];
            debug_assert_eq!(block.state, State::Free);
            block.bin_prev = NIL;
            block.bin_next = head;
        }
        if head != NIL {
            blocks[head].bin_prev = id;
        }
        self.heads[bin] = id;
        self.groups |= 1 << (bin / SUBS);
        self.subs[bin / SUBS] |= 1 << (bin % SUBS);
        self.count += 1;
    }

    /// Remove free block `id`, which these bins hold.
    pub fn remove(&mut self, blocks: &mut Blocks, id: u32) {
        let size = blocks[id].size;
        self.unlink(blocks, id, size);
        self.count -= 1;
    }

    /// Free block `id`, which these bins hold, changed size from `old_size`: move it to its new
    /// bin if that differs (a block stays in place while its size stays within its bin).
    pub fn resized(&mut self, blocks: &mut Blocks, id: u32, old_size: u64) {
        let (old, new) = (
            bin_floor(old_size / MIN_BLOCK),
            bin_floor(blocks[id].size / MIN_BLOCK),
        );
        if old != new {
            self.unlink(blocks, id, old_size);
            self.count -= 1;
            self.insert(blocks, id);
        }
    }

    /// Take `id` out of the list of the bin of `size`.
    fn unlink(&mut self, blocks: &mut Blocks, id: u32, size: u64) {
        let (prev, next) = {
            let block = &blocks[id];
            (block.bin_prev, block.bin_next)
        };
        if prev != NIL {
            blocks[prev].bin_next = next;
        } else {
            let bin = bin_floor(size / MIN_BLOCK);
            debug_assert_eq!(self.heads[bin], id);
            self.heads[bin] = next;
            if next == NIL {
                self.subs[bin / SUBS] &= !(1 << (bin % SUBS));
                if self.subs[bin / SUBS] == 0 {
                    self.groups &= !(1 << (bin / SUBS));
                }
            }
        }
        if next != NIL {
            blocks[next].bin_prev = prev;
        }
        let block = &mut blocks[id];
        block.bin_prev = NIL;
        block.bin_next = NIL;
    }

    /// A free block of at least `size` bytes (a multiple of 512), if any; it stays in the bins.
    pub fn find(&self, blocks: &Blocks, size: u64) -> Option<u32> {
        let units = size / MIN_BLOCK;
        let own = bin_floor(units);
        let mut start = own;
        if bin_lower_bound(own) != units {
            // Blocks in the request's own bin may or may not fit: look at a few, keep the best.
            let mut best = NIL;
            let mut id = self.heads[own];
            for _ in 0..OWN_BIN_SCAN {
                if id == NIL {
                    break;
                }
                let block = &blocks[id];
                if block.size >= size && (best == NIL || block.size < blocks[best].size) {
                    best = id;
                    if block.size == size {
                        break;
                    }
                }
                id = block.bin_next;
            }
            if best != NIL {
                return Some(best);
            }
            start = own + 1;
        }
        match self.first_from(start) {
            Some(bin) => Some(self.heads[bin]),
            // Nothing above: before the caller grows, make sure the own bin holds no fit at all.
            None if start != own => self.smallest_fit_in(blocks, own, size),
            None => None,
        }
    }

    /// The smallest block of at least `size` bytes in `bin`, scanning all of it.
    fn smallest_fit_in(&self, blocks: &Blocks, bin: usize, size: u64) -> Option<u32> {
        let mut best = None::<u32>;
        let mut id = self.heads[bin];
        while id != NIL {
            let block = &blocks[id];
            if block.size >= size && best.is_none_or(|b| block.size < blocks[b].size) {
                best = Some(id);
            }
            id = block.bin_next;
        }
        best
    }

    /// The lowest non-empty bin at or above `start`.
    fn first_from(&self, start: usize) -> Option<usize> {
        if start >= BINS {
            return None;
        }
        let group = start / SUBS;
        let subs = self.subs[group] & (u8::MAX << (start % SUBS));
        if subs != 0 {
            return Some(group * SUBS + subs.trailing_zeros() as usize);
        }
        let groups = if group + 1 >= GROUPS {
            0
        } else {
            self.groups & (u64::MAX << (group + 1))
        };
        if groups == 0 {
            return None;
        }
        let group = groups.trailing_zeros() as usize;
        Some(group * SUBS + self.subs[group].trailing_zeros() as usize)
    }

    /// The size of the largest free block held (0 if none). Scans one bin.
    pub fn largest(&self, blocks: &Blocks) -> u64 {
        if self.groups == 0 {
            return 0;
        }
        let group = 63 - self.groups.leading_zeros() as usize;
        let bin = group * SUBS + 7 - self.subs[group].leading_zeros() as usize;
        let mut largest = 0;
        let mut id = self.heads[bin];
        while id != NIL {
            largest = largest.max(blocks[id].size);
            id = blocks[id].bin_next;
        }
        largest
    }

    /// Number of free blocks held.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

#[cfg(test)]
mod tests {
    use super::super::blocks::Block;
    use super::*;

    fn free_block(blocks: &mut Blocks, ptr: u64, size: u64) -> u32 {
        blocks.insert(Block {
            ptr,
            size,
            requested: 0,
            segment: 0,
            prev: NIL,
            next: NIL,
            bin_prev: NIL,
            bin_next: NIL,
            state: State::Free,
            shared: false,
        })
    }

    #[test]
    fn bins_are_monotonic_and_bounds_round_trip() {
        let mut last = 0;
        for units in 1..100_000u64 {
            let bin = bin_floor(units);
            assert!(bin >= last, "bin of {units} went down");
            assert!(bin_lower_bound(bin) <= units);
            assert!(bin + 1 >= BINS || bin_lower_bound(bin + 1) > units);
            last = bin;
        }
        let top = bin_floor(u64::MAX);
        assert!(top < BINS);
        for bin in 1..=top {
            assert_eq!(bin_floor(bin_lower_bound(bin)), bin, "bin {bin}");
        }
        // The largest possible size has a bin.
        assert!(bin_floor(u64::MAX / MIN_BLOCK) < BINS);
    }

    #[test]
    fn bin_width_is_at_most_an_eighth() {
        for bin in 16..bin_floor(u64::MAX) {
            let lo = bin_lower_bound(bin);
            let hi = bin_lower_bound(bin + 1);
            assert!((hi - lo) * 8 <= lo, "bin {bin}: {lo}..{hi}");
        }
    }

    #[test]
    fn finds_exact_then_smallest_fitting() {
        let mut blocks = Blocks::default();
        let mut bins = Bins::default();
        let sizes = [512u64, 4096, 9 << 20, 17 * 512, 1 << 30];
        let ids: Vec<u32> = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| free_block(&mut blocks, (i as u64) << 32, s))
            .collect();
        for &id in &ids {
            bins.insert(&mut blocks, id);
        }
        assert_eq!(bins.len(), 5);
        // 17 units lies inside a bin of width 2: the exact block is found by the own-bin scan.
        assert_eq!(bins.find(&blocks, 17 * 512), Some(ids[3]));
        assert_eq!(bins.find(&blocks, 512), Some(ids[0]));
        assert_eq!(bins.find(&blocks, 1024), Some(ids[1]));
        assert_eq!(bins.find(&blocks, 4096), Some(ids[1]));
        assert_eq!(bins.find(&blocks, 4608), Some(ids[3]));
        assert_eq!(bins.find(&blocks, 2 << 20), Some(ids[2]));
        assert_eq!(bins.find(&blocks, (9 << 20) + 512), Some(ids[4]));
        assert_eq!(bins.find(&blocks, (1 << 30) + 512), None);
        assert_eq!(bins.largest(&blocks), 1 << 30);
        bins.remove(&mut blocks, ids[4]);
        assert_eq!(bins.largest(&blocks), 9 << 20);
        assert_eq!(bins.find(&blocks, (9 << 20) + 512), None);
        for &id in &ids[..4] {
            bins.remove(&mut blocks, id);
        }
        assert!(bins.is_empty());
        assert_eq!(bins.largest(&blocks), 0);
        assert_eq!(bins.find(&blocks, 512), None);
    }

    #[test]
    fn every_found_block_fits_and_nothing_fitting_is_missed() {
        // A deterministic pseudo-random workload compared with a linear scan.
        let mut blocks = Blocks::default();
        let mut bins = Bins::default();
        let mut held: Vec<u32> = Vec::new();
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
                bins.insert(&mut blocks, id);
                held.push(id);
            } else {
                let id = held.swap_remove((r as usize / 3) % held.len());
                bins.remove(&mut blocks, id);
                blocks.remove(id);
            }
            let want = (1 + next() % (1 << 20)) * MIN_BLOCK;
            let exists = held.iter().any(|&id| blocks[id].size >= want);
            match bins.find(&blocks, want) {
                Some(id) => {
                    assert!(blocks[id].size >= want);
                    assert!(held.contains(&id));
                }
                None => assert!(!exists, "missed a fitting block for {want}"),
            }
        }
        assert_eq!(bins.len(), held.len());
    }
}
