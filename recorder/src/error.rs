//! The recorder crate's one error type.
//!
//! Variants carry what is needed to act on them: the database operation that failed, the request
//! whose blob did not decode, the JSONL line that did not import. HTTP errors have their own type,
//! [`crate::server::ApiError`], because what a client may see is not what an operator needs.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::blob::BlobError;

/// Errors of the store, the writer, the session tools and the server's startup.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database file could not be opened or created.
    #[error("cannot open database {path}: {source}")]
    Open {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: sqlx::Error,
    },
    /// Applying the embedded migrations failed (e.g. the file was written by a newer tapedeck).
    #[error("cannot migrate database {path}: {source}")]
    Migrate {
        /// The database file.
        path: PathBuf,
        /// What the migrator said.
        source: sqlx::migrate::MigrateError,
    },
    /// A query failed.
    #[error("database error while {context}: {source}")]
    Db {
        /// What was being done.
        context: String,
        /// What SQLite said.
        source: sqlx::Error,
    },
    /// A stored blob did not decode.
    #[error("request {request}: column {column}: {source}")]
    Blob {
        /// The request whose row holds the blob.
        request: String,
        /// The column.
        column: &'static str,
        /// Why it did not decode.
        source: BlobError,
    },
    /// A stored or imported value is not what the schema promises.
    #[error("{context}: {message}")]
    Corrupt {
        /// Where the value was found.
        context: String,
        /// What was wrong with it.
        message: String,
    },
    /// JSON could not be written or read.
    #[error("JSON error while {context}: {source}")]
    Json {
        /// What was being done.
        context: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// A line of a session JSONL file could not be imported.
    #[error("import line {line}: {message}")]
    Import {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// A file or stream could not be read or written.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Asked for a session or request that is not in the database.
    #[error("{what} {id} not found")]
    NotFound {
        /// `session` or `request`.
        what: &'static str,
        /// The ID asked for.
        id: String,
    },
    /// The record writer has shut down; nothing more can be queued.
    #[error("the record writer has shut down")]
    WriterClosed,
    /// The engine failed to load a model or otherwise refused.
    #[error("engine: {0}")]
    Engine(#[from] tapedeck_engine::Error),
    /// The server could not listen on its address.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// The recorder's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn db(context: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Error {
        let context = context.into();
        move |source| Error::Db { context, source }
    }

    pub(crate) fn json(context: impl Into<String>) -> impl FnOnce(serde_json::Error) -> Error {
        let context = context.into();
        move |source| Error::Json { context, source }
    }

    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }
}
