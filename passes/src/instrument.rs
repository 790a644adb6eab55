//! The `perturb` and `probe` passes (MegaScope, docs/scope.md): rewrites of the laid-out
//! graph that `megac scope` and `megac train --perturb` ask for, and no-ops otherwise (so a
//! plan compiled without them is byte-identical).
//!
//! Both run right after `shard`, on the graph whose values carry their layouts over the
//! mesh, and insert ops that keep their operand's layout, right after the op that writes
//! the point:
//!
//! - `perturb` inserts `perturb(point, kind, seed, ...)` on a point (or on a weight:
//!   `weights.NAME`, whose readers then read the perturbed copy, so the parameter itself is
//!   never changed) and makes every reader of the point (forward, backward, collectives)
//!   read its result: the perturbation is not differentiated (its gradient is the
//!   identity). `patch` takes its replacement from a plan input `patch:POINT` the runtime
//!   fills from the probe file. During training weights are perturbed by the runtime (a
//!   fault of the stored parameter that the optimizer continues from), not by this pass.
//!   A point whose writer the `recompute` pass cloned is perturbed after the clone too,
//!   alike (the same stream: the same values), and the backward reads that copy.
//! - `probe` inserts `probe(name)`, a copy into a buffer that stays live to the end of the
//!   forward, at each point matching a pattern; a point that is a pending sum over tp (a
//!   row-parallel linear's output before its reduction) is all-reduced first, so every
//!   probe's layout is a plain split and the runtime gathers it from the layout alone.
//!   `attn.probs` probes the attention's q and k (parts `q` and `k`); the probabilities are
//!   computed from them on the host, as are the router's softmax and the logit lens.

use std::collections::HashMap;

use megac_ir::op::PerturbAction;
use megac_ir::perturb::{glob, BitField, PerturbKind, TrainPerturbation};
use megac_ir::{Axis, Graph, Op, OpId, OpKind, ValueDef, ValueId};

use crate::PassError;

/// What `megac scope` or `train --perturb` asks the passes to insert (nothing by default).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Instrument {
    /// Probe patterns (`*` matches any run of characters).
    pub probes: Vec<String>,
    /// Perturbations, with their step (training) or none.
    pub perturbations: Vec<TrainPerturbation>,
    /// The perturbations' seed.
    pub seed: u64,
    /// Perturb only the first `tokens` positions of the first sample (0: every element).
    pub tokens: u64,
    /// Training: the streams depend on the step and micro-batch, and weights are left to the
    /// runtime.
    pub train: bool,
}

/// How a point reads its op.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Site {
    Input(usize),
    Output(usize),
    /// The attention probabilities: q and k (inputs 0 and 1).
    Probs,
    /// The router's probabilities: the softmax of its logits (output 0), on the host.
    Softmax,
    /// The logit lens of a layer's output (output 0).
    Lens,
    /// The attention's per-head output (output 0): a perturbation point only.
    Heads,
}

/// The transformer layer a provenance path names.
fn layer_of(path: &str) -> Option<usize> {
    let parts: Vec<&str> = path.split('.').collect();
    parts
        .windows(2)
        .find(|w| w[0] == "layers" || w[0] == "h")
        .and_then(|w| w[1].parse().ok())
}

