//! Plan fingerprints: every example and every layout the layout and plan-validator tests
//! compile must keep compiling to the same bytes. Each case's `plan.json` (the bytes
//! `megac compile` writes, `Plan::to_json`) is hashed with 64-bit FNV-1a and compared with
//! `tests/plan-fingerprints.txt` (one line per case: name, hash, byte length, tab-separated).
//! The simulator's side of the same rules is fingerprinted too: the layouts `megac plan`
//! enumerates and ranks, the simulated reports of pipelined plans (every DPP policy), and
//! `megac schedule`'s text.
//!
//! A refactor must leave the file unchanged. A deliberate change to the plans re-blesses it
//! with `MEGAC_BLESS=1 cargo test --test plan_fingerprints` and says why in its commit.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use megac_sim::cluster::Cluster;
use megac_sim::cost::CostModel;

/// 64-bit FNV-1a of `bytes`.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn spec(file: &str, sets: &[&str]) -> megac_ir::spec::ModelSpec {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    megac_frontend::load(&root().join(file), &sets).unwrap_or_else(|e| panic!("{}", e.render()))
}

/// Compile as `megac compile` does.
fn plan(file: &str, sets: &[&str]) -> megac_ir::plan::Plan {
    let spec = spec(file, sets);
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"))
}

const BASE: &[&str] = &["train.micro_batch=2", "train.global_batch=8"];
const PIPE: &[&str] = &[
    "train.micro_batch=2",
    "train.global_batch=8",
    "model.layers=8",
];

/// An example, its base overrides, and the layouts compiled on top of the base.
type PlanCase = (
    &'static str,
    &'static [&'static str],
    Vec<Vec<&'static str>>,
);

