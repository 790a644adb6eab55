//! The `shard` pass: layouts over the device mesh, and the collectives they require.
//!
//! Runs on the differentiated graph, so forward and backward get the same treatment.
//!
//! - **Data parallelism**: the data inputs are sharded over `dp` along the batch dim; a
//!   result with a batch dim (`b`, or MoE's `tokens`) stays sharded like its operands, and a
//!   result without one (a parameter gradient, the loss) becomes a pending sum, `Partial(dp)`.
//!   The optimizer pass reduces partial gradients.
//! - **Tensor parallelism** (Megatron's layout): every parameter's layout over tp is the
//!   one extraction chose ([`crate::tensor_parallel`], from each op's layout algebra and
//!   the all-reduce/slice rewrites over the graph before this pass; no parameter name is
//!   read): on every family it is Megatron's, column-parallel linears (q/k/v, gate/up,
//!   GPT-2's `c_attn` and `c_fc`) over their output dim, row-parallel linears (o_proj,
//!   down_proj, GPT-2's `c_proj`) over their input dim, the embedding and output layer
//!   over the vocabulary, the rest whole. Every op but the token-wise ones sequence
//!   parallelism puts on shards is then emitted by one generic emitter (`Sharder::emit_tp`)
//!   under a strategy of its layout algebra over (ep, tp) ([`tensor_parallel::strategies`],
//!   the only statement of it): the first of the extracted term's choices for the op its
//!   operands can be converted to. The term models the group edges as they are emitted
//!   (a value leaves its group in its producer's layout: the vocab-parallel embedding's
//!   and llama's residual stream's partial sums reach the next layer as partial sums, the
//!   layer's residual adds add them as such), so the two agree; where the operands fit a
//!   strategy as they are and the term's choice would move them, the operands' strategy
//!   is taken and the disagreement recorded ([`departures_from_term`]). Where
//!   an op needs an operand in another layout, the pass inserts the collective that
//!   converts it: `all_reduce` for a partial sum that must be whole, `all_gather` for a
//!   shard that must be whole, `slice` for a whole value that must be split. A row-parallel linear's bias is split off into a `bias_add` after the reduction,
//!   so it is added once. Vocab-parallel embedding and cross-entropy are the ordinary ops
//!   on a vocab-sharded table/logits; the runtime reads the layout and reduces over tp.
//!   Before the layout, each chain of gradient sums that mixes partial contributions (an
//!   expert's, a column-parallel linear's input gradient) with whole ones (the router's) is
//!   reordered so the partial ones are added first and reduced once
//!   (`sum_partials_first`).
//!
//! - **Expert parallelism** (Megatron's MoE parallel folding): stacked expert weights
//!   (`[experts, out, in]`) are split over `ep` along the experts dim. Where each op on
//!   stacked expert values runs over ep is its layout algebra's
//!   ([`tensor_parallel::strategies`]: ops on stacked weights on the experts' ranks, ops on
//!   expert tokens alone on either side, the dispatch, the combine and the dispatch's
//!   gradient on the tokens' ranks) and the extracted term's choice, emitted by
//!   `Sharder::emit_tp` like every op: where an operand of expert tokens
//!   (`[experts, tokens, h]`) is on the other side, it inserts the `all_to_all` over ep
//!   that moves it (sized by the block's dispatch's token counts; one per value). On the
//!   experts' ranks the experts dim is split over `ep` and the token rows are the whole ep
//!   group's (`tokens` marked `edp`); on the tokens' ranks they are this rank's (dp, cp).
//!   The term puts the exchanges where Megatron does: to the experts before w1/w3, back
//!   before `combine_experts`; backward mirrors both. A stacked result without token rows
//!   computed from the experts' token rows (an expert weight's gradient) is a pending sum
//!   over the expert-data-parallel group (`Partial(edp)`), the other gradients over dp
//!   (and cp) as before.
//! - **Expert tensor parallelism** (Megatron's ETP = tp): experts are tensor-parallel over
//!   tp like a dense MLP, per expert (`experts.{j}.w1/w2/w3`, ep = 1) or stacked (ep > 1),
//!   as extraction chooses: w1 and w3 column-parallel (the ffn dim split), w2 row-parallel
//!   (its ffn input split). The router stays replicated over tp (the tp ranks of a group route the same tokens, so
//!   their dispatches agree); each expert's output is a partial sum over tp, the combine is
//!   linear in them, and its result is reduced once (all-reduce, or reduce-scatter to
//!   sequence shards under sequence parallelism). Backward mirrors it: the experts' output
//!   gradients are whole, their token gradients partial (summed with the router's whole
//!   contribution on sequence shards under sp), and the router-weight gradient, a dot
//!   product with the partial expert outputs, is all-reduced (`[b, s, top_k]`).
//! - **Context parallelism** with MoE: routing, dispatch and combine work on the rank's own
//!   tokens (MoE token rows are split over cp like the sequence).

use std::collections::{BTreeMap, HashMap};

use megac_ir::infer::infer_types;
use megac_ir::spec::ModelSpec;
use megac_ir::{Axis, Graph, Layout, OpKind, TensorType, ValueDef, ValueId};

use crate::tensor_parallel::{Dist, Ep};
use crate::{collectives, tensor_parallel, PassError};

