//! Session stitching and request classification.
//!
//! An agent client (opencode, Claude Code, Codex) resends the whole conversation on every turn:
//! the request of turn *n+1* is the messages of turn *n*, then turn *n*'s answer, then new tool
//! results or a new user message. The recorder groups requests into sessions so a replay can play
//! them back turn by turn:
//!
//! 1. **Header.** When the client sends the session header (default `x-session-id`), its value is
//!    the session ID.
//! 2. **Prefix.** Otherwise, a request whose messages start with an earlier request's messages
//!    followed by that request's answer continues the earlier request's session.
//! 3. **Compaction.** A request that matches no prefix but carries, as one of its messages, the
//!    summary that a compaction request of some session produced continues that session: the
//!    client rewrote its history after compacting (a branch point; `parent` is the compaction).
//! 4. Otherwise the request starts a new session.
//!
//! Matching is by hash. Messages are canonicalized (role; text with surrounding whitespace
//! trimmed, string and text-part contents alike; tool calls as name plus arguments re-serialized
//! with sorted keys; reasoning, tool-call IDs and names left out, because clients differ in
//! whether they echo them) and chained: `h0 = SHA-256("tapedeck.stitch.v1")`,
//! `h(i+1) = SHA-256(h(i) || canon(m(i)))`. A finished request stores its *continuation hash*, the
//! chain over its messages and then its answer; a new request looks up the chain hash of each of its
//! prefixes, longest first. The index lives in memory and is rebuilt from the `requests` table at
//! startup ([`Stitcher::rebuild`]), so stitching survives restarts.
//!
//! # Classification ([`classify`])
//!
//! Heuristics, in order, over the *opening* of the system/developer prompt (its first
//! [`PERSONA_CHARS`] characters, where a side agent states what it is: long agent prompts mention
//! summaries and titles in passing further down) and the last user message, case-insensitive:
//!
//! * `title`: no tools offered, and either text mentions `title` together with one of `generat`,
//!   `create`, `write`, `suggest`, `give` (opencode's title agent: "You are a title generator...").
//! * `compaction`: either text mentions `summar` (summarize, summary) together with one of
//!   `conversation`, `above`, `so far`, `continu`; or the last user message asks for a
//!   `prompt for continuing` (opencode: "Provide a detailed prompt for continuing our conversation
//!   above"). Tools or not.
//! * `agent`: tools were offered.
//! * `other`: anything else.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tapedeck_engine::ChatMessage;
use uuid::Uuid;

use crate::error::Result;
use crate::record::{RequestKind, SessionRef, SessionSource, StitchMethod};
use crate::store::Store;

/// A chain hash.
type Hash = [u8; 32];

const CHAIN_SEED: &[u8] = b"tapedeck.stitch.v1";

/// How much of the system prompt [`classify`] looks at.
pub const PERSONA_CHARS: usize = 500;

/// Classifies a chat request (see the module documentation for the rules).
pub fn classify(messages: &[ChatMessage], tools_offered: bool) -> RequestKind {
    let mut text = String::new();
    if let Some(sys) = messages
        .iter()
        .find(|m| m.role == "system" || m.role == "developer")
    {
        text.extend(
            sys.text()
                .chars()
                .take(PERSONA_CHARS)
                .flat_map(char::to_lowercase),
        );
        text.push('\n');
    }
    let last_user = messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.text().to_lowercase())
        .unwrap_or_default();
    text.push_str(&last_user);
    let any = |words: &[&str]| words.iter().any(|w| text.contains(w));
    if !tools_offered
        && text.contains("title")
        && any(&["generat", "create", "write", "suggest", "give"])
    {
        RequestKind::Title
    } else if (text.contains("summar") && any(&["conversation", "above", "so far", "continu"]))
        || last_user.contains("prompt for continuing")
    {
        RequestKind::Compaction
    } else if tools_offered {
        RequestKind::Agent
    } else {
        RequestKind::Other
    }
}

/// JSON with object keys sorted, so `{"b":1,"a":2}` and `{"a":2,"b":1}` canonicalize the same.
fn canonical_json(v: &Value) -> String {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<_> = m.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), sorted(&m[k])))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

/// The canonical form of one message (see the module documentation).
fn canonical_message(m: &ChatMessage) -> String {
    let calls: Vec<Value> = m
        .tool_calls
        .iter()
        .flatten()
        .map(|c| {
            let args = serde_json::from_str::<Value>(&c.function.arguments)
                .map(|v| canonical_json(&v))
                .unwrap_or_else(|_| c.function.arguments.trim().to_string());
            Value::Array(vec![c.function.name.clone().into(), args.into()])
        })
        .collect();
    Value::Array(vec![
        m.role.clone().into(),
        m.text().trim().to_string().into(),
        Value::Array(calls),
    ])
    .to_string()
}

