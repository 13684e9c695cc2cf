//! The driver calls a sweep (`sweep.rs`) makes without the device's lock, and the booking of
//! their answers.
//!
//! Returning memory takes driver calls that cost tens of microseconds each on a GPU
//! (`cuMemFree`, `cuMemUnmap`, `cuMemRelease`), and a `cuMemFree` may wait for the device's work
//! besides. Made under the device's lock, each held every other thread's miss and release on the
//! device behind it. So a sweep's batch only takes the memory out of the books, under the lock,
//! and queues the call ([`Deferred`]); the caller makes the calls once it let go of the lock
//! ([`Deferred::make`]), and the next batch books the answers ([`DevicePool::book_calls`]):
//!
//! - a classic idle segment leaves the books and the span map into `returning`, still counted
//!   as reserved; freed, it leaves the reserved count; not freed, it is booked again, idle;
//! - a stitched segment is taken apart (its pages back where they came from) and its range,
//!   still mapped, kept as a stuck range *in flight* (`unstitch.rs`), whose handles are not
//!   released meanwhile; unmapped, its addresses go back to their chunk; not unmapped, it stays
//!   stuck, retried by a later sweep;
//! - a handle mapped nowhere leaves the physical books into `releasing`, still counted as
//!   reserved; released, it leaves the reserved count; not released, it is held again, all its
//!   pages spare.
//!
//! Pages of a range being unmapped may be mapped into another range meanwhile: one handle may be
//! mapped in several places at once, and the range's own mapping goes with its unmap.

use std::panic::AssertUnwindSafe;

use super::*;
use crate::driver::{Driver, DriverError, DriverResult};

/// A call a sweep makes without the device's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// `cuMemFree` of a classic segment.
    Free(DevicePtr),
    /// `cuMemUnmap` of a stitched segment's range.
    Unmap(DevicePtr, u64),
    /// `cuMemRelease` of a handle mapped nowhere.
    Release(PhysHandle),
}

impl Call {
    /// The driver function.
    fn name(self) -> &'static str {
        match self {
            Call::Free(_) => "cuMemFree_v2",
            Call::Unmap(..) => "cuMemUnmap",
            Call::Release(_) => "cuMemRelease",
        }
    }
}

/// A classic segment taken out of the books, which the driver is freeing: what booking it
/// again takes, if the driver does not take it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Returning {
    pub(super) base: DevicePtr,
    pub(super) size: u64,
    class: Class,
    stream: StreamHandle,
}

/// The calls a batch queued, and the driver's answers, for the next batch to book.
#[derive(Debug, Default)]
pub struct Deferred {
    calls: Vec<Call>,
    answers: Vec<(Call, DriverResult<()>)>,
}

impl Deferred {
    /// Make the queued calls through `driver` on `device`, without its lock. A call that
    /// panics (a driver wrapper's bug) fails, and so do the calls after it, unmade: the books
    /// take all of them back, as a lock poisoned by a panic is taken over.
    pub fn make(&mut self, driver: &dyn Driver, device: i32) {
        let mut panicked = false;
        for call in self.calls.drain(..) {
            let name = call.name();
            let answer = if panicked {
                Err(not_made(
                    name,
                    "not made: the driver panicked in an earlier call",
                ))
            } else {
                std::panic::catch_unwind(AssertUnwindSafe(|| match call {
                    Call::Free(base) => driver.mem_free(device, base),
                    Call::Unmap(base, size) => driver.vmm_unmap(device, base, size),
                    Call::Release(handle) => driver.vmm_release(device, handle),
                }))
                .unwrap_or_else(|_| {
                    panicked = true;
                    Err(not_made(name, "the driver panicked"))
                })
            };
            self.answers.push((call, answer));
        }
    }

    /// Answer every queued call as not made (the memory is booked again by `book_calls`): the
    /// pass that queued them unwound before they could be made.
    pub(super) fn abandon(&mut self) {
        for call in self.calls.drain(..) {
            let answer = Err(not_made(call.name(), "not made: the pass unwound"));
            self.answers.push((call, answer));
        }
    }

    /// Calls queued.
    pub(super) fn queued(&self) -> usize {
        self.calls.len()
    }

    /// Whether calls are left to make or to book.
    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty() && self.answers.is_empty()
    }
}

