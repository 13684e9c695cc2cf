//! The gate between a thread cache's owner and the drains: the owner works on its bins with
//! plain loads and stores, and a drain takes the bins' lists only while no owner is inside.
//!
//! An owner announces itself in its cache's `busy` flag, then checks that no drain is in
//! flight; a drain announces itself in the gate's count, then waits until every cache's flag
//! is down. Each side stores, then loads what the other stored, so each needs a full fence
//! between the two (a store may otherwise still wait in the CPU's store buffer when the load
//! reads): the owner's would cost as much as the compare-and-swaps it replaces. The fences are
//! made asymmetric instead, as userspace RCU and folly do: the owner's is only a compiler
//! fence, and the drain makes every running thread of the process execute a full fence with
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (about a microsecond here). Once it returns,
//! any owner that set its flag before its fence shows the flag to the drain, and any owner
//! whose fence came first sees the drain's count and stays out. Where the system call is
//! missing or refused (kernels before 4.14, seccomp filters, valgrind; Miri), the gate is *fenced*:
//! the owner makes a full fence itself, and the two sides are the classic store-fence-load
//! pair.
//!
//! Drains are rare (`free_reusable`, a cap, a reserve that would otherwise grow the pool, a
//! thread's exit), so their cost is the system call and a wait of a few instructions for an
//! owner inside (longer only if the owner is preempted there); an owner's cost is two stores
//! and a load. While a drain is in flight, owners go past their caches to the pool.

use std::sync::atomic::{
    compiler_fence, fence, AtomicBool, AtomicU32,
    Ordering::{Acquire, Relaxed, Release, SeqCst},
};
use std::sync::OnceLock;

/// Drains in flight, and which kind of fence the owners make.
pub struct Gate {
    drains: AtomicU32,
    /// The owners make a full fence (no asymmetric barrier in this process).
    fenced: bool,
}

/// An owner inside the gate; leaving drops its cache's flag.
pub struct Owner<'a> {
    busy: &'a AtomicBool,
}

impl Drop for Owner<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        // Release: the bins' stores made inside are visible to a drain that sees the flag down.
        self.busy.store(false, Release);
    }
}

impl Gate {
    /// A gate with asymmetric fences where this process can have them, else fenced.
    pub fn new() -> Gate {
        Gate::with_fences(!membarrier::available())
    }

    /// A gate whose owners make full fences if `fenced` (also where the process could do
    /// without: the tests check both kinds).
    pub fn with_fences(fenced: bool) -> Gate {
        Gate {
            drains: AtomicU32::new(0),
            fenced,
        }
    }

    /// How the owners fence, in words (for `logging:true`).
    pub fn describe(&self) -> &'static str {
        if self.fenced {
            "a full fence on every hit (membarrier is refused here: kernels before 4.14, a \
             seccomp filter, valgrind)"
        } else {
            "no fence on a hit (membarrier: the drains fence every thread)"
        }
    }

    /// Enter as the owner of the cache whose flag is `busy` (owner only); `None`, with the
    /// flag down, while a drain is in flight.
    #[inline(always)]
    pub fn enter<'a>(&self, busy: &'a AtomicBool) -> Option<Owner<'a>> {
        busy.store(true, Relaxed);
        if self.fenced {
            fence(SeqCst);
        } else {
            // The drain's barrier fences the CPU; this keeps the compiler from moving the load
            // above the store.
            compiler_fence(SeqCst);
        }
        let owner = Owner { busy };
        // Acquire: a drain that has finished left its exchanges visible.
        (self.drains.load(Acquire) == 0).then_some(owner)
    }

    /// Run `f` with every owner out (`busy`: every cache's flag, read after the barrier, so
    /// that a cache made meanwhile is among them); `f`'s argument says whether owners are out
    /// indeed. It is `false` only if the process's barrier failed, which its registration rules
    /// out short of a kernel fault: `f` must then leave the bins alone.
    pub fn exclusive<'a, I, R>(&self, busy: impl FnOnce() -> I, f: impl FnOnce(bool) -> R) -> R
    where
        I: Iterator<Item = &'a AtomicBool>,
    {
        self.drains.fetch_add(1, SeqCst);
        let out = if self.fenced {
            // The other half of the owners' fence (a locked instruction is one on x86, but
            // the language's model asks for it).
            fence(SeqCst);
            true
        } else {
            membarrier::barrier()
        };
        if out {
            for flag in busy() {
                wait_down(flag);
            }
        }
        let result = f(out);
        self.drains.fetch_sub(1, Release);
        result
    }
}

