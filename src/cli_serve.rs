//! `tapedeck serve` and `tapedeck sessions`: the recording front end and the captures it keeps.

use std::io::{BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use tapedeck_recorder::server::{self, ServeConfig};
use tapedeck_recorder::sessions;
use tapedeck_recorder::store::Store;
use tapedeck_recorder::upstream::UpstreamConfig;

use crate::embedded;

/// Arguments of `tapedeck serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model directory (Hugging Face layout) or an embedded fixture name.
    #[arg(long, default_value = embedded::DEFAULT_MODEL)]
    pub model: String,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: tapedeck_engine::backend::Device,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// SQLite database that records every request (created with its schema if missing).
    #[arg(long, default_value = "tapedeck.db")]
    pub db: PathBuf,
    /// A toggle, `name=value`; repeatable (see `tapedeck toggles`). Recorded with every request.
    #[arg(long = "toggle", value_name = "NAME=VALUE")]
    pub toggles: Vec<String>,
    /// Header that carries a client's session ID.
    #[arg(long, default_value = "x-session-id")]
    pub session_header: String,
    /// Name to serve the model under (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Requests allowed to wait for the engine before the server answers 429.
    #[arg(long, default_value_t = 256)]
    pub max_queued: usize,
    /// KV-cache budget of the batching scheduler, MiB.
    #[arg(long, default_value_t = 512)]
    pub kv_budget: usize,
    /// Do not record (only for measuring what recording costs; see docs/benchmarks.md).
    #[arg(long)]
    pub no_record: bool,
    /// Serve one request at a time without the batching scheduler and prefix cache (the
    /// simplest path, for isolating scheduler faults).
    #[arg(long)]
    pub no_batching: bool,
    /// Records the recorder's queue holds.
    #[arg(long, default_value_t = 4096)]
    pub record_queue: usize,
    /// What a full record queue does: `wait:MS` (then drop) or `drop`. Drops are counted in
    /// `/metrics`.
    #[arg(long, default_value = "wait:100")]
    pub record_queue_policy: String,
    /// Proxy to this OpenAI-compatible server (vLLM, SGLang, llama.cpp, another tapedeck) instead
    /// of serving a model: answers pass through unchanged and are recorded (`--model` is unused).
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// With `--upstream`: a model directory (or embedded fixture name) whose tokenizer and chat
    /// template give the recorded prompt and output token IDs.
    #[arg(long, value_name = "DIR", requires = "upstream")]
    pub tokenizer: Option<String>,
    /// With `--upstream`: ask the upstream for this many top logprobs per token when the client
    /// asked for none, record them, and strip them from the client's response.
    #[arg(long, value_name = "K", requires = "upstream", value_parser = clap::value_parser!(u32).range(0..=20))]
    pub upstream_logprobs: Option<u32>,
}

/// Runs `tapedeck serve` until Ctrl-C or SIGTERM.
pub fn serve(args: ServeArgs) -> Result<()> {
    let toggles = crate::cli_generate::parse_toggles(&args.toggles)?;
    let mut cfg = match &args.upstream {
        // The model directory is not loaded in upstream mode.
        Some(_) => ServeConfig::new(&args.model),
        None => ServeConfig::new(embedded::resolve(&args.model)?),
    };
    if let Some(url) = &args.upstream {
        let mut up = UpstreamConfig::new(url.clone());
        up.tokenizer = match &args.tokenizer {
            Some(t) => Some(embedded::resolve(t).context("--tokenizer")?),
            None => None,
        };
        up.logprobs = args.upstream_logprobs;
        cfg.upstream = Some(up);
    }
    cfg.listen = args.listen;
    cfg.device = args.device;
    cfg.db = args.db;
    cfg.max_queued_requests = args.max_queued;
    cfg.scheduler = (!args.no_batching).then(|| tapedeck_engine::scheduler::SchedulerConfig {
        kv_budget_bytes: args.kv_budget << 20,
        max_waiting: args.max_queued,
        kv_dtype: toggles.kv_dtype,
        ..Default::default()
    });
    cfg.app.toggles = toggles;
    cfg.app.record = !args.no_record;
    cfg.app.session_header = args.session_header.to_ascii_lowercase();
    cfg.app.served_model_name = args.served_model_name.or_else(|| {
        (args.upstream.is_none() && embedded::names().contains(&args.model.as_str()))
            .then(|| args.model.clone())
    });
    cfg.app.writer.capacity = args.record_queue;
    cfg.app.writer.policy = args
        .record_queue_policy
        .parse()
        .context("--record-queue-policy")?;
    let rt = tokio::runtime::Runtime::new()?;
    let what = match &cfg.upstream {
        Some(up) => format!("upstream {}", up.url),
        None => format!("model {} on {}", cfg.model.display(), cfg.device),
    };
    eprintln!(
        "tapedeck serve: {what}, listening on http://{}, recording to {}",
        cfg.listen,
        cfg.db.display()
    );
    let stats = rt.block_on(server::serve(cfg))?;
    eprintln!("recorder drained: {stats:?}");
    Ok(())
}

