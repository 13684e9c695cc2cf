//! Scripted failures of simulated driver calls: [`Fault`], the [`Call`]s that can fail, and the
//! `CUDA_SIM_FAULTS` syntax.
//!
//! A fault makes one driver function fail with a chosen `CUresult` at its *n*-th call, or at
//! every call from the *n*-th on, counting the calls that reach the simulator from the moment the
//! fault is injected ([`crate::Sim::inject_fault`]) or, for `CUDA_SIM_FAULTS`, from the start
//! of the process. A failed call changes nothing, as a driver call that fails before doing its
//! work would.
//!
//! Syntax of `CUDA_SIM_FAULTS` and [`Fault::parse_list`]: comma-separated entries
//! `NAME@N=CODE` (the *N*-th call of `NAME` fails with `CODE`), `NAME@N+=CODE` (every call from
//! the *N*-th on) or `NAME=CODE` (every call). `NAME` is a driver function as exported by
//! `libcuda_sim.so` (`cuMemAlloc_v2`, `cuEventRecord`, ...); `CODE` is a number or a name from
//! `cuda.h` (`2`, `CUDA_ERROR_OUT_OF_MEMORY`). Example:
//! `cuMemAlloc_v2@3=2,cuEventRecord@5+=CUDA_ERROR_LAUNCH_FAILED`.

use std::fmt;

