//! One device's pool: its segments and blocks, the per-stream bins, and the reserved-reuse
//! policy in the order DESIGN.md gives it (see ARCHITECTURE.md). This file holds the data
//! model, the public operations and the policy's steps up to growth; the rest lives beside it:
//!
//! - `placement.rs`: the best fit among a stream's free blocks, an idle segment of another
//!   stream, and the blocks' splitting and merging;
//! - `segments.rs`: booking, returning and forgetting segments, the idle list;
//! - `streams.rs`: stream slots, events, blocks pending on other streams;
//! - `parking.rs`: the per-stream list of released blocks kept out of the bins;
//! - `sweep.rs`: returning all cached memory in batches of bounded work (`free_reusable`);
//!   `deferred.rs`: the driver calls a sweep makes without the device's lock;
//! - `growth.rs`: a new segment for a request the cache does not hold, and the growth policy
//!   (cap, release before growing, allocate, on out-of-memory release everything and retry once)
//!   its memory comes through, whatever the backing;
//! - `growing.rs`: growth's driver calls (creating memory, mapping a new range, waiting for the
//!   device's work before cached memory is used again), made without the device's lock;
//! - `stitch.rs`: page-granular reuse with the virtual-memory API, building a segment from
//!   cached pages and new memory; `pieces.rs`: which cached pages it takes; `headroom.rs`: how
//!   much more than a request lacks such a creation takes;
//! - `unstitch.rs`: taking such segments apart and returning their memory;
//! - `phys.rs`: their physical-memory books;
//! - `check.rs`: the invariant check; `layout.rs`: where the reserved memory lies, page by page.
//!
//! A segment belongs to one stream at a time, and so do its blocks: a block released on its own
//! stream is reusable there at once. A segment that is entirely free (*idle*) can move to another
//! stream; the move records an event on the old stream and makes the new one wait for it, so the
//! new user's work is ordered after everything queued on the old stream. Blocks that were also
//! used on other streams (`record_stream`) wait, *pending*, until events recorded on those
//! streams at release complete.
//!
//! Placement is PyTorch's, so that classic segments replay a trace exactly as PyTorch's policy:
//! best fit by (size, address) among the stream's free blocks of the request's class; the found
//! block is split when the rest is worth keeping (`size::splits`); released blocks merge with
//! their free neighbours. Only where PyTorch's policy would fail a small request for want of
//! memory does the pool look further: among the stream's free large blocks.
//!
//! A block released on its own stream that would merge with nothing (no free or parked
//! neighbour) is *parked* in a short per-stream list instead of the bins, so that the common
//! reserve-release-reserve of one size is served from that list without touching the bins or
//! the address map. A parked block is the very free block PyTorch's policy would have: best fit
//! looks at the parked blocks beside the bins, and a block freed next to a parked one merges
//! with it. Parked blocks are reusable memory in every figure; they go to the bins (flushed)
//! before any step that needs the idle segments: idle-segment search, growth, and returning
//! memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::bins::Bins;
use super::blocks::{Block, Blocks, State};
use super::hash::{IntMap, IntSet};
use super::ids::{BlockId, Id, IdleAt, SegId, SlotId, Table};
use super::size::{self, human, Class, MIN_BLOCK, SEGMENT_ROUND, SMALL_MAX};
use super::stats::{Stats, WholeDevice};
use super::{Context, PoolConfig};
use addresses::Addresses;
use headroom::Headroom;
use phys::{Pages, Phys};
use stitch::{Run, VmmMode};
use unstitch::Stuck;

mod addresses;
mod check;
mod deferred;
mod growing;
mod growth;
mod headroom;
mod layout;
mod parking;
mod peers;
mod phys;
mod pieces;
mod placement;
mod segments;
mod stitch;
mod streams;
mod sweep;
mod unstitch;
use crate::driver::{DevicePtr, EventHandle, PhysHandle, StreamHandle};
use crate::error::{Error, Result};
use deferred::Returning;
use growing::{Backing, Fresh, Prepared};
pub use growing::{Pass, Plan};
pub use sweep::Sweep;

