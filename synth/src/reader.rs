//! Reading `tapedeck.session.v1` JSONL with errors that point at the problem.
//!
//! The recorder's importer stops at the first bad line with its line number and serde's message;
//! the replayer's loader does the same. A fixture or a hand-edited export usually has one bad line
//! among many good ones, so this reader says *where* (file, line, the JSON path of the offending
//! field, e.g. `requests[3].response.tool_calls[0].function`) and, when not strict, skips the
//! line and keeps reading so one typo does not hide the rest of the file.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use tapedeck_recorder::sessions::{SessionLine, FORMAT};

use crate::error::{Error, Result};

/// A line that did not parse as a session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}:{line}: {}{message}", file.display(), if path.is_empty() || path == "." { String::new() } else { format!("at {path}: ") })]
pub struct LineError {
    /// The file read.
    pub file: PathBuf,
    /// 1-based line number.
    pub line: usize,
    /// JSON path of the field that failed (`requests[0].turn`), `.` for the line itself.
    pub path: String,
    /// What serde (or the format check) said.
    pub message: String,
}

/// Parses one line; `Err((path, message))` when it is not a valid session.
fn parse_line(text: &str) -> std::result::Result<SessionLine, (String, String)> {
    let de = &mut serde_json::Deserializer::from_str(text);
    let line: SessionLine = serde_path_to_error::deserialize(de).map_err(|e| {
        // serde_path_to_error writes `?` (or nothing) when the error is not inside a field,
        // e.g. a syntax error before the first key; `.` says "the line itself" more plainly.
        let path = match e.path().to_string() {
            p if p.is_empty() || p == "?" => ".".to_string(),
            p => p,
        };
        (path, e.into_inner().to_string())
    })?;
    if line.format != FORMAT {
        return Err((
            "format".into(),
            format!("format {:?} is not {FORMAT:?}", line.format),
        ));
    }
    Ok(line)
}

/// Reads a session JSONL file. Blank lines are ignored. A malformed line is reported with its file,
/// line number and field path; `strict` stops there with [`Error::Line`], otherwise the line is
/// skipped, its error collected, and reading goes on.
pub fn read_jsonl(path: &Path, strict: bool) -> Result<(Vec<SessionLine>, Vec<LineError>)> {
    let file = std::fs::File::open(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    read_from(std::io::BufReader::new(file), path, strict)
}

/// [`read_jsonl`] over any reader; `path` only labels errors.
pub fn read_from(
    input: impl BufRead,
    path: &Path,
    strict: bool,
) -> Result<(Vec<SessionLine>, Vec<LineError>)> {
    let mut sessions = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let line = line.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(&line) {
            Ok(s) => sessions.push(s),
            Err((field, message)) => {
                let e = LineError {
                    file: path.to_path_buf(),
                    line: i + 1,
                    path: field,
                    message,
                };
                if strict {
                    return Err(Error::Line(e));
                }
                errors.push(e);
            }
        }
    }
    Ok((sessions, errors))
}
