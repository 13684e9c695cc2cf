//! Processes sharing a device give each other their idle cache (`RESMEM_CONF=share:true`).
//!
//! Each sharing process joins, per device, a [`registry`] that the resmem processes of one user
//! share (keyed by the device's UUID), and runs one `helper.rs` thread per device that answers the
//! others' requests by returning idle cache to the driver. When the pool runs out of memory
//! (after its own release-before-grow and retry), [`Sharing::after_out_of_memory`] posts the
//! shortfall, waits (at most `share_wait_ms`) for the driver's free memory to rise, and retries
//! once. With `share_count:true`, [`Sharing::others_reusable`] is what `rm_mem_get_info` adds.
//!
//! This module never touches the pool's books: it asks [`Front::trim`] and [`Front::reserve`],
//! which never free a block in use.

mod helper;
pub mod registry;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ShareConfig;
use crate::error::{Error, Result};
use crate::front::Front;
use crate::pool::size::{round_up, MAX_REQUEST, SEGMENT_ROUND};
use helper::Helper;
use registry::Registry;

/// The directory of the registries when `RESMEM_SHARE_DIR` is unset.
pub const DEFAULT_DIR: &str = "/dev/shm";

/// How long joining a registry waits for its lock.
const JOIN_PATIENCE: Duration = Duration::from_secs(1);

/// How long a waiting request sleeps between looks at the driver's free memory (memory of a
/// process that died comes back without an answer).
const POLL: Duration = Duration::from_millis(2);

/// One device's part.
struct Device {
    registry: Arc<Registry>,
    given: Arc<AtomicU64>,
    received: AtomicU64,
}

/// This process's sharing, on the devices whose registry it joined.
pub struct Sharing {
    devices: Vec<Option<Device>>,
    wait: Duration,
    logging: bool,
}

impl Sharing {
    /// Join the registry in `dir` of every device of `pool` and start their helper threads. A
    /// device whose UUID is unknown or whose registry is refused does not share; each such
    /// device gets one line on standard error saying why.
    pub fn start(pool: &'static Front, config: ShareConfig, dir: &Path, logging: bool) -> Sharing {
        let stall = test_stall();
        let devices = (0..pool.device_count())
            .map(|device| {
                let joined = pool
                    .driver()
                    .device_uuid(device)
                    .map_err(|e| format!("the device's UUID is unknown ({e})"))
                    .and_then(|uuid| Registry::open(dir, &uuid))
                    .and_then(|registry| {
                        let lock = registry
                            .lock_until(Instant::now() + JOIN_PATIENCE)
                            .ok_or("another process kept the registry locked")?;
                        registry.mine(&lock).ok_or(format!(
                            "all {} places in the registry are taken",
                            registry::SLOTS
                        ))?;
                        drop(lock);
                        Ok(registry)
                    });
                let registry = match joined {
                    Ok(registry) => Arc::new(registry),
                    Err(why) => {
                        eprintln!("resmem: device {device}: sharing off: {why}");
                        return None;
                    }
                };
                let given = Arc::new(AtomicU64::new(0));
                let helper = Helper {
                    pool,
                    device,
                    registry: Arc::clone(&registry),
                    given: Arc::clone(&given),
                    logging,
                    stall,
                };
                crate::unload::pin();
                if let Err(e) = helper.spawn() {
                    eprintln!("resmem: device {device}: sharing off: cannot start a thread: {e}");
                    return None;
                }
                Some(Device {
                    registry,
                    given,
                    received: AtomicU64::new(0),
                })
            })
            .collect();
        Sharing {
            devices,
            wait: Duration::from_millis(config.wait_ms),
            logging,
        }
    }

    fn device(&self, device: i32) -> Option<&Device> {
        usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .and_then(Option::as_ref)
    }

    /// Whether `device` shares (its registry was joined).
    pub fn shares(&self, device: i32) -> bool {
        self.device(device).is_some()
    }

    /// `(given, received)`: bytes this process returned to the driver at the others' requests,
    /// and bytes the others returned at its requests, on `device`.
    pub fn counts(&self, device: i32) -> (u64, u64) {
        self.device(device).map_or((0, 0), |d| {
            (
                d.given.load(Ordering::SeqCst),
                d.received.load(Ordering::SeqCst),
            )
        })
    }

