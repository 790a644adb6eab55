//! A seeded, field-level mutator of plan JSON and the harness that runs mutated plans:
//! shared by `tests/plan_mutations.rs` (a few hundred mutations) and `bench/mutate.sh`
//! (10,000, through the ignored test `mutation_bench`).
//!
//! Each mutation changes one thing of a compiled plan's JSON value: a number (an index, a
//! size, an offset, a count) set to a neighbour, zero, a power of two, a large value or
//! another buffer's index; a buffer's shape (a dim changed, dropped or added); an
//! instruction deleted, duplicated or moved, or a program truncated; two fields swapped
//! (an instruction's inputs and outputs, two operands, two buffers' offsets or shapes, two
//! results or inputs); or a field deleted. The outcome of a mutated plan is either
//! rejection by the gate (one clear error), or a 2-step run on local threads that ends
//! with a positive, finite loss. Anything else is a failure: a panic (caught by the panic
//! hook, on any thread), a runtime error after the gate passed, a hang (timeout) or a
//! zero or non-finite loss.

#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// The fuzzer's SplitMix64 generator (`megac_fuzz::mutate::Rng`): one generator for both.
/// Every `below(n)` here has `n > 0` (`programs` lists non-empty programs only; a plan has
/// buffers and roles), so mutation `s` is the same sequence as with the copy this replaced.
pub use megac_fuzz::mutate::Rng;

/// JSON pointers of every leaf number under `v`.
fn numbers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Number(n) if n.is_u64() => out.push(at),
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                numbers(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                numbers(
                    x,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        _ => {}
    }
}

/// JSON pointers of every instruction list (programs) of the plan.
fn programs(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for (r, role) in v["roles"].as_array().into_iter().flatten().enumerate() {
        for p in ["microbatch", "optimizer"] {
            if role[p].as_array().is_some_and(|a| !a.is_empty()) {
                out.push(format!("/roles/{r}/{p}"));
            }
        }
        for (c, chunk) in role["pipeline"]["chunks"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            for p in ["forward", "backward", "weight"] {
                if chunk[p].as_array().is_some_and(|a| !a.is_empty()) {
                    out.push(format!("/roles/{r}/pipeline/chunks/{c}/{p}"));
                }
            }
        }
    }
    out
}

