//! The seed scenario as PyTorch's allocator sees it: what one load of a model by transformers
//! before PR #37920, one `generate()` and the model's deletion ask of the allocator.
//!
//! 1. `caching_allocator_warmup`: ONE `torch.empty` of the bytes of the parameters going to the
//!    device, with a tied `lm_head` counted again (it is the embedding, but the warm-up sums
//!    every name in the device map), freed at once so that it stays cached;
//! 2. every parameter tensor placed on the device, in checkpoint order (under PyTorch's policy
//!    they are carved out of the warm-up's block, leaving a tail the size of the double count);
//! 3. `generate()`: a prompt's prefill and a few decoding steps, whose activations and
//!    key-value cache land in that tail, and one 8.125 MiB block that outlives `generate()`;
//! 4. the model deleted: every parameter freed. The survivor stays, splitting the cached
//!    block, so the next load's warm-up no longer fits in it.

use crate::model::Shape;
use crate::trace::Event;

const BF16: u64 = 2;
/// Tokens of the prompt.
pub const PROMPT: u64 = 1024;
/// Tokens generated.
pub const NEW_TOKENS: u64 = 16;
/// The block that outlives `generate()`: 8.125 MiB (the seed's 0.0079 GiB allocated after it).
pub const SURVIVOR: u64 = 8_519_680;

/// Each parameter's bytes in bf16, in checkpoint order.
pub fn parameter_bytes(shape: &Shape) -> Vec<u64> {
    shape.parameters().iter().map(|p| p * BF16).collect()
}

/// The warm-up's bytes when the first `placed` parameters go to the device: their sum, plus the
/// embedding again when the model ties `lm_head` to it and it is on the device.
pub fn warmup_bytes(shape: &Shape, placed: usize) -> u64 {
    let sizes = parameter_bytes(shape);
    let on_device: u64 = sizes.iter().take(placed).sum();
    let tied_again = if shape.tied && placed > 0 {
        sizes[0]
    } else {
        0
    };
    on_device + tied_again
}

/// Names blocks in order while a load's events are written.
#[derive(Debug, Default)]
pub struct Calls {
    /// The events so far.
    pub events: Vec<Event>,
    next: u64,
}

impl Calls {
    fn alloc(&mut self, size: u64) -> u64 {
        self.next += 1;
        self.events.push(Event::Alloc {
            id: self.next,
            size,
            stream: 0,
        });
        self.next
    }

    fn free(&mut self, id: u64) {
        self.events.push(Event::Free { id });
    }

    /// Load number `load` with the first `placed` parameters on the device, generate, delete
    /// the model.
    pub fn load(&mut self, shape: &Shape, load: u32, placed: usize) {
        self.events.push(Event::Mark {
            label: format!("load {load}: warm-up, parameters, generate(), del model"),
        });
        let warm = self.alloc(warmup_bytes(shape, placed));
        self.free(warm);
        let params: Vec<u64> = parameter_bytes(shape)
            .into_iter()
            .take(placed)
            .map(|size| self.alloc(size))
            .collect();
        self.generate(shape);
        for id in params {
            self.free(id);
        }
    }

    /// `generate()`: prefill of [`PROMPT`] tokens layer by layer (hidden states, the MLP's
    /// activation, the key-value cache), the survivor, [`NEW_TOKENS`] decoding steps that grow the
    /// cache by concatenation (new tensors, old ones freed) and take the last token's logits,
    /// then everything but the survivor freed.
    fn generate(&mut self, shape: &Shape) {
        let (h, kv) = (shape.hidden, shape.kv_heads * shape.head_dim);
        let mut cache = Vec::new();
        let mut hidden = self.alloc(PROMPT * h * BF16);
        for _ in 0..shape.layers {
            let k = self.alloc(PROMPT * kv * BF16);
            let v = self.alloc(PROMPT * kv * BF16);
            cache.push((k, v));
            let mlp = self.alloc(PROMPT * shape.intermediate * BF16);
            let out = self.alloc(PROMPT * h * BF16);
            self.free(mlp);
            self.free(hidden);
            hidden = out;
        }
        self.free(hidden);
        self.alloc(SURVIVOR); // never freed
        for t in 1..=NEW_TOKENS {
            for layer in cache.iter_mut() {
                let k = self.alloc((PROMPT + t) * kv * BF16);
                let v = self.alloc((PROMPT + t) * kv * BF16);
                self.free(layer.0);
                self.free(layer.1);
                *layer = (k, v);
            }
            let logits = self.alloc(shape.vocab * BF16);
            self.free(logits);
        }
        for (k, v) in cache {
            self.free(k);
            self.free(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LLAMA_3_8B, QWEN3_4B};

    #[test]
    fn the_warmup_counts_a_tied_head_again() {
        let params = QWEN3_4B.parameter_count() * BF16;
        assert_eq!(params, 8_044_936_192);
        // 151936 x 2560 x 2 bytes more: 8.22 GiB in all.
        let all = QWEN3_4B.parameters().len();
        assert_eq!(warmup_bytes(&QWEN3_4B, all), params + 151_936 * 2560 * 2);
        assert_eq!(warmup_bytes(&QWEN3_4B, all), 8_822_848_512);
        assert_eq!(warmup_bytes(&QWEN3_4B, 0), 0);
        let llama = LLAMA_3_8B.parameters().len();
        assert_eq!(
            warmup_bytes(&LLAMA_3_8B, llama),
            LLAMA_3_8B.parameter_count() * BF16
        );
    }

    #[test]
    fn a_load_frees_all_but_the_survivor() {
        let mut calls = Calls::default();
        calls.load(&QWEN3_4B, 1, 10);
        let mut live = std::collections::HashMap::new();
        for e in &calls.events {
            match e {
                Event::Alloc { id, size, .. } => {
                    live.insert(*id, *size);
                }
                Event::Free { id } => {
                    live.remove(id).unwrap();
                }
                _ => {}
            }
        }
        assert_eq!(live.into_values().collect::<Vec<_>>(), vec![SURVIVOR]);
    }
}
