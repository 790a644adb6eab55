//! MegaScan end to end: `--inject` changes timing only (losses bit-identical), `--trace`
//! writes one record per rank, and `megac scan` names the injected slow rank or slow link
//! and nothing else, recovers injected clock offsets, merges a Perfetto trace, and rejects
//! bad trace folders with one error naming the file.
//!
//! The machine running the tests is shared and loaded, so injected faults are large (3–4×),
//! or, for the 1.1× rank, the run long enough for the sign test to see it through the noise,
//! and every assertion compares ranks with each other, never with absolute times.

use std::path::Path;
use std::process::{Command, Output};

/// The tests of this file run one at a time: each times ranks against each other, and four
/// runs of four rank threads at once on a small machine would mostly measure each other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run a timing test up to three times: it passes if an attempt passes. The machine is
/// shared (CI runs other builds beside it), and a test that times threads against each other
/// can lose one run to a scheduler hiccup; a real fault fails every attempt.
fn retry(test: fn()) {
    for attempt in 1..3 {
        if std::panic::catch_unwind(test).is_ok() {
            return;
        }
        eprintln!("attempt {attempt} failed; retrying (timing on a shared machine)");
    }
    test();
}

fn megac(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("megac runs")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Train llama-tiny with `sets`, `steps` steps, tracing into `dir`, with `inject`; returns
/// the report JSON.
fn train(dir: &Path, sets: &[&str], steps: u32, inject: &[&str]) -> serde_json::Value {
    let trace = dir.join("trace");
    let report = dir.join("report.json");
    let steps = steps.to_string();
    let mut args = vec![
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        &steps,
        "--trace",
        trace.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
    ];
    for s in sets {
        args.extend(["--set", s]);
    }
    for i in inject {
        args.extend(["--inject", i]);
    }
    ok(&megac(&args));
    serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap()
}

fn scan(dir: &Path) -> serde_json::Value {
    let out = ok(&megac(&[
        "scan",
        dir.join("trace").to_str().unwrap(),
        "--format",
        "json",
    ]));
    serde_json::from_str(&out).unwrap()
}

fn losses(report: &serde_json::Value) -> Vec<(u64, u64)> {
    report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["loss"].as_f64().unwrap().to_bits(),
                s["grad_norm"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

fn findings(v: &serde_json::Value) -> Vec<(String, Vec<u64>)> {
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap().to_string(),
                f["ranks"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| r.as_u64().unwrap())
                    .collect(),
            )
        })
        .collect()
}

const DP4: [&str; 2] = ["parallel.dp=4", "train.global_batch=16"];
const TP2DP2: [&str; 2] = ["parallel.tp=2", "parallel.dp=2"];

#[test]
fn injection_changes_timing_only_and_scan_names_the_slow_rank_and_nothing_else() {
    retry(attempt_injection_changes_timing_only_and_scan_names_the_slow_rank_and_nothing_else);
}

