//! The seed through PyTorch's own calls: transformers (before PR #37920) loading Qwen3-4B four
//! times on a 24 GiB device, as the caching allocator sees it. Each load warms up with one
//! `torch.empty` of the parameters' bytes plus the tied `lm_head` counted again, released; then
//! reserves each of the 398 parameter tensors; generation allocates and frees activations in the
//! 0.72 GiB tail the parameters leave, and one 8.125 MiB block outlives `generate()` (until the
//! next load's generation); then the parameters are released. PyTorch's policy grows to two
//! warm-ups (the seed's 16.44 GiB); the default pool, fed the same calls (no `rm_warmup`), stays
//! within 2% of one.

use std::sync::Arc;

use cuda_sim::Sim;
use resmem::driver::sim::SimDriver;
use resmem::{Pool, PoolConfig};
use resmem_cli::allocator::Allocator;
use resmem_cli::baseline::{TorchAllocator, TorchConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Qwen3-4B's parameter tensors in bf16, in load order (`src/model.rs` has the same
/// configuration): the embedding, 36 layers of 11 tensors, the final norm.
fn qwen3_4b_tensors() -> Vec<u64> {
    let (hidden, inter, heads, kv_heads, head_dim, vocab) = (2560, 9728, 32, 8, 128, 151_936);
    let mut tensors = vec![vocab * hidden];
    for _ in 0..36 {
        tensors.extend([
            hidden * heads * head_dim,
            hidden * kv_heads * head_dim,
            hidden * kv_heads * head_dim,
            heads * head_dim * hidden,
            hidden * inter,
            hidden * inter,
            inter * hidden,
            hidden,
            hidden,
            head_dim,
            head_dim,
        ]);
    }
    tensors.push(hidden);
    tensors.iter().map(|&n| n * 2).collect()
}

/// The tied `lm_head` (151936 x 2560 in bf16), which the warm-up counts again.
const LM_HEAD: u64 = 151_936 * 2560 * 2;

/// Four loads through `a`; returns the peak reserved bytes.
fn four_loads(a: &dyn Allocator) -> u64 {
    let tensors = qwen3_4b_tensors();
    let warmup: u64 = tensors.iter().sum::<u64>() + LM_HEAD;
    let mut survivor = None;
    for _ in 0..4 {
        let w = a.reserve(0, warmup, 0).unwrap();
        a.release(w).unwrap();
        let params: Vec<u64> = tensors
            .iter()
            .map(|&t| a.reserve(0, t, 0).unwrap())
            .collect();
        // generate(): activations of 2 MiB, 4 MiB and 64 KiB per step, and the survivor.
        for step in 0..32 {
            let x = a.reserve(0, 2 * MIB, 0).unwrap();
            let y = a.reserve(0, 4 * MIB, 0).unwrap();
            let z = a.reserve(0, 64 << 10, 0).unwrap();
            if step == 16 {
                let kept = a.reserve(0, 8 * MIB + 128 * 1024, 0).unwrap();
                if let Some(old) = survivor.replace(kept) {
                    a.release(old).unwrap();
                }
            }
            for p in [x, y, z] {
                a.release(p).unwrap();
            }
        }
        for p in params {
            a.release(p).unwrap();
        }
    }
    a.stats(0).unwrap().peak_reserved_bytes
}

fn sim_driver() -> Arc<SimDriver> {
    let sim: &'static Sim = Box::leak(Box::new(Sim::new(&[24 * GIB])));
    Arc::new(SimDriver::new(sim).unwrap())
}

#[test]
fn the_seed_under_pytorchs_policy_grows_to_two_warm_ups() {
    let tensors = qwen3_4b_tensors();
    assert_eq!(
        (tensors.len(), tensors.iter().sum::<u64>()),
        (398, 8_044_936_192)
    );
    let torch = TorchAllocator::new(sim_driver(), TorchConfig::default()).unwrap();
    let peak = four_loads(&torch);
    // Two warm-up segments (8,822,848,512 bytes rounded up to 2 MiB pages: 8,824,815,616) and
    // one 2 MiB small segment.
    assert_eq!(peak, 2 * 8_824_815_616 + 2 * MIB);
    assert_eq!(format!("{:.2}", peak as f64 / GIB as f64), "16.44");
}

#[test]
fn the_seed_under_the_default_stays_at_one_warm_up() {
    let pool = Pool::new(sim_driver(), PoolConfig::default());
    let warmup = 8_822_848_512u64;
    let peak = four_loads(&pool);
    pool.check().unwrap();
    assert!(peak * 100 <= warmup * 102, "{peak} bytes");
    // One warm-up segment, and 80 MiB: when the next warm-up is mapped from the first one's free
    // pages, the 10 MiB the survivor keeps from it are created with headroom: the cache the
    // range took earns credit up to eight times what it lacked (`headroom.rs`), 80 MiB; the
    // 2 MiB small segment is mapped from cached pages: 1.0097x.
    assert_eq!(peak, 8_824_815_616 + 80 * MIB);
}
