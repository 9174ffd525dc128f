//! The result of a replay: [`RunSummary`], serializable with stable field names.
//!
//! A run summary is self-contained: the target and its toggles, the settings, start and end, speed
//! aggregates (with the HDR histograms, so shards and runs merge), fidelity aggregates overall and
//! by absolute context position, and one row per turn grouped by session with the first turn that
//! diverged. `report`/`compare`/`bisect` read it; `--json FILE` writes it ([`write_json`]).
//!
//! Field names are part of the format `tapedeck.run.v1` (see `replayer/FORMAT.md`): add fields,
//! never rename them.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::history::HistoryMode;
use crate::metrics::{BucketDrift, DriftStats, RequestTiming, Slo, SpeedSummary};
use crate::session::{Shard, TurnKind};
use crate::target::TargetInfo;

/// The `format` of a run summary.
pub const RUN_FORMAT: &str = "tapedeck.run.v1";

/// How sessions were paced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Pacing {
    /// Closed loop: `concurrency` sessions in flight; a session's next turn goes as soon as its
    /// previous one finished (no think time), a new session starts when one ends.
    Closed {
        /// Sessions in flight.
        concurrency: usize,
    },
    /// Open loop: sessions start at random arrival times of `rate` sessions per second on
    /// average, regardless of how many are in flight. Gaps between arrivals are gamma distributed
    /// with shape `burstiness` and mean `1/rate` (vLLM's `--burstiness`): 1 is a Poisson process,
    /// below 1 arrivals come in bursts, above 1 they are more even. The first turn's latencies
    /// are measured from the session's intended start, so a slow server cannot hide its queueing
    /// (no coordinated omission).
    Open {
        /// Sessions per second.
        rate: f64,
        /// Seed of the arrival process.
        seed: u64,
        /// Gamma shape of the inter-arrival gaps; the squared coefficient of variation of a gap
        /// is `1/burstiness`. Absent in runs written before it existed, which were Poisson (1).
        #[serde(default = "poisson_burstiness")]
        burstiness: f64,
    },
    /// Recorded timing: each session starts at its recorded first arrival, as an offset from the
    /// earliest session's, divided by `speed` (2 replays twice as fast). Sessions with no
    /// recorded arrival start at offset 0. Like open loop, the first turn's latencies are
    /// measured from the intended start; later turns follow without think time.
    Recorded {
        /// Time compression: recorded offsets are divided by it (1 = as recorded).
        speed: f64,
    },
}

fn poisson_burstiness() -> f64 {
    1.0
}

/// Waiting between a session's turns, as a user (or agent) does between reading an answer and
/// sending the next request. Without it a replay sends every turn back to back, which overstates
/// the load per session and removes the idle gaps in which a server evicts or offloads a
/// session's KV cache — exactly where a "forgets earlier turns" bug hides.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum ThinkTime {
    /// The next turn is sent as soon as the previous answer is complete.
    #[default]
    None,
    /// The recorded gap: turn `k`'s recorded arrival minus the end of turn `k−1`'s recorded
    /// response (its arrival plus its recorded E2E). Unknown or negative gaps count as 0.
    Recorded,
    /// The recorded gap multiplied by `factor` (`scaled:0.5` halves every pause).
    Scaled {
        /// Multiplier of the recorded gap (finite, ≥ 0).
        factor: f64,
    },
}

impl ThinkTime {
    /// The multiplier applied to recorded gaps (0 for [`ThinkTime::None`]).
    pub fn factor(&self) -> f64 {
        match self {
            ThinkTime::None => 0.0,
            ThinkTime::Recorded => 1.0,
            ThinkTime::Scaled { factor } => *factor,
        }
    }
}

impl std::fmt::Display for ThinkTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ThinkTime::None => write!(f, "none"),
            ThinkTime::Recorded => write!(f, "recorded"),
            ThinkTime::Scaled { factor } => write!(f, "scaled:{factor}"),
        }
    }
}

