//! Compiles the C programs in `c_examples/` against `include/resmem.h` and the built library,
//! warning-free under strict flags, and runs them against both simulator paths: the in-process
//! simulator (`RESMEM_DRIVER=sim`) and `libcuda_sim.so` loaded as the driver library through
//! `RESMEM_CUDA_LIBRARY`, exactly as `libcuda.so.1` would be.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use common::{artifacts, run, Driver};

const C_FLAGS: &[&str] = &["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror"];
const CXX_FLAGS: &[&str] = &["-std=c++17", "-Wall", "-Wextra", "-Werror"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Compile `c_examples/<name>.c` (as C, or as C++ with `cxx`), linked against the shared or the
/// static library.
fn compile(name: &str, cxx: bool, link_static: bool) -> PathBuf {
    // Tests run in parallel and share programs: compile each once, so that none is rewritten
    // while another test runs it.
    type Compiled = Vec<((String, bool, bool), PathBuf)>;
    static COMPILED: Mutex<Compiled> = Mutex::new(Vec::new());
    let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    let key = (name.to_string(), cxx, link_static);
    if let Some((_, path)) = compiled.iter().find(|(k, _)| *k == key) {
        return path.clone();
    }
    let path = compile_now(name, cxx, link_static);
    compiled.push((key, path.clone()));
    path
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
    if link_static {
        cmd.arg(a.lib_dir.join("libresmem.a")).args([
            "-lpthread",
            "-ldl",
            "-lm",
            "-lrt",
            "-lutil",
            "-lgcc_s",
            "-lc",
        ]);
    } else {
        cmd.arg("-L")
            .arg(&a.link_dir)
            .arg("-lresmem")
            .arg(format!("-Wl,-rpath,{}", a.link_dir.display()));
    }
    cmd.arg("-o").arg(&out);
    let output = cmd.output().expect("a C compiler (gcc, g++) is installed");
    assert!(
        output.status.success(),
        "compiling {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    out
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
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let out = run(&exe, &[], driver, &[]);
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
            // Every load sees the whole 24 GiB device as free and reserves 7.50 GiB (the model
            // rounded to pages, plus one 2 MiB segment of small tensors): no offload.
            assert!(row.contains("24.00 GiB"), "{row}");
            assert!(row.contains("7.50 GiB"), "{row}");
            assert!(row.trim_end().ends_with("no"), "{row}");
        }
        assert!(
            out.contains("peak reserved 7.50 GiB (1.0005 x the model), 2 driver allocations"),
            "{out}"
        );
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
fn the_programs_pass_with_virtual_memory_stitching_too() {
    for name in ["quickstart", "loader", "errors"] {
        let exe = compile(name, false, false);
        for driver in [Driver::InProcess, Driver::SimLibrary] {
            let out = run(&exe, &[], driver, &[("RESMEM_CONF", "vmm:true")]);
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
