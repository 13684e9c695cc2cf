//! Growth's memory-creating driver calls, made without the device's lock.
//!
//! `cuMemAlloc` and `cuMemCreate` take tens of microseconds on a GPU, more for large sizes (a
//! page table to fill), and `cuMemAlloc` may wait for the device. Made under the device's lock,
//! each held every other thread's reserve and release on the device behind it, even those the
//! cache serves: one stream's growth serialized another stream's work on other memory. So
//! `Pool::reserve` and `Pool::warmup` take two passes over the usual path (`DevicePool::reserve`,
//! `DevicePool::warmup`):
//!
//! 1. Under the lock, with growth *deferred*: where the growth policy (`obtain`) would call the
//!    driver for new memory and has nothing to do first (the cap, counting other threads'
//!    growth in flight, and the driver's free memory both leave room for it), it notes a
//!    [`Plan`] and the pass unwinds through its usual failure path (cached pages lent to the new
//!    range go back; the headroom's state and the count of reserve calls are restored).
//! 2. Without the lock, the plan's call ([`Plan::make`]). A stitched range made of new memory
//!    alone (nothing cached to map into it) is also mapped and made accessible there
//!    (`cuMemMap`, `cuMemSetAccess`, 19 µs each on an H200), into addresses pass 1 took; a
//!    mapping that fails is undone under the lock in pass 3 (the handle kept as spare pages)
//!    and reported, as a mapping that fails under the lock is. A range that maps cached pages
//!    is mapped under the lock, in pass 3: its pages are lent out of other ranges' books.
//! 3. Under the lock, the usual path again, the call's answer *prepared*: where the growth
//!    policy asks for the same bytes of the same kind, it takes the new memory instead of
//!    calling the driver, or goes on from the driver's refusal as from its own first try (out
//!    of memory: pending blocks waited for, the cache returned, one more try; any other error
//!    reported), so a growth makes the driver calls a single pass would. It decides with the
//!    driver's free memory as pass 1 saw it. With the books unchanged meanwhile, pass 3 decides
//!    as pass 1 did, but for the steps before growth, which may find more to do the second
//!    time (an idle range whose lent pages came back in pass 1 gives its own back): on the
//!    replays of `scripts/policy-check.py`, peaks, creating calls and out-of-memory failures are
//!    those of a single pass. Where other threads changed the books meanwhile and pass 3 does
//!    not take the new memory, it is booked as cache (an idle segment, or spare pages: a range
//!    is unmapped), reusable and returned as any; above a cap lowered meanwhile, idle cache goes
//!    back to the driver until the pool is under it.
//!
//! The memory in flight counts against the cap (`growing`) from pass 1 to pass 3, so two threads
//! growing at once never take the pool past it. A driver that panics under the lock in either
//! pass leaves no plan behind, and memory already made is booked before the panic goes on.

use std::panic::AssertUnwindSafe;

use super::deferred::not_made;
use super::phys::Pages;
use super::*;
use crate::driver::{Driver, DriverResult};

/// What the growth policy creates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backing {
    /// A classic segment (`cuMemAlloc`) of this class, for this stream.
    Segment(Class, StreamHandle),
    /// A physical handle (`cuMemCreate`), for a stitched range.
    Handle,
    /// A physical handle that is a stitched range alone: made without the lock, it is also
    /// mapped (`cuMemMap`, `cuMemSetAccess`) into addresses the first pass took; under the lock,
    /// only created, as a handle.
    Range,
}

/// New memory from the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fresh {
    /// A classic segment.
    Segment(DevicePtr),
    /// A physical handle.
    Handle(PhysHandle),
    /// A physical handle mapped at this address, accessible.
    Range(PhysHandle, DevicePtr),
}

/// What the call of a [`Plan`] made.
#[derive(Debug)]
pub struct Made {
    result: DriverResult<Fresh>,
    /// For a range that failed after its handle was created: the handle, and the bytes mapped.
    leftover: Option<(PhysHandle, u64)>,
}

impl Backing {
    /// Ask `driver` for `bytes` of this kind on `device`.
    pub(super) fn create(
        self,
        driver: &dyn Driver,
        device: i32,
        bytes: u64,
    ) -> DriverResult<Fresh> {
        match self {
            Backing::Segment(..) => driver.mem_alloc(device, bytes).map(Fresh::Segment),
            Backing::Handle | Backing::Range => driver.vmm_create(device, bytes).map(Fresh::Handle),
        }
    }
}

