//! Returning all cached memory (`free_reusable`) in batches of bounded work, so that the
//! device's lock can be released between them: parked blocks merged, pending blocks waited for
//! and ranges kept after a failure retried, a bounded number per batch, then idle segments
//! returned a batch at a time. In virtual-memory mode a cursor walks the segments once, taking
//! apart those with no block in use, and the handles that leaves mapped nowhere go back a
//! batch at a time from their own index: no batch looks at every segment or handle.
//!
//! Blocks released by other threads while a sweep runs may stay cached: a segment the cursor
//! has passed is not looked at again, and blocks parked after the first step stay parked.
//!
//! `Pool::free_reusable` waits for the device's queued work before its first batch, without
//! the device's lock ([`Sweep::settled_at`]); its batches then return only memory that wait
//! settled (see `streams.rs`), and leave cached what was released after it began, rather than
//! wait for the device with the lock held. A sweep made with [`Sweep::default`] waits under the
//! lock where it must.
//!
//! Classic segments are freed without the device's lock too: a batch takes them out of the
//! books (and the span map) into `returning`, still counted as reserved; the caller frees them
//! through the driver once it let go of the lock ([`Sweep::free_segments`]: a `cuMemFree` may
//! wait for the device's work, and costs tens of microseconds on a GPU in any case), and the
//! next batch books the driver's answers ([`DevicePool::book_frees`]): memory returned leaves the
//! reserved count; a segment the driver did not take back is booked again, idle. Stitched
//! segments' unmaps and handles' releases stay under the lock, bounded by the batch's time.

use super::unstitch::Unsettled;
use super::*;
use crate::driver::{Driver, DriverResult};

/// A classic segment taken out of the books by a sweep, which the driver is freeing without
/// the device's lock: what booking it again takes, if the driver does not take it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Returning {
    pub(super) base: DevicePtr,
    pub(super) size: u64,
    class: Class,
    stream: StreamHandle,
}

/// Parked blocks merged per batch, for each segment a batch returns: merging is a bin update,
/// far cheaper than a driver call.
const PARKED_PER_SEGMENT: usize = 16;

/// Segments looked at per batch, for each segment a batch may take apart.
const LOOKS_PER_SEGMENT: usize = 8;

/// How far a sweep has come between its batches. Start each sweep with a fresh one.
#[derive(Debug, Default)]
pub struct Sweep {
    step: Step,
    /// Virtual-memory mode: the next segment to look at.
    next: usize,
    /// The pending blocks, and (classic segments) the idle list, from this place on were looked
    /// at already (`None`: from the end of the list when the step begins).
    below: Option<usize>,
    /// The caller waited for all work on the device, without its lock, after this many releases
    /// (`None`: no wait was made; the batches wait where they must).
    settled: Option<u64>,
    /// Classic segments the last batch took out of the books, for the caller to free.
    to_free: Vec<DevicePtr>,
    /// What the driver answered to those frees, for the next batch to book.
    freed: Vec<(DevicePtr, DriverResult<()>)>,
}

impl Sweep {
    /// A sweep for a caller that waited for all work on the device, without its lock, after
    /// reading [`DevicePool::releases`] as `releases` (0: no wait was needed): its batches
    /// return only the memory released up to then (settled), and wait for nothing with the
    /// lock held.
    pub fn settled_at(releases: u64) -> Sweep {
        Sweep {
            settled: Some(releases),
            ..Sweep::default()
        }
    }

    /// Free through `driver`, without `device`'s lock, the classic segments the last batch took
    /// out of the books; the next batch (or [`DevicePool::book_frees`]) books the answers.
    pub fn free_segments(&mut self, driver: &dyn Driver, device: i32) {
        for base in self.to_free.drain(..) {
            self.freed.push((base, driver.mem_free(device, base)));
        }
    }

    /// Whether frees are left to make or to book: the sweep is not over until they are.
    pub fn frees_left(&self) -> bool {
        !self.to_free.is_empty() || !self.freed.is_empty()
    }

    /// What the batches do with a segment that is not settled.
    fn unsettled(&self) -> Unsettled {
        match self.settled {
            Some(_) => Unsettled::Skip,
            None => Unsettled::Wait,
        }
    }

