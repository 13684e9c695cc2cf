//! Streams, events and the simulated work they order: what an event captures, what a wait
//! makes later work depend on, and completing work in order.

use crate::codes::*;
use crate::{Call, CuError, CuResult, Sim, State};

/// Identifies a stream inside the simulator: a device's default stream, a
/// created stream by its handle, or a host thread's per-thread default stream
/// of a device (by the thread's number, [`thread_number`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum StreamKey {
    Default(i32),
    Created(u64),
    PerThread(i32, u64),
}

/// `CU_STREAM_LEGACY`: the default stream, by its other name.
pub const CU_STREAM_LEGACY: u64 = 0x1;

/// `CU_STREAM_PER_THREAD`: the calling host thread's own default stream of the
/// device, one per thread, made at its first use as the driver makes it.
pub const CU_STREAM_PER_THREAD: u64 = 0x2;

/// A number for the calling host thread, unique in the process and never
/// reused: which per-thread default stream `CU_STREAM_PER_THREAD` names.
fn thread_number() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

/// "Stream `.0` has completed at least its first `.1` work items": the
/// requirements an event capture consists of.
type Requirement = (StreamKey, u64);

/// Later work on a stream waits for these requirements (from `stream_wait_event`).
#[derive(Debug)]
struct Dependency {
    /// The number of work items enqueued on the stream when the wait was
    /// issued: items with a greater sequence number depend on `requires`.
    position: u64,
    requires: Vec<Requirement>,
}

#[derive(Debug)]
pub(crate) struct StreamState {
    device: i32,
    enqueued: u64,
    completed: u64,
    dependencies: Vec<Dependency>,
    /// Destroyed streams stay until their work has completed, as on the driver.
    destroyed: bool,
}

impl StreamState {
    /// A stream of `device` with no work yet.
    pub(crate) fn new(device: i32) -> StreamState {
        StreamState {
            device,
            enqueued: 0,
            completed: 0,
            dependencies: Vec::new(),
            destroyed: false,
        }
    }
}

#[derive(Debug)]
pub(crate) struct EventState {
    device: i32,
    /// What the last record captured (empty: never recorded).
    captured: Vec<Requirement>,
    /// The capturing stream the last record was made on, if it was made during a capture.
    pub(crate) recorded_in: Option<StreamKey>,
}

/// Adds `req` to `reqs`, keeping one entry per stream with the larger count.
fn merge_requirement(reqs: &mut Vec<Requirement>, req: Requirement) {
    match reqs.iter_mut().find(|r| r.0 == req.0) {
        Some(existing) => existing.1 = existing.1.max(req.1),
        None => reqs.push(req),
    }
}

impl State {
    /// The device of stream `key`, if it is known.
    pub(crate) fn key_device(&self, key: StreamKey) -> Option<i32> {
        match key {
            StreamKey::Default(dev) | StreamKey::PerThread(dev, _) => Some(dev),
            StreamKey::Created(_) => self.streams.get(&key).map(|s| s.device),
        }
    }

    /// Resolves `stream` (0 or `CU_STREAM_LEGACY`: `dev`'s default stream;
    /// `CU_STREAM_PER_THREAD`: the calling thread's, made at its first use) to
    /// a live stream of `dev`.
    pub(crate) fn stream_key(&mut self, dev: i32, stream: u64) -> CuResult<StreamKey> {
        self.device(dev)?;
        if stream == 0 || stream == CU_STREAM_LEGACY {
            return Ok(StreamKey::Default(dev));
        }
        if stream == CU_STREAM_PER_THREAD {
            let key = StreamKey::PerThread(dev, thread_number());
            self.streams
                .entry(key)
                .or_insert_with(|| StreamState::new(dev));
            return Ok(key);
        }
        let key = StreamKey::Created(stream);
        match self.streams.get(&key) {
            Some(s) if !s.destroyed && s.device == dev => Ok(key),
            _ => Err(CuError(CUDA_ERROR_INVALID_HANDLE)),
        }
    }

    fn event(&self, event: u64) -> CuResult<&EventState> {
        self.check_init()?;
        self.events
            .get(&event)
            .ok_or(CuError(CUDA_ERROR_INVALID_HANDLE))
    }

    fn met(&self, req: &Requirement) -> bool {
        // A stream that is gone (destroyed after all its work completed) has
        // nothing left to wait for.
        match self.streams.get(&req.0) {
            Some(s) => s.completed >= req.1,
            None => true,
        }
    }

    /// Everything enqueued on `key` so far, including the waits issued after
    /// its last work item, as a list of requirements.
    fn capture(&self, key: StreamKey) -> Vec<Requirement> {
        let mut reqs = Vec::new();
        if let Some(s) = self.streams.get(&key) {
            if s.enqueued > s.completed {
                reqs.push((key, s.enqueued));
            }
            for dep in &s.dependencies {
                for r in &dep.requires {
                    if !self.met(r) {
                        merge_requirement(&mut reqs, *r);
                    }
                }
            }
        }
        reqs
    }

