//! Hand-made run summaries for the tests: every number is chosen here, nothing is replayed.

#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tapedeck_replayer::metrics::{
    drift_by_bucket, DriftStats, PositionDrift, RequestTiming, SpeedAccumulator,
};
use tapedeck_replayer::report::{
    OutputFidelity, PromptFidelity, RunSummary, SessionRow, TurnDrift, TurnRow, RUN_FORMAT,
};
use tapedeck_replayer::target::TargetInfo;

/// One turn's speed and fidelity knobs.
#[derive(Clone, Debug)]
pub struct TurnSpec {
    pub ttft_ms: f64,
    pub itl_ms: f64,
    pub tokens: usize,
    pub prompt_tokens: usize,
    pub prompt_diverged: bool,
    pub exact: bool,
    pub probe: Option<bool>,
    /// Per-position |Δlogprob| and KL of the turn's output.
    pub dlp: f64,
    pub kl: f64,
    pub top1: bool,
    pub error: bool,
}

impl Default for TurnSpec {
    fn default() -> Self {
        TurnSpec {
            ttft_ms: 100.0,
            itl_ms: 20.0,
            tokens: 8,
            prompt_tokens: 300,
            prompt_diverged: false,
            exact: true,
            probe: None,
            dlp: 0.001,
            kl: 0.0005,
            top1: true,
            error: false,
        }
    }
}

/// Builds a consistent run: rows, then speed and fidelity aggregates computed from them the way
/// the replayer does.
pub fn run(spec: &str, toggles: &str, sessions: &[(String, Vec<TurnSpec>)]) -> RunSummary {
    let mut acc = SpeedAccumulator::default();
    let slo = Default::default();
    let mut points = Vec::new();
    let mut rows = Vec::new();
    let mut fid = tapedeck_replayer::report::FidelitySummary::default();
    let mut total_e2e = 0.0;
    for (id, turns) in sessions {
        let mut srow = SessionRow {
            id: id.clone(),
            turns_total: turns.len(),
            ..SessionRow::default()
        };
        let mut prompt_len = 0;
        for (k, t) in turns.iter().enumerate() {
            prompt_len += t.prompt_tokens;
            let mut row = TurnRow {
                session_id: id.clone(),
                turn: k,
                ..TurnRow::default()
            };
            if t.error {
                row.error = Some("connection reset".into());
                row.error_kind = Some("io".into());
                acc.failure("io");
                srow.turns.push(row);
                continue;
            }
            let ttft = (t.ttft_ms * 1000.0) as u64;
            let gaps = vec![(t.itl_ms * 1000.0) as u64; t.tokens - 1];
            let e2e = ttft + gaps.iter().sum::<u64>();
            total_e2e += e2e as f64 / 1e6;
            let timing = RequestTiming {
                ttft_us: Some(ttft),
                itl_us: gaps,
                e2e_us: e2e,
                input_tokens: prompt_len,
                output_tokens: t.tokens,
            };
            acc.success(&timing, &slo);
            row.timing = Some(timing);
            row.prompt = Some(PromptFidelity {
                recorded_tokens: Some(prompt_len),
                candidate_tokens: Some(prompt_len),
                first_divergence: t.prompt_diverged.then_some(prompt_len / 2),
                diverged: t.prompt_diverged,
            });
            row.output = Some(OutputFidelity {
                basis: "token_ids".into(),
                exact_match: t.exact,
                first_divergence: (!t.exact).then_some(2),
                edit_distance: if t.exact { 0.0 } else { 0.5 },
                recorded_len: t.tokens,
                candidate_len: t.tokens,
            });
            let pts: Vec<PositionDrift> = (0..t.tokens)
                .map(|i| PositionDrift {
                    position: prompt_len + i,
                    dlogprob: -t.dlp,
                    top1_agree: t.top1 || i > 0,
                    kl: t.kl,
                })
                .collect();
            row.drift = Some(TurnDrift {
                scored_prompt: "candidate".into(),
                stats: DriftStats::of(&pts),
                first_top1_disagreement: (!t.top1).then_some(0),
            });
            points.extend(pts);
            row.probe_passed = t.probe;
            fid.compared_turns += 1;
            fid.scored_turns += 1;
            if t.prompt_diverged {
                row.flags.push("prompt_divergence".into());
                fid.prompt_divergent_turns += 1;
            }
            if t.exact {
                fid.exact_match_turns += 1;
            } else {
                row.flags.push("output_mismatch".into());
            }
            match t.probe {
                Some(true) => fid.probes_passed += 1,
                Some(false) => {
                    fid.probes_failed += 1;
                    row.flags.push("probe_failed".into());
                }
                None => {}
            }
            for f in &row.flags {
                *fid.flags.entry(f.clone()).or_default() += 1;
            }
            if row.flagged() {
                fid.flagged_turns += 1;
                srow.first_divergent_turn.get_or_insert(k);
            }
            srow.turns.push(row);
        }
        rows.push(srow);
    }
    fid.drift = DriftStats::of(&points);
    fid.drift_by_bucket = drift_by_bucket(&points);
    let duration = total_e2e / 2.0; // two concurrent sessions
    let speed = acc.summary(duration).expect("summary");
    RunSummary {
        format: RUN_FORMAT.into(),
        target: TargetInfo {
            spec: spec.into(),
            kind: "engine".into(),
            toggles: Some(toggles.into()),
            model: Some("tiny-qwen2".into()),
            build: Some("0.1.0 test".into()),
            scoring: "decode".into(),
        },
        settings: tapedeck_replayer::report::RunSettings {
            pacing: tapedeck_replayer::Pacing::Closed { concurrency: 2 },
            teacher_forcing: true,
            top_k: 8,
            ..Default::default()
        },
        started_at_us: 1_700_000_000_000_000,
        ended_at_us: 1_700_000_000_000_000 + (duration * 1e6) as i64,
        cancelled: false,
        sessions_total: rows.len(),
        sessions_started: rows.len(),
        flagged: fid.flagged_turns > 0,
        speed,
        fidelity: fid,
        sessions: rows,
        merged_from: Vec::new(),
    }
}

