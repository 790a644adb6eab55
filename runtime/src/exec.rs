//! The executor: runs a role's programs on the cpu backend, one kernel call per instruction.
//! `run_kernel` checks an instruction's arity (from `OpKind::kernel_arity`) and hands it to
//! its op family's module.

mod attention;
mod collective;
mod dense;
mod moe;
mod optim;
mod scope;

use megac_ir::plan::{BufId, Instr, Plan};
use megac_ir::{OpKind, WeightLayout};
use megac_kernels as k;

use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::memory::Memory;
pub use crate::profile::{Profile, TraceEvent};
use crate::sharded::{
    cp_positions, gather_member_major, gather_seq, real_columns, ring_pass, scatter_member_major,
    tp_split, vocab_parallel_stats,
};

/// What the optimizer program needs to know about the current step.
pub struct StepContext {
    /// 1-based optimizer step (AdamW's bias correction).
    pub step: u64,
    /// Learning rate of this step.
    pub lr: f64,
    /// The micro-batch a pipeline segment runs (tags its transfers).
    pub microbatch: u64,
    /// fp16's loss scale (1 otherwise): the loss gradient is multiplied by it, the gradient
    /// norm and the gradients divided by it.
    pub loss_scale: f64,
}

fn layout(w: WeightLayout) -> k::WeightLayout {
    match w {
        WeightLayout::OutIn => k::WeightLayout::OutIn,
        WeightLayout::InOut => k::WeightLayout::InOut,
    }
}

/// The routing of a layer's tokens to experts, rebuilt from the router's indices; expert
/// buffers with fewer rows than tokens hold at most that many (the capacity).
fn routing(mem: &Memory, indices: BufId, experts: usize, rows: usize) -> k::moe::Routing {
    let shape = &mem.buffer(indices).shape;
    let top_k = *shape.last().unwrap_or(&1) as usize;
    let t = mem.buffer(indices).len() as usize / top_k.max(1);
    let capacity = if rows < t { rows } else { 0 };
    k::moe::Routing::new(mem.i32(indices), t, top_k, experts, capacity)
}

/// Run `program` over `mem`. `tokens_per_step` scales the loss and its gradient (the mean is
/// over the global batch); `ctx` is used by optimizer instructions.
pub fn run_program(
    program: &[Instr],
    plan: &megac_ir::gate::CheckedPlan,
    mem: &Memory,
    ctx: &StepContext,
    comm: &mut dyn Communicator,
    mut profile: Option<&mut Profile>,
) -> Result<(), RuntimeError> {
    let env = Env {
        mem,
        cp_comm: plan.cp_comm,
        vocab: plan.batch.vocab as usize,
        tokens: plan.batch.tokens_per_step as f64,
        ctx,
        mesh: &plan.mesh,
    };
    // Fused groups (`crate::fusion`): one compiled kernel runs a group's instructions.
    let fused = mem.fused().program(program);
    let mut skip = 0;
    for (index, instr) in program.iter().enumerate() {
        if skip > 0 {
            skip -= 1;
            continue;
        }
        // Sends this rank started move on while it computes (`Communicator::progress`).
        comm.progress();
        let t0 = profile.as_ref().map(|_| std::time::Instant::now());
        if let Some(call) = fused.and_then(|f| f[index].as_ref()) {
            call.run(mem, ctx)?;
            skip = call.len - 1;
            if let (Some(p), Some(t0)) = (profile.as_deref_mut(), t0) {
                let secs = t0.elapsed().as_secs_f64();
                let e = p.by_op.entry("fused").or_default();
                e.0 += secs;
                e.2 += 1;
                if let Some(events) = p.events.as_mut() {
                    events.push(TraceEvent {
                        name: "fused",
                        path: match instr {
                            Instr::Kernel { path, .. } => path.clone(),
                            _ => String::new(),
                        },
                        start_s: t0.duration_since(p.origin).as_secs_f64(),
                        seconds: secs,
                    });
                }
            }
            continue;
        }
        let name = match instr {
            Instr::Zero { buffer } => {
                mem.zero(*buffer);
                "zero"
            }
            Instr::Kernel {
                op,
                inputs,
                outputs,
                ..
            } => {
                mem.debug_assert_disjoint(op, inputs, outputs);
                // Mixed precision: 16-bit operands are widened for the f32 kernel and its
                // 16-bit outputs rounded once afterwards.
                let staged = mem.stage(inputs, outputs);
                let result = run_kernel(op, inputs, outputs, &env, comm);
                if staged {
                    mem.unstage(outputs);
                }
                result?;
                op.name()
            }
            Instr::Send {
                buffer,
                chunk,
                transfer,
                twin,
            }
            | Instr::Recv {
                buffer,
                chunk,
                transfer,
                twin,
            } => {
                let (peer, tag) = transfer_peer(plan, comm.rank(), *chunk, *transfer, *twin, ctx);
                // A 16-bit activation travels widened to f32 (exact both ways): a send reads
                // the buffer, a recv writes it.
                let one = std::slice::from_ref(buffer);
                let send = matches!(instr, Instr::Send { .. });
                let (read, written) = if send { (one, &[][..]) } else { (&[][..], one) };
                let staged = mem.stage(read, written);
                let result = if send {
                    comm.send_tagged(peer, tag, mem.f32(*buffer))
                } else {
                    comm.recv_tagged(peer, tag, mem.f32_mut(*buffer))
                };
                if staged {
                    mem.unstage(written);
                }
                result?;
                if send {
                    "send"
                } else {
                    "recv"
                }
            }
        };
        if let (Some(p), Some(t0)) = (profile.as_deref_mut(), t0) {
            let flops = match instr {
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    ..
                } => matmul_flops(op, inputs, outputs, mem),
                _ => 0.0,
            };
            let secs = t0.elapsed().as_secs_f64();
            let e = p.by_op.entry(name).or_default();
            e.0 += secs;
            e.1 += flops;
            e.2 += 1;
            if let Some(events) = p.events.as_mut() {
                let path = match instr {
                    Instr::Kernel { path, .. } => path.clone(),
                    _ => String::new(),
                };
                events.push(TraceEvent {
                    name,
                    path,
                    start_s: t0.duration_since(p.origin).as_secs_f64(),
                    seconds: secs,
                });
            }
        }
    }
    Ok(())
}

