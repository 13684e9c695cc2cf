//! The shipped traces, replayed under PyTorch's policy and resmem's (classic segments, and
//! stitching where it differs): exact memory figures (they are
//! deterministic), and the PyTorch snapshot reader on a fixture made by
//! `traces/fixtures/make_snapshot.py`.

use std::path::PathBuf;

use resmem_cli::model::QWEN3_4B;
use resmem_cli::replay::{replay, Outcome, Policy};
use resmem_cli::trace::{Event, Trace};
use resmem_cli::{demo, generate, seed};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces")
}

fn both(trace: &Trace) -> (Outcome, Outcome) {
    let memory = trace.device_memory.unwrap();
    (
        replay(trace, Policy::ResmemClassic, memory, |_| {}).unwrap(),
        replay(trace, Policy::Torch, memory, |_| {}).unwrap(),
    )
}

/// (peak allocated, peak reserved, driver allocations, driver frees, out-of-memory events);
/// and the layout at the peak accounts for every byte reserved then.
fn figures(o: &Outcome) -> (u64, u64, u64, u64, u64) {
    let s = &o.stats;
    assert_eq!(o.peak_layout.total(), s.peak_reserved_bytes);
    (
        s.peak_allocated_bytes,
        s.peak_reserved_bytes,
        s.driver_allocs,
        s.driver_frees,
        o.ooms,
    )
}

#[test]
fn shipped_traces_are_what_the_generator_writes() {
    for kind in generate::KINDS {
        let mut expected = Vec::new();
        generate::by_name(kind)
            .unwrap()
            .write_json_lines(&mut expected)
            .unwrap();
        let path = traces_dir().join(format!("{kind}.jsonl"));
        let shipped = std::fs::read(&path).unwrap();
        assert!(
            shipped == expected,
            "{} is stale: run `cargo run -p resmem-cli -- gen-trace --all traces`",
            path.display()
        );
        let read = Trace::read(&path, None).unwrap();
        assert_eq!(read.name, kind);
        assert_eq!(read.events, generate::by_name(kind).unwrap().events);
    }
}

#[test]
fn transformers_37436_fails_under_torch_and_succeeds_under_resmem() {
    let trace = Trace::read(&traces_dir().join("transformers-37436.jsonl"), None).unwrap();
    assert_eq!(trace.device_memory, Some(1676 * MIB));
    let (resmem, torch) = both(&trace);
    // PyTorch: 940 MiB reserved in 47 segments of 20 MiB, 748 MiB of it cached but in split
    // segments it cannot return; 736 MiB free on the driver; the 784 MiB request fails.
    assert_eq!(figures(&torch), (940 * MIB, 940 * MIB, 47, 0, 1));
    let message = torch.first_oom.clone().unwrap();
    assert!(message.contains("784.00 MiB"), "{message}");
    assert!(
        message.contains("of which 736.00 MiB (771751936 bytes) is free"),
        "{message}"
    );
    assert!(
        message.contains("748.00 MiB (784334848 bytes) is reserved but unallocated"),
        "{message}"
    );
    // resmem's classic segments are PyTorch's: the same 20 MiB segments, the same failure.
    assert_eq!(figures(&resmem), figures(&torch));
    // resmem's default maps the cached pages again (64 pieces at most) and creates only the
    // shortfall: the request is met, 1032 MiB reserved at the peak.
    let default = replay(&trace, Policy::Resmem, 1676 * MIB, |_| {}).unwrap();
    assert_eq!(figures(&default), (976 * MIB, 1032 * MIB, 46, 0, 0));
    assert_eq!(default.first_oom, None);
}

/// Issue 9's criteria for the default against PyTorch's policy, on every shipped trace (the
/// smallest device is `scripts/policy-check.py`'s, with the real snapshots): peak reserved at
/// most PyTorch's + 0.5% (where PyTorch's run completes), no more out-of-memory events, no more
/// memory-creating calls, and at most half of PyTorch's fragmentation where that exceeds 5%.
/// interleaved-lifetimes misses the last, by the figures its own test pins.
#[test]
fn the_default_meets_the_policy_criteria_on_every_shipped_trace() {
    for kind in generate::KINDS {
        let trace = generate::by_name(kind).unwrap();
        let memory = trace.device_memory.unwrap();
        let torch = replay(&trace, Policy::Torch, memory, |_| {}).unwrap();
        let default = replay(&trace, Policy::Resmem, memory, |_| {}).unwrap();
        let (t, d) = (&torch.stats, &default.stats);
        assert!(default.ooms <= torch.ooms, "{kind}: out-of-memory events");
        if torch.ooms == 0 {
            assert!(
                d.peak_reserved_bytes as f64 <= 1.005 * t.peak_reserved_bytes as f64,
                "{kind}: peak {} against {}",
                d.peak_reserved_bytes,
                t.peak_reserved_bytes
            );
        }
        assert!(
            default.creating_calls() <= torch.creating_calls(),
            "{kind}: {} creating calls against {}",
            default.creating_calls(),
            torch.creating_calls()
        );
        if torch.fragmentation() > 0.05 {
            assert!(
                default.fragmentation() <= torch.fragmentation() / 2.0,
                "{kind}: fragmentation {} against {}",
                default.fragmentation(),
                torch.fragmentation()
            );
        }
    }
}

