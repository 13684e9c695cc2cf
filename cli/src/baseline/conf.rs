//! PyTorch's allocator settings, as a snapshot records them (`allocator_settings`) or as
//! `PYTORCH_CUDA_ALLOC_CONF` gives them: what the torch policy replays, and what it says it does
//! not model.

use super::torch::{TorchConfig, LARGE_BUFFER, POWER2_INTERVALS};

/// The allocator settings PyTorch ran with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TorchSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF` as PyTorch read it.
    pub conf: String,
    /// `max_split_size`, `max_non_split_rounding`, `roundup_power2_divisions` and
    /// `expandable_segments`, which the torch policy replays.
    pub config: TorchConfig,
    /// A `garbage_collection_threshold` was set (it acts only under a memory fraction, which
    /// neither a snapshot nor a trace records; not modelled).
    pub garbage_collection: bool,
}

const MIB: u64 = 1 << 20;

/// `conf` read as PyTorch reads `PYTORCH_CUDA_ALLOC_CONF` (`key:value` pairs separated by
/// commas; `roundup_power2_divisions` one number for every interval or a list
/// `[256:1,512:2,>:4]` of interval starts in MiB), with PyTorch's checks. Settings that do not
/// change where device memory goes (`pinned_*`, `release_lock_on_cudamalloc`, ...) are
/// accepted; `backend:cudaMallocAsync`, which replaces the policy, is refused.
pub fn parse(conf: &str) -> Result<TorchSettings, String> {
    let tokens = lex(conf);
    let mut settings = TorchSettings {
        conf: conf.to_string(),
        ..TorchSettings::default()
    };
    let mut i = 0;
    while i < tokens.len() {
        let key = tokens[i].as_str();
        expect(&tokens, i + 1, ":", key)?;
        let value = tokens
            .get(i + 2)
            .ok_or_else(|| format!("PYTORCH_CUDA_ALLOC_CONF: {key} has no value"))?;
        i += 3;
        match key {
            "max_split_size_mb" => {
                settings.config.max_split_size = Some(at_least_large_buffer(key, value)?);
            }
            "max_non_split_rounding_mb" => {
                settings.config.max_non_split_rounding = Some(at_least_large_buffer(key, value)?);
            }
            "roundup_power2_divisions" if value == "[" => {
                i = divisions_list(&tokens, i, &mut settings.config)?;
            }
            "roundup_power2_divisions" => {
                let divisions = power_of_two(key, value)?;
                settings.config.roundup_power2_divisions = [divisions; POWER2_INTERVALS];
            }
            "expandable_segments" => settings.config.expandable_segments = boolean(key, value)?,
            "garbage_collection_threshold" => {
                let t: f64 = value.parse().map_err(|_| bad(key, value))?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(format!(
                        "PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold must be between \
                         0.0 and 1.0, not {value}"
                    ));
                }
                settings.garbage_collection = true;
            }
            "backend" if value == "native" => {}
            "backend" => {
                return Err(format!(
                    "PYTORCH_CUDA_ALLOC_CONF: backend:{value} replaces PyTorch's caching \
                     allocator, which is the policy replayed; only backend:native is modelled"
                ))
            }
            "release_lock_on_cudamalloc"
            | "pinned_use_cuda_host_register"
            | "pinned_num_register_threads"
            | "pinned_reserve_segment_size_mb"
            | "pinned_use_background_threads"
            | "graph_capture_record_stream_reuse" => {}
            _ => return Err(format!("PYTORCH_CUDA_ALLOC_CONF: unknown option {key}")),
        }
        if i < tokens.len() {
            expect(&tokens, i, ",", key)?;
            i += 1;
        }
    }
    Ok(settings)
}

/// The list form of `roundup_power2_divisions` from after its `[` at `i`; the place after its
/// `]`. As PyTorch fills it: the first entry's divisions also below its interval, `>` from the
/// last entry's interval to the end.
fn divisions_list(
    tokens: &[String],
    mut i: usize,
    config: &mut TorchConfig,
) -> Result<usize, String> {
    const KEY: &str = "roundup_power2_divisions";
    let (mut first, mut last) = (true, 0);
    let divisions = &mut config.roundup_power2_divisions;
    loop {
        let start = tokens
            .get(i)
            .ok_or_else(|| format!("PYTORCH_CUDA_ALLOC_CONF: {KEY} lacks its closing ]"))?;
        if start == "]" {
            return Ok(i + 1);
        }
        expect(tokens, i + 1, ":", KEY)?;
        let value = tokens.get(i + 2).map(String::as_str).unwrap_or("");
        let d = match number(KEY, value)? {
            0 => 0,
            d => power_of_two(KEY, value).map(|_| d)?,
        };
        if start == ">" {
            divisions[last..].fill(d);
        } else {
            let mib = power_of_two(KEY, start)?;
            let at = (mib.ilog2() as usize).min(POWER2_INTERVALS - 1);
            if first {
                divisions[..at].fill(d);
                first = false;
            }
            divisions[at] = d;
            last = at;
        }
        i += 3;
        if tokens.get(i).is_some_and(|t| t == ",") {
            i += 1;
        }
    }
}

/// PyTorch's tokens: `,` `:` `[` `]` each alone, everything else between them, spaces dropped.
fn lex(conf: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    for c in conf.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                tokens.push(std::mem::take(&mut word));
            }
            tokens.push(c.to_string());
        } else if c != ' ' {
            word.push(c);
        }
    }
    if !word.is_empty() {
        tokens.push(word);
    }
    tokens
}

