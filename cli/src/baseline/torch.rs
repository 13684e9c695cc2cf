//! PyTorch's native CUDA caching allocator policy (`c10/cuda/CUDACachingAllocator.cpp`, without
//! CUDA graphs or garbage collection; its expandable segments in `expandable.rs`), written over
//! the [`Driver`] trait.
//!
//! The rules, as that file has them:
//! - every request is rounded up to a multiple of 512 bytes (at least 512), or with
//!   `roundup_power2_divisions`, to the next division of its power-of-two interval;
//! - requests of at most 1 MiB come from the *small* pool, whose segments are 2 MiB; larger ones
//!   from the *large* pool, whose segments are 20 MiB for requests under 10 MiB and the request
//!   rounded up to 2 MiB otherwise;
//! - a cached block is only reused on the stream it was allocated for: best fit in an ordered set
//!   keyed by (stream, size, address);
//! - with a finite `max_split_size`, a request below it never takes a cached block at or above it
//!   (*oversize*), and a request at or above it takes an oversize block only if the block is less
//!   than `max_non_split_rounding_mb` (20 MiB by default) larger;
//! - a found block is split when the remainder is at least 512 bytes (small pool, or any pool
//!   with expandable segments), or, in the large pool, when the request is below
//!   `max_split_size` and the remainder exceeds 1 MiB;
//! - freed blocks merge with free neighbours of the same segment; a block also used on other
//!   streams (`record_stream`) returns to the pool only once events recorded at its release
//!   complete;
//! - cached memory goes back to the driver only after a driver allocation failed: first cached
//!   oversize blocks of the stream that cover the request (largest first when none does alone),
//!   then every cached block that is a whole segment, then one retry;
//! - `mem_get_info` is the driver's view: cached memory counts as used;
//! - `empty_cache` returns every cached whole segment (with expandable segments, every cached
//!   block's whole handles);
//! - with expandable segments, a request no cached block holds grows the stream's range at the
//!   lowest free block with unmapped space after it (`expandable.rs`), and best fit counts such
//!   a block as what it can grow to.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use resmem::driver::{DevicePtr, Driver, EventHandle, StreamHandle};
use resmem::error::{rm_status, Error, Result};
use resmem::pool::layout::{Layout, Piece};
use resmem::Stats;

use super::expandable::Expandable;
use super::keys::{bytes as human, AddrMap};
use crate::allocator::Allocator;

/// The smallest block, and the rounding of every request.
pub const MIN_BLOCK: u64 = 512;
/// Requests of at most this many bytes use the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// The size of a small-pool segment.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// The size of a large-pool segment for requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests of at least this many bytes get a segment of their own size.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// The rounding of those segments.
pub const ROUND_LARGE: u64 = 2 << 20;
/// The largest request accepted: beyond it, rounding to [`ROUND_LARGE`] overflows.
pub const MAX_REQUEST: u64 = u64::MAX - (ROUND_LARGE - 1);

/// The settings PyTorch reads from `PYTORCH_CUDA_ALLOC_CONF` that this policy honours.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchConfig {
    /// `max_split_size_mb`, in bytes: cached blocks at least this large are never split. `None`
    /// (PyTorch's default) means unlimited.
    pub max_split_size: Option<u64>,
    /// `max_non_split_rounding_mb`, in bytes: with a finite `max_split_size`, a request at
    /// least that large takes a cached block only if the block is less than this much larger.
    /// `None`: PyTorch's default, 20 MiB ([`LARGE_BUFFER`]).
    pub max_non_split_rounding: Option<u64>,
    /// `roundup_power2_divisions`: for requests in each power-of-two interval from 1 MiB
    /// (`[0]`: below 2 MiB, `[1]`: 2 to 4 MiB, ..., `[15]`: 32 GiB and up), the number of
    /// equal divisions of the interval a request is rounded up to; 0 or 1 (PyTorch's default):
    /// to 512 bytes only.
    pub roundup_power2_divisions: [u64; POWER2_INTERVALS],
    /// `expandable_segments:True`: a stream's memory of each pool in one range that grows by
    /// handles of 2 MiB (small pool) or 20 MiB (large) at a free block's end
    /// (`expandable.rs`).
    pub expandable_segments: bool,
}

