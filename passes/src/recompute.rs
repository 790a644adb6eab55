//! The `recompute` pass: activation recomputation as a rewrite of the differentiated graph.
//!
//! For each transformer layer, the forward ops chosen by the policy are cloned right before
//! the first backward op that needs one of their results, and every later backward use reads
//! the clone. The originals' results then die at the end of the forward pass, so they need
//! not be kept between forward and backward: the memory planner sees shorter lifetimes.
//!
//! - `selective`: core attention (`causal_attention` and its `merge_heads`), as Megatron's
//!   selective recomputation.
//! - `full`: every forward op of the layer except those producing the layer's output (the
//!   next layer's input, which stays live as the checkpoint).
//!
//! The same rewrite, run after `shard`, is the `regather` pass: sequence parallelism's
//! all-gathers are issued again in backward instead of keeping their gathered results.

use std::collections::{HashMap, HashSet};

use megac_ir::spec::Recompute;
use megac_ir::{Graph, OpKind, ValueDef, ValueId};

use crate::PassError;

/// The layer an op belongs to (`model.layers.3` for `model.layers.3.mlp.up_proj`).
pub fn layer_of(path: &str) -> Option<&str> {
    for prefix in ["model.layers.", "transformer.h."] {
        if let Some(rest) = path.strip_prefix(prefix) {
            let digits = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            if digits > 0 {
                return Some(&path[..prefix.len() + digits]);
            }
        }
    }
    None
}

/// Rewrite `g` for `policy`.
pub fn recompute(g: &mut Graph, policy: Recompute) -> Result<(), PassError> {
    if policy == Recompute::None {
        return Ok(());
    }
    let Some(backward_start) = g.ops.iter().position(|op| op.kind.is_backward()) else {
        return Err(PassError::Autodiff(
            "recompute needs a differentiated graph: run autodiff first".into(),
        ));
    };

    // Forward consumers of each value, with their layer.
    let mut forward_users: HashMap<ValueId, Vec<Option<&str>>> = HashMap::new();
    for op in &g.ops[..backward_start] {
        for &v in &op.inputs {
            forward_users.entry(v).or_default().push(layer_of(&op.path));
        }
    }
    // The ops to clone, per layer, in forward order.
    let mut chosen: Vec<(String, Vec<usize>)> = Vec::new();
    let mut attention_outputs = HashSet::new();
    for (i, op) in g.ops[..backward_start].iter().enumerate() {
        let Some(layer) = layer_of(&op.path) else {
            continue;
        };
        let pick = match policy {
            Recompute::None => false,
            Recompute::Selective => match op.kind {
                OpKind::CausalAttention { .. } => {
                    attention_outputs.extend(op.outputs.iter().copied());
                    true
                }
                OpKind::MergeHeads => attention_outputs.contains(&op.inputs[0]),
                _ => false,
            },
            Recompute::Full => {
                // Keep the ops whose results leave the layer: they are the checkpoints.
                !op.outputs.iter().any(|v| {
                    forward_users
                        .get(v)
                        .is_some_and(|users| users.iter().any(|l| *l != Some(layer)))
                })
            }
        };
        if pick {
            match chosen.last_mut() {
                Some((l, ops)) if l == layer => ops.push(i),
                _ => chosen.push((layer.to_string(), vec![i])),
            }
        }
    }

    let groups: Vec<Vec<usize>> = chosen.into_iter().map(|(_, ops)| ops).collect();
    clone_before_backward(g, &groups, backward_start, "recompute")
}

/// The `regather` pass (sequence parallelism, as Megatron): every forward all-gather over tp
/// whose gathered result a backward op reads (the weight gradient of a column-parallel
/// linear needs the whole sequence) is issued again right before that backward op, so the
/// gathered tensor is not kept from forward to backward: only its sharded input is.
pub fn regather(g: &mut Graph) -> Result<(), PassError> {
    let Some(backward_start) = g.ops.iter().position(|op| op.kind.is_backward()) else {
        return Err(PassError::Autodiff(
            "regather needs a differentiated graph: run autodiff first".into(),
        ));
    };
    let read_in_backward: HashSet<ValueId> = g.ops[backward_start..]
        .iter()
        .flat_map(|op| op.inputs.iter().copied())
        .collect();
    let groups: Vec<Vec<usize>> = g.ops[..backward_start]
        .iter()
        .enumerate()
        .filter(|(_, op)| {
            matches!(&op.kind, OpKind::AllGather { axes, .. } if axes == &[megac_ir::Axis::Tp])
                && op.outputs.iter().any(|v| read_in_backward.contains(v))
        })
        .map(|(i, _)| vec![i])
        .collect();
    if groups.is_empty() {
        return Ok(());
    }
    clone_before_backward(g, &groups, backward_start, "regather")
}

