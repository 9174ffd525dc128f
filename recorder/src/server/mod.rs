//! The OpenAI-compatible HTTP server that records every request.
//!
//! [`app`] builds the axum [`Router`] from an [`AppState`] (testable without a socket);
//! [`serve`] loads the model, opens the database, binds, and runs until Ctrl-C or SIGTERM, then
//! drains the record writer. [`run`] is `serve` for a listener and state you made yourself.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `GET /metrics`. Every request to the two generation endpoints is recorded —
//! malformed bodies, errors and client disconnects included.

mod chat;
mod completions;
mod driver;
pub mod error;
pub mod metrics;
pub mod openai;
mod proxy;
pub mod splitter;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tapedeck_engine::scheduler::SchedulerConfig;
use tapedeck_engine::{Engine, Toggles};
use tokio::net::TcpListener;

pub use error::ApiError;

use crate::backend::{Backend, EngineBackend, SchedulerBackend};
use crate::error::{Error, Result};
use crate::record::{now_us, BuildInfo, Endpoint, RequestRecord};
use crate::stitch::Stitcher;
use crate::store::Store;
use crate::upstream::{UpstreamBackend, UpstreamConfig};
use crate::writer::{RecordWriter, WriterConfig, WriterStats};
use metrics::Metrics;

/// Options of the HTTP layer, independent of how the backend and store were made.
#[derive(Debug, Clone)]
pub struct AppOptions {
    /// Toggles in force (recorded with every request).
    pub toggles: Toggles,
    /// Name of the header that carries a session ID (lower case).
    pub session_header: String,
    /// Largest request body accepted, in bytes (413 above).
    pub body_limit: usize,
    /// Record writer settings.
    pub writer: WriterConfig,
    /// Name to serve the model under instead of the backend's model ID.
    pub served_model_name: Option<String>,
    /// Token limit when a chat request sets none (`None`: the rest of the context window).
    pub default_max_tokens: Option<usize>,
    /// Write records to the store. Off only to measure what recording costs (the
    /// recording-on-vs-off benchmark); a production server always records.
    pub record: bool,
}

impl Default for AppOptions {
    fn default() -> Self {
        AppOptions {
            toggles: Toggles::default(),
            session_header: "x-session-id".into(),
            body_limit: 32 * 1024 * 1024,
            writer: WriterConfig::default(),
            served_model_name: None,
            default_max_tokens: None,
            record: true,
        }
    }
}

/// Everything `tapedeck serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// SQLite database file (created if missing).
    pub db: PathBuf,
    /// Model directory to load.
    pub model: PathBuf,
    /// Where the model runs.
    pub device: tapedeck_engine::backend::Device,
    /// Requests allowed to wait for the engine before 429 (one-at-a-time backend).
    pub max_queued_requests: usize,
    /// Serve through the engine's continuous-batching scheduler (with its prefix cache) instead
    /// of one generation at a time. `None`: one at a time.
    pub scheduler: Option<SchedulerConfig>,
    /// Proxy to this OpenAI-compatible server instead of loading `model` (upstream mode).
    pub upstream: Option<UpstreamConfig>,
    /// HTTP-layer options.
    pub app: AppOptions,
}

impl ServeConfig {
    /// Defaults (`127.0.0.1:8000`, `./tapedeck.db`) for a model directory.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            db: PathBuf::from("tapedeck.db"),
            model: model.into(),
            device: Default::default(),
            max_queued_requests: 256,
            scheduler: None,
            upstream: None,
            app: AppOptions::default(),
        }
    }
}

struct Inner {
    backend: Arc<dyn Backend>,
    store: Store,
    writer: RecordWriter,
    stitcher: Stitcher,
    metrics: Metrics,
    options: AppOptions,
    model_name: String,
    build_id: i64,
    started_unix: i64,
}

/// Shared state of the server: backend, store, writer, session index, metrics. Cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("model", &self.0.model_name)
            .field("build_id", &self.0.build_id)
            .finish()
    }
}

