//! One device's pool: its segments and blocks, the per-stream bins, and the reserved-reuse
//! policy in the order DESIGN.md gives it.
//!
//! A segment belongs to one stream at a time, and so do its blocks: a block released on its own
//! stream is reusable there at once. A segment that is entirely free (*idle*) can move to another
//! stream; the move records an event on the old stream and makes the new one wait for it, so the
//! new user's work is ordered after everything queued on the old stream. Blocks that were also
//! used on other streams (`record_stream`) wait, *pending*, until events recorded on those
//! streams at release complete.
//!
//! A small block (at most 1 MiB), or a large one that fills its whole segment, released on its
//! own stream is first *parked* in a short per-stream list without being merged with its
//! neighbours, so that the common reserve-release-reserve of one size is served from that list
//! without touching the bins or the address map. Other large blocks merge at once: handing a
//! parked large block to the next request of its size would reorder placement across, say,
//! repeated model loads, and fragment the segment they share. Parked blocks are
//! reusable memory in every figure; they are merged (flushed) before any step that needs the
//! whole picture: a miss in the bins, idle-segment search, statistics, and returning memory.

use super::bins::Bins;
use super::blocks::{Block, Blocks, State, NIL};
use super::hash::IntMap;
use super::size::{self, human, Class, MIN_BLOCK, SEGMENT_ROUND, SMALL_MAX};
use super::stats::Stats;
use super::{Context, PoolConfig};
use stitch::{Chunk, VmmMode};

mod stitch;
use crate::driver::{DevicePtr, EventHandle, StreamHandle};
use crate::error::{Error, Result};

/// Memory obtained from the driver in one allocation.
#[derive(Clone, Debug)]
struct Segment {
    base: DevicePtr,
    size: u64,
    /// The stream slot whose bins hold its free blocks.
    slot: u32,
    class: Class,
    /// The block at `base`.
    first: u32,
    in_use: bool,
    /// Its index in `DevicePool::idle` while entirely free, else `NIL`.
    idle_at: u32,
    /// For a stitched segment (virtual-memory mode), the physical chunks mapped in it, by
    /// offset from `base`, in address order; the rest of it is holes. Empty for a segment from
    /// `cuMemAlloc`.
    chunks: Vec<(u64, Chunk)>,
    /// Built from physical chunks (its `chunks` can become empty as they are taken).
    stitched: bool,
}

/// A stream's free blocks, small and large class. Slots are reused once no segment is theirs.
struct StreamSlot {
    handle: StreamHandle,
    bins: [Bins; 2],
    /// Segments that belong to this stream.
    segments: u32,
    /// Parked blocks, most recently released last.
    parked: Vec<u32>,
}

/// How many released blocks a stream keeps parked, unmerged, for exact-size reuse.
const PARKED_MAX: usize = 16;

/// A released block waiting for other streams' work.
struct Pending {
    block: u32,
    events: Vec<EventHandle>,
}

/// Whether `grow` may give cached memory back to make room (steps 3 and 4 of the policy).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Grow {
    MayRelease,
    KeepCache,
}

/// The pool of one device. Not thread-safe by itself: [`super::Pool`] holds it behind a lock.
pub struct DevicePool {
    device: i32,
    config: PoolConfig,
    blocks: Blocks,
    segments: Vec<Segment>,
    vacant_segments: Vec<u32>,
    /// Per-stream free blocks; `slot_of` maps a stream to its slot.
    slots: Vec<StreamSlot>,
    vacant_slots: Vec<u32>,
    slot_of: IntMap<StreamHandle, u32>,
    /// Live and parked blocks by address.
    by_ptr: IntMap<DevicePtr, u32>,
    /// Parked blocks in all slots.
    parked: usize,
    /// Entirely free segments, unordered (each knows its index).
    idle: Vec<u32>,
    pending: Vec<Pending>,
    /// Streams other than its own that a live block was used on (blocks marked `shared`).
    shared: IntMap<u32, Vec<StreamHandle>>,
    spare_events: Vec<EventHandle>,
    stats: Stats,
    /// The most this pool may reserve, if capped.
    limit: Option<u64>,
    /// Whether segments are stitched from physical chunks (decided at the first growth).
    vmm: VmmMode,
    /// Physical chunks held but mapped nowhere (virtual-memory mode): reserved and reusable.
    spare: Vec<Chunk>,
}

impl DevicePool {
    /// An empty pool for `device`.
    pub fn new(device: i32, config: PoolConfig) -> DevicePool {
        DevicePool {
            device,
            config,
            blocks: Blocks::default(),
            segments: Vec::new(),
            vacant_segments: Vec::new(),
            slots: Vec::new(),
            vacant_slots: Vec::new(),
            slot_of: IntMap::default(),
            by_ptr: IntMap::default(),
            parked: 0,
            idle: Vec::new(),
            pending: Vec::new(),
            shared: IntMap::default(),
            spare_events: Vec::new(),
            stats: Stats::default(),
            limit: None,
            vmm: VmmMode::Undecided,
            spare: Vec::new(),
        }
    }

