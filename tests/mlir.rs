//! MLIR emission (feature `mlir`, `megac compile --emit mlir`): every example and every
//! layout family (tp, sp, pp schedules with interleaving and zero-bubble, FBD, dp with the
//! distributed optimizer, cp, ep, bf16/fp16) gives one module per role that MLIR parses and
//! verifies, and every such module survives a round trip through `mlir-opt-22` (skipped when
//! it is not installed, unless `MEGAC_REQUIRE_MLIR_OPT` is set, as scripts/test.sh does);
//! snapshots (`tests/snapshots/mlir__*.snap`) pin the tiny examples' modules.

use std::path::{Path, PathBuf};
use std::process::Command;

use megac_codegen::mlir;
use megac_ir::plan::Plan;

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

/// Every role's module verifies; returns them.
fn modules(file: &str, sets: &[&str]) -> Vec<(String, String)> {
    let p = plan(file, sets);
    let m = mlir::emit_modules(&p).unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    assert_eq!(m.len(), p.roles.len());
    for ((name, text), role) in m.iter().zip(&p.roles) {
        assert_eq!(name, &format!("role-{}.mlir", role.name));
        // One function per program.
        let mut programs = 2;
        if let Some(pipe) = &role.pipeline {
            programs += 3 * pipe.chunks.len();
        }
        let funcs = text.matches("func.func @").count();
        assert_eq!(funcs, programs, "{file} {sets:?} {name}");
    }
    m
}

#[test]
fn every_example_verifies() {
    let mut examples: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    examples.sort();
    assert!(examples.len() >= 10, "{examples:?}");
    for e in examples {
        let rel = e
            .strip_prefix(root())
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        let m = modules(&rel, &[]);
        round_trip(&rel, &[], &m);
    }
}

const BASE: &[&str] = &["train.micro_batch=2", "train.global_batch=8"];

