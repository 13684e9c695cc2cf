//! Simulated CUDA devices that keep the CUDA driver's rules.
//!
//! `cuda-sim` lets code that manages CUDA device memory be tested on machines
//! without a GPU. A [`Sim`] holds any number of simulated devices, each with a
//! fixed capacity that is accounted in 2 MiB pages ([`PAGE`]), its own device
//! address window, a default stream, and any number of created streams and
//! events. Every call returns the `CUresult` code the real driver would return
//! for the same misuse, wrapped in [`CuError`].
//!
//! Stream work is modelled with simulated kernels: [`Sim::enqueue_work`] adds an
//! incomplete work item to a stream, and the item completes only when a test
//! asks for it ([`Sim::complete_work`]) or the host waits for it
//! ([`Sim::stream_synchronize`], [`Sim::event_synchronize`], [`Sim::synchronize`]).
//! Events capture the work enqueued on a stream so far, and
//! [`Sim::stream_wait_event`] orders later work on one stream after the work an
//! event captured on another; completing work always completes what that work
//! waits on first, so the simulated device never finishes work out of order.
//!
//! Many independent [`Sim`] instances can exist at once. [`Sim::global`] is the
//! process-wide instance configured by the `CUDA_SIM_DEVICES` environment
//! variable; the `libcuda_sim.so` library exports the CUDA driver API over it.
//!
//! ```
//! use cuda_sim::{codes, Sim, PAGE};
//!
//! let sim = Sim::new(&[8 * PAGE]);
//! sim.init().unwrap();
//! let ptr = sim.mem_alloc(0, 1).unwrap();
//! assert_eq!(sim.used_bytes(0), PAGE);
//! assert_eq!(sim.mem_free(ptr + 1).unwrap_err().0, codes::CUDA_ERROR_INVALID_VALUE);
//! sim.mem_free(ptr).unwrap();
//! ```

#![warn(missing_docs)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fmt;
use std::sync::{Mutex, MutexGuard, OnceLock};

mod delays;
mod faults;
pub mod ledger;
mod shared;
mod vmm;
use delays::Delays;
use faults::Faults;
pub use faults::{Call, Fault};
pub use ledger::CallTally;
use ledger::Ledger;
pub use vmm::{VmmSetting, ATTRIBUTE_VMM_SUPPORTED, GRANULARITY};

/// The result of a simulated driver call.
pub type CuResult<T> = Result<T, CuError>;

/// A failed driver call: a `CUresult` code other than `CUDA_SUCCESS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuError(pub i32);

impl CuError {
    /// The code's name as in `cuda.h`, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`;
    /// `"CUDA_ERROR_UNRECOGNIZED"` for a code this crate does not know.
    pub fn name(self) -> &'static str {
        codes::name(self.0).unwrap_or("CUDA_ERROR_UNRECOGNIZED")
    }

    /// The driver's `cuGetErrorString` text, e.g. `"out of memory"`;
    /// `"unrecognized error code"` for a code this crate does not know.
    pub fn description(self) -> &'static str {
        codes::description(self.0).unwrap_or("unrecognized error code")
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name(), self.0, self.description())
    }
}

impl std::error::Error for CuError {}

/// `CUresult` values, as defined in `cuda.h`, with their names and the
/// driver's descriptions.
pub mod codes {
    /// The call succeeded.
    pub const CUDA_SUCCESS: i32 = 0;
    /// An argument is out of range or otherwise invalid.
    pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
    /// The allocation does not fit in the device's free memory.
    pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
    /// `cuInit` has not succeeded yet.
    pub const CUDA_ERROR_NOT_INITIALIZED: i32 = 3;
    /// The driver is shutting down.
    pub const CUDA_ERROR_DEINITIALIZED: i32 = 4;
    /// There is no device.
    pub const CUDA_ERROR_NO_DEVICE: i32 = 100;
    /// The device ordinal is out of range.
    pub const CUDA_ERROR_INVALID_DEVICE: i32 = 101;
    /// There is no (valid) current context.
    pub const CUDA_ERROR_INVALID_CONTEXT: i32 = 201;
    /// A stream, event or other handle is unknown or of the wrong device.
    pub const CUDA_ERROR_INVALID_HANDLE: i32 = 400;
    /// A named symbol was not found.
    pub const CUDA_ERROR_NOT_FOUND: i32 = 500;
    /// The queried work has not completed yet.
    pub const CUDA_ERROR_NOT_READY: i32 = 600;
    /// A kernel accessed memory it must not.
    pub const CUDA_ERROR_ILLEGAL_ADDRESS: i32 = 700;
    /// A kernel failed.
    pub const CUDA_ERROR_LAUNCH_FAILED: i32 = 719;
    /// The operation is not permitted.
    pub const CUDA_ERROR_NOT_PERMITTED: i32 = 800;
    /// The operation is not supported.
    pub const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
    /// An unknown internal error.
    pub const CUDA_ERROR_UNKNOWN: i32 = 999;

    /// Every code this module knows, in increasing order.
    pub const ALL: [i32; 16] = [
        CUDA_SUCCESS,
        CUDA_ERROR_INVALID_VALUE,
        CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_NOT_INITIALIZED,
        CUDA_ERROR_DEINITIALIZED,
        CUDA_ERROR_NO_DEVICE,
        CUDA_ERROR_INVALID_DEVICE,
        CUDA_ERROR_INVALID_CONTEXT,
        CUDA_ERROR_INVALID_HANDLE,
        CUDA_ERROR_NOT_FOUND,
        CUDA_ERROR_NOT_READY,
        CUDA_ERROR_ILLEGAL_ADDRESS,
        CUDA_ERROR_LAUNCH_FAILED,
        CUDA_ERROR_NOT_PERMITTED,
        CUDA_ERROR_NOT_SUPPORTED,
        CUDA_ERROR_UNKNOWN,
    ];

