//! A run never wastes the user's time or lies: output paths are checked before any work, a
//! diverging run stops with one error and saves nothing, `--init` weights must be finite,
//! a closed stdout pipe ends the process quietly, and the small mistakes found on the way
//! get one clear message. Every test runs the real binary.

mod common;
use common::{megac, stderr, stdout};

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `megac` with `args`, asserting it fails with exit code 1 and exactly `message` on stderr
/// and nothing on stdout, within `seconds`.
fn fails_fast(args: &[&str], message: &str, seconds: u64) {
    let t0 = Instant::now();
    let o = megac(args);
    let took = t0.elapsed();
    assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
    assert_eq!(stderr(&o), format!("{message}\n"), "{args:?}");
    assert_eq!(stdout(&o), "", "{args:?}");
    assert!(
        took < Duration::from_secs(seconds),
        "{args:?} took {took:?}: the check must come before any work"
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Files in `dir` (names), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn compile_tiny(out: &Path, sets: &[&str]) {
    let mut args = vec!["compile", "examples/llama-tiny.toml", "-o", s(out)];
    for set in sets {
        args.extend(["--set", set]);
    }
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
}

// ---- 1. output paths are checked before any work ----

#[test]
fn unwritable_output_paths_fail_before_compiling_or_training() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file.txt");
    std::fs::write(&file, "not a folder").unwrap();
    let under = file.join("x.safetensors");
    let under_s = s(&under);
    let file_s = s(&file);
    // The model has an error too (tp=3 does not divide the heads): the output check comes
    // first, so the run never gets as far as reading it.
    for flag in ["--save-params", "--report"] {
        fails_fast(
            &[
                "train",
                "examples/llama-tiny.toml",
                "--set",
                "parallel.tp=3",
                flag,
                under_s,
            ],
            &format!(
                "error: {flag} {under_s}: cannot create the folder {file_s}: {file_s} is a file"
            ),
            10,
        );
    }
    // Folders still to be made are resolved as `mkdir -p` would make them: `missing/x/../..`
    // is the folder they stand in, so this names a file inside `file.txt`.
    let dotted = dir.path().join("missing/x/../../file.txt/x.safetensors");
    let dotted_dir = dir.path().join("missing/x/../../file.txt");
    fails_fast(
        &[
            "train",
            "examples/llama-tiny.toml",
            "--save-params",
            s(&dotted),
        ],
        &format!(
            "error: --save-params {}: cannot create the folder {}: {file_s} is a file",
            s(&dotted),
            s(&dotted_dir)
        ),
        10,
    );
    assert!(
        !dir.path().join("missing").exists(),
        "the check made a folder"
    );
    fails_fast(
        &[
            "train",
            "examples/llama-tiny.toml",
            "--set",
            "parallel.tp=3",
            "--trace",
            file_s,
        ],
        &format!("error: --trace {file_s}: is a file, not a folder"),
        10,
    );
    fails_fast(
        &[
            "train",
            "examples/llama-tiny.toml",
            "--report",
            s(dir.path()),
        ],
        &format!(
            "error: --report {}: is a directory; give a file name",
            s(dir.path())
        ),
        10,
    );
    fails_fast(
        &["compile", "examples/llama-tiny.toml", "-o", file_s],
        &format!("error: -o {file_s}: is a file, not a folder"),
        10,
    );
    fails_fast(
        &[
            "schedule",
            "examples/llama3-70b.toml",
            "--format",
            "svg",
            "-o",
            under_s,
        ],
        &format!("error: -o {under_s}: cannot create the folder {file_s}: {file_s} is a file"),
        10,
    );
    fails_fast(
        &[
            "plan",
            "examples/llama3-8b.toml",
            "--gpus",
            "8",
            "--emit",
            under_s,
        ],
        &format!("error: --emit {under_s}: cannot create the folder {file_s}: {file_s} is a file"),
        10,
    );
    let plan = dir.path().join("plan");
    compile_tiny(&plan, &[]);
    fails_fast(
        &["simulate", s(&plan), "--trace", under_s],
        &format!("error: --trace {under_s}: cannot create the folder {file_s}: {file_s} is a file"),
        10,
    );
    fails_fast(
        &["run", s(&plan), "--save-params", under_s],
        &format!(
            "error: --save-params {under_s}: cannot create the folder {file_s}: {file_s} is a file"
        ),
        10,
    );
    // Nothing was left behind.
    assert_eq!(listing(dir.path()), ["file.txt", "plan"]);
}

/// A folder that cannot be written (when not root, who may write anywhere).
#[test]
fn a_read_only_folder_fails_first() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        eprintln!("skipped: root can write in a read-only folder");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let out = ro.join("x.safetensors");
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--save-params",
        s(&out),
    ]);
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with(&format!(
            "error: --save-params {}: cannot write in the folder {}: ",
            s(&out),
            s(&ro)
        )),
        "{}",
        stderr(&o)
    );
    assert_eq!(stdout(&o), "");
}

