//! The writer thread: it takes the entries out of every thread's ring, puts them back in the
//! process's order of calls, formats the lines and writes them with one `write(2)` per round
//! (`O_APPEND`, so whole lines land together even with other writers). The first failed write
//! stops the recording with one line on stderr.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::line::{format_line, Entry};
use super::ring::Ring;

/// How long the writer sleeps when nobody wakes it: the longest an idle thread's calls wait.
const ROUND: Duration = Duration::from_millis(250);

/// How long a flush waits for a place in the order whose call never arrives (a thread stopped
/// in the middle of a call) before writing what follows it.
const GAP_WAIT: Duration = Duration::from_millis(200);

/// The next place in the order; alone on its cache line, which every recorded call touches.
#[repr(align(128))]
pub(crate) struct Counter(pub AtomicU64);

/// What the callers and the writer thread share.
pub(crate) struct Shared {
    pub path: String,
    /// False once recording stopped (a write failed, or a forked child): calls then go unrecorded.
    pub on: AtomicBool,
    /// The order of calls: each recorded call takes the next number.
    pub order: Counter,
    /// Every thread's ring, registered on the thread's first recorded call.
    pub rings: Mutex<Vec<Arc<Ring>>>,
    /// Calls of threads whose ring is gone (recorded from a thread-local destructor).
    pub stray: Mutex<Vec<Entry>>,
    /// Threads waiting for room in their ring, woken after each round's draining.
    pub stalled: Mutex<Vec<Thread>>,
    pub progress: Mutex<Progress>,
    pub written: Condvar,
    /// Set when the recorder is dropped: the writer makes one last round and returns.
    pub stop: AtomicBool,
}

pub(crate) struct Progress {
    /// Every call numbered below this is in the file (or was dropped after a write error).
    pub written_below: u64,
    /// A flush waits until `written_below` reaches this.
    pub wanted: u64,
    /// Rounds done: a flush also waits for a whole round begun after it asked, which writes
    /// the calls that arrive after their place was given up.
    pub rounds: u64,
    /// The writer goes round without sleeping until `rounds` reaches this.
    pub wanted_rounds: u64,
}

impl Shared {
    pub fn new(path: String) -> Shared {
        Shared {
            path,
            on: AtomicBool::new(true),
            order: Counter(AtomicU64::new(0)),
            rings: Mutex::new(Vec::new()),
            stray: Mutex::new(Vec::new()),
            stalled: Mutex::new(Vec::new()),
            progress: Mutex::new(Progress {
                written_below: 0,
                wanted: 0,
                rounds: 0,
                wanted_rounds: 0,
            }),
            written: Condvar::new(),
            stop: AtomicBool::new(false),
        }
    }

    pub fn progress(&self) -> MutexGuard<'_, Progress> {
        lock(&self.progress)
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Calls taken out of the rings, waiting for every call before them in the order.
#[derive(Default)]
pub(crate) struct Reorder {
    /// The first place not yet written.
    next: u64,
    /// Entries at or after `next`, sorted by place once [`Reorder::take_ready`] ran.
    waiting: Vec<Entry>,
}

impl Reorder {
    pub fn waiting(&mut self) -> &mut Vec<Entry> {
        &mut self.waiting
    }

    pub fn next(&self) -> u64 {
        self.next
    }

    /// Format, in order, the entries that have every place before them written.
    pub fn take_ready(&mut self, text: &mut Vec<u8>) {
        // Stable sort: the rings' runs, each already in order, are merged.
        self.waiting.sort_by_key(|e| e.seq);
        let mut ready = 0;
        for entry in &self.waiting {
            if entry.seq > self.next {
                break;
            }
            // An entry behind `next` arrived after its gap was given up: written as it comes.
            if entry.seq == self.next {
                self.next += 1;
            }
            format_line(text, &entry.call);
            ready += 1;
        }
        self.waiting.drain(..ready);
    }

    /// Stop waiting for the missing place before the first waiting entry (or before `to`).
    pub fn skip_gap(&mut self, to: u64) {
        let to = self.waiting.first().map_or(to, |e| e.seq.min(to));
        self.next = self.next.max(to);
    }

