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
use std::sync::{Mutex, MutexGuard, OnceLock};

mod capture;
pub mod codes;
mod config;
mod delays;
mod error;
mod faults;
pub mod ledger;
mod shared;
mod streams;
mod vmm;
pub use capture::{CAPTURE_STATUS_ACTIVE, CAPTURE_STATUS_INVALIDATED, CAPTURE_STATUS_NONE};
use codes::*;
use config::{human_size, DEFAULT_DEVICES, DELAYS_VAR, ENV_VAR, FAULTS_VAR, SHARED_VAR, VMM_VAR};
pub use config::{parse_devices, parse_size};
use delays::Delays;
pub use error::{CuError, CuResult};
use faults::Faults;
pub use faults::{Call, Fault};
pub use ledger::CallTally;
use ledger::Ledger;
use streams::{EventState, StreamKey, StreamState};
pub use streams::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
pub use vmm::{VmmSetting, ATTRIBUTE_VMM_SUPPORTED, GRANULARITY};

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
    /// The streams capturing a graph (`capture.rs`).
    captures: capture::Captures,
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
            streams.insert(StreamKey::Default(dev), StreamState::new(dev));
        }
        Sim {
            state: Mutex::new(State {
                initialized: false,
                devices,
                streams,
                events: HashMap::new(),
                captures: Default::default(),
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
        self.call(call).map(drop)
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
    /// any) has passed: the call counted, and failed if a fault says so.
    fn call(&self, call: Call) -> CuResult<MutexGuard<'_, State>> {
        self.delays.wait(call);
        let mut st = self.lock();
        st.fault(call)?;
        Ok(st)
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
        let mut st = self.call(Call::Init)?;
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
        let st = self.call(Call::DeviceGetCount)?;
        st.check_init()?;
        Ok(i32::try_from(st.devices.len()).unwrap_or(i32::MAX))
    }

    /// `cuDeviceGetName`: e.g. `"cuda-sim device 0 (24 GiB)"`.
    pub fn device_name(&self, dev: i32) -> CuResult<String> {
        let st = self.call(Call::DeviceGetName)?;
        let capacity = st.device(dev)?.capacity;
        Ok(format!("cuda-sim device {dev} ({})", human_size(capacity)))
    }

    /// `cuDeviceGetUuid`: the device's 16-byte UUID. It is the same for every instance that
    /// shares capacity under one name ([`Sim::share_capacity`]), and unique to this instance
    /// otherwise.
    pub fn device_uuid(&self, dev: i32) -> CuResult<[u8; 16]> {
        let st = self.call(Call::DeviceGetUuid)?;
        st.device(dev)?;
        let text = format!("{} device {dev}", st.uuid_seed);
        let mut uuid = [0u8; 16];
        uuid[..8].copy_from_slice(&fnv1a(0xcbf2_9ce4_8422_2325, &text).to_le_bytes());
        uuid[8..].copy_from_slice(&fnv1a(0x8422_2325_cbf2_9ce4, &text).to_le_bytes());
        Ok(uuid)
    }

    /// `cuDeviceTotalMem`: the device's capacity in bytes.
    pub fn total_mem(&self, dev: i32) -> CuResult<u64> {
        let st = self.call(Call::DeviceTotalMem)?;
        Ok(st.device(dev)?.capacity)
    }

    /// `cuMemGetInfo`: `(free, total)` bytes, where free is the capacity less
    /// the pages in use.
    pub fn mem_get_info(&self, dev: i32) -> CuResult<(u64, u64)> {
        let st = self.call(Call::MemGetInfo)?;
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
        let mut st = self.call(Call::MemAlloc)?;
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
        let mut st = self.call(Call::MemFree)?;
        st.check_init()?;
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        let dev = window_device(ptr).ok_or(invalid)?;
        let d = st.devices.get_mut(dev).ok_or(invalid)?;
        if !d.allocations.contains_key(&ptr) {
            return Err(invalid);
        }
        // cuMemFree waits for the device first.
        st.refuse_wait_while_capturing(dev as i32)?;
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

    /// `cuIpcGetMemHandle`: the base of the `cuMemAlloc` allocation holding `ptr` (what the
    /// handle names: a process that opens it gets the allocation's start, wherever in it `ptr`
    /// lay); `CUDA_ERROR_INVALID_VALUE` for mapped memory (`cuMemCreate`), which legacy IPC
    /// does not export, and for any other address.
    pub fn ipc_mem_handle(&self, ptr: u64) -> CuResult<u64> {
        let st = self.call(Call::IpcGetMemHandle)?;
        st.check_init()?;
        let invalid = CuError(CUDA_ERROR_INVALID_VALUE);
        if vmm::device_of_mapping(&st, ptr).is_some() {
            return Err(invalid);
        }
        let d = window_device(ptr)
            .and_then(|dev| st.devices.get(dev))
            .ok_or(invalid)?;
        let (&base, &len) = d.allocations.range(..=ptr).next_back().ok_or(invalid)?;
        if ptr < base + len {
            Ok(base)
        } else {
            Err(invalid)
        }
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
