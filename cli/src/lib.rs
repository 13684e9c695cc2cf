//! The `resmem` command's logic, as a library so that its tests and benchmarks can call it:
//!
//! - [`allocator`]: the [`allocator::Allocator`] trait every policy compared here implements;
//! - [`baseline`]: PyTorch's caching-allocator policy, the reference resmem is measured against;
//! - [`env`](mod@env): the environment, validated the same way for every subcommand, and the device;
//! - [`info`]: `resmem info`'s table;
//! - [`model`]: parameter shapes of real models (the presets of `resmem demo`);
//! - [`seed`]: the seed scenario as the calls PyTorch's allocator gets;
//! - [`demo`]: the seed scenario under each policy, with a loader that offloads;
//! - [`share_demo`]: two loaders in two processes sharing a device, without and with sharing;
//! - [`trace`]: allocation traces, read from JSON lines or PyTorch memory snapshots;
//! - [`snapshot`]: PyTorch memory snapshots read as traces, with the blocks live before
//!   recording began;
//! - [`replay`]: a trace driven through a policy on a simulated device, and its figures;
//! - [`report`]: the figures of replays as a table and as JSON;
//! - [`generate`]: the realistic traces shipped in `traces/`;
//! - [`plot`]: reserved and allocated memory over a trace, as SVG;
//! - [`units`]: byte counts parsed from and printed for people.
//!
//! The command depends on the resmem library (rlib) and adds the crates only a command needs
//! (argument parsing, plots, progress bars, serialization), which the C library never links.

pub mod allocator;
pub mod baseline;
pub mod demo;
pub mod env;
pub mod generate;
pub mod info;
pub mod model;
pub mod pickle;
pub mod plot;
pub mod replay;
pub mod report;
pub mod seed;
pub mod share_demo;
pub mod snapshot;
pub mod trace;
pub mod units;