/// Memory obtained from the driver in one allocation.
#[derive(Clone, Debug)]
struct Segment {
    base: DevicePtr,
    size: u64,
    /// The stream slot whose bins hold its free blocks.
    slot: SlotId,
    class: Class,
    /// The block at `base`.
    first: BlockId,
    in_use: bool,
    /// Its place in `DevicePool::idle` while entirely free.
    idle_at: Option<IdleAt>,
    /// For a stitched segment (virtual-memory mode), its mappings in address order, tiling it.
    /// Empty for a segment from `cuMemAlloc`.
    runs: Vec<Run>,
    /// The segments with a run lent by this one: those to update when it is taken apart,
    /// without a look at every other segment. A set, so that a lender of many ranges (a
    /// warm-up lending to thousands) adds and drops one in constant time.
    borrowers: IntSet<SegId>,
    /// Built from physical memory mapped into an address range of its own.
    stitched: bool,
    /// The device's count of releases (`DevicePool::releases`) at the last release of one of
    /// its blocks; 0: none since it was booked. Its memory goes back to the driver, or to another
    /// range, without a wait when that is no later than the last wait (see `streams.rs`).
    released: u64,
    /// For a stitched segment whose first page is another segment's (a *fragment*, see
    /// `stitch.rs`): the bytes of that page before `base`, the other segment's. Its mapping
    /// starts `lead` bytes before `base`; 0 for every other segment.
    lead: u64,
    /// For a stitched segment: the other devices its mapping gives access to, a bit each
    /// (`device/peers.rs`).
    granted: u64,
}

impl Segment {
    /// The address range its mappings cover: `lead` bytes before its blocks, and its blocks.
    fn mapped(&self) -> (DevicePtr, u64) {
        (self.base - self.lead, self.size + self.lead)
    }

    /// The physical pages mapped at `[from, to)` (inside its mapping), split along its runs,
    /// each with the address it is mapped at.
    fn pages(
        &self,
        from: DevicePtr,
        to: DevicePtr,
    ) -> impl Iterator<Item = (DevicePtr, Pages)> + '_ {
        let (mapped, _) = self.mapped();
        let first = self
            .runs
            .partition_point(|r| mapped + r.offset + r.pages.size <= from);
        self.runs[first..].iter().map_while(move |r| {
            let start = mapped + r.offset;
            (start < to).then(|| {
                let (at, end) = (from.max(start), to.min(start + r.pages.size));
                let pages = Pages {
                    handle: r.pages.handle,
                    offset: r.pages.offset + (at - start),
                    size: end - at,
                };
                (at, pages)
            })
        })
    }
}

/// A stream's free blocks, small and large class. Slots are reused once no segment is theirs.
struct StreamSlot {
    handle: StreamHandle,
    bins: [Bins; 2],
    /// Segments that belong to this stream.
    segments: u32,
    /// Parked blocks, most recently released last.
    parked: Vec<BlockId>,
}

/// How many released blocks a stream keeps parked, out of the bins.
const PARKED_MAX: usize = 16;

/// A released block waiting for other streams' work.
struct Pending {
    block: BlockId,
    events: Vec<EventHandle>,
    /// The device's count of releases at its release (see `streams.rs`).
    released: u64,
}

/// Whether a reserve may wait for the device's work or order its stream after another's: not
/// while a stream captures a CUDA graph (see [`super::Pool::reserve_no_wait`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waits {
    /// Every step of the policy.
    Allowed,
    /// Only the steps that need no wait: the stream's cached blocks, settled idle segments of
    /// other streams, new memory; no cache returned.
    Never,
}

/// Whether `grow` may give cached memory back to make room (steps 3 and 4 of the policy).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Grow {
    MayRelease,
    KeepCache,
}

