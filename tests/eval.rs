//! Held-out evaluation and run logs.
//!
//! - The eval loss of a layout equals the single-device eval loss (fp32: relative 1e-5; bf16:
//!   the layout tolerance of tests/layouts.rs) in tp+sp, pp (1f1b, interleaved, zb-h1, dpp,
//!   FBD), dp with the distributed optimizer, cp, and MoE with ep; and a run with evaluation
//!   trains exactly as one without (losses, grad norms and final parameters bit for bit).
//! - An independent check of the number: with the training file shifted by `s` global
//!   batches as eval data, the eval after step `s` is the training loss of step `s + 1`
//!   (the same forward on the same weights and samples), in one device, pp and dp.
//! - `megac eval` on weights saved after step `s` (`--save-params`, a checkpoint, and the
//!   checkpoint resharded to tp2) gives the loss of step `s + 1`.
//! - Log lines (stdout a pipe), `--log FILE.jsonl`, the summary's interval mean; bad input.

mod common;

use std::path::{Path, PathBuf};

use common::{megac, stderr, stdout};
use megac_runtime::eval::{EvalOptions, EvalRecord};
use megac_runtime::train::{train, RunOptions, RunReport};

fn plan(file: &str, sets: &[&str]) -> megac_ir::gate::CheckedPlan {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    megac_ir::gate::CheckedPlan::check(plan).unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

/// Seeded token ids below 256 (every example's vocabulary), `windows` samples of
/// `seq_len + 1` tokens, as a `.bin` file.
fn token_file(dir: &Path, name: &str, windows: usize, seq_len: usize, seed: u64) -> PathBuf {
    let mut x = seed;
    let tokens: Vec<u32> = (0..windows * (seq_len + 1))
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % 256) as u32
        })
        .collect();
    write_tokens(dir, name, &tokens)
}

