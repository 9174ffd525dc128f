//! The fixture generator is deterministic, and the committed fixtures are what it generates.
//!
//! If `committed_fixtures_match_a_fresh_build` fails after a change to `engine/src/fixture.rs`,
//! regenerate and commit the fixtures:
//!
//! ```text
//! cargo run --release -p tapedeck-engine --example make_fixtures
//! ```

use std::path::Path;

use tapedeck_engine::fixture::{self, Fixture, FixtureSpec, FIXTURE_FILES};

const REGENERATE: &str = "cargo run --release -p tapedeck-engine --example make_fixtures";

fn read_dir_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let entry = entry.expect("directory entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        let bytes = std::fs::read(entry.path()).expect("read file");
        out.push((name, bytes));
    }
    out.sort();
    out
}

fn generate(spec: &FixtureSpec) -> Fixture {
    fixture::generate(spec).unwrap_or_else(|e| panic!("generate {}: {e}", spec.name))
}

#[test]
fn two_builds_are_byte_identical() {
    let a = tempfile::tempdir().expect("tempdir");
    let b = tempfile::tempdir().expect("tempdir");
    for spec in FixtureSpec::committed() {
        fixture::build(&spec, &a.path().join(&spec.name)).expect("first build");
        fixture::build(&spec, &b.path().join(&spec.name)).expect("second build");
        let fa = read_dir_files(&a.path().join(&spec.name));
        let fb = read_dir_files(&b.path().join(&spec.name));
        let names: Vec<&str> = fa.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, FIXTURE_FILES, "{}: files written", spec.name);
        for ((na, ba), (nb, bb)) in fa.iter().zip(&fb) {
            assert_eq!(na, nb);
            assert!(ba == bb, "{}/{na} differs between two builds", spec.name);
        }
    }
}

#[test]
fn committed_fixtures_match_a_fresh_build() {
    let root = fixture::committed_dir();
    let mut built = Vec::new();
    for spec in FixtureSpec::committed() {
        let fresh = generate(&spec);
        let dir = root.join(&spec.name);
        let on_disk = read_dir_files(&dir);
        let names: Vec<&str> = on_disk.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            FIXTURE_FILES,
            "{} holds unexpected files; regenerate with `{REGENERATE}`",
            dir.display()
        );
        for (name, bytes) in &on_disk {
            let want = fresh.file(name).expect("generated file");
            assert!(
                *bytes == want.bytes,
                "{}/{name} differs from a fresh build (sha256 {} committed, {} generated); \
                 the generator changed: regenerate with `{REGENERATE}` and commit",
                dir.display(),
                fixture::FixtureFile {
                    name: name.clone(),
                    bytes: bytes.clone()
                }
                .sha256(),
                want.sha256()
            );
        }
        assert!(
            fresh.total_bytes() < 5 * 1024 * 1024,
            "{} is {} bytes; committed fixtures must stay under 5 MiB",
            spec.name,
            fresh.total_bytes()
        );
        built.push(fresh);
    }
    let readme =
        std::fs::read_to_string(root.join("README.md")).expect("fixtures/models/README.md");
    assert!(
        readme == fixture::committed_readme(&built),
        "fixtures/models/README.md is stale; regenerate with `{REGENERATE}`"
    );
}

