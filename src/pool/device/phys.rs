//! The physical-memory books of the virtual-memory mode: which handles (`cuMemCreate`) the pool
//! holds, and which of their pages are *spare*, owned by no address range.
//!
//! Every page of a held handle is owned by exactly one address range (where it is mapped and
//! not a hole) or is spare. A spare page is mapped in no segment: a range's pages only become
//! spare when the range is taken apart and no other range lent them. Its range may still be
//! mapped a while: being unmapped without the device's lock, or kept after a failed unmap (a
//! *stuck* range, `unstitch.rs`), whose handles the pool does not release meanwhile. So a
//! handle whose pages are all spare, and which no stuck range maps, has no mapping left, and
//! only such a handle goes back to the driver.
//!
//! Where the driver maps a handle only in *parts* (`Driver::vmm_part`: the CUDA driver, through
//! `driver/pages.rs`), only whole parts are lent or spare: every piece taken from a handle
//! starts where one of its parts starts and ends where one ends ([`Phys::whole_parts`]).
//!
//! The handles are kept by handle, and the unused ones (all pages spare) in a set of their own,
//! largest first, so that a lookup, a change and finding the next handle to return each take
//! O(log n) however many handles are held.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::driver::PhysHandle;

/// A piece of one handle: `size` bytes from `offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pages {
    pub(crate) handle: PhysHandle,
    pub(crate) offset: u64,
    pub(crate) size: u64,
}

impl Pages {
    /// `pieces` laid back to back as the fewest mappings: a piece that goes on in its handle
    /// where the one before it stops is mapped with it, by one `cuMemMap` (a range may be
    /// unmapped only as whole mappings, and ranges are unmapped whole, so nothing needs the
    /// pieces apart in the driver; the books keep them apart).
    pub(crate) fn mappings(pieces: impl IntoIterator<Item = Pages>) -> impl Iterator<Item = Pages> {
        let mut pieces = pieces.into_iter().peekable();
        std::iter::from_fn(move || {
            let mut run = pieces.next()?;
            while let Some(next) =
                pieces.next_if(|p| p.handle == run.handle && p.offset == run.offset + run.size)
            {
                run.size += next.size;
            }
            Some(run)
        })
    }
}

/// One held handle.
#[derive(Debug)]
struct Held {
    size: u64,
    /// Spare pieces as (offset, size), in offset order, adjacent ones merged.
    spare: Vec<(u64, u64)>,
}

impl Held {
    /// All its pages are spare: it is mapped nowhere.
    fn unused(&self) -> bool {
        self.spare.len() == 1 && self.spare[0] == (0, self.size)
    }
}

/// The handles held.
#[derive(Debug, Default)]
pub(crate) struct Phys {
    held: BTreeMap<PhysHandle, Held>,
    /// The held handles whose pages are all spare, as (size, handle), largest first.
    unused: BTreeSet<(Reverse<u64>, PhysHandle)>,
    /// Where handles map only in parts: the size of each part but a handle's last.
    part: Option<u64>,
}

impl Phys {
    /// A new handle of `size` bytes, all of it owned by the range it is about to be mapped in.
    pub(crate) fn add(&mut self, handle: PhysHandle, size: u64) {
        let fresh = Held {
            size,
            spare: Vec::new(),
        };
        let before = self.held.insert(handle, fresh);
        debug_assert!(before.is_none(), "handle {handle:#x} held twice");
    }

    /// Handles map only in whole parts of `part` bytes (`Driver::vmm_part`), the last part of
    /// a handle the rest; `None`: any pages of a handle map.
    pub(crate) fn split(&mut self, part: Option<u64>) {
        self.part = part;
    }

    /// The size of `handle`'s parts but its last, where handles map only in parts.
    pub(crate) fn part(&self, handle: PhysHandle) -> Option<u64> {
        self.part.filter(|_| self.held.contains_key(&handle))
    }

