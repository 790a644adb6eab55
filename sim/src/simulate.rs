//! Event-driven simulation of a compiled plan.
//!
//! Each role program is simulated once (ranks that run the same program behave alike): the
//! micro-batch program `microbatches` times, then the optimizer program. A rank has one
//! compute stream, which runs kernels in program order, and one communication stream per
//! group kind (tp, dp, ...), on which collectives run as soon as the compute that precedes
//! them in program order is done. A kernel waits for every in-flight collective whose
//! buffers overlap its own (read-after-write and write-after-read through the arenas).
//! Kernel and collective times come from [`CostModel`]; the overlap switches of
//! [`crate::cost::CostParams`] apply as in the analytic model: a fraction of tensor-parallel
//! collective time is hidden, data-parallel gradient reduction may start with the last
//! micro-batch's backward, and the parameter gather may overlap the next step's forward.
//!
//! Pipelined plans (one role per stage) are simulated with every stage at once, transfers
//! between them over the pipeline link: see the `pipeline` submodule.

use std::collections::BTreeMap;

use megac_ir::op::OpKind;
use megac_ir::plan::{Buffer, BufferClass, Instr, Plan, Role};
use megac_ir::types::{Axis, DType};

use crate::cost::{Coll, CostMode, CostModel, Group};
use crate::error::SimError;

mod pipeline;

pub use pipeline::{order_bound, PhaseBound, StageWork};

/// What the simulation of one role found.
#[derive(Clone, Debug, PartialEq)]
pub struct RoleReport {
    /// Role name.
    pub name: String,
    /// Ranks that run it.
    pub ranks: usize,
    /// Seconds per step.
    pub step_seconds: f64,
    /// Busy time of the compute stream.
    pub compute_seconds: f64,
    /// Time the compute stream waited for communication.
    pub exposed_comm_seconds: f64,
    /// Total collective time per group kind (`tp`, `dp`, `dp+cp`, ...), hidden or not.
    pub comm_seconds: BTreeMap<String, f64>,
    /// Time of the first micro-batch (forward and backward).
    pub microbatch_seconds: f64,
    /// Time of the optimizer program.
    pub optimizer_seconds: f64,
    /// Kernels per step.
    pub kernels: u64,
    /// Peak bytes of the static memory plan (all arenas).
    pub memory_bytes: u64,
    /// Peak bytes of live activations (first definition to last use, without the
    /// placement's fragmentation): a lower bound of the activation arena.
    pub activation_live_bytes: u64,
    /// Pipelined plans: the role's pipeline stage (its `pp` coordinate).
    pub stage: Option<u32>,
    /// Pipelined plans: the stage's idle compute time over the pipeline's duration (the
    /// forward and backward phase of the step, before the optimizer); 0 without a pipeline.
    pub bubble_fraction: f64,
    /// Pipelined plans: the most micro-batches in flight at once (forward done, backward
    /// not), over all chunks of the stage; 1 without a pipeline.
    pub peak_inflight: u32,
}

/// The result of simulating a plan (the `simulate --format json` contract).
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Seconds per optimizer step (the slowest role).
    pub step_seconds: f64,
    /// Tokens per second over the job.
    pub tokens_per_s: f64,
    /// Model FLOPs (the plan's, Megatron's formula) over the peak of all GPUs.
    pub mfu: f64,
    /// Pipeline bubble: idle compute time over total time during the pipeline phase of the
    /// step, over all ranks (the pipeline schedules' definition; 0 without pipeline parallelism).
    pub bubble_fraction: f64,
    /// Pipelined plans: how the schedule was executed (`static` action lists, or `dynamic`
    /// for dpp: the highest-priority ready task, as the runtime does); None without a
    /// pipeline.
    pub pipeline_execution: Option<String>,
    /// Pipelined plans without FBD forward roles: the pipeline phase and the shortest any
    /// order of its actions could make it with the durations they took ([`order_bound`]).
    pub pipeline_phase: Option<PhaseBound>,
    /// Peak bytes of each rank.
    pub peak_memory_bytes: Vec<u64>,
    /// Per role.
    pub roles: Vec<RoleReport>,
    /// Ranks.
    pub world: usize,
}

