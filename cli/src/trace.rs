//! Allocation traces: what a program asked of its allocator, in order, independent of policy.
//!
//! Two sources (the format is documented in `traces/README.md`):
//! - JSON lines, one operation per line (`alloc`, `free`, `warmup`, `empty_cache`, `mark`, and
//!   a `meta` line naming the trace and its device);
//! - PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickled, as
//!   `torch.cuda.memory._dump_snapshot` writes them), read by [`crate::snapshot`]: the blocks
//!   live before recording began, then the `alloc` and `free_completed` events; `segment_alloc`
//!   / `segment_free` give the reserved memory PyTorch itself had, for comparison.

use std::io::{BufRead, Write};

use serde::Deserialize;

/// One operation of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Event {
    /// Name and device of the trace (first line).
    Meta {
        /// A short name.
        name: String,
        /// The device memory the trace was made for, in bytes.
        #[serde(default)]
        device_memory: Option<u64>,
        /// What the trace does.
        #[serde(default)]
        description: String,
    },
    /// Allocate `size` bytes on `stream`; `id` names the block until its `free`.
    Alloc {
        /// The block's name, unique among live blocks.
        id: u64,
        /// Bytes requested.
        size: u64,
        /// A stream number: `0` is the default stream, others are created as needed.
        #[serde(default)]
        stream: u64,
    },
    /// Free the block `id`.
    Free {
        /// The block's name.
        id: u64,
    },
    /// The live block `id` is also used on `stream` (`record_stream`): its reuse waits for
    /// that stream's work.
    RecordStream {
        /// The block's name.
        id: u64,
        /// A stream number, as in `alloc`.
        stream: u64,
    },
    /// transformers' `caching_allocator_warmup` before a load of `bytes`.
    Warmup {
        /// The bytes about to be loaded.
        bytes: u64,
    },
    /// `torch.cuda.empty_cache()`: return idle cache to the driver.
    EmptyCache,
    /// A label for what follows (a phase of the workload).
    Mark {
        /// The label.
        label: String,
    },
}

/// A trace: its operations, and what is known about where it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The trace's name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// The device memory it was made for.
    pub device_memory: Option<u64>,
    /// The device of the recording (a snapshot or a recorded trace) whose operations these are.
    pub device: usize,
    /// The operations, without `meta`.
    pub events: Vec<Event>,
    /// For PyTorch snapshots: the reserved-memory peak PyTorch recorded over the trace.
    pub torch_peak_reserved: Option<u64>,
    /// For PyTorch snapshots: the allocator settings PyTorch ran with, where recorded (the
    /// torch policy replays them).
    pub torch_settings: Option<crate::baseline::TorchSettings>,
    /// For PyTorch snapshots: blocks live before recording began, allocated first.
    pub restored_blocks: u64,
    /// For PyTorch snapshots: frees of blocks the reader could not place (skipped; none when
    /// the snapshot is consistent).
    pub unmatched_frees: u64,
    /// For PyTorch snapshots: the program's `torch.cuda.empty_cache()` calls, replayed as
    /// [`Event::EmptyCache`] (found by the call stacks recorded with the segments returned).
    pub empty_caches: u64,
}

impl Trace {
    /// The device memory a replay takes without `--device-memory`: the trace's own; else
    /// 80 GiB, or where PyTorch's recorded peak needs more (a snapshot of a run on a larger
    /// GPU), a quarter more than that peak in whole GiB, so that neither policy runs out of
    /// memory where PyTorch did not.
    pub fn default_device_memory(&self) -> u64 {
        const GIB: u64 = 1 << 30;
        self.device_memory.unwrap_or_else(|| {
            let recorded = self.torch_peak_reserved.unwrap_or(0);
            let room = recorded.saturating_add(recorded / 4);
            (80 * GIB).max(room.div_ceil(GIB).saturating_mul(GIB))
        })
    }

