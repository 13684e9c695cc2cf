//! Byte counts for people: parsing `24GiB`-style sizes and printing GiB / MiB figures.

/// Parse a size such as `24GiB`, `80GB`, `1676MiB` or a plain number of bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    cuda_sim::parse_size(text).ok_or_else(|| {
        format!("`{text}` is not a size: write a number with a unit, such as 24GiB, 80GB or 512MiB")
    })
}

/// `7.49 GiB`, `784.00 MiB`, `12.0 KiB` or `512 B`: two decimals in the largest unit under 1024.
pub fn gib_or_mib(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b >= KIB * KIB * KIB {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    } else if b >= KIB * KIB {
        format!("{:.2} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.2} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip_through_people() {
        assert_eq!(parse_size("24GiB").unwrap(), 24 << 30);
        assert_eq!(parse_size("1676MiB").unwrap(), 1676 << 20);
        assert!(parse_size("lots").unwrap_err().contains("24GiB"));
        assert_eq!(gib_or_mib(24 << 30), "24.00 GiB");
        assert_eq!(gib_or_mib(784 << 20), "784.00 MiB");
        assert_eq!(gib_or_mib(1536), "1.50 KiB");
        assert_eq!(gib_or_mib(512), "512 B");
    }
}
