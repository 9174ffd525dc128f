//! The replayer crate's one error type.
//!
//! Variants carry what an operator needs to act: the file and line of a bad session, the target
//! spec that did not parse, the URL that failed. A failing *turn* is not an error of the run: it is
//! recorded in that turn's row (with [`Error::kind`] as its class) and counted in the speed
//! summary's errors, so one bad request never throws away a run.

use std::path::PathBuf;

/// Errors of loading sessions, opening targets and replaying.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A session file line is not a valid `tapedeck.session.v1` record.
    #[error("{path}:{line}: {message}")]
    SessionFormat {
        /// The file (`-` for in-memory text).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// The recording database could not be read.
    #[error("recording database: {0}")]
    Store(#[from] tapedeck_recorder::Error),
    /// The in-process engine failed.
    #[error("engine: {0}")]
    Engine(#[from] tapedeck_engine::Error),
    /// A target spec did not parse or name something that exists.
    #[error("target {spec:?}: {message}")]
    TargetSpec {
        /// The spec as given.
        spec: String,
        /// What was wrong.
        message: String,
    },
    /// An HTTP request to the target failed before a response, or returned a non-success status.
    #[error("HTTP {url}: {message}")]
    Http {
        /// The URL requested.
        url: String,
        /// HTTP status, when one came back.
        status: Option<u16>,
        /// What went wrong (the body's error message when there is one).
        message: String,
    },
    /// The target accepted a request and then failed it (an engine stream error, an error event
    /// in an SSE stream).
    #[error("generation failed: {0}")]
    Generation(String),
    /// The target answered something that does not follow the protocol.
    #[error("protocol error from target: {0}")]
    Protocol(String),
    /// A histogram could not be encoded, decoded or merged.
    #[error("histogram: {0}")]
    Histogram(String),
    /// JSON could not be written or read.
    #[error("JSON error while {context}: {source}")]
    Json {
        /// What was being done.
        context: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// A setting is out of range.
    #[error("invalid setting {name}: {message}")]
    Setting {
        /// The setting.
        name: &'static str,
        /// What was wrong.
        message: String,
    },
    /// Run summaries could not be merged (different targets or settings, a shard given twice, a
    /// session in two inputs).
    #[error("merging runs: {0}")]
    Merge(String),
    /// The replay was cancelled while this request was in flight.
    #[error("cancelled")]
    Cancelled,
}

impl Error {
    /// A short, stable class name used to count errors by kind (`http_429`, `engine`, ...).
    pub fn kind(&self) -> String {
        match self {
            Error::Io { .. } => "io".into(),
            Error::SessionFormat { .. } => "session_format".into(),
            Error::Store(_) => "store".into(),
            Error::Engine(tapedeck_engine::Error::ContextOverflow { .. }) => {
                "context_overflow".into()
            }
            Error::Engine(_) => "engine".into(),
            Error::TargetSpec { .. } => "target_spec".into(),
            Error::Http {
                status: Some(s), ..
            } => format!("http_{s}"),
            Error::Http { status: None, .. } => "http_transport".into(),
            Error::Generation(_) => "generation".into(),
            Error::Protocol(_) => "protocol".into(),
            Error::Histogram(_) => "histogram".into(),
            Error::Json { .. } => "json".into(),
            Error::Setting { .. } => "setting".into(),
            Error::Merge(_) => "merge".into(),
            Error::Cancelled => "cancelled".into(),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
