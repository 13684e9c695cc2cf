//! What the simulated driver was asked to do, by kind of call: how many calls reached it, and
//! how much device memory each kind created and gave back; and a per-call cost model that turns
//! those figures into an estimate of the time a real driver would have spent.
//!
//! Calls are counted where every driver call enters the simulator (the fault point). The bytes
//! are the change in the devices' used pages across the call: a call runs under the simulator's
//! lock, so the change seen at the next lock is the call's own. Memory freed by a `cuMemUnmap`
//! (the last mapping of a released handle) is the unmap's, as it is on the driver.

use crate::faults::Call;

/// One kind of call's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTally {
    /// The driver function.
    pub call: Option<Call>,
    /// Calls that reached the simulator, failed ones included.
    pub calls: u64,
    /// Bytes of device memory these calls created.
    pub bytes_created: u64,
    /// Bytes of device memory these calls gave back.
    pub bytes_freed: u64,
}

/// The running figures of every call kind.
#[derive(Debug)]
pub(crate) struct Ledger {
    tallies: Vec<CallTally>,
    /// The call under way and the used pages when it began.
    pending: Option<(Call, u64)>,
}

impl Ledger {
    pub(crate) fn new() -> Ledger {
        Ledger {
            tallies: Call::ALL
                .iter()
                .map(|&call| CallTally {
                    call: Some(call),
                    ..CallTally::default()
                })
                .collect(),
            pending: None,
        }
    }

    /// A call of `call` begins with `used_pages` pages in use on all devices.
    pub(crate) fn begin(&mut self, call: Call, used_pages: u64) {
        self.tallies[call as usize].calls += 1;
        self.pending = Some((call, used_pages));
    }

    /// The call under way (if any) ended with `used_pages` pages in use.
    pub(crate) fn settle(&mut self, used_pages: u64, page: u64) {
        if let Some((call, before)) = self.pending.take() {
            let t = &mut self.tallies[call as usize];
            if used_pages > before {
                t.bytes_created += (used_pages - before) * page;
            } else {
                t.bytes_freed += (before - used_pages) * page;
            }
        }
    }

    /// Every kind's figures, in [`Call::ALL`] order.
    pub(crate) fn tallies(&self) -> Vec<CallTally> {
        self.tallies.clone()
    }
}

/// The cost of one kind of call: a fixed part per call and a part per GiB created or freed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallCost {
    /// The driver function.
    pub call: Call,
    /// Microseconds per call.
    pub per_call_us: f64,
    /// Microseconds per GiB of device memory the call created or gave back.
    pub per_gib_us: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

/// Where the memory calls' figures come from: `benches/c/driver_costs.c`, run by
/// `scripts/gpu-check.sh` on one NVIDIA H200 (driver 580.159.04, CUDA 13.0), 2026-12-04, twice:
/// each call timed alone 20 times at 2 MiB, 20 MiB, 64 MiB, 512 MiB and 2 GiB. Per call: the
/// mean of the two runs' medians at 2 MiB; per GiB: the rise from 2 MiB to 2 GiB, halved
/// (README, "On a real GPU"; BENCHMARKS.md).
const H200_SOURCE: &str = "H200 measurement, 2026-12-04 (benches/c/driver_costs.c)";

/// Freeing physical memory, per GiB, whichever call frees it: `cuMemRelease` of an unmapped
/// handle measured 520 us per GiB on the H200, and `cuMemUnmap` frees a released handle's memory
/// in its stead (the ledger charges the call that freed the memory).
pub const H200_FREE_US_PER_GIB: f64 = 520.0;

const SYNC_SOURCE: &str = "assumption: a few microseconds for a call that does not touch memory";

