//! Tensor- and expert-parallel placement by rewrites (egg): which parameters tp splits,
//! and along which dim (column-parallel, row-parallel, vocab-parallel or replicated); and,
//! under expert parallelism, on which side of ep each op on stacked experts runs (where
//! the all-to-alls go).
//!
//! The `shard` pass asks this module for the layout of every parameter over tp before it
//! lays the graph out. The graph before `shard` (forward, backward and recomputation, all
//! whole) is cut into groups: each decoder layer (`model.layers.N`, `transformer.h.N`) and
//! the rest (embedding, final norm, output layer, loss); groups that share a parameter are
//! one. Each group is translated into an e-graph over [`SymbolLang`]:
//!
//! - `oK(args)`: output of an op of the group (kind, types and layout algebra in the
//!   analysis' table); `lK`: a value from another group, in the layout that group leaves
//!   it in (whole, or a partial sum, read through its `ar`: llama's residual stream leaves
//!   the embedding and each layer as a partial sum under tp; whole under sequence
//!   parallelism, where the emitter moves it onto sequence shards); `pK.R` / `pK.D`:
//!   parameter K stored whole or split along dim D;
//! - `ar(x)`: the all-reduce of a partial sum over tp; `slice.D(x)`: this rank's part of a
//!   whole value along dim D (a local copy, no communication);
//! - `uK.L(g)`: the optimizer's update of parameter K stored in layout L from its gradient
//!   `g` in that layout (a root);
//! - under expert parallelism, `a2a.E(x)` / `a2a.T(x)`: the all-to-all over ep that moves
//!   stacked expert tokens `x` to the experts' ranks (the experts dim split over ep, the
//!   ep group's token rows) or back to the tokens' ranks ([`Ep`]).
//!
//! Each e-class holds one value in one distribution over tp (whole, split along a dim,
//! partial sum) and on one side of ep (stacked expert weights are stored on the experts'
//! ranks; every value but stacked expert tokens is on the tokens' side). The only per-op
//! code is the op's layout algebra, [`strategies`]: the operand layouts an op accepts and
//! the result layouts they give, over tp and over ep (a linear split over its output
//! features takes a whole input and gives a split output; over its input features, a
//! split input and a partial sum; a linear on stacked expert weights runs on the experts'
//! ranks; ...). Every op accepts whole operands over tp and gives whole results. Where an
//! op's algebra wants an operand on the other side of ep than the graph gives it, the
//! e-graph is built with the operand's all-to-all. The rewrites ([`rules`], names in
//! [`RULE_NAMES`]) are the collective algebra:
//!
//! - `op-on-shards-reduces`: an op on operands in another layout its algebra accepts is
//!   the op, when that gives a whole result, and its all-reduce, when it gives a partial
//!   sum (`linear(x, w) = ar(linear(slice x, slice w))`); on the other side of ep, the
//!   op's all-to-all (`swiglu(a, b) = a2a.E(swiglu(a2a.T a, a2a.T b))`). An operand is
//!   reached through a slice, the partial sums inside an all-reduce, or an all-to-all (of
//!   the value, or of the partial sums inside its all-reduce: the exchange commutes with
//!   the all-reduce);
//! - `slice-of-op-is-op-on-shards`: the slice of an op's result is the op on operands its
//!   algebra turns into that slice (`slice(linear(x, w)) = linear(x, slice w)`);
//! - `slice-of-parameter-is-its-shard`: a parameter's slice is the parameter stored split.
//!
//! Tensor parallelism moves activations by all-reduce only (Megatron's `f`/`g` pair:
//! `copy_to`/`reduce_from_tensor_model_parallel_region`); parameters are never gathered
//! (that is the distributed optimizer's business, over dp) and all-gathers along a model
//! dim are not in the algebra. Token dims (`b`, `s`, `tokens`) and the `experts` dim are
//! never tp's: sequence parallelism ([`crate::collectives`]) and expert parallelism own them.
//!
//! Roots are what leaves the group, whole, and every update; a root only other groups
//! read whose extracted term is the all-reduce of a partial sum leaves as that partial
//! sum (the reader's term holds the all-reduce, where the emitter puts it). Groups are
//! solved in graph order, each leaf in the layout its group left it in (whole where that
//! group is not solved yet), and solved again while those layouts change.
//!
//! The rules run to saturation (anything else is an error). Extraction under
//! [`CostModel`] (bytes an all-reduce or all-to-all moves times [`LINK_COST`], plus every result's
//! activation memory on a rank (expert token rows of a fixed capacity are sized per
//! micro-batch already), plus [`PARAM_COST`] times the parameter memory of every use
//! and of the update; activations and their bytes for one micro-batch) chooses, per use, a
//! layout of each parameter; a parameter used in two layouts is then fixed, first in graph
//! order, to the layout (whole, or split along any dim) whose extracted term costs least
//! (each e-class of the term counted once), and the group is extracted again until every
//! parameter has one layout. Identical layers (same ops, types and wiring) are solved once.
//!
//! With these rules and costs extraction arrives at Megatron's layout: q/k/v (and their
//! biases), gate/up, GPT-2's `c_attn`/`c_fc` column-parallel; o/down and GPT-2's `c_proj`
//! row-parallel (their bias whole, added once); embedding and output layer split over the
//! vocabulary; norms, the router and the shared-expert gate whole (split, their results
//! could not meet the whole ops that read them without an all-gather); every expert's MLP
//! split like the dense one; k/v whole when tp does not divide the kv heads. Under ep it
//! arrives at Megatron's exchanges: expert tokens to the experts' ranks before w1/w3 (one
//! all-to-all both read), back before the combine (the row-parallel w2's partial sums,
//! reduced after the combine), and the mirror pair in the backward.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use egg::{
    Analysis, Applier, CostFunction, DidMerge, EGraph, Extractor, Id, Language, PatternAst,
    Rewrite, Runner, SearchMatches, Searcher, SimpleScheduler, StopReason, Subst, Symbol,
    SymbolLang, Var,
};
use megac_ir::{Graph, OpKind, TensorType, ValueDef, ValueId, WeightLayout};

/// How a value is distributed over the tp group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dist {
    /// Whole on every rank.
    R,
    /// Split along this dim.
    S(usize),
    /// Each rank holds a partial sum.
    P,
    /// Not a valid program.
    Invalid,
}

impl Dist {
    fn name(self) -> String {
        match self {
            Dist::R => "R".into(),
            Dist::S(d) => format!("{d}:tp"),
            Dist::P => "partial:tp".into(),
            Dist::Invalid => "invalid".into(),
        }
    }
}

impl Dist {
    /// The dim this layout splits along, if it is a split.
    pub fn dim(self) -> Option<usize> {
        match self {
            Dist::S(d) => Some(d),
            _ => None,
        }
    }
}

/// Where a value stands over ep (expert parallelism's axis). Only stacked expert values
/// (a leading `experts` dim) are ever on the experts' ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ep {
    /// Token-parallel: this rank's own tokens, every expert (every value that is not a
    /// stacked expert value, and expert tokens before the dispatch's all-to-all).
    Tokens,
    /// Expert-parallel: the experts dim split over ep (this rank's experts), with the token
    /// rows of the whole ep group.
    Experts,
}

impl Ep {
    fn symbol(self) -> &'static str {
        match self {
            Ep::Tokens => "T",
            Ep::Experts => "E",
        }
    }
}

/// One way to run an op over (ep, tp): its operands' layouts and its results'.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Strategy {
    /// Operand layouts over tp.
    pub ins: Vec<Dist>,
    /// Result layouts over tp.
    pub outs: Vec<Dist>,
    /// Operands the op gathers whole over tp itself, under this strategy (their bytes are
    /// costed as an all-gather's).
    pub gathers: Vec<usize>,
    /// Operand layouts over ep.
    pub ep_ins: Vec<Ep>,
    /// Result layouts over ep.
    pub ep_outs: Vec<Ep>,
}

/// An op's operand layouts in the extracted term (over tp and over ep): which of its
/// [`strategies`] it runs under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operands {
    /// Over tp.
    pub tp: Vec<Dist>,
    /// Over ep.
    pub ep: Vec<Ep>,
}

