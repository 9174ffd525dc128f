//! The synth crate's one error type.
//!
//! Variants carry what a caller needs to act: the model directory that did not load, the needle
//! depth that cannot fit the token budget, the file and line of a JSONL line that did not parse.

use std::path::PathBuf;

/// Errors of session generation and of the JSONL reader.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model used to count tokens could not be loaded (tokenizer or chat template).
    #[error("cannot load the counting model from {dir}: {source}")]
    Model {
        /// The model directory.
        dir: PathBuf,
        /// What the engine said.
        source: tapedeck_engine::Error,
    },
    /// Rendering or tokenizing a generated prompt failed. A generator bug or a template that
    /// rejects the opencode message shapes; either way the session cannot be measured.
    #[error("cannot encode session {session}, request {request}: {message}")]
    Encode {
        /// Index of the session being generated.
        session: usize,
        /// What was being measured.
        request: String,
        /// What the engine or tokenizer said.
        message: String,
    },
    /// The configuration asks for something the generator cannot produce.
    #[error("invalid synth configuration: {0}")]
    Config(String),
    /// A needle cannot be placed at the requested depth within the token budget.
    #[error(
        "session {session}: a needle at token {depth} does not fit: {reason} \
         (prompt budget {budget} tokens)"
    )]
    Depth {
        /// Index of the session.
        session: usize,
        /// The requested (aligned) depth.
        depth: usize,
        /// The prompt budget in force ([`crate::SynthConfig::max_prompt_tokens`]).
        budget: usize,
        /// Why it does not fit.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A session could not be serialized (should not happen: every field is plain data).
    #[error("cannot serialize session {session}: {source}")]
    Serialize {
        /// Its ID.
        session: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// A malformed JSONL line, in strict reading mode.
    #[error("{0}")]
    Line(#[from] crate::reader::LineError),
}

/// The synth crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