    fn entry(code: i32) -> Option<(&'static str, &'static str)> {
        Some(match code {
            CUDA_SUCCESS => ("CUDA_SUCCESS", "no error"),
            CUDA_ERROR_INVALID_VALUE => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
            CUDA_ERROR_OUT_OF_MEMORY => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
            CUDA_ERROR_NOT_INITIALIZED => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
            CUDA_ERROR_DEINITIALIZED => ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
            CUDA_ERROR_NO_DEVICE => ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
            CUDA_ERROR_INVALID_DEVICE => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
            CUDA_ERROR_INVALID_CONTEXT => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
            CUDA_ERROR_INVALID_HANDLE => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
            CUDA_ERROR_NOT_FOUND => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
            CUDA_ERROR_NOT_READY => ("CUDA_ERROR_NOT_READY", "device not ready"),
            CUDA_ERROR_ILLEGAL_ADDRESS => (
                "CUDA_ERROR_ILLEGAL_ADDRESS",
                "an illegal memory access was encountered",
            ),
            CUDA_ERROR_LAUNCH_FAILED => ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
            CUDA_ERROR_NOT_PERMITTED => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
            CUDA_ERROR_NOT_SUPPORTED => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
            CUDA_ERROR_UNKNOWN => ("CUDA_ERROR_UNKNOWN", "unknown error"),
            _ => return None,
        })
    }

    /// The name of `code` as in `cuda.h` (what `cuGetErrorName` returns),
    /// e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`; `None` for an unknown code.
    pub fn name(code: i32) -> Option<&'static str> {
        entry(code).map(|e| e.0)
    }

    /// The driver's description of `code` (what `cuGetErrorString` returns),
    /// e.g. `"out of memory"`; `None` for an unknown code.
    pub fn description(code: i32) -> Option<&'static str> {
        entry(code).map(|e| e.1)
    }
}

use codes::*;

/// Device memory is accounted in pages of this many bytes (2 MiB): every
/// allocation is rounded up to whole pages and placed on a page boundary.
pub const PAGE: u64 = 2 << 20;

/// The first device's address window starts here.
const WINDOW_BASE: u64 = 0x7000_0000_0000;
/// Each device's address window is this large (1 TiB).
const WINDOW_SIZE: u64 = 1 << 40;
/// The first stream handle.
const FIRST_STREAM: u64 = 0x5000_0001;
/// The first event handle.
const FIRST_EVENT: u64 = 0xE000_0001;
/// The CUDA version `driver_version` reports (12.4).
const DRIVER_VERSION: i32 = 12040;
/// The process-wide instance behind [`Sim::global`], which
/// [`Sim::drop_global`] may empty.
struct Global(std::cell::UnsafeCell<OnceLock<Sim>>);

// SAFETY: shared access goes through the `OnceLock` (`Sim` is `Sync`); only
// `Sim::drop_global` takes it exclusively, under a contract excluding all else.
unsafe impl Sync for Global {}

static GLOBAL: Global = Global(std::cell::UnsafeCell::new(OnceLock::new()));

/// The environment variable that configures [`Sim::from_env`].
const ENV_VAR: &str = "CUDA_SIM_DEVICES";
/// The environment variable that scripts faults for [`Sim::from_env`] (see [`Fault`]).
const FAULTS_VAR: &str = "CUDA_SIM_FAULTS";
/// Names the file through which processes share the devices' capacity.
const SHARED_VAR: &str = "CUDA_SIM_SHARED";
/// The delays of driver calls (see `delays.rs`).
const DELAYS_VAR: &str = "CUDA_SIM_DELAYS";
/// The shape of the virtual-memory API (see [`VmmSetting`]).
const VMM_VAR: &str = "CUDA_SIM_VMM";
/// The configuration used when `CUDA_SIM_DEVICES` is unset.
const DEFAULT_DEVICES: &str = "24GiB";

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
fn human_size(bytes: u64) -> String {
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

/// Identifies a stream inside the simulator: a device's default stream or a
/// created stream by its handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum StreamKey {
    Default(i32),
    Created(u64),
}

/// "Stream `.0` has completed at least its first `.1` work items": the
/// requirements an event capture consists of.
type Requirement = (StreamKey, u64);

/// Later work on a stream waits for these requirements (from `stream_wait_event`).
#[derive(Debug)]
struct Dependency {
    /// The number of work items enqueued on the stream when the wait was
    /// issued: items with a greater sequence number depend on `requires`.
    position: u64,
    requires: Vec<Requirement>,
}

#[derive(Debug)]
struct StreamState {
    device: i32,
    enqueued: u64,
    completed: u64,
    dependencies: Vec<Dependency>,
    /// Destroyed streams stay until their work has completed, as on the driver.
    destroyed: bool,
}

#[derive(Debug)]
struct EventState {
    device: i32,
    /// What the last record captured (empty: never recorded).
    captured: Vec<Requirement>,
}

#[derive(Debug)]
struct Device {
    capacity: u64,
    used_pages: u64,
    /// Live allocations: base address -> size in bytes (whole pages).
    allocations: BTreeMap<u64, u64>,
}

