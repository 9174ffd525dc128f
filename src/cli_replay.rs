//! `tapedeck replay`: re-run recorded sessions against a candidate and measure speed and fidelity.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tapedeck_replayer::history::HistoryMode;
use tapedeck_replayer::merge::{merge_runs, missing_shards};
use tapedeck_replayer::metrics::Slo;
use tapedeck_replayer::report::{self as run_report, Pacing, RunSummary, ThinkTime};
use tapedeck_replayer::run::{replay, ReplayConfig};
use tapedeck_replayer::session::{
    parse_time, session_from_line, Session, SessionFilter, SessionSource, Shard,
};
use tapedeck_replayer::target::{self, TargetOptions};

use crate::embedded;

/// Arguments of `tapedeck replay`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ReplayArgs {
    /// `merge`: combine run summaries (e.g. the shards of a `--shard i/n` replay).
    #[command(subcommand)]
    pub command: Option<ReplayCommand>,
    /// Sessions: a tapedeck database (`.db`) or a `tapedeck.session.v1` JSONL file.
    #[arg(long, required = true)]
    pub sessions: Option<PathBuf>,
    /// The candidate: `engine:MODEL?name=value,...` (MODEL: a directory or an embedded fixture)
    /// or an OpenAI-compatible base URL (`http://host:port`).
    #[arg(long, default_value = "engine:tiny-qwen2")]
    pub target: String,
    /// `recorded`: each turn sends the recorded conversation (per-turn fidelity). `self`: the
    /// candidate's own answers are fed back (end-to-end agent behaviour).
    #[arg(long, default_value = "recorded")]
    pub history: String,
    /// Sessions in flight (closed loop).
    #[arg(long, default_value_t = 1, conflicts_with = "rate")]
    pub concurrency: usize,
    /// Sessions per second, Poisson arrivals (open loop; latency from the intended start).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open-loop arrival burstiness: inter-arrival gaps are gamma distributed with this shape and
    /// mean 1/rate (1 = Poisson; below 1 burstier, above 1 more even), as vLLM's `--burstiness`.
    #[arg(long, requires = "rate")]
    pub burstiness: Option<f64>,
    /// Pause between a session's turns: `none`, `recorded` (the recorded gap between the end of
    /// one answer and the next request) or `scaled:X` (the recorded gap times X).
    #[arg(long, default_value = "none")]
    pub think_time: String,
    /// Cap on any one think time: `500ms`, `30s`, `2m` (a bare number is seconds).
    #[arg(long)]
    pub max_think_time: Option<String>,
    /// `recorded`: start each session at its recorded arrival time (relative to the earliest),
    /// divided by `--speed`; latency is measured from that intended time.
    #[arg(long, value_parser = ["recorded"], conflicts_with_all = ["rate"])]
    pub timing: Option<String>,
    /// Time compression of `--timing recorded` (2 = twice as fast as recorded).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Seed of the open-loop arrival process and of `--sample`.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Only these session IDs (repeatable).
    #[arg(long = "session")]
    pub session_ids: Vec<String>,
    /// Only sessions that started (first recorded request) at or after this time: RFC 3339
    /// (`2026-12-03T10:00:00Z`) or Unix seconds.
    #[arg(long)]
    pub since: Option<String>,
    /// Only sessions that started before this time (RFC 3339 or Unix seconds; exclusive).
    #[arg(long)]
    pub until: Option<String>,
    /// Only sessions whose recorded client (user agent) contains this text, ignoring case
    /// (repeatable: any of them).
    #[arg(long = "client")]
    pub clients: Vec<String>,
    /// Replay only shard i of n (0-based): the sessions whose SHA-256(session ID) mod n is i,
    /// cut after the other filters and `--sample`. Pacing applies per shard (`--rate R` on n
    /// machines offers n·R in all). Merge the shards' `--json` files with `tapedeck replay merge`.
    #[arg(long)]
    pub shard: Option<String>,
    /// Only sessions with at least this many turns.
    #[arg(long, default_value_t = 0)]
    pub min_turns: usize,
    /// A seeded random sample of this many sessions.
    #[arg(long)]
    pub sample: Option<usize>,
    /// Cap on every turn's output tokens.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Goodput SLOs in milliseconds, e.g. `ttft=500,tpot=50,e2e=10000`.
    #[arg(long)]
    pub slo: Option<String>,
    /// Skip teacher-forced scoring of the recorded outputs.
    #[arg(long)]
    pub no_teacher_forcing: bool,
    /// |Δlogprob| (nats) above which a turn is flagged for drift.
    #[arg(long, default_value_t = 1e-4)]
    pub drift_tolerance: f64,
    /// Engine worker threads for `engine:` targets.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write the run summary (JSON) here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Save the run (summary and per-turn rows) into this tapedeck database; default: the
    /// `--sessions` database when sessions come from one.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Do not save the run into a database.
    #[arg(long, conflicts_with = "save")]
    pub no_save: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Stop at the first malformed JSONL line (default: skip it with a warning naming the file,
    /// line and field, and read the rest).
    #[arg(long)]
    pub strict: bool,
}