/// Clone each group of forward ops (indices into `g.ops`, in forward order) right before the
/// first backward op that reads one of the group's results, and make every backward use
/// read the clone. Values keep their types, layouts included (the pass may run after
/// `shard`); clones are named `PATH (why)`.
fn clone_before_backward(
    g: &mut Graph,
    groups: &[Vec<usize>],
    backward_start: usize,
    why: &str,
) -> Result<(), PassError> {
    // Where each group's clones go: before the first backward op reading one of its results.
    let mut recomputed: HashMap<ValueId, usize> = HashMap::new();
    for (k, ops) in groups.iter().enumerate() {
        for &i in ops {
            for &v in &g.ops[i].outputs {
                recomputed.insert(v, k);
            }
        }
    }
    let mut insert_before: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut placed = HashSet::new();
    for (i, op) in g.ops.iter().enumerate().skip(backward_start) {
        for v in &op.inputs {
            if let Some(&k) = recomputed.get(v) {
                if placed.insert(k) {
                    insert_before.entry(i).or_default().push(k);
                }
            }
        }
    }

    // Replay the graph in arena order, inserting clones and rewiring backward uses.
    let old = std::mem::replace(g, Graph::new(g.name.clone(), g.mesh.clone()));
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let mut clones: HashMap<ValueId, ValueId> = HashMap::new();
    let keep_type = |g: &mut Graph, old_v: ValueId, new_v: ValueId| {
        g.values[new_v.0 as usize].ty = old.values[old_v.0 as usize].ty.clone();
    };
    for (vi, value) in old.values.iter().enumerate() {
        let id = ValueId(vi as u32);
        match &value.def {
            ValueDef::Input(name) => {
                let v = g.add_input(name.clone(), value.ty.clone());
                map.insert(id, v);
            }
            ValueDef::Param(name) => {
                let v = g.add_param(name.clone(), value.ty.clone());
                map.insert(id, v);
            }
            ValueDef::Op(op_id, 0) => {
                let oi = op_id.0 as usize;
                let op = &old.ops[oi];
                for &k in insert_before.get(&oi).map_or(&[][..], |v| v.as_slice()) {
                    for &ci in &groups[k] {
                        let orig = &old.ops[ci];
                        let ins: Vec<ValueId> = orig
                            .inputs
                            .iter()
                            .map(|v| clones.get(v).copied().unwrap_or(map[v]))
                            .collect();
                        let outs =
                            g.add_op(orig.kind.clone(), &ins, format!("{} ({why})", orig.path))?;
                        for (o, n) in orig.outputs.iter().zip(outs) {
                            keep_type(g, *o, n);
                            clones.insert(*o, n);
                        }
                    }
                }
                let backward = oi >= backward_start;
                let ins: Vec<ValueId> = op
                    .inputs
                    .iter()
                    .map(|v| match clones.get(v) {
                        Some(&c) if backward => c,
                        _ => map[v],
                    })
                    .collect();
                let outs = g.add_op(op.kind.clone(), &ins, op.path.clone())?;
                for (o, n) in op.outputs.iter().zip(outs) {
                    keep_type(g, *o, n);
                    map.insert(*o, n);
                }
            }
            ValueDef::Op(..) => {}
        }
    }
    g.outputs = old
        .outputs
        .iter()
        .map(|(n, v)| (n.clone(), map[v]))
        .collect();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn layers_from_paths() {
        assert_eq!(
            layer_of("model.layers.12.mlp.up_proj"),
            Some("model.layers.12")
        );
        assert_eq!(layer_of("transformer.h.3.attn"), Some("transformer.h.3"));
        assert_eq!(layer_of("model.embed_tokens"), None);
        assert_eq!(layer_of("model.layers.x"), None);
    }
}