impl Strategy {
    /// Whether this strategy takes operands laid out as `ins`.
    pub fn takes(&self, ins: &Operands) -> bool {
        self.ins == ins.tp && self.ep_ins == ins.ep
    }
}

/// Dims tensor parallelism never splits: the token dims (data, context and sequence
/// parallelism's) and the stacked experts (expert parallelism's).
const NOT_TP: [&str; 4] = ["b", "s", "tokens", "experts"];

/// Whether `n` tp ranks can split `t` along dim `d` (one rank splits nothing).
fn splits(t: &TensorType, d: usize, n: u64) -> bool {
    n > 1
        && t.dims.get(d).is_some_and(|dim| {
            !dim.dynamic && dim.size % n == 0 && !NOT_TP.contains(&dim.name.as_str())
        })
}

fn last(t: &TensorType) -> usize {
    t.dims.len().saturating_sub(1)
}

/// A weight's (output, input) feature dims (stacked expert weights have a leading
/// `experts` dim).
fn features(weight: WeightLayout, rank: usize) -> (usize, usize) {
    let r = rank.max(2);
    match weight {
        WeightLayout::OutIn => (r - 2, r - 1),
        WeightLayout::InOut => (r - 1, r - 2),
    }
}

/// Whether `t` is a stacked expert value (`[experts, _, _]`): expert tokens
/// `[experts, tokens, h]`, stacked expert weights `[experts, out, in]` and their gradients.
pub fn stacked(t: &TensorType) -> bool {
    t.dims.len() == 3 && t.dims[0].name == "experts"
}

/// Whether `t` holds stacked expert tokens (`[experts, tokens, ..]`), which an all-to-all
/// over ep moves between the tokens' and the experts' ranks.
pub fn expert_tokens(t: &TensorType) -> bool {
    stacked(t) && t.dims.get(1).is_some_and(|d| d.name == "tokens")
}

/// Whether `t` is a stacked expert weight (or its gradient): `[experts, out, in]`.
fn expert_weights(t: &TensorType) -> bool {
    stacked(t) && !expert_tokens(t)
}

/// The layout algebra of `kind` over `n` tp ranks and `ep` expert-parallel ranks, on
/// operands `ins` with results `outs` (global types): every strategy it supports. The
/// first is always every operand and result whole over tp. This is what a new op states
/// to be placed by the rewrites.
///
/// Over ep (only where `ep > 1`): an op on stacked expert weights (a linear, its input and
/// weight gradients, anything else reading or giving a stacked weight) runs on the
/// experts' ranks, every operand and result there; an op on stacked expert tokens alone
/// (elementwise: SwiGLU, sums) runs on either side, as its operands are; every other op
/// on the tokens' ranks (the dispatch gives expert tokens there, the combine and the
/// dispatch's gradient read them there).
pub fn strategies(
    kind: &OpKind,
    ins: &[&TensorType],
    outs: &[&TensorType],
    n: u64,
    ep: u64,
) -> Vec<Strategy> {
    let mut v = tp_strategies(kind, ins, outs, n);
    if ep <= 1 {
        return v;
    }
    let all = || ins.iter().chain(outs);
    let weights = all().any(|t| expert_weights(t));
    let tokens_only = !ins.is_empty() && all().all(|t| expert_tokens(t));
    if weights {
        for s in &mut v {
            s.ep_ins = vec![Ep::Experts; ins.len()];
            s.ep_outs = vec![Ep::Experts; outs.len()];
        }
    } else if tokens_only {
        v = v
            .into_iter()
            .flat_map(|s| {
                let e = Strategy {
                    ep_ins: vec![Ep::Experts; ins.len()],
                    ep_outs: vec![Ep::Experts; outs.len()],
                    ..s.clone()
                };
                [s, e]
            })
            .collect();
    }
    v
}

/// [`strategies`] over tp alone (every operand and result on the tokens' ranks over ep).
fn tp_strategies(
    kind: &OpKind,
    ins: &[&TensorType],
    outs: &[&TensorType],
    n: u64,
) -> Vec<Strategy> {
    use Dist::{P, R, S};
    let strategy = |i: Vec<Dist>, o: Vec<Dist>, gathers: Vec<usize>| Strategy {
        ep_ins: vec![Ep::Tokens; i.len()],
        ep_outs: vec![Ep::Tokens; o.len()],
        ins: i,
        outs: o,
        gathers,
    };
    let whole = strategy(vec![R; ins.len()], vec![R; outs.len()], Vec::new());
    let mut v = vec![whole];
    let mut gathering = Vec::new();
    let mut add = |ins: Vec<Dist>, outs: Vec<Dist>| v.push(strategy(ins, outs, Vec::new()));
    let s = |t: &TensorType, d: usize| splits(t, d, n);
    match kind {
        // Vocab-parallel embedding: a table split over the vocabulary gives partial sums.
        OpKind::Embedding if s(ins[1], 0) => add(vec![R, S(0)], vec![P]),
        OpKind::EmbeddingGrad if s(ins[1], 0) => add(vec![R, S(0), R], vec![S(0)]),
        // Vocab-parallel cross-entropy (the runtime reduces over tp).
        OpKind::CrossEntropy if s(ins[0], last(ins[0])) => add(vec![S(last(ins[0])), R], vec![R]),
        OpKind::CrossEntropyGrad if s(ins[0], last(ins[0])) => {
            let d = last(ins[0]);
            add(vec![S(d), R], vec![S(d)])
        }
        OpKind::Linear { weight } => {
            let (o, i) = features(*weight, ins[1].dims.len());
            let (x, y) = (last(ins[0]), last(outs[0]));
            let bias = ins.len() > 2;
            // Column-parallel: a whole input, the output features split (and the bias).
            if s(ins[1], o) && (!bias || s(ins[2], 0)) {
                let mut a = vec![R, S(o)];
                if bias {
                    a.push(S(0));
                }
                add(a, vec![S(y)]);
            }
            // Row-parallel: the input features split, a partial sum (a bias counts once).
            if s(ins[1], i) && s(ins[0], x) {
                let mut a = vec![S(x), S(i)];
                if bias {
                    a.push(R);
                }
                add(a, vec![P]);
            }
        }
        OpKind::LinearGradInput { weight } => {
            let (o, i) = features(*weight, ins[1].dims.len());
            let (dy, dx) = (last(ins[0]), last(outs[0]));
            if s(ins[1], o) && s(ins[0], dy) {
                add(vec![S(dy), S(o)], vec![P]);
            }
            if s(ins[1], i) {
                add(vec![R, S(i)], vec![S(dx)]);
            }
        }
        OpKind::LinearGradWeight { weight } => {
            let (o, i) = features(*weight, outs[0].dims.len());
            let (x, dy) = (last(ins[0]), last(ins[1]));
            if s(outs[0], o) && s(ins[1], dy) {
                add(vec![R, S(dy)], vec![S(o)]);
            }
            if s(outs[0], i) && s(ins[0], x) {
                add(vec![S(x), R], vec![S(i)]);
            }
        }
        OpKind::BiasAdd if s(ins[1], 0) => {
            let d = last(ins[0]);
            add(vec![S(d), S(0)], vec![S(d)]);
        }
        OpKind::BiasGrad if s(outs[0], 0) => add(vec![S(last(ins[0]))], vec![S(0)]),
        // Views: heads stay split through split/merge (whole heads only).
        OpKind::SplitHeads { .. } if s(outs[0], last(outs[0]) - 1) => {
            add(vec![S(last(ins[0]))], vec![S(last(outs[0]) - 1)])
        }
        OpKind::MergeHeads if s(ins[0], last(ins[0]) - 1) => {
            add(vec![S(last(ins[0]) - 1)], vec![S(last(outs[0]))])
        }
        // GPT-2's fused q/k/v: each part split as the fused dim is.
        OpKind::Split { .. } if s(outs[0], last(outs[0])) => {
            add(vec![S(last(ins[0]))], vec![S(last(outs[0])); outs.len()])
        }
        OpKind::Concat if s(ins[0], last(ins[0])) => {
            add(vec![S(last(ins[0])); ins.len()], vec![S(last(outs[0]))])
        }
        // Rotary embedding: per head (not along head_dim, whose halves it rotates).
        OpKind::Rope { .. } | OpKind::RopeGrad { .. } => {
            for d in 0..last(ins[0]) {
                if s(ins[0], d) {
                    add(vec![S(d)], vec![S(d)]);
                }
            }
        }
        OpKind::Cast { .. } | OpKind::GeluTanh => {
            for d in 0..ins[0].dims.len() {
                if s(ins[0], d) {
                    add(vec![S(d)], vec![S(d)]);
                }
            }
        }
        // Attention over split heads (k and v sliced to the rank's heads where whole).
        OpKind::CausalAttention { .. } if s(ins[0], 2) && s(ins[1], 2) => {
            add(vec![S(2), S(2), S(2)], vec![S(2), S(1)])
        }
        OpKind::AttentionGrad { .. } if s(ins[0], 2) && s(ins[1], 2) => add(
            vec![S(2), S(2), S(2), S(2), S(1), S(2)],
            vec![S(2), S(2), S(2)],
        ),
        // The sum of each key/value head's repeats (tp above the kv heads) takes the query
        // heads split and gathers them itself.
        OpKind::RepeatKvGrad { .. } if s(ins[0], 2) => {
            gathering.push(strategy(vec![S(2)], vec![R], vec![0]))
        }
        // Elementwise on equal layouts; partial sums add up as partial sums.
        OpKind::Add
        | OpKind::GradSum
        | OpKind::SwiGlu
        | OpKind::SwiGluGrad
        | OpKind::GeluTanhGrad => {
            for d in 0..ins[0].dims.len() {
                if s(ins[0], d) {
                    add(vec![S(d); ins.len()], vec![S(d); outs.len()]);
                }
            }
            if matches!(kind, OpKind::Add | OpKind::GradSum) {
                add(vec![P; ins.len()], vec![P]);
            }
        }
        // A norm of per-head rows (qk-norm, `[b, s, heads, head_dim]`): split by heads, the
        // weight whole, its gradient a partial sum.
        OpKind::RmsNorm { .. } if ins[0].dims.len() == 4 && s(ins[0], 2) => {
            add(vec![S(2), R], vec![S(2)])
        }
        OpKind::RmsNormGrad { .. } if ins[0].dims.len() == 4 && s(ins[0], 2) => {
            add(vec![S(2), R, S(2)], vec![S(2), P])
        }
        // The combine is linear in the expert outputs: partial sums in, a partial sum out.
        OpKind::Combine => {
            let mut a = vec![R, R];
            a.extend(std::iter::repeat_n(P, ins.len() - 2));
            add(a, vec![P]);
        }
        OpKind::CombineGrad if ins.len() >= 4 => {
            let mut a = vec![R, R];
            a.extend(std::iter::repeat_n(P, ins.len() - 3));
            a.push(R);
            let mut o = vec![P];
            o.extend(std::iter::repeat_n(R, outs.len() - 1));
            add(a, o);
        }
        OpKind::DispatchGrad { .. } | OpKind::DispatchExpertsGrad => add(vec![P, R], vec![P]),
        OpKind::CombineExperts => {
            let mut a = vec![R, R, P];
            a.extend(std::iter::repeat_n(R, ins.len() - 3));
            add(a, vec![P]);
        }
        OpKind::CombineExpertsGrad => {
            let mut a = vec![R, R, P];
            a.extend(std::iter::repeat_n(R, ins.len() - 3));
            let mut o = vec![P];
            o.extend(std::iter::repeat_n(R, outs.len() - 1));
            add(a, o);
        }
        _ => {}
    }
    v.extend(gathering);
    v
}