    /// A block of at least `size` bytes for use on `stream`; `size` must be non-zero.
    pub fn reserve(
        &mut self,
        cx: &Context<'_>,
        size: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        let block_size = size::block_size(size)?;
        self.stats.reserve_calls += 1;
        if !self.pending.is_empty() {
            self.collect_pending(cx, false)?;
        }
        let class = size::class_of(block_size);
        // 1. A cached block on this stream: a parked one of this very size, else the bins.
        if let Some(&slot) = self.slot_of.get(&stream) {
            if let Some(id) = self.unpark(slot, block_size) {
                self.stats.cache_hits += 1;
                return Ok(self.revive(id, size));
            }
            if let Some(id) =
                self.slots[slot as usize].bins[class as usize].find(&self.blocks, block_size)
            {
                self.stats.cache_hits += 1;
                return Ok(self.take(id, block_size, size));
            }
        }
        if self.parked > 0 {
            // Merged, the parked blocks may make room on this stream or an idle segment.
            self.flush_parked();
            let found = self.slot_of.get(&stream).and_then(|&slot| {
                self.slots[slot as usize].bins[class as usize].find(&self.blocks, block_size)
            });
            if let Some(id) = found {
                self.stats.cache_hits += 1;
                return Ok(self.take(id, block_size, size));
            }
        }
        // 2. An idle segment of another stream, ordered after that stream's work.
        if let Some(id) = self.adopt_idle_segment(cx, class, block_size, stream)? {
            self.stats.cache_hits += 1;
            return Ok(self.take(id, block_size, size));
        }
        // 3. and 4. A new segment, returning cache to the driver first where needed.
        let id = self.grow(
            cx,
            size::segment_size(block_size),
            class,
            stream,
            size,
            Grow::MayRelease,
        )?;
        Ok(self.take(id, block_size, size))
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
                        // The driver rejects the stream (destroyed, or of another device): wait
                        // for all work on every device instead, and the block is free at once.
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
        let b = &self.blocks[id];
        self.stats.remove_live(b.size, b.requested);
        // Park small blocks, and large ones that fill their segment: those have no neighbour
        // to merge with, so parking defers nothing.
        let parkable = b.size <= SMALL_MAX || (b.prev == NIL && b.next == NIL);
        if events.is_empty() && parkable {
            self.park(id);
        } else if events.is_empty() {
            self.by_ptr.remove(&ptr);
            self.free_block(id);
        } else {
            self.by_ptr.remove(&ptr);
            self.blocks[id].state = State::Pending;
            self.pending.push(Pending { block: id, events });
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

    /// Make at least `bytes` reusable, counting what already is: allocate only the shortfall,
    /// as one segment. Returns the bytes allocated.
    pub fn warmup(&mut self, cx: &Context<'_>, bytes: u64) -> Result<u64> {
        // A load follows: merged free space places it best.
        self.flush_parked();
        let reusable = self.stats.reusable();
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

    /// Return every idle segment to the driver, after waiting for pending blocks. Returns the
    /// bytes returned.
    pub fn free_reusable(&mut self, cx: &Context<'_>) -> Result<u64> {
        self.flush_parked();
        self.collect_pending(cx, true)?;
        let mut released = self.release_idle(cx, u64::MAX)?;
        if matches!(self.vmm, VmmMode::On(_)) {
            // Chunks under free blocks of segments still in use go back too.
            let chunks = self.harvest(cx, u64::MAX)?;
            released += chunks.iter().map(|c| c.size).sum::<u64>();
            self.release_chunks(cx, chunks)?;
        }
        Ok(released)
    }

    /// Return idle cache to the driver up to `bytes` at another process's request: idle
    /// segments first (whole ones, so possibly a little more), then in virtual-memory mode the
    /// chunks under free blocks. Never a block in use, and never waits for other streams'
    /// work. Returns the bytes returned.
    pub fn trim(&mut self, cx: &Context<'_>, bytes: u64) -> Result<u64> {
        self.flush_parked();
        self.collect_pending(cx, false)?;
        let mut released = self.release_idle(cx, bytes)?;
        if released < bytes && matches!(self.vmm, VmmMode::On(_)) {
            let chunks = self.harvest(cx, bytes - released)?;
            released += chunks.iter().map(|c| c.size).sum::<u64>();
            self.release_chunks(cx, chunks)?;
        }
        Ok(released)
    }

    /// `(free, total)`: the driver's free bytes plus this pool's reusable bytes, and the total.
    /// Under a memory limit, free is at most what the limit leaves to new blocks.
    pub fn mem_get_info(&self, cx: &Context<'_>) -> Result<(u64, u64)> {
        let (free, total) = cx
            .driver
            .mem_get_info(self.device)
            .map_err(|e| Error::driver("asking the driver for free memory", &e))?;
        let mut free = free.saturating_add(self.stats.reusable()).min(total);
        if let Some(limit) = self.limit {
            free = free.min(limit.saturating_sub(self.stats.allocated_bytes));
        }
        Ok((free, total))
    }

    /// Cap what this pool reserves (`None`: no cap). Idle cache above a new cap is returned to
    /// the driver now; live blocks are never touched, so reserved may stay above the cap until
    /// they are released. Returns the bytes returned.
    pub fn set_memory_limit(&mut self, cx: &Context<'_>, limit: Option<u64>) -> Result<u64> {
        self.limit = limit;
        match limit {
            Some(limit) if self.stats.reserved_bytes > limit => {
                self.flush_parked();
                self.collect_pending(cx, false)?;
                self.release_idle(cx, self.stats.reserved_bytes - limit)
            }
            _ => Ok(0),
        }
    }

    /// The cap set by [`DevicePool::set_memory_limit`].
    pub fn memory_limit(&self) -> Option<u64> {
        self.limit
    }

    /// The figures, exact now. Parked blocks are merged first, so that the largest reusable
    /// block is seen whole.
    pub fn stats(&mut self) -> Stats {
        self.flush_parked();
        let mut stats = self.stats;
        stats.reusable_bytes = stats.reusable();
        let (mut small, mut large) = (0, 0);
        for slot in &self.slots {
            small = small.max(slot.bins[Class::Small as usize].largest(&self.blocks));
            large = large.max(slot.bins[Class::Large as usize].largest(&self.blocks));
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

    // ----- the steps of the policy -----

    /// Step 2: the smallest idle segment of `class` that holds `block_size` bytes, moved to
    /// `stream` if it belongs to another; returns its block.
    fn adopt_idle_segment(
        &mut self,
        cx: &Context<'_>,
        class: Class,
        block_size: u64,
        stream: StreamHandle,
    ) -> Result<Option<u32>> {
        let best = self
            .idle
            .iter()
            .map(|&seg| (&self.segments[seg as usize], seg))
            .filter(|(s, _)| s.class == class && s.size >= block_size)
            .min_by_key(|(s, seg)| (s.size, *seg))
            .map(|(_, seg)| seg);
        let Some(seg) = best else {
            return Ok(None);
        };
        let (old_slot, id) = (
            self.segments[seg as usize].slot,
            self.segments[seg as usize].first,
        );
        let old = self.slots[old_slot as usize].handle;
        if old != stream {
            self.order_after(cx, old, stream)?;
            self.bin_remove(old_slot, class, id);
            self.leave_slot(old_slot);
            let slot = self.join_slot(stream);
            self.segments[seg as usize].slot = slot;
            self.bin_insert(slot, class, id);
        }
        Ok(Some(id))
    }

    /// Steps 3 to 5: a new segment of `segment` bytes, as one free block of `stream`.
    fn grow(
        &mut self,
        cx: &Context<'_>,
        segment: u64,
        class: Class,
        stream: StreamHandle,
        requested: u64,
        mode: Grow,
    ) -> Result<u32> {
        let (free, total) = cx
            .driver
            .mem_get_info(self.device)
            .map_err(|e| Error::driver("asking the driver for free memory", &e))?;
        if segment > total {
            self.stats.ooms += 1;
            return Err(Error::out_of_memory(format!(
                "device {}: requested {} is more than the device's total memory of {}; \
                 no amount of cache returned can serve it: split the allocation or use a larger device",
                self.device,
                human(requested),
                human(total)
            )));
        }
        if self.stitching(cx) {
            let (base, chunks) = self.stitch(cx, segment, class, requested, mode, free)?;
            let size = chunks.iter().map(|c| c.size).sum();
            return Ok(self.install_segment(cx, base, size, class, stream, chunks));
        }
        self.make_room_under_limit(cx, segment, requested, mode)?;
        if mode == Grow::MayRelease && free < segment && self.config.release_before_grow {
            let released = self.release_idle(cx, segment - free)?;
            self.log(format_args!(
                "driver has {} free, {} needed: returned {} of idle cache first",
                human(free),
                human(segment),
                human(released)
            ));
        }
        let ptr = match cx.driver.mem_alloc(self.device, segment) {
            Ok(ptr) => ptr,
            Err(err) if err.is_out_of_memory() && mode == Grow::MayRelease => {
                self.stats.oom_retries += 1;
                self.collect_pending(cx, true)?;
                let released = self.release_idle(cx, u64::MAX)?;
                self.log(format_args!(
                    "driver out of memory for {}: returned all {} reusable, retrying once",
                    human(segment),
                    human(released)
                ));
                match cx.driver.mem_alloc(self.device, segment) {
                    Ok(ptr) => ptr,
                    Err(err) => return Err(self.alloc_failure(cx, err, requested, segment)),
                }
            }
            Err(err) => return Err(self.alloc_failure(cx, err, requested, segment)),
        };
        self.stats.add_reserved(segment, 1);
        Ok(self.install_segment(cx, ptr, segment, class, stream, Vec::new()))
    }

    /// Under a memory limit, make room for `bytes` more by returning idle cache (if `mode`
    /// allows), or fail with an out-of-memory error naming the limit.
    fn make_room_under_limit(
        &mut self,
        cx: &Context<'_>,
        bytes: u64,
        requested: u64,
        mode: Grow,
    ) -> Result<()> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        let allowed = limit.saturating_sub(self.stats.reserved_bytes);
        if bytes > allowed && mode == Grow::MayRelease {
            // Under a cap, returning idle cache is the only way to grow.
            self.release_idle(cx, bytes - allowed)?;
        }
        let allowed = limit.saturating_sub(self.stats.reserved_bytes);
        if bytes <= allowed {
            return Ok(());
        }
        self.stats.ooms += 1;
        Err(Error::out_of_memory(format!(
            "device {}: requested {} (needing {} more from the driver) would take this pool past \
             its memory limit of {}: it reserves {}, of which {} is reusable. Raise the limit \
             (rm_set_memory_limit, or torch.cuda.set_per_process_memory_fraction), or release \
             blocks you no longer need",
            self.device,
            human(requested),
            human(bytes),
            human(limit),
            human(self.stats.reserved_bytes),
            human(self.stats.reusable())
        )))
    }

    /// Book a new segment at `ptr` of `size` bytes (its memory already counted as reserved),
    /// as one free, idle block of `stream`; returns the block.
    fn install_segment(
        &mut self,
        cx: &Context<'_>,
        ptr: DevicePtr,
        segment: u64,
        class: Class,
        stream: StreamHandle,
        chunks: Vec<Chunk>,
    ) -> u32 {
        let seg = match self.vacant_segments.pop() {
            Some(seg) => seg,
            None => {
                self.segments.push(Segment {
                    base: 0,
                    size: 0,
                    slot: NIL,
                    class,
                    first: NIL,
                    in_use: false,
                    idle_at: NIL,
                    chunks: Vec::new(),
                    stitched: false,
                });
                u32::try_from(self.segments.len() - 1).expect("more than 4 billion segments")
            }
        };
        let id = self.blocks.insert(Block {
            ptr,
            size: segment,
            requested: 0,
            segment: seg,
            prev: NIL,
            next: NIL,
            bin_prev: NIL,
            bin_next: NIL,
            state: State::Free,
            shared: false,
        });
        let slot = self.join_slot(stream);
        let stitched = !chunks.is_empty();
        let mut offset = 0;
        let chunks = chunks
            .into_iter()
            .map(|chunk| {
                offset += chunk.size;
                (offset - chunk.size, chunk)
            })
            .collect();
        self.segments[seg as usize] = Segment {
            base: ptr,
            size: segment,
            slot,
            class,
            first: id,
            in_use: true,
            idle_at: NIL,
            chunks,
            stitched,
        };
        self.bin_insert(slot, class, id);
        self.mark_idle(seg);
        cx.directory.insert(ptr, segment, self.device);
        self.stats.segments += 1;
        id
    }

    /// Turn a failed driver allocation into the error the caller sees.
    fn alloc_failure(
        &mut self,
        cx: &Context<'_>,
        err: crate::driver::DriverError,
        requested: u64,
        segment: u64,
    ) -> Error {
        if !err.is_out_of_memory() {
            return Error::driver(
                &format!(
                    "device {}: allocating a {} segment",
                    self.device,
                    human(segment)
                ),
                &err,
            );
        }
        self.stats.ooms += 1;
        let driver_free = match cx.driver.mem_get_info(self.device) {
            Ok((free, _)) => human(free),
            Err(_) => "an unknown amount".to_string(),
        };
        Error::out_of_memory(format!(
            "device {}: out of memory: requested {} (a new segment of {}); this pool reserves {} \
             of which {} is reusable, and the driver reports {} free. Release blocks you no longer \
             need, or lower the batch or model size",
            self.device,
            human(requested),
            human(segment),
            human(self.stats.reserved_bytes),
            human(self.stats.reusable()),
            driver_free
        ))
    }

    /// Return idle segments to the driver until at least `needed` bytes are back (`u64::MAX`:
    /// all of them): the smallest single segment that covers it, else the largest first.
    fn release_idle(&mut self, cx: &Context<'_>, needed: u64) -> Result<u64> {
        let spare = self.release_spare(cx, needed)?;
        if spare >= needed {
            return Ok(spare);
        }
        let needed = needed - spare;
        let mut idle: Vec<(u64, u32)> = self
            .idle
            .iter()
            .map(|&seg| (self.segments[seg as usize].size, seg))
            .collect();
        if idle.is_empty() {
            return Ok(spare);
        }
        idle.sort_unstable();
        let chosen: Vec<(u64, u32)> = match idle.iter().find(|&&(size, _)| size >= needed) {
            Some(&one) if needed != u64::MAX => vec![one],
            _ => {
                let mut sum = 0u64;
                idle.iter()
                    .rev()
                    .take_while(|&&(size, _)| {
                        let more = sum < needed;
                        sum = sum.saturating_add(size);
                        more
                    })
                    .copied()
                    .collect()
            }
        };
        // Work queued before the blocks were released may still use them.
        cx.driver.synchronize(self.device).map_err(|e| {
            Error::driver("waiting for the device before returning cached memory", &e)
        })?;
        let mut released = spare;
        for (size, seg) in chosen {
            self.free_segment(cx, seg)?;
            released += size;
        }
        Ok(released)
    }

    /// Give an idle segment back to the driver and forget it.
    fn free_segment(&mut self, cx: &Context<'_>, seg: u32) -> Result<()> {
        let (base, size) = (
            self.segments[seg as usize].base,
            self.segments[seg as usize].size,
        );
        if !self.segments[seg as usize].stitched {
            cx.driver.mem_free(self.device, base).map_err(|e| {
                Error::driver(&format!("returning segment {base:#x} to the driver"), &e)
            })?;
            self.forget_segment(cx, seg);
            self.stats.remove_reserved(size, 1);
            return Ok(());
        }
        let chunks = self.dismantle(cx, seg)?;
        self.release_chunks(cx, chunks)
    }

    /// Drop a segment with no block in use from the books (not its memory); returns the
    /// chunks still mapped in it.
    fn forget_segment(&mut self, cx: &Context<'_>, seg: u32) -> Vec<Chunk> {
        let (base, slot, class, mut id, idle_at) = {
            let s = &self.segments[seg as usize];
            (s.base, s.slot, s.class, s.first, s.idle_at)
        };
        while id != NIL {
            let next = self.blocks[id].next;
            debug_assert!(matches!(self.blocks[id].state, State::Free | State::Hole));
            if self.blocks[id].state == State::Free {
                self.bin_remove(slot, class, id);
            }
            self.blocks.remove(id);
            id = next;
        }
        if idle_at != NIL {
            self.unmark_idle(seg);
        }
        self.leave_slot(slot);
        self.segments[seg as usize].in_use = false;
        self.vacant_segments.push(seg);
        cx.directory.remove(base);
        self.stats.segments -= 1;
        std::mem::take(&mut self.segments[seg as usize].chunks)
            .into_iter()
            .map(|(_, chunk)| chunk)
            .collect()
    }

    /// Free the pending blocks whose events have completed (all of them, waiting, if `wait`).
    fn collect_pending(&mut self, cx: &Context<'_>, wait: bool) -> Result<()> {
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

    // ----- blocks -----

    /// Hand out free block `id` as a block of `block_size` bytes. When it is larger, the front
    /// becomes a new live block and `id` stays as the free rest, moving between bins only if its
    /// size crosses a bin boundary: the usual cache hit touches no bin list at all.
    fn take(&mut self, id: u32, block_size: u64, requested: u64) -> DevicePtr {
        let seg = self.blocks[id].segment;
        let (slot, class) = {
            let s = &self.segments[seg as usize];
            (s.slot, s.class)
        };
        let (ptr, size, prev, next) = {
            let b = &self.blocks[id];
            (b.ptr, b.size, b.prev, b.next)
        };
        if prev == NIL && next == NIL {
            self.unmark_idle(seg);
        }
        let live_id = if size == block_size {
            self.bin_remove(slot, class, id);
            id
        } else {
            let live_id = self.blocks.insert(Block {
                ptr,
                size: block_size,
                requested,
                segment: seg,
                prev,
                next: id,
                bin_prev: NIL,
                bin_next: NIL,
                state: State::Live,
                shared: false,
            });
            if prev != NIL {
                self.blocks[prev].next = live_id;
            } else {
                self.segments[seg as usize].first = live_id;
            }
            let rest = &mut self.blocks[id];
            rest.prev = live_id;
            rest.ptr = ptr + block_size;
            rest.size = size - block_size;
            self.bin_resized(slot, class, id, size);
            live_id
        };
        let block = &mut self.blocks[live_id];
        block.size = block_size;
        block.requested = requested;
        block.state = State::Live;
        self.by_ptr.insert(ptr, live_id);
        self.stats.add_live(block_size, requested);
        ptr
    }

    /// Make block `id` free, merged with its free neighbours. A free neighbour grows over it in
    /// place (changing bins only if its size crosses a bin boundary).
    fn free_block(&mut self, id: u32) {
        let seg = self.blocks[id].segment;
        let (slot, class) = {
            let s = &self.segments[seg as usize];
            (s.slot, s.class)
        };
        let (ptr, size, prev, next) = {
            let b = &mut self.blocks[id];
            b.state = State::Free;
            b.requested = 0;
            (b.ptr, b.size, b.prev, b.next)
        };
        let prev_free = prev != NIL && self.blocks[prev].state == State::Free;
        let next_free = next != NIL && self.blocks[next].state == State::Free;
        let merged = match (prev_free, next_free) {
            (false, false) => {
                self.bin_insert(slot, class, id);
                id
            }
            (true, false) => {
                let old = self.blocks[prev].size;
                self.blocks[prev].size += size;
                self.unlink(id);
                self.bin_resized(slot, class, prev, old);
                prev
            }
            (false, true) => {
                let old = self.blocks[next].size;
                let b = &mut self.blocks[next];
                b.ptr = ptr;
                b.size += size;
                self.unlink(id);
                self.bin_resized(slot, class, next, old);
                next
            }
            (true, true) => {
                self.bin_remove(slot, class, next);
                let old = self.blocks[prev].size;
                self.blocks[prev].size += size + self.blocks[next].size;
                self.unlink(id);
                self.unlink(next);
                self.bin_resized(slot, class, prev, old);
                prev
            }
        };
        let b = &self.blocks[merged];
        if b.prev == NIL && b.next == NIL {
            self.mark_idle(seg);
        }
    }

    /// Take block `id` out of its segment's chain and the arena (its neighbours now cover it).
    fn unlink(&mut self, id: u32) {
        let (seg, prev, next) = {
            let b = &self.blocks[id];
            (b.segment, b.prev, b.next)
        };
        if prev != NIL {
            self.blocks[prev].next = next;
        } else {
            self.segments[seg as usize].first = next;
        }
        if next != NIL {
            self.blocks[next].prev = prev;
        }
        self.blocks.remove(id);
    }

    /// Free block `id`, held in the bins, changed size from `old_size`: move it if its bin did.
    fn bin_resized(&mut self, slot: u32, class: Class, id: u32, old_size: u64) {
        self.slots[slot as usize].bins[class as usize].resized(&mut self.blocks, id, old_size);
    }

    /// Park released block `id` on its stream, unmerged; the oldest parked block is merged if
    /// the list is full.
    fn park(&mut self, id: u32) {
        let slot = self.segments[self.blocks[id].segment as usize].slot as usize;
        self.blocks[id].state = State::Parked;
        self.blocks[id].requested = 0;
        if self.slots[slot].parked.len() == PARKED_MAX {
            let oldest = self.slots[slot].parked.remove(0);
            self.parked -= 1;
            self.by_ptr.remove(&self.blocks[oldest].ptr);
            self.free_block(oldest);
        }
        self.slots[slot].parked.push(id);
        self.parked += 1;
    }

    /// The most recently parked block of exactly `block_size` bytes on `slot`, taken out.
    fn unpark(&mut self, slot: u32, block_size: u64) -> Option<u32> {
        let parked = &mut self.slots[slot as usize].parked;
        let at = parked
            .iter()
            .rposition(|&id| self.blocks[id].size == block_size)?;
        self.parked -= 1;
        // Usually the last one: a pop, not a shift.
        Some(if at + 1 == parked.len() {
            parked.pop()?
        } else {
            parked.remove(at)
        })
    }

    /// Hand a parked block out again.
    fn revive(&mut self, id: u32, requested: u64) -> DevicePtr {
        let block = &mut self.blocks[id];
        block.state = State::Live;
        block.requested = requested;
        let (ptr, size) = (block.ptr, block.size);
        self.stats.add_live(size, requested);
        ptr
    }

    /// Merge every parked block into the free blocks of its stream.
    fn flush_parked(&mut self) {
        if self.parked == 0 {
            return;
        }
        for slot in 0..self.slots.len() {
            for id in std::mem::take(&mut self.slots[slot].parked) {
                self.by_ptr.remove(&self.blocks[id].ptr);
                self.free_block(id);
            }
        }
        self.parked = 0;
    }

    fn bin_insert(&mut self, slot: u32, class: Class, id: u32) {
        self.slots[slot as usize].bins[class as usize].insert(&mut self.blocks, id);
    }

    fn bin_remove(&mut self, slot: u32, class: Class, id: u32) {
        self.slots[slot as usize].bins[class as usize].remove(&mut self.blocks, id);
    }

    /// The stream of block `id` (its segment's).
    fn stream_of(&self, id: u32) -> StreamHandle {
        let slot = self.segments[self.blocks[id].segment as usize].slot;
        self.slots[slot as usize].handle
    }

    /// The slot of `stream`, made if needed, counting one more segment of it.
    fn join_slot(&mut self, stream: StreamHandle) -> u32 {
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
                        self.slots[slot as usize] = fresh;
                        slot
                    }
                    None => {
                        self.slots.push(fresh);
                        (self.slots.len() - 1) as u32
                    }
                };
                self.slot_of.insert(stream, slot);
                slot
            }
        };
        self.slots[slot as usize].segments += 1;
        slot
    }

    /// A segment left `slot`; the slot is freed with its last segment (its bins are empty then).
    fn leave_slot(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        s.segments -= 1;
        if s.segments == 0 {
            debug_assert!(s.bins.iter().all(Bins::is_empty) && s.parked.is_empty());
            self.slot_of.remove(&s.handle);
            self.vacant_slots.push(slot);
        }
    }

    fn mark_idle(&mut self, seg: u32) {
        debug_assert_eq!(self.segments[seg as usize].idle_at, NIL);
        self.segments[seg as usize].idle_at = self.idle.len() as u32;
        self.idle.push(seg);
    }

    fn unmark_idle(&mut self, seg: u32) {
        let at = self.segments[seg as usize].idle_at;
        debug_assert_ne!(at, NIL);
        self.idle.swap_remove(at as usize);
        if let Some(&moved) = self.idle.get(at as usize) {
            self.segments[moved as usize].idle_at = at;
        }
        self.segments[seg as usize].idle_at = NIL;
    }

    // ----- events -----

    fn take_event(&mut self, cx: &Context<'_>) -> crate::driver::DriverResult<EventHandle> {
        match self.spare_events.pop() {
            Some(event) => Ok(event),
            None => cx.driver.event_create(self.device),
        }
    }

    /// An event capturing the work queued so far on `stream`.
    fn record_event(
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
    fn synchronize_all(&self, cx: &Context<'_>) -> crate::driver::DriverResult<()> {
        (0..cx.driver.device_count()).try_for_each(|device| cx.driver.synchronize(device))
    }

    /// Order work queued on `to` from now on after the work queued so far on `from`. If the
    /// driver cannot (a destroyed stream, say), wait for the whole device instead.
    fn order_after(
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

    // ----- messages and checks -----

    fn explain_bad_pointer(&self, ptr: DevicePtr) -> Error {
        let seg = self
            .segments
            .iter()
            .find(|s| s.in_use && s.base <= ptr && ptr - s.base < s.size);
        let Some(seg) = seg else {
            return Error::invalid_pointer(format!(
                "{ptr:#x} was not returned by rm_reserve on device {}: it lies in no memory the \
                 pool holds (pass only pointers from rm_reserve, each once)",
                self.device
            ));
        };
        let mut id = seg.first;
        while id != NIL {
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

    /// Live blocks marked as used on other streams.
    fn blocks_shared(&self) -> usize {
        self.by_ptr
            .values()
            .filter(|&&id| self.blocks[id].shared)
            .count()
    }

    fn log(&self, args: std::fmt::Arguments<'_>) {
        if self.config.logging {
            eprintln!("resmem: device {}: {args}", self.device);
        }
    }

    /// Check every invariant of the books; a description of the first broken one.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut reserved = 0;
        let mut allocated = 0;
        let mut requested = 0;
        let mut live = 0;
        let mut parked = 0usize;
        let mut free_blocks = 0usize;
        let mut segments = 0;
        let mut slot_segments: IntMap<u32, u32> = IntMap::default();
        for (index, seg) in self.segments.iter().enumerate() {
            if !seg.in_use {
                continue;
            }
            segments += 1;
            reserved += seg.size;
            let mut id = seg.first;
            let mut expect = seg.base;
            let mut prev = NIL;
            let mut prev_free = false;
            let mut holes = 0;
            while id != NIL {
                let b = &self.blocks[id];
                let here = format!("block {:#x} of segment {:#x}", b.ptr, seg.base);
                if b.ptr != expect || b.prev != prev || b.segment as usize != index {
                    return Err(format!("{here}: broken neighbour links"));
                }
                if b.size == 0 || b.size % MIN_BLOCK != 0 || b.ptr % MIN_BLOCK != 0 {
                    return Err(format!("{here}: misaligned ({} bytes)", b.size));
                }
                match b.state {
                    State::Live => {
                        allocated += b.size;
                        requested += b.requested;
                        live += 1;
                        if self.by_ptr.get(&b.ptr) != Some(&id) {
                            return Err(format!("{here}: live but not in the address map"));
                        }
                        prev_free = false;
                    }
                    State::Parked => {
                        parked += 1;
                        if self.by_ptr.get(&b.ptr) != Some(&id)
                            || !self.slots[seg.slot as usize].parked.contains(&id)
                        {
                            return Err(format!("{here}: parked but not listed"));
                        }
                        prev_free = false;
                    }
                    State::Free => {
                        if prev_free {
                            return Err(format!("{here}: two free neighbours were not merged"));
                        }
                        free_blocks += 1;
                        prev_free = true;
                    }
                    State::Pending => prev_free = false,
                    State::Hole => {
                        holes += b.size;
                        let (start, end) = (b.ptr - seg.base, b.ptr - seg.base + b.size);
                        if !seg.stitched
                            || seg
                                .chunks
                                .iter()
                                .any(|&(o, c)| o < end && start < o + c.size)
                        {
                            return Err(format!("{here}: a hole where memory is mapped"));
                        }
                        prev_free = false;
                    }
                    State::Vacant => return Err(format!("{here}: vacant slot linked")),
                }
                expect = b.ptr + b.size;
                prev = id;
                id = b.next;
            }
            if expect != seg.base + seg.size {
                return Err(format!("segment {:#x}: blocks do not cover it", seg.base));
            }
            let mapped: u64 = seg.chunks.iter().map(|(_, c)| c.size).sum();
            if seg.stitched && mapped + holes != seg.size {
                return Err(format!(
                    "segment {:#x}: chunks and holes do not cover it",
                    seg.base
                ));
            }
            if seg.chunks.windows(2).any(|w| w[0].0 + w[0].1.size > w[1].0) {
                return Err(format!("segment {:#x}: chunks overlap", seg.base));
            }
            reserved -= holes;
            let first = &self.blocks[seg.first];
            let is_idle = first.next == NIL && first.state == State::Free;
            let listed =
                seg.idle_at != NIL && self.idle.get(seg.idle_at as usize) == Some(&(index as u32));
            if is_idle != listed {
                return Err(format!("segment {:#x}: idle list is wrong", seg.base));
            }
            *slot_segments.entry(seg.slot).or_insert(0u32) += 1;
        }
        if self
            .idle
            .iter()
            .any(|&seg| !self.segments[seg as usize].in_use)
        {
            return Err("a vacant segment is listed as idle".to_string());
        }
        for (&handle, &slot) in &self.slot_of {
            let s = &self.slots[slot as usize];
            if s.handle != handle
                || slot_segments.get(&slot).copied().unwrap_or(0) != s.segments
                || s.segments == 0
            {
                return Err(format!("stream {handle:#x}: slot {slot} has wrong books"));
            }
        }
        if slot_segments.len() != self.slot_of.len() {
            return Err("a segment belongs to an unmapped stream slot".to_string());
        }
        let binned: usize = self
            .slot_of
            .values()
            .flat_map(|&slot| self.slots[slot as usize].bins.iter())
            .map(Bins::len)
            .sum();
        if binned != free_blocks {
            return Err(format!("{free_blocks} free blocks but {binned} in bins"));
        }
        let shared = self.blocks_shared();
        if shared != self.shared.len() {
            return Err(format!(
                "{shared} blocks marked shared, {} in the map",
                self.shared.len()
            ));
        }
        if self.by_ptr.len() != live as usize + parked {
            return Err(format!(
                "{live} live and {parked} parked blocks but {} in the map",
                self.by_ptr.len()
            ));
        }
        let listed: usize = self.slots.iter().map(|s| s.parked.len()).sum();
        if listed != parked || self.parked != parked {
            return Err(format!(
                "{parked} parked blocks, {listed} listed, {} counted",
                self.parked
            ));
        }
        reserved += self.spare_bytes();
        let s = &self.stats;
        let books = (
            s.reserved_bytes,
            s.allocated_bytes,
            s.requested_bytes,
            s.live_blocks,
            s.segments,
        );
        if books != (reserved, allocated, requested, live, segments) {
            return Err(format!(
                "stats (reserved, allocated, requested, live, segments) = {books:?}, blocks say {:?}",
                (reserved, allocated, requested, live, segments)
            ));
        }
        if s.peak_allocated_bytes < s.allocated_bytes || s.peak_reserved_bytes < s.reserved_bytes {
            return Err("a peak is below its current value".to_string());
        }
        Ok(())
    }
}
