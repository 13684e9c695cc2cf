//! PyTorch memory snapshots (`torch.cuda.memory._snapshot()`, pickled by
//! `torch.cuda.memory._dump_snapshot`) read as a [`Trace`].
//!
//! A snapshot holds the allocator's end state (`segments`, with their blocks) and, when
//! `torch.cuda.memory._record_memory_history()` ran, the events of each device
//! (`device_traces`). Recording usually starts after some blocks were already allocated (the
//! model's weights, say): those blocks are in the end state or freed during the trace, but their
//! `alloc` is not among the events. Replaying only the events would leave them out, so the
//! reader walks the events backwards from the end state to find what was live at the first
//! event, and allocates those blocks first, in address order.
//!
//! The program's `torch.cuda.empty_cache()` calls are replayed as [`Event::EmptyCache`] where
//! they were made, found by the call stack PyTorch recorded with the segments they returned.
//!
//! `segment_alloc` / `segment_free` (and `segment_map` / `segment_unmap`) events, with the end
//! state's segments, give the reserved memory PyTorch itself had: its peak is
//! [`Trace::torch_peak_reserved`].

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::pickle::{self, Obj, Scalar};

use crate::baseline::torch::POWER2_INTERVALS;
use crate::baseline::{TorchConfig, TorchSettings};
use crate::trace::{Event, Trace};
use crate::units::gib_or_mib;

/// The snapshot's `allocator_settings`, where it has them.
fn settings(root: Obj<'_>) -> Option<TorchSettings> {
    let s = root.get("allocator_settings").and_then(dict)?;
    let mut config = TorchConfig {
        max_split_size: s
            .get("max_split_size")
            .and_then(Obj::int)
            .filter(|&m| m > 0)
            .and_then(|m| u64::try_from(m).ok()),
        ..TorchConfig::default()
    };
    // Keyed by each interval's start in MiB: "1", "2", "4", ... "32768".
    for (key, value) in s
        .get("roundup_power2_divisions")
        .and_then(Obj::items)
        .into_iter()
        .flatten()
    {
        let Some(key) = key.text() else {
            continue;
        };
        let (Ok(start), Some(divisions)) = (key.parse::<u64>(), value.int()) else {
            continue;
        };
        let interval = start.checked_ilog2().map(|i| i as usize);
        if let (Some(i), Ok(d)) = (interval, u64::try_from(divisions)) {
            if i < POWER2_INTERVALS && start.is_power_of_two() {
                config.roundup_power2_divisions[i] = d;
            }
        }
    }
    config.expandable_segments =
        s.get("expandable_segments").and_then(Obj::scalar) == Some(&Scalar::Bool(true));
    let conf = s
        .get("PYTORCH_CUDA_ALLOC_CONF")
        .and_then(Obj::text)
        .unwrap_or("")
        .to_string();
    // `max_non_split_rounding_mb` has no key of its own: read from the setting's text, as
    // PyTorch read it (a text PyTorch would have refused changes nothing).
    config.max_non_split_rounding = crate::baseline::conf::parse(&conf)
        .ok()
        .and_then(|parsed| parsed.config.max_non_split_rounding);
    Some(TorchSettings {
        conf,
        config,
        garbage_collection: matches!(
            s.get("garbage_collection_threshold").and_then(Obj::scalar),
            Some(Scalar::Float(t)) if *t > 0.0
        ),
    })
}

/// A block as the snapshot knows it: its requested bytes and raw stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    size: u64,
    stream: i128,
}

