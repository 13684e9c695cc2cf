//! Where a device's reserved memory lies, by 2 MiB page: what live blocks hold, and what the
//! cache holds by how it can be used again. One accounting for every policy (the pool's
//! [`crate::Pool::layout`], and the PyTorch-policy baseline of the command), so that a replay
//! can say what fragmentation is made of.
//!
//! A free byte in a page that also holds a live block's bytes can serve only a request that
//! fits beside that block: no mapping moves part of a page, and no memory goes back to the
//! driver while the block lives. The same holds for a page another segment maps in part (a
//! stitched range that starts in the free tail of a page, or the page's start, kept by the
//! segment that lent the tail): its free bytes are counted beside live ones. A whole free page
//! of a segment in use can be mapped into a new range where the driver has the virtual-memory
//! API (stitching); classic segments reach it only through a request that fits the free block
//! around it. A segment with no live block, and physical pages mapped in no range, are reusable
//! whole or go back to the driver.

/// The page the accounting works in: CUDA's allocation granularity, and the unit of a mapping.
pub const PAGE: u64 = 2 << 20;

/// One piece of a segment, in address order from its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// A block handed out, of `size` bytes, asked for as `requested`.
    Live { size: u64, requested: u64 },
    /// Cached bytes (free, or released and waiting for other streams' work).
    Free(u64),
    /// Bytes whose pages another segment owns (lent pages, counted there).
    Elsewhere(u64),
}

/// Where a device's reserved memory lies; the fields add up to the reserved bytes where no
/// driver call is in flight and no range is kept for a retry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// Bytes live blocks were asked for.
    pub requested: u64,
    /// Bytes live blocks hold beyond that: rounding up to 512 bytes, and rests too small to keep
    /// apart handed out with the block (1 MiB or less after a large request, as PyTorch does).
    pub rounding: u64,
    /// Cached bytes in pages that also hold a live block's bytes, or bytes another segment
    /// maps (a fragment's page: its tail lent to a range that starts there, or the lead of such
    /// a range). No such byte can be mapped elsewhere while the page is shared.
    pub beside_live: u64,
    /// Cached whole pages of segments that hold a live block.
    pub free_pages: u64,
    /// Cached bytes of segments that hold no live block, and physical pages mapped in no range.
    pub idle: u64,
}

impl Layout {
    /// Add a segment starting on a page boundary, given as its pieces in address order.
    pub fn add_segment(&mut self, pieces: impl IntoIterator<Item = Piece>) {
        // The page being summed: whether it holds live bytes or another segment's, and its
        // free bytes.
        let (mut page, mut live, mut free) = (0u64, false, 0u64);
        // The segment's free bytes beside live ones, in whole free pages, and whether any block
        // in it is live.
        let (mut beside, mut whole, mut any_live) = (0u64, 0u64, false);
        // Whole pages inside one piece, counted without a step per page: free ones are whole
        // free pages, the others hold no free byte.
        let mut bulk = 0u64;
        let mut flush = |live: &mut bool, free: &mut u64| {
            if *live {
                beside += *free;
            } else {
                whole += *free;
            }
            (*live, *free) = (false, 0);
        };
        let mut offset = 0u64;
        for piece in pieces {
            let len = match piece {
                Piece::Live { size, requested } => {
                    self.requested += requested;
                    self.rounding += size.saturating_sub(requested);
                    any_live = true;
                    size
                }
                Piece::Free(len) | Piece::Elsewhere(len) => len,
            };
            let end = offset + len;
            while offset < end {
                if offset / PAGE != page {
                    flush(&mut live, &mut free);
                    page = offset / PAGE;
                }
                // At a page's start (nothing of it counted yet), the piece's whole pages but the
                // last at once; the last goes through the step below, as any page.
                if offset % PAGE == 0 && end - offset >= 2 * PAGE {
                    let skipped = ((end - offset) / PAGE - 1) * PAGE;
                    if matches!(piece, Piece::Free(_)) {
                        bulk += skipped;
                    }
                    offset += skipped;
                    page = offset / PAGE;
                }
                let stop = end.min((page + 1) * PAGE);
                match piece {
                    // A page shared with another segment (less than the whole page lent) is
                    // no whole free page, whatever its free bytes: they are beside that use.
                    Piece::Live { .. } | Piece::Elsewhere(_) => live = true,
                    Piece::Free(_) => free += stop - offset,
                }
                offset = stop;
            }
        }
        flush(&mut live, &mut free);
        let whole = whole + bulk;
        if any_live {
            self.beside_live += beside;
            self.free_pages += whole;
        } else {
            self.idle += beside + whole;
        }
    }

    /// Add cached memory that belongs to no segment (physical pages mapped in no range).
    pub fn add_idle(&mut self, bytes: u64) {
        self.idle += bytes;
    }

    /// Add another layout of the same device (another shard's).
    pub fn add(&mut self, other: &Layout) {
        self.requested += other.requested;
        self.rounding += other.rounding;
        self.beside_live += other.beside_live;
        self.free_pages += other.free_pages;
        self.idle += other.idle;
    }

    /// Every byte accounted for.
    pub fn total(&self) -> u64 {
        self.requested + self.rounding + self.beside_live + self.free_pages + self.idle
    }

