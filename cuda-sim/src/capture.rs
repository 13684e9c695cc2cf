//! Stream capture: which streams are capturing a CUDA graph, and the calls a capture forbids.
//!
//! While a stream captures, its work is recorded into a graph instead of running. The driver
//! then refuses what would make the graph depend on work outside it or make the host wait for
//! work that will not run (the CUDA Programming Guide, "Prohibited and Unhandled Operations"),
//! and the refusal invalidates the capture, so that ending it fails too:
//!
//! - `cuStreamWaitEvent` on a capturing stream for an event recorded outside its capture:
//!   `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`;
//! - waiting for the device (`cuCtxSynchronize`), for a capturing stream
//!   (`cuStreamSynchronize`, `cuStreamQuery`), or for any event (`cuEventSynchronize`,
//!   `cuEventQuery`, prohibited in the default, global capture mode), and `cuMemFree` (which
//!   waits for the device), while a stream of the device captures:
//!   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, every capture on the device invalidated;
//! - asking after an event last recorded in a capture (`cuEventQuery`, `cuEventSynchronize`), or
//!   making a stream outside that capture wait for it, once the capture is over too:
//!   `CUDA_ERROR_CAPTURED_EVENT` (it stands for work of the graph, which runs at its launches).
//!
//! Creating and mapping memory (`cuMemAlloc`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`)
//! stays allowed, as in CUDA's relaxed capture mode, which PyTorch's allocator uses for them.
//! The default stream cannot capture here (the legacy stream cannot on the driver).

use std::collections::HashMap;

use crate::codes::*;
use crate::streams::StreamKey;
use crate::{Call, CuError, CuResult, Sim, State};

/// `CUstreamCaptureStatus`: not capturing.
pub const CAPTURE_STATUS_NONE: u32 = 0;
/// `CUstreamCaptureStatus`: capturing.
pub const CAPTURE_STATUS_ACTIVE: u32 = 1;
/// `CUstreamCaptureStatus`: capturing, but invalidated by a refused call.
pub const CAPTURE_STATUS_INVALIDATED: u32 = 2;

/// The captures under way: whether each was invalidated.
#[derive(Debug, Default)]
pub(crate) struct Captures(HashMap<StreamKey, bool>);

impl Captures {
    /// Whether `key` is capturing.
    pub(crate) fn capturing(&self, key: StreamKey) -> bool {
        self.0.contains_key(&key)
    }
}

