//! Chat encoding: the model's own Jinja `chat_template` rendered with minijinja, the explicit
//! reasoning-drop rule, the encoding faults, and parsing tool calls back out of generated text.
//!
//! Multi-turn fidelity lives or dies here: one differing byte in the rendered prompt changes every
//! token after it. So everything that decides the prompt is explicit and recorded:
//!
//! * The template environment mimics Hugging Face `transformers` (`trim_blocks`, `lstrip_blocks`,
//!   loop controls, Python string methods through `minijinja-contrib`'s `pycompat`, and HF's own
//!   `raise_exception`, `tojson` and `strftime_now`), so a model's template renders the bytes
//!   `apply_chat_template` would.
//! * Messages are converted to the template context the way HF/vLLM do (see [`ContentFormat`] and
//!   the tool-call argument rule on [`ChatTemplate::render`]).
//! * The reasoning rule ([`REASONING_RULE`]) is applied in Rust *before* rendering, so templates
//!   that render `reasoning_content` whenever present get the same behaviour everywhere, and every
//!   [`EncodingReport`] lists which turns kept or lost their reasoning.
//! * The encoding faults (`fault.encoding`, `fault.context_window`) plant known bug classes so a
//!   replay can prove it catches them.

use std::num::NonZeroUsize;
use std::path::Path;

use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::messages::{ChatMessage, FunctionCall, MessageContent, ToolCall};
use crate::toggles::{EncodingFault, Toggles};
use crate::tokenizer::{read_json, Tokenizer};

/// The name of the reasoning rule recorded in every [`EncodingReport`].
///
/// The rule, exactly: let *last user* be the last message whose role is `user` (`tool` messages
/// are not user messages). An assistant message at an index before *last user* that carries
/// `reasoning_content` has it removed before rendering when no tools are present (`tools` absent
/// or empty), and keeps it when tools are present. Assistant messages after *last user* (the
/// current agent loop: tool-call turns and their results) always keep their reasoning. With no
/// user message at all nothing is dropped. `fault.encoding=drop_thinking_always` drops before
/// *last user* even when tools are present.
pub const REASONING_RULE: &str = "drop_before_last_user_unless_tools";

/// Name the default (or only) template is registered under; appears in template error locations.
const TEMPLATE_NAME: &str = "chat_template";
/// Name of the `tool_use` variant of a list-form `chat_template`, when the model has one.
const TOOL_USE_NAME: &str = "chat_template.tool_use";

/// How tool calls appear in generated text, detected from the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// A bare JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1+).
    LlamaJson,
}

/// How list-of-parts message content is handed to the template.
///
/// HF `transformers` passes content through untouched, which makes templates that only handle
/// strings (Qwen3 renders an empty string for a list) silently lose text. vLLM instead detects
/// whether the template iterates over the content parts and otherwise joins the text parts with
/// `"\n"`; tapedeck follows vLLM so that a list of text parts renders like the equivalent string,
/// and so prompts recorded from a vLLM upstream compare equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContentFormat {
    /// Parts are flattened: the `text` of every text part, joined with `"\n"`; non-text parts are
    /// dropped (the engine is text-only).
    String,
    /// The template loops over `message.content` itself: parts are passed as a list of
    /// `{"type", "text"}` objects (string content still passes as a string).
    Parts,
}

/// One compiled variant of a template with the facts derived from its source.
#[derive(Debug, Clone)]
struct Variant {
    name: &'static str,
    sha256: String,
    tool_call_format: ToolCallFormat,
    content_format: ContentFormat,
}

