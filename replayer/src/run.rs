//! The replay loop: sessions turn by turn, many sessions at once, measured as they go.
//!
//! Each session runs its turns in order, pausing between them for its think time (none, the
//! recorded gap, or the recorded gap scaled, with an optional cap). Sessions are paced closed loop
//! (a fixed number in flight; a thinking session keeps its slot), open loop (gamma-distributed
//! arrivals — Poisson at burstiness 1 — with latency from the intended start) or at their recorded
//! arrival times scaled by a speed factor (latency from the intended start too).
//! Every turn is generated free-running, compared with its recording, and — when the recording
//! has output token IDs and summaries — its recorded output is scored under the candidate
//! (teacher forcing). Cancellation (`watch` channel set to `true`, e.g. on Ctrl-C) stops new
//! turns, abandons the ones in flight and returns everything that finished.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::stream::{FuturesUnordered, StreamExt};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::history::{self_history, Answered, HistoryMode};
use crate::metrics::{
    drift, drift_by_bucket, first_divergence, normalized_edit_distance, DriftStats, PositionDrift,
    RequestTiming, Slo, SpeedAccumulator,
};
use crate::report::{
    FidelitySummary, OutputFidelity, Pacing, PromptFidelity, RunSettings, RunSummary, SessionRow,
    ThinkTime, TurnDrift, TurnRow, RUN_FORMAT,
};
use crate::session::{Session, SessionFilter, SessionSource, Shard, Turn};
use crate::target::{GenOptions, Target, TargetOptions, TurnOutput};

/// Called after every finished turn (progress bars, live logs).
pub type ProgressFn = dyn Fn(&TurnRow) + Send + Sync;

/// How to replay.
#[derive(Clone)]
pub struct ReplayConfig {
    /// Pacing of sessions.
    pub pacing: Pacing,
    /// History mode.
    pub history: HistoryMode,
    /// Score recorded outputs under the candidate (teacher forcing).
    pub teacher_forcing: bool,
    /// Alternatives per logits summary.
    pub top_k: usize,
    /// Cap on output tokens of every turn (`None`: each request's own `max_tokens`).
    pub max_tokens_cap: Option<usize>,
    /// Goodput SLOs.
    pub slo: Slo,
    /// |Δlogprob| (nats) above which a turn is flagged for drift. A rerun of the reference is
    /// bit-exact (0), so the default only needs to sit above float noise.
    pub drift_tolerance: f64,
    /// Pause between a session's turns.
    pub think_time: ThinkTime,
    /// Cap on any one pause (`None`: unbounded).
    pub max_think_time: Option<Duration>,
    /// Which shard of the sessions this run replays, recorded in the run settings so that
    /// `tapedeck replay merge` can check it is given each shard once. Selecting the shard's
    /// sessions is the [`SessionFilter`]'s job ([`ReplayJob`] copies its shard here).
    pub shard: Option<Shard>,
    /// Called after each turn.
    pub progress: Option<Arc<ProgressFn>>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            pacing: Pacing::default(),
            history: HistoryMode::Recorded,
            teacher_forcing: true,
            top_k: tapedeck_engine::generate::DEFAULT_SUMMARY_K,
            max_tokens_cap: None,
            slo: Slo::default(),
            drift_tolerance: 1e-4,
            think_time: ThinkTime::None,
            max_think_time: None,
            shard: None,
            progress: None,
        }
    }
}

