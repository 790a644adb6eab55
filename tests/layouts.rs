//! Layout equivalence: every parallel layout trains exactly like one device. Each layout
//! runs 3 AdamW steps from the same seed and data and must match the single-device run's
//! losses (relative 1e-5) and final global parameters (relative 1e-4 per tensor).
//!
//! Mixed precision (`bf16_layout_families`, `fp16_layout_families`): every layout family
//! against the single-device run of the same precision, within tolerances derived from the
//! format's unit roundoff u (bf16 2^-8, fp16 2^-11; docs/precision.md): losses u/8,
//! gradient norms u, final working weights u per tensor (relative 2-norm).

use std::path::Path;

use megac_runtime::train::{train, RunOptions};

fn plan(file: &str, sets: &[String]) -> megac_ir::gate::CheckedPlan {
    // A bare name is an example; a path (the golden fixtures' models) is from the root.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = if file.contains('/') {
        root.join(file)
    } else {
        root.join("examples").join(file)
    };
    // `NO_SP` (test only) turns sequence parallelism off after the frontend's checks, which
    // refuse tensor-parallel MoE without it (as Megatron does) although the compiler runs it.
    let no_sp = sets.iter().any(|s| s == NO_SP);
    let sets: Vec<String> = sets.iter().filter(|s| *s != NO_SP).cloned().collect();
    let mut spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    if no_sp {
        spec.parallel.sequence_parallel = false;
    }
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    // Every compiled layout passes the plan gate (and its deadlock and schedule check).
    megac_ir::gate::CheckedPlan::check(plan).unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

/// A layout key for tests only: tensor parallelism without sequence parallelism for MoE.
const NO_SP: &str = "!parallel.sequence_parallel=false";

/// (loss, grad norm) per step and final parameters (name, values) of 3 steps.
/// What a run leaves to compare: (loss, grad norm) per step, and (name, values) per parameter.
type Outcome = (Vec<(f64, f64)>, Vec<(String, Vec<f32>)>);

/// 3 steps, from the seed's initialisation or (`init`) a Hugging Face checkpoint.
fn run_from(file: &str, sets: &[String], init: Option<&Path>) -> Outcome {
    let plan = plan(file, sets);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("final.safetensors");
    let opts = RunOptions {
        steps: Some(3),
        data: "synthetic".into(),
        save_params: Some(out.clone()),
        init: init.map(Path::to_path_buf),
        progress: Some(false),
        ..Default::default()
    };
    let report = train(&plan, &opts).unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    // Hugging Face's tensors (stacked experts are saved one tensor per expert), sorted by
    // name so that layouts with and without stacked experts compare tensor by tensor.
    let mut expected: Vec<(String, Vec<usize>)> = plan
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| (name, shape.iter().map(|&d| d as usize).collect()))
        .collect();
    expected.sort();
    let tied = !plan.params.iter().any(|p| p.name == "lm_head.weight");
    let values = megac_runtime::hf::load_params(&out, &expected, tied).unwrap();
    let params = expected.into_iter().map(|(n, _)| n).zip(values).collect();
    (
        report.steps.iter().map(|s| (s.loss, s.grad_norm)).collect(),
        params,
    )
}

/// Relative tolerances of a comparison with the single-device run.
#[derive(Clone, Copy)]
struct Tolerance {
    loss: f64,
    grad_norm: f64,
    params: f64,
    /// A floor under each element's scale in the parameters' relative error: parameters
    /// that start at zero (biases) are only as large as the optimizer's steps.
    param_floor: f64,
}

/// fp32: the same arithmetic up to summation order.
const EXACT: Tolerance = Tolerance {
    loss: 1e-5,
    grad_norm: 1e-5,
    params: 1e-4,
    param_floor: 0.0,
};

fn assert_equivalent(file: &str, base: &[&str], layouts: &[&[&str]]) {
    assert_within(file, base, layouts, EXACT);
}

fn assert_within(file: &str, base: &[&str], layouts: &[&[&str]], tol: Tolerance) {
    assert_within_from(file, None, base, layouts, tol);
}

