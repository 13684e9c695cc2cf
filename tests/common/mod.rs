//! What the integration tests share: the built libraries, and running a program against one of
//! the driver paths with a clean resmem environment.

#![allow(dead_code)]

pub mod hooks;
pub mod spy;
pub mod under;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

/// Where the built libraries are, and a scratch folder for compiled programs.
pub struct Artifacts {
    /// `target/<profile>`: holds `libresmem.so`, `libresmem.a`, `libcuda_sim.so` and
    /// `libresmem_preload.so`.
    pub lib_dir: PathBuf,
    /// `target/<profile>/c_examples`.
    pub work: PathBuf,
    /// `target/<profile>/c_examples/lib`: `libresmem.so` under its SONAME `libresmem.so.0` too,
    /// as an install lays it out; programs link and find it here.
    pub link_dir: PathBuf,
}

/// The libraries, built once per test binary. `cargo test` builds this package's own library,
/// but not the cdylibs of the simulator and preload packages, so those are built here.
pub fn artifacts() -> &'static Artifacts {
    static ARTIFACTS: OnceLock<Artifacts> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let exe = std::env::current_exe().expect("test binary path");
        let lib_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps/<test>")
            .to_path_buf();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "-p",
            "libcuda-sim",
            "-p",
            "resmem",
            "-p",
            "resmem-preload",
            "--lib",
        ]);
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let status = cmd
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build");
        assert!(
            status.success(),
            "cargo build -p libcuda-sim -p resmem -p resmem-preload --lib failed"
        );
        for lib in [
            "libresmem.so",
            "libresmem.a",
            "libcuda_sim.so",
            "libresmem_preload.so",
        ] {
            assert!(
                lib_dir.join(lib).exists(),
                "{lib} missing in {}",
                lib_dir.display()
            );
        }
        let work = lib_dir.join("c_examples");
        let link_dir = work.join("lib");
        std::fs::create_dir_all(&link_dir).expect("create the scratch folder");
        for name in ["libresmem.so", "libresmem.so.0"] {
            let link = link_dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(lib_dir.join("libresmem.so"), &link)
                .expect("link libresmem.so");
        }
        Artifacts {
            lib_dir,
            work,
            link_dir,
        }
    })
}

/// Add to `cmd` (a gcc or g++ command line) what links a program against the built library:
/// `libresmem.so` through `link_dir`, found at run time by an rpath; or with `link_static`,
/// `libresmem.a` and the system libraries it needs.
pub fn link_resmem(cmd: &mut Command, link_static: bool) {
    let a = artifacts();
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
}

/// The program `build` makes, made once per test binary under `key`: tests running at the same
/// time never run a program while another writes it (`ETXTBSY`, "Text file busy").
pub fn built_once(key: String, build: impl FnOnce() -> PathBuf) -> PathBuf {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    built.entry(key).or_insert_with(build).clone()
}

/// Run the compiler command `cmd` that writes `out`; panics with its messages if it fails.
pub fn compile(mut cmd: Command, what: &Path, out: &Path) -> PathBuf {
    let output = cmd
        .arg("-o")
        .arg(out)
        .output()
        .expect("a C compiler (gcc, g++) is installed");
    assert!(
        output.status.success(),
        "compiling {} failed:\n{}",
        what.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    out.to_path_buf()
}

/// Which driver a program runs against.
#[derive(Clone, Debug)]
pub enum Driver {
    /// `RESMEM_DRIVER=sim`: the simulated devices inside libresmem.
    InProcess,
    /// The default CUDA path, loading `libcuda_sim.so` through `RESMEM_CUDA_LIBRARY`.
    SimLibrary,
    /// The CUDA path, loading this library.
    Library(String),
}

/// Run `exe` with `args` against `driver` on one simulated 24 GiB device (plus `env`), and
/// return its standard output; panics with both outputs if it fails.
pub fn run(exe: &Path, args: &[&str], driver: Driver, env: &[(&str, &str)]) -> String {
    let env: Vec<(&str, &OsStr)> = env.iter().map(|&(k, v)| (k, OsStr::new(v))).collect();
    let output = spawn(exe, args, driver.clone(), &env);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{} {args:?} against {driver:?} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        exe.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Run `exe` as [`run`] does, with variables that need not be UTF-8, and return what it did.
pub fn spawn(exe: &Path, args: &[&str], driver: Driver, env: &[(&str, &OsStr)]) -> Output {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("RESMEM_") || key.starts_with("CUDA_SIM_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("CUDA_SIM_DEVICES", "24GiB");
    match &driver {
        Driver::InProcess => {
            cmd.env("RESMEM_DRIVER", "sim");
        }
        Driver::SimLibrary => {
            cmd.env(
                "RESMEM_CUDA_LIBRARY",
                artifacts().lib_dir.join("libcuda_sim.so"),
            );
        }
        Driver::Library(path) => {
            cmd.env("RESMEM_CUDA_LIBRARY", path);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("run the program")
}
