//! The cache's pieces for a new stitched range (`stitch.rs` builds the range from them): which
//! there are, which to take, and whether a cover in part pays.
//!
//! A piece is *spare* pages, owned by no range (see `phys.rs`); the granularity-aligned
//! interior of a free block of a large stitched segment, split along its runs, which the range
//! borrows (*lent*: its lender books it as a hole); or a *fragment*, the free tail of a page
//! whose start holds another block ([`DevicePool::fragment`]). Spare pages are taken first,
//! largest first; then the smallest lent piece that covers the rest alone, else the largest
//! first; at most as many pieces as the caller allows (a piece costs a `cuMemMap`). Whether a
//! cover in part is worth taking is [`partial_pays`]. The pieces are found through the
//! streams' bins of large blocks, each walk bounded ([`COVER_WALK`]): no search looks at every
//! free block.

use super::phys::Pages;
use super::{BlockId, Class, DevicePool, SegId};
use crate::driver::DevicePtr;
use crate::pool::size::segment_size;

/// How many free blocks the search for the smallest piece that covers an amount looks at, at
/// most, and the search for the largest pieces past the first `most` (see
/// `DevicePool::lendable`).
const COVER_WALK: usize = 64;

/// A piece of cached memory for a new segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) pages: Pages,
    /// Lent by this segment, where the pages are mapped at this address; `None`: spare pages.
    pub(super) lender: Option<(SegId, DevicePtr)>,
    /// For a lent piece, the free block it was found in, or one before it in its segment (a
    /// block cut before it for another piece): where the search for it starts.
    pub(super) block: BlockId,
    /// For a fragment (see [`DevicePool::fragment`]): the bytes of its page before the free
    /// tail, the lender's, which the new range maps but never hands out; 0 for whole pages.
    pub(super) skip: u64,
    /// The size of its handle's parts (the granularity where a handle maps in any pages): a
    /// piece is cut only at the end of one (see `phys.rs`).
    pub(super) unit: u64,
}

/// Choose spare pieces for `need` bytes, largest first, at most `most`; the last piece taken
/// is cut to what is still needed (from its start, to the end of a part of its handle: the
/// pieces may hold more than `need`). The rest comes from [`choose_lent`].
pub(super) fn choose_spare(spare: &[Piece], need: u64, most: usize) -> Vec<Piece> {
    let mut spare = spare.to_vec();
    spare.sort_by_key(|p| std::cmp::Reverse(p.pages.size));
    let mut chosen = Vec::new();
    let mut left = need;
    for piece in &spare {
        if left == 0 || chosen.len() == most {
            break;
        }
        take(piece, &mut left, &mut chosen);
    }
    chosen
}

/// Add to `chosen` (the spare pieces) lendable pieces for the rest of `need` bytes: the
/// smallest that covers the rest alone, else the largest first; at most `most` in all. The last
/// piece taken is cut to what is still needed (from its start, to the end of a part).
pub(super) fn choose_lent(chosen: &mut Vec<Piece>, lendable: &[Piece], need: u64, most: usize) {
    let mut left = need.saturating_sub(chosen.iter().map(|p| p.pages.size).sum::<u64>());
    let mut lendable = lendable.to_vec();
    lendable.sort_by_key(|p| (p.pages.size, p.lender));
    while left > 0 && chosen.len() < most && !lendable.is_empty() {
        let at = lendable
            .iter()
            .position(|p| p.pages.size >= left)
            .unwrap_or(lendable.len() - 1);
        let piece = lendable.remove(at);
        take(&piece, &mut left, chosen);
    }
}

/// Add `piece` to `chosen`, cut to `left` bytes rounded up to the end of a part, and count it
/// off `left`.
fn take(piece: &Piece, left: &mut u64, chosen: &mut Vec<Piece>) {
    let Pages { offset, size, .. } = piece.pages;
    let end = (offset + size.min(*left))
        .next_multiple_of(piece.unit)
        .min(offset + size);
    let size = end - offset;
    chosen.push(Piece {
        pages: Pages {
            size,
            ..piece.pages
        },
        ..*piece
    });
    *left = left.saturating_sub(size);
}

