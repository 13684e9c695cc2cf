//! The process-wide pool behind the C API, built once from the environment on first use.
//!
//! Nothing is loaded before the first call: a program that links resmem but never calls it
//! never opens the driver. A failure to start (no driver, a malformed variable) is remembered
//! and returned, with its message, by every later call.

use std::sync::{Arc, OnceLock};

use crate::config::{DriverChoice, Settings};
use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::driver::Driver;
use crate::error::Error;
use crate::pool::Pool;

static SETTINGS: OnceLock<Result<Settings, Error>> = OnceLock::new();
static POOL: OnceLock<Result<Pool, Error>> = OnceLock::new();

fn var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// Build a pool from settings.
pub fn build(settings: &Settings) -> Result<Pool, Error> {
    let driver: Arc<dyn Driver> = match &settings.driver {
        DriverChoice::Cuda(library) => Arc::new(CudaDriver::load(library)?),
        DriverChoice::Sim => Arc::new(SimDriver::new(cuda_sim::Sim::global())?),
    };
    Ok(Pool::new(driver, settings.pool))
}

/// The process's settings, read once from `RESMEM_DRIVER`, `RESMEM_CUDA_LIBRARY` and
/// `RESMEM_CONF`. Reading them loads nothing.
pub fn settings() -> Result<&'static Settings, Error> {
    SETTINGS
        .get_or_init(|| {
            let (driver, library, conf) = (
                var("RESMEM_DRIVER"),
                var("RESMEM_CUDA_LIBRARY"),
                var("RESMEM_CONF"),
            );
            Settings::from_vars(driver.as_deref(), library.as_deref(), conf.as_deref())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The process-wide pool, created on first use from [`settings`].
pub fn pool() -> Result<&'static Pool, Error> {
    POOL.get_or_init(|| settings().and_then(build))
        .as_ref()
        .map_err(Clone::clone)
}

/// The process-wide pool if a call has already started it; `None` otherwise (nothing is loaded).
pub fn started() -> Option<&'static Pool> {
    POOL.get().and_then(|pool| pool.as_ref().ok())
}
