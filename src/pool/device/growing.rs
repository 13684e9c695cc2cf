//! Growth's driver calls, made without the device's lock: those that create memory, those that
//! map a new stitched range, and the waits for the device's work that cached memory needs
//! before it is used again.
//!
//! `cuMemAlloc` and `cuMemCreate` take tens of microseconds on a GPU, more for large sizes (a
//! page table to fill), and `cuMemAlloc` may wait for the device; a stitched range costs a
//! `cuMemMap` per piece (up to 64) and a `cuMemSetAccess`, 19 µs each on an H200; a wait for the
//! device (`cuCtxSynchronize`) lasts as long as its queued work. Made under the device's lock,
//! each held every other thread's reserve and release on the device behind it, even those the
//! cache serves: one stream's growth serialized another stream's work on other memory. So
//! `Pool::reserve` and `Pool::warmup` take several passes over the usual path
//! (`DevicePool::reserve_as`, `DevicePool::warmup`):
//!
//! 1. Under the lock, with growth *deferred*: where the growth policy (`obtain`) would call the
//!    driver for new memory and has nothing to do first (the cap, counting other threads'
//!    growth in flight, and the driver's free memory both leave room for it), it notes a
//!    [`Plan`] and the pass unwinds through its usual failure path (cached pages lent to the new
//!    range go back; the headroom's state and the count of reserve calls are restored). A range
//!    made of cached pages alone is noted as soon as its pages are chosen, before any is taken
//!    out of the books or waited for, and so is the wait that idle ranges of lent pages need
//!    before they are taken apart (`return_borrowed`, where they were released since the last
//!    wait): the pass unwinds from there. Once they are settled, a pass takes them apart in the
//!    books and notes their unmaps, and unwinds too: the next pass books the unmaps before it
//!    decides anything, so that it finds their addresses back, as after a single pass.
//! 2. Without the lock, the plan's calls ([`Plan::make`]). A stitched range is also mapped and
//!    made accessible there, into addresses pass 1 took: the cached pages pass 1 chose for it
//!    first, then the new handle; a range made wholly of cached pages makes only those calls.
//!    The handles of the cached pages are *pinned* meanwhile: a sweep on another thread may
//!    take their ranges apart, but releases none of them while the new range maps it. A
//!    mapping that fails is undone under the lock in the next pass (a new handle kept as spare
//!    pages) and reported, as a mapping that fails under the lock is. Where the cached pages'
//!    blocks were released since the last wait for the device (work queued before may still
//!    use them), that wait is made here too, once the range is made, and the next pass finds
//!    them settled (`streams.rs`); a wait that fails is made again under the lock there. A plan
//!    that only waits, or only unmaps, makes only those calls.
//! 3. Under the lock, the usual path again, the calls' answer *prepared*: where the growth
//!    policy asks for the same bytes of the same kind, it takes the new memory instead of
//!    calling the driver, or goes on from the driver's refusal as from its own first try (out
//!    of memory: pending blocks waited for, the cache returned, one more try; any other error
//!    reported), so a growth makes the driver calls a single pass would. It decides with the
//!    driver's free memory as pass 1 saw it. A range's cached pages are chosen again too: the
//!    range made without the lock is taken where they are the same pages (the same pieces of
//!    the same handles, wherever they are cached now), and otherwise unmapped and made again
//!    under the lock from the pages chosen. With the books unchanged meanwhile, this pass
//!    decides as pass 1 did: it does not take apart idle ranges of lent pages again
//!    (`return_borrowed`: pass 1 did, and the lenders its give-backs made idle would give back
//!    more, which a single pass leaves to the next request), nor after a pass that took idle
//!    ranges apart. After a plan that only waited or unmapped, nothing is prepared: the pass
//!    takes the ranges apart (settled now), or grows, and may defer that in turn (steps 1 to 3
//!    once more; `Pool`'s `DEFERRING_PASSES`); a pass with memory prepared defers nothing. On the replays of `scripts/policy-check.py`, every figure is
//!    that of a single pass (checked against the same build with deferral off), no range made
//!    without the lock is made again, and every wait for the device is made without the lock.
//!    Where other threads changed the books meanwhile and the pass does not take the new
//!    memory, it is booked as cache (an idle segment, or spare pages: a range is unmapped),
//!    reusable and returned as any; above a cap lowered meanwhile, idle cache goes back to the
//!    driver until the pool is under it.
//!
//! The memory in flight counts against the cap (`growing`) from the pass that defers it to the
//! next, so two threads growing at once never take the pool past it. A driver that panics under
//! the lock in any pass leaves no plan behind, and memory already made is booked before the
//! panic goes on.

