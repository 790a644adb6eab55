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

/// The KV-cache plan of fixture `name` in `layout` (unchecked), as `megac generate`
/// builds it, and its window plan.
fn kv_plan(name: &str, layout: &[&str]) -> (megac_ir::plan::Plan, CheckedPlan) {
    let mut sets: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
    let window = plan(name, &sets);
    sets.extend(megac_runtime::kv::block_sets(&window));
    let block = plan(name, &sets);
    (megac_codegen::kv::kv_plan(&window, &block).unwrap(), window)
}

/// The plan's structure: caches of class kv_cache (keys and values per layer, the
/// window's positions, this rank's kv heads, on the layer's stage), the kv_cache arena
/// they fill, one parameter arena of the window plan's size (the weights held once), and a
/// decode step whose every parameter operand is one of the window plan's buffers.
#[test]
fn kv_plan_structure() {
    use megac_ir::plan::{BufferClass, Instr};
    // llama: 2 layers, 2 kv heads of 16, 16 positions.
    for (layout, kv_heads) in [
        (&[][..], 2u64),
        (&["parallel.tp=2"][..], 1),
        (&["parallel.pp=2"][..], 2),
    ] {
        let (kv, window) = kv_plan("llama", layout);
        let caches: Vec<_> = kv
            .buffers
            .iter()
            .filter(|b| b.class == BufferClass::KvCache)
            .collect();
        assert_eq!(
            caches.len(),
            4,
            "{layout:?}: a key and a value cache per layer"
        );
        for c in &caches {
            assert_eq!(c.shape, vec![16, kv_heads, 16], "{layout:?} {}", c.name);
        }
        let per_layer = 2 * 16 * kv_heads * 16 * 4;
        for rank in 0..kv.rank_to_role.len() {
            let m = kv.memory_of(rank);
            let layers = if layout.contains(&"parallel.pp=2") {
                1
            } else {
                2
            };
            assert_eq!(
                m.kv_cache_bytes,
                layers * per_layer,
                "{layout:?} rank {rank}"
            );
            assert_eq!(
                m.param_bytes,
                window.memory_of(rank).param_bytes,
                "{layout:?}"
            );
            assert_eq!(m.grad_bytes + m.opt_state_bytes, 0);
        }
        let params: std::collections::HashSet<u32> = window
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.class == BufferClass::Param)
            .map(|(i, _)| i as u32)
            .collect();
        let steps = kv.roles.iter().flat_map(|r| {
            r.decode.iter().map(|d| d.step.clone()).chain(
                r.pipeline
                    .iter()
                    .flat_map(|p| p.chunks.iter().map(|c| c.decode.clone())),
            )
        });
        let mut kernels = 0;
        for step in steps {
            for i in &step {
                if let Instr::Kernel { op, inputs, .. } = i {
                    kernels += 1;
                    assert!(!matches!(
                        op,
                        megac_ir::OpKind::CausalAttention { .. } | megac_ir::OpKind::Rope { .. }
                    ));
                    for &b in inputs {
                        if kv.buffers[b as usize].class == BufferClass::Param {
                            assert!(
                                params.contains(&b),
                                "{layout:?}: {}",
                                kv.buffers[b as usize].name
                            );
                        }
                    }
                }
            }
        }
        assert!(kernels > 0, "{layout:?}: no decode step");
        CheckedPlan::check(kv).unwrap();
    }
}

/// The gate refuses a KV-cache plan whose new structure is broken, with one error naming
/// it; and a plan that is not a KV-cache plan with caches or decode steps.
#[test]
fn kv_plan_gate() {
    use megac_ir::plan::{BufferClass, Instr};
    let (good, window) = kv_plan("llama", &[]);
    let refuse = |plan: megac_ir::plan::Plan, want: &str| {
        let e = CheckedPlan::check(plan).unwrap_err().to_string();
        assert!(e.contains(want), "expected `{want}` in: {e}");
    };
    let cache = good
        .buffers
        .iter()
        .position(|b| b.class == BufferClass::KvCache)
        .unwrap() as u32;
    // A cache of fewer positions than the window.
    let mut p = good.clone();
    p.buffers[cache as usize].shape[0] = 8;
    refuse(p, "holds the window's 16 positions of this rank");
    // Any other instruction writing a cache.
    let mut p = good.clone();
    p.roles[0]
        .decode
        .as_mut()
        .unwrap()
        .step
        .insert(0, Instr::Zero { buffer: cache });
    refuse(p, "not caches");
    // A role without a decode step.
    let mut p = good.clone();
    p.roles[0].decode = None;
    refuse(p, "has no decode step");
    // The position is not a data input (the runtime writes it).
    let mut p = good.clone();
    let pos = p.decode.as_ref().unwrap().position as usize;
    p.buffers[pos].class = BufferClass::Activation;
    refuse(p, "expected input i32 [1]");
    // A truncated decode step: the view's checks name the step.
    let mut p = good.clone();
    p.roles[0].decode.as_mut().unwrap().step.remove(0);
    refuse(p, "of the decode step");
    // Caches in the arena: a cache past the kv_cache arena.
    let mut p = good.clone();
    p.memory.kv_cache_bytes -= 4;
    refuse(p, "kv_cache arena");
    // An ordinary inference plan with a cache buffer.
    let mut p = window.into_inner();
    let mut c = good.buffers[cache as usize].clone();
    c.offset = 0;
    p.buffers.push(c);
    refuse(p, "a kv_cache buffer in a plan without decode steps");
    // The unbroken plan passes.
    CheckedPlan::check(good).unwrap();
}

