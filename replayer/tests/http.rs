//! The whole loop over HTTP: a client talks to `tapedeck serve` (the recorder's app on the fixture
//! engine), the recording database is loaded with `load_db`, and the sessions are replayed against
//! both an engine target and the HTTP server itself. Protects the seams between the recorder's
//! storage, its OpenAI endpoints (streaming chat, `/v1/completions` echo scoring with token-ID
//! extensions) and the replayer's parsers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::scheduler::SchedulerConfig;
use tapedeck_engine::{Engine, Toggles};
use tapedeck_recorder::server::{run, AppOptions, AppState};
use tapedeck_recorder::{EngineBackend, Store};
use tapedeck_replayer::report::read_json;
use tapedeck_replayer::session::{load_db, SessionSource};
use tapedeck_replayer::{
    replay, EngineTarget, HttpTarget, Pacing, ReplayConfig, SessionFilter, Target,
};
use tapedeck_replayer::{run_job, ReplayJob, TargetOptions};
use tokio::sync::{oneshot, watch};

fn engine() -> Arc<Engine> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/tiny-qwen2");
    Arc::new(
        Engine::load_with(
            &dir,
            &EngineOptions {
                threads: Some(2),
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

/// Starts the recorder on port 0; returns its base URL and a stopper that drains the writer.
async fn start_server(
    engine: Arc<Engine>,
    db: &Path,
) -> (String, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let store = Store::open(db).await.unwrap();
    let backend = EngineBackend::new(engine, 64);
    let state = AppState::new(Arc::new(backend), store, AppOptions::default())
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        run(listener, state, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    (format!("http://{addr}"), tx, task)
}

async fn record_sessions(base: &str) {
    let client = reqwest::Client::new();
    let tools = json!([{"type": "function", "function": {"name": "grep",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}}]);
    for (sid, agent, questions) in [
        (
            "h-1",
            "opencode/1.18.33 ai-sdk/5",
            ["Where is the scheduler?", "And the KV cache?"],
        ),
        (
            "h-2",
            "OpenAI/Python 3.57.0",
            ["Name a fast tokenizer.", "Why is it fast?"],
        ),
    ] {
        let mut messages = vec![json!({"role": "system", "content": "Be brief."})];
        for q in questions {
            messages.push(json!({"role": "user", "content": q}));
            let resp: Value = client
                .post(format!("{base}/v1/chat/completions"))
                .header("x-session-id", sid)
                .header("user-agent", agent)
                .json(&json!({"messages": messages, "tools": tools,
                              "temperature": 0, "max_tokens": 6}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let mut answer = resp["choices"][0]["message"].clone();
            if answer["tool_calls"].is_null() {
                answer.as_object_mut().unwrap().remove("tool_calls");
            }
            messages.push(answer);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_over_http_then_replay_from_the_database() {
    let engine = engine();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("rec.db");
    let (base, stop, task) = start_server(engine.clone(), &db).await;
    record_sessions(&base).await;
    let _ = stop.send(());
    task.await.unwrap();

    let sessions = load_db(
        &db,
        &SessionFilter {
            min_turns: 2,
            ..SessionFilter::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(sessions.len(), 2);
    // The recorder's client identity reaches the sessions and the client, time and shard filters
    // work on a database as on JSONL.
    let mut clients: Vec<(String, Option<String>)> = sessions
        .iter()
        .map(|s| (s.id.clone(), s.client.clone()))
        .collect();
    clients.sort();
    assert_eq!(
        clients,
        [
            (
                "h-1".to_string(),
                Some("opencode/1.18.33 ai-sdk/5".to_string())
            ),
            ("h-2".to_string(), Some("OpenAI/Python 3.57.0".to_string()))
        ]
    );
    let only = |f: SessionFilter| {
        let db = db.clone();
        async move {
            let ids: Vec<String> = load_db(&db, &f)
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .collect();
            ids
        }
    };
    assert_eq!(
        only(SessionFilter {
            clients: vec!["python".into()],
            ..SessionFilter::default()
        })
        .await,
        ["h-2"]
    );
    let first = sessions
        .iter()
        .filter_map(|s| s.first_arrival_us())
        .min()
        .unwrap();
    assert!(only(SessionFilter {
        until_us: Some(first),
        ..SessionFilter::default()
    })
    .await
    .is_empty());
    let mut by_shard: Vec<String> = Vec::new();
    for i in 0..2 {
        by_shard.extend(
            only(SessionFilter {
                shard: Some(tapedeck_replayer::Shard::new(i, 2).unwrap()),
                ..SessionFilter::default()
            })
            .await,
        );
    }
    by_shard.sort();
    assert_eq!(
        by_shard,
        ["h-1", "h-2"],
        "two shards partition the sessions"
    );
    let rec = sessions[0].turns[1].recorded.as_ref().unwrap();
    assert!(rec.prompt_ids.is_some() && rec.output_ids.is_some());
    assert_eq!(rec.summaries.len(), rec.output_ids.as_ref().unwrap().len());

    let cfg = ReplayConfig {
        pacing: Pacing::Closed { concurrency: 2 },
        ..ReplayConfig::default()
    };

    // The in-process reference reproduces what the server recorded, bit for bit.
    let reference: Arc<dyn Target> = Arc::new(
        EngineTarget::new(
            engine.clone(),
            Toggles::default(),
            SchedulerConfig::default(),
            "engine:tiny-qwen2",
        )
        .unwrap(),
    );
    let (_tx, rx) = watch::channel(false);
    let run_e = replay(sessions.clone(), reference, &cfg, rx).await.unwrap();
    assert!(!run_e.flagged, "{:?}", run_e.fidelity.flags);
    assert_eq!(run_e.fidelity.exact_match_turns, 4);
    assert_eq!(run_e.fidelity.drift.abs_dlogprob.max, 0.0);

    // The CLI's entry point: database in, engine spec (through a resolver), JSON out.
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models");
    let json = dir.path().join("run.json");
    let job = ReplayJob {
        sessions: SessionSource::from_path(&db),
        filter: SessionFilter::default(),
        target: "engine:tiny-qwen2?matmul=bf16".into(),
        target_options: TargetOptions {
            resolver: Some(Arc::new(move |name: &str| Ok(fixtures.join(name)))),
            threads: Some(2),
            ..TargetOptions::default()
        },
        config: cfg.clone(),
        json: Some(json.clone()),
    };
    let (_tx, rx) = watch::channel(false);
    let by_job = run_job(&job, rx).await.unwrap();
    assert!(by_job.flagged, "bf16 drifts");
    assert_eq!(by_job.target.toggles.as_deref(), Some("matmul=bf16"));
    // The JSON summary round-trips (floats to within serde_json's shortest representation).
    let back = read_json(&json).unwrap();
    assert_eq!(back.flagged, by_job.flagged);
    assert_eq!(back.fidelity.flags, by_job.fidelity.flags);
    assert_eq!(back.sessions.len(), 2);
    assert_eq!(back.speed.ttft.hdr, by_job.speed.ttft.hdr);
    assert_eq!(
        back.sessions[1].turns[1].timing,
        by_job.sessions[1].turns[1].timing
    );

    // The server itself over HTTP: streamed chat plus echo scoring.
    let db2 = dir.path().join("replay.db");
    let (base2, stop2, task2) = start_server(engine, &db2).await;
    let http: Arc<dyn Target> = Arc::new(HttpTarget::open(&base2).unwrap());
    let (_tx, rx) = watch::channel(false);
    let run_h = replay(sessions, http, &cfg, rx).await.unwrap();
    let _ = stop2.send(());
    task2.await.unwrap();
    assert_eq!(run_h.speed.failed, 0, "{:?}", run_h.sessions);
    let f = &run_h.fidelity;
    assert_eq!(f.compared_turns, 4);
    assert_eq!(f.exact_match_turns, 4, "{:?}", run_h.sessions);
    assert_eq!(f.prompt_divergent_turns, 0);
    assert_eq!(f.scored_turns, 4, "{:?}", run_h.sessions);
    assert_eq!(f.drift.top1_agreement, 1.0);
    eprintln!(
        "HTTP (prefill-scored) vs recording: max |dlogprob| {:.3e}, KL max {:.3e}; TTFT p50 {:.1} ms",
        f.drift.abs_dlogprob.max, f.drift.kl.max, run_h.speed.ttft.p50_ms
    );
    // The CPU forward is batch-invariant, so even prefill-mode scoring reproduces the decode-mode
    // recording exactly: the reference over HTTP is not flagged either.
    assert!(!run_h.flagged, "{:?}", f.flags);
    assert_eq!(run_h.speed.ttft.count, 4);
    assert!(
        run_h.speed.total_input_tokens > 0,
        "usage.prompt_tokens is read"
    );
}