    /// Completes the work the requirements name, first completing whatever
    /// that work waits on, so that work never completes out of order.
    fn complete(&mut self, reqs: &[Requirement]) {
        let mut stack: Vec<Requirement> = reqs.to_vec();
        while let Some(&(key, count)) = stack.last() {
            let Some(s) = self.streams.get(&key) else {
                stack.pop();
                continue;
            };
            if s.completed >= count {
                stack.pop();
                continue;
            }
            // Items up to `count` depend on every wait issued before them.
            let unmet: Vec<Requirement> = s
                .dependencies
                .iter()
                .filter(|d| d.position < count)
                .flat_map(|d| d.requires.iter().copied())
                .filter(|r| !self.met(r))
                .collect();
            if unmet.is_empty() {
                let s = self.streams.get_mut(&key).expect("stream looked up above");
                s.completed = count;
                s.dependencies.retain(|d| d.position >= count);
                stack.pop();
            } else {
                // Waits only ever name work enqueued before them, so this
                // cannot cycle.
                stack.extend(unmet);
            }
        }
        self.collect_destroyed();
    }

    /// Drops destroyed streams whose work has all completed.
    fn collect_destroyed(&mut self) {
        self.streams
            .retain(|_, s| !(s.destroyed && s.completed == s.enqueued));
    }

    fn complete_stream(&mut self, key: StreamKey) {
        let reqs = self.capture(key);
        self.complete(&reqs);
    }
}

impl Sim {
    /// `cuStreamCreate`: a new stream on `dev`; its handle is non-zero and
    /// unique among all devices' streams and events.
    ///
    /// Created streams do not synchronize implicitly with the default stream
    /// (they behave as `CU_STREAM_NON_BLOCKING` streams).
    pub fn stream_create(&self, dev: i32) -> CuResult<u64> {
        let mut st = self.call(Call::StreamCreate)?;
        st.device(dev)?;
        let handle = st.next_stream;
        st.next_stream += 1;
        st.streams
            .insert(StreamKey::Created(handle), StreamState::new(dev));
        Ok(handle)
    }

