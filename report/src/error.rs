//! The crate's one error type.
//!
//! Each variant carries what a user needs to fix the problem: a policy error names the key and the
//! line, an unreadable run names the file.

use std::path::PathBuf;

/// Everything that can go wrong while reporting, comparing or bisecting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The policy file is not valid TOML, has an unknown key, a value of the wrong type, or a
    /// value out of range.
    #[error("{source_name}:{line}:{column}: policy key `{key}`: {message}")]
    Policy {
        /// File name (or `<policy>` for a string).
        source_name: String,
        /// 1-based line of the offending key or value (0 when unknown).
        line: usize,
        /// 1-based column (0 when unknown).
        column: usize,
        /// The key at fault, as written in the file (dotted with its table).
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// JSON could not be produced or parsed.
    #[error("JSON ({context}): {source}")]
    Json {
        /// What was being done.
        context: String,
        /// The serde error.
        source: serde_json::Error,
    },
    /// A histogram embedded in a run summary could not be decoded.
    #[error("histogram `{metric}`: {message}")]
    Histogram {
        /// Which latency.
        metric: String,
        /// The decoder's message.
        message: String,
    },
    /// Drawing a plot failed.
    #[error("plot `{plot}`: {message}")]
    Plot {
        /// Which plot.
        plot: String,
        /// The backend's message.
        message: String,
    },
    /// A toggle name or value was rejected by the engine.
    #[error("toggle: {0}")]
    Toggle(#[from] tapedeck_engine::Error),
    /// The caller's replay (inside a bisect) failed.
    #[error("replay of toggles `{toggles}` failed: {source}")]
    Replay {
        /// The toggle set being replayed (canonical text).
        toggles: String,
        /// The caller's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
