//! What conversation the candidate sees at each turn.
//!
//! * [`HistoryMode::Recorded`]: exactly the recorded messages. Every turn starts from the same
//!   context the recorded server saw, so differences are per-turn fidelity, never compounding.
//! * [`HistoryMode::SelfFed`] (`self`): the candidate's own earlier answers replace the recorded
//!   assistant messages that answered them; user messages and tool results stay as recorded. This
//!   is agent behaviour end to end: a candidate whose early answer drifts carries that drift on.
//!
//! Which recorded assistant message answers which earlier turn is found by structure, not by
//! position: turn *j* answered at index `len(messages_j)` of a later turn *k* exactly when turn
//! *k*'s recorded messages start with turn *j*'s recorded messages and have an assistant message
//! there. Side requests (titles, compactions) and rewritten histories fail that test and are left
//! alone. Tool-call IDs of a candidate answer are replaced, by position, with the IDs of the
//! recorded answer's calls so that the recorded tool results still refer to calls that exist.

use serde::{Deserialize, Serialize};
use tapedeck_engine::ChatMessage;

/// How history is rebuilt for each turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HistoryMode {
    /// Send the recorded messages unchanged.
    #[default]
    Recorded,
    /// Feed the candidate's own earlier answers back (`self`).
    #[serde(rename = "self")]
    SelfFed,
}

impl std::str::FromStr for HistoryMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "recorded" => Ok(HistoryMode::Recorded),
            "self" => Ok(HistoryMode::SelfFed),
            other => Err(format!("unknown history mode {other:?} (recorded, self)")),
        }
    }
}

impl std::fmt::Display for HistoryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HistoryMode::Recorded => "recorded",
            HistoryMode::SelfFed => "self",
        })
    }
}

/// An earlier turn of the same session: its recorded messages and the candidate's answer to them.
#[derive(Debug, Clone, Copy)]
pub struct Answered<'a> {
    /// The messages the earlier turn was recorded with.
    pub recorded_messages: &'a [ChatMessage],
    /// What the candidate answered.
    pub answer: &'a ChatMessage,
}

/// The messages to send for a turn recorded with `messages`, given the candidate's answers to
/// earlier turns (in any order). See the module documentation for the matching rule.
pub fn self_history(messages: &[ChatMessage], earlier: &[Answered<'_>]) -> Vec<ChatMessage> {
    let mut out = messages.to_vec();
    for e in earlier {
        let p = e.recorded_messages.len();
        let answers_it = messages.len() > p
            && messages[..p] == *e.recorded_messages
            && messages[p].role == "assistant";
        if !answers_it {
            continue;
        }
        let mut answer = e.answer.clone();
        answer.role = "assistant".into();
        if let (Some(cand), Some(rec)) = (answer.tool_calls.as_mut(), &messages[p].tool_calls) {
            for (c, r) in cand.iter_mut().zip(rec) {
                c.id = r.id.clone();
            }
        }
        out[p] = answer;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tapedeck_engine::messages::FunctionCall;
    use tapedeck_engine::ToolCall;

    fn call(id: &str, name: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: "{}".into(),
            },
        }
    }

    fn with_calls(mut m: ChatMessage, calls: Vec<ToolCall>) -> ChatMessage {
        m.tool_calls = Some(calls);
        m
    }

    #[test]
    fn replaces_answers_keeps_tool_results() {
        let sys = ChatMessage::new("system", "s");
        let u1 = ChatMessage::new("user", "q1");
        let a1 = with_calls(ChatMessage::new("assistant", ""), vec![call("rec_1", "ls")]);
        let mut tool = ChatMessage::new("tool", "files");
        tool.tool_call_id = Some("rec_1".into());
        let a2 = ChatMessage::new("assistant", "recorded answer 2");
        let u2 = ChatMessage::new("user", "q2");
        let t0 = vec![sys.clone(), u1.clone()];
        let t1 = vec![sys.clone(), u1.clone(), a1.clone(), tool.clone()];
        let t2 = vec![sys, u1, a1, tool.clone(), a2, u2];

        let c0 = with_calls(
            ChatMessage::new("assistant", "cand 0"),
            vec![call("cand_x", "cat")],
        );
        let c1 = ChatMessage::new("assistant", "cand 1");
        let earlier = [
            Answered {
                recorded_messages: &t0,
                answer: &c0,
            },
            Answered {
                recorded_messages: &t1,
                answer: &c1,
            },
        ];
        let h = self_history(&t2, &earlier);
        assert_eq!(h.len(), t2.len());
        assert_eq!(h[2].text(), "cand 0", "turn 0's answer replaced");
        let calls = h[2].tool_calls.as_ref().unwrap();
        assert_eq!(
            calls[0].id, "rec_1",
            "tool call ID kept so the result still links"
        );
        assert_eq!(
            calls[0].function.name, "cat",
            "but the call itself is the candidate's"
        );
        assert_eq!(h[3], tool, "tool results stay as recorded");
        assert_eq!(h[4].text(), "cand 1", "turn 1's answer replaced");
        assert_eq!(h[5].text(), "q2");
        // Recorded mode would send t2 unchanged; a side request that does not extend t0 is left.
        let side = vec![ChatMessage::new("user", "title please")];
        assert_eq!(self_history(&side, &earlier), side);
    }
}
