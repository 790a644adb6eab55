//! The analytic layout model: step time, bubble and memory of a layout without compiling it.
//!
//! For one layout it lists the kernels of one transformer layer as megac's passes emit them
//! (the same linears, norms, attention, elementwise ops, `zero`s and collectives, with the
//! rank-local shapes of tensor, sequence, context and expert parallelism), costs each with the
//! same [`CostModel`] functions the plan simulator uses, and composes stages:
//!
//! - per micro-batch and stage: forward `F`, input-gradient backward `B` (with recomputation),
//!   weight-gradient backward `W`, exposed in-layer communication;
//! - the pipeline: `m·t_max + (Σ t_i − t_max)/v` for 1F1B and GPipe (v = 1) and interleaved
//!   (v chunks), and for ZB-H1 a bubble of `Σ (F_i + B_i − W_i)` over the other stages
//!   (the schedule formulas of megatron-lm.md §2.7 and parallel-compilers.md §3, which this
//!   model reproduces exactly under unit costs);
//! - data-parallel gradient reduction and parameter gather, overlapped as [`CostParams`] says;
//! - the optimizer step (memory-bound AdamW).
//!
//! Memory per rank: parameters, gradients and optimizer state as megac's codegen lays them out
//! (f32 master weights and gradients, AdamW moments; sharded over data parallelism with the
//! distributed optimizer), plus the activations each layer keeps for its backward (the
//! tensors megac's autodiff saves, the Korthikanti et al. accounting for flash attention,
//! divided by tp where sequence parallelism shards them), times the micro-batches a schedule
//! keeps in flight, plus the logits of the loss.
//!
//! One module a step: `layer` (the kernels of a layer and the rank-local geometry),
//! `stage` (embedding, output layer, parameters per stage), `pipeline` (send/receive and the
//! bubble), `data_parallel` (gradient reduction, parameter gather, the optimizer step) and
//! `memory`; this file holds the layout and the estimate's types and composes them.
//!
//! [`CostParams`]: crate::cost::CostParams

use megac_ir::spec::{ModelSpec, Recompute, Schedule};

use crate::cost::CostModel;

mod data_parallel;
mod layer;
mod memory;
mod pipeline;
mod stage;

pub use data_parallel::{overlapped_grad_sync, overlapped_param_gather};
use layer::Geo;
pub use memory::inflight;

/// One parallel layout of a model (the `[parallel]` keys plus micro-batch and recompute), as
/// the simulator and the layout search see it; not [`megac_ir::Layout`], the placement of one
/// value over the mesh.
#[derive(Clone, Debug, PartialEq)]
pub struct ParallelLayout {
    /// Tensor-parallel size.
    pub tp: u64,
    /// Pipeline stages.
    pub pp: u64,
    /// Virtual chunks per pipeline rank.
    pub vpp: u64,
    /// Data-parallel size.
    pub dp: u64,
    /// Context-parallel size.
    pub cp: u64,
    /// Expert-parallel size (folds over dp·cp).
    pub ep: u64,
    /// Samples per micro-batch.
    pub micro_batch: u64,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Megatron sequence parallelism (only meaningful with tp > 1).
    pub sequence_parallel: bool,
    /// ZeRO-1 distributed optimizer over dp·cp.
    pub distributed_optimizer: bool,
}

impl ParallelLayout {
    /// The layout a validated spec describes.
    pub fn of_spec(spec: &ModelSpec) -> ParallelLayout {
        let p = &spec.parallel;
        ParallelLayout {
            tp: p.tp,
            pp: p.pp,
            vpp: p.vpp,
            dp: p.dp,
            cp: p.cp,
            ep: p.ep,
            micro_batch: spec.train.micro_batch,
            schedule: p.schedule,
            recompute: spec.train.recompute,
            sequence_parallel: p.sequence_parallel,
            distributed_optimizer: p.distributed_optimizer,
        }
    }

    /// Ranks the layout needs.
    pub fn world(&self) -> u64 {
        self.tp * self.pp * self.dp * self.cp
    }

    /// `spec` with this layout in place of its own.
    pub fn apply(&self, spec: &ModelSpec) -> ModelSpec {
        let mut s = spec.clone();
        self.set_in(&mut s);
        s
    }

    /// Put this layout in place of `spec`'s own (without cloning it).
    pub fn set_in(&self, s: &mut ModelSpec) {
        let p = &mut s.parallel;
        p.tp = self.tp;
        p.pp = self.pp;
        p.vpp = self.vpp;
        p.dp = self.dp;
        p.cp = self.cp;
        p.ep = self.ep;
        p.schedule = self.schedule;
        p.sequence_parallel = self.sequence_parallel;
        p.distributed_optimizer = self.distributed_optimizer;
        p.fbd = false;
        s.train.micro_batch = self.micro_batch;
        s.train.recompute = self.recompute;
    }

    /// The `--set` arguments that turn a model.toml into this layout: every key
    /// [`ParallelLayout::set_in`] sets.
    pub fn set_args(&self) -> Vec<String> {
        vec![
            format!("parallel.tp={}", self.tp),
            format!("parallel.pp={}", self.pp),
            format!("parallel.vpp={}", self.vpp),
            format!("parallel.dp={}", self.dp),
            format!("parallel.cp={}", self.cp),
            format!("parallel.ep={}", self.ep),
            format!("parallel.schedule=\"{}\"", self.schedule.as_str()),
            format!("parallel.sequence_parallel={}", self.sequence_parallel),
            format!(
                "parallel.distributed_optimizer={}",
                self.distributed_optimizer
            ),
            "parallel.fbd=false".to_string(),
            format!("train.micro_batch={}", self.micro_batch),
            format!("train.recompute=\"{}\"", self.recompute.as_str()),
        ]
    }

