//! `tapedeck sessions`: export is complete and stable, import(export(db)) exports the same bytes,
//! re-importing is idempotent, a minimal generator-written line imports with defaults and keeps
//! stitching, and bad input is an error with its line number.

mod common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::Request;
use common::{scripted_app, temp_store, Scripted};
use serde_json::{json, Value};
use tapedeck_recorder::record::{RequestKind, SessionSource, StitchMethod};
use tapedeck_recorder::server::{app, AppOptions, AppState};
use tapedeck_recorder::sessions::{self, SessionLine, FORMAT};
use tapedeck_recorder::Error;
use tower::ServiceExt;

async fn chat(state: &AppState, body: Value) -> Value {
    let req = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app(state.clone()).oneshot(req).await.unwrap();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

async fn export_string(store: &tapedeck_recorder::Store) -> String {
    let mut out = Vec::new();
    sessions::export(store, &[], &mut out).await.unwrap();
    String::from_utf8(out).unwrap()
}

#[tokio::test]
async fn export_import_round_trip() {
    let backend = Arc::new(Scripted::new(4096));
    backend.script(&["<think>|hmm|</think>|Hi!", "Bye|."]);
    let (_d, state) = scripted_app(backend, AppOptions::default()).await;
    let tools =
        json!([{"type": "function", "function": {"name": "ls", "parameters": {"$schema": "x"}}}]);
    let m1 = json!([{"role": "user", "content": "hello", "x_vendor": 1}]);
    chat(&state, json!({"model": "scripted", "messages": m1, "tools": tools, "temperature": 0.5, "logprobs": true})).await;
    let m2 = json!([
        {"role": "user", "content": "hello", "x_vendor": 1},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [{"type": "text", "text": "bye"}]},
    ]);
    chat(
        &state,
        json!({"model": "scripted", "messages": m2, "tools": tools}),
    )
    .await;
    // A malformed request in its own header-less "session"? No: it has no session; it is not
    // exported. A separate plain chat is.
    chat(
        &state,
        json!({"messages": [{"role": "user", "content": "other"}]}),
    )
    .await;
    state.writer().flush().await.unwrap();
    let store = state.store().clone();

    let text = export_string(&store).await;
    let lines: Vec<SessionLine> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let s = lines.iter().find(|l| l.requests.len() == 2).unwrap();
    assert_eq!(s.format, FORMAT);
    assert_eq!(s.session.source, SessionSource::Content);
    let (r0, r1) = (&s.requests[0], &s.requests[1]);
    assert_eq!((r0.turn, r1.turn), (Some(0), Some(1)));
    assert_eq!(r1.parent_id, r0.id);
    assert_eq!(r1.stitch, Some(StitchMethod::Prefix));
    assert_eq!(r0.kind, Some(RequestKind::Agent));
    // Messages as sent, unknown fields included; the rest of the body in params.
    assert_eq!(r0.messages.as_ref().unwrap()[0]["x_vendor"], 1);
    assert_eq!(r0.tools.as_ref().unwrap()[0]["function"]["name"], "ls");
    assert_eq!(r0.params["temperature"], 0.5);
    assert!(r0.params.get("messages").is_none());
    let resp = r0.response.as_ref().unwrap();
    assert_eq!(resp.content, "Hi!");
    assert_eq!(resp.reasoning_content.as_deref(), Some("hmm"));
    assert_eq!(resp.text.as_deref(), Some("<think>hmm</think>Hi!"));
    assert_eq!(resp.token_ids.len(), 4);
    assert_eq!(resp.logprobs.len(), 4);
    assert_eq!(resp.logprobs[0].top.len(), 8);
    assert_eq!(r0.timing.token_offsets_us.len(), 4);
    assert!(r0.prompt_token_ids.as_ref().unwrap().len() > 5);
    assert_eq!(r0.build.as_ref().unwrap().backend, "scripted");
    assert_eq!(r0.status, Some(200));

    // Human-readable renderings for the CLI.
    let table = sessions::render_list(&sessions::list(&store).await.unwrap());
    assert_eq!(table.lines().count(), 3, "{table}");
    eprintln!("{table}");
    let shown = sessions::render_session(&sessions::show(&store, &s.session.id).await.unwrap());
    assert!(
        shown.contains("#0") && shown.contains("#1") && shown.contains("Bye."),
        "{shown}"
    );
    eprintln!("{shown}");

    // Import into a fresh database, export again: the same bytes.
    let (_d2, store2) = temp_store().await;
    let report = sessions::import(&store2, text.as_bytes()).await.unwrap();
    assert_eq!(
        (report.sessions, report.requests, report.skipped),
        (2, 3, 0)
    );
    assert_eq!(export_string(&store2).await, text);
    // Importing again skips everything.
    let again = sessions::import(&store2, text.as_bytes()).await.unwrap();
    assert_eq!((again.requests, again.skipped), (0, 3));
    assert_eq!(sessions::list(&store2).await.unwrap().len(), 2);
}

