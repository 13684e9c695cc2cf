//! Streams and events: each stream's slot (its bins and parked blocks), the events that order
//! one stream's reuse after another's work, and released blocks pending on other streams.

use super::*;

impl DevicePool {
    /// Free the pending blocks whose events have completed (all of them, waiting, if `wait`).
    pub(super) fn collect_pending(&mut self, cx: &Context<'_>, wait: bool) -> Result<()> {
        let mut i = 0;
        while i < self.pending.len() {
            let mut done = true;
            for &event in &self.pending[i].events {
                let result = if wait {
                    cx.driver
                        .event_synchronize(self.device, event)
                        .map(|()| true)
                } else {
                    cx.driver.event_query(self.device, event)
                };
                match result {
                    Ok(true) => {}
                    Ok(false) => {
                        done = false;
                        break;
                    }
                    Err(e) => {
                        return Err(Error::driver(
                            "checking whether work on other streams using a released block has finished",
                            &e,
                        ))
                    }
                }
            }
            if done {
                let Pending { block, mut events } = self.pending.swap_remove(i);
                self.spare_events.append(&mut events);
                self.free_block(block);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Wait for the events of up to `count` pending blocks and free them, stopping early once
    /// `over()`; whether none is left pending.
    pub(super) fn wait_pending(
        &mut self,
        cx: &Context<'_>,
        count: usize,
        over: &dyn Fn() -> bool,
    ) -> Result<bool> {
        for _ in 0..count {
            let Some(pending) = self.pending.last() else {
                break;
            };
            for &event in &pending.events {
                cx.driver
                    .event_synchronize(self.device, event)
                    .map_err(|e| {
                        Error::driver(
                            "waiting for work on other streams using a released block",
                            &e,
                        )
                    })?;
            }
            let Some(Pending { block, mut events }) = self.pending.pop() else {
                break;
            };
            self.spare_events.append(&mut events);
            self.free_block(block);
            if over() {
                break;
            }
        }
        Ok(self.pending.is_empty())
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

    /// Block the host until all work on every device has completed.
    pub(super) fn synchronize_all(&self, cx: &Context<'_>) -> crate::driver::DriverResult<()> {
        (0..cx.driver.device_count()).try_for_each(|device| cx.driver.synchronize(device))
    }

    /// Order work queued on `to` from now on after the work queued so far on `from`. If the
    /// driver cannot (a destroyed stream, say), wait for the whole device instead.
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
            cx.driver.synchronize(self.device).map_err(|e| {
                Error::driver("ordering a cached segment's reuse on another stream", &e)
            })?;
        }
        Ok(())
    }
}
