//! The process-wide pool behind the C API, built once from the environment on first use.
//!
//! Nothing is loaded before the first call: a program that links resmem but never calls it
//! never opens the driver. A failure to start (no driver, a malformed variable) is remembered
//! and returned, with its message, by every later call. With `RESMEM_CONF=share:true` the pool
//! starts sharing (see [`crate::share`]) when it starts, and [`reserve`] and [`warmup`] ask the
//! other processes on the device for their idle cache when the driver runs out.
//!
//! Two guards protect the process:
//! - in a setuid or setgid program (`getauxval(AT_SECURE) != 0`), `RESMEM_CUDA_LIBRARY`,
//!   `RESMEM_CONF` and any variable not known to load nothing are ignored, as `secure_getenv`
//!   would, so that whoever runs the program cannot make it load a library of their choosing.
//!   Every variable both objects read goes through the one guarded reader, [`var_os`];
//! - CUDA driver state does not survive `fork()`: a child of the process that started the pool
//!   gets `RM_ERROR_NO_DRIVER` with advice, instead of the parent's contexts and pointers.

use std::ffi::OsString;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};

use crate::config::{DriverChoice, Settings};
use crate::driver::cuda::CudaDriver;
use crate::driver::pages::PageHandles;
use crate::driver::sim::SimDriver;
use crate::driver::{DevicePtr, Driver, StreamHandle};
use crate::error::{rm_status, Error};
use crate::front::Front;
use crate::pool::Pool;
use crate::share::{self, Sharing};
use crate::unload::{self, Unloadable};

/// The pool (behind its front caches), or why it could not start, and the process that built
/// it.
struct Started {
    pid: u32,
    pool: Result<Front, Error>,
}

static SETTINGS: Unloadable<Result<Settings, Error>> = Unloadable::new();
static POOL: Unloadable<Started> = Unloadable::new();
/// Giving idle cache to other processes, when `RESMEM_CONF` asks for it; started with the pool.
/// Never dropped: its helper threads run the library's code, so starting it pins the library
/// loaded (see [`unload::pin`]) and the unload finalizer never runs.
static SHARING: OnceLock<Option<Sharing>> = OnceLock::new();

