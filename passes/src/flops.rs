//! Model FLOPs per training step, with the formula that produced them.
//!
//! Megatron-LM's `num_floating_point_operations` (training.py): per token
//! `6 · (attention projections + MLP + logits)` multiply-adds counted as 2 FLOPs, 3 passes
//! (forward, input gradient, weight gradient), plus core attention `6·B·s²·q` per layer
//! (`q = heads · head_dim`, halved for the causal mask). Recomputation is not counted
//! (model FLOPs, as MFU uses them); the router's small matmul is left out, as in Megatron.

use megac_ir::spec::{Arch, ModelSpec};

/// FLOPs of one training step and their breakdown.
#[derive(Clone, Debug, PartialEq)]
pub struct StepFlops {
    /// Total FLOPs per optimizer step.
    pub total: f64,
    /// Attention projections (Q, K, V, output).
    pub attn_proj: f64,
    /// Core attention (QKᵀ and AV), causal.
    pub attn_core: f64,
    /// MLPs (dense and expert).
    pub mlp: f64,
    /// Output layer (logits).
    pub logits: f64,
    /// The formula, for people.
    pub formula: &'static str,
}

/// Megatron's model FLOPs for one step of `spec` (global batch, padded vocabulary).
pub fn step_flops(spec: &ModelSpec) -> StepFlops {
    let m = &spec.model;
    let tokens = (spec.train.global_batch * m.seq_len) as f64;
    let (h, l) = (m.hidden as f64, m.layers as f64);
    let q = (m.heads * m.head_dim()) as f64;
    let kv = (m.kv_heads * m.head_dim()) as f64;
    let gated = if m.arch == Arch::Llama { 3.0 } else { 2.0 };
    let ffn = m.ffn_hidden as f64;
    let moe_layers = (0..m.layers).filter(|&i| m.is_moe_layer(i)).count() as f64;
    let top_k = m.moe.as_ref().map_or(1.0, |x| x.top_k as f64);
    let mlp_per_token = (l - moe_layers) * h * ffn * gated + moe_layers * h * ffn * gated * top_k;
    let attn_proj = 6.0 * tokens * l * (h * (q + 2.0 * kv) + q * h);
    let attn_core = 6.0 * tokens * m.seq_len as f64 * q * l;
    let mlp = 6.0 * tokens * mlp_per_token;
    let logits = 6.0 * tokens * h * spec.padded_vocab() as f64;
    StepFlops {
        total: attn_proj + attn_core + mlp + logits,
        attn_proj,
        attn_core,
        mlp,
        logits,
        formula: "6·T·[l·(h·(q+2·kv) + q·h) + l·h·ffn·g·k + h·V] + 6·T·s·q·l  \
                  (T = tokens/step, g = 3 SwiGLU | 2 GELU, k = top_k on MoE layers, V padded; Megatron)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For dense MHA GPT the formula reduces to Megatron's closed form
    /// `72·B·s·l·h²·(1 + s/(12h) + V/(12·l·h))` (megatron-lm.md §10.4).
    #[test]
    fn gpt_matches_closed_form() {
        let text = "[model]\narch = \"gpt\"\nlayers = 24\nhidden = 2048\nheads = 16\n\
                    ffn_hidden = 8192\nvocab = 131072\nseq_len = 4096\n[train]\nglobal_batch = 8\n";
        let spec = megac_frontend_free_parse(text);
        let f = step_flops(&spec);
        let (b, s, l, h, v) = (8.0, 4096.0, 24.0, 2048.0, 131072.0);
        let closed = 72.0 * b * s * l * h * h * (1.0 + s / (12.0 * h) + v / (12.0 * l * h));
        assert!(
            (f.total - closed).abs() / closed < 1e-12,
            "{} vs {closed}",
            f.total
        );
    }

    fn megac_frontend_free_parse(text: &str) -> ModelSpec {
        crate::test_support::spec(text)
    }
}
