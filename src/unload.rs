//! Giving back what the process-wide state holds when `libresmem.so` is unloaded (`dlclose`),
//! so that a program that loads and unloads the library in a loop does not grow.
//!
//! The pool, its settings and the in-process simulator live in statics created on first use.
//! Nothing drops statics, so each unload used to leave them behind (about 8 KiB of host memory
//! per cycle, and the pool's cached device memory). A `.fini_array` entry now runs when the
//! object is unloaded, and at process exit. The two are told apart by an `atexit` handler,
//! registered when the state is first built: at exit it runs before the objects' finalizers
//! (handlers run in reverse order of registration, and the loader's own comes first), so the
//! finalizer sees it and leaves everything in place (other threads may still be calling in, and
//! the memory goes with the process). At unload the program may no longer call in, so the
//! finalizer returns the pool's cache to the driver and drops the state.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, OnceLock};

/// A `OnceLock` in a static that the unload finalizer may empty.
pub(crate) struct Unloadable<T>(UnsafeCell<OnceLock<T>>);

// SAFETY: every access but `take` goes through the `OnceLock`, which is `Sync` for such `T`;
// `take` runs only when no other thread can be inside the library (see its contract).
unsafe impl<T: Send + Sync> Sync for Unloadable<T> {}

impl<T> Unloadable<T> {
    pub(crate) const fn new() -> Unloadable<T> {
        Unloadable(UnsafeCell::new(OnceLock::new()))
    }

    /// The cell.
    pub(crate) fn get(&self) -> &OnceLock<T> {
        // SAFETY: the only `&mut` is made by `take`, whose contract excludes any other access.
        unsafe { &*self.0.get() }
    }

    /// Empty the cell, returning its value.
    ///
    /// # Safety
    /// No reference obtained through [`Unloadable::get`] is alive, and none will be made later
    /// while the value is expected: the library is being unloaded.
    pub(crate) unsafe fn take(&self) -> Option<T> {
        // SAFETY: exclusive by the caller's contract.
        unsafe { (*self.0.get()).take() }
    }
}

/// Set by the `atexit` handler: the process is exiting, not unloading the library.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Whether the handler is registered (without it, exit and unload cannot be told apart).
static WATCHING: AtomicBool = AtomicBool::new(false);

extern "C" fn note_exit() {
    EXITING.store(true, Ordering::Relaxed);
}

/// Register the `atexit` handler, once; called when process-wide state is first built.
pub(crate) fn watch_exit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `note_exit` only stores to an atomic; registered once.
        if unsafe { libc::atexit(note_exit) } == 0 {
            WATCHING.store(true, Ordering::Relaxed);
        }
    });
}

/// Set once a background thread runs this object's code: it is then never unloaded.
static PINNED: AtomicBool = AtomicBool::new(false);

/// Keep this object loaded for the rest of the process. Called before a thread that runs its
/// code in the background is started (the recorder's writer, the sharing helpers): `dlclose`
/// would otherwise unmap that code under the thread. With the object pinned, `dlclose` leaves it
/// in place, and the finalizer below never drops the state those threads use.
pub(crate) fn pin() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        PINNED.store(true, Ordering::Relaxed);
        // SAFETY: `Dl_info` is plain data that `dladdr` fills.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: `dladdr` reads the address of a function of this object and writes `info`.
        let found = unsafe { libc::dladdr(pin as *const libc::c_void, &mut info) } != 0;
        if found && !info.dli_fname.is_null() {
            // SAFETY: `dli_fname` is the loader's NUL-terminated path of this object, which is
            // loaded: RTLD_NOLOAD only finds it (and adds a reference that is never dropped),
            // RTLD_NODELETE keeps it mapped after the last dlclose.
            unsafe {
                libc::dlopen(
                    info.dli_fname,
                    libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
                )
            };
        }
    });
}

#[used]
#[link_section = ".fini_array"]
static FINALIZER: extern "C" fn() = finalize;

/// Runs at unload and at exit: drops the process-wide state at unload only.
extern "C" fn finalize() {
    if !WATCHING.load(Ordering::Relaxed)
        || EXITING.load(Ordering::Relaxed)
        || PINNED.load(Ordering::Relaxed)
    {
        return;
    }
    // Nothing may unwind out of a finalizer.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: the library is being unloaded by dlclose: the program may no longer call
        // into it, so no reference to the state is alive or will be made.
        unsafe { crate::runtime::drop_state() };
        crate::tls::drop_panic_hook();
    });
}