/// A compiled chat template and the facts about it the encoder needs.
///
/// `Send + Sync`: the engine shares one per model across request threads.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    default: Variant,
    /// The `tool_use` variant of a list-form template, used when a request passes `tools`
    /// (what HF `apply_chat_template` does).
    tool_use: Option<Variant>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("sha256", &self.default.sha256)
            .field("tool_call_format", &self.default.tool_call_format)
            .field("content_format", &self.default.content_format)
            .field("tool_use_variant", &self.tool_use.is_some())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// What an encoding did, recorded with every request so a replay can tell encodings apart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodingReport {
    /// Name of the reasoning rule applied (`drop_before_last_user_unless_tools`).
    pub reasoning_rule: String,
    /// Whether tools were present (the rule keeps reasoning when they are).
    pub tools_present: bool,
    /// Indices (into the request's messages) of assistant turns whose reasoning was dropped.
    pub reasoning_dropped: Vec<usize>,
    /// Indices of assistant turns whose reasoning was rendered.
    pub reasoning_kept: Vec<usize>,
    /// Messages silently dropped from the front by `fault.context_window` (0 without the fault).
    pub messages_truncated: usize,
    /// SHA-256 of the template source, hex.
    pub template_sha256: String,
    /// The encoding-relevant toggles in force (`fault.encoding`, `fault.context_window`).
    pub faults: Vec<String>,
}

/// A rendered and tokenized prompt.
#[derive(Debug, Clone)]
pub struct Encoding {
    /// The rendered prompt text.
    pub text: String,
    /// Its token IDs.
    pub ids: Vec<u32>,
    /// What the encoder did.
    pub report: EncodingReport,
}

/// Generated text split into its parts per the template's convention.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParsedOutput {
    /// Visible answer text (reasoning and tool-call markup removed).
    pub content: String,
    /// Text inside `<think>...</think>`, if any.
    pub reasoning_content: Option<String>,
    /// Tool calls found, with generated IDs `call_<n>`.
    pub tool_calls: Vec<ToolCall>,
}

/// Options of one encoding.
#[derive(Debug, Clone, Copy)]
pub struct EncodeOptions {
    /// Append the assistant header so the model answers.
    pub add_generation_prompt: bool,
    /// Toggles in force (only the encoding faults matter here).
    pub toggles: Toggles,
}

/// Where a model directory's template came from, for error messages.
const MISSING_TEMPLATE: &str =
    "chat template (no \"chat_template\" in tokenizer_config.json and no chat_template.jinja)";

impl ChatTemplate {
    /// Reads the chat template of a model directory, as HF `transformers` does:
    /// `chat_template.jinja` when present (newer checkpoints store it there and it overrides the
    /// config), else `chat_template` of `tokenizer_config.json`, either a string or the list form
    /// `[{"name", "template"}, ...]`, of which `default` is used, and `tool_use` (when present)
    /// for requests that pass tools. BOS/EOS come from the tokenizer.
    pub fn from_dir(dir: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let bos = tokenizer.bos_token.as_deref();
        let eos = tokenizer.eos_token.as_deref();
        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.exists() {
            let source =
                std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?;
            return Self::from_source(&source, bos, eos);
        }
        let cfg_path = dir.join("tokenizer_config.json");
        let missing = || Error::MissingFile {
            dir: dir.to_path_buf(),
            file: MISSING_TEMPLATE.to_string(),
        };
        if !cfg_path.exists() {
            return Err(missing());
        }
        let cfg = read_json(&cfg_path)?;
        match cfg.get("chat_template") {
            None | Some(serde_json::Value::Null) => Err(missing()),
            Some(serde_json::Value::String(source)) => Self::from_source(source, bos, eos),
            Some(serde_json::Value::Array(list)) => {
                let named = |wanted: &str| {
                    list.iter().find_map(|item| {
                        (item.get("name")?.as_str()? == wanted)
                            .then(|| item.get("template")?.as_str())
                            .flatten()
                    })
                };
                let default = named("default").ok_or_else(|| Error::BadJson {
                    path: cfg_path.clone(),
                    message: "\"chat_template\" is a list without a template named \"default\""
                        .to_string(),
                })?;
                let mut template = Self::from_source(default, bos, eos)?;
                if let Some(tool_use) = named("tool_use") {
                    template.add_tool_use(tool_use)?;
                }
                Ok(template)
            }
            Some(_) => Err(Error::BadJson {
                path: cfg_path,
                message: "\"chat_template\" must be a string or a list of {name, template}"
                    .to_string(),
            }),
        }
    }