/// A link byte against a byte of memory (as [`crate::collectives::LINK_COST`]).
pub const LINK_COST: f64 = crate::collectives::LINK_COST;

/// A parameter byte against an activation byte: a parameter is held for the whole run
/// with its gradient and two AdamW moments, an activation for part of one step. With 64
/// extraction gives Megatron's layout on every family's test model and on every
/// configuration `tests/plan_fingerprints.rs` compiles (their plans are unchanged); 1024
/// gives it on the test models too, 4 does not (a test model's linear stays whole): where
/// splitting costs more bytes moved than it saves, weighed by this, a weight stays whole.
pub const PARAM_COST: f64 = 64.0;

/// One output of one op of the group.
#[derive(Clone, Debug)]
struct OpInfo {
    op: usize,
    out: usize,
    outs: usize,
    strategies: Rc<Vec<Strategy>>,
    bytes: f64,
}

/// A parameter the group reads.
#[derive(Clone, Debug)]
struct ParamInfo {
    name: String,
    /// Dims tp may split it along.
    dims: Vec<usize>,
    bytes: f64,
    /// Stored on the experts' ranks (a stacked expert weight under ep), or not.
    ep: Ep,
}

/// The analysis: the group's ops, leaves and parameters, and the first merge of classes in
/// different layouts (a broken rule; reported as an error).
#[derive(Default)]
pub struct Layouts {
    ops: Vec<OpInfo>,
    /// Each leaf's bytes and its layout over tp (as the group that produces it leaves it).
    leaves: Vec<(f64, Dist)>,
    params: Vec<ParamInfo>,
    n: f64,
    /// The ep size.
    ep: f64,
    conflict: Option<String>,
}

/// An e-class's analysis data: its layout and its global bytes.
#[derive(Clone, Debug)]
pub struct Data {
    dist: Dist,
    ep: Ep,
    bytes: f64,
}

impl Data {
    fn name(&self) -> String {
        match self.ep {
            Ep::Tokens => self.dist.name(),
            Ep::Experts => format!("{} 0:ep", self.dist.name()),
        }
    }
}

const INVALID: Data = Data {
    dist: Dist::Invalid,
    ep: Ep::Tokens,
    bytes: 0.0,
};

/// What a node's symbol names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ar,
    Slice(usize),
    /// The all-to-all over ep that moves stacked expert tokens to this side.
    Exchange(Ep),
    Op(usize),
    Leaf(usize),
    Param(usize, Dist),
    Update(usize, Dist),
}

fn parse_layout(s: &str) -> Option<Dist> {
    if s == "R" {
        Some(Dist::R)
    } else {
        s.parse().ok().map(Dist::S)
    }
}

fn kind_of(sym: Symbol) -> Option<Kind> {
    let s = sym.as_str();
    if s == "ar" {
        return Some(Kind::Ar);
    }
    if let Some(d) = s.strip_prefix("slice.") {
        return d.parse().ok().map(Kind::Slice);
    }
    match s {
        "a2a.T" => return Some(Kind::Exchange(Ep::Tokens)),
        "a2a.E" => return Some(Kind::Exchange(Ep::Experts)),
        _ => {}
    }
    let (head, rest) = s.split_at(1);
    match head {
        "o" => rest.parse().ok().map(Kind::Op),
        "l" => rest.parse().ok().map(Kind::Leaf),
        "p" | "u" => {
            let (k, l) = rest.split_once('.')?;
            let (k, l) = (k.parse().ok()?, parse_layout(l)?);
            Some(if head == "p" {
                Kind::Param(k, l)
            } else {
                Kind::Update(k, l)
            })
        }
        _ => None,
    }
}

/// The layouts of an op node's operands.
fn operands_of(node: &SymbolLang, child: impl Fn(Id) -> Data) -> Operands {
    let data: Vec<Data> = node.children.iter().map(|&c| child(c)).collect();
    Operands {
        tp: data.iter().map(|d| d.dist).collect(),
        ep: data.iter().map(|d| d.ep).collect(),
    }
}

fn node(op: String, children: Vec<Id>) -> SymbolLang {
    SymbolLang::new(op, children)
}