    /// Read a trace file, as JSON lines or, if it starts with a pickle's protocol marker, as a
    /// PyTorch memory snapshot: device `device`'s operations either way, or without one, device
    /// 0's, or the first device's that allocates where device 0 does not.
    pub fn read(path: &std::path::Path, device: Option<usize>) -> Result<Trace, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let trace = if bytes.first() == Some(&0x80) {
            Trace::from_snapshot(&bytes, device)
        } else {
            Trace::from_json_lines_on(&bytes, device)
        };
        trace
            .map(|mut t| {
                if t.name.is_empty() {
                    t.name = name;
                }
                t
            })
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// JSON lines of device `device`, or without one as [`Trace::read`] picks it; a device
    /// asked for that allocates nothing, where another does, is refused naming those.
    fn from_json_lines_on(bytes: &[u8], device: Option<usize>) -> Result<Trace, String> {
        let first = device.unwrap_or(0);
        let trace = Trace::from_json_lines_of(bytes, first)?;
        if trace.allocs() > 0 {
            return Ok(trace);
        }
        let d = crate::snapshot::pick_device(
            device,
            &allocating_devices(bytes),
            "the trace holds no allocations",
        )?;
        if d == first {
            return Ok(trace);
        }
        Trace::from_json_lines_of(bytes, d)
    }

    /// Parse JSON lines of device 0 (see [`Trace::from_json_lines_of`]).
    pub fn from_json_lines(reader: impl BufRead) -> Result<Trace, String> {
        Trace::from_json_lines_of(reader, 0)
    }

    /// Parse JSON lines, keeping device `device`'s operations: those whose `device` field
    /// (default 0) is that device, the `free`s and `record_stream`s of its blocks, and
    /// `empty_cache`s without a device. Blank lines and lines starting with `#` are skipped.
    /// Checks that every `free` names a live block and no `alloc` reuses a live id.
    pub fn from_json_lines_of(reader: impl BufRead, device: usize) -> Result<Trace, String> {
        let mut trace = Trace {
            device,
            ..Trace::default()
        };
        let mut live = std::collections::HashSet::new();
        let mut elsewhere = std::collections::HashSet::new();
        for (n, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| format!("line {}: {e}", n + 1))?;
            let text = line.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let mut value: serde_json::Value =
                serde_json::from_str(text).map_err(|e| format!("line {}: {e}", n + 1))?;
            let on =
                match value.as_object_mut().and_then(|o| o.remove("device")) {
                    None => None,
                    Some(d) => Some(d.as_u64().ok_or_else(|| {
                        format!("line {}: device {d} is not a device number", n + 1)
                    })?),
                };
            let event = Event::deserialize(value).map_err(|e| format!("line {}: {e}", n + 1))?;
            let mine = on.unwrap_or(0) == device as u64;
            match &event {
                Event::Alloc { id, .. } if !mine => {
                    if live.contains(id) || !elsewhere.insert(*id) {
                        return Err(format!("line {}: alloc of id {id}, which is live", n + 1));
                    }
                    continue;
                }
                Event::Free { id } if elsewhere.remove(id) => continue,
                Event::RecordStream { id, .. } if elsewhere.contains(id) => continue,
                Event::Warmup { .. } if !mine => continue,
                Event::EmptyCache if on.is_some() && !mine => continue,
                _ => {}
            }
            match &event {
                Event::Meta {
                    name,
                    device_memory,
                    description,
                } => {
                    trace.name = name.clone();
                    trace.device_memory = *device_memory;
                    trace.description = description.clone();
                    continue;
                }
                Event::Alloc { id, .. } if elsewhere.contains(id) || !live.insert(*id) => {
                    return Err(format!("line {}: alloc of id {id}, which is live", n + 1));
                }
                Event::Free { id } if !live.remove(id) => {
                    return Err(format!(
                        "line {}: free of id {id}, which is not live",
                        n + 1
                    ));
                }
                Event::RecordStream { id, .. } if !live.contains(id) => {
                    return Err(format!(
                        "line {}: record_stream of id {id}, which is not live",
                        n + 1
                    ));
                }
                _ => {}
            }
            trace.events.push(event);
        }
        Ok(trace)
    }

    /// Write the trace as JSON lines, `meta` first.
    pub fn write_json_lines(&self, mut out: impl Write) -> std::io::Result<()> {
        let meta = serde_json::json!({
            "op": "meta",
            "name": self.name,
            "device_memory": self.device_memory,
            "description": self.description,
        });
        writeln!(out, "{meta}")?;
        for event in &self.events {
            match event {
                Event::Alloc { id, size, stream } => writeln!(
                    out,
                    r#"{{"op":"alloc","id":{id},"size":{size},"stream":{stream}}}"#
                )?,
                Event::Free { id } => writeln!(out, r#"{{"op":"free","id":{id}}}"#)?,
                Event::RecordStream { id, stream } => writeln!(
                    out,
                    r#"{{"op":"record_stream","id":{id},"stream":{stream}}}"#
                )?,
                Event::Warmup { bytes } => writeln!(out, r#"{{"op":"warmup","bytes":{bytes}}}"#)?,
                Event::EmptyCache => writeln!(out, r#"{{"op":"empty_cache"}}"#)?,
                Event::Mark { label } => {
                    writeln!(out, "{}", serde_json::json!({"op": "mark", "label": label}))?
                }
                Event::Meta { .. } => {}
            }
        }
        Ok(())
    }

    /// Read a pickled `torch.cuda.memory._snapshot()`, taking device `device`'s trace, or
    /// without one as [`Trace::read`] picks it (see [`crate::snapshot`]).
    pub fn from_snapshot(bytes: &[u8], device: Option<usize>) -> Result<Trace, String> {
        crate::snapshot::read(bytes, device)
    }

    /// Allocations in the trace.
    pub fn allocs(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, Event::Alloc { .. }))
            .count()
    }
}

