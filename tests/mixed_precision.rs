//! Mixed precision end to end: fp16's dynamic loss scaler (Megatron's rule, skipped steps
//! reported), and the arenas of bf16 plans as Megatron spends memory (2-byte working
//! weights, 4-byte gradients, 12 bytes of master weights and moments per parameter, the
//! latter sharded by the distributed optimizer). The numerics against the PyTorch reference
//! are in tests/golden.rs, the layouts against one device in tests/layouts.rs.

mod common;

use common::{megac, stderr, stdout};

fn plan(file: &str, sets: &[&str]) -> megac_ir::plan::Plan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&path, &sets).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, false).unwrap();
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap()
}

/// Megatron's `DynamicGradScaler.update`, written out independently of the runtime's.
fn next_scale(scale: f64, hyst: &mut u64, growth: &mut u64, overflow: bool) -> f64 {
    if overflow {
        *growth = 0;
        *hyst = hyst.saturating_sub(1);
        if *hyst == 0 {
            return (scale / 2.0).max(1.0);
        }
        scale
    } else {
        *growth += 1;
        if *growth == 1000 {
            *growth = 0;
            *hyst = 2;
            return scale * 2.0;
        }
        scale
    }
}

#[test]
fn fp16_dynamic_loss_scaler_skips_overflowing_steps_and_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "16",
        "--set",
        "train.precision=\"fp16\"",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let steps = r["steps"].as_array().unwrap();
    // Megatron's initial scale 2^32 overflows fp16 on the first steps; the scale then
    // follows the rule step by step from the reported overflows.
    let (mut scale, mut hyst, mut growth) = (2f64.powi(32), 2, 0);
    let mut skipped = 0;
    for s in steps {
        assert_eq!(s["loss_scale"].as_f64().unwrap(), scale, "{s}");
        let overflow = s["skipped"].as_bool().unwrap();
        // A skipped step is exactly one whose gradient norm is not finite (null in JSON).
        assert_eq!(overflow, s["grad_norm"].as_f64().is_none(), "{s}");
        skipped += usize::from(overflow);
        scale = next_scale(scale, &mut hyst, &mut growth, overflow);
    }
    assert!(steps[0]["skipped"].as_bool().unwrap() && steps[1]["skipped"].as_bool().unwrap());
    assert!(skipped > 2 && skipped < steps.len(), "{skipped} skipped");
    // Skipped steps leave the weights alone: the loss only moves once steps are taken.
    let last = steps.last().unwrap();
    assert!(!last["skipped"].as_bool().unwrap());
    assert!(
        stdout(&o).contains(&format!("{skipped} of 16 steps skipped on overflow")),
        "{}",
        stdout(&o)
    );
}

