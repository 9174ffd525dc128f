//! The replay loop against a scripted target: closed-loop concurrency, turn order, `self` history
//! through the loop, open-loop and recorded-timing latency measured from the intended send time (no coordinated
//! omission), and cancellation that keeps finished turns. No assertion depends on the machine
//! being fast: only lower bounds on times that the target itself imposes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tapedeck_engine::{ChatMessage, LogitsSummary};
use tapedeck_replayer::run::recorded_offsets;
use tapedeck_replayer::session::{ChatRequest, Probe};
use tapedeck_replayer::target::{Clock, GenOptions, TargetInfo, TurnOutput};
use tapedeck_replayer::{
    replay, HistoryMode, Pacing, ReplayConfig, Session, Target, ThinkTime, Turn,
};
use tokio::sync::watch;

#[derive(Clone, Copy)]
enum Behaviour {
    /// Await this long (other sessions proceed meanwhile).
    AsyncDelay(Duration),
    /// Block the executor thread this long (a server that is slower than the arrival rate).
    Blocking(Duration),
    /// Answer turn 0 at once; never answer later turns.
    HangAfterFirst,
}

struct Scripted {
    behaviour: Behaviour,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Every request's messages, in arrival order.
    log: Mutex<Vec<Vec<ChatMessage>>>,
    /// When each request arrived, with its first message's text.
    sends: Mutex<Vec<(String, Instant)>>,
}

impl Scripted {
    fn new(behaviour: Behaviour) -> Arc<Self> {
        Arc::new(Scripted {
            behaviour,
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
            sends: Mutex::new(Vec::new()),
        })
    }
}

impl Target for Scripted {
    fn info(&self) -> TargetInfo {
        TargetInfo {
            spec: "scripted".into(),
            kind: "test".into(),
            scoring: "none".into(),
            ..TargetInfo::default()
        }
    }

    fn chat(
        &self,
        request: ChatRequest,
        _opts: GenOptions,
    ) -> BoxFuture<'_, tapedeck_replayer::Result<TurnOutput>> {
        Box::pin(async move {
            let sent = Instant::now();
            let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_in_flight.fetch_max(n, Ordering::SeqCst);
            let last_user = request
                .messages
                .iter()
                .rev()
                .find(|m| m.role == "user")
                .map(|m| m.text())
                .unwrap_or_default();
            self.log.lock().unwrap().push(request.messages.clone());
            self.sends
                .lock()
                .unwrap()
                .push((request.messages[0].text(), sent));
            match self.behaviour {
                Behaviour::AsyncDelay(d) => tokio::time::sleep(d).await,
                Behaviour::Blocking(d) => std::thread::sleep(d),
                Behaviour::HangAfterFirst => {
                    if request.messages.len() > 1 {
                        std::future::pending::<()>().await;
                    }
                }
            }
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let now = Instant::now();
            let answer = format!("answer to {last_user}");
            Ok(TurnOutput {
                prompt_ids: None,
                prompt_tokens: Some(10),
                output_ids: None,
                output_tokens: 1,
                text: answer.clone(),
                message: ChatMessage::new("assistant", &answer),
                summaries: Vec::new(),
                finish_reason: Some("stop".into()),
                clock: Clock {
                    sent,
                    tokens: vec![now],
                    end: now,
                },
            })
        })
    }

    fn score(
        &self,
        _p: Vec<u32>,
        _o: Vec<u32>,
        _k: usize,
    ) -> BoxFuture<'_, tapedeck_replayer::Result<Vec<LogitsSummary>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// A session of `turns` user turns whose recorded assistant answers are `recorded k`.