#[tokio::test]
async fn a_minimal_generated_line_imports_and_keeps_stitching() {
    let line = json!({
        "format": FORMAT,
        "session": {"id": "synth-0001", "source": "synth"},
        "requests": [
            {
                "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "list files"}],
                "tools": [{"type": "function", "function": {"name": "ls", "parameters": {}}}],
                "params": {"temperature": 0},
                "probe": {"must_contain": ["a.txt"], "needle_position": 17, "label": "needle@17:user"},
                "response": {"content": "", "tool_calls": [{"id": "call_a", "type": "function",
                             "function": {"name": "ls", "arguments": "{}"}}], "finish_reason": "tool_calls"}
            }
        ]
    });
    let (_d, store) = temp_store().await;
    let report = sessions::import(&store, format!("\n{line}\n").as_bytes())
        .await
        .unwrap();
    assert_eq!(report.requests, 1);
    let shown = sessions::show(&store, "synth-0001").await.unwrap();
    assert_eq!(shown.session.source, SessionSource::Synth);
    let r = &shown.requests[0];
    assert_eq!(r.kind, Some(RequestKind::Agent), "classified on import");
    assert_eq!(r.stitch, Some(StitchMethod::Import));
    assert!(r.id.is_some());
    // The probe survives the database: replays from the DB keep it.
    let probe = r.probe.as_ref().expect("probe kept");
    assert_eq!(probe.must_contain, ["a.txt"]);
    assert_eq!(probe.needle_position, Some(17));

    // A server started on this database continues the imported session.
    let backend = Arc::new(Scripted::new(4096));
    let state = AppState::new(backend, store.clone(), AppOptions::default())
        .await
        .unwrap();
    chat(
        &state,
        json!({"messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_zz", "type": "function",
         "function": {"name": "ls", "arguments": "{ }"}}]},
        {"role": "tool", "tool_call_id": "call_zz", "content": "a.txt"},
    ], "tools": [{"type": "function", "function": {"name": "ls", "parameters": {}}}]}),
    )
    .await;
    state.writer().flush().await.unwrap();
    let reqs = store.session_requests("synth-0001").await.unwrap();
    assert_eq!(reqs.len(), 2);
    assert_eq!(
        reqs[1].session.as_ref().unwrap().stitch,
        StitchMethod::Prefix
    );
    assert_eq!(reqs[1].session.as_ref().unwrap().turn, 1);
}

#[tokio::test]
async fn bad_lines_are_errors_with_line_numbers() {
    let (_d, store) = temp_store().await;
    let good = json!({"format": FORMAT, "session": {"id": "a"}, "requests": []}).to_string();
    let wrong = json!({"format": "tapedeck.session.v9", "session": {"id": "b"}, "requests": []})
        .to_string();
    match sessions::import(&store, format!("{good}\n{wrong}\n").as_bytes()).await {
        Err(Error::Import { line: 2, message }) => assert!(message.contains("v9"), "{message}"),
        other => panic!("{other:?}"),
    }
    match sessions::import(&store, "{\"format\": 3".as_bytes()).await {
        Err(Error::Import { line: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
    match sessions::show(&store, "nope").await {
        Err(Error::NotFound {
            what: "session", ..
        }) => {}
        other => panic!("{other:?}"),
    }
}
