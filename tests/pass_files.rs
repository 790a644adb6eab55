//! File tests, as Cranelift's filetests and naga's snapshot folders: every graph pass is
//! tested from text files, and the verifier from a corpus of IR it must reject.
//!
//! - `tests/passes/<pass>/*.ir`: a header (`; pass:`, `; model:`, `; set:`), the input IR
//!   (none for `build`, whose input is the model spec), a `; expected:` line and the IR that
//!   exactly that pass prints (or `error: ...` when the pass fails). The runner parses the
//!   input, verifies it, runs the one pass, verifies and prints its graph, and compares.
//! - `tests/verify-reject/*.ir`: a `; error:` header and IR that the parser or the verifier
//!   must reject with exactly that message.
//!
//! `MEGAC_BLESS=1 cargo test --test pass_files` rewrites the expected parts from what the
//! code does now. The format is described in `tests/passes/README.md`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use megac_ir::{parse_graph, verify, Graph, ModelSpec};
use megac_passes::{pass_names, run_pass, Module};

/// The separator between the input IR and the expected output.
const EXPECTED: &str = "; expected:";
/// Cases each pass folder must hold at least.
const MIN_CASES: usize = 3;
/// Rejects the verifier corpus must hold at least.
const MIN_REJECTS: usize = 10;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bless() -> bool {
    std::env::var_os("MEGAC_BLESS").is_some_and(|v| v == "1")
}

/// The `.ir` files of a folder, sorted.
fn ir_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("read folder entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ir"))
        .collect();
    files.sort();
    files
}

/// A test file split into its parts.
struct TestFile {
    /// `; key: value` header lines, in order.
    header: Vec<(String, String)>,
    /// The header and comment lines at the top, verbatim (kept when blessing).
    header_text: String,
    /// The text between the header and `; expected:` (or the end): the input IR, with every
    /// `;` line blanked so that parse errors give line numbers of the file.
    input: String,
    /// The input section verbatim (kept when blessing).
    input_text: String,
    /// The text after `; expected:`, if the file has that line.
    expected: Option<String>,
    /// The file's line number of the first expected line.
    expected_line: usize,
}

impl TestFile {
    fn read(path: &Path) -> Result<TestFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        let mut header = Vec::new();
        let mut header_text = String::new();
        let mut input = String::new();
        let mut input_text = String::new();
        let mut expected: Option<String> = None;
        let mut in_header = true;
        let mut expected_line = 0;
        for (n, line) in text.split_inclusive('\n').enumerate() {
            if let Some(exp) = expected.as_mut() {
                exp.push_str(line);
                continue;
            }
            let trimmed = line.trim_end();
            if trimmed == EXPECTED {
                expected = Some(String::new());
                expected_line = n + 2;
                continue;
            }
            let comment = trimmed.trim_start().starts_with(';');
            if in_header && (comment || trimmed.is_empty()) {
                header_text.push_str(line);
                input.push('\n');
                if let Some((k, v)) = header_line(trimmed)? {
                    header.push((k, v));
                }
                continue;
            }
            in_header = false;
            input_text.push_str(line);
            if comment {
                input.push('\n');
            } else {
                input.push_str(line);
            }
        }
        Ok(TestFile {
            header,
            header_text,
            input,
            input_text,
            expected,
            expected_line,
        })
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.header
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn all(&self, key: &str) -> Vec<String> {
        self.header
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .collect()
    }

    fn has_input(&self) -> bool {
        !self.input.trim().is_empty()
    }
}

const KEYS: [&str; 8] = [
    "pass", "model", "set", "error", "probe", "perturb", "seed", "tokens",
];

/// `; key: value` for a known key; every other `;` line is a comment.
fn header_line(line: &str) -> Result<Option<(String, String)>, String> {
    let Some(body) = line.trim_start().strip_prefix(';') else {
        return Ok(None);
    };
    let Some((key, value)) = body.trim().split_once(':') else {
        return Ok(None);
    };
    if !KEYS.contains(&key) {
        return Ok(None);
    }
    if value.trim().is_empty() {
        return Err(format!("`; {key}:` has no value"));
    }
    Ok(Some((key.to_string(), value.trim().to_string())))
}

