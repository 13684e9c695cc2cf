//! Page-granular reuse of cached physical memory (the virtual-memory mode, the default where the
//! driver and device have the API).
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
//! pieces first, at most [`MAX_PIECES`] of them: a stitch costs one `cuMemMap` per piece. A range
//! made from the cache is only as large as the request's pages. Where the cache covers the
//! request only in part, it is used only when that pays ([`partial_pays`]): half of it or more is
//! cached, the driver lacks a segment of the request's size, or all but a sliver is cached;
//! otherwise a segment is created whole, as PyTorch would, and the cache stays for the requests
//! that reuse it. The shortfall is created as one handle sized like PyTorch's segment for it,
//! and while the pool keeps growing with some headroom ([`headroom`]), so that a pool growing
//! step by step does not call the driver at every step (one `cuMemCreate` per growth, through
//! the growth policy shared with classic segments: a cap, release before growing, and release
//! everything and retry once on out-of-memory).
//!
//! Lent pages stay holes in their lender, which keep its free neighbours apart, until the range
//! that borrowed them is taken apart. So at a miss (no free block of the stream holds the
//! request), idle segments made partly of lent pages are taken apart first (`return_borrowed`):
//! merged again in their lenders, the pages may hold the request in place, as PyTorch's policy
//! would, before anything is stitched or created. On the replayed snapshots this changed no
//! trace for the worse and saved up to 4 memory-creating calls.
//!
//! When a segment with no block in use is taken apart (returning memory, a miss as above, or an
//! idle segment released), it is unmapped with one call and its pages go back where they came
//! from: a lent piece becomes free memory again in its lender (the hole is filled, merged with
//! its free neighbours, without a driver call); pages it owned outright become spare; pages it
//! had lent on to a third range now belong to that range (lent by the original lender, if any).
//! A handle goes back to the driver only when all its pages are spare, hence mapped nowhere.
//!
//! The bound this keeps, checked after every operation of the property tests: after
//! `free_reusable` every segment left holds a live block, and the driver holds exactly the
//! handles mapped in those segments.
//!
//! A failed driver call leaves the books exact: the cache's pieces go back, a created handle
//! becomes spare, and a range that could not be unmapped or freed is kept (with the handles
//! mapped in it, which are not released meanwhile) and retried by `free_reusable`.

use super::phys::Pages;
use super::{BlockId, Context, DevicePool, Grow, SegId, State};
use crate::driver::{DevicePtr, PhysHandle};
use crate::error::rm_status;
use crate::error::{Error, Result};
use crate::pool::size::{human, segment_size, Class, SEGMENT_ROUND};

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

/// The most pieces of cached memory one new segment is stitched from.
const MAX_PIECES: usize = 32;

/// A piece of cached memory for a new segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pages: Pages,
    /// Lent by this segment, where the pages are mapped at this address; `None`: spare pages.
    lender: Option<(SegId, DevicePtr)>,
}

/// An address range whose unmapping or freeing failed: kept, retried by `free_reusable`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Stuck {
    base: DevicePtr,
    size: u64,
    /// Bytes still mapped from `base` on.
    mapped: u64,
    /// The handles mapped in it, which must not be released meanwhile.
    handles: Vec<PhysHandle>,
}

/// Choose pieces for `need` bytes: spare ones first (largest first), then of the lendable ones
/// the smallest that covers the rest alone, else the largest first; at most [`MAX_PIECES`] in
/// all. The last piece taken is cut to what is still needed (from its start).
pub(super) fn choose(spare: &[Piece], lendable: &[Piece], need: u64) -> Vec<Piece> {
    let mut chosen = Vec::new();
    let mut left = need;
    let take = |piece: &Piece, left: &mut u64, chosen: &mut Vec<Piece>| {
        let size = piece.pages.size.min(*left);
        chosen.push(Piece {
            pages: Pages {
                size,
                ..piece.pages
            },
            lender: piece.lender,
        });
        *left -= size;
    };
    let mut spare = spare.to_vec();
    spare.sort_by_key(|p| std::cmp::Reverse(p.pages.size));
    for piece in &spare {
        if left == 0 || chosen.len() == MAX_PIECES {
            break;
        }
        take(piece, &mut left, &mut chosen);
    }
    let mut lendable = lendable.to_vec();
    lendable.sort_by_key(|p| (p.pages.size, p.lender));
    while left > 0 && chosen.len() < MAX_PIECES && !lendable.is_empty() {
        let at = lendable
            .iter()
            .position(|p| p.pages.size >= left)
            .unwrap_or(lendable.len() - 1);
        let piece = lendable.remove(at);
        take(&piece, &mut left, &mut chosen);
    }
    chosen
}

