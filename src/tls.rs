//! What calls past the exports' hit paths read of the calling thread's state, in one
//! thread-local: whether the thread is inside an export's boundary (read by the quiet panic
//! hook, installed here; the hit paths leave it alone, see `capi::hit`) and the front cache it
//! used last; and the thread's key ([`thread_key`]), by which the hit paths find its cache
//! with no call (`front/seats.rs`).
//!
//! In a shared object, Rust reaches a thread-local through a call to `__tls_get_addr` (the
//! general-dynamic model). One thread-local for both keeps it at one lookup per call, where two
//! cost one each. It is constant-initialised and has no destructor, so it stays usable at any
//! point of a thread's exit (a call from another key's destructor, from an `atexit` handler).
//!
//! TLS descriptors (LLVM's `-enable-tlsdesc`) would make that call keep every register (they
//! measured about 0.8 ns less a pair when the hit paths still made it), but glibc before 2.40
//! (bug 31372) lets their slow path, taken by a library loaded with `dlopen` (as Python loads
//! this one) outside static TLS, clobber vector registers the compiler assumes kept: a silent
//! corruption on the distributions most users run, for under a nanosecond. The build does not
//! use them.

use std::cell::Cell;
use std::panic;
use std::ptr;
use std::sync::Once;

/// The calling thread's per-call state.
pub(crate) struct Thread {
    /// Inside an export's panic boundary (past its hit path): a panic here is caught and
    /// reported as a status, so the quiet hook keeps it off stderr.
    pub in_boundary: Cell<bool>,
    /// The front (by id; 0: none) and the thread cache of this thread's last call into one
    /// (the common case: one front in the process). The cache is a
    /// `front::thread::ThreadCache`, typed there.
    pub front: Cell<(u64, *const ())>,
}

thread_local! {
    static THREAD: Thread = const {
        Thread {
            in_boundary: Cell::new(false),
            front: Cell::new((0, ptr::null())),
        }
    };
}

/// The calling thread's state. (Taken out of `LocalKey::with`, so that what uses it is
/// compiled into its caller rather than into an instance of `with` kept out of line.)
#[inline(always)]
pub(crate) fn current() -> &'static Thread {
    let thread: *const Thread = THREAD.with(|t| t as *const Thread);
    // SAFETY: the thread-local has no destructor, so its storage stays valid for the whole life
    // of the calling thread; and `Thread` is not `Sync`, so the reference cannot reach another
    // thread.
    unsafe { &*thread }
}

/// A number that names the calling thread among the live threads of the process, never 0,
/// read without a call where the architecture allows: the thread pointer (on x86_64 the
/// self-pointer at `%fs:0` that the ABI requires, on aarch64 `tpidr_el0`), else the address of
/// this thread-local. A thread that has exited may leave its number to a later thread.
#[inline(always)]
pub(crate) fn thread_key() -> usize {
    #[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
    {
        let key: usize;
        // SAFETY: on x86_64 Linux the thread pointer's first word points to itself (the TLS
        // ABI; glibc and musl both set it before any user code runs); the load reads only it.
        unsafe {
            std::arch::asm!("mov {}, qword ptr fs:0", out(reg) key,
                options(nostack, readonly, preserves_flags, pure));
        }
        key
    }
    #[cfg(all(target_arch = "aarch64", target_os = "linux", not(miri)))]
    {
        let key: usize;
        // SAFETY: reads the thread pointer register, which every thread has.
        unsafe {
            std::arch::asm!("mrs {}, tpidr_el0", out(reg) key,
                options(nomem, nostack, preserves_flags, pure));
        }
        key
    }
    #[cfg(not(all(
        any(target_arch = "x86_64", target_arch = "aarch64"),
        target_os = "linux",
        not(miri)
    )))]
    {
        current() as *const Thread as usize
    }
}

/// Run `f` with the calling thread's state.
#[inline(always)]
pub(crate) fn with<R>(f: impl FnOnce(&Thread) -> R) -> R {
    f(current())
}

/// Done once the quiet panic hook is installed.
static QUIET_HOOK: Once = Once::new();

/// Keep panics caught at the exports' boundary quiet (the library never prints unless asked);
/// panics elsewhere in the host process go to the hook that was there before. Installed by
/// the first export called, and by the runtime before the hit path can be taken (see
/// `runtime::fast`), so a hit never runs without it.
pub(crate) fn install_quiet_panic_hook() {
    QUIET_HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !THREAD.with(|t| t.in_boundary.get()) {
                previous(info);
            }
        }));
    });
}

/// Put back the panic hook that was there before (the library is being unloaded).
pub(crate) fn drop_panic_hook() {
    if QUIET_HOOK.is_completed() {
        // Ours wraps the previous one: dropping it drops that too, leaving the default.
        drop(panic::take_hook());
    }
}