/// [`assert_within`], every run starting from the Hugging Face checkpoint `init` (or the
/// seed's initialisation).
fn assert_within_from(
    file: &str,
    init: Option<&Path>,
    base: &[&str],
    layouts: &[&[&str]],
    tol: Tolerance,
) {
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let (ref_losses, ref_params) = run_from(file, &with(&[]), init);
    for layout in layouts {
        let (losses, params) = run_from(file, &with(layout), init);
        for (step, ((a, na), (b, nb))) in losses.iter().zip(&ref_losses).enumerate() {
            let rel = (a - b).abs() / b.abs();
            if std::env::var_os("MEGAC_PRINT_ERRORS").is_some() {
                let nrel = (na - nb).abs() / nb.abs();
                eprintln!(
                    "{file} {layout:?} step {}: loss rel {rel:.2e} norm rel {nrel:.2e}",
                    step + 1
                );
            }
            assert!(
                rel < tol.loss,
                "{file} {layout:?} step {}: loss {a} vs single device {b} (rel {rel:.2e})",
                step + 1
            );
            let rel = (na - nb).abs() / nb.abs();
            assert!(
                rel < tol.grad_norm,
                "{file} {layout:?} step {}: grad norm {na} vs single device {nb} (rel {rel:.2e})",
                step + 1
            );
        }
        assert_eq!(
            params.len(),
            ref_params.len(),
            "{file} {layout:?}: tensor count"
        );
        for ((name, got), (ref_name, want)) in params.iter().zip(&ref_params) {
            assert_eq!(name, ref_name, "{file} {layout:?}: tensors differ");
            // GPT-2's key bias gets an exactly-zero gradient in real arithmetic (softmax
            // ignores it): only rounding noise reaches it, which AdamW normalises into steps
            // of up to lr, differently for every summation order. Skip those elements.
            let h = got.len() / 3;
            let noise_only =
                |i: usize| name.ends_with("attn.c_attn.bias") && (h..2 * h).contains(&i);
            let (mut d2, mut n2) = (0f64, 0f64);
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                if noise_only(i) {
                    continue;
                }
                d2 += f64::from(a - b).powi(2);
                n2 += f64::from(*b).powi(2).max(tol.param_floor.powi(2));
            }
            let rel = (d2 / n2.max(1e-30)).sqrt();
            if std::env::var_os("MEGAC_PRINT_ERRORS").is_some() {
                eprintln!("{file} {layout:?}: {name} rel {rel:.2e}");
            }
            assert!(
                rel < tol.params,
                "{file} {layout:?}: {name} differs from single device by {rel:.2e}"
            );
        }
    }
}

const BASE: &[&str] = &["train.micro_batch=2", "train.global_batch=8"];

#[test]
fn data_parallel_llama() {
    assert_equivalent(
        "llama-tiny.toml",
        BASE,
        &[
            &["parallel.dp=2"],
            &["parallel.dp=4"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
            &["parallel.dp=4", "parallel.distributed_optimizer=true"],
        ],
    );
}

#[test]
fn data_parallel_gpt() {
    assert_equivalent(
        "gpt-tiny.toml",
        BASE,
        &[
            &["parallel.dp=2"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ],
    );
}

#[test]
fn tensor_parallel_llama() {
    assert_equivalent(
        "llama-tiny.toml",
        BASE,
        &[
            &["parallel.tp=2"],
            &["parallel.tp=2", "parallel.dp=2"],
            // tp4 > 2 kv heads: k/v heads repeated and sliced per rank.
            &["parallel.tp=4"],
            &["parallel.tp=4", "parallel.sequence_parallel=true"],
            // A rank order with dp innermost: other groups, same training.
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.order=\"dp-tp-cp-ep-pp\"",
            ],
        ],
    );
}

#[test]
fn tensor_parallel_gpt() {
    assert_equivalent(
        "gpt-tiny.toml",
        BASE,
        &[
            &["parallel.tp=2"],
            &["parallel.tp=4"],
            &["parallel.tp=2", "parallel.dp=2"],
        ],
    );
    // An untied head is vocab-parallel too (each rank holds vocab/tp rows).
    let untied = [
        "train.micro_batch=2",
        "train.global_batch=8",
        "model.tie_embeddings=false",
    ];
    assert_equivalent(
        "gpt-tiny.toml",
        &untied,
        &[&["parallel.tp=2"], &["parallel.tp=2", "parallel.pp=2"]],
    );
    let sets: Vec<String> = untied
        .iter()
        .chain(&["parallel.tp=2"])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("gpt-tiny.toml", &sets);
    let head = plan
        .params
        .iter()
        .find(|p| p.name == "lm_head.weight")
        .unwrap();
    assert_eq!(head.shards.first(), Some(&vec![megac_ir::Axis::Tp]));
}

#[test]
fn sequence_parallel() {
    assert_equivalent(
        "llama-tiny.toml",
        BASE,
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
            ],
        ],
    );
    assert_equivalent(
        "gpt-tiny.toml",
        BASE,
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.tp=4", "parallel.sequence_parallel=true"],
        ],
    );
}

