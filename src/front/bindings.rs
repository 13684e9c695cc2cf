//! Which thread cache the calling thread uses in each front, and handing the caches back when
//! the thread exits.
//!
//! The hit path reads the thread's last front and cache from `tls::Thread`, a constant
//! thread-local with no destructor, usable at any point of a thread's exit. The list of every binding of the thread
//! is made on first use and handed back at thread exit by a pthread key's destructor rather
//! than a thread-local destructor: a thread-local destructor registered while the thread is
//! already being torn down (a call from another key's destructor, or from an `atexit` handler
//! on the main thread) would never run, and its record and the list would be lost. A key's
//! destructor registered then still runs (the key destructors are called again while values
//! remain), and on the main thread at exit the list stays reachable from the thread's key
//! values. The key is deleted when the library is unloaded, so that no thread calls its
//! destructor in unmapped code.

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::ptr;
use std::sync::{OnceLock, Weak};

use super::Inner;

/// Which thread cache the thread uses in a front. It does not keep the front alive: a front
/// dropped meanwhile is skipped at the thread's exit.
pub(super) struct Binding {
    pub front: Weak<Inner>,
    pub id: u64,
    pub cache: u32,
}

/// The calling thread's caches, one per front it has used; handed back at thread exit.
pub(super) struct Bindings {
    pub list: RefCell<Vec<Binding>>,
}

thread_local! {
    /// This thread's [`Bindings`], once made (also the value of the thread's key).
    static BOUND: Cell<*mut Bindings> = const { Cell::new(ptr::null_mut()) };
}

/// The key whose destructor hands a thread's caches back; `None` if none could be made (the
/// threads then use the pool directly).
static KEY: OnceLock<Option<libc::pthread_key_t>> = OnceLock::new();

/// Run `f` with this thread's bindings, made (and their hand-back at exit registered) on first
/// use; `None` where that cannot be done.
pub(super) fn with_bindings<R>(f: impl FnOnce(&Bindings) -> R) -> Option<R> {
    let mut bound = BOUND.get();
    if bound.is_null() {
        let key = (*KEY.get_or_init(make_key))?;
        let fresh = Box::into_raw(Box::new(Bindings {
            list: RefCell::new(Vec::new()),
        }));
        // SAFETY: `key` is a live key of this process; the value is a pointer we own.
        if unsafe { libc::pthread_setspecific(key, fresh.cast()) } != 0 {
            // SAFETY: made just above and handed to no one.
            drop(unsafe { Box::from_raw(fresh) });
            return None;
        }
        BOUND.set(fresh);
        bound = fresh;
    }
    // SAFETY: made on this thread and freed only by `hand_back_at_exit` on this thread, which
    // clears `BOUND` first; no `&mut` to it exists.
    Some(f(unsafe { &*bound }))
}

fn make_key() -> Option<libc::pthread_key_t> {
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: writes `key`; the destructor never unwinds.
    (unsafe { libc::pthread_key_create(&mut key, Some(hand_back_at_exit)) } == 0).then_some(key)
}

/// The key's destructor: the thread is exiting; its caches go back to their fronts.
extern "C" fn hand_back_at_exit(value: *mut libc::c_void) {
    // A call made later in this thread's exit binds again (and is handed back again).
    crate::tls::with(|t| t.front.set((0, ptr::null())));
    BOUND.set(ptr::null_mut());
    // SAFETY: the value is the `Box<Bindings>` `with_bindings` made on this thread, given to
    // the destructor once (the key's value is cleared before the call).
    let bindings = unsafe { Box::from_raw(value.cast::<Bindings>()) };
    // Nothing may unwind into the C runtime.
    let _ = std::panic::catch_unwind(AssertUnwindSafe(move || {
        for binding in bindings.list.into_inner() {
            if let Some(front) = binding.front.upgrade() {
                front.hand_back(binding.cache);
            }
        }
    }));
}

/// Delete the key (the library is being unloaded): no thread will call its destructor, which
/// is about to be unmapped. Bindings of threads still alive are left behind.
pub(crate) fn forget_key() {
    if let Some(Some(key)) = KEY.get() {
        // SAFETY: a key made by `make_key`, deleted once (the library is going away).
        unsafe { libc::pthread_key_delete(*key) };
    }
}