use std::panic::AssertUnwindSafe;

use super::deferred::{not_made, Deferred};
use super::peers::set_access;
use super::phys::Pages;
use super::*;
use crate::driver::{Driver, DriverResult};

/// What the growth policy creates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backing {
    /// A classic segment (`cuMemAlloc`) of this class, for this stream.
    Segment(Class, StreamHandle),
    /// A physical handle (`cuMemCreate`) for a stitched range: made without the lock, the range
    /// is mapped there too (`cuMemMap` of its cached pages, `DevicePool::mapping`, then of the
    /// handle; `cuMemSetAccess`) into addresses the deferring pass took; under the lock, the handle
    /// is only created.
    Range,
    /// No new memory: a stitched range made wholly of cached pages, mapped without the lock.
    Mapping,
    /// No memory at all: the wait for the device's work (`DevicePool::defer_wait`), or the
    /// unmaps of idle ranges taken apart (`DevicePool::defer_unmaps`), made without the lock.
    Wait,
}

/// New memory from the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fresh {
    /// A classic segment.
    Segment(DevicePtr),
    /// A physical handle.
    Handle(PhysHandle),
    /// A physical handle mapped at the end of a range at this address, accessible.
    Range(PhysHandle, DevicePtr),
    /// A range of cached pages alone at this address, accessible.
    Mapped(DevicePtr),
    /// Nothing made: a plan that only waits for the device.
    Waited,
}

/// What the call of a [`Plan`] made.
#[derive(Debug)]
pub struct Made {
    result: DriverResult<Fresh>,
    /// For a range that failed once addresses were to be mapped: the handle created for it (if
    /// any), the bytes mapped from its base, and what failed.
    leftover: Option<Leftover>,
    /// Whether the device's work was waited for after the plan's other calls ([`Plan::wait`]).
    waited: bool,
}

/// What a range that failed without the lock left.
#[derive(Clone, Copy, Debug)]
struct Leftover {
    created: Option<PhysHandle>,
    mapped: u64,
    failed: &'static str,
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
            Backing::Range => driver.vmm_create(device, bytes).map(Fresh::Handle),
            // Never asked of the growth policy: they create nothing.
            Backing::Mapping | Backing::Wait => Err(not_made("cuMemCreate", "nothing to create")),
        }
    }
}

/// A creation (or a range's mapping, or a wait) a pass deferred, to make without the device's
/// lock.
#[derive(Debug)]
pub struct Plan {
    device: i32,
    backing: Backing,
    /// New memory to create.
    bytes: u64,
    /// For a range: the addresses the pass took for it (its cached pages and `bytes`).
    base: Option<DevicePtr>,
    /// For a range: its cached pages, mapped in this order before the new memory.
    pages: Vec<Pages>,
    /// Where memory the plan is for is not settled (`streams.rs`: a range's cached pages, or
    /// the idle ranges a wait is for), the device's count of releases as the pass saw it: the
    /// device's work is waited for after the plan's other calls.
    wait: Option<u64>,
    /// The driver's `(free, total)` as the deferring pass saw them.
    driver_info: (u64, u64),
    /// For a wait plan: the unmaps of idle ranges the pass took apart (`return_borrowed`),
    /// made first; their answers are booked by the next pass before it decides anything.
    unmaps: Deferred,
    /// Whether the reserve that deferred it may wait (not during a graph capture): where not,
    /// memory made meanwhile past a lowered cap returns no cache.
    waits: Waits,
    /// For a range: the other devices given access to it, a bit each (the device's peers as
    /// the pass saw them, `device/peers.rs`).
    peers: u64,
}

