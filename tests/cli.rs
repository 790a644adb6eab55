//! The command line as a user runs it: a real process, its exit code, stdout and stderr.

use std::process::{Command, Output};

fn megac(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run megac")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn check_llama3_8b_reports_its_parameter_count() {
    let o = megac(&["check", "examples/llama3-8b.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    // 8.03e9 within 0.5%: the exact count is 8,030,261,248.
    assert!(out.contains("8.03 G (8,030,261,248)"), "{out}");
    assert!(out.contains("ok: examples/llama3-8b.toml is valid"));
    assert!(out.contains("formula:"), "the FLOPs line names its formula");
    assert!(out.contains("ranks        8 "), "{out}");
}

#[test]
fn set_overrides_show_in_the_summary() {
    let o = megac(&[
        "check",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.dp=2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("tp=2 pp=1 vpp=1 dp=2"), "{out}");
    assert!(out.contains("ranks        4 "), "{out}");
}

#[test]
fn set_errors_point_at_the_argument() {
    let o = megac(&[
        "check",
        "examples/llama-tiny.toml",
        "--set",
        "parallel.tp=3",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with(
            "error: --set parallel.tp=3: parallel.tp = 3 does not divide model.heads = 4"
        ),
        "{err}"
    );
    assert!(
        err.contains("help: valid tp for this model: 1, 2, 4"),
        "{err}"
    );
}

#[test]
fn dump_output_parses_back() {
    let o = megac(&["dump", "examples/gpt-tiny.toml", "--after", "build"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let g = megac_ir::parse_graph(&text).unwrap();
    megac_ir::verify(&g).unwrap();
    assert_eq!(megac_ir::print_graph(&g), text);
    // Every layer's ops appear with their provenance.
    for needle in [
        "# transformer.h.0.attn.c_attn",
        "# transformer.h.1.mlp.c_proj",
        "# transformer.ln_f",
        "# loss",
    ] {
        assert!(text.contains(needle), "missing {needle}");
    }
}

#[test]
fn dump_rejects_an_unknown_pass() {
    let o = megac(&["dump", "examples/gpt-tiny.toml", "--after", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).is_empty());
    let err = stderr(&o);
    assert!(err.contains("no pass named `nope`; passes: build"), "{err}");
}

#[test]
fn missing_file_is_one_clear_error() {
    let o = megac(&["check", "examples/does-not-exist.toml"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: examples/does-not-exist.toml: cannot read the file"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn passes_lists_the_pipeline() {
    let o = megac(&["passes"]);
    assert!(o.status.success());
    let out = stdout(&o);
    let names: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(names, megac_passes::pass_names());
}

#[test]
fn every_command_has_help_with_an_example() {
    for cmd in ["check", "dump", "passes"] {
        let o = megac(&[cmd, "--help"]);
        assert!(o.status.success(), "{cmd} --help failed");
        let out = stdout(&o);
        assert!(
            out.contains("Example:"),
            "{cmd} --help has no example:\n{out}"
        );
        assert!(
            out.contains(&format!("megac {cmd}")),
            "{cmd} --help:\n{out}"
        );
    }
    let o = megac(&["--help"]);
    assert!(stdout(&o).contains("Examples:"));
}
