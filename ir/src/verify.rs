//! The verifier: structural invariants every pass must keep.
//!
//! - every value is defined exactly once, and an op's results point back at it;
//! - every operand is defined before the op that uses it, and the def-use graph has no cycle;
//! - every recorded type equals what shape inference derives from the operands;
//! - layouts cover each dim, dim names are unique within a type, parameter names are unique;
//! - every op has a provenance path, and every graph output exists.

use std::collections::HashSet;

use petgraph::algo::toposort;
use petgraph::graph::DiGraph;

use crate::graph::{Graph, OpId, ValueDef, ValueId};
use crate::infer::infer_types;
use crate::types::TensorType;

/// Check `graph`; the error names the first broken invariant.
pub fn verify(graph: &Graph) -> Result<(), String> {
    let n_values = graph.values.len();
    let mut defined = vec![false; n_values];
    let mut names = HashSet::new();
    for (i, v) in graph.values.iter().enumerate() {
        check_type(&v.ty).map_err(|m| format!("%{i}: {m}"))?;
        match &v.def {
            ValueDef::Input(name) | ValueDef::Param(name) => {
                if !names.insert(name.as_str()) {
                    return Err(format!("%{i}: name \"{name}\" is declared twice"));
                }
                defined[i] = true;
            }
            ValueDef::Op(op, k) => {
                let owner = graph
                    .ops
                    .get(op.0 as usize)
                    .ok_or_else(|| format!("%{i}: defined by a missing op {}", op.0))?;
                if owner.outputs.get(*k) != Some(&ValueId(i as u32)) {
                    return Err(format!("%{i}: op {} does not list it as result {k}", op.0));
                }
            }
        }
    }

    let mut deps = DiGraph::<OpId, ()>::new();
    let nodes: Vec<_> = (0..graph.ops.len())
        .map(|i| deps.add_node(OpId(i as u32)))
        .collect();
    let mut producer = vec![None; n_values];
    for (i, op) in graph.ops.iter().enumerate() {
        let here = || format!("op {} `{}` ({})", i, op.kind.name(), op.path);
        if op.path.is_empty() {
            return Err(format!("{}: no provenance path", here()));
        }
        for &v in &op.inputs {
            let vi = v.0 as usize;
            if vi >= n_values || !defined[vi] {
                return Err(format!(
                    "{}: operand %{} is not defined before use",
                    here(),
                    v.0
                ));
            }
            if let Some(p) = producer[vi] {
                deps.add_edge(nodes[p], nodes[i], ());
            }
        }
        for (k, &v) in op.outputs.iter().enumerate() {
            let vi = v.0 as usize;
            if vi >= n_values || graph.values[vi].def != ValueDef::Op(OpId(i as u32), k) {
                return Err(format!(
                    "{}: result %{} does not point back at it",
                    here(),
                    v.0
                ));
            }
            if defined[vi] {
                return Err(format!("{}: result %{} is defined twice", here(), v.0));
            }
            defined[vi] = true;
            producer[vi] = Some(i);
        }
        let ins: Vec<&TensorType> = op.inputs.iter().map(|&v| graph.ty(v)).collect();
        let want = infer_types(&op.kind, &ins).map_err(|m| format!("{}: {m}", here()))?;
        if want.len() != op.outputs.len() {
            return Err(format!(
                "{}: {} results recorded, {} inferred",
                here(),
                op.outputs.len(),
                want.len()
            ));
        }
        for (&v, w) in op.outputs.iter().zip(&want) {
            let got = graph.ty(v);
            if got.dtype != w.dtype || got.dims != w.dims {
                return Err(format!(
                    "{}: result %{} is {} but its operands give {}",
                    here(),
                    v.0,
                    got.dtype_shape(),
                    w.dtype_shape()
                ));
            }
        }
    }
    if let Err(cycle) = toposort(&deps, None) {
        return Err(format!("cycle through op {}", deps[cycle.node_id()].0));
    }
    for (name, v) in &graph.outputs {
        if (v.0 as usize) >= n_values || !defined[v.0 as usize] {
            return Err(format!("output \"{name}\" refers to undefined %{}", v.0));
        }
    }
    Ok(())
}

fn check_type(ty: &TensorType) -> Result<(), String> {
    if ty.layout.shards.len() != ty.dims.len() {
        return Err(format!(
            "layout covers {} dims but the type has {}",
            ty.layout.shards.len(),
            ty.dims.len()
        ));
    }
    let mut seen = HashSet::new();
    for d in &ty.dims {
        if !seen.insert(d.name.as_str()) {
            return Err(format!(
                "dim name `{}` repeats in {}",
                d.name,
                ty.dtype_shape()
            ));
        }
    }
    Ok(())
}