/// Annotate `g` with the layouts of `spec`'s parallel layout, inserting collectives.
///
/// With sequence parallelism, the graph is first laid out with tensor parallelism alone;
/// the collective rewrites ([`crate::collectives`]) run over that layout block by block, and
/// every token-wise op then runs on sequence shards or whole as the extracted term says.
pub fn shard(g: &mut Graph, spec: &ModelSpec) -> Result<(), PassError> {
    let p = &spec.parallel;
    if p.dp == 1 && p.tp == 1 && p.cp == 1 {
        return Ok(());
    }
    let old = std::mem::replace(g, Graph::new(g.name.clone(), g.mesh.clone()));
    laid_out(g, old, spec)?;
    Ok(())
}

/// The ops [`shard`] would emit for `g` (the graph before `shard`) in a layout over (ep,
/// tp) that is not one of the extracted term's choices for them, as `kind at path`
/// (tests: the placement comes from the term; empty where it does).
pub fn departures_from_term(g: &Graph, spec: &ModelSpec) -> Result<Vec<String>, PassError> {
    let p = &spec.parallel;
    if p.dp == 1 && p.tp == 1 && p.cp == 1 {
        return Ok(Vec::new());
    }
    let mut out = Graph::new(g.name.clone(), g.mesh.clone());
    Ok(laid_out(&mut out, g.clone(), spec)?.departures)
}

/// [`shard`]'s work: lay `old` out into the empty `g`.
fn laid_out(g: &mut Graph, old: Graph, spec: &ModelSpec) -> Result<Laid, PassError> {
    let p = &spec.parallel;
    let sp = p.tp > 1 && p.sequence_parallel;
    let tp = tp_placement(&old, spec, &tensor_parallel::rules())?;
    // The graph with its gradient sums reordered is placed again: the term then holds the
    // sums as they are emitted (partial contributions added first, reduced once).
    let (old, tp) = match sum_partials_first(&old, spec, &tp)? {
        Some(g) => {
            let tp = tp_placement(&g, spec, &tensor_parallel::rules())?;
            (g, tp)
        }
        None => (old, tp),
    };
    let placed = if sp {
        Some(sp_placement(&old, spec, &collectives::rules(), &tp)?.on_shards)
    } else {
        None
    };
    lay_out(g, &old, spec, sp, placed, &tp)
}

/// Every parameter's layout over tp, as the tensor-parallel rewrites
/// ([`crate::tensor_parallel`]) extract it for `g` (the graph before `shard`; a forward-only
/// graph is differentiated first): the dim tp splits it along, `None` when whole. Empty
/// without tensor parallelism.
pub fn tensor_parallel_params(
    g: &Graph,
    spec: &ModelSpec,
    rules: &[egg::Rewrite<egg::SymbolLang, tensor_parallel::Layouts>],
) -> Result<BTreeMap<String, Option<usize>>, PassError> {
    if spec.parallel.tp <= 1 {
        return Ok(BTreeMap::new());
    }
    Ok(tp_placement(g, spec, rules)?.params)
}

/// What the tensor-parallel rewrites extract for `g` (see [`tensor_parallel_params`]):
/// every parameter's layout and every op's choice over (ep, tp), by its index in `g` (a
/// forward-only graph's ops keep their indices in the differentiated one). Empty without
/// tensor or expert parallelism.
fn tp_placement(
    g: &Graph,
    spec: &ModelSpec,
    rules: &[egg::Rewrite<egg::SymbolLang, tensor_parallel::Layouts>],
) -> Result<tensor_parallel::Placement, PassError> {
    if spec.parallel.tp <= 1 && spec.parallel.ep <= 1 {
        return Ok(tensor_parallel::Placement::default());
    }
    // A forward-only graph (an inference plan) is laid out as training lays it out: the
    // layouts are chosen for the differentiated graph, so plans and checkpoints agree.
    let trained;
    let g = if g.outputs.iter().any(|(n, _)| n.starts_with("grad:")) {
        g
    } else {
        let mut d = g.clone();
        crate::autodiff::differentiate(&mut d)?;
        crate::recompute::recompute(&mut d, spec.train.recompute)?;
        trained = d;
        &trained
    };
    let micro_batch = spec.train.micro_batch as f64 / spec.train.global_batch.max(1) as f64;
    let p = &spec.parallel;
    let sp = p.tp > 1 && p.sequence_parallel;
    tensor_parallel::place(g, p.tp, p.ep, micro_batch, sp, rules).map_err(PassError::Collectives)
}

/// The collective placement the rewrites find for `g` (the graph before `shard`) under
/// `spec`'s tensor parallelism, with sequence parallelism.
pub fn sequence_parallel_placement(
    g: &Graph,
    spec: &ModelSpec,
) -> Result<collectives::Placement, PassError> {
    placement_with(g, spec, &collectives::rules())
}

/// [`sequence_parallel_placement`] with the given rewrites (tests remove one).
pub fn placement_with(
    g: &Graph,
    spec: &ModelSpec,
    rules: &[egg::Rewrite<collectives::Coll, collectives::Layouts>],
) -> Result<collectives::Placement, PassError> {
    let tp = tp_placement(g, spec, &tensor_parallel::rules())?;
    match sum_partials_first(g, spec, &tp)? {
        Some(g) => {
            let tp = tp_placement(&g, spec, &tensor_parallel::rules())?;
            sp_placement(&g, spec, rules, &tp)
        }
        None => sp_placement(g, spec, rules, &tp),
    }
}

fn sp_placement(
    g: &Graph,
    spec: &ModelSpec,
    rules: &[egg::Rewrite<collectives::Coll, collectives::Layouts>],
    tp: &tensor_parallel::Placement,
) -> Result<collectives::Placement, PassError> {
    let mut tp_only = Graph::new(g.name.clone(), g.mesh.clone());
    let tags = lay_out(&mut tp_only, g, spec, true, None, tp)?.tags;
    collectives::place(&tp_only, &tags, spec.parallel.tp, rules).map_err(PassError::Collectives)
}

