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
//! [`CostParams`]: crate::cost::CostParams

use megac_ir::flops::padded_vocab;
use megac_ir::spec::{Arch, ModelSpec, Recompute, Schedule};
use megac_ir::types::DType;

use crate::cost::{Coll, CostMode, CostModel, Group};

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

/// Times of one stage for one micro-batch (all its chunks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Phases {
    /// Forward (with exposed forward communication).
    f: f64,
    /// Input-gradient backward (with recomputation and exposed backward communication).
    b: f64,
    /// Weight-gradient backward.
    w: f64,
    /// Exposed in-layer communication (already inside f and b), for the breakdown.
    comm: f64,
}

impl Phases {
    fn add(&mut self, o: Phases, times: f64) {
        self.f += o.f * times;
        self.b += o.b * times;
        self.w += o.w * times;
        self.comm += o.comm * times;
    }
    fn total(&self) -> f64 {
        self.f + self.b + self.w
    }
}

/// Rank-local geometry of one layout.
struct Geo<'a> {
    cost: &'a CostModel,
    act: DType,
    /// Activation bytes per element.
    a: f64,
    /// Tokens per rank and micro-batch (the cp shard of the sequence).
    t: f64,
    /// Tokens of sequence-sharded tensors (t / tp with sequence parallelism).
    tn: f64,
    h: f64,
    /// Query width per rank.
    q_l: f64,
    /// Key/value width per rank.
    kv_l: f64,
    /// Query heads per rank.
    heads_l: f64,
    /// MLP width per rank.
    f_l: f64,
    /// Full sequence length.
    s: f64,
    sp: bool,
    tp_group: Group,
    cp_group: Group,
    ep_group: Group,
    /// Context parallelism passes keys and values around a ring (else all-gathers them).
    cp_ring: bool,
    /// Sequence parallelism keeps norm outputs sharded and gathers them again in backward.
    sp_regather: bool,
    tp_overlap: f64,
}

/// The bytes of an f32 weight or gradient element.
const W: f64 = 4.0;