/// Apply one random mutation to `plan`; returns what it did.
pub fn mutate(plan: &mut Value, rng: &mut Rng) -> String {
    let buffers = plan["buffers"].as_array().map_or(0, |a| a.len());
    match rng.below(10) {
        // A number: indices, sizes, offsets, counts, ids.
        0..=3 => {
            let mut all = Vec::new();
            numbers(plan, String::new(), &mut all);
            let at = all[rng.below(all.len())].clone();
            let old = plan.pointer(&at).and_then(Value::as_u64).unwrap_or(0);
            let new: u64 = match rng.below(9) {
                0 => 0,
                1 => old + 1,
                2 => old.saturating_sub(1),
                3 => old.saturating_mul(2),
                4 => old / 2,
                5 => rng.below(buffers.max(1)) as u64,
                6 => 1u64 << (rng.below(40) + 8),
                7 => u64::from(u32::MAX),
                _ => 1,
            };
            *plan.pointer_mut(&at).unwrap() = new.into();
            format!("{at}: {old} -> {new}")
        }
        // A buffer's shape.
        4 => {
            let b = rng.below(buffers);
            let shape = plan["buffers"][b]["shape"].as_array_mut().unwrap();
            let what = match (rng.below(3), shape.len()) {
                (0, n) if n > 0 => {
                    let d = rng.below(n);
                    let old = shape[d].as_u64().unwrap_or(0);
                    let new =
                        [0, 1, old + 1, old.saturating_sub(1), old * 2, old / 2][rng.below(6)];
                    shape[d] = new.into();
                    format!("dim {d}: {old} -> {new}")
                }
                (1, n) if n > 0 => {
                    shape.remove(rng.below(n));
                    "dim dropped".to_string()
                }
                _ => {
                    shape.insert(rng.below(shape.len() + 1), 2.into());
                    "dim of 2 added".to_string()
                }
            };
            format!("/buffers/{b}/shape: {what}")
        }
        // Instructions: deleted, duplicated, moved, a program truncated.
        5 | 6 => {
            let progs = programs(plan);
            if progs.is_empty() {
                return "no program".into();
            }
            let at = progs[rng.below(progs.len())].clone();
            let list = plan.pointer_mut(&at).unwrap().as_array_mut().unwrap();
            let n = list.len();
            let i = rng.below(n);
            match rng.below(4) {
                0 => {
                    list.remove(i);
                    format!("{at}: instruction {i} deleted")
                }
                1 => {
                    let copy = list[i].clone();
                    let j = rng.below(n + 1);
                    list.insert(j, copy);
                    format!("{at}: instruction {i} duplicated at {j}")
                }
                2 => {
                    let x = list.remove(i);
                    let j = rng.below(n);
                    list.insert(j, x);
                    format!("{at}: instruction {i} moved to {j}")
                }
                _ => {
                    list.truncate(i);
                    format!("{at}: truncated to {i} instructions")
                }
            }
        }
        // Swapped fields.
        7 | 8 => match rng.below(4) {
            0 | 1 => {
                let progs = programs(plan);
                if progs.is_empty() {
                    return "no program".into();
                }
                let at = progs[rng.below(progs.len())].clone();
                let list = plan.pointer_mut(&at).unwrap().as_array_mut().unwrap();
                let i = rng.below(list.len());
                let instr = list[i].as_object_mut().unwrap();
                let ins = instr.get("in").cloned().unwrap_or(Value::Array(Vec::new()));
                if rng.below(2) == 0 || ins.as_array().is_none_or(|a| a.len() < 2) {
                    let outs = instr
                        .get("out")
                        .cloned()
                        .unwrap_or(Value::Array(Vec::new()));
                    instr.insert("in".into(), outs);
                    instr.insert("out".into(), ins);
                    format!("{at}/{i}: in and out swapped")
                } else {
                    let a = instr.get_mut("in").unwrap().as_array_mut().unwrap();
                    let (x, y) = (rng.below(a.len()), rng.below(a.len()));
                    a.swap(x, y);
                    format!("{at}/{i}: operands {x} and {y} swapped")
                }
            }
            2 => {
                let (x, y) = (rng.below(buffers), rng.below(buffers));
                let field = ["offset", "shape", "class", "dtype"][rng.below(4)];
                let a = plan["buffers"][x][field].clone();
                let b = std::mem::replace(&mut plan["buffers"][y][field], a);
                plan["buffers"][x][field] = b;
                format!("/buffers: {field} of {x} and {y} swapped")
            }
            _ => {
                let roles = plan["roles"].as_array().map_or(0, |a| a.len());
                let r = rng.below(roles);
                let map = ["results", "inputs"][rng.below(2)];
                let keys: Vec<String> = plan["roles"][r][map]
                    .as_object()
                    .map(|o| o.keys().cloned().collect())
                    .unwrap_or_default();
                if keys.len() < 2 {
                    return format!("/roles/{r}/{map}: fewer than 2 entries");
                }
                let (a, b) = (&keys[0], &keys[1]);
                let va = plan["roles"][r][map][a].clone();
                let vb = std::mem::replace(&mut plan["roles"][r][map][b], va);
                plan["roles"][r][map][a] = vb;
                format!("/roles/{r}/{map}: {a} and {b} swapped")
            }
        },
        // A field deleted.
        _ => {
            let mut all = Vec::new();
            numbers(plan, String::new(), &mut all);
            let at = all[rng.below(all.len())].clone();
            let (parent, key) = at.rsplit_once('/').unwrap();
            match plan.pointer_mut(parent) {
                Some(Value::Object(o)) => {
                    o.remove(key);
                }
                Some(Value::Array(a)) => {
                    if let Ok(i) = key.parse::<usize>() {
                        a.remove(i);
                    }
                }
                _ => {}
            }
            format!("{at}: deleted")
        }
    }
}

/// What happened to one mutated plan.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// The gate rejected it with this error.
    Rejected(String),
    /// It trained 2 steps with positive, finite losses.
    RanOk,
    /// Anything else: a panic, a runtime error after the gate, a hang, a bad loss.
    Failure(String),
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Count every panic on any thread (rank threads included), quietly.
pub fn install_panic_counter() {
    std::panic::set_hook(Box::new(|info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        eprintln!("panic: {info}");
    }));
}

/// Run a mutated plan (JSON text) through the gate and, if it passes, 2 training steps on
/// local threads, within `timeout`.
pub fn outcome(text: String, timeout: Duration) -> Outcome {
    let before = PANICS.load(Ordering::SeqCst);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let result = std::panic::catch_unwind(|| run(&text));
        let _ = tx.send(result);
    });
    let result = match rx.recv_timeout(timeout) {
        Ok(Ok(o)) => o,
        Ok(Err(_)) => Outcome::Failure("panic".into()),
        Err(_) => return Outcome::Failure(format!("hang: no result within {timeout:?}")),
    };
    if PANICS.load(Ordering::SeqCst) != before {
        return Outcome::Failure(format!("a thread panicked ({result:?})"));
    }
    result
}

fn run(text: &str) -> Outcome {
    let plan = match megac_ir::plan::Plan::from_json(text) {
        Ok(p) => p,
        Err(e) => {
            let msg = e.to_string();
            if msg.is_empty() || msg.contains('\n') {
                return Outcome::Failure(format!("unclear gate error: {msg:?}"));
            }
            return Outcome::Rejected(msg);
        }
    };
    let opts = megac_runtime::train::RunOptions {
        steps: Some(2),
        data: "synthetic".into(),
        progress: Some(false),
        ..Default::default()
    };
    match megac_runtime::train::train(&plan, &opts) {
        Ok(report) => {
            // fp16's loss scaler skips a step whose gradients overflow (its norm is then not
            // finite, and the report says so); every other norm must be finite.
            let bad = report.steps.iter().find(|s| {
                !(s.loss.is_finite() && s.loss > 0.0 && (s.grad_norm.is_finite() || s.skipped))
            });
            match bad {
                Some(s) => Outcome::Failure(format!(
                    "step {} reports loss {} and grad norm {}",
                    s.step, s.loss, s.grad_norm
                )),
                None if report.steps.len() != 2 => {
                    Outcome::Failure(format!("{} steps instead of 2", report.steps.len()))
                }
                None => Outcome::RanOk,
            }
        }
        // A mutation that rewires fp16 arithmetic (a valid plan computing something else) may
        // overflow fp16's range: the run guard's clear stop is then the right outcome.
        Err(megac_runtime::error::RuntimeError::NonFinite(_)) if plan.train.precision == "fp16" => {
            Outcome::RanOk
        }
        Err(e) => Outcome::Failure(format!("runtime error after the gate: {e}")),
    }
}