impl SimReport {
    /// The JSON form: the contract's keys plus `roles` and `world`.
    pub fn to_json(&self) -> serde_json::Value {
        let roles: Vec<serde_json::Value> = self
            .roles
            .iter()
            .map(|r| {
                serde_json::json!({
                    "role": r.name,
                    "ranks": r.ranks,
                    "step_seconds": r.step_seconds,
                    "compute_seconds": r.compute_seconds,
                    "exposed_comm_seconds": r.exposed_comm_seconds,
                    "comm_seconds": r.comm_seconds,
                    "microbatch_seconds": r.microbatch_seconds,
                    "optimizer_seconds": r.optimizer_seconds,
                    "kernels_per_step": r.kernels,
                    "memory_bytes": r.memory_bytes,
                    "activation_live_bytes": r.activation_live_bytes,
                    "stage": r.stage,
                    "bubble_fraction": r.bubble_fraction,
                    "peak_inflight": r.peak_inflight,
                })
            })
            .collect();
        serde_json::json!({
            "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "pipeline_execution": self.pipeline_execution,
            "pipeline_seconds": self.pipeline_phase.map(|p| p.seconds),
            "pipeline_bound_seconds": self.pipeline_phase.map(|p| p.bound_seconds),
            "peak_memory_bytes": self.peak_memory_bytes,
            "world": self.world,
            "roles": roles,
        })
    }
}

/// One span of the timeline (Chrome trace "complete" event).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// Kernel or collective name.
    pub name: String,
    /// Provenance path or phase.
    pub detail: String,
    /// Start, seconds.
    pub start: f64,
    /// Duration, seconds.
    pub dur: f64,
    /// Role index (trace process).
    pub role: usize,
    /// Stream: 0 compute, 1.. communication, 99 micro-batch spans.
    pub stream: u32,
}

/// Chrome-trace JSON (opens in Perfetto / chrome://tracing) of `events`.
pub fn trace_json(plan: &Plan, events: &[TraceEvent], streams: &BTreeMap<u32, String>) -> String {
    let mut out: Vec<serde_json::Value> = Vec::with_capacity(events.len() + 16);
    for (i, role) in plan.roles.iter().enumerate() {
        out.push(
            serde_json::json!({"name": "process_name", "ph": "M", "pid": i,
            "args": {"name": format!("role {}", role.name)}}),
        );
        for (tid, name) in streams {
            out.push(
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": i, "tid": tid,
                "args": {"name": name}}),
            );
        }
    }
    for e in events {
        out.push(serde_json::json!({
            "name": e.name,
            "cat": if e.stream == 0 { "compute" } else if e.stream == 99 { "phase" } else { "comm" },
            "ph": "X",
            "ts": e.start * 1e6,
            "dur": e.dur * 1e6,
            "pid": e.role,
            "tid": e.stream,
            "args": {"path": e.detail},
        }));
    }
    let mut s = serde_json::json!({ "traceEvents": out, "displayTimeUnit": "ms" }).to_string();
    s.push('\n');
    s
}

/// The phase of a kernel in a micro-batch, for unit costs and spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Forward,
    Backward,
    WeightGrad,
}

/// Index of the first backward instruction of a micro-batch program (a gradient kernel or
/// the `zero` right before one).
fn backward_start(program: &[Instr]) -> usize {
    let first_grad = program
        .iter()
        .position(|i| matches!(i, Instr::Kernel { op, .. } if op.is_backward()))
        .unwrap_or(program.len());
    let mut s = first_grad;
    while s > 0 && matches!(program[s - 1], Instr::Zero { .. }) {
        s -= 1;
    }
    s
}

fn bytes(b: &Buffer) -> f64 {
    (b.len() * b.dtype.size_bytes()) as f64
}

fn last_dim(b: &Buffer) -> f64 {
    b.shape.last().copied().unwrap_or(1).max(1) as f64
}

fn rows(b: &Buffer) -> f64 {
    b.len() as f64 / last_dim(b)
}

/// The share of a buffer a kernel computes on and moves: for MoE token rows, the rows a
/// balanced router fills (`routed_rows` of each expert block's rows); 1 otherwise.
fn fill(b: &Buffer) -> f64 {
    match (b.routed_rows, b.shape.len().checked_sub(2)) {
        (Some(routed), Some(i)) if b.shape[i] > 0 => routed as f64 / b.shape[i] as f64,
        _ => 1.0,
    }
}

/// A bitmask of mesh axes (a communication stream per distinct set).
fn axes_key(axes: &[Axis]) -> u8 {
    axes.iter().fold(0u8, |k, a| {
        k | match a {
            Axis::Tp => 1,
            Axis::Cp => 2,
            Axis::Ep => 4,
            Axis::Dp => 8,
            Axis::Pp => 16,
            Axis::Fbd => 32,
            Axis::Edp => 64,
        }
    })
}

