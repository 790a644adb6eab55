//! The cost model, the plan simulator and the layout search, through the library and the CLI.

use megac_ir::plan::Plan;
use megac_ir::ModelSpec;
use megac_sim::{estimate, simulate, Cluster, CostModel, ParallelLayout};

mod common;
use common::{megac, stderr, stdout};

fn spec(path: &str, sets: &[&str]) -> ModelSpec {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let file = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    megac_frontend::load(std::path::Path::new(&file), &sets).expect("valid model")
}

fn plan_of(spec: &ModelSpec) -> Plan {
    let flops = megac_passes::flops::step_flops(spec).total;
    let module = megac_passes::run_pipeline(spec.clone(), None, false).expect("compiles");
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).expect("plan")
}

/// The analytic model and the simulator agree on plans megac emits today (data, tensor,
/// sequence and context parallelism; with Megatron's overlaps and with a serial runtime).
#[test]
fn analytic_model_agrees_with_the_simulator() {
    let cases: &[(&str, &[&str])] = &[
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.sequence_parallel=false",
                "parallel.distributed_optimizer=false",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.sequence_parallel=false",
                "parallel.tp=1",
                "parallel.dp=8",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=false",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.tp=1",
                "parallel.cp=2",
                "parallel.dp=4",
                "parallel.sequence_parallel=false",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.tp=2",
                "parallel.cp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=false",
                "parallel.cp_comm=all-gather",
            ],
        ),
        // The families with q/k/v biases, per-head q/k norms and a sliding window.
        (
            "examples/qwen2-7b.toml",
            &[
                "parallel.sequence_parallel=false",
                "parallel.distributed_optimizer=false",
            ],
        ),
        (
            "examples/qwen3-8b.toml",
            &[
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=false",
            ],
        ),
        (
            "examples/mistral-7b.toml",
            &[
                "parallel.tp=1",
                "parallel.cp=2",
                "parallel.dp=4",
                "parallel.sequence_parallel=false",
                "parallel.distributed_optimizer=false",
            ],
        ),
        (
            "examples/gpt3-175b.toml",
            &[
                "parallel.pp=1",
                "parallel.vpp=1",
                "parallel.dp=128",
                "model.vocab=51200",
                "parallel.sequence_parallel=false",
                "parallel.distributed_optimizer=false",
            ],
        ),
    ];
    for (path, sets) in cases {
        let s = spec(path, sets);
        let plan = plan_of(&s);
        for serial in [false, true] {
            let mut cl = Cluster::preset("h100-sxm").unwrap();
            if serial {
                cl.cost = cl.cost.clone().serial();
            }
            let cost = CostModel::new(cl.fit(plan.mesh.world_size() as u64).unwrap());
            let sim = simulate(&plan, &cost, false).unwrap().report;
            let est = estimate(&s, &ParallelLayout::of_spec(&s), &cost);
            let rel = (est.step_seconds - sim.step_seconds).abs() / sim.step_seconds;
            assert!(
                rel < 0.03,
                "{path} {sets:?} serial={serial}: model {} s vs simulated {} s",
                est.step_seconds,
                sim.step_seconds
            );
            assert!((est.mfu / sim.mfu - 1.0).abs() < 0.03);
            // Parameters, gradients and optimizer state as codegen lays them out.
            let m = &plan.memory;
            let state = (m.param_bytes + m.grad_bytes + m.opt_state_bytes) as f64;
            let model_state = est.memory.params + est.memory.grads + est.memory.optimizer;
            assert!(
                (model_state / state - 1.0).abs() < 0.01,
                "{path} {sets:?}: state {model_state} vs {state}"
            );
            // Activations: the model's count against the plan's live activations (the
            // placement's arena is larger: fragmentation).
            let live = sim.roles[0].activation_live_bytes as f64;
            let act = est.memory.activations + est.memory.head;
            assert!(
                (act / live - 1.0).abs() < 0.05,
                "{path} {sets:?}: activations {act} vs live {live}"
            );
        }
    }
}

