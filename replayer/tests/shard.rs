//! Sharding and merging: hand-made per-turn results split by `Shard` and summarized per shard,
//! then merged, must give the summary of one unsharded run over the same turns — latency
//! percentiles from the merged HDR histograms *exactly*, counts exactly, drift pooled — and the
//! merge must refuse inputs that would double count or mix configurations.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tapedeck_replayer::merge::{merge_runs, missing_shards};
use tapedeck_replayer::metrics::{Latency, LatencySummary, PositionDrift, RequestTiming, Slo};
use tapedeck_replayer::report::{
    OutputFidelity, PromptFidelity, RunSettings, SessionRow, TurnDrift, TurnRow,
};
use tapedeck_replayer::run::{summarize, RunFacts};
use tapedeck_replayer::target::TargetInfo;
use tapedeck_replayer::{Pacing, RunSummary, Shard, ThinkTime};

const T0: i64 = 1_764_720_000_000_000;

/// One session's rows and its teacher-forced positions.
struct Made {
    row: SessionRow,
    positions: Vec<PositionDrift>,
}

/// `n` sessions of 1–6 turns with seeded latencies (TTFT 5–400 ms, 1–40 output tokens, ITL
/// 2–60 ms), about one turn in nine failed, fidelity rows and drift positions across buckets.
fn made_sessions(n: usize, seed: u64) -> Vec<Made> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let id = format!("session-{i:03}");
            let turns = rng.random_range(1..=6);
            let mut rows = Vec::new();
            let mut positions = Vec::new();
            for k in 0..turns {
                let mut row = TurnRow {
                    session_id: id.clone(),
                    turn: k,
                    ..TurnRow::default()
                };
                if rng.random_range(0..9) == 0 {
                    let kind = if rng.random_bool(0.5) {
                        "http_503"
                    } else {
                        "context_overflow"
                    };
                    row.error_kind = Some(kind.into());
                    row.error = Some(format!("{kind} on turn {k}"));
                    rows.push(row);
                    continue;
                }
                let ttft = rng.random_range(5_000..400_000u64);
                let n_out = rng.random_range(1..=40usize);
                let itl: Vec<u64> = (1..n_out)
                    .map(|_| rng.random_range(2_000..60_000))
                    .collect();
                let e2e = ttft + itl.iter().sum::<u64>();
                row.timing = Some(RequestTiming {
                    ttft_us: Some(ttft),
                    itl_us: itl,
                    e2e_us: e2e,
                    input_tokens: rng.random_range(100..6000),
                    output_tokens: n_out,
                });
                let exact = rng.random_bool(0.7);
                row.output = Some(OutputFidelity {
                    basis: "token_ids".into(),
                    exact_match: exact,
                    first_divergence: (!exact).then_some(3),
                    edit_distance: if exact {
                        0.0
                    } else {
                        rng.random_range(0.01..1.0)
                    },
                    recorded_len: n_out,
                    candidate_len: n_out,
                });
                let diverged = rng.random_bool(0.1);
                row.prompt = Some(PromptFidelity {
                    recorded_tokens: Some(100),
                    candidate_tokens: Some(100),
                    first_divergence: diverged.then_some(50),
                    diverged,
                });
                if diverged {
                    row.flags.push("prompt_divergence".into());
                }
                if rng.random_bool(0.6) {
                    let prompt_len = rng.random_range(0..9000usize);
                    let pts: Vec<PositionDrift> = (0..n_out)
                        .map(|j| PositionDrift {
                            position: prompt_len + j,
                            dlogprob: rng.random_range(-0.5..0.5),
                            top1_agree: rng.random_bool(0.9),
                            kl: rng.random_range(0.0..0.3),
                        })
                        .collect();
                    row.drift = Some(TurnDrift {
                        scored_prompt: "candidate".into(),
                        stats: tapedeck_replayer::metrics::DriftStats::of(&pts),
                        first_top1_disagreement: pts.iter().position(|p| !p.top1_agree),
                    });
                    if pts.iter().any(|p| !p.top1_agree) {
                        row.flags.push("top1".into());
                    }
                    positions.extend(pts);
                }
                if rng.random_bool(0.2) {
                    let passed = rng.random_bool(0.5);
                    row.probe_passed = Some(passed);
                    if !passed {
                        row.flags.push("probe_failed".into());
                    }
                }
                rows.push(row);
            }
            Made {
                row: SessionRow {
                    id: id.clone(),
                    turns_total: turns,
                    first_divergent_turn: rows.iter().find(|r| r.flagged()).map(|r| r.turn),
                    turns: rows,
                    cancelled: false,
                },
                positions,
            }
        })
        .collect()
}