#[test]
fn data_parallel_moe() {
    assert_equivalent(
        "moe-tiny.toml",
        BASE,
        &[
            &["parallel.dp=2"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ],
    );
}

#[test]
fn context_parallel() {
    assert_equivalent(
        "llama-tiny.toml",
        BASE,
        &[
            &["parallel.cp=2"],
            &["parallel.cp=2", "parallel.tp=2"],
            &["parallel.cp=2", "parallel.dp=2"],
            // The distributed optimizer shards over dp·cp (Megatron), with dp = 1 too.
            &["parallel.cp=2", "parallel.distributed_optimizer=true"],
            &[
                "parallel.cp=2",
                "parallel.dp=2",
                "parallel.tp=2",
                "parallel.distributed_optimizer=true",
            ],
        ],
    );
    assert_equivalent(
        "gpt-tiny.toml",
        BASE,
        &[&["parallel.cp=2"], &["parallel.cp=4"]],
    );
}

#[test]
fn tensor_parallel_with_the_distributed_optimizer() {
    assert_equivalent(
        "llama-tiny.toml",
        BASE,
        &[
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
            ],
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=true",
            ],
            &[
                "parallel.cp=2",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
            ],
        ],
    );
}

/// A vocabulary that tp does not divide is padded (to a multiple of 128·tp, as Megatron
/// does); the padding changes neither the loss nor the saved Hugging Face tensors.
#[test]
fn vocabulary_padding() {
    assert_equivalent(
        "llama-tiny.toml",
        &[
            "train.micro_batch=2",
            "train.global_batch=8",
            "model.vocab=250",
        ],
        &[
            &["parallel.tp=2"],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
        ],
    );
}

/// MoE under tensor parallelism: attention is tensor-parallel, and so are the experts
/// (Megatron's expert tensor parallelism = tp: w1/w3 column-parallel, w2 row-parallel, the
/// combined output reduced once); the router runs replicated on whole activations.
#[test]
fn tensor_parallel_moe() {
    let tp_sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    assert_equivalent(
        "moe-tiny.toml",
        BASE,
        &[
            &tp_sp,
            &["parallel.tp=2", "parallel.sequence_parallel=true", NO_SP],
            &["parallel.tp=4", "parallel.sequence_parallel=true"],
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
            ],
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=true",
            ],
        ],
    );
    // Token dropping: the tp ranks of a group route the same tokens, so they drop alike.
    assert_equivalent(
        "moe-tiny.toml",
        &[
            "train.micro_batch=2",
            "train.global_batch=8",
            "model.moe.capacity_factor=1.0",
        ],
        &[&tp_sp],
    );
    // The compiled plan: each rank holds its tp slice of every expert weight (half the
    // elements at tp = 2), recorded in its parameter entry so that init, --init and
    // --save-params see the global tensors; the router stays replicated.
    let sets: Vec<String> = BASE.iter().chain(&tp_sp).map(|s| s.to_string()).collect();
    let plan = plan("moe-tiny.toml", &sets);
    let entry = |name: &str| {
        plan.params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no parameter {name}"))
    };
    let tp = megac_ir::Axis::Tp;
    let e = "model.layers.1.block_sparse_moe";
    for (w, dim) in [("w1", 0), ("w3", 0), ("w2", 1)] {
        let p = entry(&format!("{e}.experts.2.{w}.weight"));
        assert_eq!(p.shards.len(), 2, "{w}: {:?}", p.shards);
        assert_eq!(p.shards[dim], vec![tp], "{w}");
        assert!(p.shards[1 - dim].is_empty(), "{w}");
        let global: u64 = p.shape.iter().product();
        let local = plan.buffers[p.buffer as usize].len();
        assert_eq!(
            local * 2,
            global,
            "{w}: the rank's buffer is half the tensor"
        );
        assert_eq!(
            plan.buffers[p.grad.expect("a training plan's gradient") as usize].len(),
            local,
            "{w} gradient"
        );
    }
    let gate = entry(&format!("{e}.gate.weight"));
    assert!(gate.shards.iter().all(Vec::is_empty));
}

/// The golden fixture `name` (tests/golden/NAME: its model.toml, from its transformers
/// checkpoint, whose biases and scaled-RoPE weights are drawn so that they matter) in every
/// layout family against its single-device run.
fn golden_layouts(name: &str, layouts: &[&[&str]]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let init = root.join(format!("tests/golden/{name}/init.safetensors"));
    // The fixtures' weights are drawn large (so that their features move the loss); at
    // their lr of 1e-2, AdamW turns the rounding noise of near-zero gradient elements into
    // steps of up to lr, 1e-4 of a tensor. A tenth of it keeps layouts comparable at 1e-4.
    let base = [
        "train.micro_batch=2",
        "train.global_batch=8",
        "train.lr=0.001",
    ];
    assert_within_from(
        &format!("tests/golden/{name}/model.toml"),
        Some(&init),
        &base,
        layouts,
        EXACT,
    );
}