/// Whether a range only partly covered by the cache (`have` of `size` bytes) should still be
/// made from it. Covered wholly, it always is: nothing is created. Covered partly, something is
/// created anyway, and the free blocks lent are lost to the requests that would have reused
/// them (replayed training snapshots made up to twice PyTorch's driver allocations when every
/// partial cover was taken). So partly only where it pays: when at least half of the range is
/// cached (creating it whole would leave that much idle: a model's next warm-up beside the
/// block that outlived generation; the snapshot whose 477 MiB request met 340 MiB of free
/// blocks, and reserved 15% more than it needed under PyTorch's policy); when the request is
/// larger than all the pool reserves, half of the pool is cached, and that cache is `leftover`
/// (`Some` of the pool's reserved bytes: what an earlier phase left, not the rest of what the
/// pool just created, see [`DevicePool::leftover`]): creating the request whole would leave
/// half the pool idle beside it (a 37.65 GiB warm-up after a 12.88 GiB load was freed reserved
/// 50.54 GiB where 37.66 serve); or when the driver lacks a segment of the request's size
/// (PyTorch would run out of memory or return its cache). Never where the driver cannot supply
/// the rest, so that a request that cannot be met fails holding no cache back from the release
/// that precedes the failure.
pub(super) fn partial_pays(size: u64, have: u64, driver_free: u64, leftover: Option<u64>) -> bool {
    let half_of = leftover.map_or(size, |reserved| size.min(reserved));
    have.saturating_add(driver_free) >= size
        && (have.saturating_mul(2) >= half_of || driver_free < segment_size(size))
}

impl DevicePool {
    /// Cached pieces for up to `size` bytes, at most `most`: spare pages, then lendable pieces
    /// (the books unchanged).
    pub(super) fn choose(&self, granularity: u64, size: u64, most: usize) -> Vec<Piece> {
        let spare: Vec<Piece> = self
            .phys
            .spare_pieces()
            .into_iter()
            .map(|pages| Piece {
                pages,
                lender: None,
                block: BlockId::NIL,
                skip: 0,
                unit: self.phys.part(pages.handle).unwrap_or(granularity),
            })
            .collect();
        let mut chosen = choose_spare(&spare, size, most);
        let left = size.saturating_sub(chosen.iter().map(|p| p.pages.size).sum::<u64>());
        let lendable = self.lendable(granularity, left, most - chosen.len(), most);
        choose_lent(&mut chosen, &lendable, size, most);
        chosen
    }

    /// The pool's reserved bytes if `pieces` are cache an earlier phase left rather than the
    /// rest of what the pool just created, for [`partial_pays`]: the pool has stopped growing (a
    /// range came wholly from the cache since it last created memory), or half of it is in
    /// `pieces` from ranges with no live block (or spare). A growing pool's cache beside its live
    /// blocks is what the requests after it use: a 256 MiB request taking the 12 MiB beside the
    /// first 8 MiB block left the next small request to create again.
    pub(super) fn leftover(&self, pieces: &[Piece]) -> Option<u64> {
        let reserved = self.stats.reserved_bytes;
        let idle: u64 = pieces
            .iter()
            .filter(|p| {
                p.lender
                    .is_none_or(|(seg, _)| self.segments[seg].idle_at.is_some())
            })
            .map(|p| p.pages.size)
            .sum();
        (!self.headroom.growing() || idle.saturating_mul(2) >= reserved).then_some(reserved)
    }