/// Classic segments are PyTorch's policy: on every shipped trace, the same reserved memory
/// after every event, and the same driver allocations, frees and failures. (Allocated memory
/// differs by the rests of at most 1 MiB that a large block takes with it: PyTorch counts them
/// allocated, resmem reusable.)
#[test]
fn classic_segments_replay_every_shipped_trace_as_pytorchs_policy() {
    for kind in generate::KINDS {
        let trace = generate::by_name(kind).unwrap();
        let (resmem, torch) = both(&trace);
        let (_, peak, allocs, frees, ooms) = figures(&resmem);
        assert_eq!((peak, allocs, frees, ooms), {
            let t = figures(&torch);
            (t.1, t.2, t.3, t.4)
        });
        let reserved = |o: &Outcome| o.timeline.iter().map(|&(_, r)| r).collect::<Vec<u64>>();
        assert!(
            reserved(&resmem) == reserved(&torch),
            "{kind}: reserved memory differs"
        );
        for (r, t) in resmem.timeline.iter().zip(&torch.timeline) {
            assert!(r.0 <= t.0, "{kind}: more allocated than PyTorch's policy");
        }
    }
}

/// Interleaved lifetimes on 4 GiB: at the last 256 MiB buffer PyTorch runs out of memory,
/// empties its cache and grows again; the default, with room left on the driver, keeps its
/// cache, having built ranges of the free pieces between live blocks, each starting where it
/// can in the free tail of a page beside a live block, in 39 memory-creating calls against
/// PyTorch's 50, and reserves 142 MiB less at the peak (fragmentation 3.30% against 6.72%).
/// At the peak, the default's cache is 83 MiB of free bytes in pages beside live blocks or
/// shared with a range that starts in one (PyTorch's 63, its 20 MiB segments packing the
/// long-lived blocks; the default's 155 MiB before ranges started in such tails, 93 MiB before
/// blocks went to the back of a free block where that leaves more whole pages), no whole free
/// page (the buffers' growth made headroom until two creations in a row found it unused: 124
/// MiB of it was left before) and 15 MiB of idle ranges (the start of a page whose tail a live
/// range uses), where PyTorch's is mostly whole free pages its segments cannot give to a
/// 256 MiB buffer (150 MiB). Exact figures, so that a change shows.
#[test]
fn interleaved_lifetimes_figures() {
    let trace = Trace::read(&traces_dir().join("interleaved-lifetimes.jsonl"), None).unwrap();
    let memory = trace.device_memory.unwrap();
    assert_eq!(memory, 4 * GIB);
    let peak = |policy| {
        let o = replay(&trace, policy, memory, |_| {}).unwrap();
        assert_eq!(o.ooms, 0, "{}", policy.name());
        let l = o.peak_layout;
        assert_eq!(l.total(), o.stats.peak_reserved_bytes, "{}", policy.name());
        (
            o.stats.peak_reserved_bytes,
            l.requested,
            l.rounding,
            l.beside_live,
            l.free_pages,
            l.idle,
        )
    };
    let torch = (
        4_146_069_504,
        3_867_430_912,
        55_584_256,
        65_767_936,
        157_286_400,
        0,
    );
    assert_eq!(peak(Policy::Torch), torch);
    assert_eq!(peak(Policy::ResmemClassic), torch);
    assert_eq!(
        peak(Policy::Resmem),
        (
            3_999_268_864,
            3_867_430_912,
            29_693_952,
            86_635_008,
            0,
            15_508_992
        )
    );
    // Behind the front caches (what the C library's callers get): a reserve over 1 MiB the
    // thread's cache cannot serve first gives back its blocks over 1 MiB on that stream, so
    // the pool places it among them. Blocks waiting for their size in the cache meanwhile make
    // other placements, so the peak differs (here 0.2% higher) and its bytes lie elsewhere.
    assert_eq!(
        peak(Policy::ResmemFront),
        (
            4_007_657_472,
            3_867_430_912,
            29_853_696,
            96_049_152,
            0,
            14_323_712
        )
    );
}

