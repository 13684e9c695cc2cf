//! Settings: `RESMEM_CONF` parsing (PyTorch's `key:value,key:value` syntax) and the choice of
//! driver. Pure functions of the variables' text; [`crate::runtime`] reads the environment.

use crate::error::Error;
use crate::pool::PoolConfig;

/// Which driver the process-wide pool uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverChoice {
    /// The real CUDA driver, loaded from this library name or path.
    Cuda(String),
    /// The in-process simulated devices.
    Sim,
}

/// Everything the environment decides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `RESMEM_DRIVER` and `RESMEM_CUDA_LIBRARY`.
    pub driver: DriverChoice,
    /// `RESMEM_CONF`, the pool's part.
    pub pool: PoolConfig,
    /// `RESMEM_CONF`'s `preload_allocations`: whether `libresmem_preload.so` also routes
    /// `cudaMalloc`/`cudaFree` and `cuMemAlloc_v2`/`cuMemFree_v2` through the pool (default
    /// off: it only makes the memory-info calls count reusable memory as free).
    pub preload_allocations: bool,
    /// `RESMEM_CONF`'s `record:PATH`: where [`crate::record`] writes every call as a trace.
    pub record: Option<String>,
    /// `RESMEM_CONF`'s `share`, `share_count` and `share_wait_ms`.
    pub share: ShareConfig,
    /// `RESMEM_CONF`'s `handle_part_mib`, in bytes: where the driver maps physical memory only
    /// from an allocation's start (the CUDA driver), the pool's handles are made of parts of
    /// this size, each lent only whole (`driver::pages`); 0, the default: a page each.
    pub handle_part: u64,
}

/// Giving idle cache to other resmem processes on the same device (see [`crate::share`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareConfig {
    /// `share`: join the device's registry, answer other processes' requests for memory, and
    /// ask them when the driver runs out. Default: off.
    pub enabled: bool,
    /// `share_count`: `rm_mem_get_info` adds the reusable bytes the other sharing processes
    /// would give up on request. Default: off.
    pub count: bool,
    /// `share_wait_ms`: how long a request waits for the others to return memory. Default 200.
    pub wait_ms: u64,
}

impl Default for ShareConfig {
    fn default() -> Self {
        ShareConfig {
            enabled: false,
            count: false,
            wait_ms: 200,
        }
    }
}

/// Everything `RESMEM_CONF` says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conf {
    /// The pool's settings.
    pub pool: PoolConfig,
    /// See [`Settings::preload_allocations`].
    pub preload_allocations: bool,
    /// See [`Settings::record`].
    pub record: Option<String>,
    /// See [`Settings::share`].
    pub share: ShareConfig,
    /// See [`Settings::handle_part`].
    pub handle_part: u64,
}

/// The driver library loaded when `RESMEM_CUDA_LIBRARY` is unset.
pub const DEFAULT_CUDA_LIBRARY: &str = "libcuda.so.1";

/// At most this many characters of a variable's text are quoted in a message.
const QUOTE_MAX: usize = 40;

/// `text` quoted for a message: in full when short, else its start and its length, so that a
/// hostile value cannot make `rm_last_error()` arbitrarily long.
fn quote(text: &str) -> String {
    if text.chars().count() <= QUOTE_MAX {
        format!("{text:?}")
    } else {
        let start: String = text.chars().take(QUOTE_MAX).collect();
        format!("{start:?}... ({} bytes)", text.len())
    }
}

/// The keys `RESMEM_CONF` accepts, with what they take, for messages.
const KEYS: &str = "release_before_grow:true|false, logging:true|false, vmm:true|false, \
                    preload_allocations:true|false, record:PATH, share:true|false, \
                    share_count:true|false, share_wait_ms:<milliseconds, at most 60000>, \
                    handle_part_mib:<MiB, at most 1024>";

/// The longest `share_wait_ms` accepted: a minute.
const SHARE_WAIT_MAX_MS: u64 = 60_000;

/// The largest `handle_part_mib` accepted: a part of 1 GiB.
const HANDLE_PART_MAX_MIB: u64 = 1024;

impl Settings {
    /// Settings from the variables' values (`None`: unset).
    pub fn from_vars(
        driver: Option<&str>,
        cuda_library: Option<&str>,
        conf: Option<&str>,
    ) -> Result<Settings, Error> {
        let driver = match driver.map(str::trim) {
            None | Some("") | Some("cuda") => DriverChoice::Cuda(
                cuda_library
                    .filter(|l| !l.is_empty())
                    .unwrap_or(DEFAULT_CUDA_LIBRARY)
                    .to_string(),
            ),
            Some("sim") => DriverChoice::Sim,
            Some(other) => {
                return Err(Error::invalid_value(format!(
                    "RESMEM_DRIVER={} is not a driver: use cuda (the default) or sim",
                    quote(other)
                )))
            }
        };
        let conf = parse_conf(conf.unwrap_or(""))?;
        Ok(Settings {
            driver,
            pool: conf.pool,
            preload_allocations: conf.preload_allocations,
            record: conf.record,
            share: conf.share,
            handle_part: conf.handle_part,
        })
    }
}

