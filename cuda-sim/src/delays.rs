//! Time a simulated driver call takes: `CUDA_SIM_DELAYS`, so that a program run on the
//! simulator can see what a real driver's slow calls do to it (a `cuCtxSynchronize` that waits
//! for a busy device, a `cuMemFree` of tens of microseconds). The simulator's calls take next
//! to no time otherwise.
//!
//! Syntax of `CUDA_SIM_DELAYS` and [`Delays::parse`]: comma-separated entries `NAME=TIME`, where
//! `NAME` is a driver function as `libcuda_sim.so` exports it and `TIME` a number of
//! microseconds, or a number with the unit `us` or `ms`. Example:
//! `cuCtxSynchronize=2ms,cuMemFree_v2=50us`.
//!
//! A delayed call takes its time before it takes the simulator's lock, so that other threads'
//! calls go on meanwhile, as they do on the driver while one thread is in it: up to
//! [`SPIN_LIMIT`] it spins, as a driver call that costs that much works on the CPU (a sleep that
//! short would last the kernel's timer slack, 50 µs, more), beyond it sleeps, as a thread waiting
//! for the device does.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::faults::Call;

/// The longest delay spent spinning; longer ones sleep.
pub const SPIN_LIMIT: Duration = Duration::from_micros(500);

/// The delay of every call, in nanoseconds (0: none).
#[derive(Debug)]
pub(crate) struct Delays(Box<[AtomicU64]>);

impl Delays {
    pub(crate) fn new() -> Delays {
        Delays(Call::ALL.iter().map(|_| AtomicU64::new(0)).collect())
    }

    /// Each call's delay from a list in the `CUDA_SIM_DELAYS` syntax; an error names the entry
    /// it cannot read.
    pub(crate) fn parse(spec: &str) -> Result<Vec<(Call, Duration)>, String> {
        spec.split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                let (name, time) = entry.split_once('=').ok_or_else(|| {
                    format!("{entry:?}: expected NAME=TIME, e.g. cuMemFree_v2=50us")
                })?;
                let call = Call::from_name(name.trim()).ok_or_else(|| {
                    format!(
                        "{entry:?}: {:?} is not a driver function the simulator knows",
                        name.trim()
                    )
                })?;
                let time = time.trim();
                let (number, micros) = if let Some(n) = time.strip_suffix("ms") {
                    (n, 1000.0)
                } else if let Some(n) = time.strip_suffix("us") {
                    (n, 1.0)
                } else {
                    (time, 1.0)
                };
                let value: f64 = number
                    .trim()
                    .parse()
                    .ok()
                    .filter(|v: &f64| v.is_finite() && *v >= 0.0 && *v * micros <= 60e6)
                    .ok_or_else(|| {
                        format!("{entry:?}: the time is not a number of us or ms up to a minute")
                    })?;
                Ok((call, Duration::from_secs_f64(value * micros / 1e6)))
            })
            .collect()
    }

    /// Set `call`'s delay.
    pub(crate) fn set(&self, call: Call, delay: Duration) {
        self.0[call as usize].store(delay.as_nanos() as u64, Relaxed);
    }

    /// Take `call`'s time, if it has one.
    pub(crate) fn wait(&self, call: Call) {
        let delay = Duration::from_nanos(self.0[call as usize].load(Relaxed));
        if delay > SPIN_LIMIT {
            std::thread::sleep(delay);
        } else if !delay.is_zero() {
            let start = Instant::now();
            while start.elapsed() < delay {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_parse_in_microseconds_or_milliseconds() {
        assert_eq!(
            Delays::parse(" cuCtxSynchronize=2ms, cuMemFree_v2=50us,cuMemUnmap=19.5 ,").unwrap(),
            vec![
                (Call::CtxSynchronize, Duration::from_millis(2)),
                (Call::MemFree, Duration::from_micros(50)),
                (Call::MemUnmap, Duration::from_nanos(19_500)),
            ]
        );
        assert!(Delays::parse("cuMemFree=50")
            .unwrap_err()
            .contains("not a driver function"));
        assert!(Delays::parse("cuMemFree_v2")
            .unwrap_err()
            .contains("NAME=TIME"));
        assert!(Delays::parse("cuMemFree_v2=-1")
            .unwrap_err()
            .contains("not a number"));
        assert!(Delays::parse("cuMemFree_v2=2h")
            .unwrap_err()
            .contains("not a number"));
        assert_eq!(Delays::parse("").unwrap(), vec![]);
    }
}