#[test]
fn the_seed_loads_keep_reserved_at_the_model_size_under_both() {
    let trace = Trace::read(&traces_dir().join("qwen3-4b-loads.jsonl"), None).unwrap();
    let (resmem, torch) = both(&trace);
    let model = QWEN3_4B.parameter_count() * 2;
    for o in [&resmem, &torch] {
        assert_eq!(figures(o), (8_044_954_624, 8_048_869_376, 2, 0, 0));
        assert!(o.stats.peak_reserved_bytes as f64 <= 1.02 * model as f64);
    }
}

/// Models swapped in one process, each warm-up larger than the cache the loads before it
/// left: PyTorch's policy creates each whole beside that cache (33.6 GB at its peak for a
/// 16 GB model); the default takes the cache first, also where it covers under half of the
/// warm-up (Qwen3-0.6B's, then Llama-3-8B's).
#[test]
fn model_swap_figures() {
    let trace = generate::by_name("model-swap").unwrap();
    let (classic, torch) = both(&trace);
    assert_eq!(figures(&torch), (16_268_271_616, 33_629_929_472, 4, 0, 0));
    assert_eq!(figures(&classic).1, 33_629_929_472);
    let default = replay(&trace, Policy::Resmem, trace.device_memory.unwrap(), |_| {}).unwrap();
    assert_eq!(figures(&default), (16_266_436_608, 16_609_443_840, 3, 0, 0));
    assert!(default.fragmentation() < 0.05);
}

#[test]
fn decoding_and_training_figures() {
    let default = |trace: &Trace| {
        replay(trace, Policy::Resmem, trace.device_memory.unwrap(), |_| {}).unwrap()
    };
    let decode = generate::by_name("llama-3-8b-decode").unwrap();
    let (resmem, torch) = both(&decode);
    assert_eq!(figures(&resmem), figures(&torch));
    assert_eq!(figures(&torch), (17_016_823_808, 17_263_755_264, 54, 0, 0));
    // 0.7% below PyTorch's peak in 17 memory-creating calls against 54.
    assert_eq!(
        figures(&default(&decode)),
        (17_016_823_808, 17_140_023_296, 17, 0, 0)
    );
    let training = generate::by_name("qwen3-0.6b-training").unwrap();
    let (resmem, torch) = both(&training);
    assert_eq!(figures(&resmem), figures(&torch));
    assert_eq!(figures(&torch), (15_426_009_600, 16_015_949_824, 277, 0, 0));
    let default = default(&training);
    assert_eq!(
        figures(&default),
        (15_426_009_600, 15_690_891_264, 183, 0, 0)
    );
    // 2.0% below PyTorch's peak in 66% of its memory-creating calls; the fragmentation 1.7%
    // against 3.7% (the growth's headroom at most sixteen times what each request lacks).
    assert!(default.fragmentation() < 0.5 * torch.fragmentation());
}

#[test]
fn pytorch_snapshots_are_read_with_the_reserved_peak_pytorch_recorded() {
    let path = traces_dir().join("fixtures/snapshot_small.pickle");
    let trace = Trace::read(&path, None).unwrap();
    assert_eq!(trace.name, "snapshot_small");
    assert_eq!(trace.torch_peak_reserved, Some(86 * MIB));
    // The 512-byte block X predates the recording: it is allocated first, and its free in the
    // trace is matched.
    assert_eq!((trace.restored_blocks, trace.unmatched_frees), (1, 0));
    let alloc = |id, size| Event::Alloc {
        id,
        size,
        stream: 0,
    };
    assert_eq!(
        trace.events,
        vec![
            Event::Mark {
                label: "blocks live before recording began (1)".into()
            },
            alloc(1, 512),
            alloc(2, 8 * MIB),
            alloc(3, 8 * MIB),
            Event::Free { id: 2 },
            Event::Free { id: 1 },
            alloc(4, 64 * MIB),
            Event::Free { id: 3 },
            Event::Free { id: 4 },
            // S2's return: the program's torch.cuda.empty_cache(), by its recorded stack.
            Event::EmptyCache,
        ]
    );
    assert_eq!(trace.empty_caches, 1);
    let torch = replay(&trace, Policy::Torch, GIB, |_| {}).unwrap();
    // The replayed policy reserves what PyTorch recorded: the 2 MiB small-pool segment of X,
    // 20 MiB for a and b, 64 MiB for c; the empty_cache at the end returns all three, idle by
    // then.
    assert_eq!(figures(&torch), (72 * MIB, 86 * MIB, 3, 3, 0));
    let err = Trace::read(&path, Some(1)).unwrap_err();
    assert!(
        err.ends_with(
            "the snapshot holds no segments and no allocation events on device 1; device(s) 0 \
             have them: pass --device 0"
        ),
        "{err}"
    );
}

fn sim(memory: u64) -> std::sync::Arc<dyn resmem::Driver> {
    let sim = Box::leak(Box::new(cuda_sim::Sim::new(&[memory])));
    std::sync::Arc::new(resmem::driver::sim::SimDriver::new(sim).unwrap())
}

