//! From an address to the device shard whose segment holds it (its *owner*: the shard's index
//! among every device's shards, `shards.rs`), without a lock: a radix tree over 48-bit addresses
//! with one entry per 2 MiB span, written when a shard books or forgets a segment (under that
//! shard's lock) and read with atomic loads by `release` and `record_stream`.
//!
//! An entry counts the segments that touch its span and names their owner, or says that
//! segments of several owners touch it (a span two shards' segments share, where segments are
//! not 2 MiB-aligned; it stays so until its last segment goes): then, and for addresses at or
//! above [`LIMIT`], which the tree does not cover, the caller asks each shard in turn. Bits
//! 47..39 pick one of 512 top slots (512 GiB each), 38..30 one of 512 in a middle level (1 GiB
//! each), 29..21 the entry in a leaf of 512. Levels are made on first use and kept while the map
//! lives, so a reader follows them with plain atomic loads.
//!
//! A segment leaves the map *before* the driver frees its addresses (which may be handed to
//! another device at once) and is entered again if the free fails.
//!
//! A pool of one device records no segment of its first shard ([`Spans::except`]): a pointer in
//! no recorded segment is that shard's to judge. So a pool whose calls never contended (one
//! shard) books a segment at no cost per 2 MiB span, where a 24 GiB segment's 12,288 entries
//! took 200 µs under the lock, and never reads the map.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::driver::DevicePtr;

/// Addresses at or above this are not in the map.
pub const LIMIT: DevicePtr = 1 << 48;

/// The bits of a span, and of each level's index.
const SPAN_BITS: u32 = 21;
const LEVEL_BITS: u32 = 9;
const WIDE: usize = 1 << LEVEL_BITS;

/// An entry's owner field when segments of several owners touch its span.
const SEVERAL: u64 = u32::MAX as u64;

/// Who holds the segments touching an address's span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// No recorded segment.
    Nobody,
    /// Segments of this owner only.
    Shard(i32),
    /// Segments of several owners, or an address the map does not cover: ask each shard.
    Unknown,
}

type Leaf = Box<[AtomicU64]>;
type Level<T> = Box<[OnceLock<T>]>;

fn level<T>() -> Level<T> {
    (0..WIDE).map(|_| OnceLock::new()).collect()
}

/// The map. An entry is `(owner + 1) << 32 | segments`, or 0 for no segment.
pub struct Spans {
    /// The owner whose segments are not recorded, if any.
    unrecorded: Option<i32>,
    top: Level<Level<Leaf>>,
    /// Entries that are not 0, and the sum of their counts (for the check).
    occupied: AtomicUsize,
    total: AtomicU64,
}

impl Spans {
    /// A map that records no segment of `owner` (a pool of one device's first shard): a
    /// pointer in no recorded segment is that owner's to judge.
    pub fn except(owner: i32) -> Spans {
        Spans {
            unrecorded: Some(owner),
            ..Spans::default()
        }
    }
}

impl Default for Spans {
    fn default() -> Self {
        Spans {
            unrecorded: None,
            top: level(),
            occupied: AtomicUsize::new(0),
            total: AtomicU64::new(0),
        }
    }
}

/// A span's index in each level.
fn parts(span: u64) -> [usize; 3] {
    let mask = WIDE as u64 - 1;
    [
        (span >> (2 * LEVEL_BITS) & mask) as usize,
        (span >> LEVEL_BITS & mask) as usize,
        (span & mask) as usize,
    ]
}

/// The first and last span `[base, base + size)` touches below [`LIMIT`], if any.
fn bounds(base: DevicePtr, size: u64) -> Option<(u64, u64)> {
    if base >= LIMIT {
        return None;
    }
    let end = base.saturating_add(size.max(1)).min(LIMIT);
    Some((base >> SPAN_BITS, (end - 1) >> SPAN_BITS))
}

/// The spans `[base, base + size)` touches below [`LIMIT`].
fn spans(base: DevicePtr, size: u64) -> impl Iterator<Item = u64> {
    let (first, last) = bounds(base, size).map_or((1, 0), |b| b);
    first..=last
}