/// The layout of `node` given its children's data.
fn node_data(a: &Layouts, node: &SymbolLang, child: impl Fn(Id) -> Data) -> Data {
    let Some(kind) = kind_of(node.op) else {
        return INVALID;
    };
    let one = || child(node.children[0]);
    match kind {
        Kind::Ar => {
            let c = one();
            if c.dist == Dist::P {
                Data { dist: Dist::R, ..c }
            } else {
                INVALID
            }
        }
        Kind::Slice(d) => {
            let c = one();
            if c.dist == Dist::R {
                Data {
                    dist: Dist::S(d),
                    ..c
                }
            } else {
                INVALID
            }
        }
        Kind::Exchange(to) => {
            let c = one();
            if c.ep != to && c.dist != Dist::Invalid {
                Data { ep: to, ..c }
            } else {
                INVALID
            }
        }
        Kind::Op(k) => {
            let Some(info) = a.ops.get(k) else {
                return INVALID;
            };
            let ins = operands_of(node, child);
            match info.strategies.iter().find(|s| s.takes(&ins)) {
                Some(s) => Data {
                    dist: s.outs[info.out],
                    ep: s.ep_outs[info.out],
                    bytes: info.bytes,
                },
                None => INVALID,
            }
        }
        Kind::Leaf(k) => {
            let (bytes, dist) = a.leaves.get(k).copied().unwrap_or((0.0, Dist::R));
            Data {
                dist,
                ep: Ep::Tokens,
                bytes,
            }
        }
        Kind::Param(k, l) => Data {
            dist: l,
            ep: a.params.get(k).map_or(Ep::Tokens, |p| p.ep),
            bytes: a.params.get(k).map_or(0.0, |p| p.bytes),
        },
        Kind::Update(k, l) => {
            let c = one();
            let ep = a.params.get(k).map_or(Ep::Tokens, |p| p.ep);
            let ok = (c.dist == l || (l == Dist::R && c.dist == Dist::P)) && c.ep == ep;
            Data {
                dist: if ok { Dist::R } else { Dist::Invalid },
                ep,
                bytes: a.params.get(k).map_or(0.0, |p| p.bytes),
            }
        }
    }
}

impl Analysis<SymbolLang> for Layouts {
    type Data = Data;

    fn make(egraph: &mut EGraph<SymbolLang, Self>, enode: &SymbolLang, _id: Id) -> Data {
        node_data(&egraph.analysis, enode, |i| egraph[i].data.clone())
    }

    fn merge(&mut self, to: &mut Data, from: Data) -> DidMerge {
        if (to.dist != from.dist || to.ep != from.ep) && self.conflict.is_none() {
            self.conflict = Some(format!(
                "a rewrite equated a {} value with a {} one",
                to.name(),
                from.name()
            ));
        }
        DidMerge(false, false)
    }
}

type Graphs = EGraph<SymbolLang, Layouts>;

/// The rewrites, each a searcher and its applier in one (they read the analysis).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// `op(x..) = op(x'..)` or `ar(op(x'..))` for another strategy with a whole or partial
    /// result; or `a2a(op(x'..))` for one on the other side of ep.
    Reduces,
    /// `slice.d(op(x..)) = op(x'..)` for a strategy whose result is split along d.
    SliceOfOp,
    /// `slice.d(pK.R) = pK.d`.
    SliceOfParam,
}

/// The names of [`rules`], in order.
pub const RULE_NAMES: [&str; 3] = [
    "op-on-shards-reduces",
    "slice-of-op-is-op-on-shards",
    "slice-of-parameter-is-its-shard",
];

/// The collective algebra of tensor parallelism (names as in the module doc).
pub fn rules() -> Vec<Rewrite<SymbolLang, Layouts>> {
    [Rule::Reduces, Rule::SliceOfOp, Rule::SliceOfParam]
        .into_iter()
        .zip(RULE_NAMES)
        .map(|(r, name)| Rewrite::new(name, r, r).expect("a rewrite without variables"))
        .collect()
}

/// An operand of an op under another strategy.
#[derive(Clone, Copy, Debug)]
enum Arg {
    /// The operand as it is.
    Keep(Id),
    /// The rank's slice of a whole operand along a dim.
    Slice(Id, usize),
    /// The partial sums inside an all-reduced operand.
    Partial(Id),
    /// The operand moved to the other side of ep by an all-to-all.
    Exchange(Id, Ep),
}

/// The partial sums a whole class all-reduces, if it holds an all-reduce.
fn reduced(eg: &Graphs, class: Id) -> Option<Id> {
    eg[class]
        .nodes
        .iter()
        .find_map(|n| (kind_of(n.op) == Some(Kind::Ar)).then(|| n.children[0]))
}

/// The operands of op node `args` of info `info` under strategy `s`, if its classes can
/// give them.
fn operands(eg: &Graphs, args: &[Id], s: &Strategy) -> Option<Vec<Arg>> {
    args.iter()
        .zip(&s.ins)
        .zip(&s.ep_ins)
        .map(|((&a, &w), &we)| {
            let d = eg[a].data.dist;
            if eg[a].data.ep != we {
                // Across ep, in the same layout over tp: the value inside an all-to-all, or
                // its all-to-all.
                if d != w {
                    return None;
                }
                let inside = eg[a].nodes.iter().find_map(|n| {
                    (kind_of(n.op) == Some(Kind::Exchange(eg[a].data.ep)))
                        .then(|| n.children[0])
                        .filter(|&c| eg[c].data.ep == we)
                });
                if d == w {
                    return Some(inside.map_or(Arg::Exchange(a, we), Arg::Keep));
                }
                // The partial sums inside an all-reduce, moved (the all-to-all commutes
                // with the all-reduce).
                return match (d, w) {
                    (Dist::R, Dist::P) => reduced(eg, a).map(|p| Arg::Exchange(p, we)),
                    _ => None,
                };
            }
            if d == w {
                return Some(Arg::Keep(a));
            }
            match (d, w) {
                (Dist::R, Dist::S(x)) => Some(Arg::Slice(a, x)),
                (Dist::R, Dist::P) => reduced(eg, a).map(Arg::Partial).or_else(|| {
                    // Moved whole from the other side of ep: the partial sums there, moved.
                    let side = eg[a].data.ep;
                    eg[a].nodes.iter().find_map(|n| {
                        (kind_of(n.op) == Some(Kind::Exchange(side)))
                            .then(|| reduced(eg, n.children[0]))
                            .flatten()
                            .map(|p| Arg::Exchange(p, side))
                    })
                }),
                _ => None,
            }
        })
        .collect()
}

/// What applying `rule` at `class` would add: (the new op node's symbol, its operands, and
/// how it joins the class: directly, under an all-reduce, or as the class's slice).
type Plan = (Symbol, Vec<Arg>, Join);

#[derive(Clone, Copy, Debug)]
enum Join {
    Same,
    Reduce,
    Slice(usize),
    /// Under an all-to-all to the class's side of ep.
    Exchange(Ep),
}

fn plans(eg: &Graphs, class: Id, rule: Rule) -> Vec<Plan> {
    let mut out = Vec::new();
    let cur = eg[class].data.dist;
    let cur_ep = eg[class].data.ep;
    match rule {
        Rule::SliceOfParam => {}
        Rule::Reduces | Rule::SliceOfOp => {
            for n in &eg[class].nodes {
                let Some(Kind::Op(k)) = kind_of(n.op) else {
                    continue;
                };
                let info = &eg.analysis.ops[k];
                let now = operands_of(n, |c| eg[c].data.clone());
                for s in info.strategies.iter() {
                    if s.takes(&now) {
                        continue;
                    }
                    let (res, out_ep) = (s.outs[info.out], s.ep_outs[info.out]);
                    let join = match (rule, cur, res) {
                        (Rule::Reduces, c, o) if c == o && out_ep != cur_ep => {
                            Join::Exchange(cur_ep)
                        }
                        _ if out_ep != cur_ep => continue,
                        (Rule::Reduces, c, o) if c == o => Join::Same,
                        (Rule::Reduces, Dist::R, Dist::P) => Join::Reduce,
                        (Rule::SliceOfOp, Dist::R, Dist::S(d)) => Join::Slice(d),
                        _ => continue,
                    };
                    if let Some(args) = operands(eg, &n.children, s) {
                        out.push((n.op, args, join));
                    }
                }
            }
        }
    }
    out
}