/// The devices that `alloc` lines of a JSON-lines trace name (0 where a line names none);
/// lines that do not parse are left to the reader, which says where they are.
fn allocating_devices(bytes: &[u8]) -> std::collections::BTreeSet<usize> {
    bytes
        .split(|&b| b == b'\n')
        .filter_map(|line| serde_json::from_slice::<serde_json::Value>(line).ok())
        .filter(|v| v.get("op").and_then(|o| o.as_str()) == Some("alloc"))
        .filter_map(|v| match v.get("device") {
            None => Some(0),
            Some(d) => d.as_u64().and_then(|d| usize::try_from(d).ok()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_device_holds_what_pytorch_recorded() {
        const GIB: u64 = 1 << 30;
        let with = |device_memory, torch_peak_reserved| Trace {
            device_memory,
            torch_peak_reserved,
            ..Trace::default()
        };
        assert_eq!(with(None, None).default_device_memory(), 80 * GIB);
        assert_eq!(with(Some(24 * GIB), None).default_device_memory(), 24 * GIB);
        // 56.91 GiB recorded (`kkaitlyn`): 80 GiB holds it and a quarter more.
        assert_eq!(
            with(None, Some(58_276 << 20)).default_device_memory(),
            80 * GIB
        );
        // 100 GiB: 125 GiB; 100.1 GiB: 125.125 GiB, rounded up to 126.
        assert_eq!(
            with(None, Some(100 * GIB)).default_device_memory(),
            125 * GIB
        );
        assert_eq!(
            with(None, Some(100 * GIB + 100 * (1 << 20))).default_device_memory(),
            126 * GIB
        );
    }

    #[test]
    fn json_lines_round_trip_and_are_checked() {
        let text = "# a comment\n\
            {\"op\":\"meta\",\"name\":\"t\",\"device_memory\":1024}\n\
            {\"op\":\"alloc\",\"id\":1,\"size\":512}\n\
            {\"op\":\"warmup\",\"bytes\":4096}\n\
            {\"op\":\"free\",\"id\":1}\n\
            {\"op\":\"empty_cache\"}\n";
        let trace = Trace::from_json_lines(text.as_bytes()).unwrap();
        assert_eq!(
            (trace.name.as_str(), trace.device_memory),
            ("t", Some(1024))
        );
        assert_eq!(
            trace.events,
            vec![
                Event::Alloc {
                    id: 1,
                    size: 512,
                    stream: 0
                },
                Event::Warmup { bytes: 4096 },
                Event::Free { id: 1 },
                Event::EmptyCache,
            ]
        );
        let mut out = Vec::new();
        trace.write_json_lines(&mut out).unwrap();
        assert_eq!(Trace::from_json_lines(&out[..]).unwrap(), trace);

        let err = Trace::from_json_lines(&b"{\"op\":\"free\",\"id\":3}\n"[..]).unwrap_err();
        assert_eq!(err, "line 1: free of id 3, which is not live");
        let twice =
            b"{\"op\":\"alloc\",\"id\":3,\"size\":1}\n{\"op\":\"alloc\",\"id\":3,\"size\":1}";
        let err = Trace::from_json_lines(&twice[..]).unwrap_err();
        assert_eq!(err, "line 2: alloc of id 3, which is live");
        let err = Trace::from_json_lines(&b"{\"op\":\"grow\"}"[..]).unwrap_err();
        assert!(err.starts_with("line 1: unknown variant `grow`"), "{err}");
    }

    #[test]
    fn a_recorded_trace_gives_each_device_its_own_operations() {
        let text = "{\"op\":\"meta\",\"name\":\"recorded\",\"device_memory\":4096}\n\
            {\"op\":\"alloc\",\"id\":1,\"size\":512,\"stream\":7,\"device\":0}\n\
            {\"op\":\"alloc\",\"id\":2,\"size\":1024,\"stream\":0,\"device\":1}\n\
            {\"op\":\"record_stream\",\"id\":2,\"stream\":9}\n\
            {\"op\":\"record_stream\",\"id\":1,\"stream\":8}\n\
            {\"op\":\"warmup\",\"bytes\":2048,\"device\":1}\n\
            {\"op\":\"free\",\"id\":2}\n\
            {\"op\":\"free\",\"id\":1}\n\
            {\"op\":\"empty_cache\",\"device\":1}\n\
            {\"op\":\"empty_cache\"}\n";
        let zero = Trace::from_json_lines_of(text.as_bytes(), 0).unwrap();
        assert_eq!(
            zero.events,
            vec![
                Event::Alloc {
                    id: 1,
                    size: 512,
                    stream: 7
                },
                Event::RecordStream { id: 1, stream: 8 },
                Event::Free { id: 1 },
                Event::EmptyCache,
            ]
        );
        let one = Trace::from_json_lines_of(text.as_bytes(), 1).unwrap();
        assert_eq!(
            one.events,
            vec![
                Event::Alloc {
                    id: 2,
                    size: 1024,
                    stream: 0
                },
                Event::RecordStream { id: 2, stream: 9 },
                Event::Warmup { bytes: 2048 },
                Event::Free { id: 2 },
                Event::EmptyCache,
                Event::EmptyCache,
            ]
        );
        let mut out = Vec::new();
        one.write_json_lines(&mut out).unwrap();
        assert_eq!(Trace::from_json_lines(&out[..]).unwrap().events, one.events);
        let err = Trace::from_json_lines(&b"{\"op\":\"record_stream\",\"id\":4,\"stream\":1}"[..])
            .unwrap_err();
        assert_eq!(err, "line 1: record_stream of id 4, which is not live");
        let err =
            Trace::from_json_lines(&b"{\"op\":\"empty_cache\",\"device\":-1}"[..]).unwrap_err();
        assert_eq!(err, "line 1: device -1 is not a device number");
    }

    #[test]
    fn a_recording_of_another_device_alone_is_read_from_that_device() {
        let text = "{\"op\":\"alloc\",\"id\":1,\"size\":512,\"stream\":0,\"device\":2}\n\
            {\"op\":\"free\",\"id\":1}\n\
            {\"op\":\"empty_cache\"}\n";
        let trace = Trace::from_json_lines_on(text.as_bytes(), None).unwrap();
        assert_eq!(trace.device, 2);
        assert_eq!(
            trace.events,
            vec![
                Event::Alloc {
                    id: 1,
                    size: 512,
                    stream: 0
                },
                Event::Free { id: 1 },
                Event::EmptyCache,
            ]
        );
        assert_eq!(
            Trace::from_json_lines_on(text.as_bytes(), Some(2)).unwrap(),
            trace
        );
        assert_eq!(
            Trace::from_json_lines_on(text.as_bytes(), Some(0)).unwrap_err(),
            "the trace holds no allocations on device 0; device(s) 2 have them: pass --device 2"
        );
        // With no allocation anywhere, the trace is what it is (a trace of empty_cache calls).
        let none = Trace::from_json_lines_on(b"{\"op\":\"empty_cache\"}\n", None).unwrap();
        assert_eq!((none.device, none.events.len()), (0, 1));
    }
}
