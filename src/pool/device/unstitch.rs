//! Taking stitched segments apart and returning memory (the virtual-memory mode; segments are
//! built in `stitch.rs`): a segment's pages going back where they came from, its borrowers'
//! books, handles mapped nowhere returned to the driver, and address ranges kept after a failed
//! driver call (*stuck*), retried by `free_reusable`.
//!
//! Lent pages stay holes in their lender, which keep its free neighbours apart, until the range
//! that borrowed them is taken apart. So at a miss (no free block of the stream holds the
//! request), idle segments made partly of lent pages are taken apart first (`return_borrowed`):
//! merged again in their lenders, the pages may hold the request in place, as PyTorch's policy
//! would, before anything is stitched or created. On the replayed snapshots this changed no
//! trace for the worse and saved up to 4 memory-creating calls.
//!
//! When a segment with no block in use is taken apart (returning memory, a miss as above, or an
//! idle segment released), it is unmapped with one call, its addresses go back to their chunk
//! (`addresses.rs`; no driver call), and its pages go back where they came from: a lent piece
//! becomes free memory again in its lender (the hole is filled, merged with its free
//! neighbours, without a driver call); pages it owned outright become spare; pages it had lent
//! on to a third range now belong to that range (lent by the original lender, if any).
//! A handle goes back to the driver only when all its pages are spare, hence mapped nowhere.
//! A segment that lent a fragment (the tail of a page whose start it keeps, `stitch.rs`) is not
//! taken apart while its borrower is there: the page is both's. Returning everything scans
//! again once a borrower went, and a sweep's cursor goes back to the lender.
//!
//! The bound this keeps, checked after every operation of the property tests: after
//! `free_reusable` every segment left holds a live block, and the driver holds exactly the
//! handles mapped in those segments, and no address chunk that no segment uses.
//!
//! A range that could not be unmapped is kept with the handles mapped in it, which are not
//! released meanwhile, and retried by `free_reusable`; so is a range a sweep is unmapping
//! without the device's lock (`deferred.rs`), until the answer is booked. A chunk whose
//! reservation could not be freed is kept and freed by a later `free_reusable`.

use super::phys::Pages;
use super::stitch::VmmMode;
use super::{BlockId, Context, DevicePool, SegId, State};
use crate::driver::{DevicePtr, PhysHandle};
use crate::error::{Error, Result};
use crate::pool::size::human;

/// What returning memory does with a segment that is not settled (its blocks released since
/// the last wait for the device's queued work, see `streams.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unsettled {
    /// Wait for the device's queued work, with the device's lock held.
    Wait,
    /// Leave it cached: a sweep that waited before it took the lock.
    Skip,
}

/// An address range in no segment, still mapped: its unmapping failed (kept, retried by
/// `free_reusable`), or a sweep is unmapping it without the device's lock (*in flight*).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Stuck {
    base: DevicePtr,
    size: u64,
    /// Bytes still mapped from `base` on.
    mapped: u64,
    /// The handles mapped in it, which must not be released meanwhile.
    handles: Vec<PhysHandle>,
    /// A sweep is unmapping it: nobody else retries it.
    in_flight: bool,
}

impl Stuck {
    /// Its address range: `(base, size)`.
    pub(super) fn range(&self) -> (DevicePtr, u64) {
        (self.base, self.size)
    }
}

impl DevicePool {
    /// Take apart a stitched segment with no block in use (all free blocks and holes): unmap it
    /// with one call, give its pages back where they came from, and free its address range.
    /// Its lists of runs and borrowers stay allocated with the vacant segment (see
    /// `forget_segment`): taking it apart frees no heap memory of its own.
    pub(super) fn dismantle(&mut self, cx: &Context<'_>, seg: SegId) -> Result<()> {
        let (base, size) = self.segments[seg].mapped();
        cx.driver
            .vmm_unmap(self.device, base, size)
            .map_err(|e| Error::driver(&format!("unmapping cached segment {base:#x}"), &e))?;
        self.take_apart(cx, seg);
        self.addresses.give(base, size);
        Ok(())
    }

