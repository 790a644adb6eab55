//! Optimizer kernels: the global gradient norm and the AdamW step.

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
    let (mem, ctx, mesh) = (env.mem, env.ctx, env.mesh);
    match op {
        OpKind::GradNorm { .. } => {
            // Each rank sums the squares of the gradient elements it owns; the norm is global.
            let OpKind::GradNorm { axes } = op else {
                unreachable!()
            };
            let members = group(mesh, axes, comm.rank());
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
            // The norm of the unscaled gradients (fp16's loss scale divided out).
            mem.f32_mut(outs[0])[0] = (total[0].sqrt() / ctx.loss_scale) as f32;
        }
        OpKind::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            max_norm,
            ..
        } => {
            let norm = mem.f32(ins[2])[0];
            if !norm.is_finite() {
                // fp16: the gradients overflowed; the step is skipped (Megatron), and the
                // loss scaler halves its scale. (Any other precision stops the run.)
                return Ok(());
            }
            let g = mem.f32_mut(ins[1]);
            if ctx.loss_scale != 1.0 {
                k::scale_in_place(g, (1.0 / ctx.loss_scale) as f32);
            }
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
            // Mixed precision steps the f32 master copy (fourth output), then rounds it into
            // the 16-bit working weight (staged: the executor rounds it once on store).
            let weights = match outs.get(3) {
                Some(&master) => mem.f32_mut(master),
                None => mem.f32_mut(outs[0]),
            };
            k::adamw_step(
                weights,
                g,
                mem.f32_mut(outs[1]),
                mem.f32_mut(outs[2]),
                &hp,
                ctx.step,
            );
            if let Some(&master) = outs.get(3) {
                mem.f32_mut(outs[0]).copy_from_slice(mem.f32(master));
            }
        }
        _ => unreachable!("run_kernel routes `{}` elsewhere", op.name()),
    }
    Ok(())
}
