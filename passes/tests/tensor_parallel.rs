//! Tensor-parallel placement by egg rewrites over the real layer IR
//! (`passes/src/tensor_parallel.rs`): every family's groups saturate, the extracted term of
//! each family's layers is a snapshot (`passes/tests/tensor_parallel/*.txt`; `MEGAC_BLESS=1
//! cargo test -p megac-passes --test tensor_parallel` rewrites them, review the diff), the
//! extracted parameter layouts are Megatron's (a table written here from Megatron-core's
//! layers, not from the code under test), the emitted all-reduces are the term's, and
//! removing a rule changes the placement.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use megac_ir::{Axis, Graph, ModelSpec, OpKind};
use megac_passes::collectives::block;
use megac_passes::run_pipeline;
use megac_passes::tensor_parallel::{place, rules, Placement, RULE_NAMES};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn spec(model: &str, sets: &[String]) -> ModelSpec {
    let path = root()
        .join("tests/passes/models")
        .join(format!("{model}.toml"));
    megac_frontend::load(&path, sets).unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn graph_after(spec: &ModelSpec, last: &str) -> Graph {
    run_pipeline(spec.clone(), Some(last), true)
        .expect("the pipeline runs")
        .graph
        .expect("a graph")
}

/// (case, model, extra `--set`s, tp, whether MoE (tp needs sequence parallelism), the
/// layers to snapshot).
type Case = (
    &'static str,
    &'static str,
    &'static [&'static str],
    u64,
    bool,
    &'static [&'static str],
);

const CASES: &[Case] = &[
    ("llama", "llama-1l", &[], 2, false, &["model.layers.0"]),
    // tp = 4 > kv_heads = 2: k and v whole, their heads repeated.
    ("llama_tp4", "llama-1l", &[], 4, false, &["model.layers.0"]),
    ("gpt", "gpt-1l", &[], 2, false, &["transformer.h.0"]),
    ("mistral", "mistral-1l", &[], 2, false, &["model.layers.0"]),
    ("qwen2", "qwen2-1l", &[], 2, false, &["model.layers.0"]),
    ("qwen3", "qwen3-1l", &[], 2, false, &["model.layers.0"]),
    ("mixtral", "moe-1l", &[], 2, true, &["model.layers.0"]),
    (
        "qwen2_moe",
        "qwen2-moe-1l",
        &[],
        2,
        true,
        &["model.layers.0"],
    ),
    // Expert parallelism with expert tensor parallelism: stacked experts over ep.
    (
        "mixtral_ep",
        "moe-1l",
        &["parallel.dp=2", "parallel.ep=2"],
        2,
        true,
        &["model.layers.0"],
    ),
    (
        "qwen2_moe_dense_first",
        "qwen2-moe-1l",
        &["model.layers=2", "model.moe.first_dense_layers=1"],
        2,
        true,
        &["model.layers.0", "model.layers.1"],
    ),
];

fn case_spec(c: &Case) -> ModelSpec {
    let (_, model, extra, tp, moe, _) = c;
    let mut sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    sets.push(format!("parallel.tp={tp}"));
    if *moe {
        sets.push("parallel.sequence_parallel=true".into());
    }
    spec(model, &sets)
}

fn placement(
    spec: &ModelSpec,
    rules: &[egg::Rewrite<egg::SymbolLang, megac_passes::tensor_parallel::Layouts>],
) -> Placement {
    let g = graph_after(spec, "recompute");
    let mb = spec.train.micro_batch as f64 / spec.train.global_batch as f64;
    let sp = spec.parallel.tp > 1 && spec.parallel.sequence_parallel;
    place(&g, spec.parallel.tp, spec.parallel.ep, mb, sp, rules)
        .expect("the rewrites find a placement")
}

fn bless() -> bool {
    std::env::var_os("MEGAC_BLESS").is_some_and(|v| v == "1")
}

