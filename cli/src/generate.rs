//! The traces shipped in `traces/`, generated from real models' layer shapes (see
//! `traces/README.md`): `resmem gen-trace KIND` prints one, `resmem gen-trace --all traces`
//! rewrites them all.

use crate::model::{Shape, LLAMA_3_8B, QWEN3_0_6B, QWEN3_4B};
use crate::trace::{Event, Trace};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const BF16: u64 = 2;
const F32: u64 = 4;

/// The kinds of trace, by file name (without `.jsonl`).
pub const KINDS: [&str; 8] = [
    "qwen3-4b-seed",
    "qwen3-4b-loads",
    "model-swap",
    "llama-3-8b-decode",
    "qwen3-0.6b-training",
    "transformers-37436",
    "interleaved-lifetimes",
    "random-sizes",
];

/// The trace called `kind`.
pub fn by_name(kind: &str) -> Result<Trace, String> {
    match kind {
        "qwen3-4b-seed" => Ok(seed_calls(&QWEN3_4B, 4, 24 * GIB)),
        "qwen3-4b-loads" => Ok(model_loads(&QWEN3_4B, 4, 24 * GIB)),
        "model-swap" => Ok(model_swap(
            &[QWEN3_0_6B, LLAMA_3_8B, QWEN3_4B, LLAMA_3_8B],
            48 * GIB,
        )),
        "llama-3-8b-decode" => Ok(decode()),
        "qwen3-0.6b-training" => Ok(training()),
        "transformers-37436" => Ok(transformers_37436()),
        "interleaved-lifetimes" => Ok(interleaved_lifetimes()),
        "random-sizes" => Ok(random_sizes()),
        _ => Err(format!(
            "unknown trace `{kind}`; the kinds are {}",
            KINDS.join(", ")
        )),
    }
}

/// Builds a trace, naming blocks in order.
struct Gen {
    trace: Trace,
    next: u64,
}

impl Gen {
    fn new(name: &str, device_memory: u64, description: &str) -> Gen {
        Gen {
            trace: Trace {
                name: name.to_string(),
                description: description.to_string(),
                device_memory: Some(device_memory),
                ..Trace::default()
            },
            next: 0,
        }
    }

    fn alloc(&mut self, size: u64) -> u64 {
        self.next += 1;
        self.trace.events.push(Event::Alloc {
            id: self.next,
            size,
            stream: 0,
        });
        self.next
    }

    fn free(&mut self, id: u64) {
        self.trace.events.push(Event::Free { id });
    }

    fn mark(&mut self, label: String) {
        self.trace.events.push(Event::Mark { label });
    }

    /// Load a model's parameters in bf16 after transformers' warm-up; their ids.
    fn load(&mut self, shape: &Shape) -> Vec<u64> {
        let sizes: Vec<u64> = shape.parameters().iter().map(|p| p * BF16).collect();
        self.trace.events.push(Event::Warmup {
            bytes: sizes.iter().sum(),
        });
        sizes.iter().map(|&s| self.alloc(s)).collect()
    }
}

/// `loads` consecutive loads of `shape` in bf16, each warmed up like transformers and dropped
/// before the next (the seed scenario).
pub fn model_loads(shape: &Shape, loads: u32, device_memory: u64) -> Trace {
    let mut g = Gen::new(
        &format!("{}-loads", shape.name),
        device_memory,
        &format!(
            "{loads} consecutive loads of {} in bf16, each after transformers' \
             caching_allocator_warmup, the model dropped before the next",
            shape.name
        ),
    );
    for load in 1..=loads {
        g.mark(format!("load {load}"));
        for id in g.load(shape) {
            g.free(id);
        }
    }
    g.trace
}