/// Subcommands of `tapedeck replay`.
#[derive(Subcommand, Debug)]
pub enum ReplayCommand {
    /// Merge run summaries (the shards of one `--shard i/n` replay, or runs over disjoint
    /// sessions) into one; latency percentiles come from the added HDR histograms, so they equal
    /// those of one run over the same requests.
    Merge(MergeArgs),
}

/// Arguments of `tapedeck replay merge`.
#[derive(Args, Debug)]
pub struct MergeArgs {
    /// Run summaries: `--json` files, or run IDs stored in `--db`.
    #[arg(required = true, num_args = 1..)]
    pub runs: Vec<PathBuf>,
    /// Write the merged summary (JSON) here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Database holding runs named by ID.
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Accept an incomplete set of shards (default: a missing shard is an error, because the
    /// merged figures would silently cover only part of the sessions).
    #[arg(long)]
    pub partial: bool,
}

/// Parses `--max-think-time`: a number with unit `ms`, `s` or `m`; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let t = text.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
        .with_context(|| format!("{text:?} is not a duration (e.g. 500ms, 30s, 2m)"))?;
    Duration::try_from_secs_f64(v * scale).with_context(|| format!("{text:?} is out of range"))
}

/// Target options that resolve embedded fixture names for `engine:` specs.
pub fn target_options(threads: Option<usize>) -> TargetOptions {
    TargetOptions {
        resolver: Some(Arc::new(|name: &str| {
            embedded::resolve(name).map_err(|e| format!("{e:#}"))
        })),
        threads,
        ..Default::default()
    }
}

/// Loads sessions from a database or JSONL file, skipping malformed JSONL lines with a warning
/// that names the file, line and field.
pub async fn load_sessions(path: &Path, filter: &SessionFilter) -> Result<Vec<Session>> {
    load_sessions_with(path, filter, false).await
}

/// Loads sessions; with `strict`, the first malformed JSONL line is an error instead of a warning.
pub async fn load_sessions_with(
    path: &Path,
    filter: &SessionFilter,
    strict: bool,
) -> Result<Vec<Session>> {
    if !path.exists() {
        anyhow::bail!("no sessions at {}", path.display());
    }
    match SessionSource::from_path(path) {
        SessionSource::Jsonl(p) => {
            let (lines, errors) = tapedeck_synth::read_jsonl(&p, strict)
                .with_context(|| format!("reading sessions from {}", p.display()))?;
            for e in &errors {
                eprintln!(
                    "warning: skipped {}:{} (field {}): {}",
                    e.file.display(),
                    e.line,
                    e.path,
                    e.message
                );
            }
            let mut sessions = Vec::with_capacity(lines.len());
            for line in &lines {
                match session_from_line(line) {
                    Ok(s) => sessions.push(s),
                    Err(m) if strict => {
                        anyhow::bail!("{}: session {}: {m}", p.display(), line.session.id)
                    }
                    Err(m) => eprintln!(
                        "warning: skipped session {} of {}: {m}",
                        line.session.id,
                        p.display()
                    ),
                }
            }
            Ok(filter.apply(sessions))
        }
        source => source
            .load(filter)
            .await
            .with_context(|| format!("loading sessions from {}", path.display())),
    }
}

