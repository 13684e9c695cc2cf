//! The C benchmarks in `benches/c/` compile warning-free and run against `libcuda_sim.so`
//! loaded as the driver library, so that they keep working for the machines that time them
//! (`scripts/bench-c.sh` here, `scripts/gpu-check.sh` on a GPU). Their figures are not checked:
//! the simulator's times mean nothing.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{artifacts, run, Driver};

/// Compile `benches/c/<name>.c` against the built library, once per test binary (several tests
/// run `pairs` at the same time).
fn compile(name: &str) -> PathBuf {
    common::built_once(name.to_string(), || {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let source = root.join("benches/c").join(format!("{name}.c"));
        let mut cmd = Command::new("gcc");
        cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"])
            .arg("-I")
            .arg(root.join("include"))
            .arg(&source);
        common::link_resmem(&mut cmd, false);
        cmd.args(["-lpthread", "-ldl"]);
        common::compile(
            cmd,
            &source,
            &artifacts().work.join(format!("bench-{name}")),
        )
    })
}

#[test]
fn the_driver_cost_program_times_every_call_at_every_size() {
    let exe = compile("driver_costs");
    let out = run(&exe, &["2"], Driver::SimLibrary, &[]);
    assert!(out.starts_with("granularity 2097152\n"), "{out}");
    let costs: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| l.starts_with("cost "))
        .map(|l| l.split(' ').collect())
        .collect();
    // Nine calls at five sizes, each with a median, a minimum and a maximum.
    assert_eq!(costs.len(), 45, "{out}");
    assert!(costs.iter().all(|f| f.len() == 6), "{out}");
    let calls: Vec<&str> = costs[..9].iter().map(|f| f[1]).collect();
    assert_eq!(
        calls,
        [
            "cuMemAlloc",
            "cuMemFree",
            "cuMemAddressReserve",
            "cuMemCreate",
            "cuMemMap",
            "cuMemSetAccess",
            "cuMemUnmap",
            "cuMemRelease",
            "cuMemAddressFree"
        ]
    );
    let sizes: Vec<&str> = costs.iter().step_by(9).map(|f| f[2]).collect();
    assert_eq!(
        sizes,
        ["2097152", "20971520", "67108864", "536870912", "2147483648"]
    );
}

#[test]
fn the_pair_benchmark_runs_its_counting_mode() {
    let exe = compile("pairs");
    // `count` makes the pairs and prints nothing; it fails loudly on any error.
    let out = run(&exe, &["count", "1000", "512"], Driver::SimLibrary, &[]);
    assert_eq!(out, "");
}

#[test]
fn the_pair_benchmark_runs_its_two_stream_and_fixed_work_modes() {
    let exe = compile("pairs");
    // 1, 2, 4 and 8 threads on one device, each on its own stream: a line for each.
    let out = run(&exe, &["streams"], Driver::SimLibrary, &[]);
    let threads: Vec<&str> = out
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!((f[0], f.len()), ("stream_pair", 4), "{out}");
            f[1]
        })
        .collect();
    assert_eq!(threads, ["1", "2", "4", "8"], "{out}");
    // The machine's reference for the lock holds of rm_free_reusable: one line, 50 spans.
    let out = run(&exe, &["work", "50", "25"], Driver::SimLibrary, &[]);
    let f: Vec<&str> = out.trim_end().split(' ').collect();
    assert_eq!((f[0], f[1], f.len()), ("work", "50", 8), "{out}");
}

#[test]
fn the_pair_benchmark_runs_its_stitch_mode_from_the_cache_alone() {
    let exe = compile("pairs");
    // 3 reserves of 128 MiB (32 pieces) and of 256 MiB (64), each made of the 4 MiB blocks
    // released between live ones: no memory created. Then the probe's two phases, 5 figures each.
    for size in ["134217728", "268435456"] {
        let out = run(&exe, &["stitch", "3", size], Driver::SimLibrary, &[]);
        let f: Vec<&str> = out.trim_end().split(' ').collect();
        assert_eq!(
            (f[0], f[1], f[3], f.len()),
            ("stitch", "3", "0", 14),
            "{out}"
        );
    }
    // From 66 MiB blocks: one released afresh before each range (`touch`), or each range 2 MiB
    // larger than the last, which the reserve takes apart first (`return`); a wait for the
    // device before each range either way.
    let (size, hole) = (((32u64 * 66) << 20).to_string(), (66u64 << 20).to_string());
    for mode in ["touch", "return"] {
        let args = ["stitch", "2", &size, &hole, mode];
        let out = run(&exe, &args, Driver::SimLibrary, &[]);
        let f: Vec<&str> = out.trim_end().split(' ').collect();
        assert_eq!(
            (f[0], f[1], f[3], f.len()),
            ("stitch", "2", "0", 14),
            "{mode}: {out}"
        );
    }
}

#[test]
fn the_pair_benchmark_runs_its_stack_shift_sweep() {
    let exe = compile("pairs");
    // 512-byte pairs with nothing else cached, the stack shifted 0 and 2048 bytes (steps of
    // 2048), 1 ms each, one pass: resmem's line, then glibc's, at each shift.
    let out = run(
        &exe,
        &["sweep", "0", "2048", "1", "512", "1"],
        Driver::SimLibrary,
        &[],
    );
    let lines: Vec<Vec<&str>> = out.lines().map(|l| l.split(' ').collect()).collect();
    let heads: Vec<&[&str]> = lines.iter().map(|f| &f[..5]).collect();
    assert_eq!(
        heads,
        [
            ["shift", "resmem", "512", "0", "0"],
            ["shift", "glibc", "512", "0", "0"],
            ["shift", "resmem", "512", "0", "2048"],
            ["shift", "glibc", "512", "0", "2048"],
        ],
        "{out}"
    );
    // Wall and CPU time per pair, each a positive number.
    for f in &lines {
        assert_eq!(f.len(), 7, "{out}");
        for v in &f[5..] {
            assert!(v.parse::<f64>().is_ok_and(|v| v > 0.0), "{out}");
        }
    }
}

#[test]
fn the_trace_benchmark_replays_a_trace_and_counts_its_reserves() {
    let exe = compile("trace");
    let ops = artifacts().work.join("bench-trace-ops.txt");
    // Two streams; a release of a block another reserve then takes; a block left live at the
    // end of each repetition, which the program releases.
    std::fs::write(
        &ops,
        "a 0 4194304 0\na 1 1000 1\nf 0\na 2 4194304 0\nf 1\nf 2\na 3 8388608 0\n",
    )
    .unwrap();
    let out = run(
        &exe,
        &[ops.to_str().unwrap(), "3"],
        Driver::SimLibrary,
        &[("CUDA_SIM_DEVICES", "24GiB")],
    );
    let f: Vec<&str> = out.trim_end().split(' ').collect();
    assert_eq!(f.len(), 8, "{out}");
    assert_eq!(f[..3], ["trace", "7", "3"], "{out}");
    assert!(f[3].parse::<f64>().unwrap() > 0.0, "{out}");
    // Four reserves in each of three repetitions; only the first repetition's two segments
    // are not hits: the 20 MiB one created for 4 MiB, and stream 1's small one, mapped from a
    // page of its free rest, so that the peak is that one 20 MiB.
    assert_eq!(f[5..], ["12", "10", "20971520"], "{out}");
    // A bad line is refused with a message.
    std::fs::write(&ops, "x 0\n").unwrap();
    let bad = common::spawn(&exe, &[ops.to_str().unwrap(), "2"], Driver::SimLibrary, &[]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad operation"));
}