/// `n_sessions` sessions of `turns` turns with per-turn latencies drawn from a seeded RNG
/// (TTFT 80–240 ms, ITL 15–30 ms) — the "true" speeds of a build.
pub fn base_specs(n_sessions: usize, turns: usize, seed: u64) -> Vec<(String, Vec<TurnSpec>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n_sessions)
        .map(|s| {
            let ts = (0..turns)
                .map(|_| TurnSpec {
                    ttft_ms: rng.random_range(80.0..240.0),
                    itl_ms: rng.random_range(15.0..30.0),
                    tokens: rng.random_range(4..16),
                    prompt_tokens: rng.random_range(200..500),
                    ..TurnSpec::default()
                })
                .collect();
            (format!("s{s:02}"), ts)
        })
        .collect()
}

/// The same specs with every latency multiplied by `factor · (1 ± noise)` (seeded).
pub fn scaled(
    specs: &[(String, Vec<TurnSpec>)],
    ttft_factor: f64,
    itl_factor: f64,
    noise: f64,
    seed: u64,
) -> Vec<(String, Vec<TurnSpec>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    specs
        .iter()
        .map(|(id, ts)| {
            let ts = ts
                .iter()
                .map(|t| {
                    let mut t = t.clone();
                    let mut jitter = || {
                        if noise > 0.0 {
                            1.0 + rng.random_range(-noise..noise)
                        } else {
                            1.0
                        }
                    };
                    t.ttft_ms *= ttft_factor * jitter();
                    t.itl_ms *= itl_factor * jitter();
                    t
                })
                .collect();
            (id.clone(), ts)
        })
        .collect()
}
