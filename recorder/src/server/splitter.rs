//! Splits generated text, as it streams, into visible content, reasoning and tool calls.
//!
//! Qwen-style models write `<think>...</think>` before the answer and Hermes tool calls as
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Tokens do not respect tag
//! boundaries (`<tool` `_call>`), so text that could still be the start of a tag is held back until
//! the next token decides it. A tool-call block is buffered to its end tag and then parsed whole
//! (with the engine's parser, falling back to plain JSON), so clients receive a complete call:
//! first its name, then its arguments.
//!
//! Whitespace: leading whitespace of the content and of the reasoning is dropped and trailing
//! whitespace is only sent once more text follows, so that what is streamed is exactly the
//! trimmed text that a non-streaming response returns. Both paths run this same splitter.

use std::sync::Arc;

use serde_json::Value;
use tapedeck_engine::chat::ParsedOutput;
use tapedeck_engine::messages::FunctionCall;
use tapedeck_engine::ToolCall;

/// A piece of output ready to send.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Visible answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool call, with its index among this response's calls.
    ToolCall(usize, ToolCall),
}

/// How tool calls are recognized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools were offered: `<tool_call>` is ordinary text.
    Off,
    /// Hermes `<tool_call>` blocks, parsed as they close.
    Hermes,
    /// Calls that have no markers (a bare JSON object): content is held to the end and parsed whole.
    Buffered,
}

/// The engine's output parser, shared with the splitter.
pub type ParseFn = Arc<dyn Fn(&str) -> ParsedOutput + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Content,
    Reasoning,
    ToolCall,
}

#[derive(Debug, Default)]
struct Trim {
    started: bool,
    held: String,
}

impl Trim {
    /// Returns the text to emit now, holding trailing whitespace back.
    fn feed(&mut self, s: &str) -> Option<String> {
        let s = if self.started { s } else { s.trim_start() };
        if s.is_empty() {
            return None;
        }
        self.started = true;
        let full = std::mem::take(&mut self.held) + s;
        let body = full.trim_end();
        self.held = full[body.len()..].to_string();
        (!body.is_empty()).then(|| body.to_string())
    }
}

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

/// The streaming splitter. Feed it text with [`Splitter::push`], then call [`Splitter::finish`].
pub struct Splitter {
    mode: ToolMode,
    parse: ParseFn,
    state: State,
    pending: String,
    block: String,
    buffered: String,
    content_trim: Trim,
    reasoning_trim: Trim,
    /// Everything emitted so far.
    content: String,
    reasoning: Option<String>,
    calls: Vec<ToolCall>,
}

impl std::fmt::Debug for Splitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Splitter")
            .field("mode", &self.mode)
            .field("state", &self.state)
            .finish()
    }
}

/// The complete split output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Split {
    /// Visible answer.
    pub content: String,
    /// Reasoning, if any was emitted.
    pub reasoning: Option<String>,
    /// Tool calls.
    pub tool_calls: Vec<ToolCall>,
}

/// A fresh OpenAI-style tool call ID.
pub fn new_call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// Parses a Hermes block body (`{"name": ..., "arguments": ...}`) without the engine.
fn parse_call_json(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Some(ToolCall {
        id: new_call_id(),
        kind: "function".into(),
        function: FunctionCall { name, arguments },
    })
}

impl Splitter {
    /// A splitter; `starts_in_reasoning` when the prompt already opened a `<think>` block.
    pub fn new(mode: ToolMode, starts_in_reasoning: bool, parse: ParseFn) -> Self {
        Splitter {
            mode,
            parse,
            state: if starts_in_reasoning {
                State::Reasoning
            } else {
                State::Content
            },
            pending: String::new(),
            block: String::new(),
            buffered: String::new(),
            content_trim: Trim::default(),
            reasoning_trim: Trim::default(),
            content: String::new(),
            reasoning: starts_in_reasoning.then(String::new),
            calls: Vec::new(),
        }
    }

