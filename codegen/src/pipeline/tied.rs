//! Tied parameters (parameters read by several stages: GPT-2's word embeddings, read by the
//! head on the last stage): a copy on every other stage, refreshed by the home stage after
//! each optimizer step, and the other stages' gradient contributions summed once per step
//! (folded from per-micro-batch transfers) into the home stage's gradient.

use std::collections::{BTreeMap, BTreeSet};

use megac_ir::mesh::chunk_owner;
use megac_ir::plan::{BufId, BufferClass, Instr};
use megac_ir::OpKind;

use super::optimizer::place_after_arena;
use super::placement::Usage;
use super::transfers::Transfer;
use super::{unsupported, Phase};
use crate::{CodegenError, Emitter};

/// Parameters shared by stages (tied embeddings).
#[derive(Default)]
pub(super) struct Tied {
    /// Parameter -> the stage that owns it and its gradient.
    pub(super) home: BTreeMap<BufId, u32>,
    /// (parameter, other stage) -> that stage's copy.
    pub(super) copy: BTreeMap<(BufId, u32), BufId>,
}

/// Tied parameters (GPT-2's word embeddings, read by the head on the last stage): the stage
/// that accumulates the gradient updates the parameter and sends it to a copy on every other
/// stage that reads it after each optimizer step. The other stages' gradient contributions
/// reach it as backward transfers, like any cross-chunk activation.
pub(super) fn tie_parameters(e: &mut Emitter, usage: &Usage) -> Result<Tied, CodegenError> {
    let mut tied = Tied::default();
    for (&b, stages) in &usage.persistent_stage {
        if stages.len() < 2 {
            continue;
        }
        let entry = e.params.iter().position(|p| p.buffer == b);
        // The home stage: the one that accumulates the gradient; in an inference plan
        // (no gradients) the first stage that reads the parameter.
        let grad_stage = entry.and_then(|i| match e.params[i].grad {
            Some(grad) => {
                let g = usage.persistent_stage.get(&grad)?;
                (g.len() == 1).then(|| *g.iter().next().expect("one stage"))
            }
            None => stages.iter().next().copied(),
        });
        let (Some(i), Some(h)) = (entry, grad_stage) else {
            return Err(unsupported(format!(
                "`{}` is used by pipeline stages {stages:?}; only parameters can be shared between stages",
                e.buffers[b as usize].name
            )));
        };
        tied.home.insert(b, h);
        for &s in stages.iter().filter(|&&s| s != h) {
            let mut buf = e.buffers[b as usize].clone();
            buf.name = format!("{}@stage{s}", buf.name);
            buf.stage = Some(s);
            let id = e.buffers.len() as BufId;
            e.buffers.push(buf);
            tied.copy.insert((b, s), id);
            e.params[i].tied_copies.push(id);
        }
    }
    Ok(tied)
}

/// A tied parameter's gradient contribution computed on another stage (GPT-2's head on the
/// last stage): accumulated there into `partial` over the step's micro-batches, sent once per
/// step and added into the home stage's gradient `grad` (through `incoming`) before the
/// optimizer — Megatron's reduction of the embedding gradient between the first and the last
/// stage, instead of one transfer per micro-batch.
pub(super) struct TiedFold {
    grad: BufId,
    home: u32,
    stage: u32,
    partial: BufId,
    incoming: BufId,
}