/// Every point of the forward, in forward order (`embed` first): (name, op, site). The
/// first op of a path counts (recomputation's clones come later).
fn sites(g: &Graph) -> Vec<(String, usize, Site)> {
    let mut out: Vec<(String, usize, Site)> = Vec::new();
    let push = |out: &mut Vec<(String, usize, Site)>, name: String, i: usize, s: Site| {
        if !out.iter().any(|(n, _, _)| *n == name) {
            out.push((name, i, s));
        }
    };
    let mut logits = None;
    for (i, op) in g.ops.iter().enumerate() {
        if op.kind.is_backward() {
            break;
        }
        let path = &op.path;
        match (&op.kind, layer_of(path)) {
            (OpKind::Add, Some(l)) if path.ends_with(".residual.attn") => {
                if l == 0 {
                    push(&mut out, "embed".into(), i, Site::Input(0));
                }
                push(&mut out, format!("layers.{l}.attn.out"), i, Site::Input(1));
            }
            (OpKind::Add, Some(l)) if path.ends_with(".residual.mlp") => {
                push(&mut out, format!("layers.{l}.mlp.out"), i, Site::Input(1));
                push(&mut out, format!("layers.{l}.out"), i, Site::Output(0));
                push(&mut out, format!("layers.{l}.lens"), i, Site::Lens);
            }
            (OpKind::CausalAttention { .. }, Some(l)) => {
                push(&mut out, format!("layers.{l}.attn.probs"), i, Site::Probs);
                push(&mut out, format!("layers.{l}.attn"), i, Site::Heads);
            }
            // The router's linear: Mixtral's `block_sparse_moe.gate`, Qwen2-MoE's `mlp.gate`.
            (OpKind::Linear { .. }, Some(l))
                if path.ends_with(".block_sparse_moe.gate") || path.ends_with(".mlp.gate") =>
            {
                push(&mut out, format!("layers.{l}.moe.router"), i, Site::Softmax);
            }
            (OpKind::CrossEntropy, _) if logits.is_none() => logits = Some(i),
            _ => {}
        }
    }
    if let Some(i) = logits {
        push(&mut out, "logits".into(), i, Site::Input(0));
    }
    out.sort_by_key(|(name, _, _)| name != "embed");
    out
}

fn fail(m: String) -> PassError {
    PassError::Instrument(m)
}

/// The op writing `v`, if an op does.
fn producer(g: &Graph, v: ValueId) -> Option<usize> {
    match g.value(v).def {
        ValueDef::Op(OpId(i), _) => Some(i as usize),
        _ => None,
    }
}

/// `v`, or the last perturbation of it (what readers of the point read).
fn current(g: &Graph, mut v: ValueId) -> ValueId {
    while let Some(op) = g
        .ops
        .iter()
        .find(|op| matches!(op.kind, OpKind::Perturb { .. }) && op.inputs[0] == v)
    {
        v = op.outputs[0];
    }
    v
}

/// Insert `kind` on `inputs` at op position `pos` (shifting the ops after it); its result
/// keeps the first operand's type and layout.
fn insert_at(
    g: &mut Graph,
    pos: usize,
    kind: OpKind,
    inputs: Vec<ValueId>,
    path: String,
) -> Result<ValueId, PassError> {
    let tys: Vec<&megac_ir::TensorType> = inputs.iter().map(|&v| g.ty(v)).collect();
    let ty = megac_ir::infer::infer_types(&kind, &tys)
        .map_err(|message| {
            PassError::Ir(megac_ir::IrError::Type {
                op: kind.name().to_string(),
                path: path.clone(),
                message,
            })
        })?
        .remove(0);
    for v in &mut g.values {
        if let ValueDef::Op(OpId(i), _) = &mut v.def {
            if *i as usize >= pos {
                *i += 1;
            }
        }
    }
    let out = ValueId(g.values.len() as u32);
    g.values.push(megac_ir::Value {
        ty,
        def: ValueDef::Op(OpId(pos as u32), 0),
    });
    g.ops.insert(
        pos,
        Op {
            kind,
            inputs,
            outputs: vec![out],
            path,
        },
    );
    Ok(out)
}

/// Where an op reading `v` goes: right after `v`'s writer and the ops already inserted
/// after it that read it (before the first reader of an input or parameter).
fn after(g: &Graph, v: ValueId) -> usize {
    // An input or parameter: right before its first reader (the arena lists it there).
    let first_reader = || g.ops.iter().position(|op| op.inputs.contains(&v));
    let mut pos = producer(g, v).map_or_else(|| first_reader().unwrap_or(0), |i| i + 1);
    // Past the conversions, perturbations and probes already inserted on `v`.
    while g.ops.get(pos).is_some_and(|op| {
        matches!(op.kind, OpKind::Probe { .. } | OpKind::Perturb { .. })
            && op.inputs.first() == Some(&v)
    }) {
        pos += 1;
    }
    pos
}