    /// Compiles a template from source, with the BOS/EOS token texts it may print.
    pub fn from_source(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(template_error)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson_filter);
        env.add_function("strftime_now", |fmt: &str| strftime(fmt, unix_now()));
        if let Some(bos) = bos {
            env.add_global("bos_token", bos.to_string());
        }
        if let Some(eos) = eos {
            env.add_global("eos_token", eos.to_string());
        }
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            default: Variant::of(TEMPLATE_NAME, source),
            tool_use: None,
            bos_token: bos.map(str::to_string),
            eos_token: eos.map(str::to_string),
        })
    }

    /// Adds the `tool_use` variant of a list-form template.
    fn add_tool_use(&mut self, source: &str) -> Result<()> {
        self.env
            .add_template_owned(TOOL_USE_NAME, source.to_string())
            .map_err(template_error)?;
        self.tool_use = Some(Variant::of(TOOL_USE_NAME, source));
        Ok(())
    }

    /// Makes `strftime_now` render a fixed instant (Unix seconds, UTC) instead of the clock.
    ///
    /// Templates such as Llama 3.2's print today's date; a replay that wants byte-identical
    /// prompts across days pins it here. Without it the current UTC time is used (HF uses local
    /// time; servers run in UTC).
    pub fn with_fixed_time(mut self, unix_seconds: i64) -> Self {
        self.env
            .add_function("strftime_now", move |fmt: &str| strftime(fmt, unix_seconds));
        self
    }

    /// The tool-call convention of this template (of its `tool_use` variant when it has one,
    /// since tool calls only happen with tools).
    ///
    /// Detected from the source: `<tool_call>` → Hermes; otherwise a template that mentions
    /// `parameters` and `ipython` or `python_tag` → Llama JSON; otherwise Hermes.
    pub fn tool_call_format(&self) -> ToolCallFormat {
        self.tool_use
            .as_ref()
            .unwrap_or(&self.default)
            .tool_call_format
    }

    /// How list-of-parts content is passed to the (default) template.
    pub fn content_format(&self) -> ContentFormat {
        self.default.content_format
    }

    /// SHA-256 (hex) of the default template source, as recorded in [`EncodingReport`].
    pub fn sha256(&self) -> &str {
        &self.default.sha256
    }

    /// The default template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders messages (after the reasoning rule) to prompt text.
    ///
    /// Each message becomes a map like the OpenAI JSON HF templates are written against:
    /// * `role`; `content` always present: a string for string content, `none` when absent, and
    ///   list content per [`ContentFormat`].
    /// * `tool_calls` (omitted when absent or empty, so `'tool_calls' in message` tests behave):
    ///   `{id, type, function: {name, arguments}}` where `arguments` is the parsed JSON **object**
    ///   when the OpenAI argument string parses as one (Qwen2.5/Llama 3.1 templates print
    ///   `arguments | tojson`, which would double-encode a string; vLLM parses them the same
    ///   way), `{}` when the string is empty or blank (vLLM does the same), and the raw string
    ///   otherwise so no text is lost.
    /// * `reasoning_content` (assistant turns, subject to [`REASONING_RULE`]), `tool_call_id`,
    ///   `name`: omitted when absent so `is defined` tests behave.
    ///
    /// `tools` is passed as given (`none` when `None`), as HF and vLLM do; "tools present" for the
    /// reasoning rule means `Some` and non-empty. `fault.context_window` is not applied here (it
    /// needs token counts; see [`ChatTemplate::encode`]).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<(String, EncodingReport)> {
        let all: Vec<usize> = (0..messages.len()).collect();
        self.render_selected(messages, &all, tools, opts)
    }

    /// Renders and tokenizes, applying `fault.context_window` (which needs token counts).
    ///
    /// With `fault.context_window=N` and a prompt over N tokens, the oldest message that is not a
    /// `system`/`developer` message and not the last message is dropped, together with what would
    /// be left invalid by dropping it: an assistant turn with tool calls takes the `tool` results
    /// that directly follow it, and `tool` results left at the front of the conversation go too.
    /// This repeats (re-rendering each time, the reasoning rule re-applied to what remains, as a
    /// server behind a truncating proxy would) until the prompt fits or only system messages and
    /// the last message remain; a prompt that still does not fit is returned as is. The number of
    /// dropped messages is `report.messages_truncated`; report indices always refer to the
    /// caller's `messages`.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<Encoding> {
        let mut keep: Vec<usize> = (0..messages.len()).collect();
        let mut truncated = 0usize;
        loop {
            let (text, mut report) = self.render_selected(messages, &keep, tools, opts)?;
            let ids = tokenizer.encode(&text)?;
            report.messages_truncated = truncated;
            let limit = opts.toggles.fault_context_window.map(NonZeroUsize::get);
            let over = limit.is_some_and(|n| ids.len() > n);
            let dropped = if over {
                drop_oldest_group(messages, &mut keep)
            } else {
                0
            };
            if dropped == 0 {
                return Ok(Encoding { text, ids, report });
            }
            truncated += dropped;
        }
    }

    /// Renders the messages at `keep` (indices into `messages`, ascending).
    fn render_selected(
        &self,
        messages: &[ChatMessage],
        keep: &[usize],
        tools: Option<&[serde_json::Value]>,
        opts: &EncodeOptions,
    ) -> Result<(String, EncodingReport)> {
        if messages.is_empty() || keep.is_empty() {
            return Err(Error::InvalidRequest(
                "messages must contain at least one message".to_string(),
            ));
        }
        let tools_present = tools.is_some_and(|t| !t.is_empty());
        let fault = opts.toggles.fault_encoding;
        let selected: Vec<&ChatMessage> = keep.iter().filter_map(|&i| messages.get(i)).collect();
        let decisions = reasoning_decisions(&selected, tools_present, fault);
        // HF selects the `tool_use` variant whenever `tools` is passed (even an empty list).
        let variant = match (&self.tool_use, tools) {
            (Some(tool_use), Some(_)) => tool_use,
            _ => &self.default,
        };
        let mut reasoning_dropped = Vec::new();
        let mut reasoning_kept = Vec::new();
        let mut ctx_messages = Vec::with_capacity(selected.len());
        for ((&orig, msg), decision) in keep.iter().zip(&selected).zip(&decisions) {
            match decision {
                Reasoning::Dropped => reasoning_dropped.push(orig),
                Reasoning::Kept => reasoning_kept.push(orig),
                Reasoning::None => {}
            }
            let keep_reasoning = !matches!(decision, Reasoning::Dropped);
            ctx_messages.push(message_value(msg, keep_reasoning, variant.content_format));
        }
        let template = self
            .env
            .get_template(variant.name)
            .map_err(template_error)?;
        let ctx = minijinja::context! {
            messages => Value::from(Serde(&ctx_messages)),
            tools => Value::from(Serde(tools)),
            add_generation_prompt => opts.add_generation_prompt,
        };
        let text = template.render(ctx).map_err(template_error)?;
        let report = EncodingReport {
            reasoning_rule: REASONING_RULE.to_string(),
            tools_present,
            reasoning_dropped,
            reasoning_kept,
            messages_truncated: 0,
            template_sha256: variant.sha256.clone(),
            faults: encoding_faults(&opts.toggles),
        };
        Ok((text, report))
    }

    /// Splits generated text into content, reasoning and tool calls.
    ///
    /// * Reasoning: the text between `<think>` and `</think>`; a `</think>` with no opening tag
    ///   before it (the prompt opened the think block) makes everything before it reasoning; a
    ///   `<think>` never closed (generation stopped while thinking) makes everything after it
    ///   reasoning. Reasoning is trimmed; empty reasoning is `None`.
    /// * Hermes: every `<tool_call>...</tool_call>` block whose body is a JSON object with a string
    ///   `name` (and `arguments` or `parameters`) becomes a tool call; a block that does not parse
    ///   stays in the content verbatim. A final unterminated block counts when its body parses.
    /// * Llama JSON: when the whole remaining content (trimmed, `<|python_tag|>` stripped) is such
    ///   a JSON object, or several separated by whitespace or `;` (vLLM's `llama3_json` rule), they
    ///   are the tool calls and content is empty; otherwise it is all content.
    ///
    /// Tool-call IDs are `call_<n>`, n counting from 0 within this output: deterministic, so a
    /// replay of the same output compares equal. Arguments are compact JSON text (an argument
    /// value that is already a string is kept as that string). Content is trimmed. Never panics
    /// and never loses text that is not reasoning or a parsed tool call.
    pub fn parse_output(&self, text: &str) -> ParsedOutput {
        let (reasoning, rest) = split_reasoning(text);
        let (content, tool_calls) = match self.tool_call_format() {
            ToolCallFormat::Hermes => parse_hermes(&rest),
            ToolCallFormat::LlamaJson => parse_llama_json(&rest),
        };
        ParsedOutput {
            content,
            reasoning_content: reasoning,
            tool_calls,
        }
    }
}

