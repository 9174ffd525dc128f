//! What the generated sessions promise: same seed → same bytes; needles at the requested token
//! positions under the real chat encoding; every request is OpenAI chat JSON the fixture model's
//! template renders (what `tapedeck serve` accepts); agent turns extend each other; the recorder
//! classifies title, agent and compaction requests as generated; the shipped fixtures are exactly
//! what the generator makes now.

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::Value;
use tapedeck_engine::messages::MessageContent;
use tapedeck_engine::ChatMessage;
use tapedeck_recorder::record::RequestKind;
use tapedeck_recorder::sessions::{RequestLine, SessionLine};
use tapedeck_recorder::stitch::classify;
use tapedeck_synth::{
    fixtures, generate_with, to_jsonl, Counter, Error, Placement, SynthConfig, ToolDetail,
};

fn root() -> PathBuf {
    fixtures::workspace_root()
}

fn counter() -> &'static Counter {
    static C: OnceLock<Counter> = OnceLock::new();
    C.get_or_init(|| Counter::from_dir(&root().join(fixtures::MODEL)).expect("fixture model"))
}

/// The shipped configurations, generated once per test binary.
fn shipped() -> &'static Vec<(&'static str, SynthConfig, Vec<SessionLine>)> {
    static S: OnceLock<Vec<(&'static str, SynthConfig, Vec<SessionLine>)>> = OnceLock::new();
    S.get_or_init(|| {
        fixtures::shipped(&root())
            .into_iter()
            .map(|(name, cfg)| {
                let s = generate_with(&cfg, counter()).expect("generate");
                (name, cfg, s)
            })
            .collect()
    })
}

fn small(seed: u64) -> SynthConfig {
    let mut c = SynthConfig::new(root().join(fixtures::MODEL));
    c.count = 2;
    c.turns = 3..=5;
    c.contexts = vec![300, 2400];
    c.seed = seed;
    c.system_prompt_chars = 0;
    c.tool_detail = ToolDetail::Minimal;
    c
}

fn messages(r: &RequestLine) -> Vec<ChatMessage> {
    let v = Value::Array(r.messages.clone().expect("chat request has messages"));
    serde_json::from_value(v).expect("messages are OpenAI chat messages")
}

fn answer_message(r: &RequestLine) -> ChatMessage {
    let resp = r.response.as_ref().expect("scripted response");
    ChatMessage {
        role: "assistant".into(),
        content: Some(MessageContent::Text(resp.content.clone())),
        reasoning_content: resp.reasoning_content.clone(),
        tool_calls: (!resp.tool_calls.is_empty()).then(|| resp.tool_calls.clone()),
        tool_call_id: None,
        name: None,
    }
}

fn all_sessions() -> impl Iterator<Item = (&'static SynthConfig, &'static SessionLine)> {
    shipped()
        .iter()
        .flat_map(|(_, cfg, s)| s.iter().map(move |l| (cfg, l)))
}

#[test]
fn same_seed_same_bytes_different_seed_different_bytes() {
    let a = to_jsonl(&generate_with(&small(11), counter()).unwrap()).unwrap();
    let b = to_jsonl(&generate_with(&small(11), counter()).unwrap()).unwrap();
    let c = to_jsonl(&generate_with(&small(12), counter()).unwrap()).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn needles_land_exactly_at_the_requested_aligned_depth() {
    for (cfg, s) in all_sessions() {
        let probes: Vec<&RequestLine> = s.requests.iter().filter(|r| r.probe.is_some()).collect();
        assert_eq!(probes.len(), 1, "one probe per session");
        let r = probes[0];
        let probe = r.probe.as_ref().unwrap();
        let msgs = messages(r);
        let secret = &probe.must_contain[0];
        // The probe's answer is scripted to contain the secret; the prompt holds it exactly once.
        assert!(r
            .response
            .as_ref()
            .unwrap()
            .content
            .contains(secret.as_str()));
        let rendered = counter()
            .template()
            .render(&msgs, r.tools.as_deref(), &opts())
            .unwrap()
            .0;
        assert_eq!(
            rendered.matches(secret.as_str()).count(),
            1,
            "{}",
            s.session.id
        );
        // Re-measure independently: the token at the position holds the fact's first byte (it may
        // carry the space before it, as byte-level BPE attaches spaces to the next word).
        let ids = counter().encode(&msgs, r.tools.as_deref()).unwrap();
        let pos = probe.needle_position.unwrap();
        let after = counter().tokenizer().decode(&ids[pos..]).unwrap();
        assert!(
            after.trim_start().starts_with("The "),
            "{}: {:?}",
            s.session.id,
            &after[..40]
        );
        let before = counter().tokenizer().decode(&ids[..pos]).unwrap();
        assert!(!before.contains(secret.as_str()));
        // Exact placement on the aligned depth (multiples of `align`: chunk / block boundaries).
        let label = probe.label.as_deref().unwrap();
        let depth: usize = label[7..label.find(':').unwrap()].parse().unwrap();
        assert_eq!(pos, depth, "{label}");
        if let Some(a) = cfg.align {
            assert_eq!(pos % a, 0, "{label}");
        }
    }
}

fn opts() -> tapedeck_engine::chat::EncodeOptions {
    tapedeck_engine::chat::EncodeOptions {
        add_generation_prompt: true,
        toggles: Default::default(),
    }
}

#[test]
fn turn_placement_lands_within_one_turn_below_the_depth() {
    let mut cfg = small(5);
    cfg.placement = Placement::Turn;
    cfg.contexts = vec![2900];
    cfg.count = 1;
    let s = &generate_with(&cfg, counter()).unwrap()[0];
    let probe_req = s.requests.iter().find(|r| r.probe.is_some()).unwrap();
    let pos = probe_req.probe.as_ref().unwrap().needle_position.unwrap();
    // The largest growth of the prompt from one agent request to the next is one turn.
    let counts: Vec<usize> = s
        .requests
        .iter()
        .filter(|r| r.kind == Some(RequestKind::Agent))
        .map(|r| counter().count(&messages(r), r.tools.as_deref()).unwrap())
        .collect();
    let max_turn = counts
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]))
        .max()
        .unwrap();
    assert!(
        pos <= 2900 && 2900 - pos <= max_turn,
        "pos {pos}, max turn {max_turn}"
    );
}