/// Whether the process runs with elevated privileges (setuid, setgid or file capabilities).
pub fn is_secure() -> bool {
    // SAFETY: getauxval only reads the auxiliary vector; AT_SECURE is always present on Linux.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

/// Every environment variable `libresmem.so` and `libresmem_preload.so` read, and whether a
/// privileged process reads it. All of them are read through [`var_os`] (or [`var`]), never
/// `std::env` directly; a name not listed here is never read in a privileged process.
pub const VARIABLES: [(&str, bool); 10] = [
    // Picks the real driver or the built-in simulator: nothing the caller names is loaded.
    ("RESMEM_DRIVER", true),
    // Names a library to load, which would run with the program's privileges.
    ("RESMEM_CUDA_LIBRARY", false),
    // Changes what the pool (and the preload object's routing) does.
    ("RESMEM_CONF", false),
    // Makes an export panic on purpose (debug builds only).
    ("RESMEM_TEST_PANIC", false),
    // Shape the built-in simulator (RESMEM_DRIVER=sim): capacities, no virtual-memory API,
    // scripted failures of simulated calls. Nothing is loaded and no real device is touched.
    ("CUDA_SIM_DEVICES", true),
    ("CUDA_SIM_VMM", true),
    ("CUDA_SIM_FAULTS", true),
    // Names a file (or a path) the simulator shares its capacity through.
    ("CUDA_SIM_SHARED", false),
    // Where the sharing registries live; a privileged process never shares anyway.
    ("RESMEM_SHARE_DIR", false),
    // Makes the sharing helper stall on purpose (debug builds only).
    ("RESMEM_TEST_SHARE_STALL_MS", false),
];

/// Whether a privileged process may read `name` (see [`VARIABLES`]); `false` for any other name.
pub fn read_when_secure(name: &str) -> bool {
    VARIABLES.iter().any(|&(n, read)| n == name && read)
}

/// The variable's value as `environ` holds it, read through `lookup`; `None` when it is unset,
/// or when `secure` and [`read_when_secure`] refuses it (as `secure_getenv` would).
pub fn var_os_with(
    name: &str,
    secure: bool,
    lookup: impl FnOnce(&str) -> Option<OsString>,
) -> Option<OsString> {
    if secure && !read_when_secure(name) {
        return None;
    }
    lookup(name)
}

/// The variable's value, or `None` when unset or refused in a privileged process: the one
/// guarded reader of the environment.
pub fn var_os(name: &str) -> Option<OsString> {
    var_os_with(name, is_secure(), |n| std::env::var_os(n))
}

/// [`var_os`], as text (invalid UTF-8 replaced).
pub fn var(name: &str) -> Option<String> {
    var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// Build a pool from settings.
pub fn build(settings: &Settings) -> Result<Pool, Error> {
    let driver: Arc<dyn Driver> = match &settings.driver {
        DriverChoice::Cuda(library) => Arc::new(PageHandles::with_part(
            CudaDriver::load(library)?,
            settings.handle_part,
        )),
        DriverChoice::Sim => Arc::new(PageHandles::with_part(
            SimDriver::new(cuda_sim::Sim::global_from(&var_os))?,
            settings.handle_part,
        )),
    };
    Ok(Pool::new(driver, settings.pool))
}

/// The process's settings, read once from `RESMEM_DRIVER`, `RESMEM_CUDA_LIBRARY` and
/// `RESMEM_CONF` (the last two ignored in a privileged process). Reading them loads nothing.
pub fn settings() -> Result<&'static Settings, Error> {
    SETTINGS
        .get()
        .get_or_init(|| {
            unload::watch_exit();
            let (driver, library, conf) = (
                var("RESMEM_DRIVER"),
                var("RESMEM_CUDA_LIBRARY"),
                var("RESMEM_CONF"),
            );
            Settings::from_vars(driver.as_deref(), library.as_deref(), conf.as_deref())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The error a forked child gets: the pool (and the driver state under it) belongs to `parent`.
pub fn forked_error(parent: u32, child: u32) -> Error {
    Error::new(
        rm_status::RM_ERROR_NO_DRIVER,
        format!(
            "this process (pid {child}) was forked from pid {parent}, which started resmem; CUDA \
             driver state does not survive fork(), so the child cannot use it. Use resmem only in \
             the parent, or start workers with fork+exec (Python multiprocessing's \"spawn\" \
             start method) so that each starts its own"
        ),
    )
}

/// The started pool's front while the hit path may be taken: set by [`start`] once the pool
/// started and its sharing is settled, when no recording is asked for (a recorded call takes
/// the full path); cleared in a forked child and before the state is dropped at unload.
static FAST: AtomicPtr<Front> = AtomicPtr::new(std::ptr::null_mut());

/// The process-wide pool's front for the exports' hit path (one atomic load); `None` until a
/// call started the pool, in a forked child, and while calls are recorded.
#[inline(always)]
pub fn fast() -> Option<&'static Front> {
    let front = FAST.load(Ordering::Acquire);
    // SAFETY: non-null only while `POOL` holds the front it points to (set from it in `start`,
    // cleared by `drop_state` before `POOL` is emptied, at unload, when no call is in flight).
    unsafe { front.as_ref() }
}

/// The process-wide pool behind its front caches, created on first use from [`settings`]. In
/// a child forked after it started, an error that says what to do instead.
#[inline]
pub fn pool() -> Result<&'static Front, Error> {
    // The path of every call once started: two loads and the sharing flag, no error built.
    if let Some(Started {
        pool: Ok(front), ..
    }) = POOL.get().get()
    {
        if !FORKED.load(Ordering::Relaxed) && SHARING.get().is_some() {
            return Ok(front);
        }
    }
    start()
}

/// [`pool`] before the pool started, after a failure to start, or in a forked child.
#[cold]
fn start() -> Result<&'static Front, Error> {
    let started = POOL.get().get_or_init(|| {
        unload::watch_exit();
        // SAFETY: the handler only stores to an atomic, which is safe in a forked child; it is
        // registered once, here, for the life of the process.
        unsafe { libc::pthread_atfork(None, None, Some(note_fork)) };
        Started {
            pid: std::process::id(),
            pool: settings().and_then(|settings| {
                let front = Front::new(build(settings)?);
                if settings.pool.logging {
                    eprintln!("resmem: front caches: {}", front.gate_mode());
                }
                Ok(front)
            }),
        }
    });
    // One atomic load on every call: the child learns of the fork from `note_fork`, not from a
    // getpid system call.
    if FORKED.load(Ordering::Relaxed) {
        return Err(forked_error(started.pid, std::process::id()));
    }
    let front = started.pool.as_ref().map_err(Clone::clone)?;
    SHARING.get_or_init(|| start_sharing(front));
    if FAST.load(Ordering::Relaxed).is_null() && crate::record::global().is_none() {
        // A hit may panic only inside the quiet hook, like every other call.
        crate::tls::install_quiet_panic_hook();
        FAST.store(front as *const Front as *mut Front, Ordering::Release);
    }
    Ok(front)
}

/// Join the devices' registries if `RESMEM_CONF` says `share:true`; never in a privileged
/// process. The registries are in `RESMEM_SHARE_DIR`, else `/dev/shm`.
fn start_sharing(pool: &'static Front) -> Option<Sharing> {
    let settings = settings().ok()?;
    if !settings.share.enabled || is_secure() {
        return None;
    }
    let dir = var("RESMEM_SHARE_DIR")
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| share::DEFAULT_DIR.to_string());
    Some(Sharing::start(
        pool,
        settings.share,
        std::path::Path::new(&dir),
        settings.pool.logging,
    ))
}

