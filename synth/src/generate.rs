//! Building one session: the title side request, filler tasks, the needle, an optional
//! compaction, the probe; then the request lines exactly as a client would have sent them.
//!
//! # Shape
//!
//! ```text
//! title (side request: first user message, title system prompt, no tools)
//! [first task, compaction request, history rewritten]   -- with SynthConfig::compaction
//! filler tasks ............ bring the needle to depth L
//! needle turn(s) .......... the fact, in a user message, a tool result or reasoning
//! filler tasks ............ push it back (as many as the turn range and token budget allow)
//! probe ................... a user asks for the fact; the request line carries a Probe
//! ```
//!
//! A *task* is what an agent does for one user message: the user asks, the assistant calls tools
//! (one request per step, each carrying the whole history), then answers. Every agent request's
//! messages are the previous agent request's messages plus its answer plus the new input (tool
//! results or a user message), the prefix property the recorder stitches on, except across a
//! compaction, where the history is rewritten to the system prompt, the summary and what follows.
//!
//! # Needle placement
//!
//! The needle position is the index of the token that holds the first byte of the fact sentence
//! in the probe request's prompt, rendered by the target model's template and tokenized by its
//! tokenizer (see [`crate::measure::Counter::position`]). The message that carries the needle
//! starts with a lead-in sentence; with [`Placement::Exact`] the lead-in is extended by words that
//! the tokenizer encodes as one token each (` word`, checked against the vocabulary), so every
//! added word moves the needle by exactly one token and the gap left by whole filler turns closes
//! exactly. Depths shallower than the system prompt plus tool block put the needle in the
//! system prompt's `AGENTS.md` block, placed between guideline sections the same way.

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};
use tapedeck_engine::messages::{FunctionCall, MessageContent};
use tapedeck_engine::{ChatMessage, ToolCall};
use tapedeck_recorder::record::{Endpoint, RequestKind, SessionSource, StitchMethod};
use tapedeck_recorder::sessions::{
    Probe, RequestLine, ResponseLine, SessionInfo, SessionLine, Timing, FORMAT,
};
use uuid::Uuid;

use crate::config::{NeedleSite, Placement, SynthConfig};
use crate::error::{Error, Result};
use crate::measure::Counter;
use crate::opencode;
use crate::text::{Project, TextGen};

/// 2026-01-01T00:00:00Z in µs: synthetic sessions are dated after it, never by the clock.
const EPOCH_US: i64 = 1_767_225_600_000_000;

/// Candidate padding words; only those the target tokenizer encodes as one token are used.
const PAD_WORDS: &[&str] = &[
    "the", "and", "to", "of", "in", "is", "it", "that", "we", "for", "on", "with", "as", "was",
    "this", "but", "be", "not", "are", "at", "by", "or", "from", "when", "so", "if", "all", "new",
    "one", "can", "will", "test", "file", "code", "run", "build", "data", "time", "error", "value",
    "name", "type", "line", "list", "set", "key", "step", "then", "also", "there", "after",
    "before", "use", "used", "only", "each", "more", "some", "other", "into", "which", "have",
    "has", "had", "were", "should", "would", "could", "about", "still", "just", "path", "user",
    "result", "check", "output", "input", "read", "write", "call", "return", "state", "config",
];

const FACT_SUBJECTS: &[(&str, &str)] = &[
    ("deploy key", "deploy key"),
    ("staging database password", "staging database password"),
    ("on-call escalation code", "on-call escalation code"),
    ("release signing passphrase", "release signing passphrase"),
    ("feature flag salt", "feature flag salt"),
    ("backup bucket token", "backup bucket token"),
];

const ANIMALS: &[&str] = &[
    "ZEBRA", "OTTER", "FALCON", "LYNX", "BISON", "HERON", "MARTEN", "IBEX", "CONDOR", "GECKO",
];

const LEAD_IN: &str = "One more thing from the ops channel";

/// The planted fact of a session.
#[derive(Debug, Clone)]
struct Fact {
    /// `The deploy key for project aurora is K7-ZEBRA-4412.`
    sentence: String,
    /// `K7-ZEBRA-4412`: what the probe's answer must contain.
    secret: String,
    subject: String,
}