/// Renumber the values of `g` so that the arena lists them in op order again (the graph's
/// invariant, which passes replaying the arena rely on): the values from `first_new` on were
/// appended by the insertions; an input or parameter goes right before the op after it in
/// the arena (a new input, `patch:POINT`, right before its reader).
fn renumber(g: &mut Graph, first_new: usize) {
    let n = g.values.len();
    let mut key: Vec<(usize, usize, usize)> = vec![(0, 0, 0); n];
    for (i, op) in g.ops.iter().enumerate() {
        for (k, &o) in op.outputs.iter().enumerate() {
            key[o.0 as usize] = (i, k + 1, o.0 as usize);
        }
    }
    let reader = |vi: usize| {
        g.ops
            .iter()
            .position(|op| op.inputs.contains(&ValueId(vi as u32)))
            .unwrap_or(g.ops.len())
    };
    let mut next = g.ops.len();
    for vi in (0..first_new).rev() {
        match g.values[vi].def {
            ValueDef::Op(OpId(i), _) => next = i as usize,
            // Before its first reader too (a weight's `perturb` may now come first).
            _ => key[vi] = (next.min(reader(vi)), 0, vi),
        }
    }
    for (vi, k) in key.iter_mut().enumerate().skip(first_new) {
        if !matches!(g.values[vi].def, ValueDef::Op(..)) {
            *k = (reader(vi), 0, vi);
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&v| key[v]);
    let mut new_of = vec![ValueId(0); n];
    for (new, &old) in order.iter().enumerate() {
        new_of[old] = ValueId(new as u32);
    }
    let values = std::mem::take(&mut g.values);
    let mut slots: Vec<Option<megac_ir::Value>> = values.into_iter().map(Some).collect();
    g.values = order
        .iter()
        .map(|&o| slots[o].take().expect("once"))
        .collect();
    for op in &mut g.ops {
        for v in op.inputs.iter_mut().chain(op.outputs.iter_mut()) {
            *v = new_of[v.0 as usize];
        }
    }
    for (_, v) in &mut g.outputs {
        *v = new_of[v.0 as usize];
    }
}

/// The `perturb` pass.
pub fn perturb(g: &mut Graph, ins: &Instrument) -> Result<(), PassError> {
    if ins.perturbations.is_empty() {
        return Ok(());
    }
    let first_new = g.values.len();
    perturb_points(g, ins)?;
    renumber(g, first_new);
    Ok(())
}

fn perturb_points(g: &mut Graph, ins: &Instrument) -> Result<(), PassError> {
    for tp in &ins.perturbations {
        let p = &tp.perturbation;
        let points = sites(g);
        let action = match &p.kind {
            PerturbKind::Noise(s) => PerturbAction::Noise(*s),
            PerturbKind::Scale(x) => PerturbAction::Scale(*x),
            PerturbKind::Bitflip(field, rate) => {
                let (first, count) = match field {
                    BitField::Sign => (31, 1),
                    BitField::Exponent => (23, 8),
                    BitField::Mantissa => (0, 23),
                };
                PerturbAction::Bitflip {
                    first,
                    count,
                    rate: *rate,
                }
            }
            PerturbKind::ZeroHead(h) => PerturbAction::ZeroHead(*h),
            PerturbKind::Patch(_) => PerturbAction::Patch,
        };
        let (x, path, copies) = if let Some(name) = p.point.strip_prefix("weights.") {
            let Some((v, _, _)) = g.params().find(|(_, n, _)| *n == name) else {
                return Err(fail(format!(
                    "--perturb {}: the model has no parameter `{name}` (the names are \
                     Hugging Face's, e.g. `weights.{}`)",
                    p.point,
                    g.params().next().map_or("", |(_, n, _)| n)
                )));
            };
            if matches!(p.kind, PerturbKind::ZeroHead(_) | PerturbKind::Patch(_)) {
                return Err(fail(format!(
                    "--perturb {}: zero-head and patch change activations, not weights",
                    p.point
                )));
            }
            if ins.train {
                // The runtime perturbs the stored weight at its step.
                continue;
            }
            let reader = g.ops.iter().find(|op| op.inputs.contains(&v));
            (
                v,
                reader.map_or_else(String::new, |op| op.path.clone()),
                Vec::new(),
            )
        } else {
            let names: Vec<&str> = points.iter().map(|(n, _, _)| n.as_str()).collect();
            let Some((_, i, site)) = points.iter().find(|(n, _, _)| *n == p.point) else {
                return Err(fail(format!(
                    "--perturb {}: no such point; the points are {} and weights.PARAMETER",
                    p.point,
                    names.join(", ")
                )));
            };
            let op = &g.ops[*i];
            let x = match site {
                Site::Input(k) => op.inputs[*k],
                Site::Output(k) => op.outputs[*k],
                Site::Heads => op.outputs[0],
                Site::Probs | Site::Softmax | Site::Lens => {
                    return Err(fail(format!(
                        "--perturb {}: attention and router probabilities are computed for \
                         probing, not tensors of the forward; perturb layers.N.attn (the heads' \
                         outputs), layers.N.attn.out or layers.N.mlp.out instead",
                        p.point
                    )))
                }
            };
            if let PerturbKind::ZeroHead(h) = p.kind {
                if *site != Site::Heads {
                    return Err(fail(format!(
                        "--perturb {}:zero-head({h}): zero-head applies to layers.N.attn, \
                         the attention's per-head output",
                        p.point
                    )));
                }
                let heads = g.ty(x).dims[2].size;
                if h >= heads {
                    return Err(fail(format!(
                        "--perturb {}:zero-head({h}): the layer has heads 0..{heads}",
                        p.point
                    )));
                }
            }
            // The points are found before any insertion; ops move, values do not.
            let copies = recomputed_copies(g, x);
            let x = current(g, x);
            let path = producer(g, x).map_or_else(|| op.path.clone(), |w| g.ops[w].path.clone());
            (x, path, copies)
        };
        let x = current(g, x);
        let mut inputs = vec![x];
        if action == PerturbAction::Patch {
            let ty = g.ty(x).clone();
            inputs.push(g.add_input(format!("patch:{}", p.point), ty));
        }
        let kind = OpKind::Perturb {
            point: p.point.clone(),
            action,
            seed: ins.seed,
            tokens: if p.point.starts_with("weights.") {
                0
            } else {
                ins.tokens
            },
            step: tp.step.unwrap_or(0),
            train: ins.train,
        };
        insert_perturbation(g, x, kind.clone(), inputs.clone(), path)?;
        // The point's copies that activation recomputation computes again for the backward
        // are perturbed alike (the same op: the same stream, so the same values).
        for c in copies {
            let c = current(g, c);
            let mut ins = inputs.clone();
            ins[0] = c;
            let path = producer(g, c).map_or_else(String::new, |w| g.ops[w].path.clone());
            insert_perturbation(g, c, kind.clone(), ins, path)?;
        }
    }
    Ok(())
}

/// Insert the perturbation `kind` of `x` on `inputs` (`x` first) right after `x`'s writer,
/// and make every other reader of `x` (and the graph's outputs) read its result.
fn insert_perturbation(
    g: &mut Graph,
    x: ValueId,
    kind: OpKind,
    inputs: Vec<ValueId>,
    path: String,
) -> Result<(), PassError> {
    let pos = after(g, x);
    let y = insert_at(g, pos, kind, inputs, path)?;
    for (j, op) in g.ops.iter_mut().enumerate() {
        if j != pos {
            for v in &mut op.inputs {
                if *v == x {
                    *v = y;
                }
            }
        }
    }
    for (_, v) in &mut g.outputs {
        if *v == x {
            *v = y;
        }
    }
    Ok(())
}

/// The copies of `x` that the `recompute` pass made (`train.recompute`): the same result of
/// the clone of `x`'s writer (the op of the same kind whose path is the writer's with
/// ` (recompute)`, the same one in order among those), which the backward reads instead
/// of `x`. None when the writer is not recomputed.
fn recomputed_copies(g: &Graph, x: ValueId) -> Vec<ValueId> {
    let Some(w) = producer(g, x) else {
        return Vec::new();
    };
    let op = &g.ops[w];
    let Some(k) = op.outputs.iter().position(|&o| o == x) else {
        return Vec::new();
    };
    let same = |o: &megac_ir::Op, path: &str| {
        o.path == path && o.kind == op.kind && o.outputs.len() == op.outputs.len()
    };
    let ordinal = g.ops[..w].iter().filter(|o| same(o, &op.path)).count();
    let clone = format!("{} (recompute)", op.path);
    g.ops
        .iter()
        .filter(|o| same(o, &clone))
        .nth(ordinal)
        .map(|o| o.outputs[k])
        .into_iter()
        .collect()
}

/// The names of the probe points of `g` (the laid-out forward), in forward order.
pub fn probe_points(g: &Graph) -> Vec<String> {
    sites(g)
        .into_iter()
        .filter(|(_, _, s)| *s != Site::Heads)
        .map(|(n, _, _)| n)
        .collect()
}

/// The `probe` pass.
pub fn probe(g: &mut Graph, ins: &Instrument) -> Result<(), PassError> {
    if ins.probes.is_empty() {
        return Ok(());
    }
    let first_new = g.values.len();
    insert_probes(g, ins)?;
    renumber(g, first_new);
    Ok(())
}

fn insert_probes(g: &mut Graph, ins: &Instrument) -> Result<(), PassError> {
    let points: Vec<(String, usize, Site)> = sites(g)
        .into_iter()
        .filter(|(_, _, s)| *s != Site::Heads)
        .collect();
    for pat in &ins.probes {
        if !points.iter().any(|(n, _, _)| glob(pat, n)) {
            let names: Vec<&str> = points.iter().map(|(n, _, _)| n.as_str()).collect();
            return Err(fail(format!(
                "--probe {pat} matches no probe point of this model; the points are {}",
                names.join(", ")
            )));
        }
    }
    // Values are stable under insertion; resolve every wanted point first.
    let mut wanted: Vec<(String, String, ValueId)> = Vec::new();
    for (name, i, site) in &points {
        if !ins.probes.iter().any(|p| glob(p, name)) {
            continue;
        }
        let op = &g.ops[*i];
        match site {
            Site::Input(k) => wanted.push((name.clone(), String::new(), op.inputs[*k])),
            Site::Output(k) => wanted.push((name.clone(), String::new(), op.outputs[*k])),
            Site::Softmax | Site::Lens | Site::Heads => {
                wanted.push((name.clone(), String::new(), op.outputs[0]))
            }
            Site::Probs => {
                wanted.push((name.clone(), "q".into(), op.inputs[0]));
                wanted.push((name.clone(), "k".into(), op.inputs[1]));
            }
        }
    }
    let mut reduced: HashMap<ValueId, ValueId> = HashMap::new();
    for (name, part, v) in wanted {
        let v = current(g, v);
        let path = producer(g, v).map_or_else(String::new, |w| g.ops[w].path.clone());
        // A pending sum over tp is reduced (once) before it is probed.
        let x = if g.ty(v).layout.partial.contains(&Axis::Tp) {
            match reduced.get(&v) {
                Some(&r) => r,
                None => {
                    let pos = after(g, v);
                    let r = insert_at(
                        g,
                        pos,
                        OpKind::AllReduce {
                            axes: vec![Axis::Tp],
                        },
                        vec![v],
                        path.clone(),
                    )?;
                    // The operand's layout less the pending sum over tp (its splits,
                    // e.g. the sequence over cp, stay: the all-reduce is over tp only).
                    let mut layout = g.ty(v).layout.clone();
                    layout.partial.retain(|&a| a != Axis::Tp);
                    g.values[r.0 as usize].ty.layout = layout;
                    reduced.insert(v, r);
                    r
                }
            }
        } else {
            v
        };
        let pos = after(g, x);
        insert_at(g, pos, OpKind::Probe { name, part }, vec![x], path)?;
    }
    Ok(())
}
