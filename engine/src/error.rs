//! The engine's one error type.
//!
//! Every variant carries what a user needs to fix the problem: the file or tensor involved, what
//! was expected and what was found. Nothing in the engine panics on bad input; it returns one of
//! these.

use std::path::PathBuf;

/// Errors from loading, encoding, running or sampling a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file of the model directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A required file is absent from the model directory.
    #[error("model directory {dir} has no {file}")]
    MissingFile {
        /// The model directory.
        dir: PathBuf,
        /// The file that was expected there.
        file: String,
    },
    /// A JSON file did not parse or lacks a field.
    #[error("{path}: {message}")]
    BadJson {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        message: String,
    },
    /// The checkpoint is of an architecture this engine does not run.
    #[error("unsupported architecture {found:?} in {path} (supported: {supported})")]
    UnsupportedArchitecture {
        /// The `config.json` read.
        path: PathBuf,
        /// The architecture named there.
        found: String,
        /// The architectures the engine runs.
        supported: String,
    },
    /// The configuration is inconsistent (e.g. heads do not divide the hidden size).
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// A tensor is absent from every safetensors file.
    #[error("tensor {name} not found in {files}")]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The files searched.
        files: String,
    },
    /// A tensor has a different shape from the one the config implies.
    #[error("tensor {name} in {file}: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        /// The tensor name.
        name: String,
        /// The file holding it.
        file: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype the loader does not convert.
    #[error("tensor {name} in {file}: unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDtype {
        /// The tensor name.
        name: String,
        /// The file holding it.
        file: String,
        /// The dtype found.
        dtype: String,
    },
    /// A safetensors file is malformed.
    #[error("{file}: {message}")]
    Safetensors {
        /// The file.
        file: String,
        /// What the parser said.
        message: String,
    },
    /// The tokenizer failed to load, encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// A toggle name or value is not known.
    #[error("toggle {name}: {message}")]
    Toggle {
        /// The toggle name as given.
        name: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A request cannot be served as given (empty prompt, token out of vocabulary, too long, ...).
    #[error("{0}")]
    InvalidRequest(String),
    /// The scheduler's queue is full; retry later (the server answers 429).
    #[error("overloaded: {waiting} requests already waiting (limit {limit})")]
    Overloaded {
        /// Requests waiting when this one arrived.
        waiting: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The GPU backend could not start or failed (no driver, no device, a kernel that did not
    /// compile, a CUDA call that returned an error); the message says which and why.
    #[error("cuda: {0}")]
    Device(String),
    /// The scheduler has stopped (its thread ended).
    #[error("the engine scheduler has stopped")]
    SchedulerStopped,
    /// The prompt plus the requested output does not fit the model's context window.
    #[error("prompt of {prompt_tokens} tokens exceeds the context window of {context} tokens")]
    ContextOverflow {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// The model's context length.
        context: usize,
    },
}

/// The engine's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
