//! End to end with the real fixture engine: tiny-qwen2 itself makes the "recording" (prompt IDs,
//! output IDs, logits summaries, as the recorder stores them), then the replayer plays it back
//! against engine targets. Protects the central promise: a rerun of the reference is bit-exact and
//! unflagged, a precision toggle shows up as teacher-forced drift, and a truncating context window
//! shows up as prompt divergence.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use serde_json::json;
use tapedeck_engine::chat::EncodeOptions;
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::messages::MessageContent;
use tapedeck_engine::scheduler::SchedulerConfig;
use tapedeck_engine::{
    ChatMessage, Engine, GenerateRequest, SamplingParams, StopCriteria, Toggles,
};
use tapedeck_replayer::session::{ChatRequest, Recorded, TurnKind};
use tapedeck_replayer::{
    replay, EngineTarget, HistoryMode, Pacing, ReplayConfig, RunSummary, Session, Turn,
};
use tokio::sync::watch;

const MAX_TOKENS: u32 = 6;

fn engine() -> Arc<Engine> {
    static E: OnceLock<Arc<Engine>> = OnceLock::new();
    E.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/tiny-qwen2");
        Arc::new(
            Engine::load_with(
                &dir,
                &EngineOptions {
                    threads: Some(2),
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    })
    .clone()
}

fn tools() -> Vec<serde_json::Value> {
    vec![json!({"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}})]
}

/// Records one turn the way the recorder would: encode, generate greedily, keep everything.
fn record_turn(
    e: &Engine,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
) -> (Turn, ChatMessage) {
    let enc = e
        .encode_chat(
            messages,
            tools,
            &EncodeOptions {
                add_generation_prompt: true,
                toggles: Toggles::default(),
            },
        )
        .unwrap();
    let req = GenerateRequest {
        prompt: enc.ids.clone(),
        sampling: SamplingParams::default(),
        stop: StopCriteria {
            max_tokens: MAX_TOKENS as usize,
            ..StopCriteria::default()
        },
        top_k_summary: 8,
        toggles: Toggles::default(),
    };
    let out = e.generate(&req, &mut |_| true).unwrap();
    let parsed = e.template().parse_output(&out.text);
    let answer = ChatMessage {
        role: "assistant".into(),
        content: Some(MessageContent::Text(parsed.content)),
        reasoning_content: parsed.reasoning_content,
        tool_calls: (!parsed.tool_calls.is_empty()).then_some(parsed.tool_calls),
        tool_call_id: None,
        name: None,
    };
    let turn = Turn {
        kind: if tools.is_some() {
            TurnKind::Agent
        } else {
            TurnKind::Other
        },
        request: ChatRequest {
            messages: messages.to_vec(),
            tools: tools.map(<[_]>::to_vec),
            temperature: Some(0.0),
            max_tokens: Some(MAX_TOKENS),
            ..ChatRequest::default()
        },
        recorded: Some(Recorded {
            prompt_ids: Some(enc.ids),
            output_ids: Some(out.tokens),
            output_text: out.text,
            message: Some(answer.clone()),
            summaries: out.summaries,
            finish_reason: Some(out.finish_reason.as_str().into()),
            ..Recorded::default()
        }),
        probe: None,
        arrival_us: None,
    };
    (turn, answer)
}

/// A multi-turn chat whose history holds the model's own answers (self mode reproduces it).
fn chat_session(id: &str, user_turns: &[&str], with_tools: bool) -> Session {
    let e = engine();
    let tools = with_tools.then(tools);
    let mut messages = vec![ChatMessage::new(
        "system",
        "You are a careful coding agent.",
    )];
    let mut turns = Vec::new();
    for u in user_turns {
        messages.push(ChatMessage::new("user", u));
        let (turn, answer) = record_turn(&e, &messages, tools.as_deref());
        turns.push(turn);
        messages.push(answer);
    }
    Session::new(id, turns)
}

/// An agent session whose history has a tool call and its result (the client's side of a loop).
fn tool_session() -> Session {
    let e = engine();
    let tools = tools();
    let mut messages = vec![
        ChatMessage::new("system", "You are a careful coding agent."),
        ChatMessage::new("user", "What is in README.md? Read it, then summarize."),
    ];
    let (t0, mut answer) = record_turn(&e, &messages, Some(&tools));
    answer.tool_calls = Some(vec![tapedeck_engine::ToolCall {
        id: "call_0".into(),
        kind: "function".into(),
        function: tapedeck_engine::messages::FunctionCall {
            name: "read_file".into(),
            arguments: "{\"path\": \"README.md\"}".into(),
        },
    }]);
    messages.push(answer);
    let mut tool = ChatMessage::new("tool", "# tapedeck\nRecord, replay and compare sessions.");
    tool.tool_call_id = Some("call_0".into());
    messages.push(tool);
    let (t1, answer) = record_turn(&e, &messages, Some(&tools));
    messages.push(answer);
    messages.push(ChatMessage::new("user", "Thanks. Now list three risks."));
    let (t2, _) = record_turn(&e, &messages, Some(&tools));
    Session::new("tools", vec![t0, t1, t2])
}

fn sessions() -> Vec<Session> {
    static S: OnceLock<Vec<Session>> = OnceLock::new();
    S.get_or_init(|| {
        vec![
            tool_session(),
            chat_session(
                "chat-a",
                &["Explain RoPE in one line.", "Shorter.", "And YaRN?"],
                true,
            ),
            chat_session(
                "chat-b",
                &["Hello there.", "Tell me a joke about caches."],
                false,
            ),
        ]
    })
    .clone()
}

fn target(toggles: &str) -> Arc<EngineTarget> {
    let t: Toggles = toggles.parse().unwrap();
    Arc::new(
        EngineTarget::new(
            engine(),
            t,
            SchedulerConfig::default(),
            &format!("engine:tiny-qwen2?{toggles}"),
        )
        .unwrap(),
    )
}

async fn run(toggles: &str, sessions: Vec<Session>, history: HistoryMode) -> RunSummary {
    let (_tx, rx) = watch::channel(false);
    let cfg = ReplayConfig {
        pacing: Pacing::Closed { concurrency: 2 },
        history,
        ..ReplayConfig::default()
    };
    replay(sessions, target(toggles), &cfg, rx).await.unwrap()
}

fn all_turns(s: &RunSummary) -> usize {
    s.sessions.iter().map(|x| x.turns.len()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_rerun_is_exact_and_unflagged() {
    let ss = sessions();
    let n: usize = ss.iter().map(|s| s.turns.len()).sum();
    for _ in 0..2 {
        let s = run("", ss.clone(), HistoryMode::Recorded).await;
        assert_eq!(all_turns(&s), n);
        assert_eq!(s.speed.failed, 0, "{:?}", s.speed.errors);
        let f = &s.fidelity;
        assert!(!s.flagged, "flags: {:?}", f.flags);
        assert_eq!(f.compared_turns, n);
        assert_eq!(f.exact_match_turns, n);
        assert_eq!(f.prompt_divergent_turns, 0);
        assert_eq!(f.scored_turns, n);
        assert_eq!(f.drift.positions, n * MAX_TOKENS as usize - eos_short(&ss));
        assert_eq!(
            f.drift.abs_dlogprob.max, 0.0,
            "decode-mode scoring reproduces generation"
        );
        assert_eq!(f.drift.top1_agreement, 1.0);
        assert_eq!(f.drift.kl.max, 0.0);
        assert!(s.sessions.iter().all(|x| x.first_divergent_turn.is_none()));
        assert!(s.speed.ttft.count as usize == n && s.speed.e2e.count as usize == n);
    }
}

/// Output positions lost to early EOS (so the position count above is exact).
fn eos_short(ss: &[Session]) -> usize {
    ss.iter()
        .flat_map(|s| &s.turns)
        .map(|t| {
            MAX_TOKENS as usize
                - t.recorded
                    .as_ref()
                    .and_then(|r| r.output_ids.as_ref())
                    .map_or(0, Vec::len)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_matmul_drift_is_flagged() {
    let s = run("matmul=bf16", sessions(), HistoryMode::Recorded).await;
    let f = &s.fidelity;
    assert!(s.flagged);
    assert!(f.drift.abs_dlogprob.max > 1e-4, "{:?}", f.drift);
    assert!(
        f.flags.get("drift").copied().unwrap_or(0) > 0,
        "{:?}",
        f.flags
    );
    assert_eq!(
        f.prompt_divergent_turns, 0,
        "precision does not change the encoding"
    );
    assert_eq!(f.drift_by_bucket.len(), 1);
    assert_eq!(f.drift_by_bucket[0].bucket, "0-1k");
    eprintln!(
        "bf16 drift: mean |dlogprob| {:.3e}, max {:.3e}, top1 {:.3}, KL mean {:.3e}",
        f.drift.abs_dlogprob.mean,
        f.drift.abs_dlogprob.max,
        f.drift.top1_agreement,
        f.drift.kl.mean
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_context_window_is_flagged_as_prompt_divergence() {
    let ss = sessions();
    // Larger than every first turn, smaller than every last turn: later turns lose history.
    let first_max = ss
        .iter()
        .map(|s| {
            s.turns[0]
                .recorded
                .as_ref()
                .unwrap()
                .prompt_ids
                .as_ref()
                .unwrap()
                .len()
        })
        .max()
        .unwrap();
    let limit = first_max + 2;
    let s = run(
        &format!("fault.context_window={limit}"),
        ss,
        HistoryMode::Recorded,
    )
    .await;
    let f = &s.fidelity;
    assert!(s.flagged);
    assert!(f.prompt_divergent_turns > 0, "{f:?}");
    assert_eq!(
        f.flags.get("prompt_divergence").copied(),
        Some(f.prompt_divergent_turns)
    );
    let mut over = 0;
    for sess in &s.sessions {
        assert!(
            !sess.turns[0].prompt.as_ref().unwrap().diverged,
            "first turns fit"
        );
        let longest = sess
            .turns
            .iter()
            .filter_map(|t| t.prompt.as_ref()?.recorded_tokens)
            .max()
            .unwrap();
        if longest <= limit {
            assert!(
                sess.first_divergent_turn.is_none(),
                "{}: nothing to drop",
                sess.id
            );
            continue;
        }
        over += 1;
        let first = sess
            .first_divergent_turn
            .expect("a turn over the limit diverges");
        assert!(first >= 1);
        let p = sess.turns[first].prompt.as_ref().unwrap();
        assert!(p.candidate_tokens < p.recorded_tokens, "{p:?}");
        assert!(p.first_divergence.is_some());
    }
    assert!(over >= 2, "the fixture sessions must exceed the limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_history_with_the_reference_reproduces_the_recording() {
    let ss: Vec<Session> = sessions().into_iter().filter(|s| s.id != "tools").collect();
    let s = run("", ss, HistoryMode::SelfFed).await;
    assert!(!s.flagged, "{:?}", s.fidelity.flags);
    assert_eq!(s.fidelity.exact_match_turns, s.fidelity.compared_turns);
}