/// Whether a range only partly covered by the cache (`have` of `size` bytes) should still be
/// made from it. Covered wholly, it always is: nothing is created. Covered partly, something is
/// created anyway, and the free blocks lent are lost to the requests that would have reused
/// them (replayed training snapshots made up to twice PyTorch's driver allocations when every
/// partial cover was taken). So partly only where it pays: when at least half of the range is
/// cached (creating it whole would leave that much idle: a model's next warm-up beside the
/// block that outlived generation; the snapshot whose 477 MiB request met 340 MiB of free
/// blocks, and reserved 15% more than it needed under PyTorch's policy), or when the driver
/// lacks a segment of the request's size (PyTorch would run out of memory or return its cache).
/// Never where the driver cannot supply the rest, so that a request that cannot be met fails
/// holding no cache back from the release that precedes the failure.
pub(super) fn partial_pays(size: u64, have: u64, driver_free: u64) -> bool {
    have.saturating_add(driver_free) >= size
        && (have.saturating_mul(2) >= size || driver_free < segment_size(size))
}

/// The headroom of a creation: how much memory a growing pool creates at least, given the
/// bytes it created since a range was last made wholly from its cache or its memory last went
/// back (`streak`), what it
/// reserves, and the memory it may still take (`room`: the driver's free memory, and under a
/// cap no more than the cap leaves). Creating only each request's shortfall keeps the
/// peak low but makes a pool that grows step by step call the driver at every step (on the
/// replayed snapshots, up to 7 memory-creating calls more than PyTorch); so while it keeps
/// growing, a creation is at least an eighth of what the streak created, and at most a
/// thirty-second of what the pool reserves: the most it may leave idle at its peak, above what
/// it needed (a pool that only grows by requests of a segment's size each, which PyTorch's
/// policy fits exactly, may reserve that much more than PyTorch, in fewer calls). None while
/// room is short: never more than half of what is left, so headroom never takes memory a later
/// request needs, nor makes the pool return cache to stay under its cap.
pub(super) fn headroom(streak: u64, reserved: u64, room: u64) -> u64 {
    let headroom = (streak / 8).min(reserved / 32);
    if headroom > room / 2 {
        0
    } else {
        headroom
    }
}

impl DevicePool {
    /// Whether this pool stitches; asks the driver once.
    pub(super) fn stitching(&mut self, cx: &Context<'_>) -> bool {
        if self.vmm == VmmMode::Undecided {
            self.vmm = match (self.config.vmm, cx.driver.vmm_granularity(self.device)) {
                (true, Some(granularity)) => VmmMode::On(granularity),
                (true, None) => {
                    self.log(format_args!(
                        "the driver or device lacks the virtual-memory API: using classic \
                         segments"
                    ));
                    VmmMode::Off
                }
                (false, _) => VmmMode::Off,
            };
        }
        matches!(self.vmm, VmmMode::On(_))
    }