impl Spans {
    /// Note `owner`'s new segment `[base, base + size)`.
    pub fn add(&self, base: DevicePtr, size: u64, owner: i32) {
        if self.unrecorded == Some(owner) {
            return;
        }
        let code = u64::from(owner as u32) + 1;
        for span in spans(base, size) {
            let [a, b, c] = parts(span);
            let leaf = self.top[a].get_or_init(level)[b]
                .get_or_init(|| (0..WIDE).map(|_| AtomicU64::new(0)).collect());
            let update = |entry: u64| {
                Some(match (entry >> 32, entry & u64::from(u32::MAX)) {
                    (_, 0) => code << 32 | 1,
                    (owner, _) if owner == code => entry + 1,
                    (_, count) => SEVERAL << 32 | (count + 1),
                })
            };
            // The closure always returns `Some`: the update cannot fail.
            if let Ok(0) = leaf[c].fetch_update(Ordering::Release, Ordering::Relaxed, update) {
                self.occupied.fetch_add(1, Ordering::Relaxed);
            }
            self.total.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forget `owner`'s segment `[base, base + size)`, added before.
    pub fn remove(&self, base: DevicePtr, size: u64, owner: i32) {
        if self.unrecorded == Some(owner) {
            return;
        }
        for span in spans(base, size) {
            let Some(entry) = self.entry(span) else {
                debug_assert!(false, "a segment at {base:#x} that was never added");
                continue;
            };
            let update = |entry: u64| {
                debug_assert_ne!(entry & u64::from(u32::MAX), 0, "span without segments");
                Some(if entry & u64::from(u32::MAX) <= 1 {
                    0
                } else {
                    entry - 1
                })
            };
            let before = entry.fetch_update(Ordering::Release, Ordering::Relaxed, update);
            if before.is_ok_and(|entry| entry & u64::from(u32::MAX) == 1) {
                self.occupied.fetch_sub(1, Ordering::Relaxed);
            }
            self.total.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The entry of `span`, if its leaf was made.
    #[inline]
    fn entry(&self, span: u64) -> Option<&AtomicU64> {
        let [a, b, c] = parts(span);
        Some(&self.top[a].get()?[b].get()?[c])
    }

    /// Who holds the segments touching `ptr`'s span.
    #[inline]
    pub fn owner(&self, ptr: DevicePtr) -> Owner {
        if ptr >= LIMIT {
            return Owner::Unknown;
        }
        let Some(entry) = self.entry(ptr >> SPAN_BITS) else {
            return Owner::Nobody;
        };
        let entry = entry.load(Ordering::Acquire);
        match entry >> 32 {
            0 => Owner::Nobody,
            SEVERAL => Owner::Unknown,
            code => Owner::Shard((code - 1) as i32),
        }
    }
}

impl Spans {
    /// Check the map against `segments`, as (base, size, owner), in O(segments): the entries
    /// of the spans at each segment's ends (the only spans two segments can share) count the
    /// recorded segments touching them and name their owner (or, where several owners' segments
    /// touch them now or did since they were last empty, say so); and the number of spans with
    /// an entry and the sum of the entries' counts are those of the recorded segments' spans, so
    /// that no span is counted twice or left out and no other span has an entry.
    pub fn check(&self, segments: &[(DevicePtr, u64, i32)]) -> Result<(), String> {
        let mut ends: BTreeMap<u64, (BTreeSet<i32>, u64)> = BTreeMap::new();
        let mut spans_touched = 0u64;
        let recorded = segments
            .iter()
            .filter(|&&(_, _, owner)| self.unrecorded != Some(owner));
        for &(base, size, owner) in recorded {
            let Some((first, last)) = bounds(base, size) else {
                continue;
            };
            spans_touched += last - first + 1;
            let ends_of = if first == last {
                vec![first]
            } else {
                vec![first, last]
            };
            for span in ends_of {
                let e = ends.entry(span).or_default();
                e.0.insert(owner);
                e.1 += 1;
            }
        }
        let mut occupied = spans_touched;
        for (&span, (owners, n)) in &ends {
            occupied -= n - 1;
            let entry = self
                .entry(span)
                .map_or(0, |entry| entry.load(Ordering::Acquire));
            let (code, count) = (entry >> 32, entry & u64::from(u32::MAX));
            let one = match owners.iter().collect::<Vec<_>>()[..] {
                [&owner] => Some(u64::from(owner as u32) + 1),
                _ => None,
            };
            if count != *n || (code != SEVERAL && Some(code) != one) {
                return Err(format!(
                    "the span map's entry for {:#x} reads owner code {code} and {count} \
                     segments, but segments of owners {owners:?} touch it ({n})",
                    span << SPAN_BITS
                ));
            }
        }
        let (have, total) = (
            self.occupied.load(Ordering::Relaxed) as u64,
            self.total.load(Ordering::Relaxed),
        );
        if (have, total) != (occupied, spans_touched) {
            return Err(format!(
                "the span map has {have} spans with segments counting {total}, but the segments \
                 touch {occupied} spans, {spans_touched} counting each segment's"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn each_span_of_a_segment_names_its_owner_until_it_is_removed() {
        let spans = Spans::default();
        let base = 0x7000_0000_0000;
        assert_eq!(spans.owner(base), Owner::Nobody);
        spans.add(base, 20 * MIB, 1);
        assert_eq!(spans.owner(base), Owner::Shard(1));
        assert_eq!(spans.owner(base + 512), Owner::Shard(1));
        assert_eq!(spans.owner(base + 20 * MIB - 1), Owner::Shard(1));
        assert_eq!(spans.owner(base + 20 * MIB), Owner::Nobody);
        assert_eq!(spans.owner(base - 1), Owner::Nobody);
        // A segment across the end of a leaf (1 GiB) and of a middle level (512 GiB).
        let edge = (1 << 39) - 2 * MIB;
        spans.add(edge, 4 * MIB, 0);
        assert_eq!(spans.owner(edge), Owner::Shard(0));
        assert_eq!(spans.owner(edge + 3 * MIB), Owner::Shard(0));
        assert_eq!(spans.owner(edge + 4 * MIB), Owner::Nobody);
        spans
            .check(&[(base, 20 * MIB, 1), (edge, 4 * MIB, 0)])
            .unwrap();
        assert!(spans.check(&[(base, 20 * MIB, 1)]).is_err(), "one missing");
        assert!(spans
            .check(&[(base, 20 * MIB, 0), (edge, 4 * MIB, 0)])
            .is_err());
        spans.remove(base, 20 * MIB, 1);
        assert_eq!(spans.owner(base), Owner::Nobody);
        assert_eq!(spans.owner(base + 19 * MIB), Owner::Nobody);
        spans.remove(edge, 4 * MIB, 0);
        assert_eq!(spans.owner(edge + 3 * MIB), Owner::Nobody);
    }

    #[test]
    fn a_span_two_segments_share_is_counted_and_one_of_two_owners_is_unknown() {
        let spans = Spans::default();
        let base = 0x10_0000_0000;
        // Two segments of owner 0 meeting inside a span.
        spans.add(base, 3 * MIB, 0);
        spans.add(base + 3 * MIB, 3 * MIB, 0);
        assert_eq!(spans.owner(base + 2 * MIB), Owner::Shard(0));
        spans.remove(base, 3 * MIB, 0);
        assert_eq!(spans.owner(base), Owner::Nobody);
        assert_eq!(
            spans.owner(base + 2 * MIB),
            Owner::Shard(0),
            "still one segment"
        );
        // A segment of owner 1 in the same span: segments of both touch it.
        spans.add(base + MIB, 2 * MIB, 1);
        assert_eq!(
            spans.owner(base + MIB),
            Owner::Shard(1),
            "alone in the first span"
        );
        assert_eq!(spans.owner(base + 2 * MIB), Owner::Unknown);
        assert_eq!(spans.owner(base + 5 * MIB), Owner::Shard(0));
        spans
            .check(&[(base + 3 * MIB, 3 * MIB, 0), (base + MIB, 2 * MIB, 1)])
            .unwrap();
        spans.remove(base + MIB, 2 * MIB, 1);
        assert_eq!(
            spans.owner(base + 2 * MIB),
            Owner::Unknown,
            "unknown until the span's last segment goes"
        );
        spans.check(&[(base + 3 * MIB, 3 * MIB, 0)]).unwrap();
        spans.remove(base + 3 * MIB, 3 * MIB, 0);
        assert_eq!(spans.owner(base + 2 * MIB), Owner::Nobody);
        assert_eq!(spans.owner(base + 5 * MIB), Owner::Nobody);
    }

    #[test]
    fn addresses_beyond_the_map_are_unknown() {
        let spans = Spans::default();
        assert_eq!(spans.owner(LIMIT), Owner::Unknown);
        assert_eq!(spans.owner(u64::MAX), Owner::Unknown);
        // A segment across the limit is kept below it.
        spans.add(LIMIT - 2 * MIB, 4 * MIB, 3);
        assert_eq!(spans.owner(LIMIT - MIB), Owner::Shard(3));
        assert_eq!(spans.owner(LIMIT + MIB), Owner::Unknown);
        spans.remove(LIMIT - 2 * MIB, 4 * MIB, 3);
        assert_eq!(spans.owner(LIMIT - MIB), Owner::Nobody);
        spans.add(LIMIT + 8 * MIB, 2 * MIB, 0);
        spans.remove(LIMIT + 8 * MIB, 2 * MIB, 0);
    }

    #[test]
    fn an_unrecorded_owners_segments_are_not_written() {
        let spans = Spans::except(0);
        let base = 0x7f00_0000_0000;
        spans.add(base, 1 << 30, 0);
        assert_eq!(spans.owner(base), Owner::Nobody);
        assert_eq!(spans.occupied.load(Ordering::Relaxed), 0);
        // Another owner's segment beside it is recorded, and checked without the first.
        spans.add(base + (1 << 30), 4 * MIB, 1);
        assert_eq!(spans.owner(base + (1 << 30)), Owner::Shard(1));
        let segments = [(base, 1 << 30, 0), (base + (1 << 30), 4 * MIB, 1)];
        assert_eq!(spans.check(&segments), Ok(()));
        assert!(
            spans.check(&segments[..1]).is_err(),
            "the recorded one missing"
        );
        spans.remove(base, 1 << 30, 0);
        spans.remove(base + (1 << 30), 4 * MIB, 1);
        assert_eq!(spans.total.load(Ordering::Relaxed), 0);
        assert_eq!(spans.check(&[]), Ok(()));
    }
}