/// The intervals of `roundup_power2_divisions`: 1 MiB to 64 GiB, a power of two each.
pub const POWER2_INTERVALS: usize = 16;

impl TorchConfig {
    /// A request's size as PyTorch rounds it under these settings: to 512 bytes (at least
    /// 512), or where the request's interval has divisions (and the request is larger than 512
    /// bytes a division), up to the next division of its power-of-two interval.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK {
            return MIN_BLOCK;
        }
        let interval = (size.ilog2() as usize).saturating_sub(20);
        let divisions = self.roundup_power2_divisions[interval.min(POWER2_INTERVALS - 1)];
        if divisions > 1 && size > MIN_BLOCK.saturating_mul(divisions) {
            next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK) * MIN_BLOCK
        }
    }
}

/// `size` rounded up to the next of `divisions` equal steps between the powers of two around
/// it (a power of two stays; divisions count in powers of two, 6 as 4).
fn next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << size.ilog2();
    let step = floor >> divisions.ilog2();
    if step == 0 {
        return floor << 1;
    }
    let below = size & !(step - 1);
    if below == size {
        size
    } else {
        below.saturating_add(step)
    }
}

/// A request's size as PyTorch rounds it with its default settings.
pub fn round_size(size: u64) -> u64 {
    TorchConfig::default().round_size(size)
}

/// The size of the segment PyTorch asks the driver for to serve a rounded request.
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// One block: a whole segment or a piece of one, linked to its address neighbours.
#[derive(Clone, Debug)]
pub(super) struct Block {
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) stream: StreamHandle,
    pub(super) small: bool,
    pub(super) allocated: bool,
    /// Released, waiting for events on other streams.
    pub(super) pending: bool,
    pub(super) prev: Option<DevicePtr>,
    pub(super) next: Option<DevicePtr>,
    pub(super) stream_uses: Vec<StreamHandle>,
    /// Memory is mapped behind it: false only for the address space of an expandable segment
    /// with nothing mapped (kept in `Device::unmapped`, never in `free`).
    pub(super) mapped: bool,
    /// The expandable segment it lies in (an index into `Device::expandable`).
    pub(super) expandable: Option<usize>,
}

impl Block {
    /// A block nothing is allocated in: `size` bytes of `stream`'s pool between `prev` and
    /// `next`, mapped or not, in an expandable segment or not.
    pub(super) fn unused(
        size: u64,
        (stream, small): (StreamHandle, bool),
        (prev, next): (Option<DevicePtr>, Option<DevicePtr>),
        (mapped, expandable): (bool, Option<usize>),
    ) -> Block {
        Block {
            size,
            requested: 0,
            stream,
            small,
            allocated: false,
            pending: false,
            prev,
            next,
            stream_uses: Vec::new(),
            mapped,
            expandable,
        }
    }

