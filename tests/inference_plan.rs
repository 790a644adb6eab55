//! Inference plans (`megac compile --inference`, what `megac generate` and `megac scope`
//! compile): the forward only, no gradient or optimizer memory, checked by the plan gate;
//! the gate rejects an inference plan that keeps training state and a training plan that
//! lacks it; `megac run` refuses an inference plan with one error.

mod common;

use std::path::Path;

use common::{megac, stderr, stdout};
use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufferClass, Plan, PlanKind};

fn example(file: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file)
}

fn compile(file: &str, sets: &[&str], kind: PlanKind) -> Plan {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec =
        megac_frontend::load(&example(file), &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    match kind {
        PlanKind::Train => {
            let m = megac_passes::run_pipeline(spec, None, true).unwrap();
            megac_codegen::emit_plan(&m.spec, m.graph.as_ref().unwrap(), flops)
        }
        PlanKind::Inference => {
            let m = megac_passes::run_inference_pipeline(spec).unwrap();
            megac_codegen::emit_inference_plan(&m.spec, m.graph.as_ref().unwrap(), flops)
        }
    }
    .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

const LAYOUTS: &[(&str, &[&str])] = &[
    ("llama-tiny.toml", &[]),
    ("llama-tiny.toml", &["parallel.dp=2"]),
    (
        "llama-tiny.toml",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    ("llama-tiny.toml", &["parallel.pp=2"]),
    ("llama-tiny.toml", &["parallel.pp=2", "parallel.tp=2"]),
    ("gpt-tiny.toml", &["parallel.pp=2"]),
    (
        "moe-tiny.toml",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
];

/// Every layout's inference plan passes the gate and holds no gradient or optimizer state;
/// its parameters and their shards are the training plan's, and it needs less memory.
#[test]
fn inference_plans_have_no_training_state() {
    for &(file, sets) in LAYOUTS {
        let train = compile(file, sets, PlanKind::Train);
        let plan = compile(file, sets, PlanKind::Inference);
        assert_eq!(plan.kind, PlanKind::Inference);
        let plan = CheckedPlan::check(plan).unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
        let what = format!("{file} {sets:?}");
        assert!(
            plan.buffers
                .iter()
                .all(|b| !matches!(b.class, BufferClass::Grad | BufferClass::OptState)),
            "{what}"
        );
        for m in
            std::iter::once(&plan.memory).chain(plan.roles.iter().filter_map(|r| r.memory.as_ref()))
        {
            assert_eq!((m.grad_bytes, m.opt_state_bytes), (0, 0), "{what}");
        }
        assert!(plan.memory.total() < train.memory.total(), "{what}");
        assert!(plan.roles.iter().all(|r| r.optimizer.is_empty()), "{what}");
        assert_eq!(plan.params.len(), train.params.len(), "{what}");
        for (p, q) in plan.params.iter().zip(&train.params) {
            assert_eq!(
                (&p.name, &p.shape, &p.shards),
                (&q.name, &q.shape, &q.shards)
            );
            assert_eq!(p.grad, None, "{what}: {}", p.name);
            assert!(p.exp_avg.is_none() && p.exp_avg_sq.is_none() && p.master.is_none());
            assert_eq!(
                plan.buffers[p.buffer as usize].shape, train.buffers[q.buffer as usize].shape,
                "{what}: {}",
                p.name
            );
        }
        for role in &plan.roles {
            for chunk in role.pipeline.iter().flat_map(|p| &p.chunks) {
                assert!(
                    chunk.backward.is_empty() && chunk.weight.is_empty(),
                    "{what}"
                );
            }
            for a in role.pipeline.iter().flat_map(|p| &p.actions) {
                assert_eq!(a.kind, megac_ir::plan::PipeKind::F, "{what}");
            }
        }
    }
}

/// The gate keeps the kinds apart: a training plan relabelled as an inference plan, an
/// inference plan given back a gradient, and a training plan without its gradients are
/// each one error naming the field.
#[test]
fn gate_checks_the_plan_kind() {
    let mut train = compile("llama-tiny.toml", &[], PlanKind::Train);
    train.kind = PlanKind::Inference;
    let err = CheckedPlan::check(train.clone()).unwrap_err().to_string();
    assert!(
        err.starts_with("params[0].grad: an inference plan keeps no gradients"),
        "{err}"
    );

    let mut plan = compile("llama-tiny.toml", &[], PlanKind::Inference);
    plan.kind = PlanKind::Train;
    let err = CheckedPlan::check(plan.clone()).unwrap_err().to_string();
    assert!(
        err.starts_with("params[0].grad: a training plan's parameter needs a gradient buffer"),
        "{err}"
    );

    // An inference plan with an optimizer instruction.
    plan.kind = PlanKind::Inference;
    plan.roles[0].optimizer.push(megac_ir::plan::Instr::Zero {
        buffer: plan.params[0].buffer,
    });
    let err = CheckedPlan::check(plan).unwrap_err().to_string();
    assert!(
        err.starts_with("roles[0].optimizer: an inference plan has no optimizer program"),
        "{err}"
    );
}

/// `megac compile --inference` writes the plan, `megac inspect` shows its kind and empty
/// gradient and optimizer arenas, and `megac run` refuses it with one error.
#[test]
fn compile_inference_and_refuse_training() {
    let dir = std::env::temp_dir().join(format!("megac-inference-plan-{}", std::process::id()));
    let model = example("llama-tiny.toml");
    let o = megac(&[
        "compile",
        model.to_str().unwrap(),
        "--inference",
        "-o",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(dir.join("plan.json")).unwrap();
    assert!(text.contains("\"kind\":\"inference\"") || text.contains("\"kind\": \"inference\""));

    let o = megac(&["inspect", dir.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kind"], "inference");
    let mem = &v["roles"][0]["memory_bytes"];
    assert_eq!(mem["gradients"].as_u64(), Some(0));
    assert_eq!(mem["optimizer_state"].as_u64(), Some(0));
    assert_eq!(mem["parameters"].as_u64(), Some(123_712 * 4));
    let o = megac(&["inspect", dir.to_str().unwrap()]);
    assert!(
        stdout(&o).contains("kind         inference"),
        "{}",
        stdout(&o)
    );

    let o = megac(&["run", dir.to_str().unwrap(), "--steps", "1"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("this is an inference plan"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
