//! `megac import-hf` and the config.json `--save-params` writes beside the weights
//! (`megac_frontend::hf`): every golden fixture's transformers `config.json` (written by
//! transformers 5.24's `save_pretrained`) imports to exactly the `[model]` of the fixture's
//! model.toml; the exported config imports back to the same model; transformers 4's layout
//! (`rope_theta`, `rope_scaling` with `type`) reads the same; what megac cannot express is
//! refused, naming the key.

use std::path::{Path, PathBuf};
use std::process::Command;

use megac_frontend::hf::{export_config, import_config};
use megac_ir::spec::{ModelSection, RopeScaling};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

const FIXTURES: [&str; 8] = [
    "llama",
    "gpt",
    "mixtral",
    "qwen2",
    "qwen3",
    "llama31",
    "mistral",
    "qwen2_moe",
];

fn model_of(toml: &str) -> ModelSection {
    megac_frontend::parse_str("imported.toml", toml, &[])
        .unwrap_or_else(|e| panic!("{}\n{toml}", e.render()))
        .model
}

fn imported(config: &str) -> ModelSection {
    model_of(&import_config("config.json", config).unwrap_or_else(|e| panic!("{}", e.render())))
}

fn fixture_model(name: &str) -> ModelSection {
    megac_frontend::load(&root().join(format!("tests/golden/{name}/model.toml")), &[])
        .unwrap()
        .model
}

fn fixture_config(name: &str) -> String {
    std::fs::read_to_string(root().join(format!("tests/golden/{name}/init_config.json"))).unwrap()
}

#[test]
fn golden_configs_import_to_their_model_toml() {
    for name in FIXTURES {
        assert_eq!(
            imported(&fixture_config(name)),
            fixture_model(name),
            "{name}: import-hf of init_config.json"
        );
    }
}

#[test]
fn exported_configs_import_back() {
    for name in FIXTURES {
        let spec =
            megac_frontend::load(&root().join(format!("tests/golden/{name}/model.toml")), &[])
                .unwrap();
        let config = export_config(&spec);
        assert_eq!(imported(&config), spec.model, "{name}: export then import");
    }
}

/// transformers 4 kept `rope_theta` and `rope_scaling` (with `type`) at the top level.
#[test]
fn transformers_4_layout_reads_the_same() {
    let v5: serde_json::Value = serde_json::from_str(&fixture_config("llama31")).unwrap();
    let mut v4 = v5.clone();
    let obj = v4.as_object_mut().unwrap();
    let mut rope = obj.remove("rope_parameters").unwrap();
    let theta = rope.as_object_mut().unwrap().remove("rope_theta").unwrap();
    let kind = rope.as_object_mut().unwrap().remove("rope_type").unwrap();
    rope.as_object_mut().unwrap().insert("type".into(), kind);
    obj.insert("rope_theta".into(), theta);
    obj.insert("rope_scaling".into(), rope);
    let m = imported(&v4.to_string());
    assert_eq!(m, fixture_model("llama31"));
    assert!(matches!(m.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
}

/// Each change makes the config something megac cannot express; the error names the key.
#[test]
fn inexpressible_configs_are_refused_naming_the_key() {
    let cases: [(&str, &str, serde_json::Value); 9] = [
        ("qwen2_moe", "use_sliding_window", serde_json::json!(true)),
        ("qwen2_moe", "mlp_only_layers", serde_json::json!([1])),
        ("qwen2_moe", "decoder_sparse_step", serde_json::json!(2)),
        ("llama", "attention_bias", serde_json::json!(true)),
        ("llama", "mlp_bias", serde_json::json!(true)),
        ("llama", "hidden_act", serde_json::json!("gelu")),
        ("qwen2", "use_sliding_window", serde_json::json!(true)),
        (
            "llama31",
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
        ),
        ("llama", "model_type", serde_json::json!("falcon")),
    ];
    for (name, key, value) in cases {
        let mut v: serde_json::Value = serde_json::from_str(&fixture_config(name)).unwrap();
        v.as_object_mut().unwrap().insert(key.into(), value);
        let e = import_config("config.json", &v.to_string()).unwrap_err();
        assert!(
            e.message.contains(&format!("`{key}`")),
            "{name} {key}: {}",
            e.message
        );
    }
}

/// Qwen3Config's head_dim defaults to 128 (not hidden / heads); Qwen2's sliding_window is
/// not imported while use_sliding_window is false.
#[test]
fn family_defaults_follow_transformers() {
    let mut v: serde_json::Value = serde_json::from_str(&fixture_config("qwen3")).unwrap();
    v.as_object_mut().unwrap().remove("head_dim");
    assert_eq!(imported(&v.to_string()).head_dim, 128);
    let mut v: serde_json::Value = serde_json::from_str(&fixture_config("qwen2")).unwrap();
    let o = v.as_object_mut().unwrap();
    o.insert("sliding_window".into(), serde_json::json!(4096));
    o.insert("use_sliding_window".into(), serde_json::json!(false));
    assert_eq!(imported(&v.to_string()).sliding_window, None);
    // Qwen2-MoE writes `sliding_window: 0` (transformers 5.24's save_pretrained of the
    // fixture): not a window while use_sliding_window is false.
    let v: serde_json::Value = serde_json::from_str(&fixture_config("qwen2_moe")).unwrap();
    assert_eq!(v["sliding_window"], serde_json::json!(0));
    assert_eq!(v["use_sliding_window"], serde_json::json!(false));
    let m = imported(&v.to_string());
    assert_eq!(m.sliding_window, None);
    // Qwen2MoeConfig's qkv_bias (true) and norm_topk_prob (false) defaults.
    let mut v = v;
    let o = v.as_object_mut().unwrap();
    o.remove("qkv_bias");
    o.remove("norm_topk_prob");
    let m = imported(&v.to_string());
    assert!(m.qkv_bias);
    assert!(!m.moe.unwrap().norm_topk_prob);
}

#[test]
fn cli_import_hf_writes_a_model_toml_that_checks() {
    let dir = tempfile::tempdir().unwrap();
    let out: PathBuf = dir.path().join("sub/qwen2.toml");
    let bin = env!("CARGO_BIN_EXE_megac");
    let o = Command::new(bin)
        .current_dir(root())
        .args(["import-hf", "tests/golden/qwen2/init_config.json", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(model_of(&text), fixture_model("qwen2"));
    // A config megac cannot express: one error naming the key, exit 1, nothing written.
    let bad = dir.path().join("bad.json");
    let mut v: serde_json::Value = serde_json::from_str(&fixture_config("qwen2")).unwrap();
    v.as_object_mut()
        .unwrap()
        .insert("use_sliding_window".into(), serde_json::json!(true));
    std::fs::write(&bad, v.to_string()).unwrap();
    let out2 = dir.path().join("bad.toml");
    let o = Command::new(bin)
        .args(["import-hf"])
        .arg(&bad)
        .arg("-o")
        .arg(&out2)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("`use_sliding_window`"),
        "{err}"
    );
    assert!(!out2.exists());
}

/// `megac train --save-params DIR/model.safetensors` writes DIR/config.json, which imports
/// back to the trained model.
#[test]
fn train_save_params_writes_the_config_beside_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("model.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_megac"))
        .current_dir(root())
        .args(["train", "tests/golden/qwen3/model.toml", "--steps", "1"])
        .args(["--data", "tests/golden/qwen3/tokens.bin", "--save-params"])
        .arg(&weights)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(weights.exists());
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert_eq!(imported(&config), fixture_model("qwen3"));
    let v: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(v["architectures"][0], "Qwen3ForCausalLM");
}

/// Qwen2-MoE's --save-params: Hugging Face's per-expert tensor names beside a
/// Qwen2MoeForCausalLM config.json that imports back to the model.
#[test]
fn train_save_params_writes_qwen2_moe_names() {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("model.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_megac"))
        .current_dir(root())
        .args(["train", "tests/golden/qwen2_moe/model.toml", "--steps", "1"])
        .args(["--data", "tests/golden/qwen2_moe/tokens.bin"])
        .args(["--init", "tests/golden/qwen2_moe/init.safetensors"])
        .arg("--save-params")
        .arg(&weights)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert_eq!(imported(&config), fixture_model("qwen2_moe"));
    let v: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(v["architectures"][0], "Qwen2MoeForCausalLM");
    assert_eq!(v["mlp_only_layers"], serde_json::json!([0]));
    // The same tensor names as transformers' save_pretrained of the fixture.
    let names = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut n: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        n.sort();
        n
    };
    let want = names(&root().join("tests/golden/qwen2_moe/init.safetensors"));
    assert!(want.contains(&"model.layers.1.mlp.experts.3.down_proj.weight".to_string()));
    assert!(want.contains(&"model.layers.2.mlp.shared_expert_gate.weight".to_string()));
    assert_eq!(names(&weights), want);
}

