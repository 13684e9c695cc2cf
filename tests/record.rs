//! `RESMEM_CONF=record:PATH` on a real program: `c_examples/workload.c` (the C API on two
//! devices, PyTorch's entry points, four threads at once) is recorded, and `resmem replay`
//! replays each device's part of the trace under every policy.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{artifacts, run, Driver};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `c_examples/workload.c`, compiled once per test binary (never run while being written).
fn workload() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| compile_workload(false))
}

/// `c_examples/workload.c` linked against `libresmem.so` (found by its rpath), or with
/// `link_static` against `libresmem.a`: a setuid program runs as another user, who may not be
/// allowed into the folders above the shared library.
fn compile_workload(link_static: bool) -> PathBuf {
    let a = artifacts();
    let exe = a.work.join(if link_static {
        "workload-static"
    } else {
        "workload"
    });
    let source = root().join("c_examples/workload.c");
    let mut cmd = Command::new("gcc");
    cmd.args([
        "-std=c99",
        "-Wall",
        "-Wextra",
        "-pedantic",
        "-Werror",
        "-pthread",
    ])
    .arg("-I")
    .arg(root().join("include"))
    .arg(&source);
    common::link_resmem(&mut cmd, link_static);
    common::compile(cmd, &source, &exe)
}

/// The `resmem` command, built in the same profile.
fn resmem_command() -> PathBuf {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", "resmem-cli", "--bin", "resmem"]);
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let status = cmd.current_dir(root()).status().expect("run cargo build");
    assert!(status.success(), "cargo build -p resmem-cli failed");
    artifacts().lib_dir.join("resmem")
}

fn replay(trace: &Path, device: &str) -> String {
    let output = Command::new(resmem_command())
        .arg("replay")
        .arg(trace)
        .args(["--policy", "all", "--device", device])
        .output()
        .expect("run resmem replay");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn a_c_program_and_the_pytorch_entry_points_are_recorded_and_replayed() {
    let exe = workload();
    let dir = artifacts().work.join("recorded");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let conf = format!("record:{}/trace-%p.jsonl", dir.display());
    let out = run(
        exe,
        &[],
        Driver::InProcess,
        &[("RESMEM_CONF", &conf), ("CUDA_SIM_DEVICES", "1GiB,1GiB")],
    );
    assert_eq!(
        out,
        "4 threads x 5000 pairs, then a 1 PiB request: out of memory\n"
    );
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let trace = &files[0];
    let name = trace.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("trace-") && name.ends_with(".jsonl"),
        "{name}"
    );
    assert_ne!(name, "trace-%p.jsonl");

    let text = std::fs::read_to_string(trace).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // meta, warmup, 2 allocs, record_stream, the torch alloc / record_stream / free, a free,
    // 4 x 5000 pairs, a free, two empty_caches, the out-of-memory mark.
    assert_eq!(lines.len(), 1 + 1 + 2 + 1 + 3 + 1 + 40_000 + 1 + 2 + 1);
    assert!(lines[0].starts_with(
        r#"{"op":"meta","name":"recorded","device_memory":1073741824,"description":"recorded by resmem from process "#
    ));
    assert_eq!(lines[1], r#"{"op":"warmup","bytes":67108864,"device":0}"#);
    let count = |op: &str| lines.iter().filter(|l| l.contains(op)).count();
    assert_eq!(count(r#""op":"alloc""#), 3 + 20_000);
    assert_eq!(count(r#""op":"free""#), 3 + 20_000);
    assert_eq!(count(r#""op":"record_stream""#), 2);
    assert_eq!(
        lines[lines.len() - 3..],
        [
            r#"{"op":"empty_cache"}"#,
            r#"{"op":"empty_cache","device":0}"#,
            r#"{"op":"mark","label":"out of memory: 1125899906842624 bytes on device 0"}"#,
        ]
    );
    let torch: Vec<&&str> = lines
        .iter()
        .filter(|l| l.contains(r#""size":4194304,"stream":0,"device":1"#))
        .collect();
    assert_eq!(torch.len(), 1, "rm_torch_malloc's allocation");

    // Device 0: warmup, alloc, record_stream, free, 2 x 5000 pairs, 2 empty_caches, the mark.
    let zero = replay(trace, "0");
    assert!(
        zero.contains("20007 operations (10001 allocations) on a simulated 1.00 GiB device"),
        "{zero}"
    );
    // Device 1: 2 allocs, record_stream, 2 frees, 2 x 5000 pairs, one empty_cache, the mark
    // (a mark names no device, so every device's replay keeps it).
    let one = replay(trace, "1");
    assert!(
        one.contains("20007 operations (10002 allocations) on a simulated 1.00 GiB device"),
        "{one}"
    );
    // b (16 MiB) and the torch block (4 MiB) were live together on device 1, and no policy
    // ran out of memory on either device.
    let json = |device: &str| {
        let output = Command::new(resmem_command())
            .arg("replay")
            .arg(trace)
            .args(["--policy", "all", "--json", "--device", device])
            .output()
            .expect("run resmem replay --json");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let one = json("1");
    assert_eq!(
        one.matches(r#""peak_requested":20971520,"#).count(),
        3,
        "{one}"
    );
    for out in [json("0"), one] {
        assert_eq!(out.matches(r#""ooms":0,"#).count(), 3, "{out}");
    }
}

#[test]
fn a_file_that_cannot_be_written_leaves_the_program_running() {
    // The workload recording to `path` runs to the end; what it printed on stderr.
    let stderr_recording_to = |path: &str| {
        let conf = format!("record:{path}");
        let output = common::spawn(
            workload(),
            &[],
            Driver::InProcess,
            &[
                ("RESMEM_CONF", conf.as_ref()),
                ("CUDA_SIM_DEVICES", "1GiB,1GiB".as_ref()),
            ],
        );
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    assert_eq!(
        stderr_recording_to("/dev/full"),
        "resmem: recording to /dev/full stopped: No space left on device (os error 28); the \
         program goes on unrecorded\n"
    );
    assert_eq!(
        stderr_recording_to("/nonexistent/t.jsonl"),
        "resmem: cannot record to /nonexistent/t.jsonl: No such file or directory (os error 2); \
         not recording\n"
    );
}

#[test]
fn a_setuid_program_records_nothing() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making a setuid program needs root");
        return;
    }
    // Linked statically: the program runs as nobody, who may not be allowed into the folders
    // above the shared library (a checkout in a private temporary folder).
    let setuid = workload().with_file_name("workload-setuid");
    let _ = std::fs::remove_file(&setuid);
    std::fs::copy(compile_workload(true), &setuid).unwrap();
    std::os::unix::fs::chown(&setuid, Some(65534), None).unwrap();
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let dir = artifacts().work.join("recorded-setuid");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let conf = format!("record:{}/trace.jsonl", dir.display());
    let out = run(
        &setuid,
        &[],
        Driver::InProcess,
        &[("RESMEM_CONF", &conf), ("CUDA_SIM_DEVICES", "1GiB,1GiB")],
    );
    assert_eq!(
        out,
        "4 threads x 5000 pairs, then a 1 PiB request: out of memory\n"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // The program really ran privileged: a malformed RESMEM_CONF, an error otherwise, is ignored.
    let out = run(
        &setuid,
        &[],
        Driver::InProcess,
        &[
            ("RESMEM_CONF", "no_such_key:1"),
            ("CUDA_SIM_DEVICES", "1GiB,1GiB"),
        ],
    );
    assert_eq!(
        out,
        "4 threads x 5000 pairs, then a 1 PiB request: out of memory\n"
    );
}
