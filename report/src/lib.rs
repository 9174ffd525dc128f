//! tapedeck's report, compare and bisect: what a release engineer reads and what CI acts on.
//!
//! All three work on [`RunSummary`](tapedeck_replayer::RunSummary) values written by a replay:
//! * [`render`]: one run as text, JSON (schema `tapedeck.report.v1`, see `report/SCHEMA.md`),
//!   Markdown, or one self-contained HTML page with SVG plots;
//! * [`compare`]: baseline vs candidate under a [`Policy`], with noise-aware latency verdicts and
//!   fidelity thresholds, as text, Markdown or JUnit XML, and an exit code for CI;
//! * [`bisect`]: delta debugging over toggle differences to name the change that breaks fidelity.
//!
//! The CLI is a thin layer over these functions; nothing here does I/O except
//! [`Policy::from_file`].

pub mod bisect;
pub mod compare;
pub mod error;
pub mod policy;
pub mod render;
pub mod stats;
pub mod table;

mod plots;

pub use bisect::{bisect, BisectOutcome, BisectResult, Evidence, ToggleChange};
pub use compare::{compare, Comparison, MetricRow, Verdict};
pub use error::{Error, Result};
pub use policy::Policy;
pub use render::{report, Format};
