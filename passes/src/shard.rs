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
//!   over the vocabulary, the rest whole. Every op then has a layout rule
//!   (heads stay sharded through RoPE and attention, a row-parallel linear gives a partial
//!   sum, a column-parallel linear's input gradient is a partial sum, ...). Where an op
//!   needs an operand in another layout, the pass inserts the collective that converts it:
//!   `all_reduce` for a partial sum that must be whole, `all_gather` for a shard that must be
//!   whole. A row-parallel linear's bias is split off into a `bias_add` after the reduction,
//!   so it is added once. Vocab-parallel embedding and cross-entropy are the ordinary ops
//!   on a vocab-sharded table/logits; the runtime reads the layout and reduces over tp.
//!   Before the layout, each chain of gradient sums that mixes partial contributions (an
//!   expert's, a column-parallel linear's input gradient) with whole ones (the router's) is
//!   reordered so the partial ones are added first and reduced once
//!   (`sum_partials_first`).
//!
//! - **Expert parallelism** (Megatron's MoE parallel folding): stacked expert weights
//!   (`[experts, ..]`) are split over `ep` along the experts dim. Tokens dispatched to all
//!   experts (`dispatch_experts`, `[experts, tokens, h]`, this rank's tokens) go to their
//!   experts' ranks with an `all_to_all` over ep (experts split over `ep`, the token rows of
//!   the whole ep group: `tokens` marked `edp`), and come back with the mirror all-to-all
//!   before `combine_experts`; backward mirrors both. Expert weight gradients are pending
//!   sums over the expert-data-parallel group (`Partial(edp)`), the other gradients over dp
//!   (and cp) as before.
//! - **Expert tensor parallelism** (Megatron's ETP = tp): experts are tensor-parallel over
//!   tp like a dense MLP, per expert (`experts.{j}.w1/w2/w3`, ep = 1) or stacked (ep > 1):
//!   w1 and w3 column-parallel (the ffn dim split), w2 row-parallel (its ffn input split).
//!   The router stays replicated over tp (the tp ranks of a group route the same tokens, so
//!   their dispatches agree); each expert's output is a partial sum over tp, the combine is
//!   linear in them, and its result is reduced once (all-reduce, or reduce-scatter to
//!   sequence shards under sequence parallelism). Backward mirrors it: the experts' output
//!   gradients are whole, their token gradients partial (summed with the router's whole
//!   contribution on sequence shards under sp), and the router-weight gradient, a dot
//!   product with the partial expert outputs, is all-reduced (`[b, s, top_k]`).
//! - **Context parallelism** with MoE: routing, dispatch and combine work on the rank's own
//!   tokens (MoE token rows are split over cp like the sequence).

use std::collections::{BTreeMap, HashMap};

use megac_ir::spec::ModelSpec;
use megac_ir::{Axis, Graph, Layout, OpKind, ValueDef, ValueId, WeightLayout};

use crate::{collectives, tensor_parallel, PassError};

/// Where a value stands with respect to the tensor-parallel axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tp {
    /// Whole on every tp rank.
    R,
    /// Split over tp along this dim.
    S(usize),
    /// Each tp rank holds a partial sum.
    P,
}

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
    let sp = p.tp > 1 && p.sequence_parallel;
    let tp_params = tensor_parallel_params(&old, spec, &tensor_parallel::rules())?;
    let old = sum_partials_first(&old, spec, &tp_params)?.unwrap_or(old);
    let placed = if sp {
        Some(sp_placement(&old, spec, &collectives::rules(), &tp_params)?.on_shards)
    } else {
        None
    };
    lay_out(g, &old, spec, sp, placed, &tp_params)?;
    Ok(())
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
    Ok(
        tensor_parallel::place(g, spec.parallel.tp, micro_batch, rules)
            .map_err(PassError::Collectives)?
            .params,
    )
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
    let tp_params = tensor_parallel_params(g, spec, &tensor_parallel::rules())?;
    match sum_partials_first(g, spec, &tp_params)? {
        Some(g) => sp_placement(&g, spec, rules, &tp_params),
        None => sp_placement(g, spec, rules, &tp_params),
    }
}

