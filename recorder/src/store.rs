//! The SQLite store: opening (and creating) the database, migrations, and the queries the writer,
//! the stitcher and the session tools need.
//!
//! SQLite in WAL mode lets readers (`tapedeck sessions`, a replay) work while `serve` writes; with
//! `synchronous = NORMAL` a committed transaction survives a process crash (only an OS crash can
//! lose the last ones). Queries are plain `sqlx::query` with bound parameters rather than the
//! compile-checked macros so that building the workspace never needs a database or a `.sqlx`
//! cache; each query is covered by a round-trip test instead.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::Row;
use tapedeck_engine::Toggles;
use uuid::Uuid;

use crate::blob;
use crate::error::{Error, Result};
use crate::record::{
    BuildInfo, Endpoint, PromptScores, RecordedOutput, RequestKind, RequestRecord, SessionRef,
    SessionSource, StitchMethod,
};

/// The migrations under `migrations/` at the workspace root, embedded at compile time.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// A handle on the recording database. Cheap to clone (a connection pool).
#[derive(Debug, Clone)]
pub struct Store {
    pool: SqlitePool,
    path: PathBuf,
}

/// A row of `sessions` with a summary of its requests.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SessionSummary {
    /// Session ID.
    pub id: String,
    /// How it was identified.
    pub source: SessionSource,
    /// Client hint (user agent) at creation.
    pub client_hint: Option<String>,
    /// Creation time, µs since the epoch.
    pub created_us: i64,
    /// Number of requests.
    pub requests: i64,
    /// Arrival of the first request.
    pub first_arrival_us: Option<i64>,
    /// End of the last request.
    pub last_end_us: Option<i64>,
    /// Sum of prompt tokens over its requests.
    pub prompt_tokens: i64,
    /// Sum of completion tokens over its requests.
    pub completion_tokens: i64,
    /// Requests that did not end with status 200 or that carry an error.
    pub errors: i64,
}

/// What the stitcher needs from one earlier request to rebuild its index after a restart.
#[derive(Debug, Clone)]
pub struct StitchRow {
    /// The request.
    pub request: Uuid,
    /// Its session.
    pub session_id: String,
    /// Its session's source.
    pub source: SessionSource,
    /// Its turn index.
    pub turn: u32,
    /// Its kind.
    pub kind: RequestKind,
    /// Its continuation hash, if any.
    pub continuation_hash: Option<String>,
    /// Its visible answer (compaction summaries are matched by it).
    pub content: Option<String>,
}

const REQUEST_COLUMNS: &str = "r.id, r.session_id, r.turn_index, r.parent_id, r.stitch, r.kind, \
    r.endpoint, r.arrival_us, r.end_us, r.status_code, r.error, r.request_json, r.headers_json, \
    r.model, r.toggles, r.encoding_report_json, r.prompt_ids, r.output_ids, r.output_text, \
    r.content_text, r.reasoning_text, r.tool_calls_json, r.finish_reason, r.token_times, r.logits, \
    r.prompt_logits, r.prompt_logits_from, r.build_id, r.client_disconnected, r.continuation_hash, \
    r.probe_json, s.source AS session_source, s.client_hint AS session_client_hint";