    /// Forget every waiting entry (recording stopped).
    pub fn clear(&mut self) {
        self.waiting.clear();
    }
}

/// The writer thread's loop: `meta` first, then round after round until the recorder is dropped.
pub(crate) fn run(mut file: File, shared: &Shared, meta: Vec<u8>) {
    let mut text = meta;
    let mut order = Reorder::default();
    let mut closed = Vec::new();
    let mut stalled_since: Option<Instant> = None;
    loop {
        let stopping = shared.stop.load(Ordering::Acquire);
        {
            let mut rings = lock(&shared.rings);
            for ring in rings.iter() {
                // Read before draining: a closed ring gets nothing after this drain.
                closed.push(ring.is_closed());
                ring.drain(order.waiting());
            }
            let mut gone = closed.drain(..);
            rings.retain(|_| !gone.next().unwrap_or(false));
        }
        order.waiting().append(&mut lock(&shared.stray));
        for thread in lock(&shared.stalled).drain(..) {
            thread.unpark();
        }
        let before = order.next();
        order.take_ready(&mut text);
        if shared.on.load(Ordering::Relaxed) {
            if !text.is_empty() {
                if let Err(e) = file.write_all(&text) {
                    shared.on.store(false, Ordering::Relaxed);
                    let _ = writeln!(
                        std::io::stderr(),
                        "resmem: recording to {} stopped: {e}; the program goes on unrecorded",
                        shared.path
                    );
                }
            }
        } else {
            order.clear();
        }
        text.clear();
        let (wanted, again) = {
            let mut progress = shared.progress();
            progress.written_below = order.next();
            progress.rounds += 1;
            shared.written.notify_all();
            (progress.wanted, progress.rounds < progress.wanted_rounds)
        };
        if stopping {
            return;
        }
        if again {
            continue;
        }
        if wanted > order.next() && shared.on.load(Ordering::Relaxed) {
            // A flush waits: go round again soon; give up a gap that lasts.
            let since = match stalled_since {
                Some(since) if order.next() == before => since,
                _ => Instant::now(),
            };
            if since.elapsed() >= GAP_WAIT {
                order.skip_gap(wanted);
                stalled_since = None;
            } else {
                stalled_since = Some(since);
                std::thread::sleep(Duration::from_micros(50));
            }
        } else {
            stalled_since = None;
            std::thread::park_timeout(ROUND);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::line::Call;
    use super::*;

    fn free(seq: u64) -> Entry {
        Entry {
            seq,
            call: Call::Free { ptr: seq },
        }
    }

    fn ready(order: &mut Reorder) -> String {
        let mut text = Vec::new();
        order.take_ready(&mut text);
        String::from_utf8(text).unwrap()
    }

    #[test]
    fn calls_are_written_in_order_once_nothing_before_them_is_missing() {
        let mut order = Reorder::default();
        // Two threads' runs; place 2 is still in a third thread's hands.
        order.waiting().extend([free(0), free(3), free(5)]);
        order.waiting().extend([free(1), free(4)]);
        assert_eq!(
            ready(&mut order),
            "{\"op\":\"free\",\"id\":0}\n{\"op\":\"free\",\"id\":1}\n"
        );
        assert_eq!(order.next(), 2);
        assert_eq!(ready(&mut order), "");
        order.waiting().push(Entry {
            seq: 2,
            call: Call::Skip,
        });
        assert_eq!(
            ready(&mut order),
            "{\"op\":\"free\",\"id\":3}\n{\"op\":\"free\",\"id\":4}\n{\"op\":\"free\",\"id\":5}\n"
        );
        assert_eq!(order.next(), 6);
    }

    #[test]
    fn a_gap_given_up_lets_the_rest_through_and_its_call_comes_late() {
        let mut order = Reorder::default();
        order.waiting().extend([free(0), free(2), free(3)]);
        assert_eq!(ready(&mut order), "{\"op\":\"free\",\"id\":0}\n");
        order.skip_gap(10);
        assert_eq!(order.next(), 2);
        assert_eq!(
            ready(&mut order),
            "{\"op\":\"free\",\"id\":2}\n{\"op\":\"free\",\"id\":3}\n"
        );
        order.waiting().push(free(1));
        assert_eq!(ready(&mut order), "{\"op\":\"free\",\"id\":1}\n");
        assert_eq!(order.next(), 4);
        // Nothing waiting: the gap up to what a flush wants is given up.
        order.skip_gap(6);
        assert_eq!(order.next(), 6);
    }
}