/// Replays `sessions` against `spec` with a progress bar; Ctrl-C stops and keeps what finished.
pub async fn run_replay(
    sessions: Vec<Session>,
    spec: &str,
    cfg: ReplayConfig,
    threads: Option<usize>,
    quiet: bool,
) -> Result<RunSummary> {
    let target = {
        let owned = spec.to_string();
        let opts = target_options(threads);
        tokio::task::spawn_blocking(move || target::open(&owned, &opts))
            .await?
            .with_context(|| format!("opening target {spec}"))?
    };
    let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(turns as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} turns {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    };
    let mut cfg = cfg;
    {
        let bar = bar.clone();
        let flagged = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let errors = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        cfg.progress = Some(Arc::new(move |row| {
            use std::sync::atomic::Ordering::Relaxed;
            if row.error.is_some() {
                errors.fetch_add(1, Relaxed);
            }
            if row.flagged() {
                flagged.fetch_add(1, Relaxed);
            }
            bar.set_message(format!(
                "flagged {} errors {}",
                flagged.load(Relaxed),
                errors.load(Relaxed)
            ));
            bar.inc(1);
        }));
    }
    let (tx, rx) = tokio::sync::watch::channel(false);
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\ninterrupted: finishing with the turns done so far");
            let _ = tx.send(true);
        }
    });
    let run = replay(sessions, target, &cfg, rx).await;
    ctrl_c.abort();
    bar.finish_and_clear();
    Ok(run?)
}

/// Runs `tapedeck replay` (or `tapedeck replay merge`).
pub fn run(args: ReplayArgs) -> Result<()> {
    if let Some(ReplayCommand::Merge(m)) = args.command {
        return merge(m);
    }
    let Some(sessions_path) = args.sessions.clone() else {
        anyhow::bail!("--sessions is required");
    };
    let history: HistoryMode = args
        .history
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--history: {e}"))?;
    let slo: Slo = match &args.slo {
        Some(s) => s.parse().context("--slo")?,
        None => Slo::default(),
    };
    let think_time: ThinkTime = args.think_time.parse().context("--think-time")?;
    let max_think_time = args
        .max_think_time
        .as_deref()
        .map(parse_duration)
        .transpose()
        .context("--max-think-time")?;
    let shard: Option<Shard> = args
        .shard
        .as_deref()
        .map(str::parse)
        .transpose()
        .context("--shard")?;
    let time = |flag: &str, v: &Option<String>| -> Result<Option<i64>> {
        v.as_deref()
            .map(|t| parse_time(t).with_context(|| flag.to_string()))
            .transpose()
    };
    let cfg = ReplayConfig {
        pacing: match (args.timing.as_deref(), args.rate) {
            (Some(_), _) => Pacing::Recorded { speed: args.speed },
            (None, Some(rate)) => Pacing::Open {
                rate,
                seed: args.seed,
                burstiness: args.burstiness.unwrap_or(1.0),
            },
            (None, None) => Pacing::Closed {
                concurrency: args.concurrency,
            },
        },
        history,
        teacher_forcing: !args.no_teacher_forcing,
        max_tokens_cap: args.max_tokens,
        slo,
        drift_tolerance: args.drift_tolerance,
        think_time,
        max_think_time,
        shard,
        ..Default::default()
    };
    let filter = SessionFilter {
        ids: args.session_ids.clone(),
        since_us: time("--since", &args.since)?,
        until_us: time("--until", &args.until)?,
        clients: args.clients.clone(),
        min_turns: args.min_turns,
        sample: args.sample,
        seed: args.seed,
        shard,
    };
    filter.check().context("session filter")?;
    let rt = tokio::runtime::Runtime::new()?;
    let run = rt.block_on(async {
        let sessions = load_sessions_with(&sessions_path, &filter, args.strict).await?;
        if sessions.is_empty() {
            // An empty shard is a legitimate outcome of a split over few sessions, not a mistake.
            if shard.is_none() {
                anyhow::bail!(
                    "no sessions to replay in {} (after filters)",
                    sessions_path.display()
                );
            }
            eprintln!(
                "shard {}: no sessions fall in this shard",
                shard.map(|s| s.to_string()).unwrap_or_default()
            );
        }
        run_replay(sessions, &args.target, cfg, args.threads, args.quiet).await
    })?;
    print_summary(&run);
    if let Some(path) = &args.json {
        run_report::write_json(path, &run)?;
        eprintln!("run summary written to {}", path.display());
    }
    let save = match (&args.save, args.no_save) {
        (_, true) => None,
        (Some(db), false) => Some(db.clone()),
        (None, false) => match SessionSource::from_path(&sessions_path) {
            SessionSource::Database(db) => Some(db),
            SessionSource::Jsonl(_) => None,
        },
    };
    if let Some(db) = save {
        let id = rt.block_on(async {
            let store = tapedeck_recorder::store::Store::open(&db)
                .await
                .with_context(|| format!("opening {}", db.display()))?;
            let id = tapedeck_replayer::stored::save_run(&store, &run).await?;
            store.close().await;
            anyhow::Ok(id)
        })?;
        eprintln!("run {id} saved to {}", db.display());
    }
    Ok(())
}