impl Store {
    /// Opens the database at `path`, creating the file if it is missing, and applies migrations.
    pub async fn open(path: &Path) -> Result<Store> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(Error::io(format!(
                "creating the directory of {}",
                path.display()
            )))?;
        }
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .map_err(|source| Error::Open {
                path: path.to_path_buf(),
                source,
            })?;
        MIGRATOR.run(&pool).await.map_err(|source| Error::Migrate {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Store {
            pool,
            path: path.to_path_buf(),
        })
    }

    /// The connection pool, for queries this module does not offer.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Closes the pool, waiting for connections to finish (checkpointing the WAL).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Returns the `builds.id` of a build identity, inserting it on first sight.
    pub async fn register_build(&self, build: &BuildInfo) -> Result<i64> {
        sqlx::query(
            "INSERT OR IGNORE INTO builds (version, git_revision, features, backend, device, \
             first_seen_us) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(&build.version)
        .bind(&build.git_revision)
        .bind(&build.features)
        .bind(&build.backend)
        .bind(&build.device)
        .bind(crate::record::now_us())
        .execute(&self.pool)
        .await
        .map_err(Error::db("registering the build"))?;
        let id: i64 = sqlx::query_scalar(
            "SELECT id FROM builds WHERE version = ? AND git_revision = ? AND features = ? \
             AND backend = ? AND device = ?",
        )
        .bind(&build.version)
        .bind(&build.git_revision)
        .bind(&build.features)
        .bind(&build.backend)
        .bind(&build.device)
        .fetch_one(&self.pool)
        .await
        .map_err(Error::db("looking up the build"))?;
        Ok(id)
    }

    /// The build identity stored under `id`.
    pub async fn build(&self, id: i64) -> Result<Option<BuildInfo>> {
        let row = sqlx::query(
            "SELECT version, git_revision, features, backend, device FROM builds WHERE id = ?",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(Error::db("reading a build"))?;
        row.map(|r| {
            Ok(BuildInfo {
                version: get(&r, "version")?,
                git_revision: get(&r, "git_revision")?,
                features: get(&r, "features")?,
                backend: get(&r, "backend")?,
                device: get(&r, "device")?,
            })
        })
        .transpose()
    }

    /// Writes records in one transaction: all of them or none. Sessions are created on first use.
    pub async fn insert_batch(&self, records: &[RequestRecord]) -> Result<()> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(Error::db("starting a write transaction"))?;
        for rec in records {
            insert_one(&mut tx, rec).await?;
        }
        tx.commit()
            .await
            .map_err(Error::db("committing a batch of records"))
    }

    /// Creates a session row if it does not exist yet.
    pub async fn ensure_session(
        &self,
        id: &str,
        source: SessionSource,
        client_hint: Option<&str>,
        created_us: i64,
    ) -> Result<()> {
        sqlx::query(
            "INSERT OR IGNORE INTO sessions (id, source, client_hint, created_us) VALUES (?, ?, ?, ?)",
        )
        .bind(id)
        .bind(source.as_str())
        .bind(client_hint)
        .bind(created_us)
        .execute(&self.pool)
        .await
        .map_err(Error::db(format!("creating session {id}")))?;
        Ok(())
    }

    /// One request by ID, blobs decoded.
    pub async fn request(&self, id: Uuid) -> Result<Option<RequestRecord>> {
        let sql = format!(
            "SELECT {REQUEST_COLUMNS} FROM requests r LEFT JOIN sessions s ON s.id = r.session_id \
             WHERE r.id = ?"
        );
        let row = sqlx::query(&sql)
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await
            .map_err(Error::db(format!("reading request {id}")))?;
        row.as_ref().map(row_to_record).transpose()
    }

    /// The requests of a session in turn order (arrival order for ties).
    pub async fn session_requests(&self, session_id: &str) -> Result<Vec<RequestRecord>> {
        let sql = format!(
            "SELECT {REQUEST_COLUMNS} FROM requests r LEFT JOIN sessions s ON s.id = r.session_id \
             WHERE r.session_id = ? ORDER BY r.turn_index, r.arrival_us, r.id"
        );
        let rows = sqlx::query(&sql)
            .bind(session_id)
            .fetch_all(&self.pool)
            .await
            .map_err(Error::db(format!(
                "reading the requests of session {session_id}"
            )))?;
        rows.iter().map(row_to_record).collect()
    }

    /// Every session with a summary, oldest first.
    pub async fn sessions(&self) -> Result<Vec<SessionSummary>> {
        self.session_summaries(None).await
    }

    /// One session's summary.
    pub async fn session(&self, id: &str) -> Result<Option<SessionSummary>> {
        Ok(self.session_summaries(Some(id)).await?.pop())
    }

    async fn session_summaries(&self, id: Option<&str>) -> Result<Vec<SessionSummary>> {
        let sql = format!(
            "SELECT s.id, s.source, s.client_hint, s.created_us, COUNT(r.id) AS n, \
             MIN(r.arrival_us) AS first_arrival, MAX(r.end_us) AS last_end, \
             COALESCE(SUM(r.prompt_tokens), 0) AS pt, COALESCE(SUM(r.completion_tokens), 0) AS ct, \
             COALESCE(SUM(CASE WHEN r.status_code <> 200 OR r.error IS NOT NULL THEN 1 ELSE 0 END), 0) AS errors \
             FROM sessions s LEFT JOIN requests r ON r.session_id = s.id {} \
             GROUP BY s.id ORDER BY s.created_us, s.id",
            if id.is_some() { "WHERE s.id = ?" } else { "" }
        );
        let mut q = sqlx::query(&sql);
        if let Some(id) = id {
            q = q.bind(id);
        }
        let rows = q
            .fetch_all(&self.pool)
            .await
            .map_err(Error::db("listing sessions"))?;
        rows.iter()
            .map(|r| {
                Ok(SessionSummary {
                    id: get(r, "id")?,
                    source: parse_col(r, "source")?,
                    client_hint: get(r, "client_hint")?,
                    created_us: get(r, "created_us")?,
                    requests: get(r, "n")?,
                    first_arrival_us: get(r, "first_arrival")?,
                    last_end_us: get(r, "last_end")?,
                    prompt_tokens: get(r, "pt")?,
                    completion_tokens: get(r, "ct")?,
                    errors: get(r, "errors")?,
                })
            })
            .collect()
    }

    /// Number of recorded requests.
    pub async fn count_requests(&self) -> Result<i64> {
        sqlx::query_scalar("SELECT COUNT(*) FROM requests")
            .fetch_one(&self.pool)
            .await
            .map_err(Error::db("counting requests"))
    }

    /// Whether a request ID is already recorded.
    pub async fn has_request(&self, id: Uuid) -> Result<bool> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM requests WHERE id = ?")
            .bind(id.to_string())
            .fetch_one(&self.pool)
            .await
            .map_err(Error::db("looking up a request"))?;
        Ok(n > 0)
    }

    /// What the stitcher needs to rebuild its index: every request that belongs to a session.
    pub async fn stitch_rows(&self) -> Result<Vec<StitchRow>> {
        let rows = sqlx::query(
            "SELECT r.id, r.session_id, s.source, r.turn_index, r.kind, r.continuation_hash, \
             CASE WHEN r.kind = 'compaction' THEN r.content_text END AS content \
             FROM requests r JOIN sessions s ON s.id = r.session_id \
             WHERE r.turn_index IS NOT NULL ORDER BY r.arrival_us",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(Error::db("reading the stitch index"))?;
        rows.iter()
            .map(|r| {
                let turn: i64 = get(r, "turn_index")?;
                Ok(StitchRow {
                    request: parse_col(r, "id")?,
                    session_id: get(r, "session_id")?,
                    source: parse_col(r, "source")?,
                    turn: u32::try_from(turn).unwrap_or(u32::MAX),
                    kind: parse_col(r, "kind")?,
                    continuation_hash: get(r, "continuation_hash")?,
                    content: get(r, "content")?,
                })
            })
            .collect()
    }
}