/// Every example as it is, and the layouts of tests/layouts.rs and tests/check_plan.rs.
fn plan_cases() -> Vec<PlanCase> {
    let no_sets: &'static [&'static str] = &[];
    vec![
        // Every example as it is (the real-size ones included).
        ("examples/gpt-tiny.toml", no_sets, vec![vec![]]),
        (
            "examples/gpt3-175b.toml",
            no_sets,
            vec![vec![], vec!["parallel.vpp=1", "parallel.schedule=1f1b"]],
        ),
        ("examples/llama-tiny.toml", no_sets, vec![vec![]]),
        ("examples/llama3-70b.toml", no_sets, vec![vec![]]),
        ("examples/llama3-8b.toml", no_sets, vec![vec![]]),
        ("examples/mixtral-8x7b.toml", no_sets, vec![vec![]]),
        ("examples/moe-tiny.toml", no_sets, vec![vec![]]),
        ("bench/gpt-1t.toml", no_sets, vec![vec![]]),
        // tests/layouts.rs and tests/check_plan.rs without pipelines.
        (
            "examples/llama-tiny.toml",
            BASE,
            vec![
                vec![],
                vec!["parallel.dp=2"],
                vec!["parallel.dp=4"],
                vec!["parallel.dp=2", "parallel.distributed_optimizer=true"],
                vec!["parallel.dp=4", "parallel.distributed_optimizer=true"],
                vec!["parallel.tp=2"],
                vec!["parallel.tp=2", "parallel.dp=2"],
                vec!["parallel.tp=4"],
                vec!["parallel.tp=4", "parallel.sequence_parallel=true"],
                vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
                vec![
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec![
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.order=\"dp-tp-cp-ep-pp\"",
                ],
                vec!["parallel.cp=2"],
                vec!["parallel.cp=4"],
                vec!["parallel.cp=2", "parallel.tp=2"],
                vec!["parallel.cp=2", "parallel.dp=2"],
                vec!["parallel.tp=2", "parallel.dp=2", "parallel.cp=2"],
                vec![
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.distributed_optimizer=true",
                ],
                vec![
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.sequence_parallel=true",
                    "parallel.distributed_optimizer=true",
                ],
                vec![
                    "parallel.cp=2",
                    "parallel.dp=2",
                    "parallel.distributed_optimizer=true",
                ],
                vec!["model.vocab=250", "parallel.tp=2"],
                vec![
                    "model.vocab=250",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec!["train.recompute=\"selective\"", "parallel.tp=2"],
                vec!["train.recompute=\"full\"", "parallel.dp=2"],
            ],
        ),
        (
            "examples/gpt-tiny.toml",
            BASE,
            vec![
                vec![],
                vec!["parallel.dp=2"],
                vec!["parallel.dp=2", "parallel.distributed_optimizer=true"],
                vec!["parallel.tp=2"],
                vec!["parallel.tp=4"],
                vec!["parallel.tp=2", "parallel.dp=2"],
                vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
                vec!["parallel.tp=4", "parallel.sequence_parallel=true"],
                vec!["model.tie_embeddings=false", "parallel.tp=2"],
                vec![
                    "model.tie_embeddings=false",
                    "parallel.tp=2",
                    "parallel.pp=2",
                ],
                vec!["model.layers=4", "parallel.pp=2"],
                vec!["model.layers=4", "parallel.pp=4", "parallel.schedule=zb-h1"],
                vec![
                    "model.layers=4",
                    "parallel.pp=2",
                    "parallel.dp=2",
                    "parallel.distributed_optimizer=true",
                ],
                vec!["model.layers=4", "parallel.pp=2", "parallel.fbd=true"],
            ],
        ),
        (
            "examples/moe-tiny.toml",
            BASE,
            vec![
                vec![],
                vec!["parallel.dp=2"],
                vec!["parallel.dp=2", "parallel.distributed_optimizer=true"],
                vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
                vec!["parallel.tp=4", "parallel.sequence_parallel=true"],
                vec![
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec![
                    "model.moe.capacity_factor=1.0",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec!["parallel.dp=2", "parallel.ep=2"],
                vec!["parallel.dp=4", "parallel.ep=2"],
                vec!["parallel.dp=4", "parallel.ep=4"],
                vec![
                    "model.moe.capacity_factor=1.0",
                    "parallel.dp=2",
                    "parallel.ep=2",
                ],
                vec!["parallel.cp=2"],
                vec!["parallel.cp=2", "parallel.ep=2"],
                vec!["parallel.cp=2", "parallel.dp=2", "parallel.ep=4"],
                vec![
                    "parallel.dp=2",
                    "parallel.ep=2",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec![
                    "parallel.dp=2",
                    "parallel.ep=2",
                    "parallel.distributed_optimizer=true",
                ],
                vec![
                    "parallel.dp=4",
                    "parallel.ep=4",
                    "parallel.distributed_optimizer=true",
                ],
                vec![
                    "parallel.dp=2",
                    "parallel.ep=2",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                    "parallel.distributed_optimizer=true",
                ],
                vec![
                    "parallel.cp=2",
                    "parallel.dp=2",
                    "parallel.ep=2",
                    "parallel.distributed_optimizer=true",
                ],
                vec!["parallel.pp=2"],
                vec!["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
                vec![
                    "parallel.pp=2",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.dp=2",
                    "parallel.ep=2",
                    "parallel.distributed_optimizer=true",
                ],
            ],
        ),
        // Pipelines: every schedule, the DPP policies, FBD, with tp/sp/dp/cp.
        (
            "examples/llama-tiny.toml",
            PIPE,
            vec![
                vec!["parallel.pp=2"],
                vec!["parallel.pp=4"],
                vec!["parallel.pp=4", "parallel.stage_layers=[1, 3, 3, 1]"],
                vec!["parallel.pp=2", "parallel.schedule=gpipe"],
                vec!["parallel.pp=4", "parallel.schedule=gpipe"],
                vec!["parallel.pp=2", "parallel.schedule=1f1b"],
                vec![
                    "parallel.pp=4",
                    "parallel.schedule=1f1b",
                    "train.global_batch=16",
                ],
                vec!["parallel.pp=2", "parallel.schedule=zb-h1"],
                vec!["parallel.pp=4", "parallel.schedule=zb-h1"],
                vec![
                    "parallel.pp=4",
                    "parallel.schedule=zb-h1",
                    "train.global_batch=16",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.vpp=2",
                    "parallel.schedule=interleaved",
                ],
                vec![
                    "parallel.pp=4",
                    "parallel.vpp=2",
                    "parallel.schedule=interleaved",
                ],
                vec![
                    "parallel.pp=4",
                    "parallel.vpp=2",
                    "parallel.schedule=interleaved",
                    "train.global_batch=16",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=bfs",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=dfs",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=adaptive",
                ],
                vec![
                    "parallel.pp=4",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=bfs",
                ],
                vec![
                    "parallel.pp=4",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=dfs",
                ],
                vec![
                    "parallel.pp=4",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=adaptive",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.vpp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=bfs",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.vpp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=dfs",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.vpp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=adaptive",
                ],
                vec![
                    "parallel.pp=4",
                    "parallel.vpp=2",
                    "parallel.schedule=dpp",
                    "parallel.dpp_policy=adaptive",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.vpp=2",
                    "parallel.schedule=dpp",
                    "parallel.tp=2",
                    "parallel.cp=2",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.sequence_parallel=true",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.tp=2",
                    "parallel.dp=2",
                    "parallel.sequence_parallel=true",
                    "parallel.distributed_optimizer=true",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.vpp=2",
                    "parallel.schedule=interleaved",
                    "parallel.tp=2",
                    "parallel.dp=2",
                ],
                vec!["parallel.pp=2", "parallel.fbd=true"],
                vec![
                    "parallel.pp=4",
                    "parallel.fbd=true",
                    "parallel.schedule=zb-h1",
                ],
                vec![
                    "parallel.pp=2",
                    "parallel.fbd=true",
                    "parallel.tp=2",
                    "parallel.dp=2",
                ],
                vec![
                    "model.layers=6",
                    "parallel.pp=4",
                    "parallel.stage_layers=\"balanced\"",
                ],
            ],
        ),
    ]
}

/// (example, overrides, GPUs) for the layout search.
const SEARCHES: &[(&str, &[&str], u64)] = &[
    ("examples/llama3-8b.toml", &[], 8),
    ("examples/llama3-8b.toml", &[], 64),
    ("examples/llama3-70b.toml", &[], 64),
    ("examples/gpt3-175b.toml", &[], 512),
    ("examples/mixtral-8x7b.toml", &[], 64),
    ("examples/llama-tiny.toml", &[], 8),
    ("examples/moe-tiny.toml", &[], 8),
    ("examples/gpt-tiny.toml", &[], 4),
];

/// Every case's name and bytes.
fn cases() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (file, base, layouts) in plan_cases() {
        for layout in layouts {
            let sets: Vec<&str> = base.iter().chain(&layout).copied().collect();
            let name = format!("plan {file} {}", sets.join(" "));
            let plan = plan(file, &sets);
            out.push((name.trim_end().to_string(), plan.to_json().into_bytes()));
        }
    }
    let cost = CostModel::new(Cluster::preset("h100-sxm").unwrap());
    for &(file, sets, gpus) in SEARCHES {
        let spec = spec(file, sets);
        let layouts = megac_sim::search::enumerate(&spec, gpus);
        let mut text = String::new();
        for l in &layouts {
            writeln!(text, "{l:?}").unwrap();
        }
        out.push((format!("enumerate {file} gpus={gpus}"), text.into_bytes()));
        let mut text = String::new();
        for l in &layouts {
            writeln!(text, "{:?}", megac_sim::model::estimate(&spec, l, &cost)).unwrap();
        }
        out.push((format!("estimate {file} gpus={gpus}"), text.into_bytes()));
    }
    let dpp: &[&[&str]] = &[
        &[
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            "parallel.dpp_policy=bfs",
        ],
        &[
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            "parallel.dpp_policy=dfs",
        ],
        &[
            "parallel.pp=4",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
            "parallel.dpp_policy=adaptive",
        ],
        &[
            "parallel.pp=4",
            "parallel.schedule=dpp",
            "parallel.dpp_policy=adaptive",
        ],
        &["parallel.pp=4", "parallel.schedule=1f1b"],
    ];
    for layout in dpp {
        let sets: Vec<&str> = PIPE.iter().chain(layout.iter()).copied().collect();
        let file = "examples/llama-tiny.toml";
        let report = megac_sim::simulate::simulate(&plan(file, &sets), &cost, false)
            .unwrap()
            .report
            .to_json();
        out.push((
            format!("simulate {file} {}", sets.join(" ")),
            report.to_string().into_bytes(),
        ));
        let mut args = vec!["schedule", file, "--comm"];
        for s in &sets {
            args.extend(["--set", s]);
        }
        for costs in ["unit", "model"] {
            let mut args = args.clone();
            args.extend(["--costs", costs]);
            let o = Command::new(env!("CARGO_BIN_EXE_megac"))
                .args(&args)
                .current_dir(root())
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            out.push((
                format!("schedule --costs {costs} {file} {}", sets.join(" ")),
                o.stdout,
            ));
        }
    }
    out
}

#[test]
fn plans_are_byte_identical() {
    let mut got = String::new();
    for (name, bytes) in cases() {
        assert!(!name.contains('\t') && !name.contains('\n'), "{name}");
        writeln!(got, "{name}\t{:016x}\t{}", fnv1a(&bytes), bytes.len()).unwrap();
    }
    let path = root().join("tests/plan-fingerprints.txt");
    if std::env::var_os("MEGAC_BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (bless it with MEGAC_BLESS=1)", path.display()));
    let want: Vec<&str> = want.lines().collect();
    let mut changed = Vec::new();
    for line in got.lines() {
        if !want.contains(&line) {
            changed.push(format!("  now {line}"));
        }
    }
    for line in &want {
        if !got.lines().any(|l| l == *line) {
            changed.push(format!("  was {line}"));
        }
    }
    assert!(
        changed.is_empty(),
        "compiled bytes changed (a refactor must keep them; a fix re-blesses with MEGAC_BLESS=1):\n{}",
        changed.join("\n")
    );
}

#[test]
fn fnv1a_matches_the_reference_values() {
    assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
}
