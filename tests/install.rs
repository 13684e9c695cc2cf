//! `scripts/install.sh` lays out a prefix that C and C++ build systems find, and the README's
//! routes work exactly as written: the CMake package (`find_package(resmem)` →
//! `resmem::resmem`) builds `examples/cpp` and the pkg-config line builds `examples/c/app.c`;
//! both programs find `libresmem.so.0` through their run path and run, with no
//! `LD_LIBRARY_PATH`, against the simulated devices.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{artifacts, run, Driver};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn ok(cmd: &mut Command) -> String {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?} did not start ({e}); is it installed?"));
    assert!(
        output.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A fresh prefix with the built libraries installed, once per test binary.
fn prefix() -> &'static PathBuf {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let a = artifacts();
        let prefix = a.work.join("prefix");
        let _ = std::fs::remove_dir_all(&prefix);
        ok(Command::new("bash")
            .arg(root().join("scripts/install.sh"))
            .arg("--prefix")
            .arg(&prefix)
            .arg("--from")
            .arg(&a.lib_dir));
        prefix
    })
}

#[test]
fn the_prefix_holds_the_libraries_under_their_soname() {
    let lib = prefix().join("lib");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        std::fs::read_link(lib.join("libresmem.so")).unwrap(),
        Path::new("libresmem.so.0")
    );
    assert_eq!(
        std::fs::read_link(lib.join("libresmem.so.0")).unwrap(),
        PathBuf::from(format!("libresmem.so.{version}"))
    );
    for file in [
        format!("lib/libresmem.so.{version}"),
        "lib/libresmem.a".into(),
        "lib/libresmem_preload.so".into(),
        "include/resmem.h".into(),
        "lib/pkgconfig/resmem.pc".into(),
        "lib/cmake/resmem/resmemConfig.cmake".into(),
        "lib/cmake/resmem/resmemConfigVersion.cmake".into(),
    ] {
        assert!(prefix().join(&file).is_file(), "{file} is missing");
    }
    let header = std::fs::read(prefix().join("include/resmem.h")).unwrap();
    assert_eq!(
        header,
        std::fs::read(root().join("include/resmem.h")).unwrap()
    );
}

#[test]
fn cmake_builds_the_cpp_engine_with_find_package() {
    let build = artifacts().work.join("cpp-build");
    let _ = std::fs::remove_dir_all(&build);
    ok(Command::new("cmake")
        .arg("-S")
        .arg(root().join("examples/cpp"))
        .arg("-B")
        .arg(&build)
        .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix().display())));
    ok(Command::new("cmake").arg("--build").arg(&build));
    let engine = build.join("engine");
    let ldd = ok(Command::new("ldd")
        .arg(&engine)
        .env_remove("LD_LIBRARY_PATH"));
    let expected = format!(
        "libresmem.so.0 => {}",
        prefix().join("lib/libresmem.so.0").display()
    );
    assert!(ldd.contains(&expected), "{ldd}");
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let out = run(&engine, &[], driver, &[]);
        // 32 x 48 MiB weights in one warm-up segment, 32 x 8 KiB norms in a 2 MiB small range
        // made from the warm-up's free tail.
        for load in 1..=4 {
            let line = format!(
                "load {load}: 64 tensors, allocated 1536 MiB, reserved 1538 MiB, free 23039 of 24576 MiB"
            );
            assert!(out.contains(&line), "{line}\n{out}");
        }
        assert!(
            out.contains(
                "after 4 loads: peak reserved 1538 MiB, 1 driver allocations, 255 of 256 \
                 reservations served from cache"
            ),
            "{out}"
        );
        assert!(
            out.contains("a 1 PiB buffer: RM_ERROR_OUT_OF_MEMORY"),
            "{out}"
        );
    }
}

#[test]
fn pkg_config_gives_the_flags_to_build_and_start_a_c_program() {
    let flags = ok(Command::new("pkg-config")
        .args(["--cflags", "--libs", "resmem"])
        .env("PKG_CONFIG_PATH", prefix().join("lib/pkgconfig")));
    let p = prefix().display().to_string();
    assert_eq!(
        flags.trim(),
        format!("-I{p}/include -L{p}/lib -Wl,-rpath,{p}/lib -lresmem")
    );
    // The README's line: `cc app.c $(pkg-config --cflags --libs resmem)`, nothing more.
    let exe = artifacts().work.join("app-pkg-config");
    ok(Command::new("cc")
        .arg(root().join("examples/c/app.c"))
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(&exe));
    let ldd = ok(Command::new("ldd").arg(&exe).env_remove("LD_LIBRARY_PATH"));
    assert!(
        ldd.contains(&format!("libresmem.so.0 => {p}/lib/libresmem.so.0")),
        "{ldd}"
    );
    let out = ok(Command::new(&exe)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("RESMEM_CONF")
        .env_remove("RESMEM_CUDA_LIBRARY")
        .env("RESMEM_DRIVER", "sim")
        .env("CUDA_SIM_DEVICES", "24GiB"));
    assert_eq!(
        out,
        format!(
            "resmem {}: free 25769803776 of 25769803776 bytes, reserved 67108864, 1 driver \
             allocation(s)\nreturned 67108864 bytes to the driver\n",
            env!("CARGO_PKG_VERSION")
        )
    );
}