fn axes_label(axes: &[Axis]) -> String {
    let mut v: Vec<&str> = axes.iter().map(|a| a.as_str()).collect();
    v.sort_unstable();
    v.join("+")
}

/// How one instruction runs.
enum Work {
    /// On the compute stream.
    Compute(f64),
    /// A collective on the stream of `axes`.
    Collective { time: f64, axes: Vec<Axis> },
    /// No kernel (a view).
    Nothing,
}

struct Ctx<'a> {
    plan: &'a Plan,
    cost: &'a CostModel,
    groups: BTreeMap<u8, Group>,
}

fn buf(plan: &Plan, id: u32) -> Result<&Buffer, SimError> {
    plan.buffers.get(id as usize).ok_or_else(|| {
        SimError::new(format!(
            "malformed plan: buffer {id} does not exist ({} buffers)",
            plan.buffers.len()
        ))
    })
}

impl<'a> Ctx<'a> {
    fn group(&mut self, axes: &[Axis]) -> Group {
        let key = axes_key(axes);
        let gpn = self.cost.cluster.gpus_per_node;
        let mesh = &self.plan.mesh;
        *self
            .groups
            .entry(key)
            .or_insert_with(|| Group::of_mesh(mesh, axes, gpn))
    }

    /// The cost of one kernel (model costs).
    fn work(&mut self, instr: &Instr) -> Result<Work, SimError> {
        let cost = self.cost;
        let plan: &'a Plan = self.plan;
        let (op, inputs, outputs) = match instr {
            Instr::Zero { buffer } => {
                return Ok(Work::Compute(cost.memory(bytes(buf(plan, *buffer)?))))
            }
            // Pipeline transfers are timed by the pipeline simulation, not per kernel.
            Instr::Send { .. } | Instr::Recv { .. } => return Ok(Work::Nothing),
            Instr::Kernel {
                op,
                inputs,
                outputs,
                ..
            } => (op, inputs, outputs),
        };
        // MoE token rows: kernels compute on, and all-to-alls move, only the routed rows.
        let bytes = |b: &Buffer| bytes(b) * fill(b);
        let rows = |b: &Buffer| rows(b) * fill(b);
        let ins: Vec<&Buffer> = inputs
            .iter()
            .map(|&b| buf(plan, b))
            .collect::<Result<_, _>>()?;
        let outs: Vec<&Buffer> = outputs
            .iter()
            .map(|&b| buf(plan, b))
            .collect::<Result<_, _>>()?;
        let in_bytes: f64 = ins.iter().map(|b| bytes(b)).sum();
        let out_bytes: f64 = outs.iter().map(|b| bytes(b)).sum();
        let need = |n: usize, m: usize| -> Result<(), SimError> {
            if ins.len() < n || outs.len() < m {
                Err(SimError::new(format!(
                    "malformed plan: {} takes {n} input(s) and {m} output(s), has {} and {}",
                    op.name(),
                    ins.len(),
                    outs.len()
                )))
            } else {
                Ok(())
            }
        };
        // Accumulating gradient kernels read and write their parameter-gradient outputs.
        let grad_out: f64 = outs
            .iter()
            .filter(|b| b.class == BufferClass::Grad)
            .map(|b| bytes(b))
            .sum();
        let dtype = |b: &Buffer| {
            if b.dtype == DType::I32 {
                DType::F32
            } else {
                b.dtype
            }
        };
        let t = match op {
            _ if op.is_view() => return Ok(Work::Nothing),
            OpKind::Linear { .. } => {
                need(2, 1)?;
                let (x, y) = (ins[0], outs[0]);
                cost.matmul(
                    rows(x),
                    last_dim(y),
                    last_dim(x),
                    in_bytes + out_bytes,
                    dtype(x),
                )
            }
            OpKind::LinearGradInput { .. } => {
                need(2, 1)?;
                let (dy, dx) = (ins[0], outs[0]);
                cost.matmul(
                    rows(dy),
                    last_dim(dx),
                    last_dim(dy),
                    in_bytes + out_bytes,
                    dtype(dy),
                )
            }
            OpKind::LinearGradWeight { .. } => {
                need(2, 1)?;
                let (x, dy) = (ins[0], ins[1]);
                cost.matmul(
                    last_dim(dy),
                    last_dim(x),
                    rows(x),
                    in_bytes + out_bytes + grad_out,
                    dtype(x),
                )
            }
            OpKind::CausalAttention { .. } | OpKind::AttentionGrad { .. } => {
                need(3, 1)?;
                let (q, k, v) = (ins[0], ins[1], ins[2]);
                let (b, sq, heads, d) = match q.shape[..] {
                    [b, s, h, d] => (b as f64, s as f64, h as f64, d as f64),
                    _ => (1.0, rows(q), 1.0, last_dim(q)),
                };
                // A sequence sharded over cp attends to the keys of every cp rank.
                let split = op.implicit_collective().filter(|c| c.applies(&q.layout));
                let group = if let Some(c) = split {
                    self.group(&[c.axis])
                } else {
                    Group {
                        size: 1,
                        per_node: 1,
                    }
                };
                let skv_local = if k.shape.len() == 4 {
                    k.shape[1] as f64
                } else {
                    sq
                };
                let skv = skv_local * group.size as f64;
                // A sliding window keeps a share of the (query, key) pairs.
                let window = match op {
                    OpKind::CausalAttention { window } | OpKind::AttentionGrad { window } => {
                        (*window > 0).then_some(*window)
                    }
                    _ => None,
                };
                let fwd = 2.0
                    * b
                    * sq
                    * skv
                    * heads
                    * d
                    * megac_ir::flops::window_fraction(skv as u64, window);
                let backward = matches!(op, OpKind::AttentionGrad { .. });
                let flops = if backward { 2.5 * fwd } else { fwd };
                let ring = plan.cp_comm == megac_ir::spec::CpComm::Ring;
                let n = if ring { group.size as f64 } else { 1.0 };
                let kernel = n * cost.attention(
                    flops / n,
                    q.len() as f64,
                    (in_bytes + out_bytes) / n,
                    backward,
                    dtype(q),
                );
                kernel + cost.cp_exchange(bytes(k) + bytes(v), group, ring, backward, kernel)
            }
            OpKind::Embedding => {
                need(2, 1)?;
                cost.memory(bytes(ins[0]) + 2.0 * out_bytes)
            }
            OpKind::EmbeddingGrad => {
                need(3, 1)?;
                cost.memory(bytes(ins[0]) + 2.0 * bytes(ins[2]))
            }
            OpKind::PosEmbedding => {
                need(2, 1)?;
                cost.memory(3.0 * bytes(ins[0]))
            }
            OpKind::PosEmbeddingGrad => {
                need(2, 1)?;
                cost.memory(bytes(ins[1]) + 2.0 * out_bytes)
            }
            OpKind::AllReduce { axes } | OpKind::ReduceScatter { axes, .. } => {
                need(1, 1)?;
                let g = self.group(axes);
                let coll = if matches!(op, OpKind::AllReduce { .. }) {
                    Coll::AllReduce
                } else {
                    Coll::ReduceScatter
                };
                return Ok(Work::Collective {
                    time: cost.collective(coll, bytes(ins[0]), g),
                    axes: axes.clone(),
                });
            }
            OpKind::AllGather { axes, .. } => {
                need(1, 1)?;
                let g = self.group(axes);
                return Ok(Work::Collective {
                    time: cost.collective(Coll::AllGather, bytes(outs[0]), g),
                    axes: axes.clone(),
                });
            }
            OpKind::AllToAll { axes, .. } => {
                need(2, 1)?;
                let g = self.group(axes);
                // The token rows bound for the other members (every expert buffer full).
                let n = g.size.max(1) as f64;
                return Ok(Work::Collective {
                    time: cost.collective(Coll::AllToAll, bytes(ins[0]) * (n - 1.0) / n, g),
                    axes: axes.clone(),
                });
            }
            OpKind::GradNorm { axes } => {
                let g = self.group(axes);
                cost.memory(in_bytes) + cost.collective(Coll::AllReduce, 4.0, g)
            }
            OpKind::CrossEntropy => {
                need(2, 1)?;
                // Vocab-parallel: each token's max and sum of logits are all-reduced over tp.
                let logits = ins[0];
                let mut t = cost.memory(in_bytes + out_bytes);
                if let Some(axes) = logits.layout.last().filter(|a| !a.is_empty()) {
                    let g = self.group(axes);
                    t += 2.0
                        * cost.collective(Coll::AllReduce, rows(logits) * 4.0, g)
                        * (1.0 - cost.params().tp_comm_overlap);
                }
                t
            }
            OpKind::AdamW { .. } => {
                // Reads p, g, m, v; writes p, m, v.
                let scalar: f64 = ins.iter().filter(|b| b.len() <= 1).map(|b| bytes(b)).sum();
                let moments: f64 = outs.iter().skip(1).map(|b| bytes(b)).sum();
                cost.memory(in_bytes - scalar + out_bytes + moments)
            }
            _ => cost.memory(in_bytes + out_bytes + grad_out),
        };
        Ok(Work::Compute(t))
    }
}

