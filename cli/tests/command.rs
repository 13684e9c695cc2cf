//! The `resmem` binary itself: help on every subcommand, replay with a plot, info, errors, and
//! the environment read the same way by every subcommand.

use std::process::Command;

fn resmem(args: &[&str]) -> (bool, String, String) {
    let (code, out, err) = resmem_with(args, &[("RESMEM_DRIVER", "sim")]);
    (code == 0, out, err)
}

/// Run the command with a clean resmem environment plus `env`: exit code, stdout, stderr.
fn resmem_with(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_resmem"));
    cmd.args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    for var in [
        "RESMEM_DRIVER",
        "RESMEM_CONF",
        "RESMEM_CUDA_LIBRARY",
        "CUDA_SIM_DEVICES",
        "CUDA_SIM_VMM",
    ] {
        cmd.env_remove(var);
    }
    let out = cmd.envs(env.iter().copied()).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
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
fn replay_log_names_each_operation_that_changes_what_a_policy_reserves() {
    let (ok, _, err) = resmem(&["replay", "traces/transformers-37436.jsonl", "--log"]);
    assert!(ok, "{err}");
    // PyTorch's policy: a 20 MiB segment for the first 4 MiB block; the 784 MiB request, which
    // fails and returns nothing (every segment keeps a live block), is not named.
    assert!(
        err.contains(
            "torch: operation 2: alloc 1 of 4.00 MiB on stream 0: reserved 0 B -> 20.00 MiB\n"
        ),
        "{err}"
    );
    assert!(!err.contains("torch: operation 425"), "{err}");
    // resmem's default: the pool says why, then the operation.
    let stitched = err
        .lines()
        .position(|l| l.contains("stitched a 840.00 MiB"))
        .expect("the pool's log");
    assert!(
        err.lines().nth(stitched + 1).unwrap().starts_with(
            "resmem: operation 425: alloc 236 of 784.00 MiB on stream 0: reserved 968.00 MiB -> 1.01 GiB"
        ),
        "{err}"
    );
    // Without --log, nothing of it.
    let (ok, _, err) = resmem(&["replay", "traces/transformers-37436.jsonl"]);
    assert!(ok && !err.contains("operation"), "{err}");
}

#[test]
fn info_prints_a_table_of_the_configured_devices() {
    let (code, out, err) = resmem_with(
        &["info"],
        &[
            ("RESMEM_DRIVER", "sim"),
            ("CUDA_SIM_DEVICES", "24GiB,80GiB"),
            ("RESMEM_CONF", "vmm:true"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        format!(
            "resmem {} on simulated devices from CUDA_SIM_DEVICES (RESMEM_DRIVER=sim)\n\
             settings (RESMEM_CONF): release_before_grow true, vmm true, logging false, \
             preload_allocations false, record off, handle_part_mib 0\n\
             \n\
             device           total   driver free      reusable   reported free     reuse\n\
             0            24.00 GiB     24.00 GiB           0 B       24.00 GiB     pages\n\
             1            80.00 GiB     80.00 GiB           0 B       80.00 GiB     pages\n\
             \n\
             reuse: pages (cached memory mapped again page by page, with the virtual-memory \
             API), parts (the same in parts of handle_part_mib, where the driver maps only from \
             an allocation's start) or segments (classic: vmm:false, or a driver without the \
             API)\n\
             \n\
             peers (the devices whose memory each device can use; a device's ranges give access \
             to those of them that serve requests of the same process):\n\
             0: 1\n\
             1: 0\n",
            env!("CARGO_PKG_VERSION")
        )
    );
    // Stitching turned off, or devices without the virtual-memory API: segments. Devices whose
    // cuMemMap maps only from an allocation's start, as the CUDA driver's: pages, of handles of
    // one page each, or parts where handle_part_mib asks for more (on other devices, pages).
    for (vars, reuse) in [
        (&[("RESMEM_CONF", "vmm:false")][..], "segments"),
        (&[("CUDA_SIM_VMM", "0")], "segments"),
        (&[("CUDA_SIM_VMM", "offset0")], "   pages"),
        (
            &[
                ("CUDA_SIM_VMM", "offset0"),
                ("RESMEM_CONF", "handle_part_mib:8"),
            ],
            "   parts",
        ),
        (&[("RESMEM_CONF", "handle_part_mib:8")], "   pages"),
    ] {
        let mut env = vec![("RESMEM_DRIVER", "sim"), ("CUDA_SIM_DEVICES", "24GiB")];
        env.extend_from_slice(vars);
        let (code, out, err) = resmem_with(&["info"], &env);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains(&format!(
                "\n0            24.00 GiB     24.00 GiB           0 B       24.00 GiB  {reuse}\n"
            )),
            "{vars:?}: {out}"
        );
    }
}

#[test]
fn without_a_gpu_demo_and_info_fall_back_to_simulated_devices_and_say_so() {
    let no_driver = ("RESMEM_CUDA_LIBRARY", "/nonexistent/libcuda.so.1");
    let (code, out, err) = resmem_with(&["demo", "--loads", "1"], &[no_driver]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines().next().unwrap().contains(
            "on a simulated 24.00 GiB device (no GPU: could not load the CUDA driver library \
             \"/nonexistent/libcuda.so.1\""
        ),
        "{out}"
    );
    let (code, out, err) = resmem_with(&["info"], &[no_driver]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!(
            "resmem {} on simulated devices from CUDA_SIM_DEVICES (no GPU: could not load",
            env!("CARGO_PKG_VERSION")
        )),
        "{out}"
    );
    // Asked for the GPU explicitly: refused, in one line.
    for sub in [&["demo"][..], &["info"]] {
        let (code, out, err) = resmem_with(sub, &[no_driver, ("RESMEM_DRIVER", "cuda")]);
        assert_eq!((code, out.as_str()), (1, ""), "{sub:?}");
        assert!(
            err.starts_with("resmem: RESMEM_DRIVER=cuda, but could not load the CUDA driver"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn every_subcommand_refuses_a_bad_environment_in_one_line() {
    let cases = [
        (
            ("RESMEM_DRIVER", "nvidia"),
            "resmem: RESMEM_DRIVER=\"nvidia\" is not a driver: use cuda (the default) or sim\n",
        ),
        (
            ("RESMEM_CONF", "bogus:true"),
            "resmem: RESMEM_CONF: unknown key \"bogus\"; the keys are release_before_grow:true|false, \
             logging:true|false, vmm:true|false, preload_allocations:true|false, record:PATH, \
             share:true|false, share_count:true|false, share_wait_ms:<milliseconds, at most \
             60000>, handle_part_mib:<MiB, at most 1024>\n",
        ),
        (
            ("CUDA_SIM_VMM", "yes"),
            "resmem: CUDA_SIM_VMM=\"yes\": use 0 (no virtual-memory API), offset0 (cuMemMap only \
             from an allocation's start) or 1 (the API in full, the default)\n",
        ),
        (
            ("CUDA_SIM_DEVICES", "banana"),
            "resmem: CUDA_SIM_DEVICES: device 0: \"banana\" is not a size (examples: \"24GiB\", \
             \"512MiB\", \"24GB\")\n",
        ),
    ];
    let subcommands: [&[&str]; 4] = [
        &["demo", "--loads", "1"],
        &["replay", "traces/transformers-37436.jsonl"],
        &["info"],
        &["gen-trace", "transformers-37436"],
    ];
    for (var, message) in cases {
        for args in subcommands {
            let (code, out, err) = resmem_with(args, &[var]);
            assert_eq!(
                (code, out.as_str(), err.as_str()),
                (1, "", message),
                "{args:?} {var:?}"
            );
        }
    }
}

#[test]
fn bad_arguments_get_one_line_and_exit_code_2() {
    for (args, message) in [
        (
            &["demo", "--device-memory", "0"][..],
            "resmem: invalid value '0' for '--device-memory <DEVICE_MEMORY>': device 0: capacity \
             \"0\" is smaller than one 2 MiB page (see resmem --help)\n",
        ),
        (
            &[
                "replay",
                "traces/transformers-37436.jsonl",
                "--device-memory",
                "1MiB",
            ],
            "resmem: invalid value '1MiB' for '--device-memory <DEVICE_MEMORY>': device 0: \
             capacity \"1MiB\" is smaller than one 2 MiB page (see resmem --help)\n",
        ),
        (
            &["gen-trace"],
            "resmem: the following required arguments were not provided: <KIND|--all <DIR>> \
             (see resmem --help)\n",
        ),
        (
            &["gen-trace", "mystery"],
            "resmem: invalid value 'mystery' for '[KIND]' [possible values: qwen3-4b-seed, \
             qwen3-4b-loads, model-swap, llama-3-8b-decode, qwen3-0.6b-training, transformers-37436, interleaved-lifetimes, \
             random-sizes] \
             (see resmem --help)\n",
        ),
    ] {
        let (code, out, err) = resmem_with(args, &[("RESMEM_DRIVER", "sim")]);
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (2, "", message),
            "{args:?}"
        );
    }
}

#[test]
fn gen_trace_all_creates_its_folder() {
    let dir = std::env::temp_dir().join(format!("resmem-gen-{}/a/b", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, _, err) = resmem_with(&["gen-trace", "--all", dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "interleaved-lifetimes.jsonl",
            "llama-3-8b-decode.jsonl",
            "model-swap.jsonl",
            "qwen3-0.6b-training.jsonl",
            "qwen3-4b-loads.jsonl",
            "qwen3-4b-seed.jsonl",
            "random-sizes.jsonl",
            "transformers-37436.jsonl"
        ]
    );
    std::fs::remove_dir_all(dir.parent().unwrap().parent().unwrap()).unwrap();
}

#[test]
fn bad_input_says_what_is_wrong() {
    let (ok, _, err) = resmem(&["demo", "--model", "gpt-5"]);
    assert!(!ok);
    assert!(
        err.contains("the presets are qwen3-4b, llama-3-8b, mistral-7b, qwen3-0.6b"),
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
    assert!(
        out.contains(
            "PyTorch's policy with expandable_segments:True: peak reserved 15.88 GiB (1.933 x \
             one warm-up), 814 driver allocations, parameters offloaded to the CPU at load 3, 4"
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

/// A snapshot with no end-state segments whose devices' traces are `devices`, each event an
/// action and a size at one address on the default stream, written to a file named for `name`.
fn snapshot_file(name: &str, devices: &[&[(&str, i64)]]) -> std::path::PathBuf {
    use serde_pickle::{HashableValue, Value};
    let key = |k: &str| HashableValue::String(k.into());
    let event = |&(action, size): &(&str, i64)| {
        Value::Dict(
            [
                (key("action"), Value::String(action.into())),
                (key("addr"), Value::I64(0x7000_0000_0000)),
                (key("size"), Value::I64(size)),
                (key("stream"), Value::I64(0)),
            ]
            .into(),
        )
    };
    let traces = devices
        .iter()
        .map(|events| Value::List(events.iter().map(event).collect()))
        .collect();
    let root = Value::Dict(
        [
            (key("segments"), Value::List(vec![])),
            (key("device_traces"), Value::List(traces)),
        ]
        .into(),
    );
    let path = std::env::temp_dir().join(format!("resmem-{name}-{}.pickle", std::process::id()));
    std::fs::write(
        &path,
        serde_pickle::value_to_vec(&root, serde_pickle::SerOptions::new()).unwrap(),
    )
    .unwrap();
    path
}

#[test]
fn a_snapshot_larger_than_80_gib_is_replayed_on_a_device_that_holds_it() {
    // PyTorch reserved 100 GiB for a 100 GiB tensor (a run on a GPU larger than 80 GiB).
    let gib100 = 100 << 30;
    let path = snapshot_file(
        "big",
        &[&[
            ("segment_alloc", gib100),
            ("alloc", gib100),
            ("free_completed", gib100),
            ("segment_free", gib100),
        ]],
    );
    let (ok, out, err) = resmem(&["replay", path.to_str().unwrap()]);
    let (small_ok, small, _) =
        resmem(&["replay", path.to_str().unwrap(), "--device-memory", "80GiB"]);
    std::fs::remove_file(&path).unwrap();
    assert!(ok && small_ok, "{err}");
    // A quarter more than the peak PyTorch recorded, and no out-of-memory under either policy.
    assert!(
        out.starts_with(&format!(
            "{}: 2 operations (1 allocation) on a simulated 125.00 GiB device\n",
            path.file_stem().unwrap().to_str().unwrap()
        )),
        "{out}"
    );
    let ooms = |out: &str| {
        out.lines()
            .find(|l| l.starts_with("out-of-memory events"))
            .unwrap()
            .split_whitespace()
            .skip(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(ooms(&out), "0 0");
    // Asked for 80 GiB, it runs out under both, as it would on such a GPU.
    assert_eq!(ooms(&small), "1 1");
}

#[test]
fn a_snapshot_of_the_second_gpu_alone_is_replayed_from_it() {
    let path = snapshot_file(
        "gpu1",
        &[
            &[],
            &[
                ("segment_alloc", 20 << 20),
                ("alloc", 4 << 20),
                ("free_completed", 4 << 20),
                ("segment_free", 20 << 20),
            ],
        ],
    );
    let (ok, out, err) = resmem(&["replay", path.to_str().unwrap(), "--policy", "torch"]);
    let (json_ok, json, _) = resmem(&[
        "replay",
        path.to_str().unwrap(),
        "--policy",
        "torch",
        "--json",
    ]);
    let (refused, _, refusal) = resmem(&["replay", path.to_str().unwrap(), "--device", "0"]);
    std::fs::remove_file(&path).unwrap();
    assert!(ok, "{err}");
    let first = out.lines().next().unwrap();
    assert!(
        first.ends_with(
            ": 2 operations of device 1 (device 0 has nothing to replay) (1 allocation) on a \
             simulated 80.00 GiB device"
        ),
        "{first}"
    );
    assert!(json_ok);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["device"], 1);
    assert_eq!(json["policies"][0]["peak_reserved"], 20 << 20);
    assert!(!refused);
    assert!(
        refusal.ends_with(
            "the snapshot holds no segments and no allocation events on device 0; device(s) 1 \
             have them: pass --device 1\n"
        ),
        "{refusal}"
    );
}

#[test]
fn replay_takes_pytorchs_settings_from_torch_conf() {
    // A 64 MiB block freed, then 30 MiB asked for: PyTorch's defaults split the cached block
    // (64 MiB reserved); with max_split_size_mb:40 it stays whole and the request gets a
    // segment of its own (94 MiB); with expandable segments, 80 MiB.
    let path = std::env::temp_dir().join(format!("resmem-split-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        "{\"op\":\"alloc\",\"id\":1,\"size\":67108864}\n{\"op\":\"free\",\"id\":1}\n\
         {\"op\":\"alloc\",\"id\":2,\"size\":31457280}\n",
    )
    .unwrap();
    let trace = path.to_str().unwrap();
    let peak = |extra: &[&str]| {
        let mut args = vec!["replay", trace, "--policy", "torch", "--json"];
        args.extend_from_slice(extra);
        let (ok, out, err) = resmem(&args);
        assert!(ok, "{err}");
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        json["policies"][0]["peak_reserved"].as_u64().unwrap() >> 20
    };
    let default = peak(&[]);
    let tuned = peak(&["--torch-conf", "max_split_size_mb:40"]);
    let (_, table, _) = resmem(&[
        "replay",
        trace,
        "--policy",
        "torch",
        "--torch-conf",
        "max_split_size_mb:40",
    ]);
    let expandable = peak(&["--torch-conf", "expandable_segments:True"]);
    let (small, _, small_err) = resmem(&["replay", trace, "--torch-conf", "max_split_size_mb:10"]);
    std::fs::remove_file(&path).unwrap();
    assert_eq!((default, tuned), (64, 94));
    assert!(
        table.contains(
            "PYTORCH_CUDA_ALLOC_CONF=\"max_split_size_mb:40\": the torch policy replays its \
             max_split_size 40.00 MiB\n"
        ),
        "{table}"
    );
    // Expandable segments: four 20 MiB handles, the 30 MiB request taken in place.
    assert_eq!(expandable, 80);
    assert!(!small);
    assert_eq!(
        small_err,
        "resmem: PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb must be at least 20, as PyTorch \
         requires\n"
    );
}

#[test]
fn replay_with_one_page_handles_makes_the_same_decisions_in_a_call_per_page() {
    // As on the CUDA driver, which maps only from an allocation's start: the default's peak is
    // the same, and each of its handles is made of 2 MiB pages, a cuMemCreate each.
    let figures = |extra: &[&str]| {
        let mut args = vec![
            "replay",
            "traces/qwen3-4b-seed.jsonl",
            "--policy",
            "resmem",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = resmem(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let o = &v["policies"][0];
        (
            o["peak_reserved"].as_u64().unwrap(),
            o["creating_calls"].as_u64().unwrap(),
        )
    };
    let (peak, calls) = figures(&[]);
    let (pages_peak, pages_calls) = figures(&["--one-page-handles"]);
    assert_eq!(pages_peak, peak);
    assert_eq!(calls, 2);
    // Nothing is returned in this trace: every page of the peak was created once.
    assert_eq!(pages_calls, peak / (2 << 20));
    // Parts of 8 MiB (7 MiB rounds up to them): a quarter of the calls, and 48 MiB more at the
    // peak, the cache being lent only in whole parts.
    for part in ["8MiB", "7MiB"] {
        let (parts_peak, parts_calls) = figures(&["--handle-part", part]);
        assert_eq!((parts_peak, parts_calls), (peak + (48 << 20), 1068));
    }
    let (ok, _, err) = resmem(&[
        "replay",
        "traces/qwen3-4b-seed.jsonl",
        "--handle-part",
        "2GiB",
    ]);
    assert!(!ok);
    assert!(err.contains("\"2GiB\" is not a size up to 1GiB"), "{err}");
}
