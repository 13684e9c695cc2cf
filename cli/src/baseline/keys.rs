//! Small helpers of the baseline's books: a hash map for device addresses, and byte counts in
//! its messages.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashing of one integer key (a device address, 512-byte aligned): a multiply that carries
/// every input bit to the high bits, folded down to the low bits a table uses.
#[derive(Default, Clone, Copy)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

/// A map keyed by device addresses.
pub type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// `784.00 MiB (822083584 bytes)`: the unit for reading, the exact count for checking.
pub fn bytes(n: u64) -> String {
    format!("{} ({n} bytes)", crate::units::gib_or_mib(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_spread_and_counts_read_both_ways() {
        let mut map = AddrMap::default();
        for i in 0..1000u64 {
            map.insert(0x7000_0000_0000 + i * 512, i);
        }
        assert_eq!(map.len(), 1000);
        assert_eq!(map[&(0x7000_0000_0000 + 999 * 512)], 999);
        assert_eq!(bytes(784 << 20), "784.00 MiB (822083584 bytes)");
        assert_eq!(bytes(512), "512 B (512 bytes)");
    }
}