/// A collective still running: when it ends and which arena ranges it touches.
struct InFlight {
    end: f64,
    ranges: Vec<(BufferClass, u64, u64)>,
}

/// Byte ranges of buffers in their arenas (a buffer's offset counts its own dtype's elements).
fn ranges(plan: &Plan, ids: &[u32]) -> Vec<(BufferClass, u64, u64)> {
    ids.iter()
        .filter_map(|&b| plan.buffers.get(b as usize))
        .map(|b| {
            let size = b.dtype.size_bytes();
            (b.class, b.offset * size, (b.offset + b.len()) * size)
        })
        .collect()
}

fn overlaps(a: &[(BufferClass, u64, u64)], b: &[(BufferClass, u64, u64)]) -> bool {
    a.iter()
        .any(|x| b.iter().any(|y| x.0 == y.0 && x.1 < y.2 && y.1 < x.2))
}

fn instr_buffers(i: &Instr) -> Vec<u32> {
    i.buffers()
}

/// Peak bytes of simultaneously live activation buffers in one micro-batch program.
fn activation_live_bytes(plan: &Plan, program: &[Instr]) -> u64 {
    let n = program.len();
    let mut first: BTreeMap<u32, usize> = BTreeMap::new();
    let mut last: BTreeMap<u32, usize> = BTreeMap::new();
    for (t, i) in program.iter().enumerate() {
        for b in instr_buffers(i) {
            if plan.buffers.get(b as usize).map(|x| x.class) == Some(BufferClass::Activation) {
                first.entry(b).or_insert(t);
                last.insert(b, t);
            }
        }
    }
    let mut delta = vec![0i128; n + 1];
    for (b, &s) in &first {
        let size = plan.buffers[*b as usize].len() * plan.buffers[*b as usize].dtype.size_bytes();
        delta[s] += size as i128;
        delta[last[b] + 1] -= size as i128;
    }
    let (mut cur, mut peak) = (0i128, 0i128);
    for d in delta {
        cur += d;
        peak = peak.max(cur);
    }
    peak.max(0) as u64
}