    /// A new range of `size` bytes (rounded up to the granularity), mapped and accessible:
    /// cached pages first (unless `mode` keeps the cache as it is), then one new handle for the
    /// shortfall. Returns its address and runs, the memory already counted as reserved.
    pub(super) fn stitch(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        requested: u64,
        mode: Grow,
        driver_free: u64,
    ) -> Result<(DevicePtr, Vec<Run>)> {
        let VmmMode::On(granularity) = self.vmm else {
            return Err(Error::internal("stitching without the virtual-memory API"));
        };
        // Built from the cache, a range needs only the request's pages; a segment's worth of
        // memory (20 MiB for a request under 10 MiB) is created only where memory is created.
        let segment = size.next_multiple_of(granularity);
        let size = match crate::pool::size::block_size(requested) {
            Ok(block) => block.next_multiple_of(granularity).min(size),
            Err(_) => size,
        }
        .next_multiple_of(granularity);
        let pieces = if mode == Grow::MayRelease {
            self.gather(cx, size, granularity, driver_free)?
        } else {
            Vec::new()
        };
        let have: u64 = pieces.iter().map(|p| p.pages.size).sum();
        if have >= size {
            // Met from the cache alone: the pool holds what it needs, growth (if any) is over.
            self.streak = 0;
        }
        let mut all: Vec<Piece> = pieces.clone();
        // The lenders of pieces in flight are not taken apart to make room meanwhile.
        self.lending = pieces
            .iter()
            .filter_map(|p| p.lender.map(|l| l.0))
            .collect();
        let made = self.make_range(cx, (size, segment), requested, mode, driver_free, &mut all);
        self.lending.clear();
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
                    "stitched a {} segment from {} cached pieces ({}) and {} created",
                    human(offset),
                    pieces.len(),
                    human(have),
                    human(offset - have)
                ));
                Ok((base, runs))
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
        if have < size {
            // The shortfall is created as PyTorch would size a segment for it (a 20 MiB handle
            // for under 10 MiB), and at least the growing pool's headroom, so that growth keeps
            // pace with PyTorch's in driver calls; the excess stays free at the end of the new
            // range. Where that much is not to be had, the bare shortfall.
            let need = size - have;
            let granularity = match self.vmm {
                VmmMode::On(g) => g,
                _ => SEGMENT_ROUND,
            };
            // Sized by the bytes the request still lacks, not by `need`: rounded up to the
            // granularity, a 9 MiB request's 10 MiB would get a segment of its own where PyTorch
            // gives it a shared 20 MiB one.
            let lacking = crate::pool::size::block_size(requested)
                .map_or(need, |block| block.saturating_sub(have))
                .clamp(1, need);
            let sized = segment_size(lacking)
                .min(segment)
                .max(need)
                .max(headroom(
                    self.streak,
                    self.stats.reserved_bytes,
                    self.limit.map_or(driver_free, |limit| {
                        driver_free.min(limit.saturating_sub(self.stats.reserved_bytes))
                    }),
                ))
                .next_multiple_of(granularity);
            let device = self.device;
            let mut created = self.obtain(cx, sized, requested, mode, driver_free, |driver| {
                driver.vmm_create(device, sized)
            });
            let mut made = sized;
            if sized > need
                && created
                    .as_ref()
                    .is_err_and(|e| e.status == rm_status::RM_ERROR_OUT_OF_MEMORY)
            {
                made = need;
                created = self.obtain(cx, need, requested, mode, driver_free, |driver| {
                    driver.vmm_create(device, need)
                });
            }
            let handle = created?;
            self.streak += made;
            self.phys.add(handle, made);
            self.stats.add_reserved(made, 1);
            all.push(Piece {
                pages: Pages {
                    handle,
                    offset: 0,
                    size: made,
                },
                lender: None,
            });
        }
        let size = all.iter().map(|p| p.pages.size).sum();
        self.map_pieces(cx, size, all)
    }

    /// Take cached pieces for up to `size` bytes out of the books: spare pages, and aligned
    /// interiors of free blocks lent as holes. Waits for the device first, as work queued before
    /// those blocks were released may still use them.
    fn gather(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        granularity: u64,
        driver_free: u64,
    ) -> Result<Vec<Piece>> {
        let spare: Vec<Piece> = self
            .phys
            .spare_pieces()
            .into_iter()
            .map(|pages| Piece {
                pages,
                lender: None,
            })
            .collect();
        let lendable = self.lendable(granularity);
        let chosen = choose(&spare, &lendable, size);
        let have: u64 = chosen.iter().map(|p| p.pages.size).sum();
        if chosen.is_empty() || (have < size && !partial_pays(size, have, driver_free)) {
            return Ok(Vec::new());
        }
        cx.driver.synchronize(self.device).map_err(|e| {
            Error::driver("waiting for the device before remapping cached memory", &e)
        })?;
        for piece in &chosen {
            match piece.lender {
                None => self.phys.take(piece.pages),
                Some((seg, ptr)) => self.carve_hole(seg, ptr, piece.pages.size),
            }
        }
        Ok(chosen)
    }

    /// Every granularity-aligned interior of a free block, split along its segment's runs.
    fn lendable(&self, granularity: u64) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for (seg, s) in self.segments.enumerate() {
            // Small segments' pages stay for small requests, as PyTorch keeps its small pool:
            // lent to larger ranges, they left small requests to create new ones.
            if !s.in_use || !s.stitched || s.class == Class::Small {
                continue;
            }
            let mut id = s.first;
            while id != BlockId::NIL {
                let b = &self.blocks[id];
                id = b.next;
                if b.state != State::Free {
                    continue;
                }
                let start = b.ptr.next_multiple_of(granularity);
                let end = (b.ptr + b.size) / granularity * granularity;
                if end <= start {
                    continue;
                }
                let first = s
                    .runs
                    .partition_point(|r| s.base + r.offset + r.pages.size <= start);
                for r in &s.runs[first..] {
                    let (run_start, run_end) =
                        (s.base + r.offset, s.base + r.offset + r.pages.size);
                    if run_start >= end {
                        break;
                    }
                    let (from, to) = (start.max(run_start), end.min(run_end));
                    pieces.push(Piece {
                        pages: Pages {
                            handle: r.pages.handle,
                            offset: r.pages.offset + (from - run_start),
                            size: to - from,
                        },
                        lender: Some((seg, from)),
                    });
                }
            }
        }
        pieces
    }

    /// Put pieces taken for a segment that was not made back where they came from.
    fn give_back(&mut self, pieces: &[Piece]) {
        for piece in pieces {
            match piece.lender {
                None => self.phys.give(piece.pages),
                Some((seg, ptr)) => self.fill_hole(seg, ptr, piece.pages.size),
            }
        }
    }

    /// Reserve an address range of `size` bytes and map `pieces` back to back into it, with
    /// read-write access. On failure what was done is undone, or kept to retry if undoing fails.
    fn map_pieces(&mut self, cx: &Context<'_>, size: u64, pieces: &[Piece]) -> Result<DevicePtr> {
        let device = self.device;
        let base = cx.driver.vmm_reserve(device, size).map_err(|e| {
            Error::driver(&format!("reserving {} of address space", human(size)), &e)
        })?;
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
            let mut stuck = Stuck {
                base,
                size,
                mapped,
                handles: pieces.iter().map(|p| p.pages.handle).collect(),
            };
            if let Err(later) = self.unstick(cx, &mut stuck) {
                self.log(format_args!("{}; kept to retry", later.message));
                self.stuck.push(stuck);
            }
            return Err(err);
        }
        Ok(base)
    }

    /// Unmap and free a range that is in no segment, recording progress in `stuck`.
    fn unstick(&mut self, cx: &Context<'_>, stuck: &mut Stuck) -> Result<()> {
        if stuck.mapped > 0 {
            cx.driver
                .vmm_unmap(self.device, stuck.base, stuck.mapped)
                .map_err(|e| Error::driver("unmapping an abandoned address range", &e))?;
            stuck.mapped = 0;
            stuck.handles.clear();
        }
        cx.driver
            .vmm_free(self.device, stuck.base, stuck.size)
            .map_err(|e| Error::driver("freeing an abandoned address range", &e))
    }

    /// Retry up to `count` of the ranges kept after a failure; whether none is left.
    pub(super) fn retry_stuck(&mut self, cx: &Context<'_>, count: usize) -> Result<bool> {
        for _ in 0..count {
            let Some(mut stuck) = self.stuck.pop() else {
                break;
            };
            if let Err(err) = self.unstick(cx, &mut stuck) {
                self.stuck.push(stuck);
                return Err(err);
            }
        }
        Ok(self.stuck.is_empty())
    }

    /// Mark `[ptr, ptr + size)` of `seg`, inside one free block, a hole: its pages are lent.
    fn carve_hole(&mut self, seg: SegId, ptr: DevicePtr, size: u64) {
        let (slot, class) = {
            let s = &self.segments[seg];
            (s.slot, s.class)
        };
        let id = self.block_at(seg, ptr);
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
        if end < bptr + bsize {
            let right = self.new_block_after(hole, end, bptr + bsize - end, State::Free);
            self.bin_insert(slot, class, right);
        }
    }

    /// Lent pages `[ptr, ptr + size)` of `seg`, inside one hole, came back: free memory again,
    /// merged with its free neighbours.
    fn fill_hole(&mut self, seg: SegId, ptr: DevicePtr, size: u64) {
        let id = self.block_at(seg, ptr);
        let (bptr, bsize) = (self.blocks[id].ptr, self.blocks[id].size);
        debug_assert_eq!(self.blocks[id].state, State::Hole);
        debug_assert!(ptr + size <= bptr + bsize);
        let middle = if bptr < ptr {
            self.blocks[id].size = ptr - bptr;
            self.new_block_after(id, ptr, size, State::Hole)
        } else {
            self.blocks[id].size = size;
            id
        };
        if ptr + size < bptr + bsize {
            self.new_block_after(middle, ptr + size, bptr + bsize - ptr - size, State::Hole);
        }
        self.free_block(middle);
    }

    /// The block of `seg` that contains `ptr`.
    fn block_at(&self, seg: SegId, ptr: DevicePtr) -> BlockId {
        let mut id = self.segments[seg].first;
        while self.blocks[id].ptr + self.blocks[id].size <= ptr {
            id = self.blocks[id].next;
        }
        id
    }

    /// Insert a block of `size` bytes at `ptr` right after block `after`; returns it.
    fn new_block_after(
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

    /// Take apart a stitched segment with no block in use (all free blocks and holes): unmap it
    /// with one call, give its pages back where they came from, and free its address range.
    /// Its lists of runs and borrowers stay allocated with the vacant segment (see
    /// `forget_segment`): taking it apart frees no heap memory of its own.
    pub(super) fn dismantle(&mut self, cx: &Context<'_>, seg: SegId) -> Result<()> {
        let (base, size) = (self.segments[seg].base, self.segments[seg].size);
        cx.driver
            .vmm_unmap(self.device, base, size)
            .map_err(|e| Error::driver(&format!("unmapping cached segment {base:#x}"), &e))?;
        // Out of the segment while its lenders and borrowers change (none of which is `seg`),
        // put back before it is forgotten.
        let runs = std::mem::take(&mut self.segments[seg].runs);
        let mut borrowers = std::mem::take(&mut self.segments[seg].borrowers);
        // Pages this segment lent on now belong to their borrower, lent by this run's lender.
        let lender_of = |ptr: DevicePtr| {
            let r = runs
                .iter()
                .find(|r| base + r.offset <= ptr && ptr < base + r.offset + r.pages.size)
                .expect("a lent piece lies in a run");
            r.lender.map(|(l, at)| (l, at + (ptr - base - r.offset)))
        };
        for &borrower in &borrowers {
            for i in 0..self.segments[borrower].runs.len() {
                if let Some((l, ptr)) = self.segments[borrower].runs[i].lender {
                    if l == seg {
                        let lender = lender_of(ptr);
                        self.segments[borrower].runs[i].lender = lender;
                        if let Some((l, _)) = lender {
                            self.add_borrower(l, borrower);
                        }
                    }
                }
            }
        }
        // Its own lenders lend it nothing any more.
        for r in &runs {
            if let Some((l, _)) = r.lender {
                self.segments[l].borrowers.retain(|&b| b != seg);
            }
        }
        // Pages it owned go back to their lender, or become spare (changing only the lenders'
        // blocks, so the walk of its own goes on).
        let mut id = self.segments[seg].first;
        while id != BlockId::NIL {
            let b = &self.blocks[id];
            let (ptr, len, free) = (b.ptr, b.size, b.state == State::Free);
            id = b.next;
            if !free {
                continue;
            }
            for r in &runs {
                let (rs, re) = (base + r.offset, base + r.offset + r.pages.size);
                let (from, to) = (ptr.max(rs), (ptr + len).min(re));
                if from >= to {
                    continue;
                }
                match r.lender {
                    Some((l, at)) => self.fill_hole(l, at + (from - rs), to - from),
                    None => self.phys.give(Pages {
                        handle: r.pages.handle,
                        offset: r.pages.offset + (from - rs),
                        size: to - from,
                    }),
                }
            }
        }
        borrowers.clear();
        let s = &mut self.segments[seg];
        s.runs = runs;
        s.borrowers = borrowers;
        self.forget_segment(seg);
        // Out of the span map before the driver can hand the addresses to another device.
        cx.spans.remove(base, size);
        if let Err(e) = cx.driver.vmm_free(self.device, base, size) {
            self.stuck.push(Stuck {
                base,
                size,
                mapped: 0,
                handles: Vec::new(),
            });
            return Err(Error::driver(
                &format!("freeing the address range of segment {base:#x}"),
                &e,
            ));
        }
        Ok(())
    }

    /// Note that `borrower` has a run lent by `lender`.
    pub(super) fn add_borrower(&mut self, lender: SegId, borrower: SegId) {
        let borrowers = &mut self.segments[lender].borrowers;
        if !borrowers.contains(&borrower) {
            borrowers.push(borrower);
        }
    }

    /// Return cached memory until at least `needed` bytes went back to the driver (`u64::MAX`:
    /// all): unused handles, then segments with no block in use (idle, or only free blocks and
    /// holes) taken apart, largest first, and the handles that leaves unused. Returns the bytes
    /// returned.
    pub(super) fn release_idle_stitched(&mut self, cx: &Context<'_>, needed: u64) -> Result<u64> {
        let mut released = self.release_unused(cx, needed, usize::MAX)?;
        if released >= needed {
            return Ok(released);
        }
        // Taking a segment apart fills holes in its lenders and changes no other segment's
        // blocks from free to used or back, so one scan finds every candidate; each is checked
        // again before it goes.
        let mut found: Vec<(u64, SegId)> = self
            .segments
            .ids()
            .filter(|&seg| self.is_unused(seg))
            .map(|seg| (self.segments[seg].size, seg))
            .collect();
        found.sort_unstable_by(|a, b| b.cmp(a));
        let mut waited = false;
        for (_, seg) in found {
            if released >= needed {
                break;
            }
            if self.dismantle_if_unused(cx, seg, &mut waited)? {
                released += self.release_unused(cx, needed - released, usize::MAX)?;
            }
        }
        Ok(released)
    }

    /// Take apart every idle stitched segment made in part from lent pages, so that the pages
    /// go back to their lenders (merged there). Returns whether any was. A failing driver call
    /// fails no request: what could not be taken apart stays as it was (or, if only its address
    /// range could not be freed, is retried by `free_reusable`), and the request goes on.
    pub(super) fn return_borrowed(&mut self, cx: &Context<'_>) -> bool {
        if !matches!(self.vmm, VmmMode::On(_)) {
            return false;
        }
        let borrowers: Vec<SegId> = self
            .idle
            .iter()
            .copied()
            .filter(|&seg| {
                let s = &self.segments[seg];
                s.stitched && s.runs.iter().any(|r| r.lender.is_some())
            })
            .collect();
        if borrowers.is_empty() {
            return false;
        }
        // Work queued before the blocks were released may still use them.
        if let Err(e) = cx.driver.synchronize(self.device) {
            self.log(format_args!(
                "waiting for the device failed ({e}): borrowed pages stay where they are"
            ));
            return false;
        }
        let mut returned = false;
        for seg in borrowers {
            if !self.is_unused(seg) {
                continue;
            }
            match self.dismantle(cx, seg) {
                Ok(()) => returned = true,
                Err(e) => {
                    self.log(format_args!("{}; the request goes on", e.message));
                    // Taken apart but for its address range (kept to retry): its pages are back.
                    returned |= !self.segments[seg].in_use;
                }
            }
        }
        returned
    }

    /// Take `seg` apart if it is an unused stitched segment, the first time (`waited` false)
    /// after waiting for the device's queued work, which may still use its blocks. Returns
    /// whether it was taken apart.
    pub(super) fn dismantle_if_unused(
        &mut self,
        cx: &Context<'_>,
        seg: SegId,
        waited: &mut bool,
    ) -> Result<bool> {
        if !self.is_unused(seg) {
            return Ok(false);
        }
        if !*waited {
            self.wait_before_returning(cx)?;
            *waited = true;
        }
        self.dismantle(cx, seg)?;
        Ok(true)
    }

    /// Wait for the device's queued work, which may still use blocks released before it.
    pub(super) fn wait_before_returning(&self, cx: &Context<'_>) -> Result<()> {
        cx.driver
            .synchronize(self.device)
            .map_err(|e| Error::driver("waiting for the device before returning cached memory", &e))
    }

    /// Whether `seg` is a stitched segment in use whose blocks are all free or holes, lending
    /// nothing in flight.
    pub(super) fn is_unused(&self, seg: SegId) -> bool {
        let s = &self.segments[seg];
        if !(s.in_use && s.stitched && !self.lending.contains(&seg)) {
            return false;
        }
        let mut id = s.first;
        while id != BlockId::NIL {
            if !matches!(self.blocks[id].state, State::Free | State::Hole) {
                return false;
            }
            id = self.blocks[id].next;
        }
        true
    }

    /// Whether a handle mapped nowhere is left that [`DevicePool::release_unused`] would return.
    pub(super) fn has_unused_handles(&self) -> bool {
        self.phys.unused().any(|(handle, _)| !self.is_stuck(handle))
    }

    fn is_stuck(&self, handle: PhysHandle) -> bool {
        self.stuck.iter().any(|s| s.handles.contains(&handle))
    }

    /// Release handles mapped nowhere, largest first, until `needed` bytes or `count` handles
    /// went back; those mapped in a range kept to retry stay. Returns the bytes returned. Each
    /// handle is looked up when its turn comes, so that no list is allocated (under the
    /// device's lock, an allocation can cost glibc's sorting of its free chunks).
    pub(super) fn release_unused(
        &mut self,
        cx: &Context<'_>,
        needed: u64,
        count: usize,
    ) -> Result<u64> {
        let mut released = 0u64;
        for _ in 0..count {
            if released >= needed {
                break;
            }
            let next = self
                .phys
                .unused()
                .find(|&(handle, _)| !self.is_stuck(handle));
            let Some((handle, size)) = next else {
                break;
            };
            cx.driver
                .vmm_release(self.device, handle)
                .map_err(|e| Error::driver("returning cached memory to the driver", &e))?;
            self.phys.remove(handle);
            self.stats.remove_reserved(size, 1);
            released = released.saturating_add(size);
        }
        Ok(released)
    }

    /// Check that each segment lists as borrowers exactly the segments with a run it lent,
    /// each once.
    fn check_borrowers(&self) -> std::result::Result<(), String> {
        use std::collections::{BTreeMap, BTreeSet};
        let mut expected: BTreeMap<SegId, BTreeSet<SegId>> = BTreeMap::new();
        for (seg_id, s) in self.segments.enumerate().filter(|(_, s)| s.in_use) {
            for (l, _) in s.runs.iter().filter_map(|r| r.lender) {
                expected.entry(l).or_default().insert(seg_id);
            }
        }
        for (seg_id, s) in self.segments.enumerate() {
            let listed: BTreeSet<SegId> = s.borrowers.iter().copied().collect();
            let lent = expected.remove(&seg_id).unwrap_or_default();
            if listed.len() != s.borrowers.len()
                || listed != lent
                || (!s.in_use && !lent.is_empty())
            {
                return Err(format!(
                    "segment {:#x} lists borrowers {:?} but lent runs to {:?}",
                    s.base, s.borrowers, lent
                ));
            }
        }
        Ok(())
    }

    /// Check the books of stitched segments: runs tile each segment; every lent run's pages are
    /// a hole in its lender; holes are exactly the lent pages; memory held equals the handles.
    pub(super) fn check_stitched(&self) -> std::result::Result<(), String> {
        self.phys.check()?;
        let (mut lent, mut holes, mut owned) = (0u64, 0u64, 0u64);
        for s in self.segments.iter().filter(|s| s.in_use && s.stitched) {
            let mut at = 0;
            for r in &s.runs {
                if r.offset != at || !self.phys.holds(r.pages.handle) {
                    return Err(format!(
                        "segment {:#x}: runs do not tile it with held handles",
                        s.base
                    ));
                }
                at += r.pages.size;
                if let Some((l, ptr)) = r.lender {
                    lent += r.pages.size;
                    let lender = self.segments.get(l).filter(|x| x.in_use);
                    let inside = lender.is_some_and(|x| {
                        let b = &self.blocks[self.block_at(l, ptr)];
                        x.base <= ptr
                            && b.state == State::Hole
                            && ptr + r.pages.size <= b.ptr + b.size
                    });
                    if !inside {
                        return Err(format!(
                            "segment {:#x}: a run lent by {ptr:#x} is not a hole there",
                            s.base
                        ));
                    }
                }
            }
            if at != s.size {
                return Err(format!("segment {:#x}: runs do not cover it", s.base));
            }
            let mut id = s.first;
            while id != BlockId::NIL {
                let b = &self.blocks[id];
                if b.state == State::Hole {
                    holes += b.size;
                } else {
                    owned += b.size;
                }
                id = b.next;
            }
        }
        if lent != holes {
            return Err(format!("{lent} bytes lent but {holes} bytes of holes"));
        }
        self.check_borrowers()?;
        if owned + self.phys.spare_bytes() != self.phys.held_bytes() {
            return Err(format!(
                "segments own {owned} bytes and {} are spare, but handles hold {}",
                self.phys.spare_bytes(),
                self.phys.held_bytes()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::ids::Id;

    const MIB: u64 = 1 << 20;

    fn spare(handle: PhysHandle, offset: u64, size: u64) -> Piece {
        Piece {
            pages: Pages {
                handle,
                offset,
                size,
            },
            lender: None,
        }
    }

    fn lent(seg: u16, ptr: DevicePtr, size: u64) -> Piece {
        Piece {
            pages: Pages {
                handle: 100 + u64::from(seg),
                offset: 0,
                size,
            },
            lender: Some((SegId::at(usize::from(seg)), ptr)),
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
        // The seed's next warm-up: 8.22 GiB, all but 10 MiB cached; the driver has plenty.
        assert!(partial_pays(
            8_824_815_616,
            8_824_815_616 - 10 * MIB,
            15 * gib
        ));
        // A 16 MiB request with 4 MiB cached and the driver roomy: create it whole instead.
        assert!(!partial_pays(16 * MIB, 4 * MIB, 15 * gib));
        // The same with the driver short of 16 MiB: the cache helps.
        assert!(partial_pays(16 * MIB, 4 * MIB, 14 * MIB));
        // Under 10 MiB a segment is 20 MiB: short of that, the cache helps.
        assert!(partial_pays(6 * MIB, 2 * MIB, 18 * MIB));
        assert!(!partial_pays(6 * MIB, 2 * MIB, 20 * MIB));
        // Nor where the driver cannot supply the rest.
        assert!(!partial_pays(5 * gib, 2 * MIB, 4 * gib));
        // Half cached pays; less does not.
        assert!(partial_pays(32 * MIB, 16 * MIB, gib));
        assert!(!partial_pays(32 * MIB, 14 * MIB, gib));
        // The snapshot's 477 MiB request beside 340 MiB of free blocks.
        assert!(partial_pays(478 * MIB, 340 * MIB, 70 * gib));
    }

    #[test]
    fn a_growing_pool_creates_with_headroom_bounded_by_what_it_reserves() {
        let gib = 1 << 30;
        // Nothing created since the cache last sufficed: no headroom.
        assert_eq!(headroom(0, 4 * gib, 60 * gib), 0);
        // An eighth of what the streak created...
        assert_eq!(headroom(160 * MIB, 4 * gib, 60 * gib), 20 * MIB);
        // ... at most a thirty-second of what the pool reserves...
        assert_eq!(headroom(4 * gib, gib, 60 * gib), 32 * MIB);
        // ... and none where it would take half of what the driver has left.
        assert_eq!(headroom(4 * gib, 4 * gib, 250 * MIB), 0);
        assert_eq!(headroom(4 * gib, 4 * gib, 256 * MIB), 128 * MIB);
    }

    #[test]
    fn a_stitch_takes_at_most_max_pieces() {
        let lendable: Vec<Piece> = (0..100)
            .map(|i| lent(i, u64::from(i) << 32, 2 * MIB))
            .collect();
        let chosen = choose(&[], &lendable, 1 << 30);
        assert_eq!(chosen.len(), MAX_PIECES);
        assert_eq!(chosen.iter().map(|p| p.pages.size).sum::<u64>(), 64 * MIB);
    }
}
