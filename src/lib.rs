//! resmem: a CUDA device-memory caching pool that treats memory it has reserved from the driver
//! but is not using as *free* memory.
//!
//! - `rm_mem_get_info` reports the driver's free memory plus the pool's reusable bytes, so a
//!   loader that plans placement with it does not mistake cache for use;
//! - `rm_reserve` reuses cached memory before it grows, returns idle cache to the driver before
//!   the driver would run out, and retries once after returning everything on out-of-memory;
//! - `rm_warmup` allocates only the shortfall beyond what is already reusable.
//!
//! The library is used from C through `include/resmem.h` (see [`capi`]); from Rust, build a
//! [`Pool`] over a [`Driver`] directly.
//!
//! Module map (dependencies run one way: capi → runtime → share and front → pool → driver
//! trait ← cuda | sim):
//! - [`capi`]: the core `rm_*` exports and the panic boundary;
//! - [`error`]: status codes, the error type, the thread-local last-error message;
//! - [`front`]: per-thread front caches ahead of the pool, used by the C API;
//! - [`pool`]: the caching pool, pure logic over the [`Driver`] trait;
//! - [`driver`]: the trait, the CUDA driver loaded at run time, the simulated driver;
//! - [`config`]: `RESMEM_CONF` and driver settings, parsed from text;
//! - [`runtime`]: the process-wide pool built from the environment on first use;
//! - [`record`]: `RESMEM_CONF=record:PATH`, every call written as a replayable trace;
//! - [`share`]: processes sharing a device give each other their idle cache on request;
//! - [`torch`]: the entry points of PyTorch's pluggable allocator (`rm_torch_*`);
//! - `tls`: the calling thread's per-call state (one thread-local) and the quiet panic hook;
//! - `unload`: what the process-wide state gives back when the library is unloaded.

pub mod capi;
pub mod config;
pub mod driver;
pub mod error;
pub mod front;
pub mod pool;
pub mod record;
pub mod runtime;
pub mod share;
mod tls;
pub mod torch;
mod unload;

pub use driver::{Driver, DriverError};
pub use error::{rm_status, Error, Result};
pub use front::Front;
pub use pool::{Pool, PoolConfig, Stats};
