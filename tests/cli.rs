//! The command line as a user runs it: a real process, its exit code, stdout and stderr.

mod common;
use common::{megac, stderr, stdout};

#[test]
fn check_llama3_8b_reports_its_parameter_count() {
    let o = megac(&["check", "examples/llama3-8b.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    // 8.03e9 within 0.5%: the exact count is 8,030,261,248.
    assert!(out.contains("8.03 G (8,030,261,248)"), "{out}");
    assert!(out.contains("ok: examples/llama3-8b.toml is valid"));
    assert!(out.contains("formula:"), "the FLOPs line names its formula");
    assert!(out.contains("ranks        8 "), "{out}");
}

#[test]
fn set_overrides_show_in_the_summary() {
    let o = megac(&[
        "check",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.dp=2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("tp=2 pp=1 vpp=1 dp=2"), "{out}");
    assert!(out.contains("ranks        4 "), "{out}");
}

#[test]
fn set_errors_point_at_the_argument() {
    let o = megac(&[
        "check",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.tp=3",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with(
            "error: --set parallel.tp=3: parallel.tp = 3 does not divide model.heads = 4"
        ),
        "{err}"
    );
    assert!(
        err.contains("help: valid tp for this model: 1, 2, 4"),
        "{err}"
    );
}

#[test]
fn dump_output_parses_back() {
    let o = megac(&["dump", "examples/gpt-tiny.toml", "--after", "build"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let g = megac_ir::parse_graph(&text).unwrap();
    megac_ir::verify(&g).unwrap();
    assert_eq!(megac_ir::print_graph(&g), text);
    // Every layer's ops appear with their provenance.
    for needle in [
        "# transformer.h.0.attn.c_attn",
        "# transformer.h.1.mlp.c_proj",
        "# transformer.ln_f",
        "# loss",
    ] {
        assert!(text.contains(needle), "missing {needle}");
    }
}

#[test]
fn dump_rejects_an_unknown_pass() {
    let o = megac(&["dump", "examples/gpt-tiny.toml", "--after", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).is_empty());
    let err = stderr(&o);
    assert!(err.contains("no pass named `nope`; passes: build"), "{err}");
}

#[test]
fn missing_file_is_one_clear_error() {
    let o = megac(&["check", "examples/does-not-exist.toml"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: examples/does-not-exist.toml: cannot read the file"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn passes_lists_the_pipeline() {
    let o = megac(&["passes"]);
    assert!(o.status.success());
    let out = stdout(&o);
    // Numbered lines are the graph passes; the codegen steps follow, indented.
    let names: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(names, megac_passes::pass_names());
    assert!(
        out.contains("then codegen") && out.contains("schedule"),
        "{out}"
    );
}

#[test]
fn every_command_has_help_with_an_example() {
    for cmd in [
        "check",
        "dump",
        "passes",
        "compile",
        "inspect",
        "run",
        "train",
        "launch",
        "simulate",
        "plan",
        "checkpoint",
    ] {
        let o = megac(&[cmd, "--help"]);
        assert!(o.status.success(), "{cmd} --help failed");
        let out = stdout(&o);
        assert!(
            out.contains("Example:"),
            "{cmd} --help has no example:\n{out}"
        );
        assert!(
            out.contains(&format!("megac {cmd}")),
            "{cmd} --help:\n{out}"
        );
    }
    let o = megac(&["--help"]);
    assert!(stdout(&o).contains("Examples:"));
}

fn unigram_entropy(bytes: &[u8]) -> f64 {
    let mut counts = [0u64; 256];
    for &b in bytes {
        counts[b as usize] += 1;
    }
    let n = bytes.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum()
}

fn read_report(path: &std::path::Path) -> Vec<(f64, f64)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
    v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            assert_eq!(s["step"].as_u64(), Some(i as u64 + 1));
            assert!(s["seconds"].as_f64().unwrap() > 0.0);
            (
                s["loss"].as_f64().unwrap(),
                s["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The main job: the tiny llama learns a text file in the repo, well below the unigram
/// entropy of its bytes.
#[test]
fn train_on_text_beats_the_unigram_entropy() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("run.json");
    let corpus = "examples/data/corpus.txt";
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--data",
        corpus,
        "--steps",
        "150",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let steps = read_report(&report);
    assert_eq!(steps.len(), 150);
    let text =
        std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(corpus)).unwrap();
    let h = unigram_entropy(&text);
    let first = steps[0].0;
    let last = steps.last().unwrap().0;
    assert!(
        (first - (256f64).ln()).abs() < 0.1,
        "initial loss {first} is not ~ln(256)"
    );
    assert!(
        last < h - 0.2,
        "final loss {last} is not well below the unigram entropy {h:.3}"
    );
    assert!(stdout(&o).contains("trained 150 steps of llama-tiny"));
}

#[test]
fn compile_is_deterministic_and_run_matches_train() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for out in [&a, &b] {
        let o = megac(&[
            "compile",
            "examples/gpt-tiny.toml",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let pa = std::fs::read(a.join("plan.json")).unwrap();
    assert_eq!(
        pa,
        std::fs::read(b.join("plan.json")).unwrap(),
        "plans differ"
    );
    // The plan and the model's Hugging Face config.json (for `run --save-params`), no more.
    let mut entries: Vec<_> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        vec![
            std::ffi::OsString::from("config.json"),
            std::ffi::OsString::from("plan.json")
        ],
        "stray files"
    );
    assert_eq!(
        std::fs::read(a.join("config.json")).unwrap(),
        std::fs::read(b.join("config.json")).unwrap(),
        "configs differ"
    );

    // `run` of the compiled plan and `train` of the model give the same losses.
    let (ra, rb) = (dir.path().join("ra.json"), dir.path().join("rb.json"));
    let o = megac(&[
        "run",
        a.to_str().unwrap(),
        "--steps",
        "3",
        "--report",
        ra.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = megac(&[
        "train",
        "examples/gpt-tiny.toml",
        "--steps",
        "3",
        "--report",
        rb.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(read_report(&ra).len(), 3);
    assert_eq!(
        read_report(&ra),
        read_report(&rb),
        "same plan, same data, same losses"
    );
}

#[test]
fn inspect_reports_memory_by_class() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    assert!(megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "-o",
        out.to_str().unwrap()
    ])
    .status
    .success());
    let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mem = &v["roles"][0]["memory_bytes"];
    // llama-tiny: 123,712 fp32 parameters; gradients the same; AdamW keeps two moments.
    assert_eq!(mem["parameters"].as_u64(), Some(123_712 * 4));
    assert_eq!(mem["gradients"].as_u64(), Some(123_712 * 4));
    assert_eq!(mem["optimizer_state"].as_u64(), Some(2 * 123_712 * 4));
    let peak = mem["activations_peak"].as_u64().unwrap();
    let unplanned = mem["activations_unplanned"].as_u64().unwrap();
    assert!(
        peak > 0 && peak < unplanned,
        "liveness reuse: {peak} vs {unplanned}"
    );
    let text = stdout(&megac(&["inspect", out.to_str().unwrap()]));
    assert!(
        text.contains("optimizer state") && text.contains("FLOPs"),
        "{text}"
    );
}

#[test]
fn unsupported_layouts_and_bad_plans_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let o = megac(&[
        "compile",
        "examples/moe-tiny.toml",
        "--set",
        "parallel.cp=2",
        "--set",
        "model.moe.capacity_factor=1.0",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("use a dropless MoE (capacity_factor = 0) with cp"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists(), "a failed compile leaves no output");

    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("plan.json"), "{\"schema_version\": 99}").unwrap();
    let o = megac(&["run", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("schema version 99 is not supported"),
        "{}",
        stderr(&o)
    );

    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "1",
        "--data",
        "missing.bin",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: data missing.bin"),
        "{}",
        stderr(&o)
    );
}

/// `megac inspect`'s memory total agrees with the peak resident memory of `megac run`
/// within 10% (on a model large enough for the arenas to dominate the process), in fp32 and
/// in bf16 (where the cpu backend also allocates its staging area, `total_cpu`).
#[test]
fn inspect_memory_matches_peak_rss() {
    for precision in ["fp32", "bf16"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p");
        let report = dir.path().join("r.json");
        let set = format!("train.precision=\"{precision}\"");
        assert!(megac(&[
            "compile",
            "bench/llama-bench.toml",
            "--set",
            &set,
            "-o",
            out.to_str().unwrap()
        ])
        .status
        .success());
        let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let m = &v["roles"][0]["memory_bytes"];
        // The cpu backend's figure: the arenas plus, in bf16, its staging area.
        let planned = m["total_cpu"].as_u64().or(m["total"].as_u64()).unwrap() as f64;
        if precision == "bf16" {
            assert!(m["staging"].as_u64().unwrap() > 0);
            assert!(m["total_cpu"].as_u64().unwrap() > m["total"].as_u64().unwrap());
        }
        // The fused kernels of an `mlir` build (`--fusion on`) add MLIR's JIT code and
        // contexts, which the plan does not allocate: measured without them.
        let mut args = vec![
            "run",
            out.to_str().unwrap(),
            "--steps",
            "2",
            "--report",
            report.to_str().unwrap(),
        ];
        if cfg!(feature = "mlir") {
            args.extend(["--fusion", "off"]);
        }
        let o = megac(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        // What the run took: its peak less what the process held when it started (the
        // binary and its libraries: 7.8 MB for bench/llama-bench.toml's plan in the default
        // build, 40 MB with the `mlir` feature's static MLIR libraries, which the plan does
        // not allocate).
        let start = r["start_rss_bytes"].as_u64().unwrap() as f64;
        assert!(start > 0.0, "{r}");
        let rss = r["peak_rss_bytes"].as_u64().unwrap() as f64 - start;
        let rel = (rss - planned).abs() / planned;
        assert!(
            rel < 0.1,
            "{precision}: planned {planned:.0} bytes, peak RSS {rss:.0} bytes above the \
             {start:.0} at the start ({:.1}% apart)",
            rel * 100.0
        );
    }
}

#[test]
fn trace_writes_a_chrome_timeline_and_profile_prints_the_op_table() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "2",
        "--trace",
        trace.to_str().unwrap(),
        "--trace-kernels",
        "--profile",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace.join("rank-0.trace.json")).unwrap())
            .unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let steps = events.iter().filter(|e| e["cat"] == "step").count();
    assert_eq!(steps, 2);
    let kernels: Vec<&serde_json::Value> = events.iter().filter(|e| e["cat"] == "kernel").collect();
    assert!(kernels
        .iter()
        .any(|e| e["name"] == "attention_grad"
            && e["args"]["path"] == "model.layers.1.self_attn.core"));
    assert!(kernels.iter().all(|e| e["dur"].as_f64().unwrap() >= 0.0));
    let out = stdout(&o);
    assert!(
        out.contains("linear_grad_weight") && out.contains("matmuls:"),
        "{out}"
    );
}

/// A hand-edited plan whose ranks disagree on a collective is reported, not hung on: rank 1
/// gets a copy of the program without its first tensor-parallel all-reduce. (The local
/// communicator's own run-time detection is tested in runtime/tests/local_comm.rs.)
#[test]
fn mismatched_collective_in_an_edited_plan_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let o = megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.tp=2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let path = out.join("plan.json");
    let mut plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut role = plan["roles"][0].clone();
    let program = role["microbatch"].as_array_mut().unwrap();
    let first = program
        .iter()
        .position(|i| i["op"] == "all_reduce")
        .unwrap();
    // The edited role copies instead of reducing: its data flow stays whole (the plan gate
    // passes it), but it skips a collective its partner calls.
    program[first]["op"] = serde_json::json!("cast");
    program[first]["attrs"] = serde_json::json!({"to": "f32"});
    role["name"] = serde_json::json!("edited");
    plan["roles"].as_array_mut().unwrap().push(role);
    plan["rank_to_role"] = serde_json::json!([0, 1]);
    std::fs::write(&path, serde_json::to_string(&plan).unwrap()).unwrap();

    let start = std::time::Instant::now();
    let o = megac(&["run", out.to_str().unwrap(), "--steps", "1"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("mismatch") || err.contains("deadlock"),
        "{err}"
    );
    assert!(
        err.contains("rank 0") && err.contains("rank 1"),
        "names the ranks: {err}"
    );
    assert!(start.elapsed().as_secs() < 60, "reported promptly");
}

/// The per-rank memory `inspect` predicts is what rank 0 allocates, class by class, for
/// tensor parallelism and for the distributed optimizer (which shards AdamW state over dp).
#[test]
fn inspect_memory_matches_the_allocated_arenas() {
    for sets in [
        vec!["--set", "parallel.tp=2"],
        vec![
            "--set",
            "parallel.dp=2",
            "--set",
            "parallel.distributed_optimizer=true",
        ],
        // Rank 0 is pipeline stage 0: it allocates its own stage's arenas only.
        vec!["--set", "parallel.pp=2"],
        vec![
            "--set",
            "parallel.pp=2",
            "--set",
            "parallel.dp=2",
            "--set",
            "parallel.distributed_optimizer=true",
        ],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p");
        let report = dir.path().join("r.json");
        let mut args = vec!["compile", "examples/llama-tiny.toml"];
        args.extend(&sets);
        args.extend(["-o", out.to_str().unwrap()]);
        assert!(megac(&args).status.success());
        let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let planned = &v["roles"][0]["memory_bytes"];
        let r = run_report(&out, 1, &report);
        let measured = &r["memory_bytes"];
        for class in ["parameters", "gradients", "optimizer_state"] {
            assert_eq!(planned[class], measured[class], "{sets:?}: {class}");
        }
        assert_eq!(
            planned["activations_peak"], measured["activations"],
            "{sets:?}"
        );
        if sets.contains(&"parallel.pp=2") {
            // The stages split the parameters: together they hold each once.
            let roles = v["roles"].as_array().unwrap();
            assert_eq!(roles.len(), 2);
            // 1F1B: stage 0 keeps min(pp, m) micro-batches in flight, stage 1 one (m = 2
            // micro-batches, 1 with dp = 2).
            let slots = |r: usize| roles[r]["pipeline"]["chunks"][0]["slots"].as_u64();
            let first = if sets.len() == 2 { 2 } else { 1 };
            assert_eq!((slots(0), slots(1)), (Some(first), Some(1)), "{sets:?}");
            let total: u64 = roles
                .iter()
                .map(|r| r["memory_bytes"]["parameters"].as_u64().unwrap())
                .sum();
            let params = 123_712 * 4;
            if sets.len() == 2 {
                assert_eq!(total, params, "{sets:?}");
            } else {
                // ZeRO-1 pads each stage's flat segments to a multiple of dp.
                assert!(total >= params && total < params + 64, "{sets:?}: {total}");
            }
        } else if sets.len() > 2 {
            // AdamW state is half of the unsharded 2 x parameters.
            assert_eq!(
                measured["optimizer_state"].as_u64().unwrap(),
                measured["parameters"].as_u64().unwrap(),
                "{sets:?}"
            );
        }
    }
}

/// With expert parallelism the distributed optimizer shards expert AdamW state over the
/// expert-data-parallel group (edp = dp / ep = 2 here) and the rest over dp (4): inspect's
/// per-rank memory equals the arenas a run allocates, and the state is two moments of each.
#[test]
fn inspect_memory_of_the_expert_distributed_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let report = dir.path().join("r.json");
    let o = megac(&[
        "compile",
        "examples/moe-tiny.toml",
        "--set",
        "parallel.dp=4",
        "--set",
        "parallel.ep=2",
        "--set",
        "parallel.distributed_optimizer=true",
        "--set",
        "train.global_batch=8",
        "--set",
        "train.micro_batch=2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let planned = &v["roles"][0]["memory_bytes"];
    let o = megac(&[
        "run",
        out.to_str().unwrap(),
        "--steps",
        "1",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let measured = &r["memory_bytes"];
    for class in ["parameters", "gradients", "optimizer_state"] {
        assert_eq!(planned[class], measured[class], "{class}");
    }
    // moe-tiny: 2 layers of 4 experts × 3 × 64 × 128 (2 experts per ep rank) and the rest.
    let expert = 2 * 2 * 3 * 64 * 128;
    let plan =
        megac_ir::plan::Plan::from_json(&std::fs::read_to_string(out.join("plan.json")).unwrap())
            .unwrap();
    let local: u64 = plan
        .params
        .iter()
        .map(|p| plan.buffers[p.buffer as usize].len())
        .sum();
    let dense = local - expert;
    assert_eq!(
        measured["optimizer_state"].as_u64().unwrap(),
        2 * 4 * (expert / 2 + dense.div_ceil(4)),
        "expert state over edp = 2, the rest over dp = 4"
    );
}

fn collective_bytes(sets: &[&str]) -> serde_json::Value {
    collective_bytes_of("examples/llama-tiny.toml", sets)
}

fn collective_bytes_of(file: &str, sets: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let mut args = vec!["compile", file];
    for s in sets {
        args.extend(["--set", s]);
    }
    args.extend(["-o", out.to_str().unwrap()]);
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["roles"][0]["collective_bytes_per_step"].clone()
}

/// Bytes each collective moves per step and rank, for the layouts whose collectives are
/// explicit in the plan: data parallelism reduces every gradient once (4 bytes per
/// parameter); the distributed optimizer reduce-scatters and all-gathers the flat (padded)
/// arena instead; tensor parallelism reduces a [micro-batch, seq, hidden] activation
/// 2 times per layer forward and 2 backward, plus the embedding and the output layer;
/// sequence parallelism replaces each of those all-reduces by a gather and a scatter.
#[test]
fn collective_bytes_per_step() {
    let params: u64 = 123_712;
    let act = |mb: u64| mb * 64 * 64 * 4; // one [mb, s=64, h=64] f32 activation
    let v = collective_bytes(&["parallel.dp=2"]);
    assert_eq!(v["all_reduce"].as_u64(), Some(params * 4), "{v}");
    let v = collective_bytes(&["parallel.dp=2", "parallel.distributed_optimizer=true"]);
    assert_eq!(v["reduce_scatter"].as_u64(), Some(params * 4), "{v}");
    // (gathers count the gathered buffer: the whole arena)
    assert_eq!(v["all_gather"].as_u64(), Some(params * 4), "{v}");
    assert!(v.get("all_reduce").is_none(), "{v}");
    // tp2: micro-batch 4, 2 micro-batches per step, 2 layers: (2·2 + 1) forward and
    // (2·2 + 1) backward all-reduces of one activation each per micro-batch.
    let v = collective_bytes(&["parallel.tp=2"]);
    assert_eq!(v["all_reduce"].as_u64(), Some(2 * 10 * act(4)), "{v}");
    // tp2 + sp: gathers and scatters along the sequence of the local [4, 32, 64] halves.
    let v = collective_bytes(&["parallel.tp=2", "parallel.sequence_parallel=true"]);
    assert!(
        v.get("all_reduce").is_none() || v["all_reduce"].as_u64().unwrap() < act(4),
        "{v}"
    );
    assert!(
        v["all_gather"].as_u64().unwrap() > 0 && v["reduce_scatter"].as_u64().unwrap() > 0,
        "{v}"
    );
}

/// Expert parallelism's all-to-all bytes per step and rank: moe-tiny on dp2+ep2 has one
/// micro-batch of 4·64 tokens per rank and step; each of the 2 layers makes 4 all-to-alls
/// (dispatch and combine, forward and backward), each bounded by a [4 experts, 256 rows,
/// 64] f32 buffer of which half belongs to the other rank, plus the 4 token counts (i32).
#[test]
fn all_to_all_bytes_per_step() {
    let v = collective_bytes_of(
        "examples/moe-tiny.toml",
        &["parallel.dp=2", "parallel.ep=2"],
    );
    let buffer = 4 * 256 * 64 * 4;
    assert_eq!(
        v["all_to_all"].as_u64(),
        Some(2 * 4 * (buffer / 2 + 16)),
        "{v}"
    );
}

/// The memory planner's arena is within 5% of the activations live at once (a lower bound
/// for any placement) on the benchmark model and the tiny examples.
#[test]
fn activation_arena_is_close_to_the_live_peak() {
    for file in [
        "bench/llama-bench.toml",
        "examples/llama-tiny.toml",
        "examples/gpt-tiny.toml",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p");
        assert!(megac(&["compile", file, "-o", out.to_str().unwrap()])
            .status
            .success());
        let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let m = &v["roles"][0]["memory_bytes"];
        let (arena, live) = (
            m["activations_peak"].as_u64().unwrap() as f64,
            m["activations_live"].as_u64().unwrap() as f64,
        );
        assert!(
            arena >= live,
            "{file}: the arena cannot be smaller than the live peak"
        );
        assert!(arena <= live * 1.05, "{file}: arena {arena} vs live {live}");
    }
}

/// `megac schedule`: per-rank timelines and the bubble of the model's pipeline layout, with
/// unit costs reproducing the formulas ((p-1)/(m+p-1) of the step for 1F1B; a third of
/// 1F1B's idle time for ZB-H1).
#[test]
fn schedule_shows_timelines_and_the_bubble() {
    let o = megac(&[
        "schedule",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.pp=2",
        "--set",
        "train.global_batch=16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("rank 0 | F0 F1 BW0 F2 BW1 F3 BW2 BW3"),
        "{out}"
    );
    assert!(
        out.contains("bubble fraction 0.2000"),
        "(p-1)/(m+p-1) = 1/5: {out}"
    );
    let o = megac(&[
        "schedule",
        "examples/llama3-70b.toml",
        "--set",
        "parallel.schedule=\"zb-h1\"",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let b = v["bubble_fraction"].as_f64().unwrap();
    // pp 4, 64 micro-batches: (p-1)/(3m+p-1) = 3/195.
    assert!((b - 3.0 / 195.0).abs() < 1e-9, "{b}");
    assert_eq!(v["ranks"].as_array().unwrap().len(), 4);
}

/// A dynamic (dpp) run reports the order rank 0 actually ran: every forward and backward of
/// its chunks exactly once, each backward after its forward, later chunks' backward first.
#[test]
fn dpp_report_records_the_order_it_ran() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    for policy in ["bfs", "dfs", "adaptive", "ordered"] {
        let policy_set = format!("parallel.dpp_policy={policy}");
        let o = megac(&[
            "train",
            "examples/llama-tiny.toml",
            "--set",
            "model.layers=4",
            "--set",
            "parallel.pp=2",
            "--set",
            "parallel.vpp=2",
            "--set",
            "parallel.schedule=dpp",
            "--set",
            &policy_set,
            "--steps",
            "1",
            "--report",
            report.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let order: Vec<String> = r["pipeline_order"]
            .as_array()
            .unwrap_or_else(|| panic!("no pipeline_order: {r}"))
            .iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect();
        // Rank 0 holds chunks 0 and 2; 2 micro-batches.
        let mut want: Vec<String> = ["F", "BW"]
            .iter()
            .flat_map(|k| ["0.0", "0.1", "2.0", "2.1"].map(|c| format!("{k}{c}")))
            .collect();
        let mut got = order.clone();
        want.sort();
        got.sort();
        assert_eq!(got, want, "{policy}: {order:?}");
        let pos = |t: &str| order.iter().position(|x| x == t).unwrap();
        for c in ["0.0", "0.1", "2.0", "2.1"] {
            assert!(
                pos(&format!("F{c}")) < pos(&format!("BW{c}")),
                "{policy}: {order:?}"
            );
        }
        for j in ["0", "1"] {
            assert!(
                pos(&format!("BW2.{j}")) < pos(&format!("BW0.{j}")),
                "{policy}: {order:?}"
            );
        }
    }
}

/// Activation memory is planned in bytes: bf16 activations take half the room of fp32 ones
/// (the loss, norms and statistics stay f32, so a little more than half).
#[test]
fn bf16_activations_take_half_the_arena() {
    let dir = tempfile::tempdir().unwrap();
    let mut peaks = Vec::new();
    for precision in ["fp32", "bf16"] {
        let out = dir.path().join(precision);
        let set = format!("train.precision={precision}");
        let o = megac(&[
            "compile",
            "examples/llama-tiny.toml",
            "--set",
            &set,
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let o = megac(&["inspect", out.to_str().unwrap(), "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let m = &v["roles"][0]["memory_bytes"];
        peaks.push((
            m["activations_peak"].as_u64().unwrap() as f64,
            m["activations_live"].as_u64().unwrap() as f64,
        ));
    }
    let (fp32, bf16) = (peaks[0], peaks[1]);
    for (a, b) in [(fp32.0, bf16.0), (fp32.1, bf16.1)] {
        let ratio = b / a;
        assert!(ratio > 0.5 && ratio < 0.6, "bf16/fp32 activations {ratio}");
    }
}

/// The default build has no MPI (the `mpi` cargo feature is opt-in): `--comm mpi` of `run`
/// and `train` and `megac launch` each fail with one error, before any work, that says how
/// to get a build with MPI; never a panic.
#[cfg(not(feature = "mpi"))]
#[test]
fn without_the_mpi_feature_comm_mpi_and_launch_say_how_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan");
    let plan = plan.to_str().unwrap();
    let o = megac(&["compile", "examples/llama-tiny.toml", "-o", plan]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report = dir.path().join("run.json");
    let report = report.to_str().unwrap();
    let cases: [&[&str]; 5] = [
        &[
            "run", plan, "--comm", "mpi", "--steps", "2", "--report", report,
        ],
        &[
            "train",
            "examples/llama-tiny.toml",
            "--comm",
            "mpi",
            "--steps",
            "2",
        ],
        // Before compiling: a model that does not exist is not the error shown.
        &["train", "no-such-model.toml", "--comm", "mpi"],
        &[
            "launch", "-n", "1", plan, "--steps", "2", "--report", report,
        ],
        &["launch", "-n", "2", "--hostfile", "no-such-hostfile", plan],
    ];
    for args in cases {
        let o = megac(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let what = if args[0] == "launch" {
            "megac launch"
        } else {
            "--comm mpi"
        };
        assert!(
            err.starts_with(&format!("error: {what}: this megac was built without MPI")),
            "{args:?}: {err}"
        );
        assert_eq!(err.matches("error:").count(), 1, "{args:?}: {err}");
        assert!(
            err.contains(
                "apt-get install --no-install-recommends libopenmpi-dev openmpi-bin libclang-dev\n"
            ),
            "{args:?}: {err}"
        );
        assert!(
            err.contains("cargo build --release --features mpi\n"),
            "{args:?}: {err}"
        );
    }
    assert!(!std::path::Path::new(report).exists(), "nothing ran");
}

/// A compiled plan records its model.toml's `[cluster]`; `simulate`, `inspect` and
/// `schedule --costs model` cost it there unless `--cluster` overrides it, and say which.
#[test]
fn plans_remember_their_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let o = megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "--set",
        "cluster.device=\"a100-80g\"",
        "--set",
        "cluster.nodes=1",
        "--set",
        "cluster.gpus_per_node=4",
        "--set",
        "parallel.pp=2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let p = out.to_str().unwrap();
    let o = megac(&["simulate", p, "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["cluster"]["name"], "a100-80g");
    assert_eq!(v["cluster"]["gpus_per_node"], 4);
    assert!(v["cluster"]["source"]
        .as_str()
        .unwrap()
        .ends_with("plan.json [cluster]"));
    let o = megac(&["simulate", p, "--format", "json", "--cluster", "h200"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["cluster"]["name"], "h200");
    let o = megac(&["inspect", p]);
    assert!(
        stdout(&o).contains("cluster      a100-80g ("),
        "{}",
        stdout(&o)
    );
    let o = megac(&["schedule", p, "--costs", "model"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("a100-80g"), "{}", stdout(&o));
    // A device that is no preset is refused when compiling, not later.
    let o = megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "--set",
        "cluster.device=\"tpu\"",
        "--set",
        "cluster.nodes=1",
        "--set",
        "cluster.gpus_per_node=4",
        "-o",
        dir.path().join("q").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cluster.device = \"tpu\" is not a cluster preset"));
    assert!(!dir.path().join("q").exists());
}

/// `megac plan --format json`: best first, each layout as the `--set` arguments that turn the
/// model.toml into it; every one of them compiles to a plan of that layout.
#[test]
fn plan_json_lists_layouts_as_set_arguments_that_compile() {
    let o = megac(&[
        "plan",
        "examples/llama-tiny.toml",
        "--gpus",
        "4",
        "--top",
        "5",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["searched"].as_u64().unwrap() >= 5);
    assert!(v["seconds"].as_f64().unwrap() >= 0.0);
    let layouts = v["layouts"].as_array().unwrap();
    assert_eq!(layouts.len(), 5);
    let times: Vec<f64> = layouts
        .iter()
        .map(|l| l["step_seconds"].as_f64().unwrap())
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "best first: {times:?}"
    );
    for l in layouts {
        assert!(l["peak_memory_bytes"].as_u64().unwrap() > 0);
        assert!(l["mfu"].as_f64().unwrap() > 0.0 && l["tokens_per_s"].as_f64().unwrap() > 0.0);
        let sets: Vec<&str> = l["set"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        let mut args = vec!["check", "examples/llama-tiny.toml"];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let o = megac(&args);
        assert!(o.status.success(), "{sets:?}: {}", stderr(&o));
        // tp·pp·dp·cp is the 4 GPUs asked for.
        let size = |k: &str| -> u64 {
            sets.iter()
                .find_map(|s| s.strip_prefix(&format!("parallel.{k}=")))
                .unwrap()
                .parse()
                .unwrap()
        };
        assert_eq!(
            size("tp") * size("pp") * size("dp") * size("cp"),
            4,
            "{sets:?}"
        );
    }
    // The text output keeps its last line.
    let o = megac(&["plan", "examples/llama-tiny.toml", "--gpus", "4"]);
    let text = stdout(&o);
    let last = text.lines().last().unwrap();
    assert!(
        last.starts_with("searched ") && last.contains(" layouts in "),
        "{last}"
    );
}

/// `megac run PLAN --steps N --report REPORT`, which must succeed; the report.
fn run_report(plan: &std::path::Path, steps: u32, report: &std::path::Path) -> serde_json::Value {
    let steps = steps.to_string();
    let o = megac(&[
        "run",
        plan.to_str().unwrap(),
        "--steps",
        &steps,
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap()
}

/// A build without the `mlir` feature answers `--emit mlir` with one error naming the
/// feature, before compiling or writing anything.
#[cfg(not(feature = "mlir"))]
#[test]
fn emit_mlir_without_the_feature_is_one_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan");
    let o = megac(&[
        "compile",
        "examples/llama-tiny.toml",
        "--emit",
        "mlir",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("`mlir` feature"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!out.exists(), "nothing written");
}

/// `--deterministic` only changes MPI runs: local threads reduce in group order anyway, so
/// a local run with it reports the same losses and norms, bit for bit.
#[test]
fn deterministic_changes_nothing_on_local_threads() {
    let dir = tempfile::tempdir().unwrap();
    let reports: Vec<_> = [false, true]
        .iter()
        .map(|&det| {
            let report = dir.path().join(format!("r{det}.json"));
            let mut args = vec![
                "train",
                "examples/llama-tiny.toml",
                "--set",
                "parallel.dp=2",
                "--steps",
                "2",
                "--report",
                report.to_str().unwrap(),
            ];
            if det {
                args.push("--deterministic");
            }
            let o = megac(&args);
            assert!(o.status.success(), "{}", stderr(&o));
            read_report(&report)
        })
        .collect();
    assert_eq!(reports[0].len(), 2);
    assert_eq!(reports[0], reports[1]);
}