    /// The cached bytes.
    pub fn cached(&self) -> u64 {
        self.beside_live + self.free_pages + self.idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The accounting one page at a time, as the definition reads: each page's free bytes are
    /// beside live ones if anything else lies in the page, whole otherwise.
    fn by_page(pieces: &[Piece]) -> Layout {
        let mut l = Layout::default();
        let mut pages: Vec<(bool, u64)> = Vec::new();
        let mut offset = 0u64;
        let mut any_live = false;
        for &piece in pieces {
            let len = match piece {
                Piece::Live { size, requested } => {
                    l.requested += requested;
                    l.rounding += size - requested;
                    any_live = true;
                    size
                }
                Piece::Free(len) | Piece::Elsewhere(len) => len,
            };
            for byte_page in offset / PAGE..(offset + len).div_ceil(PAGE) {
                let (start, end) = (byte_page * PAGE, (byte_page + 1) * PAGE);
                let part = (offset + len).min(end) - offset.max(start);
                if pages.len() <= byte_page as usize {
                    pages.resize(byte_page as usize + 1, (false, 0));
                }
                match piece {
                    Piece::Free(_) => pages[byte_page as usize].1 += part,
                    _ => pages[byte_page as usize].0 = true,
                }
            }
            offset += len;
        }
        let (mut beside, mut whole) = (0, 0);
        for (used, free) in pages {
            if used {
                beside += free;
            } else {
                whole += free;
            }
        }
        if any_live {
            l.beside_live = beside;
            l.free_pages = whole;
        } else {
            l.idle = beside + whole;
        }
        l
    }

    #[test]
    fn whole_pages_counted_at_once_match_the_count_page_by_page() {
        // Pieces of 512 bytes to 40 MiB in 512-byte steps, from a fixed pseudo-random sequence.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for _ in 0..2000 {
            let pieces: Vec<Piece> = (0..1 + next(12))
                .map(|_| {
                    let most = if next(2) == 0 { 8192 } else { 81920 };
                    let len = 512 * (1 + next(most));
                    match next(3) {
                        0 => Piece::Live {
                            size: len,
                            requested: len - 512 * next(len / 512),
                        },
                        1 => Piece::Free(len),
                        _ => Piece::Elsewhere(len),
                    }
                })
                .collect();
            let mut l = Layout::default();
            l.add_segment(pieces.iter().copied());
            assert_eq!(l, by_page(&pieces), "{pieces:?}");
        }
    }

    #[test]
    fn free_bytes_are_told_apart_by_the_pages_they_share() {
        let mut l = Layout::default();
        // [live 3 MiB, asked 2.5][free 6 MiB][live 1 MiB][free 2 MiB]: pages 0-1 hold the first
        // block and 1 MiB free; pages 2-3 are free; page 4 holds 1 MiB free then the second
        // block; page 5 is free.
        l.add_segment([
            Piece::Live {
                size: 3 * MIB,
                requested: 5 * MIB / 2,
            },
            Piece::Free(6 * MIB),
            Piece::Live {
                size: MIB,
                requested: MIB,
            },
            Piece::Free(2 * MIB),
        ]);
        assert_eq!(
            l,
            Layout {
                requested: 7 * MIB / 2,
                rounding: MIB / 2,
                beside_live: 2 * MIB,
                free_pages: 6 * MIB,
                idle: 0,
            }
        );
        assert_eq!(l.total(), 12 * MIB);
        assert_eq!(l.cached(), 8 * MIB);
    }

    #[test]
    fn a_segment_with_no_live_block_is_idle_and_lent_pages_count_where_they_are_owned() {
        let mut l = Layout::default();
        l.add_segment([
            Piece::Free(3 * MIB),
            Piece::Elsewhere(4 * MIB),
            Piece::Free(MIB),
        ]);
        l.add_idle(2 * MIB);
        assert_eq!(
            l,
            Layout {
                idle: 6 * MIB,
                ..Layout::default()
            }
        );
        // A lent run beside a live block: the block's page is shared with no free byte.
        let mut l = Layout::default();
        l.add_segment([
            Piece::Live {
                size: 2 * MIB,
                requested: 2 * MIB,
            },
            Piece::Elsewhere(2 * MIB),
            Piece::Free(MIB),
        ]);
        assert_eq!((l.beside_live, l.free_pages, l.total()), (0, MIB, 3 * MIB));
    }

    #[test]
    fn free_bytes_of_a_page_another_segment_maps_in_part_are_beside_that_use() {
        // [live 2 MiB][free 1 MiB][1 MiB lent to a range that starts there][free 2 MiB]: page 1
        // is shared with the range, so its free 1 MiB cannot be mapped elsewhere; page 2 can.
        let mut l = Layout::default();
        l.add_segment([
            Piece::Live {
                size: 2 * MIB,
                requested: 2 * MIB,
            },
            Piece::Free(MIB),
            Piece::Elsewhere(MIB),
            Piece::Free(2 * MIB),
        ]);
        assert_eq!(
            (l.beside_live, l.free_pages, l.idle, l.total()),
            (MIB, 2 * MIB, 0, 5 * MIB)
        );
        // The same with no live block: the segment is idle, whatever its pages share.
        let mut l = Layout::default();
        l.add_segment([
            Piece::Free(MIB),
            Piece::Elsewhere(MIB),
            Piece::Free(2 * MIB),
        ]);
        assert_eq!((l.beside_live, l.free_pages, l.idle), (0, 0, 3 * MIB));
    }
}