/// The seed's calls as PyTorch's allocator gets them ([`crate::seed`]): `loads` loads of
/// `shape` with every parameter on the device (a trace cannot offload: `resmem demo` runs the
/// same calls with a loader that does).
pub fn seed_calls(shape: &Shape, loads: u32, device_memory: u64) -> Trace {
    let mut calls = crate::seed::Calls::default();
    for load in 1..=loads {
        calls.load(shape, load, shape.parameters().len());
    }
    Trace {
        name: format!("{}-seed", shape.name),
        description: format!(
            "the seed through PyTorch's calls: {loads} loads of {} in bf16 by transformers \
             before PR #37920 (one warm-up torch.empty of the parameters with the tied lm_head \
             counted twice, freed; the parameters; generate(), after which one 8.125 MiB block \
             stays live; del model)",
            shape.name
        ),
        device_memory: Some(device_memory),
        events: calls.events,
        ..Trace::default()
    }
}

/// One process loading `models` one after the other, each larger than the last, through the
/// seed's calls ([`crate::seed`]: a warm-up `torch.empty` of the parameters, freed; the
/// parameters; `generate()`, after which one block stays live; `del model`), as an evaluation
/// harness or a server swapping models does. Each warm-up is larger than all the cache the models
/// before it left.
pub fn model_swap(models: &[Shape], device_memory: u64) -> Trace {
    let mut calls = crate::seed::Calls::default();
    for (load, shape) in (1..).zip(models) {
        calls.load(shape, load, shape.parameters().len());
    }
    let names: Vec<&str> = models.iter().map(|m| m.name).collect();
    Trace {
        name: "model-swap".to_string(),
        description: format!(
            "one process loading {} in turn by transformers before PR #37920 (a warm-up \
             torch.empty of the parameters, freed; the parameters; generate(), after which one \
             block stays live; del model): each warm-up larger than all the earlier loads left",
            names.join(", then ")
        ),
        device_memory: Some(device_memory),
        events: calls.events,
        ..Trace::default()
    }
}

/// Llama-3-8B serving five requests of different batch sizes and prompt lengths, with a KV cache
/// that grows by concatenation each step as transformers' `DynamicCache` does.
fn decode() -> Trace {
    let s = LLAMA_3_8B;
    let mut g = Gen::new(
        "llama-3-8b-decode",
        24 * GIB,
        "Llama-3-8B in bf16 generating for five requests (batch 1 to 16, prompts of 128 to 2048 \
         tokens): prefill activations, then per step and layer a query, a key-value cache that \
         grows by one token through concatenation (new tensor, old one freed) and the MLP's \
         intermediate activation",
    );
    g.mark("load".into());
    let _weights = g.load(&s);
    let (h, q, kv, d, inter) = (
        s.hidden,
        s.q_heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.head_dim,
        s.intermediate,
    );
    for (batch, prompt, new_tokens) in [
        (1, 512, 32),
        (8, 256, 32),
        (4, 1024, 16),
        (16, 128, 32),
        (2, 2048, 16),
    ] {
        g.mark(format!(
            "request: batch {batch}, prompt {prompt}, {new_tokens} new tokens"
        ));
        let tokens = batch * prompt;
        let mut hidden = g.alloc(tokens * h * BF16);
        let mut cache = Vec::new();
        for _ in 0..s.layers {
            let norm = g.alloc(tokens * h * BF16);
            let query = g.alloc(tokens * q * BF16);
            let k = g.alloc(tokens * kv * BF16);
            let v = g.alloc(tokens * kv * BF16);
            cache.push((k, v));
            let attn = g.alloc(tokens * q * BF16);
            g.free(query);
            g.free(norm);
            let gate = g.alloc(tokens * inter * BF16);
            let up = g.alloc(tokens * inter * BF16);
            let act = g.alloc(tokens * inter * BF16);
            g.free(gate);
            g.free(up);
            let next = g.alloc(tokens * h * BF16);
            g.free(act);
            g.free(attn);
            g.free(hidden);
            hidden = next;
        }
        let logits = g.alloc(batch * s.vocab * F32);
        g.free(logits);
        for step in 0..new_tokens {
            let len = prompt + step + 1;
            for (k, v) in cache.iter_mut() {
                let query = g.alloc(batch * q * BF16);
                for kv_id in [k, v] {
                    let token = g.alloc(batch * kv * BF16);
                    let grown = g.alloc(batch * s.kv_heads * len * d * BF16);
                    g.free(*kv_id);
                    g.free(token);
                    *kv_id = grown;
                }
                let act = g.alloc(batch * inter * BF16);
                g.free(act);
                g.free(query);
            }
            let logits = g.alloc(batch * s.vocab * F32);
            g.free(logits);
        }
        for (k, v) in cache {
            g.free(k);
            g.free(v);
        }
        g.free(hidden);
    }
    g.trace
}