/// Lay `old` out into `g`. `sp`: sequence parallelism, with `placed` saying which
/// token-wise ops run on sequence shards (none when `None`). Returns, for each op of `g`
/// emitted for an op of `old` (not a conversion), (that op, which of its emitted ops).
fn lay_out(
    g: &mut Graph,
    old: &Graph,
    spec: &ModelSpec,
    sp: bool,
    placed: Option<HashMap<(usize, usize), bool>>,
    tp: &tensor_parallel::Placement,
) -> Result<Laid, PassError> {
    let p = &spec.parallel;
    let mut s = Sharder {
        g,
        placed,
        cur: 0,
        sub: 0,
        converting: false,
        tags: HashMap::new(),
        departures: Vec::new(),
        tp: p.tp > 1,
        dp: p.dp > 1,
        cp: p.cp > 1,
        sp,
        whole_of: HashMap::new(),
        seq_of: HashMap::new(),
        slice_of: HashMap::new(),
        n: p.tp,
        ep_n: p.ep,
        choices: &tp.ops,
        ep: p.ep > 1,
        edp: p.dp * p.cp / p.ep.max(1) > 1,
        counts_of: HashMap::new(),
        experts_of: HashMap::new(),
        tokens_of: HashMap::new(),
    };
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    for (i, value) in old.values.iter().enumerate() {
        let id = ValueId(i as u32);
        match &value.def {
            ValueDef::Input(name) => {
                let v = s.g.add_input(name.clone(), value.ty.clone());
                if s.dp {
                    let d = batch_dim(s.g, v);
                    if let Some(d) = d {
                        s.g.values[v.0 as usize].ty.layout.shards[d] = vec![Axis::Dp];
                    }
                }
                if s.cp {
                    if let Some(d) = s.seq_dim(v) {
                        s.g.values[v.0 as usize].ty.layout.shards[d] = vec![Axis::Cp];
                    }
                }
                map.insert(id, v);
            }
            ValueDef::Param(name) => {
                let v = s.g.add_param(name.clone(), value.ty.clone());
                if let Some(&Some(d)) = tp.params.get(name) {
                    s.g.values[v.0 as usize].ty.layout.shards[d] = vec![Axis::Tp];
                }
                if s.ep && tensor_parallel::stacked(s.g.ty(v)) {
                    s.g.values[v.0 as usize].ty.layout.shards[0] = vec![Axis::Ep];
                }
                map.insert(id, v);
            }
            ValueDef::Op(op_id, 0) => {
                let op = &old.ops[op_id.0 as usize];
                s.cur = op_id.0 as usize;
                s.sub = 0;
                let ins: Vec<ValueId> = op.inputs.iter().map(|v| map[v]).collect();
                let outs = s.emit(&op.kind, ins, &op.path)?;
                for (o, n) in op.outputs.iter().zip(outs) {
                    map.insert(*o, n);
                }
            }
            ValueDef::Op(..) => {}
        }
    }
    s.g.outputs = old
        .outputs
        .iter()
        .map(|(n, v)| (n.clone(), map[v]))
        .collect();
    // A parameter's gradient must be laid out like the parameter.
    let params: HashMap<String, ValueId> =
        s.g.params().map(|(v, n, _)| (n.to_string(), v)).collect();
    for (name, v) in s.g.outputs.clone() {
        if let Some(pname) = name.strip_prefix("grad:") {
            // Partial gradients (norm weights under sequence parallelism) are reduced by the
            // optimizer pass; a split must match the parameter's.
            let (pg, pp) = (s.tp_state(v), s.tp_state(params[pname]));
            if pg != pp && pg != Dist::P {
                return Err(PassError::Autodiff(format!(
                    "shard: the gradient of {pname} is {pg:?} over tp but the parameter is {pp:?}"
                )));
            }
        }
    }
    Ok(Laid {
        tags: s.tags,
        map,
        departures: s.departures,
    })
}

/// What [`lay_out`] returns: for each op of the new graph emitted for an op of the old one
/// (not a conversion), (that op, which of its emitted ops); every old value's new value;
/// and the ops emitted in a layout the extracted term does not give them.
struct Laid {
    tags: HashMap<usize, (usize, usize)>,
    map: HashMap<ValueId, ValueId>,
    departures: Vec<String>,
}