fn sp_placement(
    g: &Graph,
    spec: &ModelSpec,
    rules: &[egg::Rewrite<collectives::Coll, collectives::Layouts>],
    tp_params: &BTreeMap<String, Option<usize>>,
) -> Result<collectives::Placement, PassError> {
    let mut tp_only = Graph::new(g.name.clone(), g.mesh.clone());
    let tags = lay_out(&mut tp_only, g, spec, true, None, tp_params)?.tags;
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
    tp_params: &BTreeMap<String, Option<usize>>,
) -> Result<Laid, PassError> {
    let p = &spec.parallel;
    let mut s = Sharder {
        g,
        placed,
        cur: 0,
        sub: 0,
        converting: false,
        tags: HashMap::new(),
        tp: p.tp > 1,
        dp: p.dp > 1,
        cp: p.cp > 1,
        sp,
        whole_of: HashMap::new(),
        seq_of: HashMap::new(),
        head_slice_of: HashMap::new(),
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
                if let Some(&Some(d)) = tp_params.get(name) {
                    s.g.values[v.0 as usize].ty.layout.shards[d] = vec![Axis::Tp];
                }
                if s.ep && s.is_experts(v) {
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
            if pg != pp && pg != Tp::P {
                return Err(PassError::Autodiff(format!(
                    "shard: the gradient of {pname} is {pg:?} over tp but the parameter is {pp:?}"
                )));
            }
        }
    }
    Ok(Laid { tags: s.tags, map })
}

/// What [`lay_out`] returns: for each op of the new graph emitted for an op of the old one
/// (not a conversion), (that op, which of its emitted ops); and every old value's new value.
struct Laid {
    tags: HashMap<usize, (usize, usize)>,
    map: HashMap<ValueId, ValueId>,
}

