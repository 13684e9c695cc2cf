//! Parameter shapes of real decoder-only transformers, in the order their checkpoints list them.

/// A model's architecture, as its `config.json` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The preset's name, e.g. `qwen3-4b`.
    pub name: &'static str,
    /// `hidden_size`.
    pub hidden: u64,
    /// `intermediate_size`.
    pub intermediate: u64,
    /// `num_hidden_layers`.
    pub layers: u64,
    /// `num_attention_heads`.
    pub q_heads: u64,
    /// `num_key_value_heads`.
    pub kv_heads: u64,
    /// `head_dim`.
    pub head_dim: u64,
    /// `vocab_size`.
    pub vocab: u64,
    /// `tie_word_embeddings`: the output projection shares the embedding.
    pub tied: bool,
    /// Per-head RMS norms on queries and keys (Qwen3).
    pub qk_norm: bool,
}

/// Qwen3-4B.
pub const QWEN3_4B: Shape = Shape {
    name: "qwen3-4b",
    hidden: 2560,
    intermediate: 9728,
    layers: 36,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 151936,
    tied: true,
    qk_norm: true,
};

/// Meta-Llama-3-8B.
pub const LLAMA_3_8B: Shape = Shape {
    name: "llama-3-8b",
    hidden: 4096,
    intermediate: 14336,
    layers: 32,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128256,
    tied: false,
    qk_norm: false,
};

/// Mistral-7B-v0.1.
pub const MISTRAL_7B: Shape = Shape {
    name: "mistral-7b",
    hidden: 4096,
    intermediate: 14336,
    layers: 32,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 32000,
    tied: false,
    qk_norm: false,
};

/// Qwen3-0.6B (the training trace's model).
pub const QWEN3_0_6B: Shape = Shape {
    name: "qwen3-0.6b",
    hidden: 1024,
    intermediate: 3072,
    layers: 28,
    q_heads: 16,
    kv_heads: 8,
    head_dim: 128,
    vocab: 151936,
    tied: true,
    qk_norm: true,
};

/// The presets `resmem demo --model` accepts.
pub const PRESETS: [Shape; 4] = [QWEN3_4B, LLAMA_3_8B, MISTRAL_7B, QWEN3_0_6B];

/// The preset called `name`.
pub fn preset(name: &str) -> Result<Shape, String> {
    PRESETS
        .iter()
        .find(|s| s.name == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|s| s.name).collect();
            format!(
                "unknown model `{name}`; the presets are {}",
                names.join(", ")
            )
        })
}

impl Shape {
    /// Every parameter tensor's element count, in checkpoint order.
    pub fn parameters(&self) -> Vec<u64> {
        let (h, q, kv) = (
            self.hidden,
            self.q_heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let mut p = vec![self.vocab * h]; // embed_tokens
        for _ in 0..self.layers {
            p.extend([h, q * h, kv * h, kv * h, h * q]); // input norm, q, k, v, o
            if self.qk_norm {
                p.extend([self.head_dim, self.head_dim]);
            }
            p.push(h); // post-attention norm
            p.extend([self.intermediate * h; 3]); // gate, up, down
        }
        p.push(h); // final norm
        if !self.tied {
            p.push(self.vocab * h); // lm_head
        }
        p
    }

    /// Total parameters.
    pub fn parameter_count(&self) -> u64 {
        self.parameters().iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_published_models() {
        assert_eq!(QWEN3_4B.parameter_count(), 4_022_468_096);
        assert_eq!(QWEN3_4B.parameters().len(), 398);
        assert_eq!(LLAMA_3_8B.parameter_count(), 8_030_261_248);
        assert_eq!(MISTRAL_7B.parameter_count(), 7_241_732_096);
        assert_eq!(QWEN3_0_6B.parameter_count(), 596_049_920);
        assert!(preset("gpt-5").unwrap_err().contains("qwen3-4b"));
    }
}
