//! The pass pipeline on the examples: snapshots of every pass's output for the tiny models,
//! verification after every pass, text round-trips, and parameter counts of the real models.

use std::path::{Path, PathBuf};

use megac_ir::{parse_graph, print_graph, verify};
use megac_passes::{pass_names, run_pipeline};

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name)
}

fn load(name: &str, sets: &[&str]) -> megac_ir::ModelSpec {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    megac_frontend::load(&example(name), &sets).unwrap_or_else(|e| panic!("{}", e.render()))
}

const TINY: [&str; 3] = ["llama-tiny.toml", "gpt-tiny.toml", "moe-tiny.toml"];
const REAL: [&str; 4] = [
    "llama3-8b.toml",
    "llama3-70b.toml",
    "gpt3-175b.toml",
    "mixtral-8x7b.toml",
];

#[test]
fn snapshot_every_pass_of_the_tiny_examples() {
    for file in TINY {
        let mut previous = String::new();
        for pass in pass_names() {
            let module = run_pipeline(load(file, &[]), Some(pass), true)
                .unwrap_or_else(|e| panic!("{file} after {pass}: {e}"));
            let dump = module.dump();
            // MegaScope's instrumentation passes are no-ops unless a run asks for probes or
            // perturbations (tests/passes/perturb and tests/passes/probe pin them when asked): the
            // graph is the previous pass's, byte for byte.
            if matches!(pass, "perturb" | "probe") {
                assert_eq!(
                    dump, previous,
                    "{file}: {pass} changed a graph that asked for nothing"
                );
                continue;
            }
            let stem = file.trim_end_matches(".toml");
            insta::assert_snapshot!(format!("{stem}__after_{pass}"), dump);
            previous = dump;
        }
    }
}

