//! Distributed checkpoints through the `megac` binary: `--save` / `--load` resume bit-exactly
//! in the same layout and within fp32 tolerance in any other (resharding), faults are one
//! clear error before training, a crashed save leaves the previous checkpoint in use, and
//! `megac checkpoint inspect|export` read what `--save` wrote. Every reference is an
//! uninterrupted run.

mod common;

// A size read from an edited index must never turn into a giant allocation.
#[global_allocator]
static ALLOC: megac_fuzz::CappedAlloc = megac_fuzz::CappedAlloc;

use std::path::{Path, PathBuf};

use common::{megac, stderr, stdout};

const LLAMA: &str = "examples/llama-tiny.toml";
const MOE: &str = "examples/moe-tiny.toml";
const GPT: &str = "examples/gpt-tiny.toml";

/// `megac train MODEL` with `--set` overrides `sets` and `extra` arguments; panics with its
/// output unless it succeeds.
fn train(model: &str, sets: &[&str], extra: &[&str]) -> String {
    let o = run_train(model, sets, extra);
    assert!(
        o.status.success(),
        "megac train {model} {sets:?} {extra:?} failed:\n{}",
        stderr(&o)
    );
    stdout(&o)
}

fn run_train(model: &str, sets: &[&str], extra: &[&str]) -> std::process::Output {
    let mut args: Vec<&str> = vec!["train", model];
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    args.extend_from_slice(extra);
    megac(&args)
}

/// (step, loss, grad norm, loss scale, lr) of each step of a `--report`.
fn report(path: &Path) -> Vec<(u64, f64, f64, Option<f64>, f64)> {
    let text = std::fs::read_to_string(path).expect("report");
    let v: serde_json::Value = serde_json::from_str(&text).expect("report JSON");
    v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| {
            (
                s["step"].as_u64().expect("step"),
                s["loss"].as_f64().unwrap_or(f64::NAN),
                s["grad_norm"].as_f64().unwrap_or(f64::NAN),
                s["loss_scale"].as_f64(),
                s["lr"].as_f64().expect("lr"),
            )
        })
        .collect()
}

fn p(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary folder")
}

/// Saved at step 3 (and 2) and resumed to 6 in the same layout: steps 4, 5, 6 with the
/// uninterrupted run's losses, gradient norms and final parameters, bit for bit.
fn bit_exact(model: &str, sets: &[&str]) {
    let t = tmp();
    let (full, full_params) = (p(t.path(), "full.json"), p(t.path(), "full.safetensors"));
    train(
        model,
        sets,
        &[
            "--steps",
            "6",
            "--report",
            &full,
            "--save-params",
            &full_params,
        ],
    );
    let ckpt = p(t.path(), "ckpt");
    let out = train(
        model,
        sets,
        &["--steps", "3", "--save", &ckpt, "--save-interval", "2"],
    );
    assert!(out.contains("saved 2 checkpoints"), "{out}");
    let latest = std::fs::read_to_string(t.path().join("ckpt/latest")).expect("latest");
    assert_eq!(latest.trim(), "step-000003");
    assert!(t.path().join("ckpt/step-000002/index.json").is_file());
    let (res, res_params) = (p(t.path(), "res.json"), p(t.path(), "res.safetensors"));
    let out = train(
        model,
        sets,
        &[
            "--steps",
            "6",
            "--load",
            &ckpt,
            "--report",
            &res,
            "--save-params",
            &res_params,
        ],
    );
    assert!(out.contains("resumed after step 3 from"), "{out}");
    let (a, b) = (report(Path::new(&full)), report(Path::new(&res)));
    assert_eq!(
        b.iter().map(|s| s.0).collect::<Vec<_>>(),
        [4, 5, 6],
        "{sets:?}"
    );
    for s in &b {
        let r = a[s.0 as usize - 1];
        assert_eq!(
            (s.1.to_bits(), s.2.to_bits(), s.3, s.4.to_bits()),
            (r.1.to_bits(), r.2.to_bits(), r.3, r.4.to_bits()),
            "{model} {sets:?} step {}: resumed {s:?}, uninterrupted {r:?}",
            s.0
        );
    }
    assert_eq!(
        std::fs::read(&full_params).expect("params"),
        std::fs::read(&res_params).expect("params"),
        "{model} {sets:?}: final parameters differ"
    );
    // An explicit step folder: resumes after step 2.
    let res2 = p(t.path(), "res2.json");
    let step2 = p(t.path(), "ckpt/step-000002");
    train(
        model,
        sets,
        &["--steps", "4", "--load", &step2, "--report", &res2],
    );
    let c = report(Path::new(&res2));
    assert_eq!(c.iter().map(|s| s.0).collect::<Vec<_>>(), [3, 4]);
    assert_eq!(c[0].1.to_bits(), a[2].1.to_bits(), "{sets:?}");
}

