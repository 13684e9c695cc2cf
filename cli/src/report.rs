//! The figures of replays, for people (a side-by-side table) and for scripts (JSON).

use crate::baseline::TorchSettings;
use crate::replay::{Outcome, Policy, CALL_ROWS};
use crate::trace::Trace;
use crate::units::gib_or_mib;

/// Hundredths of a GiB: `7.49`.
fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / f64::from(1u32 << 30))
}

/// The rows of the peak's layout (`Outcome::peak_layout`), in the order of its fields.
const LAYOUT_ROWS: [&str; 6] = [
    "at the peak (MiB)",
    "  live: requested",
    "  live: rounding",
    "  cached beside live",
    "  cached whole pages",
    "  cached idle",
];

/// The side-by-side table of several outcomes (sizes in GiB), with the smallest device of each
/// when `min_devices` has them (in the same order).
pub fn table(trace: &Trace, outcomes: &[Outcome], min_devices: &[Option<u64>]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = vec![
        ("peak requested (GiB)".into(), vec![]),
        ("peak reserved (GiB)".into(), vec![]),
        ("fragmentation".into(), vec![]),
    ];
    for label in LAYOUT_ROWS {
        rows.push((label.into(), vec![]));
    }
    if !min_devices.is_empty() {
        rows.push(("smallest device (GiB)".into(), vec![]));
    }
    rows.push(("out-of-memory events".into(), vec![]));
    rows.push(("driver allocations (creating memory)".into(), vec![]));
    for (label, _) in CALL_ROWS {
        rows.push((format!("  {label}"), vec![]));
    }
    rows.push(("est. driver time (ms)".into(), vec![]));
    for (i, o) in outcomes.iter().enumerate() {
        let mut cells = vec![
            gib(o.peak_requested),
            gib(o.stats.peak_reserved_bytes),
            format!("{:.2} %", 100.0 * o.fragmentation()),
        ];
        let l = &o.peak_layout;
        for bytes in [
            l.total(),
            l.requested,
            l.rounding,
            l.beside_live,
            l.free_pages,
            l.idle,
        ] {
            cells.push(format!("{:.0}", bytes as f64 / f64::from(1u32 << 20)));
        }
        if !min_devices.is_empty() {
            cells.push(match min_devices.get(i).copied().flatten() {
                Some(bytes) => gib(bytes),
                None => "none".into(),
            });
        }
        cells.push(o.ooms.to_string());
        cells.push(o.creating_calls().to_string());
        for (_, calls) in CALL_ROWS {
            cells.push(o.count(calls).to_string());
        }
        cells.push(format!("{:.2}", o.driver_time_us() / 1000.0));
        for (row, cell) in rows.iter_mut().zip(cells) {
            row.1.push(cell);
        }
    }
    let mut out = format!("{:<26}", "");
    for o in outcomes {
        let mark = if o.policy.is_default() { " *" } else { "" };
        out.push_str(&format!("{:>17}", format!("{}{mark}", o.policy.name())));
    }
    out.push('\n');
    for (label, cells) in rows {
        out.push_str(&format!("{label:<26}"));
        for c in cells {
            out.push_str(&format!("{c:>17}"));
        }
        out.push('\n');
    }
    if outcomes.iter().any(|o| o.policy.is_default()) {
        out.push_str("* resmem's default policy (PoolConfig::default())\n");
    }
    if let Some(peak) = trace.torch_peak_reserved {
        out.push_str(&format!(
            "PyTorch itself recorded a peak reserved of {} GiB",
            gib(peak)
        ));
        if let Some(t) = outcomes.iter().find(|o| o.policy == Policy::Torch) {
            let ratio = t.stats.peak_reserved_bytes as f64 / peak.max(1) as f64;
            out.push_str(&format!(
                "; the torch policy replayed {} GiB, {ratio:.4} x that",
                gib(t.stats.peak_reserved_bytes)
            ));
        }
        out.push('\n');
        if trace.restored_blocks > 0 {
            out.push_str(&format!(
                "{} blocks live before recording began were allocated first\n",
                trace.restored_blocks
            ));
        }
        if trace.empty_caches > 0 {
            out.push_str(&format!(
                "{} torch.cuda.empty_cache() call(s) of the program replayed\n",
                trace.empty_caches
            ));
        }
        if trace.unmatched_frees > 0 {
            out.push_str(&format!(
                "{} frees of blocks the snapshot does not place were skipped\n",
                trace.unmatched_frees
            ));
        }
    }
    if let Some(settings) = &trace.torch_settings {
        out.push_str(&settings_lines(settings));
    }
    out
}