impl AppState {
    /// Registers this build in the store, rebuilds the session index from it, and starts the
    /// record writer.
    pub async fn new(backend: Arc<dyn Backend>, store: Store, options: AppOptions) -> Result<Self> {
        if options
            .session_header
            .parse::<axum::http::HeaderName>()
            .is_err()
        {
            return Err(Error::Config(format!(
                "session header {:?} is not a valid header name",
                options.session_header
            )));
        }
        let info = backend.info();
        let build_id = store
            .register_build(&BuildInfo::current(&info.backend, &info.device))
            .await?;
        let stitcher = Stitcher::rebuild(&store).await?;
        let writer = RecordWriter::spawn(store.clone(), options.writer);
        let model_name = options
            .served_model_name
            .clone()
            .unwrap_or_else(|| info.model_id.clone());
        Ok(AppState(Arc::new(Inner {
            backend,
            store,
            writer,
            stitcher,
            metrics: Metrics::default(),
            options: AppOptions {
                session_header: options.session_header.to_ascii_lowercase(),
                ..options
            },
            model_name,
            build_id,
            started_unix: now_us() / 1_000_000,
        })))
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.0.backend
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.0.store
    }

    /// The record writer (flush it in tests before reading the database).
    pub fn writer(&self) -> &RecordWriter {
        &self.0.writer
    }

    /// The session index.
    pub fn stitcher(&self) -> &Stitcher {
        &self.0.stitcher
    }

    /// Metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// The options.
    pub fn options(&self) -> &AppOptions {
        &self.0.options
    }

    /// The model name served.
    pub fn model_name(&self) -> &str {
        &self.0.model_name
    }

    /// Drains the record writer: call after the server stopped accepting requests.
    pub async fn shutdown(&self) -> WriterStats {
        self.0.writer.shutdown().await
    }

    /// Whether `model` names the served model (its served name or the backend's model ID).
    fn serves(&self, model: &str) -> bool {
        model == self.0.model_name || model == self.0.backend.info().model_id
    }

    /// A record with the arrival facts of a request.
    fn new_record(
        &self,
        endpoint: Endpoint,
        arrival: Arrival,
        headers: &HeaderMap,
    ) -> RequestRecord {
        let mut rec = RequestRecord::new(
            uuid::Uuid::new_v4(),
            endpoint,
            arrival.us,
            self.0.options.toggles,
        );
        rec.headers = select_headers(headers);
        rec.build_id = Some(self.0.build_id);
        rec
    }

    /// Counts a finished request and hands its record to the writer without waiting (see
    /// [`RecordWriter::submit_nowait`]).
    fn finish_nowait(&self, rec: RequestRecord, arrival: Arrival) {
        let m = &self.0.metrics;
        m.e2e.observe(arrival.at.elapsed());
        m.request_done(
            rec.endpoint.as_str(),
            rec.status,
            rec.prompt_tokens().unwrap_or(0),
            rec.completion_tokens().unwrap_or(0),
        );
        if rec.client_disconnected {
            m.client_disconnected();
        }
        tracing::debug!(
            id = %rec.id,
            endpoint = rec.endpoint.as_str(),
            status = rec.status,
            prompt_tokens = rec.prompt_tokens().unwrap_or(0),
            completion_tokens = rec.completion_tokens().unwrap_or(0),
            e2e_ms = arrival.at.elapsed().as_millis() as u64,
            "request done"
        );
        if self.0.options.record {
            self.0.writer.submit_nowait(rec);
        }
    }

    /// Records a request that failed before generating and returns its error response.
    async fn fail(&self, mut rec: RequestRecord, arrival: Arrival, err: ApiError) -> Response {
        rec.status = err.status().as_u16();
        rec.error = Some(err.record_text());
        rec.end_us = now_us();
        self.finish_nowait(rec, arrival);
        err.into_response()
    }
}

/// When a request arrived, stamped by the outermost middleware before the body is read.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// Monotonic clock, for durations.
    pub at: Instant,
    /// Wall clock, µs since the epoch, for the record.
    pub us: i64,
}

impl Arrival {
    fn now() -> Self {
        Arrival {
            at: Instant::now(),
            us: now_us(),
        }
    }

    fn of(req: &Request) -> Self {
        req.extensions()
            .get::<Arrival>()
            .copied()
            .unwrap_or_else(Arrival::now)
    }
}

async fn stamp_arrival(mut req: Request, next: Next) -> Response {
    req.extensions_mut().insert(Arrival::now());
    next.run(req).await
}

/// Headers never recorded: credentials. Any header whose name contains one of these is left out.
const SECRET_HEADER_PARTS: &[&str] = &["auth", "cookie", "key", "token", "secret", "password"];