fn expect(tokens: &[String], i: usize, want: &str, key: &str) -> Result<(), String> {
    match tokens.get(i) {
        Some(t) if t == want => Ok(()),
        Some(t) => Err(format!(
            "PYTORCH_CUDA_ALLOC_CONF: expected {want} after {key}, found {t}"
        )),
        None => Err(format!(
            "PYTORCH_CUDA_ALLOC_CONF: expected {want} after {key}"
        )),
    }
}

fn bad(key: &str, value: &str) -> String {
    format!("PYTORCH_CUDA_ALLOC_CONF: {value} is not a valid value for {key}")
}

fn number(key: &str, value: &str) -> Result<u64, String> {
    value.parse().map_err(|_| bad(key, value))
}

/// A size in MiB that PyTorch requires to be at least its 20 MiB large-pool segment
/// (`max_split_size_mb`, `max_non_split_rounding_mb`), in bytes.
fn at_least_large_buffer(key: &str, value: &str) -> Result<u64, String> {
    let mb = number(key, value)?;
    if mb < LARGE_BUFFER / MIB {
        return Err(format!(
            "PYTORCH_CUDA_ALLOC_CONF: {key} must be at least {}, as PyTorch requires",
            LARGE_BUFFER / MIB
        ));
    }
    Ok(mb.saturating_mul(MIB))
}

fn power_of_two(key: &str, value: &str) -> Result<u64, String> {
    let n = number(key, value)?;
    if n.is_power_of_two() {
        Ok(n)
    } else {
        Err(format!(
            "PYTORCH_CUDA_ALLOC_CONF: {key} takes powers of two, not {value}"
        ))
    }
}

fn boolean(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(format!(
            "PYTORCH_CUDA_ALLOC_CONF: {key} takes True or False, not {value}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn divisions(pairs: &[(usize, u64)]) -> [u64; POWER2_INTERVALS] {
        let mut d = [0; POWER2_INTERVALS];
        for &(i, v) in pairs {
            d[i] = v;
        }
        d
    }

    #[test]
    fn the_settings_are_read_as_pytorch_reads_them() {
        let s = parse("max_split_size_mb:128, roundup_power2_divisions:4").unwrap();
        assert_eq!(s.config.max_split_size, Some(128 << 20));
        assert_eq!(s.config.roundup_power2_divisions, [4; POWER2_INTERVALS]);
        assert_eq!(s.conf, "max_split_size_mb:128, roundup_power2_divisions:4");
        assert!(!s.config.expandable_segments && !s.garbage_collection);
        // The list: its first entry below its interval too, `>` from the last entry on.
        let s = parse("roundup_power2_divisions:[4:2,256:1,512:0,>:8]").unwrap();
        let mut want = divisions(&[(0, 2), (1, 2), (2, 2), (8, 1), (9, 8)]);
        want[9..].fill(8);
        assert_eq!(s.config.roundup_power2_divisions, want);
        let s = parse("expandable_segments:True,garbage_collection_threshold:0.6").unwrap();
        assert!(s.config.expandable_segments && s.garbage_collection);
        assert_eq!(s.config.max_split_size, None);
        let s = parse("max_split_size_mb:64,max_non_split_rounding_mb:256").unwrap();
        assert_eq!(s.config.max_non_split_rounding, Some(256 << 20));
        assert_eq!(
            parse("max_split_size_mb:64")
                .unwrap()
                .config
                .max_non_split_rounding,
            None
        );
        let s = parse("backend:native,pinned_num_register_threads:8").unwrap();
        assert_eq!(s.config, TorchConfig::default());
        assert_eq!(parse("").unwrap().config, TorchConfig::default());
    }

    #[test]
    fn settings_pytorch_refuses_are_refused() {
        for (conf, message) in [
            (
                "max_split_size_mb:19",
                "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb must be at least 20, as PyTorch \
                 requires",
            ),
            (
                "max_non_split_rounding_mb:19",
                "PYTORCH_CUDA_ALLOC_CONF: max_non_split_rounding_mb must be at least 20, as \
                 PyTorch requires",
            ),
            (
                "roundup_power2_divisions:3",
                "PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions takes powers of two, not 3",
            ),
            (
                "roundup_power2_divisions:[256:2",
                "PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions lacks its closing ]",
            ),
            (
                "expandable_segments:yes",
                "PYTORCH_CUDA_ALLOC_CONF: expandable_segments takes True or False, not yes",
            ),
            (
                "garbage_collection_threshold:1.5",
                "PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold must be between 0.0 and \
                 1.0, not 1.5",
            ),
            (
                "backend:cudaMallocAsync",
                "PYTORCH_CUDA_ALLOC_CONF: backend:cudaMallocAsync replaces PyTorch's caching \
                 allocator, which is the policy replayed; only backend:native is modelled",
            ),
            (
                "max_split",
                "PYTORCH_CUDA_ALLOC_CONF: expected : after max_split",
            ),
            (
                "max_split_size_mb:128;x",
                "PYTORCH_CUDA_ALLOC_CONF: 128;x is not a valid value for max_split_size_mb",
            ),
            ("sizes:4", "PYTORCH_CUDA_ALLOC_CONF: unknown option sizes"),
        ] {
            assert_eq!(parse(conf).unwrap_err(), message, "{conf}");
        }
    }
}
