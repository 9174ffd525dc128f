//! Session stitching and classification with opencode-shaped traffic: a ~10k-character system
//! prompt, ten tools whose parameter schemas carry `$schema`, assistant turns with `content: ""`
//! plus tool calls and `reasoning_content`, `tool` results, a title side request, a compaction and
//! the rewritten history after it; then a restart that must keep stitching.

mod common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use common::{temp_store, Scripted};
use serde_json::{json, Value};
use tapedeck_recorder::record::{RequestKind, SessionSource, StitchMethod};
use tapedeck_recorder::server::{app, AppOptions, AppState};
use tapedeck_recorder::stitch::classify;
use tapedeck_recorder::Store;
use tower::ServiceExt;

fn system_prompt() -> String {
    let mut s = String::from(
        "You are opencode, an interactive CLI tool that helps users with software engineering \
         tasks. Use the instructions below and the tools available to you to assist the user.\n",
    );
    while s.len() < 10_000 {
        s.push_str("- Always read a file before editing it. Prefer small, focused edits. ");
    }
    s
}

fn tools() -> Value {
    let names = [
        "bash",
        "edit",
        "webfetch",
        "glob",
        "grep",
        "list",
        "read",
        "write",
        "todowrite",
        "task",
    ];
    Value::Array(
        names
            .iter()
            .map(|n| {
                json!({"type": "function", "function": {
                    "name": n,
                    "description": format!("The {n} tool."),
                    "parameters": {
                        "$schema": "http://json-schema.org/draft-07/schema#",
                        "type": "object",
                        "properties": {"path": {"type": "string", "description": "a path"}},
                        "required": ["path"],
                        "additionalProperties": false,
                    },
                }})
            })
            .collect(),
    )
}