impl Geo<'_> {
    fn lin(&self, m: f64, n: f64, k: f64) -> f64 {
        self.cost
            .matmul(m, n, k, (m * k + m * n) * self.a + k * n * W, self.act)
    }
    fn lin_gi(&self, m: f64, n: f64, k: f64) -> f64 {
        // dx[m,k] = dy[m,n] · w[n,k]
        self.cost
            .matmul(m, k, n, (m * n + m * k) * self.a + n * k * W, self.act)
            + self.zero(m * k * self.a)
    }
    fn lin_gw(&self, m: f64, n: f64, k: f64) -> f64 {
        // dw[n,k] += dy[m,n]ᵀ · x[m,k] (f32, accumulated)
        self.cost.matmul(
            n,
            k,
            m,
            (m * n + m * k) * self.a + 2.0 * n * k * W,
            self.act,
        )
    }
    fn mem(&self, bytes: f64) -> f64 {
        self.cost.memory(bytes)
    }
    fn zero(&self, bytes: f64) -> f64 {
        self.cost.memory(bytes)
    }
    /// A tensor-parallel collective of a `[t, width]` activation (exposed part).
    fn tp_coll(&self, coll: Coll, width: f64) -> f64 {
        self.cost
            .collective(coll, self.t * width * self.a, self.tp_group)
            * (1.0 - self.tp_overlap)
    }
    /// Entering a column-parallel region: all-gather with sequence parallelism, else nothing.
    fn enter_f(&self) -> f64 {
        if self.sp {
            self.tp_coll(Coll::AllGather, self.h)
        } else {
            0.0
        }
    }
    /// Leaving a row-parallel region: reduce-scatter with sequence parallelism, else all-reduce.
    fn exit_f(&self) -> f64 {
        if self.sp {
            self.tp_coll(Coll::ReduceScatter, self.h)
        } else {
            self.tp_coll(Coll::AllReduce, self.h)
        }
    }
    /// Backward of a column-parallel region's input: reduce-scatter with sequence
    /// parallelism, plus the re-gather of the saved sharded input with `sp_regather` (megac
    /// keeps the gathered input instead), else all-reduce.
    fn enter_b(&self) -> f64 {
        if self.sp {
            let regather = if self.sp_regather {
                self.tp_coll(Coll::AllGather, self.h)
            } else {
                0.0
            };
            self.tp_coll(Coll::ReduceScatter, self.h) + regather
        } else {
            self.tp_coll(Coll::AllReduce, self.h)
        }
    }
    /// Backward of a row-parallel output: all-gather with sequence parallelism.
    fn exit_b(&self) -> f64 {
        if self.sp {
            self.tp_coll(Coll::AllGather, self.h)
        } else {
            0.0
        }
    }
    fn norm_f(&self, params: f64) -> f64 {
        self.mem(2.0 * self.tn * self.h * self.a + params * self.h * W)
    }
    fn norm_b(&self, params: f64) -> f64 {
        // x, dy in, dx out; weights in; weight gradients accumulated (read and written).
        self.mem(3.0 * self.tn * self.h * self.a + 3.0 * params * self.h * W)
            + self.zero(self.tn * self.h * self.a)
    }
    fn grad_sum(&self, tokens: f64, width: f64) -> f64 {
        self.mem(3.0 * tokens * width * self.a) + self.zero(tokens * width * self.a)
    }
    /// Executed attention FLOPs forward (causal: half the square), per rank.
    fn attn_flops(&self) -> f64 {
        let d = self.q_l / self.heads_l;
        2.0 * self.t * self.s * self.heads_l * d
    }
    /// Attention kernels per rank: one, or with ring context parallelism one per key/value
    /// block (the local queries meet each of the cp blocks in turn).
    fn attn_blocks(&self) -> f64 {
        if self.cp_ring {
            self.cp_group.size.max(1) as f64
        } else {
            1.0
        }
    }
    fn kv_bytes(&self) -> f64 {
        2.0 * self.t * self.kv_l * self.a
    }
    fn attn_f(&self) -> f64 {
        let n = self.attn_blocks();
        let bytes =
            (2.0 * self.q_l + 2.0 * self.kv_l) * self.t * self.a + 4.0 * self.t * self.heads_l;
        let kernel = n * self.cost.attention(
            self.attn_flops() / n,
            self.t * self.q_l,
            bytes / n,
            false,
            self.act,
        );
        kernel
            + self
                .cost
                .cp_exchange(self.kv_bytes(), self.cp_group, self.cp_ring, false, kernel)
    }
    fn attn_b(&self) -> f64 {
        let n = self.attn_blocks();
        let bytes =
            (4.0 * self.q_l + 4.0 * self.kv_l) * self.t * self.a + 4.0 * self.t * self.heads_l;
        let kernel = n * self.cost.attention(
            2.5 * self.attn_flops() / n,
            self.t * self.q_l,
            bytes / n,
            true,
            self.act,
        );
        kernel
            + self
                .cost
                .cp_exchange(self.kv_bytes(), self.cp_group, self.cp_ring, true, kernel)
            + self.zero(self.t * self.q_l * self.a)
            + 2.0 * self.zero(self.t * self.kv_l * self.a)
    }
}

/// Costs of one transformer layer for one micro-batch, and the bytes it keeps for backward.
struct LayerCost {
    phases: Phases,
    /// Forward time of the layer (recomputation replays it).
    forward: f64,
    /// Forward time of the core attention (selective recomputation replays it).
    attention: f64,
    /// Bytes kept for backward without recomputation.
    saved: f64,
    /// Bytes kept with selective recomputation.
    saved_selective: f64,
    /// The layer input (the checkpoint of full recomputation).
    input: f64,
}