/// Read a pickled snapshot, taking device `device`'s trace; without one, device 0's, or where
/// device 0 has neither segments nor allocation events, the first device that has (a run on
/// `cuda:1` alone, say). A device with nothing to replay is refused, never replayed as zeros.
pub fn read(bytes: &[u8], device: Option<usize>) -> Result<Trace, String> {
    let root = pickle::read(bytes).map_err(|e| format!("not a readable pickle: {e}"))?;
    let root = dict(root.root()).ok_or("the pickle is not a memory snapshot (a dict)")?;
    let all_segments: Vec<Obj<'_>> = root
        .get("segments")
        .and_then(Obj::list)
        .map(|segs| segs.into_iter().filter_map(dict).collect())
        .unwrap_or_default();
    let traces = root.get("device_traces").and_then(Obj::list);
    let device = pick_device(
        device,
        &used_devices(&all_segments, traces.as_deref()),
        "the snapshot holds no segments and no allocation events",
    )?;
    let segments: Vec<Obj<'_>> = all_segments
        .into_iter()
        .filter(|&s| s.get("device").and_then(Obj::int) == Some(device as i128))
        .collect();
    let end_reserved: i128 = segments
        .iter()
        .filter_map(|&s| s.get("total_size").and_then(Obj::int))
        .sum();
    let no_trace = || {
        format!(
            "the snapshot holds {} segment(s) ({}) on device {device} but no allocation \
             events to replay: call torch.cuda.memory._record_memory_history() before the \
             workload and dump the snapshot after it",
            segments.len(),
            gib_or_mib(u64::try_from(end_reserved).unwrap_or(0))
        )
    };
    let traces = match traces {
        Some(traces) => traces,
        None if !segments.is_empty() => return Err(no_trace()),
        None => {
            return Err("the snapshot has no device_traces: record it with \
                            torch.cuda.memory._record_memory_history() first"
                .into())
        }
    };
    let events: Vec<Obj<'_>> = match traces.get(device).and_then(|t| t.list()) {
        Some(events) => events.into_iter().filter_map(dict).collect(),
        None if !segments.is_empty() => return Err(no_trace()),
        None => {
            return Err(format!(
                "the snapshot has traces for {} device(s); device {device} is not among them",
                traces.len()
            ))
        }
    };
    let has_alloc = events.iter().any(|&e| action(e) == "alloc");
    if !has_alloc {
        return Err(if segments.is_empty() {
            format!(
                "the snapshot holds no segments and no allocation events on device {device}: \
                 nothing to replay"
            )
        } else {
            no_trace()
        });
    }
    let mut trace = Trace {
        device,
        torch_settings: settings(root),
        description: format!("PyTorch memory snapshot, device {device}"),
        ..Trace::default()
    };
    let mut streams = Streams::default();
    let mut ids: HashMap<i128, u64> = HashMap::new();
    let mut next_id = 0u64;
    let before = live_before_recording(&segments, &events)?;
    if !before.is_empty() {
        trace.events.push(Event::Mark {
            label: format!("blocks live before recording began ({})", before.len()),
        });
    }
    for (addr, block) in before {
        next_id += 1;
        ids.insert(addr, next_id);
        trace.events.push(Event::Alloc {
            id: next_id,
            size: block.size,
            stream: streams.number(block.stream),
        });
        trace.restored_blocks += 1;
    }
    let (mut reserved, mut peak, mut net) = (0i128, 0i128, 0i128);
    // Whether the last event was a segment returned by `torch.cuda.empty_cache()`.
    let mut emptying = false;
    for &event in &events {
        let addr = event.get("addr").and_then(Obj::int).unwrap_or(0);
        let size = event.get("size").and_then(Obj::int).unwrap_or(0);
        match action(event) {
            "alloc" => {
                let raw = event.get("stream").and_then(Obj::int).unwrap_or(0);
                next_id += 1;
                ids.insert(addr, next_id);
                trace.events.push(Event::Alloc {
                    id: next_id,
                    size: u64::try_from(size).map_err(|_| "an alloc of a negative size")?,
                    stream: streams.number(raw),
                });
            }
            "free_completed" => match ids.remove(&addr) {
                Some(id) => trace.events.push(Event::Free { id }),
                None => trace.unmatched_frees += 1,
            },
            "segment_alloc" | "segment_map" => {
                reserved += size;
                net += size;
                peak = peak.max(reserved);
            }
            "segment_free" | "segment_unmap" => {
                reserved -= size;
                net -= size;
                // One `torch.cuda.empty_cache()` returns every idle segment: a run of these
                // events. Only its first is the call; PyTorch's own releases (before growing,
                // on out-of-memory) are its policy's, which the replay decides for itself.
                let asked = from_empty_cache(event);
                if asked && !emptying {
                    trace.events.push(Event::EmptyCache);
                    trace.empty_caches += 1;
                }
                emptying = asked;
                continue;
            }
            _ => {}
        }
        emptying = false;
    }
    // What was reserved before the trace began shifts every point by the same amount.
    let start = (end_reserved - net).max(0);
    trace.torch_peak_reserved = Some(u64::try_from(start + peak.max(0)).unwrap_or(0));
    Ok(trace)
}