/// For [`Rule::SliceOfParam`]: the parameter leaves `slice.d(pK.R)` nodes of `class` are.
fn param_slices(eg: &Graphs, class: Id) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for n in &eg[class].nodes {
        let Some(Kind::Slice(d)) = kind_of(n.op) else {
            continue;
        };
        for m in &eg[n.children[0]].nodes {
            if let Some(Kind::Param(k, Dist::R)) = kind_of(m.op) {
                if eg.analysis.params[k].dims.contains(&d) {
                    out.push((k, d));
                }
            }
        }
    }
    out
}

impl Searcher<SymbolLang, Layouts> for Rule {
    fn search_eclass_with_limit(
        &self,
        egraph: &Graphs,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, SymbolLang>> {
        if limit == 0 {
            return None;
        }
        let hit = match self {
            Rule::SliceOfParam => !param_slices(egraph, eclass).is_empty(),
            _ => !plans(egraph, eclass, *self).is_empty(),
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

impl Applier<SymbolLang, Layouts> for Rule {
    fn apply_one(
        &self,
        egraph: &mut Graphs,
        eclass: Id,
        _subst: &Subst,
        _ast: Option<&PatternAst<SymbolLang>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let mut changed = Vec::new();
        if *self == Rule::SliceOfParam {
            for (k, d) in param_slices(egraph, eclass) {
                let p = egraph.add(node(format!("p{k}.{d}"), Vec::new()));
                if egraph.union(eclass, p) {
                    changed.push(p);
                }
            }
            return changed;
        }
        for (op, args, join) in plans(egraph, eclass, *self) {
            let args: Vec<Id> = args
                .into_iter()
                .map(|a| match a {
                    Arg::Keep(x) | Arg::Partial(x) => x,
                    Arg::Slice(x, d) => egraph.add(node(format!("slice.{d}"), vec![x])),
                    Arg::Exchange(x, to) => {
                        egraph.add(node(format!("a2a.{}", to.symbol()), vec![x]))
                    }
                })
                .collect();
            let new = egraph.add(SymbolLang::new(op, args));
            let (a, b) = match join {
                Join::Same => (eclass, new),
                Join::Reduce => (eclass, egraph.add(node("ar".into(), vec![new]))),
                Join::Slice(d) => (egraph.add(node(format!("slice.{d}"), vec![eclass])), new),
                Join::Exchange(to) => (
                    eclass,
                    egraph.add(node(format!("a2a.{}", to.symbol()), vec![new])),
                ),
            };
            if egraph.union(a, b) {
                changed.push(b);
            }
        }
        changed
    }
}

/// The cost model: bytes an all-reduce moves over the tp links (`2(n-1)/n` of the value)
/// times [`LINK_COST`], plus the memory of every result on one rank (the whole value, or
/// `1/n` of it when split), plus [`PARAM_COST`] times a parameter's memory on a rank at
/// every use and at its update (with the optimizer's all-reduce of a partial gradient).
/// An all-to-all over ep moves the `(ep-1)/ep` of a rank's part that other ranks hold,
/// times [`LINK_COST`], and holds its result. `fixed` excludes the other layouts of
/// parameters already fixed.
pub struct CostModel<'a> {
    egraph: &'a Graphs,
    fixed: &'a HashMap<usize, Dist>,
}

impl CostFunction<SymbolLang> for CostModel<'_> {
    type Cost = f64;

    fn cost<C: FnMut(Id) -> f64>(&mut self, enode: &SymbolLang, mut costs: C) -> f64 {
        let a = &self.egraph.analysis;
        let data = node_data(a, enode, |i| self.egraph[i].data.clone());
        if data.dist == Dist::Invalid {
            return f64::INFINITY;
        }
        let n = a.n;
        let local = |d: Dist, b: f64| match d {
            Dist::S(_) => b / n,
            _ => b,
        };
        let wire = |b: f64| 2.0 * LINK_COST * b * (n - 1.0) / n;
        let excluded = |k: usize, l: Dist| self.fixed.get(&k).is_some_and(|&f| f != l);
        let own = match kind_of(enode.op) {
            Some(Kind::Ar) => wire(data.bytes) + data.bytes,
            Some(Kind::Slice(_)) => local(data.dist, data.bytes),
            Some(Kind::Exchange(_)) => {
                let b = local(data.dist, data.bytes);
                LINK_COST * b * (a.ep - 1.0) / a.ep + b
            }
            Some(Kind::Op(k)) => {
                let ins = operands_of(enode, |c| self.egraph[c].data.clone());
                let gathered: f64 =
                    a.ops[k]
                        .strategies
                        .iter()
                        .find(|s| s.takes(&ins))
                        .map_or(0.0, |s| {
                            s.gathers
                                .iter()
                                .map(|&i| self.egraph[enode.children[i]].data.bytes)
                                .sum()
                        });
                local(data.dist, data.bytes) + wire(gathered) / 2.0
            }
            Some(Kind::Leaf(_)) => 0.0,
            Some(Kind::Param(k, l)) if excluded(k, l) => f64::INFINITY,
            Some(Kind::Param(_, l)) => PARAM_COST * local(l, data.bytes),
            Some(Kind::Update(k, l)) if excluded(k, l) => f64::INFINITY,
            Some(Kind::Update(_, l)) => {
                let reduce = if self.egraph[enode.children[0]].data.dist == Dist::P {
                    wire(data.bytes)
                } else {
                    0.0
                };
                PARAM_COST * local(l, data.bytes) + reduce
            }
            None => f64::INFINITY,
        };
        enode.fold(own, |acc, id| acc + costs(id))
    }
}

/// What the rewrites found for one group.
#[derive(Clone, Debug)]
pub struct GroupPlacement {
    /// The group (`model.layers.0`, or `model` for everything outside the layers).
    pub group: String,
    /// The group solved first whose ops, types and wiring this one repeats (its placement
    /// is reused), if any.
    pub same_as: Option<String>,
    /// Why the rewrites stopped (always `Saturated`: anything else is an error).
    pub stop: String,
    /// Rewrite iterations until saturation.
    pub iterations: usize,
    /// E-nodes at saturation.
    pub nodes: usize,
    /// E-classes at saturation.
    pub classes: usize,
    /// Extractions until every parameter had one layout.
    pub extractions: usize,
    /// The extracted term, one e-class a line (`%k = node : layout`), the roots last.
    pub term: String,
    /// All-reduces in the extracted term, but those of partial gradients an update reads
    /// (the optimizer pass reduces them).
    pub all_reduces: usize,
    /// Cost of the extracted term, and of every parameter whole.
    pub cost: f64,
    /// See `cost`.
    pub whole_cost: f64,
    /// The term's choice for each op of the group it holds: (the op's place among the
    /// group's ops, in graph order; its operands' layouts). An op the term holds in two
    /// layouts (read whole by one op, split by another) is listed once per layout, in the
    /// term's order.
    pub choices: Vec<(usize, Operands)>,
}

/// What the rewrites found for the graph.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// Every parameter's layout over tp: the dim it is split along, `None` when whole.
    pub params: BTreeMap<String, Option<usize>>,
    /// Every group, in graph order.
    pub groups: Vec<GroupPlacement>,
    /// For every op of the graph the extracted term holds (by its index in `g.ops`), the
    /// layouts of its operands there, each list once, in the term's order (the strategy of
    /// its [`strategies`] with these `ins` says its results'). `shard` emits each op so.
    pub ops: BTreeMap<usize, Vec<Operands>>,
}

/// The decoder layer an op's path belongs to (`model.layers.N`, `transformer.h.N`).
fn layer(path: &str) -> Option<&str> {
    let b = crate::collectives::block(path);
    b.rsplit('.')
        .next()
        .filter(|p| p.parse::<u64>().is_ok())
        .map(|_| b)
}

fn bytes(t: &TensorType) -> f64 {
    t.dims.iter().map(|d| d.size as f64).product::<f64>() * t.dtype.size_bytes() as f64
}

/// An activation's bytes for one micro-batch: `scale` (the micro-batch's share of the
/// graph's batch) of its global bytes, but for expert token rows of a fixed capacity (a
/// `tokens` dim that is not dynamic), which the build pass sizes per micro-batch already.
fn activation_bytes(t: &TensorType, scale: f64) -> f64 {
    let per_micro_batch = t.dims.iter().any(|d| d.name == "tokens" && !d.dynamic);
    bytes(t) * if per_micro_batch { 1.0 } else { scale }
}

/// How many times [`place`] solves the groups at most, until the layouts between them
/// settle (the forward's edges settle in one pass, the backward's in the next).
const PASSES: usize = 4;

/// The placement of every parameter of `g` (the graph before `shard`) over `n` tp ranks
/// and `ep` expert-parallel ranks (stacked expert weights are stored on their experts'
/// ranks), with the rewrites `rules` (tests remove one). `micro_batch`: the share of the graph's
/// batch one rank holds at once (`train.micro_batch / train.global_batch`); activations and
/// the bytes they move are costed for one micro-batch. `sequence_parallel`: whether
/// sequence parallelism lays out the token-wise ops (see the module doc on group edges).
pub fn place(
    g: &Graph,
    n: u64,
    ep: u64,
    micro_batch: f64,
    sequence_parallel: bool,
    rules: &[Rewrite<SymbolLang, Layouts>],
) -> Result<Placement, String> {
    // Under sequence parallelism the emitter moves the residual stream onto sequence shards
    // (the embedding's partial sum reduce-scattered at once), which is not tp's algebra:
    // values cross group edges whole, as the collective rewrites then place them.
    let partial_edges = !sequence_parallel;
    // Group of every op: its layer, or the rest; groups sharing a parameter (read, or its
    // gradient produced) are merged.
    let key = |i: usize| layer(&g.ops[i].path).unwrap_or("model").to_string();
    let mut parent: HashMap<String, String> = HashMap::new();
    fn find(p: &mut HashMap<String, String>, k: &str) -> String {
        let mut k = k.to_string();
        while let Some(next) = p.get(&k).filter(|n| **n != k).cloned() {
            k = next;
        }
        k
    }
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    for (i, op) in g.ops.iter().enumerate() {
        for &o in &op.outputs {
            producer.insert(o, i);
        }
    }
    let grad_of: HashMap<&str, ValueId> = g
        .outputs
        .iter()
        .filter_map(|(name, v)| name.strip_prefix("grad:").map(|p| (p, *v)))
        .collect();
    let mut owner: HashMap<ValueId, String> = HashMap::new();
    let mut join = |parent: &mut HashMap<String, String>, v: ValueId, k: String| {
        let k = find(parent, &k);
        match owner.get(&v) {
            Some(o) => {
                let o = find(parent, o);
                if o != k {
                    // Keep the earlier group's name as the root.
                    parent.insert(k, o);
                }
            }
            None => {
                owner.insert(v, k);
            }
        }
    };
    for (i, op) in g.ops.iter().enumerate() {
        for &x in &op.inputs {
            if let ValueDef::Param(name) = &g.values[x.0 as usize].def {
                join(&mut parent, x, key(i));
                if let Some(p) = grad_of.get(name.as_str()).and_then(|v| producer.get(v)) {
                    join(&mut parent, x, key(*p));
                }
            }
        }
    }
    let mut order: Vec<String> = Vec::new();
    let mut ops_of: HashMap<String, Vec<usize>> = HashMap::new();
    for i in 0..g.ops.len() {
        let k = find(&mut parent, &key(i));
        if !ops_of.contains_key(&k) {
            order.push(k.clone());
        }
        ops_of.entry(k).or_default().push(i);
    }
    let group_of_op: HashMap<usize, &str> = order
        .iter()
        .flat_map(|k| ops_of[k].iter().map(move |&i| (i, k.as_str())))
        .collect();
    let mut readers: HashMap<ValueId, HashSet<&str>> = HashMap::new();
    for (i, op) in g.ops.iter().enumerate() {
        for &x in &op.inputs {
            readers.entry(x).or_default().insert(group_of_op[&i]);
        }
    }
    let outputs: HashSet<ValueId> = g.outputs.iter().map(|(_, v)| *v).collect();
    // The layout each value crossing a group edge leaves its group in (whole where its
    // group is not solved yet). Groups are solved in graph order, and again while a group's
    // leaves changed (the backward reads later groups' results): at most `PASSES` times.
    let mut edges: HashMap<ValueId, Dist> = HashMap::new();
    let mut solved: HashMap<String, (String, Vec<Dist>, GroupPlacement, Vec<Dist>)> =
        HashMap::new();
    let mut placement;
    let mut pass = 0;
    loop {
        pass += 1;
        let before = edges.clone();
        placement = Placement::default();
        for b in &order {
            let group = Group::new(
                g,
                &ops_of[b],
                b,
                (n, ep, micro_batch),
                &producer,
                &readers,
                &outputs,
                &grad_of,
                (&edges, partial_edges),
            );
            let crossing: Vec<Vec<ValueId>> =
                group.crossing.iter().map(|(v, _)| v.clone()).collect();
            let names: Vec<String> = group
                .eg
                .analysis
                .params
                .iter()
                .map(|p| p.name.clone())
                .collect();
            let (layouts, p, leaves_as) = match solved.get(&group.signature) {
                Some((first, layouts, p, leaves_as)) => {
                    let p = GroupPlacement {
                        group: b.clone(),
                        same_as: (first != b).then(|| first.clone()),
                        ..p.clone()
                    };
                    (layouts.clone(), p, leaves_as.clone())
                }
                None => {
                    let signature = group.signature.clone();
                    let (layouts, p, leaves_as) = group.solve(g, rules)?;
                    solved.insert(
                        signature,
                        (b.clone(), layouts.clone(), p.clone(), leaves_as.clone()),
                    );
                    (layouts, p, leaves_as)
                }
            };
            for (name, &l) in names.into_iter().zip(&layouts) {
                placement.params.insert(name, l.dim());
            }
            for (values, &l) in crossing.iter().zip(&leaves_as) {
                for &v in values {
                    edges.insert(v, l);
                }
            }
            placement.groups.push(p);
        }
        if edges == before {
            break;
        }
        if pass == PASSES {
            return Err(format!(
                "the layouts between groups did not settle in {PASSES} passes"
            ));
        }
    }
    // Parameters no op reads stay whole.
    for (_, name, _) in g.params() {
        placement.params.entry(name.to_string()).or_insert(None);
    }
    // Each op's choice, by its index in the graph (a repeated group's by its place).
    for p in &placement.groups {
        let ops = &ops_of[&p.group];
        for (j, ins) in &p.choices {
            let c = placement.ops.entry(ops[*j]).or_default();
            if !c.contains(ins) {
                c.push(ins.clone());
            }
        }
    }
    Ok(placement)
}

/// One group's e-graph before the rewrites.
struct Group {
    name: String,
    /// The group's ops (indices in the graph), in graph order.
    ops: Vec<usize>,
    eg: Graphs,
    roots: Vec<Id>,
    /// Per root, the values it holds that other groups read, and whether it may leave the
    /// group as a partial sum (only other groups read it).
    crossing: Vec<(Vec<ValueId>, bool)>,
    /// Per parameter, its update root, if its gradient is produced in the group.
    updates: Vec<Option<Id>>,
    signature: String,
}

impl Group {
    #[allow(clippy::too_many_arguments)]
    fn new(
        g: &Graph,
        ops: &[usize],
        name: &str,
        (n, ep, scale): (u64, u64, f64),
        producer: &HashMap<ValueId, usize>,
        readers: &HashMap<ValueId, HashSet<&str>>,
        outputs: &HashSet<ValueId>,
        grad_of: &HashMap<&str, ValueId>,
        (edges, partial_edges): (&HashMap<ValueId, Dist>, bool),
    ) -> Group {
        let mut eg: Graphs = EGraph::new(Layouts {
            n: n as f64,
            ep: ep as f64,
            ..Layouts::default()
        });
        let mut class: HashMap<ValueId, Id> = HashMap::new();
        let in_group: HashSet<usize> = ops.iter().copied().collect();
        // The signature: every op's kind and types, operands by their place in the group.
        let mut sig = String::new();
        let mut local: HashMap<ValueId, String> = HashMap::new();
        for &i in ops {
            let op = &g.ops[i];
            let mut args = Vec::with_capacity(op.inputs.len());
            for &x in &op.inputs {
                if let Some(&c) = class.get(&x) {
                    args.push(c);
                    continue;
                }
                let ty = g.ty(x);
                let c = match &g.values[x.0 as usize].def {
                    ValueDef::Param(pname) => {
                        let k = eg.analysis.params.len();
                        let dims = (0..ty.dims.len()).filter(|&d| splits(ty, d, n)).collect();
                        let on_experts = ep > 1 && expert_weights(ty);
                        eg.analysis.params.push(ParamInfo {
                            name: pname.clone(),
                            dims,
                            bytes: bytes(ty),
                            ep: if on_experts { Ep::Experts } else { Ep::Tokens },
                        });
                        local.insert(x, format!("p{k}"));
                        eg.add(node(format!("p{k}.R"), Vec::new()))
                    }
                    _ => {
                        // A value from another group, in the layout that group leaves it:
                        // a partial sum is read through its all-reduce (the ops are built
                        // on whole operands; the rewrites reach the partial sum inside).
                        let k = eg.analysis.leaves.len();
                        let dist = edges.get(&x).copied().unwrap_or(Dist::R);
                        eg.analysis.leaves.push((activation_bytes(ty, scale), dist));
                        local.insert(x, format!("l{k}"));
                        sig.push_str(&format!("leaf l{k} {}\n", dist.name()));
                        let leaf = eg.add(node(format!("l{k}"), Vec::new()));
                        match dist {
                            Dist::P => eg.add(node("ar".into(), vec![leaf])),
                            _ => leaf,
                        }
                    }
                };
                class.insert(x, c);
                args.push(c);
            }
            let ins: Vec<&TensorType> = op.inputs.iter().map(|&x| g.ty(x)).collect();
            let outs: Vec<&TensorType> = op.outputs.iter().map(|&x| g.ty(x)).collect();
            let strategies = Rc::new(strategies(&op.kind, &ins, &outs, n, ep));
            // Every operand whole over tp; over ep, as the first whole strategy on the
            // operands' sides wants them, else as the first whole one does, each operand on
            // the wrong side moved by an all-to-all.
            let sides: Vec<Ep> = args.iter().map(|&c| eg[c].data.ep).collect();
            let whole: Vec<&Strategy> = strategies
                .iter()
                .filter(|s| s.ins.iter().all(|&d| d == Dist::R))
                .collect();
            if let Some(s) = whole.iter().find(|s| s.ep_ins == sides).or(whole.first()) {
                for (a, (&have, &want)) in args.iter_mut().zip(sides.iter().zip(&s.ep_ins)) {
                    if have != want {
                        *a = eg.add(node(format!("a2a.{}", want.symbol()), vec![*a]));
                    }
                }
            }
            sig.push_str(&format!(
                "{:?}({}) -> {:?}\n",
                op.kind,
                op.inputs
                    .iter()
                    .map(|x| format!("{}:{:?}", local[x], g.ty(*x).dims))
                    .collect::<Vec<_>>()
                    .join(", "),
                outs.iter().map(|t| &t.dims).collect::<Vec<_>>()
            ));
            for (k, &o) in op.outputs.iter().enumerate() {
                let idx = eg.analysis.ops.len();
                eg.analysis.ops.push(OpInfo {
                    op: i,
                    out: k,
                    outs: op.outputs.len(),
                    strategies: strategies.clone(),
                    bytes: activation_bytes(g.ty(o), scale),
                });
                let c = eg.add(node(format!("o{idx}"), args.clone()));
                class.insert(o, c);
                local.insert(o, format!("v{idx}"));
            }
        }
        // Roots: what leaves the group (whole), and every parameter's update. A result nobody
        // reads (a recomputed layer's last) may be in any layout: not a root. A root only
        // other groups read may leave as the partial sum its all-reduce reduces (with
        // `partial_edges`; [`Group::solve`]).
        let mut roots = Vec::new();
        let mut crossing: Vec<(Vec<ValueId>, bool)> = Vec::new();
        for &i in ops {
            for &o in &g.ops[i].outputs {
                let leaves = readers
                    .get(&o)
                    .is_some_and(|r| r.iter().any(|x| *x != name));
                let grad_only = g
                    .outputs
                    .iter()
                    .any(|(n, v)| *v == o && n.starts_with("grad:"))
                    && !leaves;
                if (leaves || outputs.contains(&o)) && !grad_only {
                    let c = class[&o];
                    let j = match roots.iter().position(|&r| r == c) {
                        Some(j) => j,
                        None => {
                            roots.push(c);
                            crossing.push((Vec::new(), partial_edges));
                            roots.len() - 1
                        }
                    };
                    crossing[j].0.push(o);
                    crossing[j].1 &= leaves && !outputs.contains(&o);
                }
            }
        }
        let mut updates = vec![None; eg.analysis.params.len()];
        for (k, info) in eg.analysis.params.clone().iter().enumerate() {
            let Some(gv) = grad_of.get(info.name.as_str()) else {
                continue;
            };
            if !producer.get(gv).is_some_and(|p| in_group.contains(p)) {
                continue;
            }
            let gc = class[gv];
            let mut u = eg.add(node(format!("u{k}.R"), vec![gc]));
            for &d in &info.dims {
                let s = eg.add(node(format!("slice.{d}"), vec![gc]));
                let ud = eg.add(node(format!("u{k}.{d}"), vec![s]));
                eg.union(u, ud);
                u = eg.find(u);
            }
            updates[k] = Some(u);
            sig.push_str(&format!("update p{k} from {}\n", local[gv]));
        }
        let root_names: Vec<String> = roots
            .iter()
            .map(|r| {
                class
                    .iter()
                    .filter(|(_, c)| *c == r)
                    .map(|(v, _)| local[v].clone())
                    .min()
                    .unwrap_or_default()
            })
            .collect();
        sig.push_str(&format!("roots {}\n", root_names.join(", ")));
        eg.rebuild();
        Group {
            name: name.to_string(),
            ops: ops.to_vec(),
            eg,
            roots,
            crossing,
            updates,
            signature: sig,
        }
    }