/// The layouts mutated: tp+sp, pp with zb-h1 and dpp, fbd, ep, cp, the distributed
/// optimizer, bf16 (16-bit buffers, master shards) and fp16 interleaved (pooled slots);
/// small models so that a run takes milliseconds.
pub const LAYOUTS: &[(&str, &[&str])] = &[
    (
        "llama-tiny.toml",
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=4", "parallel.pp=2", "parallel.schedule=zb-h1"],
    ),
    (
        "llama-tiny.toml",
        &[
            "model.layers=4",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=dpp",
        ],
    ),
    (
        "llama-tiny.toml",
        &["model.layers=4", "parallel.pp=2", "parallel.fbd=true"],
    ),
    ("moe-tiny.toml", &["parallel.dp=2", "parallel.ep=2"]),
    ("llama-tiny.toml", &["parallel.cp=2"]),
    (
        "llama-tiny.toml",
        &["parallel.dp=2", "parallel.distributed_optimizer=true"],
    ),
    (
        "llama-tiny.toml",
        &[
            "train.precision=\"bf16\"",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.dp=2",
            "parallel.distributed_optimizer=true",
        ],
    ),
    (
        "llama-tiny.toml",
        &[
            "train.precision=\"fp16\"",
            "model.layers=8",
            "parallel.pp=2",
            "parallel.vpp=4",
            "parallel.schedule=interleaved",
        ],
    ),
];

/// Compile `file` with `sets` (plus a small batch and sequence) to plan JSON.
pub fn compiled(file: &str, sets: &[&str]) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let mut all: Vec<String> = [
        "train.micro_batch=2",
        "train.global_batch=8",
        "model.seq_len=16",
    ]
    .iter()
    .chain(sets)
    .map(|s| s.to_string())
    .collect();
    all.dedup();
    let spec = megac_frontend::load(&path, &all).unwrap_or_else(|e| panic!("{}", e.render()));
    let flops = megac_passes::flops::step_flops(&spec).total;
    let module = megac_passes::run_pipeline(spec, None, true).unwrap();
    let plan = megac_codegen::emit_plan(&module.spec, module.graph.as_ref().unwrap(), flops)
        .unwrap_or_else(|e| panic!("{file} {sets:?}: {e}"));
    serde_json::from_str(&plan.to_json()).unwrap()
}

/// Tally of a mutation run.
#[derive(Debug, Default)]
pub struct Tally {
    /// Mutations tried.
    pub tried: usize,
    /// Rejected by the gate.
    pub rejected: usize,
    /// Trained to the end with a positive, finite loss.
    pub ran_ok: usize,
    /// Failures: (seed, layout, mutation, what happened).
    pub failures: Vec<(u64, String, String, String)>,
}

/// Run mutations `seed..seed + n` over [`LAYOUTS`] (mutation s on layout s mod their
/// number), `timeout` per run.
pub fn run_mutations(seed: u64, n: usize, timeout: Duration) -> Tally {
    install_panic_counter();
    let bases: Vec<(String, Value)> = LAYOUTS
        .iter()
        .map(|(f, s)| (format!("{f} {s:?}"), compiled(f, s)))
        .collect();
    let mut tally = Tally::default();
    for i in 0..n {
        let s = seed.wrapping_add(i as u64);
        let mut rng = Rng::new(s);
        // The seed alone picks the layout and the mutation: `MEGAC_MUTATIONS=1
        // MEGAC_SEED=s` reproduces mutation s.
        let (name, base) = &bases[(s % bases.len() as u64) as usize];
        let mut plan = base.clone();
        let what = mutate(&mut plan, &mut rng);
        tally.tried += 1;
        match outcome(plan.to_string(), timeout) {
            Outcome::Rejected(e) => {
                if std::env::var_os("MEGAC_SHOW_REJECTIONS").is_some() {
                    println!("rejected: {name}: {what}: {e}");
                }
                tally.rejected += 1
            }
            Outcome::RanOk => tally.ran_ok += 1,
            Outcome::Failure(f) => {
                eprintln!("FAILURE seed {s} {name}: {what}: {f}");
                let hang = f.starts_with("hang");
                tally.failures.push((s, name.clone(), what, f));
                if hang {
                    // A hung run keeps its thread; stop rather than pile them up.
                    break;
                }
            }
        }
    }
    tally
}