/// The headers worth recording: all but credentials (see [`SECRET_HEADER_PARTS`]).
fn select_headers(headers: &HeaderMap) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for (name, value) in headers {
        let n = name.as_str();
        if SECRET_HEADER_PARTS.iter().any(|p| n.contains(p)) {
            continue;
        }
        let v = String::from_utf8_lossy(value.as_bytes()).into_owned();
        match out.get_mut(n) {
            Some(Value::String(prev)) => {
                prev.push_str(", ");
                prev.push_str(&v);
            }
            _ => {
                out.insert(n.to_string(), Value::String(v));
            }
        }
    }
    out
}

/// Reads a body up to the configured limit.
async fn read_body(body: Body, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        // `to_bytes` reports an exceeded limit as a `LengthLimitError` somewhere in the source
        // chain; anything else is a broken connection.
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(s) = src {
            if s.is::<http_body_util::LengthLimitError>() {
                return ApiError::payload_too_large(limit);
            }
            src = s.source();
        }
        ApiError::bad_request(format!("could not read the request body: {e}"))
    })
}

/// Parses a JSON body into `T`; every failure is a 400 in OpenAI's shape. This is the JSON
/// "extractor" of this server: handlers read the raw body first because the recording needs it
/// even when it does not parse.
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => ApiError::bad_request(format!("invalid request: {e}")),
            Category::Syntax | Category::Eof | Category::Io => {
                ApiError::bad_request(format!("malformed JSON body: {e}"))
            }
        }
    })
}

fn model_card(state: &AppState) -> Value {
    let info = state.backend().info();
    json!({
        "id": state.model_name(),
        "object": "model",
        "created": state.0.started_unix,
        "owned_by": "tapedeck",
        "root": info.model_id,
        "max_model_len": info.context_len,
    })
}

async fn models(State(state): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    if state.serves(&id) {
        axum::Json(model_card(&state)).into_response()
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

async fn health(State(state): State<AppState>) -> Response {
    let load = state.backend().load();
    let w = state.writer().stats();
    axum::Json(json!({
        "status": "ok",
        "model": state.model_name(),
        "running": load.running,
        "waiting": load.queued,
        "recorder": w,
    }))
    .into_response()
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let backend = state.backend();
    let body = state.metrics().render(
        backend.load(),
        backend.cache_stats(),
        state.writer().stats(),
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
    .into_response()
}

/// The router. Body limits are enforced by the handlers (so an oversized request is still
/// recorded), not by a layer.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(stamp_arrival))
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` resolves, then drains the record writer.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<WriterStats> {
    let addr = listener
        .local_addr()
        .map_err(Error::io("reading the listening address"))?;
    tracing::info!(%addr, model = state.model_name(), db = %state.store().path().display(), "serving");
    axum::serve(listener, app(state.clone()))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(Error::io("serving HTTP"))?;
    let stats = state.shutdown().await;
    tracing::info!(
        written = stats.written,
        dropped = stats.dropped,
        failed = stats.failed,
        "recorder drained"
    );
    state.store().close().await;
    Ok(stats)
}

/// `tapedeck serve`: loads the model, opens (or creates) the database, listens, and records every
/// request until Ctrl-C or SIGTERM; then stops accepting, lets in-flight responses finish, and
/// drains the record queue.
pub async fn serve(config: ServeConfig) -> Result<WriterStats> {
    let backend: Arc<dyn Backend> = match config.upstream.clone() {
        Some(up) => Arc::new(
            UpstreamBackend::connect(up)
                .await
                .map_err(|e| Error::Config(format!("upstream: {e}")))?,
        ),
        None => local_backend(&config).await?,
    };
    let store = Store::open(&config.db).await?;
    let state = AppState::new(backend, store, config.app.clone()).await?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
    run(listener, state, shutdown_signal()).await
}

/// The in-process engine backend of a serve configuration.
async fn local_backend(config: &ServeConfig) -> Result<Arc<dyn Backend>> {
    let dir = config.model.clone();
    let opts = tapedeck_engine::engine::EngineOptions {
        device: config.device,
        ..Default::default()
    };
    let engine = tokio::task::spawn_blocking(move || Engine::load_with(&dir, &opts))
        .await
        .map_err(|e| Error::Config(format!("model loading task failed: {e}")))??;
    let engine = Arc::new(engine);
    let backend: Arc<dyn Backend> = match config.scheduler.clone() {
        None => Arc::new(EngineBackend::new(engine, config.max_queued_requests)),
        Some(cfg) => Arc::new(
            SchedulerBackend::start(engine, cfg)
                .map_err(|e| Error::Config(format!("cannot start the scheduler: {e}")))?,
        ),
    };
    Ok(backend)
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
