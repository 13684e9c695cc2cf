//! PyTorch memory snapshots from arbitrary bytes (`scripts/fuzz.sh` seeds the corpus with the
//! shipped fixture, `traces/fixtures/snapshot_small.pickle`): reading never panics and never
//! loops, and an error is one short line. A snapshot read is a well-formed trace (every free
//! names a live block, no live block's id reused), and PyTorch's policy and resmem's default
//! replay it on a 1 GiB simulated device without a panic (an error, such as a request too large
//! for any device, is fine).

#![no_main]

use std::collections::BTreeSet;

use libfuzzer_sys::fuzz_target;
use resmem_cli::replay::{replay, Policy};
use resmem_cli::snapshot;
use resmem_cli::trace::Event;

fuzz_target!(|data: &[u8]| {
    let trace = match snapshot::read(data, None) {
        Ok(trace) => trace,
        Err(e) => {
            assert!(!e.contains('\n') && e.len() < 400, "{e:?}");
            return;
        }
    };
    let mut live = BTreeSet::new();
    for event in &trace.events {
        match event {
            Event::Alloc { id, .. } => assert!(live.insert(*id), "id {id} reused while live"),
            Event::Free { id } => assert!(live.remove(id), "free of {id}, not live"),
            _ => {}
        }
    }
    for policy in [Policy::Torch, Policy::Resmem] {
        let _ = replay(&trace, policy, 1 << 30, |_| {});
    }
});
