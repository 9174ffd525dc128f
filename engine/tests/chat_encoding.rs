//! Chat encoding: exact renderings of multi-turn conversations through a Qwen-style (ChatML,
//! Hermes tool calls, `<think>` reasoning) and a Llama-3.1-style (headers, JSON tool calls,
//! `ipython`) template, the reasoning rule, the encoding faults, and parsing generated text back.
//!
//! Expected strings were cross-checked against Python Jinja2 configured as HF `transformers`
//! configures it (trim_blocks, lstrip_blocks, HF's `tojson`), so they pin HF-identical bytes.

use std::path::Path;

use serde_json::json;
use tapedeck_engine::chat::{
    ChatTemplate, ContentFormat, EncodeOptions, ToolCallFormat, REASONING_RULE,
};
use tapedeck_engine::messages::{ContentPart, FunctionCall, MessageContent};
use tapedeck_engine::toggles::{EncodingFault, Toggles};
use tapedeck_engine::tokenizer::Tokenizer;
use tapedeck_engine::{ChatMessage, Error, ToolCall};

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/chat");
/// 2024-07-26 00:00:00 UTC, the date Meta's template hard-codes.
const FIXED_TIME: i64 = 1_721_952_000;

fn template_source(name: &str) -> String {
    std::fs::read_to_string(Path::new(DATA).join(name)).expect("test template")
}

const QWEN_SPECIALS: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];
const LLAMA_SPECIALS: &[&str] = &[
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
];

/// Writes a byte-level BPE `tokenizer.json` (one token per byte, no merges, plus the given added
/// tokens) into `dir`: a real `tokenizers` tokenizer with predictable token counts.
fn write_tokenizer_json(dir: &Path, specials: &[&str]) {
    let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    alphabet.sort_unstable();
    let vocab: serde_json::Map<String, serde_json::Value> = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": alphabet.len() + i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": false, "use_regex": true});
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