impl State {
    /// Refuse a call that waits for work while a stream of `dev` captures, invalidating every
    /// capture on the device.
    pub(crate) fn refuse_wait_while_capturing(&mut self, dev: i32) -> CuResult<()> {
        let on_device: Vec<StreamKey> = (self.captures.0.keys().copied())
            .filter(|&key| self.key_device(key) == Some(dev))
            .collect();
        if on_device.is_empty() {
            return Ok(());
        }
        for key in on_device {
            self.captures.0.insert(key, true);
        }
        Err(CuError(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
    }

    /// Refuse a query or host wait of `event` where it was last recorded in a capture.
    pub(crate) fn refuse_captured_event(&self, event: u64) -> CuResult<()> {
        match self.events.get(&event).and_then(|e| e.recorded_in) {
            Some(_) => Err(CuError(CUDA_ERROR_CAPTURED_EVENT)),
            None => Ok(()),
        }
    }

    /// Refuse a wait of stream `key` for `event` across a capture's bounds: a capturing stream
    /// for an event recorded outside its capture (the capture invalidated), or any other stream
    /// for an event recorded in a capture.
    pub(crate) fn refuse_isolated_wait(&mut self, key: StreamKey, event: u64) -> CuResult<()> {
        if !self.captures.capturing(key) {
            return self.refuse_captured_event(event);
        }
        if self.events.get(&event).and_then(|e| e.recorded_in) == Some(key) {
            return Ok(());
        }
        self.captures.0.insert(key, true);
        Err(CuError(CUDA_ERROR_STREAM_CAPTURE_ISOLATION))
    }
}

std::thread_local! {
    /// The calling thread's `CUstreamCaptureMode` (0 global, the default; 1 thread-local;
    /// 2 relaxed).
    static MODE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

impl Sim {
    /// `cuThreadExchangeStreamCaptureMode`: the calling thread's capture mode becomes `mode`;
    /// returns the old one. The simulator refuses waits during a capture whatever the mode.
    pub fn thread_exchange_capture_mode(&self, mode: u32) -> CuResult<u32> {
        let _st = self.call(Call::ThreadExchangeStreamCaptureMode)?;
        if mode > 2 {
            return Err(CuError(CUDA_ERROR_INVALID_VALUE));
        }
        Ok(MODE.with(|m| m.replace(mode)))
    }

    /// `cuStreamBeginCapture`: `stream` (a created stream of `dev`) begins capturing a graph.
    /// The default stream fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, a stream already
    /// capturing with `CUDA_ERROR_ILLEGAL_STATE`.
    pub fn stream_begin_capture(&self, dev: i32, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamBeginCapture)?;
        let key = st.stream_key(dev, stream)?;
        if stream == 0 {
            return Err(CuError(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
        }
        if st.captures.capturing(key) {
            return Err(CuError(CUDA_ERROR_ILLEGAL_STATE));
        }
        st.captures.0.insert(key, false);
        Ok(())
    }

    /// `cuStreamEndCapture`: the capture on `stream` ends; `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`
    /// where a refused call invalidated it, `CUDA_ERROR_ILLEGAL_STATE` where none was under way.
    pub fn stream_end_capture(&self, dev: i32, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamEndCapture)?;
        let key = st.stream_key(dev, stream)?;
        match st.captures.0.remove(&key) {
            None => Err(CuError(CUDA_ERROR_ILLEGAL_STATE)),
            Some(true) => Err(CuError(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)),
            Some(false) => Ok(()),
        }
    }

    /// `cuStreamIsCapturing`: the stream's `CUstreamCaptureStatus` ([`CAPTURE_STATUS_NONE`],
    /// [`CAPTURE_STATUS_ACTIVE`] or [`CAPTURE_STATUS_INVALIDATED`]).
    pub fn stream_is_capturing(&self, dev: i32, stream: u64) -> CuResult<u32> {
        let mut st = self.call(Call::StreamIsCapturing)?;
        let key = st.stream_key(dev, stream)?;
        Ok(match st.captures.0.get(&key) {
            None => CAPTURE_STATUS_NONE,
            Some(false) => CAPTURE_STATUS_ACTIVE,
            Some(true) => CAPTURE_STATUS_INVALIDATED,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn sim() -> Sim {
        let s = Sim::new(&[1 << 30, 1 << 30]);
        s.init().unwrap();
        s
    }

    fn err<T: std::fmt::Debug>(r: CuResult<T>) -> i32 {
        r.unwrap_err().0
    }

    #[test]
    fn a_capture_begins_and_ends_on_a_created_stream() {
        let s = sim();
        let c = s.stream_create(0).unwrap();
        assert_eq!(s.stream_is_capturing(0, c).unwrap(), CAPTURE_STATUS_NONE);
        assert_eq!(
            err(s.stream_begin_capture(0, 0)),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(err(s.stream_end_capture(0, c)), CUDA_ERROR_ILLEGAL_STATE);
        s.stream_begin_capture(0, c).unwrap();
        assert_eq!(err(s.stream_begin_capture(0, c)), CUDA_ERROR_ILLEGAL_STATE);
        assert_eq!(s.stream_is_capturing(0, c).unwrap(), CAPTURE_STATUS_ACTIVE);
        // Memory is made and mapped during a capture, as in the relaxed mode.
        let p = s.mem_alloc(0, 2 * MIB).unwrap();
        let h = s.mem_create(0, 2 * MIB).unwrap();
        // Events recorded on other streams, and waits within the capture, are allowed.
        let (e, f) = (s.event_create(0).unwrap(), s.event_create(0).unwrap());
        s.event_record(0, e, 0).unwrap();
        s.event_record(0, f, c).unwrap();
        s.stream_wait_event(0, c, f).unwrap();
        s.stream_end_capture(0, c).unwrap();
        assert_eq!(s.stream_is_capturing(0, c).unwrap(), CAPTURE_STATUS_NONE);
        s.mem_free(p).unwrap();
        s.mem_release(h).unwrap();
    }

    #[test]
    fn an_event_recorded_in_a_capture_is_not_asked_after() {
        let s = sim();
        let (a, c) = (s.stream_create(0).unwrap(), s.stream_create(0).unwrap());
        let e = s.event_create(0).unwrap();
        s.stream_begin_capture(0, c).unwrap();
        s.event_record(0, e, c).unwrap();
        s.stream_end_capture(0, c).unwrap();
        assert_eq!(err(s.event_query(e)), CUDA_ERROR_CAPTURED_EVENT);
        assert_eq!(err(s.event_synchronize(e)), CUDA_ERROR_CAPTURED_EVENT);
        assert_eq!(err(s.stream_wait_event(0, a, e)), CUDA_ERROR_CAPTURED_EVENT);
        // Recorded again outside a capture, it is an event as any.
        s.event_record(0, e, c).unwrap();
        assert!(s.event_query(e).unwrap());
    }

    #[test]
    fn waits_during_a_capture_are_refused_and_invalidate_it() {
        let s = sim();
        let (a, c) = (s.stream_create(0).unwrap(), s.stream_create(0).unwrap());
        let e = s.event_create(0).unwrap();
        s.enqueue_work(0, a).unwrap();
        s.event_record(0, e, a).unwrap();
        let p = s.mem_alloc(0, 2 * MIB).unwrap();
        // A capturing stream waiting for work outside its capture.
        s.stream_begin_capture(0, c).unwrap();
        assert_eq!(
            err(s.stream_wait_event(0, c, e)),
            CUDA_ERROR_STREAM_CAPTURE_ISOLATION
        );
        assert_eq!(
            s.stream_is_capturing(0, c).unwrap(),
            CAPTURE_STATUS_INVALIDATED
        );
        assert_eq!(
            err(s.stream_end_capture(0, c)),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        // The host waiting while a stream of the device captures; another device may.
        type Wait = fn(&Sim, u64, u64, u64) -> CuResult<()>;
        let waits: [(&str, Wait); 6] = [
            ("cuCtxSynchronize", |s, _, _, _| s.synchronize(0)),
            ("cuStreamSynchronize", |s, c, _, _| {
                s.stream_synchronize(0, c)
            }),
            ("cuStreamQuery", |s, c, _, _| s.stream_query(0, c).map(drop)),
            ("cuEventSynchronize", |s, _, e, _| s.event_synchronize(e)),
            ("cuEventQuery", |s, _, e, _| s.event_query(e).map(drop)),
            ("cuMemFree", |s, _, _, p| s.mem_free(p)),
        ];
        for (name, wait) in waits {
            s.stream_begin_capture(0, c).unwrap();
            s.synchronize(1).unwrap();
            assert_eq!(
                err(wait(&s, c, e, p)),
                CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "{name}"
            );
            assert_eq!(
                err(s.stream_end_capture(0, c)),
                CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                "{name}"
            );
            wait(&s, c, e, p).unwrap();
        }
        assert_eq!(s.pending_work(0, a).unwrap(), 0);
    }
}
