//! The one error type of the crate: a message, where it points (file, line, column) when
//! there is a place, and a hint at what would be valid.

use std::fmt;

/// A place in a file: 1-based line and column, and the line's text for the snippet.
#[derive(Clone, Debug, PartialEq)]
pub struct Location {
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub col: usize,
    /// The source line.
    pub text: String,
}

impl Location {
    /// The location of byte offset `pos` in `text`.
    pub fn at(text: &str, pos: usize) -> Location {
        let mut pos = pos.min(text.len());
        while !text.is_char_boundary(pos) {
            pos -= 1;
        }
        let before = &text[..pos];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let line = before.matches('\n').count() + 1;
        let col = text[line_start..pos].chars().count() + 1;
        let line_end = text[line_start..]
            .find('\n')
            .map_or(text.len(), |i| line_start + i);
        Location {
            line,
            col,
            text: text[line_start..line_end]
                .trim_end_matches('\r')
                .to_string(),
        }
    }
}

/// A problem with a cluster file, a plan or a layout search.
#[derive(Clone, Debug, PartialEq)]
pub struct SimError {
    /// The file the problem is in, if any.
    pub file: Option<String>,
    /// Where in the file.
    pub location: Option<Location>,
    /// What is wrong.
    pub message: String,
    /// What would be valid.
    pub help: Option<String>,
}

impl SimError {
    /// An error with no file.
    pub fn new(message: impl Into<String>) -> SimError {
        SimError {
            file: None,
            location: None,
            message: message.into(),
            help: None,
        }
    }

    /// An error in `file` (no position).
    pub fn in_file(file: &str, message: impl Into<String>) -> SimError {
        SimError {
            file: Some(file.to_string()),
            ..SimError::new(message)
        }
    }

    /// An error at byte offset `pos` of `text`, the contents of `file`.
    pub fn at(file: &str, text: &str, pos: usize, message: impl Into<String>) -> SimError {
        SimError {
            file: Some(file.to_string()),
            location: Some(Location::at(text, pos)),
            ..SimError::new(message)
        }
    }

    /// Attach a hint.
    pub fn with_help(mut self, help: impl Into<String>) -> SimError {
        self.help = Some(help.into());
        self
    }

    /// The full diagnostic: `error: FILE:LINE:COL: message`, the line with a caret under the
    /// column, and the hint; each on its own line.
    pub fn render(&self) -> String {
        let mut out = format!("error: {self}\n");
        if let Some(Location { line, col, text }) = &self.location {
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

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, &self.location) {
            (Some(file), Some(l)) => write!(f, "{file}:{}:{}: {}", l.line, l.col, self.message),
            (Some(file), None) => write!(f, "{file}: {}", self.message),
            _ => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for SimError {}
