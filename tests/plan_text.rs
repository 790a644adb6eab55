//! The plan's text form (`megac_ir::print_plan`, `megac inspect PLAN_DIR --program`):
//! snapshots of the tiny examples, pipelined layouts and a tp·dp layout with the distributed
//! optimizer (`tests/snapshots/plan_text__*.snap`,
//! reviewed with `cargo insta review`), the same text from the binary after a round trip
//! through `plan.json`, and the same bytes on every print.

use std::path::Path;
use std::process::Command;

use megac_ir::plan::Plan;
use megac_ir::print_plan;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Compile as `megac compile` does.
fn plan(file: &str, sets: &[&str]) -> Plan {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&root().join(file), &sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

/// Snapshot name, example, `--set` overrides.
const CASES: [(&str, &str, &[&str]); 6] = [
    ("llama-tiny", "examples/llama-tiny.toml", &[]),
    ("gpt-tiny", "examples/gpt-tiny.toml", &[]),
    ("moe-tiny", "examples/moe-tiny.toml", &[]),
    (
        "llama-tiny_pp2",
        "examples/llama-tiny.toml",
        &["parallel.pp=2"],
    ),
    (
        "llama-tiny_pp2_zb",
        "examples/llama-tiny.toml",
        &[
            "parallel.pp=2",
            "parallel.schedule=\"zb-h1\"",
            "train.micro_batch=2",
        ],
    ),
    (
        "llama-tiny_tp2_dp2_zero1",
        "examples/llama-tiny.toml",
        &[
            "parallel.tp=2",
            "parallel.dp=2",
            "parallel.distributed_optimizer=true",
        ],
    ),
];

#[test]
fn snapshot_the_plans_of_the_tiny_examples() {
    for (name, file, sets) in CASES {
        let text = print_plan(&plan(file, sets));
        insta::assert_snapshot!(name, text);
    }
}

#[test]
fn pipelined_text_has_every_chunk_program_and_the_actions() {
    let text = print_plan(&plan("examples/llama-tiny.toml", &["parallel.pp=2"]));
    for line in [
        "role 0 \"stage0\" ranks=0",
        "role 1 \"stage1\" ranks=1",
        "  chunk 0 layers=0..1",
        "  chunk 1 layers=1..2",
        "    forward (",
        "    backward (",
        "    weight (",
        "  actions (4)",
    ] {
        assert!(text.contains(line), "no `{line}` in\n{text}");
    }
    assert!(text.contains(" = recv from chunk=0 transfer=0"), "{text}");
    assert!(text.contains("send "), "{text}");
}

#[test]
fn printing_is_deterministic_and_survives_plan_json() {
    let plan = plan("examples/moe-tiny.toml", &[]);
    let text = print_plan(&plan);
    assert_eq!(text, print_plan(&plan.clone()));
    let back = Plan::parse_json(&plan.to_json()).expect("parse plan.json");
    assert_eq!(text, print_plan(&back));
}

#[test]
fn inspect_program_prints_the_text_form() {
    let dir = tempfile::tempdir().unwrap();
    let megac = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_megac"))
            .args(args)
            .current_dir(root())
            .output()
            .expect("run megac");
        assert!(
            out.status.success(),
            "megac {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let plan_dir = dir.path().join("plan");
    let plan_dir = plan_dir.to_str().unwrap();
    megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.pp=2",
        "-o",
        plan_dir,
    ]);
    let text = megac(&["inspect", plan_dir, "--program"]);
    assert_eq!(
        text,
        print_plan(&plan("examples/llama-tiny.toml", &["parallel.pp=2"]))
    );
}
