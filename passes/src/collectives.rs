//! Collective rewrites with egg: where do a transformer layer's collectives go?
//!
//! The tensor-parallel placement of one layer's residual stream is written as a term of a
//! small language (per-token ops `norm` and `add`, the column- and row-parallel linear
//! blocks `col` and `row`, and the collectives `ar`, `ag`, `rs` along the sequence dim).
//! The collective algebra is a set of rewrites:
//!
//! - `ar(p) = ag(rs(p))`: an all-reduce is a reduce-scatter followed by an all-gather;
//! - per-token ops commute with gathering along the sequence: `norm(ag(x)) = ag(norm(x))`,
//!   `add(ag(a), ag(b)) = ag(add(a, b))`;
//! - taking this rank's sequence shard cancels a gather (`shard(ag(x)) = x`), turns an
//!   all-reduce into a reduce-scatter (`shard(ar(p)) = rs(p)`), and commutes with per-token
//!   ops.
//!
//! Extraction picks the cheapest equivalent term under a cost model of bytes: collectives
//! move `(n-1)/n` of an activation per gather or scatter (twice that for an all-reduce), and
//! a per-token op touches its whole operand, or `1/n` of it on sequence shards. The result is
//! the placement `shard` applies to every layer when `sequence_parallel = true`: whether norms
//! and residual adds run on sequence shards, and how many gathers, scatters and all-reduces a
//! layer needs. With these rules it arrives at Megatron's sequence parallelism by itself:
//! 2 all-gathers and 2 reduce-scatters per layer, no all-reduce.

use egg::{
    define_language, rewrite as rw, CostFunction, Extractor, Id, RecExpr, Rewrite, Runner, Symbol,
};

define_language! {
    /// One layer's residual stream and its collectives: `norm` (per-token norm), `add`
    /// (residual), `col`/`row` (column-/row-parallel linear), `ar`/`ag`/`rs` (all-reduce,
    /// all-gather, reduce-scatter over tp), `shard` (this rank's sequence shard), the input.
    #[allow(missing_docs)]
    pub enum Coll {
        "norm" = Norm(Id),
        "add" = Add([Id; 2]),
        "col" = Col(Id),
        "row" = Row(Id),
        "ar" = AllReduce(Id),
        "ag" = AllGather(Id),
        "rs" = ReduceScatter(Id),
        "shard" = Shard(Id),
        Input(Symbol),
    }
}

/// How a value is distributed over the tp group.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Dist {
    /// Split along the sequence.
    Seq,
    /// Whole on every rank.
    Full,
    /// Split along the hidden dim (between a column- and a row-parallel linear).
    Hidden,
    /// A pending sum.
    Partial,
    /// Not a valid program (e.g. a norm of a partial sum).
    Invalid,
}

/// Bytes moved and touched, and the distribution of the result.
#[derive(Clone, Copy, Debug)]
pub struct Cost {
    bytes: f64,
    dist: Dist,
}

impl PartialEq for Cost {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        self.bytes.partial_cmp(&other.bytes)
    }
}

/// The cost model: `n` ranks, activations of `bytes` bytes, linear blocks of a fixed cost.
struct Bytes {
    n: f64,
    activation: f64,
}

impl CostFunction<Coll> for Bytes {
    type Cost = Cost;

