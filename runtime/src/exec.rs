//! The executor: runs a role's programs on the cpu backend, one kernel call per instruction.

use megac_ir::plan::{BufId, Instr, Plan};
use megac_ir::{OpKind, WeightLayout};
use megac_kernels as k;

use crate::comm::Communicator;
use crate::error::RuntimeError;
use crate::memory::Memory;
pub use crate::profile::{Profile, TraceEvent};
use crate::sharded::{
    cp_positions, gather_member_major, gather_seq, real_columns, ring_pass, scatter_member_major,
    vocab_parallel_stats, vocab_shard,
};

/// What the optimizer program needs to know about the current step.
pub struct StepContext {
    /// 1-based optimizer step (AdamW's bias correction).
    pub step: u64,
    /// Learning rate of this step.
    pub lr: f64,
    /// The micro-batch a pipeline segment runs (tags its transfers).
    pub microbatch: u64,
}

fn layout(w: WeightLayout) -> k::WeightLayout {
    match w {
        WeightLayout::OutIn => k::WeightLayout::OutIn,
        WeightLayout::InOut => k::WeightLayout::InOut,
    }
}

fn arity(
    op: &OpKind,
    ins: &[BufId],
    outs: &[BufId],
    n_in: usize,
    n_out: usize,
) -> Result<(), RuntimeError> {
    if ins.len() == n_in && outs.len() == n_out {
        Ok(())
    } else {
        Err(RuntimeError::Plan(format!(
            "`{}` takes {n_in} inputs and {n_out} outputs, the plan gives {} and {}",
            op.name(),
            ins.len(),
            outs.len()
        )))
    }
}