/// The generated files agree with each other and with the spec: what the engine and HF rely on.
#[test]
fn files_are_consistent_with_the_spec() {
    for spec in FixtureSpec::committed() {
        let fx = generate(&spec);
        let json = |name: &str| -> serde_json::Value {
            serde_json::from_slice(&fx.file(name).expect(name).bytes).expect(name)
        };
        let config = json("config.json");
        assert_eq!(config["vocab_size"], spec.vocab_size);

        let tok = tokenizers::Tokenizer::from_bytes(&fx.file("tokenizer.json").expect("tok").bytes)
            .expect("tokenizer.json loads");
        assert_eq!(tok.get_vocab_size(true), spec.vocab_size, "{}", spec.name);
        for t in spec.added_tokens() {
            assert_eq!(
                tok.token_to_id(t.content),
                spec.added_token_id(t.content),
                "{}: {}",
                spec.name,
                t.content
            );
        }
        // Every eos id of generation_config names an added special token.
        let gen = json("generation_config.json");
        for id in gen["eos_token_id"].as_array().expect("eos list") {
            let id = id.as_u64().expect("id") as u32;
            let text = tok.id_to_token(id).expect("eos token");
            assert!(text.starts_with("<|"), "{}: eos {id} is {text}", spec.name);
        }

        // Byte-level BPE round-trips arbitrary text, chat markup included.
        let text = "fn main() {\n    println!(\"héllo — ✓\");\n}\n<think>x</think> 12345";
        let enc = tok.encode(text, false).expect("encode");
        assert_eq!(tok.decode(enc.get_ids(), false).expect("decode"), text);

        let st =
            safetensors::SafeTensors::deserialize(&fx.file("model.safetensors").expect("st").bytes)
                .expect("safetensors parses");
        let names = st.names();
        let embed = st.tensor("model.embed_tokens.weight").expect("embeddings");
        assert_eq!(embed.shape(), [spec.vocab_size, spec.hidden_size]);
        assert_eq!(
            st.tensor("lm_head.weight").is_ok(),
            !spec.tie_word_embeddings,
            "{}: lm_head presence",
            spec.name
        );
        assert_eq!(
            st.tensor("model.layers.0.self_attn.q_proj.bias").is_ok(),
            spec.arch == fixture::Arch::Qwen2
        );
        let k = st
            .tensor("model.layers.0.self_attn.k_proj.weight")
            .expect("k_proj");
        assert_eq!(
            k.shape(),
            [spec.num_kv_heads * spec.head_dim(), spec.hidden_size]
        );
        let elements: usize = names
            .iter()
            .map(|n| {
                st.tensor(n)
                    .expect("tensor")
                    .shape()
                    .iter()
                    .product::<usize>()
            })
            .sum();
        assert_eq!(elements, fx.num_params);
    }
}

/// minijinja renders the fixtures' chat templates exactly as HF transformers (jinja2) does, on the
/// conversations of `fixtures/models/chat_template_cases.json`.
#[test]
fn chat_templates_render_like_hf() {
    let path = fixture::committed_dir().join("chat_template_cases.json");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("cases file")).expect("json");
    let cases = doc["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for spec in FixtureSpec::committed() {
        let bos = spec
            .added_token_id("<|begin_of_text|>")
            .map(|_| "<|begin_of_text|>");
        // Whitespace handling must not matter: HF sets trim_blocks and lstrip_blocks, minijinja
        // defaults to neither.
        for hf_whitespace in [true, false] {
            let mut env = minijinja::Environment::new();
            env.set_syntax(
                minijinja::syntax::SyntaxConfig::builder()
                    .trim_blocks(hf_whitespace)
                    .lstrip_blocks(hf_whitespace)
                    .build()
                    .expect("syntax config"),
            );
            env.add_template("chat", spec.chat_template())
                .expect("template compiles in minijinja");
            let tmpl = env.get_template("chat").expect("template");
            for case in cases {
                let want = case["expected"][&spec.name].as_str().unwrap_or_else(|| {
                    panic!("{}: no expected render for {}", path.display(), spec.name)
                });
                let got = tmpl
                    .render(minijinja::context! {
                        messages => minijinja::value::Serde(&case["messages"]),
                        tools => minijinja::value::Serde(&case["tools"]),
                        add_generation_prompt => case["add_generation_prompt"].as_bool(),
                        bos_token => bos,
                    })
                    .unwrap_or_else(|e| panic!("{} {}: {e:#}", spec.name, case["name"]));
                assert_eq!(
                    got, want,
                    "{} case {} (trim/lstrip blocks {hf_whitespace})",
                    spec.name, case["name"]
                );
            }
        }
    }
}