#[test]
fn every_family_saturates_and_its_layer_term_is_the_snapshot() {
    let mut failures = Vec::new();
    for c in CASES {
        let (case, _, _, _, _, layers) = c;
        let p = placement(&case_spec(c), &rules());
        for g in &p.groups {
            assert_eq!(g.stop, "Saturated", "{case}: {}", g.group);
            assert!(g.cost < g.whole_cost, "{case}: {}: {g:?}", g.group);
        }
        let mut text = String::new();
        for layer in *layers {
            let g = p
                .groups
                .iter()
                .find(|g| g.group == *layer)
                .unwrap_or_else(|| panic!("{case}: no group {layer}"));
            text.push_str(&format!(
                "; group {}: stop {}, {} iterations, {} e-nodes, {} e-classes, {} extractions; \
                 cost {} (every parameter whole {}); {} all-reduce\n{}\n",
                g.group,
                g.stop,
                g.iterations,
                g.nodes,
                g.classes,
                g.extractions,
                g.cost,
                g.whole_cost,
                g.all_reduces,
                g.term
            ));
        }
        let path = root()
            .join("passes/tests/tensor_parallel")
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
        "{}\n(if the new terms are right: MEGAC_BLESS=1 cargo test -p megac-passes --test tensor_parallel)",
        failures.join("\n")
    );
}

/// Megatron-core's layout of a parameter over tp (`megatron/core/tensor_parallel/layers.py`:
/// `ColumnParallelLinear` splits the weight's output rows and its bias, `RowParallelLinear`
/// the input columns and keeps the bias whole, `VocabParallelEmbedding` the vocabulary;
/// norms, the MoE router (`TopKRouter`) and the shared-expert gate are replicated; experts
/// under ETP = tp split like the dense MLP), with HF's names and storage orders; `kv_split`:
/// whether tp divides the kv heads (megac keeps k/v whole otherwise, Megatron refuses).
fn megatron(name: &str, kv_split: bool) -> Option<usize> {
    // Stacked experts (`experts.w1.weight`, `[experts, ffn, h]`, under ep): the same split,
    // one dim further in.
    if name.contains(".experts.w") {
        return megatron(&name.replace(".experts.", ".experts.0."), kv_split).map(|d| d + 1);
    }
    let ends = |s: &[&str]| s.iter().any(|x| name.ends_with(x));
    if name.starts_with("transformer.") {
        // GPT-2's Conv1D weights are [in, out].
        return if ends(&["attn.c_attn.weight", "mlp.c_fc.weight"]) {
            Some(1)
        } else if ends(&[
            "attn.c_attn.bias",
            "mlp.c_fc.bias",
            "attn.c_proj.weight",
            "mlp.c_proj.weight",
            "transformer.wte.weight",
        ]) {
            Some(0)
        } else {
            None
        };
    }
    if !kv_split
        && ends(&[
            "k_proj.weight",
            "v_proj.weight",
            "k_proj.bias",
            "v_proj.bias",
        ])
    {
        return None;
    }
    if ends(&[
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
        ".w1.weight",
        ".w3.weight",
        "embed_tokens.weight",
    ]) || name == "lm_head.weight"
    {
        Some(0)
    } else if ends(&["o_proj.weight", "down_proj.weight", ".w2.weight"]) {
        Some(1)
    } else {
        None
    }
}

#[test]
fn extracted_layouts_are_megatrons() {
    for c in CASES {
        let spec = case_spec(c);
        let kv_split = spec.model.kv_heads.is_multiple_of(spec.parallel.tp);
        let p = placement(&spec, &rules());
        let want: BTreeMap<String, Option<usize>> = p
            .params
            .keys()
            .map(|n| (n.clone(), megatron(n, kv_split)))
            .collect();
        assert_eq!(p.params, want, "{}", c.0);
        assert!(p.params.values().any(|d| d.is_some()), "{}", c.0);
    }
}

