//! Collective placement by rewrites (egg): where sequence parallelism's collectives go.
//!
//! The `shard` pass first lays the graph out with Megatron's tensor parallelism alone (each
//! parameter's layout as [`crate::tensor_parallel`] extracted it; every
//! per-token op on whole activations, an `all_reduce` where a row-parallel linear's partial
//! sum must be whole). This module translates that graph, one block at a time (a decoder
//! layer, forward, backward and recomputation together; the embedding, the final norm, the
//! output layer and the loss each their own block), into a small e-graph language:
//!
//! - `ar`, `ag`, `rs`, `slice`: all-reduce, all-gather, reduce-scatter and this rank's slice
//!   over tp along the value's sequence dim;
//! - `(oN a b ...)`: result of the block's op N on its operands, exactly as the tp layout
//!   gave it (its kind, path and per-rank layout are in the analysis' table);
//! - leaves: values from outside the block (parameters, inputs, other blocks' results).
//!
//! The analysis gives every e-class its distribution over tp (whole, sequence shards, split
//! along another dim, partial sum). An op node is valid on the operand layouts the tp layout
//! gave it; a **token-wise** op ([`token_wise`], the one piece of sequence-parallel layout
//! algebra an op states) is also valid with every operand that has a sequence dim on
//! sequence shards (and the others whole): its results with a sequence dim are then on
//! shards, those without (a norm weight's gradient: a sum over tokens) partial sums.
//!
//! The rewrites ([`rules`]) are the collective algebra, not per-op placement:
//!
//! - `allreduce-is-gather-of-scatter`: `ar(p) = ag(rs(p))`;
//! - `slice-cancels-gather`: `slice(ag(x)) = x`;
//! - `token-op-commutes-with-gather`: a token-wise op of gathered operands is the gather of
//!   the op on the shards (`op(ag x, w) = ag(op(x, w))`), and a result that sums over tokens
//!   is the all-reduce of the op's partial sums (`op.1(ag x, w, ag dy) = ar(op.1(x, w, dy))`);
//!   a whole operand beside a gathered one is sliced (`add(ag x, y) = ag(add(x, slice y))`).
//!   A whole value is sliced only to meet a sharded one: slicing the operands of a sum of
//!   whole values (k's and v's input gradients when tp exceeds the kv heads) would cost less
//!   activation memory at tp = 4 but is not Megatron's placement, and plans stay as they were.
//!
//! Boundary condition (Megatron's sequence parallelism): a whole activation with a sequence
//! dim that one block passes to another (the residual stream and its gradient) is held on
//! sequence shards: the producing block's root is its `slice`, the consuming block sees only
//! the shards (and their `ag`). A result no op reads (the last op of a recomputed layer) is
//! a root too, held as its shards.
//!
//! The rules run to saturation (anything else is an error), and extraction picks the
//! cheapest term under a cost model of bytes ([`CostModel`]): the bytes a collective moves
//! over the tp links, weighted by the link cost, plus the activation memory every result
//! takes on a rank. The extracted term decides, for every token-wise op of the graph,
//! whether it runs on sequence shards ([`Placement::on_shards`]); `shard` emits each op so,
//! and the collectives follow from the layouts. With these rules extraction arrives at
//! Megatron's placement: norms, residual adds, bias adds and their gradients on shards,
//! 2 all-gathers and 2 reduce-scatters per dense layer's forward, no all-reduce.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use egg::{
    define_language, rewrite as rw, Analysis, Applier, CostFunction, DidMerge, EGraph, Extractor,
    Id, Language, PatternAst, Rewrite, Runner, SearchMatches, Searcher, SimpleScheduler,
    StopReason, Subst, Symbol, Var,
};
use megac_ir::{Axis, Graph, OpKind, ValueDef, ValueId};

define_language! {
    /// A block's tensor-parallel program: the collectives over tp along the sequence dim
    /// (`ar`, `ag`, `rs`, `slice`), the block's ops (`oN`, by index into the analysis'
    /// table) and leaves (`lN`: values from outside the block).
    #[allow(missing_docs)]
    pub enum Coll {
        "ar" = AllReduce(Id),
        "ag" = AllGather(Id),
        "rs" = ReduceScatter(Id),
        "slice" = Slice(Id),
        Op(Symbol, Vec<Id>),
        Leaf(Symbol),
    }
}