impl Variant {
    fn of(name: &'static str, source: &str) -> Self {
        Variant {
            name,
            sha256: hex::encode(Sha256::digest(source.as_bytes())),
            tool_call_format: detect_tool_call_format(source),
            content_format: detect_content_format(source),
        }
    }
}

fn detect_tool_call_format(source: &str) -> ToolCallFormat {
    if source.contains("<tool_call>") {
        ToolCallFormat::Hermes
    } else if source.contains("parameters")
        && (source.contains("ipython") || source.contains("python_tag"))
    {
        ToolCallFormat::LlamaJson
    } else {
        ToolCallFormat::Hermes
    }
}

/// `Parts` when the source has a `for` loop over some message's content (`for x in
/// message.content`, `m['content']`, `m["content"]`), as vLLM's detection decides; else `String`.
fn detect_content_format(source: &str) -> ContentFormat {
    let iterates = source.split("{%").skip(1).any(|stmt| {
        let stmt = stmt.split("%}").next().unwrap_or("");
        let stmt = stmt.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let Some(rest) = stmt.strip_prefix("for") else {
            return false;
        };
        let Some((_, iterable)) = rest.split_once(" in ") else {
            return false;
        };
        let iterable = iterable
            .trim_start()
            .split(|c: char| c == '|' || c.is_whitespace())
            .next()
            .unwrap_or("");
        [".content", "['content']", "[\"content\"]"]
            .iter()
            .any(|suffix| iterable.ends_with(suffix))
    });
    if iterates {
        ContentFormat::Parts
    } else {
        ContentFormat::String
    }
}

