//! Every example a user is shown runs as written, from the repository root: the command lines
//! in README.md's code blocks and in the `Example:`/`Examples:` section of `megac --help` and
//! of every subcommand's `--help` (the subcommands are read from `megac --help`, so a new
//! one is covered without editing this file).
//!
//! What is run, exactly:
//! - README.md: every line inside a fenced code block that starts with `megac ` or
//!   `cargo run --release -- ` (the prefix is replaced by the built binary). Placeholder syntax
//!   in prose and tables (`megac run PLAN_DIR ...`) is not an example and is not run.
//! - `--help`: every line after the `Example:`/`Examples:` heading that starts with `megac `.
//! - A line is split into words as a POSIX shell would for these examples: whitespace,
//!   '…' and "…" quoting, and a trailing unquoted `# comment` dropped.
//! - The lines of one source (README.md, or one `--help`) run in order, in one temporary
//!   directory, so an example may use what an earlier one wrote (`compile -o /tmp/p`, then
//!   `inspect /tmp/p`).
//!
//! The only changes made to a command before it runs (so that the test is fast and writes
//! nothing outside its temporary directory):
//! 1. Paths: a word starting with `/tmp/` is moved into the temporary directory (`/tmp/x` →
//!    `TMP/x`); the value of an output option (`-o`, `--out`, `--output`, `--report`,
//!    `--trace`, `--emit`, `--save-params`) that is a relative path is written there too
//!    (`run.json` → `TMP/run.json`), and later words naming that path follow it.
//! 2. Steps: `train`, `run` and `launch` run at most 2 steps: `--steps N` becomes
//!    `--steps 2` when N > 2, and `--steps 2` is added when the line has no `--steps`.
//! 3. MPI: a line that needs MPI (`megac launch`, or `--comm mpi`) runs only in a build with
//!    the `mpi` feature; in a build without it, it must fail with the error that says how to
//!    get MPI (exit 1), which is checked instead.
//!
//! Every other line must exit 0.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// At most this many steps for `train`, `run` and `launch` (rule 2).
const MAX_STEPS: u64 = 2;

/// Options whose value is a path the command writes (rule 1).
const OUTPUT_OPTIONS: [&str; 7] = [
    "-o",
    "--out",
    "--output",
    "--report",
    "--trace",
    "--emit",
    "--save-params",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn megac(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(root())
        // Other tests run at the same time: ranks waiting in MPI yield their core.
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .env_remove("MEGAC_PROGRESS")
        .output()
        .expect("run megac")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Split `line` into words as a shell would for these examples (whitespace, '…' and "…"
/// quoting, an unquoted `#` starting a comment).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_with(String::new);
            }
            (None, '#') if word.is_none() => break,
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    assert!(quote.is_none(), "unbalanced quote in example: {line}");
    words.extend(word);
    words
}

#[test]
fn shell_words_split_like_a_shell() {
    assert_eq!(
        shell_words(r#"megac schedule x.toml --set parallel.schedule="zb-h1"   # a comment"#),
        [
            "megac",
            "schedule",
            "x.toml",
            "--set",
            "parallel.schedule=zb-h1"
        ]
    );
    assert_eq!(shell_words("a 'b c' \"\""), ["a", "b c", ""]);
}

/// The arguments (after `megac`) of an example line, or None when the line is not one.
fn example_args(line: &str) -> Option<Vec<String>> {
    let line = line.trim();
    let rest = line
        .strip_prefix("cargo run --release -- ")
        .or_else(|| line.strip_prefix("megac "))?;
    Some(shell_words(rest))
}

/// README.md's examples: `megac ...` and `cargo run --release -- ...` lines in code blocks.
fn readme_examples() -> Vec<(String, Vec<String>)> {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("read README.md");
    let mut in_block = false;
    let mut found = Vec::new();
    for line in readme.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
        } else if in_block {
            if let Some(args) = example_args(line) {
                found.push((line.trim().to_string(), args));
            }
        }
    }
    found
}