/// What the report says of the allocator settings PyTorch ran with: nothing for its defaults.
fn settings_lines(s: &TorchSettings) -> String {
    let mut out = String::new();
    let replayed: Vec<String> = s
        .config
        .max_split_size
        .map(|m| format!("max_split_size {}", gib_or_mib(m)))
        .into_iter()
        .chain(
            s.config
                .max_non_split_rounding
                .map(|m| format!("max_non_split_rounding {}", gib_or_mib(m))),
        )
        .chain(
            s.config
                .roundup_power2_divisions
                .iter()
                .any(|&d| d > 1)
                .then(|| {
                    format!(
                        "roundup_power2_divisions {:?}",
                        s.config.roundup_power2_divisions
                    )
                }),
        )
        .chain(
            s.config
                .expandable_segments
                .then(|| "expandable segments".to_string()),
        )
        .collect();
    if !replayed.is_empty() {
        out.push_str(&format!(
            "PYTORCH_CUDA_ALLOC_CONF=\"{}\": the torch policy replays its {}\n",
            s.conf,
            replayed.join(", ")
        ));
    }
    if s.garbage_collection {
        out.push_str(
            "a garbage_collection_threshold acts only under a memory fraction, which no trace \
             records: not modelled\n",
        );
    }
    out
}

/// The figures as JSON: the trace, PyTorch's recorded peak if known, and per policy its
/// figures, driver calls by kind and smallest device (`null` when not searched or none runs).
pub fn json(trace: &Trace, outcomes: &[Outcome], min_devices: &[Option<u64>]) -> String {
    let policies: Vec<serde_json::Value> = outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let calls: serde_json::Map<String, serde_json::Value> = CALL_ROWS
                .iter()
                .map(|(label, calls)| (label.to_string(), o.count(calls).into()))
                .collect();
            serde_json::json!({
                "policy": o.policy.name(),
                "default": o.policy.is_default(),
                "peak_requested": o.peak_requested,
                "peak_allocated": o.stats.peak_allocated_bytes,
                "peak_reserved": o.stats.peak_reserved_bytes,
                "fragmentation": o.fragmentation(),
                "peak_layout": {
                    "reserved": o.peak_layout.total(),
                    "requested": o.peak_layout.requested,
                    "rounding": o.peak_layout.rounding,
                    "beside_live": o.peak_layout.beside_live,
                    "free_pages": o.peak_layout.free_pages,
                    "idle": o.peak_layout.idle,
                },
                "smallest_device": min_devices.get(i).copied().flatten(),
                "ooms": o.ooms,
                "creating_calls": o.creating_calls(),
                "calls": calls,
                "driver_time_us": o.driver_time_us(),
            })
        })
        .collect();
    serde_json::json!({
        "trace": trace.name,
        "device": trace.device,
        "operations": trace.events.len(),
        "allocations": trace.allocs(),
        "torch_recorded_peak_reserved": trace.torch_peak_reserved,
        "restored_blocks": trace.restored_blocks,
        "empty_caches": trace.empty_caches,
        "torch_settings": trace.torch_settings.as_ref().map(|s| serde_json::json!({
            "conf": s.conf,
            "max_split_size": s.config.max_split_size,
            "max_non_split_rounding": s.config.max_non_split_rounding,
            "roundup_power2_divisions": s.config.roundup_power2_divisions,
            "expandable_segments": s.config.expandable_segments,
            "garbage_collection": s.garbage_collection,
        })),
        "policies": policies,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::replay;
    use crate::trace::Event;

    #[test]
    fn the_table_marks_the_default_and_the_json_carries_every_figure() {
        let trace = Trace {
            name: "t".into(),
            events: vec![
                Event::Alloc {
                    id: 1,
                    size: 3 << 20,
                    stream: 0,
                },
                Event::Free { id: 1 },
            ],
            ..Trace::default()
        };
        let outcomes: Vec<Outcome> = [Policy::Torch, Policy::Resmem]
            .iter()
            .map(|&p| replay(&trace, p, 1 << 30, |_| {}).unwrap())
            .collect();
        let text = table(&trace, &outcomes, &[Some(32 << 20), None]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            ["torch", "resmem", "*"]
        );
        // PyTorch's policy: a 20 MiB segment for 3 MiB.
        let row = |label: &str| {
            let line = lines.iter().find(|l| l.starts_with(label)).unwrap();
            line[label.len()..]
                .split_whitespace()
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(row("peak requested (GiB)"), "0.00");
        assert_eq!(row("peak reserved (GiB)"), "0.02");
        assert_eq!(row("fragmentation"), "85.00");
        // The 3 MiB block's second page holds 1 MiB free; the other 8 pages are free.
        assert_eq!(row("at the peak (MiB)"), "20");
        assert_eq!(row("  live: requested"), "3");
        assert_eq!(row("  live: rounding"), "0");
        assert_eq!(row("  cached beside live"), "1");
        assert_eq!(row("  cached whole pages"), "16");
        assert_eq!(row("  cached idle"), "0");
        assert_eq!(row("smallest device (GiB)"), "0.03");
        assert_eq!(row("driver allocations (creating memory)"), "1");
        assert!(text.ends_with("* resmem's default policy (PoolConfig::default())\n"));
        let json: serde_json::Value =
            serde_json::from_str(&json(&trace, &outcomes, &[Some(32 << 20), None])).unwrap();
        let torch = &json["policies"][0];
        assert_eq!(torch["policy"], "torch");
        assert_eq!(torch["default"], false);
        assert_eq!(torch["peak_requested"], 3 << 20);
        assert_eq!(torch["peak_reserved"], 20 << 20);
        assert_eq!(torch["smallest_device"], 32 << 20);
        assert_eq!(torch["calls"]["cuMemAlloc"], 1);
        assert_eq!(
            torch["peak_layout"],
            serde_json::json!({
                "reserved": 20 << 20,
                "requested": 3 << 20,
                "rounding": 0,
                "beside_live": 1 << 20,
                "free_pages": 16 << 20,
                "idle": 0,
            })
        );
        assert_eq!(json["policies"][1]["default"], true);
        assert_eq!(
            json["policies"][1]["smallest_device"],
            serde_json::Value::Null
        );
    }

    #[test]
    fn the_settings_pytorch_ran_with_are_said_where_they_are_not_its_defaults() {
        use crate::baseline::TorchConfig;
        assert_eq!(settings_lines(&TorchSettings::default()), "");
        let mut config = TorchConfig {
            max_split_size: Some(128 << 20),
            max_non_split_rounding: Some(64 << 20),
            ..TorchConfig::default()
        };
        config.roundup_power2_divisions[0] = 4;
        config.expandable_segments = true;
        let settings = TorchSettings {
            conf: "max_split_size_mb:128,max_non_split_rounding_mb:64,\
                   roundup_power2_divisions:4,expandable_segments:True"
                .into(),
            config,
            garbage_collection: true,
        };
        assert_eq!(
            settings_lines(&settings),
            "PYTORCH_CUDA_ALLOC_CONF=\"max_split_size_mb:128,max_non_split_rounding_mb:64,\
             roundup_power2_divisions:4,expandable_segments:True\": the torch policy replays its \
             max_split_size 128.00 MiB, max_non_split_rounding 64.00 MiB, \
             roundup_power2_divisions [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], \
             expandable segments\n\
             a garbage_collection_threshold acts only under a memory fraction, which no trace \
             records: not modelled\n"
        );
    }
}