#[test]
fn resume_in_the_same_layout_is_bit_exact_fp32() {
    bit_exact(LLAMA, &[]);
    bit_exact(
        LLAMA,
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.distributed_optimizer=true",
        ],
    );
    // GPT-2 ties its head to the word embeddings: the last stage's copy loads too. A
    // cosine schedule (warmup 2, decay to step 6) continues from the step.
    bit_exact(
        GPT,
        &[
            "parallel.pp=2",
            "train.lr_schedule=\"cosine\"",
            "train.warmup_steps=2",
            "train.decay_steps=6",
            "train.min_lr=1e-4",
        ],
    );
}

#[test]
fn resume_in_the_same_layout_is_bit_exact_bf16() {
    // bf16 keeps fp32 master weights beside the 16-bit working weights: both are saved.
    bit_exact(LLAMA, &["train.precision=\"bf16\"", "parallel.pp=2"]);
    bit_exact(
        LLAMA,
        &[
            "train.precision=\"bf16\"",
            "parallel.dp=2",
            "parallel.distributed_optimizer=true",
        ],
    );
}

#[test]
fn resume_continues_the_fp16_loss_scaler() {
    // The default scaler (2^32, hysteresis 2) overflows at every step of this model: the
    // scale halves from step 3 on, which a fresh scaler would not repeat after a resume.
    bit_exact(LLAMA, &["train.precision=\"fp16\""]);
}

