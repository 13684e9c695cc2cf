//! Returning all cached memory (`free_reusable`) in batches of bounded work, so that the
//! device's lock can be released between them: parked blocks merged, pending blocks waited for
//! and ranges kept after a failure retried, a bounded number per batch, then idle segments
//! returned a batch at a time. In virtual-memory mode a cursor walks the segments once, taking
//! apart those with no block in use, and the handles that leaves mapped nowhere go back a
//! batch at a time from their own index: no batch looks at every segment or handle.
//!
//! Blocks released by other threads while a sweep runs may stay cached: a segment the cursor
//! has passed is not looked at again, and blocks parked after the first step stay parked.

use super::*;

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
}

impl Sweep {
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
        // Memory going back to the driver: growth after it starts afresh, with no headroom.
        self.headroom.reset();
        if sweep.step == Step::Parked {
            if !self.flush_parked_upto(PARKED_PER_SEGMENT * segments) {
                return Ok((0, true));
            }
            sweep.step = Step::Pending;
        }
        if sweep.step == Step::Pending {
            if !self.wait_pending(cx, segments, over)? {
                return Ok((0, true));
            }
            sweep.step = Step::Stuck;
        }
        if sweep.step == Step::Stuck {
            // Ranges whose undoing failed first: once unmapped, their handles can go back too.
            if !self.retry_stuck(cx, segments)? {
                return Ok((0, true));
            }
            sweep.step = Step::Segments;
        }
        if matches!(self.vmm, VmmMode::On(_)) {
            return self.sweep_stitched(cx, sweep, segments, over);
        }
        let released = self.release_idle_segments(cx, segments, over)?;
        Ok((released, !self.idle.is_empty()))
    }

    /// Return up to `count` idle classic segments to the driver, the last listed first, after
    /// the device's queued work, stopping early once `over()`. Returns the bytes returned.
    fn release_idle_segments(
        &mut self,
        cx: &Context<'_>,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<u64> {
        if self.idle.is_empty() {
            return Ok(0);
        }
        self.wait_before_returning(cx)?;
        let mut released = 0;
        for _ in 0..count {
            // Returned, a segment leaves the idle list.
            let Some(&seg) = self.idle.last() else {
                break;
            };
            let size = self.segments[seg].size;
            self.free_segment(cx, seg)?;
            released += size;
            if over() {
                break;
            }
        }
        Ok(released)
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
        let (mut taken, mut looked, mut waited) = (0, 0, false);
        while sweep.next < self.segments.len()
            && taken < count
            && looked < LOOKS_PER_SEGMENT * count
        {
            let seg = SegId::at(sweep.next);
            sweep.next += 1;
            looked += 1;
            if !self.dismantle_if_unused(cx, seg, &mut waited)? {
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