/// What the reasoning rule decided for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reasoning {
    /// Not an assistant message with `reasoning_content`.
    None,
    /// Reasoning passed to the template.
    Kept,
    /// Reasoning removed before rendering.
    Dropped,
}

/// Applies [`REASONING_RULE`] (and the `drop_thinking_always` fault) to a message list.
fn reasoning_decisions(
    messages: &[&ChatMessage],
    tools_present: bool,
    fault: EncodingFault,
) -> Vec<Reasoning> {
    let last_user = messages.iter().rposition(|m| m.role == "user");
    let drop_before_last_user = match fault {
        EncodingFault::Off => !tools_present,
        EncodingFault::DropThinkingAlways => true,
    };
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if m.role != "assistant" || m.reasoning_content.is_none() {
                Reasoning::None
            } else if drop_before_last_user && last_user.is_some_and(|u| i < u) {
                Reasoning::Dropped
            } else {
                Reasoning::Kept
            }
        })
        .collect()
}

/// The encoding toggles in force, as `name=value`.
fn encoding_faults(toggles: &Toggles) -> Vec<String> {
    toggles
        .non_default()
        .into_iter()
        .filter(|(name, _)| *name == "fault.encoding" || *name == "fault.context_window")
        .map(|(name, value)| format!("{name}={value}"))
        .collect()
}