/// Qwen2 (q/k/v biases, linear rope scaling): the biases are column-parallel with their
/// heads (replicated k/v biases when tp exceeds the kv heads), and every layout family
/// trains like one device.
#[test]
fn qwen2_layout_families() {
    golden_layouts(
        "qwen2",
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            // tp 4 > 2 kv heads: k/v (and their biases) whole, heads repeated.
            &["parallel.tp=4"],
            &["parallel.tp=4", "parallel.sequence_parallel=true"],
            &["parallel.cp=2"],
            &["parallel.pp=2"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ],
    );
    let sets: Vec<String> = BASE
        .iter()
        .chain(&["parallel.tp=2"])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("tests/golden/qwen2/model.toml", &sets);
    let entry = |name: &str| plan.params.iter().find(|p| p.name == name).unwrap();
    for b in ["q_proj", "k_proj", "v_proj"] {
        let p = entry(&format!("model.layers.0.self_attn.{b}.bias"));
        assert_eq!(p.shards, vec![vec![megac_ir::Axis::Tp]], "{b}.bias");
    }
}

/// Llama 3.1's rope scaling: positions under context parallelism (load-balanced chunks) get
/// the scaled frequencies too.
#[test]
fn llama31_rope_scaling_layout_families() {
    golden_layouts(
        "llama31",
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.cp=2"],
            &["parallel.cp=2", "parallel.cp_comm=\"all-gather\""],
            &["parallel.pp=2"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ],
    );
}

