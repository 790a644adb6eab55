//! `megac scope` against Hugging Face transformers: every probe point of the tiny llama,
//! gpt and mixtral models on one input equals transformers' value
//! (`tests/golden/*/scope.safetensors`, made by tests/golden/make_scope_golden.py from
//! `output_hidden_states`, `output_attentions` and module hooks; not run in CI) within
//! float32 rounding; patterns select points; bad patterns are one error and write nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use megac_runtime::infer::{glob, with_ranks, with_ranks_scope};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// The one-sample plan of fixture `name` with every probe point compiled in (the `probe`
/// pass).
fn forward_plan(name: &str, extra: &[&str]) -> megac_ir::gate::CheckedPlan {
    let probes = megac_passes::Instrument {
        probes: vec!["*".to_string()],
        ..Default::default()
    };
    forward_plan_with(name, extra, probes)
}

/// As [`forward_plan`], with `instrument`'s probes and perturbations.
fn forward_plan_with(
    name: &str,
    extra: &[&str],
    instrument: megac_passes::Instrument,
) -> megac_ir::gate::CheckedPlan {
    let mut sets = vec!["train.micro_batch=1", "train.global_batch=1"];
    sets.extend_from_slice(extra);
    let sets: Vec<String> = sets.into_iter().map(String::from).collect();
    let spec = megac_frontend::load(&fixture(name).join("model.toml"), &sets)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline_with(spec, instrument, None, true).unwrap();
    let plan =
        megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops).unwrap();
    megac_ir::gate::CheckedPlan::check(plan).unwrap()
}

fn tensors(bytes: &[u8]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
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

const TOKENS: [u32; 8] = [3, 14, 15, 92, 65, 35, 89, 79];

/// Every point, by name and shape, within 1e-6 of transformers (absolute, scaled by the
/// tensor's largest magnitude when that is above 1), in the layout `sets` gives (tensor
/// parallel: the points gathered from the ranks' shards).
fn probes_match(name: &str, sets: &[&str]) {
    let plan = forward_plan(name, sets);
    let init = fixture(name).join("init.safetensors");
    let mut got =
        with_ranks_scope(&plan, &init, |inf| inf.probe(&TOKENS, &["*".to_string()])).unwrap();
    got.sort_by(|a, b| a.name.cmp(&b.name));
    let want = tensors(&std::fs::read(fixture(name).join("scope.safetensors")).unwrap());
    let names = |v: Vec<&String>| v.into_iter().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(got.iter().map(|p| &p.name).collect()),
        names(want.iter().map(|w| &w.0).collect())
    );
    // 2 layers: embed, logits, and 4 points per layer.
    // 2 layers of 4 points and the lens's 2 (mixtral: and the router), embed and logits.
    let per_layer = if name == "mixtral" { 7 } else { 6 };
    assert_eq!(got.len(), 2 + 2 * per_layer);
    for (p, (wname, wshape, wvals)) in got.iter().zip(&want) {
        assert_eq!(&p.shape, wshape, "{name}: {wname}");
        let scale = wvals.iter().fold(1f32, |m, x| m.max(x.abs()));
        let diff = max_diff(&p.values, wvals);
        eprintln!("{name} {sets:?} {wname}: max |diff| {diff:e} (scale {scale})");
        assert!(
            diff <= 1e-6 * scale,
            "{name} {sets:?}: {wname}: max |diff| {diff}"
        );
    }
    // A probe is a genuine readout: the last layer's output differs from its attention's.
    let find = |n: &str| &got.iter().find(|p| p.name == n).unwrap().values;
    assert_ne!(find("layers.1.out"), find("layers.1.attn.out"));
}

#[test]
fn probes_llama_match_transformers() {
    probes_match("llama", &[]);
}

#[test]
fn probes_gpt_match_transformers() {
    probes_match("gpt", &[]);
}

#[test]
fn probes_mixtral_match_transformers() {
    probes_match("mixtral", &[]);
}

/// pp2: the points of each stage's layers gathered from the stage that ran them; and
/// pp2 × tp2 with sequence parallelism.
#[test]
fn probes_pp2_match_transformers() {
    probes_match("llama", &["parallel.pp=2"]);
    probes_match("gpt", &["parallel.pp=2"]);
    probes_match(
        "mixtral",
        &[
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
        ],
    );
}

/// tp2 (heads, ffn and vocabulary split over two ranks), with and without sequence
/// parallelism (the residual stream split over the sequence too).
#[test]
fn probes_tp2_match_transformers() {
    probes_match("llama", &["parallel.tp=2"]);
    probes_match("gpt", &["parallel.tp=2", "parallel.sequence_parallel=true"]);
    probes_match(
        "mixtral",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    );
}