macro_rules! driver_calls {
    ($($variant:ident = $name:literal),* $(,)?) => {
        /// A driver function the simulator counts, and can make fail on purpose.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Call {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl Call {
            /// Every call, in declaration order.
            pub const ALL: &'static [Call] = &[$(Call::$variant),*];

            /// The function's name as the driver exports it, e.g. `"cuMemAlloc_v2"`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Call::$variant => $name,)*
                }
            }

            /// The call with this exported name.
            pub fn from_name(name: &str) -> Option<Call> {
                match name {
                    $($name => Some(Call::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

driver_calls! {
    Init = "cuInit",
    DriverGetVersion = "cuDriverGetVersion",
    DeviceGetCount = "cuDeviceGetCount",
    DeviceGet = "cuDeviceGet",
    DeviceGetName = "cuDeviceGetName",
    DeviceTotalMem = "cuDeviceTotalMem_v2",
    DeviceGetUuid = "cuDeviceGetUuid",
    DevicePrimaryCtxRetain = "cuDevicePrimaryCtxRetain",
    DevicePrimaryCtxRelease = "cuDevicePrimaryCtxRelease_v2",
    CtxPushCurrent = "cuCtxPushCurrent_v2",
    CtxPopCurrent = "cuCtxPopCurrent_v2",
    CtxGetCurrent = "cuCtxGetCurrent",
    CtxSetCurrent = "cuCtxSetCurrent",
    CtxGetDevice = "cuCtxGetDevice",
    CtxSynchronize = "cuCtxSynchronize",
    MemGetInfo = "cuMemGetInfo_v2",
    MemAlloc = "cuMemAlloc_v2",
    MemFree = "cuMemFree_v2",
    StreamCreate = "cuStreamCreate",
    StreamDestroy = "cuStreamDestroy_v2",
    StreamSynchronize = "cuStreamSynchronize",
    StreamQuery = "cuStreamQuery",
    StreamWaitEvent = "cuStreamWaitEvent",
    StreamBeginCapture = "cuStreamBeginCapture_v2",
    StreamEndCapture = "cuStreamEndCapture",
    StreamIsCapturing = "cuStreamIsCapturing",
    ThreadExchangeStreamCaptureMode = "cuThreadExchangeStreamCaptureMode",
    EventCreate = "cuEventCreate",
    EventRecord = "cuEventRecord",
    EventQuery = "cuEventQuery",
    EventSynchronize = "cuEventSynchronize",
    EventDestroy = "cuEventDestroy_v2",
    GetErrorName = "cuGetErrorName",
    GetErrorString = "cuGetErrorString",
    DeviceGetAttribute = "cuDeviceGetAttribute",
    DeviceCanAccessPeer = "cuDeviceCanAccessPeer",
    MemGetAllocationGranularity = "cuMemGetAllocationGranularity",
    MemAddressReserve = "cuMemAddressReserve",
    MemAddressFree = "cuMemAddressFree",
    MemCreate = "cuMemCreate",
    MemRelease = "cuMemRelease",
    MemMap = "cuMemMap",
    MemUnmap = "cuMemUnmap",
    MemSetAccess = "cuMemSetAccess",
    IpcGetMemHandle = "cuIpcGetMemHandle",
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A scripted failure: `call` fails with `code` at its `nth` call (1 = the next one), and at
/// every later one too when `and_after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The function that fails.
    pub call: Call,
    /// Which of its calls fails first, counting from 1.
    pub nth: u64,
    /// Whether every call after the `nth` fails too.
    pub and_after: bool,
    /// The `CUresult` it fails with (not `CUDA_SUCCESS`).
    pub code: i32,
}

impl Fault {
    /// The `nth` call of `call` fails with `code`.
    pub fn once(call: Call, nth: u64, code: i32) -> Fault {
        Fault {
            call,
            nth,
            and_after: false,
            code,
        }
    }

    /// Every call of `call` from the `nth` on fails with `code`.
    pub fn from_nth(call: Call, nth: u64, code: i32) -> Fault {
        Fault {
            call,
            nth,
            and_after: true,
            code,
        }
    }

    /// Parse one entry, `NAME@N=CODE`, `NAME@N+=CODE` or `NAME=CODE`.
    pub fn parse(entry: &str) -> Result<Fault, String> {
        let entry = entry.trim();
        let (target, code) = entry
            .split_once('=')
            .ok_or_else(|| format!("{entry:?} is not NAME@N=CODE"))?;
        let (name, position) = match target.split_once('@') {
            Some((name, position)) => (name.trim(), Some(position.trim())),
            None => (target.trim(), None),
        };
        let call = Call::from_name(name)
            .ok_or_else(|| format!("{entry:?}: {name:?} is not a driver function the simulator knows (e.g. cuMemAlloc_v2)"))?;
        let (nth, and_after) = match position {
            None => (1, true),
            Some(p) => {
                let (digits, and_after) = match p.strip_suffix('+') {
                    Some(d) => (d.trim(), true),
                    None => (p, false),
                };
                let nth: u64 = digits
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("{entry:?}: {p:?} is not a call number (1, 2, ...; N+ for every call from N on)"))?;
                (nth, and_after)
            }
        };
        let code = code.trim();
        let code = match code.parse::<i32>() {
            Ok(n) => n,
            Err(_) => crate::codes::ALL
                .iter()
                .copied()
                .find(|&c| crate::codes::name(c) == Some(code))
                .ok_or_else(|| format!("{entry:?}: {code:?} is not a CUresult (a number or a name such as CUDA_ERROR_OUT_OF_MEMORY)"))?,
        };
        if code == crate::codes::CUDA_SUCCESS {
            return Err(format!("{entry:?}: a fault cannot return CUDA_SUCCESS"));
        }
        Ok(Fault {
            call,
            nth,
            and_after,
            code,
        })
    }

    /// Parse a comma-separated list of entries (see the module documentation); empty entries
    /// are skipped.
    pub fn parse_list(spec: &str) -> Result<Vec<Fault>, String> {
        spec.split(',')
            .filter(|e| !e.trim().is_empty())
            .map(Fault::parse)
            .collect()
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plus = if self.and_after { "+" } else { "" };
        write!(f, "{}@{}{plus}={}", self.call, self.nth, self.code)
    }
}

/// A fault with the number of matching calls seen since it was injected.
#[derive(Debug)]
pub(crate) struct Armed {
    fault: Fault,
    seen: u64,
}

/// The call counters and armed faults of one simulator.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    calls: Vec<u64>,
    armed: Vec<Armed>,
    injected: u64,
}

impl Faults {
    pub(crate) fn new() -> Faults {
        Faults {
            calls: vec![0; Call::ALL.len()],
            armed: Vec::new(),
            injected: 0,
        }
    }

    /// Count a call of `call`; the code of the fault it triggers, if any.
    pub(crate) fn hit(&mut self, call: Call) -> Option<i32> {
        self.calls[call as usize] += 1;
        let mut failure = None;
        for armed in self.armed.iter_mut().filter(|a| a.fault.call == call) {
            armed.seen += 1;
            let f = &armed.fault;
            let fires = armed.seen == f.nth || (f.and_after && armed.seen > f.nth);
            if fires && failure.is_none() {
                failure = Some(f.code);
            }
        }
        if failure.is_some() {
            self.injected += 1;
        }
        failure
    }

    pub(crate) fn arm(&mut self, fault: Fault) {
        self.armed.push(Armed { fault, seen: 0 });
    }

    pub(crate) fn clear(&mut self) {
        self.armed.clear();
    }

    pub(crate) fn calls(&self, call: Call) -> u64 {
        self.calls[call as usize]
    }

    pub(crate) fn injected(&self) -> u64 {
        self.injected
    }
}