impl std::fmt::Debug for ReplayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayConfig")
            .field("pacing", &self.pacing)
            .field("history", &self.history)
            .field("teacher_forcing", &self.teacher_forcing)
            .field("top_k", &self.top_k)
            .field("max_tokens_cap", &self.max_tokens_cap)
            .field("slo", &self.slo)
            .field("drift_tolerance", &self.drift_tolerance)
            .field("think_time", &self.think_time)
            .field("max_think_time", &self.max_think_time)
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl ReplayConfig {
    fn settings(&self) -> RunSettings {
        RunSettings {
            pacing: self.pacing,
            history: self.history,
            teacher_forcing: self.teacher_forcing,
            top_k: self.top_k,
            max_tokens_cap: self.max_tokens_cap,
            slo: self.slo,
            drift_tolerance: self.drift_tolerance,
            think_time: self.think_time,
            max_think_time_ms: self.max_think_time.map(|d| d.as_secs_f64() * 1000.0),
            shard: self.shard,
        }
    }

    fn check(&self) -> Result<()> {
        if let ThinkTime::Scaled { factor } = self.think_time {
            if !(factor.is_finite() && factor >= 0.0) {
                return Err(Error::Setting {
                    name: "think-time",
                    message: format!("scaled:{factor}: the factor must be finite and >= 0"),
                });
            }
        }
        if let Some(sh) = self.shard {
            Shard::new(sh.index, sh.count)?;
        }
        match self.pacing {
            Pacing::Closed { concurrency: 0 } => Err(Error::Setting {
                name: "concurrency",
                message: "must be at least 1".into(),
            }),
            Pacing::Open { rate, .. } if !(rate.is_finite() && rate > 0.0) => Err(Error::Setting {
                name: "rate",
                message: format!("{rate} is not a positive number of sessions per second"),
            }),
            Pacing::Open { burstiness, .. } if !(burstiness.is_finite() && burstiness > 0.0) => {
                Err(Error::Setting {
                    name: "burstiness",
                    message: format!("{burstiness} is not a positive gamma shape"),
                })
            }
            Pacing::Recorded { speed } if !(speed.is_finite() && speed > 0.0) => {
                Err(Error::Setting {
                    name: "speed",
                    message: format!("{speed} is not a positive time compression factor"),
                })
            }
            _ => Ok(()),
        }
    }
}

/// Start offsets of sessions replayed at their recorded times: each session's first recorded
/// arrival minus the earliest one, divided by `speed`. A session without a recorded arrival gets
/// offset 0 (it starts at once).
pub fn recorded_offsets(sessions: &[Session], speed: f64) -> Vec<Duration> {
    let firsts: Vec<Option<i64>> = sessions.iter().map(Session::first_arrival_us).collect();
    let Some(t0) = firsts.iter().flatten().min().copied() else {
        return vec![Duration::ZERO; sessions.len()];
    };
    firsts
        .into_iter()
        .map(|t| match t {
            Some(t) => {
                let us = u64::try_from(t.saturating_sub(t0)).unwrap_or(0) as f64;
                Duration::from_secs_f64(us / speed / 1e6)
            }
            None => Duration::ZERO,
        })
        .collect()
}

/// Start offsets of `n` sessions arriving as a Poisson process of `rate` per second: exponential
/// gaps with mean `1/rate`, drawn from a seeded ChaCha stream so a rerun uses the same schedule.
pub fn poisson_offsets(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            // 1 − U is in (0, 1], so the logarithm is finite.
            let u: f64 = 1.0 - rng.random::<f64>();
            t += -u.ln() / rate;
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Start offsets of `n` sessions whose inter-arrival gaps are gamma distributed with shape
/// `burstiness` and scale `1/(rate·burstiness)` — mean `1/rate` whatever the shape, variance
/// `1/(rate²·burstiness)` — as vLLM's `benchmark_serving --burstiness` draws them. Shape 1 is the
/// exponential, and then the schedule is exactly [`poisson_offsets`]'s (so runs recorded before
/// burstiness existed replay the same arrivals from their seed).
pub fn arrival_offsets(n: usize, rate: f64, burstiness: f64, seed: u64) -> Result<Vec<Duration>> {
    if !(rate.is_finite() && rate > 0.0) {
        return Err(Error::Setting {
            name: "rate",
            message: format!("{rate} is not a positive number of sessions per second"),
        });
    }
    if burstiness == 1.0 {
        return Ok(poisson_offsets(n, rate, seed));
    }
    let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness)).map_err(|e| Error::Setting {
        name: "burstiness",
        message: format!("{burstiness}: {e}"),
    })?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0f64;
    Ok((0..n)
        .map(|_| {
            t += gamma.sample(&mut rng);
            Duration::from_secs_f64(t)
        })
        .collect())
}

/// The recorded think time before `next`: its recorded arrival minus the end of `prev`'s recorded
/// response (`prev` arrival + recorded E2E), in µs. `None` when a time is missing; 0 when the next
/// request arrived before the previous answer ended (a client that does not wait, e.g. a title
/// request sent alongside the agent turn).
pub fn recorded_gap_us(prev: &Turn, next: &Turn) -> Option<u64> {
    let prev_end = prev
        .arrival_us?
        .saturating_add(i64::try_from(prev.recorded.as_ref()?.e2e_us?).ok()?);
    Some(u64::try_from(next.arrival_us?.saturating_sub(prev_end)).unwrap_or(0))
}

