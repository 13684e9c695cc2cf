//! `libresmem_preload.so` under `LD_PRELOAD`, against the simulated driver (`libcuda_sim.so`) and
//! a stand-in `libcudart.so.12` that reaches the driver through its own handle, as the real
//! runtime does. The program (`tests/preload/check.c`) links both and knows nothing of resmem.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{artifacts, compile, link_resmem};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn gcc(args: &[&str]) {
    let output = Command::new("gcc")
        .args(args)
        .output()
        .expect("gcc is installed");
    assert!(
        output.status.success(),
        "gcc {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The check program, linked against `libcuda_sim.so` and the stand-in `libcudart.so.12`.
fn program() -> &'static PathBuf {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(|| {
        let a = artifacts();
        let dir = a.work.join("preload");
        std::fs::create_dir_all(&dir).unwrap();
        let s = |p: &Path| p.to_str().unwrap().to_string();
        let cudart = dir.join("libcudart.so.12");
        let src = root().join("tests/preload");
        let flags = ["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror"];
        let mut args: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        args.extend([
            "-shared".into(),
            "-fPIC".into(),
            s(&src.join("fake_cudart.c")),
            "-ldl".into(),
            "-o".into(),
            s(&cudart),
        ]);
        gcc(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let exe = dir.join("check");
        let mut args: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        args.extend([
            s(&src.join("check.c")),
            s(&cudart),
            s(&a.lib_dir.join("libcuda_sim.so")),
            format!("-Wl,-rpath,{}:{}", s(&dir), s(&a.lib_dir)),
            "-ldl".into(),
            "-o".into(),
            s(&exe),
        ]);
        gcc(&args.iter().map(String::as_str).collect::<Vec<_>>());
        exe
    })
}

/// `tests/preload/linked.c`, linked against `libresmem.so.0` and the stand-in `libcudart.so.12`.
fn linked_program() -> &'static PathBuf {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(|| {
        let dir = program().parent().unwrap().to_path_buf();
        let source = root().join("tests/preload/linked.c");
        let mut cmd = Command::new("gcc");
        cmd.args(["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I"])
            .arg(root().join("include"))
            .arg(&source)
            .arg(dir.join("libcudart.so.12"))
            .arg(format!("-Wl,-rpath,{}", dir.display()));
        link_resmem(&mut cmd, false);
        cmd.arg("-ldl");
        compile(cmd, &source, &dir.join("linked"))
    })
}

/// Run `exe` with `args`, with the preload object or not, and `RESMEM_CONF`; return stdout.
fn run(exe: &Path, args: &[&str], preload: bool, conf: &str) -> String {
    let a = artifacts();
    let sim = a.lib_dir.join("libcuda_sim.so");
    let mut cmd = Command::new(exe);
    cmd.args(args);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("RESMEM_") || key.starts_with("CUDA_SIM_") || key == "LD_PRELOAD" {
            cmd.env_remove(key);
        }
    }
    cmd.env("CUDA_SIM_DEVICES", "24GiB")
        .env("RESMEM_CUDA_LIBRARY", &sim)
        .env("FAKE_CUDART_DRIVER", &sim)
        .env("RESMEM_CONF", conf);
    if preload {
        cmd.env("LD_PRELOAD", a.lib_dir.join("libresmem_preload.so"));
    }
    let output = cmd.output().expect("run the program");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        exe.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// What the program's `cuIpcGetMemHandle` and `cudaIpcGetMemHandle` answered for the blocks it
/// got from `cuMemAlloc_v2` and `cudaMalloc`: `0` (a handle), `1` (invalid value: refused).
fn assert_ipc_answers(out: &str, answer: i32) {
    for line in [
        format!("cuIpcGetMemHandle of the cuMemAlloc_v2 block: {answer}\n"),
        format!("cudaIpcGetMemHandle of the cudaMalloc block: {answer}\n"),
    ] {
        assert!(out.contains(&line), "{line}: {out}");
    }
}

/// The figures of the line starting with `when`: (cuMemGetInfo_v2 free, cudaMemGetInfo free,
/// driver used), in MiB.
fn figures(out: &str, when: &str) -> (u64, u64, u64) {
    let line = out
        .lines()
        .find(|l| l.starts_with(when))
        .unwrap_or_else(|| panic!("no line {when:?} in:\n{out}"));
    let numbers: Vec<u64> = line[when.len()..]
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(numbers.len(), 3, "{line}");
    (numbers[0], numbers[1], numbers[2])
}

const DEVICE_MIB: u64 = 24 * 1024;