impl std::str::FromStr for ThinkTime {
    type Err = Error;

    /// Parses `none`, `recorded` or `scaled:X` (X a finite number ≥ 0).
    fn from_str(s: &str) -> Result<ThinkTime> {
        let bad = |m: String| Error::Setting {
            name: "think-time",
            message: m,
        };
        match s.trim() {
            "none" => Ok(ThinkTime::None),
            "recorded" => Ok(ThinkTime::Recorded),
            other => {
                let x = other
                    .strip_prefix("scaled:")
                    .ok_or_else(|| bad(format!("{other:?} is not none, recorded or scaled:X")))?;
                let factor: f64 = x
                    .trim()
                    .parse()
                    .ok()
                    .filter(|f: &f64| f.is_finite() && *f >= 0.0)
                    .ok_or_else(|| bad(format!("{x:?} is not a finite factor >= 0")))?;
                Ok(ThinkTime::Scaled { factor })
            }
        }
    }
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing::Closed { concurrency: 1 }
    }
}

/// The settings a run used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// Pacing.
    pub pacing: Pacing,
    /// History mode.
    pub history: HistoryMode,
    /// Whether recorded outputs were scored under the candidate (teacher forcing).
    pub teacher_forcing: bool,
    /// Alternatives per logits summary.
    pub top_k: usize,
    /// Output-token cap applied to every turn, if any.
    pub max_tokens_cap: Option<usize>,
    /// Goodput SLOs.
    pub slo: Slo,
    /// |Δlogprob| above which a turn is flagged for drift (nats).
    pub drift_tolerance: f64,
    /// Think time between a session's turns (absent in older runs: none).
    #[serde(default)]
    pub think_time: ThinkTime,
    /// Upper bound on any one think time, milliseconds (`None`: unbounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_think_time_ms: Option<f64>,
    /// The part of the sessions this run replayed when the replay was split across machines
    /// (`--shard i/n`); `None` for a whole replay and for a merge of shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
}

/// Prompt-encoding fidelity of one turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptFidelity {
    /// Recorded prompt length.
    pub recorded_tokens: Option<usize>,
    /// Candidate prompt length.
    pub candidate_tokens: Option<usize>,
    /// First differing prompt token, when both ID lists are known.
    pub first_divergence: Option<usize>,
    /// Whether the prompts differ (by IDs when known, else by length).
    pub diverged: bool,
}

/// Free-running output fidelity of one turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OutputFidelity {
    /// `token_ids` when both ID lists were known, else `text` (characters of the answer).
    pub basis: String,
    /// Identical output.
    pub exact_match: bool,
    /// First divergent output token (or character, on a text basis).
    pub first_divergence: Option<usize>,
    /// Levenshtein distance / longer length.
    pub edit_distance: f64,
    /// Recorded output length (tokens or characters).
    pub recorded_len: usize,
    /// Candidate output length (tokens or characters).
    pub candidate_len: usize,
}

/// Teacher-forced drift of the recorded output under the candidate, for one turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnDrift {
    /// Whose prompt the recorded output was scored after: `candidate` (the candidate's own
    /// encoding, recorded history mode with prompt IDs) or `recorded`.
    pub scored_prompt: String,
    /// Aggregates over the turn's output positions.
    pub stats: DriftStats,
    /// First output index where the candidate's top-1 disagrees with the recording's.
    pub first_top1_disagreement: Option<usize>,
}

/// Everything measured for one turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnRow {
    /// Session.
    pub session_id: String,
    /// Index of the turn in the session.
    pub turn: usize,
    /// What the turn is for.
    pub kind: TurnKind,
    /// Error text, when the turn failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Error class ([`Error::kind`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<String>,
    /// Speed facts (from the intended send time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<RequestTiming>,
    /// Candidate finish reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// Prompt fidelity, when a recording exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<PromptFidelity>,
    /// Output fidelity, when a recording exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputFidelity>,
    /// Teacher-forced drift, when scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<TurnDrift>,
    /// Probe verdict, when the turn has a probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_passed: Option<bool>,
    /// Why the turn is flagged (`prompt_divergence`, `output_mismatch`, `drift`, `top1`,
    /// `probe_failed`); empty when it is not.
    #[serde(default)]
    pub flags: Vec<String>,
}