    /// The pieces of free blocks [`choose_lent`] may take for the `left` bytes the spare pieces
    /// leave, `slots` pieces at most: per stream, the largest (walked from its largest free
    /// block down, until `most` are found and no smaller block can hold a larger one),
    /// and for every amount those could leave to cover, the smallest that covers it (walked
    /// from that amount up, until a block two pages larger than the best found, which holds no
    /// smaller piece unless its segment's runs split it). Found through the streams' bins of
    /// large blocks, and each walk looks at [`COVER_WALK`] blocks past what it needs at most:
    /// with 100k free blocks cached, listing every piece made one growth take 21 ms under the
    /// device's lock. Ties of size are broken by the bins' order (size, then address), so among
    /// many equal blocks only the first few are looked at; and the largest pieces are always
    /// among those listed.
    fn lendable(&self, granularity: u64, mut left: u64, slots: usize, most: usize) -> Vec<Piece> {
        if left == 0 || slots == 0 {
            return Vec::new();
        }
        let mut pieces = Vec::new();
        let mut top = Vec::new();
        for slot in &self.slots {
            let bins = &slot.bins[Class::Large as usize];
            let mut found = Vec::new();
            for (looked, id) in bins.from(granularity).rev().enumerate() {
                // Blocks whose pages all straddle their ends hold no piece: not walked forever.
                if looked == most + COVER_WALK {
                    break;
                }
                if found.len() >= most {
                    // The smallest of the largest so far; a block no larger holds no larger piece.
                    found.sort_unstable_by(|a: &u64, b| b.cmp(a));
                    found.truncate(most);
                    if self.blocks[id].size <= found[most - 1] {
                        break;
                    }
                }
                let from = pieces.len();
                self.pieces_of(id, granularity, &mut pieces);
                found.extend(pieces[from..].iter().map(|p| p.pages.size));
                top.extend(pieces[from..].iter().map(|p| p.pages.size));
            }
        }
        // The amounts left to cover after each of the largest pieces, as `choose` takes them.
        top.sort_unstable_by(|a, b| b.cmp(a));
        let mut amounts = vec![left];
        for size in top.iter().take(slots) {
            if left <= *size {
                break;
            }
            left -= size;
            amounts.push(left);
        }
        for slot in &self.slots {
            let bins = &slot.bins[Class::Large as usize];
            for &amount in &amounts {
                let mut best = u64::MAX;
                for (looked, id) in bins.from(amount.max(granularity)).enumerate() {
                    // A block of `best` + two pages or more holds only pieces no smaller than
                    // `best`, unless its segment's runs split it.
                    if self.blocks[id].size >= best.saturating_add(2 * granularity)
                        || looked == COVER_WALK
                    {
                        break;
                    }
                    let from = pieces.len();
                    self.pieces_of(id, granularity, &mut pieces);
                    let covering = pieces[from..].iter().map(|p| p.pages.size);
                    if let Some(size) = covering.filter(|&size| size >= amount).min() {
                        best = best.min(size);
                    }
                }
            }
        }
        pieces.sort_unstable_by_key(|p| p.lender);
        pieces.dedup_by_key(|p| p.lender);
        pieces
    }

    /// The smallest *fragment* of at least `part` bytes: a free block that is the tail of a
    /// page whose start holds a block, in a stitched large segment (a larger free block keeps
    /// its start for the requests that fit it in place). A new range maps the whole page first
    /// and starts its blocks at the tail: the page's start stays its lender's, who marks the
    /// tail a hole as it does lent pages, and who is not taken apart while the range lives. So a
    /// request that would use its last page only in part (`part` bytes of it) uses the tail
    /// instead, and needs a page less: a range made for a long-lived block otherwise leaves the
    /// rest of its last page unused for as long as the block lives, however many such blocks
    /// follow. Found through the streams' bins of large blocks, from `part` up to a page,
    /// [`COVER_WALK`] blocks each at most. A segment's first page is no fragment where it is
    /// another's.
    pub(super) fn fragment(&self, granularity: u64, part: u64) -> Option<Piece> {
        let mut best: Option<Piece> = None;
        for slot in &self.slots {
            let bins = &slot.bins[Class::Large as usize];
            // A fragment is smaller than a page: the walk stops at the first block that is not.
            let small = bins
                .from(part)
                .take(COVER_WALK)
                .take_while(|&id| self.blocks[id].size < granularity);
            for id in small {
                let b = &self.blocks[id];
                let s = &self.segments[b.segment];
                let page = b.ptr / granularity * granularity;
                let tail = page + granularity - b.ptr;
                let smaller = best.is_none_or(|f| tail < f.pages.size - f.skip);
                let fits = tail >= part && b.size == tail;
                if !s.stitched || b.ptr == page || page < s.base || !fits || !smaller {
                    continue;
                }
                // Runs are whole pages: the page lies in one. Where handles map in parts, only
                // a part of one page is a fragment.
                let Some((_, pages)) = s.pages(page, page + granularity).next() else {
                    continue;
                };
                if self
                    .phys
                    .part(pages.handle)
                    .is_some_and(|part| part > granularity)
                {
                    continue;
                }
                best = Some(Piece {
                    pages,
                    lender: Some((b.segment, page)),
                    block: id,
                    skip: b.ptr - page,
                    unit: granularity,
                });
            }
        }
        best
    }