#[derive(Debug)]
struct State {
    initialized: bool,
    devices: Vec<Device>,
    streams: HashMap<StreamKey, StreamState>,
    events: HashMap<u64, EventState>,
    next_stream: u64,
    next_event: u64,
    alloc_calls: u64,
    free_calls: u64,
    faults: Faults,
    /// Calls by kind and the memory each kind created and gave back.
    ledger: Ledger,
    vmm: vmm::VmmState,
    /// With `CUDA_SIM_SHARED`: the other processes' use of the same devices.
    shared: Option<shared::Shared>,
    /// What device UUIDs are derived from: the shared name, or this instance alone.
    uuid_seed: String,
    /// This instance's number in the process.
    instance: u64,
}

/// Adds `req` to `reqs`, keeping one entry per stream with the larger count.
fn merge_requirement(reqs: &mut Vec<Requirement>, req: Requirement) {
    match reqs.iter_mut().find(|r| r.0 == req.0) {
        Some(existing) => existing.1 = existing.1.max(req.1),
        None => reqs.push(req),
    }
}

impl State {
    /// Count a call of `call` and fail it if a fault says so.
    fn fault(&mut self, call: Call) -> CuResult<()> {
        let used = self.used_pages();
        self.ledger.begin(call, used);
        match self.faults.hit(call) {
            Some(code) => Err(CuError(code)),
            None => Ok(()),
        }
    }

    /// Pages in use on all devices.
    fn used_pages(&self) -> u64 {
        self.devices.iter().map(|d| d.used_pages).sum()
    }

    fn check_init(&self) -> CuResult<()> {
        if self.initialized {
            Ok(())
        } else {
            Err(CuError(CUDA_ERROR_NOT_INITIALIZED))
        }
    }

    fn device(&self, dev: i32) -> CuResult<&Device> {
        self.check_init()?;
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or(CuError(CUDA_ERROR_INVALID_DEVICE))
    }

    fn device_mut(&mut self, dev: i32) -> CuResult<&mut Device> {
        self.device(dev)?;
        Ok(&mut self.devices[dev as usize])
    }

    /// Free pages of `dev` (a valid ordinal): its capacity less this process's pages in use and,
    /// with shared capacity, the other processes'.
    fn free_pages(&self, dev: i32) -> CuResult<u64> {
        let d = &self.devices[dev as usize];
        let others = match &self.shared {
            Some(shared) => shared
                .others(dev as usize)
                .map_err(|_| CuError(CUDA_ERROR_UNKNOWN))?,
            None => 0,
        };
        Ok((d.capacity / PAGE).saturating_sub(d.used_pages + others))
    }

    /// Count `pages` more in use on `dev` (a valid ordinal) if they fit in its free pages;
    /// `CUDA_ERROR_OUT_OF_MEMORY` (and nothing counted) if not.
    fn take_pages(&mut self, dev: i32, pages: u64) -> CuResult<()> {
        let d = &self.devices[dev as usize];
        let (capacity, used) = (d.capacity / PAGE, d.used_pages);
        let fits = used + pages <= capacity
            && match &self.shared {
                Some(shared) => shared
                    .set_used(dev as usize, used + pages, capacity)
                    .map_err(|_| CuError(CUDA_ERROR_UNKNOWN))?,
                None => true,
            };
        if !fits {
            return Err(CuError(CUDA_ERROR_OUT_OF_MEMORY));
        }
        self.devices[dev as usize].used_pages += pages;
        Ok(())
    }

    /// Count `pages` of `dev` free again.
    fn give_pages(&mut self, dev: usize, pages: u64) {
        let used = self.devices[dev].used_pages - pages;
        self.devices[dev].used_pages = used;
        if let Some(shared) = &self.shared {
            // Shrinking never fails for lack of room; an I/O failure leaves the pages counted
            // until the process exits, which errs on the side of less free memory.
            let _ = shared.set_used(dev, used, u64::MAX);
        }
    }

    /// Resolves `stream` (0: `dev`'s default stream) to a live stream of `dev`.
    fn stream_key(&self, dev: i32, stream: u64) -> CuResult<StreamKey> {
        self.device(dev)?;
        if stream == 0 {
            return Ok(StreamKey::Default(dev));
        }
        let key = StreamKey::Created(stream);
        match self.streams.get(&key) {
            Some(s) if !s.destroyed && s.device == dev => Ok(key),
            _ => Err(CuError(CUDA_ERROR_INVALID_HANDLE)),
        }
    }

    fn event(&self, event: u64) -> CuResult<&EventState> {
        self.check_init()?;
        self.events
            .get(&event)
            .ok_or(CuError(CUDA_ERROR_INVALID_HANDLE))
    }

    fn met(&self, req: &Requirement) -> bool {
        // A stream that is gone (destroyed after all its work completed) has
        // nothing left to wait for.
        match self.streams.get(&req.0) {
            Some(s) => s.completed >= req.1,
            None => true,
        }
    }

    /// Everything enqueued on `key` so far, including the waits issued after
    /// its last work item, as a list of requirements.
    fn capture(&self, key: StreamKey) -> Vec<Requirement> {
        let mut reqs = Vec::new();
        if let Some(s) = self.streams.get(&key) {
            if s.enqueued > s.completed {
                reqs.push((key, s.enqueued));
            }
            for dep in &s.dependencies {
                for r in &dep.requires {
                    if !self.met(r) {
                        merge_requirement(&mut reqs, *r);
                    }
                }
            }
        }
        reqs
    }

