//! Collective placement by egg rewrites over the real layer IR (`passes/src/collectives.rs`):
//! every family's layer saturates, its extracted term is a snapshot
//! (`passes/tests/collectives/*.txt`; `MEGAC_BLESS=1 cargo test -p megac-passes --test
//! collectives` rewrites them, review the diff), the emitted collectives are the term's,
//! per-layer collective counts under tp and tp+sp are pinned beside Megatron-core's (equal for
//! dense layers, the MoE differences explained), and removing a rule changes the placement.

use std::path::{Path, PathBuf};

use megac_ir::{Axis, Graph, ModelSpec, OpKind};
use megac_passes::collectives::{block, rules, RULE_NAMES};
use megac_passes::run_pipeline;
use megac_passes::shard::{placement_with, sequence_parallel_placement};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn spec(model: &str, sets: &[&str]) -> ModelSpec {
    let path = root()
        .join("tests/passes/models")
        .join(format!("{model}.toml"));
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{model}: {e}"))
}

/// The graph as `shard` sees it (after recompute), and after `last`.
fn graph_after(spec: &ModelSpec, last: &str) -> Graph {
    run_pipeline(spec.clone(), Some(last), true)
        .expect("the pipeline runs")
        .graph
        .expect("a graph")
}

/// Every family's layer: (case name, model, extra `--set`s, the layer blocks to snapshot).
const CASES: &[(&str, &str, &[&str], &[&str])] = &[
    ("llama", "llama-1l", &[], &["model.layers.0"]),
    ("gpt", "gpt-1l", &[], &["transformer.h.0"]),
    ("mistral", "mistral-1l", &[], &["model.layers.0"]),
    ("qwen2", "qwen2-1l", &[], &["model.layers.0"]),
    ("qwen3", "qwen3-1l", &[], &["model.layers.0"]),
    ("mixtral", "moe-1l", &[], &["model.layers.0"]),
    ("qwen2_moe", "qwen2-moe-1l", &[], &["model.layers.0"]),
    (
        "qwen2_moe_dense_first",
        "qwen2-moe-1l",
        &["model.layers=2", "model.moe.first_dense_layers=1"],
        &["model.layers.0", "model.layers.1"],
    ),
];

fn tp_sets(extra: &[&str], sp: bool) -> Vec<String> {
    let mut v: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    v.push("parallel.tp=2".into());
    if sp {
        v.push("parallel.sequence_parallel=true".into());
    }
    v
}

fn spec_tp(model: &str, extra: &[&str], sp: bool) -> ModelSpec {
    let sets = tp_sets(extra, sp);
    let sets: Vec<&str> = sets.iter().map(|s| s.as_str()).collect();
    spec(model, &sets)
}

fn bless() -> bool {
    std::env::var_os("MEGAC_BLESS").is_some_and(|v| v == "1")
}

#[test]
fn every_family_saturates_and_its_layer_term_is_the_snapshot() {
    let mut failures = Vec::new();
    for (case, model, extra, layers) in CASES {
        let spec = spec_tp(model, extra, true);
        let g = graph_after(&spec, "recompute");
        let p = sequence_parallel_placement(&g, &spec).expect("the rewrites find a placement");
        assert!(!p.blocks.is_empty());
        for b in &p.blocks {
            assert_eq!(b.stop, "Saturated", "{case}: {}", b.block);
            assert!(b.cost <= b.start_cost, "{case}: {}: {b:?}", b.block);
        }
        let mut text = String::new();
        for layer in *layers {
            let b = p
                .blocks
                .iter()
                .find(|b| b.block == *layer)
                .unwrap_or_else(|| panic!("{case}: no block {layer}"));
            text.push_str(&format!(
                "; block {}: stop {}, {} iterations, {} e-nodes, {} e-classes; cost {} (tp alone {}); \
                 {} all-reduce, {} all-gather, {} reduce-scatter, {} all-reduce of gradients\n{}\n",
                b.block,
                b.stop,
                b.iterations,
                b.nodes,
                b.classes,
                b.cost,
                b.start_cost,
                b.all_reduces,
                b.all_gathers,
                b.reduce_scatters,
                b.sum_all_reduces,
                b.term
            ));
        }
        let path = root()
            .join("passes/tests/collectives")
            .join(format!("{case}.txt"));
        if bless() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(want) if want == text => {}
            Ok(_) => failures.push(format!("{}: the extracted term changed", path.display())),
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
    }
    assert!(
        failures.is_empty(),
        "{}\n(if the new terms are right: MEGAC_BLESS=1 cargo test -p megac-passes --test collectives)",
        failures.join("\n")
    );
}

