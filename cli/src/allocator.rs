//! [`Allocator`]: what a caching allocator offers its callers. resmem's [`Pool`] implements it,
//! so does its [`Front`] (the pool behind the per-thread caches the C library uses), and so does
//! the PyTorch-policy baseline, so that trace replay, demos and benchmarks drive
//! either one through the same calls and compare their figures.

use resmem::driver::{DevicePtr, StreamHandle};
use resmem::error::Result;
use resmem::pool::Layout;
use resmem::{Front, Pool, Stats};

/// A caching device-memory allocator over some driver.
pub trait Allocator: Send + Sync {
    /// A short name for tables and plots, e.g. `resmem` or `torch`.
    fn name(&self) -> &'static str;
    /// Number of devices.
    fn device_count(&self) -> i32;
    /// A block of at least `size` bytes on `device` for use on `stream`; `0` for size 0.
    fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr>;
    /// Give a block back to the allocator; `0` does nothing.
    fn release(&self, ptr: DevicePtr) -> Result<()>;
    /// Note that a live block is also used on `stream`.
    fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()>;
    /// `(free, total)` bytes of `device`, as this allocator reports them to a loader.
    fn mem_get_info(&self, device: i32) -> Result<(u64, u64)>;
    /// Return idle cached memory to the driver (one device, or all); the bytes returned.
    fn free_reusable(&self, device: Option<i32>) -> Result<u64>;
    /// Prepare for a load of `bytes` (transformers' `caching_allocator_warmup`); the bytes the
    /// driver was asked for.
    fn warmup(&self, device: i32, bytes: u64) -> Result<u64>;
    /// The figures of `device`.
    fn stats(&self, device: i32) -> Result<Stats>;
    /// Set the peaks of `device` to the current values.
    fn reset_peak_stats(&self, device: i32) -> Result<()>;
    /// Where `device`'s reserved memory lies, by page (a walk of every block).
    fn layout(&self, device: i32) -> Result<Layout>;
}

impl Allocator for Pool {
    fn name(&self) -> &'static str {
        "resmem"
    }
    fn device_count(&self) -> i32 {
        Pool::device_count(self)
    }
    fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        Pool::reserve(self, device, size, stream)
    }
    fn release(&self, ptr: DevicePtr) -> Result<()> {
        Pool::release(self, ptr)
    }
    fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        Pool::record_stream(self, ptr, stream)
    }
    fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        Pool::mem_get_info(self, device)
    }
    fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        Pool::free_reusable(self, device)
    }
    fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        Pool::warmup(self, device, bytes)
    }
    fn stats(&self, device: i32) -> Result<Stats> {
        Pool::stats(self, device)
    }
    fn reset_peak_stats(&self, device: i32) -> Result<()> {
        Pool::reset_peak_stats(self, device)
    }
    fn layout(&self, device: i32) -> Result<Layout> {
        Pool::layout(self, device)
    }
}

impl Allocator for Front {
    fn name(&self) -> &'static str {
        "resmem-front"
    }
    fn device_count(&self) -> i32 {
        Front::device_count(self)
    }
    fn reserve(&self, device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr> {
        Front::reserve(self, device, size, stream)
    }
    fn release(&self, ptr: DevicePtr) -> Result<()> {
        Front::release(self, ptr)
    }
    fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        Front::record_stream(self, ptr, stream)
    }
    fn mem_get_info(&self, device: i32) -> Result<(u64, u64)> {
        Front::mem_get_info(self, device)
    }
    fn free_reusable(&self, device: Option<i32>) -> Result<u64> {
        Front::free_reusable(self, device)
    }
    fn warmup(&self, device: i32, bytes: u64) -> Result<u64> {
        Front::warmup(self, device, bytes)
    }
    fn stats(&self, device: i32) -> Result<Stats> {
        Front::stats(self, device)
    }
    fn reset_peak_stats(&self, device: i32) -> Result<()> {
        Front::reset_peak_stats(self, device)
    }
    /// The pool's layout: blocks waiting in a front cache count as live there. A replay's new
    /// peaks come from growth, which drains the caches first, so they hold none then.
    fn layout(&self, device: i32) -> Result<Layout> {
        self.pool().layout(device)
    }
}