impl Plan {
    /// The bytes of addresses the plan's range takes (0 without a range).
    fn span(&self) -> u64 {
        match self.base {
            Some(_) => self.bytes + self.pages.iter().map(|p| p.size).sum::<u64>(),
            None => 0,
        }
    }

    /// Make the calls through `driver`, without the device's lock. A driver that panics fails
    /// the call (`CUDA_ERROR_UNKNOWN`) instead of unwinding past the memory counted in flight.
    pub fn make(&mut self, driver: &dyn Driver) -> Made {
        let device = self.device;
        self.unmaps.make(driver, device);
        let mut leftover = None;
        let mut call = match self.backing {
            Backing::Segment(..) => "cuMemAlloc_v2",
            Backing::Range => "cuMemCreate",
            Backing::Mapping => "cuMemMap",
            Backing::Wait => "cuCtxSynchronize",
        };
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let created = match self.backing {
                Backing::Wait => return Ok(Fresh::Waited),
                Backing::Mapping => None,
                _ => Some(self.backing.create(driver, device, self.bytes)?),
            };
            let handle = match (created, self.base) {
                (Some(Fresh::Handle(handle)), Some(_)) => Some(handle),
                (Some(fresh), _) => return Ok(fresh),
                (None, _) => None,
            };
            let Some(base) = self.base else {
                return Err(not_made("cuMemMap", "a range without addresses"));
            };
            let mut left = Leftover {
                created: handle,
                mapped: 0,
                failed: "",
            };
            call = "cuMemMap";
            let cached = Pages::mappings(self.pages.iter().copied())
                .map(|pages| (pages, "mapping cached memory into a new segment"));
            let new = handle.map(|handle| {
                let pages = Pages {
                    handle,
                    offset: 0,
                    size: self.bytes,
                };
                (pages, "mapping new memory into a new segment")
            });
            for (pages, failed) in cached.chain(new) {
                left.failed = failed;
                leftover = Some(left);
                let at = base + left.mapped;
                driver.vmm_map(device, at, pages.size, pages.handle, pages.offset)?;
                left.mapped += pages.size;
            }
            call = "cuMemSetAccess";
            left.failed = "setting access to a new segment";
            leftover = Some(left);
            self.peers = set_access(driver, device, (base, left.mapped), self.peers)?;
            leftover = None;
            Ok(match handle {
                Some(handle) => Fresh::Range(handle, base),
                None => Fresh::Mapped(base),
            })
        }))
        .unwrap_or_else(|_| Err(not_made(call, "the driver panicked")));
        // Work queued before the cached pages' blocks were released may still use them: waited
        // for here rather than under the lock in the next pass. A wait that fails or panics is
        // made again there (and reported if it fails again).
        let waited = result.is_ok()
            && self.wait.is_some()
            && std::panic::catch_unwind(AssertUnwindSafe(|| driver.synchronize(device).is_ok()))
                .unwrap_or(false);
        Made {
            result,
            leftover,
            waited,
        }
    }
}

/// Memory the calls of a [`Plan`] made, for the next pass.
#[derive(Debug)]
pub(super) struct Prepared {
    /// The plan they were made for.
    plan: Plan,
    /// The calls' answer: the memory, or why the driver refused it (then the next pass goes
    /// on from that failure, as the usual path from its first try).
    pub(super) made: DriverResult<Fresh>,
}

impl Prepared {
    /// The driver's `(free, total)` as the deferring pass saw them.
    pub(super) fn driver_info(&self) -> (u64, u64) {
        self.plan.driver_info
    }
}

/// What a pass came to.
pub enum Pass<T> {
    /// Done (or failed) under the lock.
    Done(Result<T>),
    /// Driver calls are to be made first, without the lock.
    Grow(Plan),
}

impl DevicePool {
    /// Run `f`, one of the usual paths, with growth deferred (the first pass).
    pub fn deferring<T>(
        &mut self,
        cx: &Context<'_>,
        f: impl FnOnce(&mut DevicePool) -> Result<T>,
    ) -> Pass<T> {
        self.borrowed_returned = false;
        self.pass(cx, true, f)
    }