    /// Saturate, extract, and fix parameters until each has one layout.
    ///
    /// Returns every parameter's layout, the placement, and the layout each root leaves the
    /// group in: whole, or, for a root only other groups read whose extracted term is the
    /// all-reduce of a partial sum, that partial sum (the emitter reduces a value where an
    /// op needs it whole, so the reading group's term holds the all-reduce).
    fn solve(
        self,
        g: &Graph,
        rules: &[Rewrite<SymbolLang, Layouts>],
    ) -> Result<(Vec<Dist>, GroupPlacement, Vec<Dist>), String> {
        let b = self.name.clone();
        let mut all_roots: Vec<Id> = self.roots.clone();
        all_roots.extend(self.updates.iter().flatten());
        let whole_fixed: HashMap<usize, Dist> = (0..self.eg.analysis.params.len())
            .map(|k| (k, Dist::R))
            .collect();
        let whole_cost = {
            let ex = Extractor::new(
                &self.eg,
                CostModel {
                    egraph: &self.eg,
                    fixed: &whole_fixed,
                },
            );
            all_roots.iter().map(|&r| ex.find_best_cost(r)).sum::<f64>()
        };
        let runner = Runner::<SymbolLang, Layouts, ()>::new(Layouts::default())
            .with_egraph(self.eg)
            .with_scheduler(SimpleScheduler)
            .with_iter_limit(200)
            .with_node_limit(2_000_000)
            .with_time_limit(Duration::from_secs(3600))
            .run(rules);
        let stop = runner.stop_reason.clone();
        if !matches!(stop, Some(StopReason::Saturated)) {
            return Err(format!(
                "the tensor-parallel rewrites of {b} did not saturate: {stop:?}"
            ));
        }
        let eg = &runner.egraph;
        if let Some(c) = &eg.analysis.conflict {
            return Err(format!("{b}: {c}"));
        }
        let roots: Vec<Id> = all_roots.iter().map(|&r| eg.find(r)).collect();
        let np = eg.analysis.params.len();
        let mut fixed: HashMap<usize, Dist> = HashMap::new();
        let mut extractions = 0;
        loop {
            let (cost, ex) = extract(eg, &roots, &fixed);
            extractions += 1;
            if !cost.is_finite() {
                return Err(format!("{b}: no valid tensor-parallel placement was found"));
            }
            let used = used_layouts(eg, &ex, &roots, np);
            drop(ex);
            let Some(k) = (0..np).find(|&k| used[k].len() > 1) else {
                break;
            };
            let mut best: Option<(f64, Dist)> = None;
            let candidates: Vec<Dist> = std::iter::once(Dist::R)
                .chain(eg.analysis.params[k].dims.iter().map(|&d| Dist::S(d)))
                .collect();
            for l in candidates {
                let mut f = fixed.clone();
                f.insert(k, l);
                let (c, _) = extract(eg, &roots, &f);
                extractions += 1;
                if best.is_none_or(|(bc, _)| c < bc) {
                    best = Some((c, l));
                }
            }
            let (_, l) = best.expect("a used layout");
            fixed.insert(k, l);
        }
        let (_, ex) = extract(eg, &roots, &fixed);
        let mut leaves_as = Vec::with_capacity(self.crossing.len());
        let mut roots = roots;
        for (j, (_, may)) in self.crossing.iter().enumerate() {
            let nd = ex.find_best_node(roots[j]);
            let partial =
                *may && kind_of(nd.op) == Some(Kind::Ar) && eg[nd.children[0]].data.dist == Dist::P;
            if partial {
                roots[j] = eg.find(nd.children[0]);
            }
            leaves_as.push(if partial { Dist::P } else { Dist::R });
        }
        drop(ex);
        let (cost, ex) = extract(eg, &roots, &fixed);
        let used = used_layouts(eg, &ex, &roots, np);
        let layouts: Vec<Dist> = (0..np)
            .map(|k| used[k].iter().next().copied().unwrap_or(Dist::R))
            .collect();
        let (term, all_reduces) = term_text(g, eg, &ex, &roots, &layouts);
        let place: HashMap<usize, usize> =
            self.ops.iter().enumerate().map(|(j, &i)| (i, j)).collect();
        let mut choices: Vec<(usize, Operands)> = Vec::new();
        for c in walk(eg, &ex, &roots) {
            let nd = ex.find_best_node(c);
            if let Some(Kind::Op(k)) = kind_of(nd.op) {
                let ins = operands_of(nd, |ch| eg[ch].data.clone());
                let choice = (place[&eg.analysis.ops[k].op], ins);
                if !choices.contains(&choice) {
                    choices.push(choice);
                }
            }
        }
        Ok((
            layouts,
            GroupPlacement {
                group: b,
                same_as: None,
                stop: format!("{:?}", StopReason::Saturated),
                iterations: runner.iterations.len(),
                nodes: eg.total_size(),
                classes: eg.number_of_classes(),
                extractions,
                term,
                all_reduces,
                cost,
                whole_cost,
                choices,
            },
            leaves_as,
        ))
    }
}

type Ex<'a> = Extractor<'a, CostModel<'a>, SymbolLang, Layouts>;

/// The cheapest term for `roots` with the parameters in `fixed` held to their layout, and
/// its cost.
fn extract<'a>(eg: &'a Graphs, roots: &[Id], fixed: &'a HashMap<usize, Dist>) -> (f64, Ex<'a>) {
    let ex = Extractor::new(eg, CostModel { egraph: eg, fixed });
    if roots.iter().any(|&r| !ex.find_best_cost(r).is_finite()) {
        return (f64::INFINITY, ex);
    }
    // The term's cost counts every e-class it holds once (a value read by many is held
    // and communicated once), unlike the extractor's tree cost.
    let mut model = CostModel { egraph: eg, fixed };
    let c: f64 = walk(eg, &ex, roots)
        .into_iter()
        .map(|c| model.cost(ex.find_best_node(c), |_| 0.0))
        .sum();
    (c, ex)
}

