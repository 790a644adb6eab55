//! The plan validator: proves before a run that every group's members call the same
//! collectives in the same order with the same sizes.
//!
//! For each rank it walks its role's programs (one micro-batch, then the optimizer) and
//! lists, per process group, the communication calls it makes: the explicit collectives
//! (`all_reduce`, `all_gather`, `reduce_scatter`, the group reduction of `grad_norm`) and the
//! ones kernels make implicitly from buffer layouts (vocab-parallel embedding is local, the
//! vocab-parallel cross-entropy reduces over tp, context-parallel attention exchanges over
//! cp, expert parallelism's all-to-all over ep). Every member of a group must list the same sequence. Pipeline send/recv matching
//! joins this check when plans carry schedules.

use std::collections::BTreeMap;

use crate::op::OpKind;
use crate::plan::{Instr, Plan};
use crate::types::Axis;

/// One communication call of a rank.
#[derive(Clone, Debug, PartialEq)]
struct Call {
    what: String,
    elements: u64,
    program: &'static str,
    index: usize,
    path: String,
}

/// Check `plan`; the error names the group, the call number, the ranks and their calls.
pub fn check_plan(plan: &Plan) -> Result<(), String> {
    let world = plan.mesh.world_size();
    if plan.rank_to_role.len() != world {
        return Err(format!(
            "the mesh has {world} ranks but the rank table lists {}",
            plan.rank_to_role.len()
        ));
    }
    // group -> rank -> calls
    let mut calls: BTreeMap<Vec<usize>, BTreeMap<usize, Vec<Call>>> = BTreeMap::new();
    for rank in 0..world {
        let role = plan
            .roles
            .get(plan.rank_to_role[rank] as usize)
            .ok_or_else(|| {
                format!(
                    "rank {rank} has role {}, which does not exist",
                    plan.rank_to_role[rank]
                )
            })?;
        for (program, instrs) in [
            ("microbatch", &role.microbatch),
            ("optimizer", &role.optimizer),
        ] {
            for (index, instr) in instrs.iter().enumerate() {
                let Instr::Kernel {
                    op, inputs, path, ..
                } = instr
                else {
                    continue;
                };
                for (axes, what, elements) in communication(plan, op, inputs)? {
                    if axes.is_empty() {
                        continue;
                    }
                    let group = plan.mesh.group(rank, &axes);
                    if group.len() < 2 {
                        continue;
                    }
                    calls
                        .entry(group)
                        .or_default()
                        .entry(rank)
                        .or_default()
                        .push(Call {
                            what,
                            elements,
                            program,
                            index,
                            path: path.clone(),
                        });
                }
            }
        }
    }
    for (group, members) in &calls {
        let first = group[0];
        let reference = members.get(&first).cloned().unwrap_or_default();
        for &rank in group {
            let mine = members.get(&rank).cloned().unwrap_or_default();
            let n = reference.len().max(mine.len());
            for k in 0..n {
                let (a, b) = (reference.get(k), mine.get(k));
                let same = match (a, b) {
                    (Some(a), Some(b)) => a.what == b.what && a.elements == b.elements,
                    _ => false,
                };
                if !same {
                    let show = |r: usize, c: Option<&Call>| match c {
                        Some(c) => format!(
                            "rank {r} calls {} of {} elements ({}[{}], {})",
                            c.what, c.elements, c.program, c.index, c.path
                        ),
                        None => format!("rank {r} makes no call"),
                    };
                    return Err(format!(
                        "collective mismatch on group {group:?}, call #{}: {}; {}",
                        k + 1,
                        show(first, a),
                        show(rank, b)
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The communication `op` makes: (group axes, description, elements).
fn communication(
    plan: &Plan,
    op: &OpKind,
    inputs: &[u32],
) -> Result<Vec<(Vec<Axis>, String, u64)>, String> {
    let buffer = |b: u32| {
        plan.buffers
            .get(b as usize)
            .ok_or_else(|| format!("`{}` reads buffer {b}, which does not exist", op.name()))
    };
    let split_over = |b: u32, dim: usize, axis: Axis| -> Result<bool, String> {
        Ok(buffer(b)?
            .layout
            .get(dim)
            .is_some_and(|a| a.contains(&axis)))
    };
    Ok(match op {
        OpKind::AllReduce { axes }
        | OpKind::AllGather { axes, .. }
        | OpKind::ReduceScatter { axes, .. } => {
            vec![(
                axes.clone(),
                op.name().to_string(),
                buffer(inputs[0])?.len(),
            )]
        }
        OpKind::GradNorm { axes } => vec![(axes.clone(), "grad_norm".into(), 1)],
        // Expert parallelism: the members exchange their token counts, then the token rows
        // (variable split sizes, bounded by the buffers, which every member sizes alike).
        OpKind::AllToAll { axes, .. } => vec![
            (
                axes.clone(),
                "all_gather (token counts)".into(),
                buffer(inputs[1])?.len(),
            ),
            (axes.clone(), "all_to_all".into(), buffer(inputs[0])?.len()),
        ],
        // MoE under context parallelism sums the load-balancing statistics over cp.
        OpKind::MoeAuxLoss { .. } | OpKind::MoeAuxLossGrad { .. } => {
            if split_over(inputs[0], 1, Axis::Cp)? {
                let logits = buffer(inputs[0])?;
                let experts = logits.shape.last().copied().unwrap_or(0);
                vec![(
                    vec![Axis::Cp],
                    format!("{} (context-parallel statistics)", op.name()),
                    2 * experts + 1,
                )]
            } else {
                Vec::new()
            }
        }
        OpKind::CrossEntropy | OpKind::CrossEntropyGrad => {
            let logits = buffer(inputs[0])?;
            let last = logits.shape.len().saturating_sub(1);
            if split_over(inputs[0], last, Axis::Tp)? {
                let rows = logits.len() / logits.shape.last().copied().unwrap_or(1).max(1);
                vec![(
                    vec![Axis::Tp],
                    format!("{} (vocab-parallel)", op.name()),
                    rows,
                )]
            } else {
                Vec::new()
            }
        }
        OpKind::CausalAttention | OpKind::AttentionGrad => {
            if split_over(inputs[0], 1, Axis::Cp)? {
                let kv = buffer(inputs[1])?.len();
                vec![(
                    vec![Axis::Cp],
                    format!("{} (context-parallel)", op.name()),
                    kv,
                )]
            } else {
                Vec::new()
            }
        }
        _ => Vec::new(),
    })
}