    /// The place to look at next, before `below` (once a step begins: the end of a list of
    /// `len`), kept within the list, which may have shrunk between batches.
    fn cursor(&mut self, len: usize) -> usize {
        let at = self.below.unwrap_or(len).min(len);
        self.below = Some(at);
        at
    }

    /// The step the next batch begins with, for the benchmark probe.
    #[cfg(feature = "hold-probe")]
    pub fn step_name(&self) -> &'static str {
        match self.step {
            Step::Parked => "parked",
            Step::Pending => "pending",
            Step::Stuck => "stuck",
            Step::Segments => "segments",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Step {
    #[default]
    Parked,
    Pending,
    Stuck,
    Segments,
}

impl DevicePool {
    /// One batch of a sweep returning all cached memory to the driver, doing at most: merging
    /// `PARKED_PER_SEGMENT * segments` parked blocks, waiting for `segments` pending blocks,
    /// retrying `segments` ranges kept after a failure, returning `segments` idle segments (in
    /// virtual-memory mode: looking at `LOOKS_PER_SEGMENT * segments` segments, taking apart at
    /// most `segments` of them, and returning at most `2 * segments` handles mapped nowhere).
    /// Pending blocks, segments and handles stop early once `over()` says the batch has run long
    /// enough (after one at least). Returns the bytes returned and whether another batch is
    /// needed.
    pub fn free_reusable_batch(
        &mut self,
        cx: &Context<'_>,
        sweep: &mut Sweep,
        segments: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<(u64, bool)> {
        let segments = segments.max(1);
        let booked = self.book_frees(cx, sweep)?;
        if let Some(releases) = sweep.settled {
            self.settled_at(releases);
        }
        // Memory going back to the driver: growth after it starts afresh, with no headroom.
        self.headroom.reset();
        if sweep.step == Step::Parked {
            if !self.flush_parked_upto(PARKED_PER_SEGMENT * segments) {
                return Ok((booked, true));
            }
            sweep.step = Step::Pending;
        }
        if sweep.step == Step::Pending {
            if !self.wait_pending(cx, sweep, segments, over)? {
                return Ok((booked, true));
            }
            sweep.below = None;
            sweep.step = Step::Stuck;
        }
        if sweep.step == Step::Stuck {
            // Ranges whose undoing failed first: once unmapped, their handles can go back too.
            if !self.retry_stuck(cx, segments)? {
                return Ok((booked, true));
            }
            sweep.step = Step::Segments;
        }
        if matches!(self.vmm, VmmMode::On(_)) {
            let (released, more) = self.sweep_stitched(cx, sweep, segments, over)?;
            return Ok((booked + released, more));
        }
        self.take_idle_segments(cx, sweep, segments, over)?;
        Ok((booked, sweep.below != Some(0) || sweep.frees_left()))
    }

    /// Book what the driver answered to the frees of the last batch (see the module's
    /// documentation). Returns the bytes returned, or (after booking every answer) the first
    /// failure.
    pub fn book_frees(&mut self, cx: &Context<'_>, sweep: &mut Sweep) -> Result<u64> {
        let mut returned = 0;
        let mut failure = None;
        for (base, answer) in sweep.freed.drain(..) {
            let at = self
                .returning
                .iter()
                .position(|r| r.base == base)
                .expect("a segment freed by the sweep is returning");
            let r = self.returning.swap_remove(at);
            match answer {
                Ok(()) => {
                    self.stats.remove_reserved(r.size, 1);
                    returned += r.size;
                }
                Err(e) => {
                    // Still the driver's allocation, and ours: idle again.
                    let id =
                        self.install_segment(cx, r.base, r.size, r.class, r.stream, Vec::new());
                    debug_assert_eq!(self.blocks[id].ptr, r.base);
                    self.segments[self.blocks[id].segment].released = self.settled;
                    failure.get_or_insert(Error::driver(
                        &format!("returning segment {base:#x} to the driver"),
                        &e,
                    ));
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(returned),
        }
    }

    /// Wait for the events of up to `count` pending blocks and free them, the last listed
    /// first, stopping early once `over()`. A sweep that waited for the device without the lock
    /// waits only for the events of blocks released before, which that wait completed: of the
    /// others it only asks whether they completed, and leaves pending those that did not.
    /// Returns whether every pending block was looked at.
    fn wait_pending(
        &mut self,
        cx: &Context<'_>,
        sweep: &mut Sweep,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<bool> {
        let mut at = sweep.cursor(self.pending.len());
        for _ in 0..count {
            if at == 0 {
                break;
            }
            at -= 1;
            sweep.below = Some(at);
            // Freed, a block leaves the list; the last one takes its place, looked at already
            // (or pending since the sweep began).
            let wait =
                sweep.unsettled() == Unsettled::Wait || self.pending[at].released <= self.settled;
            self.free_pending_if_done(cx, at, wait)?;
            if over() {
                break;
            }
        }
        Ok(at == 0)
    }

    /// Take up to `count` idle classic segments out of the books for the caller to free (see
    /// the module's documentation), the last listed first, those not settled waited for or
    /// skipped (as `sweep` says), stopping early once `over()`.
    fn take_idle_segments(
        &mut self,
        cx: &Context<'_>,
        sweep: &mut Sweep,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<()> {
        let unsettled = sweep.unsettled();
        let mut at = sweep.cursor(self.idle.len());
        let mut looked = 0;
        while at > 0 && sweep.to_free.len() < count && looked < LOOKS_PER_SEGMENT * count {
            at -= 1;
            looked += 1;
            sweep.below = Some(at);
            let seg = self.idle[IdleAt::at(at)];
            if !self.may_return(cx, seg, unsettled)? {
                continue;
            }
            // Taken out, a segment leaves the idle list; the last one takes its place, looked at
            // already (or idle since the sweep began).
            let s = &self.segments[seg];
            let r = Returning {
                base: s.base,
                size: s.size,
                class: s.class,
                stream: self.slots[s.slot].handle,
            };
            // Out of the span map before the driver can hand the addresses to another device.
            cx.spans.remove(r.base, r.size);
            self.forget_segment(seg);
            self.returning.push(r);
            sweep.to_free.push(r.base);
            if over() {
                break;
            }
        }
        Ok(())
    }

    /// One batch of the virtual-memory mode: handles mapped nowhere, then the next segments
    /// from the cursor, those with no block in use taken apart, then the handles that left
    /// mapped nowhere, each within its bound and stopping early once `over()` (after one at
    /// least: a handle left goes back in the next batch).
    fn sweep_stitched(
        &mut self,
        cx: &Context<'_>,
        sweep: &mut Sweep,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<(u64, bool)> {
        let mut released = self.release_unused_upto(cx, count, over)?;
        let unsettled = sweep.unsettled();
        let (mut taken, mut looked) = (0, 0);
        while sweep.next < self.segments.len()
            && taken < count
            && looked < LOOKS_PER_SEGMENT * count
        {
            let seg = SegId::at(sweep.next);
            sweep.next += 1;
            looked += 1;
            if !self.dismantle_if_unused(cx, seg, unsettled)? {
                continue;
            }
            taken += 1;
            if over() {
                break;
            }
        }
        released += self.release_unused_upto(cx, count, over)?;
        let more = sweep.next < self.segments.len() || self.has_unused_handles();
        if !more {
            // Last, the address chunks left unused: a few calls at most.
            self.release_unused_chunks(cx)?;
        }
        Ok((released, more))
    }

    /// Release up to `count` handles mapped nowhere, largest first, stopping early once
    /// `over()` (after one at least). Returns the bytes returned.
    fn release_unused_upto(
        &mut self,
        cx: &Context<'_>,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<u64> {
        let mut released = 0;
        for _ in 0..count {
            let bytes = self.release_unused(cx, u64::MAX, 1)?;
            released += bytes;
            if bytes == 0 || over() {
                break;
            }
        }
        Ok(released)
    }
}

#[cfg(test)]
impl DevicePool {
    /// How many vacant segments still hold an allocated list of runs (for tests).
    pub(crate) fn vacant_with_runs_room(&self) -> usize {
        self.vacant_segments
            .iter()
            .filter(|&&seg| self.segments[seg].runs.capacity() > 0)
            .count()
    }
}
