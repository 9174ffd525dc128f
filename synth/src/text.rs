//! Deterministic text: prose, Rust/Python/TypeScript source, JSON, shell output and directory
//! listings, all drawn from one ChaCha8 stream.
//!
//! The goal is prompts that look and tokenize like agent traffic (code-heavy tool results, short
//! user requests, terse reasoning) without being trivially repetitive, so prefix caches and
//! attention see realistic variety. Everything here is a pure function of the generator's state:
//! no hash-map iteration, no clock.

use rand::seq::IndexedRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The languages a synthetic project is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    /// A Cargo crate.
    Rust,
    /// A Python package with pytest.
    Python,
    /// A Node/TypeScript package.
    TypeScript,
}

impl Lang {
    fn ext(self) -> &'static str {
        match self {
            Lang::Rust => "rs",
            Lang::Python => "py",
            Lang::TypeScript => "ts",
        }
    }
}

const PROJECTS: &[&str] = &[
    "aurora", "basalt", "cinder", "dynamo", "ember", "fjord", "granite", "helix", "indigo",
    "juniper", "krypton", "lumen", "meridian", "nebula", "obsidian", "polaris", "quartz",
    "riverbed", "sequoia", "tundra", "umbra", "vortex", "willow", "zephyr",
];

const NOUNS: &[&str] = &[
    "request", "session", "token", "buffer", "config", "parser", "cache", "client", "server",
    "handler", "router", "record", "entry", "batch", "queue", "worker", "schema", "table", "index",
    "report", "metric", "stream", "event", "payload", "header", "account", "invoice", "order",
    "user", "profile", "message", "channel", "policy", "rule", "job", "task", "plan", "snapshot",
    "segment", "window", "limit", "retry", "timeout", "store", "ledger", "cursor", "filter",
];

const VERBS: &[&str] = &[
    "parse",
    "load",
    "store",
    "fetch",
    "build",
    "render",
    "apply",
    "merge",
    "split",
    "validate",
    "resolve",
    "encode",
    "decode",
    "flush",
    "drain",
    "collect",
    "compute",
    "update",
    "insert",
    "remove",
    "normalize",
    "register",
    "dispatch",
    "schedule",
    "retry",
    "compare",
    "measure",
];

const ADJS: &[&str] = &[
    "pending", "active", "stale", "empty", "partial", "cached", "raw", "sorted", "unique",
    "default", "current", "next", "last", "total", "max", "min", "local", "remote", "shared",
];

const PROSE_SUBJECTS: &[&str] = &[
    "The retry loop",
    "This function",
    "The cache layer",
    "Our CI job",
    "The parser",
    "The new flag",
    "That test",
    "The migration",
    "The handler",
    "The config loader",
    "This module",
    "The background worker",
];

const PROSE_PREDICATES: &[&str] = &[
    "fails when the input is empty",
    "keeps a reference to the old buffer",
    "should not block the request path",
    "was written before we moved to async",
    "returns early on the first error",
    "needs a clearer error message",
    "reads the file twice",
    "is only exercised by the integration tests",
    "holds the lock longer than it needs to",
    "silently drops the last entry",
    "depends on the order of the map",
    "was flaky on the Windows runner",
    "times out under load",
    "ignores the timeout setting",
    "logs at the wrong level",
];

const PROSE_TAILS: &[&str] = &[
    "so we should fix it before the release.",
    "which is why the numbers looked off last week.",
    "and nobody noticed until the nightly run.",
    "but only with the default settings.",
    "according to the last review.",
    "when the batch size is larger than one.",
    "after the refactor in the previous sprint.",
    "unless the cache is warm.",
];

/// A synthetic repository: the working directory and files an agent session talks about.
#[derive(Debug, Clone)]
pub struct Project {
    /// Project name (also the directory name).
    pub name: String,
    /// Source language.
    pub lang: Lang,
    /// Absolute working directory.
    pub root: String,
    /// Source files, relative to `root`.
    pub files: Vec<String>,
    /// Identifier stems used in code (module and type names).
    pub stems: Vec<String>,
}

