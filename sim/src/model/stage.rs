//! Pipeline stages: the embedding (first stage) and the output layer and loss (last stage)
//! as phases, the parameters and parameter tensors a stage's ranks hold, and each stage's
//! phases, parameters and activation bytes for one micro-batch.

use megac_ir::flops::padded_vocab;
use megac_ir::spec::{Arch, ModelSpec, Recompute, Schedule};
use megac_ir::types::DType;

use super::layer::{layer_cost, Geo, LayerCost, Phases, W};
use super::ParallelLayout;
use crate::cost::Coll;

/// One pipeline stage's costs for one micro-batch, its parameters and activation bytes.
pub(super) struct Stage {
    /// Its pipeline rank (the first, one middle stage standing for all, the last).
    pub(super) index: u64,
    /// How many of the pp real stages it stands for.
    pub(super) mult: f64,
    pub(super) ph: Phases,
    pub(super) params_dense: f64,
    pub(super) params_expert: f64,
    /// Activation bytes kept for backward per micro-batch in flight.
    pub(super) saved_per_mb: f64,
    /// The working set of the layer being differentiated (and recomputed).
    pub(super) working: f64,
    /// Gradient bytes beyond the stage's parameters' (a tied embedding's landing buffer for
    /// the head's contribution).
    pub(super) grad_extra: f64,
    /// Parameter tensors on the stage.
    pub(super) tensors: f64,
}

/// The stages whose costs differ: the first, one middle stage (all middle stages are alike)
/// and the last, each with its multiplicity among the pp real ones. Layers split
/// contiguously and evenly (interleaving changes the order, not the count).
pub(super) fn stages(g: &Geo, spec: &ModelSpec, layout: &ParallelLayout) -> Vec<Stage> {
    let m = &spec.model;
    let pp = layout.pp.max(1);
    let (t, h) = (g.t, g.h);
    let per_stage = m.layers / pp;
    let stage_layers = |i: u64| -> Vec<u64> { (i * per_stage..(i + 1) * per_stage).collect() };
    let dense_layer = layer_cost(g, spec, layout, false);
    let moe_layer = m.moe.as_ref().map(|_| layer_cost(g, spec, layout, true));
    let embed = embedding_phases(g, spec, layout);
    let head = head_phases(g, spec, layout);
    let recompute_of = |lc: &LayerCost| match layout.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => lc.attention,
        Recompute::Full => lc.forward,
    };
    let mode = match layout.recompute {
        Recompute::None => 0,
        Recompute::Selective => 1,
        Recompute::Full => 2,
    };
    let saved_of = |lc: &LayerCost| [lc.saved, lc.saved_selective, lc.input][mode];
    // Zero-bubble plans keep a micro-batch's slot from F to W (ZeroBubbleKept).
    let zero_bubble = layout.schedule == Schedule::ZbH1 && pp > 1;
    let (tn, a) = (g.tn, g.a);
    let v_l = padded_vocab(m.vocab, layout.tp) as f64 / layout.tp as f64;
    let stage = |i: u64, mult: f64| -> Stage {
        let layers = stage_layers(i);
        let (first, last) = (i == 0, i == pp - 1);
        let mut ph = Phases::default();
        let mut saved = 0.0;
        let (mut kw_bw, mut mlp_bw) = (0.0, 0.0f64);
        let mut working: f64 = 0.0;
        let mut grad_extra = 0.0;
        for &l in &layers {
            let lc = match (&moe_layer, m.is_moe_layer(l)) {
                (Some(x), true) => x,
                _ => &dense_layer,
            };
            ph.add(lc.phases, 1.0);
            ph.b += recompute_of(lc);
            saved += saved_of(lc);
            kw_bw += lc.zb[mode].kw_bw;
            mlp_bw = mlp_bw.max(lc.zb[mode].mlp_bw);
            // Working set of the layer being differentiated (and recomputed).
            working = working.max(lc.saved);
        }
        if first {
            // The embedding keeps nothing for its backward but its output, the first
            // layer's input, which the layer counts.
            ph.add(embed, 1.0);
            if m.tie_embeddings && pp > 1 {
                // Its backward writes an f32 gradient contribution of the tied table (and
                // reads the gathered output gradient); the head's contribution lands in an
                // f32 buffer of its own once per step.
                working = working.max(v_l * h * W + t * h * a);
                grad_extra = v_l * h * W;
            }
        }
        if last {
            ph.add(head, 1.0);
        }
        if zero_bubble {
            // As B starts: everything 1F1B keeps, plus the first MLP's output gradients, or
            // on the last stage the head's logits, their gradient, the final norm's input and
            // output. As B ends: the linears' inputs and output gradients, plus what W reads
            // of the head (the logits' gradient, the norm's output) or of the embedding (its
            // output's gradient, gathered; a tied embedding's f32 gradient contribution).
            let (head_start, head_end) = (
                2.0 * t * v_l * a + 2.0 * tn * h * a,
                t * v_l * a + tn * h * a,
            );
            let start = saved
                + if last {
                    head_start.max(head_end + mlp_bw)
                } else {
                    mlp_bw
                };
            let mut end = kw_bw;
            if last {
                end += head_end;
            }
            if first {
                end += t * h * a;
                if m.tie_embeddings {
                    end += v_l * h * W;
                }
            }
            saved = start.max(end);
        }
        let (pd, pe) = stage_params(spec, layout, &layers, first, last);
        Stage {
            index: i,
            mult,
            ph,
            params_dense: pd,
            params_expert: pe,
            saved_per_mb: saved,
            working,
            grad_extra,
            tensors: stage_tensors(spec, layers.len(), first, last),
        }
    };
    if pp == 1 {
        vec![stage(0, 1.0)]
    } else {
        let mut s = vec![stage(0, 1.0)];
        if pp > 2 {
            s.push(stage(1, (pp - 2) as f64));
        }
        s.push(stage(pp - 1, 1.0));
        s
    }
}

