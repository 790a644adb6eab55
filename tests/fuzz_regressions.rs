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
