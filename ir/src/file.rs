//! Reading and writing users' files, in one home.
//!
//! Reading ([`read_text`]): the text files users hand megac (model.toml, cluster.toml,
//! hostfiles, plan.json) are read without trusting their size: a file over a limit is an
//! error before anything is read, and the memory for the rest is reserved fallibly, so a
//! file too large for memory is an error, never an abort.
//!
//! Writing ([`write_atomic`]): write a temporary file beside the target, then rename it
//! into place, so a reader never sees a half-written plan, report, trace or
//! checkpoint, and a failed write leaves the old file (or none) behind. Codegen's
//! `write_plan`, the runtime's trace and `save_params`, and the CLI's report, trace, schedule
//! and `--emit` writers all call it (it lives in ir because the runtime depends on ir only).

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Why an atomic write failed (the target is untouched, the temporary file removed).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The path names no file (it ends in `..` or is empty).
    #[error("not a file path")]
    NotAFile,
    /// The target's folder is missing and cannot be made.
    #[error("cannot create the folder {dir}: {source}")]
    Folder {
        /// The folder.
        dir: String,
        /// Why.
        source: io::Error,
    },
    /// No temporary file can be created beside the target.
    #[error("cannot create a temporary file in {dir}: {source}")]
    Temporary {
        /// The folder.
        dir: String,
        /// Why.
        source: io::Error,
    },
    /// Writing or syncing the temporary file failed (or the writer reported an error).
    #[error("cannot write: {0}")]
    Write(io::Error),
    /// The temporary file cannot replace the target.
    #[error("cannot rename the temporary file into place: {0}")]
    Rename(io::Error),
}

/// Write `contents` to `path` atomically (see [`write_atomic_with`]).
pub fn write_atomic(path: &Path, contents: impl AsRef<[u8]>) -> Result<(), WriteError> {
    write_atomic_with(path, |w| w.write_all(contents.as_ref()))
}

/// Write `path` atomically with `write`: missing folders are created, `write` fills a new
/// temporary file beside the target (`.NAME.PID.N.tmp`, through a 1 MiB buffer), which is
/// flushed, synced and renamed over `path`; the folder is then synced (best effort). On any
/// error the temporary file is removed and `path` is left as it was.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), WriteError> {
    let name = path.file_name().ok_or(WriteError::NotAFile)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(|source| WriteError::Folder {
        dir: dir.display().to_string(),
        source,
    })?;
    let (tmp, file) = create_temporary(dir, &name.to_string_lossy())?;
    let written = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, &file);
        write(&mut w)?;
        w.flush()?;
        drop(w);
        file.sync_all()
    })();
    drop(file);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(WriteError::Write(e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(WriteError::Rename(e));
    }
    // Make the rename durable; failing to sync a folder is not worth an error.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A new temporary file in `dir` for target `name`, unique among concurrent writers.
fn create_temporary(dir: &Path, name: &str) -> Result<(PathBuf, File), WriteError> {
    let pid = std::process::id();
    let mut n = 0u32;
    loop {
        let tmp = dir.join(format!(".{name}.{pid}.{n}.tmp"));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
            Err(source) => {
                return Err(WriteError::Temporary {
                    dir: dir.display().to_string(),
                    source,
                })
            }
        }
    }
}

/// The largest configuration file megac reads (model.toml, cluster.toml, hostfile): real
/// ones are a few kilobytes.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Why a text file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadTextError {
    /// The file could not be opened or read, or is not UTF-8.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The file is larger than the reader accepts.
    #[error("the file is {size} bytes, more than the {max} bytes this kind of file may have")]
    TooLarge {
        /// The file's size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The file does not fit in memory.
    #[error("the file is {size} bytes, more than fits in memory")]
    OutOfMemory {
        /// The file's size in bytes.
        size: u64,
    },
}

/// Read the UTF-8 file at `path`, at most `max` bytes long (`u64::MAX`: no limit but
/// memory).
pub fn read_text(path: &Path, max: u64) -> Result<String, ReadTextError> {
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    if size > max {
        return Err(ReadTextError::TooLarge { size, max });
    }
    let mut bytes = Vec::new();
    usize::try_from(size)
        .ok()
        .and_then(|n| bytes.try_reserve_exact(n).ok())
        .ok_or(ReadTextError::OutOfMemory { size })?;
    // A file that grows while it is read stops at the limit plus one byte (then too large).
    (&mut file)
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(ReadTextError::TooLarge {
            size: bytes.len() as u64,
            max,
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        ReadTextError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("stream did not contain valid UTF-8: {}", e.utf8_error()),
        ))
    })
}
