//! Every model file in examples/ loads and validates, and a few facts about them hold.

use std::path::{Path, PathBuf};

use megac_frontend::ModelSpec;

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn load(name: &str) -> ModelSpec {
    let path = examples_dir().join(name);
    megac_frontend::load(&path, &[]).unwrap_or_else(|e| panic!("{}", e.render()))
}

#[test]
fn every_example_validates() {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(examples_dir())
        .expect("examples/ exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 7,
        "expected at least 7 examples, found {paths:?}"
    );
    let failures: Vec<String> = paths
        .iter()
        .filter_map(|p| megac_frontend::load(p, &[]).err().map(|e| e.render()))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_example_fits_its_cluster() {
    for name in [
        "llama3-8b.toml",
        "llama3-70b.toml",
        "gpt3-175b.toml",
        "mixtral-8x7b.toml",
    ] {
        let spec = load(name);
        let cluster = spec
            .cluster
            .as_ref()
            .expect("large examples name a cluster");
        assert_eq!(
            spec.parallel.world_size(),
            cluster.nodes * cluster.gpus_per_node,
            "{name} uses the whole cluster"
        );
    }
}

#[test]
fn llama_tiny_uses_grouped_query_attention() {
    let spec = load("llama-tiny.toml");
    assert_eq!(spec.name, "llama-tiny");
    assert_eq!(spec.model.heads, 4);
    assert_eq!(spec.model.kv_heads, 2);
    assert!(!spec.model.tie_embeddings);
    assert_eq!(spec.train.microbatches(spec.parallel.dp), 2);
}

#[test]
fn gpt_tiny_ties_embeddings_by_default() {
    let spec = load("gpt-tiny.toml");
    assert!(spec.model.tie_embeddings);
    assert_eq!(spec.model.kv_heads, spec.model.heads);
}

#[test]
fn moe_tiny_has_experts_on_every_layer() {
    let spec = load("moe-tiny.toml");
    let moe = spec.model.moe.as_ref().expect("moe-tiny has [model.moe]");
    assert_eq!((moe.experts, moe.top_k), (4, 2));
    assert!((0..spec.model.layers).all(|i| spec.model.is_moe_layer(i)));
}

#[test]
fn mixtral_has_eight_experts_over_eight_ranks() {
    let spec = load("mixtral-8x7b.toml");
    let moe = spec.model.moe.as_ref().expect("mixtral has [model.moe]");
    assert_eq!(moe.experts, 8);
    assert_eq!(moe.top_k, 2);
    assert_eq!(spec.parallel.ep, 8);
    assert_eq!(spec.parallel.dp % spec.parallel.ep, 0);
}

#[test]
fn llama3_70b_runs_on_64_ranks() {
    let spec = load("llama3-70b.toml");
    let p = &spec.parallel;
    assert_eq!((p.tp, p.pp, p.cp, p.dp), (4, 4, 2, 2));
    assert_eq!(p.world_size(), 64);
    assert_eq!(spec.padded_vocab(), 128_512);
}

#[test]
fn gpt3_175b_pads_the_vocabulary_as_megatron() {
    let spec = load("gpt3-175b.toml");
    assert_eq!(spec.model.vocab, 50_257);
    assert_eq!(spec.padded_vocab(), 51_200);
    assert_eq!(spec.parallel.world_size(), 1024);
}

#[test]
fn llama3_8b_takes_the_reference_layout_through_overrides() {
    let path = examples_dir().join("llama3-8b.toml");
    let sets = ["parallel.tp=1".to_string(), "parallel.dp=8".to_string()];
    let spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    assert_eq!((spec.parallel.tp, spec.parallel.dp), (1, 8));
    assert_eq!(spec.parallel.world_size(), 8);
}