    /// Completes the work the requirements name, first completing whatever
    /// that work waits on, so that work never completes out of order.
    fn complete(&mut self, reqs: &[Requirement]) {
        let mut stack: Vec<Requirement> = reqs.to_vec();
        while let Some(&(key, count)) = stack.last() {
            let Some(s) = self.streams.get(&key) else {
                stack.pop();
                continue;
            };
            if s.completed >= count {
                stack.pop();
                continue;
            }
            // Items up to `count` depend on every wait issued before them.
            let unmet: Vec<Requirement> = s
                .dependencies
                .iter()
                .filter(|d| d.position < count)
                .flat_map(|d| d.requires.iter().copied())
                .filter(|r| !self.met(r))
                .collect();
            if unmet.is_empty() {
                let s = self.streams.get_mut(&key).expect("stream looked up above");
                s.completed = count;
                s.dependencies.retain(|d| d.position >= count);
                stack.pop();
            } else {
                // Waits only ever name work enqueued before them, so this
                // cannot cycle.
                stack.extend(unmet);
            }
        }
        self.collect_destroyed();
    }

    /// Drops destroyed streams whose work has all completed.
    fn collect_destroyed(&mut self) {
        self.streams
            .retain(|_, s| !(s.destroyed && s.completed == s.enqueued));
    }

    fn complete_stream(&mut self, key: StreamKey) {
        let reqs = self.capture(key);
        self.complete(&reqs);
    }
}

/// A set of simulated CUDA devices with their memory, streams and events.
///
/// All methods take `&self`; the state sits behind one mutex, so a `Sim` can
/// be shared between threads. Calls follow the CUDA driver's rules and return
/// its error codes: every driver call fails with `CUDA_ERROR_NOT_INITIALIZED`
/// until [`Sim::init`] succeeded, device ordinals out of range give
/// `CUDA_ERROR_INVALID_DEVICE`, and unknown stream or event handles give
/// `CUDA_ERROR_INVALID_HANDLE`.
#[derive(Debug)]
pub struct Sim {
    state: Mutex<State>,
    config_error: Option<String>,
    /// The time each call takes (`CUDA_SIM_DELAYS`), outside the lock.
    delays: Delays,
}

impl Sim {
    /// Creates one device per entry of `capacities`, each rounded down to a
    /// whole number of pages. [`Sim::init`] must be called before use; with no
    /// devices it fails with `CUDA_ERROR_NO_DEVICE`, as the driver does.
    pub fn new(capacities: &[u64]) -> Sim {
        let instance = next_instance();
        let devices: Vec<Device> = capacities
            .iter()
            .map(|&c| Device {
                capacity: c / PAGE * PAGE,
                used_pages: 0,
                allocations: BTreeMap::new(),
            })
            .collect();
        let mut streams = HashMap::new();
        for dev in 0..devices.len() {
            let dev = i32::try_from(dev).expect("too many devices");
            streams.insert(
                StreamKey::Default(dev),
                StreamState {
                    device: dev,
                    enqueued: 0,
                    completed: 0,
                    dependencies: Vec::new(),
                    destroyed: false,
                },
            );
        }
        Sim {
            state: Mutex::new(State {
                initialized: false,
                devices,
                streams,
                events: HashMap::new(),
                next_stream: FIRST_STREAM,
                next_event: FIRST_EVENT,
                alloc_calls: 0,
                free_calls: 0,
                faults: Faults::new(),
                ledger: Ledger::new(),
                vmm: vmm::VmmState::new(),
                shared: None,
                uuid_seed: format!("instance {instance} of pid {}", std::process::id()),
                instance,
            }),
            config_error: None,
            delays: Delays::new(),
        }
    }

    /// Creates the devices that the `CUDA_SIM_DEVICES` environment variable
    /// lists (see [`parse_devices`]); one 24 GiB device when it is unset. The
    /// faults that `CUDA_SIM_FAULTS` lists (see [`Fault::parse_list`]) are
    /// injected, counting calls from creation.
    pub fn from_env() -> Result<Sim, String> {
        Sim::from_vars(&|name| std::env::var_os(name))
    }

    /// As [`Sim::from_env`], with each variable read through `var` (a program
    /// that filters its environment, in a privileged process say, passes its
    /// own reader).
    pub fn from_vars(var: &dyn Fn(&str) -> Option<OsString>) -> Result<Sim, String> {
        let text = |name: &str| match var(name) {
            None => Ok(None),
            Some(v) => v
                .into_string()
                .map(Some)
                .map_err(|_| format!("{name} is not valid UTF-8")),
        };
        let spec = text(ENV_VAR)?.unwrap_or_else(|| DEFAULT_DEVICES.to_string());
        let sim = parse_devices(&spec)
            .map(|caps| Sim::new(&caps))
            .map_err(|e| format!("{ENV_VAR}={spec:?}: {e}"))?;
        if let Some(value) = text(VMM_VAR)? {
            sim.set_vmm(VmmSetting::parse(&value)?);
        }
        if let Some(name) = text(SHARED_VAR)? {
            sim.share_capacity(&name)
                .map_err(|e| format!("{SHARED_VAR}={name:?}: {e}"))?;
        }
        if let Some(delays) = text(DELAYS_VAR)? {
            sim.set_delays(&delays)
                .map_err(|e| format!("{DELAYS_VAR}={delays:?}: {e}"))?;
        }
        if let Some(faults) = text(FAULTS_VAR)? {
            sim.inject_faults(&faults)
                .map_err(|e| format!("{FAULTS_VAR}={faults:?}: {e}"))?;
        }
        Ok(sim)
    }