    pub(super) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// One device's books.
#[derive(Default)]
pub(super) struct Device {
    pub(super) blocks: AddrMap<Block>,
    /// Cached blocks by (stream, size, address): `[small, large]`.
    pub(super) free: [BTreeSet<(StreamHandle, u64, DevicePtr)>; 2],
    pub(super) pending: Vec<(DevicePtr, Vec<EventHandle>)>,
    /// Unmapped blocks of expandable segments by (stream, address): `[small, large]`.
    pub(super) unmapped: [BTreeSet<(StreamHandle, DevicePtr)>; 2],
    /// Expandable segments, `None` once returned.
    pub(super) expandable: Vec<Option<Expandable>>,
    pub(super) stats: Stats,
    /// Bytes obtained from the driver since creation (for `warmup`'s answer).
    pub(super) driver_bytes: u64,
}

impl Device {
    /// Merge the block at `later` into the block at `earlier`, its address neighbour before it
    /// (the caller took both out of their sets): `later`'s entry goes.
    pub(super) fn merge(&mut self, earlier: DevicePtr, later: DevicePtr) {
        let b = self.blocks.remove(&later).expect("linked");
        let e = self.blocks.get_mut(&earlier).expect("known");
        e.size += b.size;
        e.next = b.next;
        if let Some(n) = b.next {
            self.blocks.get_mut(&n).expect("linked").prev = Some(earlier);
        }
    }
}

/// PyTorch's caching allocator policy over every device of a driver.
pub struct TorchAllocator {
    pub(super) driver: Arc<dyn Driver>,
    pub(super) config: TorchConfig,
    devices: Box<[Mutex<Device>]>,
}

impl TorchAllocator {
    /// The policy over every device `driver` sees. A `max_split_size` and a
    /// `max_non_split_rounding` must be at least 20 MiB, as PyTorch requires of
    /// `max_split_size_mb` and `max_non_split_rounding_mb` (earlier releases wanted more than
    /// 20 MiB).
    pub fn new(driver: Arc<dyn Driver>, config: TorchConfig) -> Result<TorchAllocator> {
        let settings = [
            ("max_split_size", config.max_split_size),
            ("max_non_split_rounding", config.max_non_split_rounding),
        ];
        for (name, bytes) in settings {
            if let Some(bytes) = bytes.filter(|&b| b < LARGE_BUFFER) {
                return Err(Error::invalid_value(format!(
                    "{name} of {} is too small: PyTorch requires at least 20 MiB",
                    human(bytes)
                )));
            }
        }
        let devices = (0..driver.device_count().max(0))
            .map(|_| Mutex::new(Device::default()))
            .collect();
        Ok(TorchAllocator {
            driver,
            config,
            devices,
        })
    }

    fn max_split(&self) -> u64 {
        self.config.max_split_size.unwrap_or(u64::MAX)
    }

    fn lock(&self, device: i32) -> Result<MutexGuard<'_, Device>> {
        usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
            .ok_or_else(|| {
                Error::new(
                    rm_status::RM_ERROR_INVALID_DEVICE,
                    format!(
                        "device {device} is out of range: {} sees {} device(s)",
                        self.driver.describe(),
                        self.devices.len()
                    ),
                )
            })
    }

    /// The device holding the live block at `ptr`.
    fn device_of(&self, ptr: DevicePtr) -> Result<i32> {
        if self.devices.len() == 1 {
            return Ok(0);
        }
        (0..self.devices.len() as i32)
            .find(|&d| {
                self.lock(d)
                    .map(|dev| dev.blocks.contains_key(&ptr))
                    .unwrap_or(false)
            })
            .ok_or_else(|| unknown_pointer(ptr))
    }

    fn malloc(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        let mut dev = self.lock(device)?;
        if size == 0 {
            return Ok(0);
        }
        let rounded = self.config.round_size(size.min(MAX_REQUEST));
        if size > MAX_REQUEST || rounded > MAX_REQUEST {
            return Err(Error::invalid_value(format!(
                "size {size} overflows when rounded to 2 MiB; pass the number of bytes you need"
            )));
        }
        self.process_events(device, &mut dev)?;
        dev.stats.reserve_calls += 1;
        let small = rounded <= SMALL_SIZE;
        let ptr = match self.get_free_block(&mut dev, rounded, small, stream) {
            Some(ptr) => {
                dev.stats.cache_hits += 1;
                ptr
            }
            None => self.new_segment(device, &mut dev, size, rounded, small, stream)?,
        };
        Ok(self.alloc_found_block(&mut dev, ptr, rounded, size))
    }

    /// Best fit among this stream's cached blocks, with the oversize rules; removed from the set.
    fn get_free_block(
        &self,
        dev: &mut Device,
        rounded: u64,
        small: bool,
        stream: StreamHandle,
    ) -> Option<DevicePtr> {
        let Device { free, blocks, .. } = dev;
        let set = &mut free[usize::from(!small)];
        let mut found = set.range((stream, rounded, 0)..);
        let mut best = *found.next()?;
        if best.0 != stream {
            return None;
        }
        // Best fit counts an expandable block as what it grows to with the unmapped space after
        // it: a later block of this stream that grows to less is taken instead.
        if self.config.expandable_segments {
            let grown = |b: &(StreamHandle, u64, DevicePtr)| {
                let block = &blocks[&b.2];
                b.1 + block
                    .next
                    .map(|n| &blocks[&n])
                    .filter(|n| !n.mapped)
                    .map_or(0, |n| n.size)
            };
            for next in found {
                if blocks[&best.2].expandable.is_none()
                    || next.0 != stream
                    || grown(next) >= grown(&best)
                {
                    break;
                }
                best = *next;
            }
        }
        let (s, bsize, ptr) = best;
        let max_split = self.max_split();
        if rounded < max_split && bsize >= max_split {
            return None;
        }
        let rounding = self.config.max_non_split_rounding.unwrap_or(LARGE_BUFFER);
        if rounded >= max_split && bsize >= rounded.saturating_add(rounding) {
            return None;
        }
        set.remove(&(s, bsize, ptr));
        Some(ptr)
    }