/// Trace stream names.
pub fn stream_names() -> BTreeMap<u32, String> {
    let mut m = BTreeMap::new();
    m.insert(0, "compute".to_string());
    m.insert(99, "micro-batches".to_string());
    m
}

/// Trace stream of micro-batch and pipeline-action spans.
const PHASE_STREAM: u32 = 99;

fn stream_id(key: u8) -> u32 {
    1 + key as u32
}

/// A simulated step: the report and, when asked for, the timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// The numbers.
    pub report: SimReport,
    /// The timeline (empty without `trace`).
    pub events: Vec<TraceEvent>,
    /// Names of the timeline's streams, by id.
    pub streams: BTreeMap<u32, String>,
}

/// Simulate one step of `plan` on the cluster of `cost` (sized for the plan). With
/// `trace`, also return the timeline (every kernel of the first and last micro-batch and of
/// the optimizer, plus one span per micro-batch) and the names of its streams.
pub fn simulate(plan: &Plan, cost: &CostModel, trace: bool) -> Result<Simulation, SimError> {
    let world = plan.mesh.world_size();
    if plan.rank_to_role.len() != world {
        return Err(SimError::new(format!(
            "malformed plan: rank_to_role has {} entries for a mesh of {world} ranks",
            plan.rank_to_role.len()
        )));
    }
    if plan.roles.is_empty() {
        return Err(SimError::new("malformed plan: no roles"));
    }
    if let Some(&r) = plan
        .rank_to_role
        .iter()
        .find(|&&r| r as usize >= plan.roles.len())
    {
        return Err(SimError::new(format!(
            "malformed plan: rank_to_role names role {r}, but there are {} roles",
            plan.roles.len()
        )));
    }
    let mut ctx = Ctx {
        plan,
        cost,
        groups: BTreeMap::new(),
    };
    let mut events = Vec::new();
    let mut names = stream_names();
    let mut roles = Vec::new();
    let mut bubble_fraction = 0.0;
    let mut pipeline_execution = None;
    let mut pipeline_phase = None;
    if plan.roles.iter().any(|r| r.pipeline.is_some()) {
        let p = pipeline::simulate_pipeline(&mut ctx, trace, &mut events, &mut names)?;
        roles = p.roles;
        bubble_fraction = p.bubble_fraction;
        pipeline_execution = Some(p.execution.to_string());
        pipeline_phase = p.phase;
    } else {
        for (ri, role) in plan.roles.iter().enumerate() {
            let ranks = plan
                .rank_to_role
                .iter()
                .filter(|&&r| r as usize == ri)
                .count();
            let rep = simulate_role(&mut ctx, ri, role, ranks, trace, &mut events, &mut names)?;
            roles.push(rep);
        }
    }
    let step = roles.iter().map(|r| r.step_seconds).fold(0.0, f64::max);
    let dtype = match plan.train.precision.as_str() {
        "bf16" => DType::Bf16,
        "fp16" => DType::F16,
        _ => DType::F32,
    };
    let peak = cost.peak(dtype);
    let peak_memory_bytes = plan
        .rank_to_role
        .iter()
        .map(|&r| roles[r as usize].memory_bytes)
        .collect();
    let report = SimReport {
        step_seconds: step,
        tokens_per_s: if step > 0.0 {
            plan.batch.tokens_per_step as f64 / step
        } else {
            0.0
        },
        mfu: if step > 0.0 {
            plan.flops_per_step / (step * world as f64 * peak)
        } else {
            0.0
        },
        bubble_fraction,
        pipeline_execution,
        pipeline_phase,
        peak_memory_bytes,
        roles,
        world,
    };
    Ok(Simulation {
        report,
        events,
        streams: names,
    })
}