/// The example lines of a `--help` output (after its `Example:`/`Examples:` heading).
fn help_examples(help: &str) -> Vec<(String, Vec<String>)> {
    help.lines()
        .skip_while(|l| !(l.starts_with("Example:") || l.starts_with("Examples:")))
        .filter(|l| l.trim_start().starts_with("megac "))
        .map(|l| (l.trim().to_string(), example_args(l).unwrap()))
        .collect()
}

/// The subcommands listed by `megac --help`.
fn subcommands() -> Vec<String> {
    let o = megac(&["--help".to_string()]);
    assert!(o.status.success());
    let help = text(&o.stdout);
    let names: Vec<String> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        // A name starts at column 2 (a wrapped description would be indented further).
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect();
    assert!(names.len() >= 10, "too few subcommands found:\n{help}");
    names
}

/// Rules 1 and 2: `args` with its paths moved into `tmp` and its steps bounded.
fn rewrite(args: &[String], tmp: &Path, moved: &mut BTreeMap<String, PathBuf>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut steps_seen = false;
    for (i, arg) in args.iter().enumerate() {
        let prev = i.checked_sub(1).map(|j| args[j].as_str());
        let mut arg = arg.clone();
        if let Some(rest) = arg.strip_prefix("/tmp/") {
            arg = tmp.join(rest).to_string_lossy().into_owned();
        } else if let Some(p) = moved.get(&arg) {
            arg = p.to_string_lossy().into_owned();
        } else if prev.is_some_and(|p| OUTPUT_OPTIONS.contains(&p)) && Path::new(&arg).is_relative()
        {
            let p = tmp.join(&arg);
            moved.insert(arg, p.clone());
            arg = p.to_string_lossy().into_owned();
        }
        if prev == Some("--steps") {
            steps_seen = true;
            let n: u64 = arg.parse().expect("--steps takes a number");
            arg = n.min(MAX_STEPS).to_string();
        }
        out.push(arg);
    }
    if ["train", "run", "launch"].contains(&args[0].as_str()) && !steps_seen {
        out.extend(["--steps".to_string(), MAX_STEPS.to_string()]);
    }
    out
}

/// Run one source's examples in order (one temporary directory); the failures, described.
fn run_examples(source: &str, examples: &[(String, Vec<String>)]) -> Vec<String> {
    let tmp = tempfile::tempdir().unwrap();
    let mut moved = BTreeMap::new();
    let mut failures = Vec::new();
    for (line, args) in examples {
        let needs_mpi = args[0] == "launch" || args.windows(2).any(|w| w == ["--comm", "mpi"]);
        let args = rewrite(args, tmp.path(), &mut moved);
        let o = megac(&args);
        let (out, err) = (text(&o.stdout), text(&o.stderr));
        let ok = if needs_mpi && !cfg!(feature = "mpi") {
            o.status.code() == Some(1)
                && err.contains("this megac was built without MPI")
                && err.contains("--features mpi")
        } else {
            o.status.success()
        };
        if !ok {
            failures.push(format!(
                "{source}: `{line}`\n  ran: megac {}\n  exit: {:?}\n  stdout: {}\n  stderr: {}",
                args.join(" "),
                o.status.code(),
                out.chars().take(2000).collect::<String>(),
                err.chars().take(2000).collect::<String>(),
            ));
        }
    }
    failures
}

#[test]
fn every_readme_example_runs() {
    let examples = readme_examples();
    // The README's set-up block shows three training commands.
    assert!(
        examples.len() >= 3,
        "README.md examples not found: {examples:?}"
    );
    let failures = run_examples("README.md", &examples);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_help_example_runs() {
    let mut failures = Vec::new();
    let mut count = 0;
    let mut sources = vec![(String::from("megac --help"), vec!["--help".to_string()])];
    for name in subcommands() {
        sources.push((
            format!("megac {name} --help"),
            vec![name, "--help".to_string()],
        ));
    }
    for (source, help_args) in sources {
        let o = megac(&help_args);
        assert!(o.status.success(), "{source} failed");
        let examples = help_examples(&text(&o.stdout));
        assert!(!examples.is_empty(), "{source} shows no example");
        count += examples.len();
        failures.extend(run_examples(&source, &examples));
    }
    assert!(count >= 20, "only {count} examples found in --help");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