    /// A new segment for the request, releasing cache only after the driver refused.
    fn new_segment(
        &self,
        device: i32,
        dev: &mut Device,
        size: u64,
        rounded: u64,
        small: bool,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        // A segment of the pool's size, or with expandable segments, the request's size mapped
        // at a free block's end.
        let grow = |dev: &mut Device| {
            if self.config.expandable_segments {
                self.alloc_expandable(device, dev, rounded, small, stream)
            } else {
                self.alloc_block(device, dev, allocation_size(rounded), small, stream)
            }
        };
        if let Some(ptr) = grow(dev)? {
            return Ok(ptr);
        }
        if self.release_available_cached_blocks(device, dev, rounded, small, stream)? {
            if let Some(ptr) = grow(dev)? {
                return Ok(ptr);
            }
        }
        self.release_cached_blocks(device, dev)?;
        dev.stats.oom_retries += 1;
        if let Some(ptr) = grow(dev)? {
            return Ok(ptr);
        }
        dev.stats.ooms += 1;
        let (free, total) = self.driver.mem_get_info(device).unwrap_or((0, 0));
        Err(Error::out_of_memory(format!(
            "CUDA out of memory (PyTorch policy). Tried to allocate {} on device {device}, which \
             has a total capacity of {} of which {} is free. Of the reserved memory, {} is \
             allocated and {} is reserved but unallocated",
            human(size),
            human(total),
            human(free),
            human(dev.stats.allocated_bytes),
            human(dev.stats.reusable())
        )))
    }

    /// One driver allocation; `None` on out-of-memory.
    fn alloc_block(
        &self,
        device: i32,
        dev: &mut Device,
        bytes: u64,
        small: bool,
        stream: StreamHandle,
    ) -> Result<Option<DevicePtr>> {
        let ptr = match self.driver.mem_alloc(device, bytes) {
            Ok(ptr) => ptr,
            Err(e) if e.is_out_of_memory() => return Ok(None),
            Err(e) => return Err(Error::driver("allocating a segment", &e)),
        };
        dev.blocks.insert(
            ptr,
            Block::unused(bytes, (stream, small), (None, None), (true, None)),
        );
        dev.stats.add_reserved(bytes, 1);
        dev.stats.segments += 1;
        dev.driver_bytes += bytes;
        Ok(Some(ptr))
    }

    /// With a finite `max_split_size`: return cached oversize whole segments of this stream,
    /// the smallest that covers the request alone, else the largest first until they cover it.
    fn release_available_cached_blocks(
        &self,
        device: i32,
        dev: &mut Device,
        rounded: u64,
        small: bool,
        stream: StreamHandle,
    ) -> Result<bool> {
        let max_split = self.max_split();
        if self.config.max_split_size.is_none() {
            return Ok(false);
        }
        let key = rounded.max(max_split);
        let set = &dev.free[usize::from(!small)];
        // Whole segments; never an expandable segment's blocks (their handles go back only
        // with the rest of the cache).
        let whole = |b: &(StreamHandle, u64, DevicePtr)| {
            let block = &dev.blocks[&b.2];
            !block.is_split() && block.expandable.is_none()
        };
        if let Some(&one) = set
            .range((stream, key, 0)..)
            .next()
            .filter(|b| b.0 == stream && whole(b))
        {
            self.release_block(device, dev, one)?;
            return Ok(true);
        }
        let mut chosen = Vec::new();
        let mut total = 0u64;
        for &b in set.range((stream, max_split, 0)..(stream, key, 0)).rev() {
            if total >= key {
                break;
            }
            if whole(&b) {
                total += b.1;
                chosen.push(b);
            }
        }
        self.synchronize(device)?;
        for b in chosen {
            self.release_block(device, dev, b)?;
        }
        Ok(total >= key)
    }

