//! tapedeck's session generator: opencode-shaped multi-turn agent sessions with planted needles,
//! written in the recorder's JSONL exchange format (`tapedeck.session.v1`).
//!
//! Why synthetic sessions: a replay needs long, tool-heavy, multi-turn conversations whose
//! expected answers are known. Real recordings have the shape but no ground truth; these have
//! both. Each session plants a fact (a needle) at a chosen absolute token position of the target
//! model's prompt, buries it under filler turns, and ends with a turn that asks for it; that
//! request carries a [`Probe`](tapedeck_recorder::sessions::Probe) the replayer checks. A model
//! build that silently loses context (a KV-cache bug at a block boundary, a dropped reasoning
//! block, a truncating proxy) fails the probe at a known depth.
//!
//! * [`generate`] builds sessions from a [`SynthConfig`]; [`write_jsonl`] / [`to_jsonl`] write
//!   them one per line. Same config and model files → same bytes.
//! * [`read_jsonl`] reads JSONL back, reporting bad lines with file, line and field path.
//! * Shapes and placement rules: see the `generate` module documentation.
//!
//! `tapedeck synth sessions --count N --turns A..B --context L1,L2 --seed S -o FILE.jsonl` is a
//! thin wrapper over [`generate`] and [`write_jsonl`].

pub mod config;
pub mod error;
pub mod fixtures;
mod generate;
pub mod measure;
pub mod opencode;
pub mod reader;
pub mod text;

use std::io::Write;
use std::path::Path;

pub use config::{NeedleSite, Placement, SynthConfig};
pub use error::{Error, Result};
pub use measure::Counter;
pub use opencode::ToolDetail;
pub use reader::{read_from, read_jsonl, LineError};
pub use tapedeck_recorder::sessions::SessionLine;

/// Generates `cfg.count` sessions, measuring needle depths with the tokenizer and chat template
/// of `cfg.model_dir`.
pub fn generate(cfg: &SynthConfig) -> Result<Vec<SessionLine>> {
    let counter = Counter::from_dir(&cfg.model_dir)?;
    generate_with(cfg, &counter)
}

/// [`generate`] with an already loaded counter (tests and batch tools reuse one).
pub fn generate_with(cfg: &SynthConfig, counter: &Counter) -> Result<Vec<SessionLine>> {
    if cfg.turns.is_empty() {
        return Err(Error::Config(format!(
            "empty turn range {}..{}",
            cfg.turns.start(),
            cfg.turns.end()
        )));
    }
    if cfg.align == Some(0) {
        return Err(Error::Config("align must be at least 1".into()));
    }
    (0..cfg.count)
        .map(|i| generate::session(cfg, counter, i))
        .collect()
}

/// Sessions as JSONL bytes: one compact JSON object per line, `\n`-terminated, fields in the
/// recorder's declaration order.
pub fn to_jsonl(sessions: &[SessionLine]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for s in sessions {
        serde_json::to_writer(&mut out, s).map_err(|source| Error::Serialize {
            session: s.session.id.clone(),
            source,
        })?;
        out.push(b'\n');
    }
    Ok(out)
}

/// Writes sessions as JSONL to `path` (created or truncated).
pub fn write_jsonl(path: &Path, sessions: &[SessionLine]) -> Result<()> {
    let bytes = to_jsonl(sessions)?;
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::create(path).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.flush().map_err(io)
}