/// Removes the oldest droppable group from `keep` (see [`ChatTemplate::encode`]); returns how
/// many messages it removed (0 when nothing may be dropped).
fn drop_oldest_group(messages: &[ChatMessage], keep: &mut Vec<usize>) -> usize {
    let is_system = |i: usize| {
        messages
            .get(i)
            .is_some_and(|m| m.role == "system" || m.role == "developer")
    };
    let role = |i: usize| messages.get(i).map_or("", |m| m.role.as_str());
    let last = keep.len().saturating_sub(1);
    let Some(pos) = keep[..last].iter().position(|&i| !is_system(i)) else {
        return 0;
    };
    keep.remove(pos);
    let mut removed = 1;
    // Everything before `pos` is a system message, so `tool` results now at `pos` answer calls
    // that are gone (the dropped turn's, or earlier ones): drop them too, never the last message.
    while pos + 1 < keep.len() && role(keep[pos]) == "tool" {
        keep.remove(pos);
        removed += 1;
    }
    removed
}

/// Converts a message to the map a template sees (see [`ChatTemplate::render`]).
fn message_value(
    msg: &ChatMessage,
    keep_reasoning: bool,
    content_format: ContentFormat,
) -> serde_json::Value {
    use serde_json::{json, Map, Value as J};
    let mut m = Map::new();
    m.insert("role".into(), J::String(msg.role.clone()));
    let content = match &msg.content {
        None => J::Null,
        Some(MessageContent::Text(s)) => J::String(s.clone()),
        Some(MessageContent::Parts(parts)) => match content_format {
            ContentFormat::String => J::String(
                parts
                    .iter()
                    .filter(|p| p.kind == "text")
                    .filter_map(|p| p.text.as_deref())
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            ContentFormat::Parts => serde_json::to_value(parts).unwrap_or(J::Null),
        },
    };
    m.insert("content".into(), content);
    if keep_reasoning {
        if let Some(r) = &msg.reasoning_content {
            m.insert("reasoning_content".into(), J::String(r.clone()));
        }
    }
    if let Some(calls) = msg.tool_calls.as_ref().filter(|c| !c.is_empty()) {
        let calls: Vec<J> = calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": c.kind,
                    "function": {
                        "name": c.function.name,
                        "arguments": template_arguments(&c.function.arguments),
                    },
                })
            })
            .collect();
        m.insert("tool_calls".into(), J::Array(calls));
    }
    if let Some(id) = &msg.tool_call_id {
        m.insert("tool_call_id".into(), J::String(id.clone()));
    }
    if let Some(name) = &msg.name {
        m.insert("name".into(), J::String(name.clone()));
    }
    J::Object(m)
}

/// OpenAI argument string → template value: a JSON object when it parses as one, `{}` when blank,
/// else the string itself.
fn template_arguments(arguments: &str) -> serde_json::Value {
    if arguments.trim().is_empty() {
        return serde_json::Value::Object(serde_json::Map::new());
    }
    match serde_json::from_str::<serde_json::Value>(arguments) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        _ => serde_json::Value::String(arguments.to_string()),
    }
}

/// Maps a minijinja error (with its causes) to the engine's template error.
fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    Error::Template(msg)
}

