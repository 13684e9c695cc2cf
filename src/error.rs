//! Errors: the C status codes ([`rm_status`]), the crate's [`Error`] (a status and a message for
//! people), and the thread-local message behind `rm_last_error()`.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::fmt;

use crate::driver::DriverError;

/// The result of every resmem function.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum rm_status {
    /// The call did what it was asked.
    RM_SUCCESS = 0,
    /// An argument is wrong: a NULL out-pointer, a size that overflows, a malformed `RESMEM_CONF`.
    RM_ERROR_INVALID_VALUE = 1,
    /// The device ordinal is out of range for this process.
    RM_ERROR_INVALID_DEVICE = 2,
    /// The request cannot be met even after returning all reusable memory to the driver.
    RM_ERROR_OUT_OF_MEMORY = 3,
    /// The pointer was not returned by `rm_reserve`, points inside a block, or was already released.
    RM_ERROR_INVALID_POINTER = 4,
    /// No CUDA driver could be loaded or initialised.
    RM_ERROR_NO_DRIVER = 5,
    /// Another driver call failed; the message names the call and its `CUresult`.
    RM_ERROR_DRIVER = 6,
    /// A bug in resmem: a caught panic or a broken invariant. Please report it with the message.
    RM_ERROR_INTERNAL = 7,
}

impl rm_status {
    /// Every status, in order of value.
    pub const ALL: [rm_status; 8] = [
        rm_status::RM_SUCCESS,
        rm_status::RM_ERROR_INVALID_VALUE,
        rm_status::RM_ERROR_INVALID_DEVICE,
        rm_status::RM_ERROR_OUT_OF_MEMORY,
        rm_status::RM_ERROR_INVALID_POINTER,
        rm_status::RM_ERROR_NO_DRIVER,
        rm_status::RM_ERROR_DRIVER,
        rm_status::RM_ERROR_INTERNAL,
    ];

    /// The status with this numeric value, if there is one.
    pub fn from_raw(raw: i64) -> Option<rm_status> {
        rm_status::ALL.get(usize::try_from(raw).ok()?).copied()
    }

    /// A short description, as a NUL-terminated static string.
    pub fn describe_cstr(self) -> &'static std::ffi::CStr {
        match self {
            rm_status::RM_SUCCESS => c"RM_SUCCESS: success",
            rm_status::RM_ERROR_INVALID_VALUE => c"RM_ERROR_INVALID_VALUE: invalid argument",
            rm_status::RM_ERROR_INVALID_DEVICE => c"RM_ERROR_INVALID_DEVICE: no such device",
            rm_status::RM_ERROR_OUT_OF_MEMORY => {
                c"RM_ERROR_OUT_OF_MEMORY: out of device memory, even after returning reusable memory"
            }
            rm_status::RM_ERROR_INVALID_POINTER => {
                c"RM_ERROR_INVALID_POINTER: pointer unknown to the pool or already released"
            }
            rm_status::RM_ERROR_NO_DRIVER => {
                c"RM_ERROR_NO_DRIVER: no CUDA driver could be loaded or initialised"
            }
            rm_status::RM_ERROR_DRIVER => c"RM_ERROR_DRIVER: a CUDA driver call failed",
            rm_status::RM_ERROR_INTERNAL => c"RM_ERROR_INTERNAL: internal error in resmem",
        }
    }
}

/// A failure: the status a C caller sees and a message that says what happened and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// The status code.
    pub status: rm_status,
    /// What happened, with the numbers, and what to do.
    pub message: String,
}

impl Error {
    /// An error with this status and message.
    pub fn new(status: rm_status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// `RM_ERROR_INVALID_VALUE`.
    pub fn invalid_value(message: impl Into<String>) -> Error {
        Error::new(rm_status::RM_ERROR_INVALID_VALUE, message)
    }

    /// `RM_ERROR_INVALID_POINTER`.
    pub fn invalid_pointer(message: impl Into<String>) -> Error {
        Error::new(rm_status::RM_ERROR_INVALID_POINTER, message)
    }

    /// `RM_ERROR_OUT_OF_MEMORY`.
    pub fn out_of_memory(message: impl Into<String>) -> Error {
        Error::new(rm_status::RM_ERROR_OUT_OF_MEMORY, message)
    }

    /// Whether this is `RM_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        self.status == rm_status::RM_ERROR_OUT_OF_MEMORY
    }

    /// `RM_ERROR_INTERNAL`.
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(rm_status::RM_ERROR_INTERNAL, message)
    }

    /// `RM_ERROR_DRIVER` for a failed driver call made while doing `what`.
    pub fn driver(what: &str, err: &DriverError) -> Error {
        Error::new(
            rm_status::RM_ERROR_DRIVER,
            format!("{what}: {err}; the device may be in an error state (check earlier kernel launches)"),
        )
    }

    /// This error, noting that undoing the failed step failed too with `cleanup`: what could
    /// not be given back stays held by the pool, counted as reserved, for a later attempt.
    pub fn with_cleanup_failure(self, cleanup: &Error) -> Error {
        Error::new(
            self.status,
            format!(
                "{}; undoing it failed too ({}), so that memory stays reserved by the pool and \
                 rm_free_reusable returns it once the driver allows",
                self.message, cleanup.message
            ),
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.status, self.message)
    }
}

impl std::error::Error for Error {}

/// A resmem result.
pub type Result<T> = std::result::Result<T, Error>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// What `rm_last_error()` says on a thread whose locals are being destroyed (a call from a
/// thread-exit destructor, or from an `atexit` handler after the main thread's locals went).
const GONE: &std::ffi::CStr = c"no message: this thread is exiting and its message storage is \
    gone; the status code the call returned says what failed";

/// Remember `message` as this thread's last failure. While the thread's locals are being
/// destroyed the message has nowhere to go and is dropped (never a panic): the failing call
/// still returns its status.
pub fn set_last_error(message: &str) {
    // Interior NULs cannot cross into C; replace them rather than lose the message.
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    let _stored = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
}

/// This thread's last failure message as a C string; `""` if none. The pointer stays valid until
/// the next failing resmem call on this thread. While the thread's locals are being destroyed, a
/// static message that says so.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(GONE.as_ptr())
}

/// This thread's last failure message.
pub fn last_error() -> String {
    LAST_ERROR
        .try_with(|slot| slot.borrow().to_string_lossy().into_owned())
        .unwrap_or_else(|_| GONE.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_values_match_the_c_contract() {
        for (i, status) in rm_status::ALL.iter().enumerate() {
            assert_eq!(*status as i64, i as i64);
            assert_eq!(rm_status::from_raw(i as i64), Some(*status));
        }
        assert_eq!(rm_status::from_raw(8), None);
        assert_eq!(rm_status::from_raw(-1), None);
    }

    #[test]
    fn last_error_is_per_thread_and_survives_nul() {
        set_last_error("first\0second");
        assert_eq!(last_error(), "first\\0second");
        std::thread::spawn(|| assert_eq!(last_error(), ""))
            .join()
            .unwrap();
    }
}
