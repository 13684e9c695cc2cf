//! The `resmem` binary itself: help on every subcommand, replay with a plot, info, errors.

use std::process::Command;

fn resmem(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_resmem"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env("RESMEM_DRIVER", "sim")
        .env("CUDA_SIM_DEVICES", "24GiB")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_subcommand_has_help() {
    for sub in ["demo", "replay", "info", "gen-trace"] {
        let (ok, out, _) = resmem(&[sub, "--help"]);
        assert!(ok, "{sub} --help failed");
        assert!(out.contains("Usage: resmem"), "{out}");
    }
}

#[test]
fn replay_prints_the_table_and_draws_the_plot() {
    let svg = std::env::temp_dir().join(format!("resmem-plot-{}.svg", std::process::id()));
    let (ok, out, err) = resmem(&[
        "replay",
        "traces/transformers-37436.jsonl",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    // `both`: PyTorch's policy, then resmem's default.
    let ooms = out
        .lines()
        .find(|l| l.starts_with("out-of-memory events"))
        .map(|l| l.split_whitespace().skip(2).collect::<Vec<_>>());
    assert_eq!(ooms, Some(vec!["1", "0"]), "{out}");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).unwrap();
    assert!(drawn.starts_with("<svg"));
    assert!(drawn.contains("torch reserved") && drawn.contains("resmem allocated"));
}

#[test]
fn info_reports_the_configured_devices() {
    let (ok, out, err) = resmem(&["info"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("device 0: total 24.00 GiB, driver free 24.00 GiB, resmem reusable 0 B"),
        "{out}"
    );
}

#[test]
fn bad_input_says_what_is_wrong() {
    let (ok, _, err) = resmem(&["demo", "--model", "gpt-5"]);
    assert!(!ok);
    assert!(
        err.contains("the presets are qwen3-4b, llama-3-8b, mistral-7b"),
        "{err}"
    );
    let (ok, _, err) = resmem(&["replay", "no-such-trace.jsonl"]);
    assert!(!ok);
    assert!(err.contains("cannot read no-such-trace.jsonl"), "{err}");
}

#[test]
fn the_demo_shows_pytorchs_offload_and_resmems_none() {
    let svg = std::env::temp_dir().join(format!("resmem-demo-{}.svg", std::process::id()));
    let (ok, out, err) = resmem(&["demo", "--plot", svg.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        out.contains(
            "PyTorch's policy: peak reserved 16.44 GiB (2.001 x one warm-up), 3 driver \
             allocations, parameters offloaded to the CPU at load 3, 4"
        ),
        "{out}"
    );
    assert!(out.contains("resmem: peak reserved"), "{out}");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).unwrap();
    assert!(drawn.contains("torch reserved") && drawn.contains("resmem reserved"));
}

#[test]
fn a_snapshot_without_a_trace_is_refused() {
    use serde_pickle::{HashableValue, Value};
    let key = |k: &str| HashableValue::String(k.into());
    let segment = Value::Dict(
        [
            (key("device"), Value::I64(0)),
            (key("address"), Value::I64(0x7000_0000_0000)),
            (key("total_size"), Value::I64(2 << 20)),
            (key("blocks"), Value::List(vec![])),
        ]
        .into(),
    );
    let root = Value::Dict([(key("segments"), Value::List(vec![segment]))].into());
    let path = std::env::temp_dir().join(format!("resmem-snap-{}.pickle", std::process::id()));
    std::fs::write(
        &path,
        serde_pickle::value_to_vec(&root, serde_pickle::SerOptions::new()).unwrap(),
    )
    .unwrap();
    let (ok, out, err) = resmem(&["replay", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert!(!ok && out.is_empty(), "{out}");
    assert_eq!(
        err,
        format!(
            "resmem: {}: the snapshot holds 1 segment(s) (2.00 MiB) on device 0 but no \
             allocation events to replay: call torch.cuda.memory._record_memory_history() \
             before the workload and dump the snapshot after it\n",
            path.display()
        )
    );
}
