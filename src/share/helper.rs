//! The helper thread of one shared device: it sleeps on the registry's request counter, and on
//! each request (or every [`REFRESH`]) says how much this process could give up and returns
//! idle cache, up to what the others still want, through [`Front::trim`] (blocks waiting in the front caches
//! given back to the pool first): never a block in use.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::registry::Registry;
use crate::front::Front;

/// How often the thread refreshes this process's reusable bytes without a request.
pub const REFRESH: Duration = Duration::from_millis(100);
/// How long the thread tries to take the registry's lock before skipping a round.
const LOCK_PATIENCE: Duration = Duration::from_secs(1);

/// What the thread works with.
pub struct Helper {
    pub pool: &'static Front,
    pub device: i32,
    pub registry: Arc<Registry>,
    /// Bytes this process returned at others' requests.
    pub given: Arc<AtomicU64>,
    pub logging: bool,
    /// In debug builds, for tests: how long to hold the registry's lock before answering
    /// (`RESMEM_TEST_SHARE_STALL_MS`), so that a test can kill a process that holds it.
    pub stall: Duration,
}

impl Helper {
    /// Start the thread; it runs for the life of the process.
    pub fn spawn(self) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name(format!("resmem-share-{}", self.device))
            .spawn(move || self.run())
            .map(drop)
    }

    fn run(self) {
        let mut seen = self.registry.requests();
        loop {
            self.publish();
            self.answer();
            self.registry.wait_requests(seen, REFRESH);
            seen = self.registry.requests();
        }
    }

    fn publish(&self) {
        if let Ok(stats) = self.pool.stats(self.device) {
            self.registry.publish(stats.reusable_bytes);
        }
    }

    /// Return idle cache for every open request of another process.
    fn answer(&self) {
        let Some(lock) = self.registry.lock_until(Instant::now() + LOCK_PATIENCE) else {
            return;
        };
        let wanting: Vec<_> = lock
            .others()
            .into_iter()
            .filter(|slot| slot.wanted() > 0)
            .collect();
        if wanting.is_empty() {
            return;
        }
        if !self.stall.is_zero() {
            std::thread::sleep(self.stall);
        }
        let mut returned = 0;
        for slot in wanting {
            let want = slot.wanted();
            if want == 0 {
                continue;
            }
            let bytes = match self.pool.trim(self.device, want) {
                Ok(bytes) => bytes,
                Err(e) => {
                    self.log(format_args!("could not return idle cache: {}", e.message));
                    0
                }
            };
            if bytes == 0 {
                break;
            }
            slot.answered(bytes);
            returned += bytes;
        }
        drop(lock);
        if returned > 0 {
            self.given.fetch_add(returned, Ordering::SeqCst);
            self.registry.announce();
            self.publish();
            self.log(format_args!(
                "returned {} MiB of idle cache to the driver for another process",
                returned >> 20
            ));
        }
    }

    fn log(&self, args: std::fmt::Arguments<'_>) {
        if self.logging {
            eprintln!("resmem: device {}: sharing: {args}", self.device);
        }
    }
}
