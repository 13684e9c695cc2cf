//! Processes sharing a device give each other their idle cache: real processes (the C program
//! `c_examples/share.c`) on one simulated 24 GiB device whose capacity they share through
//! `CUDA_SIM_SHARED`, with their registry in a scratch directory (`RESMEM_SHARE_DIR`).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::artifacts;

const GIB: u64 = 1 << 30;

/// `c_examples/share.c`, compiled once per test binary.
fn program() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let a = artifacts();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = a.work.join("share");
        let source = root.join("c_examples/share.c");
        let mut cmd = Command::new("gcc");
        cmd.args(["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I"])
            .arg(root.join("include"))
            .arg(&source);
        common::link_resmem(&mut cmd, false);
        common::compile(cmd, &source, &out)
    })
}

/// One test's shared device and registry directory.
struct Device {
    dir: PathBuf,
}

/// How a process reaches the simulated device.
#[derive(Clone, Copy)]
enum Path_ {
    /// `RESMEM_DRIVER=sim`: the simulator inside libresmem.
    InProcess,
    /// `libcuda_sim.so` loaded as the CUDA driver.
    Library,
}

impl Device {
    fn new(name: &str) -> Device {
        let dir = std::env::temp_dir().join(format!("resmem-share-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Device { dir }
    }

    /// A `share` process: `conf` is its `RESMEM_CONF`, `env` more variables.
    fn command(&self, path: Path_, conf: &str, env: &[(&str, &str)], args: &[&str]) -> Command {
        let mut cmd = Command::new(program());
        cmd.args(args);
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy().into_owned();
            if key.starts_with("RESMEM_") || key.starts_with("CUDA_SIM_") {
                cmd.env_remove(key);
            }
        }
        cmd.env("CUDA_SIM_DEVICES", "24GiB")
            .env("CUDA_SIM_SHARED", self.dir.join("capacity"))
            .env("RESMEM_SHARE_DIR", &self.dir)
            .env("RESMEM_CONF", conf);
        match path {
            Path_::InProcess => cmd.env("RESMEM_DRIVER", "sim"),
            Path_::Library => cmd.env(
                "RESMEM_CUDA_LIBRARY",
                artifacts().lib_dir.join("libcuda_sim.so"),
            ),
        };
        cmd.envs(env.iter().copied());
        cmd
    }

    /// Start `share hold GIB` and wait until it caches its memory.
    fn hold(&self, path: Path_, conf: &str, env: &[(&str, &str)], gib: u64) -> Holder {
        let mut child = self
            .command(path, conf, env, &["hold", &gib.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start share hold");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n", "share hold {gib} did not start");
        Holder {
            child,
            stdin: Some(stdin),
            stdout,
        }
    }

    /// Run `share ask GIB` to its end; its standard output and error.
    fn ask(&self, path: Path_, conf: &str, gib: u64) -> (String, String) {
        let out = self
            .command(path, conf, &[], &["ask", &gib.to_string()])
            .output()
            .expect("run share ask");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(
            out.status.success(),
            "share ask failed:\n{stdout}\n{stderr}"
        );
        (stdout, stderr)
    }

    /// The registry file (there is one device).
    fn registry(&self) -> PathBuf {
        let found: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("resmem-")
            })
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        found[0].clone()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running `share hold`.
struct Holder {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Holder {
    /// Its figures now.
    fn figures(&mut self) -> Figures {
        writeln!(self.stdin.as_mut().unwrap(), "figures").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        Figures::parse(&line)
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill on the pid of a child this test started and has not yet waited for.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// End it (end of input) and return what it wrote on standard error.
    fn finish(mut self) -> String {
        drop(self.stdin.take());
        assert!(self.child.wait().unwrap().success());
        let mut err = String::new();
        std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut err).unwrap();
        err
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The figures `share` prints.
#[derive(Debug, PartialEq, Eq)]
struct Figures {
    given: u64,
    received: u64,
    reserved: u64,
    allocated: u64,
}

impl Figures {
    fn parse(text: &str) -> Figures {
        let line = text
            .lines()
            .find(|l| l.starts_with("given="))
            .unwrap_or_else(|| panic!("no figures in {text:?}"));
        let field = |name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
        };
        Figures {
            given: field("given"),
            received: field("received"),
            reserved: field("reserved"),
            allocated: field("allocated"),
        }
    }
}

/// The `status=` of an `ask`.
fn status(stdout: &str) -> i32 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("status="))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no status in {stdout:?}"))
}

const SHARE: &str = "share:true";

#[test]
fn b_gets_the_idle_cache_of_a_and_c_which_does_not_share_is_never_asked() {
    let device = Device::new("three");
    let mut a = device.hold(Path_::InProcess, SHARE, &[], 16);
    // C caches 4 GiB but does not share: nobody may ask it.
    let mut c = device.hold(Path_::Library, "", &[], 4);
    // 20 GiB are cached; B's 12 GiB fit only if A gives its idle cache back. B loads the
    // driver library, A and C the in-process simulator: all see one device.
    let (out, err) = device.ask(Path_::Library, SHARE, 12);
    assert_eq!(status(&out), 0, "{out}{err}");
    // A returned its whole idle 16 GiB segment; B received it and allocated its 12 GiB.
    assert_eq!(
        Figures::parse(&out),
        Figures {
            given: 0,
            received: 16 * GIB,
            reserved: 12 * GIB,
            allocated: 12 * GIB
        }
    );
    assert_eq!(
        a.figures(),
        Figures {
            given: 16 * GIB,
            received: 0,
            reserved: 0,
            allocated: 0
        }
    );
    assert_eq!(
        c.figures(),
        Figures {
            given: 0,
            received: 0,
            reserved: 4 * GIB,
            allocated: 0
        }
    );
    // Without sharing, the same request fails as it always did: C keeps its cache.
    let mut a = {
        drop(a);
        device.hold(Path_::InProcess, SHARE, &[], 16)
    };
    let (out, _) = device.ask(Path_::InProcess, "", 12);
    assert_eq!(status(&out), 3, "{out}");
    assert!(!out.contains("sharing"), "{out}");
    assert_eq!(a.figures().reserved, 16 * GIB);
    assert_eq!(c.figures().reserved, 4 * GIB);
    assert_eq!(a.finish(), "");
    assert_eq!(c.finish(), "");
}

#[test]
fn with_share_count_the_loader_sees_the_others_idle_cache_as_free() {
    let device = Device::new("count");
    let mut a = device.hold(Path_::InProcess, SHARE, &[], 16);
    let free = |conf: &str| -> u64 {
        let (out, _) = device.ask(Path_::InProcess, conf, 1);
        out.lines()
            .find_map(|l| l.strip_prefix("free="))
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(free(SHARE), 8 * GIB);
    // A says what it could give when it reads its figures (and every 100 ms).
    assert_eq!(a.figures().reserved, 16 * GIB);
    assert_eq!(free("share:true,share_count:true"), 24 * GIB);
}

#[test]
fn a_killed_by_sigkill_mid_request_costs_b_nothing_but_the_wait() {
    let device = Device::new("kill");
    let a = device.hold(Path_::InProcess, SHARE, &[], 16);
    // Stopped, A cannot answer; B's request stays open until A dies.
    a.signal(libc::SIGSTOP);
    let b = device
        .command(
            Path_::InProcess,
            "share:true,share_wait_ms:20000",
            &[],
            &["ask", "12"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    a.signal(libc::SIGKILL);
    let out = b.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    // The simulator freed A's memory when it died; B took it without an answer.
    assert_eq!(status(&stdout), 0, "{stdout}");
    let figures = Figures::parse(&stdout);
    assert_eq!((figures.received, figures.allocated), (0, 12 * GIB));
    assert!(killed.elapsed() < Duration::from_secs(15), "B hung");
    // A stopped peer costs at most the bounded wait: D asks E, which is stopped.
    let e = device.hold(Path_::InProcess, SHARE, &[], 8);
    e.signal(libc::SIGSTOP);
    let (out, _) = device.ask(Path_::InProcess, "share:true,share_wait_ms:100", 20);
    assert_eq!(status(&out), 3, "{out}");
    assert!(
        out.contains("asked the other processes on this device for 4096 MiB and they returned 0 MiB within 100 ms"),
        "{out}"
    );
    e.signal(libc::SIGCONT);
}

#[cfg(debug_assertions)]
#[test]
fn a_killed_while_holding_the_registry_lock_blocks_nobody() {
    let device = Device::new("lock");
    // A's helper holds the registry's lock for a minute before answering.
    let a = device.hold(
        Path_::InProcess,
        SHARE,
        &[("RESMEM_TEST_SHARE_STALL_MS", "60000")],
        16,
    );
    let b = device
        .command(
            Path_::InProcess,
            "share:true,share_wait_ms:20000",
            &[],
            &["ask", "12"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    a.signal(libc::SIGKILL);
    let out = b.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(status(&stdout), 0, "{stdout}");
    // The registry works on: the lock is free and A's place was reclaimed.
    let mut d = device.hold(Path_::InProcess, SHARE, &[], 8);
    let (out, _) = device.ask(Path_::InProcess, SHARE, 20);
    assert_eq!(status(&out), 0, "{out}");
    assert_eq!(Figures::parse(&out).received, 8 * GIB);
    assert_eq!(d.figures().given, 8 * GIB);
}

/// Run a sharing process against the registry as the test left it: it must work, without
/// sharing, and say why in exactly one line.
fn refused(device: &Device, needle: &str) {
    let (out, err) = device.ask(Path_::InProcess, SHARE, 4);
    assert_eq!(status(&out), 0, "{out}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with("resmem: device 0: sharing off: ") && lines[0].contains(needle),
        "{err}"
    );
}

#[test]
fn a_garbled_registry_is_refused_with_one_line_and_sharing_off() {
    let device = Device::new("garbled");
    let (out, err) = device.ask(Path_::InProcess, SHARE, 1);
    assert_eq!((status(&out), err.as_str()), (0, ""));
    let registry = device.registry();
    let size = std::fs::metadata(&registry).unwrap().len();
    assert_eq!(size, 4160);

    std::fs::write(&registry, b"short").unwrap();
    refused(&device, "is 5 bytes, not the 4160 of a registry; remove it");

    let garbage: Vec<u8> = (0..size).map(|i| (i * 7919 % 251) as u8).collect();
    std::fs::write(&registry, &garbage).unwrap();
    refused(&device, "does not start as a resmem registry");

    std::fs::set_permissions(&registry, std::fs::Permissions::from_mode(0o644)).unwrap();
    refused(&device, "has mode 644");
    std::fs::set_permissions(&registry, std::fs::Permissions::from_mode(0o600)).unwrap();

    std::fs::remove_file(&registry).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", &registry).unwrap();
    refused(&device, "cannot open the registry");
    std::fs::remove_file(&registry).unwrap();

    // Another user's file (the test can make one only as root).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::write(&registry, &garbage).unwrap();
        let path = std::ffi::CString::new(registry.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path of a file this test created.
        assert_eq!(unsafe { libc::chown(path.as_ptr(), 65534, 65534) }, 0);
        refused(&device, "belongs to uid 65534, not to this user (uid 0)");
        std::fs::remove_file(&registry).unwrap();
    }

    // With the file gone, the next process makes a new registry and shares again.
    let (out, err) = device.ask(Path_::InProcess, SHARE, 1);
    assert_eq!((status(&out), err.as_str()), (0, ""));
}
