//! Collective ops: all-reduce, all-gather, reduce-scatter, slice (local) and the
//! expert-parallel all-to-all.

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
        OpKind::AllReduce { axes } => {
            if ins[0] != outs[0] {
                mem.f32_mut(outs[0]).copy_from_slice(mem.f32(ins[0]));
            }
            let members = group(mesh, axes, comm.rank());
            comm.all_reduce_sum(&members, mem.f32_mut(outs[0]))?;
        }
        OpKind::Slice { axes, dim } => {
            let members = group(mesh, axes, comm.rank());
            let me = members.iter().position(|&r| r == comm.rank()).unwrap_or(0);
            let s = shape(mem, outs[0]);
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
            let members = group(mesh, axes, comm.rank());
            let n = members.len();
            let gather = matches!(op, OpKind::AllGather { .. });
            // The sharded side's shape: [outer, local, inner] around `dim`.
            let local_buf = if gather { ins[0] } else { outs[0] };
            let s = shape(mem, local_buf);
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
        OpKind::AllToAll {
            axes,
            split,
            concat,
        } => {
            let (xs, ys) = (shape(mem, ins[0]), shape(mem, outs[0]));
            if xs.len() != 3 || ys.len() != 3 || xs[2] != ys[2] || split == concat {
                return Err(RuntimeError::Plan(format!(
                    "`all_to_all` moves [experts, tokens, h] buffers, the plan gives {xs:?} -> {ys:?}"
                )));
            }
            let members = group(mesh, axes, comm.rank());
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
        _ => unreachable!("run_kernel routes `{}` elsewhere", op.name()),
    }
    Ok(())
}