/// Wait until an owner inside leaves: spinning a little (an owner stays a few instructions),
/// then yielding (it was preempted inside).
fn wait_down(flag: &AtomicBool) {
    let mut spins = 0u32;
    while flag.load(Acquire) {
        if spins < 1000 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// The process-wide barrier: `membarrier(2)`, registered once per process.
mod membarrier {
    use super::OnceLock;

    #[cfg(all(target_os = "linux", not(miri)))]
    mod sys {
        // The commands of linux/membarrier.h.
        pub const QUERY: libc::c_int = 0;
        pub const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
        pub const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

        pub fn call(command: libc::c_int) -> libc::c_long {
            // SAFETY: membarrier takes two integer arguments and touches no memory of ours.
            unsafe { libc::syscall(libc::SYS_membarrier, command, 0, 0) }
        }
    }

    /// Whether the process is registered for expedited barriers (tried once).
    pub fn available() -> bool {
        static REGISTERED: OnceLock<bool> = OnceLock::new();
        *REGISTERED.get_or_init(register)
    }

    #[cfg(all(target_os = "linux", not(miri)))]
    fn register() -> bool {
        let commands = sys::call(sys::QUERY);
        commands >= 0
            && commands & libc::c_long::from(sys::PRIVATE_EXPEDITED) != 0
            && sys::call(sys::REGISTER_PRIVATE_EXPEDITED) == 0
    }

    #[cfg(any(not(target_os = "linux"), miri))]
    fn register() -> bool {
        false
    }

    /// A full fence on every running thread of the process; `false` if the system refused.
    /// (A forked child inherits no registration: it registers again here.)
    #[cfg(all(target_os = "linux", not(miri)))]
    pub fn barrier() -> bool {
        sys::call(sys::PRIVATE_EXPEDITED) == 0
            || (sys::call(sys::REGISTER_PRIVATE_EXPEDITED) == 0
                && sys::call(sys::PRIVATE_EXPEDITED) == 0)
    }

    #[cfg(any(not(target_os = "linux"), miri))]
    pub fn barrier() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// An owner moving tokens between two plain "lists" (counters it loads and stores without
    /// read-modify-write) inside the gate, and a drain taking both whole with exchanges: no
    /// token is lost or counted twice.
    fn owner_and_drains_keep_every_token(gate: Gate) {
        struct Shared {
            gate: Gate,
            busy: AtomicBool,
            a: AtomicU64,
            b: AtomicU64,
            drained: AtomicU64,
            stop: AtomicBool,
        }
        let tokens = 1000u64;
        let s = Arc::new(Shared {
            gate,
            busy: AtomicBool::new(false),
            a: AtomicU64::new(tokens),
            b: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let owner = {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                // Until the drains are done: at least one pass whatever the scheduling.
                let mut i = 0u64;
                while i == 0 || !s.stop.load(Relaxed) {
                    i += 1;
                    let Some(_inside) = s.gate.enter(&s.busy) else {
                        continue;
                    };
                    let (from, to) = if i % 2 == 0 {
                        (&s.a, &s.b)
                    } else {
                        (&s.b, &s.a)
                    };
                    let n = from.load(Relaxed);
                    if n > 0 {
                        from.store(n - 1, Relaxed);
                        to.store(to.load(Relaxed) + 1, Relaxed);
                    }
                }
            })
        };
        for drain in 0..2000u64 {
            let taken = s.gate.exclusive(
                || std::iter::once(&s.busy),
                |out| {
                    assert!(out, "the barrier was refused");
                    s.a.swap(0, Acquire) + s.b.swap(0, Acquire)
                },
            );
            s.drained.fetch_add(taken, Relaxed);
            // Tokens back, for the owner to move again.
            if drain % 2 == 1 {
                let back = s.drained.swap(0, Relaxed);
                s.gate.exclusive(
                    || std::iter::once(&s.busy),
                    |_| s.a.fetch_add(back, Relaxed),
                );
            }
            std::thread::yield_now();
        }
        s.stop.store(true, Relaxed);
        owner.join().unwrap();
        let total = s.a.load(Relaxed) + s.b.load(Relaxed) + s.drained.load(Relaxed);
        assert_eq!(total, tokens);
    }

    #[test]
    fn an_owner_and_drains_keep_every_token_with_asymmetric_fences() {
        // Where the process cannot have them, this is the fenced test again.
        owner_and_drains_keep_every_token(Gate::new());
    }

    #[test]
    fn an_owner_and_drains_keep_every_token_with_full_fences() {
        owner_and_drains_keep_every_token(Gate::with_fences(true));
    }

    #[test]
    fn a_drain_waits_for_an_owner_inside_to_leave() {
        for gate in [Gate::new(), Gate::with_fences(true)] {
            let gate = Arc::new(gate);
            let busy = Arc::new(AtomicBool::new(false));
            let left = Arc::new(AtomicBool::new(false));
            let inside = gate.enter(&busy).expect("no drain in flight");
            let drain = {
                let (gate, busy, left) = (Arc::clone(&gate), Arc::clone(&busy), Arc::clone(&left));
                std::thread::spawn(move || {
                    gate.exclusive(|| std::iter::once(&*busy), |_| left.load(Acquire))
                })
            };
            // The owner stays inside (as if preempted there) while the drain runs.
            std::thread::sleep(std::time::Duration::from_millis(50));
            left.store(true, Release);
            drop(inside);
            assert!(drain.join().unwrap(), "the drain ran with the owner inside");
        }
    }

    #[test]
    fn an_owner_stays_out_while_a_drain_is_in_flight() {
        let gate = Gate::with_fences(true);
        let busy = AtomicBool::new(false);
        gate.exclusive(
            || std::iter::once(&busy),
            |_| {
                assert!(gate.enter(&busy).is_none());
                assert!(!busy.load(Relaxed), "the flag is down again");
            },
        );
        let inside = gate.enter(&busy).expect("no drain in flight");
        assert!(busy.load(Relaxed));
        drop(inside);
        assert!(!busy.load(Relaxed));
    }
}
