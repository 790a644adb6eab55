//! Perturbations beyond noise, scale and bitflip (tests/scope.rs checks those):
//! `zero-head` against an independent edit of the weights (zeroing a head's output before
//! the output projection equals zeroing that head's input columns of the projection),
//! `patch` (from a probe file of the same input: nothing changes, KL exactly 0; of another
//! input: every later point becomes that input's), and `megac train --perturb` (noise(0) is
//! bit-identical to no perturbation; a weight bit flip at a step changes the run from that
//! step on; seeded runs repeat).

use std::path::{Path, PathBuf};
use std::process::Command;

use megac_runtime::infer::{Inference, PerturbKind, Perturbation, Probe};
use megac_runtime::perturb::TrainPerturbation;
use megac_runtime::train::{train, RunOptions};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn plan(name: &str, sets: &[&str]) -> megac_ir::gate::CheckedPlan {
    plan_with(name, sets, megac_passes::Instrument::default()).unwrap()
}

/// The plan of fixture `name` with `instrument`'s probes and perturbations compiled in (the
/// `perturb` and `probe` passes), or the passes' error.
fn plan_with(
    name: &str,
    sets: &[&str],
    instrument: megac_passes::Instrument,
) -> Result<megac_ir::gate::CheckedPlan, String> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let spec = megac_frontend::load(&fixture(name).join("model.toml"), &sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module =
        megac_passes::run_pipeline_with(spec, instrument, None, true).map_err(|e| e.to_string())?;
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    Ok(megac_ir::gate::CheckedPlan::check(plan).unwrap())
}

/// The one-sample plan with every probe point.
fn forward_plan(name: &str) -> megac_ir::gate::CheckedPlan {
    scope_plan(name, &[]).unwrap()
}

/// The one-sample plan with every probe point and the scope perturbations `perturb` of the
/// 8 tokens of `A` (seed 0).
fn scope_plan(name: &str, perturb: &[&str]) -> Result<megac_ir::gate::CheckedPlan, String> {
    scope_plan_in(name, &[], perturb)
}

/// [`scope_plan`] in the layout `sets` gives.
fn scope_plan_in(
    name: &str,
    sets: &[&str],
    perturb: &[&str],
) -> Result<megac_ir::gate::CheckedPlan, String> {
    let mut all = vec!["train.micro_batch=1", "train.global_batch=1"];
    all.extend_from_slice(sets);
    plan_with(
        name,
        &all,
        megac_passes::Instrument {
            probes: vec!["*".to_string()],
            perturbations: perturb
                .iter()
                .map(|p| TrainPerturbation {
                    perturbation: Perturbation::parse(p).unwrap(),
                    step: None,
                })
                .collect(),
            tokens: A.len() as u64,
            ..Default::default()
        },
    )
}

const A: [u32; 8] = [3, 14, 15, 92, 65, 35, 89, 79];
const B: [u32; 8] = [27, 18, 28, 18, 28, 45, 90, 45];

fn perturb(text: &str) -> Perturbation {
    Perturbation::parse(text).unwrap()
}

/// Every tensor of a safetensors file.
fn read_all(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, t.shape().to_vec(), v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn save(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let refs: Vec<(String, Vec<usize>, &[f32])> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), &v[..]))
        .collect();
    megac_runtime::hf::save_params(path, &refs).unwrap();
}