/// The cost model: every call kind that a caching allocator makes, with its source. Kinds not
/// listed are counted but cost nothing here (initialisation, contexts, device queries).
pub const COSTS: &[CallCost] = &[
    // 46 us at 2 MiB, 344 at 2 GiB.
    CallCost {
        call: Call::MemAlloc,
        per_call_us: 46.0,
        per_gib_us: 149.0,
        source: H200_SOURCE,
    },
    // 37 us at 2 MiB, 1,198 at 2 GiB: freeing costs more than allocating.
    CallCost {
        call: Call::MemFree,
        per_call_us: 37.0,
        per_gib_us: 580.0,
        source: H200_SOURCE,
    },
    // 12 us at 2 MiB, 214 at 2 GiB.
    CallCost {
        call: Call::MemCreate,
        per_call_us: 12.0,
        per_gib_us: 101.0,
        source: H200_SOURCE,
    },
    // 13.5 us at 2 MiB, 1,054 at 2 GiB.
    CallCost {
        call: Call::MemRelease,
        per_call_us: 13.5,
        per_gib_us: H200_FREE_US_PER_GIB,
        source: H200_SOURCE,
    },
    // 1.0 us at 2 MiB, 5 at 2 GiB; it creates no memory.
    CallCost {
        call: Call::MemMap,
        per_call_us: 1.0,
        per_gib_us: 0.0,
        source: H200_SOURCE,
    },
    // 18 us at 2 MiB, 61 at 2 GiB for a handle still held; per GiB freed: as cuMemRelease.
    CallCost {
        call: Call::MemUnmap,
        per_call_us: 18.0,
        per_gib_us: H200_FREE_US_PER_GIB,
        source: H200_SOURCE,
    },
    // 27 us at 2 MiB, 26 at 20 MiB, 150 at 2 GiB: the model has no per-GiB part for a call
    // that creates no memory, so ranges of gigabytes cost more than it says.
    CallCost {
        call: Call::MemSetAccess,
        per_call_us: 27.0,
        per_gib_us: 0.0,
        source: H200_SOURCE,
    },
    // 0.9 us at 2 MiB, 12 at 2 GiB; the pool reserves 64 GiB or more at a time: the 2 GiB
    // figure.
    CallCost {
        call: Call::MemAddressReserve,
        per_call_us: 12.0,
        per_gib_us: 0.0,
        source: H200_SOURCE,
    },
    // 0.7 us at 2 MiB, 12 at 2 GiB: as cuMemAddressReserve.
    CallCost {
        call: Call::MemAddressFree,
        per_call_us: 12.0,
        per_gib_us: 0.0,
        source: H200_SOURCE,
    },
    CallCost {
        call: Call::MemGetInfo,
        per_call_us: 1.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::EventCreate,
        per_call_us: 2.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::EventRecord,
        per_call_us: 2.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::EventQuery,
        per_call_us: 1.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::EventSynchronize,
        per_call_us: 2.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::EventDestroy,
        per_call_us: 2.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::StreamWaitEvent,
        per_call_us: 2.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
    CallCost {
        call: Call::CtxSynchronize,
        per_call_us: 5.0,
        per_gib_us: 0.0,
        source: SYNC_SOURCE,
    },
];

/// The cost model's entry for `call`, if it has one.
pub fn cost_of(call: Call) -> Option<&'static CallCost> {
    COSTS.iter().find(|c| c.call == call)
}

/// The estimated driver time of `tally`'s calls, in microseconds (0 for kinds without a cost).
pub fn estimate_us(tally: &CallTally) -> f64 {
    let Some(cost) = tally.call.and_then(cost_of) else {
        return 0.0;
    };
    let gib = (tally.bytes_created + tally.bytes_freed) as f64 / f64::from(1u32 << 30);
    cost.per_call_us * tally.calls as f64 + cost.per_gib_us * gib
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_go_to_the_call_that_moved_them() {
        let mut ledger = Ledger::new();
        ledger.begin(Call::MemAlloc, 0);
        ledger.settle(3, 1 << 21);
        ledger.begin(Call::MemFree, 3);
        ledger.settle(1, 1 << 21);
        ledger.begin(Call::MemFree, 1);
        ledger.settle(1, 1 << 21);
        ledger.settle(0, 1 << 21); // nothing under way: nothing counted
        let t = ledger.tallies();
        let alloc = t[Call::MemAlloc as usize];
        assert_eq!(
            (alloc.calls, alloc.bytes_created, alloc.bytes_freed),
            (1, 6 << 20, 0)
        );
        let free = t[Call::MemFree as usize];
        assert_eq!(
            (free.calls, free.bytes_created, free.bytes_freed),
            (2, 0, 4 << 20)
        );
    }

    #[test]
    fn the_simulator_counts_calls_and_bytes_by_kind() {
        let page = crate::PAGE;
        let sim = crate::Sim::new(&[16 * page]);
        sim.init().unwrap();
        let a = sim.mem_alloc(0, 3 * page).unwrap();
        assert!(sim.mem_alloc(0, 20 * page).is_err()); // counted, moves nothing
        let b = sim.mem_alloc(0, 1).unwrap();
        sim.mem_free(a).unwrap();
        let handle = sim.mem_create(0, 2 * page).unwrap();
        sim.mem_release(handle).unwrap();
        let calls = sim.driver_calls();
        let get = |call: Call| {
            let t = calls[call as usize];
            assert_eq!(t.call, Some(call));
            (t.calls, t.bytes_created, t.bytes_freed)
        };
        assert_eq!(get(Call::MemAlloc), (3, 4 * page, 0));
        assert_eq!(get(Call::MemFree), (1, 0, 3 * page));
        assert_eq!(get(Call::MemCreate), (1, 2 * page, 0));
        assert_eq!(get(Call::MemRelease), (1, 0, 2 * page));
        assert_eq!(get(Call::Init), (1, 0, 0));
        sim.mem_free(b).unwrap();
    }

    #[test]
    fn the_estimate_is_per_call_plus_per_gib() {
        let tally = CallTally {
            call: Some(Call::MemAlloc),
            calls: 4,
            bytes_created: 2 << 30,
            bytes_freed: 0,
        };
        assert_eq!(estimate_us(&tally), 4.0 * 46.0 + 2.0 * 149.0);
        let map = CallTally {
            call: Some(Call::MemMap),
            calls: 10,
            ..CallTally::default()
        };
        assert_eq!(estimate_us(&map), 10.0);
        let init = CallTally {
            call: Some(Call::Init),
            calls: 3,
            ..CallTally::default()
        };
        assert_eq!(estimate_us(&init), 0.0);
        // Every kind has one entry at most.
        for c in COSTS {
            assert_eq!(COSTS.iter().filter(|d| d.call == c.call).count(), 1);
        }
    }
}
