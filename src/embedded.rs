//! The fixture models compiled into the binary, so `tapedeck demo` and `tapedeck generate` work on
//! a fresh machine with nothing downloaded.
//!
//! An embedded model is written once to a cache directory named by its content hash and then
//! loaded like any other model directory: there is one loading path, and the engine never knows
//! the difference.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use tapedeck_engine::fixture::{self, FixtureSpec};

/// The model used when none is named.
pub const DEFAULT_MODEL: &str = "tiny-qwen2";

type Files = &'static [(&'static str, &'static [u8])];

macro_rules! model_files {
    ($dir:literal) => {
        &[
            (
                "config.json",
                include_bytes!(concat!("../fixtures/models/", $dir, "/config.json")),
            ),
            (
                "generation_config.json",
                include_bytes!(concat!(
                    "../fixtures/models/",
                    $dir,
                    "/generation_config.json"
                )),
            ),
            (
                "model.safetensors",
                include_bytes!(concat!("../fixtures/models/", $dir, "/model.safetensors")),
            ),
            (
                "tokenizer.json",
                include_bytes!(concat!("../fixtures/models/", $dir, "/tokenizer.json")),
            ),
            (
                "tokenizer_config.json",
                include_bytes!(concat!(
                    "../fixtures/models/",
                    $dir,
                    "/tokenizer_config.json"
                )),
            ),
        ]
    };
}

/// Embedded models by name.
const MODELS: &[(&str, Files)] = &[
    ("tiny-qwen2", model_files!("tiny-qwen2")),
    ("tiny-llama", model_files!("tiny-llama")),
];

fn files(name: &str) -> Option<Files> {
    MODELS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// Names of the embedded models.
pub fn names() -> Vec<&'static str> {
    MODELS.iter().map(|(n, _)| *n).collect()
}

/// Writes an embedded model's files into `out` (created if missing).
pub fn write_to(name: &str, out: &Path) -> Result<()> {
    let Some(files) = files(name) else {
        bail!(
            "no embedded model {name:?} (embedded: {})",
            names().join(", ")
        );
    };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for (file, bytes) in files {
        let p = out.join(file);
        std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// Where tapedeck keeps generated files (`$XDG_CACHE_HOME/tapedeck`, else `~/.cache/tapedeck`).
pub fn cache_root() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("tapedeck");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h).join(".cache").join("tapedeck");
    }
    std::env::temp_dir().join("tapedeck-cache")
}

/// Benchmark models generated on first use rather than embedded (a real model's shapes, random
/// weights, a trained tokenizer; llama-1b is 2.5 GB): every command takes them by name, as
/// `bench engine` always did.
pub const GENERATED: [&str; 2] = ["llama-120m", "llama-1b"];

/// A model directory for `spec`: an existing directory as given, else an embedded model written
/// (once) to the cache, else a generated benchmark model built (once) into the cache.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    let p = Path::new(spec);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    if let (true, Some(fs)) = (GENERATED.contains(&spec), FixtureSpec::by_name(spec)) {
        return generated(spec, &fs);
    }
    let Some(files) = files(spec) else {
        bail!(
            "{spec:?} is neither a model directory nor an embedded model (embedded: {}; \
             generated on first use: {})",
            names().join(", "),
            GENERATED.join(", ")
        );
    };
    let mut h = Sha256::new();
    for (file, bytes) in files {
        h.update(file.as_bytes());
        h.update(bytes);
    }
    let hash = hex::encode(h.finalize());
    let dir = cache_root()
        .join("models")
        .join(format!("{spec}-{}", &hash[..12]));
    install(&dir, ".complete", |tmp| {
        write_to(spec, tmp)?;
        std::fs::write(tmp.join(".complete"), b"")?;
        Ok(())
    })
}

/// The generated benchmark model `spec` in the cache, built there first if missing.
fn generated(spec: &str, fs: &FixtureSpec) -> Result<PathBuf> {
    let dir = cache_root().join("bench").join(spec);
    install(&dir, "config.json", |tmp| {
        eprintln!(
            "generating the {spec} benchmark model into {} ...",
            dir.display()
        );
        fixture::build(fs, tmp)
            .map(|_| ())
            .with_context(|| format!("building {spec} into {}", tmp.display()))
    })
}

/// `dir`, built first by `build` unless `dir/marker` shows it complete. `build` writes into a
/// private directory that is then renamed into place, so that a concurrent or interrupted run
/// never sees a half-written model.
fn install(dir: &Path, marker: &str, build: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    if dir.join(marker).exists() {
        return Ok(dir.to_path_buf());
    }
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    build(&tmp)?;
    if let Err(e) = std::fs::rename(&tmp, dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join(marker).exists() {
            return Err(e).with_context(|| format!("installing model into {}", dir.display()));
        }
    }
    Ok(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    /// A user who mistypes a model name learns every name that would have worked, generated
    /// benchmark models included.
    #[test]
    fn an_unknown_model_lists_the_embedded_and_generated_names() {
        let err = super::resolve("no-such-model-here")
            .unwrap_err()
            .to_string();
        for name in super::names().iter().chain(super::GENERATED.iter()) {
            assert!(err.contains(name), "{name} missing from: {err}");
        }
    }
}
