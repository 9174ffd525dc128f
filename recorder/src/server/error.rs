//! The one error type at the HTTP edge, in OpenAI's shape.
//!
//! Every failure a client can see is an [`ApiError`]: `{"error": {"message", "type", "param",
//! "code"}}` with the right status. Internal details (engine failures, database errors) go to the
//! log and to the recording, never to the client.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::backend::BackendError;

/// An error response. Boxed inside so that `Result<T, ApiError>` stays small.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError(Box<Inner>);

#[derive(Debug, Clone, PartialEq)]
struct Inner {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
    retry_after: Option<Duration>,
    internal: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError(Box::new(Inner {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            internal: None,
        }))
    }

    /// 400: the request is malformed or asks for something unsupported.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the offending parameter.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request(message).with_param(param)
    }

    /// 404: the model asked for is not served here.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist."),
        )
        .with_param("model");
        e.0.code = Some("model_not_found");
        e
    }

    /// 404: no such route.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    /// 400: the prompt does not fit the context window.
    pub fn context_length(prompt_tokens: usize, context: usize) -> Self {
        let mut e = Self::bad_request(format!(
            "This model's maximum context length is {context} tokens. However, your prompt has \
             {prompt_tokens} tokens."
        ))
        .with_param("messages");
        e.0.code = Some("context_length_exceeded");
        e
    }

    /// 413: the body is larger than the configured limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 429: too many requests are waiting.
    pub fn overloaded(retry_after: Duration) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the server is overloaded; retry later",
        );
        e.0.code = Some("rate_limit_exceeded");
        e.0.retry_after = Some(retry_after);
        e
    }

    /// 500: something failed on our side; `detail` is logged and recorded, not sent.
    pub fn internal(detail: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal server error",
        );
        e.0.internal = Some(detail.into());
        e
    }

    /// Names the parameter at fault.
    pub fn with_param(mut self, param: &str) -> Self {
        self.0.param = Some(param.to_string());
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The message sent to the client.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// The machine-readable code, if any.
    pub fn code(&self) -> Option<&'static str> {
        self.0.code
    }

    /// What goes into the recording: the internal detail when there is one.
    pub fn record_text(&self) -> String {
        match &self.0.internal {
            Some(d) => format!("{}: {d}", self.0.message),
            None => self.0.message.clone(),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.0.message,
            "type": self.0.kind,
            "param": self.0.param,
            "code": self.0.code,
        }})
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Overloaded { retry_after, .. } => ApiError::overloaded(retry_after),
            BackendError::InvalidRequest(m) => ApiError::bad_request(m),
            BackendError::ContextOverflow {
                prompt_tokens,
                context,
            } => ApiError::context_length(prompt_tokens, context),
            BackendError::Cancelled => ApiError::internal("generation cancelled"),
            BackendError::Internal(m) => ApiError::internal(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Some(d) = &self.0.internal {
            tracing::error!(status = %self.0.status, detail = %d, "request failed");
        }
        let mut resp = (self.0.status, axum::Json(self.body())).into_response();
        if let Some(after) = self.0.retry_after {
            let secs = after.as_secs().max(1).to_string();
            if let Ok(v) = HeaderValue::from_str(&secs) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}
