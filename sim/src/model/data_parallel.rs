//! Data parallelism and the optimizer: the gradient reduction and parameter gather of each
//! stage (over cp, then dp; experts over their own data-parallel group), overlapped with the
//! backward and forward as [`CostParams`] says, and the optimizer step (memory-bound AdamW,
//! sharded with the distributed optimizer).
//!
//! [`CostParams`]: crate::cost::CostParams

use super::layer::{Geo, Phases, W};
use super::stage::Stage;
use super::ParallelLayout;
use crate::cost::{Coll, CostMode, Group};

/// How the distributed optimizer (ZeRO-1 over dp·cp) shards a stage's parameters.
pub(super) struct Shards {
    /// Whether the optimizer is distributed (and there is more than one dp·cp rank).
    pub(super) dist: bool,
    /// Shards of the dense parameters (dp), 1 without it.
    pub(super) dense: f64,
    /// Shards of the expert parameters (the expert data-parallel group), 1 without it.
    pub(super) expert: f64,
}

/// The expert data-parallel size: dp·cp over ep.
fn expert_dp(layout: &ParallelLayout) -> u64 {
    (layout.dp * layout.cp / layout.ep.max(1)).max(1)
}

/// The optimizer's shards of `layout`.
pub(super) fn shards(layout: &ParallelLayout) -> Shards {
    let dist = layout.distributed_optimizer && layout.dp * layout.cp > 1;
    Shards {
        dist,
        // Megatron's distributed optimizer shards over dp·cp (so do megac's plans).
        dense: if dist {
            (layout.dp * layout.cp) as f64
        } else {
            1.0
        },
        expert: if dist { expert_dp(layout) as f64 } else { 1.0 },
    }
}

/// The exposed data-parallel communication and the optimizer step of the worst stage
/// (seconds; both 0 under unit costs). As megac's plans do it: with context parallelism
/// every gradient is first all-reduced over cp (one collective per parameter, after the
/// backward), then reduced over dp; the distributed optimizer instead reduce-scatters over
/// the dp·cp group directly and shards over it (Megatron).
pub(super) fn dp_and_optimizer(
    g: &Geo,
    layout: &ParallelLayout,
    stages: &[Stage],
    phases: &[Phases],
    interleaved: bool,
) -> (f64, f64) {
    let cost = g.cost;
    if cost.mode == CostMode::Unit {
        return (0.0, 0.0);
    }
    let gpn = cost.cluster.gpus_per_node;
    let (tp, pp, cp, dp) = (layout.tp, layout.pp.max(1), layout.cp, layout.dp);
    let v = layout.vpp.max(1);
    let params = cost.params();
    let dense_group = Group::strided(dp, tp * cp, gpn);
    let dense_dist_group = Group::strided(dp * cp, tp, gpn);
    let cp_grad_group = Group::strided(cp, tp, gpn);
    let expert_group = Group::strided(expert_dp(layout), tp * layout.ep.max(1), gpn);
    let Shards {
        dist,
        dense: dense_shards,
        expert: expert_shards,
    } = shards(layout);
    let mut dp_exposed: f64 = 0.0;
    let mut optimizer: f64 = 0.0;
    for (st, ph) in stages.iter().zip(phases) {
        let (pd, pe) = (st.params_dense, st.params_expert);
        // The distributed optimizer gathers the working weights (16-bit when mixed).
        let gw = g.act.size_bytes() as f64;
        let cp_t = if cp > 1 && !dist {
            cost.collective(Coll::AllReduce, (pd + pe) * W, cp_grad_group)
                + (st.tensors - 1.0).max(0.0) * params.kernel_overhead_us * 1e-6
        } else {
            0.0
        };
        let (grad_t, gather_t) = if dist {
            (
                cost.collective(Coll::ReduceScatter, pd * W, dense_dist_group)
                    + cost.collective(Coll::ReduceScatter, pe * W, expert_group),
                cost.collective(Coll::AllGather, pd * gw, dense_dist_group)
                    + cost.collective(Coll::AllGather, pe * gw, expert_group),
            )
        } else {
            (
                cost.collective(Coll::AllReduce, pd * W, dense_group)
                    + cost.collective(Coll::AllReduce, pe * W, expert_group),
                0.0,
            )
        };
        let exposed = if params.dp_comm_overlap {
            let chunks = if interleaved { v } else { 1 };
            let group = if pp > 1 { pp } else { 1 };
            let grad = if cp > 1 {
                // The dp reduction waits for the cp all-reduces, which follow the backward.
                cp_t + grad_t
            } else {
                overlapped_grad_sync(grad_t, ph.b + ph.w, chunks, group)
            };
            grad + overlapped_param_gather(gather_t, ph.f, chunks, group)
        } else {
            cp_t + grad_t + gather_t
        };
        dp_exposed = dp_exposed.max(exposed);
        let (shard_d, shard_e) = (pd / dense_shards, pe / expert_shards);
        let kernels = if dist { 1.0 } else { st.tensors };
        let opt = cost.memory((shard_d + shard_e) * 4.0)
            + cost.collective(Coll::AllReduce, 4.0, dense_group)
            + cost.memory((shard_d + shard_e) * 28.0)
            + (kernels - 1.0).max(0.0) * params.kernel_overhead_us * 1e-6;
        optimizer = optimizer.max(opt);
    }
    (dp_exposed, optimizer)
}

/// Exposed time of a gradient reduction taking `total` seconds that overlaps the backward
/// of the last micro-batch (`backward` seconds for the whole stage). With `chunks` virtual
/// chunks (Megatron's interleaved schedule), chunk c's gradients are final `c·group` chunk
/// backwards before the end (`group` micro-batches per round, = pp) and its reduction starts
/// then; the reductions run one after the other.
pub fn overlapped_grad_sync(total: f64, backward: f64, chunks: u64, group: u64) -> f64 {
    let v = chunks.max(1) as f64;
    let (per, t_chunk) = (total / v, backward / v);
    let mut finish = f64::NEG_INFINITY;
    for c in (0..chunks.max(1)).rev() {
        let ready = -(c as f64 * group as f64 * t_chunk) - t_chunk;
        finish = finish.max(ready) + per;
    }
    finish.max(0.0)
}

/// Exposed time of a parameter gather taking `total` seconds that overlaps the first
/// forward (`forward` seconds for the whole stage). With `chunks` virtual chunks, chunk c is
/// first needed after `c·group` chunk forwards; the gathers run one after the other from the
/// start of the step.
pub fn overlapped_param_gather(total: f64, forward: f64, chunks: u64, group: u64) -> f64 {
    let v = chunks.max(1) as f64;
    let (per, t_chunk) = (total / v, forward / v);
    let (mut finish, mut delay) = (0.0f64, 0.0f64);
    for c in 0..chunks.max(1) {
        finish += per;
        let deadline = c as f64 * group as f64 * t_chunk + t_chunk + delay;
        if finish > deadline {
            delay += finish - deadline;
        }
    }
    delay
}