/// Whether a segment's return was the program's `torch.cuda.empty_cache()`, by the call
/// stack PyTorch recorded with it: the C++ frame `NativeCachingAllocator::emptyCache()` (or
/// `THCPModule_emptyCache`), or with Python frames only, `empty_cache` in `torch/cuda/memory.py`.
/// A snapshot recorded without stacks cannot tell it from PyTorch's own releases: none is
/// taken for one.
fn from_empty_cache(event: Obj<'_>) -> bool {
    event
        .get("frames")
        .and_then(Obj::list)
        .into_iter()
        .flatten()
        .filter_map(dict)
        .any(|frame| {
            let name = frame.get("name").and_then(Obj::text).unwrap_or("");
            let file = frame.get("filename").and_then(Obj::text).unwrap_or("");
            name.contains("emptyCache")
                || (name == "empty_cache" && file.replace('\\', "/").ends_with("cuda/memory.py"))
        })
}

/// The devices with a segment in the end state or an `alloc` among their events.
fn used_devices(segments: &[Obj<'_>], traces: Option<&[Obj<'_>]>) -> BTreeSet<usize> {
    let mut used: BTreeSet<usize> = segments
        .iter()
        .filter_map(|&s| s.get("device").and_then(Obj::int))
        .filter_map(|d| usize::try_from(d).ok())
        .collect();
    for (d, events) in traces.into_iter().flatten().enumerate() {
        let allocates = events
            .list()
            .into_iter()
            .flatten()
            .filter_map(dict)
            .any(|e| action(e) == "alloc");
        if allocates {
            used.insert(d);
        }
    }
    used
}

/// The device to replay, of those with something to replay (`used`): the one asked for where
/// it is among them or none is; without one, 0, or where 0 is not among them the first. A
/// device asked for with nothing, where another has something, is refused naming those.
/// `lacks` says what the refused device lacks ("the trace holds no allocations").
pub(crate) fn pick_device(
    asked: Option<usize>,
    used: &BTreeSet<usize>,
    lacks: &str,
) -> Result<usize, String> {
    match (asked, used.first()) {
        (Some(d), _) if used.is_empty() || used.contains(&d) => Ok(d),
        (Some(d), first) => Err(format!(
            "{lacks} on device {d}; device(s) {} have them: pass --device {}",
            used.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            first.copied().unwrap_or(0)
        )),
        (None, Some(&first)) if !used.contains(&0) => Ok(first),
        (None, _) => Ok(0),
    }
}