fn attempt_injection_changes_timing_only_and_scan_names_the_slow_rank_and_nothing_else() {
    let _serial = serial();
    let healthy = tempfile::tempdir().unwrap();
    let slow = tempfile::tempdir().unwrap();
    let a = train(healthy.path(), &DP4, 5, &[]);
    let b = train(
        slow.path(),
        &DP4,
        5,
        &["slow-rank:2:4", "jitter:0.1:3", "clock:1:50:200"],
    );
    // Bit-identical losses and gradient norms with and without injection.
    assert_eq!(losses(&a), losses(&b));
    // Every rank wrote its record.
    for r in 0..4 {
        assert!(slow.path().join(format!("trace/rank-{r}.json")).is_file());
    }
    let v = scan(slow.path());
    assert_eq!(
        (v["steps"].as_u64(), v["ranks"].as_u64()),
        (Some(5), Some(4))
    );
    assert_eq!(findings(&v), [("slow-rank".to_string(), vec![2])], "{v:#}");
    let f = &v["findings"][0];
    assert!(f["score"].as_f64().unwrap() >= 1.3, "{f}");
    assert!((2..=5).contains(&f["first_step"].as_u64().unwrap()), "{f}");
    // MegatronApp's heuristic, the baseline, finds a 4x straggler too.
    let baseline: Vec<u64> = v["baseline_megatronapp"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .collect();
    assert!(baseline.contains(&2), "{baseline:?}");
    // The SVG timeline names the slow rank in red, and only it.
    let svg = slow.path().join("timeline.svg");
    ok(&megac(&[
        "scan",
        slow.path().join("trace").to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("fill=\"#c00\">rank ").count(), 1);
    assert!(svg.contains("fill=\"#c00\">rank 2 ("));
    // The healthy run: nothing found.
    let v = scan(healthy.path());
    assert_eq!(findings(&v), [], "{v:#}");
}

#[test]
fn scan_recovers_injected_clock_offsets_and_merges_a_trace() {
    retry(attempt_scan_recovers_injected_clock_offsets_and_merges_a_trace);
}

fn attempt_scan_recovers_injected_clock_offsets_and_merges_a_trace() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let truth = [(1usize, 50.0f64, 200.0f64), (3, -50.0, -200.0)];
    train(
        dir.path(),
        &TP2DP2,
        4,
        &["clock:1:50:200", "clock:3:-50:-200"],
    );
    let v = scan(dir.path());
    let offsets = v["clock"]["offsets_us"].as_array().unwrap();
    let drifts = v["clock"]["drift_ppm"].as_array().unwrap();
    let drift_bounds = v["clock"]["drift_bound_ppm"].as_array().unwrap();
    // Every rank plays ping-pong with rank 0 before the first step and after the last: the
    // offset at the run's start is within a few µs (the sync's turnaround; 100 µs leaves room
    // for the extrapolation to the process's time zero), the drift within tens of ppm (a few
    // µs over a run of a few hundred ms).
    for r in 0..4 {
        let (o, d) = truth
            .iter()
            .find(|t| t.0 == r)
            .map_or((0.0, 0.0), |t| (t.1 * 1e3, t.2));
        let (eo, ed) = (offsets[r].as_f64().unwrap(), drifts[r].as_f64().unwrap());
        // On a loaded machine the best round trip can be long: the drift's tolerance is then
        // the bound the scan itself derives from the turnarounds (plus rounding), never less
        // than 100 ppm, never more than 2000.
        let bound = drift_bounds[r].as_f64().unwrap_or(0.0);
        assert!(
            r == 0 || (0.0..2000.0).contains(&bound),
            "rank {r}: drift bound {bound} ppm"
        );
        let (max_o, max_d) = (100.0, f64::max(100.0, bound + 1.0));
        assert!(
            (eo - o).abs() < max_o,
            "rank {r}: offset {eo} us, injected {o} us"
        );
        assert!(
            (ed - d).abs() < max_d,
            "rank {r}: drift {ed} ppm, injected {d}"
        );
    }
    // The merged trace: a named process per rank, flows, every timestamp finite.
    let merged = dir.path().join("merged.json");
    ok(&megac(&[
        "scan",
        dir.path().join("trace").to_str().unwrap(),
        "-o",
        merged.to_str().unwrap(),
    ]));
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&merged).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let names: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "rank 0 (tp0 dp0 pp0)",
            "rank 1 (tp1 dp0 pp0)",
            "rank 2 (tp0 dp1 pp0)",
            "rank 3 (tp1 dp1 pp0)"
        ]
    );
    assert!(events.iter().any(|e| e["ph"] == "s") && events.iter().any(|e| e["ph"] == "f"));
    let xs: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(xs.iter().all(|e| e["ts"].as_f64().unwrap() >= 0.0));
    // After alignment, the members of each collective leave it together, not 50 ms apart:
    // the median spread of their exits is under 2 ms.
    let mut exits: std::collections::BTreeMap<(String, u64), Vec<f64>> = Default::default();
    for e in xs.iter().filter(|e| e["cat"] == "coll") {
        let key = (
            e["name"].as_str().unwrap().to_string(),
            e["args"]["seq"].as_u64().unwrap(),
        );
        exits
            .entry(key)
            .or_default()
            .push(e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap());
    }
    let mut spreads: Vec<f64> = exits
        .values()
        .filter(|v| v.len() > 1)
        .map(|v| {
            v.iter().cloned().fold(f64::MIN, f64::max) - v.iter().cloned().fold(f64::MAX, f64::min)
        })
        .collect();
    spreads.sort_by(f64::total_cmp);
    assert!(!spreads.is_empty());
    assert!(spreads[spreads.len() / 2] < 2_000.0, "{spreads:?}");
}

#[test]
fn a_slow_link_between_pipeline_ranks_is_a_link_and_a_slow_rank_is_a_rank() {
    retry(attempt_a_slow_link_between_pipeline_ranks_is_a_link_and_a_slow_rank_is_a_rank);
}