/// Sequence-dim tp collectives (all-reduce, all-gather, reduce-scatter) of a block's ops,
/// forward (before the first backward op) and backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    ar: usize,
    ag: usize,
    rs: usize,
}

fn counts(g: &Graph, layer: &str) -> (Counts, Counts) {
    let first_backward = g
        .ops
        .iter()
        .position(|op| op.kind.is_backward())
        .unwrap_or(g.ops.len());
    let (mut fwd, mut bwd) = (Counts::default(), Counts::default());
    for (i, op) in g.ops.iter().enumerate() {
        if block(&op.path) != layer {
            continue;
        }
        let c = if i < first_backward {
            &mut fwd
        } else {
            &mut bwd
        };
        let seq = |dim: u64| g.ty(op.inputs[0]).dims[dim as usize].name == "s";
        match &op.kind {
            OpKind::AllReduce { axes } if axes == &[Axis::Tp] => c.ar += 1,
            OpKind::AllGather { axes, dim } if axes == &[Axis::Tp] && seq(*dim) => c.ag += 1,
            OpKind::ReduceScatter { axes, dim } if axes == &[Axis::Tp] && seq(*dim) => c.rs += 1,
            _ => {}
        }
    }
    (fwd, bwd)
}

const fn c(ar: usize, ag: usize, rs: usize) -> Counts {
    Counts { ar, ag, rs }
}

/// Megatron-core's collectives per layer (forward, backward before `regather`; read from
/// NVIDIA/Megatron-LM at d98e8a64dd: `tensor_parallel/layers.py` and `mappings.py`,
/// `transformer/moe/token_dispatcher.py` (`MoEAllGatherTokenDispatcher`, ETP = tp, ep = 1),
/// `transformer/moe/shared_experts.py`), megac's, and why they differ.
///
/// Dense layer, tp: `RowParallelLinear` all-reduces after attention and after the MLP, the
/// backward of `ColumnParallelLinear`'s `copy_to_tensor_model_parallel_region` all-reduces
/// the input gradients of q/k/v (one: megac sums the three partial contributions first) and
/// of gate/up. tp+sp: each all-reduce is a reduce-scatter at the block's end and an
/// all-gather at the next block's start, mirrored in backward (the all-gathers Megatron
/// repeats for the weight gradients are `regather`'s, after this count). qkv bias, qk-norm
/// and a dense first layer change none of it.
///
/// MoE layer, tp+sp (Megatron requires sequence parallelism for MoE under tp, as megac):
/// Megatron runs the router on the sequence shards and its dispatcher all-gathers the
/// routing map, the probabilities and the hidden states, then reduce-scatters the combined
/// output: forward (0, 4, 2) with attention's pair; backward (0, 2, 3), the probabilities'
/// gradient reduce-scattered. megac all-gathers the MoE input once and runs the router, the
/// experts (and the shared expert) on the whole tokens: forward 2 all-gathers fewer; the
/// probabilities' gradient, partial over tp as Megatron's, is all-reduced (`[b, s, top_k]`)
/// instead of reduce-scattered: backward one all-reduce more, one reduce-scatter fewer.
///
/// Qwen2-MoE's shared expert: Megatron's `SharedExpertMLP` gathers its own input and
/// reduce-scatters its output (forward (0, 5, 3), backward (0, 3, 4)); its gate is a linear
/// on the sequence shards. megac's shared expert reads the routed experts' gathered input
/// (forward one all-gather fewer again) and its gate's linear runs on the whole tokens, the
/// sigmoid product on shards: backward one all-gather more (the gate logits' gradient,
/// `[b, s, 1]`). The MoE input's gradient sums the routed experts' and the shared
/// expert's partial contributions before one reduce-scatter (`shard`'s
/// `sum_partials_first` puts them ahead of the whole ones, the router's and the gate's),
/// where Megatron reduce-scatters the routed and the shared expert's apart: backward two
/// reduce-scatters fewer than Megatron's four (one more fewer for the probabilities).
#[test]
fn per_layer_collectives_are_megatrons() {
    // (case, layer, Megatron's (tp forward, backward), megac's tp, Megatron's tp+sp, megac's
    // tp+sp). MoE under tp requires sequence parallelism: no tp counts.
    type Pair = (Counts, Counts);
    type Row = (Option<Pair>, Option<Pair>, Pair, Pair);
    let dense: Row = (
        Some((c(2, 0, 0), c(2, 0, 0))),
        Some((c(2, 0, 0), c(2, 0, 0))),
        (c(0, 2, 2), c(0, 2, 2)),
        (c(0, 2, 2), c(0, 2, 2)),
    );
    let moe: Row = (
        None,
        None,
        (c(0, 4, 2), c(0, 2, 3)),
        (c(0, 2, 2), c(1, 2, 2)),
    );
    let shared: Row = (
        None,
        None,
        (c(0, 5, 3), c(0, 3, 4)),
        (c(0, 2, 3), c(1, 4, 2)),
    );
    let dense_in_moe: Row = (None, None, dense.2, dense.3);
    let expect: &[(&str, &str, Row)] = &[
        ("llama", "model.layers.0", dense),
        ("gpt", "transformer.h.0", dense),
        ("mistral", "model.layers.0", dense),
        ("qwen2", "model.layers.0", dense),
        ("qwen3", "model.layers.0", dense),
        ("mixtral", "model.layers.0", moe),
        ("qwen2_moe", "model.layers.0", shared),
        ("qwen2_moe_dense_first", "model.layers.0", dense_in_moe),
        ("qwen2_moe_dense_first", "model.layers.1", shared),
    ];
    let mut got = Vec::new();
    for (case, layer, (_, tp_want, _, _)) in expect {
        let (_, model, extra, _) = CASES.iter().find(|c| c.0 == *case).unwrap();
        let tp =
            tp_want.map(|_| counts(&graph_after(&spec_tp(model, extra, false), "shard"), layer));
        let sp = counts(&graph_after(&spec_tp(model, extra, true), "shard"), layer);
        got.push((*case, *layer, (tp, sp)));
    }
    let want: Vec<_> = expect
        .iter()
        .map(|(a, b, (_, tp, _, sp))| (*a, *b, (*tp, *sp)))
        .collect();
    assert_eq!(got, want);
    // Where megac and Megatron agree: every dense layer, tp and tp+sp.
    for (case, layer, (m_tp, tp, m_sp, sp)) in expect
        .iter()
        .filter(|r| r.2 == dense || r.2 == dense_in_moe)
    {
        assert_eq!((m_tp, m_sp), (tp, sp), "{case}: {layer}");
    }
}