/// A creation the first pass deferred, to make without the device's lock.
#[derive(Debug)]
pub struct Plan {
    device: i32,
    backing: Backing,
    bytes: u64,
    /// For a range: the addresses the first pass took for it.
    base: Option<DevicePtr>,
    /// The driver's `(free, total)` as the first pass saw them.
    driver_info: (u64, u64),
}

impl Plan {
    /// Make the calls through `driver`, without the device's lock. A driver that panics fails
    /// the call (`CUDA_ERROR_UNKNOWN`) instead of unwinding past the memory counted in flight.
    pub fn make(&self, driver: &dyn Driver) -> Made {
        let (device, bytes) = (self.device, self.bytes);
        let mut leftover = None;
        let mut call = match self.backing {
            Backing::Segment(..) => "cuMemAlloc_v2",
            Backing::Handle | Backing::Range => "cuMemCreate",
        };
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let fresh = self.backing.create(driver, device, bytes)?;
            let (Fresh::Handle(handle), Some(base)) = (fresh, self.base) else {
                return Ok(fresh);
            };
            leftover = Some((handle, 0));
            call = "cuMemMap";
            driver.vmm_map(device, base, bytes, handle, 0)?;
            leftover = Some((handle, bytes));
            call = "cuMemSetAccess";
            driver.vmm_set_access(device, base, bytes)?;
            leftover = None;
            Ok(Fresh::Range(handle, base))
        }))
        .unwrap_or_else(|_| Err(not_made(call, "the driver panicked")));
        Made { result, leftover }
    }
}

/// Memory the call of a [`Plan`] made, for the second pass.
#[derive(Debug)]
pub(super) struct Prepared {
    backing: Backing,
    bytes: u64,
    /// The call's answer: the memory, or why the driver refused it (then the second pass goes
    /// on from that failure, as the usual path from its first try).
    pub(super) made: DriverResult<Fresh>,
    /// The driver's `(free, total)` as the first pass saw them.
    pub(super) driver_info: (u64, u64),
}

/// What the first pass came to.
pub enum Pass<T> {
    /// Done (or failed) under the lock.
    Done(Result<T>),
    /// New memory is to be made first, without the lock.
    Grow(Plan),
}

impl DevicePool {
    /// Run `f`, one of the usual paths, with growth deferred (the first pass).
    pub fn deferring<T>(&mut self, f: impl FnOnce(&mut DevicePool) -> Result<T>) -> Pass<T> {
        let (headroom, reserve_calls) = (self.headroom, self.stats.reserve_calls);
        self.defer = true;
        let done = std::panic::catch_unwind(AssertUnwindSafe(|| f(self)));
        self.defer = false;
        let done = done.unwrap_or_else(|panic| {
            // A driver that panicked under the lock: no plan outlives the pass (the lock is
            // taken over, see `Pool::lock`).
            if let Some(plan) = self.plan.take() {
                self.growing -= plan.bytes;
                if let Some(base) = plan.base {
                    self.carved -= plan.bytes;
                    self.addresses.give(base, plan.bytes);
                }
            }
            std::panic::resume_unwind(panic)
        });
        match self.plan.take() {
            Some(plan) => {
                debug_assert!(done.is_err(), "a deferred growth unwinds its pass");
                self.headroom = headroom;
                self.stats.reserve_calls = reserve_calls;
                Pass::Grow(plan)
            }
            None => Pass::Done(done),
        }
    }