/// dp2 (each replica runs the sample; the probes' batch split over dp gathered by layout),
/// also with tp2 and sequence parallelism: transformers' values, and bit for bit the
/// one-device (or tp2-sp) probes.
#[test]
fn probes_dp2_match_transformers_and_one_device() {
    let dp = ["parallel.dp=2", "train.global_batch=2"];
    probes_match("llama", &dp);
    let tp_sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    let mut both = dp.to_vec();
    both.extend_from_slice(&tp_sp);
    probes_match("mixtral", &both);
    for (name, base, with_dp) in [
        ("llama", vec![], dp.to_vec()),
        ("mixtral", tp_sp.to_vec(), both.clone()),
    ] {
        let init = fixture(name).join("init.safetensors");
        let all = ["*".to_string()];
        let one = with_ranks_scope(&forward_plan(name, &base), &init, |inf| {
            inf.probe(&TOKENS, &all)
        })
        .unwrap();
        let two = with_ranks_scope(&forward_plan(name, &with_dp), &init, |inf| {
            inf.probe(&TOKENS, &all)
        })
        .unwrap();
        assert_eq!(one, two, "{name} {with_dp:?}");
    }
    // generate's forward runs dp too: the one-device logits, bit for bit.
    let init = fixture("llama").join("init.safetensors");
    let one = with_ranks(&forward_plan("llama", &[]), &init, |inf| {
        inf.logits(&TOKENS)
    })
    .unwrap();
    let two = with_ranks(&forward_plan("llama", &dp), &init, |inf| {
        inf.logits(&TOKENS)
    })
    .unwrap();
    assert_eq!(one, two);
}

/// cp2, cp2 × tp2 (mixtral with sequence parallelism) and cp2 × pp2 (llama); the sequence
/// is split over cp into the load-balanced chunks 0 and 3, 1 and 2 of four, and the probes
/// are put back in order by their buffers' layouts: transformers' values, and the one-device
/// probes within 1e-6
/// (absolute, scaled by the tensor's largest magnitude above 1): the ranks' attention sums
/// its keys in another order, so the layouts differ from one device by float32 rounding.
#[test]
fn probes_cp2_match_transformers_and_one_device() {
    for name in ["llama", "gpt", "mixtral"] {
        let mut layouts: Vec<&[&str]> = if name == "mixtral" {
            vec![
                &["parallel.cp=2"],
                &[
                    "parallel.cp=2",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                ],
            ]
        } else {
            vec![&["parallel.cp=2"], &["parallel.cp=2", "parallel.tp=2"]]
        };
        if name == "llama" {
            layouts.push(&["parallel.cp=2", "parallel.pp=2"]);
        }
        let init = fixture(name).join("init.safetensors");
        let all = ["*".to_string()];
        let one = with_ranks_scope(&forward_plan(name, &[]), &init, |inf| {
            inf.probe(&TOKENS, &all)
        })
        .unwrap();
        for sets in layouts {
            probes_match(name, sets);
            let cp = with_ranks_scope(&forward_plan(name, sets), &init, |inf| {
                inf.probe(&TOKENS, &all)
            })
            .unwrap();
            assert_eq!(cp.len(), one.len());
            for (a, b) in cp.iter().zip(&one) {
                assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{name} {sets:?}");
                let scale = b.values.iter().fold(1f32, |m, x| m.max(x.abs()));
                let diff = max_diff(&a.values, &b.values);
                eprintln!("{name} {sets:?} {}: vs one device {diff:e}", a.name);
                assert!(diff <= 1e-6 * scale, "{name} {sets:?} {}: {diff}", a.name);
            }
        }
        // generate's forward runs cp too: the same logits.
        let plan = forward_plan(name, &["parallel.cp=2"]);
        let cp = with_ranks(&plan, &init, |inf| inf.logits(&TOKENS)).unwrap();
        let want = &one.iter().find(|p| p.name == "logits").unwrap().values;
        assert_eq!(cp.len(), want.len());
        assert!(cp.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-6));
    }
}

#[test]
fn glob_patterns() {
    assert!(glob("layers.*.attn.probs", "layers.1.attn.probs"));
    assert!(glob("*", "embed"));
    assert!(glob("layers.1.*", "layers.1.mlp.out"));
    assert!(!glob("layers.1.*", "layers.10"));
    assert!(glob("*.out", "layers.0.attn.out"));
    assert!(!glob("layers.*.attn.probs", "layers.1.attn.out"));
    assert!(!glob("embed", "embeds"));
    assert!(glob("*a*b*", "xaybz"));
    assert!(!glob("*a*b", "ba"));
}