/// Without tensor parallelism's sequence parallelism the emitted tp layout has exactly the
/// term's all-reduces (dense families; MoE needs sequence parallelism under tp).
#[test]
fn emitted_all_reduces_are_the_terms() {
    for c in CASES.iter().filter(|c| !c.4) {
        let spec = case_spec(c);
        let p = placement(&spec, &rules());
        let sharded = graph_after(&spec, "shard");
        for layer in c.5 {
            let g = p.groups.iter().find(|g| g.group == *layer).unwrap();
            let emitted = sharded
                .ops
                .iter()
                .filter(|op| block(&op.path) == *layer)
                .filter(|op| matches!(&op.kind, OpKind::AllReduce { axes } if axes == &[Axis::Tp]))
                .count();
            assert_eq!(emitted, g.all_reduces, "{}: {layer}", c.0);
        }
    }
}

/// Under expert parallelism the emitted all-to-alls of each MoE layer are the extracted
/// term's: the exchanges between the tokens' and the experts' ranks are where the term put
/// them (forward: to the experts before w1/w3, back before the combine; backward: the
/// mirror pair), each value moved once.
#[test]
fn emitted_all_to_alls_are_the_terms() {
    let mut checked = 0;
    for c in CASES
        .iter()
        .filter(|c| c.2.iter().any(|s| s.starts_with("parallel.ep=")))
    {
        for tp in [1, 2] {
            let (_, model, extra, _, _, layers) = c;
            let mut sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            sets.push(format!("parallel.tp={tp}"));
            if tp > 1 {
                sets.push("parallel.sequence_parallel=true".into());
            }
            let spec = spec(model, &sets);
            let p = placement(&spec, &rules());
            let sharded = graph_after(&spec, "shard");
            for layer in *layers {
                let g = p.groups.iter().find(|g| g.group == *layer).unwrap();
                let in_term = g.term.matches("all_to_all.").count();
                let emitted = sharded
                    .ops
                    .iter()
                    .filter(|op| block(&op.path) == *layer)
                    .filter(|op| matches!(&op.kind, OpKind::AllToAll { .. }))
                    .count();
                assert_eq!(emitted, in_term, "{} tp {tp}: {layer}", c.0);
                assert_eq!(in_term, 4, "{} tp {tp}: {layer}\n{}", c.0, g.term);
                checked += 1;
            }
        }
    }
    assert!(checked >= 2, "{checked}");
}

/// Each rule matters on the real llama layer: without it the placement changes (without
/// the slices of parameters or of ops nothing is split; without the reduction no
/// row-parallel or vocab-parallel layout is found).
#[test]
fn removing_a_rule_changes_the_placement() {
    let spec = case_spec(&CASES[0]);
    let full = placement(&spec, &rules());
    assert_eq!(
        full.params["model.layers.0.self_attn.o_proj.weight"],
        Some(1)
    );
    for (i, name) in RULE_NAMES.iter().enumerate() {
        let mut fewer = rules();
        fewer.remove(i);
        let p = placement(&spec, &fewer);
        assert_ne!(p.params, full.params, "without {name}");
        let layer = |p: &Placement| {
            p.groups
                .iter()
                .find(|g| g.group == "model.layers.0")
                .unwrap()
                .term
                .clone()
        };
        assert_ne!(layer(&p), layer(&full), "without {name}");
        match *name {
            "op-on-shards-reduces" => {
                assert_eq!(p.params["model.layers.0.self_attn.o_proj.weight"], None);
                assert_eq!(p.params["model.embed_tokens.weight"], None);
            }
            _ => assert!(p.params.values().all(|d| d.is_none()), "without {name}"),
        }
    }
}