/// The emitted layer has the extracted term's collectives.
#[test]
fn emitted_collectives_are_the_terms() {
    for (case, model, extra, layers) in CASES {
        let spec = spec_tp(model, extra, true);
        let p = sequence_parallel_placement(&graph_after(&spec, "recompute"), &spec).unwrap();
        let sharded = graph_after(&spec, "shard");
        for layer in *layers {
            let b = p.blocks.iter().find(|b| b.block == *layer).unwrap();
            let (f, w) = counts(&sharded, layer);
            assert_eq!(
                (f.ar + w.ar, f.ag + w.ag, f.rs + w.rs),
                (b.all_reduces, b.all_gathers, b.reduce_scatters),
                "{case}: {layer}"
            );
        }
    }
}

/// Without `ar = ag(rs)` the rewrites cannot leave tensor parallelism's all-reduces: on the
/// real llama layer, the placement changes (no op on shards, all-reduces in the term).
#[test]
fn removing_a_rule_changes_the_placement() {
    let spec = spec_tp("llama-1l", &[], true);
    let g = graph_after(&spec, "recompute");
    let full = sequence_parallel_placement(&g, &spec).unwrap();
    let layer = |p: &megac_passes::collectives::Placement| {
        p.blocks
            .iter()
            .find(|b| b.block == "model.layers.0")
            .cloned()
            .unwrap()
    };
    let colls = |b: &megac_passes::collectives::BlockPlacement| {
        (b.all_reduces, b.all_gathers, b.reduce_scatters)
    };
    assert!(full.on_shards.values().any(|&s| s));
    assert_eq!(colls(&layer(&full)), (0, 4, 4));
    for (i, name) in RULE_NAMES.iter().enumerate() {
        let mut fewer = rules();
        fewer.remove(i);
        let p = placement_with(&g, &spec, &fewer).unwrap();
        assert_ne!(colls(&layer(&p)), colls(&layer(&full)), "without {name}");
        assert_ne!(layer(&p).term, layer(&full).term, "without {name}");
        if *name == "allreduce-is-gather-of-scatter" {
            // Sums on shards only by all-reducing and slicing: no reduce-scatter is found.
            assert_eq!(layer(&p).reduce_scatters, 0, "without {name}");
            assert!(layer(&p).all_reduces > 0, "without {name}");
        }
        if *name == "token-op-commutes-with-gather" {
            assert!(p.on_shards.values().all(|&s| !s), "without {name}");
        }
    }
}