    fn cost<C: FnMut(Id) -> Cost>(&mut self, enode: &Coll, mut costs: C) -> Cost {
        let b = self.activation;
        let wire = b * (self.n - 1.0) / self.n;
        let invalid = Cost {
            bytes: f64::INFINITY,
            dist: Dist::Invalid,
        };
        let touch = |d: Dist| if d == Dist::Seq { b / self.n } else { b };
        match enode {
            Coll::Input(_) => Cost {
                bytes: 0.0,
                dist: Dist::Seq,
            },
            Coll::Norm(x) => {
                let c = costs(*x);
                match c.dist {
                    Dist::Seq | Dist::Full => Cost {
                        bytes: c.bytes + touch(c.dist),
                        dist: c.dist,
                    },
                    _ => invalid,
                }
            }
            Coll::Add([a, b2]) => {
                let (x, y) = (costs(*a), costs(*b2));
                if x.dist != y.dist || x.dist == Dist::Invalid || x.dist == Dist::Hidden {
                    return invalid;
                }
                Cost {
                    bytes: x.bytes + y.bytes + touch(x.dist),
                    dist: x.dist,
                }
            }
            Coll::Col(x) => {
                let c = costs(*x);
                if c.dist != Dist::Full {
                    return invalid;
                }
                Cost {
                    bytes: c.bytes + b,
                    dist: Dist::Hidden,
                }
            }
            Coll::Row(x) => {
                let c = costs(*x);
                if c.dist != Dist::Hidden {
                    return invalid;
                }
                Cost {
                    bytes: c.bytes + b,
                    dist: Dist::Partial,
                }
            }
            Coll::AllReduce(x) => {
                let c = costs(*x);
                if c.dist != Dist::Partial {
                    return invalid;
                }
                Cost {
                    bytes: c.bytes + 2.0 * wire,
                    dist: Dist::Full,
                }
            }
            Coll::AllGather(x) => {
                let c = costs(*x);
                if c.dist != Dist::Seq {
                    return invalid;
                }
                Cost {
                    bytes: c.bytes + wire,
                    dist: Dist::Full,
                }
            }
            Coll::ReduceScatter(x) => {
                let c = costs(*x);
                if c.dist != Dist::Partial {
                    return invalid;
                }
                Cost {
                    bytes: c.bytes + wire,
                    dist: Dist::Seq,
                }
            }
            Coll::Shard(x) => {
                let c = costs(*x);
                if c.dist != Dist::Full {
                    return invalid;
                }
                Cost {
                    bytes: c.bytes,
                    dist: Dist::Seq,
                }
            }
        }
    }
}

/// The collective algebra.
pub fn rules() -> Vec<Rewrite<Coll, ()>> {
    vec![
        rw!("allreduce-is-gather-of-scatter"; "(ar ?p)" => "(ag (rs ?p))"),
        rw!("norm-commutes-with-gather"; "(norm (ag ?x))" => "(ag (norm ?x))"),
        rw!("gather-commutes-with-norm"; "(ag (norm ?x))" => "(norm (ag ?x))"),
        rw!("add-commutes-with-gather"; "(add (ag ?a) (ag ?b))" => "(ag (add ?a ?b))"),
        rw!("gather-commutes-with-add"; "(ag (add ?a ?b))" => "(add (ag ?a) (ag ?b))"),
        rw!("shard-cancels-gather"; "(shard (ag ?x))" => "?x"),
        rw!("shard-of-allreduce-is-scatter"; "(shard (ar ?p))" => "(rs ?p)"),
        rw!("shard-commutes-with-add"; "(shard (add ?a ?b))" => "(add (shard ?a) (shard ?b))"),
        rw!("shard-commutes-with-norm"; "(shard (norm ?x))" => "(norm (shard ?x))"),
    ]
}

/// One layer with Megatron's tensor-parallel placement: the input is the previous layer's
/// sequence-sharded output `x`, gathered; each block ends in an all-reduce; the layer's output
/// is requested on sequence shards.
pub fn tensor_parallel_layer() -> RecExpr<Coll> {
    let mut e = RecExpr::default();
    let x = e.add(Coll::Input(Symbol::from("x")));
    let mut h = e.add(Coll::AllGather(x));
    for _ in 0..2 {
        // norm -> column-parallel -> row-parallel -> all-reduce -> residual add
        let n = e.add(Coll::Norm(h));
        let c = e.add(Coll::Col(n));
        let r = e.add(Coll::Row(c));
        let a = e.add(Coll::AllReduce(r));
        h = e.add(Coll::Add([h, a]));
    }
    e.add(Coll::Shard(h));
    e
}