/// The process's sharing, if it shares.
fn sharing() -> Option<&'static Sharing> {
    SHARING.get().and_then(Option::as_ref)
}

/// A block from the process-wide pool; when the driver runs out and sharing is on, after
/// asking the other processes on the device for their idle cache.
pub fn reserve(device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr, Error> {
    let pool = pool()?;
    match pool.reserve(device, size, stream) {
        Err(e) if e.is_out_of_memory() => match sharing() {
            Some(share) => share
                .after_out_of_memory(pool, device, size, e, || pool.reserve(device, size, stream)),
            None => Err(e),
        },
        other => other,
    }
}

/// `rm_reserve_no_wait` on the process-wide pool (see [`crate::pool::Pool::reserve_no_wait`]):
/// sharing does not ask other processes for memory, which waits.
pub fn reserve_no_wait(device: i32, size: u64, stream: StreamHandle) -> Result<DevicePtr, Error> {
    pool()?.reserve_no_wait(device, size, stream)
}

/// `rm_warmup` on the process-wide pool; when the driver runs out and sharing is on, after
/// asking the other processes on the device for the shortfall. The bytes newly allocated.
pub fn warmup(device: i32, bytes: u64) -> Result<u64, Error> {
    let pool = pool()?;
    match pool.warmup(device, bytes) {
        Err(e) if e.is_out_of_memory() => match sharing() {
            Some(share) => {
                let reusable = pool.stats(device)?.reusable_bytes;
                let missing = bytes.saturating_sub(reusable);
                share.after_out_of_memory(pool, device, missing, e, || pool.warmup(device, bytes))
            }
            None => Err(e),
        },
        other => other,
    }
}

/// `(free, total)` of `device` as `rm_mem_get_info` reports it: the pool's figure, plus with
/// `share_count:true` the reusable bytes the other sharing processes would give up.
pub fn mem_get_info(device: i32) -> Result<(u64, u64), Error> {
    let (free, total) = pool()?.mem_get_info(device)?;
    let counted = settings().is_ok_and(|s| s.share.count);
    match sharing() {
        Some(share) if counted => Ok((
            free.saturating_add(share.others_reusable(device))
                .min(total),
            total,
        )),
        _ => Ok((free, total)),
    }
}

/// `(given, received)`: bytes this process returned to the driver at other processes'
/// requests on `device`, and bytes they returned at its requests; zeros without sharing.
/// With sharing, `reusable` (the pool's reusable bytes on `device`, just read) is published to
/// the others at once, rather than at the helper's next refresh.
pub fn share_counts(device: i32, reusable: u64) -> (u64, u64) {
    sharing().map_or((0, 0), |share| {
        share.publish(device, reusable);
        share.counts(device)
    })
}

/// Set in a child forked after the pool started (its state belongs to the parent).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_fork() {
    FORKED.store(true, Ordering::Relaxed);
    FAST.store(std::ptr::null_mut(), Ordering::Relaxed);
}