async fn insert_one(conn: &mut sqlx::SqliteConnection, rec: &RequestRecord) -> Result<()> {
    let id = rec.id.to_string();
    if let Some(s) = &rec.session {
        sqlx::query(
            "INSERT OR IGNORE INTO sessions (id, source, client_hint, created_us) VALUES (?, ?, ?, ?)",
        )
        .bind(&s.id)
        .bind(s.source.as_str())
        .bind(&s.client_hint)
        .bind(rec.arrival_us)
        .execute(&mut *conn)
        .await
        .map_err(Error::db(format!("creating session {} for request {id}", s.id)))?;
    }
    let headers = serde_json::to_string(&rec.headers).map_err(Error::json("encoding headers"))?;
    let toggles_json =
        serde_json::to_string(&rec.toggles).map_err(Error::json("encoding toggles"))?;
    let report = rec
        .encoding_report
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(Error::json("encoding the encoding report"))?;
    let probe = rec
        .probe
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(Error::json("encoding the probe"))?;
    let out = rec.output.as_ref();
    let tool_calls = out
        .filter(|o| !o.tool_calls.is_empty())
        .map(|o| serde_json::to_string(&o.tool_calls))
        .transpose()
        .map_err(Error::json("encoding tool calls"))?;
    sqlx::query(
        "INSERT INTO requests (id, session_id, turn_index, parent_id, stitch, kind, endpoint, \
         arrival_us, first_token_us, end_us, status_code, error, request_json, headers_json, model, \
         toggles, toggles_json, encoding_report_json, prompt_ids, output_ids, output_text, \
         content_text, reasoning_text, tool_calls_json, finish_reason, token_times, logits, \
         prompt_logits, prompt_logits_from, prompt_tokens, completion_tokens, build_id, \
         client_disconnected, continuation_hash, probe_json) VALUES \
         (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(&id)
    .bind(rec.session.as_ref().map(|s| s.id.as_str()))
    .bind(rec.session.as_ref().map(|s| i64::from(s.turn)))
    .bind(rec.session.as_ref().and_then(|s| s.parent).map(|p| p.to_string()))
    .bind(rec.session.as_ref().map(|s| s.stitch.as_str()))
    .bind(rec.kind.as_str())
    .bind(rec.endpoint.as_str())
    .bind(rec.arrival_us)
    .bind(rec.first_token_us())
    .bind(rec.end_us)
    .bind(i64::from(rec.status))
    .bind(&rec.error)
    .bind(&rec.request_body)
    .bind(headers)
    .bind(&rec.model)
    .bind(rec.toggles.to_string())
    .bind(toggles_json)
    .bind(report)
    .bind(rec.prompt_ids.as_deref().map(blob::encode_tokens))
    .bind(out.map(|o| blob::encode_tokens(&o.token_ids)))
    .bind(out.map(|o| o.text.as_str()))
    .bind(out.map(|o| o.content.as_str()))
    .bind(out.and_then(|o| o.reasoning.as_deref()))
    .bind(tool_calls)
    .bind(out.and_then(|o| o.finish_reason.as_deref()))
    .bind(out.map(|o| blob::encode_times(&o.token_offsets_us)))
    .bind(out.map(|o| blob::encode_logits(&o.logits)))
    .bind(rec.prompt_scores.as_ref().map(|p| blob::encode_logits(&p.summaries)))
    .bind(rec.prompt_scores.as_ref().map(|p| i64::from(p.from)))
    .bind(rec.prompt_tokens().map(|n| n as i64))
    .bind(rec.completion_tokens().map(|n| n as i64))
    .bind(rec.build_id)
    .bind(rec.client_disconnected)
    .bind(&rec.continuation_hash)
    .bind(probe)
    .execute(&mut *conn)
    .await
    .map_err(Error::db(format!("inserting request {id}")))?;
    Ok(())
}

fn get<'r, T>(row: &'r SqliteRow, col: &str) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
{
    row.try_get(col)
        .map_err(Error::db(format!("reading column {col}")))
}

