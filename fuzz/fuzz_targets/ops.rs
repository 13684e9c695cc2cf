//! Operation sequences from arbitrary bytes on two simulated devices with three streams each:
//! every byte pair is one operation. After each, the books must be exact (`Pool::check`,
//! reserved equal to what the simulator holds, allocated + reusable = reserved) and every block
//! aligned and inside the driver's memory; at the end, releasing everything and returning the
//! cache leaves the simulator empty.

#![no_main]

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cuda_sim::Sim;
use libfuzzer_sys::fuzz_target;
use resmem::driver::sim::SimDriver;
use resmem::{rm_status, Pool, PoolConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn size(code: u8) -> u64 {
    // 1 byte to 3 GiB, on a roughly logarithmic scale with odd sizes in between.
    let shift = u64::from(code % 32);
    ((1u64 << shift) + u64::from(code / 32) * 511).min(3 * GIB)
}

fuzz_target!(|data: &[u8]| {
    // One simulator for the whole run (each input leaves it empty), so memory stays flat.
    static SIM: OnceLock<(&'static Sim, Vec<Vec<u64>>)> = OnceLock::new();
    let (sim, streams) = SIM.get_or_init(|| {
        let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[4 * GIB, GIB])));
        sim.init().unwrap();
        let streams = (0..2)
            .map(|d| {
                vec![
                    0,
                    sim.stream_create(d).unwrap(),
                    sim.stream_create(d).unwrap(),
                ]
            })
            .collect();
        (sim, streams)
    });
    let sim: &'static Sim = sim;
    let pool = Pool::new(
        Arc::new(SimDriver::new(sim).unwrap()),
        PoolConfig {
            release_before_grow: data.first().is_some_and(|b| b & 1 == 0),
            logging: false,
        },
    );
    let mut live: BTreeMap<u64, (i32, u64)> = BTreeMap::new();
    for pair in data.chunks_exact(2) {
        let (op, arg) = (pair[0], pair[1]);
        let device = i32::from(op & 1);
        let stream = streams[device as usize][usize::from((op >> 1) % 3)];
        let pick = |live: &BTreeMap<u64, (i32, u64)>| {
            (!live.is_empty()).then(|| *live.iter().nth(usize::from(arg) % live.len()).unwrap().0)
        };
        match op >> 3 {
            0..=11 => match pool.reserve(device, size(arg), stream) {
                Ok(ptr) => {
                    assert_eq!(ptr % 512, 0);
                    assert_eq!(sim.device_of(ptr), Some(device));
                    assert_eq!(sim.device_of(ptr + size(arg) - 1), Some(device));
                    assert!(live.insert(ptr, (device, size(arg))).is_none());
                }
                Err(e) => assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY, "{e}"),
            },
            12..=19 => {
                if let Some(ptr) = pick(&live) {
                    pool.release(ptr).unwrap();
                    live.remove(&ptr);
                }
            }
            20..=22 => {
                if let Some(ptr) = pick(&live) {
                    let (d, _) = live[&ptr];
                    pool.record_stream(ptr, streams[d as usize][usize::from(arg % 3)])
                        .unwrap();
                }
            }
            23 => {
                // An address past a block's start that no other live block starts at.
                if let Some(ptr) = pick(&live) {
                    let inner = ptr + 512 * u64::from(arg % 4 + 1);
                    if !live.contains_key(&inner) {
                        let e = pool.release(inner).unwrap_err();
                        assert_eq!(e.status, rm_status::RM_ERROR_INVALID_POINTER);
                    }
                }
            }
            24 | 25 => drop(sim.enqueue_work(device, stream)),
            26 | 27 => drop(sim.complete_work(device, stream)),
            28 => drop(
                pool.free_reusable((arg & 1 == 0).then_some(device))
                    .unwrap(),
            ),
            29 => {
                if let Err(e) = pool.warmup(device, size(arg)) {
                    assert_eq!(e.status, rm_status::RM_ERROR_OUT_OF_MEMORY, "{e}");
                }
            }
            30 => {
                let limit = (arg & 1 == 0).then_some(u64::from(arg) * 16 * MIB);
                pool.set_memory_limit(Some(device), limit).unwrap();
            }
            _ => {
                let (free, total) = pool.mem_get_info(device).unwrap();
                assert!(free <= total);
            }
        }
        pool.check().unwrap();
        for d in 0..2 {
            let s = pool.stats(d).unwrap();
            assert_eq!(s.reserved_bytes, sim.used_bytes(d));
            assert_eq!(s.allocated_bytes + s.reusable_bytes, s.reserved_bytes);
        }
    }
    for (ptr, _) in std::mem::take(&mut live) {
        pool.release(ptr).unwrap();
    }
    pool.free_reusable(None).unwrap();
    assert_eq!(sim.used_bytes(0) + sim.used_bytes(1), 0);
    for d in 0..2 {
        sim.synchronize(d).unwrap();
    }
});