/// The pool of one device's shard (`shards.rs`). Not thread-safe by itself: [`super::Pool`]
/// holds it behind a lock.
pub struct DevicePool {
    device: i32,
    /// The pool's index among every device's shards: its segments' owner in the span map.
    owner: i32,
    config: PoolConfig,
    blocks: Blocks,
    segments: Table<SegId, Segment>,
    vacant_segments: Vec<SegId>,
    /// Per-stream free blocks; `slot_of` maps a stream to its slot.
    slots: Table<SlotId, StreamSlot>,
    vacant_slots: Vec<SlotId>,
    slot_of: IntMap<StreamHandle, SlotId>,
    /// Live and parked blocks by address.
    by_ptr: IntMap<DevicePtr, BlockId>,
    /// Parked blocks in all slots.
    parked: usize,
    /// Entirely free segments, unordered (each knows its place).
    idle: Table<IdleAt, SegId>,
    pending: Vec<Pending>,
    /// Streams other than its own that a live block was used on (blocks marked `shared`).
    shared: IntMap<BlockId, Vec<StreamHandle>>,
    spare_events: Vec<EventHandle>,
    stats: Stats,
    /// Whether segments are stitched from physical memory (decided at the first growth).
    vmm: VmmMode,
    /// The physical handles held in virtual-memory mode, and their spare pages.
    phys: Phys,
    /// Every hole (lent pages, in a stitched segment) by its address: where lent pages come
    /// back to without a walk along their lender's blocks.
    holes: BTreeMap<DevicePtr, BlockId>,
    /// The address space stitched segments are carved from.
    addresses: Addresses,
    /// Address ranges whose unmapping failed, to retry.
    stuck: Vec<Stuck>,
    /// Classic segments a sweep took out of the books, which the driver is freeing without the
    /// device's lock: still reserved until it answers (`deferred.rs`).
    returning: Vec<Returning>,
    /// Handles a sweep took out of the books, which the driver is releasing without the
    /// device's lock, with their sizes: still reserved until it answers.
    releasing: Vec<(PhysHandle, u64)>,
    /// Emptied lists of the handles of stuck ranges, kept for the next (no allocation under the
    /// lock, see `forget_segment`).
    spare_handle_lists: Vec<Vec<PhysHandle>>,
    /// Segments lending pages to a range being made (not taken apart meanwhile).
    lending: Vec<SegId>,
    /// The cached pages of the stitched range being made, in the order they are mapped (before
    /// any new memory): what a plan to map it without the lock maps (`growing.rs`).
    mapping: Vec<phys::Pages>,
    /// The handles of cached pages that ranges in flight map without the lock, once per page
    /// run: not released meanwhile, whatever becomes of the ranges they are cached in.
    pinned: Vec<PhysHandle>,
    /// The peers the last stitched range mapped gave access to, a bit each: what its segment
    /// is booked with (`device/peers.rs`).
    mapped_for: u64,
    /// What sizes the headroom of the next stitched creation (`headroom.rs`).
    headroom: Headroom,
    /// Blocks released so far (each release counts one, and stamps its segment).
    releases: u64,
    /// Every release up to this count was followed by a wait for the device's queued work:
    /// the work that used those blocks is done (see `streams.rs`).
    settled: u64,
    /// Growth's creating call is deferred, to be made without the lock (`growing.rs`).
    defer: bool,
    /// An earlier pass of this request went past taking idle ranges of lent pages apart, or
    /// took them apart (`growing.rs`): later passes do not do it again.
    borrowed_returned: bool,
    /// Whether the reserve under way may wait (`Allowed` between reserves).
    waits: Waits,
    /// The creation deferred by this pass.
    plan: Option<Plan>,
    /// Memory made without the lock, for this pass to take.
    prepared: Option<Prepared>,
    /// Bytes claimed for memory being created, without the lock or under it, until it is booked
    /// or the attempt ends (`DevicePool::claim`): counted against the cap.
    growing: u64,
    /// Bytes of addresses taken for ranges being mapped without the lock.
    carved: u64,
    /// The device's total memory, as the driver last gave it.
    driver_total: u64,
    /// What the device reserves, all its shards together, and its peak (`stats.rs`).
    whole_device: Arc<WholeDevice>,
}

impl DevicePool {
    /// An empty pool for `device`, the shard `owner` of every device's shards, booking what it
    /// reserves in `reserved` too (shared by the device's shards).
    pub fn new(
        device: i32,
        owner: i32,
        config: PoolConfig,
        reserved: Arc<WholeDevice>,
    ) -> DevicePool {
        DevicePool {
            whole_device: reserved,
            device,
            owner,
            config,
            blocks: Blocks::default(),
            segments: Table::default(),
            vacant_segments: Vec::new(),
            slots: Table::default(),
            vacant_slots: Vec::new(),
            slot_of: IntMap::default(),
            by_ptr: IntMap::default(),
            parked: 0,
            idle: Table::default(),
            pending: Vec::new(),
            shared: IntMap::default(),
            spare_events: Vec::new(),
            stats: Stats::default(),
            vmm: VmmMode::Undecided,
            phys: Phys::default(),
            addresses: Addresses::default(),
            holes: BTreeMap::new(),
            stuck: Vec::new(),
            returning: Vec::new(),
            releasing: Vec::new(),
            spare_handle_lists: Vec::new(),
            lending: Vec::new(),
            mapping: Vec::new(),
            pinned: Vec::new(),
            mapped_for: 0,
            headroom: Headroom::default(),
            releases: 0,
            settled: 0,
            defer: false,
            borrowed_returned: false,
            waits: Waits::Allowed,
            plan: None,
            prepared: None,
            growing: 0,
            carved: 0,
            driver_total: 0,
        }
    }

