//! Mixture-of-experts kernels: the router, the load-balancing loss (its statistics summed
//! over cp), dispatch and combine (one expert or all stacked), and their backward ops.

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
    let (mem, tokens, mesh) = (env.mem, env.tokens, env.mesh);
    match op {
        OpKind::Router { top_k, renorm } | OpKind::RouterGrad { top_k, renorm } => {
            let e = last(mem, ins[0]);
            let t = numel(mem, ins[0]) / e;
            let (k_, renorm) = (*top_k as usize, *renorm);
            if matches!(op, OpKind::Router { .. }) {
                k::moe::router_fwd_with(
                    mem.f32(ins[0]),
                    t,
                    e,
                    k_,
                    renorm,
                    mem.f32_mut(outs[0]),
                    mem.i32_act_mut(outs[1]),
                );
            } else {
                // The selection is recomputed from the logits (it is deterministic).
                let mut w = vec![0f32; t * k_];
                let mut idx = vec![0i32; t * k_];
                k::moe::router_fwd_with(mem.f32(ins[0]), t, e, k_, renorm, &mut w, &mut idx);
                k::moe::router_bwd_with(
                    mem.f32(ins[0]),
                    t,
                    e,
                    k_,
                    renorm,
                    &idx,
                    mem.f32(ins[1]),
                    mem.f32_mut(outs[0]),
                );
            }
        }
        OpKind::MoeAuxLoss { coeff } | OpKind::MoeAuxLossGrad { coeff } => {
            let e = last(mem, ins[0]);
            let t = numel(mem, ins[0]) / e;
            let top_k = last(mem, ins[1]);
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
                let members = group(mesh, &[c.axis], comm.rank());
                let (logits, idx) = (mem.f32(ins[0]), mem.i32(ins[1]));
                let mut stats = k::moe::moe_aux_stats(logits, t, e, top_k, idx);
                comm.all_reduce_sum_f64(&members, stats.as_mut_slice())?;
                if matches!(op, OpKind::MoeAuxLoss { .. }) {
                    let l = k::moe::moe_aux_loss_from_stats(&stats, top_k, *coeff);
                    mem.f32_mut(outs[0])[0] = (l * share) as f32;
                } else {
                    let scale = share * members.len() as f64 * env.ctx.loss_scale;
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
                    (share * env.ctx.loss_scale) as f32,
                    mem.f32_mut(outs[0]),
                );
            }
        }
        OpKind::Dispatch { expert, .. } => {
            let rows = shape(mem, outs[0])[0] as usize;
            let h = last(mem, ins[0]);
            let experts = 1 + (*expert as usize).max(max_index(mem.i32(ins[1])));
            let r = routing(mem, ins[1], experts, rows);
            let out = mem.f32_mut(outs[0]);
            out.fill(0.0);
            k::moe::dispatch_fwd_routed(mem.f32(ins[0]), &r, *expert as usize, h, out);
        }
        OpKind::DispatchGrad { expert } => {
            let rows = shape(mem, ins[0])[0] as usize;
            let h = last(mem, ins[0]);
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
            let s = shape(mem, outs[0]);
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
            let s = shape(mem, ins[0]);
            let (e, rows, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let r = routing(mem, ins[1], e, rows);
            let (dy, dx) = (mem.f32(ins[0]), mem.f32_mut(outs[0]));
            for (ex, block) in dy.chunks_exact(rows * h).enumerate() {
                k::moe::dispatch_bwd(block, &r, ex, h, dx);
            }
        }
        OpKind::CombineExperts => {
            let s = shape(mem, ins[2]);
            let (e, rows, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let ys: Vec<&[f32]> = mem.f32(ins[2]).chunks_exact(rows * h).collect();
            let r = routing(mem, ins[1], e, rows);
            let t = numel(mem, outs[0]) / h;
            k::moe::combine_fwd(mem.f32(ins[0]), &r, &ys, t, h, mem.f32_mut(outs[0]));
        }
        OpKind::CombineExpertsGrad => {
            let s = shape(mem, ins[2]);
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
        OpKind::Combine => {
            let ys: Vec<&[f32]> = ins[2..].iter().map(|&y| mem.f32(y)).collect();
            let rows = shape(mem, ins[2])[0] as usize;
            let h = last(mem, outs[0]);
            let r = routing(mem, ins[1], ys.len(), rows);
            let t = numel(mem, outs[0]) / h;
            k::moe::combine_fwd(mem.f32(ins[0]), &r, &ys, t, h, mem.f32_mut(outs[0]));
        }
        OpKind::CombineGrad => {
            let experts = ins.len().saturating_sub(3);
            let ys: Vec<&[f32]> = ins[2..2 + experts].iter().map(|&y| mem.f32(y)).collect();
            let rows = shape(mem, ins[2])[0] as usize;
            let dout = mem.f32(ins[2 + experts]);
            let h = last(mem, ins[2 + experts]);
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
        _ => unreachable!("run_kernel routes `{}` elsewhere", op.name()),
    }
    Ok(())
}