fn target() -> TargetInfo {
    TargetInfo {
        spec: "http://127.0.0.1:8000".into(),
        kind: "http".into(),
        scoring: "prefill".into(),
        ..TargetInfo::default()
    }
}

fn settings(shard: Option<Shard>) -> RunSettings {
    RunSettings {
        pacing: Pacing::Open {
            rate: 4.0,
            seed: 7,
            burstiness: 0.5,
        },
        teacher_forcing: true,
        top_k: 8,
        slo: "ttft=200,tpot=40".parse::<Slo>().unwrap(),
        think_time: ThinkTime::Scaled { factor: 0.5 },
        max_think_time_ms: Some(30_000.0),
        shard,
        ..RunSettings::default()
    }
}

/// The summary of `sessions` as one run started at `start_us` lasting `duration`.
fn run_of(
    sessions: &[&Made],
    shard: Option<Shard>,
    start_us: i64,
    duration: Duration,
) -> RunSummary {
    summarize(RunFacts {
        target: target(),
        settings: settings(shard),
        started_at_us: start_us,
        duration,
        cancelled: false,
        sessions_total: sessions.len(),
        sessions_started: sessions.len(),
        sessions: sessions.iter().map(|m| m.row.clone()).collect(),
        positions: sessions
            .iter()
            .flat_map(|m| m.positions.iter().copied())
            .collect(),
    })
    .unwrap()
}

fn shards_of(made: &[Made], n: u32) -> Vec<Vec<&Made>> {
    (0..n)
        .map(|i| {
            let sh = Shard::new(i, n).unwrap();
            made.iter().filter(|m| sh.contains(&m.row.id)).collect()
        })
        .collect()
}