fn attempt_a_slow_link_between_pipeline_ranks_is_a_link_and_a_slow_rank_is_a_rank() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    // pp2 × dp2: ranks 0 and 2 are one pipeline (dp0), 1 and 3 the other.
    let sets = ["parallel.pp=2", "parallel.dp=2"];
    let check = megac(&[
        "check",
        "examples/llama-tiny.toml",
        "--set",
        sets[0],
        "--set",
        sets[1],
    ]);
    ok(&check);
    train(dir.path(), &sets, 6, &["slow-link:0-2:4"]);
    let v = scan(dir.path());
    let f = findings(&v);
    // Which pair is the dp0 pipeline depends on the rank order: find it in the rank files.
    let pp = |r: usize| -> u64 {
        let t: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(format!("trace/rank-{r}.json"))).unwrap(),
        )
        .unwrap();
        t["coords"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c[0] == "pp")
            .unwrap()[1]
            .as_u64()
            .unwrap()
    };
    assert_ne!(
        pp(0),
        pp(2),
        "ranks 0 and 2 must be different pipeline stages"
    );
    assert_eq!(f, [("slow-link".to_string(), vec![0, 2])], "{v:#}");
    // A slow rank on the same layout is a rank, not its links.
    let rank = tempfile::tempdir().unwrap();
    train(rank.path(), &sets, 6, &["slow-rank:0:4"]);
    let v = scan(rank.path());
    assert_eq!(findings(&v), [("slow-rank".to_string(), vec![0])], "{v:#}");
}

/// A 1.1× slow rank is found, and only it; the healthy run of the same layout names nothing.
/// dp2 for 40 steps: on a machine of two or more cores the two rank threads take turns on
/// two of them and the block test judges 19 blocks of 2 steps; on one core (no rotation)
/// the per-segment sign test has 156 segments.
#[test]
fn a_slightly_slow_rank_is_found_and_a_healthy_run_reports_nothing() {
    retry(attempt_a_slightly_slow_rank_is_found_and_a_healthy_run_reports_nothing);
}

fn attempt_a_slightly_slow_rank_is_found_and_a_healthy_run_reports_nothing() {
    let _serial = serial();
    let sets = ["parallel.dp=2"];
    let slow = tempfile::tempdir().unwrap();
    train(
        slow.path(),
        &sets,
        40,
        &["slow-rank:1:1.1", "jitter:0.05:7"],
    );
    let v = scan(slow.path());
    assert_eq!(findings(&v), [("slow-rank".to_string(), vec![1])], "{v:#}");
    let score = v["findings"][0]["score"].as_f64().unwrap();
    assert!(score >= 1.05, "{v:#}");
    // The peer's median segment is faster than the slow rank's, not slower.
    let peer = v["per_rank"][0]["compute_ratio"].as_f64().unwrap();
    assert!(peer < 1.0, "{v:#}");
    let healthy = tempfile::tempdir().unwrap();
    train(healthy.path(), &sets, 40, &["jitter:0.05:7"]);
    let v = scan(healthy.path());
    assert_eq!(findings(&v), [], "{v:#}");
}