fn parse_col<T: FromStr>(row: &SqliteRow, col: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    let s: String = get(row, col)?;
    s.parse().map_err(|e: T::Err| Error::Corrupt {
        context: format!("column {col}"),
        message: e.to_string(),
    })
}

fn row_to_record(r: &SqliteRow) -> Result<RequestRecord> {
    let id: Uuid = parse_col(r, "id")?;
    let rid = id.to_string();
    let corrupt = |col: &str, message: String| Error::Corrupt {
        context: format!("request {rid}: column {col}"),
        message,
    };
    let decode_json = |col: &str, s: Option<String>| -> Result<Option<serde_json::Value>> {
        s.map(|s| serde_json::from_str(&s).map_err(|e| corrupt(col, e.to_string())))
            .transpose()
    };
    let blob_err = |column: &'static str| {
        let request = rid.clone();
        move |source| Error::Blob {
            request,
            column,
            source,
        }
    };

    let session_id: Option<String> = get(r, "session_id")?;
    let session = match session_id {
        None => None,
        Some(sid) => {
            let turn: Option<i64> = get(r, "turn_index")?;
            let parent: Option<String> = get(r, "parent_id")?;
            let stitch: Option<String> = get(r, "stitch")?;
            let source: Option<String> = get(r, "session_source")?;
            Some(SessionRef {
                id: sid,
                source: source
                    .as_deref()
                    .unwrap_or("content")
                    .parse()
                    .map_err(|e| corrupt("sessions.source", e))?,
                client_hint: get(r, "session_client_hint")?,
                turn: u32::try_from(turn.unwrap_or(0)).unwrap_or(u32::MAX),
                parent: parent
                    .map(|p| p.parse::<Uuid>())
                    .transpose()
                    .map_err(|e| corrupt("parent_id", e.to_string()))?,
                stitch: stitch
                    .as_deref()
                    .unwrap_or("new")
                    .parse::<StitchMethod>()
                    .map_err(|e| corrupt("stitch", e))?,
            })
        }
    };

    let headers = match decode_json("headers_json", get(r, "headers_json")?)? {
        Some(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let toggles_text: String = get(r, "toggles")?;
    let toggles: Toggles = toggles_text
        .parse()
        .map_err(|e: tapedeck_engine::Error| corrupt("toggles", e.to_string()))?;
    let encoding_report = decode_json("encoding_report_json", get(r, "encoding_report_json")?)?
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| corrupt("encoding_report_json", e.to_string()))?;
    let prompt_ids = get::<Option<Vec<u8>>>(r, "prompt_ids")?
        .map(|b| blob::decode_tokens(&b))
        .transpose()
        .map_err(blob_err("prompt_ids"))?;

    let output_ids: Option<Vec<u8>> = get(r, "output_ids")?;
    let output = match output_ids {
        None => None,
        Some(b) => {
            let tool_calls = decode_json("tool_calls_json", get(r, "tool_calls_json")?)?
                .map(serde_json::from_value)
                .transpose()
                .map_err(|e| corrupt("tool_calls_json", e.to_string()))?
                .unwrap_or_default();
            Some(RecordedOutput {
                token_ids: blob::decode_tokens(&b).map_err(blob_err("output_ids"))?,
                text: get::<Option<String>>(r, "output_text")?.unwrap_or_default(),
                content: get::<Option<String>>(r, "content_text")?.unwrap_or_default(),
                reasoning: get(r, "reasoning_text")?,
                tool_calls,
                finish_reason: get(r, "finish_reason")?,
                token_offsets_us: get::<Option<Vec<u8>>>(r, "token_times")?
                    .map(|b| blob::decode_times(&b))
                    .transpose()
                    .map_err(blob_err("token_times"))?
                    .unwrap_or_default(),
                logits: get::<Option<Vec<u8>>>(r, "logits")?
                    .map(|b| blob::decode_logits(&b))
                    .transpose()
                    .map_err(blob_err("logits"))?
                    .unwrap_or_default(),
            })
        }
    };
    let prompt_scores = match get::<Option<Vec<u8>>>(r, "prompt_logits")? {
        None => None,
        Some(b) => Some(PromptScores {
            from: u32::try_from(get::<Option<i64>>(r, "prompt_logits_from")?.unwrap_or(0))
                .unwrap_or(0),
            summaries: blob::decode_logits(&b).map_err(blob_err("prompt_logits"))?,
        }),
    };
    let status: i64 = get(r, "status_code")?;
    Ok(RequestRecord {
        id,
        session,
        kind: parse_col(r, "kind")?,
        endpoint: parse_col::<Endpoint>(r, "endpoint")?,
        arrival_us: get(r, "arrival_us")?,
        end_us: get(r, "end_us")?,
        status: u16::try_from(status).map_err(|e| corrupt("status_code", e.to_string()))?,
        error: get(r, "error")?,
        request_body: get(r, "request_json")?,
        headers,
        model: get(r, "model")?,
        toggles,
        encoding_report,
        prompt_ids,
        output,
        prompt_scores,
        build_id: get(r, "build_id")?,
        client_disconnected: get(r, "client_disconnected")?,
        probe: decode_json("probe_json", get(r, "probe_json")?)?
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| corrupt("probe_json", e.to_string()))?,
        continuation_hash: get(r, "continuation_hash")?,
    })
}