#[test]
fn missing_output_folders_are_created_and_no_probe_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let params = dir.path().join("a/b/params.safetensors");
    let report = dir.path().join("c/run.json");
    let trace = dir.path().join("d/trace");
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "1",
        "--save-params",
        s(&params),
        "--report",
        s(&report),
        "--trace",
        s(&trace),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // `train` writes the Hugging Face config.json beside the weights, and nothing else.
    assert_eq!(
        listing(&dir.path().join("a/b")),
        ["config.json", "params.safetensors"]
    );
    assert_eq!(listing(&dir.path().join("c")), ["run.json"]);
    assert_eq!(listing(&trace), ["rank-0.json"]);
}

// ---- 2. a diverging run stops and saves nothing; --init must be finite ----

/// Train llama-tiny with `args` added, expecting exactly `message` on stderr, exit 1, and
/// neither the `--save-params` nor the `--report` file.
fn diverges(args: &[&str], message: &str) {
    let dir = tempfile::tempdir().unwrap();
    let params = dir.path().join("params.safetensors");
    let report = dir.path().join("run.json");
    let mut all = vec![
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "50",
        "--save-params",
        s(&params),
        "--report",
        s(&report),
    ];
    all.extend(args);
    let o = megac(&all);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(stderr(&o), format!("{message}\n"));
    assert_eq!(stdout(&o), "");
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));
}

/// lr = 1e30: the first update throws the weights to ~1e30; the second step's gradients
/// overflow.
const LR_1E30: &str = "error: step 2: the gradient norm is not finite (loss 5.5452, gradient norm NaN); training stopped there, no parameters or report written\nhelp: try a lower train.lr (now 1e30; 1.000e30 at this step), a lower train.grad_clip (now 1), and check the data and the --init weights";

#[test]
fn a_nan_gradient_norm_stops_the_run_and_saves_nothing() {
    diverges(&["--set", "train.lr=1e30"], LR_1E30);
    diverges(
        &["--set", "train.lr=1e30", "--set", "train.grad_clip=0"],
        "error: step 2: the gradient norm is not finite (loss 5.5452, gradient norm NaN); training stopped there, no parameters or report written\nhelp: try a lower train.lr (now 1e30; 1.000e30 at this step), gradient clipping with train.grad_clip = 1.0 (now off), and check the data and the --init weights",
    );
}

#[test]
fn a_nan_gradient_norm_stops_every_rank() {
    diverges(
        &[
            "--set",
            "train.lr=1e30",
            "--set",
            "parallel.dp=2",
            "--set",
            "parallel.tp=2",
        ],
        LR_1E30,
    );
}

/// A change to one tensor's values, by name.
type Edit<'a> = (&'a str, &'a dyn Fn(&mut [f32]));

/// Copy the safetensors file `from` to `to`, changing the tensors `edits` name.
fn edit_safetensors(from: &Path, to: &Path, edits: &[Edit<'_>]) {
    use safetensors::tensor::TensorView;
    let bytes = std::fs::read(from).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32);
        let mut values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for (target, edit) in edits {
            if name == *target {
                edit(&mut values);
            }
        }
        let data = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push((name, view.shape().to_vec(), data));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, d)| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::F32, shape.clone(), d).unwrap(),
            )
        })
        .collect();
    std::fs::write(to, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn init_weights_with_nan_or_inf_are_rejected_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "1",
        "--save-params",
        s(&good),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bad = dir.path().join("bad.safetensors");
    edit_safetensors(
        &good,
        &bad,
        &[
            ("model.layers.1.mlp.down_proj.weight", &|v| v[5] = f32::NAN),
            ("model.norm.weight", &|v| v[0] = f32::INFINITY),
        ],
    );
    fails_fast(
        &["train", "examples/llama-tiny.toml", "--init", s(&bad)],
        &format!(
            "error: parameters {}: NaN or infinite values in 2 tensors: model.layers.1.mlp.down_proj.weight (1 of 11008 values, the first NaN at element 5), model.norm.weight (1 of 64 values, the first inf at element 0)",
            s(&bad)
        ),
        30,
    );
    // Finite but huge weights: the first forward pass overflows, and the run stops at step 1.
    let huge = dir.path().join("huge.safetensors");
    edit_safetensors(&good, &huge, &[("model.norm.weight", &|v| v.fill(3e38))]);
    diverges(
        &["--init", s(&huge)],
        "error: step 1: the loss is not finite (loss NaN, gradient norm NaN); training stopped there, no parameters or report written\nhelp: try a lower train.lr (now 1e-3; 1.000e-3 at this step), a lower train.grad_clip (now 1), and check the data and the --init weights",
    );
}

// ---- 3. a closed pipe ends the process quietly ----

/// Run megac with its stdout a pipe whose reader is closed at once: the process must end
/// as Unix tools do (exit 0, or killed by SIGPIPE), never with a panic.
fn quiet_on_closed_pipe(args: &[&str]) {
    use std::os::unix::process::ExitStatusExt;
    let mut child = Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    assert!(
        o.status.success() || o.status.signal() == Some(13),
        "{args:?}: {:?} {err}",
        o.status
    );
}

