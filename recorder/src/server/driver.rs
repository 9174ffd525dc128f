//! The task that runs one generation from start to record, whatever the client does.
//!
//! The handler starts a [`Generation`], spawns [`drive`] and waits for its [`Reply`]. The driver
//! owns the record: it timestamps tokens, feeds them to the endpoint's [`Protocol`] (which formats
//! chunks and the final body), sends the stream, and when generation ends it writes the record.
//! Because the driver is its own task, a client that disconnects (the handler future or the SSE
//! body is dropped) is noticed — the generation is cancelled — and the request is still recorded,
//! flagged `client_disconnected`.
//!
//! A streamed response is opened at the first token, so an error before any token (engine
//! refusal, context overflow) still gets its proper HTTP status; an error after that becomes a
//! final SSE `error` event.

use std::convert::Infallible;
use std::time::Instant;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tapedeck_engine::{FinishReason, GenerateOutput, TokenEvent};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt as _;

use super::error::ApiError;
use super::{AppState, Arrival};
use crate::backend::{BackendError, GenEvent, Generation};
use crate::record::{now_us, RecordedOutput, RequestRecord};

/// What the driver tells the waiting handler.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Stream these events.
    Stream(mpsc::Receiver<Event>),
    /// Send this JSON body.
    Whole(Value),
    /// Fail with this error.
    Error(ApiError),
}

impl Reply {
    /// The HTTP response; `None` from the channel means the driver died, which is a bug.
    pub(crate) fn into_response(reply: Option<Reply>) -> Response {
        match reply {
            Some(Reply::Stream(rx)) => {
                let stream = ReceiverStream::new(rx).map(Ok::<_, Infallible>);
                Sse::new(stream)
                    .keep_alive(KeepAlive::default())
                    .into_response()
            }
            Some(Reply::Whole(v)) => axum::Json(v).into_response(),
            Some(Reply::Error(e)) => e.into_response(),
            None => ApiError::internal("generation driver ended without replying").into_response(),
        }
    }
}

/// The end of a successful generation, formatted.
pub(crate) struct Done {
    /// Chunks to stream before `[DONE]` (final chunk, usage chunk).
    pub chunks: Vec<Value>,
    /// The non-streaming response body.
    pub whole: Value,
    /// The finish reason sent.
    pub finish_reason: String,
}

/// How one endpoint formats a generation.
pub(crate) trait Protocol: Send + 'static {
    /// Chunks that open a stream (the role chunk; an echoed prompt).
    fn opening(&mut self) -> Vec<Value>;
    /// Chunks for one token (possibly none while text is held back).
    fn token(&mut self, ev: &TokenEvent) -> Vec<Value>;
    /// The end of a generation.
    fn done(&mut self, out: &GenerateOutput) -> Done;
    /// Fills in what the protocol knows about the output (content, reasoning, tool calls) and
    /// registers a finished answer for session stitching.
    fn record(&mut self, rec: &mut RequestRecord, output: &mut RecordedOutput, success: bool);
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

enum Sink {
    Pending(oneshot::Sender<Reply>),
    Streaming(mpsc::Sender<Event>),
    Gone,
}

impl Sink {
    async fn closed(&mut self) {
        match self {
            Sink::Pending(tx) => tx.closed().await,
            Sink::Streaming(tx) => tx.closed().await,
            Sink::Gone => std::future::pending().await,
        }
    }

    /// Opens the stream if it is not open yet; false when the client is gone.
    fn open(&mut self) -> (bool, bool) {
        match std::mem::replace(self, Sink::Gone) {
            Sink::Pending(reply) => {
                let (tx, rx) = mpsc::channel(256);
                if reply.send(Reply::Stream(rx)).is_ok() {
                    *self = Sink::Streaming(tx);
                    (true, true)
                } else {
                    (false, false)
                }
            }
            Sink::Streaming(tx) => {
                *self = Sink::Streaming(tx);
                (true, false)
            }
            Sink::Gone => (false, false),
        }
    }

    async fn send(&mut self, ev: Event) -> bool {
        match self {
            Sink::Streaming(tx) => {
                if tx.send(ev).await.is_ok() {
                    true
                } else {
                    *self = Sink::Gone;
                    false
                }
            }
            _ => false,
        }
    }

    fn is_gone(&self) -> bool {
        match self {
            Sink::Pending(tx) => tx.is_closed(),
            Sink::Streaming(tx) => tx.is_closed(),
            Sink::Gone => true,
        }
    }

    fn reply(&mut self, r: Reply) -> bool {
        match std::mem::replace(self, Sink::Gone) {
            Sink::Pending(tx) => tx.send(r).is_ok(),
            _ => false,
        }
    }
}

/// Everything the driver needs.
pub(crate) struct Run<P> {
    pub state: AppState,
    pub record: RequestRecord,
    pub arrival: Arrival,
    pub generation: Generation,
    pub protocol: P,
    pub stream: bool,
}