/// The model spec named by the header: `; model:` (relative to the repository root) with
/// every `; set:` applied.
fn load_spec(file: &TestFile) -> Result<ModelSpec, String> {
    let model = file
        .get("model")
        .ok_or("no `; model:` header (the passes read the model spec)")?;
    megac_frontend::load(&root().join(model), &file.all("set")).map_err(|e| e.render())
}

/// Run one pass file; the text the pass produced, or why the case is broken.
fn run_pass_file(pass_dir: &str, file: &TestFile) -> Result<String, String> {
    let pass = file.get("pass").ok_or("no `; pass:` header")?;
    if pass != pass_dir {
        return Err(format!(
            "header names pass `{pass}` but the file is in the `{pass_dir}` folder"
        ));
    }
    let spec = load_spec(file)?;
    let mut module = Module::new(spec);
    // What the `perturb` and `probe` passes insert: `; probe: PATTERN`, `; perturb:
    // POINT:KIND[@STEP]` (training streams), `; seed: S`, `; tokens: N`.
    module.instrument = megac_passes::Instrument {
        probes: file.all("probe"),
        perturbations: file
            .all("perturb")
            .iter()
            .map(|p| megac_ir::perturb::TrainPerturbation::parse(p))
            .collect::<Result<_, _>>()?,
        seed: file
            .get("seed")
            .map_or(Ok(0), str::parse)
            .map_err(|e| format!("; seed: {e}"))?,
        tokens: file
            .get("tokens")
            .map_or(Ok(0), str::parse)
            .map_err(|e| format!("; tokens: {e}"))?,
        train: file.get("tokens").is_none(),
    };
    if pass == "build" {
        if file.has_input() {
            return Err("a `build` file holds no input IR: its input is the model spec".into());
        }
    } else {
        if !file.has_input() {
            return Err("no input IR before `; expected:`".into());
        }
        let graph = parse_graph(&file.input).map_err(|e| format!("input does not parse: {e}"))?;
        verify(&graph).map_err(|e| format!("input does not verify: {e}"))?;
        check_mesh(&graph, &module.spec)?;
        module.graph = Some(graph);
    }
    Ok(match run_pass(&mut module, pass) {
        Ok(()) => module.dump(),
        Err(e) => format!("error: {e}\n"),
    })
}

/// The input's `mesh` line must be the one the header's spec gives, so header and IR agree.
fn check_mesh(graph: &Graph, spec: &ModelSpec) -> Result<(), String> {
    let mut built = Module::new(spec.clone());
    run_pass(&mut built, "build").map_err(|e| format!("the header's spec does not build: {e}"))?;
    let want = &built.graph.as_ref().expect("build makes a graph").mesh;
    if &graph.mesh != want {
        return Err(format!(
            "the input's mesh ({:?}) is not the header's model + set ({:?})",
            graph.mesh.axes, want.axes
        ));
    }
    Ok(())
}

/// What the parser or the verifier says about a reject file, or None if both accept it.
fn reject_error(file: &TestFile) -> Option<String> {
    match parse_graph(&file.input) {
        Err(e) => Some(format!("parse: {e}")),
        Ok(g) => verify(&g).err().map(|e| format!("verify: {e}")),
    }
}

#[test]
fn every_pass_file_gives_its_expected_output() {
    let dir = root().join("tests/passes");
    let mut failures = Vec::new();
    let mut count = 0;
    for pass in pass_names() {
        let files = ir_files(&dir.join(pass));
        if files.len() < MIN_CASES {
            failures.push(format!(
                "tests/passes/{pass}/: {} cases, at least {MIN_CASES} expected",
                files.len()
            ));
        }
        for path in files {
            count += 1;
            let name = path
                .strip_prefix(root())
                .unwrap_or(&path)
                .display()
                .to_string();
            let file = match TestFile::read(&path) {
                Ok(f) => f,
                Err(e) => {
                    failures.push(format!("{name}: {e}"));
                    continue;
                }
            };
            let got = match run_pass_file(pass, &file) {
                Ok(got) => got,
                Err(e) => {
                    failures.push(format!("{name}: {e}"));
                    continue;
                }
            };
            if file.expected.as_deref() == Some(got.as_str()) {
                continue;
            }
            if bless() {
                let text = format!("{}{}{EXPECTED}\n{got}", file.header_text, file.input_text);
                std::fs::write(&path, text).unwrap_or_else(|e| panic!("{name}: {e}"));
                eprintln!("blessed {name}");
                continue;
            }
            failures.push(match &file.expected {
                None => format!("{name}: no `{EXPECTED}` line; the pass printed:\n{got}"),
                Some(want) => format!(
                    "{name}: output differs (- expected, + actual):\n{}",
                    diff(want, &got, file.expected_line)
                ),
            });
        }
    }
    for entry in std::fs::read_dir(&dir).expect("read tests/passes") {
        let path = entry.expect("read folder entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if path.is_dir() && name != "models" && !pass_names().contains(&name.as_ref()) {
            failures.push(format!(
                "tests/passes/{name}/: no pass has that name (passes: {})",
                pass_names().join(", ")
            ));
        }
    }
    assert!(count > 0, "no pass files under {}", dir.display());
    report(failures);
}

