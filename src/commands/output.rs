//! The check every command makes of the paths it will write, before any work: a run that
//! trains for an hour must not fail at its end because `--save-params` names a folder that
//! does not exist or cannot be written.
//!
//! Policy: a missing folder is fine when it can be made: the nearest part of the path that
//! exists must be a folder in which a file can be created (probed by creating a file there
//! and removing it). The check creates nothing else, so a run that fails leaves nothing
//! behind; the writers create the missing folders (`mkdir -p`) when they write.

use std::fs::OpenOptions;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Check that the file `path` (given with `flag`, e.g. `--save-params`) can be written:
/// its folder exists and is writable, or can be made.
pub fn check_file(flag: &str, path: &Path) -> Result<(), String> {
    let shown = path.display();
    if path.is_dir() {
        return Err(format!(
            "error: {flag} {shown}: is a directory; give a file name"
        ));
    }
    if path.file_name().is_none() {
        return Err(format!("error: {flag} {shown}: not a file name"));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    writable_dir(flag, path, dir)
}

/// Check that the folder `dir` (given with `flag`, e.g. `-o` or `--trace`) can hold the files
/// the command writes there: it exists and is writable, or can be made.
pub fn check_dir(flag: &str, dir: &Path) -> Result<(), String> {
    if dir.exists() && !dir.is_dir() {
        return Err(format!(
            "error: {flag} {}: is a file, not a folder",
            dir.display()
        ));
    }
    writable_dir(flag, dir, dir)
}

/// Check that `dir` exists and can be written, or can be made: probe its nearest existing
/// ancestor with a file that is removed again.
fn writable_dir(flag: &str, arg: &Path, dir: &Path) -> Result<(), String> {
    let fail = |what: String| format!("error: {flag} {}: {what}", arg.display());
    // The nearest part of `dir` that exists, once the folders still to be made are resolved
    // (`nodir/x/../../f` is `./f`: the `..`s cancel folders that `mkdir -p` would make).
    let resolved = resolve_missing(dir);
    let existing = nearest_existing(&resolved);
    if !existing.is_dir() {
        return Err(fail(format!(
            "cannot create the folder {}: {} is a file",
            dir.display(),
            existing.display()
        )));
    }
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let probe = existing.join(format!(
        ".megac-write-probe-{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    match OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(file) => {
            drop(file);
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(fail(format!(
            "cannot write in the folder {}: {e}",
            existing.display()
        ))),
    }
}

/// Write `text` to `path` atomically (`megac_ir::file::write_atomic`: missing folders are
/// made, a temporary file is renamed into place), with the CLI's error line.
pub fn write_file(path: &Path, text: &str) -> Result<(), String> {
    megac_ir::file::write_atomic(path, text).map_err(|e| format!("error: {}: {e}", path.display()))
}

/// The nearest part of `dir` that exists (`.` for a relative path none of which exists).
fn nearest_existing(dir: &Path) -> PathBuf {
    dir.ancestors()
        .find(|a| a.as_os_str().is_empty() || a.exists())
        .filter(|a| !a.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

/// `dir` with its part below the nearest existing folder applied lexically: a folder that does
/// not exist yet has no symbolic links, so `missing/..` is the folder it stands in, as it will
/// be once `mkdir -p` has made it.
fn resolve_missing(dir: &Path) -> PathBuf {
    let base = nearest_existing(dir);
    let rest = dir.strip_prefix(&base).unwrap_or(dir);
    let mut out = base;
    let mut made = 0usize; // components pushed onto `out` that do not exist yet
    for c in rest.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir if made > 0 => {
                out.pop();
                made -= 1;
            }
            Component::ParentDir => out.push(".."),
            other => {
                out.push(other);
                made += 1;
            }
        }
    }
    out
}