    /// Run `f` again (the second pass) with what `plan`'s call made prepared for it; what `f`
    /// does not take is booked as cache afterwards.
    pub fn prepared<T>(
        &mut self,
        cx: &Context<'_>,
        plan: Plan,
        made: Made,
        f: impl FnOnce(&mut DevicePool) -> Result<T>,
    ) -> Result<T> {
        self.growing -= plan.bytes;
        if plan.base.is_some() {
            self.carved -= plan.bytes;
        }
        if let (Some(base), Err(err)) = (plan.base, &made.result) {
            // A range not made: its addresses back, and a handle created for it kept as spare
            // pages once unmapped (or kept with the range to retry, if the unmap fails).
            match made.leftover {
                Some((handle, mapped)) => {
                    self.keep_pages_of(cx, handle, base, plan.bytes, mapped);
                    // Mapping failed where creating did not: reported, as when a range fails
                    // to map under the lock (not made again from the pages just kept).
                    let what = match mapped {
                        0 => "mapping new memory into a new segment",
                        _ => "setting access to a new segment",
                    };
                    return Err(Error::driver(what, err));
                }
                None => self.addresses.give(base, plan.bytes),
            }
        }
        self.prepared = Some(Prepared {
            backing: plan.backing,
            bytes: plan.bytes,
            made: made.result,
            driver_info: plan.driver_info,
        });
        // Booked whether the pass takes it, fails, or unwinds (a driver that panicked under the
        // lock): memory the driver made never leaves the books.
        let done = std::panic::catch_unwind(AssertUnwindSafe(|| f(self)));
        if let Some(unused) = self.prepared.take() {
            self.book_fresh(cx, unused);
        }
        done.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// In the first pass, whether to defer creating `bytes` of `backing` (then noted as the
    /// plan): nothing need go back first, to the cap or for the driver's `driver_free` bytes. A
    /// range takes its addresses now.
    pub(super) fn defer_growth(
        &mut self,
        cx: &Context<'_>,
        backing: Backing,
        bytes: u64,
        driver_free: u64,
    ) -> Result<bool> {
        let room = self.room_under_cap();
        if !self.defer || self.plan.is_some() || bytes > room || bytes > driver_free {
            return Ok(false);
        }
        let base = match backing {
            Backing::Range => {
                let base = self.take_addresses(cx, bytes)?;
                self.carved += bytes;
                Some(base)
            }
            _ => None,
        };
        self.growing += bytes;
        self.plan = Some(Plan {
            device: self.device,
            backing,
            bytes,
            base,
            driver_info: (driver_free, self.driver_total),
        });
        Ok(true)
    }

    /// Hold `handle`, just created, of `bytes`: its pages owned by the range being made, and
    /// counted as reserved.
    fn keep_handle(&mut self, handle: PhysHandle, bytes: u64) {
        self.phys.add(handle, bytes);
        self.stats.add_reserved(bytes, 1);
    }

    /// In the second pass, the prepared memory if it is `bytes` of `backing`; other prepared
    /// memory is booked as cache now, before the policy looks at the cache or the cap.
    pub(super) fn take_prepared(
        &mut self,
        cx: &Context<'_>,
        backing: Backing,
        bytes: u64,
    ) -> Option<Prepared> {
        let p = self.prepared.take()?;
        if p.backing == backing && p.bytes == bytes {
            return Some(p);
        }
        self.book_fresh(cx, p);
        None
    }

    /// Keep prepared memory the second pass did not take, as cache (an idle segment, or spare
    /// pages); where a cap lowered meanwhile leaves no room for it, idle cache goes back to the
    /// driver until the pool is under it, as growth under a cap returns it.
    fn book_fresh(&mut self, cx: &Context<'_>, p: Prepared) {
        let Ok(fresh) = p.made else {
            return;
        };
        match (fresh, p.backing) {
            (Fresh::Segment(ptr), Backing::Segment(class, stream)) => {
                self.stats.add_reserved(p.bytes, 1);
                self.install_segment(cx, ptr, p.bytes, class, stream, Vec::new());
            }
            (Fresh::Handle(handle), _) => {
                self.keep_handle(handle, p.bytes);
                self.give_whole(handle, p.bytes);
            }
            (Fresh::Range(handle, base), _) => {
                // Unmapped under the lock: a path taken only when the books moved meanwhile.
                self.keep_pages_of(cx, handle, base, p.bytes, p.bytes);
            }
            (Fresh::Segment(_), _) => unreachable!("a segment made for a handle"),
        }
        if let Some(limit) = self.limit {
            let over = (self.stats.reserved_bytes + self.growing).saturating_sub(limit);
            if over > 0 {
                match self.release_idle(cx, over) {
                    Ok(back) => self.log(format_args!(
                        "returned {} of idle cache: memory made meanwhile took the pool past \
                         its cap",
                        human(back)
                    )),
                    Err(e) => self.log(format_args!("{}; kept above the cap", e.message)),
                }
            }
        }
    }

    /// Keep `handle` (`bytes`, just created for a range at `base` that is not made, `mapped`
    /// bytes of it mapped there) as spare pages, the range unmapped and its addresses back; or
    /// kept with the range to retry, if the unmap fails.
    fn keep_pages_of(
        &mut self,
        cx: &Context<'_>,
        handle: PhysHandle,
        base: DevicePtr,
        bytes: u64,
        mapped: u64,
    ) {
        self.keep_handle(handle, bytes);
        self.abandon_range(cx, base, bytes, mapped, vec![handle]);
        self.give_whole(handle, bytes);
    }

    /// Every page of `handle` (`bytes`), held, owned by no range any more: spare.
    fn give_whole(&mut self, handle: PhysHandle, bytes: u64) {
        self.phys.give(Pages {
            handle,
            offset: 0,
            size: bytes,
        });
    }
}