/// The peer rank and message tag of a pipeline transfer: the rank with this rank's
/// coordinates that holds `chunk` (or, for `twin`, this rank's FBD twin), and a tag unique
/// per (transfer, micro-batch).
pub fn transfer_peer(
    plan: &Plan,
    rank: usize,
    chunk: u32,
    transfer: u32,
    twin: bool,
    ctx: &StepContext,
) -> (usize, u64) {
    let peer = plan.mesh.transfer_peer(rank, chunk, twin);
    let tag = u64::from(transfer) * plan.batch.microbatches.max(1) + ctx.microbatch;
    (peer, tag)
}

/// The largest expert index in `indices`.
fn max_index(indices: &[i32]) -> usize {
    indices.iter().copied().max().unwrap_or(0).max(0) as usize
}

/// FLOPs of the matmul inside `op` (2·m·k·n), 0 for other ops.
fn matmul_flops(op: &OpKind, ins: &[BufId], outs: &[BufId], mem: &Memory) -> f64 {
    let numel = |b: BufId| mem.buffer(b).len() as f64;
    let last = |b: BufId| *mem.buffer(b).shape.last().unwrap_or(&1) as f64;
    match op {
        // x[m,k] · w -> y[m,n]: 2·numel(x)·n
        OpKind::Linear { .. } => 2.0 * numel(ins[0]) * last(outs[0]),
        // dy[m,n] · w -> dx[m,k]: 2·numel(dy)·k
        OpKind::LinearGradInput { .. } => 2.0 * numel(ins[0]) * last(outs[0]),
        // xᵀ · dy -> dw: 2·numel(x)·n
        OpKind::LinearGradWeight { .. } => 2.0 * numel(ins[0]) * last(ins[1]),
        _ => 0.0,
    }
}

/// What a kernel call may use besides its buffers.
struct Env<'a> {
    mem: &'a Memory,
    /// How context-parallel attention exchanges K/V.
    cp_comm: megac_ir::spec::CpComm,
    /// The model's real vocabulary (padding columns beyond it are ignored by the loss).
    vocab: usize,
    /// Tokens per step: the loss is a mean over these.
    tokens: f64,
    ctx: &'a StepContext,
    mesh: &'a megac_ir::Mesh,
}

