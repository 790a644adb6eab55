//! Layout search: every valid layout of a model on N GPUs, ranked by the analytic model.
//!
//! A layout is (tp, pp, vpp, dp, cp, ep, micro batch, schedule, recompute, sequence
//! parallelism, distributed optimizer) with `tp·pp·dp·cp = N` that passes model.toml's
//! validation rules (docs/model-toml.md). Layouts whose predicted peak memory does not fit
//! the device are dropped; the rest are ranked by predicted step time.

use std::time::Instant;

use megac_ir::rules::{self, divisors};
use megac_ir::spec::{ModelSpec, Recompute, Schedule};

use crate::cluster::{Cluster, GIB};
use crate::cost::CostModel;
use crate::error::SimError;
use crate::model::{estimate, Estimate, ParallelLayout};

/// One ranked layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The layout.
    pub layout: ParallelLayout,
    /// Its prediction.
    pub estimate: Estimate,
}

/// What a search found.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchResult {
    /// The best layouts that fit, fastest first (at most `top`).
    pub best: Vec<Candidate>,
    /// Layouts enumerated and estimated.
    pub searched: usize,
    /// Of those, how many fit in memory.
    pub fitting: usize,
    /// Wall time of the search, seconds.
    pub seconds: f64,
}

/// Every layout of `spec` on exactly `gpus` ranks that model.toml's rules accept.
///
/// The candidates are the factorisations `tp·cp·pp·dp = gpus` with every vpp, micro-batch,
/// schedule, sequence parallelism, ep, recompute and distributed-optimizer choice; the
/// rules that decide which are valid are not repeated here: a candidate is kept when
/// [`megac_ir::rules::check`] finds nothing wrong with `spec` in that layout (as
/// `megac plan --emit` writes it: layers split evenly, FBD off, and the search's own cluster
/// instead of model.toml's `[cluster]`). Only choices that cannot change a run are left out:
/// sequence parallelism without tp, other schedules without a pipeline, the distributed
/// optimizer without dp.
pub fn enumerate(spec: &ModelSpec, gpus: u64) -> Vec<ParallelLayout> {
    let m = &spec.model;
    let gb = spec.train.global_batch;
    let mut out = Vec::new();
    let moe = m.moe.as_ref();
    let mut candidate = spec.clone();
    candidate.parallel.stage_layers.clear();
    candidate.parallel.balance_stages = false;
    candidate.cluster = None;
    for tp in divisors(gpus) {
        for cp in divisors(gpus / tp) {
            for pp in divisors(gpus / (tp * cp)) {
                let dp = gpus / (tp * cp * pp);
                let vpps = if pp >= 2 {
                    divisors(m.layers / pp)
                } else {
                    vec![1]
                };
                let eps = match moe {
                    None => vec![1],
                    Some(_) => divisors(dp * cp),
                };
                let sps: &[bool] = if tp == 1 { &[false] } else { &[false, true] };
                let dists: &[bool] = if dp * cp > 1 {
                    &[false, true]
                } else {
                    &[false]
                };
                for mb in divisors(gb / dp) {
                    for &vpp in &vpps {
                        let schedules: &[Schedule] = if pp == 1 {
                            &[Schedule::OneFOneB]
                        } else {
                            &[
                                Schedule::OneFOneB,
                                Schedule::Gpipe,
                                Schedule::ZbH1,
                                Schedule::Interleaved,
                                Schedule::Dpp,
                            ]
                        };
                        for &schedule in schedules {
                            for &sequence_parallel in sps {
                                for &ep in &eps {
                                    for recompute in
                                        [Recompute::None, Recompute::Selective, Recompute::Full]
                                    {
                                        for &distributed_optimizer in dists {
                                            let layout = ParallelLayout {
                                                tp,
                                                pp,
                                                vpp,
                                                dp,
                                                cp,
                                                ep,
                                                micro_batch: mb,
                                                schedule,
                                                recompute,
                                                sequence_parallel,
                                                distributed_optimizer,
                                            };
                                            layout.set_in(&mut candidate);
                                            if rules::check(&candidate).is_empty() {
                                                out.push(layout);
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Search every layout of `spec` on `gpus` GPUs of `cost`'s cluster; keep the `top` fastest
/// that fit. A model that fits no layout is an error that says how far the smallest is.
pub fn search(
    spec: &ModelSpec,
    gpus: u64,
    cost: &CostModel,
    top: usize,
) -> Result<SearchResult, SimError> {
    let start = Instant::now();
    let layouts = enumerate(spec, gpus);
    if layouts.is_empty() {
        return Err(SimError::new(format!(
            "no valid layout of {} on {gpus} GPUs: tp·pp·dp·cp = {gpus} with tp dividing heads ({}) and ffn_hidden ({}), pp dividing layers ({}), dp dividing global_batch ({})",
            spec.name, spec.model.heads, spec.model.ffn_hidden, spec.model.layers, spec.train.global_batch
        ))
        .with_help("choose a GPU count whose factors fit the model (for example a power of two), or change global_batch"));
    }
    let mut fitting: Vec<Candidate> = Vec::new();
    let mut smallest: Option<Candidate> = None;
    for layout in &layouts {
        let e = estimate(spec, layout, cost);
        if e.fits {
            fitting.push(Candidate {
                layout: layout.clone(),
                estimate: e,
            });
        } else if smallest
            .as_ref()
            .is_none_or(|s| e.peak_memory_bytes < s.estimate.peak_memory_bytes)
        {
            smallest = Some(Candidate {
                layout: layout.clone(),
                estimate: e,
            });
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    if fitting.is_empty() {
        let dev = &cost.cluster.device;
        let s = smallest.expect("layouts is not empty");
        return Err(SimError::new(format!(
            "no layout of {} fits on {gpus} × {} ({:.1} GiB, {:.1} GiB reserved): the smallest needs {:.1} GiB per GPU ({}); searched {} layouts",
            spec.name,
            cost.cluster.name,
            dev.memory_bytes / GIB,
            cost.params().reserved_memory_gib,
            s.estimate.peak_memory_bytes / GIB,
            s.layout.label(),
            layouts.len()
        ))
        .with_help("use more GPUs, a device with more memory, a smaller global_batch or seq_len, or a smaller model"));
    }
    let n_fit = fitting.len();
    fitting.sort_by(|a, b| {
        a.estimate
            .step_seconds
            .total_cmp(&b.estimate.step_seconds)
            .then(
                a.estimate
                    .peak_memory_bytes
                    .total_cmp(&b.estimate.peak_memory_bytes),
            )
    });
    // Layouts the model cannot tell apart (same time and memory, e.g. a schedule that
    // reduces to another one here) are listed once: the first in enumeration order.
    fitting.dedup_by(|b, a| {
        a.estimate.step_seconds == b.estimate.step_seconds
            && a.estimate.peak_memory_bytes == b.estimate.peak_memory_bytes
    });
    fitting.truncate(top.max(1));
    Ok(SearchResult {
        best: fitting,
        searched: layouts.len(),
        fitting: n_fit,
        seconds,
    })
}

fn float(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains(['.', 'e', 'E']) || s.contains("inf") || s.contains("NaN") {
        s
    } else {
        format!("{s}.0")
    }
}

/// A complete model.toml for `spec` with `layout` (and `[cluster]` for `cluster`), as
/// `megac plan --emit` writes it; `header` lines become comments at the top.
pub fn emit_model_toml(
    spec: &ModelSpec,
    layout: &ParallelLayout,
    cluster: &Cluster,
    header: &[String],
) -> String {
    let s = layout.apply(spec);
    let (m, t, p) = (&s.model, &s.train, &s.parallel);
    let mut o = String::new();
    for h in header {
        o.push_str(&format!("# {h}\n"));
    }
    o.push_str("\n[model]\n");
    o.push_str(&format!("arch = \"{}\"\n", m.arch.as_str()));
    o.push_str(&format!("layers = {}\n", m.layers));
    o.push_str(&format!("hidden = {}\n", m.hidden));
    o.push_str(&format!("heads = {}\n", m.heads));
    o.push_str(&format!("kv_heads = {}\n", m.kv_heads));
    o.push_str(&format!("ffn_hidden = {}\n", m.ffn_hidden));
    o.push_str(&format!("vocab = {}\n", m.vocab));
    o.push_str(&format!("seq_len = {}\n", m.seq_len));
    o.push_str(&format!("tie_embeddings = {}\n", m.tie_embeddings));
    o.push_str(&format!("norm_eps = {}\n", float(m.norm_eps)));
    o.push_str(&format!("rope_theta = {}\n", float(m.rope_theta)));
    // The family keys, where they differ from the family's defaults (as the frontend reads
    // them: Qwen3's head size is 128, the others' hidden / heads; Qwen2's q/k/v biases;
    // Qwen3's q/k norm).
    use megac_ir::spec::{Arch, RopeScaling};
    let head_dim_default = if m.arch == Arch::Qwen3 {
        128
    } else {
        (m.hidden / m.heads).max(1)
    };
    if m.head_dim != head_dim_default {
        o.push_str(&format!("head_dim = {}\n", m.head_dim));
    }
    if m.qkv_bias != matches!(m.arch, Arch::Qwen2 | Arch::Qwen2Moe) {
        o.push_str(&format!("qkv_bias = {}\n", m.qkv_bias));
    }
    if m.qk_norm != (m.arch == Arch::Qwen3) {
        o.push_str(&format!("qk_norm = {}\n", m.qk_norm));
    }
    if let Some(w) = m.sliding_window {
        o.push_str(&format!("sliding_window = {w}\n"));
    }
    if let Some(r) = &m.rope_scaling {
        o.push_str("\n[model.rope_scaling]\n");
        o.push_str(&format!("type = \"{}\"\n", r.type_name()));
        match *r {
            RopeScaling::Linear { factor } => {
                o.push_str(&format!("factor = {}\n", float(factor)));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                o.push_str(&format!("factor = {}\n", float(factor)));
                o.push_str(&format!("low_freq_factor = {}\n", float(low_freq_factor)));
                o.push_str(&format!("high_freq_factor = {}\n", float(high_freq_factor)));
                o.push_str(&format!(
                    "original_max_position_embeddings = {}\n",
                    float(original_max_position_embeddings)
                ));
            }
        }
    }
    if let Some(x) = &m.moe {
        o.push_str("\n[model.moe]\n");
        o.push_str(&format!("experts = {}\n", x.experts));
        o.push_str(&format!("top_k = {}\n", x.top_k));
        o.push_str(&format!("layer_freq = {}\n", x.layer_freq));
        o.push_str(&format!("aux_loss_coeff = {}\n", float(x.aux_loss_coeff)));
        o.push_str(&format!("capacity_factor = {}\n", float(x.capacity_factor)));
        // The keys of a separate expert size, a shared expert, the top-k normalisation and
        // dense first layers, where they differ from the family's defaults.
        let qwen = m.arch == megac_ir::spec::Arch::Qwen2Moe;
        if x.ffn_hidden != m.ffn_hidden {
            o.push_str(&format!("ffn_hidden = {}\n", x.ffn_hidden));
        }
        if x.shared_ffn_hidden > 0 {
            o.push_str(&format!("shared_ffn_hidden = {}\n", x.shared_ffn_hidden));
        }
        if x.shared_expert_gate != (x.shared_ffn_hidden > 0 && qwen) {
            o.push_str(&format!("shared_expert_gate = {}\n", x.shared_expert_gate));
        }
        if x.norm_topk_prob == qwen {
            o.push_str(&format!("norm_topk_prob = {}\n", x.norm_topk_prob));
        }
        if x.first_dense_layers > 0 {
            o.push_str(&format!("first_dense_layers = {}\n", x.first_dense_layers));
        }
    }
    o.push_str("\n[train]\n");
    o.push_str(&format!("micro_batch = {}\n", t.micro_batch));
    o.push_str(&format!("global_batch = {}\n", t.global_batch));
    o.push_str(&format!("steps = {}\n", t.steps));
    o.push_str(&format!("seed = {}\n", t.seed));
    o.push_str(&format!("precision = \"{}\"\n", t.precision.as_str()));
    o.push_str(&format!("lr = {}\n", float(t.lr)));
    o.push_str(&format!(
        "betas = [{}, {}]\n",
        float(t.betas.0),
        float(t.betas.1)
    ));
    o.push_str(&format!("eps = {}\n", float(t.eps)));
    o.push_str(&format!("weight_decay = {}\n", float(t.weight_decay)));
    o.push_str(&format!("grad_clip = {}\n", float(t.grad_clip)));
    o.push_str(&format!("recompute = \"{}\"\n", t.recompute.as_str()));
    if let Some(ls) = &t.loss_scaler {
        if ls.fixed {
            o.push_str(&format!("loss_scale = {}\n", float(ls.initial_scale)));
        } else {
            o.push_str(&format!(
                "initial_loss_scale = {}\n",
                float(ls.initial_scale)
            ));
            o.push_str(&format!("min_loss_scale = {}\n", float(ls.min_scale)));
            o.push_str(&format!("loss_scale_window = {}\n", ls.window));
        }
        o.push_str(&format!("hysteresis = {}\n", ls.hysteresis));
    }
    if let Some(c) = &t.lr_schedule {
        o.push_str("lr_schedule = \"cosine\"\n");
        o.push_str(&format!("warmup_steps = {}\n", c.warmup_steps));
        o.push_str(&format!("decay_steps = {}\n", c.decay_steps));
        o.push_str(&format!("min_lr = {}\n", float(c.min_lr)));
    }
    o.push_str("\n[parallel]\n");
    o.push_str(&format!("tp = {}\n", p.tp));
    o.push_str(&format!("pp = {}\n", p.pp));
    o.push_str(&format!("vpp = {}\n", p.vpp));
    o.push_str(&format!("dp = {}\n", p.dp));
    o.push_str(&format!("cp = {}\n", p.cp));
    o.push_str(&format!("ep = {}\n", p.ep));
    o.push_str(&format!("sequence_parallel = {}\n", p.sequence_parallel));
    o.push_str(&format!(
        "distributed_optimizer = {}\n",
        p.distributed_optimizer
    ));
    o.push_str(&format!("schedule = \"{}\"\n", p.schedule.as_str()));
    o.push_str(&format!("dpp_policy = \"{}\"\n", p.dpp_policy.as_str()));
    o.push_str("fbd = false\n");
    if p.cp_comm == megac_ir::spec::CpComm::AllGather {
        o.push_str("cp_comm = \"all-gather\"\n");
    }
    o.push_str("\n[cluster]\n");
    o.push_str(&format!("device = \"{}\"\n", cluster.name));
    o.push_str(&format!(
        "nodes = {}\n",
        cluster
            .nodes
            .unwrap_or_else(|| layout.world().div_ceil(cluster.gpus_per_node))
    ));
    o.push_str(&format!("gpus_per_node = {}\n", cluster.gpus_per_node));
    o
}
