//! The plan gate (`megac_ir::gate`): every compiled plan of every example and layout passes
//! it, and hand-mutated plans are rejected by the real binary with one error line naming the
//! JSON path and the values, a non-zero exit and no panic.

mod common;

use std::path::Path;

use common::{megac, stderr, stdout};
use megac_ir::gate::CheckedPlan;
use megac_ir::plan::Plan;

fn compile(file: &str, sets: &[&str]) -> Plan {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

/// Every layout the layout-equivalence and validator tests compile, on every example.
const LAYOUTS: &[(&str, &[&str])] = &[
    ("llama-tiny.toml", &[]),
    ("llama-tiny.toml", &["parallel.dp=2"]),
    ("llama-tiny.toml", &["parallel.tp=2"]),
    (
        "llama-tiny.toml",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    (
        "llama-tiny.toml",
        &[
            "parallel.tp=4",
            "parallel.sequence_parallel=true",
            "parallel.dp=2",
        ],
    ),
    ("llama-tiny.toml", &["parallel.cp=2"]),
    (
        "llama-tiny.toml",
        &["parallel.cp=2", "parallel.tp=2", "parallel.dp=2"],
    ),
    (
        "llama-tiny.toml",
        &["parallel.dp=2", "parallel.distributed_optimizer=true"],
    ),
    (
        "llama-tiny.toml",
        &[
            "parallel.tp=2",
            "parallel.dp=2",
            "parallel.sequence_parallel=true",
            "parallel.distributed_optimizer=true",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "parallel.cp=2",
            "parallel.dp=2",
            "parallel.distributed_optimizer=true",
        ],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=8", "parallel.pp=2", "parallel.schedule=gpipe"],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=8", "parallel.pp=4", "parallel.schedule=1f1b"],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=8", "parallel.pp=2", "parallel.schedule=zb-h1"],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=8", "parallel.pp=4", "parallel.schedule=zb-h1"],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=4",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            "parallel.dpp_policy=adaptive",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=4",
            "parallel.schedule=dpp",
            "parallel.dpp_policy=bfs",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.dp=2",
            "parallel.sequence_parallel=true",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            "parallel.tp=2",
            "parallel.cp=2",
        ],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=8", "parallel.pp=2", "parallel.fbd=true"],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=4",
            "parallel.fbd=true",
            "parallel.schedule=zb-h1",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=8",
            "parallel.pp=2",
            "parallel.fbd=true",
            "parallel.tp=2",
            "parallel.dp=2",
        ],
    ),
    ("gpt-tiny.toml", &[]),
    (
        "gpt-tiny.toml",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    (
        "gpt-tiny.toml",
        &["parallel.dp=2", "parallel.distributed_optimizer=true"],
    ),
    ("gpt-tiny.toml", &["parallel.cp=2"]),
    ("gpt-tiny.toml", &["parallel.tp=2", "parallel.pp=2"]),
    ("moe-tiny.toml", &[]),
    (
        "moe-tiny.toml",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    ("moe-tiny.toml", &["parallel.dp=2", "parallel.ep=2"]),
    ("moe-tiny.toml", &["parallel.dp=4", "parallel.ep=4"]),
    ("moe-tiny.toml", &["parallel.cp=2", "parallel.ep=2"]),
    (
        "moe-tiny.toml",
        &[
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
    ),
    (
        "moe-tiny.toml",
        &[
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.distributed_optimizer=true",
        ],
    ),
    ("moe-tiny.toml", &["model.moe.capacity_factor=1.0"]),
    (
        "moe-tiny.toml",
        &["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
    ),
];

#[test]
fn every_compiled_layout_passes_the_gate() {
    for (file, layout) in LAYOUTS {
        let mut sets = vec!["train.micro_batch=2", "train.global_batch=8"];
        sets.extend_from_slice(layout);
        let plan = compile(file, &sets);
        CheckedPlan::check(plan).unwrap_or_else(|e| panic!("{file} {layout:?}: {e}"));
    }
}

#[test]
fn every_example_at_its_own_size_passes_the_gate() {
    for file in ["llama-tiny.toml", "gpt-tiny.toml", "moe-tiny.toml"] {
        CheckedPlan::check(compile(file, &[])).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
}

/// Compile llama-tiny with the binary, apply `mutate` to plan.json, run 1 step and return the
/// error (stderr) after checking the exit code and that nothing panicked.
fn run_mutated(sets: &[&str], mutate: impl FnOnce(&mut serde_json::Value)) -> (String, String) {
    run_mutated_model("examples/llama-tiny.toml", sets, mutate)
}

/// [`run_mutated`] for another model.
fn run_mutated_model(
    model: &str,
    sets: &[&str],
    mutate: impl FnOnce(&mut serde_json::Value),
) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan");
    let out_s = out.to_str().unwrap();
    let mut args = vec!["compile", model, "-o", out_s];
    for s in sets {
        args.extend(["--set", s]);
    }
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let file = out.join("plan.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    mutate(&mut v);
    std::fs::write(&file, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let o = megac(&["run", out_s, "--steps", "1"]);
    let err = stderr(&o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "exit status {:?}: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "one error line: {err}");
    (err.trim_end().to_string(), file.display().to_string())
}

fn assert_rejects(sets: &[&str], mutate: impl FnOnce(&mut serde_json::Value), expected: &str) {
    let (err, file) = run_mutated(sets, mutate);
    assert_eq!(err, format!("error: {file}: {expected}"));
}

#[test]
fn rejects_a_loss_result_that_does_not_exist() {
    assert_rejects(
        &[],
        |v| v["roles"][0]["results"]["loss"] = 100000.into(),
        "roles[0].results.loss: buffer 100000 does not exist (the plan has 184 buffers)",
    );
}

#[test]
fn rejects_a_tokens_input_that_does_not_exist() {
    assert_rejects(
        &[],
        |v| v["roles"][0]["inputs"]["tokens"] = 100000.into(),
        "roles[0].inputs.tokens: buffer 100000 does not exist (the plan has 184 buffers)",
    );
}

#[test]
fn rejects_a_zero_micro_batch() {
    assert_rejects(
        &[],
        |v| v["batch"]["micro_batch"] = 0.into(),
        "batch.micro_batch: must be positive, got 0",
    );
}

#[test]
fn rejects_zero_micro_batches() {
    assert_rejects(
        &[],
        |v| v["batch"]["microbatches"] = 0.into(),
        "batch.microbatches: must be positive, got 0",
    );
}

#[test]
fn rejects_micro_batches_that_do_not_make_the_global_batch() {
    assert_rejects(
        &[],
        |v| v["batch"]["microbatches"] = 3.into(),
        "batch.microbatches: 3 micro-batches of 4 samples on 1 data-parallel rank(s) do not make the global batch of 8",
    );
}

#[test]
fn rejects_a_parameter_buffer_of_the_wrong_shape() {
    assert_rejects(
        &[],
        |v| v["buffers"][0]["shape"] = serde_json::json!([1, 1]),
        "params[0].buffer: buffer 0 (model.embed_tokens.weight) has 1 elements, but the rank's shard of [256, 64] has 16384",
    );
}

#[test]
fn rejects_a_buffer_outside_its_arena() {
    assert_rejects(
        &[],
        |v| v["buffers"][0]["offset"] = 1_000_000_000_000_000u64.into(),
        "buffers[0].offset: 16384 elements at offset 1000000000000000 do not fit the param arena of 123712 elements (494848 bytes) of role rank",
    );
}

#[test]
fn rejects_a_parameter_whose_buffer_does_not_exist() {
    assert_rejects(
        &[],
        |v| v["params"][0]["buffer"] = 99999.into(),
        "params[0].buffer: buffer 99999 does not exist (the plan has 184 buffers)",
    );
}

#[test]
fn rejects_a_parameter_pointing_at_a_gradient() {
    assert_rejects(
        &[],
        |v| v["params"][0]["buffer"] = 1.into(),
        "params[0].buffer: buffer 1 (grad:model.embed_tokens.weight) is grad f32, expected param f32",
    );
}

#[test]
fn rejects_a_truncated_micro_batch_program() {
    assert_rejects(
        &[],
        |v| {
            v["roles"][0]["microbatch"]
                .as_array_mut()
                .unwrap()
                .truncate(50)
        },
        "params[0].grad: buffer 1 (grad:model.embed_tokens.weight) is never written by the programs of role rank before its optimizer (a truncated program?)",
    );
}

#[test]
fn rejects_a_program_that_reads_an_activation_before_writing_it() {
    assert_rejects(
        &[],
        |v| {
            v["roles"][0]["microbatch"].as_array_mut().unwrap().remove(0);
        },
        "roles[0].microbatch[0].in[0]: reads activation buffer 86 (%3) before any instruction of the program writes it",
    );
}

#[test]
fn rejects_a_loss_no_program_writes() {
    assert_rejects(
        &[],
        |v| v["roles"][0]["results"]["loss"] = v["roles"][0]["results"]["grad_norm"].clone(),
        "roles[0].results.loss: buffer 183 is never written by the micro-batch program",
    );
}

#[test]
fn rejects_a_loss_that_is_not_a_scalar() {
    assert_rejects(
        &[],
        |v| v["roles"][0]["results"]["loss"] = 86.into(),
        "roles[0].results.loss: buffer 86 (%3) has shape [4, 64, 64]; results are scalars",
    );
}

#[test]
fn rejects_a_loss_that_is_not_a_cross_entropy() {
    // Another scalar the micro-batch program writes: a MoE layer's load-balancing loss.
    let mut found = None;
    let (err, file) = run_mutated_model("examples/moe-tiny.toml", &[], |v| {
        let program = v["roles"][0]["microbatch"].as_array().unwrap();
        let (i, b) = program
            .iter()
            .enumerate()
            .filter(|(_, i)| i["op"] != "cross_entropy")
            .find_map(|(k, i)| {
                let b = i["out"].as_array()?.first()?.as_u64()?;
                let shape = v["buffers"][b as usize]["shape"].as_array()?;
                shape.is_empty().then_some((k, b))
            })
            .unwrap();
        let (op, name) = (
            program[i]["op"].as_str().unwrap().to_string(),
            v["buffers"][b as usize]["name"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        found = Some((i, b, op, name));
        v["roles"][0]["results"]["loss"] = b.into();
    });
    let (i, b, op, name) = found.unwrap();
    assert_eq!(
        err,
        format!(
            "error: {file}: roles[0].results.loss: buffer {b} ({name}) is last written by roles[0].microbatch[{i}] (`{op}`), not by a cross_entropy"
        )
    );
}

#[test]
fn rejects_a_kernel_with_a_wrong_shape() {
    assert_rejects(
        &[],
        |v| {
            let i = &mut v["roles"][0]["microbatch"][0];
            i["out"] = serde_json::json!([1]);
        },
        "roles[0].microbatch[0] (embedding model.embed_tokens): the output (buffer 1, grad:model.embed_tokens.weight) has shape [256, 64], expected [4, 64, 64]",
    );
}

#[test]
fn the_gate_rejects_a_plan_for_every_command_that_reads_one() {
    // check-plan and inspect read plans through the same gate.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan");
    let out_s = out.to_str().unwrap();
    assert!(megac(&["compile", "examples/llama-tiny.toml", "-o", out_s])
        .status
        .success());
    let file = out.join("plan.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    v["batch"]["micro_batch"] = 0.into();
    std::fs::write(&file, serde_json::to_string(&v).unwrap()).unwrap();
    for cmd in ["check-plan", "inspect"] {
        let o = megac(&[cmd, out_s]);
        assert_eq!(o.status.code(), Some(1), "{cmd}");
        assert_eq!(stdout(&o), "", "{cmd}");
        assert_eq!(
            stderr(&o).trim_end(),
            format!(
                "error: {}: batch.micro_batch: must be positive, got 0",
                file.display()
            ),
            "{cmd}"
        );
    }
}
