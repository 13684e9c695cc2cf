//! Compiles the C programs in `c_examples/` against `include/resmem.h` and the built library,
//! warning-free under strict flags, and runs them against both simulator paths: the in-process
//! simulator (`RESMEM_DRIVER=sim`) and `libcuda_sim.so` loaded as the driver library through
//! `RESMEM_CUDA_LIBRARY`, exactly as `libcuda.so.1` would be.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{artifacts, run, spawn, Driver};

const C_FLAGS: &[&str] = &["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror"];
const CXX_FLAGS: &[&str] = &["-std=c++17", "-Wall", "-Wextra", "-Werror"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Compile `c_examples/<name>.c` (as C, or as C++ with `cxx`), linked against the shared or the
/// static library; once per test binary, so that tests running at the same time never run a
/// program while another writes it.
fn compile(name: &str, cxx: bool, link_static: bool) -> PathBuf {
    common::built_once(format!("{name} {cxx} {link_static}"), || {
        compile_now(name, cxx, link_static)
    })
}

fn compile_now(name: &str, cxx: bool, link_static: bool) -> PathBuf {
    let a = artifacts();
    let out = a.work.join(format!(
        "{name}{}{}",
        if cxx { "-cxx" } else { "" },
        if link_static { "-static" } else { "" }
    ));
    let source = root().join("c_examples").join(format!("{name}.c"));
    let mut cmd = Command::new(if cxx { "g++" } else { "gcc" });
    if cxx {
        cmd.args(["-x", "c++"]).args(CXX_FLAGS);
    } else {
        cmd.args(C_FLAGS);
    }
    cmd.arg("-I").arg(root().join("include")).arg(&source);
    if cxx {
        cmd.args(["-x", "none"]);
    }
    common::link_resmem(&mut cmd, link_static);
    common::compile(cmd, &source, &out)
}

#[test]
fn quickstart_runs_on_both_simulator_paths() {
    let exe = compile("quickstart", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let out = run(&exe, &[], driver, &[]);
        assert!(
            out.contains("reserved 67108864, reusable 67108864"),
            "{out}"
        );
        assert!(
            out.contains("returned 67108864 bytes to the driver"),
            "{out}"
        );
    }
}

#[test]
fn the_header_compiles_as_cxx17_and_the_static_library_links() {
    let cxx = compile("quickstart", true, false);
    run(&cxx, &[], Driver::SimLibrary, &[]);
    let static_exe = compile("quickstart", false, true);
    run(&static_exe, &[], Driver::InProcess, &[]);
}

#[test]
fn loader_keeps_reserved_at_the_model_size_over_four_loads() {
    let exe = compile("loader", false, false);
    // The default: the small tensors' 2 MiB range is made from the warm-up's free tail, so the
    // model rounded to pages is all; classic segments add a 2 MiB small segment.
    let cases = [
        (
            "",
            "7.49 GiB",
            "peak reserved 7.49 GiB (1.0002 x the model), 1 driver allocations",
        ),
        (
            "vmm:false",
            "7.50 GiB",
            "peak reserved 7.50 GiB (1.0005 x the model), 2 driver allocations",
        ),
    ];
    for (conf, reserved, summary) in cases {
        for driver in [Driver::InProcess, Driver::SimLibrary] {
            let out = run(&exe, &[], driver, &[("RESMEM_CONF", conf)]);
            assert!(
                out.contains(
                    "model: 4022468096 parameters, 8044936192 bytes (7.49 GiB) in 398 tensors"
                ),
                "{out}"
            );
            let rows: Vec<&str> = out
                .lines()
                .filter(|l| {
                    l.split_whitespace()
                        .next()
                        .is_some_and(|w| w.parse::<u32>().is_ok())
                })
                .collect();
            assert_eq!(rows.len(), 4, "{out}");
            for row in rows {
                // Every load sees the whole 24 GiB device as free: no offload.
                assert!(row.contains("24.00 GiB"), "{row}");
                assert!(row.contains(reserved), "{conf}: {row}");
                assert!(row.trim_end().ends_with("no"), "{row}");
            }
            assert!(out.contains(summary), "{conf}: {out}");
        }
    }
}

#[test]
fn errors_reports_every_failure_with_its_status_and_message() {
    let exe = compile("errors", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let out = run(&exe, &[], driver, &[]);
        assert!(out.contains("passed: 0 failure(s)"), "{out}");
    }
}

#[test]
fn the_programs_pass_with_classic_segments_too() {
    for name in ["quickstart", "loader", "errors"] {
        let exe = compile(name, false, false);
        for driver in [Driver::InProcess, Driver::SimLibrary] {
            let out = run(&exe, &[], driver, &[("RESMEM_CONF", "vmm:false")]);
            assert!(!out.contains("FAIL"), "{out}");
        }
    }
}

#[test]
fn errors_without_a_usable_driver() {
    let exe = compile("errors", false, false);
    run(
        &exe,
        &["no-driver"],
        Driver::Library("/nonexistent/libcuda.so.1".into()),
        &[],
    );
    run(
        &exe,
        &["bad-driver"],
        Driver::Library("libm.so.6".into()),
        &[],
    );
    run(
        &exe,
        &["bad-conf"],
        Driver::InProcess,
        &[("RESMEM_CONF", "no_such_key:1")],
    );
}

#[test]
fn hostile_input_gets_its_documented_status_and_changes_nothing() {
    let exe = compile("hostile", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let two = ("CUDA_SIM_DEVICES", "4GiB,4GiB");
        let out = run(&exe, &[], driver.clone(), &[two]);
        assert!(
            out.contains("hostile inputs: ") && out.contains(", 0 failure(s)"),
            "{out}"
        );
        // `RESMEM_TEST_PANIC` forces a panic in a debug build of the library alone (the tests
        // build it in their own profile).
        if cfg!(debug_assertions) {
            let out = run(
                &exe,
                &["panic"],
                driver.clone(),
                &[("RESMEM_TEST_PANIC", "rm_reserve")],
            );
            assert!(out.contains(", 0 failure(s)"), "{out}");
        }
        // Classic segments: cuMemAlloc_v2 is what fails.
        let faults = "cuMemAlloc_v2@1=719,cuMemAlloc_v2@2=2,cuMemAlloc_v2@3=2";
        let env = [("CUDA_SIM_FAULTS", faults), ("RESMEM_CONF", "vmm:false")];
        let out = run(&exe, &["faults"], driver, &env);
        assert!(out.contains(", 0 failure(s)"), "{out}");
    }
}

#[test]
fn hostile_input_with_stitched_segments_too() {
    let exe = compile("hostile", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let env = [
            ("CUDA_SIM_DEVICES", "4GiB,4GiB"),
            ("RESMEM_CONF", "vmm:true"),
        ];
        let out = run(&exe, &[], driver.clone(), &env);
        assert!(
            out.contains("hostile inputs: ") && out.contains(", 0 failure(s)"),
            "{out}"
        );
        // The first chunk creation fails with a launch failure, the next two run out of memory.
        // Through the loaded library the first cuMemCreate is the driver's check that it maps
        // at offsets into an allocation (`driver/cuda.rs`), before the pool's first growth.
        let faults = match driver {
            Driver::InProcess => "cuMemCreate@1=719,cuMemCreate@2=2,cuMemCreate@3=2",
            _ => "cuMemCreate@2=719,cuMemCreate@3=2,cuMemCreate@4=2",
        };
        let env = [("CUDA_SIM_FAULTS", faults), ("RESMEM_CONF", "vmm:true")];
        let out = run(&exe, &["faults", "cuMemCreate"], driver, &env);
        assert!(out.contains(", 0 failure(s)"), "{out}");
    }
}

#[test]
fn hostile_resmem_conf_is_refused_with_a_short_message() {
    let exe = compile("hostile", false, false);
    let long = "x".repeat(100_000);
    let long_value = format!("logging:{}", "1".repeat(100_000));
    let cases: Vec<(&OsStr, u32)> = vec![
        (OsStr::new(""), 0),
        (OsStr::new(" , ,, "), 0),
        (OsStr::new("logging:false, release_before_grow:OFF"), 0),
        (OsStr::new(&long), 1),
        (OsStr::new(&long_value), 1),
        (OsStr::from_bytes(b"logging:\xff\xfe"), 1),
        (OsStr::from_bytes(b"\xc3\x28:true"), 1),
        (OsStr::new("max_split_size_mb:128"), 1),
        (OsStr::new("logging:2"), 1),
        (OsStr::new("release_before_grow:-1"), 1),
        (OsStr::new("logging:true:false"), 1),
        (OsStr::new("logging=true"), 1),
        (OsStr::new("logging:true,logging:true"), 1),
        (OsStr::new("logging:tr\u{fc}e"), 1),
    ];
    for (conf, status) in cases {
        let out = spawn(
            &exe,
            &["expect", &status.to_string()],
            Driver::InProcess,
            &[("RESMEM_CONF", conf)],
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "RESMEM_CONF={conf:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if status != 0 {
            assert!(text.contains("RESMEM_CONF"), "{text}");
        }
    }
}

#[test]
fn a_setuid_program_ignores_resmem_conf() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making a setuid program needs root");
        return;
    }
    let exe = compile("hostile", false, true);
    let setuid = exe.with_file_name("hostile-setuid");
    std::fs::copy(&exe, &setuid).unwrap();
    std::os::unix::fs::chown(&setuid, Some(65534), None).unwrap();
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let conf = [("RESMEM_CONF", OsStr::new("no_such_key:1"))];
    // Not privileged: the malformed RESMEM_CONF is an error ...
    let out = spawn(&exe, &["expect", "1"], Driver::InProcess, &conf);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // ... setuid (AT_SECURE): it is ignored, as secure_getenv would.
    let out = spawn(&setuid, &["expect", "0"], Driver::InProcess, &conf);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_export_works_from_thread_exit_destructors_and_atexit_handlers() {
    let exe = compile("exit", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        for conf in ["", "vmm:true"] {
            let out = spawn(
                &exe,
                &[],
                driver.clone(),
                &[("RESMEM_CONF", OsStr::new(conf))],
            );
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            let what = format!("{driver:?} {conf:?}: {}\n{stdout}{stderr}", out.status);
            assert!(out.status.success(), "{what}");
            assert!(
                stdout.contains("exit in thread destructor: 0 failure(s)")
                    && stdout.contains("exit in atexit handler: 0 failure(s)"),
                "{what}"
            );
            // Neither the library nor the simulated driver says anything.
            assert_eq!(stderr, "", "{what}");
        }
    }
}

