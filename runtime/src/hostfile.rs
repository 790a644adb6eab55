//! OpenMPI hostfiles (`megac launch --hostfile FILE`): one node per line,
//! `HOST [slots=N] [max_slots=N]`, `#` comments. megac checks the file before starting
//! mpirun, so a malformed file is one error naming its line.

use std::path::Path;

/// A hostfile that cannot start the job: the file, the line (1-based) when one line is at
/// fault, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--hostfile {path}{}: {message}", line.map_or(String::new(), |l| format!(":{l}")))]
pub struct HostfileError {
    /// The hostfile as the user named it.
    pub path: String,
    /// The line at fault (1-based), if one is.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

/// Check an OpenMPI hostfile's `text` for `n` processes: one clear error for a malformed
/// line, an empty file, or fewer slots than processes (when every line gives its slots).
/// Never panics, whatever the text and `n`.
pub fn check_hostfile(path: &Path, text: &str, n: usize) -> Result<(), HostfileError> {
    let err = |line: Option<usize>, message: String| HostfileError {
        path: path.display().to_string(),
        line,
        message,
    };
    let mut hosts = 0usize;
    // The total of the slots, while every line gives its slots (saturating: a sum past
    // usize::MAX is more than any job needs).
    let mut slots = Some(0usize);
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(_host) = words.next() else { continue };
        hosts += 1;
        let mut line_slots = None;
        for w in words {
            let (key, value) = w.split_once('=').unwrap_or((w, ""));
            match key {
                "slots" | "max_slots" | "max-slots" => {
                    let v = value
                        .parse::<usize>()
                        .ok()
                        .filter(|&v| v > 0)
                        .ok_or_else(|| {
                            err(
                                Some(i + 1),
                                format!("`{w}`: {key} must be a positive whole number"),
                            )
                        })?;
                    if key == "slots" {
                        line_slots = Some(v);
                    }
                }
                _ => {
                    return Err(err(
                        Some(i + 1),
                        format!(
                            "`{w}`: expected `HOST [slots=N] [max_slots=N]` (one node per line)"
                        ),
                    ))
                }
            }
        }
        slots = slots.zip(line_slots).map(|(a, b)| a.saturating_add(b));
    }
    if hosts == 0 {
        return Err(err(
            None,
            "no hosts (expected one node per line: `HOST slots=N`)".to_string(),
        ));
    }
    if let Some(total) = slots.filter(|&t| t < n) {
        return Err(err(
            None,
            format!(
                "{total} slot{} on {hosts} host{}, but megac launch -n {n} starts {n} \
                 processes; add slots or hosts",
                if total == 1 { "" } else { "s" },
                if hosts == 1 { "" } else { "s" },
            ),
        ));
    }
    Ok(())
}