/// `g` with each chain of gradient sums reordered so that the contributions tensor
/// parallelism leaves as partial sums (laid out with `tp_params`) are added to each other
/// first and reduced once, the whole ones after, where that saves a reduction (`None`
/// where it saves none anywhere, the graph then used as it is). The sum is rebuilt where its last
/// contribution is ready, with the paths of its ops in their order. (The autodiff adds
/// contributions as the backward reaches them; where a whole one comes first, as the
/// shared-expert gate's before the experts', every partial one after it was reduced on its
/// own.) The caller places the rebuilt graph again, so the term holds its sums as they are.
fn sum_partials_first(
    g: &Graph,
    spec: &ModelSpec,
    tp: &tensor_parallel::Placement,
) -> Result<Option<Graph>, PassError> {
    if spec.parallel.tp <= 1 {
        return Ok(None);
    }
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    let mut readers: HashMap<ValueId, usize> = HashMap::new();
    for (i, op) in g.ops.iter().enumerate() {
        for &o in &op.outputs {
            producer.insert(o, i);
        }
        for &x in &op.inputs {
            *readers.entry(x).or_default() += 1;
        }
    }
    let outputs: std::collections::HashSet<ValueId> = g.outputs.iter().map(|(_, v)| *v).collect();
    let is_sum = |i: usize| matches!(g.ops[i].kind, OpKind::GradSum);
    // Op i continues the chain of the sum producing its first operand.
    let inner = |i: usize| -> Option<usize> {
        let a = g.ops[i].inputs[0];
        producer
            .get(&a)
            .copied()
            .filter(|&k| is_sum(k) && readers.get(&a) == Some(&1) && !outputs.contains(&a))
    };
    let continued: std::collections::HashSet<usize> = (0..g.ops.len())
        .filter(|&i| is_sum(i))
        .filter_map(inner)
        .collect();
    let mut chains: Vec<(Vec<usize>, Vec<ValueId>)> = Vec::new();
    for head in (0..g.ops.len()).filter(|&i| is_sum(i) && !continued.contains(&i)) {
        let mut ops = vec![head];
        while let Some(k) = inner(*ops.last().expect("a sum")) {
            ops.push(k);
        }
        ops.reverse();
        let mut leaves = vec![g.ops[ops[0]].inputs[0]];
        leaves.extend(ops.iter().map(|&i| g.ops[i].inputs[1]));
        chains.push((ops, leaves));
    }
    if chains.iter().all(|(ops, _)| ops.len() < 2) {
        return Ok(None);
    }
    let mut tp_only = Graph::new(g.name.clone(), g.mesh.clone());
    let laid = lay_out(&mut tp_only, g, spec, true, None, tp)?;
    let partial = |v: ValueId| tp_only.ty(laid.map[&v]).layout.partial.contains(&Axis::Tp);
    // The chains to rebuild, by their last op: (their ops, the contributions reordered).
    let mut rebuilt: HashMap<usize, (Vec<usize>, Vec<ValueId>)> = HashMap::new();
    let mut dropped: std::collections::HashSet<usize> = std::collections::HashSet::new();
    for (ops, leaves) in chains {
        let (mut order, whole): (Vec<ValueId>, Vec<ValueId>) =
            leaves.iter().partition(|&&v| partial(v));
        if order.is_empty() || whole.is_empty() {
            continue;
        }
        order.extend(whole);
        // Left to right, a leading run of partial contributions is reduced once, every
        // partial one after a whole one on its own; partial ones first: once.
        let lead = leaves.iter().take_while(|&&v| partial(v)).count();
        let after = leaves[lead..].iter().filter(|&&v| partial(v)).count();
        if usize::from(lead > 0) + after <= 1 {
            continue;
        }
        dropped.extend(ops.iter().copied());
        rebuilt.insert(*ops.last().expect("a sum"), (ops, order));
    }
    if rebuilt.is_empty() {
        return Ok(None);
    }
    let mut out = Graph::new(g.name.clone(), g.mesh.clone());
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    for (i, value) in g.values.iter().enumerate() {
        let id = ValueId(i as u32);
        match &value.def {
            ValueDef::Input(name) => {
                map.insert(id, out.add_input(name.clone(), value.ty.clone()));
            }
            ValueDef::Param(name) => {
                map.insert(id, out.add_param(name.clone(), value.ty.clone()));
            }
            ValueDef::Op(op_id, 0) => {
                let i = op_id.0 as usize;
                let op = &g.ops[i];
                if let Some((ops, order)) = rebuilt.get(&i) {
                    let mut acc = map[&order[0]];
                    for (&k, &x) in ops.iter().zip(&order[1..]) {
                        acc = out.add_op1(OpKind::GradSum, &[acc, map[&x]], &g.ops[k].path)?;
                    }
                    map.insert(op.outputs[0], acc);
                } else if !dropped.contains(&i) {
                    let ins: Vec<ValueId> = op.inputs.iter().map(|v| map[v]).collect();
                    let outs = out.add_op(op.kind.clone(), &ins, &op.path)?;
                    for (o, n) in op.outputs.iter().zip(outs) {
                        map.insert(*o, n);
                    }
                }
            }
            ValueDef::Op(..) => {}
        }
    }
    out.outputs = g.outputs.iter().map(|(n, v)| (n.clone(), map[v])).collect();
    Ok(Some(out))
}

/// Mark `l` with tp layout `d` (a layout of the algebra: never `Invalid`, which marks
/// nothing).
fn mark_tp(l: &mut Layout, d: Dist) {
    match d {
        Dist::R | Dist::Invalid => {}
        Dist::S(d) => l.shards[d].push(Axis::Tp),
        Dist::P => l.partial.push(Axis::Tp),
    }
}

fn batch_dim(g: &Graph, v: ValueId) -> Option<usize> {
    g.ty(v)
        .dims
        .iter()
        .position(|d| d.name == "b" || d.name == "tokens")
}