/// The answer of a call the driver did not complete: `CUDA_ERROR_UNKNOWN`.
pub(super) fn not_made(call: &'static str, why: &str) -> DriverError {
    DriverError {
        call,
        code: 999,
        name: "CUDA_ERROR_UNKNOWN".to_string(),
        description: why.to_string(),
    }
}

impl DevicePool {
    /// Take the idle classic segment `seg` out of the books, and queue its free.
    pub(super) fn take_out_to_free(
        &mut self,
        cx: &Context<'_>,
        seg: SegId,
        deferred: &mut Deferred,
    ) {
        let s = &self.segments[seg];
        let r = Returning {
            base: s.base,
            size: s.size,
            class: s.class,
            stream: self.slots[s.slot].handle,
        };
        // Out of the span map before the driver can hand the addresses to another device.
        cx.spans.remove(r.base, r.size, self.owner);
        self.forget_segment(seg);
        self.returning.push(r);
        deferred.calls.push(Call::Free(r.base));
    }

    /// Book the answers to unmaps a pass queued (`DevicePool::defer_unmaps`), made since: a
    /// range the driver did not unmap stays kept, retried by `free_reusable`; the request goes
    /// on either way.
    pub(super) fn book_queued(&mut self, cx: &Context<'_>, unmaps: &mut Deferred) {
        if let Err(e) = self.book_calls(cx, unmaps) {
            self.log(format_args!("{}; the request goes on", e.message));
        }
    }

    /// Take the unused stitched segment `seg` apart, and queue the unmap of its range.
    pub(super) fn take_apart_later(
        &mut self,
        cx: &Context<'_>,
        seg: SegId,
        deferred: &mut Deferred,
    ) {
        let (base, size) = self.take_apart_to_unmap(cx, seg);
        deferred.calls.push(Call::Unmap(base, size));
    }

    /// Take the next handle mapped nowhere (and in no range being unmapped or stuck) out of the
    /// books, and queue its release; whether there was one.
    pub(super) fn take_out_to_release(&mut self, deferred: &mut Deferred) -> bool {
        let Some((handle, size)) = self.next_unused_handle() else {
            return false;
        };
        self.phys.remove(handle);
        self.releasing.push((handle, size));
        deferred.calls.push(Call::Release(handle));
        true
    }

    /// Book the driver's answers to the calls `deferred` made (see the module's documentation).
    /// Returns the bytes returned, or (after booking every answer) the first failure.
    pub fn book_calls(&mut self, cx: &Context<'_>, deferred: &mut Deferred) -> Result<u64> {
        let mut returned = 0;
        let mut failure = None;
        for (call, answer) in deferred.answers.drain(..) {
            let ok = answer.is_ok();
            match call {
                Call::Free(base) => {
                    let at = self.returning.iter().position(|r| r.base == base);
                    let r = self
                        .returning
                        .swap_remove(at.expect("a segment being freed"));
                    if ok {
                        self.remove_reserved(r.size, 1);
                        returned += r.size;
                    } else {
                        // Still the driver's allocation, and ours: idle again, settled as before.
                        let id = self.install_segment(
                            cx,
                            (r.base, r.size, 0),
                            r.class,
                            r.stream,
                            Vec::new(),
                        );
                        self.segments[self.blocks[id].segment].released = self.settled;
                    }
                }
                Call::Unmap(base, size) => self.unmapped(base, size, ok),
                Call::Release(handle) => {
                    let at = self.releasing.iter().position(|&(h, _)| h == handle);
                    let (_, size) = self
                        .releasing
                        .swap_remove(at.expect("a handle being released"));
                    if ok {
                        self.remove_reserved(size, 1);
                        returned += size;
                    } else {
                        // Still held, mapped nowhere.
                        self.phys.add(handle, size);
                        self.phys.give(phys::Pages {
                            handle,
                            offset: 0,
                            size,
                        });
                    }
                }
            }
            if let Err(e) = answer {
                let what = match call {
                    Call::Free(base) => format!("returning segment {base:#x} to the driver"),
                    Call::Unmap(base, _) => format!("unmapping cached segment {base:#x}"),
                    Call::Release(_) => "returning cached memory to the driver".to_string(),
                };
                self.log(format_args!("{what} failed ({e}); kept"));
                failure.get_or_insert(Error::driver(&what, &e));
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(returned),
        }
    }
}