fn write_tokens(dir: &Path, name: &str, tokens: &[u32]) -> PathBuf {
    let path = dir.join(name);
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

fn read_tokens(path: &Path) -> Vec<u32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// What a run leaves: its report and its final parameters.
struct Run {
    report: RunReport,
    params: Vec<Vec<f32>>,
}

/// `steps` steps of `file` with `sets` on `data`, evaluating with `eval` (None: none).
fn run(file: &str, sets: &[&str], steps: u64, data: &Path, eval: Option<EvalOptions>) -> Run {
    let plan = plan(file, sets);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("final.safetensors");
    let opts = RunOptions {
        steps: Some(steps),
        data: data.to_str().unwrap().into(),
        save_params: Some(out.clone()),
        progress: Some(false),
        log_lines: Some(false),
        eval,
        ..Default::default()
    };
    let report = train(&plan, &opts).unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    let mut expected: Vec<(String, Vec<usize>)> = plan
        .hf_tensors()
        .into_iter()
        .map(|(name, shape)| (name, shape.iter().map(|&d| d as usize).collect()))
        .collect();
    expected.sort();
    let tied = !plan.params.iter().any(|p| p.name == "lm_head.weight");
    let params = megac_runtime::hf::load_params(&out, &expected, tied).unwrap();
    Run { report, params }
}

fn every_step(data: &Path, iters: u64) -> Option<EvalOptions> {
    Some(EvalOptions {
        data: data.to_str().unwrap().into(),
        interval: Some(1),
        iters,
    })
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// Each layout: its evals match the reference's within `tol`, and it trains bit for bit as
/// the same layout without evaluation.
fn assert_layouts(file: &str, base: &[&str], layouts: &[&[&str]], tol: f64) {
    let dir = tempfile::tempdir().unwrap();
    let train_data = token_file(dir.path(), "train.bin", 64, 64, 1);
    let eval_data = token_file(dir.path(), "eval.bin", 64, 64, 2);
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let reference = run(file, base, 2, &train_data, every_step(&eval_data, 2));
    let ref_evals: Vec<&EvalRecord> = reference.report.evals.iter().collect();
    assert_eq!(ref_evals.iter().map(|e| e.step).collect::<Vec<_>>(), [1, 2]);
    for layout in layouts {
        let sets = with(layout);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let evaluated = run(file, &sets, 2, &train_data, every_step(&eval_data, 2));
        for (e, r) in evaluated.report.evals.iter().zip(&ref_evals) {
            assert_eq!((e.step, e.batches), (r.step, r.batches));
            assert!(
                rel(e.loss, r.loss) <= tol,
                "{file} {layout:?}: eval after step {}: {} vs one device {} (rel {:e})",
                e.step,
                e.loss,
                r.loss,
                rel(e.loss, r.loss)
            );
        }
        assert_eq!(evaluated.report.evals.len(), ref_evals.len());
        // Evaluation changes nothing: the same layout without it trains identically.
        let plain = run(file, &sets, 2, &train_data, None);
        let a: Vec<(f64, f64)> = evaluated
            .report
            .steps
            .iter()
            .map(|s| (s.loss, s.grad_norm))
            .collect();
        let b: Vec<(f64, f64)> = plain
            .report
            .steps
            .iter()
            .map(|s| (s.loss, s.grad_norm))
            .collect();
        assert_eq!(a, b, "{file} {layout:?}: evaluation changed the training");
        assert!(
            evaluated.params == plain.params,
            "{file} {layout:?}: evaluation changed the final parameters"
        );
        assert!(plain.report.evals.is_empty());
    }
}

const BASE: &[&str] = &["train.micro_batch=2", "train.global_batch=8"];
const PIPE: &[&str] = &[
    "train.micro_batch=2",
    "train.global_batch=8",
    "model.layers=4",
];
const FP32: f64 = 1e-5;

#[test]
fn eval_in_tensor_data_and_context_parallel_layouts() {
    assert_layouts(
        "llama-tiny.toml",
        BASE,
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
            &["parallel.cp=2"],
        ],
        FP32,
    );
}

#[test]
fn eval_in_pipeline_schedules() {
    assert_layouts(
        "llama-tiny.toml",
        PIPE,
        &[
            &["parallel.pp=2"],
            &[
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.schedule=interleaved",
            ],
            &["parallel.pp=2", "parallel.schedule=zb-h1"],
            &["parallel.pp=2", "parallel.fbd=true"],
            &["parallel.pp=2", "parallel.tp=2", "parallel.dp=2"],
        ],
        FP32,
    );
}

/// GPT-2's tied word embeddings (a copy on the last stage) and MoE layers split over stages.
#[test]
fn eval_in_pipelines_with_tied_embeddings_and_moe() {
    assert_layouts(
        "gpt-tiny.toml",
        BASE,
        &[&["parallel.pp=2"], &["parallel.pp=2", "parallel.fbd=true"]],
        FP32,
    );
    assert_layouts(
        "moe-tiny.toml",
        BASE,
        &[
            &["parallel.pp=2"],
            &["parallel.pp=2", "parallel.schedule=zb-h1"],
        ],
        FP32,
    );
}

/// MegaDPP picks its order at run time (so its training is compared within tolerance in
/// tests/layouts.rs, not bit for bit across runs); its evaluation follows the reference
/// order.
#[test]
fn eval_under_dynamic_pipeline_parallelism() {
    let dir = tempfile::tempdir().unwrap();
    let train_data = token_file(dir.path(), "train.bin", 64, 64, 1);
    let eval_data = token_file(dir.path(), "eval.bin", 64, 64, 2);
    let reference = run(
        "llama-tiny.toml",
        PIPE,
        2,
        &train_data,
        every_step(&eval_data, 2),
    );
    let mut sets = PIPE.to_vec();
    sets.extend(["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=dpp"]);
    let dpp = run(
        "llama-tiny.toml",
        &sets,
        2,
        &train_data,
        every_step(&eval_data, 2),
    );
    for (e, r) in dpp.report.evals.iter().zip(&reference.report.evals) {
        assert!(rel(e.loss, r.loss) <= FP32, "{} vs {}", e.loss, r.loss);
    }
    assert_eq!(dpp.report.evals.len(), 2);
}

#[test]
fn eval_in_expert_parallel_moe() {
    assert_layouts(
        "moe-tiny.toml",
        BASE,
        &[
            &["parallel.dp=2", "parallel.ep=2"],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
        ],
        FP32,
    );
}

/// bf16: the layout tolerance of the loss in tests/layouts.rs (u/8, u = 2^-8).
#[test]
fn eval_in_bf16_layouts() {
    let base = [BASE, &["train.precision=\"bf16\"", "train.eps=1e-2"]].concat();
    assert_layouts(
        "llama-tiny.toml",
        &base,
        &[
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
            &["parallel.pp=2"],
        ],
        2f64.powi(-8) / 8.0,
    );
}

/// The training file shifted by `shift` windows (sample `i` of the result is sample
/// `i + shift` of `data`).
fn shifted(dir: &Path, data: &Path, shift: usize, seq_len: usize) -> PathBuf {
    let tokens = read_tokens(data);
    write_tokens(dir, "shifted.bin", &tokens[shift * (seq_len + 1)..])
}

/// With the training data shifted by `s` global batches as eval data, the eval after step
/// `s` runs the forward of step `s + 1`: the same weights, the same samples. The numbers
/// must be identical (the same instructions on the same values in the same order).
#[test]
fn eval_after_step_s_is_the_loss_of_step_s_plus_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = token_file(dir.path(), "train.bin", 64, 64, 3);
    let s = 2;
    let eval_data = shifted(dir.path(), &data, s * 8, 64);
    for (file, sets) in [
        ("llama-tiny.toml", BASE.to_vec()),
        ("llama-tiny.toml", [PIPE, &["parallel.pp=2"]].concat()),
        (
            "llama-tiny.toml",
            [BASE, &["parallel.dp=2", "parallel.tp=2"]].concat(),
        ),
        (
            "moe-tiny.toml",
            [BASE, &["parallel.dp=2", "parallel.ep=2"]].concat(),
        ),
    ] {
        let eval = Some(EvalOptions {
            data: eval_data.to_str().unwrap().into(),
            interval: Some(s as u64),
            iters: 1,
        });
        let r = run(file, &sets, s as u64 + 1, &data, eval).report;
        // After step s (the interval) and after the last step.
        assert_eq!(
            r.evals.iter().map(|e| e.step).collect::<Vec<_>>(),
            [s as u64, s as u64 + 1]
        );
        assert_eq!(
            r.evals[0].loss,
            r.steps[s].loss,
            "{file} {sets:?}: the eval after step {s} is not step {}'s loss",
            s + 1
        );
    }
}

