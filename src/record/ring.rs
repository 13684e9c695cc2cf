//! A thread's recorded calls on their way to the writer thread: a fixed ring of five-word
//! entries with one producer (the thread) and one consumer (the writer). Pushing is a few
//! plain stores and one release store of `head`: no lock, no read-modify-write.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::line::{Entry, Words};

/// Entries a ring holds; a power of two.
pub(crate) const CAPACITY: usize = 2048;

/// A counter alone on its cache line, so that the thread's stores and the writer's do not
/// take the line from each other.
#[repr(align(128))]
struct Own(AtomicUsize);

pub(crate) struct Ring {
    slots: Box<[[AtomicU64; 5]]>,
    /// Entries pushed so far; stored only by the owning thread.
    head: Own,
    /// Entries taken so far; stored only by the writer.
    tail: Own,
    /// Set when the owning thread is gone: once drained, the ring can be forgotten.
    closed: AtomicBool,
}

/// The owning thread's end of a ring: where it writes next, and where it next looks at the
/// writer's progress (half a ring behind: time to wake the writer; a whole ring: full).
pub(crate) struct Producer {
    ring: Arc<Ring>,
    head: usize,
    look_at: usize,
}

impl Ring {
    pub fn new() -> Ring {
        Ring {
            slots: (0..CAPACITY).map(|_| Default::default()).collect(),
            head: Own(AtomicUsize::new(0)),
            tail: Own(AtomicUsize::new(0)),
            closed: AtomicBool::new(false),
        }
    }

    /// Move every entry pushed so far to `out` (writer only).
    pub fn drain(&self, out: &mut Vec<Entry>) {
        let tail = self.tail.0.load(Ordering::Relaxed);
        let head = self.head.0.load(Ordering::Acquire);
        let mut at = tail;
        while at != head {
            let slot = &self.slots[at & (CAPACITY - 1)];
            let words: Words = std::array::from_fn(|i| slot[i].load(Ordering::Relaxed));
            out.push(Entry::from_words(words));
            at = at.wrapping_add(1);
        }
        // Release: the slots are read before the producer may write them again.
        self.tail.0.store(head, Ordering::Release);
    }

    /// Whether the owning thread is gone; read before the last [`Ring::drain`].
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

impl Producer {
    /// The only producer of `ring`, a new one.
    pub fn new(ring: Arc<Ring>) -> Producer {
        Producer {
            ring,
            head: 0,
            look_at: CAPACITY / 2,
        }
    }

    /// Append `entry`: `Some(wake)`, `wake` true when half a ring or more waits for the writer
    /// (said once per half ring), or `None` when the ring is full and nothing was appended.
    #[inline]
    pub fn push(&mut self, entry: Entry) -> Option<bool> {
        let mut wake = false;
        if self.head == self.look_at {
            // Acquire: the writer has finished reading the slots it gave back.
            let tail = self.ring.tail.0.load(Ordering::Acquire);
            if self.head == tail + CAPACITY {
                return None;
            }
            wake = self.head >= tail + CAPACITY / 2;
            self.look_at = if wake {
                tail + CAPACITY
            } else {
                tail + CAPACITY / 2
            };
        }
        let slot = &self.ring.slots[self.head & (CAPACITY - 1)];
        for (word, value) in slot.iter().zip(entry.to_words()) {
            word.store(value, Ordering::Relaxed);
        }
        self.head += 1;
        // Release: the slot's words are visible to whoever sees the new head.
        self.ring.head.0.store(self.head, Ordering::Release);
        Some(wake)
    }
}

impl Drop for Producer {
    /// The thread is gone (or records for another recorder now): it pushes nothing more.
    fn drop(&mut self) {
        self.ring.closed.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::super::line::Call;
    use super::*;

    fn free(seq: u64) -> Entry {
        Entry {
            seq,
            call: Call::Free { ptr: seq * 512 },
        }
    }

    #[test]
    fn a_full_ring_refuses_until_drained() {
        let ring = Arc::new(Ring::new());
        let mut producer = Producer::new(Arc::clone(&ring));
        for n in 1..=CAPACITY as u64 {
            // Half a ring waiting: the writer is to be woken, once.
            let half = n == CAPACITY as u64 / 2 + 1;
            assert_eq!(producer.push(free(n)), Some(half));
        }
        assert_eq!(producer.push(free(9999)), None);
        let mut out = Vec::new();
        ring.drain(&mut out);
        assert_eq!(out.len(), CAPACITY);
        assert_eq!(out[0], free(1));
        assert_eq!(out[CAPACITY - 1], free(CAPACITY as u64));
        assert_eq!(producer.push(free(7)), Some(false));
        out.clear();
        ring.drain(&mut out);
        assert_eq!(out, vec![free(7)]);
        // Drained as it goes: nothing to wake the writer for, a whole ring later.
        for n in 0..2 * CAPACITY as u64 {
            assert_eq!(producer.push(free(n)), Some(false));
            ring.drain(&mut out);
        }
        assert!(!ring.is_closed());
        drop(producer);
        assert!(ring.is_closed());
    }

    #[test]
    fn entries_cross_threads_whole_and_in_order() {
        let ring = Arc::new(Ring::new());
        let mut producer = Producer::new(Arc::clone(&ring));
        const N: u64 = 100_000;
        let thread = std::thread::spawn(move || {
            for n in 0..N {
                while producer.push(free(n)).is_none() {
                    std::thread::yield_now();
                }
            }
        });
        let mut out = Vec::new();
        loop {
            let closed = ring.is_closed();
            ring.drain(&mut out);
            if closed {
                break;
            }
            std::thread::yield_now();
        }
        thread.join().unwrap();
        assert_eq!(out.len(), N as usize);
        assert!(out.iter().enumerate().all(|(n, e)| *e == free(n as u64)));
    }
}