impl TurnRow {
    /// Whether anything about the turn is flagged.
    pub fn flagged(&self) -> bool {
        !self.flags.is_empty()
    }
}

/// One session's turns.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionRow {
    /// Session ID.
    pub id: String,
    /// Turns in the recording.
    pub turns_total: usize,
    /// Turns replayed (fewer when cancelled, or when `self` mode stopped after an error).
    pub turns: Vec<TurnRow>,
    /// The first flagged turn, if any.
    pub first_divergent_turn: Option<usize>,
    /// The run was cancelled before this session finished.
    pub cancelled: bool,
}

/// Fidelity aggregates of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FidelitySummary {
    /// Turns with a recording to compare against.
    pub compared_turns: usize,
    /// Turns whose prompt differed from the recording.
    pub prompt_divergent_turns: usize,
    /// Turns whose output matched the recording exactly.
    pub exact_match_turns: usize,
    /// Mean normalized edit distance of outputs.
    pub mean_edit_distance: f64,
    /// Turns scored by teacher forcing.
    pub scored_turns: usize,
    /// Teacher-forced drift over every scored position.
    pub drift: DriftStats,
    /// The same by absolute context position bucket (0–1k, 1–2k, 2–4k, 4–8k, 8–16k, 16k+).
    pub drift_by_bucket: Vec<BucketDrift>,
    /// Probes that passed.
    pub probes_passed: usize,
    /// Probes that failed.
    pub probes_failed: usize,
    /// Turns flagged.
    pub flagged_turns: usize,
    /// Flag counts by reason.
    pub flags: std::collections::BTreeMap<String, usize>,
}

/// One replay run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Always [`RUN_FORMAT`].
    pub format: String,
    /// The candidate.
    pub target: TargetInfo,
    /// Settings.
    pub settings: RunSettings,
    /// Start, µs since the Unix epoch.
    pub started_at_us: i64,
    /// End, µs since the Unix epoch.
    pub ended_at_us: i64,
    /// Whether the run was cancelled (results of finished turns are kept).
    pub cancelled: bool,
    /// Sessions loaded.
    pub sessions_total: usize,
    /// Sessions started.
    pub sessions_started: usize,
    /// Speed aggregates.
    pub speed: SpeedSummary,
    /// Fidelity aggregates.
    pub fidelity: FidelitySummary,
    /// Whether any turn was flagged: the verdict `compare` and CI start from.
    pub flagged: bool,
    /// Per-session, per-turn rows.
    pub sessions: Vec<SessionRow>,
    /// The runs this summary was merged from (`tapedeck replay merge`), in input order; empty
    /// for a run that was replayed directly.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_from: Vec<MergedPart>,
}

/// One input of a merged run: enough to see which shards went in and when each ran.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MergedPart {
    /// The part's shard, when it was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
    /// Its start, µs since the Unix epoch.
    pub started_at_us: i64,
    /// Its end, µs since the Unix epoch.
    pub ended_at_us: i64,
    /// Sessions it loaded.
    pub sessions_total: usize,
    /// Requests it completed.
    pub completed: u64,
    /// Whether it was cancelled.
    pub cancelled: bool,
}

/// Writes a run summary as pretty JSON.
pub fn write_json(path: &Path, run: &RunSummary) -> Result<()> {
    let text = serde_json::to_string_pretty(run).map_err(|source| Error::Json {
        context: "writing the run summary".into(),
        source,
    })?;
    std::fs::write(path, text).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a run summary written by [`write_json`].
pub fn read_json(path: &Path) -> Result<RunSummary> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        context: format!("reading {}", path.display()),
        source,
    })
}