/// HF's `raise_exception(message)`: aborts rendering with the template's own message.
fn raise_exception(message: Value) -> std::result::Result<Value, minijinja::Error> {
    let message = match message.as_str() {
        Some(s) => s.to_string(),
        None => message.to_string(),
    };
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// HF's `tojson` filter: Python `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, so spacing (`", "`, `": "`), float formatting and non-ASCII text match what
/// `transformers` renders (minijinja's built-in escapes `<`, `>`, `&`, `'` for HTML instead).
/// Positional arguments follow Python's order: `ensure_ascii`, `indent`.
fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii = match ensure_ascii {
        Some(v) => v.is_true(),
        None => kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(usize::try_from(v.as_i64().unwrap_or(0).max(0)).unwrap_or(0)),
        }),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: cannot serialize")
            .with_source(e)
    })?;
    let writer = PyJson {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    writer.write(&json, 0, &mut out);
    Ok(Value::from(out))
}

/// A writer reproducing Python's `json.dumps` output byte for byte.
struct PyJson {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => {
                if let Some(i) = n.as_i64() {
                    out.push_str(&i.to_string());
                } else if let Some(u) = n.as_u64() {
                    out.push_str(&u.to_string());
                } else {
                    out.push_str(&py_float_repr(n.as_f64().unwrap_or(f64::NAN)));
                }
            }
            J::String(s) => self.write_str(s, out),
            J::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &J)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, val)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write_str(k, out);
                    out.push_str(&self.key_sep);
                    self.write(val, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)` as `json.dumps` writes it: shortest round-trip digits, positional
/// notation for exponents in [-4, 16), else `d.ddde±XX`; `NaN`/`Infinity` as Python writes them.
fn py_float_repr(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_string();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if v < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let (int, frac) = if exp >= 0 {
            let int_len = usize::try_from(exp).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                (
                    format!("{digits}{}", "0".repeat(int_len - digits.len())),
                    "0".to_string(),
                )
            } else {
                (digits[..int_len].to_string(), digits[int_len..].to_string())
            }
        } else {
            let zeros = usize::try_from(-exp - 1).unwrap_or(0);
            ("0".to_string(), format!("{}{digits}", "0".repeat(zeros)))
        };
        format!("{sign}{int}.{frac}")
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        let mant = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mant}e{esign}{:02}", exp.unsigned_abs())
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0))
}

/// Python `strftime` (C locale) over a UTC instant, through jiff's `strtime` (the same
/// directives: `%Y %m %d %e %B %b %A %a %H %I %M %S %p %j %F %T %Z %z %%` and more). A format jiff
/// cannot render (an unknown directive) comes back as written, as glibc leaves what it does not
/// know.
fn strftime(fmt: &str, unix_seconds: i64) -> String {
    jiff::Timestamp::from_second(unix_seconds)
        .ok()
        .and_then(|t| jiff::fmt::strtime::format(fmt, &t.to_zoned(jiff::tz::TimeZone::UTC)).ok())
        .unwrap_or_else(|| fmt.to_string())
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// Splits off reasoning (see [`ChatTemplate::parse_output`]); returns (reasoning, the rest).
fn split_reasoning(text: &str) -> (Option<String>, String) {
    let open = text.find(THINK_OPEN);
    let close = text.find(THINK_CLOSE);
    let (reasoning, rest) = match (open, close) {
        (Some(o), Some(c)) if o < c => (
            &text[o + THINK_OPEN.len()..c],
            format!("{}{}", &text[..o], &text[c + THINK_CLOSE.len()..]),
        ),
        (Some(o), None) => (&text[o + THINK_OPEN.len()..], text[..o].to_string()),
        (_, Some(c)) => (&text[..c], text[c + THINK_CLOSE.len()..].to_string()),
        (None, None) => return (None, text.to_string()),
    };
    let reasoning = reasoning.trim();
    let reasoning = (!reasoning.is_empty()).then(|| reasoning.to_string());
    (reasoning, rest)
}

/// A tool call from a JSON body `{"name": ..., "arguments"|"parameters": ...}`, or `None`.
fn call_from_json(body: &str, index: usize) -> Option<ToolCall> {
    let value: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    call_from_value(&value, index)
}

/// A tool call from a parsed JSON object with a string `name`, or `None`.
fn call_from_value(value: &serde_json::Value, index: usize) -> Option<ToolCall> {
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(serde_json::Value::Null) => "{}".to_string(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => serde_json::to_string(other).ok()?,
    };
    Some(ToolCall {
        id: format!("call_{index}"),
        kind: "function".to_string(),
        function: FunctionCall { name, arguments },
    })
}

/// Hermes `<tool_call>` blocks → tool calls; everything else stays content.
fn parse_hermes(text: &str) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(CALL_OPEN) {
        content.push_str(&rest[..start]);
        let body_start = start + CALL_OPEN.len();
        let after = &rest[body_start..];
        match after.find(CALL_CLOSE) {
            Some(end) => {
                let block_end = body_start + end + CALL_CLOSE.len();
                match call_from_json(&after[..end], calls.len()) {
                    Some(call) => calls.push(call),
                    None => content.push_str(&rest[start..block_end]),
                }
                rest = &rest[block_end..];
            }
            None => {
                match call_from_json(after, calls.len()) {
                    Some(call) => calls.push(call),
                    None => content.push_str(&rest[start..]),
                }
                rest = "";
            }
        }
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// Llama JSON tool calls when the whole text (trimmed, `<|python_tag|>` stripped) is a sequence of
/// one or more call objects separated by whitespace or `;` (as vLLM's `llama3_json` parser
/// accepts); otherwise the text is content.
fn parse_llama_json(text: &str) -> (String, Vec<ToolCall>) {
    let trimmed = text.trim();
    let mut rest = trimmed.strip_prefix(PYTHON_TAG).unwrap_or(trimmed);
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if rest.is_empty() {
            break;
        }
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<serde_json::Value>();
        let call = match stream.next() {
            Some(Ok(value)) => call_from_value(&value, calls.len()),
            _ => None,
        };
        match call {
            Some(call) => {
                calls.push(call);
                rest = &rest[stream.byte_offset()..];
            }
            None => return (trimmed.to_string(), Vec::new()),
        }
    }
    if calls.is_empty() {
        return (trimmed.to_string(), Vec::new());
    }
    (String::new(), calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.7, "0.7"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (123456.789, "123456.789"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ];
        for (v, want) in cases {
            assert_eq!(py_float_repr(v), want, "{v}");
        }
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 00:00:00 UTC (a Friday).
        let t = 1_721_952_000;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %j %H:%M:%S %p %%", t),
            "Friday July 208 00:00:00 AM %"
        );
        assert_eq!(strftime("%F %T", 0), "1970-01-01 00:00:00");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
        // An unknown directive leaves the format as written.
        assert_eq!(strftime("%Y %~", 0), "%Y %~");
    }

    #[test]
    fn content_format_detection() {
        assert_eq!(
            detect_content_format("{% for c in message['content'] %}{{ c.text }}{% endfor %}"),
            ContentFormat::Parts
        );
        assert_eq!(
            detect_content_format("{%- for part in message.content -%}{% endfor %}"),
            ContentFormat::Parts
        );
        assert_eq!(
            detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}"),
            ContentFormat::String
        );
    }

    #[test]
    fn reasoning_split_cases() {
        assert_eq!(
            split_reasoning("<think>\nhm\n</think>\n\nHi"),
            (Some("hm".into()), "\n\nHi".into())
        );
        assert_eq!(
            split_reasoning("hm</think>Hi"),
            (Some("hm".into()), "Hi".into())
        );
        assert_eq!(
            split_reasoning("<think>still"),
            (Some("still".into()), "".into())
        );
        assert_eq!(split_reasoning("<think></think>x"), (None, "x".into()));
        assert_eq!(split_reasoning("plain"), (None, "plain".into()));
    }
}
