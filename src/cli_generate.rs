//! `tapedeck generate`: one prompt through the in-process engine, printed as it streams.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tapedeck_engine::chat::EncodeOptions;
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::{
    ChatMessage, Engine, GenerateRequest, SamplingParams, StopCriteria, Toggles,
};

use crate::embedded;

/// Arguments of `tapedeck generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model directory (Hugging Face layout) or an embedded fixture name.
    #[arg(long, default_value = embedded::DEFAULT_MODEL)]
    pub model: String,
    /// A user message, sent through the model's chat template.
    #[arg(long, conflicts_with = "messages")]
    pub prompt: Option<String>,
    /// A JSON file with an OpenAI-style `messages` array (or an object holding `messages` and
    /// optionally `tools`).
    #[arg(long)]
    pub messages: Option<PathBuf>,
    /// Send `--prompt` as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// A toggle, `name=value`; repeatable (see `tapedeck toggles`).
    #[arg(long = "toggle", value_name = "NAME=VALUE")]
    pub toggles: Vec<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k filter (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus filter.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Min-p filter.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Sampling seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string; repeatable.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print each token's logits summary (logprob, entropy, top alternatives).
    #[arg(long)]
    pub logits: bool,
    /// Alternatives per logits summary.
    #[arg(long, default_value_t = 8)]
    pub top_logprobs: usize,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: tapedeck_engine::backend::Device,
}

/// Parses repeated `--toggle name=value` flags into a toggle set.
pub fn parse_toggles(items: &[String]) -> Result<Toggles> {
    let mut t = Toggles::default();
    for item in items {
        let (n, v) = item
            .split_once('=')
            .with_context(|| format!("--toggle {item:?}: expected NAME=VALUE"))?;
        t.set(n, v)?;
    }
    Ok(t)
}

fn read_messages(path: &PathBuf) -> Result<(Vec<ChatMessage>, Option<Vec<serde_json::Value>>)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let (msgs, tools) = match v {
        serde_json::Value::Array(_) => (v, None),
        serde_json::Value::Object(mut o) => (
            o.remove("messages")
                .with_context(|| format!("{}: no \"messages\" field", path.display()))?,
            o.remove("tools").and_then(|t| t.as_array().cloned()),
        ),
        _ => bail!("{}: expected a messages array or an object", path.display()),
    };
    let msgs: Vec<ChatMessage> = serde_json::from_value(msgs)
        .with_context(|| format!("{}: invalid messages", path.display()))?;
    Ok((msgs, tools))
}

/// Runs `tapedeck generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let toggles = parse_toggles(&args.toggles)?;
    let dir = embedded::resolve(&args.model)?;
    let engine = Engine::load_with(
        &dir,
        &EngineOptions {
            threads: args.threads,
            device: args.device,
        },
    )
    .with_context(|| format!("loading model from {}", dir.display()))?;
    let prompt: Vec<u32> = match (&args.prompt, &args.messages) {
        (Some(p), _) if args.raw => engine.tokenizer().encode(p)?,
        (Some(p), _) => {
            let msgs = [ChatMessage::new("user", p)];
            let opts = EncodeOptions {
                add_generation_prompt: true,
                toggles,
            };
            engine.encode_chat(&msgs, None, &opts)?.ids
        }
        (None, Some(path)) => {
            let (msgs, tools) = read_messages(path)?;
            let opts = EncodeOptions {
                add_generation_prompt: true,
                toggles,
            };
            engine.encode_chat(&msgs, tools.as_deref(), &opts)?.ids
        }
        (None, None) => bail!("give --prompt TEXT or --messages FILE.json"),
    };
    let req = GenerateRequest {
        prompt,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: (args.top_k > 0).then_some(args.top_k),
            top_p: args.top_p,
            min_p: args.min_p,
            seed: args.seed,
        },
        stop: StopCriteria {
            max_tokens: args.max_tokens,
            stop_strings: args.stop.clone(),
            ..Default::default()
        },
        top_k_summary: args.top_logprobs,
        toggles,
    };
    let tok = engine.tokenizer();
    let mut stdout = std::io::stdout().lock();
    let out = engine.generate(&req, &mut |ev| {
        if args.logits {
            let alts: Vec<String> = ev
                .summary
                .top
                .iter()
                .map(|(id, lp)| {
                    let t = tok.id_to_token(*id).unwrap_or_default();
                    format!("{t:?}:{lp:.3}")
                })
                .collect();
            let _ = writeln!(
                stdout,
                "{:>6} {:>10} logprob {:>8.4} entropy {:>6.3}  top: {}",
                ev.id,
                format!("{:?}", tok.id_to_token(ev.id).unwrap_or_default()),
                ev.summary.logprob,
                ev.summary.entropy,
                alts.join(" ")
            );
        } else {
            let _ = write!(stdout, "{}", ev.text);
            let _ = stdout.flush();
        }
        true
    })?;
    if args.logits {
        writeln!(stdout, "text: {:?}", out.text)?;
    } else {
        writeln!(stdout)?;
    }
    let secs = out.timings.total.as_secs_f64();
    eprintln!(
        "[{} prompt tokens, {} generated, finish: {}, prefill {:.1} ms, {:.1} tokens/s, toggles: {}]",
        out.prompt_tokens,
        out.tokens.len(),
        out.finish_reason.as_str(),
        out.timings.prefill.as_secs_f64() * 1e3,
        out.tokens.len() as f64 / (secs - out.timings.prefill.as_secs_f64()).max(1e-9),
        if toggles.to_string().is_empty() { "default".to_string() } else { toggles.to_string() },
    );
    Ok(())
}