#[test]
fn the_verifier_rejects_every_file_in_its_corpus() {
    let dir = root().join("tests/verify-reject");
    let files = ir_files(&dir);
    let mut failures = Vec::new();
    if files.len() < MIN_REJECTS {
        failures.push(format!(
            "tests/verify-reject/: {} files, at least {MIN_REJECTS} expected",
            files.len()
        ));
    }
    for path in files {
        let name = path
            .strip_prefix(root())
            .unwrap_or(&path)
            .display()
            .to_string();
        let file = match TestFile::read(&path) {
            Ok(f) => f,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        if file.expected.is_some() {
            failures.push(format!(
                "{name}: a reject has an `; error:` header, not `{EXPECTED}`"
            ));
            continue;
        }
        let Some(got) = reject_error(&file) else {
            failures.push(format!("{name}: the parser and the verifier accept it"));
            continue;
        };
        let want = file.get("error");
        if want == Some(got.as_str()) {
            continue;
        }
        if bless() {
            let mut header = String::new();
            let mut written = false;
            for line in file.header_text.split_inclusive('\n') {
                if header_line(line.trim_end())
                    .ok()
                    .flatten()
                    .is_some_and(|(k, _)| k == "error")
                {
                    if !written {
                        writeln!(header, "; error: {got}").expect("write to String");
                        written = true;
                    }
                } else {
                    header.push_str(line);
                }
            }
            if !written {
                header = format!("; error: {got}\n{header}");
            }
            std::fs::write(&path, format!("{header}{}", file.input_text))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            eprintln!("blessed {name}");
            continue;
        }
        failures.push(format!(
            "{name}: rejected with a different error\n  expected: {}\n  actual:   {got}",
            want.unwrap_or("(no `; error:` header)")
        ));
    }
    report(failures);
}

fn report(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} file test(s) failed:\n\n{}\n\nIf the new output is right: MEGAC_BLESS=1 cargo test --test pass_files",
        failures.len(),
        failures.join("\n\n")
    );
}

/// A line diff of `want` and `got` (longest common subsequence): changed lines with three
/// lines of context, `-` expected and `+` actual; `want` starts on the file's line
/// `first_line`, and expected lines show their line number in the file.
fn diff(want: &str, got: &str, first_line: usize) -> String {
    let a: Vec<&str> = want.lines().collect();
    let b: Vec<&str> = got.lines().collect();
    let (n, m) = (a.len(), b.len());
    let mut lcs = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    // Edit script: (tag, expected line number, text).
    let mut script: Vec<(char, usize, &str)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            script.push((' ', i + 1, a[i]));
            i += 1;
            j += 1;
        } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
            script.push(('-', i + 1, a[i]));
            i += 1;
        } else {
            script.push(('+', 0, b[j]));
            j += 1;
        }
    }
    const CONTEXT: usize = 3;
    let changed: Vec<usize> = (0..script.len()).filter(|&k| script[k].0 != ' ').collect();
    let mut out = String::new();
    let mut last_shown: Option<usize> = None;
    for (k, &(tag, line, text)) in script.iter().enumerate() {
        let near = changed
            .iter()
            .any(|&c| k + CONTEXT >= c && k <= c + CONTEXT);
        if !near {
            continue;
        }
        if last_shown.is_some_and(|l| l + 1 != k) {
            out.push_str("   ...\n");
        }
        if tag == '+' {
            writeln!(out, "+      | {text}")
        } else {
            writeln!(out, "{tag} {:4} | {text}", line + first_line - 1)
        }
        .expect("write to String");
        last_shown = Some(k);
    }
    out
}
