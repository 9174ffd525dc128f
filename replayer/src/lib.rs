//! tapedeck's replayer: re-runs recorded multi-turn sessions against a candidate (the in-process
//! engine with a toggle set, or any OpenAI-compatible server) and measures speed and fidelity.
//!
//! * [`session`]: the input model ([`Session`], [`Turn`]) and its loaders (JSONL
//!   `tapedeck.session.v1`, the recorder's SQLite database).
//! * [`target`]: the [`Target`] trait with [`EngineTarget`] and [`HttpTarget`], opened from a spec
//!   string by [`target::open`].
//! * [`history`]: what each turn sends (`recorded` or `self` history).
//! * [`run`]: the replay loop ([`replay`]), pacing (closed/open loop) and cancellation.
//! * [`metrics`]: pure speed and fidelity arithmetic (HDR histograms, drift, KL from top-k).
//! * [`report`]: the serializable [`RunSummary`].
//! * [`merge`]: merging run summaries (the shards of a replay split with `--shard i/n`), with the
//!   HDR histograms added so merged percentiles are exact.
//!
//! The CLI builds a [`ReplayJob`] and calls [`run_job`]; [`replay`] is the same loop over sessions
//! and a target already in hand. File formats: `replayer/FORMAT.md`.

pub mod error;
pub mod history;
pub mod merge;
pub mod metrics;
pub mod report;
pub mod run;
pub mod session;
pub mod stored;
pub mod target;

pub use error::{Error, Result};
pub use history::HistoryMode;
pub use merge::merge_runs;
pub use report::{Pacing, RunSummary, ThinkTime};
pub use run::{replay, run_job, summarize, ReplayConfig, ReplayJob, RunFacts};
pub use session::{parse_time, Session, SessionFilter, SessionSource, Shard, Turn};
pub use target::{EngineTarget, HttpTarget, Target, TargetOptions};
