//! KV-cache decoding (`megac_runtime::kv`) against recomputing the whole prefix
//! (`Inference::logits`, the path tests/generate.rs checks against transformers): the logits
//! of every position, the prompt's from the window plan's prefill and each later one from
//! a one-token step through the cache, agree within float32 rounding, for llama, gpt,
//! mixtral and qwen2-moe (MoE), mistral (a sliding window of 5 over 16 positions) and qwen2
//! (qkv bias, linear rope scaling), on one device, in tp2 and in pp2.

use std::path::{Path, PathBuf};
use std::process::Command;

use megac_ir::gate::CheckedPlan;
use megac_runtime::infer::with_ranks;
use megac_runtime::kv::with_ranks_kv;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// Fixture `name`'s one-sample inference plan with `sets` (after micro and global batch 1).
fn plan(name: &str, sets: &[String]) -> CheckedPlan {
    let mut all = vec![
        "train.micro_batch=1".to_string(),
        "train.global_batch=1".into(),
    ];
    all.extend(sets.iter().cloned());
    let spec = megac_frontend::load(&fixture(name).join("model.toml"), &all)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    // An inference plan, as `megac generate` compiles.
    let module = megac_passes::run_inference_pipeline(spec).unwrap();
    let plan =
        megac_codegen::emit_inference_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
            .unwrap();
    assert_eq!(plan.kind, megac_ir::plan::PlanKind::Inference);
    CheckedPlan::check(plan).unwrap()
}

/// The 16 tokens every case runs (the fixtures' context is 16).
const TOKENS: [u32; 16] = [
    3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79,
];

/// Max |kv - recomputed| over every position's logits, for a prompt of `prompt` tokens.
fn kv_vs_recompute(name: &str, layout: &[&str], prompt: usize) -> f32 {
    let mut sets: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
    let window = plan(name, &sets);
    sets.extend(megac_runtime::kv::block_sets(&window));
    let block = plan(name, &sets);
    let init = fixture(name).join("init.safetensors");
    let n = TOKENS.len().min(window.batch.seq_len as usize);
    let tokens = &TOKENS[..n];
    let full = with_ranks(&window, &init, |inf| inf.logits(tokens)).unwrap();
    let kv = with_ranks_kv(&window, &block, &init, |dec| dec.logits(tokens, prompt)).unwrap();
    assert_eq!(full.len(), kv.len(), "{name} {layout:?}");
    let v = full.len() / n;
    let mut worst = 0f32;
    for t in 0..n {
        let (a, b) = (&full[t * v..(t + 1) * v], &kv[t * v..(t + 1) * v]);
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let scale = a.iter().fold(1f32, |m, x| m.max(x.abs()));
        assert!(
            d <= 1e-5 * scale,
            "{name} {layout:?}: position {t} (prompt {prompt}): max |kv - recomputed| = {d}"
        );
        worst = worst.max(d);
    }
    eprintln!("{name} {layout:?} prompt {prompt}: max |kv - recomputed| = {worst:e}");
    worst
}

fn every_layout(name: &str, tp: &[&str]) {
    every_layout_pp(name, tp, "parallel.pp=2");
}

fn every_layout_pp(name: &str, tp: &[&str], pp: &str) {
    for prompt in [1, 5] {
        kv_vs_recompute(name, &[], prompt);
    }
    kv_vs_recompute(name, tp, 3);
    kv_vs_recompute(name, &[pp], 3);
}

#[test]
fn kv_llama_equals_recompute() {
    every_layout("llama", &["parallel.tp=2"]);
    // pp2 × tp2.
    kv_vs_recompute("llama", &["parallel.pp=2", "parallel.tp=2"], 2);
}

#[test]
fn kv_gpt_equals_recompute() {
    every_layout("gpt", &["parallel.tp=2"]);
    // GPT-2's learned positions on sequence shards.
    kv_vs_recompute(
        "gpt",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        4,
    );
}

#[test]
fn kv_moe_equals_recompute() {
    let sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    every_layout("mixtral", &sp);
    // Three layers: three stages.
    every_layout_pp("qwen2_moe", &sp, "parallel.pp=3");
    // Three layers over two stages, balanced by cost: the block plan keeps the window
    // plan's split (a one-token block alone would be balanced differently).
    kv_vs_recompute(
        "qwen2_moe",
        &["parallel.pp=2", "parallel.stage_layers=\"balanced\""],
        3,
    );
}

#[test]
fn kv_mistral_window_equals_recompute() {
    // The window (5) is shorter than the context (32, the tokens 16): later steps attend
    // only the last 5 cached positions.
    every_layout("mistral", &["parallel.tp=2"]);
}

#[test]
fn kv_qwen2_bias_equals_recompute() {
    every_layout("qwen2", &["parallel.tp=2"]);
}

fn megac(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

/// `megac generate` gives the same tokens with and without the cache; a MoE with a capacity
/// (which drops tokens by the whole window) is refused with the cache, one error.
#[test]
fn generate_with_and_without_cache() {
    for name in ["mistral", "qwen2_moe"] {
        let dir = fixture(name);
        let (model, init) = (dir.join("model.toml"), dir.join("init.safetensors"));
        let run = |extra: &[&str]| {
            let mut args = vec![
                "generate",
                model.to_str().unwrap(),
                "--init",
                init.to_str().unwrap(),
                "--tokens",
                "7,1,12,40",
                "--max-new-tokens",
                "12",
                "--format",
                "json",
            ];
            args.extend_from_slice(extra);
            let out = megac(&args);
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(out.status.success(), "{name} {extra:?}: {err}");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            v["tokens"].clone()
        };
        assert_eq!(run(&[]), run(&["--no-kv-cache"]), "{name}");
    }
    let dir = fixture("mixtral");
    let (model, init) = (dir.join("model.toml"), dir.join("init.safetensors"));
    let out = megac(&[
        "generate",
        model.to_str().unwrap(),
        "--init",
        init.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--set",
        "model.moe.capacity_factor=1.5",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("needs dropless MoE routing"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