    /// Take apart a stitched segment with no block in use, its range to be unmapped without
    /// the device's lock (a sweep's, see `sweep.rs`): its books as [`DevicePool::dismantle`]
    /// leaves them, but the range, still mapped, kept as stuck and *in flight* (not retried by
    /// others), its handles not released meanwhile, until the driver's answer is booked.
    /// Returns the range.
    pub(super) fn take_apart_to_unmap(&mut self, cx: &Context<'_>, seg: SegId) -> (DevicePtr, u64) {
        let (base, size) = self.segments[seg].mapped();
        let mut handles = self.spare_handle_lists.pop().unwrap_or_default();
        for r in &self.segments[seg].runs {
            if !handles.contains(&r.pages.handle) {
                handles.push(r.pages.handle);
            }
        }
        self.take_apart(cx, seg);
        self.stuck.push(Stuck {
            base,
            size,
            mapped: size,
            handles,
            in_flight: true,
        });
        (base, size)
    }

    /// The driver answered the unmap of `[base, base + size)`, in flight since
    /// [`DevicePool::take_apart_to_unmap`]: unmapped, its addresses go back to their chunk and
    /// its handles may be released; else it stays, kept to retry.
    pub(super) fn unmapped(&mut self, base: DevicePtr, size: u64, unmapped: bool) {
        let at = self
            .stuck
            .iter()
            .position(|k| k.in_flight && k.base == base)
            .expect("an unmap in flight is kept");
        if !unmapped {
            self.stuck[at].in_flight = false;
            return;
        }
        let mut done = self.stuck.swap_remove(at);
        done.handles.clear();
        self.spare_handle_lists.push(done.handles);
        self.addresses.give(base, size);
    }