    /// Shares the devices' capacity with every process (and instance) that shares `name`: a
    /// file `/dev/shm/cuda-sim-<name>`, or the path `name` itself when it holds a `/`. From
    /// now on, free memory is the capacity less what all of them use, an allocation that does
    /// not fit in that fails with `CUDA_ERROR_OUT_OF_MEMORY`, the memory of a process that
    /// exits or is killed is free again, and device UUIDs derive from `name`, so that every
    /// sharer sees the same device. Every sharer must list the same capacities, at most 8
    /// devices. Call it before allocating.
    pub fn share_capacity(&self, name: &str) -> Result<(), String> {
        let mut st = self.lock();
        if st.devices.len() > shared::DEVICES {
            return Err(format!(
                "a shared simulator has at most {} devices",
                shared::DEVICES
            ));
        }
        let shared = shared::Shared::open(name, st.instance)?;
        for dev in 0..st.devices.len() {
            let used = st.devices[dev].used_pages;
            shared
                .set_used(dev, used, u64::MAX)
                .map_err(|e| format!("cannot write {}: {e}", shared::path_of(name).display()))?;
        }
        st.shared = Some(shared);
        st.uuid_seed = format!("shared {name}");
        Ok(())
    }

    /// Makes a driver call fail as `fault` says, counting its calls from now
    /// on. Several faults may be armed at once, on the same call too: each
    /// counts on its own, and the first that fires decides the code.
    pub fn inject_fault(&self, fault: Fault) {
        self.lock().faults.arm(fault);
    }

    /// Injects every fault of a list in the `CUDA_SIM_FAULTS` syntax, e.g.
    /// `"cuMemAlloc_v2@3=2,cuEventRecord@5+=719"`; injects none if an entry is
    /// malformed, and says which.
    pub fn inject_faults(&self, spec: &str) -> Result<(), String> {
        let faults = Fault::parse_list(spec)?;
        let mut st = self.lock();
        for fault in faults {
            st.faults.arm(fault);
        }
        Ok(())
    }

    /// Disarms every fault; the call counters keep counting.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// How many times `call` reached the simulator since it was created,
    /// failed ones included.
    pub fn call_count(&self, call: Call) -> u64 {
        self.lock().faults.calls(call)
    }

    /// Every driver function's calls since creation (failed ones included) and the device
    /// memory they created and gave back, in [`Call::ALL`] order; see [`ledger`] for the cost
    /// model that estimates their time.
    pub fn driver_calls(&self) -> Vec<CallTally> {
        self.lock().ledger.tallies()
    }

    /// How many calls failed because of an injected fault since creation.
    pub fn injected_failures(&self) -> u64 {
        self.lock().faults.injected()
    }

    /// Counts a call of `call` that has no method of its own here (context
    /// functions of `libcuda_sim.so`) and fails it if a fault says so.
    pub fn fault_point(&self, call: Call) -> CuResult<()> {
        self.call(call).fault(call)
    }

    /// Makes every call of `call` take `delay` from now on (`Duration::ZERO`:
    /// none), spent before the call takes the simulator's lock.
    pub fn set_delay(&self, call: Call, delay: std::time::Duration) {
        self.delays.set(call, delay);
    }

    /// Sets the delays of a list in the `CUDA_SIM_DELAYS` syntax, e.g.
    /// `cuCtxSynchronize=2ms,cuMemFree_v2=50us` (see `delays.rs`).
    pub fn set_delays(&self, spec: &str) -> Result<(), String> {
        for (call, delay) in Delays::parse(spec)? {
            self.set_delay(call, delay);
        }
        Ok(())
    }

