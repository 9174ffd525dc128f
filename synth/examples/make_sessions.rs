//! Regenerates the shipped session fixtures in `fixtures/sessions/` (see its README.md):
//!
//! ```sh
//! cargo run -p tapedeck-synth --example make_sessions            # writes fixtures/sessions/
//! cargo run -p tapedeck-synth --example make_sessions -- OUT_DIR # writes elsewhere
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use tapedeck_synth::{fixtures, generate, write_jsonl};

fn main() -> ExitCode {
    let root = fixtures::workspace_root();
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(fixtures::DIR));
    for (name, cfg) in fixtures::shipped(&root) {
        let path = out.join(name);
        let sessions = match generate(&cfg) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{name}: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = write_jsonl(&path, &sessions) {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        println!("{} ({size} bytes)", path.display());
        for s in &sessions {
            let probe = s.requests.iter().find_map(|r| r.probe.as_ref());
            println!(
                "  {}: {} requests, probe {}",
                s.session.id,
                s.requests.len(),
                probe
                    .map(|p| format!(
                        "{} at token {}",
                        p.label.as_deref().unwrap_or("?"),
                        p.needle_position.unwrap_or(0)
                    ))
                    .unwrap_or_else(|| "none".into())
            );
        }
    }
    ExitCode::SUCCESS
}
