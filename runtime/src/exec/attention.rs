//! Attention kernels: RoPE, causal attention (ring or all-gather of K/V under context
//! parallelism), `repeat_kv`, and their backward ops.

use super::*;

/// Run one of this family's kernels (`run_kernel` routes only these ops here and has checked
/// their arity).
pub(super) fn run(
    op: &OpKind,
    ins: &[BufId],
    outs: &[BufId],
    env: &Env,
    comm: &mut dyn Communicator,
) -> Result<(), RuntimeError> {
    let (mem, mesh) = (env.mem, env.mesh);
    match op {
        OpKind::Rope { theta, scaling } | OpKind::RopeGrad { theta, scaling } => {
            let [b, s, nh, d] = dims4(op, mem, ins[0])?;
            let inverse = matches!(op, OpKind::RopeGrad { .. });
            let inv_freq = megac_ir::spec::rope_inv_freq(d, *theta, scaling.as_ref());
            // Context parallelism: the local tokens sit at their chunks' global positions.
            let positions = match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None => (0..s as u32).collect(),
                Some(pos) => pos.local,
            };
            k::rope_freq(
                mem.f32(ins[0]),
                b,
                s,
                nh,
                d,
                &inv_freq,
                &positions,
                mem.f32_mut(outs[0]),
                inverse,
            );
        }
        OpKind::RopeAt { theta, scaling } => {
            let [b, s, nh, d] = dims4(op, mem, ins[0])?;
            let inv_freq = megac_ir::spec::rope_inv_freq(d, *theta, scaling.as_ref());
            let positions = step_positions(mem, ins[0], ins[1], mesh, comm.rank());
            k::rope_freq(
                mem.f32(ins[0]),
                b,
                s,
                nh,
                d,
                &inv_freq,
                &positions,
                mem.f32_mut(outs[0]),
                false,
            );
        }
        OpKind::KvAttention { window } => {
            let [b, s, nh, d] = dims4(op, mem, ins[0])?;
            let nkv = dims4(op, mem, ins[1])?[2];
            if b != 1 {
                return Err(RuntimeError::Plan(format!(
                    "`kv_attention` holds one sequence; its block has {b}"
                )));
            }
            let row = nkv * d;
            let cp = mesh.size(megac_ir::Axis::Cp) as usize;
            if cp > 1 {
                return cp_kv_attention(*window, ins, outs, env, comm, [s, nh, nkv, d]);
            }
            let pos = step_positions(mem, ins[0], ins[3], mesh, comm.rank());
            k::kv::cache_write(mem.f32_mut(outs[2]), mem.f32(ins[1]), &pos, row);
            k::kv::cache_write(mem.f32_mut(outs[3]), mem.f32(ins[2]), &pos, row);
            let window = u32::try_from(*window).unwrap_or(u32::MAX);
            let capacity = mem.buffer(outs[2]).shape[0] as usize;
            if pos.first() == Some(&0) && s <= capacity {
                // The prefill (the block at position 0 holds every key it attends): the
                // causal attention of the window plan, so its logits are those of the
                // recomputation bit for bit.
                let (q, kx, vx) = (mem.f32(ins[0]), mem.f32(ins[1]), mem.f32(ins[2]));
                let (out, lse) = (mem.f32_mut(outs[0]), mem.f32_mut(outs[1]));
                if window == 0 {
                    k::attention_fwd(q, kx, vx, 1, s, nh, nkv, d, out, lse);
                } else {
                    k::context::attention_window_fwd(
                        q, kx, vx, &pos, &pos, window, 1, s, s, nh, nkv, d, out, lse,
                    );
                }
            } else {
                let keys = k::kv::cached_keys(&pos, capacity);
                k::kv::cached_attention(
                    mem.f32(ins[0]),
                    mem.f32(outs[2]),
                    mem.f32(outs[3]),
                    &pos,
                    keys,
                    window,
                    nh,
                    nkv,
                    d,
                    mem.f32_mut(outs[0]),
                    mem.f32_mut(outs[1]),
                );
            }
        }
        OpKind::CausalAttention { window } => {
            let [b, s, nh, d] = dims4(op, mem, ins[0])?;
            let nkv = dims4(op, mem, ins[1])?[2];
            // A window at least the sequence long is no window (and fits the kernel's u32).
            let window = u32::try_from(*window).unwrap_or(u32::MAX);
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None if window == 0 => k::attention_fwd(
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
                None => {
                    // Sliding window: the positional mask over positions 0..s.
                    let pos: Vec<u32> = (0..s as u32).collect();
                    k::context::attention_window_fwd(
                        mem.f32(ins[0]),
                        mem.f32(ins[1]),
                        mem.f32(ins[2]),
                        &pos,
                        &pos,
                        window,
                        b,
                        s,
                        s,
                        nh,
                        nkv,
                        d,
                        mem.f32_mut(outs[0]),
                        mem.f32_mut(outs[1]),
                    );
                }
                Some(pos) if env.cp_comm == megac_ir::spec::CpComm::AllGather => {
                    // Context parallelism, all-gather variant: every rank gathers the
                    // sequence's keys and values and attends its local queries by global
                    // position (and window).
                    let block = s * nkv * d;
                    let kk = gather_seq(comm, &pos.group, mem.f32(ins[1]), b, block)?;
                    let vv = gather_seq(comm, &pos.group, mem.f32(ins[2]), b, block)?;
                    k::context::attention_window_fwd(
                        mem.f32(ins[0]),
                        &kk,
                        &vv,
                        &pos.local,
                        &pos.all,
                        window,
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
                    // rank attends its queries to each block as it passes (masked by global
                    // position and window; a block a query cannot see gives lse = -inf) and
                    // merges the partial results by log-sum-exp.
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
                            k::context::attention_window_fwd(
                                q, &kb, &vb, &pos.local, k_pos, window, b, s, s, nh, nkv, d, out,
                                lse,
                            );
                        } else {
                            k::context::attention_window_fwd(
                                q,
                                &kb,
                                &vb,
                                &pos.local,
                                k_pos,
                                window,
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
        OpKind::RepeatKv { n } | OpKind::RepeatKvGrad { n } => {
            let n = *n as usize;
            let d = last(mem, ins[0]);
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
        OpKind::AttentionGrad { window } => {
            let [b, s, nh, d] = dims4(op, mem, ins[0])?;
            let nkv = dims4(op, mem, ins[1])?[2];
            let window = u32::try_from(*window).unwrap_or(u32::MAX);
            match cp_positions(mem, ins[0], 1, mesh, comm.rank()) {
                None if window > 0 => {
                    let pos: Vec<u32> = (0..s as u32).collect();
                    k::context::attention_window_bwd(
                        mem.f32(ins[0]),
                        mem.f32(ins[1]),
                        mem.f32(ins[2]),
                        mem.f32(ins[3]),
                        mem.f32(ins[4]),
                        mem.f32(ins[5]),
                        &pos,
                        &pos,
                        window,
                        b,
                        s,
                        s,
                        nh,
                        nkv,
                        d,
                        mem.f32_mut(outs[0]),
                        mem.f32_mut(outs[1]),
                        mem.f32_mut(outs[2]),
                    );
                }
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
                    k::context::attention_window_bwd(
                        mem.f32(ins[0]),
                        &kk,
                        &vv,
                        mem.f32(ins[3]),
                        mem.f32(ins[4]),
                        mem.f32(ins[5]),
                        &pos.local,
                        &pos.all,
                        window,
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
                        k::context::attention_window_bwd(
                            q, &kb, &vb, out, lse, dout, &pos.local, k_pos, window, b, s, s, nh,
                            nkv, d, dq, &mut dkb, &mut dvb,
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
        _ => unreachable!("run_kernel routes `{}` elsewhere", op.name()),
    }
    Ok(())
}

/// `kv_attention` under context parallelism (cp > 1). Each cp rank's caches hold the
/// positions it holds in the load-balanced layout of the whole window (`seq_len` tokens in
/// 2·cp chunks: rank `m` holds chunks `m` and `2·cp-1-m`), slot `i` for its `i`-th local
/// position, so the cache is `seq_len / cp` rows per rank.
/// - **The prefill** (q split over cp: the window plan's attention): the window's own cp
///   attention (ring or all-gather, so the prompt's logits are the recomputation's bit for
///   bit), then each local row's keys and values into its slot (local row `i` is slot `i`).
/// - **The decode step** (q not split over cp: every cp rank runs the same one-token block):
///   the rank owning a block row's position writes its keys and values into its slot; every
///   rank attends the block's queries over its own slots (masked by global position and
///   window; a rank none of whose slots a query sees gives lse = -inf), the partial outputs
///   and log-sum-exps are all-gathered over the cp group and merged in group order
///   (log-sum-exp weights, as the ring attention merges), so every cp rank holds the same
///   result.
fn cp_kv_attention(
    window: u64,
    ins: &[BufId],
    outs: &[BufId],
    env: &Env,
    comm: &mut dyn Communicator,
    [s, nh, nkv, d]: [usize; 4],
) -> Result<(), RuntimeError> {
    let (mem, mesh) = (env.mem, env.mesh);
    let rank = comm.rank();
    let row = nkv * d;
    let cp = mesh.size(megac_ir::Axis::Cp) as usize;
    let me = mesh.coord(rank, megac_ir::Axis::Cp);
    let group = mesh.group(rank, &[megac_ir::Axis::Cp]);
    let slots = mem.buffer(outs[2]).shape[0] as usize;
    let seq = slots * cp;
    if !seq.is_multiple_of(2 * cp) {
        return Err(RuntimeError::Plan(format!(
            "`kv_attention`: a cache of {slots} rows per rank over cp = {cp} is not the \
             load-balanced layout of a window"
        )));
    }
    let mine = k::context::cp_local_positions(seq, cp, me);
    if cp_positions(mem, ins[0], 1, mesh, rank).is_some() {
        // The prefill: the window plan's attention, then the local rows into their slots.
        super::attention::run(
            &OpKind::CausalAttention { window },
            &ins[..3],
            &outs[..2],
            env,
            comm,
        )?;
        let n = s.min(slots);
        mem.f32_mut(outs[2])[..n * row].copy_from_slice(&mem.f32(ins[1])[..n * row]);
        mem.f32_mut(outs[3])[..n * row].copy_from_slice(&mem.f32(ins[2])[..n * row]);
        return Ok(());
    }
    let pos = step_positions(mem, ins[0], ins[3], mesh, rank);
    // This rank's rows of the block: at their slots.
    for (i, &p) in pos.iter().enumerate() {
        if let Some(slot) = mine.iter().position(|&m| m == p) {
            for (x, c) in [(ins[1], outs[2]), (ins[2], outs[3])] {
                let src = mem.f32(x)[i * row..(i + 1) * row].to_vec();
                mem.f32_mut(c)[slot * row..(slot + 1) * row].copy_from_slice(&src);
            }
        }
    }
    let window = u32::try_from(window).unwrap_or(u32::MAX);
    let (mut part_out, mut part_lse) = (vec![0f32; s * nh * d], vec![0f32; nh * s]);
    k::context::attention_window_fwd(
        mem.f32(ins[0]),
        mem.f32(outs[2]),
        mem.f32(outs[3]),
        &pos,
        &mine,
        window,
        1,
        s,
        slots,
        nh,
        nkv,
        d,
        &mut part_out,
        &mut part_lse,
    );
    let n = group.len();
    let mut outs_all = vec![0f32; part_out.len() * n];
    let mut lses_all = vec![0f32; part_lse.len() * n];
    comm.all_gather(&group, &part_out, &mut outs_all)?;
    comm.all_gather(&group, &part_lse, &mut lses_all)?;
    let (on, ln) = (part_out.len(), part_lse.len());
    let (out, lse) = (mem.f32_mut(outs[0]), mem.f32_mut(outs[1]));
    out.copy_from_slice(&outs_all[..on]);
    lse.copy_from_slice(&lses_all[..ln]);
    for m in 1..n {
        k::context::attention_merge_into(
            out,
            lse,
            &outs_all[m * on..(m + 1) * on],
            &lses_all[m * ln..(m + 1) * ln],
            1,
            s,
            nh,
            d,
        );
    }
    Ok(())
}

/// The global positions of the rows of `x` (`[b, s, ..]`, its seq dim possibly split by
/// sequence parallelism) in a KV-cache step: the step's position (`pos`, an `i32[1]` input)
/// plus the rows of the rank's earlier sequence shards plus the row.
pub(super) fn step_positions(
    mem: &Memory,
    x: BufId,
    pos: BufId,
    mesh: &megac_ir::Mesh,
    rank: usize,
) -> Vec<u32> {
    let buf = mem.buffer(x);
    let s = buf.shape.get(1).copied().unwrap_or(1) as usize;
    let part = buf.layout.get(1).map_or(0, |axes| {
        axes.iter().fold(0usize, |acc, &a| {
            acc * mesh.size(a) as usize + mesh.coord(rank, a)
        })
    });
    let start = mem.i32(pos).first().copied().unwrap_or(0).max(0) as usize;
    (0..s)
        .map(|i| (start + part * s + i).min(u32::MAX as usize) as u32)
        .collect()
}
