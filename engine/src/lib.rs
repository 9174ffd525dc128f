//! tapedeck's inference engine.
//!
//! Loads Hugging Face Llama-family checkpoints (Llama, Qwen2, Mistral), encodes chats with the
//! model's own template, and runs them on the CPU reference backend or the CUDA backend
//! ([`backend`]) with precision and fault toggles. Its f32 path is the golden reference that toggled builds, GPU kernels and other servers
//! are compared against, so correctness comes before speed everywhere in this crate.

pub mod backend;
pub mod chat;
pub mod config;
pub mod cuda;
pub mod decoding;
pub mod engine;
pub mod error;
pub mod fixture;
pub mod generate;
pub mod kv_blocks;
pub(crate) mod kv_host;
pub mod messages;
pub mod model;
pub mod models;
pub mod numerics;
pub mod sampling;
pub mod scheduler;
pub mod toggles;
pub mod tokenizer;
pub mod weights;

pub use engine::Engine;
pub use error::{Error, Result};
pub use generate::{
    FinishReason, GenerateOutput, GenerateRequest, LogitsSummary, SamplingParams, StopCriteria,
    TokenEvent,
};
pub use messages::{ChatMessage, ToolCall};
pub use toggles::Toggles;