fn run_kernel(
    op: &OpKind,
    ins: &[BufId],
    outs: &[BufId],
    env: &Env,
    comm: &mut dyn Communicator,
) -> Result<(), RuntimeError> {
    let want = op.kernel_arity(ins.len());
    if !want.accepts(ins.len(), outs.len()) {
        return Err(RuntimeError::Plan(format!(
            "`{}` takes {} inputs and {} outputs, the plan gives {} and {}",
            op.name(),
            want.inputs_near(ins.len()),
            want.outputs,
            ins.len(),
            outs.len()
        )));
    }
    match op {
        OpKind::Embedding
        | OpKind::PosEmbedding
        | OpKind::PosEmbeddingAt
        | OpKind::Linear { .. }
        | OpKind::RmsNorm { .. }
        | OpKind::LayerNorm { .. }
        | OpKind::Split { .. }
        | OpKind::Concat
        | OpKind::Cast { .. }
        | OpKind::Add
        | OpKind::BiasAdd
        | OpKind::GradSum
        | OpKind::SwiGlu
        | OpKind::SigmoidMul
        | OpKind::GeluTanh
        | OpKind::CrossEntropy
        | OpKind::EmbeddingGrad
        | OpKind::PosEmbeddingGrad
        | OpKind::LinearGradInput { .. }
        | OpKind::LinearGradWeight { .. }
        | OpKind::BiasGrad
        | OpKind::RmsNormGrad { .. }
        | OpKind::LayerNormGrad { .. }
        | OpKind::SwiGluGrad
        | OpKind::SigmoidMulGrad
        | OpKind::GeluTanhGrad
        | OpKind::CrossEntropyGrad => dense::run(op, ins, outs, env, comm),
        OpKind::Rope { .. }
        | OpKind::RopeGrad { .. }
        | OpKind::CausalAttention { .. }
        | OpKind::RopeAt { .. }
        | OpKind::KvAttention { .. }
        | OpKind::AttentionGrad { .. }
        | OpKind::RepeatKv { .. }
        | OpKind::RepeatKvGrad { .. } => attention::run(op, ins, outs, env, comm),
        OpKind::Router { .. }
        | OpKind::RouterGrad { .. }
        | OpKind::MoeAuxLoss { .. }
        | OpKind::MoeAuxLossGrad { .. }
        | OpKind::Dispatch { .. }
        | OpKind::DispatchGrad { .. }
        | OpKind::DispatchExperts { .. }
        | OpKind::DispatchExpertsGrad
        | OpKind::CombineExperts
        | OpKind::CombineExpertsGrad
        | OpKind::Combine
        | OpKind::CombineGrad => moe::run(op, ins, outs, env, comm),
        OpKind::AllReduce { .. }
        | OpKind::Slice { .. }
        | OpKind::AllGather { .. }
        | OpKind::ReduceScatter { .. }
        | OpKind::AllToAll { .. } => collective::run(op, ins, outs, env, comm),
        OpKind::GradNorm { .. } | OpKind::AdamW { .. } => optim::run(op, ins, outs, env, comm),
        OpKind::Probe { .. } | OpKind::Perturb { .. } => scope::run(op, ins, outs, env, comm),
        OpKind::SplitHeads { .. } | OpKind::MergeHeads => Err(RuntimeError::Plan(format!(
            "`{}` is a view and never an instruction",
            op.name()
        ))),
    }
}

/// The dims of buffer `b`.
fn shape(mem: &Memory, b: BufId) -> Vec<u64> {
    mem.buffer(b).shape.clone()
}

/// The last dim of buffer `b` (1 for a scalar).
fn last(mem: &Memory, b: BufId) -> usize {
    *mem.buffer(b).shape.last().unwrap_or(&1) as usize
}

/// The elements of buffer `b`.
fn numel(mem: &Memory, b: BufId) -> usize {
    mem.buffer(b).len() as usize
}

/// Matrices in a (weight) buffer: its leading dim for stacked experts `[experts, .., ..]`.
fn experts_of(mem: &Memory, b: BufId) -> usize {
    let s = &mem.buffer(b).shape;
    if s.len() == 3 {
        (s[0] as usize).max(1)
    } else {
        1
    }
}

/// The four dims of buffer `b`, which `op` needs 4-d.
fn dims4(op: &OpKind, mem: &Memory, b: BufId) -> Result<[usize; 4], RuntimeError> {
    let s = shape(mem, b);
    if s.len() == 4 {
        Ok([s[0] as usize, s[1] as usize, s[2] as usize, s[3] as usize])
    } else {
        Err(RuntimeError::Plan(format!(
            "`{}` needs 4-d operands",
            op.name()
        )))
    }
}

/// The members of `rank`'s group over `axes` (just `rank` when `axes` is empty).
fn group(mesh: &megac_ir::Mesh, axes: &[megac_ir::Axis], rank: usize) -> Vec<usize> {
    if axes.is_empty() {
        vec![rank]
    } else {
        mesh.group(rank, axes)
    }
}