/// The distribution of every node of `expr` (None where the program is invalid).
fn distributions(expr: &RecExpr<Coll>, n: u64) -> Vec<Dist> {
    let mut model = Bytes {
        n: n as f64,
        activation: 1.0,
    };
    let mut out: Vec<Cost> = Vec::new();
    for node in expr.as_ref() {
        let c = model.cost(node, |i| out[usize::from(i)]);
        out.push(c);
    }
    out.into_iter().map(|c| c.dist).collect()
}

/// What the rewrites found for one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// The extracted term.
    pub term: String,
    /// All-gathers per layer (forward).
    pub all_gathers: usize,
    /// Reduce-scatters per layer (forward).
    pub reduce_scatters: usize,
    /// All-reduces per layer (forward).
    pub all_reduces: usize,
    /// Whether norms run on sequence shards.
    pub norms_on_shards: bool,
    /// Bytes of the extracted term (cost model units).
    pub cost: f64,
    /// Bytes of the tensor-parallel placement, for comparison.
    pub tp_cost: f64,
}

/// Saturate the layer term with the collective algebra and extract the cheapest placement
/// for `n` tensor-parallel ranks.
pub fn sequence_parallel_placement(n: u64) -> Placement {
    let start = tensor_parallel_layer();
    let runner = Runner::default()
        .with_iter_limit(20)
        .with_node_limit(10_000)
        .with_expr(&start)
        .run(&rules());
    let model = || Bytes {
        n: n as f64,
        activation: 1.0,
    };
    let extractor = Extractor::new(&runner.egraph, model());
    let (cost, best) = extractor.find_best(runner.roots[0]);
    let tp_cost = model().cost_rec(&start).bytes;
    let count = |f: fn(&Coll) -> bool| best.as_ref().iter().filter(|n| f(n)).count();
    let dist = distributions(&best, n);
    let norms_on_shards = best
        .as_ref()
        .iter()
        .all(|node| !matches!(node, Coll::Norm(x) if dist[usize::from(*x)] != Dist::Seq));
    Placement {
        term: best.to_string(),
        all_gathers: count(|n| matches!(n, Coll::AllGather(_))),
        reduce_scatters: count(|n| matches!(n, Coll::ReduceScatter(_))),
        all_reduces: count(|n| matches!(n, Coll::AllReduce(_))),
        norms_on_shards,
        cost: cost.bytes,
        tp_cost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_find_megatron_sequence_parallelism() {
        for n in [2, 4, 8] {
            let p = sequence_parallel_placement(n);
            assert_eq!(
                (p.all_gathers, p.reduce_scatters, p.all_reduces),
                (2, 2, 0),
                "{p:?}"
            );
            assert!(p.norms_on_shards, "{p:?}");
            assert!(p.cost < p.tp_cost, "{p:?}");
        }
    }

    #[test]
    fn the_starting_point_is_tensor_parallel() {
        let t = tensor_parallel_layer();
        let n = t
            .as_ref()
            .iter()
            .filter(|n| matches!(n, Coll::AllReduce(_)))
            .count();
        assert_eq!(n, 2);
        let dist = distributions(&t, 2);
        assert!(dist.iter().all(|d| *d != Dist::Invalid));
        assert_eq!(*dist.last().unwrap(), Dist::Seq);
    }

    /// Without the all-reduce = gather-of-scatter rule the rewrites cannot leave the
    /// tensor-parallel placement: the rules, not a hard-coded answer, find the placement.
    #[test]
    fn without_the_algebra_nothing_changes() {
        let start = tensor_parallel_layer();
        let runner = Runner::default()
            .with_expr(&start)
            .run(&rules()[1..5].to_vec());
        let extractor = Extractor::new(
            &runner.egraph,
            Bytes {
                n: 2.0,
                activation: 1.0,
            },
        );
        let (_, best) = extractor.find_best(runner.roots[0]);
        let ar = best
            .as_ref()
            .iter()
            .filter(|n| matches!(n, Coll::AllReduce(_)))
            .count();
        assert_eq!(ar, 2, "{best}");
    }

    #[test]
    fn extracted_layer() {
        let p = sequence_parallel_placement(2);
        insta::assert_snapshot!(p.term);
    }
}
