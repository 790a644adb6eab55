//! `megac generate` against Hugging Face transformers: greedy ids equal to
//! `generate(do_sample=False)` for the same weights (fixtures `tests/golden/*/generate.json`
//! and `scope.safetensors`, made by tests/golden/make_scope_golden.py, not run in CI), the
//! forward's logits equal to transformers' within float32 rounding, and the sampler's and
//! the command line's contracts.

use std::path::{Path, PathBuf};
use std::process::Command;

use megac_runtime::infer::Inference;
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn megac(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

/// `megac generate` on fixture `name` with `extra` options; the parsed JSON.
fn generate(name: &str, extra: &[&str]) -> serde_json::Value {
    let dir = fixture(name);
    let (model, init) = (dir.join("model.toml"), dir.join("init.safetensors"));
    let mut args = vec![
        "generate",
        model.to_str().unwrap(),
        "--init",
        init.to_str().unwrap(),
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    let out = megac(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn join(t: &[u64]) -> String {
    t.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// Every greedy case of the fixture gives transformers' ids exactly, with `sets` (a layout).
fn greedy_matches(name: &str, sets: &[&str]) {
    greedy_matches_with(name, sets, &[]);
}

/// [`greedy_matches`] with the command-line options `flags` too.
fn greedy_matches_with(name: &str, sets: &[&str], flags: &[&str]) {
    let text = std::fs::read_to_string(fixture(name).join("generate.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for case in cases {
        let prompt = ids(&case["prompt"]);
        let want = ids(&case["tokens"]);
        let n = case["max_new_tokens"].as_u64().unwrap().to_string();
        let p = join(&prompt);
        let mut args = vec!["--tokens", &p, "--max-new-tokens", &n];
        for s in sets {
            args.extend(["--set", s]);
        }
        args.extend_from_slice(flags);
        let got = generate(name, &args);
        assert_eq!(ids(&got["prompt_tokens"]), prompt);
        assert_eq!(
            ids(&got["tokens"]),
            want,
            "{name} {sets:?}: prompt {prompt:?}"
        );
        let bytes: Vec<u8> = want.iter().map(|&t| t as u8).collect();
        assert_eq!(
            got["text"].as_str().unwrap(),
            String::from_utf8_lossy(&bytes)
        );
        assert!(got["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn greedy_llama_matches_transformers() {
    greedy_matches("llama", &[]);
}

#[test]
fn greedy_gpt_matches_transformers() {
    greedy_matches("gpt", &[]);
}

#[test]
fn greedy_mixtral_matches_transformers() {
    greedy_matches("mixtral", &[]);
}

/// Pipeline parallelism: two stages run as a forward pipeline (the last one's logits
/// gathered); and with tp2 on each stage.
#[test]
fn greedy_pp2_matches_transformers() {
    greedy_matches("llama", &["parallel.pp=2"]);
    greedy_matches("gpt", &["parallel.pp=2"]);
    greedy_matches("mixtral", &["parallel.pp=2"]);
    greedy_matches("llama", &["parallel.pp=2", "parallel.tp=2"]);
}

/// Tensor parallelism: two ranks (threads), the vocab-parallel logits gathered.
#[test]
fn greedy_tp2_matches_transformers() {
    greedy_matches("llama", &["parallel.tp=2"]);
    greedy_matches("gpt", &["parallel.tp=2"]);
    // Megatron's tensor-parallel MoE needs sequence parallelism.
    greedy_matches(
        "mixtral",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    );
}

/// Context parallelism (the sequence split over two ranks in load-balanced chunks; the
/// logits put back in order by their layout), with the KV cache (each cp rank caches the
/// positions it holds, the step's attention merged over cp) and recomputing the prefix for
/// every new token (`--no-kv-cache`): transformers' ids, which are the one-device run's
/// (`greedy_*_matches_transformers`); also with tp2 (mixtral: and sequence parallelism).
#[test]
fn greedy_cp2_matches_transformers() {
    for flags in [&[][..], &["--no-kv-cache"][..]] {
        greedy_matches_with("llama", &["parallel.cp=2"], flags);
        greedy_matches_with("gpt", &["parallel.cp=2"], flags);
        greedy_matches_with("mixtral", &["parallel.cp=2"], flags);
        greedy_matches_with("llama", &["parallel.cp=2", "parallel.tp=2"], flags);
        greedy_matches_with(
            "mixtral",
            &[
                "parallel.cp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            flags,
        );
    }
}

/// Expert parallelism: ep2 folded over dp2 (every replica runs the prompt) or over cp2,
/// also with tp2 and sequence parallelism, with the KV cache and with `--no-kv-cache`:
/// transformers' ids.
#[test]
fn greedy_ep2_matches_transformers() {
    let tp_sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    for base in [
        &["parallel.dp=2", "parallel.ep=2"][..],
        &["parallel.cp=2", "parallel.ep=2"][..],
    ] {
        let with_tp: Vec<&str> = base.iter().chain(&tp_sp).copied().collect();
        for flags in [&[][..], &["--no-kv-cache"][..]] {
            greedy_matches_with("mixtral", base, flags);
            greedy_matches_with("mixtral", &with_tp, flags);
        }
    }
}

/// `megac compile --inference --kv-cache` under cp writes a KV-cache plan whose caches
/// hold each rank's half of the window's positions.
#[test]
fn kv_cache_plan_under_cp() {
    let dir = fixture("llama");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("plan");
    let (m, o) = (dir.join("model.toml"), out.to_str().unwrap().to_string());
    let args = [
        "compile",
        m.to_str().unwrap(),
        "--inference",
        "--kv-cache",
        "--set",
        "parallel.cp=2",
        "-o",
        &o,
    ];
    let run = megac(&args);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{err}");
    let plan = megac_ir::plan::Plan::load(&out.join("plan.json")).unwrap();
    assert!(plan.decode.is_some());
    let caches: Vec<_> = plan
        .buffers
        .iter()
        .filter(|b| b.class == megac_ir::plan::BufferClass::KvCache)
        .collect();
    // 2 layers × (k, v); 16 positions over cp = 2: 8 per rank.
    assert_eq!(caches.len(), 4);
    assert!(caches.iter().all(|b| b.shape[0] == 8), "{caches:?}");
    // Each rank's kv_cache arena: 4 caches × 8 positions × 2 kv heads × 16 × 4 bytes.
    assert_eq!(plan.memory.kv_cache_bytes, 4 * 8 * 2 * 16 * 4);
}

/// The checked one-sample plan of fixture `name`.
pub fn forward_plan(name: &str) -> megac_ir::gate::CheckedPlan {
    let sets = ["train.micro_batch=1", "train.global_batch=1"].map(String::from);
    let spec = megac_frontend::load(&fixture(name).join("model.toml"), &sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    megac_ir::gate::CheckedPlan::check(plan).unwrap()
}

fn read_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

const SCOPE_TOKENS: [u32; 8] = [3, 14, 15, 92, 65, 35, 89, 79];

/// The logits of the fixture's probe input equal transformers' within float32 rounding;
/// every prefix's logits (the sequence padded to the context) equal the full sequence's
/// rows bit for bit: the padding cannot leak into earlier positions.
fn logits_match(name: &str) {
    let plan = forward_plan(name);
    let init = fixture(name).join("init.safetensors");
    let mut inf = Inference::new(&plan, &init).unwrap();
    let got = inf.logits(&SCOPE_TOKENS).unwrap();
    let bytes = std::fs::read(fixture(name).join("scope.safetensors")).unwrap();
    let want = read_f32(&SafeTensors::deserialize(&bytes).unwrap(), "logits");
    assert_eq!(got.len(), want.len());
    let max = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max < 1e-6, "{name}: max |logit - transformers| = {max}");
    let v = inf.vocab();
    for k in 1..SCOPE_TOKENS.len() {
        let prefix = inf.logits(&SCOPE_TOKENS[..k]).unwrap();
        assert_eq!(prefix[..], got[..k * v], "{name}: prefix of {k} tokens");
    }
}

#[test]
fn logits_llama_match_transformers() {
    logits_match("llama");
}

#[test]
fn logits_gpt_match_transformers() {
    logits_match("gpt");
}

#[test]
fn logits_mixtral_match_transformers() {
    logits_match("mixtral");
}

#[test]
fn sampling_is_seeded_and_top_k_1_is_greedy() {
    let prompt = ["--tokens", "5,17,99,3,42", "--max-new-tokens", "8"];
    let sample = |seed: &str, k: &str| {
        let mut a = prompt.to_vec();
        a.extend_from_slice(&["--temperature", "1.5", "--top-k", k, "--seed", seed]);
        ids(&generate("mixtral", &a)["tokens"])
    };
    let greedy = ids(&generate("mixtral", &prompt)["tokens"]);
    assert_eq!(sample("3", "0"), sample("3", "0"));
    // Different seeds sample different sequences (8 draws at temperature 1.5).
    let seqs: std::collections::BTreeSet<_> = ["1", "2", "3", "4"]
        .iter()
        .map(|s| sample(s, "0"))
        .collect();
    assert!(seqs.len() > 1, "{seqs:?}");
    assert_eq!(sample("9", "1"), greedy);
    let mut a = prompt.to_vec();
    a.extend_from_slice(&["--temperature", "0.7", "--top-p", "1e-9", "--seed", "5"]);
    assert_eq!(ids(&generate("mixtral", &a)["tokens"]), greedy);
}

#[test]
fn bad_generate_input_is_one_error() {
    let dir = fixture("llama");
    let (model, init) = (dir.join("model.toml"), dir.join("init.safetensors"));
    let (m, i) = (model.to_str().unwrap(), init.to_str().unwrap());
    for (extra, want) in [
        (
            vec!["--tokens", "1,x"],
            "--tokens 1,x: item 2 is `x`, not a token id",
        ),
        (
            vec!["--tokens", "1,128"],
            "token 1 is 128, outside the vocabulary [0, 128)",
        ),
        (
            vec!["--tokens", "1,2", "--max-new-tokens", "15"],
            "2 prompt tokens + 15 new tokens do not fit the model's context of seq_len = 16",
        ),
        (
            vec!["--prompt", "é"],
            "token 0 is 195, outside the vocabulary [0, 128)",
        ),
        (
            vec!["--tokens", "1", "--format", "xml"],
            "--format xml: expected text or json",
        ),
        (
            vec!["--tokens", "1", "--top-p", "0"],
            "--top-p 0: expected a number in (0, 1]",
        ),
    ] {
        let mut args = vec!["generate", m, "--init", i];
        args.extend(extra.iter().copied());
        let out = megac(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(out.stdout.is_empty());
    }
}
