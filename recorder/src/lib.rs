//! tapedeck's recorder: an OpenAI-compatible HTTP front end that records every request it serves.
//!
//! * [`server`]: the axum app (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
//!   `/metrics`) and [`server::serve`], which the `tapedeck serve` command calls.
//! * [`backend`]: what the server generates with, behind one trait: [`EngineBackend`] (the
//!   in-process engine, one generation at a time), [`SchedulerBackend`] (the engine's
//!   continuous-batching scheduler with its prefix cache), [`upstream::UpstreamBackend`] (any
//!   OpenAI-compatible server, proxied and recorded: `tapedeck serve --upstream URL`).
//! * [`store`], [`writer`], [`blob`]: the SQLite database, the off-request-path batched writer,
//!   and the binary encoding of per-token columns.
//! * [`stitch`]: how requests are grouped into multi-turn sessions and classified.
//! * [`sessions`]: list, show, export and import sessions (JSONL, `tapedeck.session.v1`).
//!
//! Formats are described in `recorder/FORMAT.md`.

pub mod backend;
pub mod blob;
pub mod error;
pub mod record;
pub mod server;
pub mod sessions;
pub mod stitch;
pub mod store;
pub mod upstream;
pub mod writer;

pub use backend::{Backend, EngineBackend, SchedulerBackend};
pub use error::{Error, Result};
pub use record::{RequestKind, RequestRecord};
pub use server::{serve, ServeConfig};
pub use store::Store;
pub use writer::{QueuePolicy, RecordWriter, WriterConfig};