#[test]
fn every_request_is_openai_chat_json_the_fixture_template_renders() {
    for (cfg, s) in all_sessions() {
        assert_eq!(s.format, tapedeck_recorder::sessions::FORMAT);
        for r in &s.requests {
            let msgs = messages(r);
            let n = counter().count(&msgs, r.tools.as_deref()).unwrap();
            assert!(
                n <= cfg.max_prompt_tokens,
                "{} turn {:?}: {n}",
                s.session.id,
                r.turn
            );
            assert_eq!(r.params["stream"], Value::Bool(true));
            assert_eq!(
                r.params["stream_options"]["include_usage"],
                Value::Bool(true)
            );
            assert_eq!(r.params["temperature"], serde_json::json!(0));
            assert_eq!(
                r.headers["x-session-id"],
                Value::String(s.session.id.clone())
            );
            if let Some(tools) = &r.tools {
                assert_eq!(tools.len(), 10);
                assert_eq!(r.params["tool_choice"], "auto");
                for t in tools {
                    assert_eq!(
                        t["function"]["parameters"]["$schema"],
                        "http://json-schema.org/draft-07/schema#"
                    );
                }
            }
            // Every tool result answers a call made earlier; every call's arguments are a
            // compact JSON object.
            let mut calls = Vec::new();
            for m in &msgs {
                for c in m.tool_calls.iter().flatten() {
                    assert!(c.id.starts_with("call_"));
                    let args: Value = serde_json::from_str(&c.function.arguments).unwrap();
                    assert!(args.is_object());
                    assert_eq!(args.to_string(), c.function.arguments);
                    assert_eq!(m.text(), "");
                    calls.push(c.id.clone());
                }
                if m.role == "tool" {
                    assert!(calls.contains(m.tool_call_id.as_ref().unwrap()));
                }
            }
        }
    }
}

#[test]
fn agent_turns_extend_the_previous_turn_plus_its_answer() {
    for (_, s) in all_sessions() {
        let mut prev: Option<(Vec<ChatMessage>, ChatMessage)> = None;
        let mut compaction_answer: Option<String> = None;
        for r in &s.requests {
            match r.kind {
                Some(RequestKind::Agent) => {
                    let msgs = messages(r);
                    if let Some(summary) = compaction_answer.take() {
                        // History rewritten: the summary is carried, the old turns are not.
                        assert!(msgs.iter().any(|m| m.text() == summary));
                    } else if let Some((p, a)) = &prev {
                        assert!(msgs.len() > p.len() + 1, "{}", s.session.id);
                        assert_eq!(&msgs[..p.len()], &p[..], "{}", s.session.id);
                        assert_eq!(&msgs[p.len()], a, "{}", s.session.id);
                    }
                    prev = Some((msgs, answer_message(r)));
                }
                Some(RequestKind::Compaction) => {
                    compaction_answer = Some(r.response.as_ref().unwrap().content.clone());
                }
                _ => {}
            }
        }
    }
}

#[test]
fn the_recorder_classifies_title_agent_and_compaction_as_generated() {
    let mut kinds = Vec::new();
    for (_, s) in all_sessions() {
        assert_eq!(s.requests[0].kind, Some(RequestKind::Title));
        for r in &s.requests {
            let tools = r.tools.as_ref().is_some_and(|t| !t.is_empty());
            assert_eq!(
                Some(classify(&messages(r), tools)),
                r.kind,
                "turn {:?}",
                r.turn
            );
            kinds.push(r.kind);
        }
    }
    assert!(kinds.contains(&Some(RequestKind::Compaction)));
}

#[test]
fn shipped_fixtures_equal_a_fresh_generation() {
    let mut total = 0;
    for (name, _, sessions) in shipped() {
        let path = root().join(fixtures::DIR).join(name);
        let on_disk = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        total += on_disk.len();
        assert!(
            on_disk == to_jsonl(sessions).unwrap(),
            "{} differs from a fresh generation: run `cargo run -p tapedeck-synth --example make_sessions`",
            path.display()
        );
    }
    assert!(total <= 2 << 20, "fixtures take {total} bytes");
}

#[test]
fn depths_past_the_budget_and_missing_models_are_errors() {
    let mut cfg = small(1);
    cfg.contexts = vec![7000];
    assert!(matches!(
        generate_with(&cfg, counter()),
        Err(Error::Depth { depth: 7000, .. })
    ));
    let cfg = SynthConfig::new("/nonexistent/model");
    assert!(matches!(
        tapedeck_synth::generate(&cfg),
        Err(Error::Model { .. })
    ));
}
