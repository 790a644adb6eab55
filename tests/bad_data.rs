//! The bad-data corpus: every `tests/bad-data/NAME.args` is a `megac` command line (one
//! argument per line) that trains on broken data (a truncated Megatron index, a .bin shorter
//! than its index, a token id over the vocab, a malformed blend, a tokenizer larger than the
//! model's vocab, a .jsonl line without `text`, ...), and `NAME.stderr` is exactly what megac
//! must print. Each must fail before training: exit code 1, nothing on stdout, one `error:`
//! line naming the file. The data files are made by `tests/bad-data/make_files.py`.
//!
//! After an intended message change: `MEGAC_BLESS=1 cargo test --test bad_data`, then read
//! the diff of the `.stderr` files.

use std::path::PathBuf;
use std::process::Command;

const DIR: &str = "tests/bad-data";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bless() -> bool {
    std::env::var("MEGAC_BLESS").is_ok_and(|v| v == "1")
}

fn cases() -> Vec<(String, Vec<String>)> {
    let mut names: Vec<String> = std::fs::read_dir(root().join(DIR))
        .expect("tests/bad-data exists")
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "args"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let text = std::fs::read_to_string(root().join(DIR).join(format!("{name}.args")))
                .expect("readable .args");
            let args = text
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect();
            (name, args)
        })
        .collect()
}

#[test]
fn every_bad_data_case_is_one_clear_error_before_training() {
    let cases = cases();
    assert!(cases.len() >= 15, "found only {} cases", cases.len());
    let mut failures = Vec::new();
    for (name, args) in &cases {
        let out = Command::new(env!("CARGO_BIN_EXE_megac"))
            .current_dir(root())
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .output()
            .expect("megac runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let mut problems = Vec::new();
        if out.status.code() != Some(1) {
            problems.push(format!("exit code {:?}, expected 1", out.status.code()));
        }
        if stderr.contains("panicked") {
            problems.push("megac panicked".to_string());
        }
        if !stdout.is_empty() {
            problems.push(format!("stdout is not empty: {stdout:?}"));
        }
        let errors = stderr.lines().filter(|l| l.starts_with("error:")).count();
        if errors != 1 || !stderr.starts_with("error: ") {
            problems.push(format!("expected one `error:` line first, got {errors}"));
        }
        if stderr.contains("step 1") {
            problems.push("training started".to_string());
        }
        let expected = root().join(DIR).join(format!("{name}.stderr"));
        if bless() {
            std::fs::write(&expected, &stderr).expect("write .stderr");
        } else {
            match std::fs::read_to_string(&expected) {
                Ok(e) if e == stderr => {}
                Ok(e) => problems.push(format!(
                    "stderr differs:\n  expected {e:?}\n  actual   {stderr:?}"
                )),
                Err(_) => {
                    problems.push(format!("{} is missing (MEGAC_BLESS=1)", expected.display()))
                }
            }
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{name} ({}):\n  - {}",
                args.join(" "),
                problems.join("\n  - ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