/// Every figure of a latency summary except the encoding, compared exactly, plus the decoded
/// histograms' bucket counts.
fn assert_same_latency(name: &str, a: &LatencySummary, b: &LatencySummary) {
    let figures = |l: &LatencySummary| {
        [
            l.count as f64,
            l.mean_ms,
            l.p50_ms,
            l.p90_ms,
            l.p95_ms,
            l.p99_ms,
            l.p999_ms,
            l.max_ms,
        ]
    };
    assert_eq!(figures(a), figures(b), "{name}");
    let buckets = |l: &LatencySummary| -> Vec<(u64, u64)> {
        let d = Latency::decode(&l.hdr).unwrap();
        d.histogram()
            .iter_recorded()
            .map(|v| (v.value_iterated_to(), v.count_at_value()))
            .collect()
    };
    assert_eq!(buckets(a), buckets(b), "{name}: histogram buckets");
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn merged_shards_equal_one_unsharded_run() {
    let made = made_sessions(60, 11);
    let all: Vec<&Made> = made.iter().collect();
    let d = Duration::from_micros(93_456_789);
    let whole = run_of(&all, None, T0, d);
    for n in [1u32, 2, 3, 5] {
        let parts = shards_of(&made, n);
        assert_eq!(
            parts.iter().map(Vec::len).sum::<usize>(),
            made.len(),
            "every session lands in exactly one of {n} shards"
        );
        // Shards ran side by side over the same window (the merged span is the same).
        let runs: Vec<RunSummary> = parts
            .iter()
            .enumerate()
            .map(|(i, p)| run_of(p, Some(Shard::new(i as u32, n).unwrap()), T0, d))
            .collect();
        let m = merge_runs(&runs).unwrap();

        let (ms, ws) = (&m.speed, &whole.speed);
        assert_same_latency("ttft", &ms.ttft, &ws.ttft);
        assert_same_latency("itl", &ms.itl, &ws.itl);
        assert_same_latency("tpot", &ms.tpot, &ws.tpot);
        assert_same_latency("e2e", &ms.e2e, &ws.e2e);
        assert_eq!(ms.completed, ws.completed);
        assert_eq!(ms.failed, ws.failed);
        assert_eq!(ms.errors, ws.errors);
        assert_eq!(ms.good_requests, ws.good_requests);
        assert_eq!(ms.total_input_tokens, ws.total_input_tokens);
        assert_eq!(ms.total_output_tokens, ws.total_output_tokens);
        assert!(close(ms.duration_s, ws.duration_s, 1e-12));
        assert!(close(ms.request_throughput, ws.request_throughput, 1e-12));
        assert!(close(
            ms.output_token_throughput,
            ws.output_token_throughput,
            1e-12
        ));
        assert!(close(ms.goodput, ws.goodput, 1e-12));

        let (mf, wf) = (&m.fidelity, &whole.fidelity);
        assert_eq!(mf.compared_turns, wf.compared_turns);
        assert_eq!(mf.prompt_divergent_turns, wf.prompt_divergent_turns);
        assert_eq!(mf.exact_match_turns, wf.exact_match_turns);
        assert_eq!(mf.scored_turns, wf.scored_turns);
        assert_eq!(
            (mf.probes_passed, mf.probes_failed),
            (wf.probes_passed, wf.probes_failed)
        );
        assert_eq!(mf.flagged_turns, wf.flagged_turns);
        assert_eq!(mf.flags, wf.flags);
        assert!(close(mf.mean_edit_distance, wf.mean_edit_distance, 1e-12));
        let check_drift = |a: &tapedeck_replayer::metrics::DriftStats,
                           b: &tapedeck_replayer::metrics::DriftStats| {
            assert_eq!(a.positions, b.positions);
            assert!(close(a.top1_agreement, b.top1_agreement, 1e-12));
            for (x, y) in [
                (&a.dlogprob, &b.dlogprob),
                (&a.abs_dlogprob, &b.abs_dlogprob),
                (&a.kl, &b.kl),
            ] {
                assert_eq!(x.n, y.n);
                assert_eq!((x.min, x.max), (y.min, y.max));
                assert!(close(x.mean, y.mean, 1e-9), "{x:?} {y:?}");
                assert!(close(x.ci95_low, y.ci95_low, 1e-9), "{x:?} {y:?}");
                assert!(close(x.ci95_high, y.ci95_high, 1e-9), "{x:?} {y:?}");
                // Quantiles are merged as upper bounds (documented), never below the truth.
                assert!(x.q90 >= y.q90 && x.q99 >= y.q99, "{x:?} {y:?}");
            }
        };
        check_drift(&mf.drift, &wf.drift);
        assert_eq!(mf.drift_by_bucket.len(), wf.drift_by_bucket.len());
        for (a, b) in mf.drift_by_bucket.iter().zip(&wf.drift_by_bucket) {
            assert_eq!((&a.bucket, a.from), (&b.bucket, b.from));
            check_drift(&a.drift, &b.drift);
        }

        assert_eq!(
            m.settings, whole.settings,
            "the merge is a whole run's settings"
        );
        assert_eq!(m.target, whole.target);
        assert_eq!(m.flagged, whole.flagged);
        assert_eq!(m.sessions_total, whole.sessions_total);
        let mut ids: Vec<&str> = m.sessions.iter().map(|s| s.id.as_str()).collect();
        ids.sort_unstable();
        let mut want: Vec<&str> = whole.sessions.iter().map(|s| s.id.as_str()).collect();
        want.sort_unstable();
        assert_eq!(ids, want);
        assert_eq!(m.merged_from.len(), n as usize);
        assert!(missing_shards(&m).is_empty());
    }
}

#[test]
fn shards_run_one_after_another_merge_over_the_whole_span() {
    let made = made_sessions(30, 5);
    let parts = shards_of(&made, 3);
    let d = Duration::from_secs(10);
    let runs: Vec<RunSummary> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let start = T0 + 10_000_000 * i as i64;
            run_of(p, Some(Shard::new(i as u32, 3).unwrap()), start, d)
        })
        .collect();
    let m = merge_runs(&runs).unwrap();
    assert_eq!(m.started_at_us, T0);
    assert_eq!(m.ended_at_us, T0 + 30_000_000);
    assert!(close(m.speed.duration_s, 30.0, 1e-12));
    assert!(close(
        m.speed.request_throughput,
        m.speed.completed as f64 / 30.0,
        1e-12
    ));
    // A merged run merges again (its parts are kept), e.g. two half-merges.
    let ab = merge_runs(&runs[..2]).unwrap();
    let again = merge_runs(&[ab, runs[2].clone()]).unwrap();
    assert_same_latency("e2e", &again.speed.e2e, &m.speed.e2e);
    assert_eq!(again.merged_from, m.merged_from);
}

