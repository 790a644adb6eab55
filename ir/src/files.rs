//! Reading the text files users hand megac (model.toml, cluster.toml, hostfiles, plan.json)
//! without trusting their size: a file over a limit is an error before anything is read,
//! and the memory for the rest is reserved fallibly, so a file too large for memory is an
//! error, never an abort.

use std::io::Read;
use std::path::Path;

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