fn compile_to(dir: &std::path::Path, model: &str, sets: &[&str]) {
    let mut args = vec!["compile", model];
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    let out = dir.to_str().unwrap();
    args.extend(["-o", out]);
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `simulate` on a compiled dp2 × tp2 plan: sane numbers, the JSON contract, a trace.
#[test]
fn simulate_a_dp_tp_plan() {
    let dir = tempfile::tempdir().unwrap();
    let plan_dir = dir.path().join("plan");
    compile_to(
        &plan_dir,
        "examples/llama-tiny.toml",
        &["parallel.dp=2", "parallel.tp=2"],
    );
    let trace = dir.path().join("sim.trace.json");
    let o = megac(&[
        "simulate",
        plan_dir.to_str().unwrap(),
        "--format",
        "json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON on stdout");
    let step = v["step_seconds"].as_f64().unwrap();
    let tps = v["tokens_per_s"].as_f64().unwrap();
    let mfu = v["mfu"].as_f64().unwrap();
    assert!(
        step > 0.0 && step < 1.0,
        "a tiny model steps in well under a second: {step}"
    );
    // llama-tiny: global batch 8 × 64 tokens.
    assert!((tps * step / 512.0 - 1.0).abs() < 1e-9);
    assert!(mfu > 0.0 && mfu < 0.5, "{mfu}");
    assert_eq!(v["bubble_fraction"].as_f64(), Some(0.0));
    let mem = v["peak_memory_bytes"].as_array().unwrap();
    assert_eq!(mem.len(), 4);
    let text = std::fs::read_to_string(plan_dir.join("plan.json")).unwrap();
    let plan = Plan::from_json(&text).unwrap();
    assert!(mem.iter().all(|m| m.as_u64() == Some(plan.memory.total())));
    // The timeline has compute and tensor-parallel communication.
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    assert!(events
        .iter()
        .any(|e| e["name"] == "linear" && e["ph"] == "X"));
    assert!(events
        .iter()
        .any(|e| e["name"] == "all_reduce" && e["cat"] == "comm"));
    assert!(events.iter().any(|e| e["name"] == "adamw"));

    // The text form says the same.
    let o = megac(&[
        "simulate",
        plan_dir.to_str().unwrap(),
        "--cluster",
        "a100-80g",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("step "), "{out}");
    assert!(out.contains("A100"), "{out}");
    assert!(out.contains("comm tp"), "{out}");
}

/// Unit costs through the simulator: F, B and W of one micro-batch take 1 each.
#[test]
fn simulator_unit_costs() {
    let s = spec("examples/llama-tiny.toml", &["parallel.dp=2"]);
    let plan = plan_of(&s);
    let cost = CostModel::unit(Cluster::preset("h100-sxm").unwrap().fit(2).unwrap());
    let r = simulate(&plan, &cost, false).unwrap().report;
    let want = 3.0 * plan.batch.microbatches as f64;
    assert!(
        (r.step_seconds - want).abs() < 1e-9,
        "{} vs {want}",
        r.step_seconds
    );
}

/// `plan` on Llama-3 8B and 8 GPUs: K layouts, fastest first, all fitting, the last line.
#[test]
fn plan_llama3_8b_on_8_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let emit = dir.path().join("best.toml");
    let o = megac(&[
        "plan",
        "examples/llama3-8b.toml",
        "--gpus",
        "8",
        "--top",
        "6",
        "--emit",
        emit.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let rows: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| l.contains(" tp="))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 6, "{out}");
    let steps: Vec<f64> = rows.iter().map(|r| r[1].parse().unwrap()).collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{out}");
    // 80 GiB minus 2 GiB reserved.
    assert!(
        rows.iter().all(|r| r[5].parse::<f64>().unwrap() <= 78.0),
        "{out}"
    );
    let last = out.lines().last().unwrap();
    let words: Vec<&str> = last.split_whitespace().collect();
    assert_eq!(words[0], "searched", "{out}");
    assert!(words[1].parse::<u64>().unwrap() > 1000, "{last}");
    assert_eq!(&words[2..4], ["layouts", "in"]);
    assert!(words[4].parse::<f64>().is_ok() && words[5] == "s", "{last}");
    // The emitted file is a valid model.toml with the best layout.
    let o = megac(&["check", emit.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let best_layout = rows[0][6..].join(" ");
    let text = std::fs::read_to_string(&emit).unwrap();
    let tp = best_layout
        .split("tp=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert!(text.contains(&format!("\ntp = {tp}\n")), "{text}");
}

#[test]
fn plan_errors_are_one_clear_message() {
    // A model that fits no layout.
    let o = megac(&[
        "plan",
        "examples/llama3-70b.toml",
        "--gpus",
        "1",
        "--cluster",
        "h100-sxm",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: no layout of llama3-70b fits on 1 × h100-sxm"),
        "{err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "{err}"
    );
    assert!(!err.contains("panicked"));

    // A malformed cluster file: file, line and column.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("cluster.toml");
    std::fs::write(
        &bad,
        "preset = \"h100-sxm\"\n[inter_node]\ngb_per_s = \"fast\"\n",
    )
    .unwrap();
    let o = megac(&[
        "plan",
        "examples/llama-tiny.toml",
        "--gpus",
        "2",
        "--cluster",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with(&format!("error: {}:3:12:", bad.display())),
        "{err}"
    );
    assert!(err.contains("gb_per_s = \"fast\""), "{err}");

    // An unknown preset.
    let o = megac(&[
        "plan",
        "examples/llama-tiny.toml",
        "--gpus",
        "2",
        "--cluster",
        "b300",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("unknown cluster preset `b300`"),
        "{}",
        stderr(&o)
    );

    // A cluster too small for the GPU count (llama3-8b's [cluster] is one 8-GPU node).
    let o = megac(&["plan", "examples/llama3-8b.toml", "--gpus", "16"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("too small"), "{}", stderr(&o));
}

#[test]
fn simulate_errors_are_one_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let plan_dir = dir.path().join("plan");
    compile_to(
        &plan_dir,
        "examples/llama-tiny.toml",
        &["parallel.dp=4", "train.micro_batch=2"],
    );
    let small = dir.path().join("small.toml");
    std::fs::write(
        &small,
        "preset = \"h100-sxm\"\nnodes = 1\ngpus_per_node = 2\n",
    )
    .unwrap();
    let o = megac(&[
        "simulate",
        plan_dir.to_str().unwrap(),
        "--cluster",
        small.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("too small for the layout"), "{err}");
    assert!(err.contains("the layout needs 4"), "{err}");
    let o = megac(&["simulate", dir.path().join("nothing").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot read the plan"),
        "{}",
        stderr(&o)
    );
    let o = megac(&["simulate", plan_dir.to_str().unwrap(), "--format", "yaml"]);
    assert_eq!(o.status.code(), Some(1));
}

/// A compiled pipelined llama-tiny (8 layers) under unit costs.
fn unit_pipeline(sets: &[&str]) -> (Plan, megac_sim::SimReport) {
    let mut all = vec!["model.layers=8"];
    all.extend_from_slice(sets);
    let s = spec("examples/llama-tiny.toml", &all);
    let plan = plan_of(&s);
    let world = plan.mesh.world_size() as u64;
    let cost = CostModel::unit(Cluster::preset("h100-sxm").unwrap().fit(world).unwrap());
    let r = simulate(&plan, &cost, false).unwrap().report;
    (plan, r)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

/// Unit costs (F = B = W = 1 per chunk action, BW = 2, free communication) reproduce the
/// pipeline schedules' bubble formulas exactly on compiled plans: gpipe and 1f1b
/// (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1), zb-h1 (p−1)/(3m+p−1).
#[test]
fn pipelined_plans_under_unit_costs_reproduce_the_bubble_formulas() {
    // (micro_batch, global_batch) -> m = global / micro (dp = 1).
    let batches: &[(u64, u64)] = &[(4, 8), (2, 8), (1, 8), (1, 12), (1, 16)];
    for pp in [2u64, 4] {
        for &(mb, gb) in batches {
            let m = gb / mb;
            let (pf, mf) = (pp as f64, m as f64);
            let pp_set = format!("parallel.pp={pp}");
            let mb_set = format!("train.micro_batch={mb}");
            let gb_set = format!("train.global_batch={gb}");
            let base = [pp_set.as_str(), mb_set.as_str(), gb_set.as_str()];
            let cases: Vec<(&str, u64, f64)> = vec![
                ("gpipe", 1, (pf - 1.0) / (mf + pf - 1.0)),
                ("1f1b", 1, (pf - 1.0) / (mf + pf - 1.0)),
                ("zb-h1", 1, (pf - 1.0) / (3.0 * mf + pf - 1.0)),
                ("interleaved", 2, (pf - 1.0) / (2.0 * mf + pf - 1.0)),
            ];
            for (schedule, vpp, want) in cases {
                // Interleaving needs m % p = 0; ZB-H1's formula holds for m >= p.
                if (schedule == "interleaved" && m % pp != 0) || (schedule == "zb-h1" && m < pp) {
                    continue;
                }
                let sched = format!("parallel.schedule={schedule}");
                let vpp_set = format!("parallel.vpp={vpp}");
                let mut sets = base.to_vec();
                sets.push(&sched);
                sets.push(&vpp_set);
                let (plan, r) = unit_pipeline(&sets);
                assert_eq!(plan.batch.microbatches, m);
                assert!(
                    close(r.bubble_fraction, want),
                    "{schedule} pp={pp} vpp={vpp} m={m}: bubble {} vs {want}",
                    r.bubble_fraction
                );
                // The step: every stage's work (3 per micro-batch and chunk) over 1 − bubble.
                let work = 3.0 * mf * vpp as f64;
                assert!(
                    close(r.step_seconds, work / (1.0 - want)),
                    "{schedule} pp={pp} m={m}: step {}",
                    r.step_seconds
                );
                assert_eq!(r.pipeline_execution.as_deref(), Some("static"));
                // And the pipeline schedules' own unit-cost simulation of the same order.
                let kind: megac_ir::pipeline::ScheduleKind = schedule.parse().unwrap();
                let lists =
                    megac_ir::pipeline::schedule(kind, pp as u32, vpp as u32, m as u32).unwrap();
                let t = megac_ir::pipeline::simulate(&lists, megac_ir::pipeline::Costs::unit())
                    .unwrap();
                assert!(close(r.bubble_fraction, t.bubble_fraction));
                assert!(close(r.step_seconds, t.makespan));
                assert_eq!(r.roles.len(), pp as usize);
                for (s, role) in r.roles.iter().enumerate() {
                    assert_eq!(role.stage, Some(s as u32));
                    assert!(close(role.compute_seconds, work), "{schedule}");
                    assert_eq!(
                        role.memory_bytes,
                        plan.roles[s].memory.as_ref().unwrap().total()
                    );
                }
                // 1F1B keeps at most p − s micro-batches in flight on stage s, GPipe m.
                if schedule == "1f1b" {
                    assert_eq!(r.roles[0].peak_inflight as u64, pp.min(m));
                }
                if schedule == "gpipe" {
                    assert_eq!(r.roles[0].peak_inflight as u64, m);
                }
            }
        }
    }
}

/// MegaDPP runs dynamically (the highest-priority ready task); under unit costs it takes the
/// pipeline schedule's reference order, so its bubble equals that order's.
#[test]
fn dpp_plans_run_dynamically_and_match_the_reference_order_under_unit_costs() {
    for policy in ["bfs", "dfs", "adaptive", "ordered"] {
        let pol = format!("parallel.dpp_policy={policy}");
        let sets = [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            pol.as_str(),
            "train.micro_batch=1",
            "train.global_batch=8",
        ];
        let (_, r) = unit_pipeline(&sets);
        assert_eq!(r.pipeline_execution.as_deref(), Some("dynamic"));
        let kind: megac_ir::pipeline::ScheduleKind = format!("dpp-{policy}").parse().unwrap();
        let lists = megac_ir::pipeline::schedule(kind, 2, 2, 8).unwrap();
        let t = megac_ir::pipeline::simulate(&lists, megac_ir::pipeline::Costs::unit()).unwrap();
        assert!(
            close(r.bubble_fraction, t.bubble_fraction),
            "dpp-{policy}: {} vs reference {}",
            r.bubble_fraction,
            t.bubble_fraction
        );
        assert!(close(r.step_seconds, t.makespan), "dpp-{policy}");
    }
}

/// `simulate` on a pipelined plan with the cost model: per-stage figures, transfers over
/// the pipeline link, one trace track per stage, `--costs unit` on the command line.
#[test]
fn simulate_a_pipelined_plan() {
    let dir = tempfile::tempdir().unwrap();
    let plan_dir = dir.path().join("plan");
    compile_to(
        &plan_dir,
        "examples/llama-tiny.toml",
        &["model.layers=8", "parallel.pp=4", "parallel.dp=2"],
    );
    let trace = dir.path().join("pp.trace.json");
    let o = megac(&[
        "simulate",
        plan_dir.to_str().unwrap(),
        "--format",
        "json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let step = v["step_seconds"].as_f64().unwrap();
    let bubble = v["bubble_fraction"].as_f64().unwrap();
    assert!(step > 0.0 && step < 1.0, "{step}");
    // 1F1B, m = 1 per dp rank (global batch 8 = 2 × micro-batch 4, dp 2): mostly bubble.
    assert!(bubble > 0.5 && bubble < 1.0, "{bubble}");
    assert_eq!(v["pipeline_execution"], "static");
    let roles = v["roles"].as_array().unwrap();
    assert_eq!(roles.len(), 4);
    let text = std::fs::read_to_string(plan_dir.join("plan.json")).unwrap();
    let plan = Plan::from_json(&text).unwrap();
    for (s, r) in roles.iter().enumerate() {
        assert_eq!(r["stage"].as_u64(), Some(s as u64));
        assert_eq!(r["ranks"].as_u64(), Some(2));
        assert!(r["step_seconds"].as_f64().unwrap() <= step);
        assert!(r["compute_seconds"].as_f64().unwrap() > 0.0);
        let b = r["bubble_fraction"].as_f64().unwrap();
        assert!(b > 0.0 && b < 1.0, "{b}");
        if s < 3 {
            assert!(r["comm_seconds"]["pp"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    let mem = v["peak_memory_bytes"].as_array().unwrap();
    assert_eq!(mem.len(), 8);
    for (rank, m) in mem.iter().enumerate() {
        assert_eq!(m.as_u64(), Some(plan.memory_of(rank).total()));
    }
    // One track (process) per stage, with its F and BW spans.
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    for s in 0..4 {
        assert!(events.iter().any(|e| e["ph"] == "M"
            && e["pid"] == s
            && e["args"]["name"] == format!("role stage{s}")));
        assert!(events
            .iter()
            .any(|e| e["pid"] == s && e["name"] == format!("F{s}.0")));
        assert!(events
            .iter()
            .any(|e| e["pid"] == s && e["name"] == format!("BW{s}.0")));
    }
    assert!(events
        .iter()
        .any(|e| e["name"] == "send" && e["cat"] == "comm"));

    // Unit costs from the command line: p = 4, m = 1: bubble 3/4.
    let o = megac(&["simulate", plan_dir.to_str().unwrap(), "--costs", "unit"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("bubble 75.0%"), "{out}");
    assert!(out.contains("stage 3"), "{out}");
    let o = megac(&["simulate", plan_dir.to_str().unwrap(), "--costs", "free"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--costs free"), "{}", stderr(&o));

    // Stages one node apart: transfers cross the network, the step gets no faster.
    let spread = dir.path().join("spread.toml");
    std::fs::write(
        &spread,
        "preset = \"h100-sxm\"\nnodes = 4\ngpus_per_node = 2\n",
    )
    .unwrap();
    let o = megac(&[
        "simulate",
        plan_dir.to_str().unwrap(),
        "--format",
        "json",
        "--cluster",
        spread.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let w: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let pp_time = |v: &serde_json::Value| v["roles"][0]["comm_seconds"]["pp"].as_f64().unwrap();
    assert!(
        pp_time(&w) > pp_time(&v),
        "{} vs {}",
        pp_time(&w),
        pp_time(&v)
    );
    assert!(w["step_seconds"].as_f64().unwrap() >= step);
}

/// `megac plan`'s analytic model (sim/src/model.rs) against the plan simulation on
/// pipelined layouts of Llama-3 8B: step time within 15%.
#[test]
fn analytic_model_agrees_with_the_pipeline_simulation() {
    let cases: &[&[&str]] = &[
        &["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"],
        &["parallel.tp=2", "parallel.pp=4", "parallel.dp=1"],
        &[
            "parallel.tp=1",
            "parallel.pp=4",
            "parallel.vpp=2",
            "parallel.dp=2",
            "parallel.schedule=interleaved",
        ],
        &[
            "parallel.tp=2",
            "parallel.pp=4",
            "parallel.dp=1",
            "parallel.schedule=zb-h1",
        ],
    ];
    for sets in cases {
        let mut all = vec![
            "parallel.sequence_parallel=false",
            "parallel.distributed_optimizer=false",
            "train.global_batch=32",
        ];
        all.extend_from_slice(sets);
        let s = spec("examples/llama3-8b.toml", &all);
        let plan = plan_of(&s);
        for serial in [false, true] {
            let mut cl = Cluster::preset("h100-sxm").unwrap();
            if serial {
                cl.cost = cl.cost.clone().serial();
            }
            let cost = CostModel::new(cl.fit(plan.mesh.world_size() as u64).unwrap());
            let sim = simulate(&plan, &cost, false).unwrap().report;
            let est = estimate(&s, &ParallelLayout::of_spec(&s), &cost);
            let rel = est.step_seconds / sim.step_seconds - 1.0;
            println!(
                "{sets:?} serial={serial}: model {:.4} s (bubble/ideal {:.3}), simulated {:.4} s (bubble {:.3}, idle/total), {:+.1}%",
                est.step_seconds,
                est.bubble_fraction,
                sim.step_seconds,
                sim.bubble_fraction,
                100.0 * rel
            );
            assert!(rel.abs() < 0.05, "{sets:?} serial={serial}: {rel}");
        }
    }
}

/// Held-out check of the plan path: the pipelined rows of Megatron-LM's H100 table
/// (sim/src/calibrate.rs) compiled with the layout the calibration picks and simulated
/// through `simulate`, against the published step times, and each plan's peak memory per
/// rank against the H100's 80 GiB. Prints per-row figures; slow (plans of up to 6,144
/// ranks), so `cargo test --release --test simulate -- --ignored --nocapture`.
#[test]
#[ignore]
fn megatron_pipelined_rows_through_the_plan_path() {
    let cl = Cluster::preset("h100-sxm").unwrap();
    let rows = megac_sim::calibrate::calibrate(&cl);
    let mut errs = Vec::new();
    for c in rows.iter().filter(|c| c.row.pp > 1) {
        let s = c.layout.apply(&c.row.spec());
        let t0 = std::time::Instant::now();
        let flops = megac_passes::flops::step_flops(&s).total;
        let module = match megac_passes::run_pipeline(s.clone(), None, false) {
            Ok(m) => m,
            Err(e) => {
                println!("{}: does not compile: {e}", c.row.name);
                continue;
            }
        };
        let plan =
            match megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops) {
                Ok(p) => p,
                Err(e) => {
                    println!("{}: no plan: {e}", c.row.name);
                    continue;
                }
            };
        let compile_s = t0.elapsed().as_secs_f64();
        let cost = CostModel::new(cl.fit(plan.mesh.world_size() as u64).unwrap());
        let t1 = std::time::Instant::now();
        let sim = simulate(&plan, &cost, false).unwrap().report;
        let err = sim.step_seconds / c.row.measured_seconds() - 1.0;
        errs.push(err);
        let memory = sim.roles.iter().map(|r| r.memory_bytes).max().unwrap_or(0) as f64;
        let gib = (1u64 << 30) as f64;
        println!(
            "{:<5} peak memory {:.1} GiB per rank ({} the 80 GiB of an H100; analytic {:.1} GiB)",
            c.row.name,
            memory / gib,
            if memory <= 80.0 * gib {
                "fits"
            } else {
                "exceeds"
            },
            c.estimate.peak_memory_bytes / gib
        );
        println!(
            "{:<5} {} measured {:.3} s, analytic {:.3} s ({:+.1}%), plan simulation {:.3} s ({:+.1}%), bubble {:.3}, busy first/last stage {:.3}/{:.3} s; compile {:.1} s, simulate {:.1} s",
            c.row.name,
            c.layout.label(),
            c.row.measured_seconds(),
            c.estimate.step_seconds,
            100.0 * c.error,
            sim.step_seconds,
            100.0 * err,
            sim.bubble_fraction,
            sim.roles[0].compute_seconds,
            sim.roles[sim.roles.len() - 1].compute_seconds,
            compile_s,
            t1.elapsed().as_secs_f64()
        );
    }
    let mean = errs.iter().map(|e| e.abs()).sum::<f64>() / errs.len().max(1) as f64;
    println!(
        "plan path: mean |error| {:.1}% over {} rows",
        100.0 * mean,
        errs.len()
    );
}

/// The real-size examples as they are: compile, pass the plan validator, simulate on their
/// `[cluster]` device, and fit every rank's memory.
#[test]
fn real_size_examples_compile_validate_and_fit() {
    for path in [
        "examples/llama3-8b.toml",
        "examples/llama3-70b.toml",
        "examples/gpt3-175b.toml",
        "examples/mixtral-8x7b.toml",
    ] {
        let s = spec(path, &[]);
        let plan = plan_of(&s);
        megac_ir::check::check_plan(&plan).unwrap_or_else(|e| panic!("{path}: {e}"));
        let device = s.cluster.as_ref().map_or("h100-sxm", |c| c.device.as_str());
        let cl = Cluster::preset(device).unwrap();
        let cost = CostModel::new(cl.fit(plan.mesh.world_size() as u64).unwrap());
        let sim = simulate(&plan, &cost, false).unwrap().report;
        assert!(
            sim.step_seconds > 0.0 && sim.mfu > 0.05 && sim.mfu < 0.8,
            "{path}"
        );
        let capacity = cost.cluster.device.memory_bytes;
        for (rank, &bytes) in sim.peak_memory_bytes.iter().enumerate() {
            assert!(
                (bytes as f64) < capacity,
                "{path}: rank {rank} needs {:.1} GiB",
                bytes as f64 / (1u64 << 30) as f64
            );
        }
    }
}

/// `megac plan` and `megac simulate` of the plan compiled from a layout `plan` returned
/// agree (issue 13's goal: step time within 5%, peak memory per rank within 2%), for every
/// layout of the search's top 10 of each real-size example on its own cluster: tp·dp, cp,
/// interleaved pipelines, expert parallelism with cp (Mixtral) and GPT-3 175B on 1,024 GPUs.
/// (bench/plan_vs_simulate.sh prints the same for any model.)
#[test]
fn plan_and_simulate_agree_on_the_searched_layouts() {
    for (path, gpus) in [
        ("examples/llama3-8b.toml", 8),
        ("examples/llama3-70b.toml", 64),
        ("examples/mixtral-8x7b.toml", 32),
        ("examples/gpt3-175b.toml", 1024),
    ] {
        let s = spec(path, &[]);
        let device = s.cluster.as_ref().map_or("h100-sxm", |c| c.device.as_str());
        let cluster = Cluster::preset(device).unwrap();
        let cost = CostModel::new(cluster.fit(gpus).unwrap());
        let found = megac_sim::search(&s, gpus, &cost, 10).unwrap();
        assert_eq!(found.best.len(), 10, "{path}");
        for c in &found.best {
            let plan = plan_of(&c.layout.apply(&s));
            let sim = simulate(&plan, &cost, false).unwrap().report;
            let memory = sim.roles.iter().map(|r| r.memory_bytes).max().unwrap() as f64;
            let (dt, dm) = (
                c.estimate.step_seconds / sim.step_seconds - 1.0,
                c.estimate.peak_memory_bytes / memory - 1.0,
            );
            assert!(
                dt.abs() < 0.05 && dm.abs() < 0.02,
                "{path} {}: plan {} s {} B, simulate {} s {memory} B",
                c.layout.label(),
                c.estimate.step_seconds,
                c.estimate.peak_memory_bytes,
                sim.step_seconds
            );
        }
    }
}

/// The analytic model's peak memory per rank follows pipelined plans within 2%, under 1F1B
/// and under zero-bubble H1, whose slots keep what W reads of B until W
/// (sim's `ZeroBubbleKept`): dense Llama and GPT with and without sequence parallelism,
/// under each recomputation, and (zero-bubble only) Mixtral with expert parallelism.
#[test]
fn analytic_memory_follows_pipelined_plans() {
    let cases: &[(&str, &[&str])] = &[
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.tp=2",
                "parallel.pp=4",
                "parallel.dp=1",
                "parallel.sequence_parallel=true",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.tp=2",
                "parallel.pp=4",
                "parallel.dp=1",
                "parallel.sequence_parallel=false",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.tp=2",
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "train.recompute=selective",
            ],
        ),
        (
            "examples/llama3-8b.toml",
            &[
                "parallel.tp=2",
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "train.recompute=full",
            ],
        ),
        (
            "examples/llama3-70b.toml",
            &[
                "parallel.tp=4",
                "parallel.pp=4",
                "parallel.dp=2",
                "parallel.cp=2",
                "parallel.sequence_parallel=true",
                "train.global_batch=128",
            ],
        ),
        (
            "examples/gpt3-175b.toml",
            &[
                "parallel.tp=8",
                "parallel.pp=8",
                "parallel.dp=2",
                "parallel.sequence_parallel=true",
                "model.layers=32",
            ],
        ),
        (
            "examples/mixtral-8x7b.toml",
            &[
                "parallel.tp=1",
                "parallel.pp=4",
                "parallel.dp=8",
                "parallel.ep=8",
                "train.global_batch=64",
            ],
        ),
        (
            "examples/mixtral-8x7b.toml",
            &[
                "parallel.tp=2",
                "parallel.pp=4",
                "parallel.dp=4",
                "parallel.ep=4",
                "parallel.sequence_parallel=true",
                "train.global_batch=64",
            ],
        ),
    ];
    for ((path, sets), schedule) in cases
        .iter()
        .flat_map(|c| ["parallel.schedule=1f1b", "parallel.schedule=zb-h1"].map(|s| (c, s)))
        // Mixtral under 1F1B is 3.8% under (full recompute: the backward's expert gradient
        // buffers, transient in the plan's scratch, are not in the model's working set).
        .filter(|((path, _), schedule)| !(path.contains("mixtral") && schedule.ends_with("1f1b")))
    {
        let mut all = vec![
            schedule,
            "parallel.distributed_optimizer=true",
            "train.global_batch=32",
            "parallel.vpp=1",
        ];
        all.extend_from_slice(sets);
        let s = spec(path, &all);
        let plan = plan_of(&s);
        let cluster = Cluster::preset("h100-sxm").unwrap();
        let cost = CostModel::new(cluster.fit(plan.mesh.world_size() as u64).unwrap());
        let sim = simulate(&plan, &cost, false).unwrap().report;
        let memory = sim.roles.iter().map(|r| r.memory_bytes).max().unwrap() as f64;
        let est = estimate(&s, &ParallelLayout::of_spec(&s), &cost);
        let dm = est.peak_memory_bytes / memory - 1.0;
        println!(
            "{path} {schedule} {sets:?}: model {:.2} GiB, plan {:.2} GiB, {:+.2}%",
            est.peak_memory_bytes / 2f64.powi(30),
            memory / 2f64.powi(30),
            100.0 * dm
        );
        assert!(dm.abs() < 0.02, "{path} {schedule} {sets:?}: {dm}");
    }
}

/// The analytic model's parameter memory counts every parameter the compiler builds, the
/// new families' q/k/v biases and per-head q/k norms included (one device, fp32: 4 bytes
/// each; the vocabulary padded as the plan pads it).
#[test]
fn analytic_parameter_memory_counts_every_parameter() {
    let one = [
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.dp=1",
        "parallel.cp=1",
        "parallel.ep=1",
        "parallel.sequence_parallel=false",
        "parallel.distributed_optimizer=false",
        "train.precision=\"fp32\"",
    ];
    for path in [
        "examples/llama3-8b.toml",
        "examples/qwen2-7b.toml",
        "examples/qwen3-8b.toml",
        "examples/mistral-7b.toml",
        // Routed experts of moe.ffn_hidden, the shared expert and its gate.
        "examples/qwen1.5-moe-a2.7b.toml",
    ] {
        let s = spec(path, &one);
        let plan = plan_of(&s);
        let elements: u64 = plan
            .params
            .iter()
            .map(|p| p.shape.iter().product::<u64>())
            .sum();
        let cost = CostModel::new(Cluster::preset("h100-sxm").unwrap().fit(1).unwrap());
        let est = estimate(&s, &ParallelLayout::of_spec(&s), &cost);
        assert_eq!(
            est.memory.params,
            4.0 * elements as f64,
            "{path}: the model's parameter bytes vs the plan's {elements} parameters"
        );
    }
}

/// Many small experts over ep: Qwen1.5-MoE-A2.7B (60 experts of 1,408, top 4, a shared
/// expert) on one 8-GPU node, the search's top 10 (ep 2 and 4, i.e. 30 or 15 local experts).
/// Under ep the plan runs a rank's local experts as one grouped kernel per op (their
/// weights stacked along `experts`), and the analytic model times them so: before it
/// timed them as one small matmul per expert (each `fill`-penalised, with its own launch),
/// 7 to 8% above `simulate` on these layouts (18% for the example's own layout at mb 1).
/// Now the largest difference is 0.7%; the bound, 2%, keeps a margin for the rest of the
/// model's approximations while failing a return to per-expert timing by a factor of 4.
#[test]
fn plan_and_simulate_agree_on_many_small_experts() {
    let path = "examples/qwen1.5-moe-a2.7b.toml";
    let s = spec(path, &[]);
    let cost = CostModel::new(Cluster::preset("h100-sxm").unwrap().fit(8).unwrap());
    let found = megac_sim::search(&s, 8, &cost, 10).unwrap();
    assert_eq!(found.best.len(), 10);
    for c in &found.best {
        assert!(c.layout.ep > 1, "{}", c.layout.label());
        let plan = plan_of(&c.layout.apply(&s));
        let sim = simulate(&plan, &cost, false).unwrap().report;
        let dt = c.estimate.step_seconds / sim.step_seconds - 1.0;
        assert!(
            dt.abs() < 0.02,
            "{path} {}: plan {} s, simulate {} s ({dt:+.3})",
            c.layout.label(),
            c.estimate.step_seconds,
            sim.step_seconds
        );
    }
    // The example's own layout (dp 8, ep 4, micro-batch 1).
    let plan = plan_of(&s);
    let sim = simulate(&plan, &cost, false).unwrap().report;
    let est = estimate(&s, &ParallelLayout::of_spec(&s), &cost);
    let dt = est.step_seconds / sim.step_seconds - 1.0;
    assert!(
        dt.abs() < 0.02,
        "{path}: model {} s, simulate {} s",
        est.step_seconds,
        sim.step_seconds
    );
}

/// `--jitter`: every pipeline action of a stage takes its unit cost times 1 + S·|z|, drawn
/// from the stage's own stream in the order the stage runs its actions. Checked against the
/// pipeline schedules' own simulator fed the same draws (1F1B and interleaved), and for
/// reproducibility through the command line.
#[test]
fn jitter_slows_each_action_by_a_draw_of_its_stage_stream() {
    use megac_ir::pipeline::{schedule, simulate_by, ActionKind, ScheduleKind};
    use megac_ir::rng::SplitMix64;
    let (std, seed) = (0.3, 7u64);
    for (name, vpp) in [("1f1b", 1u32), ("interleaved", 2)] {
        let sched = format!("parallel.schedule={name}");
        let vpp_set = format!("parallel.vpp={vpp}");
        let s = spec(
            "examples/llama-tiny.toml",
            &[
                "model.layers=8",
                "parallel.pp=2",
                "train.micro_batch=1",
                "train.global_batch=4",
                &sched,
                &vpp_set,
            ],
        );
        let plan = plan_of(&s);
        let mut cost = CostModel::unit(Cluster::preset("h100-sxm").unwrap().fit(2).unwrap());
        let plain = simulate(&plan, &cost, false).unwrap().report.step_seconds;
        cost.jitter = Some(megac_sim::Jitter { std, seed });
        let got = simulate(&plan, &cost, false).unwrap().report.step_seconds;
        // The reference: the same order, each compute action's cost drawn from stage s's
        // stream (ranks are stages here: pp = 2, nothing else).
        let kind: ScheduleKind = name.parse().unwrap();
        let lists = schedule(kind, 2, vpp, 4).unwrap();
        let mut factor = std::collections::HashMap::new();
        for (stage, list) in lists.iter().enumerate() {
            let mut rng = SplitMix64::for_rank(seed, stage);
            for a in list {
                if matches!(a.kind, ActionKind::F | ActionKind::BW) {
                    let f = 1.0 + std * rng.normal().abs();
                    factor.insert((a.chunk, a.microbatch, a.kind == ActionKind::F), f);
                }
            }
        }
        let want = simulate_by(&lists, 0.0, |a| {
            let unit = if a.kind == ActionKind::F { 1.0 } else { 2.0 };
            unit * factor[&(a.chunk, a.microbatch, a.kind == ActionKind::F)]
        })
        .unwrap()
        .makespan;
        assert!(close(got, want), "{name}: {got} vs {want}");
        assert!(
            got > plain * 1.05,
            "{name}: {got} vs {plain} without jitter"
        );
    }

    // The command line: the same seed gives the same step, another seed another; a bad
    // spec is one error.
    let dir = tempfile::tempdir().unwrap();
    let plan_dir = dir.path().join("plan");
    compile_to(
        &plan_dir,
        "examples/llama-tiny.toml",
        &["model.layers=8", "parallel.pp=2", "parallel.schedule=dpp"],
    );
    let p = plan_dir.to_str().unwrap();
    let step = |jitter: &str| {
        let o = megac(&[
            "simulate", p, "--costs", "unit", "--format", "json", "--jitter", jitter,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert!(v["jitter"]["std"].as_f64().is_some(), "{v}");
        v["step_seconds"].as_f64().unwrap()
    };
    let (a, b, c) = (step("0.2:1"), step("0.2:1"), step("0.2:2"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(step("0"), step("0:5"));
    let o = megac(&["simulate", p, "--costs", "unit", "--jitter", "0.2:1"]);
    assert!(
        stdout(&o).contains("jitter       each pipeline action's compute × (1 + 0.2·|z|), seed 1"),
        "{}",
        stdout(&o)
    );
    for bad in ["-0.1", "lots", "0.2:x"] {
        let o = megac(&["simulate", p, "--jitter", bad]);
        assert_eq!(o.status.code(), Some(1), "{bad}");
        let err = stderr(&o);
        assert!(err.starts_with(&format!("error: --jitter {bad}:")), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The order bound (`megac simulate`'s `pipeline_bound_seconds`) never exceeds the phase a
/// schedule took, with or without jitter, for every pipeline schedule; it is tight for 1F1B
/// and interleaved 1F1B at unit costs without jitter (their bubble is the fill and drain the
/// bound charges), and interleaved under jitter stays within a few percent of it.
#[test]
fn the_order_bound_is_below_every_schedule_and_tight_for_1f1b() {
    let schedules: [(&str, u32, &[&str]); 6] = [
        ("1f1b", 1, &[]),
        ("interleaved", 2, &[]),
        ("zb-h1", 1, &[]),
        ("dpp", 2, &["parallel.dpp_policy=bfs"]),
        ("dpp", 2, &["parallel.dpp_policy=dfs"]),
        ("dpp", 2, &["parallel.dpp_policy=ordered"]),
    ];
    for (name, vpp, extra) in schedules {
        let sched = format!("parallel.schedule={name}");
        let vpp_set = format!("parallel.vpp={vpp}");
        let mut sets = vec![
            "model.layers=8",
            "parallel.pp=4",
            "train.micro_batch=1",
            "train.global_batch=8",
            &sched,
            &vpp_set,
        ];
        sets.extend_from_slice(extra);
        let plan = plan_of(&spec("examples/llama-tiny.toml", &sets));
        let mut cost = CostModel::unit(Cluster::preset("h100-sxm").unwrap().fit(4).unwrap());
        let phase = |cost: &CostModel| {
            simulate(&plan, cost, false)
                .unwrap()
                .report
                .pipeline_phase
                .expect("a pipelined plan has a phase")
        };
        let plain = phase(&cost);
        assert!(
            plain.bound_seconds <= plain.seconds + 1e-9,
            "{name} {extra:?}: bound {} above the phase {}",
            plain.bound_seconds,
            plain.seconds
        );
        if name == "1f1b" || name == "interleaved" {
            assert!(
                close(plain.bound_seconds, plain.seconds),
                "{name}: bound {} vs {}",
                plain.bound_seconds,
                plain.seconds
            );
        }
        for seed in 1..=5 {
            cost.jitter = Some(megac_sim::Jitter { std: 0.2, seed });
            let p = phase(&cost);
            assert!(
                p.bound_seconds <= p.seconds + 1e-9 && p.bound_seconds > plain.bound_seconds,
                "{name} {extra:?} seed {seed}: bound {} vs phase {} (jitter-free bound {})",
                p.bound_seconds,
                p.seconds,
                plain.bound_seconds
            );
            if name == "interleaved" {
                assert!(
                    p.seconds < 1.05 * p.bound_seconds,
                    "seed {seed}: interleaved {} vs bound {}",
                    p.seconds,
                    p.bound_seconds
                );
            }
        }
    }
}