/// Whether an op works token by token, so that it may run on sequence shards: given every
/// operand with a sequence dim split along it (and the others, its weights, whole), its
/// results with a sequence dim are split the same way and its results without one (sums
/// over the tokens: weight and bias gradients) are partial sums over tp. This is the layout
/// algebra sequence parallelism needs from an op; a new token-wise op is added here (and
/// `shard` then places it with no code of its own).
pub fn token_wise(kind: &OpKind) -> bool {
    matches!(
        kind,
        OpKind::RmsNorm { .. }
            | OpKind::RmsNormGrad { .. }
            | OpKind::LayerNorm { .. }
            | OpKind::LayerNormGrad { .. }
            | OpKind::Add
            | OpKind::GradSum
            | OpKind::BiasAdd
            | OpKind::BiasGrad
            | OpKind::SigmoidMul
            | OpKind::SigmoidMulGrad
    )
}

/// How a value is distributed over the tp group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dist {
    /// Whole on every rank.
    Whole,
    /// Split along its sequence dim.
    Seq,
    /// Split along another dim (heads, the MLP's hidden dim, the vocabulary).
    Split(usize),
    /// A pending sum.
    Partial,
    /// Not a valid program.
    Invalid,
}

impl Dist {
    fn name(self) -> String {
        match self {
            Dist::Whole => "R".into(),
            Dist::Seq => "s:tp".into(),
            Dist::Split(d) => format!("{d}:tp"),
            Dist::Partial => "partial:tp".into(),
            Dist::Invalid => "invalid".into(),
        }
    }
}

/// An e-class's analysis data: its distribution, whether it has a sequence dim, its bytes.
#[derive(Clone, Debug)]
pub struct Data {
    dist: Dist,
    seq: bool,
    bytes: f64,
}

/// One output of one op of the block, as the tp layout emitted it.
#[derive(Clone, Debug)]
struct OpInfo {
    kind: OpKind,
    /// The op's index in the tp-laid-out graph and which of its results this node is.
    op: usize,
    out: usize,
    outs: usize,
    token_wise: bool,
    /// Operands with a sequence dim.
    stream: Vec<bool>,
    /// The operand layouts the tp layout gave it, and its result's.
    ins: Vec<Dist>,
    dist: Dist,
    seq: bool,
    bytes: f64,
}

/// A value from outside the block.
#[derive(Clone, Debug)]
struct LeafInfo {
    name: String,
    dist: Dist,
    seq: bool,
    bytes: f64,
}

/// The analysis: the block's ops and leaves, and the first merge of classes with different
/// distributions (a broken rule; reported as an error).
#[derive(Default)]
pub struct Layouts {
    ops: Vec<OpInfo>,
    leaves: Vec<LeafInfo>,
    conflict: Option<String>,
}

fn index(sym: &Symbol) -> usize {
    sym.as_str()[1..].parse().unwrap_or(usize::MAX)
}

const INVALID: Data = Data {
    dist: Dist::Invalid,
    seq: false,
    bytes: 0.0,
};

/// The token-wise rule: operands with a sequence dim all on shards (or all whole, or, for a
/// sum, all partial), the others whole.
fn token_rule(info: &OpInfo, ins: &[Dist]) -> Dist {
    let mut stream = None;
    for (d, &s) in ins.iter().zip(&info.stream) {
        if !s {
            if *d != Dist::Whole {
                return Dist::Invalid;
            }
        } else if stream.is_some_and(|x| x != *d) {
            return Dist::Invalid;
        } else {
            stream = Some(*d);
        }
    }
    let sum = matches!(info.kind, OpKind::Add | OpKind::GradSum);
    match stream {
        Some(Dist::Whole) => Dist::Whole,
        Some(Dist::Seq) if info.seq => Dist::Seq,
        Some(Dist::Seq) => Dist::Partial,
        Some(Dist::Partial) if sum => Dist::Partial,
        _ => Dist::Invalid,
    }
}