/// `kv_plan` refuses what the cache cannot hold exactly, with one error: MoE routing with a
/// capacity (which tokens an expert drops depends on the window), context parallelism.
#[test]
fn kv_plan_refuses() {
    let refuse = |name: &str, layout: &[&str], want: &str| {
        let mut sets: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
        let window = plan(name, &sets);
        sets.extend(megac_runtime::kv::block_sets(&window));
        let block = plan(name, &sets);
        let e = megac_codegen::kv::kv_plan(&window, &block)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{name} {layout:?}: {e}");
    };
    refuse(
        "mixtral",
        &["model.moe.capacity_factor=1.5"],
        "dropless MoE routing",
    );
    // Under cp the block is the layout without cp (one token is not split over cp): the
    // window itself does not stand for it.
    let cp = plan("llama", &["parallel.cp=2".to_string()]);
    let e = megac_codegen::kv::kv_plan(&cp, &cp)
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not fit the window plan"), "{e}");
    // Two plans that are not a window and its block.
    let (a, b) = (plan("llama", &[]), plan("gpt", &[]));
    assert!(megac_codegen::kv::kv_plan(&a, &b).is_err());
}

/// `megac compile --inference --kv-cache` writes the KV-cache plan; `megac inspect` shows
/// its cache memory per rank.
#[test]
fn compile_and_inspect_kv_plan() {
    let dir = std::env::temp_dir().join(format!("megac-kvplan-{}", std::process::id()));
    let model = fixture("llama").join("model.toml");
    let out = megac(&[
        "compile",
        model.to_str().unwrap(),
        "--inference",
        "--kv-cache",
        "--set",
        "parallel.tp=2",
        "-o",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan = megac_ir::plan::Plan::load(&dir.join("plan.json")).unwrap();
    assert!(plan.decode.is_some());
    let text = megac(&["inspect", dir.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    // 2 layers × (k, v) × 16 positions × 1 kv head × 16 × 4 bytes per rank.
    assert!(text.contains("kv cache"), "{text}");
    assert!(text.contains("decode       KV cache"), "{text}");
    let program = megac(&["inspect", dir.to_str().unwrap(), "--program"]);
    let program = String::from_utf8_lossy(&program.stdout).to_string();
    for want in [
        "decode block=2",
        "  decode (",
        "kv_attention",
        "rope_at",
        "kv_cache",
    ] {
        assert!(program.contains(want), "`{want}` not in the plan's text");
    }
    let json = megac(&["inspect", dir.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        v["roles"][0]["memory_bytes"]["kv_cache"],
        2 * 2 * 16 * 16 * 4
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Max |kv - recomputed| over every position's logits, for a prompt of `prompt` tokens.
fn kv_vs_recompute(name: &str, layout: &[&str], prompt: usize) -> f32 {
    let mut sets: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
    let window = plan(name, &sets);
    sets.extend(megac_runtime::kv::block_sets(&window));
    let block = plan(name, &sets);
    let kv = megac_codegen::kv::kv_plan(&window, &block).unwrap();
    let kv = CheckedPlan::check(kv).unwrap_or_else(|e| panic!("{name} {layout:?}: {e}"));
    let init = fixture(name).join("init.safetensors");
    let n = TOKENS.len().min(window.batch.seq_len as usize);
    let tokens = &TOKENS[..n];
    let full = with_ranks(&window, &init, |inf| inf.logits(tokens)).unwrap();
    let kv = with_ranks_kv(&kv, &init, |dec| dec.logits(tokens, prompt)).unwrap();
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
        if t < prompt.max(1) {
            // The prefill is the window's forward (its attention also fills the caches):
            // the prompt's logits are the recomputation's bit for bit.
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name} {layout:?}: prefill position {t} differs from the recomputation"
            );
        }
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

/// Context parallelism: each cp rank caches its load-balanced positions and the step's
/// attention partials are merged over cp (llama: RoPE, GQA; gpt: learned positions; both
/// also with tp2, and the ring and all-gather cp attention of the prefill).
#[test]
fn kv_cp_equals_recompute() {
    for name in ["llama", "gpt"] {
        for prompt in [1, 5] {
            kv_vs_recompute(name, &["parallel.cp=2"], prompt);
        }
        kv_vs_recompute(name, &["parallel.cp=2", "parallel.tp=2"], 3);
    }
    kv_vs_recompute(
        "llama",
        &["parallel.cp=2", "parallel.cp_comm=\"all-gather\""],
        4,
    );
    // A sliding window shorter than the context, over cp.
    kv_vs_recompute("mistral", &["parallel.cp=2"], 3);
    // Dropless MoE, with tp2 and sequence parallelism.
    kv_vs_recompute(
        "mixtral",
        &[
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
        3,
    );
    // cp2 × pp2: the decode step's pipeline runs in each cp slice.
    kv_vs_recompute("llama", &["parallel.cp=2", "parallel.pp=2"], 3);
}

/// Expert parallelism (ep2 folded over dp2 or cp2, also with tp2 and sequence
/// parallelism): the decode step's tokens go to their experts' ranks and back by
/// all-to-all over ep as the window's do (under cp the block keeps the dp·cp ranks as its
/// dp, so its expert groups are the window's); mixtral and qwen2-moe (shared experts, a
/// dense first layer).
#[test]
fn kv_ep_equals_recompute() {
    let dp_ep = ["parallel.dp=2", "train.global_batch=2", "parallel.ep=2"];
    let cp_ep = ["parallel.cp=2", "parallel.ep=2"];
    let tp_sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    for name in ["mixtral", "qwen2_moe"] {
        for base in [&dp_ep[..], &cp_ep[..]] {
            for prompt in [1, 5] {
                kv_vs_recompute(name, base, prompt);
            }
            let with_tp: Vec<&str> = base.iter().chain(&tp_sp).copied().collect();
            kv_vs_recompute(name, &with_tp, 3);
        }
    }
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