struct Sharder<'a> {
    g: &'a mut Graph,
    /// The extracted term's choice for each token-wise op: on sequence shards or whole.
    placed: Option<HashMap<(usize, usize), bool>>,
    /// The op of the input graph being emitted, and how many ops were emitted for it.
    cur: usize,
    sub: usize,
    /// Inside a conversion (all-reduce, gather, slice, ...): its ops carry no tag.
    converting: bool,
    /// See [`lay_out`]'s result.
    tags: HashMap<usize, (usize, usize)>,
    /// Ops the extracted term holds but not in a layout their operands reach (see
    /// [`Self::strategy`]): none on every configuration the tests compile.
    departures: Vec<String>,
    tp: bool,
    dp: bool,
    /// Context parallelism: the sequence is split over cp everywhere (load-balanced chunks).
    cp: bool,
    /// Sequence parallelism: token-wise ops run on sequence shards where the collective
    /// rewrites placed them, the vocab-parallel embedding's output is reduce-scattered.
    sp: bool,
    /// Values already made whole: each conversion is inserted once and reused.
    whole_of: HashMap<ValueId, ValueId>,
    /// Values already split along the sequence.
    seq_of: HashMap<ValueId, ValueId>,
    /// Whole values already sliced over tp, by value and dim.
    slice_of: HashMap<(ValueId, usize), ValueId>,
    /// The tp size.
    n: u64,
    /// The ep size.
    ep_n: u64,
    /// The extracted tensor-parallel term's choice for each op of the graph laid out: the
    /// layouts of its operands ([`tensor_parallel::Placement::ops`]).
    choices: &'a BTreeMap<usize, Vec<tensor_parallel::Operands>>,
    /// Expert parallelism: stacked experts split over ep.
    ep: bool,
    /// Whether several ranks hold the same experts (dp·cp > ep).
    edp: bool,
    /// Per MoE block (path prefix), the token counts of its dispatch (sizes the all-to-all).
    counts_of: HashMap<String, ValueId>,
    /// Expert tokens already sent to their experts' ranks.
    experts_of: HashMap<ValueId, ValueId>,
    /// Expert outputs already brought back to their tokens' ranks.
    tokens_of: HashMap<ValueId, ValueId>,
}

/// The MoE block of an op's path (`model.layers.0.block_sparse_moe`; Qwen2-MoE's
/// `model.layers.0.mlp`).
fn moe_block(path: &str) -> &str {
    for block in ["block_sparse_moe", ".mlp."] {
        if let Some(i) = path.find(block) {
            return &path[..i + block.trim_end_matches('.').len()];
        }
    }
    path
}

