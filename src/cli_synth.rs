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
    let SynthCommand::Sessions(a) = cmd;
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
