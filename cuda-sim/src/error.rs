//! The error of a failed simulated driver call.

use std::fmt;

use crate::codes;

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