fn report_of(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn eval_json(args: &[&str]) -> serde_json::Value {
    let o = megac(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)))
}

/// `megac eval` of the weights after step 2 (saved as safetensors or as a checkpoint,
/// evaluated in the saving layout and resharded to tp2) on samples 16..23 is the training
/// loss of step 3.
#[test]
fn megac_eval_of_saved_weights_is_the_next_step_loss() {
    let dir = tempfile::tempdir().unwrap();
    let data = token_file(dir.path(), "train.bin", 40, 64, 4);
    let next = shifted(dir.path(), &data, 16, 64);
    let (report, ckpt) = (dir.path().join("r.json"), dir.path().join("ckpt"));
    let params = dir.path().join("w").join("model.safetensors");
    let model = "examples/llama-tiny.toml";
    let o = megac(&[
        "train",
        model,
        "--steps",
        "3",
        "--data",
        data.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
        "--save",
        ckpt.to_str().unwrap(),
        "--save-interval",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let step3 = report_of(&report)["steps"][2]["loss"].as_f64().unwrap();
    let o = megac(&[
        "train",
        model,
        "--steps",
        "2",
        "--data",
        data.to_str().unwrap(),
        "--save-params",
        params.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let next = next.to_str().unwrap();
    let common = ["--data", next, "--iters", "1", "--format", "json"];
    let with = |init: &str, extra: &[&'static str]| -> Vec<String> {
        ["eval", model, "--init", init]
            .iter()
            .chain(&common)
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let step2 = ckpt.join("step-000002");
    for (init, extra, tol) in [
        (params.to_str().unwrap(), &[][..], 0.0),
        (step2.to_str().unwrap(), &[][..], 0.0),
        (
            step2.to_str().unwrap(),
            &["--set", "parallel.tp=2"][..],
            FP32,
        ),
    ] {
        let args = with(init, extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let j = eval_json(&args);
        let loss = j["loss"].as_f64().unwrap();
        assert!(
            rel(loss, step3) <= tol,
            "{init} {extra:?}: eval {loss} vs step 3 {step3}"
        );
        assert_eq!(j["batches"], 1);
        assert_eq!(j["samples"], 8);
        assert_eq!(j["tokens"], 8 * 64);
        assert!((j["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9 * loss.exp());
        if init.contains("step-") {
            assert_eq!(j["checkpoint_step"], 2);
        }
    }
    // Without --iters: every whole global batch of the file (40 - 16 = 24 samples: 3),
    // their mean; the text form prints loss and perplexity.
    let j = eval_json(&[
        "eval",
        model,
        "--init",
        params.to_str().unwrap(),
        "--data",
        next,
        "--format",
        "json",
    ]);
    let losses: Vec<f64> = j["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 3);
    assert_eq!(losses[0], step3);
    let mean = losses.iter().sum::<f64>() / 3.0;
    assert!(rel(j["loss"].as_f64().unwrap(), mean) < 1e-12);
    let o = megac(&[
        "eval",
        model,
        "--init",
        params.to_str().unwrap(),
        "--data",
        next,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.starts_with("eval llama-tiny on ")
            && text.contains(&format!("loss {:.4}, perplexity {:.3}", mean, mean.exp())),
        "{text}"
    );
}

#[test]
fn megac_eval_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let model = "examples/llama-tiny.toml";
    let missing = dir.path().join("none.safetensors");
    for (args, want) in [
        (
            vec![
                "eval",
                model,
                "--init",
                missing.to_str().unwrap(),
                "--data",
                "synthetic",
                "--iters",
                "1",
            ],
            "none.safetensors",
        ),
        (
            vec![
                "eval",
                model,
                "--init",
                missing.to_str().unwrap(),
                "--data",
                "synthetic",
            ],
            "give --iters K",
        ),
        (
            vec![
                "eval",
                model,
                "--init",
                missing.to_str().unwrap(),
                "--data",
                "synthetic",
                "--iters",
                "0",
            ],
            "--iters 0",
        ),
        (
            vec![
                "eval",
                model,
                "--init",
                missing.to_str().unwrap(),
                "--data",
                "synthetic",
                "--format",
                "xml",
            ],
            "--format xml",
        ),
        (
            vec![
                "eval",
                model,
                "--init",
                dir.path().to_str().unwrap(),
                "--data",
                "synthetic",
                "--iters",
                "1",
            ],
            "checkpoint",
        ),
    ] {
        let o = megac(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.starts_with("error: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A log line: `step S/N | loss L | grad norm G | lr R | T tok/s | elapsed E | ETA A`.
fn parse_log_line(line: &str) -> (u64, f64, f64, f64) {
    let fields: Vec<&str> = line.split(" | ").collect();
    assert_eq!(fields.len(), 7, "{line}");
    let value = |i: usize, key: &str| -> &str {
        fields[i]
            .strip_prefix(key)
            .unwrap_or_else(|| panic!("{line}: field {i} is not `{key}...`"))
    };
    let step = value(0, "step ")
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let loss = value(1, "loss ").parse().unwrap();
    let grad = value(2, "grad norm ").parse().unwrap();
    let lr = value(3, "lr ").parse().unwrap();
    assert!(value(4, "").ends_with(" tok/s"), "{line}");
    let clock = |s: &str| s.len() >= 7 && s.split(':').count() == 3;
    assert!(
        clock(value(5, "elapsed ")) && clock(value(6, "ETA ")),
        "{line}"
    );
    (step, loss, grad, lr)
}

/// stdout a pipe: a log line every --log-interval steps with the interval's mean loss, an
/// eval line per evaluation, the summary's mean of the last interval; `--log` has one JSON
/// object per step and per evaluation, equal to the report.
#[test]
fn log_lines_and_jsonl_when_stdout_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let data = token_file(dir.path(), "train.bin", 64, 64, 5);
    let eval = token_file(dir.path(), "eval.bin", 16, 64, 6);
    let (report, log) = (
        dir.path().join("r.json"),
        dir.path().join("logs").join("run.jsonl"),
    );
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "7",
        "--data",
        data.to_str().unwrap(),
        "--log-interval",
        "3",
        "--eval-data",
        eval.to_str().unwrap(),
        "--eval-interval",
        "3",
        "--eval-iters",
        "2",
        "--report",
        report.to_str().unwrap(),
        "--log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r = report_of(&report);
    let steps = r["steps"].as_array().unwrap();
    let loss = |s: usize| steps[s - 1]["loss"].as_f64().unwrap();
    let out = stdout(&o);
    let logged: Vec<(u64, f64, f64, f64)> = out
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(parse_log_line)
        .collect();
    assert_eq!(
        logged.iter().map(|l| l.0).collect::<Vec<_>>(),
        [3, 6],
        "{out}"
    );
    for &(step, mean, grad, lr) in &logged {
        let s = step as usize;
        let want = (loss(s - 2) + loss(s - 1) + loss(s)) / 3.0;
        assert!((mean - want).abs() <= 5e-5, "{out}: mean {want}");
        let g = steps[s - 1]["grad_norm"].as_f64().unwrap();
        assert!((grad - g).abs() <= 5e-4 * g.max(1.0), "{out}");
        assert_eq!(lr, steps[s - 1]["lr"].as_f64().unwrap(), "{out}");
    }
    let evals = r["evals"].as_array().unwrap();
    let eval_lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("eval step "))
        .collect();
    assert_eq!(eval_lines.len(), 3, "{out}");
    for (line, e) in eval_lines.iter().zip(evals) {
        let (s, l) = (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap());
        assert!(
            line.starts_with(&format!(
                "eval step {s}/7 | loss {l:.4} | ppl {:.2} | 2 batches | ",
                l.exp()
            )),
            "{line}"
        );
    }
    assert_eq!(
        evals
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [3, 6, 7]
    );
    // The summary: the last interval of 3 is step 7 alone.
    let mean7 = format!("loss {:.4} -> {:.4} (step 7)", loss(1), loss(7));
    assert!(out.contains(&mean7), "{out}");
    assert!(
        out.contains(&format!(
            "eval loss {:.4}",
            evals[2]["loss"].as_f64().unwrap()
        )),
        "{out}"
    );
    // The JSON lines: 7 steps and 3 evaluations in run order, values as in the report.
    let text = std::fs::read_to_string(&log).unwrap();
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<String> = records
        .iter()
        .map(|j| format!("{}{}", j["kind"].as_str().unwrap(), j["step"]))
        .collect();
    assert_eq!(
        kinds,
        [
            "step1", "step2", "step3", "eval3", "step4", "step5", "step6", "eval6", "step7",
            "eval7"
        ]
    );
    let mut last_elapsed = 0.0;
    for j in records.iter().filter(|j| j["kind"] == "step") {
        let s = &steps[j["step"].as_u64().unwrap() as usize - 1];
        for key in ["loss", "grad_norm", "lr"] {
            assert_eq!(j[key], s[key], "{j}");
        }
        assert!(j["tokens_per_s"].as_f64().unwrap() > 0.0);
        let elapsed = j["elapsed"].as_f64().unwrap();
        assert!(elapsed >= last_elapsed, "{text}");
        last_elapsed = elapsed;
        assert!(j.get("skipped").is_none(), "fp32 has no skipped steps: {j}");
    }
    for (j, e) in records.iter().filter(|j| j["kind"] == "eval").zip(evals) {
        assert_eq!(j["loss"], e["loss"]);
        assert_eq!(j["batches"], 2);
    }
}

/// fp16's dynamic scaler skips the first steps: the JSON lines and the log lines say so.
#[test]
fn fp16_skipped_steps_in_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("run.jsonl");
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "4",
        "--set",
        "train.precision=\"fp16\"",
        "--log-interval",
        "2",
        "--log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 4);
    // Megatron's initial scale 2^32 overflows on the first two steps (tests/mixed_precision.rs).
    for (j, skipped) in records.iter().zip([true, true]) {
        assert_eq!(j["skipped"], skipped, "{j}");
        assert!(
            j["grad_norm"].is_null() && j["loss_scale"].as_f64().is_some(),
            "{j}"
        );
    }
    let out = stdout(&o);
    let first = out
        .lines()
        .find(|l| l.starts_with("step 2/4 "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(first.ends_with(" | skipped 2"), "{first}");
}

#[test]
fn a_terminal_free_run_without_log_options_logs_every_10_steps() {
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "12",
        "--set",
        "model.layers=1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(lines[0].starts_with("step 10/12 | loss "), "{out}");
    // The summary's loss is the mean of steps 11 and 12.
    assert!(out.contains("(mean of steps 11-12)"), "{out}");
}

#[test]
fn run_options_of_evaluation_and_logging_refuse_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let model = "examples/llama-tiny.toml";
    let missing = dir.path().join("none.bin");
    let d = dir.path().to_str().unwrap();
    for (args, want) in [
        (
            vec![
                "train",
                model,
                "--steps",
                "1",
                "--eval-data",
                missing.to_str().unwrap(),
            ],
            "none.bin",
        ),
        (
            vec![
                "train",
                model,
                "--steps",
                "1",
                "--eval-data",
                "synthetic",
                "--eval-interval",
                "0",
            ],
            "--eval-interval 0",
        ),
        (
            vec![
                "train",
                model,
                "--steps",
                "1",
                "--eval-data",
                "synthetic",
                "--eval-iters",
                "0",
            ],
            "--eval-iters 0",
        ),
        (
            vec!["train", model, "--steps", "1", "--log-interval", "0"],
            "--log-interval 0",
        ),
        (
            vec!["train", model, "--steps", "1", "--log", d],
            "is a directory",
        ),
    ] {
        let o = megac(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            !stdout(&o).contains("step 1"),
            "{args:?}: trained before refusing"
        );
    }
    // --eval-interval without --eval-data is a usage error.
    let o = megac(&["train", model, "--steps", "1", "--eval-interval", "2"]);
    assert_eq!(o.status.code(), Some(2));
}
