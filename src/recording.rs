//! Recording sessions the way production traffic is recorded: a `tapedeck serve` on a free local
//! port, and the sessions played through it over HTTP as a client would. Used by `tapedeck synth
//! record` and `tapedeck demo`.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use tapedeck_engine::scheduler::SchedulerConfig;
use tapedeck_engine::Toggles;
use tapedeck_recorder::backend::SchedulerBackend;
use tapedeck_recorder::server::{self, AppOptions, AppState};
use tapedeck_recorder::store::Store;
use tapedeck_recorder::writer::WriterStats;
use tapedeck_replayer::report::{Pacing, RunSummary};
use tapedeck_replayer::run::ReplayConfig;
use tapedeck_replayer::session::Session;

use crate::cli_replay::run_replay;

/// A recording server running in this process.
pub struct LocalServer {
    /// Its base URL (`http://127.0.0.1:PORT`).
    pub url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<tapedeck_recorder::Result<WriterStats>>,
}

impl LocalServer {
    /// Loads `model_dir` and serves it with `toggles` on a free loopback port, recording to `db`
    /// under the model name `name`.
    pub async fn start(
        model_dir: &Path,
        name: &str,
        toggles: Toggles,
        db: &Path,
        threads: Option<usize>,
    ) -> Result<Self> {
        let engine = {
            let model = model_dir.to_path_buf();
            tokio::task::spawn_blocking(move || {
                tapedeck_engine::Engine::load_with(
                    &model,
                    &tapedeck_engine::engine::EngineOptions {
                        threads,
                        ..Default::default()
                    },
                )
            })
            .await??
        };
        let store = Store::open(db).await?;
        let options = AppOptions {
            served_model_name: Some(name.to_string()),
            toggles,
            ..Default::default()
        };
        let scheduler = SchedulerConfig {
            kv_dtype: toggles.kv_dtype,
            ..Default::default()
        };
        let backend = SchedulerBackend::start(Arc::new(engine), scheduler)
            .map_err(|e| anyhow::anyhow!("starting the scheduler: {e}"))?;
        let state = AppState::new(Arc::new(backend), store, options).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server::run(listener, state, async {
            let _ = stop_rx.await;
        }));
        Ok(LocalServer { url, stop, task })
    }

    /// Stops accepting, finishes in-flight responses and drains the recorder.
    pub async fn stop(self) -> Result<WriterStats> {
        let _ = self.stop.send(());
        Ok(self.task.await??)
    }
}

/// Plays `sessions` through `url` (recorded history, `concurrency` sessions at a time, no
/// teacher forcing: this is the client side of a recording, not a measurement).
pub async fn play(
    sessions: Vec<Session>,
    url: &str,
    concurrency: usize,
    threads: Option<usize>,
) -> Result<RunSummary> {
    let cfg = ReplayConfig {
        pacing: Pacing::Closed {
            concurrency: concurrency.max(1),
        },
        teacher_forcing: false,
        ..Default::default()
    };
    run_replay(sessions, url, cfg, threads, true).await
}