fn extend(prev: &Hash, m: &ChatMessage) -> Hash {
    let mut h = Sha256::new();
    h.update(prev);
    h.update(canonical_message(m).as_bytes());
    h.finalize().into()
}

fn seed() -> Hash {
    Sha256::digest(CHAIN_SEED).into()
}

fn content_hash(text: &str) -> Hash {
    Sha256::digest(text.trim().as_bytes()).into()
}

/// Where a new request's session continues from.
#[derive(Debug, Clone)]
struct Anchor {
    session: String,
    source: SessionSource,
    request: Uuid,
}

/// Most continuation keys kept in memory (about 150 bytes each). Older keys are forgotten first:
/// a conversation idle for a million requests starts a new session when it resumes.
pub const MAX_KEYS: usize = 1 << 20;

/// A map that forgets its oldest keys beyond a capacity.
#[derive(Debug)]
struct Bounded {
    map: HashMap<Hash, Anchor>,
    order: VecDeque<Hash>,
    cap: usize,
}

impl Bounded {
    fn new(cap: usize) -> Self {
        Bounded {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    fn insert(&mut self, k: Hash, v: Anchor) {
        if self.map.insert(k, v).is_none() {
            self.order.push_back(k);
        }
        while self.map.len() > self.cap {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
    }

    fn get(&self, k: &Hash) -> Option<&Anchor> {
        self.map.get(k)
    }
}

#[derive(Debug)]
struct Index {
    continuations: Bounded,
    compactions: Bounded,
    next_turn: HashMap<String, u32>,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            continuations: Bounded::new(MAX_KEYS),
            compactions: Bounded::new(MAX_KEYS / 16),
            next_turn: HashMap::new(),
        }
    }
}

impl Index {
    fn take_turn(&mut self, session: &str) -> u32 {
        let t = self.next_turn.entry(session.to_string()).or_insert(0);
        let turn = *t;
        *t = t.saturating_add(1);
        turn
    }
}

/// The hash chain of a request's messages, kept from arrival until its answer is known.
#[derive(Debug, Clone)]
pub struct Chain {
    last: Hash,
}

/// The session index. Shared by all request handlers; every method holds its lock briefly.
#[derive(Debug, Default)]
pub struct Stitcher {
    index: Mutex<Index>,
}

/// A session header value made safe to use as an ID: trimmed; replaced by a hash when it is longer
/// than 128 bytes or holds control characters. `None` when empty.
pub fn session_id_from_header(value: &str) -> Option<String> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if v.len() > 128 || v.chars().any(char::is_control) {
        return Some(format!(
            "h-{}",
            &hex::encode(Sha256::digest(v.as_bytes()))[..32]
        ));
    }
    Some(v.to_string())
}

impl Stitcher {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds the index from the requests already recorded.
    pub async fn rebuild(store: &Store) -> Result<Self> {
        let mut index = Index::default();
        for row in store.stitch_rows().await? {
            let anchor = Anchor {
                session: row.session_id.clone(),
                source: row.source,
                request: row.request,
            };
            let next = index.next_turn.entry(row.session_id).or_insert(0);
            *next = (*next).max(row.turn.saturating_add(1));
            if let Some(h) = row.continuation_hash.as_deref().and_then(parse_hash) {
                index.continuations.insert(h, anchor.clone());
            }
            if let (RequestKind::Compaction, Some(c)) = (row.kind, row.content.as_deref()) {
                if !c.trim().is_empty() {
                    index.compactions.insert(content_hash(c), anchor);
                }
            }
        }
        Ok(Stitcher {
            index: Mutex::new(index),
        })
    }