/// The distribution of `node` given its children's data.
fn node_data(layouts: &Layouts, node: &Coll, child: impl Fn(Id) -> Data) -> Data {
    let coll = |c: Data, from: Dist, to: Dist| {
        if c.dist == from && c.seq {
            Data { dist: to, ..c }
        } else {
            INVALID
        }
    };
    match node {
        Coll::AllReduce(x) => {
            let c = child(*x);
            if c.dist == Dist::Partial {
                Data {
                    dist: Dist::Whole,
                    ..c
                }
            } else {
                INVALID
            }
        }
        Coll::AllGather(x) => coll(child(*x), Dist::Seq, Dist::Whole),
        Coll::ReduceScatter(x) => coll(child(*x), Dist::Partial, Dist::Seq),
        Coll::Slice(x) => coll(child(*x), Dist::Whole, Dist::Seq),
        Coll::Leaf(s) => match layouts.leaves.get(index(s)) {
            Some(l) => Data {
                dist: l.dist,
                seq: l.seq,
                bytes: l.bytes,
            },
            None => INVALID,
        },
        Coll::Op(s, args) => {
            let Some(info) = layouts.ops.get(index(s)) else {
                return INVALID;
            };
            let ins: Vec<Dist> = args.iter().map(|&a| child(a).dist).collect();
            let dist = if ins == info.ins {
                info.dist
            } else if info.token_wise {
                token_rule(info, &ins)
            } else {
                Dist::Invalid
            };
            Data {
                dist,
                seq: info.seq,
                bytes: info.bytes,
            }
        }
    }
}

impl Analysis<Coll> for Layouts {
    type Data = Data;

    fn make(egraph: &mut EGraph<Coll, Self>, enode: &Coll, _id: Id) -> Data {
        node_data(&egraph.analysis, enode, |i| egraph[i].data.clone())
    }

    fn merge(&mut self, to: &mut Data, from: Data) -> DidMerge {
        if to.dist != from.dist && self.conflict.is_none() {
            self.conflict = Some(format!(
                "a rewrite equated a {} value with a {} one",
                to.dist.name(),
                from.dist.name()
            ));
        }
        DidMerge(false, false)
    }
}

type Graphs = EGraph<Coll, Layouts>;

/// The custom rewrites, which inspect the analysis (a searcher and its applier in one).
#[derive(Clone, Copy, Debug)]
enum Custom {
    /// `op(ag x, w) = ag(op(x, w))` for a token-wise op (`ar` for results without a
    /// sequence dim); a whole operand beside a gathered one is sliced
    /// (`op(ag x, y) = ag(op(x, slice y))`).
    TokenOpCommutes,
}

/// The class a gathered operand comes from (the shards inside its first `ag`).
fn gathered(egraph: &Graphs, class: Id) -> Option<Id> {
    egraph[class].nodes.iter().find_map(|n| match n {
        Coll::AllGather(x) => Some(*x),
        _ => None,
    })
}

/// An operand of a commuted token-wise op.
#[derive(Clone, Copy, Debug)]
enum Arg {
    /// The shards inside a gathered operand.
    Shards(Id),
    /// A whole operand, sliced to meet the gathered ones.
    Slice(Id),
    /// A weight (no sequence dim), as it is.
    Keep(Id),
}

/// For each token-wise op node of `class` whose operands with a sequence dim are gathers
/// (at least one) or whole values: the op on their shards.
fn commuted(egraph: &Graphs, class: Id) -> Vec<(Symbol, Vec<Arg>)> {
    let mut out = Vec::new();
    for node in &egraph[class].nodes {
        let Coll::Op(s, args) = node else { continue };
        let Some(info) = egraph.analysis.ops.get(index(s)) else {
            continue;
        };
        if !info.token_wise {
            continue;
        }
        let mut new = Vec::with_capacity(args.len());
        let mut gathers = 0;
        for (&a, &stream) in args.iter().zip(&info.stream) {
            let d = &egraph[a].data;
            new.push(if !stream {
                Arg::Keep(a)
            } else if let Some(x) = gathered(egraph, a) {
                gathers += 1;
                Arg::Shards(x)
            } else if d.dist == Dist::Whole {
                Arg::Slice(a)
            } else {
                gathers = usize::MAX;
                break;
            });
        }
        if gathers == 0 || gathers == usize::MAX {
            continue;
        }
        let ins: Vec<Dist> = new
            .iter()
            .map(|a| match a {
                Arg::Shards(x) => egraph[*x].data.dist,
                Arg::Slice(_) => Dist::Seq,
                Arg::Keep(x) => egraph[*x].data.dist,
            })
            .collect();
        let want = if info.seq { Dist::Seq } else { Dist::Partial };
        if token_rule(info, &ins) == want {
            out.push((*s, new));
        }
    }
    out
}