    /// Wait for pending blocks, then return every cached block that is a whole segment.
    fn release_cached_blocks(&self, device: i32, dev: &mut Device) -> Result<u64> {
        for (ptr, events) in std::mem::take(&mut dev.pending) {
            for event in events {
                self.driver
                    .event_synchronize(device, event)
                    .and_then(|()| self.driver.event_destroy(device, event))
                    .map_err(|e| Error::driver("waiting for a released block's streams", &e))?;
            }
            Self::free_block(dev, ptr);
        }
        let whole: Vec<_> = dev
            .free
            .iter()
            .flatten()
            .filter(|b| !dev.blocks[&b.2].is_split() && dev.blocks[&b.2].expandable.is_none())
            .copied()
            .collect();
        let expandable: Vec<DevicePtr> = dev
            .free
            .iter()
            .flatten()
            .filter(|b| dev.blocks[&b.2].expandable.is_some())
            .map(|b| b.2)
            .collect();
        if whole.is_empty() && expandable.is_empty() {
            return Ok(0);
        }
        self.synchronize(device)?;
        let mut released = 0;
        for b in whole {
            released += b.1;
            self.release_block(device, dev, b)?;
        }
        // Each cached expandable block's whole handles, and a segment left with nothing mapped.
        for ptr in expandable {
            released += self.unmap_block(device, dev, ptr)?;
        }
        Ok(released)
    }

    pub(super) fn synchronize(&self, device: i32) -> Result<()> {
        self.driver
            .synchronize(device)
            .map_err(|e| Error::driver("waiting for the device before freeing", &e))
    }

    /// Free a cached whole segment.
    fn release_block(
        &self,
        device: i32,
        dev: &mut Device,
        key: (StreamHandle, u64, DevicePtr),
    ) -> Result<()> {
        let (_, size, ptr) = key;
        self.driver
            .mem_free(device, ptr)
            .map_err(|e| Error::driver("returning a cached segment", &e))?;
        let small = dev.blocks[&ptr].small;
        dev.free[usize::from(!small)].remove(&key);
        dev.blocks.remove(&ptr);
        dev.stats.remove_reserved(size, 1);
        dev.stats.segments -= 1;
        Ok(())
    }

    /// Hand out the block at `ptr` for a request, splitting off the remainder where the rules say.
    fn alloc_found_block(
        &self,
        dev: &mut Device,
        ptr: DevicePtr,
        rounded: u64,
        requested: u64,
    ) -> DevicePtr {
        let block = dev.blocks.get_mut(&ptr).expect("a found block is known");
        let remaining = block.size - rounded;
        let split = if block.small || self.config.expandable_segments {
            remaining >= MIN_BLOCK
        } else {
            rounded < self.max_split() && remaining > SMALL_SIZE
        };
        if split {
            let rest = Block::unused(
                remaining,
                (block.stream, block.small),
                (Some(ptr), block.next),
                (true, block.expandable),
            );
            let rest_ptr = ptr + rounded;
            block.size = rounded;
            block.next = Some(rest_ptr);
            let (stream, small, after) = (rest.stream, rest.small, rest.next);
            dev.blocks.insert(rest_ptr, rest);
            if let Some(after) = after {
                dev.blocks.get_mut(&after).expect("linked").prev = Some(rest_ptr);
            }
            dev.free[usize::from(!small)].insert((stream, remaining, rest_ptr));
        }
        let block = dev.blocks.get_mut(&ptr).expect("a found block is known");
        block.allocated = true;
        block.requested = requested;
        let size = block.size;
        dev.stats.add_live(size, requested);
        ptr
    }