/// Three steps of training Qwen3-0.6B in bf16 with AdamW (fp32 moments), batch 4 of 1024 tokens:
/// activations saved layer by layer, freed in reverse during the backward pass, gradients
/// allocated there and freed by `zero_grad(set_to_none=True)`, optimizer states on the first
/// step.
fn training() -> Trace {
    let s = QWEN3_0_6B;
    let mut g = Gen::new(
        "qwen3-0.6b-training",
        24 * GIB,
        "three training steps of Qwen3-0.6B in bf16 with AdamW (fp32 moments), batch 4 x 1024 \
         tokens: saved activations per layer, fp32 logits, gradients per parameter, optimizer \
         states created on the first step",
    );
    let tokens = 4 * 1024;
    let (h, q, kv, inter) = (
        s.hidden,
        s.q_heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.intermediate,
    );
    let params: Vec<u64> = s.parameters().iter().map(|p| p * BF16).collect();
    g.mark("load".into());
    let _weights: Vec<u64> = params.iter().map(|&p| g.alloc(p)).collect();
    let mut moments: Vec<u64> = Vec::new();
    for step in 1..=3 {
        g.mark(format!("step {step}: forward"));
        let mut saved = vec![g.alloc(tokens * h * BF16)]; // the embedding's output
        for _ in 0..s.layers {
            for size in [h, q, kv, kv, q] {
                saved.push(g.alloc(tokens * size * BF16)); // norm, q, k, v, attention output
            }
            saved.push(g.alloc(tokens * s.q_heads * F32)); // log-sum-exp per head and token
            saved.push(g.alloc(tokens * h * BF16)); // residual after attention
            saved.push(g.alloc(tokens * h * BF16)); // second norm
            for _ in 0..3 {
                saved.push(g.alloc(tokens * inter * BF16)); // gate, up, activation
            }
            saved.push(g.alloc(tokens * h * BF16)); // the layer's output
        }
        let norm = g.alloc(tokens * h * BF16);
        let logits = g.alloc(tokens * s.vocab * F32);
        let loss = g.alloc(F32);
        g.mark(format!("step {step}: backward"));
        let grad_logits = g.alloc(tokens * s.vocab * F32);
        g.free(logits);
        g.free(loss);
        let mut grads: Vec<u64> = Vec::new();
        grads.push(g.alloc(params[0])); // embedding (tied with the output)
        let mut grad_hidden = g.alloc(tokens * h * BF16);
        g.free(grad_logits);
        g.free(norm);
        let per_layer = params.len().saturating_sub(2) / s.layers as usize;
        for layer in (0..s.layers as usize).rev() {
            for size in [inter, inter, inter, h, q, kv, kv, q] {
                let grad = g.alloc(tokens * size * BF16);
                g.free(grad);
            }
            for &p in &params[1 + layer * per_layer..1 + (layer + 1) * per_layer] {
                grads.push(g.alloc(p));
            }
            for _ in 0..12 {
                if let Some(id) = saved.pop() {
                    g.free(id);
                }
            }
            let next = g.alloc(tokens * h * BF16);
            g.free(grad_hidden);
            grad_hidden = next;
        }
        grads.push(g.alloc(params[params.len() - 1]));
        g.free(grad_hidden);
        for id in saved {
            g.free(id);
        }
        g.mark(format!("step {step}: optimizer"));
        if moments.is_empty() {
            for &p in &params {
                moments.push(g.alloc(p / BF16 * F32));
                moments.push(g.alloc(p / BF16 * F32));
            }
        }
        for &p in &params {
            let tmp = g.alloc(p / BF16 * F32);
            g.free(tmp);
        }
        for id in grads {
            g.free(id);
        }
    }
    g.trace
}