fn megac(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

#[test]
fn scope_command_writes_the_selected_points() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("p.safetensors");
    let dir = fixture("llama");
    let (m, i) = (dir.join("model.toml"), dir.join("init.safetensors"));
    let base = [
        "scope",
        m.to_str().unwrap(),
        "--init",
        i.to_str().unwrap(),
        "--tokens",
        "3,14,15,92,65,35,89,79",
    ];
    let mut args = base.to_vec();
    args.extend([
        "--probe",
        "layers.*.attn.probs",
        "--probe",
        "logits",
        "-o",
        out.to_str().unwrap(),
    ]);
    let run = megac(&args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let got = tensors(&std::fs::read(&out).unwrap());
    let names: Vec<&str> = got.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(
        names,
        ["layers.0.attn.probs", "layers.1.attn.probs", "logits"]
    );
    let want = tensors(&std::fs::read(dir.join("scope.safetensors")).unwrap());
    let probs = want.iter().find(|w| w.0 == "layers.1.attn.probs").unwrap();
    assert_eq!(got[1].1, probs.1);
    assert_eq!(got[1].1, [1, 4, 8, 8]);

    // Bad input: one error, exit 1, no file.
    let bad = tmp.path().join("bad.safetensors");
    for (tokens, probe, want) in [
        (
            "1,2",
            "layers.*.mlp",
            "--probe layers.*.mlp matches no probe point of this model; the points are embed, layers.0.attn.probs",
        ),
        ("1,200", "logits", "token 1 is 200, outside the vocabulary [0, 128)"),
    ] {
        let mut args = base[..4].to_vec();
        args.extend(["--tokens", tokens, "--probe", probe, "-o", bad.to_str().unwrap()]);
        let run = megac(&args);
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!bad.exists());
    }
}

/// `megac scope ... --perturb P... --report R.json` on llama; the parsed report.
fn perturb_report(perturb: &[&str], seed: &str) -> serde_json::Value {
    perturb_report_in(&[], perturb, seed)
}