async fn chat(state: &AppState, body: Value, session_header: Option<&str>) -> Value {
    let mut req = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("user-agent", "opencode/0.9.0 ai-sdk/provider-utils/3");
    if let Some(h) = session_header {
        req = req.header("x-session-id", h);
    }
    let resp = app(state.clone())
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

async fn state_on(store: Store, backend: Arc<Scripted>) -> AppState {
    AppState::new(backend, store, AppOptions::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn opencode_agent_session_with_title_and_compaction() {
    let (_dir, store) = temp_store().await;
    let backend = Arc::new(Scripted::new(1 << 20));
    backend.script(&[
        // turn 0: reasoning + a tool call
        "<think>|I need to read main.rs first.|</think>|\n<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"src/main.rs\", \"limit\": 200}}\n</tool_call>",
        // title request
        "Fix bug in main.rs",
        // turn 1: an answer
        "The bug| is an off-by-one| in the loop.",
        // compaction
        "Summary: we fixed an off-by-one in src/main.rs; next, run the tests.",
        // after compaction
        "Running the tests now.",
    ]);
    let state = state_on(store.clone(), backend.clone()).await;
    let sys = json!({"role": "system", "content": system_prompt()});
    let user = json!({"role": "user", "content": "Fix the bug in src/main.rs"});

    // Turn 0.
    let r0 = chat(
        &state,
        json!({"model": "scripted", "messages": [sys, user], "tools": tools(), "stream": false}),
        None,
    )
    .await;
    let m0 = &r0["choices"][0]["message"];
    let call = m0["tool_calls"][0].clone();
    assert_eq!(call["function"]["name"], "read");

    // The title side request, as opencode sends it: its own system prompt, no tools.
    let title = chat(
        &state,
        json!({"messages": [
            {"role": "system", "content": "You are a title generator. You output ONLY a thread title. Nothing else.\n<task>\nGenerate a brief title that would help the user find this conversation later.\n</task>"},
            {"role": "user", "content": "Fix the bug in src/main.rs"},
        ]}),
        None,
    )
    .await;
    assert_eq!(
        title["choices"][0]["message"]["content"],
        "Fix bug in main.rs"
    );

    // Turn 1: the client echoes the answer its own way — `content: ""`, reasoning attached,
    // arguments re-serialized with different key order and spacing — and adds the tool result.
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let echoed_args = format!(
        "{{\"limit\": {}, \"path\": \"{}\"}}",
        args["limit"],
        args["path"].as_str().unwrap()
    );
    let assistant0 = json!({
        "role": "assistant",
        "content": "",
        "reasoning_content": m0["reasoning_content"],
        "tool_calls": [{"id": call["id"], "type": "function",
                        "function": {"name": "read", "arguments": echoed_args}}],
    });
    let tool0 = json!({"role": "tool", "tool_call_id": call["id"], "content": "fn main() { for i in 0..=n {} }"});
    let msgs1 = json!([sys, user, assistant0, tool0]);
    let r1 = chat(&state, json!({"messages": msgs1, "tools": tools()}), None).await;
    let answer1 = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(answer1, "The bug is an off-by-one in the loop.");

    // Compaction: the whole history plus a request to summarize.
    let mut msgs2 = msgs1.as_array().unwrap().clone();
    msgs2.push(json!({"role": "assistant", "content": format!("{answer1}\n")}));
    msgs2.push(json!({"role": "user", "content": "Provide a detailed prompt for continuing our conversation above. Focus on information that would be helpful for continuing the conversation, including what we did, what we're doing, which files we're working on, and what we're going to do next."}));
    let r2 = chat(&state, json!({"messages": msgs2}), None).await;
    let summary = r2["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    // After compaction the history is rewritten: the summary replaces it.
    let msgs3 = json!([sys, {"role": "assistant", "content": summary}, {"role": "user", "content": "Continue if you have next steps"}]);
    chat(&state, json!({"messages": msgs3, "tools": tools()}), None).await;

    state.writer().flush().await.unwrap();
    let sessions = store.sessions().await.unwrap();
    assert_eq!(sessions.len(), 2, "{sessions:#?}");
    let agent = sessions
        .iter()
        .find(|s| s.requests == 4)
        .expect("agent session");
    let title_s = sessions
        .iter()
        .find(|s| s.requests == 1)
        .expect("title session");
    assert_eq!(agent.source, SessionSource::Content);
    assert_eq!(
        agent.client_hint.as_deref(),
        Some("opencode/0.9.0 ai-sdk/provider-utils/3")
    );
    let reqs = store.session_requests(&agent.id).await.unwrap();
    let kinds: Vec<RequestKind> = reqs.iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [
            RequestKind::Agent,
            RequestKind::Agent,
            RequestKind::Compaction,
            RequestKind::Agent
        ]
    );
    let turns: Vec<u32> = reqs
        .iter()
        .map(|r| r.session.as_ref().unwrap().turn)
        .collect();
    // The title request took no turn of this session.
    assert_eq!(turns, [0, 1, 2, 3]);
    let stitch: Vec<StitchMethod> = reqs
        .iter()
        .map(|r| r.session.as_ref().unwrap().stitch)
        .collect();
    assert_eq!(
        stitch,
        [
            StitchMethod::New,
            StitchMethod::Prefix,
            StitchMethod::Prefix,
            StitchMethod::Compaction
        ]
    );
    let parents: Vec<_> = reqs
        .iter()
        .map(|r| r.session.as_ref().unwrap().parent)
        .collect();
    assert_eq!(
        parents,
        [None, Some(reqs[0].id), Some(reqs[1].id), Some(reqs[2].id)]
    );
    let title_reqs = store.session_requests(&title_s.id).await.unwrap();
    assert_eq!(title_reqs[0].kind, RequestKind::Title);
    // The recorded request is the body as received, $schema and all.
    assert!(reqs[0].request_body.contains("$schema"));
    assert!(reqs[0].request_body.len() > 10_000);

    // Restart: a new state over the same database keeps stitching into the same session.
    state.shutdown().await;
    let backend2 = Arc::new(Scripted::new(1 << 20));
    backend2.script(&["Tests pass."]);
    let state2 = state_on(store.clone(), backend2).await;
    let mut msgs4 = msgs3.as_array().unwrap().clone();
    msgs4.push(json!({"role": "assistant", "content": "Running the tests now."}));
    msgs4.push(json!({"role": "user", "content": "and?"}));
    chat(&state2, json!({"messages": msgs4, "tools": tools()}), None).await;
    state2.writer().flush().await.unwrap();
    let reqs = store.session_requests(&agent.id).await.unwrap();
    assert_eq!(reqs.len(), 5);
    let last = reqs[4].session.as_ref().unwrap();
    assert_eq!(
        (last.turn, last.stitch, last.parent),
        (4, StitchMethod::Prefix, Some(reqs[3].id))
    );
}

#[tokio::test]
async fn header_sessions_win_and_count_turns() {
    let (_dir, store) = temp_store().await;
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["one", "two", "three"]);
    let state = state_on(store.clone(), backend).await;
    let u = |t: &str| json!({"role": "user", "content": t});
    chat(&state, json!({"messages": [u("a")]}), Some("abc")).await;
    chat(
        &state,
        json!({"messages": [u("a"), {"role": "assistant", "content": "one"}, u("b")]}),
        Some("abc"),
    )
    .await;
    // Unrelated content, same header: same session.
    chat(&state, json!({"messages": [u("zzz")]}), Some("abc")).await;
    state.writer().flush().await.unwrap();
    let reqs = store.session_requests("abc").await.unwrap();
    assert_eq!(reqs.len(), 3);
    let s: Vec<_> = reqs.iter().map(|r| r.session.clone().unwrap()).collect();
    assert!(s
        .iter()
        .all(|s| s.source == SessionSource::Header && s.stitch == StitchMethod::Header));
    assert_eq!(s.iter().map(|s| s.turn).collect::<Vec<_>>(), [0, 1, 2]);
    // The content match is still noted as the parent.
    assert_eq!(s[1].parent, Some(reqs[0].id));
    assert_eq!(s[2].parent, None);
}

#[tokio::test]
async fn a_retry_of_the_same_turn_and_an_unrelated_chat() {
    let (_dir, store) = temp_store().await;
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["hi there"]);
    let state = state_on(store.clone(), backend).await;
    let first = json!({"messages": [{"role": "user", "content": "hello"}]});
    chat(&state, first.clone(), None).await;
    chat(&state, first, None).await; // identical: no prefix match, new session
    let next = json!({"messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "how are you"},
    ]});
    chat(&state, next, None).await;
    state.writer().flush().await.unwrap();
    let sessions = store.sessions().await.unwrap();
    assert_eq!(sessions.len(), 2);
    // Both earlier requests registered the same continuation; the later one wins, and the
    // continuation joins its session.
    assert_eq!(sessions.iter().map(|s| s.requests).sum::<i64>(), 3);
    assert!(sessions.iter().any(|s| s.requests == 2));
}

