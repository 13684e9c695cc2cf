//! Building a segment from cached physical memory and new memory (the virtual-memory mode, the
//! default where the driver and device have the API); taking segments apart and returning their
//! memory is `unstitch.rs`.
//!
//! A segment is a reserved address range tiled by *runs*: each run is one `cuMemMap` of a piece
//! of a physical handle, at a granularity offset into it. On a miss, a new segment is built from
//! pages the cache already holds before any memory is created:
//!
//! 1. *spare* pages, owned by no range (see `phys.rs`);
//! 2. the granularity-aligned interior of any free block of a large segment (in use or idle),
//!    split along that segment's runs. Those pages are *lent*: the same piece of the handle is
//!    mapped a second time, into the new range, and the lender's books mark the range a *hole*
//!    (never handed out). Nothing is unmapped: CUDA allows one handle mapped in several places,
//!    and `cuMemUnmap` takes whole mappings only. Small segments' pages are not lent: they stay
//!    for small requests, as PyTorch keeps its small pool (lent to larger ranges, they left the
//!    small requests after them to create new segments: up to 9 more memory-creating calls on a
//!    real training snapshot).
//!
//! The piece chosen is the smallest single one that covers what is needed, else the largest
//! pieces first, at most [`MAX_PIECES`] of them: a stitch costs one `cuMemMap` per piece (where
//! the request would otherwise fail for want of memory, up to [`LAST_RESORT_PIECES`]). A range
//! made from the cache is only as large as the request's pages. Where the cache covers the
//! request only in part, it is used only when that pays ([`partial_pays`]): half of it or more is
//! cached (half of the pool's reservation, for a request larger than that, where the cache is
//! what an earlier phase left), or the driver lacks a segment of the request's size;
//! otherwise a segment is created whole, as PyTorch would, and the cache stays for the requests
//! that reuse it. The shortfall is created as one handle sized like PyTorch's segment for it,
//! with headroom for the requests after it (`headroom.rs`), so that a pool growing step by step
//! does not call the driver at every step (one `cuMemCreate` per growth, through
//! the growth policy shared with classic segments: a cap, release before growing, and release
//! everything and retry once on out-of-memory).
//!
//! Lent pages stay holes in their lender until the range that borrowed them is taken apart
//! (`unstitch.rs`), which fills the holes again.
//!
//! A range may also start in a *fragment* ([`DevicePool::fragment`]): the free tail of a page
//! whose start holds another block. The whole page is mapped as the range's first run, its
//! blocks start at the tail (the segment's `lead` bytes before them are the lender's), and the
//! lender marks the tail a hole. A request whose last page it would fill only in part takes a
//! fragment that holds that part where the cache covers the rest, so its range needs a page
//! less: the page beside each long-lived block is used by the next one, as best fit in one
//! address space would place it, where otherwise every range made for one leaves the rest of
//! its last page unused for as long as the block lives (on a trace of long-lived blocks among
//! short-lived activations, 155 MiB at the peak beside live blocks; 72 MiB with fragments).
//! The lender is not taken apart while its borrower lives: the page's start is its own.
//!
//! A failed driver call leaves the books exact: the cache's pieces go back, a created handle
//! becomes spare, and a range that could not be unmapped or freed is kept (with the handles
//! mapped in it, which are not released meanwhile) and retried by `free_reusable`.

use super::addresses;
use super::phys::Pages;
use super::{Backing, BlockId, Context, DevicePool, Fresh, Grow, SegId, State};
use crate::driver::DevicePtr;
use crate::error::{Error, Result};
use crate::pool::size::{
    block_size, class_of, human, segment_size, Class, SEGMENT_ROUND, SMALL_MAX,
};

/// One mapping in a stitched segment: `pages` at `offset` from its base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) offset: u64,
    pub(super) pages: Pages,
    /// The segment and address where the same pages are mapped as a hole, if they were lent.
    pub(super) lender: Option<(SegId, DevicePtr)>,
}

/// Whether a device pool stitches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VmmMode {
    /// Not asked yet (decided at the first growth, which has the driver at hand).
    Undecided,
    /// Classic segments from `cuMemAlloc`.
    Off,
    /// Stitched segments, with this allocation granularity.
    On(u64),
}

