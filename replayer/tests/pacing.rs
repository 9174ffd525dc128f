//! The replay loop against a scripted target: closed-loop concurrency, turn order, `self` history
//! through the loop, open-loop latency measured from the intended send time (no coordinated
//! omission), and cancellation that keeps finished turns. No assertion depends on the machine
//! being fast: only lower bounds on times that the target itself imposes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tapedeck_engine::{ChatMessage, LogitsSummary};
use tapedeck_replayer::session::{ChatRequest, Probe};
use tapedeck_replayer::target::{Clock, GenOptions, TargetInfo, TurnOutput};
use tapedeck_replayer::{replay, HistoryMode, Pacing, ReplayConfig, Session, Target, Turn};
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
}

impl Scripted {
    fn new(behaviour: Behaviour) -> Arc<Self> {
        Arc::new(Scripted {
            behaviour,
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
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