    /// Micro-batches per step and data-parallel rank.
    pub fn microbatches(&self, global_batch: u64) -> u64 {
        global_batch / (self.micro_batch * self.dp).max(1)
    }

    /// One line for people: `tp=8 pp=16 vpp=2 dp=8 cp=1 ep=1 mb=1 interleaved recompute=none sp dist-opt`.
    pub fn label(&self) -> String {
        let mut s = format!(
            "tp={} pp={} vpp={} dp={} cp={} ep={} mb={} {} recompute={}",
            self.tp,
            self.pp,
            self.vpp,
            self.dp,
            self.cp,
            self.ep,
            self.micro_batch,
            self.schedule.as_str(),
            self.recompute.as_str()
        );
        if self.sequence_parallel && self.tp > 1 {
            s.push_str(" sp");
        }
        if self.distributed_optimizer {
            s.push_str(" dist-opt");
        }
        s
    }
}

/// Bytes per rank by class (the worst pipeline stage).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters (f32).
    pub params: f64,
    /// Gradients (f32; plus the reduce-scattered shard with the distributed optimizer).
    pub grads: f64,
    /// AdamW moments (sharded with the distributed optimizer).
    pub optimizer: f64,
    /// Activations kept for backward, over the micro-batches in flight, plus one layer's
    /// working set.
    pub activations: f64,
    /// Logits and their gradient on the last stage, embeddings on the first.
    pub head: f64,
}

impl MemoryEstimate {
    /// Total bytes.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer + self.activations + self.head
    }
}

/// Where one step's time goes (seconds, the slowest stage).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TimeBreakdown {
    /// Forward of all micro-batches (with its exposed in-layer communication).
    pub forward: f64,
    /// Input-gradient backward of all micro-batches (with recomputation and its exposed
    /// in-layer communication).
    pub backward: f64,
    /// Weight-gradient backward of all micro-batches.
    pub weight_grad: f64,
    /// Exposed tensor/context/expert-parallel communication of all micro-batches (already
    /// counted in `forward` and `backward`).
    pub layer_comm: f64,
    /// Pipeline bubble (including exposed pipeline send/receive).
    pub bubble: f64,
    /// Exposed data-parallel communication.
    pub dp_comm: f64,
    /// Optimizer step (gradient norm and AdamW).
    pub optimizer: f64,
}

/// The model's prediction for one layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// Seconds per optimizer step.
    pub step_seconds: f64,
    /// Tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation: model FLOPs (Megatron's formula) / (time · GPUs · peak).
    pub mfu: f64,
    /// Pipeline bubble time over ideal (bubble-free) compute time, Megatron's definition:
    /// `(p−1)/m` for 1F1B.
    pub bubble_fraction: f64,
    /// Peak bytes on the most loaded rank (without the reserved memory).
    pub peak_memory_bytes: f64,
    /// Its breakdown.
    pub memory: MemoryEstimate,
    /// Whether the peak plus the reserved memory fits the device.
    pub fits: bool,
    /// Where the time goes.
    pub time: TimeBreakdown,
    /// Micro-batches per step and data-parallel rank.
    pub microbatches: u64,
}

/// Predict step time, throughput, MFU, bubble and memory of `layout` for `spec` on the
/// cluster of `cost` (which must hold at least `layout.world()` GPUs): the stages' costs
/// (`stage::stages`, from `layer::layer_cost`), the pipeline (`pipeline::pipeline`),
/// data-parallel communication and the optimizer (`data_parallel::dp_and_optimizer`) and
/// memory (`memory::peak_memory`).
pub fn estimate(spec: &ModelSpec, layout: &ParallelLayout, cost: &CostModel) -> Estimate {
    let m = &spec.model;
    let g = Geo::new(spec, layout, cost);
    let microbatches = layout.microbatches(spec.train.global_batch).max(1);
    let mf = microbatches as f64;
    let stages = stage::stages(&g, spec, layout);
    let pipe = pipeline::pipeline(&g, layout, &stages);
    let pipeline = mf * pipe.t_max + pipe.bubble;
    let (dp_exposed, optimizer) =
        data_parallel::dp_and_optimizer(&g, layout, &stages, &pipe.phases, pipe.interleaved);
    let (peak, mem) = memory::peak_memory(&g, spec, layout, &stages, microbatches);

    let step = pipeline + dp_exposed + optimizer;
    let tokens = (spec.train.global_batch * m.seq_len) as f64;
    let world = layout.world() as f64;
    let flops = megac_ir::flops::step_flops_at_tp(spec, layout.tp).total;
    let ideal = mf * pipe.t_max;
    let params = cost.params();
    let fits =
        peak + params.reserved_memory_gib * crate::cluster::GIB <= cost.cluster.device.memory_bytes;
    let crit = &pipe.phases[pipe.imax];
    Estimate {
        step_seconds: step,
        tokens_per_s: tokens / step,
        mfu: flops / (step * world * cost.peak(g.act)),
        bubble_fraction: if ideal > 0.0 {
            pipe.bubble / ideal
        } else {
            0.0
        },
        peak_memory_bytes: peak,
        memory: mem,
        fits,
        time: TimeBreakdown {
            forward: mf * crit.f,
            backward: mf * crit.b,
            weight_grad: mf * crit.w,
            layer_comm: mf * crit.comm,
            bubble: pipe.bubble,
            dp_comm: dp_exposed,
            optimizer,
        },
        microbatches,
    }
}