/// [`perturb_report`] with the `--set`s `sets` (a layout).
fn perturb_report_in(sets: &[&str], perturb: &[&str], seed: &str) -> serde_json::Value {
    let tmp = tempfile::tempdir().unwrap();
    let (out, report) = (tmp.path().join("p.safetensors"), tmp.path().join("r.json"));
    let dir = fixture("llama");
    let (m, i) = (dir.join("model.toml"), dir.join("init.safetensors"));
    let mut args = vec![
        "scope",
        m.to_str().unwrap(),
        "--init",
        i.to_str().unwrap(),
        "--tokens",
        "3,14,15,92,65,35,89,79",
        "--probe",
        "logits",
        "-o",
        out.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
        "--seed",
        seed,
    ];
    for p in perturb {
        args.extend(["--perturb", p]);
    }
    for s in sets {
        args.extend(["--set", s]);
    }
    let run = megac(&args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap()
}

const DOWN: &str = "weights.model.layers.0.mlp.down_proj.weight";

/// `megac scope --report` under cp2: noise(0) gives kl exactly 0 and agreement 1, and a
/// knockout (`layers.0.attn.out:scale(0)`, the same on every layout) the one-device report's
/// losses and kl within float rounding.
#[test]
fn perturbation_report_under_cp() {
    let cp = ["parallel.cp=2"];
    let r = perturb_report_in(&cp, &["layers.0.out:noise(0)"], "1");
    assert_eq!(r["kl"].as_f64(), Some(0.0));
    assert_eq!(r["top1_agreement"].as_f64(), Some(1.0));
    assert_eq!(r["clean_loss"], r["perturbed_loss"]);
    let knock = ["layers.0.attn.out:scale(0)"];
    let (one, two) = (
        perturb_report(&knock, "1"),
        perturb_report_in(&cp, &knock, "1"),
    );
    for key in ["clean_loss", "perturbed_loss", "kl", "top1_agreement"] {
        let (a, b) = (one[key].as_f64().unwrap(), two[key].as_f64().unwrap());
        eprintln!("cp2 report {key}: {b} vs one device {a}");
        assert!((a - b).abs() <= 1e-5, "{key}: {b} vs {a}");
    }
    assert!(one["kl"].as_f64().unwrap() > 0.0);
}

#[test]
fn perturbation_identities() {
    // noise(0): the perturbed run is the clean run.
    let r = perturb_report(&["layers.0.out:noise(0)"], "1");
    assert_eq!(r["kl"].as_f64(), Some(0.0));
    assert_eq!(r["top1_agreement"].as_f64(), Some(1.0));
    assert_eq!(r["clean_loss"], r["perturbed_loss"]);
    // The clean loss is the next-token cross-entropy of transformers' logits.
    let want = tensors(&std::fs::read(fixture("llama").join("scope.safetensors")).unwrap());
    let logits = &want.iter().find(|w| w.0 == "logits").unwrap().2;
    let v = 128;
    let mut loss = 0.0;
    for t in 0..TOKENS.len() - 1 {
        let row = &logits[t * v..(t + 1) * v];
        let max = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
        let lse = row
            .iter()
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        loss += lse - f64::from(row[TOKENS[t + 1] as usize]);
    }
    loss /= (TOKENS.len() - 1) as f64;
    let clean = r["clean_loss"].as_f64().unwrap();
    assert!((clean - loss).abs() < 1e-5, "{clean} vs {loss}");
    assert_eq!(r["per_position"].as_array().unwrap().len(), TOKENS.len());
    // The same bit flips twice restore the weights bit for bit.
    let flip = format!("{DOWN}:bitflip(exponent, 0.01)");
    let once = perturb_report(&[&flip], "1");
    assert!(once["kl"].as_f64().unwrap() > 0.0);
    let twice = perturb_report(&[&flip, &flip], "1");
    assert_eq!(twice["kl"].as_f64(), Some(0.0));
    assert_eq!(twice["top1_agreement"].as_f64(), Some(1.0));
    assert_eq!(twice["perturbed_loss"], twice["clean_loss"]);
    // Noise is seeded: the same seed, the same report; another seed, another.
    let a = perturb_report(&["layers.0.out:noise(0.5)"], "7");
    assert!(a["kl"].as_f64().unwrap() > 0.0);
    assert_eq!(a, perturb_report(&["layers.0.out:noise(0.5)"], "7"));
    assert_ne!(
        a["kl"],
        perturb_report(&["layers.0.out:noise(0.5)"], "8")["kl"]
    );
}

#[test]
fn perturbation_kinds_on_tensors() {
    use megac_runtime::infer::{apply, BitField, PerturbKind, Perturbation};
    let bytes = std::fs::read(fixture("llama").join("init.safetensors")).unwrap();
    let all = tensors(&bytes);
    let w = &all
        .iter()
        .find(|t| t.0 == "model.layers.0.mlp.down_proj.weight")
        .unwrap()
        .2;
    for field in [BitField::Sign, BitField::Exponent, BitField::Mantissa] {
        let kind = PerturbKind::Bitflip(field, 0.05);
        let mut x = w.clone();
        apply(&kind, &mut x, 42);
        let changed: Vec<u32> = x
            .iter()
            .zip(w)
            .map(|(a, b)| a.to_bits() ^ b.to_bits())
            .filter(|&d| d != 0)
            .collect();
        // About 5% of the elements, one bit each, in the field.
        let frac = changed.len() as f64 / w.len() as f64;
        assert!((0.03..0.07).contains(&frac), "{field:?}: {frac}");
        let mask: u32 = match field {
            BitField::Sign => 1 << 31,
            BitField::Exponent => 0xff << 23,
            BitField::Mantissa => (1 << 23) - 1,
        };
        assert!(changed
            .iter()
            .all(|d| d.count_ones() == 1 && d & mask == *d));
        apply(&kind, &mut x, 42);
        assert!(x.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    // scale(2) doubles exactly; noise's spread is sigma times the RMS.
    let mut x = w.clone();
    apply(&PerturbKind::Scale(2.0), &mut x, 0);
    assert!(x.iter().zip(w).all(|(a, b)| *a == 2.0 * b));
    let mut x = w.clone();
    apply(&PerturbKind::Noise(0.1), &mut x, 3);
    let rms = |v: &[f64]| (v.iter().map(|d| d * d).sum::<f64>() / v.len() as f64).sqrt();
    let d: Vec<f64> = x.iter().zip(w).map(|(a, b)| f64::from(a - b)).collect();
    let base: Vec<f64> = w.iter().map(|&b| f64::from(b)).collect();
    let ratio = rms(&d) / rms(&base);
    assert!((0.09..0.11).contains(&ratio), "{ratio}");
    // Parsing.
    assert_eq!(
        Perturbation::parse("layers.1.out:bitflip(mantissa, 0.5)")
            .unwrap()
            .kind,
        PerturbKind::Bitflip(BitField::Mantissa, 0.5)
    );
    for bad in [
        "layers.1.out",
        "layers.1.out:noise(-1)",
        "layers.1.out:bitflip(sign, 2)",
        "layers.1.out:bitflip(middle, 0.1)",
        "layers.1.out:scale(x)",
        "layers.1.out:zero()",
    ] {
        assert!(Perturbation::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn perturbed_probes_and_bad_perturbations() {
    let plan = forward_plan("llama", &[]);
    let init = fixture("llama").join("init.safetensors");
    let pats = ["layers.1.mlp.out".to_string()];
    let clean = with_ranks(&plan, &init, |inf| inf.probe(&TOKENS, &pats)).unwrap();
    let p = megac_runtime::infer::Perturbation::parse("layers.1.mlp.out:scale(2)").unwrap();
    let perturbed = forward_plan_with(
        "llama",
        &[],
        megac_passes::Instrument {
            probes: pats.to_vec(),
            perturbations: vec![megac_runtime::perturb::TrainPerturbation {
                perturbation: p,
                step: None,
            }],
            tokens: TOKENS.len() as u64,
            ..Default::default()
        },
    );
    let scaled = with_ranks(&perturbed, &init, |inf| inf.probe(&TOKENS, &pats)).unwrap();
    assert!(clean[0]
        .values
        .iter()
        .zip(&scaled[0].values)
        .all(|(a, b)| 2.0 * a == *b));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("p.safetensors");
    let dir = fixture("llama");
    let (m, i) = (dir.join("model.toml"), dir.join("init.safetensors"));
    for (perturb, want) in [
        (
            "layers.0.attn.probs:scale(2)",
            "attention and router probabilities are computed for probing",
        ),
        (
            "layers.9.out:scale(2)",
            "--perturb layers.9.out: no such point",
        ),
        ("weights.nope:scale(2)", "the model has no parameter `nope`"),
        (
            "embed:wobble(1)",
            "`wobble` with 1 argument(s) is not a kind",
        ),
    ] {
        let run = megac(&[
            "scope",
            m.to_str().unwrap(),
            "--init",
            i.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--probe",
            "logits",
            "--perturb",
            perturb,
            "-o",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(!out.exists());
    }
}

/// Expert parallelism (ep2, folded over dp2 or cp2; with tp2 and sequence parallelism): each
/// rank holds half the experts and the tokens go to them and back by all-to-all over ep;
/// the probes (the router's probabilities included) are gathered to their global shapes and
/// equal the one-device run's (bit for bit under dp, whose ranks each hold the whole
/// sequence; within 1e-6 scaled under cp, whose attention sums its keys in another order),
/// and mixtral's equal transformers'. qwen2-moe (shared experts, a dense first layer) has no
/// transformers probe file: it is checked against its one-device run.
#[test]
fn probes_ep2_match_one_device() {
    let dp_ep = ["parallel.dp=2", "train.global_batch=2", "parallel.ep=2"];
    let tp_sp = ["parallel.tp=2", "parallel.sequence_parallel=true"];
    let dp_ep_tp: Vec<&str> = dp_ep.iter().chain(&tp_sp).copied().collect();
    let cp_ep = ["parallel.cp=2", "parallel.ep=2"];
    let cp_ep_tp: Vec<&str> = cp_ep.iter().chain(&tp_sp).copied().collect();
    let all = ["*".to_string()];
    for name in ["mixtral", "qwen2_moe"] {
        let init = fixture(name).join("init.safetensors");
        let one = with_ranks_scope(&forward_plan(name, &[]), &init, |inf| {
            inf.probe(&TOKENS, &all)
        })
        .unwrap();
        assert!(one.iter().any(|p| p.name.ends_with(".moe.router")));
        for (sets, exact) in [
            (&dp_ep[..], true),
            (&dp_ep_tp[..], false),
            (&cp_ep[..], false),
            (&cp_ep_tp[..], false),
        ] {
            if name == "mixtral" {
                probes_match(name, sets);
            }
            let got = with_ranks_scope(&forward_plan(name, sets), &init, |inf| {
                inf.probe(&TOKENS, &all)
            })
            .unwrap();
            assert_eq!(got.len(), one.len(), "{name} {sets:?}");
            for (a, b) in got.iter().zip(&one) {
                assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{name} {sets:?}");
                let scale = b.values.iter().fold(1f32, |m, x| m.max(x.abs()));
                let diff = max_diff(&a.values, &b.values);
                eprintln!("{name} {sets:?} {}: vs one device {diff:e}", a.name);
                if exact {
                    assert_eq!(a.values, b.values, "{name} {sets:?} {}", a.name);
                }
                assert!(diff <= 1e-6 * scale, "{name} {sets:?} {}: {diff}", a.name);
            }
        }
    }
}

/// The largest |a - b| over two equally long tensors.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}