#[test]
fn without_the_preload_the_program_sees_the_driver() {
    let out = run(program(), &[], false, "");
    assert!(out.contains("resmem is not in the process"), "{out}");
    assert_eq!(figures(&out, "start"), (DEVICE_MIB, DEVICE_MIB, 0));
    assert_eq!(
        figures(&out, "128 MiB cuMemAlloc_v2 live"),
        (DEVICE_MIB - 128, DEVICE_MIB - 128, 128)
    );
    assert_eq!(figures(&out, "after cudaFree"), (DEVICE_MIB, DEVICE_MIB, 0));
    assert_ipc_answers(&out, 0);
    assert!(out.contains("passed: 0 failure(s)"), "{out}");
}

#[test]
fn memory_info_counts_reusable_memory_as_free() {
    let out = run(program(), &[], true, "");
    assert_eq!(figures(&out, "start"), (DEVICE_MIB, DEVICE_MIB, 0));
    // 64 MiB held by the pool and unused: the driver has 64 MiB out, both APIs report all free.
    assert_eq!(
        figures(&out, "after rm_reserve+rm_release"),
        (DEVICE_MIB, DEVICE_MIB, 64)
    );
    // Allocations are not routed unless asked: cuMemAlloc_v2 goes to the driver.
    assert_eq!(
        figures(&out, "128 MiB cuMemAlloc_v2 live"),
        (DEVICE_MIB - 128, DEVICE_MIB - 128, 192)
    );
    assert_eq!(
        figures(&out, "after cudaFree"),
        (DEVICE_MIB, DEVICE_MIB, 64)
    );
    // Memory the driver handed out keeps its IPC handles.
    assert_ipc_answers(&out, 0);
    // The 32-bit form caps both figures at UINT_MAX.
    assert!(
        out.contains("cuMemGetInfo (32-bit) free 4294967295 total 4294967295"),
        "{out}"
    );
    assert!(out.contains("passed: 0 failure(s)"), "{out}");
}

#[test]
fn preload_allocations_routes_malloc_and_free_through_the_pool() {
    let out = run(program(), &[], true, "preload_allocations:true");
    assert_eq!(
        figures(&out, "after rm_reserve+rm_release"),
        (DEVICE_MIB, DEVICE_MIB, 64)
    );
    // cuMemAlloc_v2 of 128 MiB: the cached 64 MiB segment is half of it, so its pages are
    // mapped again into the new range and the pool creates only the other 64 MiB.
    assert_eq!(
        figures(&out, "128 MiB cuMemAlloc_v2 live"),
        (DEVICE_MIB - 128, DEVICE_MIB - 128, 128)
    );
    // cuMemFree_v2 gives it back to the pool, not to the driver: still all free.
    assert_eq!(
        figures(&out, "after cuMemFree_v2"),
        (DEVICE_MIB, DEVICE_MIB, 128)
    );
    // cudaMalloc of 32 MiB is served from the cache: the driver hands out nothing more.
    assert_eq!(
        figures(&out, "32 MiB cudaMalloc live"),
        (DEVICE_MIB - 32, DEVICE_MIB - 32, 128)
    );
    assert_eq!(
        figures(&out, "after cudaFree"),
        (DEVICE_MIB, DEVICE_MIB, 128)
    );
    // cudaMalloc of 256 MiB while a stream captures, in the relaxed capture mode: the cached
    // 128 MiB would be half of it, but mapping it into the new range waits for the work that
    // released it, which the driver refuses during a capture (and the capture with it). The
    // 256 MiB are new, and the capture ends cleanly.
    assert_eq!(
        figures(&out, "256 MiB cudaMalloc captured"),
        (DEVICE_MIB - 256, DEVICE_MIB - 256, 384)
    );
    // A block of the pool gets no IPC handle: a handle names a whole allocation (here a
    // mapped range, which legacy IPC cannot export; with classic segments the other process
    // would open the segment's start instead of the block).
    assert_ipc_answers(&out, 1);
    assert!(out.contains("passed: 0 failure(s)"), "{out}");
}

/// With classic segments the driver would give the pool's blocks an IPC handle, of the whole
/// segment: the process opening it would read the segment's start, not the block. Refused.
#[test]
fn blocks_of_classic_segments_get_no_ipc_handle_either() {
    let out = run(program(), &[], true, "preload_allocations:true,vmm:false");
    assert_ipc_answers(&out, 1);
    assert!(out.contains("passed: 0 failure(s)"), "{out}");
}

/// A program linked against `libresmem.so.0` and run with the preload object: the preload
/// exports the `rm_*` API under that SONAME, so the loader binds the program's calls to the
/// preload's pool instead of loading a second library with a second pool (which would count the
/// first one's cache as used, and the first the second's): the block it reserves and the one the
/// preload routes are one pool's. Without the preload, its own library serves it alone.
#[test]
fn a_program_linked_against_the_library_shares_the_preloads_pool() {
    let exe = linked_program();
    let out = run(exe, &[], true, "preload_allocations:true");
    assert!(out.contains("live blocks 2\n"), "{out}");
    assert!(
        out.contains("rm_reserve in libresmem_preload.so\n"),
        "{out}"
    );
    assert!(out.contains("linked: 0 failure(s)"), "{out}");
    let out = run(exe, &[], false, "");
    assert!(out.contains("live blocks 1\n"), "{out}");
    assert!(out.contains("rm_reserve in libresmem.so.0\n"), "{out}");
    assert!(out.contains("linked: 0 failure(s)"), "{out}");
}