/// The embedding's phases (first stage): the gather, GPT's position embedding, the cast to
/// the activation dtype, and their backward; with tp the all-reduce of the vocab-split
/// lookup.
fn embedding_phases(g: &Geo, spec: &ModelSpec, layout: &ParallelLayout) -> Phases {
    let m = &spec.model;
    let (t, h, a, s) = (g.t, g.h, g.a, g.s);
    let mut embed = Phases::default();
    let mut f = g.mem(t * 4.0 + 2.0 * t * h * 4.0);
    let mut comm = 0.0;
    if layout.tp > 1 {
        comm += g.cost.collective(Coll::AllReduce, t * h * 4.0, g.tp_group) * (1.0 - g.tp_overlap);
    }
    if m.arch == Arch::Gpt {
        f += g.mem(3.0 * t * h * 4.0);
    }
    let mut b = g.mem(2.0 * t * h * 4.0 + t * 4.0);
    if g.act != DType::F32 {
        f += g.mem(t * h * (4.0 + a));
        b += g.mem(t * h * (4.0 + a)) + g.zero(t * h * 4.0);
    }
    if m.arch == Arch::Gpt {
        b += g.mem(t * h * 4.0 + 2.0 * s * h * 4.0);
    }
    embed.f = f + comm;
    embed.b = b;
    embed.comm = comm;
    embed
}