/// Fail early, before any allocation, if the plan uses a kernel this backend lacks.
pub fn check_supported(plan: &Plan) -> Result<(), RuntimeError> {
    for role in &plan.roles {
        for instr in role.microbatch.iter().chain(&role.optimizer) {
            if let Instr::Kernel { op, .. } = instr {
                if matches!(op, OpKind::Cast { to } if *to != megac_ir::DType::F32) {
                    return Err(RuntimeError::Unsupported(
                        "precision = \"bf16\" plans need bf16 kernels, which the cpu backend does not have yet; compile with train.precision = \"fp32\"".into(),
                    ));
                }
            }
        }
    }
    Ok(())
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
    for instr in program {
        let t0 = profile.as_ref().map(|_| std::time::Instant::now());
        let name = match instr {
            Instr::Zero { buffer } => {
                mem.f32_mut(*buffer).fill(0.0);
                "zero"
            }
            Instr::Kernel {
                op,
                inputs,
                outputs,
                ..
            } => {
                run_kernel(op, inputs, outputs, &env, comm)?;
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
                if matches!(instr, Instr::Send { .. }) {
                    comm.send_tagged(peer, tag, mem.f32(*buffer))?;
                    "send"
                } else {
                    comm.recv_tagged(peer, tag, mem.f32_mut(*buffer))?;
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
    let (mem, tokens, ctx, mesh) = (env.mem, env.tokens, env.ctx, env.mesh);
    let group = |axes: &[megac_ir::Axis], rank: usize| -> Vec<usize> {
        if axes.is_empty() {
            vec![rank]
        } else {
            mesh.group(rank, axes)
        }
    };
    let shape = |b: BufId| mem.buffer(b).shape.clone();
    let last = |b: BufId| *mem.buffer(b).shape.last().unwrap_or(&1) as usize;
    let numel = |b: BufId| mem.buffer(b).len() as usize;
    // Matrices in a (weight) buffer: its leading dim for stacked experts `[experts, .., ..]`.
    let experts_of = |b: BufId| {
        let s = &mem.buffer(b).shape;
        if s.len() == 3 {
            (s[0] as usize).max(1)
        } else {
            1
        }
    };
    let dims4 = |b: BufId| -> Result<[usize; 4], RuntimeError> {
        let s = shape(b);
        if s.len() == 4 {
            Ok([s[0] as usize, s[1] as usize, s[2] as usize, s[3] as usize])
        } else {
            Err(RuntimeError::Plan(format!(
                "`{}` needs 4-d operands",
                op.name()
            )))
        }
    };
    match op {
        OpKind::Embedding => {
            arity(op, ins, outs, 2, 1)?;
            match vocab_shard(mem, ins[1], 0, mesh, comm.rank()) {
                None => k::embedding_fwd(
                    mem.i32(ins[0]),
                    mem.f32(ins[1]),
                    last(ins[1]),
                    mem.f32_mut(outs[0]),
                ),
                Some((start, rows)) => {
                    // Vocab-parallel: rows outside this rank's slice contribute zero.
                    let (ids, table, out) =
                        (mem.i32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
                    let h = last(ins[1]);
                    for (&id, row) in ids.iter().zip(out.chunks_exact_mut(h)) {
                        let local = id as i64 - start as i64;
                        if (0..rows as i64).contains(&local) {
                            let l = local as usize;
                            row.copy_from_slice(&table[l * h..(l + 1) * h]);
                        } else {
                            row.fill(0.0);
                        }
                    }
                }
            }
        }
        OpKind::PosEmbedding => {
            arity(op, ins, outs, 2, 1)?;
            let s = shape(ins[0]);
            let (b, sl, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None => k::pos_embedding_fwd(
                    mem.f32(ins[0]),
                    mem.f32(ins[1]),
                    b,
                    sl,
                    h,
                    mem.f32_mut(outs[0]),
                ),
                Some(pos) => {
                    let (x, wpe, y) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
                    for bi in 0..b {
                        for (i, &p) in pos.local.iter().enumerate() {
                            let at = (bi * sl + i) * h;
                            let w = &wpe[p as usize * h..(p as usize + 1) * h];
                            k::add_fwd(&x[at..at + h], w, &mut y[at..at + h]);
                        }
                    }
                }
            }
        }
        OpKind::Linear { weight } => {
            if ins.len() != 2 && ins.len() != 3 {
                return arity(op, ins, outs, 2, 1);
            }
            let (kk, n) = (last(ins[0]), last(outs[0]));
            // Stacked experts: one matrix per expert, over that expert's rows.
            let g = experts_of(ins[1]);
            let m = numel(ins[0]) / kk.max(1) / g;
            let bias = ins.get(2).map(|&b| mem.f32(b));
            let (x, w, y) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            for ((x, w), y) in x
                .chunks_exact(m * kk)
                .zip(w.chunks_exact(kk * n))
                .zip(y.chunks_exact_mut(m * n))
            {
                k::linear_fwd(x, w, bias, y, m, kk, n, layout(*weight));
            }
        }
        OpKind::RmsNorm { eps } => {
            arity(op, ins, outs, 2, 1)?;
            let h = last(ins[0]);
            k::rms_norm_fwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                *eps as f32,
                numel(ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::LayerNorm { eps } => {
            arity(op, ins, outs, 3, 1)?;
            let h = last(ins[0]);
            k::layer_norm_fwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                *eps as f32,
                numel(ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::Split { n } => {
            arity(op, ins, outs, 1, *n as usize)?;
            let (x, width) = (mem.f32(ins[0]), last(ins[0]));
            let d = width / *n as usize;
            for (p, &o) in outs.iter().enumerate() {
                let y = mem.f32_mut(o);
                for (row, dst) in y.chunks_exact_mut(d).enumerate() {
                    dst.copy_from_slice(&x[row * width + p * d..row * width + (p + 1) * d]);
                }
            }
        }
        OpKind::Concat => {
            arity(op, ins, outs, ins.len(), 1)?;
            let y = mem.f32_mut(outs[0]);
            let width = last(outs[0]);
            let d = width / ins.len().max(1);
            for (p, &i) in ins.iter().enumerate() {
                for (row, src) in mem.f32(i).chunks_exact(d).enumerate() {
                    y[row * width + p * d..row * width + (p + 1) * d].copy_from_slice(src);
                }
            }
        }
        OpKind::Rope { theta } | OpKind::RopeGrad { theta } => {
            arity(op, ins, outs, 1, 1)?;
            let [b, s, nh, d] = dims4(ins[0])?;
            let fwd = matches!(op, OpKind::Rope { .. });
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None if fwd => k::rope_fwd(
                    mem.f32(ins[0]),
                    b,
                    s,
                    nh,
                    d,
                    *theta as f32,
                    mem.f32_mut(outs[0]),
                ),
                None => k::rope_bwd(
                    mem.f32(ins[0]),
                    b,
                    s,
                    nh,
                    d,
                    *theta as f32,
                    mem.f32_mut(outs[0]),
                ),
                // Context parallelism: the local tokens sit at their chunks' global positions.
                Some(pos) if fwd => k::context::rope_fwd_positions(
                    mem.f32(ins[0]),
                    b,
                    s,
                    nh,
                    d,
                    *theta as f32,
                    &pos.local,
                    mem.f32_mut(outs[0]),
                ),
                Some(pos) => k::context::rope_bwd_positions(
                    mem.f32(ins[0]),
                    b,
                    s,
                    nh,
                    d,
                    *theta as f32,
                    &pos.local,
                    mem.f32_mut(outs[0]),
                ),
            }
        }
        OpKind::CausalAttention => {
            arity(op, ins, outs, 3, 2)?;
            let [b, s, nh, d] = dims4(ins[0])?;
            let nkv = dims4(ins[1])?[2];
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None => k::attention_fwd(
                    mem.f32(ins[0]),
                    mem.f32(ins[1]),
                    mem.f32(ins[2]),
                    b,
                    s,
                    nh,
                    nkv,
                    d,
                    mem.f32_mut(outs[0]),
                    mem.f32_mut(outs[1]),
                ),
                Some(pos) if env.cp_comm == megac_ir::spec::CpComm::AllGather => {
                    // Context parallelism, all-gather variant: every rank gathers the
                    // sequence's keys and values and attends its local queries by global
                    // position.
                    let block = s * nkv * d;
                    let kk = gather_seq(comm, &pos.group, mem.f32(ins[1]), b, block)?;
                    let vv = gather_seq(comm, &pos.group, mem.f32(ins[2]), b, block)?;
                    k::context::attention_block_fwd(
                        mem.f32(ins[0]),
                        &kk,
                        &vv,
                        &pos.local,
                        &pos.all,
                        b,
                        s,
                        s * pos.group.len(),
                        nh,
                        nkv,
                        d,
                        mem.f32_mut(outs[0]),
                        mem.f32_mut(outs[1]),
                    );
                }
                Some(pos) => {
                    // Ring variant: each rank's K/V block travels around the cp ring; every
                    // rank attends its queries to each block as it passes and merges the
                    // partial results by log-sum-exp.
                    let n = pos.group.len();
                    let me = pos.me;
                    let mut kb = mem.f32(ins[1]).to_vec();
                    let mut vb = mem.f32(ins[2]).to_vec();
                    let (out, lse) = (mem.f32_mut(outs[0]), mem.f32_mut(outs[1]));
                    let q = mem.f32(ins[0]);
                    let mut part_out = vec![0f32; out.len()];
                    let mut part_lse = vec![0f32; lse.len()];
                    for step in 0..n {
                        let owner = (me + n - step) % n;
                        let k_pos = &pos.all[owner * s..(owner + 1) * s];
                        if step == 0 {
                            k::context::attention_block_fwd(
                                q, &kb, &vb, &pos.local, k_pos, b, s, s, nh, nkv, d, out, lse,
                            );
                        } else {
                            k::context::attention_block_fwd(
                                q,
                                &kb,
                                &vb,
                                &pos.local,
                                k_pos,
                                b,
                                s,
                                s,
                                nh,
                                nkv,
                                d,
                                &mut part_out,
                                &mut part_lse,
                            );
                            k::context::attention_merge_into(
                                out, lse, &part_out, &part_lse, b, s, nh, d,
                            );
                        }
                        if step + 1 < n {
                            ring_pass(comm, &pos.group, me, &mut [&mut kb, &mut vb])?;
                        }
                    }
                }
            }
        }
        OpKind::Cast { .. } => {
            arity(op, ins, outs, 1, 1)?;
            mem.f32_mut(outs[0]).copy_from_slice(mem.f32(ins[0]));
        }
        OpKind::Add => {
            arity(op, ins, outs, 2, 1)?;
            k::add_fwd(mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
        }
        OpKind::RepeatKv { n } | OpKind::RepeatKvGrad { n } => {
            arity(op, ins, outs, 1, 1)?;
            let n = *n as usize;
            let d = last(ins[0]);
            let (x, y) = (mem.f32(ins[0]), mem.f32_mut(outs[0]));
            if matches!(op, OpKind::RepeatKv { .. }) {
                // Each kv head's row of d values is written n times in a row.
                for (src, dst) in x.chunks_exact(d).zip(y.chunks_exact_mut(d * n)) {
                    for rep in dst.chunks_exact_mut(d) {
                        rep.copy_from_slice(src);
                    }
                }
            } else {
                for (src, dst) in x.chunks_exact(d * n).zip(y.chunks_exact_mut(d)) {
                    for rep in src.chunks_exact(d) {
                        k::accumulate(dst, rep);
                    }
                }
            }
        }
        OpKind::BiasAdd => {
            arity(op, ins, outs, 2, 1)?;
            let (x, b, y) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            let n = b.len();
            for (yr, xr) in y.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
                k::add_fwd(xr, b, yr);
            }
        }
        OpKind::GradSum => {
            // Two contributions (autodiff), or one added into a gradient (the pipeline's
            // tied-parameter reduction).
            let n = ins.len().clamp(1, 2);
            arity(op, ins, outs, n, 1)?;
            let y = mem.f32_mut(outs[0]);
            for &x in ins {
                k::accumulate(y, mem.f32(x));
            }
        }
        OpKind::SwiGlu => {
            arity(op, ins, outs, 2, 1)?;
            k::swiglu_fwd(mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
        }
        OpKind::GeluTanh => {
            arity(op, ins, outs, 1, 1)?;
            k::gelu_tanh_fwd(mem.f32(ins[0]), mem.f32_mut(outs[0]));
        }
        OpKind::CrossEntropy => {
            arity(op, ins, outs, 2, 1)?;
            let v = last(ins[0]);
            let rank_dims = mem.buffer(ins[0]).shape.len();
            let sum = match vocab_shard(mem, ins[0], rank_dims - 1, mesh, comm.rank()) {
                None => {
                    k::cross_entropy_fwd(mem.f32(ins[0]), mem.i32(ins[1]), numel(ins[0]) / v, v)
                }
                Some((start, _)) => {
                    let members = mesh.group(comm.rank(), &[megac_ir::Axis::Tp]);
                    let stats = vocab_parallel_stats(
                        mem.f32(ins[0]),
                        mem.i32(ins[1]),
                        v,
                        start,
                        env.vocab,
                        &members,
                        comm,
                    )?;
                    stats.iter().map(|s| f64::from(s.lse - s.target)).sum()
                }
            };
            mem.f32_mut(outs[0])[0] = (sum / tokens) as f32;
        }
        OpKind::EmbeddingGrad => {
            arity(op, ins, outs, 3, 1)?;
            match vocab_shard(mem, ins[1], 0, mesh, comm.rank()) {
                None => k::embedding_bwd(
                    mem.i32(ins[0]),
                    mem.f32(ins[2]),
                    last(ins[1]),
                    mem.f32_mut(outs[0]),
                ),
                Some((start, rows)) => {
                    let (ids, dy, dt) = (mem.i32(ins[0]), mem.f32(ins[2]), mem.f32_mut(outs[0]));
                    let h = last(ins[1]);
                    for (&id, row) in ids.iter().zip(dy.chunks_exact(h)) {
                        let local = id as i64 - start as i64;
                        if (0..rows as i64).contains(&local) {
                            let l = local as usize;
                            k::accumulate(&mut dt[l * h..(l + 1) * h], row);
                        }
                    }
                }
            }
        }
        OpKind::PosEmbeddingGrad => {
            arity(op, ins, outs, 2, 1)?;
            let s = shape(ins[1]);
            let (b, sl, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let (dy, dwpe) = (mem.f32(ins[1]), mem.f32_mut(outs[0]));
            match cp_positions(mem, ins[1], 1, mesh, comm.rank()) {
                None => {
                    for bi in 0..b {
                        k::accumulate(&mut dwpe[..sl * h], &dy[bi * sl * h..(bi + 1) * sl * h]);
                    }
                }
                Some(pos) => {
                    for bi in 0..b {
                        for (i, &p) in pos.local.iter().enumerate() {
                            let at = (bi * sl + i) * h;
                            k::accumulate(
                                &mut dwpe[p as usize * h..(p as usize + 1) * h],
                                &dy[at..at + h],
                            );
                        }
                    }
                }
            }
        }
        OpKind::LinearGradInput { weight } => {
            arity(op, ins, outs, 2, 1)?;
            let (n, kk) = (last(ins[0]), last(outs[0]));
            let g = experts_of(ins[1]);
            let m = numel(ins[0]) / n.max(1) / g;
            let (dy, w, dx) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            for ((dy, w), dx) in dy
                .chunks_exact(m * n)
                .zip(w.chunks_exact(kk * n))
                .zip(dx.chunks_exact_mut(m * kk))
            {
                k::linear_bwd_data(dy, w, dx, m, kk, n, layout(*weight));
            }
        }
        OpKind::LinearGradWeight { weight } => {
            arity(op, ins, outs, 2, 1)?;
            let (kk, n) = (last(ins[0]), last(ins[1]));
            let g = experts_of(outs[0]);
            let m = numel(ins[0]) / kk.max(1) / g;
            let (x, dy, dw) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
            for ((x, dy), dw) in x
                .chunks_exact(m * kk)
                .zip(dy.chunks_exact(m * n))
                .zip(dw.chunks_exact_mut(kk * n))
            {
                k::linear_bwd_weight(x, dy, dw, None, m, kk, n, layout(*weight));
            }
        }
        OpKind::BiasGrad => {
            arity(op, ins, outs, 1, 1)?;
            let n = last(ins[0]);
            let db = mem.f32_mut(outs[0]);
            for row in mem.f32(ins[0]).chunks_exact(n) {
                k::accumulate(db, row);
            }
        }
        OpKind::RmsNormGrad { eps } => {
            arity(op, ins, outs, 3, 2)?;
            let h = last(ins[0]);
            k::rms_norm_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                *eps as f32,
                numel(ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
            );
        }
        OpKind::LayerNormGrad { eps } => {
            arity(op, ins, outs, 3, 3)?;
            let h = last(ins[0]);
            k::layer_norm_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                *eps as f32,
                numel(ins[0]) / h,
                h,
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
                mem.f32_mut(outs[2]),
            );
        }
        OpKind::AttentionGrad => {
            arity(op, ins, outs, 6, 3)?;
            let [b, s, nh, d] = dims4(ins[0])?;
            let nkv = dims4(ins[1])?[2];
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None => k::attention_bwd(
                    mem.f32(ins[0]),
                    mem.f32(ins[1]),
                    mem.f32(ins[2]),
                    mem.f32(ins[3]),
                    mem.f32(ins[4]),
                    mem.f32(ins[5]),
                    b,
                    s,
                    nh,
                    nkv,
                    d,
                    mem.f32_mut(outs[0]),
                    mem.f32_mut(outs[1]),
                    mem.f32_mut(outs[2]),
                ),
                Some(pos) if env.cp_comm == megac_ir::spec::CpComm::AllGather => {
                    // Gather K and V again, accumulate their gradients for the whole
                    // sequence, and send each rank the sum for its own chunks.
                    let n = pos.group.len();
                    let block = s * nkv * d;
                    let kk = gather_seq(comm, &pos.group, mem.f32(ins[1]), b, block)?;
                    let vv = gather_seq(comm, &pos.group, mem.f32(ins[2]), b, block)?;
                    let mut dk_all = vec![0f32; kk.len()];
                    let mut dv_all = vec![0f32; vv.len()];
                    k::context::attention_block_bwd(
                        mem.f32(ins[0]),
                        &kk,
                        &vv,
                        mem.f32(ins[3]),
                        mem.f32(ins[4]),
                        mem.f32(ins[5]),
                        &pos.local,
                        &pos.all,
                        b,
                        s,
                        s * n,
                        nh,
                        nkv,
                        d,
                        mem.f32_mut(outs[0]),
                        &mut dk_all,
                        &mut dv_all,
                    );
                    for (all, out) in [(dk_all, outs[1]), (dv_all, outs[2])] {
                        let mut member_major = vec![0f32; all.len()];
                        gather_member_major(&all, &mut member_major, n, b, block);
                        let mut mine = vec![0f32; b * block];
                        comm.reduce_scatter_sum(&pos.group, &member_major, &mut mine)?;
                        k::accumulate(mem.f32_mut(out), &mine);
                    }
                }
                Some(pos) => {
                    // Ring variant: K, V and their gradient accumulators travel together; each
                    // rank adds its queries' share for every block (with the final lse), and
                    // after a full turn every accumulator is back with its block's owner.
                    let n = pos.group.len();
                    let me = pos.me;
                    let mut kb = mem.f32(ins[1]).to_vec();
                    let mut vb = mem.f32(ins[2]).to_vec();
                    let mut dkb = vec![0f32; kb.len()];
                    let mut dvb = vec![0f32; vb.len()];
                    let (q, out, lse, dout) = (
                        mem.f32(ins[0]),
                        mem.f32(ins[3]),
                        mem.f32(ins[4]),
                        mem.f32(ins[5]),
                    );
                    let dq = mem.f32_mut(outs[0]);
                    for step in 0..n {
                        let owner = (me + n - step) % n;
                        let k_pos = &pos.all[owner * s..(owner + 1) * s];
                        k::context::attention_block_bwd(
                            q, &kb, &vb, out, lse, dout, &pos.local, k_pos, b, s, s, nh, nkv, d,
                            dq, &mut dkb, &mut dvb,
                        );
                        ring_pass(
                            comm,
                            &pos.group,
                            me,
                            &mut [&mut kb, &mut vb, &mut dkb, &mut dvb],
                        )?;
                    }
                    k::accumulate(mem.f32_mut(outs[1]), &dkb);
                    k::accumulate(mem.f32_mut(outs[2]), &dvb);
                }
            }
        }
        OpKind::SwiGluGrad => {
            arity(op, ins, outs, 3, 2)?;
            k::swiglu_bwd(
                mem.f32(ins[0]),
                mem.f32(ins[1]),
                mem.f32(ins[2]),
                mem.f32_mut(outs[0]),
                mem.f32_mut(outs[1]),
            );
        }
        OpKind::GeluTanhGrad => {
            arity(op, ins, outs, 2, 1)?;
            k::gelu_tanh_bwd(mem.f32(ins[0]), mem.f32(ins[1]), mem.f32_mut(outs[0]));
        }
        OpKind::CrossEntropyGrad => {
            arity(op, ins, outs, 2, 1)?;
            let v = last(ins[0]);
            let rank_dims = mem.buffer(ins[0]).shape.len();
            if let Some((start, _)) = vocab_shard(mem, ins[0], rank_dims - 1, mesh, comm.rank()) {
                let members = mesh.group(comm.rank(), &[megac_ir::Axis::Tp]);
                let (logits, labels) = (mem.f32(ins[0]), mem.i32(ins[1]));
                let stats =
                    vocab_parallel_stats(logits, labels, v, start, env.vocab, &members, comm)?;
                let real = real_columns(v, start, env.vocab);
                let scale = (1.0 / tokens) as f32;
                let dl = mem.f32_mut(outs[0]);
                for (row, ((x, d), st)) in logits
                    .chunks_exact(v)
                    .zip(dl.chunks_exact_mut(v))
                    .zip(&stats)
                    .enumerate()
                {
                    for (j, (&xj, dj)) in x[..real].iter().zip(d.iter_mut()).enumerate() {
                        *dj += scale * (xj - st.lse).exp();
                        if labels[row] as i64 - start as i64 == j as i64 {
                            *dj -= scale;
                        }
                    }
                }
                return Ok(());
            }
            k::cross_entropy_bwd(
                mem.f32(ins[0]),
                mem.i32(ins[1]),
                numel(ins[0]) / v,
                v,
                (1.0 / tokens) as f32,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::GradNorm { .. } => {
            if outs.len() != 1 {
                return arity(op, ins, outs, ins.len(), 1);
            }
            // Each rank sums the squares of the gradient elements it owns; the norm is global.
            let OpKind::GradNorm { axes } = op else {
                unreachable!()
            };
            let members = group(axes, comm.rank());
            // Each member's squares count once per group of members that hold the same
            // elements: a gradient replicated over some of the axes is divided by their size.
            // Pipeline stages hold disjoint gradients: `pp` never replicates. A buffer split
            // over both ep and edp (the distributed optimizer's expert shards) is unique over
            // dp·cp, which the two fold over.
            let mut total = [ins
                .iter()
                .map(|&g| {
                    let layout = &mem.buffer(g).layout;
                    let has = |a: megac_ir::Axis| layout.iter().any(|d| d.contains(&a));
                    let folded = has(megac_ir::Axis::Ep) && has(megac_ir::Axis::Edp);
                    let replicas: u64 = axes
                        .iter()
                        .filter(|&&a| a != megac_ir::Axis::Pp)
                        .filter(|&&a| {
                            !(has(a)
                                || folded && matches!(a, megac_ir::Axis::Dp | megac_ir::Axis::Cp))
                        })
                        .map(|&a| mesh.size(a))
                        .product();
                    k::sum_squares(mem.f32(g)) / replicas as f64
                })
                .sum::<f64>()];
            comm.all_reduce_sum_f64(&members, &mut total)?;
            mem.f32_mut(outs[0])[0] = total[0].sqrt() as f32;
        }
        OpKind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            max_norm,
            ..
        } => {
            arity(op, ins, outs, 3, 3)?;
            let norm = mem.f32(ins[2])[0];
            let g = mem.f32_mut(ins[1]);
            if *max_norm > 0.0 {
                // torch.nn.utils.clip_grad_norm_: multiply by min(1, max_norm / (norm + 1e-6)).
                let coef = (*max_norm as f32) / (norm + 1e-6);
                if coef < 1.0 {
                    k::scale_in_place(g, coef);
                }
            }
            let hp = k::AdamW {
                lr: ctx.lr as f32,
                beta1: *beta1 as f32,
                beta2: *beta2 as f32,
                eps: *eps as f32,
                weight_decay: *weight_decay as f32,
            };
            k::adamw_step(
                mem.f32_mut(outs[0]),
                g,
                mem.f32_mut(outs[1]),
                mem.f32_mut(outs[2]),
                &hp,
                ctx.step,
            );
        }
        OpKind::AllReduce { axes } => {
            arity(op, ins, outs, 1, 1)?;
            if ins[0] != outs[0] {
                mem.f32_mut(outs[0]).copy_from_slice(mem.f32(ins[0]));
            }
            let members = group(axes, comm.rank());
            comm.all_reduce_sum(&members, mem.f32_mut(outs[0]))?;
        }
        OpKind::Slice { axes, dim } => {
            arity(op, ins, outs, 1, 1)?;
            let members = group(axes, comm.rank());
            let me = members.iter().position(|&r| r == comm.rank()).unwrap_or(0);
            let s = shape(outs[0]);
            let d = *dim as usize;
            let outer: usize = s[..d].iter().map(|&x| x as usize).product();
            let block: usize = s[d..].iter().map(|&x| x as usize).product();
            let (x, y) = (mem.f32(ins[0]), mem.f32_mut(outs[0]));
            let n = members.len();
            for o in 0..outer {
                let from = (o * n + me) * block;
                y[o * block..(o + 1) * block].copy_from_slice(&x[from..from + block]);
            }
        }
        OpKind::AllGather { axes, dim } | OpKind::ReduceScatter { axes, dim } => {
            arity(op, ins, outs, 1, 1)?;
            let members = group(axes, comm.rank());
            let n = members.len();
            let gather = matches!(op, OpKind::AllGather { .. });
            // The sharded side's shape: [outer, local, inner] around `dim`.
            let local_buf = if gather { ins[0] } else { outs[0] };
            let s = shape(local_buf);
            let d = *dim as usize;
            if d >= s.len() {
                return Err(RuntimeError::Plan(format!(
                    "`{}` over dim {d} of a {}-d buffer",
                    op.name(),
                    s.len()
                )));
            }
            let outer: usize = s[..d].iter().map(|&x| x as usize).product();
            let local = s[d] as usize;
            let inner: usize = s[d + 1..].iter().map(|&x| x as usize).product();
            let chunk = outer * local * inner;
            if gather {
                // Copy first: the input may lie inside the output (a rank's own shard).
                let send = mem.f32(ins[0]).to_vec();
                let mut member_major = vec![0.0f32; chunk * n];
                comm.all_gather(&members, &send, &mut member_major)?;
                let y = mem.f32_mut(outs[0]);
                scatter_member_major(&member_major, y, n, outer, local * inner);
            } else {
                let x = mem.f32(ins[0]);
                let mut member_major = vec![0.0f32; chunk * n];
                gather_member_major(x, &mut member_major, n, outer, local * inner);
                comm.reduce_scatter_sum(&members, &member_major, mem.f32_mut(outs[0]))?;
            }
        }
        OpKind::SplitHeads { .. } | OpKind::MergeHeads => {
            return Err(RuntimeError::Plan(format!(
                "`{}` is a view and never an instruction",
                op.name()
            )))
        }
        OpKind::Router { top_k } | OpKind::RouterGrad { top_k } => {
            let e = last(ins[0]);
            let t = numel(ins[0]) / e;
            let k_ = *top_k as usize;
            if matches!(op, OpKind::Router { .. }) {
                arity(op, ins, outs, 1, 2)?;
                k::router_fwd(
                    mem.f32(ins[0]),
                    t,
                    e,
                    k_,
                    mem.f32_mut(outs[0]),
                    mem.i32_act_mut(outs[1]),
                );
            } else {
                arity(op, ins, outs, 2, 1)?;
                // The selection is recomputed from the logits (it is deterministic).
                let mut w = vec![0f32; t * k_];
                let mut idx = vec![0i32; t * k_];
                k::router_fwd(mem.f32(ins[0]), t, e, k_, &mut w, &mut idx);
                k::router_bwd(
                    mem.f32(ins[0]),
                    t,
                    e,
                    k_,
                    &idx,
                    mem.f32(ins[1]),
                    mem.f32_mut(outs[0]),
                );
            }
        }
        OpKind::MoeAuxLoss { coeff } | OpKind::MoeAuxLossGrad { coeff } => {
            arity(op, ins, outs, 2, 1)?;
            let e = last(ins[0]);
            let t = numel(ins[0]) / e;
            let top_k = last(ins[1]);
            // Per micro-batch, as Megatron: the step's loss averages the micro-batches of
            // every data-parallel rank (tokens per step / tokens per micro-batch of them).
            let share = t as f64 / tokens;
            // Context parallelism: the micro-batch's tokens are spread over the cp group, so
            // the token statistics are summed over it (as Megatron does over tp·cp); each
            // rank reports its tokens' share of the loss, and the gradient of the whole
            // micro-batch's loss reaches every rank's tokens.
            let split = op
                .implicit_collective()
                .filter(|c| c.applies(&mem.buffer(ins[c.operand]).layout));
            if let Some(c) = split {
                let members = group(&[c.axis], comm.rank());
                let (logits, idx) = (mem.f32(ins[0]), mem.i32(ins[1]));
                let mut stats = k::moe::moe_aux_stats(logits, t, e, top_k, idx);
                comm.all_reduce_sum_f64(&members, stats.as_mut_slice())?;
                if matches!(op, OpKind::MoeAuxLoss { .. }) {
                    let l = k::moe::moe_aux_loss_from_stats(&stats, top_k, *coeff);
                    mem.f32_mut(outs[0])[0] = (l * share) as f32;
                } else {
                    let scale = share * members.len() as f64;
                    k::moe::moe_aux_loss_bwd_from_stats(
                        logits,
                        t,
                        e,
                        top_k,
                        &stats,
                        *coeff,
                        scale as f32,
                        mem.f32_mut(outs[0]),
                    );
                }
                return Ok(());
            }
            if matches!(op, OpKind::MoeAuxLoss { .. }) {
                let l = k::moe_aux_loss_fwd(mem.f32(ins[0]), t, e, top_k, mem.i32(ins[1]), *coeff);
                mem.f32_mut(outs[0])[0] = (l * share) as f32;
            } else {
                k::moe_aux_loss_bwd(
                    mem.f32(ins[0]),
                    t,
                    e,
                    mem.i32(ins[1]),
                    top_k,
                    *coeff,
                    share as f32,
                    mem.f32_mut(outs[0]),
                );
            }
        }
        OpKind::Dispatch { expert, .. } => {
            arity(op, ins, outs, 2, 1)?;
            let rows = shape(outs[0])[0] as usize;
            let h = last(ins[0]);
            let experts = 1 + (*expert as usize).max(max_index(mem.i32(ins[1])));
            let r = routing(mem, ins[1], experts, rows);
            let out = mem.f32_mut(outs[0]);
            out.fill(0.0);
            k::moe::dispatch_fwd_routed(mem.f32(ins[0]), &r, *expert as usize, h, out);
        }
        OpKind::DispatchGrad { expert } => {
            arity(op, ins, outs, 2, 1)?;
            let rows = shape(ins[0])[0] as usize;
            let h = last(ins[0]);
            let experts = 1 + (*expert as usize).max(max_index(mem.i32(ins[1])));
            let r = routing(mem, ins[1], experts, rows);
            k::moe::dispatch_bwd(
                mem.f32(ins[0]),
                &r,
                *expert as usize,
                h,
                mem.f32_mut(outs[0]),
            );
        }
        OpKind::DispatchExperts { experts, .. } => {
            arity(op, ins, outs, 2, 2)?;
            let s = shape(outs[0]);
            let (e, rows, h) = (*experts as usize, s[1] as usize, s[2] as usize);
            let r = routing(mem, ins[1], e, rows);
            let out = mem.f32_mut(outs[0]);
            out.fill(0.0);
            for (ex, block) in out.chunks_exact_mut(rows * h).enumerate() {
                k::moe::dispatch_fwd_routed(mem.f32(ins[0]), &r, ex, h, block);
            }
            for (ex, c) in mem.i32_act_mut(outs[1]).iter_mut().enumerate() {
                *c = r.count(ex) as i32;
            }
        }
        OpKind::DispatchExpertsGrad => {
            arity(op, ins, outs, 2, 1)?;
            let s = shape(ins[0]);
            let (e, rows, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let r = routing(mem, ins[1], e, rows);
            let (dy, dx) = (mem.f32(ins[0]), mem.f32_mut(outs[0]));
            for (ex, block) in dy.chunks_exact(rows * h).enumerate() {
                k::moe::dispatch_bwd(block, &r, ex, h, dx);
            }
        }
        OpKind::CombineExperts => {
            arity(op, ins, outs, 3, 1)?;
            let s = shape(ins[2]);
            let (e, rows, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let ys: Vec<&[f32]> = mem.f32(ins[2]).chunks_exact(rows * h).collect();
            let r = routing(mem, ins[1], e, rows);
            let t = numel(outs[0]) / h;
            k::moe::combine_fwd(mem.f32(ins[0]), &r, &ys, t, h, mem.f32_mut(outs[0]));
        }
        OpKind::CombineExpertsGrad => {
            arity(op, ins, outs, 4, 2)?;
            let s = shape(ins[2]);
            let (e, rows, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let ys: Vec<&[f32]> = mem.f32(ins[2]).chunks_exact(rows * h).collect();
            let r = routing(mem, ins[1], e, rows);
            let mut dys: Vec<&mut [f32]> =
                mem.f32_mut(outs[1]).chunks_exact_mut(rows * h).collect();
            k::moe::combine_bwd(
                mem.f32(ins[0]),
                &r,
                &ys,
                mem.f32(ins[3]),
                h,
                mem.f32_mut(outs[0]),
                &mut dys,
            );
        }
        OpKind::AllToAll {
            axes,
            split,
            concat,
        } => {
            arity(op, ins, outs, 2, 1)?;
            let (xs, ys) = (shape(ins[0]), shape(outs[0]));
            if xs.len() != 3 || ys.len() != 3 || xs[2] != ys[2] || split == concat {
                return Err(RuntimeError::Plan(format!(
                    "`all_to_all` moves [experts, tokens, h] buffers, the plan gives {xs:?} -> {ys:?}"
                )));
            }
            let members = group(axes, comm.rank());
            crate::sharded::expert_all_to_all(
                comm,
                &members,
                mem.i32(ins[1]),
                mem.f32(ins[0]),
                xs[1] as usize,
                mem.f32_mut(outs[0]),
                ys[1] as usize,
                xs[2] as usize,
                *split == 0,
            )?;
        }
        OpKind::Combine => {
            if ins.len() < 3 || outs.len() != 1 {
                return arity(op, ins, outs, 3, 1);
            }
            let ys: Vec<&[f32]> = ins[2..].iter().map(|&y| mem.f32(y)).collect();
            let rows = shape(ins[2])[0] as usize;
            let h = last(outs[0]);
            let r = routing(mem, ins[1], ys.len(), rows);
            let t = numel(outs[0]) / h;
            k::moe::combine_fwd(mem.f32(ins[0]), &r, &ys, t, h, mem.f32_mut(outs[0]));
        }
        OpKind::CombineGrad => {
            let experts = ins.len().saturating_sub(3);
            if experts == 0 || outs.len() != experts + 1 {
                return arity(op, ins, outs, 4, 2);
            }
            let ys: Vec<&[f32]> = ins[2..2 + experts].iter().map(|&y| mem.f32(y)).collect();
            let rows = shape(ins[2])[0] as usize;
            let dout = mem.f32(ins[2 + experts]);
            let h = last(ins[2 + experts]);
            let r = routing(mem, ins[1], experts, rows);
            let mut dys: Vec<&mut [f32]> = outs[1..].iter().map(|&o| mem.f32_mut(o)).collect();
            k::moe::combine_bwd(
                mem.f32(ins[0]),
                &r,
                &ys,
                dout,
                h,
                mem.f32_mut(outs[0]),
                &mut dys,
            );
        }
    }
    Ok(())
}