#[test]
fn merge_refuses_double_counting_and_mixed_configurations() {
    let made = made_sessions(24, 3);
    let parts = shards_of(&made, 3);
    let d = Duration::from_secs(5);
    let shard = |i: usize| run_of(&parts[i], Some(Shard::new(i as u32, 3).unwrap()), T0, d);
    let err = |runs: &[RunSummary]| merge_runs(runs).unwrap_err().to_string();

    assert!(err(&[shard(0), shard(1), shard(1)]).contains("shard 1/3 is given more than once"));
    let all: Vec<&Made> = made.iter().collect();
    let whole = run_of(&all, None, T0, d);
    assert!(err(&[whole.clone(), whole.clone()]).contains("appears again"));
    assert!(err(&[whole.clone(), shard(0)]).contains("some inputs are shards"));
    let mut other_n = shard(1);
    other_n.settings.shard = Some(Shard::new(1, 4).unwrap());
    assert!(err(&[shard(0), other_n]).contains("4-way"));
    let mut other_target = shard(1);
    other_target.target.toggles = Some("matmul=bf16".into());
    assert!(err(&[shard(0), other_target]).contains("only runs of one target"));
    let mut other_settings = shard(1);
    other_settings.settings.think_time = ThinkTime::None;
    assert!(err(&[shard(0), other_settings]).contains("different settings"));
    assert!(err(&[]).contains("no runs"));

    // A missing shard merges, and is reported.
    let partial = merge_runs(&[shard(0), shard(2)]).unwrap();
    assert_eq!(missing_shards(&partial), [Shard::new(1, 3).unwrap()]);
}

#[test]
fn run_json_round_trips_and_older_runs_still_read() {
    let made = made_sessions(6, 9);
    let parts = shards_of(&made, 2);
    let d = Duration::from_secs(2);
    let runs: Vec<RunSummary> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| run_of(p, Some(Shard::new(i as u32, 2).unwrap()), T0, d))
        .collect();
    let m = merge_runs(&runs).unwrap();
    let text = serde_json::to_string(&m).unwrap();
    let back: RunSummary = serde_json::from_str(&text).unwrap();
    // Without serde_json's `float_roundtrip` feature a float may come back one ulp off, so
    // the fields that carry the merge are compared, not every float.
    assert_eq!(back.merged_from, m.merged_from);
    assert_eq!(back.settings, m.settings);
    let shape = |r: &RunSummary| -> Vec<(String, usize)> {
        r.sessions
            .iter()
            .map(|s| (s.id.clone(), s.turns.len()))
            .collect()
    };
    assert_eq!(shape(&back), shape(&m));
    assert_eq!(back.speed.e2e.hdr, m.speed.e2e.hdr);
    assert_eq!(back.speed.completed, m.speed.completed);
    let v = serde_json::to_value(&runs[1]).unwrap();
    assert_eq!(
        v["settings"]["shard"],
        serde_json::json!({"index": 1, "count": 2})
    );
    assert_eq!(
        v["settings"]["think_time"],
        serde_json::json!({"mode": "scaled", "factor": 0.5})
    );
    // A run written before think time, shards, burstiness and merges existed.
    let mut old = serde_json::to_value(&runs[0]).unwrap();
    let s = old["settings"].as_object_mut().unwrap();
    for k in ["think_time", "max_think_time_ms", "shard"] {
        s.remove(k);
    }
    s["pacing"].as_object_mut().unwrap().remove("burstiness");
    old.as_object_mut().unwrap().remove("merged_from");
    let old: RunSummary = serde_json::from_value(old).unwrap();
    assert_eq!(old.settings.think_time, ThinkTime::None);
    assert_eq!(old.settings.shard, None);
    assert!(matches!(old.settings.pacing, Pacing::Open { burstiness, .. } if burstiness == 1.0));
    assert!(old.merged_from.is_empty());
}
