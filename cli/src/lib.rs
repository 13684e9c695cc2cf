//! The `resmem` command's logic, as a library so that its tests and benchmarks can call it:
//!
//! - [`model`]: parameter shapes of real models (the presets of `resmem demo`);
//! - [`demo`]: the seed scenario, four loads of a model under each policy;
//! - [`share_demo`]: two loaders in two processes sharing a device, without and with sharing;
//! - [`trace`]: allocation traces, read from JSON lines or PyTorch memory snapshots;
//! - [`replay`]: a trace driven through a policy on a simulated device, and its figures;
//! - [`generate`]: the realistic traces shipped in `traces/`;
//! - [`plot`]: reserved and allocated memory over a trace, as SVG;
//! - [`units`]: byte counts parsed from and printed for people.
//!
//! The command depends on the resmem library (rlib) and adds the crates only a command needs
//! (argument parsing, plots, progress bars, serialization), which the C library never links.

pub mod demo;
pub mod generate;
pub mod model;
pub mod plot;
pub mod replay;
pub mod share_demo;
pub mod trace;
pub mod units;