/// `g` with each chain of gradient sums reordered so that the contributions tensor
/// parallelism leaves as partial sums (laid out with `tp_params`) are added to each other
/// first and reduced once, the whole ones after, where that saves a reduction (`None`
/// where it saves none anywhere, the graph then used as it is). The sum is rebuilt where its last
/// contribution is ready, with the paths of its ops in their order. (The autodiff adds
/// contributions as the backward reaches them; where a whole one comes first, as the
/// shared-expert gate's before the experts', every partial one after it was reduced on its
/// own.)
fn sum_partials_first(
    g: &Graph,
    spec: &ModelSpec,
    tp_params: &BTreeMap<String, Option<usize>>,
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
    let laid = lay_out(&mut tp_only, g, spec, true, None, tp_params)?;
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
    /// Repeated key/value heads already sliced to this rank's query heads.
    head_slice_of: HashMap<ValueId, ValueId>,
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

    fn tp_state(&self, v: ValueId) -> Tp {
        let l = self.layout(v);
        if l.partial.contains(&Axis::Tp) {
            return Tp::P;
        }
        match l.shards.iter().position(|s| s.contains(&Axis::Tp)) {
            Some(d) => Tp::S(d),
            None => Tp::R,
        }
    }

    fn rank(&self, v: ValueId) -> usize {
        self.g.ty(v).dims.len()
    }

    /// Append an op, set its results' layouts (tp as given, dp by the batch rule).
    fn op(
        &mut self,
        kind: OpKind,
        ins: &[ValueId],
        path: &str,
        tp: &[Tp],
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
            let t = tp.get(k).copied().unwrap_or(Tp::R);
            let l = &mut self.g.values[o.0 as usize].ty.layout;
            match t {
                Tp::R => {}
                Tp::S(d) => l.shards[d].push(Axis::Tp),
                Tp::P => l.partial.push(Axis::Tp),
            }
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
        tp: Tp,
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
        if w != v && self.ep && self.is_experts(v) {
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
            Tp::R => Ok(v),
            Tp::P => self.op1(
                OpKind::AllReduce {
                    axes: vec![Axis::Tp],
                },
                &[v],
                path,
                Tp::R,
            ),
            Tp::S(d) => self.op1(
                OpKind::AllGather {
                    axes: vec![Axis::Tp],
                    dim: d as u64,
                },
                &[v],
                path,
                Tp::R,
            ),
        }
    }

    /// `v` (whole, `[b, s, heads, d]`) sliced to this rank's heads.
    fn head_slice(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        if let Some(&w) = self.head_slice_of.get(&v) {
            return Ok(w);
        }
        let was = std::mem::replace(&mut self.converting, true);
        let w = self.op1(
            OpKind::Slice {
                axes: vec![Axis::Tp],
                dim: 2,
            },
            &[v],
            path,
            Tp::S(2),
        );
        self.converting = was;
        let w = w?;
        self.head_slice_of.insert(v, w);
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
            Tp::S(x) if x == d => Ok(v),
            Tp::P => self.op1(OpKind::ReduceScatter { axes, dim }, &[v], path, Tp::S(d)),
            Tp::R => self.op1(OpKind::Slice { axes, dim }, &[v], path, Tp::S(d)),
            Tp::S(_) => self
                .whole(v, path)
                .and_then(|whole| self.op1(OpKind::Slice { axes, dim }, &[whole], path, Tp::S(d))),
        };
        self.converting = was;
        let w = w?;
        self.seq_of.insert(v, w);
        Ok(w)
    }

    /// `v` whole, unless it is already sharded (kept as is).
    fn not_partial(&mut self, v: ValueId, path: &str) -> Result<ValueId, PassError> {
        match self.tp_state(v) {
            Tp::P => self.whole(v, path),
            _ => Ok(v),
        }
    }

    /// Emit `kind` on operands `ins` with the layout rules; returns the results. Expert
    /// parallelism's rules come first ([`Self::emit_expert`]), then tp's, one op family a
    /// function; an op no family claims runs on whole operands ([`Self::emit_whole`]).
    fn emit(
        &mut self,
        kind: &OpKind,
        ins: Vec<ValueId>,
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        if self.ep {
            if let Some(outs) = self.emit_expert(kind, &ins, path)? {
                return Ok(outs);
            }
        }
        if !self.tp {
            let n = self.op(kind.clone(), &ins, path, &[])?;
            return Ok(n);
        }
        if collectives::token_wise(kind) && self.placed_on_shards() {
            return self.emit_on_shards(kind, &ins, path);
        }
        match kind {
            OpKind::Embedding
            | OpKind::EmbeddingGrad
            | OpKind::CrossEntropy
            | OpKind::CrossEntropyGrad => self.emit_embedding_loss(kind, &ins, path),
            OpKind::Linear { weight }
            | OpKind::LinearGradInput { weight }
            | OpKind::LinearGradWeight { weight } => self.emit_linear(kind, *weight, &ins, path),
            OpKind::BiasAdd | OpKind::BiasGrad => self.emit_bias(kind, &ins, path),
            OpKind::SplitHeads { .. }
            | OpKind::MergeHeads
            | OpKind::Split { .. }
            | OpKind::Concat => self.emit_view(kind, &ins, path),
            OpKind::Rope { .. }
            | OpKind::RopeGrad { .. }
            | OpKind::Cast { .. }
            | OpKind::GeluTanh => self.emit_unary(kind, &ins, path),
            OpKind::CausalAttention { .. } | OpKind::AttentionGrad { .. } => {
                self.emit_attention(kind, &ins, path)
            }
            OpKind::Add
            | OpKind::GradSum
            | OpKind::SwiGlu
            | OpKind::SwiGluGrad
            | OpKind::GeluTanhGrad => self.emit_elementwise(kind, &ins, path),
            OpKind::RmsNorm { .. }
            | OpKind::LayerNorm { .. }
            | OpKind::RmsNormGrad { .. }
            | OpKind::LayerNormGrad { .. } => self.emit_norm(kind, &ins, path),
            OpKind::Combine | OpKind::CombineGrad | OpKind::DispatchGrad { .. } => {
                self.emit_moe(kind, &ins, path)
            }
            // Everything else (position embeddings, the router, dispatch, collectives,
            // optimizer) runs on whole operands and gives whole results.
            _ => self.emit_whole(kind, &ins, path),
        }
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
        let tp: Vec<Tp> = outs
            .iter()
            .map(|t| match t.dims.iter().position(|d| d.name == "s") {
                Some(d) => Tp::S(d),
                None => Tp::P,
            })
            .collect();
        self.op(kind.clone(), &args, path, &tp)
    }

    /// The default rule: every operand made whole, whole results (correct for any op, but it
    /// communicates).
    fn emit_whole(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let args = self.all_whole(ins, path)?;
        self.op(kind.clone(), &args, path, &[])
    }

    /// The vocab-parallel embedding and cross-entropy (and their gradients): a table split
    /// over the vocabulary gives partial sums (reduce-scattered onto sequence shards with
    /// sequence parallelism); logits split over it give a whole loss and split gradients.
    fn emit_embedding_loss(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        match kind {
            OpKind::Embedding => {
                let out = if self.tp_state(ins[1]) == Tp::S(0) {
                    Tp::P
                } else {
                    Tp::R
                };
                let y = self.op1(k, ins, path, out)?;
                if self.sp && out == Tp::P {
                    // Sequence parallelism: the residual stream starts on sequence shards
                    // (Megatron reduce-scatters the vocab-parallel embedding's output).
                    return Ok(vec![self.seq_shard(y, path)?]);
                }
                Ok(vec![y])
            }
            OpKind::EmbeddingGrad => {
                let dy = self.whole(ins[2], path)?;
                let out = if self.tp_state(ins[1]) == Tp::S(0) {
                    Tp::S(0)
                } else {
                    Tp::R
                };
                self.op(k, &[ins[0], ins[1], dy], path, &[out])
            }
            _ => {
                // Cross-entropy and its gradient.
                let logits = self.not_partial(ins[0], path)?;
                let out = match (kind, self.tp_state(logits)) {
                    (OpKind::CrossEntropyGrad, Tp::S(d)) => Tp::S(d),
                    _ => Tp::R,
                };
                self.op(k, &[logits, ins[1]], path, &[out])
            }
        }
    }

    /// Linears and their gradients: column-parallel (the weight split over its output
    /// features: the input gathered whole, the output split), row-parallel (split over its
    /// input features: a split input gives a partial sum, reduced before a bias), else whole.
    fn emit_linear(
        &mut self,
        kind: &OpKind,
        weight: WeightLayout,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let last = |s: &Self, v: ValueId| s.rank(v) - 1;
        let k = kind.clone();
        let (in_dim, out_dim) = match weight {
            WeightLayout::OutIn => (1, 0),
            WeightLayout::InOut => (0, 1),
        };
        match kind {
            OpKind::Linear { .. } => match self.tp_state(ins[1]) {
                Tp::S(d) if d == out_dim => {
                    let x = self.whole(ins[0], path)?;
                    let mut args = vec![x, ins[1]];
                    args.extend(ins.get(2));
                    let out = Tp::S(self.rank(x) - 1);
                    self.op(k, &args, path, &[out])
                }
                Tp::S(d) if d == in_dim => {
                    let x = ins[0];
                    if self.tp_state(x) != Tp::S(last(self, x)) {
                        return Err(PassError::Autodiff(format!(
                            "shard: {path}: a row-parallel linear needs its input split over tp"
                        )));
                    }
                    let partial = self.op1(k.clone(), &[x, ins[1]], path, Tp::P)?;
                    match ins.get(2) {
                        None => Ok(vec![partial]),
                        // The bias goes on after the partial sums are reduced: onto each
                        // sequence shard where the rewrites placed the bias add there
                        // (reduce-scattered, as Megatron does), else onto the all-reduced
                        // whole.
                        Some(&bias) if self.placed_on_shards() => {
                            self.emit_on_shards(&OpKind::BiasAdd, &[partial, bias], path)
                        }
                        Some(&bias) => {
                            let whole = self.whole(partial, path)?;
                            Ok(vec![self.op1(
                                OpKind::BiasAdd,
                                &[whole, bias],
                                path,
                                Tp::R,
                            )?])
                        }
                    }
                }
                _ => self.emit_whole(kind, ins, path),
            },
            OpKind::LinearGradInput { .. } => match self.tp_state(ins[1]) {
                Tp::S(d) if d == out_dim => {
                    let dy = ins[0];
                    if self.tp_state(dy) != Tp::S(last(self, dy)) {
                        return Err(PassError::Autodiff(format!(
                            "shard: {path}: the output gradient of a column-parallel linear must be split over tp"
                        )));
                    }
                    self.op(k, ins, path, &[Tp::P])
                }
                Tp::S(d) if d == in_dim => {
                    let dy = self.whole(ins[0], path)?;
                    let out = Tp::S(self.rank(dy) - 1);
                    self.op(k, &[dy, ins[1]], path, &[out])
                }
                _ => self.emit_whole(kind, ins, path),
            },
            _ => {
                // The weight gradient. Column-parallel: dy split over the output features, x
                // whole. Row-parallel: x split over the input features, dy whole.
                let (x, dy) = (ins[0], ins[1]);
                let (x, dy, out) = if self.tp_state(dy) == Tp::S(last(self, dy)) {
                    (self.whole(x, path)?, dy, Tp::S(out_dim))
                } else if self.tp_state(x) == Tp::S(last(self, x)) {
                    (x, self.whole(dy, path)?, Tp::S(in_dim))
                } else {
                    (self.whole(x, path)?, self.whole(dy, path)?, Tp::R)
                };
                self.op(k, &[x, dy], path, &[out])
            }
        }
    }

    /// Bias add and its gradient: on sequence shards with sequence parallelism (the bias
    /// gradient then a partial sum), else on the input's layout (a split bias follows a
    /// split input).
    fn emit_bias(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        if matches!(kind, OpKind::BiasAdd) {
            let x = self.not_partial(ins[0], path)?;
            let out = self.tp_state(x);
            let b = if out == Tp::R {
                self.whole(ins[1], path)?
            } else {
                ins[1]
            };
            return self.op(k, &[x, b], path, &[out]);
        }
        // The gradient of a bias added on sequence shards sums this rank's tokens.
        if self
            .seq_dim(ins[0])
            .is_some_and(|d| self.tp_state(ins[0]) == Tp::S(d))
        {
            return self.op(k, ins, path, &[Tp::P]);
        }
        let dy = self.not_partial(ins[0], path)?;
        let out = match self.tp_state(dy) {
            Tp::S(_) => Tp::S(0),
            _ => Tp::R,
        };
        self.op(k, &[dy], path, &[out])
    }

    /// Views, split and concat: on operands all sharded at the dim the view splits or merges
    /// (its leading factor), or all whole; else gathered whole.
    fn emit_view(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        let args: Vec<ValueId> = ins
            .iter()
            .map(|&x| self.not_partial(x, path))
            .collect::<Result<_, _>>()?;
        let r = self.rank(args[0]);
        // The sharded dim must be the one the view splits or merges at its leading
        // factor: `heads*head_dim` <-> `heads`, `3*rest` <-> `rest`.
        let expected = if matches!(kind, OpKind::MergeHeads) {
            r - 2
        } else {
            r - 1
        };
        let all_sharded = args.iter().all(|&x| self.tp_state(x) == Tp::S(expected));
        let all_whole = args.iter().all(|&x| self.tp_state(x) == Tp::R);
        let n_out = match kind {
            OpKind::Split { n } => *n as usize,
            _ => 1,
        };
        if all_sharded {
            let out = match kind {
                OpKind::SplitHeads { .. } => Tp::S(r - 1),
                OpKind::MergeHeads => Tp::S(r - 2),
                _ => Tp::S(r - 1),
            };
            self.op(k, &args, path, &vec![out; n_out])
        } else if all_whole {
            self.op(k, &args, path, &[])
        } else {
            let args = self.all_whole(&args, path)?;
            self.op(k, &args, path, &[])
        }
    }

    /// One-operand elementwise ops (rope, cast, GELU): the result keeps the operand's layout
    /// (a partial sum is reduced first).
    fn emit_unary(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let x = self.not_partial(ins[0], path)?;
        let out = self.tp_state(x);
        self.op(kind.clone(), &[x], path, &[out])
    }

    /// Attention splits over heads: q, k, v (and in backward every operand) split. With more
    /// tp ranks than kv heads, k and v are whole (heads repeated) and each rank takes the
    /// repeated heads of its query heads.
    fn emit_attention(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        let fwd = matches!(kind, OpKind::CausalAttention { .. });
        let outs: &[Tp] = if fwd {
            &[Tp::S(2), Tp::S(1)]
        } else {
            &[Tp::S(2), Tp::S(2), Tp::S(2)]
        };
        if self.tp_state(ins[0]) == Tp::S(2) && self.tp_state(ins[1]) == Tp::R {
            let mut args = ins.to_vec();
            for a in [1, 2] {
                args[a] = self.head_slice(ins[a], path)?;
            }
            return self.op(k, &args, path, outs);
        }
        let split = if fwd {
            [ins[0], ins[1], ins[2]]
                .iter()
                .all(|&x| self.tp_state(x) == Tp::S(2))
        } else {
            ins.iter().all(|&x| matches!(self.tp_state(x), Tp::S(_)))
        };
        if split {
            return self.op(k, ins, path, outs);
        }
        self.emit_whole(kind, ins, path)
    }

    /// Residual adds, gradient sums and the MLP's elementwise ops (SwiGLU, the GELU
    /// gradient): on equal layouts (partial sums add up as partial sums), else whole. (Adds
    /// and sums the collective rewrites put on sequence shards are emitted by
    /// [`Self::emit_on_shards`].)
    fn emit_elementwise(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        let sums = matches!(kind, OpKind::Add | OpKind::GradSum);
        let states: Vec<Tp> = ins.iter().map(|&x| self.tp_state(x)).collect();
        let n_out = if matches!(kind, OpKind::SwiGluGrad) {
            2
        } else {
            1
        };
        let same = states.iter().all(|&t| t == states[0]);
        if same && (states[0] != Tp::P || sums) {
            // Elementwise on equal layouts; partial sums add up as partial sums.
            self.op(k, ins, path, &vec![states[0]; n_out])
        } else {
            self.emit_whole(kind, ins, path)
        }
    }

    /// Norms and their gradients off sequence shards (where the collective rewrites put them
    /// on shards, [`Self::emit_on_shards`] emits them): a per-head norm (qk-norm) split by
    /// heads, else whole.
    fn emit_norm(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        // A norm of per-head rows (Qwen3's qk-norm over head_dim of q and k, `[b, s, heads,
        // head_dim]`): never on sequence shards. Split by heads, each rank normalises its
        // own rows with the replicated weight and the weight gradient is a partial sum over
        // tp; otherwise whole.
        if self.rank(ins[0]) == 4 {
            let x_state = self.tp_state(ins[0]);
            if x_state == Tp::S(2) {
                let w = self.whole(ins[1], path)?;
                if matches!(kind, OpKind::RmsNorm { .. }) {
                    return self.op(k, &[ins[0], w], path, &[x_state]);
                }
                if matches!(kind, OpKind::RmsNormGrad { .. }) {
                    let dy = self.not_partial(ins[2], path)?;
                    if self.tp_state(dy) == x_state {
                        return self.op(k, &[ins[0], w, dy], path, &[x_state, Tp::P]);
                    }
                }
            }
            return self.emit_whole(kind, ins, path);
        }
        self.emit_whole(kind, ins, path)
    }

    /// The per-expert MoE ops under expert tensor parallelism: every expert's output is a
    /// partial sum over tp (its w2 is row-parallel); the combine is linear in them, so it
    /// gives a partial sum, reduced once after it. Backward: the router-weight gradient (a
    /// dot product with the expert outputs) is partial too, the experts' output gradients
    /// whole, and the token gradients of the experts (their w1/w3 are column-parallel)
    /// partial. Otherwise whole.
    fn emit_moe(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Vec<ValueId>, PassError> {
        let k = kind.clone();
        match kind {
            OpKind::Combine if ins[2..].iter().all(|&y| self.tp_state(y) == Tp::P) => {
                let mut args = self.all_whole(&ins[..2], path)?;
                args.extend_from_slice(&ins[2..]);
                self.op(k, &args, path, &[Tp::P])
            }
            OpKind::CombineGrad
                if ins.len() >= 4
                    && ins[2..ins.len() - 1]
                        .iter()
                        .all(|&y| self.tp_state(y) == Tp::P) =>
            {
                let n = ins.len();
                let mut args = self.all_whole(&ins[..2], path)?;
                args.extend_from_slice(&ins[2..n - 1]);
                args.push(self.whole(ins[n - 1], path)?);
                let mut outs = vec![Tp::P];
                outs.extend(std::iter::repeat_n(Tp::R, n - 3));
                self.op(k, &args, path, &outs)
            }
            OpKind::DispatchGrad { .. } if self.tp_state(ins[0]) == Tp::P => {
                let idx = self.whole(ins[1], path)?;
                self.op(k, &[ins[0], idx], path, &[Tp::P])
            }
            _ => self.emit_whole(kind, ins, path),
        }
    }

    fn all_whole(&mut self, ins: &[ValueId], path: &str) -> Result<Vec<ValueId>, PassError> {
        ins.iter().map(|&x| self.whole(x, path)).collect()
    }

    /// Whether `v`'s first dim is the stacked experts dim.
    fn is_experts(&self, v: ValueId) -> bool {
        let ty = self.g.ty(v);
        ty.dims.len() == 3 && ty.dims[0].name == "experts"
    }

    /// Whether `v` (stacked experts) is split over ep, i.e. lives on its experts' ranks.
    fn on_experts(&self, v: ValueId) -> bool {
        self.layout(v).shards[0].contains(&Axis::Ep)
    }

    /// Layout of stacked expert tokens: on the experts' ranks (experts split over ep, the
    /// token rows of the ep group) or on the tokens' ranks (this rank's tokens); `tp` says
    /// where they stand over tp (expert tensor parallelism: the ffn dim split, or the
    /// experts' outputs partial sums).
    fn set_expert_layout(&mut self, v: ValueId, on_experts: bool, tp: Tp) {
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
        match tp {
            Tp::R => {}
            Tp::S(d) => l.shards[d].push(Axis::Tp),
            Tp::P => l.partial.push(Axis::Tp),
        }
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

    /// Expert parallelism's rules for the MoE ops on stacked experts; `None` for other ops.
    fn emit_expert(
        &mut self,
        kind: &OpKind,
        ins: &[ValueId],
        path: &str,
    ) -> Result<Option<Vec<ValueId>>, PassError> {
        let k = kind.clone();
        let st = |s: &Self, v: ValueId| s.tp_state(v);
        let outs = match kind {
            OpKind::DispatchExperts { .. } => {
                let args = self.all_whole(ins, path)?;
                let outs = self.op(k, &args, path, &[])?;
                self.set_expert_layout(outs[0], false, Tp::R);
                let l = &mut self.g.values[outs[1].0 as usize].ty.layout;
                *l = Layout::replicated(1);
                self.counts_of.insert(moe_block(path).to_string(), outs[1]);
                outs
            }
            // Expert tensor parallelism on stacked weights `[experts, out, in]`: w1/w3
            // column-parallel (dim 1 over tp), w2 row-parallel (dim 2 over tp).
            OpKind::Linear { .. } if self.is_experts(ins[1]) => {
                let x = self.all_to_all(ins[0], path, true)?;
                let (x, out) = match st(self, ins[1]) {
                    Tp::S(1) => (self.whole(x, path)?, Tp::S(2)),
                    Tp::S(2) if st(self, x) == Tp::S(2) => (x, Tp::P),
                    Tp::S(_) => {
                        return Err(PassError::Autodiff(format!(
                        "shard: {path}: a row-parallel expert linear needs its input split over tp"
                    )))
                    }
                    _ => (self.whole(x, path)?, Tp::R),
                };
                let out_v = self.op1(k, &[x, ins[1]], path, Tp::R)?;
                self.set_expert_layout(out_v, true, out);
                vec![out_v]
            }
            OpKind::LinearGradInput { .. } if self.is_experts(ins[1]) => {
                let dy = self.all_to_all(ins[0], path, true)?;
                let (dy, out) = match st(self, ins[1]) {
                    Tp::S(1) if st(self, dy) == Tp::S(2) => (dy, Tp::P),
                    Tp::S(2) => (self.whole(dy, path)?, Tp::S(2)),
                    Tp::S(_) => return Err(PassError::Autodiff(format!(
                        "shard: {path}: the output gradient of a column-parallel expert linear must be split over tp"
                    ))),
                    _ => (self.whole(dy, path)?, Tp::R),
                };
                let out_v = self.op1(k, &[dy, ins[1]], path, Tp::R)?;
                self.set_expert_layout(out_v, true, out);
                vec![out_v]
            }
            OpKind::LinearGradWeight { .. } if self.is_experts(ins[0]) => {
                let x = self.all_to_all(ins[0], path, true)?;
                let dy = self.all_to_all(ins[1], path, true)?;
                // Column-parallel: dy split over the ffn dim; row-parallel: x split.
                let (x, dy, tp) = if st(self, dy) == Tp::S(2) {
                    (self.whole(x, path)?, dy, Some(1))
                } else if st(self, x) == Tp::S(2) {
                    (x, self.whole(dy, path)?, Some(2))
                } else {
                    (self.whole(x, path)?, self.whole(dy, path)?, None)
                };
                let out = self.op1(k, &[x, dy], path, Tp::R)?;
                let l = &mut self.g.values[out.0 as usize].ty.layout;
                l.shards = vec![vec![Axis::Ep], Vec::new(), Vec::new()];
                if let Some(d) = tp {
                    l.shards[d].push(Axis::Tp);
                }
                l.partial = if self.edp {
                    vec![Axis::Edp]
                } else {
                    Vec::new()
                };
                vec![out]
            }
            OpKind::SwiGlu | OpKind::SwiGluGrad | OpKind::GradSum | OpKind::Add
                if self.is_experts(ins[0]) =>
            {
                let mut args: Vec<ValueId> = ins
                    .iter()
                    .map(|&x| self.all_to_all(x, path, true))
                    .collect::<Result<_, _>>()?;
                // Elementwise on equal tp layouts (partial sums only add up); else whole.
                let states: Vec<Tp> = args.iter().map(|&x| st(self, x)).collect();
                let sums = matches!(kind, OpKind::GradSum | OpKind::Add);
                let mut tp = states[0];
                if !(states.iter().all(|&t| t == tp) && (tp != Tp::P || sums)) {
                    args = self.all_whole(&args, path)?;
                    tp = Tp::R;
                }
                let outs = self.op(k, &args, path, &[])?;
                for &o in &outs {
                    self.set_expert_layout(o, true, tp);
                }
                outs
            }
            // The combine is linear in the expert outputs: partial over tp in, partial out
            // (reduced once after it); its gradient's router-weight part is partial too.
            OpKind::CombineExperts | OpKind::CombineExpertsGrad => {
                let mut args = self.all_whole(&ins[..2], path)?;
                let y = self.all_to_all(ins[2], path, false)?;
                let y = match st(self, y) {
                    Tp::P => y,
                    _ => self.whole(y, path)?,
                };
                let partial = st(self, y) == Tp::P;
                args.push(y);
                for &x in &ins[3..] {
                    args.push(self.whole(x, path)?);
                }
                let first = if partial { Tp::P } else { Tp::R };
                let outs = self.op(k, &args, path, &[first])?;
                if let Some(&dy) = outs.get(1) {
                    self.set_expert_layout(dy, false, Tp::R);
                }
                outs
            }
            OpKind::DispatchExpertsGrad => {
                let dy = self.all_to_all(ins[0], path, false)?;
                let out = match st(self, dy) {
                    Tp::P => Tp::P,
                    _ => Tp::R,
                };
                let dy = if out == Tp::P {
                    dy
                } else {
                    self.whole(dy, path)?
                };
                let idx = self.whole(ins[1], path)?;
                self.op(k, &[dy, idx], path, &[out])?
            }
            _ => return Ok(None),
        };
        Ok(Some(outs))
    }
}