    fn free(&self, ptr: DevicePtr) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let device = self.device_of(ptr)?;
        let mut dev = self.lock(device)?;
        let block = match dev.blocks.get_mut(&ptr) {
            Some(b) if b.allocated => b,
            _ => return Err(unknown_pointer(ptr)),
        };
        block.allocated = false;
        let (size, requested) = (block.size, block.requested);
        let uses = std::mem::take(&mut block.stream_uses);
        dev.stats.remove_live(size, requested);
        if uses.is_empty() {
            Self::free_block(&mut dev, ptr);
            return Ok(());
        }
        let mut events = Vec::with_capacity(uses.len());
        for stream in uses {
            let event = self
                .driver
                .event_create(device)
                .and_then(|ev| self.driver.event_record(device, ev, stream).map(|()| ev))
                .map_err(|e| Error::driver("recording a released block's stream use", &e))?;
            events.push(event);
        }
        dev.blocks.get_mut(&ptr).expect("known").pending = true;
        dev.pending.push((ptr, events));
        Ok(())
    }

    /// Return released blocks whose events have all completed to the pool.
    fn process_events(&self, device: i32, dev: &mut Device) -> Result<()> {
        let mut i = 0;
        while i < dev.pending.len() {
            let mut done = true;
            for &event in &dev.pending[i].1 {
                if !self
                    .driver
                    .event_query(device, event)
                    .map_err(|e| Error::driver("querying a released block's event", &e))?
                {
                    done = false;
                    break;
                }
            }
            if done {
                let (ptr, events) = dev.pending.swap_remove(i);
                for event in events {
                    let _ = self.driver.event_destroy(device, event);
                }
                Self::free_block(dev, ptr);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// A block goes back to its pool, merged with free neighbours.
    pub(super) fn free_block(dev: &mut Device, mut ptr: DevicePtr) {
        let mergeable = |dev: &Device, p: Option<DevicePtr>| {
            p.filter(|p| {
                let b = &dev.blocks[p];
                !b.allocated && !b.pending && b.mapped
            })
        };
        dev.blocks.get_mut(&ptr).expect("known").pending = false;
        if let Some(prev) = mergeable(dev, dev.blocks[&ptr].prev) {
            let p = &dev.blocks[&prev];
            dev.free[usize::from(!p.small)].remove(&(p.stream, p.size, prev));
            dev.merge(prev, ptr);
            ptr = prev;
        }
        if let Some(next) = mergeable(dev, dev.blocks[&ptr].next) {
            let n = &dev.blocks[&next];
            dev.free[usize::from(!n.small)].remove(&(n.stream, n.size, next));
            dev.merge(ptr, next);
        }
        let b = &dev.blocks[&ptr];
        let key = (b.stream, b.size, ptr);
        dev.free[usize::from(!b.small)].insert(key);
    }

    /// Check the books of every device against the blocks: a description of the first problem.
    pub fn check(&self) -> std::result::Result<(), String> {
        for device in 0..self.devices.len() as i32 {
            let dev = self.lock(device).map_err(|e| e.message)?;
            let mut reserved = 0;
            let mut allocated = 0;
            let mut cached = 0;
            let mut unmapped = 0;
            for (&ptr, b) in &dev.blocks {
                if b.prev.is_none() {
                    let mut p = Some(ptr);
                    while let Some(q) = p {
                        let blk = &dev.blocks[&q];
                        if blk.mapped {
                            reserved += blk.size;
                        }
                        if let Some(n) = blk.next {
                            if n != q + blk.size {
                                return Err(format!("{q:#x}: next {n:#x} is not adjacent"));
                            }
                        }
                        p = blk.next;
                    }
                }
                if !b.mapped {
                    unmapped += 1;
                    if b.allocated
                        || !dev.unmapped[usize::from(!b.small)].contains(&(b.stream, ptr))
                    {
                        return Err(format!("{ptr:#x}: unmapped block missing from its pool"));
                    }
                } else if b.allocated {
                    allocated += b.size;
                } else if !b.pending {
                    cached += 1;
                    if !dev.free[usize::from(!b.small)].contains(&(b.stream, b.size, ptr)) {
                        return Err(format!("{ptr:#x}: free block missing from its pool"));
                    }
                }
            }
            let in_sets: usize = dev.free.iter().map(BTreeSet::len).sum();
            if in_sets != cached {
                return Err(format!("{in_sets} blocks in the pools, {cached} cached"));
            }
            let listed: usize = dev.unmapped.iter().map(BTreeSet::len).sum();
            if listed != unmapped {
                return Err(format!(
                    "{listed} unmapped blocks listed, {unmapped} in segments"
                ));
            }
            if reserved != dev.stats.reserved_bytes || allocated != dev.stats.allocated_bytes {
                return Err(format!(
                    "device {device}: blocks hold {reserved} reserved / {allocated} allocated, \
                     stats say {} / {}",
                    dev.stats.reserved_bytes, dev.stats.allocated_bytes
                ));
            }
        }
        Ok(())
    }
}

fn unknown_pointer(ptr: DevicePtr) -> Error {
    Error::invalid_pointer(format!(
        "{ptr:#x} is not a live block of this allocator (pass only pointers it returned, each once)"
    ))
}

impl Allocator for TorchAllocator {
    fn name(&self) -> &'static str {
        "torch"
    }
    fn device_count(&self) -> i32 {
        self.devices.len() as i32
    }
    fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        self.malloc(device, size, stream)
    }
    fn release(&self, ptr: DevicePtr) -> Result<()> {
        self.free(ptr)
    }
    fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let device = self.device_of(ptr)?;
        let mut dev = self.lock(device)?;
        match dev.blocks.get_mut(&ptr) {
            Some(b) if b.allocated => {
                if b.stream != stream && !b.stream_uses.contains(&stream) {
                    b.stream_uses.push(stream);
                }
                Ok(())
            }
            _ => Err(unknown_pointer(ptr)),
        }
    }
    /// The driver's view: PyTorch's `torch.cuda.mem_get_info` counts cached memory as used.
    fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        drop(self.lock(device)?); // only to check the ordinal
        self.driver
            .mem_get_info(device)
            .map_err(|e| Error::driver("asking the driver for free memory", &e))
    }
    /// `torch.cuda.empty_cache()`.
    fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        let devices = match device {
            Some(d) => d..d + 1,
            None => 0..self.devices.len() as i32,
        };
        let mut total = 0;
        for d in devices {
            let mut dev = self.lock(d)?;
            total += self.release_cached_blocks(d, &mut dev)?;
        }
        Ok(total)
    }
    /// transformers' `caching_allocator_warmup` on PyTorch: one tensor of `bytes`, dropped at
    /// once, so that its block stays cached. Returns the bytes the driver was asked for.
    fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        let before = self.lock(device)?.driver_bytes;
        let ptr = self.malloc(device, bytes, 0)?;
        self.free(ptr)?;
        Ok(self.lock(device)?.driver_bytes - before)
    }
    fn stats(&self, device: i32) -> Result<Stats> {
        let dev = self.lock(device)?;
        let mut s = dev.stats;
        s.reusable_bytes = s.reusable();
        s.largest_reusable_block = dev.free.iter().flatten().map(|b| b.1).max().unwrap_or(0);
        Ok(s)
    }
    fn reset_peak_stats(&self, device: i32) -> Result<()> {
        self.lock(device)?.stats.reset_peaks();
        Ok(())
    }
    fn layout(&self, device: i32) -> Result<Layout> {
        let dev = self.lock(device)?;
        let mut layout = Layout::default();
        // Each segment from its first block (none before it), along its chain; an expandable
        // segment as its runs of mapped blocks, each a segment of its own.
        for (&first, _) in dev.blocks.iter().filter(|(_, b)| b.prev.is_none()) {
            let mut run = Vec::new();
            let mut at = Some(first);
            while let Some(p) = at {
                let b = &dev.blocks[&p];
                at = b.next;
                if !b.mapped {
                    layout.add_segment(std::mem::take(&mut run));
                } else if b.allocated {
                    run.push(Piece::Live {
                        size: b.size,
                        requested: b.requested,
                    });
                } else {
                    run.push(Piece::Free(b.size));
                }
            }
            layout.add_segment(run);
        }
        Ok(layout)
    }
}