/// `tapedeck sessions ...`.
#[derive(Subcommand, Debug)]
pub enum SessionsCommand {
    /// List recorded sessions.
    List {
        /// Database file.
        #[arg(long, default_value = "tapedeck.db")]
        db: PathBuf,
    },
    /// Print one session as JSON.
    Show {
        /// Session ID.
        id: String,
        /// Database file.
        #[arg(long, default_value = "tapedeck.db")]
        db: PathBuf,
    },
    /// Write sessions as JSONL (`tapedeck.session.v1`), all unless IDs are given.
    Export {
        /// Session IDs.
        ids: Vec<String>,
        /// Database file.
        #[arg(long, default_value = "tapedeck.db")]
        db: PathBuf,
        /// Output file (default: standard output).
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
    /// Load JSONL sessions into a database (requests already present are skipped).
    Import {
        /// JSONL file.
        file: PathBuf,
        /// Database file (created if missing).
        #[arg(long, default_value = "tapedeck.db")]
        db: PathBuf,
    },
}

async fn open(db: &std::path::Path, create: bool) -> Result<Store> {
    if !create && !db.exists() {
        anyhow::bail!("no database at {}", db.display());
    }
    Store::open(db)
        .await
        .with_context(|| format!("opening {}", db.display()))
}

/// Runs `tapedeck sessions ...`.
pub fn sessions(cmd: SessionsCommand) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        match cmd {
            SessionsCommand::List { db } => {
                let store = open(&db, false).await?;
                let list = sessions::list(&store).await?;
                println!(
                    "{:<38} {:>8} {:>10} {:>10} {:>6}  CLIENT",
                    "SESSION", "REQUESTS", "PROMPT", "COMPLETION", "ERRORS"
                );
                for s in list {
                    println!(
                        "{:<38} {:>8} {:>10} {:>10} {:>6}  {}",
                        s.id,
                        s.requests,
                        s.prompt_tokens,
                        s.completion_tokens,
                        s.errors,
                        s.client_hint.unwrap_or_default()
                    );
                }
            }
            SessionsCommand::Show { id, db } => {
                let store = open(&db, false).await?;
                let line = sessions::show(&store, &id).await?;
                println!("{}", serde_json::to_string_pretty(&line)?);
            }
            SessionsCommand::Export { ids, db, out } => {
                let store = open(&db, false).await?;
                let n = match out {
                    Some(path) => {
                        let f = std::fs::File::create(&path)
                            .with_context(|| format!("creating {}", path.display()))?;
                        let mut w = std::io::BufWriter::new(f);
                        let n = sessions::export(&store, &ids, &mut w).await?;
                        w.flush()?;
                        n
                    }
                    None => {
                        let mut w = std::io::stdout().lock();
                        sessions::export(&store, &ids, &mut w).await?
                    }
                };
                eprintln!("exported {n} sessions");
            }
            SessionsCommand::Import { file, db } => {
                let store = open(&db, true).await?;
                let f = std::fs::File::open(&file)
                    .with_context(|| format!("opening {}", file.display()))?;
                let r = sessions::import(&store, BufReader::new(f)).await?;
                eprintln!(
                    "imported {} sessions: {} requests inserted, {} already present",
                    r.sessions, r.requests, r.skipped
                );
            }
        }
        Ok(())
    })
}
