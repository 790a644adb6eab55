//! MegaScope's instructions: `probe` (a copy into a probe buffer the runtime reads after the
//! forward) and `perturb` (the seeded kernels of `megac_kernels::perturb`).

use super::*;
use megac_ir::op::PerturbAction;

/// Run one of this family's kernels (`run_kernel` routes only these ops here and has checked
/// their arity).
pub(super) fn run(
    op: &OpKind,
    ins: &[BufId],
    outs: &[BufId],
    env: &Env,
    comm: &mut dyn Communicator,
) -> Result<(), RuntimeError> {
    let mem = env.mem;
    let y = mem.f32_mut(outs[0]);
    y.copy_from_slice(mem.f32(ins[0]));
    let OpKind::Perturb {
        point,
        action,
        seed,
        tokens,
        step,
        train,
    } = op
    else {
        return Ok(());
    };
    if *step != 0 && *step != env.ctx.step {
        return Ok(());
    }
    // Every element, or the real tokens' rows of this rank's part.
    let shape = shape(mem, outs[0]);
    let n = crate::sharded::perturbed_elements(
        env.mesh,
        comm.rank(),
        &shape,
        &mem.buffer(outs[0]).layout,
        *tokens,
    ) as usize;
    let x = &mut y[..n];
    let stream = if *train {
        format!("{point}@{}.{}", env.ctx.step, env.ctx.microbatch)
    } else {
        point.clone()
    };
    let seed = megac_kernels::perturb::stream_seed(*seed, &stream);
    match *action {
        PerturbAction::Noise(sigma) => megac_kernels::perturb::noise(x, sigma, seed),
        PerturbAction::Scale(f) => megac_kernels::perturb::scale(x, f),
        PerturbAction::Bitflip { first, count, rate } => {
            megac_kernels::perturb::bitflip(x, first, count, rate, seed)
        }
        PerturbAction::ZeroHead(h) => {
            // A global head: the rank whose part of the heads dim holds it zeroes it.
            let (heads, d) = match shape[..] {
                [_, _, heads, d] => (heads as usize, d as usize),
                _ => {
                    return Err(RuntimeError::Plan(format!(
                        "perturb {point}: zero-head needs a [b, s, heads, d] tensor"
                    )))
                }
            };
            let axes = mem
                .buffer(outs[0])
                .layout
                .get(2)
                .cloned()
                .unwrap_or_default();
            let part = axes.iter().fold(0usize, |p, &ax| {
                p * env.mesh.size(ax) as usize + env.mesh.coord(comm.rank(), ax)
            });
            if h as usize / heads.max(1) == part {
                megac_kernels::perturb::zero_head(x, h as usize % heads.max(1), heads, d);
            }
        }
        PerturbAction::Patch => {
            x.copy_from_slice(&mem.f32(ins[1])[..n]);
        }
    }
    Ok(())
}
