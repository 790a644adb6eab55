//! Model FLOPs per training step and the padded vocabulary: the one home of both rules,
//! used by the compiler (`megac check`, the plan's `flops`, the stage balancer through
//! [`ModelSpec::padded_vocab`]) and by the simulator's layout model (at a layout's tp).
//!
//! Megatron-LM's `num_floating_point_operations` (training.py): per token
//! `6 · (attention projections + MLP + logits)` multiply-adds counted as 2 FLOPs, 3 passes
//! (forward, input gradient, weight gradient), plus core attention `6·B·s²·q` per layer
//! (`q = heads · head_dim`, halved for the causal mask). Recomputation is not counted
//! (model FLOPs, as MFU uses them); the router's small matmul is left out, as in Megatron.
//!
//! The same count per token and layer ([`layer_flops`], and [`head_flops`] for the output
//! layer) weighs the layers of a pipeline: the stage balancer
//! (`pipeline::stages::chunk_layers`) and `megac schedule --costs model`.

use crate::spec::ModelSpec;

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
    let Widths { q, kv, gated } = widths(spec);
    let ffn = m.ffn_hidden as f64;
    let moe_layers = (0..m.layers).filter(|&i| m.is_moe_layer(i)).count() as f64;
    // An MoE layer's MLP width per token: top_k routed experts of the expert ffn, plus the
    // shared expert's.
    let moe_ffn = m.moe.as_ref().map_or(ffn, |x| {
        x.top_k as f64 * x.ffn_hidden as f64 + x.shared_ffn_hidden as f64
    });
    let mlp_per_token = (l - moe_layers) * h * ffn * gated + moe_layers * h * moe_ffn * gated;
    let attn_proj = 6.0 * tokens * l * (h * (q + 2.0 * kv) + q * h);
    let attn_core =
        6.0 * tokens * m.seq_len as f64 * q * l * window_fraction(m.seq_len, m.sliding_window);
    let mlp = 6.0 * tokens * mlp_per_token;
    let logits = 6.0 * tokens * h * padded_vocab(m.vocab, tp) as f64;
    StepFlops {
        total: attn_proj + attn_core + mlp + logits,
        attn_proj,
        attn_core,
        mlp,
        logits,
        formula: "6·T·[l·(h·(q+2·kv) + q·h) + l·h·ffn·g·k + h·V] + 6·T·s·q·l  \
                  (T = tokens/step, g = 3 SwiGLU | 2 GELU, ffn·k = top_k·expert ffn + shared ffn on MoE layers, V padded; Megatron)",
    }
}

/// The widths the counts share: query and key/value widths (`heads · head_dim`) and the MLP's
/// matrices per hidden unit (`g` = 3 for the gated SwiGLU of llama, 2 for GPT's GELU).
struct Widths {
    q: f64,
    kv: f64,
    gated: f64,
}

fn widths(spec: &ModelSpec) -> Widths {
    let m = &spec.model;
    Widths {
        q: (m.heads * m.head_dim()) as f64,
        kv: (m.kv_heads * m.head_dim()) as f64,
        gated: if m.arch.llama_like() { 3.0 } else { 2.0 },
    }
}

/// Per-token FLOPs of one forward pass through one transformer layer, a multiply-add
/// counted as 2 FLOPs: the terms of [`step_flops`] for a single layer and token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerFlops {
    /// The linears: attention projections `2·(h·(q + 2·kv) + q·h)` and the MLP
    /// `2·g·h·ffn`, times `top_k` on an MoE layer.
    pub matmul: f64,
    /// Core attention (QKᵀ and AV), causal: `2·s·q`.
    pub core: f64,
}

impl LayerFlops {
    /// Forward plus both backward passes (input and weight gradient): Megatron's 3-pass count.
    pub fn training(&self) -> f64 {
        3.0 * (self.matmul + self.core)
    }
}

/// The per-token forward FLOPs of layer `l` of `spec` (MoE layers count `top_k` experts).
pub fn layer_flops(spec: &ModelSpec, l: u64) -> LayerFlops {
    let m = &spec.model;
    let Widths { q, kv, gated } = widths(spec);
    let h = m.hidden as f64;
    let width = match &m.moe {
        Some(x) if m.is_moe_layer(l) => {
            x.top_k as f64 * x.ffn_hidden as f64 + x.shared_ffn_hidden as f64
        }
        _ => m.ffn_hidden as f64,
    };
    let proj = 2.0 * (h * (q + 2.0 * kv) + q * h);
    LayerFlops {
        matmul: proj + 2.0 * gated * h * width,
        core: 2.0 * m.seq_len as f64 * q * window_fraction(m.seq_len, m.sliding_window),
    }
}

/// The share of causal attention's (query, key) pairs that a sliding window of `window`
/// keys keeps over a sequence of `s`: `Σ_i min(i+1, w) / Σ_i (i+1)`; exactly 1 without a
/// window or with one at least the sequence long (so the count of full causal attention is
/// unchanged).
pub fn window_fraction(s: u64, window: Option<u64>) -> f64 {
    match window {
        Some(w) if w < s => {
            let (s, w) = (s as f64, w as f64);
            (w * (w + 1.0) / 2.0 + (s - w) * w) / (s * (s + 1.0) / 2.0)
        }
        _ => 1.0,
    }
}

/// The per-token forward FLOPs of the output layer: `2·h·V`, logits over the vocabulary
/// padded for the spec's tp (the same in each of the three passes).
pub fn head_flops(spec: &ModelSpec) -> f64 {
    2.0 * spec.model.hidden as f64 * spec.padded_vocab() as f64
}

#[cfg(test)]
mod tests {
    use super::window_fraction;

    /// The causal pairs a window keeps, counted from the definition.
    #[test]
    fn window_fraction_counts_the_pairs_the_window_keeps() {
        let brute = |s: u64, w: u64| {
            let kept: u64 = (0..s).map(|q| (q + 1).min(w)).sum();
            kept as f64 / (s * (s + 1) / 2) as f64
        };
        for (s, w) in [(8, 3), (32, 5), (8192, 4096), (16, 1)] {
            let f = window_fraction(s, Some(w));
            assert!((f - brute(s, w)).abs() < 1e-12, "s {s} w {w}: {f}");
        }
        // No window, or one at least the sequence long: exactly full causal attention.
        assert_eq!(window_fraction(64, None), 1.0);
        assert_eq!(window_fraction(64, Some(64)), 1.0);
        assert_eq!(window_fraction(64, Some(1000)), 1.0);
    }
}