/// The layout families: (example, overrides on top of BASE).
fn layouts() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("examples/llama-tiny.toml", vec!["parallel.tp=2"]),
        (
            "examples/llama-tiny.toml",
            vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
        (
            "examples/llama-tiny.toml",
            vec!["parallel.dp=2", "parallel.distributed_optimizer=true"],
        ),
        (
            "examples/llama-tiny.toml",
            vec![
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
                "parallel.sequence_parallel=true",
            ],
        ),
        ("examples/llama-tiny.toml", vec!["parallel.cp=2"]),
        (
            "examples/llama-tiny.toml",
            vec!["parallel.cp=2", "parallel.tp=2", "parallel.dp=2"],
        ),
        ("examples/llama-tiny.toml", vec!["train.precision=\"bf16\""]),
        (
            "examples/llama-tiny.toml",
            vec![
                "train.precision=\"bf16\"",
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
            ],
        ),
        ("examples/llama-tiny.toml", vec!["train.precision=\"fp16\""]),
        (
            "examples/llama-tiny.toml",
            vec!["model.layers=4", "parallel.pp=2"],
        ),
        (
            "examples/llama-tiny.toml",
            vec!["model.layers=4", "parallel.pp=2", "parallel.schedule=gpipe"],
        ),
        (
            "examples/llama-tiny.toml",
            vec!["model.layers=4", "parallel.pp=2", "parallel.schedule=1f1b"],
        ),
        (
            "examples/llama-tiny.toml",
            vec![
                "model.layers=8",
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.schedule=interleaved",
            ],
        ),
        (
            "examples/llama-tiny.toml",
            vec!["model.layers=4", "parallel.pp=2", "parallel.schedule=zb-h1"],
        ),
        (
            "examples/llama-tiny.toml",
            vec!["model.layers=4", "parallel.pp=2", "parallel.schedule=dpp"],
        ),
        (
            "examples/llama-tiny.toml",
            vec![
                "model.layers=4",
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
            ],
        ),
        ("examples/gpt-tiny.toml", vec!["parallel.tp=2"]),
        (
            "examples/gpt-tiny.toml",
            vec!["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
        (
            "examples/gpt-tiny.toml",
            vec!["model.layers=4", "parallel.pp=2", "parallel.fbd=true"],
        ),
        (
            "examples/gpt-tiny.toml",
            vec!["model.layers=4", "parallel.pp=4", "parallel.schedule=zb-h1"],
        ),
        ("examples/gpt-tiny.toml", vec!["parallel.cp=2"]),
        (
            "examples/moe-tiny.toml",
            vec!["parallel.dp=2", "parallel.ep=2"],
        ),
        (
            "examples/moe-tiny.toml",
            vec![
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.distributed_optimizer=true",
            ],
        ),
        (
            "examples/moe-tiny.toml",
            vec!["parallel.cp=2", "parallel.ep=2"],
        ),
        (
            "examples/moe-tiny.toml",
            vec!["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
        ),
        (
            "examples/moe-tiny.toml",
            vec![
                "model.moe.capacity_factor=1.0",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
        ),
    ]
}

#[test]
fn every_layout_family_verifies() {
    for (file, sets) in layouts() {
        let sets: Vec<&str> = BASE.iter().copied().chain(sets).collect();
        let m = modules(file, &sets);
        round_trip(file, &sets, &m);
        let all: String = m.iter().map(|(_, t)| t.as_str()).collect();
        let has = |s: &str| all.contains(s);
        // What each family must show.
        if sets.iter().any(|s| s.contains("tp=2")) {
            assert!(has("megac.group = \"tp\""), "{file} {sets:?}");
        }
        if sets.iter().any(|s| s.contains("pp=")) {
            assert!(
                has("@megac.send.") && has("@megac.recv."),
                "{file} {sets:?}"
            );
            assert!(has("megac.slot"), "{file} {sets:?}");
        }
        if sets.iter().any(|s| s.contains("distributed_optimizer")) {
            assert!(has("megac.rank_index"), "{file} {sets:?}");
            assert!(
                has("megac.reduce_scatter") && has("megac.all_gather"),
                "{file} {sets:?}"
            );
        }
        if sets.iter().any(|s| s.contains("ep=2")) {
            assert!(has("megac.all_to_all"), "{file} {sets:?}");
        }
        if sets.iter().any(|s| s.contains("bf16")) {
            assert!(has("xbf16>") && has("arith.truncf"), "{file} {sets:?}");
        }
        if sets.iter().any(|s| s.contains("zb-h1")) {
            assert!(
                all.lines()
                    .any(|l| l.contains("@chunk") && l.contains("_weight")),
                "{file} {sets:?}"
            );
        }
    }
}

#[test]
fn modules_are_linalg_on_arena_views() {
    let m = modules("examples/llama-tiny.toml", &[]);
    let (_, text) = &m[0];
    // One arena argument per class.
    for class in ["param", "grad", "opt_state", "activation", "input"] {
        assert!(
            text.contains(&format!("megac.arena = \"{class}\"")),
            "{class}"
        );
    }
    assert!(text.contains("memref.view"));
    assert!(text.contains("linalg.generic"));
    assert!(
        text.contains("math.rsqrt"),
        "rms_norm lowers to linalg with math"
    );
    assert!(
        text.contains("math.exp"),
        "swiglu lowers to linalg with math"
    );
    // The matmuls are contractions, not kernel calls.
    assert!(!text.contains("megac.kernel.linear"));
    assert!(!text.contains("megac.kernel.swiglu"));
    // Kernels without a lowering are declared runtime symbols.
    assert!(text.contains("func.func private @megac.kernel.causal_attention.f32("));
}

#[test]
fn emission_is_deterministic() {
    let p = plan(
        "examples/moe-tiny.toml",
        &["parallel.dp=2", "parallel.ep=2"],
    );
    assert_eq!(
        mlir::emit_modules(&p).unwrap(),
        mlir::emit_modules(&p).unwrap()
    );
}

#[test]
fn a_broken_module_is_one_error_naming_the_stage() {
    let err = mlir::verify::canonical("module { func.func @f() { %0 = arith.addf } }").unwrap_err();
    assert_eq!(err.0, "parse");
    assert!(!err.1.is_empty());
    let err = mlir::verify::canonical(
        "module { func.func @f(%a: memref<4xf32>) { %c = arith.constant 0 : index\n %v = memref.load %a[%c, %c] : memref<4xf32>\n return } }",
    )
    .unwrap_err();
    assert_ne!(err.1, "(no diagnostics)");
}

/// `mlir-opt-22` on PATH or in /usr/lib/llvm-22/bin, found once. Missing, the round trips
/// are skipped, unless `MEGAC_REQUIRE_MLIR_OPT` is set (scripts/test.sh, which installs
/// mlir-22-tools): then a missing tool fails the test.
fn mlir_opt() -> Option<&'static Path> {
    static OPT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    let opt = OPT.get_or_init(|| {
        let found = find_mlir_opt();
        if found.is_none() {
            assert!(
                std::env::var_os("MEGAC_REQUIRE_MLIR_OPT").is_none(),
                "MEGAC_REQUIRE_MLIR_OPT is set but mlir-opt-22 is not installed (apt-get install mlir-22-tools)"
            );
            eprintln!("mlir-opt-22 not found: round trips skipped (scripts/test.sh installs mlir-22-tools)");
        }
        found
    });
    opt.as_deref()
}

/// Each module through `mlir-opt-22 --verify-each`: MLIR's own tool accepts it, and what it
/// prints parses back to the same module.
fn round_trip(file: &str, sets: &[&str], modules: &[(String, String)]) {
    let Some(opt) = mlir_opt() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in modules {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = Command::new(opt)
            .arg("--verify-each")
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{file} {sets:?} {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let reprinted = String::from_utf8(out.stdout).unwrap();
        let again = mlir::verify::canonical(&reprinted).unwrap();
        assert_eq!(&again, text, "{file} {sets:?} {name}");
    }
}

fn find_mlir_opt() -> Option<PathBuf> {
    let candidates = [
        PathBuf::from("mlir-opt-22"),
        PathBuf::from("/usr/lib/llvm-22/bin/mlir-opt"),
    ];
    candidates.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn snapshot_the_tiny_examples() {
    for (name, file) in [
        ("llama-tiny", "examples/llama-tiny.toml"),
        ("gpt-tiny", "examples/gpt-tiny.toml"),
        ("moe-tiny", "examples/moe-tiny.toml"),
    ] {
        let m = modules(file, &[]);
        assert_eq!(m.len(), 1);
        insta::assert_snapshot!(name, m[0].1);
    }
}

#[test]
fn compile_emit_mlir_writes_a_module_per_role_beside_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan");
    let o = Command::new(env!("CARGO_BIN_EXE_megac"))
        .args([
            "compile",
            "examples/llama-tiny.toml",
            "--set",
            "parallel.pp=2",
            "--emit",
            "mlir",
            "-o",
        ])
        .arg(&out)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("plan.json").exists());
    let p = megac_ir::plan::Plan::load(&out.join("plan.json")).unwrap();
    for r in &p.plan().roles {
        let text = std::fs::read_to_string(out.join(format!("role-{}.mlir", r.name))).unwrap();
        mlir::verify::canonical(&text).unwrap();
    }
}

// ---- The lowerings compute what the Rust kernels compute: each lowered kernel of the tiny
// ---- examples, alone in a function, JIT-compiled by MLIR and run on random arenas, against
// ---- megac_kernels on the same data.

use megac_ir::plan::{BufId, Instr};
use megac_ir::OpKind;
use megac_kernels as k;

/// SplitMix64 in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn read(p: &Plan, arenas: &[Vec<u8>; 5], b: BufId) -> Vec<f32> {
    let buf = &p.buffers[b as usize];
    let a = &arenas[buf.class.index()];
    let at = (buf.offset * 4) as usize;
    (0..buf.len() as usize)
        .map(|i| f32::from_le_bytes(a[at + 4 * i..at + 4 * i + 4].try_into().unwrap()))
        .collect()
}

fn read_i32(p: &Plan, arenas: &[Vec<u8>; 5], b: BufId) -> Vec<i32> {
    read(p, arenas, b)
        .iter()
        .map(|x| x.to_bits() as i32)
        .collect()
}

fn write(p: &Plan, arenas: &mut [Vec<u8>; 5], b: BufId, v: &[f32]) {
    let buf = &p.buffers[b as usize];
    let a = &mut arenas[buf.class.index()];
    let at = (buf.offset * 4) as usize;
    for (i, x) in v.iter().enumerate() {
        a[at + 4 * i..at + 4 * i + 4].copy_from_slice(&x.to_le_bytes());
    }
}

fn layout(w: megac_ir::op::WeightLayout) -> k::WeightLayout {
    match w {
        megac_ir::op::WeightLayout::OutIn => k::WeightLayout::OutIn,
        megac_ir::op::WeightLayout::InOut => k::WeightLayout::InOut,
    }
}

/// The Rust kernel of `instr` on `arenas` (f32 plans without a split: the tiny examples).
fn reference(p: &Plan, arenas: &mut [Vec<u8>; 5], instr: &Instr) {
    let Instr::Kernel {
        op,
        inputs,
        outputs,
        ..
    } = instr
    else {
        unreachable!()
    };
    let r = |b: BufId| read(p, arenas, b);
    let shape = |b: BufId| p.buffers[b as usize].shape.clone();
    let last = |b: BufId| *shape(b).last().unwrap() as usize;
    let len = |b: BufId| p.buffers[b as usize].len() as usize;
    let mut outs: Vec<Vec<f32>> = outputs.iter().map(|&b| r(b)).collect();
    match op {
        OpKind::Embedding => {
            let ids = read_i32(p, arenas, inputs[0]);
            k::embedding_fwd(&ids, &r(inputs[1]), last(inputs[1]), &mut outs[0]);
        }
        OpKind::PosEmbedding => {
            let s = shape(inputs[0]);
            let (b, sl, h) = (s[0] as usize, s[1] as usize, s[2] as usize);
            k::pos_embedding_fwd(&r(inputs[0]), &r(inputs[1]), b, sl, h, &mut outs[0]);
        }
        OpKind::RmsNorm { eps } => {
            let h = last(inputs[0]);
            k::rms_norm_fwd(
                &r(inputs[0]),
                &r(inputs[1]),
                *eps as f32,
                len(inputs[0]) / h,
                h,
                &mut outs[0],
            );
        }
        OpKind::RmsNormGrad { eps } => {
            let h = last(inputs[0]);
            let (a, b) = outs.split_at_mut(1);
            k::rms_norm_bwd(
                &r(inputs[0]),
                &r(inputs[1]),
                &r(inputs[2]),
                *eps as f32,
                len(inputs[0]) / h,
                h,
                &mut a[0],
                &mut b[0],
            );
        }
        OpKind::LayerNorm { eps } => {
            let h = last(inputs[0]);
            k::layer_norm_fwd(
                &r(inputs[0]),
                &r(inputs[1]),
                &r(inputs[2]),
                *eps as f32,
                len(inputs[0]) / h,
                h,
                &mut outs[0],
            );
        }
        OpKind::Linear { weight } => {
            let (kk, n) = (last(inputs[0]), last(outputs[0]));
            let bias = inputs.get(2).map(|&b| r(b));
            k::linear_fwd(
                &r(inputs[0]),
                &r(inputs[1]),
                bias.as_deref(),
                &mut outs[0],
                len(inputs[0]) / kk,
                kk,
                n,
                layout(*weight),
            );
        }
        OpKind::LinearGradInput { weight } => {
            let (n, kk) = (last(inputs[0]), last(outputs[0]));
            k::linear_bwd_data(
                &r(inputs[0]),
                &r(inputs[1]),
                &mut outs[0],
                len(inputs[0]) / n,
                kk,
                n,
                layout(*weight),
            );
        }
        OpKind::LinearGradWeight { weight } => {
            let (kk, n) = (last(inputs[0]), last(inputs[1]));
            k::linear_bwd_weight(
                &r(inputs[0]),
                &r(inputs[1]),
                &mut outs[0],
                None,
                len(inputs[0]) / kk,
                kk,
                n,
                layout(*weight),
            );
        }
        OpKind::BiasGrad => {
            let n = last(inputs[0]);
            for (i, v) in r(inputs[0]).iter().enumerate() {
                outs[0][i % n] += v;
            }
        }
        OpKind::Add => k::add_fwd(&r(inputs[0]), &r(inputs[1]), &mut outs[0]),
        OpKind::GradSum => {
            for &x in inputs {
                k::accumulate(&mut outs[0], &r(x));
            }
        }
        OpKind::SwiGlu => k::swiglu_fwd(&r(inputs[0]), &r(inputs[1]), &mut outs[0]),
        OpKind::SwiGluGrad => {
            let (a, b) = outs.split_at_mut(1);
            k::swiglu_bwd(
                &r(inputs[0]),
                &r(inputs[1]),
                &r(inputs[2]),
                &mut a[0],
                &mut b[0],
            );
        }
        OpKind::GeluTanh => k::gelu_tanh_fwd(&r(inputs[0]), &mut outs[0]),
        OpKind::GeluTanhGrad => k::gelu_tanh_bwd(&r(inputs[0]), &r(inputs[1]), &mut outs[0]),
        other => panic!("no reference for {}", other.name()),
    }
    for (&b, v) in outputs.iter().zip(&outs) {
        write(p, arenas, b, v);
    }
}

#[test]
fn lowered_kernels_compute_what_the_rust_kernels_compute() {
    use megac_codegen::mlir::jit::Jit;
    let ops = [
        "embedding",
        "pos_embedding",
        "rms_norm",
        "rms_norm_grad",
        "layer_norm",
        "linear",
        "linear_grad_input",
        "linear_grad_weight",
        "bias_grad",
        "add",
        "grad_sum",
        "swiglu",
        "swiglu_grad",
        "gelu_tanh",
        "gelu_tanh_grad",
    ];
    let mut seen = std::collections::BTreeSet::new();
    for file in ["examples/llama-tiny.toml", "examples/gpt-tiny.toml"] {
        let p = plan(file, &[]);
        let role = &p.roles[0];
        // First instance of each op, and every distinct linear form (bias, weight layout).
        let mut picked: Vec<(String, &Instr)> = Vec::new();
        for i in &role.microbatch {
            let Instr::Kernel { op, inputs, .. } = i else {
                continue;
            };
            let key = format!("{} {:?} {}", op.name(), op.attrs(), inputs.len());
            if ops.contains(&op.name()) && !picked.iter().any(|(k, _)| *k == key) {
                picked.push((key, i));
            }
        }
        for (key, instr) in picked {
            let (src, bytes, extras) =
                mlir::function_source(&p, 0, "kernel", std::slice::from_ref(instr));
            assert!(extras.is_empty());
            let jit = Jit::compile(&src, bytes, 0).unwrap_or_else(|e| panic!("{key}: {e}"));
            let mut rng = Rng(7);
            let mut arenas: [Vec<u8>; 5] = bytes.map(|n| vec![0u8; n as usize]);
            for (c, a) in arenas.iter_mut().enumerate() {
                for w in a.chunks_exact_mut(4) {
                    let v = if c == 4 {
                        (rng.next() % p.batch.vocab) as i32 as u32
                    } else {
                        rng.unit().to_bits()
                    };
                    w.copy_from_slice(&v.to_le_bytes());
                }
            }
            let mut want = arenas.clone();
            reference(&p, &mut want, instr);
            let mut got = arenas.clone();
            {
                let [a0, a1, a2, a3, a4] = &mut got;
                let mut views: [&mut [u8]; 5] = [a0, a1, a2, a3, a4];
                jit.call("kernel", &mut views, &[]).unwrap();
            }
            let Instr::Kernel { outputs, .. } = instr else {
                unreachable!()
            };
            for &o in outputs {
                let (g, w) = (read(&p, &got, o), read(&p, &want, o));
                let worst = g
                    .iter()
                    .zip(&w)
                    .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                    .fold(0.0f32, f32::max);
                assert!(worst < 2e-5, "{file} {key}: output {o} differs by {worst}");
            }
            seen.insert(key.split(' ').next().unwrap().to_string());
        }
    }
    let missing: Vec<&&str> = ops.iter().filter(|o| !seen.contains(**o)).collect();
    assert!(missing.is_empty(), "not exercised: {missing:?}");
}

/// Every op kind has a form: a kernel with a lowering is linalg (no runtime call of its name
/// in the examples' single-device plans), a collective is a call of `@megac.<op>`, every
/// other kernel a call of `@megac.kernel.<op>`; views are never instructions.
#[test]
fn every_op_of_the_examples_has_a_form() {
    let mut seen = std::collections::BTreeSet::new();
    for file in [
        "examples/llama-tiny.toml",
        "examples/gpt-tiny.toml",
        "examples/moe-tiny.toml",
    ] {
        let p = plan(
            file,
            &[
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.dp=2",
                "parallel.distributed_optimizer=true",
            ],
        );
        let text: String = mlir::emit_modules(&p)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        for role in &p.roles {
            for i in Plan::programs_of(role).into_iter().flatten() {
                let Instr::Kernel { op, .. } = i else {
                    continue;
                };
                assert!(!op.is_view(), "{}", op.name());
                let call = format!("@megac.kernel.{}.", op.name());
                let collective = format!("@megac.{}.", op.name());
                if matches!(
                    op,
                    OpKind::AllReduce { .. }
                        | OpKind::AllGather { .. }
                        | OpKind::ReduceScatter { .. }
                        | OpKind::AllToAll { .. }
                ) {
                    assert!(text.contains(&collective), "{file}: {}", op.name());
                } else if mlir::lowered(op) {
                    // tp's vocab-split embedding is lowered too (rank index argument).
                    assert!(!text.contains(&call), "{file}: {} is lowered", op.name());
                } else {
                    assert!(
                        text.contains(&call),
                        "{file}: {} is a runtime kernel",
                        op.name()
                    );
                }
                seen.insert(op.name());
            }
        }
    }
    assert!(seen.len() >= 35, "{} op kinds: {seen:?}", seen.len());
}