/// A replay run as the store keeps it. The recorder does not depend on the replayer, so the run
/// arrives as its scalar facts plus its summary JSON (`tapedeck.run.v1`).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRun {
    /// Run ID.
    pub id: String,
    /// Summary format tag.
    pub format: String,
    /// Target spec replayed against.
    pub target_spec: String,
    /// `engine` or `http`.
    pub target_kind: String,
    /// Toggles of the target, canonical text, when known.
    pub toggles: Option<String>,
    /// Build of the target, when known.
    pub build: Option<String>,
    /// Start, µs since the epoch.
    pub started_at_us: i64,
    /// End, µs since the epoch.
    pub ended_at_us: i64,
    /// The run was cancelled.
    pub cancelled: bool,
    /// Any turn was flagged.
    pub flagged: bool,
    /// The whole summary, JSON.
    pub summary_json: String,
}

/// One replayed turn of a stored run.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTurn {
    /// Session.
    pub session_id: String,
    /// Turn index.
    pub turn: i64,
    /// Flags, comma-separated (empty when not flagged).
    pub flags: String,
    /// Error text of a failed turn.
    pub error: Option<String>,
    /// The turn's row, JSON.
    pub row_json: String,
}

impl Store {
    /// Writes a replay run and its turns in one transaction.
    pub async fn save_run(&self, run: &StoredRun, turns: &[StoredTurn]) -> Result<()> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(Error::db("starting the run transaction"))?;
        sqlx::query(
            "INSERT INTO runs (id, format, target_spec, target_kind, toggles, build, \
             started_at_us, ended_at_us, cancelled, flagged, summary_json) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&run.id)
        .bind(&run.format)
        .bind(&run.target_spec)
        .bind(&run.target_kind)
        .bind(&run.toggles)
        .bind(&run.build)
        .bind(run.started_at_us)
        .bind(run.ended_at_us)
        .bind(run.cancelled)
        .bind(run.flagged)
        .bind(&run.summary_json)
        .execute(&mut *tx)
        .await
        .map_err(Error::db("inserting a run"))?;
        for t in turns {
            sqlx::query(
                "INSERT INTO run_turns (run_id, session_id, turn, flagged, flags, error, row_json) \
                 VALUES (?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(&run.id)
            .bind(&t.session_id)
            .bind(t.turn)
            .bind(!t.flags.is_empty())
            .bind(&t.flags)
            .bind(&t.error)
            .bind(&t.row_json)
            .execute(&mut *tx)
            .await
            .map_err(Error::db("inserting a run turn"))?;
        }
        tx.commit().await.map_err(Error::db("committing a run"))
    }

    /// Every stored run, oldest first, without turns.
    pub async fn runs(&self) -> Result<Vec<StoredRun>> {
        self.runs_where(None).await
    }

    /// One stored run by ID.
    pub async fn run(&self, id: &str) -> Result<Option<StoredRun>> {
        Ok(self.runs_where(Some(id)).await?.pop())
    }

    async fn runs_where(&self, id: Option<&str>) -> Result<Vec<StoredRun>> {
        let sql = format!(
            "SELECT id, format, target_spec, target_kind, toggles, build, started_at_us, \
             ended_at_us, cancelled, flagged, summary_json FROM runs {} ORDER BY started_at_us, id",
            if id.is_some() { "WHERE id = ?" } else { "" }
        );
        let mut q = sqlx::query(&sql);
        if let Some(id) = id {
            q = q.bind(id);
        }
        let rows = q
            .fetch_all(&self.pool)
            .await
            .map_err(Error::db("listing runs"))?;
        rows.iter()
            .map(|r| {
                Ok(StoredRun {
                    id: get(r, "id")?,
                    format: get(r, "format")?,
                    target_spec: get(r, "target_spec")?,
                    target_kind: get(r, "target_kind")?,
                    toggles: get(r, "toggles")?,
                    build: get(r, "build")?,
                    started_at_us: get(r, "started_at_us")?,
                    ended_at_us: get(r, "ended_at_us")?,
                    cancelled: get(r, "cancelled")?,
                    flagged: get(r, "flagged")?,
                    summary_json: get(r, "summary_json")?,
                })
            })
            .collect()
    }

    /// The turns of a stored run, in (session, turn) order.
    pub async fn run_turns(&self, run_id: &str) -> Result<Vec<StoredTurn>> {
        let rows = sqlx::query(
            "SELECT session_id, turn, flags, error, row_json FROM run_turns WHERE run_id = ? \
             ORDER BY session_id, turn",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await
        .map_err(Error::db("listing run turns"))?;
        rows.iter()
            .map(|r| {
                Ok(StoredTurn {
                    session_id: get(r, "session_id")?,
                    turn: get(r, "turn")?,
                    flags: get(r, "flags")?,
                    error: get(r, "error")?,
                    row_json: get(r, "row_json")?,
                })
            })
            .collect()
    }
}