/// One agent request: what the client adds to the history, and the scripted answer.
#[derive(Debug, Clone)]
struct Exchange {
    input: Vec<ChatMessage>,
    answer: ChatMessage,
}

/// A request in emission order.
enum Planned {
    Agent {
        messages: Vec<ChatMessage>,
        answer: ChatMessage,
        probe: Option<Probe>,
    },
    Compaction {
        messages: Vec<ChatMessage>,
        answer: String,
    },
}

struct Builder<'a> {
    cfg: &'a SynthConfig,
    counter: &'a Counter,
    index: usize,
    tg: TextGen,
    project: Project,
    tree: String,
    date: String,
    tools: Vec<Value>,
    pad_words: Vec<String>,
    agents_notes: String,
    /// History before `exchanges` (system prompt, and after a compaction the rewritten head).
    head: Vec<ChatMessage>,
    exchanges: Vec<Exchange>,
    /// Requests already final (segments before a compaction).
    planned: Vec<Planned>,
    first_user: Option<String>,
}

fn assistant(content: &str, reasoning: &str, calls: Vec<ToolCall>) -> ChatMessage {
    ChatMessage {
        role: "assistant".into(),
        content: Some(MessageContent::Text(content.to_string())),
        reasoning_content: Some(reasoning.to_string()),
        tool_calls: (!calls.is_empty()).then_some(calls),
        tool_call_id: None,
        name: None,
    }
}

fn tool_result(call: &ToolCall, content: String) -> ChatMessage {
    ChatMessage {
        role: "tool".into(),
        content: Some(MessageContent::Text(content)),
        reasoning_content: None,
        tool_calls: None,
        tool_call_id: Some(call.id.clone()),
        name: None,
    }
}

fn alnum(rng: &mut ChaCha8Rng, n: usize) -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    (0..n)
        .map(|_| A[rng.random_range(0..A.len())] as char)
        .collect()
}

fn uuid(rng: &mut ChaCha8Rng) -> Uuid {
    uuid::Builder::from_random_bytes(rng.random()).into_uuid()
}

