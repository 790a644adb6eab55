//! The fusion pass's kernels (issue 19; docs/mlir.md): every fused group of the tiny
//! examples and of a bf16 and a tp2 layout, JIT-compiled through MLIR and run on random
//! data, against the same instructions run one by one by the Rust kernels; and training
//! with fusion on against fusion off.
#![cfg(feature = "mlir")]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use megac_ir::gate::CheckedPlan;
use megac_ir::plan::{BufId, Instr, Plan};
use megac_ir::DType;
use megac_runtime::comm::SingleRank;
use megac_runtime::exec::{run_program, StepContext};
use megac_runtime::memory::Memory;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn plan(file: &str, sets: &[&str]) -> Plan {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&root().join(file), &sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap()
}

/// The buffers `instrs` read or write, and those they write.
fn buffers(instrs: &[Instr]) -> (Vec<BufId>, Vec<BufId>) {
    let (mut all, mut written) = (Vec::new(), Vec::new());
    for i in instrs {
        match i {
            Instr::Zero { buffer } => {
                all.push(*buffer);
                written.push(*buffer);
            }
            Instr::Kernel {
                inputs, outputs, ..
            } => {
                all.extend(inputs);
                all.extend(outputs);
                written.extend(outputs);
            }
            _ => unreachable!("no transfers in a fused group"),
        }
    }
    all.sort_unstable();
    all.dedup();
    written.sort_unstable();
    written.dedup();
    (all, written)
}

/// Distance in units in the last place of floats of `dtype` (f32, bf16 or fp16; the
/// values are read back as f32, exactly).
fn ulps(a: f32, b: f32, dtype: DType) -> u64 {
    // The value's position among the format's values, in order (negative below zero).
    let key = |x: f32| -> i64 {
        let i = x.to_bits() as i32;
        let mag = i64::from(i & 0x7fff_ffff);
        let k = match dtype {
            DType::Bf16 => mag >> 16,
            // fp16: 10 fraction bits, exponent bias 15; below 2^-14 subnormal in 2^-24 steps.
            DType::F16 => {
                let (e, m) = ((mag >> 23) - 127, mag & 0x7f_ffff);
                if e >= -14 {
                    ((e + 15) << 10) | (m >> 13)
                } else {
                    (f64::from(x.abs()) * 2f64.powi(24)) as i64
                }
            }
            _ => mag,
        };
        if i < 0 {
            -k
        } else {
            k
        }
    };
    key(a).abs_diff(key(b))
}