    /// `cuStreamDestroy`: destroys a created stream. As on the driver, work
    /// already enqueued on it still completes later (events that captured it
    /// stay incomplete until then). Unknown handles and the default stream
    /// (0) fail with `CUDA_ERROR_INVALID_HANDLE`.
    pub fn stream_destroy(&self, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamDestroy)?;
        st.check_init()?;
        match st.streams.get_mut(&StreamKey::Created(stream)) {
            Some(s) if !s.destroyed => s.destroyed = true,
            _ => return Err(CuError(CUDA_ERROR_INVALID_HANDLE)),
        }
        st.collect_destroyed();
        Ok(())
    }

    /// `cuEventCreate`: a new event on `dev`; its handle is non-zero and
    /// unique among all devices' streams and events.
    pub fn event_create(&self, dev: i32) -> CuResult<u64> {
        let mut st = self.call(Call::EventCreate)?;
        st.device(dev)?;
        let handle = st.next_event;
        st.next_event += 1;
        st.events.insert(
            handle,
            EventState {
                device: dev,
                captured: Vec::new(),
                recorded_in: None,
            },
        );
        Ok(handle)
    }

    /// `cuEventDestroy`: destroys an event (waits already issued on it keep
    /// their meaning).
    pub fn event_destroy(&self, event: u64) -> CuResult<()> {
        let mut st = self.call(Call::EventDestroy)?;
        st.event(event)?;
        st.events.remove(&event);
        Ok(())
    }

    /// `cuEventRecord`: the event captures all work enqueued on `stream` so
    /// far (0: `dev`'s default stream), including the waits issued on it;
    /// recording again replaces the capture. An event or stream of another
    /// device fails with `CUDA_ERROR_INVALID_HANDLE`.
    pub fn event_record(&self, dev: i32, event: u64, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::EventRecord)?;
        let key = st.stream_key(dev, stream)?;
        if st.event(event)?.device != dev {
            return Err(CuError(CUDA_ERROR_INVALID_HANDLE));
        }
        let captured = st.capture(key);
        let recorded_in = st.captures.capturing(key).then_some(key);
        let e = st.events.get_mut(&event).expect("checked above");
        e.captured = captured;
        e.recorded_in = recorded_in;
        Ok(())
    }

    /// `cuEventQuery`: whether the captured work has completed (`true`);
    /// events never recorded are complete.
    pub fn event_query(&self, event: u64) -> CuResult<bool> {
        let mut st = self.call(Call::EventQuery)?;
        let dev = st.event(event)?.device;
        st.refuse_wait_while_capturing(dev)?;
        st.refuse_captured_event(event)?;
        let e = st.event(event)?;
        Ok(e.captured.iter().all(|r| st.met(r)))
    }

    /// `cuEventSynchronize`: the host waits for the captured work, which
    /// therefore completes (with whatever it waits on).
    pub fn event_synchronize(&self, event: u64) -> CuResult<()> {
        let mut st = self.call(Call::EventSynchronize)?;
        let dev = st.event(event)?.device;
        st.refuse_wait_while_capturing(dev)?;
        st.refuse_captured_event(event)?;
        let reqs = st.event(event)?.captured.clone();
        st.complete(&reqs);
        Ok(())
    }

    /// `cuStreamWaitEvent`: work enqueued on `stream` (0: `dev`'s default
    /// stream) after this call cannot complete before the work the event
    /// captured. The event may belong to another device, as on the driver.
    pub fn stream_wait_event(&self, dev: i32, stream: u64, event: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamWaitEvent)?;
        let key = st.stream_key(dev, stream)?;
        st.event(event)?;
        st.refuse_isolated_wait(key, event)?;
        let requires: Vec<Requirement> = st
            .event(event)?
            .captured
            .iter()
            .filter(|r| !st.met(r))
            .copied()
            .collect();
        if requires.is_empty() {
            return Ok(());
        }
        let s = st.streams.get_mut(&key).expect("resolved above");
        let position = s.enqueued;
        match s.dependencies.last_mut() {
            Some(d) if d.position == position => {
                for r in requires {
                    merge_requirement(&mut d.requires, r);
                }
            }
            _ => s.dependencies.push(Dependency { position, requires }),
        }
        Ok(())
    }

    /// `cuStreamSynchronize`: completes everything enqueued on the stream so
    /// far (0: `dev`'s default stream) and what it waits on.
    pub fn stream_synchronize(&self, dev: i32, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamSynchronize)?;
        let key = st.stream_key(dev, stream)?;
        if st.captures.capturing(key) {
            st.refuse_wait_while_capturing(dev)?;
        }
        st.complete_stream(key);
        Ok(())
    }

    /// `cuStreamQuery`: whether everything enqueued on the stream so far,
    /// including the waits issued on it, has completed.
    pub fn stream_query(&self, dev: i32, stream: u64) -> CuResult<bool> {
        let mut st = self.call(Call::StreamQuery)?;
        let key = st.stream_key(dev, stream)?;
        if st.captures.capturing(key) {
            st.refuse_wait_while_capturing(dev)?;
        }
        Ok(st.capture(key).is_empty())
    }

    /// `cuCtxSynchronize`: completes all work on all of the device's streams
    /// (destroyed ones with work left included).
    pub fn synchronize(&self, dev: i32) -> CuResult<()> {
        let mut st = self.call(Call::CtxSynchronize)?;
        st.device(dev)?;
        st.refuse_wait_while_capturing(dev)?;
        let keys: Vec<StreamKey> = st
            .streams
            .iter()
            .filter(|(_, s)| s.device == dev)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            st.complete_stream(key);
        }
        Ok(())
    }

    /// A simulated kernel (not a CUDA call): enqueues one incomplete work
    /// item on the stream (0: `dev`'s default stream) and returns its
    /// sequence number on that stream (1 for the first item).
    pub fn enqueue_work(&self, dev: i32, stream: u64) -> CuResult<u64> {
        let mut st = self.lock();
        let key = st.stream_key(dev, stream)?;
        let s = st.streams.get_mut(&key).expect("resolved above");
        s.enqueued += 1;
        Ok(s.enqueued)
    }

    /// Completes all work enqueued on the stream so far (not a CUDA call),
    /// first completing whatever that work waits on through
    /// [`Sim::stream_wait_event`]. Work completes in order per stream.
    pub fn complete_work(&self, dev: i32, stream: u64) -> CuResult<()> {
        let mut st = self.lock();
        let key = st.stream_key(dev, stream)?;
        st.complete_stream(key);
        Ok(())
    }

    /// The number of incomplete work items on the stream (not a CUDA call).
    pub fn pending_work(&self, dev: i32, stream: u64) -> CuResult<u64> {
        let mut st = self.lock();
        let key = st.stream_key(dev, stream)?;
        let s = &st.streams[&key];
        Ok(s.enqueued - s.completed)
    }

    /// The device a live created stream belongs to; `None` for the default
    /// stream (0) and unknown or destroyed handles. Needs no initialization.
    pub fn stream_device(&self, stream: u64) -> Option<i32> {
        match self.lock().streams.get(&StreamKey::Created(stream)) {
            Some(s) if !s.destroyed => Some(s.device),
            _ => None,
        }
    }

    /// The device a live event belongs to; `None` for unknown handles.
    /// Needs no initialization.
    pub fn event_device(&self, event: u64) -> Option<i32> {
        self.lock().events.get(&event).map(|e| e.device)
    }
}
