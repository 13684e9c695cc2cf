//! The address space of stitched segments: large reservations (`cuMemAddressReserve`), called
//! *chunks*, out of which each segment's range is carved and into which it goes back when the
//! segment is taken apart, so that making and taking apart a segment costs no reservation call
//! of its own (on an H200 every virtual-memory call costs about as much as a `cuMemMap`: on the
//! shipped traces and shared snapshots the per-segment reservations and frees were 16-38% of the
//! default's driver calls, about a fifth on most). PyTorch's expandable segments reserve
//! address space the size of the device once for the same reason.
//!
//! Pure bookkeeping: the device pool makes the driver calls. Free ranges are kept by address
//! (merged with their free neighbours, never across a chunk's edge: a mapping must lie inside
//! one reservation) and by (size, address) for best fit. A chunk whose every address is free
//! again is *unused*; `free_reusable` gives those back, so that a pool holding nothing holds no
//! address space either.

use std::collections::{BTreeMap, BTreeSet};

use crate::driver::DevicePtr;

/// The least address space reserved at once: 64 GiB (more where one range needs more). Address
/// space costs no memory; this leaves room for the whole cache of most devices in one chunk.
pub(super) const CHUNK: u64 = 64 << 30;

/// The chunks reserved and their free ranges.
#[derive(Debug, Default)]
pub(super) struct Addresses {
    /// Reserved chunks, by base: their sizes.
    chunks: BTreeMap<DevicePtr, u64>,
    /// Free ranges, by start: their sizes.
    free: BTreeMap<DevicePtr, u64>,
    /// The same free ranges by (size, start).
    by_size: BTreeSet<(u64, DevicePtr)>,
}

impl Addresses {
    /// A free range of `size` bytes taken out, the smallest that fits (lowest address first);
    /// `None` if no chunk has room.
    pub(super) fn take(&mut self, size: u64) -> Option<DevicePtr> {
        let &(have, start) = self.by_size.range((size, 0)..).next()?;
        self.remove_free(start, have);
        if have > size {
            self.insert_free(start + size, have - size);
        }
        Some(start)
    }

    /// A newly reserved chunk, all free.
    pub(super) fn add_chunk(&mut self, base: DevicePtr, size: u64) {
        self.chunks.insert(base, size);
        self.insert_free(base, size);
    }

    /// Give back `[ptr, ptr + size)`, taken before: merged with its free neighbours in its chunk.
    pub(super) fn give(&mut self, ptr: DevicePtr, size: u64) {
        let (chunk, chunk_size) = self.chunk_of(ptr);
        let (mut start, mut end) = (ptr, ptr + size);
        debug_assert!(end <= chunk + chunk_size, "a range inside its chunk");
        if let Some((&before, &len)) = self.free.range(chunk..ptr).next_back() {
            if before + len == ptr {
                self.remove_free(before, len);
                start = before;
            }
        }
        if end < chunk + chunk_size {
            if let Some(&len) = self.free.get(&end) {
                self.remove_free(end, len);
                end += len;
            }
        }
        self.insert_free(start, end - start);
    }

    /// A chunk with no range in use, if any: `(base, size)`.
    pub(super) fn unused_chunk(&self) -> Option<(DevicePtr, u64)> {
        self.chunks
            .iter()
            .find(|&(base, size)| self.free.get(base) == Some(size))
            .map(|(&base, &size)| (base, size))
    }

    /// Forget unused chunk `base` (its reservation freed).
    pub(super) fn remove_chunk(&mut self, base: DevicePtr) {
        let size = self.chunks.remove(&base).expect("a chunk");
        self.remove_free(base, size);
    }

    /// Bytes of address space reserved.
    pub(super) fn reserved(&self) -> u64 {
        self.chunks.values().sum()
    }

    /// Bytes of address space free in the chunks.
    pub(super) fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    /// Whether `[ptr, ptr + size)` lies inside one chunk.
    pub(super) fn within_chunk(&self, ptr: DevicePtr, size: u64) -> bool {
        self.chunks
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&base, &len)| ptr + size <= base + len)
    }

    /// The books agree: free ranges inside chunks, apart and unmerged only at chunk edges, and
    /// the size index equal to them.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut last_end = None;
        for (&start, &len) in &self.free {
            if len == 0 || !self.within_chunk(start, len) {
                return Err(format!(
                    "free address range {start:#x}+{len:#x} outside a chunk"
                ));
            }
            if last_end == Some(start) && !self.chunks.contains_key(&start) {
                return Err(format!("free address range at {start:#x} not merged"));
            }
            if last_end.is_some_and(|e| e > start) {
                return Err(format!("free address ranges overlap at {start:#x}"));
            }
            if !self.by_size.contains(&(len, start)) {
                return Err(format!(
                    "free address range {start:#x} not in the size index"
                ));
            }
            last_end = Some(start + len);
        }
        if self.by_size.len() != self.free.len() {
            return Err("the size index of free addresses holds other ranges".into());
        }
        Ok(())
    }

    fn chunk_of(&self, ptr: DevicePtr) -> (DevicePtr, u64) {
        let (&base, &size) = self
            .chunks
            .range(..=ptr)
            .next_back()
            .expect("an address range lies in a chunk");
        (base, size)
    }

    fn insert_free(&mut self, start: DevicePtr, size: u64) {
        self.free.insert(start, size);
        self.by_size.insert((size, start));
    }

    fn remove_free(&mut self, start: DevicePtr, size: u64) {
        self.free.remove(&start);
        self.by_size.remove(&(size, start));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn ranges_are_carved_best_fit_and_merge_back_within_their_chunk() {
        let mut a = Addresses::default();
        assert_eq!(a.take(2 * MIB), None);
        a.add_chunk(0x1000_0000, 10 * MIB);
        let x = a.take(4 * MIB).unwrap();
        let y = a.take(2 * MIB).unwrap();
        let z = a.take(4 * MIB).unwrap();
        assert_eq!((x, y, z), (0x1000_0000, 0x1040_0000, 0x1060_0000));
        assert_eq!((a.take(2 * MIB), a.free_bytes()), (None, 0));
        a.give(x, 4 * MIB);
        a.give(z, 4 * MIB);
        // Best fit: the 2 MiB request takes from the lower of the two equal holes.
        assert_eq!(a.take(2 * MIB), Some(x));
        a.give(x, 2 * MIB);
        assert_eq!(a.unused_chunk(), None);
        a.give(y, 2 * MIB);
        a.check().unwrap();
        assert_eq!(a.unused_chunk(), Some((0x1000_0000, 10 * MIB)));
        a.remove_chunk(0x1000_0000);
        assert_eq!((a.reserved(), a.free_bytes()), (0, 0));
        a.check().unwrap();
    }

    #[test]
    fn adjacent_chunks_never_merge() {
        let mut a = Addresses::default();
        a.add_chunk(0x1000_0000, 4 * MIB);
        a.add_chunk(0x1040_0000, 4 * MIB);
        // 8 MiB of adjacent free addresses, but no one range of 6 MiB inside a chunk.
        assert_eq!(a.take(6 * MIB), None);
        let x = a.take(4 * MIB).unwrap();
        a.give(x, 4 * MIB);
        a.check().unwrap();
        assert_eq!(a.free.len(), 2);
        assert_eq!(a.unused_chunk(), Some((0x1000_0000, 4 * MIB)));
    }
}