fn session(id: usize, turns: usize) -> Session {
    let mut messages = Vec::new();
    let mut out = Vec::new();
    for k in 0..turns {
        messages.push(ChatMessage::new("user", &format!("s{id}t{k}")));
        out.push(Turn {
            kind: Default::default(),
            request: ChatRequest {
                messages: messages.clone(),
                ..ChatRequest::default()
            },
            recorded: None,
            probe: None,
            arrival_us: None,
        });
        messages.push(ChatMessage::new("assistant", &format!("recorded {k}")));
    }
    Session::new(format!("s{id}"), out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_bounds_concurrency_and_keeps_turn_order() {
    let target = Scripted::new(Behaviour::AsyncDelay(Duration::from_millis(15)));
    let mut sessions: Vec<Session> = (0..6).map(|i| session(i, 3)).collect();
    // Probes: one the scripted answer passes, one it fails.
    sessions[0].turns[0].probe = Some(Probe {
        must_contain: vec!["answer to s0t0".into()],
    });
    sessions[1].turns[2].probe = Some(Probe {
        must_contain: vec!["the needle".into()],
    });
    let cfg = ReplayConfig {
        pacing: Pacing::Closed { concurrency: 2 },
        history: HistoryMode::SelfFed,
        ..ReplayConfig::default()
    };
    let (_tx, rx) = watch::channel(false);
    let run = replay(sessions, target.clone(), &cfg, rx).await.unwrap();
    assert_eq!(run.sessions.len(), 6);
    assert_eq!(run.speed.completed, 18);
    assert_eq!(target.max_in_flight.load(Ordering::SeqCst), 2);
    assert_eq!(run.fidelity.probes_passed, 1);
    assert_eq!(run.fidelity.probes_failed, 1);
    assert_eq!(run.sessions[1].first_divergent_turn, Some(2));
    assert_eq!(run.sessions[1].turns[2].flags, ["probe_failed"]);
    let log = target.log.lock().unwrap();
    for i in 0..6 {
        let mine: Vec<&Vec<ChatMessage>> = log
            .iter()
            .filter(|m| m[0].text() == format!("s{i}t0"))
            .collect();
        assert_eq!(mine.len(), 3);
        // Turn order: each request of a session extends the previous one.
        for (k, m) in mine.iter().enumerate() {
            assert_eq!(m.len(), 2 * k + 1);
        }
        // Self history: the candidate's answers replaced the recorded ones.
        let last = mine[2];
        assert_eq!(last[1].text(), format!("answer to s{i}t0"));
        assert_eq!(last[3].text(), format!("answer to s{i}t1"));
    }
}

#[test]
fn open_loop_latency_counts_from_the_intended_send_time() {
    // One executor thread and a target that blocks it for 40 ms per request: five sessions due
    // within a few milliseconds are *sent* late, one after another. Measured from the intended
    // time, the last one waited for the four before it; measured from its own send it would look
    // like 40 ms (coordinated omission).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let service = Duration::from_millis(40);
    let target = Scripted::new(Behaviour::Blocking(service));
    let sessions: Vec<Session> = (0..5).map(|i| session(i, 1)).collect();
    let cfg = ReplayConfig {
        pacing: Pacing::Open {
            rate: 2000.0,
            seed: 1,
            burstiness: 1.0,
        },
        ..ReplayConfig::default()
    };
    let (_tx, rx) = watch::channel(false);
    let run = rt.block_on(replay(sessions, target, &cfg, rx)).unwrap();
    let mut e2e: Vec<u64> = run
        .sessions
        .iter()
        .map(|s| s.turns[0].timing.as_ref().unwrap().e2e_us)
        .collect();
    e2e.sort_unstable();
    for (k, v) in e2e.iter().enumerate() {
        // The k-th request served waited for k earlier ones; allow 10 ms of schedule slack.
        let floor = (k as u64 + 1) * 40_000 - 10_000;
        assert!(*v >= floor, "request {k}: {v} µs < {floor} µs ({e2e:?})");
    }
    assert!(run.speed.e2e.max_ms >= 190.0, "{:?}", run.speed.e2e);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_keeps_finished_turns() {
    let target = Scripted::new(Behaviour::HangAfterFirst);
    let sessions: Vec<Session> = (0..3).map(|i| session(i, 3)).collect();
    let (tx, rx) = watch::channel(false);
    let tx = Arc::new(tx);
    let finished = Arc::new(AtomicUsize::new(0));
    let (tx2, finished2) = (tx.clone(), finished.clone());
    let cfg = ReplayConfig {
        pacing: Pacing::Closed { concurrency: 3 },
        // Cancel once every session's first turn is in.
        progress: Some(Arc::new(move |_row| {
            if finished2.fetch_add(1, Ordering::SeqCst) + 1 == 3 {
                let _ = tx2.send(true);
            }
        })),
        ..ReplayConfig::default()
    };
    let run = tokio::time::timeout(Duration::from_secs(30), replay(sessions, target, &cfg, rx))
        .await
        .expect("cancellation ends the run")
        .unwrap();
    assert!(run.cancelled);
    assert_eq!(run.speed.completed, 3);
    assert_eq!(run.speed.failed, 0, "an abandoned turn is not an error");
    assert!(run
        .sessions
        .iter()
        .all(|s| s.cancelled && s.turns.len() == 1));
}

/// `session(id, turns)` whose requests were recorded at `first_us`, then 10 s apart.
fn recorded_session(id: usize, turns: usize, first_us: Option<i64>) -> Session {
    let mut s = session(id, turns);
    for (k, t) in s.turns.iter_mut().enumerate() {
        t.arrival_us = first_us.map(|f| f + 10_000_000 * k as i64);
    }
    s
}

#[test]
fn recorded_offsets_are_relative_to_the_earliest_session_and_scaled() {
    let t0 = 1_700_000_000_000_000i64;
    let sessions = vec![
        recorded_session(0, 2, Some(t0 + 400_000)),
        recorded_session(1, 1, Some(t0)),
        recorded_session(2, 1, None),
        recorded_session(3, 3, Some(t0 + 3_000_000)),
    ];
    let ms = |v: Vec<Duration>| v.iter().map(|d| d.as_micros() as u64).collect::<Vec<_>>();
    assert_eq!(
        ms(recorded_offsets(&sessions, 1.0)),
        [400_000, 0, 0, 3_000_000]
    );
    assert_eq!(
        ms(recorded_offsets(&sessions, 4.0)),
        [100_000, 0, 0, 750_000]
    );
    assert_eq!(
        ms(recorded_offsets(&sessions[2..3], 1.0)),
        [0],
        "no recorded times: all start at once"
    );
    // A session whose first turn lacks a time uses its first turn that has one.
    let mut s = recorded_session(4, 2, Some(t0 + 50_000));
    s.turns[0].arrival_us = None;
    assert_eq!(
        ms(recorded_offsets(
            &[recorded_session(1, 1, Some(t0)), s],
            1.0
        )),
        [0, 10_050_000]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_pacing_starts_sessions_at_scaled_recorded_offsets() {
    let target = Scripted::new(Behaviour::AsyncDelay(Duration::ZERO));
    let t0 = 1_700_000_000_000_000i64;
    // Recorded 0, 300 ms and 600 ms apart; replayed at speed 2: 0, 150 ms, 300 ms.
    let sessions = vec![
        recorded_session(0, 2, Some(t0 + 600_000)),
        recorded_session(1, 2, Some(t0)),
        recorded_session(2, 2, Some(t0 + 300_000)),
    ];
    let cfg = ReplayConfig {
        pacing: Pacing::Recorded { speed: 2.0 },
        ..ReplayConfig::default()
    };
    let (_tx, rx) = watch::channel(false);
    let before = Instant::now();
    let run = replay(sessions, target.clone(), &cfg, rx).await.unwrap();
    assert_eq!(run.speed.completed, 6);
    assert_eq!(run.settings.pacing, Pacing::Recorded { speed: 2.0 });
    let sends = target.sends.lock().unwrap();
    let first = |id: &str| {
        sends
            .iter()
            .find(|(m, _)| m == id)
            .map(|(_, t)| t.duration_since(before))
            .unwrap()
    };
    let (a, b, c) = (first("s1t0"), first("s2t0"), first("s0t0"));
    assert!(b >= Duration::from_millis(150), "{b:?}");
    assert!(c >= Duration::from_millis(300), "{c:?}");
    // Order of first sends follows the recording (the gaps are far above scheduler noise).
    assert!(a < b && b < c, "{a:?} {b:?} {c:?}");
    // No think time: a session's turns are not spread by the recorded 10 s gap between them.
    assert!(
        run.speed.duration_s < 0.3 + 10.0 / 2.0,
        "{}",
        run.speed.duration_s
    );
    let json = serde_json::to_value(run.settings.pacing).unwrap();
    assert_eq!(json, serde_json::json!({"mode": "recorded", "speed": 2.0}));
}

#[test]
fn recorded_pacing_latency_counts_from_the_intended_send_time() {
    // As the open-loop case: five sessions recorded 1 ms apart, a target that blocks the only
    // executor thread for 40 ms per request; the k-th served waited for the k before it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let target = Scripted::new(Behaviour::Blocking(Duration::from_millis(40)));
    let t0 = 1_700_000_000_000_000i64;
    let sessions: Vec<Session> = (0..5)
        .map(|i| recorded_session(i, 1, Some(t0 + 1_000 * i as i64)))
        .collect();
    let cfg = ReplayConfig {
        pacing: Pacing::Recorded { speed: 1.0 },
        ..ReplayConfig::default()
    };
    let (_tx, rx) = watch::channel(false);
    let run = rt.block_on(replay(sessions, target, &cfg, rx)).unwrap();
    let mut e2e: Vec<u64> = run
        .sessions
        .iter()
        .map(|s| s.turns[0].timing.as_ref().unwrap().e2e_us)
        .collect();
    e2e.sort_unstable();
    for (k, v) in e2e.iter().enumerate() {
        let floor = (k as u64 + 1) * 40_000 - 10_000;
        assert!(*v >= floor, "request {k}: {v} µs < {floor} µs ({e2e:?})");
    }
}

#[tokio::test]
async fn recorded_pacing_rejects_a_bad_speed() {
    for speed in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let cfg = ReplayConfig {
            pacing: Pacing::Recorded { speed },
            ..ReplayConfig::default()
        };
        let (_tx, rx) = watch::channel(false);
        let target = Scripted::new(Behaviour::AsyncDelay(Duration::ZERO));
        let err = replay(vec![session(0, 1)], target, &cfg, rx)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("speed"), "{err}");
    }
}

/// `session(id, turns)` recorded with each answer taking `answer_ms` and the next request
/// arriving `think_ms` after it: the recorded think time is `think_ms` before every later turn.
fn thinking_session(id: usize, turns: usize, answer_ms: i64, think_ms: i64) -> Session {
    let mut s = session(id, turns);
    let t0 = 1_700_000_000_000_000i64;
    for (k, t) in s.turns.iter_mut().enumerate() {
        t.arrival_us = Some(t0 + 1000 * (answer_ms + think_ms) * k as i64);
        t.recorded = Some(tapedeck_replayer::session::Recorded {
            e2e_us: Some(1000 * answer_ms as u64),
            ..Default::default()
        });
    }
    s
}

/// Gaps between consecutive sends of each session's turns (by the `s{id}t0` first message).
fn send_gaps(target: &Scripted, ids: usize) -> Vec<Vec<Duration>> {
    let sends = target.sends.lock().unwrap();
    (0..ids)
        .map(|i| {
            let mine: Vec<Instant> = sends
                .iter()
                .filter(|(m, _)| *m == format!("s{i}t0"))
                .map(|(_, t)| *t)
                .collect();
            mine.windows(2).map(|w| w[1] - w[0]).collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn think_time_paces_turns_in_closed_and_open_loop() {
    // Recorded: answers took 40 ms and the user thought 60 ms before each next turn. The
    // scripted target answers at once, so every gap between two sends is the think time plus
    // scheduling noise: only lower bounds are asserted.
    let cases = [
        (ThinkTime::Recorded, None, 60),
        (ThinkTime::Scaled { factor: 0.5 }, None, 30),
        (
            ThinkTime::Scaled { factor: 4.0 },
            Some(Duration::from_millis(100)),
            100,
        ),
    ];
    for pacing in [
        Pacing::Closed { concurrency: 2 },
        Pacing::Open {
            rate: 1000.0,
            seed: 3,
            burstiness: 0.5,
        },
    ] {
        for (mode, max, floor_ms) in cases {
            let target = Scripted::new(Behaviour::AsyncDelay(Duration::ZERO));
            let sessions: Vec<Session> = (0..2).map(|i| thinking_session(i, 3, 40, 60)).collect();
            let cfg = ReplayConfig {
                pacing,
                think_time: mode,
                max_think_time: max,
                ..ReplayConfig::default()
            };
            let (_tx, rx) = watch::channel(false);
            let run = replay(sessions, target.clone(), &cfg, rx).await.unwrap();
            assert_eq!(run.speed.completed, 6);
            assert_eq!(run.settings.think_time, mode);
            for gaps in send_gaps(&target, 2) {
                assert_eq!(gaps.len(), 2);
                for g in gaps {
                    assert!(
                        g >= Duration::from_millis(floor_ms),
                        "{pacing:?} {mode}: gap {g:?} < {floor_ms} ms"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn think_time_cap_bounds_long_recorded_pauses() {
    // Recorded pauses of an hour, capped at 50 ms: the run ends quickly, each gap at least 50 ms.
    let target = Scripted::new(Behaviour::AsyncDelay(Duration::ZERO));
    let sessions = vec![thinking_session(0, 3, 10, 3_600_000)];
    let cfg = ReplayConfig {
        think_time: ThinkTime::Recorded,
        max_think_time: Some(Duration::from_millis(50)),
        ..ReplayConfig::default()
    };
    let (_tx, rx) = watch::channel(false);
    let run = tokio::time::timeout(
        Duration::from_secs(30),
        replay(sessions, target.clone(), &cfg, rx),
    )
    .await
    .expect("the cap applies")
    .unwrap();
    assert_eq!(run.speed.completed, 3);
    assert!(send_gaps(&target, 1)[0]
        .iter()
        .all(|g| *g >= Duration::from_millis(50)));
    assert_eq!(run.settings.max_think_time_ms, Some(50.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_interrupts_a_think_time() {
    // An hour's pause after the first turn; cancelling during it ends the run at once.
    let target = Scripted::new(Behaviour::AsyncDelay(Duration::ZERO));
    let (tx, rx) = watch::channel(false);
    let tx = Arc::new(tx);
    let tx2 = tx.clone();
    let cfg = ReplayConfig {
        think_time: ThinkTime::Recorded,
        progress: Some(Arc::new(move |_row| {
            let _ = tx2.send(true);
        })),
        ..ReplayConfig::default()
    };
    let sessions = vec![thinking_session(0, 3, 10, 3_600_000)];
    let run = tokio::time::timeout(Duration::from_secs(30), replay(sessions, target, &cfg, rx))
        .await
        .expect("cancellation ends the pause")
        .unwrap();
    assert!(run.cancelled);
    assert_eq!(run.speed.completed, 1);
}

#[tokio::test]
async fn open_loop_rejects_a_bad_burstiness() {
    for burstiness in [0.0, -1.0, f64::NAN] {
        let cfg = ReplayConfig {
            pacing: Pacing::Open {
                rate: 1.0,
                seed: 0,
                burstiness,
            },
            ..ReplayConfig::default()
        };
        let (_tx, rx) = watch::channel(false);
        let target = Scripted::new(Behaviour::AsyncDelay(Duration::ZERO));
        let err = replay(vec![session(0, 1)], target, &cfg, rx)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("burstiness"), "{err}");
    }
}
