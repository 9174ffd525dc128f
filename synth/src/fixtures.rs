//! The shipped fixture sets in `fixtures/sessions/`, as configurations.
//!
//! Kept in the library (not only in the example that writes them) so the test that compares the
//! committed files with a fresh generation uses exactly the same settings: change the generator
//! without regenerating the files and that test fails.

use std::path::{Path, PathBuf};

use crate::config::{Placement, SynthConfig};
use crate::opencode::ToolDetail;

/// The counting model of the shipped fixtures, relative to the workspace root.
pub const MODEL: &str = "fixtures/models/tiny-qwen2";

/// The folder of the shipped fixtures, relative to the workspace root.
pub const DIR: &str = "fixtures/sessions";

/// The workspace root (this crate's parent directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// `(file name, configuration)` of every shipped fixture, with the model under `root`.
///
/// tiny-qwen2's tokenizer has 2048 tokens, so text takes about 2.4 characters per token: the
/// opencode-sized preamble (10k-character system prompt, full tool descriptions) would be about
/// 8000 tokens, past the 7000-token budget these sessions keep under the model's 8192-token
/// window. The fixtures therefore use a shorter system prompt and [`ToolDetail::Minimal`]
/// (all ten tools with their JSON Schemas, without per-property descriptions); depths shallower
/// than that preamble land in the system prompt's `AGENTS.md` block.
pub fn shipped(root: &Path) -> Vec<(&'static str, SynthConfig)> {
    let model = root.join(MODEL);
    let mut main = SynthConfig::new(&model);
    main.count = 5;
    main.turns = 4..=8;
    main.contexts = vec![512, 1024, 3072, 4096, 5120];
    main.seed = 7;
    main.align = Some(64);
    main.placement = Placement::Exact;
    main.system_prompt_chars = 2500;
    main.tool_detail = ToolDetail::Minimal;

    let mut smoke = SynthConfig::new(&model);
    smoke.count = 2;
    smoke.turns = 3..=3;
    smoke.contexts = vec![256, 2560];
    smoke.seed = 1;
    smoke.align = Some(16);
    smoke.compaction = true;
    smoke.system_prompt_chars = 0;
    smoke.tool_detail = ToolDetail::Minimal;
    smoke.max_prompt_tokens = 4096;
    vec![("opencode-synth.jsonl", main), ("smoke.jsonl", smoke)]
}