/// zero-head(h) on `layers.{l}.attn` equals the clean run of weights whose output
/// projection ignores head h: its input columns zeroed (`o_proj`, [hidden, heads·d]) or,
/// for GPT-2's Conv1D `c_proj` ([heads·d, hidden]), its input rows.
fn zero_head_matches_weights(name: &str, o_proj: &str, conv1d: bool, head: usize) {
    let plan = forward_plan(name);
    let init = fixture(name).join("init.safetensors");
    let clean = Inference::new(&plan, &init).unwrap().logits(&A).unwrap();
    let knock = scope_plan(name, &[&format!("layers.1.attn:zero-head({head})")]).unwrap();
    let knocked = Inference::new(&knock, &init).unwrap().logits(&A).unwrap();
    let d = 16; // hidden 64 over 4 heads
    let mut weights = read_all(&init);
    let (_, shape, w) = weights.iter_mut().find(|(n, _, _)| n == o_proj).unwrap();
    for r in 0..shape[0] {
        for c in 0..shape[1] {
            let zero = if conv1d { r / d == head } else { c / d == head };
            if zero {
                w[r * shape[1] + c] = 0.0;
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("edited.safetensors");
    save(&edited, &weights);
    let want = Inference::new(&plan, &edited).unwrap().logits(&A).unwrap();
    let diff = max_diff(&knocked, &want);
    eprintln!("{name}: zero-head({head}) vs zeroed weights: max diff {diff:e}");
    assert!(
        diff <= 1e-6,
        "{name}: zero-head differs from the edited weights by {diff}"
    );
    assert!(clean != knocked, "{name}: zero-head changed nothing");
}

#[test]
fn zero_head_equals_zeroed_output_projection() {
    zero_head_matches_weights("llama", "model.layers.1.self_attn.o_proj.weight", false, 2);
    zero_head_matches_weights("gpt", "transformer.h.1.attn.c_proj.weight", true, 1);
    zero_head_matches_weights(
        "mixtral",
        "model.layers.1.self_attn.o_proj.weight",
        false,
        3,
    );
}

#[test]
fn zero_head_rejects_bad_heads_and_points() {
    for (p, want) in [
        ("layers.0.attn:zero-head(4)", "the layer has heads 0..4"),
        (
            "layers.0.out:zero-head(0)",
            "zero-head applies to layers.N.attn",
        ),
        (
            "weights.model.norm.weight:zero-head(0)",
            "change activations, not weights",
        ),
    ] {
        let err = scope_plan("llama", &[p]).unwrap_err();
        assert!(err.contains(want), "{p}: {err}");
    }
    assert!(Perturbation::parse("layers.0.attn:zero-head(x)").is_err());
    assert_eq!(
        perturb("layers.0.out:patch(/tmp/a:b.safetensors)").kind,
        PerturbKind::Patch("/tmp/a:b.safetensors".into())
    );
}

fn probe_all(inf: &mut Inference, tokens: &[u32]) -> Vec<Probe> {
    inf.probe(tokens, &["*".to_string()]).unwrap()
}

fn write_probes(path: &Path, probes: &[Probe]) {
    let t: Vec<(String, Vec<usize>, Vec<f32>)> = probes
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone(), p.values.clone()))
        .collect();
    save(path, &t);
}

/// patch(FILE of input B) at `layers.0.out` on input A: points before it are A's, it and
/// every later point B's, bit for bit (the residual stream after layer 0 is all the later
/// layers read, at every position); patching from A's own file changes nothing.
#[test]
fn patch_replaces_activations() {
    for name in ["llama", "gpt"] {
        let plan = forward_plan(name);
        let init = fixture(name).join("init.safetensors");
        let mut inf = Inference::new(&plan, &init).unwrap();
        let (pa, pb) = (probe_all(&mut inf, &A), probe_all(&mut inf, &B));
        let dir = tempfile::tempdir().unwrap();
        let (fa, fb) = (
            dir.path().join("a.safetensors"),
            dir.path().join("b.safetensors"),
        );
        write_probes(&fa, &pa);
        write_probes(&fb, &pb);
        let spec = |f: &Path| format!("layers.0.out:patch({})", f.display());
        let patched = scope_plan(name, &[&spec(&fa)]).unwrap();
        let mut inf = Inference::new(&patched, &init).unwrap();
        inf.set_patches(&[perturb(&spec(&fa))]).unwrap();
        assert_eq!(
            probe_all(&mut inf, &A),
            pa,
            "{name}: patched with A's own values"
        );
        inf.set_patches(&[perturb(&spec(&fb))]).unwrap();
        let got = probe_all(&mut inf, &A);
        for ((g, a), b) in got.iter().zip(&pa).zip(&pb) {
            let later = g.name.starts_with("layers.1.") || g.name == "logits";
            let want = if later || g.name == "layers.0.out" || g.name.starts_with("layers.0.lens") {
                b
            } else {
                a
            };
            assert_eq!(g, want, "{name}: {}", g.name);
        }
        // Another length: one error naming both shapes.
        let err = inf
            .probe(&A[..5], &["logits".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("shape [1, 8, 64]"), "{err}");
    }
}

fn megac(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

/// `megac scope --perturb POINT:patch(own probe file) --report`: kl exactly 0, agreement 1,
/// on one device and in tp2 with sequence parallelism, cp2, pp2 and dp2 (each patched from
/// the probe file of its own layout's clean run).
#[test]
fn scope_patch_from_own_probes_has_zero_kl() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("llama").join("model.toml");
    let init = fixture("llama").join("init.safetensors");
    let probes = dir.path().join("p.safetensors");
    let report = dir.path().join("r.json");
    for layout in [
        &[][..],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.cp=2"],
        &["parallel.pp=2"],
        &["parallel.dp=2"],
    ] {
        let mut base = vec![
            "scope".to_string(),
            model.display().to_string(),
            "--init".into(),
            init.display().to_string(),
            "--tokens".into(),
            "3,14,15,92,65,35,89,79".into(),
        ];
        for s in layout {
            base.extend(["--set".to_string(), s.to_string()]);
        }
        let run = |extra: &[&str]| {
            let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
            args.extend_from_slice(extra);
            let out = megac(&args);
            assert!(
                out.status.success(),
                "{layout:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["--probe", "layers.*.out", "-o", probes.to_str().unwrap()]);
        let patch = format!("layers.1.out:patch({})", probes.display());
        let out2 = dir.path().join("q.safetensors");
        run(&[
            "--probe",
            "logits",
            "-o",
            out2.to_str().unwrap(),
            "--perturb",
            &patch,
            "--report",
            report.to_str().unwrap(),
        ]);
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        assert_eq!(r["kl"].as_f64(), Some(0.0), "{layout:?}");
        assert_eq!(r["top1_agreement"].as_f64(), Some(1.0), "{layout:?}");
        assert_eq!(r["clean_loss"], r["perturbed_loss"], "{layout:?}");
    }
}

fn train_with(perturb: &[&str], seed: u64) -> Vec<(f64, f64)> {
    train_in(&[], perturb, seed)
}

/// Three steps of the llama fixture in `layout` with `perturb`: (loss, grad norm) per step.
fn train_in(layout: &[&str], perturb: &[&str], seed: u64) -> Vec<(f64, f64)> {
    let perturb: Vec<TrainPerturbation> = perturb
        .iter()
        .map(|p| TrainPerturbation::parse(p).unwrap())
        .collect();
    // Activation perturbations are compiled into the plan; the runtime perturbs weights.
    let instrument = megac_passes::Instrument {
        perturbations: perturb.clone(),
        seed,
        train: true,
        ..Default::default()
    };
    let plan = plan_with("llama", layout, instrument).unwrap();
    let opts = RunOptions {
        steps: Some(3),
        data: "synthetic".into(),
        init: Some(fixture("llama").join("init.safetensors")),
        progress: Some(false),
        perturb,
        perturb_seed: seed,
        ..Default::default()
    };
    let report = train(&plan, &opts).unwrap();
    report.steps.iter().map(|s| (s.loss, s.grad_norm)).collect()
}

#[test]
fn train_perturbations() {
    let clean = train_with(&[], 0);
    let bits = |r: &[(f64, f64)]| -> Vec<(u64, u64)> {
        r.iter().map(|(a, b)| (a.to_bits(), b.to_bits())).collect()
    };
    // noise(0) on an activation every micro-batch, and on a weight: bit-identical.
    let zero = train_with(
        &[
            "layers.0.out:noise(0)",
            "weights.model.norm.weight:noise(0)",
        ],
        5,
    );
    assert_eq!(bits(&zero), bits(&clean));
    // Noise on activations every step: every step differs, and the seed repeats it.
    let noisy = train_with(&["layers.0.mlp.out:noise(0.5)"], 1);
    assert!(noisy.iter().zip(&clean).all(|(a, b)| a != b), "{noisy:?}");
    assert_eq!(
        bits(&noisy),
        bits(&train_with(&["layers.0.mlp.out:noise(0.5)"], 1))
    );
    assert_ne!(
        bits(&noisy),
        bits(&train_with(&["layers.0.mlp.out:noise(0.5)"], 2))
    );
    // A weight fault at step 2: step 1 as clean, steps 2 and 3 not.
    let flip = train_with(
        &["weights.model.layers.0.mlp.down_proj.weight:bitflip(exponent, 0.05)@2"],
        0,
    );
    assert_eq!(bits(&flip[..1]), bits(&clean[..1]));
    assert!(
        flip[1..].iter().zip(&clean[1..]).all(|(a, b)| a != b),
        "{flip:?}"
    );
    // Head knockout during step 3 only.
    let knock = train_with(&["layers.1.attn:zero-head(0)@3"], 0);
    assert_eq!(bits(&knock[..2]), bits(&clean[..2]));
    assert_ne!(knock[2], clean[2]);
    // Bad input: one error each.
    for (p, want) in [
        ("layers.0.out:noise(0)@0", "is not a step"),
        ("layers.0.out:patch(x.safetensors)", "for megac scope"),
    ] {
        let err = TrainPerturbation::parse(p).unwrap_err();
        assert!(err.contains(want), "{p}: {err}");
    }
}

/// Training perturbations in tp2 (with and without sequence parallelism) and dp2: noise(0)
/// is bit-identical to the layout's clean run, a seed repeats its run, and zero-head of a
/// head that tp2's second rank holds gives the one-device knockout's losses (within float
/// rounding of the layouts), only in its step.
#[test]
fn train_perturbations_multi_rank() {
    let bits = |r: &[(f64, f64)]| -> Vec<(u64, u64)> {
        r.iter().map(|(a, b)| (a.to_bits(), b.to_bits())).collect()
    };
    let one = train_in(&[], &[], 0);
    let knock_one = train_in(&[], &["layers.1.attn:zero-head(3)@2"], 0);
    for layout in [
        &["parallel.tp=2"][..],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.dp=2"],
        // Pipeline stages run their chunks' perturb instructions; the weights are on
        // stage 0 (down_proj) and stage 1 (the final norm).
        &["parallel.pp=2"],
        &["parallel.pp=2", "parallel.tp=2"],
    ] {
        let clean = train_in(layout, &[], 0);
        let zero = train_in(
            layout,
            &[
                "layers.0.out:noise(0)",
                "layers.1.attn:noise(0)",
                "weights.model.layers.0.mlp.down_proj.weight:noise(0)",
                "weights.model.norm.weight:noise(0)",
            ],
            5,
        );
        assert_eq!(bits(&zero), bits(&clean), "{layout:?}");
        let p = [
            "layers.0.mlp.out:noise(0.5)",
            "weights.model.layers.0.mlp.down_proj.weight:bitflip(mantissa, 0.05)@2",
        ];
        let noisy = train_in(layout, &p, 1);
        assert!(
            noisy.iter().zip(&clean).all(|(a, b)| a != b),
            "{layout:?}: {noisy:?}"
        );
        assert_eq!(bits(&noisy), bits(&train_in(layout, &p, 1)), "{layout:?}");
        assert_ne!(bits(&noisy), bits(&train_in(layout, &p, 2)), "{layout:?}");
        // Head 3 of 4: under tp2 the second rank's head 1.
        let knock = train_in(layout, &["layers.1.attn:zero-head(3)@2"], 0);
        assert_eq!(bits(&knock[..1]), bits(&clean[..1]), "{layout:?}");
        for (t, ((k, k1), (c, c1))) in knock
            .iter()
            .zip(&knock_one)
            .zip(clean.iter().zip(&one))
            .enumerate()
        {
            // The layout reproduces the one-device run within rounding, clean and knocked out.
            assert!(
                (c.0 - c1.0).abs() < 1e-5 && (k.0 - k1.0).abs() < 1e-5,
                "{layout:?} step {t}: {k:?} {k1:?} {c:?} {c1:?}"
            );
            if t >= 1 {
                assert!(
                    (k.0 - c.0).abs() > 1e-4,
                    "{layout:?} step {t}: {k:?} vs clean {c:?}"
                );
            }
        }
    }
    // A head no rank holds: one error (from the perturb pass).
    let instrument = megac_passes::Instrument {
        perturbations: vec![TrainPerturbation::parse("layers.1.attn:zero-head(4)").unwrap()],
        train: true,
        ..Default::default()
    };
    let err = plan_with("llama", &["parallel.tp=2"], instrument).unwrap_err();
    assert!(err.contains("the layer has heads 0..4"), "{err}");
    // An activation perturbation the plan was compiled without: one error.
    let opts = RunOptions {
        steps: Some(1),
        data: "synthetic".into(),
        init: Some(fixture("llama").join("init.safetensors")),
        progress: Some(false),
        perturb: vec![TrainPerturbation::parse("layers.1.out:noise(1)").unwrap()],
        ..Default::default()
    };
    let err = train(&plan("llama", &[]), &opts).unwrap_err().to_string();
    assert!(err.contains("compiled into the plan"), "{err}");
}

/// `megac scope`'s perturbations in tp2 (with and without sequence parallelism), pp2,
/// pp2 × tp2, cp2 and cp2 × tp2 (cp: each rank perturbs the real rows of its load-balanced
/// chunks, 0-3 and 4-7 of 8 tokens over 16 positions): noise(0) leaves the logits bit-identical to the layout's clean run, scale(2)
/// doubles the probed point exactly, and zero-head gives the one-device knockout's logits
/// (within float rounding of the layouts).
#[test]
fn scope_perturbations_in_tp_and_pp() {
    let init = fixture("llama").join("init.safetensors");
    let logits = |plan: &megac_ir::gate::CheckedPlan| {
        megac_runtime::infer::with_ranks(plan, &init, |inf| inf.logits(&A)).unwrap()
    };
    let point = |plan: &megac_ir::gate::CheckedPlan| {
        megac_runtime::infer::with_ranks(plan, &init, |inf| {
            inf.probe(&A, &["layers.1.mlp.out".to_string()])
        })
        .unwrap()
        .remove(0)
        .values
    };
    let knock_one = logits(&scope_plan("llama", &["layers.1.attn:zero-head(3)"]).unwrap());
    for layout in [
        &["parallel.tp=2"][..],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.pp=2"],
        &[
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
        &["parallel.cp=2"],
        &["parallel.cp=2", "parallel.tp=2"],
    ] {
        let clean_plan = scope_plan_in("llama", layout, &[]).unwrap();
        let clean = logits(&clean_plan);
        let zero = logits(&scope_plan_in("llama", layout, &["layers.0.out:noise(0)"]).unwrap());
        assert!(
            zero.iter()
                .zip(&clean)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{layout:?}"
        );
        let scaled =
            point(&scope_plan_in("llama", layout, &["layers.1.mlp.out:scale(2)"]).unwrap());
        let base = point(&clean_plan);
        assert!(
            scaled.iter().zip(&base).all(|(a, b)| *a == 2.0 * b),
            "{layout:?}"
        );
        let knock =
            logits(&scope_plan_in("llama", layout, &["layers.1.attn:zero-head(3)"]).unwrap());
        let diff = max_diff(&knock, &knock_one);
        eprintln!("{layout:?}: zero-head(3) vs one device: max diff {diff:e}");
        assert!(diff <= 1e-5, "{layout:?}: {diff}");
        assert!(knock != clean, "{layout:?}");
    }
}

/// Through the CLI: `megac train --perturb` compiles the activation perturbations into the
/// plan (here pp2: noise(0) trains as the clean run, noise(0.5) not), and `megac run` of a
/// plan compiled without them refuses an activation point with one error.
#[test]
fn train_and_run_commands_with_perturbations() {
    let model = fixture("llama").join("model.toml");
    let m = model.to_str().unwrap();
    let losses = |perturb: &[&str]| -> String {
        let mut args = vec!["train", m, "--steps", "2", "--set", "parallel.pp=2"];
        for p in perturb {
            args.extend(["--perturb", p]);
        }
        let out = megac(&args);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // "trained 2 steps of model: loss A -> B (...)"
        let line = text
            .lines()
            .find(|l| l.starts_with("trained"))
            .unwrap()
            .to_string();
        line.split(" (").next().unwrap().to_string()
    };
    let clean = losses(&[]);
    assert_eq!(losses(&["layers.0.out:noise(0)"]), clean);
    assert_ne!(losses(&["layers.0.out:noise(0.5)"]), clean);
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan");
    assert!(megac(&["compile", m, "-o", plan.to_str().unwrap()])
        .status
        .success());
    let run = megac(&[
        "run",
        plan.to_str().unwrap(),
        "--steps",
        "1",
        "--perturb",
        "layers.0.out:noise(1)",
    ]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(err.contains("compiled into the plan"), "{err}");
}

/// `patch` in tp2, tp2 with sequence parallelism, cp2, cp2 × tp2, pp2 and dp2 (llama): every
/// rank fills its part of the replacement from the file's global tensor. Patching
/// `layers.0.out` of input A from the one-device probe file of input B gives the one-device
/// patched run's points (B's from `layers.0.out` on, A's before it) within float32 rounding
/// of the layout; patching from the layout's own probe file of A gives its clean run's
/// logits: bit for bit where the point is a plain split (sequence parallelism, cp, pp,
/// dp), within rounding under tp2 without sequence parallelism (there the residual stream
/// is a pending sum over tp, patched as the whole sum on tp rank 0, so it is added in
/// another order).
#[test]
fn patch_in_every_layout() {
    let name = "llama";
    let init = fixture(name).join("init.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let one = forward_plan(name);
    let mut inf = Inference::new(&one, &init).unwrap();
    let (pa, pb) = (probe_all(&mut inf, &A), probe_all(&mut inf, &B));
    let fb = dir.path().join("b.safetensors");
    write_probes(&fb, &pb);
    let spec = |f: &Path| format!("layers.0.out:patch({})", f.display());
    for (layout, exact) in [
        (&["parallel.tp=2"][..], false),
        (&["parallel.tp=2", "parallel.sequence_parallel=true"], true),
        (&["parallel.cp=2"], true),
        (
            &[
                "parallel.cp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            true,
        ),
        (&["parallel.pp=2"], true),
        (&["parallel.dp=2", "train.global_batch=2"], true),
    ] {
        let run = |plan: &megac_ir::gate::CheckedPlan, patch: Option<&Path>| {
            megac_runtime::infer::with_ranks_scope(plan, &init, |inf| {
                if let Some(f) = patch {
                    inf.set_patches(&[perturb(&spec(f))])?;
                }
                Ok(probe_all(inf, &A))
            })
            .unwrap()
        };
        let clean = run(&scope_plan_in(name, layout, &[]).unwrap(), None);
        let fa = dir.path().join("a.safetensors");
        write_probes(&fa, &clean);
        let patched_plan = |f: &Path| scope_plan_in(name, layout, &[&spec(f)]).unwrap();
        // From B's one-device file: the one-device patched run, within rounding.
        let got = run(&patched_plan(&fb), Some(&fb));
        let mut worst = 0f32;
        for ((g, a), b) in got.iter().zip(&pa).zip(&pb) {
            let later = g.name.starts_with("layers.1.")
                || g.name == "logits"
                || g.name == "layers.0.out"
                || g.name.starts_with("layers.0.lens");
            let want = if later { b } else { a };
            assert_eq!((&g.name, &g.shape), (&want.name, &want.shape), "{layout:?}");
            let diff = max_diff(&g.values, &want.values);
            // The lens's token ids must agree; probabilities and activations within 1e-5.
            assert!(diff <= 1e-5, "{layout:?}: {}: {diff}", g.name);
            if g.name == "layers.0.out" {
                assert_eq!(g, b, "{layout:?}: the patched point is B's, bit for bit");
            }
            worst = worst.max(diff);
        }
        eprintln!("{layout:?}: patched from B vs one device: max diff {worst:e}");
        // From the layout's own file of A: its clean run.
        let same = run(&patched_plan(&fa), Some(&fa));
        let logits = |p: &[Probe]| {
            p.iter()
                .find(|p| p.name == "logits")
                .unwrap()
                .values
                .clone()
        };
        let (x, y) = (logits(&same), logits(&clean));
        if exact {
            assert_eq!(same, clean, "{layout:?}: patched with A's own values");
        } else {
            let diff = max_diff(&x, &y);
            eprintln!("{layout:?}: patched from its own file: logits max diff {diff:e}");
            assert!(diff <= 1e-5, "{layout:?}: {diff}");
        }
    }
}

/// Activation recomputation computes a perturbed point again for the backward with the same
/// perturbation (the `perturb` pass instruments the `recompute` pass's clone of the point's
/// writer too, with the same stream): training with noise and a bit flip on points inside
/// the recomputed regions (attention's per-head output, which selective recomputation
/// clones; the attention and MLP outputs, which full recomputation clones) gives losses,
/// gradient norms and final parameters bit-identical with `train.recompute` none, selective
/// and full, on one device and in tp2 with sequence parallelism; and the perturbation
/// changes the run.
#[test]
fn perturbations_survive_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let run = |layout: &[&str], recompute: &str, perturb: &[&str]| {
        let perturb: Vec<TrainPerturbation> = perturb
            .iter()
            .map(|p| TrainPerturbation::parse(p).unwrap())
            .collect();
        let mut sets = layout.to_vec();
        let r = format!("train.recompute={recompute}");
        sets.push(&r);
        let instrument = megac_passes::Instrument {
            perturbations: perturb.clone(),
            seed: 5,
            train: true,
            ..Default::default()
        };
        let plan = plan_with("llama", &sets, instrument).unwrap();
        let params = dir
            .path()
            .join(format!("{recompute}-{}.safetensors", layout.len()));
        let opts = RunOptions {
            steps: Some(3),
            data: "synthetic".into(),
            init: Some(fixture("llama").join("init.safetensors")),
            progress: Some(false),
            perturb,
            perturb_seed: 5,
            save_params: Some(params.clone()),
            ..Default::default()
        };
        let report = train(&plan, &opts).unwrap();
        let steps: Vec<(u64, u64)> = report
            .steps
            .iter()
            .map(|s| (s.loss.to_bits(), s.grad_norm.to_bits()))
            .collect();
        let weights: Vec<(String, Vec<usize>, Vec<u32>)> = read_all(&params)
            .into_iter()
            .map(|(n, s, v)| (n, s, v.iter().map(|x| x.to_bits()).collect()))
            .collect();
        (steps, weights)
    };
    let perturb = [
        "layers.0.attn:noise(0.3)",
        "layers.1.attn:bitflip(mantissa, 0.05)",
        "layers.0.attn.out:bitflip(exponent, 0.01)",
        "layers.1.mlp.out:noise(0.2)",
    ];
    for layout in [
        &[][..],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ] {
        let none = run(layout, "none", &perturb);
        assert_ne!(none.0, run(layout, "none", &[]).0, "{layout:?}: perturbed");
        for policy in ["selective", "full"] {
            let got = run(layout, policy, &perturb);
            assert_eq!(got.0, none.0, "{layout:?} {policy}: losses and grad norms");
            assert!(got.1 == none.1, "{layout:?} {policy}: parameters");
        }
    }
}

/// Weight faults of 16-bit working weights (bf16 / fp16 mixed precision) act on the 16-bit
/// copy the kernels read: a bit flip flips a bit of the 16-bit format's field, so the same
/// flip twice restores every bit, and a sign flip of a bf16 weight negates exactly the
/// elements it hits (the other bits unchanged); noise(0) and scale(1) change no bit.
#[test]
fn weight_faults_of_16_bit_working_weights() {
    use megac_kernels::precision::{narrow, Half};
    use megac_runtime::perturb::apply_working;
    let values: Vec<f32> = (0..4000)
        .map(|i| ((i as f32) * 0.731).sin() * 3.0)
        .collect();
    for half in [Half::Bf16, Half::F16] {
        let mut orig = vec![0u16; values.len()];
        narrow(half, &values, &mut orig);
        for field in ["sign", "exponent", "mantissa"] {
            let kind = perturb(&format!("weights.w:bitflip({field}, 0.2)")).kind;
            let mut w = orig.clone();
            apply_working(&kind, half, &mut w, 11);
            let changed = w.iter().zip(&orig).filter(|(a, b)| a != b).count();
            assert!(
                (600..1000).contains(&changed),
                "{half:?} {field}: {changed} of 4000 changed"
            );
            // One bit of the field per changed element.
            let mask: u16 = match (field, half) {
                ("sign", _) => 0x8000,
                ("exponent", Half::Bf16) => 0x7f80,
                ("mantissa", Half::Bf16) => 0x007f,
                ("exponent", Half::F16) => 0x7c00,
                _ => 0x03ff,
            };
            for (a, b) in w.iter().zip(&orig) {
                let d = a ^ b;
                assert!(
                    d == 0 || (d.count_ones() == 1 && d & mask == d),
                    "{half:?} {field}"
                );
            }
            if field == "sign" {
                for (a, b) in w.iter().zip(&orig) {
                    let (x, y) = (half.to_f32(*a), half.to_f32(*b));
                    assert!(a == b || x == -y, "{half:?}: a sign flip negates");
                }
            }
            apply_working(&kind, half, &mut w, 11);
            assert_eq!(w, orig, "{half:?} {field}: twice restores every bit");
        }
        for k in ["noise(0)", "scale(1)"] {
            let mut w = orig.clone();
            apply_working(&perturb(&format!("weights.w:{k}")).kind, half, &mut w, 3);
            assert_eq!(w, orig, "{half:?} {k}");
        }
        let mut w = orig.clone();
        apply_working(&perturb("weights.w:scale(2)").kind, half, &mut w, 3);
        assert!(w
            .iter()
            .zip(&orig)
            .all(|(a, b)| half.to_f32(*a) == 2.0 * half.to_f32(*b)));
    }
}

/// `megac train --perturb` on a weight under bf16 and fp16 mixed precision: the same
/// exponent bit flip given twice at step 2 trains bit-identically to the clean run (the
/// working weight restored bit for bit), once it leaves step 1 bit-identical and changes
/// step 2 (its forward and backward read the faulted working weight) and step 3; a sign
/// flip of every element changes step 2 too.
#[test]
fn train_weight_faults_in_mixed_precision() {
    let w = "weights.model.layers.0.mlp.down_proj.weight";
    let flip = format!("{w}:bitflip(exponent, 0.05)@2");
    let sign = format!("{w}:bitflip(sign, 1)@2");
    let bits = |r: &[(f64, f64)]| -> Vec<(u64, u64)> {
        r.iter().map(|(a, b)| (a.to_bits(), b.to_bits())).collect()
    };
    for precision in ["bf16", "fp16"] {
        let set = format!("train.precision=\"{precision}\"");
        let layout = [set.as_str()];
        let clean = bits(&train_in(&layout, &[], 0));
        let twice = bits(&train_in(&layout, &[&flip, &flip], 0));
        assert_eq!(twice, clean, "{precision}: the same flip twice");
        let once = bits(&train_in(&layout, &[&flip], 0));
        assert_eq!(once[0], clean[0], "{precision}: step 1");
        assert_ne!(once[1], clean[1], "{precision}: step 2");
        assert_ne!(once[2], clean[2], "{precision}: step 3");
        let negated = bits(&train_in(&layout, &[&sign], 0));
        assert_eq!(negated[0], clean[0], "{precision}: step 1");
        assert_ne!(negated[1], clean[1], "{precision}: step 2");
    }
}

/// The largest |a - b| over two equally long tensors.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}
