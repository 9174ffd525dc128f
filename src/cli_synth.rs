//! `tapedeck synth sessions`: opencode-shaped multi-turn sessions with planted needles.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use tapedeck_synth::{SynthConfig, ToolDetail};

use crate::embedded;

/// `tapedeck synth ...`.
#[derive(Subcommand, Debug)]
pub enum SynthCommand {
    /// Generate sessions as `tapedeck.session.v1` JSONL.
    Sessions(SessionsArgs),
    /// Record sessions: play them through a local `tapedeck serve` of the target engine as a
    /// client would, so the database holds real token IDs, logits summaries and timings of every
    /// assistant turn, ready for replay.
    Record(RecordArgs),
}

/// Arguments of `tapedeck synth record`.
#[derive(Args, Debug)]
pub struct RecordArgs {
    /// Sessions to play (JSONL).
    #[arg(long)]
    pub sessions: PathBuf,
    /// The engine to record: `engine:MODEL?toggles` (MODEL: directory or embedded name).
    #[arg(long, default_value = "engine:tiny-qwen2")]
    pub target: String,
    /// Database to record into (created if missing).
    #[arg(long, default_value = "tapedeck.db")]
    pub db: PathBuf,
    /// Sessions played at once.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Engine worker threads.
    #[arg(long)]
    pub threads: Option<usize>,
}

fn record(a: RecordArgs) -> Result<()> {
    let (model, toggles) = tapedeck_replayer::target::engine::parse_spec(&a.target)
        .map_err(|e| anyhow::anyhow!("--target: {e}"))?;
    let dir = embedded::resolve(&model)?;
    let name = if embedded::names().contains(&model.as_str()) {
        model.clone()
    } else {
        dir.file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| model.clone())
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let sessions = crate::cli_replay::load_sessions(&a.sessions, &Default::default()).await?;
        let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();
        let server =
            crate::recording::LocalServer::start(&dir, &name, toggles, &a.db, a.threads).await?;
        eprintln!(
            "recording {} sessions ({turns} turns) through {} into {}",
            sessions.len(),
            server.url,
            a.db.display()
        );
        let played =
            crate::recording::play(sessions, &server.url, a.concurrency, a.threads).await?;
        let stats = server.stop().await?;
        eprintln!(
            "{} requests answered ({} failed), {} records written, {} dropped",
            played.speed.completed, played.speed.failed, stats.written, stats.dropped
        );
        Ok(())
    })
}

/// Arguments of `tapedeck synth sessions`.
#[derive(Args, Debug)]
pub struct SessionsArgs {
    /// Number of sessions.
    #[arg(long, default_value_t = 4)]
    pub count: usize,
    /// Agent turns per session, `A..B` (inclusive).
    #[arg(long, default_value = "4..8")]
    pub turns: String,
    /// Needle depths in tokens, comma-separated; session i gets the (i mod n)-th.
    #[arg(long, value_delimiter = ',')]
    pub context: Vec<usize>,
    /// Seed: the same seed and model give the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Model whose tokenizer and chat template measure depths (directory or embedded name).
    #[arg(long, default_value = embedded::DEFAULT_MODEL)]
    pub model: String,
    /// Round each depth up to a multiple of this (16: KV block, 64: a prefill chunk).
    #[arg(long)]
    pub align: Option<usize>,
    /// Add a compaction request after which the history is rewritten.
    #[arg(long)]
    pub compaction: bool,
    /// Send only the first paragraph of each tool description (small-context models).
    #[arg(long)]
    pub brief_tools: bool,
    /// System prompt length in characters.
    #[arg(long, default_value_t = 10_000)]
    pub system_prompt_chars: usize,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Output file.
    #[arg(short, long)]
    pub out: PathBuf,
}

fn parse_range(s: &str) -> Result<std::ops::RangeInclusive<usize>> {
    let (a, b) = s
        .split_once("..")
        .map(|(a, b)| (a, b.trim_start_matches('=')))
        .unwrap_or((s, s));
    let (a, b): (usize, usize) = (
        a.trim().parse().with_context(|| format!("--turns {s:?}"))?,
        b.trim().parse().with_context(|| format!("--turns {s:?}"))?,
    );
    if a == 0 || a > b {
        bail!("--turns {s:?}: expected A..B with 1 <= A <= B");
    }
    Ok(a..=b)
}

/// Runs `tapedeck synth ...`.
pub fn run(cmd: SynthCommand) -> Result<()> {
    let a = match cmd {
        SynthCommand::Sessions(a) => a,
        SynthCommand::Record(r) => return record(r),
    };
    let dir = embedded::resolve(&a.model)?;
    let mut cfg = SynthConfig::new(&dir);
    if embedded::names().contains(&a.model.as_str()) {
        cfg.model = a.model.clone();
    }
    cfg.count = a.count;
    cfg.turns = parse_range(&a.turns)?;
    cfg.contexts = a.context.clone();
    cfg.seed = a.seed;
    cfg.align = a.align;
    cfg.compaction = a.compaction;
    cfg.system_prompt_chars = a.system_prompt_chars;
    cfg.max_tokens = a.max_tokens;
    if a.brief_tools {
        cfg.tool_detail = ToolDetail::Brief;
    }
    let sessions = tapedeck_synth::generate(&cfg)?;
    tapedeck_synth::write_jsonl(&a.out, &sessions)?;
    let requests: usize = sessions.iter().map(|s| s.requests.len()).sum();
    eprintln!(
        "wrote {} sessions ({requests} requests) to {}",
        sessions.len(),
        a.out.display()
    );
    Ok(())
}