/// A deterministic text source over one ChaCha8 stream.
pub struct TextGen {
    /// The stream. Public so the session builder draws from the same sequence.
    pub rng: ChaCha8Rng,
}

fn pick<'a>(rng: &mut ChaCha8Rng, list: &'a [&'a str]) -> &'a str {
    list.choose(rng).copied().unwrap_or("x")
}

fn camel(s: &str) -> String {
    s.split('_')
        .map(|w| {
            let mut c = w.chars();
            match c.next() {
                Some(f) => f.to_uppercase().chain(c).collect(),
                None => String::new(),
            }
        })
        .collect()
}

fn lower_camel(s: &str) -> String {
    let c = camel(s);
    let mut it = c.chars();
    match it.next() {
        Some(f) => f.to_lowercase().chain(it).collect(),
        None => String::new(),
    }
}

impl TextGen {
    /// A generator over `rng`.
    pub fn new(rng: ChaCha8Rng) -> Self {
        TextGen { rng }
    }

    /// A word from a list.
    pub fn pick(&mut self, list: &[&str]) -> String {
        pick(&mut self.rng, list).to_string()
    }

    /// A noun, for identifiers and prose.
    pub fn noun(&mut self) -> String {
        self.pick(NOUNS)
    }

    /// A verb, for identifiers and prose.
    pub fn verb(&mut self) -> String {
        self.pick(VERBS)
    }

    /// A snake_case identifier such as `load_pending_cache`.
    pub fn ident(&mut self) -> String {
        match self.rng.random_range(0..3) {
            0 => format!("{}_{}", self.verb(), self.noun()),
            1 => format!("{}_{}_{}", self.verb(), self.pick(ADJS), self.noun()),
            _ => format!("{}_{}", self.pick(ADJS), self.noun()),
        }
    }

    /// A synthetic project: name, language, working directory and file list.
    pub fn project(&mut self) -> Project {
        let name = self.pick(PROJECTS);
        let lang = match self.rng.random_range(0..3) {
            0 => Lang::Rust,
            1 => Lang::Python,
            _ => Lang::TypeScript,
        };
        let mut stems: Vec<String> = Vec::new();
        while stems.len() < 6 {
            let s = self.noun();
            if !stems.contains(&s) {
                stems.push(s);
            }
        }
        let files = match lang {
            Lang::Rust => {
                let mut f = vec![
                    "Cargo.toml".to_string(),
                    "src/main.rs".into(),
                    "src/lib.rs".into(),
                ];
                f.extend(stems.iter().map(|s| format!("src/{s}.rs")));
                f.push(format!("tests/{}.rs", stems[0]));
                f
            }
            Lang::Python => {
                let mut f = vec!["pyproject.toml".to_string(), format!("{name}/__init__.py")];
                f.extend(stems.iter().map(|s| format!("{name}/{s}.py")));
                f.push(format!("tests/test_{}.py", stems[0]));
                f
            }
            Lang::TypeScript => {
                let mut f = vec![
                    "package.json".to_string(),
                    "tsconfig.json".into(),
                    "src/index.ts".into(),
                ];
                f.extend(stems.iter().map(|s| format!("src/{s}.ts")));
                f.push(format!("test/{}.test.ts", stems[0]));
                f
            }
        };
        Project {
            root: format!("/home/dev/{name}"),
            name,
            lang,
            files,
            stems,
        }
    }

    /// A source file of the project's language (one of its `files` that holds code).
    pub fn source_file(&mut self, p: &Project) -> String {
        let ext = p.lang.ext();
        let code: Vec<&String> = p.files.iter().filter(|f| f.ends_with(ext)).collect();
        code.choose(&mut self.rng)
            .map(|s| s.to_string())
            .unwrap_or_else(|| format!("src/main.{ext}"))
    }

    /// One sentence of engineering prose.
    pub fn sentence(&mut self) -> String {
        match self.rng.random_range(0..4) {
            0 => format!(
                "{} {} {}",
                self.pick(PROSE_SUBJECTS),
                self.pick(PROSE_PREDICATES),
                self.pick(PROSE_TAILS)
            ),
            1 => format!(
                "I think `{}` {}.",
                self.ident(),
                self.pick(PROSE_PREDICATES)
            ),
            2 => format!(
                "We call `{}` from `{}` {}",
                self.ident(),
                self.ident(),
                self.pick(PROSE_TAILS)
            ),
            _ => format!(
                "{} {}, {}",
                self.pick(PROSE_SUBJECTS),
                self.pick(PROSE_PREDICATES),
                self.pick(PROSE_TAILS)
            ),
        }
    }

    /// `n` sentences joined into a paragraph.
    pub fn paragraph(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| self.sentence())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Source code of about `lines` lines in the project's language.
    pub fn code(&mut self, lang: Lang, lines: usize) -> Vec<String> {
        let mut out = Vec::new();
        match lang {
            Lang::Rust => {
                out.push("use std::collections::BTreeMap;".to_string());
                out.push("use std::path::Path;".to_string());
                out.push(String::new());
            }
            Lang::Python => {
                out.push("from __future__ import annotations".to_string());
                out.push(String::new());
                out.push("import json".to_string());
                out.push("from dataclasses import dataclass".to_string());
                out.push(String::new());
            }
            Lang::TypeScript => {
                out.push("import { readFile } from \"node:fs/promises\";".to_string());
                out.push(format!(
                    "import type {{ {} }} from \"./{}\";",
                    camel(&self.noun()),
                    self.noun()
                ));
                out.push(String::new());
            }
        }
        while out.len() < lines {
            let block = match lang {
                Lang::Rust => self.rust_item(),
                Lang::Python => self.python_item(),
                Lang::TypeScript => self.ts_item(),
            };
            out.extend(block);
            out.push(String::new());
        }
        out.truncate(lines.max(1));
        out
    }

    fn rust_item(&mut self) -> Vec<String> {
        let name = self.ident();
        let ty = camel(&self.noun());
        let arg = self.noun();
        let field = self.ident();
        match self.rng.random_range(0..3) {
            0 => vec![
                format!("/// {}", self.sentence()),
                "#[derive(Debug, Clone, PartialEq)]".into(),
                format!("pub struct {ty} {{"),
                format!("    pub {field}: Vec<u32>,"),
                format!("    pub {}: Option<String>,", self.noun()),
                format!("    {}: usize,", self.ident()),
                "}".into(),
            ],
            1 => vec![
                format!("pub fn {name}({arg}: &{ty}, limit: usize) -> Result<usize, Error> {{"),
                format!("    let mut {} = BTreeMap::new();", self.noun()),
                format!("    for (i, item) in {arg}.{field}.iter().enumerate() {{"),
                "        if i >= limit {".into(),
                format!(
                    "            return Err(Error::{}(i));",
                    camel(&self.ident())
                ),
                "        }".into(),
                format!("        {}.insert(*item, i);", self.noun()),
                "    }".into(),
                format!("    Ok({arg}.{field}.len())"),
                "}".into(),
            ],
            _ => vec![
                format!("impl {ty} {{"),
                format!("    /// {}", self.sentence()),
                format!("    pub fn {name}(&mut self, path: &Path) -> std::io::Result<()> {{"),
                "        let text = std::fs::read_to_string(path)?;".into(),
                format!(
                    "        self.{field} = text.lines().filter_map(|l| l.parse().ok()).collect();"
                ),
                "        Ok(())".into(),
                "    }".into(),
                "}".into(),
            ],
        }
    }

    fn python_item(&mut self) -> Vec<String> {
        let name = self.ident();
        let ty = camel(&self.noun());
        let arg = self.noun();
        let field = self.ident();
        match self.rng.random_range(0..3) {
            0 => vec![
                "@dataclass".into(),
                format!("class {ty}:"),
                format!("    \"\"\"{}\"\"\"", self.sentence()),
                String::new(),
                format!("    {field}: list[int]"),
                format!("    {}: str | None = None", self.noun()),
            ],
            1 => vec![
                format!("def {name}({arg}: {ty}, limit: int = 100) -> int:"),
                format!("    {} = {{}}", self.noun()),
                format!("    for i, item in enumerate({arg}.{field}):"),
                "        if i >= limit:".into(),
                format!(
                    "            raise ValueError(f\"{} overflow at {{i}}\")",
                    self.noun()
                ),
                format!("        {}[item] = i", self.noun()),
                format!("    return len({arg}.{field})"),
            ],
            _ => vec![
                format!("def {name}(path: str) -> dict:"),
                format!("    \"\"\"{}\"\"\"", self.sentence()),
                "    with open(path, encoding=\"utf-8\") as fh:".into(),
                "        data = json.load(fh)".into(),
                format!("    return {{k: v for k, v in data.items() if k != \"{field}\"}}"),
            ],
        }
    }

    fn ts_item(&mut self) -> Vec<String> {
        let name = lower_camel(&self.ident());
        let ty = camel(&self.noun());
        let arg = lower_camel(&self.noun());
        let field = lower_camel(&self.ident());
        match self.rng.random_range(0..3) {
            0 => vec![
                format!("/** {} */", self.sentence()),
                format!("export interface {ty} {{"),
                format!("  {field}: number[];"),
                format!("  {}?: string;", lower_camel(&self.noun())),
                "}".into(),
            ],
            1 => vec![
                format!("export function {name}({arg}: {ty}, limit = 100): number {{"),
                format!("  const seen = new Map<number, number>();"),
                format!("  {arg}.{field}.forEach((item, i) => {{"),
                "    if (i >= limit) {".into(),
                format!(
                    "      throw new Error(`{} overflow at ${{i}}`);",
                    self.noun()
                ),
                "    }".into(),
                "    seen.set(item, i);".into(),
                "  });".into(),
                format!("  return {arg}.{field}.length;"),
                "}".into(),
            ],
            _ => vec![
                format!("export async function {name}(path: string): Promise<{ty}> {{"),
                "  const text = await readFile(path, \"utf8\");".into(),
                format!("  const parsed = JSON.parse(text) as {ty};"),
                format!("  return {{ ...parsed, {field}: parsed.{field} ?? [] }};"),
                "}".into(),
            ],
        }
    }

    /// A file as opencode's `read` tool returns it: `<file>`, zero-padded line numbers, a footer.
    pub fn numbered_file(lines: &[String], first: usize) -> String {
        let mut out = String::from("<file>\n");
        for (i, l) in lines.iter().enumerate() {
            out.push_str(&format!("{:05}| {l}\n", first + i));
        }
        out.push_str(&format!(
            "\n(End of file - total {} lines)\n</file>",
            first + lines.len() - 1
        ));
        out
    }

    /// The output of the project's test command, passing or with one failure.
    pub fn test_output(&mut self, p: &Project, fail: bool) -> String {
        let n = self.rng.random_range(4..14);
        let names: Vec<String> = (0..n).map(|_| self.ident()).collect();
        let mut out = String::new();
        match p.lang {
            Lang::Rust => {
                out.push_str(&format!(
                    "   Compiling {} v0.{}.{} ({})\n    Finished `test` profile [unoptimized + debuginfo] target(s) in {}.{:02}s\n     Running unittests src/lib.rs (target/debug/deps/{}-{:016x})\n\nrunning {n} tests\n",
                    p.name,
                    self.rng.random_range(1..9),
                    self.rng.random_range(0..20),
                    p.root,
                    self.rng.random_range(1..40),
                    self.rng.random_range(0..100),
                    p.name,
                    self.rng.random::<u64>()
                ));
                for (i, t) in names.iter().enumerate() {
                    let bad = fail && i == n / 2;
                    out.push_str(&format!(
                        "test {}::tests::{t} ... {}\n",
                        p.stems[i % p.stems.len()],
                        if bad { "FAILED" } else { "ok" }
                    ));
                }
                if fail {
                    let t = &names[n / 2];
                    out.push_str(&format!(
                        "\nfailures:\n\n---- tests::{t} stdout ----\nthread 'tests::{t}' panicked at src/{}.rs:{}:{}:\nassertion `left == right` failed\n  left: {}\n right: {}\n\nfailures:\n    tests::{t}\n\ntest result: FAILED. {} passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n",
                        p.stems[0],
                        self.rng.random_range(20..400),
                        self.rng.random_range(5..40),
                        self.rng.random_range(0..100),
                        self.rng.random_range(100..200),
                        n - 1
                    ));
                } else {
                    out.push_str(&format!(
                        "\ntest result: ok. {n} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.{:02}s\n",
                        self.rng.random_range(0..100)
                    ));
                }
            }
            Lang::Python => {
                out.push_str(&format!(
                    "============================= test session starts ==============================\nplatform linux -- Python 3.12.{}, pytest-8.3.{}, pluggy-1.5.0\nrootdir: {}\nconfigfile: pyproject.toml\ncollected {n} items\n\n",
                    self.rng.random_range(0..9),
                    self.rng.random_range(0..5),
                    p.root
                ));
                let dots: String = (0..n)
                    .map(|i| if fail && i == n / 2 { 'F' } else { '.' })
                    .collect();
                out.push_str(&format!("tests/test_{}.py {dots} [100%]\n", p.stems[0]));
                if fail {
                    let t = &names[n / 2];
                    out.push_str(&format!(
                        "\n=================================== FAILURES ===================================\n___________________________________ test_{t} ___________________________________\n\n    def test_{t}():\n>       assert {}(\"{}\") == {}\nE       AssertionError: assert {} == {}\n\ntests/test_{}.py:{}: AssertionError\n=========================== short test summary info ============================\nFAILED tests/test_{}.py::test_{t} - AssertionError\n========================= 1 failed, {} passed in 0.{:02}s =========================\n",
                        self.ident(),
                        self.noun(),
                        self.rng.random_range(0..50),
                        self.rng.random_range(50..99),
                        self.rng.random_range(0..50),
                        p.stems[0],
                        self.rng.random_range(10..300),
                        p.stems[0],
                        n - 1,
                        self.rng.random_range(10..99)
                    ));
                } else {
                    out.push_str(&format!(
                        "\n============================== {n} passed in 0.{:02}s ===============================\n",
                        self.rng.random_range(10..99)
                    ));
                }
            }
            Lang::TypeScript => {
                out.push_str(&format!(
                    "\n> {}@0.{}.0 test\n> vitest run\n\n RUN  v2.1.{} {}\n\n",
                    p.name,
                    self.rng.random_range(1..9),
                    self.rng.random_range(0..9),
                    p.root
                ));
                for (i, t) in names.iter().enumerate() {
                    let bad = fail && i == n / 2;
                    out.push_str(&format!(
                        " {} test/{}.test.ts > {} > {}\n",
                        if bad { "×" } else { "✓" },
                        p.stems[0],
                        p.stems[i % p.stems.len()],
                        t.replace('_', " ")
                    ));
                }
                out.push_str(&format!(
                    "\n Test Files  {} (1)\n      Tests  {}{n} total\n   Duration  {}.{:02}s\n",
                    if fail { "1 failed" } else { "1 passed" },
                    if fail {
                        format!("1 failed | {} passed | ", n - 1)
                    } else {
                        format!("{n} passed | ")
                    },
                    self.rng.random_range(0..4),
                    self.rng.random_range(0..100)
                ));
            }
        }
        out
    }

    /// `git status` / `git log` style output.
    pub fn git_output(&mut self, p: &Project) -> String {
        if self.rng.random_bool(0.5) {
            let mut out = String::from(
                "On branch main\nYour branch is up to date with 'origin/main'.\n\nChanges not staged for commit:\n  (use \"git add <file>...\" to update what will be committed)\n",
            );
            let k = self.rng.random_range(1..4);
            for _ in 0..k {
                let f = self.source_file(p);
                out.push_str(&format!("\tmodified:   {f}\n"));
            }
            out.push_str(
                "\nno changes added to commit (use \"git add\" and/or \"git commit -a\")\n",
            );
            out
        } else {
            let mut out = String::new();
            for _ in 0..self.rng.random_range(3..8) {
                out.push_str(&format!(
                    "{:07x} {} {} in {}\n",
                    self.rng.random::<u32>() & 0x0fff_ffff,
                    camel(&self.verb()),
                    self.pick(ADJS),
                    self.noun()
                ));
            }
            out
        }
    }

    /// opencode's `list` tool output: an indented tree under the working directory.
    pub fn listing(p: &Project) -> String {
        let mut out = format!("{}/\n", p.root);
        let mut dirs: Vec<&str> = Vec::new();
        for f in &p.files {
            match f.rsplit_once('/') {
                None => out.push_str(&format!("  {f}\n")),
                Some((d, _)) => {
                    if !dirs.contains(&d) {
                        dirs.push(d);
                    }
                }
            }
        }
        for d in dirs {
            out.push_str(&format!("  {d}/\n"));
            for f in p
                .files
                .iter()
                .filter(|f| f.rsplit_once('/').map(|x| x.0) == Some(d))
            {
                let base = f.rsplit_once('/').map_or(f.as_str(), |x| x.1);
                out.push_str(&format!("    {base}\n"));
            }
        }
        out
    }

    /// opencode's `grep` tool output for `pattern` over the project.
    pub fn grep_output(&mut self, p: &Project, pattern: &str) -> String {
        let k = self.rng.random_range(1..6);
        let mut out = format!("Found {k} matches\n");
        for _ in 0..k {
            let f = self.source_file(p);
            out.push_str(&format!(
                "{}/{f}:\n  Line {}: {}({});\n",
                p.root,
                self.rng.random_range(3..400),
                pattern,
                self.noun()
            ));
        }
        out
    }

    /// A JSON config document (package manifest or settings), pretty-printed.
    pub fn json_doc(&mut self, p: &Project) -> String {
        let mut deps = serde_json::Map::new();
        for _ in 0..self.rng.random_range(2..6) {
            deps.insert(
                format!("{}-{}", self.noun(), self.pick(ADJS)),
                serde_json::Value::String(format!(
                    "^{}.{}.{}",
                    self.rng.random_range(0..9),
                    self.rng.random_range(0..30),
                    self.rng.random_range(0..12)
                )),
            );
        }
        let v = serde_json::json!({
            "name": p.name,
            "version": format!("0.{}.{}", self.rng.random_range(1..9), self.rng.random_range(0..20)),
            "private": true,
            "scripts": { "build": "tsc -p .", "test": "vitest run", "lint": "eslint src" },
            "dependencies": deps,
            format!("{}Timeout", lower_camel(&self.noun())): self.rng.random_range(100..30000),
        });
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn same_seed_same_text() {
        let mut a = TextGen::new(ChaCha8Rng::seed_from_u64(7));
        let mut b = TextGen::new(ChaCha8Rng::seed_from_u64(7));
        let pa = a.project();
        let pb = b.project();
        assert_eq!(pa.files, pb.files);
        assert_eq!(a.code(pa.lang, 40), b.code(pb.lang, 40));
        assert_eq!(a.test_output(&pa, true), b.test_output(&pb, true));
    }

    #[test]
    fn numbered_file_looks_like_opencode_read() {
        let f = TextGen::numbered_file(&["fn main() {".into(), "}".into()], 12);
        assert!(f.contains("00012| fn main() {\n00013| }\n"));
        assert!(f.ends_with("(End of file - total 13 lines)\n</file>"));
    }
}