    /// A block of at least `size` bytes for use on `stream`; `size` must be non-zero. Without
    /// waits where `waits` says (see `Pool::reserve_no_wait`).
    pub fn reserve_as(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        stream: StreamHandle,
        waits: Waits,
    ) -> Result<DevicePtr> {
        self.with_waits(waits, |pool| pool.reserve_steps(cx, size, stream))
    }

    /// `f` with the reserve's `waits` in force (`Allowed` again after it).
    fn with_waits<T>(&mut self, waits: Waits, f: impl FnOnce(&mut Self) -> T) -> T {
        self.waits = waits;
        let done = f(self);
        self.waits = Waits::Allowed;
        done
    }

    /// Whether the reserve under way may wait for the device's work or order its stream after
    /// another's.
    pub(super) fn may_wait(&self) -> bool {
        self.waits == Waits::Allowed
    }

    /// The steps of [`DevicePool::reserve_as`].
    fn reserve_steps(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        let block_size = size::block_size(size)?;
        self.stats.reserve_calls += 1;
        if let Some(ptr) = self.reuse(cx, size, block_size, stream)? {
            return Ok(ptr);
        }
        // Idle segments made partly of lent pages give them back first: merged again in their
        // lenders, they may hold the request as PyTorch's policy would have them hold it. Not
        // again in a later pass of the request (`growing.rs`): an earlier pass did it, and the
        // lenders it made idle would give back more, where a single pass leaves them to the
        // next request.
        let waits = self.may_wait();
        if waits && !self.borrowed_returned && self.return_borrowed(cx)? {
            if let Some(ptr) = self.reuse(cx, size, block_size, stream)? {
                return Ok(ptr);
            }
        }
        // 3. and 4. A new segment, returning cache to the driver first where needed.
        let class = size::class_of(block_size);
        let ooms = self.stats.ooms;
        // Without waits, no cache goes back (`cuMemFree` waits; a range's pages need their
        // work done) and none is mapped into the new range: the request's memory is new.
        let grown = self.grow(
            cx,
            size::segment_size(block_size),
            class,
            stream,
            size,
            if waits {
                Grow::MayRelease
            } else {
                Grow::KeepCache
            },
        );
        match grown {
            Ok(id) => Ok(self.take(id, block_size, size)),
            // The last resort of a small request, where no memory can be had for a small
            // segment even after every idle one went back: the best fit among the stream's free
            // large blocks. PyTorch's policy fails it, though the unused parts of large blocks'
            // pages hold it (a model load near the device's capacity failed a 490 KiB request
            // with 54 MiB reusable there, on a device where PyTorch's policy had room for a
            // small segment). Freed, the block merges back into its large segment.
            Err(err) if err.is_out_of_memory() && class == Class::Small => {
                match self.best_free(stream, Class::Large, block_size) {
                    Some(fit) => {
                        self.stats.ooms = ooms;
                        self.log(format_args!(
                            "no memory for a small segment: a request of {} served from a free \
                             large block",
                            human(size)
                        ));
                        Ok(self.take_fit(fit, block_size, size))
                    }
                    None => Err(err),
                }
            }
            Err(err) => Err(err),
        }
    }

    /// Like [`DevicePool::reserve_as`], but only from memory already held (steps 1 and 2): `None`
    /// where the request would need the driver, and then nothing is counted.
    pub fn reserve_cached(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        stream: StreamHandle,
        waits: Waits,
    ) -> Result<Option<DevicePtr>> {
        let block_size = size::block_size(size)?;
        let found = self.with_waits(waits, |pool| pool.reuse(cx, size, block_size, stream))?;
        if found.is_some() {
            self.stats.reserve_calls += 1;
        }
        Ok(found)
    }