    /// Run `f`, with growth deferred if `defer`; memory prepared that `f` does not take is
    /// booked as cache afterwards, whether `f` returns or unwinds.
    fn pass<T>(
        &mut self,
        cx: &Context<'_>,
        defer: bool,
        f: impl FnOnce(&mut DevicePool) -> Result<T>,
    ) -> Pass<T> {
        let (headroom, reserve_calls) = (self.headroom, self.stats.reserve_calls);
        self.defer = defer;
        let done = std::panic::catch_unwind(AssertUnwindSafe(|| f(self)));
        self.defer = false;
        // Booked whether the pass takes it, fails, or unwinds (a driver that panicked under the
        // lock): memory the driver made never leaves the books.
        if let Some(unused) = self.prepared.take() {
            self.book_fresh(cx, unused);
        }
        let done = done.unwrap_or_else(|panic| {
            // A driver that panicked under the lock: no plan outlives the pass (the lock is
            // taken over, see `Pool::lock`).
            if let Some(mut plan) = self.plan.take() {
                self.unplan(&plan);
                if let Some(base) = plan.base {
                    self.addresses.give(base, plan.span());
                }
                // Ranges taken apart to unmap: kept, retried by `free_reusable`.
                plan.unmaps.abandon();
                self.book_queued(cx, &mut plan.unmaps);
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

    /// `plan` is no longer in flight: its bytes' claim is given up, its addresses leave the
    /// carved count, and its cached pages' handles are no longer pinned.
    fn unplan(&mut self, plan: &Plan) {
        self.unclaim(plan.bytes);
        self.carved -= plan.span();
        for pages in &plan.pages {
            if let Some(at) = self.pinned.iter().position(|&h| h == pages.handle) {
                self.pinned.swap_remove(at);
            }
        }
    }

    /// Run `f` again (a later pass) with what `plan`'s calls made prepared for it, growth
    /// deferred again if `defer` (a plan this pass makes is then returned); what `f` does not
    /// take is booked as cache afterwards.
    pub fn prepared<T>(
        &mut self,
        cx: &Context<'_>,
        mut plan: Plan,
        made: Made,
        defer: bool,
        f: impl FnOnce(&mut DevicePool) -> Result<T>,
    ) -> Pass<T> {
        self.unplan(&plan);
        // Every plan but a wait alone comes from a pass that went past taking idle ranges apart
        // (`return_borrowed`), or took them apart: the passes after it do not take apart the
        // lenders those give-backs made idle (`DevicePool::reserve_as`).
        self.borrowed_returned = !(plan.backing == Backing::Wait && plan.unmaps.is_empty());
        if !plan.unmaps.is_empty() {
            self.book_queued(cx, &mut plan.unmaps);
        }
        if let (Some(releases), true) = (plan.wait, made.waited) {
            self.settled_at(releases);
        }
        let span = plan.span();
        if let (Some(base), Err(err)) = (plan.base, &made.result) {
            // A range not made: its addresses back, and a handle created for it kept as spare
            // pages once unmapped (or kept with the range to retry, if the unmap fails).
            match made.leftover {
                Some(left) => {
                    let created = left.created.map(|handle| (handle, plan.bytes));
                    self.undo_range(cx, created, base, span, left.mapped, &plan.pages);
                    // Mapping failed where creating did not: reported, as when a range fails
                    // to map under the lock (not made again from the pages just kept).
                    return Pass::Done(Err(Error::driver(left.failed, err)));
                }
                None => self.addresses.give(base, span),
            }
        }
        // A wait or unmaps leave nothing to take: the pass finds the memory settled or the
        // addresses back, and may defer in turn. A pass with memory prepared defers nothing: it
        // takes the memory, or makes its own under the lock.
        let defer = defer && plan.backing == Backing::Wait;
        if plan.backing != Backing::Wait {
            self.prepared = Some(Prepared {
                plan,
                made: made.result,
            });
        }
        self.pass(cx, defer, f)
    }

    /// In a deferring pass, whether to defer creating `bytes` of `backing` (then noted as the
    /// plan): nothing need go back first, to the cap or for the driver's `driver_free` bytes. A
    /// range takes its addresses now, for its cached pages (`DevicePool::mapping`) and `bytes`.
    pub(super) fn defer_growth(
        &mut self,
        cx: &Context<'_>,
        backing: Backing,
        bytes: u64,
        driver_free: u64,
    ) -> Result<bool> {
        if !self.may_defer() || bytes > driver_free || !self.claim(cx, bytes) {
            return Ok(false);
        }
        // The claim is the plan's until `unplan`.
        if let Err(err) = self.plan(cx, backing, bytes, driver_free) {
            self.unclaim(bytes);
            return Err(err);
        }
        Ok(true)
    }

    /// In a deferring pass, whether to defer mapping a range made wholly of the cached `pages`,
    /// then noted as the plan, its addresses taken now.
    pub(super) fn defer_mapping(
        &mut self,
        cx: &Context<'_>,
        pages: impl Iterator<Item = Pages>,
        driver_free: u64,
    ) -> Result<bool> {
        if !self.may_defer() {
            return Ok(false);
        }
        self.mapping.clear();
        self.mapping.extend(pages);
        let planned = self.plan(cx, Backing::Mapping, 0, driver_free);
        self.mapping.clear();
        planned.map(|()| true)
    }

    /// In a deferring pass, whether to defer the wait for the device's work that idle ranges of
    /// lent pages need before they are taken apart (`return_borrowed`): some of `segs` are not
    /// settled (then noted as the plan, made without the lock).
    pub(super) fn defer_wait(&mut self, segs: &[SegId]) -> bool {
        if !self.may_defer() || segs.iter().all(|&seg| self.is_settled(seg)) {
            return false;
        }
        self.plan_for_cache(Some(self.releases), Deferred::default());
        true
    }

    /// In a deferring pass, the idle ranges of lent pages `segs` that are unused (and settled)
    /// taken apart in the books, their pages back in their lenders, and their unmaps noted as
    /// the plan, made without the lock; whether there were any (then the pass unwinds, and the
    /// next decides with their addresses back, as after a single pass's unmaps).
    pub(super) fn defer_unmaps(&mut self, cx: &Context<'_>, segs: &[SegId]) -> bool {
        if !self.may_defer() {
            return false;
        }
        let mut unmaps = Deferred::default();
        for &seg in segs {
            if self.is_unused(seg) {
                self.take_apart_later(cx, seg, &mut unmaps);
            }
        }
        if unmaps.queued() == 0 {
            return false;
        }
        self.plan_for_cache(None, unmaps);
        true
    }

    /// Note a plan that makes no memory: a wait for the device's work (as `wait`), and `unmaps`.
    fn plan_for_cache(&mut self, wait: Option<u64>, unmaps: Deferred) {
        self.plan = Some(Plan {
            device: self.device,
            backing: Backing::Wait,
            bytes: 0,
            base: None,
            pages: Vec::new(),
            wait,
            driver_info: (0, self.driver_total),
            unmaps,
            waits: self.waits,
            peers: 0,
        });
    }

    /// Whether this pass may note a plan: growth is deferred, and no plan is noted yet.
    pub(super) fn may_defer(&self) -> bool {
        self.defer && self.plan.is_none()
    }

    /// Note the plan of `bytes` of `backing` (a range's addresses taken, its cached pages'
    /// handles pinned), in flight until [`DevicePool::unplan`]; its bytes claimed by the caller
    /// ([`DevicePool::claim`]), given up there.
    fn plan(
        &mut self,
        cx: &Context<'_>,
        backing: Backing,
        bytes: u64,
        driver_free: u64,
    ) -> Result<()> {
        let mut plan = Plan {
            device: self.device,
            backing,
            bytes,
            base: None,
            pages: Vec::new(),
            wait: None,
            driver_info: (driver_free, self.driver_total),
            unmaps: Deferred::default(),
            waits: self.waits,
            peers: self.whole_device.peers(),
        };
        if matches!(backing, Backing::Range | Backing::Mapping) {
            plan.pages = self.mapping.clone();
            let span = bytes + plan.pages.iter().map(|p| p.size).sum::<u64>();
            plan.base = Some(self.take_addresses(cx, span)?);
        }
        // The lenders of the range's cached pages (`DevicePool::lending`): waited for with it.
        let unsettled = self.lending.iter().any(|&seg| !self.is_settled(seg));
        plan.wait = unsettled.then_some(self.releases);
        debug_assert!(
            plan.wait.is_none() || self.may_wait(),
            "a reserve without waits lends no unsettled pages"
        );
        self.carved += plan.span();
        self.pinned.extend(plan.pages.iter().map(|p| p.handle));
        self.plan = Some(plan);
        Ok(())
    }

    /// Hold `handle`, just created, of `bytes`: its pages owned by the range being made, and
    /// counted as reserved.
    fn keep_handle(&mut self, handle: PhysHandle, bytes: u64) {
        self.phys.add(handle, bytes);
        self.add_reserved(bytes, 1);
    }

    /// In a later pass, the prepared memory if it is `bytes` of `backing` (for a range, with
    /// the same cached pages, `DevicePool::mapping`, which then takes the order the range maps
    /// them in); other prepared memory is booked as cache now, before the policy looks at the
    /// cache or the cap.
    pub(super) fn take_prepared(
        &mut self,
        cx: &Context<'_>,
        backing: Backing,
        bytes: u64,
    ) -> Option<Prepared> {
        let p = self.prepared.take()?;
        let plan = &p.plan;
        let same_pages = || {
            let mut made = plan.pages.clone();
            let mut asked = self.mapping.clone();
            made.sort_unstable_by_key(|p| (p.handle, p.offset));
            asked.sort_unstable_by_key(|p| (p.handle, p.offset));
            made == asked
        };
        if plan.backing == backing && plan.bytes == bytes && (plan.base.is_none() || same_pages()) {
            // The range maps them in its own order: the range's runs follow it.
            self.mapping.clone_from(&plan.pages);
            self.mapped_for = plan.peers;
            return Some(p);
        }
        self.book_fresh(cx, p);
        None
    }

    /// Keep prepared memory the next pass did not take, as cache (an idle segment, or spare
    /// pages); where a cap lowered meanwhile leaves no room for it, idle cache goes back to the
    /// driver until the pool is under it, as growth under a cap returns it.
    fn book_fresh(&mut self, cx: &Context<'_>, p: Prepared) {
        let Ok(fresh) = p.made else {
            return;
        };
        let plan = &p.plan;
        let span = plan.span();
        match (fresh, plan.backing) {
            (Fresh::Segment(ptr), Backing::Segment(class, stream)) => {
                self.add_reserved(plan.bytes, 1);
                self.install_segment(cx, (ptr, plan.bytes, 0), class, stream, Vec::new());
            }
            // Unmapped under the lock: a path taken only when the books moved meanwhile (the
            // cached pages are where they were, or have moved on).
            (Fresh::Range(handle, base), _) => {
                let created = Some((handle, plan.bytes));
                self.undo_range(cx, created, base, span, span, &plan.pages);
            }
            (Fresh::Mapped(base), _) => self.undo_range(cx, None, base, span, span, &plan.pages),
            (Fresh::Segment(_) | Fresh::Handle(_) | Fresh::Waited, _) => {
                unreachable!("a plan makes a segment or a range")
            }
        }
        // Not for a reserve without waits (`cuMemFree` waits): kept above the cap until the
        // next reserve that may wait.
        let limit = self.limit().filter(|_| plan.waits == Waits::Allowed);
        if let Some(limit) = limit {
            let over = self.device_committed(cx).saturating_sub(limit);
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

    /// A range at `base` of `span` bytes that is not made, `mapped` bytes of it mapped there
    /// (its cached `pages`, then the handle `created` for it, of its bytes): unmapped, its
    /// addresses back, and the created handle kept as spare pages; or kept with the range to
    /// retry, if the unmap fails.
    fn undo_range(
        &mut self,
        cx: &Context<'_>,
        created: Option<(PhysHandle, u64)>,
        base: DevicePtr,
        span: u64,
        mapped: u64,
        pages: &[Pages],
    ) {
        if let Some((handle, bytes)) = created {
            self.keep_handle(handle, bytes);
        }
        let handles = pages.iter().map(|p| p.handle);
        let handles = handles.chain(created.map(|(handle, _)| handle)).collect();
        self.abandon_range(cx, base, span, mapped, handles);
        if let Some((handle, bytes)) = created {
            self.give_whole(handle, bytes);
        }
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
