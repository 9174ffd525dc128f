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
    let success = match &outcome {
        Ok(out) => {
            let done = protocol.done(out);
            output.finish_reason = Some(done.finish_reason.clone());
            if out.finish_reason == FinishReason::Cancelled {
                disconnected = true;
            }
            if stream {
                if !disconnected {
                    let mut chunks = done.chunks;
                    let ok = send_chunks(&mut sink, &mut protocol, &[]).await
                        && send_all(&mut sink, chunks.drain(..)).await
                        && sink.send(Event::default().data("[DONE]")).await;
                    disconnected |= !ok;
                }
            } else if !sink.reply(Reply::Whole(done.whole)) {
                disconnected = true;
            }
            output.token_ids = out.tokens.clone();
            output.text = out.text.clone();
            output.logits = out.summaries.clone();
            !disconnected
        }
        Err(e) => {
            let err = ApiError::from(e.clone());
            record.error = Some(err.record_text());
            if matches!(e, BackendError::Cancelled) {
                disconnected = true;
            }
            if matches!(sink, Sink::Pending(_)) {
                record.status = err.status().as_u16();
                if err.status().is_server_error() {
                    tracing::error!(request = %record.id, error = %err.record_text(), "generation failed");
                }
                sink.reply(Reply::Error(err));
            } else {
                tracing::error!(request = %record.id, error = %err.record_text(), "generation failed mid-stream");
                sink.send(data(&err.body())).await;
            }
            output.finish_reason = Some("error".into());
            output.token_ids = ids;
            output.logits = summaries;
            false
        }
    };
    drop(sink);
    record.end_us = now_us();
    record.client_disconnected = disconnected;
    protocol.record(&mut record, &mut output, success);
    record.output = Some(output);
    state.finish(record, arrival).await;
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
