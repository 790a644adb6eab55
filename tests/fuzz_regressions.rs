//! The fuzz targets (megac-fuzz) in the test suite: every input in the regression corpus
//! `tests/fuzz-corpus/<target>/` (inputs that once crashed a reader) is read without a panic,
//! and a few thousand generated inputs per target are too. The million-input runs are
//! `bench/fuzz.sh`.

use std::path::Path;
use std::process::Command;

use megac_fuzz::{Corpus, Outcome, Target, Verdict};

// As in the fuzzer: an allocation of more than 1 GiB fails, so a size read from a header
// that reaches an infallible allocation aborts this test instead of passing by overcommit.
#[global_allocator]
static ALLOC: megac_fuzz::CappedAlloc = megac_fuzz::CappedAlloc;

#[test]
fn regression_corpus_is_read_without_a_panic() {
    megac_fuzz::install_quiet_panic_hook();
    let mut failures = Vec::new();
    let mut cases = 0;
    for target in Target::ALL {
        let dir = megac_fuzz::seeds::regression_dir(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files {
            let bytes = std::fs::read(&f).unwrap();
            cases += 1;
            match megac_fuzz::run_one(target, &bytes) {
                Verdict::Clean(Outcome::Rejected(m)) => assert!(!m.is_empty()),
                Verdict::Clean(Outcome::Accepted) => {}
                Verdict::Panic(m) => failures.push(format!("{}: {m}", f.display())),
            }
        }
    }
    assert!(
        cases > 0,
        "the regression corpus tests/fuzz-corpus is empty"
    );
    assert!(
        failures.is_empty(),
        "readers panicked:\n{}",
        failures.join("\n")
    );
}

/// Compile the fuzzer's tiny model into `dir` (the plan target's seed).
fn tiny_plan(dir: &Path) {
    let model = dir.join("tiny.toml");
    std::fs::write(&model, megac_fuzz::seeds::TINY_MODEL).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_megac"))
        .arg("compile")
        .arg(&model)
        .arg("-o")
        .arg(dir.join("plan"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn generated_inputs_never_crash_a_reader() {
    megac_fuzz::install_quiet_panic_hook();
    let tmp = tempfile::tempdir().unwrap();
    tiny_plan(tmp.path());
    let plan_dir = tmp.path().join("plan");
    let mut report = Vec::new();
    for target in Target::ALL {
        let corpus = Corpus::new(target, &[plan_dir.as_path()]);
        let n = if target == Target::Plan { 1_000 } else { 3_000 };
        let mut crashes = Vec::new();
        let stats = megac_fuzz::fuzz_range(&corpus, 0x5eed, 0..n, |i, _, m| {
            crashes.push(format!("{} input {i}: {m}", target.name()))
        });
        assert!(crashes.is_empty(), "crashes:\n{}", crashes.join("\n"));
        // The generator must reach both sides of every reader, or the test proves little.
        assert!(
            stats.accepted > 0 && stats.rejected > 0,
            "{}: {stats:?}",
            target.name()
        );
        report.push(format!("{}: {stats:?}", target.name()));
    }
    eprintln!("{}", report.join("\n"));
}

/// A sparse file of `len` bytes (no disk used) at `dir/name`.
fn sparse(dir: &Path, name: &str, len: u64) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().set_len(len).unwrap();
    path
}

#[test]
fn files_too_big_are_errors_not_aborts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let huge = 8u64 << 30; // past the 1 GiB allocation cap of this test binary

    let model = sparse(dir, "model.toml", megac_ir::file::MAX_CONFIG_BYTES + 1);
    let e = megac_frontend::load(&model, &[]).unwrap_err().render();
    assert!(e.contains("more than the 16777216 bytes"), "{e}");

    let cluster = sparse(dir, "cluster.toml", huge);
    let e = megac_sim::cluster::Cluster::load(cluster.to_str().unwrap()).unwrap_err();
    assert!(e.to_string().contains("more than the"), "{e}");

    let plan = sparse(dir, "plan.json", huge);
    let e = megac_ir::file::read_text(&plan, u64::MAX).unwrap_err();
    assert!(e.to_string().contains("more than fits in memory"), "{e}");

    let bin = sparse(dir, "tokens.bin", huge);
    let e = megac_runtime::data::DataSource::open(bin.to_str().unwrap(), 4, 300, 0).unwrap_err();
    assert!(e.to_string().contains("not enough memory"), "{e}");

    let txt = sparse(dir, "tokens.txt", huge);
    let e = megac_runtime::data::DataSource::open(txt.to_str().unwrap(), 4, 300, 0).unwrap_err();
    assert!(e.to_string().contains("not enough memory"), "{e}");

    let st = sparse(dir, "init.safetensors", huge);
    let e = megac_runtime::hf::load_params(&st, &[], false).unwrap_err();
    assert!(e.to_string().contains("more than fits in memory"), "{e}");
}

#[test]
fn a_plan_mesh_that_no_rank_table_can_match_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_plan(tmp.path());
    let text = std::fs::read_to_string(tmp.path().join("plan/plan.json")).unwrap();
    let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(megac_fuzz::load_plan(&text).is_ok());
    let axes = |axes: serde_json::Value| {
        let mut p = plan.clone();
        p["mesh"]["axes"] = axes;
        megac_fuzz::load_plan(&p.to_string()).unwrap_err()
    };
    let cases = [
        (
            serde_json::json!([["tp", 1], ["pp", u64::MAX - 7], ["dp", 16]]),
            "the world size (tp·cp·dp·pp) overflows",
        ),
        (serde_json::json!([["tp", 0]]), "axis tp has size 0"),
        (
            serde_json::json!([["tp", 1], ["tp", 1]]),
            "axis tp is listed twice",
        ),
        (serde_json::json!([["edp", 1]]), "edp is derived"),
        (
            serde_json::json!([["dp", 2], ["ep", 3]]),
            "ep = 3 does not divide dp·cp = 2",
        ),
    ];
    for (mesh, want) in cases {
        let e = axes(mesh.clone());
        assert!(e.contains(want), "{mesh}: {e}");
    }
}
