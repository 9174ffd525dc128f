//! The per-request state of generation, shared by [`Engine::generate`] and the scheduler: sampler,
//! incremental detokenizer, stop-string matcher and the output being built.
//!
//! Keeping one implementation means a request served alone and one served in a batch finish for
//! the same reasons with the same text.
//!
//! [`Engine::generate`]: crate::Engine::generate

use std::time::Instant;

use crate::backend::{Feed, Ticket};
use crate::error::Result;
use crate::generate::{FinishReason, GenerateOutput, GenerateRequest, Timings, TokenEvent};
use crate::model::{Logits, Pick, WantLogits};
use crate::sampling::{summarize, Sampler};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// One request's generation in progress.
pub struct Decoding {
    sampler: Sampler,
    stops: StopMatcher,
    detok: IncrementalDecoder,
    out: GenerateOutput,
    start: Instant,
    max_tokens: usize,
    ignore_eos: bool,
    stop_token_ids: Vec<u32>,
    top_k_summary: usize,
    done: bool,
    /// Teacher forcing: the tokens to feed instead of sampling (empty: generate).
    forced: Vec<u32>,
}

impl Decoding {
    /// Starts decoding for `req`; `start` is when the request arrived (timings count from it).
    pub fn new(req: &GenerateRequest, start: Instant) -> Self {
        Decoding {
            sampler: Sampler::new(&req.sampling),
            stops: StopMatcher::new(&req.stop.stop_strings),
            detok: IncrementalDecoder::default(),
            out: GenerateOutput {
                tokens: Vec::new(),
                text: String::new(),
                summaries: Vec::new(),
                finish_reason: FinishReason::Length,
                matched_stop: None,
                prompt_tokens: req.prompt.len(),
                timings: Timings::default(),
            },
            start,
            max_tokens: req.stop.max_tokens,
            ignore_eos: req.stop.ignore_eos,
            stop_token_ids: req.stop.stop_token_ids.clone(),
            top_k_summary: req.top_k_summary,
            done: req.stop.max_tokens == 0,
            forced: Vec::new(),
        }
    }

    /// Teacher forcing through the generation path: each step "chooses" the next of `forced`
    /// and summarizes the distribution with that token's logprob; no stop rule applies until
    /// `forced` runs out. Scoring this way runs exactly the prefill chunks, decode steps, batching
    /// and prefix-cache hits that generation does.
    pub fn new_forced(req: &GenerateRequest, start: Instant, forced: Vec<u32>) -> Self {
        let mut d = Decoding::new(req, start);
        d.max_tokens = forced.len();
        d.done = forced.is_empty();
        d.forced = forced;
        d
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.out.tokens
    }

    /// Whether generation has ended.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Marks the end of the prompt's prefill (for the timings).
    pub fn prefilled(&mut self) {
        self.out.timings.prefill = self.start.elapsed();
    }

    /// What the next step needs from the forward pass: a pick (the token and its summary) when
    /// the choice is greedy or forced, so the backend can make it where the logits are; the
    /// whole last row when sampling draws from the distribution.
    pub fn want(&self) -> WantLogits {
        self.want_at(self.out.tokens.len())
    }

    /// What the step that produces token number `n` (from 0) needs: [`want`](Self::want) for
    /// a step submitted before the tokens ahead of it are known.
    pub fn want_at(&self, n: usize) -> WantLogits {
        let k = self.top_k_summary;
        if let Some(&token) = self.forced.get(n) {
            WantLogits::Pick(Pick {
                k,
                token: Some(token),
            })
        } else if self.forced.is_empty() && self.sampler.is_greedy() {
            WantLogits::Pick(Pick { k, token: None })
        } else {
            WantLogits::Last
        }
    }

    /// Teacher forcing's token number `n`, which a step can be fed before it is "chosen".
    pub fn forced_at(&self, n: usize) -> Option<u32> {
        self.forced.get(n).copied()
    }

    /// Whether token number `n` can still be produced: it is within `max_tokens` and nothing
    /// has ended generation. An end-of-sequence or stop string may still end it sooner.
    pub fn may_produce(&self, n: usize) -> bool {
        !self.done && n < self.max_tokens
    }