fn attention_block(g: &Geo, arch: Arch, ph: &mut Phases) -> (f64, f64) {
    // Returns (forward time incl. comm, attention kernel time); adds to ph.
    let (t, h, a) = (g.t, g.h, g.a);
    let mut f = 0.0;
    let mut b = 0.0;
    let mut w = 0.0;
    let mut comm_f = 0.0;
    let mut comm_b = 0.0;
    let norm_params = if arch == Arch::Gpt { 2.0 } else { 1.0 };
    f += g.norm_f(norm_params);
    comm_f += g.enter_f();
    let attn = g.attn_f();
    let attn_b = g.attn_b();
    match arch {
        Arch::Llama => {
            f += g.lin(t, g.q_l, h) + 2.0 * g.lin(t, g.kv_l, h);
            f += g.mem(2.0 * t * g.q_l * a) + g.mem(2.0 * t * g.kv_l * a);
            f += attn;
            f += g.lin(t, h, g.q_l);
            comm_f += g.exit_f();
            f += g.mem(3.0 * g.tn * h * a);
            // Backward, in reverse.
            comm_b += g.exit_b();
            b += g.grad_sum(g.tn, h); // residual: the input feeds the norm and the add
            b += g.lin_gi(t, h, g.q_l);
            w += g.lin_gw(t, h, g.q_l);
            b += attn_b;
            b += g.mem(2.0 * t * g.q_l * a) + g.zero(t * g.q_l * a);
            b += g.mem(2.0 * t * g.kv_l * a) + g.zero(t * g.kv_l * a);
            b += g.lin_gi(t, g.q_l, h) + 2.0 * g.lin_gi(t, g.kv_l, h);
            b += 2.0 * g.grad_sum(t, h);
            w += g.lin_gw(t, g.q_l, h) + 2.0 * g.lin_gw(t, g.kv_l, h);
            comm_b += g.enter_b();
            b += g.norm_b(norm_params);
        }
        Arch::Gpt => {
            let qkv = 3.0 * g.q_l;
            f += g.lin(t, qkv, h) + g.mem(qkv * W);
            f += g.mem(2.0 * t * qkv * a); // split
            f += attn;
            f += g.lin(t, h, g.q_l);
            comm_f += g.exit_f();
            f += g.mem(2.0 * g.tn * h * a + h * W); // bias (after the reduction)
            f += g.mem(3.0 * g.tn * h * a);
            comm_b += g.exit_b();
            b += g.grad_sum(g.tn, h);
            b += g.lin_gi(t, h, g.q_l);
            w += g.lin_gw(t, h, g.q_l) + g.mem(t * h * a + 2.0 * h * W);
            b += attn_b;
            b += g.mem(2.0 * t * qkv * a) + g.zero(t * qkv * a); // concat
            b += g.lin_gi(t, qkv, h);
            w += g.lin_gw(t, qkv, h) + g.mem(t * qkv * a + 2.0 * qkv * W);
            comm_b += g.enter_b();
            b += g.norm_b(norm_params);
        }
    }
    ph.f += f + comm_f;
    ph.b += b + comm_b;
    ph.w += w;
    ph.comm += comm_f + comm_b;
    (f + comm_f, attn)
}

