//! The layout search and model.toml's rules agree (`megac_ir::rules::check` is their one
//! home). Over several models and GPU counts:
//! - every layout `megac_sim::search::enumerate` proposes passes `check`, and the model.toml
//!   `megac plan --emit` writes for it loads through the frontend;
//! - on small models, a brute force over every factorisation and choice finds exactly the
//!   enumerated layouts among those `check` accepts (up to the choices that cannot change a
//!   run, which the search leaves out).

use std::collections::BTreeSet;
use std::path::Path;

use megac_ir::rules::check;
use megac_ir::spec::{ModelSpec, Recompute, Schedule};
use megac_sim::cluster::Cluster;
use megac_sim::model::ParallelLayout;
use megac_sim::search::{emit_model_toml, enumerate};

fn spec(file: &str, sets: &[&str]) -> ModelSpec {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()))
}

/// `spec` in `layout`, as `megac plan --emit` writes it (even split, no FBD, no
/// `[cluster]` of model.toml's: the search sizes its own).
fn in_layout(spec: &ModelSpec, layout: &ParallelLayout) -> ModelSpec {
    let mut s = layout.apply(spec);
    s.parallel.stage_layers.clear();
    s.parallel.balance_stages = false;
    s.cluster = None;
    s
}

/// Every enumerated layout passes `check`, and its emitted model.toml loads.
fn proposes_only_valid_layouts(spec: &ModelSpec, gpus: u64) -> usize {
    let cluster = Cluster::preset("h100-sxm").unwrap();
    let layouts = enumerate(spec, gpus);
    for (i, layout) in layouts.iter().enumerate() {
        assert_eq!(layout.world(), gpus, "{}", layout.label());
        let violations = check(&in_layout(spec, layout));
        assert!(
            violations.is_empty(),
            "{} on {gpus}: the search proposes {} which breaks {violations:?}",
            spec.name,
            layout.label()
        );
        // The user's path, on a sample: `megac plan --emit` then `megac check`.
        if i % 61 == 0 {
            let text = emit_model_toml(spec, layout, &cluster, &[]);
            if let Err(e) = megac_frontend::parse_str("emitted.toml", &text, &[]) {
                panic!(
                    "{}: emitted model.toml rejected:\n{}",
                    layout.label(),
                    e.render()
                );
            }
        }
    }
    layouts.len()
}

