//! From a block's address to its entry, without a lock: a radix tree over 48-bit addresses with
//! one slot per 512-byte granule (the pool's alignment). Levels are created on first use and
//! never freed while the front lives, so a reader follows them with plain atomic loads; a slot
//! holds an entry index plus one (`0`: no block the front knows starts there).
//!
//! Bits 47..33 pick one of 32 Ki top slots, 32..18 one of 32 Ki in a middle level covering
//! 8 GiB, and 17..9 the slot in a 2 KiB leaf covering 256 KiB, so memory follows the blocks'
//! spread: a sparse 4 MiB block costs one leaf.

use std::alloc::{self, Layout};
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use crate::driver::DevicePtr;

/// Addresses at or above this are not kept (the front passes them to the pool).
pub const LIMIT: DevicePtr = 1 << 48;

const WIDE: usize = 1 << 15;
const LEAF: usize = 512;

type Leaf = [AtomicU32; LEAF];
/// A level: pointers to the next levels, null until made. Fixed sizes, so that a lookup
/// indexes them with no bounds check.
type Level<T> = [AtomicPtr<T>; WIDE];

/// A new zeroed `T` on the heap, made there (not on the stack first). Only for the levels
/// here and the seats of `seats.rs`: arrays of atomic integers and pointers, of non-zero sizes,
/// for which zero bytes are a valid value.
pub(super) fn zeroed<T>() -> Box<T> {
    let layout = Layout::new::<T>();
    // SAFETY: `T` has a non-zero size (see above).
    let at = unsafe { alloc::alloc_zeroed(layout) }.cast::<T>();
    if at.is_null() {
        alloc::handle_alloc_error(layout);
    }
    // SAFETY: allocated above with `T`'s layout, and `T` (arrays of atomic integers and
    // pointers) is valid with zero bytes.
    unsafe { Box::from_raw(at) }
}

/// The level at `slot`, made if it is missing (a race to make it keeps the first one made).
fn level_at<T>(slot: &AtomicPtr<T>) -> &T {
    let mut at = slot.load(Ordering::Acquire);
    if at.is_null() {
        let made = Box::into_raw(zeroed::<T>());
        at = match slot.compare_exchange(ptr::null_mut(), made, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => made,
            Err(first) => {
                // SAFETY: made just above and published nowhere.
                drop(unsafe { Box::from_raw(made) });
                first
            }
        };
    }
    // SAFETY: a non-null slot holds a level made by `level_at`, freed only when the map drops.
    unsafe { &*at }
}

/// The level at `slot`, if made.
#[inline(always)]
fn level_if<T>(slot: &AtomicPtr<T>) -> Option<&T> {
    // SAFETY: as in `level_at`.
    unsafe { slot.load(Ordering::Acquire).as_ref() }
}

/// The map.
pub struct AddressMap {
    top: Box<Level<Level<Leaf>>>,
}

impl Default for AddressMap {
    fn default() -> Self {
        AddressMap { top: zeroed() }
    }
}

impl Drop for AddressMap {
    fn drop(&mut self) {
        for middle in self.top.iter() {
            let middle = middle.load(Ordering::Acquire);
            if middle.is_null() {
                continue;
            }
            // SAFETY: made by `level_at` with `Box::into_raw`, reachable only from here now.
            let middle = unsafe { Box::from_raw(middle) };
            for leaf in middle.iter() {
                let leaf = leaf.load(Ordering::Acquire);
                if !leaf.is_null() {
                    // SAFETY: as above.
                    drop(unsafe { Box::from_raw(leaf) });
                }
            }
        }
    }
}

fn parts(ptr: DevicePtr) -> [usize; 3] {
    [
        (ptr >> 33) as usize & (WIDE - 1),
        (ptr >> 18) as usize & (WIDE - 1),
        (ptr >> 9) as usize & (LEAF - 1),
    ]
}

impl AddressMap {
    /// The entry whose block starts at `ptr`, if one was set and not cleared.
    #[inline]
    pub fn get(&self, ptr: DevicePtr) -> Option<u32> {
        if ptr >= LIMIT || ptr % 512 != 0 {
            return None;
        }
        let [a, b, c] = parts(ptr);
        let leaf = level_if(&level_if(&self.top[a])?[b])?;
        leaf[c].load(Ordering::Acquire).checked_sub(1)
    }

    /// Note that the block at `ptr` (below [`LIMIT`], 512-byte aligned) has entry `index`.
    pub fn set(&self, ptr: DevicePtr, index: u32) {
        debug_assert!(ptr < LIMIT && ptr % 512 == 0);
        let [a, b, c] = parts(ptr);
        let leaf = level_at(&level_at(&self.top[a])[b]);
        leaf[c].store(index + 1, Ordering::Release);
    }

    /// Forget the block at `ptr`.
    pub fn clear(&self, ptr: DevicePtr) {
        let [a, b, c] = parts(ptr);
        if let Some(leaf) = level_if(&self.top[a]).and_then(|l| level_if(&l[b])) {
            leaf[c].store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_clear_at_exact_addresses_only() {
        let map = AddressMap::default();
        let base = 0x7000_0000_0000;
        assert_eq!(map.get(base), None);
        map.set(base, 0);
        map.set(base + 512, 7);
        map.set(base + (3 << 30), 9);
        assert_eq!(map.get(base), Some(0));
        assert_eq!(map.get(base + 512), Some(7));
        assert_eq!(map.get(base + (3 << 30)), Some(9));
        // Interior, unaligned, neighbouring and out-of-range addresses find nothing.
        assert_eq!(map.get(base + 1024), None);
        assert_eq!(map.get(base + 8), None);
        assert_eq!(map.get(base - 512), None);
        assert_eq!(map.get(LIMIT + base), None);
        map.clear(base + 512);
        assert_eq!(map.get(base + 512), None);
        assert_eq!(map.get(base), Some(0));
        map.clear(0x10_0000_0000); // never set: nothing happens
    }
}