#[allow(clippy::too_many_arguments)]
fn simulate_role(
    ctx: &mut Ctx,
    ri: usize,
    role: &Role,
    ranks: usize,
    trace: bool,
    events: &mut Vec<TraceEvent>,
    names: &mut BTreeMap<u32, String>,
) -> Result<RoleReport, SimError> {
    let plan = ctx.plan;
    let cost = ctx.cost;
    let params = cost.params().clone();
    let unit = cost.mode == CostMode::Unit;
    let m = plan.batch.microbatches.max(1);
    let mb = &role.microbatch;
    let bstart = backward_start(mb);

    // Precompute the work and phase of every instruction once.
    let phase_of = |i: usize, instr: &Instr| -> Phase {
        if i < bstart {
            return Phase::Forward;
        }
        match instr {
            Instr::Kernel {
                op: OpKind::LinearGradWeight { .. } | OpKind::BiasGrad,
                ..
            } => Phase::WeightGrad,
            _ => Phase::Backward,
        }
    };
    let mut mb_work = Vec::with_capacity(mb.len());
    for instr in mb {
        mb_work.push(ctx.work(instr)?);
    }
    let mut opt_work = Vec::with_capacity(role.optimizer.len());
    for instr in &role.optimizer {
        opt_work.push(ctx.work(instr)?);
    }
    if unit {
        // F, B and W of a micro-batch take 1 each, spread over their kernels.
        let mut counts = [0usize; 3];
        for (i, (instr, w)) in mb.iter().zip(&mb_work).enumerate() {
            if matches!(w, Work::Compute(_)) && !matches!(instr, Instr::Zero { .. }) {
                match phase_of(i, instr) {
                    Phase::Forward => counts[0] += 1,
                    Phase::Backward => counts[1] += 1,
                    Phase::WeightGrad => counts[2] += 1,
                }
            }
        }
        for (i, (instr, w)) in mb.iter().zip(mb_work.iter_mut()).enumerate() {
            *w = match w {
                Work::Compute(_) if !matches!(instr, Instr::Zero { .. }) => {
                    let n = match phase_of(i, instr) {
                        Phase::Forward => counts[0],
                        Phase::Backward => counts[1],
                        Phase::WeightGrad => counts[2],
                    };
                    Work::Compute(if n > 0 { 1.0 / n as f64 } else { 0.0 })
                }
                Work::Collective { axes, .. } => Work::Collective {
                    time: 0.0,
                    axes: axes.clone(),
                },
                _ => Work::Compute(0.0),
            };
        }
        for w in opt_work.iter_mut() {
            *w = match w {
                Work::Collective { axes, .. } => Work::Collective {
                    time: 0.0,
                    axes: axes.clone(),
                },
                _ => Work::Compute(0.0),
            };
        }
    }
    let mb_ranges: Vec<(Ranges, Ranges)> = mb
        .iter()
        .map(|i| match i {
            Instr::Zero { buffer } | Instr::Recv { buffer, .. } => {
                (Vec::new(), ranges(plan, &[*buffer]))
            }
            Instr::Send { buffer, .. } => (ranges(plan, &[*buffer]), Vec::new()),
            Instr::Kernel {
                inputs, outputs, ..
            } => (ranges(plan, inputs), ranges(plan, outputs)),
        })
        .collect();
    let opt_ranges: Vec<_> = role
        .optimizer
        .iter()
        .map(|i| match i {
            Instr::Zero { buffer } | Instr::Recv { buffer, .. } => {
                (Vec::new(), ranges(plan, &[*buffer]))
            }
            Instr::Send { buffer, .. } => (ranges(plan, &[*buffer]), Vec::new()),
            Instr::Kernel {
                inputs, outputs, ..
            } => (ranges(plan, inputs), ranges(plan, outputs)),
        })
        .collect();

    let mut st = RoleSim::new(ri, bstart, trace, m, &params);
    let mut fwd_window = f64::INFINITY;
    let mut first_mb = 0.0f64;
    for k in 0..m {
        let start = st.compute_free;
        let (bwd, fwd) = st.run(mb, &mb_work, &mb_ranges, false, k, events, names);
        st.bwd_start_last = bwd;
        fwd_window = fwd_window.min(fwd);
        if k == 0 {
            first_mb = st.compute_free - start;
        }
        if trace {
            events.push(TraceEvent {
                name: format!("micro-batch {k}"),
                detail: "forward".into(),
                start,
                dur: bwd - start,
                role: ri,
                stream: 99,
            });
            events.push(TraceEvent {
                name: format!("micro-batch {k}"),
                detail: "backward".into(),
                start: bwd,
                dur: st.compute_free - bwd,
                role: ri,
                stream: 99,
            });
        }
    }
    let opt_start = st.compute_free;
    st.run(
        &role.optimizer,
        &opt_work,
        &opt_ranges,
        true,
        m,
        events,
        names,
    );
    let opt_seconds = st.compute_free - opt_start;
    let mut end = st.compute_free;
    for c in &st.inflight {
        end = end.max(c.end);
    }
    if st.deferred_end > 0.0 {
        let window = if fwd_window.is_finite() {
            fwd_window
        } else {
            0.0
        };
        end = end.max(st.deferred_end - window);
    }
    Ok(RoleReport {
        name: role.name.clone(),
        ranks,
        step_seconds: end,
        compute_seconds: st.busy,
        exposed_comm_seconds: st.waited + (end - st.compute_free).max(0.0),
        comm_seconds: st.comm_total,
        microbatch_seconds: first_mb,
        optimizer_seconds: opt_seconds,
        kernels: st.kernels,
        memory_bytes: plan.memory.total(),
        activation_live_bytes: activation_live_bytes(plan, mb),
        stage: None,
        bubble_fraction: 0.0,
        peak_inflight: 1,
    })
}

