//! The physical-memory books of the virtual-memory mode: which handles (`cuMemCreate`) the pool
//! holds, and which of their pages are *spare*, owned by no address range.
//!
//! Every page of a held handle is owned by exactly one address range (where it is mapped and
//! not a hole) or is spare. A spare page is mapped nowhere: a range's pages only become spare
//! when the range is unmapped and no other range lent them. So a handle whose pages are all
//! spare has no mapping left, and only such a handle goes back to the driver.

use crate::driver::PhysHandle;

/// A piece of one handle: `size` bytes from `offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pages {
    pub(crate) handle: PhysHandle,
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

/// One held handle.
#[derive(Debug)]
struct Held {
    handle: PhysHandle,
    size: u64,
    /// Spare pieces as (offset, size), in offset order, adjacent ones merged.
    spare: Vec<(u64, u64)>,
}

/// The handles held, in creation order.
#[derive(Debug, Default)]
pub(crate) struct Phys {
    held: Vec<Held>,
}

impl Phys {
    /// A new handle of `size` bytes, all of it owned by the range it is about to be mapped in.
    pub(crate) fn add(&mut self, handle: PhysHandle, size: u64) {
        self.held.push(Held {
            handle,
            size,
            spare: Vec::new(),
        });
    }

    /// Bytes held in all handles.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held.iter().map(|h| h.size).sum()
    }

    /// Whether `handle` is held.
    pub(crate) fn holds(&self, handle: PhysHandle) -> bool {
        self.held.iter().any(|h| h.handle == handle)
    }

    /// Bytes in spare pages.
    pub(crate) fn spare_bytes(&self) -> u64 {
        self.held
            .iter()
            .flat_map(|h| h.spare.iter())
            .map(|&(_, size)| size)
            .sum()
    }

    /// Every spare piece, largest first.
    pub(crate) fn spare_pieces(&self) -> Vec<Pages> {
        let mut pieces: Vec<Pages> = self
            .held
            .iter()
            .flat_map(|h| {
                h.spare.iter().map(|&(offset, size)| Pages {
                    handle: h.handle,
                    offset,
                    size,
                })
            })
            .collect();
        pieces.sort_unstable_by_key(|p| (std::cmp::Reverse(p.size), p.handle, p.offset));
        pieces
    }

    /// `pages` are owned by no range any more.
    pub(crate) fn give(&mut self, pages: Pages) {
        let held = self
            .held
            .iter_mut()
            .find(|h| h.handle == pages.handle)
            .expect("pages of a held handle");
        debug_assert!(pages.offset + pages.size <= held.size);
        let at = held.spare.partition_point(|&(o, _)| o < pages.offset);
        held.spare.insert(at, (pages.offset, pages.size));
        // Merge with the neighbours.
        if at + 1 < held.spare.len() && pages.offset + pages.size == held.spare[at + 1].0 {
            held.spare[at].1 += held.spare[at + 1].1;
            held.spare.remove(at + 1);
        }
        if at > 0 && held.spare[at - 1].0 + held.spare[at - 1].1 == pages.offset {
            held.spare[at - 1].1 += held.spare[at].1;
            held.spare.remove(at);
        }
    }

    /// Take `pages`, which must be spare, for a range.
    pub(crate) fn take(&mut self, pages: Pages) {
        let held = self
            .held
            .iter_mut()
            .find(|h| h.handle == pages.handle)
            .expect("pages of a held handle");
        let at = held
            .spare
            .iter()
            .position(|&(o, s)| o <= pages.offset && pages.offset + pages.size <= o + s)
            .expect("spare pages");
        let (o, s) = held.spare.remove(at);
        let mut rest = Vec::with_capacity(2);
        if o < pages.offset {
            rest.push((o, pages.offset - o));
        }
        if pages.offset + pages.size < o + s {
            rest.push((pages.offset + pages.size, o + s - pages.offset - pages.size));
        }
        for (i, piece) in rest.into_iter().enumerate() {
            held.spare.insert(at + i, piece);
        }
    }

    /// The handles whose pages are all spare (mapped nowhere), largest first, as
    /// (handle, size).
    pub(crate) fn unused(&self) -> Vec<(PhysHandle, u64)> {
        let mut unused: Vec<(PhysHandle, u64)> = self
            .held
            .iter()
            .filter(|h| h.spare.len() == 1 && h.spare[0] == (0, h.size))
            .map(|h| (h.handle, h.size))
            .collect();
        unused.sort_unstable_by_key(|&(handle, size)| (std::cmp::Reverse(size), handle));
        unused
    }

    /// Forget `handle`, returned to the driver (it must be unused); its size.
    pub(crate) fn remove(&mut self, handle: PhysHandle) -> u64 {
        let at = self
            .held
            .iter()
            .position(|h| h.handle == handle)
            .expect("a held handle");
        debug_assert_eq!(self.held[at].spare, vec![(0, self.held[at].size)]);
        self.held.remove(at).size
    }

    /// Check the books: spare pieces inside their handle, ordered, merged, non-empty.
    pub(crate) fn check(&self) -> Result<(), String> {
        for h in &self.held {
            let mut end = 0;
            for (i, &(o, s)) in h.spare.iter().enumerate() {
                if s == 0 || o + s > h.size || (i > 0 && o <= end) {
                    return Err(format!(
                        "handle {:#x}: spare pieces {:?} are not ordered, merged pieces inside \
                         its {} bytes",
                        h.handle, h.spare, h.size
                    ));
                }
                end = o + s;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn pages(handle: PhysHandle, offset: u64, size: u64) -> Pages {
        Pages {
            handle,
            offset,
            size,
        }
    }

    #[test]
    fn spare_pages_merge_and_a_handle_is_unused_only_when_all_are_spare() {
        let mut phys = Phys::default();
        phys.add(1, 20 * MIB);
        phys.add(2, 4 * MIB);
        assert_eq!(phys.held_bytes(), 24 * MIB);
        assert_eq!(phys.spare_bytes(), 0);
        assert!(phys.unused().is_empty());
        phys.give(pages(1, 8 * MIB, 4 * MIB));
        phys.give(pages(1, 0, 2 * MIB));
        phys.give(pages(1, 12 * MIB, 8 * MIB));
        assert_eq!(phys.spare_bytes(), 14 * MIB);
        assert_eq!(
            phys.spare_pieces(),
            vec![pages(1, 8 * MIB, 12 * MIB), pages(1, 0, 2 * MIB)]
        );
        assert!(phys.unused().is_empty(), "6 MiB are still owned");
        phys.give(pages(2, 0, 4 * MIB));
        assert_eq!(phys.unused(), vec![(2, 4 * MIB)]);
        phys.give(pages(1, 2 * MIB, 6 * MIB));
        assert_eq!(phys.unused(), vec![(1, 20 * MIB), (2, 4 * MIB)]);
        phys.check().unwrap();
        // Taking pages splits a spare piece.
        phys.take(pages(1, 4 * MIB, 2 * MIB));
        assert_eq!(
            phys.spare_pieces(),
            vec![
                pages(1, 6 * MIB, 14 * MIB),
                pages(1, 0, 4 * MIB),
                pages(2, 0, 4 * MIB)
            ]
        );
        assert_eq!(phys.unused(), vec![(2, 4 * MIB)]);
        phys.check().unwrap();
        assert_eq!(phys.remove(2), 4 * MIB);
        assert!(!phys.holds(2));
        assert_eq!(phys.held_bytes(), 20 * MIB);
        phys.give(pages(1, 4 * MIB, 2 * MIB));
        assert_eq!(phys.unused(), vec![(1, 20 * MIB)]);
    }
}