/// Every layout on `gpus` ranks (no pruning) that `check` accepts and that the search
/// counts as distinct (sp only with tp > 1, a schedule only with a pipeline, the
/// distributed optimizer only with dp·cp > 1, the group it shards over).
fn brute_force(spec: &ModelSpec, gpus: u64) -> BTreeSet<String> {
    let m = &spec.model;
    let mut out = BTreeSet::new();
    let mut s = spec.clone();
    s.parallel.stage_layers.clear();
    s.parallel.balance_stages = false;
    s.cluster = None;
    let schedules = [
        Schedule::OneFOneB,
        Schedule::Gpipe,
        Schedule::ZbH1,
        Schedule::Interleaved,
        Schedule::Dpp,
    ];
    for tp in 1..=gpus {
        for cp in 1..=gpus {
            for pp in 1..=gpus {
                if tp * cp * pp > gpus || !gpus.is_multiple_of(tp * cp * pp) {
                    continue;
                }
                let dp = gpus / (tp * cp * pp);
                for vpp in 1..=m.layers {
                    for micro_batch in 1..=spec.train.global_batch {
                        for schedule in schedules {
                            if pp == 1 && schedule != Schedule::OneFOneB {
                                continue;
                            }
                            for sequence_parallel in [false, true] {
                                if sequence_parallel && tp == 1 {
                                    continue;
                                }
                                for ep in 1..=dp * cp {
                                    for recompute in
                                        [Recompute::None, Recompute::Selective, Recompute::Full]
                                    {
                                        for distributed_optimizer in [false, true] {
                                            if distributed_optimizer && dp * cp == 1 {
                                                continue;
                                            }
                                            let l = ParallelLayout {
                                                tp,
                                                pp,
                                                vpp,
                                                dp,
                                                cp,
                                                ep,
                                                micro_batch,
                                                schedule,
                                                recompute,
                                                sequence_parallel,
                                                distributed_optimizer,
                                            };
                                            l.set_in(&mut s);
                                            if check(&s).is_empty() {
                                                out.insert(l.label());
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn the_search_proposes_only_layouts_check_accepts() {
    for (file, sets, gpus) in [
        ("examples/llama3-8b.toml", &[][..], 8),
        ("examples/llama3-8b.toml", &[], 64),
        ("examples/llama3-70b.toml", &[], 64),
        ("examples/llama3-70b.toml", &[], 128),
        ("examples/gpt3-175b.toml", &[], 512),
        ("examples/mixtral-8x7b.toml", &[], 64),
        (
            "examples/mixtral-8x7b.toml",
            &["model.moe.capacity_factor=1.25"],
            32,
        ),
        ("bench/gpt-1t.toml", &[], 1024),
    ] {
        let s = spec(file, sets);
        let n = proposes_only_valid_layouts(&s, gpus);
        assert!(n > 0, "{file} on {gpus}: no layout");
    }
}

#[test]
fn the_search_finds_every_layout_check_accepts() {
    let rich = ["model.layers=8", "train.global_batch=16"];
    for (file, gpus) in [
        ("examples/llama-tiny.toml", 8),
        ("examples/llama-tiny.toml", 6),
        ("examples/gpt-tiny.toml", 4),
        ("examples/gpt-tiny.toml", 12),
        ("examples/moe-tiny.toml", 8),
    ] {
        for sets in [&[][..], &rich, &["model.moe.capacity_factor=1.0"][..]] {
            if sets.first().is_some_and(|s| s.starts_with("model.moe")) && !file.contains("moe") {
                continue;
            }
            let s = spec(file, sets);
            proposes_only_valid_layouts(&s, gpus);
            let found: BTreeSet<String> = enumerate(&s, gpus)
                .iter()
                .map(ParallelLayout::label)
                .collect();
            let all = brute_force(&s, gpus);
            assert_eq!(
                found.len(),
                enumerate(&s, gpus).len(),
                "{file} {sets:?} on {gpus}: the search proposes a layout twice"
            );
            let missed: Vec<&String> = all.difference(&found).collect();
            let extra: Vec<&String> = found.difference(&all).collect();
            assert!(
                missed.is_empty() && extra.is_empty(),
                "{file} {sets:?} on {gpus}: missed {missed:?}, extra {extra:?}"
            );
        }
    }
}

/// `megac plan --emit` keeps Qwen2-MoE's [model.moe] keys (expert and shared-expert sizes,
/// the unnormalised top-k, dense first layers): the emitted model.toml loads to the same
/// model.
#[test]
fn emitted_model_toml_keeps_the_moe_keys() {
    let spec = spec(
        "examples/qwen1.5-moe-a2.7b.toml",
        &["model.moe.first_dense_layers=2"],
    );
    let cluster = Cluster::preset("h100-sxm").unwrap();
    let layout = ParallelLayout::of_spec(&spec);
    let text = emit_model_toml(&spec, &layout, &cluster, &[]);
    let back = megac_frontend::parse_str("emitted.toml", &text, &[])
        .unwrap_or_else(|e| panic!("{}\n{text}", e.render()));
    assert_eq!(back.model, spec.model, "{text}");
    let moe = back.model.moe.unwrap();
    assert_eq!((moe.ffn_hidden, moe.shared_ffn_hidden), (1408, 5632));
    assert!(moe.shared_expert_gate && !moe.norm_topk_prob);
    assert_eq!(moe.first_dense_layers, 2);
}

/// `megac plan --emit` keeps every model and numerics key of the new families where it
/// differs from the family's default: Qwen3's head size and q/k norm, Qwen2's biases,
/// Mistral's sliding window, Llama 3.1's and linear rope scaling, and fp16's loss scaler
/// (dynamic and static). The emitted model.toml loads to the same model and training job.
#[test]
fn emitted_model_toml_keeps_the_family_and_numerics_keys() {
    let cases: &[(&str, &[&str])] = &[
        ("examples/qwen3-8b.toml", &["model.head_dim=64"]),
        ("examples/qwen3-8b.toml", &["model.qk_norm=false"]),
        ("examples/qwen2-7b.toml", &["model.qkv_bias=false"]),
        ("examples/mistral-7b.toml", &[]),
        (
            "examples/llama3-8b.toml",
            &[
                "model.rope_scaling.type=\"llama3\"",
                "model.rope_scaling.factor=8",
                "model.rope_scaling.low_freq_factor=1",
                "model.rope_scaling.high_freq_factor=4",
                "model.rope_scaling.original_max_position_embeddings=8192",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "model.rope_scaling.type=\"linear\"",
                "model.rope_scaling.factor=2",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "train.precision=\"fp16\"",
                "train.initial_loss_scale=65536",
                "train.hysteresis=3",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &["train.precision=\"fp16\"", "train.loss_scale=1024"],
        ),
    ];
    let cluster = Cluster::preset("h100-sxm").unwrap();
    for (file, sets) in cases {
        let spec = spec(file, sets);
        let layout = ParallelLayout::of_spec(&spec);
        let text = emit_model_toml(&spec, &layout, &cluster, &[]);
        let back = megac_frontend::parse_str("emitted.toml", &text, &[])
            .unwrap_or_else(|e| panic!("{file} {sets:?}: {}\n{text}", e.render()));
        assert_eq!(back.model, spec.model, "{file} {sets:?}\n{text}");
        assert_eq!(back.train, spec.train, "{file} {sets:?}\n{text}");
    }
}
