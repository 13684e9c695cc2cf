//! A benchmark probe, compiled only with the cargo feature `hold-probe` (never in the shipped
//! library; `scripts/bench-pauses.sh` builds a copy with it): how long each hold of a device's
//! lock by [`super::Pool::free_reusable`] lasts, in wall-clock time and in the thread's own CPU
//! time (which leaves out the time it waited for a CPU, so that a preemption on a shared machine
//! is told apart from work), and glibc's count of free chunks in its fastbins before and after
//! the hold: a count that falls during a hold means glibc consolidated its fastbins in it (a
//! `free` that coalesced into a chunk of 64 KiB or more, or a `malloc` of a large-bin size, while
//! fastbin chunks were waiting). The counts are read outside the timed span.
//!
//! The thread's page faults and involuntary context switches during each hold are counted too
//! (`getrusage`): a fault is kernel time inside the hold, a switch a preemption.
//!
//! When the call ends, one line per hold goes to standard error:
//! `hold <step> <wall ns> <CPU ns> <fastbin chunks before> <after> <page faults> <switches>`.

use std::time::Instant;

/// The free chunks in glibc's fastbins, over every arena.
fn fastbin_chunks() -> usize {
    // SAFETY: mallinfo2 (glibc 2.33 and later) takes no argument and only reads the
    // allocator's state under its own locks; it returns the struct by value.
    unsafe { libc::mallinfo2() }.smblks
}

/// The calling thread's (minor + major page faults, involuntary context switches) so far.
fn thread_faults_and_switches() -> (u64, u64) {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a valid rusage to write; RUSAGE_THREAD exists on Linux.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut r) };
    ((r.ru_minflt + r.ru_majflt) as u64, r.ru_nivcsw as u64)
}

fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// One hold, as timed.
struct Hold {
    step: &'static str,
    wall_ns: u64,
    cpu_ns: u64,
    fast_before: usize,
    fast_after: usize,
    faults: u64,
    switches: u64,
}

/// The holds of one `free_reusable` call.
#[derive(Default)]
pub(super) struct Holds {
    holds: Vec<Hold>,
}

/// A hold being timed.
pub(super) struct Timing {
    step: &'static str,
    fast_before: usize,
    faults_and_switches: (u64, u64),
    wall: Instant,
    cpu_ns: u64,
}

impl Holds {
    /// Start timing a hold that begins with sweep step `step`.
    pub(super) fn start(step: &'static str) -> Timing {
        let fast_before = fastbin_chunks();
        Timing {
            step,
            fast_before,
            faults_and_switches: thread_faults_and_switches(),
            cpu_ns: thread_cpu_ns(),
            wall: Instant::now(),
        }
    }

    /// The hold `timing` ended.
    pub(super) fn end(&mut self, timing: Timing) {
        let wall_ns = timing.wall.elapsed().as_nanos() as u64;
        let cpu_ns = thread_cpu_ns() - timing.cpu_ns;
        let (faults, switches) = thread_faults_and_switches();
        let (faults_before, switches_before) = timing.faults_and_switches;
        self.holds.push(Hold {
            faults: faults - faults_before,
            switches: switches - switches_before,
            step: timing.step,
            wall_ns,
            cpu_ns,
            fast_before: timing.fast_before,
            fast_after: fastbin_chunks(),
        });
    }

    /// Write every hold to standard error.
    pub(super) fn print(&self) {
        use std::io::Write;
        let mut out = String::with_capacity(self.holds.len() * 48);
        for h in &self.holds {
            out.push_str(&format!(
                "hold {} {} {} {} {} {} {}\n",
                h.step, h.wall_ns, h.cpu_ns, h.fast_before, h.fast_after, h.faults, h.switches
            ));
        }
        let _ = std::io::stderr().lock().write_all(out.as_bytes());
    }
}