    /// The input of a step submitted ahead, after the step `producing` token number `n` and
    /// before that one is collected: the forced token where teacher forcing gives it, else the
    /// token `producing` picks. `None` where generation cannot go on past token `n` (the rules
    /// [`step`](Self::step) applies; `room`: the context has a position for token `n`).
    pub fn feed_ahead<'t>(
        &self,
        n: usize,
        room: bool,
        producing: &'t mut Ticket,
    ) -> Option<Feed<'t>> {
        if !(room && self.may_produce(n + 1)) {
            return None;
        }
        Some(match self.forced_at(n) {
            Some(t) => Feed::Token(t),
            None => Feed::Picked(producing),
        })
    }

    /// Chooses the next token from `logits` (as [`want`](Self::want) asked for them);
    /// `context_full` says the context window has no room for another position. Returns the event
    /// to stream and whether generation ended.
    pub fn step(
        &mut self,
        logits: Logits,
        tok: &Tokenizer,
        context_full: bool,
    ) -> Result<(TokenEvent, bool)> {
        if self.out.tokens.is_empty() && self.out.timings.prefill.is_zero() {
            self.prefilled();
        }
        let forced = self.forced.get(self.out.tokens.len()).copied();
        let (id, summary) = match logits {
            Logits::Picked { token, summary } => {
                if forced.is_some_and(|f| f != token) {
                    return Err(crate::error::Error::Device(format!(
                        "the backend picked token {token} where {forced:?} was forced"
                    )));
                }
                (token, summary)
            }
            Logits::Rows(row) => {
                let id = forced.unwrap_or_else(|| self.sampler.sample(&row));
                let summary = summarize(&row, id, self.top_k_summary);
                (id, summary)
            }
        };
        self.out.tokens.push(id);
        self.out.summaries.push(summary.clone());
        if forced.is_some() {
            let elapsed = self.start.elapsed();
            self.out.timings.first_token.get_or_insert(elapsed);
            if self.out.tokens.len() >= self.forced.len() || context_full {
                self.out.finish_reason = FinishReason::Length;
                self.done = true;
            }
            let event = TokenEvent {
                id,
                text: String::new(),
                summary,
                elapsed,
            };
            return Ok((event, self.done));
        }
        let is_stop_token =
            (!self.ignore_eos && tok.eos_ids.contains(&id)) || self.stop_token_ids.contains(&id);
        let mut text = String::new();
        let mut hit = None;
        if !is_stop_token {
            let piece = self.detok.push(tok, id)?;
            let (emit, matched) = self.stops.push(&piece);
            text = emit;
            hit = matched;
        }
        self.out.text.push_str(&text);
        let elapsed = self.start.elapsed();
        self.out.timings.first_token.get_or_insert(elapsed);
        if is_stop_token || hit.is_some() {
            self.out.finish_reason = FinishReason::Stop;
            self.out.matched_stop = hit;
            self.done = true;
        } else if context_full || self.out.tokens.len() >= self.max_tokens {
            self.out.finish_reason = FinishReason::Length;
            self.done = true;
        }
        let event = TokenEvent {
            id,
            text,
            summary,
            elapsed,
        };
        Ok((event, self.done))
    }

    /// Ends generation because the caller stopped listening.
    pub fn cancel(&mut self) {
        self.out.finish_reason = FinishReason::Cancelled;
        self.done = true;
    }

    /// The final output. Text held back for a stop string that never completed is released.
    pub fn finish(mut self) -> GenerateOutput {
        if self.out.finish_reason != FinishReason::Stop {
            let rest = self.stops.flush();
            self.out.text.push_str(&rest);
        }
        if self.out.timings.prefill.is_zero() {
            self.prefilled();
        }
        self.out.timings.total = self.start.elapsed();
        self.out
    }
}

/// Finds stop strings in streamed text, holding back any tail that could still become one.
#[derive(Debug, Default)]
struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    pending: String,
}

impl StopMatcher {
    fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds text; returns what can be released and the stop string matched, if any (the text
    /// released then ends just before it).
    fn push(&mut self, piece: &str) -> (String, Option<String>) {
        self.pending.push_str(piece);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), None);
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = first {
            let s = s.clone();
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, Some(s));
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..k]) {
                    hold = hold.max(k);
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, None)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    #[test]
    fn stop_matcher_holds_back_partial_matches() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("abc S"), ("abc ".to_string(), None));
        assert_eq!(m.push("T"), (String::new(), None));
        assert_eq!(m.push("x"), ("STx".to_string(), None));
        assert_eq!(m.push("yST"), ("y".to_string(), None));
        assert_eq!(m.push("OPz"), (String::new(), Some("STOP".to_string())));
        let mut m = StopMatcher::new(&["é!".to_string()]);
        assert_eq!(m.push("aé"), ("a".to_string(), None));
        assert_eq!(m.flush(), "é");
    }
}
