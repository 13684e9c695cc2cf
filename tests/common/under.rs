//! One interface over [`Pool`] and [`Front`], so that a test runs the same operations on the
//! pool itself and behind the front caches.

use resmem::{Front, Pool, Result as RmResult, Stats};

/// What a test drives: the pool itself, or the pool behind the front caches (the C API's
/// path), with the same meaning on both.
pub trait Under: Send + Sync {
    fn reserve(&self, device: i32, size: u64, stream: u64) -> RmResult<u64>;
    /// [`Pool::reserve_no_wait`].
    fn reserve_no_wait(&self, device: i32, size: u64, stream: u64) -> RmResult<u64>;
    fn release(&self, ptr: u64) -> RmResult<()>;
    fn stats(&self, device: i32) -> RmResult<Stats>;
    fn mem_get_info(&self, device: i32) -> RmResult<(u64, u64)>;
    fn free_reusable(&self, device: Option<i32>) -> RmResult<u64>;
    fn warmup(&self, device: i32, bytes: u64) -> RmResult<u64>;
    fn reset_peak_stats(&self, device: i32) -> RmResult<()>;
    fn set_memory_limit(&self, device: Option<i32>, limit: Option<u64>) -> RmResult<u64>;
    fn memory_limit(&self, device: i32) -> RmResult<Option<u64>>;
    fn record_stream(&self, ptr: u64, stream: u64) -> RmResult<()>;
    fn check(&self) -> Result<(), String>;
    /// [`Pool::own_shard`].
    fn own_shard(&self, device: i32, stream: u64) -> RmResult<bool>;
    /// Whether the figures are consistent with each other while other threads' calls are in
    /// flight: the pool's are read under the device's lock; the front caches' running counters
    /// are summed across threads and are exact only once no call is in flight (as documented).
    fn figures_exact_in_flight(&self) -> bool;
}

macro_rules! under {
    ($t:ty, $exact:expr) => {
        impl Under for $t {
            fn figures_exact_in_flight(&self) -> bool {
                $exact
            }
            fn reserve(&self, device: i32, size: u64, stream: u64) -> RmResult<u64> {
                <$t>::reserve(self, device, size, stream)
            }
            fn reserve_no_wait(&self, device: i32, size: u64, stream: u64) -> RmResult<u64> {
                <$t>::reserve_no_wait(self, device, size, stream)
            }
            fn release(&self, ptr: u64) -> RmResult<()> {
                <$t>::release(self, ptr)
            }
            fn stats(&self, device: i32) -> RmResult<Stats> {
                <$t>::stats(self, device)
            }
            fn mem_get_info(&self, device: i32) -> RmResult<(u64, u64)> {
                <$t>::mem_get_info(self, device)
            }
            fn free_reusable(&self, device: Option<i32>) -> RmResult<u64> {
                <$t>::free_reusable(self, device)
            }
            fn warmup(&self, device: i32, bytes: u64) -> RmResult<u64> {
                <$t>::warmup(self, device, bytes)
            }
            fn reset_peak_stats(&self, device: i32) -> RmResult<()> {
                <$t>::reset_peak_stats(self, device)
            }
            fn set_memory_limit(&self, device: Option<i32>, limit: Option<u64>) -> RmResult<u64> {
                <$t>::set_memory_limit(self, device, limit)
            }
            fn memory_limit(&self, device: i32) -> RmResult<Option<u64>> {
                <$t>::memory_limit(self, device)
            }
            fn record_stream(&self, ptr: u64, stream: u64) -> RmResult<()> {
                <$t>::record_stream(self, ptr, stream)
            }
            fn check(&self) -> Result<(), String> {
                <$t>::check(self)
            }
            fn own_shard(&self, device: i32, stream: u64) -> RmResult<bool> {
                self.shards().own_shard(device, stream)
            }
        }
    };
}
under!(Pool, true);
under!(Front, false);

/// How each reaches the pool's shards.
trait Shards {
    fn shards(&self) -> &Pool;
}

impl Shards for Pool {
    fn shards(&self) -> &Pool {
        self
    }
}

impl Shards for Front {
    fn shards(&self) -> &Pool {
        self.pool()
    }
}