    fn tags(&self) -> &'static [&'static str] {
        match (self.state, self.mode) {
            (State::Content, ToolMode::Hermes) => &[THINK, CALL],
            (State::Content, _) => &[THINK],
            (State::Reasoning, _) => &[THINK_END],
            (State::ToolCall, _) => &[CALL_END],
        }
    }

    /// Adds generated text; returns what can be sent now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.pending.push_str(text);
        loop {
            let tags = self.tags();
            let hit = tags
                .iter()
                .filter_map(|t| self.pending.find(t).map(|p| (p, *t)))
                .min_by_key(|(p, _)| *p);
            match hit {
                Some((pos, tag)) => {
                    let before = self.pending[..pos].to_string();
                    self.pending.drain(..pos + tag.len());
                    self.emit(&before, &mut out);
                    self.transition(tag, &mut out);
                }
                None => {
                    let keep = held_suffix(&self.pending, tags);
                    let cut = self.pending.len() - keep;
                    let now = self.pending[..cut].to_string();
                    self.pending.drain(..cut);
                    self.emit(&now, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// Ends the text: flushes held text and an unterminated block; returns the last pieces.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        self.emit(&rest, &mut out);
        if self.state == State::ToolCall {
            // Cut off inside a block (max_tokens): a call if it parses, else plain text.
            let block = std::mem::take(&mut self.block);
            if !self.emit_calls(&format!("{CALL}{block}"), &block, &mut out) {
                self.state = State::Content;
                self.emit_content(&format!("{CALL}{block}"), &mut out);
            }
            self.state = State::Content;
        }
        if self.mode == ToolMode::Buffered {
            let text = std::mem::take(&mut self.buffered);
            let parsed = (self.parse)(&text);
            if parsed.tool_calls.is_empty() {
                self.emit_content(&text, &mut out);
            } else {
                self.emit_content(&parsed.content, &mut out);
                for mut c in parsed.tool_calls {
                    c.id = new_call_id();
                    self.push_call(c, &mut out);
                }
            }
        }
        out
    }

    /// Everything emitted so far.
    pub fn result(&self) -> Split {
        Split {
            content: self.content.clone(),
            reasoning: self.reasoning.clone().filter(|r| !r.is_empty()),
            tool_calls: self.calls.clone(),
        }
    }

    fn transition(&mut self, tag: &str, out: &mut Vec<Piece>) {
        match tag {
            THINK => {
                self.state = State::Reasoning;
                self.reasoning.get_or_insert_with(String::new);
            }
            THINK_END => self.state = State::Content,
            CALL => {
                self.state = State::ToolCall;
                self.block.clear();
            }
            _ => {
                let block = std::mem::take(&mut self.block);
                self.state = State::Content;
                if !self.emit_calls(&format!("{CALL}{block}{CALL_END}"), &block, out) {
                    self.emit_content(&format!("{CALL}{block}{CALL_END}"), out);
                }
            }
        }
    }

    /// Parses one block into calls; false when it holds none.
    fn emit_calls(&mut self, markup: &str, body: &str, out: &mut Vec<Piece>) -> bool {
        let mut calls = (self.parse)(markup).tool_calls;
        if calls.is_empty() {
            calls.extend(parse_call_json(body));
        }
        if calls.is_empty() {
            return false;
        }
        for mut c in calls {
            c.id = new_call_id();
            self.push_call(c, out);
        }
        true
    }

    fn push_call(&mut self, c: ToolCall, out: &mut Vec<Piece>) {
        out.push(Piece::ToolCall(self.calls.len(), c.clone()));
        self.calls.push(c);
    }

    fn emit(&mut self, text: &str, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        match self.state {
            State::Content if self.mode == ToolMode::Buffered => self.buffered.push_str(text),
            State::Content => self.emit_content(text, out),
            State::Reasoning => {
                if let Some(s) = self.reasoning_trim.feed(text) {
                    self.reasoning.get_or_insert_with(String::new).push_str(&s);
                    out.push(Piece::Reasoning(s));
                }
            }
            State::ToolCall => self.block.push_str(text),
        }
    }

    fn emit_content(&mut self, text: &str, out: &mut Vec<Piece>) {
        if let Some(s) = self.content_trim.feed(text) {
            self.content.push_str(&s);
            out.push(Piece::Content(s));
        }
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `tags`.
fn held_suffix(s: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        for len in (1..tag.len()).rev() {
            if len <= best {
                break;
            }
            if s.is_char_boundary(s.len().saturating_sub(len)) && s.ends_with(&tag[..len]) {
                best = len;
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_engine() -> ParseFn {
        Arc::new(|t: &str| ParsedOutput {
            content: t.to_string(),
            ..Default::default()
        })
    }

    fn run(mode: ToolMode, chunks: &[&str]) -> (Vec<Piece>, Split) {
        let mut s = Splitter::new(mode, false, no_engine());
        let mut out = Vec::new();
        for c in chunks {
            out.extend(s.push(c));
        }
        out.extend(s.finish());
        (out, s.result())
    }

    fn joined(pieces: &[Piece]) -> (String, String) {
        let mut c = String::new();
        let mut r = String::new();
        for p in pieces {
            match p {
                Piece::Content(s) => c.push_str(s),
                Piece::Reasoning(s) => r.push_str(s),
                Piece::ToolCall(..) => {}
            }
        }
        (c, r)
    }

    #[test]
    fn think_split_across_tokens() {
        let text = "<think>\nLet me see.\n</think>\n\nThe answer is 4.";
        // Every way of cutting the text into two pieces gives the same result.
        for cut in 0..=text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let (pieces, split) = run(ToolMode::Hermes, &[&text[..cut], &text[cut..]]);
            assert_eq!(split.content, "The answer is 4.", "cut {cut}");
            assert_eq!(split.reasoning.as_deref(), Some("Let me see."), "cut {cut}");
            assert_eq!(joined(&pieces), (split.content, split.reasoning.unwrap()));
        }
    }

    #[test]
    fn tool_calls_one_char_at_a_time() {
        let text = "I'll look.\n<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"a.rs\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>";
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (pieces, split) = run(ToolMode::Hermes, &refs);
        assert_eq!(split.content, "I'll look.");
        assert_eq!(split.tool_calls.len(), 2);
        assert_eq!(split.tool_calls[0].function.name, "read");
        assert_eq!(split.tool_calls[0].function.arguments, r#"{"path":"a.rs"}"#);
        assert_eq!(split.tool_calls[1].function.arguments, "{}");
        let idx: Vec<usize> = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::ToolCall(i, _) => Some(*i),
                _ => None,
            })
            .collect();
        assert_eq!(idx, vec![0, 1]);
        assert_ne!(split.tool_calls[0].id, split.tool_calls[1].id);
    }

    #[test]
    fn tool_call_text_without_tools_is_content() {
        let text = "<tool_call>{\"name\":\"x\"}</tool_call>";
        let (_, split) = run(ToolMode::Off, &[text]);
        assert_eq!(split.content, text);
        assert!(split.tool_calls.is_empty());
    }

    #[test]
    fn unparsable_or_unterminated_blocks_stay_text() {
        let (_, split) = run(ToolMode::Hermes, &["a <tool_call>not json</tool_call> b"]);
        assert_eq!(split.content, "a <tool_call>not json</tool_call> b");
        let (_, split) = run(ToolMode::Hermes, &["<tool_call>{\"name\": \"re"]);
        assert_eq!(split.content, "<tool_call>{\"name\": \"re");
        let (_, split) = run(
            ToolMode::Hermes,
            &["<tool_call>{\"name\": \"x\", \"arguments\": {}}"],
        );
        assert_eq!(split.tool_calls.len(), 1);
    }

    #[test]
    fn whitespace_is_trimmed_consistently() {
        let (pieces, split) = run(ToolMode::Off, &["  \n", "a", " ", "\n", "b", "  ", "\n"]);
        assert_eq!(split.content, "a \nb");
        assert_eq!(joined(&pieces).0, "a \nb");
        let (_, split) = run(ToolMode::Off, &["a <", "b"]);
        assert_eq!(split.content, "a <b");
        let (_, split) = run(ToolMode::Off, &["ends with <thi"]);
        assert_eq!(split.content, "ends with <thi");
    }

    #[test]
    fn prompt_opened_think() {
        let mut s = Splitter::new(ToolMode::Off, true, no_engine());
        s.push("hmm\n</think>\n\nok");
        s.finish();
        assert_eq!(s.result().reasoning.as_deref(), Some("hmm"));
        assert_eq!(s.result().content, "ok");
    }

    #[test]
    fn buffered_mode_parses_at_the_end() {
        let parse: ParseFn = Arc::new(|t: &str| match parse_call_json(t) {
            Some(c) => ParsedOutput {
                content: String::new(),
                reasoning_content: None,
                tool_calls: vec![c],
            },
            None => ParsedOutput {
                content: t.to_string(),
                ..Default::default()
            },
        });
        let mut s = Splitter::new(ToolMode::Buffered, false, parse);
        assert!(s.push("{\"name\": \"ls\", ").is_empty());
        s.push("\"parameters\": {\"d\": 1}}");
        let out = s.finish();
        assert!(matches!(&out[0], Piece::ToolCall(0, c) if c.function.arguments == r#"{"d":1}"#));
    }
}
