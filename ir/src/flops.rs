//! Model FLOPs per training step and the padded vocabulary: the one home of both rules,
//! used by the compiler (`megac check`, the plan's `flops`, the stage balancer through
//! [`ModelSpec::padded_vocab`]) and by the simulator's layout model (at a layout's tp).
//!
//! Megatron-LM's `num_floating_point_operations` (training.py): per token
//! `6 · (attention projections + MLP + logits)` multiply-adds counted as 2 FLOPs, 3 passes
//! (forward, input gradient, weight gradient), plus core attention `6·B·s²·q` per layer
//! (`q = heads · head_dim`, halved for the causal mask). Recomputation is not counted
//! (model FLOPs, as MFU uses them); the router's small matmul is left out, as in Megatron.

use crate::spec::{Arch, ModelSpec};

/// Vocabulary padded to a multiple of 128·tp, as Megatron pads it (tp 0 counts as 1).
pub fn padded_vocab(vocab: u64, tp: u64) -> u64 {
    let m = 128 * tp.max(1);
    vocab.div_ceil(m) * m
}

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

/// Megatron's model FLOPs for one step of `spec` (global batch, vocabulary padded for the
/// spec's own tp).
pub fn step_flops(spec: &ModelSpec) -> StepFlops {
    step_flops_at_tp(spec, spec.parallel.tp)
}

/// Megatron's model FLOPs for one step of `spec` with the vocabulary padded for `tp` (the
/// simulator's search prices layouts whose tp differs from the spec's).
pub fn step_flops_at_tp(spec: &ModelSpec, tp: u64) -> StepFlops {
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
    let logits = 6.0 * tokens * h * padded_vocab(m.vocab, tp) as f64;
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