/// Saved at step 2 in layout `from`, resumed to step 4 in layout `to`: within fp32 rel 1e-5
/// of the uninterrupted run in `to`.
#[test]
fn a_checkpoint_loads_into_any_layout() {
    let dist = "parallel.distributed_optimizer=true";
    let kv4 = "model.kv_heads=4";
    let l4 = "model.layers=4";
    let cases: &[(&str, &[&str], &[&str])] = &[
        (LLAMA, &[], &["parallel.tp=2"]),
        (LLAMA, &["parallel.tp=2"], &["parallel.pp=2"]),
        (LLAMA, &["parallel.pp=2"], &["parallel.dp=2", dist]),
        (LLAMA, &["parallel.dp=2", dist], &[]),
        (
            LLAMA,
            &["parallel.cp=2", "parallel.dp=2", dist],
            &["parallel.tp=2", "parallel.sequence_parallel=true"],
        ),
        (LLAMA, &["parallel.tp=2", kv4], &["parallel.tp=4", kv4]),
        (LLAMA, &["parallel.tp=4", kv4], &["parallel.tp=2", kv4]),
        (
            LLAMA,
            &["parallel.pp=2", "parallel.vpp=2", l4],
            &["parallel.dp=2", dist, l4],
        ),
        (MOE, &["parallel.dp=2", "parallel.ep=2"], &[]),
        (MOE, &[], &["parallel.dp=2", "parallel.ep=2", dist]),
        (
            MOE,
            &[
                "parallel.dp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            &["parallel.pp=2"],
        ),
        (
            GPT,
            &["parallel.tp=2"],
            &["parallel.pp=2", "parallel.dp=2", dist],
        ),
    ];
    let t = tmp();
    for (k, (model, from, to)) in cases.iter().enumerate() {
        let ckpt = p(t.path(), &format!("ckpt{k}"));
        train(model, from, &["--steps", "2", "--save", &ckpt]);
        let (full, res) = (
            p(t.path(), &format!("full{k}.json")),
            p(t.path(), &format!("res{k}.json")),
        );
        train(model, to, &["--steps", "4", "--report", &full]);
        train(
            model,
            to,
            &["--steps", "4", "--load", &ckpt, "--report", &res],
        );
        let (a, b) = (report(Path::new(&full)), report(Path::new(&res)));
        assert_eq!(b.iter().map(|s| s.0).collect::<Vec<_>>(), [3, 4]);
        for s in &b {
            let r = a[s.0 as usize - 1];
            for (got, want, what) in [(s.1, r.1, "loss"), (s.2, r.2, "grad norm")] {
                let rel = (got - want).abs() / want.abs();
                assert!(
                    rel <= 1e-5,
                    "{model} {from:?} -> {to:?} step {}: {what} {got} resumed, {want} uninterrupted (rel {rel:e})",
                    s.0
                );
            }
        }
    }
}

/// A checkpoint of 2 steps of llama-tiny on 2 ranks (tp = 2).
fn saved(t: &Path) -> PathBuf {
    let ckpt = t.join("ckpt");
    train(
        LLAMA,
        &["parallel.tp=2"],
        &["--steps", "2", "--save", &ckpt.display().to_string()],
    );
    ckpt
}

/// `--load ckpt` with `sets`: must fail before training with a message containing every
/// one of `wanted`, and write no report.
fn refused(t: &Path, ckpt: &Path, model: &str, sets: &[&str], wanted: &[&str]) {
    let report = t.join("refused.json");
    let o = run_train(
        model,
        sets,
        &[
            "--steps",
            "4",
            "--load",
            &ckpt.display().to_string(),
            "--report",
            &report.display().to_string(),
        ],
    );
    let err = stderr(&o);
    assert!(!o.status.success(), "{sets:?}: loaded:\n{}", stdout(&o));
    for w in wanted {
        assert!(err.contains(w), "{sets:?}: `{w}` not in:\n{err}");
    }
    assert_eq!(err.trim().lines().count(), 1, "one line:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!stdout(&o).contains("trained"), "{}", stdout(&o));
    assert!(!report.exists(), "a refused load wrote a report");
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_by_name() {
    let t = tmp();
    let ckpt = saved(t.path());
    let step = ckpt.join("step-000002");
    let shard = step.join("rank-00001.bin");
    let bytes = std::fs::read(&shard).expect("shard");
    // Another model, another geometry, nothing left to do, nothing there.
    refused(
        t.path(),
        &ckpt,
        LLAMA,
        &["model.layers=3"],
        &[
            "index.json",
            "not a checkpoint of this model",
            "model.layers.2",
        ],
    );
    refused(
        t.path(),
        &ckpt,
        LLAMA,
        &["model.hidden=128", "model.ffn_hidden=344"],
        &["index.json", "not a checkpoint of this model", "[256, 64]"],
    );
    refused(
        t.path(),
        &ckpt,
        LLAMA,
        &["train.global_batch=16"],
        &["global_batch 8", "16"],
    );
    let o = megac(&[
        "train",
        LLAMA,
        "--steps",
        "2",
        "--load",
        &ckpt.display().to_string(),
    ]);
    assert!(
        stderr(&o).contains("nothing left to train"),
        "{}",
        stderr(&o)
    );
    refused(
        t.path(),
        &t.path().join("nowhere"),
        LLAMA,
        &[],
        &["nowhere", "no such checkpoint folder"],
    );
    // Truncated: one error naming the shard.
    std::fs::write(&shard, &bytes[..bytes.len() - 8]).expect("truncate");
    refused(
        t.path(),
        &ckpt,
        LLAMA,
        &[],
        &["rank-00001.bin", "truncated", &format!("{}", bytes.len())],
    );
    // Corrupted: the same size, one bit flipped.
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x10;
    std::fs::write(&shard, &flipped).expect("corrupt");
    refused(
        t.path(),
        &ckpt,
        LLAMA,
        &[],
        &["rank-00001.bin", "corrupted", "checksum"],
    );
    // A shard missing, an index damaged.
    std::fs::remove_file(&shard).expect("remove");
    refused(
        t.path(),
        &ckpt,
        LLAMA,
        &[],
        &["rank-00001.bin", "cannot open"],
    );
    std::fs::write(&shard, &bytes).expect("restore");
    let index = step.join("index.json");
    let text = std::fs::read_to_string(&index).expect("index");
    std::fs::write(&index, &text[..text.len() / 2]).expect("cut index");
    refused(
        t.path(),
        &step,
        LLAMA,
        &[],
        &["index.json", "malformed index"],
    );
    // A shape no file could hold: refused, not allocated.
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("index");
    v["tensors"][0]["shape"] = serde_json::json!([4294967296u64, 65536]);
    std::fs::write(&index, v.to_string()).expect("edit index");
    refused(
        t.path(),
        &step,
        LLAMA,
        &[],
        &["index.json", "malformed index", "does not fit"],
    );
    std::fs::write(&index, &text).expect("restore index");
    // Restored: it loads again.
    train(
        LLAMA,
        &[],
        &["--steps", "3", "--load", &ckpt.display().to_string()],
    );
}

#[test]
fn a_crashed_save_leaves_the_previous_checkpoint_in_use() {
    let t = tmp();
    let ckpt = saved(t.path());
    // What a save killed at step 4 leaves: a half-written temporary folder, and (a copy cut
    // short) a step folder without its index.
    let tmp4 = ckpt.join("step-000004.tmp");
    std::fs::create_dir_all(&tmp4).expect("tmp");
    std::fs::write(tmp4.join("rank-00000.bin"), [1u8, 2, 3]).expect("half file");
    let dir4 = ckpt.join("step-000004");
    std::fs::create_dir_all(&dir4).expect("dir");
    std::fs::write(dir4.join("rank-00000.bin"), [1u8, 2, 3]).expect("half file");
    let resumed = |name: &str| {
        let r = t.path().join(name);
        train(
            LLAMA,
            &["parallel.tp=2"],
            &[
                "--steps",
                "4",
                "--load",
                &ckpt.display().to_string(),
                "--report",
                &r.display().to_string(),
            ],
        );
        report(&r).iter().map(|s| s.0).collect::<Vec<_>>()
    };
    assert_eq!(resumed("a.json"), [3, 4], "latest names step 2");
    // `latest` lost, or naming the incomplete step: the highest complete step folder.
    std::fs::write(ckpt.join("latest"), "step-000004\n").expect("latest");
    assert_eq!(resumed("b.json"), [3, 4]);
    std::fs::remove_file(ckpt.join("latest")).expect("latest");
    assert_eq!(resumed("c.json"), [3, 4]);
    // The next save clears the stale temporary folder and completes step 4.
    std::fs::remove_dir_all(&dir4).expect("rm");
    train(
        LLAMA,
        &["parallel.tp=2"],
        &[
            "--steps",
            "4",
            "--load",
            &ckpt.display().to_string(),
            "--save",
            &ckpt.display().to_string(),
        ],
    );
    assert!(!tmp4.exists());
    assert!(dir4.join("index.json").is_file());
    let latest = std::fs::read_to_string(ckpt.join("latest")).expect("latest");
    assert_eq!(latest.trim(), "step-000004");
}

#[test]
fn inspect_and_export_read_a_checkpoint() {
    let t = tmp();
    let ckpt = t.path().join("ckpt");
    let params = t.path().join("params.safetensors");
    train(
        LLAMA,
        &["parallel.tp=2", "parallel.dp=2"],
        &[
            "--steps",
            "2",
            "--save",
            &ckpt.display().to_string(),
            "--save-params",
            &params.display().to_string(),
        ],
    );
    let o = megac(&["checkpoint", "inspect", &ckpt.display().to_string()]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    for want in [
        "step-000002",
        "llama-tiny",
        "step           2 (16 samples consumed)",
        "tp=2",
        "dp=2",
        "(4 ranks)",
        "model.embed_tokens.weight",
        "param,exp_avg,exp_avg_sq",
    ] {
        assert!(out.contains(want), "`{want}` not in:\n{out}");
    }
    // The step folder holds the model's Hugging Face config, which export puts beside the
    // weights: the one --save-params wrote.
    let exported = t.path().join("export").join("model.safetensors");
    let o = megac(&[
        "checkpoint",
        "export",
        &ckpt.display().to_string(),
        "-o",
        &exported.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&exported).expect("export"),
        std::fs::read(&params).expect("params"),
        "export differs from --save-params of the same run"
    );
    let config = std::fs::read_to_string(t.path().join("export").join("config.json"))
        .expect("export writes config.json beside the weights");
    assert_eq!(
        config,
        std::fs::read_to_string(t.path().join("config.json")).expect("--save-params' config"),
    );
    assert!(config.contains("\"LlamaForCausalLM\""), "{config}");
}

/// A model whose checkpoint (26 MiB) takes longer to write than a step to train: a kill
/// lands in a save.
const SAVE_BOUND: &[&str] = &[
    "parallel.tp=2",
    "model.vocab=16384",
    "model.seq_len=16",
    "train.micro_batch=1",
    "train.global_batch=2",
];

#[test]
fn a_run_killed_while_saving_resumes_from_a_complete_checkpoint() {
    // Saving after every step, killed (SIGKILL) after its first checkpoint is complete;
    // whatever the kill interrupted, `--load` finds a complete checkpoint and resumes
    // exactly. At least one of the attempts must have been killed inside a save (it leaves
    // a `.tmp` folder).
    let mut inside = 0;
    for attempt in 0..5 {
        let t = tmp();
        let ckpt = t.path().join("ckpt");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_megac"));
        cmd.args(["train", LLAMA]);
        for s in SAVE_BOUND {
            cmd.args(["--set", s]);
        }
        let mut child = cmd
            .args(["--steps", "100000", "--save-interval", "1", "--save"])
            .arg(&ckpt)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start megac");
        let start = std::time::Instant::now();
        while !ckpt.join("latest").exists() {
            assert!(start.elapsed().as_secs() < 120, "no checkpoint after 120 s");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        // Kill as soon as a later save has started (its `.tmp` folder exists).
        let saving = |d: &Path| {
            std::fs::read_dir(d).is_ok_and(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            })
        };
        while !saving(&ckpt) && start.elapsed().as_secs() < 120 {
            std::thread::sleep(std::time::Duration::from_micros(200 * (attempt + 1)));
        }
        child.kill().expect("kill -9");
        child.wait().expect("reap");
        let partial = std::fs::read_dir(&ckpt)
            .expect("checkpoint folder")
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
        inside += usize::from(partial);
        let o = megac(&["checkpoint", "inspect", &ckpt.display().to_string()]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        let step: u64 = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("step"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no step in:\n{out}"));
        let (full, res) = (p(t.path(), "full.json"), p(t.path(), "res.json"));
        let total = (step + 1).to_string();
        train(LLAMA, SAVE_BOUND, &["--steps", &total, "--report", &full]);
        let ck = ckpt.display().to_string();
        train(
            LLAMA,
            SAVE_BOUND,
            &["--steps", &total, "--load", &ck, "--report", &res],
        );
        let (a, b) = (report(Path::new(&full)), report(Path::new(&res)));
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].0, step + 1);
        let r = a[step as usize];
        assert_eq!(
            (b[0].1.to_bits(), b[0].2.to_bits()),
            (r.1.to_bits(), r.2.to_bits()),
            "step {}: resumed {:?}, uninterrupted {r:?}",
            step + 1,
            b[0]
        );
        if inside > 0 {
            break;
        }
    }
    assert!(inside > 0, "no kill landed inside a save");
}

#[test]
fn async_saves_write_what_synchronous_saves_write() {
    // Snapshots written by a background thread, completed at the next save: the same
    // folders, byte for byte, as synchronous saves of the same run; and they resume.
    let t = tmp();
    let (a, s) = (p(t.path(), "async"), p(t.path(), "sync"));
    let sets = &["parallel.dp=2", "parallel.distributed_optimizer=true"];
    let out = train(
        LLAMA,
        sets,
        &[
            "--steps",
            "3",
            "--save-interval",
            "1",
            "--save",
            &a,
            "--save-async",
        ],
    );
    assert!(out.contains("saved 3 checkpoints"), "{out}");
    train(
        LLAMA,
        sets,
        &["--steps", "3", "--save-interval", "1", "--save", &s],
    );
    for step in ["step-000001", "step-000002", "step-000003"] {
        for file in ["index.json", "rank-00000.bin", "rank-00001.bin"] {
            let read = |d: &str| std::fs::read(Path::new(d).join(step).join(file)).expect(file);
            assert!(read(&a) == read(&s), "{step}/{file} differs");
        }
    }
    let latest = std::fs::read_to_string(t.path().join("async/latest")).expect("latest");
    assert_eq!(latest.trim(), "step-000003");
    let report = p(t.path(), "r.json");
    let step1 = p(t.path(), "async/step-000001");
    train(
        LLAMA,
        sets,
        &["--steps", "2", "--load", &step1, "--report", &report],
    );
    assert_eq!(report_steps(&report), [2]);
}

fn report_steps(path: &str) -> Vec<u64> {
    report(Path::new(path)).iter().map(|s| s.0).collect()
}

#[test]
fn mutated_indexes_are_errors_not_panics() {
    // 400 random edits of a real index (values replaced, removed, duplicated, numbers
    // pushed to extremes: the fuzzer's JSON mutator), each opened, checked against the model
    // and, when accepted, assembled as `checkpoint export` and `--load` do: every outcome is
    // a value or an error with a message, never a panic or a giant allocation.
    let t = tmp();
    let ckpt = saved(t.path());
    let step = ckpt.join("step-000002");
    let index = step.join("index.json");
    let text = std::fs::read_to_string(&index).expect("index");
    let original: serde_json::Value = serde_json::from_str(&text).expect("index JSON");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(LLAMA);
    let spec = megac_frontend::load(&path, &["parallel.tp=2".to_string()])
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).expect("passes");
    let plan = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .expect("plan");
    let (mut accepted, mut rejected) = (0, 0);
    for i in 0..400u64 {
        let mut rng = megac_fuzz::mutate::Rng::for_input(0xc4ec_4901, i);
        let mut v = original.clone();
        for _ in 0..1 + rng.below(3) {
            megac_fuzz::mutate::mutate_json(&mut rng, &mut v);
        }
        std::fs::write(&index, v.to_string()).expect("write index");
        let outcome = std::panic::catch_unwind(|| {
            let ckpt = megac_runtime::checkpoint::Checkpoint::open(&step)?;
            ckpt.check(&plan, 4)?;
            ckpt.hf_tensors(megac_runtime::checkpoint::Kind::ExpAvg)?;
            Ok::<_, megac_runtime::checkpoint::CheckpointError>(())
        });
        match outcome {
            Ok(Ok(())) => accepted += 1,
            Ok(Err(e)) => {
                assert!(
                    !e.to_string().trim().is_empty(),
                    "mutation {i}: empty error"
                );
                rejected += 1;
            }
            Err(_) => panic!("mutation {i} panicked: {v}"),
        }
    }
    std::fs::write(&index, &text).expect("restore");
    assert!(rejected > 100, "{accepted} accepted, {rejected} rejected");
}

#[test]
fn run_takes_the_checkpoint_options_and_refuses_bad_ones() {
    let t = tmp();
    let plan = p(t.path(), "plan");
    let o = megac(&["compile", LLAMA, "--set", "parallel.dp=2", "-o", &plan]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ckpt = p(t.path(), "ckpt");
    let o = megac(&["run", &plan, "--steps", "2", "--save", &ckpt]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report = p(t.path(), "r.json");
    let o = megac(&[
        "run", &plan, "--steps", "3", "--load", &ckpt, "--report", &report,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(report_steps(&report), [3]);
    for (args, wanted) in [
        (
            vec!["--save", ckpt.as_str(), "--save-interval", "0"],
            "--save-interval 0",
        ),
        (vec!["--save-interval", "2"], "--save"),
        (vec!["--save-async"], "--save"),
        (
            vec!["--load", ckpt.as_str(), "--init", "x.safetensors"],
            "--init",
        ),
    ] {
        let mut a = vec!["run", plan.as_str(), "--steps", "3"];
        a.extend(args.iter().copied());
        let o = megac(&a);
        assert!(!o.status.success(), "{a:?} ran");
        assert!(stderr(&o).contains(wanted), "{a:?}: {}", stderr(&o));
        assert!(!stdout(&o).contains("trained"), "{a:?} trained");
    }
}
