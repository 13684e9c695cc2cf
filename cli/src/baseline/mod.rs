//! Reference policies that resmem's figures are compared against. Each implements
//! [`crate::allocator::Allocator`] over the same [`resmem::Driver`] trait as the pool, so trace replay, the
//! demo and the benchmarks drive them through the same calls.
//!
//! - [`torch`]: PyTorch's native CUDA caching allocator, as `c10/cuda/CUDACachingAllocator.cpp`
//!   documents it, and `expandable.rs`, its expandable segments;
//! - [`conf`]: the settings it ran with, from a snapshot or `PYTORCH_CUDA_ALLOC_CONF`.

pub mod conf;
mod expandable;
mod keys;
pub mod torch;

pub use conf::TorchSettings;
pub use torch::{TorchAllocator, TorchConfig};

#[cfg(test)]
mod tests;
