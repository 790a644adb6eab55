//! Helpers shared by the tests that run the `megac` binary as a process.

use std::process::{Command, Output};

/// Run `megac` with `args` from the package root.
pub fn megac(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_megac"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run megac")
}

/// The process's stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The process's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