impl<'a> Builder<'a> {
    fn enc_err(&self, what: &str) -> impl Fn(String) -> Error + '_ {
        let session = self.index;
        let request = what.to_string();
        move |message| Error::Encode {
            session,
            request: request.clone(),
            message,
        }
    }

    fn call(&mut self, name: &str, args: Value) -> ToolCall {
        ToolCall {
            id: format!("call_{}", alnum(&mut self.tg.rng, 24)),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: args.to_string(),
            },
        }
    }

    fn history(&self) -> Vec<ChatMessage> {
        let mut h = self.head.clone();
        for e in &self.exchanges {
            h.extend(e.input.iter().cloned());
            h.push(e.answer.clone());
        }
        h
    }

    fn abs(&self, rel: &str) -> String {
        format!("{}/{rel}", self.project.root)
    }

    fn system_prompt(&self, agents_after: usize, agents_body: &str) -> String {
        opencode::system_prompt(
            &self.project,
            &self.tree,
            &self.date,
            self.cfg.system_prompt_chars,
            Some((agents_after, agents_body)),
        )
    }

    fn pad(&self, n: usize) -> String {
        let mut s = String::from(LEAD_IN);
        for w in self.pad_words.iter().cycle().take(n) {
            s.push(' ');
            s.push_str(w);
        }
        s.push_str(".\n\n");
        s
    }

    fn reasoning(&mut self) -> String {
        let n = self.tg.rng.random_range(1..3);
        self.tg.paragraph(n)
    }

    /// A filler task of roughly `target` tokens: one user message, one to three tool steps, a
    /// final answer.
    fn task(&mut self, target: usize) -> Vec<Exchange> {
        let p = self.project.clone();
        let file = self.tg.source_file(&p);
        // ~10 tokens per numbered code line under small vocabularies; the loop re-measures.
        let lines = (target / 10).clamp(6, 160);
        let mut out = Vec::new();
        let kind = self.tg.rng.random_range(0..6);
        let (user, first_calls, first_results): (String, Vec<ToolCall>, Vec<String>) = match kind {
            0 => {
                let u = format!(
                    "Can you explain what `{}` in {file} does? {}",
                    self.tg.ident(),
                    self.tg.sentence()
                );
                let c = self.call("read", json!({"filePath": self.abs(&file)}));
                let body = self.tg.code(p.lang, lines);
                (u, vec![c], vec![TextGen::numbered_file(&body, 1)])
            }
            1 => {
                let cmd = match p.lang {
                    crate::text::Lang::Rust => "cargo test",
                    crate::text::Lang::Python => "python -m pytest -q",
                    crate::text::Lang::TypeScript => "npm test",
                };
                let u = format!(
                    "Run the tests and fix whatever fails. {}",
                    self.tg.sentence()
                );
                let c = self.call(
                    "bash",
                    json!({"command": cmd, "description": "Runs the test suite"}),
                );
                let out = self.tg.test_output(&p, true);
                (u, vec![c], vec![out])
            }
            2 => {
                let pat = self.tg.ident();
                let u = format!("Where do we call `{pat}`? I want to rename it.");
                let c = self.call("grep", json!({"pattern": pat, "include": "*.*"}));
                let out = self.tg.grep_output(&p, &pat);
                (u, vec![c], vec![out])
            }
            3 => {
                let u = format!(
                    "Give me an overview of the repository layout. {}",
                    self.tg.sentence()
                );
                let c = self.call("list", json!({"path": p.root}));
                let c2 = self.call(
                    "bash",
                    json!({"command": "git status && git log --oneline -5", "description": "Shows status and recent commits"}),
                );
                let r2 = self.tg.git_output(&p);
                (u, vec![c, c2], vec![TextGen::listing(&p), r2])
            }
            4 => {
                let u = format!(
                    "Plan the work for adding a `--{}` flag, then check the manifest.",
                    self.tg.noun()
                );
                let todos: Vec<Value> = (0..self.tg.rng.random_range(2..5))
                    .map(|i| {
                        json!({"content": self.tg.sentence(), "status": if i == 0 {"in_progress"} else {"pending"}, "priority": "medium", "id": format!("{}", i + 1)})
                    })
                    .collect();
                let c = self.call("todowrite", json!({"todos": todos}));
                let out = serde_json::to_string_pretty(&todos).unwrap_or_default();
                (u, vec![c], vec![out])
            }
            _ => {
                let u = format!(
                    "Quick question: how should `{}` handle an empty input? {}",
                    self.tg.ident(),
                    self.tg.sentence()
                );
                (u, Vec::new(), Vec::new())
            }
        };
        let reasoning = self.reasoning();
        let user_msg = ChatMessage::new("user", &user);
        if first_calls.is_empty() {
            let code = self.tg.code(p.lang, lines.min(30)).join("\n");
            let answer = format!(
                "{}\n\n```\n{code}\n```\n\n{}",
                self.tg.sentence(),
                self.tg.sentence()
            );
            out.push(Exchange {
                input: vec![user_msg],
                answer: assistant(&answer, &reasoning, Vec::new()),
            });
            return out;
        }
        out.push(Exchange {
            input: vec![user_msg],
            answer: assistant("", &reasoning, first_calls.clone()),
        });
        let mut results: Vec<ChatMessage> = first_calls
            .iter()
            .zip(first_results)
            .map(|(c, r)| tool_result(c, r))
            .collect();
        // Optional second step: an edit of the file, or a read of a second file.
        if self.tg.rng.random_bool(0.5) {
            let reasoning = self.reasoning();
            let (call, result) = if self.tg.rng.random_bool(0.5) {
                let old = self.tg.ident();
                let new = self.tg.ident();
                let c = self.call(
                    "edit",
                    json!({"filePath": self.abs(&file), "oldString": old, "newString": new}),
                );
                (c, String::new())
            } else {
                let other = self.tg.source_file(&p);
                let c = self.call("read", json!({"filePath": self.abs(&other)}));
                let body = self.tg.code(p.lang, (lines / 2).max(6));
                (c, TextGen::numbered_file(&body, 1))
            };
            out.push(Exchange {
                input: std::mem::take(&mut results),
                answer: assistant("", &reasoning, vec![call.clone()]),
            });
            results = vec![tool_result(&call, result)];
        }
        let reasoning = self.reasoning();
        let answer = format!(
            "{} See `{file}:{}`.\n\n{}",
            self.tg.sentence(),
            self.tg.rng.random_range(3..200),
            self.tg.sentence()
        );
        out.push(Exchange {
            input: results,
            answer: assistant(&answer, &reasoning, Vec::new()),
        });
        out
    }

    fn push_task(&mut self, target: usize) -> usize {
        let t = self.task(target);
        let n = t.len();
        if self.first_user.is_none() {
            self.first_user = t
                .first()
                .and_then(|e| e.input.first())
                .map(ChatMessage::text);
        }
        self.exchanges.extend(t);
        n
    }

    /// The needle turn(s) for a site, the fact preceded by `pad` words.
    fn needle_exchanges(&mut self, site: NeedleSite, fact: &Fact, pad: usize) -> Vec<Exchange> {
        // Re-derive every random choice from a fixed stream so that trying several pad lengths
        // yields the same surrounding text.
        let mut rng = ChaCha8Rng::seed_from_u64(self.cfg.seed);
        rng.set_stream(((self.index as u64) << 8) | 0x4e);
        let saved = std::mem::replace(&mut self.tg.rng, rng);
        let lead = self.pad(pad);
        let out = match site {
            NeedleSite::System => Vec::new(),
            NeedleSite::User => {
                let u = format!(
                    "{lead}{}\n\nKeep that in mind for later. For now, {}",
                    fact.sentence,
                    self.tg.sentence().to_lowercase()
                );
                let r = self.reasoning();
                vec![Exchange {
                    input: vec![ChatMessage::new("user", &u)],
                    answer: assistant(&format!("Noted. {}", self.tg.sentence()), &r, Vec::new()),
                }]
            }
            NeedleSite::Tool => {
                let u = "Read docs/ops-notes.md and tell me if anything there affects the release.";
                let call = self.call("read", json!({"filePath": self.abs("docs/ops-notes.md")}));
                let r1 = self.reasoning();
                let mut lines = vec![
                    "# Ops notes".to_string(),
                    String::new(),
                    self.tg.sentence(),
                    String::new(),
                ];
                lines.push(lead.trim_end().to_string());
                lines.push(String::new());
                lines.push(fact.sentence.clone());
                lines.push(String::new());
                lines.push(self.tg.sentence());
                let r2 = self.reasoning();
                vec![
                    Exchange {
                        input: vec![ChatMessage::new("user", u)],
                        answer: assistant("", &r1, vec![call.clone()]),
                    },
                    Exchange {
                        input: vec![tool_result(&call, TextGen::numbered_file(&lines, 1))],
                        answer: assistant(
                            &format!("Nothing blocking. {}", self.tg.sentence()),
                            &r2,
                            Vec::new(),
                        ),
                    },
                ]
            }
            NeedleSite::Reasoning => {
                let u = format!(
                    "Check the CI settings for the deploy job before we change anything. {}",
                    self.tg.sentence()
                );
                let r = format!(
                    "{lead}{} I should remember that value. {}",
                    fact.sentence,
                    self.tg.sentence()
                );
                vec![Exchange {
                    input: vec![ChatMessage::new("user", &u)],
                    answer: assistant(
                        &format!("The deploy job looks fine. {}", self.tg.sentence()),
                        &r,
                        Vec::new(),
                    ),
                }]
            }
        };
        self.tg.rng = saved;
        out
    }

    /// Position of the fact if the needle turn(s) with `pad` words came next.
    fn needle_position(&mut self, site: NeedleSite, fact: &Fact, pad: usize) -> Result<usize> {
        let mut msgs = self.history();
        for e in self.needle_exchanges(site, fact, pad) {
            msgs.extend(e.input);
            msgs.push(e.answer);
        }
        msgs.push(ChatMessage::new("user", "?"));
        let pos = self
            .counter
            .position(&msgs, Some(&self.tools), &fact.sentence)
            .map_err(self.enc_err("needle placement"))?;
        pos.ok_or_else(|| Error::Encode {
            session: self.index,
            request: "needle placement".into(),
            message: "the rendered prompt does not contain the fact".into(),
        })
    }

    fn depth_error(&self, depth: usize, reason: String) -> Error {
        Error::Depth {
            session: self.index,
            depth,
            budget: self.cfg.max_prompt_tokens,
            reason,
        }
    }

    /// Pad words so that `measure(pad) == target`; `measure` is `base + pad` for single-token
    /// words, re-measured in case a boundary merges.
    fn exact_pad(
        &mut self,
        target: usize,
        mut measure: impl FnMut(&mut Self, usize) -> Result<usize>,
    ) -> Result<usize> {
        let mut pad = 0usize;
        for _ in 0..8 {
            let pos = measure(self, pad)?;
            if pos == target {
                return Ok(pad);
            }
            let next = pad as i64 + target as i64 - pos as i64;
            if next < 0 {
                return Err(self.depth_error(
                    target,
                    format!("the text before the needle already takes {pos} tokens"),
                ));
            }
            pad = next as usize;
        }
        Err(self.depth_error(
            target,
            "padding did not converge (the tokenizer merges across the padding)".into(),
        ))
    }

    fn compaction(&mut self) {
        let mut messages = vec![ChatMessage::new("system", opencode::COMPACTION_SYSTEM)];
        messages.extend(self.history().into_iter().skip(1));
        messages.push(ChatMessage::new("user", opencode::COMPACTION_USER));
        let files: Vec<String> = self.project.files.iter().take(3).cloned().collect();
        let summary = format!(
            "## What we did\n{}\n\n## Files\n{}\n\n## Next steps\n- {}\n- {}",
            self.tg.paragraph(2),
            files
                .iter()
                .map(|f| format!("- {}", self.abs(f)))
                .collect::<Vec<_>>()
                .join("\n"),
            self.tg.sentence(),
            self.tg.sentence()
        );
        for (k, e) in self.exchanges.iter().enumerate() {
            let mut m = self.head.clone();
            for prev in &self.exchanges[..k] {
                m.extend(prev.input.iter().cloned());
                m.push(prev.answer.clone());
            }
            m.extend(e.input.iter().cloned());
            self.planned.push(Planned::Agent {
                messages: m,
                answer: e.answer.clone(),
                probe: None,
            });
        }
        self.planned.push(Planned::Compaction {
            messages,
            answer: summary.clone(),
        });
        let system = self.head[0].clone();
        self.head = vec![
            system,
            ChatMessage::new("user", opencode::COMPACTION_RESUME),
            ChatMessage {
                reasoning_content: None,
                ..assistant(&summary, "", Vec::new())
            },
        ];
        self.exchanges.clear();
    }

    fn agent_requests(&self) -> usize {
        self.planned
            .iter()
            .filter(|p| matches!(p, Planned::Agent { .. }))
            .count()
            + self.exchanges.len()
    }
}