impl Searcher<Coll, Layouts> for Custom {
    fn search_eclass_with_limit(
        &self,
        egraph: &Graphs,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, Coll>> {
        if limit == 0 {
            return None;
        }
        let hit = match self {
            Custom::TokenOpCommutes => !commuted(egraph, eclass).is_empty(),
        };
        hit.then(|| SearchMatches {
            eclass,
            substs: vec![Subst::default()],
            ast: None,
        })
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

impl Applier<Coll, Layouts> for Custom {
    fn apply_one(
        &self,
        egraph: &mut Graphs,
        eclass: Id,
        _subst: &Subst,
        _ast: Option<&PatternAst<Coll>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let mut changed = Vec::new();
        match self {
            Custom::TokenOpCommutes => {
                for (s, args) in commuted(egraph, eclass) {
                    let args: Vec<Id> = args
                        .into_iter()
                        .map(|a| match a {
                            Arg::Shards(x) | Arg::Keep(x) => x,
                            Arg::Slice(x) => egraph.add(Coll::Slice(x)),
                        })
                        .collect();
                    let seq = egraph.analysis.ops[index(&s)].seq;
                    let op = egraph.add(Coll::Op(s, args));
                    let back = egraph.add(if seq {
                        Coll::AllGather(op)
                    } else {
                        Coll::AllReduce(op)
                    });
                    if egraph.union(eclass, back) {
                        changed.push(back);
                    }
                }
            }
        }
        changed
    }
}

fn partial_with_seq(var: &str) -> impl Fn(&mut Graphs, Id, &Subst) -> bool {
    let v: Var = var.parse().expect("a pattern variable");
    move |egraph, _, subst| {
        let d = &egraph[subst[v]].data;
        d.dist == Dist::Partial && d.seq
    }
}

/// The collective algebra (names as in the module doc). [`RULE_NAMES`] lists them in order.
pub fn rules() -> Vec<Rewrite<Coll, Layouts>> {
    let custom = |name: &str, c: Custom| {
        Rewrite::new(name, c, c).expect("a rewrite without variables is well formed")
    };
    vec![
        rw!("allreduce-is-gather-of-scatter"; "(ar ?p)" => "(ag (rs ?p))" if partial_with_seq("?p")),
        rw!("slice-cancels-gather"; "(slice (ag ?x))" => "?x"),
        custom("token-op-commutes-with-gather", Custom::TokenOpCommutes),
    ]
}

/// The names of [`rules`], in order.
pub const RULE_NAMES: [&str; 3] = [
    "allreduce-is-gather-of-scatter",
    "slice-cancels-gather",
    "token-op-commutes-with-gather",
];

/// The cost model: bytes a collective moves over the tp links (`(n-1)/n` of the value per
/// gather or scatter, twice that per all-reduce) times `link`, the cost of a link byte
/// relative to a byte of memory, plus the activation memory of every result on one rank
/// (the whole value, or `1/n` of it when split).
pub struct CostModel<'a> {
    egraph: &'a Graphs,
    n: f64,
    link: f64,
}

/// A tp link byte against a memory byte: NVLink's ~450 GB/s per direction against HBM's
/// ~3 TB/s, rounded. The placement does not depend on it (tp and sequence parallelism move
/// the same bytes); it orders the terms that do.
pub const LINK_COST: f64 = 8.0;

impl CostFunction<Coll> for CostModel<'_> {
    type Cost = f64;

    fn cost<C: FnMut(Id) -> f64>(&mut self, enode: &Coll, mut costs: C) -> f64 {
        let data = node_data(&self.egraph.analysis, enode, |i| {
            self.egraph[i].data.clone()
        });
        if data.dist == Dist::Invalid {
            return f64::INFINITY;
        }
        let b = data.bytes;
        let local = match data.dist {
            Dist::Seq | Dist::Split(_) => b / self.n,
            _ => b,
        };
        let wire = self.link * b * (self.n - 1.0) / self.n;
        let own = match enode {
            Coll::Leaf(_) => 0.0,
            Coll::Op(..) | Coll::Slice(_) => local,
            Coll::AllGather(_) | Coll::ReduceScatter(_) => wire + local,
            Coll::AllReduce(_) => 2.0 * wire + local,
        };
        enode.fold(own, |acc, id| acc + costs(id))
    }
}

/// What the rewrites found for one block.
#[derive(Clone, Debug)]
pub struct BlockPlacement {
    /// The block (`model.layers.0`, `model.embed_tokens`, `lm_head`, ...).
    pub block: String,
    /// Why the rewrites stopped (always `Saturated`: anything else is an error).
    pub stop: String,
    /// Rewrite iterations until saturation.
    pub iterations: usize,
    /// E-nodes and e-classes at saturation.
    pub nodes: usize,
    /// E-classes at saturation.
    pub classes: usize,
    /// The extracted term, one e-class a line (`%k = node : layout`), the roots last.
    pub term: String,
    /// All-reduces of activations (values with a sequence dim), all-gathers and
    /// reduce-scatters along the sequence in the extracted term.
    pub all_reduces: usize,
    /// All-reduces of sums over the tokens (weight gradients of token-wise ops on shards;
    /// `shard` leaves them partial and the optimizer pass reduces them).
    pub sum_all_reduces: usize,
    /// See `all_reduces`.
    pub all_gathers: usize,
    /// See `all_reduces`.
    pub reduce_scatters: usize,
    /// Cost of the extracted term and of the tensor-parallel starting point.
    pub cost: f64,
    /// See `cost`.
    pub start_cost: f64,
}

/// What the rewrites found for the graph.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// For each token-wise op of the tp layout, keyed by (the op of the graph before `shard`,
    /// which of the ops emitted for it), whether the extracted term runs it on sequence
    /// shards.
    pub on_shards: HashMap<(usize, usize), bool>,
    /// Every block, in graph order.
    pub blocks: Vec<BlockPlacement>,
}