#[test]
fn the_seed_through_pytorchs_calls() {
    let warmup = seed::warmup_bytes(&QWEN3_4B, QWEN3_4B.parameters().len());
    assert_eq!(warmup, 8_822_848_512); // 8.22 GiB
    let torch = demo::run(&*Policy::Torch.build(sim(24 * GIB)), &QWEN3_4B, 4).unwrap();
    // The warm-up's segment (8.22 GiB rounded to 2 MiB) and the small pool's 2 MiB; the next
    // warm-up does not fit beside the survivor, so a second one: 16.44 GiB.
    let one = 8_824_815_616;
    let reserved: Vec<u64> = torch.loads.iter().map(|l| l.reserved).collect();
    assert_eq!(
        reserved,
        [
            one + 2 * MIB,
            2 * one + 2 * MIB,
            2 * one + 2 * MIB,
            2 * one + 2 * MIB
        ]
    );
    assert_eq!(torch.stats.peak_reserved_bytes, 2 * one + 2 * MIB);
    assert_eq!(
        format!("{:.2}", torch.stats.peak_reserved_bytes as f64 / GIB as f64),
        "16.44"
    );
    // PyTorch's view counts the cache as used: 7.56 GiB free at load 3, less the room for the
    // largest layer, is short of the 7.49 GiB model.
    let free: Vec<u64> = torch.loads.iter().map(|l| l.reported_free).collect();
    assert_eq!(
        free,
        [
            24 * GIB,
            24 * GIB - one - 2 * MIB,
            24 * GIB - 2 * one - 2 * MIB,
            24 * GIB - 2 * one - 2 * MIB
        ]
    );
    assert_eq!(torch.offloaded_loads(), vec![3, 4]);
    let survivors: Vec<u64> = torch.loads.iter().map(|l| l.allocated).collect();
    assert_eq!(survivors, [1, 2, 3, 4].map(|n| n * seed::SURVIVOR));
    // resmem's default, fed the same calls, counts its cache as free: nothing is offloaded.
    let resmem = demo::run(&*Policy::Resmem.build(sim(24 * GIB)), &QWEN3_4B, 4).unwrap();
    assert_eq!(resmem.offloaded_loads(), Vec::<usize>::new());
    // ... and reuses the cached pages for each warm-up: it stays within 2% of one warm-up.
    let peak = resmem.stats.peak_reserved_bytes;
    assert!(peak as f64 <= 1.02 * one as f64, "{peak}");
    assert_eq!(peak, 8_908_701_696);
    // The shipped trace is the same calls with nothing offloaded: PyTorch's policy reaches the
    // same 16.44 GiB.
    let trace = Trace::read(&traces_dir().join("qwen3-4b-seed.jsonl"), None).unwrap();
    let replayed = replay(&trace, Policy::Torch, 24 * GIB, |_| {}).unwrap();
    assert_eq!(replayed.stats.peak_reserved_bytes, 2 * one + 2 * MIB);
    assert_eq!(replayed.ooms, 0);
    let replayed = replay(&trace, Policy::Resmem, 24 * GIB, |_| {}).unwrap();
    let peak = replayed.stats.peak_reserved_bytes;
    assert!(peak as f64 <= 1.02 * one as f64, "{peak}");
    assert_eq!(replayed.ooms, 0);
}

/// A pool that only grows, by requests PyTorch's policy fits exactly (200 tensors of 48 MiB,
/// never freed), ends with the headroom of its last growth unused: 0.13% over PyTorch's peak,
/// in 181 memory-creating calls against 200 (the figures `src/pool/device/headroom.rs` gives).
/// Headroom of less than a tensor serves none; once two creations in a row find it so, the
/// next makes none, and the pool grows by exactly what the tensors need until a headroom holds
/// one (0.75% over in 144 calls while every creation made headroom).
#[test]
fn a_pool_that_only_grows_ends_with_its_last_headroom_unused() {
    let mut lines = String::from("{\"op\":\"meta\",\"name\":\"growth\"}\n");
    for id in 1..=200 {
        lines += &format!("{{\"op\":\"alloc\",\"id\":{id},\"size\":{}}}\n", 48 * MIB);
    }
    let trace = Trace::from_json_lines(lines.as_bytes()).unwrap();
    let torch = replay(&trace, Policy::Torch, 80 * GIB, |_| {}).unwrap();
    let default = replay(&trace, Policy::Resmem, 80 * GIB, |_| {}).unwrap();
    assert_eq!(figures(&torch), (200 * 48 * MIB, 200 * 48 * MIB, 200, 0, 0));
    assert_eq!(
        figures(&default),
        (200 * 48 * MIB, 10_078_912_512, 181, 0, 0)
    );
}