/// Turn the per-micro-batch backward transfers that only feed a tied parameter's gradient
/// sum into per-step reductions ([`TiedFold`]): the producer accumulates into a gradient-class
/// copy, the home stage's sum drops the transferred term.
pub(super) fn fold_tied_gradients(
    e: &mut Emitter,
    segs: &mut BTreeMap<(u32, Phase), Vec<Instr>>,
    transfers: &[Transfer],
    tied: &Tied,
    pp: u32,
) -> Vec<TiedFold> {
    let tied_grads: BTreeSet<BufId> = e
        .params
        .iter()
        .filter(|p| tied.home.contains_key(&p.buffer))
        .filter_map(|p| p.grad)
        .collect();
    let mut folds: Vec<TiedFold> = Vec::new();
    for (t, x) in transfers.iter().enumerate() {
        let t = t as u32;
        let Some(seg) = segs.get(&(x.to, x.to_phase)) else {
            continue;
        };
        let users: Vec<usize> = seg
            .iter()
            .enumerate()
            .filter(|(_, i)| !matches!(i, Instr::Recv { .. }) && i.buffers().contains(&x.dst))
            .map(|(k, _)| k)
            .collect();
        let [k] = users[..] else { continue };
        let Instr::Kernel {
            op: OpKind::GradSum,
            inputs,
            outputs,
            ..
        } = &seg[k]
        else {
            continue;
        };
        let [grad] = outputs[..] else { continue };
        if !tied_grads.contains(&grad) || inputs.len() != 2 {
            continue;
        }
        let stage = chunk_owner(x.from, pp);
        let home = chunk_owner(x.to, pp);
        // The producer's per-step partial sum, and the home stage's landing buffer.
        let fold = match folds
            .iter()
            .position(|f| f.grad == grad && f.stage == stage)
        {
            Some(i) => i,
            None => {
                let mut partial = e.buffers[grad as usize].clone();
                partial.name = format!("{}@stage{stage}", partial.name);
                partial.stage = Some(stage);
                let mut incoming = partial.clone();
                incoming.name = format!("{}.from{stage}", e.buffers[grad as usize].name);
                incoming.stage = Some(home);
                let id = e.buffers.len() as BufId;
                e.buffers.push(partial);
                e.buffers.push(incoming);
                folds.push(TiedFold {
                    grad,
                    home,
                    stage,
                    partial: id,
                    incoming: id + 1,
                });
                folds.len() - 1
            }
        };
        let partial = folds[fold].partial;
        // Home: the sum keeps its own term; the receive goes.
        let seg = segs.get_mut(&(x.to, x.to_phase)).expect("segment");
        if let Instr::Kernel { inputs, .. } = &mut seg[k] {
            inputs.retain(|&b| b != x.dst);
        }
        seg.retain(|i| !matches!(i, Instr::Recv { transfer, .. } if *transfer == t));
        // Producer: accumulate instead of sending.
        let seg = segs.get_mut(&(x.from, x.from_phase)).expect("segment");
        for i in seg.iter_mut() {
            if matches!(i, Instr::Send { transfer, .. } if *transfer == t) {
                *i = Instr::Kernel {
                    op: OpKind::GradSum,
                    inputs: vec![x.src],
                    outputs: vec![partial],
                    path: "optimizer.tied_gradient".into(),
                };
            }
        }
    }
    folds
}

/// Once per step, before each stage's gradient reduction: the producers send their partial
/// tied gradients home, where they are added into the gradient. The extra buffers go after
/// each stage's gradient arena.
pub(super) fn reduce_tied_gradients(
    e: &mut Emitter,
    opt: &mut [Vec<Instr>],
    folds: &[TiedFold],
    first: u32,
) {
    for (transfer, f) in (first..).zip(folds) {
        opt[f.stage as usize].insert(
            0,
            Instr::Send {
                buffer: f.partial,
                chunk: f.home,
                transfer,
                twin: false,
            },
        );
        let home = &mut opt[f.home as usize];
        home.insert(
            0,
            Instr::Kernel {
                op: OpKind::GradSum,
                inputs: vec![f.incoming],
                outputs: vec![f.grad],
                path: "optimizer.tied_gradient".into(),
            },
        );
        home.insert(
            0,
            Instr::Recv {
                buffer: f.incoming,
                chunk: f.stage,
                transfer,
                twin: false,
            },
        );
    }
    let mut extra: BTreeMap<u32, Vec<BufId>> = BTreeMap::new();
    for f in folds {
        extra.entry(f.stage).or_default().push(f.partial);
        extra.entry(f.home).or_default().push(f.incoming);
    }
    for (stage, ids) in extra {
        place_after_arena(e, BufferClass::Grad, stage, &ids);
    }
}

/// The sends and receives that refresh tied copies after each step, per stage (transfer ids
/// from `first`).
pub(super) fn tied_refresh(tied: &Tied, first: u32, pp: u32) -> Vec<Vec<Instr>> {
    let mut refresh: Vec<Vec<Instr>> = vec![Vec::new(); pp as usize];
    for (transfer, (&(b, s), &copy_id)) in (first..).zip(&tied.copy) {
        let h = tied.home[&b];
        refresh[h as usize].push(Instr::Send {
            buffer: b,
            chunk: s,
            transfer,
            twin: false,
        });
        refresh[s as usize].push(Instr::Recv {
            buffer: copy_id,
            chunk: h,
            transfer,
            twin: false,
        });
    }
    refresh
}
