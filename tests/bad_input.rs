//! The bad-input corpus: every `tests/bad-input/NAME.toml` is a small model with one
//! problem, and `NAME.stderr` is exactly what `megac check` must print for it. When
//! `NAME.args` exists, its lines (one argument per line, e.g. `--set` then `parallel.tp=3`)
//! are appended to the command line.
//!
//! For each case the CLI runs as a separate process, so a panic shows up as exit code 101
//! and a backtrace hint instead of taking the test harness down. Each case must exit with
//! code 1, print nothing on stdout, and print exactly one rendered error on stderr.
//!
//! To regenerate the expected output after an intended message change, run
//! `MEGAC_BLESS=1 cargo test --test bad_input` and read the diff of the `.stderr` files.

use std::path::{Path, PathBuf};
use std::process::Command;

const DIR: &str = "tests/bad-input";

/// One corpus entry: its name, the `.toml` path relative to the package root, and the
/// extra command-line arguments from `NAME.args`.
struct Case {
    name: String,
    toml: String,
    args: Vec<String>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cases() -> Vec<Case> {
    let mut names: Vec<String> = std::fs::read_dir(root().join(DIR))
        .expect("tests/bad-input exists")
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let args = std::fs::read_to_string(root().join(DIR).join(format!("{name}.args")))
                .map(|text| {
                    text.lines()
                        .filter(|l| !l.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            Case {
                toml: format!("{DIR}/{name}.toml"),
                name,
                args,
            }
        })
        .collect()
}

/// Exit code, stdout and stderr of `megac check PATH ARGS...`, run from the package root.
fn run(case: &Case) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_megac"))
        .current_dir(root())
        .arg("check")
        .arg(&case.toml)
        .args(&case.args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("megac runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn bless() -> bool {
    std::env::var("MEGAC_BLESS").is_ok_and(|v| v == "1")
}

/// The first line of a unified-ish diff: where expected and actual part ways.
fn first_difference(expected: &str, actual: &str) -> String {
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    for i in 0..e.len().max(a.len()) {
        let (x, y) = (e.get(i), a.get(i));
        if x != y {
            return format!(
                "first difference at stderr line {}:\n  expected: {:?}\n  actual:   {:?}",
                i + 1,
                x.copied().unwrap_or("<none>"),
                y.copied().unwrap_or("<none>")
            );
        }
    }
    "the texts differ only in their trailing newline".to_string()
}

#[test]
fn every_bad_input_is_one_clear_error() {
    let cases = cases();
    assert!(
        cases.len() >= 50,
        "the corpus should have at least 50 cases, found {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for case in &cases {
        let (code, stdout, stderr) = run(case);
        let mut problems = Vec::new();
        if code != Some(1) {
            problems.push(format!("exit code {code:?}, expected 1"));
        }
        if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
            problems.push("megac panicked".to_string());
        }
        if !stdout.is_empty() {
            problems.push(format!("stdout is not empty: {stdout:?}"));
        }
        if !stderr.starts_with("error: ") {
            problems.push("stderr does not start with `error: `".to_string());
        }
        let errors = stderr.lines().filter(|l| l.starts_with("error:")).count();
        if errors != 1 {
            problems.push(format!(
                "stderr has {errors} lines starting with `error:`, expected 1"
            ));
        }
        let expected_path = root().join(DIR).join(format!("{}.stderr", case.name));
        if bless() {
            std::fs::write(&expected_path, &stderr).expect("write .stderr");
        } else {
            match std::fs::read_to_string(&expected_path) {
                Ok(expected) if expected == stderr => {}
                Ok(expected) => problems.push(first_difference(&expected, &stderr)),
                Err(_) => problems.push(format!(
                    "{} is missing (run with MEGAC_BLESS=1 to create it)",
                    expected_path.display()
                )),
            }
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{} ({} {}):\n  - {}\n  stderr was:\n{}",
                case.name,
                case.toml,
                case.args.join(" "),
                problems.join("\n  - "),
                stderr
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} bad-input cases failed:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn every_case_has_expected_stderr_and_no_strays() {
    let dir = root().join(DIR);
    let mut problems = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/bad-input exists") {
        let path = entry.expect("readable directory entry").path();
        let ext = path.extension().and_then(|x| x.to_str()).unwrap_or("");
        let toml = path.with_extension("toml");
        match ext {
            "toml" if !bless() && !path.with_extension("stderr").exists() => {
                problems.push(format!("{} has no .stderr", path.display()))
            }
            "stderr" | "args" if !toml.exists() => {
                problems.push(format!("{} has no matching .toml", path.display()))
            }
            "toml" | "stderr" | "args" => {}
            _ => problems.push(format!("unexpected file {}", path.display())),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// `FILE:LINE:COL` of the first stderr line, when the error has a location in the file.
fn location(first_line: &str) -> Option<(String, usize, usize)> {
    let rest = first_line.strip_prefix("error: ")?;
    let mut parts = rest.splitn(4, ':');
    let file = parts.next()?;
    let line = parts.next()?.parse().ok()?;
    let col = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((file.to_string(), line, col))
}

#[test]
fn every_location_points_into_the_file() {
    let mut failures = Vec::new();
    for case in cases() {
        let (_, _, stderr) = run(&case);
        let first = stderr.lines().next().unwrap_or("");
        let Some((file, line, col)) = location(first) else {
            // No location: the message must still name the file or the --set argument.
            let prefix = format!("error: {}: ", case.toml);
            if !first.starts_with(&prefix) && !first.starts_with("error: --set ") {
                failures.push(format!(
                    "{}: `{first}` names neither {} nor a --set argument",
                    case.name, case.toml
                ));
            }
            continue;
        };
        let text = std::fs::read_to_string(Path::new(&root()).join(&case.toml)).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        if file != case.toml {
            failures.push(format!(
                "{}: location names {file}, not {}",
                case.name, case.toml
            ));
        } else if line == 0 || line > lines.len().max(1) {
            failures.push(format!(
                "{}: line {line} is outside the file ({} lines)",
                case.name,
                lines.len()
            ));
        } else if col == 0 || col > lines.get(line - 1).map_or(0, |l| l.chars().count()) + 1 {
            failures.push(format!(
                "{}: column {col} is outside line {line} ({:?})",
                case.name,
                lines.get(line - 1)
            ));
        } else {
            // The snippet under the message repeats that source line.
            let snippet = format!("{line} | {}", lines.get(line - 1).unwrap_or(&""));
            if !stderr.lines().any(|l| l == snippet) {
                failures.push(format!(
                    "{}: the snippet does not show line {line} `{snippet}`",
                    case.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