/// The blocks live at the first event, by address: the end state's live blocks, walked back
/// through the events (an `alloc` was not live before it, a `free_completed` was).
fn live_before_recording(
    segments: &[Obj<'_>],
    events: &[Obj<'_>],
) -> Result<BTreeMap<i128, Block>, String> {
    let mut live = BTreeMap::new();
    for &segment in segments {
        let stream = segment.get("stream").and_then(Obj::int).unwrap_or(0);
        for block in segment
            .get("blocks")
            .and_then(Obj::list)
            .into_iter()
            .flatten()
        {
            let Some(block) = dict(block) else { continue };
            let state = block.get("state").and_then(Obj::text).unwrap_or("");
            if !state.starts_with("active") {
                continue;
            }
            let addr = block
                .get("address")
                .and_then(Obj::int)
                .ok_or("a live block of the snapshot's segments has no address")?;
            // `requested_size` is what the caller asked for (0 in old snapshots: take `size`).
            let size = match block.get("requested_size").and_then(Obj::int) {
                Some(r) if r > 0 => r,
                _ => block.get("size").and_then(Obj::int).unwrap_or(0),
            };
            let size = u64::try_from(size).map_err(|_| "a live block of a negative size")?;
            live.insert(addr, Block { size, stream });
        }
    }
    for &event in events.iter().rev() {
        let addr = event.get("addr").and_then(Obj::int).unwrap_or(0);
        match action(event) {
            "alloc" => {
                live.remove(&addr);
            }
            "free_completed" => {
                let size = event.get("size").and_then(Obj::int).unwrap_or(0);
                let size = u64::try_from(size).map_err(|_| "a free of a negative size")?;
                let stream = event.get("stream").and_then(Obj::int).unwrap_or(0);
                live.insert(addr, Block { size, stream });
            }
            _ => {}
        }
    }
    Ok(live)
}

/// Raw CUDA stream handles numbered as traces number them: 0 stays 0, others 1, 2, ... in order
/// of first use.
#[derive(Default)]
struct Streams(HashMap<i128, u64>);

impl Streams {
    fn number(&mut self, raw: i128) -> u64 {
        if raw == 0 {
            return 0;
        }
        let next = self.0.len() as u64 + 1;
        *self.0.entry(raw).or_insert(next)
    }
}

fn action(event: Obj<'_>) -> &str {
    event.get("action").and_then(Obj::text).unwrap_or("")
}

/// `v` where it is a dict.
fn dict(v: Obj<'_>) -> Option<Obj<'_>> {
    v.is_dict().then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    // Test snapshots are written with serde-pickle's writer.
    use serde_pickle::{HashableValue, Value};

    const MIB: i64 = 1 << 20;

    fn map(pairs: Vec<(&str, Value)>) -> Value {
        Value::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| (HashableValue::String(k.into()), v))
                .collect(),
        )
    }

    fn event(action: &str, addr: i64, size: i64, stream: i64) -> Value {
        map(vec![
            ("action", Value::String(action.into())),
            ("addr", Value::I64(addr)),
            ("size", Value::I64(size)),
            ("stream", Value::I64(stream)),
        ])
    }

    fn block(addr: i64, size: i64, requested: i64, state: &str) -> Value {
        map(vec![
            ("address", Value::I64(addr)),
            ("size", Value::I64(size)),
            ("requested_size", Value::I64(requested)),
            ("state", Value::String(state.into())),
        ])
    }

    fn segment(addr: i64, size: i64, stream: i64, blocks: Vec<Value>) -> Value {
        segment_on(0, addr, size, stream, blocks)
    }

    fn segment_on(device: i64, addr: i64, size: i64, stream: i64, blocks: Vec<Value>) -> Value {
        map(vec![
            ("device", Value::I64(device)),
            ("address", Value::I64(addr)),
            ("total_size", Value::I64(size)),
            ("stream", Value::I64(stream)),
            ("blocks", Value::List(blocks)),
        ])
    }

    fn pickle(segments: Vec<Value>, traces: Option<Vec<Vec<Value>>>) -> Vec<u8> {
        let mut root = vec![("segments", Value::List(segments))];
        if let Some(traces) = traces {
            let traces = traces.into_iter().map(Value::List).collect();
            root.push(("device_traces", Value::List(traces)));
        }
        serde_pickle::value_to_vec(&map(root), serde_pickle::SerOptions::new()).unwrap()
    }

    #[test]
    fn blocks_live_before_recording_are_allocated_first() {
        // Segment A (20 MiB, stream 7) holds W (6 MiB asked, 6 MiB block), live throughout,
        // and V (3 MiB), live before recording and freed during it. Segment B (64 MiB, recorded)
        // holds the traced block T, still live at the end.
        let (a, b) = (0x7000_0000_0000, 0x7000_0200_0000);
        let segments = vec![
            segment(
                a,
                20 * MIB,
                7,
                vec![
                    block(a, 6 * MIB, 6 * MIB, "active_allocated"),
                    block(a + 6 * MIB, 14 * MIB, 0, "inactive"),
                ],
            ),
            segment(
                b,
                64 * MIB,
                0,
                vec![block(b, 64 * MIB, 50 * MIB, "active_allocated")],
            ),
        ];
        let events = vec![
            event("free_requested", a + 6 * MIB, 3 * MIB, 7),
            event("free_completed", a + 6 * MIB, 3 * MIB, 7),
            event("segment_alloc", b, 64 * MIB, 0),
            event("alloc", b, 50 * MIB, 0),
        ];
        let trace = read(&pickle(segments, Some(vec![events])), Some(0)).unwrap();
        let (w, v, t) = (6 << 20, 3 << 20, 50 << 20);
        assert_eq!(
            trace.events,
            vec![
                Event::Mark {
                    label: "blocks live before recording began (2)".into()
                },
                Event::Alloc {
                    id: 1,
                    size: w,
                    stream: 1
                },
                Event::Alloc {
                    id: 2,
                    size: v,
                    stream: 1
                },
                Event::Free { id: 2 },
                Event::Alloc {
                    id: 3,
                    size: t,
                    stream: 0
                },
            ]
        );
        assert_eq!((trace.restored_blocks, trace.unmatched_frees), (2, 0));
        // 20 MiB reserved before recording, 64 MiB more during it.
        assert_eq!(trace.torch_peak_reserved, Some(84 << 20));
    }

    #[test]
    fn a_snapshot_without_events_is_refused() {
        let segments = vec![segment(
            0x7000_0000_0000,
            20 * MIB,
            0,
            vec![block(
                0x7000_0000_0000,
                20 * MIB,
                20 * MIB,
                "active_allocated",
            )],
        )];
        let expected = "the snapshot holds 1 segment(s) (20.00 MiB) on device 0 but no \
                        allocation events to replay: call \
                        torch.cuda.memory._record_memory_history() before the workload and \
                        dump the snapshot after it";
        let no_key = read(&pickle(segments.clone(), None), Some(0)).unwrap_err();
        assert_eq!(no_key, expected);
        let empty = read(&pickle(segments.clone(), Some(vec![vec![]])), Some(0)).unwrap_err();
        assert_eq!(empty, expected);
        let no_device = read(&pickle(segments, Some(vec![])), Some(0)).unwrap_err();
        assert_eq!(no_device, expected);
        let nothing = read(&pickle(vec![], Some(vec![])), Some(0)).unwrap_err();
        assert_eq!(
            nothing,
            "the snapshot has traces for 0 device(s); device 0 is not among them"
        );
    }

    #[test]
    fn a_snapshot_of_another_device_alone_is_read_from_that_device() {
        // A run on cuda:1 only: device 0's trace is empty and it holds no segment.
        let a = 0x7000_0000_0000;
        let segments = vec![segment_on(1, a, 20 * MIB, 0, vec![])];
        let events = vec![
            event("segment_alloc", a, 20 * MIB, 0),
            event("alloc", a, 4 * MIB, 0),
            event("free_requested", a, 4 * MIB, 0),
            event("free_completed", a, 4 * MIB, 0),
        ];
        let bytes = pickle(segments, Some(vec![vec![], events]));
        let trace = read(&bytes, None).unwrap();
        assert_eq!(trace.device, 1);
        assert_eq!(trace.description, "PyTorch memory snapshot, device 1");
        assert_eq!(
            trace.events,
            vec![
                Event::Alloc {
                    id: 1,
                    size: 4 << 20,
                    stream: 0
                },
                Event::Free { id: 1 }
            ]
        );
        assert_eq!(trace.torch_peak_reserved, Some(20 << 20));
        assert_eq!(read(&bytes, Some(1)).unwrap(), trace);
        assert_eq!(
            read(&bytes, Some(0)).unwrap_err(),
            "the snapshot holds no segments and no allocation events on device 0; device(s) 1 \
             have them: pass --device 1"
        );
        // A device with events but nothing to replay anywhere: refused, not replayed as zeros.
        let idle = vec![event("segment_alloc", a, 2 * MIB, 0)];
        assert_eq!(
            read(&pickle(vec![], Some(vec![idle])), None).unwrap_err(),
            "the snapshot holds no segments and no allocation events on device 0: nothing to \
             replay"
        );
    }

    #[test]
    fn the_device_is_the_one_asked_for_else_0_else_the_first_with_something() {
        let used = |d: &[usize]| d.iter().copied().collect::<BTreeSet<usize>>();
        assert_eq!(pick_device(None, &used(&[]), "nothing"), Ok(0));
        assert_eq!(pick_device(None, &used(&[0, 2]), "nothing"), Ok(0));
        assert_eq!(pick_device(None, &used(&[2, 3]), "nothing"), Ok(2));
        assert_eq!(pick_device(Some(3), &used(&[2, 3]), "nothing"), Ok(3));
        assert_eq!(pick_device(Some(5), &used(&[]), "nothing"), Ok(5));
        assert_eq!(
            pick_device(Some(0), &used(&[2, 3]), "nothing").unwrap_err(),
            "nothing on device 0; device(s) 2, 3 have them: pass --device 2"
        );
    }

    /// `event` with a call stack of frames named `names`, in `file`.
    fn with_frames(event: Value, file: &str, names: &[&str]) -> Value {
        let Value::Dict(mut d) = event else {
            unreachable!()
        };
        let frames = names
            .iter()
            .map(|name| {
                map(vec![
                    ("name", Value::String((*name).into())),
                    ("filename", Value::String(file.into())),
                    ("line", Value::I64(0)),
                ])
            })
            .collect();
        d.insert(HashableValue::String("frames".into()), Value::List(frames));
        Value::Dict(d)
    }

    #[test]
    fn the_programs_empty_cache_calls_are_replayed_and_pytorchs_own_releases_are_not() {
        use crate::replay::{replay, Policy};
        let (a, b, c) = (0x7000_0000_0000, 0x7000_1000_0000, 0x7000_2000_0000);
        let cpp = "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()";
        let released_by = |addr, size, file: &str, names: &[&str]| {
            with_frames(event("segment_free", addr, size, 0), file, names)
        };
        let events = vec![
            event("segment_alloc", a, 30 * MIB, 0),
            event("alloc", a, 30 * MIB, 0),
            event("free_completed", a, 30 * MIB, 0),
            event("segment_alloc", b, 32 * MIB, 0),
            event("alloc", b, 32 * MIB, 0),
            event("free_completed", b, 32 * MIB, 0),
            // One call returns both idle segments: one event each, one call replayed.
            released_by(a, 30 * MIB, "", &["torch::unwind::unwind()", cpp]),
            released_by(b, 32 * MIB, "", &["torch::unwind::unwind()", cpp]),
            event("segment_alloc", c, 64 * MIB, 0),
            event("alloc", c, 64 * MIB, 0),
            event("free_completed", c, 64 * MIB, 0),
            // Recorded with Python frames only.
            released_by(
                c,
                64 * MIB,
                "/usr/lib/python3.12/site-packages/torch/cuda/memory.py",
                &["empty_cache", "main"],
            ),
            event("segment_alloc", a, 8 * MIB, 0),
            event("alloc", a, 8 * MIB, 0),
            // PyTorch's own release before growing: its policy's, not the program's.
            released_by(
                a,
                8 * MIB,
                "CUDACachingAllocator.cpp",
                &["release_cached_blocks", "malloc"],
            ),
            // No stack recorded: not taken for a call.
            event("segment_free", b, 2 * MIB, 0),
        ];
        let trace = read(&pickle(vec![], Some(vec![events])), None).unwrap();
        let alloc = |id, mib: u64| Event::Alloc {
            id,
            size: mib << 20,
            stream: 0,
        };
        assert_eq!(
            trace.events,
            vec![
                alloc(1, 30),
                Event::Free { id: 1 },
                alloc(2, 32),
                Event::Free { id: 2 },
                Event::EmptyCache,
                alloc(3, 64),
                Event::Free { id: 3 },
                Event::EmptyCache,
                alloc(4, 8),
            ]
        );
        assert_eq!(trace.empty_caches, 2);
        // PyTorch's policy returns the 30 and 32 MiB segments before the 64 MiB request, as
        // PyTorch did: 64 MiB at the peak. Without the call the 64 MiB segment would come
        // beside them: 126 MiB.
        let peak = |trace: &Trace| {
            replay(trace, Policy::Torch, 1 << 30, |_| {})
                .unwrap()
                .stats
                .peak_reserved_bytes
        };
        assert_eq!(peak(&trace), 64 << 20);
        let mut without = trace.clone();
        without.events.retain(|e| *e != Event::EmptyCache);
        assert_eq!(peak(&without), 126 << 20);
    }

    #[test]
    fn damaged_snapshots_are_refused_with_a_message_never_a_panic() {
        let whole: &[u8] = include_bytes!("../../traces/fixtures/snapshot_small.pickle");
        assert!(read(whole, None).is_ok());
        for end in 0..whole.len() {
            let err = read(&whole[..end], None).unwrap_err();
            assert!(err.starts_with("not a readable pickle: "), "{end}: {err}");
        }
        // Every byte changed to a few values: read or refused, never a panic.
        let mut bytes = whole.to_vec();
        for at in 0..whole.len() {
            for value in [0u8, 0x7f, 0x80, 0xff, whole[at] ^ 1] {
                bytes[at] = value;
                let _ = read(&bytes, None);
            }
            bytes[at] = whole[at];
        }
    }

    /// A snapshot of one 64 MiB block freed and a 30 MiB block asked for after it, with the
    /// allocator settings `settings`.
    fn split_or_not(settings: Option<Vec<(&str, Value)>>) -> Vec<u8> {
        let a = 0x7000_0000_0000;
        let events = vec![
            event("alloc", a, 64 * MIB, 0),
            event("free_completed", a, 64 * MIB, 0),
            event("alloc", a, 30 * MIB, 0),
        ];
        let mut root = vec![
            ("segments", Value::List(vec![])),
            ("device_traces", Value::List(vec![Value::List(events)])),
        ];
        if let Some(settings) = settings {
            root.push(("allocator_settings", map(settings)));
        }
        serde_pickle::value_to_vec(&map(root), serde_pickle::SerOptions::new()).unwrap()
    }

    #[test]
    fn the_allocator_settings_pytorch_ran_with_are_read_and_replayed() {
        use crate::replay::{replay, Policy};
        let roundup = map(vec![
            ("1", Value::I64(0)),
            ("2", Value::I64(4)),
            ("32768", Value::I64(2)),
        ]);
        let settings = vec![
            (
                "PYTORCH_CUDA_ALLOC_CONF",
                Value::String(
                    "max_split_size_mb:40,max_non_split_rounding_mb:30,expandable_segments:True"
                        .into(),
                ),
            ),
            ("max_split_size", Value::I64(40 * MIB)),
            ("garbage_collection_threshold", Value::F64(0.0)),
            ("expandable_segments", Value::Bool(true)),
            ("roundup_power2_divisions", roundup),
        ];
        let trace = read(&split_or_not(Some(settings)), None).unwrap();
        let mut divisions = [0; POWER2_INTERVALS];
        divisions[1] = 4;
        divisions[15] = 2;
        assert_eq!(
            trace.torch_settings,
            Some(TorchSettings {
                conf: "max_split_size_mb:40,max_non_split_rounding_mb:30,expandable_segments:True"
                    .into(),
                config: TorchConfig {
                    max_split_size: Some(40 << 20),
                    // Read from the recorded text: it has no key of its own.
                    max_non_split_rounding: Some(30 << 20),
                    roundup_power2_divisions: divisions,
                    expandable_segments: true,
                },
                garbage_collection: false,
            })
        );
        let peak = |trace: &Trace| {
            replay(trace, Policy::Torch, 1 << 30, |_| {})
                .unwrap()
                .stats
                .peak_reserved_bytes
        };
        // With expandable segments the 64 MiB block is four 20 MiB handles, and the 30 MiB
        // request takes the cached 80 MiB block in place (max_split_size does not stop the
        // search of expandable segments): 80 MiB.
        assert_eq!(peak(&trace), 80 << 20);
        // With max_split_size 40 MiB alone, the 30 MiB request does not split the cached
        // 64 MiB block: a segment of its own, 94 MiB reserved. PyTorch's defaults (-1:
        // unlimited; no settings recorded at all) split it: 64 MiB.
        let split = vec![("max_split_size", Value::I64(40 * MIB))];
        assert_eq!(
            peak(&read(&split_or_not(Some(split)), None).unwrap()),
            94 << 20
        );
        let unlimited = vec![("max_split_size", Value::I64(-1))];
        let default = read(&split_or_not(Some(unlimited)), None).unwrap();
        assert_eq!(
            default.torch_settings.as_ref().unwrap().config,
            TorchConfig::default()
        );
        assert_eq!(peak(&default), 64 << 20);
        let unrecorded = read(&split_or_not(None), None).unwrap();
        assert_eq!(unrecorded.torch_settings, None);
        assert_eq!(peak(&unrecorded), 64 << 20);
    }
}
