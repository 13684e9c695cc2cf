//! Building a segment from cached physical memory and new memory (the virtual-memory mode, the
//! default where the driver and device have the API); taking segments apart and returning their
//! memory is `unstitch.rs`.
//!
//! A segment is a reserved address range tiled by *runs*: each run is a piece of a physical
//! handle, at a granularity offset into it, mapped by one `cuMemMap` (runs that go on in one
//! handle, one after the other, by one call together: `Pages::mappings`). On a miss, a new
//! segment is built from pages the cache already holds before any memory is created:
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
//! Which pieces is `pieces.rs`'s: the smallest single one that covers what is needed, else the
//! largest pieces first, at most [`MAX_PIECES`] of them: a stitch costs a `cuMemMap` per piece
//! (where the request would otherwise fail for want of memory, up to [`LAST_RESORT_PIECES`]). A
//! range made from the cache is only as large as the request's pages. Where the cache covers the
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
//! its last page unused for as long as the block lives (measured when fragments came, on a trace
//! of long-lived blocks among short-lived activations: 155 MiB at the peak beside live blocks
//! without them, 72 MiB with them). The lender is not taken apart while its borrower lives: the
//! page's start is its own. Where a request would otherwise fail for want of memory, its last
//! try takes a fragment also where the driver has the rest, as the page it saves may be the one
//! the driver lacks (a generated load then runs on a device 32 MiB smaller: `loads-17005`
//! failed at 18.03 GiB a 66.10 MiB request with 14 MiB of whole pages cached and 52 MiB free on
//! the device).
//!
//! A failed driver call leaves the books exact: the cache's pieces go back, a created handle
//! becomes spare, and a range that could not be unmapped or freed is kept (with the handles
//! mapped in it, which are not released meanwhile) and retried by `free_reusable`.

use super::addresses;
use super::peers::set_access;
use super::phys::Pages;
use super::pieces::{partial_pays, Piece};
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
pub(super) const MAX_PIECES: usize = 64;

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
                Some(Some(granularity)) => {
                    // Where the driver maps a handle only in parts, only whole parts are lent.
                    self.phys.split(cx.driver.vmm_part(self.device));
                    VmmMode::On(granularity)
                }
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
                    self.limit().map_or(driver_free, |limit| {
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
            self.add_reserved(made, 1);
            all.push(Piece {
                pages: Pages {
                    handle,
                    offset: 0,
                    size: made,
                },
                lender: None,
                block: BlockId::NIL,
                skip: 0,
                unit: self.phys.part(handle).unwrap_or(granularity),
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
        // the page saved would be spare beside it: no fragment then, save in the last resort
        // ([`DevicePool::stitch_growth`]), where the page saved may be the one the driver lacks.
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
            let last_resort = most == LAST_RESORT_PIECES;
            let created = if last_resort { driver_free } else { 0 };
            let cached = chosen.iter().map(|p| p.pages.size).sum::<u64>();
            if cached + granularity + created >= size {
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
        for pages in Pages::mappings(pieces.iter().map(|p| p.pages)) {
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
        let mut peers = self.whole_device.peers();
        if result.is_ok() {
            match set_access(cx.driver, device, (base, size), peers) {
                Ok(given) => peers = given,
                Err(e) => result = Err(Error::driver("setting access to a new segment", &e)),
            }
        }
        if let Err(err) = result {
            let handles = pieces.iter().map(|p| p.pages.handle).collect();
            self.abandon_range(cx, base, size, mapped, handles);
            return Err(err);
        }
        self.mapped_for = peers;
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