/// The output layer's phases (last stage): the final norm, the logits linear over the
/// rank's vocabulary shard, the cross-entropy (with tp: the max and sum all-reduces of
/// vocab-parallel cross-entropy), their backward, and the tied embedding's gradient.
fn head_phases(g: &Geo, spec: &ModelSpec, layout: &ParallelLayout) -> Phases {
    let m = &spec.model;
    let tp = layout.tp;
    let (t, h, a) = (g.t, g.h, g.a);
    let v_l = padded_vocab(m.vocab, tp) as f64 / tp as f64;
    let mut head = Phases::default();
    let norm_params = if m.arch == Arch::Gpt { 2.0 } else { 1.0 };
    let mut comm_f = g.enter_f();
    let f = g.norm_f(norm_params) + g.lin(t, v_l, h) + g.mem(t * v_l * a + t * 4.0 + 4.0);
    let mut b = g.mem(2.0 * t * v_l * a + t * 8.0) + g.zero(t * v_l * a);
    b += g.lin_gi(t, v_l, h);
    let mut w = g.lin_gw(t, v_l, h);
    if m.tie_embeddings {
        w += g.mem(3.0 * v_l * h * W) + g.zero(v_l * h * W);
    }
    let comm_b = g.enter_b();
    b += g.norm_b(norm_params);
    if tp > 1 {
        // Vocab-parallel cross-entropy: max and sum of each token's logits over tp.
        comm_f +=
            2.0 * g.cost.collective(Coll::AllReduce, t * 4.0, g.tp_group) * (1.0 - g.tp_overlap);
    }
    head.f = f + comm_f;
    head.b = b + comm_b;
    head.w = w;
    head.comm = comm_f + comm_b;
    head
}

/// Parameter counts on one rank of a stage: (dense, expert).
fn stage_params(
    spec: &ModelSpec,
    layout: &ParallelLayout,
    layers: &[u64],
    first: bool,
    last: bool,
) -> (f64, f64) {
    let m = &spec.model;
    let tp = layout.tp as f64;
    let h = m.hidden as f64;
    let d = m.head_dim() as f64;
    let q_l = (m.heads as f64) * d / tp;
    let kv_l = (m.kv_heads as f64 / tp).max(1.0).floor() * d;
    let f_l = m.ffn_hidden as f64 / tp;
    let v_l = padded_vocab(m.vocab, layout.tp) as f64 / tp;
    let (mut dense, mut expert) = (0.0, 0.0);
    for &i in layers {
        match m.arch {
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe => {
                dense += h * q_l + 2.0 * h * kv_l + q_l * h + 2.0 * h;
                if m.qkv_bias {
                    dense += q_l + 2.0 * kv_l;
                }
                if m.qk_norm {
                    dense += 2.0 * d;
                }
                if m.is_moe_layer(i) {
                    let x = m.moe.as_ref().expect("moe layer has [model.moe]");
                    dense += h * x.experts as f64;
                    let (e_l, s_l) = (x.ffn_hidden as f64 / tp, x.shared_ffn_hidden as f64 / tp);
                    expert += (x.experts / layout.ep.max(1)) as f64 * 3.0 * h * e_l;
                    // The shared expert is a dense MLP (split over tp), its gate replicated.
                    dense += 3.0 * h * s_l;
                    if x.shared_expert_gate {
                        dense += h;
                    }
                } else {
                    dense += 3.0 * h * f_l;
                }
            }
            Arch::Gpt => {
                dense +=
                    3.0 * h * q_l + 3.0 * q_l + q_l * h + h + 2.0 * h * f_l + f_l + h + 4.0 * h;
            }
        }
    }
    if first {
        dense += v_l * h;
        if m.arch == Arch::Gpt {
            dense += (m.seq_len as f64) * h;
        }
    }
    if last {
        dense += if m.arch == Arch::Gpt { 2.0 * h } else { h };
        if !m.tie_embeddings || !first {
            dense += v_l * h;
        }
    }
    (dense, expert)
}

/// Number of parameter tensors on a stage (one AdamW kernel each without the distributed
/// optimizer).
fn stage_tensors(spec: &ModelSpec, layers: usize, first: bool, last: bool) -> f64 {
    let m = &spec.model;
    let per_layer = match m.arch {
        Arch::Gpt => 12.0,
        _ => 9.0 + 3.0 * f64::from(u8::from(m.qkv_bias)) + 2.0 * f64::from(u8::from(m.qk_norm)),
    };
    let mut n = per_layer * layers as f64;
    if first {
        n += if m.arch == Arch::Gpt { 2.0 } else { 1.0 };
    }
    if last {
        n += if m.arch == Arch::Gpt { 2.0 } else { 1.0 };
        if !m.tie_embeddings {
            n += 1.0;
        }
    }
    n
}
