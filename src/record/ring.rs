//! A thread's recorded calls on their way to the writer thread: a fixed ring of five-word
//! entries with one producer (the thread) and one consumer (the writer). Pushing is a few
//! plain stores and one release store of `head`: no lock, no read-modify-write.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::line::{Entry, Words};

/// Entries a ring holds; a power of two.
pub(crate) const CAPACITY: usize = 2048;

pub(crate) struct Ring {
    slots: Box<[[AtomicU64; 5]]>,
    /// Entries pushed so far; stored only by the owning thread.
    head: AtomicUsize,
    /// Entries taken so far; stored only by the writer.
    tail: AtomicUsize,
    /// Set when the owning thread is gone: once drained, the ring can be forgotten.
    closed: AtomicBool,
}

impl Ring {
    pub fn new() -> Ring {
        Ring {
            slots: (0..CAPACITY).map(|_| Default::default()).collect(),
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        }
    }

    /// Append `entry` (owning thread only): the number of entries now waiting, or `None` when
    /// the ring is full and nothing was appended.
    #[inline]
    pub fn push(&self, entry: Entry) -> Option<usize> {
        let head = self.head.load(Ordering::Relaxed);
        // Acquire: the writer has finished reading the slots it gave back.
        let waiting = head.wrapping_sub(self.tail.load(Ordering::Acquire));
        if waiting >= CAPACITY {
            return None;
        }
        let slot = &self.slots[head & (CAPACITY - 1)];
        for (word, value) in slot.iter().zip(entry.to_words()) {
            word.store(value, Ordering::Relaxed);
        }
        // Release: the slot's words are visible to whoever sees the new head.
        self.head.store(head.wrapping_add(1), Ordering::Release);
        Some(waiting + 1)
    }

    /// Move every entry pushed so far to `out` (writer only).
    pub fn drain(&self, out: &mut Vec<Entry>) {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let mut at = tail;
        while at != head {
            let slot = &self.slots[at & (CAPACITY - 1)];
            let words: Words = std::array::from_fn(|i| slot[i].load(Ordering::Relaxed));
            out.push(Entry::from_words(words));
            at = at.wrapping_add(1);
        }
        self.tail.store(head, Ordering::Release);
    }

    /// The owning thread is gone (it pushes nothing more).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Whether the owning thread is gone; read before the last [`Ring::drain`].
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::super::line::Call;
    use super::*;
    use std::sync::Arc;

    fn free(seq: u64) -> Entry {
        Entry {
            seq,
            call: Call::Free { ptr: seq * 512 },
        }
    }

    #[test]
    fn a_full_ring_refuses_until_drained() {
        let ring = Ring::new();
        for n in 0..CAPACITY as u64 {
            assert_eq!(ring.push(free(n)), Some(n as usize + 1));
        }
        assert_eq!(ring.push(free(9999)), None);
        let mut out = Vec::new();
        ring.drain(&mut out);
        assert_eq!(out.len(), CAPACITY);
        assert_eq!(out[0], free(0));
        assert_eq!(out[CAPACITY - 1], free(CAPACITY as u64 - 1));
        assert_eq!(ring.push(free(7)), Some(1));
        out.clear();
        ring.drain(&mut out);
        assert_eq!(out, vec![free(7)]);
    }

    #[test]
    fn entries_cross_threads_whole_and_in_order() {
        let ring = Arc::new(Ring::new());
        let producer = Arc::clone(&ring);
        const N: u64 = 100_000;
        let thread = std::thread::spawn(move || {
            for n in 0..N {
                while producer.push(free(n)).is_none() {
                    std::thread::yield_now();
                }
            }
            producer.close();
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