/// Runs `tapedeck replay merge`: reads the summaries, merges them, prints and writes the result.
pub fn merge(args: MergeArgs) -> Result<()> {
    let runs = args
        .runs
        .iter()
        .map(|r| read_run(r, args.db.as_deref()))
        .collect::<Result<Vec<_>>>()?;
    let names: Vec<String> = args.runs.iter().map(|p| p.display().to_string()).collect();
    let merged = merge_runs(&runs).with_context(|| {
        let list: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(k, n)| format!("input {} = {n}", k + 1))
            .collect();
        format!("merging {}", list.join(", "))
    })?;
    let missing = missing_shards(&merged);
    if !missing.is_empty() {
        let list: Vec<String> = missing.iter().map(Shard::to_string).collect();
        if !args.partial {
            anyhow::bail!(
                "shards {} are missing (give every shard, or --partial to merge what is there)",
                list.join(", ")
            );
        }
        eprintln!(
            "warning: shards {} are missing; the merged run covers only part of the sessions",
            list.join(", ")
        );
    }
    print_summary(&merged);
    if let Some(path) = &args.json {
        run_report::write_json(path, &merged)?;
        eprintln!("merged run summary written to {}", path.display());
    }
    Ok(())
}

/// Reads a run: a summary JSON file, or a run ID stored in `db`.
pub fn read_run(arg: &Path, db: Option<&Path>) -> Result<RunSummary> {
    if arg.is_file() {
        return run_report::read_json(arg).with_context(|| format!("reading {}", arg.display()));
    }
    let Some(db) = db else {
        anyhow::bail!(
            "{} is not a run summary file (give --db DB to name a stored run by ID)",
            arg.display()
        );
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let store = tapedeck_recorder::store::Store::open(db)
            .await
            .with_context(|| format!("opening {}", db.display()))?;
        let run = tapedeck_replayer::stored::load_run(&store, &arg.to_string_lossy()).await?;
        store.close().await;
        Ok(run)
    })
}

/// A short text summary of a run.
pub fn print_summary(run: &RunSummary) {
    let s = &run.speed;
    let f = &run.fidelity;
    let mut part = String::new();
    if let Some(sh) = run.settings.shard {
        part = format!(" [shard {sh}]");
    } else if !run.merged_from.is_empty() {
        part = format!(" [merged from {} runs]", run.merged_from.len());
    }
    println!(
        "target {}{part} — {} sessions, {} requests ({} failed) in {:.1} s",
        run.target.spec, run.sessions_started, s.completed, s.failed, s.duration_s
    );
    println!(
        "speed: {:.2} req/s, {:.1} output tok/s, TTFT p50 {:.1} ms p99 {:.1} ms, ITL p50 {:.2} ms p99 {:.2} ms",
        s.request_throughput,
        s.output_token_throughput,
        s.ttft.p50_ms,
        s.ttft.p99_ms,
        s.itl.p50_ms,
        s.itl.p99_ms
    );
    println!(
        "fidelity: {} turns compared, {} prompt divergences, {} exact matches, mean |Δlogprob| {:.2e}, top-1 agreement {:.4}, flagged turns {}",
        f.compared_turns,
        f.prompt_divergent_turns,
        f.exact_match_turns,
        f.drift.abs_dlogprob.mean,
        f.drift.top1_agreement,
        f.flagged_turns
    );
    for srow in &run.sessions {
        if let Some(t) = srow.first_divergent_turn {
            let flags = srow
                .turns
                .iter()
                .find(|r| r.turn == t)
                .map(|r| r.flags.join(","))
                .unwrap_or_default();
            println!("  session {}: first divergent turn {t} ({flags})", srow.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_with_units() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration(" 2m ").unwrap(), Duration::from_secs(120));
        for bad in ["", "fast", "-1s", "1h", "nan"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