/// Loss-scaler keys only make sense with fp16: one clear error otherwise.
#[test]
fn loss_scale_keys_need_fp16() {
    let o = megac(&[
        "check",
        "examples/llama-tiny.toml",
        "--set",
        "train.precision=\"bf16\"",
        "--set",
        "train.loss_scale=1024",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("train.loss_scale is only used with train.precision = \"fp16\""),
        "{}",
        stderr(&o)
    );
}

/// Parameter elements a rank holds (its shard of every parameter), from the plan.
fn local_params(p: &megac_ir::plan::Plan) -> u64 {
    p.params
        .iter()
        .map(|e| p.buffers[e.buffer as usize].len())
        .sum()
}

/// The arenas of a bf16 plan, class by class, against Megatron's per-parameter bytes: the
/// working weight 2, the fp32 main gradient 4, fp32 master weight and Adam moments 12 —
/// divided by the distributed optimizer's group, dp·cp (its reduce-scatter is in place);
/// tp and ep divide what a rank holds.
#[test]
fn bf16_arenas_are_megatrons_bytes_per_parameter() {
    let cases: &[(&str, &[&str], u64)] = &[
        ("examples/llama-tiny.toml", &[], 1),
        ("examples/llama-tiny.toml", &["parallel.tp=2"], 1),
        ("examples/llama-tiny.toml", &["parallel.dp=2"], 1),
        (
            "examples/llama-tiny.toml",
            &["parallel.dp=2", "parallel.distributed_optimizer=true"],
            2,
        ),
        (
            "examples/llama-tiny.toml",
            &[
                "parallel.dp=4",
                "parallel.tp=2",
                "parallel.distributed_optimizer=true",
                "train.global_batch=16",
            ],
            4,
        ),
        (
            "examples/moe-tiny.toml",
            &["parallel.dp=2", "parallel.ep=2"],
            1,
        ),
    ];
    for &(file, layout, d) in cases {
        let mut sets = vec!["train.precision=\"bf16\""];
        sets.extend_from_slice(layout);
        let p = plan(file, &sets);
        let n = local_params(&p);
        let m = &p.memory;
        assert_eq!(m.param_bytes, 2 * n, "{file} {layout:?}: working weights");
        // ZeRO segments are padded to a multiple of d elements.
        let shard = |bytes: u64| bytes.div_ceil(d);
        if d == 1 {
            assert_eq!(m.grad_bytes, 4 * n, "{file} {layout:?}: gradients");
            assert_eq!(m.opt_state_bytes, 12 * n, "{file} {layout:?}: optimizer");
        } else {
            let slack = 4 * 12 * d; // padding: under one element per segment and rank
                                    // The reduce-scatter reduces in place into the rank's slice (Megatron's 4 B).
            let want_grad = 4 * n;
            assert!(
                m.grad_bytes.abs_diff(want_grad) <= slack,
                "{file} {layout:?}: gradients {} vs {want_grad}",
                m.grad_bytes
            );
            assert!(
                m.opt_state_bytes.abs_diff(shard(12 * n)) <= slack,
                "{file} {layout:?}: optimizer {} vs {}",
                m.opt_state_bytes,
                shard(12 * n)
            );
        }
        // The same plan in fp32: 4 + 4 + 8.
        let p32 = plan(file, layout);
        assert_eq!(local_params(&p32), n);
        assert_eq!(p32.memory.param_bytes, 4 * n);
        assert_eq!(p32.memory.staging_bytes, 0);
        assert!(m.staging_bytes > 0);
    }
}

/// Pipeline activation memory: what a micro-batch keeps between its segments takes a slot
/// per micro-batch in flight (the layers' chunks of a stage share one pool of them), what
/// one segment alone uses lives in one scratch region. So full recomputation keeps little
/// more than each layer's input, and interleaving (vpp) adds only the extra micro-batches in
/// flight, not a copy of every chunk's working memory.
#[test]
fn full_recompute_keeps_layer_inputs_and_vpp_does_not_inflate_it() {
    let act = |vpp: u64, recompute: &str| -> u64 {
        let schedule = if vpp == 1 { "1f1b" } else { "interleaved" };
        let vpp = format!("parallel.vpp={vpp}");
        let schedule = format!("parallel.schedule=\"{schedule}\"");
        let recompute = format!("train.recompute=\"{recompute}\"");
        let p = plan(
            "examples/llama-tiny.toml",
            &[
                "model.layers=8",
                "parallel.pp=2",
                &vpp,
                &schedule,
                &recompute,
                "train.global_batch=16",
                "train.micro_batch=2",
            ],
        );
        p.roles
            .iter()
            .map(|r| r.memory.as_ref().unwrap().activation_bytes)
            .max()
            .unwrap()
    };
    let (none1, full1, full2, full4) = (
        act(1, "none"),
        act(1, "full"),
        act(2, "full"),
        act(4, "full"),
    );
    assert!(full1 * 3 < none1, "full recompute {full1} vs none {none1}");
    assert!(
        full4 * 4 < full1 * 5 && full2 * 4 < full1 * 5,
        "vpp 1/2/4: {full1} {full2} {full4}"
    );
}