    /// The books' part of taking `seg` apart: its pages back where they came from, the segment
    /// forgotten and out of the span map. Its address range is the caller's.
    fn take_apart(&mut self, cx: &Context<'_>, seg: SegId) {
        let (base, size) = (self.segments[seg].base, self.segments[seg].size);
        // Runs lie from the mapped start, `lead` bytes before the blocks.
        let (mapped, _) = self.segments[seg].mapped();
        // Out of the segment while its lenders and borrowers change (none of which is `seg`),
        // put back before it is forgotten.
        let runs = std::mem::take(&mut self.segments[seg].runs);
        let mut borrowers = std::mem::take(&mut self.segments[seg].borrowers);
        // Pages this segment lent on now belong to their borrower, lent by this run's lender.
        let lender_of = |ptr: DevicePtr| {
            let r = runs
                .iter()
                .find(|r| mapped + r.offset <= ptr && ptr < mapped + r.offset + r.pages.size)
                .expect("a lent piece lies in a run");
            r.lender.map(|(l, at)| (l, at + (ptr - mapped - r.offset)))
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
                self.segments[l].borrowers.remove(&seg);
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
                let (rs, re) = (mapped + r.offset, mapped + r.offset + r.pages.size);
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
        cx.spans.remove(base, size, self.owner);
    }

    /// Lent pages `[ptr, ptr + size)` of `seg`, inside one hole, came back: free memory again,
    /// merged with its free neighbours.
    pub(super) fn fill_hole(&mut self, seg: SegId, ptr: DevicePtr, size: u64) {
        let (&bptr, &id) = self
            .holes
            .range(..=ptr)
            .next_back()
            .expect("lent pages lie in a hole");
        let bsize = self.blocks[id].size;
        debug_assert_eq!(self.blocks[id].segment, seg);
        debug_assert_eq!(self.blocks[id].state, State::Hole);
        debug_assert!(ptr + size <= bptr + bsize);
        let middle = if bptr < ptr {
            self.blocks[id].size = ptr - bptr;
            self.new_block_after(id, ptr, size, State::Hole)
        } else {
            self.holes.remove(&bptr);
            self.blocks[id].size = size;
            id
        };
        if ptr + size < bptr + bsize {
            let rest = bptr + bsize - ptr - size;
            let right = self.new_block_after(middle, ptr + size, rest, State::Hole);
            self.holes.insert(ptr + size, right);
        }
        self.free_block(middle);
    }

    /// The segment that lent `seg` the fragment its first page is, if any (see `stitch.rs`).
    pub(super) fn fragment_lender(&self, seg: SegId) -> Option<SegId> {
        let s = &self.segments[seg];
        let lender = s.runs.first().and_then(|r| r.lender).map(|(l, _)| l);
        lender.filter(|_| s.lead > 0)
    }

    /// Whether `lender` lent `borrower` the fragment its first page is.
    fn lends_fragment(&self, lender: SegId, borrower: SegId) -> bool {
        self.fragment_lender(borrower) == Some(lender)
    }

    /// Note that `borrower` has a run lent by `lender`.
    pub(super) fn add_borrower(&mut self, lender: SegId, borrower: SegId) {
        self.segments[lender].borrowers.insert(borrower);
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
        // blocks from free to used or back, so one scan finds every candidate (each checked
        // again before it goes), but for the lenders of fragments, which may go once their
        // borrowers went: scanned again while a scan took any apart.
        loop {
            let mut found: Vec<(u64, SegId)> = self
                .segments
                .ids()
                .filter(|&seg| self.is_unused(seg))
                .map(|seg| (self.segments[seg].size, seg))
                .collect();
            found.sort_unstable_by(|a, b| b.cmp(a));
            let mut any = false;
            for (_, seg) in found {
                if released >= needed {
                    return Ok(released);
                }
                if self.dismantle_if_unused(cx, seg, Unsettled::Wait)? {
                    any = true;
                    released += self.release_unused(cx, needed - released, usize::MAX)?;
                }
            }
            if !any {
                return Ok(released);
            }
        }
    }

    /// Take apart every idle stitched segment made in part from lent pages, so that the pages
    /// go back to their lenders (merged there). Returns whether any was. A failing driver call
    /// fails no request: what could not be taken apart stays as it was (or, if only its address
    /// range could not be freed, is retried by `free_reusable`), and the request goes on. The
    /// error is a deferring pass's unwinding only, where it defers the wait for the device.
    pub(super) fn return_borrowed(&mut self, cx: &Context<'_>) -> Result<bool> {
        if !matches!(self.vmm, VmmMode::On(_)) {
            return Ok(false);
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
            return Ok(false);
        }
        // Work queued before the blocks were released may still use them: waited for first,
        // without the device's lock where the pass defers (`growing.rs`).
        if self.defer_wait(&borrowers) {
            return Err(Error::internal(
                "waiting for the device deferred until the device's lock is free",
            ));
        }
        if let Err(e) = self.settle(cx, borrowers.iter().copied(), "waiting for the device") {
            self.log(format_args!(
                "{}: borrowed pages stay where they are",
                e.message
            ));
            return Ok(false);
        }
        // Their unmaps too, the ranges taken apart in the books now.
        if self.defer_unmaps(cx, &borrowers) {
            return Err(Error::internal(
                "unmapping deferred until the device's lock is free",
            ));
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
        Ok(returned)
    }

    /// Take `seg` apart if it is an unused stitched segment whose blocks' queued work is done
    /// (settled, see `streams.rs`); one that is not settled is waited for or skipped, as
    /// `unsettled` says. Returns whether it was taken apart.
    pub(super) fn dismantle_if_unused(
        &mut self,
        cx: &Context<'_>,
        seg: SegId,
        unsettled: Unsettled,
    ) -> Result<bool> {
        if !self.is_unused(seg) || !self.may_return(cx, seg, unsettled)? {
            return Ok(false);
        }
        self.dismantle(cx, seg)?;
        Ok(true)
    }

    /// Whether `seg`'s memory may go back to the driver now: it is settled, or (`Wait`) the
    /// device's queued work, which may still use its blocks, was waited for.
    pub(super) fn may_return(
        &mut self,
        cx: &Context<'_>,
        seg: SegId,
        unsettled: Unsettled,
    ) -> Result<bool> {
        if self.is_settled(seg) {
            return Ok(true);
        }
        if unsettled == Unsettled::Skip {
            return Ok(false);
        }
        self.settle(
            cx,
            [seg],
            "waiting for the device before returning cached memory",
        )?;
        Ok(true)
    }

    /// Whether `seg` is a stitched segment in use whose blocks are all free or holes, lending
    /// nothing in flight, nor a fragment to a segment that is still there.
    pub(super) fn is_unused(&self, seg: SegId) -> bool {
        let s = &self.segments[seg];
        if !(s.in_use && s.stitched && !self.lending.contains(&seg)) {
            return false;
        }
        // A fragment's lender stays while its borrower lives: the page's start is its own.
        if s.borrowers.iter().any(|&b| self.lends_fragment(seg, b)) {
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

    /// The largest handle mapped nowhere, and in no range being unmapped or kept to retry.
    pub(super) fn next_unused_handle(&self) -> Option<(PhysHandle, u64)> {
        self.phys
            .unused()
            .find(|&(handle, _)| !self.is_stuck(handle))
    }

    /// Whether `handle` is mapped in a range kept to retry, or by a range mapped in flight.
    fn is_stuck(&self, handle: PhysHandle) -> bool {
        self.stuck.iter().any(|s| s.handles.contains(&handle)) || self.pinned.contains(&handle)
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
            let Some((handle, size)) = self.next_unused_handle() else {
                break;
            };
            cx.driver
                .vmm_release(self.device, handle)
                .map_err(|e| Error::driver("returning cached memory to the driver", &e))?;
            self.phys.remove(handle);
            self.remove_reserved(size, 1);
            released = released.saturating_add(size);
        }
        Ok(released)
    }

    /// Unmap and free `[base, base + size)`, an address range in no segment with `mapped` bytes
    /// mapped from `base` (pages of `handles`); if that fails too, keep it to retry.
    pub(super) fn abandon_range(
        &mut self,
        cx: &Context<'_>,
        base: DevicePtr,
        size: u64,
        mapped: u64,
        handles: Vec<PhysHandle>,
    ) {
        let mut stuck = Stuck {
            base,
            size,
            mapped,
            handles,
            in_flight: false,
        };
        if let Err(later) = self.unstick(cx, &mut stuck) {
            self.log(format_args!("{}; kept to retry", later.message));
            self.stuck.push(stuck);
        }
    }

    /// Unmap a range that is in no segment and give its addresses back to their chunk,
    /// recording progress in `stuck`.
    fn unstick(&mut self, cx: &Context<'_>, stuck: &mut Stuck) -> Result<()> {
        if stuck.mapped > 0 {
            cx.driver
                .vmm_unmap(self.device, stuck.base, stuck.mapped)
                .map_err(|e| Error::driver("unmapping an abandoned address range", &e))?;
            stuck.mapped = 0;
            stuck.handles.clear();
        }
        self.addresses.give(stuck.base, stuck.size);
        Ok(())
    }

    /// Free the reservations of address chunks no segment uses, one driver call each; a chunk
    /// whose freeing fails is kept (still unused) for the next `free_reusable`.
    pub(super) fn release_unused_chunks(&mut self, cx: &Context<'_>) -> Result<()> {
        while let Some((base, size)) = self.addresses.unused_chunk() {
            cx.driver.vmm_free(self.device, base, size).map_err(|e| {
                Error::driver(
                    &format!(
                        "freeing {} of unused address space at {base:#x}",
                        human(size)
                    ),
                    &e,
                )
            })?;
            self.addresses.remove_chunk(base);
        }
        Ok(())
    }

    /// Retry up to `count` of the ranges kept after a failure (not those a sweep is unmapping);
    /// whether none is left.
    pub(super) fn retry_stuck(&mut self, cx: &Context<'_>, count: usize) -> Result<bool> {
        let mut at = self.stuck.len();
        for _ in 0..count {
            let Some(i) = self.stuck[..at].iter().rposition(|k| !k.in_flight) else {
                break;
            };
            at = i;
            // Unmapped, it leaves the list; the last one takes its place, looked at already.
            let mut stuck = self.stuck.swap_remove(i);
            if let Err(err) = self.unstick(cx, &mut stuck) {
                self.stuck.push(stuck);
                return Err(err);
            }
        }
        Ok(self.stuck.iter().all(|k| k.in_flight))
    }
}
