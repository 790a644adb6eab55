//! Golden tests against Hugging Face transformers + torch: fixtures made by
//! tests/golden/make_golden.py (not run in CI) hold a tiny model's initial weights, tokens,
//! the losses and grad norms of 3 AdamW steps, and the final weights. megac must reproduce
//! every loss and grad norm to relative 1e-5 and the final weights to relative 1e-4.

use std::path::{Path, PathBuf};

use megac_runtime::train::Session;
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn read_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("fixture lacks {name}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn golden(name: &str) {
    golden_with_init(name, "init.safetensors");
}

/// The checked plan of fixture folder `dir`'s model.toml with `sets`.
fn checked_plan(dir: &Path, sets: &[String]) -> megac_ir::gate::CheckedPlan {
    let spec = megac_frontend::load(&dir.join("model.toml"), sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    megac_ir::gate::CheckedPlan::check(plan).unwrap()
}

fn golden_with_init(name: &str, init_file: &str) {
    let dir = fixture(name);
    let plan = checked_plan(&dir, &[]);

    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let losses: Vec<f64> = expected["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let norms: Vec<f64> = expected["grad_norms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();

    let data = dir.join("tokens.bin");
    let init = dir.join(init_file);
    let mut s = Session::new(&plan, data.to_str().unwrap(), Some(&init)).unwrap();
    for step in 1..=3u64 {
        let (loss, norm) = s.step(step).unwrap();
        let (want_loss, want_norm) = (losses[step as usize - 1], norms[step as usize - 1]);
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
        if std::env::var_os("MEGAC_PRINT_ERRORS").is_some() {
            eprintln!(
                "{name} step {step}: loss rel {:.2e} norm rel {:.2e}",
                rel(loss, want_loss),
                rel(norm, want_norm)
            );
        }
        assert!(
            rel(loss, want_loss) < 1e-5,
            "{name} step {step}: loss {loss} vs transformers {want_loss}"
        );
        assert!(
            rel(norm, want_norm) < 1e-5,
            "{name} step {step}: grad norm {norm} vs torch {want_norm}"
        );
    }

    let bytes = std::fs::read(dir.join("final.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for p in &plan.params {
        let want = read_f32(&st, &p.name);
        let got = &s.mem.read_f32(p.buffer)[..];
        assert_eq!(got.len(), want.len(), "{}", p.name);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
        // GPT-2's key bias has a gradient that is exactly zero in real arithmetic (softmax
        // is invariant to it); torch and megac both see only rounding noise there, which
        // AdamW normalises to steps of up to lr. Those elements are compared loosely.
        let noise_only = |i: usize| {
            name == "gpt" && p.name.ends_with("attn.c_attn.bias") && (64..128).contains(&i)
        };
        // AdamW divides each gradient by its own running RMS, so an element whose gradient
        // is small enough for rounding to move it by a few percent moves by a few percent of
        // lr per step, whatever its weight's scale: which elements those are depends on the
        // CPU's summation order (a 5.6e-4 move of one Qwen2-MoE q_proj element on an AMD
        // EPYC, where megac's own ep layout moves it by 1e-4). One element in a thousand
        // (at least one per tensor) may exceed the weight-relative tolerance by up to a
        // tenth of lr per step; the rest of the tensor must still agree to 1e-4.
        let lr = plan.train.lr as f32;
        let steps = 3.0f32;
        let outliers_allowed = (got.len() / 1000).max(1);
        let mut outliers = 0usize;
        let (mut diff2, mut norm2) = (0f64, 0f64);
        for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
            let tol = if noise_only(i) {
                3.0 * 0.01
            } else {
                1e-3 * scale
            };
            let outlier = (a - b).abs() > tol && (a - b).abs() <= 0.1 * lr * steps;
            if outlier {
                outliers += 1;
            } else {
                assert!(
                    (a - b).abs() <= tol,
                    "{name}: {}[{i}] = {a} after 3 steps, transformers has {b} (tolerance {tol:e})",
                    p.name
                );
            }
            assert!(
                outliers <= outliers_allowed,
                "{name}: {}: more than {outliers_allowed} elements differ from transformers by \
                 more than {tol:e} (the last: [{i}] = {a}, transformers has {b})",
                p.name
            );
            if !noise_only(i) && !outlier {
                diff2 += f64::from(a - b).powi(2);
                norm2 += f64::from(b).powi(2);
            }
        }
        // Relative 1e-4 over the tensor; single elements whose gradient is within rounding
        // noise of zero may differ more (AdamW divides by their tiny second moment).
        let rel = (diff2 / norm2.max(1e-30)).sqrt();
        if std::env::var_os("MEGAC_PRINT_ERRORS").is_some() {
            eprintln!("{name}: {} rel {rel:.2e}", p.name);
        }
        assert!(
            rel < 1e-4,
            "{name}: {} differs from transformers by relative {rel:.2e}",
            p.name
        );
    }
}

#[test]
fn llama_matches_transformers() {
    golden("llama");
}

#[test]
fn gpt_matches_transformers() {
    golden("gpt");
}

/// Qwen2ForCausalLM: q/k/v biases (drawn non-zero: they move the first loss by 2.5%) split
/// with their heads, and linear rope scaling (factor 2: 1.2%).
#[test]
fn qwen2_matches_transformers() {
    golden("qwen2");
}

/// LlamaForCausalLM with Llama 3.1's rope scaling (`_compute_llama3_parameters`: factor 8,
/// low/high frequency factors 1 and 4, original context 16 < seq 32; it moves the first
/// loss by 0.65%).
#[test]
fn llama31_rope_scaling_matches_transformers() {
    golden("llama31");
}

/// Qwen3ForCausalLM: RMSNorm over each head's q and k before RoPE (weights drawn around 1;
/// the norms move the first loss by 0.37%), head_dim 32 with hidden 64 / 4 heads.
#[test]
fn qwen3_matches_transformers() {
    golden("qwen3");
}

/// MistralForCausalLM with a sliding window of 5 over 32-token samples (query q sees keys
/// q-4 ..= q, transformers' sliding-window mask; full causal attention changes the first
/// loss by 1.3%).
#[test]
fn mistral_sliding_window_matches_transformers() {
    golden("mistral");
}

/// MixtralForCausalLM (aux_loss_coeff = 0, so the loss is exactly transformers' LM loss):
/// router softmax in fp32, top-2, renormalised weights, dropless experts.
#[test]
fn mixtral_matches_transformers() {
    golden("mixtral");
}

/// Qwen2MoeForCausalLM (eager experts, aux loss off): q/k/v biases, a dense first layer
/// (`mlp_only_layers = [0]`, dense ffn 96), then router softmax in fp32 over 4 experts of
/// ffn 48, top-2 weights not renormalised (renormalising moves the first loss by 0.31%), and
/// a shared expert of 80 scaled by sigmoid(x · w) (the gate moves it by 0.48%); every
/// token's top-2 / third router logit gap is at least 4e-3.
#[test]
fn qwen2_moe_matches_transformers() {
    golden("qwen2_moe");
}

/// Qwen2-MoE's state dict as transformers 5 holds it (experts fused into
/// `mlp.experts.gate_up_proj` and `down_proj`, beside the shared expert) loads with `--init`
/// and trains identically.
#[test]
fn qwen2_moe_fused_checkpoint_loads() {
    golden_with_init("qwen2_moe", "init_fused.safetensors");
}

/// transformers 5 saves Mixtral's experts fused (`mlp.experts.gate_up_proj`, `down_proj`);
/// `--init` accepts that layout too and trains identically.
#[test]
fn mixtral_fused_checkpoint_loads() {
    golden_with_init("mixtral", "init_fused.safetensors");
}

/// The mixed-precision reference of `tests/golden/make_golden_mixed.py` (PyTorch: bf16/fp16
/// working weights through transformers, fp32 main gradients, AdamW on fp32 master weights;
/// fp16 with a static loss scale). Tolerances from the format's unit roundoff u
/// (docs/precision.md): losses u/8, gradient norms u, final weights 2u per tensor (relative
/// 2-norm, with a floor of the 3 steps' movement for parameters that start at zero): the
/// reference's autograd rounds each micro-batch's weight gradient to 16 bits before it is
/// widened into the fp32 main gradient, which megac (as Megatron's fused gradient
/// accumulation) does not, one more rounding per gradient and step.
fn golden_mixed(name: &str, precision: &str) {
    let dir = fixture(name);
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("expected_{precision}.json"))).unwrap(),
    )
    .unwrap();
    let mut sets = vec![
        format!("train.precision=\"{precision}\""),
        format!("train.eps={}", expected["eps"].as_f64().unwrap()),
    ];
    if let Some(scale) = expected["loss_scale"].as_f64() {
        sets.push(format!("train.loss_scale={scale}"));
    }
    let plan = checked_plan(&dir, &sets);
    let u = if precision == "bf16" {
        2f64.powi(-8)
    } else {
        2f64.powi(-11)
    };
    let series = |k: &str| -> Vec<f64> {
        expected[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let (losses, norms) = (series("losses"), series("grad_norms"));
    let data = dir.join("tokens.bin");
    let init = dir.join("init.safetensors");
    let mut s = Session::new(&plan, data.to_str().unwrap(), Some(&init)).unwrap();
    let print = std::env::var_os("MEGAC_PRINT_ERRORS").is_some();
    for step in 1..=3u64 {
        let (loss, norm) = s.step(step).unwrap();
        let (want_loss, want_norm) = (losses[step as usize - 1], norms[step as usize - 1]);
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
        if print {
            eprintln!(
                "{name} {precision} step {step}: loss rel {:.2e} norm rel {:.2e}",
                rel(loss, want_loss),
                rel(norm, want_norm)
            );
        }
        assert!(
            rel(loss, want_loss) < u / 8.0,
            "{name} {precision} step {step}: loss {loss} vs the PyTorch reference {want_loss}"
        );
        assert!(
            rel(norm, want_norm) < u,
            "{name} {precision} step {step}: grad norm {norm} vs the PyTorch reference {want_norm}"
        );
    }
    let bytes = std::fs::read(dir.join(format!("final_{precision}.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // lr 1e-2 over 3 steps: a parameter that starts at zero is about this large.
    let floor = 3e-2f64;
    for p in &plan.params {
        if name == "gpt" && p.name == "lm_head.weight" {
            continue;
        }
        let want = read_f32(&st, &p.name);
        let got = s.mem.read_f32(p.buffer);
        assert_eq!(got.len(), want.len(), "{}", p.name);
        // The working weights are 16-bit values (an fp32 run's would not be).
        let kind = if precision == "bf16" {
            megac_kernels::Half::Bf16
        } else {
            megac_kernels::Half::F16
        };
        assert!(
            got.iter().all(|&x| kind.round(x) == x),
            "{name} {precision}: {} holds values that are not {precision}",
            p.name
        );
        let (mut diff2, mut norm2) = (0f64, 0f64);
        for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
            // GPT-2's key bias: a gradient of rounding noise only (see `golden`).
            if name == "gpt" && p.name.ends_with("attn.c_attn.bias") && (64..128).contains(&i) {
                continue;
            }
            diff2 += f64::from(a - b).powi(2);
            norm2 += f64::from(b).powi(2).max(floor * floor);
        }
        let rel = (diff2 / norm2).sqrt();
        if print {
            eprintln!("{name} {precision}: {} rel {rel:.2e}", p.name);
        }
        assert!(
            rel < 2.0 * u,
            "{name} {precision}: {} differs from the PyTorch reference by relative {rel:.2e}",
            p.name
        );
    }
}

#[test]
fn llama_bf16_matches_the_pytorch_reference() {
    golden_mixed("llama", "bf16");
}

#[test]
fn gpt_bf16_matches_the_pytorch_reference() {
    golden_mixed("gpt", "bf16");
}

#[test]
fn llama_fp16_matches_the_pytorch_reference() {
    golden_mixed("llama", "fp16");
}

#[test]
fn gpt_fp16_matches_the_pytorch_reference() {
    golden_mixed("gpt", "fp16");
}

// The families of issue 15 in bf16 (tests/golden/make_golden_mixed.py, MIXED_MODELS: not
// qwen2 and llama31, whose fixtures are too sensitive to bf16 rounding for a reference).

#[test]
fn qwen3_bf16_matches_the_pytorch_reference() {
    golden_mixed("qwen3", "bf16");
}

#[test]
fn mistral_bf16_matches_the_pytorch_reference() {
    golden_mixed("mistral", "bf16");
}

#[test]
fn qwen2_moe_bf16_matches_the_pytorch_reference() {
    golden_mixed("qwen2_moe", "bf16");
}