    /// The granularity-aligned interior of free block `id`, split along its segment's runs, as
    /// pieces to lend (the whole parts of their handles in it), added to `out`; none where its
    /// segment is not stitched.
    fn pieces_of(&self, id: BlockId, granularity: u64, out: &mut Vec<Piece>) {
        let b = &self.blocks[id];
        let seg = b.segment;
        let s = &self.segments[seg];
        // Small segments' pages stay for small requests, as PyTorch keeps its small pool (their
        // blocks are in the small bins): lent to larger ranges, they left small requests to
        // create new ones.
        if !s.stitched {
            return;
        }
        let start = b.ptr.next_multiple_of(granularity);
        let end = (b.ptr + b.size) / granularity * granularity;
        if end <= start {
            return;
        }
        out.extend(s.pages(start, end).filter_map(|(at, pages)| {
            let whole = self.phys.whole_parts(pages)?;
            Some(Piece {
                pages: whole,
                lender: Some((seg, at + whole.offset - pages.offset)),
                block: id,
                skip: 0,
                unit: self.phys.part(pages.handle).unwrap_or(granularity),
            })
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::super::stitch::MAX_PIECES;
    use super::*;
    use crate::driver::PhysHandle;
    use crate::pool::ids::Id;

    const MIB: u64 = 1 << 20;

    /// Spare pieces first, then lendable ones, as `gather` chooses.
    fn choose(spare: &[Piece], lendable: &[Piece], need: u64) -> Vec<Piece> {
        let mut chosen = choose_spare(spare, need, MAX_PIECES);
        choose_lent(&mut chosen, lendable, need, MAX_PIECES);
        chosen
    }

    fn spare(handle: PhysHandle, offset: u64, size: u64) -> Piece {
        Piece {
            block: BlockId::NIL,
            pages: Pages {
                handle,
                offset,
                size,
            },
            lender: None,
            skip: 0,
            unit: 2 * MIB,
        }
    }

    fn lent(seg: u16, ptr: DevicePtr, size: u64) -> Piece {
        Piece {
            block: BlockId::NIL,
            pages: Pages {
                handle: 100 + u64::from(seg),
                offset: 0,
                size,
            },
            lender: Some((SegId::at(usize::from(seg)), ptr)),
            skip: 0,
            unit: 2 * MIB,
        }
    }

    #[test]
    fn spare_pages_first_then_the_best_single_lent_piece() {
        let lendable = [
            lent(1, 0x1000_0000, 64 * MIB),
            lent(2, 0x2000_0000, 8 * MIB),
            lent(3, 0x3000_0000, 16 * MIB),
        ];
        // 10 MiB: the 16 MiB piece alone, cut to 10 MiB; the 8 MiB one would need a second.
        let chosen = choose(&[], &lendable, 10 * MIB);
        assert_eq!(
            chosen,
            vec![Piece {
                pages: Pages {
                    size: 10 * MIB,
                    ..lendable[2].pages
                },
                ..lendable[2]
            }]
        );
        // Spare pages go first, whatever their size; the rest from the best lent piece.
        let chosen = choose(&[spare(7, 4 * MIB, 4 * MIB)], &lendable, 10 * MIB);
        assert_eq!(chosen[0], spare(7, 4 * MIB, 4 * MIB));
        assert_eq!(chosen[1].lender, Some((SegId::at(2), 0x2000_0000)));
        assert_eq!(chosen[1].pages.size, 6 * MIB);
        assert_eq!(chosen.len(), 2);
        // Nothing covers 100 MiB alone: the largest first, all of it (88 MiB).
        let chosen = choose(&[], &lendable, 100 * MIB);
        let sizes: Vec<u64> = chosen.iter().map(|p| p.pages.size).collect();
        assert_eq!(sizes, vec![64 * MIB, 16 * MIB, 8 * MIB]);
        assert!(choose(&[], &[], 2 * MIB).is_empty());
    }

    #[test]
    fn a_partly_covered_range_is_made_from_the_cache_only_where_it_matters() {
        let gib = 1 << 30;
        // A pool far larger than the requests below: only the request's own half counts.
        let pool = Some(64 * gib);
        // The seed's next warm-up: 8.22 GiB, all but 10 MiB cached; the driver has plenty.
        assert!(partial_pays(
            8_824_815_616,
            8_824_815_616 - 10 * MIB,
            15 * gib,
            pool
        ));
        // A 16 MiB request with 4 MiB cached and the driver roomy: create it whole instead.
        assert!(!partial_pays(16 * MIB, 4 * MIB, 15 * gib, pool));
        // The same with the driver short of 16 MiB: the cache helps.
        assert!(partial_pays(16 * MIB, 4 * MIB, 14 * MIB, pool));
        // Under 10 MiB a segment is 20 MiB: short of that, the cache helps.
        assert!(partial_pays(6 * MIB, 2 * MIB, 18 * MIB, pool));
        assert!(!partial_pays(6 * MIB, 2 * MIB, 20 * MIB, pool));
        // Nor where the driver cannot supply the rest.
        assert!(!partial_pays(5 * gib, 2 * MIB, 4 * gib, pool));
        // Half cached pays; less does not.
        assert!(partial_pays(32 * MIB, 16 * MIB, gib, pool));
        assert!(!partial_pays(32 * MIB, 14 * MIB, gib, pool));
        // The snapshot's 477 MiB request beside 340 MiB of free blocks.
        assert!(partial_pays(478 * MIB, 340 * MIB, 70 * gib, pool));
        // A request larger than the pool, its cache left over: half the pool cached pays, though it is a third
        // of the request (a 12 GiB load freed, then a 36 GiB warm-up); less than half does not.
        assert!(partial_pays(36 * gib, 12 * gib, 400 * gib, Some(13 * gib)));
        assert!(partial_pays(36 * gib, 6 * gib, 400 * gib, Some(12 * gib)));
        assert!(!partial_pays(
            36 * gib,
            6 * gib - MIB,
            400 * gib,
            Some(12 * gib)
        ));
        // A request no larger than the pool still needs half of itself cached.
        assert!(!partial_pays(
            12 * gib,
            6 * gib - MIB,
            400 * gib,
            Some(12 * gib)
        ));
        // Not where the cache is the rest of what a growing pool just created.
        assert!(!partial_pays(256 * MIB, 12 * MIB, 400 * gib, None));
    }

    #[test]
    fn a_stitch_takes_at_most_max_pieces() {
        let lendable: Vec<Piece> = (0..100)
            .map(|i| lent(i, u64::from(i) << 32, 2 * MIB))
            .collect();
        let chosen = choose(&[], &lendable, 1 << 30);
        assert_eq!(chosen.len(), MAX_PIECES);
        assert_eq!(chosen.iter().map(|p| p.pages.size).sum::<u64>(), 128 * MIB);
    }
}
