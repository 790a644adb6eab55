//! Memory per rank: parameters, gradients and optimizer state as megac's codegen lays them
//! out (f32 master weights and gradients, AdamW moments; sharded over data parallelism with
//! the distributed optimizer), plus the activations each layer keeps for its backward times
//! the micro-batches a schedule keeps in flight, plus the logits of the loss.

use megac_ir::flops::padded_vocab;
use megac_ir::spec::Schedule;

use super::data_parallel::{shards, Shards};
use super::layer::{Geo, W};
use super::stage::Stage;
use super::{MemoryEstimate, ParallelLayout};

/// The peak bytes over `stages` and the breakdown of the stage that holds it.
pub(super) fn peak_memory(
    g: &Geo,
    spec: &megac_ir::spec::ModelSpec,
    layout: &ParallelLayout,
    stages: &[Stage],
    microbatches: u64,
) -> (f64, MemoryEstimate) {
    let tp = layout.tp;
    let pp = layout.pp.max(1);
    let (t, tn, h, a) = (g.t, g.tn, g.h, g.a);
    let v_l = padded_vocab(spec.model.vocab, tp) as f64 / tp as f64;
    let Shards {
        dist,
        dense: dense_shards,
        expert: expert_shards,
    } = shards(layout);
    let mut mem = MemoryEstimate::default();
    let mut peak: f64 = 0.0;
    for st in stages {
        let (pd, pe) = (st.params_dense, st.params_expert);
        let p_all = pd + pe;
        let shard = pd / dense_shards + pe / expert_shards;
        // As codegen lays them out: working weights in the storage dtype, f32 gradients
        // (the distributed optimizer reduce-scatters in place), f32 moments and, under mixed
        // precision, an f32 master copy, sharded by the distributed optimizer.
        let state_per_param = if g.act.is_half() { 12.0 } else { 8.0 };
        let param_bytes = p_all * g.act.size_bytes() as f64;
        let (grads, opt_state) = if dist {
            (p_all * W + st.grad_extra, shard * state_per_param)
        } else {
            (p_all * W + st.grad_extra, p_all * state_per_param)
        };
        let inflight = inflight(layout, microbatches, st.index);
        let activations = st.saved_per_mb * inflight + st.working;
        let last = st.index == pp - 1;
        // The logits, their gradient and the final norm's tensors (zero-bubble plans keep
        // them in each micro-batch's slot instead: `Stage::saved_per_mb`).
        let head_bytes = if last && !(layout.schedule == Schedule::ZbH1 && pp > 1) {
            2.0 * t * v_l * a + 3.0 * tn * h * a
        } else {
            0.0
        };
        let me = MemoryEstimate {
            params: param_bytes,
            grads,
            optimizer: opt_state,
            activations,
            head: head_bytes,
        };
        if me.total() > peak {
            peak = me.total();
            mem = me;
        }
    }
    (peak, mem)
}

/// Micro-batches whose activations stage `i` holds at once (in units of one micro-batch's
/// activations of the whole stage).
pub fn inflight(layout: &ParallelLayout, microbatches: u64, i: u64) -> f64 {
    let p = layout.pp.max(1);
    let m = microbatches.max(1);
    let v = layout.vpp.max(1);
    if p == 1 {
        return 1.0;
    }
    match layout.schedule {
        Schedule::Gpipe => m as f64,
        Schedule::Interleaved | Schedule::Dpp if v > 1 => {
            // Megatron's warmup: 2(p−i−1) + (v−1)·p chunk-forwards before the first backward,
            // plus the one in flight; each holds 1/v of the stage.
            let chunks = (2 * (p - i - 1) + (v - 1) * p + 1).min(m * v);
            chunks as f64 / v as f64
        }
        // Zero-bubble H1: every stage holds a micro-batch from its F to its deferred W,
        // pp of them at once (as many as 1F1B's first stage).
        Schedule::ZbH1 => p.min(m) as f64,
        _ => (p - i).min(m) as f64,
    }
}
