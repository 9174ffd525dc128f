//! `tapedeck`: record, replay and compare multi-turn LLM serving sessions.
//!
//! A thin binary: each subcommand parses its arguments and calls one library function; errors
//! become a message and a non-zero exit code.

mod cli_bench;
mod cli_bench_kernels;
mod cli_demo;
mod cli_generate;
mod cli_replay;
mod cli_serve;
mod cli_synth;
mod cli_verdict;
mod embedded;
mod recording;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Record, replay and compare multi-turn LLM serving sessions for context fidelity and speed.
#[derive(Parser, Debug)]
#[command(name = "tapedeck", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The main job on the embedded default: serve, record, replay against candidates, compare,
    /// bisect, report.
    Demo(cli_demo::DemoArgs),
    /// Serve the engine over an OpenAI-compatible HTTP API, recording every request to SQLite.
    Serve(cli_serve::ServeArgs),
    /// List, show, export and import recorded sessions.
    #[command(subcommand)]
    Sessions(cli_serve::SessionsCommand),
    /// Re-run recorded sessions against a candidate; measure speed and context fidelity.
    Replay(Box<cli_replay::ReplayArgs>),
    /// Render a replay run as text, JSON, Markdown or a self-contained HTML page.
    Report(cli_verdict::ReportArgs),
    /// Compare a candidate run with a baseline under a policy; exit 0 pass, 1 fail, 2 not comparable.
    Compare(cli_verdict::CompareArgs),
    /// Find the smallest set of toggle changes that breaks fidelity (delta debugging).
    Bisect(cli_verdict::BisectArgs),
    /// Generate test sessions.
    #[command(subcommand)]
    Synth(cli_synth::SynthCommand),
    /// Generate text with the in-process engine.
    Generate(cli_generate::GenerateArgs),
    /// List the engine's toggles: names, allowed values, defaults.
    Toggles,
    /// Benchmarks that print figures.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write an embedded fixture model to a directory (or print where it is cached).
    Fixture {
        /// Embedded model name (`tiny-qwen2` or `tiny-llama`).
        #[arg(default_value = embedded::DEFAULT_MODEL)]
        name: String,
        /// Directory to write; default: the cache directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Engine speed: prefill, decode, batched throughput, prefix cache, memory.
    Engine(cli_bench::BenchArgs),
    /// GPU: the few-token bf16 GEMV kernels against cuBLAS on Llama-3.2-1B's linear layers.
    Gemv(cli_bench_kernels::GemvBenchArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo(args) => cli_demo::run(args),
        Command::Serve(args) => cli_serve::serve(args),
        Command::Sessions(cmd) => cli_serve::sessions(cmd),
        Command::Replay(args) => cli_replay::run(*args),
        Command::Synth(cmd) => cli_synth::run(cmd),
        Command::Report(args) => cli_verdict::report(args),
        Command::Compare(args) => exit_with(cli_verdict::compare(args)?),
        Command::Bisect(args) => exit_with(cli_verdict::bisect(args)?),
        Command::Generate(args) => cli_generate::run(args),
        Command::Bench(BenchCommand::Engine(args)) => cli_bench::run(args),
        Command::Bench(BenchCommand::Gemv(args)) => cli_bench_kernels::run(args),
        Command::Toggles => {
            print_toggles();
            Ok(())
        }
        Command::Fixture { name, out } => {
            let dir = match out {
                Some(out) => {
                    embedded::write_to(&name, &out)?;
                    out
                }
                None => embedded::resolve(&name)?,
            };
            println!("{}", dir.display());
            Ok(())
        }
    }
}

/// Ends the process with a verdict's exit code (0 is returned normally).
fn exit_with(code: i32) -> Result<()> {
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

fn print_toggles() {
    use tapedeck_engine::toggles::REGISTRY;
    let w_name = REGISTRY
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let w_vals = REGISTRY
        .iter()
        .map(|s| s.values.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let w_def = REGISTRY
        .iter()
        .map(|s| s.default.len())
        .max()
        .unwrap_or(7)
        .max(7);
    println!(
        "{:w_name$}  {:w_vals$}  {:w_def$}  DESCRIPTION",
        "NAME", "VALUES", "DEFAULT"
    );
    for s in REGISTRY {
        println!(
            "{:w_name$}  {:w_vals$}  {:w_def$}  {}",
            s.name, s.values, s.default, s.description
        );
    }
    println!("\npresets (`preset=NAME` sets these at once; toggles after it override them):");
    for (name, set) in tapedeck_engine::toggles::PRESETS {
        println!("  {name}: {set}");
    }
}