impl Sharder<'_> {
    fn layout(&self, v: ValueId) -> &Layout {
        &self.g.ty(v).layout
    }

    fn tp_state(&self, v: ValueId) -> Dist {
        let l = self.layout(v);
        if l.partial.contains(&Axis::Tp) {
            return Dist::P;
        }
        match l.shards.iter().position(|s| s.contains(&Axis::Tp)) {
            Some(d) => Dist::S(d),
            None => Dist::R,
        }
    }

    /// Append an op, set its results' layouts (tp as given, dp by the batch rule).
    fn op(
        &mut self,
        kind: OpKind,
        ins: &[ValueId],
        path: &str,
        tp: &[Dist],
    ) -> Result<Vec<ValueId>, PassError> {
        let dp_in = self.dp
            && ins.iter().any(|&x| {
                let l = self.layout(x);
                l.partial.contains(&Axis::Dp) || l.shards.iter().any(|s| s.contains(&Axis::Dp))
            });
        let cp_in = self.cp
            && ins.iter().any(|&x| {
                let l = self.layout(x);
                l.partial.contains(&Axis::Cp) || l.shards.iter().any(|s| s.contains(&Axis::Cp))
            });
        let outs = self.g.add_op(kind, ins, path)?;
        if !self.converting {
            self.tags.insert(self.g.ops.len() - 1, (self.cur, self.sub));
            self.sub += 1;
        }
        for (k, &o) in outs.iter().enumerate() {
            let bd = batch_dim(self.g, o);
            let sd = self.seq_dim(o);
            let t = tp.get(k).copied().unwrap_or(Dist::R);
            let l = &mut self.g.values[o.0 as usize].ty.layout;
            mark_tp(l, t);
            if dp_in {
                match bd {
                    Some(d) => l.shards[d].insert(0, Axis::Dp),
                    None => l.partial.insert(0, Axis::Dp),
                }
            }
            // Context parallelism: the sequence stays split over cp (outermost), and what
            // has no sequence dim (parameter gradients, the loss) is a partial sum over cp.
            if cp_in {
                match (sd, bd) {
                    (Some(d), _) => l.shards[d].insert(0, Axis::Cp),
                    // MoE token rows: this rank's tokens, split over cp like the sequence.
                    (None, Some(d)) => l.shards[d].push(Axis::Cp),
                    (None, None) => l.partial.push(Axis::Cp),
                }
            }
        }
        Ok(outs)
    }

    fn op1(
        &mut self,
        kind: OpKind,
        ins: &[ValueId],
        path: &str,
        tp: Dist,
    ) -> Result<ValueId, PassError> {
        Ok(self.op(kind, ins, path, &[tp])?[0])
    }

    /// `v` made whole over tp (the conversion is inserted once per value).
    fn whole(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        if let Some(&w) = self.whole_of.get(&v) {
            return Ok(w);
        }
        let w = self.convert_whole(v, path)?;
        self.whole_of.insert(v, w);
        Ok(w)
    }

    fn convert_whole(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        let w = self.convert_whole_tp(v, path)?;
        if w != v && self.ep && tensor_parallel::stacked(self.g.ty(v)) {
            // Stacked expert tokens keep their place over ep (and dp, cp, edp).
            let mut l = self.layout(v).clone();
            for s in &mut l.shards {
                s.retain(|&a| a != Axis::Tp);
            }
            l.partial.retain(|&a| a != Axis::Tp);
            self.g.values[w.0 as usize].ty.layout = l;
        }
        Ok(w)
    }

    fn convert_whole_tp(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        let was = std::mem::replace(&mut self.converting, true);
        let w = self.convert_whole_tp_inner(v, path);
        self.converting = was;
        w
    }

    fn convert_whole_tp_inner(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        match self.tp_state(v) {
            Dist::R | Dist::Invalid => Ok(v),
            Dist::P => self.op1(
                OpKind::AllReduce {
                    axes: vec![Axis::Tp],
                },
                &[v],
                path,
                Dist::R,
            ),
            Dist::S(d) => self.op1(
                OpKind::AllGather {
                    axes: vec![Axis::Tp],
                    dim: d as u64,
                },
                &[v],
                path,
                Dist::R,
            ),
        }
    }

    /// `v` (whole) sliced to this rank's part along `dim` (a local copy; the conversion is
    /// inserted once per value and dim).
    fn slice(&mut self, v: ValueId, dim: usize, path: &str) -> Result<ValueId, PassError> {
        if let Some(&w) = self.slice_of.get(&(v, dim)) {
            return Ok(w);
        }
        let was = std::mem::replace(&mut self.converting, true);
        let w = self.op1(
            OpKind::Slice {
                axes: vec![Axis::Tp],
                dim: dim as u64,
            },
            &[v],
            path,
            Dist::S(dim),
        );
        self.converting = was;
        let w = w?;
        if self.ep && tensor_parallel::stacked(self.g.ty(v)) {
            // Stacked expert values keep their place over ep (and dp, cp, edp).
            let mut l = self.layout(v).clone();
            l.shards[dim].push(Axis::Tp);
            self.g.values[w.0 as usize].ty.layout = l;
        }
        self.slice_of.insert((v, dim), w);
        Ok(w)
    }

    /// The sequence dim of `v`, if it has one.
    fn seq_dim(&self, v: ValueId) -> Option<usize> {
        self.g.ty(v).dims.iter().position(|d| d.name == "s")
    }

    /// `v` split over tp along the sequence (sequence parallelism): a partial sum is
    /// reduce-scattered, a whole value sliced locally.
    fn seq_shard(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        let Some(d) = self.seq_dim(v) else {
            return self.whole(v, path);
        };
        if let Some(&w) = self.seq_of.get(&v) {
            return Ok(w);
        }
        let axes = vec![Axis::Tp];
        let dim = d as u64;
        let was = std::mem::replace(&mut self.converting, true);
        let w = match self.tp_state(v) {
            Dist::S(x) if x == d => Ok(v),
            Dist::P => self.op1(OpKind::ReduceScatter { axes, dim }, &[v], path, Dist::S(d)),
            Dist::R | Dist::Invalid => {
                self.op1(OpKind::Slice { axes, dim }, &[v], path, Dist::S(d))
            }
            Dist::S(_) => self.whole(v, path).and_then(|whole| {
                self.op1(OpKind::Slice { axes, dim }, &[whole], path, Dist::S(d))
            }),
        };
        self.converting = was;
        let w = w?;
        self.seq_of.insert(v, w);
        Ok(w)
    }

    /// Emit `kind` on operands `ins`; returns the results. A token-wise op the collective
    /// rewrites put on sequence shards is emitted so ([`Self::emit_on_shards`]); every
    /// other op as the extracted term says ([`Self::emit_tp`]; under expert parallelism,
    /// every op with a stacked expert operand or result, on whichever side of ep its
    /// layout algebra and the term put it).
    fn emit(
        &mut self,
        kind: &OpKind,
        ins: Vec<ValueId>,
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let experts = self.ep && {
            let outs = self.infer(kind, &ins, path)?;
            ins.iter()
                .map(|&x| self.g.ty(x))
                .chain(&outs)
                .any(tensor_parallel::stacked)
        };
        if experts {
            return self.emit_tp(kind, &ins, path);
        }
        if !self.tp {
            let n = self.op(kind.clone(), &ins, path, &[])?;
            return Ok(n);
        }
        if collectives::token_wise(kind) && self.placed_on_shards() {
            return self.emit_on_shards(kind, &ins, path);
        }
        // The gradient of a bias added on sequence shards sums this rank's tokens.
        if matches!(kind, OpKind::BiasGrad)
            && self
                .seq_dim(ins[0])
                .is_some_and(|d| self.tp_state(ins[0]) == Dist::S(d))
        {
            return self.op(kind.clone(), &ins, path, &[Dist::P]);
        }
        self.emit_tp(kind, &ins, path)
    }

    /// Whether the extracted term runs the next op emitted for the current one on sequence
    /// shards (never without sequence parallelism or before the rewrites ran).
    fn placed_on_shards(&self) -> bool {
        self.sp
            && self
                .placed
                .as_ref()
                .and_then(|p| p.get(&(self.cur, self.sub)))
                .copied()
                .unwrap_or(false)
    }

    /// A token-wise op ([`collectives::token_wise`]) on sequence shards, where the extracted
    /// term put it: every operand with a sequence dim on shards (a partial sum
    /// reduce-scattered, a whole value sliced), the others whole; results with a sequence
    /// dim on shards, the others (sums over the tokens) partial sums.
    fn emit_on_shards(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let mut args = Vec::with_capacity(ins.len());
        for &x in ins {
            args.push(match self.seq_dim(x) {
                Some(_) => self.seq_shard(x, path)?,
                None => self.whole(x, path)?,
            });
        }
        let tys: Vec<&megac_ir::TensorType> = args.iter().map(|&x| self.g.ty(x)).collect();
        let outs = megac_ir::infer::infer_types(kind, &tys).map_err(|message| {
            PassError::Ir(megac_ir::IrError::Type {
                op: kind.name().to_string(),
                path: path.to_string(),
                message,
            })
        })?;
        let tp: Vec<Dist> = outs
            .iter()
            .map(|t| match t.dims.iter().position(|d| d.name == "s") {
                Some(d) => Dist::S(d),
                None => Dist::P,
            })
            .collect();
        self.op(kind.clone(), &args, path, &tp)
    }

    /// Which side of ep `v` is on: the experts' ranks where its experts dim is split over
    /// ep.
    fn side(&self, v: ValueId) -> Ep {
        if self.ep && tensor_parallel::stacked(self.g.ty(v)) && self.on_experts(v) {
            Ep::Experts
        } else {
            Ep::Tokens
        }
    }

    /// The result types of `kind` on `ins`.
    fn infer(
        &self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<TensorType>, PassError> {
        let tys: Vec<&TensorType> = ins.iter().map(|&x| self.g.ty(x)).collect();
        infer_types(kind, &tys).map_err(|message| {
            PassError::Ir(megac_ir::IrError::Type {
                op: kind.name().to_string(),
                path: path.to_string(),
                message,
            })
        })
    }

    /// The strategy of `kind`'s layout algebra ([`tensor_parallel::strategies`]) the op
    /// runs under: the first the extracted term gives the current op whose operand layouts
    /// the emitted operands can be converted to (a partial sum stays one, a whole value can
    /// be sliced, anything made whole; expert tokens moved to either side of ep). An op the
    /// term does not hold (a result nobody reads) runs on its operands as they are where the
    /// algebra lists that, else whole; an op the term holds in no layout its operands reach
    /// is recorded in `departures` and run so too (and see the disagreement below).
    fn strategy(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<tensor_parallel::Strategy, PassError> {
        let outs = self.infer(kind, ins, path)?;
        let tys: Vec<&TensorType> = ins.iter().map(|&x| self.g.ty(x)).collect();
        let outs: Vec<&TensorType> = outs.iter().collect();
        let mut all = tensor_parallel::strategies(kind, &tys, &outs, self.n, self.ep_n);
        let now = tensor_parallel::Operands {
            tp: ins.iter().map(|&x| self.tp_state(x)).collect(),
            ep: ins.iter().map(|&x| self.side(x)).collect(),
        };
        let reachable = |want: &tensor_parallel::Operands| {
            let tp = now
                .tp
                .iter()
                .zip(&want.tp)
                .all(|(&have, &want)| match want {
                    Dist::R => true,
                    Dist::S(d) => have == Dist::S(d) || have == Dist::R,
                    Dist::P => have == Dist::P,
                    Dist::Invalid => false,
                });
            let ep = ins
                .iter()
                .zip(now.ep.iter().zip(&want.ep))
                .all(|(&x, (a, b))| a == b || tensor_parallel::expert_tokens(self.g.ty(x)));
            tp && ep
        };
        let chosen = self.choices.get(&self.cur).and_then(|c| {
            c.iter()
                .filter(|ins| reachable(ins))
                .find_map(|ins| all.iter().position(|s| s.takes(ins)))
        });
        let fits = all.iter().position(|s| s.takes(&now));
        let k = match chosen {
            Some(k) => k,
            None => {
                if self.choices.contains_key(&self.cur) {
                    self.departures.push(format!("{} at {path}", kind.name()));
                }
                fits.unwrap_or(0)
            }
        };
        // Where the operands fit another strategy as they are and the term's choice would
        // move them (an all-reduce, all-gather or all-to-all they do not need), the op runs
        // as they are and the disagreement is recorded (tests: none but the ones they list).
        let mut k = k;
        if let Some(f) = fits.filter(|&f| f != k && chosen.is_some()) {
            let s = &all[k];
            let moves = now
                .tp
                .iter()
                .zip(&s.ins)
                .enumerate()
                .any(|(i, (&have, &want))| {
                    let want = if s.gathers.contains(&i) {
                        Dist::R
                    } else {
                        want
                    };
                    (want == Dist::R && have != Dist::R) || now.ep[i] != s.ep_ins[i]
                });
            if moves {
                self.departures.push(format!(
                    "{} at {path}: the term's {:?} moves operands that fit {:?} as they are",
                    kind.name(),
                    s.ins,
                    all[f].ins
                ));
                k = f;
            }
        }
        Ok(all.swap_remove(k))
    }

    /// An op laid out by its layout algebra ([`Self::strategy`]): each operand converted to
    /// the strategy's layout, first over ep (expert tokens on the other side moved by an
    /// all-to-all, [`Self::all_to_all`]), then over tp (all-reduced or all-gathered whole,
    /// sliced from whole, kept; an operand the op gathers itself made whole first); the
    /// results in its result layouts (stacked expert results also over ep and the
    /// expert-data-parallel group, [`Self::set_expert_layout`]: a result without token rows
    /// computed from the experts' token rows, an expert weight's gradient, is a pending sum
    /// over edp). Two ops have more to them than their layouts: a linear with a bias whose
    /// product is a partial sum adds the bias after the reduction (once; on sequence shards
    /// where the collective rewrites put that add, as Megatron reduce-scatters), and under
    /// sequence parallelism the vocab-parallel embedding's partial sum is reduce-scattered
    /// onto sequence shards at once (the residual stream starts on them, as Megatron's).
    fn emit_tp(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let s = self.strategy(kind, ins, path)?;
        let mut args = Vec::with_capacity(ins.len());
        for (i, (&x, &want)) in ins.iter().zip(&s.ins).enumerate() {
            let x = if self.side(x) == s.ep_ins[i] {
                x
            } else {
                self.all_to_all(x, path, s.ep_ins[i] == Ep::Experts)?
            };
            let want = if s.gathers.contains(&i) {
                Dist::R
            } else {
                want
            };
            args.push(match (want, self.tp_state(x)) {
                (Dist::R, _) => self.whole(x, path)?,
                (Dist::S(d), Dist::R) => self.slice(x, d, path)?,
                _ => x,
            });
        }
        let outs = &s.outs;
        if matches!(kind, OpKind::Linear { .. }) && args.len() == 3 && outs[0] == Dist::P {
            let partial = self.op1(kind.clone(), &args[..2], path, Dist::P)?;
            let bias = args[2];
            if self.placed_on_shards() {
                return self.emit_on_shards(&OpKind::BiasAdd, &[partial, bias], path);
            }
            let whole = self.whole(partial, path)?;
            return Ok(vec![self.op1(
                OpKind::BiasAdd,
                &[whole, bias],
                path,
                Dist::R,
            )?]);
        }
        let edp_in = self.edp
            && args.iter().any(|&x| {
                let l = self.layout(x);
                l.partial.contains(&Axis::Edp) || l.shards.iter().any(|s| s.contains(&Axis::Edp))
            });
        let ys = self.op(kind.clone(), &args, path, outs)?;
        if let OpKind::DispatchExperts { .. } = kind {
            // Its token counts (this rank's, per expert) size the block's all-to-alls.
            self.g.values[ys[1].0 as usize].ty.layout = Layout::replicated(1);
            self.counts_of.insert(moe_block(path).to_string(), ys[1]);
        }
        for (k, &y) in ys.iter().enumerate() {
            if !(self.ep && tensor_parallel::stacked(self.g.ty(y))) {
                continue;
            }
            let on_experts = s.ep_outs[k] == Ep::Experts;
            if tensor_parallel::expert_tokens(self.g.ty(y)) {
                self.set_expert_layout(y, on_experts, outs[k]);
                continue;
            }
            let rank = self.g.ty(y).dims.len();
            let l = &mut self.g.values[y.0 as usize].ty.layout;
            *l = Layout::replicated(rank);
            if on_experts {
                l.shards[0].push(Axis::Ep);
            }
            mark_tp(l, outs[k]);
            if edp_in {
                l.partial.push(Axis::Edp);
            }
        }
        if self.sp && matches!(kind, OpKind::Embedding) && outs[0] == Dist::P {
            return Ok(vec![self.seq_shard(ys[0], path)?]);
        }
        Ok(ys)
    }
    /// Whether `v` (stacked experts) is split over ep, i.e. lives on its experts' ranks.
    fn on_experts(&self, v: ValueId) -> bool {
        self.layout(v).shards[0].contains(&Axis::Ep)
    }

    /// Layout of stacked expert tokens: on the experts' ranks (experts split over ep, the
    /// token rows of the ep group) or on the tokens' ranks (this rank's tokens); `tp` says
    /// where they stand over tp (expert tensor parallelism: the ffn dim split, or the
    /// experts' outputs partial sums).
    fn set_expert_layout(&mut self, v: ValueId, on_experts: bool, tp: Dist) {
        let tokens = if on_experts {
            if self.edp {
                vec![Axis::Edp]
            } else {
                Vec::new()
            }
        } else {
            let mut t = Vec::new();
            if self.dp {
                t.push(Axis::Dp);
            }
            if self.cp {
                t.push(Axis::Cp);
            }
            t
        };
        let experts = if on_experts {
            vec![Axis::Ep]
        } else {
            Vec::new()
        };
        let l = &mut self.g.values[v.0 as usize].ty.layout;
        l.shards = vec![experts, tokens, Vec::new()];
        l.partial.clear();
        mark_tp(l, tp);
    }

    /// The all-to-all over ep that moves stacked expert tokens `v` to their experts' ranks
    /// (`to_experts`) or back to their tokens' ranks.
    fn all_to_all(
        &mut self,
        v: ValueId,
        path: &str,
        to_experts: bool,
    ) -> Result<ValueId, PassError> {
        let cache = if to_experts {
            &self.experts_of
        } else {
            &self.tokens_of
        };
        if let Some(&w) = cache.get(&v) {
            return Ok(w);
        }
        if self.on_experts(v) == to_experts {
            return Ok(v);
        }
        if !tensor_parallel::expert_tokens(self.g.ty(v)) {
            return Err(PassError::Autodiff(format!(
                "shard: {path}: only expert tokens move between the tokens' and the experts' ranks"
            )));
        }
        let counts = *self.counts_of.get(moe_block(path)).ok_or_else(|| {
            PassError::Autodiff(format!(
                "shard: {path}: expert tokens without the dispatch that counts them"
            ))
        })?;
        // The exchange runs within each tp rank's ep group: its tp layout stays.
        let tp = self.tp_state(v);
        let (split, concat) = if to_experts { (0, 1) } else { (1, 0) };
        let w = self.g.add_op1(
            OpKind::AllToAll {
                axes: vec![Axis::Ep],
                split,
                concat,
            },
            &[v, counts],
            path,
        )?;
        self.set_expert_layout(w, to_experts, tp);
        if to_experts {
            self.experts_of.insert(v, w);
        } else {
            self.tokens_of.insert(v, w);
        }
        Ok(w)
    }
}
