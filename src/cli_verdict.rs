//! `tapedeck report`, `compare` and `bisect`: turning replay runs into something a person can
//! read and a CI job can gate on.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use tapedeck_engine::Toggles;
use tapedeck_replayer::run::ReplayConfig;
use tapedeck_replayer::session::{Session, SessionFilter};
use tapedeck_report::{BisectResult, Evidence, Format, Policy};

use crate::cli_replay::{load_sessions, read_run, run_replay};
use crate::embedded;

/// Arguments of `tapedeck report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A run summary written by `tapedeck replay --json`, or a run ID stored in `--db`.
    pub run: PathBuf,
    /// Database holding stored runs (when RUN is an ID).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// text | json | markdown | html.
    #[arg(long, default_value = "text")]
    pub format: String,
    /// Output file (default: standard output).
    #[arg(short, long)]
    pub out: Option<PathBuf>,
}

/// Runs `tapedeck report`.
pub fn report(args: ReportArgs) -> Result<()> {
    let run = read_run(&args.run, args.db.as_deref())?;
    let format: Format = args
        .format
        .parse()
        .map_err(|e| anyhow::anyhow!("--format: {e}"))?;
    let text = tapedeck_report::report(&run, format)?;
    write_out(args.out.as_deref(), &text)
}

fn write_out(path: Option<&Path>, text: &str) -> Result<()> {
    match path {
        Some(p) => {
            std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
            eprintln!("wrote {}", p.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// Arguments of `tapedeck compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Baseline run: summary JSON file, or a run ID stored in `--db`.
    pub base: PathBuf,
    /// Candidate run: summary JSON file, or a run ID stored in `--db`.
    pub cand: PathBuf,
    /// Database holding stored runs (when runs are named by ID).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Policy (TOML); default: the built-in defaults (see `ci/policy.toml`).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Also write JUnit XML here.
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// Also write a Markdown summary here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// Loads a policy file, or the defaults.
pub fn load_policy(path: Option<&Path>) -> Result<Policy> {
    match path {
        Some(p) => Ok(Policy::from_file(p)?),
        None => Ok(Policy::default()),
    }
}

/// Runs `tapedeck compare`; returns the exit code (0 pass, 1 fail, 2 could not compare).
pub fn compare(args: CompareArgs) -> Result<i32> {
    let policy = load_policy(args.policy.as_deref())?;
    let base = read_run(&args.base, args.db.as_deref())?;
    let cand = read_run(&args.cand, args.db.as_deref())?;
    let cmp = tapedeck_report::compare(&base, &cand, &policy);
    print!("{}", cmp.to_text());
    if let Some(p) = &args.junit {
        write_out(Some(p), &cmp.to_junit())?;
    }
    if let Some(p) = &args.markdown {
        write_out(Some(p), &cmp.to_markdown())?;
    }
    Ok(cmp.exit_code())
}

/// Arguments of `tapedeck bisect`.
#[derive(Args, Debug)]
pub struct BisectArgs {
    /// Sessions: a database or JSONL file.
    #[arg(long)]
    pub sessions: PathBuf,
    /// The toggle set that passes (e.g. `""` for the defaults).
    #[arg(long, default_value = "")]
    pub good: String,
    /// The toggle set that fails.
    #[arg(long)]
    pub bad: String,
    /// The engine to replay on (`engine:MODEL`; toggles are added by the bisect).
    #[arg(long, default_value = "engine:tiny-qwen2")]
    pub target: String,
    /// Policy deciding pass/fail against the good run (TOML; default: built-in).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Cap on output tokens per turn (bisect replays many times; fewer tokens are faster).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Engine worker threads.
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Finds the smallest set of toggle changes from `good` to `bad` that makes `sessions` fail the
/// policy against a replay with `good` (delta debugging; each configuration replayed once).
pub async fn bisect_sessions(
    sessions: &[Session],
    model_spec: &str,
    good: Toggles,
    bad: Toggles,
    policy: &Policy,
    cfg: &ReplayConfig,
    threads: Option<usize>,
) -> Result<BisectResult> {
    let model = model_spec
        .strip_prefix("engine:")
        .unwrap_or(model_spec)
        .split('?')
        .next()
        .unwrap_or(embedded::DEFAULT_MODEL)
        .to_string();
    let spec_for = |t: &Toggles| {
        let s = t.to_string();
        if s.is_empty() {
            format!("engine:{model}")
        } else {
            format!("engine:{model}?{s}")
        }
    };
    let base = run_replay(
        sessions.to_vec(),
        &spec_for(&good),
        cfg.clone(),
        threads,
        true,
    )
    .await?;
    let result = tapedeck_report::bisect(good, bad, |t: Toggles| {
        let spec = spec_for(&t);
        let sessions = sessions.to_vec();
        let cfg = cfg.clone();
        let base = &base;
        async move {
            let run = run_replay(sessions, &spec, cfg, threads, true).await?;
            let failed = tapedeck_report::compare(base, &run, policy).exit_code() == 1;
            Ok::<_, anyhow::Error>((failed, Evidence::from_run(&run)))
        }
    })
    .await?;
    Ok(result)
}

/// Runs `tapedeck bisect`; returns the exit code of the result.
pub fn bisect(args: BisectArgs) -> Result<i32> {
    let good: Toggles = args.good.parse().context("--good")?;
    let bad: Toggles = args.bad.parse().context("--bad")?;
    let policy = load_policy(args.policy.as_deref())?;
    let cfg = ReplayConfig {
        max_tokens_cap: args.max_tokens,
        ..Default::default()
    };
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(async {
        let sessions = load_sessions(&args.sessions, &SessionFilter::default()).await?;
        bisect_sessions(
            &sessions,
            &args.target,
            good,
            bad,
            &policy,
            &cfg,
            args.threads,
        )
        .await
    })?;
    println!("{result}");
    Ok(result.exit_code())
}