/// The same random inputs in `a` and `b` for every buffer `instrs` touch; then `instrs` run
/// unfused on `a` (a copy of them is no program of the plan, so nothing fuses it) and as one
/// fused group on `b`. The buffers they write, to compare.
fn run_both(
    checked: &CheckedPlan,
    a: &mut Memory,
    b: &mut Memory,
    instrs: &[Instr],
    rng: &mut megac_runtime::rng::SplitMix64,
) -> Vec<BufId> {
    let (all, written) = buffers(instrs);
    for &buf in &all {
        let n = checked.buffers[buf as usize].len() as usize;
        let v: Vec<f32> = (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
        a.write_f32(buf, &v);
        b.write_f32(buf, &v);
    }
    let ctx = StepContext {
        step: 1,
        lr: 1e-3,
        microbatch: 0,
        loss_scale: 1.0,
    };
    let copy: Vec<Instr> = instrs.to_vec();
    run_program(&copy, checked, a, &ctx, &mut SingleRank, None).unwrap();
    assert!(megac_runtime::fusion::run_group(checked, b, instrs, &ctx).unwrap());
    written
}

/// The most units in the last place (in its buffer's format) by which any output element
/// of a fused kernel differs from the Rust kernels', for every distinct fused group (by
/// kernel text) of `file` with `sets`, by pattern.
fn check(file: &str, sets: &[&str]) -> BTreeMap<String, u64> {
    let checked = CheckedPlan::check(plan(file, sets)).unwrap();
    let p: &Plan = &checked;
    megac_runtime::fusion::set_enabled(false);
    let mut seen = std::collections::HashSet::new();
    let mut worst: BTreeMap<String, u64> = BTreeMap::new();
    let mut rng = megac_runtime::rng::SplitMix64(7);
    for (ri, role) in p.roles.iter().enumerate() {
        let rank = p
            .rank_to_role
            .iter()
            .position(|&r| r as usize == ri)
            .unwrap();
        let mut a = Memory::new(&checked, rank).unwrap();
        let mut b = Memory::new(&checked, rank).unwrap();
        for (_, program) in megac_codegen::fuse::programs(role) {
            for g in megac_codegen::fuse::groups(program) {
                let instrs = g.instrs(program);
                if megac_codegen::fuse::alone(&instrs[0]) {
                    // AdamW needs its own data (a second moment >= 0, a gradient norm):
                    // `fused_adamw_is_bitwise_the_rust_adamw`.
                    continue;
                }
                let text = megac_runtime::fusion::group_source(p, instrs)
                    .unwrap_or_else(|| panic!("{file}: no fused form of {}", g.pattern(program)));
                if !seen.insert(text) {
                    continue;
                }
                let written = run_both(&checked, &mut a, &mut b, instrs, &mut rng);
                let mut d = 0;
                for &buf in &written {
                    let dtype = p.buffers[buf as usize].dtype;
                    let (x, y) = (a.read_f32(buf), b.read_f32(buf));
                    for (u, v) in x.iter().zip(&y) {
                        assert!(v.is_finite(), "{file} {}: non-finite", g.pattern(program));
                        d = d.max(ulps(*u, *v, dtype));
                    }
                }
                let e = worst.entry(g.pattern(program)).or_default();
                *e = (*e).max(d);
            }
        }
    }
    eprintln!("{file} {sets:?}: {worst:?}");
    worst
}

#[test]
fn fused_kernels_compute_what_the_rust_kernels_compute() {
    let mut all: BTreeMap<String, u64> = BTreeMap::new();
    for (file, sets) in [
        ("examples/llama-tiny.toml", &[][..]),
        ("examples/gpt-tiny.toml", &[][..]),
        (
            "examples/llama-tiny.toml",
            &["train.precision=\"bf16\""][..],
        ),
        ("examples/gpt-tiny.toml", &["parallel.tp=2"][..]),
        // The golden fixtures' other patterns: MoE's shared-expert gate (`sigmoid_mul`),
        // qwen3's q/k norms; fp16 and bf16 casts; sequence parallelism's row shards.
        ("tests/golden/qwen2_moe/model.toml", &[][..]),
        (
            "tests/golden/qwen2_moe/model.toml",
            &["train.precision=\"bf16\""][..],
        ),
        ("tests/golden/qwen3/model.toml", &[][..]),
        ("examples/gpt-tiny.toml", &["train.precision=\"fp16\""][..]),
        (
            "examples/llama-tiny.toml",
            &["parallel.tp=2", "parallel.sequence_parallel=true"][..],
        ),
        // Rows whose length is no multiple of the 8 lanes (52 = 6·8 + 4): the row sums'
        // tails.
        (
            "examples/llama-tiny.toml",
            &["model.hidden=52", "model.heads=2", "model.kv_heads=1"][..],
        ),
        (
            "examples/gpt-tiny.toml",
            &["model.hidden=52", "model.heads=2"][..],
        ),
    ] {
        let w = check(file, sets);
        assert!(!w.is_empty(), "{file} {sets:?}: no fused groups");
        for (k, v) in w {
            let e = all.entry(k).or_default();
            *e = (*e).max(v);
        }
    }
    for (pattern, d) in &all {
        // Every fused kernel performs the Rust kernels' operations in their order (row
        // sums in f64 in the same lanes, the same formulas): the same bits.
        assert_eq!(*d, 0, "{pattern}: {d} ulps");
    }
}

/// The fused AdamW against the runtime's AdamW instruction (the Rust kernels): every
/// distinct AdamW kernel of llama-tiny in fp32 and bf16 (fp32 master weights, bf16
/// working weights) and gpt-tiny in fp16, on random parameters, gradients and moments,
/// at steps 1 and 7, with and without a loss scale, a gradient norm that clips and one
/// that does not, and a non-finite norm (the step is skipped): every buffer it reads or
/// writes (the gradient is unscaled and clipped in place) bitwise equal.
#[test]
fn fused_adamw_is_bitwise_the_rust_adamw() {
    megac_runtime::fusion::set_enabled(false);
    let mut rng = megac_runtime::rng::SplitMix64(5);
    let mut runs = 0;
    for (file, sets) in [
        ("examples/llama-tiny.toml", &[][..]),
        (
            "examples/llama-tiny.toml",
            &["train.precision=\"bf16\""][..],
        ),
        ("examples/gpt-tiny.toml", &["train.precision=\"fp16\""][..]),
    ] {
        let checked = CheckedPlan::check(plan(file, sets)).unwrap();
        let p: &Plan = &checked;
        let (mut a, mut b) = (
            Memory::new(&checked, 0).unwrap(),
            Memory::new(&checked, 0).unwrap(),
        );
        let program = &p.roles[0].optimizer;
        let mut seen = std::collections::HashSet::new();
        for g in megac_codegen::fuse::groups(program) {
            let instrs = g.instrs(program);
            if !megac_codegen::fuse::alone(&instrs[0]) {
                continue;
            }
            let text = megac_runtime::fusion::group_source(p, instrs)
                .unwrap_or_else(|| panic!("{file} {sets:?}: no fused AdamW"));
            if !seen.insert(text) {
                continue;
            }
            let Instr::Kernel {
                inputs, outputs, ..
            } = &instrs[0]
            else {
                unreachable!()
            };
            let mut all: Vec<BufId> = inputs.iter().chain(outputs).copied().collect();
            all.sort_unstable();
            all.dedup();
            let norm_buf = inputs[2];
            for (step, lr, loss_scale, norm) in [
                (1, 1e-3, 1.0, 0.37f32),
                (7, 3e-4, 1.0, 4.5),
                (7, 1e-3, 1024.0, 2.0),
                (2, 1e-3, 1.0, f32::INFINITY),
            ] {
                for &buf in &all {
                    let n = p.buffers[buf as usize].len() as usize;
                    let v: Vec<f32> = if buf == norm_buf {
                        vec![norm; n]
                    } else if buf == outputs[2] {
                        // The second moment is a running mean of squares.
                        (0..n).map(|_| (rng.next_f64() * 1e-3) as f32).collect()
                    } else {
                        (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
                    };
                    a.write_f32(buf, &v);
                    b.write_f32(buf, &v);
                }
                let ctx = StepContext {
                    step,
                    lr,
                    microbatch: 0,
                    loss_scale,
                };
                let copy: Vec<Instr> = instrs.to_vec();
                run_program(&copy, &checked, &a, &ctx, &mut SingleRank, None).unwrap();
                assert!(megac_runtime::fusion::run_group(&checked, &b, instrs, &ctx).unwrap());
                for &buf in &all {
                    let (x, y) = (a.read_f32(buf), b.read_f32(buf));
                    let first = x
                        .iter()
                        .zip(&y)
                        .position(|(u, v)| u.to_bits() != v.to_bits());
                    if let Some(i) = first {
                        panic!(
                            "{file} {sets:?} step {step} norm {norm}: buffer {buf} differs at {i}: {} vs {}",
                            x[i], y[i]
                        );
                    }
                }
                runs += 1;
            }
        }
    }
    assert!(runs >= 12, "{runs} AdamW runs");
}

/// Losses and gradient norms of `megac train` on the tiny llama for 4 steps.
fn train(sets: &[&str], fusion: &str) -> Vec<(f64, f64)> {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_megac"));
    cmd.args([
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "4",
        "--fusion",
        fusion,
    ])
    .arg("--report")
    .arg(&report)
    .current_dir(root());
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    r["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["loss"].as_f64().unwrap(),
                s["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn training_with_fusion_equals_training_without() {
    for sets in [
        &[][..],
        &["parallel.tp=2"][..],
        &["train.precision=\"bf16\""][..],
    ] {
        let (on, off) = (train(sets, "on"), train(sets, "off"));
        assert_eq!(on.len(), 4);
        for (s, (a, b)) in on.iter().zip(&off).enumerate() {
            let rel = |x: f64, y: f64| (x - y).abs() / y.abs().max(1e-30);
            eprintln!(
                "{sets:?} step {}: loss on {} off {} (rel {:e}), grad norm rel {:e}",
                s + 1,
                a.0,
                b.0,
                rel(a.0, b.0),
                rel(a.1, b.1)
            );
            // Every fused kernel computes the Rust kernels' bits: the same run.
            assert_eq!(a, b, "{sets:?} step {}: (loss, grad norm)", s + 1);
        }
    }
}

/// Micro-benchmark (not part of `cargo test`; run with `cargo test --release --features
/// mlir --test fusion -- --ignored --nocapture fused_kernel_speed`): every distinct fused
/// group of the bench model (bench/llama-bench.toml), its instructions run by the Rust
/// kernels against its fused kernel, on the same buffers in the same process, best of
/// `MEGAC_FUSE_REPS` (default 20) runs each. Prints one line per group.
#[test]
#[ignore]
fn fused_kernel_speed() {
    use std::time::Instant;
    let reps: usize = std::env::var("MEGAC_FUSE_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let checked = CheckedPlan::check(plan("bench/llama-bench.toml", &[])).unwrap();
    let p: &Plan = &checked;
    megac_runtime::fusion::set_enabled(false);
    let mut rng = megac_runtime::rng::SplitMix64(7);
    let mut seen = std::collections::HashSet::new();
    let mut mem = Memory::new(&checked, 0).unwrap();
    let ctx = StepContext {
        step: 1,
        lr: 1e-3,
        microbatch: 0,
        loss_scale: 1.0,
    };
    let (mut total_rust, mut total_fused) = (0f64, 0f64);
    for (_, program) in megac_codegen::fuse::programs(&p.roles[0]) {
        let groups = megac_codegen::fuse::groups(program);
        for g in &groups {
            let instrs = g.instrs(program);
            let text = megac_runtime::fusion::group_source(p, instrs).unwrap();
            let count = groups
                .iter()
                .filter(|h| {
                    megac_runtime::fusion::group_source(p, h.instrs(program)).as_ref()
                        == Some(&text)
                })
                .count();
            if !seen.insert(text) {
                continue;
            }
            let (all, _) = buffers(instrs);
            for &buf in &all {
                let n = p.buffers[buf as usize].len() as usize;
                let v: Vec<f32> = (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
                mem.write_f32(buf, &v);
            }
            let t = Instant::now();
            let fused = megac_runtime::fusion::prepare_group(&checked, instrs)
                .unwrap()
                .unwrap();
            let compile = t.elapsed().as_secs_f64();
            let copy: Vec<Instr> = instrs.to_vec();
            let best = |f: &mut dyn FnMut()| {
                f();
                (0..reps)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let rust = best(&mut || {
                run_program(&copy, &checked, &mem, &ctx, &mut SingleRank, None).unwrap()
            });
            let fast = best(&mut || fused.run(&mem, &ctx).unwrap());
            total_rust += rust * count as f64;
            total_fused += fast * count as f64;
            eprintln!(
                "{:<40} x{count:<2} rust {:8.1} us  fused {:8.1} us  fused/rust {:5.2}  (compile {:.2} s)",
                g.pattern(program),
                rust * 1e6,
                fast * 1e6,
                fast / rust,
                compile
            );
        }
    }
    eprintln!(
        "all groups of one step (by count): rust {:.1} us, fused {:.1} us, fused/rust {:.2} ({:?} cores, RAYON_NUM_THREADS={:?})",
        total_rust * 1e6,
        total_fused * 1e6,
        total_fused / total_rust,
        std::thread::available_parallelism().map(|n| n.get()).ok(),
        std::env::var("RAYON_NUM_THREADS").ok()
    );
}

/// RoPE's fused form holds the tables of positions `0..s`: under context parallelism
/// (a rank's tokens sit at other positions) a group with `rope_grad` has none, and the
/// runtime runs its instructions unfused (the layout tests train such plans).
#[test]
fn rope_has_no_fused_form_under_context_parallelism() {
    let mut seen = 0;
    for (sets, fused) in [(&[][..], true), (&["parallel.cp=2"][..], false)] {
        let p = plan("examples/llama-tiny.toml", sets);
        for (_, program) in megac_codegen::fuse::programs(&p.roles[0]) {
            for g in megac_codegen::fuse::groups(program) {
                if g.pattern(program).contains("rope") {
                    seen += 1;
                    let src = megac_runtime::fusion::group_source(&p, g.instrs(program));
                    assert_eq!(src.is_some(), fused, "{sets:?}: {}", g.pattern(program));
                }
            }
        }
    }
    assert!(seen >= 4, "{seen} rope groups");
}

/// The forward `rope` (q and k rotate independently, so it forms no group in these
/// models): its fused form, run alone on random data, against the Rust kernel, bitwise;
/// with default frequencies and with llama 3.1's scaled ones.
#[test]
fn fused_forward_rope_is_bitwise_the_rust_kernel() {
    megac_runtime::fusion::set_enabled(false);
    let mut rng = megac_runtime::rng::SplitMix64(11);
    let mut checked_ropes = 0;
    for file in [
        "examples/llama-tiny.toml",
        "tests/golden/llama31/model.toml",
    ] {
        let checked = CheckedPlan::check(plan(file, &[])).unwrap();
        let p: &Plan = &checked;
        let (mut a, mut b) = (
            Memory::new(&checked, 0).unwrap(),
            Memory::new(&checked, 0).unwrap(),
        );
        let ropes: Vec<Instr> = p.roles[0]
            .microbatch
            .iter()
            .filter(|i| matches!(i, Instr::Kernel { op, .. } if op.name() == "rope"))
            .cloned()
            .collect();
        assert!(!ropes.is_empty(), "{file}: no rope");
        // One of each shape (q and k) suffices: the layers repeat them.
        for r in ropes.iter().take(2) {
            let one = std::slice::from_ref(r);
            let written = run_both(&checked, &mut a, &mut b, one, &mut rng);
            for &buf in &written {
                let (x, y) = (a.read_f32(buf), b.read_f32(buf));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&x), bits(&y), "{file}: rope differs");
            }
            checked_ropes += 1;
        }
    }
    assert_eq!(checked_ropes, 4);
}