    /// The whole parts of its handle within `pages`, or `pages` where any pages map; `None`
    /// where it holds no whole part.
    pub(crate) fn whole_parts(&self, pages: Pages) -> Option<Pages> {
        let Some(part) = self.part(pages.handle) else {
            return Some(pages);
        };
        let size = self.held[&pages.handle].size;
        let end = pages.offset + pages.size;
        let start = pages.offset.next_multiple_of(part);
        let end = if end == size { end } else { end / part * part };
        (start < end).then(|| Pages {
            offset: start,
            size: end - start,
            ..pages
        })
    }

    /// Bytes held in all handles.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held.values().map(|h| h.size).sum()
    }

    /// Whether `handle` is held.
    pub(crate) fn holds(&self, handle: PhysHandle) -> bool {
        self.held.contains_key(&handle)
    }

    /// Bytes in spare pages.
    pub(crate) fn spare_bytes(&self) -> u64 {
        self.held
            .values()
            .flat_map(|h| h.spare.iter())
            .map(|&(_, size)| size)
            .sum()
    }

    /// Every spare piece, largest first.
    pub(crate) fn spare_pieces(&self) -> Vec<Pages> {
        let mut pieces: Vec<Pages> = self
            .held
            .iter()
            .flat_map(|(&handle, h)| {
                h.spare.iter().map(move |&(offset, size)| Pages {
                    handle,
                    offset,
                    size,
                })
            })
            .collect();
        pieces.sort_unstable_by_key(|p| (Reverse(p.size), p.handle, p.offset));
        pieces
    }

    /// `pages` are owned by no range any more.
    pub(crate) fn give(&mut self, pages: Pages) {
        let held = self
            .held
            .get_mut(&pages.handle)
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
        if held.unused() {
            self.unused.insert((Reverse(held.size), pages.handle));
        }
    }

    /// Take `pages`, which must be spare, for a range.
    pub(crate) fn take(&mut self, pages: Pages) {
        let held = self
            .held
            .get_mut(&pages.handle)
            .expect("pages of a held handle");
        if held.unused() {
            self.unused.remove(&(Reverse(held.size), pages.handle));
        }
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
    pub(crate) fn unused(&self) -> impl Iterator<Item = (PhysHandle, u64)> + '_ {
        self.unused
            .iter()
            .map(|&(Reverse(size), handle)| (handle, size))
    }

    /// Forget `handle`, returned to the driver (it must be unused); its size.
    pub(crate) fn remove(&mut self, handle: PhysHandle) -> u64 {
        let held = self.held.remove(&handle).expect("a held handle");
        debug_assert!(held.unused());
        self.unused.remove(&(Reverse(held.size), handle));
        held.size
    }

    /// Check the books: spare pieces inside their handle, ordered, merged, non-empty; the
    /// unused set exactly the handles whose pages are all spare.
    pub(crate) fn check(&self) -> Result<(), String> {
        let unused: BTreeSet<(Reverse<u64>, PhysHandle)> = self
            .held
            .iter()
            .filter(|(_, h)| h.unused())
            .map(|(&handle, h)| (Reverse(h.size), handle))
            .collect();
        if unused != self.unused {
            return Err(format!(
                "the unused handles are listed as {:?} but are {:?}",
                self.unused, unused
            ));
        }
        for (&handle, h) in &self.held {
            let mut end = 0;
            for (i, &(o, s)) in h.spare.iter().enumerate() {
                if s == 0 || o + s > h.size || (i > 0 && o <= end) {
                    return Err(format!(
                        "handle {:#x}: spare pieces {:?} are not ordered, merged pieces inside \
                         its {} bytes",
                        handle, h.spare, h.size
                    ));
                }
                let pages = Pages {
                    handle,
                    offset: o,
                    size: s,
                };
                if self.whole_parts(pages) != Some(pages) {
                    return Err(format!(
                        "handle {handle:#x}: spare pages {o:#x}+{s:#x} are not whole parts of \
                         {:?} bytes",
                        self.part(handle)
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
    fn pieces_that_go_on_in_their_handle_are_mapped_together() {
        let runs: Vec<Pages> = Pages::mappings([
            pages(1, 0, 2 * MIB),
            pages(1, 2 * MIB, 4 * MIB),
            pages(2, 6 * MIB, 2 * MIB),
            pages(1, 6 * MIB, 2 * MIB),
            pages(1, 10 * MIB, 2 * MIB),
            pages(1, 12 * MIB, 2 * MIB),
        ])
        .collect();
        // One handle's pieces that follow each other join; another handle's between them, or
        // a gap in the offsets, starts a new mapping.
        assert_eq!(
            runs,
            vec![
                pages(1, 0, 6 * MIB),
                pages(2, 6 * MIB, 2 * MIB),
                pages(1, 6 * MIB, 2 * MIB),
                pages(1, 10 * MIB, 4 * MIB),
            ]
        );
        assert_eq!(Pages::mappings([]).count(), 0);
    }

    #[test]
    fn where_handles_map_in_parts_only_whole_parts_are_pieces() {
        let mut phys = Phys::default();
        phys.add(1, 20 * MIB);
        assert_eq!(phys.part(1), None);
        assert_eq!(
            phys.whole_parts(pages(1, 2 * MIB, 4 * MIB)),
            Some(pages(1, 2 * MIB, 4 * MIB))
        );
        // 6 MiB parts: 0-6, 6-12, 12-18 and the last, 18-20.
        phys.split(Some(6 * MIB));
        assert_eq!(phys.part(1), Some(6 * MIB));
        assert_eq!(phys.part(2), None, "not held");
        assert_eq!(
            phys.whole_parts(pages(1, 2 * MIB, 16 * MIB)),
            Some(pages(1, 6 * MIB, 12 * MIB))
        );
        // The last part is whole where the piece reaches the handle's end.
        assert_eq!(
            phys.whole_parts(pages(1, 14 * MIB, 6 * MIB)),
            Some(pages(1, 18 * MIB, 2 * MIB))
        );
        // Inside one part, or across a boundary without a whole part: nothing.
        assert_eq!(phys.whole_parts(pages(1, 2 * MIB, 4 * MIB)), None);
        assert_eq!(phys.whole_parts(pages(1, 4 * MIB, 6 * MIB)), None);
        // Spare pages that are not whole parts break the books.
        phys.give(pages(1, 0, 6 * MIB));
        phys.check().unwrap();
        phys.give(pages(1, 8 * MIB, 2 * MIB));
        assert!(phys.check().unwrap_err().contains("not whole parts"));
    }

    #[test]
    fn spare_pages_merge_and_a_handle_is_unused_only_when_all_are_spare() {
        let mut phys = Phys::default();
        phys.add(1, 20 * MIB);
        phys.add(2, 4 * MIB);
        assert_eq!(phys.held_bytes(), 24 * MIB);
        assert_eq!(phys.spare_bytes(), 0);
        assert!(phys.unused().next().is_none());
        phys.give(pages(1, 8 * MIB, 4 * MIB));
        phys.give(pages(1, 0, 2 * MIB));
        phys.give(pages(1, 12 * MIB, 8 * MIB));
        assert_eq!(phys.spare_bytes(), 14 * MIB);
        assert_eq!(
            phys.spare_pieces(),
            vec![pages(1, 8 * MIB, 12 * MIB), pages(1, 0, 2 * MIB)]
        );
        assert!(phys.unused().next().is_none(), "6 MiB are still owned");
        phys.give(pages(2, 0, 4 * MIB));
        assert_eq!(phys.unused().collect::<Vec<_>>(), vec![(2, 4 * MIB)]);
        phys.give(pages(1, 2 * MIB, 6 * MIB));
        assert_eq!(
            phys.unused().collect::<Vec<_>>(),
            vec![(1, 20 * MIB), (2, 4 * MIB)]
        );
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
        assert_eq!(phys.unused().collect::<Vec<_>>(), vec![(2, 4 * MIB)]);
        phys.check().unwrap();
        assert_eq!(phys.remove(2), 4 * MIB);
        assert!(!phys.holds(2));
        assert_eq!(phys.held_bytes(), 20 * MIB);
        phys.give(pages(1, 4 * MIB, 2 * MIB));
        assert_eq!(phys.unused().collect::<Vec<_>>(), vec![(1, 20 * MIB)]);
    }
}
