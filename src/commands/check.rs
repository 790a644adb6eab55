//! `megac check`: validate a model.toml and print a one-screen summary.

use megac_ir::spec::{Arch, ModelSpec};
use megac_ir::Graph;
use megac_passes::flops::step_flops;

use crate::ModelArgs;

/// Validate, build the graph, and print parameters, FLOPs, batch, layout and ranks.
pub fn run(args: &ModelArgs) -> Result<(), String> {
    let spec = super::load_spec(args)?;
    let module = super::compile(spec, None)?;
    let graph = module
        .graph
        .as_ref()
        .ok_or("error: the pipeline built no graph")?;
    print!(
        "{}",
        summary(&module.spec, graph, &args.model.display().to_string())
    );
    Ok(())
}

/// `1234567` -> `1,234,567`.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// `8.03e9` -> `8.03 G`, with SI prefixes.
fn si(x: f64) -> String {
    const UNITS: [(f64, &str); 6] = [
        (1e18, "E"),
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
    ];
    for (scale, unit) in UNITS {
        if x >= scale {
            return format!("{:.2} {unit}", x / scale);
        }
    }
    format!("{x:.0} ")
}

fn onoff(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The summary text (also used by tests).
pub fn summary(spec: &ModelSpec, graph: &Graph, file: &str) -> String {
    let m = &spec.model;
    let t = &spec.train;
    let p = &spec.parallel;
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<12} {v}\n"));

    let family = match (m.arch, &m.moe) {
        (Arch::Llama, Some(_)) => "llama + moe (MixtralForCausalLM names)".to_string(),
        (arch, moe) => format!("{arch} ({} names)", arch.hf_class(moe.is_some())),
    };
    line("model", format!("{} — {family}", spec.name));
    line(
        "shape",
        format!(
            "{} layers, hidden {}, {} heads ({} kv, head size {}), ffn {}, vocab {} (padded {}), seq {}",
            m.layers,
            m.hidden,
            m.heads,
            m.kv_heads,
            m.head_dim(),
            m.ffn_hidden,
            m.vocab,
            spec.padded_vocab(),
            m.seq_len
        ),
    );
    let mut extras = Vec::new();
    if m.qkv_bias {
        extras.push("q/k/v biases".to_string());
    }
    if m.qk_norm {
        extras.push("q/k RMSNorm per head".to_string());
    }
    if let Some(w) = m.sliding_window {
        extras.push(format!(
            "sliding window {w} (core attention FLOPs × {:.4}, the causal pairs it keeps)",
            megac_ir::flops::window_fraction(m.seq_len, Some(w))
        ));
    }
    if let Some(r) = &m.rope_scaling {
        extras.push(match r {
            megac_ir::spec::RopeScaling::Linear { factor } => {
                format!("rope scaling linear (factor {factor})")
            }
            megac_ir::spec::RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => format!(
                "rope scaling llama3 (factor {factor}, low {low_freq_factor}, high {high_freq_factor}, original context {original_max_position_embeddings})"
            ),
        });
    }
    if !extras.is_empty() {
        line("attention", extras.join(", "));
    }
    if let Some(moe) = &m.moe {
        line(
            "moe",
            format!(
                "{} experts, top-{}, every {} layer(s), aux loss {}, capacity factor {}",
                moe.experts,
                moe.top_k,
                moe.layer_freq,
                moe.aux_loss_coeff,
                if moe.capacity_factor == 0.0 {
                    "dropless".to_string()
                } else {
                    moe.capacity_factor.to_string()
                }
            ),
        );
        let mut more = vec![format!(
            "expert ffn {}, top-k weights {}",
            moe.ffn_hidden,
            if moe.norm_topk_prob {
                "renormalised"
            } else {
                "as routed (not renormalised)"
            }
        )];
        if moe.shared_ffn_hidden > 0 {
            more.push(format!(
                "shared expert ffn {}{}",
                moe.shared_ffn_hidden,
                if moe.shared_expert_gate {
                    " (sigmoid-gated)"
                } else {
                    ""
                }
            ));
        }
        if moe.first_dense_layers > 0 {
            more.push(format!("first {} layer(s) dense", moe.first_dense_layers));
        }
        line("", more.join(", "));
    }
    let params = graph.param_count_unpadded(m.vocab);
    let tensors = graph.params().count();
    line(
        "parameters",
        format!(
            "{} ({}) in {tensors} tensors, tied embeddings {}",
            si(params as f64),
            grouped(params),
            onoff(m.tie_embeddings)
        ),
    );
    if let Some(moe) = &m.moe {
        let inactive_experts = moe.experts - moe.top_k;
        let per_expert = 3 * m.hidden * moe.ffn_hidden;
        let moe_layers = (0..m.layers).filter(|&i| m.is_moe_layer(i)).count() as u64;
        let active = params - moe_layers * inactive_experts * per_expert;
        line(
            "active",
            format!("{} per token ({})", si(active as f64), grouped(active)),
        );
    }
    let f = step_flops(spec);
    line(
        "FLOPs/step",
        format!(
            "{}FLOP = attention projections {} + core attention {} + MLP {} + logits {}",
            si(f.total),
            si(f.attn_proj),
            si(f.attn_core),
            si(f.mlp),
            si(f.logits)
        ),
    );
    line("", format!("formula: {}", f.formula));
    let tokens = t.global_batch * m.seq_len;
    line(
        "batch",
        format!(
            "{} samples × {} tokens = {} tokens/step; micro-batch {}, {} micro-batches per data-parallel rank",
            t.global_batch,
            m.seq_len,
            grouped(tokens),
            t.micro_batch,
            t.microbatches(p.dp)
        ),
    );
    line(
        "train",
        format!(
            "{} steps, {}, AdamW lr {} betas ({}, {}) eps {} wd {}, clip {}, recompute {}, seed {}",
            t.steps,
            t.precision.as_str(),
            t.lr,
            t.betas.0,
            t.betas.1,
            t.eps,
            t.weight_decay,
            t.grad_clip,
            t.recompute.as_str(),
            t.seed
        ),
    );
    let lr_schedule = megac_codegen::lr_schedule(spec);
    let mut lr_line = super::lr_schedule_text(t.lr, &lr_schedule);
    if let Some(note) = super::lr_schedule_cut_short(t.lr, &lr_schedule, t.steps) {
        lr_line = format!("{lr_line}; {note}");
    }
    line("lr schedule", lr_line);
    let mut schedule = format!("schedule {}", p.schedule.as_str());
    if p.schedule == megac_ir::spec::Schedule::Dpp {
        schedule.push_str(&format!(" ({})", p.dpp_policy.as_str()));
    }
    line(
        "layout",
        format!(
            "tp={} pp={} vpp={} dp={} cp={} ep={}; sequence parallel {}, distributed optimizer {}, {schedule}, fbd {}",
            p.tp,
            p.pp,
            p.vpp,
            p.dp,
            p.cp,
            p.ep,
            onoff(p.sequence_parallel && p.tp > 1),
            onoff(p.distributed_optimizer),
            onoff(p.fbd)
        ),
    );
    line(
        "ranks",
        format!(
            "{} (tp·pp·dp·cp = {}·{}·{}·{}{}; rank order {})",
            p.world_size(),
            p.tp,
            p.pp,
            p.dp,
            p.cp,
            if p.fbd { ", ×2 FBD roles" } else { "" },
            p.order
                .iter()
                .map(|a| a.as_str())
                .collect::<Vec<_>>()
                .join("-")
        ),
    );
    if let Some(c) = &spec.cluster {
        line(
            "cluster",
            format!(
                "{}: {} node(s) × {} = {} devices",
                c.device,
                c.nodes,
                c.gpus_per_node,
                c.nodes * c.gpus_per_node
            ),
        );
    }
    line(
        "graph",
        format!(
            "{} ops, {} values after `{}`",
            graph.ops.len(),
            graph.values.len(),
            megac_passes::pass_names().last().copied().unwrap_or("-")
        ),
    );
    out.push_str(&format!("ok: {file} is valid\n"));
    out
}
