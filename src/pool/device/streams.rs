//! Streams and events: each stream's slot (its bins and parked blocks), the events that order
//! one stream's reuse after another's work, released blocks pending on other streams, and the
//! waits for the device's queued work before memory leaves its stream.
//!
//! # Settled memory
//!
//! Work queued before a block was released may still use it, so its memory goes back to the
//! driver, or into a range another stream may use, only after a wait for the device's queued
//! work (`cuCtxSynchronize`). Each release counts one and stamps its segment with the count;
//! each wait records the count it began at (*settled*): a segment stamped no later is settled,
//! and needs no wait of its own. So a pool that waited once waits again only for segments
//! released since, and `Pool::free_reusable` waits before it takes the device's lock, so that
//! no reserve or release on the device waits behind the device's work: its sweep then returns
//! only settled segments (see `sweep.rs`).

use super::*;
use crate::driver::DriverResult;

impl DevicePool {
    /// Free the pending blocks whose events have completed (all of them, waiting, if `wait`).
    pub(super) fn collect_pending(&mut self, cx: &Context<'_>, wait: bool) -> Result<()> {
        let mut i = 0;
        while i < self.pending.len() {
            // Freed, a block leaves the list and the last one takes its place.
            if !self.free_pending_if_done(cx, i, wait)? {
                i += 1;
            }
        }
        Ok(())
    }

    /// Free the pending block at place `i` of the list if the events it waits for have
    /// completed (waiting for them, if `wait`), the last one taking its place; whether it was
    /// freed.
    pub(super) fn free_pending_if_done(
        &mut self,
        cx: &Context<'_>,
        i: usize,
        wait: bool,
    ) -> Result<bool> {
        for &event in &self.pending[i].events {
            let done = if wait {
                cx.driver
                    .event_synchronize(self.device, event)
                    .map(|()| true)
            } else {
                cx.driver.event_query(self.device, event)
            }
            .map_err(|e| {
                Error::driver(
                    "checking whether work on other streams using a released block has finished",
                    &e,
                )
            })?;
            if !done {
                return Ok(false);
            }
        }
        let Pending {
            block, mut events, ..
        } = self.pending.swap_remove(i);
        self.spare_events.append(&mut events);
        self.free_block(block);
        Ok(true)
    }

    /// The stream of block `id` (its segment's).
    pub(super) fn stream_of(&self, id: BlockId) -> StreamHandle {
        let slot = self.segments[self.blocks[id].segment].slot;
        self.slots[slot].handle
    }

    /// The slot of `stream`, made if needed, counting one more segment of it.
    pub(super) fn join_slot(&mut self, stream: StreamHandle) -> SlotId {
        let slot = match self.slot_of.get(&stream) {
            Some(&slot) => slot,
            None => {
                let fresh = StreamSlot {
                    handle: stream,
                    bins: [Bins::default(), Bins::default()],
                    segments: 0,
                    parked: Vec::with_capacity(PARKED_MAX),
                };
                let slot = match self.vacant_slots.pop() {
                    Some(slot) => {
                        self.slots[slot] = fresh;
                        slot
                    }
                    None => self.slots.push(fresh),
                };
                self.slot_of.insert(stream, slot);
                slot
            }
        };
        self.slots[slot].segments += 1;
        slot
    }

    /// A segment left `slot`; the slot is freed with its last segment (its bins are empty then).
    pub(super) fn leave_slot(&mut self, slot: SlotId) {
        let s = &mut self.slots[slot];
        s.segments -= 1;
        if s.segments == 0 {
            debug_assert!(s.bins.iter().all(Bins::is_empty) && s.parked.is_empty());
            self.slot_of.remove(&s.handle);
            self.vacant_slots.push(slot);
        }
    }

    /// Give every event back to the driver: the spare ones and those of pending blocks (the
    /// pool is being dropped). Failures are ignored: the events go with the context anyway.
    pub fn destroy_events(&mut self, cx: &Context<'_>) {
        let pending = self.pending.iter_mut().flat_map(|p| p.events.drain(..));
        for event in self.spare_events.drain(..).chain(pending) {
            let _ = cx.driver.event_destroy(self.device, event);
        }
    }

    pub(super) fn take_event(
        &mut self,
        cx: &Context<'_>,
    ) -> crate::driver::DriverResult<EventHandle> {
        match self.spare_events.pop() {
            Some(event) => Ok(event),
            None => cx.driver.event_create(self.device),
        }
    }

    /// An event capturing the work queued so far on `stream`.
    pub(super) fn record_event(
        &mut self,
        cx: &Context<'_>,
        stream: StreamHandle,
    ) -> crate::driver::DriverResult<EventHandle> {
        let event = self.take_event(cx)?;
        match cx.driver.event_record(self.device, event, stream) {
            Ok(()) => Ok(event),
            Err(err) => {
                self.spare_events.push(event);
                Err(err)
            }
        }
    }

    /// Whether the work that used `seg`'s blocks is done: none was released since the last wait
    /// for the device's queued work began.
    pub(super) fn is_settled(&self, seg: SegId) -> bool {
        self.segments[seg].released <= self.settled
    }

    /// Wait for the device's queued work unless every segment of `segs` is settled already;
    /// `what` names the wait in the error.
    pub(super) fn settle(
        &mut self,
        cx: &Context<'_>,
        segs: impl IntoIterator<Item = SegId>,
        what: &str,
    ) -> Result<()> {
        if segs.into_iter().all(|seg| self.is_settled(seg)) {
            return Ok(());
        }
        self.wait_device(cx).map_err(|e| Error::driver(what, &e))
    }

    /// Block the host until all work on the device has completed: every release so far is
    /// settled.
    pub(super) fn wait_device(&mut self, cx: &Context<'_>) -> DriverResult<()> {
        let releases = self.releases;
        cx.driver.synchronize(self.device)?;
        self.settled = releases;
        Ok(())
    }

    /// Releases counted so far: what a wait for the device's queued work made without the
    /// device's lock settles (see [`DevicePool::settled_at`]).
    pub fn releases(&self) -> u64 {
        self.releases
    }

    /// Whether a block was released since the last wait for the device's queued work began,
    /// and cached memory is left that may need one before it goes back.
    pub fn needs_wait(&self) -> bool {
        self.releases > self.settled && self.stats.reusable() > 0
    }

    /// The caller waited for all work on the device, without its lock, after reading
    /// [`DevicePool::releases`] as `releases`: those releases are settled.
    pub fn settled_at(&mut self, releases: u64) {
        self.settled = self.settled.max(releases);
    }

    /// Block the host until all work on every device has completed.
    pub(super) fn synchronize_all(&self, cx: &Context<'_>) -> crate::driver::DriverResult<()> {
        (0..cx.driver.device_count()).try_for_each(|device| cx.driver.synchronize(device))
    }

    /// Order work queued on `to` from now on after the work queued so far on `from`. If the
    /// driver cannot (a destroyed stream, say, or another thread's per-thread stream), wait for
    /// the whole device instead.
    pub(super) fn order_after(
        &mut self,
        cx: &Context<'_>,
        from: StreamHandle,
        to: StreamHandle,
    ) -> Result<()> {
        let ordered = self.record_event(cx, from).and_then(|event| {
            let waited = cx.driver.stream_wait_event(self.device, to, event);
            self.spare_events.push(event);
            waited
        });
        if ordered.is_err() {
            self.wait_device(cx).map_err(|e| {
                Error::driver("ordering a cached segment's reuse on another stream", &e)
            })?;
        }
        Ok(())
    }
}