/// The process-wide pool (behind its front caches) if a call has already started it in this
/// process; `None` otherwise (nothing is loaded).
pub fn started() -> Option<&'static Front> {
    POOL.get()
        .get()
        .filter(|_| !FORKED.load(Ordering::Relaxed))
        .and_then(|started| started.pool.as_ref().ok())
}

/// Return the pool's cache to the driver and drop the process-wide state (the library is being
/// unloaded).
///
/// # Safety
/// No reference to the pool or the settings is alive, and no call will be made into the library.
pub(crate) unsafe fn drop_state() {
    FAST.store(std::ptr::null_mut(), Ordering::Relaxed);
    // SAFETY: the caller's contract.
    let started = unsafe { POOL.take() };
    if let Some(Started { pool: Ok(pool), .. }) = &started {
        if !FORKED.load(Ordering::Relaxed) {
            // Nobody is left to hear of a failure: what cannot go back stays with the driver.
            let _returned = pool.free_reusable(None);
        }
    }
    drop(started);
    crate::front::forget_key();
    // SAFETY: the caller's contract.
    drop(unsafe { SETTINGS.take() });
    // SAFETY: the caller's contract; the simulator is reached only through the pool.
    unsafe { cuda_sim::Sim::drop_global() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_privileged_process_reads_only_the_variables_that_load_nothing() {
        let set = |_: &str| Some(OsString::from("value"));
        let refused = [
            "RESMEM_CUDA_LIBRARY",
            "RESMEM_CONF",
            "RESMEM_TEST_PANIC",
            "CUDA_SIM_SHARED",
            "RESMEM_SHARE_DIR",
            "RESMEM_TEST_SHARE_STALL_MS",
            "LD_LIBRARY_PATH",
            "RESMEM_UNKNOWN",
            "",
        ];
        for name in refused {
            assert!(!read_when_secure(name), "{name}");
            assert_eq!(var_os_with(name, true, set), None, "{name}");
            assert_eq!(var_os_with(name, false, set), set(name), "{name}");
        }
        let read = [
            "RESMEM_DRIVER",
            "CUDA_SIM_DEVICES",
            "CUDA_SIM_VMM",
            "CUDA_SIM_FAULTS",
        ];
        for name in read {
            assert!(read_when_secure(name), "{name}");
            assert_eq!(var_os_with(name, true, set), set(name), "{name}");
            assert_eq!(var_os_with(name, false, set), set(name), "{name}");
        }
        // Every listed variable is decided above, and an unset one is None either way.
        assert_eq!(VARIABLES.len(), read.len() + 6);
        for (name, _) in VARIABLES {
            assert!(read.contains(&name) || refused.contains(&name), "{name}");
            assert_eq!(var_os_with(name, false, |_| None), None);
        }
        // A test binary is not setuid; the C harness checks a setuid and a setgid program.
        assert!(!is_secure());
    }

    /// Both objects read the environment only through the guarded reader: no `std::env` read
    /// anywhere else in their sources.
    #[test]
    fn no_source_reads_the_environment_around_the_guard() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        let mut dirs = vec![root.join("src"), root.join("preload/src")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        assert!(files.len() > 20, "{files:?}");
        let this = root.join("src/runtime.rs");
        for file in files.iter().filter(|f| **f != this) {
            let text = std::fs::read_to_string(file).unwrap();
            for needle in ["env::var", "getenv", "env::vars"] {
                assert!(
                    !text.contains(needle),
                    "{} reads the environment with {needle}: use resmem::runtime::var",
                    file.display()
                );
            }
        }
    }

    #[test]
    fn a_forked_child_is_told_what_to_do() {
        let e = forked_error(100, 200);
        assert_eq!(e.status, rm_status::RM_ERROR_NO_DRIVER);
        assert!(
            e.message.contains("pid 200) was forked from pid 100"),
            "{}",
            e.message
        );
        assert!(e.message.contains("spawn"), "{}", e.message);
    }
}