/// `megac compile` writes the config beside plan.json; `megac run PLAN --save-params`
/// copies it beside the weights.
#[test]
fn run_save_params_copies_the_config_of_the_compiled_plan() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan");
    let bin = env!("CARGO_BIN_EXE_megac");
    let o = Command::new(bin)
        .current_dir(root())
        .args(["compile", "tests/golden/mistral/model.toml", "-o"])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let weights = dir.path().join("out/model.safetensors");
    let o = Command::new(bin)
        .arg("run")
        .arg(&plan)
        .args(["--steps", "1", "--save-params"])
        .arg(&weights)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let config = std::fs::read_to_string(dir.path().join("out/config.json")).unwrap();
    assert_eq!(imported(&config), fixture_model("mistral"));
}

/// A Llama-3.1-style checkpoint (llama3 rope scaling) imported with `import-hf` and
/// trained from its weights with `--init` gives transformers' losses (the llama31
/// fixture: the first step's loss is that of the checkpoint as transformers computes it;
/// without the scaling it would differ by 0.65%).
#[test]
fn imported_llama31_checkpoint_gives_transformers_losses() {
    let toml = import_config("config.json", &fixture_config("llama31")).unwrap();
    // The fixture's job: 4 samples a step in micro-batches of 2, 3 AdamW steps.
    let sets: Vec<String> = [
        "train.micro_batch=2",
        "train.global_batch=4",
        "train.lr=0.01",
        "train.betas=[0.9, 0.95]",
        "train.eps=1e-8",
        "train.weight_decay=0.1",
        "train.grad_clip=2.0",
        "train.seed=7",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let spec = megac_frontend::parse_str("llama31-imported.toml", &toml, &sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    let plan = megac_ir::gate::CheckedPlan::check(plan).unwrap();
    let dir = root().join("tests/golden/llama31");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let data = dir.join("tokens.bin");
    let init = dir.join("init.safetensors");
    let mut s =
        megac_runtime::train::Session::new(&plan, data.to_str().unwrap(), Some(&init)).unwrap();
    for step in 1..=3u64 {
        let (loss, _) = s.step(step).unwrap();
        let want = expected["losses"][step as usize - 1].as_f64().unwrap();
        assert!(
            (loss - want).abs() / want < 1e-5,
            "step {step}: loss {loss} vs transformers {want}"
        );
    }
}