    /// Number of continuation keys held (for tests and diagnostics).
    pub fn len(&self) -> usize {
        self.lock().continuations.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        // A panic while holding this lock cannot leave the maps half-updated in a way that
        // matters (each update is one insert), so a poisoned lock is still usable.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Places an arriving chat request in a session. `header_session` is the session header's
    /// value, if sent; `client_hint` is stored with a new session.
    pub fn assign(
        &self,
        header_session: Option<&str>,
        messages: &[ChatMessage],
        client_hint: Option<&str>,
    ) -> (SessionRef, Chain) {
        let mut chain = Vec::with_capacity(messages.len());
        let mut h = seed();
        for m in messages {
            h = extend(&h, m);
            chain.push(h);
        }
        let mut index = self.lock();
        let prefix = chain
            .iter()
            .rev()
            .find_map(|h| index.continuations.get(h).cloned());
        let hint = client_hint.map(str::to_string);
        let session = if let Some(id) = header_session.and_then(session_id_from_header) {
            let parent = prefix.filter(|a| a.session == id).map(|a| a.request);
            SessionRef {
                turn: index.take_turn(&id),
                id,
                source: SessionSource::Header,
                client_hint: hint,
                parent,
                stitch: StitchMethod::Header,
            }
        } else if let Some(a) = prefix {
            SessionRef {
                turn: index.take_turn(&a.session),
                id: a.session,
                source: a.source,
                client_hint: hint,
                parent: Some(a.request),
                stitch: StitchMethod::Prefix,
            }
        } else if let Some(a) = messages
            .iter()
            .rev()
            .filter(|m| m.role == "user" || m.role == "assistant" || m.role == "system")
            .find_map(|m| index.compactions.get(&content_hash(&m.text())).cloned())
        {
            SessionRef {
                turn: index.take_turn(&a.session),
                id: a.session,
                source: a.source,
                client_hint: hint,
                parent: Some(a.request),
                stitch: StitchMethod::Compaction,
            }
        } else {
            let id = Uuid::new_v4().to_string();
            SessionRef {
                turn: index.take_turn(&id),
                id,
                source: SessionSource::Content,
                client_hint: hint,
                parent: None,
                stitch: StitchMethod::New,
            }
        };
        (session, Chain { last: h })
    }

    /// Registers a finished request's answer so that later requests can continue from it; returns
    /// the continuation hash to store with the record.
    pub fn complete(
        &self,
        session: &SessionRef,
        request: Uuid,
        kind: RequestKind,
        chain: &Chain,
        answer: &ChatMessage,
    ) -> String {
        let h = extend(&chain.last, answer);
        let anchor = Anchor {
            session: session.id.clone(),
            source: session.source,
            request,
        };
        let mut index = self.lock();
        if kind == RequestKind::Compaction && !answer.text().trim().is_empty() {
            index
                .compactions
                .insert(content_hash(&answer.text()), anchor.clone());
        }
        index.continuations.insert(h, anchor);
        hex::encode(h)
    }
}

/// The continuation hash of a request with these messages and this answer: what
/// [`Stitcher::complete`] would store. Used when importing sessions, so that a server started on
/// the database later continues them.
pub fn continuation_hash(messages: &[ChatMessage], answer: &ChatMessage) -> String {
    let mut h = seed();
    for m in messages {
        h = extend(&h, m);
    }
    hex::encode(extend(&h, answer))
}

fn parse_hash(s: &str) -> Option<Hash> {
    hex::decode(s).ok()?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form_ignores_what_clients_change() {
        let mut a = ChatMessage::new("assistant", "  hello\n");
        a.reasoning_content = Some("thinking".into());
        let b = ChatMessage::new("assistant", "hello");
        assert_eq!(canonical_message(&a), canonical_message(&b));
        let c = ChatMessage::new("user", "hello");
        assert_ne!(canonical_message(&b), canonical_message(&c));
        assert_eq!(
            canonical_json(&serde_json::json!({"b": 1, "a": {"d": 2, "c": 3}})),
            r#"{"a":{"c":3,"d":2},"b":1}"#
        );
    }

    #[test]
    fn bounded_map_forgets_the_oldest() {
        let mut b = Bounded::new(2);
        let a = |n: u8| Anchor {
            session: n.to_string(),
            source: SessionSource::Content,
            request: Uuid::nil(),
        };
        b.insert([1; 32], a(1));
        b.insert([2; 32], a(2));
        b.insert([2; 32], a(2)); // re-insert does not count twice
        b.insert([3; 32], a(3));
        assert!(b.get(&[1; 32]).is_none());
        assert!(b.get(&[2; 32]).is_some() && b.get(&[3; 32]).is_some());
    }

    #[test]
    fn header_ids_are_sanitized() {
        assert_eq!(session_id_from_header("  abc "), Some("abc".into()));
        assert_eq!(session_id_from_header(" "), None);
        let long = "x".repeat(500);
        let id = session_id_from_header(&long).unwrap();
        assert!(id.starts_with("h-") && id.len() == 34);
        assert!(session_id_from_header("a\nb").unwrap().starts_with("h-"));
    }
}