#[test]
fn bad_inject_specs_and_trace_folders_are_one_clear_error() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "1",
        "--inject",
        "slow-rank:two:2",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "error: --inject slow-rank:two:2: `two` is not a rank (a number from 0)\n"
    );
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--steps",
        "1",
        "--inject",
        "slow-rank:3:2",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("rank 3 is outside the plan's 1 ranks"),
        "{}",
        stderr(&o)
    );
    // An empty folder, a broken file, a missing rank.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let o = megac(&["scan", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no rank-N.json files"),
        "{}",
        stderr(&o)
    );
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(broken.join("rank-0.json"), "{\"format\": ").unwrap();
    let out = dir.path().join("merged.json");
    let o = megac(&[
        "scan",
        broken.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.starts_with(&format!(
            "error: {}: not a megac rank file",
            broken.join("rank-0.json").display()
        )),
        "{e}"
    );
    assert!(!out.exists(), "no merged trace after an error");
    let dp2 = dir.path().join("dp2");
    train(&dp2, &["parallel.dp=2", "train.global_batch=16"], 1, &[]);
    std::fs::remove_file(dp2.join("trace/rank-1.json")).unwrap();
    let o = megac(&["scan", dp2.join("trace").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("rank-1.json is missing"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("panicked"));
}

/// Train llama-tiny tp2 x dp2 for 20 steps with `extra` options; (losses, stderr).
fn train_online(dir: &Path, extra: &[&str]) -> (Vec<(u64, u64)>, String) {
    let report = dir.join("report.json");
    let mut args = vec![
        "train",
        "examples/llama-tiny.toml",
        "--set",
        TP2DP2[0],
        "--set",
        TP2DP2[1],
        "--steps",
        "20",
        "--report",
        report.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = megac(&args);
    ok(&o);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    (losses(&v), stderr(&o))
}

/// `--scan`: a 1.5× slow rank is named on one warning line (the rank, the step, the score)
/// within 10 steps; a healthy run prints no warning; losses are bit-identical with and
/// without `--scan`.
#[test]
fn scan_during_training_warns_of_a_slow_rank_within_ten_steps() {
    retry(attempt_scan_during_training_warns_of_a_slow_rank_within_ten_steps);
}

fn attempt_scan_during_training_warns_of_a_slow_rank_within_ten_steps() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (plain, _) = train_online(dir.path(), &[]);
    let (healthy, err) = train_online(dir.path(), &["--scan"]);
    assert_eq!(plain, healthy, "--scan changes no number");
    assert!(!err.contains("warning: --scan"), "a healthy run: {err}");
    let (slow, err) = train_online(dir.path(), &["--scan", "--inject", "slow-rank:2:1.5"]);
    assert_eq!(plain, slow, "injection changes no number");
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("warning: --scan: "))
        .collect();
    assert!(!warnings.is_empty(), "no warning: {err}");
    let first = warnings[0];
    assert!(
        first.contains("slow-rank rank 2 (tp0 dp1 pp0): score "),
        "{err}"
    );
    let step: u64 = first["warning: --scan: step ".len()..]
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(step <= 10, "named at step {step}: {err}");
    // Nothing else is named.
    assert!(
        warnings.iter().all(|w| w.contains("slow-rank rank 2 (")),
        "{err}"
    );
}

/// The `--scan` warning lines of `err`, and the step of the first.
fn scan_warnings(err: &str) -> (Vec<&str>, u64) {
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("warning: --scan: "))
        .collect();
    assert!(!warnings.is_empty(), "no warning: {err}");
    let step: u64 = warnings[0]["warning: --scan: step ".len()..]
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (warnings, step)
}

/// `--scan` on pp2 × dp2 with a 4× slow link between the two stages of one pipeline: the
/// warning names the link (both ranks), within 10 steps, and no rank.
#[test]
fn scan_during_training_warns_of_a_slow_link_as_a_link() {
    retry(attempt_scan_during_training_warns_of_a_slow_link_as_a_link);
}

fn attempt_scan_during_training_warns_of_a_slow_link_as_a_link() {
    let _serial = serial();
    let o = megac(&[
        "train",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.dp=2",
        "--steps",
        "12",
        "--scan",
        "--inject",
        "slow-link:0-2:4",
    ]);
    ok(&o);
    let err = stderr(&o);
    let (warnings, step) = scan_warnings(&err);
    assert!(
        warnings[0].contains("slow-link rank 0 (") && warnings[0].contains(" <-> rank 2 ("),
        "{err}"
    );
    assert!(step <= 10, "named at step {step}: {err}");
    assert!(
        warnings.iter().all(|w| !w.contains("slow-rank")),
        "no rank is named: {err}"
    );
}

/// Two faults at once, both found by `megac scan` and nothing else: two slow ranks in
/// different tp and dp groups (tp2 × dp2, ranks 0 and 3), and a slow rank beside a slow link
/// (pp2 × dp2: rank 1, link 0–2). 17 steps, as bench/scan_detect.py runs: with 8, a healthy
/// rank of the pp2 × dp2 run read 1.064 against its peer in three attempts in a row on a
/// host whose speed swung, and was named.
#[test]
fn scan_finds_two_simultaneous_faults() {
    retry(attempt_scan_finds_two_simultaneous_faults);
}

fn attempt_scan_finds_two_simultaneous_faults() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), &TP2DP2, 17, &["slow-rank:0:2", "slow-rank:3:2"]);
    let v = scan(dir.path());
    let mut f = findings(&v);
    f.sort();
    assert_eq!(
        f,
        [
            ("slow-rank".to_string(), vec![0]),
            ("slow-rank".to_string(), vec![3])
        ],
        "{v:#}"
    );
    let dir = tempfile::tempdir().unwrap();
    let pp2dp2 = ["parallel.pp=2", "parallel.dp=2"];
    train(
        dir.path(),
        &pp2dp2,
        17,
        &["slow-rank:1:2", "slow-link:0-2:4"],
    );
    let v = scan(dir.path());
    let mut f = findings(&v);
    f.sort();
    assert_eq!(
        f,
        [
            ("slow-link".to_string(), vec![0, 2]),
            ("slow-rank".to_string(), vec![1])
        ],
        "{v:#}"
    );
}
