//! `CUresult` values, as defined in `cuda.h`, with their names and the
//! driver's descriptions.

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
/// The operation cannot be made in the present state (a capture begun twice, or ended where
/// none began).
pub const CUDA_ERROR_ILLEGAL_STATE: i32 = 401;
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
/// The operation is not permitted while a stream captures a graph.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
/// The capture was invalidated by an earlier error.
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: i32 = 901;
/// A capturing stream was made to wait for work outside its capture.
pub const CUDA_ERROR_STREAM_CAPTURE_ISOLATION: i32 = 905;
/// The event was last recorded in a capture: it stands for graph work, not asked after.
pub const CUDA_ERROR_CAPTURED_EVENT: i32 = 907;
/// An unknown internal error.
pub const CUDA_ERROR_UNKNOWN: i32 = 999;

/// Every code this module knows, in increasing order.
pub const ALL: [i32; 21] = [
    CUDA_SUCCESS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
    CUDA_ERROR_CAPTURED_EVENT,
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
        CUDA_ERROR_ILLEGAL_STATE => (
            "CUDA_ERROR_ILLEGAL_STATE",
            "the operation cannot be performed in the present state",
        ),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => (
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "operation not permitted when stream is capturing",
        ),
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => (
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            "operation failed due to a previous error during capture",
        ),
        CUDA_ERROR_STREAM_CAPTURE_ISOLATION => (
            "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
            "dependency created on uncaptured work in another stream",
        ),
        CUDA_ERROR_CAPTURED_EVENT => (
            "CUDA_ERROR_CAPTURED_EVENT",
            "operation not permitted on an event last recorded in a capturing stream",
        ),
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