/// transformers issue #37436 as PyTorch's allocator meets it: 748 MiB cached but spread over
/// 20 MiB segments that each keep a live 4 MiB block, 736 MiB free on the driver, and a
/// 784 MiB request.
pub fn transformers_37436() -> Trace {
    let mut g = Gen::new(
        "transformers-37436",
        1676 * MIB,
        "transformers #37436: 235 activations of 4 MiB, 187 of them freed so that 748 MiB is \
         cached (in PyTorch's 20 MiB segments, each still holding a live block), 736 MiB free on \
         the driver, then a 784 MiB request",
    );
    g.mark("activations".into());
    let ids: Vec<u64> = (0..235).map(|_| g.alloc(4 * MIB)).collect();
    for (i, &id) in ids.iter().enumerate() {
        let (segment, slot) = (i / 5, i % 5);
        if slot != 0 && !(segment == 46 && slot == 1) {
            g.free(id);
        }
    }
    g.mark("the 784 MiB request".into());
    g.alloc(784 * MIB);
    g.trace
}

/// Mixed sizes with long-lived blocks interleaved among short-lived ones, the fragmentation
/// GMLake measured in LLM training: a serving process keeps per-request state (1 to 16 MiB)
/// while the activations around it come and go (4 to 64 MiB), then a long prompt needs large
/// buffers. Free memory ends up in pieces between live blocks.
pub fn interleaved_lifetimes() -> Trace {
    let mut g = Gen::new(
        "interleaved-lifetimes",
        4 * GIB,
        "300 rounds on a 4 GiB device: per round one long-lived block of 1 to 16 MiB and three \
         short-lived activations of 4 to 64 MiB (two freed in the round, one in the next), every \
         third long-lived block freed later; then eight 256 MiB buffers for a long prompt",
    );
    let mut next = sequence(0x2545_F491_4F6C_DD1D);
    g.mark("rounds".into());
    let mut long_lived = Vec::new();
    let mut carried: Option<u64> = None;
    for round in 0..300u64 {
        long_lived.push(g.alloc((1 + next(16)) * MIB + next(4) * 4096));
        let acts: Vec<u64> = (0..3)
            .map(|_| g.alloc((4 + next(61)) * MIB + next(8) * 512))
            .collect();
        if let Some(id) = carried.take() {
            g.free(id);
        }
        g.free(acts[0]);
        g.free(acts[2]);
        carried = Some(acts[1]);
        if round % 3 == 2 {
            let i = next(long_lived.len() as u64) as usize;
            let id = long_lived.swap_remove(i);
            g.free(id);
        }
    }
    if let Some(id) = carried {
        g.free(id);
    }
    g.mark("long prompt".into());
    let buffers: Vec<u64> = (0..8).map(|_| g.alloc(256 * MIB)).collect();
    for id in buffers {
        g.free(id);
    }
    g.trace
}

/// A fixed linear congruential sequence from `seed`: numbers below the bound asked, the same
/// every time.
fn sequence(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed;
    move |below: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % below
    }
}

/// No structure a policy could be fitted to: allocations of sizes spread evenly over the
/// powers of two from 512 B to 256 MiB, and frees of live blocks picked at random, the working
/// set drifting upward as a serving process's does while its batches grow.
pub fn random_sizes() -> Trace {
    let mut g = Gen::new(
        "random-sizes",
        24 * GIB,
        "6,000 operations on a 24 GiB device: allocations of sizes spread evenly over the powers \
         of two from 512 B to 256 MiB, and (48% of the operations) frees of a live block picked \
         at random; the rest freed at the end",
    );
    let mut next = sequence(0x9E37_79B9_7F4A_7C15);
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..6000 {
        if !live.is_empty() && next(100) < 48 {
            let i = next(live.len() as u64) as usize;
            let id = live.swap_remove(i);
            g.free(id);
        } else {
            // 2^(9..28) times 1 to 2 in 1,024 steps.
            let size = ((1024 + next(1024)) << (9 + next(19))) >> 10;
            live.push(g.alloc(size));
        }
    }
    for id in live {
        g.free(id);
    }
    g.trace
}
