//! `tapedeck demo`: the main job on the embedded default, end to end, in under a minute.
//!
//! 1. start `serve` (embedded tiny-qwen2, a temporary SQLite file) on a free local port;
//! 2. play the fixture sessions through it as a client would, so they are recorded;
//! 3. replay the recording against the reference engine, a precision candidate and a faulty one;
//! 4. compare each candidate with the reference, bisect the faulty toggle set, and write the
//!    HTML report.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tapedeck_replayer::report::RunSummary;
use tapedeck_replayer::run::ReplayConfig;
use tapedeck_replayer::session::{parse_jsonl, SessionFilter};

use crate::cli_replay::{load_sessions, print_summary, run_replay};
use crate::embedded;
use crate::recording::{play, LocalServer};

/// The fixture sessions the demo plays (`fixtures/sessions/smoke.jsonl`).
const DEMO_SESSIONS: &str = include_str!("../fixtures/sessions/smoke.jsonl");

/// Arguments of `tapedeck demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Keep the recording in this database (default: a temporary file).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Where to write the report and run summaries (default: a temporary directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Sessions to play (default: the embedded fixture sessions).
    #[arg(long)]
    pub sessions: Option<PathBuf>,
    /// Engine worker threads.
    #[arg(long)]
    pub threads: Option<usize>,
}

/// The reference and the candidates the demo replays against.
pub const CANDIDATES: &[(&str, &str)] = &[
    ("reference", ""),
    ("precision candidate", "matmul=bf16"),
    (
        "faulty candidate",
        "kv_dtype=bf16,decode_topk=1024,prefill_chunk=256,fault.encoding=drop_thinking_always",
    ),
];

fn step(n: usize, text: &str) {
    println!("\n[{n}] {text}");
}

/// Runs `tapedeck demo`.
pub fn run(args: DemoArgs) -> Result<()> {
    let started = Instant::now();
    let tmp = tempfile::tempdir().context("creating a temporary directory")?;
    let out_dir = args.out.clone().unwrap_or_else(|| tmp.path().join("out"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let db = args
        .db
        .clone()
        .unwrap_or_else(|| tmp.path().join("demo.db"));
    let model = embedded::resolve(embedded::DEFAULT_MODEL)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(demo(&args, &model, &db, &out_dir))?;
    println!("\ndone in {:.1} s", started.elapsed().as_secs_f64());
    if args.out.is_none() {
        // The temporary directory goes away; keep the report where the user can open it.
        let keep = std::env::temp_dir().join("tapedeck-demo");
        std::fs::create_dir_all(&keep)?;
        for entry in std::fs::read_dir(&out_dir)? {
            let p = entry?.path();
            if let Some(name) = p.file_name() {
                std::fs::copy(&p, keep.join(name))?;
            }
        }
        println!("report and run summaries: {}", keep.display());
    }
    Ok(())
}

async fn demo(args: &DemoArgs, model: &Path, db: &Path, out: &Path) -> Result<()> {
    let sessions = match &args.sessions {
        Some(p) => load_sessions(p, &SessionFilter::default()).await?,
        None => parse_jsonl(DEMO_SESSIONS, Path::new("fixtures/sessions/smoke.jsonl"))?,
    };
    let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();

    step(
        1,
        "starting `tapedeck serve` (embedded tiny-qwen2) on a free local port",
    );
    let server = LocalServer::start(
        model,
        embedded::DEFAULT_MODEL,
        Default::default(),
        db,
        args.threads,
    )
    .await?;
    println!(
        "    serving at {}, recording to {}",
        server.url,
        db.display()
    );

    step(
        2,
        &format!(
            "playing {} fixture sessions ({turns} turns) through it as a client",
            sessions.len()
        ),
    );
    let played = play(sessions, &server.url, 2, args.threads).await?;
    let stats = server.stop().await?;
    println!(
        "    {} requests answered, {} records written, {} dropped",
        played.speed.completed, stats.written, stats.dropped
    );

    step(
        3,
        "replaying the recording against the reference and two candidates",
    );
    let recorded = load_sessions(db, &SessionFilter::default()).await?;
    let mut runs: Vec<(String, RunSummary)> = Vec::new();
    for (name, toggles) in CANDIDATES {
        let spec = if toggles.is_empty() {
            format!("engine:{}", embedded::DEFAULT_MODEL)
        } else {
            format!("engine:{}?{toggles}", embedded::DEFAULT_MODEL)
        };
        println!("\n  -- {name}: {spec}");
        let run = run_replay(
            recorded.clone(),
            &spec,
            ReplayConfig::default(),
            args.threads,
            true,
        )
        .await?;
        print_summary(&run);
        let path = out.join(format!("run-{}.json", name.replace(' ', "-")));
        tapedeck_replayer::report::write_json(&path, &run)?;
        runs.push((name.to_string(), run));
    }

    step(
        4,
        "comparing each candidate with the reference (default policy, see ci/policy.toml)",
    );
    let policy = tapedeck_report::Policy::default();
    let reference = &runs[0].1;
    for (name, run) in &runs[1..] {
        let cmp = tapedeck_report::compare(reference, run, &policy);
        println!(
            "
  -- {name}: {}",
            cmp.verdict_word()
        );
        print!("{}", indent(&cmp.to_text()));
        std::fs::write(
            out.join(format!("compare-{}.md", name.replace(' ', "-"))),
            cmp.to_markdown(),
        )?;
    }

    step(
        5,
        "bisecting the faulty candidate's toggles against the reference",
    );
    let (_, faulty) = CANDIDATES[CANDIDATES.len() - 1];
    let bad: tapedeck_engine::Toggles = faulty.parse()?;
    let bisect_cfg = ReplayConfig {
        // Bisect replays several times; a few output tokens per turn are enough to judge.
        max_tokens_cap: Some(8),
        ..Default::default()
    };
    let result = crate::cli_verdict::bisect_sessions(
        &recorded,
        &format!("engine:{}", embedded::DEFAULT_MODEL),
        tapedeck_engine::Toggles::default(),
        bad,
        &policy,
        &bisect_cfg,
        args.threads,
    )
    .await?;
    print!("{}", indent(&result.to_string()));

    step(6, "writing the HTML report of the faulty candidate's run");
    let html = tapedeck_report::report(&runs[runs.len() - 1].1, tapedeck_report::Format::Html)?;
    let page = out.join("report.html");
    std::fs::write(&page, html)?;
    println!("    {}", page.display());
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}