/// The pause before each turn of `session` under `mode`, capped at `max`: element `k` is waited
/// after turn `k−1`'s answer ends and before turn `k` is sent (element 0 is always zero: a
/// session's start is the pacing's business). A gap that cannot be derived counts as zero, so
/// missing data never slows a replay down.
pub fn think_times(session: &Session, mode: ThinkTime, max: Option<Duration>) -> Vec<Duration> {
    let factor = mode.factor();
    let mut out = Vec::with_capacity(session.turns.len());
    for k in 0..session.turns.len() {
        let gap_us = match k {
            0 => 0,
            _ if factor == 0.0 => 0,
            _ => recorded_gap_us(&session.turns[k - 1], &session.turns[k]).unwrap_or(0),
        };
        let mut d = Duration::from_secs_f64(gap_us as f64 * factor / 1e6);
        if let Some(m) = max {
            d = d.min(m);
        }
        out.push(d);
    }
    out
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Speed facts of one output relative to `intended` (the send time, or the scheduled time of an
/// open-loop session's first turn).
pub fn timing_from(out: &TurnOutput, intended: Instant) -> RequestTiming {
    let since = |t: Instant| micros(t.saturating_duration_since(intended));
    let c = &out.clock;
    RequestTiming {
        ttft_us: c.tokens.first().map(|&t| since(t)),
        itl_us: c
            .tokens
            .windows(2)
            .map(|w| micros(w[1].saturating_duration_since(w[0])))
            .collect(),
        e2e_us: since(c.end),
        input_tokens: out.prompt_tokens.unwrap_or(0),
        output_tokens: out.output_tokens,
    }
}

/// Resolves when the token becomes `true`; never when the sender is gone without cancelling.
async fn cancelled(mut rx: watch::Receiver<bool>) {
    if rx.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What one finished turn contributes.
struct TurnResult {
    row: TurnRow,
    timing: Option<RequestTiming>,
    positions: Vec<PositionDrift>,
    answer: Option<tapedeck_engine::ChatMessage>,
    output_mismatch: bool,
}

/// Compares a candidate output with the recording and, when possible, scores the recorded output.
async fn evaluate(
    target: &dyn Target,
    cfg: &ReplayConfig,
    turn: &Turn,
    out: &TurnOutput,
    self_mode_after_mismatch: bool,
) -> (TurnRow, Vec<PositionDrift>, bool) {
    let mut row = TurnRow {
        kind: turn.kind,
        finish_reason: out.finish_reason.clone(),
        ..TurnRow::default()
    };
    let mut positions = Vec::new();
    let mut mismatch = false;
    if let Some(rec) = &turn.recorded {
        // Prompt.
        let prompt = match (&rec.prompt_ids, &out.prompt_ids) {
            (Some(r), Some(c)) => {
                let d = first_divergence(r, c);
                PromptFidelity {
                    recorded_tokens: Some(r.len()),
                    candidate_tokens: Some(c.len()),
                    first_divergence: d,
                    diverged: d.is_some(),
                }
            }
            (r, _) => {
                let rl = r.as_ref().map(Vec::len);
                PromptFidelity {
                    recorded_tokens: rl,
                    candidate_tokens: out.prompt_tokens,
                    first_divergence: None,
                    diverged: matches!((rl, out.prompt_tokens), (Some(a), Some(b)) if a != b),
                }
            }
        };
        // In self mode a prompt legitimately differs once an earlier answer differed.
        if prompt.diverged && !self_mode_after_mismatch {
            row.flags.push("prompt_divergence".into());
        }
        row.prompt = Some(prompt);
        // Free-running output.
        let output = match (&rec.output_ids, &out.output_ids) {
            (Some(r), Some(c)) => OutputFidelity {
                basis: "token_ids".into(),
                exact_match: r == c,
                first_divergence: first_divergence(r, c),
                edit_distance: normalized_edit_distance(r, c),
                recorded_len: r.len(),
                candidate_len: c.len(),
            },
            _ => {
                let r: Vec<char> = rec
                    .message
                    .as_ref()
                    .map(|m| m.text())
                    .unwrap_or_else(|| rec.output_text.clone())
                    .chars()
                    .collect();
                let c: Vec<char> = out.message.text().chars().collect();
                OutputFidelity {
                    basis: "text".into(),
                    exact_match: r == c,
                    first_divergence: first_divergence(&r, &c),
                    edit_distance: normalized_edit_distance(&r, &c),
                    recorded_len: r.len(),
                    candidate_len: c.len(),
                }
            }
        };
        mismatch = !output.exact_match;
        // Only a deterministic recording (greedy, or a fixed seed) must reproduce exactly.
        let deterministic = turn.request.temperature == Some(0.0) || turn.request.seed.is_some();
        if mismatch && deterministic && !self_mode_after_mismatch {
            row.flags.push("output_mismatch".into());
        }
        row.output = Some(output);
        // Teacher forcing.
        let scored_prompt = match (cfg.history, &out.prompt_ids) {
            (HistoryMode::Recorded, Some(c)) => Some(("candidate", c.clone())),
            _ => rec.prompt_ids.clone().map(|r| ("recorded", r)),
        };
        if let (true, Some((whose, prompt_ids)), Some(output_ids)) =
            (cfg.teacher_forcing, scored_prompt, &rec.output_ids)
        {
            if !output_ids.is_empty() && rec.summaries.len() == output_ids.len() {
                match target
                    .score(prompt_ids.clone(), output_ids.clone(), cfg.top_k)
                    .await
                {
                    Ok(cand) => {
                        positions = drift(prompt_ids.len(), &rec.summaries, &cand);
                        let stats = DriftStats::of(&positions);
                        if stats.abs_dlogprob.max > cfg.drift_tolerance {
                            row.flags.push("drift".into());
                        }
                        if stats.top1_agreement < 1.0 {
                            row.flags.push("top1".into());
                        }
                        row.drift = Some(TurnDrift {
                            scored_prompt: whose.into(),
                            first_top1_disagreement: positions.iter().position(|p| !p.top1_agree),
                            stats,
                        });
                    }
                    Err(e) => {
                        row.error_kind = Some(format!("score_{}", e.kind()));
                        row.error = Some(format!("scoring: {e}"));
                    }
                }
            }
        }
    }
    if let Some(p) = &turn.probe {
        let passed = p.passes(&out.text) || p.passes(&out.message.text());
        if !passed {
            row.flags.push("probe_failed".into());
        }
        row.probe_passed = Some(passed);
    }
    (row, positions, mismatch)
}

/// Replays one session; returns its row and per-turn contributions.
async fn run_session(
    session: Session,
    target: Arc<dyn Target>,
    cfg: ReplayConfig,
    intended_start: Instant,
    cancel: watch::Receiver<bool>,
) -> (SessionRow, Vec<TurnResult>) {
    let gen = GenOptions {
        top_k: cfg.top_k,
        max_tokens_cap: cfg.max_tokens_cap,
        session_id: Some(session.id.clone()),
    };
    let mut results: Vec<TurnResult> = Vec::new();
    let mut answers: Vec<(usize, tapedeck_engine::ChatMessage)> = Vec::new();
    let pauses = think_times(&session, cfg.think_time, cfg.max_think_time);
    let mut intended = intended_start;
    let mut was_cancelled = false;
    let mut any_mismatch = false;
    // When the previous answer ended (the think time counts from there).
    let mut last_end: Option<Instant> = None;
    for (k, turn) in session.turns.iter().enumerate() {
        if *cancel.borrow() {
            was_cancelled = true;
            break;
        }
        if let Some(end) = last_end {
            // The next request is due `pause` after the answer ended. Time the replayer itself
            // spent after the answer (teacher-forced scoring) overlaps the pause; if it ran
            // past the due time, latency counts from when the replayer was ready, so its own
            // work is never charged to the target.
            let ready = Instant::now();
            let due = end + pauses[k];
            if due > ready {
                let slept = tokio::select! {
                    _ = tokio::time::sleep_until(due.into()) => true,
                    _ = cancelled(cancel.clone()) => false,
                };
                if !slept {
                    was_cancelled = true;
                    break;
                }
            }
            intended = due.max(ready);
        }
        let mut request = turn.request.clone();
        if cfg.history == HistoryMode::SelfFed {
            let earlier: Vec<Answered<'_>> = answers
                .iter()
                .map(|(j, a)| Answered {
                    recorded_messages: &session.turns[*j].request.messages,
                    answer: a,
                })
                .collect();
            request.messages = self_history(&turn.request.messages, &earlier);
        }
        let chat = target.chat(request, gen.clone());
        let outcome = tokio::select! {
            r = chat => Some(r),
            _ = cancelled(cancel.clone()) => None,
        };
        let Some(outcome) = outcome else {
            was_cancelled = true;
            break;
        };
        let after_mismatch = cfg.history == HistoryMode::SelfFed && any_mismatch;
        last_end = Some(match &outcome {
            Ok(out) => out.clock.end,
            Err(_) => Instant::now(),
        });
        let result = match outcome {
            Ok(out) => {
                let timing = timing_from(&out, intended);
                let eval = evaluate(target.as_ref(), &cfg, turn, &out, after_mismatch);
                let (mut row, positions, mismatch) = tokio::select! {
                    r = eval => r,
                    _ = cancelled(cancel.clone()) => {
                        was_cancelled = true;
                        break;
                    }
                };
                row.timing = Some(timing.clone());
                TurnResult {
                    row,
                    timing: Some(timing),
                    positions,
                    answer: Some(out.message),
                    output_mismatch: mismatch,
                }
            }
            Err(e) => TurnResult {
                row: TurnRow {
                    kind: turn.kind,
                    error_kind: Some(e.kind()),
                    error: Some(e.to_string()),
                    ..TurnRow::default()
                },
                timing: None,
                positions: Vec::new(),
                answer: None,
                output_mismatch: false,
            },
        };
        let mut result = result;
        result.row.session_id = session.id.clone();
        result.row.turn = k;
        any_mismatch |= result.output_mismatch;
        if let Some(p) = &cfg.progress {
            p(&result.row);
        }
        let failed = result.timing.is_none();
        if let Some(a) = result.answer.take() {
            answers.push((k, a));
        }
        results.push(result);
        // Without the candidate's answer the agent's conversation cannot continue in self mode.
        if failed && cfg.history == HistoryMode::SelfFed {
            break;
        }
    }
    let row = SessionRow {
        id: session.id.clone(),
        turns_total: session.turns.len(),
        turns: results.iter().map(|r| r.row.clone()).collect(),
        first_divergent_turn: results.iter().find(|r| r.row.flagged()).map(|r| r.row.turn),
        cancelled: was_cancelled,
    };
    (row, results)
}

/// Replays `sessions` against `target` and returns the run summary.
///
/// This is the library entry point of `tapedeck replay`. Setting `cancel` to `true` stops the run
/// early; the summary then holds every turn that finished and `cancelled: true`. Only invalid
/// settings are errors: a failing turn is recorded in its row and counted by kind.
pub async fn replay(
    sessions: Vec<Session>,
    target: Arc<dyn Target>,
    cfg: &ReplayConfig,
    cancel: watch::Receiver<bool>,
) -> Result<RunSummary> {
    cfg.check()?;
    let started_at_us = now_us();
    let start = Instant::now();
    let total = sessions.len();
    let mut done: Vec<(usize, SessionRow, Vec<TurnResult>)> = Vec::with_capacity(total);
    let mut started = 0usize;
    match cfg.pacing {
        Pacing::Closed { concurrency } => {
            let mut pending = sessions.into_iter().enumerate();
            let mut running = FuturesUnordered::new();
            loop {
                while running.len() < concurrency && !*cancel.borrow() {
                    let Some((i, s)) = pending.next() else { break };
                    started += 1;
                    let (t, c, rx) = (target.clone(), cfg.clone(), cancel.clone());
                    running.push(async move {
                        let (row, res) = run_session(s, t, c, Instant::now(), rx).await;
                        (i, row, res)
                    });
                }
                match running.next().await {
                    Some(r) => done.push(r),
                    None => break,
                }
            }
        }
        pacing @ (Pacing::Open { .. } | Pacing::Recorded { .. }) => {
            let offsets = match pacing {
                Pacing::Recorded { speed } => recorded_offsets(&sessions, speed),
                Pacing::Open {
                    rate,
                    seed,
                    burstiness,
                } => arrival_offsets(total, rate, burstiness, seed)?,
                Pacing::Closed { .. } => unreachable!("closed loop is handled above"),
            };
            let mut running = FuturesUnordered::new();
            for ((i, s), off) in sessions.into_iter().enumerate().zip(offsets) {
                let (t, c, rx) = (target.clone(), cfg.clone(), cancel.clone());
                let due = start + off;
                running.push(async move {
                    let wait = tokio::select! {
                        _ = tokio::time::sleep_until(due.into()) => true,
                        _ = cancelled(rx.clone()) => false,
                    };
                    if !wait {
                        return None;
                    }
                    let (row, res) = run_session(s, t, c, due, rx).await;
                    Some((i, row, res))
                });
            }
            while let Some(r) = running.next().await {
                if let Some(r) = r {
                    started += 1;
                    done.push(r);
                }
            }
        }
    }
    let duration = start.elapsed();
    done.sort_by_key(|(i, _, _)| *i);
    let mut positions = Vec::new();
    let mut rows = Vec::with_capacity(done.len());
    for (_, row, results) in done {
        for r in results {
            positions.extend(r.positions);
        }
        rows.push(row);
    }
    summarize(RunFacts {
        target: target.info(),
        settings: cfg.settings(),
        started_at_us,
        duration,
        cancelled: *cancel.borrow(),
        sessions_total: total,
        sessions_started: started,
        sessions: rows,
        positions,
    })
}

/// Everything `tapedeck replay` asks for: where sessions come from, which target, how to replay,
/// and where to write the summary.
#[derive(Debug, Clone)]
pub struct ReplayJob {
    /// Sessions: a `tapedeck.session.v1` JSONL file or a recording database.
    pub sessions: SessionSource,
    /// Which sessions.
    pub filter: SessionFilter,
    /// Target spec: `engine:DIR?toggles` or an `http(s)://` base URL.
    pub target: String,
    /// How to open the target (model-name resolver, threads, scheduler limits).
    pub target_options: TargetOptions,
    /// How to replay.
    pub config: ReplayConfig,
    /// Write the run summary here as JSON (also written when the run was cancelled).
    pub json: Option<PathBuf>,
}

/// Loads sessions, opens the target, replays and writes the summary: the whole of
/// `tapedeck replay`. Model loading runs on a blocking thread so the runtime stays responsive
/// (Ctrl-C is honoured while a large model loads only once the load returns).
pub async fn run_job(job: &ReplayJob, cancel: watch::Receiver<bool>) -> Result<RunSummary> {
    let sessions = job.sessions.load(&job.filter).await?;
    let (spec, opts) = (job.target.clone(), job.target_options.clone());
    let target = tokio::task::spawn_blocking(move || crate::target::open(&spec, &opts))
        .await
        .map_err(|e| Error::Generation(format!("target loading task failed: {e}")))??;
    let mut config = job.config.clone();
    config.shard = config.shard.or(job.filter.shard);
    let summary = replay(sessions, target, &config, cancel).await?;
    if let Some(path) = &job.json {
        crate::report::write_json(path, &summary)?;
    }
    Ok(summary)
}

/// The raw facts of a run that [`summarize`] turns into a [`RunSummary`]: the per-turn rows
/// (grouped by session, each successful turn with its timing) and every teacher-forced position.
/// Public so that a summary can be rebuilt from rows — and so tests can check aggregation (e.g.
/// that merged shards equal one run) on hand-made turns.
#[derive(Debug, Clone)]
pub struct RunFacts {
    /// The candidate.
    pub target: crate::target::TargetInfo,
    /// The settings the run used (SLOs are read from here).
    pub settings: RunSettings,
    /// Start, µs since the Unix epoch.
    pub started_at_us: i64,
    /// Wall-clock duration rates are computed over.
    pub duration: Duration,
    /// Whether the run was cancelled.
    pub cancelled: bool,
    /// Sessions loaded.
    pub sessions_total: usize,
    /// Sessions started.
    pub sessions_started: usize,
    /// One row per session, its turns inside.
    pub sessions: Vec<SessionRow>,
    /// Every teacher-forced position of every turn (for run-level drift and its buckets).
    pub positions: Vec<PositionDrift>,
}

/// Aggregates a run's facts: speed from each turn's timing (a turn without timing is a failure
/// of its `error_kind`), fidelity from each row, drift from the positions.
pub fn summarize(facts: RunFacts) -> Result<RunSummary> {
    let RunFacts {
        target,
        settings,
        started_at_us,
        duration,
        cancelled,
        sessions_total,
        sessions_started,
        sessions,
        positions,
    } = facts;
    let mut speed = SpeedAccumulator::default();
    let mut fid = FidelitySummary::default();
    let mut edit_sum = 0.0;
    for srow in &sessions {
        for row in &srow.turns {
            match (&row.timing, &row.error_kind) {
                (Some(t), _) => speed.success(t, &settings.slo),
                (None, Some(kind)) => speed.failure(kind),
                (None, None) => speed.failure("unknown"),
            }
            if let Some(o) = &row.output {
                fid.compared_turns += 1;
                fid.exact_match_turns += usize::from(o.exact_match);
                edit_sum += o.edit_distance;
            }
            if row.prompt.as_ref().is_some_and(|p| p.diverged) {
                fid.prompt_divergent_turns += 1;
            }
            if row.drift.is_some() {
                fid.scored_turns += 1;
            }
            match row.probe_passed {
                Some(true) => fid.probes_passed += 1,
                Some(false) => fid.probes_failed += 1,
                None => {}
            }
            if row.flagged() {
                fid.flagged_turns += 1;
            }
            for f in &row.flags {
                *fid.flags.entry(f.clone()).or_default() += 1;
            }
        }
    }
    if fid.compared_turns > 0 {
        fid.mean_edit_distance = edit_sum / fid.compared_turns as f64;
    }
    fid.drift = DriftStats::of(&positions);
    fid.drift_by_bucket = drift_by_bucket(&positions);
    let ended_at_us = started_at_us.saturating_add(i64::try_from(micros(duration)).unwrap_or(0));
    Ok(RunSummary {
        format: RUN_FORMAT.into(),
        target,
        settings,
        started_at_us,
        ended_at_us,
        cancelled,
        sessions_total,
        sessions_started,
        speed: speed.summary(duration.as_secs_f64())?,
        flagged: fid.flagged_turns > 0,
        fidelity: fid,
        sessions,
        merged_from: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{ChatRequest, Recorded};

    fn turn(arrival_us: Option<i64>, e2e_us: Option<u64>) -> Turn {
        Turn {
            kind: Default::default(),
            request: ChatRequest::default(),
            recorded: Some(Recorded {
                e2e_us,
                ..Recorded::default()
            }),
            probe: None,
            arrival_us,
        }
    }

    #[test]
    fn think_time_arithmetic() {
        let ms = Duration::from_millis;
        // Turn 0 at 0 s answered in 0.2 s; turn 1 at 1.0 s (thought 0.8 s) answered in 0.6 s;
        // turn 2 at 1.5 s, before turn 1's answer ended (gap −0.1 s → 0); turn 3's predecessor
        // has no recorded E2E (unknown → 0); turn 4 at 3.0 s after turn 3 at 2.0 s + 0.25 s.
        let s = Session::new(
            "s",
            vec![
                turn(Some(0), Some(200_000)),
                turn(Some(1_000_000), Some(600_000)),
                turn(Some(1_500_000), None),
                turn(Some(2_000_000), Some(250_000)),
                turn(Some(3_000_000), Some(1)),
                turn(None, None),
            ],
        );
        assert_eq!(recorded_gap_us(&s.turns[0], &s.turns[1]), Some(800_000));
        assert_eq!(recorded_gap_us(&s.turns[1], &s.turns[2]), Some(0));
        assert_eq!(recorded_gap_us(&s.turns[2], &s.turns[3]), None);
        assert_eq!(recorded_gap_us(&s.turns[4], &s.turns[5]), None);
        let z = Duration::ZERO;
        assert_eq!(
            think_times(&s, ThinkTime::Recorded, None),
            [z, ms(800), z, z, ms(750), z]
        );
        assert_eq!(
            think_times(&s, ThinkTime::Scaled { factor: 0.5 }, None),
            [z, ms(400), z, z, Duration::from_micros(375_000), z]
        );
        assert_eq!(
            think_times(&s, ThinkTime::Scaled { factor: 3.0 }, Some(ms(1000))),
            [z, ms(1000), z, z, ms(1000), z],
            "clamped by the maximum"
        );
        assert_eq!(
            think_times(&s, ThinkTime::Recorded, Some(ms(500))),
            [z, ms(500), z, z, ms(500), z]
        );
        assert_eq!(think_times(&s, ThinkTime::None, None), [z; 6]);
        assert!(think_times(&Session::new("e", vec![]), ThinkTime::Recorded, None).is_empty());
        assert_eq!(
            "scaled:2.5".parse::<ThinkTime>().unwrap(),
            ThinkTime::Scaled { factor: 2.5 }
        );
        assert_eq!(
            "recorded".parse::<ThinkTime>().unwrap(),
            ThinkTime::Recorded
        );
        assert_eq!("none".parse::<ThinkTime>().unwrap(), ThinkTime::None);
        for bad in ["scaled:-1", "scaled:inf", "scaled:", "fast", "scaled:x"] {
            assert!(bad.parse::<ThinkTime>().is_err(), "{bad}");
        }
    }

    /// Mean and squared coefficient of variation of the gaps of an arrival schedule.
    fn gap_moments(offs: &[Duration]) -> (f64, f64) {
        let gaps: Vec<f64> = std::iter::once(offs[0].as_secs_f64())
            .chain(offs.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()))
            .collect();
        let n = gaps.len() as f64;
        let mean = gaps.iter().sum::<f64>() / n;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (mean, var / (mean * mean))
    }

    #[test]
    fn gamma_arrivals_keep_the_mean_and_set_the_variance() {
        let (n, rate) = (20_000, 50.0);
        let mut cv2s = Vec::new();
        for b in [0.25, 0.5, 1.0, 2.0, 8.0] {
            let offs = arrival_offsets(n, rate, b, 42).unwrap();
            assert!(offs.windows(2).all(|w| w[0] <= w[1]), "non-decreasing");
            let (mean, cv2) = gap_moments(&offs);
            // Mean gap 1/rate whatever the shape. Its relative standard error is
            // sqrt(1/(b·n)) ≤ 1.4% here; allow 6%.
            assert!((mean * rate - 1.0).abs() < 0.06, "b={b}: mean gap {mean}");
            // Squared CV of a gamma gap is 1/shape. The sample variance's relative standard
            // error is about sqrt((2 + 6/b)/n) ≤ 3.6%; allow 20%.
            assert!(
                (cv2 * b - 1.0).abs() < 0.2,
                "b={b}: cv² {cv2}, want {}",
                1.0 / b
            );
            cv2s.push(cv2);
            assert_eq!(offs, arrival_offsets(n, rate, b, 42).unwrap(), "seeded");
        }
        assert!(
            cv2s.windows(2).all(|w| w[0] > w[1]),
            "burstier means more variable: {cv2s:?}"
        );
        assert_eq!(
            arrival_offsets(100, rate, 1.0, 9).unwrap(),
            poisson_offsets(100, rate, 9),
            "burstiness 1 is the Poisson schedule"
        );
        assert!(arrival_offsets(3, rate, 0.0, 1).is_err());
        assert!(arrival_offsets(3, rate, f64::NAN, 1).is_err());
        assert!(arrival_offsets(3, 0.0, 1.0, 1).is_err());
    }

    #[test]
    fn poisson_mean_rate() {
        let n = 20_000;
        let rate = 50.0;
        let offs = poisson_offsets(n, rate, 42);
        assert!(offs.windows(2).all(|w| w[0] <= w[1]), "non-decreasing");
        let observed = n as f64 / offs[n - 1].as_secs_f64();
        // The rate estimate's relative standard error is 1/sqrt(n) ≈ 0.7%; allow 5%.
        assert!((observed - rate).abs() / rate < 0.05, "{observed}");
        // Exponential gaps: the coefficient of variation is 1.
        let gaps: Vec<f64> = std::iter::once(offs[0].as_secs_f64())
            .chain(offs.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()))
            .collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        assert!((sd / mean - 1.0).abs() < 0.05, "cv {}", sd / mean);
        assert_eq!(offs, poisson_offsets(n, rate, 42), "seeded");
        assert_ne!(offs, poisson_offsets(n, rate, 43));
    }
}