/// Parse `RESMEM_CONF`: `key:value` pairs separated by commas; spaces around them are ignored.
/// An unknown key, a repeated key or a bad value is an error, never ignored.
pub fn parse_conf(text: &str) -> Result<Conf, Error> {
    let mut config = Conf::default();
    let mut seen: Vec<&str> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((key, value)) = item.split_once(':') else {
            return Err(Error::invalid_value(format!(
                "RESMEM_CONF: {} is not key:value; the keys are {KEYS}",
                quote(item)
            )));
        };
        let (key, value) = (key.trim(), value.trim());
        if seen.contains(&key) {
            return Err(Error::invalid_value(format!(
                "RESMEM_CONF: {} is given twice",
                quote(key)
            )));
        }
        seen.push(key);
        if key == "record" {
            if value.is_empty() {
                return Err(Error::invalid_value(
                    "RESMEM_CONF: record: needs a file, e.g. record:/tmp/trace-%p.jsonl"
                        .to_string(),
                ));
            }
            config.record = Some(value.to_string());
            continue;
        }
        if key == "share_wait_ms" {
            config.share.wait_ms = value
                .parse::<u64>()
                .ok()
                .filter(|&ms| ms <= SHARE_WAIT_MAX_MS)
                .ok_or_else(|| {
                    Error::invalid_value(format!(
                        "RESMEM_CONF: share_wait_ms:{} is not a number of milliseconds from 0 \
                         to {SHARE_WAIT_MAX_MS}",
                        quote(value)
                    ))
                })?;
            continue;
        }
        if key == "handle_part_mib" {
            let mib = value
                .parse::<u64>()
                .ok()
                .filter(|&mib| mib <= HANDLE_PART_MAX_MIB)
                .ok_or_else(|| {
                    Error::invalid_value(format!(
                        "RESMEM_CONF: handle_part_mib:{} is not a number of MiB from 0 (a page \
                         each, the default) to {HANDLE_PART_MAX_MIB}",
                        quote(value)
                    ))
                })?;
            config.handle_part = mib << 20;
            continue;
        }
        let slot = match key {
            "release_before_grow" => &mut config.pool.release_before_grow,
            "logging" => &mut config.pool.logging,
            "vmm" => &mut config.pool.vmm,
            "preload_allocations" => &mut config.preload_allocations,
            "share" => &mut config.share.enabled,
            "share_count" => &mut config.share.count,
            _ => {
                return Err(Error::invalid_value(format!(
                    "RESMEM_CONF: unknown key {}; the keys are {KEYS}",
                    quote(key)
                )))
            }
        };
        *slot = parse_bool(key, value)?;
    }
    Ok(config)
}