/// The nodes of the extracted term, children before parents.
fn walk(eg: &Graphs, ex: &Ex<'_>, roots: &[Id]) -> Vec<Id> {
    let mut seen: HashSet<Id> = HashSet::new();
    let mut order = Vec::new();
    let mut stack: Vec<(Id, bool)> = roots.iter().rev().map(|&r| (r, false)).collect();
    while let Some((c, done)) = stack.pop() {
        let c = eg.find(c);
        if done {
            if seen.insert(c) {
                order.push(c);
            }
            continue;
        }
        if seen.contains(&c) {
            continue;
        }
        stack.push((c, true));
        for &ch in ex.find_best_node(c).children().iter().rev() {
            if !seen.contains(&eg.find(ch)) {
                stack.push((ch, false));
            }
        }
    }
    order
}

/// The layouts each parameter has in the extracted term (uses and update).
fn used_layouts(
    eg: &Graphs,
    ex: &Ex<'_>,
    roots: &[Id],
    np: usize,
) -> Vec<std::collections::BTreeSet<Dist>> {
    let mut used = vec![std::collections::BTreeSet::new(); np];
    for c in walk(eg, ex, roots) {
        match kind_of(ex.find_best_node(c).op) {
            Some(Kind::Param(k, l)) | Some(Kind::Update(k, l)) => {
                used[k].insert(l);
            }
            _ => {}
        }
    }
    used
}