type Ranges = Vec<(BufferClass, u64, u64)>;

/// The state of one role's simulation.
struct RoleSim {
    ri: usize,
    bstart: usize,
    trace: bool,
    m: u64,
    tp_overlap: f64,
    dp_overlap: bool,
    compute_free: f64,
    busy: f64,
    waited: f64,
    streams: BTreeMap<u8, f64>,
    comm_total: BTreeMap<String, f64>,
    inflight: Vec<InFlight>,
    kernels: u64,
    bwd_start_last: f64,
    /// Pipelines: when each chunk's gradients are final (see [`RoleSim::grads_final`]).
    grad_ready: Vec<(Ranges, f64)>,
    deferred_end: f64,
}

impl RoleSim {
    /// A fresh simulation of role `ri` (`bstart`: the first backward instruction of the
    /// micro-batch program, `usize::MAX` for pipelines), with the cost model's overlaps.
    fn new(
        ri: usize,
        bstart: usize,
        trace: bool,
        m: u64,
        params: &crate::cost::CostParams,
    ) -> Self {
        RoleSim {
            ri,
            bstart,
            trace,
            m,
            tp_overlap: params.tp_comm_overlap,
            dp_overlap: params.dp_comm_overlap,
            compute_free: 0.0,
            busy: 0.0,
            waited: 0.0,
            streams: BTreeMap::new(),
            comm_total: BTreeMap::new(),
            inflight: Vec::new(),
            kernels: 0,
            bwd_start_last: 0.0,
            grad_ready: Vec::new(),
            deferred_end: 0.0,
        }
    }

    fn detail(&self, k: u64, in_optimizer: bool) -> bool {
        self.trace && (in_optimizer || k == 0 || k + 1 == self.m || self.m <= 4)
    }

