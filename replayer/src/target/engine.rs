//! The in-process engine as a target: `engine:DIR?name=value,...`, where one of the pairs may be
//! `device=cpu|cuda|cuda:N` (where forward passes run; the default is the CPU). The device is not a
//! toggle: it changes where the numbers are computed, and a replay A/Bs devices by naming two
//! targets.
//!
//! Turns go through one [`EngineHandle`], so concurrent sessions are batched by the engine's own
//! continuous-batching scheduler exactly as `tapedeck serve` would batch them; the prompt IDs the
//! candidate encoded are returned, so prompt divergence is measured token by token.
//!
//! Teacher forcing uses [`ScoreMode::Decode`]: the prompt is prefilled (chunked per the
//! `prefill_chunk` toggle) and every scored token then runs as one decode step, exactly as
//! generation ran when the recording was made. One prefill pass over the whole sequence would be
//! cheaper, but it would take the prefill kernels for the output positions, so decode-only kernels
//! and toggles (`decode_topk`, a decode attention kernel) would be invisible to the drift metrics,
//! and a reference replay would not reproduce its own recording bit for bit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use tapedeck_engine::backend::Device;
use tapedeck_engine::chat::EncodeOptions;
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::messages::MessageContent;
use tapedeck_engine::scheduler::{EngineHandle, Event, SchedulerConfig};
use tapedeck_engine::{
    ChatMessage, Engine, GenerateRequest, LogitsSummary, SamplingParams, StopCriteria, Toggles,
};

use super::{Clock, GenOptions, Target, TargetInfo, TargetOptions, TurnOutput};
use crate::error::{Error, Result};
use crate::session::ChatRequest;

/// Splits `engine:DIR?toggles` into the model part and the parsed toggles.
pub fn parse_spec(spec: &str) -> Result<(String, Toggles)> {
    let bad = |message: String| Error::TargetSpec {
        spec: spec.to_string(),
        message,
    };
    let rest = spec
        .strip_prefix("engine:")
        .ok_or_else(|| bad("an engine target starts with engine:".into()))?;
    let (model, toggles) = match rest.split_once('?') {
        Some((m, t)) => (m, t),
        None => (rest, ""),
    };
    if model.is_empty() {
        return Err(bad(
            "no model directory or fixture name after engine:".into()
        ));
    }
    let toggles: String = toggles
        .split(',')
        .filter(|p| !p.trim_start().starts_with("device="))
        .collect::<Vec<_>>()
        .join(",");
    let toggles: Toggles = toggles.parse().map_err(|e| bad(format!("{e}")))?;
    Ok((model.to_string(), toggles))
}

/// The `device=` pair of an engine spec (the CPU when absent).
pub fn spec_device(spec: &str) -> Result<Device> {
    let query = spec.split_once('?').map_or("", |(_, q)| q);
    match query
        .split(',')
        .find_map(|p| p.trim().strip_prefix("device="))
    {
        Some(d) => d.parse().map_err(|e| Error::TargetSpec {
            spec: spec.to_string(),
            message: format!("{e}"),
        }),
        None => Ok(Device::Cpu),
    }
}

/// A target that runs turns on an in-process engine with a toggle set.
pub struct EngineTarget {
    spec: String,
    handle: EngineHandle,
    toggles: Toggles,
}

impl EngineTarget {
    /// Loads the model named by `spec` (through `opts.resolver` when given) and starts a scheduler.
    pub fn open(spec: &str, opts: &TargetOptions) -> Result<Self> {
        let (model, toggles) = parse_spec(spec)?;
        let dir: PathBuf = match &opts.resolver {
            Some(resolve) => resolve(&model).map_err(|message| Error::TargetSpec {
                spec: spec.to_string(),
                message,
            })?,
            None => PathBuf::from(&model),
        };
        let engine = Engine::load_with(
            &dir,
            &EngineOptions {
                threads: opts.threads,
                device: spec_device(spec)?,
            },
        )?;
        Self::new(Arc::new(engine), toggles, opts.scheduler.clone(), spec)
    }

    /// A target over an already loaded engine (several targets may share one model). Its KV
    /// pool stores the toggles' `kv_dtype`, whatever `scheduler` says, since every request of
    /// the target carries those toggles.
    pub fn new(
        engine: Arc<Engine>,
        toggles: Toggles,
        scheduler: SchedulerConfig,
        spec: &str,
    ) -> Result<Self> {
        let scheduler = SchedulerConfig {
            kv_dtype: toggles.kv_dtype,
            ..scheduler
        };
        let handle = EngineHandle::start(engine, scheduler)?;
        Ok(EngineTarget {
            spec: spec.to_string(),
            handle,
            toggles,
        })
    }

    /// The toggles every request of this target runs with.
    pub fn toggles(&self) -> &Toggles {
        &self.toggles
    }

    /// The scheduler handle (its live stats, for progress displays).
    pub fn handle(&self) -> &EngineHandle {
        &self.handle
    }