#[test]
fn a_closed_stdout_pipe_is_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan");
    compile_tiny(&plan, &["parallel.pp=2"]);
    let plan = s(&plan);
    for args in [
        &["simulate", plan][..],
        &["simulate", plan, "--format", "json"],
        &["inspect", plan],
        &["inspect", plan, "--json"],
        &["schedule", plan],
        &["schedule", "examples/llama3-70b.toml"],
        &["check-plan", plan],
        &["plan", "examples/llama3-8b.toml", "--gpus", "8"],
        &["dump", "examples/llama-tiny.toml"],
        &["check", "examples/llama-tiny.toml"],
        &["passes"],
    ] {
        quiet_on_closed_pipe(args);
    }
}

// ---- 4. small ones ----

#[test]
fn run_on_a_model_toml_suggests_train() {
    fails_fast(
        &["run", "examples/llama-tiny.toml", "--steps", "5"],
        "error: examples/llama-tiny.toml: is a file; `megac run` takes a plan directory (written by `megac compile`)\nhelp: to compile and train a model.toml in one go: megac train examples/llama-tiny.toml",
        10,
    );
}

#[test]
fn plan_top_zero_is_rejected() {
    fails_fast(
        &[
            "plan",
            "examples/llama3-8b.toml",
            "--gpus",
            "8",
            "--top",
            "0",
        ],
        "error: --top 0: show at least one layout (--top 1 shows the fastest)",
        10,
    );
}

#[test]
fn data_directory_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    fails_fast(
        &["train", "examples/llama-tiny.toml", "--data", s(dir.path())],
        &format!(
            "error: data {}: is a directory; expected `synthetic`, a `.bin` file (little-endian u32 token ids) or a `.txt` file (text, byte-level tokens)",
            s(dir.path())
        ),
        30,
    );
}

const COSINE: [&str; 8] = [
    "--set",
    "train.lr_schedule=\"cosine\"",
    "--set",
    "train.warmup_steps=10",
    "--set",
    "train.decay_steps=100",
    "--set",
    "train.min_lr=0.0001",
];

#[test]
fn check_shows_the_lr_schedule() {
    let o = megac(&["check", "examples/llama-tiny.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("\nlr schedule  constant 0.001\n"),
        "{}",
        stdout(&o)
    );
    let mut args = vec!["check", "examples/llama-tiny.toml"];
    args.extend(COSINE);
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("\nlr schedule  cosine: warmup from 0 to 0.001 over 10 steps, then decay to 0.0001 at step 100\n"),
        "{}",
        stdout(&o)
    );
    // train.steps (200) > decay_steps; fewer steps than the decay is said on the same line.
    args.extend(["--set", "train.steps=40"]);
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("\nlr schedule  cosine: warmup from 0 to 0.001 over 10 steps, then decay to 0.0001 at step 100; the run stops at step 40, before the lr schedule ends: it follows the warmup (10 steps) and the cosine decay down to lr 7.750e-4 at step 40, not the schedule's decay to 0.0001 at step 100\n"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn train_says_when_steps_cut_the_lr_schedule_short() {
    let mut args = vec!["train", "examples/llama-tiny.toml", "--steps", "3"];
    args.extend(COSINE);
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stderr(&o),
        "note: the run stops at step 3, inside the lr warmup (10 steps): the lr rises from 0 to 3.000e-4 and never decays (the schedule's decay to 0.0001 at step 100)\n"
    );
    // The whole schedule: no note.
    let mut args = vec!["train", "examples/llama-tiny.toml", "--steps", "1"];
    args.extend([
        "--set",
        "train.lr_schedule=\"cosine\"",
        "--set",
        "train.decay_steps=1",
    ]);
    let o = megac(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
}

#[test]
fn simulate_and_inspect_warn_when_the_plan_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan");
    compile_tiny(&plan, &[]);
    let cluster = dir.path().join("small.toml");
    std::fs::write(
        &cluster,
        "preset = \"h100-sxm\"\nname = \"small\"\n[device]\nmemory_gib = 0.0001\n",
    )
    .unwrap();
    for args in [
        vec!["simulate", s(&plan), "--cluster", s(&cluster)],
        vec![
            "simulate",
            s(&plan),
            "--cluster",
            s(&cluster),
            "--format",
            "json",
        ],
        vec!["inspect", s(&plan), "--cluster", s(&cluster)],
        vec!["inspect", s(&plan), "--cluster", s(&cluster), "--json"],
    ] {
        let o = megac(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.starts_with("warning: role rank needs ") && err.ends_with(&format!(" MiB of one NVIDIA H100 SXM5 80GB ({}): the plan does not fit its cluster's memory (`megac plan` finds layouts that do)\n", s(&cluster))),
            "{args:?}: {err}"
        );
    }
    // On the default cluster it fits: no warning.
    for args in [vec!["simulate", s(&plan)], vec!["inspect", s(&plan)]] {
        let o = megac(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o), "", "{args:?}");
    }
}