    /// Steps 1 and 2 of [`DevicePool::reserve_as`].
    fn reuse(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        block_size: u64,
        stream: StreamHandle,
    ) -> Result<Option<DevicePtr>> {
        if !self.pending.is_empty() && self.may_wait() {
            self.collect_pending(cx, false)?;
        }
        let class = size::class_of(block_size);
        // 1. Best fit among this stream's free blocks: the bins and the parked ones.
        let ptr = if let Some(fit) = self.best_free(stream, class, block_size) {
            self.take_fit(fit, block_size, size)
        } else {
            // Filed in the bins, parked blocks that fill their segment make it idle (step 2,
            // growth).
            self.flush_parked();
            // 2. An idle segment of another stream, ordered after that stream's work.
            let Some(id) = self.adopt_idle_segment(cx, class, block_size, stream)? else {
                return Ok(None);
            };
            self.stats.cache_hits += 1;
            self.take(id, block_size, size)
        };
        if class == Class::Large {
            // What tells headroom it was of use (`headroom.rs`).
            self.headroom.served();
        }
        Ok(Some(ptr))
    }

    /// Give the block at `ptr` back to the pool.
    pub fn release(&mut self, cx: &Context<'_>, ptr: DevicePtr) -> Result<()> {
        let id = match self.by_ptr.get(&ptr) {
            Some(&id) if self.blocks[id].state == State::Live => id,
            _ => return Err(self.explain_bad_pointer(ptr)),
        };
        // Record the events first, so that a failing driver leaves the block live and the books
        // unchanged.
        let mut events = Vec::new();
        if self.blocks[id].shared {
            let streams = self.shared.remove(&id).unwrap_or_default();
            for &stream in &streams {
                match self.record_event(cx, stream) {
                    Ok(event) => events.push(event),
                    Err(_) => {
                        // The driver rejects the stream (destroyed, of another device, or another
                        // thread's per-thread stream): wait for all work on every device
                        // instead, and the block is free at once.
                        self.spare_events.append(&mut events);
                        if let Err(err) = self.synchronize_all(cx) {
                            self.shared.insert(id, streams);
                            return Err(Error::driver(
                                &format!(
                                    "releasing {ptr:#x}: stream {stream:#x}, which used the block, \
                                     takes no event and waiting for the devices failed, so the \
                                     block stays reserved"
                                ),
                                &err,
                            ));
                        }
                        break;
                    }
                }
            }
            self.blocks[id].shared = false;
        }
        self.releases += 1;
        let seg = self.blocks[id].segment;
        self.segments[seg].released = self.releases;
        let b = &self.blocks[id];
        self.stats.remove_live(allocated(b.requested), b.requested);
        // Park a block with no free or parked neighbour: it would merge with nothing, so it is
        // the very free block PyTorch's policy would have, only not filed in the bins.
        let unused = |n: BlockId| {
            n != BlockId::NIL && matches!(self.blocks[n].state, State::Free | State::Parked)
        };
        let parkable = !unused(b.prev) && !unused(b.next);
        if events.is_empty() && parkable {
            self.park(id);
        } else if events.is_empty() {
            self.by_ptr.remove(&ptr);
            self.free_block(id);
        } else {
            self.by_ptr.remove(&ptr);
            self.blocks[id].state = State::Pending;
            self.pending.push(Pending {
                block: id,
                events,
                released: self.releases,
            });
        }
        Ok(())
    }