fn term_text(
    g: &Graph,
    eg: &Graphs,
    ex: &Ex<'_>,
    roots: &[Id],
    layouts: &[Dist],
) -> (String, usize) {
    let a = &eg.analysis;
    let mut lines: Vec<String> = a
        .params
        .iter()
        .zip(layouts)
        .map(|(p, &l)| format!("param {} {}", p.name, l.name()))
        .collect();
    let mut num: HashMap<Id, usize> = HashMap::new();
    let mut ars = 0;
    let order = walk(eg, ex, roots);
    // The all-reduce of a partial gradient the update reads is the optimizer's, not tp's.
    let reduced_by_optimizer: HashSet<Id> = order
        .iter()
        .map(|&c| ex.find_best_node(c))
        .filter(|n| matches!(kind_of(n.op), Some(Kind::Update(..))))
        .map(|n| eg.find(n.children[0]))
        .collect();
    for c in order {
        let nd = ex.find_best_node(c);
        let arg = |ch: &Id| format!("%{}", num[&eg.find(*ch)]);
        let args: Vec<String> = nd.children.iter().map(arg).collect();
        let text = match kind_of(nd.op) {
            Some(Kind::Ar) => {
                if !reduced_by_optimizer.contains(&c) {
                    ars += 1;
                }
                format!("ar({})", args[0])
            }
            Some(Kind::Slice(d)) => format!("slice.{d}({})", args[0]),
            Some(Kind::Exchange(Ep::Experts)) => format!("all_to_all.to_experts({})", args[0]),
            Some(Kind::Exchange(Ep::Tokens)) => format!("all_to_all.to_tokens({})", args[0]),
            Some(Kind::Leaf(k)) => format!("leaf {k}"),
            Some(Kind::Param(k, _)) => a.params[k].name.clone(),
            Some(Kind::Update(k, l)) => {
                format!("update {}({}) as {}", a.params[k].name, args[0], l.name())
            }
            Some(Kind::Op(k)) => {
                let info = &a.ops[k];
                let op = &g.ops[info.op];
                let out = if info.outs > 1 {
                    format!(".{}", info.out)
                } else {
                    String::new()
                };
                format!("{}{out}({}) # {}", op.kind.name(), args.join(", "), op.path)
            }
            None => nd.op.to_string(),
        };
        let k = num.len();
        num.insert(c, k);
        lines.push(format!("%{k} = {text} : {}", eg[c].data.name()));
    }
    let names: Vec<String> = roots
        .iter()
        .map(|r| format!("%{}", num[&eg.find(*r)]))
        .collect();
    lines.push(format!("roots {}", names.join(", ")));
    (lines.join("\n") + "\n", ars)
}
