//! Diagnostics: one error, with the file, line and column it points at and what would be valid.

use std::fmt;

/// Where a setting came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// A place in model.toml (1-based line and column) and that line's text.
    File {
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        col: usize,
        /// The source line, for the snippet under the message.
        text: String,
    },
    /// A `--set key=value` argument on the command line.
    Set(String),
    /// Not written anywhere: the documented default applies.
    Default,
}

/// A model.toml problem: the message, where it is, and a hint at what would be valid.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub struct SpecError {
    /// The model.toml path as the user gave it.
    pub file: String,
    /// Where the offending setting is.
    pub origin: Origin,
    /// What is wrong, naming the key and the values involved.
    pub message: String,
    /// What would be valid, if there is something useful to say.
    pub help: Option<String>,
}

impl SpecError {
    /// An error at `origin` in `file`.
    pub fn new(file: &str, origin: Origin, message: impl Into<String>) -> SpecError {
        SpecError {
            file: file.to_string(),
            origin,
            message: message.into(),
            help: None,
        }
    }

    /// Attach a hint.
    pub fn with_help(mut self, help: impl Into<String>) -> SpecError {
        self.help = Some(help.into());
        self
    }

    /// The full diagnostic: `error: FILE:LINE:COL: message`, the source line with a caret
    /// under the column, and the hint.
    pub fn render(&self) -> String {
        let mut out = format!("error: {self}\n");
        if let Origin::File { line, col, text } = &self.origin {
            let num = line.to_string();
            let pad = " ".repeat(num.len());
            out.push_str(&format!("{pad} |\n{num} | {text}\n{pad} | "));
            out.push_str(&" ".repeat(col.saturating_sub(1)));
            out.push_str("^\n");
        }
        if let Some(help) = &self.help {
            out.push_str(&format!("help: {help}\n"));
        }
        out
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.origin {
            Origin::File { line, col, .. } => {
                write!(f, "{}:{}:{}: {}", self.file, line, col, self.message)
            }
            Origin::Set(arg) => write!(f, "--set {}: {}", arg, self.message),
            Origin::Default => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// Origin of byte offset `pos` in `text`.
pub fn origin_at(text: &str, pos: usize) -> Origin {
    let pos = pos.min(text.len());
    let before = &text[..pos];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = before.matches('\n').count() + 1;
    let col = text[line_start..pos].chars().count() + 1;
    let line_end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    Origin::File {
        line,
        col,
        text: text[line_start..line_end]
            .trim_end_matches('\r')
            .to_string(),
    }
}