/// The block an op's provenance path belongs to: a decoder layer (`model.layers.N`,
/// `transformer.h.N`), else the path itself.
pub fn block(path: &str) -> &str {
    let parts: Vec<&str> = path.split('.').collect();
    for i in 0..parts.len().saturating_sub(1) {
        if matches!(parts[i], "layers" | "h") && parts[i + 1].parse::<u64>().is_ok() {
            let n: usize = parts[..=i + 1].iter().map(|p| p.len() + 1).sum::<usize>() - 1;
            return &path[..n];
        }
    }
    path
}

fn dist_of(g: &Graph, v: ValueId) -> (Dist, bool, f64) {
    let ty = g.ty(v);
    let seq_dim = ty.dims.iter().position(|d| d.name == "s");
    let l = &ty.layout;
    let dist = if l.partial.contains(&Axis::Tp) {
        Dist::Partial
    } else {
        match l.shards.iter().position(|s| s.contains(&Axis::Tp)) {
            Some(d) if Some(d) == seq_dim => Dist::Seq,
            Some(d) => Dist::Split(d),
            None => Dist::Whole,
        }
    };
    let elems: f64 = ty.dims.iter().map(|d| d.size as f64).product();
    (
        dist,
        seq_dim.is_some(),
        elems * ty.dtype.size_bytes() as f64,
    )
}

fn value_name(g: &Graph, v: ValueId) -> String {
    match &g.values[v.0 as usize].def {
        ValueDef::Param(n) | ValueDef::Input(n) => n.clone(),
        ValueDef::Op(o, k) => {
            let op = &g.ops[o.0 as usize];
            let out = if op.outputs.len() > 1 {
                format!(".{k}")
            } else {
                String::new()
            };
            format!("{}{out}@{}", op.kind.name(), op.path)
        }
    }
}

