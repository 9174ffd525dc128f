//! The model families the engine runs. All are Llama-shaped; see [`models::llama`].
//!
//! [`models::llama`]: crate::models::llama

pub use crate::models::llama::{
    BlockTable, KvCache, KvPool, Logits, Model, Pick, Segment, WantLogits,
};