    /// The state, locked, for a call of `call`, once the call's delay (if
    /// any) has passed.
    fn call(&self, call: Call) -> MutexGuard<'_, State> {
        self.delays.wait(call);
        self.lock()
    }

    /// The process-wide instance, created from the environment on first use
    /// (see [`Sim::from_env`]). If `CUDA_SIM_DEVICES` is malformed it has no
    /// devices, [`Sim::init`] fails with `CUDA_ERROR_INVALID_VALUE`, and
    /// [`Sim::config_error`] holds the parse message.
    pub fn global() -> &'static Sim {
        Sim::global_from(&|name| std::env::var_os(name))
    }

    /// As [`Sim::global`], reading the variables through `var` if this call
    /// creates the instance (see [`Sim::from_vars`]).
    pub fn global_from(var: &dyn Fn(&str) -> Option<OsString>) -> &'static Sim {
        // SAFETY: the only `&mut` is made by `drop_global`, whose contract excludes this.
        let global = unsafe { &*GLOBAL.0.get() };
        global.get_or_init(|| {
            Sim::from_vars(var).unwrap_or_else(|message| Sim {
                config_error: Some(message),
                ..Sim::new(&[])
            })
        })
    }

    /// Drop the process-wide instance, for a library being unloaded (`dlclose`),
    /// so that its memory does not outlive the library.
    ///
    /// # Safety
    /// No reference from [`Sim::global`] is alive, and it will not be called
    /// again: the library that holds the instance is being unloaded.
    pub unsafe fn drop_global() {
        // SAFETY: exclusive by the caller's contract.
        drop(unsafe { (*GLOBAL.0.get()).take() });
    }

    /// Why the configuration was rejected, for an instance made by
    /// [`Sim::global`] from a malformed `CUDA_SIM_DEVICES`.
    pub fn config_error(&self) -> Option<&str> {
        self.config_error.as_deref()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated
        // in a way that matters more than refusing all later calls would.
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // The previous call has ended: what it changed is its own.
        let used = st.used_pages();
        st.ledger.settle(used, PAGE);
        st
    }

    /// `cuInit`: initializes the driver; calling it again is harmless.
    /// Fails with `CUDA_ERROR_INVALID_VALUE` for a malformed configuration and
    /// `CUDA_ERROR_NO_DEVICE` when there are no devices.
    pub fn init(&self) -> CuResult<()> {
        let mut st = self.call(Call::Init);
        st.fault(Call::Init)?;
        if self.config_error.is_some() {
            return Err(CuError(CUDA_ERROR_INVALID_VALUE));
        }
        if st.devices.is_empty() {
            return Err(CuError(CUDA_ERROR_NO_DEVICE));
        }
        st.initialized = true;
        Ok(())
    }

    /// `cuDriverGetVersion`: 12040 (CUDA 12.4). Needs no initialization.
    pub fn driver_version(&self) -> i32 {
        DRIVER_VERSION
    }

    /// `cuDeviceGetCount`: the number of devices.
    pub fn device_count(&self) -> CuResult<i32> {
        let mut st = self.call(Call::DeviceGetCount);
        st.fault(Call::DeviceGetCount)?;
        st.check_init()?;
        Ok(i32::try_from(st.devices.len()).unwrap_or(i32::MAX))
    }

    /// `cuDeviceGetName`: e.g. `"cuda-sim device 0 (24 GiB)"`.
    pub fn device_name(&self, dev: i32) -> CuResult<String> {
        let mut st = self.call(Call::DeviceGetName);
        st.fault(Call::DeviceGetName)?;
        let capacity = st.device(dev)?.capacity;
        Ok(format!("cuda-sim device {dev} ({})", human_size(capacity)))
    }

    /// `cuDeviceGetUuid`: the device's 16-byte UUID. It is the same for every instance that
    /// shares capacity under one name ([`Sim::share_capacity`]), and unique to this instance
    /// otherwise.
    pub fn device_uuid(&self, dev: i32) -> CuResult<[u8; 16]> {
        let mut st = self.call(Call::DeviceGetUuid);
        st.fault(Call::DeviceGetUuid)?;
        st.device(dev)?;
        let text = format!("{} device {dev}", st.uuid_seed);
        let mut uuid = [0u8; 16];
        uuid[..8].copy_from_slice(&fnv1a(0xcbf2_9ce4_8422_2325, &text).to_le_bytes());
        uuid[8..].copy_from_slice(&fnv1a(0x8422_2325_cbf2_9ce4, &text).to_le_bytes());
        Ok(uuid)
    }

    /// `cuDeviceTotalMem`: the device's capacity in bytes.
    pub fn total_mem(&self, dev: i32) -> CuResult<u64> {
        let mut st = self.call(Call::DeviceTotalMem);
        st.fault(Call::DeviceTotalMem)?;
        Ok(st.device(dev)?.capacity)
    }

    /// `cuMemGetInfo`: `(free, total)` bytes, where free is the capacity less
    /// the pages in use.
    pub fn mem_get_info(&self, dev: i32) -> CuResult<(u64, u64)> {
        let mut st = self.call(Call::MemGetInfo);
        st.fault(Call::MemGetInfo)?;
        let capacity = st.device(dev)?.capacity;
        Ok((st.free_pages(dev)? * PAGE, capacity))
    }

    /// `cuMemAlloc`: allocates `bytes` (rounded up to whole pages) on `dev`.
    ///
    /// Fails with `CUDA_ERROR_INVALID_VALUE` for zero bytes and
    /// `CUDA_ERROR_OUT_OF_MEMORY` when the pages do not fit in the free ones.
    /// The address is page-aligned, non-zero, inside the device's own 1 TiB
    /// window starting at `0x7000_0000_0000 + dev * 2^40`, and the lowest gap
    /// that fits, so addresses are reused after a free as on the driver.
    pub fn mem_alloc(&self, dev: i32, bytes: u64) -> CuResult<u64> {
        let mut st = self.call(Call::MemAlloc);
        st.fault(Call::MemAlloc)?;
        let d = st.device_mut(dev)?;
        if bytes == 0 {
            return Err(CuError(CUDA_ERROR_INVALID_VALUE));
        }
        let oom = CuError(CUDA_ERROR_OUT_OF_MEMORY);
        let pages = bytes.div_ceil(PAGE);
        if pages > d.capacity / PAGE - d.used_pages {
            return Err(oom);
        }
        let size = pages * PAGE;
        let window = WINDOW_BASE + dev as u64 * WINDOW_SIZE;
        let end = window + WINDOW_SIZE;
        let mut cursor = window;
        for (&base, &len) in &d.allocations {
            if base - cursor >= size {
                break;
            }
            cursor = base + len;
        }
        if end - cursor < size {
            return Err(oom);
        }
        st.take_pages(dev, pages)?;
        st.devices[dev as usize].allocations.insert(cursor, size);
        st.alloc_calls += 1;
        Ok(cursor)
    }

    /// `cuMemFree`: frees the allocation that starts exactly at `ptr`, on
    /// whichever device it lives. Anything else (zero, an unknown address, an
    /// address inside an allocation, a second free) fails with
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub fn mem_free(&self, ptr: u64) -> CuResult<()> {
        let mut st = self.call(Call::MemFree);
        st.fault(Call::MemFree)?;
        st.check_init()?;
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        let dev = window_device(ptr).ok_or(invalid)?;
        let d = st.devices.get_mut(dev).ok_or(invalid)?;
        let size = d.allocations.remove(&ptr).ok_or(invalid)?;
        st.give_pages(dev, size / PAGE);
        st.free_calls += 1;
        Ok(())
    }

    /// The device whose live allocation contains `ptr` (its base or any byte
    /// inside it); `None` otherwise. Needs no initialization.
    pub fn device_of(&self, ptr: u64) -> Option<i32> {
        let st = self.lock();
        if let Some(dev) = vmm::device_of_mapping(&st, ptr) {
            return Some(dev);
        }
        let dev = window_device(ptr)?;
        let d = st.devices.get(dev)?;
        let (&base, &len) = d.allocations.range(..=ptr).next_back()?;
        (ptr < base + len).then_some(dev as i32)
    }

    /// `cuStreamCreate`: a new stream on `dev`; its handle is non-zero and
    /// unique among all devices' streams and events.
    ///
    /// Created streams do not synchronize implicitly with the default stream
    /// (they behave as `CU_STREAM_NON_BLOCKING` streams).
    pub fn stream_create(&self, dev: i32) -> CuResult<u64> {
        let mut st = self.call(Call::StreamCreate);
        st.fault(Call::StreamCreate)?;
        st.device(dev)?;
        let handle = st.next_stream;
        st.next_stream += 1;
        st.streams.insert(
            StreamKey::Created(handle),
            StreamState {
                device: dev,
                enqueued: 0,
                completed: 0,
                dependencies: Vec::new(),
                destroyed: false,
            },
        );
        Ok(handle)
    }

    /// `cuStreamDestroy`: destroys a created stream. As on the driver, work
    /// already enqueued on it still completes later (events that captured it
    /// stay incomplete until then). Unknown handles and the default stream
    /// (0) fail with `CUDA_ERROR_INVALID_HANDLE`.
    pub fn stream_destroy(&self, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamDestroy);
        st.fault(Call::StreamDestroy)?;
        st.check_init()?;
        match st.streams.get_mut(&StreamKey::Created(stream)) {
            Some(s) if !s.destroyed => s.destroyed = true,
            _ => return Err(CuError(CUDA_ERROR_INVALID_HANDLE)),
        }
        st.collect_destroyed();
        Ok(())
    }

    /// `cuEventCreate`: a new event on `dev`; its handle is non-zero and
    /// unique among all devices' streams and events.
    pub fn event_create(&self, dev: i32) -> CuResult<u64> {
        let mut st = self.call(Call::EventCreate);
        st.fault(Call::EventCreate)?;
        st.device(dev)?;
        let handle = st.next_event;
        st.next_event += 1;
        st.events.insert(
            handle,
            EventState {
                device: dev,
                captured: Vec::new(),
            },
        );
        Ok(handle)
    }

    /// `cuEventDestroy`: destroys an event (waits already issued on it keep
    /// their meaning).
    pub fn event_destroy(&self, event: u64) -> CuResult<()> {
        let mut st = self.call(Call::EventDestroy);
        st.fault(Call::EventDestroy)?;
        st.event(event)?;
        st.events.remove(&event);
        Ok(())
    }

    /// `cuEventRecord`: the event captures all work enqueued on `stream` so
    /// far (0: `dev`'s default stream), including the waits issued on it;
    /// recording again replaces the capture. An event or stream of another
    /// device fails with `CUDA_ERROR_INVALID_HANDLE`.
    pub fn event_record(&self, dev: i32, event: u64, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::EventRecord);
        st.fault(Call::EventRecord)?;
        let key = st.stream_key(dev, stream)?;
        if st.event(event)?.device != dev {
            return Err(CuError(CUDA_ERROR_INVALID_HANDLE));
        }
        let captured = st.capture(key);
        st.events.get_mut(&event).expect("checked above").captured = captured;
        Ok(())
    }

    /// `cuEventQuery`: whether the captured work has completed (`true`);
    /// events never recorded are complete.
    pub fn event_query(&self, event: u64) -> CuResult<bool> {
        let mut st = self.call(Call::EventQuery);
        st.fault(Call::EventQuery)?;
        let e = st.event(event)?;
        Ok(e.captured.iter().all(|r| st.met(r)))
    }

    /// `cuEventSynchronize`: the host waits for the captured work, which
    /// therefore completes (with whatever it waits on).
    pub fn event_synchronize(&self, event: u64) -> CuResult<()> {
        let mut st = self.call(Call::EventSynchronize);
        st.fault(Call::EventSynchronize)?;
        let reqs = st.event(event)?.captured.clone();
        st.complete(&reqs);
        Ok(())
    }

    /// `cuStreamWaitEvent`: work enqueued on `stream` (0: `dev`'s default
    /// stream) after this call cannot complete before the work the event
    /// captured. The event may belong to another device, as on the driver.
    pub fn stream_wait_event(&self, dev: i32, stream: u64, event: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamWaitEvent);
        st.fault(Call::StreamWaitEvent)?;
        let key = st.stream_key(dev, stream)?;
        let requires: Vec<Requirement> = st
            .event(event)?
            .captured
            .iter()
            .filter(|r| !st.met(r))
            .copied()
            .collect();
        if requires.is_empty() {
            return Ok(());
        }
        let s = st.streams.get_mut(&key).expect("resolved above");
        let position = s.enqueued;
        match s.dependencies.last_mut() {
            Some(d) if d.position == position => {
                for r in requires {
                    merge_requirement(&mut d.requires, r);
                }
            }
            _ => s.dependencies.push(Dependency { position, requires }),
        }
        Ok(())
    }

    /// `cuStreamSynchronize`: completes everything enqueued on the stream so
    /// far (0: `dev`'s default stream) and what it waits on.
    pub fn stream_synchronize(&self, dev: i32, stream: u64) -> CuResult<()> {
        let mut st = self.call(Call::StreamSynchronize);
        st.fault(Call::StreamSynchronize)?;
        let key = st.stream_key(dev, stream)?;
        st.complete_stream(key);
        Ok(())
    }

    /// `cuStreamQuery`: whether everything enqueued on the stream so far,
    /// including the waits issued on it, has completed.
    pub fn stream_query(&self, dev: i32, stream: u64) -> CuResult<bool> {
        let mut st = self.call(Call::StreamQuery);
        st.fault(Call::StreamQuery)?;
        let key = st.stream_key(dev, stream)?;
        Ok(st.capture(key).is_empty())
    }

    /// `cuCtxSynchronize`: completes all work on all of the device's streams
    /// (destroyed ones with work left included).
    pub fn synchronize(&self, dev: i32) -> CuResult<()> {
        let mut st = self.call(Call::CtxSynchronize);
        st.fault(Call::CtxSynchronize)?;
        st.device(dev)?;
        let keys: Vec<StreamKey> = st
            .streams
            .iter()
            .filter(|(_, s)| s.device == dev)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            st.complete_stream(key);
        }
        Ok(())
    }

    /// A simulated kernel (not a CUDA call): enqueues one incomplete work
    /// item on the stream (0: `dev`'s default stream) and returns its
    /// sequence number on that stream (1 for the first item).
    pub fn enqueue_work(&self, dev: i32, stream: u64) -> CuResult<u64> {
        let mut st = self.lock();
        let key = st.stream_key(dev, stream)?;
        let s = st.streams.get_mut(&key).expect("resolved above");
        s.enqueued += 1;
        Ok(s.enqueued)
    }

    /// Completes all work enqueued on the stream so far (not a CUDA call),
    /// first completing whatever that work waits on through
    /// [`Sim::stream_wait_event`]. Work completes in order per stream.
    pub fn complete_work(&self, dev: i32, stream: u64) -> CuResult<()> {
        let mut st = self.lock();
        let key = st.stream_key(dev, stream)?;
        st.complete_stream(key);
        Ok(())
    }

    /// The number of incomplete work items on the stream (not a CUDA call).
    pub fn pending_work(&self, dev: i32, stream: u64) -> CuResult<u64> {
        let st = self.lock();
        let key = st.stream_key(dev, stream)?;
        let s = &st.streams[&key];
        Ok(s.enqueued - s.completed)
    }

    /// The device a live created stream belongs to; `None` for the default
    /// stream (0) and unknown or destroyed handles. Needs no initialization.
    pub fn stream_device(&self, stream: u64) -> Option<i32> {
        match self.lock().streams.get(&StreamKey::Created(stream)) {
            Some(s) if !s.destroyed => Some(s.device),
            _ => None,
        }
    }

    /// The device a live event belongs to; `None` for unknown handles.
    /// Needs no initialization.
    pub fn event_device(&self, event: u64) -> Option<i32> {
        self.lock().events.get(&event).map(|e| e.device)
    }

    /// Bytes in use on `dev` (pages in use times [`PAGE`]); 0 for an unknown
    /// device. Needs no initialization.
    pub fn used_bytes(&self, dev: i32) -> u64 {
        self.with_device(dev, |d| d.used_pages * PAGE)
    }

    /// The number of live allocations on `dev`; 0 for an unknown device.
    /// Needs no initialization.
    pub fn live_allocations(&self, dev: i32) -> usize {
        self.with_device(dev, |d| d.allocations.len())
    }

    /// The live allocations of `dev` as `(base, bytes)`, by address; empty for
    /// an unknown device. Not a driver call: never counted or failed.
    pub fn allocations(&self, dev: i32) -> Vec<(u64, u64)> {
        self.with_device(dev, |d| {
            d.allocations.iter().map(|(&b, &l)| (b, l)).collect()
        })
    }

    /// The number of devices once [`Sim::init`] succeeded, like
    /// [`Sim::device_count`] but not a driver call: never counted or failed.
    pub fn initialized_device_count(&self) -> CuResult<i32> {
        let st = self.lock();
        st.check_init()?;
        Ok(i32::try_from(st.devices.len()).unwrap_or(i32::MAX))
    }

    /// The number of successful [`Sim::mem_alloc`] calls, all devices.
    pub fn alloc_calls(&self) -> u64 {
        self.lock().alloc_calls
    }

    /// The number of successful [`Sim::mem_free`] calls, all devices.
    pub fn free_calls(&self) -> u64 {
        self.lock().free_calls
    }

    /// The capacity of `dev` in bytes (whole pages); 0 for an unknown device.
    /// Needs no initialization.
    pub fn capacity(&self, dev: i32) -> u64 {
        self.with_device(dev, |d| d.capacity)
    }

    fn with_device<T: Default>(&self, dev: i32, f: impl FnOnce(&Device) -> T) -> T {
        let st = self.lock();
        usize::try_from(dev)
            .ok()
            .and_then(|d| st.devices.get(d))
            .map(f)
            .unwrap_or_default()
    }
}

/// A number unique to each [`Sim`] created in this process.
fn next_instance() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The 64-bit FNV-1a hash of `text`, from `seed`.
fn fnv1a(seed: u64, text: &str) -> u64 {
    text.bytes().fold(seed, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The device whose address window contains `ptr`, if any.
fn window_device(ptr: u64) -> Option<usize> {
    let offset = ptr.checked_sub(WINDOW_BASE)?;
    usize::try_from(offset / WINDOW_SIZE).ok()
}

#[cfg(test)]
mod tests;
