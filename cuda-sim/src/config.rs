//! What configures a simulator from the environment: the variables' names, and the parsing of
//! sizes and device lists.

use crate::PAGE;

/// The environment variable that configures [`crate::Sim::from_env`].
pub(crate) const ENV_VAR: &str = "CUDA_SIM_DEVICES";
/// The environment variable that scripts faults for [`crate::Sim::from_env`] (see [`crate::Fault`]).
pub(crate) const FAULTS_VAR: &str = "CUDA_SIM_FAULTS";
/// Names the file through which processes share the devices' capacity.
pub(crate) const SHARED_VAR: &str = "CUDA_SIM_SHARED";
/// The delays of driver calls (see `delays.rs`).
pub(crate) const DELAYS_VAR: &str = "CUDA_SIM_DELAYS";
/// The shape of the virtual-memory API (see [`crate::VmmSetting`]).
pub(crate) const VMM_VAR: &str = "CUDA_SIM_VMM";
/// The configuration used when `CUDA_SIM_DEVICES` is unset.
pub(crate) const DEFAULT_DEVICES: &str = "24GiB";

/// Parses a byte size such as `"24GiB"`, `"80 GiB"`, `"1.5GiB"`, `"24GB"`
/// (24 * 10^9), `"2MB"`, `"4KiB"` or `"1048576"`.
///
/// Units are case-insensitive: `B`, `KB`, `MB`, `GB`, `TB` (powers of 1000)
/// and `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024); no unit means bytes.
/// Whitespace may separate the number from the unit. A fraction is accepted
/// when the result is a whole number of bytes. Returns `None` for anything
/// else, including negative numbers and values that overflow `u64`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim_start());
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    if !whole.bytes().all(|b| b.is_ascii_digit()) || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let fraction = fraction.trim_end_matches('0');
    if whole.len() > 30 || fraction.len() > 20 {
        return None;
    }
    let whole_value: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let fraction_value: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().ok()?
    };
    let scale = 10u128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
    let fraction_bytes = fraction_value.checked_mul(multiplier)?;
    if fraction_bytes % scale != 0 {
        return None;
    }
    let total = whole_value
        .checked_mul(multiplier)?
        .checked_add(fraction_bytes / scale)?;
    u64::try_from(total).ok()
}

/// Parses a device list: comma-separated capacities such as `"24GiB"` or
/// `"80GiB,80GiB"` (see [`parse_size`]), one device per entry.
///
/// Fails, with a message naming the bad part, when the list is empty, an
/// entry is not a size, or a capacity is smaller than one [`PAGE`].
pub fn parse_devices(s: &str) -> Result<Vec<u64>, String> {
    if s.trim().is_empty() {
        return Err(
            "the device list is empty; expected capacities such as \"24GiB\" or \"80GiB,80GiB\""
                .to_string(),
        );
    }
    s.split(',')
        .enumerate()
        .map(|(i, part)| {
            let size = parse_size(part).ok_or_else(|| {
                format!(
                    "device {i}: {:?} is not a size (examples: \"24GiB\", \"512MiB\", \"24GB\")",
                    part.trim()
                )
            })?;
            if size < PAGE {
                return Err(format!(
                    "device {i}: capacity {:?} is smaller than one 2 MiB page",
                    part.trim()
                ));
            }
            Ok(size)
        })
        .collect()
}

/// Formats a page-aligned capacity for device names: `"24 GiB"`, `"1536 MiB"`.
pub(crate) fn human_size(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else if bytes % MIB == 0 {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{bytes} B")
    }
}