/// A model directory with a tokenizer and the given `tokenizer_config.json`.
fn model_dir(specials: &[&str], config: serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer_json(dir.path(), specials);
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

struct Model {
    _dir: tempfile::TempDir,
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

fn qwen() -> Model {
    let dir = model_dir(
        QWEN_SPECIALS,
        json!({"chat_template": template_source("qwen_hermes_think.jinja"),
               "eos_token": "<|im_end|>", "bos_token": null}),
    );
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    let template = ChatTemplate::from_dir(dir.path(), &tokenizer).unwrap();
    Model {
        _dir: dir,
        tokenizer,
        template,
    }
}

fn llama() -> Model {
    let dir = model_dir(
        LLAMA_SPECIALS,
        json!({"chat_template": template_source("llama31_json_tools.jinja"),
               "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    );
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    let template = ChatTemplate::from_dir(dir.path(), &tokenizer)
        .unwrap()
        .with_fixed_time(FIXED_TIME);
    Model {
        _dir: dir,
        tokenizer,
        template,
    }
}

fn opts(toggles: &str) -> EncodeOptions {
    EncodeOptions {
        add_generation_prompt: true,
        toggles: toggles.parse().unwrap(),
    }
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

fn assistant(
    reasoning: Option<&str>,
    content: Option<&str>,
    calls: &[(&str, &str, &str)],
) -> ChatMessage {
    ChatMessage {
        role: "assistant".into(),
        content: content.map(|c| MessageContent::Text(c.into())),
        reasoning_content: reasoning.map(str::to_string),
        tool_calls: (!calls.is_empty()).then(|| {
            calls
                .iter()
                .map(|(id, name, args)| ToolCall {
                    id: (*id).into(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: (*name).into(),
                        arguments: (*args).into(),
                    },
                })
                .collect()
        }),
        tool_call_id: None,
        name: None,
    }
}

fn tool_result(id: &str, content: &str) -> ChatMessage {
    ChatMessage {
        tool_call_id: Some(id.into()),
        ..msg("tool", content)
    }
}

fn tools() -> Vec<serde_json::Value> {
    vec![
        json!({"type": "function", "function": {"name": "read_file",
            "description": "Read a file — UTF-8 <text> & more",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string"}, "limit": {"type": "number", "default": 1.0}},
                "required": ["path"]}}}),
        json!({"type": "function", "function": {"name": "grep", "description": "Search",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}},
                "required": ["pattern"]}}}),
    ]
}

/// system, user, assistant with reasoning, a second user turn, an assistant tool-call turn with
/// content "" (what opencode sends) and reasoning, two tool results.
fn agent_conversation() -> Vec<ChatMessage> {
    vec![
        msg("system", "You are a careful coding agent."),
        msg("user", "Hi! Who are you?"),
        assistant(Some("\nGreet back.\n"), Some("I am a coding agent."), &[]),
        msg("user", "Read notes.txt and grep for TODO."),
        assistant(
            Some("Two tools needed."),
            Some(""),
            &[
                ("call_a", "read_file", r#"{"path":"notes.txt"}"#),
                ("call_b", "grep", r#"{"pattern":"TODO","flags":["-n"]}"#),
            ],
        ),
        tool_result("call_a", "alpha\nTODO: beta"),
        tool_result("call_b", "notes.txt:2:TODO: beta"),
    ]
}

const QWEN_TOOLS_HEADER: &str = "<|im_start|>system\nYou are a careful coding agent.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"read_file\", \"description\": \"Read a file — UTF-8 <text> & more\", \"parameters\": {\"type\": \"object\", \"properties\": {\"path\": {\"type\": \"string\"}, \"limit\": {\"type\": \"number\", \"default\": 1.0}}, \"required\": [\"path\"]}}}\n{\"type\": \"function\", \"function\": {\"name\": \"grep\", \"description\": \"Search\", \"parameters\": {\"type\": \"object\", \"properties\": {\"pattern\": {\"type\": \"string\"}}, \"required\": [\"pattern\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

const QWEN_AGENT_TAIL: &str = "<|im_start|>user\nRead notes.txt and grep for TODO.<|im_end|>\n<|im_start|>assistant\n<think>\nTwo tools needed.\n</think>\n\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"notes.txt\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"grep\", \"arguments\": {\"pattern\": \"TODO\", \"flags\": [\"-n\"]}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nalpha\nTODO: beta\n</tool_response>\n<tool_response>\nnotes.txt:2:TODO: beta\n</tool_response><|im_end|>\n<|im_start|>assistant\n";

#[test]
fn qwen_multi_turn_with_tools_renders_exactly_and_keeps_all_reasoning() {
    let m = qwen();
    let tools = tools();
    let enc = m
        .template
        .encode(&m.tokenizer, &agent_conversation(), Some(&tools), &opts(""))
        .unwrap();
    let expected = format!(
        "{QWEN_TOOLS_HEADER}<|im_start|>user\nHi! Who are you?<|im_end|>\n<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nI am a coding agent.<|im_end|>\n{QWEN_AGENT_TAIL}"
    );
    assert_eq!(enc.text, expected);
    let r = &enc.report;
    assert_eq!(r.reasoning_rule, REASONING_RULE);
    assert_eq!(r.reasoning_rule, "drop_before_last_user_unless_tools");
    assert!(r.tools_present);
    assert_eq!(r.reasoning_kept, vec![2, 4]);
    assert!(r.reasoning_dropped.is_empty());
    assert_eq!(r.messages_truncated, 0);
    assert!(r.faults.is_empty());
    assert_eq!(r.template_sha256, m.template.sha256());
    assert_eq!(r.template_sha256.len(), 64);

    // Special tokens are single IDs and the IDs decode back to the exact text.
    let im_start = m.tokenizer.token_to_id("<|im_start|>").unwrap();
    assert_eq!(enc.ids[0], im_start);
    assert_eq!(
        enc.ids.iter().filter(|&&i| i == im_start).count(),
        expected.matches("<|im_start|>").count()
    );
    assert_eq!(m.tokenizer.decode(&enc.ids).unwrap(), expected);
}

#[test]
fn qwen_without_tools_drops_reasoning_before_last_user_only() {
    let m = qwen();
    let (text, report) = m
        .template
        .render(&agent_conversation(), None, &opts(""))
        .unwrap();
    let expected = format!(
        "<|im_start|>system\nYou are a careful coding agent.<|im_end|>\n<|im_start|>user\nHi! Who are you?<|im_end|>\n<|im_start|>assistant\nI am a coding agent.<|im_end|>\n{QWEN_AGENT_TAIL}"
    );
    assert_eq!(text, expected);
    assert!(!report.tools_present);
    assert_eq!(report.reasoning_dropped, vec![2]);
    assert_eq!(report.reasoning_kept, vec![4]);

    // An empty tool list is "no tools" for the rule.
    let (_, report) = m
        .template
        .render(&agent_conversation(), Some(&[]), &opts(""))
        .unwrap();
    assert!(!report.tools_present);
    assert_eq!(report.reasoning_dropped, vec![2]);

    // With no user message at all nothing is "before the last user message".
    let no_user = vec![msg("system", "s"), assistant(Some("r"), Some("a"), &[])];
    let (text, report) = m.template.render(&no_user, None, &opts("")).unwrap();
    assert!(text.contains("<think>\nr\n</think>"), "{text}");
    assert_eq!(report.reasoning_kept, vec![1]);
}

#[test]
fn tool_messages_do_not_count_as_user_messages() {
    // The last user message is index 1; the turns after it (a tool loop) keep reasoning even
    // without tools, the turn before... there is none, so nothing is dropped.
    let m = qwen();
    let conv = vec![
        msg("user", "go"),
        assistant(Some("first"), None, &[("c0", "grep", r#"{"pattern":"x"}"#)]),
        tool_result("c0", "hit"),
        assistant(Some("second"), Some("done"), &[]),
    ];
    let (text, report) = m.template.render(&conv, None, &opts("")).unwrap();
    assert_eq!(report.reasoning_kept, vec![1, 3]);
    assert!(report.reasoning_dropped.is_empty());
    assert!(
        text.contains("<think>\nfirst\n</think>") && text.contains("<think>\nsecond\n</think>")
    );
}

#[test]
fn drop_thinking_always_fault_changes_the_rendering_with_tools() {
    let m = qwen();
    let tools = tools();
    let conv = agent_conversation();
    let good = m
        .template
        .encode(&m.tokenizer, &conv, Some(&tools), &opts(""))
        .unwrap();
    let faulty_opts = EncodeOptions {
        add_generation_prompt: true,
        toggles: Toggles {
            fault_encoding: EncodingFault::DropThinkingAlways,
            ..Toggles::default()
        },
    };
    let bad = m
        .template
        .encode(&m.tokenizer, &conv, Some(&tools), &faulty_opts)
        .unwrap();
    let expected = format!(
        "{QWEN_TOOLS_HEADER}<|im_start|>user\nHi! Who are you?<|im_end|>\n<|im_start|>assistant\nI am a coding agent.<|im_end|>\n{QWEN_AGENT_TAIL}"
    );
    assert_eq!(bad.text, expected);
    assert_ne!(bad.ids, good.ids);
    assert!(bad.report.tools_present);
    assert_eq!(bad.report.reasoning_dropped, vec![2]);
    assert_eq!(bad.report.reasoning_kept, vec![4]);
    assert_eq!(
        bad.report.faults,
        vec!["fault.encoding=drop_thinking_always"]
    );
    // The first differing token is where the dropped reasoning was.
    let first_diff = good
        .ids
        .iter()
        .zip(&bad.ids)
        .position(|(a, b)| a != b)
        .unwrap();
    let prefix = m.tokenizer.decode(&good.ids[..first_diff]).unwrap();
    assert!(
        prefix.ends_with("Hi! Who are you?<|im_end|>\n<|im_start|>assistant\n"),
        "{prefix}"
    );
}

#[test]
fn context_window_fault_drops_oldest_messages_and_reports_it() {
    let m = qwen();
    let tools = tools();
    let conv = agent_conversation();
    // The window that fits exactly the conversation without messages 1 and 2.
    let without_first_exchange: Vec<ChatMessage> = [&conv[..1], &conv[3..]].concat();
    let target = m
        .template
        .encode(
            &m.tokenizer,
            &without_first_exchange,
            Some(&tools),
            &opts(""),
        )
        .unwrap();
    let full = m
        .template
        .encode(&m.tokenizer, &conv, Some(&tools), &opts(""))
        .unwrap();
    assert!(full.ids.len() > target.ids.len());
    let window = target.ids.len();
    let enc = m
        .template
        .encode(
            &m.tokenizer,
            &conv,
            Some(&tools),
            &opts(&format!("fault.context_window={window}")),
        )
        .unwrap();
    assert_eq!(enc.text, target.text);
    assert_eq!(enc.ids, target.ids);
    assert_eq!(enc.report.messages_truncated, 2);
    assert_eq!(
        enc.report.faults,
        vec![format!("fault.context_window={window}")]
    );
    // Indices still refer to the caller's messages.
    assert_eq!(enc.report.reasoning_kept, vec![4]);

    // A window that fits: nothing dropped, the fault is still listed as in force.
    let roomy = m
        .template
        .encode(
            &m.tokenizer,
            &conv,
            Some(&tools),
            &opts("fault.context_window=100000"),
        )
        .unwrap();
    assert_eq!(roomy.report.messages_truncated, 0);
    assert_eq!(roomy.text, full.text);
    assert_eq!(roomy.report.faults, vec!["fault.context_window=100000"]);

    // A window nothing fits: drops down to system + last message; the assistant tool-call turn
    // goes together with the tool result that follows it (4 and 5), the last message stays.
    let tiny = m
        .template
        .encode(
            &m.tokenizer,
            &conv,
            Some(&tools),
            &opts("fault.context_window=1"),
        )
        .unwrap();
    assert_eq!(tiny.report.messages_truncated, 5);
    assert!(tiny.report.reasoning_kept.is_empty() && tiny.report.reasoning_dropped.is_empty());
    assert_eq!(
        tiny.text,
        format!(
            "{QWEN_TOOLS_HEADER}<|im_start|>user\n<tool_response>\nnotes.txt:2:TODO: beta\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
    );
}

#[test]
fn context_window_truncation_reapplies_the_reasoning_rule() {
    // Without tools: dropping the first user message keeps the second one as the last user, so the
    // rule still drops the reasoning of the assistant turn before it.
    let m = qwen();
    let conv = agent_conversation();
    let (full, _) = m.template.render(&conv, None, &opts("")).unwrap();
    let full_len = m.tokenizer.encode(&full).unwrap().len();
    let enc = m
        .template
        .encode(
            &m.tokenizer,
            &conv,
            None,
            &opts(&format!("fault.context_window={}", full_len - 1)),
        )
        .unwrap();
    assert_eq!(enc.report.messages_truncated, 1);
    assert_eq!(enc.report.reasoning_dropped, vec![2]);
    assert_eq!(enc.report.reasoning_kept, vec![4]);
    assert!(!enc.text.contains("Hi! Who are you?"));
    assert!(enc
        .text
        .contains("<|im_start|>assistant\nI am a coding agent.<|im_end|>"));
}

#[test]
fn list_of_text_parts_renders_like_a_string() {
    let m = qwen();
    let as_string = vec![msg("system", "sys"), msg("user", "first line\nsecond line")];
    let mut as_parts = as_string.clone();
    as_parts[1].content = Some(MessageContent::Parts(vec![
        ContentPart {
            kind: "text".into(),
            text: Some("first line".into()),
        },
        ContentPart {
            kind: "image_url".into(),
            text: None,
        },
        ContentPart {
            kind: "text".into(),
            text: Some("second line".into()),
        },
    ]));
    assert_eq!(m.template.content_format(), ContentFormat::String);
    let a = m.template.render(&as_string, None, &opts("")).unwrap().0;
    let b = m.template.render(&as_parts, None, &opts("")).unwrap().0;
    assert_eq!(a, b);

    // A single text part is the same as its string in a template that iterates parts, too.
    let parts_template = ChatTemplate::from_source(
        "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}\n{% endfor %}",
        None,
        None,
    )
    .unwrap();
    assert_eq!(parts_template.content_format(), ContentFormat::Parts);
    let mut one_part = as_string.clone();
    one_part[1].content = Some(MessageContent::Parts(vec![ContentPart {
        kind: "text".into(),
        text: Some("first line\nsecond line".into()),
    }]));
    assert_eq!(
        parts_template
            .render(&as_string, None, &opts(""))
            .unwrap()
            .0,
        parts_template.render(&one_part, None, &opts("")).unwrap().0,
    );
}

#[test]
fn tool_call_arguments_are_objects_when_they_parse_else_strings() {
    let t = ChatTemplate::from_source(
        "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments is mapping }} {{ c.function.arguments | tojson }}\n{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let conv = vec![
        msg("user", "u"),
        assistant(
            None,
            None,
            &[
                ("a", "f", r#"{"b":1,"a":[true,null,2.50]}"#),
                ("b", "f", ""),
                ("c", "f", "not json"),
                ("d", "f", "[1, 2]"),
            ],
        ),
    ];
    let (text, _) = t.render(&conv, None, &opts("")).unwrap();
    assert_eq!(
        text,
        "True {\"b\": 1, \"a\": [true, null, 2.5]}\nTrue {}\nFalse \"not json\"\nFalse \"[1, 2]\"\n"
    );
}

#[test]
fn hf_tojson_matches_python_json_dumps() {
    let t = ChatTemplate::from_source(
        "{% for tool in tools %}{{ tool | tojson }}|{{ tool | tojson(indent=2) }}|{{ tool | tojson(ensure_ascii=true) }}|{{ tool | tojson(separators=(',', ':'), sort_keys=true) }}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let tools = vec![
        json!({"z": "é <b>&'\"\n\u{1F600}", "a": {"f": 1e-5, "g": 1e16, "h": 3.0, "i": -7}, "e": []}),
    ];
    let (text, _) = t
        .render(&[msg("user", "x")], Some(&tools), &opts(""))
        .unwrap();
    let expected = [
        "{\"z\": \"é <b>&'\\\"\\n\u{1F600}\", \"a\": {\"f\": 1e-05, \"g\": 1e+16, \"h\": 3.0, \"i\": -7}, \"e\": []}",
        "{\n  \"z\": \"é <b>&'\\\"\\n\u{1F600}\",\n  \"a\": {\n    \"f\": 1e-05,\n    \"g\": 1e+16,\n    \"h\": 3.0,\n    \"i\": -7\n  },\n  \"e\": []\n}",
        "{\"z\": \"\\u00e9 <b>&'\\\"\\n\\ud83d\\ude00\", \"a\": {\"f\": 1e-05, \"g\": 1e+16, \"h\": 3.0, \"i\": -7}, \"e\": []}",
        "{\"a\":{\"f\":1e-05,\"g\":1e+16,\"h\":3.0,\"i\":-7},\"e\":[],\"z\":\"é <b>&'\\\"\\n\u{1F600}\"}",
    ]
    .join("|");
    assert_eq!(text, expected);
}

const LLAMA_SYSTEM_WITH_TOOLS: &str = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou have access to the following functions. To call a function, please respond with JSON for a function call.Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        \"description\": \"Current weather\",\n        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                }\n            },\n            \"required\": [\n                \"city\"\n            ]\n        }\n    }\n}\n\nYou are a helpful assistant.<|eot_id|>";

fn llama_tools() -> Vec<serde_json::Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}),
    ]
}

fn llama_conversation() -> Vec<ChatMessage> {
    vec![
        msg("system", "You are a helpful assistant."),
        msg("user", "What's the weather in Paris?"),
        assistant(
            None,
            None,
            &[(
                "call_0",
                "get_weather",
                r#"{"city":"Paris","unit":"celsius"}"#,
            )],
        ),
        tool_result("call_0", r#"{"temp": 21.5}"#),
        msg("assistant", "It is 21.5 °C in Paris."),
        msg("user", "Thanks!"),
    ]
}

#[test]
fn llama_multi_turn_with_json_tool_calls_renders_exactly() {
    let m = llama();
    assert_eq!(m.template.tool_call_format(), ToolCallFormat::LlamaJson);
    let tools = llama_tools();
    let enc = m
        .template
        .encode(&m.tokenizer, &llama_conversation(), Some(&tools), &opts(""))
        .unwrap();
    // Meta's template JSON-encodes string tool results (`is iterable` is true for strings in
    // Jinja): the quirk is reproduced, not corrected.
    let expected = format!(
        "{LLAMA_SYSTEM_WITH_TOOLS}<|start_header_id|>user<|end_header_id|>\n\nWhat's the weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{{\"name\": \"get_weather\", \"parameters\": {{\"city\": \"Paris\", \"unit\": \"celsius\"}}}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"{{\\\"temp\\\": 21.5}}\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nIt is 21.5 °C in Paris.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThanks!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(enc.text, expected);
    assert_eq!(
        enc.ids[0],
        m.tokenizer.token_to_id("<|begin_of_text|>").unwrap()
    );
    assert_eq!(m.tokenizer.decode(&enc.ids).unwrap(), expected);
    assert!(enc.report.tools_present);
    assert!(enc.report.reasoning_kept.is_empty() && enc.report.reasoning_dropped.is_empty());

    // Without tools: no ipython environment and no function list.
    let (text, _) = m
        .template
        .render(&llama_conversation()[..2], None, &opts(""))
        .unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat's the weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn raise_exception_surfaces_as_template_error_with_the_message() {
    let m = llama();
    let mut conv = llama_conversation();
    conv[2] = assistant(
        None,
        None,
        &[("a", "get_weather", "{}"), ("b", "get_weather", "{}")],
    );
    let err = m
        .template
        .encode(&m.tokenizer, &conv, Some(&llama_tools()), &opts(""))
        .unwrap_err();
    match &err {
        Error::Template(message) => assert!(
            message.contains("This model only supports single tool-calls at once!"),
            "{message}"
        ),
        other => panic!("expected Error::Template, got {other:?}"),
    }

    let q = qwen();
    let err = q
        .template
        .render(&[msg("narrator", "once upon a time")], None, &opts(""))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Template(m) if m.contains("Unknown role: narrator")),
        "{err}"
    );
}

#[test]
fn empty_messages_are_an_invalid_request() {
    let m = qwen();
    assert!(matches!(
        m.template.encode(&m.tokenizer, &[], None, &opts("")),
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(
        m.template.render(&[], None, &opts("")),
        Err(Error::InvalidRequest(_))
    ));
}

/// The text the model generated for the last assistant turn of a rendering (between its header
/// and its end-of-turn token).
fn generated_part<'a>(text: &'a str, header: &str, end: &str) -> &'a str {
    let start = text.rfind(header).unwrap() + header.len();
    let len = text[start..].find(end).unwrap();
    &text[start..start + len]
}

#[test]
fn hermes_parse_output_inverts_the_template() {
    let m = qwen();
    assert_eq!(m.template.tool_call_format(), ToolCallFormat::Hermes);
    let calls = [
        ("call_x", "read_file", r#"{"path":"notes.txt","limit":2}"#),
        (
            "call_y",
            "grep",
            r#"{"pattern":"TODO \"quoted\" é","flags":["-n"]}"#,
        ),
    ];
    let turn = assistant(Some("Let me look."), Some("Checking both."), &calls);
    let conv = vec![msg("user", "go"), turn];
    let opts = EncodeOptions {
        add_generation_prompt: false,
        ..opts("")
    };
    let (text, _) = m.template.render(&conv, Some(&tools()), &opts).unwrap();
    let generated = generated_part(&text, "<|im_start|>assistant\n", "<|im_end|>");
    let parsed = m.template.parse_output(generated);
    assert_eq!(parsed.content, "Checking both.");
    assert_eq!(parsed.reasoning_content.as_deref(), Some("Let me look."));
    assert_eq!(parsed.tool_calls.len(), 2);
    for (i, (call, (_, name, args))) in parsed.tool_calls.iter().zip(calls).enumerate() {
        assert_eq!(call.id, format!("call_{i}"));
        assert_eq!(call.kind, "function");
        assert_eq!(call.function.name, name);
        assert_eq!(call.function.arguments, args);
    }

    // Generation that starts inside the think block (the prompt opened it).
    let parsed = m
        .template
        .parse_output("thinking hard\n</think>\n\nThe answer is 4.");
    assert_eq!(parsed.reasoning_content.as_deref(), Some("thinking hard"));
    assert_eq!(parsed.content, "The answer is 4.");
    assert!(parsed.tool_calls.is_empty());
}

#[test]
fn malformed_tool_call_json_stays_in_content() {
    let m = qwen();
    let text = "<think>plan</think>\nBefore.\n<tool_call>\n{\"name\": \"grep\", \"arguments\": {\"pattern\": \n</tool_call>\n<tool_call>\n{\"name\": \"grep\", \"arguments\": {\"pattern\": \"ok\"}}\n</tool_call>\nAfter.";
    let parsed = m.template.parse_output(text);
    assert_eq!(parsed.reasoning_content.as_deref(), Some("plan"));
    assert_eq!(
        parsed.content,
        "Before.\n<tool_call>\n{\"name\": \"grep\", \"arguments\": {\"pattern\": \n</tool_call>\n\nAfter."
    );
    assert_eq!(parsed.tool_calls.len(), 1);
    assert_eq!(parsed.tool_calls[0].id, "call_0");
    assert_eq!(
        parsed.tool_calls[0].function.arguments,
        r#"{"pattern":"ok"}"#
    );

    // A block missing its name, and an unterminated block that does not parse: all content.
    let text = "<tool_call>{\"arguments\": {}}</tool_call> and <tool_call>{\"name\": \"x\"";
    let parsed = m.template.parse_output(text);
    assert!(parsed.tool_calls.is_empty());
    assert_eq!(parsed.content, text);

    // An unterminated block that parses (generation stopped at the closing tag) is a call.
    let parsed = m
        .template
        .parse_output("<tool_call>\n{\"name\": \"x\", \"arguments\": {\"a\": 1}}\n");
    assert_eq!(parsed.tool_calls.len(), 1);
    assert_eq!(parsed.tool_calls[0].function.arguments, r#"{"a":1}"#);
    assert_eq!(parsed.content, "");

    // Unclosed thinking: everything after <think> is reasoning, nothing is content.
    let parsed = m.template.parse_output("<think>\nstill going");
    assert_eq!(parsed.reasoning_content.as_deref(), Some("still going"));
    assert_eq!(parsed.content, "");
}

#[test]
fn llama_parse_output_inverts_the_template() {
    let m = llama();
    let conv = &llama_conversation()[..3];
    let opts = EncodeOptions {
        add_generation_prompt: false,
        ..opts("")
    };
    let (text, _) = m
        .template
        .render(conv, Some(&llama_tools()), &opts)
        .unwrap();
    let generated = generated_part(
        &text,
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    );
    let parsed = m.template.parse_output(generated);
    assert_eq!(parsed.content, "");
    assert_eq!(parsed.tool_calls.len(), 1);
    assert_eq!(parsed.tool_calls[0].id, "call_0");
    assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
    assert_eq!(
        parsed.tool_calls[0].function.arguments,
        r#"{"city":"Paris","unit":"celsius"}"#
    );

    let parsed = m
        .template
        .parse_output("<|python_tag|>{\"name\": \"f\", \"arguments\": {\"k\": [1]}}");
    assert_eq!(parsed.tool_calls[0].function.name, "f");
    assert_eq!(parsed.tool_calls[0].function.arguments, r#"{"k":[1]}"#);

    // Several calls, separated by newlines or `;`.
    let parsed = m.template.parse_output(
        "{\"name\": \"a\", \"parameters\": {}};\n{\"name\": \"b\", \"parameters\": {\"x\": 1}}",
    );
    let names: Vec<_> = parsed
        .tool_calls
        .iter()
        .map(|c| c.function.name.as_str())
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(parsed.tool_calls[1].id, "call_1");
    assert_eq!(parsed.tool_calls[1].function.arguments, r#"{"x":1}"#);

    for plain in [
        "It is sunny.",
        "{\"name\": \"f\"} trailing",
        "{\"not\": \"a call\"}",
        "Sure:\n{\"name\": \"f\", \"parameters\": {}}",
    ] {
        let parsed = m.template.parse_output(plain);
        assert!(parsed.tool_calls.is_empty(), "{plain}");
        assert_eq!(parsed.content, plain);
    }
}

#[test]
fn from_dir_reads_every_template_location_and_names_the_missing_one() {
    let qwen_src = template_source("qwen_hermes_think.jinja");
    let llama_src = template_source("llama31_json_tools.jinja");

    // chat_template.jinja overrides tokenizer_config.json.
    let dir = model_dir(QWEN_SPECIALS, json!({"chat_template": llama_src}));
    std::fs::write(dir.path().join("chat_template.jinja"), &qwen_src).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let t = ChatTemplate::from_dir(dir.path(), &tok).unwrap();
    assert_eq!(t.source(), qwen_src);

    // List form: "default" without tools, "tool_use" with tools (as HF selects).
    let dir = model_dir(
        QWEN_SPECIALS,
        json!({"chat_template": [
            {"name": "tool_use", "template": "TOOLS{% for m in messages %}|{{ m.content }}{% endfor %}<tool_call>"},
            {"name": "default", "template": "PLAIN{% for m in messages %}|{{ m.content }}{% endfor %}"}
        ]}),
    );
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let t = ChatTemplate::from_dir(dir.path(), &tok).unwrap();
    let conv = [msg("user", "hi")];
    let (plain, plain_report) = t.render(&conv, None, &opts("")).unwrap();
    let (with_tools, tools_report) = t.render(&conv, Some(&tools()), &opts("")).unwrap();
    assert_eq!(plain, "PLAIN|hi");
    assert_eq!(with_tools, "TOOLS|hi<tool_call>");
    assert_ne!(plain_report.template_sha256, tools_report.template_sha256);
    assert_eq!(plain_report.template_sha256, t.sha256());

    // No template anywhere: the error names both places looked at.
    let dir = model_dir(QWEN_SPECIALS, json!({"eos_token": "<|im_end|>"}));
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let err = ChatTemplate::from_dir(dir.path(), &tok).unwrap_err();
    assert!(matches!(err, Error::MissingFile { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("tokenizer_config.json") && text.contains("chat_template.jinja"),
        "{text}"
    );

    // A template that does not compile is a template error.
    let err = ChatTemplate::from_source("{% for x in %}", None, None).unwrap_err();
    assert!(matches!(err, Error::Template(_)), "{err:?}");
}

#[test]
fn bos_and_eos_are_globals_and_generation_prompt_is_optional() {
    let t = ChatTemplate::from_source(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
        Some("<s>"),
        Some("</s>"),
    )
    .unwrap();
    let conv = [msg("user", "a"), msg("assistant", "b")];
    assert_eq!(
        t.render(&conv, None, &opts("")).unwrap().0,
        "<s>a</s>b</s>>"
    );
    let no_prompt = EncodeOptions {
        add_generation_prompt: false,
        toggles: Toggles::default(),
    };
    assert_eq!(
        t.render(&conv, None, &no_prompt).unwrap().0,
        "<s>a</s>b</s>"
    );
}

#[test]
fn strftime_now_and_trim_blocks_follow_hf() {
    let t = ChatTemplate::from_source(
        "{% if true %}\n  A {{ strftime_now('%Y-%m-%d') }}\n{% endif %}\nB",
        None,
        None,
    )
    .unwrap()
    .with_fixed_time(FIXED_TIME);
    // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before one.
    assert_eq!(
        t.render(&[msg("user", "x")], None, &opts("")).unwrap().0,
        "  A 2024-07-26\nB"
    );
}