    /// Tell the others that this process could give up `reusable` bytes on `device`.
    pub fn publish(&self, device: i32, reusable: u64) {
        if let Some(share) = self.device(device) {
            share.registry.publish(reusable);
        }
    }

    /// The reusable bytes the other sharing processes on `device` said they would give up.
    pub fn others_reusable(&self, device: i32) -> u64 {
        self.device(device)
            .map_or(0, |d| d.registry.others_reusable())
    }

    /// A call that needed `bytes` more from the driver of `device` failed with `error`, an
    /// out-of-memory: if the driver is short of them, ask the other processes for the
    /// shortfall, wait for the driver's free memory to rise (at most `share_wait_ms`), and run
    /// `retry` once. Otherwise, or if the memory did not come, `error` with what was asked and
    /// received added.
    pub fn after_out_of_memory<T>(
        &self,
        pool: &Front,
        device: i32,
        bytes: u64,
        error: Error,
        retry: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let Some(share) = self.device(device) else {
            return Err(error);
        };
        let need = round_up(bytes.min(MAX_REQUEST), SEGMENT_ROUND);
        let driver_free = || pool.driver().mem_get_info(device).map(|(free, _)| free);
        let Ok((free, total)) = pool.driver().mem_get_info(device) else {
            return Err(error);
        };
        if free >= need || need > total {
            // Short for another reason (a memory limit), or more than the device holds: the
            // others cannot help.
            return Err(error);
        }
        let asked = need - free;
        let start = Instant::now();
        let deadline = start + self.wait;
        let registry = &share.registry;
        let slot = registry
            .lock_until(deadline)
            .and_then(|lock| registry.mine(&lock));
        let Some(slot) = slot else {
            return Err(note(
                error,
                asked,
                0,
                self.wait,
                "the registry stayed busy or full",
            ));
        };
        let before = registry.post(slot, asked);
        let arrived = loop {
            let seen = registry.answers();
            if driver_free().is_ok_and(|free| free >= need) {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            registry.wait_answers(seen, POLL.min(deadline - now));
        };
        let waited = start.elapsed();
        // A helper holds the lock from its trim until it has recorded what it returned: taking
        // the lock (if it comes before the deadline) makes the count include every answer.
        let lock = registry.lock_until(deadline);
        let received = registry.close(slot, before);
        drop(lock);
        share.received.fetch_add(received, Ordering::SeqCst);
        if self.logging {
            eprintln!(
                "resmem: device {device}: sharing: asked the other processes for {} MiB; \
                 {} MiB came back in {} us",
                asked >> 20,
                received >> 20,
                waited.as_micros()
            );
        }
        if !arrived {
            return Err(note(
                error,
                asked,
                received,
                self.wait,
                "the driver's free memory did not rise enough",
            ));
        }
        retry()
    }
}

/// `error` with what sharing tried added to its message.
fn note(error: Error, asked: u64, received: u64, wait: Duration, why: &str) -> Error {
    Error::new(
        error.status,
        format!(
            "{} (sharing: asked the other processes on this device for {} MiB and they returned \
             {} MiB within {} ms: {why}; raise share_wait_ms, or free memory in the others)",
            error.message,
            asked >> 20,
            received >> 20,
            wait.as_millis()
        ),
    )
}

/// In debug builds, `RESMEM_TEST_SHARE_STALL_MS`: how long helper threads hold the registry's
/// lock before answering, so that tests can kill a process that holds it. Zero otherwise.
fn test_stall() -> Duration {
    #[cfg(debug_assertions)]
    if let Some(ms) = crate::runtime::var("RESMEM_TEST_SHARE_STALL_MS").and_then(|v| v.parse().ok())
    {
        return Duration::from_millis(ms);
    }
    Duration::ZERO
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;
    use crate::error::rm_status;
    use crate::pool::{Pool, PoolConfig};
    use cuda_sim::Sim;

    const GIB: u64 = 1 << 30;

    /// Two pools on two simulators that share one 24 GiB device through a scratch file, each
    /// sharing through a registry in a scratch directory.
    fn pair(name: &str, wait_ms: u64) -> [(&'static Front, Sharing); 2] {
        let dir = std::env::temp_dir().join(format!("resmem-share-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let capacity = dir.join("capacity").to_string_lossy().into_owned();
        let config = ShareConfig {
            enabled: true,
            count: true,
            wait_ms,
        };
        [(); 2].map(|()| {
            let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[24 * GIB])));
            sim.share_capacity(&capacity).unwrap();
            let driver = SimDriver::new(sim).unwrap();
            let pool: &'static Front = Box::leak(Box::new(Front::new(Pool::new(
                Arc::new(driver),
                PoolConfig::default(),
            ))));
            let sharing = Sharing::start(pool, config, &dir, false);
            (pool, sharing)
        })
    }

    #[test]
    fn a_process_short_of_memory_gets_the_idle_cache_of_another() {
        let [(a, share_a), (b, share_b)] = pair("give", 5000);
        assert!(share_a.shares(0) && share_b.shares(0));
        let cached = a.reserve(0, 16 * GIB, 0).unwrap();
        a.release(cached).unwrap();
        let error = b.reserve(0, 12 * GIB, 0).unwrap_err();
        assert_eq!(error.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
        let ptr = share_b
            .after_out_of_memory(b, 0, 12 * GIB, error, || b.reserve(0, 12 * GIB, 0))
            .unwrap();
        assert_ne!(ptr, 0);
        // A returned its whole 16 GiB idle segment; B asked for the 4 GiB it lacked.
        assert_eq!(share_a.counts(0), (16 * GIB, 0));
        assert_eq!(share_b.counts(0), (0, 16 * GIB));
        assert_eq!(a.stats(0).unwrap().reserved_bytes, 0);
        assert_eq!(b.stats(0).unwrap().allocated_bytes, 12 * GIB);
    }

    #[test]
    fn a_live_block_is_never_given_and_the_wait_is_bounded() {
        let [(a, _share_a), (b, share_b)] = pair("live", 50);
        let live = a.reserve(0, 16 * GIB, 0).unwrap();
        let error = b.reserve(0, 12 * GIB, 0).unwrap_err();
        let start = Instant::now();
        let error = share_b
            .after_out_of_memory(b, 0, 12 * GIB, error, || b.reserve(0, 12 * GIB, 0))
            .unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert_eq!(error.status, rm_status::RM_ERROR_OUT_OF_MEMORY);
        assert!(
            error.message.contains(
                "asked the other processes on this device for 4096 MiB and they returned 0 MiB \
                 within 50 ms"
            ),
            "{}",
            error.message
        );
        assert_eq!(a.stats(0).unwrap().allocated_bytes, 16 * GIB);
        a.release(live).unwrap();
    }

    #[test]
    fn the_others_reusable_bytes_are_counted_and_a_limit_is_not_a_shortage() {
        let [(a, share_a), (b, share_b)] = pair("count", 200);
        let cached = a.reserve(0, 6 * GIB, 0).unwrap();
        a.release(cached).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while share_b.others_reusable(0) != 6 * GIB && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(share_b.others_reusable(0), 6 * GIB);
        assert_eq!(share_a.others_reusable(0), 0);
        // Under its own cap, B's shortage is not the driver's: nobody is asked.
        b.set_memory_limit(Some(0), Some(GIB)).unwrap();
        let error = b.reserve(0, 2 * GIB, 0).unwrap_err();
        let error = share_b
            .after_out_of_memory(b, 0, 2 * GIB, error, || b.reserve(0, 2 * GIB, 0))
            .unwrap_err();
        assert!(error.message.contains("memory limit"), "{}", error.message);
        assert!(!error.message.contains("sharing"), "{}", error.message);
        // Nor is a request larger than the device.
        b.set_memory_limit(Some(0), None).unwrap();
        let error = b.reserve(0, 30 * GIB, 0).unwrap_err();
        let error = share_b
            .after_out_of_memory(b, 0, 30 * GIB, error, || b.reserve(0, 30 * GIB, 0))
            .unwrap_err();
        assert!(!error.message.contains("sharing"), "{}", error.message);
        assert_eq!(share_a.counts(0), (0, 0));
        assert_eq!(a.stats(0).unwrap().reserved_bytes, 6 * GIB);
    }
}