/// The most pieces of cached memory one new segment is stitched from. Each costs a `cuMemMap`
/// (19 µs on an H200), made without the device's lock (`growing.rs`), so the bound weighs the
/// requesting thread's time against memory: the 784 MiB request of transformers issue #37436,
/// beside 748 MiB cached in 20 MiB segments that each keep a live block, reserves 1,226 MiB at
/// the trace's peak with 32 pieces at most and 1,030 MiB with 64 (the smallest device that runs
/// the trace: 1.22 GiB, and 0.97).
const MAX_PIECES: usize = 64;

/// The most pieces a segment is stitched from when the request would otherwise fail: after the
/// growth policy returned every idle range and the driver still could not create what
/// [`MAX_PIECES`] pieces left lacking, the cache is searched again with this bound (a last try
/// under the device's lock, about 19 ms of `cuMemMap` calls on an H200 at most). A cache that
/// gave back its idle ranges keeps its memory in the handles that live blocks still use, as
/// spare pages and free blocks beside those blocks, often in more than 64 pieces: a model's next
/// warm-up over the blocks that outlived the last one failed with 12.9 GiB so held and 37.5 GiB
/// free on the device for 49.3 GiB, where PyTorch's policy, returning its idle segments, served
/// it.
const LAST_RESORT_PIECES: usize = 1024;

/// How many free blocks the search for the smallest piece that covers an amount looks at, at
/// most, and the search for the largest pieces past the first [`MAX_PIECES`] (see
/// `DevicePool::lendable`).
const COVER_WALK: usize = 64;

/// A piece of cached memory for a new segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pages: Pages,
    /// Lent by this segment, where the pages are mapped at this address; `None`: spare pages.
    lender: Option<(SegId, DevicePtr)>,
    /// For a lent piece, the free block it was found in, or one before it in its segment (a
    /// block cut before it for another piece): where the search for it starts.
    block: BlockId,
    /// For a fragment (see [`DevicePool::fragment`]): the bytes of its page before the free
    /// tail, the lender's, which the new range maps but never hands out; 0 for whole pages.
    skip: u64,
}

/// Choose spare pieces for `need` bytes, largest first, at most `most`; the last piece taken
/// is cut to what is still needed (from its start). The rest comes from [`choose_lent`].
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
/// piece taken is cut to what is still needed (from its start).
pub(super) fn choose_lent(chosen: &mut Vec<Piece>, lendable: &[Piece], need: u64, most: usize) {
    let mut left = need - chosen.iter().map(|p| p.pages.size).sum::<u64>();
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

/// The segments that lend `pieces`.
fn lenders(pieces: &[Piece]) -> impl Iterator<Item = SegId> + '_ {
    pieces.iter().filter_map(|p| p.lender.map(|(seg, _)| seg))
}

/// Put the pieces of `all` in the order of `pages`, the same pages as its first pieces (as a
/// range made without the lock mapped them).
fn arrange(all: &mut [Piece], pages: &[Pages]) {
    for (at, want) in pages.iter().enumerate() {
        if let Some(found) = all[at..].iter().position(|p| p.pages == *want) {
            all.swap(at, at + found);
        }
    }
}