    /// Note that the live block at `ptr` is also used on `stream`.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let id = match self.by_ptr.get(&ptr) {
            Some(&id) if self.blocks[id].state == State::Live => id,
            _ => return Err(self.explain_bad_pointer(ptr)),
        };
        if self.stream_of(id) != stream {
            self.blocks[id].shared = true;
            let streams = self.shared.entry(id).or_default();
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }
        Ok(())
    }

    /// Make at least `bytes` reusable on the device, counting what already is (the device's
    /// other shards' too): allocate only the shortfall, as one segment. Returns the bytes
    /// allocated.
    pub fn warmup(&mut self, cx: &Context<'_>, bytes: u64) -> Result<u64> {
        // A load follows: merged free space places it best.
        self.flush_parked();
        let reusable = self.device_reusable(cx);
        if bytes <= reusable {
            return Ok(0);
        }
        let shortfall = bytes - reusable;
        let segment = size::round_up(size::block_size(shortfall)?, SEGMENT_ROUND);
        self.grow(cx, segment, Class::Large, 0, shortfall, Grow::KeepCache)?;
        self.log(format_args!(
            "warm-up of {}: {} already reusable, allocated {}",
            human(bytes),
            human(reusable),
            human(segment)
        ));
        Ok(segment)
    }

    /// Return idle cache to the driver up to `bytes` at another process's request: whole idle
    /// segments (so possibly a little more), and in virtual-memory mode the spare pages of
    /// handles no range maps, as [`crate::Pool::free_reusable`] would, but only up to `bytes`.
    /// Never a block in use, and never waits for other streams' work. Returns the bytes
    /// returned.
    pub fn trim(&mut self, cx: &Context<'_>, bytes: u64) -> Result<u64> {
        self.flush_parked();
        self.collect_pending(cx, false)?;
        self.retry_stuck(cx, usize::MAX)?;
        self.release_idle(cx, bytes)
    }

    /// The driver's `(free, total)` bytes of the device, as it reports them.
    pub(crate) fn driver_info(&self, cx: &Context<'_>) -> Result<(u64, u64)> {
        cx.driver
            .mem_get_info(self.device)
            .map_err(|e| Error::driver("asking the driver for free memory", &e))
    }

    /// Return this pool's idle cache above the device's cap (set in the device's shared figures,
    /// [`WholeDevice::set_limit`]), counting the device's other shards' memory too; live
    /// blocks are never touched, so reserved may stay above the cap until they are released.
    /// Returns the bytes returned.
    pub fn return_above_cap(&mut self, cx: &Context<'_>) -> Result<u64> {
        let reserved = self.device_reserved(cx);
        match self.limit() {
            Some(limit) if reserved > limit => {
                self.flush_parked();
                self.collect_pending(cx, false)?;
                self.release_idle(cx, reserved - limit)
            }
            _ => Ok(0),
        }
    }

    /// What this pool reserves and has claimed for memory being created (`DevicePool::claim`):
    /// what the device's other shards count against a cap.
    pub(crate) fn committed(&self) -> u64 {
        self.stats.reserved_bytes + self.growing
    }

    /// [`DevicePool::committed`] with what the device's other shards last published.
    pub(crate) fn device_committed(&self, cx: &Context<'_>) -> u64 {
        self.committed() + cx.reserved_elsewhere()
    }

    /// What the device reserves: this pool, and what its other shards last published.
    fn device_reserved(&self, cx: &Context<'_>) -> u64 {
        self.stats.reserved_bytes + cx.reserved_elsewhere()
    }

    /// What the device holds reusable: this pool's, and what its other shards last published.
    fn device_reusable(&self, cx: &Context<'_>) -> u64 {
        self.stats.reusable() + cx.reusable_elsewhere()
    }

    /// Bytes in live blocks (the figure of [`DevicePool::stats`], without its walk).
    pub(crate) fn allocated_bytes(&self) -> u64 {
        self.stats.allocated_bytes
    }

    /// Bytes reserved that no live block holds (the figure of [`DevicePool::stats`], without its
    /// walk).
    pub(crate) fn reusable_bytes(&self) -> u64 {
        self.stats.reusable()
    }

    /// What the device's other shards read of this one: [`DevicePool::committed`], and the
    /// bytes reserved that no live block holds.
    pub(crate) fn published(&self) -> (u64, u64) {
        (self.committed(), self.reusable_bytes())
    }

    /// A request counted as failed for want of memory was served after all (once the device's
    /// other shards returned their idle cache).
    pub(crate) fn forgive_oom(&mut self) {
        self.stats.ooms = self.stats.ooms.saturating_sub(1);
    }

    /// The device's cap, if any (one for all its shards: [`WholeDevice::set_limit`]).
    pub fn limit(&self) -> Option<u64> {
        self.whole_device.limit()
    }

    /// Whether this pool stitches its segments (see [`super::Pool::reuses_pages`]).
    pub fn reuses_pages(&mut self, cx: &Context<'_>) -> bool {
        self.stitching(cx)
    }

    /// The figures, exact now, read without changing anything (a parked block has no free or
    /// parked neighbour, so it counts as the free block it is).
    pub fn stats(&self) -> Stats {
        let mut stats = self.stats;
        stats.reusable_bytes = stats.reusable();
        let (mut small, mut large) = (0, 0);
        for slot in &self.slots {
            small = small.max(slot.bins[Class::Small as usize].largest());
            large = large.max(slot.bins[Class::Large as usize].largest());
            for &id in &slot.parked {
                let size = self.blocks[id].size;
                match self.segments[self.blocks[id].segment].class {
                    Class::Small => small = small.max(size),
                    Class::Large => large = large.max(size),
                }
            }
        }
        // Small requests come only from small segments, large ones (over 1 MiB) only from large.
        let large = if large > SMALL_MAX { large } else { 0 };
        stats.largest_reusable_block = large.max(small.min(SMALL_MAX));
        stats
    }

    /// Set the peaks to the current values.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peaks();
    }

    /// Count `bytes` newly held from the driver in `calls` allocations, in this shard's figures
    /// and the device's.
    fn add_reserved(&mut self, bytes: u64, calls: u64) {
        self.stats.add_reserved(bytes, calls);
        self.whole_device.add(bytes);
    }

    /// Count `bytes` given back to the driver in `calls` frees, in this shard's figures and the
    /// device's.
    fn remove_reserved(&mut self, bytes: u64, calls: u64) {
        self.stats.remove_reserved(bytes, calls);
        self.whole_device.remove(bytes);
    }

    // ----- pointers -----

    /// Whether a segment of this pool belongs to `stream`.
    pub fn holds_stream(&self, stream: StreamHandle) -> bool {
        self.slot_of
            .get(&stream)
            .is_some_and(|&slot| self.slots[slot].segments > 0)
    }

    /// Whether a live or parked block starts at `ptr`.
    pub fn has_block_at(&self, ptr: DevicePtr) -> bool {
        self.by_ptr.contains_key(&ptr)
    }

    /// Whether a segment of this pool holds `ptr` (a look at every segment).
    pub fn holds(&self, ptr: DevicePtr) -> bool {
        self.segment_of(ptr).is_some()
    }

    /// Every segment's address range, as (base, size).
    pub fn segment_ranges(&self) -> impl Iterator<Item = (DevicePtr, u64)> + '_ {
        self.segments
            .iter()
            .filter(|s| s.in_use)
            .map(|s| (s.base, s.size))
    }

    fn segment_of(&self, ptr: DevicePtr) -> Option<&Segment> {
        self.segments
            .iter()
            .find(|s| s.in_use && s.base <= ptr && ptr - s.base < s.size)
    }

    // ----- messages -----

    fn explain_bad_pointer(&self, ptr: DevicePtr) -> Error {
        let seg = self.segment_of(ptr);
        let Some(seg) = seg else {
            return Error::invalid_pointer(format!(
                "{ptr:#x} was not returned by rm_reserve on device {}: it lies in no memory the \
                 pool holds (pass only pointers from rm_reserve, each once)",
                self.device
            ));
        };
        let mut id = seg.first;
        while id != BlockId::NIL {
            let block = &self.blocks[id];
            if block.ptr <= ptr && ptr - block.ptr < block.size {
                let what = match (block.ptr == ptr, block.state) {
                    (true, State::Free | State::Pending | State::Parked) => {
                        "was already released (double release); the pool is unchanged".to_string()
                    }
                    (false, State::Live) => format!(
                        "points {} bytes into a live block of {} at {:#x}; release the block's \
                         start address",
                        ptr - block.ptr,
                        human(block.size),
                        block.ptr
                    ),
                    _ => "lies inside cached free memory: it is not a pointer rm_reserve returned \
                          or it was already released"
                        .to_string(),
                };
                return Error::invalid_pointer(format!("{ptr:#x} {what}"));
            }
            id = block.next;
        }
        Error::internal(format!(
            "{ptr:#x} lies in segment {:#x} but in none of its blocks",
            seg.base
        ))
    }

    fn log(&self, args: std::fmt::Arguments<'_>) {
        if self.config.logging {
            eprintln!("resmem: device {}: {args}", self.device);
        }
    }
}

/// The bytes a live block of a request of `requested` bytes counts as allocated: the request
/// rounded up to [`MIN_BLOCK`], as the caller sees it (and the front caches count it). A large
/// block may carry a rest of at most 1 MiB that no large request could use (PyTorch's split
/// rule, `size::splits`): that rest counts as reusable, as it would have as a free block.
pub(super) fn allocated(requested: u64) -> u64 {
    size::round_up(requested.max(1), MIN_BLOCK)
}