/// Translate the tp-laid-out graph `g` block by block, saturate each with `rules`, extract
/// the cheapest term for `n` tp ranks. `tags` maps each op of `g` that `shard` emitted for
/// an op of its input graph to (that op, which of its emitted ops); conversions have none.
pub fn place(
    g: &Graph,
    tags: &HashMap<usize, (usize, usize)>,
    n: u64,
    rules: &[Rewrite<Coll, Layouts>],
) -> Result<Placement, String> {
    // Producer op of every value; the blocks reading it.
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    let mut readers: HashMap<ValueId, HashSet<&str>> = HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    let mut ops_of: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, op) in g.ops.iter().enumerate() {
        let b = block(&op.path);
        if !ops_of.contains_key(b) {
            order.push(b);
        }
        ops_of.entry(b).or_default().push(i);
        for &o in &op.outputs {
            producer.insert(o, i);
        }
        for &x in &op.inputs {
            readers.entry(x).or_default().insert(b);
        }
    }
    let outputs: HashSet<ValueId> = g.outputs.iter().map(|(_, v)| *v).collect();
    let mut placement = Placement::default();
    for b in order {
        let ops = &ops_of[b];
        let leaves_elsewhere = |v: ValueId| {
            outputs.contains(&v) || readers.get(&v).is_some_and(|r| r.iter().any(|x| *x != b))
        };
        // A whole activation with a sequence dim passed between blocks: held on shards.
        let boundary = |v: ValueId| {
            let (d, seq, _) = dist_of(g, v);
            d == Dist::Whole && seq && producer.contains_key(&v)
        };
        let mut eg: Graphs = EGraph::new(Layouts::default());
        let mut class: HashMap<ValueId, Id> = HashMap::new();
        let operand = |eg: &mut Graphs, class: &mut HashMap<ValueId, Id>, v: ValueId| {
            if let Some(&c) = class.get(&v) {
                return c;
            }
            let (dist, seq, bytes) = dist_of(g, v);
            let held = boundary(v);
            let name = value_name(g, v);
            eg.analysis.leaves.push(LeafInfo {
                name: if held { format!("{name}@shards") } else { name },
                dist: if held { Dist::Seq } else { dist },
                seq,
                bytes,
            });
            let sym = Symbol::from(format!("l{}", eg.analysis.leaves.len() - 1));
            let mut c = eg.add(Coll::Leaf(sym));
            if held {
                c = eg.add(Coll::AllGather(c));
            }
            class.insert(v, c);
            c
        };
        for &i in ops {
            let op = &g.ops[i];
            let args: Vec<Id> = op
                .inputs
                .iter()
                .map(|&x| operand(&mut eg, &mut class, x))
                .collect();
            let seq_coll = |dim: u64, axes: &[Axis]| {
                axes == [Axis::Tp]
                    && g.ty(op.inputs[0])
                        .dims
                        .iter()
                        .position(|d| d.name == "s")
                        .is_some_and(|s| s as u64 == dim)
            };
            let coll = match &op.kind {
                OpKind::AllReduce { axes } if axes == &[Axis::Tp] => Some(Coll::AllReduce(args[0])),
                OpKind::AllGather { axes, dim } if seq_coll(*dim, axes) => {
                    Some(Coll::AllGather(args[0]))
                }
                OpKind::ReduceScatter { axes, dim } if seq_coll(*dim, axes) => {
                    Some(Coll::ReduceScatter(args[0]))
                }
                OpKind::Slice { axes, dim } if seq_coll(*dim, axes) => Some(Coll::Slice(args[0])),
                _ => None,
            };
            if let Some(node) = coll {
                let c = eg.add(node);
                class.insert(op.outputs[0], c);
                continue;
            }
            let ins: Vec<Dist> = op.inputs.iter().map(|&x| dist_of(g, x).0).collect();
            let stream: Vec<bool> = op.inputs.iter().map(|&x| dist_of(g, x).1).collect();
            for (k, &o) in op.outputs.iter().enumerate() {
                let (dist, seq, bytes) = dist_of(g, o);
                eg.analysis.ops.push(OpInfo {
                    kind: op.kind.clone(),
                    op: i,
                    out: k,
                    outs: op.outputs.len(),
                    token_wise: tags.contains_key(&i) && token_wise(&op.kind),
                    stream: stream.clone(),
                    ins: ins.clone(),
                    dist,
                    seq,
                    bytes,
                });
                let sym = Symbol::from(format!("o{}", eg.analysis.ops.len() - 1));
                let c = eg.add(Coll::Op(sym, args.clone()));
                class.insert(o, c);
            }
        }
        // Roots: what leaves the block (a held activation as its shards), and results no op
        // reads (a recomputed clone's last results), also held as their shards.
        let mut roots: Vec<Id> = Vec::new();
        for &i in ops {
            for &o in &g.ops[i].outputs {
                let dead = !outputs.contains(&o) && !readers.contains_key(&o);
                if leaves_elsewhere(o) || dead {
                    let c = class[&o];
                    let (d, seq, _) = dist_of(g, o);
                    let r = if boundary(o) || (dead && d == Dist::Whole && seq) {
                        eg.add(Coll::Slice(c))
                    } else {
                        c
                    };
                    if !roots.contains(&r) {
                        roots.push(r);
                    }
                }
            }
        }
        eg.rebuild();
        let start_cost: f64 = {
            let model = CostModel {
                egraph: &eg,
                n: n as f64,
                link: LINK_COST,
            };
            let ex = Extractor::new(&eg, model);
            roots.iter().map(|&r| ex.find_best_cost(r)).sum()
        };
        let runner = Runner::<Coll, Layouts, ()>::new(Layouts::default())
            .with_egraph(eg)
            .with_scheduler(SimpleScheduler)
            .with_iter_limit(200)
            .with_node_limit(2_000_000)
            .with_time_limit(Duration::from_secs(3600))
            .run(rules);
        let stop = runner.stop_reason.clone();
        if !matches!(stop, Some(StopReason::Saturated)) {
            return Err(format!(
                "the collective rewrites of block {b} did not saturate: {stop:?}"
            ));
        }
        let eg = &runner.egraph;
        if let Some(c) = &eg.analysis.conflict {
            return Err(format!("block {b}: {c}"));
        }
        let roots: Vec<Id> = roots.iter().map(|&r| eg.find(r)).collect();
        let ex = Extractor::new(
            eg,
            CostModel {
                egraph: eg,
                n: n as f64,
                link: LINK_COST,
            },
        );
        let cost: f64 = roots.iter().map(|&r| ex.find_best_cost(r)).sum();
        if !cost.is_finite() {
            return Err(format!("block {b}: no valid placement was found"));
        }
        // Walk the extracted term: number its classes in post-order, read each op's layout.
        let mut num: HashMap<Id, usize> = HashMap::new();
        let mut lines: Vec<String> = Vec::new();
        let (mut ar, mut ag, mut rs, mut sums) = (0, 0, 0, 0);
        let mut stack: Vec<(Id, bool)> = roots.iter().rev().map(|&r| (r, false)).collect();
        while let Some((c, done)) = stack.pop() {
            if num.contains_key(&c) {
                continue;
            }
            let node = ex.find_best_node(c);
            if !done {
                stack.push((c, true));
                for &ch in node.children().iter().rev() {
                    let ch = eg.find(ch);
                    if !num.contains_key(&ch) {
                        stack.push((ch, false));
                    }
                }
                continue;
            }
            let arg = |ch: &Id| format!("%{}", num[&eg.find(*ch)]);
            let text = match node {
                Coll::AllReduce(x) => {
                    if eg[c].data.seq {
                        ar += 1;
                    } else {
                        sums += 1;
                    }
                    format!("ar({})", arg(x))
                }
                Coll::AllGather(x) => {
                    ag += 1;
                    format!("ag({})", arg(x))
                }
                Coll::ReduceScatter(x) => {
                    rs += 1;
                    format!("rs({})", arg(x))
                }
                Coll::Slice(x) => format!("slice({})", arg(x)),
                Coll::Leaf(s) => eg.analysis.leaves[index(s)].name.clone(),
                Coll::Op(s, args) => {
                    let info = &eg.analysis.ops[index(s)];
                    let op = &g.ops[info.op];
                    if let Some(&key) = tags.get(&info.op).filter(|_| info.token_wise) {
                        let shards = args
                            .iter()
                            .zip(&info.stream)
                            .any(|(&a, &st)| st && eg[a].data.dist == Dist::Seq);
                        if let Some(prev) = placement.on_shards.insert(key, shards) {
                            if prev != shards {
                                return Err(format!(
                                    "block {b}: the extracted term runs {} ({}) both on shards and whole",
                                    op.kind.name(),
                                    op.path
                                ));
                            }
                        }
                    }
                    let out = if info.outs > 1 {
                        format!(".{}", info.out)
                    } else {
                        String::new()
                    };
                    let args: Vec<String> = args.iter().map(arg).collect();
                    format!(
                        "{}{out}({}) # {}",
                        info.kind.name(),
                        args.join(", "),
                        op.path
                    )
                }
            };
            let k = num.len();
            num.insert(c, k);
            lines.push(format!("%{k} = {text} : {}", eg[c].data.dist.name()));
        }
        let mut term = lines.join("\n");
        let names: Vec<String> = roots.iter().map(|r| format!("%{}", num[r])).collect();
        term.push_str(&format!("\nroots {}\n", names.join(", ")));
        placement.blocks.push(BlockPlacement {
            block: b.to_string(),
            stop: format!("{:?}", StopReason::Saturated),
            iterations: runner.iterations.len(),
            nodes: eg.total_size(),
            classes: eg.number_of_classes(),
            term,
            all_reduces: ar,
            sum_all_reduces: sums,
            all_gathers: ag,
            reduce_scatters: rs,
            cost,
            start_cost,
        });
    }
    Ok(placement)
}