/// Add `piece` to `chosen`, cut to `left` bytes, and count it off `left`.
fn take(piece: &Piece, left: &mut u64, chosen: &mut Vec<Piece>) {
    let size = piece.pages.size.min(*left);
    chosen.push(Piece {
        pages: Pages {
            size,
            ..piece.pages
        },
        ..*piece
    });
    *left -= size;
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
    /// Whether this pool stitches; asks the driver once.
    pub(super) fn stitching(&mut self, cx: &Context<'_>) -> bool {
        if self.vmm == VmmMode::Undecided {
            // Not asked with stitching off: the CUDA driver tries a mapping to answer.
            self.vmm = match self
                .config
                .vmm
                .then(|| cx.driver.vmm_granularity(self.device))
            {
                None => VmmMode::Off,
                Some(Some(granularity)) => VmmMode::On(granularity),
                Some(None) => {
                    self.log(format_args!(
                        "the driver or device lacks the virtual-memory API, or maps no memory \
                         at an offset into an allocation: using classic segments"
                    ));
                    VmmMode::Off
                }
            };
        }
        matches!(self.vmm, VmmMode::On(_))
    }

    /// [`DevicePool::stitch`] from at most [`MAX_PIECES`] cached pieces; where that fails for
    /// want of memory with memory still cached (the growth policy returned every idle range
    /// first), once more from at most [`LAST_RESORT_PIECES`], made under the device's lock, and
    /// counted as one out-of-memory only if that fails too.
    pub(super) fn stitch_growth(
        &mut self,
        cx: &Context<'_>,
        (size, requested): (u64, u64),
        mode: Grow,
        driver_free: u64,
    ) -> Result<(DevicePtr, Vec<Run>, u64)> {
        let ooms = self.stats.ooms;
        let first = self.stitch(cx, (size, requested), mode, driver_free, MAX_PIECES);
        let retry = match &first {
            Err(e) => e.is_out_of_memory() && mode == Grow::MayRelease && self.stats.reusable() > 0,
            Ok(_) => false,
        };
        if !retry {
            return first;
        }
        let (free, _) = self.driver_info(cx)?;
        let defer = std::mem::replace(&mut self.defer, false);
        let again = self.stitch(cx, (size, requested), mode, free, LAST_RESORT_PIECES);
        self.defer = defer;
        self.stats.ooms = ooms + u64::from(again.as_ref().is_err_and(Error::is_out_of_memory));
        if again.is_ok() {
            self.log(format_args!(
                "out of memory with at most {MAX_PIECES} cached pieces: made from up to \
                 {LAST_RESORT_PIECES} instead"
            ));
        }
        again
    }

    /// A new range of `size` bytes (rounded up to the granularity), mapped and accessible:
    /// cached pages first, in at most `most` pieces (unless `mode` keeps the cache as it is),
    /// then one new handle for the shortfall. Returns its address, its runs and its lead (the
    /// bytes of its first page that a fragment's lender keeps, see [`DevicePool::fragment`]),
    /// the memory already counted as reserved.
    pub(super) fn stitch(
        &mut self,
        cx: &Context<'_>,
        (size, requested): (u64, u64),
        mode: Grow,
        driver_free: u64,
        most: usize,
    ) -> Result<(DevicePtr, Vec<Run>, u64)> {
        let VmmMode::On(granularity) = self.vmm else {
            return Err(Error::internal("stitching without the virtual-memory API"));
        };
        // Built from the cache, a range needs only the request's pages; a segment's worth of
        // memory (20 MiB for a request under 10 MiB) is created only where memory is created.
        let segment = size.next_multiple_of(granularity);
        let size = match block_size(requested) {
            Ok(block) => block.next_multiple_of(granularity).min(size),
            Err(_) => size,
        }
        .next_multiple_of(granularity);
        let pieces = if mode == Grow::MayRelease {
            self.gather(cx, (size, requested), granularity, driver_free, most)?
        } else {
            Vec::new()
        };
        let have: u64 = pieces.iter().map(|p| p.pages.size).sum();
        // A fragment is a page already partly in use, not cache taken from other requests: the
        // headroom counts the other pieces only. And a range the cache covers only with a
        // fragment's help does not end the pool's growth: its headroom still answers the
        // requests after it (a training snapshot's growth went on in 26 MiB creations without
        // it: 865 memory-creating calls instead of 463).
        let lead = pieces.first().map_or(0, |p| p.skip);
        let fragment = usize::from(lead > 0);
        let (cached, count) = (
            have - fragment as u64 * granularity,
            pieces.len() - fragment,
        );
        if have >= size {
            self.headroom.met_from_cache(cached, count, lead == 0);
        } else if cached > 0 {
            self.headroom.took_cache(cached, size - have);
        }
        let mut all: Vec<Piece> = pieces.clone();
        // The lenders of pieces in flight are not taken apart to make room meanwhile.
        self.lending.clear();
        self.lending.extend(lenders(&pieces));
        self.mapping.clear();
        self.mapping.extend(pieces.iter().map(|p| p.pages));
        let made = self.make_range(cx, (size, segment), requested, mode, driver_free, &mut all);
        self.lending.clear();
        self.mapping.clear();
        match made {
            Ok(base) => {
                let mut offset = 0;
                let runs = all
                    .iter()
                    .map(|p| {
                        offset += p.pages.size;
                        Run {
                            offset: offset - p.pages.size,
                            pages: p.pages,
                            lender: p.lender,
                        }
                    })
                    .collect();
                self.log(format_args!(
                    "stitched a {} segment for a request of {} from {} cached pieces ({}{}) and \
                     {} created",
                    human(offset),
                    human(requested),
                    pieces.len(),
                    human(have),
                    if lead > 0 {
                        format!(", starting {} into a page beside a live block", human(lead))
                    } else {
                        String::new()
                    },
                    human(offset - have)
                ));
                Ok((base, runs, lead))
            }
            Err(err) => {
                self.give_back(&all);
                Err(err)
            }
        }
    }

    /// Create the shortfall of `all` for `size` bytes (added to them, at most `segment` bytes)
    /// and map them into a new range.
    fn make_range(
        &mut self,
        cx: &Context<'_>,
        (size, segment): (u64, u64),
        requested: u64,
        mode: Grow,
        driver_free: u64,
        all: &mut Vec<Piece>,
    ) -> Result<DevicePtr> {
        let have: u64 = all.iter().map(|p| p.pages.size).sum();
        // Free blocks' pages may still be in use by work queued before their release (spare
        // pages came from ranges taken apart, settled then): the device's work is waited for
        // before the range is handed out. In a deferring pass, without the lock, with the calls
        // that make the range (`growing.rs`), where they are deferred.
        let remap = "waiting for the device before remapping cached memory";
        if !self.defer {
            self.settle(cx, lenders(all), remap)?;
        }
        if have < size {
            // The shortfall is created as PyTorch would size a segment for it (a 20 MiB handle
            // for under 10 MiB), and at least the pool's headroom, so that growth keeps
            // pace with PyTorch's in driver calls; the excess stays free at the end of the new
            // range. Where that much is not to be had, the bare shortfall.
            let need = size - have;
            let granularity = match self.vmm {
                VmmMode::On(g) => g,
                _ => SEGMENT_ROUND,
            };
            // Sized by the bytes the request still lacks, not by `need`: rounded up to the
            // granularity, a 9 MiB request's 10 MiB would get a segment of its own where PyTorch
            // gives it a shared 20 MiB one. And sized as the request's class would size it: a
            // large request lacking 1 MiB or less is still a large one (the small class's 2 MiB
            // handle left each 9 MiB request with 8 MiB cached creating again: 48 calls on a
            // snapshot where PyTorch's policy makes 43); `segment` keeps a small request's 2 MiB.
            let block = block_size(requested);
            let lacking = block
                .as_ref()
                .map_or(need, |block| block.saturating_sub(have))
                .clamp(1, need);
            // Headroom for large requests only: a small request's range is a small segment,
            // whose pages serve small requests alone (a 1 MiB request after a 476 MiB one made
            // a 114 MiB small segment, and the next large request created 122 MiB beside it: a
            // real snapshot's peak 6% higher). And none for a warm-up, which asks for exactly
            // its shortfall.
            let large = block.is_ok_and(|block| class_of(block) == Class::Large);
            let headroom = if mode == Grow::MayRelease && large {
                self.headroom.bytes(
                    self.stats.reserved_bytes,
                    self.limit.map_or(driver_free, |limit| {
                        driver_free.min(limit.saturating_sub(self.device_reserved(cx)))
                    }),
                    lacking,
                )
            } else {
                0
            };
            let sized = segment_size(lacking.max(SMALL_MAX + 1))
                .min(segment)
                .max(need)
                .max(headroom)
                .next_multiple_of(granularity);
            // The range is mapped without the lock too, where the creation is (`growing.rs`).
            let backing = Backing::Range;
            let mut created = self.obtain(cx, sized, requested, mode, driver_free, backing);
            let mut made = sized;
            if sized > need && created.as_ref().is_err_and(Error::is_out_of_memory) {
                made = need;
                created = self.obtain(cx, need, requested, mode, driver_free, backing);
            }
            let (handle, mapped_at) = match created? {
                Fresh::Handle(handle) => (handle, None),
                Fresh::Range(handle, base) => (handle, Some(base)),
                Fresh::Segment(_) | Fresh::Mapped(_) | Fresh::Waited => {
                    unreachable!("a handle asked for")
                }
            };
            self.headroom.created(made, need);
            self.phys.add(handle, made);
            self.stats.add_reserved(made, 1);
            all.push(Piece {
                pages: Pages {
                    handle,
                    offset: 0,
                    size: made,
                },
                lender: None,
                block: BlockId::NIL,
                skip: 0,
            });
            if let Some(base) = mapped_at {
                // Mapped and accessible already, with the cached pages before it.
                arrange(all, &self.mapping);
                return Ok(base);
            }
        } else if let Some(p) = self.take_prepared(cx, Backing::Mapping, 0) {
            // Cached pages alone, mapped without the lock (`growing.rs`).
            return match p.made {
                Ok(Fresh::Mapped(base)) => {
                    arrange(all, &self.mapping);
                    Ok(base)
                }
                Ok(_) => Err(Error::internal("a mapping prepared as other memory")),
                Err(e) => Err(Error::driver(
                    "mapping cached memory into a new segment",
                    &e,
                )),
            };
        }
        self.settle(cx, lenders(all), remap)?;
        let size = all.iter().map(|p| p.pages.size).sum();
        self.map_pieces(cx, size, all)
    }

    /// Take cached pieces for up to `size` bytes out of the books, at most `most` of them: spare
    /// pages, and aligned interiors of free blocks lent as holes. Work queued before those
    /// blocks were released may still use them: the range is not handed out before the device's
    /// work is waited for (`make_range`), unless their segments are settled (`streams.rs`).
    fn gather(
        &mut self,
        cx: &Context<'_>,
        (size, requested): (u64, u64),
        granularity: u64,
        driver_free: u64,
        most: usize,
    ) -> Result<Vec<Piece>> {
        // A request whose last page it would use only in part starts in a fragment where one
        // holds that part and the cache holds the rest: its range needs a page less (see
        // [`DevicePool::fragment`]). Where memory is created anyway, a segment's worth of it,
        // the page saved would be spare beside it: no fragment then.
        let fragment = match block_size(requested) {
            Ok(block) if class_of(block) == Class::Large && block < size => {
                let part = block - (size - granularity);
                (part < granularity)
                    .then(|| self.fragment(granularity, part))
                    .flatten()
            }
            _ => None,
        };
        let mut chosen = Vec::new();
        if let Some(fragment) = fragment {
            chosen = self.choose(granularity, size - granularity, most - 1);
            if chosen.iter().map(|p| p.pages.size).sum::<u64>() + granularity >= size {
                chosen.insert(0, fragment);
            } else {
                chosen.clear();
            }
        }
        if chosen.is_empty() {
            chosen = self.choose(granularity, size, most);
            let have: u64 = chosen.iter().map(|p| p.pages.size).sum();
            if have < size && !partial_pays(size, have, driver_free, self.leftover(&chosen)) {
                return Ok(Vec::new());
            }
        }
        let have: u64 = chosen.iter().map(|p| p.pages.size).sum();
        // A range of cached pages alone is mapped without the lock (`growing.rs`): in the first
        // pass, decided before the books change, so that the second decides the same.
        if have >= size && self.defer {
            self.lending.clear();
            self.lending.extend(lenders(&chosen));
            let deferred = self.defer_mapping(cx, chosen.iter().map(|p| p.pages), driver_free);
            self.lending.clear();
            if deferred? {
                return Err(Error::internal(
                    "mapping deferred until the device's lock is free",
                ));
            }
        }
        for piece in &chosen {
            match piece.lender {
                None => self.phys.take(piece.pages),
                Some((seg, ptr)) => self.carve_hole(
                    seg,
                    piece.block,
                    ptr + piece.skip,
                    piece.pages.size - piece.skip,
                ),
            }
        }
        Ok(chosen)
    }

    /// Cached pieces for up to `size` bytes, at most `most`: spare pages, then lendable pieces
    /// (the books unchanged).
    fn choose(&self, granularity: u64, size: u64, most: usize) -> Vec<Piece> {
        let spare: Vec<Piece> = self
            .phys
            .spare_pieces()
            .into_iter()
            .map(|pages| Piece {
                pages,
                lender: None,
                block: BlockId::NIL,
                skip: 0,
            })
            .collect();
        let mut chosen = choose_spare(&spare, size, most);
        let left = size - chosen.iter().map(|p| p.pages.size).sum::<u64>();
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
    fn leftover(&self, pieces: &[Piece]) -> Option<u64> {
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
    /// follow. Found through the streams' bins of large blocks, from `part` up, [`COVER_WALK`]
    /// blocks each at most. A segment's first page is no fragment where it is another's.
    fn fragment(&self, granularity: u64, part: u64) -> Option<Piece> {
        let mut best: Option<Piece> = None;
        for slot in &self.slots {
            let bins = &slot.bins[Class::Large as usize];
            for id in bins.from(part).take(COVER_WALK) {
                let b = &self.blocks[id];
                let s = &self.segments[b.segment];
                let page = b.ptr / granularity * granularity;
                let tail = page + granularity - b.ptr;
                let smaller = best.is_none_or(|f| tail < f.pages.size - f.skip);
                let fits = tail >= part && b.size == tail;
                if !s.stitched || b.ptr == page || page < s.base || !fits || !smaller {
                    continue;
                }
                let (mapped, _) = s.mapped();
                let at = s
                    .runs
                    .partition_point(|r| mapped + r.offset + r.pages.size <= page);
                let r = &s.runs[at];
                best = Some(Piece {
                    pages: Pages {
                        handle: r.pages.handle,
                        offset: r.pages.offset + (page - mapped - r.offset),
                        size: granularity,
                    },
                    lender: Some((b.segment, page)),
                    block: id,
                    skip: b.ptr - page,
                });
            }
        }
        best
    }

    /// The granularity-aligned interior of free block `id`, split along its segment's runs, as
    /// pieces to lend, added to `out`; none where its segment is not stitched.
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
        let (mapped, _) = s.mapped();
        let first = s
            .runs
            .partition_point(|r| mapped + r.offset + r.pages.size <= start);
        for r in &s.runs[first..] {
            let (run_start, run_end) = (mapped + r.offset, mapped + r.offset + r.pages.size);
            if run_start >= end {
                break;
            }
            let (from, to) = (start.max(run_start), end.min(run_end));
            out.push(Piece {
                pages: Pages {
                    handle: r.pages.handle,
                    offset: r.pages.offset + (from - run_start),
                    size: to - from,
                },
                lender: Some((seg, from)),
                block: id,
                skip: 0,
            });
        }
    }

    /// Put pieces taken for a segment that was not made back where they came from.
    fn give_back(&mut self, pieces: &[Piece]) {
        for piece in pieces {
            match piece.lender {
                None => self.phys.give(piece.pages),
                Some((seg, ptr)) => {
                    self.fill_hole(seg, ptr + piece.skip, piece.pages.size - piece.skip)
                }
            }
        }
    }

    /// Take an address range of `size` bytes from the address chunks (reserving a new chunk
    /// where none has room) and map `pieces` back to back into it, with read-write access. On
    /// failure what was done is undone, or kept to retry if undoing fails.
    fn map_pieces(&mut self, cx: &Context<'_>, size: u64, pieces: &[Piece]) -> Result<DevicePtr> {
        let device = self.device;
        let base = self.take_addresses(cx, size)?;
        let mut mapped = 0;
        let mut result = Ok(());
        for p in pieces {
            let pages = p.pages;
            if let Err(e) = cx.driver.vmm_map(
                device,
                base + mapped,
                pages.size,
                pages.handle,
                pages.offset,
            ) {
                result = Err(Error::driver(
                    "mapping cached memory into a new segment",
                    &e,
                ));
                break;
            }
            mapped += pages.size;
        }
        if result.is_ok() {
            result = cx
                .driver
                .vmm_set_access(device, base, size)
                .map_err(|e| Error::driver("setting access to a new segment", &e));
        }
        if let Err(err) = result {
            let handles = pieces.iter().map(|p| p.pages.handle).collect();
            self.abandon_range(cx, base, size, mapped, handles);
            return Err(err);
        }
        Ok(base)
    }

    /// An address range of `size` bytes from the chunks; a new chunk of at least
    /// [`addresses::CHUNK`] bytes reserved where none has room.
    pub(super) fn take_addresses(&mut self, cx: &Context<'_>, size: u64) -> Result<DevicePtr> {
        if let Some(ptr) = self.addresses.take(size) {
            return Ok(ptr);
        }
        let chunk = size.max(addresses::CHUNK);
        let base = cx.driver.vmm_reserve(self.device, chunk).map_err(|e| {
            Error::driver(&format!("reserving {} of address space", human(chunk)), &e)
        })?;
        self.addresses.add_chunk(base, chunk);
        Ok(self.addresses.take(size).expect("a new chunk has room"))
    }

    /// Mark `[ptr, ptr + size)` of `seg`, inside one free block, a hole: its pages are lent.
    /// `hint` is that block or one before it in `seg` (the search starts there).
    fn carve_hole(&mut self, seg: SegId, hint: BlockId, ptr: DevicePtr, size: u64) {
        let (slot, class) = {
            let s = &self.segments[seg];
            (s.slot, s.class)
        };
        let id = self.block_from(seg, hint, ptr);
        debug_assert_eq!(self.blocks[id].state, State::Free);
        if self.segments[seg].idle_at.is_some() {
            // With a hole it is no longer one free block: not idle any more.
            self.unmark_idle(seg);
        }
        // Split the free block into [left free][hole][right free].
        self.bin_remove(slot, class, id);
        let (start, end) = (ptr, ptr + size);
        let (bptr, bsize) = (self.blocks[id].ptr, self.blocks[id].size);
        debug_assert!(bptr <= start && end <= bptr + bsize);
        let mut hole = id;
        if bptr < start {
            self.blocks[id].size = start - bptr;
            self.bin_insert(slot, class, id);
            hole = self.new_block_after(id, start, size, State::Hole);
        } else {
            self.blocks[id].state = State::Hole;
            self.blocks[id].size = size;
        }
        self.holes.insert(start, hole);
        if end < bptr + bsize {
            let right = self.new_block_after(hole, end, bptr + bsize - end, State::Free);
            self.bin_insert(slot, class, right);
        }
    }

    /// The block of `seg` that contains `ptr`, found walking from its first block (the
    /// invariant check's way: it trusts no index).
    pub(super) fn block_at(&self, seg: SegId, ptr: DevicePtr) -> BlockId {
        self.block_from(seg, self.segments[seg].first, ptr)
    }

    /// The block of `seg` that contains `ptr`, found walking from `hint`, a block of `seg` at or
    /// before `ptr`, or from the first block where `hint` is not one.
    fn block_from(&self, seg: SegId, hint: BlockId, ptr: DevicePtr) -> BlockId {
        let usable = hint != BlockId::NIL
            && self.blocks.is_held(hint)
            && self.blocks[hint].segment == seg
            && self.blocks[hint].ptr <= ptr;
        let mut id = if usable {
            hint
        } else {
            self.segments[seg].first
        };
        while self.blocks[id].ptr + self.blocks[id].size <= ptr {
            id = self.blocks[id].next;
        }
        id
    }

    /// Insert a block of `size` bytes at `ptr` right after block `after`; returns it.
    pub(super) fn new_block_after(
        &mut self,
        after: BlockId,
        ptr: DevicePtr,
        size: u64,
        state: State,
    ) -> BlockId {
        let (segment, next) = (self.blocks[after].segment, self.blocks[after].next);
        let id = self.blocks.insert(crate::pool::blocks::Block {
            ptr,
            size,
            requested: 0,
            segment,
            prev: after,
            next,
            state,
            shared: false,
        });
        self.blocks[after].next = id;
        if next != BlockId::NIL {
            self.blocks[next].prev = id;
        }
        id
    }
}

#[cfg(test)]
mod tests {
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
