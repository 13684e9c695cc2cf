//! A fast hasher for the pool's integer keys (device addresses, stream handles), which are
//! trusted and 512-byte aligned: SipHash would be most of the cost of a cache hit.

use std::hash::{BuildHasherDefault, Hasher};

/// Multiply-and-fold hashing of one `u64`; every input bit reaches the low bits the table uses.
#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }

    fn write_u32(&mut self, n: u32) {
        self.0 ^= u64::from(n);
    }
}

/// A `HashMap` keyed by integers with [`IntHasher`].
pub type IntMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// A `HashSet` of integers with [`IntHasher`].
pub type IntSet<K> = std::collections::HashSet<K, BuildHasherDefault<IntHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn aligned_keys_spread_over_low_bits() {
        let build = BuildHasherDefault::<IntHasher>::default();
        let mut seen = std::collections::HashSet::new();
        for i in 0..4096u64 {
            seen.insert(build.hash_one(0x7000_0000_0000 + i * 512) & 1023);
        }
        assert!(seen.len() > 900, "only {} of 1024 buckets used", seen.len());
    }
}