/// Every op `shard` emits (but conversions, and ops on sequence shards, whose algebra is
/// `collectives::token_wise`'s) has operand and result tp layouts that its layout algebra
/// (`tensor_parallel::strategies`) lists: the emission and the algebra the extraction ran
/// on agree, op by op, on every family under tp and tp+sp.
#[test]
fn emitted_layouts_follow_each_ops_algebra() {
    use megac_passes::tensor_parallel::{stacked, strategies, Dist, Ep};
    let dist = |g: &Graph, v: megac_ir::ValueId| -> Option<Dist> {
        let ty = g.ty(v);
        if ty.layout.partial.contains(&Axis::Tp) {
            return Some(Dist::P);
        }
        match ty.layout.shards.iter().position(|s| s.contains(&Axis::Tp)) {
            Some(d) if ty.dims[d].name == "s" => None,
            Some(d) => Some(Dist::S(d)),
            None => Some(Dist::R),
        }
    };
    let mut checked = 0;
    for c in CASES {
        for sp in [false, true] {
            if c.4 && !sp {
                continue;
            }
            let (_, model, extra, tp, _, _) = c;
            let mut sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            sets.push(format!("parallel.tp={tp}"));
            if sp {
                sets.push("parallel.sequence_parallel=true".into());
            }
            let spec = spec(model, &sets);
            let ep = spec.parallel.ep;
            let g = graph_after(&spec, "shard");
            let side = |v: megac_ir::ValueId| {
                let ty = g.ty(v);
                if stacked(ty) && ty.layout.shards[0].contains(&Axis::Ep) {
                    Ep::Experts
                } else {
                    Ep::Tokens
                }
            };
            for op in &g.ops {
                if matches!(
                    op.kind,
                    OpKind::AllReduce { .. }
                        | OpKind::AllGather { .. }
                        | OpKind::ReduceScatter { .. }
                        | OpKind::Slice { .. }
                        | OpKind::AllToAll { .. }
                ) {
                    continue;
                }
                let ins: Option<Vec<Dist>> = op.inputs.iter().map(|&v| dist(&g, v)).collect();
                let outs: Option<Vec<Dist>> = op.outputs.iter().map(|&v| dist(&g, v)).collect();
                let (Some(ins), Some(outs)) = (ins, outs) else {
                    continue;
                };
                let tys: Vec<&megac_ir::TensorType> = op.inputs.iter().map(|&v| g.ty(v)).collect();
                let otys: Vec<&megac_ir::TensorType> =
                    op.outputs.iter().map(|&v| g.ty(v)).collect();
                let ep_ins: Vec<Ep> = op.inputs.iter().map(|&v| side(v)).collect();
                let ep_outs: Vec<Ep> = op.outputs.iter().map(|&v| side(v)).collect();
                let listed = strategies(&op.kind, &tys, &otys, *tp, ep).iter().any(|s| {
                    s.ins == ins && s.outs == outs && s.ep_ins == ep_ins && s.ep_outs == ep_outs
                });
                assert!(
                    listed,
                    "{} (sp {sp}): {} at {}: {ins:?} {ep_ins:?} -> {outs:?} {ep_outs:?} is not in its algebra",
                    c.0,
                    op.kind.name(),
                    op.path
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 500, "{checked}");
}

/// The forward-only graph of inference plans (no gradients, no updates) gets the same
/// parameter layouts as training.
#[test]
fn inference_layouts_are_the_trainings() {
    for c in CASES {
        let spec = case_spec(c);
        let g = megac_passes::run_inference_pipeline(spec.clone())
            .expect("the inference pipeline runs")
            .graph
            .expect("a graph");
        let kv_split = spec.model.kv_heads.is_multiple_of(spec.parallel.tp);
        for (_, name, ty) in g.params() {
            let got = ty.layout.shards.iter().position(|s| s.contains(&Axis::Tp));
            assert_eq!(got, megatron(name, kv_split), "{}: {name}", c.0);
        }
    }
}

/// A rule set that never saturates (each application adds a fresh leaf) is an error, never
/// a placement.
#[test]
fn an_unsaturated_run_is_an_error() {
    use egg::{
        Applier, Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, SymbolLang, Var,
    };
    use megac_passes::tensor_parallel::Layouts;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static FRESH: AtomicUsize = AtomicUsize::new(1_000_000);
    struct Grow;
    impl Searcher<SymbolLang, Layouts> for Grow {
        fn search_eclass_with_limit(
            &self,
            _: &egg::EGraph<SymbolLang, Layouts>,
            eclass: Id,
            limit: usize,
        ) -> Option<SearchMatches<'_, SymbolLang>> {
            (limit > 0).then(|| SearchMatches {
                eclass,
                substs: vec![Subst::default()],
                ast: None,
            })
        }
        fn vars(&self) -> Vec<Var> {
            Vec::new()
        }
    }
    impl Applier<SymbolLang, Layouts> for Grow {
        fn apply_one(
            &self,
            egraph: &mut egg::EGraph<SymbolLang, Layouts>,
            eclass: Id,
            _: &Subst,
            _: Option<&PatternAst<SymbolLang>>,
            _: Symbol,
        ) -> Vec<Id> {
            let k = FRESH.fetch_add(1, Ordering::Relaxed);
            let leaf = egraph.add(SymbolLang::leaf(format!("l{k}")));
            if egraph.union(eclass, leaf) {
                return vec![leaf];
            }
            Vec::new()
        }
    }
    let mut grow = rules();
    grow.push(Rewrite::new("grow", Grow, Grow).unwrap());
    let spec = case_spec(&CASES[0]);
    let g = graph_after(&spec, "recompute");
    let err = place(&g, 2, 1, 0.5, false, &grow).unwrap_err();
    assert!(err.contains("did not saturate"), "{err}");
}

/// The emitted layouts are the extracted term's: on every example under tp 2 (with and
/// without sequence parallelism) and, for the MoE ones, under ep 2 (with tp 2 and sequence
/// parallelism too) and with a fixed expert capacity under tp 2 and sequence parallelism,
/// every op the term holds is emitted under one of the term's choices for it (none falls
/// back to its operands' layouts, and none runs as its operands are where the term's choice
/// would move them: `shard::departures_from_term` is empty). The group edges are what makes
/// this hold: the first layer reads the vocab-parallel embedding's partial sum, as the
/// term's leaf says; and the term is extracted for the graph with its gradient sums
/// reordered (partial contributions first), so Qwen1.5-MoE's dispatch gradients under tp
/// and sequence parallelism take their partial operands as they are, for every expert.
#[test]
fn every_emitted_op_runs_as_the_term_says() {
    let mut examples: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    examples.sort();
    let one_stage = [
        "parallel.pp=1",
        "parallel.vpp=1",
        "parallel.cp=1",
        "parallel.dp=1",
        "parallel.ep=1",
        "parallel.schedule=\"1f1b\"",
        "parallel.distributed_optimizer=false",
        "parallel.sequence_parallel=false",
    ];
    let mut checked = 0;
    let mut failures = Vec::new();
    for path in &examples {
        let moe = std::fs::read_to_string(path)
            .unwrap()
            .contains("[model.moe]");
        let mut layouts: Vec<Vec<&str>> = Vec::new();
        if !moe {
            layouts.push(vec!["parallel.tp=2"]);
        }
        layouts.push(vec!["parallel.tp=2", "parallel.sequence_parallel=true"]);
        if moe {
            layouts.push(vec!["parallel.dp=2", "parallel.ep=2"]);
            layouts.push(vec![
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ]);
            layouts.push(vec![
                "model.moe.capacity_factor=1.0",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ]);
        }
        for layout in layouts {
            let sets: Vec<String> = one_stage
                .iter()
                .chain(&layout)
                .map(|s| s.to_string())
                .collect();
            let spec = megac_frontend::load(path, &sets)
                .unwrap_or_else(|e| panic!("{}: {layout:?}: {e}", path.display()));
            let g = graph_after(&spec, "recompute");
            let mb = spec.train.micro_batch as f64 / spec.train.global_batch as f64;
            let sp = spec.parallel.sequence_parallel;
            let p = place(&g, 2, spec.parallel.ep, mb, sp, &rules()).unwrap();
            assert!(!p.ops.is_empty(), "{}: {layout:?}", path.display());
            let departures = megac_passes::shard::departures_from_term(&g, &spec)
                .unwrap_or_else(|e| panic!("{}: {layout:?}: {e}", path.display()));
            if !departures.is_empty() {
                let mut d = departures.clone();
                d.dedup();
                failures.push(format!("{} {layout:?}:\n{}", path.display(), d.join("\n")));
            }
            checked += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "emitted in a layout not the term's:\n{}",
        failures.join("\n")
    );
    assert!(checked >= 20, "{checked}");
}
