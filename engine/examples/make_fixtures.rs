//! Rebuilds the test models under `fixtures/models/` (or a benchmark model on demand).
//!
//! ```text
//! cargo run --release -p tapedeck-engine --example make_fixtures                 # committed fixtures + README
//! cargo run --release -p tapedeck-engine --example make_fixtures -- --out DIR    # same, elsewhere
//! cargo run --release -p tapedeck-engine --example make_fixtures -- --spec llama_120m --out DIR [--dtype f32]
//! cargo run --release -p tapedeck-engine --example make_fixtures -- --spec tiny_qwen2 --print-corpus
//! ```
//!
//! Without `--spec` it builds every committed spec into `OUT/<name>/` and writes `OUT/README.md`
//! (default `OUT`: the workspace's `fixtures/models`). With `--spec NAME` it builds that one spec
//! into `OUT/<name>/`. Every file is printed with its size and SHA-256. Output is bit-for-bit
//! reproducible; `engine/tests/fixture_determinism.rs` fails when the committed files differ from a
//! fresh build.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use tapedeck_engine::fixture::{self, Dtype, FixtureSpec};

const USAGE: &str = "usage: make_fixtures [--out DIR] [--spec tiny_llama|tiny_qwen2|llama_120m]... [--dtype f32|bf16|f16] [--print-corpus]";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("make_fixtures: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut out: Option<PathBuf> = None;
    let mut specs: Vec<FixtureSpec> = Vec::new();
    let mut dtype: Option<Dtype> = None;
    let mut print_corpus = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| args.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        match a.as_str() {
            "--out" => out = Some(PathBuf::from(value("--out")?)),
            "--spec" => {
                let name = value("--spec")?;
                specs.push(
                    FixtureSpec::by_name(&name).ok_or(format!("unknown spec {name:?}\n{USAGE}"))?,
                );
            }
            "--dtype" => {
                dtype = Some(match value("--dtype")?.as_str() {
                    "f32" => Dtype::F32,
                    "bf16" => Dtype::BF16,
                    "f16" => Dtype::F16,
                    other => return Err(format!("unknown dtype {other:?}\n{USAGE}")),
                })
            }
            "--print-corpus" => print_corpus = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let committed = specs.is_empty();
    if committed {
        if dtype.is_some() {
            return Err(
                "--dtype applies to --spec builds only; the committed fixtures are fixed".into(),
            );
        }
        specs = FixtureSpec::committed();
    }
    if let Some(d) = dtype {
        for s in &mut specs {
            s.dtype = d;
        }
    }
    if print_corpus {
        // The tokenizer's training text, documents separated by blank lines, for inspection.
        for spec in &specs {
            for doc in fixture::corpus(spec.seed, spec.corpus_bytes) {
                println!("{doc}\n");
            }
        }
        return Ok(());
    }
    let out = out.unwrap_or_else(fixture::committed_dir);

    let mut built = Vec::new();
    for spec in &specs {
        let dir = out.join(&spec.name);
        let t = Instant::now();
        let fx = fixture::build(spec, &dir).map_err(|e| e.to_string())?;
        println!(
            "{}: {} params, {} bytes, built in {:.2}s -> {}",
            spec.name,
            fx.num_params,
            fx.total_bytes(),
            t.elapsed().as_secs_f64(),
            dir.display()
        );
        for f in &fx.files {
            println!("  {}  {:>10}  {}", f.sha256(), f.bytes.len(), f.name);
        }
        built.push(fx);
    }
    if committed {
        let readme = out.join("README.md");
        std::fs::write(&readme, fixture::committed_readme(&built))
            .map_err(|e| format!("cannot write {}: {e}", readme.display()))?;
        println!("wrote {}", readme.display());
    }
    Ok(())
}