/// Runs a generation to its end and records it. See the module documentation.
pub(crate) async fn drive<P: Protocol>(run: Run<P>, reply: oneshot::Sender<Reply>) {
    let Run {
        state,
        mut record,
        arrival,
        mut generation,
        mut protocol,
        stream,
    } = run;
    let mut sink = Sink::Pending(reply);
    let mut disconnected = false;
    let mut offsets: Vec<u64> = Vec::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut summaries = Vec::new();
    let mut last_token: Option<Instant> = None;
    let outcome: Result<GenerateOutput, BackendError> = loop {
        let ev = tokio::select! {
            biased;
            ev = generation.next() => ev,
            _ = sink.closed(), if !disconnected => {
                disconnected = true;
                generation.cancel();
                continue;
            }
        };
        match ev {
            None => {
                break Err(BackendError::Internal(
                    "generation ended without a result".into(),
                ))
            }
            Some(GenEvent::Done(out)) => break Ok(out),
            Some(GenEvent::Error(e)) => break Err(e),
            Some(GenEvent::Token(ev)) => {
                let now = Instant::now();
                let offset = now.duration_since(arrival.at);
                offsets.push(u64::try_from(offset.as_micros()).unwrap_or(u64::MAX));
                ids.push(ev.id);
                summaries.push(ev.summary.clone());
                match last_token {
                    None => state.metrics().ttft.observe(offset),
                    Some(prev) => state.metrics().itl.observe(now.duration_since(prev)),
                }
                last_token = Some(now);
                let chunks = protocol.token(&ev);
                if stream && !disconnected {
                    let ok = send_chunks(&mut sink, &mut protocol, &chunks).await;
                    if !ok {
                        disconnected = true;
                        generation.cancel();
                    }
                }
            }
        }
    };

    let mut output = RecordedOutput {
        token_offsets_us: offsets,
        ..RecordedOutput::default()
    };
    // The record is queued before the client can see the end of its response (the `[DONE]`, the
    // body, the error), so whoever reads the database after a response finds it after a flush.
    let last: Last;
    let success = match &outcome {
        Ok(out) => {
            let done = protocol.done(out);
            output.finish_reason = Some(done.finish_reason.clone());
            output.token_ids = out.tokens.clone();
            output.text = out.text.clone();
            output.logits = out.summaries.clone();
            if out.finish_reason == FinishReason::Cancelled {
                disconnected = true;
            }
            if stream {
                if !disconnected && !send_chunks(&mut sink, &mut protocol, &done.chunks).await {
                    disconnected = true;
                }
                last = Last::Event(Event::default().data("[DONE]"));
            } else {
                last = Last::Reply(Reply::Whole(done.whole));
            }
            true
        }
        Err(e) => {
            let err = ApiError::from(e.clone());
            record.error = Some(err.record_text());
            if matches!(e, BackendError::Cancelled) {
                disconnected = true;
            }
            output.finish_reason = Some("error".into());
            output.token_ids = ids;
            output.logits = summaries;
            if matches!(sink, Sink::Pending(_)) {
                record.status = err.status().as_u16();
                if err.status().is_server_error() && !disconnected {
                    tracing::error!(request = %record.id, error = %err.record_text(), "generation failed");
                }
                last = Last::Reply(Reply::Error(err));
            } else {
                tracing::error!(request = %record.id, error = %err.record_text(), "generation failed mid-stream");
                last = Last::Event(data(&err.body()));
            }
            false
        }
    };
    if sink.is_gone() {
        disconnected = true;
    }
    if disconnected && matches!(sink, Sink::Pending(_)) {
        // Nothing was sent: nginx's "client closed request".
        record.status = CLIENT_CLOSED_REQUEST;
    }
    record.end_us = now_us();
    record.client_disconnected = disconnected;
    protocol.record(&mut record, &mut output, success && !disconnected);
    record.output = Some(output);
    state.finish_nowait(record, arrival);
    match last {
        Last::Event(ev) => {
            sink.send(ev).await;
        }
        Last::Reply(r) => {
            sink.reply(r);
        }
    }
}

/// Status recorded for a request whose client left before any response byte was sent.
pub(crate) const CLIENT_CLOSED_REQUEST: u16 = 499;

/// What is delivered after the record is queued.
enum Last {
    Event(Event),
    Reply(Reply),
}

async fn send_all(sink: &mut Sink, chunks: impl Iterator<Item = Value>) -> bool {
    for c in chunks {
        if !sink.send(data(&c)).await {
            return false;
        }
    }
    true
}

/// Opens the stream if needed (sending the protocol's opening chunks), then sends `chunks`.
async fn send_chunks<P: Protocol>(sink: &mut Sink, protocol: &mut P, chunks: &[Value]) -> bool {
    let (open, fresh) = sink.open();
    if !open {
        return false;
    }
    if fresh {
        let opening = protocol.opening();
        if !send_all(sink, opening.into_iter()).await {
            return false;
        }
    }
    send_all(sink, chunks.iter().cloned()).await
}