#[test]
fn every_example_verifies_and_round_trips_through_the_text_form() {
    for file in TINY.iter().chain(REAL.iter()) {
        let module = run_pipeline(load(file, &[]), None, true).unwrap();
        let graph = module.graph.unwrap();
        let text = print_graph(&graph);
        let back = parse_graph(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        verify(&back).unwrap();
        assert!(
            back == graph,
            "{file}: parsed graph differs from the built one"
        );
        assert_eq!(print_graph(&back), text, "{file}: printing is not stable");
    }
}

#[test]
fn dumps_are_deterministic() {
    let a = run_pipeline(load("moe-tiny.toml", &[]), None, true)
        .unwrap()
        .dump();
    let b = run_pipeline(load("moe-tiny.toml", &[]), None, true)
        .unwrap()
        .dump();
    assert_eq!(a, b);
}

fn params(file: &str) -> u64 {
    let spec = load(file, &[]);
    let vocab = spec.model.vocab;
    run_pipeline(spec, None, true)
        .unwrap()
        .graph
        .unwrap()
        .param_count_unpadded(vocab)
}

fn assert_close(file: &str, got: u64, want: f64, tol: f64) {
    let rel = (got as f64 - want).abs() / want;
    assert!(
        rel < tol,
        "{file}: {got} parameters, want {want:e} (relative error {rel:.4})"
    );
}

/// Parameter counts of the real models against their published sizes.
#[test]
fn real_model_parameter_counts() {
    // Llama-3 8B: 8,030,261,248 parameters (the issue asks for 0.5% of 8.03e9).
    assert_eq!(params("llama3-8b.toml"), 8_030_261_248);
    assert_close("llama3-8b.toml", params("llama3-8b.toml"), 8.03e9, 0.005);
    // Llama-3 70B: 70,553,706,496.
    assert_eq!(params("llama3-70b.toml"), 70_553_706_496);
    // Mixtral 8x7B: 46,702,792,704.
    assert_eq!(params("mixtral-8x7b.toml"), 46_702_792_704);
    // Qwen2-7B: 7,615,616,512 (its q/k/v biases are 28 · (3584 + 2 · 512) = 129,024 of them).
    assert_eq!(params("qwen2-7b.toml"), 7_615_616_512);
    // Mistral-7B v0.1: 7,241,732,096 (the sliding window has no parameters).
    assert_eq!(params("mistral-7b.toml"), 7_241_732_096);
    // Qwen3-8B: 8,190,735,360 (head_dim 128 from the family's default; q/k norms).
    assert_eq!(params("qwen3-8b.toml"), 8_190_735_360);
    // Qwen1.5-MoE-A2.7B: 14,315,784,192 (60 routed experts of 1408 and a gated shared
    // expert of 5632 in each of 24 layers; q/k/v biases).
    assert_eq!(params("qwen1.5-moe-a2.7b.toml"), 14_315_784_192);
    // GPT-3 175B with GPT-2's vocabulary and tied embeddings: 12·l·h² + biases and norms
    // + V·h + seq·h ≈ 174.6e9.
    assert_close("gpt3-175b.toml", params("gpt3-175b.toml"), 174.6e9, 0.005);
}

/// HF parameter names and shapes (spot checks against the transformers classes).
#[test]
fn hugging_face_parameter_names() {
    let g = run_pipeline(load("gpt-tiny.toml", &[]), None, true)
        .unwrap()
        .graph
        .unwrap();
    let find = |name: &str| -> Vec<u64> {
        g.params()
            .find(|(_, n, _)| *n == name)
            .unwrap_or_else(|| panic!("no parameter {name}"))
            .2
            .sizes()
    };
    // GPT-2's Conv1D stores [in, out].
    assert_eq!(find("transformer.h.0.attn.c_attn.weight"), vec![64, 192]);
    assert_eq!(find("transformer.h.1.mlp.c_proj.weight"), vec![256, 64]);
    assert_eq!(find("transformer.wpe.weight"), vec![64, 64]);
    assert!(
        g.params().all(|(_, n, _)| n != "lm_head.weight"),
        "gpt ties lm_head"
    );

    let g = run_pipeline(load("moe-tiny.toml", &[]), None, true)
        .unwrap()
        .graph
        .unwrap();
    let names: Vec<&str> = g.params().map(|(_, n, _)| n).collect();
    for want in [
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.1.block_sparse_moe.experts.3.w2.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ] {
        assert!(names.contains(&want), "missing {want}");
    }
}

#[test]
fn overrides_reach_the_graph() {
    let g = run_pipeline(
        load(
            "llama-tiny.toml",
            &["parallel.tp=2", "train.precision=\"bf16\""],
        ),
        None,
        true,
    )
    .unwrap()
    .graph
    .unwrap();
    let text = print_graph(&g);
    assert!(text.contains("mesh tp=2 "), "{}", &text[..200]);
    // Mixed precision: bf16 working weights, so the embedding already yields bf16
    // activations; weight gradients stay f32 (Megatron's main_grad); AdamW keeps a master.
    assert!(
        !text.contains("= cast("),
        "no cast is needed after a bf16 embedding"
    );
    assert!(text.contains("bf16[b=8, s=64, h=64]"));
    assert!(text.contains("bf16[vocab=256, h=64]"), "{}", &text[..600]);
    assert!(text.contains("master=1"));
}

/// Under activation recomputation, backward ops read recomputed clones, never the forward
/// pass's own layer-internal activations (selective: never attention results).
#[test]
fn recompute_rewires_backward_uses_to_clones() {
    use megac_ir::{OpKind, ValueDef};
    use megac_passes::recompute::layer_of;
    for policy in ["selective", "full"] {
        for file in TINY {
            let set = format!("train.recompute=\"{policy}\"");
            let module = run_pipeline(load(file, &[&set]), Some("recompute"), true).unwrap();
            let g = module.graph.unwrap();
            assert_eq!(parse_graph(&print_graph(&g)).unwrap(), g);
            let start = g.ops.iter().position(|op| op.kind.is_backward()).unwrap();
            let clones = g.ops[..start]
                .iter()
                .filter(|op| op.path.ends_with("(recompute)"))
                .count();
            assert_eq!(clones, 0, "{file}: clones belong after the forward pass");
            let producer = |v: megac_ir::ValueId| match g.value(v).def {
                ValueDef::Op(op, _) => Some(op.0 as usize),
                _ => None,
            };
            let mut rewired = 0;
            for op in &g.ops[start..] {
                for &v in &op.inputs {
                    let Some(p) = producer(v) else { continue };
                    let src = &g.ops[p];
                    if src.path.ends_with("(recompute)") {
                        rewired += 1;
                        continue;
                    }
                    if p >= start {
                        continue;
                    }
                    let Some(layer) = layer_of(&src.path) else {
                        continue;
                    };
                    let leaves_layer = g.ops[..start]
                        .iter()
                        .any(|u| u.inputs.contains(&v) && layer_of(&u.path) != Some(layer));
                    let bad = match policy {
                        "full" => !leaves_layer,
                        _ => matches!(src.kind, OpKind::CausalAttention { .. }),
                    };
                    assert!(
                        !bad,
                        "{file} ({policy}): backward op {} reads %{} of {} directly",
                        op.kind.name(),
                        v.0,
                        src.path
                    );
                }
            }
            assert!(rewired > 0, "{file} ({policy}): nothing was recomputed");
        }
    }
    let module = run_pipeline(
        load("llama-tiny.toml", &["train.recompute=\"full\""]),
        Some("recompute"),
        true,
    )
    .unwrap();
    insta::assert_snapshot!("llama-tiny__recompute_full", module.dump());
}

/// Data parallelism in the IR: inputs sharded over dp along the batch, activations follow,
/// parameter gradients and the loss are pending sums that the optimizer reduces.
#[test]
fn data_parallel_layouts_and_collectives() {
    let module = run_pipeline(load("llama-tiny.toml", &["parallel.dp=2"]), None, true).unwrap();
    let g = module.graph.as_ref().unwrap();
    let text = module.dump();
    assert!(text.contains("i32[b=8, s=64] {b:dp}"));
    let reduces = g
        .ops
        .iter()
        .filter(|op| matches!(op.kind, megac_ir::OpKind::AllReduce { .. }))
        .count();
    assert_eq!(
        reduces,
        g.params().count(),
        "one gradient reduction per parameter"
    );
    let loss = g.outputs.iter().find(|(n, _)| n == "loss").unwrap().1;
    assert_eq!(g.ty(loss).layout.partial, vec![megac_ir::Axis::Dp]);
    assert_eq!(parse_graph(&text).unwrap(), *g);
    insta::assert_snapshot!("llama-tiny__dp2", text);
    // Rank 1's local view halves the batch.
    let local = print_graph(&g.localize(1).unwrap());
    assert!(local.contains("i32[b=4, s=64] {b:dp}"));
}

/// Tensor parallelism (Megatron's placement without sequence parallelism): per layer, the
/// forward reduces twice over tp (after the attention and MLP row-parallel linears, before
/// the next norm) and the backward twice (the input gradients of the column-parallel
/// linears); the vocab-parallel embedding adds one forward reduction and the vocab-parallel
/// output layer one backward reduction (its input gradient), as in Megatron.
#[test]
fn tensor_parallel_collectives_per_layer() {
    use megac_ir::OpKind;
    use megac_passes::recompute::layer_of;
    for file in ["llama-tiny.toml", "gpt-tiny.toml"] {
        let module = run_pipeline(load(file, &["parallel.tp=2"]), Some("shard"), true).unwrap();
        let g = module.graph.as_ref().unwrap();
        let backward_start = g.ops.iter().position(|op| op.kind.is_backward()).unwrap();
        let tp_reduce = |op: &megac_ir::Op| matches!(&op.kind, OpKind::AllReduce { axes } if axes == &[megac_ir::Axis::Tp]);
        let gathers = g
            .ops
            .iter()
            .filter(|op| matches!(op.kind, OpKind::AllGather { .. }))
            .count();
        assert_eq!(gathers, 0, "{file}: nothing should need gathering");
        let fwd: Vec<&megac_ir::Op> = g.ops[..backward_start]
            .iter()
            .filter(|op| tp_reduce(op))
            .collect();
        let bwd: Vec<&megac_ir::Op> = g.ops[backward_start..]
            .iter()
            .filter(|op| tp_reduce(op))
            .collect();
        // 2 layers: 2 per layer, plus the embedding (forward) or the output layer (backward).
        assert_eq!(fwd.len(), 2 * 2 + 1, "{file}: forward tp all-reduces");
        assert_eq!(bwd.len(), 2 * 2 + 1, "{file}: backward tp all-reduces");
        for layer in ["0", "1"] {
            let n = bwd
                .iter()
                .filter(|op| layer_of(&op.path).is_some_and(|l| l.ends_with(layer)))
                .count();
            assert_eq!(n, 2, "{file}: layer {layer} backward all-reduces");
        }
    }
    let module = run_pipeline(load("llama-tiny.toml", &["parallel.tp=2"]), None, true).unwrap();
    insta::assert_snapshot!("llama-tiny__tp2", module.dump());
}

/// Sequence parallelism: the collective rewrites put norms and residual adds on sequence
/// shards, so every layer has Megatron's placement — forward 2 all-gathers and
/// 2 reduce-scatters over tp along the sequence and no all-reduce; backward the mirror.
#[test]
fn sequence_parallel_collectives_per_layer() {
    use megac_ir::{Axis, OpKind};
    use megac_passes::recompute::layer_of;
    let sets = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    let module = run_pipeline(load("llama-tiny.toml", &sets), Some("shard"), true).unwrap();
    let g = module.graph.as_ref().unwrap();
    let backward_start = g.ops.iter().position(|op| op.kind.is_backward()).unwrap();
    let tally = |ops: &[megac_ir::Op], layer: &str| {
        let mut counts = (0, 0, 0);
        for op in ops.iter().filter(|op| layer_of(&op.path) == Some(layer)) {
            match &op.kind {
                OpKind::AllGather { axes, dim } if axes == &[Axis::Tp] && *dim == 1 => {
                    counts.0 += 1
                }
                OpKind::ReduceScatter { axes, dim } if axes == &[Axis::Tp] && *dim == 1 => {
                    counts.1 += 1
                }
                OpKind::AllReduce { axes } if axes == &[Axis::Tp] => counts.2 += 1,
                _ => {}
            }
        }
        counts
    };
    // Layer 1 (layer 0 also takes the embedding's reduce-scatter at its first norm).
    assert_eq!(
        tally(&g.ops[..backward_start], "model.layers.1"),
        (2, 2, 0),
        "forward"
    );
    assert_eq!(
        tally(&g.ops[backward_start..], "model.layers.1"),
        (2, 2, 0),
        "backward"
    );
    let all_reduces = g
        .ops
        .iter()
        .filter(|op| matches!(&op.kind, OpKind::AllReduce { axes } if axes == &[Axis::Tp]))
        .count();
    assert_eq!(all_reduces, 0, "no tp all-reduce anywhere in the step");
    insta::assert_snapshot!("llama-tiny__tp2_sp", module.dump());
}

/// Expert parallelism: per MoE layer, forward one all-to-all over ep that sends tokens to
/// their experts' ranks and one that brings the outputs back; backward the mirror (the
/// output gradients to the experts, the input gradients back). Expert weights are split
/// over ep and their gradients reduced over the expert-data-parallel group only.
#[test]
fn expert_parallel_collectives_per_layer() {
    use megac_ir::{Axis, OpKind};
    use megac_passes::recompute::layer_of;
    let sets = [
        "parallel.dp=4",
        "parallel.ep=2",
        "train.micro_batch=2",
        "train.global_batch=8",
    ];
    let module = run_pipeline(load("moe-tiny.toml", &sets), None, true).unwrap();
    let g = module.graph.as_ref().unwrap();
    let text = module.dump();
    assert_eq!(parse_graph(&text).unwrap(), *g);
    let backward_start = g.ops.iter().position(|op| op.kind.is_backward()).unwrap();
    for layer in ["model.layers.0", "model.layers.1"] {
        let a2a = |ops: &[megac_ir::Op]| -> Vec<(u64, u64)> {
            ops.iter()
                .filter(|op| layer_of(&op.path) == Some(layer))
                .filter_map(|op| match &op.kind {
                    OpKind::AllToAll {
                        axes,
                        split,
                        concat,
                    } if axes == &[Axis::Ep] => Some((*split, *concat)),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(a2a(&g.ops[..backward_start]), [(0, 1), (1, 0)], "{layer}");
        assert_eq!(a2a(&g.ops[backward_start..]), [(0, 1), (1, 0)], "{layer}");
    }
    // Expert gradients: split over ep, summed over the 2 ranks holding the same experts.
    let w1 = "model.layers.0.block_sparse_moe.experts.w1.weight";
    let p = g.params().find(|(_, n, _)| *n == w1).unwrap().0;
    assert_eq!(g.ty(p).layout.shards[0], vec![Axis::Ep]);
    let reduce = g
        .ops
        .iter()
        .find(|op| op.path == format!("optimizer.reduce.{w1}"))
        .unwrap();
    assert_eq!(
        reduce.kind,
        OpKind::AllReduce {
            axes: vec![Axis::Edp]
        }
    );
    assert!(text.contains("{experts:ep, tokens:edp} = all_to_all("));
}

/// Expert tensor parallelism (Megatron's ETP = tp): expert weights split over tp like a dense
/// MLP (w1/w3 column-parallel, w2 row-parallel), the router replicated, the combined expert
/// output a partial sum reduced once per MoE layer. Per layer with sequence parallelism:
/// forward 2 all-gathers and 2 reduce-scatters over tp along the sequence (attention and
/// MoE, as Megatron), no all-reduce; backward the mirror plus one all-reduce of the
/// router-weight gradient (`[b, s, top_k]`: a dot product with the experts' partial
/// outputs). Without sequence parallelism (which the frontend refuses for MoE, as Megatron
/// does, but the shard pass supports): forward 2 all-reduces, backward 3.
#[test]
fn expert_tensor_parallel_collectives_per_layer() {
    use megac_ir::{Axis, OpKind};
    use megac_passes::recompute::layer_of;
    let tally = |ops: &[megac_ir::Op], layer: &str| {
        let mut counts = (0, 0, 0);
        for op in ops.iter().filter(|op| layer_of(&op.path) == Some(layer)) {
            match &op.kind {
                OpKind::AllGather { axes, dim } if axes == &[Axis::Tp] && *dim == 1 => {
                    counts.0 += 1
                }
                OpKind::ReduceScatter { axes, dim } if axes == &[Axis::Tp] && *dim == 1 => {
                    counts.1 += 1
                }
                OpKind::AllReduce { axes } if axes == &[Axis::Tp] => counts.2 += 1,
                OpKind::AllGather { axes, .. }
                | OpKind::ReduceScatter { axes, .. }
                | OpKind::AllReduce { axes }
                    if axes.contains(&Axis::Tp) =>
                {
                    panic!("{layer}: unexpected {}", op.kind.name())
                }
                _ => {}
            }
        }
        counts
    };
    // The same per-layer counts with stacked experts split over ep (dp2+ep2+tp2).
    let ep = &["parallel.dp=2", "parallel.ep=2"][..];
    for (extra, sp, fwd, bwd) in [
        (&[][..], true, (2, 2, 0), (2, 2, 1)),
        (&[][..], false, (0, 0, 2), (0, 0, 3)),
        (ep, true, (2, 2, 0), (2, 2, 1)),
        (ep, false, (0, 0, 2), (0, 0, 3)),
    ] {
        let mut sets = vec!["parallel.tp=2", "parallel.sequence_parallel=true"];
        sets.extend_from_slice(extra);
        let mut spec = load("moe-tiny.toml", &sets);
        spec.parallel.sequence_parallel = sp;
        let stacked = !extra.is_empty();
        let module = run_pipeline(spec, Some("shard"), true).unwrap();
        let g = module.graph.as_ref().unwrap();
        assert_eq!(parse_graph(&module.dump()).unwrap(), *g);
        let backward_start = g.ops.iter().position(|op| op.kind.is_backward()).unwrap();
        for layer in ["model.layers.0", "model.layers.1"] {
            let f = tally(&g.ops[..backward_start], layer);
            let b = tally(&g.ops[backward_start..], layer);
            assert_eq!(
                f, fwd,
                "{sets:?} sp={sp} {layer} forward (all-gather, reduce-scatter, all-reduce)"
            );
            assert_eq!(
                b, bwd,
                "{sets:?} sp={sp} {layer} backward (all-gather, reduce-scatter, all-reduce)"
            );
        }
        if stacked {
            // Stacked `[experts, ffn, h]` / `[experts, h, ffn]`: experts over ep, ffn over tp.
            let p = |name: &str| {
                let p = g.params().find(|(_, n, _)| *n == name).unwrap().0;
                g.ty(p).layout.shards.clone()
            };
            let e = "model.layers.1.block_sparse_moe.experts";
            let (ep, tp) = (vec![Axis::Ep], vec![Axis::Tp]);
            assert_eq!(
                p(&format!("{e}.w1.weight")),
                [ep.clone(), tp.clone(), vec![]]
            );
            assert_eq!(
                p(&format!("{e}.w3.weight")),
                [ep.clone(), tp.clone(), vec![]]
            );
            assert_eq!(p(&format!("{e}.w2.weight")), [ep, vec![], tp]);
            continue;
        }
        // Expert weights are split over tp (w1/w3 by their ffn rows, w2 by its ffn columns),
        // the router replicated; expert weight gradients need no tp reduction.
        let layout = |name: &str| {
            let p = g.params().find(|(_, n, _)| *n == name).unwrap().0;
            g.ty(p).layout.shards.clone()
        };
        let e = "model.layers.0.block_sparse_moe";
        assert_eq!(
            layout(&format!("{e}.experts.0.w1.weight")),
            [vec![Axis::Tp], vec![]]
        );
        assert_eq!(
            layout(&format!("{e}.experts.3.w3.weight")),
            [vec![Axis::Tp], vec![]]
        );
        assert_eq!(
            layout(&format!("{e}.experts.1.w2.weight")),
            [vec![], vec![Axis::Tp]]
        );
        assert_eq!(layout(&format!("{e}.gate.weight")), [vec![], vec![]]);
    }
}