/// Qwen3 (qk-norm, head_dim ≠ hidden / heads): the norms run on each rank's heads with the
/// replicated weight, whose gradient is a partial sum reduced over tp.
#[test]
fn qwen3_layout_families() {
    golden_layouts(
        "qwen3",
        &[
            &["parallel.tp=2"],
            // tp 4 > 2 kv heads: k whole, normalised whole on every rank.
            &["parallel.tp=4"],
            &["parallel.tp=4", "parallel.sequence_parallel=true"],
            &["parallel.cp=2"],
            &["parallel.pp=2"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
        ],
    );
}

/// Mistral's sliding window (5 of 32 tokens) under context parallelism: each rank's queries
/// are masked by global position and window against every key block, ring or all-gathered
/// (cp 4: chunks of 4 tokens, shorter than the window, so a query sees keys of up to three
/// chunks).
#[test]
fn mistral_sliding_window_layout_families() {
    golden_layouts(
        "mistral",
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.cp=2"],
            &["parallel.cp=4"],
            &["parallel.cp=2", "parallel.cp_comm=\"all-gather\""],
            &["parallel.cp=2", "parallel.tp=2"],
            &["parallel.pp=2"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ],
    );
}

/// Qwen2-MoE (dense first layer, unnormalised top-2, sigmoid-gated shared expert, q/k/v
/// biases): the shared expert splits over tp as the dense MLP, its gate replicated; experts
/// over ep folded over dp; every layout family trains like one device.
#[test]
fn qwen2_moe_layout_families() {
    golden_layouts(
        "qwen2_moe",
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.dp=2", "parallel.ep=2"],
            &["parallel.cp=2"],
            // Experts over the cp group (ep folds over dp·cp).
            &["parallel.cp=2", "parallel.ep=2"],
            &["parallel.pp=3"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
            &[
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.distributed_optimizer=true",
            ],
            // Recomputation clones the MoE layer, shared expert and gate included.
            &["train.recompute=\"full\""],
            &[
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "train.recompute=\"full\"",
            ],
        ],
    );
    let sets: Vec<String> = BASE
        .iter()
        .chain(&["parallel.tp=2", "parallel.sequence_parallel=true"])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("tests/golden/qwen2_moe/model.toml", &sets);
    let entry = |name: &str| {
        plan.params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no parameter {name}"))
    };
    let tp = vec![megac_ir::Axis::Tp];
    let mp = "model.layers.1.mlp";
    // The shared expert is column/row parallel as a dense MLP; so are the routed experts.
    for (w, dim) in [("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)] {
        for p in [
            entry(&format!("{mp}.shared_expert.{w}.weight")),
            entry(&format!("{mp}.experts.1.{w}.weight")),
            entry(&format!("model.layers.0.mlp.{w}.weight")),
        ] {
            assert_eq!(p.shards[dim], tp, "{}", p.name);
            assert!(p.shards[1 - dim].is_empty(), "{}", p.name);
        }
    }
    // The router and the shared expert's gate are replicated.
    for name in ["gate.weight", "shared_expert_gate.weight"] {
        let p = entry(&format!("{mp}.{name}"));
        assert!(p.shards.iter().all(Vec::is_empty), "{name}: {:?}", p.shards);
    }
    // The gate scales each token's row on sequence shards: the shared expert's partial
    // output is reduce-scattered once (as a dense MLP's under sequence parallelism), the
    // gate logits (one per token) sliced, their gradient gathered once for the replicated
    // [1, h] weight; nothing is all-reduced.
    use megac_ir::plan::Instr;
    use megac_ir::OpKind;
    let gate_path = format!("{mp}.shared_expert_gate");
    let mut count = std::collections::BTreeMap::<&str, usize>::new();
    for i in &plan.roles[0].microbatch {
        if let Instr::Kernel { op, path, .. } = i {
            if *path == gate_path {
                *count.entry(op.name()).or_default() += 1;
            }
        }
    }
    assert_eq!(count.get("all_reduce"), None, "{count:?}");
    assert_eq!(count.get("reduce_scatter"), Some(&1), "{count:?}");
    assert_eq!(count.get("slice"), Some(&1), "{count:?}");
    assert_eq!(count.get("all_gather"), Some(&1), "{count:?}");
    assert!(plan.roles[0].microbatch.iter().any(|i| matches!(
        i,
        Instr::Kernel {
            op: OpKind::SigmoidMulGrad,
            ..
        }
    )));
}

/// Pipelines: 8 layers so that pp·vpp up to 8 chunks each get one; 4 micro-batches per step.
const PIPE: &[&str] = &[
    "train.micro_batch=2",
    "train.global_batch=8",
    "model.layers=8",
];

#[test]
fn pipeline_parallel_schedules() {
    assert_equivalent(
        "llama-tiny.toml",
        PIPE,
        &[
            &["parallel.pp=2"],
            &["parallel.pp=4"],
            // Uneven stages, as a user balances the embedding and head by hand.
            &["parallel.pp=4", "parallel.stage_layers=[1, 3, 3, 1]"],
            &["parallel.pp=2", "parallel.schedule=gpipe"],
            &["parallel.pp=4", "parallel.schedule=zb-h1"],
            // Sequence parallelism's re-gathered linear inputs are gathered within W.
            &[
                "parallel.pp=2",
                "parallel.schedule=zb-h1",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            &[
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.schedule=interleaved",
            ],
            &[
                "parallel.pp=4",
                "parallel.vpp=2",
                "parallel.schedule=interleaved",
            ],
            // One layer per chunk: each stage's layer chunks share one pool of slots.
            &[
                "parallel.pp=2",
                "parallel.vpp=4",
                "parallel.schedule=interleaved",
            ],
        ],
    );
}

#[test]
fn pipeline_stages_balanced_by_cost() {
    // 6 layers do not split evenly over 4 chunks: the cost-balanced split does it.
    let base = &[
        "train.micro_batch=2",
        "train.global_batch=8",
        "model.layers=6",
    ];
    let balanced = ["parallel.pp=4", "parallel.stage_layers=\"balanced\""];
    assert_equivalent("llama-tiny.toml", base, &[&balanced]);
    let sets: Vec<String> = base
        .iter()
        .chain(&balanced)
        .map(|s| s.to_string())
        .collect();
    let plan = plan("llama-tiny.toml", &sets);
    // The chunks hold contiguous, non-empty runs of all 6 layers; the last (with the head)
    // no more than the first.
    let layers: Vec<[u64; 2]> = plan
        .roles
        .iter()
        .map(|r| r.pipeline.as_ref().unwrap().chunks[0].layers.unwrap())
        .collect();
    assert_eq!(layers[0][0], 0);
    assert_eq!(layers[3][1], 6);
    for w in layers.windows(2) {
        assert_eq!(w[0][1], w[1][0], "{layers:?}");
    }
    assert!(layers.iter().all(|[a, b]| b > a), "{layers:?}");
    assert!(
        layers[3][1] - layers[3][0] <= layers[0][1] - layers[0][0],
        "{layers:?}"
    );
}

#[test]
fn pipeline_dynamic_dpp_policies() {
    let dpp = |policy: &'static str| -> [&'static str; 4] {
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            policy,
        ]
    };
    assert_equivalent(
        "llama-tiny.toml",
        PIPE,
        &[
            &dpp("parallel.dpp_policy=bfs"),
            &dpp("parallel.dpp_policy=dfs"),
            &dpp("parallel.dpp_policy=adaptive"),
            &dpp("parallel.dpp_policy=ordered"),
        ],
    );
    // Tensor- and context-parallel peers agree on every dynamic choice.
    assert_equivalent(
        "llama-tiny.toml",
        PIPE,
        &[&[
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            "parallel.tp=2",
            "parallel.cp=2",
        ]],
    );
}

#[test]
fn pipeline_with_tensor_sequence_and_data_parallelism() {
    assert_equivalent(
        "llama-tiny.toml",
        PIPE,
        &[
            &[
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
            ],
            // ZeRO-1 per stage, the norm summed over dp, tp and pp.
            &[
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=true",
            ],
        ],
    );
}

#[test]
fn pipeline_with_tied_embeddings_and_moe() {
    // GPT-2 ties the head to the word embeddings: the last stage holds a copy, its gradient
    // contribution flows back to the first stage, the update flows forward after each step.
    let base = &[
        "train.micro_batch=2",
        "train.global_batch=8",
        "model.layers=4",
    ];
    assert_equivalent(
        "gpt-tiny.toml",
        base,
        &[
            &["parallel.pp=2"],
            &["parallel.pp=4", "parallel.schedule=zb-h1"],
            &[
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
            ],
        ],
    );
    // The head's gradient contribution crosses once per step (Megatron's embedding-group
    // reduction), not once per micro-batch.
    let sets: Vec<String> = base
        .iter()
        .chain(&["parallel.pp=2"])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("gpt-tiny.toml", &sets);
    let wte = plan
        .params
        .iter()
        .find(|p| p.name == "transformer.wte.weight")
        .unwrap();
    let table = wte.shape.iter().product::<u64>();
    let sends_of_table = |instrs: &[megac_ir::plan::Instr]| {
        instrs
            .iter()
            .filter(|i| {
                matches!(i, megac_ir::plan::Instr::Send { buffer, .. }
                    if plan.buffers[*buffer as usize].len() == table)
            })
            .count()
    };
    let last = &plan.roles[1];
    let per_microbatch: usize = last
        .pipeline
        .as_ref()
        .unwrap()
        .chunks
        .iter()
        .map(|c| sends_of_table(&c.forward) + sends_of_table(&c.backward))
        .sum();
    assert_eq!(
        per_microbatch, 0,
        "the tied gradient is not sent per micro-batch"
    );
    assert_eq!(
        sends_of_table(&last.optimizer),
        1,
        "it is sent once per step"
    );
    // MoE: every layer's auxiliary loss reaches the loss on the last stage.
    assert_equivalent(
        "moe-tiny.toml",
        &["train.micro_batch=2", "train.global_batch=8"],
        &[
            &["parallel.pp=2"],
            &["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
            // Expert tensor parallelism on pipeline stages.
            &[
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
        ],
    );
}

#[test]
fn forward_backward_decoupling() {
    // MegaFBD: a forward role per stage on its own ranks; the backward roles recompute from
    // the stage inputs their twins send, and send the updated parameters back.
    assert_equivalent(
        "llama-tiny.toml",
        PIPE,
        &[
            &["parallel.pp=2", "parallel.fbd=true"],
            &[
                "parallel.pp=4",
                "parallel.fbd=true",
                "parallel.schedule=zb-h1",
            ],
        ],
    );
    assert_equivalent(
        "gpt-tiny.toml",
        &[
            "train.micro_batch=2",
            "train.global_batch=8",
            "model.layers=4",
        ],
        &[&["parallel.pp=2", "parallel.fbd=true"]],
    );
    // The forward roles keep no gradients, optimizer state or activations beyond one
    // micro-batch.
    let sets: Vec<String> = PIPE
        .iter()
        .chain(&["parallel.pp=2", "parallel.fbd=true"])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("llama-tiny.toml", &sets);
    assert_eq!(plan.rank_to_role.len(), 4);
    let forward: Vec<_> = plan
        .roles
        .iter()
        .filter(|r| r.name.ends_with(".forward"))
        .collect();
    assert_eq!(forward.len(), 2);
    for r in forward {
        let mem = r.memory.as_ref().unwrap();
        assert_eq!((mem.grad_bytes, mem.opt_state_bytes), (0, 0), "{}", r.name);
        let pipe = r.pipeline.as_ref().unwrap();
        assert!(pipe
            .chunks
            .iter()
            .all(|c| c.slots == 1 && c.backward.is_empty()));
    }
}

/// Expert parallelism (experts split over ep, folded over dp·cp; all-to-all dispatch and
/// combine), alone and with tensor and sequence parallelism.
#[test]
fn expert_parallel_moe() {
    assert_equivalent(
        "moe-tiny.toml",
        BASE,
        &[
            &["parallel.dp=2", "parallel.ep=2"],
            &["parallel.dp=4", "parallel.ep=4"],
            &["parallel.dp=4", "parallel.ep=2"],
        ],
    );
    // Token dropping: each micro-batch keeps the same tokens as on one device.
    assert_equivalent(
        "moe-tiny.toml",
        &[
            "train.micro_batch=2",
            "train.global_batch=8",
            "model.moe.capacity_factor=1.0",
        ],
        &[&["parallel.dp=2", "parallel.ep=2"]],
    );
}

/// `--init` under expert tensor parallelism: each rank loads its tp (and ep) slice of the
/// global per-expert tensors of a checkpoint (here the single-device run's parameters after
/// 3 steps), and `--save-params` writes global tensors again, so every layout continues
/// from the checkpoint exactly like one device.
#[test]
fn expert_tensor_parallel_init_from_a_checkpoint() {
    let file = "moe-tiny.toml";
    let sets = |extra: &[&str]| -> Vec<String> {
        BASE.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt.safetensors");
    let opts = RunOptions {
        steps: Some(1),
        data: "synthetic".into(),
        save_params: Some(ckpt.clone()),
        progress: Some(false),
        ..Default::default()
    };
    train(&plan(file, &sets(&[])), &opts).unwrap();
    let (ref_losses, ref_params) = run_from(file, &sets(&[]), Some(&ckpt));
    for layout in [
        &["parallel.tp=2", "parallel.sequence_parallel=true"][..],
        &[
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
    ] {
        let (losses, params) = run_from(file, &sets(layout), Some(&ckpt));
        for ((a, _), (b, _)) in losses.iter().zip(&ref_losses) {
            assert!(
                (a - b).abs() / b.abs() < 1e-5,
                "{layout:?}: loss {a} vs {b}"
            );
        }
        assert_eq!(params.len(), ref_params.len());
        for ((name, got), (ref_name, want)) in params.iter().zip(&ref_params) {
            assert_eq!(name, ref_name);
            let d2: f64 = got
                .iter()
                .zip(want)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let n2: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
            let rel = (d2 / n2.max(1e-30)).sqrt();
            assert!(rel < 1e-4, "{layout:?}: {name} differs by {rel:.2e}");
        }
    }
}

/// Expert parallelism with expert tensor parallelism (stacked experts split over ep along
/// the experts dim and over tp along the ffn dim) and sequence parallelism.
#[test]
fn expert_and_tensor_parallel_moe() {
    assert_equivalent(
        "moe-tiny.toml",
        BASE,
        &[
            &[
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            &[
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                NO_SP,
            ],
        ],
    );
    let sets: Vec<String> = BASE
        .iter()
        .chain(&[
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("moe-tiny.toml", &sets);
    let (ep, tp) = (megac_ir::Axis::Ep, megac_ir::Axis::Tp);
    for (w, dim) in [("w1", 1), ("w3", 1), ("w2", 2)] {
        let name = format!("model.layers.0.block_sparse_moe.experts.{w}.weight");
        let p = plan.params.iter().find(|p| p.name == name).unwrap();
        assert_eq!(p.shards[0], vec![ep], "{w}");
        assert_eq!(p.shards[dim], vec![tp], "{w}");
        let global: u64 = p.shape.iter().product();
        let local = plan.buffers[p.buffer as usize].len();
        assert_eq!(local * 4, global, "{w}: a quarter per rank (ep 2 × tp 2)");
    }
}

/// Context parallelism with MoE: routing on each rank's sequence chunks, the load-balancing
/// statistics summed over cp; with ep = 2 the experts split over the cp ranks.
#[test]
fn context_parallel_moe() {
    assert_equivalent(
        "moe-tiny.toml",
        BASE,
        &[
            &["parallel.cp=2"],
            &["parallel.cp=2", "parallel.ep=2"],
            &["parallel.cp=2", "parallel.dp=2", "parallel.ep=4"],
        ],
    );
}

/// The distributed optimizer with expert parallelism (Megatron's): non-expert parameters are
/// sharded over dp, expert parameters over the expert-data-parallel group edp (dp·cp / ep),
/// each in its own flat segments; the global grad norm counts every element once.
#[test]
fn expert_parallel_moe_with_the_distributed_optimizer() {
    let zero1 = "parallel.distributed_optimizer=true";
    assert_equivalent(
        "moe-tiny.toml",
        BASE,
        &[
            &["parallel.dp=2", "parallel.ep=2", zero1],
            // edp = 2: expert state sharded over 2 ranks, the rest over 4.
            &["parallel.dp=4", "parallel.ep=2", zero1],
            // edp = 1: expert state unsharded.
            &["parallel.dp=4", "parallel.ep=4", zero1],
            &[
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                zero1,
            ],
            &["parallel.cp=2", "parallel.dp=2", "parallel.ep=2", zero1],
            &["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", zero1],
        ],
    );
}

/// Under the distributed optimizer a rank's expert AdamW state is 1/edp of its expert
/// parameters (two fp32 moments each) and its other state 1/dp of the others.
#[test]
fn expert_optimizer_state_is_sharded_over_edp() {
    for (dp, ep) in [(2u64, 2u64), (4, 2), (4, 4)] {
        let sets: Vec<String> = BASE
            .iter()
            .map(|s| s.to_string())
            .chain([
                format!("parallel.dp={dp}"),
                format!("parallel.ep={ep}"),
                "parallel.distributed_optimizer=true".into(),
            ])
            .collect();
        let plan = plan("moe-tiny.toml", &sets);
        let edp = dp / ep;
        let (mut expert, mut dense) = (0u64, 0u64);
        for p in &plan.params {
            let local = plan.buffers[p.buffer as usize].len();
            if p.shards.iter().any(|a| a.contains(&megac_ir::Axis::Ep)) {
                expert += local;
            } else {
                dense += local;
            }
            assert!(p.exp_avg.is_none() && p.exp_avg_sq.is_none(), "{}", p.name);
        }
        let state: u64 = plan
            .buffers
            .iter()
            .filter(|b| b.class == megac_ir::plan::BufferClass::OptState)
            .map(|b| b.len())
            .sum();
        assert_eq!(
            state,
            2 * (expert / edp + dense.div_ceil(dp)),
            "dp{dp} ep{ep}: expert {expert}, dense {dense}"
        );
        assert_eq!(plan.memory.opt_state_bytes, state * 4, "dp{dp} ep{ep}");
    }
}

/// The tolerances of a 16-bit format with unit roundoff `u` (docs/precision.md); the
/// examples' lr is 1e-3, so 3 steps move a parameter by about 3e-3.
fn mixed(u: f64) -> Tolerance {
    Tolerance {
        loss: u / 8.0,
        grad_norm: u,
        params: u,
        param_floor: 3e-3,
    }
}

/// Every layout family in one precision: tp+sp, cp, dp, the distributed optimizer, ep, pp
/// with each schedule, interleaving and MegaDPP, MegaFBD.
fn mixed_families(precision: &[&str], u: f64) {
    let tol = mixed(u);
    fn with<'a>(base: &[&'a str], precision: &[&'a str]) -> Vec<&'a str> {
        base.iter().chain(precision).copied().collect()
    }
    assert_within(
        "llama-tiny.toml",
        &with(BASE, precision),
        &[
            &["parallel.tp=2"],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.cp=2"],
            &["parallel.dp=2"],
            &[
                "parallel.dp=2",
                "parallel.tp=2",
                "parallel.distributed_optimizer=true",
            ],
        ],
        tol,
    );
    assert_within(
        "llama-tiny.toml",
        &with(PIPE, precision),
        &[
            &["parallel.pp=2"],
            &["parallel.pp=2", "parallel.schedule=gpipe"],
            &["parallel.pp=4", "parallel.schedule=zb-h1"],
            &[
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.schedule=interleaved",
            ],
            &["parallel.pp=2", "parallel.schedule=dpp"],
            &["parallel.pp=2", "parallel.fbd=true"],
        ],
        tol,
    );
    assert_within(
        "moe-tiny.toml",
        &with(BASE, precision),
        &[
            &["parallel.dp=2", "parallel.ep=2"],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
        ],
        tol,
    );
    assert_within(
        "gpt-tiny.toml",
        &with(BASE, precision),
        &[&["parallel.tp=2"]],
        tol,
    );
}

#[test]
fn bf16_layout_families() {
    mixed_families(
        &["train.precision=\"bf16\"", "train.eps=1e-2"],
        2f64.powi(-8),
    );
}

/// fp16 with a static loss scale, so that no step is skipped and the layouts compare step
/// by step (the dynamic scaler is tested in tests/mixed_precision.rs).
#[test]
fn fp16_layout_families() {
    mixed_families(
        &[
            "train.precision=\"fp16\"",
            "train.loss_scale=1024",
            "train.eps=1e-2",
        ],
        2f64.powi(-11),
    );
}

/// Under zb-h1 with sequence parallelism, a re-gathered linear input that only the weight
/// gradient reads is gathered within `W`, so it is not kept from `B` to `W`.
#[test]
fn zero_bubble_gathers_weight_gradient_inputs_within_w() {
    use megac_ir::plan::Instr;
    use megac_ir::OpKind;
    let sets: Vec<String> = PIPE
        .iter()
        .chain(&[
            "parallel.pp=2",
            "parallel.schedule=zb-h1",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ])
        .map(|s| s.to_string())
        .collect();
    let plan = plan("llama-tiny.toml", &sets);
    let regather = |i: &Instr| matches!(i, Instr::Kernel { op: OpKind::AllGather { .. }, path, .. } if path.ends_with("(regather)"));
    let reads = |prog: &[Instr], b: u32| {
        prog.iter()
            .any(|i| matches!(i, Instr::Kernel { inputs, .. } if inputs.contains(&b)))
    };
    let mut in_w = 0;
    for role in &plan.roles {
        for c in &role.pipeline.as_ref().unwrap().chunks {
            in_w += c.weight.iter().filter(|i| regather(i)).count();
            for i in c.backward.iter().filter(|i| regather(i)) {
                let Instr::Kernel { outputs, path, .. } = i else {
                    unreachable!()
                };
                assert!(
                    reads(&c.backward, outputs[0]),
                    "{path}: gathered in B for W alone"
                );
            }
        }
    }
    assert!(in_w >= 8, "{in_w} re-gathers in W");
}