/// Generates session `index` of `cfg`.
pub(crate) fn session(cfg: &SynthConfig, counter: &Counter, index: usize) -> Result<SessionLine> {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    rng.set_stream(index as u64 + 1);
    let mut tg = TextGen::new(rng);
    let project = tg.project();
    let tree = TextGen::listing(&project);
    let created_us = EPOCH_US + tg.rng.random_range(0..180 * 86_400) * 1_000_000;
    let date = opencode::date_string(created_us);
    let pad_words: Vec<String> = {
        let ok: Vec<&str> = PAD_WORDS
            .iter()
            .copied()
            .filter(|w| counter.single_token_word(w))
            .collect();
        if ok.len() < 8 && cfg.placement == Placement::Exact {
            return Err(Error::Config(format!(
                "the tokenizer of {} has too few single-token words for exact placement; use Placement::Turn",
                counter.dir().display()
            )));
        }
        (0..4096)
            .map(|_| ok.choose(&mut tg.rng).copied().unwrap_or("the").to_string())
            .collect()
    };
    let (subject, _) = *FACT_SUBJECTS
        .choose(&mut tg.rng)
        .unwrap_or(&FACT_SUBJECTS[0]);
    let secret = format!(
        "{}{}-{}-{:04}",
        (b'A' + tg.rng.random_range(0..26u8)) as char,
        tg.rng.random_range(1..10),
        ANIMALS.choose(&mut tg.rng).copied().unwrap_or("ZEBRA"),
        tg.rng.random_range(1000..10000)
    );
    let fact = Fact {
        sentence: format!("The {subject} for project {} is {secret}.", project.name),
        secret,
        subject: subject.to_string(),
    };
    let agents_notes = format!(
        "- Build with the project's standard tooling; run the tests before you say a change is done.\n- {}\n- {}",
        tg.sentence(),
        tg.sentence()
    );
    let session_id = format!("ses_{}", alnum(&mut tg.rng, 26));
    let n_turns = tg
        .rng
        .random_range(*cfg.turns.start()..=(*cfg.turns.end()).max(*cfg.turns.start()))
        .max(2);
    let mut b = Builder {
        cfg,
        counter,
        index,
        tg,
        project,
        tree,
        date,
        tools: opencode::tools(cfg.tool_detail),
        pad_words,
        agents_notes,
        head: Vec::new(),
        exchanges: Vec::new(),
        planned: Vec::new(),
        first_user: None,
    };
    let depth = cfg.depth_for(index);
    let after_all = opencode::section_count(&b.project, &b.tree, &b.date, cfg.system_prompt_chars);
    let plain_system = b.system_prompt(after_all + 1, &b.agents_notes.clone());
    b.head = vec![ChatMessage::new("system", &plain_system)];

    // Which site: the system prompt when the depth is shallower than a first user message could
    // be, else a rotation over user / tool / reasoning.
    let rotation = [NeedleSite::User, NeedleSite::Tool, NeedleSite::Reasoning];
    let mut site = rotation[(index + (cfg.seed % 3) as usize) % 3];
    if let Some(d) = depth {
        if d + 64 > cfg.max_prompt_tokens {
            return Err(b.depth_error(d, "deeper than the prompt budget".into()));
        }
        let shallowest = b.needle_position(site, &fact, 0)?;
        if d < shallowest {
            site = NeedleSite::System;
        }
    }

    if site == NeedleSite::System {
        let d = depth.unwrap_or(0);
        let notes = b.agents_notes.clone();
        let body = |b: &Builder, pad: usize| format!("{notes}\n\n{}{}", b.pad(pad), fact.sentence);
        let measure_sys = |b: &mut Builder, after: usize, pad: usize| -> Result<usize> {
            let sys = b.system_prompt(after, &body(b, pad));
            b.head = vec![ChatMessage::new("system", &sys)];
            b.needle_position(NeedleSite::System, &fact, 0)
        };
        // The deepest section boundary at or before the depth.
        let mut after = 0;
        for a in 0..=after_all + 1 {
            if measure_sys(&mut b, a, 0)? <= d {
                after = a;
            }
        }
        let pad = match (depth, cfg.placement) {
            (Some(d), Placement::Exact) => b.exact_pad(d, |b, p| measure_sys(b, after, p))?,
            _ => 0,
        };
        measure_sys(&mut b, after, pad)?;
        if cfg.compaction {
            let t = b.tg.rng.random_range(150..400);
            b.push_task(t);
            b.compaction();
        }
    } else {
        if cfg.compaction {
            let t = b.tg.rng.random_range(150..400);
            b.push_task(t);
            b.compaction();
        }
        let needle_reqs = if site == NeedleSite::Tool { 2 } else { 1 };
        let pre_budget = n_turns.saturating_sub(needle_reqs + 1 + 2 + b.agent_requests());
        let mut tasks_left = (pre_budget / 2).max(1);
        if let Some(d) = depth {
            let mut shrink = 0;
            loop {
                let p0 = b.needle_position(site, &fact, 0)?;
                if p0 > d {
                    return Err(b.depth_error(
                        d,
                        format!("the history before the needle already takes {p0} tokens"),
                    ));
                }
                let remaining = d - p0;
                if remaining < 80 || shrink >= 3 {
                    break;
                }
                let target = (remaining / tasks_left.max(1)).clamp(60, 1500) >> shrink;
                let saved = b.exchanges.len();
                b.push_task(target);
                if b.needle_position(site, &fact, 0)? > d {
                    b.exchanges.truncate(saved);
                    shrink += 1;
                    continue;
                }
                tasks_left = tasks_left.saturating_sub(1);
            }
            let pad = match cfg.placement {
                Placement::Exact => b.exact_pad(d, |b, p| b.needle_position(site, &fact, p))?,
                Placement::Turn => 0,
            };
            let ex = b.needle_exchanges(site, &fact, pad);
            b.exchanges.extend(ex);
        } else {
            let ex = b.needle_exchanges(site, &fact, 0);
            b.exchanges.extend(ex);
        }
        if b.first_user.is_none() {
            b.first_user = b
                .exchanges
                .first()
                .and_then(|e| e.input.first())
                .map(ChatMessage::text);
        }
    }

    // Filler after the needle, then the probe.
    let question = format!(
        "Before we wrap up: what is the {} for project {}? Reply with the exact value.",
        fact.subject, b.project.name
    );
    let probe_msgs = |b: &Builder| {
        let mut m = b.history();
        m.push(ChatMessage::new("user", &question));
        m
    };
    let mut post = 0;
    while post == 0 || b.agent_requests() + 1 < n_turns {
        let saved = b.exchanges.len();
        let t = b.tg.rng.random_range(100..600);
        b.push_task(t);
        let n = counter
            .count(&probe_msgs(&b), Some(&b.tools))
            .map_err(b.enc_err("probe"))?;
        if n + cfg.max_tokens as usize > cfg.max_prompt_tokens {
            b.exchanges.truncate(saved);
            break;
        }
        post += 1;
    }
    let msgs = probe_msgs(&b);
    let total = counter
        .count(&msgs, Some(&b.tools))
        .map_err(b.enc_err("probe"))?;
    if total > cfg.max_prompt_tokens {
        return Err(b.depth_error(
            depth.unwrap_or(0),
            format!("the probe request takes {total} tokens"),
        ));
    }
    let pos = counter
        .position(&msgs, Some(&b.tools), &fact.sentence)
        .map_err(b.enc_err("probe"))?
        .ok_or_else(|| Error::Encode {
            session: index,
            request: "probe".into(),
            message: "the probe prompt does not contain the fact".into(),
        })?;
    if let (Some(d), Placement::Exact) = (depth, cfg.placement) {
        if pos != d {
            return Err(b.depth_error(d, format!("the needle landed at {pos}")));
        }
    }
    let reasoning = b.reasoning();
    let answer = assistant(&fact.sentence, &reasoning, Vec::new());
    let probe = Probe {
        must_contain: vec![fact.secret.clone()],
        needle_position: Some(pos),
        label: Some(format!("needle@{}:{}", depth.unwrap_or(pos), site.as_str())),
    };
    // Plan the remaining segment's requests.
    let head = b.head.clone();
    let mut m = head;
    for e in &b.exchanges {
        let mut req = m.clone();
        req.extend(e.input.iter().cloned());
        b.planned.push(Planned::Agent {
            messages: req.clone(),
            answer: e.answer.clone(),
            probe: None,
        });
        m = req;
        m.push(e.answer.clone());
    }
    b.planned.push(Planned::Agent {
        messages: msgs,
        answer,
        probe: Some(probe),
    });
    let first_user = b.first_user.clone().unwrap_or_else(|| question.clone());
    emit(&mut b, session_id, created_us, &first_user)
}