fn msgs(v: Value) -> Vec<tapedeck_engine::ChatMessage> {
    serde_json::from_value(v).unwrap()
}

#[test]
fn classification_heuristics() {
    let title = msgs(json!([
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "debug my code"}
    ]));
    assert_eq!(classify(&title, false), RequestKind::Title);
    // With tools it is an agent turn that merely mentions a title.
    assert_eq!(classify(&title, true), RequestKind::Agent);
    let compaction = msgs(json!([
        {"role": "system", "content": "You are a helpful AI assistant tasked with summarizing conversations."},
        {"role": "user", "content": "Provide a detailed prompt for continuing our conversation above."}
    ]));
    assert_eq!(classify(&compaction, false), RequestKind::Compaction);
    assert_eq!(classify(&compaction, true), RequestKind::Compaction);
    let plain = msgs(json!([{"role": "user", "content": "What is 2+2?"}]));
    assert_eq!(classify(&plain, false), RequestKind::Other);
    assert_eq!(classify(&plain, true), RequestKind::Agent);
    // A long agent prompt that mentions summaries and the conversation deep inside (as opencode's
    // does: "...avoid summarizing your action...") is still an agent turn: only the persona
    // opening of the system prompt counts.
    let mut long = system_prompt();
    long.push_str("\nDo not add a summary of the conversation unless asked. Never write a title.");
    let agent = msgs(json!([
        {"role": "system", "content": long},
        {"role": "user", "content": "fix the tests"}
    ]));
    assert_eq!(classify(&agent, true), RequestKind::Agent);
    assert_eq!(classify(&agent, false), RequestKind::Other);
}