    async fn run_chat(&self, req: ChatRequest, opts: GenOptions) -> Result<TurnOutput> {
        let engine = self.handle.engine().clone();
        let encoding = engine.encode_chat(
            &req.messages,
            req.tools.as_deref(),
            &EncodeOptions {
                add_generation_prompt: true,
                toggles: self.toggles,
            },
        )?;
        let prompt_len = encoding.ids.len();
        let room = engine.context_len().saturating_sub(prompt_len);
        let mut max_tokens = req.max_tokens.map_or(room, |n| n as usize).min(room);
        if let Some(cap) = opts.max_tokens_cap {
            max_tokens = max_tokens.min(cap);
        }
        let greq = GenerateRequest {
            prompt: encoding.ids.clone(),
            sampling: SamplingParams {
                temperature: req.temperature.unwrap_or(1.0),
                top_k: None,
                top_p: req.top_p.unwrap_or(1.0),
                min_p: 0.0,
                seed: req.seed,
            },
            stop: StopCriteria {
                max_tokens: max_tokens.max(1),
                stop_strings: req.stop.clone(),
                stop_token_ids: Vec::new(),
                ignore_eos: false,
            },
            top_k_summary: opts.top_k.max(1),
            toggles: self.toggles,
        };
        let sent = Instant::now();
        let mut stream = self.handle.submit(greq)?;
        let mut tokens = Vec::new();
        let out = loop {
            match stream.next().await {
                Some(Event::Token(_)) => tokens.push(Instant::now()),
                Some(Event::Done(out)) => break out,
                Some(Event::Error(e)) => return Err(Error::Generation(e)),
                None => return Err(Error::Generation("the scheduler stopped".into())),
            }
        };
        let end = Instant::now();
        let parsed = engine.template().parse_output(&out.text);
        let finish = match out.finish_reason {
            tapedeck_engine::FinishReason::Stop if !parsed.tool_calls.is_empty() => "tool_calls",
            other => other.as_str(),
        };
        let message = ChatMessage {
            role: "assistant".into(),
            content: Some(MessageContent::Text(parsed.content)),
            reasoning_content: parsed.reasoning_content,
            tool_calls: (!parsed.tool_calls.is_empty()).then_some(parsed.tool_calls),
            tool_call_id: None,
            name: None,
        };
        Ok(TurnOutput {
            prompt_tokens: Some(prompt_len),
            prompt_ids: Some(encoding.ids),
            output_tokens: out.tokens.len(),
            output_ids: Some(out.tokens),
            text: out.text,
            message,
            summaries: out.summaries,
            finish_reason: Some(finish.to_string()),
            clock: Clock { sent, tokens, end },
        })
    }
}

impl Target for EngineTarget {
    fn info(&self) -> TargetInfo {
        let engine = self.handle.engine();
        TargetInfo {
            spec: self.spec.clone(),
            kind: "engine".into(),
            toggles: Some(self.toggles.to_string()),
            model: Some(engine.dir().display().to_string()),
            build: Some(format!(
                "tapedeck {} {}",
                env!("CARGO_PKG_VERSION"),
                option_env!("TAPEDECK_GIT_REVISION").unwrap_or("unknown")
            )),
            scoring: "decode".into(),
        }
    }

    fn chat(&self, request: ChatRequest, opts: GenOptions) -> BoxFuture<'_, Result<TurnOutput>> {
        Box::pin(self.run_chat(request, opts))
    }

    fn score(
        &self,
        prompt: Vec<u32>,
        output: Vec<u32>,
        top_k: usize,
    ) -> BoxFuture<'_, Result<Vec<LogitsSummary>>> {
        let handle = self.handle.clone();
        let toggles = self.toggles;
        // Through the scheduler: the prompt hits the prefix cache the turn's generation just
        // filled, and the recorded output is fed one decode step at a time exactly as
        // generation runs (decode-only toggles such as `decode_topk` show).
        Box::pin(async move {
            if output.is_empty() || prompt.is_empty() {
                return Ok(Vec::new());
            }
            handle
                .score(prompt, output, top_k.max(1), toggles)
                .await
                .map_err(|e| Error::Generation(format!("scoring: {e}")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing() {
        let (m, t) = parse_spec("engine:tiny-qwen2?matmul=bf16").unwrap();
        assert_eq!(m, "tiny-qwen2");
        assert_eq!(t.to_string(), "matmul=bf16");
        let (m, t) = parse_spec("engine:/models/x").unwrap();
        assert_eq!(m, "/models/x");
        assert_eq!(t, Toggles::default());
        let (m, t) = parse_spec("engine:tiny-qwen2?device=cuda:1,kv_dtype=bf16").unwrap();
        assert_eq!(
            (m.as_str(), t.to_string().as_str()),
            ("tiny-qwen2", "kv_dtype=bf16")
        );
        assert_eq!(
            spec_device("engine:tiny-qwen2?device=cuda:1,kv_dtype=bf16").unwrap(),
            Device::Cuda(1)
        );
        assert_eq!(spec_device("engine:x?matmul=bf16").unwrap(), Device::Cpu);
        assert!(spec_device("engine:x?device=tpu").is_err());
        assert!(parse_spec("engine:").is_err());
        assert!(parse_spec("engine:x?matmul=f64").is_err());
        assert!(parse_spec("x").is_err());
    }
}