fn mlp_block(
    g: &Geo,
    spec: &ModelSpec,
    layout: &ParallelLayout,
    moe: bool,
    ph: &mut Phases,
) -> f64 {
    let m = &spec.model;
    let (t, h, a, f_l) = (g.t, g.h, g.a, g.f_l);
    let mut f = 0.0;
    let mut b = 0.0;
    let mut w = 0.0;
    let mut comm_f = 0.0;
    let mut comm_b = 0.0;
    let norm_params = if m.arch == Arch::Gpt { 2.0 } else { 1.0 };
    f += g.norm_f(norm_params);
    comm_f += g.enter_f();
    match (m.arch, moe) {
        (Arch::Llama, false) => {
            f += 2.0 * g.lin(t, f_l, h) + g.mem(3.0 * t * f_l * a) + g.lin(t, h, f_l);
            b += g.lin_gi(t, h, f_l);
            w += g.lin_gw(t, h, f_l);
            b += g.mem(5.0 * t * f_l * a) + 2.0 * g.zero(t * f_l * a);
            b += 2.0 * g.lin_gi(t, f_l, h) + g.grad_sum(t, h);
            w += 2.0 * g.lin_gw(t, f_l, h);
        }
        (Arch::Gpt, _) => {
            f += g.lin(t, f_l, h) + g.mem(f_l * W);
            f += g.mem(2.0 * t * f_l * a);
            f += g.lin(t, h, f_l) + g.mem(2.0 * g.tn * h * a + h * W);
            b += g.lin_gi(t, h, f_l);
            w += g.lin_gw(t, h, f_l) + g.mem(t * h * a + 2.0 * h * W);
            b += g.mem(3.0 * t * f_l * a) + g.zero(t * f_l * a);
            b += g.lin_gi(t, f_l, h);
            w += g.lin_gw(t, f_l, h) + g.mem(t * f_l * a + 2.0 * f_l * W);
        }
        (Arch::Llama, true) => {
            let x = m.moe.as_ref().expect("moe layer has [model.moe]");
            let (e, k) = (x.experts as f64, x.top_k as f64);
            let ep = layout.ep.max(1) as f64;
            let local = e / ep;
            let m_e = t * k * ep / e; // tokens per local expert (balanced routing)
                                      // Router, aux loss, dispatch / combine.
            f += g.lin(t, e, h) + g.mem(2.0 * t * e * 4.0 + t * k * 8.0) + g.mem(t * e * 4.0);
            b += g.lin_gi(t, e, h) + g.mem(3.0 * t * e * 4.0) + g.zero(t * e * 4.0);
            w += g.lin_gw(t, e, h);
            for _ in 0..local as u64 {
                f += g.mem(2.0 * m_e * h * a);
                f += 2.0 * g.lin(m_e, f_l, h) + g.mem(3.0 * m_e * f_l * a) + g.lin(m_e, h, f_l);
                b += g.mem(2.0 * m_e * h * a) + g.zero(t * h * a);
                b += g.lin_gi(m_e, h, f_l)
                    + g.mem(5.0 * m_e * f_l * a)
                    + 2.0 * g.zero(m_e * f_l * a);
                b += 2.0 * g.lin_gi(m_e, f_l, h) + g.grad_sum(m_e, h);
                w += g.lin_gw(m_e, h, f_l) + 2.0 * g.lin_gw(m_e, f_l, h);
            }
            f += g.mem((t * k * h + t * h) * a);
            b += g.mem((2.0 * t * k * h + t * h) * a) + g.zero(t * k * h * a);
            if layout.ep > 1 {
                let bytes = t * k * h * a;
                let a2a =
                    g.cost.collective(Coll::AllToAll, bytes, g.ep_group) * (1.0 - g.tp_overlap);
                comm_f += 2.0 * a2a;
                comm_b += 2.0 * a2a;
            }
        }
    }
    comm_f += g.exit_f();
    f += g.mem(3.0 * g.tn * h * a);
    comm_b += g.exit_b();
    b += g.grad_sum(g.tn, h);
    comm_b += g.enter_b();
    b += g.norm_b(norm_params);
    ph.f += f + comm_f;
    ph.b += b + comm_b;
    ph.w += w;
    ph.comm += comm_f + comm_b;
    f + comm_f
}