fn params(cfg: &SynthConfig, tools: bool) -> Map<String, Value> {
    let mut p = Map::new();
    p.insert("model".into(), Value::String(cfg.model.clone()));
    p.insert("stream".into(), Value::Bool(true));
    p.insert("stream_options".into(), json!({"include_usage": true}));
    p.insert("max_tokens".into(), json!(cfg.max_tokens));
    if tools {
        p.insert("tool_choice".into(), json!("auto"));
    }
    p.insert("temperature".into(), json!(0));
    p
}

fn to_values(msgs: &[ChatMessage]) -> Vec<Value> {
    msgs.iter()
        .map(|m| serde_json::to_value(m).unwrap_or(Value::Null))
        .collect()
}

fn emit(b: &mut Builder, id: String, created_us: i64, first_user: &str) -> Result<SessionLine> {
    let cfg = b.cfg;
    let client = "opencode/0.15 (tapedeck-synth)".to_string();
    let mut headers = Map::new();
    headers.insert("user-agent".into(), Value::String(client.clone()));
    headers.insert("x-session-id".into(), Value::String(id.clone()));
    let mut arrival = created_us;
    let mut requests = Vec::new();
    let title = format!(
        "{} {}",
        match b.project.lang {
            crate::text::Lang::Rust => "Working on Rust crate",
            crate::text::Lang::Python => "Working on Python package",
            crate::text::Lang::TypeScript => "Working on TypeScript app",
        },
        b.project.name
    );
    let title_msgs = vec![
        ChatMessage::new("system", opencode::TITLE_SYSTEM),
        ChatMessage::new("user", first_user),
    ];
    let line = |turn: u32,
                id: Uuid,
                parent: Option<Uuid>,
                kind: RequestKind,
                messages: &[ChatMessage],
                tools: Option<Vec<Value>>,
                arrival: i64,
                response: ResponseLine,
                probe: Option<Probe>| RequestLine {
        id: Some(id),
        turn: Some(turn),
        parent_id: parent,
        stitch: Some(StitchMethod::Header),
        kind: Some(kind),
        endpoint: Some(Endpoint::ChatCompletions),
        model: Some(cfg.model.clone()),
        messages: Some(to_values(messages)),
        params: params(cfg, tools.is_some()),
        tools,
        raw_body: None,
        headers: headers.clone(),
        toggles: String::new(),
        build: None,
        status: Some(200),
        error: None,
        client_disconnected: false,
        timing: Timing {
            arrival_us: Some(arrival),
            ..Timing::default()
        },
        prompt_token_ids: None,
        encoding_report: None,
        response: Some(response),
        prompt_scores: None,
        probe,
    };
    let title_id = uuid(&mut b.tg.rng);
    requests.push(line(
        0,
        title_id,
        None,
        RequestKind::Title,
        &title_msgs,
        None,
        arrival,
        ResponseLine {
            content: title,
            finish_reason: Some("stop".into()),
            ..ResponseLine::default()
        },
        None,
    ));
    let mut parent: Option<Uuid> = None;
    for (k, p) in std::mem::take(&mut b.planned).into_iter().enumerate() {
        arrival += b.tg.rng.random_range(1_500_000..40_000_000);
        let rid = uuid(&mut b.tg.rng);
        let turn = k as u32 + 1;
        match p {
            Planned::Agent {
                messages,
                answer,
                probe,
            } => {
                let calls = answer.tool_calls.clone().unwrap_or_default();
                let finish = if calls.is_empty() {
                    "stop"
                } else {
                    "tool_calls"
                };
                requests.push(line(
                    turn,
                    rid,
                    parent,
                    RequestKind::Agent,
                    &messages,
                    Some(b.tools.clone()),
                    arrival,
                    ResponseLine {
                        content: answer.text(),
                        reasoning_content: answer.reasoning_content.clone(),
                        tool_calls: calls,
                        finish_reason: Some(finish.into()),
                        ..ResponseLine::default()
                    },
                    probe,
                ));
            }
            Planned::Compaction { messages, answer } => {
                requests.push(line(
                    turn,
                    rid,
                    parent,
                    RequestKind::Compaction,
                    &messages,
                    None,
                    arrival,
                    ResponseLine {
                        content: answer,
                        finish_reason: Some("stop".into()),
                        ..ResponseLine::default()
                    },
                    None,
                ));
            }
        }
        parent = Some(rid);
    }
    Ok(SessionLine {
        format: FORMAT.to_string(),
        session: SessionInfo {
            id,
            source: SessionSource::Synth,
            client_hint: Some(client),
            created_us: Some(created_us),
        },
        requests,
    })
}