#[test]
fn a_program_that_never_touches_cuda_loads_nothing() {
    // /proc/self/maps of `cat` itself: the preload object is mapped, no CUDA library is, and a
    // driver path that does not exist changes nothing.
    let a = artifacts();
    for driver in [
        a.lib_dir.join("libcuda_sim.so"),
        PathBuf::from("/nonexistent/libcuda.so.1"),
    ] {
        let output = Command::new("cat")
            .arg("/proc/self/maps")
            .env("LD_PRELOAD", a.lib_dir.join("libresmem_preload.so"))
            .env("RESMEM_CUDA_LIBRARY", &driver)
            .env("RESMEM_CONF", "preload_allocations:true")
            .output()
            .expect("run cat");
        assert!(output.status.success());
        assert!(output.stderr.is_empty(), "{:?}", output.stderr);
        let maps = String::from_utf8_lossy(&output.stdout);
        assert!(maps.contains("libresmem_preload.so"), "{maps}");
        assert!(!maps.contains("libcuda"), "{maps}");
    }
}

/// `RESMEM_CUDA_LIBRARY` in a privileged program that loads the preload object: a setgid
/// program (the kernel sets `AT_SECURE`; setgid to another group keeps root's file access, so
/// the program can still read the build tree) must not load the library it names, while the
/// same program unprivileged does.
#[test]
fn a_privileged_program_ignores_resmem_cuda_library() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making a setgid program needs root");
        return;
    }
    let a = artifacts();
    let dir = a.work.join("preload-secure");
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let src = root().join("tests/preload");
    let hostile = dir.join("libhostile.so");
    gcc(&[
        "-shared",
        "-fPIC",
        &s(&src.join("hostile_driver.c")),
        "-o",
        &s(&hostile),
    ]);
    let exe = dir.join("secure");
    gcc(&[
        "-std=c99",
        "-Wall",
        "-Wextra",
        "-Werror",
        &s(&src.join("secure.c")),
        "-ldl",
        "-o",
        &s(&exe),
    ]);
    let setgid = dir.join("secure-setgid");
    std::fs::copy(&exe, &setgid).unwrap();
    std::os::unix::fs::chown(&setgid, None, Some(65534)).unwrap();
    std::fs::set_permissions(&setgid, std::fs::Permissions::from_mode(0o2755)).unwrap();
    let run = |exe: &Path| {
        let out = Command::new(exe)
            .arg(a.lib_dir.join("libresmem_preload.so"))
            .env_clear()
            .env("RESMEM_CUDA_LIBRARY", &hostile)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let plain = run(&exe);
    assert!(plain.contains("hostile library loaded"), "{plain}");
    assert!(plain.contains("secure 0,"), "{plain}");
    let privileged = run(&setgid);
    assert!(privileged.contains("secure 1,"), "{privileged}");
    assert!(!privileged.contains("hostile"), "{privileged}");
}

#[test]
fn an_unmodified_program_is_recorded_through_the_preload() {
    let trace = artifacts()
        .work
        .join(format!("preload-trace-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&trace);
    let conf = format!("preload_allocations:true,record:{}", trace.display());
    let out = run(program(), &[], true, &conf);
    assert!(out.contains("passed: 0 failure(s)"), "{out}");
    let text = std::fs::read_to_string(&trace).unwrap();
    std::fs::remove_file(&trace).unwrap();
    // Each line's operation and size: rm_reserve + rm_release of 64 MiB, then cuMemAlloc_v2 of
    // 128 MiB, cudaMalloc of 32 MiB and of 256 MiB (during a capture), each freed, all through
    // the pool on device 0.
    let ops: Vec<String> = text
        .lines()
        .skip(1)
        .map(|l| {
            let op = l.split('"').nth(3).unwrap_or_default();
            let size = l
                .split("\"size\":")
                .nth(1)
                .map(|s| s.split(',').next().unwrap_or_default())
                .unwrap_or("-");
            format!("{op} {size}")
        })
        .collect();
    assert_eq!(
        ops,
        [
            "alloc 67108864",
            "free -",
            "alloc 134217728",
            "free -",
            "alloc 33554432",
            "free -",
            "alloc 268435456",
            "free -"
        ],
        "{text}"
    );
    assert!(text.starts_with(r#"{"op":"meta","name":"recorded","device_memory":25769803776,"#));
}
