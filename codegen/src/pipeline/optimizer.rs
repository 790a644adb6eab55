//! The optimizer split by stage (steps 3 and 4 of the split): every stage clips with the
//! global norm and updates only its own parameters; each stage's persistent arenas are
//! packed on their own, then its gradients are reduced (buckets, or ZeRO-1 over its own
//! parameters).

use std::collections::BTreeSet;

use megac_ir::plan::{BufId, BufferClass, Instr};
use megac_ir::{Axis, OpKind};

use super::tied::Tied;
use super::unsupported;
use crate::{CodegenError, Emitter};

/// The optimizer program per stage: every stage clips with the global norm (its own
/// squares, summed over pp too, into its own norm buffer) and updates its own parameters.
/// Returns the norm buffers and the programs.
#[allow(clippy::type_complexity)]
pub(super) fn split_optimizer(
    e: &mut Emitter,
    pp: u32,
) -> Result<(Vec<BufId>, Vec<Vec<Instr>>), CodegenError> {
    let norm = *e
        .results
        .get("grad_norm")
        .ok_or_else(|| CodegenError::Incomplete("no grad_norm result".into()))?;
    let mut norms = vec![norm; pp as usize];
    for (s, n) in norms.iter_mut().enumerate().skip(1) {
        let mut buf = e.buffers[norm as usize].clone();
        buf.name = format!("{}@stage{s}", buf.name);
        *n = e.buffers.len() as BufId;
        e.buffers.push(buf);
    }
    for (s, &n) in norms.iter().enumerate() {
        e.buffers[n as usize].stage = Some(s as u32);
    }
    let mut opt: Vec<Vec<Instr>> = vec![Vec::new(); pp as usize];
    for instr in std::mem::take(&mut e.optimizer) {
        match instr {
            Instr::Kernel {
                op: OpKind::GradNorm { axes },
                inputs,
                path,
                ..
            } => {
                let mut axes = axes.clone();
                if !axes.contains(&Axis::Pp) {
                    axes.push(Axis::Pp);
                }
                for (s, prog) in opt.iter_mut().enumerate() {
                    let mine: Vec<BufId> = inputs
                        .iter()
                        .copied()
                        .filter(|&g| e.buffers[g as usize].stage == Some(s as u32))
                        .collect();
                    prog.push(Instr::Kernel {
                        op: OpKind::GradNorm { axes: axes.clone() },
                        inputs: mine,
                        outputs: vec![norms[s]],
                        path: path.clone(),
                    });
                }
            }
            Instr::Kernel {
                op,
                inputs,
                outputs,
                path,
            } => {
                let stages: BTreeSet<u32> = inputs
                    .iter()
                    .chain(&outputs)
                    .filter(|&&b| b != norm)
                    .filter_map(|&b| e.buffers[b as usize].stage)
                    .collect();
                let [s] = stages.iter().copied().collect::<Vec<_>>()[..] else {
                    return Err(unsupported(format!(
                        "optimizer instruction `{path}` touches stages {stages:?}"
                    )));
                };
                let fix = |b: BufId| if b == norm { norms[s as usize] } else { b };
                opt[s as usize].push(Instr::Kernel {
                    op,
                    inputs: inputs.into_iter().map(fix).collect(),
                    outputs: outputs.into_iter().map(fix).collect(),
                    path,
                });
            }
            other => {
                let s = other
                    .buffers()
                    .iter()
                    .find_map(|&b| e.buffers[b as usize].stage)
                    .unwrap_or(0);
                opt[s as usize].push(other);
            }
        }
    }
    Ok((norms, opt))
}

/// Step 4: each stage's persistent arenas packed on their own, then its gradient reduction
/// (buckets, or ZeRO-1 over its own parameters with the norm summed over pp too; tied
/// copies after the flat segments), then the tied-copy refresh.
pub(super) fn stage_optimizers(
    e: &mut Emitter,
    opt: &mut [Vec<Instr>],
    norms: &[BufId],
    mut refresh: Vec<Vec<Instr>>,
    tied: &Tied,
) -> Result<(), CodegenError> {
    let pp = opt.len() as u32;
    for class in [BufferClass::Param, BufferClass::Grad, BufferClass::OptState] {
        for s in 0..pp {
            let mut offset = 0u64;
            for b in e.buffers.iter_mut() {
                if b.class == class && b.stage == Some(s) {
                    b.offset = offset;
                    offset += b.len();
                }
            }
        }
    }
    let p = &e.spec.parallel;
    let zero1 = p.distributed_optimizer && p.dp * p.cp > 1;
    for (s, prog) in opt.iter_mut().enumerate() {
        let before = e.buffers.len();
        if e.inference {
            // Nothing to reduce or update.
        } else if zero1 {
            let mine: Vec<usize> = (0..e.params.len())
                .filter(|&i| e.buffers[e.params[i].buffer as usize].stage == Some(s as u32))
                .collect();
            *prog = e.zero1_program(prog, &mine, norms[s], &[Axis::Pp])?;
        } else {
            *prog = e.bucketed(std::mem::take(prog));
        }
        for b in &mut e.buffers[before..] {
            b.stage = Some(s as u32);
            b.name = format!("{}@stage{s}", b.name);
        }
        if zero1 {
            // Tied copies go after the stage's flat segments.
            let copies: Vec<BufId> = tied
                .copy
                .iter()
                .filter(|((_, cs), _)| *cs == s as u32)
                .map(|(_, &id)| id)
                .collect();
            place_after_arena(e, BufferClass::Param, s as u32, &copies);
        }
        prog.append(&mut refresh[s]);
    }
    Ok(())
}

/// Place `ids` one after another past the end of stage `stage`'s `class` arena (the other
/// buffers' farthest extent over the mesh): buffers added after the arena was laid out.
pub(super) fn place_after_arena(e: &mut Emitter, class: BufferClass, stage: u32, ids: &[BufId]) {
    let mut end = e
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            b.class == class && b.stage == Some(stage) && !ids.contains(&(*i as BufId))
        })
        .map(|(_, b)| b.far_end(&e.g.mesh))
        .max()
        .unwrap_or(0);
    for &b in ids {
        e.buffers[b as usize].offset = end;
        end += e.buffers[b as usize].len();
    }
}