#[test]
fn one_thread_per_device_returning_memory_keeps_every_block_known() {
    let exe = compile("devices", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        for conf in ["", "vmm:true"] {
            let env = [("CUDA_SIM_DEVICES", "2GiB,2GiB"), ("RESMEM_CONF", conf)];
            let out = run(&exe, &["5000"], driver.clone(), &env);
            assert!(
                out.contains("devices: 2 threads, 5000 rounds each; 0 failure(s)"),
                "{out}"
            );
        }
    }
}

#[test]
fn loading_and_unloading_the_library_does_not_grow_the_process() {
    let exe = compile("unload", false, false);
    let library = artifacts().lib_dir.join("libresmem.so");
    let library = library.to_str().unwrap();
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        for conf in ["", "vmm:true"] {
            let out = run(
                &exe,
                &[library, "220"],
                driver.clone(),
                &[("RESMEM_CONF", conf)],
            );
            assert!(
                out.contains("unload: 220 cycles") && out.contains("; 0 failure(s)"),
                "{out}"
            );
        }
    }
}

#[test]
fn a_forked_child_gets_a_clear_error_and_the_parent_goes_on() {
    let exe = compile("fork", false, false);
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let out = run(&exe, &[], driver, &[]);
        assert!(out.contains("fork: 0 failure(s)"), "{out}");
        assert!(out.contains("ok   child after start: rm_reserve"), "{out}");
    }
}

#[test]
fn logging_says_once_how_the_front_caches_hits_fence() {
    let exe = compile("quickstart", false, false);
    let out = spawn(
        &exe,
        &[],
        Driver::InProcess,
        &[("RESMEM_CONF", OsStr::new("logging:true"))],
    );
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("resmem: front caches: "))
        .collect();
    // Which of the two depends on whether the kernel lets the process register for membarrier.
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        [
            "resmem: front caches: no fence on a hit (membarrier: the drains fence every thread)",
            "resmem: front caches: a full fence on every hit (membarrier is refused here: kernels \
             before 4.14, a seccomp filter, valgrind)"
        ]
        .contains(&lines[0]),
        "{err}"
    );
}