    /// Run `program` once (micro-batch `k`, or the optimizer); returns the start of its
    /// backward and the forward's duration.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        program: &[Instr],
        work: &[Work],
        rng: &[(Ranges, Ranges)],
        in_optimizer: bool,
        k: u64,
        events: &mut Vec<TraceEvent>,
        names: &mut BTreeMap<u32, String>,
    ) -> (f64, f64) {
        let start = self.compute_free;
        let mut bwd = start;
        let detail = self.detail(k, in_optimizer);
        for (i, (instr, w)) in program.iter().zip(work).enumerate() {
            if !in_optimizer && i == self.bstart {
                bwd = self.compute_free;
            }
            self.exec(instr, w, &rng[i], in_optimizer, detail, events, names);
        }
        (bwd, if in_optimizer { 0.0 } else { bwd - start })
    }

    /// When the gradients in `ins` are final, for a data-parallel reduction that overlaps
    /// the backward: the start of the last backward that writes them (pipelines, per chunk),
    /// else the start of the last micro-batch's backward.
    fn grads_final(&self, ins: &Ranges) -> f64 {
        self.grad_ready
            .iter()
            .filter(|(r, _)| overlaps(r, ins))
            .map(|(_, t)| *t)
            .reduce(f64::max)
            .unwrap_or(self.bwd_start_last)
    }

    /// Run one instruction whose work is `w` and whose (read, written) arena ranges are
    /// `rng`; with `detail`, record it in the timeline.
    #[allow(clippy::too_many_arguments)]
    fn exec(
        &mut self,
        instr: &Instr,
        w: &Work,
        rng: &(Ranges, Ranges),
        in_optimizer: bool,
        detail: bool,
        events: &mut Vec<TraceEvent>,
        names: &mut BTreeMap<u32, String>,
    ) {
        let (ins, outs) = rng;
        let path = match instr {
            Instr::Kernel { path, .. } => path.as_str(),
            _ => "",
        };
        match w {
            Work::Nothing => {}
            Work::Compute(t) => {
                let now = self.compute_free;
                self.inflight.retain(|c| c.end > now);
                let mut ready = now;
                for c in &self.inflight {
                    if overlaps(&c.ranges, ins) || overlaps(&c.ranges, outs) {
                        ready = ready.max(c.end);
                    }
                }
                self.waited += ready - now;
                if detail {
                    events.push(TraceEvent {
                        name: instr_name(instr),
                        detail: path.to_string(),
                        start: ready,
                        dur: *t,
                        role: self.ri,
                        stream: 0,
                    });
                }
                self.compute_free = ready + t;
                self.busy += t;
                self.kernels += 1;
            }
            Work::Collective { time, axes } => {
                let key = axes_key(axes);
                let is_dp = axes.contains(&Axis::Dp);
                let layer = !is_dp && !axes.contains(&Axis::Pp);
                let mut dur = *time;
                if layer && !in_optimizer {
                    dur *= 1.0 - self.tp_overlap;
                }
                *self.comm_total.entry(axes_label(axes)).or_insert(0.0) += time;
                let free = self.streams.get(&key).copied().unwrap_or(0.0);
                let reads_grads = ins.iter().any(|r| r.0 == BufferClass::Grad);
                let writes_params = outs.iter().any(|r| r.0 == BufferClass::Param);
                let overlap_dp = in_optimizer && is_dp && self.dp_overlap;
                let after = if overlap_dp && reads_grads {
                    self.grads_final(ins)
                } else {
                    self.compute_free
                };
                let now = self.compute_free;
                self.inflight.retain(|c| c.end > now.min(after));
                let mut s = free.max(after);
                for c in &self.inflight {
                    if overlaps(&c.ranges, ins) || overlaps(&c.ranges, outs) {
                        s = s.max(c.end);
                    }
                }
                let end = s + dur;
                self.streams.insert(key, end);
                self.kernels += 1;
                if detail {
                    names
                        .entry(stream_id(key))
                        .or_insert_with(|| format!("comm {}", axes_label(axes)));
                    events.push(TraceEvent {
                        name: instr_name(instr),
                        detail: path.to_string(),
                        start: s,
                        dur,
                        role: self.ri,
                        stream: stream_id(key),
                    });
                }
                if overlap_dp && writes_params {
                    // The parameter gather overlaps the next step's first forward.
                    self.deferred_end = self.deferred_end.max(end);
                } else {
                    let mut r = ins.clone();
                    r.extend(outs.iter().copied());
                    self.inflight.push(InFlight { end, ranges: r });
                }
            }
        }
    }
}

fn instr_name(i: &Instr) -> String {
    match i {
        Instr::Zero { .. } => "zero".into(),
        Instr::Send { .. } => "send".into(),
        Instr::Recv { .. } => "recv".into(),
        Instr::Kernel { op, .. } => op.name().into(),
    }
}