fn layer_cost(g: &Geo, spec: &ModelSpec, layout: &ParallelLayout, moe: bool) -> LayerCost {
    let m = &spec.model;
    let mut ph = Phases::default();
    let (attn_fwd, attention) = attention_block(g, m.arch, &mut ph);
    let mlp_fwd = mlp_block(g, spec, layout, moe, &mut ph);
    let (t, tn, h, a) = (g.t, g.tn, g.h, g.a);
    let lse = 4.0 * t * g.heads_l;
    let attn_out = t * g.q_l * a;
    let mlp_saved = match (m.arch, moe) {
        (Arch::Llama, false) => 3.0 * t * g.f_l * a,
        (Arch::Gpt, _) => 2.0 * t * g.f_l * a,
        (Arch::Llama, true) => {
            let x = m.moe.as_ref().expect("moe layer has [model.moe]");
            let (e, k) = (x.experts as f64, x.top_k as f64);
            let tokens = t * k; // routed copies on this rank
            t * e * 4.0 + tokens * (h + 3.0 * g.f_l) * a + tokens * h * a
        }
    };
    let qkv_saved = match m.arch {
        Arch::Llama => (g.q_l + 2.0 * g.kv_l) * t * a,
        Arch::Gpt => 3.0 * g.q_l * t * a,
    };
    // Norm inputs (sharded by sequence parallelism) and outputs (the linears' saved input:
    // gathered, or sharded with `sp_regather`), q/k/v, attention output and log-sum-exp, the
    // MLP's saved tensors.
    let norm_out = if g.sp_regather { tn } else { t };
    let saved = 2.0 * tn * h * a + 2.0 * norm_out * h * a + qkv_saved + attn_out + lse + mlp_saved;
    LayerCost {
        phases: ph,
        forward: attn_fwd + mlp_fwd,
        attention,
        saved,
        saved_selective: saved - attn_out - lse,
        input: tn * h * a,
    }
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
            Arch::Llama => {
                dense += h * q_l + 2.0 * h * kv_l + q_l * h + 2.0 * h;
                if m.is_moe_layer(i) {
                    let x = m.moe.as_ref().expect("moe layer has [model.moe]");
                    dense += h * x.experts as f64;
                    expert += (x.experts / layout.ep.max(1)) as f64 * 3.0 * h * f_l;
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
        Arch::Llama => 9.0,
        Arch::Gpt => 12.0,
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

/// Predict step time, throughput, MFU, bubble and memory of `layout` for `spec` on the
/// cluster of `cost` (which must hold at least `layout.world()` GPUs).
pub fn estimate(spec: &ModelSpec, layout: &ParallelLayout, cost: &CostModel) -> Estimate {
    let m = &spec.model;
    let cl = &cost.cluster;
    let gpn = cl.gpus_per_node;
    let (tp, pp, cp, dp) = (layout.tp, layout.pp.max(1), layout.cp, layout.dp);
    let v = layout.vpp.max(1);
    let sp = layout.sequence_parallel && tp > 1;
    let act = spec.train.precision.storage();
    let a = act.size_bytes() as f64;
    let mb = layout.micro_batch as f64;
    let s = m.seq_len as f64;
    let t = mb * s / cp as f64;
    let tn = if sp { t / tp as f64 } else { t };
    let d = m.head_dim() as f64;
    let heads_l = m.heads as f64 / tp as f64;
    let kv_heads_l = (m.kv_heads as f64 / tp as f64).max(1.0).floor();
    let params = cost.params();
    let unit = cost.mode == CostMode::Unit;
    let g = Geo {
        cost,
        act,
        a,
        t,
        tn,
        h: m.hidden as f64,
        q_l: heads_l * d,
        kv_l: kv_heads_l * d,
        heads_l,
        f_l: m.ffn_hidden as f64 / tp as f64,
        s,
        sp,
        tp_group: Group::strided(tp, 1, gpn),
        cp_group: Group::strided(cp, tp, gpn),
        ep_group: Group::strided(layout.ep, tp, gpn),
        cp_ring: spec.parallel.cp_comm == megac_ir::spec::CpComm::Ring,
        sp_regather: params.sp_regather,
        tp_overlap: params.tp_comm_overlap,
    };
    let microbatches = layout.microbatches(spec.train.global_batch).max(1);
    let mf = microbatches as f64;

    // Layers of each stage (contiguous split; interleaving changes the order, not the count).
    let per_stage = m.layers / pp;
    let stage_layers = |i: u64| -> Vec<u64> { (i * per_stage..(i + 1) * per_stage).collect() };
    let dense_layer = layer_cost(&g, spec, layout, false);
    let moe_layer = m.moe.as_ref().map(|_| layer_cost(&g, spec, layout, true));

    // Embedding (first stage) and loss head (last stage).
    let v_l = padded_vocab(m.vocab, tp) as f64 / tp as f64;
    let h = g.h;
    let mut embed = Phases::default();
    {
        let mut f = g.mem(t * 4.0 + 2.0 * t * h * 4.0);
        let mut comm = 0.0;
        if tp > 1 {
            comm +=
                g.cost.collective(Coll::AllReduce, t * h * 4.0, g.tp_group) * (1.0 - g.tp_overlap);
        }
        if m.arch == Arch::Gpt {
            f += g.mem(3.0 * t * h * 4.0);
        }
        let mut b = g.mem(2.0 * t * h * 4.0 + t * 4.0);
        if act != DType::F32 {
            f += g.mem(t * h * (4.0 + a));
            b += g.mem(t * h * (4.0 + a)) + g.zero(t * h * 4.0);
        }
        if m.arch == Arch::Gpt {
            b += g.mem(t * h * 4.0 + 2.0 * s * h * 4.0);
        }
        embed.f = f + comm;
        embed.b = b;
        embed.comm = comm;
    }
    let mut head = Phases::default();
    {
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
            comm_f += 2.0
                * g.cost.collective(Coll::AllReduce, t * 4.0, g.tp_group)
                * (1.0 - g.tp_overlap);
        }
        head.f = f + comm_f;
        head.b = b + comm_b;
        head.w = w;
        head.comm = comm_f + comm_b;
    }

    let recompute_of = |lc: &LayerCost| match layout.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => lc.attention,
        Recompute::Full => lc.forward,
    };
    let saved_of = |lc: &LayerCost| match layout.recompute {
        Recompute::None => lc.saved,
        Recompute::Selective => lc.saved_selective,
        Recompute::Full => lc.input,
    };

    // Per-stage phases for one micro-batch, parameters and activation bytes.
    struct Stage {
        ph: Phases,
        params_dense: f64,
        params_expert: f64,
        saved_per_mb: f64,
        working: f64,
        tensors: f64,
    }
    let stage = |i: u64| -> Stage {
        let layers = stage_layers(i);
        let (first, last) = (i == 0, i == pp - 1);
        let mut ph = Phases::default();
        let mut saved = 0.0;
        let mut working: f64 = 0.0;
        for &l in &layers {
            let lc = match (&moe_layer, m.is_moe_layer(l)) {
                (Some(x), true) => x,
                _ => &dense_layer,
            };
            ph.add(lc.phases, 1.0);
            ph.b += recompute_of(lc);
            saved += saved_of(lc);
            // Working set of the layer being differentiated (and recomputed).
            working = working.max(lc.saved);
        }
        if first {
            ph.add(embed, 1.0);
            saved += t * h * 4.0;
        }
        if last {
            ph.add(head, 1.0);
        }
        let (pd, pe) = stage_params(spec, layout, &layers, first, last);
        Stage {
            ph,
            params_dense: pd,
            params_expert: pe,
            saved_per_mb: saved,
            working,
            tensors: stage_tensors(spec, layers.len(), first, last),
        }
    };
    let stages: Vec<Stage> = if pp == 1 {
        vec![stage(0)]
    } else {
        // First, one middle stage (all middle stages are alike), last.
        let mut s = vec![stage(0)];
        if pp > 2 {
            s.push(stage(1));
        }
        s.push(stage(pp - 1));
        s
    };
    // Multiplicity of each computed stage among the pp real ones.
    let mult: Vec<f64> = match stages.len() {
        1 => vec![1.0],
        2 => vec![1.0, 1.0],
        _ => vec![1.0, (pp - 2) as f64, 1.0],
    };

    // Pipeline send/receive of the boundary activation (sequence-sharded with sp).
    let pp_group = Group::strided(pp, tp * cp * dp, gpn);
    let t_p2p = if pp > 1 && !unit {
        cost.collective(Coll::SendRecv, tn * h * a, pp_group)
    } else {
        0.0
    };

    // Phases per stage (unit costs replace them: one per chunk for F, B and W).
    let mut phases: Vec<Phases> = stages
        .iter()
        .map(|st| {
            if unit {
                Phases {
                    f: v as f64,
                    b: v as f64,
                    w: v as f64,
                    comm: 0.0,
                }
            } else {
                st.ph
            }
        })
        .collect();
    let mut bubble_extra = 0.0;
    if pp > 1 && !unit {
        if params.pp_comm_overlap {
            bubble_extra += 2.0 * (pp - 1) as f64 * t_p2p;
        } else {
            for ph in &mut phases {
                ph.f += v as f64 * t_p2p;
                ph.b += v as f64 * t_p2p;
                ph.comm += 2.0 * v as f64 * t_p2p;
            }
            bubble_extra += 2.0 * (pp - 1) as f64 * t_p2p;
        }
    }
    let totals: Vec<f64> = phases.iter().map(Phases::total).collect();
    let (imax, t_max) = totals
        .iter()
        .copied()
        .enumerate()
        .fold((0, 0.0), |acc, (i, x)| if x > acc.1 { (i, x) } else { acc });
    let sum: f64 = totals.iter().zip(&mult).map(|(x, k)| x * k).sum();
    let interleaved = v > 1 && matches!(layout.schedule, Schedule::Interleaved | Schedule::Dpp);
    let bubble = if pp == 1 {
        0.0
    } else {
        match layout.schedule {
            Schedule::ZbH1 => {
                let gsum: f64 = phases
                    .iter()
                    .zip(&mult)
                    .map(|(p, k)| (p.f + p.b - p.w) * k)
                    .sum();
                let gmax = phases[imax].f + phases[imax].b - phases[imax].w;
                (gsum - gmax).max(0.0)
            }
            _ if interleaved => (sum - t_max) / v as f64,
            _ => sum - t_max,
        }
    } + bubble_extra;
    let pipeline = mf * t_max + bubble;

    // Data-parallel gradient reduction and parameter gather (per stage; the worst one). As
    // megac's plans do it: with context parallelism every gradient is first all-reduced over
    // cp (one collective per parameter, after the backward), then reduced over dp; the
    // distributed optimizer instead reduce-scatters over the dp·cp group and shards over it
    // (Megatron).
    let dpcp = dp * cp;
    let dense_group = Group::strided(dp, tp * cp, gpn);
    let dense_dist_group = Group::strided(dpcp, tp, gpn);
    let cp_grad_group = Group::strided(cp, tp, gpn);
    let expert_dp = (dpcp / layout.ep.max(1)).max(1);
    let expert_group = Group::strided(expert_dp, tp * layout.ep.max(1), gpn);
    let mut dp_exposed: f64 = 0.0;
    let mut optimizer: f64 = 0.0;
    let mut mem = MemoryEstimate::default();
    let mut peak: f64 = 0.0;
    let dist = layout.distributed_optimizer && dpcp > 1;
    let dense_shards = if dist { dpcp as f64 } else { 1.0 };
    let expert_shards = if dist { expert_dp as f64 } else { 1.0 };
    for (i, st) in stages.iter().enumerate() {
        let ph = &phases[i];
        let (pd, pe) = (st.params_dense, st.params_expert);
        if !unit {
            // The distributed optimizer gathers the working weights (16-bit when mixed).
            let gw = act.size_bytes() as f64;
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
        // Memory of this stage.
        let p_all = pd + pe;
        let shard = pd / dense_shards + pe / expert_shards;
        // As codegen lays them out: working weights in the storage dtype, f32 gradients
        // (plus the reduce-scattered shard with the distributed optimizer), f32 moments and,
        // under mixed precision, an f32 master copy, sharded by the distributed optimizer.
        let state_per_param = if act.is_half() { 12.0 } else { 8.0 };
        let param_bytes = p_all * act.size_bytes() as f64;
        let (grads, opt_state) = if dist {
            (p_all * W + shard * W, shard * state_per_param)
        } else {
            (p_all * W, p_all * state_per_param)
        };
        let stage_index = if i == stages.len() - 1 {
            pp - 1
        } else {
            i as u64
        };
        let inflight = inflight(layout, microbatches, stage_index);
        let activations = st.saved_per_mb * inflight + st.working;
        let last = stage_index == pp - 1;
        let head_bytes = if last {
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
    let step = pipeline + dp_exposed + optimizer;
    let tokens = (spec.train.global_batch * m.seq_len) as f64;
    let world = layout.world() as f64;
    let flops = megac_ir::flops::step_flops_at_tp(spec, tp).total;
    let ideal = mf * t_max;
    let fits = peak + params.reserved_memory_gib * crate::cluster::GIB <= cl.device.memory_bytes;
    let crit = &phases[imax];
    Estimate {
        step_seconds: step,
        tokens_per_s: tokens / step,
        mfu: flops / (step * world * cost.peak(act)),
        bubble_fraction: if ideal > 0.0 { bubble / ideal } else { 0.0 },
        peak_memory_bytes: peak,
        memory: mem,
        fits,
        time: TimeBreakdown {
            forward: mf * crit.f,
            backward: mf * crit.b,
            weight_grad: mf * crit.w,
            layer_comm: mf * crit.comm,
            bubble,
            dp_comm: dp_exposed,
            optimizer,
        },
        microbatches,
    }
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
        _ => (p - i).min(m) as f64,
    }
}