fn parse_bool(key: &str, value: &str) -> Result<bool, Error> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(Error::invalid_value(format!(
            "RESMEM_CONF: {key}:{} is not a boolean; use true or false",
            quote(value)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::rm_status::RM_ERROR_INVALID_VALUE;

    #[test]
    fn defaults() {
        let s = Settings::from_vars(None, None, None).unwrap();
        assert_eq!(s.driver, DriverChoice::Cuda("libcuda.so.1".into()));
        assert_eq!(s.pool, PoolConfig::default());
        assert!(!s.preload_allocations);
        assert!(s.pool.release_before_grow);
        assert!(!s.pool.logging);
    }

    #[test]
    fn driver_choice() {
        let s = Settings::from_vars(Some("sim"), Some("/x/libcuda.so"), None).unwrap();
        assert_eq!(s.driver, DriverChoice::Sim);
        let s = Settings::from_vars(Some("cuda"), Some("/x/libcuda_sim.so"), Some("")).unwrap();
        assert_eq!(s.driver, DriverChoice::Cuda("/x/libcuda_sim.so".into()));
        let e = Settings::from_vars(Some("rocm"), None, None).unwrap_err();
        assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
        assert!(e.message.contains("\"rocm\""), "{}", e.message);
    }

    #[test]
    fn conf_keys_and_values() {
        let c = parse_conf(" logging:true , release_before_grow:false ").unwrap();
        assert!(c.pool.logging);
        assert!(!c.pool.release_before_grow);
        assert!(!c.preload_allocations);
        assert!(c.pool.vmm, "page-granular reuse is the default");
        assert!(!parse_conf("vmm:false").unwrap().pool.vmm);
        assert_eq!(parse_conf("").unwrap(), Conf::default());
        assert_eq!(parse_conf(",,").unwrap(), Conf::default());
        assert!(parse_conf("logging:0").map(|c| !c.pool.logging).unwrap());
    }

    #[test]
    fn preload_allocations_is_off_unless_asked() {
        let s = Settings::from_vars(None, None, None).unwrap();
        assert!(!s.preload_allocations);
        let s = Settings::from_vars(None, None, Some("preload_allocations:true")).unwrap();
        assert!(s.preload_allocations);
        assert_eq!(s.pool, PoolConfig::default());
        let s =
            Settings::from_vars(None, None, Some("preload_allocations:off,logging:on")).unwrap();
        assert!(!s.preload_allocations);
        assert!(s.pool.logging);
        let e = parse_conf("preload_allocations:sometimes").unwrap_err();
        assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
        assert!(e
            .message
            .contains("preload_allocations:\"sometimes\" is not a boolean"));
    }

    #[test]
    fn record_takes_a_path_with_colons() {
        let c = parse_conf("logging:true, record:/tmp/a:b/trace-%p.jsonl").unwrap();
        assert_eq!(c.record.as_deref(), Some("/tmp/a:b/trace-%p.jsonl"));
        assert!(c.pool.logging);
        assert_eq!(parse_conf("").unwrap().record, None);
        let e = parse_conf("record:").unwrap_err();
        assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
        assert!(e.message.contains("needs a file"), "{}", e.message);
        let s = Settings::from_vars(Some("sim"), None, Some("record:t.jsonl")).unwrap();
        assert_eq!(s.record.as_deref(), Some("t.jsonl"));
    }

    #[test]
    fn sharing_is_off_unless_asked_and_waits_200_ms() {
        let s = Settings::from_vars(None, None, None).unwrap();
        assert_eq!(
            s.share,
            ShareConfig {
                enabled: false,
                count: false,
                wait_ms: 200
            }
        );
        let c = parse_conf("share:true,share_count:on,share_wait_ms:1500").unwrap();
        assert_eq!(
            c.share,
            ShareConfig {
                enabled: true,
                count: true,
                wait_ms: 1500
            }
        );
        assert_eq!(c.pool, PoolConfig::default());
        assert_eq!(parse_conf("share_wait_ms:0").unwrap().share.wait_ms, 0);
        for bad in [
            "share_wait_ms:-1",
            "share_wait_ms:60001",
            "share_wait_ms:fast",
        ] {
            let e = parse_conf(bad).unwrap_err();
            assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
            assert!(
                e.message.contains("is not a number of milliseconds"),
                "{}",
                e.message
            );
        }
        let e = parse_conf("share_wait_ms:5,share_wait_ms:6").unwrap_err();
        assert!(e.message.contains("given twice"), "{}", e.message);
    }

    #[test]
    fn handles_are_made_of_pages_unless_larger_parts_are_asked_for() {
        assert_eq!(
            Settings::from_vars(None, None, None).unwrap().handle_part,
            0
        );
        let s = Settings::from_vars(Some("sim"), None, Some("handle_part_mib:8")).unwrap();
        assert_eq!(s.handle_part, 8 << 20);
        assert_eq!(
            parse_conf("handle_part_mib:1024").unwrap().handle_part,
            1 << 30
        );
        assert_eq!(parse_conf("handle_part_mib: 0").unwrap().handle_part, 0);
        for bad in [
            "handle_part_mib:1025",
            "handle_part_mib:-2",
            "handle_part_mib:8MiB",
        ] {
            let e = parse_conf(bad).unwrap_err();
            assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
            assert!(
                e.message.contains("is not a number of MiB"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn messages_quote_at_most_a_clip_of_hostile_text() {
        let long = "x".repeat(100_000);
        for text in [
            long.clone(),
            format!("{long}:true"),
            format!("logging:{long}"),
        ] {
            let e = parse_conf(&text).unwrap_err();
            assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
            assert!(e.message.len() < 400, "{} bytes", e.message.len());
            assert!(e.message.contains("(100000 bytes)"), "{}", e.message);
        }
        let e = Settings::from_vars(Some(&long), None, None).unwrap_err();
        assert!(e.message.len() < 400, "{} bytes", e.message.len());
    }

    #[test]
    fn conf_errors_say_what_is_wrong() {
        for (text, needle) in [
            ("max_split_size_mb:128", "unknown key \"max_split_size_mb\""),
            ("logging", "is not key:value"),
            ("logging:maybe", "not a boolean"),
            ("logging:true,logging:false", "given twice"),
            ("logging:", "not a boolean"),
        ] {
            let e = parse_conf(text).unwrap_err();
            assert_eq!(e.status, RM_ERROR_INVALID_VALUE);
            assert!(e.message.contains(needle), "{text}: {}", e.message);
        }
    }
}
