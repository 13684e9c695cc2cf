//! Returning all cached memory (`free_reusable`) in batches of bounded work, so that the
//! device's lock can be released between them: parked blocks merged, pending blocks waited for
//! and ranges kept after a failure retried, a bounded number per batch, then idle segments
//! returned a batch at a time. In virtual-memory mode a cursor walks the segments once, taking
//! apart those with no block in use, and the handles that leaves mapped nowhere go back a
//! batch at a time from their own index: no batch looks at every segment or handle.
//!
//! Blocks released by other threads while a sweep runs may stay cached: a segment the cursor
//! has passed is not looked at again (but the lender of a fragment whose borrower it takes
//! apart), and blocks parked after the first step stay parked.
//!
//! `Pool::free_reusable` waits for the device's queued work before its first batch, without
//! the device's lock ([`Sweep::settled_at`]); its batches then return only memory that wait
//! settled (see `streams.rs`), and leave cached what was released after it began, rather than
//! wait for the device with the lock held.
//!
//! The driver calls that return memory are made without the device's lock too: a batch takes
//! the memory out of the books and queues the calls, the caller makes them once it let go of the
//! lock ([`Sweep::make_calls`]), and the next batch books the answers (`deferred.rs`). So a
//! batch's hold of the lock is bookkeeping only.

use super::deferred::Deferred;
use super::unstitch::Unsettled;
use super::*;
use crate::driver::Driver;

/// Parked blocks merged per batch, for each segment a batch returns: merging is a bin update,
/// far cheaper than a driver call.
const PARKED_PER_SEGMENT: usize = 16;

/// Segments looked at per batch, for each segment a batch may take apart.
const LOOKS_PER_SEGMENT: usize = 8;

/// How far a sweep has come between its batches. Start each sweep with a fresh one.
#[derive(Debug)]
pub struct Sweep {
    step: Step,
    /// Virtual-memory mode: the next segment to look at.
    next: usize,
    /// The pending blocks, and (classic segments) the idle list, from this place on were looked
    /// at already (`None`: from the end of the list when the step begins).
    below: Option<usize>,
    /// The caller waited for all work on the device, without its lock, after this many releases
    /// (0: no wait was needed).
    settled: u64,
    /// The driver calls the last batch queued, and their answers.
    deferred: Deferred,
}

impl Sweep {
    /// A sweep for a caller that waited for all work on the device, without its lock, after
    /// reading [`DevicePool::releases`] as `releases` (0: no wait was needed): its batches
    /// return only the memory released up to then (settled), and wait for nothing with the
    /// lock held.
    pub fn settled_at(releases: u64) -> Sweep {
        Sweep {
            step: Step::default(),
            next: 0,
            below: None,
            settled: releases,
            deferred: Deferred::default(),
        }
    }

    /// Make through `driver`, without `device`'s lock, the driver calls the last batch queued;
    /// the next batch (or [`DevicePool::book_sweep_calls`]) books the answers.
    pub fn make_calls(&mut self, driver: &dyn Driver, device: i32) {
        self.deferred.make(driver, device);
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
        let booked = self.book_calls(cx, &mut sweep.deferred)?;
        self.settled_at(sweep.settled);
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
        let more = if matches!(self.vmm, VmmMode::On(_)) {
            self.sweep_stitched(cx, sweep, segments, over)?
        } else {
            self.take_idle_segments(cx, sweep, segments, over)?;
            sweep.below != Some(0)
        };
        Ok((booked, more || !sweep.deferred.is_empty()))
    }

    /// Book the answers to the calls a failed batch queued and the caller made: the books are
    /// exact again. Returns the bytes returned, or the first failure.
    pub fn book_sweep_calls(&mut self, cx: &Context<'_>, sweep: &mut Sweep) -> Result<u64> {
        self.book_calls(cx, &mut sweep.deferred)
    }

    /// Wait for the events of up to `count` pending blocks and free them, the last listed
    /// first, stopping early once `over()`: only for the events of blocks released before the
    /// sweep's wait for the device, which that wait completed; of the others it only asks whether
    /// they completed, and leaves pending those that did not. Returns whether every pending
    /// block was looked at.
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
            let wait = self.pending[at].released <= self.settled;
            self.free_pending_if_done(cx, at, wait)?;
            if over() {
                break;
            }
        }
        Ok(at == 0)
    }

    /// Take up to `count` idle classic segments out of the books for the caller to free
    /// (`deferred.rs`), the last listed first, those not settled skipped, stopping early once
    /// `over()`.
    fn take_idle_segments(
        &mut self,
        cx: &Context<'_>,
        sweep: &mut Sweep,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<()> {
        let mut at = sweep.cursor(self.idle.len());
        let mut looked = 0;
        while at > 0 && sweep.deferred.queued() < count && looked < LOOKS_PER_SEGMENT * count {
            at -= 1;
            looked += 1;
            sweep.below = Some(at);
            let seg = self.idle[IdleAt::at(at)];
            if !self.may_return(cx, seg, Unsettled::Skip)? {
                continue;
            }
            // Taken out, a segment leaves the idle list; the last one takes its place, looked at
            // already (or idle since the sweep began).
            self.take_out_to_free(cx, seg, &mut sweep.deferred);
            if over() {
                break;
            }
        }
        Ok(())
    }

    /// One batch of the virtual-memory mode: handles mapped nowhere, then the next segments
    /// from the cursor, those with no block in use taken apart, each within its bound and
    /// stopping early once `over()` (after one at least), their calls queued (`deferred.rs`).
    /// The handles a range taken apart leaves mapped nowhere go once its unmap is booked, by a
    /// later batch. Returns whether another batch is needed.
    fn sweep_stitched(
        &mut self,
        cx: &Context<'_>,
        sweep: &mut Sweep,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<bool> {
        while sweep.deferred.queued() < count && self.take_out_to_release(&mut sweep.deferred) {
            if over() {
                break;
            }
        }
        let (mut taken, mut looked) = (0, 0);
        while sweep.next < self.segments.len()
            && taken < count
            && looked < LOOKS_PER_SEGMENT * count
        {
            let seg = SegId::at(sweep.next);
            sweep.next += 1;
            looked += 1;
            if !self.is_unused(seg) || !self.may_return(cx, seg, Unsettled::Skip)? {
                continue;
            }
            // The lender of its fragment, passed over while it lent it, may go now.
            let lender = self.fragment_lender(seg);
            self.take_apart_later(cx, seg, &mut sweep.deferred);
            if let Some(lender) = lender {
                sweep.next = sweep.next.min(lender.index());
            }
            taken += 1;
            if over() {
                break;
            }
        }
        let more = sweep.next < self.segments.len()
            || self.has_unused_handles()
            || !sweep.deferred.is_empty();
        if !more {
            // Last, the address chunks left unused: a few calls at most.
            self.release_unused_chunks(cx)?;
        }
        Ok(more)
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
