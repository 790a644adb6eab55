//! The `optimizer` pass: global gradient norm, clipping and one AdamW step per parameter.
//!
//! Reads the `grad:NAME` outputs of autodiff and adds `grad_norm` (an output, recorded in run
//! reports before clipping) and an `adamw` op per parameter whose result, the updated
//! parameter, becomes the output `param:NAME`.

use megac_ir::spec::TrainSection;
use megac_ir::{Graph, OpKind, ValueId};

use crate::PassError;

/// Append the optimizer step to a differentiated graph.
pub fn add_optimizer(g: &mut Graph, train: &TrainSection) -> Result<(), PassError> {
    let grads: Vec<(String, ValueId)> = g
        .outputs
        .iter()
        .filter_map(|(n, v)| n.strip_prefix("grad:").map(|p| (p.to_string(), *v)))
        .collect();
    if grads.is_empty() {
        return Err(PassError::Autodiff(
            "the optimizer pass needs gradients: run autodiff first".into(),
        ));
    }
    // Gradients that are pending sums over mesh axes (data parallelism) are reduced first.
    let mut grads = grads;
    for (name, grad) in grads.iter_mut() {
        let layout = g.ty(*grad).layout.clone();
        if !layout.partial.is_empty() {
            *grad = g.add_op1(
                OpKind::AllReduce {
                    axes: layout.partial.clone(),
                },
                &[*grad],
                format!("optimizer.reduce.{name}"),
            )?;
            // The reduced gradient keeps its split (e.g. over tp); only the sum is done.
            g.values[grad.0 as usize].ty.layout.shards = layout.shards;
        }
    }
    let all: Vec<ValueId> = grads.iter().map(|(_, v)| *v).collect();
    // With tensor parallelism some gradients are split over tp: the squares are summed over
    // the tp group, and gradients replicated over it count once.
    let tp_split = all.iter().any(|&v| {
        g.ty(v)
            .layout
            .shards
            .iter()
            .any(|s| s.contains(&megac_ir::Axis::Tp))
    });
    let mut axes = if tp_split {
        vec![megac_ir::Axis::Tp]
    } else {
        Vec::new()
    };
    // Expert parallelism: expert gradients are disjoint across the ep group, so their
    // squares are summed over it (the others, replicated over ep, count once).
    let ep_split = all.iter().any(|&v| {
        g.ty(v)
            .layout
            .shards
            .iter()
            .any(|s| s.contains(&megac_ir::Axis::Ep))
    });
    if ep_split {
        axes.push(megac_ir::Axis::Ep);
    }
    let norm = g.add_op1(OpKind::GradNorm { axes }, &all, "optimizer.grad_norm")?;
    g.add_output("grad_norm", norm);
    let kind = OpKind::AdamW {
        lr: train.lr,
        beta1: train.betas.0,
        beta2: train.betas.1,
        eps: train.eps,
        weight_decay: train.weight_decay,
        max_norm: train.grad_clip,
        master: false,
    };
    for (name, grad) in grads {
        let param = g
            .params()
            .find(|(_, n, _)| *n == name)
            .map(|(v, _, _)| v)
            .ok_or_else(|| PassError::Autodiff(format!("gradient of unknown parameter {name}")))?;
        // A 16-bit working weight (mixed precision) is stepped through an f32 master copy.
        let mut kind = kind.clone();
        if let OpKind::AdamW { master, .. } = &mut kind {
            *master = g.ty(param).dtype.is_half();
        }
        let updated = g.add_op1(kind, &[param, grad, norm], format!("optimizer.{name}"))?;
        g.add_output(format!("param:{name}"), updated);
    }
    Ok(())
}
