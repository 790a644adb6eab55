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
    // The rows of the first `tokens` positions of the first sample (`[b, s, rest..]`): of
    // this rank's sequence shard where the sequence is split (sequence parallelism; under
    // context parallelism its load-balanced chunks).
    let shape = shape(mem, outs[0]);
    let n = if *tokens == 0 {
        y.len()
    } else {
        let row = shape.get(2..).map_or(1, |r| r.iter().product::<u64>()) as usize;
        let local = shape.get(1).copied().unwrap_or(1) as usize;
        let axes = mem
            .buffer(outs[0])
            .layout
            .get(1)
            .cloned()
            .unwrap_or_default();
        // The rows' global positions ascend (under cp: the load-balanced chunks), so the
        // real ones are a prefix.
        let positions = crate::sharded::dim_positions(env.mesh, comm.rank(), &axes, local)
            .iter()
            .filter(|&&p| p < *tokens as usize)
            .count();
        (positions * row).min(y.len())
    };
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
